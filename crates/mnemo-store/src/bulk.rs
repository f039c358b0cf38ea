//! Bulk loads and whole-database maintenance, for the benchmarks and for operators loading data
//! by hand. Nothing here is on the API's or the worker's path: a bulk load writes rows without
//! their embed jobs (the rows come with their vectors, or are marked embedded), so it is not the
//! write path and keeps none of its guarantees beyond the schema's constraints.
//!
//! The benchmarks' reads of whole tables (sizes, embedding lags, superseded rows) live here too,
//! so that no SQL is written outside this crate.

use chrono::{DateTime, Utc};
use mnemo_core::{AgentId, MemoryText, Scope, SessionId, SourceKind, SourceRef, TenantId, UserId};
use pgvector::Vector;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

use crate::{Store, StoreError};

/// The full-text (RUM) index the migrations create.
const FULLTEXT_INDEX: &str = "memory_items_tsv_idx";

/// One row for [`Store::bulk_load`].
#[derive(Debug, Clone)]
pub struct BulkRow {
    pub id: Uuid,
    pub tenant: TenantId,
    pub scope: Scope,
    pub session: Option<SessionId>,
    pub user: Option<UserId>,
    pub agent: Option<AgentId>,
    pub kind: SourceKind,
    pub source_ref: SourceRef,
    pub content: MemoryText,
    /// Its event and creation time; `None` is the load's transaction time.
    pub created_at: Option<DateTime<Utc>>,
    /// Soft-deleted at this time, if set.
    pub deleted_at: Option<DateTime<Utc>>,
    /// Its vector of the load's model, if it has one.
    pub vector: Option<Vec<f32>>,
}

/// An index dropped by [`Store::drop_fulltext_index`], with the definition it had, to be built
/// again by [`Store::rebuild_index`].
#[derive(Debug)]
pub struct DroppedIndex {
    name: String,
    definition: String,
}

impl DroppedIndex {
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// How much room the memory tables and their indexes take.
#[derive(Debug, Clone, Copy)]
pub struct Footprint {
    pub memory_rows: i64,
    /// `memory_items` with its indexes and TOAST.
    pub memory_items_bytes: i64,
    /// `memory_embeddings` with its indexes (the HNSW ones included) and TOAST.
    pub memory_embeddings_bytes: i64,
    pub fulltext_index_bytes: i64,
    /// The model's HNSW index, if it has one.
    pub vector_index_bytes: Option<i64>,
}

impl Store {
    /// Inserts `rows` and their vectors of `model` in one transaction. Every row is marked as
    /// embedded by `model` (a bulk load queues no embed jobs), and its content hash is computed
    /// here from its content. A row whose key exists already fails the whole load.
    pub async fn bulk_load(&self, model: &str, rows: &[BulkRow]) -> Result<(), StoreError> {
        fn column<'a, T: ?Sized + 'a>(
            rows: &'a [BulkRow],
            f: impl Fn(&'a BulkRow) -> Option<&'a T>,
        ) -> Vec<Option<&'a T>> {
            rows.iter().map(f).collect()
        }
        let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
        let tenants = column(rows, |r| Some(r.tenant.as_str()));
        let scopes = column(rows, |r| Some(r.scope.as_str()));
        let sessions = column(rows, |r| r.session.as_ref().map(SessionId::as_str));
        let users = column(rows, |r| r.user.as_ref().map(UserId::as_str));
        let agents = column(rows, |r| r.agent.as_ref().map(AgentId::as_str));
        let kinds = column(rows, |r| Some(r.kind.as_str()));
        let refs = column(rows, |r| Some(r.source_ref.as_str()));
        let contents = column(rows, |r| Some(r.content.as_str()));
        let created: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.created_at).collect();
        let deleted: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.deleted_at).collect();
        let (vector_keys, vectors): (Vec<(&str, Uuid)>, Vec<Vector>) =
            rows.iter().filter_map(|r| Some(((r.tenant.as_str(), r.id), Vector::from(r.vector.clone()?)))).unzip();
        let (vector_tenants, vector_ids): (Vec<&str>, Vec<Uuid>) = vector_keys.into_iter().unzip();

        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO memory_items (id, tenant_id, scope, session_id, user_id, agent_id, source_kind, source_ref,
                                       content, content_sha256, event_time, created_at, deleted_at, embedded_model,
                                       visibility)
             SELECT id, tenant, scope, session, usr, agent, kind, ref, content, sha256(convert_to(content, 'UTF8')),
                    COALESCE(created, now()), COALESCE(created, now()), deleted, $12,
                    -- What each scope's class allows (Visibility::default_for).
                    CASE scope WHEN 'agent' THEN 'agent' WHEN 'tenant' THEN 'tenant' ELSE 'private' END
             FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                         $8::text[], $9::text[], $10::timestamptz[], $11::timestamptz[])
                  AS r(id, tenant, scope, session, usr, agent, kind, ref, content, created, deleted)",
        )
        .bind(&ids)
        .bind(&tenants)
        .bind(&scopes)
        .bind(&sessions)
        .bind(&users)
        .bind(&agents)
        .bind(&kinds)
        .bind(&refs)
        .bind(&contents)
        .bind(&created)
        .bind(&deleted)
        .bind(model)
        .execute(&mut *tx)
        .await?;
        if !vector_ids.is_empty() {
            sqlx::query(
                // By the whole key: on the id alone the join read every row of the table, so a
                // load's statements grew slower with the table.
                // Made of nothing but the given vector: no previous turn.
                "INSERT INTO memory_embeddings (tenant_id, item_id, model, embedding, content_sha256, previous_id)
                 SELECT m.tenant_id, m.id, $4, v.embedding, m.content_sha256, NULL
                 FROM unnest($1::text[], $2::uuid[], $3::vector[]) AS v(tenant, id, embedding)
                 JOIN memory_items m ON m.tenant_id = v.tenant AND m.id = v.id",
            )
            .bind(&vector_tenants)
            .bind(&vector_ids)
            .bind(&vectors)
            .bind(model)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Drops the full-text index, keeping its definition as the migrations left it, so a large
    /// load does not update it row by row; one build afterwards is far faster.
    pub async fn drop_fulltext_index(&self) -> Result<DroppedIndex, StoreError> {
        // The live definition, not a copy of the migration's text: it stays right whatever later
        // migrations change.
        let definition: String = sqlx::query_scalar(
            "SELECT pg_get_indexdef(c.oid) FROM pg_class c
             WHERE c.relname = $1 AND c.relnamespace = current_schema()::regnamespace",
        )
        .bind(FULLTEXT_INDEX)
        .fetch_one(&self.pool)
        .await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP INDEX {FULLTEXT_INDEX}"))).execute(&self.pool).await?;
        Ok(DroppedIndex { name: FULLTEXT_INDEX.to_owned(), definition })
    }

    /// Builds a dropped index again, as it was defined.
    pub async fn rebuild_index(&self, index: DroppedIndex) -> Result<(), StoreError> {
        sqlx::raw_sql(sqlx::AssertSqlSafe(index.definition)).execute(&self.pool).await?;
        Ok(())
    }

    /// Sets `maintenance_work_mem` for this database's future connections (index builds use it;
    /// an HNSW build of a million vectors wants about 2 GB to stay in memory). Open connections
    /// keep their value: connect anew to use it.
    pub async fn set_maintenance_work_mem(&self, mebibytes: u32) -> Result<(), StoreError> {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DO $$ BEGIN
                EXECUTE format('ALTER DATABASE %I SET maintenance_work_mem = ''{mebibytes}MB''', current_database());
            END $$"
        )))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Refreshes the planner's statistics of `memory_items`, which recall's list of common
    /// lexemes is read from.
    pub async fn analyze_memories(&self) -> Result<(), StoreError> {
        sqlx::query("ANALYZE memory_items").execute(&self.pool).await?;
        Ok(())
    }

    /// Counts every tenant's lexemes again from its rows (migration 032), which a bulk load does
    /// not: keyword search weighs words by them.
    pub async fn count_lexemes(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT mnemo_count_tenant_text(t.tenant_id) FROM (SELECT DISTINCT tenant_id FROM memory_items) t")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// VACUUM ANALYZE of `memory_items` and `memory_embeddings`, as autovacuum would do after a
    /// bulk load.
    pub async fn vacuum_analyze_memories(&self) -> Result<(), StoreError> {
        // One statement each: VACUUM cannot run inside the transaction a multi-statement string gets.
        sqlx::query("VACUUM ANALYZE memory_items").execute(&self.pool).await?;
        sqlx::query("VACUUM ANALYZE memory_embeddings").execute(&self.pool).await?;
        Ok(())
    }

    /// Rows and on-disk sizes of the memory tables, the full-text index and `model`'s HNSW index.
    pub async fn footprint(&self, model: &str, dimensions: usize) -> Result<Footprint, StoreError> {
        let (memory_rows, memory_items_bytes, memory_embeddings_bytes, fulltext_index_bytes): (i64, i64, i64, i64) =
            sqlx::query_as(
                "SELECT (SELECT count(*) FROM memory_items), pg_total_relation_size('memory_items'),
                        (SELECT sum(pg_total_relation_size(relid))::bigint FROM pg_partition_tree('memory_embeddings')),
                        pg_relation_size($1::regclass)",
            )
            .bind(FULLTEXT_INDEX)
            .fetch_one(&self.pool)
            .await?;
        // The partitions' indexes hold it; none when the index is not there.
        let vector_index_bytes: Option<i64> = sqlx::query_scalar(
            "SELECT sum(pg_relation_size(t.relid))::bigint FROM pg_class c, pg_partition_tree(c.oid) t
             WHERE c.relname = $1 AND c.relnamespace = current_schema()::regnamespace",
        )
        .bind(crate::search::vector_index_name(model, dimensions))
        .fetch_one(&self.pool)
        .await?;
        Ok(Footprint {
            memory_rows,
            memory_items_bytes,
            memory_embeddings_bytes,
            fulltext_index_bytes,
            vector_index_bytes,
        })
    }

    /// Seconds from each live row's creation to its vector, over every vector of every model but
    /// those made again because a message between the row and the turn it was embedded with was
    /// deleted (their lag would count from the row's write, not from the deletion). A vector
    /// made with no turn counts as made after every deletion before its row: with messages
    /// embedded alone, the rows after the first deletion are left out.
    pub async fn embed_lag_seconds(&self) -> Result<Vec<f64>, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT extract(epoch FROM e.embedded_at - m.created_at)::float8
             FROM memory_items m JOIN memory_embeddings e ON e.tenant_id = m.tenant_id AND e.item_id = m.id
             LEFT JOIN memory_items p ON p.tenant_id = e.tenant_id AND p.id = e.previous_id
             WHERE m.deleted_at IS NULL AND NOT EXISTS (
                 SELECT 1 FROM memory_items d
                 WHERE d.tenant_id = m.tenant_id AND d.session_id = m.session_id AND d.deleted_at IS NOT NULL
                   AND (d.event_time, d.id) < (m.event_time, m.id)
                   AND (p.id IS NULL OR (d.event_time, d.id) > (p.event_time, p.id)))",
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// Every row some other row superseded, in every tenant.
    pub async fn superseded_ids(&self) -> Result<Vec<Uuid>, StoreError> {
        Ok(sqlx::query_scalar("SELECT id FROM memory_items WHERE superseded_by IS NOT NULL")
            .fetch_all(&self.pool)
            .await?)
    }

    /// Sets a tenant's retention settings (the `memory_retention` object of its configuration,
    /// read by [`Store::retention_policy`]), replacing any it had.
    pub async fn set_retention_settings(
        &self,
        tenant: &TenantId,
        memory_retention: &serde_json::Value,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO tenant_config (tenant_id, settings)
             VALUES ($1, jsonb_build_object('memory_retention', $2::jsonb))
             ON CONFLICT (tenant_id) DO UPDATE
             SET settings = tenant_config.settings || EXCLUDED.settings, updated_at = now()",
        )
        .bind(tenant.as_str())
        .bind(memory_retention)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

/// The writes benchmark's baseline: a bare table of three columns beside mnemo's, written one
/// row per transaction on a pool of its own, to show what the same server does without mnemo.
#[derive(Debug, Clone)]
pub struct PlainInserts {
    pool: PgPool,
}

impl PlainInserts {
    /// Connects to the database at `url` and creates the table there.
    pub async fn create(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new().max_connections(max_connections).connect(url).await?;
        sqlx::query("CREATE TABLE bench_plain (id uuid PRIMARY KEY, tenant_id text NOT NULL, content text NOT NULL)")
            .execute(&pool)
            .await?;
        Ok(Self { pool })
    }

    /// One row, committed on its own.
    pub async fn insert(&self, content: &str) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO bench_plain (id, tenant_id, content) VALUES ($1, 'bench', $2)")
            .bind(Uuid::now_v7())
            .bind(content)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

//! The SQL half of recall: ranked candidates per class from full text and from vectors, whether
//! rows in the searched classes still wait for vectors, and the rows recall finally returns.
//! Fusion, reranking and the query's embedding live in `mnemo-recall`.
//!
//! Every statement filters by the caller's tenant and by the classes it may search. Vector SQL
//! names the model as a literal, so the planner can use that model's partial HNSW index.

use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, NaiveDate, Utc};
use mnemo_core::{Label, RecallClass, Scope, SourceKind, TenantId, UserId};
use pgvector::Vector;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::{Store, StoreError};

/// Where and how to search: the caller's tenant, the classes it may see, the kinds asked for.
#[derive(Debug, Clone)]
pub struct SearchScope<'a> {
    pub tenant: &'a TenantId,
    pub classes: &'a [RecallClass],
    /// Empty means every kind.
    pub kinds: &'a [SourceKind],
    /// Superseded facts too. For admin paths only: the HTTP API never sets it.
    pub include_superseded: bool,
    /// The token's roles, which open rows written with `allowed_roles`.
    pub roles: &'a [Label],
    /// The token's user, whose own memories its roles never hide.
    pub user: Option<&'a UserId>,
}

/// Candidates per class (named by its scope), best first.
pub type Ranked = HashMap<Scope, Vec<Uuid>>;

/// Lexemes too common to search by, with the fraction of rows holding each.
#[derive(Debug, Clone, Default)]
pub struct CommonLexemes {
    pub lexemes: Vec<String>,
    pub frequencies: Vec<f32>,
    /// The largest fraction at which a common lexeme is still searched alone, when every lexeme
    /// of a question is common: the row bound over the table's rows. In a small table a word is
    /// common by its fraction and cheap to search; in a large one the rarest common word can
    /// match tens of thousands of rows, which RUM ranks one by one (tens of milliseconds) for
    /// candidates that one frequent word hardly orders.
    pub alone_up_to: f32,
}

/// A row recall returns, with what ranking and packing read.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct RecalledRow {
    pub id: Uuid,
    pub source_kind: String,
    pub source_ref: String,
    pub content: String,
    pub event_time: DateTime<Utc>,
    pub scope: String,
    pub layer: String,
    pub importance: Option<f32>,
    pub confidence: Option<f32>,
    /// When it was last of use, for its decay (see `decay_clock!`).
    pub last_used: DateTime<Utc>,
    pub faded: bool,
    /// A message's role and `name` (a tool output's tool), and the conversation and user it was
    /// written in and for: with the kind, who or what wrote it, and where.
    pub role: Option<String>,
    pub tool_name: Option<String>,
    pub session_id: Option<String>,
    pub user_id: Option<String>,
}

/// Search statements for one embedding model. Build once per process with [`Store::search`].
#[derive(Debug, Clone)]
pub struct Search {
    store: Store,
    model: String,
    dimensions: usize,
    keyword_sql: Arc<str>,
    vector_sql: Arc<str>,
    exact_tenant_sql: Arc<str>,
    fallback_tenant_sql: Arc<str>,
    fallback_session_sql: Arc<str>,
    within_sql: Arc<str>,
    participant_sql: Arc<str>,
    pending_sql: Arc<str>,
}

/// The rows of one class a statement may search, each switched on by its bound identity
/// (`$2`–`$5`); `$1` is the tenant, `$6` the agent whose workspace notes the user class may
/// hold, `$7` the kinds, `$8` whether superseded rows count, `$9` the token's roles, `$10` the
/// token's user.
///
/// A row's owner class holds it whatever its visibility; a user's row shared with its agent
/// (visibility `agent` or `tenant`) is also in that agent's class for the agent's other users,
/// and a row shared with the tenant is in the tenant class for everyone else. The classes never
/// overlap, so fusion counts no row twice. README's "Access control" table says the same.
fn class_filter(class: Scope) -> &'static str {
    match class {
        Scope::Session => "$2::text IS NOT NULL AND m.session_id = $2 AND m.scope = 'session'",
        // A user's workspace notes are recalled only under the agent whose files they are.
        Scope::User => {
            "$4::text IS NOT NULL AND m.user_id = $4 AND m.scope = 'user' \
             AND (m.source_kind <> 'workspace_note' OR m.agent_id = $6::text)"
        }
        Scope::Agent => {
            "$5::text IS NOT NULL AND m.agent_id = $5 AND (m.scope = 'agent' \
             OR (m.scope = 'user' AND m.visibility <> 'private' AND m.user_id IS DISTINCT FROM $10::text))"
        }
        Scope::Tenant => {
            "$3 AND (m.scope = 'tenant' OR (m.visibility = 'tenant' \
             AND NOT COALESCE(m.scope = 'user' AND m.user_id = $10::text, false) \
             AND NOT COALESCE(m.agent_id = $5::text, false)))"
        }
    }
}
/// Live rows of the tenant, of the kinds asked for, that the token's roles open (a user's own
/// memories are always open to that user). The first two conditions are in the predicate of
/// the full-text index and must stay word for word.
const LIVE: &str = "m.deleted_at IS NULL AND m.anonymized_at IS NULL AND ($8 OR m.superseded_by IS NULL) \
                    AND m.tenant_id = $1 AND m.source_kind = ANY($7) \
                    AND (m.allowed_roles = '{}' OR m.allowed_roles && $9::text[] \
                         OR (m.scope = 'user' AND m.user_id = $10::text))";

/// The most rows of a session or of a tenant class that the vector half ranks exactly. A larger
/// class takes an HNSW scan filtered to it, so that a session of 50,000 rows costs about what one
/// of 1,000 does; ranking a long session's newest 1,000 exactly as well cost 4 ms of a 5 ms
/// statement and is done only when the scan comes back short.
const EXACT_ROWS: u32 = 1000;

/// A large class's HNSW scan that finds at least this many rows (recall's largest `top_k`) is
/// taken as it is. One that finds fewer is a sliver of a large index, or met a quirk of the graph
/// (scans of a class that is most of a 1.2M-row index found 35–43 of 50 on one question in ten),
/// and is also ranked exactly over a bounded set of the class's rows (`Search::vector`).
const SCAN_ENOUGH: usize = mnemo_core::MAX_TOP_K;

/// The most rows of the tenant class that a short scan's fallback ranks exactly: the whole class
/// when it is a sliver of the index, a bounded share of it otherwise (ranking all of a
/// million-row class exactly took 1.8 s).
const FALLBACK_ROWS: u32 = 20_000;

/// The most rows not yet in the full-text index that one search ranks from the heap, newest
/// first. More wait only while the embed workers are behind, and recall is `degraded` then.
const UNINDEXED_SCAN: u32 = 4096;

/// The tenant's newest rows without a vector (through `memory_items_unindexed_idx`), at most
/// [`UNINDEXED_SCAN`]: what the keyword half stems from their content, and where recall looks for
/// rows still waiting for a vector.
fn newest_unembedded() -> String {
    format!(
        "SELECT * FROM memory_items
         WHERE tenant_id = $1 AND deleted_at IS NULL AND anonymized_at IS NULL AND embedded_model IS NULL
         ORDER BY created_at DESC LIMIT {UNINDEXED_SCAN}"
    )
}

/// The most lexemes the keyword half searches by: the rarest the tenant's counted rows hold, then
/// those they do not hold (found, if at all, in rows not counted yet). A long query's every
/// mid-frequency word would make each class's index scan match most of the tenant. The longest
/// question of LoCoMo has 15, of BEAM 29.
const MAX_QUERY_LEXEMES: u32 = 32;

/// Rows each class's full-text index scan brings, by RUM's distance, for BM25 to rank.
const KEYWORD_POOL: u32 = 200;

/// BM25's term-frequency saturation and length normalisation (the usual values).
const BM25_K1: f64 = 1.2;
const BM25_B: f64 = 0.75;

/// Full text with OR semantics: the query's lexemes less the common ones (`$13`, with their
/// frequencies in `$14`), at most [`MAX_QUERY_LEXEMES`]; when every lexeme is common, the rarest alone if its frequency is at
/// most `$15`, else none (the vector half answers alone). Each class's candidates
/// are the `KEYWORD_POOL` nearest by RUM's distance: from the index for embedded rows, and for
/// rows not embedded yet (whose full-text column is still empty) from their content, stemmed here
/// (see migrations 024 and 028; the class filter is cheaper than stemming, so only the class's
/// rows are stemmed). They are ranked by BM25 over every lexeme of the query, each weighed by how
/// few of the tenant's rows hold it (migration 032); `d` is the score negated, so that less is
/// better as in the vector half.
fn keyword_sql() -> String {
    let bm25 = format!(
        "coalesce((SELECT sum(w.idf * tf.n * ({BM25_K1} + 1)
                   / (tf.n + {BM25_K1} * (1 - {BM25_B} + {BM25_B} * length(x.tsv) / (SELECT avgdl FROM corpus))))
                  FROM unnest(x.tsv) AS u
                  JOIN weights w ON w.lexeme = u.lexeme
                  CROSS JOIN LATERAL (SELECT coalesce(array_length(u.positions, 1), 1)::float8 AS n) tf), 0)"
    );
    let newest = newest_unembedded();
    let branches: Vec<String> = Scope::ALL
        .iter()
        .map(|&class| {
            let filter = class_filter(class);
            format!(
                "(SELECT '{class}' AS class, x.id, -{bm25} AS d FROM (
                   (SELECT m.id, m.tsv
                    FROM memory_items m
                    WHERE {filter} AND {LIVE} AND m.embedded_model IS NOT NULL AND m.tsv @@ (SELECT q FROM query)
                    ORDER BY m.tsv <=> (SELECT q FROM query) LIMIT {KEYWORD_POOL})
                   UNION ALL
                   (SELECT m.id, to_tsvector('english', m.content) AS tsv
                    FROM ({newest}) m
                    WHERE {filter} AND {LIVE} AND to_tsvector('english', m.content) @@ (SELECT q FROM query)
                    ORDER BY to_tsvector('english', m.content) <=> (SELECT q FROM query) LIMIT {KEYWORD_POOL})
                 ) x ORDER BY 3 LIMIT $11)"
            )
        })
        .collect();
    format!(
        "WITH lexemes AS (
            SELECT l, c.freq FROM unnest(tsvector_to_array(to_tsvector('english', $12))) AS l
            LEFT JOIN unnest($13::text[], $14::float4[]) AS c(lexeme, freq) ON c.lexeme = l
        ), kept AS (
            (SELECT x.l FROM lexemes x LEFT JOIN tenant_lexemes f ON f.tenant_id = $1 AND f.lexeme = x.l
             WHERE x.freq IS NULL ORDER BY f.documents IS NULL, f.documents, x.l LIMIT {MAX_QUERY_LEXEMES})
            UNION ALL
            (SELECT l FROM lexemes WHERE NOT EXISTS (SELECT 1 FROM lexemes WHERE freq IS NULL) AND freq <= $15
             ORDER BY freq LIMIT 1)
        ), query AS (
            -- Each lexeme quoted as a tsquery literal: no operator in it is interpreted.
            SELECT tsquery_or_agg(('''' || replace(replace(l, '\\', '\\\\'), '''', '''''') || '''')::tsquery) AS q
            FROM kept
        ), corpus AS (
            -- A tenant not counted yet weighs every word alike; one whose counted rows hold no
            -- lexeme at all (stop words only) divides by 1, not 0.
            SELECT greatest(coalesce(max(t.documents), 0), 1)::float8 AS n,
                   coalesce(nullif(max(t.lexemes), 0)::float8 / nullif(max(t.documents), 0), 1) AS avgdl
            FROM tenant_text t WHERE t.tenant_id = $1
        ), weights AS (
            -- BM25's inverse document frequency, never below zero when the counts have drifted.
            SELECT x.l AS lexeme,
                   ln(1 + (greatest(c.n - coalesce(f.documents, 0), 0) + 0.5) / (coalesce(f.documents, 0) + 0.5)) AS idf
            FROM lexemes x CROSS JOIN corpus c
            LEFT JOIN tenant_lexemes f ON f.tenant_id = $1 AND f.lexeme = x.l
        )
        {}",
        branches.join("\nUNION ALL\n")
    )
}

/// Whether rows in the searched classes may be missing from recall: the tenant has more rows
/// without a vector than the keyword half stems from their content (the rest are found by
/// neither half), or a live row of those classes waits for a vector of the model (rows whose
/// embedding failed for good are not waiting). The tenant's rows without a vector are read through
/// their own index: read through the classes' indexes, every row of a long session was read at
/// each recall (33 ms for 50,000 rows; docs/benchmarks.md, "Is anything still waiting"). Rows of
/// another model are rare outside a model switch: the model is a literal, so that the planner
/// sees how few there are and reads them through the embed-pending index (during a switch, when
/// they are many, it reads the classes' rows as before).
fn pending_sql(model_literal: &str) -> String {
    let any_class: Vec<String> = Scope::ALL.iter().map(|&class| format!("({})", class_filter(class))).collect();
    let any_class = any_class.join(" OR ");
    let newest = newest_unembedded();
    format!(
        "SELECT EXISTS (
            SELECT 1 FROM memory_items
            WHERE tenant_id = $1 AND deleted_at IS NULL AND anonymized_at IS NULL AND embedded_model IS NULL
            OFFSET {UNINDEXED_SCAN}
        ) OR EXISTS (
            SELECT 1 FROM ({newest}) m WHERE m.embed_error IS NULL AND {LIVE} AND ({any_class})
        ) OR EXISTS (
            SELECT 1 FROM memory_items m
            WHERE m.embed_error IS NULL AND {LIVE}
              AND (m.embedded_model < {model_literal} OR m.embedded_model > {model_literal})
              AND ({any_class})
        )"
    )
}

impl Store {
    /// Search statements for `model`, whose vectors have `dimensions` components.
    pub fn search(&self, model: &str, dimensions: usize) -> Search {
        let model_literal = sql_literal(model);
        let distance = format!("(e.embedding::vector({dimensions}) <=> $12::vector({dimensions}))");
        // Identity classes (a user's or an agent's facts and notes) are small: rank them exactly,
        // found through their own indexes (migration 039), which hold none of the messages that
        // carry the same user or agent. `+ 0` keeps the planner off the HNSW index, which would
        // have to walk past the whole tenant to find them.
        let exact = |class: Scope| {
            let filter = class_filter(class);
            format!(
                "(SELECT '{class}' AS class, m.id, {distance}::float8 AS d
                  FROM memory_items m
                  JOIN memory_embeddings e ON e.tenant_id = m.tenant_id AND e.item_id = m.id AND e.model = {model_literal}
                  WHERE {filter} AND {LIVE}
                  ORDER BY {distance} + 0 LIMIT $11)"
            )
        };
        // The rows of `bounded` (a CTE of a class's ids) ranked exactly, when `condition` holds.
        let exact_over = |bounded: &str, condition: &str| {
            format!(
                "SELECT b.id, {distance}::float8 AS d
                 FROM {bounded} b JOIN memory_embeddings e ON e.tenant_id = $1 AND e.item_id = b.id AND e.model = {model_literal}
                 WHERE {condition}
                 ORDER BY {distance} + 0 LIMIT $11"
            )
        };
        // A class's live rows that `pick` (more conditions, an ORDER BY and a LIMIT) bounds,
        // ranked exactly: a short HNSW scan's fallback (`Search::vector`), a period's rows
        // (`Search::vector_within`).
        let ranked_exactly = |class: Scope, pick: &str| {
            format!(
                "WITH picked AS MATERIALIZED (
                    SELECT m.id FROM memory_items m WHERE {filter} AND {LIVE} {pick}
                 )
                 SELECT '{class}' AS class, x.id, x.d FROM ({exact}) x",
                filter = class_filter(class),
                exact = exact_over("picked", "true"),
            )
        };
        // An HNSW scan filtered to `class`, when `condition` holds.
        let approximate = |class: Scope, condition: &str| {
            format!(
                "SELECT m.id, {distance}::float8 AS d
                 FROM memory_embeddings e JOIN memory_items m ON m.tenant_id = e.tenant_id AND m.id = e.item_id
                 WHERE {condition}
                   AND e.model = {model_literal} AND e.tenant_id = $1 AND {filter} AND {LIVE}
                 ORDER BY {distance} LIMIT $11",
                filter = class_filter(class),
            )
        };
        // A class of more than `EXACT_ROWS` rows (the tenant class, a long session) takes an HNSW
        // scan filtered to it, iterative so the filter cannot starve it (see the migration that
        // sets hnsw.iterative_scan); a smaller one (its ids in `ids`) is ranked exactly instead:
        // the HNSW scan would walk far to find its few rows, or the whole index to find none.
        // `size` bounds the class's rows from its own partial index alone, without reading them;
        // one-time filters on it run exactly one of the two, and `ids` only for a small class.
        // (A larger class that is a sliver of the index can still come back short from the scan:
        // see `Search::vector`.)
        let bounded_class = |class: Scope, size: &str, ids: &str| {
            format!(
                "(SELECT '{class}' AS class, x.id, x.d FROM (({exact}) UNION ALL ({approximate})) x ORDER BY x.d LIMIT $11)",
                exact = exact_over(ids, &format!("(SELECT n FROM {size}) <= {EXACT_ROWS}")),
                approximate = approximate(class, &format!("(SELECT n FROM {size}) > {EXACT_ROWS}")),
            )
        };
        let branches: Vec<String> = Scope::ALL
            .iter()
            .map(|&class| match class {
                Scope::Tenant => bounded_class(class, "shared_size", "shared"),
                Scope::Session => bounded_class(class, "session_size", "in_session"),
                _ => exact(class),
            })
            .collect();
        // The size CTEs' conditions are their indexes' predicates (memory_items_session_idx,
        // memory_items_tenant_class_idx), so they count from the index alone where it can. A
        // class too large to rank exactly is named in a row without an id, so that only its
        // short answer costs a second statement (`Search::vector`).
        let vector_sql = format!(
            "WITH session_size AS MATERIALIZED (
                SELECT count(*) AS n FROM (
                    SELECT FROM memory_items m WHERE m.tenant_id = $1 AND {session} LIMIT {EXACT_ROWS} + 1) s
            ), in_session AS MATERIALIZED (
                SELECT m.id FROM memory_items m WHERE {session} AND {LIVE} LIMIT {EXACT_ROWS} + 1
            ), shared_size AS MATERIALIZED (
                SELECT count(*) AS n FROM (
                    SELECT FROM memory_items m
                    WHERE m.tenant_id = $1 AND $3 AND (m.scope = 'tenant' OR m.visibility = 'tenant')
                      AND m.deleted_at IS NULL AND m.anonymized_at IS NULL
                    LIMIT {EXACT_ROWS} + 1) s
            ), shared AS MATERIALIZED (
                SELECT m.id FROM memory_items m WHERE {tenant} AND {LIVE} LIMIT {EXACT_ROWS} + 1
            )
            {}
            UNION ALL
            SELECT c.class, NULL::uuid, NULL::float8
            FROM (VALUES ('{tenant_class}', (SELECT n FROM shared_size)), ('{session_class}', (SELECT n FROM session_size))) c(class, n)
            WHERE c.n > {EXACT_ROWS}",
            branches.join("\nUNION ALL\n"),
            tenant_class = Scope::Tenant,
            session_class = Scope::Session,
            session = class_filter(Scope::Session),
            tenant = class_filter(Scope::Tenant),
        );
        let within_period =
            // Days `$13` to `$14` (excluded) in time zone `$15`: constants to the planner.
            format!(
                "AND m.event_time >= ($13::date::timestamp AT TIME ZONE $15::text) \
                 AND m.event_time < ($14::date::timestamp AT TIME ZONE $15::text) \
                 ORDER BY m.event_time DESC LIMIT {EXACT_ROWS}"
            );
        // The session's messages by the participants `$13` names (lower case), found in
        // memory_items_participant_idx, ranked exactly when they are one participant's and at
        // most `EXACT_ROWS`: a question naming several participants, or one who wrote more, is
        // left to the session's vector list.
        let participant_sql = format!(
            "WITH picked AS MATERIALIZED (
                SELECT m.id, lower(m.tool_name) AS who FROM memory_items m
                WHERE {session} AND {LIVE} AND m.tool_name IS NOT NULL AND m.role IN ('user', 'assistant')
                  AND lower(m.tool_name) = ANY($13::text[])
                LIMIT {EXACT_ROWS} + 1
             )
             SELECT '{session_class}' AS class, x.id, x.d FROM ({exact}) x",
            session = class_filter(Scope::Session),
            session_class = Scope::Session,
            exact = exact_over(
                "picked",
                &format!("(SELECT count(DISTINCT who) = 1 AND count(*) <= {EXACT_ROWS} FROM picked)")
            ),
        );
        Search {
            store: self.clone(),
            model: model.to_owned(),
            dimensions,
            keyword_sql: keyword_sql().into(),
            vector_sql: vector_sql.into(),
            exact_tenant_sql: exact(Scope::Tenant).into(),
            fallback_tenant_sql: ranked_exactly(Scope::Tenant, &format!("LIMIT {FALLBACK_ROWS}")).into(),
            fallback_session_sql: ranked_exactly(
                Scope::Session,
                &format!("ORDER BY m.event_time DESC LIMIT {EXACT_ROWS}"),
            )
            .into(),
            // Each class's newest rows of the period: the session and tenant classes find them
            // in their indexes by event time (memory_items_session_idx, _tenant_class_idx).
            within_sql: Scope::ALL
                .iter()
                .map(|&class| format!("({})", ranked_exactly(class, &within_period)))
                .collect::<Vec<_>>()
                .join("\nUNION ALL\n")
                .into(),
            participant_sql: participant_sql.into(),
            pending_sql: pending_sql(&model_literal).into(),
        }
    }

    /// Lexemes in more than `fraction` of all rows or in more than `max_rows` rows, with their
    /// frequencies, from the statistics ANALYZE keeps (so only as fresh as the last ANALYZE, and
    /// over all tenants: migration 029 reads them as the owner), and `max_rows` as a fraction of
    /// the table's rows: the rarest of a question's common lexemes is searched alone up to it.
    pub async fn common_lexemes(&self, fraction: f64, max_rows: f64) -> Result<CommonLexemes, StoreError> {
        let rows: Vec<(String, f32, f64)> = sqlx::query_as(
            "SELECT lexeme, freq,
                    (SELECT greatest(reltuples, 1)::float8 FROM pg_class WHERE oid = 'memory_items'::regclass)
             FROM mnemo_common_lexemes($1, $2)",
        )
        .bind(fraction)
        .bind(max_rows)
        .fetch_all(&self.pool)
        .await?;
        // With no common lexeme the bound is never read.
        let table_rows = rows.first().map_or(1.0, |(_, _, n)| *n);
        let (lexemes, frequencies) = rows.into_iter().map(|(l, f, _)| (l, f)).unzip();
        Ok(CommonLexemes { lexemes, frequencies, alone_up_to: (max_rows / table_rows) as f32 })
    }

    /// Whether row-level security keeps keyword search from its full-text index, because
    /// full-text matching is not marked leakproof in this database (scripts/setup-postgres.sh
    /// marks it): the planner must then check each row's tenant before matching it.
    pub async fn wall_hides_keyword_index(&self) -> Result<bool, StoreError> {
        if !self.walled() {
            return Ok(false);
        }
        let leakproof: bool = sqlx::query_scalar(
            "SELECT proleakproof FROM pg_proc WHERE oid = 'pg_catalog.ts_match_vq(tsvector, tsquery)'::regprocedure",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(!leakproof)
    }

    /// The rows behind `ids` that are still live, for the caller's tenant only.
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn recalled_rows(
        &self,
        tenant: &TenantId,
        ids: &[Uuid],
        include_superseded: bool,
    ) -> Result<Vec<RecalledRow>, StoreError> {
        Ok(sqlx::query_as(concat!(
            "SELECT id, source_kind, source_ref, content, event_time, scope, layer, importance, confidence, ",
            decay_clock!(),
            " AS last_used, faded_at IS NOT NULL AS faded, role, tool_name, session_id, user_id
             FROM memory_items
             WHERE tenant_id = $1 AND id = ANY($2) AND deleted_at IS NULL AND anonymized_at IS NULL
               AND ($3 OR superseded_by IS NULL)",
        ))
        .bind(tenant.as_str())
        .bind(ids)
        .bind(include_superseded)
        .fetch_all(&mut *self.tenant_connection([tenant.as_str()]).await?)
        .await?)
    }

    /// Builds (or finishes, if an earlier build was interrupted) the HNSW index for `model`'s
    /// vectors: one per partition of `memory_embeddings` (migration 49), each built CONCURRENTLY
    /// (writes go on meanwhile) and attached to the table's, which is valid once every
    /// partition's is. Returns whether it built one; false too while another session builds it
    /// (every worker tries at start).
    pub async fn ensure_vector_index(&self, model: &str, dimensions: usize) -> Result<bool, StoreError> {
        let name = vector_index_name(model, dimensions);
        if self.index_validity(&name).await? == Some(true) {
            return Ok(false);
        }
        let on = |table: &str| {
            format!(
                "{table} USING hnsw ((embedding::vector({dimensions})) vector_cosine_ops) WHERE model = {}",
                sql_literal(model)
            )
        };
        // One builder at a time (a second would find a partition's index half-built, invalid,
        // and drop it), under a lock its own connection holds until it closes at the end, built
        // or not (a pooled one could go back to the pool still holding it).
        let mut conn = self.pool.acquire().await?.detach();
        let lock = format!("mnemo vector index {name}");
        let locked: bool =
            sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1))").bind(&lock).fetch_one(&mut conn).await?;
        // Built by another meanwhile, or being built.
        if !locked || self.index_validity(&name).await? == Some(true) {
            return Ok(false);
        }
        // Creating the table's index and attaching a partition's take locks that stall recall and
        // embedding while they wait (behind a long export, say): they give up instead, and the
        // caller tries again. A partition's build waits as long as it must: giving up would throw
        // away what it built.
        let (give_up, wait) = ("SET lock_timeout = '5s'", "SET lock_timeout = 0");
        sqlx::query(give_up).execute(&mut conn).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE INDEX IF NOT EXISTS {name} ON ONLY {}",
            on("memory_embeddings")
        )))
        .execute(&mut conn)
        .await?;
        // The partitions of the table, and those of the index (the ones attached).
        let children = "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                        WHERE i.inhparent = $1::regclass ORDER BY 1";
        let partitions: Vec<String> =
            sqlx::query_scalar(children).bind("memory_embeddings").fetch_all(&mut conn).await?;
        let attached: Vec<String> = sqlx::query_scalar(children).bind(&name).fetch_all(&mut conn).await?;
        let missing = partitions.iter().filter_map(|partition| {
            let index = format!("{name}_{}", partition.trim_start_matches("memory_embeddings_"));
            (!attached.contains(&index)).then_some((partition, index))
        });
        for (partition, index) in missing {
            if self.index_validity(&index).await? == Some(false) {
                let drop = format!("DROP INDEX CONCURRENTLY IF EXISTS {index}");
                sqlx::raw_sql(sqlx::AssertSqlSafe(drop)).execute(&mut conn).await?;
            }
            let create = format!("CREATE INDEX CONCURRENTLY IF NOT EXISTS {index} ON {}", on(partition));
            sqlx::query(wait).execute(&mut conn).await?;
            sqlx::raw_sql(sqlx::AssertSqlSafe(create)).execute(&mut conn).await?;
            sqlx::query(give_up).execute(&mut conn).await?;
            let attach = format!("ALTER INDEX {name} ATTACH PARTITION {index}");
            sqlx::raw_sql(sqlx::AssertSqlSafe(attach)).execute(&mut conn).await?;
        }
        Ok(true)
    }

    /// Whether `model`'s HNSW index exists and is usable.
    pub async fn has_vector_index(&self, model: &str, dimensions: usize) -> Result<bool, StoreError> {
        Ok(self.index_validity(&vector_index_name(model, dimensions)).await? == Some(true))
    }

    /// Whether an index of this schema is valid; `None` when there is none. A CONCURRENTLY build
    /// that was interrupted leaves an invalid one behind.
    async fn index_validity(&self, name: &str) -> Result<Option<bool>, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = $1 AND c.relnamespace = current_schema()::regnamespace",
        )
        .bind(name)
        .fetch_optional(&self.pool)
        .await?)
    }
}

/// A string as an SQL literal. Model names go into statement text (so the planner can match
/// each model's partial index); quotes are doubled, and backslashes are plain characters under
/// standard_conforming_strings.
fn sql_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// One index per (model, dimensions); model names may hold any character, so the name hashes it.
pub(crate) fn vector_index_name(model: &str, dimensions: usize) -> String {
    format!("{}{dimensions}", vector_index_prefix(model))
}

/// What every index of `model`'s vectors is named by, whatever their dimensions (its partitions'
/// indexes add `_p{n}` after them).
pub(crate) fn vector_index_prefix(model: &str) -> String {
    let digest = hex::encode(Sha256::digest(model.as_bytes()));
    format!("memory_embeddings_hnsw_{}_", &digest[..12])
}

/// Binds `$1`–`$10`, which every search statement shares.
macro_rules! bind_scope {
    ($query:expr, $scope:expr) => {{
        let scope: &SearchScope<'_> = $scope;
        let class = |wanted: Scope| {
            scope.classes.iter().find_map(|c| match c {
                RecallClass::Session(s) if wanted == Scope::Session => Some(s.as_str().to_owned()),
                RecallClass::User(u, _) if wanted == Scope::User => Some(u.as_str().to_owned()),
                RecallClass::Agent(a) if wanted == Scope::Agent => Some(a.as_str().to_owned()),
                _ => None,
            })
        };
        let kinds: Vec<&str> = if scope.kinds.is_empty() {
            SourceKind::ALL.iter().map(|k| k.as_str()).collect()
        } else {
            scope.kinds.iter().map(|k| k.as_str()).collect()
        };
        $query
            .bind(scope.tenant.as_str())
            .bind(class(Scope::Session))
            .bind(scope.classes.contains(&RecallClass::Tenant))
            .bind(class(Scope::User))
            .bind(class(Scope::Agent))
            .bind(scope.classes.iter().find_map(|c| match c {
                RecallClass::User(_, agent) => agent.as_ref().map(|a| a.as_str().to_owned()),
                _ => None,
            }))
            .bind(kinds)
            .bind(scope.include_superseded)
            .bind(scope.roles.iter().map(|r| r.as_str()).collect::<Vec<_>>())
            .bind(scope.user.map(|u| u.as_str()))
    }};
}

/// Groups `(class, id, distance)` rows by class, nearest first (ties by id, so runs repeat),
/// at most `per_class` each; a row found twice in a class counts once, at its nearer distance.
fn rank(mut rows: Vec<(String, Uuid, f64)>, per_class: i64) -> Ranked {
    rows.sort_by(|a, b| a.2.total_cmp(&b.2).then(a.1.cmp(&b.1)));
    let mut ranked = Ranked::new();
    for (class, id, _) in rows {
        if let Ok(class) = Scope::parse(&class) {
            let ids = ranked.entry(class).or_default();
            if ids.len() < per_class as usize && !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ranked
}

impl Search {
    /// The same statements, run on `store` (a replica of this one's database).
    pub fn on(&self, store: Store) -> Search {
        Search { store, ..self.clone() }
    }

    /// This search with its keyword statement rewritten by `edit`: for the test that takes the
    /// statement's tenant filter out and finds row-level security still isolating.
    #[doc(hidden)]
    pub fn with_keyword_sql(&self, edit: impl FnOnce(&str) -> String) -> Search {
        Search { keyword_sql: edit(&self.keyword_sql).into(), ..self.clone() }
    }

    /// The database the statements run on.
    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    pub fn dimensions(&self) -> usize {
        self.dimensions
    }

    /// Full-text candidates per class, at most `per_class` each, best first.
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn keyword(
        &self,
        scope: &SearchScope<'_>,
        query: &str,
        common: &CommonLexemes,
        per_class: i64,
    ) -> Result<Ranked, StoreError> {
        let rows = bind_scope!(sqlx::query_as(sqlx::AssertSqlSafe(Arc::clone(&self.keyword_sql))), scope)
            .bind(per_class)
            .bind(query)
            .bind(&common.lexemes)
            .bind(&common.frequencies)
            .bind(common.alone_up_to)
            .fetch_all(&mut *self.store.tenant_connection([scope.tenant.as_str()]).await?)
            .await?;
        Ok(rank(rows, per_class))
    }

    /// Nearest neighbours of `vector` per class, at most `per_class` each, nearest first.
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn vector(&self, scope: &SearchScope<'_>, vector: &[f32], per_class: i64) -> Result<Ranked, StoreError> {
        let vector = Vector::from(vector.to_vec());
        let mut conn = self.store.tenant_connection([scope.tenant.as_str()]).await?;
        let answer: Vec<(String, Option<Uuid>, Option<f64>)> =
            bind_scope!(sqlx::query_as(sqlx::AssertSqlSafe(Arc::clone(&self.vector_sql))), scope)
                .bind(per_class)
                .bind(&vector)
                .fetch_all(&mut *conn)
                .await?;
        let mut scanned = Vec::new();
        let mut rows: Vec<(String, Uuid, f64)> = Vec::with_capacity(answer.len());
        for (class, id, d) in answer {
            match (id, d) {
                (Some(id), Some(d)) => rows.push((class, id, d)),
                _ => scanned.push(class),
            }
        }
        // A class ranked whole that came back short holds no more. One searched by its HNSW scan
        // that found fewer than `SCAN_ENOUGH` is also ranked exactly, beside what the scan found:
        // the tenant class over at most `FALLBACK_ROWS` of its rows, a session over its newest
        // `EXACT_ROWS`. Not in the statement above: there the planner put the tenant's scan under
        // a parallel Gather, whose workers started on every recall.
        let fallbacks = [(Scope::Tenant, &self.fallback_tenant_sql), (Scope::Session, &self.fallback_session_sql)];
        for (class, sql) in fallbacks {
            let large = scanned.iter().any(|c| c == class.as_str());
            let found = rows.iter().filter(|(c, ..)| c == class.as_str()).count();
            if large && found < SCAN_ENOUGH.min(per_class as usize) {
                let exact: Vec<(String, Uuid, f64)> =
                    bind_scope!(sqlx::query_as(sqlx::AssertSqlSafe(Arc::clone(sql))), scope)
                        .bind(per_class)
                        .bind(&vector)
                        .fetch_all(&mut *conn)
                        .await?;
                rows.extend(exact);
            }
        }
        Ok(rank(rows, per_class))
    }

    /// The tenant's time zone and the date there at `at`, read where this search reads: the day
    /// a question is asked on.
    pub async fn tenant_day(&self, tenant: &TenantId, at: DateTime<Utc>) -> Result<(String, NaiveDate), StoreError> {
        self.store.tenant_day(tenant, at).await
    }

    /// Per class, the rows nearest to `vector` among those whose event time is in the days
    /// `from..to` of time zone `zone`: each class's newest `EXACT_ROWS` rows of the period,
    /// ranked exactly. A longer period of a large class is searched over its newest rows only, at
    /// the cost of a session's fallback.
    pub async fn vector_within(
        &self,
        scope: &SearchScope<'_>,
        vector: &[f32],
        (from, to): (NaiveDate, NaiveDate),
        zone: &str,
        per_class: i64,
    ) -> Result<Ranked, StoreError> {
        let rows = bind_scope!(sqlx::query_as(sqlx::AssertSqlSafe(Arc::clone(&self.within_sql))), scope)
            .bind(per_class)
            .bind(Vector::from(vector.to_vec()))
            .bind(from)
            .bind(to)
            .bind(zone)
            .fetch_all(&mut *self.store.tenant_connection([scope.tenant.as_str()]).await?)
            .await?;
        Ok(rank(rows, per_class))
    }

    /// The session's messages by the one participant `names` holds (names in lower case, as a
    /// question writes them: the `name` user and assistant messages were written with), nearest
    /// to `vector` first. Empty when the session has no such participant, or several, or one
    /// with more than `EXACT_ROWS` messages.
    pub async fn vector_by_participant(
        &self,
        scope: &SearchScope<'_>,
        vector: &[f32],
        names: &[String],
        per_class: i64,
    ) -> Result<Ranked, StoreError> {
        let rows = bind_scope!(sqlx::query_as(sqlx::AssertSqlSafe(Arc::clone(&self.participant_sql))), scope)
            .bind(per_class)
            .bind(Vector::from(vector.to_vec()))
            .bind(names)
            .fetch_all(&mut *self.store.tenant_connection([scope.tenant.as_str()]).await?)
            .await?;
        Ok(rank(rows, per_class))
    }

    /// This model's vectors of the rows behind `ids`, for the caller's tenant only; a row without
    /// one is left out.
    pub async fn vectors(&self, tenant: &TenantId, ids: &[Uuid]) -> Result<HashMap<Uuid, Vec<f32>>, StoreError> {
        let rows: Vec<(Uuid, Vector)> = sqlx::query_as(
            "SELECT item_id, embedding FROM memory_embeddings WHERE tenant_id = $1 AND model = $2 AND item_id = ANY($3)",
        )
        .bind(tenant.as_str())
        .bind(&self.model)
        .bind(ids)
        .fetch_all(&mut *self.store.tenant_connection([tenant.as_str()]).await?)
        .await?;
        Ok(rows.into_iter().map(|(id, v)| (id, v.to_vec())).collect())
    }

    /// The exact nearest neighbours of `vector` in the tenant class (a scan of every vector of
    /// the tenant, slow on a large one): what the benchmarks compare the HNSW half with.
    pub async fn exact_tenant(
        &self,
        scope: &SearchScope<'_>,
        vector: &[f32],
        limit: i64,
    ) -> Result<Vec<Uuid>, StoreError> {
        let rows = bind_scope!(sqlx::query_as(sqlx::AssertSqlSafe(Arc::clone(&self.exact_tenant_sql))), scope)
            .bind(limit)
            .bind(Vector::from(vector.to_vec()))
            .fetch_all(&mut *self.store.tenant_connection([scope.tenant.as_str()]).await?)
            .await?;
        Ok(rank(rows, limit).remove(&Scope::Tenant).unwrap_or_default())
    }

    /// Whether live rows in the searched classes still wait for a vector of this model.
    pub async fn pending_embeddings(&self, scope: &SearchScope<'_>) -> Result<bool, StoreError> {
        Ok(bind_scope!(sqlx::query_scalar(sqlx::AssertSqlSafe(Arc::clone(&self.pending_sql))), scope)
            .fetch_one(&mut *self.store.tenant_connection([scope.tenant.as_str()]).await?)
            .await?)
    }
}

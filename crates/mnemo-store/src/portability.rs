//! A tenant's data out and in (`mnemo-runbook export|import`). Rows travel as JSON objects of
//! their columns, so ids, supersede chains, validity, anonymization and typed fields arrive as
//! they left. An import stages every row first and writes nothing until all of them are checked:
//! it lands whole in one transaction or not at all.

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use mnemo_core::TenantId;
use serde_json::Value;
use sqlx::{Postgres, Transaction};

use crate::{Store, StoreError};

/// What an export holds, in the order an import writes it (a row's references come first), with
/// what `--since` filters by: when a row was written or, for rows changed in place, last
/// changed. Extraction's and consolidation's progress travels (a moved tenant would otherwise
/// read every session and every daily note again, paying the model and writing the same
/// memories twice); the audit log, job queues and the runs held or cooling down stay behind.
pub const EXPORT_TABLES: &[(&str, &str)] = &[
    ("tenant_config", "updated_at"),
    ("memory_items", "changed_at"),
    ("tool_outputs", "created_at"),
    ("memory_embeddings", "embedded_at"),
    ("memory_relations", "created_at"),
    ("memory_sightings", "seen_at"),
    ("session_compactions", "created_at"),
    ("workspace_files", "updated_at"),
    // A version changes once: when retention redacts its text.
    ("workspace_file_versions", "COALESCE(redacted_at, created_at)"),
    ("memory_extractions", EXTRACTION_CHANGED),
    ("consolidation_state", CONSOLIDATION_CHANGED),
];

/// When a conversation's extraction last changed: asked (again: pending anew from then), attempted
/// or finished.
const EXTRACTION_CHANGED: &str = "GREATEST(created_at, attempted_at, finished_at)";

/// When an (agent, user)'s consolidation state last changed: it has no column of its own for it.
const CONSOLIDATION_CHANGED: &str = "GREATEST(watermark, last_requested_at, last_scheduled_at, last_finished_at)";

/// The tables whose rows change in place, with their keys, and when the file's copy `r` replaces
/// the stored row `s`: when it changed later, so an export `--since` carries a retirement, a
/// supersede or an anonymization to a copy made before. Anonymization goes one way whatever the
/// clocks of two databases say: an anonymized copy always replaces a row that is not, and an
/// anonymized row is never replaced.
const CHANGED_IN_PLACE: &[(&str, &[&str], &str)] = &[
    ("tenant_config", &["tenant_id"], "r.updated_at > s.updated_at"),
    (
        "memory_items",
        &["tenant_id", "id"],
        "CASE WHEN s.anonymized_at IS NOT NULL THEN false
              WHEN r.anonymized_at IS NOT NULL THEN true
              ELSE r.changed_at > s.changed_at END",
    ),
    // A file's history goes by version first: a copy whose file went further (a core file made
    // from its template here, a restore there) is the later one, whatever the clocks say.
    (
        "workspace_files",
        &["tenant_id", "agent_id", "user_id", "path"],
        "r.version > s.version OR (r.version = s.version AND r.updated_at > s.updated_at)",
    ),
    // A redaction goes one way, as anonymization does.
    (
        "workspace_file_versions",
        &["tenant_id", "agent_id", "user_id", "path", "version"],
        "s.redacted_at IS NULL AND r.redacted_at IS NOT NULL",
    ),
    (
        "memory_extractions",
        &["tenant_id", "session_id", "through_id", "agent_id", "user_id"],
        "GREATEST(r.created_at, r.attempted_at, r.finished_at) > GREATEST(s.created_at, s.attempted_at, s.finished_at)",
    ),
    // A run held here is left to finish.
    (
        "consolidation_state",
        &["tenant_id", "agent_id", "user_id"],
        "s.running_since IS NULL
         AND GREATEST(r.watermark, r.last_requested_at, r.last_scheduled_at, r.last_finished_at)
             > GREATEST(s.watermark, s.last_requested_at, s.last_scheduled_at, s.last_finished_at)",
    ),
];

/// What anonymization deletes beside an item (by `item_id`). An import writes none for an item
/// stored anonymized, and deletes those a copy holds of an item it leaves anonymized: a copy
/// keeps nothing its source erased.
const ERASED_WITH_ITEM: &[&str] = &["memory_embeddings", "tool_outputs", "memory_sightings"];

/// The references an import checks before it writes: (table, field, table it points into, the
/// target's fields matched in order). Each must resolve within the file or the tenant's rows.
const REFERENCES: &[(&str, &str, &str, &[&str])] = &[
    ("memory_items", "superseded_by", "memory_items", &["id"]),
    ("tool_outputs", "item_id", "memory_items", &["id"]),
    ("memory_embeddings", "item_id", "memory_items", &["id"]),
    ("memory_relations", "item_id", "memory_items", &["id"]),
    ("memory_relations", "target_id", "memory_items", &["id"]),
    ("memory_sightings", "item_id", "memory_items", &["id"]),
    ("workspace_file_versions", "path", "workspace_files", &["agent_id", "user_id", "path"]),
];

/// Why an import was refused; nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("line {line}: {table}.{field} points at {target}, which is neither in the file nor in the tenant")]
    Dangling { line: i64, table: String, field: &'static str, target: String },
    #[error(
        "line {line}: its memory's source_ref is held by another row of the tenant ({existing}): the file and the \
         tenant disagree about which row it names"
    )]
    SourceRefTaken { line: i64, existing: uuid::Uuid },
    #[error("line {line}: {table} has no column {column:?} (was the file exported by a newer mnemo?)")]
    UnknownColumn { line: i64, table: &'static str, column: String },
    #[error("line {line}: a {table} row this mnemo cannot store: {problem}")]
    BadRow { line: i64, table: &'static str, problem: String },
    #[error(
        "line {line}: workspace file {path} was changed both in the file and in the tenant since they were one copy \
         (their versions disagree); import into an empty tenant, or restore the tenant's copy first"
    )]
    Diverged { line: i64, path: String },
    #[error(
        "line {line}: an erasure needs a user_sha256 (64 hex digits) and an erased_at time no later than the \
         export's (its header's exported_at)"
    )]
    BadErasure { line: i64 },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for ImportError {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(e.into())
    }
}

/// Rows per table: in the file, written, and already there but older, so overwritten (the rest
/// were there as they are in the file, or newer).
#[derive(Debug, Clone, Default)]
pub struct ImportReport {
    pub tables: Vec<(&'static str, u64, u64, u64)>,
    /// Items whose vectors did not come with them (or not of their model): the workers embed them.
    pub to_embed: u64,
    /// Workspace files, versions and sightings of users erased here after they were written,
    /// left out.
    pub erased_left_out: u64,
    /// Erasures the file brought that this tenant had not recorded.
    pub erasures: u64,
    /// Stored workspace files, versions and sightings of users the file says were erased since.
    pub erased_here: u64,
    /// Memories new here of users erased here after they were written, anonymized as the
    /// erasure would have.
    pub erased_anonymized: u64,
}

/// An import under way: rows staged in its transaction until [`Import::finish`].
#[derive(Debug)]
pub struct Import {
    tenant: TenantId,
    tx: Transaction<'static, Postgres>,
    /// (the user's hash, when) of each erasure the file carries.
    erasures: Vec<(String, chrono::DateTime<chrono::Utc>)>,
    /// The file's tenant settings replace the stored ones, however recently those changed.
    replace_settings: bool,
    /// What the tenant's own erasures do to the file's rows of the user ids they name.
    own_erasures: OwnErasures,
}

/// What a tenant's own erasures do to an imported file's rows of the same user ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnErasures {
    /// Nothing: the file's ids name other people (`--erasures skip`).
    Ignore,
    /// The users' files, sightings and progress from before the erasure are left out.
    LeaveOutFiles,
    /// That, and their memories new here from before the erasure come in anonymized: the ids
    /// surely name the erased people (the tenant's own file, or `--erasures apply`).
    Anonymize,
}

/// The name an export gives its erasure lines in place of a table.
pub const ERASURES: &str = "erasures";

/// An export under way: every table is read in one read-only snapshot, so a row and the rows
/// it points at (an item and its tool output, a file and its versions) leave together.
#[derive(Debug)]
pub struct Export {
    tx: Transaction<'static, Postgres>,
    /// The snapshot's time by the database's clock: an export `--since` it misses nothing this
    /// one left out.
    pub started_at: chrono::DateTime<chrono::Utc>,
    /// The last migration the database has applied: rows have the columns of that schema.
    pub schema: i64,
}

impl Export {
    /// Whether the snapshot holds anything of `tenant`: a memory, a workspace file or settings.
    pub async fn holds(&mut self, tenant: &TenantId) -> Result<bool, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM memory_items WHERE tenant_id = $1)
                 OR EXISTS (SELECT 1 FROM workspace_files WHERE tenant_id = $1)
                 OR EXISTS (SELECT 1 FROM tenant_config WHERE tenant_id = $1)",
        )
        .bind(tenant.as_str())
        .fetch_one(&mut *self.tx)
        .await?)
    }

    /// The tenant's erasures (since `since`, if given): the user's hash and when, as the
    /// `memory.erase` audit row has them. An erasure deletes the user's files outright, so a copy
    /// kept up to date by exports `--since` learns of it only this way.
    pub async fn erasures(
        &mut self,
        tenant: &TenantId,
        since: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<Vec<Value>, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT jsonb_build_object('tenant_id', tenant_id, 'user_sha256', details->>'user_sha256',
                                       'erased_at', created_at)
             FROM audit_log
             WHERE tenant_id = $1 AND event = $2 AND details ? 'user_sha256'
               AND ($3::timestamptz IS NULL OR created_at >= $3)
             ORDER BY created_at, id",
        )
        .bind(tenant.as_str())
        .bind(mnemo_core::AuditEvent::Erase.as_str())
        .bind(since)
        .fetch_all(&mut *self.tx)
        .await?)
    }

    /// The tenant's rows of one of [`EXPORT_TABLES`] (created or changed since `since`, if given)
    /// as JSON objects of their stored columns, streamed in the order the scan reads them (an
    /// import writes them in one statement: no order is needed, and a sort would hold the
    /// first row back until it had read the tenant's last).
    pub fn rows<'a>(
        &'a mut self,
        tenant: &'a TenantId,
        (table, time): (&'static str, &'static str),
        since: Option<chrono::DateTime<chrono::Utc>>,
    ) -> BoxStream<'a, Result<Value, StoreError>> {
        // Generated columns (the full-text vector) are the database's to compute again.
        let sql = format!(
            "SELECT to_jsonb(t) - ARRAY(SELECT column_name::text FROM information_schema.columns
                 WHERE table_schema = current_schema() AND table_name = '{table}' AND is_generated <> 'NEVER')
             FROM {table} t WHERE tenant_id = $1 AND ($2::timestamptz IS NULL OR {time} >= $2)"
        );
        sqlx::query_scalar::<_, Value>(sqlx::AssertSqlSafe(sql))
            .bind(tenant.as_str())
            .bind(since)
            .fetch(&mut *self.tx)
            .map(|r| r.map_err(StoreError::from))
            .boxed()
    }
}

impl Store {
    /// Opens an export: a repeatable-read, read-only transaction whose snapshot every table is
    /// read from.
    pub async fn begin_export(&self) -> Result<Export, StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY").execute(&mut *tx).await?;
        // The first query takes the snapshot, and the clock it reads runs after that: every
        // change and erasure the snapshot holds is stamped no later. (`now()`, the transaction's
        // start, came before an erasure committed between it and this query, and the import
        // refused the file for an erasure dated after its export.)
        let started_at = sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(&mut *tx).await?;
        let schema = schema_version(&mut tx).await?;
        Ok(Export { tx, started_at, schema })
    }

    /// The last migration the database has applied: an import refuses a file of a later schema,
    /// whose columns this database may not have.
    pub async fn schema_version(&self) -> Result<i64, StoreError> {
        schema_version(&mut *self.pool.acquire().await?).await
    }

    /// Opens an import into `tenant`. Rows must already name `tenant`.
    /// With `replace_settings`, the file's tenant settings (when it has them) replace the
    /// tenant's whenever either changed last (another tenant's copy, asked for by name); without,
    /// only when the file's changed later.
    pub async fn begin_import(
        &self,
        tenant: &TenantId,
        replace_settings: bool,
        own_erasures: OwnErasures,
    ) -> Result<Import, StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET CONSTRAINTS memory_items_superseded_by_fkey DEFERRED").execute(&mut *tx).await?;
        sqlx::query(
            "CREATE TEMP TABLE import_rows (line bigint NOT NULL, tbl text NOT NULL, row jsonb NOT NULL)
             ON COMMIT DROP",
        )
        .execute(&mut *tx)
        .await?;
        Ok(Import { tenant: tenant.clone(), tx, erasures: Vec::new(), replace_settings, own_erasures })
    }
}

impl Import {
    /// Takes the erasure on line `line` of the file (an [`Export::erasures`] row) exported at
    /// `exported_at`: an erasure after it, or in a file that does not say when it was exported,
    /// is refused (it would delete the user's files written since, and audit an erasure that
    /// never happened).
    pub fn erasure(
        &mut self,
        line: i64,
        row: &Value,
        exported_at: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<(), ImportError> {
        let hash = row["user_sha256"].as_str().filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()));
        let at = row["erased_at"].as_str().and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok());
        let at = at.map(|at| at.with_timezone(&chrono::Utc)).filter(|at| exported_at.is_some_and(|e| *at <= e));
        let (Some(hash), Some(at)) = (hash, at) else { return Err(ImportError::BadErasure { line }) };
        self.erasures.push((hash.to_ascii_lowercase(), at));
        Ok(())
    }

    /// Records the file's erasures this tenant has not (an audit row each, at the source's
    /// time), and deletes what the tenant still holds of those users from before their erasure:
    /// their workspace files with every version, their sightings, and their extraction and
    /// consolidation progress; and takes them out of the
    /// writers of earlier compactions, as the erasure did at the source (a compaction record is
    /// never exported again once changed). Their memories come in the file anonymized. Returns
    /// (erasures recorded, rows deleted).
    async fn apply_erasures(&mut self) -> Result<(u64, u64), StoreError> {
        if self.erasures.is_empty() {
            return Ok((0, 0));
        }
        let (hashes, times): (Vec<String>, Vec<chrono::DateTime<chrono::Utc>>) = self.erasures.iter().cloned().unzip();
        let erase = mnemo_core::AuditEvent::Erase.as_str();
        let recorded = sqlx::query(
            "INSERT INTO audit_log (tenant_id, event, reason, actor, details, created_at)
             SELECT DISTINCT $1, $2, 'erasure', 'import', jsonb_build_object('user_sha256', e.hash, 'imported', true), e.at
             FROM unnest($3::text[], $4::timestamptz[]) AS e(hash, at)
             WHERE NOT EXISTS (SELECT 1 FROM audit_log a WHERE a.tenant_id = $1 AND a.event = $2
                               AND a.details->>'user_sha256' = e.hash AND a.created_at = e.at)",
        )
        .bind(self.tenant.as_str())
        .bind(erase)
        .bind(&hashes)
        .bind(&times)
        .execute(&mut *self.tx)
        .await?
        .rows_affected();
        // A file written before the erasure goes with every version, later ones too.
        let erased = format!("{} = e.hash", user_sha256!("x.user_id"));
        let statements = [
            format!(
                "DELETE FROM workspace_file_versions v
                 USING workspace_files x, unnest($2::text[], $3::timestamptz[]) AS e(hash, at)
                 WHERE v.tenant_id = $1 AND x.tenant_id = $1 AND x.user_id <> ''
                   AND (v.agent_id, v.user_id, v.path) = (x.agent_id, x.user_id, x.path)
                   AND x.created_at <= e.at AND {erased}"
            ),
            format!(
                "DELETE FROM workspace_files x USING unnest($2::text[], $3::timestamptz[]) AS e(hash, at)
                 WHERE x.tenant_id = $1 AND x.user_id <> '' AND x.created_at <= e.at AND {erased}"
            ),
            format!(
                "DELETE FROM memory_sightings x USING unnest($2::text[], $3::timestamptz[]) AS e(hash, at)
                 WHERE x.tenant_id = $1 AND x.user_id IS NOT NULL AND x.seen_at <= e.at AND {erased}"
            ),
            format!(
                "DELETE FROM memory_extractions x USING unnest($2::text[], $3::timestamptz[]) AS e(hash, at)
                 WHERE x.tenant_id = $1 AND x.created_at <= e.at AND {erased}"
            ),
            format!(
                "DELETE FROM consolidation_state x USING unnest($2::text[], $3::timestamptz[]) AS e(hash, at)
                 WHERE x.tenant_id = $1 AND {CONSOLIDATION_CHANGED} <= e.at AND {erased}"
            ),
        ];
        sqlx::query(
            "UPDATE session_compactions x
             SET participants = ARRAY(
                 SELECT p FROM unnest(x.participants) AS p
                 WHERE NOT EXISTS (SELECT 1 FROM unnest($2::text[], $3::timestamptz[]) AS e(hash, at)
                                   WHERE e.hash = p AND x.created_at <= e.at))
             WHERE x.tenant_id = $1 AND x.participants && $2::text[]",
        )
        .bind(self.tenant.as_str())
        .bind(&hashes)
        .bind(&times)
        .execute(&mut *self.tx)
        .await?;
        let mut deleted = 0;
        for sql in statements {
            deleted += sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(self.tenant.as_str())
                .bind(&hashes)
                .bind(&times)
                .execute(&mut *self.tx)
                .await?
                .rows_affected();
        }
        Ok((recorded, deleted))
    }

    /// Stages rows: (line in the file, table, row), each checked first ([`check_row`]).
    pub async fn stage(&mut self, rows: &[(i64, &'static str, Value)]) -> Result<(), ImportError> {
        for (line, table, row) in rows {
            check_row(&self.tenant, *line, table, row)?;
        }
        let lines: Vec<i64> = rows.iter().map(|r| r.0).collect();
        let tables: Vec<&str> = rows.iter().map(|r| r.1).collect();
        let values: Vec<sqlx::types::Json<&Value>> = rows.iter().map(|r| sqlx::types::Json(&r.2)).collect();
        sqlx::query("INSERT INTO import_rows SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::jsonb[])")
            .bind(&lines)
            .bind(&tables)
            .bind(&values)
            .execute(&mut *self.tx)
            .await?;
        Ok(())
    }

    /// Checks every reference, then writes every staged row that is not there already, overwrites
    /// rows changed in place whose stored copy is older, and commits. Items that came without a vector of their model are left for the workers to
    /// embed. On any error nothing is written. `progress` is told each step as it begins (a large
    /// tenant's can take minutes each). A `dry_run` does all of it, checks the references whose
    /// check waits for the commit, and rolls back: the report says what the import would do.
    pub async fn finish(mut self, dry_run: bool, mut progress: impl FnMut(&str)) -> Result<ImportReport, ImportError> {
        let (erasures, erased_here) = self.apply_erasures().await?;
        let tenant = self.tenant.as_str();
        sqlx::query("CREATE INDEX ON import_rows (tbl, (row->>'id'))").execute(&mut *self.tx).await?;
        // Files exported before rows kept `changed_at` carry their creation time instead.
        sqlx::query(
            "UPDATE import_rows SET row = row || jsonb_build_object('changed_at', row->'created_at')
             WHERE tbl = 'memory_items' AND NOT row ? 'changed_at'",
        )
        .execute(&mut *self.tx)
        .await?;
        // A consolidation run held at the source holds nothing here.
        sqlx::query(
            "UPDATE import_rows SET row = row || '{\"running_since\": null, \"running_by\": null}'::jsonb
             WHERE tbl = 'consolidation_state'",
        )
        .execute(&mut *self.tx)
        .await?;
        progress("checking every row against its table");
        let columns = check_rows(&mut self.tx, tenant).await?;
        // A zone of a region's shape (`check_row`) that this PostgreSQL does not know would read
        // as UTC; the runbook's `memory time-zone --set` refuses it too.
        let zone: Option<(i64, String)> = sqlx::query_as(
            "SELECT l.line, l.row->'settings'->>'time_zone' FROM import_rows l
             WHERE l.tbl = 'tenant_config' AND l.row->'settings'->>'time_zone' IS NOT NULL
               AND NOT EXISTS (SELECT 1 FROM pg_timezone_names WHERE name = l.row->'settings'->>'time_zone')
             ORDER BY l.line LIMIT 1",
        )
        .fetch_optional(&mut *self.tx)
        .await?;
        if let Some((line, zone)) = zone {
            let problem = format!("time_zone {zone:?} is not one this PostgreSQL knows");
            return Err(ImportError::BadRow { line, table: "tenant_config", problem });
        }
        // A model's vectors have one length: that of its HNSW index (across tenants), or the
        // tenant's stored vectors', or the first the file gives. The column takes any length, and
        // only the index, once built, refuses another (with no line to name); a vector in before
        // it would stop the index from ever being built.
        let models: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT row->>'model' FROM import_rows WHERE tbl = 'memory_embeddings' AND row->>'model' IS NOT NULL",
        )
        .fetch_all(&mut *self.tx)
        .await?;
        let prefixes: Vec<String> = models.iter().map(|m| crate::search::vector_index_prefix(m)).collect();
        let odd: Option<(i64, String, i32, i32)> = sqlx::query_as(
            "WITH staged AS (
                 SELECT l.line, l.row->>'model' AS model, vector_dims((l.row->>'embedding')::vector) AS dims
                 FROM import_rows l WHERE l.tbl = 'memory_embeddings'
             ), expected AS (
                 SELECT DISTINCT ON (s.model) s.model,
                        COALESCE((SELECT split_part(substr(c.relname, length(p.prefix) + 1), '_', 1)::int
                                  FROM unnest($2::text[], $3::text[]) AS p(model, prefix)
                                  JOIN pg_class c ON c.relkind IN ('i', 'I') AND starts_with(c.relname::text, p.prefix)
                                  WHERE p.model = s.model
                                  LIMIT 1),
                                 (SELECT vector_dims(e.embedding) FROM memory_embeddings e
                                  WHERE e.tenant_id = $1 AND e.model = s.model LIMIT 1),
                                 s.dims) AS dims
                 FROM staged s ORDER BY s.model, s.line
             )
             SELECT s.line, s.model, s.dims, x.dims FROM staged s JOIN expected x USING (model)
             WHERE s.dims <> x.dims ORDER BY s.line LIMIT 1",
        )
        .bind(tenant)
        .bind(&models)
        .bind(&prefixes)
        .fetch_optional(&mut *self.tx)
        .await?;
        if let Some((line, model, dims, expected)) = odd {
            let problem = format!("a vector of {dims} dimensions for model {model}, whose vectors have {expected}");
            return Err(ImportError::BadRow { line, table: "memory_embeddings", problem });
        }
        // An erasure deletes a user's files, sightings and progress outright; a copy made before
        // it must not bring them back (their memories come back anonymized already: an
        // anonymized row is never replaced).
        let erased_left_out = if self.own_erasures == OwnErasures::Ignore {
            0
        } else {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM import_rows l USING audit_log a
             WHERE l.tbl IN ('workspace_files', 'workspace_file_versions', 'memory_sightings', 'memory_extractions',
                             'consolidation_state')
               AND a.tenant_id = $1 AND a.event = '{erase}'
               AND a.details->>'user_sha256' = {user_hash}
               AND CASE l.tbl
                       WHEN 'memory_sightings' THEN (l.row->>'seen_at')::timestamptz
                       WHEN 'consolidation_state' THEN (SELECT {CONSOLIDATION_CHANGED}
                                                        FROM jsonb_populate_record(NULL::consolidation_state, l.row))
                       -- A file written before the erasure goes with every version, later ones
                       -- too, as the erasure took them (by the file's time, staged or stored).
                       WHEN 'workspace_file_versions' THEN COALESCE(
                           (SELECT (f.row->>'created_at')::timestamptz FROM import_rows f
                            WHERE f.tbl = 'workspace_files' AND f.row->>'agent_id' = l.row->>'agent_id'
                              AND f.row->>'user_id' = l.row->>'user_id' AND f.row->>'path' = l.row->>'path'),
                           (SELECT s.created_at FROM workspace_files s
                            WHERE s.tenant_id = $1 AND s.agent_id = l.row->>'agent_id'
                              AND s.user_id = l.row->>'user_id' AND s.path = l.row->>'path'),
                           (l.row->>'created_at')::timestamptz)
                       ELSE (l.row->>'created_at')::timestamptz
                   END <= a.created_at",
                erase = mnemo_core::AuditEvent::Erase,
                user_hash = user_sha256!("l.row->>'user_id'"),
            )))
            .bind(tenant)
            .execute(&mut *self.tx)
            .await?
            .rows_affected()
        };
        progress("checking references");
        sqlx::query("ANALYZE import_rows").execute(&mut *self.tx).await?;
        for (table, field, target, keys) in REFERENCES {
            // The referencing row's value of each key: `field` stands for the target's `id`.
            let ours = |k: &str| if k == "id" { format!("l.row->>'{field}'") } else { format!("l.row->>'{k}'") };
            let in_file = keys.iter().map(|k| format!("t.row->>'{k}' = {}", ours(k))).collect::<Vec<_>>();
            let stored = keys
                .iter()
                .map(
                    |k| if *k == "id" { format!("m.id = ({})::uuid", ours(k)) } else { format!("m.{k} = {}", ours(k)) },
                )
                .collect::<Vec<_>>();
            let sql = format!(
                "SELECT l.line, l.row->>'{field}' FROM import_rows l
                 WHERE l.tbl = '{table}' AND l.row->>'{field}' IS NOT NULL
                   AND NOT EXISTS (SELECT 1 FROM import_rows t WHERE t.tbl = '{target}' AND {})
                   AND NOT EXISTS (SELECT 1 FROM {target} m WHERE m.tenant_id = $1 AND {})
                 ORDER BY l.line LIMIT 1",
                in_file.join(" AND "),
                stored.join(" AND "),
            );
            let dangling: Option<(i64, String)> =
                sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(tenant).fetch_optional(&mut *self.tx).await?;
            if let Some((line, target)) = dangling {
                return Err(ImportError::Dangling { line, table: (*table).to_owned(), field, target });
            }
        }

        // A file's version of one number holding other text here and in the file: two histories.
        let diverged: Option<(i64, String)> = sqlx::query_as(
            "SELECT l.line, s.path FROM import_rows l
             JOIN workspace_file_versions s
               ON s.tenant_id = $1 AND s.agent_id = l.row->>'agent_id' AND s.user_id = COALESCE(l.row->>'user_id', '')
              AND s.path = l.row->>'path' AND s.version = (l.row->>'version')::int
             WHERE l.tbl = 'workspace_file_versions' AND s.redacted_at IS NULL AND l.row->>'redacted_at' IS NULL
               AND s.content IS DISTINCT FROM l.row->>'content'
             ORDER BY l.line LIMIT 1",
        )
        .bind(tenant)
        .fetch_optional(&mut *self.tx)
        .await?;
        if let Some((line, path)) = diverged {
            return Err(ImportError::Diverged { line, path });
        }

        let mut report = ImportReport { erased_left_out, erasures, erased_here, ..ImportReport::default() };
        // Under the tenant's text-count lock from here to the commit, so that no vector saved
        // meanwhile holds the words of a turn the file brings anonymized or deleted: the vectors
        // made with such a turn are dropped now, while the stored row still names its session
        // (the file's own copies, made without it, then go in), and a save waiting for the lock
        // sees the turn gone.
        crate::embeddings::lock_text_counts(&mut self.tx, &[tenant.to_owned()]).await?;
        let turns: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT s.id FROM import_rows l JOIN memory_items s ON s.tenant_id = $1 AND s.id = (l.row->>'id')::uuid
             WHERE l.tbl = 'memory_items' AND s.anonymized_at IS NULL
               AND (l.row->>'anonymized_at' IS NOT NULL OR (l.row->>'deleted_at' IS NOT NULL AND s.deleted_at IS NULL))",
        )
        .bind(tenant)
        .fetch_all(&mut *self.tx)
        .await?;
        let queued = crate::retention::drop_vectors_made_with(&mut self.tx, &self.tenant, &turns).await?;
        report.to_embed += queued.len() as u64;
        // A row new here whose vector did not come with it goes in without its model, as the
        // embed worker will find it: not in with it and then out again, which wrote every index
        // entry twice and the full-text index's (it holds embedded rows only) for nothing.
        sqlx::query("CREATE TEMP TABLE import_unembedded (line bigint PRIMARY KEY, id uuid NOT NULL) ON COMMIT DROP")
            .execute(&mut *self.tx)
            .await?;
        sqlx::query(
            "INSERT INTO import_unembedded
             SELECT l.line, (l.row->>'id')::uuid FROM import_rows l
             WHERE l.tbl = 'memory_items' AND l.row->>'embedded_model' IS NOT NULL AND l.row->>'id' IS NOT NULL
               AND NOT EXISTS (SELECT 1 FROM import_rows e
                               WHERE e.tbl = 'memory_embeddings' AND e.row->>'item_id' = l.row->>'id'
                                 AND e.row->>'model' = l.row->>'embedded_model')
               AND NOT EXISTS (SELECT 1 FROM memory_items s WHERE s.tenant_id = $1 AND s.id = (l.row->>'id')::uuid)",
        )
        .bind(tenant)
        .execute(&mut *self.tx)
        .await?;
        for (table, columns) in &columns {
            progress(&format!("writing {table}"));
            let list = columns.join(", ");
            let staged: i64 = sqlx::query_scalar("SELECT count(*) FROM import_rows WHERE tbl = $1")
                .bind(table)
                .fetch_one(&mut *self.tx)
                .await?;
            // Stored rows are overwritten before new ones go in: an anonymized row frees its key
            // (its source_ref is renamed), and a new row of the file may be waiting for it. A
            // chain may then point at a row not in yet: the supersede key is checked at commit.
            let mut overwritten = 0;
            if let Some((_, keys, wins)) = CHANGED_IN_PLACE.iter().find(|(t, _, _)| t == table) {
                let wins = if *table == "tenant_config" && self.replace_settings { "true" } else { wins };
                let values = columns.iter().map(|c| format!("r.{c}")).collect::<Vec<_>>().join(", ");
                let matched = keys.iter().map(|k| format!("s.{k} = r.{k}")).collect::<Vec<_>>().join(" AND ");
                if *table == "memory_items" {
                    audit_imported_revivals(&mut self.tx, tenant, wins).await?;
                }
                let overwrite = format!(
                    "UPDATE {table} s SET ({list}) = ROW({values})
                     FROM import_rows l, jsonb_populate_record(NULL::{table}, l.row) r
                     WHERE l.tbl = '{table}' AND s.tenant_id = $1 AND {matched} AND ({wins})"
                );
                overwritten = checked(&mut self.tx, tenant, (table, &list), overwrite).await?;
            }
            // A new row's key held by another row would make the insert below skip it as if it
            // were there already (checked after the overwrites: an anonymized row frees its key).
            // A row whose id is stored is there already, whatever its key.
            if *table == "memory_items" {
                let taken: Option<(i64, uuid::Uuid)> = sqlx::query_as(
                    "SELECT l.line, m.id FROM import_rows l
                     JOIN memory_items m ON m.tenant_id = $1 AND m.source_kind = l.row->>'source_kind'
                                        AND m.source_ref = l.row->>'source_ref' AND m.id <> (l.row->>'id')::uuid
                     WHERE l.tbl = 'memory_items'
                       AND NOT EXISTS (SELECT 1 FROM memory_items s
                                       WHERE s.tenant_id = $1 AND s.id = (l.row->>'id')::uuid)
                     ORDER BY l.line LIMIT 1",
                )
                .bind(tenant)
                .fetch_optional(&mut *self.tx)
                .await?;
                if let Some((line, existing)) = taken {
                    return Err(ImportError::SourceRefTaken { line, existing });
                }
            }
            // One statement per table, so references between its own rows (a supersede chain)
            // are checked when all of them are in.
            let not_erased = match *table {
                // Nor a vector made with the words of a turn stored anonymized or deleted (a
                // deleted turn's words leave recall at once).
                "memory_embeddings" => {
                    "AND NOT EXISTS (SELECT 1 FROM memory_items m
                                     WHERE m.tenant_id = $1 AND m.id IN (r.item_id, r.previous_id)
                                       AND (m.anonymized_at IS NOT NULL
                                            OR (m.id = r.previous_id AND m.deleted_at IS NOT NULL)))"
                }
                table if ERASED_WITH_ITEM.contains(&table) => {
                    "AND NOT EXISTS (SELECT 1 FROM memory_items m
                                     WHERE m.tenant_id = $1 AND m.id = r.item_id AND m.anonymized_at IS NOT NULL)"
                }
                _ => "",
            };
            // A new row whose vector did not come with it: without its model (see above).
            let selected = columns
                .iter()
                .map(|c| match (*table, c.as_str()) {
                    ("memory_items", "embedded_model") => "CASE WHEN NOT EXISTS (SELECT 1 FROM import_unembedded u
                         WHERE u.line = l.line) THEN r.embedded_model END"
                        .to_owned(),
                    _ => format!("r.{c}"),
                })
                .collect::<Vec<_>>()
                .join(", ");
            let insert = format!(
                "INSERT INTO {table} ({list})
                 SELECT {selected} FROM import_rows l, jsonb_populate_record(NULL::{table}, l.row) r
                 WHERE l.tbl = '{table}' {not_erased} ORDER BY l.line
                 ON CONFLICT DO NOTHING"
            );
            let written = checked(&mut self.tx, tenant, (table, &list), insert).await?;
            report.tables.push((table, staged as u64, written, overwritten));
            // Before the tables that hang off items go in: a new item may take the tool-output
            // key the anonymized one held.
            if *table == "memory_items" {
                audit_imported_changes(&mut self.tx, tenant).await?;
                for erased in ERASED_WITH_ITEM {
                    let sql = format!(
                        "DELETE FROM {erased} x USING memory_items m, import_rows l
                         WHERE l.tbl = 'memory_items' AND m.tenant_id = $1 AND m.id = (l.row->>'id')::uuid
                           AND m.anonymized_at IS NOT NULL AND x.tenant_id = $1 AND x.item_id = m.id"
                    );
                    sqlx::query(sqlx::AssertSqlSafe(sql)).bind(tenant).execute(&mut *self.tx).await?;
                }
            }
        }
        let inserted_unembedded: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT u.id) FROM import_unembedded u JOIN memory_items m ON m.tenant_id = $1 AND m.id = u.id",
        )
        .bind(tenant)
        .fetch_one(&mut *self.tx)
        .await?;
        report.to_embed += u64::try_from(inserted_unembedded).unwrap_or(0);
        // Stored rows the file overwrote, or kept, without a vector of their model here (but
        // those whose vectors held a turn the file brings anonymized or deleted: queued above, they keep
        // their model, and their full text stays searchable until they are embedded again).
        report.to_embed += sqlx::query(
            "UPDATE memory_items m SET embedded_model = NULL
             FROM import_rows l
             WHERE l.tbl = 'memory_items' AND m.tenant_id = $1 AND m.id = (l.row->>'id')::uuid
               AND m.embedded_model IS NOT NULL AND m.id <> ALL($2)
               AND NOT EXISTS (SELECT 1 FROM memory_embeddings e
                               WHERE e.tenant_id = m.tenant_id AND e.item_id = m.id AND e.model = m.embedded_model)",
        )
        .bind(tenant)
        .bind(&queued)
        .execute(&mut *self.tx)
        .await?
        .rows_affected();
        // Memories new here of a user erased here before they were written (a move's last export
        // `--since` carrying what the user wrote at the source meanwhile), and replies marked as
        // theirs (migration 54): anonymized as the
        // erasure would have, with an audit row each. Those stored here the erasure took.
        if self.own_erasures == OwnErasures::Anonymize {
            let picked: Vec<(uuid::Uuid, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT m.id, 'erasure' FROM import_rows l
                 JOIN memory_items m ON m.tenant_id = $1 AND m.id = (l.row->>'id')::uuid
                 WHERE l.tbl = 'memory_items' AND m.anonymized_at IS NULL
                   AND (m.user_id IS NOT NULL OR m.reply_to_user_sha256 IS NOT NULL)
                   AND EXISTS (SELECT 1 FROM audit_log a
                               WHERE a.tenant_id = $1 AND a.event = '{erase}'
                                 AND a.details->>'user_sha256' = COALESCE({user_hash}, m.reply_to_user_sha256)
                                 AND m.created_at <= a.created_at)
                 ORDER BY m.id FOR UPDATE OF m",
                erase = mnemo_core::AuditEvent::Erase,
                user_hash = user_sha256!("m.user_id"),
            )))
            .bind(tenant)
            .fetch_all(&mut *self.tx)
            .await?;
            report.erased_anonymized =
                crate::retention::anonymize(&mut self.tx, &self.tenant, picked, "import").await?.len() as u64;
        }
        // Rows imported with their vectors have their full text already: the embed worker never
        // counts their lexemes (migration 032).
        progress("counting the tenant's words");
        sqlx::query("SELECT mnemo_count_tenant_text($1)").bind(tenant).execute(&mut *self.tx).await?;
        // Each file the import touched is at its newest version, with that version's text: a
        // file kept (newer here) whose history the file ran ahead of, or a file replaced by an
        // older-numbered copy, would collide with its own next version at the next write.
        let ahead: Option<(i64, String)> = sqlx::query_as(
            "WITH touched AS (
                 SELECT l.row->>'agent_id' AS agent_id, COALESCE(l.row->>'user_id', '') AS user_id,
                        l.row->>'path' AS path, min(l.line) AS line
                 FROM import_rows l WHERE l.tbl IN ('workspace_files', 'workspace_file_versions')
                 GROUP BY 1, 2, 3)
             SELECT t.line, f.path FROM touched t
             JOIN workspace_files f ON f.tenant_id = $1 AND f.agent_id = t.agent_id AND f.user_id = t.user_id
                                   AND f.path = t.path
             CROSS JOIN LATERAL (
                 SELECT v.version, v.content, v.redacted_at FROM workspace_file_versions v
                 WHERE v.tenant_id = $1 AND v.agent_id = f.agent_id AND v.user_id = f.user_id AND v.path = f.path
                 ORDER BY v.version DESC LIMIT 1) v
             WHERE v.version <> f.version OR (v.redacted_at IS NULL AND v.content <> f.content)
             ORDER BY t.line LIMIT 1",
        )
        .bind(tenant)
        .fetch_optional(&mut *self.tx)
        .await?;
        if let Some((line, path)) = ahead {
            return Err(ImportError::Diverged { line, path });
        }
        // A consolidation state naming a user with no file under the agent (an erased user) is
        // forgotten, as the source forgets it (`forget_idle_consolidation`): a later export
        // cannot carry that delete.
        sqlx::query(crate::consolidation::FORGET_IDLE_STATES)
            .bind(tenant)
            .bind(None::<&str>)
            .bind(None::<&str>)
            .execute(&mut *self.tx)
            .await?;
        if dry_run {
            progress("checking, then rolling back (dry run)");
            sqlx::query("SET CONSTRAINTS ALL IMMEDIATE").execute(&mut *self.tx).await?;
            self.tx.rollback().await?;
        } else {
            progress("committing");
            self.tx.commit().await?;
        }
        Ok(report)
    }
}

/// The rules of a write that the schema does not hold, for the row on line `line`: it names the
/// import's tenant; a live memory's source_ref and ids parse as a write's do (a reserved
/// `|anonymized` ref would block the tenant's sweeps); a workspace file's path is one a write
/// accepts, its owner (agent or user) is the one its path says (an agent's PROFILE.md would reach
/// every user's prompt), and a file's size is its content's; progress names ids a job parses.
fn check_row(tenant: &TenantId, line: i64, table: &'static str, row: &Value) -> Result<(), ImportError> {
    let bad = |problem: String| ImportError::BadRow { line, table, problem };
    let text = |field: &str| row[field].as_str().unwrap_or_default();
    if row["tenant_id"] != tenant.as_str() {
        return Err(bad(format!("it names tenant {}, not {tenant}", row["tenant_id"])));
    }
    let invalid = |e: mnemo_core::InvalidInput| bad(e.to_string());
    match table {
        "memory_items" if row["anonymized_at"].is_null() => {
            mnemo_core::SourceRef::parse(text("source_ref")).map_err(invalid)?;
            for (field, id) in
                [("user_id", &row["user_id"]), ("agent_id", &row["agent_id"]), ("session_id", &row["session_id"])]
            {
                let Some(id) = id.as_str() else { continue };
                match field {
                    "user_id" => mnemo_core::UserId::parse(id).map(drop),
                    "agent_id" => mnemo_core::AgentId::parse(id).map(drop),
                    _ => mnemo_core::SessionId::parse(id).map(drop),
                }
                .map_err(invalid)?;
            }
        }
        "workspace_files" | "workspace_file_versions" => {
            let path = mnemo_core::WorkspacePath::parse(text("path")).map_err(invalid)?;
            mnemo_core::AgentId::parse(text("agent_id")).map_err(invalid)?;
            let user = text("user_id");
            if !user.is_empty() {
                mnemo_core::UserId::parse(user).map_err(invalid)?;
            }
            if (path.owner() == mnemo_core::FileOwner::Agent) != user.is_empty() {
                let owner = if user.is_empty() { "the agent" } else { "a user" };
                return Err(bad(format!("{} is not a file of {owner}", path.as_str())));
            }
            if table == "workspace_files" && row["size_bytes"].as_u64() != Some(text("content").len() as u64) {
                return Err(bad("size_bytes is not the length of its content".to_owned()));
            }
        }
        // A zone the runbook would refuse (a fixed offset PostgreSQL reads with its sign
        // inverted) would move every day of the tenant's.
        "tenant_config" => {
            let zone = &row["settings"]["time_zone"];
            if !zone.is_null() && !zone.as_str().is_some_and(crate::time_zone::is_region_zone) {
                return Err(bad(format!("time_zone {zone} is not a region's zone, such as Europe/Paris")));
            }
        }
        // Progress is an (agent, user)'s, and an extraction's a session's too: ids a job could
        // not parse would stop it.
        "memory_extractions" | "consolidation_state" => {
            mnemo_core::AgentId::parse(text("agent_id")).map_err(invalid)?;
            mnemo_core::UserId::parse(text("user_id")).map_err(invalid)?;
            if table == "memory_extractions" {
                mnemo_core::SessionId::parse(text("session_id")).map_err(invalid)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// Checks every staged row against the tables' columns before anything is written, and returns
/// each table's column list (those the database does not compute). A field of no column (a file
/// of a newer schema) is refused, not dropped; a column the file lacks (one added since it was
/// exported) takes its default, as rows written before it did; a value of the wrong type is
/// refused, naming its line.
async fn check_rows(
    tx: &mut sqlx::PgConnection,
    tenant: &str,
) -> Result<Vec<(&'static str, Vec<String>)>, ImportError> {
    sqlx::query(FIRST_BAD_ROW).execute(&mut *tx).await?;
    let mut lists = Vec::new();
    for &(table, _) in EXPORT_TABLES {
        let columns: Vec<(String, Option<String>)> = sqlx::query_as(
            "SELECT column_name::text, column_default::text FROM information_schema.columns
             WHERE table_schema = current_schema() AND table_name = $1 AND is_generated = 'NEVER'
             ORDER BY ordinal_position",
        )
        .bind(table)
        .fetch_all(&mut *tx)
        .await?;
        let names: Vec<&str> = columns.iter().map(|(name, _)| name.as_str()).collect();
        let unknown: Option<(i64, String)> = sqlx::query_as(
            "SELECT l.line, k FROM import_rows l, jsonb_object_keys(l.row) k
             WHERE l.tbl = $1 AND k <> ALL($2) ORDER BY l.line LIMIT 1",
        )
        .bind(table)
        .bind(&names)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((line, column)) = unknown {
            return Err(ImportError::UnknownColumn { line, table, column });
        }
        for backfill in BACKFILLS.iter().filter(|(t, _)| *t == table).map(|(_, sql)| *sql) {
            sqlx::query(backfill).execute(&mut *tx).await?;
        }
        let defaulted: Vec<(&str, &str)> =
            columns.iter().filter_map(|(name, default)| Some((name.as_str(), default.as_deref()?))).collect();
        if !defaulted.is_empty() {
            // Each default is evaluated only for a row that lacks its column.
            let fill = defaulted
                .iter()
                .map(|(name, default)| format!("'{name}', CASE WHEN NOT row ? '{name}' THEN to_jsonb({default}) END"))
                .collect::<Vec<_>>()
                .join(", ");
            let sql = format!(
                "UPDATE import_rows SET row = jsonb_strip_nulls(jsonb_build_object({fill})) || row
                 WHERE tbl = $1 AND NOT row ?& $2"
            );
            let names: Vec<&str> = defaulted.iter().map(|(name, _)| *name).collect();
            sqlx::query(sqlx::AssertSqlSafe(sql)).bind(table).bind(&names).execute(&mut *tx).await?;
        }
        let probe = format!(
            "SELECT count(*) FROM import_rows l, jsonb_populate_record(NULL::{table}, l.row) r
             WHERE l.tbl = '{table}' AND l.row->>'tenant_id' = $1"
        );
        checked(&mut *tx, tenant, (table, &names.join(", ")), probe).await?;
        lists.push((table, columns.into_iter().map(|(name, _)| name).collect()));
    }
    Ok(lists)
}

/// What a migration gave the rows it found, for a file's rows written before it, which lack the
/// column: the column's default is for rows written since. Migration 23: an agent's or the
/// tenant's row is read as widely as its class (`private` would be refused for it), and a daily
/// note's pieces are episodic.
const BACKFILLS: &[(&str, &str)] = &[
    (
        "memory_items",
        "UPDATE import_rows SET row = row || jsonb_build_object('visibility',
             CASE row->>'scope' WHEN 'agent' THEN 'agent' WHEN 'tenant' THEN 'tenant' ELSE 'private' END)
         WHERE tbl = 'memory_items' AND NOT row ? 'visibility'",
    ),
    (
        "memory_items",
        "UPDATE import_rows SET row = row || '{\"layer\": \"episodic\"}'
         WHERE tbl = 'memory_items' AND NOT row ? 'layer'
           AND row->>'source_kind' = 'workspace_note' AND row->'metadata'->>'path' <> 'MEMORY.md'",
    ),
];

/// Runs one of the import's statements over the staged rows of `table` (`$1` is the tenant). If
/// a row's values fail it, the statement is undone and the error names the first such line.
async fn checked(
    tx: &mut sqlx::PgConnection,
    tenant: &str,
    (table, columns): (&'static str, &str),
    sql: String,
) -> Result<u64, ImportError> {
    sqlx::query("SAVEPOINT import_step").execute(&mut *tx).await?;
    match sqlx::query(sqlx::AssertSqlSafe(sql)).bind(tenant).execute(&mut *tx).await {
        Ok(done) => {
            sqlx::query("RELEASE SAVEPOINT import_step").execute(&mut *tx).await?;
            Ok(done.rows_affected())
        }
        Err(e) if is_bad_value(&e) => {
            sqlx::query("ROLLBACK TO SAVEPOINT import_step").execute(&mut *tx).await?;
            let bad: Option<(i64, String)> =
                sqlx::query_as("SELECT line, problem FROM pg_temp.import_first_bad_row($1, $2)")
                    .bind(table)
                    .bind(columns)
                    .fetch_optional(&mut *tx)
                    .await?;
            match bad {
                Some((line, problem)) => Err(ImportError::BadRow { line, table, problem }),
                None => Err(e.into()),
            }
        }
        Err(e) => Err(e.into()),
    }
}

async fn schema_version(db: &mut sqlx::PgConnection) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar("SELECT coalesce(max(version), 0) FROM _sqlx_migrations WHERE success").fetch_one(db).await?)
}

/// The first staged row of `table` that cannot be written, in file order, and why: each row is
/// written alone in a subtransaction that is then undone. Only a row's own faults count (a value
/// of the wrong type, a missing or out-of-range field); a reference to a row not in yet does not.
/// Run only after a statement over all of them failed, to name the line.
const FIRST_BAD_ROW: &str = "
CREATE OR REPLACE FUNCTION pg_temp.import_first_bad_row(t text, columns text) RETURNS TABLE (line bigint, problem text)
LANGUAGE plpgsql AS $f$
DECLARE r record;
BEGIN
    FOR r IN SELECT l.line, l.row FROM import_rows l WHERE l.tbl = t ORDER BY l.line LOOP
        BEGIN
            EXECUTE format('INSERT INTO %I (%s) SELECT %s FROM jsonb_populate_record(NULL::%I, $1) ON CONFLICT DO NOTHING',
                           t, columns, columns, t) USING r.row;
            RAISE EXCEPTION USING ERRCODE = 'MNEMO';
        EXCEPTION
            WHEN SQLSTATE 'MNEMO' OR foreign_key_violation THEN NULL;
            WHEN data_exception OR integrity_constraint_violation THEN
                line := r.line; problem := SQLERRM; RETURN NEXT; RETURN;
        END;
    END LOOP;
END $f$";

/// Whether `e` is a fault of the rows' values (SQLSTATE classes 22 and 23), which
/// [`FIRST_BAD_ROW`] can pin to a line.
fn is_bad_value(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().is_some_and(|c| c.starts_with("22") || c.starts_with("23")))
}

/// The revive audit rows of the retired (superseded or deleted) facts the file's copies bring
/// back (revived at the source, whose audit rows stay behind), written before those copies
/// overwrite them, and stamped when the source revived them: a revival starts the fact's
/// validity (`valid_from`). `wins` is when a copy `r` replaces the stored row `s`.
async fn audit_imported_revivals(tx: &mut sqlx::PgConnection, tenant: &str, wins: &str) -> Result<(), StoreError> {
    let sql = format!(
        "INSERT INTO audit_log (tenant_id, event, item_id, related_item_id, reason, actor, created_at)
         SELECT $1, '{revive}', s.id, s.superseded_by, 'imported', 'import', COALESCE(r.valid_from, now())
         FROM import_rows l, jsonb_populate_record(NULL::memory_items, l.row) r, memory_items s
         WHERE l.tbl = 'memory_items' AND s.tenant_id = $1 AND s.id = r.id AND ({wins})
           AND s.source_kind = 'fact'
           AND ((s.superseded_by IS NOT NULL AND r.superseded_by IS DISTINCT FROM s.superseded_by)
                -- Valid again since it was deleted here: revived at the source after that (two
                -- copies may each delete a row, by their own maintenance clocks).
                OR (s.deleted_at IS NOT NULL AND r.valid_from > s.deleted_at))
         ORDER BY l.line",
        revive = mnemo_core::AuditEvent::Revive,
    );
    sqlx::query(sqlx::AssertSqlSafe(sql)).bind(tenant).execute(tx).await?;
    Ok(())
}

/// The audit rows of the supersedes, deletions and anonymizations an import brings in (actor
/// `import`), once per row (a deletion once per time it happened), stamped when they happened at
/// the source (as-of reads go by them): the source's own audit log stays behind, and every
/// retirement has its audit row.
async fn audit_imported_changes(tx: &mut sqlx::PgConnection, tenant: &str) -> Result<(), StoreError> {
    let sql = format!(
        "INSERT INTO audit_log (tenant_id, event, item_id, related_item_id, reason, actor, created_at)
         SELECT $1, c.event, m.id, c.related, 'imported', 'import', COALESCE(c.at, now())
         FROM import_rows l
         JOIN memory_items m ON m.tenant_id = $1 AND m.id = (l.row->>'id')::uuid
         CROSS JOIN LATERAL (VALUES ('{supersede}', m.superseded_by, m.superseded_by IS NOT NULL, m.superseded_at),
                                    ('{delete}', NULL::uuid, m.deleted_at IS NOT NULL, m.deleted_at),
                                    ('{anonymize}', NULL::uuid, m.anonymized_at IS NOT NULL, m.anonymized_at))
                    AS c(event, related, happened, at)
         WHERE l.tbl = 'memory_items' AND c.happened
           AND NOT EXISTS (SELECT 1 FROM audit_log a
                           WHERE a.tenant_id = $1 AND a.item_id = m.id AND a.event = c.event
                             AND a.related_item_id IS NOT DISTINCT FROM c.related
                             AND (c.event <> '{delete}' OR a.created_at = c.at))
         ORDER BY l.line, c.at",
        supersede = mnemo_core::AuditEvent::Supersede,
        delete = mnemo_core::AuditEvent::Delete,
        anonymize = mnemo_core::AuditEvent::Anonymize,
    );
    sqlx::query(sqlx::AssertSqlSafe(sql)).bind(tenant).execute(tx).await?;
    Ok(())
}

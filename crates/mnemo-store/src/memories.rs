use std::collections::{BTreeMap, HashMap, HashSet};

use mnemo_core::{
    AuditEvent, Label, Layer, MAX_RELATIONS, NewMemory, Origin, Principal, Scope, SourceKind, ToolOutputKey, Unit,
    fingerprint,
};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::embeddings::embed_job;
use crate::judge::push_judge_jobs;
use crate::queue::{EmbedJob, JobArgs, push};
use crate::{HeldConnection, Store, StoreError};

/// The row a write landed on, and whether this write created it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remembered {
    pub id: Uuid,
    pub was_new: bool,
}

/// A window of a full tool output payload's UTF-8 bytes (see [`Store::tool_output_window`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutputWindow {
    pub key: ToolOutputKey,
    pub item_id: Uuid,
    /// The payload's whole length in bytes.
    pub total_bytes: usize,
    /// Its bytes from the window's offset: as many as asked for, or fewer where it ends.
    pub bytes: Vec<u8>,
}

/// Inserts many rows and the embed jobs of those inserted in one statement. Rows go in key order,
/// so two batches that share keys wait on each other instead of deadlocking; a key proposed twice
/// is inserted once. The jobs are apalis' rows as its own push writes them (`$29` the queue), one
/// per tenant naming its inserted rows, or one per [`ROWS_PER_EMBED_JOB`] of them (`$30`-`$32`
/// each tenant of the batch, its chunks and their job ids; `$33` the chunk size); their
/// arguments are [`EmbedJob`]'s JSON, their metadata the trace that queued them (`$34` the key,
/// `$35` the traceparent or NULL), as [`queue::push`](crate::queue) writes it.
const INSERT_ITEMS: &str = "
WITH new AS (
INSERT INTO memory_items (
    id, tenant_id, scope, session_id, user_id, agent_id, source_kind, source_ref,
    content, content_sha256, tool_output_key, metadata, event_time, fact_key, valid_from,
    role, tool_call_id, tool_name, token_count, token_counter,
    layer, category, importance, confidence, tags, origin, visibility, allowed_roles, fingerprint
)
SELECT id, tenant_id, scope, session_id, user_id, agent_id, source_kind, source_ref,
       content, content_sha256, tool_output_key, metadata, COALESCE(event_time, now()), fact_key,
       -- A fact is valid from its write, but a model's reading of a conversation (extraction,
       -- applied minutes or hours later) from when it was said: it is no newer than what was
       -- stated after it.
       CASE WHEN source_kind = 'fact' THEN
           CASE WHEN origin = 'extraction' THEN LEAST(COALESCE(event_time, now()), now()) ELSE now() END
       END,
       role, tool_call_id, tool_name, token_count, token_counter,
       layer, category, importance, confidence, string_to_array(tags, ','), origin, visibility,
       string_to_array(allowed_roles, ','), fingerprint
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[],
            $9::text[], $10::bytea[], $11::text[], $12::jsonb[], $13::timestamptz[], $14::text[],
            $15::text[], $16::text[], $17::text[], $18::int4[], $19::text[],
            $20::text[], $21::text[], $22::float4[], $23::float4[], $24::text[], $25::text[], $26::text[],
            $27::text[], $28::text[]) WITH ORDINALITY
     AS r(id, tenant_id, scope, session_id, user_id, agent_id, source_kind, source_ref,
          content, content_sha256, tool_output_key, metadata, event_time, fact_key,
          role, tool_call_id, tool_name, token_count, token_counter,
          -- Tags and roles are comma-joined: a label has no comma, and arrays of arrays do not
          -- unnest row by row.
          layer, category, importance, confidence, tags, origin, visibility, allowed_roles, fingerprint, ord)
ORDER BY tenant_id, source_kind, source_ref, ord
ON CONFLICT (tenant_id, source_kind, source_ref) DO NOTHING
RETURNING id, tenant_id, content_sha256
), chunked AS (
    SELECT new.*, (row_number() OVER (PARTITION BY tenant_id ORDER BY id) - 1) / $33 AS chunk FROM new
), jobs AS (
    INSERT INTO apalis.jobs (id, job_type, job, status, attempts, max_attempts, run_at, priority, metadata)
    SELECT t.job_id, $29,
           convert_to(json_build_object('tenant_id', c.tenant_id, 'items', json_agg(json_build_object(
               'item_id', c.id, 'content_sha256', encode(c.content_sha256, 'hex'))))::text, 'UTF8'),
           'Pending', 0, 25, now(), 0,
           CASE WHEN $35::text IS NULL THEN ''::hstore ELSE hstore($34::text, $35::text) END
    FROM chunked c
    JOIN unnest($30::text[], $31::int8[], $32::text[]) AS t(tenant_id, chunk, job_id)
      ON t.tenant_id = c.tenant_id AND t.chunk = c.chunk
    GROUP BY c.tenant_id, t.job_id
)
SELECT id FROM new";

/// The most rows one embed job names. A job waits until all its rows are embedded, and a worker
/// runs 128 embed jobs at once by default: 1,024 rows in hand take about 35 s on the CPU model at
/// its slowest measured rate (about 30 rows/s with the previous turn), well inside the 120 s job
/// timeout. A group commit of 16 writers (8 rows) still writes one job.
const ROWS_PER_EMBED_JOB: usize = 8;

/// The rows that already held the keys of rows not inserted, by their position in the batch.
const FIND_ITEMS: &str = "
SELECT k.ord, m.id, m.content_sha256, m.deleted_at IS NOT NULL AS deleted,
       m.superseded_by IS NOT NULL AS superseded, m.visibility,
       array_to_string(m.allowed_roles, ',') AS roles, m.session_id, m.user_id, m.agent_id,
       m.role AS turn_role, m.tool_call_id
FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS k(tenant_id, source_kind, source_ref, ord)
JOIN memory_items m USING (tenant_id, source_kind, source_ref)";

/// A row [`FIND_ITEMS`] found holding a key, with what decides whether a write may land on it.
#[derive(sqlx::FromRow)]
struct KeyHolder {
    ord: i64,
    id: Uuid,
    content_sha256: Vec<u8>,
    deleted: bool,
    superseded: bool,
    visibility: String,
    roles: String,
    session_id: Option<String>,
    user_id: Option<String>,
    agent_id: Option<String>,
    /// A conversation row's role and tool call; `None` for other kinds, and for rows written
    /// before migration 14.
    turn_role: Option<String>,
    tool_call_id: Option<String>,
}

/// Re-asserting a superseded or deleted fact makes it live again: its validity restarts, its
/// judgement is cleared so it is judged again (against the facts that are now older than it),
/// and an audit row names the fact that had superseded it, if one had. A fact re-asserted with
/// a key it does not hold takes the key and is judged again the same way, its validity
/// restarting too: the caller said, now, what it replaces. Any fact re-asserted counts as
/// accessed now (a fade is undone: forgetting would take it again otherwise). Returns the
/// revived rows, whether each has a vector already (then its judge job is queued here;
/// otherwise its embed job is, and embedding queues the judge's), and their content hashes.
/// `$1` and `$2` are the rows' ids and tenants, `$3` the audit event, `$5` the keys written (null
/// for none); `$4` whether the writer may bring the row back from a delete, and `$6` from a
/// supersession, checked again here under the row's lock: a delete or a judgement that commits
/// after the writer read the row live is not undone, nor is a row anonymized meanwhile touched
/// ([`GONE_FACTS`] finds those).
const REVIVE_FACTS: &str = "
WITH asked AS (
    SELECT r.*, m.superseded_by IS NOT NULL OR m.deleted_at IS NOT NULL
                OR (r.fact_key IS NOT NULL AND m.fact_key IS DISTINCT FROM r.fact_key) AS revive
    FROM unnest($1::uuid[], $2::text[], $4::bool[], $5::text[], $6::bool[])
         AS r(id, tenant_id, may_undelete, fact_key, may_revive)
    JOIN memory_items m ON m.tenant_id = r.tenant_id AND m.id = r.id
    WHERE m.source_kind = 'fact'
), old AS (
    SELECT m.tenant_id, m.id, m.superseded_by, m.deleted_at IS NOT NULL AS was_deleted,
           m.anonymized_at IS NOT NULL AS gone, r.fact_key
    FROM asked r JOIN memory_items m ON m.tenant_id = r.tenant_id AND m.id = r.id
    -- Checked again here, on the row as locked: a delete or a judgement may have committed since.
    WHERE r.revive
      AND (m.superseded_by IS NOT NULL OR m.deleted_at IS NOT NULL
           OR (r.fact_key IS NOT NULL AND m.fact_key IS DISTINCT FROM r.fact_key))
      AND (m.deleted_at IS NULL OR r.may_undelete)
      AND (m.superseded_by IS NULL OR r.may_revive)
    ORDER BY m.tenant_id, m.id
    -- Not FOR UPDATE: a relation's foreign key check takes KEY SHARE on its target, which FOR
    -- UPDATE blocks (two writes reviving each other's targets would deadlock).
    FOR NO KEY UPDATE OF m
), live AS (
    -- A fact said again while live is only refreshed: one locked elsewhere (a judgement, an
    -- embedding) is passed over rather than waited for, whatever order that writer locks in.
    SELECT m.tenant_id, m.id FROM asked r JOIN memory_items m ON m.tenant_id = r.tenant_id AND m.id = r.id
    WHERE NOT r.revive AND m.anonymized_at IS NULL
    FOR NO KEY UPDATE OF m SKIP LOCKED
), revived AS (
    UPDATE memory_items m
    SET superseded_by = NULL, superseded_at = NULL, deleted_at = NULL, valid_from = now(), valid_to = NULL,
        fact_key = COALESCE(old.fact_key, m.fact_key), judge_at = NULL, judge_outcome = NULL,
        judge_enqueued_at = CASE WHEN m.embedded_model IS NOT NULL THEN now() END,
        faded_at = NULL, last_accessed_at = now(),
        -- Deleted before its embed job ran (which passed it over): embedded anew.
        embed_enqueued_at = CASE WHEN old.was_deleted AND m.embedded_model IS NULL THEN now() ELSE m.embed_enqueued_at END,
        embed_error = CASE WHEN old.was_deleted AND m.embedded_model IS NULL THEN NULL ELSE m.embed_error END,
        embed_failing_since = CASE WHEN old.was_deleted AND m.embedded_model IS NULL THEN NULL ELSE m.embed_failing_since END,
        embed_attempts = CASE WHEN old.was_deleted AND m.embedded_model IS NULL THEN 0 ELSE m.embed_attempts END
    FROM old WHERE m.tenant_id = old.tenant_id AND m.id = old.id AND NOT old.gone
    RETURNING m.id, m.tenant_id, old.superseded_by AS successor, old.superseded_by IS NOT NULL OR old.was_deleted AS retired,
              m.embedded_model IS NOT NULL AS embedded, old.was_deleted, m.content_sha256
), restated AS (
    -- Said again while live: as good as recalled (its decay counts from now, a fade is undone).
    UPDATE memory_items m SET faded_at = NULL, last_accessed_at = now()
    FROM live WHERE m.tenant_id = live.tenant_id AND m.id = live.id
), audit AS (
    INSERT INTO audit_log (tenant_id, event, item_id, related_item_id, reason, actor)
    SELECT tenant_id, $3, id, successor, 'reasserted', 'api' FROM revived WHERE retired
)
SELECT id, tenant_id, embedded, was_deleted, content_sha256 FROM revived";

/// Of the facts a write found under its keys (`$1` ids, `$2` tenants), those anonymized since it
/// read them (a retention sweep or an erasure committed first): the write answers none of them.
const GONE_FACTS: &str = "
SELECT m.tenant_id, m.id FROM unnest($1::uuid[], $2::text[]) AS r(id, tenant_id)
JOIN memory_items m ON m.tenant_id = r.tenant_id AND m.id = r.id
WHERE m.anonymized_at IS NOT NULL";

/// Two writes of one memory (tenant, kind and source_ref `$1`) that carry relations take turns
/// until commit, so each counts the relations the other added ([`refused_relations`]). An
/// advisory lock, taken first in the transaction in one order: a row lock taken instead, after
/// the revivals' row locks, could deadlock with them.
const LOCK_RELATION_WRITES: &str = "
SELECT pg_advisory_xact_lock(h) FROM (
    SELECT DISTINCT hashtextextended('relations' || chr(31) || k, 0) AS h FROM unnest($1::text[]) k ORDER BY h
) x";

/// Relations from the rows written to their targets, which must be live rows of the same tenant,
/// at most `$5` ([`MAX_RELATIONS`]) a memory, counting those a re-assertion finds (both checked
/// first: see [`refused_relations`]; the foreign keys and the bound here are the second wall).
const INSERT_RELATIONS: &str = "
INSERT INTO memory_relations (tenant_id, item_id, relation, target_id)
SELECT tenant_id, item_id, relation, target_id FROM (
    SELECT n.*,
           row_number() OVER (PARTITION BY n.tenant_id, n.item_id ORDER BY n.i) AS nth,
           (SELECT count(*) FROM memory_relations h WHERE h.tenant_id = n.tenant_id AND h.item_id = n.item_id) AS held
    FROM (SELECT DISTINCT ON (tenant_id, item_id, relation, target_id) *
          FROM unnest($1::text[], $2::uuid[], $3::text[], $4::uuid[]) WITH ORDINALITY
               AS u(tenant_id, item_id, relation, target_id, i)
          ORDER BY tenant_id, item_id, relation, target_id, i) n
    WHERE NOT EXISTS (SELECT 1 FROM memory_relations h
                      WHERE h.tenant_id = n.tenant_id AND h.item_id = n.item_id
                        AND h.relation = n.relation AND h.target_id = n.target_id)
) fresh
WHERE held + nth <= $5
ON CONFLICT DO NOTHING";

/// The sessions the rows written were stated in.
const INSERT_SIGHTINGS: &str = "
INSERT INTO memory_sightings (tenant_id, item_id, session_id, user_id)
SELECT * FROM unnest($1::text[], $2::uuid[], $3::text[], $4::text[])
ON CONFLICT DO NOTHING";

const INSERT_TOOL_OUTPUTS: &str = "
INSERT INTO tool_outputs (tenant_id, key, item_id, content)
SELECT * FROM unnest($1::text[], $2::text[], $3::uuid[], $4::text[])
ON CONFLICT (tenant_id, key) DO NOTHING";

impl Store {
    /// Inserts the row, its full tool output and its embed job in one transaction, or finds the
    /// row an earlier write of the same (tenant, kind, source_ref) made. Concurrent identical
    /// writes land on one row and exactly one of them reports `was_new`.
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn remember(&self, memory: &NewMemory) -> Result<Remembered, StoreError> {
        let mut results = self.remember_many(std::slice::from_ref(memory)).await?;
        results.pop().unwrap_or_else(|| Err(StoreError::Database(sqlx::Error::RowNotFound)))
    }

    /// [`Store::remember`] for many rows in one transaction: one result per row, in order. The
    /// outer error means nothing was written; an inner one concerns that row alone (a failure
    /// after some rows were committed is each unwritten row's own).
    pub async fn remember_many(&self, batch: &[NewMemory]) -> Result<Vec<Result<Remembered, StoreError>>, StoreError> {
        self.remember_many_on(&mut HeldConnection::default(), batch).await
    }

    /// [`Store::remember_many`] on a connection the caller keeps between batches (a group
    /// committer's). After an error the connection is given back, since the error may have
    /// left it broken or mid-transaction.
    #[tracing::instrument(name = "remember_many", skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub(crate) async fn remember_many_on(
        &self,
        held: &mut HeldConnection,
        batch: &[NewMemory],
    ) -> Result<Vec<Result<Remembered, StoreError>>, StoreError> {
        let mut rounds = Rounds::new(batch);
        while let Some((pending, rows)) = rounds.next() {
            let results = match self.held_connection(held, rows.iter().map(|m| m.tenant.as_str())).await {
                Ok(conn) => insert_round(conn, &rows).await,
                Err(error) => Err(RoundFailed { committed: Vec::new(), error }),
            };
            match results {
                Ok(results) => rounds.fill(pending, results),
                Err(RoundFailed { committed, error }) => {
                    held.release();
                    rounds.fill(pending, committed);
                    if rounds.results.iter().all(Option::is_none) {
                        return Err(error);
                    }
                    // Rows are committed already: they are answered as written. The others are
                    // written by the next round, on another connection, unless the database is
                    // out of reach, out of space or past its timeout: then each fails as the
                    // batch would have (its client writes it again).
                    if error.for_each_write().is_none() {
                        tracing::warn!(error = %error, "a round of writes failed after some of its rows were committed");
                        continue;
                    }
                    let failed = || error.for_each_write().expect("the database's failure");
                    return Ok(rounds.results.into_iter().map(|r| r.unwrap_or_else(|| Err(failed()))).collect());
                }
            }
        }
        Ok(rounds
            .results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(StoreError::Database(sqlx::Error::RowNotFound))))
            .collect())
    }

    /// [`Store::remember_many`], all or nothing: when any row is refused (or was held by a
    /// write that rolled back), nothing is written, that row keeps its error and the others
    /// answer [`StoreError::RolledBack`].
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn remember_all(&self, batch: &[NewMemory]) -> Result<Vec<Result<Remembered, StoreError>>, StoreError> {
        let mut conn = self.tenant_connection(batch.iter().map(|m| m.tenant.as_str())).await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let mut rounds = Rounds::new(batch);
        while let Some((pending, rows)) = rounds.next() {
            let results = insert_in(&mut tx, &rows).await?;
            rounds.fill(pending, results);
        }
        let results = rounds.results;
        if results.iter().any(Option::is_none) {
            return Err(StoreError::Database(sqlx::Error::RowNotFound));
        }
        if results.iter().all(|r| matches!(r, Some(Ok(_)))) {
            tx.commit().await?;
            return Ok(results.into_iter().flatten().collect());
        }
        tx.rollback().await?;
        Ok(results
            .into_iter()
            .map(|r| match r {
                Some(Err(e)) => Err(e),
                _ => Err(StoreError::RolledBack),
            })
            .collect())
    }

    /// Up to `len` bytes from byte `offset` of the full payload behind a `tout_…` key (sliced by
    /// the database, so a page of a large payload does not carry the whole of it), with its
    /// length, while its row is live, to a caller who may read the row, as the session's
    /// messages are read: a token bound to a session reads that session's outputs; otherwise a
    /// user's token reads the rows carrying its user, and a service token any of its tenant.
    /// Roles narrow each.
    pub async fn tool_output_window(
        &self,
        caller: &Principal,
        key: &ToolOutputKey,
        offset: usize,
        len: usize,
    ) -> Result<Option<ToolOutputWindow>, StoreError> {
        // A text is at most 1 GB: positions past that are past its end.
        let clamp = |n: usize| i32::try_from(n).unwrap_or(i32::MAX - 1);
        let row: Option<(Uuid, i32, Vec<u8>)> = sqlx::query_as(
            "SELECT t.item_id, octet_length(t.content), substring(convert_to(t.content, 'UTF8') FROM $6 FOR $7)
             FROM tool_outputs t
                 JOIN memory_items m ON m.id = t.item_id AND m.tenant_id = t.tenant_id
                 WHERE t.tenant_id = $1 AND t.key = $2 AND m.deleted_at IS NULL AND m.anonymized_at IS NULL
                   AND (m.allowed_roles = '{}' OR m.allowed_roles && $5::text[])
                   AND CASE WHEN $4::text IS NOT NULL THEN m.session_id = $4
                            ELSE $3::text IS NULL OR m.user_id = $3 END",
        )
        .bind(caller.tenant.as_str())
        .bind(key.as_str())
        .bind(caller.user.as_ref().map(|u| u.as_str()))
        .bind(caller.session.as_ref().map(|s| s.as_str()))
        .bind(caller.roles.iter().map(Label::as_str).collect::<Vec<_>>())
        .bind(clamp(offset) + 1)
        .bind(clamp(len))
        .fetch_optional(&mut *self.tenant_connection([caller.tenant.as_str()]).await?)
        .await?;
        Ok(row.map(|(item_id, total, bytes)| ToolOutputWindow {
            key: key.clone(),
            item_id,
            total_bytes: total as usize,
            bytes,
        }))
    }
}

/// A batch's results over up to three rounds of inserts: a row whose key belonged to a
/// transaction that rolled back while we waited on it is neither inserted nor found (`None`),
/// and the next round inserts it.
struct Rounds<'a> {
    batch: &'a [NewMemory],
    results: Vec<Option<Result<Remembered, StoreError>>>,
    left: usize,
}

impl<'a> Rounds<'a> {
    fn new(batch: &'a [NewMemory]) -> Self {
        Self { batch, results: batch.iter().map(|_| None).collect(), left: 3 }
    }

    /// The positions and rows of the next round; `None` when every row has a result or the
    /// rounds are used up.
    fn next(&mut self) -> Option<(Vec<usize>, Vec<&'a NewMemory>)> {
        let pending: Vec<usize> = (0..self.batch.len()).filter(|&i| self.results[i].is_none()).collect();
        if pending.is_empty() || self.left == 0 {
            return None;
        }
        self.left -= 1;
        let rows = pending.iter().map(|&i| &self.batch[i]).collect();
        Some((pending, rows))
    }

    fn fill(&mut self, pending: Vec<usize>, results: Vec<Option<Result<Remembered, StoreError>>>) {
        for (i, result) in pending.into_iter().zip(results) {
            self.results[i] = result;
        }
    }
}

/// A round that failed: the answers of the rows it committed before it failed (its positions;
/// `None` for the others, and no entry at all when it committed none), and the failure.
struct RoundFailed {
    committed: Vec<Option<Result<Remembered, StoreError>>>,
    error: StoreError,
}

impl From<StoreError> for RoundFailed {
    fn from(error: StoreError) -> Self {
        Self { committed: Vec::new(), error }
    }
}

impl From<sqlx::Error> for RoundFailed {
    fn from(error: sqlx::Error) -> Self {
        StoreError::from(error).into()
    }
}

/// One round of [`Store::remember_many`] on `conn`, whose tenants are named. Rows that are a row
/// each (no relations, sightings or full tool output) are written by one statement, atomic on
/// its own, so without BEGIN and COMMIT: two round trips fewer per group commit, the most of a
/// transaction's time under load (docs/benchmarks.md, "Where a write's time goes").
async fn insert_round(
    conn: &mut PgConnection,
    rows: &[&NewMemory],
) -> Result<Vec<Option<Result<Remembered, StoreError>>>, RoundFailed> {
    let single = |m: &&NewMemory| m.typed.relations.is_empty() && m.seen_in.is_none() && m.tool_output.is_none();
    if !rows.is_empty() && rows.iter().all(single) {
        let (ids, inserted) = insert_items(&mut *conn, rows).await?;
        if inserted.len() == rows.len() {
            return Ok(settle(conn, rows, &ids, &inserted).await?);
        }
        // Keys that were taken may revive facts: that is several statements, after the new
        // rows were committed, which stay answered as written whatever fails now.
        let settled = async {
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            let results = settle(&mut tx, rows, &ids, &inserted).await?;
            tx.commit().await?;
            Ok::<_, StoreError>(results)
        };
        return settled.await.map_err(|error| RoundFailed { committed: written(&ids, &inserted), error });
    }
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let results = insert_in(&mut tx, rows).await?;
    tx.commit().await?;
    Ok(results)
}

/// One round of inserts on `tx` (see [`Store::remember_many`]): the rows, their revivals, full
/// tool outputs, embed and judge jobs. Other writes that must commit with rows (an extraction's
/// facts) call it on their own transaction.
pub(crate) async fn insert_in(
    tx: &mut PgConnection,
    rows: &[&NewMemory],
) -> Result<Vec<Option<Result<Remembered, StoreError>>>, StoreError> {
    let relation_writes: Vec<String> = rows
        .iter()
        .filter(|m| !m.typed.relations.is_empty())
        .map(|m| [m.tenant.as_str(), m.kind.as_str(), m.source_ref.as_str()].join("\u{1f}"))
        .collect();
    if !relation_writes.is_empty() {
        sqlx::query(LOCK_RELATION_WRITES).bind(relation_writes).execute(&mut *tx).await?;
    }
    // A row whose relations cannot all be held is refused alone; the others go in.
    let mut refused = refused_relations(tx, rows).await?;
    if refused.is_empty() {
        return insert_checked(tx, rows).await;
    }
    let valid: Vec<&NewMemory> =
        rows.iter().enumerate().filter(|(i, _)| !refused.contains_key(i)).map(|(_, m)| *m).collect();
    let mut inserted = insert_checked(tx, &valid).await?.into_iter();
    Ok((0..rows.len())
        .map(|i| match refused.remove(&i) {
            Some(e) => Some(Err(e)),
            None => inserted.next().flatten(),
        })
        .collect())
}

async fn insert_checked(
    tx: &mut PgConnection,
    rows: &[&NewMemory],
) -> Result<Vec<Option<Result<Remembered, StoreError>>>, StoreError> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let (ids, inserted) = insert_items(tx, rows).await?;
    settle(tx, rows, &ids, &inserted).await
}

/// Inserts the rows whose keys are free, with their embed jobs; returns the ids given to all
/// rows and the ids of those inserted.
async fn insert_items(tx: &mut PgConnection, rows: &[&NewMemory]) -> Result<(Vec<Uuid>, Vec<Uuid>), StoreError> {
    let ids: Vec<Uuid> = rows.iter().map(|_| Uuid::now_v7()).collect();
    let mut per_tenant: BTreeMap<&str, usize> = BTreeMap::new();
    for m in rows {
        *per_tenant.entry(m.tenant.as_str()).or_default() += 1;
    }
    let chunks: Vec<(&str, i64)> = per_tenant
        .into_iter()
        .flat_map(|(tenant, n)| (0..n.div_ceil(ROWS_PER_EMBED_JOB) as i64).map(move |chunk| (tenant, chunk)))
        .collect();
    let job_ids: Vec<String> = chunks.iter().map(|_| ulid::Ulid::generate().to_string()).collect();
    let column = |f: fn(&NewMemory) -> Option<String>| rows.iter().map(|m| f(m)).collect::<Vec<_>>();
    let tenants = column(|m| Some(m.tenant.to_string()));
    let kinds = column(|m| Some(m.kind.to_string()));
    let refs = column(|m| Some(m.source_ref.to_string()));

    let inserted: Vec<Uuid> = sqlx::query_scalar(INSERT_ITEMS)
        .bind(&ids)
        .bind(&tenants)
        .bind(column(|m| Some(m.scope.to_string())))
        .bind(column(|m| m.session.as_ref().map(ToString::to_string)))
        .bind(column(|m| m.user.as_ref().map(ToString::to_string)))
        .bind(column(|m| m.agent.as_ref().map(ToString::to_string)))
        .bind(&kinds)
        .bind(&refs)
        .bind(column(|m| Some(m.content.as_str().to_owned())))
        .bind(rows.iter().map(|m| m.content_sha256.to_vec()).collect::<Vec<_>>())
        .bind(column(|m| m.tool_output.as_ref().map(|(key, _)| key.to_string())))
        .bind(rows.iter().map(|m| m.metadata.to_json()).collect::<Vec<_>>())
        .bind(rows.iter().map(|m| m.event_time).collect::<Vec<_>>())
        .bind(column(|m| m.fact_key.as_ref().map(|k| k.as_str().to_owned())))
        .bind(column(|m| m.turn.as_ref().map(|t| t.role.to_string())))
        .bind(column(|m| m.turn.as_ref().and_then(|t| t.tool_call_id.clone())))
        .bind(column(|m| m.turn.as_ref().and_then(|t| t.tool_name.clone())))
        .bind(
            rows.iter()
                .map(|m| m.turn.as_ref().map(|t| i32::try_from(t.tokens).unwrap_or(i32::MAX)))
                .collect::<Vec<_>>(),
        )
        .bind(column(|m| m.turn.as_ref().map(|t| t.counted_by.clone())))
        .bind(column(|m| Some(m.typed.layer.to_string())))
        .bind(column(|m| m.typed.category.map(|c| c.to_string())))
        .bind(rows.iter().map(|m| m.typed.importance.map(Unit::get)).collect::<Vec<_>>())
        .bind(rows.iter().map(|m| m.typed.confidence.map(Unit::get)).collect::<Vec<_>>())
        .bind(column(|m| Some(joined(&m.typed.tags))))
        .bind(column(|m| Some(m.typed.origin.to_string())))
        .bind(column(|m| Some(m.typed.visibility.to_string())))
        .bind(column(|m| Some(joined(&m.typed.allowed_roles))))
        .bind(column(|m| {
            (m.typed.layer == Layer::Episodic && m.scope != Scope::Session).then(|| fingerprint(m.content.as_str()))
        }))
        .bind(EmbedJob::QUEUE.as_str())
        .bind(chunks.iter().map(|c| c.0).collect::<Vec<_>>())
        .bind(chunks.iter().map(|c| c.1).collect::<Vec<_>>())
        .bind(job_ids)
        .bind(ROWS_PER_EMBED_JOB as i64)
        .bind(crate::queue::TRACEPARENT)
        .bind(mnemo_config::traceparent())
        .fetch_all(&mut *tx)
        .await?;
    Ok((ids, inserted))
}

/// The answers of the rows `inserted` (by position in `ids`); `None` for the others.
fn written(ids: &[Uuid], inserted: &[Uuid]) -> Vec<Option<Result<Remembered, StoreError>>> {
    let inserted: HashSet<&Uuid> = inserted.iter().collect();
    ids.iter().map(|id| inserted.contains(id).then_some(Ok(Remembered { id: *id, was_new: true }))).collect()
}

/// The results of rows after [`insert_items`]: rows whose keys were taken are matched to what
/// holds them (and facts asserted again revived), and the new rows' relations, sightings and
/// full tool outputs are written.
async fn settle(
    tx: &mut PgConnection,
    rows: &[&NewMemory],
    ids: &[Uuid],
    inserted: &[Uuid],
) -> Result<Vec<Option<Result<Remembered, StoreError>>>, StoreError> {
    let mut results = written(ids, inserted);

    // Keys that were taken: by an earlier write, or by an identical row earlier in this batch.
    let (mut reasserted_facts, mut reasserted_tenants, mut may_undelete, mut reasserted_keys, mut may_revive) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    if inserted.len() < rows.len() {
        let column = |f: fn(&NewMemory) -> String| rows.iter().map(|m| f(m)).collect::<Vec<_>>();
        let (tenants, kinds, refs) =
            (column(|m| m.tenant.to_string()), column(|m| m.kind.to_string()), column(|m| m.source_ref.to_string()));
        let existing: Vec<KeyHolder> =
            sqlx::query_as(FIND_ITEMS).bind(tenants).bind(kinds).bind(refs).fetch_all(&mut *tx).await?;
        for KeyHolder {
            ord,
            id,
            content_sha256: sha,
            deleted,
            superseded,
            visibility,
            roles,
            session_id: session,
            user_id: holder,
            agent_id: holder_agent,
            turn_role,
            tool_call_id,
        } in existing
        {
            let i = usize::try_from(ord - 1).unwrap_or(usize::MAX);
            if let Some(slot @ None) = results.get_mut(i) {
                let is_fact = rows[i].kind == SourceKind::Fact;
                // A writer's fact asserted again with other readers is a different fact: refused,
                // so a re-assertion can never widen or narrow who reads a row. mnemo's own jobs
                // (extraction) re-assert what the row says and keep its readers.
                let typed = &rows[i].typed;
                // Shared with an agent, the readers are that agent's users.
                let agent = rows[i].agent.as_ref().map(|a| a.as_str());
                let readers_differ = matches!(typed.origin, Origin::Api | Origin::User)
                    && (visibility != typed.visibility.as_str()
                        || roles != joined(&typed.allowed_roles)
                        || (visibility == "agent" && holder_agent.as_deref() != agent));
                // A session's row under a ref another session's row holds is another write: it
                // would land on a row its session never reads.
                let other_session = rows[i].session.as_ref().is_some_and(|s| session.as_deref() != Some(s.as_str()));
                // So is a turn of another role or tool call under a held ref: a retry repeats
                // the whole message, and the held row would stand for a turn never stored.
                let turn = rows[i].turn.as_ref();
                let other_turn = turn_role.is_some()
                    && (turn.map(|t| t.role.as_str()) != turn_role.as_deref()
                        || turn.and_then(|t| t.tool_call_id.as_deref()) != tool_call_id.as_deref());
                // The row names the user who first wrote it; only they bring it back. Another
                // user of an agent reviving a fact the agent's operator (or another user) wrote
                // would have the judge retire, in its writer's name, what replaced it.
                let writer = holder.as_deref() == rows[i].user.as_ref().map(|u| u.as_str());
                // Only a fact comes back from a delete, re-asserted by its writer, never by a
                // model (extraction).
                let may_undelete_it = is_fact && typed.origin != Origin::Extraction && writer;
                // Relations are the writer's to add, as reviving and re-keying are: another user of
                // an agent would hang links on a memory that is not theirs to change.
                let foreign_relations = !writer && typed.relations.iter().any(|r| r.target != id);
                let conflict = sha != rows[i].content_sha256
                    || (is_fact && readers_differ)
                    || other_session
                    || other_turn
                    || foreign_relations;
                *slot = Some(if conflict {
                    Err(StoreError::SourceRefConflict { existing: id })
                } else if deleted && !may_undelete_it {
                    // A fact is asserted again by its user; a message or chunk under a
                    // deleted row's key is a retry that must not bring the row back, nor may a
                    // model bring back a fact its user deleted, nor another user of an agent
                    // an agent fact someone deleted (the row names its first writer).
                    Err(StoreError::SourceRefDeleted { existing: id })
                } else if is_fact && superseded && !writer {
                    // Another user's fact that a newer one replaced: theirs to bring back.
                    Err(StoreError::SourceRefConflict { existing: id })
                } else {
                    if is_fact {
                        reasserted_facts.push(id);
                        reasserted_tenants.push(rows[i].tenant.as_str());
                        may_undelete.push(may_undelete_it);
                        // Only its writer brings a superseded fact back or re-keys one, and never
                        // through a model (extraction): another user of an agent would retire the
                        // writer's facts of that key through it, and a model repeating what a
                        // newer fact replaced would undo that.
                        let by_its_writer = writer && typed.origin != Origin::Extraction;
                        may_revive.push(by_its_writer);
                        reasserted_keys.push(rows[i].fact_key.as_ref().filter(|_| by_its_writer).map(|k| k.as_str()));
                    }
                    Ok(Remembered { id, was_new: false })
                });
            }
        }
    }

    if !reasserted_facts.is_empty() {
        let revived: Vec<(Uuid, String, bool, bool, Vec<u8>)> = sqlx::query_as(REVIVE_FACTS)
            .bind(&reasserted_facts)
            .bind(&reasserted_tenants)
            .bind(AuditEvent::Revive.as_str())
            .bind(&may_undelete)
            .bind(&reasserted_keys)
            .bind(&may_revive)
            .fetch_all(&mut *tx)
            .await?;
        // After the revival, which waited for any sweep holding those rows: a row anonymized
        // since the writer read it is not the fact any more.
        let gone: HashSet<(String, Uuid)> = sqlx::query_as(GONE_FACTS)
            .bind(&reasserted_facts)
            .bind(&reasserted_tenants)
            .fetch_all(&mut *tx)
            .await?
            .into_iter()
            .collect();
        if !gone.is_empty() {
            for (slot, row) in results.iter_mut().zip(rows.iter()) {
                if let Some(Ok(r)) = slot
                    && gone.contains(&(row.tenant.as_str().to_owned(), r.id))
                {
                    *slot = Some(Err(StoreError::SourceRefDeleted { existing: r.id }));
                }
            }
        }
        let (embedded, unembedded): (Vec<_>, Vec<_>) = revived.into_iter().partition(|(_, _, embedded, ..)| *embedded);
        push_judge_jobs(tx, embedded.into_iter().map(|(id, t, ..)| (id, t)).collect()).await?;
        // A deleted row's embed job passed it over; any other has a job of its own still.
        let jobs = unembedded
            .into_iter()
            .filter(|(_, _, _, was_deleted, _)| *was_deleted)
            .map(|(id, t, _, _, sha)| embed_job((id, t, sha)))
            .collect::<Result<Vec<_>, _>>()?;
        push(tx, &jobs).await?;
    }

    let landed: Vec<(&NewMemory, Uuid)> = rows
        .iter()
        .zip(&results)
        .filter_map(|(m, r)| match r {
            Some(Ok(r)) => Some((*m, r.id)),
            _ => None,
        })
        .collect();
    let (mut tenants, mut items, mut relations, mut targets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (m, id) in &landed {
        for relation in m.typed.relations.iter().filter(|r| r.target != *id) {
            tenants.push(m.tenant.as_str());
            items.push(*id);
            relations.push(relation.kind.as_str());
            targets.push(relation.target);
        }
    }
    if !items.is_empty() {
        sqlx::query(INSERT_RELATIONS)
            .bind(tenants)
            .bind(items)
            .bind(relations)
            .bind(targets)
            .bind(MAX_RELATIONS as i64)
            .execute(&mut *tx)
            .await?;
    }
    let (mut tenants, mut items, mut sessions, mut users) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (m, id) in &landed {
        if let Some(session) = &m.seen_in {
            tenants.push(m.tenant.as_str());
            items.push(*id);
            sessions.push(session.as_str());
            users.push(m.user.as_ref().map(|u| u.as_str()));
        }
    }
    if !items.is_empty() {
        let insert = sqlx::query(INSERT_SIGHTINGS).bind(tenants).bind(items).bind(sessions).bind(users);
        insert.execute(&mut *tx).await?;
    }

    let new: Vec<(&NewMemory, Uuid)> =
        rows.iter().zip(ids).filter(|(_, id)| inserted.contains(id)).map(|(m, id)| (*m, *id)).collect();
    let elided: Vec<(&NewMemory, Uuid)> = new.iter().filter(|(m, _)| m.tool_output.is_some()).copied().collect();
    if !elided.is_empty() {
        let (mut tenants, mut keys, mut items, mut payloads) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (m, id) in &elided {
            if let Some((key, full)) = &m.tool_output {
                tenants.push(m.tenant.as_str());
                keys.push(key.as_str());
                items.push(*id);
                payloads.push(full.as_str());
            }
        }
        sqlx::query(INSERT_TOOL_OUTPUTS).bind(tenants).bind(keys).bind(items).bind(payloads).execute(&mut *tx).await?;
    }
    Ok(results)
}

/// Each row of `rows` (by position) whose relations cannot all be held: one it does not hold yet
/// names a target that is not a live row of the row's tenant, or the memory would hold more than [`MAX_RELATIONS`]
/// with those it holds (a re-assertion adds to them) and those the rows before it in `rows` give
/// the same memory (a group commit may carry two writes of one). A memory's relation to itself
/// is never stored, so it does not count. Called under [`LOCK_RELATION_WRITES`], so no other
/// write adds to them meanwhile.
async fn refused_relations(
    tx: &mut PgConnection,
    rows: &[&NewMemory],
) -> Result<HashMap<usize, StoreError>, StoreError> {
    let (mut positions, mut tenants, mut kinds, mut refs, mut relations, mut targets) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (i, m) in rows.iter().enumerate() {
        for relation in &m.typed.relations {
            positions.push(i as i64);
            tenants.push(m.tenant.as_str());
            kinds.push(m.kind.as_str());
            refs.push(m.source_ref.as_str());
            relations.push(relation.kind.as_str());
            targets.push(relation.target);
        }
    }
    if targets.is_empty() {
        return Ok(HashMap::new());
    }
    let refused: Vec<(i64, Option<Uuid>, i64)> = sqlx::query_as(
        "WITH r AS (
            SELECT * FROM unnest($1::int8[], $2::text[], $3::text[], $4::text[], $5::text[], $6::uuid[])
                AS r(position, tenant_id, kind, source_ref, relation, target)
         ), missing AS (
            SELECT DISTINCT ON (r.position) r.position, r.target FROM r
            WHERE NOT EXISTS (SELECT 1 FROM memory_items m
                              WHERE m.tenant_id = r.tenant_id AND m.id = r.target AND m.superseded_by IS NULL
                                AND m.deleted_at IS NULL AND m.anonymized_at IS NULL)
              -- A relation the memory holds already (a retry) stands whatever became of its target.
              AND NOT EXISTS (SELECT 1 FROM memory_items s
                              JOIN memory_relations h ON h.tenant_id = s.tenant_id AND h.item_id = s.id
                              WHERE s.tenant_id = r.tenant_id AND s.source_kind = r.kind AND s.source_ref = r.source_ref
                                AND h.relation = r.relation AND h.target_id = r.target)
            ORDER BY r.position
         ), memory AS (
            SELECT p.*, m.id AS existing
            FROM (SELECT DISTINCT position, tenant_id, kind, source_ref FROM r) p
            LEFT JOIN memory_items m
                   ON m.tenant_id = p.tenant_id AND m.source_kind = p.kind AND m.source_ref = p.source_ref
         ), counted AS (
            SELECT p.position,
                   (SELECT count(*) FROM (
                        SELECT e.relation, e.target FROM r e
                        WHERE e.tenant_id = p.tenant_id AND e.kind = p.kind AND e.source_ref = p.source_ref
                          AND e.position <= p.position AND e.target IS DISTINCT FROM p.existing
                        UNION
                        SELECT h.relation, h.target_id FROM memory_relations h
                        WHERE h.tenant_id = p.tenant_id AND h.item_id = p.existing
                    ) u) AS n
            FROM memory p
         )
         SELECT c.position, x.target, c.n FROM counted c LEFT JOIN missing x ON x.position = c.position
         WHERE x.position IS NOT NULL OR c.n > $7",
    )
    .bind(positions)
    .bind(tenants)
    .bind(kinds)
    .bind(refs)
    .bind(relations)
    .bind(targets)
    .bind(MAX_RELATIONS as i64)
    .fetch_all(&mut *tx)
    .await?;
    Ok(refused
        .into_iter()
        .map(|(i, missing, n)| {
            let e = match missing {
                Some(target) => StoreError::RelationTargetMissing { target },
                None => StoreError::TooManyRelations { relations: usize::try_from(n).unwrap_or(usize::MAX) },
            };
            (i as usize, e)
        })
        .collect())
}

/// Labels as one comma-joined string (see [`INSERT_ITEMS`]).
fn joined(labels: &[Label]) -> String {
    labels.iter().map(Label::as_str).collect::<Vec<_>>().join(",")
}

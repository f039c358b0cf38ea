//! Retention: soft deletes, tenant policies, the sweep's candidates and batches, user erasure,
//! and the audit log reader. Anonymizing a row is one transaction per batch, so a crash leaves
//! each row either untouched or fully anonymized: content `[REDACTED]`, identity, metadata,
//! key, vectors (and those of the next turn, which held its words) and tool output payload
//! gone, full text empty (a generated column), a
//! `source_ref` that no longer names its identity and ends in `|anonymized`, and a
//! `memory.anonymize` audit row with the id and reason. The row itself stays, so supersede
//! chains stay intact.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use mnemo_core::{
    AnonymizeReason, AuditEvent, Label, Queue, RetentionPolicy, SafetyFloor, SessionId, TenantId, UserId, WorkspacePath,
};
use serde_json::Value;
use sqlx::AssertSqlSafe;
use uuid::Uuid;

use crate::embeddings::{embed_job, lock_text_counts};
use crate::queue::{RetentionJob, push};
use crate::{Store, StoreError};

/// A soft delete's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deleted {
    pub id: Uuid,
    pub deleted_at: DateTime<Utc>,
    /// The row was deleted (or anonymized) before this request.
    pub already: bool,
}

/// The times before which retired rows are due: now minus each TTL, by the database's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cutoffs {
    pub deleted_before: DateTime<Utc>,
    pub superseded_before: DateTime<Utc>,
}

/// What a sweep of one tenant has to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepPlan {
    pub cutoffs: Cutoffs,
    pub soft_deleted: u64,
    pub superseded: u64,
    /// Every row the tenant holds, anonymized ones included.
    pub tenant_rows: u64,
    /// Workspace file versions whose text is due for redaction (replaced, or current in a file
    /// deleted, before the soft TTL's cutoff); held to the safety floor on their own count.
    pub workspace_versions: u64,
    /// Every workspace file version the tenant holds, redacted ones included.
    pub tenant_versions: u64,
}

impl SweepPlan {
    pub fn due(&self) -> u64 {
        self.soft_deleted + self.superseded
    }

    /// Whether `floor` refuses this sweep unasked: its rows against the tenant's rows, or its
    /// workspace versions against the tenant's versions (a shortened TTL or a bulk delete of
    /// files empties their history as surely as it anonymizes rows).
    pub fn over(&self, floor: &SafetyFloor) -> bool {
        floor.refuses(self.due(), self.tenant_rows) || floor.refuses(self.workspace_versions, self.tenant_versions)
    }

    /// The smallest `--allow-large-sweep` that lets this sweep through: both counts.
    pub fn to_allow(&self) -> u64 {
        self.due().max(self.workspace_versions)
    }
}

/// What erasing a user touches: rows per kind, and the payloads and vectors behind them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ErasurePlan {
    pub rows_by_kind: BTreeMap<String, u64>,
    pub tool_outputs: u64,
    pub embeddings: u64,
    /// The user's workspace files (PROFILE.md, MEMORY.md, daily notes), removed with every
    /// version.
    pub workspace_files: u64,
    /// Other records naming the user in clear (`USER_RECORDS`): what is left of a user whose
    /// rows were all deleted and anonymized already.
    pub other_records: u64,
}

impl ErasurePlan {
    pub fn rows(&self) -> u64 {
        self.rows_by_kind.values().sum()
    }
}

/// A workspace file, as a retention sweep pages through them.
#[derive(Debug, Clone, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct FileCursor {
    pub agent_id: String,
    /// '' for the agent's own files.
    pub user_id: String,
    pub path: String,
}

/// One row of the audit log.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct AuditEntry {
    pub id: i64,
    #[sqlx(try_from = "String")]
    pub tenant_id: TenantId,
    #[sqlx(try_from = "String")]
    pub event: AuditEvent,
    pub item_id: Option<Uuid>,
    pub related_item_id: Option<Uuid>,
    pub reason: Option<String>,
    pub actor: String,
    pub details: Value,
    pub created_at: DateTime<Utc>,
}

/// Which audit rows to read; every field narrows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AuditFilter {
    pub tenant: Option<TenantId>,
    pub event: Option<AuditEvent>,
    /// Rows about this item, as subject or as the related item.
    pub item: Option<Uuid>,
    pub since: Option<DateTime<Utc>>,
    pub limit: i64,
}

/// Rows whose content is still there but that are retired: the partial index's predicate.
const RETIRED: &str = "m.anonymized_at IS NULL AND (m.deleted_at IS NOT NULL OR m.superseded_at IS NOT NULL)";

/// Of the tenant's ($1) retired rows, those due under cutoffs $2 (deleted) and $3 (superseded).
fn due_filter() -> String {
    format!("m.tenant_id = $1 AND {RETIRED} AND (m.deleted_at < $2 OR m.superseded_at < $3)")
}

/// A due row's reason: deletion first, as it is the caller's own decision.
const DUE_REASON: &str = "CASE WHEN m.deleted_at < $2 THEN 'soft_deleted' ELSE 'superseded' END";

/// Tenant `$1`'s workspace file versions whose text is due under cutoff `$2`, not yet redacted:
/// replaced by a version written before it, or current in a file deleted before it. Read through
/// `workspace_file_versions_unredacted_idx` (migration 41): about one entry per file.
macro_rules! due_versions {
    () => {
        "SELECT v.agent_id, v.user_id, v.path, v.version FROM workspace_file_versions v
         WHERE v.tenant_id = $1 AND v.redacted_at IS NULL
           AND (EXISTS (SELECT 1 FROM workspace_file_versions n
                        WHERE n.tenant_id = $1 AND n.agent_id = v.agent_id AND n.user_id = v.user_id
                          AND n.path = v.path AND n.version = v.version + 1 AND n.created_at < $2)
                OR EXISTS (SELECT 1 FROM workspace_files f
                           WHERE f.tenant_id = $1 AND f.agent_id = v.agent_id AND f.user_id = v.user_id
                             AND f.path = v.path AND f.version = v.version AND f.deleted_at < $2))"
    };
}

/// Tables besides rows and files that name a user in clear, erased with their workspace: their
/// extraction and consolidation state, and their sightings, which name the sessions they stated
/// memories in, on any row (another user's agent fact, too).
const USER_RECORDS: &[&str] = &["memory_extractions", "extraction_runs", "consolidation_state", "memory_sightings"];

/// The sessions of tenant `$1` whose summaries may hold user `$2`'s words: those the user has
/// rows in (or replies marked as theirs), and those a summary was made from the user's messages
/// in (named by the sha256 of the id, as the erasure's audit row names them; migration 38),
/// which may be anonymized since.
macro_rules! users_sessions {
    () => {
        concat!(
            "SELECT s.session_id FROM memory_items s
         WHERE s.tenant_id = $1 AND s.user_id = $2 AND s.session_id IS NOT NULL
         UNION
         SELECT s.session_id FROM memory_items s
         WHERE s.tenant_id = $1 AND s.reply_to_user_sha256 = ",
            user_sha256!("$2"),
            "
         UNION
         SELECT c.session_id FROM session_compactions c
         WHERE c.tenant_id = $1 AND ",
            user_sha256!("$2"),
            " = ANY(c.participants)"
        )
    };
}

/// A row `m` of tenant `$1` that summarizes a session user `$2`'s words may be in.
const SUMMARY_OF_USERS_SESSION: &str =
    concat!("m.source_kind = 'session_summary' AND m.session_id IN (", users_sessions!(), ")");

/// The rows that reply to a conversation row `u` carrying a user (joined LATERAL to it): those
/// carrying no user (an agent's, written with a service token) after it in its session, up to
/// the next row that carries one, deleted or not, and not marked as replies to another (see
/// `ANONYMIZE`): of them, extraction reads the assistant's as the user's (`SPOKEN` in
/// conversation.rs), an erasure takes them all. They may repeat what the user said, and once the user's row is gone they
/// would read as replies to the user before: an erasure takes them, and retention marks them. A
/// reply follows one nearest row, so counts of them add up.
macro_rules! replies_of {
    () => {
        "
SELECT r.id, r.source_kind
FROM (SELECT 1) one
LEFT JOIN LATERAL (
    SELECT p.event_time, p.id FROM memory_items p
    WHERE p.tenant_id = u.tenant_id AND p.session_id = u.session_id AND p.scope = 'session'
      AND p.source_kind IN ('chat_message', 'tool_output') AND p.user_id IS NOT NULL AND p.anonymized_at IS NULL
      AND p.event_time >= u.event_time AND (p.event_time, p.id) > (u.event_time, u.id)
    ORDER BY p.event_time, p.id LIMIT 1
) next ON true
-- Bounded by the next row in the index condition: read after, as a filter, the scan would run to
-- the session's end from each of the user's rows.
JOIN memory_items r
  ON r.tenant_id = u.tenant_id AND r.session_id = u.session_id AND r.scope = 'session'
 AND r.source_kind IN ('chat_message', 'tool_output') AND r.user_id IS NULL AND r.anonymized_at IS NULL
 AND r.reply_to_user_sha256 IS NULL
 AND r.event_time >= u.event_time AND r.event_time <= COALESCE(next.event_time, 'infinity')
 AND (r.event_time, r.id) > (u.event_time, u.id)
 AND (next.id IS NULL OR (r.event_time, r.id) < (next.event_time, next.id))
WHERE u.scope = 'session' AND u.source_kind IN ('chat_message', 'tool_output') AND u.user_id IS NOT NULL"
    };
}
const REPLIES_OF: &str = replies_of!();

/// Anonymizes rows `$2` (with reasons `$3`) of tenant `$1`, audited as event `$4` by actor `$5`.
/// Returns (id, source_kind, reason) of each row anonymized.
const ANONYMIZE: &str = concat!(
    "
WITH picked AS (SELECT * FROM unnest($2::uuid[], $3::text[]) AS p(id, reason)),
-- A user's message anonymized by retention names its user and session no more: the replies to it
-- (REPLIES_OF) keep the sha256 of the user it answered, so they stay that user's, for extraction
-- and for that user's erasure, instead of following the user before (migration 54). An erasure
-- takes the replies with the message instead.
-- The messages by an array, not a join: joined, the planner reads each reply's upper bound (the
-- next row carrying a user) as a filter, and a scan runs to its session's end.
marked AS (
    UPDATE memory_items x SET reply_to_user_sha256 = ",
    user_sha256!("u.user_id"),
    "
    FROM memory_items u CROSS JOIN LATERAL (",
    replies_of!(),
    "
    ) reply
    WHERE u.tenant_id = $1 AND u.id = ANY(ARRAY(SELECT id FROM picked WHERE reason <> 'erasure'))
      -- One probe (memory_items_unowned_turns_idx) before the replies are looked for: most
      -- messages have no row carrying no user after them.
      AND EXISTS (SELECT 1 FROM memory_items n
                  WHERE n.tenant_id = $1 AND n.session_id = u.session_id AND n.user_id IS NULL
                    AND n.scope = 'session' AND n.source_kind IN ('chat_message', 'tool_output')
                    AND n.anonymized_at IS NULL AND (n.event_time, n.id) > (u.event_time, u.id))
      AND x.tenant_id = $1 AND x.id = reply.id AND x.id <> ALL($2)
),
vectors AS (DELETE FROM memory_embeddings e USING picked WHERE e.tenant_id = $1 AND e.item_id = picked.id),
payloads AS (DELETE FROM tool_outputs t USING picked WHERE t.tenant_id = $1 AND t.item_id = picked.id),
sightings AS (DELETE FROM memory_sightings x USING picked WHERE x.tenant_id = $1 AND x.item_id = picked.id),
-- The rows' words leave their tenant's counts (migration 032), read from the full text as
-- it was before this statement (the caller holds the counts' lock, so no embedding of
-- these rows is half-counted); a word no other row holds is forgotten.
words AS (
    SELECT l, count(*) AS n FROM memory_items w JOIN picked ON w.tenant_id = $1 AND w.id = picked.id
    CROSS JOIN unnest(tsvector_to_array(w.tsv)) AS l
    GROUP BY l
),
forgotten AS (
    DELETE FROM tenant_lexemes c USING words
    WHERE c.tenant_id = $1 AND c.lexeme = words.l AND c.documents <= words.n
),
uncounted AS (
    UPDATE tenant_lexemes c SET documents = c.documents - words.n FROM words
    WHERE c.tenant_id = $1 AND c.lexeme = words.l AND c.documents > words.n
),
uncounted_rows AS (
    UPDATE tenant_text t SET documents = greatest(t.documents - x.n, 0), lexemes = greatest(t.lexemes - x.lexemes, 0)
    FROM (SELECT count(*) AS n, coalesce(sum(length(w.tsv)), 0) AS lexemes
          FROM memory_items w JOIN picked ON w.tenant_id = $1 AND w.id = picked.id
          WHERE w.tsv IS NOT NULL) x
    WHERE t.tenant_id = $1
),
anonymized AS (
    UPDATE memory_items m SET
        content = '[REDACTED]',
        content_sha256 = sha256('[REDACTED]'::bytea),
        session_id = NULL, user_id = NULL, agent_id = NULL,
        metadata = '{}'::jsonb, tool_output_key = NULL, fact_key = NULL,
        -- A tool's output names its tool, which is kept; any other message's name is its
        -- participant's (a user, an assistant, a system message's sender).
        tool_name = CASE WHEN m.role = 'tool' OR m.source_kind = 'tool_output' THEN m.tool_name END,
        -- Tags and the fingerprint are made of the content.
        tags = '{}', fingerprint = NULL,
        embedded_model = NULL, embed_error = NULL, embed_failing_since = NULL, reply_to_user_sha256 = NULL,
        -- A fact's ref is made of its identity and a hash of its content, a workspace
        -- note's of a hash of its agent and user and the file's path, a session
        -- summary's of its session and a hash of its text: replaced. Other refs are the
        -- caller's ids: kept, suffixed, and when a row already took the plain suffix, with
        -- '|anonymized|' and the row id between: no caller's ref holds '|anonymized|', so
        -- no plain suffix in the same batch can make the same key. Either way the key is
        -- free for a new write.
        source_ref = CASE
            WHEN m.source_kind = 'fact' THEN 'fact:' || m.scope || ':' || m.id || '|anonymized'
            WHEN m.source_kind = 'workspace_note' THEN 'workspace:' || m.id || '|anonymized'
            WHEN m.source_kind = 'session_summary' THEN 'session-summary:' || m.id || '|anonymized'
            WHEN EXISTS (
                SELECT 1 FROM memory_items x
                WHERE x.tenant_id = m.tenant_id AND x.source_kind = m.source_kind
                  AND x.source_ref = m.source_ref || '|anonymized'
            ) THEN m.source_ref || '|anonymized|' || m.id || '|anonymized'
            ELSE m.source_ref || '|anonymized'
        END,
        valid_to = CASE WHEN m.source_kind = 'fact' THEN COALESCE(m.valid_to, now()) END,
        deleted_at = CASE WHEN picked.reason = 'erasure' THEN COALESCE(m.deleted_at, now()) ELSE m.deleted_at END,
        anonymized_at = now()
    FROM picked
    WHERE m.id = picked.id AND m.tenant_id = $1
    RETURNING m.id, m.source_kind, picked.reason
),
audit AS (
    INSERT INTO audit_log (tenant_id, event, item_id, reason, actor)
    SELECT $1, $4, id, reason, $5 FROM anonymized
)
SELECT id, source_kind, reason FROM anonymized"
);

/// Drops the vectors made with the words of rows `$2` of tenant `$1` (a chat message is
/// embedded with the session's turn before it), read before those rows are anonymized (which
/// takes their session), deleted or not. A vector
/// that names no turn because it was made before migration 036 is taken to be made with the
/// turn before its row. Returns (id, tenant, content hash) of each live row that lost a vector.
/// The rows keep `embedded_model`: their full text, which that column gates, stays counted and
/// searchable while they are embedded again. Their attempts start again from none: failures of
/// an earlier embedding would stretch the new one's first backoff.
const DROP_VECTORS_MADE_WITH: &str = "
WITH turns AS (
    SELECT p.session_id, p.event_time, p.id FROM memory_items p
    WHERE p.tenant_id = $1 AND p.id = ANY($2) AND p.source_kind = 'chat_message' AND p.scope = 'session'
), next_turns AS (
    -- n's conditions hold the conversation index's predicate: one probe per turn.
    SELECT n.id FROM turns t CROSS JOIN LATERAL (
        SELECT n.id FROM memory_items n
        WHERE n.tenant_id = $1 AND n.session_id = t.session_id AND n.scope = 'session'
          AND n.source_kind IN ('chat_message', 'tool_output') AND n.deleted_at IS NULL AND n.anonymized_at IS NULL
          AND (n.event_time, n.id) > (t.event_time, t.id) AND n.source_kind = 'chat_message'
        ORDER BY n.event_time, n.id LIMIT 1
    ) n
), named AS (
    DELETE FROM memory_embeddings e
    WHERE e.tenant_id = $1 AND e.previous_id = ANY($2) AND e.item_id <> ALL($2)
    RETURNING e.item_id
), unnamed AS (
    -- By the key: the nil uuid is every such vector of the tenant.
    DELETE FROM memory_embeddings e USING next_turns n
    WHERE e.tenant_id = $1 AND e.item_id = n.id AND n.id <> ALL($2)
      AND e.previous_id = '00000000-0000-0000-0000-000000000000'
    RETURNING e.item_id
)
UPDATE memory_items m SET embed_attempts = 0
WHERE m.tenant_id = $1 AND m.id IN (SELECT item_id FROM named UNION SELECT item_id FROM unnamed)
  AND m.deleted_at IS NULL AND m.anonymized_at IS NULL
RETURNING m.id, m.tenant_id, m.content_sha256";

/// Drops the vectors that hold the words of rows `ids` of `tenant` (see
/// [`DROP_VECTORS_MADE_WITH`]), and queues their rows to embed again, in the caller's
/// transaction, which holds the tenant's text-count lock: a vector being saved meanwhile is
/// either seen here or refused for its turn (`SAVE_VECTORS`). Returns the rows queued.
pub(crate) async fn drop_vectors_made_with(
    tx: &mut sqlx::PgConnection,
    tenant: &TenantId,
    ids: &[Uuid],
) -> Result<Vec<Uuid>, StoreError> {
    let again: Vec<(Uuid, String, Vec<u8>)> =
        sqlx::query_as(DROP_VECTORS_MADE_WITH).bind(tenant.as_str()).bind(ids).fetch_all(&mut *tx).await?;
    let queued = again.iter().map(|(id, _, _)| *id).collect();
    push(&mut *tx, &again.into_iter().map(embed_job).collect::<Result<Vec<_>, _>>()?).await?;
    Ok(queued)
}

/// Anonymizes the rows `picked` (id, reason) of `tenant`, which the caller's transaction has
/// locked, with `actor` on their audit rows, and embeds again the rows whose vectors held their
/// words. The caller holds the tenant's text-count lock, taken before any row lock (embedding
/// takes it first too). Returns (id, source_kind, reason) of each row anonymized.
pub(crate) async fn anonymize(
    tx: &mut sqlx::PgConnection,
    tenant: &TenantId,
    picked: Vec<(Uuid, String)>,
    actor: &str,
) -> Result<Vec<(Uuid, String, String)>, StoreError> {
    if picked.is_empty() {
        return Ok(Vec::new());
    }
    let (ids, reasons): (Vec<Uuid>, Vec<String>) = picked.into_iter().unzip();
    drop_vectors_made_with(tx, tenant, &ids).await?;
    Ok(sqlx::query_as(ANONYMIZE)
        .bind(tenant.as_str())
        .bind(ids)
        .bind(reasons)
        .bind(AuditEvent::Anonymize.as_str())
        .bind(actor)
        .fetch_all(&mut *tx)
        .await?)
}

/// Anonymizes the soft-deleted rows `ids` of `tenant` now, in the caller's transaction, with
/// `actor` on their audit rows: rows whose content must not wait for the retention sweep. The
/// caller holds the tenant's text-count lock, taken before any row lock (embedding and erasure
/// take it first too).
pub(crate) async fn anonymize_ids(
    tx: &mut sqlx::PgConnection,
    tenant: &TenantId,
    ids: &[Uuid],
    actor: &str,
) -> Result<(), StoreError> {
    let picked = sqlx::query_as(
        "SELECT m.id, 'soft_deleted' FROM memory_items m
         WHERE m.tenant_id = $1 AND m.id = ANY($2) AND m.anonymized_at IS NULL
         ORDER BY m.id FOR UPDATE",
    )
    .bind(tenant.as_str())
    .bind(ids)
    .fetch_all(&mut *tx)
    .await?;
    anonymize(tx, tenant, picked, actor).await?;
    Ok(())
}

/// Soft-deletes row `$2` of tenant `$1` for the caller (`$3` its user, `$7` its session, `$6` its
/// roles; see [`Store::soft_delete`]), with an audit row (`$5`, reason `$4`) when first deleted.
/// A user may delete a session's summary only when every compaction of the session summarized
/// their words alone (`participants`, migration 38; a record that names nobody, made before it or
/// emptied by erasures, holds another user's words when another user's message, or a reply
/// marked as answering another user, is in the session).
const SOFT_DELETE: &str = concat!(
    "
WITH target AS (
    SELECT t.id, COALESCE(t.deleted_at, t.anonymized_at) AS deleted_at,
           t.deleted_at IS NOT NULL OR t.anonymized_at IS NOT NULL AS already
    FROM memory_items t
    WHERE t.tenant_id = $1 AND t.id = $2
      AND ($3::text IS NULL OR (t.user_id = $3 AND (t.source_kind <> 'session_summary' OR NOT EXISTS (
          SELECT 1 FROM session_compactions c
          WHERE c.tenant_id = $1 AND c.session_id = t.session_id
            AND (NOT c.participants <@ ARRAY[",
    user_sha256!("$3"),
    "] OR (c.participants = '{}' AND c.outcome = 'summarized' AND EXISTS (
                -- Named nobody: made before migration 38, from messages carrying no user, or
                -- every writer erased since. Another user's message (deleted ones too), or a
                -- reply marked as another's when their message was anonymized (migration 54),
                -- says whose words it may hold.
                SELECT 1 FROM memory_items o
                WHERE o.tenant_id = $1 AND o.session_id = t.session_id AND o.scope = 'session'
                  AND o.source_kind IN ('chat_message', 'tool_output')
                  AND (o.user_id <> $3 OR o.reply_to_user_sha256 <> ",
    user_sha256!("$3"),
    "))))))))
      AND ($7::text IS NULL OR t.session_id = $7 OR ($3::text IS NOT NULL AND t.scope <> 'session'))
      AND (t.allowed_roles = '{}' OR t.allowed_roles && $6::text[] OR (t.scope = 'user' AND t.user_id = $3))
    FOR UPDATE OF t
), deleted AS (
    UPDATE memory_items m
    SET deleted_at = now(),
        valid_to = CASE WHEN m.source_kind = 'fact' THEN COALESCE(m.valid_to, now()) END
    FROM target WHERE m.tenant_id = $1 AND m.id = target.id AND NOT target.already
    RETURNING m.id
), audit AS (
    INSERT INTO audit_log (tenant_id, event, item_id, reason, actor)
    SELECT $1, $5, id, $4, 'api' FROM deleted
)
SELECT id, COALESCE(deleted_at, now()), already FROM target"
);

impl Store {
    /// Soft-deletes a row of `tenant`. With `only_user`, only a row carrying that user (a user's
    /// token may delete only its own rows), and a session's summary only when it summarized that
    /// user's words alone (it carries the last user it covers, for their erasure, but holds
    /// everyone's words in the session); with
    /// `only_session`, only a row of that session (a token bound to a session reaches no other),
    /// or with `only_user` too, a row of no session. `None` when no such row exists for the
    /// caller. The row leaves recall at once, and so do its words in the vector of the
    /// message after it (embedded with its previous turn), which is embedded again; a fact's
    /// validity ends. Audited once, when first deleted.
    pub async fn soft_delete(
        &self,
        tenant: &TenantId,
        id: Uuid,
        only_user: Option<&UserId>,
        only_session: Option<&SessionId>,
        roles: &[Label],
        requested_by: &str,
    ) -> Result<Option<Deleted>, StoreError> {
        let mut conn = self.tenant_connection([tenant.as_str()]).await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        // A session's rows need the tenant's text-count lock: a chat message is another vector's
        // previous turn (`ROWS_TO_EMBED`), and a compaction records its summary of the session's
        // rows under the lock, checking they are unchanged. A row's scope never changes: deleting
        // a fact or a document chunk takes no lock the embed worker's saves wait on.
        let in_a_session: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM memory_items WHERE tenant_id = $1 AND id = $2 AND scope = 'session')",
        )
        .bind(tenant.as_str())
        .bind(id)
        .fetch_one(&mut *tx)
        .await?;
        if in_a_session {
            // Before any row lock, as embedding takes it (see `drop_vectors_made_with`).
            lock_text_counts(&mut tx, &[tenant.as_str().to_owned()]).await?;
        }
        let row: Option<(Uuid, DateTime<Utc>, bool)> = sqlx::query_as(SOFT_DELETE)
            .bind(tenant.as_str())
            .bind(id)
            .bind(only_user.map(UserId::as_str))
            .bind(requested_by)
            .bind(AuditEvent::Delete.as_str())
            .bind(roles.iter().map(Label::as_str).collect::<Vec<_>>())
            .bind(only_session.map(SessionId::as_str))
            .fetch_optional(&mut *tx)
            .await?;
        if let (Some((id, _, false)), true) = (row, in_a_session) {
            drop_vectors_made_with(&mut tx, tenant, &[id]).await?;
        }
        tx.commit().await?;
        Ok(row.map(|(id, deleted_at, already)| Deleted { id, deleted_at, already }))
    }

    /// The tenant's retention policy, each missing or invalid field from `defaults`, with a
    /// warning for every value ignored.
    pub async fn retention_policy(
        &self,
        tenant: &TenantId,
        defaults: RetentionPolicy,
    ) -> Result<(RetentionPolicy, Vec<String>), StoreError> {
        let settings = self.retention_settings(tenant).await?;
        Ok(RetentionPolicy::for_tenant(tenant.as_str(), settings.as_ref(), defaults))
    }

    /// The tenant's retention settings as stored (the `memory_retention` object), if any.
    pub async fn retention_settings(&self, tenant: &TenantId) -> Result<Option<Value>, StoreError> {
        let settings: Option<Option<Value>> =
            sqlx::query_scalar("SELECT settings -> 'memory_retention' FROM tenant_config WHERE tenant_id = $1")
                .bind(tenant.as_str())
                .fetch_optional(&self.pool)
                .await?;
        Ok(settings.flatten())
    }

    /// Whether the tenant holds a memory or a workspace file: an operator's command naming one
    /// that holds neither may have a typo in it.
    pub async fn tenant_holds_data(&self, tenant: &TenantId) -> Result<bool, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM memory_items WHERE tenant_id = $1)
                 OR EXISTS (SELECT 1 FROM workspace_files WHERE tenant_id = $1)",
        )
        .bind(tenant.as_str())
        .fetch_one(&self.pool)
        .await?)
    }

    /// Sets the fields of `set` and removes those of `unset` in the tenant's retention settings,
    /// keeping its other fields and settings, with a `tenant.retention_policy` audit row naming
    /// the values set and the fields removed (numbers and names only); one transaction, which
    /// writes nothing when the settings stay what they were (a tenant without any has `{}`).
    /// Returns the settings now.
    pub async fn change_retention_settings(
        &self,
        tenant: &TenantId,
        set: &serde_json::Map<String, Value>,
        unset: &[&str],
        actor: &str,
    ) -> Result<Value, StoreError> {
        let mut tx = self.pool.begin().await?;
        let before: Option<Option<Value>> = sqlx::query_scalar(
            "SELECT settings -> 'memory_retention' FROM tenant_config WHERE tenant_id = $1 FOR UPDATE",
        )
        .bind(tenant.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        // A stored value that is not an object is replaced: the sweep ignores it anyway.
        let now: Value = sqlx::query_scalar(
            "INSERT INTO tenant_config (tenant_id, settings)
             VALUES ($1, jsonb_build_object('memory_retention', $2::jsonb - $3::text[]))
             ON CONFLICT (tenant_id) DO UPDATE
             SET settings = jsonb_set(tenant_config.settings, '{memory_retention}',
                   (CASE WHEN jsonb_typeof(tenant_config.settings -> 'memory_retention') = 'object'
                         THEN tenant_config.settings -> 'memory_retention' ELSE '{}' END || $2::jsonb) - $3::text[]),
                 updated_at = now()
             RETURNING settings -> 'memory_retention'",
        )
        .bind(tenant.as_str())
        .bind(Value::Object(set.clone()))
        .bind(unset)
        .fetch_one(&mut *tx)
        .await?;
        if before.flatten().unwrap_or_else(|| Value::Object(Default::default())) == now {
            tx.rollback().await?;
            return Ok(now);
        }
        sqlx::query(
            "INSERT INTO audit_log (tenant_id, event, reason, actor, details) VALUES ($1, $2, 'changed', $3, $4)",
        )
        .bind(tenant.as_str())
        .bind(AuditEvent::RetentionPolicy.as_str())
        .bind(actor)
        .bind(serde_json::json!({ "set": set, "unset": unset }))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(now)
    }

    /// Counts what a sweep of `tenant` under `policy` would anonymize now, and the tenant's rows.
    pub async fn sweep_plan(&self, tenant: &TenantId, policy: &RetentionPolicy) -> Result<SweepPlan, StoreError> {
        let (deleted_before, superseded_before): (DateTime<Utc>, DateTime<Utc>) =
            sqlx::query_as("SELECT now() - make_interval(days => $1), now() - make_interval(days => $2)")
                .bind(i32::try_from(policy.soft_ttl_days).unwrap_or(i32::MAX))
                .bind(i32::try_from(policy.superseded_ttl_days).unwrap_or(i32::MAX))
                .fetch_one(&self.pool)
                .await?;
        let cutoffs = Cutoffs { deleted_before, superseded_before };
        let (soft_deleted, due): (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*) FILTER (WHERE m.deleted_at < $2), count(*) FROM memory_items m WHERE {}",
            due_filter()
        )))
        .bind(tenant.as_str())
        .bind(deleted_before)
        .bind(superseded_before)
        .fetch_one(&self.pool)
        .await?;
        let tenant_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM memory_items WHERE tenant_id = $1")
            .bind(tenant.as_str())
            .fetch_one(&self.pool)
            .await?;
        let versions: i64 = sqlx::query_scalar(concat!("SELECT count(*) FROM (", due_versions!(), ") d"))
            .bind(tenant.as_str())
            .bind(deleted_before)
            .fetch_one(&self.pool)
            .await?;
        let tenant_versions: i64 =
            sqlx::query_scalar("SELECT count(*) FROM workspace_file_versions WHERE tenant_id = $1")
                .bind(tenant.as_str())
                .fetch_one(&self.pool)
                .await?;
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(SweepPlan {
            cutoffs,
            soft_deleted: n(soft_deleted),
            superseded: n(due - soft_deleted),
            tenant_rows: n(tenant_rows),
            workspace_versions: n(versions),
            tenant_versions: n(tenant_versions),
        })
    }

    /// Redacts the due versions (under `cutoff`, the soft TTL's) of the next workspace file of
    /// `tenant` after `after` (agent, user, path) that has any, the oldest `at_most` of them, in
    /// one transaction under the file's lock, as a write takes it: content '' and `redacted_at`,
    /// the file's own copy too when it is deleted and its last version is among them, and one
    /// `workspace.change` audit row (`redacted`, the versions). The rows stay, so the history
    /// still says who changed the file and when. Returns the file and how many versions it
    /// redacted; `None` when no file after `after` has any.
    pub async fn redact_due_versions(
        &self,
        tenant: &TenantId,
        cutoff: DateTime<Utc>,
        after: &FileCursor,
        at_most: u64,
        actor: &str,
    ) -> Result<Option<(FileCursor, u64)>, StoreError> {
        let next: Option<FileCursor> = sqlx::query_as(concat!(
            "SELECT agent_id, user_id, path FROM (",
            due_versions!(),
            ") d WHERE (agent_id, user_id, path) > ($3, $4, $5) ORDER BY agent_id, user_id, path LIMIT 1"
        ))
        .bind(tenant.as_str())
        .bind(cutoff)
        .bind(&after.agent_id)
        .bind(&after.user_id)
        .bind(&after.path)
        .fetch_optional(&self.pool)
        .await?;
        let Some(file) = next else { return Ok(None) };
        let mut tx = self.pool.begin().await?;
        let (agent, user, path) = (file.agent_id.as_str(), file.user_id.as_str(), file.path.as_str());
        crate::workspace::lock_stored(&mut tx, tenant.as_str(), agent, user, path).await?;
        // Due again under the lock: the file may have changed since it was picked.
        let versions: Vec<i32> = sqlx::query_scalar(concat!(
            "UPDATE workspace_file_versions s SET content = '', redacted_at = now()
             FROM (SELECT * FROM (",
            due_versions!(),
            ") due WHERE due.agent_id = $3 AND due.user_id = $4 AND due.path = $5 ORDER BY due.version LIMIT $6) d
             WHERE s.tenant_id = $1 AND s.agent_id = d.agent_id AND s.user_id = d.user_id AND s.path = d.path
               AND s.version = d.version
             RETURNING s.version"
        ))
        .bind(tenant.as_str())
        .bind(cutoff)
        .bind(&file.agent_id)
        .bind(&file.user_id)
        .bind(&file.path)
        .bind(i64::try_from(at_most).unwrap_or(i64::MAX))
        .fetch_all(&mut *tx)
        .await?;
        // A deleted file's row holds its last text too, emptied with that version;
        // `updated_at` carries the change to a copy (an import replaces a file changed later).
        // No row: the user was erased meanwhile.
        let id: Option<Uuid> = sqlx::query_scalar(
            "WITH emptied AS (
                 UPDATE workspace_files SET content = '', size_bytes = 0, updated_at = now()
                 WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3 AND path = $4
                   AND deleted_at < $5 AND content <> '' AND version = ANY($6))
             SELECT id FROM workspace_files WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3 AND path = $4",
        )
        .bind(tenant.as_str())
        .bind(&file.agent_id)
        .bind(&file.user_id)
        .bind(&file.path)
        .bind(cutoff)
        .bind(&versions)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(id) = id.filter(|_| !versions.is_empty()) {
            let standard = WorkspacePath::parse(path).is_ok_and(|p| p.is_standard_name());
            let mut details = crate::workspace::audited_file(agent, user, path, standard);
            details["versions"] = serde_json::json!(versions);
            crate::workspace::audit_change(&mut tx, tenant.as_str(), id, "redacted", actor, details).await?;
        }
        tx.commit().await?;
        Ok(Some((file, versions.len() as u64)))
    }

    /// Up to `limit` rows a sweep with `cutoffs` would anonymize, with their reasons, by id.
    pub async fn due_rows(
        &self,
        tenant: &TenantId,
        cutoffs: Cutoffs,
        limit: i64,
    ) -> Result<Vec<(Uuid, AnonymizeReason)>, StoreError> {
        let rows: Vec<(Uuid, String)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT m.id, {DUE_REASON} FROM memory_items m WHERE {} ORDER BY m.id LIMIT $4",
            due_filter()
        )))
        .bind(tenant.as_str())
        .bind(cutoffs.deleted_before)
        .bind(cutoffs.superseded_before)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|(id, r)| (id, reason(&r))).collect())
    }

    /// Anonymizes up to `limit` due rows of `tenant` with ids after `after`, in one transaction.
    /// Rows another sweep holds are skipped (it is anonymizing them). Returns each row anonymized
    /// with its reason. Callers page by id: the index keeps entries of rows already anonymized
    /// until vacuum, and starting every batch from the first id would walk them all again.
    pub async fn anonymize_due(
        &self,
        tenant: &TenantId,
        cutoffs: Cutoffs,
        after: Uuid,
        limit: i64,
        actor: &str,
    ) -> Result<Vec<(Uuid, AnonymizeReason)>, StoreError> {
        let mut tx = self.pool.begin().await?;
        lock_text_counts(&mut tx, &[tenant.as_str().to_owned()]).await?;
        let picked = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT m.id, {DUE_REASON} FROM memory_items m WHERE {} AND m.id > $5
             ORDER BY m.id LIMIT $4 FOR UPDATE SKIP LOCKED",
            due_filter()
        )))
        .bind(tenant.as_str())
        .bind(cutoffs.deleted_before)
        .bind(cutoffs.superseded_before)
        .bind(limit)
        .bind(after)
        .fetch_all(&mut *tx)
        .await?;
        let rows = anonymize(&mut tx, tenant, picked, actor).await?;
        tx.commit().await?;
        Ok(rows.into_iter().map(|(id, _, r)| (id, reason(&r))).collect())
    }

    /// What erasing `user` of `tenant` would anonymize.
    pub async fn erasure_plan(&self, tenant: &TenantId, user: &UserId) -> Result<ErasurePlan, StoreError> {
        // The user's rows and the replies to them, then the summaries of their sessions that
        // another writer stamped: selections each on its index (under one OR, the tenant's every
        // row is read).
        let kinds: Vec<(String, i64, i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
            "WITH erased AS (
                 SELECT id, source_kind FROM memory_items WHERE tenant_id = $1 AND user_id = $2
                 UNION ALL
                 SELECT r.id, r.source_kind FROM memory_items u CROSS JOIN LATERAL ({REPLIES_OF}) r
                 WHERE u.tenant_id = $1 AND u.user_id = $2 AND u.anonymized_at IS NULL
                 UNION ALL
                 SELECT id, source_kind FROM memory_items WHERE tenant_id = $1 AND reply_to_user_sha256 = {hash}
                 UNION ALL
                 SELECT m.id, m.source_kind FROM memory_items m
                 WHERE m.tenant_id = $1 AND {SUMMARY_OF_USERS_SESSION} AND m.user_id IS DISTINCT FROM $2
                   AND m.anonymized_at IS NULL
             )
             SELECT source_kind, count(*),
                    (SELECT count(*) FROM tool_outputs t JOIN erased e ON t.item_id = e.id WHERE t.tenant_id = $1),
                    (SELECT count(*) FROM memory_embeddings v JOIN erased e ON v.item_id = e.id WHERE v.tenant_id = $1)
             FROM erased GROUP BY 1",
            hash = user_sha256!("$2"),
        )))
        .bind(tenant.as_str())
        .bind(user.as_str())
        .fetch_all(&self.pool)
        .await?;
        // Each row of the answer repeats the two totals.
        let (tool_outputs, embeddings) = kinds.first().map_or((0, 0), |k| (k.2, k.3));
        let workspace_files: i64 =
            sqlx::query_scalar("SELECT count(*) FROM workspace_files WHERE tenant_id = $1 AND user_id = $2")
                .bind(tenant.as_str())
                .bind(user.as_str())
                .fetch_one(&self.pool)
                .await?;
        let counts: Vec<String> = USER_RECORDS
            .iter()
            .map(|table| format!("(SELECT count(*) FROM {table} WHERE tenant_id = $1 AND user_id = $2)"))
            .collect();
        let other_records: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT {}", counts.join(" + "))))
            .bind(tenant.as_str())
            .bind(user.as_str())
            .fetch_one(&self.pool)
            .await?;
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(ErasurePlan {
            rows_by_kind: kinds.into_iter().map(|(kind, count, _, _)| (kind, n(count))).collect(),
            tool_outputs: n(tool_outputs),
            embeddings: n(embeddings),
            workspace_files: n(workspace_files),
            other_records: n(other_records),
        })
    }

    /// Removes the user's workspace files with every version, their extraction and
    /// consolidation state, and the extraction and consolidation jobs naming them (running
    /// ones too), in one transaction: an erasure keeps no copy of what they said, nor their id in
    /// clear. Returns the files removed.
    pub async fn erase_user_workspace(&self, tenant: &TenantId, user: &UserId) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin().await?;
        crate::workspace::lock_user_files(&mut tx, tenant, user).await?;
        // Before any delete, so it waits holding no row: a schedule under way may be queueing the user.
        crate::consolidation::share_schedule(&mut tx).await?;
        for table in ["workspace_file_versions"].iter().chain(USER_RECORDS) {
            sqlx::query(AssertSqlSafe(format!("DELETE FROM {table} WHERE tenant_id = $1 AND user_id = $2")))
                .bind(tenant.as_str())
                .bind(user.as_str())
                .execute(&mut *tx)
                .await?;
        }
        // Running ones too: the run finds nothing pending and takes no run (see the runners),
        // and apalis' acknowledgement of a row gone changes nothing. Locked in id order, as that
        // acknowledgement locks a batch: a worker acknowledging two of them at once waits for the
        // erasure, or the erasure for it.
        sqlx::query(
            "DELETE FROM apalis.jobs WHERE id IN (
                 SELECT id FROM apalis.jobs
                 WHERE job_type = ANY($3)
                   AND convert_from(job, 'UTF8')::jsonb @> jsonb_build_object('tenant_id', $1::text, 'user_id', $2::text)
                 ORDER BY id FOR UPDATE)",
        )
        .bind(tenant.as_str())
        .bind(user.as_str())
        .bind([Queue::Extract.as_str(), Queue::Consolidate.as_str()])
        .execute(&mut *tx)
        .await?;
        let files = sqlx::query("DELETE FROM workspace_files WHERE tenant_id = $1 AND user_id = $2")
            .bind(tenant.as_str())
            .bind(user.as_str())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(files)
    }

    /// Takes the user whose hash is `user_sha256` out of the writers the tenant's compaction
    /// records name, once their erasure has taken the summaries: a later summary of those
    /// sessions holds none of their words, and erasing them again must not take it.
    pub async fn forget_summary_writer(&self, tenant: &TenantId, user_sha256: &str) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE session_compactions SET participants = array_remove(participants, $2)
             WHERE tenant_id = $1 AND $2 = ANY(participants)",
        )
        .bind(tenant.as_str())
        .bind(user_sha256)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The sessions whose summaries may hold `user`'s words, read before an erasure anonymizes
    /// their rows (an anonymized row names no session).
    pub async fn user_sessions(&self, tenant: &TenantId, user: &UserId) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(users_sessions!())
            .bind(tenant.as_str())
            .bind(user.as_str())
            .fetch_all(&self.pool)
            .await?)
    }

    /// Soft-deletes and anonymizes the summaries of `sessions`, whoever they name: a summary is
    /// stamped with one writer but holds every speaker's words. Returns (id, source_kind) of each.
    pub async fn erase_session_summaries(
        &self,
        tenant: &TenantId,
        sessions: &[String],
        actor: &str,
    ) -> Result<Vec<(Uuid, String)>, StoreError> {
        let mut tx = self.pool.begin().await?;
        lock_text_counts(&mut tx, &[tenant.as_str().to_owned()]).await?;
        let picked = sqlx::query_as(
            "SELECT m.id, 'erasure' FROM memory_items m
             WHERE m.tenant_id = $1 AND m.scope = 'session' AND m.session_id = ANY($2)
               AND m.source_kind = 'session_summary' AND m.anonymized_at IS NULL
             ORDER BY m.id FOR UPDATE",
        )
        .bind(tenant.as_str())
        .bind(sessions)
        .fetch_all(&mut *tx)
        .await?;
        let rows = anonymize(&mut tx, tenant, picked, actor).await?;
        tx.commit().await?;
        Ok(rows.into_iter().map(|(id, kind, _)| (id, kind)).collect())
    }

    /// Soft-deletes and anonymizes rows carrying `user` with ids after `after` and the replies to
    /// them ([`REPLIES_OF`]), at most `limit` in one transaction, waiting for rows others hold
    /// (an erasure must not skip any). A row goes after its replies, in the same transaction or
    /// a later one, so none is left behind its row (a long run of tool rows after one message
    /// may fill a transaction alone). Returns (id, source_kind) of each, and where the next page
    /// starts (`after` again when only replies were taken; `None` when nothing was left).
    pub async fn erase_user_rows(
        &self,
        tenant: &TenantId,
        user: &UserId,
        after: Uuid,
        limit: i64,
        actor: &str,
    ) -> Result<(Vec<(Uuid, String)>, Option<Uuid>), StoreError> {
        let mut tx = self.pool.begin().await?;
        lock_text_counts(&mut tx, &[tenant.as_str().to_owned()]).await?;
        let found: Vec<(Uuid, Uuid, bool)> = sqlx::query_as(AssertSqlSafe(format!(
            "WITH mine AS (
                 SELECT m.tenant_id, m.id, m.session_id, m.scope, m.source_kind, m.event_time, m.user_id
                 FROM memory_items m
                 WHERE m.tenant_id = $1 AND (m.user_id = $2 OR m.reply_to_user_sha256 = {hash})
                   AND m.anonymized_at IS NULL AND m.id > $4
                 ORDER BY m.id LIMIT $3 FOR UPDATE
             )
             SELECT id, id AS owner, true AS mine FROM mine
             UNION ALL
             SELECT r.id, u.id, false FROM mine u CROSS JOIN LATERAL ({REPLIES_OF}) r
             ORDER BY owner, mine, id",
            hash = user_sha256!("$2"),
        )))
        .bind(tenant.as_str())
        .bind(user.as_str())
        .bind(limit)
        .bind(after)
        .fetch_all(&mut *tx)
        .await?;
        let taken = &found[..found.len().min(usize::try_from(limit.max(1)).unwrap_or(usize::MAX))];
        // The last of the user's rows taken; replies alone continue from where this page began.
        let last = taken.iter().rev().find(|(_, _, mine)| *mine).map(|(_, owner, _)| *owner);
        let next = last.or((!taken.is_empty()).then_some(after));
        let picked = taken.iter().map(|(id, _, _)| (*id, "erasure".to_owned())).collect();
        let rows = anonymize(&mut tx, tenant, picked, actor).await?;
        tx.commit().await?;
        Ok((rows.into_iter().map(|(id, kind, _)| (id, kind)).collect(), next))
    }

    /// Writes one audit row about a tenant rather than an item (a refused or allowed sweep, an
    /// erasure). `details` holds counts and hashes, never content.
    pub async fn audit(
        &self,
        tenant: &TenantId,
        event: AuditEvent,
        reason: &str,
        actor: &str,
        details: Value,
    ) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO audit_log (tenant_id, event, reason, actor, details) VALUES ($1, $2, $3, $4, $5)")
            .bind(tenant.as_str())
            .bind(event.as_str())
            .bind(reason)
            .bind(actor)
            .bind(details)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// When the user whose hash is `user_sha256` was last erased from `tenant`, if ever.
    pub async fn last_erasure(
        &self,
        tenant: &TenantId,
        user_sha256: &str,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT max(created_at) FROM audit_log
             WHERE tenant_id = $1 AND event = $2 AND details ->> 'user_sha256' = $3",
        )
        .bind(tenant.as_str())
        .bind(AuditEvent::Erase.as_str())
        .bind(user_sha256)
        .fetch_one(&self.pool)
        .await?)
    }

    /// When an erasure of the user whose hash is `user_sha256` began in `tenant` and never
    /// finished (no `memory.erase` row since its `memory.erase.begun` row), if one did.
    pub async fn unfinished_erasure(
        &self,
        tenant: &TenantId,
        user_sha256: &str,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT begun.created_at FROM audit_log begun
             WHERE begun.tenant_id = $1 AND begun.event = $2 AND begun.details ->> 'user_sha256' = $4
               AND NOT EXISTS (SELECT FROM audit_log done
                               WHERE done.tenant_id = $1 AND done.event = $3
                                 AND done.details ->> 'user_sha256' = $4 AND done.created_at >= begun.created_at)
             ORDER BY begun.created_at DESC LIMIT 1",
        )
        .bind(tenant.as_str())
        .bind(AuditEvent::EraseBegun.as_str())
        .bind(AuditEvent::Erase.as_str())
        .bind(user_sha256)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Audit rows, newest first.
    pub async fn audit_entries(&self, filter: &AuditFilter) -> Result<Vec<AuditEntry>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT id, tenant_id, event, item_id, related_item_id, reason, actor, details, created_at
             FROM audit_log
             WHERE ($1::text IS NULL OR tenant_id = $1)
               AND ($2::text IS NULL OR event = $2)
               AND ($3::uuid IS NULL OR item_id = $3 OR related_item_id = $3)
               AND ($4::timestamptz IS NULL OR created_at >= $4)
             ORDER BY created_at DESC, id DESC
             LIMIT $5",
        )
        .bind(filter.tenant.as_ref().map(TenantId::as_str))
        .bind(filter.event.map(AuditEvent::as_str))
        .bind(filter.item)
        .bind(filter.since)
        .bind(filter.limit)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Schedules retention tick `tick`: one sweep row and one job per tenant holding retired rows
    /// or workspace text to redact in time, unless the tick is scheduled already. Returns the tenants scheduled. (Not "or a later
    /// one": a longer `MNEMO_ANONYMIZE_INTERVAL_S` makes tick numbers smaller, and would stop
    /// every sweep until the old rows were pruned.)
    pub async fn schedule_retention(&self, tick: i64) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin().await?;
        let scheduled: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM retention_sweeps WHERE tick = $1)")
            .bind(tick)
            .fetch_one(&mut *tx)
            .await?;
        if scheduled {
            return Ok(0);
        }
        let tenants: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
            "INSERT INTO retention_sweeps (tenant_id, tick)
             SELECT m.tenant_id, $1::bigint FROM memory_items m WHERE {RETIRED}
             UNION
             -- Workspace text that will be due: replaced versions, and deleted files.
             SELECT v.tenant_id, $1::bigint FROM workspace_file_versions v
             JOIN workspace_files f ON f.tenant_id = v.tenant_id AND f.agent_id = v.agent_id
                                   AND f.user_id = v.user_id AND f.path = v.path
             WHERE v.redacted_at IS NULL AND (v.version < f.version OR f.deleted_at IS NOT NULL)
             ON CONFLICT DO NOTHING
             RETURNING tenant_id"
        )))
        .bind(tick)
        .fetch_all(&mut *tx)
        .await?;
        let jobs = tenants
            .iter()
            .map(|tenant| Ok(RetentionJob { tenant_id: TenantId::parse(tenant)?, tick }))
            .collect::<Result<Vec<_>, StoreError>>()?;
        push(&mut tx, &jobs).await?;
        tx.commit().await?;
        Ok(tenants.len() as u64)
    }

    /// Marks a scheduled sweep as started by `worker`. `false` when it finished already (a job
    /// delivered twice), so the caller does nothing.
    pub async fn start_retention_sweep(&self, job: &RetentionJob, worker: &str) -> Result<bool, StoreError> {
        let started = sqlx::query(
            "UPDATE retention_sweeps SET worker = $3, started_at = now()
             WHERE tenant_id = $1 AND tick = $2 AND finished_at IS NULL",
        )
        .bind(job.tenant_id.as_str())
        .bind(job.tick)
        .bind(worker)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(started == 1)
    }

    /// Queues the job again, to go on with a sweep that stopped at its time limit.
    pub async fn continue_retention_sweep(&self, job: &RetentionJob) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await?;
        push(&mut conn, std::slice::from_ref(job)).await
    }

    /// Adds a sweep job's work to its sweep row; with `result` (done, dry_run, refused), the
    /// sweep is finished.
    pub async fn record_retention_sweep(
        &self,
        job: &RetentionJob,
        anonymized: u64,
        result: Option<&str>,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE retention_sweeps
             SET anonymized = COALESCE(anonymized, 0) + $4, result = $3,
                 finished_at = CASE WHEN $3::text IS NULL THEN NULL ELSE now() END
             WHERE tenant_id = $1 AND tick = $2",
        )
        .bind(job.tenant_id.as_str())
        .bind(job.tick)
        .bind(result)
        .bind(i64::try_from(anonymized).unwrap_or(i64::MAX))
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

/// The reason column the statements above write; they write only known reasons.
fn reason(raw: &str) -> AnonymizeReason {
    AnonymizeReason::parse(raw).unwrap_or(AnonymizeReason::SoftDeleted)
}

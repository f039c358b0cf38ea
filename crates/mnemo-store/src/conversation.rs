//! A session's conversation: its chat messages and tool outputs in the one order every reader
//! uses (event time, then write order: ids are time-ordered UUIDv7s), and its compactions: where
//! the window starts, the summary in effect, and the compaction asked for.

use std::time::Duration;

use chrono::{DateTime, Utc};
use mnemo_core::{
    AgentId, AuditEvent, CompactionOutcome, CompactionTrigger, Keep, Queue, Role, SessionId, SourceKind, TenantId,
    TokenCounter, TriggerSource, USER_SYSTEM_PREFIX, UserId, WindowMessage, Workspace, sendable_call_id,
};
use uuid::Uuid;

use crate::embeddings::lock_text_counts;
use crate::extraction::request_extraction_in;
use crate::queue::{CompactJob, push, push_after};
use crate::retention::anonymize_ids;
use crate::{Store, StoreError};

/// One message of a session, as stored.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct SessionMessage {
    pub id: Uuid,
    #[sqlx(try_from = "String")]
    pub source_kind: SourceKind,
    #[sqlx(try_from = "String")]
    pub role: Role,
    pub content: String,
    pub tool_call_id: Option<String>,
    pub tool_name: Option<String>,
    /// `None` for rows written before token counts were kept.
    pub token_count: Option<i32>,
    /// The tokenizer that made `token_count`.
    pub token_counter: Option<String>,
    pub event_time: DateTime<Utc>,
    pub user_id: Option<String>,
    pub agent_id: Option<String>,
    /// On a reply carrying no user: the sha256 of the user whose message it answered, once
    /// retention anonymized that message (migration 54).
    pub reply_to_user_sha256: Option<String>,
}

/// Of a session's `messages` (oldest first), those extraction reads as `user`'s, by `SPOKEN`'s
/// rule as far as these messages show it: their chat messages and the assistant's carrying no
/// user that open them, follow theirs, or are marked as replies to them; no tool call or result.
/// A user's message carrying no user is nobody's. The extraction gates of a completion and of a
/// compaction read these.
pub fn spoken_by<'a>(messages: &'a [SessionMessage], user: &UserId) -> Vec<&'a SessionMessage> {
    let hash = user.sha256();
    let mut last: Option<&str> = None;
    messages
        .iter()
        .filter(|m| {
            // Any row carrying a user makes the replies after it theirs, as `SPOKEN` looks back.
            let owned = match (m.user_id.as_deref(), m.reply_to_user_sha256.as_deref()) {
                (Some(writer), _) => {
                    last = Some(writer);
                    writer == user.as_str()
                }
                (None, _) if m.role != Role::Assistant => false,
                (None, Some(answered)) => answered == hash,
                (None, None) => last.is_none_or(|writer| writer == user.as_str()),
            };
            owned
                && m.source_kind == SourceKind::ChatMessage
                && m.tool_call_id.is_none()
                && matches!(m.role, Role::User | Role::Assistant)
        })
        .collect()
}

/// Where a page of messages starts: after this message. Ordered as a session's messages are,
/// by time then id (a `Uuid` orders by its bytes, as PostgreSQL orders uuids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct MessageCursor {
    pub event_time: DateTime<Utc>,
    pub id: Uuid,
}

impl MessageCursor {
    /// The cursor just after this message: as a read's `before` bound it includes the message
    /// itself (ids order as PostgreSQL orders uuids: as big-endian numbers).
    pub fn inclusive(self) -> Self {
        Self { id: Uuid::from_u128(self.id.as_u128().saturating_add(1)), ..self }
    }
}

impl SessionMessage {
    pub fn cursor(&self) -> MessageCursor {
        MessageCursor { event_time: self.event_time, id: self.id }
    }

    /// The message as a context window or a compaction reads it. Its stored token count is used
    /// when `counter` made it; a row counted by another counter, or before counts were kept, is
    /// counted now. A system message written under a user's token goes as a marked user message
    /// (what a user, or an agent acting with their token, wrote never instructs the model).
    pub fn to_window(&self, counter: &dyn TokenCounter) -> WindowMessage {
        if self.role == Role::System && self.user_id.is_some() {
            // The participant's name after the marker, which the message opens with.
            let content = match &self.tool_name {
                Some(name) => format!("{USER_SYSTEM_PREFIX}\n{name}: {}", self.content),
                None => format!("{USER_SYSTEM_PREFIX}\n{}", self.content),
            };
            return WindowMessage {
                role: Role::User,
                tokens: counter.count(&content),
                content,
                tool_call_id: None,
                tool_name: None,
                name_tokens: 0,
            };
        }
        let stored = self
            .token_count
            .filter(|_| self.token_counter.as_deref() == Some(counter.name()))
            .and_then(|n| u32::try_from(n).ok());
        WindowMessage {
            role: self.role,
            tokens: stored.unwrap_or_else(|| counter.count(&self.content)),
            content: self.content.clone(),
            tool_call_id: self.tool_call_id.as_deref().map(sendable_call_id),
            tool_name: self.tool_name.clone(),
            name_tokens: WindowMessage::name_cost(
                self.role,
                self.tool_call_id.as_deref(),
                self.tool_name.as_deref(),
                counter,
            ),
        }
    }
}

/// The session's live chat messages and tool outputs after `($3, $4)` (the start when not
/// given): bounds, not `IS NULL OR`, so a generic plan still reads the index as a range.
macro_rules! conversation_rows {
    () => {
        "
FROM memory_items m
WHERE m.tenant_id = $1 AND m.session_id = $2 AND m.scope = 'session'
  AND m.source_kind IN ('chat_message', 'tool_output')
  AND m.deleted_at IS NULL AND m.anonymized_at IS NULL
  AND (m.event_time, m.id) > (COALESCE($3, '-infinity'), COALESCE($4, '00000000-0000-0000-0000-000000000000'))"
    };
}

/// Those messages before `($5, $6)` (the end when not given) that `$filter` keeps, in `$order`,
/// at most `$7`. A row written before roles were kept reads as what its kind implies: a chat
/// message from the user, a tool output answering the call its source_ref names.
macro_rules! session_messages {
    ($order:literal) => {
        session_messages!("", $order)
    };
    ($filter:expr, $order:literal) => {
        concat!(
            "SELECT m.id, m.source_kind,
       COALESCE(m.role, CASE m.source_kind WHEN 'tool_output' THEN 'tool' ELSE 'user' END) AS role,
       m.content,
       COALESCE(m.tool_call_id, CASE m.source_kind WHEN 'tool_output' THEN m.source_ref END) AS tool_call_id,
       m.tool_name, m.token_count, m.token_counter, m.event_time, m.user_id, m.agent_id,
       m.reply_to_user_sha256",
            conversation_rows!(),
            "
  AND (m.event_time, m.id) < (COALESCE($5, 'infinity'), COALESCE($6, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))",
            $filter,
            "
ORDER BY ",
            $order,
            "
LIMIT $7"
        )
    };
}

const SESSION_MESSAGES: &str = session_messages!("m.event_time, m.id");
const SESSION_MESSAGES_NEWEST_FIRST: &str = session_messages!("m.event_time DESC, m.id DESC");
/// What the user and the assistant said (no tool calls or results), without the messages of other
/// users than `$8`, oldest first. An assistant's message carrying no user (an agent's reply
/// written with a token without `sub`) is the user's of the message before it that carries one
/// (deleted or not: a reply to a message its user deleted is still theirs, and once retention
/// anonymized that message, the reply keeps the sha256 of its user), and everyone's before the
/// first: in a session several users write in, a reply to another user (which may repeat what
/// they said) is theirs. A user's message carrying no user is nobody's: read as the user's own
/// words, it would let a token that may not write their files put words in their mouth. An
/// erasure takes a user's replies by this rule and more (`REPLIES_OF` in retention.rs: every row
/// carrying no user that follows theirs).
const SPOKEN: &str = session_messages!(
    concat!(
        "
  AND m.source_kind = 'chat_message' AND COALESCE(m.role, 'user') IN ('user', 'assistant')
  AND m.tool_call_id IS NULL
  AND (m.user_id = $8 OR (m.user_id IS NULL AND ($8::text IS NULL
    OR (m.role = 'assistant' AND (m.reply_to_user_sha256 = ",
        user_sha256!("$8"),
        "
    OR (m.reply_to_user_sha256 IS NULL AND COALESCE((
      SELECT p.user_id = $8 FROM memory_items p
      WHERE p.tenant_id = $1 AND p.session_id = $2 AND p.scope = 'session'
        AND p.source_kind IN ('chat_message', 'tool_output') AND p.anonymized_at IS NULL
        AND p.user_id IS NOT NULL AND p.event_time <= m.event_time AND (p.event_time, p.id) < (m.event_time, m.id)
      ORDER BY p.event_time DESC, p.id DESC LIMIT 1), true)))))))"
    ),
    "m.event_time, m.id"
);
const COUNT_MESSAGES: &str = concat!("SELECT count(*)", conversation_rows!());

/// The latest compaction (where the window starts), the summary in effect with it, and the
/// compaction asked for, if any.
const SESSION_STATE: &str = "
SELECT c.through_id, c.through_time, c.summary_id, s.content AS summary,
       (SELECT sc.through_id FROM session_compactions sc
        WHERE sc.tenant_id = $1 AND sc.session_id = $2 AND sc.summary_id = c.summary_id
        ORDER BY sc.through_time, sc.through_id LIMIT 1) AS summary_through,
       r.trigger AS pending, r.requested_at AS pending_since
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT * FROM session_compactions
    WHERE tenant_id = $1 AND session_id = $2
    ORDER BY through_time DESC, through_id DESC LIMIT 1
) c ON true
LEFT JOIN memory_items s
    ON s.tenant_id = $1 AND s.id = c.summary_id AND s.session_id = $2 AND s.source_kind = 'session_summary'
   AND s.deleted_at IS NULL AND s.anonymized_at IS NULL
LEFT JOIN session_compaction_requests r ON r.tenant_id = $1 AND r.session_id = $2";

/// Asks for a compaction unless one is asked for already; a request older than `$4` seconds
/// (its job gave up, or no worker serves the queue) is asked again.
const REQUEST_COMPACTION: &str = "
INSERT INTO session_compaction_requests AS r (tenant_id, session_id, trigger) VALUES ($1, $2, $3)
ON CONFLICT (tenant_id, session_id) DO UPDATE SET trigger = EXCLUDED.trigger, requested_at = now()
WHERE r.requested_at < now() - make_interval(secs => $4)
RETURNING true";

/// Whether a compact job (queue `$3`) for session `$2` of tenant `$1` waits in the queue.
const COMPACT_JOB_WAITS: &str = "
SELECT EXISTS (
    SELECT 1 FROM apalis.jobs
    WHERE job_type = $3
      AND (status IN ('Pending', 'Queued') OR (status = 'Failed' AND attempts < max_attempts))
      AND convert_from(job, 'UTF8')::jsonb @> jsonb_build_object('tenant_id', $1::text, 'session_id', $2::text)
)";

const RENEW_REQUEST: &str = "
INSERT INTO session_compaction_requests AS r (tenant_id, session_id, trigger) VALUES ($1, $2, $3)
ON CONFLICT (tenant_id, session_id) DO UPDATE SET requested_at = now()";

/// Records a compaction unless one through the same or a later message is recorded already, or
/// one past where this one's plan started (overtaken), or its summary is no longer live; whether
/// it was overtaken, and whether it was recorded.
const RECORD_COMPACTION: &str = concat!(
    "
WITH overtaken AS (
    SELECT EXISTS (
        -- The latest record alone: each test holds for it when it holds for any earlier one
        -- (read whole, the session's every compaction was read at each record).
        SELECT 1 FROM (SELECT through_time, through_id FROM session_compactions
                       WHERE tenant_id = $1 AND session_id = $2
                       ORDER BY through_time DESC, through_id DESC LIMIT 1) latest
        -- Recorded already, or another job recorded past where this one's plan started: its
        -- summary would be dropped for this one's, which does not include it.
        WHERE (through_time, through_id) >= ($4, $3) OR $11::timestamptz IS NULL
           OR (through_time, through_id) > ($11, $12)
    ) AS yes
), recorded AS (
    INSERT INTO session_compactions
        (tenant_id, session_id, through_id, through_time, messages, outcome, reason, summary_id, model, trigger,
         participants)
    SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
           -- The writers of the messages `$13` its summary was made from (user_sha256's hash), and
           -- the users the replies marked as theirs answered (migration 54).
           ARRAY(SELECT DISTINCT COALESCE(",
    user_sha256!("m.user_id"),
    ", m.reply_to_user_sha256)
                 FROM memory_items m
                 WHERE m.tenant_id = $1 AND m.id = ANY($13::uuid[])
                   AND (m.user_id IS NOT NULL OR m.reply_to_user_sha256 IS NOT NULL))
    WHERE NOT (SELECT yes FROM overtaken)
      -- Its summary is still live: a job that found nothing to compact (keeping more) drops the
      -- summaries no record holds, and an erasure those holding the user's words.
      AND ($8::uuid IS NULL OR EXISTS (
          SELECT 1 FROM memory_items s
          WHERE s.tenant_id = $1 AND s.id = $8 AND s.deleted_at IS NULL AND s.anonymized_at IS NULL))
    ON CONFLICT (tenant_id, session_id, through_id) DO NOTHING
    RETURNING 1
)
SELECT (SELECT yes FROM overtaken), EXISTS (SELECT 1 FROM recorded)"
);

/// Compactions of one session record one at a time, so two cannot both pass the check above.
const LOCK_SESSION: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1 || chr(31) || $2, 0))";

/// Whether the session's live messages after `($3, $4)` through `($5, $6)` are exactly `$7`,
/// the ones the compaction's plan read (none deleted, erased or written into the range since),
/// and the summary `$8` it built on, if any, is still live (not erased).
const COVERED_UNCHANGED: &str = concat!(
    "WITH live AS (SELECT m.id",
    conversation_rows!(),
    "
  AND (m.event_time, m.id) <= ($5, $6))
SELECT (SELECT count(*) FROM live) = cardinality($7::uuid[])
   AND NOT EXISTS (SELECT id FROM live EXCEPT SELECT unnest($7::uuid[]))
   AND ($8::uuid IS NULL OR EXISTS (
       SELECT 1 FROM memory_items s
       WHERE s.tenant_id = $1 AND s.id = $8 AND s.deleted_at IS NULL AND s.anonymized_at IS NULL))"
);

/// Soft-deletes the session's live summaries that no recorded compaction holds: only `$3` when
/// given, never `$4`; with a delete audit row each, reason `$6`. Returns their ids. The session's
/// rows are read through its index (`scope = 'session'`; the tenant's other rows are not read
/// under the text-count lock the caller holds), then filtered.
const DROP_UNHELD_SUMMARIES: &str = "
WITH dropped AS (
    UPDATE memory_items m SET deleted_at = now()
    WHERE m.tenant_id = $1 AND m.scope = 'session' AND m.session_id = $2 AND m.source_kind = 'session_summary'
      AND m.deleted_at IS NULL AND m.anonymized_at IS NULL
      AND ($3::uuid IS NULL OR m.id = $3) AND m.id IS DISTINCT FROM $4
      AND NOT EXISTS (
          SELECT 1 FROM session_compactions c WHERE c.tenant_id = $1 AND c.session_id = $2 AND c.summary_id = m.id)
    RETURNING m.id
), audit AS (
    INSERT INTO audit_log (tenant_id, event, item_id, reason, actor)
    SELECT $1, $5, id, $6, 'compaction' FROM dropped
)
SELECT id FROM dropped";

const CLEAR_REQUEST: &str = "DELETE FROM session_compaction_requests WHERE tenant_id = $1 AND session_id = $2";

const SESSION_COMPACTIONS: &str = "
SELECT through_id, through_time, messages, outcome, reason, summary_id, model, trigger, created_at
FROM session_compactions WHERE tenant_id = $1 AND session_id = $2
ORDER BY through_time, through_id";

/// A compaction asked for again after this long without being done.
pub const STALE_REQUEST: Duration = Duration::from_secs(300);

/// Where a session's context window starts and what comes before it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SessionState {
    /// The last message the latest compaction covered; the window starts after it.
    pub through: Option<MessageCursor>,
    pub summary: Option<SessionSummary>,
    /// A compaction asked for and not yet done.
    pub pending: Option<PendingCompaction>,
}

/// A compaction asked for and not yet done.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PendingCompaction {
    pub trigger: CompactionTrigger,
    pub since: DateTime<Utc>,
}

impl PendingCompaction {
    /// Asked for so long ago that its job gave up or no worker serves the queue: ask again.
    pub fn is_stale(&self) -> bool {
        Utc::now().signed_duration_since(self.since).to_std().is_ok_and(|age| age > STALE_REQUEST)
    }
}

/// The summary in effect: a `session_summary` row.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionSummary {
    pub id: Uuid,
    pub content: String,
    /// The last message it summarizes.
    pub through: Uuid,
}

#[derive(sqlx::FromRow)]
struct StateRow {
    through_id: Option<Uuid>,
    through_time: Option<DateTime<Utc>>,
    summary_id: Option<Uuid>,
    summary: Option<String>,
    summary_through: Option<Uuid>,
    pending: Option<String>,
    pending_since: Option<DateTime<Utc>>,
}

/// One compaction, as recorded.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Compaction {
    pub through_id: Uuid,
    pub through_time: DateTime<Utc>,
    /// Messages it covered.
    pub messages: i32,
    #[sqlx(try_from = "String")]
    pub outcome: CompactionOutcome,
    /// Why it truncated: `no_model` or the model failure's label.
    pub reason: Option<String>,
    /// The summary in effect after it.
    pub summary_id: Option<Uuid>,
    pub model: Option<String>,
    #[sqlx(try_from = "String")]
    pub trigger: CompactionTrigger,
    pub created_at: DateTime<Utc>,
}

/// What a compaction job records.
#[derive(Debug, Clone, PartialEq)]
pub struct NewCompaction {
    /// Where the compaction this one continues ended (its plan's start): none when it is the first.
    pub from: Option<MessageCursor>,
    pub through: MessageCursor,
    /// The messages it covers, as its plan read them: through `through`, after `from`.
    pub covered: Vec<Uuid>,
    /// The summary its own builds on (the one in effect when it planned).
    pub previous_summary: Option<Uuid>,
    pub outcome: CompactionOutcome,
    pub reason: Option<String>,
    pub summary_id: Option<Uuid>,
    pub model: Option<String>,
    pub trigger: CompactionTrigger,
    /// The workspaces whose extraction of the covered messages is asked for with the record, so
    /// a crash between the two loses neither (seed 001's flushBeforeCompact).
    pub extract_for: Vec<Workspace>,
}

/// What became of a compaction's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recording {
    Recorded,
    /// Another compaction of the session was recorded since this one's plan started.
    Overtaken,
    /// A message it covers, or the summary it built on, was deleted or erased, or a message was
    /// written into its range, since its plan read them; or the summary it wrote was dropped (by
    /// a job that found nothing to compact) or erased.
    MessagesChanged,
}

impl Recording {
    /// The audit reason of the summaries this outcome drops: a recorded compaction drops the
    /// ones it overtook.
    fn drop_reason(self) -> &'static str {
        match self {
            Self::Recorded | Self::Overtaken => "compaction_overtaken",
            Self::MessagesChanged => "messages_changed",
        }
    }
}

impl Store {
    /// Whether `user` has rows in `session`, and whether `agent` is known there: it has rows in
    /// the session, or files of the user.
    pub async fn user_and_agent_in_session(
        &self,
        tenant: &TenantId,
        user: &UserId,
        agent: &AgentId,
        session: &SessionId,
    ) -> Result<(bool, bool), StoreError> {
        Ok(sqlx::query_as(concat!(
            "SELECT ",
            user_in_session!(),
            // As there, `scope = 'session'` bounds the scan to the session.
            ",
                    EXISTS (SELECT 1 FROM memory_items
                            WHERE tenant_id = $1 AND scope = 'session' AND session_id = $2 AND agent_id = $4)
                    OR EXISTS (SELECT 1 FROM workspace_files WHERE tenant_id = $1 AND agent_id = $4 AND user_id = $3)",
        ))
        .bind(tenant.as_str())
        .bind(session.as_str())
        .bind(user.as_str())
        .bind(agent.as_str())
        .fetch_one(&self.pool)
        .await?)
    }

    /// Up to `limit` messages of the session after `after`, in the session's order.
    pub async fn session_messages(
        &self,
        tenant: &TenantId,
        session: &SessionId,
        after: Option<MessageCursor>,
        limit: i64,
    ) -> Result<Vec<SessionMessage>, StoreError> {
        self.read_messages(SESSION_MESSAGES, tenant, session, after, None, limit).await
    }

    /// Up to `limit` messages of the session after `after` and before `before`, newest first:
    /// a context window reads only the tail its budget can hold.
    pub async fn session_messages_newest_first(
        &self,
        tenant: &TenantId,
        session: &SessionId,
        after: Option<MessageCursor>,
        before: Option<MessageCursor>,
        limit: i64,
    ) -> Result<Vec<SessionMessage>, StoreError> {
        self.read_messages(SESSION_MESSAGES_NEWEST_FIRST, tenant, session, after, before, limit).await
    }

    /// Up to `limit` of what the user and the assistant said in the session after `after` (from
    /// the start when not given) and before `before`, oldest first, leaving out tool traffic and
    /// other users' messages (in a session several users write in, theirs never become `user`'s
    /// memories): an extraction's transcript.
    pub async fn spoken_messages(
        &self,
        tenant: &TenantId,
        session: &SessionId,
        after: Option<MessageCursor>,
        before: MessageCursor,
        user: Option<&UserId>,
        limit: i64,
    ) -> Result<Vec<SessionMessage>, StoreError> {
        Ok(sqlx::query_as(SPOKEN)
            .bind(tenant.as_str())
            .bind(session.as_str())
            .bind(after.map(|c| c.event_time))
            .bind(after.map(|c| c.id))
            .bind(before.event_time)
            .bind(before.id)
            .bind(limit)
            .bind(user.map(UserId::as_str))
            .fetch_all(&mut *self.tenant_connection([tenant.as_str()]).await?)
            .await?)
    }

    async fn read_messages(
        &self,
        sql: &'static str,
        tenant: &TenantId,
        session: &SessionId,
        after: Option<MessageCursor>,
        before: Option<MessageCursor>,
        limit: i64,
    ) -> Result<Vec<SessionMessage>, StoreError> {
        Ok(sqlx::query_as(sql)
            .bind(tenant.as_str())
            .bind(session.as_str())
            .bind(after.map(|c| c.event_time))
            .bind(after.map(|c| c.id))
            .bind(before.map(|c| c.event_time))
            .bind(before.map(|c| c.id))
            .bind(limit)
            .fetch_all(&mut *self.tenant_connection([tenant.as_str()]).await?)
            .await?)
    }

    /// How many messages the session has after `after`.
    pub async fn count_session_messages(
        &self,
        tenant: &TenantId,
        session: &SessionId,
        after: Option<MessageCursor>,
    ) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(COUNT_MESSAGES)
            .bind(tenant.as_str())
            .bind(session.as_str())
            .bind(after.map(|c| c.event_time))
            .bind(after.map(|c| c.id))
            .fetch_one(&mut *self.tenant_connection([tenant.as_str()]).await?)
            .await?)
    }

    /// Where the session's window starts, its summary, and the compaction asked for.
    pub async fn session_state(&self, tenant: &TenantId, session: &SessionId) -> Result<SessionState, StoreError> {
        let row: StateRow = sqlx::query_as(SESSION_STATE)
            .bind(tenant.as_str())
            .bind(session.as_str())
            .fetch_one(&mut *self.tenant_connection([tenant.as_str()]).await?)
            .await?;
        let through = row.through_time.zip(row.through_id).map(|(event_time, id)| MessageCursor { event_time, id });
        let summary = match (row.summary_id, row.summary, row.summary_through) {
            (Some(id), Some(content), Some(through)) => Some(SessionSummary { id, content, through }),
            _ => None,
        };
        let pending = match (row.pending, row.pending_since) {
            (Some(trigger), Some(since)) => Some(PendingCompaction {
                trigger: CompactionTrigger::try_from(trigger).map_err(StoreError::Stored)?,
                since,
            }),
            _ => None,
        };
        Ok(SessionState { through, summary, pending })
    }

    /// Asks for a compaction of the session and queues its job, unless one is asked for already
    /// (and not stale). True when this call queued the job.
    pub async fn request_compaction(
        &self,
        tenant: &TenantId,
        session: &SessionId,
        trigger: CompactionTrigger,
        keep: Option<Keep>,
        keep_at_most: Option<u64>,
    ) -> Result<bool, StoreError> {
        let mut conn = self.tenant_connection([tenant.as_str()]).await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let queued: Option<bool> = sqlx::query_scalar(REQUEST_COMPACTION)
            .bind(tenant.as_str())
            .bind(session.as_str())
            .bind(trigger.as_str())
            .bind(STALE_REQUEST.as_secs_f64())
            .fetch_optional(&mut *tx)
            .await?;
        if queued.is_some() {
            let job = CompactJob {
                tenant_id: tenant.clone(),
                session_id: session.clone(),
                trigger,
                keep,
                keep_at_most,
                summary_failures: 0,
            };
            push(&mut tx, &[job]).await?;
        }
        tx.commit().await?;
        Ok(queued.is_some())
    }

    /// Queues `job` again after `delay`, its request renewed with it, so that no trigger queues
    /// a second job for the session meanwhile (a request is taken for stale after
    /// [`STALE_REQUEST`]). Not when a job for the session waits already (a duplicate, or one an
    /// operator ran by hand during an outage): that one will try.
    pub async fn retry_compaction(&self, job: &CompactJob, delay: Duration) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        retry_compaction_in(&mut tx, job, delay).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records a compaction (once: a retried job finds its record made) and clears the request
    /// (unless overtaken).
    /// Not when another compaction was recorded since this one's plan started (the two ran side
    /// by side, and the next job plans again from the one recorded), nor when the messages it
    /// covers changed since (one was deleted or its user erased): then the summary it wrote is
    /// deleted and anonymized, and `job` is queued again in the same transaction, its request
    /// kept, so a context call waiting for the compaction never sees the session without one.
    /// Once recorded, the summaries no compaction holds (written by jobs that crashed before
    /// recording, or that this one overtakes) are too.
    pub async fn record_compaction(
        &self,
        tenant: &TenantId,
        session: &SessionId,
        compaction: &NewCompaction,
        job: &CompactJob,
    ) -> Result<Recording, StoreError> {
        let mut tx = self.pool.begin().await?;
        lock_session_summaries(&mut tx, tenant, session).await?;
        let unchanged: bool = sqlx::query_scalar(COVERED_UNCHANGED)
            .bind(tenant.as_str())
            .bind(session.as_str())
            .bind(compaction.from.map(|c| c.event_time))
            .bind(compaction.from.map(|c| c.id))
            .bind(compaction.through.event_time)
            .bind(compaction.through.id)
            .bind(&compaction.covered)
            .bind(compaction.previous_summary)
            .fetch_one(&mut *tx)
            .await?;
        let (overtaken, recorded) = if !unchanged {
            (false, false)
        } else {
            sqlx::query_as(RECORD_COMPACTION)
                .bind(tenant.as_str())
                .bind(session.as_str())
                .bind(compaction.through.id)
                .bind(compaction.through.event_time)
                .bind(i32::try_from(compaction.covered.len()).unwrap_or(i32::MAX))
                .bind(compaction.outcome.as_str())
                .bind(compaction.reason.as_deref())
                .bind(compaction.summary_id)
                .bind(compaction.model.as_deref())
                .bind(compaction.trigger.as_str())
                .bind(compaction.from.map(|c| c.event_time))
                .bind(compaction.from.map(|c| c.id))
                // A truncation (even one that keeps the previous summary) summarized nothing.
                .bind(if compaction.outcome == CompactionOutcome::Summarized { &compaction.covered[..] } else { &[] })
                .fetch_one(&mut *tx)
                .await?
        };
        let recording = match (unchanged, recorded, overtaken) {
            (true, true, _) => Recording::Recorded,
            (true, false, true) => Recording::Overtaken,
            // Not overtaken, yet not recorded: its summary was dropped or erased meanwhile.
            _ => Recording::MessagesChanged,
        };
        // Recorded: every other job of the session is overtaken, so no summary it holds is lost.
        let (only, never) = match recording {
            Recording::Recorded => (None, compaction.summary_id),
            _ => (compaction.summary_id, None),
        };
        if recording == Recording::Recorded || only.is_some() {
            drop_unheld_summaries(&mut tx, tenant, session, only, never, recording.drop_reason()).await?;
        }
        if recording == Recording::Recorded {
            for workspace in &compaction.extract_for {
                request_extraction_in(&mut tx, workspace, session, compaction.through, TriggerSource::Compaction)
                    .await?;
            }
        }
        match recording {
            Recording::Recorded => {
                sqlx::query(CLEAR_REQUEST).bind(tenant.as_str()).bind(session.as_str()).execute(&mut *tx).await?;
            }
            Recording::MessagesChanged => {
                retry_compaction_in(&mut tx, &CompactJob { summary_failures: 0, ..job.clone() }, Duration::ZERO)
                    .await?;
            }
            // Its request was cleared by the job that overtook it: a request there now is a later
            // one (that job's follow-up), which must stay.
            Recording::Overtaken => {}
        }
        tx.commit().await?;
        Ok(recording)
    }

    /// Clears the session's compaction request: its job found nothing to compact. The summaries
    /// no record holds (an earlier try's, which crashed before recording) are deleted and
    /// anonymized now, as a record would: none may come, and such a summary may quote the message
    /// whose delete left nothing to compact. A job that wrote one meanwhile (keeping less) is
    /// then not recorded, and planned again.
    pub async fn nothing_to_compact(&self, tenant: &TenantId, session: &SessionId) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        lock_session_summaries(&mut tx, tenant, session).await?;
        drop_unheld_summaries(&mut tx, tenant, session, None, None, Recording::MessagesChanged.drop_reason()).await?;
        sqlx::query(CLEAR_REQUEST).bind(tenant.as_str()).bind(session.as_str()).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The session's compactions, oldest first.
    pub async fn session_compactions(
        &self,
        tenant: &TenantId,
        session: &SessionId,
    ) -> Result<Vec<Compaction>, StoreError> {
        Ok(sqlx::query_as(SESSION_COMPACTIONS)
            .bind(tenant.as_str())
            .bind(session.as_str())
            .fetch_all(&self.pool)
            .await?)
    }
}

/// Takes the session's compaction lock, then the tenant's text counts, before any row lock
/// (embedding and erasure take the counts, then rows; anonymizing a dropped summary needs them).
async fn lock_session_summaries(
    tx: &mut sqlx::PgConnection,
    tenant: &TenantId,
    session: &SessionId,
) -> Result<(), StoreError> {
    sqlx::query(LOCK_SESSION).bind(tenant.as_str()).bind(session.as_str()).execute(&mut *tx).await?;
    lock_text_counts(tx, &[tenant.as_str().to_owned()]).await
}

/// Renews the session's compaction request and queues `job` after `delay`, unless a job for the
/// session waits already (a duplicate, or one an operator ran by hand during an outage).
async fn retry_compaction_in(tx: &mut sqlx::PgConnection, job: &CompactJob, delay: Duration) -> Result<(), StoreError> {
    sqlx::query(RENEW_REQUEST)
        .bind(job.tenant_id.as_str())
        .bind(job.session_id.as_str())
        .bind(job.trigger.as_str())
        .execute(&mut *tx)
        .await?;
    let waiting: bool = sqlx::query_scalar(COMPACT_JOB_WAITS)
        .bind(job.tenant_id.as_str())
        .bind(job.session_id.as_str())
        .bind(Queue::Compact.as_str())
        .fetch_one(&mut *tx)
        .await?;
    if !waiting {
        push_after(tx, job, delay, 0).await?;
    }
    Ok(())
}

/// Deletes and anonymizes the session's summaries no record holds (only `only` when given, never
/// `never`; see [`DROP_UNHELD_SUMMARIES`]), audited with `reason`.
async fn drop_unheld_summaries(
    tx: &mut sqlx::PgConnection,
    tenant: &TenantId,
    session: &SessionId,
    only: Option<Uuid>,
    never: Option<Uuid>,
    reason: &str,
) -> Result<(), StoreError> {
    let dropped: Vec<Uuid> = sqlx::query_scalar(DROP_UNHELD_SUMMARIES)
        .bind(tenant.as_str())
        .bind(session.as_str())
        .bind(only)
        .bind(never)
        .bind(AuditEvent::Delete.as_str())
        .bind(reason)
        .fetch_all(&mut *tx)
        .await?;
    if !dropped.is_empty() {
        anonymize_ids(tx, tenant, &dropped, "compaction").await?;
    }
    Ok(())
}

//! A session's conversation: its chat messages and tool outputs in the one order every reader
//! uses (event time, then write order: ids are time-ordered UUIDv7s), and its latest summary.

use chrono::{DateTime, Utc};
use mnemo_core::{Role, SessionId, SourceKind, TenantId};
use uuid::Uuid;

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
}

/// Where a page of messages starts: after this message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageCursor {
    pub event_time: DateTime<Utc>,
    pub id: Uuid,
}

impl SessionMessage {
    pub fn cursor(&self) -> MessageCursor {
        MessageCursor { event_time: self.event_time, id: self.id }
    }
}

/// The session's live chat messages and tool outputs. A row written before roles were kept
/// reads as what its kind implies: a chat message from the user, a tool output answering the
/// call its source_ref names.
const SESSION_MESSAGES: &str = "
SELECT m.id, m.source_kind,
       COALESCE(m.role, CASE m.source_kind WHEN 'tool_output' THEN 'tool' ELSE 'user' END) AS role,
       m.content,
       COALESCE(m.tool_call_id, CASE m.source_kind WHEN 'tool_output' THEN m.source_ref END) AS tool_call_id,
       m.tool_name, m.token_count, m.token_counter, m.event_time
FROM memory_items m
WHERE m.tenant_id = $1 AND m.session_id = $2 AND m.scope = 'session'
  AND m.source_kind IN ('chat_message', 'tool_output')
  AND m.deleted_at IS NULL AND m.anonymized_at IS NULL
  AND ($3::timestamptz IS NULL OR (m.event_time, m.id) > ($3, $4))
ORDER BY m.event_time, m.id
LIMIT $5";

impl Store {
    /// Up to `limit` messages of the session after `after`, in the session's order.
    pub async fn session_messages(
        &self,
        tenant: &TenantId,
        session: &SessionId,
        after: Option<MessageCursor>,
        limit: i64,
    ) -> Result<Vec<SessionMessage>, StoreError> {
        Ok(sqlx::query_as(SESSION_MESSAGES)
            .bind(tenant.as_str())
            .bind(session.as_str())
            .bind(after.map(|c| c.event_time))
            .bind(after.map(|c| c.id))
            .bind(limit)
            .fetch_all(&self.pool)
            .await?)
    }
}

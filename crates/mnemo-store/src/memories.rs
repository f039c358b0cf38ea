use apalis_postgres::queries::push_tasks;
use mnemo_core::{NewMemory, TenantId, ToolOutputKey};
use uuid::Uuid;

use crate::queue::{EMBED_QUEUE, EmbedJob, task};
use crate::{Store, StoreError};

/// The row a write landed on, and whether this write created it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remembered {
    pub id: Uuid,
    pub was_new: bool,
}

/// A full tool output payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutput {
    pub key: ToolOutputKey,
    pub item_id: Uuid,
    pub content: String,
}

const INSERT_ITEM: &str = "
INSERT INTO memory_items (
    id, tenant_id, scope, session_id, user_id, agent_id, source_kind, source_ref,
    content, content_sha256, tool_output_key, metadata, event_time, fact_key, valid_from
)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, COALESCE($13, now()), $14,
        CASE WHEN $7 = 'fact' THEN now() END)
ON CONFLICT (tenant_id, source_kind, source_ref) DO NOTHING
RETURNING id";

const FIND_ITEM: &str = "
SELECT id, content_sha256 FROM memory_items
WHERE tenant_id = $1 AND source_kind = $2 AND source_ref = $3";

const INSERT_TOOL_OUTPUT: &str = "
INSERT INTO tool_outputs (tenant_id, key, item_id, content) VALUES ($1, $2, $3, $4)
ON CONFLICT (tenant_id, key) DO NOTHING";

impl Store {
    /// Inserts the row, its full tool output and its embed job in one transaction, or finds the
    /// row an earlier write of the same (tenant, kind, source_ref) made. Concurrent identical
    /// writes land on one row and exactly one of them reports `was_new`.
    pub async fn remember(&self, memory: &NewMemory) -> Result<Remembered, StoreError> {
        // A conflicting row can only disappear if it is rolled back while we wait on it; then the
        // next attempt inserts. Two rounds always settle it; the third is a guard.
        for _ in 0..3 {
            let mut tx = self.pool.begin().await?;
            let inserted: Option<Uuid> = sqlx::query_scalar(INSERT_ITEM)
                .bind(Uuid::now_v7())
                .bind(memory.tenant.as_str())
                .bind(memory.scope.as_str())
                .bind(memory.session.as_ref().map(|s| s.as_str()))
                .bind(memory.user.as_ref().map(|u| u.as_str()))
                .bind(memory.agent.as_ref().map(|a| a.as_str()))
                .bind(memory.kind.as_str())
                .bind(memory.source_ref.as_str())
                .bind(memory.content.as_str())
                .bind(memory.content_sha256.as_slice())
                .bind(memory.tool_output.as_ref().map(|(key, _)| key.as_str()))
                .bind(memory.metadata.to_json())
                .bind(memory.event_time)
                .bind(memory.fact_key.as_ref().map(|k| k.as_str()))
                .fetch_optional(&mut *tx)
                .await?;

            if let Some(id) = inserted {
                if let Some((key, full)) = &memory.tool_output {
                    sqlx::query(INSERT_TOOL_OUTPUT)
                        .bind(memory.tenant.as_str())
                        .bind(key.as_str())
                        .bind(id)
                        .bind(full)
                        .execute(&mut *tx)
                        .await?;
                }
                let job = EmbedJob {
                    tenant_id: memory.tenant.to_string(),
                    item_id: id,
                    content_sha256: hex::encode(memory.content_sha256),
                };
                push_tasks(&mut *tx, EMBED_QUEUE, vec![task(&job)?]).await?;
                tx.commit().await?;
                return Ok(Remembered { id, was_new: true });
            }

            let existing: Option<(Uuid, Vec<u8>)> = sqlx::query_as(FIND_ITEM)
                .bind(memory.tenant.as_str())
                .bind(memory.kind.as_str())
                .bind(memory.source_ref.as_str())
                .fetch_optional(&mut *tx)
                .await?;
            tx.rollback().await?;
            match existing {
                Some((id, sha)) if sha == memory.content_sha256 => return Ok(Remembered { id, was_new: false }),
                Some((existing, _)) => return Err(StoreError::SourceRefConflict { existing }),
                None => continue,
            }
        }
        Err(StoreError::Database(sqlx::Error::Protocol("memory row neither inserted nor found".into())))
    }

    /// The full payload behind a `tout_…` key, for its own tenant only.
    pub async fn tool_output(&self, tenant: &TenantId, key: &ToolOutputKey) -> Result<Option<ToolOutput>, StoreError> {
        let row: Option<(Uuid, String)> =
            sqlx::query_as("SELECT item_id, content FROM tool_outputs WHERE tenant_id = $1 AND key = $2")
                .bind(tenant.as_str())
                .bind(key.as_str())
                .fetch_optional(&self.pool)
                .await?;
        Ok(row.map(|(item_id, content)| ToolOutput { key: key.clone(), item_id, content }))
    }
}

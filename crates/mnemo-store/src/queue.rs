//! The job queues mnemo writes into and the arguments of their jobs. Jobs are enqueued in the
//! same transaction as the rows they are about, so a row and its job exist together or not at
//! all. The arguments are JSON, as apalis' Postgres backend decodes them.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use apalis_core::task::builder::TaskBuilder;
use apalis_postgres::PgTask;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::StoreError;

/// Embeds new or changed rows.
pub const EMBED_QUEUE: &str = "embed";

/// Embed one memory row. `content_sha256` is the hash the row had when the job was queued, so
/// a worker can tell that the content changed since and must be embedded again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmbedJob {
    pub tenant_id: String,
    pub item_id: Uuid,
    pub content_sha256: String,
}

/// Judges embedded facts against the older facts of their bucket.
pub const JUDGE_QUEUE: &str = "judge";

/// Judge one fact, if it is still pending.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JudgeJob {
    pub tenant_id: String,
    pub item_id: Uuid,
}

/// Anonymizes one tenant's retired rows under its retention policy.
pub const RETENTION_QUEUE: &str = "retention";

/// Sweep one tenant for retention tick `tick` (scheduled once per tenant and tick).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetentionJob {
    pub tenant_id: String,
    pub tick: i64,
}

pub(crate) fn task<T: Serialize>(args: &T) -> Result<PgTask, StoreError> {
    Ok(TaskBuilder::new(serde_json::to_vec(args)?).build())
}

/// A job due after `delay`. apalis stores run_at in whole seconds, truncating: the due time is
/// rounded up, or a sub-second remainder could make the job due at once.
pub(crate) fn delayed_task<T: Serialize>(args: &T, delay: Duration) -> Result<PgTask, StoreError> {
    let due = (SystemTime::now() + delay).duration_since(UNIX_EPOCH).unwrap_or_default();
    let due_secs = due.as_secs() + u64::from(due.subsec_nanos() > 0);
    Ok(TaskBuilder::new(serde_json::to_vec(args)?).run_at_timestamp(due_secs).build())
}

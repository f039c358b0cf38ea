//! The job queues mnemo writes into and the arguments of their jobs. Jobs are enqueued in the
//! same transaction as the rows they are about, so a row and its job exist together or not at
//! all. The arguments are JSON, as apalis' Postgres backend decodes them.

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

pub(crate) fn task<T: Serialize>(args: &T) -> Result<PgTask, StoreError> {
    Ok(TaskBuilder::new(serde_json::to_vec(args)?).build())
}

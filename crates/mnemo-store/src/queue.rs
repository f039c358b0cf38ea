//! The job queues mnemo writes into and the arguments of their jobs. Jobs are enqueued in the
//! same transaction as the rows they are about, so a row and its job exist together or not at
//! all. The arguments are JSON, as apalis' Postgres backend decodes them.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use apalis_core::task::builder::TaskBuilder;
use apalis_core::task::metadata::MetadataStore;
use apalis_postgres::queries::push_tasks;
use mnemo_core::{AgentId, CompactionTrigger, Keep, Queue, SessionId, TenantId, UserId};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// The arguments of one queue's jobs: which queue they go to is part of their type, so a job can
/// never be pushed onto another queue's table.
pub trait JobArgs: Serialize + for<'de> Deserialize<'de> + Send + Sync + Unpin + 'static {
    const QUEUE: Queue;

    /// For a job about one user's files: the (tenant, agent, user) it names, and a query over
    /// them (`$1`–`$3`) saying whether it still has work. Its retries are queued under the
    /// user's files and only while it has work, so none outlives the user's erasure: one that
    /// committed first leaves no work, and one under way waits, then removes the retry.
    fn user_work(&self) -> Option<([&str; 3], &'static str)> {
        None
    }

    /// For a job about memory rows that housekeeping queues again when their job looks lost
    /// (embed, judge): a statement marking the rows (tenant `$1`, ids `$2`) queued until `$3`
    /// seconds from now, the tenant and the ids. A retry runs it as it queues the job, so a
    /// retry waiting out its backoff is not taken for lost and queued a second time. Rows in
    /// id order, and one another writer holds is passed over: a mark is worth no lock wait.
    fn rows_waiting(&self) -> Option<(&'static str, &str, Vec<Uuid>)> {
        None
    }
}

/// Embed memory rows of one tenant. A write queues one job for the rows of a tenant that one
/// statement inserted: a job row per memory row was about a third of a write's time in the
/// database (docs/benchmarks.md). Jobs queued before named one row (`item_id`,
/// `content_sha256` beside `tenant_id`) and still decode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "EmbedJobArgs")]
pub struct EmbedJob {
    #[serde(serialize_with = "parsed::serialize")]
    pub tenant_id: TenantId,
    pub items: Vec<EmbedItem>,
}

/// A row an embed job names. `content_sha256` is the hash the row had when the job was queued,
/// so a worker can tell that the content changed since and must be embedded again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmbedItem {
    pub item_id: Uuid,
    pub content_sha256: String,
}

/// One row of an embed job with its tenant: what the embed worker batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbedRow {
    pub tenant_id: TenantId,
    pub item_id: Uuid,
    pub content_sha256: String,
}

impl EmbedJob {
    /// A job for one row.
    pub fn of(row: &EmbedRow) -> Self {
        let item = EmbedItem { item_id: row.item_id, content_sha256: row.content_sha256.clone() };
        Self { tenant_id: row.tenant_id.clone(), items: vec![item] }
    }

    pub fn rows(&self) -> impl Iterator<Item = EmbedRow> + '_ {
        self.items.iter().map(|i| EmbedRow {
            tenant_id: self.tenant_id.clone(),
            item_id: i.item_id,
            content_sha256: i.content_sha256.clone(),
        })
    }
}

/// An embed job's arguments as stored: rows in `items`, or one row in the fields of old jobs.
#[derive(Deserialize)]
struct EmbedJobArgs {
    #[serde(with = "parsed")]
    tenant_id: TenantId,
    #[serde(default)]
    items: Vec<EmbedItem>,
    item_id: Option<Uuid>,
    content_sha256: Option<String>,
}

impl TryFrom<EmbedJobArgs> for EmbedJob {
    type Error = &'static str;

    fn try_from(args: EmbedJobArgs) -> Result<Self, Self::Error> {
        let mut items = args.items;
        match (args.item_id, args.content_sha256) {
            (Some(item_id), Some(content_sha256)) => items.push(EmbedItem { item_id, content_sha256 }),
            (None, None) => {}
            _ => return Err("an embed job names a row without its content hash"),
        }
        if items.is_empty() {
            return Err("an embed job names no row");
        }
        Ok(Self { tenant_id: args.tenant_id, items })
    }
}

/// Judge one fact, if it is still pending.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JudgeJob {
    #[serde(with = "parsed")]
    pub tenant_id: TenantId,
    pub item_id: Uuid,
}

/// Sweep one tenant for retention tick `tick` (scheduled once per tenant and tick).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetentionJob {
    #[serde(with = "parsed")]
    pub tenant_id: TenantId,
    pub tick: i64,
}

/// Compact one session's conversation: summarize what comes before the turns it keeps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompactJob {
    #[serde(with = "parsed")]
    pub tenant_id: TenantId,
    #[serde(with = "parsed")]
    pub session_id: SessionId,
    #[serde(with = "parsed")]
    pub trigger: CompactionTrigger,
    /// The turns (or tokens) kept verbatim, as the server that asked judged there was something
    /// to compact: the worker cuts by the same keep whatever its own settings say. `None` (a job
    /// the runbook queues, or one queued before this field): the worker's setting.
    #[serde(default, with = "keep", skip_serializing_if = "Option::is_none")]
    pub keep: Option<Keep>,
    /// When the turns compaction keeps are longer than this many tokens (one long agent turn),
    /// it keeps this many instead: half of what the asking call's window leaves the history
    /// (without its current message).
    #[serde(default)]
    pub keep_at_most: Option<u64>,
    /// How many times in a row the model failed this compaction in a way that passes (the
    /// endpoint down, overloaded or slow): the last try truncates instead of asking again.
    #[serde(default)]
    pub summary_failures: u32,
}

/// Extract memories from the (agent, user)'s completed conversations that wait.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtractJob {
    #[serde(with = "parsed")]
    pub tenant_id: TenantId,
    #[serde(with = "parsed")]
    pub agent_id: AgentId,
    #[serde(with = "parsed")]
    pub user_id: UserId,
}

/// Consolidate the (agent, user)'s daily notes into MEMORY.md.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsolidateJob {
    #[serde(with = "parsed")]
    pub tenant_id: TenantId,
    #[serde(with = "parsed")]
    pub agent_id: AgentId,
    #[serde(with = "parsed")]
    pub user_id: UserId,
}

/// Record that recall returned these rows of one tenant at `at`. `batch` makes the job
/// idempotent: a retried job finds its batch applied and counts nothing twice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccessJob {
    #[serde(with = "parsed")]
    pub tenant_id: TenantId,
    pub batch: Uuid,
    pub items: Vec<Uuid>,
    pub at: chrono::DateTime<chrono::Utc>,
}

impl JobArgs for AccessJob {
    const QUEUE: Queue = Queue::Access;
}

impl JobArgs for ConsolidateJob {
    const QUEUE: Queue = Queue::Consolidate;

    fn user_work(&self) -> Option<([&str; 3], &'static str)> {
        Some(([self.tenant_id.as_str(), self.agent_id.as_str(), self.user_id.as_str()], crate::consolidation::HAS_WORK))
    }
}

impl JobArgs for ExtractJob {
    const QUEUE: Queue = Queue::Extract;

    fn user_work(&self) -> Option<([&str; 3], &'static str)> {
        Some(([self.tenant_id.as_str(), self.agent_id.as_str(), self.user_id.as_str()], crate::extraction::HAS_PENDING))
    }
}

/// [`JobArgs::rows_waiting`]'s statement over the queue-time `column` of `memory_items`.
macro_rules! queued_until {
    ($column:literal) => {
        concat!(
            "WITH due AS (SELECT now() + make_interval(secs => $3) AS at), rows AS (
                 SELECT id FROM memory_items, due
                 WHERE tenant_id = $1 AND id = ANY($2) AND COALESCE(",
            $column,
            ", '-infinity') < due.at
                 ORDER BY id FOR UPDATE OF memory_items SKIP LOCKED)
             UPDATE memory_items m SET ",
            $column,
            " = due.at FROM rows, due WHERE m.tenant_id = $1 AND m.id = rows.id"
        )
    };
}

impl JobArgs for EmbedJob {
    const QUEUE: Queue = Queue::Embed;

    fn rows_waiting(&self) -> Option<(&'static str, &str, Vec<Uuid>)> {
        let ids = self.items.iter().map(|i| i.item_id).collect();
        Some((queued_until!("embed_enqueued_at"), self.tenant_id.as_str(), ids))
    }
}

impl JobArgs for JudgeJob {
    const QUEUE: Queue = Queue::Judge;

    fn rows_waiting(&self) -> Option<(&'static str, &str, Vec<Uuid>)> {
        Some((queued_until!("judge_enqueued_at"), self.tenant_id.as_str(), vec![self.item_id]))
    }
}

impl JobArgs for RetentionJob {
    const QUEUE: Queue = Queue::Retention;
}

impl JobArgs for CompactJob {
    const QUEUE: Queue = Queue::Compact;
}

/// Ids and names in job arguments are their strings, parsed back on the way out, so a job whose
/// arguments were edited into an invalid value fails to decode instead of running.
mod parsed {
    use std::fmt::Display;

    use mnemo_core::InvalidInput;
    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<T: Display, S: Serializer>(value: &T, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(value)
    }

    pub fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
    where
        T: TryFrom<String, Error = InvalidInput>,
        D: Deserializer<'de>,
    {
        T::try_from(String::deserialize(d)?).map_err(D::Error::custom)
    }
}

/// A job's `Option<Keep>` as `{"turns": 2}` or `{"tokens": 500}` (mnemo-core's types carry no
/// serde).
mod keep {
    use mnemo_core::Keep;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum Form {
        Turns(usize),
        Tokens(u64),
    }

    pub fn serialize<S: Serializer>(keep: &Option<Keep>, s: S) -> Result<S::Ok, S::Error> {
        let form = keep.map(|keep| match keep {
            Keep::Turns(n) => Form::Turns(n),
            Keep::Tokens(n) => Form::Tokens(n),
        });
        form.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Keep>, D::Error> {
        Ok(Option::<Form>::deserialize(d)?.map(|form| match form {
            Form::Turns(n) => Keep::Turns(n),
            Form::Tokens(n) => Keep::Tokens(n),
        }))
    }
}

/// The key of a job's metadata (apalis' `metadata` column) that holds the W3C `traceparent` of
/// the span that queued it, when traces are exported: the worker's span for the job continues
/// that trace.
pub const TRACEPARENT: &str = "traceparent";

/// The key of a job's metadata that counts the times it failed before and was queued again: a
/// re-queued job is a new row, whose apalis attempts start at 0, so its backoff grows by this.
pub const FAILURES: &str = "mnemo_failures";

/// How many times the job whose metadata this is failed before.
pub fn failures_before(metadata: &MetadataStore) -> usize {
    metadata.get(FAILURES).and_then(|n| n.parse().ok()).unwrap_or(0)
}

/// A job's task, carrying the current trace and the failures it follows.
fn task<J: JobArgs>(job: &J, failures: usize) -> Result<TaskBuilder<Vec<u8>>, StoreError> {
    let mut metadata = MetadataStore::new();
    if let Some(traceparent) = mnemo_config::traceparent() {
        let _ = metadata.insert(TRACEPARENT, traceparent);
    }
    if failures > 0 {
        let _ = metadata.insert(FAILURES, failures.to_string());
    }
    Ok(TaskBuilder::new(serde_json::to_vec(job)?).with_metadata(metadata))
}

/// Pushes jobs onto their own queue with `conn` (a transaction, so they commit with the rows
/// they are about).
pub(crate) async fn push<J: JobArgs>(conn: &mut PgConnection, jobs: &[J]) -> Result<(), StoreError> {
    if jobs.is_empty() {
        return Ok(());
    }
    let tasks = jobs.iter().map(|job| Ok(task(job, 0)?.build()));
    push_tasks(conn, J::QUEUE.as_str(), tasks.collect::<Result<_, StoreError>>()?).await?;
    Ok(())
}

/// Pushes a job due after `delay`. apalis stores run_at in whole seconds, truncating: the due
/// time is rounded up, or a sub-second remainder could make the job due at once.
pub(crate) async fn push_after<J: JobArgs>(
    conn: &mut PgConnection,
    job: &J,
    delay: Duration,
    failures: usize,
) -> Result<(), StoreError> {
    let due = (SystemTime::now() + delay).duration_since(UNIX_EPOCH).unwrap_or_default();
    let due_secs = due.as_secs() + u64::from(due.subsec_nanos() > 0);
    let task = task(job, failures)?.run_at_timestamp(due_secs).build();
    push_tasks(conn, J::QUEUE.as_str(), vec![task]).await?;
    Ok(())
}

impl crate::Store {
    /// Queues `job` again on its own queue, due after `delay`: the worker's durable backoff
    /// (apalis retries a failed job at once and ignores a retry delay).
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn retry_after<J: JobArgs>(&self, job: &J, delay: Duration) -> Result<bool, StoreError> {
        self.retry(job, delay, 0).await
    }

    /// Queues `job` again after it failed for the `failures`-th time in a row, due after
    /// `delay`; the next run knows how many failures it follows ([`failures_before`]). False
    /// when the job had no work left ([`JobArgs::user_work`]) and was not queued.
    pub async fn retry_failed<J: JobArgs>(
        &self,
        job: &J,
        delay: Duration,
        failures: usize,
    ) -> Result<bool, StoreError> {
        self.retry(job, delay, failures).await
    }

    /// Queues `job` again (see [`JobArgs::user_work`] for a job naming a user); whether it did.
    async fn retry<J: JobArgs>(&self, job: &J, delay: Duration, failures: usize) -> Result<bool, StoreError> {
        let Some(([tenant, agent, user], work_query)) = job.user_work() else {
            let mut tx = self.pool.begin().await?;
            if let Some((statement, tenant, ids)) = job.rows_waiting() {
                sqlx::query(statement).bind(tenant).bind(ids).bind(delay.as_secs_f64()).execute(&mut *tx).await?;
            }
            push_after(&mut tx, job, delay, failures).await?;
            tx.commit().await?;
            return Ok(true);
        };
        let mut tx = self.pool.begin().await?;
        crate::workspace::share_user_files(&mut tx, tenant, user).await?;
        let has_work: bool =
            sqlx::query_scalar(work_query).bind(tenant).bind(agent).bind(user).fetch_one(&mut *tx).await?;
        if has_work {
            push_after(&mut tx, job, delay, failures).await?;
        }
        tx.commit().await?;
        Ok(has_work)
    }

    /// Makes every job of `J`'s queue that waits out a backoff due now, for when what failed
    /// (a model endpoint) answers again; how many.
    pub async fn retry_now<J: JobArgs>(&self) -> Result<u64, StoreError> {
        Ok(sqlx::query(
            "UPDATE apalis.jobs SET run_at = now()
             WHERE job_type = $1 AND status = 'Pending' AND run_at > now()",
        )
        .bind(J::QUEUE.as_str())
        .execute(&self.pool)
        .await?
        .rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_without_a_failure_count_follows_none() {
        let mut metadata = MetadataStore::new();
        assert_eq!(failures_before(&metadata), 0);
        let _ = metadata.insert(FAILURES, "3");
        assert_eq!(failures_before(&metadata), 3);
    }

    #[test]
    fn compact_jobs_carry_their_keep_and_those_queued_before_still_decode() {
        let old = serde_json::json!({ "tenant_id": "acme", "session_id": "s1", "trigger": "messages",
            "keep_at_most": null, "summary_failures": 0 });
        let job: CompactJob = serde_json::from_value(old.clone()).expect("decodes");
        assert_eq!(job.keep, None);
        assert_eq!(serde_json::to_value(&job).expect("encodes"), old, "no keep, no field");

        for (keep, form) in [
            (Keep::Turns(1), serde_json::json!({ "turns": 1 })),
            (Keep::Tokens(500), serde_json::json!({ "tokens": 500 })),
        ] {
            let job = CompactJob { keep: Some(keep), ..job.clone() };
            let encoded = serde_json::to_value(&job).expect("encodes");
            assert_eq!(encoded["keep"], form);
            assert_eq!(serde_json::from_value::<CompactJob>(encoded).expect("decodes"), job);
        }
        let bad = serde_json::json!({ "tenant_id": "acme", "session_id": "s1", "trigger": "messages",
            "keep": { "pairs": 2 } });
        assert!(serde_json::from_value::<CompactJob>(bad).is_err());
    }

    #[test]
    fn embed_jobs_of_one_row_queued_before_still_decode() {
        let id = Uuid::now_v7();
        let old = serde_json::json!({ "tenant_id": "acme", "item_id": id, "content_sha256": "ab" });
        let job: EmbedJob = serde_json::from_value(old).expect("decodes");
        assert_eq!(job.items, vec![EmbedItem { item_id: id, content_sha256: "ab".into() }]);

        let now = serde_json::to_value(&job).expect("encodes");
        assert_eq!(
            now,
            serde_json::json!({ "tenant_id": "acme", "items": [{ "item_id": id, "content_sha256": "ab" }] })
        );
        assert_eq!(serde_json::from_value::<EmbedJob>(now).expect("decodes"), job);

        for bad in [
            serde_json::json!({ "tenant_id": "acme", "items": [] }),
            serde_json::json!({ "tenant_id": "acme", "item_id": id }),
            serde_json::json!({ "tenant_id": " ", "item_id": id, "content_sha256": "ab" }),
        ] {
            assert!(serde_json::from_value::<EmbedJob>(bad).is_err());
        }
    }
}

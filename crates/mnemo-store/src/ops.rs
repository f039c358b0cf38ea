//! Operations: the once-per-tick housekeeping claim, pruning of finished jobs and dead worker
//! rows, the status figures the runbook and the worker's metrics report, and the delivery check
//! of the fault suite.

use std::time::Duration;

use chrono::{DateTime, Utc};
use mnemo_core::{Queue, TenantId};
use uuid::Uuid;

use crate::{Store, StoreError};

/// Jobs in one queue, by state. `dead` are jobs apalis will not run again (killed, or failed
/// with no attempts left).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct QueueStatus {
    pub queue: String,
    pub pending: i64,
    pub running: i64,
    pub failed: i64,
    pub dead: i64,
    /// Jobs done and not pruned yet; counted only when asked (`queue_status(true)`): there are
    /// an hour of every job's worth, read whole.
    pub done: Option<i64>,
    /// Age of the oldest job that could run now but has not started.
    pub oldest_pending_seconds: Option<f64>,
}

/// Rows without a vector of the active model.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedBacklog {
    pub pending: i64,
    pub oldest_pending_seconds: Option<f64>,
    /// Rows that failed for good (`embed_error` set).
    pub failed: i64,
}

/// What became of acknowledged writes (see [`Store::delivery`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery {
    /// Acknowledged ids with no row.
    pub missing: i64,
    /// Rows of those ids without a vector of the model (and not failed for good).
    pub unembedded: i64,
    /// Rows of those ids that failed embedding for good.
    pub failed: i64,
    /// Vectors of the model stored for those ids (the key allows one per row and model, so fewer
    /// than the rows means some lack theirs).
    pub vectors: i64,
}

/// A worker process seen by the queue backend.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerStatus {
    pub id: String,
    pub queue: String,
    pub last_seen: DateTime<Utc>,
    pub alive: bool,
}

/// What one housekeeping run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Housekeeping {
    /// Jobs queued again: lost embed, judge and extraction jobs, and facts asked about again
    /// after a judge failure that may pass.
    pub requeued: u64,
    pub pruned_jobs: u64,
    pub removed_workers: u64,
    /// Tenants whose retention sweep was scheduled.
    pub retention_scheduled: u64,
    /// (agent, user) pairs whose nightly consolidation was queued.
    pub consolidations_scheduled: u64,
}

/// The most finished jobs one housekeeping tick deletes.
const PRUNE_JOBS: i64 = 20_000;

impl Store {
    /// Claims housekeeping tick `tick` for `worker`. Exactly one caller per tick gets `true`.
    pub async fn claim_housekeeping_tick(&self, tick: i64, worker: &str) -> Result<bool, StoreError> {
        let claimed =
            sqlx::query("INSERT INTO housekeeping_ticks (tick, worker) VALUES ($1, $2) ON CONFLICT DO NOTHING")
                .bind(tick)
                .bind(worker)
                .execute(&self.pool)
                .await?
                .rows_affected();
        Ok(claimed == 1)
    }

    pub async fn finish_housekeeping_tick(&self, tick: i64, done: Housekeeping) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE housekeeping_ticks SET requeued = $2, pruned_jobs = $3, removed_workers = $4, finished_at = now()
             WHERE tick = $1",
        )
        .bind(tick)
        .bind(done.requeued as i64)
        .bind(done.pruned_jobs as i64)
        .bind(done.removed_workers as i64)
        .execute(&self.pool)
        .await?;
        // Keep a day of history at the default tick.
        sqlx::query("DELETE FROM housekeeping_ticks WHERE tick < $1 - 10000").bind(tick).execute(&self.pool).await?;
        Ok(())
    }

    /// Deletes jobs that finished (done, or dead) longer than `retention` ago, judge batch
    /// records older than a week (`judge tune` reads the last hours), and retention sweep records
    /// older than 30 days.
    pub async fn prune_finished_jobs(&self, retention: Duration) -> Result<u64, StoreError> {
        sqlx::query("DELETE FROM judge_batches WHERE finished_at < now() - interval '7 days'")
            .execute(&self.pool)
            .await?;
        sqlx::query("DELETE FROM retention_sweeps WHERE scheduled_at < now() - interval '30 days'")
            .execute(&self.pool)
            .await?;
        // At most `PRUNE_JOBS` a tick, the oldest first through their index (migration 047): a
        // backlog (after an outage, or a shorter retention) goes over a few ticks, not in one
        // statement holding every row.
        let pruned = sqlx::query(
            "DELETE FROM apalis.jobs WHERE id IN (
                 SELECT id FROM apalis.jobs
                 WHERE (status = 'Done' OR status = 'Killed' OR (status = 'Failed' AND attempts >= max_attempts))
                   AND coalesce(done_at, run_at) < now() - make_interval(secs => $1)
                 ORDER BY coalesce(done_at, run_at) LIMIT $2)",
        )
        .bind(retention.as_secs_f64())
        .bind(PRUNE_JOBS)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(pruned)
    }

    /// Deletes worker rows not seen for `max_age` that hold no job.
    pub async fn remove_stale_workers(&self, max_age: Duration) -> Result<u64, StoreError> {
        let removed = sqlx::query(
            "DELETE FROM apalis.workers w
             WHERE w.last_seen < now() - make_interval(secs => $1)
               AND NOT EXISTS (SELECT 1 FROM apalis.jobs j WHERE j.lock_by = w.id)",
        )
        .bind(max_age.as_secs_f64())
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(removed)
    }

    /// Each queue's jobs by state, every queue listed. Live and dead jobs are read through their own indexes
    /// (migrations 043 and 047), so the workers' gauges, refreshed every few seconds, never read
    /// the finished jobs; `count_done` counts those too (the runbook's `status`).
    pub async fn queue_status(&self, count_done: bool) -> Result<Vec<QueueStatus>, StoreError> {
        let live: Vec<(String, i64, i64, i64, Option<f64>)> = sqlx::query_as(
            "SELECT job_type,
                    count(*) FILTER (WHERE status IN ('Pending', 'Queued')),
                    count(*) FILTER (WHERE status = 'Running'),
                    count(*) FILTER (WHERE status = 'Failed'),
                    extract(epoch FROM now() - min(run_at) FILTER (WHERE status = 'Pending' AND run_at <= now()))::float8
             FROM apalis.jobs
             WHERE status IN ('Pending', 'Queued', 'Running') OR (status = 'Failed' AND attempts < max_attempts)
             GROUP BY job_type",
        )
        .fetch_all(&self.pool)
        .await?;
        let dead: Vec<(String, i64)> = sqlx::query_as(
            "SELECT job_type, count(*) FROM apalis.jobs
             WHERE status = 'Killed' OR (status = 'Failed' AND attempts >= max_attempts) GROUP BY job_type",
        )
        .fetch_all(&self.pool)
        .await?;
        let done: Vec<(String, i64)> = if count_done {
            sqlx::query_as("SELECT job_type, count(*) FROM apalis.jobs WHERE status = 'Done' GROUP BY job_type")
                .fetch_all(&self.pool)
                .await?
        } else {
            Vec::new()
        };
        // Every queue, by name, zeros included: a gauge whose queue went empty reads 0, not its
        // last value; then any other job type the table holds.
        let empty = |queue: String| QueueStatus {
            queue,
            pending: 0,
            running: 0,
            failed: 0,
            dead: 0,
            done: count_done.then_some(0),
            oldest_pending_seconds: None,
        };
        let mut queues: std::collections::BTreeMap<String, QueueStatus> =
            Queue::ALL.iter().map(|q| (q.as_str().to_owned(), empty(q.as_str().to_owned()))).collect();
        for (name, pending, running, failed, oldest) in live {
            let q = queues.entry(name.clone()).or_insert_with(|| empty(name));
            (q.pending, q.running, q.failed, q.oldest_pending_seconds) = (pending, running, failed, oldest);
        }
        for (name, n) in dead {
            queues.entry(name.clone()).or_insert_with(|| empty(name)).dead = n;
        }
        for (name, n) in done {
            queues.entry(name.clone()).or_insert_with(|| empty(name)).done = Some(n);
        }
        Ok(queues.into_values().collect())
    }

    /// Checks acknowledged writes of `tenant` after a fault: every id has its row, and each row
    /// its one vector of `model`.
    pub async fn delivery(&self, tenant: &TenantId, ids: &[Uuid], model: &str) -> Result<Delivery, StoreError> {
        let (missing, unembedded, failed, vectors): (i64, i64, i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE m.id IS NULL),
                    count(*) FILTER (WHERE m.id IS NOT NULL AND m.embed_error IS NULL
                                     AND m.embedded_model IS DISTINCT FROM $3),
                    count(*) FILTER (WHERE m.embed_error IS NOT NULL),
                    (SELECT count(*) FROM memory_embeddings e
                     WHERE e.tenant_id = $1 AND e.model = $3 AND e.item_id = ANY($2))
             FROM unnest($2::uuid[]) AS a(id)
             LEFT JOIN memory_items m ON m.tenant_id = $1 AND m.id = a.id",
        )
        .bind(tenant.as_str())
        .bind(ids)
        .bind(model)
        .fetch_one(&self.pool)
        .await?;
        Ok(Delivery { missing, unembedded, failed, vectors })
    }

    /// Rows without a vector of `model`: waiting, how long the oldest has waited, and given up
    /// (any row whose embedding failed for good).
    /// Every worker reads it every 5 s, so both halves go through partial indexes that hold
    /// (nearly) nothing in steady state: migration 8's for the rows waiting (by three ranges of
    /// the model: a btree cannot serve `<>`), migration 42's for those given up.
    pub async fn embed_backlog(&self, model: &str) -> Result<EmbedBacklog, StoreError> {
        let (pending, oldest_pending_seconds, failed): (i64, Option<f64>, i64) = sqlx::query_as(
            "SELECT w.n, w.oldest, f.n
             FROM (SELECT count(*) AS n, extract(epoch FROM now() - min(created_at))::float8 AS oldest
                   FROM memory_items
                   WHERE embed_error IS NULL AND deleted_at IS NULL AND anonymized_at IS NULL
                     AND (embedded_model IS NULL OR embedded_model < $1 OR embedded_model > $1)) w,
                  -- Whatever model a row names: one whose vector was dropped (it held the words
                  -- of a turn anonymized since) keeps its model, and its re-embedding may fail.
                  (SELECT count(*) AS n FROM memory_items
                   WHERE embed_error IS NOT NULL AND deleted_at IS NULL AND anonymized_at IS NULL) f",
        )
        .bind(model)
        .fetch_one(&self.pool)
        .await?;
        Ok(EmbedBacklog { pending, oldest_pending_seconds, failed })
    }

    /// Worker rows; `alive` when seen within `alive_within`.
    pub async fn workers(&self, alive_within: Duration) -> Result<Vec<WorkerStatus>, StoreError> {
        let rows: Vec<(String, String, DateTime<Utc>, bool)> = sqlx::query_as(
            "SELECT id, worker_type, last_seen, last_seen >= now() - make_interval(secs => $1)
             FROM apalis.workers ORDER BY last_seen DESC",
        )
        .bind(alive_within.as_secs_f64())
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|(id, queue, last_seen, alive)| WorkerStatus { id, queue, last_seen, alive }).collect())
    }
}

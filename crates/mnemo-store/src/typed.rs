//! The jobs of typed memory: access tracking from recall (applied by a job, never in the recall
//! statement), promotion of episodic memories seen in two sessions, and fading of episodic
//! memories whose decay fell below the floor. Promotion and fading are cross-tenant by design
//! (housekeeping finds the work, in bounded batches); each update names its row's tenant.

use chrono::{DateTime, Utc};
use mnemo_core::{AuditEvent, TenantId};
use uuid::Uuid;

use crate::queue::{AccessJob, JobArgs, push};
use crate::{Store, StoreError};

/// How long an access batch waits for a row lock: well under `deadlock_timeout` (1 s).
const ACCESS_LOCK_WAIT: &str = "SET LOCAL lock_timeout = '200ms'";

/// Applies one access batch once: a retried job finds its batch id taken and counts nothing.
/// Accessing a faded row brings it back into packs. Rows are locked in id order, so two batches
/// sharing rows wait on each other instead of deadlocking.
const APPLY_ACCESS: &str = "
WITH batch AS (
    INSERT INTO access_batches (tenant_id, id) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING id
), hits AS (
    SELECT item, count(*)::int AS n FROM unnest($3::uuid[]) AS item WHERE EXISTS (SELECT 1 FROM batch)
    GROUP BY item
), locked AS (
    -- NO KEY UPDATE: no key changes, so a write whose foreign key names the row (a relation)
    -- does not wait on it.
    SELECT m.id, hits.n FROM memory_items m JOIN hits ON m.id = hits.item
    WHERE m.tenant_id = $1 ORDER BY m.id FOR NO KEY UPDATE OF m
)
UPDATE memory_items m
-- The count stops at the column's largest value: an overflow would fail the whole batch.
SET last_accessed_at = greatest(m.last_accessed_at, $4),
    access_count = least(m.access_count::bigint + locked.n, 2147483647)::int, faded_at = NULL
FROM locked WHERE m.tenant_id = $1 AND m.id = locked.id";

/// Live episodic memories (not session rows) with confidence at least `$1`, whose fingerprint
/// was seen in two or more sessions within their bucket (same tenant, scope, identities and
/// readers: a sighting no reader of the row could see never changes it), become semantic, with
/// an audit row each; at most `$2` groups per run, each whole (a group cut in two would leave
/// its other rows a group of one session at the next run), but for a row another writer holds
/// at that moment, which is passed over (SKIP LOCKED) and waits for a sighting of its own.
const PROMOTE: &str = "
WITH groups AS (
    SELECT m.tenant_id, m.scope, m.user_id, m.agent_id, m.visibility, m.allowed_roles, m.fingerprint
    FROM memory_items m JOIN memory_sightings s ON s.tenant_id = m.tenant_id AND s.item_id = m.id
    WHERE m.layer = 'episodic' AND m.fingerprint IS NOT NULL AND m.scope <> 'session'
      AND m.deleted_at IS NULL AND m.anonymized_at IS NULL AND m.superseded_by IS NULL
    GROUP BY 1, 2, 3, 4, 5, 6, 7
    HAVING count(DISTINCT s.session_id) >= 2 AND bool_or(m.confidence >= $1)
    LIMIT $2
), picked AS (
    SELECT m.tenant_id, m.id FROM memory_items m
    JOIN groups g ON g.tenant_id = m.tenant_id AND g.fingerprint = m.fingerprint AND g.scope = m.scope
                 AND g.user_id IS NOT DISTINCT FROM m.user_id AND g.agent_id IS NOT DISTINCT FROM m.agent_id
                 AND g.visibility = m.visibility AND g.allowed_roles = m.allowed_roles
    WHERE m.layer = 'episodic' AND m.confidence >= $1
      AND m.deleted_at IS NULL AND m.anonymized_at IS NULL AND m.superseded_by IS NULL
    FOR UPDATE OF m SKIP LOCKED
), promoted AS (
    UPDATE memory_items m SET layer = 'semantic', faded_at = NULL
    FROM picked WHERE m.tenant_id = picked.tenant_id AND m.id = picked.id
    RETURNING m.tenant_id, m.id
), audit AS (
    INSERT INTO audit_log (tenant_id, event, item_id, reason, actor)
    SELECT tenant_id, $3, id, 'seen_in_two_sessions', 'housekeeping' FROM promoted
)
SELECT count(*) FROM promoted";

/// Live episodic memories (not session rows) last of use ([`decay_clock!`]) before `$1` leave
/// packs; at most `$2` per run.
const FADE: &str = concat!(
    "
WITH picked AS (
    SELECT tenant_id, id FROM memory_items
    WHERE layer = 'episodic' AND scope <> 'session' AND faded_at IS NULL
      AND deleted_at IS NULL AND anonymized_at IS NULL
      AND ",
    decay_clock!(),
    " < $1
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE memory_items m SET faded_at = now()
FROM picked WHERE m.tenant_id = picked.tenant_id AND m.id = picked.id"
);

/// Episodic facts faded before `$4` (not superseded ones, which have their own TTL) last of use
/// ([`decay_clock!`]) before `$1` are deleted, soft (the retention sweep anonymizes them), their validity
/// ended as an API delete ends it, with an audit row each; at most `$2` per run. Only facts: a
/// daily note's pieces live as long as their note, and documents as long as their writer keeps
/// them.
const FORGET: &str = concat!(
    "
WITH picked AS (
    SELECT tenant_id, id FROM memory_items
    WHERE layer = 'episodic' AND source_kind = 'fact' AND scope <> 'session' AND faded_at IS NOT NULL
      AND deleted_at IS NULL AND anonymized_at IS NULL AND superseded_by IS NULL
      AND ",
    decay_clock!(),
    " < $1 AND faded_at < $4
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), deleted AS (
    UPDATE memory_items m SET deleted_at = now(), valid_to = COALESCE(m.valid_to, now())
    FROM picked WHERE m.tenant_id = picked.tenant_id AND m.id = picked.id
    RETURNING m.tenant_id, m.id
), audit AS (
    INSERT INTO audit_log (tenant_id, event, item_id, reason, actor)
    SELECT tenant_id, $3, id, 'decayed', 'maintenance' FROM deleted
)
SELECT count(*) FROM deleted"
);

impl Store {
    /// Queues one access batch for `tenant`: the rows a recall returned, as of `at`.
    pub async fn queue_access(&self, tenant: &TenantId, items: Vec<Uuid>, at: DateTime<Utc>) -> Result<(), StoreError> {
        let job = AccessJob { tenant_id: tenant.clone(), batch: Uuid::now_v7(), items, at };
        let mut conn = self.pool.acquire().await?;
        push(&mut conn, &[job]).await
    }

    /// Records an access batch on its rows; returns how many rows it touched (0 when the batch
    /// was applied before). Bookkeeping gives way: a row another transaction holds for longer
    /// than [`ACCESS_LOCK_WAIT`] fails the batch, to be retried after a backoff, before
    /// PostgreSQL's deadlock check (after a second) could abort the other side instead (a judge
    /// that retires rows a recall returned, whose model call would be paid for again).
    pub async fn apply_access(&self, job: &AccessJob) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(ACCESS_LOCK_WAIT).execute(&mut *tx).await?;
        let touched = sqlx::query(APPLY_ACCESS)
            .bind(job.tenant_id.as_str())
            .bind(job.batch)
            .bind(&job.items)
            .bind(job.at)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(touched)
    }

    /// Promotes episodic memories seen in two sessions (see [`PROMOTE`]); returns how many.
    pub async fn promote_episodic(&self, min_confidence: f64, limit: i64) -> Result<u64, StoreError> {
        let promoted: i64 = sqlx::query_scalar(PROMOTE)
            .bind(min_confidence as f32)
            .bind(limit)
            .bind(AuditEvent::Promote.as_str())
            .fetch_one(&self.pool)
            .await?;
        Ok(promoted as u64)
    }

    /// Marks episodic memories unused since `before` as faded; returns how many.
    pub async fn fade_episodic(&self, before: DateTime<Utc>, limit: i64) -> Result<u64, StoreError> {
        Ok(sqlx::query(FADE).bind(before).bind(limit).execute(&self.pool).await?.rows_affected())
    }

    /// Deletes episodic facts faded before `faded_before` and unused since `before` (see
    /// [`FORGET`]); returns how many.
    pub async fn forget_decayed(
        &self,
        before: DateTime<Utc>,
        faded_before: DateTime<Utc>,
        limit: i64,
    ) -> Result<u64, StoreError> {
        let forgotten: i64 = sqlx::query_scalar(FORGET)
            .bind(before)
            .bind(limit)
            .bind(AuditEvent::Delete.as_str())
            .bind(faded_before)
            .fetch_one(&self.pool)
            .await?;
        Ok(forgotten as u64)
    }

    /// Forgets applied access batches older than a day, and applied before the accesses of
    /// every access job not yet done were made: a job run again after a long outage (every
    /// worker down for a day), or queued again after a failure that came after its batch
    /// committed, still finds its batch applied, and counts nothing twice.
    pub async fn prune_access_batches(&self) -> Result<u64, StoreError> {
        let prune = "DELETE FROM access_batches WHERE applied_at < least(now() - interval '1 day', (
                         SELECT min((convert_from(job, 'UTF8')::jsonb ->> 'at')::timestamptz)
                         FROM apalis.jobs WHERE job_type = $1
                           AND (status IN ('Pending', 'Queued', 'Running') OR (status = 'Failed' AND attempts < max_attempts))))";
        Ok(sqlx::query(prune).bind(AccessJob::QUEUE.as_str()).execute(&self.pool).await?.rows_affected())
    }

    /// Computes again the promotion fingerprint of episodic memories that hold a signed number
    /// (written before the fingerprint kept signs), `batch` rows a statement in key order,
    /// calling `progress` with the rows read and changed so far. Idempotent. Returns both.
    pub async fn refingerprint(
        &self,
        tenant: Option<&TenantId>,
        batch: i64,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(u64, u64), StoreError> {
        let (mut after, mut read, mut changed) = ((String::new(), Uuid::nil()), 0u64, 0u64);
        loop {
            // A superset of what `fingerprint` reads as a sign: a minus before a digit.
            let rows: Vec<(String, Uuid, String, String)> = sqlx::query_as(
                "SELECT tenant_id, id, content, fingerprint FROM memory_items
                 WHERE (tenant_id, id) > ($1, $2) AND ($3::text IS NULL OR tenant_id = $3)
                   AND layer = 'episodic' AND fingerprint IS NOT NULL AND content ~ '[-−][0-9]'
                 ORDER BY tenant_id, id LIMIT $4",
            )
            .bind(&after.0)
            .bind(after.1)
            .bind(tenant.map(TenantId::as_str))
            .bind(batch)
            .fetch_all(&self.pool)
            .await?;
            let Some(last) = rows.last() else { return Ok((read, changed)) };
            after = (last.0.clone(), last.1);
            read += rows.len() as u64;
            let stale: Vec<(String, Uuid, String)> = rows
                .into_iter()
                .filter_map(|(tenant, id, content, stored)| {
                    let now = mnemo_core::fingerprint(&content);
                    (now != stored).then_some((tenant, id, now))
                })
                .collect();
            if !stale.is_empty() {
                let (tenants, (ids, prints)): (Vec<String>, (Vec<Uuid>, Vec<String>)) =
                    stale.into_iter().map(|(t, id, p)| (t, (id, p))).unzip();
                changed += sqlx::query(
                    "UPDATE memory_items m SET fingerprint = c.fingerprint
                     FROM unnest($1::text[], $2::uuid[], $3::text[]) AS c(tenant_id, id, fingerprint)
                     WHERE m.tenant_id = c.tenant_id AND m.id = c.id AND m.fingerprint IS NOT NULL",
                )
                .bind(&tenants)
                .bind(&ids)
                .bind(&prints)
                .execute(&self.pool)
                .await?
                .rows_affected();
            }
            progress(read, changed);
        }
    }
}

//! Consolidation's state per (agent, user): requests (throttled when extraction asks), the one
//! run at a time, the watermark, and applying a new MEMORY.md with the watermark in one
//! transaction.

use std::time::Duration;

use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};
use mnemo_core::{AgentId, TenantId, UserId, Workspace, WorkspacePath};

use crate::queue::{ConsolidateJob, push, push_after};
use crate::workspace::{Replacement, current, key_in, lock, replace_core_file, share_user_files, user_of};
use crate::{Store, StoreError};

/// Who wrote MEMORY.md changes made by consolidation, in versions and audit rows.
const ACTOR: &str = "consolidation";

/// Asks for a run. With a throttle (`$4` seconds: an extraction asking), unless one was asked
/// for within it, doubled for each run that failed in a row, at most 2^5 times (16 hours at the
/// default 30 minutes, so the nightly schedule, never throttled, still comes): a failed run's
/// notes are shown to the model again by the next. Without (by hand), unless a request is still
/// waiting for its run: asked after the last run began or ended, within [`REQUEST_LOST_AFTER`]
/// (a job that found nothing to do takes no run).
const REQUEST: &str = "
INSERT INTO consolidation_state AS s (tenant_id, agent_id, user_id, last_requested_at) VALUES ($1, $2, $3, now())
ON CONFLICT (tenant_id, agent_id, user_id) DO UPDATE SET last_requested_at = now()
WHERE s.last_requested_at IS NULL
   OR CASE WHEN $4::float8 IS NULL
        THEN s.last_requested_at <= GREATEST(s.running_since, s.last_finished_at, '-infinity'::timestamptz)
             OR s.last_requested_at < now() - make_interval(secs => $5)
        ELSE s.last_requested_at < now() - make_interval(secs => $4 * 2 ^ LEAST(s.failures, 5))
      END
RETURNING true";

/// A request by hand that has not led to a run this long after it is taken for one that never
/// will (a job that found no note), and does not hold back the next.
const REQUEST_LOST_AFTER: Duration = Duration::from_secs(600);

/// A daily note's path (`memory/YYYY-MM-DD.md`; not an archived one, which no run reads).
macro_rules! daily_note_path {
    () => {
        "path ~ '^memory/[0-9]{4}-[0-9]{2}-[0-9]{2}[.]md$'"
    };
}

/// A user's live daily note, as `workspace_files_daily_note_idx` (migration 043) holds them.
macro_rules! live_daily_note {
    () => {
        concat!("user_id <> '' AND deleted_at IS NULL AND ", daily_note_path!())
    };
}

/// Every (agent, user) with daily notes, of a tenant in zone `$2`, whose schedule fired at `$1`
/// and was not acted on yet: marked, and returned to be queued. Cross-tenant: housekeeping finds
/// the work, each job carries its own tenant. The tenants with notes are found first, then those
/// of the zone, one zone lookup a tenant (not one a file; hence MATERIALIZED), then their notes.
const SCHEDULE: &str = concat!(
    "
WITH noted AS MATERIALIZED (SELECT DISTINCT tenant_id AS t FROM workspace_files WHERE ",
    live_daily_note!(),
    "),
zone_tenants AS MATERIALIZED (SELECT t FROM noted WHERE tenant_time_zone(t) = $2)
INSERT INTO consolidation_state AS s (tenant_id, agent_id, user_id, last_scheduled_at, last_requested_at)
SELECT DISTINCT tenant_id, agent_id, user_id, $1::timestamptz, now() FROM workspace_files
WHERE ",
    live_daily_note!(),
    "
  AND tenant_id IN (SELECT t FROM zone_tenants)
  -- A note of the days a run reads (from `$3`, the first): older ones alone leave it nothing to do.
  AND path >= 'memory/' || to_char($3::date, 'YYYY-MM-DD')
ON CONFLICT (tenant_id, agent_id, user_id) DO UPDATE SET last_scheduled_at = $1, last_requested_at = now()
WHERE s.last_scheduled_at IS NULL OR s.last_scheduled_at < $1
RETURNING tenant_id, agent_id, user_id"
);

/// Removes the tenant's (`$1`) consolidation states that no run holds and whose user has no file
/// under the agent at all, not even a deleted one (an erased user): the (agent `$2`, user `$3`)'s
/// when given, else every such one.
pub(crate) const FORGET_IDLE_STATES: &str = "
DELETE FROM consolidation_state s
WHERE s.tenant_id = $1 AND ($2::text IS NULL OR (s.agent_id = $2 AND s.user_id = $3)) AND s.running_by IS NULL
  AND NOT EXISTS (SELECT 1 FROM workspace_files w
                  WHERE w.tenant_id = $1 AND w.agent_id = s.agent_id AND w.user_id = s.user_id)";

/// The nightly schedule, as a whole: it holds this alone while it scans and queues, and a user's
/// erasure holds it shared. So the schedule never reads a note an erasure in flight is deleting
/// (it would queue a job and write a state row naming the user after the erasure), and an
/// erasure that comes while it runs waits, then deletes what it queued. One lock, not one per
/// user: a schedule may queue thousands of users in one transaction.
const LOCK_SCHEDULE_ALONE: &str = "SELECT pg_advisory_xact_lock(hashtextextended('consolidation schedule', 0))";
const LOCK_SCHEDULE: &str = "SELECT pg_advisory_xact_lock_shared(hashtextextended('consolidation schedule', 0))";

/// Shares the nightly schedule's lock until `tx` ends, as a user's erasure does (see
/// [`LOCK_SCHEDULE_ALONE`]).
pub(crate) async fn share_schedule(tx: &mut sqlx::PgConnection) -> Result<(), StoreError> {
    sqlx::query(LOCK_SCHEDULE).execute(tx).await?;
    Ok(())
}

/// Whether the (tenant `$1`, agent `$2`, user `$3`) has a live daily note.
macro_rules! has_daily_note {
    () => {
        concat!(
            "EXISTS (SELECT 1 FROM workspace_files
                 WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3 AND deleted_at IS NULL AND ",
            daily_note_path!(),
            ")"
        )
    };
}

/// Whether the (tenant `$1`, agent `$2`, user `$3`) has a live daily note.
pub(crate) const HAS_NOTE: &str = concat!("SELECT ", has_daily_note!());

/// Whether a consolidation job of the (tenant `$1`, agent `$2`, user `$3`) has work: a live
/// daily note to read, or a state row to remove (one a request racing the user's erasure wrote).
pub(crate) const HAS_WORK: &str = concat!(
    "SELECT ",
    has_daily_note!(),
    " OR EXISTS (SELECT 1 FROM consolidation_state WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3)"
);

/// Takes the run when nobody holds it (or its holder is presumed dead) and the user has a live
/// daily note (none once the user was erased: no state row may name them then).
const CLAIM: &str = concat!(
    "
INSERT INTO consolidation_state AS s (tenant_id, agent_id, user_id, running_since, running_by)
SELECT $1, $2, $3, now(), $4
WHERE ",
    has_daily_note!(),
    "
ON CONFLICT (tenant_id, agent_id, user_id) DO UPDATE SET running_since = now(), running_by = $4
WHERE s.running_since IS NULL OR s.running_since < now() - make_interval(secs => $5)
RETURNING true"
);

/// The user's live daily notes of days from `$4` on at a version consolidation has not read,
/// oldest first.
const CHANGED_NOTES: &str = concat!(
    "
SELECT w.path, w.content, w.version, w.updated_at FROM workspace_files w
LEFT JOIN consolidation_state s USING (tenant_id, agent_id, user_id)
WHERE w.tenant_id = $1 AND w.agent_id = $2 AND w.user_id = $3 AND w.deleted_at IS NULL
  AND ",
    daily_note_path!(),
    " AND w.path >= $4
  AND w.version > COALESCE((s.consolidated ->> w.path)::int, 0)
  -- Changed since it was read, but not its text (a PATCH of `enabled`, a restore of what was
  -- read): shown again, the model would take what it merged for new.
  AND NOT EXISTS (SELECT 1 FROM workspace_file_versions v
                  WHERE v.tenant_id = w.tenant_id AND v.agent_id = w.agent_id AND v.user_id = w.user_id
                    AND v.path = w.path AND v.version = (s.consolidated ->> w.path)::int AND v.content = w.content)
ORDER BY w.path"
);

/// Ends the run held by `$7`: `$4` the notes' versions now consolidated (`{}` for none; entries
/// of notes no longer live are dropped), `$5` the outcome, `$6` its label, `$8` the newest
/// change consolidated (the watermark never moves back). Failures in a row are counted, but not
/// an edit of MEMORY.md or of a note during the model call, a MEMORY.md too large to send (no
/// model was paid for, and once it is shortened the next run should not wait), or a database
/// error: the next run may well succeed.
const FINISH: &str = "
UPDATE consolidation_state s SET running_since = NULL, running_by = NULL, last_finished_at = now(),
    consolidated = (
        SELECT COALESCE(jsonb_object_agg(e.key, e.value), '{}'::jsonb)
        FROM jsonb_each(s.consolidated || $4::jsonb) AS e
        WHERE EXISTS (SELECT 1 FROM workspace_files w
                      WHERE w.tenant_id = s.tenant_id AND w.agent_id = s.agent_id AND w.user_id = s.user_id
                        AND w.path = e.key AND w.deleted_at IS NULL)),
    watermark = GREATEST(watermark, COALESCE($8, watermark)), last_outcome = $5, last_reason = $6,
    failures = CASE WHEN $5 <> 'failed' THEN 0 WHEN $6 IN ('memory_changed', 'notes_changed', 'memory_too_large', 'error') THEN failures ELSE failures + 1 END
WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3 AND running_by = $7";

/// What a request for an (agent, user)'s consolidation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsolidationRequest {
    /// Its job is queued.
    Queued,
    /// An earlier request waits for its run (or, throttled, was made too recently).
    Waiting,
    /// The user has no live daily note: nothing to consolidate.
    NoNote,
}

/// What a claim of an (agent, user)'s consolidation run found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsolidationClaim {
    Claimed,
    /// Another run holds it: the job was queued again.
    Held,
    /// The user has no live daily note (erased since the job was queued, say): nothing to run.
    NoNote,
}

/// A daily note to consolidate, at the version read.
#[derive(Debug, Clone, PartialEq)]
pub struct ChangedNote {
    pub day: NaiveDate,
    pub content: String,
    pub version: i32,
    pub updated_at: DateTime<Utc>,
}

impl Store {
    /// Asks for a consolidation of the (agent, user) and queues its job, unless the user has no
    /// live daily note (nothing to read; an erased user among them), one was asked for within
    /// `throttle` (longer after failed runs), or, without a throttle, one is still waiting for
    /// its run.
    pub async fn request_consolidation(
        &self,
        workspace: &Workspace,
        throttle: Option<Duration>,
    ) -> Result<ConsolidationRequest, StoreError> {
        let user = user_of(workspace)?;
        let mut conn = self.tenant_connection([workspace.tenant.as_str()]).await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        // Under the user's files, shared: an erasure committing meanwhile leaves no note.
        share_user_files(&mut tx, workspace.tenant.as_str(), user).await?;
        let has_note: bool = sqlx::query_scalar(HAS_NOTE)
            .bind(workspace.tenant.as_str())
            .bind(workspace.agent.as_str())
            .bind(user)
            .fetch_one(&mut *tx)
            .await?;
        let request = if !has_note {
            ConsolidationRequest::NoNote
        } else if request_consolidation_in(&mut tx, workspace, throttle).await? {
            ConsolidationRequest::Queued
        } else {
            ConsolidationRequest::Waiting
        };
        tx.commit().await?;
        Ok(request)
    }

    /// Queues a consolidation for every (agent, user) with daily notes of the `day_range` days a
    /// run reads, of the tenants in `zone`, whose schedule fired at `local_fire` (wall-clock time
    /// in `zone`) and was not acted on yet; how many.
    pub async fn schedule_consolidations(
        &self,
        zone: &str,
        local_fire: NaiveDateTime,
        day_range: u32,
    ) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin().await?;
        let fire: DateTime<Utc> = sqlx::query_scalar("SELECT $1::timestamp AT TIME ZONE $2")
            .bind(local_fire)
            .bind(zone)
            .fetch_one(&mut *tx)
            .await?;
        // Once per fire across workers and ticks: only the claimant scans.
        let claimed =
            sqlx::query("INSERT INTO consolidation_fires (zone, fire) VALUES ($1, $2) ON CONFLICT DO NOTHING")
                .bind(zone)
                .bind(fire)
                .execute(&mut *tx)
                .await?
                .rows_affected();
        if claimed == 0 {
            return Ok(0);
        }
        sqlx::query(LOCK_SCHEDULE_ALONE).execute(&mut *tx).await?;
        // A claim matters while its fire is within the schedule's look-back (366 days).
        sqlx::query("DELETE FROM consolidation_fires WHERE fire < now() - interval '400 days'")
            .execute(&mut *tx)
            .await?;
        // The first day a run on the fire's day reads: that day and the `day_range - 1` before.
        let first_day = local_fire.date() - chrono::Days::new(u64::from(day_range.saturating_sub(1)));
        let due: Vec<(String, String, String)> =
            sqlx::query_as(SCHEDULE).bind(fire).bind(zone).bind(first_day).fetch_all(&mut *tx).await?;
        let jobs = due
            .iter()
            .map(|(tenant, agent, user)| {
                Ok(ConsolidateJob {
                    tenant_id: TenantId::parse(tenant)?,
                    agent_id: AgentId::parse(agent)?,
                    user_id: UserId::parse(user)?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        push(&mut tx, &jobs).await?;
        sqlx::query("UPDATE consolidation_fires SET scheduled = $3 WHERE zone = $1 AND fire = $2")
            .bind(zone)
            .bind(fire)
            .bind(i32::try_from(jobs.len()).unwrap_or(i32::MAX))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(jobs.len() as u64)
    }

    /// Whether the user has a live daily note under the agent: without one no consolidation has
    /// anything to read, and a job for the pair (one queued before the user's erasure, say) must
    /// not leave a state row naming them.
    pub async fn has_daily_notes(&self, workspace: &Workspace) -> Result<bool, StoreError> {
        Ok(sqlx::query_scalar(HAS_NOTE)
            .bind(workspace.tenant.as_str())
            .bind(workspace.agent.as_str())
            .bind(user_of(workspace)?)
            .fetch_one(&self.pool)
            .await?)
    }

    /// Removes the (agent, user)'s state when no run holds it and the user has no file under the
    /// agent at all, not even a deleted one: an erased user. A schedule or a request that races
    /// the user's erasure can write a row (and queue a job) naming them after the erasure took
    /// theirs; that job, finding no note, removes it here. A user who only deleted their notes
    /// keeps the state `memory status` shows.
    pub async fn forget_idle_consolidation(&self, workspace: &Workspace) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        let user = user_of(workspace)?;
        // After an erasure under way, which holds the user's files alone.
        share_user_files(&mut tx, workspace.tenant.as_str(), user).await?;
        sqlx::query(FORGET_IDLE_STATES)
            .bind(workspace.tenant.as_str())
            .bind(workspace.agent.as_str())
            .bind(user)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Takes `job`'s (agent, user)'s consolidation run. When another run holds it, `job` is queued
    /// again after `retry_in` in the claim's transaction, under the user's files: an erasure
    /// either commits first (then the user has no note, and nothing is queued) or waits, and its
    /// clean-up of the queue finds the retry.
    pub async fn claim_consolidation(
        &self,
        job: &ConsolidateJob,
        worker: &str,
        stale: Duration,
        retry_in: Duration,
    ) -> Result<ConsolidationClaim, StoreError> {
        let (tenant, agent, user) = (job.tenant_id.as_str(), job.agent_id.as_str(), job.user_id.as_str());
        // Under the user's files, shared: an erasure committing meanwhile is seen by the claim.
        let mut tx = self.pool.begin().await?;
        share_user_files(&mut tx, tenant, user).await?;
        let claimed: Option<bool> = sqlx::query_scalar(CLAIM)
            .bind(tenant)
            .bind(agent)
            .bind(user)
            .bind(worker)
            .bind(stale.as_secs_f64())
            .fetch_optional(&mut *tx)
            .await?;
        let claim = if claimed.is_some() {
            ConsolidationClaim::Claimed
        } else if sqlx::query_scalar(HAS_NOTE).bind(tenant).bind(agent).bind(user).fetch_one(&mut *tx).await? {
            push_after(&mut tx, job, retry_in, 0).await?;
            ConsolidationClaim::Held
        } else {
            ConsolidationClaim::NoNote
        };
        tx.commit().await?;
        Ok(claim)
    }

    /// The daily notes of days from `since` on that consolidation has not read at their current
    /// version, oldest first.
    pub async fn notes_to_consolidate(
        &self,
        workspace: &Workspace,
        since: NaiveDate,
    ) -> Result<Vec<ChangedNote>, StoreError> {
        let rows: Vec<(String, String, i32, DateTime<Utc>)> = sqlx::query_as(CHANGED_NOTES)
            .bind(workspace.tenant.as_str())
            .bind(workspace.agent.as_str())
            .bind(user_of(workspace)?)
            .bind(WorkspacePath::daily_note(since).as_str())
            .fetch_all(&self.pool)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(path, content, version, updated_at)| {
                Some(ChangedNote { day: WorkspacePath::parse(&path).ok()?.note_day()?, content, version, updated_at })
            })
            .collect())
    }

    /// Ends the run in one transaction: replaces MEMORY.md when `memory` is given (or, when it
    /// or a note `read` lost text since the model read them, changes nothing:
    /// [`StoreError::FileChanged`] naming the file), records the notes `read` as consolidated when
    /// given (so a run that failed leaves them to the next), and the outcome and its reason. A run
    /// another worker took over changes nothing ([`StoreError::RunLost`]).
    pub async fn finish_consolidation(
        &self,
        workspace: &Workspace,
        worker: &str,
        memory: Option<&Replacement>,
        read: Option<&[ChangedNote]>,
        outcome: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        let read = read.unwrap_or_default();
        if let Some(replacement) = memory {
            // What a user took out of a note during the model call must not reach MEMORY.md (a
            // note only added to, as extraction adds to today's, still holds what was read).
            // Locked before MEMORY.md, in the order extraction takes them.
            for note in read {
                let key = key_in(workspace, WorkspacePath::daily_note(note.day))?;
                lock(&mut tx, &key).await?;
                let now = current(&mut tx, &key).await?;
                // (Extraction trims a note's trailing blank before it adds an entry.)
                if !now.is_some_and(|c| !c.deleted && c.file.content.starts_with(note.content.trim_end())) {
                    return Err(StoreError::FileChanged { path: key.path.as_str().to_owned() });
                }
            }
            if !replace_core_file(&mut tx, workspace, "MEMORY.md", replacement, ACTOR).await? {
                return Err(StoreError::FileChanged { path: "MEMORY.md".to_owned() });
            }
        }
        let versions: serde_json::Map<String, serde_json::Value> =
            read.iter().map(|n| (WorkspacePath::daily_note(n.day).to_string(), n.version.into())).collect();
        let finished = sqlx::query(FINISH)
            .bind(workspace.tenant.as_str())
            .bind(workspace.agent.as_str())
            .bind(user_of(workspace)?)
            .bind(serde_json::Value::Object(versions))
            .bind(outcome)
            .bind(reason)
            .bind(worker)
            .bind(read.iter().map(|n| n.updated_at).max())
            .execute(&mut *tx)
            .await?;
        // Another worker took the run over: what this one would change is rolled back.
        if finished.rows_affected() == 0 {
            return Err(StoreError::RunLost);
        }
        tx.commit().await?;
        Ok(())
    }
}

/// [`Store::request_consolidation`] within `tx`: the request and its job commit with what
/// asked for them.
pub(crate) async fn request_consolidation_in(
    tx: &mut sqlx::PgConnection,
    workspace: &Workspace,
    throttle: Option<Duration>,
) -> Result<bool, StoreError> {
    let asked: Option<bool> = sqlx::query_scalar(REQUEST)
        .bind(workspace.tenant.as_str())
        .bind(workspace.agent.as_str())
        .bind(user_of(workspace)?)
        .bind(throttle.map(|t| t.as_secs_f64()))
        .bind(REQUEST_LOST_AFTER.as_secs_f64())
        .fetch_optional(&mut *tx)
        .await?;
    if asked.is_some() {
        let job = ConsolidateJob {
            tenant_id: workspace.tenant.clone(),
            agent_id: workspace.agent.clone(),
            user_id: workspace.user.clone().expect("checked above"),
        };
        push(tx, &[job]).await?;
    }
    Ok(asked.is_some())
}

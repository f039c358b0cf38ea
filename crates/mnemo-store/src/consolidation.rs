//! Consolidation's state per (agent, user): requests (throttled when extraction asks), the one
//! run at a time, the watermark, and applying a new MEMORY.md with the watermark in one
//! transaction.

use std::time::Duration;

use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};
use mnemo_core::{AgentId, TenantId, UserId, Workspace, WorkspacePath};

use crate::queue::{ConsolidateJob, push};
use crate::workspace::{Replacement, replace_core_file, user_of};
use crate::{Store, StoreError};

/// Who wrote MEMORY.md changes made by consolidation, in versions and audit rows.
const ACTOR: &str = "consolidation";

/// Asks for a run unless one was asked for within `$4` seconds (NULL: always).
const REQUEST: &str = "
INSERT INTO consolidation_state AS s (tenant_id, agent_id, user_id, last_requested_at) VALUES ($1, $2, $3, now())
ON CONFLICT (tenant_id, agent_id, user_id) DO UPDATE SET last_requested_at = now()
WHERE $4::float8 IS NULL OR s.last_requested_at IS NULL OR s.last_requested_at < now() - make_interval(secs => $4)
RETURNING true";

/// Every (agent, user) with daily notes, of a tenant in zone `$2`, whose schedule fired at `$1`
/// and was not acted on yet: marked, and returned to be queued. Cross-tenant: housekeeping finds
/// the work, each job carries its own tenant.
const SCHEDULE: &str = "
INSERT INTO consolidation_state AS s (tenant_id, agent_id, user_id, last_scheduled_at, last_requested_at)
SELECT DISTINCT tenant_id, agent_id, user_id, $1::timestamptz, now() FROM workspace_files
WHERE user_id <> '' AND deleted_at IS NULL AND starts_with(path, 'memory/')
  AND tenant_id IN (SELECT t FROM (SELECT DISTINCT tenant_id AS t FROM workspace_files) ts WHERE tenant_time_zone(t) = $2)
ON CONFLICT (tenant_id, agent_id, user_id) DO UPDATE SET last_scheduled_at = $1, last_requested_at = now()
WHERE s.last_scheduled_at IS NULL OR s.last_scheduled_at < $1
RETURNING tenant_id, agent_id, user_id";

/// Takes the run when nobody holds it (or its holder is presumed dead); answers the watermark.
const CLAIM: &str = "
INSERT INTO consolidation_state AS s (tenant_id, agent_id, user_id, running_since, running_by)
VALUES ($1, $2, $3, now(), $4)
ON CONFLICT (tenant_id, agent_id, user_id) DO UPDATE SET running_since = now(), running_by = $4
WHERE s.running_since IS NULL OR s.running_since < now() - make_interval(secs => $5)
RETURNING watermark";

/// The user's live daily notes changed after `$4`, of days from `$5` on, oldest first.
const CHANGED_NOTES: &str = "
SELECT path, content, updated_at FROM workspace_files
WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3 AND deleted_at IS NULL
  AND path ~ '^memory/[0-9]{4}-[0-9]{2}-[0-9]{2}[.]md$' AND path >= $5 AND updated_at > $4
ORDER BY path";

/// Ends the run held by `$7`: `$4` the new watermark (NULL keeps it; it never moves back), `$5`
/// the outcome, `$6` its label.
const FINISH: &str = "
UPDATE consolidation_state SET running_since = NULL, running_by = NULL, last_finished_at = now(),
    watermark = GREATEST(watermark, COALESCE($4, watermark)), last_outcome = $5, last_reason = $6
WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3 AND running_by = $7";

/// A daily note to consolidate.
#[derive(Debug, Clone, PartialEq)]
pub struct ChangedNote {
    pub day: NaiveDate,
    pub content: String,
    pub updated_at: DateTime<Utc>,
}

impl Store {
    /// Asks for a consolidation of the (agent, user) and queues its job, unless one was asked
    /// for within `throttle` (`None`: always). True when this call queued the job.
    pub async fn request_consolidation(
        &self,
        workspace: &Workspace,
        throttle: Option<Duration>,
    ) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        let asked: Option<bool> = sqlx::query_scalar(REQUEST)
            .bind(workspace.tenant.as_str())
            .bind(workspace.agent.as_str())
            .bind(user_of(workspace)?)
            .bind(throttle.map(|t| t.as_secs_f64()))
            .fetch_optional(&mut *tx)
            .await?;
        if asked.is_some() {
            let job = ConsolidateJob {
                tenant_id: workspace.tenant.clone(),
                agent_id: workspace.agent.clone(),
                user_id: workspace.user.clone().expect("checked above"),
            };
            push(&mut tx, &[job]).await?;
        }
        tx.commit().await?;
        Ok(asked.is_some())
    }

    /// Queues a consolidation for every (agent, user) with daily notes, of the tenants in `zone`,
    /// whose schedule fired at `local_fire` (wall-clock time in `zone`) and was not acted on yet;
    /// how many.
    pub async fn schedule_consolidations(&self, zone: &str, local_fire: NaiveDateTime) -> Result<u64, StoreError> {
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
        let due: Vec<(String, String, String)> =
            sqlx::query_as(SCHEDULE).bind(fire).bind(zone).fetch_all(&mut *tx).await?;
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

    /// Takes the (agent, user)'s consolidation run; its watermark, or `None` when it is held.
    pub async fn claim_consolidation(
        &self,
        workspace: &Workspace,
        worker: &str,
        stale: Duration,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        Ok(sqlx::query_scalar(CLAIM)
            .bind(workspace.tenant.as_str())
            .bind(workspace.agent.as_str())
            .bind(user_of(workspace)?)
            .bind(worker)
            .bind(stale.as_secs_f64())
            .fetch_optional(&self.pool)
            .await?)
    }

    /// The (agent, user)'s watermark: notes changed after it are not consolidated yet.
    pub async fn consolidation_watermark(&self, workspace: &Workspace) -> Result<DateTime<Utc>, StoreError> {
        let watermark: Option<DateTime<Utc>> = sqlx::query_scalar(
            "SELECT watermark FROM consolidation_state WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3",
        )
        .bind(workspace.tenant.as_str())
        .bind(workspace.agent.as_str())
        .bind(user_of(workspace)?)
        .fetch_optional(&self.pool)
        .await?;
        Ok(watermark.unwrap_or(DateTime::UNIX_EPOCH))
    }

    /// The daily notes changed after `watermark`, of days from `since` on, oldest first.
    pub async fn notes_changed_since(
        &self,
        workspace: &Workspace,
        watermark: DateTime<Utc>,
        since: NaiveDate,
    ) -> Result<Vec<ChangedNote>, StoreError> {
        let rows: Vec<(String, String, DateTime<Utc>)> = sqlx::query_as(CHANGED_NOTES)
            .bind(workspace.tenant.as_str())
            .bind(workspace.agent.as_str())
            .bind(user_of(workspace)?)
            .bind(watermark)
            .bind(WorkspacePath::daily_note(since).as_str())
            .fetch_all(&self.pool)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(path, content, updated_at)| {
                Some(ChangedNote { day: WorkspacePath::parse(&path).ok()?.note_day()?, content, updated_at })
            })
            .collect())
    }

    /// Ends the run: replaces MEMORY.md when `memory` is given and moves the watermark when
    /// given, in one transaction, recording the outcome and its reason.
    pub async fn finish_consolidation(
        &self,
        workspace: &Workspace,
        worker: &str,
        memory: Option<&Replacement>,
        watermark: Option<DateTime<Utc>>,
        outcome: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        if let Some(replacement) = memory {
            replace_core_file(&mut tx, workspace, "MEMORY.md", replacement, ACTOR).await?;
        }
        sqlx::query(FINISH)
            .bind(workspace.tenant.as_str())
            .bind(workspace.agent.as_str())
            .bind(user_of(workspace)?)
            .bind(watermark)
            .bind(outcome)
            .bind(reason)
            .bind(worker)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }
}

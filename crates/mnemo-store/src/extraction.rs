//! Extraction's state: the completed conversations waiting to be extracted, the one run per
//! (agent, user) and its cooldown, and applying an extraction in one transaction (the daily
//! note, the profile, the memory, the facts, the conversations marked done).

use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};
use mnemo_core::{NewMemory, SessionId, TriggerSource, Workspace, WorkspacePath, with_daily_entry};
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use crate::consolidation::request_consolidation_in;
use crate::memories::insert_in;
use crate::queue::{ExtractJob, push, push_after};
use crate::workspace::{
    NewState, Replacement, apply, current, key_in, lock, replace_core_file, share_user_files, user_of,
};
use crate::{MessageCursor, Store, StoreError};

/// Who wrote workspace changes made by extraction, in versions and audit rows.
const ACTOR: &str = "extraction";

/// A conversation's request, and what is done when it was asked for already (`$conflict`).
macro_rules! request {
    ($conflict:literal) => {
        concat!(
            "
INSERT INTO memory_extractions AS m (tenant_id, session_id, through_id, through_time, agent_id, user_id, trigger_source)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (tenant_id, session_id, through_id, agent_id, user_id) ",
            $conflict,
            "
RETURNING true"
        )
    };
}

/// Asks once per conversation end.
const REQUEST: &str = request!("DO NOTHING");

/// A manual request: asks, or asks again for a conversation whose extraction failed or found no
/// model (after the operator fixed the model), with its attempts anew. One that was extracted
/// stays done: its entries are written already. (A separate statement: `DO UPDATE … WHERE`
/// locks the row even when it changes nothing, which every retried completion would pay.)
const REQUEST_AGAIN: &str = request!(
    "DO UPDATE
SET status = 'pending', reason = NULL, attempts = 0, created_at = now(), finished_at = NULL,
    trigger_source = EXCLUDED.trigger_source
WHERE m.status IN ('failed', 'disabled')"
);

/// A piece of a long conversation, asked for while `$8` holds the (agent, user)'s run (the row
/// locked, so a takeover committing meanwhile is seen): one row when it is held.
const REQUEST_PIECE: &str = "
WITH held AS (
    SELECT 1 FROM extraction_runs WHERE tenant_id = $1 AND agent_id = $5 AND user_id = $6 AND running_by = $8
    FOR SHARE
), asked AS (
    INSERT INTO memory_extractions AS m (tenant_id, session_id, through_id, through_time, agent_id, user_id, trigger_source)
    SELECT $1, $2, $3, $4, $5, $6, $7 FROM held
    ON CONFLICT (tenant_id, session_id, through_id, agent_id, user_id) DO UPDATE
    SET status = 'pending', reason = NULL, attempts = 0, created_at = now(), finished_at = NULL
    WHERE m.status = 'disabled'
)
SELECT 1 FROM held";

/// The conversations of session `$2` whose extraction for (agent `$3`, user `$4`) failed for good
/// before the message (`$5`, `$6`): one condition for the operator's request and its dry run.
macro_rules! failed_before {
    () => {
        "
WHERE m.tenant_id = $1 AND m.session_id = $2 AND m.agent_id = $3 AND m.user_id = $4
  AND m.status = 'failed' AND (m.through_time, m.through_id) < ($5, $6)"
    };
}

const USER_IN_SESSION: &str = concat!("SELECT ", user_in_session!());

/// A manual request asks again for what failed in the session for the (agent `$3`, user `$4`)
/// before the request's last message (`$5`, `$6`): each conversation, or piece of a long one,
/// whose attempts were spent. Their messages were never shown (no later conversation reads
/// across one, see `LAST_READ`), so each reads its own again.
const ASK_AGAIN_FAILED: &str = concat!(
    "
UPDATE memory_extractions m
SET status = 'pending', reason = NULL, attempts = 0, created_at = now(), finished_at = NULL",
    failed_before!()
);

/// The session's conversations and pieces whose extraction failed for good before `($5, $6)`,
/// oldest first: those [`ASK_AGAIN_FAILED`] asks for again.
const FAILED_BEFORE: &str = concat!(
    "
SELECT session_id, through_id, through_time, trigger_source, 0 AS attempts, NULL::text AS last_failure
FROM memory_extractions m",
    failed_before!(),
    "
ORDER BY m.through_time, m.through_id"
);

/// Whether the (tenant `$1`, agent `$2`, user `$3`) has a conversation pending.
macro_rules! has_pending {
    () => {
        "EXISTS (SELECT 1 FROM memory_extractions
        WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3 AND status = 'pending')"
    };
}

/// Whether the (tenant `$1`, agent `$2`, user `$3`) has a conversation pending.
pub(crate) const HAS_PENDING: &str = concat!("SELECT ", has_pending!());

/// Takes the (agent, user)'s run when nobody holds it (or its holder is presumed dead), the
/// cooldown since the last one has passed and a conversation is pending (none is once the user
/// was erased: no run row may name them then).
const CLAIM: &str = concat!(
    "
INSERT INTO extraction_runs AS r (tenant_id, agent_id, user_id, running_since, running_by)
SELECT $1, $2, $3, now(), $4
WHERE ",
    has_pending!(),
    "
ON CONFLICT (tenant_id, agent_id, user_id) DO UPDATE SET running_since = now(), running_by = $4
WHERE (r.running_since IS NULL OR r.running_since < now() - make_interval(secs => $6))
  AND (r.last_finished_at IS NULL OR r.last_finished_at <= now() - make_interval(secs => $5))
RETURNING true"
);

/// How long until the run can be taken: the cooldown `$4` left; and while it is held, the least
/// of a whole cooldown (a holder that is alive starts one when it ends) and the time until the
/// run goes stale `$5` (one that died). Polling sooner would only find it held.
const WAIT: &str = "
SELECT GREATEST(
    COALESCE(EXTRACT(EPOCH FROM last_finished_at + make_interval(secs => $4) - now()), 0),
    CASE WHEN running_since IS NOT NULL
         THEN LEAST($4, EXTRACT(EPOCH FROM running_since + make_interval(secs => $5) - now()))
         ELSE 0 END
)::float8
FROM extraction_runs WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3";

const PENDING: &str = "
SELECT session_id, through_id, through_time, trigger_source, attempts, reason AS last_failure
FROM memory_extractions
WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3 AND status = 'pending'
ORDER BY through_time, through_id";

/// Ends the (agent, user)'s run held by `$5` (a run taken over as stale is not the old holder's
/// to end); `$4` starts its cooldown.
const RELEASE: &str = "
UPDATE extraction_runs SET running_since = NULL, running_by = NULL,
    last_finished_at = CASE WHEN $4 THEN now() ELSE last_finished_at END
WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3 AND running_by = $5";

/// Marks the (agent `$7`, user `$8`)'s conversations `$2`/`$3` (sessions, last messages) with
/// `$4` (a status) and `$5` (a reason); `$6` counts an attempt.
const MARK: &str = "
UPDATE memory_extractions m
SET status = $4, reason = $5, attempts = attempts + $6::int,
    attempted_at = CASE WHEN $6::int > 0 THEN now() ELSE attempted_at END,
    finished_at = CASE WHEN $4 = 'pending' THEN NULL ELSE now() END
FROM unnest($2::text[], $3::uuid[]) AS k(session_id, through_id)
WHERE m.tenant_id = $1 AND m.session_id = k.session_id AND m.through_id = k.through_id
  AND m.agent_id = $7 AND m.user_id = $8 AND m.status = 'pending'";

/// Records a failed model call on the (agent `$6`, user `$7`)'s conversations `$2`/`$3` with
/// reason `$4`: each one that has now had `$5` attempts is `failed`, the others stay `pending`;
/// but when the endpoint was down (`$8`), only one waiting for a day or more (a day-long outage
/// fails nothing sooner, and an input that always draws a 5xx does not hold its pair for ever).
/// Returns their statuses.
const MARK_FAILED: &str = "
UPDATE memory_extractions m
SET attempts = attempts + 1, reason = $4, attempted_at = now(),
    status = CASE WHEN attempts + 1 >= $5 AND (NOT $8 OR created_at < now() - interval '1 day')
                  THEN 'failed' ELSE 'pending' END,
    finished_at = CASE WHEN attempts + 1 >= $5 AND (NOT $8 OR created_at < now() - interval '1 day')
                       THEN now() END
FROM unnest($2::text[], $3::uuid[]) AS k(session_id, through_id)
WHERE m.tenant_id = $1 AND m.session_id = k.session_id AND m.through_id = k.through_id
  AND m.agent_id = $6 AND m.user_id = $7 AND m.status = 'pending'
RETURNING m.status";

/// A completed conversation waiting for extraction.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct PendingExtraction {
    #[sqlx(try_from = "String")]
    pub session_id: SessionId,
    pub through_id: Uuid,
    pub through_time: DateTime<Utc>,
    #[sqlx(try_from = "String")]
    pub trigger_source: TriggerSource,
    pub attempts: i32,
    /// The kind of the model failure its last attempt ended with ([`mnemo_core::ModelFailure`]).
    pub last_failure: Option<String>,
}

impl PendingExtraction {
    /// A conversation of `session` through `through`, not attempted yet.
    pub fn new(session: SessionId, through: MessageCursor, trigger_source: TriggerSource) -> Self {
        Self {
            session_id: session,
            through_id: through.id,
            through_time: through.event_time,
            trigger_source,
            attempts: 0,
            last_failure: None,
        }
    }

    pub fn through(&self) -> MessageCursor {
        MessageCursor { event_time: self.through_time, id: self.through_id }
    }
}

/// Whether an extraction may run now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Claim {
    Claimed,
    /// Another run holds the (agent, user), or its cooldown lasts this long yet: the job was
    /// queued again for then.
    Wait(Duration),
    /// Nothing is pending (the user erased since the job was queued, say): nothing to run.
    Nothing,
}

/// What an extraction changes, checked.
#[derive(Debug, Clone, Default)]
pub struct ExtractionChanges {
    pub day: Option<NaiveDate>,
    pub daily_entry: Option<String>,
    pub profile: Option<Replacement>,
    pub memory: Option<Replacement>,
    pub facts: Vec<NewMemory>,
    /// The model's short reason.
    pub reason: String,
    /// The largest a workspace file may be: an entry that would take today's note past it is
    /// not added (the rest applies), as an API write past it is refused.
    pub max_note_bytes: usize,
    /// When today's note changes, a consolidation is asked for in the same transaction, at most
    /// once per this period; `None`: none is (consolidation is off).
    pub consolidation_throttle: Option<Duration>,
}

fn keys(pending: &[PendingExtraction]) -> (Vec<String>, Vec<Uuid>) {
    pending.iter().map(|p| (p.session_id.to_string(), p.through_id)).unzip()
}

/// Where the (agent, user)'s last conversation of a session read before `($5, $6)` ended:
/// extracted, or failed for good (its messages are not read by the next one: a message the model
/// always fails on fails only its own conversation; an operator's request asks for it again).
const LAST_READ: &str = "
SELECT through_time, through_id FROM memory_extractions
WHERE tenant_id = $1 AND session_id = $2 AND agent_id = $3 AND user_id = $4 AND status IN ('done', 'failed')
  AND (through_time, through_id) < ($5, $6)
ORDER BY through_time DESC, through_id DESC
LIMIT 1";

/// Whether a conversation of the session was extracted for the (agent, user) at or past `($5, $6)`.
const EXTRACTED_PAST: &str = "
SELECT EXISTS (SELECT 1 FROM memory_extractions
               WHERE tenant_id = $1 AND session_id = $2 AND agent_id = $3 AND user_id = $4 AND status = 'done'
                 AND (through_time, through_id) >= ($5, $6))";

/// The (agent, user)s with a conversation waiting for longer than `$1` seconds and no extract
/// job that will run: at most `$2`.
/// The live jobs' (tenant, agent, user) are read once, as text, so that the anti-join is one
/// hash join: a containment test per pair read every live job's payload again for each pending
/// row (docs/benchmarks.md, "Stranded extractions").
const STRANDED: &str = "
WITH live AS MATERIALIZED (
    SELECT DISTINCT args ->> 'tenant_id' AS tenant_id, args ->> 'agent_id' AS agent_id, args ->> 'user_id' AS user_id
    FROM (SELECT convert_from(job, 'UTF8')::jsonb AS args FROM apalis.jobs
          WHERE job_type = $3
            AND (status IN ('Pending', 'Queued', 'Running') OR (status = 'Failed' AND attempts < max_attempts))) j
)
SELECT DISTINCT e.tenant_id, e.agent_id, e.user_id FROM memory_extractions e
WHERE e.status = 'pending' AND e.created_at < now() - make_interval(secs => $1)
  AND NOT EXISTS (
      SELECT 1 FROM live
      WHERE live.tenant_id = e.tenant_id AND live.agent_id = e.agent_id AND live.user_id = e.user_id)
LIMIT $2";

/// Binds `$1`–`$6` of the statements over one session's conversations for a workspace: the
/// tenant, the session, the agent, the user, and a message (its time, then its id).
macro_rules! bind_conversations {
    ($query:expr, $workspace:expr, $session:expr, $message:expr) => {
        $query
            .bind($workspace.tenant.as_str())
            .bind($session.as_str())
            .bind($workspace.agent.as_str())
            .bind(user_of($workspace)?)
            .bind($message.event_time)
            .bind($message.id)
    };
}

impl Store {
    /// Queues an extract job for each (agent, user) whose conversations have waited longer than
    /// `grace` with no job that will run: a job given up, or a crash between a run and the job
    /// it queues for what it left. At most `limit`; how many.
    pub async fn requeue_unextracted(&self, grace: Duration, limit: i64) -> Result<u64, StoreError> {
        let stranded: Vec<(String, String, String)> = sqlx::query_as(STRANDED)
            .bind(grace.as_secs_f64())
            .bind(limit)
            .bind(mnemo_core::Queue::Extract.as_str())
            .fetch_all(&self.pool)
            .await?;
        let jobs = stranded
            .iter()
            .map(|(tenant, agent, user)| {
                Ok(ExtractJob {
                    tenant_id: mnemo_core::TenantId::parse(tenant)?,
                    agent_id: mnemo_core::AgentId::parse(agent)?,
                    user_id: mnemo_core::UserId::parse(user)?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        // Each under its user's files, while still pending: an erasure since leaves nothing.
        let mut queued = 0;
        for job in &jobs {
            queued += u64::from(self.retry_after(job, Duration::ZERO).await?);
        }
        Ok(queued)
    }

    /// Asks for the extraction of a completed conversation (once per session and last message;
    /// by hand, again after it failed) and queues the (agent, user)'s job. True when this call
    /// asked.
    pub async fn request_extraction(
        &self,
        workspace: &Workspace,
        session: &SessionId,
        through: MessageCursor,
        source: TriggerSource,
    ) -> Result<bool, StoreError> {
        let mut conn = self.tenant_connection([workspace.tenant.as_str()]).await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let asked = request_extraction_in(&mut tx, workspace, session, through, source).await?;
        tx.commit().await?;
        Ok(asked)
    }

    /// An operator's request (the runbook's, never a client's: a message the model always fails
    /// on would be retried for as long as a client kept asking): asks for the conversation through
    /// `through` as [`Self::request_extraction`] does by hand, and again for every conversation
    /// and piece of the session before it that failed for good, each for its own messages (no
    /// later conversation read them). True when anything was asked.
    pub async fn request_extraction_again(
        &self,
        workspace: &Workspace,
        session: &SessionId,
        through: MessageCursor,
    ) -> Result<bool, StoreError> {
        let user = user_of(workspace)?;
        let mut conn = self.tenant_connection([workspace.tenant.as_str()]).await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        // Under the user's files, shared, and only while the user is in the session: an erasure
        // committing meanwhile leaves no request and no job naming them.
        share_user_files(&mut tx, workspace.tenant.as_str(), user).await?;
        let there: bool = sqlx::query_scalar(USER_IN_SESSION)
            .bind(workspace.tenant.as_str())
            .bind(session.as_str())
            .bind(user)
            .fetch_one(&mut *tx)
            .await?;
        if !there {
            return Ok(false);
        }
        let failed = bind_conversations!(sqlx::query(ASK_AGAIN_FAILED), workspace, session, through)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        let asked = request_extraction_in(&mut tx, workspace, session, through, TriggerSource::Manual).await?;
        if failed > 0 && !asked {
            push(&mut tx, &[extract_job(workspace)?]).await?;
        }
        tx.commit().await?;
        Ok(asked || failed > 0)
    }

    /// Where the workspace's last conversation of `session` read before `before` ended: the
    /// messages through it were shown to the model already (a compaction's extraction, or an
    /// earlier completion of the session), or failed for good and wait for an operator.
    pub async fn last_read(
        &self,
        workspace: &Workspace,
        session: &SessionId,
        before: MessageCursor,
    ) -> Result<Option<MessageCursor>, StoreError> {
        let row: Option<(DateTime<Utc>, Uuid)> =
            bind_conversations!(sqlx::query_as(LAST_READ), workspace, session, before)
                .fetch_optional(&self.pool)
                .await?;
        Ok(row.map(|(event_time, id)| MessageCursor { event_time, id }))
    }

    /// Asks for the first piece of a conversation too long for one transcript, as a conversation
    /// of its own through `through`, with the conversation's trigger (no job: the run that cuts
    /// it extracts it), while `worker` holds the (agent, user)'s run: pending after this, asked
    /// now or before, or asked again after a run without a model marked it `disabled`.
    /// [`StoreError::RunLost`] when the run was taken over.
    pub async fn request_extraction_piece(
        &self,
        workspace: &Workspace,
        worker: &str,
        session: &SessionId,
        through: MessageCursor,
        source: TriggerSource,
    ) -> Result<(), StoreError> {
        let (tenant, user) = (workspace.tenant.as_str(), user_of(workspace)?);
        // Under the user's files, shared: an erasure committing meanwhile is seen, as by the claim.
        let mut tx = self.pool.begin().await?;
        share_user_files(&mut tx, tenant, user).await?;
        // The piece's end is past where the run's reading starts (`LAST_READ`), so no row there
        // was extracted or failed: one that exists is pending, or disabled and asked again.
        let held: Option<i32> = sqlx::query_scalar(REQUEST_PIECE)
            .bind(tenant)
            .bind(session.as_str())
            .bind(through.id)
            .bind(through.event_time)
            .bind(workspace.agent.as_str())
            .bind(user)
            .bind(source.as_str())
            .bind(worker)
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        held.map(drop).ok_or(StoreError::RunLost)
    }

    /// Whether a conversation of `session` was extracted for the workspace's user through
    /// `through` or past it.
    pub async fn extracted_through(
        &self,
        workspace: &Workspace,
        session: &SessionId,
        through: MessageCursor,
    ) -> Result<bool, StoreError> {
        extracted_through(&mut *self.pool.acquire().await?, workspace, session, through).await
    }

    /// The session's conversations and pieces whose extraction for the workspace's user failed
    /// for good before `through`, oldest first, as [`Store::request_extraction_again`] would ask
    /// for them again (not attempted yet).
    pub async fn failed_extractions(
        &self,
        workspace: &Workspace,
        session: &SessionId,
        through: MessageCursor,
    ) -> Result<Vec<PendingExtraction>, StoreError> {
        Ok(bind_conversations!(sqlx::query_as(FAILED_BEFORE), workspace, session, through)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Takes `job`'s (agent, user)'s extraction run. When it is held or cooling, `job` is queued
    /// again for when it may be taken, in the claim's transaction, under the user's files: an
    /// erasure either commits first (then nothing is pending, and nothing is queued) or waits,
    /// and its clean-up of the queue finds the retry.
    pub async fn claim_extraction(
        &self,
        job: &ExtractJob,
        worker: &str,
        cooldown: Duration,
        stale: Duration,
    ) -> Result<Claim, StoreError> {
        let (tenant, agent, user) = (job.tenant_id.as_str(), job.agent_id.as_str(), job.user_id.as_str());
        // Under the user's files, shared: an erasure committing meanwhile is seen by the claim.
        let mut tx = self.pool.begin().await?;
        share_user_files(&mut tx, tenant, user).await?;
        let claimed: Option<bool> = sqlx::query_scalar(CLAIM)
            .bind(tenant)
            .bind(agent)
            .bind(user)
            .bind(worker)
            .bind(cooldown.as_secs_f64())
            .bind(stale.as_secs_f64())
            .fetch_optional(&mut *tx)
            .await?;
        let claim = if claimed.is_some() {
            Claim::Claimed
        } else if !sqlx::query_scalar::<_, bool>(HAS_PENDING)
            .bind(tenant)
            .bind(agent)
            .bind(user)
            .fetch_one(&mut *tx)
            .await?
        {
            Claim::Nothing
        } else {
            let wait: Option<f64> = sqlx::query_scalar(WAIT)
                .bind(tenant)
                .bind(agent)
                .bind(user)
                .bind(cooldown.as_secs_f64())
                .bind(stale.as_secs_f64())
                .fetch_optional(&mut *tx)
                .await?;
            let wait = Duration::from_secs_f64(wait.unwrap_or(1.0).clamp(0.5, 3600.0));
            push_after(&mut tx, job, wait, 0).await?;
            Claim::Wait(wait)
        };
        tx.commit().await?;
        Ok(claim)
    }

    /// The (agent, user)'s conversations waiting for extraction, oldest first.
    pub async fn pending_extractions(&self, workspace: &Workspace) -> Result<Vec<PendingExtraction>, StoreError> {
        Ok(sqlx::query_as(PENDING)
            .bind(workspace.tenant.as_str())
            .bind(workspace.agent.as_str())
            .bind(user_of(workspace)?)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Ends a run that changed nothing: the conversations get `status` (`pending` again when the
    /// run was given up, `disabled` without a model, `done` when the model saw nothing worth
    /// keeping) and `reason`; a `done` or `disabled` run starts the cooldown.
    pub async fn finish_extraction(
        &self,
        workspace: &Workspace,
        worker: &str,
        pending: &[PendingExtraction],
        status: &str,
        reason: &str,
        attempt: bool,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        mark(&mut tx, workspace, pending, status, reason, attempt).await?;
        release(&mut tx, workspace, worker, status == "done" || status == "disabled").await?;
        tx.commit().await?;
        Ok(())
    }

    /// Ends a run whose model call failed (`reason`; `endpoint_down` when the endpoint's state
    /// caused it): each conversation counts the attempt, and is `failed` once it has had
    /// `max_attempts` (its own: one that joined the run late keeps its attempts), and, when the
    /// endpoint was down, has waited a day. The cooldown starts, so the (agent, user)'s other jobs wait it out rather
    /// than spend their conversations' attempts on a model that is down. Returns how many stay
    /// `pending`.
    pub async fn fail_extraction(
        &self,
        workspace: &Workspace,
        worker: &str,
        pending: &[PendingExtraction],
        reason: &str,
        endpoint_down: bool,
        max_attempts: i32,
    ) -> Result<usize, StoreError> {
        let mut tx = self.pool.begin().await?;
        let (sessions, throughs) = keys(pending);
        let statuses: Vec<String> = sqlx::query_scalar(MARK_FAILED)
            .bind(workspace.tenant.as_str())
            .bind(&sessions)
            .bind(&throughs)
            .bind(reason)
            .bind(max_attempts)
            .bind(workspace.agent.as_str())
            .bind(user_of(workspace)?)
            .bind(endpoint_down)
            .fetch_all(&mut *tx)
            .await?;
        release(&mut tx, workspace, worker, true).await?;
        tx.commit().await?;
        Ok(statuses.iter().filter(|s| *s == "pending").count())
    }

    /// Applies an extraction in one transaction: today's note gets the entry (unless the note is
    /// full: the conversations' reason is then `daily_note_full`), PROFILE.md and MEMORY.md are
    /// replaced when given (unless changed since the model read them: `file_changed`), the facts are written as `POST /v1/facts` writes them (embedded, then
    /// judged), the conversations are done and the cooldown starts, and a consolidation is asked
    /// for when today's note changed. True when today's note changed.
    pub async fn apply_extraction(
        &self,
        workspace: &Workspace,
        worker: &str,
        pending: &[PendingExtraction],
        changes: &ExtractionChanges,
    ) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        let mut reason = changes.reason.as_str();
        let mut note_changed = false;
        if let (Some(day), Some(entry)) = (changes.day, &changes.daily_entry) {
            let key = key_in(workspace, WorkspacePath::daily_note(day))?;
            lock(&mut tx, &key).await?;
            let now = current(&mut tx, &key).await?;
            let existing = now.as_ref().filter(|c| !c.deleted).map(|c| c.file.content.as_str());
            let content = with_daily_entry(existing, day, entry);
            if content.len() > changes.max_note_bytes {
                tracing::warn!(tenant = %workspace.tenant, "today's note is full: the extraction's entry was not added");
                reason = "daily_note_full";
            } else {
                let state = NewState {
                    content: &content,
                    enabled: now.as_ref().is_some_and(|c| c.file.enabled),
                    sort_order: now.as_ref().map_or(crate::DEFAULT_SORT_ORDER, |c| c.file.sort_order),
                    deleted: false,
                };
                let version = now.as_ref().map_or(1, |c| c.file.version + 1);
                let change = if existing.is_some() { "appended" } else { "created" };
                apply(&mut tx, &key, &state, version, change, ACTOR).await?;
                note_changed = true;
            }
        }
        for (name, replacement) in [("PROFILE.md", &changes.profile), ("MEMORY.md", &changes.memory)] {
            if let Some(replacement) = replacement
                && !replace_core_file(&mut tx, workspace, name, replacement, ACTOR).await?
            {
                // Changed during the model call: the edit stays; the next extraction sees it.
                reason = "file_changed";
            }
        }
        let facts: Vec<&NewMemory> = changes.facts.iter().collect();
        for result in insert_in(&mut tx, &facts).await? {
            match result {
                // A fact the user already has is as good; one the user deleted stays deleted.
                Some(Ok(_)) | Some(Err(StoreError::SourceRefDeleted { .. })) => {}
                Some(Err(e)) => return Err(e),
                // Its key belonged to a transaction that rolled back: the job runs again.
                None => return Err(StoreError::Database(sqlx::Error::RowNotFound)),
            }
        }
        if let Some(throttle) = changes.consolidation_throttle.filter(|_| note_changed) {
            request_consolidation_in(&mut tx, workspace, Some(throttle)).await?;
        }
        mark(&mut tx, workspace, pending, "done", reason, true).await?;
        release(&mut tx, workspace, worker, true).await?;
        tx.commit().await?;
        Ok(note_changed)
    }
}

async fn extracted_through(
    conn: &mut sqlx::PgConnection,
    workspace: &Workspace,
    session: &SessionId,
    through: MessageCursor,
) -> Result<bool, StoreError> {
    Ok(bind_conversations!(sqlx::query_scalar(EXTRACTED_PAST), workspace, session, through).fetch_one(conn).await?)
}

/// [`Store::request_extraction`] in the caller's transaction.
pub(crate) async fn request_extraction_in(
    tx: &mut sqlx::PgConnection,
    workspace: &Workspace,
    session: &SessionId,
    through: MessageCursor,
    source: TriggerSource,
) -> Result<bool, StoreError> {
    let user = user_of(workspace)?;
    // A compaction recorded after a later conversation of the session was extracted (its model
    // call outlasted that extraction) asks for nothing: the later one read its newest messages,
    // and reading them again would write its daily entry twice.
    if source == TriggerSource::Compaction && extracted_through(tx, workspace, session, through).await? {
        return Ok(false);
    }
    let statement = if source == TriggerSource::Manual { REQUEST_AGAIN } else { REQUEST };
    let asked: Option<bool> = sqlx::query_scalar(statement)
        .bind(workspace.tenant.as_str())
        .bind(session.as_str())
        .bind(through.id)
        .bind(through.event_time)
        .bind(workspace.agent.as_str())
        .bind(user)
        .bind(source.as_str())
        .fetch_optional(&mut *tx)
        .await?;
    if asked.is_some() {
        push(&mut *tx, &[extract_job(workspace)?]).await?;
    }
    Ok(asked.is_some())
}

/// The (agent, user)'s extract job.
fn extract_job(workspace: &Workspace) -> Result<ExtractJob, StoreError> {
    let user = workspace.user.clone().ok_or(StoreError::Stored(mnemo_core::InvalidInput::Empty { field: "user" }))?;
    Ok(ExtractJob { tenant_id: workspace.tenant.clone(), agent_id: workspace.agent.clone(), user_id: user })
}

async fn mark(
    tx: &mut Transaction<'_, Postgres>,
    workspace: &Workspace,
    pending: &[PendingExtraction],
    status: &str,
    reason: &str,
    attempt: bool,
) -> Result<(), StoreError> {
    let (sessions, throughs) = keys(pending);
    sqlx::query(MARK)
        .bind(workspace.tenant.as_str())
        .bind(&sessions)
        .bind(&throughs)
        .bind(status)
        .bind(reason)
        .bind(i32::from(attempt))
        .bind(workspace.agent.as_str())
        .bind(user_of(workspace)?)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Ends this worker's run in `tx`; [`StoreError::RunLost`] when another worker took it over,
/// so that the caller's transaction, and all it changed, is rolled back.
async fn release(
    tx: &mut Transaction<'_, Postgres>,
    workspace: &Workspace,
    worker: &str,
    cooldown: bool,
) -> Result<(), StoreError> {
    let released = sqlx::query(RELEASE)
        .bind(workspace.tenant.as_str())
        .bind(workspace.agent.as_str())
        .bind(user_of(workspace)?)
        .bind(cooldown)
        .bind(worker)
        .execute(&mut **tx)
        .await?;
    if released.rows_affected() == 0 {
        return Err(StoreError::RunLost);
    }
    Ok(())
}

/// The memory jobs' state of one (agent, user), for operators.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct MemoryStatus {
    pub agent_id: String,
    pub user_id: String,
    pub pending: i64,
    pub failed: i64,
    pub last_extraction: Option<DateTime<Utc>>,
    pub extraction_running_since: Option<DateTime<Utc>>,
    pub consolidation_watermark: Option<DateTime<Utc>>,
    pub last_consolidation: Option<DateTime<Utc>>,
    pub last_consolidation_outcome: Option<String>,
    pub last_consolidation_reason: Option<String>,
    /// Consolidation runs that failed in a row: an extraction asks for the next one twice as
    /// seldom after each.
    pub consolidation_failures: i32,
}

/// Every (agent, user) of the tenant with extraction or consolidation state.
const MEMORY_STATUS: &str = "
WITH requests AS (
    SELECT agent_id, user_id, count(*) FILTER (WHERE status = 'pending') AS pending,
           count(*) FILTER (WHERE status = 'failed') AS failed
    FROM memory_extractions WHERE tenant_id = $1 GROUP BY agent_id, user_id
), pairs AS (
    SELECT agent_id, user_id FROM requests
    UNION SELECT agent_id, user_id FROM extraction_runs WHERE tenant_id = $1
    UNION SELECT agent_id, user_id FROM consolidation_state WHERE tenant_id = $1
)
SELECT p.agent_id, p.user_id, COALESCE(q.pending, 0) AS pending, COALESCE(q.failed, 0) AS failed,
       r.last_finished_at AS last_extraction, r.running_since AS extraction_running_since,
       c.watermark AS consolidation_watermark, c.last_finished_at AS last_consolidation,
       c.last_outcome AS last_consolidation_outcome, c.last_reason AS last_consolidation_reason,
       COALESCE(c.failures, 0) AS consolidation_failures
FROM pairs p
LEFT JOIN requests q ON q.agent_id = p.agent_id AND q.user_id = p.user_id
LEFT JOIN extraction_runs r ON r.tenant_id = $1 AND r.agent_id = p.agent_id AND r.user_id = p.user_id
LEFT JOIN consolidation_state c ON c.tenant_id = $1 AND c.agent_id = p.agent_id AND c.user_id = p.user_id
ORDER BY p.agent_id, p.user_id";

impl Store {
    /// Extraction and consolidation state per (agent, user) of the tenant.
    pub async fn memory_status(&self, tenant: &mnemo_core::TenantId) -> Result<Vec<MemoryStatus>, StoreError> {
        Ok(sqlx::query_as(MEMORY_STATUS).bind(tenant.as_str()).fetch_all(&self.pool).await?)
    }
}

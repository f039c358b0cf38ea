//! Retention sweeps and user erasure, shared by the worker's `retention` queue and the runbook.
//!
//! A sweep reads the tenant's policy, counts what is due, and checks the safety floor before it
//! changes anything: a sweep that would anonymize more than the floor allows is refused (an
//! audit row, a metric, nothing else) unless an operator allowed at least that many rows, which
//! is audited too. It then anonymizes in batches of the policy's size, one transaction each, so
//! a sweep killed at any point leaves every row untouched or fully anonymized and the next sweep
//! finishes the rest. A dry run (by policy, environment or flag) only counts and lists.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use mnemo_config::RetentionSettings;
use mnemo_core::{AnonymizeReason, AuditEvent, RetentionPolicy, SafetyFloor, TenantId, UserId};
use mnemo_store::queue::RetentionJob;
use mnemo_store::{ErasurePlan, FileCursor, Store, StoreError, SweepPlan};
use serde_json::json;
use uuid::Uuid;

/// How many row ids a dry run lists.
pub const DRY_RUN_IDS: i64 = 1000;

/// How one sweep runs, beyond the tenant's policy.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    pub defaults: RetentionPolicy,
    pub floor: SafetyFloor,
    /// A dry run whatever the policy says.
    pub dry_run: bool,
    /// An operator's permission to anonymize up to this many rows past the floor.
    pub allow_large: Option<u64>,
    /// Who runs it, for the audit rows: `worker` or `runbook`.
    pub actor: String,
    /// Stop after the batch that ends past this time (the rest is left for a later sweep).
    pub deadline: Option<Instant>,
    /// A dry run lists the rows it would anonymize (at most [`DRY_RUN_IDS`]).
    pub list_ids: bool,
}

impl SweepOptions {
    pub fn new(settings: &RetentionSettings, actor: &str) -> Self {
        Self {
            defaults: settings.defaults,
            floor: settings.floor,
            dry_run: false,
            allow_large: None,
            actor: actor.to_owned(),
            deadline: None,
            list_ids: false,
        }
    }
}

/// How a sweep ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepOutcome {
    /// Everything due was anonymized.
    Done,
    /// Stopped at the deadline with rows still due.
    Unfinished,
    /// A dry run: nothing changed.
    DryRun,
    /// The safety floor refused it: nothing changed.
    Refused,
}

impl SweepOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Done => "done",
            Self::Unfinished => "unfinished",
            Self::DryRun => "dry_run",
            Self::Refused => "refused",
        }
    }
}

/// What a sweep found and did.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepReport {
    pub tenant: TenantId,
    pub policy: RetentionPolicy,
    /// Policy values that were ignored.
    pub warnings: Vec<String>,
    pub plan: SweepPlan,
    pub outcome: SweepOutcome,
    /// The floor would refuse this sweep without the operator's permission (which it had, or
    /// the sweep was refused or only a dry run).
    pub over_floor: bool,
    pub anonymized: BTreeMap<&'static str, u64>,
    /// Workspace file versions whose text was redacted.
    pub redacted_versions: u64,
    /// A dry run's rows (at most [`DRY_RUN_IDS`]), by id, when asked for.
    pub ids: Vec<(Uuid, AnonymizeReason)>,
    pub elapsed: Duration,
}

impl SweepReport {
    pub fn anonymized_total(&self) -> u64 {
        self.anonymized.values().sum()
    }
}

/// Sweeps one tenant now. `progress` is called after each batch of rows and each file's
/// versions with (done, due), rows and versions together.
pub async fn sweep_tenant(
    store: &Store,
    tenant: &TenantId,
    options: &SweepOptions,
    mut progress: impl FnMut(u64, u64),
) -> Result<SweepReport, StoreError> {
    let started = Instant::now();
    let (policy, warnings) = store.retention_policy(tenant, options.defaults).await?;
    for warning in &warnings {
        tracing::warn!("{warning}");
    }
    let plan = store.sweep_plan(tenant, &policy).await?;
    let due = plan.due();
    let over_floor = plan.over(&options.floor);
    let allowed = options.allow_large.is_some_and(|n| n >= plan.to_allow());
    let dry_run = options.dry_run || policy.dry_run;
    let mut report = SweepReport {
        tenant: tenant.clone(),
        policy,
        warnings,
        plan,
        outcome: SweepOutcome::DryRun,
        over_floor,
        anonymized: BTreeMap::new(),
        redacted_versions: 0,
        ids: Vec::new(),
        elapsed: Duration::ZERO,
    };
    let floor = json!({
        "due": due,
        "soft_deleted": plan.soft_deleted,
        "superseded": plan.superseded,
        "tenant_rows": plan.tenant_rows,
        "workspace_versions_due": plan.workspace_versions,
        "tenant_versions": plan.tenant_versions,
        "max_fraction": options.floor.max_fraction,
        "floor_rows": options.floor.floor_rows,
        "allowed": options.allow_large,
    });
    if dry_run {
        if options.list_ids {
            report.ids = store.due_rows(tenant, plan.cutoffs, DRY_RUN_IDS).await?;
        }
    } else if over_floor && !allowed {
        store.audit(tenant, AuditEvent::AnonymizeRefused, "safety_floor", &options.actor, floor).await?;
        metrics::counter!("mnemo_anonymize_refused_total").increment(1);
        tracing::warn!(
            tenant = %tenant,
            due,
            tenant_rows = plan.tenant_rows,
            workspace_versions_due = plan.workspace_versions,
            tenant_versions = plan.tenant_versions,
            "retention sweep refused by the safety floor; nothing changed (an operator can allow it: mnemo-runbook anonymize --allow-large-sweep)"
        );
        report.outcome = SweepOutcome::Refused;
    } else {
        if over_floor {
            store.audit(tenant, AuditEvent::AnonymizeAllowed, "operator", &options.actor, floor).await?;
        }
        report.outcome = SweepOutcome::Done;
        // At most as many as the plan counted (and the operator's N, when given), the number the
        // floor checked: rows that turn due only now (an import committed after the plan) leave
        // as many for the next sweep, whose plan the floor checks.
        let bounded = |planned: u64| options.allow_large.map_or(planned, |n| n.min(planned));
        let (row_cap, version_cap) = (bounded(due), bounded(report.plan.workspace_versions));
        let total = row_cap + version_cap;
        let (mut done, mut after) = (0, Uuid::nil());
        loop {
            let limit = u64::from(policy.batch_size).min(row_cap - done);
            if limit == 0 {
                break;
            }
            let batch = store.anonymize_due(tenant, plan.cutoffs, after, limit as i64, &options.actor).await?;
            let Some(last) = batch.iter().map(|(id, _)| *id).max() else { break };
            after = last;
            for (_, reason) in &batch {
                *report.anonymized.entry(reason.as_str()).or_default() += 1;
                metrics::counter!("mnemo_anonymized_rows_total", "reason" => reason.as_str()).increment(1);
            }
            done += batch.len() as u64;
            progress(done, total);
            if options.deadline.is_some_and(|d| Instant::now() >= d) {
                report.outcome = SweepOutcome::Unfinished;
                break;
            }
        }
        // Then the workspace files' replaced and deleted texts, one file per transaction, oldest
        // versions first, within their own cap.
        let (cutoff, mut after) = (report.plan.cutoffs.deleted_before, FileCursor::default());
        while report.outcome == SweepOutcome::Done && report.redacted_versions < version_cap {
            let left = version_cap - report.redacted_versions;
            let Some((file, n)) = store.redact_due_versions(tenant, cutoff, &after, left, &options.actor).await? else {
                break;
            };
            after = file;
            report.redacted_versions += n;
            metrics::counter!("mnemo_redacted_workspace_versions_total").increment(n);
            progress(done + report.redacted_versions, total);
            if options.deadline.is_some_and(|d| Instant::now() >= d) {
                report.outcome = SweepOutcome::Unfinished;
            }
        }
    }
    report.elapsed = started.elapsed();
    metrics::counter!("mnemo_retention_sweeps_total", "outcome" => report.outcome.as_str()).increment(1);
    tracing::info!(
        tenant = %tenant,
        outcome = report.outcome.as_str(),
        due,
        anonymized = report.anonymized_total(),
        redacted_versions = report.redacted_versions,
        seconds = report.elapsed.as_secs_f64(),
        "retention sweep"
    );
    Ok(report)
}

/// What erasing a user found and did.
#[derive(Debug, Clone, PartialEq)]
pub struct ErasureReport {
    /// What carried the user before the erasure (rows per kind, payloads, vectors).
    pub plan: ErasurePlan,
    pub dry_run: bool,
    /// Rows anonymized per kind.
    pub anonymized: BTreeMap<String, u64>,
    pub elapsed: Duration,
}

/// Soft-deletes and anonymizes every row carrying `user` in `tenant` now, whatever the TTLs,
/// with an audit row for each, and a `memory.erase.begun` row before and a `memory.erase` row
/// after them naming the user only by a hash.
pub async fn erase_user(
    store: &Store,
    tenant: &TenantId,
    user: &UserId,
    batch_size: u32,
    dry_run: bool,
    actor: &str,
    mut progress: impl FnMut(u64, u64),
) -> Result<ErasureReport, StoreError> {
    let started = Instant::now();
    let plan = store.erasure_plan(tenant, user).await?;
    let mut report = ErasureReport { plan, dry_run, anonymized: BTreeMap::new(), elapsed: Duration::ZERO };
    if dry_run {
        return Ok(report);
    }
    // Recorded before anything changes: a crash after the last row and before the `memory.erase`
    // row leaves nothing carrying the user, and a re-run needs this to know it has work to finish.
    let user_sha256 = user.sha256();
    store.audit(tenant, AuditEvent::EraseBegun, "erasure", actor, json!({ "user_sha256": user_sha256 })).await?;
    let total = report.plan.rows();
    let mut done = 0;
    // The summaries of the user's sessions before and after their rows: the sessions are read
    // while the rows still name them, and a compaction under way may record one meanwhile.
    let sessions = store.user_sessions(tenant, user).await?;
    done = erase_summaries(store, tenant, &sessions, actor, &mut report, done).await?;
    // Files, then rows, until a files pass after a row pass finds none: a file written
    // meanwhile (an extraction that read the user's messages before the row pass took them)
    // made recall rows that the next row pass erases.
    let mut workspace_files = store.erase_user_workspace(tenant, user).await?;
    loop {
        done = erase_rows(store, tenant, user, batch_size, actor, &mut report, done, total, &mut progress).await?;
        let files = store.erase_user_workspace(tenant, user).await?;
        if files == 0 {
            break;
        }
        workspace_files += files;
    }
    // With a session the user first wrote in meanwhile: its rows no longer name them, but a
    // compaction that recorded them as a writer still does, until `forget_summary_writer`.
    let mut sessions = sessions;
    sessions.extend(store.user_sessions(tenant, user).await?);
    sessions.sort_unstable();
    sessions.dedup();
    done = erase_summaries(store, tenant, &sessions, actor, &mut report, done).await?;
    store.forget_summary_writer(tenant, &user_sha256).await?;
    let details = json!({
        "user_sha256": user_sha256,
        "rows": report.anonymized,
        "workspace_files": workspace_files,
        "tool_outputs": report.plan.tool_outputs,
        "embeddings": report.plan.embeddings,
    });
    store.audit(tenant, AuditEvent::Erase, "erasure", actor, details).await?;
    report.elapsed = started.elapsed();
    tracing::info!(tenant = %tenant, rows = done, seconds = report.elapsed.as_secs_f64(), "user erased");
    Ok(report)
}

/// Erases the summaries of `sessions` (see [`Store::erase_session_summaries`]); returns `done`
/// plus those erased.
async fn erase_summaries(
    store: &Store,
    tenant: &TenantId,
    sessions: &[String],
    actor: &str,
    report: &mut ErasureReport,
    done: u64,
) -> Result<u64, StoreError> {
    let summaries = store.erase_session_summaries(tenant, sessions, actor).await?;
    Ok(tally(report, &summaries, done))
}

/// Counts rows an erasure anonymized, by kind and in the metrics; returns `done` plus them.
fn tally(report: &mut ErasureReport, erased: &[(Uuid, String)], done: u64) -> u64 {
    for (_, kind) in erased {
        *report.anonymized.entry(kind.clone()).or_default() += 1;
    }
    metrics::counter!("mnemo_anonymized_rows_total", "reason" => AnonymizeReason::Erasure.as_str())
        .increment(erased.len() as u64);
    done + erased.len() as u64
}

/// Erases the rows carrying `user`, a page of ids at a time, then checks again from the start:
/// rows written while the erasure runs, or held by another transaction, are erased too. It
/// stops only when none is left. Returns `done` plus the rows erased.
#[allow(clippy::too_many_arguments)]
async fn erase_rows(
    store: &Store,
    tenant: &TenantId,
    user: &UserId,
    batch_size: u32,
    actor: &str,
    report: &mut ErasureReport,
    mut done: u64,
    total: u64,
    progress: &mut impl FnMut(u64, u64),
) -> Result<u64, StoreError> {
    let mut after = Uuid::nil();
    loop {
        let (batch, last) = store.erase_user_rows(tenant, user, after, i64::from(batch_size.max(1)), actor).await?;
        let Some(last) = last else {
            if after.is_nil() {
                return Ok(done);
            }
            after = Uuid::nil();
            continue;
        };
        after = last;
        done = tally(report, &batch, done);
        progress(done, total.max(done));
    }
}

/// The worker's side of the `retention` queue: sweeps the job's tenant unless its sweep for
/// that tick finished already, stopping before the job's time limit and queueing a follow-up
/// job for the rest.
#[derive(Debug, Clone)]
pub struct RetentionRunner {
    pub store: Store,
    pub settings: RetentionSettings,
    pub worker: String,
    /// The job's time limit; a sweep stops at four fifths of it.
    pub job_timeout: Duration,
}

impl RetentionRunner {
    pub async fn run(&self, job: &RetentionJob) -> Result<(), StoreError> {
        if !self.store.start_retention_sweep(job, &self.worker).await? {
            return Ok(());
        }
        let mut options = SweepOptions::new(&self.settings, "worker");
        options.deadline = Some(Instant::now() + self.job_timeout.mul_f64(0.8));
        let report = sweep_tenant(&self.store, &job.tenant_id, &options, |_, _| {}).await?;
        let anonymized = report.anonymized_total();
        if report.outcome == SweepOutcome::Unfinished {
            self.store.record_retention_sweep(job, anonymized, None).await?;
            self.store.continue_retention_sweep(job).await?;
        } else {
            self.store.record_retention_sweep(job, anonymized, Some(report.outcome.as_str())).await?;
        }
        Ok(())
    }
}

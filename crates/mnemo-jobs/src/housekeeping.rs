//! Housekeeping fires once per tick across every worker of a deployment: each worker tries to
//! claim the tick's row in `housekeeping_ticks`, and the one that inserts it does the work.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chrono::Utc;
use mnemo_config::{MaintenanceSettings, SignalSettings};
use mnemo_core::{CronSchedule, SignalWeights};
use mnemo_store::{Housekeeping, Maintained, Store};

use crate::JobError;

/// What housekeeping needs to know.
#[derive(Debug, Clone)]
pub struct HousekeepingPolicy {
    pub interval: Duration,
    pub model: String,
    pub embed_grace: Duration,
    pub judge_grace: Duration,
    pub job_retention: Duration,
    pub dead_worker_after: Duration,
    /// How often each tenant's retired rows are swept.
    pub retention_interval: Duration,
    /// When every (agent, user) with daily notes is consolidated; `None` never.
    pub consolidate_cron: Option<CronSchedule>,
    /// Days of notes a consolidation reads (`MNEMO_CONSOLIDATE_DAY_RANGE`): a pair whose notes
    /// are all older is not queued.
    pub consolidate_day_range: u32,
    /// Archiving old daily notes and pruning old session messages.
    pub maintenance: MaintenanceSettings,
    /// The decay half-life and floor, and the promotion threshold.
    pub signals: SignalSettings,
}

/// How long a conversation waits for extraction with no job that will run before housekeeping
/// queues one: a request and its job are written together, so only a job given up or a crash
/// leaves one waiting.
const EXTRACTION_GRACE: Duration = Duration::from_secs(600);

/// The current tick number: wall-clock time in whole intervals, the same on every machine.
fn tick_number(interval: Duration) -> i64 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    i64::try_from(now.as_millis() / interval.as_millis().max(1)).unwrap_or(i64::MAX)
}

/// Runs one tick's housekeeping if this worker wins the tick; `None` if another did.
pub async fn run_housekeeping(
    store: &Store,
    worker: &str,
    policy: &HousekeepingPolicy,
) -> Result<Option<Housekeeping>, JobError> {
    let tick = tick_number(policy.interval);
    if !store.claim_housekeeping_tick(tick, worker).await? {
        return Ok(None);
    }
    // Each step runs even when an earlier one failed: one step failing at every tick (a bad row,
    // a missing grant) must not starve the others.
    let mut steps = Steps::default();
    let done = Housekeeping {
        requeued: steps
            .run("requeue_unembedded", store.requeue_unembedded(&policy.model, policy.embed_grace, 10_000).await)
            + steps.run("requeue_unjudged", store.requeue_unjudged(policy.judge_grace, 10_000).await)
            + steps.run("requeue_unextracted", store.requeue_unextracted(EXTRACTION_GRACE, 1_000).await)
            + steps.run("rejudge_passing_failures", store.rejudge_passing_failures(1_000).await),
        pruned_jobs: steps.run("prune_finished_jobs", store.prune_finished_jobs(policy.job_retention).await),
        removed_workers: steps.run("remove_stale_workers", store.remove_stale_workers(policy.dead_worker_after).await),
        retention_scheduled: steps
            .run("schedule_retention", store.schedule_retention(tick_number(policy.retention_interval)).await),
        consolidations_scheduled: steps.run("schedule_consolidations", schedule_consolidations(store, policy).await),
    };
    steps.run("finish_housekeeping_tick", store.finish_housekeeping_tick(tick, done).await);
    steps.run("maintenance", maintain(store, worker, policy).await);
    if done != Housekeeping::default() {
        tracing::info!(
            tick,
            requeued = done.requeued,
            pruned_jobs = done.pruned_jobs,
            removed_workers = done.removed_workers,
            retention_scheduled = done.retention_scheduled,
            consolidations_scheduled = done.consolidations_scheduled,
            "housekeeping"
        );
    }
    metrics::counter!("mnemo_housekeeping_runs_total").increment(1);
    metrics::counter!("mnemo_housekeeping_requeued_total").increment(done.requeued);
    steps.finish()?;
    Ok(Some(done))
}

/// The steps of one housekeeping or maintenance round: a failing step counts as nothing done,
/// is logged, and the round goes on; the first failure is the round's result.
#[derive(Default)]
struct Steps {
    first_failure: Option<JobError>,
}

impl Steps {
    fn run<T: Default, E: Into<JobError>>(&mut self, step: &'static str, result: Result<T, E>) -> T {
        result.unwrap_or_else(|e| {
            let e = e.into();
            tracing::warn!(step, error = %e, "housekeeping step failed; the others go on");
            self.first_failure.get_or_insert(e);
            T::default()
        })
    }

    fn finish(self) -> Result<(), JobError> {
        self.first_failure.map_or(Ok(()), Err)
    }
}

/// Queues the consolidations whose schedule fired: in each tenant's own time zone. A zone whose
/// scheduling fails is logged and the zones after it are still scheduled; the first failure is
/// the step's.
async fn schedule_consolidations(store: &Store, policy: &HousekeepingPolicy) -> Result<u64, JobError> {
    let Some(cron) = &policy.consolidate_cron else { return Ok(0) };
    let mut zones = Steps::default();
    let mut scheduled = 0;
    for (zone, now) in store.zone_clocks().await? {
        if let Some(fire) = cron.last_fire(now) {
            scheduled += zones.run(
                "schedule_consolidations",
                store.schedule_consolidations(&zone, fire, policy.consolidate_day_range).await,
            );
        }
    }
    zones.finish()?;
    Ok(scheduled)
}

/// How long a maintenance run may stay unfinished before another worker takes it over: far
/// longer than its bounded batches take, far shorter than the interval (6 h by default) that a
/// run cut off by a kill or a deploy would otherwise wait.
const MAINTENANCE_STALE: Duration = Duration::from_secs(30 * 60);

/// Archives old daily notes and prunes old session messages, once per maintenance interval
/// across all workers, a bounded batch of each per run (the next run goes on).
async fn maintain(store: &Store, worker: &str, policy: &HousekeepingPolicy) -> Result<(), JobError> {
    let settings = &policy.maintenance;
    let tick = tick_number(settings.interval);
    if !store.claim_maintenance(tick, worker, MAINTENANCE_STALE).await? {
        return Ok(());
    }
    let done = match maintenance_run(store, settings, &policy.signals).await {
        Ok(done) => done,
        Err(e) => {
            // Each step is bounded and may run again: the next housekeeping tick does, rather
            // than the next maintenance interval hours later.
            if let Err(release) = store.release_maintenance(tick, worker).await {
                tracing::warn!(tick, error = %release, "cannot give the failed maintenance run's claim back");
            }
            return Err(e);
        }
    };
    if !store.finish_maintenance(tick, worker, done).await? {
        tracing::warn!(tick, "maintenance ran past its claim, which another worker took over");
        return Ok(());
    }
    tracing::info!(
        tick,
        archived = done.archived,
        pruned = done.pruned,
        promoted = done.promoted,
        faded = done.faded,
        forgotten = done.forgotten,
        "maintenance"
    );
    Ok(())
}

/// One maintenance run's steps.
async fn maintenance_run(
    store: &Store,
    settings: &MaintenanceSettings,
    signals: &SignalSettings,
) -> Result<Maintained, JobError> {
    let mut steps = Steps::default();
    let mut done = Maintained::default();
    if settings.note_retention_days > 0 {
        let before = Utc::now().date_naive() - chrono::Days::new(u64::from(settings.note_retention_days));
        done.archived =
            steps.run("archive_daily_notes", store.archive_daily_notes(before, 1000, settings.max_file_bytes).await);
    }
    if settings.session_retention_days > 0 {
        done.pruned =
            steps.run("prune_old_sessions", store.prune_old_sessions(settings.session_retention_days, 10_000).await);
    }
    done.promoted =
        steps.run("promote_episodic", store.promote_episodic(signals.promotion_min_confidence, 10_000).await);
    if signals.decay_floor > 0.0 {
        let before = fade_before(&signals.weights, signals.decay_floor);
        done.faded = steps.run("fade_episodic", store.fade_episodic(before, 10_000).await);
    }
    if signals.decay_delete_floor > 0.0 {
        let before = fade_before(&signals.weights, signals.decay_delete_floor);
        // Out of packs for as long as its decay takes from one floor to the other, however late
        // it was faded (the first run after the floors were set, an old import), so a recall in
        // between can still bring it back.
        let faded_before = Utc::now() - (fade_before(&signals.weights, signals.decay_floor) - before);
        done.forgotten = steps.run("forget_decayed", store.forget_decayed(before, faded_before, 10_000).await);
    }
    steps.run("prune_access_batches", store.prune_access_batches().await);
    steps.finish()?;
    Ok(done)
}

/// The last use before which an episodic memory's decay is below `floor`: ½^(age / half-life)
/// < floor exactly when age > half-life · log2(1 / floor).
fn fade_before(signals: &SignalWeights, floor: f64) -> chrono::DateTime<Utc> {
    let days = signals.half_life_days * (1.0 / floor).log2();
    // At most about 3,000 years back: PostgreSQL's timestamps end at 4713 BC, and a cut-off
    // before them failed every maintenance run.
    Utc::now() - chrono::Duration::milliseconds((days * 86_400_000.0).min(1e14) as i64)
}

/// Tries every interval until `stop` resolves.
pub(crate) async fn housekeeping_loop(store: Store, worker: String, policy: HousekeepingPolicy) {
    let mut timer = tokio::time::interval(policy.interval);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        timer.tick().await;
        if let Err(e) = run_housekeeping(&store, &worker, &policy).await {
            tracing::warn!(error = %e, "housekeeping failed; trying again next tick");
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::Datelike;

    /// However long the half-life and small the floor (both valid settings), the cut-off is a
    /// time PostgreSQL can hold (from 4713 BC), so the fading statement runs.
    #[test]
    fn the_fade_cut_off_stays_within_postgresql_s_timestamps() {
        let weights = mnemo_core::SignalWeights { half_life_days: 36_500.0, ..mnemo_core::SignalWeights::OFF };
        assert!(super::fade_before(&weights, 1e-30).year() > -4713);
        let usual = mnemo_core::SignalWeights { half_life_days: 30.0, ..mnemo_core::SignalWeights::OFF };
        let cut_off = super::fade_before(&usual, 0.5);
        let days = (chrono::Utc::now() - cut_off).num_days();
        assert_eq!(days, 30, "a floor of one half is one half-life");
    }
}

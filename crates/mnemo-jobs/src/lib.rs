//! mnemo's background work on apalis-postgres: the worker pool ([`run_worker`]), batched
//! embedding ([`EmbedDispatcher`]), the contradiction judge ([`JudgeDispatcher`]), retention
//! sweeps and user erasure ([`sweep_tenant`], [`erase_user`]), and once-per-tick housekeeping. Every job is idempotent:
//! running it twice leaves the state running it once leaves.

use std::sync::Arc;
use std::time::Duration;

mod batcher;
mod compact;
mod consolidate;
mod embed;
mod extract;
mod housekeeping;
mod judge;
mod retention;
mod worker;

pub use compact::{CompactPlan, CompactPolicy, CompactReport, Compactor, SUMMARY_RETRIES};
pub use consolidate::{ConsolidateReport, ConsolidateRunner, MAX_NOTES_CHARS};
pub use embed::{EmbedDispatcher, EmbedPolicy};
pub use extract::{ExtractReport, ExtractRunner, MAX_CONVERSATIONS_PER_RUN, Proposal, Shown, TODAY_NOTE_CHARS};
pub use housekeeping::{HousekeepingPolicy, run_housekeeping};
pub use judge::{BatchReport, JudgeDispatcher, JudgePolicy, judge_batch, judge_pending};
pub use retention::{
    DRY_RUN_IDS, ErasureReport, RetentionRunner, SweepOptions, SweepOutcome, SweepReport, erase_user, sweep_tenant,
};
pub use worker::{Models, run_worker, worker_name};

/// Why a job or the worker failed. Cloneable because a batch's one failure answers every job
/// of the batch; the store's error is shared, not flattened, so its cause chain stays.
#[derive(Debug, Clone, thiserror::Error)]
pub enum JobError {
    #[error("storage failed")]
    Store(#[source] Arc<mnemo_store::StoreError>),
    #[error("the worker is shutting down")]
    ShuttingDown,
    #[error("the job ran past its timeout of {0:?}")]
    TimedOut(Duration),
    /// `alone`: the job was the batch's only one, so it is the one that panics.
    #[error("the job's batch panicked")]
    Panicked { alone: bool },
    #[error("{0}")]
    Setup(String),
}

impl From<mnemo_store::StoreError> for JobError {
    fn from(e: mnemo_store::StoreError) -> Self {
        Self::Store(Arc::new(e))
    }
}

/// Spawns its future when dropped, unless disarmed: what a run must undo when its job is cut off
/// at the timeout (a future dropped midway runs none of its code after the await it was at).
pub(crate) struct UndoIfDropped<F: Future<Output = ()> + Send + 'static>(Option<F>);

impl<F: Future<Output = ()> + Send + 'static> UndoIfDropped<F> {
    pub(crate) fn new(undo: F) -> Self {
        Self(Some(undo))
    }

    pub(crate) fn disarm(mut self) {
        self.0 = None;
    }
}

impl<F: Future<Output = ()> + Send + 'static> Drop for UndoIfDropped<F> {
    fn drop(&mut self) {
        if let Some(undo) = self.0.take() {
            tokio::spawn(undo);
        }
    }
}

/// What a handler means the worker to do with its job next. Failures a job records itself
/// (an embed error on its row, a judge fail-open) are `Done`: the job did its work.
#[derive(Debug)]
pub enum Next {
    /// Finished; nothing to run again.
    Done,
    /// Run the same job again after the delay, as a new delayed job (apalis itself would retry
    /// at once and ignores a retry delay).
    RetryAfter(Duration, JobError),
    /// It can never succeed: the job is killed (apalis keeps it as `Killed`, not retried).
    GiveUp(JobError),
}

impl Next {
    /// The next step after a handler's result: a store failure is transient (the database may be
    /// back in a moment), a worker shutting down leaves the job to orphan recovery, and a set-up
    /// error never heals by itself. A job whose statement the database refuses for what it says
    /// is given up once it has failed [`REFUSED_ATTEMPTS`] times in a row: retried forever, it
    /// would come back every five minutes.
    pub fn after(result: Result<(), JobError>, attempt: usize) -> Self {
        match result {
            Ok(()) => Self::Done,
            Err(JobError::Store(e)) if e.is_permanent() && attempt >= REFUSED_ATTEMPTS => {
                Self::GiveUp(JobError::Store(e))
            }
            // A batch that panics every time with this job in it (an embed job's rows are
            // submitted together, so they are one batch's) is this job's bug as much as alone.
            Err(e @ JobError::Panicked { alone: false }) if attempt >= REFUSED_ATTEMPTS => Self::GiveUp(e),
            Err(
                e @ (JobError::Store(_)
                | JobError::ShuttingDown
                | JobError::TimedOut(_)
                | JobError::Panicked { alone: false }),
            ) => Self::RetryAfter(backoff(i32::try_from(attempt).unwrap_or(i32::MAX)), e),
            // A panic is a bug: a job that panicked alone would only panic again. Its batch-mates
            // run again (in smaller batches as they retry at different times).
            Err(e @ (JobError::Setup(_) | JobError::Panicked { alone: true })) => Self::GiveUp(e),
        }
    }
}

/// How many times a job is run whose statement the database refuses for what it says, or whose
/// batch panics.
pub const REFUSED_ATTEMPTS: usize = 5;

/// Exponential backoff with full jitter: attempt 1 waits 0.5–1.5 s, doubling each attempt, at
/// most five minutes. Jitter spreads the retries of a batch that failed together.
pub fn backoff(attempt: i32) -> Duration {
    nominal_backoff(attempt).mul_f64(0.5 + rand::random::<f64>())
}

fn nominal_backoff(attempt: i32) -> Duration {
    let base = Duration::from_secs(1).saturating_mul(1u32 << attempt.clamp(1, 20).saturating_sub(1));
    base.min(Duration::from_secs(300))
}

/// The least time the backoffs before attempt `max_attempts` add up to (each at its shortest).
/// A row failing for less is not given up, however many attempts it has made: an endpoint that
/// answers now and then brings retries forward, and would otherwise use them up in minutes.
pub fn shortest_schedule(max_attempts: i32) -> Duration {
    (1..max_attempts).map(|attempt| nominal_backoff(attempt).mul_f64(0.5)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_statement_the_database_refuses_is_given_up_after_its_attempts() {
        let refused =
            || JobError::from(mnemo_store::StoreError::Stored(mnemo_core::InvalidInput::Empty { field: "content" }));
        for attempt in 1..REFUSED_ATTEMPTS {
            assert!(matches!(Next::after(Err(refused()), attempt), Next::RetryAfter(..)), "attempt {attempt}");
        }
        assert!(matches!(Next::after(Err(refused()), REFUSED_ATTEMPTS), Next::GiveUp(_)));
    }

    #[test]
    fn a_row_is_kept_for_as_long_as_its_backoffs_take_at_their_shortest() {
        assert_eq!(shortest_schedule(1), Duration::ZERO);
        assert_eq!(shortest_schedule(4), Duration::from_secs_f64(3.5));
        // The default 16: 1 + 2 + … + 256 s, then six times 300 s, halved.
        assert_eq!(shortest_schedule(16), Duration::from_secs_f64(1155.5));
    }

    #[test]
    fn backoff_grows_with_jitter_and_a_cap() {
        for attempt in 1..=12 {
            let nominal = Duration::from_secs(1u64 << (attempt - 1)).min(Duration::from_secs(300));
            let d = backoff(attempt);
            assert!(d >= nominal.mul_f64(0.5) && d <= nominal.mul_f64(1.5), "attempt {attempt}: {d:?}");
        }
        assert!(backoff(40) <= Duration::from_secs(450));
    }

    #[test]
    fn a_store_failure_keeps_its_cause_and_is_retried_later() {
        let e = JobError::from(mnemo_store::StoreError::ShuttingDown);
        let source = std::error::Error::source(&e).expect("the store error is the source");
        assert_eq!(source.to_string(), "the store is shutting down");
        match Next::after(Err(e), 3) {
            Next::RetryAfter(delay, _) => assert!(delay >= Duration::from_secs(2) && delay <= Duration::from_secs(6)),
            other => panic!("a store failure is transient: {other:?}"),
        }
        assert!(matches!(Next::after(Err(JobError::ShuttingDown), 1), Next::RetryAfter(..)));
        let unavailable = || JobError::from(mnemo_store::StoreError::Unavailable("connection refused".into()));
        assert!(matches!(Next::after(Err(unavailable()), 1000), Next::RetryAfter(..)), "an outage never gives up");
        assert!(matches!(Next::after(Err(JobError::Setup("no model".into())), 1), Next::GiveUp(_)));
        assert!(matches!(Next::after(Ok(()), 1), Next::Done));
    }
}

//! mnemo's background work on apalis-postgres: the worker pool ([`run_worker`]), batched
//! embedding ([`EmbedDispatcher`]), the contradiction judge ([`JudgeDispatcher`]), retention
//! sweeps and user erasure ([`sweep_tenant`], [`erase_user`]), and once-per-tick housekeeping. Every job is idempotent:
//! running it twice leaves the state running it once leaves.

use std::time::Duration;

mod batcher;
mod embed;
mod housekeeping;
mod judge;
mod retention;
mod worker;

pub use embed::{EmbedDispatcher, EmbedPolicy};
pub use housekeeping::{HousekeepingPolicy, run_housekeeping};
pub use judge::{BatchReport, JudgeDispatcher, JudgePolicy, judge_batch, judge_pending};
pub use retention::{
    DRY_RUN_IDS, ErasureReport, RetentionRunner, SweepOptions, SweepOutcome, SweepReport, erase_user, sweep_tenant,
};
pub use worker::{run_worker, worker_name};

#[derive(Debug, Clone, thiserror::Error)]
pub enum JobError {
    #[error("storage failed: {0}")]
    Store(String),
    #[error("the worker is shutting down")]
    ShuttingDown,
    #[error("{0}")]
    Setup(String),
}

impl From<mnemo_store::StoreError> for JobError {
    fn from(e: mnemo_store::StoreError) -> Self {
        Self::Store(e.to_string())
    }
}

/// Exponential backoff with full jitter: attempt 1 waits 0.5–1.5 s, doubling each attempt, at
/// most five minutes. Jitter spreads the retries of a batch that failed together.
pub fn backoff(attempt: i32) -> Duration {
    let base = Duration::from_secs(1).saturating_mul(1u32 << attempt.clamp(1, 20).saturating_sub(1));
    let capped = base.min(Duration::from_secs(300));
    capped.mul_f64(0.5 + rand::random::<f64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_with_jitter_and_a_cap() {
        for attempt in 1..=12 {
            let nominal = Duration::from_secs(1u64 << (attempt - 1)).min(Duration::from_secs(300));
            let d = backoff(attempt);
            assert!(d >= nominal.mul_f64(0.5) && d <= nominal.mul_f64(1.5), "attempt {attempt}: {d:?}");
        }
        assert!(backoff(40) <= Duration::from_secs(450));
    }
}

//! The contradiction judge. Each apalis judge job hands its fact to the [`JudgeDispatcher`];
//! the dispatcher gathers up to `batch_size` pending facts and judges them side by side:
//! - a fact with a key retires the older live facts of its bucket with the same key, without a
//!   model call;
//! - otherwise its candidates (older, live, close facts of its bucket) with its very words (case
//!   and punctuation aside) are retired as copies without a model call, and the others go to
//!   the model, which says SUPERSEDE, DUPLICATE or KEEP for each; with no model configured the
//!   outcome is `disabled` (or `superseded`, when copies were retired);
//! - any model failure retires nothing: the outcome is `fail_open`, with an audit row and a
//!   metric.
//!
//! Every judged fact gets `judge_at` and an outcome, so nothing is judged twice; a job whose fact
//! is no longer pending changes nothing. A fact is judged only once the older facts of its bucket
//! have vectors: facts written close together can be embedded out of order, and an older fact
//! embedded late would otherwise never be compared with it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mnemo_core::{Judge, JudgeOutcome, Verdict, fingerprint};
use mnemo_store::queue::JudgeJob;
use mnemo_store::{BatchRecord, Candidate, Judgement, PendingFact, Retire, Store, StoreError};
use tracing::Instrument;
use uuid::Uuid;

use crate::JobError;
use crate::batcher::{Batcher, Gather};

/// How the judge finds candidates and batches its work.
#[derive(Debug, Clone, Copy)]
pub struct JudgePolicy {
    pub batch_size: usize,
    pub max_wait: Duration,
    pub topk: usize,
    pub threshold: f64,
}

/// A handle to the batching loop. Cheap to clone.
#[derive(Debug, Clone)]
pub struct JudgeDispatcher {
    batcher: Batcher<JudgeJob>,
}

impl JudgeDispatcher {
    /// One batching loop: a batch is the rows in flight at once, as the seed's batch size means.
    pub fn start(store: Store, judge: Option<Arc<dyn Judge>>, policy: JudgePolicy, worker: String) -> Self {
        let batcher = Batcher::start(
            "judge batch",
            1,
            policy.batch_size,
            Gather::Wait(policy.max_wait),
            move |jobs: Vec<JudgeJob>, _| {
                let (store, judge, worker) = (store.clone(), judge.clone(), worker.clone());
                async move {
                    judge_batch(&store, judge, policy, &worker, &jobs).await.map(|_| ()).map_err(|e| {
                    tracing::warn!(error = %e, jobs = jobs.len(), "judge batch could not be stored; its jobs will run again");
                    JobError::from(e)
                })
                }
            },
        );
        Self { batcher }
    }

    /// Judges one job's fact with whichever others are waiting. `Err` means the database could
    /// not be reached and the job should run again.
    pub async fn submit(&self, job: JudgeJob) -> Result<(), JobError> {
        self.batcher.submit(job).await
    }
}

/// What a batch did: the outcome recorded for each fact judged, the batch's time, and its
/// slowest model call (the batch's calls run side by side).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchReport {
    pub outcomes: Vec<JudgeOutcome>,
    pub wall: Duration,
    pub model_max: Duration,
}

/// Judges the still-pending facts behind `jobs`, side by side, and records the batch.
pub async fn judge_batch(
    store: &Store,
    judge: Option<Arc<dyn Judge>>,
    policy: JudgePolicy,
    worker: &str,
    jobs: &[JudgeJob],
) -> Result<BatchReport, StoreError> {
    let started = Instant::now();
    let facts = store.pending_facts(jobs).await?;
    let mut running = tokio::task::JoinSet::new();
    for fact in facts {
        running.spawn(judge_fact(store.clone(), judge.clone(), policy, fact).in_current_span());
    }
    let mut report = BatchReport::default();
    let (mut model_calls, mut model_sum, mut model_max) = (0, Duration::ZERO, Duration::ZERO);
    let mut failure = None;
    while let Some(done) = running.join_next().await {
        // A panicking judgement panics the batch, as it would have without the task: the
        // batcher fails its jobs.
        let done = done.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        match done {
            Ok((outcome, model_time)) => {
                if let Some(t) = model_time {
                    model_calls += 1;
                    model_sum += t;
                    model_max = model_max.max(t);
                }
                report.outcomes.extend(outcome);
            }
            // The others still finish; the jobs run again and skip what is done.
            Err(e) => failure = Some(e),
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    report.wall = started.elapsed();
    report.model_max = model_max;
    if !report.outcomes.is_empty() {
        metrics::histogram!("mnemo_judge_batch_rows").record(report.outcomes.len() as f64);
        store
            .record_judge_batch(&BatchRecord {
                worker: worker.to_owned(),
                batch_size: policy.batch_size,
                rows: report.outcomes.len(),
                model_calls,
                wall: report.wall,
                model_sum,
                model_max,
            })
            .await?;
    }
    Ok(report)
}

/// Judges every pending fact, a batch at a time, until none is left; what each batch did. For
/// tests, benchmarks and draining a backlog by hand; workers judge through their queue.
pub async fn judge_pending(
    store: &Store,
    judge: Option<Arc<dyn Judge>>,
    policy: JudgePolicy,
    worker: &str,
) -> Result<Vec<BatchReport>, StoreError> {
    let mut reports = Vec::new();
    loop {
        let jobs = store.oldest_pending_facts(i64::try_from(policy.batch_size).unwrap_or(i64::MAX)).await?;
        if jobs.is_empty() {
            return Ok(reports);
        }
        let report = judge_batch(store, judge.clone(), policy, worker, &jobs).await?;
        if report.outcomes.is_empty() {
            // What is left waits for vectors, or another judge holds it: leave it.
            return Ok(reports);
        }
        reports.push(report);
    }
}

/// How long a judgement waits for an older fact of its bucket to be embedded: a second, then a
/// tenth of the time the fact has waited so far, at most a minute, so a long embedding outage
/// does not queue every pending fact's job again each second.
fn defer_delay(fact: Uuid, now: std::time::SystemTime) -> Duration {
    let written = fact
        .get_timestamp()
        .map(|t| {
            let (secs, nanos) = t.to_unix();
            std::time::UNIX_EPOCH + Duration::new(secs, nanos)
        })
        .unwrap_or(now);
    let waited = now.duration_since(written).unwrap_or_default();
    (waited / 10).clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// Decides and applies one fact's judgement; the outcome recorded (none if the fact stopped
/// being pending meanwhile, or waits for an older fact's vector) and how long the model took,
/// if it was asked.
async fn judge_fact(
    store: Store,
    judge: Option<Arc<dyn Judge>>,
    policy: JudgePolicy,
    fact: PendingFact,
) -> Result<(Option<JudgeOutcome>, Option<Duration>), StoreError> {
    let mut model_time = None;
    if store.older_facts_unembedded(&fact).await? {
        store.defer_judgement(&fact, defer_delay(fact.id, std::time::SystemTime::now())).await?;
        metrics::counter!("mnemo_judge_deferred_total").increment(1);
        return Ok((None, None));
    }
    let judgement = if fact.fact_key.is_some() {
        // The facts of its key are read, and retired, under the bucket's lock.
        judgement(JudgeOutcome::NoCandidates, Vec::new(), "key_match", None, 0)
    } else {
        let candidates = store.judge_candidates(&fact, policy.threshold, policy.topk).await?;
        let total = candidates.len();
        // A candidate with the fact's own words (case and punctuation aside) is a copy, retired
        // without a model, so copies never pile up even where no judge model is configured.
        let words = fingerprint(&fact.content);
        let (copies, others): (Vec<Candidate>, Vec<Candidate>) =
            candidates.into_iter().partition(|c| fingerprint(&c.content) == words);
        let mut retire: Vec<(Uuid, Retire)> = copies.iter().map(|c| (c.id, Retire::SameWords)).collect();
        let without_model =
            |retire: Vec<(Uuid, Retire)>, none: JudgeOutcome| judgement(none, retire, none.as_str(), None, total);
        match &judge {
            None => without_model(retire, JudgeOutcome::Disabled),
            Some(_) if others.is_empty() => without_model(retire, JudgeOutcome::NoCandidates),
            Some(judge) => {
                let texts: Vec<String> = others.iter().map(|c| c.content.clone()).collect();
                let started = Instant::now();
                let answer = judge
                    .judge(&fact.content, &texts)
                    .instrument(mnemo_config::model_span("chat", judge.model(), texts.len()))
                    .await;
                let took = started.elapsed();
                model_time = Some(took);
                metrics::histogram!("mnemo_judge_model_seconds").record(took.as_secs_f64());
                let model = Some(judge.model().to_owned());
                match answer {
                    Ok(verdicts) if verdicts.len() == others.len() => {
                        retire.extend(others.iter().zip(&verdicts).filter_map(|(c, v)| match v {
                            Verdict::Supersede => Some((c.id, Retire::Model)),
                            Verdict::Duplicate => Some((c.id, Retire::Duplicate)),
                            Verdict::Keep => None,
                        }));
                        judgement(JudgeOutcome::Kept, retire, "model", model, total)
                    }
                    // A failing model retires nothing, the copies included.
                    Ok(verdicts) => {
                        let detail = format!("{} verdicts for {}", verdicts.len(), others.len());
                        tracing::debug!(item = %fact.id, detail, "judge failure detail");
                        judgement(JudgeOutcome::FailOpen, Vec::new(), "wrong_count", model, total)
                    }
                    // One that may pass (the endpoint down or slow) is asked again later.
                    Err(e) => {
                        tracing::debug!(item = %fact.id, detail = e.detail, "judge failure detail");
                        Judgement {
                            failure_may_pass: e.may_pass(),
                            ..judgement(JudgeOutcome::FailOpen, Vec::new(), e.kind, model, total)
                        }
                    }
                }
            }
        }
    };
    let applied = store.apply_judgement(&fact, &judgement).await?;
    if let Some(outcome) = applied {
        metrics::counter!("mnemo_judge_rows_total", "outcome" => outcome.as_str()).increment(1);
    }
    // Once recorded: a fact judged meanwhile, or a batch retried after a database error, would
    // otherwise count one failure the database does not hold, or one twice.
    if applied == Some(JudgeOutcome::FailOpen) {
        fail_open(&fact, judgement.reason);
    }
    Ok((applied, model_time))
}

fn judgement(
    unless_retired: JudgeOutcome,
    retire: Vec<(Uuid, Retire)>,
    reason: &'static str,
    model: Option<String>,
    candidates: usize,
) -> Judgement {
    Judgement { unless_retired, retire, reason, model, candidates, failure_may_pass: false }
}

/// A judge failure recorded: counted and logged by kind and ids (its detail, which could echo a
/// prompt, went to debug where it happened).
fn fail_open(fact: &PendingFact, kind: &'static str) {
    metrics::counter!("mnemo_judge_fail_open_total", "reason" => kind).increment(1);
    tracing::warn!(item = %fact.id, tenant = %fact.tenant_id, reason = kind, "judge failed; nothing retired (fail-open)");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deferral_grows_with_the_time_the_fact_has_waited() {
        // A whole second: a UUIDv7 holds its time in milliseconds.
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_secs();
        let written = std::time::UNIX_EPOCH + Duration::from_secs(secs);
        let fact = Uuid::new_v7(uuid::Timestamp::from_unix(uuid::NoContext, secs, 0));
        let after = |wait: u64| defer_delay(fact, written + Duration::from_secs(wait));
        assert_eq!(after(0), Duration::from_secs(1), "a fresh fact waits a second");
        assert_eq!(after(100), Duration::from_secs(10));
        assert_eq!(after(3600), Duration::from_secs(60), "at most a minute");
    }
}

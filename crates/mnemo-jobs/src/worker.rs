//! The worker pool: one apalis worker per served queue (woken by LISTEN/NOTIFY, with an interval
//! poll for delayed jobs), housekeeping, queue gauges, and `/metrics` on the worker's own
//! address. Stops on the shutdown signal after in-flight jobs finish (or, past the grace period,
//! leaves them to be re-queued as orphans).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use apalis::layers::WorkerBuilderExt;
use apalis::layers::tracing::TraceLayer;
use apalis::prelude::{
    AbortError, Attempt, BackendExt, BoxDynError, Data, MetadataStore, Monitor, ParallelizeExt, Task, WorkerBuilder,
};
use apalis_postgres::{Config, PostgresStorage};
use mnemo_config::WorkerSettings;
use mnemo_core::{Consolidator, Embedder, Extractor, Judge, Queue, Summarizer, TokenCounter};
use mnemo_store::queue::{
    AccessJob, CompactJob, ConsolidateJob, EmbedJob, ExtractJob, JobArgs, JudgeJob, RetentionJob, TRACEPARENT,
    failures_before,
};
use mnemo_store::{MIGRATOR, Store};
use tracing::{Instrument, Span};

use crate::housekeeping::{HousekeepingPolicy, housekeeping_loop};
use crate::{
    CompactPolicy, Compactor, ConsolidateRunner, EmbedDispatcher, EmbedPolicy, ExtractRunner, JobError,
    JudgeDispatcher, JudgePolicy, Next, RetentionRunner,
};

/// How long a failed queue worker waits before it starts again. A failure restarts at once; one
/// within `RESTART_STREAK` of the failure before (of any queue's worker: when the database refuses
/// connections they all fail) waits twice as long as that one did, from `MIN_RESTART_PAUSE` up to
/// `MAX_RESTART_PAUSE`. Without it a worker refused by a restarting database restarted a hundred
/// times in a few seconds (the fault suite saw it).
#[derive(Debug, Default)]
struct RestartPacer {
    /// When a worker last failed, and the pause it was given then.
    last: Option<(Instant, Duration)>,
}

const RESTART_STREAK: Duration = Duration::from_secs(10);
const MIN_RESTART_PAUSE: Duration = Duration::from_millis(100);
const MAX_RESTART_PAUSE: Duration = Duration::from_secs(2);

impl RestartPacer {
    fn pause(&mut self, now: Instant) -> Duration {
        let pause = match self.last {
            Some((at, before)) if now.saturating_duration_since(at) < RESTART_STREAK + before => {
                (before * 2).clamp(MIN_RESTART_PAUSE, MAX_RESTART_PAUSE)
            }
            _ => Duration::ZERO,
        };
        self.last = Some((now, pause));
        pause
    }
}

/// A name no other process has used or will use: a restarted worker must not inherit the
/// Running jobs of its previous life, or they would never be re-queued.
pub fn worker_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host = host.trim();
    let host = if host.is_empty() { "host" } else { host };
    format!("mnemo-{host}-{}-{}", std::process::id(), &uuid::Uuid::new_v4().simple().to_string()[..8])
}

async fn handle_embed(
    job: EmbedJob,
    dispatcher: Data<EmbedDispatcher>,
    store: Data<Store>,
    timeout: Data<JobTimeout>,
    attempt: Attempt,
    meta: MetadataStore,
) -> Result<(), BoxDynError> {
    // Each row joins whichever batch is gathering; the job runs again (skipping the rows done)
    // if any of them could not be stored.
    let work = async {
        let results = futures_util::future::join_all(job.rows().map(|row| dispatcher.submit(row))).await;
        results.into_iter().collect::<Result<(), _>>()
    };
    run(&store, &job, &attempt, &meta, *timeout, work).await
}

async fn handle_judge(
    job: JudgeJob,
    dispatcher: Data<JudgeDispatcher>,
    store: Data<Store>,
    timeout: Data<JobTimeout>,
    attempt: Attempt,
    meta: MetadataStore,
) -> Result<(), BoxDynError> {
    run(&store, &job, &attempt, &meta, *timeout, dispatcher.submit(job.clone())).await
}

async fn handle_compact(
    job: CompactJob,
    compactor: Data<Compactor>,
    store: Data<Store>,
    timeout: Data<JobTimeout>,
    attempt: Attempt,
    meta: MetadataStore,
) -> Result<(), BoxDynError> {
    run(&store, &job, &attempt, &meta, *timeout, async { compactor.run(&job).await.map(|_| ()) }).await
}

async fn handle_extract(
    job: ExtractJob,
    runner: Data<ExtractRunner>,
    store: Data<Store>,
    timeout: Data<JobTimeout>,
    attempt: Attempt,
    meta: MetadataStore,
) -> Result<(), BoxDynError> {
    run(&store, &job, &attempt, &meta, *timeout, async { runner.run(&job).await.map(|_| ()) }).await
}

async fn handle_consolidate(
    job: ConsolidateJob,
    runner: Data<ConsolidateRunner>,
    store: Data<Store>,
    timeout: Data<JobTimeout>,
    attempt: Attempt,
    meta: MetadataStore,
) -> Result<(), BoxDynError> {
    run(&store, &job, &attempt, &meta, *timeout, async { runner.run(&job).await.map(|_| ()) }).await
}

async fn handle_access(
    job: AccessJob,
    store: Data<Store>,
    timeout: Data<JobTimeout>,
    attempt: Attempt,
    meta: MetadataStore,
) -> Result<(), BoxDynError> {
    let work = async { store.apply_access(&job).await.map(|_| ()).map_err(JobError::from) };
    run(&store, &job, &attempt, &meta, *timeout, work).await
}

async fn handle_retention(
    job: RetentionJob,
    runner: Data<RetentionRunner>,
    store: Data<Store>,
    timeout: Data<JobTimeout>,
    attempt: Attempt,
    meta: MetadataStore,
) -> Result<(), BoxDynError> {
    run(&store, &job, &attempt, &meta, *timeout, async { runner.run(&job).await.map_err(JobError::from) }).await
}

/// A job's span, continuing the trace of the span that queued the job (the `traceparent` in its
/// metadata). The layer logs nothing of its own: failures are logged by [`finish`].
fn job_span<J: JobArgs>(task: &Task<J>) -> Span {
    let queue = J::QUEUE.as_str();
    let span = tracing::info_span!(
        "job",
        otel.name = %format_args!("{queue} job"),
        otel.kind = "consumer",
        queue,
        attempt = task.attempt(),
    );
    mnemo_config::continue_trace(&span, task.metadata().get(TRACEPARENT), None);
    span
}

/// How long past the job timeout apalis' own timeout waits, for `run` to retry the job.
const BACKSTOP_MARGIN: Duration = Duration::from_secs(30);

/// Runs a job on a task of its own, in the job's span: `tokio::spawn` alone would leave the span
/// behind, and the job's batches and statements would start traces of their own. The task is
/// aborted when its handle is dropped (by apalis' timeout), instead of running on unseen.
fn spawn_in_span<F>(job: F) -> AbortOnDrop<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    AbortOnDrop(tokio::spawn(job.in_current_span()))
}

/// A task's handle that aborts the task when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Future for AbortOnDrop<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How long one job may run: [`run`] stops its work then and retries it later.
#[derive(Debug, Clone, Copy)]
struct JobTimeout(Duration);

/// Runs a job's work within the job timeout, then carries out its next step. Work still going
/// at the timeout is dropped (a transaction it holds rolls back, as after a crash) and the job
/// runs again later like any failed one: apalis' own timeout would leave the work running and
/// the job marked running until its worker stopped.
async fn run<J: JobArgs>(
    store: &Store,
    job: &J,
    attempt: &Attempt,
    meta: &MetadataStore,
    JobTimeout(timeout): JobTimeout,
    work: impl Future<Output = Result<(), JobError>>,
) -> Result<(), BoxDynError> {
    let result = tokio::time::timeout(timeout, caught(work)).await.unwrap_or(Err(JobError::TimedOut(timeout)));
    finish(store, job, result, failures_before(meta) + attempt.current()).await
}

/// `work`, with a panic in it taken for the job's own failure (a bug, given up with its log
/// line): left to apalis, the job ran again at once, 25 times, with no backoff and no word.
async fn caught(work: impl Future<Output = Result<(), JobError>>) -> Result<(), JobError> {
    use futures_util::FutureExt;
    std::panic::AssertUnwindSafe(work).catch_unwind().await.unwrap_or(Err(JobError::Panicked { alone: true }))
}

/// Carries out a handler's next step for its job, whose run this is the `failures`-th failure
/// in a row if it failed (counting those before it was re-queued, so the backoff grows).
async fn finish<J: JobArgs>(
    store: &Store,
    job: &J,
    result: Result<(), JobError>,
    failures: usize,
) -> Result<(), BoxDynError> {
    let queue = J::QUEUE.as_str();
    match Next::after(result, failures) {
        Next::Done => Ok(()),
        Next::RetryAfter(delay, cause) => {
            // When even the retry cannot be queued, the job fails and apalis runs it again at once.
            if store.retry_failed(job, delay, failures).await? {
                tracing::warn!(queue, error = %mnemo_config::with_causes(&cause), delay_ms = delay.as_millis() as u64,
                    "job failed; it runs again later");
                metrics::counter!("mnemo_job_retries_total", "queue" => queue).increment(1);
            } else {
                tracing::info!(queue, error = %mnemo_config::with_causes(&cause), "job failed with no work left; not run again");
            }
            Ok(())
        }
        Next::GiveUp(cause) => {
            tracing::error!(queue, error = %mnemo_config::with_causes(&cause), "job cannot succeed; given up");
            metrics::counter!("mnemo_jobs_given_up_total", "queue" => queue).increment(1);
            Err(AbortError::new(cause).into())
        }
    }
}

/// Recall's HNSW index for the model this pool embeds with, built once per database (every
/// worker tries; one builds while the others find it built or being built). Built concurrently,
/// so writes and embedding go on while it builds; a build that fails (a lock it waited too long
/// for) is tried again a minute later, going on from the partitions done.
async fn build_vector_index(store: Store, model: String, dimensions: usize) {
    let started = std::time::Instant::now();
    loop {
        match store.ensure_vector_index(&model, dimensions).await {
            Ok(true) => tracing::info!(model, seconds = started.elapsed().as_secs_f64(), "vector index built"),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(model, error = %e, "cannot build the vector index yet; recall ranks the tenant class exactly meanwhile");
                tokio::time::sleep(Duration::from_secs(60)).await;
                continue;
            }
        }
        return;
    }
}

/// The models a pool works with.
#[derive(Debug, Clone)]
pub struct Models {
    pub embedder: Arc<dyn Embedder>,
    /// `None` when the judge's model step is off.
    pub judge: Option<Arc<dyn Judge>>,
    /// `None` when no chat model is configured: compaction truncates.
    pub summarizer: Option<Arc<dyn Summarizer>>,
    /// `None` when no chat model is configured: extraction is disabled.
    pub extractor: Option<Arc<dyn Extractor>>,
    /// `None` when no chat model is configured: consolidation is disabled.
    pub consolidator: Option<Arc<dyn Consolidator>>,
    /// Counts tokens as context windows do.
    pub counter: Arc<dyn TokenCounter>,
}

/// Runs the pool until `shutdown` resolves.
pub async fn run_worker(
    settings: WorkerSettings,
    models: Models,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), JobError> {
    let Models { embedder, judge, summarizer, extractor, consolidator, counter } = models;
    // Handlers wait on the dispatcher without holding a connection: a small pool serves the
    // backend's fetches, acks and heartbeats, the batches, housekeeping and the gauges. Each
    // queue's listener (NOTIFY) holds one of its connections for good: 8 more than those.
    let listeners = u32::try_from(settings.queues.len()).unwrap_or(u32::MAX);
    let connections = settings.database.max_connections.max(listeners.saturating_add(8));
    let store = Store::connect(settings.database.url.expose(), connections).await?;
    let schema = MIGRATOR.status(store.pool()).await?;
    if !schema.pending.is_empty() {
        return Err(JobError::Setup("the database schema is not current: run `mnemo-runbook migrate` first".into()));
    }
    // Migrate, then deploy: the workers already running keep running on the newer schema, as the
    // server keeps serving, and one restarting meanwhile (a drain, a crash) must start as well.
    if !schema.unknown.is_empty() {
        tracing::warn!("the database was migrated by a newer mnemo: deploy it");
    }
    // Batches and housekeeping cross tenants: row-level security would hide their rows.
    if store.walled() {
        return Err(JobError::Setup(
            "MNEMO_DATABASE_URL's role is held by row-level security: workers connect as the tables' owner \
             (ARCHITECTURE.md, \"Two roles\")"
                .into(),
        ));
    }
    let name = worker_name();
    tracing::info!(
        worker = %name,
        model = embedder.model(),
        judge = judge.as_ref().map_or("disabled", |j| j.model()),
        summarizer = summarizer.as_ref().map_or("none (compaction truncates)", |s| s.model()),
        queues = ?settings.queues,
        "mnemo-worker starting"
    );

    let metrics = serve_metrics(settings.listen).await?;
    let index = tokio::spawn(build_vector_index(store.clone(), embedder.model().to_owned(), embedder.dimensions()));
    let gauges = tokio::spawn(gauge_loop(store.clone(), embedder.model().to_owned()));
    let housekeeping = tokio::spawn(housekeeping_loop(
        store.clone(),
        name.clone(),
        HousekeepingPolicy {
            interval: settings.housekeeping_interval,
            model: embedder.model().to_owned(),
            embed_grace: settings.embed_grace,
            judge_grace: settings.judge.grace,
            job_retention: settings.job_retention,
            dead_worker_after: settings.orphan_timeout * 3,
            retention_interval: settings.retention.interval,
            consolidate_cron: settings.workspace.consolidation.schedule.clone(),
            consolidate_day_range: settings.workspace.consolidation.day_range,
            maintenance: settings.workspace.maintenance,
            signals: settings.signals,
        },
    ));

    // The backend's heartbeat also drives orphan recovery: a worker silent for
    // heartbeat × missed_heartbeats is dead, and its Running jobs go back to Pending.
    // Also how often a queue is polled for what no notice announces (a delayed retry coming
    // due): every 1 to 5 s, whatever the timeout.
    let heartbeat = (settings.orphan_timeout / 10).clamp(Duration::from_secs(1), Duration::from_secs(5));
    // Whole beats of the heartbeat as it is (not its whole seconds): 19 s must not become 36.
    let missed = (settings.orphan_timeout.as_secs_f64() / heartbeat.as_secs_f64()).ceil().max(2.0) as u32;
    // A queue worker whose backend failed (PostgreSQL restarted under it) starts again instead of
    // ending the process: the fault suite (`make faults`) saw every worker exit on a restart.
    // Not while shutting down. No cap on restarts (a cap turned a long outage into an exit within
    // seconds); a worker that keeps failing is paced instead (`RestartPacer`).
    // The monitor's own flag is no use here: a failed worker reads as stopped.
    let stopping = Arc::new(AtomicBool::new(false));
    let shutting_down = stopping.clone();
    let pacer = std::sync::Mutex::new(RestartPacer::default());
    let mut monitor = Monitor::new().shutdown_timeout(settings.job_timeout).should_restart(move |worker, error| {
        let again = !shutting_down.load(Ordering::Relaxed);
        let pause = if again { pacer.lock().map_or(Duration::ZERO, |mut p| p.pause(Instant::now())) } else { Duration::ZERO };
        tracing::warn!(worker = %worker.name(), error = %error, restarts = worker.restarts(), again, pause_ms = pause.as_millis() as u64, "queue worker failed");
        // The callback is synchronous and runs inside the monitor's future: waiting here holds
        // back every queue's fetching (never the jobs already running, which are spawned), and
        // only while some queue fails again and again.
        if !pause.is_zero() && tokio::runtime::Handle::current().runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread {
            tokio::task::block_in_place(|| std::thread::sleep(pause));
        }
        // A shutdown asked for during the pause wins.
        again && !shutting_down.load(Ordering::Relaxed)
    });
    for (queue, concurrency) in settings.queues.clone() {
        // One queue's apalis worker, the same for every queue: woken by NOTIFY and polling every
        // heartbeat, its jobs handed to the queue's dispatcher, each job bounded by the timeout.
        // A macro because the job and handler types differ per queue.
        macro_rules! register_queue {
            ($monitor:expr, $job:ty, $config:expr, $dispatcher:expr, $handler:expr) => {{
                let config = $config.heartbeat_interval(heartbeat).missed_heartbeats(missed as usize);
                let (pool, dispatcher, store) = (store.pool().clone(), $dispatcher, store.clone());
                let worker_id = format!("{name}-{queue}");
                let job_timeout = settings.job_timeout;
                $monitor.register(move |restarts| {
                    let backend = PostgresStorage::<$job>::new(&pool)
                        .with_config(config.clone())
                        .with_pubsub()
                        .poll_with_interval(heartbeat);
                    // A restarted worker takes a new id: the jobs the failed one held are then
                    // an orphan's, found dead and queued again after the orphan timeout.
                    let id = if restarts == 0 { worker_id.clone() } else { format!("{worker_id}-{restarts}") };
                    WorkerBuilder::new(id)
                        .backend(backend)
                        .data(dispatcher.clone())
                        .data(store.clone())
                        .data(JobTimeout(job_timeout))
                        .catch_panic()
                        .concurrency(concurrency)
                        // A backstop only: `run` ends a job's work at the timeout itself.
                        .timeout(job_timeout + BACKSTOP_MARGIN)
                        .layer(
                            TraceLayer::new()
                                .make_span_with(job_span::<$job>)
                                .on_request(|_: &Task<$job>, _: &Span| {})
                                .on_response(())
                                .on_failure(()),
                        )
                        .parallelize(spawn_in_span)
                        .build($handler)
                })
            }};
        }
        match queue {
            Queue::Embed => {
                let dispatcher = EmbedDispatcher::start(
                    store.clone(),
                    embedder.clone(),
                    EmbedPolicy {
                        batch_size: settings.embed_batch_size,
                        max_attempts: settings.embed_max_attempts,
                        previous_turn: settings.embed_previous_turn,
                    },
                );
                let config = Config::default()
                    .queue(queue.as_str())
                    // Enough jobs in hand for the next batches while one is in the model, but
                    // never more than can run: fetched-but-waiting jobs stop heartbeating.
                    .batch_size(concurrency.min(settings.embed_batch_size * 4));
                monitor = register_queue!(monitor, EmbedJob, config, dispatcher, handle_embed);
            }
            Queue::Judge => {
                let j = &settings.judge;
                let policy = JudgePolicy {
                    batch_size: j.batch_size,
                    max_wait: j.max_wait,
                    topk: j.topk,
                    threshold: j.threshold,
                };
                let dispatcher = JudgeDispatcher::start(store.clone(), judge.clone(), policy, name.clone());
                let config = Config::default().queue(queue.as_str()).batch_size(concurrency);
                monitor = register_queue!(monitor, JudgeJob, config, dispatcher, handle_judge);
            }
            Queue::Retention => {
                let runner = RetentionRunner {
                    store: store.clone(),
                    settings: settings.retention,
                    worker: name.clone(),
                    job_timeout: settings.job_timeout,
                };
                let config = Config::default().queue(queue.as_str()).batch_size(concurrency);
                monitor = register_queue!(monitor, RetentionJob, config, runner, handle_retention);
            }
            Queue::Compact => {
                let compactor = Compactor {
                    store: store.clone(),
                    summarizer: summarizer.clone(),
                    counter: counter.clone(),
                    policy: match &settings.context.model {
                        Some(model) => {
                            CompactPolicy::from_settings(&settings.context).within(settings.job_timeout, model.timeout)
                        }
                        None => CompactPolicy::from_settings(&settings.context),
                    },
                    extraction: settings.workspace.extraction.before_compaction(),
                };
                let config = Config::default().queue(queue.as_str()).batch_size(concurrency);
                monitor = register_queue!(monitor, CompactJob, config, compactor, handle_compact);
            }
            Queue::Extract => {
                let runner = ExtractRunner {
                    store: store.clone(),
                    extractor: extractor.clone(),
                    worker: name.clone(),
                    settings: settings.workspace.extraction.clone(),
                    max_file_bytes: settings.workspace.max_file_bytes,
                    max_memory_tokens: settings.workspace.consolidation.max_memory_tokens,
                    counter: counter.clone(),
                    stale_after: settings.job_timeout * 2,
                    consolidation_throttle: settings.workspace.consolidation.after_extraction(),
                };
                let config = Config::default().queue(queue.as_str()).batch_size(concurrency);
                monitor = register_queue!(monitor, ExtractJob, config, runner, handle_extract);
            }
            Queue::Consolidate => {
                let runner = ConsolidateRunner {
                    store: store.clone(),
                    consolidator: consolidator.clone(),
                    counter: counter.clone(),
                    worker: name.clone(),
                    settings: settings.workspace.consolidation.clone(),
                    stale_after: settings.job_timeout * 2,
                };
                let config = Config::default().queue(queue.as_str()).batch_size(concurrency);
                monitor = register_queue!(monitor, ConsolidateJob, config, runner, handle_consolidate);
            }
            Queue::Access => {
                let config = Config::default().queue(queue.as_str()).batch_size(concurrency);
                monitor = register_queue!(monitor, AccessJob, config, (), handle_access);
            }
        }
    }

    let result = monitor
        .run_with_signal(async move {
            shutdown.await;
            stopping.store(true, Ordering::Relaxed);
            Ok(())
        })
        .await;
    housekeeping.abort();
    gauges.abort();
    index.abort();
    metrics.abort();
    tracing::info!(worker = %name, "mnemo-worker stopped");
    result.map_err(|e| JobError::Setup(format!("worker pool failed: {e}")))
}

/// Queue depth, oldest pending age and the embedding backlog, refreshed every few seconds.
async fn gauge_loop(store: Store, model: String) {
    let mut timer = tokio::time::interval(Duration::from_secs(5));
    loop {
        timer.tick().await;
        match store.queue_status(false).await {
            Ok(queues) => {
                for q in queues {
                    for (state, n) in
                        [("pending", q.pending), ("running", q.running), ("failed", q.failed), ("dead", q.dead)]
                    {
                        metrics::gauge!("mnemo_queue_jobs", "queue" => q.queue.clone(), "state" => state).set(n as f64);
                    }
                    metrics::gauge!("mnemo_queue_oldest_pending_seconds", "queue" => q.queue.clone())
                        .set(q.oldest_pending_seconds.unwrap_or(0.0));
                }
            }
            Err(e) => tracing::debug!(error = %e, "queue gauges not refreshed"),
        }
        if let Ok(backlog) = store.embed_backlog(&model).await {
            metrics::gauge!("mnemo_embed_pending_rows").set(backlog.pending as f64);
            metrics::gauge!("mnemo_embed_failed_rows").set(backlog.failed as f64);
        }
    }
}

async fn serve_metrics(addr: std::net::SocketAddr) -> Result<tokio::task::JoinHandle<()>, JobError> {
    let handle = mnemo_config::metrics_handle();
    let app = axum::Router::new()
        .route("/metrics", axum::routing::get(move || std::future::ready(handle.render())))
        .route("/healthz", axum::routing::get(|| std::future::ready("ok")));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| JobError::Setup(format!("cannot serve metrics on {addr}: {e}")))?;
    tracing::info!(addr = %listener.local_addr().map_err(|e| JobError::Setup(e.to_string()))?, "worker metrics listening");
    Ok(tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_in_a_streak_are_paced_and_a_lone_failure_is_not() {
        let mut pacer = RestartPacer::default();
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        assert_eq!(pacer.pause(at(0)), Duration::ZERO, "the first failure restarts at once");
        // Failing again right after each restart, as against a database that is down.
        let mut now = 5;
        let mut pauses = Vec::new();
        for _ in 0..7 {
            let pause = pacer.pause(at(now));
            pauses.push(pause.as_millis() as u64);
            now += pause.as_millis() as u64 + 5;
        }
        assert_eq!(pauses, [100, 200, 400, 800, 1600, 2000, 2000]);
        // Quiet for longer than the streak: the next failure restarts at once again.
        let later = now + RESTART_STREAK.as_millis() as u64 + 2000 + 1;
        assert_eq!(pacer.pause(at(later)), Duration::ZERO);
        assert_eq!(pacer.pause(at(later + 1)), MIN_RESTART_PAUSE);
    }

    #[tokio::test]
    async fn a_job_that_panics_is_its_own_failure_not_a_crash() {
        let panics = async {
            if rand::random::<u8>() < 255 {
                panic!("a bug");
            }
            Ok(())
        };
        assert!(matches!(caught(panics).await, Err(JobError::Panicked { alone: true })));
        assert!(matches!(caught(async { Ok(()) }).await, Ok(())));
        assert!(matches!(Next::after(Err(JobError::Panicked { alone: true }), 1), Next::GiveUp(_)));
        // In a batch with others: run again, but not for ever.
        let in_batch = |attempt| Next::after(Err(JobError::Panicked { alone: false }), attempt);
        assert!(matches!(in_batch(crate::REFUSED_ATTEMPTS - 1), Next::RetryAfter(..)));
        assert!(matches!(in_batch(crate::REFUSED_ATTEMPTS), Next::GiveUp(_)));
    }
}

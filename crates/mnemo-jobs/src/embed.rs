//! Batched embedding. Each apalis embed job hands its row to the [`EmbedDispatcher`] and waits;
//! the dispatcher gathers rows into a batch, makes one model call for it, writes the vectors
//! back (queueing the judge for facts), and answers every job. Rows already embedded by the
//! current model for their current content are skipped, so a job run twice (a crash, a
//! re-queue) changes nothing the second time.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use mnemo_core::{EmbedError, Embedder, FailureClass, embedding_text};
use mnemo_store::queue::{EmbedJob, EmbedRow};
use mnemo_store::{EmbedFailure, NewVector, Store, StoreError};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::Instrument;
use uuid::Uuid;

use crate::batcher::{Batcher, Gather};
use crate::{JobError, backoff};

/// How the dispatcher batches and retries.
#[derive(Debug, Clone, Copy)]
pub struct EmbedPolicy {
    pub batch_size: usize,
    pub max_attempts: i32,
    /// Embed each chat message with the turn before it (see [`mnemo_core::embedding_text`]).
    pub previous_turn: bool,
}

/// Model calls that may run at once. One call on a few rows leaves cores idle while it runs
/// the parts of a forward pass that are not split across threads; a second call fills them.
/// Measured under a steady stream (`embed-latency`), two at once cut latency by a third to a
/// half at 0.6-0.8 of the batched rate against one at once (docs/benchmarks.md).
const MODEL_CALLS_AT_ONCE: usize = 2;

/// A handle to the batching loops. Cheap to clone.
#[derive(Debug, Clone)]
pub struct EmbedDispatcher {
    batcher: Batcher<EmbedRow>,
}

impl EmbedDispatcher {
    /// Starts one more batching loop than [`MODEL_CALLS_AT_ONCE`]: while the model's calls are
    /// all taken, the spare loop gathers, and goes in the moment one of them is done (while that
    /// loop stores its vectors) or once its batch is full. So a lone row is embedded at once;
    /// under a steady stream each batch holds what arrived while the calls ran, so batches grow
    /// with the backlog and the model runs nearer its batched rate the more it has to do; and a
    /// backlog of full batches runs one more call beside them.
    pub fn start(store: Store, embedder: Arc<dyn Embedder>, policy: EmbedPolicy) -> Self {
        let model = Arc::new(Semaphore::new(MODEL_CALLS_AT_ONCE));
        let gather = Gather::UntilFree(model);
        let failing = Arc::new(AtomicBool::new(false));
        let loops = MODEL_CALLS_AT_ONCE + 1;
        let batcher =
            Batcher::start("embed batch", loops, policy.batch_size, gather, move |jobs: Vec<EmbedRow>, model| {
                let (store, embedder, failing) = (store.clone(), embedder.clone(), failing.clone());
                async move {
                    embed_batch(&store, embedder.as_ref(), policy, &jobs, model, &failing).await.map_err(|e| {
                        tracing::warn!(
                            error = %e,
                            jobs = jobs.len(),
                            "embed batch could not be stored; its jobs will run again"
                        );
                        JobError::from(e)
                    })
                }
            });
        Self { batcher }
    }

    /// Embeds one row of a job with whichever others are waiting. `Ok` means the row is finished:
    /// embedded, skipped, re-queued with a backoff, or failed for good (recorded on the row).
    /// `Err` means the database could not be reached and the row's job should run again.
    pub async fn submit(&self, job: EmbedRow) -> Result<(), JobError> {
        self.batcher.submit(job).await
    }
}

/// One batch: load, skip what is done, embed the rest (isolating rows the model refuses), free
/// the model for the next batch, store the vectors, and record each failure with its next step.
/// `failing` says the endpoint's last answer was a transient failure: when it answers again, the
/// rows waiting out a backoff are retried at once rather than up to minutes later.
async fn embed_batch(
    store: &Store,
    embedder: &dyn Embedder,
    policy: EmbedPolicy,
    jobs: &[EmbedRow],
    model_permit: Option<OwnedSemaphorePermit>,
    failing: &AtomicBool,
) -> Result<(), StoreError> {
    let model = embedder.model();
    let rows = store.rows_to_embed(jobs, model, policy.previous_turn).await?;
    let unrecorded: Vec<_> = rows.iter().filter(|r| r.done && !r.recorded).collect();
    if !unrecorded.is_empty() {
        store.record_embedded(model, &unrecorded).await?;
    }
    let skipped = jobs.len() - rows.iter().filter(|r| !r.done).count();
    metrics::counter!("mnemo_embed_rows_skipped_total").increment(skipped as u64);
    let todo: Vec<_> = rows.into_iter().filter(|r| !r.done).collect();
    if todo.is_empty() {
        return Ok(());
    }
    metrics::histogram!("mnemo_embed_batch_rows").record(todo.len() as f64);

    let texts: Vec<String> = todo.iter().map(|r| embedding_text(&r.content, r.previous.as_deref())).collect();
    // While the endpoint answers, a batch failed by a server error is searched for the row
    // whose input draws it; once it does not, that would only add calls to an outage.
    let answering = !failing.load(Ordering::Relaxed);
    let mut results = embed_isolating(embedder, &texts, answering).await;
    // A provider may refuse a row for its previous turn's words: such a row goes again alone.
    let refused_with_context: Vec<usize> = (0..todo.len())
        .filter(|&i| todo[i].previous.is_some() && matches!(&results[i], Err(e) if e.class == FailureClass::Permanent))
        .collect();
    let mut with_previous: Vec<Option<Uuid>> = todo.iter().map(|r| r.previous_id).collect();
    if !refused_with_context.is_empty() {
        let alone: Vec<String> = refused_with_context.iter().map(|&i| todo[i].content.clone()).collect();
        for (i, result) in refused_with_context.into_iter().zip(embed_isolating(embedder, &alone, answering).await) {
            results[i] = result;
            with_previous[i] = None;
        }
    }
    drop(model_permit);

    let mut vectors = Vec::new();
    let mut failures = Vec::new();
    for ((row, result), previous_id) in todo.iter().zip(results).zip(with_previous) {
        match result {
            Ok(embedding) => vectors.push(NewVector {
                id: row.id,
                tenant_id: row.tenant_id.clone(),
                content_sha256: row.content_sha256.clone(),
                embedding,
                previous_id,
            }),
            Err(e) => failures.push(((row.tenant_id.as_str().to_owned(), row.id), e)),
        }
    }

    let created: HashMap<Uuid, _> = todo.iter().map(|r| (r.id, r.created_at)).collect();
    let answered = !vectors.is_empty();
    let saved = store.save_vectors(model, vectors).await?;
    let now = chrono::Utc::now();
    for id in &saved {
        if let Some(created_at) = created.get(id) {
            let lag = (now - *created_at).to_std().unwrap_or_default();
            metrics::histogram!("mnemo_embed_lag_seconds").record(lag.as_secs_f64());
        }
    }
    metrics::counter!("mnemo_embed_rows_embedded_total").increment(saved.len() as u64);
    let transient = failures.iter().any(|(_, e)| e.class == FailureClass::Transient);
    if !transient && answered && failing.swap(false, Ordering::Relaxed) {
        // Only a shortcut: if it fails, the retries stay due when their backoff ends.
        match store.retry_now::<EmbedJob>().await {
            Ok(due) => tracing::info!(
                jobs = due,
                "the embedding endpoint answers again: rows waiting out a backoff are retried now"
            ),
            Err(e) => tracing::warn!(error = %e, "could not bring the waiting embed retries forward"),
        }
    }

    let first_failed = record_failures(store, policy, model, jobs, failures).await?;
    // Only once the retries are queued: a concurrent batch's answer that took the flag before
    // would bring nothing forward, and these retries would wait out their whole backoff. Only
    // when nothing was answered and a row failed at its first attempt: a row failing beside
    // answered ones, or a retry failing alone, is the row's trouble more likely than the
    // endpoint's, and bringing every waiting retry forward at each answer would bring it back
    // with them. An outage fails rows at their first attempt from its start.
    if transient && !answered && first_failed {
        failing.store(true, Ordering::Relaxed);
    }
    Ok(())
}

/// A row of a batch: its tenant and id.
type RowKey = (String, Uuid);

/// Records each failed row's attempt: a transient failure is retried after a backoff until the
/// row has made its attempts and failed for as long as their backoffs take at their shortest;
/// then, or at a permanent failure, the row is given up with the reason on it. Returns whether a
/// row failed transiently at its first attempt.
async fn record_failures(
    store: &Store,
    policy: EmbedPolicy,
    model: &str,
    jobs: &[EmbedRow],
    failures: Vec<(RowKey, EmbedError)>,
) -> Result<bool, StoreError> {
    if failures.is_empty() {
        return Ok(false);
    }
    // By tenant and id: an import into a second tenant keeps its rows' ids.
    let by_key: HashMap<RowKey, &EmbedRow> =
        jobs.iter().map(|j| ((j.tenant_id.as_str().to_owned(), j.item_id), j)).collect();
    let failed: Vec<&EmbedRow> = failures.iter().filter_map(|(key, _)| by_key.get(key).copied()).collect();
    let so_far: HashMap<RowKey, (i32, f64)> = store
        .embed_failures(&failed)
        .await?
        .into_iter()
        .map(|(tenant, id, n, secs)| ((tenant, id), (n, secs)))
        .collect();
    let promised = crate::shortest_schedule(policy.max_attempts).as_secs_f64();
    let mut records = Vec::with_capacity(failures.len());
    let mut first_failed = false;
    for (key, error) in failures {
        let Some(job) = by_key.get(&key) else { continue };
        let id = key.1;
        let (attempts, failing_secs) = so_far.get(&key).copied().unwrap_or_default();
        let attempt = attempts + 1;
        first_failed |= attempt == 1 && error.class == FailureClass::Transient;
        let retry =
            error.class == FailureClass::Transient && (attempt < policy.max_attempts || failing_secs < promised);
        let class = match error.class {
            FailureClass::Transient if retry => "transient",
            FailureClass::Transient => "exhausted",
            FailureClass::Permanent => "permanent",
        };
        metrics::counter!("mnemo_embed_failures_total", "class" => class, "kind" => error.kind).increment(1);
        if retry {
            // At least as long as the endpoint asked (its Retry-After).
            let delay = backoff(attempt).max(error.retry_after.unwrap_or_default());
            tracing::info!(item = %id, attempt, kind = error.kind, delay_ms = delay.as_millis() as u64,
                "embedding failed; retrying later");
            records.push(EmbedFailure { job, error: error.to_string(), retry_after: Some(delay) });
        } else {
            let recorded = match error.class {
                FailureClass::Transient => format!("gave up after {attempt} attempts: {error}"),
                FailureClass::Permanent => error.to_string(),
            };
            tracing::warn!(item = %id, attempt, kind = error.kind, "embedding failed for good");
            records.push(EmbedFailure { job, error: recorded, retry_after: None });
        }
    }
    store.record_embed_failures(model, &records).await?;
    Ok(first_failed)
}

/// One model call for the whole batch. If the provider refuses the batch outright, the batch is
/// halved until the refused rows stand alone, so one bad row does not fail the others. A
/// transient failure applies to every row of the call, but a server error while the endpoint is
/// `answering` is searched for the rows that draw it ([`search_server_errors`]).
async fn embed_isolating(
    embedder: &dyn Embedder,
    texts: &[String],
    answering: bool,
) -> Vec<Result<Vec<f32>, EmbedError>> {
    let started = Instant::now();
    let answer =
        embedder.embed(texts).instrument(mnemo_config::model_span("embeddings", embedder.model(), texts.len())).await;
    metrics::histogram!("mnemo_embed_model_seconds").record(started.elapsed().as_secs_f64());
    match answer {
        Ok(vectors) if vectors.len() == texts.len() => {
            // One vector pgvector would refuse, or that points nowhere (all zeros), fails its
            // row alone, not the batch's save; retried, since a misbehaving endpoint is mended.
            let dimensions = embedder.dimensions();
            vectors
                .into_iter()
                .map(|v| {
                    match v.len() == dimensions && v.iter().all(|x| x.is_finite()) && v.iter().any(|&x| x != 0.0) {
                        true => Ok(v),
                        false => Err(EmbedError::transient(
                            "bad_vector",
                            format!("{} values, not {dimensions} finite ones, not all zero", v.len()),
                        )),
                    }
                })
                .collect()
        }
        Ok(vectors) => {
            let e = EmbedError::transient("wrong_count", format!("asked for {}, got {}", texts.len(), vectors.len()));
            texts.iter().map(|_| Err(e.clone())).collect()
        }
        Err(e) if e.class == FailureClass::Permanent && texts.len() > 1 => {
            let (left, right) = texts.split_at(texts.len() / 2);
            let mut results = Box::pin(embed_isolating(embedder, left, answering)).await;
            results.extend(Box::pin(embed_isolating(embedder, right, answering)).await);
            results
        }
        Err(e) if answering && is_server_error(&e) && texts.len() > 1 => {
            Box::pin(search_server_errors(embedder, texts)).await
        }
        Err(e) => texts.iter().map(|_| Err(e.clone())).collect(),
    }
}

/// A 500 from the endpoint, as `mnemo_models`' client words it: some endpoints answer it for
/// one input. A 502, 503 or 504 is a gateway's or the endpoint's state, never the input's, and
/// so is a 500 asking for a wait (Retry-After).
fn is_server_error(e: &EmbedError) -> bool {
    e.kind == "http_5xx" && e.detail.starts_with("HTTP 500:") && e.retry_after.is_none()
}

/// The rows of `texts`, whose call failed with a 500, that draw it: some endpoints answer it for
/// one input, and that row would fail its batch-mates at every retry for as long as its
/// attempts last. Each half is asked once; only a half failed whole by a server error
/// beside one that was answered is searched further, so an endpoint that has just gone down
/// costs two more calls, not one per row.
async fn search_server_errors(embedder: &dyn Embedder, texts: &[String]) -> Vec<Result<Vec<f32>, EmbedError>> {
    let (left, right) = texts.split_at(texts.len() / 2);
    let mut l = embed_isolating(embedder, left, false).await;
    let mut r = embed_isolating(embedder, right, false).await;
    let answered = |results: &[Result<Vec<f32>, EmbedError>]| results.iter().any(Result::is_ok);
    let server_errors = |results: &[Result<Vec<f32>, EmbedError>]| {
        results.iter().all(|result| result.as_ref().is_err_and(is_server_error))
    };
    if answered(&r) && server_errors(&l) && left.len() > 1 {
        l = Box::pin(search_server_errors(embedder, left)).await;
    }
    if answered(&l) && server_errors(&r) && right.len() > 1 {
        r = Box::pin(search_server_errors(embedder, right)).await;
    }
    l.extend(r);
    l
}

#[cfg(test)]
mod tests {
    use mnemo_core::{EmbedFuture, Embedder, FailureClass};

    /// Answers NaN for the text "bad", as a local model's arithmetic might.
    #[derive(Debug)]
    struct NanFor;

    impl Embedder for NanFor {
        fn model(&self) -> &str {
            "nan-for-bad"
        }

        fn dimensions(&self) -> usize {
            2
        }

        fn embed<'a>(&'a self, texts: &'a [String]) -> EmbedFuture<'a> {
            let vectors = texts.iter().map(|t| match t.as_str() {
                "bad" => vec![f32::NAN, 0.0],
                "zero" => vec![0.0, 0.0],
                _ => vec![1.0, 0.0],
            });
            let vectors: Vec<Vec<f32>> = vectors.collect();
            Box::pin(async move { Ok(vectors) })
        }
    }

    /// Answers 500 to any call holding an input with "poison" (or to every call when `down`),
    /// counting the calls.
    #[derive(Debug, Default)]
    struct ServerErrorFor {
        down: bool,
        calls: std::sync::atomic::AtomicUsize,
    }

    impl Embedder for ServerErrorFor {
        fn model(&self) -> &str {
            "server-error-for-poison"
        }

        fn dimensions(&self) -> usize {
            2
        }

        fn embed<'a>(&'a self, texts: &'a [String]) -> EmbedFuture<'a> {
            self.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let fails = self.down || texts.iter().any(|t| t.contains("poison"));
            let answer = match fails {
                true => Err(mnemo_core::EmbedError::transient("http_5xx", "HTTP 500: Internal Server Error")),
                false => Ok(texts.iter().map(|_| vec![1.0, 0.0]).collect()),
            };
            Box::pin(async move { answer })
        }
    }

    /// One input that draws a server error fails only its own row while the endpoint answers;
    /// an endpoint that is down costs two more calls, and none once it is known to be failing.
    #[tokio::test]
    async fn a_row_whose_input_draws_a_server_error_fails_alone() {
        let mut texts: Vec<String> = (0..16).map(|i| format!("row {i}")).collect();
        texts[11] = "the poison row".into();
        let endpoint = ServerErrorFor::default();
        let results = super::embed_isolating(&endpoint, &texts, true).await;
        let failed: Vec<usize> = (0..texts.len()).filter(|&i| results[i].is_err()).collect();
        assert_eq!(failed, [11], "{results:?}");
        let calls = endpoint.calls.load(std::sync::atomic::Ordering::Relaxed);
        assert!(calls <= 1 + 2 * 4, "{calls} calls for 16 rows");

        let down = ServerErrorFor { down: true, ..Default::default() };
        assert!(super::embed_isolating(&down, &texts, true).await.iter().all(Result::is_err));
        assert_eq!(down.calls.load(std::sync::atomic::Ordering::Relaxed), 3);
        let known_down = ServerErrorFor { down: true, ..Default::default() };
        assert!(super::embed_isolating(&known_down, &texts, false).await.iter().all(Result::is_err));
        assert_eq!(known_down.calls.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    /// pgvector refuses a NaN, which would fail the whole batch's save, and a zero vector points
    /// nowhere: each fails its row alone, to be retried (the endpoint misbehaved).
    #[tokio::test]
    async fn a_vector_that_is_not_finite_or_all_zero_fails_its_row_alone() {
        let texts = ["a", "bad", "c", "zero"].map(String::from);
        let results = super::embed_isolating(&NanFor, &texts, true).await;
        assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
        for bad in [1, 3] {
            assert_eq!(results[bad].as_ref().map_err(|e| e.class), Err(FailureClass::Transient), "{results:?}");
        }
    }
}

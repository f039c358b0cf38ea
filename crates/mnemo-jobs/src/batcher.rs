//! Gathers jobs into batches: each apalis job hands its arguments over and waits; a batching
//! loop takes jobs, runs them as one batch, and answers every job of it with the batch's result.
//!
//! How long a batch gathers is the [`Gather`] policy. A fixed wait suits a model whose cost
//! hardly depends on the batch (the judge's chat calls). A model that gets cheaper per row with
//! bigger batches (an embedder) gathers while the model's calls are all taken and stops the
//! moment one is free: a lone job runs at once, and under load each batch holds what arrived
//! while the calls ran, so batches grow with the backlog and shrink again when it drains. A full
//! batch goes in beside them.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tracing::{Instrument, Span};

use crate::JobError;

type Reply = oneshot::Sender<Result<(), JobError>>;

/// A job handed to a batching loop: its arguments, where its answer goes, and the span of the
/// job that waits (the batch's span continues its trace).
type Handed<J> = (J, Reply, Span);

/// When a batch stops gathering.
#[derive(Debug, Clone)]
pub(crate) enum Gather {
    /// When it is full or its first job has waited this long.
    Wait(Duration),
    /// When one of the model's calls is free (a permit of this semaphore, handed to the run,
    /// which releases it when its model call is done) or the batch is full. A full batch goes in
    /// without a permit, beside the calls in the model: with a backlog, every core stays busy.
    UntilFree(Arc<Semaphore>),
}

/// A handle to the batching loops. Cheap to clone.
#[derive(Debug)]
pub(crate) struct Batcher<J> {
    sender: mpsc::Sender<Handed<J>>,
}

impl<J> Clone for Batcher<J> {
    fn clone(&self) -> Self {
        Self { sender: self.sender.clone() }
    }
}

impl<J: Send + 'static> Batcher<J> {
    /// Starts `loops` batching loops over one queue of jobs: with one more loop than the model
    /// takes calls at once, a batch gathers (or stores its results) while the others run.
    /// `name` names a batch's span.
    pub fn start<F, Fut>(name: &'static str, loops: usize, batch_size: usize, gather: Gather, run: F) -> Self
    where
        F: Fn(Vec<J>, Option<OwnedSemaphorePermit>) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<(), JobError>> + Send + 'static,
    {
        let (sender, receiver) = mpsc::channel(batch_size * 8);
        let receiver = Arc::new(Mutex::new(receiver));
        for _ in 0..loops.max(1) {
            tokio::spawn(batch_loop(name, receiver.clone(), batch_size.max(1), gather.clone(), run.clone()));
        }
        Self { sender }
    }

    /// Runs one job with whichever others are waiting; the batch's result.
    pub async fn submit(&self, job: J) -> Result<(), JobError> {
        let (reply, answer) = oneshot::channel();
        self.sender.send((job, reply, Span::current())).await.map_err(|_| JobError::ShuttingDown)?;
        answer.await.map_err(|_| JobError::ShuttingDown)?
    }
}

async fn batch_loop<J, F, Fut>(
    name: &'static str,
    receiver: Arc<Mutex<mpsc::Receiver<Handed<J>>>>,
    batch_size: usize,
    gather: Gather,
    run: F,
) where
    F: Fn(Vec<J>, Option<OwnedSemaphorePermit>) -> Fut,
    Fut: Future<Output = Result<(), JobError>>,
{
    loop {
        let mut batch = Vec::with_capacity(batch_size);
        let mut permit = None;
        {
            let mut receiver = receiver.lock().await;
            let Some(first) = receiver.recv().await else { return };
            batch.push(first);
            match &gather {
                Gather::Wait(max_wait) => {
                    let deadline = tokio::time::Instant::now() + *max_wait;
                    while batch.len() < batch_size {
                        match tokio::time::timeout_at(deadline, receiver.recv()).await {
                            Ok(Some(item)) => batch.push(item),
                            Ok(None) | Err(_) => break,
                        }
                    }
                }
                Gather::UntilFree(model) => {
                    while batch.len() < batch_size && permit.is_none() {
                        tokio::select! {
                            biased;
                            free = model.clone().acquire_owned() => permit = free.ok(),
                            item = receiver.recv() => match item {
                                Some(item) => batch.push(item),
                                None => break,
                            },
                        }
                    }
                    // Whatever else is already waiting rides along.
                    while batch.len() < batch_size {
                        match receiver.try_recv() {
                            Ok(item) => batch.push(item),
                            Err(_) => break,
                        }
                    }
                }
            }
        }
        // A job that stopped waiting (its timeout cut it off) runs again as a new job: running
        // it here too would pay for it twice.
        batch.retain(|(_, reply, _)| !reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        let alone = batch.len() == 1;
        let span = mnemo_config::batch_span(name, batch.iter().map(|(_, _, caller)| caller));
        let (jobs, replies): (Vec<J>, Vec<Reply>) = batch.into_iter().map(|(job, reply, _)| (job, reply)).unzip();
        // A batch that panics fails its own jobs; the loop lives on for the next batches (a
        // dead loop would leave every later job of the queue waiting for an answer in vain).
        let result = AssertUnwindSafe(run(jobs, permit).instrument(span)).catch_unwind().await.unwrap_or_else(|_| {
            tracing::error!(batch = name, jobs = replies.len(), "a batch panicked: its jobs fail");
            Err(JobError::Panicked { alone })
        });
        for reply in replies {
            let _ = reply.send(result.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batcher of `loops` loops over one model whose runs record their batch sizes.
    fn recording(
        model: &Arc<Semaphore>,
        loops: usize,
        batch_size: usize,
    ) -> (Batcher<u32>, Arc<std::sync::Mutex<Vec<usize>>>) {
        let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let recorded = sizes.clone();
        let batcher = Batcher::start(
            "test batch",
            loops,
            batch_size,
            Gather::UntilFree(model.clone()),
            move |jobs: Vec<u32>, permit| {
                let recorded = recorded.clone();
                async move {
                    recorded.lock().expect("sizes").push(jobs.len());
                    drop(permit);
                    Ok(())
                }
            },
        );
        (batcher, sizes)
    }

    fn submit_all(batcher: &Batcher<u32>, n: u32) -> Vec<tokio::task::JoinHandle<Result<(), JobError>>> {
        (0..n)
            .map(|i| {
                let batcher = batcher.clone();
                tokio::spawn(async move { batcher.submit(i).await })
            })
            .collect()
    }

    #[tokio::test]
    async fn a_panicking_batch_fails_its_jobs_and_the_loop_goes_on() {
        let batcher =
            Batcher::start("test batch", 1, 1, Gather::Wait(Duration::ZERO), |jobs: Vec<u32>, _| async move {
                assert!(jobs[0] != 1, "job 1 panics");
                Ok(())
            });
        assert!(matches!(batcher.submit(1).await, Err(JobError::Panicked { alone: true })));
        assert!(batcher.submit(2).await.is_ok(), "the only loop survived the panic");
    }

    #[tokio::test]
    async fn a_job_that_stopped_waiting_is_left_out_of_its_batch() {
        let ran = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = ran.clone();
        let batcher =
            Batcher::start("test batch", 1, 8, Gather::Wait(Duration::from_millis(300)), move |jobs: Vec<u32>, _| {
                seen.lock().expect("ran").extend(jobs);
                async { Ok(()) }
            });
        let gone = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.submit(1).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        gone.abort();
        assert!(batcher.submit(2).await.is_ok());
        assert_eq!(*ran.lock().expect("ran"), [2]);
    }

    #[tokio::test]
    async fn a_batch_gathers_while_the_model_is_busy_and_a_lone_job_goes_at_once() {
        let model = Arc::new(Semaphore::new(1));
        let (batcher, sizes) = recording(&model, 2, 32);
        // Nothing else waiting, the model free: the job goes alone and at once.
        tokio::time::timeout(Duration::from_millis(500), batcher.submit(1)).await.expect("at once").expect("ok");

        // The model busy: jobs gather, and go together the moment it is free.
        let busy = model.clone().acquire_owned().await.expect("permit");
        let waiting = submit_all(&batcher, 5);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(*sizes.lock().expect("sizes"), vec![1], "nothing runs while the model is busy");
        drop(busy);
        for job in waiting {
            job.await.expect("task").expect("ok");
        }
        assert_eq!(*sizes.lock().expect("sizes"), vec![1, 5]);
    }

    /// The embed dispatcher's shape: two calls at once, three loops. A lone job waits only when
    /// both calls are taken.
    #[tokio::test]
    async fn with_two_calls_at_once_a_job_gathers_only_while_both_are_taken() {
        let model = Arc::new(Semaphore::new(2));
        let (batcher, sizes) = recording(&model, 3, 32);
        let first = model.clone().acquire_owned().await.expect("permit");
        tokio::time::timeout(Duration::from_millis(500), batcher.submit(1)).await.expect("at once").expect("ok");

        let second = model.clone().acquire_owned().await.expect("permit");
        let waiting = submit_all(&batcher, 3);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(*sizes.lock().expect("sizes"), vec![1], "nothing runs while both calls are taken");
        drop(first);
        for job in waiting {
            job.await.expect("task").expect("ok");
        }
        assert_eq!(*sizes.lock().expect("sizes"), vec![1, 3]);
        drop(second);
    }

    #[tokio::test]
    async fn a_full_batch_goes_in_beside_the_busy_model() {
        let model = Arc::new(Semaphore::new(1));
        let (batcher, sizes) = recording(&model, 2, 4);
        let _busy = model.clone().acquire_owned().await.expect("permit");
        for job in submit_all(&batcher, 4) {
            tokio::time::timeout(Duration::from_millis(500), job)
                .await
                .expect("not held back")
                .expect("task")
                .expect("ok");
        }
        assert_eq!(*sizes.lock().expect("sizes"), vec![4]);
    }
}

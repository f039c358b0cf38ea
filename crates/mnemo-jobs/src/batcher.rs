//! Gathers jobs into batches: each apalis job hands its arguments over and waits; a batching
//! loop takes jobs, runs them as one batch, and answers every job of it with the batch's result.
//!
//! How long a batch gathers is the [`Gather`] policy. A fixed wait suits a model whose cost
//! hardly depends on the batch (the judge's chat calls). A model that gets cheaper per row with
//! bigger batches (an embedder) gathers while the model is busy and stops the moment it is free:
//! a lone job runs at once, and under load each batch holds what arrived during the previous
//! one, so batches grow with the backlog and shrink again when it drains. Once they are full,
//! two run at once.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use crate::JobError;

type Reply = oneshot::Sender<Result<(), JobError>>;

/// When a batch stops gathering.
#[derive(Debug, Clone)]
pub(crate) enum Gather {
    /// When it is full or its first job has waited this long.
    Wait(Duration),
    /// When the model is free (a permit of this semaphore, handed to the run, which releases it
    /// when its model call is done) or the batch is full. A full batch goes in without a permit,
    /// beside the one in the model: with a backlog, two batches at once keep every core busy.
    UntilFree(Arc<Semaphore>),
}

/// A handle to the batching loops. Cheap to clone.
#[derive(Debug)]
pub(crate) struct Batcher<J> {
    sender: mpsc::Sender<(J, Reply)>,
}

impl<J> Clone for Batcher<J> {
    fn clone(&self) -> Self {
        Self { sender: self.sender.clone() }
    }
}

impl<J: Send + 'static> Batcher<J> {
    /// Starts `loops` batching loops over one queue of jobs: with two, one batch gathers (or
    /// stores its results) while the other runs.
    pub fn start<F, Fut>(loops: usize, batch_size: usize, gather: Gather, run: F) -> Self
    where
        F: Fn(Vec<J>, Option<OwnedSemaphorePermit>) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<(), JobError>> + Send + 'static,
    {
        let (sender, receiver) = mpsc::channel(batch_size * 8);
        let receiver = Arc::new(Mutex::new(receiver));
        for _ in 0..loops.max(1) {
            tokio::spawn(batch_loop(receiver.clone(), batch_size.max(1), gather.clone(), run.clone()));
        }
        Self { sender }
    }

    /// Runs one job with whichever others are waiting; the batch's result.
    pub async fn submit(&self, job: J) -> Result<(), JobError> {
        let (reply, answer) = oneshot::channel();
        self.sender.send((job, reply)).await.map_err(|_| JobError::ShuttingDown)?;
        answer.await.map_err(|_| JobError::ShuttingDown)?
    }
}

async fn batch_loop<J, F, Fut>(
    receiver: Arc<Mutex<mpsc::Receiver<(J, Reply)>>>,
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
        let (jobs, replies): (Vec<J>, Vec<Reply>) = batch.into_iter().unzip();
        let result = run(jobs, permit).await;
        for reply in replies {
            let _ = reply.send(result.clone());
        }
    }
}

//! Gathers jobs into batches: each apalis job hands its arguments over and waits; a batching
//! loop takes jobs until the batch is full or the first has waited `max_wait`, runs the batch,
//! and answers every job of it with the batch's result.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Mutex, mpsc, oneshot};

use crate::JobError;

type Reply = oneshot::Sender<Result<(), JobError>>;

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
    /// Starts `loops` batching loops over one queue of jobs: with two, one batch gathers while
    /// the other runs.
    pub fn start<F, Fut>(loops: usize, batch_size: usize, max_wait: Duration, run: F) -> Self
    where
        F: Fn(Vec<J>) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<(), JobError>> + Send + 'static,
    {
        let (sender, receiver) = mpsc::channel(batch_size * 8);
        let receiver = Arc::new(Mutex::new(receiver));
        for _ in 0..loops.max(1) {
            tokio::spawn(batch_loop(receiver.clone(), batch_size.max(1), max_wait, run.clone()));
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
    max_wait: Duration,
    run: F,
) where
    F: Fn(Vec<J>) -> Fut,
    Fut: Future<Output = Result<(), JobError>>,
{
    loop {
        let mut batch = Vec::with_capacity(batch_size);
        {
            let mut receiver = receiver.lock().await;
            let Some(first) = receiver.recv().await else { return };
            batch.push(first);
            let deadline = tokio::time::Instant::now() + max_wait;
            while batch.len() < batch_size {
                match tokio::time::timeout_at(deadline, receiver.recv()).await {
                    Ok(Some(item)) => batch.push(item),
                    Ok(None) | Err(_) => break,
                }
            }
        }
        let (jobs, replies): (Vec<J>, Vec<Reply>) = batch.into_iter().unzip();
        let result = run(jobs).await;
        for reply in replies {
            let _ = reply.send(result.clone());
        }
    }
}

//! Group commit for writes. Concurrent requests hand their rows to a few committer tasks; each
//! takes whatever is waiting (up to a limit) and writes it in one transaction. A lone write goes
//! straight through, so nothing waits on a timer; under load, rows share a transaction, an fsync
//! and the job queue's notification lock instead of queueing for them one by one.

use std::sync::Arc;

use mnemo_core::NewMemory;
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::{Remembered, Store, StoreError};

type Reply = oneshot::Sender<Result<Remembered, StoreError>>;

/// A handle to the committers. Cheap to clone.
#[derive(Debug, Clone)]
pub struct GroupCommit {
    sender: mpsc::Sender<(NewMemory, Reply)>,
}

impl GroupCommit {
    /// Starts `committers` tasks, each writing up to `max_batch` rows per transaction. They stop
    /// when every handle is dropped.
    pub fn start(store: Store, committers: usize, max_batch: usize) -> Self {
        let (sender, receiver) = mpsc::channel(committers * max_batch * 4);
        let receiver = Arc::new(Mutex::new(receiver));
        for _ in 0..committers.max(1) {
            tokio::spawn(commit_loop(store.clone(), receiver.clone(), max_batch.max(1)));
        }
        Self { sender }
    }

    /// Writes one row, with whichever others are waiting.
    pub async fn remember(&self, memory: NewMemory) -> Result<Remembered, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.sender.send((memory, reply)).await.map_err(|_| StoreError::ShuttingDown)?;
        answer.await.map_err(|_| StoreError::ShuttingDown)?
    }
}

async fn commit_loop(store: Store, receiver: Arc<Mutex<mpsc::Receiver<(NewMemory, Reply)>>>, max_batch: usize) {
    let mut batch = Vec::with_capacity(max_batch);
    loop {
        {
            let mut receiver = receiver.lock().await;
            if receiver.recv_many(&mut batch, max_batch).await == 0 {
                return;
            }
        }
        let (rows, replies): (Vec<NewMemory>, Vec<Reply>) = batch.drain(..).unzip();
        metrics::histogram!("mnemo_write_batch_rows").record(rows.len() as f64);
        match store.remember_many(&rows).await {
            Ok(results) => {
                for (reply, result) in replies.into_iter().zip(results) {
                    let _ = reply.send(result);
                }
            }
            // One row can fail a whole batch (a constraint, a deadlock); then each row is written
            // on its own, so only that row's request sees the error.
            Err(e) if rows.len() > 1 => {
                tracing::warn!(error = %e, rows = rows.len(), "batched write failed; writing its rows one by one");
                for (row, reply) in rows.iter().zip(replies) {
                    let _ = reply.send(store.remember(row).await);
                }
            }
            Err(e) => {
                if let Some(reply) = replies.into_iter().next() {
                    let _ = reply.send(Err(e));
                }
            }
        }
    }
}

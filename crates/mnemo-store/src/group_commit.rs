//! Group commit for writes. Concurrent requests hand their rows to a few committer tasks; each
//! takes whatever is waiting (up to a limit) and writes it in one transaction. A lone write goes
//! straight through, so nothing waits on a timer; under load, rows share a transaction, an fsync
//! and the job queue's notification lock instead of queueing for them one by one.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mnemo_core::NewMemory;
use tokio::sync::{Mutex, mpsc, oneshot};
use tracing::{Instrument, Span};

use crate::{HeldConnection, Remembered, Store, StoreError};

type Reply = oneshot::Sender<Result<Remembered, StoreError>>;

/// A row on its way to a committer, with when it was handed over and the span of the request
/// that wrote it.
type Pending = (NewMemory, Reply, Instant, Span);

/// A handle to the committers. Cheap to clone.
#[derive(Debug, Clone)]
pub struct GroupCommit {
    sender: mpsc::Sender<Pending>,
    totals: Arc<Totals>,
}

/// Running totals since the committers started, so a benchmark can show why a rate is what it
/// is: how many rows share a transaction, how long a row waits for a committer, and how long a
/// transaction takes.
#[derive(Debug, Default)]
struct Totals {
    transactions: AtomicU64,
    rows: AtomicU64,
    queued_micros: AtomicU64,
    transaction_micros: AtomicU64,
}

/// A copy of the committers' totals; subtract two to see one interval.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommitStats {
    pub transactions: u64,
    pub rows: u64,
    /// Summed over rows: from the hand-over to the start of the row's transaction.
    pub queued: Duration,
    /// Summed over commits: from the first statement to the end of the last (COMMIT, or the one
    /// statement that writes a group alone).
    pub in_transaction: Duration,
}

impl std::ops::Add for CommitStats {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            transactions: self.transactions + other.transactions,
            rows: self.rows + other.rows,
            queued: self.queued + other.queued,
            in_transaction: self.in_transaction + other.in_transaction,
        }
    }
}

impl std::ops::Sub for CommitStats {
    type Output = Self;

    fn sub(self, earlier: Self) -> Self {
        Self {
            transactions: self.transactions.saturating_sub(earlier.transactions),
            rows: self.rows.saturating_sub(earlier.rows),
            queued: self.queued.saturating_sub(earlier.queued),
            in_transaction: self.in_transaction.saturating_sub(earlier.in_transaction),
        }
    }
}

impl GroupCommit {
    /// Starts `committers` tasks, each writing up to `max_batch` rows per transaction, and
    /// giving up on a batch the database has not answered within `answer_within` (a connection
    /// a network dropped without a word: PostgreSQL's statement timeout cannot fire then). They
    /// stop when every handle is dropped.
    pub fn start(store: Store, committers: usize, max_batch: usize, answer_within: Duration) -> Self {
        let (sender, receiver) = mpsc::channel(committers * max_batch * 4);
        let receiver = Arc::new(Mutex::new(receiver));
        let totals = Arc::new(Totals::default());
        for _ in 0..committers.max(1) {
            let loop_ = commit_loop(store.clone(), receiver.clone(), max_batch.max(1), answer_within, totals.clone());
            tokio::spawn(loop_);
        }
        Self { sender, totals }
    }

    /// The totals so far.
    pub fn stats(&self) -> CommitStats {
        let t = &self.totals;
        CommitStats {
            transactions: t.transactions.load(Ordering::Relaxed),
            rows: t.rows.load(Ordering::Relaxed),
            queued: Duration::from_micros(t.queued_micros.load(Ordering::Relaxed)),
            in_transaction: Duration::from_micros(t.transaction_micros.load(Ordering::Relaxed)),
        }
    }

    /// Writes one row, with whichever others are waiting.
    pub async fn remember(&self, memory: NewMemory) -> Result<Remembered, StoreError> {
        let (reply, answer) = oneshot::channel();
        let pending = (memory, reply, Instant::now(), Span::current());
        self.sender.send(pending).await.map_err(|_| StoreError::ShuttingDown)?;
        answer.await.map_err(|_| StoreError::ShuttingDown)?
    }
}

async fn commit_loop(
    store: Store,
    receiver: Arc<Mutex<mpsc::Receiver<Pending>>>,
    max_batch: usize,
    answer_within: Duration,
    totals: Arc<Totals>,
) {
    let mut batch = Vec::with_capacity(max_batch);
    // The committer's own connection: a batch on it makes one round trip where one taken from
    // the pool would make three (the pool's liveness ping, naming the tenants, the statement).
    let mut held = HeldConnection::default();
    loop {
        {
            let mut receiver = receiver.lock().await;
            if receiver.recv_many(&mut batch, max_batch).await == 0 {
                return;
            }
        }
        let started = Instant::now();
        let queued: Duration = batch.iter().map(|(_, _, handed, _)| started - *handed).sum();
        let span = mnemo_config::batch_span("group commit", batch.iter().map(|(_, _, _, caller)| caller));
        let (mut rows, mut replies, mut callers) = (Vec::new(), Vec::new(), Vec::new());
        for (row, reply, _, caller) in batch.drain(..) {
            rows.push(row);
            replies.push(reply);
            callers.push(caller);
        }
        metrics::histogram!("mnemo_write_batch_rows").record(rows.len() as f64);
        let reused = held.is_held();
        let mut written = write(&store, &mut held, &rows, answer_within).instrument(span.clone()).await;
        // A kept connection the database dropped (a restart) fails at once, where the pool
        // would have pinged it and connected again: the batch is written once more on a fresh
        // one, which source_refs make safe.
        if reused && written.as_ref().is_err_and(StoreError::is_unavailable) {
            written = write(&store, &mut held, &rows, answer_within).instrument(span).await;
        }
        totals.transactions.fetch_add(1, Ordering::Relaxed);
        totals.rows.fetch_add(rows.len() as u64, Ordering::Relaxed);
        totals.queued_micros.fetch_add(queued.as_micros() as u64, Ordering::Relaxed);
        totals.transaction_micros.fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        match written {
            Ok(results) => {
                for (reply, result) in replies.into_iter().zip(results) {
                    let _ = reply.send(result);
                }
            }
            // The database out of reach or out of disk space fails every row alike, at once:
            // writing them one by one would make the last wait for one failure per row before it.
            // So does a statement past its timeout, most often the database too busy or a table
            // lock held elsewhere: written one by one, each row would wait out a timeout of its
            // own, with every write queued behind this committer. When one row alone waited (its
            // key held by a long transaction), the others fail with it: their clients write them
            // again (a write is idempotent), which is cheaper than a committer held for minutes.
            Err(e) if e.for_each_write().is_some() => {
                let failed = || e.for_each_write().expect("the database's failure");
                for reply in replies {
                    let _ = reply.send(Err(failed()));
                }
                // The rows queued while this batch waited out its timeout would each wait out one
                // of their own against the same database: they fail now with this batch, so no
                // write waits more than one timeout. (A committer holding the queue is taking a
                // batch of its own, which it tries.)
                if e.is_unavailable()
                    && let Ok(mut receiver) = receiver.try_lock()
                {
                    while let Ok((_, reply, _, _)) = receiver.try_recv() {
                        let _ = reply.send(Err(failed()));
                    }
                }
            }
            // One row can fail a whole batch (a constraint, a deadlock); then each row is written
            // on its own, so only that row's request sees the error.
            Err(e) if rows.len() > 1 => {
                tracing::warn!(error = %e, rows = rows.len(), "batched write failed; writing its rows one by one");
                for ((row, reply), caller) in rows.iter().zip(replies).zip(callers) {
                    let _ = reply.send(store.remember(row).instrument(caller).await);
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

/// One batch on the committer's connection, given up after `answer_within`: the connection is
/// then closed (its state is unknown), and the rows fail as with the database out of reach. A
/// batch that committed unseen is answered `was_new: false` when its clients write it again.
async fn write(
    store: &Store,
    held: &mut HeldConnection,
    rows: &[NewMemory],
    answer_within: Duration,
) -> Result<Vec<Result<Remembered, StoreError>>, StoreError> {
    match tokio::time::timeout(answer_within, store.remember_many_on(held, rows)).await {
        Ok(written) => written,
        Err(_) => {
            held.close();
            let waited = answer_within.as_secs_f64();
            Err(StoreError::Unavailable(format!("no answer from the database within {waited:.0} s")))
        }
    }
}

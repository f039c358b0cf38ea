//! Access tracking off the request path: a recall hands its row ids to a channel and returns;
//! one task gathers them per tenant and, once a second (or at 1,000 ids), queues one access job
//! per tenant. The job updates `last_accessed_at` and `access_count`; the recall statement never
//! writes. When the channel is full the ids are dropped and counted: tracking is best-effort,
//! recall is not. A server stopping asks for what it gathered to be queued at once.

use std::collections::HashMap;
use std::time::Duration;

use chrono::Utc;
use mnemo_core::TenantId;
use mnemo_store::Store;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

/// Recalls waiting to be gathered before new ones are dropped.
const CHANNEL: usize = 4096;
/// A tenant's ids are queued at the latest after this long...
const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// ...or once this many have gathered.
const MAX_BATCH: usize = 1000;

/// Rows a recall returned, or a request to queue what was gathered now (answered once done).
#[derive(Debug)]
enum Gathered {
    Rows(TenantId, Vec<Uuid>),
    Flush(oneshot::Sender<()>),
}

#[derive(Debug, Clone)]
pub(crate) struct AccessTracker {
    sender: mpsc::Sender<Gathered>,
}

impl AccessTracker {
    pub(crate) fn start(store: Store) -> Self {
        let (sender, receiver) = mpsc::channel(CHANNEL);
        tokio::spawn(gather(store, receiver));
        Self { sender }
    }

    pub(crate) fn record(&self, tenant: &TenantId, items: Vec<Uuid>) {
        // Counted in rows, as a batch that cannot be queued is (runbook: the accesses lost).
        let rows = items.len() as u64;
        if self.sender.try_send(Gathered::Rows(tenant.clone(), items)).is_err() {
            metrics::counter!("mnemo_recall_access_dropped_total").increment(rows);
        }
    }

    /// Queues what was gathered so far, and returns once it is queued.
    pub(crate) async fn flush(&self) {
        let (done, queued) = oneshot::channel();
        if self.sender.send(Gathered::Flush(done)).await.is_ok() {
            let _ = queued.await;
        }
    }
}

async fn gather(store: Store, mut receiver: mpsc::Receiver<Gathered>) {
    let mut pending: HashMap<TenantId, Vec<Uuid>> = HashMap::new();
    let mut timer = tokio::time::interval(FLUSH_EVERY);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            received = receiver.recv() => match received {
                None => break,
                Some(Gathered::Rows(tenant, items)) => {
                    let batch = pending.entry(tenant.clone()).or_default();
                    batch.extend(items);
                    if batch.len() >= MAX_BATCH {
                        let items = std::mem::take(batch);
                        queue(&store, &tenant, items).await;
                    }
                }
                Some(Gathered::Flush(done)) => {
                    queue_all(&store, &mut pending).await;
                    let _ = done.send(());
                }
            },
            _ = timer.tick() => queue_all(&store, &mut pending).await,
        }
    }
    queue_all(&store, &mut pending).await;
}

async fn queue_all(store: &Store, pending: &mut HashMap<TenantId, Vec<Uuid>>) {
    for (tenant, items) in pending.drain() {
        if !items.is_empty() {
            queue(store, &tenant, items).await;
        }
    }
}

async fn queue(store: &Store, tenant: &TenantId, items: Vec<Uuid>) {
    let count = items.len() as u64;
    if let Err(e) = store.queue_access(tenant, items, Utc::now()).await {
        tracing::warn!(error = %e, rows = count, "cannot queue an access batch; these accesses are not recorded");
        metrics::counter!("mnemo_recall_access_dropped_total").increment(count);
    }
}

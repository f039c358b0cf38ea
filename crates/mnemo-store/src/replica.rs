//! Reads from a streaming replica that never silently miss an acknowledged write. mnemo commits
//! synchronously, so every acknowledged commit lies within the primary's flushed WAL; once the
//! replica has replayed as far as the primary had flushed when a read began, the read sees every
//! write acknowledged before it. A replica still behind after a short wait is read anyway by
//! recall, which then answers `degraded`; reads that cannot say so go to the primary. A replica
//! that cannot be reached is skipped for a while and the primary serves every read.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;

use crate::{Store, StoreError};

/// How often a read waiting for the replica asks how far it has replayed.
const POLL: Duration = Duration::from_millis(2);

/// How long reads skip a replica that could not be reached before one tries it again.
const SKIP_FAILED_REPLICA: Duration = Duration::from_secs(5);

/// How long a read waits for a connection to the replica: past it, the primary answers.
const REPLICA_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(1);

/// Where reads go: the primary alone, or a streaming replica checked against it. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Reads {
    primary: Store,
    replica: Option<Arc<Replica>>,
}

#[derive(Debug)]
struct Replica {
    store: Store,
    wait: Duration,
    /// Set when the replica could not be reached (or is no standby): reads skip it until then.
    skip_until: Mutex<Option<Instant>>,
}

/// Where one read goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFrom {
    Primary,
    /// `lagging`: the replica had not replayed every acknowledged write when the wait ended (or
    /// the primary could not say how far its WAL goes).
    Replica {
        lagging: bool,
    },
}

impl Reads {
    /// Every read goes to `primary`.
    pub fn primary(primary: Store) -> Self {
        Self { primary, replica: None }
    }

    /// Reads go to the replica at `url` once it has caught up, waiting at most `wait` for it.
    /// Connecting is lazy, so a replica that is down at start-up does not stop the caller; a URL
    /// that does not parse does.
    /// With `statement_timeout`, each statement on the replica is cancelled past it, as on the
    /// API's primary connections ([`Store::connect_bounded`]).
    pub fn with_replica(
        self,
        url: &str,
        max_connections: u32,
        wait: Duration,
        statement_timeout: Option<Duration>,
    ) -> Result<Self, StoreError> {
        let options: PgConnectOptions = url.parse().map_err(StoreError::Config)?;
        let options = match statement_timeout {
            Some(limit) => crate::bounded(options, limit),
            None => options,
        };
        // Connecting is lazy, so whether row-level security holds the role is not known:
        // assume it does (naming tenants costs the owner nothing but a statement).
        let store =
            Store::lazy(&options.application_name("mnemo-read"), max_connections, true, REPLICA_ACQUIRE_TIMEOUT);
        let replica = Replica { store, wait, skip_until: Mutex::new(None) };
        Ok(Self { replica: Some(Arc::new(replica)), ..self })
    }

    pub fn primary_store(&self) -> &Store {
        &self.primary
    }

    pub fn replica_store(&self) -> Option<&Store> {
        self.replica.as_ref().map(|r| &r.store)
    }

    /// Where a read that may answer incomplete should go: the replica, lagging or not, unless it
    /// cannot be reached.
    pub async fn route(&self) -> ReadFrom {
        let Some(replica) = &self.replica else { return ReadFrom::Primary };
        let route = replica.route(&self.primary).await;
        // What each read found; a lagging replica serves recall, the primary everything else.
        let replica = match route {
            ReadFrom::Primary => "unreachable",
            ReadFrom::Replica { lagging: false } => "caught_up",
            ReadFrom::Replica { lagging: true } => "lagging",
        };
        metrics::counter!("mnemo_replica_reads_total", "replica" => replica).increment(1);
        route
    }

    /// A store holding every acknowledged write: the replica if it caught up within the wait,
    /// otherwise the primary.
    pub async fn complete(&self) -> &Store {
        match (self.route().await, &self.replica) {
            (ReadFrom::Replica { lagging: false }, Some(replica)) => &replica.store,
            _ => &self.primary,
        }
    }
}

impl Replica {
    async fn route(&self, primary: &Store) -> ReadFrom {
        if self.skip_until.lock().expect("poisoned").is_some_and(|until| Instant::now() < until) {
            return ReadFrom::Primary;
        }
        let target = primary.flushed_wal().await;
        let deadline = Instant::now() + self.wait;
        loop {
            let replayed = match self.store.replayed_wal().await {
                Ok(Some(replayed)) => replayed,
                Ok(None) => return self.skip("it is not a standby (it may have been promoted)"),
                Err(e) => return self.skip(&e.to_string()),
            };
            match &target {
                Ok(target) if replayed >= *target => {
                    *self.skip_until.lock().expect("poisoned") = None;
                    return ReadFrom::Replica { lagging: false };
                }
                Ok(_) if Instant::now() < deadline => tokio::time::sleep(POLL).await,
                // Behind after the wait, or the primary cannot say where its WAL ends.
                _ => return ReadFrom::Replica { lagging: true },
            }
        }
    }

    fn skip(&self, why: &str) -> ReadFrom {
        tracing::warn!(
            reason = why,
            "reads skip the replica for {} s; the primary serves them",
            SKIP_FAILED_REPLICA.as_secs()
        );
        *self.skip_until.lock().expect("poisoned") = Some(Instant::now() + SKIP_FAILED_REPLICA);
        ReadFrom::Primary
    }
}

impl Store {
    /// Where the primary's flushed WAL ends, in bytes: every acknowledged commit lies before it.
    pub async fn flushed_wal(&self) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar("SELECT (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::bigint")
            .fetch_one(&self.pool)
            .await?)
    }

    /// How far a standby has replayed the primary's WAL, in bytes; `None` on a server that is not
    /// in recovery.
    pub async fn replayed_wal(&self) -> Result<Option<i64>, StoreError> {
        Ok(sqlx::query_scalar("SELECT (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::bigint")
            .fetch_one(&self.pool)
            .await?)
    }
}

//! All of mnemo's SQL. The schema lives in `migrations/` and is applied by [`MIGRATOR`] (mnemo's
//! tables and apalis' job tables together); everything else is a typed method on [`Store`].
//! Every query that touches tenant data filters by the tenant it is given, and that tenant
//! always comes from an authenticated principal.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// When a memory was last of use, for its decay: its last recall or, never recalled, its
/// `event_time`, but its write at the latest (a fact dated ahead does not stay fresh until its
/// day). Fading's and forgetting's indexes are on this expression (migration 51).
macro_rules! decay_clock {
    () => {
        "COALESCE(last_accessed_at, LEAST(event_time, created_at))"
    };
}

/// The sha256 (hex) of the user id `$column` (SQL of text): how an erasure's audit row, a
/// compaction's participants and a reply's mark (migration 54) name a user, as
/// `UserId::sha256` computes it.
macro_rules! user_sha256 {
    ($column:literal) => {
        concat!("encode(sha256(convert_to(", $column, ", 'UTF8')), 'hex')")
    };
}

/// Whether user `$3` carries a row of tenant `$1`'s session `$2` (their erasure takes them all).
/// `scope = 'session'`, which a session's rows always have, lets the session's partial indexes
/// bound the scan to the session (the user's index would read all of their rows in the tenant).
macro_rules! user_in_session {
    () => {
        "EXISTS (SELECT 1 FROM memory_items WHERE tenant_id = $1 AND scope = 'session' AND session_id = $2 AND user_id = $3)"
    };
}

mod bulk;
mod consolidation;
mod conversation;
mod database;
mod embeddings;
mod error;
mod extraction;
mod group_commit;
mod judge;
mod maintenance;
mod memories;
mod ops;
mod portability;
pub mod queue;
mod replica;
mod retention;
mod schema;
mod search;
mod time_zone;
mod typed;
mod workspace;

pub use bulk::{BulkRow, DroppedIndex, Footprint, PlainInserts};
pub use consolidation::{ChangedNote, ConsolidationClaim, ConsolidationRequest};
pub use conversation::{
    Compaction, MessageCursor, NewCompaction, PendingCompaction, Recording, STALE_REQUEST, SessionMessage,
    SessionState, SessionSummary, spoken_by,
};
pub use database::{
    FreshDatabase, create_database, create_empty_database, drop_database, move_database, with_database,
};
pub use embeddings::{EmbedFailure, NewVector, RowToEmbed};
pub use error::StoreError;
pub use extraction::{Claim, ExtractionChanges, MemoryStatus, PendingExtraction};
pub use group_commit::{CommitStats, GroupCommit};
pub use judge::{
    BatchRecord, BatchStats, Candidate, ClearSelection, ClearedFact, FactRecord, FailOpenFact, JudgeStatus, Judgement,
    PendingFact, Retire, SupersedeIntegrity,
};
pub use maintenance::Maintained;
pub use memories::{Remembered, ToolOutputWindow};
pub use ops::{Delivery, EmbedBacklog, Housekeeping, QueueStatus, WorkerStatus};
pub use portability::{ERASURES, EXPORT_TABLES, Export, Import, ImportError, ImportReport, OwnErasures};
pub use replica::{ReadFrom, Reads};
pub use retention::{AuditEntry, AuditFilter, Cutoffs, Deleted, ErasurePlan, FileCursor, SweepPlan};
pub use schema::{MIGRATOR, Migrations, SchemaStatus};
pub use search::{CommonLexemes, Ranked, RecalledRow, Search, SearchScope};
pub use sqlx::PgPool;
pub use workspace::{DEFAULT_SORT_ORDER, Edited, FileMeta, FileVersion, Replacement, Restored, WorkspaceFile, Written};

/// The database behind mnemo. Cheap to clone: it is a handle to connection pools.
#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    /// For a role row-level security holds (not the tables' owner, a superuser or BYPASSRLS):
    /// the connections [`Store::tenant_connection`] names tenants on. Nothing else takes them,
    /// so no tenant is ever named on `pool`, and a statement there sees no tenant's rows.
    named: Option<PgPool>,
}

/// `options` with each statement cancelled by PostgreSQL past `statement_timeout`.
pub(crate) fn bounded(options: PgConnectOptions, statement_timeout: Duration) -> PgConnectOptions {
    options.options([("statement_timeout", statement_timeout.as_millis().to_string())])
}

/// How long a connection may sit in an open transaction with no statement running before
/// PostgreSQL ends it: a worker or server whose host died (no socket closed) would otherwise hold
/// its locks (a tenant's text counts, a user's files) until TCP gives up, hours later. Every
/// transaction of mnemo's runs its statements back to back (no model call inside one), so this
/// only ends the dead; ten minutes leaves room for an export written to a slow pipe.
const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(600);

/// The session setting row-level security reads (migration 029): a text[] literal.
const TENANTS_SETTING: &str = "mnemo.tenants";

impl Store {
    /// A store on `pool`, whose role row-level security must not hold (the tables' owner, as in
    /// tests and benchmarks): it names no tenant on its connections.
    pub fn new(pool: PgPool) -> Self {
        Self { pool, named: None }
    }

    /// Opens a pool of at most `max_connections`. Connecting is lazy past the first connection,
    /// which is made here so that a wrong URL or password fails at start-up rather than on the
    /// first request, and which asks whether row-level security holds the role. If it does, the
    /// pool is the one tenants are named on, and a quarter as many (at least 2) serve what names
    /// none (job pushes, WAL positions, catalog reads).
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        Self::connect_with(url.parse().map_err(StoreError::Config)?, max_connections).await
    }

    /// Like [`Store::connect`], with each statement cancelled by PostgreSQL past
    /// `statement_timeout`: the API's, so that a request whose client gave up (or a lock that is
    /// not let go) does not hold a connection for as long as its statement would run.
    pub async fn connect_bounded(
        url: &str,
        max_connections: u32,
        statement_timeout: Duration,
    ) -> Result<Self, StoreError> {
        let options: PgConnectOptions = url.parse().map_err(StoreError::Config)?;
        Self::connect_with(bounded(options, statement_timeout), max_connections).await
    }

    async fn connect_with(options: PgConnectOptions, max_connections: u32) -> Result<Self, StoreError> {
        let options = options.application_name("mnemo");
        let mut first = sqlx::ConnectOptions::connect(&options).await?;
        let walled = !role_bypasses_wall(&mut first, None).await?.unwrap_or(false);
        sqlx::Connection::close(first).await?;
        Ok(Self::lazy(&options, max_connections, walled, Duration::from_secs(5)))
    }

    /// Pools that connect when first used, named ones if `walled`; the primary's and a replica's.
    pub(crate) fn lazy(options: &PgConnectOptions, max: u32, walled: bool, acquire_timeout: Duration) -> Self {
        let options = &options
            .clone()
            .options([("idle_in_transaction_session_timeout", IDLE_IN_TRANSACTION.as_millis().to_string())]);
        let pool = |max| PgPoolOptions::new().max_connections(max).acquire_timeout(acquire_timeout);
        if !walled {
            return Self { pool: pool(max).connect_lazy_with(options.clone()), named: None };
        }
        Self {
            pool: pool(max.div_ceil(4).max(2)).connect_lazy_with(options.clone()),
            named: Some(pool(max).connect_lazy_with(options.clone())),
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether row-level security holds this store's role: false for the owner's role that
    /// workers and the runbook use, true for the API's (ARCHITECTURE.md, "Two roles").
    pub fn walled(&self) -> bool {
        self.named.is_some()
    }

    /// Whether the database answers at all.
    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// A connection whose statements see and write the rows of `tenants` only, under row-level
    /// security: the second wall, behind each statement's own tenant filter. The tenants are
    /// named on the connection, before any statement or transaction on it; the next checkout
    /// of the same connection names its own, as every checkout of these connections does.
    pub(crate) async fn tenant_connection<'a>(
        &self,
        tenants: impl IntoIterator<Item = &'a str>,
    ) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, StoreError> {
        let Some(named) = &self.named else { return Ok(self.pool.acquire().await?) };
        let mut conn = named.acquire().await?;
        name_tenants(&mut conn, &tenant_set(tenants)).await?;
        Ok(conn)
    }

    /// [`Store::tenant_connection`] for a task that keeps its connection between uses (a group
    /// committer): the first use takes it from the pool, later ones skip the pool's liveness ping,
    /// and the tenants are named again only when they differ from the last use's. Naming is
    /// always exactly `tenants`, never a superset.
    pub(crate) async fn held_connection<'h, 'a>(
        &self,
        held: &'h mut HeldConnection,
        tenants: impl IntoIterator<Item = &'a str>,
    ) -> Result<&'h mut sqlx::PgConnection, StoreError> {
        let tenants = tenant_set(tenants);
        // Given back now and then, as the pool retires its own connections (sqlx's default
        // max_lifetime), so a server-side backend does not live as long as the server; and after
        // a quiet spell, so the pool pings it before it is used again (a firewall may have
        // dropped an idle connection without a word).
        let now = std::time::Instant::now();
        if held.conn.as_ref().is_some_and(|(_, taken)| taken.elapsed() > HELD_FOR)
            || held.used.is_some_and(|used| now - used > HELD_IDLE)
        {
            held.release();
        }
        held.used = Some(now);
        let (conn, _) = match held.conn.take() {
            Some(kept) => held.conn.insert(kept),
            // Nothing is named on a connection not yet held: `release` forgets both together.
            None => {
                let conn = self.named.as_ref().unwrap_or(&self.pool).acquire().await?;
                held.conn.insert((conn, std::time::Instant::now()))
            }
        };
        if self.named.is_some() && held.named != tenants {
            held.named.clear();
            name_tenants(conn, &tenants).await?;
            held.named = tenants.into_iter().map(str::to_owned).collect();
        }
        Ok(conn)
    }
}

/// How long a task keeps one connection ([`Store::held_connection`]), and how long unused.
const HELD_FOR: Duration = Duration::from_secs(30 * 60);
const HELD_IDLE: Duration = Duration::from_secs(60);

/// A connection kept by one task between uses, with the tenants last named on it
/// ([`Store::held_connection`]). Dropping it, or [`HeldConnection::release`], returns it to the pool.
#[derive(Debug, Default)]
pub(crate) struct HeldConnection {
    /// The connection, and when it was taken from the pool.
    conn: Option<(sqlx::pool::PoolConnection<sqlx::Postgres>, std::time::Instant)>,
    named: Vec<String>,
    /// When it was last used.
    used: Option<std::time::Instant>,
}

impl HeldConnection {
    /// Gives the connection back, as after an error that may have left it broken or mid-way.
    pub(crate) fn release(&mut self) {
        self.conn = None;
        self.named.clear();
    }

    /// Closes the connection rather than giving it back: a statement on it was abandoned, and
    /// neither its transaction nor its socket can be trusted.
    pub(crate) fn close(&mut self) {
        if let Some((conn, _)) = self.conn.take() {
            drop(conn.detach());
        }
        self.named.clear();
    }

    /// Whether the next use reuses a connection an earlier use took (and the pool did not ping).
    pub(crate) fn is_held(&self) -> bool {
        self.conn.is_some()
    }
}

/// `tenants` sorted and without repeats, as they are named and compared.
fn tenant_set<'a>(tenants: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let mut tenants: Vec<&str> = tenants.into_iter().collect();
    tenants.sort_unstable();
    tenants.dedup();
    tenants
}

/// Names `tenants` (sorted, without repeats) on `conn` for row-level security, replacing what
/// was named before.
async fn name_tenants(conn: &mut sqlx::PgConnection, tenants: &[&str]) -> Result<(), StoreError> {
    sqlx::query("SELECT set_config($1, $2::text[]::text, false)")
        .bind(TENANTS_SETTING)
        .bind(tenants)
        .execute(conn)
        .await?;
    Ok(())
}

/// Whether `role` (the connection's own when `None`) is not held by row-level security on
/// mnemo's tables: a superuser, a BYPASSRLS role, or (the policies not being forced) a member of
/// the owner's role. Before the first migration nobody owns them yet, and the answer is no.
/// `None` when there is no such role.
pub(crate) async fn role_bypasses_wall(
    conn: &mut sqlx::PgConnection,
    role: Option<&str>,
) -> Result<Option<bool>, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT r.rolsuper OR r.rolbypassrls
                OR coalesce((SELECT pg_has_role(r.oid, c.relowner, 'USAGE') FROM pg_class c
                             WHERE c.oid = to_regclass('memory_items')), false)
         FROM pg_roles r WHERE r.rolname = coalesce($1, current_user)",
    )
    .bind(role)
    .fetch_optional(conn)
    .await?)
}

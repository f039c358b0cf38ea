//! All of mnemo's SQL. The schema lives in `migrations/` and is applied by [`MIGRATOR`] (mnemo's
//! tables and apalis' job tables together); everything else is a typed method on [`Store`].
//! Every query that touches tenant data filters by the tenant it is given, and that tenant
//! always comes from an authenticated principal.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

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
pub use consolidation::ChangedNote;
pub use conversation::{
    Compaction, MessageCursor, NewCompaction, PendingCompaction, STALE_REQUEST, SessionMessage, SessionState,
    SessionSummary,
};
pub use database::{FreshDatabase, create_database, move_database, with_database};
pub use embeddings::{NewVector, RowToEmbed};
pub use error::StoreError;
pub use extraction::{Claim, ExtractionChanges, MemoryStatus, PendingExtraction};
pub use group_commit::{CommitStats, GroupCommit};
pub use judge::{
    BatchRecord, BatchStats, Candidate, ClearSelection, FactRecord, FailOpenFact, JudgeStatus, Judgement, PendingFact,
    SupersedeIntegrity,
};
pub use maintenance::Maintained;
pub use memories::{Remembered, ToolOutput};
pub use ops::{Delivery, EmbedBacklog, Housekeeping, QueueStatus, WorkerStatus};
pub use portability::{EXPORT_TABLES, Import, ImportError, ImportReport};
pub use replica::{ReadFrom, Reads};
pub use retention::{AuditEntry, AuditFilter, Cutoffs, Deleted, ErasurePlan, SweepPlan};
pub use schema::{MIGRATOR, Migrations, SchemaStatus};
pub use search::{CommonLexemes, Ranked, RecalledRow, Search, SearchScope};
pub use sqlx::PgPool;
pub use workspace::{DEFAULT_SORT_ORDER, Edited, FileMeta, FileVersion, Replacement, WorkspaceFile, Written};

/// The database behind mnemo. Cheap to clone: it is a handle to a connection pool.
#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    /// Whether row-level security holds this pool's role (it is not the tables' owner, a
    /// superuser, or BYPASSRLS), so that a connection used for a tenant must name it.
    walled: bool,
}

/// The session setting row-level security reads (migration 029): a text[] literal.
const TENANTS_SETTING: &str = "mnemo.tenants";

impl Store {
    /// A store on `pool`, which names the tenants on every connection it uses for one.
    pub fn new(pool: PgPool) -> Self {
        Self { pool, walled: true }
    }

    /// Opens a pool. Connecting is lazy past the first connection, which is made here so that a
    /// wrong URL or password fails at start-up rather than on the first request, and which asks
    /// whether row-level security holds the role.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let options: PgConnectOptions = url.parse().map_err(StoreError::Config)?;
        let options = options.application_name("mnemo");
        let mut first = sqlx::ConnectOptions::connect(&options).await?;
        let walled = !role_bypasses_wall(&mut first).await?;
        sqlx::Connection::close(first).await?;
        let pool =
            pool_options(max_connections, walled).acquire_timeout(Duration::from_secs(5)).connect_lazy_with(options);
        Ok(Self { pool, walled })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether row-level security holds this store's role: false for the owner's role that
    /// workers and the runbook use, true for the API's (ARCHITECTURE.md, "Two roles").
    pub fn walled(&self) -> bool {
        self.walled
    }

    /// Whether the database answers at all.
    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// A connection whose statements see and write the rows of `tenants` only, under row-level
    /// security: the second wall, behind each statement's own tenant filter. The setting lasts
    /// until the connection goes back to the pool, which resets it (see [`pool_options`]), so
    /// it covers a transaction begun on the connection as well as statements outside one.
    pub(crate) async fn tenant_connection<'a>(
        &self,
        tenants: impl IntoIterator<Item = &'a str>,
    ) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, StoreError> {
        let mut conn = self.pool.acquire().await?;
        if self.walled {
            let mut tenants: Vec<&str> = tenants.into_iter().collect();
            tenants.sort_unstable();
            tenants.dedup();
            sqlx::query("SELECT set_config($1, $2::text[]::text, false)")
                .bind(TENANTS_SETTING)
                .bind(tenants)
                .execute(&mut *conn)
                .await?;
        }
        Ok(conn)
    }
}

/// Pool options for a role that row-level security holds (`walled`): the tenants a checkout
/// named are forgotten when the connection comes back, before anyone else can take it, so a
/// statement on a connection nobody named a tenant on sees no tenant's rows.
pub(crate) fn pool_options(max_connections: u32, walled: bool) -> PgPoolOptions {
    let options = PgPoolOptions::new().max_connections(max_connections);
    if !walled {
        return options;
    }
    options.after_release(|conn, _| {
        Box::pin(async move {
            sqlx::Executor::execute(conn, "RESET mnemo.tenants").await?;
            Ok(true)
        })
    })
}

/// Whether the connection's role is not held by row-level security on mnemo's tables: a
/// superuser, a BYPASSRLS role, or (the policies not being forced) a member of the owner's role.
/// Before the first migration nobody owns them yet, and the answer is no.
async fn role_bypasses_wall(conn: &mut sqlx::PgConnection) -> Result<bool, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT r.rolsuper OR r.rolbypassrls
                OR coalesce((SELECT pg_has_role(c.relowner, 'USAGE') FROM pg_class c
                             WHERE c.oid = to_regclass('memory_items')), false)
         FROM pg_roles r WHERE r.rolname = current_user",
    )
    .fetch_one(conn)
    .await?)
}

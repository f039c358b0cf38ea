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
}

impl Store {
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// Opens a pool. Connecting is lazy past the first connection, which is made here so that a
    /// wrong URL or password fails at start-up rather than on the first request.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let options: PgConnectOptions = url.parse().map_err(StoreError::Config)?;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.application_name("mnemo"))
            .await?;
        Ok(Self { pool })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether the database answers at all.
    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }
}

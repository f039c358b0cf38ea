use uuid::Uuid;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The source_ref already names a row with different content; nothing was written.
    #[error("source_ref already holds different content (row {existing})")]
    SourceRefConflict { existing: Uuid },
    /// The source_ref names a row that was deleted; it is not brought back.
    #[error("source_ref names a deleted row ({existing})")]
    SourceRefDeleted { existing: Uuid },
    /// A model's replacement for a file was made from a version that is no longer current
    /// (someone changed the file during the model call); nothing was written.
    #[error("{path} changed after it was read")]
    FileChanged { path: String },
    /// A relation names a memory that is not a live row of the writer's tenant; nothing was
    /// written.
    #[error("relation target {target} is not a memory of this tenant")]
    RelationTargetMissing { target: Uuid },
    /// The memory would hold more than [`mnemo_core::MAX_RELATIONS`] relations (`relations`,
    /// those it holds and the new ones); nothing was written.
    #[error("the memory would hold {relations} relations")]
    TooManyRelations { relations: usize },
    /// The workspace file version asked for had its text redacted by retention, at `at`.
    #[error("version {version} was redacted by retention at {at}: its text is gone")]
    VersionRedacted { version: i32, at: chrono::DateTime<chrono::Utc> },
    /// This worker's run (an extraction's or a consolidation's) was taken over by another
    /// worker, having been held past the stale limit: nothing it did was kept.
    #[error("the run was taken over by another worker")]
    RunLost,
    /// Another row of an all-or-nothing write failed, so this one was not written.
    #[error("not written: another row of the batch was refused")]
    RolledBack,
    #[error("invalid database URL: {0}")]
    Config(#[source] sqlx::Error),
    /// An operator's request the store refuses, changing nothing; the text says why.
    #[error("{0}")]
    Refused(String),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("job queue error: {0}")]
    Queue(#[from] apalis_postgres::Error),
    #[error("the store is shutting down")]
    ShuttingDown,
    /// The database could not be reached, or was shutting down or starting, for a write that
    /// shared its commit with others: the same for each of them.
    #[error("the database is unavailable: {0}")]
    Unavailable(String),
    /// A statement of a commit this write shared with others ran past its timeout (or was
    /// cancelled): the same for each of them.
    #[error("a database statement was cancelled: {0}")]
    Cancelled(String),
    /// The database is out of disk space, for a write that shared its commit with others: the
    /// same for each of them.
    #[error("the database is out of disk space: {0}")]
    StorageFull(String),
    /// A value read back from the database no longer parses as its domain type.
    #[error("a stored value is invalid: {0}")]
    Stored(#[from] mnemo_core::InvalidInput),
    #[error("job arguments could not be encoded: {0}")]
    Encode(#[from] serde_json::Error),
}

impl StoreError {
    /// Whether the database was out of reach (down, restarting, no connection within the pool's
    /// timeout) rather than refusing this request: the same request may succeed once it is back.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::ShuttingDown) || self.sqlx().is_some_and(database_unavailable)
    }

    /// Whether PostgreSQL cancelled the statement (SQLSTATE 57014): it ran past its
    /// `statement_timeout`, or was cancelled by an operator.
    pub fn is_cancelled(&self) -> bool {
        matches!(self, Self::Cancelled(_))
            || matches!(self.sqlx(), Some(sqlx::Error::Database(e)) if e.code().as_deref() == Some("57014"))
    }

    /// Whether the database refused the write for want of disk space (SQLSTATE 53100): nothing
    /// was written, and the same write succeeds once an operator frees space.
    pub fn is_storage_full(&self) -> bool {
        matches!(self, Self::StorageFull(_))
            || matches!(self.sqlx(), Some(sqlx::Error::Database(e)) if e.code().as_deref() == Some("53100"))
    }

    /// The same failure for each write of a commit many shared, when it is the database's and not
    /// any one row's: out of disk space, out of reach, or a statement past its timeout. `None`
    /// otherwise (a row may be to blame: its writes are tried again apart).
    pub fn for_each_write(&self) -> Option<Self> {
        let cause = || self.to_string();
        if self.is_storage_full() {
            Some(Self::StorageFull(cause()))
        } else if self.is_unavailable() {
            Some(Self::Unavailable(cause()))
        } else if self.is_cancelled() {
            Some(Self::Cancelled(cause()))
        } else {
            None
        }
    }

    /// Whether the same statement over the same rows would be refused the same way again: the
    /// database refused what it says (a value, a constraint, a missing column or privilege:
    /// SQLSTATE classes 22, 23, 42 and 0A), or a value does not encode or decode. Not a lost
    /// connection, a full disk, a deadlock or a serialization failure, nor a unique or exclusion
    /// violation (a race another write won), which pass.
    pub fn is_permanent(&self) -> bool {
        match self {
            Self::Stored(_) | Self::Encode(_) | Self::Config(_) | Self::Migrate(_) => true,
            _ => self.sqlx().is_some_and(|e| match e {
                sqlx::Error::Database(d) => d.code().is_some_and(|c| {
                    ["22", "23", "42", "0A"].iter().any(|class| c.starts_with(class))
                        && !["23505", "23P01"].contains(&&*c)
                }),
                sqlx::Error::ColumnDecode { .. }
                | sqlx::Error::Decode(_)
                | sqlx::Error::ColumnNotFound(_)
                | sqlx::Error::TypeNotFound { .. }
                | sqlx::Error::Encode(_) => true,
                _ => false,
            }),
        }
    }

    /// Whether the database refused a value the statement carried (SQLSTATE classes 22 and 23,
    /// but a race another write won): the same values would be refused again. Unlike
    /// [`Self::is_permanent`], not a statement the schema or a privilege refuses, which a deploy
    /// may mend.
    pub fn is_refused_value(&self) -> bool {
        self.sqlx()
            .and_then(|e| e.as_database_error())
            .and_then(|d| d.code())
            .is_some_and(|c| (c.starts_with("22") || c.starts_with("23")) && !["23505", "23P01"].contains(&&*c))
    }

    /// The database's own error, from a statement or from the job queue.
    fn sqlx(&self) -> Option<&sqlx::Error> {
        match self {
            Self::Database(e) | Self::Queue(apalis_postgres::Error::Database(e)) => Some(e),
            _ => None,
        }
    }
}

fn database_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => true,
        // admin_shutdown, crash_shutdown, cannot_connect_now (57P…); the connection failures of
        // class 08 (not its protocol violation, 08P01); too many connections; a primary turned
        // read-only (a failover under way).
        sqlx::Error::Database(e) => e.code().is_some_and(|code| {
            code.starts_with("57P") || ["08000", "08001", "08003", "08004", "08006", "53300", "25006"].contains(&&*code)
        }),
        _ => false,
    }
}

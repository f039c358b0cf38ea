use apalis_postgres::PostgresStorage;
use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::StoreError;

/// The whole schema: mnemo's own migrations (`migrations/`, history in `_sqlx_migrations`) and
/// apalis' job tables (schema `apalis`, history in `apalis._sqlx_migrations`). The server, the
/// runbook's `migrate` and the tests all apply it through [`MIGRATOR`].
#[derive(Debug)]
pub struct Migrations {
    own: Migrator,
}

pub static MIGRATOR: Migrations = Migrations { own: sqlx::migrate!("../../migrations") };

/// How far a database is from the schema this build expects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaStatus {
    /// Versions this build knows that the database has not applied (mnemo's, then apalis').
    pub pending: Vec<i64>,
    /// Versions the database has applied that this build does not know: a newer build migrated
    /// it, and this one should not serve.
    pub unknown: Vec<i64>,
}

impl SchemaStatus {
    pub fn is_current(&self) -> bool {
        self.pending.is_empty() && self.unknown.is_empty()
    }
}

impl Migrations {
    /// Applies whatever is missing. Safe to run from several processes at once: each migrator
    /// holds an advisory lock while it works.
    pub async fn run(&self, pool: &PgPool) -> Result<(), StoreError> {
        PostgresStorage::<()>::setup(pool).await?;
        self.own.run(pool).await?;
        Ok(())
    }

    pub async fn status(&self, pool: &PgPool) -> Result<SchemaStatus, StoreError> {
        let mut status = SchemaStatus { pending: Vec::new(), unknown: Vec::new() };
        let apalis = PostgresStorage::<()>::migrations();
        for (migrator, applied_sql) in [
            (&self.own, "SELECT version FROM _sqlx_migrations WHERE success"),
            (&apalis, "SELECT version FROM apalis._sqlx_migrations WHERE success"),
        ] {
            let applied: Vec<i64> = match sqlx::query_scalar(applied_sql).fetch_all(pool).await {
                Ok(versions) => versions,
                // No history table yet: nothing applied.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => Vec::new(),
                Err(e) => return Err(e.into()),
            };
            let known: Vec<i64> =
                migrator.iter().filter(|m| m.migration_type.is_up_migration()).map(|m| m.version).collect();
            status.pending.extend(known.iter().filter(|v| !applied.contains(v)));
            status.unknown.extend(applied.iter().filter(|v| !known.contains(v)));
        }
        Ok(status)
    }
}

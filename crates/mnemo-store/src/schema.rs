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
    /// it (migrate, then deploy): this one keeps serving and working, and `migrate` refuses.
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

    /// Applies apalis' tables and mnemo's migrations only through `version`: the schema an earlier
    /// build left, for checking what a later migration does to a database that build filled.
    pub async fn run_through(&self, pool: &PgPool, version: i64) -> Result<(), StoreError> {
        PostgresStorage::<()>::setup(pool).await?;
        let through: Vec<_> = self.own.iter().filter(|m| m.version <= version).cloned().collect();
        Migrator { migrations: through.into(), ..Migrator::DEFAULT }.run(pool).await?;
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

    /// The name of migration `version` (its file's, words separated by spaces), mnemo's or
    /// apalis'; `None` for a version this build does not know.
    pub fn description(&self, version: i64) -> Option<String> {
        let apalis = PostgresStorage::<()>::migrations();
        [&self.own, &apalis]
            .into_iter()
            .flat_map(|migrator| migrator.iter())
            .find(|m| m.version == version && m.migration_type.is_up_migration())
            .map(|m| m.description.to_string())
    }
}

impl crate::Store {
    /// Lets `role`, the API's (ARCHITECTURE.md, "Two roles"), use mnemo's tables in this
    /// database: now, and those later migrations make (run as this store's role, their owner).
    /// It may read the migration history but not write it. Refused, granting nothing, when the
    /// role is a superuser, BYPASSRLS or a member of the owner's role: row-level security would
    /// not hold it. Running it again changes nothing.
    pub async fn grant_app_role(&self, role: &str) -> Result<(), StoreError> {
        let refuse = StoreError::Refused;
        let plain = role.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c == '_')
            && role.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !plain {
            return Err(refuse(format!("role {role:?} is not a plain lower-case identifier")));
        }
        let bypasses = crate::role_bypasses_wall(&mut *self.pool().acquire().await?, Some(role)).await?;
        match bypasses {
            None => return Err(refuse(format!("role {role:?} does not exist"))),
            Some(true) => {
                return Err(refuse(format!(
                    "role {role:?} is a superuser, BYPASSRLS or a member of the tables' owner: \
                     row-level security would not hold it"
                )));
            }
            Some(false) => {}
        }
        let schema: String = sqlx::query_scalar("SELECT quote_ident(current_schema())").fetch_one(self.pool()).await?;
        let schemas = format!("{schema}, apalis");
        let sql = format!(
            "GRANT USAGE ON SCHEMA {schemas} TO {role};
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schemas} TO {role};
             GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schemas} TO {role};
             REVOKE INSERT, UPDATE, DELETE ON _sqlx_migrations, apalis._sqlx_migrations FROM {role};
             ALTER DEFAULT PRIVILEGES IN SCHEMA {schemas} GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {role};
             ALTER DEFAULT PRIVILEGES IN SCHEMA {schemas} GRANT USAGE, SELECT ON SEQUENCES TO {role};"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(self.pool()).await?;
        Ok(())
    }
}

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

use crate::{MIGRATOR, StoreError};

/// A database made by [`create_database`].
#[derive(Debug)]
pub struct FreshDatabase {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

/// A new, empty database on the server behind `admin_url`, with the whole schema applied. Tests
/// and benchmarks each work in one of their own. `prefix` must be a plain identifier.
pub async fn create_database(admin_url: &str, prefix: &str, max_connections: u32) -> Result<FreshDatabase, StoreError> {
    let (name, url) = create_empty_database(admin_url, prefix).await?;
    let pool = PgPoolOptions::new().max_connections(max_connections).connect(&url).await?;
    MIGRATOR.run(&pool).await?;
    Ok(FreshDatabase { name, url, pool })
}

/// A new database with no schema at all (as `make run` finds its own the first time): its name
/// and URL. `prefix` must be a plain identifier.
pub async fn create_empty_database(admin_url: &str, prefix: &str) -> Result<(String, String), StoreError> {
    let admin: PgConnectOptions = admin_url.parse().map_err(StoreError::Config)?;
    let name = format!("{prefix}_{}", &uuid::Uuid::new_v4().simple().to_string()[..16]);
    let mut conn = admin.connect().await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&mut conn).await?;
    let url = with_database(admin_url, &name);
    Ok((name, url))
}

/// Drops the database `name` (a plain identifier, as [`create_empty_database`] makes),
/// ending the sessions connected to it that `admin_url`'s role may end.
pub async fn drop_database(admin_url: &str, name: &str) -> Result<(), StoreError> {
    let admin: PgConnectOptions = admin_url.parse().map_err(StoreError::Config)?;
    let mut conn = admin.connect().await?;
    let sql = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await?;
    Ok(())
}

/// Moves a database made by [`create_database`] (its pool closed) into `tablespace`, such as one
/// on a small filesystem for the disk-full fault. `tablespace` must be a plain identifier.
pub async fn move_database(admin_url: &str, database: &FreshDatabase, tablespace: &str) -> Result<(), StoreError> {
    let plain = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !plain(tablespace) {
        return Err(StoreError::Config(sqlx::Error::Configuration(
            format!("tablespace {tablespace:?} is not a plain lower-case identifier").into(),
        )));
    }
    database.pool.close().await;
    let admin: PgConnectOptions = admin_url.parse().map_err(StoreError::Config)?;
    let mut conn = admin.connect().await?;
    let sql = format!("ALTER DATABASE {} SET TABLESPACE {tablespace}", database.name);
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await?;
    Ok(())
}

/// The same URL, naming another database.
pub fn with_database(url: &str, database: &str) -> String {
    let authority_start = url.find("://").map_or(0, |i| i + 3);
    let query_start = url.find('?').unwrap_or(url.len());
    let path_start = url[authority_start..query_start].find('/').map_or(query_start, |i| authority_start + i);
    format!("{}/{database}{}", &url[..path_start], &url[query_start..])
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn database_names_are_swapped_in_place() {
        assert_eq!(with_database("postgres://u:p@h:1/db?host=/run", "x"), "postgres://u:p@h:1/x?host=/run");
        assert_eq!(with_database("postgres://u@h/db", "x"), "postgres://u@h/x");
        assert_eq!(with_database("postgres://h", "x"), "postgres://h/x");
        assert_eq!(with_database("postgres://h?sslmode=disable", "x"), "postgres://h/x?sslmode=disable");
    }
}

use std::time::Duration;

use crate::{ConfigError, Env, Problems, Secret, vars};

/// How the database is reached.
#[derive(Debug, Clone)]
pub struct DatabaseSettings {
    pub url: Secret<String>,
    pub max_connections: u32,
    /// A streaming replica of `url`, when reads may go there.
    pub read_url: Option<Secret<String>>,
    /// How long a read waits for the replica to catch up before it answers `degraded` (recall)
    /// or reads the primary (everything else).
    pub replica_wait: Duration,
}

impl DatabaseSettings {
    pub(crate) fn read(env: &Env, problems: &mut Problems) -> Self {
        let url = env.get(vars::DATABASE_URL).or_else(|| env.get(vars::DATABASE_URL_FALLBACK));
        if url.is_none() {
            problems.0.push(format!(
                "{} (or {}) is not set; the local default is printed by scripts/setup-postgres.sh",
                vars::DATABASE_URL,
                vars::DATABASE_URL_FALLBACK
            ));
        }
        let max_connections = problems.parsed(env, vars::DB_MAX_CONNECTIONS, 16u32, "a whole number");
        if max_connections == 0 {
            problems.0.push(format!("{} must be at least 1", vars::DB_MAX_CONNECTIONS));
        }
        let read_url = env.get(vars::READ_DATABASE_URL).map(|u| Secret::new(u.to_owned()));
        let replica_wait =
            Duration::from_millis(problems.bounded(env, vars::READ_REPLICA_WAIT_MS, 25, 0..=10_000, "milliseconds"));
        Self { url: Secret::new(url.unwrap_or_default().to_owned()), max_connections, read_url, replica_wait }
    }

    /// Settings for the binaries that need nothing but the database (runbook, bench).
    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        Problems::read_all(env, Self::read)
    }
}

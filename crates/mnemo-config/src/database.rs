use crate::{ConfigError, Env, Problems, Secret, vars};

/// How the database is reached.
#[derive(Debug, Clone)]
pub struct DatabaseSettings {
    pub url: Secret<String>,
    pub max_connections: u32,
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
        Self { url: Secret::new(url.unwrap_or_default().to_owned()), max_connections }
    }

    /// Settings for the binaries that need nothing but the database (runbook, bench).
    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        Problems::read_all(env, Self::read)
    }
}

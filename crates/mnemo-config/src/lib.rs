//! Configuration: every environment variable mnemo reads is a named constant in [`vars`], each
//! binary's settings are a typed struct parsed from an [`Env`], and every error is reported at
//! once so an operator fixes a deployment in one round. Tests build an [`Env`] from a map and
//! never touch the process environment. Secrets are wrapped so they never print.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

mod telemetry;

pub use telemetry::{LogFormat, LogSettings, init_tracing, shutdown_signal};

/// The names of every environment variable mnemo reads.
pub mod vars {
    pub const DATABASE_URL: &str = "MNEMO_DATABASE_URL";
    /// Read when `MNEMO_DATABASE_URL` is unset, as many tools set it.
    pub const DATABASE_URL_FALLBACK: &str = "DATABASE_URL";
    pub const DB_MAX_CONNECTIONS: &str = "MNEMO_DB_MAX_CONNECTIONS";
    pub const LISTEN: &str = "MNEMO_LISTEN";
    pub const JWT_SECRET: &str = "MNEMO_JWT_SECRET";
    pub const JWT_PUBLIC_KEY_FILE: &str = "MNEMO_JWT_PUBLIC_KEY_FILE";
    pub const MAX_TOOL_OUTPUT_BYTES: &str = "MNEMO_MAX_TOOL_OUTPUT_BYTES";
    pub const WRITE_COMMITTERS: &str = "MNEMO_WRITE_COMMITTERS";
    pub const WRITE_MAX_BATCH: &str = "MNEMO_WRITE_MAX_BATCH";
    pub const LOG: &str = "MNEMO_LOG";
    pub const LOG_FORMAT: &str = "MNEMO_LOG_FORMAT";
}

/// The variables a process sees. Built from the real environment in binaries and from a map in
/// tests.
#[derive(Debug, Clone, Default)]
pub struct Env(BTreeMap<String, String>);

impl Env {
    pub fn from_process() -> Self {
        Self(std::env::vars().collect())
    }

    pub fn from_pairs<K: Into<String>, V: Into<String>>(pairs: impl IntoIterator<Item = (K, V)>) -> Self {
        Self(pairs.into_iter().map(|(k, v)| (k.into(), v.into())).collect())
    }

    /// The same variables with one set or replaced.
    pub fn with(mut self, name: &str, value: impl Into<String>) -> Self {
        self.0.insert(name.to_owned(), value.into());
        self
    }

    /// A set, non-blank value.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str).filter(|v| !v.trim().is_empty())
    }
}

/// A value that must never reach a log line or an error message.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret<T>(T);

impl<T> Secret<T> {
    pub fn new(value: T) -> Self {
        Self(value)
    }

    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl<T> std::fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Every problem found in one pass over the environment.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  - {}", .0.join("\n  - "))]
pub struct ConfigError(pub Vec<String>);

/// Collects problems while settings are read, so all of them are reported together.
#[derive(Debug, Default)]
struct Problems(Vec<String>);

impl Problems {
    fn parsed<T: FromStr>(&mut self, env: &Env, name: &str, default: T, what: &str) -> T
    where
        T::Err: std::fmt::Display,
    {
        match env.get(name) {
            None => default,
            Some(raw) => raw.trim().parse().unwrap_or_else(|e| {
                self.0.push(format!("{name}={raw:?} is not {what}: {e}"));
                default
            }),
        }
    }

    fn finish<T>(self, value: T) -> Result<T, ConfigError> {
        if self.0.is_empty() { Ok(value) } else { Err(ConfigError(self.0)) }
    }
}

/// How the database is reached.
#[derive(Debug, Clone)]
pub struct DatabaseSettings {
    pub url: Secret<String>,
    pub max_connections: u32,
}

impl DatabaseSettings {
    fn read(env: &Env, problems: &mut Problems) -> Self {
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
        let mut problems = Problems::default();
        let settings = Self::read(env, &mut problems);
        problems.finish(settings)
    }
}

/// How bearer tokens are verified.
#[derive(Debug, Clone)]
pub enum JwtKey {
    /// HS256 with a shared secret.
    Hmac(Secret<Vec<u8>>),
    /// RS256 or ES256 with a PEM public key (the algorithm follows the key).
    PublicKeyPem { path: PathBuf, pem: Vec<u8> },
}

/// HS256 secrets shorter than this are refused: they can be brute-forced.
pub const MIN_JWT_SECRET_BYTES: usize = 32;

impl JwtKey {
    fn read(env: &Env, problems: &mut Problems) -> Option<Self> {
        match (env.get(vars::JWT_SECRET), env.get(vars::JWT_PUBLIC_KEY_FILE)) {
            (Some(_), Some(_)) => {
                problems.0.push(format!("set one of {} and {}, not both", vars::JWT_SECRET, vars::JWT_PUBLIC_KEY_FILE));
                None
            }
            (None, None) => {
                problems.0.push(format!(
                    "no token verification key: set {} (HS256) or {} (RS256/ES256)",
                    vars::JWT_SECRET,
                    vars::JWT_PUBLIC_KEY_FILE
                ));
                None
            }
            (Some(secret), None) if secret.len() < MIN_JWT_SECRET_BYTES => {
                problems.0.push(format!(
                    "{} is {} bytes; use at least {MIN_JWT_SECRET_BYTES}",
                    vars::JWT_SECRET,
                    secret.len()
                ));
                None
            }
            (Some(secret), None) => Some(Self::Hmac(Secret::new(secret.as_bytes().to_vec()))),
            (None, Some(path)) => match std::fs::read(path) {
                Ok(pem) => Some(Self::PublicKeyPem { path: PathBuf::from(path), pem }),
                Err(e) => {
                    problems.0.push(format!("{}={path:?} cannot be read: {e}", vars::JWT_PUBLIC_KEY_FILE));
                    None
                }
            },
        }
    }
}

/// Everything `mnemo-server` needs.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    pub database: DatabaseSettings,
    pub listen: SocketAddr,
    pub jwt: JwtKey,
    /// The largest tool output accepted in one write; longer ones are refused with 413.
    pub max_tool_output_bytes: usize,
    /// Writes are group-committed: this many transactions in flight at once…
    pub write_committers: usize,
    /// …each holding at most this many rows.
    pub write_max_batch: usize,
    pub log: LogSettings,
}

impl ServerSettings {
    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        let mut problems = Problems::default();
        let database = DatabaseSettings::read(env, &mut problems);
        let listen = problems.parsed(
            env,
            vars::LISTEN,
            SocketAddr::from(([127, 0, 0, 1], 8080)),
            "an address like 127.0.0.1:8080",
        );
        let jwt = JwtKey::read(env, &mut problems);
        let max_tool_output_bytes = problems.parsed(env, vars::MAX_TOOL_OUTPUT_BYTES, 4 << 20, "a number of bytes");
        let write_committers = problems.parsed(env, vars::WRITE_COMMITTERS, 2usize, "a whole number");
        let write_max_batch = problems.parsed(env, vars::WRITE_MAX_BATCH, 64usize, "a whole number");
        if write_committers == 0 || write_max_batch == 0 {
            problems.0.push(format!("{} and {} must be at least 1", vars::WRITE_COMMITTERS, vars::WRITE_MAX_BATCH));
        }
        if write_committers as u64 >= u64::from(database.max_connections) {
            problems.0.push(format!(
                "{}={write_committers} leaves no database connection for reads: keep it below {}={}",
                vars::WRITE_COMMITTERS,
                vars::DB_MAX_CONNECTIONS,
                database.max_connections
            ));
        }
        let log = LogSettings::read(env, &mut problems);
        let jwt = jwt.unwrap_or(JwtKey::Hmac(Secret::new(Vec::new())));
        problems.finish(Self { database, listen, jwt, max_tool_output_bytes, write_committers, write_max_batch, log })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_problems_are_reported_at_once() {
        let env = Env::from_pairs([(vars::LISTEN, "nowhere"), (vars::DB_MAX_CONNECTIONS, "many")]);
        let err = ServerSettings::from_env(&env).unwrap_err();
        let text = err.to_string();
        assert_eq!(err.0.len(), 4, "{text}");
        for name in [vars::DATABASE_URL, vars::LISTEN, vars::DB_MAX_CONNECTIONS, vars::JWT_SECRET] {
            assert!(text.contains(name), "{name} missing from: {text}");
        }
    }

    #[test]
    fn database_url_falls_back_and_secrets_do_not_print() {
        let env = Env::from_pairs([
            (vars::DATABASE_URL_FALLBACK, "postgres://u:hunter2@localhost/db"),
            (vars::JWT_SECRET, "0123456789abcdef0123456789abcdef"),
        ]);
        let settings = ServerSettings::from_env(&env).expect("valid settings");
        assert_eq!(settings.database.url.expose(), "postgres://u:hunter2@localhost/db");
        assert_eq!(settings.listen.to_string(), "127.0.0.1:8080");
        let printed = format!("{settings:?}");
        assert!(!printed.contains("hunter2") && !printed.contains("0123456789abcdef"), "{printed}");
    }

    #[test]
    fn short_or_double_keys_are_refused() {
        let short = Env::from_pairs([(vars::DATABASE_URL, "postgres://x"), (vars::JWT_SECRET, "short")]);
        assert!(ServerSettings::from_env(&short).unwrap_err().to_string().contains("at least 32"));
        let both = Env::from_pairs([
            (vars::DATABASE_URL, "postgres://x"),
            (vars::JWT_SECRET, "0123456789abcdef0123456789abcdef"),
            (vars::JWT_PUBLIC_KEY_FILE, "/nonexistent.pem"),
        ]);
        assert!(ServerSettings::from_env(&both).unwrap_err().to_string().contains("not both"));
    }
}

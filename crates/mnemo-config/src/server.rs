use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::{
    ConfigError, ContextSettings, DatabaseSettings, EmbedSettings, Env, LogSettings, Problems, RecallSettings, Secret,
    WorkspaceSettings, vars,
};

/// How bearer tokens are verified.
#[derive(Debug, Clone)]
pub enum JwtKey {
    /// HS256 with a shared secret, and while it is rotated out, the previous one.
    Hmac { secret: Secret<Vec<u8>>, previous: Option<Secret<Vec<u8>>> },
    /// RS256 or ES256 with the PEM public keys of a file (the algorithm follows each key): an
    /// identity provider's current and next keys during a rotation.
    PublicKeyPem { path: PathBuf, pem: Vec<u8> },
}

/// HS256 secrets shorter than this are refused: they can be brute-forced.
pub const MIN_JWT_SECRET_BYTES: usize = 32;

impl JwtKey {
    pub(crate) fn read(env: &Env, problems: &mut Problems) -> Option<Self> {
        let short = |var: &str, secret: &str| {
            (secret.len() < MIN_JWT_SECRET_BYTES)
                .then(|| format!("{var} is {} bytes; use at least {MIN_JWT_SECRET_BYTES}", secret.len()))
        };
        // Every problem is listed at once: the previous secret's do not hide the current's.
        let before = problems.0.len();
        let previous = env.get(vars::JWT_PREVIOUS_SECRET);
        if let Some(previous) = previous {
            if env.get(vars::JWT_SECRET).is_none() {
                problems.0.push(format!(
                    "{} is for rotating {}, which is not set",
                    vars::JWT_PREVIOUS_SECRET,
                    vars::JWT_SECRET
                ));
            } else if env.get(vars::JWT_SECRET) == Some(previous) {
                // The same secret twice: the tokens of the one being rotated out would all fail.
                problems.0.push(format!(
                    "{} equals {}: give it the secret being rotated out",
                    vars::JWT_PREVIOUS_SECRET,
                    vars::JWT_SECRET
                ));
            }
            problems.0.extend(short(vars::JWT_PREVIOUS_SECRET, previous));
        }
        let key = match (env.get(vars::JWT_SECRET), env.get(vars::JWT_PUBLIC_KEY_FILE)) {
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
            (Some(secret), None) => match short(vars::JWT_SECRET, secret) {
                Some(problem) => {
                    problems.0.push(problem);
                    None
                }
                None => Some(Self::Hmac {
                    secret: Secret::new(secret.as_bytes().to_vec()),
                    previous: previous.map(|p| Secret::new(p.as_bytes().to_vec())),
                }),
            },
            (None, Some(path)) => match std::fs::read(path) {
                Ok(pem) => Some(Self::PublicKeyPem { path: PathBuf::from(path), pem }),
                Err(e) => {
                    problems.0.push(format!("{}={path:?} cannot be read: {e}", vars::JWT_PUBLIC_KEY_FILE));
                    None
                }
            },
        };
        key.filter(|_| problems.0.len() == before)
    }
}

/// Everything `mnemo-server` needs.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    pub database: DatabaseSettings,
    pub listen: SocketAddr,
    pub jwt: JwtKey,
    /// When set, a token must carry this `aud` (one of its audiences) and this `iss`: a key that
    /// an identity provider signs other applications' tokens with then opens nothing else.
    pub jwt_audience: Option<String>,
    pub jwt_issuer: Option<String>,
    /// The largest tool output accepted in one write; longer ones are refused with 413.
    pub max_tool_output_bytes: usize,
    /// The most items of one batch write.
    pub max_batch_items: usize,
    /// How long a connection may wait for a request's head (idle keep-alive included)…
    pub header_timeout: Duration,
    /// …and a request for its body.
    pub body_timeout: Duration,
    /// How long a response's write may wait on a client that reads nothing; then the connection
    /// is closed.
    pub write_timeout: Duration,
    /// Client connections served at once; more wait in the listen queue.
    pub max_client_connections: usize,
    /// The longest a statement of the API's may run; PostgreSQL cancels it then.
    pub statement_timeout: Duration,
    /// Requests per second per tenant (0: no limit), and how many may come at once.
    pub rate_limit_per_tenant: f64,
    pub rate_limit_burst: f64,
    /// Writes are group-committed: this many transactions in flight at once…
    pub write_committers: usize,
    /// …each holding at most this many rows.
    pub write_max_batch: usize,
    /// Queries are embedded with the same model as the rows.
    pub embed: EmbedSettings,
    pub recall: RecallSettings,
    /// How context windows count tokens and when they ask for compaction.
    pub context: ContextSettings,
    /// Agent workspaces: file sizes, the core files' templates, their share of a prompt.
    pub workspace: WorkspaceSettings,
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
        let named = |name: &str| env.get(name).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
        let (jwt_audience, jwt_issuer) = (named(vars::JWT_AUDIENCE), named(vars::JWT_ISSUER));
        // Over 256 MiB a request's body (three times this) passes what one PostgreSQL value holds.
        let max_tool_output_bytes =
            problems.bounded(env, vars::MAX_TOOL_OUTPUT_BYTES, 4 << 20, 1..=256 << 20, "a number of bytes");
        let max_batch_items = problems.parsed(env, vars::MAX_BATCH_ITEMS, 1000usize, "a whole number");
        if !(1..=10_000).contains(&max_batch_items) {
            problems.0.push(format!("{} must be between 1 and 10000", vars::MAX_BATCH_ITEMS));
        }
        let header_timeout = problems.seconds(env, vars::HEADER_TIMEOUT_S, 10);
        let body_timeout = problems.seconds(env, vars::BODY_TIMEOUT_S, 60);
        let write_timeout = problems.seconds(env, vars::WRITE_TIMEOUT_S, 60);
        let max_client_connections =
            problems.bounded(env, vars::MAX_CLIENT_CONNECTIONS, 1024usize, 1..=1_000_000, "a whole number");
        let statement_timeout = problems.seconds(env, vars::STATEMENT_TIMEOUT_S, 30);
        let rate_limit_per_tenant: f64 = problems.parsed(env, vars::RATE_LIMIT_PER_TENANT, 0.0, "requests per second");
        let rate_limit_burst = problems.parsed(
            env,
            vars::RATE_LIMIT_BURST,
            (2.0 * rate_limit_per_tenant).max(1.0),
            "a number of requests",
        );
        // Below one request a day a limit means nothing, and its waits overflow.
        let rate = rate_limit_per_tenant;
        let valid = rate.is_finite() && (rate == 0.0 || rate >= 1.0 / 86_400.0) && rate_limit_burst >= 1.0;
        if !valid {
            problems.0.push(format!(
                "{} must be 0 (no limit) or at least one request a day (0.0000116) and {} at least 1",
                vars::RATE_LIMIT_PER_TENANT,
                vars::RATE_LIMIT_BURST
            ));
        }
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let write_committers = problems.parsed(
            env,
            vars::WRITE_COMMITTERS,
            default_committers(cores, database.max_connections),
            "a whole number",
        );
        let write_max_batch = problems.bounded(env, vars::WRITE_MAX_BATCH, 64usize, 1..=10_000, "a whole number");
        if write_committers == 0 {
            problems.0.push(format!("{} must be at least 1", vars::WRITE_COMMITTERS));
        }
        if database.max_connections < 2 {
            problems.0.push(format!(
                "{}={} leaves no database connection for reads beside a write committer: at least 2",
                vars::DB_MAX_CONNECTIONS,
                database.max_connections
            ));
        } else if write_committers as u64 >= u64::from(database.max_connections) {
            problems.0.push(format!(
                "{}={write_committers} leaves no database connection for reads: keep it below {}={}",
                vars::WRITE_COMMITTERS,
                vars::DB_MAX_CONNECTIONS,
                database.max_connections
            ));
        }
        let embed = EmbedSettings::read(env, &mut problems);
        let recall = RecallSettings::read(env, &mut problems);
        let context = ContextSettings::read(env, &mut problems);
        let workspace = WorkspaceSettings::read(env, &mut problems);
        let log = LogSettings::read(env, &mut problems);
        let jwt = jwt.unwrap_or(JwtKey::Hmac { secret: Secret::new(Vec::new()), previous: None });
        problems.finish(Self {
            database,
            listen,
            jwt,
            jwt_audience,
            jwt_issuer,
            max_tool_output_bytes,
            max_batch_items,
            header_timeout,
            statement_timeout,
            body_timeout,
            write_timeout,
            max_client_connections,
            rate_limit_per_tenant,
            rate_limit_burst,
            write_committers,
            write_max_batch,
            embed,
            recall,
            context,
            workspace,
            log,
        })
    }
}

/// Committers' transactions run on the same cores as the server and PostgreSQL: on two cores one
/// committer with twice the rows per transaction writes more than two (docs/benchmarks.md). Half
/// the cores, and never more than half the pool's connections, which reads need too.
fn default_committers(cores: usize, max_connections: u32) -> usize {
    (cores / 2).min(max_connections as usize / 2).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_committers_leave_connections_for_reads_on_any_machine() {
        assert_eq!(default_committers(1, 16), 1);
        assert_eq!(default_committers(2, 16), 1);
        assert_eq!(default_committers(8, 16), 4);
        // On 32 cores half the cores (16) would take every default connection.
        assert_eq!(default_committers(32, 16), 8);
        assert_eq!(default_committers(64, 2), 1);
    }

    #[test]
    fn a_previous_secret_rotates_the_secret_it_stands_beside() {
        let read = |pairs: &[(&str, &str)]| {
            let mut problems = Problems(Vec::new());
            let key = JwtKey::read(&Env::from_pairs(pairs.iter().copied()), &mut problems);
            (key, problems.0)
        };
        let (secret, previous) = ("s".repeat(MIN_JWT_SECRET_BYTES), "p".repeat(MIN_JWT_SECRET_BYTES));
        let (key, problems) = read(&[(vars::JWT_SECRET, &secret), (vars::JWT_PREVIOUS_SECRET, &previous)]);
        assert!(problems.is_empty(), "{problems:?}");
        assert!(matches!(key, Some(JwtKey::Hmac { previous: Some(p), .. }) if p.expose() == previous.as_bytes()));
        let (key, problems) = read(&[(vars::JWT_PREVIOUS_SECRET, &previous)]);
        assert!(key.is_none() && problems[0].contains("which is not set"), "{problems:?}");
        let (key, problems) = read(&[(vars::JWT_SECRET, &secret), (vars::JWT_PREVIOUS_SECRET, "short")]);
        assert!(key.is_none() && problems[0].starts_with(vars::JWT_PREVIOUS_SECRET), "{problems:?}");
        assert!(!problems[0].contains("short"), "a secret is never shown: {problems:?}");
        let (key, problems) = read(&[(vars::JWT_SECRET, &secret), (vars::JWT_PREVIOUS_SECRET, &secret)]);
        assert!(key.is_none() && problems[0].contains("equals"), "{problems:?}");
        // Both secrets short: both named at once.
        let (key, problems) = read(&[(vars::JWT_SECRET, "short"), (vars::JWT_PREVIOUS_SECRET, "shorter")]);
        assert!(key.is_none() && problems.len() == 2, "{problems:?}");
    }

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
    fn counts_past_any_use_are_refused_by_name() {
        let env = Env::from_pairs([
            (vars::DATABASE_URL, "postgres://x"),
            (vars::JWT_SECRET, "0123456789abcdef0123456789abcdef"),
            (vars::WRITE_MAX_BATCH, "100000000"),
            (vars::COMPACT_TRIGGER_MESSAGES, "18446744073709551615"),
            (vars::COMPACT_KEEP_PAIRS, "99999999"),
        ]);
        let err = ServerSettings::from_env(&env).unwrap_err();
        assert_eq!(err.0.len(), 3, "{err}");
        for name in [vars::WRITE_MAX_BATCH, vars::COMPACT_TRIGGER_MESSAGES, vars::COMPACT_KEEP_PAIRS] {
            assert!(err.to_string().contains(&format!("{name}=")), "{name}: {err}");
        }
    }

    #[test]
    fn one_connection_is_refused_for_what_it_is() {
        let env = Env::from_pairs([
            (vars::DATABASE_URL, "postgres://x"),
            (vars::JWT_SECRET, "0123456789abcdef0123456789abcdef"),
            (vars::DB_MAX_CONNECTIONS, "1"),
        ]);
        let err = ServerSettings::from_env(&env).unwrap_err();
        assert_eq!(
            err.0,
            ["MNEMO_DB_MAX_CONNECTIONS=1 leaves no database connection for reads beside a write committer: at least 2"]
        );
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

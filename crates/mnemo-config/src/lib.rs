//! Configuration: every environment variable mnemo reads is a named constant in [`vars`], each
//! binary's settings are a typed struct parsed from an [`Env`], and every error is reported at
//! once so an operator fixes a deployment in one round. Tests build an [`Env`] from a map and
//! never touch the process environment. Secrets are wrapped so they never print.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

mod telemetry;

use mnemo_core::{MAX_BATCH_SIZE, MAX_TTL_DAYS, RetentionPolicy};
pub use telemetry::{LogFormat, LogSettings, init_tracing, metrics_handle, shutdown_signal};

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
    pub const EMBED_PROVIDER: &str = "MNEMO_EMBED_PROVIDER";
    pub const EMBED_MODEL: &str = "MNEMO_EMBED_MODEL";
    pub const EMBED_DIMENSIONS: &str = "MNEMO_EMBED_DIMENSIONS";
    pub const EMBED_BASE_URL: &str = "MNEMO_EMBED_BASE_URL";
    pub const EMBED_API_KEY: &str = "MNEMO_EMBED_API_KEY";
    /// Read when `MNEMO_EMBED_BASE_URL` is unset.
    pub const OPENAI_BASE_URL: &str = "OPENAI_BASE_URL";
    /// Read when `MNEMO_EMBED_API_KEY` is unset.
    pub const OPENAI_API_KEY: &str = "OPENAI_API_KEY";
    pub const EMBED_TIMEOUT_MS: &str = "MNEMO_EMBED_TIMEOUT_MS";
    pub const EMBED_MAX_INPUTS: &str = "MNEMO_EMBED_MAX_INPUTS";
    pub const LOCAL_MODEL_DIR: &str = "MNEMO_LOCAL_MODEL_DIR";
    pub const EMBED_BATCH_SIZE: &str = "MNEMO_EMBED_BATCH_SIZE";
    pub const EMBED_MAX_WAIT_MS: &str = "MNEMO_EMBED_MAX_WAIT_MS";
    pub const EMBED_MAX_ATTEMPTS: &str = "MNEMO_EMBED_MAX_ATTEMPTS";
    pub const WORKER_QUEUES: &str = "MNEMO_WORKER_QUEUES";
    pub const WORKER_LISTEN: &str = "MNEMO_WORKER_LISTEN";
    pub const WORKER_ORPHAN_TIMEOUT_S: &str = "MNEMO_WORKER_ORPHAN_TIMEOUT_S";
    pub const JOB_TIMEOUT_S: &str = "MNEMO_JOB_TIMEOUT_S";
    pub const HOUSEKEEPING_INTERVAL_S: &str = "MNEMO_HOUSEKEEPING_INTERVAL_S";
    pub const EMBED_GRACE_S: &str = "MNEMO_EMBED_GRACE_S";
    pub const JOB_RETENTION_S: &str = "MNEMO_JOB_RETENTION_S";
    pub const RECALL_WEIGHT_SESSION: &str = "MNEMO_RECALL_WEIGHT_SESSION";
    pub const RECALL_WEIGHT_TENANT: &str = "MNEMO_RECALL_WEIGHT_TENANT";
    pub const RECALL_WEIGHT_USER: &str = "MNEMO_RECALL_WEIGHT_USER";
    pub const RECALL_WEIGHT_AGENT: &str = "MNEMO_RECALL_WEIGHT_AGENT";
    pub const RECALL_PRUNE_FRACTION: &str = "MNEMO_RECALL_PRUNE_FRACTION";
    pub const RERANKER_URL: &str = "MNEMO_RERANKER_URL";
    pub const RERANKER_TIMEOUT_MS: &str = "MNEMO_RERANKER_TIMEOUT_MS";
    pub const JUDGE_MODEL: &str = "MNEMO_JUDGE_MODEL";
    /// Falls back to `OPENAI_BASE_URL`.
    pub const JUDGE_BASE_URL: &str = "MNEMO_JUDGE_BASE_URL";
    /// Falls back to `OPENAI_API_KEY`.
    pub const JUDGE_API_KEY: &str = "MNEMO_JUDGE_API_KEY";
    pub const JUDGE_TOPK: &str = "MNEMO_JUDGE_TOPK";
    pub const JUDGE_THRESHOLD: &str = "MNEMO_JUDGE_THRESHOLD";
    pub const JUDGE_BATCH_SIZE: &str = "MNEMO_JUDGE_BATCH_SIZE";
    pub const JUDGE_TIMEOUT_MS: &str = "MNEMO_JUDGE_TIMEOUT_MS";
    pub const JUDGE_MAX_WAIT_MS: &str = "MNEMO_JUDGE_MAX_WAIT_MS";
    pub const JUDGE_GRACE_S: &str = "MNEMO_JUDGE_GRACE_S";
    pub const ANONYMIZE_SOFT_TTL_DAYS: &str = "MNEMO_ANONYMIZE_SOFT_TTL_DAYS";
    pub const ANONYMIZE_SUP_TTL_DAYS: &str = "MNEMO_ANONYMIZE_SUP_TTL_DAYS";
    pub const ANONYMIZE_BATCH_SIZE: &str = "MNEMO_ANONYMIZE_BATCH_SIZE";
    pub const ANONYMIZE_DRY_RUN: &str = "MNEMO_ANONYMIZE_DRY_RUN";
    pub const ANONYMIZE_MAX_FRACTION: &str = "MNEMO_ANONYMIZE_MAX_FRACTION";
    pub const ANONYMIZE_FLOOR_ROWS: &str = "MNEMO_ANONYMIZE_FLOOR_ROWS";
    pub const ANONYMIZE_INTERVAL_S: &str = "MNEMO_ANONYMIZE_INTERVAL_S";
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

    /// Reads settings with `read` and fails with every problem it found.
    fn read_all<T>(env: &Env, read: fn(&Env, &mut Problems) -> T) -> Result<T, ConfigError> {
        let mut problems = Self::default();
        let value = read(env, &mut problems);
        problems.finish(value)
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
        Problems::read_all(env, Self::read)
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
    /// Queries are embedded with the same model as the rows.
    pub embed: EmbedSettings,
    pub recall: RecallSettings,
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
        let embed = EmbedSettings::read(env, &mut problems);
        let recall = RecallSettings::read(env, &mut problems);
        let log = LogSettings::read(env, &mut problems);
        let jwt = jwt.unwrap_or(JwtKey::Hmac(Secret::new(Vec::new())));
        problems.finish(Self {
            database,
            listen,
            jwt,
            max_tool_output_bytes,
            write_committers,
            write_max_batch,
            embed,
            recall,
            log,
        })
    }
}

/// The class priors of weighted Reciprocal Rank Fusion across recall classes. 0 suppresses a
/// class.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClassWeights {
    pub session: f64,
    pub tenant: f64,
    pub user: f64,
    pub agent: f64,
}

impl Default for ClassWeights {
    fn default() -> Self {
        Self { session: 1.3, tenant: 1.0, user: 1.1, agent: 1.0 }
    }
}

/// How recall searches and ranks.
#[derive(Debug, Clone)]
pub struct RecallSettings {
    pub weights: ClassWeights,
    /// A TEI-compatible reranker; unset disables rerank.
    pub reranker_url: Option<String>,
    pub rerank_timeout: Duration,
    /// Query lexemes found in more than this fraction of rows are dropped from the full-text half.
    pub prune_fraction: f64,
    /// Values that were ignored, to be logged once tracing is up (the weights fall back to their
    /// defaults rather than stop the server, as the seed says).
    pub warnings: Vec<String>,
}

impl Default for RecallSettings {
    fn default() -> Self {
        Self {
            weights: ClassWeights::default(),
            reranker_url: None,
            rerank_timeout: Duration::from_millis(1000),
            prune_fraction: 0.01,
            warnings: Vec::new(),
        }
    }
}

impl RecallSettings {
    fn read(env: &Env, problems: &mut Problems) -> Self {
        let defaults = Self::default();
        let mut warnings = Vec::new();
        let mut weight = |name: &str, default: f64| match env.get(name).map(|raw| (raw, raw.trim().parse::<f64>())) {
            None => default,
            Some((_, Ok(w))) if w.is_finite() && w >= 0.0 => w,
            Some((raw, _)) => {
                warnings.push(format!("{name}={raw:?} is not a weight of 0 or more; using the default {default}"));
                default
            }
        };
        let d = defaults.weights;
        let weights = ClassWeights {
            session: weight(vars::RECALL_WEIGHT_SESSION, d.session),
            tenant: weight(vars::RECALL_WEIGHT_TENANT, d.tenant),
            user: weight(vars::RECALL_WEIGHT_USER, d.user),
            agent: weight(vars::RECALL_WEIGHT_AGENT, d.agent),
        };
        let reranker_url = env.get(vars::RERANKER_URL).map(|u| u.trim().to_owned());
        if let Some(url) = &reranker_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            problems.0.push(format!("{}={url:?} must be an http:// or https:// URL", vars::RERANKER_URL));
        }
        let timeout_ms = problems.parsed(env, vars::RERANKER_TIMEOUT_MS, 1000u64, "milliseconds").max(1);
        let prune_fraction = problems.parsed(env, vars::RECALL_PRUNE_FRACTION, defaults.prune_fraction, "a fraction");
        if !(0.0..=1.0).contains(&prune_fraction) {
            problems.0.push(format!("{} must be between 0 and 1", vars::RECALL_PRUNE_FRACTION));
        }
        Self { weights, reranker_url, rerank_timeout: Duration::from_millis(timeout_ms), prune_fraction, warnings }
    }

    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        Problems::read_all(env, Self::read)
    }
}

/// Which embedding provider, and how to reach it.
#[derive(Debug, Clone)]
pub enum EmbedProvider {
    /// all-MiniLM-L6-v2 in-process, loaded from a folder made by `scripts/fetch-model.sh`.
    Local { model_dir: PathBuf },
    /// Any OpenAI-compatible `/v1/embeddings` endpoint.
    /// `base_url` unset means the client library's default (OpenAI itself).
    OpenAi {
        base_url: Option<String>,
        api_key: Secret<String>,
        dimensions: usize,
        timeout: Duration,
        max_inputs: usize,
    },
}

/// The embedding model every process of a deployment uses.
#[derive(Debug, Clone)]
pub struct EmbedSettings {
    pub provider: EmbedProvider,
    /// The name vectors are stored under; changing it re-embeds in the background.
    pub model: String,
}

/// The local model's name.
pub const LOCAL_EMBED_MODEL: &str = "all-MiniLM-L6-v2";

impl EmbedSettings {
    fn read(env: &Env, problems: &mut Problems) -> Self {
        let model = env.get(vars::EMBED_MODEL);
        match env.get(vars::EMBED_PROVIDER).unwrap_or("local") {
            "local" => {
                if model.is_some_and(|m| m != LOCAL_EMBED_MODEL) {
                    problems.0.push(format!(
                        "{}=local runs {LOCAL_EMBED_MODEL} only; unset {} or use the openai provider",
                        vars::EMBED_PROVIDER,
                        vars::EMBED_MODEL
                    ));
                }
                let model_dir = PathBuf::from(env.get(vars::LOCAL_MODEL_DIR).unwrap_or("models/all-MiniLM-L6-v2"));
                Self { provider: EmbedProvider::Local { model_dir }, model: LOCAL_EMBED_MODEL.to_owned() }
            }
            "openai" => {
                let base_url = env.get(vars::EMBED_BASE_URL).or_else(|| env.get(vars::OPENAI_BASE_URL));
                let api_key = env.get(vars::EMBED_API_KEY).or_else(|| env.get(vars::OPENAI_API_KEY)).unwrap_or("");
                if base_url.is_none() && api_key.is_empty() {
                    problems.0.push(format!(
                        "the openai provider needs {} (or {}) and/or {} (or {})",
                        vars::EMBED_BASE_URL,
                        vars::OPENAI_BASE_URL,
                        vars::EMBED_API_KEY,
                        vars::OPENAI_API_KEY
                    ));
                }
                if model.is_none() {
                    problems
                        .0
                        .push(format!("the openai provider needs {} (e.g. text-embedding-3-small)", vars::EMBED_MODEL));
                }
                let dimensions = problems.parsed(env, vars::EMBED_DIMENSIONS, 0usize, "a whole number");
                if dimensions == 0 {
                    problems.0.push(format!("the openai provider needs {} (e.g. 1536)", vars::EMBED_DIMENSIONS));
                }
                let timeout_ms = problems.parsed(env, vars::EMBED_TIMEOUT_MS, 10_000u64, "milliseconds");
                let max_inputs = problems.parsed(env, vars::EMBED_MAX_INPUTS, 256usize, "a whole number").max(1);
                Self {
                    provider: EmbedProvider::OpenAi {
                        base_url: base_url.map(|u| u.trim_end_matches('/').to_owned()),
                        api_key: Secret::new(api_key.to_owned()),
                        dimensions,
                        timeout: Duration::from_millis(timeout_ms),
                        max_inputs,
                    },
                    model: model.unwrap_or_default().to_owned(),
                }
            }
            other => {
                problems.0.push(format!("{}={other:?} must be local or openai", vars::EMBED_PROVIDER));
                Self { provider: EmbedProvider::Local { model_dir: PathBuf::new() }, model: String::new() }
            }
        }
    }

    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        Problems::read_all(env, Self::read)
    }
}

/// The OpenAI-compatible chat model that judges contradictions.
#[derive(Debug, Clone)]
pub struct JudgeModel {
    pub name: String,
    /// Unset means the client library's default (OpenAI itself).
    pub base_url: Option<String>,
    pub api_key: Secret<String>,
    pub timeout: Duration,
}

/// How the contradiction judge finds candidates and batches its work.
#[derive(Debug, Clone)]
pub struct JudgeSettings {
    /// `None` (an empty `MNEMO_JUDGE_MODEL`) disables the model step; keyed facts still supersede.
    pub model: Option<JudgeModel>,
    /// Candidates per pending row.
    pub topk: usize,
    /// Cosine-distance cutoff, clamped to [0, 1]: older facts closer than this are candidates.
    pub threshold: f64,
    /// Pending rows judged at once (their model calls run side by side).
    pub batch_size: usize,
    /// How long a batch waits to fill.
    pub max_wait: Duration,
    /// Pending rows whose judge job was queued this long ago get a new job.
    pub grace: Duration,
}

impl JudgeSettings {
    fn read(env: &Env, problems: &mut Problems) -> Self {
        let model = env.get(vars::JUDGE_MODEL).map(|name| {
            let base_url = env.get(vars::JUDGE_BASE_URL).or_else(|| env.get(vars::OPENAI_BASE_URL));
            let api_key = env.get(vars::JUDGE_API_KEY).or_else(|| env.get(vars::OPENAI_API_KEY)).unwrap_or("");
            if base_url.is_none() && api_key.is_empty() {
                problems.0.push(format!(
                    "{}={name:?} needs {} (or {}) and/or {} (or {})",
                    vars::JUDGE_MODEL,
                    vars::JUDGE_BASE_URL,
                    vars::OPENAI_BASE_URL,
                    vars::JUDGE_API_KEY,
                    vars::OPENAI_API_KEY
                ));
            }
            let timeout_ms = problems.parsed(env, vars::JUDGE_TIMEOUT_MS, 20_000u64, "milliseconds").max(1);
            JudgeModel {
                name: name.trim().to_owned(),
                base_url: base_url.map(|u| u.trim().trim_end_matches('/').to_owned()),
                api_key: Secret::new(api_key.to_owned()),
                timeout: Duration::from_millis(timeout_ms),
            }
        });
        let topk = problems.parsed(env, vars::JUDGE_TOPK, 5usize, "a whole number");
        if !(1..=50).contains(&topk) {
            problems.0.push(format!("{}={topk} must be between 1 and 50", vars::JUDGE_TOPK));
        }
        // Clamped rather than refused, as the seed says; not a number at all is still an error.
        let threshold = problems.parsed(env, vars::JUDGE_THRESHOLD, 0.7f64, "a number");
        let threshold = if threshold.is_nan() { 0.7 } else { threshold.clamp(0.0, 1.0) };
        let batch_size = problems.parsed(env, vars::JUDGE_BATCH_SIZE, 20usize, "a whole number");
        if !(1..=500).contains(&batch_size) {
            problems.0.push(format!("{}={batch_size} must be between 1 and 500", vars::JUDGE_BATCH_SIZE));
        }
        let max_wait = Duration::from_millis(problems.parsed(env, vars::JUDGE_MAX_WAIT_MS, 50u64, "milliseconds"));
        let grace =
            Duration::from_secs(problems.parsed(env, vars::JUDGE_GRACE_S, 120u64, "a number of seconds").max(1));
        Self { model, topk, threshold, batch_size: batch_size.max(1), max_wait, grace }
    }

    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        Problems::read_all(env, Self::read)
    }
}

/// The safety floor: a sweep that would anonymize more than `max_fraction` of a tenant's rows
/// *and* more than `floor_rows` rows is refused unless an operator allows it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SafetyFloor {
    pub max_fraction: f64,
    pub floor_rows: u64,
}

impl SafetyFloor {
    /// Whether anonymizing `rows` of a tenant holding `tenant_rows` is too large to do unasked.
    pub fn refuses(&self, rows: u64, tenant_rows: u64) -> bool {
        rows > self.floor_rows && rows as f64 > self.max_fraction * tenant_rows as f64
    }
}

/// Retention: the default policy (a tenant's own policy overrides it field by field), the
/// safety floor, and how often the workers sweep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetentionSettings {
    pub defaults: RetentionPolicy,
    pub floor: SafetyFloor,
    pub interval: Duration,
}

impl RetentionSettings {
    fn read(env: &Env, problems: &mut Problems) -> Self {
        let d = RetentionPolicy::default();
        let mut days = |name: &str, default: u32| {
            let days = problems.parsed(env, name, default, "a whole number of days");
            if days > MAX_TTL_DAYS {
                problems.0.push(format!("{name}={days} is over {MAX_TTL_DAYS} days"));
            }
            days
        };
        let soft_ttl_days = days(vars::ANONYMIZE_SOFT_TTL_DAYS, d.soft_ttl_days);
        let superseded_ttl_days = days(vars::ANONYMIZE_SUP_TTL_DAYS, d.superseded_ttl_days);
        let batch_size = problems.parsed(env, vars::ANONYMIZE_BATCH_SIZE, d.batch_size, "a whole number");
        if !(1..=MAX_BATCH_SIZE).contains(&batch_size) {
            problems
                .0
                .push(format!("{}={batch_size} must be between 1 and {MAX_BATCH_SIZE}", vars::ANONYMIZE_BATCH_SIZE));
        }
        let dry_run = match env.get(vars::ANONYMIZE_DRY_RUN).map(|v| v.trim().to_ascii_lowercase()) {
            None => d.dry_run,
            Some(v) if ["true", "1", "yes", "on"].contains(&v.as_str()) => true,
            Some(v) if ["false", "0", "no", "off"].contains(&v.as_str()) => false,
            Some(v) => {
                problems.0.push(format!("{}={v:?} must be true or false", vars::ANONYMIZE_DRY_RUN));
                d.dry_run
            }
        };
        let max_fraction = problems.parsed(env, vars::ANONYMIZE_MAX_FRACTION, 0.2f64, "a fraction");
        if !(0.0..=1.0).contains(&max_fraction) {
            problems.0.push(format!("{} must be between 0 and 1", vars::ANONYMIZE_MAX_FRACTION));
        }
        let floor_rows = problems.parsed(env, vars::ANONYMIZE_FLOOR_ROWS, 1000u64, "a whole number of rows");
        let interval = problems.parsed(env, vars::ANONYMIZE_INTERVAL_S, 3600u64, "a number of seconds").max(1);
        Self {
            defaults: RetentionPolicy { soft_ttl_days, superseded_ttl_days, batch_size: batch_size.max(1), dry_run },
            floor: SafetyFloor { max_fraction, floor_rows },
            interval: Duration::from_secs(interval),
        }
    }

    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        Problems::read_all(env, Self::read)
    }
}

/// Everything `mnemo-worker` needs.
#[derive(Debug, Clone)]
pub struct WorkerSettings {
    pub database: DatabaseSettings,
    pub embed: EmbedSettings,
    pub judge: JudgeSettings,
    pub retention: RetentionSettings,
    /// Queues this process serves, with the jobs it runs at once on each.
    pub queues: Vec<(String, usize)>,
    /// Rows per model call, and how long a batch waits to fill.
    pub embed_batch_size: usize,
    pub embed_max_wait: Duration,
    /// Failed attempts after which a row's embedding is given up (and recorded on the row).
    pub embed_max_attempts: i32,
    /// A worker silent this long is presumed dead and its jobs run again elsewhere.
    pub orphan_timeout: Duration,
    pub job_timeout: Duration,
    pub housekeeping_interval: Duration,
    /// Rows unembedded this long after their job was queued get a new job.
    pub embed_grace: Duration,
    /// Finished jobs are kept this long.
    pub job_retention: Duration,
    /// Where `/metrics` is served.
    pub listen: SocketAddr,
    pub log: LogSettings,
}

/// The queues a worker knows.
pub const QUEUES: &[&str] = &["embed", "judge", "retention"];

impl WorkerSettings {
    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        let mut problems = Problems::default();
        let database = DatabaseSettings::read(env, &mut problems);
        let embed = EmbedSettings::read(env, &mut problems);
        let judge = JudgeSettings::read(env, &mut problems);
        let retention = RetentionSettings::read(env, &mut problems);
        // Embed: 4× the batch, so the next batches gather while one is in the model. Judge: 2×
        // the batch, so the next batch is in hand when one finishes. Retention: one tenant's sweep
        // at a time per worker; sweeps are long and share the database with everything else.
        let default_queues = format!("embed=128,judge={},retention=1", judge.batch_size * 2);
        let queues = parse_queues(env.get(vars::WORKER_QUEUES).unwrap_or(&default_queues), &mut problems);
        if let Some((_, concurrency)) = queues.iter().find(|(q, _)| q == "judge")
            && *concurrency < judge.batch_size
        {
            problems.0.push(format!(
                "{}: judge={concurrency} is below {}={}, so a batch could never fill",
                vars::WORKER_QUEUES,
                vars::JUDGE_BATCH_SIZE,
                judge.batch_size
            ));
        }
        let embed_batch_size = problems.parsed(env, vars::EMBED_BATCH_SIZE, 32usize, "a whole number").max(1);
        let embed_max_wait = Duration::from_millis(problems.parsed(env, vars::EMBED_MAX_WAIT_MS, 5u64, "milliseconds"));
        let embed_max_attempts = problems.parsed(env, vars::EMBED_MAX_ATTEMPTS, 8i32, "a whole number").max(1);
        let secs = |problems: &mut Problems, name: &str, default: u64| {
            Duration::from_secs(problems.parsed(env, name, default, "a number of seconds").max(1))
        };
        let orphan_timeout = secs(&mut problems, vars::WORKER_ORPHAN_TIMEOUT_S, 20);
        let job_timeout = secs(&mut problems, vars::JOB_TIMEOUT_S, 120);
        let housekeeping_interval = secs(&mut problems, vars::HOUSEKEEPING_INTERVAL_S, 10);
        let embed_grace = secs(&mut problems, vars::EMBED_GRACE_S, 60);
        let job_retention = secs(&mut problems, vars::JOB_RETENTION_S, 3600);
        let listen = problems.parsed(env, vars::WORKER_LISTEN, SocketAddr::from(([127, 0, 0, 1], 9464)), "an address");
        let log = LogSettings::read(env, &mut problems);
        problems.finish(Self {
            database,
            embed,
            judge,
            retention,
            queues,
            embed_batch_size,
            embed_max_wait,
            embed_max_attempts,
            orphan_timeout,
            job_timeout,
            housekeeping_interval,
            embed_grace,
            job_retention,
            listen,
            log,
        })
    }
}

/// `embed=32,judge=4`: queue names, each with an optional concurrency (default 8).
fn parse_queues(raw: &str, problems: &mut Problems) -> Vec<(String, usize)> {
    let mut queues = Vec::new();
    for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, concurrency) = part.split_once('=').unwrap_or((part, "8"));
        if !QUEUES.contains(&name) {
            problems.0.push(format!("{}: unknown queue {name:?}; known: {}", vars::WORKER_QUEUES, QUEUES.join(", ")));
            continue;
        }
        match concurrency.parse::<usize>() {
            Ok(n) if n > 0 => queues.push((name.to_owned(), n)),
            _ => problems.0.push(format!("{}: {part:?} needs a positive concurrency", vars::WORKER_QUEUES)),
        }
    }
    if queues.is_empty() && problems.0.is_empty() {
        problems.0.push(format!("{} names no queue", vars::WORKER_QUEUES));
    }
    queues
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
    fn bad_recall_weights_fall_back_with_a_warning() {
        let env = Env::from_pairs([
            (vars::RECALL_WEIGHT_SESSION, "-1"),
            (vars::RECALL_WEIGHT_USER, "lots"),
            (vars::RECALL_WEIGHT_AGENT, "0"),
            (vars::RECALL_WEIGHT_TENANT, "2.5"),
        ]);
        let settings = RecallSettings::from_env(&env).expect("weights never stop start-up");
        assert_eq!(settings.weights, ClassWeights { session: 1.3, tenant: 2.5, user: 1.1, agent: 0.0 });
        assert_eq!(settings.warnings.len(), 2, "{:?}", settings.warnings);
        assert!(settings.warnings[0].contains(vars::RECALL_WEIGHT_SESSION));
        let bad_url = Env::from_pairs([(vars::RERANKER_URL, "tei:80")]);
        assert!(RecallSettings::from_env(&bad_url).is_err());
    }

    #[test]
    fn judge_settings_clamp_the_threshold_and_fall_back_to_openai_variables() {
        let env = Env::from_pairs([
            (vars::JUDGE_MODEL, "small-judge"),
            (vars::OPENAI_BASE_URL, "http://llm:8000/v1/"),
            (vars::JUDGE_THRESHOLD, "1.5"),
        ]);
        let settings = JudgeSettings::from_env(&env).expect("valid");
        let model = settings.model.expect("a model");
        assert_eq!((model.name.as_str(), model.base_url.as_deref()), ("small-judge", Some("http://llm:8000/v1")));
        assert_eq!((settings.threshold, settings.topk, settings.batch_size), (1.0, 5, 20));
        assert!(JudgeSettings::from_env(&Env::default()).expect("disabled").model.is_none());
        let nowhere = Env::from_pairs([(vars::JUDGE_MODEL, "m"), (vars::JUDGE_THRESHOLD, "close")]);
        let err = JudgeSettings::from_env(&nowhere).unwrap_err().to_string();
        assert!(err.contains(vars::JUDGE_BASE_URL) && err.contains(vars::JUDGE_THRESHOLD), "{err}");
        let small = Env::from_pairs([(vars::DATABASE_URL, "postgres://x"), (vars::WORKER_QUEUES, "embed,judge=4")]);
        assert!(WorkerSettings::from_env(&small).unwrap_err().to_string().contains("never fill"));
    }

    #[test]
    fn retention_defaults_and_refusals() {
        let settings = RetentionSettings::from_env(&Env::default()).expect("defaults");
        assert_eq!(settings.defaults, RetentionPolicy::default());
        assert_eq!(settings.floor, SafetyFloor { max_fraction: 0.2, floor_rows: 1000 });
        let env = Env::from_pairs([(vars::ANONYMIZE_DRY_RUN, "TRUE"), (vars::ANONYMIZE_SOFT_TTL_DAYS, "0")]);
        let settings = RetentionSettings::from_env(&env).expect("valid");
        assert!(settings.defaults.dry_run);
        assert_eq!(settings.defaults.soft_ttl_days, 0);
        let bad = Env::from_pairs([
            (vars::ANONYMIZE_DRY_RUN, "maybe"),
            (vars::ANONYMIZE_BATCH_SIZE, "0"),
            (vars::ANONYMIZE_MAX_FRACTION, "1.5"),
            (vars::ANONYMIZE_SUP_TTL_DAYS, "-1"),
        ]);
        assert_eq!(RetentionSettings::from_env(&bad).unwrap_err().0.len(), 4);
    }

    #[test]
    fn the_floor_needs_both_the_share_and_the_count() {
        let floor = SafetyFloor { max_fraction: 0.2, floor_rows: 1000 };
        assert!(!floor.refuses(1000, 1000), "not more than 1000 rows");
        assert!(floor.refuses(1001, 5000));
        assert!(!floor.refuses(1001, 5005), "exactly a fifth is allowed");
        assert!(!floor.refuses(5000, 1_000_000), "a small share of a large tenant");
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

//! The names of every environment variable mnemo reads.

/// A file of `NAME=value` lines read under the environment (see `Env::from_process`).
pub const CONFIG_FILE: &str = "MNEMO_CONFIG_FILE";

pub const DATABASE_URL: &str = "MNEMO_DATABASE_URL";
/// Read when `MNEMO_DATABASE_URL` is unset, as many tools set it.
pub const DATABASE_URL_FALLBACK: &str = "DATABASE_URL";
pub const DB_MAX_CONNECTIONS: &str = "MNEMO_DB_MAX_CONNECTIONS";
/// A streaming replica for recall, tool-output reads and exports; writes and jobs stay on the
/// primary.
pub const READ_DATABASE_URL: &str = "MNEMO_READ_DATABASE_URL";
/// How long a read waits for the replica to replay the primary's acknowledged writes.
pub const READ_REPLICA_WAIT_MS: &str = "MNEMO_READ_REPLICA_WAIT_MS";
pub const LISTEN: &str = "MNEMO_LISTEN";
pub const JWT_SECRET: &str = "MNEMO_JWT_SECRET";
/// A secret being rotated out: tokens it signed are accepted beside `MNEMO_JWT_SECRET`'s until it
/// is unset.
pub const JWT_PREVIOUS_SECRET: &str = "MNEMO_JWT_PREVIOUS_SECRET";
pub const JWT_PUBLIC_KEY_FILE: &str = "MNEMO_JWT_PUBLIC_KEY_FILE";
pub const JWT_AUDIENCE: &str = "MNEMO_JWT_AUDIENCE";
pub const JWT_ISSUER: &str = "MNEMO_JWT_ISSUER";
pub const MAX_TOOL_OUTPUT_BYTES: &str = "MNEMO_MAX_TOOL_OUTPUT_BYTES";
pub const WRITE_COMMITTERS: &str = "MNEMO_WRITE_COMMITTERS";
pub const WRITE_MAX_BATCH: &str = "MNEMO_WRITE_MAX_BATCH";
pub const EMBED_PROVIDER: &str = "MNEMO_EMBED_PROVIDER";
pub const EMBED_MODEL: &str = "MNEMO_EMBED_MODEL";
pub const EMBED_DIMENSIONS: &str = "MNEMO_EMBED_DIMENSIONS";
pub const EMBED_SEND_DIMENSIONS: &str = "MNEMO_EMBED_SEND_DIMENSIONS";
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
pub const EMBED_MAX_ATTEMPTS: &str = "MNEMO_EMBED_MAX_ATTEMPTS";
pub const EMBED_PREVIOUS_TURN: &str = "MNEMO_EMBED_PREVIOUS_TURN";
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
/// The most concurrent recalls' queries embedded in one call (1: each alone).
pub const RECALL_QUERY_BATCH: &str = "MNEMO_RECALL_QUERY_BATCH";
/// How many recent queries' vectors recall keeps (0: none).
pub const RECALL_QUERY_CACHE: &str = "MNEMO_RECALL_QUERY_CACHE";
/// How long a recall waits for its query's vector before it answers from full text alone.
pub const RECALL_QUERY_WAIT_MS: &str = "MNEMO_RECALL_QUERY_WAIT_MS";
/// Ranking signals' weights (0 turns one off) and the decay's half-life.
pub const SIGNAL_WEIGHT_IMPORTANCE: &str = "MNEMO_SIGNAL_WEIGHT_IMPORTANCE";
pub const SIGNAL_WEIGHT_CONFIDENCE: &str = "MNEMO_SIGNAL_WEIGHT_CONFIDENCE";
pub const SIGNAL_WEIGHT_DECAY: &str = "MNEMO_SIGNAL_WEIGHT_DECAY";
pub const DECAY_HALF_LIFE_DAYS: &str = "MNEMO_DECAY_HALF_LIFE_DAYS";
/// An episodic memory whose decay falls below this is no longer packed.
pub const DECAY_FLOOR: &str = "MNEMO_DECAY_FLOOR";
/// A faded memory whose decay falls below this is deleted (seed 004 forgets below 0.2).
pub const DECAY_DELETE_FLOOR: &str = "MNEMO_DECAY_DELETE_FLOOR";
/// The confidence an episodic memory needs to be promoted to semantic.
pub const PROMOTION_MIN_CONFIDENCE: &str = "MNEMO_PROMOTION_MIN_CONFIDENCE";
pub const RERANKER_URL: &str = "MNEMO_RERANKER_URL";
/// The most items one batch write takes.
pub const MAX_BATCH_ITEMS: &str = "MNEMO_MAX_BATCH_ITEMS";
pub const HEADER_TIMEOUT_S: &str = "MNEMO_HEADER_TIMEOUT_S";
pub const BODY_TIMEOUT_S: &str = "MNEMO_BODY_TIMEOUT_S";
pub const WRITE_TIMEOUT_S: &str = "MNEMO_WRITE_TIMEOUT_S";
pub const MAX_CLIENT_CONNECTIONS: &str = "MNEMO_MAX_CLIENT_CONNECTIONS";
pub const STATEMENT_TIMEOUT_S: &str = "MNEMO_STATEMENT_TIMEOUT_S";
pub const RATE_LIMIT_PER_TENANT: &str = "MNEMO_RATE_LIMIT_PER_TENANT";
pub const RATE_LIMIT_BURST: &str = "MNEMO_RATE_LIMIT_BURST";
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
/// The stdio MCP binary's (`mnemo-mcp`): the server it forwards to, the bearer token it sends
/// and how long it waits for an answer.
pub const MCP_SERVER_URL: &str = "MNEMO_URL";
pub const MCP_TOKEN: &str = "MNEMO_TOKEN";
pub const MCP_TIMEOUT_S: &str = "MNEMO_MCP_TIMEOUT_S";
pub const LOG_FORMAT: &str = "MNEMO_LOG_FORMAT";
pub const TOKENIZER: &str = "MNEMO_TOKENIZER";
/// The chat model later jobs share (compaction); its base URL and key fall back to
/// `OPENAI_BASE_URL` and `OPENAI_API_KEY`.
pub const LLM_MODEL: &str = "MNEMO_LLM_MODEL";
pub const LLM_BASE_URL: &str = "MNEMO_LLM_BASE_URL";
pub const LLM_API_KEY: &str = "MNEMO_LLM_API_KEY";
pub const LLM_TIMEOUT_MS: &str = "MNEMO_LLM_TIMEOUT_MS";
pub const COMPACT_TRIGGER_RATIO: &str = "MNEMO_COMPACT_TRIGGER_RATIO";
pub const COMPACT_TRIGGER_MESSAGES: &str = "MNEMO_COMPACT_TRIGGER_MESSAGES";
pub const COMPACT_KEEP_PAIRS: &str = "MNEMO_COMPACT_KEEP_PAIRS";
pub const COMPACT_KEEP_TOKENS: &str = "MNEMO_COMPACT_KEEP_TOKENS";
pub const COMPACT_SUMMARY_MAX_TOKENS: &str = "MNEMO_COMPACT_SUMMARY_MAX_TOKENS";
pub const COMPACT_CHUNK_TOKENS: &str = "MNEMO_COMPACT_CHUNK_TOKENS";
pub const WORKSPACE_MAX_FILE_BYTES: &str = "MNEMO_WORKSPACE_MAX_FILE_BYTES";
/// A directory holding AGENTS.md, SOUL.md, PROFILE.md and MEMORY.md: what the core files start as.
pub const WORKSPACE_TEMPLATES_DIR: &str = "MNEMO_WORKSPACE_TEMPLATES_DIR";
pub const WORKSPACE_PROMPT_MAX_TOKENS: &str = "MNEMO_WORKSPACE_PROMPT_MAX_TOKENS";
/// Days of daily notes a prompt's `## Recent Context` holds.
pub const MEMORY_RECENT_DAYS: &str = "MNEMO_MEMORY_RECENT_DAYS";
pub const EXTRACT_ENABLED: &str = "MNEMO_EXTRACT_ENABLED";
pub const EXTRACT_SKIP_CRON: &str = "MNEMO_EXTRACT_SKIP_CRON";
pub const EXTRACT_MIN_MESSAGES: &str = "MNEMO_EXTRACT_MIN_MESSAGES";
pub const EXTRACT_MIN_USER_CHARS: &str = "MNEMO_EXTRACT_MIN_USER_CHARS";
pub const EXTRACT_COOLDOWN_S: &str = "MNEMO_EXTRACT_COOLDOWN_S";
pub const EXTRACT_MAX_ATTEMPTS: &str = "MNEMO_EXTRACT_MAX_ATTEMPTS";
pub const EXTRACT_UPDATE_MEMORY: &str = "MNEMO_EXTRACT_UPDATE_MEMORY";
/// Extract what a compaction takes out of the context window, when it does (seed 001's
/// flushBeforeCompact).
pub const EXTRACT_BEFORE_COMPACTION: &str = "MNEMO_EXTRACT_BEFORE_COMPACTION";
/// Consolidation of daily notes into MEMORY.md at all (`false`: MEMORY.md changes only by hand or
/// by extraction's `MNEMO_EXTRACT_UPDATE_MEMORY`).
pub const CONSOLIDATE_ENABLED: &str = "MNEMO_CONSOLIDATE_ENABLED";
pub const CONSOLIDATE_DAY_RANGE: &str = "MNEMO_CONSOLIDATE_DAY_RANGE";
pub const CONSOLIDATE_MAX_MEMORY_TOKENS: &str = "MNEMO_CONSOLIDATE_MAX_MEMORY_TOKENS";
pub const CONSOLIDATE_THROTTLE_S: &str = "MNEMO_CONSOLIDATE_THROTTLE_S";
/// When consolidation runs for every (agent, user) with daily notes: a five-field cron
/// expression, read in each tenant's time zone; `off` turns it off.
pub const CONSOLIDATE_CRON: &str = "MNEMO_CONSOLIDATE_CRON";
pub const MAINTENANCE_INTERVAL_S: &str = "MNEMO_MAINTENANCE_INTERVAL_S";
pub const DAILY_NOTE_RETENTION_DAYS: &str = "MNEMO_DAILY_NOTE_RETENTION_DAYS";
pub const SESSION_RETENTION_DAYS: &str = "MNEMO_SESSION_RETENTION_DAYS";
/// OpenTelemetry's own variables (read by the OTLP exporter itself; mnemo checks these few):
/// traces are exported when either endpoint is set, over HTTP with protobuf.
pub const OTEL_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
pub const OTEL_TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
pub const OTEL_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_PROTOCOL";
pub const OTEL_TRACES_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL";
pub const OTEL_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
pub const OTEL_RESOURCE_ATTRIBUTES: &str = "OTEL_RESOURCE_ATTRIBUTES";
pub const OTEL_SDK_DISABLED: &str = "OTEL_SDK_DISABLED";

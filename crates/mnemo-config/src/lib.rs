//! Configuration: every environment variable mnemo reads is a named constant in [`vars`], each
//! binary's settings are a typed struct parsed from an [`Env`], and every error is reported at
//! once so an operator fixes a deployment in one round. Tests build an [`Env`] from a map and
//! never touch the process environment. Secrets are wrapped so they never print.

mod chat_model;
mod context;
mod database;
mod embed;
mod env;
mod judge;
mod recall;
mod retention;
mod server;
mod telemetry;
pub mod vars;
mod worker;
mod workspace;

pub use chat_model::ChatModel;
pub use context::{ContextSettings, TokenizerName};
pub use database::DatabaseSettings;
pub use embed::{EmbedProvider, EmbedSettings, LOCAL_EMBED_MODELS};
use env::Problems;
pub use env::{ConfigError, Env, Secret};
pub use judge::JudgeSettings;
pub use recall::{ClassWeights, RecallSettings, SignalSettings};
pub use retention::RetentionSettings;
pub use server::{JwtKey, MIN_JWT_SECRET_BYTES, ServerSettings};
pub use telemetry::{
    LogFormat, LogSettings, Telemetry, TraceExport, batch_span, continue_trace, guarded_filter, init_tracing,
    metrics_handle, model_span, shutdown_signal, traceparent, with_causes,
};
pub use worker::{WorkerSettings, orphan_timeout};
pub use workspace::{
    ConsolidationSettings, ExtractionSettings, MAX_EXTRACT_MIN_MESSAGES, MaintenanceSettings, WorkspaceSettings,
};

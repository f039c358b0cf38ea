use std::path::PathBuf;
use std::time::Duration;

use crate::{ConfigError, Env, Problems, Secret, vars};

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
    pub(crate) fn read(env: &Env, problems: &mut Problems) -> Self {
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

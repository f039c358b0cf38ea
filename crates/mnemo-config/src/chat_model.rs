use std::time::Duration;

use crate::{Env, Problems, Secret, vars};

/// An OpenAI-compatible chat model: the judge's, or the one later jobs share (compaction).
#[derive(Debug, Clone)]
pub struct ChatModel {
    pub name: String,
    /// Unset means the client library's default (OpenAI itself).
    pub base_url: Option<String>,
    pub api_key: Secret<String>,
    pub timeout: Duration,
}

/// The variables that name one chat model. The base URL and key fall back to `OPENAI_BASE_URL`
/// and `OPENAI_API_KEY`.
pub(crate) struct ChatModelVars {
    pub model: &'static str,
    pub base_url: &'static str,
    pub api_key: &'static str,
    pub timeout_ms: &'static str,
}

impl ChatModel {
    /// The model `names.model` names; `None` when it is unset or empty.
    pub(crate) fn read(env: &Env, problems: &mut Problems, names: ChatModelVars, timeout_ms: u64) -> Option<Self> {
        let name = env.get(names.model)?;
        let base_url = env.get(names.base_url).or_else(|| env.get(vars::OPENAI_BASE_URL));
        let api_key = env.get(names.api_key).or_else(|| env.get(vars::OPENAI_API_KEY)).unwrap_or("");
        if base_url.is_none() && api_key.is_empty() {
            problems.0.push(format!(
                "{}={name:?} needs {} (or {}) and/or {} (or {})",
                names.model,
                names.base_url,
                vars::OPENAI_BASE_URL,
                names.api_key,
                vars::OPENAI_API_KEY
            ));
        }
        let timeout_ms = problems.milliseconds(env, names.timeout_ms, timeout_ms);
        Some(Self {
            name: name.trim().to_owned(),
            base_url: base_url.map(|u| u.trim().trim_end_matches('/').to_owned()),
            api_key: Secret::new(api_key.to_owned()),
            timeout: Duration::from_millis(timeout_ms),
        })
    }
}

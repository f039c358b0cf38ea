use std::time::Duration;

use crate::{Env, Problems, Secret};

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
        let (base_url, api_key) =
            problems.endpoint(env, names.base_url, names.api_key, &format!("{}={name:?}", names.model));
        let timeout_ms = problems.milliseconds(env, names.timeout_ms, timeout_ms);
        Some(Self { name: name.trim().to_owned(), base_url, api_key, timeout: Duration::from_millis(timeout_ms) })
    }
}

use crate::chat_model::{ChatModel, ChatModelVars};
use crate::{ConfigError, Env, Problems, vars};

/// The largest `MNEMO_COMPACT_SUMMARY_MAX_TOKENS`.
const MAX_SUMMARY_TOKENS: u32 = 2000;

/// How tokens are counted for context windows (`MNEMO_TOKENIZER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerName {
    /// tiktoken's `o200k_base` (GPT-4o and later).
    O200kBase,
    /// tiktoken's `cl100k_base` (GPT-4, GPT-3.5).
    Cl100kBase,
    /// An estimate by characters (the seeds' 3.5 a token, for ASCII), for models no BPE here
    /// matches.
    CharEstimate,
}

impl TokenizerName {
    pub const ALL: [Self; 3] = [Self::O200kBase, Self::Cl100kBase, Self::CharEstimate];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::O200kBase => "o200k_base",
            Self::Cl100kBase => "cl100k_base",
            Self::CharEstimate => "chars",
        }
    }
}

/// Context windows and their compaction. The API server reads the triggers and the tokenizer,
/// and what compaction keeps (to ask only when there is something to compact); the worker reads
/// the tokenizer and what compaction keeps (to cut) and the model that summarizes: both must be
/// given the same.
#[derive(Debug, Clone)]
pub struct ContextSettings {
    pub tokenizer: TokenizerName,
    /// Compact when a session's history passes this fraction of the caller's `max_input_tokens`
    /// (0 disables).
    pub trigger_ratio: f64,
    /// Compact when more than this many messages came since the last compaction (0 disables).
    pub trigger_messages: usize,
    /// Turns compaction leaves verbatim.
    pub keep_pairs: usize,
    /// When set, compaction leaves this many tokens of the newest messages instead.
    pub keep_tokens: Option<u64>,
    /// The summary's `max_tokens`.
    pub summary_max_tokens: u32,
    /// The most tokens of messages one summarizing call reads; more are summarized in steps,
    /// each bringing the summary up to date.
    pub chunk_tokens: u64,
    /// The model that summarizes; `None` makes compaction truncate.
    pub model: Option<ChatModel>,
}

impl Default for ContextSettings {
    fn default() -> Self {
        Self {
            tokenizer: TokenizerName::O200kBase,
            trigger_ratio: 0.75,
            trigger_messages: 50,
            keep_pairs: 2,
            keep_tokens: None,
            summary_max_tokens: 300,
            chunk_tokens: 8000,
            model: None,
        }
    }
}

impl ContextSettings {
    /// What compaction leaves verbatim: the newest `keep_tokens` when set, else `keep_pairs`
    /// turns. The job plans by it, and a context call decides by it whether to ask for one.
    pub fn compaction_keeps(&self) -> mnemo_core::Keep {
        self.keep_tokens.map_or(mnemo_core::Keep::Turns(self.keep_pairs), mnemo_core::Keep::Tokens)
    }

    pub(crate) fn read(env: &Env, problems: &mut Problems) -> Self {
        let defaults = Self::default();
        let mut tokenizer = defaults.tokenizer;
        if let Some(raw) = env.get(vars::TOKENIZER) {
            match TokenizerName::ALL.into_iter().find(|t| t.as_str() == raw.trim()) {
                Some(found) => tokenizer = found,
                None => {
                    let known: Vec<&str> = TokenizerName::ALL.iter().map(|t| t.as_str()).collect();
                    problems.0.push(format!(
                        "{}: unknown tokenizer {raw:?}; known: {}",
                        vars::TOKENIZER,
                        known.join(", ")
                    ))
                }
            }
        }
        let trigger_ratio = problems.parsed(env, vars::COMPACT_TRIGGER_RATIO, defaults.trigger_ratio, "a number");
        if !(0.0..=1.0).contains(&trigger_ratio) {
            problems.0.push(format!("{}={trigger_ratio} must be between 0 and 1", vars::COMPACT_TRIGGER_RATIO));
        }
        let trigger_messages = problems.bounded(
            env,
            vars::COMPACT_TRIGGER_MESSAGES,
            defaults.trigger_messages,
            0..=1_000_000,
            "a whole number",
        );
        let keep_pairs =
            problems.bounded(env, vars::COMPACT_KEEP_PAIRS, defaults.keep_pairs, 0..=10_000, "a whole number");
        let keep_tokens = match problems.bounded(env, vars::COMPACT_KEEP_TOKENS, 0u64, 0..=10_000_000, "a whole number")
        {
            0 => None,
            n => Some(n),
        };
        let summary_max_tokens =
            problems.parsed(env, vars::COMPACT_SUMMARY_MAX_TOKENS, defaults.summary_max_tokens, "a whole number");
        // A summary is stored as a memory row (at most 16 KiB): the twice 2,000 tokens that the
        // job takes from a server ignoring max_tokens fit at about 4 bytes a token (English);
        // 8,000 allowed summaries that passed every check and could not be stored.
        if !(50..=MAX_SUMMARY_TOKENS).contains(&summary_max_tokens) {
            problems.0.push(format!(
                "{}={summary_max_tokens} must be between 50 and {MAX_SUMMARY_TOKENS} (a summary is stored in at most 16 KiB)",
                vars::COMPACT_SUMMARY_MAX_TOKENS
            ));
        }
        let chunk_tokens = problems.parsed(env, vars::COMPACT_CHUNK_TOKENS, defaults.chunk_tokens, "a whole number");
        if chunk_tokens < 500 {
            problems.0.push(format!("{}={chunk_tokens} must be at least 500", vars::COMPACT_CHUNK_TOKENS));
        }
        let model = ChatModel::read(
            env,
            problems,
            ChatModelVars {
                model: vars::LLM_MODEL,
                base_url: vars::LLM_BASE_URL,
                api_key: vars::LLM_API_KEY,
                timeout_ms: vars::LLM_TIMEOUT_MS,
            },
            30_000,
        );
        Self {
            tokenizer,
            trigger_ratio,
            trigger_messages,
            keep_pairs,
            keep_tokens,
            summary_max_tokens,
            chunk_tokens,
            model,
        }
    }

    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        Problems::read_all(env, Self::read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tokenizer_defaults_to_o200k_and_an_unknown_one_is_refused() {
        assert_eq!(
            ContextSettings::from_env(&Env::from_pairs::<&str, &str>([])).expect("ok").tokenizer,
            TokenizerName::O200kBase
        );
        let chars = ContextSettings::from_env(&Env::from_pairs([(vars::TOKENIZER, "chars")])).expect("ok");
        assert_eq!(chars.tokenizer, TokenizerName::CharEstimate);
        let err = ContextSettings::from_env(&Env::from_pairs([(vars::TOKENIZER, "gpt2")])).unwrap_err();
        assert!(err.to_string().contains("unknown tokenizer"), "{err}");
    }

    #[test]
    fn compaction_defaults_off_switches_and_bad_values() {
        let defaults = ContextSettings::from_env(&Env::default()).expect("ok");
        assert_eq!((defaults.trigger_ratio, defaults.trigger_messages, defaults.keep_pairs), (0.75, 50, 2));
        assert_eq!((defaults.keep_tokens, defaults.summary_max_tokens), (None, 300));
        assert!(defaults.model.is_none());
        let off = ContextSettings::from_env(&Env::from_pairs([
            (vars::COMPACT_TRIGGER_RATIO, "0"),
            (vars::COMPACT_TRIGGER_MESSAGES, "0"),
            (vars::COMPACT_KEEP_TOKENS, "2000"),
            (vars::LLM_MODEL, "small"),
            (vars::OPENAI_BASE_URL, "http://llm:8000/v1/"),
        ]))
        .expect("ok");
        assert_eq!((off.trigger_ratio, off.trigger_messages, off.keep_tokens), (0.0, 0, Some(2000)));
        assert_eq!(off.model.expect("a model").base_url.as_deref(), Some("http://llm:8000/v1"));
        let err = ContextSettings::from_env(&Env::from_pairs([
            (vars::COMPACT_TRIGGER_RATIO, "1.5"),
            (vars::COMPACT_SUMMARY_MAX_TOKENS, "10"),
            (vars::LLM_MODEL, "small"),
        ]))
        .unwrap_err()
        .to_string();
        for name in [vars::COMPACT_TRIGGER_RATIO, vars::COMPACT_SUMMARY_MAX_TOKENS, vars::LLM_BASE_URL] {
            assert!(err.contains(name), "{err}");
        }
        // A summary that could not be stored is not allowed either.
        let summary =
            |tokens: &str| ContextSettings::from_env(&Env::from_pairs([(vars::COMPACT_SUMMARY_MAX_TOKENS, tokens)]));
        assert_eq!(summary("2000").expect("the largest").summary_max_tokens, 2000);
        assert!(summary("2001").unwrap_err().to_string().contains("16 KiB"));
    }
}

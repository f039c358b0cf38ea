use crate::{ConfigError, Env, Problems, vars};

/// How tokens are counted for context windows (`MNEMO_TOKENIZER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerName {
    /// tiktoken's `o200k_base` (GPT-4o and later).
    O200kBase,
    /// tiktoken's `cl100k_base` (GPT-4, GPT-3.5).
    Cl100kBase,
    /// The seeds' estimate, characters / 3.5, for models no BPE here matches.
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

/// Context windows: how tokens are counted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ContextSettings {
    pub tokenizer: TokenizerName,
}

impl Default for ContextSettings {
    fn default() -> Self {
        Self { tokenizer: TokenizerName::O200kBase }
    }
}

impl ContextSettings {
    pub(crate) fn read(env: &Env, problems: &mut Problems) -> Self {
        let mut settings = Self::default();
        if let Some(raw) = env.get(vars::TOKENIZER) {
            match TokenizerName::ALL.into_iter().find(|t| t.as_str() == raw.trim()) {
                Some(tokenizer) => settings.tokenizer = tokenizer,
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
        settings
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
}

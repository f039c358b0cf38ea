use std::time::Duration;

use crate::chat_model::{ChatModel, ChatModelVars};
use crate::{ConfigError, Env, Problems, vars};

/// How the contradiction judge finds candidates and batches its work.
#[derive(Debug, Clone)]
pub struct JudgeSettings {
    /// `None` (an empty `MNEMO_JUDGE_MODEL`) disables the model step; keyed facts still supersede.
    pub model: Option<ChatModel>,
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
    pub(crate) fn read(env: &Env, problems: &mut Problems) -> Self {
        let model = ChatModel::read(
            env,
            problems,
            ChatModelVars {
                model: vars::JUDGE_MODEL,
                base_url: vars::JUDGE_BASE_URL,
                api_key: vars::JUDGE_API_KEY,
                timeout_ms: vars::JUDGE_TIMEOUT_MS,
            },
            20_000,
        );
        let topk = problems.parsed(env, vars::JUDGE_TOPK, 5usize, "a whole number");
        if !(1..=50).contains(&topk) {
            problems.0.push(format!("{}={topk} must be between 1 and 50", vars::JUDGE_TOPK));
        }
        // Clamped rather than refused, as the seed says; not a number at all is still an error.
        let threshold = problems.parsed(env, vars::JUDGE_THRESHOLD, 0.7f64, "a number");
        let threshold = if threshold.is_nan() { 0.7 } else { threshold.clamp(0.0, 1.0) };
        let batch_size = Self::read_batch_size(env, problems);
        // Well inside a job's time: a lone fact's batch waits this long before it is judged.
        let max_wait =
            Duration::from_millis(problems.bounded(env, vars::JUDGE_MAX_WAIT_MS, 50u64, 0..=10_000, "milliseconds"));
        let grace =
            Duration::from_secs(problems.bounded(env, vars::JUDGE_GRACE_S, 120u64, 1..=86_400, "a number of seconds"));
        Self { model, topk, threshold, batch_size, max_wait, grace }
    }

    fn read_batch_size(env: &Env, problems: &mut Problems) -> usize {
        let batch_size = problems.parsed(env, vars::JUDGE_BATCH_SIZE, 20usize, "a whole number");
        if !(1..=500).contains(&batch_size) {
            problems.0.push(format!("{}={batch_size} must be between 1 and 500", vars::JUDGE_BATCH_SIZE));
        }
        batch_size.max(1)
    }

    /// `MNEMO_JUDGE_BATCH_SIZE` alone, as the workers read it: the size `judge tune` takes as
    /// the one in use, whatever the other judge settings of the shell it runs in.
    pub fn batch_size_from_env(env: &Env) -> Result<usize, ConfigError> {
        Problems::read_all(env, Self::read_batch_size)
    }

    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        Problems::read_all(env, Self::read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}

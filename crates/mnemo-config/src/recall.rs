use std::time::Duration;

use mnemo_core::SignalWeights;

use crate::{ConfigError, Env, Problems, vars};

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

/// The ranking signals (read by the server's recall) and what maintenance does with decay and
/// confidence (read by the worker).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SignalSettings {
    pub weights: SignalWeights,
    /// An episodic memory's decay below which packs leave it out (0: never).
    pub decay_floor: f64,
    /// A faded memory's decay below which maintenance deletes it (0: never; at most
    /// `decay_floor`, so a memory leaves packs before it is forgotten).
    pub decay_delete_floor: f64,
    /// The confidence an episodic memory seen in two sessions needs to become semantic.
    pub promotion_min_confidence: f64,
}

impl Default for SignalSettings {
    fn default() -> Self {
        Self {
            weights: SignalWeights { importance: 0.1, confidence: 0.1, decay: 0.02, half_life_days: 30.0 },
            decay_floor: 0.05,
            decay_delete_floor: 0.0,
            promotion_min_confidence: 0.75,
        }
    }
}

impl SignalSettings {
    pub(crate) fn read(env: &Env, problems: &mut Problems) -> Self {
        let defaults = Self::default();
        let mut unit = |name: &str, default: f64| {
            let value = problems.parsed(env, name, default, "a number");
            if !(0.0..=1.0).contains(&value) {
                problems.0.push(format!("{name} must be between 0 and 1"));
            }
            value
        };
        let d = defaults.weights;
        let (importance, confidence, decay) = (
            unit(vars::SIGNAL_WEIGHT_IMPORTANCE, d.importance),
            unit(vars::SIGNAL_WEIGHT_CONFIDENCE, d.confidence),
            unit(vars::SIGNAL_WEIGHT_DECAY, d.decay),
        );
        let decay_floor = unit(vars::DECAY_FLOOR, defaults.decay_floor);
        let decay_delete_floor = unit(vars::DECAY_DELETE_FLOOR, defaults.decay_delete_floor);
        let promotion_min_confidence = unit(vars::PROMOTION_MIN_CONFIDENCE, defaults.promotion_min_confidence);
        let half_life_days = problems.parsed(env, vars::DECAY_HALF_LIFE_DAYS, d.half_life_days, "a number of days");
        if !(half_life_days > 0.0 && half_life_days <= 36_500.0) {
            problems.0.push(format!("{} must be above 0 and at most 36500", vars::DECAY_HALF_LIFE_DAYS));
        }
        // A memory leaves packs for a while before it is deleted, so a recall can still save it.
        if decay_delete_floor > 0.0 && decay_delete_floor >= decay_floor {
            problems.0.push(format!(
                "{}={decay_delete_floor} must be below {}={decay_floor}: a memory leaves packs before it is deleted",
                vars::DECAY_DELETE_FLOOR,
                vars::DECAY_FLOOR
            ));
        }
        let weights = SignalWeights { importance, confidence, decay, half_life_days };
        Self { weights, decay_floor, decay_delete_floor, promotion_min_confidence }
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
    /// The most concurrent recalls' queries embedded in one call (1: each alone).
    pub query_batch: usize,
    /// How many recent queries' vectors are kept (0: none).
    pub query_cache: usize,
    /// How long a recall waits for its query's vector (queued behind others, or from a provider
    /// that hangs) before it answers from full text alone, `degraded`.
    pub query_wait: Duration,
    /// Importance, confidence and decay: the bounded factor on fused scores.
    pub signals: SignalWeights,
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
            query_batch: 32,
            query_cache: 1024,
            query_wait: Duration::from_millis(2000),
            signals: SignalSettings::default().weights,
            warnings: Vec::new(),
        }
    }
}

impl RecallSettings {
    pub(crate) fn read(env: &Env, problems: &mut Problems) -> Self {
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
        let timeout_ms = problems.milliseconds(env, vars::RERANKER_TIMEOUT_MS, 1000);
        let prune_fraction = problems.parsed(env, vars::RECALL_PRUNE_FRACTION, defaults.prune_fraction, "a fraction");
        if !(0.0..=1.0).contains(&prune_fraction) {
            problems.0.push(format!("{} must be between 0 and 1", vars::RECALL_PRUNE_FRACTION));
        }
        let query_batch = problems.parsed(env, vars::RECALL_QUERY_BATCH, defaults.query_batch, "a whole number");
        if !(1..=256).contains(&query_batch) {
            problems.0.push(format!("{} must be between 1 and 256", vars::RECALL_QUERY_BATCH));
        }
        let query_cache = problems.parsed(env, vars::RECALL_QUERY_CACHE, defaults.query_cache, "a whole number");
        if query_cache > 1_000_000 {
            problems.0.push(format!("{} must be at most 1000000", vars::RECALL_QUERY_CACHE));
        }
        let query_wait = problems.bounded(env, vars::RECALL_QUERY_WAIT_MS, 2000, 10..=60_000, "milliseconds");
        let signals = SignalSettings::read(env, problems).weights;
        Self {
            weights,
            reranker_url,
            rerank_timeout: Duration::from_millis(timeout_ms),
            prune_fraction,
            query_batch,
            query_cache,
            query_wait: Duration::from_millis(query_wait),
            signals,
            warnings,
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
}

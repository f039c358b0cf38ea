use std::path::PathBuf;
use std::time::Duration;

use crate::{ConfigError, Env, Problems, Secret, vars};

/// Which embedding provider, and how to reach it.
#[derive(Debug, Clone)]
pub enum EmbedProvider {
    /// One of [`LOCAL_EMBED_MODELS`] in-process, loaded from a folder made by
    /// `scripts/fetch-model.sh`.
    Local { model_dir: PathBuf, dimensions: usize },
    /// Any OpenAI-compatible `/v1/embeddings` endpoint.
    /// `base_url` unset means the client library's default (OpenAI itself).
    OpenAi {
        base_url: Option<String>,
        api_key: Secret<String>,
        dimensions: usize,
        /// Whether requests carry `dimensions`, asking the model to shorten its vectors (OpenAI's
        /// text-embedding-3 models). Off by default: servers and models that cannot shorten
        /// (ada-002, most models behind vLLM) refuse the field, failing every row.
        send_dimensions: bool,
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

/// The most dimensions pgvector's HNSW index takes for a `vector`.
const MAX_INDEXED_DIMENSIONS: usize = 2000;

/// The models the local provider runs, with their dimensions; the first is the default.
/// all-mpnet-base-v2 ranks better and costs 4.4 to 6.2 times as much per text
/// (docs/benchmarks.md, "A stronger local model").
pub const LOCAL_EMBED_MODELS: [(&str, usize); 2] = [("all-MiniLM-L6-v2", 384), ("all-mpnet-base-v2", 768)];

impl EmbedSettings {
    pub(crate) fn read(env: &Env, problems: &mut Problems) -> Self {
        let model = env.get(vars::EMBED_MODEL);
        match env.get(vars::EMBED_PROVIDER).unwrap_or("local") {
            "local" => {
                let (name, dimensions) = match model {
                    None => LOCAL_EMBED_MODELS[0],
                    Some(m) => LOCAL_EMBED_MODELS.into_iter().find(|(name, _)| *name == m).unwrap_or_else(|| {
                        let known: Vec<&str> = LOCAL_EMBED_MODELS.iter().map(|(name, _)| *name).collect();
                        problems.0.push(format!(
                            "{}={m:?}: the local provider runs {}; use the openai provider for others",
                            vars::EMBED_MODEL,
                            known.join(" or ")
                        ));
                        LOCAL_EMBED_MODELS[0]
                    }),
                };
                let model_dir =
                    env.get(vars::LOCAL_MODEL_DIR).map_or_else(|| PathBuf::from("models").join(name), PathBuf::from);
                Self { provider: EmbedProvider::Local { model_dir, dimensions }, model: name.to_owned() }
            }
            "openai" => {
                let (base_url, api_key) =
                    problems.endpoint(env, vars::EMBED_BASE_URL, vars::EMBED_API_KEY, "the openai provider");
                if model.is_none() {
                    problems
                        .0
                        .push(format!("the openai provider needs {} (e.g. text-embedding-3-small)", vars::EMBED_MODEL));
                }
                let dimensions = problems.parsed(env, vars::EMBED_DIMENSIONS, 0usize, "a whole number");
                if dimensions == 0 {
                    problems.0.push(format!("the openai provider needs {} (e.g. 1536)", vars::EMBED_DIMENSIONS));
                } else if dimensions > MAX_INDEXED_DIMENSIONS {
                    // Every search would scan every vector: pgvector's HNSW index takes no more.
                    problems.0.push(format!(
                        "{}={dimensions}: pgvector indexes vectors of at most {MAX_INDEXED_DIMENSIONS} dimensions; \
                         ask the model for shorter ones ({}=true, for text-embedding-3 models)",
                        vars::EMBED_DIMENSIONS,
                        vars::EMBED_SEND_DIMENSIONS
                    ));
                }
                let send_dimensions = problems.parsed(env, vars::EMBED_SEND_DIMENSIONS, false, "true or false");
                let timeout_ms = problems.milliseconds(env, vars::EMBED_TIMEOUT_MS, 10_000);
                let max_inputs = problems.bounded(env, vars::EMBED_MAX_INPUTS, 256usize, 1..=100_000, "a whole number");
                Self {
                    provider: EmbedProvider::OpenAi {
                        base_url,
                        api_key,
                        dimensions,
                        send_dimensions,
                        timeout: Duration::from_millis(timeout_ms),
                        max_inputs,
                    },
                    model: model.unwrap_or_default().to_owned(),
                }
            }
            other => {
                problems.0.push(format!("{}={other:?} must be local or openai", vars::EMBED_PROVIDER));
                Self {
                    provider: EmbedProvider::Local { model_dir: PathBuf::new(), dimensions: 0 },
                    model: String::new(),
                }
            }
        }
    }

    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        Problems::read_all(env, Self::read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local(pairs: &[(&str, &str)]) -> Result<(String, PathBuf, usize), ConfigError> {
        let settings = EmbedSettings::from_env(&Env::from_pairs(pairs.iter().copied()))?;
        match settings.provider {
            EmbedProvider::Local { model_dir, dimensions } => Ok((settings.model, model_dir, dimensions)),
            EmbedProvider::OpenAi { .. } => panic!("not the local provider"),
        }
    }

    #[test]
    fn the_local_provider_runs_either_model_from_its_own_folder() {
        let default = local(&[]).unwrap();
        assert_eq!(default, ("all-MiniLM-L6-v2".into(), "models/all-MiniLM-L6-v2".into(), 384));
        let mpnet = local(&[(vars::EMBED_MODEL, "all-mpnet-base-v2")]).unwrap();
        assert_eq!(mpnet, ("all-mpnet-base-v2".into(), "models/all-mpnet-base-v2".into(), 768));
        let elsewhere = local(&[(vars::EMBED_MODEL, "all-mpnet-base-v2"), (vars::LOCAL_MODEL_DIR, "/srv/mpnet")]);
        assert_eq!(elsewhere.unwrap().1, PathBuf::from("/srv/mpnet"));
    }

    #[test]
    fn vectors_too_long_to_index_are_refused() {
        let openai = |dimensions: &str| {
            EmbedSettings::from_env(&Env::from_pairs([
                (vars::EMBED_PROVIDER, "openai"),
                (vars::EMBED_API_KEY, "k"),
                (vars::EMBED_MODEL, "text-embedding-3-large"),
                (vars::EMBED_DIMENSIONS, dimensions),
            ]))
        };
        assert!(openai("2000").is_ok());
        let err = openai("3072").unwrap_err().to_string();
        assert!(err.contains("MNEMO_EMBED_DIMENSIONS=3072") && err.contains(vars::EMBED_SEND_DIMENSIONS), "{err}");
    }

    #[test]
    fn the_local_provider_refuses_a_model_it_cannot_run() {
        let err = local(&[(vars::EMBED_MODEL, "text-embedding-3-small")]).unwrap_err().to_string();
        assert!(err.contains("all-MiniLM-L6-v2 or all-mpnet-base-v2") && err.contains("openai"), "{err}");
    }
}

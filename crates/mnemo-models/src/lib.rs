//! Model providers, behind the traits in `mnemo-core`: the local embedder (all-MiniLM-L6-v2 or
//! all-mpnet-base-v2; candle, in-process), any OpenAI-compatible embeddings endpoint and chat judge
//! (async-openai), and a TEI-compatible reranker. This crate alone talks to model endpoints.
//! Providers never retry on their own: callers own retries, so backoff is durable and visible.

use std::path::PathBuf;
use std::sync::{Arc, Once};

use mnemo_config::{ContextSettings, EmbedProvider, EmbedSettings, JudgeSettings};
use mnemo_core::{Consolidator, Embedder, Extractor, Judge, Summarizer};

mod bert;
mod chat_consolidate;
mod chat_extract;
mod chat_judge;
mod chat_summary;
mod local;
mod openai;
mod tei;
mod tokens;
mod transport;

pub use chat_consolidate::{CONSOLIDATE_MARKER, OpenAiConsolidator, parse_consolidation};
pub use chat_extract::{EXTRACT_MARKER, OpenAiExtractor, parse_extraction};
pub use chat_judge::{OpenAiJudge, parse_verdicts};
pub use chat_summary::{OpenAiSummarizer, SUMMARIZE_MARKER};
pub use local::LocalEmbedder;
pub use openai::OpenAiEmbedder;
pub use tei::TeiReranker;
pub use tokens::{Tokenizer, counting};

/// Keeps candle's element-wise operations on the thread that runs a forward pass, by running
/// this program again in place (`exec`: the same process id, arguments and environment) with
/// `CANDLE_NUM_THREADS=1`, unless that variable is set. Otherwise candle splits each of those
/// operations across helper threads that spin at a barrier, one caller at a time; on two cores
/// shared with PostgreSQL and the API that cost more than it saved: without the helpers the local
/// model embedded 28% more rows per second in the worker and served 1.2× the recalls at 32
/// clients (docs/benchmarks.md). Matrix multiplications still use the physical cores. Setting the
/// variable from within would need `unsafe`. Call it at the top of `main`, before any work; if
/// `exec` fails, the program goes on with candle's default and says so.
pub fn keep_elementwise_ops_on_one_thread() {
    use std::os::unix::process::CommandExt;

    if std::env::var_os("CANDLE_NUM_THREADS").is_some() {
        return;
    }
    let mut args = std::env::args_os();
    let mut again = std::process::Command::new("/proc/self/exe"); // this binary even if replaced on disk
    if let Some(name) = args.next() {
        again.arg0(name);
    }
    let failed = again.args(args).env("CANDLE_NUM_THREADS", "1").exec();
    eprintln!("cannot restart with CANDLE_NUM_THREADS=1 ({failed}); the local model keeps candle's helper threads");
}

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("the local embedding model in {dir} cannot be used: {detail}")]
    LocalModel { dir: PathBuf, detail: String },
    #[error("the embedding client cannot be built: {0}")]
    Client(String),
}

/// The embedder the settings name. The local model is loaded (and run once) here, so a missing
/// or corrupt model fails at start-up.
pub fn embedder(settings: &EmbedSettings) -> Result<Arc<dyn Embedder>, ModelError> {
    match &settings.provider {
        EmbedProvider::Local { model_dir, dimensions } => {
            Ok(Arc::new(LocalEmbedder::load(model_dir, &settings.model, *dimensions)?))
        }
        EmbedProvider::OpenAi { base_url, api_key, dimensions, send_dimensions, timeout, max_inputs } => {
            install_tls_provider();
            Ok(Arc::new(OpenAiEmbedder::new(
                base_url.as_deref(),
                api_key.expose(),
                &settings.model,
                *dimensions,
                *send_dimensions,
                *timeout,
                *max_inputs,
            )?))
        }
    }
}

/// The contradiction judge the settings name; `None` when the model step is disabled.
pub fn judge(settings: &JudgeSettings) -> Result<Option<Arc<dyn Judge>>, ModelError> {
    let Some(model) = &settings.model else { return Ok(None) };
    let judge = OpenAiJudge::new(model.base_url.as_deref(), model.api_key.expose(), &model.name, model.timeout)?;
    Ok(Some(Arc::new(judge)))
}

/// The model that summarizes sessions; `None` when none is configured (compaction truncates).
pub fn summarizer(settings: &ContextSettings) -> Result<Option<Arc<dyn Summarizer>>, ModelError> {
    let Some(model) = &settings.model else { return Ok(None) };
    let summarizer =
        OpenAiSummarizer::new(model.base_url.as_deref(), model.api_key.expose(), &model.name, model.timeout)?;
    Ok(Some(Arc::new(summarizer)))
}

/// The model that extracts memories after conversations; `None` when none is configured.
pub fn extractor(settings: &ContextSettings, max_file_bytes: usize) -> Result<Option<Arc<dyn Extractor>>, ModelError> {
    let Some(model) = &settings.model else { return Ok(None) };
    let extractor = OpenAiExtractor::new(
        model.base_url.as_deref(),
        model.api_key.expose(),
        &model.name,
        model.timeout,
        max_file_bytes,
    )?;
    Ok(Some(Arc::new(extractor)))
}

/// The model that consolidates daily notes into MEMORY.md; `None` when none is configured.
pub fn consolidator(settings: &ContextSettings) -> Result<Option<Arc<dyn Consolidator>>, ModelError> {
    let Some(model) = &settings.model else { return Ok(None) };
    let consolidator =
        OpenAiConsolidator::new(model.base_url.as_deref(), model.api_key.expose(), &model.name, model.timeout)?;
    Ok(Some(Arc::new(consolidator)))
}

/// HTTPS to providers uses rustls with ring, which is already in the build for PostgreSQL TLS.
/// Every HTTP client in a process that links this crate needs it: call before building one.
pub fn install_tls_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Fails only if another provider was installed first, which is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

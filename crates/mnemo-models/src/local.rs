//! all-MiniLM-L6-v2 run in-process with candle: BERT, mask-weighted mean pooling, L2
//! normalisation. The tokenizer shipped with the model pads every input to 128 tokens and cuts at
//! 128; here it pads to the longest text of a batch and cuts at 256 (`sentence_bert_config.json`'s
//! `max_seq_length`), which is 3–6× faster on short texts and keeps long ones whole.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use mnemo_core::{EmbedError, EmbedFuture, Embedder};
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

use crate::ModelError;
use crate::bert::{BertModel, Config};

/// The name vectors from this model are stored under.
pub const LOCAL_MODEL_NAME: &str = "all-MiniLM-L6-v2";
const MAX_TOKENS: usize = 256;

#[derive(Debug)]
pub struct LocalEmbedder {
    inner: Arc<Inner>,
    dimensions: usize,
}

struct Inner {
    // Forward passes may run side by side (the dispatcher runs two batches at once): on small
    // batches one pass cannot keep every core busy, so two in parallel share the cores better.
    model: BertModel,
    tokenizer: Tokenizer,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LocalModel")
    }
}

fn missing(dir: &Path, what: &str, e: impl std::fmt::Display) -> ModelError {
    ModelError::LocalModel {
        dir: dir.to_path_buf(),
        detail: format!("{what}: {e}. Fetch the model with scripts/fetch-model.sh (make run does)"),
    }
}

impl LocalEmbedder {
    /// Loads the model from `dir` (config.json, tokenizer.json, model.safetensors). A missing or
    /// corrupt file is an error that names the fetch script.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let file = |name: &str| -> PathBuf { dir.join(name) };
        let config = std::fs::read_to_string(file("config.json")).map_err(|e| missing(dir, "config.json", e))?;
        let config: Config =
            serde_json::from_str(&config).map_err(|e| missing(dir, "config.json is not a BERT config", e))?;
        let mut tokenizer =
            Tokenizer::from_file(file("tokenizer.json")).map_err(|e| missing(dir, "tokenizer.json", e))?;
        tokenizer.with_padding(Some(PaddingParams { strategy: PaddingStrategy::BatchLongest, ..Default::default() }));
        tokenizer
            .with_truncation(Some(TruncationParams { max_length: MAX_TOKENS, ..Default::default() }))
            .map_err(|e| missing(dir, "tokenizer truncation", e))?;
        // Read into memory rather than mmap: mmap is unsafe if the file changes underneath.
        let weights = std::fs::read(file("model.safetensors")).map_err(|e| missing(dir, "model.safetensors", e))?;
        let vb = VarBuilder::from_buffered_safetensors(weights, DType::F32, &Device::Cpu)
            .map_err(|e| missing(dir, "model.safetensors is corrupt", e))?;
        let model =
            BertModel::load(vb, &config).map_err(|e| missing(dir, "model.safetensors does not fit config.json", e))?;
        let embedder = Self { dimensions: config.hidden_size, inner: Arc::new(Inner { model, tokenizer }) };
        // A model that loads but cannot run is as broken as a missing one: find out now.
        embedder.inner.embed(&["warm-up".to_owned()]).map_err(|e| missing(dir, "the model does not run", e))?;
        Ok(embedder)
    }
}

/// Texts per forward pass. Within a call, texts are grouped by length so that short ones are
/// not padded to the longest of a mixed batch.
const MAX_FORWARD_BATCH: usize = 32;

impl Inner {
    fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let mut order: Vec<usize> = (0..texts.len()).collect();
        order.sort_by_key(|&i| texts[i].len());
        let mut vectors = vec![Vec::new(); texts.len()];
        for group in order.chunks(MAX_FORWARD_BATCH) {
            let batch: Vec<String> = group.iter().map(|&i| texts[i].clone()).collect();
            for (&i, vector) in group.iter().zip(self.forward(batch)?) {
                vectors[i] = vector;
            }
        }
        Ok(vectors)
    }

    fn forward(&self, texts: Vec<String>) -> Result<Vec<Vec<f32>>, EmbedError> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let fail = |e: &dyn std::fmt::Display| EmbedError::permanent("local_model", e.to_string());
        let encodings = self.tokenizer.encode_batch(texts, true).map_err(|e| fail(&e))?;
        let rows = encodings.len();
        let width = encodings.first().map_or(0, |e| e.get_ids().len());
        let flat = |f: fn(&tokenizers::Encoding) -> &[u32]| -> Vec<u32> {
            encodings.iter().flat_map(|e| f(e).iter().copied()).collect()
        };
        let device = Device::Cpu;
        let ids = Tensor::from_vec(flat(|e| e.get_ids()), (rows, width), &device).map_err(|e| fail(&e))?;
        let types = Tensor::from_vec(flat(|e| e.get_type_ids()), (rows, width), &device).map_err(|e| fail(&e))?;
        let mask = Tensor::from_vec(flat(|e| e.get_attention_mask()), (rows, width), &device).map_err(|e| fail(&e))?;

        let pooled = (|| {
            let hidden = self.model.forward(&ids, &types, &mask)?;
            // Mean over the real tokens only, then unit length.
            let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
            let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
            let counts = mask.sum(1)?;
            let mean = summed.broadcast_div(&counts)?;
            let norms = mean.sqr()?.sum_keepdim(1)?.sqrt()?;
            mean.broadcast_div(&norms)?.to_vec2::<f32>()
        })()
        .map_err(|e: candle_core::Error| fail(&e))?;
        Ok(pooled)
    }
}

impl Embedder for LocalEmbedder {
    fn model(&self) -> &str {
        LOCAL_MODEL_NAME
    }

    fn dimensions(&self) -> usize {
        self.dimensions
    }

    fn embed<'a>(&'a self, texts: &'a [String]) -> EmbedFuture<'a> {
        let inner = self.inner.clone();
        let texts = texts.to_vec();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || inner.embed(&texts))
                .await
                .map_err(|e| EmbedError::transient("local_model", format!("embedding task failed: {e}")))?
        })
    }
}

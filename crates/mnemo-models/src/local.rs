//! The local model (all-MiniLM-L6-v2, or all-mpnet-base-v2) run in-process with candle: the
//! encoder, mask-weighted mean pooling, L2 normalisation. The tokenizer shipped with the model
//! pads every input to 128 tokens and cuts at 128; here texts are cut at 256 tokens
//! (all-MiniLM-L6-v2's `max_seq_length`; all-mpnet-base-v2's is 384, held to 256 for the same
//! cost bound), which keeps long ones whole, and each forward pass pads only to the longest of
//! its own texts, which is 3–6× faster on short ones.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use mnemo_core::{EmbedError, EmbedFuture, Embedder};
use tokenizers::{Encoding, Tokenizer, TruncationParams};

use crate::ModelError;
use crate::bert::{BertModel, Config};

const MAX_TOKENS: usize = 256;

#[derive(Debug)]
pub struct LocalEmbedder {
    inner: Arc<Inner>,
    /// The name vectors from this model are stored under.
    name: String,
    dimensions: usize,
}

struct Inner {
    // Forward passes may run side by side (the dispatcher makes two model calls at once): on small
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
    /// Loads the model `name`, of `dimensions`, from `dir` (config.json, tokenizer.json,
    /// model.safetensors). A missing or corrupt file, or another model's, is an error that names
    /// the fetch script.
    pub fn load(dir: &Path, name: &str, dimensions: usize) -> Result<Self, ModelError> {
        let file = |name: &str| -> PathBuf { dir.join(name) };
        let config = std::fs::read_to_string(file("config.json")).map_err(|e| missing(dir, "config.json", e))?;
        let config: Config =
            serde_json::from_str(&config).map_err(|e| missing(dir, "config.json is not a BERT config", e))?;
        if config.hidden_size != dimensions {
            let found = format!("it holds a model of {} dimensions", config.hidden_size);
            return Err(missing(dir, &found, format!("{name} has {dimensions}")));
        }
        let mut tokenizer =
            Tokenizer::from_file(file("tokenizer.json")).map_err(|e| missing(dir, "tokenizer.json", e))?;
        // No padding here: `Inner::forward` pads each pass to its own longest text.
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(Some(TruncationParams { max_length: MAX_TOKENS, ..Default::default() }))
            .map_err(|e| missing(dir, "tokenizer truncation", e))?;
        // Read into memory rather than mmap: mmap is unsafe if the file changes underneath.
        let weights = std::fs::read(file("model.safetensors")).map_err(|e| missing(dir, "model.safetensors", e))?;
        let vb = VarBuilder::from_buffered_safetensors(weights, DType::F32, &Device::Cpu)
            .map_err(|e| missing(dir, "model.safetensors is corrupt", e))?;
        let model =
            BertModel::load(vb, &config).map_err(|e| missing(dir, "model.safetensors does not fit config.json", e))?;
        let embedder = Self { name: name.to_owned(), dimensions, inner: Arc::new(Inner { model, tokenizer }) };
        // A model that loads but cannot run is as broken as a missing one: find out now.
        embedder.inner.embed(&["warm-up".to_owned()]).map_err(|e| missing(dir, "the model does not run", e))?;
        Ok(embedder)
    }
}

/// The most texts of one forward pass.
const MAX_FORWARD_BATCH: usize = 32;

/// What a forward pass costs besides its tokens, counted in padded tokens: a pass of one short
/// text takes about 13 ms and one of 32 about 7.5 ms a text (`mnemo-bench embedder`), so about
/// 20 tokens' worth of work is paid per pass whatever its size.
const PASS_COST_IN_TOKENS: usize = 20;

/// Splits texts sorted by token count (`lengths`, ascending) into consecutive forward passes
/// that cost the least: a pass pays its size times its longest text (every text is padded to
/// it) plus [`PASS_COST_IN_TOKENS`]. One pass for a batch of like lengths; for a batch of
/// questions from 8 to 30 tokens, a few passes instead of padding every question to 30.
/// Returns the passes' end indices.
fn passes(lengths: &[usize]) -> Vec<usize> {
    let n = lengths.len();
    // best[j]: the least cost of the first j texts; cut[j]: where the last pass of those starts.
    let (mut best, mut cut) = (vec![0usize; n + 1], vec![0usize; n + 1]);
    for j in 1..=n {
        best[j] = usize::MAX;
        for i in j.saturating_sub(MAX_FORWARD_BATCH)..j {
            let cost = best[i] + (j - i) * lengths[j - 1] + PASS_COST_IN_TOKENS;
            if cost < best[j] {
                (best[j], cut[j]) = (cost, i);
            }
        }
    }
    let mut ends = Vec::new();
    let mut j = n;
    while j > 0 {
        ends.push(j);
        j = cut[j];
    }
    ends.reverse();
    ends
}

impl Inner {
    fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let fail = |e: &dyn std::fmt::Display| EmbedError::permanent("local_model", e.to_string());
        let encodings =
            self.tokenizer.encode_batch(texts.iter().map(String::as_str).collect(), true).map_err(|e| fail(&e))?;
        let mut order: Vec<usize> = (0..encodings.len()).collect();
        order.sort_by_key(|&i| encodings[i].len());
        let lengths: Vec<usize> = order.iter().map(|&i| encodings[i].len()).collect();
        let mut vectors = vec![Vec::new(); texts.len()];
        let mut start = 0;
        for end in passes(&lengths) {
            let pass = &order[start..end];
            let batch: Vec<&Encoding> = pass.iter().map(|&i| &encodings[i]).collect();
            for (&i, vector) in pass.iter().zip(self.forward(&batch).map_err(|e| fail(&e))?) {
                vectors[i] = vector;
            }
            start = end;
        }
        Ok(vectors)
    }

    /// One forward pass over `encodings`, each padded to the longest.
    fn forward(&self, encodings: &[&Encoding]) -> candle_core::Result<Vec<Vec<f32>>> {
        let rows = encodings.len();
        let width = encodings.iter().map(|e| e.len()).max().unwrap_or(0);
        if width == 0 {
            // The tokenizer adds [CLS] and [SEP] to every text: never a text of no tokens.
            candle_core::bail!("a pass of texts with no tokens");
        }
        // Padding is masked out, so its id does not matter: 0 ([PAD] in BERT's vocabulary), of
        // token type 0.
        let padded = |f: fn(&Encoding) -> &[u32]| -> Vec<u32> {
            let mut flat = Vec::with_capacity(rows * width);
            for e in encodings {
                flat.extend_from_slice(f(e));
                flat.resize(flat.len() + width - e.len(), 0);
            }
            flat
        };
        let device = Device::Cpu;
        let ids = Tensor::from_vec(padded(|e| e.get_ids()), (rows, width), &device)?;
        let types = Tensor::from_vec(padded(|e| e.get_type_ids()), (rows, width), &device)?;
        let mask = Tensor::from_vec(padded(|e| e.get_attention_mask()), (rows, width), &device)?;

        let hidden = self.model.forward(&ids, &types, &mask)?;
        // Mean over the real tokens only, then unit length.
        let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
        let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
        let counts = mask.sum(1)?;
        let mean = summed.broadcast_div(&counts)?;
        let norms = mean.sqr()?.sum_keepdim(1)?.sqrt()?;
        mean.broadcast_div(&norms)?.to_vec2::<f32>()
    }
}

impl Embedder for LocalEmbedder {
    fn model(&self) -> &str {
        &self.name
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(lengths: &[usize]) -> Vec<usize> {
        let mut start = 0;
        passes(lengths)
            .into_iter()
            .map(|end| {
                let size = end - start;
                start = end;
                size
            })
            .collect()
    }

    #[test]
    fn texts_of_like_length_share_one_pass() {
        assert_eq!(sizes(&[14; 32]), [32]);
        assert_eq!(sizes(&[12, 13, 13, 14, 15, 15, 16]), [7]);
        assert!(sizes(&[]).is_empty());
    }

    #[test]
    fn short_texts_are_not_padded_to_a_long_one() {
        let mut lengths = vec![10; 31];
        lengths.push(256);
        assert_eq!(sizes(&lengths), [31, 1]);
        // Questions from 8 to 30 tokens: a few passes, not one padded to 30.
        let lengths: Vec<usize> = (0..32).map(|i| 8 + i * 22 / 31).collect();
        let split = sizes(&lengths);
        assert!((2..=6).contains(&split.len()), "{split:?}");
    }

    #[test]
    fn no_pass_holds_more_than_the_most_a_pass_takes() {
        let split = sizes(&[14; 100]);
        assert_eq!(split.iter().sum::<usize>(), 100);
        assert!(split.iter().all(|&n| n <= MAX_FORWARD_BATCH), "{split:?}");
    }
}

//! BERT's encoder for the local embedder: the computation of candle-transformers' `BertModel`
//! (loading the same safetensors names), with its two costliest element-wise steps replaced.
//! GELU took libm's `erf` element by element, a third of a short batch's time: here it is a
//! rational approximation that the compiler vectorises (within 1e-7 of erf). Attention's softmax
//! was five tensor operations: here it is candle's fused one. Measured in docs/benchmarks.md
//! ("A faster local embedder").

use candle_core::{CpuStorage, D, DType, Layout, Module, Result, Shape, Tensor};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder, embedding, layer_norm, linear};
use serde::Deserialize;

/// The fields of a BERT `config.json` this encoder reads (others are ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub hidden_act: String,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub layer_norm_eps: f64,
    #[serde(default)]
    pub model_type: Option<String>,
}

pub struct BertModel {
    word_embeddings: Embedding,
    position_embeddings: Embedding,
    token_type_embeddings: Embedding,
    embeddings_norm: LayerNorm,
    layers: Vec<Layer>,
}

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    heads: usize,
    attention_output: Linear,
    attention_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNorm,
}

impl BertModel {
    pub fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        if config.hidden_act != "gelu" {
            candle_core::bail!("hidden_act {:?}: only \"gelu\" is supported", config.hidden_act);
        }
        // Checkpoints name their tensors with or without the model type in front.
        let vb = match &config.model_type {
            Some(prefix) if vb.contains_tensor(&format!("{prefix}.embeddings.word_embeddings.weight")) => vb.pp(prefix),
            _ => vb,
        };
        let (h, e) = (config.hidden_size, vb.pp("embeddings"));
        let layers = (0..config.num_hidden_layers)
            .map(|i| Layer::load(vb.pp(format!("encoder.layer.{i}")), config))
            .collect::<Result<_>>()?;
        Ok(Self {
            word_embeddings: embedding(config.vocab_size, h, e.pp("word_embeddings"))?,
            position_embeddings: embedding(config.max_position_embeddings, h, e.pp("position_embeddings"))?,
            token_type_embeddings: embedding(config.type_vocab_size, h, e.pp("token_type_embeddings"))?,
            embeddings_norm: layer_norm(h, config.layer_norm_eps, e.pp("LayerNorm"))?,
            layers,
        })
    }

    /// The last hidden state, (batch, tokens, hidden), of `input_ids` with their token types
    /// and attention mask (1 for a real token, 0 for padding), each (batch, tokens).
    pub fn forward(&self, input_ids: &Tensor, token_type_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let (_, tokens) = input_ids.dims2()?;
        let positions = Tensor::arange(0u32, tokens as u32, input_ids.device())?;
        let embedded = (self.word_embeddings.forward(input_ids)?
            + self.token_type_embeddings.forward(token_type_ids)?)?
        .broadcast_add(&self.position_embeddings.forward(&positions)?)?;
        let mut hidden = self.embeddings_norm.forward(&embedded)?;
        // Padding is masked by adding the float minimum to its scores: (batch, 1, 1, tokens).
        let mask = attention_mask.to_dtype(DType::F32)?.unsqueeze(1)?.unsqueeze(1)?;
        let mask = mask.affine(-1.0, 1.0)?.affine(f64::from(f32::MIN), 0.0)?;
        for layer in &self.layers {
            hidden = layer.forward(&hidden, &mask)?;
        }
        Ok(hidden)
    }
}

impl Layer {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        let (h, i) = (config.hidden_size, config.intermediate_size);
        let (attention, eps) = (vb.pp("attention"), config.layer_norm_eps);
        Ok(Self {
            query: linear(h, h, attention.pp("self.query"))?,
            key: linear(h, h, attention.pp("self.key"))?,
            value: linear(h, h, attention.pp("self.value"))?,
            heads: config.num_attention_heads,
            attention_output: linear(h, h, attention.pp("output.dense"))?,
            attention_norm: layer_norm(h, eps, attention.pp("output.LayerNorm"))?,
            intermediate: linear(h, i, vb.pp("intermediate.dense"))?,
            output: linear(i, h, vb.pp("output.dense"))?,
            output_norm: layer_norm(h, eps, vb.pp("output.LayerNorm"))?,
        })
    }

    fn forward(&self, hidden: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (batch, tokens, width) = hidden.dims3()?;
        let head_size = width / self.heads;
        // (batch, tokens, width) → (batch, heads, tokens, head_size)
        let split = |x: Tensor| x.reshape((batch, tokens, self.heads, head_size))?.transpose(1, 2)?.contiguous();
        let query = split(self.query.forward(hidden)?)?;
        let key = split(self.key.forward(hidden)?)?;
        let value = split(self.value.forward(hidden)?)?;
        let scores = (query.matmul(&key.t()?)? / (head_size as f64).sqrt())?.broadcast_add(mask)?;
        let probabilities = candle_nn::ops::softmax_last_dim(&scores)?;
        let context = probabilities.matmul(&value)?.transpose(1, 2)?.contiguous()?.flatten_from(D::Minus2)?;
        let attended = self.attention_norm.forward(&(self.attention_output.forward(&context)? + hidden)?)?;
        let intermediate = self.intermediate.forward(&attended)?.contiguous()?.apply_op1_no_bwd(&Gelu)?;
        self.output_norm.forward(&(self.output.forward(&intermediate)? + attended)?)
    }
}

/// GELU, x·Φ(x) with the exact normal CDF as BERT defines it (not the tanh approximation).
struct Gelu;

impl candle_core::CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "gelu-erf-rational"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(data), Some((start, end))) = (storage, layout.contiguous_offsets()) else {
            candle_core::bail!("gelu: a contiguous f32 tensor is expected");
        };
        let out =
            data[start..end].iter().map(|&x| 0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))).collect();
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }
}

/// erf as a rational function of x, odd numerator over even denominator, on [-4, 4] (beyond it
/// erf is ±1 in f32): the coefficients of Eigen's and XLA's float erf. Branch-free, so a loop
/// over it vectorises.
fn erf(x: f32) -> f32 {
    const ALPHA: [f32; 7] = [
        -2.726_142_3e-10,
        2.770_681_4e-8,
        -2.101_024e-6,
        -5.692_506_4e-5,
        -7.349_906_3e-4,
        -2.954_600_2e-3,
        -1.609_603_3e-2,
    ];
    const BETA: [f32; 5] = [-1.456_607_2e-5, -2.133_740_6e-4, -1.682_827e-3, -7.373_329_3e-3, -1.426_473_9e-2];
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let p = ALPHA.iter().fold(0.0, |p, &a| p * x2 + a) * x;
    let q = BETA.iter().fold(0.0, |q, &b| q * x2 + b);
    p / q
}

#[cfg(test)]
mod tests {
    /// erf against values from a reference table (Abramowitz and Stegun, table 7.1).
    #[test]
    fn erf_matches_the_table() {
        let erf = |x: f32| f64::from(super::erf(x));
        for (x, want) in [(0.1, 0.112_462_916), (0.5, 0.520_499_878), (1.0, 0.842_700_793), (2.0, 0.995_322_265)] {
            assert!((erf(x) - want).abs() < 2e-7, "erf({x}) = {} against {want}", erf(x));
            assert!((erf(-x) + want).abs() < 2e-7);
        }
        assert_eq!(erf(0.0), 0.0);
        assert!((super::erf(9.0) - 1.0).abs() < 2e-7 && (super::erf(-9.0) + 1.0).abs() < 2e-7);
    }
}

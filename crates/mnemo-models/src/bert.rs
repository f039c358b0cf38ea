//! BERT's encoder for the local embedder: the computation of candle-transformers' `BertModel`
//! (loading the same safetensors names), with its two costliest element-wise steps replaced. It
//! also runs MPNet (all-mpnet-base-v2), which is BERT's layers under other tensor names, without
//! token types, with positions counted from 2, and with a learnt bias per head for each relative
//! distance between two tokens, added to every layer's attention scores.
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
    /// 0 (absent) for MPNet, which has no token types.
    #[serde(default)]
    pub type_vocab_size: usize,
    pub layer_norm_eps: f64,
    #[serde(default)]
    pub model_type: Option<String>,
    /// MPNet's relative position buckets.
    #[serde(default)]
    pub relative_attention_num_buckets: Option<usize>,
}

impl Config {
    fn is_mpnet(&self) -> bool {
        self.model_type.as_deref() == Some("mpnet")
    }
}

pub struct BertModel {
    word_embeddings: Embedding,
    position_embeddings: Embedding,
    /// The first position's index: 0 for BERT, 2 for MPNet (its padding index, 1, plus one).
    first_position: u32,
    token_type_embeddings: Option<Embedding>,
    embeddings_norm: LayerNorm,
    /// MPNet: (buckets, heads).
    relative_attention_bias: Option<Embedding>,
    heads: usize,
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
        let mpnet = config.is_mpnet();
        let relative_attention_bias = match (mpnet, config.relative_attention_num_buckets) {
            (false, _) => None,
            // `relative_bucket` is MPNet's function for 32 buckets.
            (true, Some(32)) => {
                Some(embedding(32, config.num_attention_heads, vb.pp("encoder.relative_attention_bias"))?)
            }
            (true, other) => candle_core::bail!("relative_attention_num_buckets {other:?}: only 32 is supported"),
        };
        Ok(Self {
            word_embeddings: embedding(config.vocab_size, h, e.pp("word_embeddings"))?,
            position_embeddings: embedding(config.max_position_embeddings, h, e.pp("position_embeddings"))?,
            first_position: if mpnet { 2 } else { 0 },
            token_type_embeddings: if mpnet {
                None
            } else {
                Some(embedding(config.type_vocab_size, h, e.pp("token_type_embeddings"))?)
            },
            embeddings_norm: layer_norm(h, config.layer_norm_eps, e.pp("LayerNorm"))?,
            relative_attention_bias,
            heads: config.num_attention_heads,
            layers,
        })
    }

    /// The last hidden state, (batch, tokens, hidden), of `input_ids` with their token types
    /// and attention mask (1 for a real token, 0 for padding), each (batch, tokens).
    pub fn forward(&self, input_ids: &Tensor, token_type_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let (_, tokens) = input_ids.dims2()?;
        let device = input_ids.device();
        // Texts are padded on the right, so a real token's position is its index.
        let positions = Tensor::arange(self.first_position, self.first_position + tokens as u32, device)?;
        let mut embedded = self.word_embeddings.forward(input_ids)?;
        if let Some(token_types) = &self.token_type_embeddings {
            embedded = (embedded + token_types.forward(token_type_ids)?)?;
        }
        let embedded = embedded.broadcast_add(&self.position_embeddings.forward(&positions)?)?;
        let mut hidden = self.embeddings_norm.forward(&embedded)?;
        // Padding is masked by adding the float minimum to its scores: (batch, 1, 1, tokens).
        let mask = attention_mask.to_dtype(DType::F32)?.unsqueeze(1)?.unsqueeze(1)?;
        let mut mask = mask.affine(-1.0, 1.0)?.affine(f64::from(f32::MIN), 0.0)?;
        if let Some(bias) = &self.relative_attention_bias {
            // (1, heads, tokens, tokens), the same for every layer.
            let buckets: Vec<u32> = (0..tokens)
                .flat_map(|query| (0..tokens).map(move |key| relative_bucket(key as i64 - query as i64)))
                .collect();
            let buckets = Tensor::from_vec(buckets, (tokens, tokens), device)?;
            let bias = bias.forward(&buckets)?.permute((2, 0, 1))?.reshape((1, self.heads, tokens, tokens))?;
            mask = mask.broadcast_add(&bias)?;
        }
        for layer in &self.layers {
            hidden = layer.forward(&hidden, &mask)?;
        }
        Ok(hidden)
    }
}

/// MPNet's bucket for a key `distance` tokens after the query (negative: before), as MPNet
/// (after T5) defines it with 32 buckets up to 128 tokens: 16 per direction, the first 8 one
/// distance each, the other 8 spread logarithmically up to 128 and beyond. In f32, as the
/// reference computes it, so that a distance on a boundary (64) falls in the same bucket.
fn relative_bucket(distance: i64) -> u32 {
    const HALF: u32 = 16;
    const EXACT: u32 = 8;
    let side = if distance > 0 { HALF } else { 0 };
    let n = distance.unsigned_abs() as u32;
    if n < EXACT {
        return side + n;
    }
    let far = (n as f32 / EXACT as f32).ln() / (128.0f64 / 8.0).ln() as f32 * (HALF - EXACT) as f32;
    side + (EXACT + far as u32).min(HALF - 1)
}

impl Layer {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        let (h, i) = (config.hidden_size, config.intermediate_size);
        let (attention, eps) = (vb.pp("attention"), config.layer_norm_eps);
        // The same tensors under each checkpoint's own names.
        let [query, key, value, output, norm] = if config.is_mpnet() {
            ["attn.q", "attn.k", "attn.v", "attn.o", "LayerNorm"]
        } else {
            ["self.query", "self.key", "self.value", "output.dense", "output.LayerNorm"]
        };
        Ok(Self {
            query: linear(h, h, attention.pp(query))?,
            key: linear(h, h, attention.pp(key))?,
            value: linear(h, h, attention.pp(value))?,
            heads: config.num_attention_heads,
            attention_output: linear(h, h, attention.pp(output))?,
            attention_norm: layer_norm(h, eps, attention.pp(norm))?,
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

    /// A tiny MPNet (2 layers of width 8, 2 heads) with weights from a formula, against the same
    /// model run by a numpy transcription of the reference implementation in float64: the last
    /// hidden state of 70 tokens at three positions. 70 tokens cross every bucket boundary but
    /// the last; with the relative bias left out the outputs move by 0.01–0.04, with distance 64 in
    /// the bucket below by 1.5e-3 (both checked with the numpy model).
    #[test]
    fn mpnet_gives_the_reference_s_hidden_states() {
        use candle_core::{DType, Device, Tensor};
        use std::collections::HashMap;
        let (h, layers, heads, intermediate, vocab, positions) = (8, 2, 2, 16, 16, 80);
        let config: super::Config = serde_json::from_value(serde_json::json!({
            "vocab_size": vocab, "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
            "intermediate_size": intermediate, "hidden_act": "gelu", "max_position_embeddings": positions,
            "layer_norm_eps": 1e-5, "model_type": "mpnet", "relative_attention_num_buckets": 32,
        }))
        .unwrap();
        let mut shapes: Vec<(String, Vec<usize>)> = vec![
            ("embeddings.word_embeddings.weight".into(), vec![vocab, h]),
            ("embeddings.position_embeddings.weight".into(), vec![positions, h]),
            ("embeddings.LayerNorm.weight".into(), vec![h]),
            ("embeddings.LayerNorm.bias".into(), vec![h]),
            ("encoder.relative_attention_bias.weight".into(), vec![32, heads]),
        ];
        for i in 0..layers {
            let p = format!("encoder.layer.{i}.");
            for n in ["q", "k", "v", "o"] {
                shapes.push((format!("{p}attention.attn.{n}.weight"), vec![h, h]));
                shapes.push((format!("{p}attention.attn.{n}.bias"), vec![h]));
            }
            for (name, shape) in [
                ("attention.LayerNorm.weight", vec![h]),
                ("attention.LayerNorm.bias", vec![h]),
                ("intermediate.dense.weight", vec![intermediate, h]),
                ("intermediate.dense.bias", vec![intermediate]),
                ("output.dense.weight", vec![h, intermediate]),
                ("output.dense.bias", vec![h]),
                ("output.LayerNorm.weight", vec![h]),
                ("output.LayerNorm.bias", vec![h]),
            ] {
                shapes.push((format!("{p}{name}"), shape));
            }
        }
        // 0.5·sin(0.61·i + the sum of the name's bytes mod 97); LayerNorm scales 1 + a fifth of
        // that, its biases a fifth, so that the layers' inputs show in the output.
        let tensors: HashMap<String, Tensor> = shapes
            .into_iter()
            .map(|(name, shape)| {
                let seed = f64::from(name.bytes().map(u32::from).sum::<u32>() % 97);
                let n: usize = shape.iter().product();
                let values = (0..n).map(|i| f64::from(0.5 * (0.61 * i as f64 + seed).sin() as f32)).map(|w| {
                    (if name.ends_with("LayerNorm.weight") {
                        1.0 + 0.2 * w
                    } else if name.ends_with("LayerNorm.bias") {
                        0.2 * w
                    } else {
                        w
                    }) as f32
                });
                let tensor = Tensor::from_iter(values, &Device::Cpu).unwrap().reshape(shape).unwrap();
                (name, tensor)
            })
            .collect();
        let model =
            super::BertModel::load(candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu), &config)
                .unwrap();
        let ids: Vec<u32> = (0..70).map(|i| i * 7 % 16).collect();
        // A second row: the first 10 tokens, padded to 70, must read as those 10 alone.
        let mut padded = ids[..10].to_vec();
        padded.resize(70, 0);
        let mask: Vec<u32> = [vec![1; 70], vec![1; 10], vec![0; 60]].concat();
        let run = |ids: Vec<u32>, mask: Vec<u32>, rows: usize| {
            let tokens = ids.len() / rows;
            let ids = Tensor::from_vec(ids, (rows, tokens), &Device::Cpu).unwrap();
            let mask = Tensor::from_vec(mask, (rows, tokens), &Device::Cpu).unwrap();
            model.forward(&ids, &ids.zeros_like().unwrap(), &mask).unwrap().to_vec3::<f32>().unwrap()
        };
        let hidden = run([ids.clone(), padded].concat(), mask, 2);
        let want: [(usize, [f32; 8]); 3] = [
            (0, [1.97461, 0.20706, 0.70642, -0.58882, -0.22781, 0.24949, -1.84259, -0.52689]),
            (9, [1.70280, 0.10923, 1.05318, -0.61052, -0.05705, 0.47954, -1.84673, -0.80387]),
            (69, [1.51520, 0.95485, 0.11282, -1.33005, -1.05520, 1.21177, -1.06650, -0.49812]),
        ];
        for (token, want) in want {
            for (got, want) in hidden[0][token].iter().zip(want) {
                assert!((got - want).abs() < 2e-5, "token {token}: {:?} against {want:?}", hidden[0][token]);
            }
        }
        let alone = run(ids[..10].to_vec(), vec![1; 10], 1);
        for token in 0..10 {
            for (a, b) in alone[0][token].iter().zip(&hidden[1][token]) {
                assert!((a - b).abs() < 1e-5, "token {token} of the padded row");
            }
        }
    }

    /// MPNet's relative position buckets against the reference formula, evaluated in float32
    /// with numpy (the boundary at 64 is where float precision decides).
    #[test]
    fn relative_buckets_match_the_reference() {
        let distances =
            [-200, -128, -64, -63, -33, -32, -16, -9, -8, -7, -1, 0, 1, 7, 8, 16, 32, 64, 65, 127, 128, 300];
        let want = [15, 15, 14, 13, 12, 12, 10, 8, 8, 7, 1, 0, 17, 23, 24, 26, 28, 30, 30, 31, 31, 31];
        let got: Vec<u32> = distances.iter().map(|&d| super::relative_bucket(d)).collect();
        assert_eq!(got, want);
    }
}

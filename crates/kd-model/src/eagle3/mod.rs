//! EAGLE-3 drafts with SpecForge's `LlamaForCausalLMEagle3` semantics: one Llama decoder layer
//! that reads the target's own hidden features, a reduced output vocabulary, and training-time
//! test (TTT) steps.
//!
//! - `fc` (`3·d_target → d`, no bias) fuses the hidden states of three target layers,
//!   concatenated low, mid, high.
//! - The decoder layer's q/k/v read `2·d` inputs: `cat(RMSNorm(embedding), RMSNorm(hidden))`,
//!   embedding half first (`input_layernorm`, `hidden_norm`); the residual is the hidden
//!   stream (its `hidden_norm` under `norm_before_residual`, as vLLM's `speculators` drafts may
//!   have it); then the usual post-attention norm and SwiGLU.
//! - `norm`, then `lm_head` over the draft vocabulary ([`DraftVocab`]: `d2t` offsets and the
//!   `t2d` mask over the target vocabulary).
//! - The embedding is the target's, frozen, and not exported.
//! - Under `norm_before_fc` (`speculators`' option, which llama.cpp reads too) an RMSNorm
//!   over the concatenated features comes before `fc`.
//! - A draft read from vLLM's `speculators` layout may have Qwen3's decoder layer instead
//!   (`transformer_layer_config.model_type: "qwen3"`, or no `model_type`, speculators'
//!   default): each query and key head goes through its own RMSNorm (`q_norm`, `k_norm`)
//!   before RoPE. Drafts trained here from scratch have SpecForge's Llama layer.
//!
//! TTT step `k` (0, 1, …) reads the ids shifted left `k` times and the previous step's
//! hidden output (before the final norm), at RoPE positions `t + k`; its queries attend to
//! step 0's keys causally plus the same position's key of every later step
//! ([`Eagle3Draft::step`]). Step 0 is plain causal attention, which is also what decoding
//! runs. Parity with SpecForge is tested against `fixtures/eagle3/` (made by
//! `fixtures/make_eagle3_golden.py`, which re-implements SpecForge's modules in PyTorch).

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::{Module, Param};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};
use safetensors::Dtype;

use crate::error::{ModelError, Result};
use crate::rope::{Rope, apply_rotary};

mod cache;
mod config;
mod decode;
mod export;
mod file;
mod gguf;
mod host;
mod init;
mod vocab;

pub use cache::{DraftKvCache, TttCache};
pub use config::Eagle3Config;
pub use export::{Eagle3Format, SpeculatorsVerifier, export_eagle3};
pub use gguf::{GgufWeightType, export_eagle3_gguf};
pub use vocab::DraftVocab;

use decode::Proj;
use file::{WeightsFile, serialize_tensors};

/// The `architectures` entry of an EAGLE-3 draft's `config.json`.
pub const EAGLE3_ARCHITECTURE: &str = "LlamaForCausalLMEagle3";

/// Whether `dir` holds an EAGLE-3 draft: a `config.json` whose `architectures` name
/// [`EAGLE3_ARCHITECTURE`] (SpecForge's layout) or with `speculators_model_type: eagle3`
/// (vLLM's `speculators` layout).
pub fn is_eagle3_dir(dir: impl AsRef<Path>) -> bool {
    std::fs::read_to_string(dir.as_ref().join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|v| {
            v.get("speculators_model_type").and_then(|k| k.as_str()) == Some("eagle3")
                || v.get("architectures")
                    .and_then(|a| a.as_array())
                    .is_some_and(|a| a.iter().any(|n| n.as_str() == Some(EAGLE3_ARCHITECTURE)))
        })
}

/// The weights file of a draft directory.
const WEIGHTS_FILE: &str = "model.safetensors";

/// An EAGLE-3 draft. Projection weights are held `[in, out]`.
#[derive(Module, Debug)]
pub struct Eagle3Draft {
    /// RMSNorm weight `[3·d_target]` over the concatenated features before `fc`
    /// (`norm_before_fc`, `input_norm.weight`); `None` without it.
    pub input_norm: Option<Param<Tensor<1>>>,
    /// `fc`: `[3·d_target, d]`.
    pub fc: Param<Tensor<2>>,
    /// The frozen target embedding, `[target_vocab, d]`.
    pub embed_tokens: Param<Tensor<2>>,
    /// RMSNorm weight over the embedding half.
    pub input_layernorm: Param<Tensor<1>>,
    /// RMSNorm weight over the hidden half.
    pub hidden_norm: Param<Tensor<1>>,
    /// `[2d, heads · head_dim]`.
    pub q_proj: Param<Tensor<2>>,
    /// `[2d, kv_heads · head_dim]`.
    pub k_proj: Param<Tensor<2>>,
    /// `[2d, kv_heads · head_dim]`.
    pub v_proj: Param<Tensor<2>>,
    /// `[heads · head_dim, d]`.
    pub o_proj: Param<Tensor<2>>,
    /// RMSNorm weight `[head_dim]` over each query head before RoPE: a Qwen3 layer's `q_norm`
    /// (speculators' `model_type: "qwen3"` drafts); `None` in a Llama layer.
    pub q_norm: Option<Param<Tensor<1>>>,
    /// The same over each key head (`k_norm`).
    pub k_norm: Option<Param<Tensor<1>>>,
    /// RMSNorm weight before the MLP.
    pub post_attention_layernorm: Param<Tensor<1>>,
    /// `[d, intermediate]`.
    pub gate_proj: Param<Tensor<2>>,
    /// `[d, intermediate]`.
    pub up_proj: Param<Tensor<2>>,
    /// `[intermediate, d]`.
    pub down_proj: Param<Tensor<2>>,
    /// Final RMSNorm weight.
    pub norm: Param<Tensor<1>>,
    /// `[d, draft_vocab]`.
    pub lm_head: Param<Tensor<2>>,
    #[module(skip)]
    config: Eagle3Config,
    #[module(skip)]
    vocab: DraftVocab,
    #[module(skip)]
    rope: Rope,
    /// Q8_0 copies of the projections for decoding ([`Eagle3Draft::with_q8_0_weights`]).
    #[module(skip)]
    packed: Option<decode::DecodePacks>,
    /// Whether few-position decoding passes run on the host ([`Eagle3Draft::with_host_decoding`]).
    #[module(skip)]
    host_decoding: bool,
}

/// `x · rsqrt(mean(x²) + ε) · w` over the last axis.
fn rms_norm(x: Tensor<3>, weight: &Param<Tensor<1>>, eps: f64) -> Tensor<3> {
    let [b, s, d] = x.dims();
    let variance = x.clone().powi_scalar(2).mean_dim(2);
    let normed = x * (variance + eps).sqrt().recip();
    normed * weight.val().reshape([1, 1, d]).expand([b, s, d])
}

/// `x · W` for `x` `[b, s, in]` and `W` `[in, out]`.
fn project(x: Tensor<3>, weight: &Param<Tensor<2>>) -> Tensor<3> {
    let [b, s, i] = x.dims();
    let out = weight.val().dims()[1];
    x.reshape([b * s, i])
        .matmul(weight.val())
        .reshape([b, s, out])
}

/// `x · rsqrt(mean(x²) + ε) · w` over each head of `x` `[b, heads, s, head_dim]`, when there is
/// a weight (a Qwen3 layer's `q_norm` / `k_norm`).
fn head_norm(x: Tensor<4>, weight: Option<&Param<Tensor<1>>>, eps: f64) -> Tensor<4> {
    let Some(weight) = weight else { return x };
    let [b, h, s, d] = x.dims();
    let variance = x.clone().powi_scalar(2).mean_dim(3);
    let normed = x * (variance + eps).sqrt().recip();
    normed * weight.val().reshape([1, 1, 1, d]).expand([b, h, s, d])
}

/// `[b, kv, t, d]` → `[b, heads, t, d]`: the model's `repeat_kv` with the group size of
/// `heads` query heads.
fn repeat_kv(x: Tensor<4>, heads: usize) -> Tensor<4> {
    let groups = heads / x.dims()[1];
    crate::model::repeat_kv(x, groups)
}

impl Eagle3Draft {
    /// Loads a draft directory (`config.json`, `model.safetensors` under SpecForge's tensor
    /// names, with `d2t` and `t2d`; vLLM's `speculators` layout too). The target's embedding comes from `embedding`
    /// (`[target_vocab, d]`) when given, else from the file's `embed_tokens.weight`.
    pub fn load(
        dir: impl AsRef<Path>,
        embedding: Option<Tensor<2>>,
        device: &Device,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let config = Eagle3Config::from_file(dir.join("config.json"))?;
        let file = WeightsFile::open(&dir.join(WEIGHTS_FILE))?;
        // SpecForge's `midlayer.` or the `speculators` format's `layers.0.`.
        let m = export::layer_prefix(&file);
        // A tensor the draft would not read (a bias, another layer's norm) is an error.
        export::check_names(&file, &export::expected_tensors(&config), m)?;
        let c = &config.llama;
        let (d, vocab) = (c.hidden_size, c.vocab_size);
        let (q_out, kv_out) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let inter = c.intermediate_size;
        let dv = config.draft_vocab_size;
        // [out, in] on disk (nn.Linear), [in, out] here.
        let linear = |name: &str, out: usize, input: usize| -> Result<Param<Tensor<2>>> {
            let v = file.floats(name, &[out, input])?;
            let data = TensorData::new(v, [out, input]);
            Ok(Param::from_tensor(
                Tensor::<2>::from_data(data, (device, DType::F32)).transpose(),
            ))
        };
        let vector_of = |name: &str, n: usize| -> Result<Param<Tensor<1>>> {
            let v = file.floats(name, &[n])?;
            Ok(Param::from_tensor(Tensor::from_data(
                TensorData::new(v, [n]),
                (device, DType::F32),
            )))
        };
        let vector = |name: &str| vector_of(name, d);
        // A Qwen3 layer's per-head norms.
        let qk_norm = |name: &str| -> Result<Option<Param<Tensor<1>>>> {
            if !c.qk_norm() {
                return Ok(None);
            }
            let name = format!("{m}{name}");
            if !file.has(&name) {
                return Err(file.error(
                    &name,
                    "missing: config.json makes the decoder layer Qwen3's (model_type \
                     \"qwen3\", or none in a speculators transformer_layer_config), which \
                     normalises each query and key head; a draft from SpecForge has a Llama \
                     layer (model_type \"llama\")"
                        .into(),
                ));
            }
            vector_of(&name, c.head_dim).map(Some)
        };
        let embedding = match embedding {
            Some(e) => {
                if e.dims() != [vocab, d] {
                    return Err(ModelError::Input(format!(
                        "the target embedding is {:?}; the draft at {} expects [{vocab}, {d}]",
                        e.dims(),
                        dir.display()
                    )));
                }
                e
            }
            None if file.has("embed_tokens.weight") => {
                let v = file.floats("embed_tokens.weight", &[vocab, d])?;
                Tensor::from_data(TensorData::new(v, [vocab, d]), (device, DType::F32))
            }
            None => {
                return Err(ModelError::Input(format!(
                    "{} has no embed_tokens.weight (SpecForge does not export it): pass the \
                     target's embedding",
                    dir.display()
                )));
            }
        };
        // A draft over the whole target vocabulary maps ids to themselves; speculators stores
        // no `d2t` for it.
        let d2t = if !file.has("d2t") && dv == vocab {
            vec![0; dv]
        } else {
            file.ints("d2t")?
        };
        if d2t.len() != dv {
            return Err(file.error("d2t", format!("{} entries, expected {dv}", d2t.len())));
        }
        let vocab_map = DraftVocab::from_d2t(&d2t, vocab)?;
        let rope = Rope::new(c);
        let features = 3 * config.target_hidden_size;
        let input_norm = config
            .norm_before_fc
            .then(|| vector_of(export::INPUT_NORM, features))
            .transpose()?;
        Ok(Self {
            input_norm,
            fc: linear("fc.weight", d, features)?,
            embed_tokens: Param::from_tensor(embedding).set_require_grad(false),
            input_layernorm: vector(&format!("{m}input_layernorm.weight"))?,
            hidden_norm: vector(&format!("{m}hidden_norm.weight"))?,
            q_proj: linear(&format!("{m}self_attn.q_proj.weight"), q_out, 2 * d)?,
            k_proj: linear(&format!("{m}self_attn.k_proj.weight"), kv_out, 2 * d)?,
            v_proj: linear(&format!("{m}self_attn.v_proj.weight"), kv_out, 2 * d)?,
            o_proj: linear(&format!("{m}self_attn.o_proj.weight"), d, q_out)?,
            q_norm: qk_norm(export::QK_NORMS[0])?,
            k_norm: qk_norm(export::QK_NORMS[1])?,
            post_attention_layernorm: vector(&format!("{m}post_attention_layernorm.weight"))?,
            gate_proj: linear(&format!("{m}mlp.gate_proj.weight"), inter, d)?,
            up_proj: linear(&format!("{m}mlp.up_proj.weight"), inter, d)?,
            down_proj: linear(&format!("{m}mlp.down_proj.weight"), d, inter)?,
            norm: vector("norm.weight")?,
            lm_head: linear("lm_head.weight", dv, d)?,
            config,
            vocab: vocab_map,
            rope,
            packed: None,
            host_decoding: true,
        })
    }

    /// A fresh draft for training: projections drawn from N(0, 0.02²) (transformers' Llama
    /// initialisation, which SpecForge keeps), norms at one; `embedding` is the target's
    /// `[target_vocab, d]`, frozen. The projections are drawn from `seed` alone
    /// ([`kd_kernels::SeededDraws`]: on the CPU, the values `device.seed(seed)` and the
    /// backend's `Tensor::random` would give, without that process-wide generator), so the
    /// same seed gives the same draft whatever else the process draws meanwhile.
    pub fn new(
        config: Eagle3Config,
        vocab: DraftVocab,
        embedding: Tensor<2>,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        let c = &config.llama;
        let (d, target_vocab) = (c.hidden_size, c.vocab_size);
        if embedding.dims() != [target_vocab, d] {
            return Err(ModelError::Input(format!(
                "the target embedding is {:?}; the draft expects [{target_vocab}, {d}]",
                embedding.dims()
            )));
        }
        if vocab.len() != config.draft_vocab_size || vocab.target_vocab() != target_vocab {
            return Err(ModelError::Input(format!(
                "a draft vocabulary of {} over {} target tokens for a draft of {} over {}",
                vocab.len(),
                vocab.target_vocab(),
                config.draft_vocab_size,
                target_vocab
            )));
        }
        let (q_out, kv_out) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let inter = c.intermediate_size;
        let dv = config.draft_vocab_size;
        let mut draws = kd_kernels::SeededDraws::new(seed);
        // Drawn in the order of the fields below.
        let mut linear = |input: usize, out: usize| {
            Param::from_tensor(draws.tensor(
                [input, out],
                burn::tensor::Distribution::Normal(0.0, 0.02),
                device,
            ))
        };
        let ones_of = |n: usize| Param::from_tensor(Tensor::<1>::ones([n], (device, DType::F32)));
        let ones = || ones_of(d);
        let qk_norm = || c.qk_norm().then(|| ones_of(c.head_dim));
        let features = 3 * config.target_hidden_size;
        Ok(Self {
            input_norm: config.norm_before_fc.then(|| ones_of(features)),
            fc: linear(features, d),
            embed_tokens: Param::from_tensor(embedding).set_require_grad(false),
            input_layernorm: ones(),
            hidden_norm: ones(),
            q_proj: linear(2 * d, q_out),
            k_proj: linear(2 * d, kv_out),
            v_proj: linear(2 * d, kv_out),
            o_proj: linear(q_out, d),
            q_norm: qk_norm(),
            k_norm: qk_norm(),
            post_attention_layernorm: ones(),
            gate_proj: linear(d, inter),
            up_proj: linear(d, inter),
            down_proj: linear(inter, d),
            norm: ones(),
            lm_head: linear(d, dv),
            rope: Rope::new(c),
            config,
            vocab,
            packed: None,
            host_decoding: true,
        })
    }

    /// Writes the draft as SpecForge exports it for serving: `config.json` and
    /// `model.safetensors` (f32, SpecForge's names, `d2t` and `t2d`, no embedding), both
    /// atomically.
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = self
            .named_tensors()
            .into_iter()
            .map(|(name, data)| {
                let shape = data.shape().to_vec();
                let values: Vec<f32> = data
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .expect("converted to f32");
                let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                (name, Dtype::F32, shape, bytes)
            })
            .collect();
        let d2t = self.vocab.d2t();
        tensors.push((
            "d2t".into(),
            Dtype::I64,
            vec![d2t.len()],
            d2t.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ));
        let t2d = self.vocab.t2d();
        tensors.push((
            "t2d".into(),
            Dtype::BOOL,
            vec![t2d.len()],
            t2d.iter().map(|&b| b as u8).collect(),
        ));
        let path = dir.join(WEIGHTS_FILE);
        let bytes = serialize_tensors(
            tensors
                .iter()
                .map(|(n, dt, shape, bytes)| (n.as_str(), *dt, shape.as_slice(), bytes.as_slice())),
            &path,
        )?;
        crate::weights::write_atomic(&path, &bytes)?;
        let config =
            serde_json::to_string_pretty(&self.config.to_json()).expect("a JSON value serialises");
        crate::weights::write_atomic(&dir.join("config.json"), config.as_bytes())
    }

    /// Decoding: runs new positions after what `cache` holds (plain causal attention over the
    /// cache and the new positions, RoPE positions continuing from the cache's length), and
    /// appends their keys and values. `ids` `[1, s]` are the tokens, `hidden` `[1, s, d]` the
    /// hidden inputs (fused target features for positions the target has verified, the
    /// draft's own output for drafted ones). Returns the hidden outputs `[1, s, d]`.
    pub fn forward_cached(
        &self,
        ids: Tensor<2, Int>,
        hidden: Tensor<3>,
        cache: &mut DraftKvCache,
    ) -> Tensor<3> {
        let [b, s] = ids.dims();
        if let Some(packs) = self.host_packs(b, s, &hidden) {
            let d = self.config.llama.hidden_size;
            let device = hidden.device();
            let embedded = self
                .embed_tokens
                .val()
                .select(0, ids.reshape([s]))
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .expect("converted to f32");
            let hidden = hidden
                .into_data()
                .try_into_vec::<f32>()
                .expect("host decoding takes f32 inputs");
            let out = host::forward_cached(self, packs, &embedded, &hidden, cache);
            return Tensor::from_data(TensorData::new(out, [1, s, d]), &device);
        }
        let (h, hd) = (
            self.config.llama.num_attention_heads,
            self.config.llama.head_dim,
        );
        let device = hidden.device();
        let past = cache.len();
        let (q, k, v, residual) = self.attention_inputs(ids, hidden, past, true);
        let (k, v) = cache.append(k, v);
        let total = past + s;
        let scale = 1.0 / (hd as f64).sqrt();
        // New position t (absolute past + t) sees keys up to past + t.
        let mut mask = vec![0i64; s * total];
        for t in 0..s {
            for key in past + t + 1..total {
                mask[t * total + key] = 1;
            }
        }
        let mask = Tensor::<2, Int>::from_data(TensorData::new(mask, [s, total]), &device)
            .bool()
            .unsqueeze::<4>()
            .expand([b, h, s, total]);
        let scores = q
            .matmul(repeat_kv(k, h).swap_dims(2, 3))
            .mul_scalar(scale)
            .mask_fill(mask, f32::NEG_INFINITY);
        let out = softmax(scores, 3).matmul(repeat_kv(v, h));
        self.finish(residual, out, true)
    }

    /// The configuration.
    pub fn config(&self) -> &Eagle3Config {
        &self.config
    }

    /// The draft vocabulary.
    pub fn vocab(&self) -> &DraftVocab {
        &self.vocab
    }

    /// `fc` over the target's features `[batch, seq, 3·d_target]` (low, mid, high layers
    /// concatenated): the hidden input of step 0, `[batch, seq, d]`.
    pub fn fuse(&self, features: Tensor<3>) -> Tensor<3> {
        project(self.normed_features(features), &self.fc)
    }

    /// The features as `fc` reads them: under `norm_before_fc`, RMS-normalised over all
    /// `3·d_target` values of a position.
    fn normed_features(&self, features: Tensor<3>) -> Tensor<3> {
        match &self.input_norm {
            Some(w) => rms_norm(features, w, self.config.llama.rms_norm_eps),
            None => features,
        }
    }

    /// [`fuse`](Self::fuse) for decoding: a few positions through the decoding kernels (see
    /// [`with_q8_0_weights`](Self::with_q8_0_weights)).
    pub fn fuse_decoding(&self, features: Tensor<3>) -> Tensor<3> {
        self.proj(self.normed_features(features), Proj::Fc, true)
    }

    /// One TTT step: `ids` `[batch, seq]` (the step's tokens), `hidden` `[batch, seq, d]` (the
    /// fused features at step 0, the previous step's output after), positions `t + step`
    /// where `step` is the number of steps in `cache`. Returns the step's hidden output
    /// (before the final norm), `[batch, seq, d]`. Rows are right-padded or full: a query
    /// never reads a later position.
    pub fn step(&self, ids: Tensor<2, Int>, hidden: Tensor<3>, cache: &mut TttCache) -> Tensor<3> {
        let [b, s] = ids.dims();
        let (h, hd) = (
            self.config.llama.num_attention_heads,
            self.config.llama.head_dim,
        );
        let device = hidden.device();
        let (q, k, v, residual) = self.attention_inputs(ids, hidden, cache.steps(), false);
        cache.keys.push(k);
        cache.values.push(v);
        let scale = 1.0 / (hd as f64).sqrt();
        // Step 0's keys, causally: [b, h, s, s].
        let k0 = repeat_kv(cache.keys[0].clone(), h);
        let v0 = repeat_kv(cache.values[0].clone(), h);
        let causal: Tensor<2, Bool> = Tensor::<2, Int>::ones([s, s], &device).triu(1).bool();
        let mut logits = vec![
            q.clone()
                .matmul(k0.swap_dims(2, 3))
                .mul_scalar(scale)
                .mask_fill(
                    causal.unsqueeze::<4>().expand([b, h, s, s]),
                    f32::NEG_INFINITY,
                ),
        ];
        // Each later step's key at the query's own position: [b, h, s, 1] each.
        let later: Vec<(Tensor<4>, Tensor<4>)> = (1..cache.keys.len())
            .map(|i| {
                (
                    repeat_kv(cache.keys[i].clone(), h),
                    repeat_kv(cache.values[i].clone(), h),
                )
            })
            .collect();
        for (ki, _) in &later {
            logits.push((q.clone() * ki.clone()).sum_dim(3).mul_scalar(scale));
        }
        let weights = softmax(Tensor::cat(logits, 3), 3);
        let mut out = weights.clone().slice([0..b, 0..h, 0..s, 0..s]).matmul(v0);
        for (i, (_, vi)) in later.into_iter().enumerate() {
            let a = weights.clone().slice([0..b, 0..h, 0..s, s + i..s + i + 1]);
            out = out + a * vi;
        }
        self.finish(residual, out, false)
    }

    /// The decoder layer's input and projections: `cat(RMSNorm(embedding), RMSNorm(hidden))`,
    /// then q `[b, heads, s, head_dim]` and k, v `[b, kv_heads, s, head_dim]`, with RoPE at
    /// positions `first_position + t`; and the residual the layer adds to (`hidden`, or its
    /// `hidden_norm` under `norm_before_residual`).
    fn attention_inputs(
        &self,
        ids: Tensor<2, Int>,
        hidden: Tensor<3>,
        first_position: usize,
        decode: bool,
    ) -> (Tensor<4>, Tensor<4>, Tensor<4>, Tensor<3>) {
        let c = &self.config.llama;
        let [b, s] = ids.dims();
        let (h, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let eps = c.rms_norm_eps;
        let device = hidden.device();
        let embedded = self
            .embed_tokens
            .val()
            .select(0, ids.reshape([b * s]))
            .reshape([b, s, c.hidden_size]);
        let normed = rms_norm(hidden.clone(), &self.hidden_norm, eps);
        let residual = if self.config.norm_before_residual {
            normed.clone()
        } else {
            hidden
        };
        let x = Tensor::cat(
            vec![rms_norm(embedded, &self.input_layernorm, eps), normed],
            2,
        );
        let positions: Vec<i64> = (0..b)
            .flat_map(|_| (0..s).map(move |t| (first_position + t) as i64))
            .collect();
        let (cos, sin) = self.rope.tables(&positions, b, s, DType::F32, &device);
        let heads = |t: Tensor<3>, n: usize| t.reshape([b, s, n, hd]).swap_dims(1, 2);
        // A Qwen3 layer normalises each head before RoPE.
        let q = head_norm(
            heads(self.proj(x.clone(), Proj::Q, decode), h),
            self.q_norm.as_ref(),
            eps,
        );
        let k = head_norm(
            heads(self.proj(x.clone(), Proj::K, decode), kv),
            self.k_norm.as_ref(),
            eps,
        );
        let (q, k) = (apply_rotary(q, &cos, &sin), apply_rotary(k, &cos, &sin));
        let v = heads(self.proj(x, Proj::V, decode), kv);
        (q, k, v, residual)
    }

    /// The rest of the layer from the attention output `[b, heads, s, head_dim]`: `o_proj`,
    /// the residual on the hidden stream, the post-attention norm and SwiGLU.
    fn finish(&self, residual: Tensor<3>, attention: Tensor<4>, decode: bool) -> Tensor<3> {
        let [b, h, s, hd] = attention.dims();
        let eps = self.config.llama.rms_norm_eps;
        let attn = self.proj(
            attention.swap_dims(1, 2).reshape([b, s, h * hd]),
            Proj::O,
            decode,
        );
        let hidden = residual + attn;
        let normed = rms_norm(hidden.clone(), &self.post_attention_layernorm, eps);
        let gate = silu(self.proj(normed.clone(), Proj::Gate, decode));
        let mlp = self.proj(
            gate * self.proj(normed, Proj::Up, decode),
            Proj::Down,
            decode,
        );
        hidden + mlp
    }

    /// The draft's logits over its vocabulary, `[batch, seq, draft_vocab]`, from a step's
    /// hidden output.
    pub fn logits(&self, hidden: Tensor<3>) -> Tensor<3> {
        let eps = self.config.llama.rms_norm_eps;
        project(rms_norm(hidden, &self.norm, eps), &self.lm_head)
    }

    /// [`logits`](Self::logits) for decoding: a few positions through the decoding kernels
    /// (see [`with_q8_0_weights`](Self::with_q8_0_weights)).
    pub fn logits_decoding(&self, hidden: Tensor<3>) -> Tensor<3> {
        let [b, s, _] = hidden.dims();
        if let Some(packs) = self.host_packs(b, s, &hidden) {
            let device = hidden.device();
            let values = hidden
                .into_data()
                .try_into_vec::<f32>()
                .expect("host decoding takes f32 inputs");
            let out = host::logits(packs, &values);
            let vocab = out.len() / s.max(1);
            return Tensor::from_data(TensorData::new(out, [1, s, vocab]), &device);
        }
        let eps = self.config.llama.rms_norm_eps;
        self.proj(rms_norm(hidden, &self.norm, eps), Proj::LmHead, true)
    }

    /// `steps` TTT steps from the target's features: the ids shift left by one per step
    /// (token 0 fills the end), each step reads the previous one's hidden output. Returns
    /// each step's logits `[batch, seq, draft_vocab]`.
    pub fn unroll(&self, ids: Tensor<2, Int>, features: Tensor<3>, steps: usize) -> Vec<Tensor<3>> {
        let [b, s] = ids.dims();
        let device = ids.device();
        let mut cache = TttCache::new();
        let mut hidden = self.fuse(features);
        let mut ids = ids;
        let mut out = Vec::with_capacity(steps);
        for step in 0..steps {
            if step > 0 {
                ids = Tensor::cat(
                    vec![
                        ids.slice([0..b, 1..s]),
                        Tensor::<2, Int>::zeros([b, 1], &device),
                    ],
                    1,
                );
            }
            hidden = self.step(ids.clone(), hidden, &mut cache);
            out.push(self.logits(hidden.clone()));
        }
        out
    }

    /// The tensors under SpecForge's names (`[out, in]` as nn.Linear holds them), for export;
    /// the embedding is left out, as SpecForge's SGLang export does.
    pub fn named_tensors(&self) -> BTreeMap<String, TensorData> {
        let mut out = BTreeMap::new();
        let mut linear = |name: &str, p: &Param<Tensor<2>>| {
            out.insert(name.to_string(), p.val().transpose().into_data());
        };
        linear("fc.weight", &self.fc);
        linear("midlayer.self_attn.q_proj.weight", &self.q_proj);
        linear("midlayer.self_attn.k_proj.weight", &self.k_proj);
        linear("midlayer.self_attn.v_proj.weight", &self.v_proj);
        linear("midlayer.self_attn.o_proj.weight", &self.o_proj);
        linear("midlayer.mlp.gate_proj.weight", &self.gate_proj);
        linear("midlayer.mlp.up_proj.weight", &self.up_proj);
        linear("midlayer.mlp.down_proj.weight", &self.down_proj);
        linear("lm_head.weight", &self.lm_head);
        for (name, p) in [
            ("midlayer.input_layernorm.weight", &self.input_layernorm),
            ("midlayer.hidden_norm.weight", &self.hidden_norm),
            (
                "midlayer.post_attention_layernorm.weight",
                &self.post_attention_layernorm,
            ),
            ("norm.weight", &self.norm),
        ] {
            out.insert(name.to_string(), p.val().into_data());
        }
        if let Some(p) = &self.input_norm {
            out.insert(export::INPUT_NORM.to_string(), p.val().into_data());
        }
        for (name, p) in export::QK_NORMS.iter().zip([&self.q_norm, &self.k_norm]) {
            if let Some(p) = p {
                out.insert(format!("midlayer.{name}"), p.val().into_data());
            }
        }
        out
    }
}

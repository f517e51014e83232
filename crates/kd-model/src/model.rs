//! The Llama decoder (Touvron et al. 2023, arXiv 2302.13971; Llama 3: arXiv 2407.21783),
//! written to match Hugging Face transformers' `modeling_llama.py` operation by operation.
//!
//! Module and field names equal the checkpoint keys (`model.layers.{i}.self_attn.q_proj`),
//! so loading and saving are mechanical. Burn's `Linear` stores `[in, out]`; checkpoints store
//! `[out, in]`: the loader transposes once.

use burn::module::Module;
use burn::nn::{Embedding, RmsNorm};
use burn::tensor::{DType, Tensor, TensorData};
use kd_lora::{LoraLinear, derive_seed};

use crate::batch::{ForwardOptions, HiddenStates, TokenBatch};
use crate::cache::KvCache;
use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};
use crate::ops;
use crate::rope::Rope;
use crate::skinny;

mod head;
mod host;
mod layer;

pub use head::LmHead;
pub(crate) use head::trains;
pub(crate) use host::{HostLayer, HostNorm, rotate, swap_seq_heads};
use layer::rms_norm;
pub use layer::{Attention, DecoderLayer, Mlp};
pub(crate) use layer::{LayerMask, LayerPacks, repeat_kv};

/// The output of a forward pass.
#[derive(Debug, Clone)]
pub struct ModelOutput {
    /// `[batch, seq, vocab]` logits (`[batch, n, vocab]` with `last_positions: Some(n)`), in
    /// the model's compute dtype; `None` when not requested.
    pub logits: Option<Tensor<3>>,
    /// The requested hidden states `[batch, seq, hidden]`, each with its Hugging Face index.
    pub hidden_states: Vec<(usize, Tensor<3>)>,
}

impl ModelOutput {
    /// The logits, or an error when the forward pass was asked not to compute them.
    pub fn into_logits(self) -> Result<Tensor<3>> {
        self.logits.ok_or_else(|| {
            ModelError::Input("logits were not requested (ForwardOptions::logits = false)".into())
        })
    }

    /// The hidden state with Hugging Face index `index`, if it was requested.
    pub fn hidden_state(&self, index: usize) -> Option<&Tensor<3>> {
        self.hidden_states
            .iter()
            .find(|(i, _)| *i == index)
            .map(|(_, t)| t)
    }
}

/// A Llama-architecture causal language model (`LlamaForCausalLM`).
#[derive(Module, Debug)]
pub struct Llama {
    /// Token embedding (`model.embed_tokens`), `[vocab, hidden]`.
    pub embed_tokens: Embedding,
    /// The decoder layers (`model.layers`).
    pub layers: Vec<DecoderLayer>,
    /// Final norm (`model.norm`).
    pub norm: RmsNorm,
    /// The LM head (`lm_head`), absent when tied to the embedding.
    pub lm_head: Option<LmHead>,
    #[module(skip)]
    config: LlamaConfig,
    #[module(skip)]
    rope: Rope,
    /// GGUF blocks kept for decoding (`Llama::load_for_inference`), mirroring the weights.
    #[module(skip)]
    pub(crate) packed: Option<std::sync::Arc<crate::packed::Packed>>,
    /// The settings of the adapters attached by `apply_lora` / `load_adapter` (what
    /// `save_adapter` writes as `adapter_config.json`); `None` without adapters.
    #[module(skip)]
    pub(crate) lora: Option<kd_lora::LoraConfig>,
}

impl Llama {
    /// A randomly initialised model (transformers' init: normal(0, 0.02) weights, unit norms),
    /// drawn from the device's generator: benchmarks and tests without checkpoints.
    pub fn random(config: &LlamaConfig, device: &burn::tensor::Device) -> Self {
        use burn::nn::{EmbeddingConfig, Initializer, LinearConfig, RmsNormConfig};
        let init = Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        let linear = |i: usize, o: usize, bias: bool| {
            LoraLinear::new(
                LinearConfig::new(i, o)
                    .with_bias(bias)
                    .with_initializer(init.clone())
                    .init(device),
            )
        };
        let norm_of = |width: usize| {
            RmsNormConfig::new(width)
                .with_epsilon(config.rms_norm_eps)
                .init(device)
        };
        let norm = || norm_of(config.hidden_size);
        let (d, q, kv, i) = (
            config.hidden_size,
            config.num_attention_heads * config.head_dim,
            config.num_key_value_heads * config.head_dim,
            config.intermediate_size,
        );
        let ([qb, kb, vb, ob], mb) = (config.attention_biases(), config.mlp_bias);
        let layers = (0..config.num_hidden_layers)
            .map(|_| DecoderLayer {
                input_layernorm: norm(),
                self_attn: Self::attention_from_parts(
                    config,
                    [
                        linear(d, q, qb),
                        linear(d, kv, kb),
                        linear(d, kv, vb),
                        linear(q, d, ob),
                    ],
                    config
                        .qk_norm()
                        .then(|| [norm_of(config.head_dim), norm_of(config.head_dim)]),
                ),
                post_attention_layernorm: norm(),
                mlp: Mlp {
                    gate_proj: linear(d, i, mb),
                    up_proj: linear(d, i, mb),
                    down_proj: linear(i, d, mb),
                },
            })
            .collect();
        let embed_tokens = EmbeddingConfig::new(config.vocab_size, d)
            .with_initializer(init.clone())
            .init(device);
        let lm_head = (!config.tie_word_embeddings).then(|| LmHead {
            weight: init.init([config.vocab_size, d], device),
        });
        Self::from_parts(config.clone(), embed_tokens, layers, norm(), lm_head)
    }

    pub(crate) fn from_parts(
        config: LlamaConfig,
        embed_tokens: Embedding,
        layers: Vec<DecoderLayer>,
        norm: RmsNorm,
        lm_head: Option<LmHead>,
    ) -> Self {
        let rope = Rope::new(&config);
        Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            config,
            rope,
            packed: None,
            lora: None,
        }
    }

    pub(crate) fn attention_from_parts(
        config: &LlamaConfig,
        [q_proj, k_proj, v_proj, o_proj]: [LoraLinear; 4],
        qk_norms: Option<[RmsNorm; 2]>,
    ) -> Attention {
        let (q_norm, k_norm) = match qk_norms {
            Some([q, k]) => (Some(q), Some(k)),
            None => (None, None),
        };
        Attention {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
            num_heads: config.num_attention_heads,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        }
    }

    /// Keeps only the decoder layers at the given indices (in increasing order), with the
    /// embeddings, final norm and LM head unchanged: a known way to initialise a draft from
    /// its target (layer skipping / early exit).
    pub fn keep_layers(self, keep: &[usize]) -> Result<Self> {
        let n = self.layers.len();
        if keep.is_empty() {
            return Err(ModelError::Input("keep at least one layer".into()));
        }
        if let Some(bad) = keep.iter().find(|i| **i >= n) {
            return Err(ModelError::Input(format!(
                "layer {bad} does not exist: the model has layers 0..{n}"
            )));
        }
        if keep.windows(2).any(|w| w[0] >= w[1]) {
            return Err(ModelError::Input(format!(
                "layers to keep must be distinct and increasing, got {keep:?}"
            )));
        }
        let packed = self
            .packed
            .as_ref()
            .map(|p| std::sync::Arc::new(p.keep(keep)));
        let mut config = self.config;
        config.num_hidden_layers = keep.len();
        let mut slots: Vec<Option<DecoderLayer>> = self.layers.into_iter().map(Some).collect();
        let layers = keep
            .iter()
            .map(|i| slots[*i].take().expect("indices are distinct"))
            .collect();
        let lora = self.lora;
        let mut out = Self::from_parts(config, self.embed_tokens, layers, self.norm, self.lm_head);
        out.packed = packed;
        out.lora = lora;
        Ok(out)
    }

    /// Every adapter-capable projection with its module path
    /// (`model.layers.{i}.self_attn.q_proj`, …), in checkpoint order.
    pub fn projections(&self) -> Vec<(String, &LoraLinear)> {
        let mut out = Vec::with_capacity(self.layers.len() * 7);
        let names = [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ];
        for (i, l) in self.layers.iter().enumerate() {
            for (name, p) in names.into_iter().zip(l.projections()) {
                out.push((format!("model.layers.{i}.{name}"), p));
            }
        }
        out
    }

    /// Mutable access to the projections, in the order of [`projections`](Self::projections).
    pub(crate) fn projections_mut(&mut self) -> Vec<&mut LoraLinear> {
        let mut out = Vec::with_capacity(self.layers.len() * 7);
        for l in &mut self.layers {
            let (a, m) = (&mut l.self_attn, &mut l.mlp);
            out.extend([&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj]);
            out.extend([&mut m.gate_proj, &mut m.up_proj, &mut m.down_proj]);
        }
        out
    }

    /// The configuration this model was built from.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The RoPE inverse frequencies in use.
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// The dtype of the weights, which is the dtype activations are computed in.
    pub fn dtype(&self) -> DType {
        self.embedding_meta().1
    }

    /// An empty KV cache sized for this model (its capacity grows as tokens arrive).
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.layers.len())
    }

    /// An empty KV cache for this model that allocates `slots` token slots per row at once
    /// (prompt + new tokens, padding included, when known: no reallocation while decoding).
    pub fn new_cache_with_capacity(&self, slots: usize) -> KvCache {
        KvCache::with_capacity(self.layers.len(), slots)
    }

    /// Runs the model over a whole padded batch.
    pub fn forward(&self, batch: &TokenBatch, options: &ForwardOptions) -> Result<ModelOutput> {
        self.run(batch, None, options)
    }

    /// Logits `[batch, seq, vocab]` of a padded batch.
    pub fn logits(&self, batch: &TokenBatch) -> Result<Tensor<3>> {
        let out = self.forward(batch, &ForwardOptions::default())?;
        Ok(out.logits.expect("logits were requested"))
    }

    /// Runs the model over new tokens that follow what `cache` holds, and appends them to it.
    ///
    /// Feed the (left-padded) prompts first, then one token per row per step. Padding in the
    /// new tokens is allowed too (a row that has finished can be fed padding).
    pub fn forward_cached(
        &self,
        batch: &TokenBatch,
        cache: &mut KvCache,
        options: &ForwardOptions,
    ) -> Result<ModelOutput> {
        if cache.num_layers() != self.layers.len() {
            return Err(ModelError::Input(format!(
                "the cache has {} layers, the model {}",
                cache.num_layers(),
                self.layers.len()
            )));
        }
        cache.check_batch(batch.batch_size())?;
        if batch.segments().is_some() {
            return Err(ModelError::Input(
                "packed batches (segment ids) are for full forward passes, not the KV cache".into(),
            ));
        }
        // On a worker of the pool: no hand-off per operation of the pass.
        self.run_decoding(|| self.run(batch, Some(cache), options))
    }

    fn run(
        &self,
        batch: &TokenBatch,
        mut cache: Option<&mut KvCache>,
        options: &ForwardOptions,
    ) -> Result<ModelOutput> {
        let (b, s) = (batch.batch_size(), batch.seq_len());
        if b == 0 || s == 0 {
            return Err(ModelError::Input(format!("empty batch [{b}, {s}]")));
        }
        if let Some(cache) = cache.as_deref_mut()
            && let Some(chunks) = prefill_chunks(self, batch, options)
        {
            return self.run_chunked(batch, cache, options, &chunks);
        }
        let vocab = self.config.vocab_size;
        if let Some(bad) = batch.ids().iter().find(|id| **id as usize >= vocab) {
            return Err(ModelError::Input(format!(
                "token id {bad} is out of range for a vocabulary of {vocab}"
            )));
        }
        let n_layers = self.layers.len();
        let wanted: Vec<usize> = match &options.hidden_states {
            HiddenStates::None => Vec::new(),
            HiddenStates::All => (0..=n_layers).collect(),
            HiddenStates::Layers(l) => l.clone(),
        };
        if let Some(bad) = wanted.iter().find(|i| **i > n_layers) {
            return Err(ModelError::Input(format!(
                "hidden state {bad} requested; valid indices are 0..={n_layers} \
                 (0 = embeddings, {n_layers} = after the final norm)"
            )));
        }

        let (device, dtype, _) = self.embedding_meta();
        let empty = KvCache::new(0);
        let past_cache = cache.as_deref().unwrap_or(&empty);
        let past = past_cache.len();
        let positions = batch.resolved_positions(past_cache.real_lengths());
        let head_dim = self.config.head_dim;
        let mask = LayerMask::new(
            attention_mask(batch, past_cache.valid_rows(), past),
            [b, s, past + s],
            1.0 / (head_dim as f64).sqrt(),
            ops::applies(&device, dtype),
            &device,
        )?;

        let mut x = self.embed(batch, &device);
        let mut collected: Vec<Option<Tensor<3>>> = vec![None; wanted.len()];
        let mut record = |index: usize, x: &Tensor<3>| {
            for (slot, w) in wanted.iter().enumerate() {
                if *w == index {
                    collected[slot] = Some(x.clone());
                }
            }
        };
        record(0, &x);
        let host = match (
            self.layers_on_host(b * s, options),
            cache.as_deref_mut(),
            mask.job(),
        ) {
            (Some(host), Some(cache), Some(job)) => Some((host, cache, job)),
            _ => None,
        };
        if let Some((host, cache, job)) = host {
            // A few rows of a model that decodes from packed blocks: each layer on the host.
            let (cos, sin) = self.rope.host_tables(&positions);
            let pass = host::HostPass {
                batch: b,
                seq: s,
                cos: &cos,
                sin: &sin,
                job,
                device: &device,
            };
            x = self.forward_on_host(host, x, &pass, cache, &wanted, &mut record);
        } else {
            let (cos, sin) = self.rope.tables(&positions, b, s, dtype, &device);
            for (i, layer) in self.layers.iter().enumerate() {
                let layer_cache = cache.as_deref_mut().map(|c| (c, i));
                let seed = options.dropout_seed.map(|s| derive_seed(s, &[i as u64]));
                let packs = self.packed.as_ref().map(|p| &p.layers[i]);
                x = layer.forward(x, &cos, &sin, &mask, layer_cache, seed, packs);
                // HF's entry for the last layer is the normed output, recorded below.
                if i + 1 < n_layers {
                    record(i + 1, &x);
                }
            }
        }
        if let Some(cache) = cache {
            cache.push_mask(b, s, batch.mask());
        }
        let x = rms_norm(&self.norm, x);
        record(n_layers, &x);
        let hidden = wanted
            .iter()
            .zip(collected)
            .map(|(i, t)| (*i, t.expect("every requested index was recorded")))
            .collect();

        let logits = match options.last_positions {
            Some(n) if n == 0 || n > s => {
                return Err(ModelError::Input(format!(
                    "logits of the last {n} positions asked for a batch of {s} positions"
                )));
            }
            Some(n) if n < s => x.slice([0..b, s - n..s]),
            _ => x,
        };
        let logits = options.logits.then(|| self.lm_head_forward(logits));
        Ok(ModelOutput {
            logits,
            hidden_states: hidden,
        })
    }

    /// A long pass through the KV cache in consecutive chunks of positions (see
    /// [`prefill_chunks`]): each chunk's keys and values join the cache before the next
    /// chunk attends to them, as one pass would; the last chunk's output is the pass's.
    fn run_chunked(
        &self,
        batch: &TokenBatch,
        cache: &mut KvCache,
        options: &ForwardOptions,
        chunks: &[std::ops::Range<usize>],
    ) -> Result<ModelOutput> {
        let (b, s) = (batch.batch_size(), batch.seq_len());
        let mut out: Option<ModelOutput> = None;
        // The hidden states asked for, chunk by chunk (joined along the positions below).
        let mut hidden: Vec<Vec<Tensor<3>>> = Vec::new();
        // Positions `cols` of every row of a row-major `[b, s]` array.
        fn columns<T: Copy>(v: &[T], b: usize, s: usize, cols: &std::ops::Range<usize>) -> Vec<T> {
            (0..b)
                .flat_map(|r| v[r * s + cols.start..r * s + cols.end].iter().copied())
                .collect()
        }
        for (k, cols) in chunks.iter().enumerate() {
            let part = TokenBatch::new(
                b,
                cols.len(),
                columns(batch.ids(), b, s, cols),
                columns(batch.mask(), b, s, cols),
            )?;
            let last = k + 1 == chunks.len();
            let opts = ForwardOptions {
                logits: last && options.logits,
                ..options.clone()
            };
            let mut part_out = self.run(&part, Some(&mut *cache), &opts)?;
            hidden.resize_with(part_out.hidden_states.len(), Vec::new);
            for (slot, (_, h)) in hidden.iter_mut().zip(&part_out.hidden_states) {
                slot.push(h.clone());
            }
            if last {
                for ((_, h), parts) in part_out.hidden_states.iter_mut().zip(&mut hidden) {
                    *h = Tensor::cat(std::mem::take(parts), 1);
                }
            }
            out = Some(part_out);
        }
        out.ok_or_else(|| ModelError::Input("no chunks".into()))
    }

    /// The decoder layers over the embeddings `x` on the host (`model::host`), handing
    /// `record` each hidden state in `wanted` but the last (recorded after the final norm).
    fn forward_on_host(
        &self,
        host: &[HostLayer],
        x: Tensor<3>,
        pass: &host::HostPass<'_>,
        cache: &mut KvCache,
        wanted: &[usize],
        record: &mut dyn FnMut(usize, &Tensor<3>),
    ) -> Tensor<3> {
        let shape = x.dims();
        let mut xs: Vec<f32> = x.into_data().try_into_vec().expect("f32 embeddings");
        let packs = &self
            .packed
            .as_ref()
            .expect("host layers come with packs")
            .layers;
        let n_layers = self.layers.len();
        for (i, layer) in self.layers.iter().enumerate() {
            host::decode_layer(layer, &packs[i], &host[i], &mut xs, pass, (cache, i));
            if i + 1 < n_layers && wanted.contains(&(i + 1)) {
                record(
                    i + 1,
                    &Tensor::from_data(TensorData::new(xs.clone(), shape), pass.device),
                );
            }
        }
        Tensor::from_data(TensorData::new(xs, shape), pass.device)
    }

    /// The host copies of every layer's norms and biases when a pass of `rows` rows decodes
    /// on the host (`model::host`): packed blocks for every projection, no adapter, no
    /// dropout, f32 on the CPU backend without autodiff, and no more rows than the packed
    /// products serve faster than a GEMM — any number for a lean model, which has no f32
    /// copy for the GEMM to read.
    fn layers_on_host(&self, rows: usize, options: &ForwardOptions) -> Option<&[HostLayer]> {
        let packed = self.packed.as_ref()?;
        let host = packed.host.as_deref()?;
        let (device, dtype, autodiff) = self.embedding_meta();
        let applies = (rows <= skinny::MAX_ROWS || packed.lean)
            && skinny::avx2()
            && options.dropout_seed.is_none()
            && !autodiff
            && ops::applies(&device, dtype)
            && self.layers.iter().all(|l| {
                l.projections()
                    .iter()
                    .all(|p| p.adapter.is_none() && !trains(&p.base.weight))
            });
        applies.then_some(host)
    }
}

/// The boolean mask `[batch, seq, past + seq]`, row-major (`true` = masked): a query sees
/// the real keys at or before its own slot.
fn attention_mask(batch: &TokenBatch, past_valid: &[Vec<bool>], past: usize) -> Vec<bool> {
    let (b, s) = (batch.batch_size(), batch.seq_len());
    let total = past + s;
    let mut data = Vec::with_capacity(b * s * total);
    for (row, new) in batch.mask().chunks_exact(s).enumerate() {
        let past_row = past_valid.get(row).map_or(&[][..], Vec::as_slice);
        let valid = |j: usize| {
            if j < past { past_row[j] } else { new[j - past] }
        };
        let segs = batch.segments().map(|g| &g[row * s..(row + 1) * s]);
        for i in 0..s {
            for j in 0..total {
                // Packed sequences (full passes only) attend within their own segment.
                let same_segment = match segs {
                    Some(g) if j >= past => g[j - past] == g[i],
                    _ => true,
                };
                data.push(!(valid(j) && j <= past + i && same_segment));
            }
        }
    }
    data
}

/// Positions per chunk of a long pass through the KV cache (a prompt's prefill): the
/// activations of one chunk at a time, not of the whole prompt, are what a pass holds.
const PREFILL_CHUNK: usize = 128;

/// The chunks of positions a pass runs in, when it is long and chunking changes nothing but
/// memory: through a cache, on a model that decodes each layer on the host, with logits of
/// at most the last chunk's positions, and the batch's positions implied by its mask (no
/// explicit positions, no packed segments). Hidden states asked for are joined from the
/// chunks', so that asking for them does not change the pass the logits come from.
fn prefill_chunks(
    model: &Llama,
    batch: &TokenBatch,
    options: &ForwardOptions,
) -> Option<Vec<std::ops::Range<usize>>> {
    let s = batch.seq_len();
    let last = s - (s - 1) % PREFILL_CHUNK - 1;
    let fits = match options.last_positions {
        Some(n) => n > 0 && n <= s - last,
        None => !options.logits,
    };
    let plain = batch.positions().is_none() && batch.segments().is_none();
    // (Dropout is ruled out by `layers_on_host`.)
    (s > PREFILL_CHUNK
        && fits
        && plain
        && model
            .layers_on_host(batch.batch_size() * PREFILL_CHUNK, options)
            .is_some())
    .then(|| {
        (0..s)
            .step_by(PREFILL_CHUNK)
            .map(|c| c..(c + PREFILL_CHUNK).min(s))
            .collect()
    })
}

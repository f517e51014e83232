//! A Llama-architecture decoder on Burn 0.22 that loads Hugging Face checkpoints and matches
//! transformers' `LlamaForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM` numerically
//! (the families differ only where [`ModelFamily`] says: biases, per-head q/k norms).
//!
//! - [`LlamaConfig`] reads `config.json` in both styles found in the wild (the hub's Llama 3.x
//!   files and what transformers ≥ 5 writes).
//! - [`Llama::load`] reads `model.safetensors` or a sharded checkpoint (F32/BF16/F16), checks
//!   every tensor by name and shape, and computes in f32 (or bf16 on request).
//! - [`Llama::forward`] runs a padded [`TokenBatch`] and returns logits and, on request, hidden
//!   states indexed as transformers' `output_hidden_states`.
//! - [`Llama::forward_cached`] decodes incrementally with a [`KvCache`]; each row of a
//!   left-padded batch decodes as it would alone; [`KvCache::truncate`] rolls rows back.
//! - [`Llama::generate`]: the decode loop (greedy or [`Sampling`] from per-prompt seeded
//!   streams, rows finishing independently), shared by the teacher and the speculative
//!   decoder.
//! - [`Llama::save`] writes the model back in Hugging Face layout.
//!
//! ```no_run
//! use kd_model::{parse_device, ForwardOptions, HiddenStates, Llama, TokenBatch};
//!
//! # fn main() -> Result<(), kd_model::ModelError> {
//! let device = parse_device("cpu")?;
//! let model = Llama::load("path/to/Llama-3.2-1B", &device)?;
//! let batch = TokenBatch::single(&[128000, 9906, 1917]);
//! let out = model.forward(&batch, &ForwardOptions::with_hidden_states(HiddenStates::All))?;
//! let last_hidden = out.hidden_state(model.config().num_hidden_layers); // after the final norm
//! let logits = out.logits.as_ref().expect("requested"); // [1, 3, vocab]
//! # let _ = (logits, last_hidden);
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

mod batch;
mod cache;
mod config;
pub mod device;
pub mod eagle3;
mod error;
mod family;
pub mod generate;
pub mod gguf;
pub mod hub;
mod lora;
mod model;
pub mod ops;
mod packed;
mod q8;
mod q8k;
mod rope;
pub mod sampling;
mod skinny;
pub mod weights;

/// The model's building blocks: the types of [`Llama`]'s public fields and the rotary
/// embedding, for code that reads or replaces a layer.
pub mod layers {
    pub use crate::model::{Attention, DecoderLayer, LmHead, Mlp};
    pub use crate::rope::{Rope, apply_rotary};
    pub use kd_lora::LoraLinear;
}

use std::path::Path;

use burn::tensor::Device;

pub use batch::{ForwardOptions, HiddenStates, PaddingSide, TokenBatch};
pub use cache::KvCache;
pub use config::{LlamaConfig, RopeScaling, StoredDType};
pub use device::parse_device;
pub use eagle3::{DraftVocab, Eagle3Config, Eagle3Draft};
pub use error::{ModelError, Result};
pub use family::ModelFamily;
pub use generate::{
    CapturedRow, Completion, FinishReason, GenerateOptions, GenerateTimings, SeededPrompt,
};
pub use kd_lora::{LoraConfig, TargetModules};
pub use lora::ParameterReport;
pub use model::{Llama, ModelOutput};
pub use sampling::Sampling;
pub use weights::{ComputeDType, SaveDType};

impl Llama {
    /// Loads a model computing in f32: a Hugging Face directory (`config.json` and
    /// safetensors weights), a `.gguf` file, a directory holding one `.gguf` file and no
    /// `config.json`, or a hub id (`org/name`) found in the local Hugging Face cache
    /// ([`hub::resolve_model_path`]). Llama, Qwen2/Qwen2.5 and Qwen3 models ([`ModelFamily`]).
    pub fn load(path: impl AsRef<Path>, device: &Device) -> Result<Self> {
        Self::load_with(path, ComputeDType::F32, device)
    }

    /// Like [`load`](Self::load), computing in the given dtype. GGUF weights are dequantised
    /// to f32 (then rounded to bf16 when asked).
    pub fn load_with(path: impl AsRef<Path>, dtype: ComputeDType, device: &Device) -> Result<Self> {
        let path = &hub::resolve_model_path(path)?;
        if let Some(file) = gguf::gguf_path(path)? {
            let (source, config) = gguf::GgufSource::open(&file)?;
            return weights::load(&source, config, dtype, device);
        }
        let config = LlamaConfig::from_file(path.join("config.json"))?;
        weights::load(&weights::Checkpoint::open(path)?, config, dtype, device)
    }

    /// Like [`load`](Self::load), for a model that only infers (a teacher, a target, a chat):
    /// from a GGUF file on the CPU it keeps the projections and the LM head stored as Q8_0,
    /// Q4_0 or Q4_1 in those blocks, and decoding reads them instead of an f32 copy — the same
    /// weight values, a fraction of the memory traffic. The model is lean: the f32 copy of a
    /// weight held in blocks is made only when a path needs it ([`f32_copies_made`](
    /// Self::f32_copies_made)), so decoding and prefill through the KV cache never make one
    /// where every projection is packed (each layer then runs on the host for any number of
    /// rows). Do not train or merge into such a model's base weights: the blocks would not
    /// follow ([`merge_and_unload`](Self::merge_and_unload) drops them).
    pub fn load_for_inference(path: impl AsRef<Path>, device: &Device) -> Result<Self> {
        let path = &hub::resolve_model_path(path)?;
        let Some(file) = gguf::gguf_path(path)? else {
            return Self::load(path, device);
        };
        let (source, config) = gguf::GgufSource::open(&file)?;
        if *device != Device::flex() {
            return weights::load(&source, config, ComputeDType::F32, device);
        }
        // Lean: the blocks first, and each packed matrix's f32 weight made from them only
        // when a path reads it.
        let (layers, head) = packed::Packed::matrices(source.file(), &config);
        let tied = config.tie_word_embeddings;
        let lazy = |name: &str| -> Option<burn::module::Param<burn::tensor::Tensor<2>>> {
            // The LM head, or the embedding when tied (the head's blocks are the embedding's).
            if name == "lm_head.weight" || name == "model.embed_tokens.weight" && tied {
                return head.as_ref().map(|m| m.lazy_weight(false, device));
            }
            let rest = name.strip_prefix("model.layers.")?;
            let (layer, module) = rest.split_once('.')?;
            // The projections in `LayerPacks` order: q, k, v, o, gate, up, down.
            let slot = gguf::LAYER_MODULES[2..]
                .iter()
                .position(|(_, hf)| module.strip_suffix(".weight") == Some(*hf))?;
            layers.get(layer.parse::<usize>().ok()?)?[slot]
                .as_ref()
                .map(|m| m.lazy_weight(true, device))
        };
        let mut model = weights::load_with(&source, config, ComputeDType::F32, device, &lazy)?;
        let mut packed = packed::Packed::with_host(layers, head, &model);
        packed.lean = true;
        tracing::debug!(matrices = packed.count(), "kept GGUF blocks for decoding");
        model.packed = Some(std::sync::Arc::new(packed));
        Ok(model)
    }

    /// How [`load_for_inference`](Self::load_for_inference) would decode the model at
    /// `path` on the CPU: for a GGUF file (or a directory holding one), how many of its
    /// decoder projections (q, k, v, o, gate, up, down of every layer) are stored as Q8_0,
    /// Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K, which decoding reads packed, and how many
    /// there are. When all are, passes of up to 32 rows run each layer on the host ([`with_host_layers`](Self::with_host_layers)).
    /// `None` for a Hugging Face directory. Reads only the file's header.
    pub fn packed_projections(path: impl AsRef<Path>) -> Result<Option<(usize, usize)>> {
        let path = &hub::resolve_model_path(path)?;
        let Some(file) = gguf::gguf_path(path)? else {
            return Ok(None);
        };
        let g = kd_gguf::GgufFile::open(&file)?;
        let layers = gguf::config_from_gguf(&g)?.num_hidden_layers;
        let names: Vec<&str> = gguf::LAYER_MODULES
            .iter()
            .filter(|(_, hf)| hf.ends_with("_proj"))
            .map(|(g, _)| *g)
            .collect();
        let packed = (0..layers)
            .flat_map(|l| names.iter().map(move |m| format!("blk.{l}.{m}.weight")))
            .filter(|n| g.tensor(n).is_some_and(|t| packed::group::packable(t.ty)))
            .count();
        Ok(Some((packed, layers * names.len())))
    }

    /// Whether decoding reads packed GGUF blocks ([`load_for_inference`](Self::load_for_inference)).
    pub fn has_packed_weights(&self) -> bool {
        self.packed.is_some()
    }

    /// For a lean model ([`load_for_inference`](Self::load_for_inference) on the CPU), how
    /// many of the weights held in blocks (projections, and the LM head or the tied
    /// embedding) also have their f32 copy made, of how many: `(0, n)`
    /// while only the blocks are read; a path that needs a weight in f32 (training, merging,
    /// saving, the per-operation path over more than 32 rows, another device) makes it then.
    /// `None` for a model that holds its f32 weights from the start.
    pub fn f32_copies_made(&self) -> Option<(usize, usize)> {
        let packed = self.packed.as_ref().filter(|p| p.lean)?;
        let mut weights: Vec<&burn::module::Param<burn::tensor::Tensor<2>>> = Vec::new();
        for (layer, packs) in self.layers.iter().zip(&packed.layers) {
            for (p, pack) in layer.projections().iter().zip(packs) {
                if pack.is_some() {
                    weights.push(&p.base.weight);
                }
            }
        }
        if packed.head.is_some() {
            weights.push(self.head_param());
        }
        let made = weights.iter().filter(|w| w.is_initialized()).count();
        Some((made, weights.len()))
    }

    /// Decoding from packed GGUF blocks with 8-bit activations, as llama.cpp's CPU backend
    /// computes: each product's input rows are quantised to 8-bit blocks of 32 (Q8_1; for
    /// K-quant weights super-blocks of 256, Q8_K) and meet the weights' blocks in integer dot
    /// products (AVX2, or AVX-512 VNNI where the CPU has it). Faster than dequantising each block to f32, and no longer the f32 copy's
    /// arithmetic. A row's products do not depend on the rest of the batch, and attention
    /// takes a pass of up to 16 tokens per row token by token, so such a pass (a speculative
    /// verification) gives each row the bits of one-token passes. Longer passes (a prompt)
    /// round differently from one-token passes in their last bits, which 8-bit rounding can
    /// turn into another greedy token (so speculative decoding reads the prompts in a pass of
    /// their own, as plain decoding does). No effect on a model without packed blocks, on
    /// passes that a model with f32 copies runs as tensor operations (more than a few rows:
    /// prefill, training; a lean model runs every pass on the host, 8-bit), or below AVX2
    /// (`KD_SIMD=scalar`), where decoding reads the blocks' f32 values.
    pub fn with_int8_activations(mut self, on: bool) -> Self {
        if let Some(p) = self.packed.as_mut() {
            std::sync::Arc::make_mut(p).set_int8(on);
        }
        self
    }

    /// The 8-bit products of Q4_1 and Q8_0 blocks ([`with_int8_activations`](Self::with_int8_activations)
    /// on) run on Intel AMX tiles, where the CPU has AMX-INT8 (Sapphire Rapids and later
    /// Xeons) and the SIMD level in use is AVX-512: one tile instruction takes up to 16
    /// tokens, so a pass over a few tokens (a speculative verification) costs about what one
    /// costs. Each block's 32 products are summed exactly in one integer, where the AVX-512
    /// kernels (and ggml) sum eight lanes of four apart: other rounding, not ggml's bits,
    /// still independent of the rest of the batch. The weights are repacked once (0.625
    /// byte per weight for Q4_1, 1.0625 for Q8_0, beside the GGUF file's mapped blocks).
    /// No effect without 8-bit activations or elsewhere; [`amx_tiles`](Self::amx_tiles) says
    /// whether it took. Call it after `with_int8_activations` (which drops the tiles when
    /// turned off).
    pub fn with_amx_tiles(mut self, on: bool) -> Self {
        if let Some(p) = self.packed.as_mut() {
            std::sync::Arc::make_mut(p).set_amx(on);
        }
        self
    }

    /// Whether some packed product runs on AMX tiles ([`with_amx_tiles`](Self::with_amx_tiles)).
    pub fn amx_tiles(&self) -> bool {
        self.packed.as_ref().is_some_and(|p| p.amx())
    }

    /// Whether this process can run 8-bit products on AMX tiles
    /// ([`with_amx_tiles`](Self::with_amx_tiles)): a CPU with AMX-INT8 under Linux, the SIMD
    /// level in use AVX-512 (`KD_SIMD` not capping it), and the tile state granted. Whether a
    /// given model uses them also depends on its block types (Q4_1, Q8_0).
    pub fn amx_tiles_available() -> bool {
        packed::amx_available()
    }

    /// Runs `f` (decoding work of this model: a pass through the KV cache, a generation or
    /// speculative loop) on a worker of rayon's pool. On the CPU backend the pool's other
    /// workers stay awake while it runs ([`kd_kernels::keep_awake`]): a decode step is a few
    /// hundred short parallel operations, and waking a sleeping worker for each costs about
    /// what it saves (measured on a 2-core KVM guest, SmolLM2 Q4_1 on AMX tiles: a pass over
    /// 2 tokens 1.10–1.12× a 1-token pass with sleeping workers, 1.00–1.05× with them awake).
    /// Other backends only need the hand-off to the pool ([`kd_kernels::on_pool`]).
    pub fn run_decoding<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.embed_tokens.weight.lazy_device().without_autodiff() == Device::flex() {
            kd_kernels::keep_awake(f)
        } else {
            kd_kernels::on_pool(f)
        }
    }

    /// Decoding from Q8_0 blocks made now from the f32 weights (every projection and the LM
    /// head), as if the model had been loaded from a Q8_0 GGUF file: a quarter of the f32
    /// bytes per decoded token, and no longer the f32 arithmetic (each weight rounded to 8 bits
    /// in blocks of 32; opt in). Replaces blocks kept from a GGUF file; `on = false` drops
    /// them all (decoding then reads the f32 weights). Only on the CPU backend; adapters
    /// still add their own product, and a model whose base weights change afterwards (merged
    /// adapters, training) must call it again. Below AVX2 (`KD_SIMD=scalar`) the blocks stand
    /// down and decoding reads the f32 weights.
    pub fn with_q8_0_weights(mut self, on: bool) -> Self {
        self.packed = (on && self.embed_tokens.weight.lazy_device() == Device::flex())
            .then(|| std::sync::Arc::new(packed::Packed::q8_0_from_weights(&self)));
        self
    }

    /// Decoding passes of a few rows (up to 32: a decode step, a speculative verification;
    /// any number through the KV cache for a lean model, prefill included) run each decoder
    /// layer on the host, in one call, where the model decodes from packed blocks (the
    /// default): plain f32 rows through the same kernels as Burn's per-operation path,
    /// bit-identical to it, without a tensor operation per step of the layer. `false`
    /// keeps the per-operation path (for comparisons). No effect without packed blocks, with
    /// adapters attached, with dropout, or below AVX2.
    pub fn with_host_layers(mut self, on: bool) -> Self {
        if let Some(p) = self.packed.take() {
            let mut p = std::sync::Arc::unwrap_or_clone(p);
            p.set_host(on.then_some(&self));
            self.packed = Some(std::sync::Arc::new(p));
        }
        self
    }

    /// Whether the model has host layers ([`with_host_layers`](Self::with_host_layers)). A pass
    /// runs on them where they apply: few rows, no adapters or dropout, AVX2 or above.
    pub fn host_layers(&self) -> bool {
        self.packed.as_ref().is_some_and(|p| p.host.is_some())
    }

    /// Whether packed products take 8-bit activations ([`with_int8_activations`](Self::with_int8_activations)).
    pub fn int8_activations(&self) -> bool {
        self.packed.as_ref().is_some_and(|p| p.int8())
    }

    /// Writes `config.json` and the weights to `dir` in Hugging Face layout (shards of at most
    /// [`weights::DEFAULT_MAX_SHARD_BYTES`]), every file atomically.
    pub fn save(&self, dir: impl AsRef<Path>, dtype: SaveDType) -> Result<()> {
        self.save_sharded(dir, dtype, weights::DEFAULT_MAX_SHARD_BYTES)
    }

    /// Like [`save`](Self::save), with a chosen shard size.
    pub fn save_sharded(
        &self,
        dir: impl AsRef<Path>,
        dtype: SaveDType,
        max_shard_bytes: usize,
    ) -> Result<()> {
        let dir = dir.as_ref();
        weights::save(self, dir, dtype, max_shard_bytes)?;
        let mut config = self.config().clone();
        config.torch_dtype = Some(match dtype {
            SaveDType::F32 => StoredDType::F32,
            SaveDType::BF16 => StoredDType::BF16,
            SaveDType::F16 => StoredDType::F16,
        });
        let text = serde_json::to_string_pretty(&config.to_json()).expect("JSON values serialise");
        weights::write_atomic(&dir.join("config.json"), text.as_bytes())
    }
}

/// The unit tests again at every lower instruction-set level (`KD_SIMD`), in child processes.
#[cfg(test)]
mod levels {
    #[test]
    fn unit_tests_pass_at_every_lower_level() {
        kd_kernels::testing::assert_passes_at_lower_levels(&[], &["levels::"]);
    }
}

//! GGUF files (llama.cpp's format) of the `llama`, `qwen2` and `qwen3` architectures: the
//! hyper-parameters from the metadata, the tensors under their Hugging Face names,
//! dequantised to f32, with the Q/K row permutation of llama.cpp's converter undone.
//!
//! llama.cpp's `convert_hf_to_gguf.py` stores a Llama's `q_proj` and `k_proj` with the two
//! halves of each head interleaved (its `LlamaModel.permute`: rows `(head, half, i)` become
//! `(head, i, half)`), because ggml rotates adjacent pairs where transformers rotates
//! `(i, i + d/2)`. [`unpermute_rows`] reverses that, so the model computes exactly what
//! transformers' `LlamaForCausalLM` loaded from the same file computes. The Qwen converters
//! keep Hugging Face's row order (llama.cpp runs those architectures with NEOX-style RoPE),
//! so their rows are read as stored.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::{DType, TensorData};
use half::bf16;
use kd_gguf::GgufFile;
use serde_json::{Value, json};

use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};
use crate::family::ModelFamily;
use crate::weights::{TensorSource, transpose_data};

/// The name of the tensor holding llama3-style RoPE frequency divisors.
const ROPE_FREQS: &str = "rope_freqs.weight";

/// A GGUF file as a tensor source with Hugging Face names.
pub(crate) struct GgufSource {
    file: GgufFile,
    /// Hugging Face name → (GGUF name, heads to un-permute by).
    names: BTreeMap<String, (String, Option<usize>)>,
}

impl GgufSource {
    pub(crate) fn open(path: &Path) -> Result<(Self, LlamaConfig)> {
        let file = GgufFile::open(path)?;
        let config = config_from_gguf(&file)?;
        let mut names = BTreeMap::new();
        let mut unknown = Vec::new();
        for t in file.tensors() {
            match hf_name(&t.name, &config) {
                Some((hf, heads)) => {
                    names.insert(hf, (t.name.clone(), heads));
                }
                None if t.name == ROPE_FREQS => {}
                None => unknown.push(format!(
                    "unexpected tensor `{}` with dims {:?} (not part of a {} model)",
                    t.name, t.dims, config.family
                )),
            }
        }
        if !unknown.is_empty() {
            return Err(ModelError::Weights {
                dir: path.to_path_buf(),
                problems: unknown,
            });
        }
        Ok((Self { file, names }, config))
    }

    /// The open file.
    pub(crate) fn file(&self) -> &GgufFile {
        &self.file
    }
}

impl TensorSource for GgufSource {
    fn origin(&self) -> &Path {
        self.file.path()
    }

    fn shapes(&self) -> Result<BTreeMap<String, Vec<usize>>> {
        Ok(self
            .names
            .iter()
            .map(|(hf, (name, _))| {
                let t = self
                    .file
                    .tensor(name)
                    .expect("named from the file's tensors");
                (hf.clone(), t.shape())
            })
            .collect())
    }

    fn read(&self, name: &str, dtype: DType, transpose: bool) -> Result<TensorData> {
        let (gguf_name, heads) = &self.names[name];
        let info = self
            .file
            .tensor(gguf_name)
            .expect("named from the file's tensors");
        let shape = info.shape();
        let mut values = self.file.dequantize(gguf_name)?;
        if let Some(heads) = *heads {
            values = unpermute_rows(&values, &shape, heads).ok_or_else(|| ModelError::Weights {
                dir: self.file.path().to_path_buf(),
                problems: vec![format!(
                    "tensor `{gguf_name}` with shape {shape:?} cannot hold {heads} heads \
                         of even width"
                )],
            })?;
        }
        Ok(if dtype == DType::BF16 {
            let values: Vec<bf16> = values.into_iter().map(bf16::from_f32).collect();
            transpose_data(values, shape, transpose)
        } else {
            transpose_data(values, shape, transpose)
        })
    }
}

/// Undoes llama.cpp's Q/K permutation of a `[rows, cols]` projection of `heads` heads:
/// row `(h, i, half)` of the file is row `(h, half, i)` of the Hugging Face weight.
/// `None` when the rows are not `heads` heads of even width.
pub fn unpermute_rows(values: &[f32], shape: &[usize], heads: usize) -> Option<Vec<f32>> {
    let (rows, cols) = match *shape {
        [rows, cols] => (rows, cols),
        [rows] => (rows, 1),
        _ => return None,
    };
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        return None;
    }
    let mut out = vec![0f32; values.len()];
    for (dst, src) in unpermuted_order(rows, heads).into_iter().enumerate() {
        out[dst * cols..(dst + 1) * cols].copy_from_slice(&values[src * cols..(src + 1) * cols]);
    }
    Some(out)
}

/// For each Hugging Face row of a `rows`-row Q/K projection of `heads` heads, the file's row
/// it comes from: HF row `(h, half, i)` is file row `(h, i, half)`. `rows` must be a multiple
/// of `2 · heads`.
pub(crate) fn unpermuted_order(rows: usize, heads: usize) -> Vec<usize> {
    let half = rows / heads / 2;
    let mut order = vec![0; rows];
    for h in 0..heads {
        for i in 0..half {
            for which in 0..2 {
                order[h * 2 * half + which * half + i] = (h * half + i) * 2 + which;
            }
        }
    }
    order
}

/// The Hugging Face name of a GGUF tensor of a llama model, and the number of heads to
/// un-permute it by (queries and keys).
fn hf_name(gguf: &str, c: &LlamaConfig) -> Option<(String, Option<usize>)> {
    let top = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(t) = top {
        return Some((t.to_string(), None));
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let (hf, heads) = match module {
        "attn_q_norm" if c.qk_norm() => ("self_attn.q_norm", None),
        "attn_k_norm" if c.qk_norm() => ("self_attn.k_norm", None),
        _ => {
            let &(_, hf) = LAYER_MODULES.iter().find(|(g, _)| *g == module)?;
            (hf, permuted_heads(hf, c))
        }
    };
    let heads = heads.filter(|_| c.family.gguf_permutes_qk() && suffix == "weight");
    Some((format!("model.layers.{layer}.{hf}.{suffix}"), heads))
}

/// A decoder layer's modules: llama.cpp's name (`blk.N.<name>`) and Hugging Face's
/// (`model.layers.N.<name>`).
pub(crate) const LAYER_MODULES: [(&str, &str); 9] = [
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// The heads by which llama.cpp's converter permutes a Llama module's rows (queries and
/// keys), given its Hugging Face name.
pub(crate) fn permuted_heads(hf_module: &str, c: &LlamaConfig) -> Option<usize> {
    match hf_module {
        "self_attn.q_proj" => Some(c.num_attention_heads),
        "self_attn.k_proj" => Some(c.num_key_value_heads),
        _ => None,
    }
}

/// The configuration a `llama`, `qwen2` or `qwen3` GGUF file describes, as the
/// `config.json` transformers' GGUF loader would derive (`LlamaConfig::to_json` writes it
/// back).
pub(crate) fn config_from_gguf(g: &GgufFile) -> Result<LlamaConfig> {
    let path = g.path().to_path_buf();
    let arch = g.str("general.architecture")?;
    let Some(family) = ModelFamily::from_model_type(arch) else {
        return Err(ModelError::config(
            &path,
            "general.architecture",
            format!(
                "unsupported architecture `{arch}`: supported are {} (Llama, SmolLM, \
                 TinyLlama, Qwen2, Qwen2.5, Qwen3, …)",
                ModelFamily::supported()
            ),
        ));
    };
    let key = |k: &str| format!("{arch}.{k}");
    let hidden = g.uint(&key("embedding_length"))?;
    let heads = g.uint(&key("attention.head_count"))?;
    let kv_heads = g
        .opt_uint(&key("attention.head_count_kv"))?
        .unwrap_or(heads);
    let head_dim = match g.opt_uint(&key("attention.key_length"))? {
        Some(d) => d,
        None if heads > 0 => hidden / heads,
        None => 0,
    };
    if let Some(v) = g.opt_uint(&key("attention.value_length"))?
        && v != head_dim
    {
        return Err(ModelError::config(
            &path,
            key("attention.value_length"),
            format!("{v} differs from the key length {head_dim}; {arch} uses one head width"),
        ));
    }
    if let Some(r) = g.opt_uint(&key("rope.dimension_count"))?
        && r != head_dim
    {
        return Err(ModelError::config(
            &path,
            key("rope.dimension_count"),
            format!("{r}: partial rotary embeddings (head width {head_dim}) are not supported"),
        ));
    }
    if let Some(t) = g.opt_str(&key("rope.scaling.type"))?
        && t != "none"
    {
        return Err(ModelError::config(
            &path,
            key("rope.scaling.type"),
            format!("RoPE scaling `{t}` is not supported (plain and llama3-style are)"),
        ));
    }
    let rope_theta = g.opt_float(&key("rope.freq_base"))?.unwrap_or(10_000.0);
    let embd = g.tensor("token_embd.weight").ok_or_else(|| {
        ModelError::Gguf(kd_gguf::GgufError::MissingTensor {
            path: path.clone(),
            name: "token_embd.weight".into(),
        })
    })?;
    let vocab = embd.shape()[0];
    let rope_scaling = match g.tensor(ROPE_FREQS) {
        None => Value::Null,
        Some(_) => llama3_scaling(g, rope_theta, head_dim as usize)?,
    };
    let token = |name: &str| -> Result<Value> {
        Ok(g.opt_uint(&format!("tokenizer.ggml.{name}_token_id"))?
            .map_or(Value::Null, Value::from))
    };
    let config = json!({
        "architectures": [family.architecture()],
        "model_type": family.model_type(),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": g.uint(&key("feed_forward_length"))?,
        "num_hidden_layers": g.uint(&key("block_count"))?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": g.opt_float(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": g.opt_uint(&key("context_length"))?.unwrap_or(2048),
        "tie_word_embeddings": g.tensor("output.weight").is_none(),
        "attention_bias": g.tensor("blk.0.attn_q.bias").is_some(),
        "mlp_bias": g.tensor("blk.0.ffn_gate.bias").is_some(),
        "bos_token_id": token("bos")?,
        "eos_token_id": token("eos")?,
        "pad_token_id": token("padding")?,
        "torch_dtype": "float32",
    });
    let text = serde_json::to_string(&config).expect("JSON values serialise");
    LlamaConfig::from_json_str(&text).map_err(|e| match e {
        ModelError::Config { field, message, .. } => ModelError::Config {
            path: PathBuf::from(g.path()),
            field: format!("(derived config.json) {field}"),
            message,
        },
        other => other,
    })
}

/// Recovers the llama3 RoPE scaling parameters whose frequency divisors llama.cpp's converter
/// stored in `rope_freqs.weight` (it keeps the divisors, not the parameters): the largest
/// divisor is the factor; the original context length is searched over powers of two with
/// Meta's low/high frequency factors (1 and 4).
fn llama3_scaling(g: &GgufFile, theta: f64, head_dim: usize) -> Result<Value> {
    let stored = g.dequantize(ROPE_FREQS)?;
    let err = |message: String| ModelError::config(g.path(), ROPE_FREQS, message);
    if stored.len() != head_dim / 2 {
        return Err(err(format!(
            "{} values, expected head_dim / 2 = {}",
            stored.len(),
            head_dim / 2
        )));
    }
    let factor = stored.iter().copied().fold(1.0f32, f32::max) as f64;
    let freqs: Vec<f64> = (0..head_dim)
        .step_by(2)
        .map(|i| 1.0 / theta.powf(i as f64 / head_dim as f64))
        .collect();
    let (low, high) = (1.0f64, 4.0f64);
    let divisors = |old: f64| -> Vec<f64> {
        freqs
            .iter()
            .map(|&f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < old / high {
                    1.0
                } else if wavelen > old / low {
                    factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                }
            })
            .collect()
    };
    let hint = g.opt_uint("llama.rope.scaling.original_context_length")?;
    let candidates = hint
        .into_iter()
        .chain((4..=24).map(|p| 1u64 << p))
        .collect::<Vec<_>>();
    for old in candidates {
        let d = divisors(old as f64);
        if d.iter()
            .zip(&stored)
            .all(|(a, &b)| (a - b as f64).abs() <= 1e-4 * a.abs())
        {
            return Ok(json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": old,
            }));
        }
    }
    Err(err(
        "the frequency divisors match no llama3 scaling (factor = their maximum, low/high \
         frequency factors 1 and 4, any power-of-two original context): this scaling is not \
         supported"
            .into(),
    ))
}

/// The GGUF file a model path names (see [`kd_gguf::locate`]).
pub(crate) fn gguf_path(path: &Path) -> Result<Option<PathBuf>> {
    Ok(kd_gguf::locate(path, "config.json")?)
}

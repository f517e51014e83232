//! `LlamaConfig`: the Hugging Face `config.json` of a Llama, Qwen2 / Qwen2.5 or Qwen3 model
//! (the family from `model_type` / `architectures`, see [`ModelFamily`]).
//!
//! Two styles are found in the wild and both are read:
//! - the hub's Llama 3.x checkpoints (transformers 4.x): top-level `rope_theta`,
//!   `rope_scaling` (`null` or a dict with `rope_type`/`type`) and `torch_dtype`;
//! - transformers ≥ 5: `rope_parameters` holding `rope_theta`, `rope_type` and the scaling
//!   fields, and `dtype`.
//!
//! Defaults for absent fields are those of transformers' `LlamaConfig`, `Qwen2Config` and
//! `Qwen3Config`.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{ModelError, Result};
use crate::family::ModelFamily;

mod fields;

use fields::Fields;

/// How rotary position embeddings are computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE (`rope_type` "default", or no scaling at all).
    Default,
    /// Llama 3.1's frequency-dependent scaling (`rope_type` "llama3").
    Llama3 {
        /// `factor` (8 for Llama 3.1, 32 for Llama 3.2).
        factor: f64,
        /// `low_freq_factor` (1 in Meta's checkpoints).
        low_freq_factor: f64,
        /// `high_freq_factor` (4 in Meta's checkpoints).
        high_freq_factor: f64,
        /// `original_max_position_embeddings` (8192 in Meta's checkpoints).
        original_max_position_embeddings: usize,
    },
}

/// The dtype the checkpoint declares (`torch_dtype` or `dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDType {
    /// `float32`.
    F32,
    /// `bfloat16`.
    BF16,
    /// `float16`.
    F16,
}

impl StoredDType {
    /// The name transformers uses (`"bfloat16"`).
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::BF16 => "bfloat16",
            Self::F16 => "float16",
        }
    }

    fn from_hf_name(name: &str) -> Option<Self> {
        match name.trim_start_matches("torch.") {
            "float32" | "float" => Some(Self::F32),
            "bfloat16" => Some(Self::BF16),
            "float16" | "half" => Some(Self::F16),
            _ => None,
        }
    }
}

/// A Llama-architecture model configuration, validated.
///
/// Read one with [`LlamaConfig::from_file`] or [`LlamaConfig::from_json_str`]; write one back
/// with [`LlamaConfig::to_json`], which keeps every field of the original file.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// The decoder family (`model_type`): what differs between Llama, Qwen2 and Qwen3.
    pub family: ModelFamily,
    /// Vocabulary size (rows of the embedding and of the LM head).
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention when smaller than the query heads).
    pub num_key_value_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// Epsilon of the RMS norms.
    pub rms_norm_eps: f64,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// Longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// Whether the LM head shares the token embedding matrix.
    pub tie_word_embeddings: bool,
    /// `attention_bias` of the config: bias on the q/k/v/o projections of a Llama or Qwen3
    /// (a Qwen2 always has q/k/v biases and no o bias: see
    /// [`attention_biases`](Self::attention_biases)).
    pub attention_bias: bool,
    /// Bias on the MLP projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// Beginning-of-sequence token ids (usually one).
    pub bos_token_ids: Vec<u32>,
    /// End-of-sequence token ids (Llama 3.1 Instruct lists three).
    pub eos_token_ids: Vec<u32>,
    /// Padding token id, if the configuration names one.
    pub pad_token_id: Option<u32>,
    /// The dtype the checkpoint declares.
    pub torch_dtype: Option<StoredDType>,
    /// The original JSON object (every field, including those not interpreted here).
    raw: Map<String, Value>,
}

const MEMORY: &str = "<memory>";

impl LlamaConfig {
    /// Reads and validates a `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::parse(&text, path)
    }

    /// The configuration of a llama-architecture GGUF file (a file, or a directory holding
    /// one `.gguf` file), as transformers' GGUF loader derives it from the metadata.
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = crate::gguf::gguf_path(path)?.ok_or_else(|| {
            ModelError::config(
                path,
                "<path>",
                "is not a .gguf file or a directory holding one",
            )
        })?;
        crate::gguf::config_from_gguf(&kd_gguf::GgufFile::open(file)?)
    }

    /// Parses and validates the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self> {
        Self::parse(text, Path::new(MEMORY))
    }

    fn parse(text: &str, path: &Path) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let Value::Object(raw) = value else {
            return Err(ModelError::config(path, "<root>", "expected a JSON object"));
        };
        Self::from_map(raw, path)
    }

    fn from_map(raw: Map<String, Value>, path: &Path) -> Result<Self> {
        let f = Fields { map: &raw, path };
        let family = f.family()?;
        f.check_attention_layout(family)?;
        match f.str_opt("hidden_act")? {
            None | Some("silu") => {}
            Some(other) => {
                return Err(f.err(
                    "hidden_act",
                    format!("unsupported activation {other:?}: Llama uses \"silu\""),
                ));
            }
        }

        let hidden_size = f.usize_req("hidden_size")?;
        let num_attention_heads = f.usize_req("num_attention_heads")?;
        let num_key_value_heads = f
            .usize_opt("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        if num_attention_heads == 0 || !num_attention_heads.is_multiple_of(num_key_value_heads) {
            return Err(f.err(
                "num_key_value_heads",
                format!(
                    "{num_key_value_heads} must be positive and divide \
                     num_attention_heads ({num_attention_heads})"
                ),
            ));
        }
        let head_dim = match f.usize_opt("head_dim")?.or(family.default_head_dim()) {
            Some(d) => d,
            None if hidden_size.is_multiple_of(num_attention_heads) => {
                hidden_size / num_attention_heads
            }
            None => {
                return Err(f.err(
                    "head_dim",
                    format!(
                        "absent, and hidden_size ({hidden_size}) is not a multiple of \
                         num_attention_heads ({num_attention_heads})"
                    ),
                ));
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(f.err("head_dim", format!("{head_dim} must be even and positive")));
        }

        let (rope_theta, rope_scaling) = f.rope()?;
        let torch_dtype = f.dtype()?;

        let (has_attention_bias, has_mlp_bias) = family.config_fields();
        let config = Self {
            family,
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize_req("intermediate_size")?,
            num_hidden_layers: f.usize_req("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: f
                .usize_opt("max_position_embeddings")?
                .unwrap_or(family.default_max_positions()),
            tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            attention_bias: has_attention_bias && f.bool_opt("attention_bias")?.unwrap_or(false),
            mlp_bias: has_mlp_bias && f.bool_opt("mlp_bias")?.unwrap_or(false),
            bos_token_ids: f.ids("bos_token_id")?,
            eos_token_ids: f.ids("eos_token_id")?,
            pad_token_id: f.ids("pad_token_id")?.first().copied(),
            torch_dtype,
            raw: Map::new(),
        };
        for (field, value) in [
            ("vocab_size", config.vocab_size),
            ("hidden_size", config.hidden_size),
            ("intermediate_size", config.intermediate_size),
            ("num_hidden_layers", config.num_hidden_layers),
        ] {
            if value == 0 {
                return Err(f.err(field, "must be positive"));
            }
        }
        if config.rms_norm_eps.is_nan() || config.rms_norm_eps <= 0.0 {
            return Err(f.err("rms_norm_eps", "must be positive"));
        }
        Ok(Self { raw, ..config })
    }

    /// Builds a configuration in code (every other field takes transformers' default:
    /// untied, no biases, eps 1e-6, plain RoPE with θ = 10000).
    pub fn new(
        vocab_size: usize,
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        num_key_value_heads: usize,
    ) -> Result<Self> {
        let json = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": num_attention_heads,
            "num_key_value_heads": num_key_value_heads,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "max_position_embeddings": 2048,
            "tie_word_embeddings": false,
            "dtype": "float32",
        });
        let Value::Object(map) = json else {
            unreachable!("json! of an object literal is an object")
        };
        Self::from_map(map, Path::new(MEMORY))
    }

    /// The bench model every performance figure of this project uses ("bench-155m",
    /// `docs/src/benchmarks.md`): vocab 128256, hidden 512, 8 layers, 8 heads, 4 KV heads,
    /// intermediate 1408, θ = 500000, untied, eps 1e-5.
    pub fn bench_155m() -> Self {
        let mut c = Self::new(128_256, 512, 1408, 8, 8, 4).expect("valid preset");
        c.rope_theta = 500_000.0;
        c.rms_norm_eps = 1e-5;
        c
    }

    /// The same shape as a Llama (an EAGLE-3 draft layer over a Qwen target is Llama-shaped,
    /// as SpecForge's is): family, `model_type` and the fields only Qwen reads reset.
    pub(crate) fn into_llama_layout(mut self) -> Self {
        self.family = ModelFamily::Llama;
        self.raw.insert("model_type".into(), "llama".into());
        self.raw.remove("architectures");
        for key in [
            "use_sliding_window",
            "sliding_window",
            "max_window_layers",
            "layer_types",
        ] {
            self.raw.remove(key);
        }
        self
    }

    /// Which of the q, k, v and o projections carry a bias.
    pub fn attention_biases(&self) -> [bool; 4] {
        self.family.attention_biases(self.attention_bias)
    }

    /// Whether each query and key head is RMS-normalised before RoPE (Qwen3's `q_norm`,
    /// `k_norm`).
    pub fn qk_norm(&self) -> bool {
        self.family.qk_norm()
    }

    /// The number of query heads that share one key/value head.
    pub fn kv_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// The number of parameters of the model this configuration describes.
    pub fn num_parameters(&self) -> usize {
        let (d, h, kv, hd, i) = (
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.intermediate_size,
        );
        let attn = d * h * hd * 2 + d * kv * hd * 2;
        let [qb, kb, vb, ob] = self.attention_biases();
        let attn_bias = usize::from(qb) * h * hd
            + (usize::from(kb) + usize::from(vb)) * kv * hd
            + usize::from(ob) * d;
        let attn_bias = attn_bias + if self.qk_norm() { 2 * hd } else { 0 };
        let mlp = 3 * d * i + if self.mlp_bias { 2 * i + d } else { 0 };
        let layer = attn + attn_bias + mlp + 2 * d;
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * d
        };
        self.vocab_size * d + self.num_hidden_layers * layer + d + head
    }

    /// The configuration as a `config.json` object.
    ///
    /// Fields of the original file that this crate does not interpret are kept unchanged;
    /// interpreted fields take their current values, in the style of the original file
    /// (`rope_parameters` or `rope_theta` + `rope_scaling`).
    pub fn to_json(&self) -> Value {
        let mut map = self.raw.clone();
        let mut put = |k: &str, v: Value| {
            map.insert(k.to_string(), v);
        };
        put("vocab_size", self.vocab_size.into());
        put("hidden_size", self.hidden_size.into());
        put("intermediate_size", self.intermediate_size.into());
        put("num_hidden_layers", self.num_hidden_layers.into());
        put("num_attention_heads", self.num_attention_heads.into());
        put("num_key_value_heads", self.num_key_value_heads.into());
        put("head_dim", self.head_dim.into());
        put("rms_norm_eps", self.rms_norm_eps.into());
        put(
            "max_position_embeddings",
            self.max_position_embeddings.into(),
        );
        put("tie_word_embeddings", self.tie_word_embeddings.into());
        let (has_attention_bias, has_mlp_bias) = self.family.config_fields();
        if has_attention_bias {
            put("attention_bias", self.attention_bias.into());
        }
        if has_mlp_bias {
            put("mlp_bias", self.mlp_bias.into());
        }
        put("bos_token_id", ids_json(&self.bos_token_ids));
        put("eos_token_id", ids_json(&self.eos_token_ids));
        if let Some(pad) = self.pad_token_id {
            put("pad_token_id", pad.into());
        }
        let mut rope = Map::new();
        match self.rope_scaling {
            RopeScaling::Default => {
                rope.insert("rope_type".into(), "default".into());
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                rope.insert("rope_type".into(), "llama3".into());
                rope.insert("factor".into(), factor.into());
                rope.insert("low_freq_factor".into(), low_freq_factor.into());
                rope.insert("high_freq_factor".into(), high_freq_factor.into());
                rope.insert(
                    "original_max_position_embeddings".into(),
                    original_max_position_embeddings.into(),
                );
            }
        }
        let dtype_key = if map.contains_key("rope_parameters") {
            rope.insert("rope_theta".into(), self.rope_theta.into());
            map.insert("rope_parameters".into(), Value::Object(rope));
            "dtype"
        } else {
            map.insert("rope_theta".into(), self.rope_theta.into());
            let scaling = match self.rope_scaling {
                RopeScaling::Default => Value::Null,
                RopeScaling::Llama3 { .. } => Value::Object(rope),
            };
            map.insert("rope_scaling".into(), scaling);
            if map.contains_key("dtype") {
                "dtype"
            } else {
                "torch_dtype"
            }
        };
        if let Some(dtype) = self.torch_dtype {
            map.insert(dtype_key.into(), dtype.hf_name().into());
        }
        map.entry("architectures")
            .or_insert_with(|| serde_json::json!([self.family.architecture()]));
        map.entry("model_type")
            .or_insert_with(|| self.family.model_type().into());
        map.entry("hidden_act").or_insert_with(|| "silu".into());
        Value::Object(map)
    }
}

fn ids_json(ids: &[u32]) -> Value {
    match ids {
        [] => Value::Null,
        [one] => (*one).into(),
        many => many.iter().copied().map(Value::from).collect(),
    }
}

#[cfg(test)]
mod tests;

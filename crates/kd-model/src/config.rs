//! `LlamaConfig`: the Hugging Face `config.json` of a Llama-architecture model.
//!
//! Two styles are found in the wild and both are read:
//! - the hub's Llama 3.x checkpoints (transformers 4.x): top-level `rope_theta`,
//!   `rope_scaling` (`null` or a dict with `rope_type`/`type`) and `torch_dtype`;
//! - transformers ≥ 5: `rope_parameters` holding `rope_theta`, `rope_type` and the scaling
//!   fields, and `dtype`.
//!
//! Defaults for absent fields are those of transformers' `LlamaConfig`.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{ModelError, Result};
use crate::family::ModelFamily;

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

/// Typed access to the fields of a config object, with errors naming the field.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn err(&self, field: &str, message: impl Into<String>) -> ModelError {
        ModelError::config(PathBuf::from(self.path), field, message)
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn usize_req(&self, key: &str) -> Result<usize> {
        self.usize_opt(key)?
            .ok_or_else(|| self.err(key, "missing (a positive integer is required)"))
    }

    fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                as_usize(v, || {
                    self.err(key, format!("expected a non-negative integer, found {v}"))
                })
            })
            .transpose()
    }

    fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| self.err(key, format!("expected a number, found {v}")))
            })
            .transpose()
    }

    fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.err(key, format!("expected true or false, found {v}")))
            })
            .transpose()
    }

    fn str_opt(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.err(key, format!("expected a string, found {v}")))
            })
            .transpose()
    }

    /// A token id given as an integer, a list of integers, or null.
    fn ids(&self, key: &str) -> Result<Vec<u32>> {
        let bad = |v: &Value| {
            self.err(
                key,
                format!("expected a token id or a list of ids, found {v}"),
            )
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| as_u32(v).ok_or_else(|| bad(v)))
                .collect(),
            Some(v) => Ok(vec![as_u32(v).ok_or_else(|| bad(v))?]),
        }
    }

    /// The family `model_type` and `architectures` name (Llama when neither is given);
    /// an unknown one, or the two naming different families, is an error listing the
    /// supported ones.
    fn family(&self) -> Result<ModelFamily> {
        let from_type = match self.str_opt("model_type")? {
            None => None,
            Some(t) => Some(ModelFamily::from_model_type(t).ok_or_else(|| {
                self.err(
                    "model_type",
                    format!(
                        "unsupported model type {t:?}: supported are {}",
                        ModelFamily::supported()
                    ),
                )
            })?),
        };
        let from_arch = match self.get("architectures") {
            None | Some(Value::Null) => None,
            Some(archs) => {
                let names: Vec<&str> = archs
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                let family = names
                    .iter()
                    .find_map(|n| ModelFamily::from_architecture(n))
                    .ok_or_else(|| {
                        let known: Vec<_> =
                            ModelFamily::ALL.iter().map(|f| f.architecture()).collect();
                        self.err(
                            "architectures",
                            format!("unsupported architecture {archs}: supported are {known:?}"),
                        )
                    })?;
                Some(family)
            }
        };
        match (from_type, from_arch) {
            (Some(t), Some(a)) if t != a => Err(self.err(
                "architectures",
                format!(
                    "names {} but model_type is {:?}",
                    a.architecture(),
                    t.model_type()
                ),
            )),
            (t, a) => Ok(t.or(a).unwrap_or_default()),
        }
    }

    /// Refuses what the model would otherwise silently compute differently: sliding-window
    /// attention switched on (Qwen2/Qwen3's `use_sliding_window`, or transformers ≥ 5's
    /// `layer_types` naming a sliding layer).
    fn check_attention_layout(&self, family: ModelFamily) -> Result<()> {
        if family != ModelFamily::Llama && self.bool_opt("use_sliding_window")? == Some(true) {
            return Err(self.err(
                "use_sliding_window",
                "sliding-window attention is not supported; released Qwen checkpoints set \
                 it to false",
            ));
        }
        if let Some(types) = self.get("layer_types").and_then(Value::as_array)
            && let Some((i, t)) = types
                .iter()
                .enumerate()
                .find(|(_, t)| t.as_str() != Some("full_attention"))
        {
            return Err(self.err(
                &format!("layer_types[{i}]"),
                format!("{t}: only \"full_attention\" layers are supported"),
            ));
        }
        Ok(())
    }

    fn dtype(&self) -> Result<Option<StoredDType>> {
        for key in ["dtype", "torch_dtype"] {
            if let Some(name) = self.str_opt(key)? {
                return StoredDType::from_hf_name(name).map(Some).ok_or_else(|| {
                    self.err(
                        key,
                        format!(
                            "unsupported dtype {name:?}: expected float32, bfloat16 or float16"
                        ),
                    )
                });
            }
        }
        Ok(None)
    }

    /// `rope_parameters` (transformers ≥ 5) or `rope_theta` + `rope_scaling` (4.x).
    fn rope(&self) -> Result<(f64, RopeScaling)> {
        let (section, params) = match self.get("rope_parameters") {
            Some(Value::Object(p)) => ("rope_parameters", Some(p)),
            Some(v) => {
                return Err(self.err("rope_parameters", format!("expected an object, found {v}")));
            }
            None => match self.get("rope_scaling") {
                Some(Value::Object(p)) => ("rope_scaling", Some(p)),
                Some(v) => {
                    return Err(self.err(
                        "rope_scaling",
                        format!("expected an object or null, found {v}"),
                    ));
                }
                None => ("rope_scaling", None),
            },
        };
        let sub = |k: &str| format!("{section}.{k}");
        let theta_in_section = params
            .and_then(|p| p.get("rope_theta"))
            .filter(|v| !v.is_null());
        let rope_theta = match theta_in_section {
            Some(v) => v.as_f64().ok_or_else(|| {
                self.err(&sub("rope_theta"), format!("expected a number, found {v}"))
            })?,
            None => self.f64_opt("rope_theta")?.unwrap_or(10_000.0),
        };
        if rope_theta.is_nan() || rope_theta <= 0.0 {
            return Err(self.err("rope_theta", "must be positive"));
        }
        let Some(p) = params else {
            return Ok((rope_theta, RopeScaling::Default));
        };
        let type_key = if p.contains_key("rope_type") {
            "rope_type"
        } else {
            "type"
        };
        let rope_type = match p.get(type_key) {
            None | Some(Value::Null) => "default",
            Some(Value::String(s)) => s.as_str(),
            Some(v) => {
                return Err(self.err(&sub(type_key), format!("expected a string, found {v}")));
            }
        };
        let num = |k: &str| -> Result<f64> {
            p.get(k).and_then(Value::as_f64).ok_or_else(|| {
                self.err(
                    &sub(k),
                    "missing or not a number (required by rope_type \"llama3\")",
                )
            })
        };
        match rope_type {
            "default" => Ok((rope_theta, RopeScaling::Default)),
            "llama3" => {
                let (factor, low_freq_factor, high_freq_factor) = (
                    num("factor")?,
                    num("low_freq_factor")?,
                    num("high_freq_factor")?,
                );
                let original = p
                    .get("original_max_position_embeddings")
                    .and_then(|v| as_usize(v, || ()).ok())
                    .ok_or_else(|| {
                        self.err(
                            &sub("original_max_position_embeddings"),
                            "missing or not an integer (required by rope_type \"llama3\")",
                        )
                    })?;
                let scaling = RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings: original,
                };
                if let RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    ..
                } = scaling
                    && (factor <= 0.0
                        || high_freq_factor <= low_freq_factor
                        || low_freq_factor <= 0.0)
                {
                    return Err(self.err(
                        &sub("factor"),
                        "llama3 scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0",
                    ));
                }
                Ok((rope_theta, scaling))
            }
            other => Err(self.err(
                &sub(type_key),
                format!(
                    "unsupported rope type {other:?}: supported are \"default\" and \"llama3\""
                ),
            )),
        }
    }
}

fn as_usize<E>(v: &Value, err: impl FnOnce() -> E) -> std::result::Result<usize, E> {
    if let Some(n) = v.as_u64() {
        return usize::try_from(n).map_err(|_| err());
    }
    // Some writers store integers as floats (`8192.0`).
    match v.as_f64() {
        Some(x) if x >= 0.0 && x.fract() == 0.0 && x < 9.0e15 => Ok(x as usize),
        _ => Err(err()),
    }
}

fn as_u32(v: &Value) -> Option<u32> {
    as_usize(v, || ()).ok().and_then(|n| u32::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `meta-llama/Llama-3.2-1B-Instruct/config.json` as published on the hub (transformers 4.x style).
    const LLAMA_3_2_1B: &str = include_str!("../../../fixtures/configs/llama-3.2-1b-instruct.json");
    /// The same model as transformers 5 writes it (`rope_parameters`, `dtype`).
    const LLAMA_3_2_1B_V5: &str =
        include_str!("../../../fixtures/configs/llama-3.2-1b-instruct.v5.json");

    #[test]
    fn hub_style_llama_3_2_1b() {
        let c = LlamaConfig::from_json_str(LLAMA_3_2_1B).unwrap();
        assert_eq!(c.vocab_size, 128_256);
        assert_eq!(c.hidden_size, 2048);
        assert_eq!(c.intermediate_size, 8192);
        assert_eq!(c.num_hidden_layers, 16);
        assert_eq!(c.num_attention_heads, 32);
        assert_eq!(c.num_key_value_heads, 8);
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert_eq!(c.rope_theta, 500_000.0);
        assert_eq!(
            c.rope_scaling,
            RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192
            }
        );
        assert_eq!(c.max_position_embeddings, 131_072);
        assert!(c.tie_word_embeddings);
        assert_eq!(c.bos_token_ids, vec![128_000]);
        assert_eq!(c.eos_token_ids, vec![128_001, 128_008, 128_009]);
        assert_eq!(c.torch_dtype, Some(StoredDType::BF16));
        // 1.24 B parameters, as published for Llama 3.2 1B.
        assert_eq!(c.num_parameters(), 1_235_814_400);
    }

    #[test]
    fn transformers_v5_style_reads_the_same() {
        let hub = LlamaConfig::from_json_str(LLAMA_3_2_1B).unwrap();
        let v5 = LlamaConfig::from_json_str(LLAMA_3_2_1B_V5).unwrap();
        assert_eq!(
            (
                hub.rope_theta,
                hub.rope_scaling,
                hub.torch_dtype,
                hub.eos_token_ids.clone()
            ),
            (
                v5.rope_theta,
                v5.rope_scaling,
                v5.torch_dtype,
                v5.eos_token_ids.clone()
            )
        );
        assert_eq!(
            LlamaConfig {
                raw: Map::new(),
                ..hub
            },
            LlamaConfig {
                raw: Map::new(),
                ..v5
            }
        );
    }

    #[test]
    fn round_trip_keeps_style_and_unknown_fields() {
        for text in [LLAMA_3_2_1B, LLAMA_3_2_1B_V5] {
            let c = LlamaConfig::from_json_str(text).unwrap();
            let json = c.to_json();
            let back = LlamaConfig::from_json_str(&json.to_string()).unwrap();
            assert_eq!(
                c,
                LlamaConfig {
                    raw: c.raw.clone(),
                    ..back
                }
            );
            let original: Value = serde_json::from_str(text).unwrap();
            for key in [
                "initializer_range",
                "pretraining_tp",
                "rope_parameters",
                "rope_scaling",
            ] {
                assert_eq!(
                    original.get(key).is_some(),
                    json.get(key).is_some(),
                    "{key}"
                );
            }
        }
    }

    #[test]
    fn defaults_when_fields_absent() {
        let c = LlamaConfig::from_json_str(
            r#"{"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                "num_hidden_layers": 32, "num_attention_heads": 32, "eos_token_id": 2}"#,
        )
        .unwrap();
        assert_eq!(c.num_key_value_heads, 32);
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.rope_theta, 10_000.0);
        assert_eq!(c.rope_scaling, RopeScaling::Default);
        assert_eq!(c.rms_norm_eps, 1e-6);
        assert_eq!(c.eos_token_ids, vec![2]);
        assert!(c.bos_token_ids.is_empty());
        assert!(!c.tie_word_embeddings);
    }

    #[test]
    fn qwen_families_read_their_own_fields() {
        let base = r#""vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2"#;
        // Qwen2: q/k/v biases whatever `attention_bias` says (its config has none), no o bias.
        let c = LlamaConfig::from_json_str(&format!(
            r#"{{{base}, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                 "use_sliding_window": false, "sliding_window": 4096, "max_window_layers": 21}}"#
        ))
        .unwrap();
        assert_eq!(c.family, ModelFamily::Qwen2);
        assert_eq!(c.attention_biases(), [true, true, true, false]);
        assert!(!c.qk_norm());
        assert_eq!(c.max_position_embeddings, 32_768);
        let json = c.to_json();
        assert_eq!(json["model_type"], "qwen2");
        assert!(json.get("attention_bias").is_none() && json.get("mlp_bias").is_none());
        assert_eq!(json["use_sliding_window"], false);
        // Qwen3: per-head q/k norms; `attention_bias` for all four projections.
        let c = LlamaConfig::from_json_str(&format!(
            r#"{{{base}, "model_type": "qwen3", "head_dim": 16, "attention_bias": true}}"#
        ))
        .unwrap();
        assert_eq!(
            (c.family, c.head_dim, c.attention_biases(), c.qk_norm()),
            (ModelFamily::Qwen3, 16, [true; 4], true)
        );
        assert_eq!(c.to_json()["architectures"][0], "Qwen3ForCausalLM");
        // Parameters: one layer's biases and norms on top of the same shapes.
        let plain = LlamaConfig::from_json_str(&format!(r#"{{{base}, "head_dim": 16}}"#)).unwrap();
        assert_eq!(
            c.num_parameters() - plain.num_parameters(),
            (2 * 16 + 2 * 2 * 16 + 8) + 2 * 16
        );
    }

    fn err_of(text: &str) -> String {
        LlamaConfig::from_json_str(text).unwrap_err().to_string()
    }

    #[test]
    fn clear_errors_name_the_field() {
        let base = r#""vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2"#;
        let e = err_of(&format!(
            r#"{{{base}, "architectures": ["MistralForCausalLM"]}}"#
        ));
        assert!(
            e.contains("`architectures`") && e.contains("MistralForCausalLM"),
            "{e}"
        );
        let e = err_of(&format!(r#"{{{base}, "model_type": "gemma2"}}"#));
        assert!(
            e.contains("`model_type`")
                && e.contains("gemma2")
                && e.contains(r#"supported are "llama", "qwen2", "qwen3""#),
            "{e}"
        );
        let e = err_of(&format!(
            r#"{{{base}, "model_type": "qwen2", "architectures": ["LlamaForCausalLM"]}}"#
        ));
        assert!(e.contains("`architectures`") && e.contains("qwen2"), "{e}");
        let e = err_of(&format!(
            r#"{{{base}, "model_type": "qwen2", "use_sliding_window": true}}"#
        ));
        assert!(e.contains("`use_sliding_window`"), "{e}");
        let e = err_of(&format!(
            r#"{{{base}, "model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}}"#
        ));
        assert!(e.contains("`layer_types[1]`"), "{e}");
        let e = err_of(&format!(
            r#"{{{base}, "rope_scaling": {{"rope_type": "yarn", "factor": 4.0}}}}"#
        ));
        assert!(
            e.contains("`rope_scaling.rope_type`") && e.contains("yarn"),
            "{e}"
        );
        let e = err_of(&format!(
            r#"{{{base}, "rope_parameters": {{"rope_type": "dynamic", "rope_theta": 1.0}}}}"#
        ));
        assert!(
            e.contains("`rope_parameters.rope_type`") && e.contains("dynamic"),
            "{e}"
        );
        let e = err_of(&format!(
            r#"{{{base}, "rope_scaling": {{"type": "linear", "factor": 4.0}}}}"#
        ));
        assert!(
            e.contains("`rope_scaling.type`") && e.contains("linear"),
            "{e}"
        );
        let e = err_of(&format!(
            r#"{{{base}, "rope_scaling": {{"rope_type": "llama3", "factor": 8.0}}}}"#
        ));
        assert!(e.contains("rope_scaling.low_freq_factor"), "{e}");
        let e = err_of(
            r#"{"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}"#,
        );
        assert!(e.contains("`vocab_size`") && e.contains("missing"), "{e}");
        let e = err_of(&format!(r#"{{{base}, "num_key_value_heads": 3}}"#));
        assert!(e.contains("`num_key_value_heads`"), "{e}");
        let e = err_of(&format!(r#"{{{base}, "eos_token_id": "x"}}"#));
        assert!(e.contains("`eos_token_id`"), "{e}");
        let e = err_of(&format!(r#"{{{base}, "torch_dtype": "int8"}}"#));
        assert!(e.contains("`torch_dtype`") && e.contains("int8"), "{e}");
        let e = err_of(&format!(r#"{{{base}, "hidden_act": "gelu"}}"#));
        assert!(e.contains("`hidden_act`"), "{e}");
        let e = err_of("[1, 2]");
        assert!(e.contains("JSON object"), "{e}");
        let e = err_of("{\"vocab_size\": 8,");
        assert!(e.contains("invalid JSON"), "{e}");
    }

    #[test]
    fn bench_preset_has_155m_parameters() {
        let c = LlamaConfig::bench_155m();
        assert_eq!(c.head_dim, 64);
        let n = c.num_parameters();
        assert!((150_000_000..160_000_000).contains(&n), "{n}");
    }
}

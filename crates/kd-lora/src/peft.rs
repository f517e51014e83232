//! The PEFT file format: `adapter_config.json` with PEFT's field names and
//! `adapter_model.safetensors` with PEFT's keys
//! (`base_model.model.<module path>.lora_A.weight` `[r, in]`, `.lora_B.weight` `[out, r]`), so
//! that `PeftModel.from_pretrained` loads what we write and we load what PEFT writes.

use std::collections::BTreeMap;
use std::path::Path;

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use serde_json::{Value, json};

use crate::config::{LoraConfig, TargetModules};
use crate::error::{LoraError, Result};

/// File name of the adapter configuration.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// File name of the adapter weights.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
const PREFIX: &str = "base_model.model.";

/// One module's adapter weights in PEFT layout.
#[derive(Debug, Clone, PartialEq)]
pub struct PeftWeights {
    /// `lora_A.weight`, `[r, in]`, row-major.
    pub a: Vec<f32>,
    /// `lora_B.weight`, `[out, r]`, row-major.
    pub b: Vec<f32>,
    /// Rank.
    pub r: usize,
    /// Input width.
    pub d_in: usize,
    /// Output width.
    pub d_out: usize,
}

/// A PEFT adapter as read from disk.
#[derive(Debug, Clone, PartialEq)]
pub struct PeftAdapter {
    /// The LoRA configuration (`r`, `lora_alpha`, `lora_dropout`, `target_modules`,
    /// `use_rslora`).
    pub config: LoraConfig,
    /// `base_model_name_or_path`.
    pub base_model: Option<String>,
    /// Module path (`model.layers.0.self_attn.q_proj`) → weights.
    pub modules: BTreeMap<String, PeftWeights>,
}

/// The `adapter_config.json` PEFT writes for a causal-LM LoRA adapter.
pub fn adapter_config_json(config: &LoraConfig, base_model: &str, inference_mode: bool) -> Value {
    let targets = match &config.target_modules {
        TargetModules::Names(n) => json!(n),
        TargetModules::Regex(r) => json!(r),
    };
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": targets,
        "bias": "none",
        "use_rslora": config.use_rslora,
        "fan_in_fan_out": false,
        "inference_mode": inference_mode,
        "init_lora_weights": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": false,
        "revision": null,
    })
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    kd_kernels::write_atomic(path, bytes).map_err(|e| LoraError::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

/// One tensor as `safetensors::serialize` takes it: its element type, its shape and its
/// values' little-endian bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct RawTensor {
    /// The element type.
    pub dtype: Dtype,
    /// The shape.
    pub shape: Vec<usize>,
    /// The values, little-endian, row-major.
    pub bytes: Vec<u8>,
}

impl safetensors::View for &RawTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Writes an adapter in PEFT layout into `dir` (each file atomically).
pub fn save_peft(
    dir: &Path,
    config: &LoraConfig,
    base_model: &str,
    modules: &BTreeMap<String, PeftWeights>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| LoraError::Io {
        path: dir.to_path_buf(),
        source: e,
    })?;
    let f32s = |shape: Vec<usize>, v: &[f32]| RawTensor {
        dtype: Dtype::F32,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    };
    let mut views: Vec<(String, RawTensor)> = Vec::new();
    for (path, w) in modules {
        views.push((
            format!("{PREFIX}{path}.lora_A.weight"),
            f32s(vec![w.r, w.d_in], &w.a),
        ));
        views.push((
            format!("{PREFIX}{path}.lora_B.weight"),
            f32s(vec![w.d_out, w.r], &w.b),
        ));
    }
    let metadata = Some(std::collections::HashMap::from([(
        "format".to_string(),
        "pt".to_string(),
    )]));
    let weights_path = dir.join(ADAPTER_WEIGHTS);
    let data = safetensors::serialize(views.iter().map(|(n, v)| (n.as_str(), v)), metadata)
        .map_err(|e| LoraError::Format {
            path: weights_path.clone(),
            message: e.to_string(),
        })?;
    write_atomic(&weights_path, &data)?;
    let cfg = serde_json::to_string_pretty(&adapter_config_json(config, base_model, false))
        .expect("JSON serialises");
    write_atomic(&dir.join(ADAPTER_CONFIG), cfg.as_bytes())
}

/// Reads a PEFT LoRA adapter directory (written by PEFT or by [`save_peft`]).
pub fn load_peft(dir: &Path) -> Result<PeftAdapter> {
    let (config, base_model) = read_adapter_config(&dir.join(ADAPTER_CONFIG))?;
    let modules = read_adapter_weights(&dir.join(ADAPTER_WEIGHTS), config.r)?;
    Ok(PeftAdapter {
        config,
        base_model,
        modules,
    })
}

/// `adapter_config.json`: the LoRA configuration and the base model's name; anything PEFT
/// can write that this crate does not apply (DoRA, transposed adapters, biases, per-module
/// ranks) is an error naming the field.
fn read_adapter_config(cfg_path: &Path) -> Result<(LoraConfig, Option<String>)> {
    let text = std::fs::read_to_string(cfg_path).map_err(|e| LoraError::Io {
        path: cfg_path.to_path_buf(),
        source: e,
    })?;
    let v: Value = serde_json::from_str(&text).map_err(|e| LoraError::Format {
        path: cfg_path.to_path_buf(),
        message: format!("invalid JSON: {e}"),
    })?;
    let bad = |field: &str, msg: &str| LoraError::Format {
        path: cfg_path.to_path_buf(),
        message: format!("field `{field}`: {msg}"),
    };
    match v.get("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        other => return Err(bad("peft_type", &format!("{other:?} is not \"LORA\""))),
    }
    if v.get("use_dora").and_then(Value::as_bool) == Some(true) {
        return Err(bad("use_dora", "DoRA adapters are not supported"));
    }
    if v.get("fan_in_fan_out").and_then(Value::as_bool) == Some(true) {
        return Err(bad(
            "fan_in_fan_out",
            "transposed (Conv1D-style) adapters are not supported",
        ));
    }
    if let Some(b) = v.get("bias").and_then(Value::as_str)
        && b != "none"
    {
        return Err(bad("bias", &format!("{b:?}: only \"none\" is supported")));
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if v.get(key)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            return Err(bad(key, "per-module ranks/alphas are not supported"));
        }
    }
    let r = v
        .get("r")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("r", "missing or not an integer"))? as usize;
    let alpha = v
        .get("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or_else(|| bad("lora_alpha", "missing or not a number"))?;
    let target_modules = match v.get("target_modules") {
        Some(Value::String(s)) => TargetModules::Regex(s.clone()),
        Some(Value::Array(a)) => TargetModules::Names(
            a.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect(),
        ),
        _ => {
            return Err(bad(
                "target_modules",
                "missing (a list of names or a regex)",
            ));
        }
    };
    let config = LoraConfig {
        r,
        alpha,
        dropout: v.get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0),
        target_modules,
        use_rslora: v
            .get("use_rslora")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    };
    let base_model = v
        .get("base_model_name_or_path")
        .and_then(Value::as_str)
        .map(String::from);
    Ok((config, base_model))
}

/// A tensor's shape and values, read as f32.
type Part = (Vec<usize>, Vec<f32>);

/// `adapter_model.safetensors`: every module's rank-`r` A and B, paired by module path.
fn read_adapter_weights(w_path: &Path, r: usize) -> Result<BTreeMap<String, PeftWeights>> {
    let format = |message: String| LoraError::Format {
        path: w_path.to_path_buf(),
        message,
    };
    let bytes = std::fs::read(w_path).map_err(|e| LoraError::Io {
        path: w_path.to_path_buf(),
        source: e,
    })?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| format(format!("invalid safetensors file: {e}")))?;
    let mut a_parts: BTreeMap<String, Part> = BTreeMap::new();
    let mut b_parts: BTreeMap<String, Part> = BTreeMap::new();
    for (name, view) in st.tensors() {
        let values = f32_values(&view)
            .ok_or_else(|| format(format!("tensor `{name}` has dtype {:?}", view.dtype())))?;
        let stripped = name.strip_prefix(PREFIX).unwrap_or(&name);
        // PEFT names adapters: `.lora_A.weight` (saved) or `.lora_A.default.weight`.
        let (module, parts) = if let Some(m) = stripped
            .strip_suffix(".lora_A.weight")
            .or_else(|| stripped.strip_suffix(".lora_A.default.weight"))
        {
            (m, &mut a_parts)
        } else if let Some(m) = stripped
            .strip_suffix(".lora_B.weight")
            .or_else(|| stripped.strip_suffix(".lora_B.default.weight"))
        {
            (m, &mut b_parts)
        } else {
            return Err(format(format!(
                "unexpected tensor `{name}`: only LoRA A/B weights are supported (no biases, no modules_to_save)"
            )));
        };
        parts.insert(module.to_string(), (view.shape().to_vec(), values));
    }
    let mut modules = BTreeMap::new();
    for (module, (a_shape, a)) in a_parts {
        let (b_shape, b) = b_parts
            .remove(&module)
            .ok_or_else(|| format(format!("`{module}` has lora_A but no lora_B")))?;
        if a_shape.len() != 2 || b_shape.len() != 2 || a_shape[0] != r || b_shape[1] != r {
            return Err(LoraError::Shape(format!(
                "`{module}`: lora_A {a_shape:?} and lora_B {b_shape:?} do not form a rank-{r} adapter"
            )));
        }
        modules.insert(
            module,
            PeftWeights {
                a,
                b,
                r,
                d_in: a_shape[1],
                d_out: b_shape[0],
            },
        );
    }
    if let Some(module) = b_parts.keys().next() {
        return Err(format(format!("`{module}` has lora_B but no lora_A")));
    }
    Ok(modules)
}

/// A safetensors tensor's values as f32 (from f32, bf16 or f16); `None` for other dtypes.
fn f32_values(view: &safetensors::tensor::TensorView<'_>) -> Option<Vec<f32>> {
    let data = view.data();
    Some(match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

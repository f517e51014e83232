//! Typed access to a `config.json` object's fields, with errors that name the field: the
//! reading half of [`LlamaConfig`](super::LlamaConfig).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::{RopeScaling, StoredDType};
use crate::error::{ModelError, Result};
use crate::family::ModelFamily;

/// Typed access to the fields of a config object, with errors naming the field.
pub(super) struct Fields<'a> {
    pub(super) map: &'a Map<String, Value>,
    pub(super) path: &'a Path,
}

impl Fields<'_> {
    pub(super) fn err(&self, field: &str, message: impl Into<String>) -> ModelError {
        ModelError::config(PathBuf::from(self.path), field, message)
    }

    pub(super) fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    pub(super) fn usize_req(&self, key: &str) -> Result<usize> {
        self.usize_opt(key)?
            .ok_or_else(|| self.err(key, "missing (a positive integer is required)"))
    }

    pub(super) fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                as_usize(v, || {
                    self.err(key, format!("expected a non-negative integer, found {v}"))
                })
            })
            .transpose()
    }

    pub(super) fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| self.err(key, format!("expected a number, found {v}")))
            })
            .transpose()
    }

    pub(super) fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.err(key, format!("expected true or false, found {v}")))
            })
            .transpose()
    }

    pub(super) fn str_opt(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.err(key, format!("expected a string, found {v}")))
            })
            .transpose()
    }

    /// A token id given as an integer, a list of integers, or null.
    pub(super) fn ids(&self, key: &str) -> Result<Vec<u32>> {
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
    pub(super) fn family(&self) -> Result<ModelFamily> {
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
    pub(super) fn check_attention_layout(&self, family: ModelFamily) -> Result<()> {
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

    pub(super) fn dtype(&self) -> Result<Option<StoredDType>> {
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
    pub(super) fn rope(&self) -> Result<(f64, RopeScaling)> {
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

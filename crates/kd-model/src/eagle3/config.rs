//! The `config.json` of an EAGLE-3 draft.

use std::path::Path;

use serde_json::Value;

use super::EAGLE3_ARCHITECTURE;
use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};

/// An EAGLE-3 draft's configuration: a one-layer Llama configuration plus the draft
/// vocabulary's size and the target's width.
#[derive(Debug, Clone, PartialEq)]
pub struct Eagle3Config {
    /// The decoder layer's shape (`num_hidden_layers` 1), RoPE and norms; `vocab_size` is the
    /// target's vocabulary.
    pub llama: LlamaConfig,
    /// Tokens the draft predicts (`draft_vocab_size`).
    pub draft_vocab_size: usize,
    /// Width of each target hidden state `fc` reads (`target_hidden_size`, default
    /// `hidden_size`).
    pub target_hidden_size: usize,
}

impl Eagle3Config {
    /// Reads a `config.json` as SpecForge writes it.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::parse(&text, path)
    }

    /// Parses the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self> {
        Self::parse(text, Path::new("<memory>"))
    }

    /// The draft SpecForge builds for a target: the target's width, heads, MLP width, RoPE and
    /// norm, one layer, and a draft vocabulary of `draft_vocab_size` tokens.
    pub fn for_target(target: &LlamaConfig, draft_vocab_size: usize) -> Result<Self> {
        let mut llama = target.clone().into_llama_layout();
        llama.num_hidden_layers = 1;
        llama.tie_word_embeddings = false;
        llama.attention_bias = false;
        llama.mlp_bias = false;
        if draft_vocab_size == 0 || draft_vocab_size > llama.vocab_size {
            return Err(ModelError::Input(format!(
                "draft vocabulary of {draft_vocab_size} tokens: expected 1 to the target's \
                 vocab_size {}",
                llama.vocab_size
            )));
        }
        Ok(Self {
            target_hidden_size: target.hidden_size,
            draft_vocab_size,
            llama,
        })
    }

    /// The `config.json` SpecForge writes: a Llama configuration with the EAGLE-3
    /// architecture and `draft_vocab_size` (and `target_hidden_size` when it differs).
    pub fn to_json(&self) -> Value {
        let mut value = self.llama.to_json();
        if let Some(map) = value.as_object_mut() {
            map.insert(
                "architectures".into(),
                Value::Array(vec![Value::String(EAGLE3_ARCHITECTURE.into())]),
            );
            map.insert("draft_vocab_size".into(), self.draft_vocab_size.into());
            if self.target_hidden_size != self.llama.hidden_size {
                map.insert("target_hidden_size".into(), self.target_hidden_size.into());
            }
        }
        value
    }

    fn parse(text: &str, path: &Path) -> Result<Self> {
        let mut value: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let Some(map) = value.as_object_mut() else {
            return Err(ModelError::config(path, "<root>", "expected a JSON object"));
        };
        let is_eagle3 = map
            .get("architectures")
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|n| n.as_str() == Some(EAGLE3_ARCHITECTURE)));
        if !is_eagle3 {
            return Err(ModelError::config(
                path,
                "architectures",
                format!("expected [\"{EAGLE3_ARCHITECTURE}\"]: this is not an EAGLE-3 draft"),
            ));
        }
        let size = |key: &str| -> Result<Option<usize>> {
            match map.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                    ModelError::config(path, key, "expected a non-negative integer")
                }),
            }
        };
        let draft_vocab_size = size("draft_vocab_size")?.ok_or_else(|| {
            ModelError::config(
                path,
                "draft_vocab_size",
                "missing: an EAGLE-3 draft names it",
            )
        })?;
        let target_hidden_size = size("target_hidden_size")?;
        // The rest is a Llama configuration: read it as one, with the same checks.
        map.insert(
            "architectures".into(),
            Value::Array(vec![Value::String("LlamaForCausalLM".into())]),
        );
        for key in ["draft_vocab_size", "target_hidden_size"] {
            map.remove(key);
        }
        let llama = LlamaConfig::from_json_str(&value.to_string()).map_err(|e| match e {
            ModelError::Config { field, message, .. } => ModelError::Config {
                path: path.to_path_buf(),
                field,
                message,
            },
            other => other,
        })?;
        if llama.num_hidden_layers != 1 {
            return Err(ModelError::config(
                path,
                "num_hidden_layers",
                format!(
                    "{}: an EAGLE-3 draft has one layer",
                    llama.num_hidden_layers
                ),
            ));
        }
        if draft_vocab_size == 0 || draft_vocab_size > llama.vocab_size {
            return Err(ModelError::config(
                path,
                "draft_vocab_size",
                format!(
                    "{draft_vocab_size}: expected 1 to the target's vocab_size {}",
                    llama.vocab_size
                ),
            ));
        }
        Ok(Self {
            target_hidden_size: target_hidden_size.unwrap_or(llama.hidden_size),
            draft_vocab_size,
            llama,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_names_what_is_wrong() {
        let base = r#"{"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 1, "vocab_size": 96, "rms_norm_eps": 1e-5,
            "draft_vocab_size": 32}"#;
        let c = Eagle3Config::from_json_str(base).unwrap();
        assert_eq!((c.draft_vocab_size, c.target_hidden_size), (32, 64));
        let err = Eagle3Config::from_json_str(&base.replace("Eagle3", ""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("architectures"), "{err}");
        let err =
            Eagle3Config::from_json_str(&base.replace("\"draft_vocab_size\": 32", "\"x\": 1"))
                .unwrap_err()
                .to_string();
        assert!(err.contains("draft_vocab_size"), "{err}");
        let err = Eagle3Config::from_json_str(&base.replace("32}", "300}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("draft_vocab_size"), "{err}");
    }
}

//! The `config.json` of an EAGLE-3 draft.

use std::path::Path;

use serde_json::Value;

use super::EAGLE3_ARCHITECTURE;
use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};
use crate::family::ModelFamily;

/// An EAGLE-3 draft's configuration: a one-layer Llama configuration plus the draft
/// vocabulary's size and the target's width.
#[derive(Debug, Clone, PartialEq)]
pub struct Eagle3Config {
    /// The decoder layer's shape (`num_hidden_layers` 1), RoPE and norms; `vocab_size` is the
    /// target's vocabulary. Its `family` is Llama (SpecForge's layer, and every draft this
    /// project trains) or Qwen3 (speculators' `model_type: "qwen3"` layer, whose query and key
    /// heads each go through an RMSNorm before RoPE: [`LlamaConfig::qk_norm`]).
    pub llama: LlamaConfig,
    /// Tokens the draft predicts (`draft_vocab_size`).
    pub draft_vocab_size: usize,
    /// Width of each target hidden state `fc` reads (`target_hidden_size`, default
    /// `hidden_size`).
    pub target_hidden_size: usize,
    /// The target's hidden states `fc` reads, low / mid / high, in Hugging Face's
    /// `output_hidden_states` indexing: index i is the input of decoder layer i (1 ≤ i < L).
    /// Written twice, as each server reads it: `eagle_aux_hidden_state_layer_ids` at the top
    /// level holds these indices (vLLM and llama.cpp's converter capture the input of layer i),
    /// `eagle_config.eagle_aux_hidden_state_layer_ids` holds i − 1 (SpecForge and SGLang
    /// capture the output of the layer they name). `None` when the file says neither; servers
    /// then take their default, the same layers `[2, L/2, L − 3]` here.
    pub aux_layers: Option<[usize; 3]>,
    /// `norm_before_residual`: the decoder layer's residual is the normalised hidden input
    /// (`hidden_norm(hidden)`) instead of the raw one. SpecForge and SGLang have only the raw
    /// residual (false); vLLM's `speculators` drafts (Red Hat's among them) and llama.cpp
    /// (`eagle3.norm_before_residual`) take either. Written to `config.json` only when true.
    pub norm_before_residual: bool,
    /// `norm_before_fc`: an RMSNorm (weight `input_norm.weight`, `3·target_hidden_size`)
    /// over the concatenated target features before `fc`. SpecForge and SGLang have none
    /// (false); `speculators` drafts (nvidia's gpt-oss drafts among them) and llama.cpp
    /// (`eagle3.norm_before_fc`) take either. Written to `config.json` only when true.
    pub norm_before_fc: bool,
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
            aux_layers: None,
            norm_before_residual: false,
            norm_before_fc: false,
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
            if self.norm_before_residual {
                map.insert("norm_before_residual".into(), true.into());
            }
            if self.norm_before_fc {
                map.insert("norm_before_fc".into(), true.into());
            }
            if let Some(layers) = self.aux_layers {
                map.insert("eagle_aux_hidden_state_layer_ids".into(), layers.into());
                // SpecForge's and SGLang's ids name the layer whose output is read.
                let ids: Vec<usize> = layers.iter().map(|l| l.saturating_sub(1)).collect();
                map.insert(
                    "eagle_config".into(),
                    serde_json::json!({ "eagle_aux_hidden_state_layer_ids": ids }),
                );
            }
        }
        value
    }

    fn parse(text: &str, path: &Path) -> Result<Self> {
        let mut value: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        // vLLM's `speculators` layout: read as the SpecForge layout it describes.
        if let Some(specforge) = super::export::from_speculators(&value, path)? {
            value = specforge;
        }
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
        let aux_layers = aux_layers(map, path)?;
        let flag = |key: &str| -> Result<bool> {
            match map.get(key) {
                None | Some(Value::Null) => Ok(false),
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| ModelError::config(path, key, "expected true or false")),
            }
        };
        let norm_before_residual = flag("norm_before_residual")?;
        let norm_before_fc = flag("norm_before_fc")?;
        // The other normalisations `speculators` knows (Eagle 3.1's): no counterpart here.
        for key in ["fc_norm", "norm_output"] {
            if flag(key)? {
                return Err(ModelError::config(
                    path,
                    key,
                    "true: this draft normalises where this project's EAGLE-3 layer does not \
                     (it reads norm_before_residual and norm_before_fc); only drafts with it \
                     false are read",
                ));
            }
        }
        // The rest is the decoder layer's configuration: read it as a model's, with the same
        // checks. Its family comes from `model_type` alone (`architectures` names the draft):
        // Llama's layer, SpecForge's and speculators' `llama`, unless it says otherwise.
        map.remove("architectures");
        map.entry("model_type").or_insert_with(|| "llama".into());
        for key in [
            "draft_vocab_size",
            "target_hidden_size",
            "eagle_config",
            "eagle_aux_hidden_state_layer_ids",
            "norm_before_residual",
            "norm_before_fc",
            "fc_norm",
            "norm_output",
        ] {
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
        match llama.family {
            ModelFamily::Llama | ModelFamily::Qwen3 => {}
            other => {
                return Err(ModelError::config(
                    path,
                    "model_type",
                    format!(
                        "{:?}: an EAGLE-3 draft's decoder layer is Llama's (SpecForge, \
                         speculators' \"llama\") or Qwen3's (speculators' \"qwen3\")",
                        other.model_type()
                    ),
                ));
            }
        }
        // speculators gives q/k/v (and Llama's MLP) biases when these are set; SpecForge's
        // layer has none, and neither does this one.
        for (key, set) in [
            ("attention_bias", llama.attention_bias),
            ("mlp_bias", llama.mlp_bias),
        ] {
            if set {
                return Err(ModelError::config(
                    path,
                    key,
                    "true: EAGLE-3 drafts here have no projection biases (SpecForge's have \
                     none); a draft trained with them cannot be read",
                ));
            }
        }
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
            aux_layers,
            norm_before_residual,
            norm_before_fc,
            llama,
        })
    }
}

/// The target layers whose hidden states an EAGLE-3 draft reads, as Hugging Face indices:
/// vLLM's top-level `eagle_aux_hidden_state_layer_ids` (the input of layer i) or SpecForge's
/// nested `eagle_config` key (the output of layer i, Hugging Face's i + 1); an error when both
/// are given and disagree.
fn aux_layers(map: &serde_json::Map<String, Value>, path: &Path) -> Result<Option<[usize; 3]>> {
    let three = |v: &Value, key: &str| -> Result<[usize; 3]> {
        let ids: Option<Vec<usize>> = v
            .as_array()
            .and_then(|a| a.iter().map(|v| v.as_u64().map(|n| n as usize)).collect());
        match ids.as_deref() {
            Some(&[a, b, c]) => Ok([a, b, c]),
            _ => Err(ModelError::config(
                path,
                key,
                "expected three layer indices (low, mid, high): `fc` reads three target \
                 hidden states",
            )),
        }
    };
    // vLLM's key: Hugging Face indices (the input of layer i).
    let top = match map.get("eagle_aux_hidden_state_layer_ids") {
        None | Some(Value::Null) => None,
        Some(v) => Some(three(v, "eagle_aux_hidden_state_layer_ids")?),
    };
    // SpecForge's and SGLang's: the output of layer i, Hugging Face's index i + 1.
    let nested_key = "eagle_config.eagle_aux_hidden_state_layer_ids";
    let nested = match map
        .get("eagle_config")
        .and_then(|c| c.get("eagle_aux_hidden_state_layer_ids"))
    {
        None | Some(Value::Null) => None,
        Some(v) => Some(three(v, nested_key)?.map(|i| i + 1)),
    };
    match (top, nested) {
        (Some(a), Some(b)) if a != b => Err(ModelError::config(
            path,
            nested_key,
            format!(
                "{:?} names the outputs of layers {:?}, but eagle_aux_hidden_state_layer_ids \
                 names the inputs of layers {a:?}: they disagree (SpecForge's ids are vLLM's \
                 minus one)",
                b.map(|i| i - 1),
                b.map(|i| i - 1)
            ),
        )),
        (a, b) => Ok(a.or(b)),
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
        // SpecForge's / SGLang's ids name layer outputs: [1, 4, 7] are Hugging Face's
        // hidden_states [2, 5, 8], which vLLM's top-level key names directly.
        let nested = base.replace(
            "32}",
            r#"32, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 7]}}"#,
        );
        let c = Eagle3Config::from_json_str(&nested).unwrap();
        assert_eq!(c.aux_layers, Some([2, 5, 8]));
        let top = base.replace(
            "32}",
            r#"32, "eagle_aux_hidden_state_layer_ids": [2, 5, 8]}"#,
        );
        assert_eq!(
            Eagle3Config::from_json_str(&top).unwrap().aux_layers,
            Some([2, 5, 8])
        );
        let json = c.to_json();
        assert_eq!(
            json["eagle_aux_hidden_state_layer_ids"],
            serde_json::json!([2, 5, 8])
        );
        assert_eq!(
            json["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
            serde_json::json!([1, 4, 7])
        );
        let again = Eagle3Config::from_json_str(&json.to_string()).unwrap();
        assert_eq!(again.to_json(), json);
        assert_eq!(again.aux_layers, c.aux_layers);
        let both = nested.replace(
            "\"eagle_config\"",
            "\"eagle_aux_hidden_state_layer_ids\": [1, 4, 7], \"eagle_config\"",
        );
        let err = Eagle3Config::from_json_str(&both).unwrap_err().to_string();
        assert!(err.contains("disagree"), "{err}");
        let err = Eagle3Config::from_json_str(&nested.replace("[1, 4, 7]", "[1, 4]"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("eagle_aux_hidden_state_layer_ids"), "{err}");

        // `norm_before_residual`: false unless stated, kept through `to_json`, a bool or an
        // error naming it.
        assert!(
            !Eagle3Config::from_json_str(base)
                .unwrap()
                .norm_before_residual
        );
        assert!(base_json_lacks(base, "norm_before_residual"));
        let nbr = base.replace("32}", r#"32, "norm_before_residual": true}"#);
        let c = Eagle3Config::from_json_str(&nbr).unwrap();
        assert!(c.norm_before_residual);
        assert!(
            Eagle3Config::from_json_str(&c.to_json().to_string())
                .unwrap()
                .norm_before_residual
        );
        let err = Eagle3Config::from_json_str(&nbr.replace("true}", "\"yes\"}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("norm_before_residual"), "{err}");
    }

    /// The decoder layer's family comes from `model_type`: Llama's when unstated in SpecForge's
    /// layout, Qwen3's when unstated in speculators' (its default layer configuration class,
    /// `Qwen3Config`, as `make_speculators_golden.py` checks); Qwen2's and biases refused by
    /// name.
    #[test]
    fn the_decoder_layer_is_llama_s_or_qwen3_s() {
        let fields = r#""hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
            "vocab_size": 96, "rms_norm_eps": 1e-5, "head_dim": 16"#;
        let specforge = |extra: &str| {
            format!(
                r#"{{"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32,
                {fields}{extra}}}"#
            )
        };
        let speculators = |extra: &str| {
            format!(
                r#"{{"speculators_model_type": "eagle3", "draft_vocab_size": 32,
                "transformer_layer_config": {{{fields}{extra}}}}}"#
            )
        };
        let family = |text: &str| Eagle3Config::from_json_str(text).unwrap().llama.family;
        assert_eq!(family(&specforge("")), ModelFamily::Llama);
        assert_eq!(
            family(&specforge(r#", "model_type": "llama""#)),
            ModelFamily::Llama
        );
        assert_eq!(
            family(&specforge(r#", "model_type": "qwen3""#)),
            ModelFamily::Qwen3
        );
        assert_eq!(family(&speculators("")), ModelFamily::Qwen3);
        assert_eq!(
            family(&speculators(r#", "model_type": "llama""#)),
            ModelFamily::Llama
        );
        let c = Eagle3Config::from_json_str(&speculators("")).unwrap();
        assert!(c.llama.qk_norm());
        // Kept through a checkpoint's config.json.
        let again = Eagle3Config::from_json_str(&c.to_json().to_string()).unwrap();
        assert_eq!(again.llama.family, ModelFamily::Qwen3);
        for (extra, key) in [
            (r#", "model_type": "qwen2""#, "model_type"),
            (
                r#", "model_type": "llama", "attention_bias": true"#,
                "attention_bias",
            ),
            (
                r#", "model_type": "qwen3", "attention_bias": true"#,
                "attention_bias",
            ),
            (r#", "model_type": "llama", "mlp_bias": true"#, "mlp_bias"),
        ] {
            for text in [specforge(extra), speculators(extra)] {
                let err = Eagle3Config::from_json_str(&text).unwrap_err().to_string();
                assert!(err.contains(key), "{text}: {err}");
            }
        }
    }

    fn base_json_lacks(text: &str, key: &str) -> bool {
        let json = Eagle3Config::from_json_str(text).unwrap().to_json();
        json.get(key).is_none()
    }

    /// A `speculators` config: `norm_before_residual` and `norm_before_fc` are read; the
    /// normalisations with no counterpart here are refused by name, in either layout.
    #[test]
    fn speculators_configs_read_norm_before_residual_and_fc_and_refuse_the_rest() {
        let layer = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
            "vocab_size": 96, "rms_norm_eps": 1e-5}"#;
        let config = |extra: &str| {
            format!(
                r#"{{"speculators_model_type": "eagle3", "draft_vocab_size": 32,
                "transformer_layer_config": {layer}{extra}}}"#
            )
        };
        assert!(
            !Eagle3Config::from_json_str(&config(""))
                .unwrap()
                .norm_before_residual
        );
        let c = Eagle3Config::from_json_str(&config(r#", "norm_before_residual": true"#)).unwrap();
        assert!(c.norm_before_residual);
        let c = Eagle3Config::from_json_str(&config(r#", "norm_before_fc": true"#)).unwrap();
        assert!(c.norm_before_fc && !c.norm_before_residual);
        let again = Eagle3Config::from_json_str(&c.to_json().to_string()).unwrap();
        assert!(again.norm_before_fc);
        assert!(
            !Eagle3Config::from_json_str(&config(""))
                .unwrap()
                .norm_before_fc
        );
        for key in ["fc_norm", "norm_output"] {
            let err = Eagle3Config::from_json_str(&config(&format!(r#", "{key}": true"#)))
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{err}");
            // SpecForge's layout saying the same.
            let mut specforge = c.to_json();
            specforge[key] = true.into();
            let err = Eagle3Config::from_json_str(&specforge.to_string())
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{err}");
        }
    }
}

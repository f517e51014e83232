//! Writing a draft directory for a server: SpecForge's layout (what SGLang serves, and vLLM
//! reads too) or vLLM's `speculators` layout. Files are checked key by key first: a tensor
//! missing, of the wrong shape, or not part of an EAGLE-3 draft is an error naming it (SGLang
//! skips unknown keys silently, which serves a draft with untrained weights).

use std::path::Path;

use safetensors::Dtype;
use serde_json::{Value, json};

use super::file::WeightsFile;
use super::{Eagle3Config, WEIGHTS_FILE};
use crate::error::{ModelError, Result};

/// Where a draft directory is going.
#[derive(Debug, Clone, PartialEq)]
pub enum Eagle3Format {
    /// SpecForge's export, which SGLang serves (`--speculative-algorithm EAGLE3
    /// --speculative-draft-model-path DIR`): `midlayer.*` tensors, `LlamaForCausalLMEagle3`.
    SpecForge,
    /// vLLM's `speculators` format: `layers.0.*` tensors, `Eagle3Speculator` with a
    /// `speculators_config` naming the verifier.
    Speculators(SpeculatorsVerifier),
}

/// The verifier (target) and proposal a `speculators` config names.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculatorsVerifier {
    /// The target as a server finds it (a hub id or a path).
    pub name_or_path: String,
    /// Its architectures, e.g. `["LlamaForCausalLM"]`.
    pub architectures: Vec<String>,
    /// Tokens drafted per verification (`proposal_methods[0].speculative_tokens`).
    pub speculative_tokens: usize,
}

/// The tensors of an EAGLE-3 draft under SpecForge's names (the decoder layer's under
/// `midlayer.`), with their shapes, `d2t` and `t2d` last.
pub(super) fn expected_tensors(c: &Eagle3Config) -> Vec<(String, Vec<usize>)> {
    let l = &c.llama;
    let (d, inter) = (l.hidden_size, l.intermediate_size);
    let (q, kv) = (
        l.num_attention_heads * l.head_dim,
        l.num_key_value_heads * l.head_dim,
    );
    let m = |s: &str| format!("midlayer.{s}");
    let mut tensors = vec![("fc.weight".into(), vec![d, 3 * c.target_hidden_size])];
    if c.norm_before_fc {
        tensors.push((INPUT_NORM.into(), vec![3 * c.target_hidden_size]));
    }
    tensors.extend([
        (m("self_attn.q_proj.weight"), vec![q, 2 * d]),
        (m("self_attn.k_proj.weight"), vec![kv, 2 * d]),
        (m("self_attn.v_proj.weight"), vec![kv, 2 * d]),
        (m("self_attn.o_proj.weight"), vec![d, q]),
        (m("mlp.gate_proj.weight"), vec![inter, d]),
        (m("mlp.up_proj.weight"), vec![inter, d]),
        (m("mlp.down_proj.weight"), vec![d, inter]),
        (m("input_layernorm.weight"), vec![d]),
        (m("hidden_norm.weight"), vec![d]),
        (m("post_attention_layernorm.weight"), vec![d]),
        ("norm.weight".into(), vec![d]),
        ("lm_head.weight".into(), vec![c.draft_vocab_size, d]),
    ]);
    if l.qk_norm() {
        for name in QK_NORMS {
            tensors.push((m(name), vec![l.head_dim]));
        }
    }
    tensors.push(("d2t".into(), vec![c.draft_vocab_size]));
    tensors.push(("t2d".into(), vec![l.vocab_size]));
    tensors
}

/// The weight of the RMSNorm over the concatenated features (`norm_before_fc`), in both
/// layouts.
pub(super) const INPUT_NORM: &str = "input_norm.weight";

/// A Qwen3 layer's per-head query and key norms (under the layer's prefix).
pub(super) const QK_NORMS: [&str; 2] = ["self_attn.q_norm.weight", "self_attn.k_norm.weight"];

/// Checks that every tensor of `file` (whose layer prefix is `from`) is one of `expected`
/// (SpecForge's names) or the embedding: a tensor the draft would not read is an error naming
/// it, never skipped.
pub(super) fn check_names(
    file: &WeightsFile,
    expected: &[(String, Vec<usize>)],
    from: &str,
) -> Result<()> {
    for name in file.tensors().names() {
        let canonical = name.replacen(from, "midlayer.", 1);
        if name != "embed_tokens.weight" && !expected.iter().any(|(n, _)| *n == canonical) {
            return Err(file.error(
                name,
                format!(
                    "not a tensor of this EAGLE-3 draft (expected {})",
                    expected
                        .iter()
                        .map(|(n, _)| n.replacen("midlayer.", from, 1))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
    }
    Ok(())
}

/// The prefix of the decoder layer's tensors in a file: SpecForge's `midlayer.` or the
/// `speculators` format's `layers.0.`.
pub(super) fn layer_prefix(file: &WeightsFile) -> &'static str {
    if file.has("layers.0.self_attn.q_proj.weight") && !file.has("midlayer.self_attn.q_proj.weight")
    {
        "layers.0."
    } else {
        "midlayer."
    }
}

/// Copies the draft directory `src` (either layout) to `dst` in `format`, checking every
/// tensor against the configuration first. The embedding, when the source has one, is left
/// out: the draft reads the target's.
pub fn export_eagle3(src: &Path, dst: &Path, format: &Eagle3Format) -> Result<()> {
    let config = Eagle3Config::from_file(src.join("config.json"))?;
    let path = src.join(WEIGHTS_FILE);
    let file = WeightsFile::open(&path)?;
    let st = file.tensors();
    let from = layer_prefix(&file);
    let to = match format {
        Eagle3Format::SpecForge => "midlayer.",
        Eagle3Format::Speculators(_) => "layers.0.",
    };
    if config.norm_before_residual && *format == Eagle3Format::SpecForge {
        return Err(ModelError::config(
            src.join("config.json"),
            "norm_before_residual",
            "true: SGLang's and SpecForge's EAGLE-3 layer always adds the raw hidden state as \
             the residual and has no such option, so SGLang would serve this draft computing \
             something else; export it --to vllm or --to gguf, which take the setting",
        ));
    }
    if config.norm_before_fc && *format == Eagle3Format::SpecForge {
        return Err(ModelError::config(
            src.join("config.json"),
            "norm_before_fc",
            "true: SGLang's and SpecForge's EAGLE-3 draft feeds the target features to fc \
             without a norm and has no such option, so SGLang would skip input_norm.weight \
             and serve something else; export it --to vllm or --to gguf, which take it",
        ));
    }
    if config.llama.qk_norm() && *format == Eagle3Format::SpecForge {
        return Err(ModelError::config(
            src.join("config.json"),
            "model_type",
            "\"qwen3\": this draft's layer normalises each query and key head (q_norm, \
             k_norm), which SGLang's and SpecForge's Llama layer does not have, so SGLang would \
             skip those tensors and serve something else; export it --to vllm",
        ));
    }
    let expected = expected_tensors(&config);
    // Every tensor of the file is one of the draft's (or the embedding, dropped).
    check_names(&file, &expected, from)?;
    // Over the whole target vocabulary the maps are the identity. The speculators layout
    // leaves them out (its model registers no `d2t`/`t2d` then); SpecForge's always has them
    // (its exporter requires both), so a source without them gets the identity written.
    let whole_vocab = config.draft_vocab_size == config.llama.vocab_size;
    let identity = (whole_vocab && !(file.has("d2t") && file.has("t2d"))).then(|| {
        (
            vec![0u8; 8 * config.draft_vocab_size],
            vec![1u8; config.llama.vocab_size],
        )
    });
    let mut out: Vec<(String, Dtype, Vec<usize>, &[u8])> = Vec::with_capacity(expected.len());
    for (name, shape) in &expected {
        if whole_vocab && matches!(name.as_str(), "d2t" | "t2d") {
            if matches!(format, Eagle3Format::Speculators(_)) {
                continue;
            }
            if let Some((d2t, t2d)) = identity.as_ref().filter(|_| !file.has(name)) {
                let (dtype, data) = if name == "d2t" {
                    (Dtype::I64, d2t.as_slice())
                } else {
                    (Dtype::BOOL, t2d.as_slice())
                };
                out.push((name.clone(), dtype, shape.clone(), data));
                continue;
            }
        }
        let stored = name.replacen("midlayer.", from, 1);
        let view = st
            .tensor(&stored)
            .map_err(|_| file.error(&stored, "missing".into()))?;
        if view.shape() != shape.as_slice() {
            return Err(file.error(
                &stored,
                format!("shape {:?}, expected {shape:?}", view.shape()),
            ));
        }
        let dtype_ok = match name.as_str() {
            "d2t" => view.dtype() == Dtype::I64,
            "t2d" => view.dtype() == Dtype::BOOL,
            _ => matches!(view.dtype(), Dtype::F32 | Dtype::BF16 | Dtype::F16),
        };
        if !dtype_ok {
            return Err(file.error(&stored, format!("dtype {:?}", view.dtype())));
        }
        out.push((
            name.replacen("midlayer.", to, 1),
            view.dtype(),
            shape.clone(),
            view.data(),
        ));
    }
    // The vocabulary maps must describe one draft vocabulary.
    if file.has("d2t") {
        super::DraftVocab::from_d2t(&file.ints("d2t")?, config.llama.vocab_size)?;
    }

    std::fs::create_dir_all(dst).map_err(|e| ModelError::io(dst, e))?;
    let config_json = match format {
        Eagle3Format::SpecForge => config.to_json(),
        Eagle3Format::Speculators(v) => speculators_json(&config, v),
    };
    let text = serde_json::to_string_pretty(&config_json).expect("JSON values serialise");
    let weights = super::file::serialize_tensors(
        out.iter()
            .map(|(n, dt, shape, data)| (n.as_str(), *dt, shape.as_slice(), *data)),
        &dst.join(WEIGHTS_FILE),
    )?;
    crate::weights::write_atomic(&dst.join(WEIGHTS_FILE), &weights)?;
    crate::weights::write_atomic(&dst.join("config.json"), text.as_bytes())
}

/// The `config.json` of vLLM's `speculators` format: the decoder layer's configuration
/// (Llama's or Qwen3's) as `transformer_layer_config`, `norm_before_residual` always stated
/// (vLLM assumes true when the key is missing), the feature layers in vLLM's indexing.
fn speculators_json(c: &Eagle3Config, v: &SpeculatorsVerifier) -> Value {
    let mut layer = c.llama.to_json();
    if let Some(map) = layer.as_object_mut() {
        map.remove("architectures");
        map.insert("model_type".into(), c.llama.family.model_type().into());
    }
    let mut config = json!({
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": false,
        "norm_output": false,
        "target_hidden_size": c.target_hidden_size,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{
                "proposal_type": "greedy",
                "speculative_tokens": v.speculative_tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0
            }],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": v.name_or_path,
                "architectures": v.architectures
            }
        }
    });
    if let Some(layers) = c.aux_layers {
        config["eagle_aux_hidden_state_layer_ids"] = json!(layers);
    }
    config
}

/// Reads a `speculators` config as the SpecForge-layout JSON it describes, or `None` when
/// `value` is not one. Normalisations SpecForge's EAGLE-3 does not have are refused by name.
pub(super) fn from_speculators(value: &Value, path: &Path) -> Result<Option<Value>> {
    let Some(kind) = value.get("speculators_model_type") else {
        return Ok(None);
    };
    if kind.as_str() != Some("eagle3") {
        return Err(ModelError::config(
            path,
            "speculators_model_type",
            format!("{kind}: only eagle3 drafts are read"),
        ));
    }
    let Some(layer) = value
        .get("transformer_layer_config")
        .and_then(Value::as_object)
    else {
        return Err(ModelError::config(
            path,
            "transformer_layer_config",
            "missing: a speculators draft holds its decoder layer's configuration there",
        ));
    };
    let mut out = layer.clone();
    // speculators reads a layer configuration without `model_type` as Qwen3's (its default
    // layer configuration class).
    out.entry("model_type").or_insert_with(|| "qwen3".into());
    out.insert("architectures".into(), json!([super::EAGLE3_ARCHITECTURE]));
    for key in [
        "draft_vocab_size",
        "target_hidden_size",
        "eagle_aux_hidden_state_layer_ids",
        "norm_before_residual",
        "norm_before_fc",
        "fc_norm",
        "norm_output",
    ] {
        if let Some(v) = value.get(key).filter(|v| !v.is_null()) {
            out.insert(key.into(), v.clone());
        }
    }
    Ok(Some(Value::Object(out)))
}

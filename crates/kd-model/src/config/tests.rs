//! Unit tests of `LlamaConfig`: both config styles, the families, the errors.

use super::*;

/// `meta-llama/Llama-3.2-1B-Instruct/config.json` as published on the hub (transformers 4.x style).
const LLAMA_3_2_1B: &str = include_str!("../../../../fixtures/configs/llama-3.2-1b-instruct.json");
/// The same model as transformers 5 writes it (`rope_parameters`, `dtype`).
const LLAMA_3_2_1B_V5: &str =
    include_str!("../../../../fixtures/configs/llama-3.2-1b-instruct.v5.json");

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

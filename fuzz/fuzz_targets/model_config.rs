//! Model loading on arbitrary bytes: the first byte picks `config.json` text (parsed and
//! validated, every family) or a `model.safetensors` file beside a fixed micro Llama config
//! (header, dtypes, shapes, offsets checked against the config; `fuzz/make_seeds.py` writes a
//! model of exactly this shape as a seed). Errors are fine; panics, aborts and unbounded
//! allocations are findings.
#![no_main]

use libfuzzer_sys::fuzz_target;

/// `MICRO_CONFIG` of `fuzz/make_seeds.py`.
const MICRO_CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
  "num_key_value_heads": 1, "vocab_size": 16, "max_position_embeddings": 64,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": true,
  "torch_dtype": "float32"}"#;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    if which % 2 == 0 {
        if let Ok(text) = std::str::from_utf8(rest)
            && let Ok(config) = kd_model::LlamaConfig::from_json_str(text)
        {
            let _ = config.num_parameters();
        }
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), MICRO_CONFIG).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), rest).unwrap();
    let _ = kd_model::Llama::load(dir.path(), &burn::tensor::Device::flex());
});

//! Qwen2 / Qwen2.5 and Qwen3 beyond the shared tests (parity.rs, generation.rs and
//! autodiff.rs run tiny-qwen2 and tiny-qwen3 as they run the Llamas): the configuration each
//! family reads, GGUF files of both architectures against transformers' GGUF loader, decoding
//! from packed blocks, save and reload, LoRA in PEFT's layout against PEFT
//! (fixtures/make_tiny_qwens.py, fixtures/make_qwen_peft_fixture.py), and hub ids resolved in a
//! cache laid out by huggingface_hub (fixtures/make_hf_cache.py).

use burn::module::{Module, Param};
use burn::tensor::{Distribution, Tensor};
use kd_model::{
    GenerateOptions, Llama, LoraConfig, ModelFamily, SaveDType, SeededPrompt, TokenBatch,
    hub::resolve_model_path_in,
};

use crate::util::*;

const QWENS: [&str; 2] = ["tiny-qwen2", "tiny-qwen3"];

fn parameters(name: &str) -> usize {
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/tiny-qwen-models.json")).unwrap(),
    )
    .unwrap();
    summary["models"][name]["parameters"].as_u64().unwrap() as usize
}

#[test]
fn each_family_reads_its_own_config() {
    let q2 = load("tiny-qwen2");
    let c = q2.config();
    assert_eq!(c.family, ModelFamily::Qwen2);
    // q/k/v carry a bias, o does not; no q/k norms.
    assert_eq!(c.attention_biases(), [true, true, true, false]);
    assert!(!c.qk_norm() && !c.tie_word_embeddings);
    assert_eq!(c.rope_theta, 1e6);
    assert_eq!(q2.num_params(), parameters("tiny-qwen2"));
    assert_eq!(c.num_parameters(), parameters("tiny-qwen2"));

    let q3 = load("tiny-qwen3");
    let c = q3.config();
    assert_eq!(c.family, ModelFamily::Qwen3);
    assert_eq!(c.attention_biases(), [false; 4]);
    assert!(c.qk_norm() && c.tie_word_embeddings);
    // head_dim is its own field, not hidden / heads (48 / 4).
    assert_eq!(
        (c.hidden_size, c.num_attention_heads, c.head_dim),
        (48, 4, 16)
    );
    assert_eq!(q3.num_params(), parameters("tiny-qwen3"));
    assert_eq!(c.num_parameters(), parameters("tiny-qwen3"));
}

#[test]
fn save_and_reload_keeps_the_family_and_the_numbers() {
    let g = golden("tiny-qwen2");
    let batch = golden_batch(&g, "left");
    for name in QWENS {
        let model = load(name);
        let tmp = tempfile::tempdir().unwrap();
        model.save(tmp.path(), SaveDType::F32).unwrap();
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap())
                .unwrap();
        let family = model.config().family;
        assert_eq!(written["model_type"], family.model_type(), "{name}");
        assert_eq!(written["architectures"][0], family.architecture(), "{name}");
        let again = Llama::load(tmp.path(), &cpu()).unwrap();
        // The same configuration, read back from what was written (which adds `head_dim`
        // where the original left it implicit).
        let reread = kd_model::LlamaConfig::from_json_str(&written.to_string()).unwrap();
        assert_eq!(again.config(), &reread, "{name}");
        assert_eq!(
            (
                reread.family,
                reread.head_dim,
                reread.attention_biases(),
                reread.qk_norm()
            ),
            (
                family,
                model.config().head_dim,
                model.config().attention_biases(),
                model.config().qk_norm()
            ),
            "{name}"
        );
        assert_eq!(
            to_vec(again.logits(&batch).unwrap()),
            to_vec(model.logits(&batch).unwrap()),
            "{name}: reloaded logits"
        );
    }
}

/// The GGUF file `tiny-gguf/<name>.gguf` against transformers loading the same file
/// (`fixtures/golden/gguf/<name>.safetensors`).
#[test]
fn gguf_files_give_transformers_logits() {
    for (name, tol) in [("tiny-qwen2", 1e-4f32), ("tiny-qwen3", 1e-4)] {
        let path = fixtures().join(format!("tiny-gguf/{name}.gguf"));
        let model = Llama::load(&path, &cpu()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let hf = load(name);
        let (c, h) = (model.config(), hf.config());
        assert_eq!(c.family, h.family, "{name}");
        assert_eq!(
            (
                c.head_dim,
                c.num_key_value_heads,
                c.rope_theta,
                c.tie_word_embeddings
            ),
            (
                h.head_dim,
                h.num_key_value_heads,
                h.rope_theta,
                h.tie_word_embeddings
            ),
            "{name}"
        );
        let g = golden(&format!("gguf/{name}"));
        for side in ["right", "left", "offset"] {
            let batch = golden_batch(&g, side);
            let logits = to_vec(model.logits(&batch).unwrap());
            let theirs = &g[&format!("{side}.logits")].f32;
            let d = max_diff_masked(&logits, theirs, batch.mask(), c.vocab_size);
            eprintln!("{name} GGUF {side}: max |Δ| vs transformers' GGUF loader {d:.2e}");
            assert!(d <= tol, "{name} {side}: {d}");
            assert_eq!(
                argmaxes_masked(&logits, batch.mask(), c.vocab_size),
                argmaxes_masked(theirs, batch.mask(), c.vocab_size),
                "{name} {side}: argmax"
            );
        }
    }
}

#[test]
fn gguf_decoding_from_packed_blocks_equals_transformers_generate() {
    // tiny-qwen2.gguf stores its projections as Q8_0 (make_tiny_qwens.py): load_for_inference
    // keeps the blocks and decodes each layer on the host (biases added after the packed
    // product); tiny-qwen3.gguf is F32 (no blocks to keep: the f32 path, q/k norms in the
    // KV-cached step).
    for name in QWENS {
        let path = fixtures().join(format!("tiny-gguf/{name}.gguf"));
        let packed = Llama::load_for_inference(&path, &cpu()).unwrap();
        assert!(packed.has_packed_weights(), "{name}");
        let (n, total) = Llama::packed_projections(&path).unwrap().unwrap();
        let qwen2 = name == "tiny-qwen2";
        assert_eq!(
            (n, total),
            (if qwen2 { total } else { 0 }, 7 * packed.layers.len())
        );
        assert_eq!(packed.host_layers(), qwen2, "{name}");
        let g = golden(&format!("gguf/{name}"));
        let ids = &g["generate.input_ids"];
        let mask = &g["generate.attention_mask"].i64;
        let new = &g["generate.new_tokens"];
        let (rows, s) = (ids.shape[0], ids.shape[1]);
        let steps = new.shape[1];
        let prompts: Vec<Vec<u32>> = (0..rows)
            .map(|r| {
                (0..s)
                    .filter(|j| mask[r * s + j] != 0)
                    .map(|j| ids.i64[r * s + j] as u32)
                    .collect()
            })
            .collect();
        let mut options = GenerateOptions::greedy(steps);
        options.stop_token_ids = vec![u32::MAX];
        let seeded: Vec<SeededPrompt> = prompts
            .iter()
            .map(|ids| SeededPrompt { ids, seed: 0 })
            .collect();
        let out = packed.generate(&seeded, &options).unwrap();
        for (r, o) in out.iter().enumerate() {
            let want: Vec<u32> = new.i64[r * steps..(r + 1) * steps]
                .iter()
                .map(|t| *t as u32)
                .collect();
            assert_eq!(o.ids, want, "{name} row {r}");
        }
    }
}

#[test]
fn peft_adapters_on_qwen_bases_give_peft_logits() {
    let peft = golden("tiny-qwen-peft");
    for (name, family) in [("tiny-qwen2", "qwen2"), ("tiny-qwen3", "qwen3")] {
        let g = golden(name);
        let dir = fixtures().join(format!("tiny-adapters/{family}-peft-r4"));
        let (model, config) = load(name).load_adapter(&dir).unwrap();
        assert_eq!(config.r, 4);
        let vocab = model.config().vocab_size;
        for side in ["right", "left"] {
            let batch = golden_batch(&g, side);
            let logits = to_vec(model.logits(&batch).unwrap());
            let theirs = &peft[&format!("{family}.{side}.logits")].f32;
            let d = max_diff_masked(&logits, theirs, batch.mask(), vocab);
            eprintln!("{name} + PEFT adapter {side}: max |Δ| vs PEFT {d:.2e}");
            assert!(d <= 1e-4, "{name} {side}: {d}");
        }
        // Merged into the base (the biases untouched), as PEFT's merge_and_unload.
        let batch = golden_batch(&g, "right");
        let merged = model.clone().merge_and_unload();
        let logits = to_vec(merged.logits(&batch).unwrap());
        let theirs = &peft[&format!("{family}.merged.right.logits")].f32;
        let d = max_diff_masked(&logits, theirs, batch.mask(), vocab);
        assert!(d <= 1e-4, "{name} merged: {d}");
    }
}

#[test]
fn our_adapters_on_qwen_round_trip_and_export() {
    let device = cpu();
    device.seed(7);
    let config = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        ..LoraConfig::default()
    };
    for name in QWENS {
        let g = golden(name);
        let batch = golden_batch(&g, "right");
        let base = load(name);
        let mut model = base.clone().apply_lora(&config).unwrap();
        // All seven projections adapted, PEFT's names; the biases are not parameters of it.
        let weights = model.adapter_weights();
        let layers = model.config().num_hidden_layers;
        assert_eq!(weights.len(), 7 * layers, "{name}");
        assert!(weights.keys().all(|k| !k.contains("bias")), "{name}");
        // Fresh adapters (B = 0) change nothing; give B values so that the test sees them.
        nonzero_b(&mut model);
        let with_adapter = to_vec(model.logits(&batch).unwrap());
        assert_ne!(with_adapter, to_vec(base.logits(&batch).unwrap()), "{name}");

        let tmp = tempfile::tempdir().unwrap();
        let adapter = tmp.path().join("adapter");
        model
            .save_adapter(&adapter, &format!("fixtures/tiny-models/{name}"))
            .unwrap();
        let (again, _) = load(name).load_adapter(&adapter).unwrap();
        assert_eq!(again.adapter_weights(), model.adapter_weights(), "{name}");

        let merged_dir = tmp.path().join("merged");
        model
            .clone()
            .export_merged(&merged_dir, SaveDType::F32, None)
            .unwrap();
        let merged = Llama::load(&merged_dir, &cpu()).unwrap();
        assert_eq!(merged.config().family, base.config().family);
        let d = max_diff_masked(
            &to_vec(merged.logits(&batch).unwrap()),
            &with_adapter,
            batch.mask(),
            256,
        );
        assert!(d <= 1e-5, "{name}: exported vs adapter {d}");
        // For fixtures/check_adapter_with_peft.py (run by hand: PEFT loads the adapter with
        // no missing or unexpected key and gives these logits; transformers loads the export).
        if let Some(out) = std::env::var_os("KD_QWEN_PEFT_CHECK_DIR") {
            let out = std::path::Path::new(&out).join(name);
            std::fs::create_dir_all(&out).unwrap();
            model.save_adapter(out.join("adapter"), name).unwrap();
            model
                .clone()
                .export_merged(out.join("merged"), SaveDType::F32, None)
                .unwrap();
            write_logits(&out.join("logits.safetensors"), &g, &with_adapter);
        }
    }
}

/// Replaces every adapter's B (zero when fresh) by seeded normal values.
fn nonzero_b(model: &mut Llama) {
    let device = cpu();
    device.seed(3);
    for layer in &mut model.layers {
        let (a, m) = (&mut layer.self_attn, &mut layer.mlp);
        for p in [
            &mut a.q_proj,
            &mut a.k_proj,
            &mut a.v_proj,
            &mut a.o_proj,
            &mut m.gate_proj,
            &mut m.up_proj,
            &mut m.down_proj,
        ] {
            let adapter = p.adapter.as_mut().expect("every projection adapted");
            let dims = adapter.lora_b.weight.val().dims();
            adapter.lora_b.weight = Param::from_tensor(Tensor::random(
                dims,
                Distribution::Normal(0.0, 0.05),
                &device,
            ));
        }
    }
}

fn write_logits(path: &std::path::Path, g: &std::collections::HashMap<String, Golden>, v: &[f32]) {
    let shape = g["right.logits"].shape.clone();
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape, &bytes).unwrap();
    let data = safetensors::serialize([("right.logits", view)], None).unwrap();
    std::fs::write(path, data).unwrap();
}

#[test]
fn hub_ids_resolve_in_a_cache_laid_out_by_huggingface_hub() {
    // fixtures/hf-cache/hub: tiny-qwen3 downloaded by huggingface_hub's snapshot_download
    // (models--tiny-org--tiny-qwen3/{refs/main, snapshots/<commit>/ → ../../blobs/}).
    let cache = fixtures().join("hf-cache/hub");
    let snapshot = resolve_model_path_in("tiny-org/tiny-qwen3", &cache).unwrap();
    assert!(snapshot.starts_with(cache.join("models--tiny-org--tiny-qwen3/snapshots")));
    let model = Llama::load(&snapshot, &cpu()).unwrap();
    let local = load("tiny-qwen3");
    assert_eq!(model.config(), local.config());
    let batch = TokenBatch::single(&[1, 17, 45, 200, 3]);
    assert_eq!(
        to_vec(model.logits(&batch).unwrap()),
        to_vec(local.logits(&batch).unwrap())
    );
    // A path that exists is never taken for an id; an id not in the cache stays as given
    // (the loader then says "no config.json"); a missing revision is named.
    let dir = model_dir("tiny-qwen3");
    assert_eq!(resolve_model_path_in(&dir, &cache).unwrap(), dir);
    assert_eq!(
        resolve_model_path_in("tiny-org/absent", &cache).unwrap(),
        std::path::Path::new("tiny-org/absent")
    );
    let e = resolve_model_path_in("tiny-org/tiny-qwen3@nope", &cache)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tiny-org/tiny-qwen3@nope") && e.contains("nope"),
        "{e}"
    );
}

#[test]
fn the_demo_qwen_teacher_decodes_as_transformers_does() {
    // fixtures/demo-qwen (make_demo_qwen.py): a trained bf16 Qwen2 with a ChatML tokenizer;
    // transformers' greedy tokens from its golden.json, stopping at <|im_end|> (1023).
    let dir = fixtures().join("demo-qwen");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let teacher = Llama::load(dir.join("teacher"), &cpu()).unwrap();
    assert_eq!(teacher.config().family, ModelFamily::Qwen2);
    let results = golden["teacher_greedy"]["results"].as_array().unwrap();
    assert!(!results.is_empty());
    for r in results {
        let prompt: Vec<u32> = serde_json::from_value(r["prompt_ids"].clone()).unwrap();
        let want: Vec<u32> = serde_json::from_value(r["new_tokens"].clone()).unwrap();
        let mut options = GenerateOptions::greedy(8);
        options.stop_token_ids = vec![1023];
        let out = teacher
            .generate(
                &[SeededPrompt {
                    ids: &prompt,
                    seed: 0,
                }],
                &options,
            )
            .unwrap();
        assert_eq!(out[0].ids, want, "{}", r["text"]);
    }
}

//! LoRA on the Llama: PEFT-written adapters give PEFT's logits, only adapters train, our
//! adapters round-trip, merge equals adapter, bad adapters are clear errors.

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Tensor;
use kd_model::{
    ForwardOptions, Llama, LoraConfig, ModelError, SaveDType, TargetModules, TokenBatch,
};

use crate::util::*;

fn adapter_dir(name: &str) -> std::path::PathBuf {
    fixtures().join("tiny-adapters").join(name)
}

#[test]
fn peft_written_adapters_give_peft_logits() {
    let g = golden("tiny-llama3");
    let peft = golden("tiny-llama3-peft");
    let reference = Reference::load("tiny-llama3-peft");
    for (dir, key, batches) in [
        ("peft-r4", "", &["right", "left"][..]),
        ("peft-rslora-r2", "rslora.", &["right"][..]),
    ] {
        let (model, config) = load("tiny-llama3").load_adapter(adapter_dir(dir)).unwrap();
        assert_eq!(config.use_rslora, dir.contains("rslora"));
        for b in batches {
            let batch = golden_batch(&g, b);
            let logits = to_vec(model.logits(&batch).unwrap());
            let key = format!("{key}{b}.logits");
            reference.check(&format!("{dir} {key}"), &key, &logits, Some(batch.mask()));
            assert_eq!(
                argmaxes_masked(&logits, batch.mask(), 256),
                argmaxes_masked(&peft[&key].f32, batch.mask(), 256),
                "{dir} {key}: argmax"
            );
        }
    }
}

#[test]
fn merge_equals_adapter_and_exports_a_loadable_model() {
    let g = golden("tiny-llama3");
    let batch = golden_batch(&g, "right");
    let (model, _) = load("tiny-llama3")
        .load_adapter(adapter_dir("peft-r4"))
        .unwrap();
    let with_adapter = to_vec(model.logits(&batch).unwrap());
    let merged = model.clone().merge_and_unload();
    assert!(!merged.has_adapters());
    let d = max_diff_masked(
        &to_vec(merged.logits(&batch).unwrap()),
        &with_adapter,
        batch.mask(),
        256,
    );
    assert!(d <= 1e-5, "merged vs adapter: {d}");
    Reference::load("tiny-llama3-peft").check(
        "vs PEFT's merge_and_unload",
        "merged.right.logits",
        &with_adapter,
        Some(batch.mask()),
    );

    let tmp = tempfile::tempdir().unwrap();
    let tok = fixtures().join("llama3-tokenizer");
    model
        .export_merged(tmp.path(), SaveDType::F32, Some(&tok))
        .unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(tmp.path().join(f).is_file(), "{f}");
    }
    let reloaded = Llama::load(tmp.path(), &cpu()).unwrap();
    let d = max_diff_masked(
        &to_vec(reloaded.logits(&batch).unwrap()),
        &with_adapter,
        batch.mask(),
        256,
    );
    assert!(d <= 1e-5, "exported vs adapter: {d}");
}

#[test]
fn our_adapters_round_trip_in_peft_layout() {
    let device = cpu();
    device.seed(5);
    let config = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        ..LoraConfig::default()
    };
    let model = load("tiny-llama3").apply_lora(&config).unwrap();
    // Fresh adapters (B = 0) leave the model unchanged.
    let batch = TokenBatch::single(&[1, 17, 45, 200, 3]);
    assert_eq!(
        to_vec(model.logits(&batch).unwrap()),
        to_vec(load("tiny-llama3").logits(&batch).unwrap())
    );
    let report = model.parameter_report();
    // r·(in + out) per projection: q 4·96, k 4·72, v 4·72, o 4·96, gate/up 4·176, down 4·176.
    assert_eq!(report.trainable, 3 * 4 * (96 + 72 + 72 + 96 + 176 * 3));
    assert_eq!(report.total, 100_944 + report.trainable);
    assert!(
        report
            .to_string()
            .starts_with("trainable params: 10,368 || all params: 111,312 || trainable%: ")
    );

    let tmp = tempfile::tempdir().unwrap();
    model
        .save_adapter(tmp.path(), "fixtures/tiny-models/tiny-llama3")
        .unwrap();
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    for (k, v) in [
        ("peft_type", "LORA"),
        ("task_type", "CAUSAL_LM"),
        ("bias", "none"),
    ] {
        assert_eq!(cfg[k], v, "{k}");
    }
    assert_eq!(cfg["r"], 4);
    assert_eq!(cfg["fan_in_fan_out"], false);
    let (again, _) = load("tiny-llama3").load_adapter(tmp.path()).unwrap();
    assert_eq!(again.adapter_weights(), model.adapter_weights());
}

#[test]
fn only_adapters_train() {
    let device = cpu();
    device.seed(11);
    let config = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        ..LoraConfig::default()
    };
    let mut model = load("tiny-llama3").apply_lora(&config).unwrap().train();
    let base_before = model.layers[0]
        .self_attn
        .q_proj
        .base
        .weight
        .val()
        .into_data();
    let embed_before = model.embed_tokens.weight.val().into_data();
    let b_before = model.layers[0]
        .self_attn
        .q_proj
        .adapter
        .as_ref()
        .unwrap()
        .lora_b
        .weight
        .val()
        .into_data();
    let mut optim = AdamWConfig::new()
        .with_weight_decay(0.01)
        .with_epsilon(1e-8)
        .init();
    let batch = TokenBatch::from_rows(
        &[vec![1, 17, 45, 200, 3, 99], vec![1, 88, 12]],
        0,
        kd_model::PaddingSide::Right,
    );
    for _ in 0..3 {
        let logits = model.logits(&batch).unwrap();
        let loss: Tensor<1> = logits.powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    assert_eq!(
        model.layers[0]
            .self_attn
            .q_proj
            .base
            .weight
            .val()
            .into_data(),
        base_before,
        "base weights changed"
    );
    assert_eq!(
        model.embed_tokens.weight.val().into_data(),
        embed_before,
        "embeddings changed"
    );
    let b_after = model.layers[0]
        .self_attn
        .q_proj
        .adapter
        .as_ref()
        .unwrap()
        .lora_b
        .weight
        .val()
        .into_data();
    assert_ne!(b_after, b_before, "adapters did not train");
}

#[test]
fn dropout_is_seeded_and_off_in_eval() {
    let device = cpu();
    device.seed(3);
    let config = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.3,
        ..LoraConfig::default()
    };
    let (peft_model, _) = load("tiny-llama3")
        .load_adapter(adapter_dir("peft-r4"))
        .unwrap();
    // Same adapter weights, but with dropout.
    let mut model = load("tiny-llama3").apply_lora(&config).unwrap();
    for ((_, src), dst) in peft_model
        .projections()
        .into_iter()
        .zip(model_projections(&mut model))
    {
        let a = src.adapter.as_ref().unwrap();
        let d = dst.adapter.as_mut().unwrap();
        d.lora_a = a.lora_a.clone();
        d.lora_b = a.lora_b.clone();
    }
    let batch = TokenBatch::single(&[1, 17, 45, 200, 3]);
    let run = |seed: Option<u64>| {
        let opts = ForwardOptions {
            dropout_seed: seed,
            ..ForwardOptions::default()
        };
        to_vec(model.forward(&batch, &opts).unwrap().logits.unwrap())
    };
    assert_eq!(run(Some(1)), run(Some(1)));
    assert_ne!(run(Some(1)), run(Some(2)));
    assert_eq!(run(None), to_vec(peft_model.logits(&batch).unwrap()));
}

/// With the seed's LoRA defaults (dropout 0.05) a training forward pass on the CPU takes the
/// fused projection for all seven projections of every layer, dropout included, and its
/// masks follow the seed.
#[test]
fn training_with_dropout_takes_the_fused_projection() {
    let device = cpu().autodiff();
    // Trained (non-zero) adapter weights, with the default dropout.
    let (mut model, _) = Llama::load(crate::util::model_dir("tiny-llama3"), &device)
        .unwrap()
        .load_adapter(adapter_dir("peft-r4"))
        .unwrap();
    let dropout = LoraConfig::default().dropout;
    assert_eq!(dropout, 0.05);
    for p in model_projections(&mut model) {
        p.adapter.as_mut().unwrap().dropout = dropout;
    }
    let batch = TokenBatch::single(&[1, 17, 45, 200, 3, 9, 11]);
    let run = |seed: u64| {
        let opts = ForwardOptions {
            dropout_seed: Some(seed),
            ..ForwardOptions::default()
        };
        let before = kd_model::ops::fused_lora_calls();
        let logits = model.forward(&batch, &opts).unwrap().logits.unwrap();
        let calls = kd_model::ops::fused_lora_calls() - before;
        (to_vec(logits), calls)
    };
    let (a, calls) = run(1);
    assert_eq!(calls, 7 * model.layers.len() as u64);
    assert_eq!(a, run(1).0, "same seed, same masks");
    assert_ne!(a, run(2).0, "another seed, other masks");
}

fn model_projections(model: &mut Llama) -> Vec<&mut kd_model::layers::LoraLinear> {
    let mut out = Vec::new();
    for l in &mut model.layers {
        let (a, m) = (&mut l.self_attn, &mut l.mlp);
        out.extend([&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj]);
        out.extend([&mut m.gate_proj, &mut m.up_proj, &mut m.down_proj]);
    }
    out
}

#[test]
fn bad_adapters_and_targets_are_clear_errors() {
    // Unknown target modules list the valid names.
    let config = LoraConfig {
        target_modules: TargetModules::Names(vec!["qkv_proj".into()]),
        ..LoraConfig::default()
    };
    let e = load("tiny-llama3")
        .apply_lora(&config)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`qkv_proj`") && e.contains("gate_proj") && e.contains("q_proj"),
        "{e}"
    );
    // An adapter for another architecture: tiny-llama3's adapter on tiny-tied (other widths).
    match load("tiny-tied").load_adapter(adapter_dir("peft-r4")) {
        Err(ModelError::Weights { problems, .. }) => {
            assert!(
                problems.iter().any(
                    |p| p.contains("model.layers.0.self_attn.k_proj") && p.contains("[16, 48]")
                ),
                "{problems:#?}"
            );
            assert!(
                problems
                    .iter()
                    .any(|p| p.contains("model.layers.2") && p.contains("does not exist")),
                "{problems:#?}"
            );
        }
        Err(e) => panic!("expected a weights error, got {e}"),
        Ok(_) => panic!("a mismatched adapter loaded"),
    }
}

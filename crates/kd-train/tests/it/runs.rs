//! Whole runs: loss falls, checkpoints have the seed's layout, metrics are written, pruning,
//! full fine-tuning, non-finite steps.

use burn::tensor::Tensor;
use kd_data::Batch;
use kd_model::{Llama, TokenBatch};
use kd_train::{
    CausalLmLoss, NoopObserver, StepLoss, StepLossFn, TrainConfig, TrainError, TrainMode,
    TrainModel, step_checkpoints, train,
};

use crate::util::*;

#[test]
fn lora_run_writes_checkpoints_logs_and_learns() {
    let dir = tempfile::tempdir().unwrap();
    let config = TrainConfig {
        num_epochs: 3,
        learning_rate: 2e-2,
        ..small_config(dir.path())
    };
    let examples = examples(16);
    let mut info = run_info();
    info.tokenizer_dir = Some(fixtures().join("llama3-tokenizer"));
    let (model, summary) = train(
        &config,
        &info,
        lora_model(),
        &examples,
        &CausalLmLoss { weight: 1.0 },
        &mut NoopObserver,
    )
    .unwrap();
    // 16 examples / (2 × 2) = 4 steps per epoch, 3 epochs.
    assert_eq!(summary.global_step, 12);
    assert_eq!(summary.skipped_steps, 0);
    let out = dir.path();
    for e in 0..3 {
        let ck = out.join(format!("checkpoint-epoch-{e}"));
        for f in [
            "adapter_config.json",
            "adapter_model.safetensors",
            "tokenizer.json",
            "trainer_state.json",
        ] {
            assert!(ck.join(f).is_file(), "{}/{f}", ck.display());
        }
        assert!(ck.join("training_state/optimizer.safetensors").is_file());
        assert!(ck.join("training_state/state.json").is_file());
    }
    // save_total_limit 2 keeps the newest two step checkpoints.
    let steps: Vec<usize> = step_checkpoints(out).into_iter().map(|(n, _)| n).collect();
    assert_eq!(steps, vec![10, 12]);
    // One log line per step after the header lines, losses falling.
    let log = std::fs::read_to_string(out.join("training_log.txt")).unwrap();
    let lines: Vec<&str> = log.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(lines.len(), 12);
    assert!(
        log.contains("effective batch 4 = 1 device(s) × 2 × 2 accumulation"),
        "{log}"
    );
    assert!(log.contains("trainable params: 10,368"), "{log}");
    assert!(
        lines[0].contains("ce_loss")
            && lines[0].contains("grad_norm")
            && lines[0].contains("tokens/s")
    );
    let loss_of = |l: &str| -> f64 {
        l.split(" | loss ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(
        loss_of(lines[11]) < 0.7 * loss_of(lines[0]),
        "{} -> {}",
        lines[0],
        lines[11]
    );
    // TensorBoard events.
    let runs: Vec<_> = std::fs::read_dir(out.join("runs"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(runs.len(), 1);
    assert!(
        runs[0]
            .file_name()
            .to_string_lossy()
            .starts_with("events.out.tfevents.")
    );
    assert!(runs[0].metadata().unwrap().len() > 12 * 5 * 30);
    // The returned model equals the last checkpoint's adapter.
    let (reloaded, _) = base_model()
        .load_adapter(out.join("checkpoint-epoch-2"))
        .unwrap();
    assert_eq!(reloaded.adapter_weights(), model.llama.adapter_weights());
}

#[test]
fn full_fine_tuning_saves_the_whole_model() {
    let dir = tempfile::tempdir().unwrap();
    let config = TrainConfig {
        mode: TrainMode::Full,
        max_steps: Some(3),
        save_steps: 0,
        learning_rate: 1e-3,
        ..small_config(dir.path())
    };
    let model = TrainModel {
        llama: base_model(),
        projection: None,
    };
    let (trained, summary) = train(
        &config,
        &run_info(),
        model,
        &examples(8),
        &CausalLmLoss { weight: 1.0 },
        &mut NoopObserver,
    )
    .unwrap();
    assert_eq!(summary.global_step, 3);
    let ck = dir.path().join("checkpoint-3");
    assert!(ck.join("config.json").is_file() && ck.join("model.safetensors").is_file());
    let reloaded = Llama::load(&ck, &cpu()).unwrap();
    let batch = TokenBatch::single(&[1, 17, 45, 200]);
    let a: Vec<f32> = reloaded
        .logits(&batch)
        .unwrap()
        .into_data()
        .try_into_vec_as()
        .unwrap();
    let b: Vec<f32> = trained
        .llama
        .logits(&batch)
        .unwrap()
        .into_data()
        .try_into_vec_as()
        .unwrap();
    assert_eq!(a, b);
    let base: Vec<f32> = base_model()
        .logits(&batch)
        .unwrap()
        .into_data()
        .try_into_vec_as()
        .unwrap();
    assert_ne!(a, base, "full fine-tuning changed nothing");
}

/// A loss that is NaN on every step.
struct NanLoss;

impl StepLossFn for NanLoss {
    fn loss(
        &self,
        model: &TrainModel,
        batch: &Batch,
        normalizer: f32,
        seed: u64,
    ) -> kd_train::Result<StepLoss> {
        let l = CausalLmLoss { weight: 1.0 }.loss(model, batch, normalizer, seed)?;
        let nan = Tensor::<1>::from_floats([f32::NAN], &l.total.device());
        Ok(StepLoss {
            total: l.total * nan,
            terms: vec![("ce_loss", f64::NAN)],
            kd: None,
        })
    }
}

#[test]
fn non_finite_steps_are_skipped_then_stop_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = TrainConfig {
        max_consecutive_nonfinite: 3,
        save_steps: 1,
        ..small_config(dir.path())
    };
    let before = lora_model().llama.adapter_weights();
    let e = train(
        &config,
        &run_info(),
        lora_model(),
        &examples(16),
        &NanLoss,
        &mut NoopObserver,
    )
    .unwrap_err();
    assert!(
        matches!(e, TrainError::NonFinite { count: 3, step: 3 }),
        "{e}"
    );
    // Checkpoints written before the stop hold the untouched (finite) adapters.
    let (reloaded, _) = base_model()
        .load_adapter(dir.path().join("checkpoint-2"))
        .unwrap();
    let after = reloaded.adapter_weights();
    let twice = lora_model().llama.adapter_weights();
    let same = |x: &std::collections::BTreeMap<String, kd_lora::PeftWeights>,
                y: &std::collections::BTreeMap<String, kd_lora::PeftWeights>| {
        x.iter().all(|(k, w)| w.a == y[k].a && w.b == y[k].b)
    };
    assert!(same(&before, &twice), "lora_model() is not deterministic");
    assert!(
        same(&after, &before),
        "the adapters changed although every step was skipped"
    );
}

#[test]
fn unknown_config_keys_are_refused() {
    let e = serde_json::from_str::<TrainConfig>(r#"{"learning_rat": 1e-4}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("learning_rat"), "{e}");
    let bad = TrainConfig {
        train_batch_size: 0,
        ..TrainConfig::default()
    };
    assert!(
        bad.validate()
            .unwrap_err()
            .to_string()
            .contains("train_batch_size")
    );
}

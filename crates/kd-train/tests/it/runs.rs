//! Whole runs: loss falls, checkpoints have the seed's layout, metrics are written, pruning,
//! full fine-tuning, non-finite steps.

use burn::tensor::Tensor;
use kd_data::Batch;
use kd_model::{Llama, TokenBatch};
use kd_train::checkpoint::step_checkpoints;
use kd_train::{
    CausalLmLoss, NoopObserver, StepLoss, StepLossFn, TrainConfig, TrainError, TrainMode,
    TrainModel,
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
        log.contains("effective batch 4 = 1 shard(s) × 2 × 2 accumulation steps"),
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
    // Read back: every record's CRCs, the file version first, then the scalars of every
    // logged step with the values of trainer_state.json's log history.
    let events = read_events(&runs[0].path());
    assert_eq!((events[0].0, events[0].1.as_str()), (0, "brain.Event:2"));
    assert!(events[0].2.is_nan());
    let history: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("checkpoint-epoch-2/trainer_state.json")).unwrap(),
    )
    .unwrap();
    let logs = history["log_history"].as_array().unwrap();
    assert_eq!(logs.len(), 12);
    for r in logs {
        let step = r["step"].as_u64().unwrap() as i64;
        for (tag, key) in [
            ("train/loss", "loss"),
            ("train/lr", "learning_rate"),
            ("train/grad_norm", "grad_norm"),
            ("train/tokens_per_second", "tokens_per_second"),
        ] {
            let want = r[key].as_f64().unwrap() as f32;
            let got: Vec<f32> = events
                .iter()
                .filter(|(s, t, _)| *s == step && t == tag)
                .map(|(_, _, v)| *v)
                .collect();
            assert_eq!(got, vec![want], "{tag} at step {step}");
        }
        let ce = r["terms"][0][1].as_f64().unwrap() as f32;
        assert!(
            events.contains(&(step, "train/ce_loss".into(), ce)),
            "ce at {step}"
        );
    }
    assert_eq!(
        events.len(),
        1 + 12 * 5,
        "one file version and five scalars per step"
    );
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
    let model = TrainModel::new(base_model());
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

/// The records of a TensorBoard event file as (step, tag, value): TFRecord framing (length,
/// masked CRC-32C of the length, data, masked CRC-32C of the data; every CRC checked) around
/// `Event` protobufs; the file-version event gives (step, version, NaN).
fn read_events(path: &std::path::Path) -> Vec<(i64, String, f32)> {
    /// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit: independent of
    /// the table-driven one that writes the files.
    fn crc32c(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0x82F6_3B78
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }
    fn masked(data: &[u8]) -> u32 {
        let c = crc32c(data);
        (c.rotate_right(15)).wrapping_add(0xa282_ead8)
    }
    fn varint(b: &[u8], at: &mut usize) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let byte = b[*at];
            *at += 1;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return v;
            }
            shift += 7;
        }
    }
    /// The fields of a protobuf message: (field number, wire type, payload bytes).
    fn fields(b: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
        let mut at = 0;
        let mut out = Vec::new();
        while at < b.len() {
            let key = varint(b, &mut at);
            let (field, wire) = (key >> 3, key & 7);
            let len = match wire {
                0 => {
                    let start = at;
                    varint(b, &mut at);
                    out.push((field, wire, b[start..at].to_vec()));
                    continue;
                }
                1 => 8,
                5 => 4,
                2 => varint(b, &mut at) as usize,
                other => panic!("wire type {other}"),
            };
            out.push((field, wire, b[at..at + len].to_vec()));
            at += len;
        }
        out
    }
    let bytes = std::fs::read(path).unwrap();
    let mut at = 0;
    let mut out = Vec::new();
    while at < bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
        assert_eq!(crc, masked(len_bytes), "length CRC at byte {at}");
        let data = &bytes[at + 12..at + 12 + len];
        let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
        assert_eq!(crc, masked(data), "data CRC at byte {at}");
        at += 16 + len;
        let mut step = 0i64;
        let mut entry = None;
        for (field, wire, payload) in fields(data) {
            match (field, wire) {
                (1, 1) => assert!(f64::from_le_bytes(payload[..].try_into().unwrap()) > 1.6e9),
                (2, 0) => step = varint(&payload, &mut 0) as i64,
                (3, 2) => entry = Some((String::from_utf8(payload).unwrap(), f32::NAN)),
                (5, 2) => {
                    let value = &fields(&payload)[0];
                    assert_eq!(value.0, 1, "Summary.value");
                    let (mut tag, mut v) = (String::new(), f32::NAN);
                    for (f, _, p) in fields(&value.2) {
                        match f {
                            1 => tag = String::from_utf8(p).unwrap(),
                            2 => v = f32::from_le_bytes(p[..].try_into().unwrap()),
                            other => panic!("Summary.Value field {other}"),
                        }
                    }
                    entry = Some((tag, v));
                }
                other => panic!("unexpected Event field {other:?}"),
            }
        }
        let (tag, v) = entry.expect("an event with a payload");
        out.push((step, tag, v));
    }
    out
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

/// A causal-LM loss that records the rayon worker each call ran on (`None`: a thread outside
/// the pool).
#[derive(Default)]
struct Threads(std::sync::Mutex<Vec<Option<usize>>>);

impl StepLossFn for Threads {
    fn loss(
        &self,
        model: &TrainModel,
        batch: &Batch,
        normalizer: f32,
        seed: u64,
    ) -> kd_train::Result<StepLoss> {
        self.0.lock().unwrap().push(rayon::current_thread_index());
        CausalLmLoss { weight: 1.0 }.loss(model, batch, normalizer, seed)
    }
}

#[test]
fn steps_run_on_a_worker_of_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let config = TrainConfig {
        num_epochs: 1,
        save_steps: 0,
        ..small_config(dir.path())
    };
    let loss = Threads::default();
    assert_eq!(rayon::current_thread_index(), None, "the test's own thread");
    let (_, summary) = train(
        &config,
        &run_info(),
        lora_model(),
        &examples(8),
        &loss,
        &mut NoopObserver,
    )
    .unwrap();
    let threads = loss.0.into_inner().unwrap();
    assert!(
        threads.len() >= summary.global_step && summary.global_step > 0,
        "{} steps, {threads:?}",
        summary.global_step
    );
    assert!(
        threads.iter().all(Option::is_some),
        "a step's loss ran outside rayon's pool: {threads:?}"
    );
}

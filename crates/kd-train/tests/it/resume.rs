//! Exact resume: a run killed with SIGKILL after a checkpoint and resumed ends with the same
//! adapter bytes as a run never interrupted.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kd_train::{CausalLmLoss, NoopObserver, TrainConfig, TrainObserver};

use crate::util::*;

const CHILD_ENV: &str = "KD_TRAIN_RESUME_CHILD_DIR";

fn config(dir: &Path) -> TrainConfig {
    TrainConfig {
        num_epochs: 2,
        save_total_limit: None,
        ..small_config(dir)
    }
}

/// Sleeps after the first checkpoint so that the parent can kill the process mid-run.
struct SlowAfterFirstCheckpoint;

impl TrainObserver for SlowAfterFirstCheckpoint {
    fn on_checkpoint(&mut self, path: &Path) {
        if path.ends_with("checkpoint-2") {
            std::thread::sleep(Duration::from_secs(30));
        }
    }
}

/// The child's side: trains into `dir`, slowly after its first checkpoint (the parent kills
/// it there).
fn resume_child(dir: &str) {
    let cfg = config(Path::new(dir));
    train(
        &cfg,
        &run_info(),
        lora_model(),
        &examples(16),
        &CausalLmLoss { weight: 1.0 },
        &mut SlowAfterFirstCheckpoint,
    )
    .unwrap();
}

#[test]
fn exact_resume_after_sigkill() {
    // Started again by itself as the child (the variable names its directory).
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        return resume_child(&dir);
    }
    let examples = examples(16);
    let loss = CausalLmLoss { weight: 1.0 };
    // The reference: never interrupted.
    let straight = tempfile::tempdir().unwrap();
    train(
        &config(straight.path()),
        &run_info(),
        lora_model(),
        &examples,
        &loss,
        &mut NoopObserver,
    )
    .unwrap();

    // A child process runs the same training and is killed after checkpoint-2.
    let killed = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "resume::exact_resume_after_sigkill",
            "--nocapture",
        ])
        .env(CHILD_ENV, killed.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !killed
        .path()
        .join("checkpoint-2")
        .join("trainer_state.json")
        .exists()
    {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the child never reached checkpoint-2"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the child exited early"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL on Unix
    child.wait().unwrap();
    assert!(
        !killed.path().join("checkpoint-epoch-1").exists(),
        "the child finished before the kill"
    );

    // Resume from the latest checkpoint and finish.
    let resumed = TrainConfig {
        resume_from_checkpoint: Some("latest".into()),
        ..config(killed.path())
    };
    let (_, summary) = train(
        &resumed,
        &run_info(),
        lora_model(),
        &examples,
        &loss,
        &mut NoopObserver,
    )
    .unwrap();
    assert_eq!(summary.global_step, 8);
    for name in ["checkpoint-epoch-1", "checkpoint-6", "checkpoint-epoch-0"] {
        let a =
            std::fs::read(straight.path().join(name).join("adapter_model.safetensors")).unwrap();
        let b = std::fs::read(killed.path().join(name).join("adapter_model.safetensors")).unwrap();
        assert!(
            a == b,
            "{name}: resumed adapter bytes differ from the uninterrupted run"
        );
        let a = std::fs::read(
            straight
                .path()
                .join(name)
                .join("training_state/optimizer.safetensors"),
        )
        .unwrap();
        let b = std::fs::read(
            killed
                .path()
                .join(name)
                .join("training_state/optimizer.safetensors"),
        )
        .unwrap();
        assert!(a == b, "{name}: optimizer state differs");
    }
}

#[test]
fn resume_refuses_a_different_run() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        max_steps: Some(2),
        ..config(dir.path())
    };
    train(
        &cfg,
        &run_info(),
        lora_model(),
        &examples(16),
        &CausalLmLoss { weight: 1.0 },
        &mut NoopObserver,
    )
    .unwrap();
    let other = TrainConfig {
        seed: 8,
        resume_from_checkpoint: Some("latest".into()),
        ..cfg
    };
    let e = train(
        &other,
        &run_info(),
        lora_model(),
        &examples(16),
        &CausalLmLoss { weight: 1.0 },
        &mut NoopObserver,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("seed: checkpoint 7 vs now 8"), "{e}");
}

#[test]
fn runs_are_deterministic() {
    let examples = examples(16);
    let loss = CausalLmLoss { weight: 1.0 };
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let cfg = |d: &Path| TrainConfig {
        max_steps: Some(3),
        ..config(d)
    };
    train(
        &cfg(a.path()),
        &run_info(),
        lora_model(),
        &examples,
        &loss,
        &mut NoopObserver,
    )
    .unwrap();
    train(
        &cfg(b.path()),
        &run_info(),
        lora_model(),
        &examples,
        &loss,
        &mut NoopObserver,
    )
    .unwrap();
    for name in ["checkpoint-2", "checkpoint-3"] {
        let x = std::fs::read(a.path().join(name).join("adapter_model.safetensors")).unwrap();
        let y = std::fs::read(b.path().join(name).join("adapter_model.safetensors")).unwrap();
        assert!(x == y, "{name}: two identical runs differ");
    }
}

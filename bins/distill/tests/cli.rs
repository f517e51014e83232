//! The `distill` binary on the demo configuration, run from the repository root as the README
//! says: dry run, a short run with Hydra overrides, and errors with a failing exit status.

use std::path::PathBuf;
use std::process::{Command, Output};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn distill(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_distill"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("the binary runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn dry_run_prints_the_resolved_configuration() {
    let o = distill(&[
        "--config_path",
        "examples/distill",
        "--config_name",
        "distill_megatron",
        "--dry_run",
        "kd_objective=js_divergence",
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("kd_objective: js_divergence"), "{t}");
    assert!(t.contains("distill_loss_weight: 0.85"), "{t}");
    assert!(t.contains("warning: `student.strategy_args`"), "{t}");
}

#[test]
fn a_short_run_trains_validates_and_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display().to_string();
    let o = distill(&[
        "--config",
        "examples/distill/demo.yaml",
        &format!("output_dir={out}"),
        &format!("logging_dir={out}/logs"),
        "+student.data_args.max_samples=48",
        "max_steps=4",
        "eval_steps=2",
        "save_steps=2",
        "kd_objective=reverse_kl",
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("validation step 2: student/val_loss"), "{t}");
    assert!(t.contains("4 steps"), "{t}");
    assert!(
        dir.path()
            .join("checkpoint-4/adapter_model.safetensors")
            .is_file()
    );
    assert!(
        std::fs::read_dir(dir.path().join("logs"))
            .unwrap()
            .flatten()
            .any(|e| e
                .file_name()
                .to_string_lossy()
                .starts_with("events.out.tfevents."))
    );
}

#[test]
fn typos_and_bad_values_fail_with_the_key() {
    let o = distill(&[
        "--config",
        "examples/distill/demo.yaml",
        "kd_objectiv=forward_kl",
    ]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("+kd_objectiv"), "{t}");
    let o = distill(&["--config", "examples/distill/demo.yaml", "kd_objective=kl"]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("`kd_objective`") && t.contains("forward_kl"),
        "{t}"
    );
    let o = distill(&["--config_path", "examples/distill"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--config_name"), "{}", text(&o));
}

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

/// SIGTERM during training (what Slurm and Kubernetes send first) stops after the step in
/// progress with a checkpoint of it and exit status 75; the same command with
/// `resume_from_checkpoint=true` then finishes the run.
#[test]
fn sigterm_stops_with_a_checkpoint_and_the_run_resumes() {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display().to_string();
    let args = [
        "--config".to_string(),
        "examples/distill/demo.yaml".into(),
        format!("output_dir={out}"),
        format!("logging_dir={out}/logs"),
        "+student.data_args.max_samples=48".into(),
        "max_steps=200".into(),
        "eval_steps=1000".into(),
        "save_steps=1000".into(),
        "logging_steps=1".into(),
    ];
    let child = Command::new(env!("CARGO_BIN_EXE_distill"))
        .args(&args)
        .current_dir(repo())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = dir.path().join("training_log.txt");
    let start = Instant::now();
    while !std::fs::read_to_string(&log).is_ok_and(|t| t.contains("step")) {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "training never started"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let o = child.wait_with_output().unwrap();
    let t = text(&o);
    assert_eq!(o.status.code(), Some(75), "{t}");
    assert!(t.contains("resume_from_checkpoint=true"), "{t}");
    let checkpoints: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    assert_eq!(checkpoints.len(), 1, "{checkpoints:?}\n{t}");
    assert_ne!(
        checkpoints[0], "checkpoint-200",
        "the run was not stopped early"
    );
    let resume: Vec<String> = args
        .iter()
        .cloned()
        .chain(["resume_from_checkpoint=true".to_string()])
        .collect();
    let o = distill(&resume.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        dir.path()
            .join("checkpoint-200/adapter_model.safetensors")
            .is_file()
    );
}

//! The `speculator` binary on the demo pair: dry run, train, merge, eval, derive-draft, and
//! errors with a failing exit status.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use burn::tensor::Device;
use kd_model::{Llama, TokenBatch, generate::to_host};

fn demo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/demo")
}

fn speculator(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_speculator"))
        .args(args)
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

fn small_run(out: &Path) -> Vec<String> {
    let d = demo();
    [
        "--target_model",
        &d.join("target").display().to_string(),
        "--draft_model",
        &d.join("draft").display().to_string(),
        "--data_dir",
        &d.join("data").display().to_string(),
        "--output_dir",
        &out.display().to_string(),
        "--max_samples",
        "120",
        "--num_epochs",
        "2",
        "--learning_rate",
        "3e-3",
        "--lora_r",
        "8",
        "--lora_alpha",
        "16",
        "--max_new_tokens",
        "24",
        "--eval_max_new_tokens",
        "24",
        "--eval_fraction",
        "0.1",
    ]
    .map(String::from)
    .to_vec()
}

#[test]
fn dry_run_train_merge_and_eval() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let args = small_run(&out);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();

    // The dry run checks and describes, and writes nothing.
    let o = speculator(&[argv.as_slice(), &["--dry_run"]].concat());
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("108 for training, 12 held out"), "{t}");
    assert!(!out.exists(), "a dry run wrote {}", out.display());

    // Training ends with acceptance before → after.
    let o = speculator(&argv);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("acceptance before → after"), "{t}");
    let checkpoint = out.join("checkpoint-epoch-1");
    assert!(checkpoint.join("adapter_model.safetensors").is_file());

    // The merged export computes what base + adapter compute.
    let merged = dir.path().join("merged");
    let o = speculator(&[
        "merge",
        "--adapter",
        checkpoint.to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
        "--dtype",
        "f32",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(merged.join(f).is_file(), "merged/{f}");
    }
    let cpu = Device::flex();
    let (with_adapter, _) = Llama::load(demo().join("draft"), &cpu)
        .unwrap()
        .load_adapter(&checkpoint)
        .unwrap();
    let ids = TokenBatch::single(&[0, 2, 300, 17, 3, 200]);
    let a = to_host(with_adapter.logits(&ids).unwrap());
    let b = to_host(Llama::load(&merged, &cpu).unwrap().logits(&ids).unwrap());
    let d = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(d < 1e-4, "merged vs adapter: max |Δ| = {d}");

    // `eval` reports on any pair and writes the report as JSON.
    let report = dir.path().join("report.json");
    let d = demo();
    let o = speculator(&[
        "eval",
        "--target_model",
        d.join("target").to_str().unwrap(),
        "--draft_model",
        d.join("draft").to_str().unwrap(),
        "--adapter",
        checkpoint.to_str().unwrap(),
        "--data_dir",
        d.join("data").to_str().unwrap(),
        "--max_samples",
        "8",
        "--eval_k",
        "3",
        "--eval_max_new_tokens",
        "16",
        "--output",
        report.to_str().unwrap(),
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("mean accepted length"), "{t}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!((r["prompts"].as_u64(), r["k"].as_u64()), (Some(8), Some(3)));
    assert_eq!(r["greedy_identical_rows"].as_u64(), Some(8));
}

#[test]
fn derive_draft_keeps_the_chosen_layers() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("derived");
    let target = demo().join("target");
    let o = speculator(&[
        "derive-draft",
        "--from",
        target.to_str().unwrap(),
        "--keep",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("layers [0, 2]"), "{}", text(&o));
    let derived = Llama::load(&out, &Device::flex()).unwrap();
    assert_eq!(derived.config().num_hidden_layers, 2);
    assert!(out.join("tokenizer.json").is_file());
}

#[test]
fn errors_fail_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let args = small_run(&dir.path().join("run"));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = speculator(&[argv.as_slice(), &["--draft_gpus", "cuda:1"]].concat());
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("--draft_gpus") && t.contains("--features cuda"),
        "{t}"
    );
    let o = speculator(&["--lora_rr", "8"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("--lora_r"),
        "clap suggests the flag: {}",
        text(&o)
    );
}

/// `small_run` with `flag` set to `value` (replacing it when there).
fn with(mut args: Vec<String>, flag: &str, value: &str) -> Vec<String> {
    match args.iter().position(|a| a == flag) {
        Some(i) => args[i + 1] = value.to_string(),
        None => args.extend([flag.to_string(), value.to_string()]),
    }
    args
}

/// Starts the binary, waits until `ready` holds, sends SIGTERM, and returns its output.
fn terminate_when(args: &[String], ready: impl Fn() -> bool) -> Output {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let child = Command::new(env!("CARGO_BIN_EXE_speculator"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let start = Instant::now();
    while !ready() {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "the run never got there"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(kill.success());
    child.wait_with_output().expect("the run ends")
}

/// SIGTERM (what Slurm and Kubernetes send before they kill) during training stops the run
/// after the step in progress with a checkpoint of it and exit status 75; resuming then ends
/// with the bytes of a run never stopped. During generation, the finished shards are kept and
/// the next run reuses them.
#[test]
fn sigterm_stops_cleanly_and_the_run_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let args = |out: &Path| {
        let a = with(small_run(out), "--eval_fraction", "0");
        let a = with(a, "--logging_steps", "1");
        with(a, "--teacher_cache_dir", cache.to_str().unwrap())
    };
    let straight = dir.path().join("straight");
    let o = speculator(
        &args(&straight)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(o.status.success(), "{}", text(&o));

    let stopped = dir.path().join("stopped");
    let log = stopped.join("training_log.txt");
    let o = terminate_when(&args(&stopped), || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.contains("step"))
    });
    let t = text(&o);
    assert_eq!(o.status.code(), Some(75), "{t}");
    assert!(
        t.contains("stopped on request after step")
            && t.contains("--resume_from_checkpoint latest"),
        "{t}"
    );
    let steps: Vec<String> = std::fs::read_dir(&stopped)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-") && n != "checkpoint-epoch-1")
        .collect();
    assert!(!steps.is_empty(), "no checkpoint after the stop");
    assert!(
        !stopped.join("checkpoint-epoch-1").exists(),
        "the run was not stopped early"
    );
    let resume = with(args(&stopped), "--resume_from_checkpoint", "latest");
    let o = speculator(&resume.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", text(&o));
    let adapter =
        |d: &Path| std::fs::read(d.join("checkpoint-epoch-1/adapter_model.safetensors")).unwrap();
    assert!(
        adapter(&stopped) == adapter(&straight),
        "resumed adapter differs"
    );

    // During generation (another cache, shards of 4 prompts): finished shards stay.
    let cache2 = dir.path().join("cache2");
    let gen_args = with(
        with(
            args(&dir.path().join("gen")),
            "--teacher_cache_dir",
            cache2.to_str().unwrap(),
        ),
        "--batch_size",
        "4",
    );
    let first = cache2.join("generations/shard-00000.jsonl");
    let o = terminate_when(&gen_args, || first.is_file());
    let t = text(&o);
    assert_eq!(o.status.code(), Some(75), "{t}");
    assert!(t.contains("shards; they are kept in"), "{t}");
    assert!(first.is_file());
}

/// The seed's way of naming models, hub ids, on the Qwen2 pair of fixtures/demo-qwen found in
/// a Hugging Face cache (`HF_HUB_CACHE`, offline): the run trains and measures, speculative
/// decoding reproduces the target's greedy output, and the adapters name the hub id as their
/// base, as PEFT would.
#[test]
fn hub_ids_name_a_qwen_pair_in_the_hf_cache() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("hub");
    let pair = demo().join("../demo-qwen");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    for (id, src) in [
        ("demo-qwen-teacher", "teacher"),
        ("demo-qwen-student", "student"),
    ] {
        let repo = cache.join(format!("models--tiny-org--{id}"));
        let snapshot = repo.join("snapshots").join(commit);
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), commit).unwrap();
        for e in std::fs::read_dir(pair.join(src)).unwrap().flatten() {
            std::fs::copy(e.path(), snapshot.join(e.file_name())).unwrap();
        }
    }
    let out = dir.path().join("run");
    let data = demo().join("data");
    let o = Command::new(env!("CARGO_BIN_EXE_speculator"))
        .env("HF_HUB_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .args([
            "--target_model",
            "tiny-org/demo-qwen-teacher",
            "--draft_model",
            "tiny-org/demo-qwen-student",
            "--data_dir",
            data.to_str().unwrap(),
            "--output_dir",
            out.to_str().unwrap(),
            "--max_samples",
            "40",
            "--num_epochs",
            "1",
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
            "--max_new_tokens",
            "16",
            "--eval_max_new_tokens",
            "16",
            "--eval_fraction",
            "0.2",
            "--chat_template_kwargs",
            r#"{"enable_thinking": false}"#,
        ])
        .output()
        .expect("the binary runs");
    assert!(o.status.success(), "{}", text(&o));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("acceptance.json")).unwrap())
            .unwrap();
    assert_eq!(
        report["after"]["greedy_identical_rows"].as_u64(),
        Some(8),
        "{report}"
    );
    let adapter: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("checkpoint-epoch-0/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        adapter["base_model_name_or_path"],
        "tiny-org/demo-qwen-student"
    );
    // A dry run of `target` (offline: HF_HUB_OFFLINE=1) on the cached student.
    let dry_run = |target: &str, out: &str| {
        Command::new(env!("CARGO_BIN_EXE_speculator"))
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1")
            .args([
                "--target_model",
                target,
                "--draft_model",
                "tiny-org/demo-qwen-student",
                "--data_dir",
                data.to_str().unwrap(),
                "--output_dir",
                dir.path().join(out).to_str().unwrap(),
                "--dry_run",
            ])
            .output()
            .unwrap()
    };
    // The dry run says where each id was found and what family the model is.
    let o = dry_run("tiny-org/demo-qwen-teacher", "planned");
    assert!(o.status.success(), "{}", text(&o));
    let plan = text(&o);
    assert!(
        plan.contains("tiny-org/demo-qwen-teacher found in the Hugging Face cache")
            && plan.contains(": qwen2, 2 layers"),
        "{plan}"
    );
    // Offline, an id the cache does not hold is the loader's "not a model" error, naming the
    // cache.
    let o = dry_run("tiny-org/absent", "other");
    assert!(!o.status.success());
    assert!(
        text(&o).contains("tiny-org/absent") && text(&o).contains(cache.to_str().unwrap()),
        "{}",
        text(&o)
    );
}

/// A prompt that leaves no room for a completion in the models' 512 positions (5000 words) is
/// skipped with a count, in training's generation (dry run and run) and in `eval` alike; it
/// used to be generated from and evaluated silently.
#[test]
fn prompts_too_long_for_the_models_are_skipped_with_a_count() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data/long");
    std::fs::create_dir_all(&data).unwrap();
    let lines: Vec<String> = std::fs::read_to_string(demo().join("data/ai/batch_input.jsonl"))
        .unwrap()
        .lines()
        .take(11)
        .map(String::from)
        .collect();
    let essay = vec!["word"; 5000].join(" ");
    let long = serde_json::json!({
        "custom_id": "the-essay", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "demo", "messages": [{"role": "user", "content": essay}]}
    });
    let mut text_lines = lines.clone();
    text_lines.insert(4, long.to_string());
    std::fs::write(data.join("batch_input.jsonl"), text_lines.join("\n") + "\n").unwrap();
    let data_dir = dir.path().join("data");
    let out = dir.path().join("run");
    let args = with(
        with(small_run(&out), "--data_dir", data_dir.to_str().unwrap()),
        "--max_samples",
        "100",
    );
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = speculator(&[argv.as_slice(), &["--dry_run"]].concat());
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("11 from") && t.contains("1 too long for 511 prompt tokens"),
        "{t}"
    );
    assert!(
        t.contains("1 prompt skipped") && t.contains("the-essay"),
        "the warning names the prompt: {t}"
    );
    // --max_seq_length below the positions sets the limit, and says so.
    let o = speculator(&[argv.as_slice(), &["--dry_run", "--max_seq_length", "20"]].concat());
    let t = text(&o);
    assert!(t.contains("within --max_seq_length 20"), "{t}");

    let d = demo();
    let o = speculator(&[
        "eval",
        "--target_model",
        d.join("target").to_str().unwrap(),
        "--draft_model",
        d.join("draft").to_str().unwrap(),
        "--data_dir",
        data_dir.to_str().unwrap(),
        "--eval_k",
        "2",
        "--eval_max_new_tokens",
        "4",
        "--output",
        dir.path().join("report.json").to_str().unwrap(),
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("1 prompt skipped") && t.contains("the target's 512 positions"),
        "{t}"
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap())
            .unwrap();
    assert_eq!(r["prompts"].as_u64(), Some(11), "{r}");
    // A data directory that is not there: named by its flag.
    let o = speculator(&[
        "eval",
        "--target_model",
        d.join("target").to_str().unwrap(),
        "--draft_model",
        d.join("draft").to_str().unwrap(),
        "--data_dir",
        "/nonexistent-kd-data",
    ]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("--data_dir /nonexistent-kd-data does not exist"),
        "{}",
        text(&o)
    );
}

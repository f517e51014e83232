//! `mpirun -np N speculator …` on the demo pair: N data-parallel ranks train what one process
//! with N accumulation shards trains, share the teacher cache, and a rank killed outright ends
//! the job, which then resumes exactly.
//!
//! These tests need Open MPI's `mpirun` (Debian: `openmpi-bin`). Where it is missing they say so
//! and pass, unless `KD_REQUIRE_MPI=1` (as `.ci/run` sets, after installing it) makes that a
//! failure.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn demo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/demo")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `mpirun -np n speculator`, or `None` (said on stderr) where Open MPI is not installed.
fn ranks(n: usize) -> Option<Command> {
    match kd_dist::local_mpirun(n) {
        Some(mut cmd) => {
            cmd.arg(env!("CARGO_BIN_EXE_speculator"));
            Some(cmd)
        }
        None if std::env::var("KD_REQUIRE_MPI").as_deref() == Ok("1") => {
            panic!("KD_REQUIRE_MPI=1 but no mpirun was found (install openmpi-bin)")
        }
        None => {
            eprintln!("skipped: no mpirun here (install openmpi-bin to run this test)");
            None
        }
    }
}

fn alone() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_speculator"));
    cmd.env("RAYON_NUM_THREADS", "1");
    cmd
}

fn run(mut cmd: Command, args: &[String]) -> Output {
    cmd.args(args).output().expect("the command runs")
}

/// A short run with LoRA dropout on (each shard's masks must be the ones one process draws)
/// and two micro-batches per step (so each rank sums two shards before the all-reduce).
fn args(out: &Path, cache: &Path) -> Vec<String> {
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
        "--teacher_cache_dir",
        &cache.display().to_string(),
        "--max_samples",
        "48",
        "--num_epochs",
        "10",
        "--train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
        "--batch_size",
        "4",
        "--learning_rate",
        "3e-3",
        "--lora_r",
        "8",
        "--lora_alpha",
        "16",
        "--lora_dropout",
        "0.1",
        "--max_new_tokens",
        "16",
        "--eval_fraction",
        "0.1",
        "--eval_batch_size",
        "2",
        "--eval_max_new_tokens",
        "12",
        "--logging_steps",
        "1",
        "--save_steps",
        "1",
    ]
    .map(String::from)
    .to_vec()
}

fn with(mut args: Vec<String>, flag: &str, value: &str) -> Vec<String> {
    match args.iter().position(|a| a == flag) {
        Some(i) => args[i + 1] = value.to_string(),
        None => args.extend([flag.to_string(), value.to_string()]),
    }
    args
}

/// The per-step losses (full precision) of the last checkpoint's `trainer_state.json`.
fn losses(out: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(last(out).join("trainer_state.json")).unwrap();
    let state: serde_json::Value = serde_json::from_str(&text).unwrap();
    state["log_history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["loss"].as_f64().unwrap())
        .collect()
}

/// The last step checkpoint of a run.
fn last(out: &Path) -> PathBuf {
    let mut steps = kd_train::checkpoint::step_checkpoints(out);
    steps.sort();
    steps.last().expect("a step checkpoint").1.clone()
}

/// Every tensor of an adapter file, by name.
fn adapter(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The largest |a − b| / max(|a|, |b|, 1e-3) over every element of two adapters.
fn max_relative_difference(a: &Path, b: &Path) -> f64 {
    let (a, b) = (adapter(a), adapter(b));
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f64;
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert_eq!(va.len(), vb.len());
        for (x, y) in va.iter().zip(vb) {
            let d = (x - y).abs() as f64 / (x.abs().max(y.abs()) as f64).max(1e-3);
            worst = worst.max(d);
        }
    }
    worst
}

/// Every record of a teacher cache's shards (each line), as a set.
fn records(cache: &Path) -> BTreeSet<String> {
    let dir = cache.join("generations");
    let mut out = BTreeSet::new();
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("shard-") {
            let text = std::fs::read_to_string(e.path()).unwrap();
            out.extend(text.lines().map(str::to_string));
        }
    }
    out
}

/// 2 and 4 ranks against one process with as many shards: the same teacher cache (as a set
/// of records), the same per-step losses and the same adapter within 1e-6 relative (the
/// gradient sums are added in f64 in another order — each rank's shards, then the all-reduce —
/// and rounded to f32 once; bitwise equal here), the same acceptance counts before and after
/// (the held-out prompts decoded in shares); only rank 0 reports. Then rank 1 is SIGKILLed mid-run: the job ends with an
/// error within a minute (no rank hangs), and `--resume_from_checkpoint latest` continues to
/// the bytes of the uninterrupted 2-rank run.
#[test]
fn ranks_train_what_one_process_with_as_many_shards_trains() {
    if ranks(2).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for n in [2, 4] {
        compare_ranks(dir.path(), n);
    }
    let two_out = dir.path().join("ranks-2");
    let two_cache = dir.path().join("cache-ranks-2");

    // A rank killed outright (SIGKILL: no chance to say anything) after step 2's checkpoint.
    let killed_out = dir.path().join("killed");
    let mut cmd = ranks(2).unwrap();
    let mut child = cmd
        .args(args(&killed_out, &two_cache))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !killed_out.join("checkpoint-2").is_dir() {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "no checkpoint-2"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let victim = rank_pid(&killed_out, 1).expect("rank 1's process");
    let kill = Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let killed = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(!status.success(), "the job went on without rank 1");
            eprintln!(
                "the job ended {:.2} s after rank 1 was killed ({status})",
                killed.elapsed().as_secs_f64()
            );
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(60),
            "the job still runs a minute after rank 1 was killed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.wait_with_output();
    let resume = with(
        args(&killed_out, &two_cache),
        "--resume_from_checkpoint",
        "latest",
    );
    let o = run(ranks(2).unwrap(), &resume);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        adapter(&last(&killed_out)),
        adapter(&last(&two_out)),
        "the resumed run ends elsewhere than the uninterrupted one"
    );
}

/// `n` ranks against one process with `n` shards, in `dir/one-{n}` and `dir/ranks-{n}`.
fn compare_ranks(dir: &Path, n: usize) {
    let one_out = dir.join(format!("one-{n}"));
    let one_cache = dir.join(format!("cache-one-{n}"));
    let one_args = with(
        args(&one_out, &one_cache),
        "--accumulation_shards",
        &n.to_string(),
    );
    let o = run(alone(), &one_args);
    assert!(o.status.success(), "{}", text(&o));

    let ranks_out = dir.join(format!("ranks-{n}"));
    let ranks_cache = dir.join(format!("cache-ranks-{n}"));
    let o = run(ranks(n).unwrap(), &args(&ranks_out, &ranks_cache));
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    // Rank 0 alone reports.
    assert_eq!(t.matches("speculator: done").count(), 1, "{t}");
    assert!(t.contains(&format!("data-parallel      {n} ranks")), "{t}");

    assert_eq!(
        records(&one_cache),
        records(&ranks_cache),
        "the ranks' teacher cache differs from one process's"
    );
    let (l1, l2) = (losses(&one_out), losses(&ranks_out));
    assert!(l1.len() >= 4, "too few steps logged: {l1:?}");
    assert_eq!(l1.len(), l2.len());
    for (a, b) in l1.iter().zip(&l2) {
        assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "{l1:?} vs {l2:?}");
    }
    // Acceptance, decoded in shares (batch b on rank b mod n) and merged: the counts of one
    // process (the wall times differ).
    let acceptance = |out: &Path| -> serde_json::Value {
        let text = std::fs::read_to_string(out.join("acceptance.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    };
    let (a1, a2) = (acceptance(&one_out), acceptance(&ranks_out));
    for when in ["before", "after"] {
        for key in ["prompts", "tokens", "greedy_identical_rows"] {
            assert_eq!(a1[when][key], a2[when][key], "{when}.{key}");
        }
        for key in [
            "verify_steps",
            "drafted",
            "accepted",
            "emitted",
            "reached",
            "accepted_at",
            "alpha_sum",
            "top1_agree",
            "examined",
        ] {
            assert_eq!(
                a1[when]["stats"][key], a2[when]["stats"][key],
                "{when}.stats.{key}"
            );
        }
    }
    assert!(a1["after"]["prompts"].as_u64().unwrap() >= 3);
    let worst = max_relative_difference(&last(&one_out), &last(&ranks_out));
    assert!(
        worst <= 1e-6,
        "{n} ranks: adapters differ by {worst:e} relative"
    );
    eprintln!(
        "{n} ranks vs one process with {n} shards: adapters differ by {worst:e} relative at most"
    );
}

/// The pid of the rank `rank` process of the job writing to `out` (its command line names
/// `out`; Open MPI puts the rank in its environment).
fn rank_pid(out: &Path, rank: usize) -> Option<u32> {
    let needle = out.display().to_string();
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        if !cmdline.starts_with(env!("CARGO_BIN_EXE_speculator")) || !cmdline.contains(&needle) {
            continue;
        }
        let Ok(environ) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        if environ.split(|b| *b == 0).any(|v| v == want.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

/// Ranks that would train different runs (here rank 1 has another learning rate, as a
/// machine with other settings or data would) are refused before the first step, naming the
/// rank, and the job ends.
#[test]
fn ranks_that_plan_different_runs_are_refused() {
    let Some(mut cmd) = kd_dist::local_mpirun(1) else {
        if std::env::var("KD_REQUIRE_MPI").as_deref() == Ok("1") {
            panic!("KD_REQUIRE_MPI=1 but no mpirun was found (install openmpi-bin)");
        }
        eprintln!("skipped: no mpirun here (install openmpi-bin to run this test)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let cache = dir.path().join("cache");
    let a = args(&out, &cache);
    let b = with(args(&out, &cache), "--learning_rate", "1e-3");
    // Open MPI's MPMD form: one rank with each command line.
    cmd.arg(env!("CARGO_BIN_EXE_speculator"))
        .args(&a)
        .args([":", "-np", "1", env!("CARGO_BIN_EXE_speculator")])
        .args(&b);
    let o = cmd.output().unwrap();
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("rank 1 plans another run than rank 0"), "{t}");
    assert!(!out.join("checkpoint-1").exists(), "a step was trained");
}

//! Loss-kernel figures beside PyTorch: for each objective, forward + backward w.r.t. the
//! student logits at N = 1024 × V = 128256 f32 (`docs/src/benchmarks.md`), the median of the
//! timed calls (3 after 1 warm-up by default) and the peak extra memory (beyond the inputs,
//! gradient included), each objective in a fresh process, then the same workload through
//! `benches/losses_pytorch.py` (its twins written as a strong PyTorch user writes them); each
//! row of the table (both columns and their ratios) is printed as soon as both sides ran.
//!
//! ```text
//! cargo run --release -p kd-benches --bin loss_figures -- --python /path/to/venv/bin/python
//! ```

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use burn::tensor::{Device, Distribution, Tensor, TensorData};
use clap::Parser;
use kd_benches::{peak_extra, time_ms};
use kd_loss::{
    HiddenProjection, KdConfig, KdObjective, Teacher, cross_entropy, hidden_mse, kd_loss,
};
use serde_json::{Value, json};

const OBJECTIVES: [&str; 9] = [
    "cross_entropy",
    "forward_kl",
    "reverse_kl",
    "skewed_forward_kl",
    "skewed_reverse_kl",
    "js_divergence",
    "tv_distance",
    "adaptive_kl",
    "hidden_mse",
];

#[derive(Parser, Debug)]
struct Args {
    /// Rows (tokens).
    #[arg(long, default_value_t = 1024)]
    rows: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 128_256)]
    vocab: usize,
    /// Timed calls per objective.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Untimed warm-up calls.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// PyTorch side: stop an objective's timed calls once they took this long (after 3).
    #[arg(long, default_value_t = 15.0)]
    max_seconds: f64,
    /// Comma-separated objectives (default: all).
    #[arg(long)]
    objectives: Option<String>,
    /// Python with torch for the PyTorch column (skipped when absent).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Where to write the JSON results.
    #[arg(long, default_value = "benches/results/losses.json")]
    json: PathBuf,
    /// Internal: run one objective and print its JSON line.
    #[arg(long, hide = true)]
    child: Option<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(objective) = &args.child {
        let result = run_one(&args, objective)?;
        println!("{result}");
        return Ok(());
    }
    kd_benches::print_machine()?;
    let objectives: Vec<String> = match &args.objectives {
        Some(list) => list.split(',').map(|s| s.trim().to_string()).collect(),
        None => OBJECTIVES.iter().map(|s| s.to_string()).collect(),
    };
    let exe = std::env::current_exe()?;
    println!(
        "{:<18} {:>10} {:>10} {:>7} {:>11} {:>11} {:>7}",
        "objective", "ours ms", "torch ms", "time×", "ours MiB", "torch MiB", "mem×"
    );
    let mut ours = serde_json::Map::new();
    let mut theirs = serde_json::Map::new();
    for o in &objectives {
        let out = Command::new(&exe)
            .args(["--child", o])
            .args(workload_args(&args))
            .output()
            .with_context(|| format!("running {o}"))?;
        if !out.status.success() {
            bail!("{o} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let line = String::from_utf8_lossy(&out.stdout);
        let v: Value =
            serde_json::from_str(line.trim()).with_context(|| format!("parsing {line}"))?;
        ours.insert(o.clone(), v);
        if let Some(python) = &args.python
            && let Some(v) = pytorch(python, &args, o)?
        {
            theirs.insert(o.clone(), v);
        }
        print_row(o, &ours[o], theirs.get(o).unwrap_or(&Value::Null));
    }
    if let Some(dir) = args.json.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let report = json!({"rows": args.rows, "vocab": args.vocab, "ours": ours, "pytorch": theirs});
    std::fs::write(&args.json, serde_json::to_string_pretty(&report)?)?;
    eprintln!("wrote {}", args.json.display());
    Ok(())
}

/// The workload flags both sides take: rows, vocabulary, repeats, warm-up.
fn workload_args(args: &Args) -> [String; 8] {
    [
        "--rows".into(),
        args.rows.to_string(),
        "--vocab".into(),
        args.vocab.to_string(),
        "--repeats".into(),
        args.repeats.to_string(),
        "--warmup".into(),
        args.warmup.to_string(),
    ]
}

/// One objective through `benches/losses_pytorch.py`: its JSON result.
fn pytorch(python: &PathBuf, args: &Args, objective: &str) -> Result<Option<Value>> {
    let tmp = std::env::temp_dir().join(format!("losses_pytorch_{}.json", std::process::id()));
    let out = kd_benches::python_command(python)
        .arg("benches/losses_pytorch.py")
        .args(workload_args(args))
        .args(["--max-seconds", &args.max_seconds.to_string()])
        .args(["--objectives", objective, "--json"])
        .arg(&tmp)
        .output()
        .context("running benches/losses_pytorch.py")?;
    if !out.status.success() {
        bail!(
            "the PyTorch script failed on {objective}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&tmp)?)?;
    let results = v.get("results").cloned().unwrap_or(Value::Null);
    Ok(match results {
        Value::Object(map) => map.get(objective).cloned(),
        Value::Array(items) => items
            .into_iter()
            .find(|i| i.get("objective").and_then(Value::as_str) == Some(objective)),
        _ => None,
    })
}

/// One row of the table: both sides' median time and peak extra memory, and their ratios.
fn print_row(o: &str, a: &Value, b: &Value) {
    let mib = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64).map(|b| b / 1048576.0);
    let num = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64);
    let (ta, tb) = (num(a, "median_ms"), num(b, "median_ms"));
    let (ma, mb) = (
        mib(a, "extra_bytes"),
        num(b, "peak_extra_mib").or(mib(b, "extra_bytes")),
    );
    let ratio = |x: Option<f64>, y: Option<f64>| match (x, y) {
        (Some(x), Some(y)) if y > 0.0 => format!("{:.2}", x / y),
        _ => "-".into(),
    };
    let f = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.1}"));
    println!(
        "{:<18} {:>10} {:>10} {:>7} {:>11} {:>11} {:>7}",
        o,
        f(ta),
        f(tb),
        ratio(ta, tb),
        f(ma),
        f(mb),
        ratio(ma, mb)
    );
}

fn run_one(args: &Args, objective: &str) -> Result<Value> {
    let (n, v) = (args.rows, args.vocab);
    let plain = Device::flex();
    let device = plain.clone().autodiff();
    plain.seed(0);
    let mask: Vec<bool> = (0..n).map(|i| i % 10 != 3).collect();
    let count = mask.iter().filter(|m| **m).count() as f32;

    if objective == "hidden_mse" {
        let hs =
            Tensor::<2>::random([n, 2048], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let ht = Tensor::<2>::random([n, 4096], Distribution::Normal(0.0, 1.0), &plain);
        let proj = HiddenProjection::new(2048, 4096, 0, &device);
        let step = || {
            let loss = hidden_mse(hs.clone(), ht.clone(), Some(&proj), &mask, count)
                .expect("valid shapes");
            let value = loss
                .clone()
                .into_data()
                .try_into_vec_as::<f32>()
                .expect("f32")[0];
            let grads = loss.backward();
            (value, hs.grad(&grads), proj.proj.weight.val().grad(&grads))
        };
        let ((loss, _, _), extra) = peak_extra(step);
        let (median, min, max, cpu) = time_ms(args.warmup, args.repeats, || drop(step()));
        return Ok(
            json!({"objective": objective, "median_ms": median, "min_ms": min, "max_ms": max,
            "cpu_per_wall": cpu, "extra_bytes": extra, "loss": loss}),
        );
    }

    let student =
        Tensor::<2>::random([n, v], Distribution::Normal(0.0, 2.0), &device).require_grad();
    let teacher = Tensor::<2>::random([n, v], Distribution::Normal(0.0, 2.0), &plain);
    let targets: Vec<i64> = (0..n)
        .map(|i| {
            if mask[i] {
                ((i * 7919) % v) as i64
            } else {
                -100
            }
        })
        .collect();
    let config = if objective == "cross_entropy" {
        None
    } else {
        let obj: KdObjective =
            serde_json::from_value(json!(objective)).context("unknown objective")?;
        Some(KdConfig {
            objective: obj,
            kd_temperature: 2.0,
            teacher_temperature: 1.0,
            skew_lambda: 0.1,
            adaptive_kl_alpha: 0.5,
            logits_topk: 0,
            ..KdConfig::default()
        })
    };
    let step = || {
        let out = match &config {
            None => cross_entropy(student.clone(), &targets, count),
            Some(c) => kd_loss(
                student.clone(),
                Teacher::Logits(teacher.clone()),
                &mask,
                count,
                c,
            ),
        }
        .expect("valid inputs");
        let value = out
            .loss
            .clone()
            .into_data()
            .try_into_vec_as::<f32>()
            .expect("f32")[0];
        let grads = out.loss.backward();
        (value, student.grad(&grads))
    };
    let ((loss, grad), extra) = peak_extra(step);
    let grad_norm = grad
        .map(|g| {
            g.powi_scalar(2)
                .sum()
                .sqrt()
                .into_data()
                .try_into_vec_as::<f32>()
                .expect("f32")[0]
        })
        .unwrap_or(f32::NAN);
    let (median, min, max, cpu) = time_ms(args.warmup, args.repeats, || drop(step()));
    let _ = TensorData::new(vec![0f32], [1]);
    Ok(
        json!({"objective": objective, "median_ms": median, "min_ms": min, "max_ms": max,
        "cpu_per_wall": cpu, "extra_bytes": extra, "loss": loss, "grad_norm": grad_norm}),
    )
}

//! `kd_loss::linear_kd` (the student's LM head fused with KD) beside PyTorch's plain
//! formulation (`logits = h @ W.T`, one `log_softmax` per side, the objective, masked sum / N,
//! backward to `h`): forward + backward at N = 1024 and 4096 tokens, hidden 512, V = 128256,
//! the teacher's top-64 and the full vocabulary, forward KL and JS; the median time and the
//! peak extra memory (beyond the inputs: `h`, `W`, the teacher's top-k or logits; the
//! gradient of `h` included), each case in a fresh process, PyTorch's in the same run
//! (`benches/linear_kd_pytorch.py`).
//!
//! ```text
//! cargo run --release -p kd-benches --bin linear_kd -- --python fixtures/.venv/bin/python
//! ```

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use burn::tensor::{Device, Distribution, Int, Tensor};
use clap::Parser;
use kd_benches::{peak_extra, time_ms};
use kd_loss::{KdConfig, KdObjective, Teacher, linear_kd};
use serde_json::{Value, json};

#[derive(Parser, Debug)]
struct Args {
    /// Comma-separated token counts.
    #[arg(long, default_value = "1024,4096")]
    rows: String,
    /// Hidden size.
    #[arg(long, default_value_t = 512)]
    hidden: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 128_256)]
    vocab: usize,
    /// Comma-separated modes: `topk` (the teacher's top-64) and/or `full`.
    #[arg(long, default_value = "topk,full")]
    modes: String,
    /// Comma-separated objectives.
    #[arg(long, default_value = "forward_kl,js_divergence")]
    objectives: String,
    /// Timed calls per case.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Untimed warm-up calls.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Python with torch for the PyTorch column (skipped when absent).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Where to write the JSON results.
    #[arg(long, default_value = "benches/results/linear_kd.json")]
    json: PathBuf,
    /// Internal: run one case (`rows,mode,objective`) and print its JSON line.
    #[arg(long, hide = true)]
    child: Option<String>,
}

const TOPK: usize = 64;

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(case) = &args.child {
        println!("{}", run_one(&args, case)?);
        return Ok(());
    }
    kd_benches::print_machine()?;
    let mut cases = Vec::new();
    for r in args.rows.split(',') {
        for m in args.modes.split(',') {
            for o in args.objectives.split(',') {
                cases.push(format!("{},{},{}", r.trim(), m.trim(), o.trim()));
            }
        }
    }
    let exe = std::env::current_exe()?;
    let common = |c: &mut Command| {
        c.args(["--hidden", &args.hidden.to_string()])
            .args(["--vocab", &args.vocab.to_string()])
            .args(["--repeats", &args.repeats.to_string()])
            .args(["--warmup", &args.warmup.to_string()]);
    };
    let mut rows_out = Vec::new();
    println!(
        "{:<28} {:>9} {:>9} {:>6} {:>9} {:>9} {:>6}",
        "case", "ours ms", "torch ms", "time×", "ours MiB", "torch MiB", "mem×"
    );
    for case in &cases {
        let run = |mut c: Command, what: &str| -> Result<Value> {
            common(&mut c);
            let out = c
                .output()
                .with_context(|| format!("running {what} {case}"))?;
            if !out.status.success() {
                bail!(
                    "{what} {case} failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let line = String::from_utf8_lossy(&out.stdout);
            serde_json::from_str(line.trim().lines().last().unwrap_or(""))
                .with_context(|| format!("parsing {line}"))
        };
        let mut c = Command::new(&exe);
        c.args(["--child", case]);
        let ours = run(c, "ours")?;
        let theirs = match &args.python {
            Some(py) => {
                let mut c = kd_benches::python_command(py);
                c.arg("benches/linear_kd_pytorch.py").args(["--case", case]);
                Some(run(c, "pytorch")?)
            }
            None => None,
        };
        let num = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64);
        let mib = |v: &Value| num(v, "extra_bytes").map(|b| b / 1048576.0);
        let (ta, tb) = (
            num(&ours, "median_ms"),
            theirs.as_ref().and_then(|t| num(t, "median_ms")),
        );
        let (ma, mb) = (mib(&ours), theirs.as_ref().and_then(mib));
        let ratio = |x: Option<f64>, y: Option<f64>| match (x, y) {
            (Some(x), Some(y)) if y > 0.0 => format!("{:.2}", x / y),
            _ => "-".into(),
        };
        let f = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.1}"));
        println!(
            "{:<28} {:>9} {:>9} {:>6} {:>9} {:>9} {:>6}",
            case,
            f(ta),
            f(tb),
            ratio(ta, tb),
            f(ma),
            f(mb),
            ratio(ma, mb)
        );
        if let (Some(a), Some(b)) = (
            num(&ours, "loss"),
            theirs.as_ref().and_then(|t| num(t, "loss")),
        ) {
            eprintln!("  loss: ours {a:.6}, PyTorch {b:.6}");
        }
        rows_out.push(json!({"case": case, "ours": ours, "pytorch": theirs}));
    }
    if let Some(dir) = args.json.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let report =
        json!({"hidden": args.hidden, "vocab": args.vocab, "topk": TOPK, "cases": rows_out});
    std::fs::write(&args.json, serde_json::to_string_pretty(&report)?)?;
    eprintln!("wrote {}", args.json.display());
    Ok(())
}

fn run_one(args: &Args, case: &str) -> Result<Value> {
    let parts: Vec<&str> = case.split(',').collect();
    let [rows, mode, objective] = parts.as_slice() else {
        bail!("case `{case}`: expected rows,mode,objective");
    };
    let n: usize = rows.parse()?;
    let (d, v) = (args.hidden, args.vocab);
    let plain = Device::flex();
    let device = plain.clone().autodiff();
    plain.seed(0);
    let mask: Vec<bool> = (0..n).map(|i| i % 10 != 3).collect();
    let count = mask.iter().filter(|m| **m).count() as f32;
    let h = Tensor::<2>::random([n, d], Distribution::Normal(0.0, 1.0), &device).require_grad();
    let w = Tensor::<2>::random([v, d], Distribution::Normal(0.0, 0.05), &plain);
    let objective: KdObjective = serde_json::from_value(json!(objective))?;
    let full = *mode == "full";
    let teacher = if full {
        Teacher::Logits(Tensor::<2>::random(
            [n, v],
            Distribution::Normal(0.0, 2.0),
            &plain,
        ))
    } else {
        let values = Tensor::<2>::random([n, TOPK], Distribution::Normal(0.0, 2.0), &plain);
        let indices =
            Tensor::<2, Int>::random([n, TOPK], Distribution::Uniform(0.0, v as f64), &plain);
        Teacher::TopK { indices, values }
    };
    let config = KdConfig {
        logits_topk: if full { 0 } else { TOPK },
        ..KdConfig::new(objective)
    };
    let step = || {
        let out = linear_kd(
            h.clone(),
            w.clone(),
            teacher.clone(),
            &mask,
            count,
            &config,
            1.0,
            None,
        )
        .expect("valid inputs");
        let value = out.loss.clone().into_scalar::<f32>();
        let grads = out.loss.backward();
        (value, h.grad(&grads))
    };
    let ((loss, _), extra) = peak_extra(step);
    let (median, min, max, cpu) = time_ms(args.warmup, args.repeats, || drop(step()));
    Ok(
        json!({"case": case, "median_ms": median, "min_ms": min, "max_ms": max,
        "cpu_per_wall": cpu, "extra_bytes": extra, "loss": loss}),
    )
}

//! LoRA train-step throughput on the bench model (`reference/benchmarks.md`: bench-155m,
//! batch 4 × seq 256 random ids, LoRA r16 α32 dropout 0 on q,k,v,o,gate,up,down, AdamW lr
//! 2e-4 wd 0.01, clip 1.0; 3 warm-up + 10 timed steps), in tokens/s and peak RSS, beside the
//! same step in PyTorch + PEFT (`benches/train_step_pytorch.py`) run in the same process tree.
//!
//! `cargo run --release -p kd-benches --bin train_step -- --python <venv>/bin/python`

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Result, bail};
use burn::module::Module;
use burn::optim::GradientsParams;
use clap::Parser;
use kd_benches::{proc_status_bytes, random_batch};
use kd_model::{Llama, LlamaConfig, LoraConfig, parse_device};
use kd_train::{
    AdamW, AdamWParams, CausalLmLoss, StepLossFn, TrainModel, clip_coefficient, global_grad_norm,
};

#[derive(Parser, Debug)]
struct Args {
    /// Rows per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Tokens per row.
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Untimed steps.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Vocabulary size (default: the bench model's 128256); a small one isolates the cost of
    /// the LM head and loss from the transformer body.
    #[arg(long)]
    vocab: Option<usize>,
    /// Python with torch + transformers + peft for the PyTorch column.
    #[arg(long)]
    python: Option<PathBuf>,
    /// Keep freed memory in the allocator (`kd_train::retain_freed_memory`) here, and the
    /// same glibc settings (GLIBC_TUNABLES) for the PyTorch process.
    #[arg(long)]
    retain_freed_memory: bool,
}

/// glibc tunables equal to what `kd_train::retain_freed_memory` sets.
const RETAIN_TUNABLES: &str = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647";

fn main() -> Result<()> {
    let args = Args::parse();
    if args.retain_freed_memory && !kd_train::retain_freed_memory() {
        bail!("--retain-freed-memory needs glibc");
    }
    let device = parse_device("cpu")?;
    device.seed(0);
    let mut config = LlamaConfig::bench_155m();
    if let Some(v) = args.vocab {
        config.vocab_size = v;
    }
    let lora = LoraConfig {
        r: 16,
        alpha: 32.0,
        dropout: 0.0,
        ..LoraConfig::default()
    };
    let llama = Llama::random(&config, &device).apply_lora_seeded(&lora, 0)?;
    println!(
        "bench-155m: {} parameters; {}",
        config.num_parameters(),
        llama.parameter_report()
    );
    let mut model = TrainModel {
        llama: llama.train(),
        projection: None,
    };
    let (b, s) = (args.batch, args.seq);
    let batch = random_batch(b, s, config.vocab_size);
    let n = batch.label_tokens() as f32;
    let loss_fn = CausalLmLoss { weight: 1.0 };
    let params = AdamWParams {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let mut opt = AdamW::default();
    let mut times = Vec::new();
    let mut phases = [Vec::new(), Vec::new(), Vec::new()];
    let mut last_loss = 0.0;
    for i in 0..args.warmup + args.steps {
        let t = Instant::now();
        let l = loss_fn.loss(&model, &batch, n, i as u64)?;
        last_loss = l.total.clone().into_scalar::<f32>();
        let t_forward = t.elapsed().as_secs_f64();
        let grads = GradientsParams::from_grads(l.total.backward(), &model);
        let t_backward = t.elapsed().as_secs_f64();
        let norm = global_grad_norm(&model, &grads);
        model = opt.step(model, &grads, params, 2e-4, clip_coefficient(norm, 1.0));
        if i >= args.warmup {
            let total = t.elapsed().as_secs_f64();
            times.push(total);
            phases[0].push(t_forward);
            phases[1].push(t_backward - t_forward);
            phases[2].push(total - t_backward);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let [f, bw, o] = phases.each_mut().map(median);
    let median = median(&mut times);
    let tokens = (b * s) as f64;
    let peak = proc_status_bytes("VmHWM").unwrap_or(0) as f64 / 1e9;
    println!(
        "ours:    median step {:.3} s, {:.1} tokens/s, peak RSS {:.2} GB, loss {:.4}",
        median,
        tokens / median,
        peak,
        last_loss
    );
    println!("ours:    forward {f:.3} s, backward {bw:.3} s, optimizer {o:.3} s (medians)");
    if let Some(py) = args.python {
        let mut cmd = Command::new(py);
        if args.retain_freed_memory {
            cmd.env("GLIBC_TUNABLES", RETAIN_TUNABLES);
        }
        let status = cmd
            .arg("benches/train_step_pytorch.py")
            .args(["--batch", &b.to_string(), "--seq", &s.to_string()])
            .args(["--vocab", &config.vocab_size.to_string()])
            .args([
                "--warmup",
                &args.warmup.to_string(),
                "--steps",
                &args.steps.to_string(),
            ])
            .env("OMP_WAIT_POLICY", "PASSIVE")
            .status()?;
        if !status.success() {
            bail!("the PyTorch script failed");
        }
    }
    Ok(())
}

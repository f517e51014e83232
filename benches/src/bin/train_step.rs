//! LoRA train-step throughput on the bench model (`docs/src/benchmarks.md`: bench-155m,
//! batch 4 × seq 256 random ids, LoRA r16 α32 dropout 0 on q,k,v,o,gate,up,down, AdamW lr
//! 2e-4 wd 0.01, clip 1.0; 3 warm-up + 10 timed steps), in tokens/s and peak RSS, beside the
//! same step in PyTorch + PEFT (`benches/train_step_pytorch.py`) run in the same process tree.
//!
//! `cargo run --release -p kd-benches --bin train_step -- --python <venv>/bin/python`
//!
//! `--preset seed-1b` is the speculator seed's scale instead: the Llama-3.2-1B configuration
//! (`fixtures/configs/llama-3.2-1b-instruct.json`, random weights), LoRA r64 α128 dropout 0.05
//! on the seven projections, batch 1 × 2048 tokens, AdamW; PyTorch + PEFT with SDPA attention.
//!
//! The two sides alternate (`--rounds`: ours, PyTorch, ours, PyTorch, …) and each run prints
//! its CPU time / wall time (about the thread count on an idle machine; clearly less means the
//! run was disturbed). Ours also prints how close the step is to its GEMM-bound time: the
//! multiply-adds of the step's products divided by the GEMM rate measured here on the same
//! shapes.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use burn::module::Module;
use burn::optim::GradientsParams;
use clap::Parser;
use kd_benches::{Preset, cpu_seconds, median, proc_status_bytes, random_batch};
use kd_model::{Llama, LlamaConfig, LoraConfig, parse_device};
use kd_train::advanced::{AdamW, AdamWParams, clip_coefficient, global_grad_norm};
use kd_train::{CausalLmLoss, StepLossFn, TrainModel};

#[derive(Parser, Debug)]
struct Args {
    /// The workload: bench-155m at batch 4 × 256 with LoRA r16 α32 dropout 0
    /// (`docs/src/benchmarks.md`), or the seed's Llama-3.2-1B at 1 × 2048 with LoRA r64 α128
    /// dropout 0.05; `--batch`, `--seq`, `--warmup`, `--steps` override the shape.
    #[arg(long, value_enum, default_value_t = Preset::Bench155m)]
    preset: Preset,
    /// Alternating rounds of ours and PyTorch (with `--python`).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Rows per step (preset: 4, seed-1b 1).
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per row (preset: 256, seed-1b 2048).
    #[arg(long)]
    seq: Option<usize>,
    /// Untimed steps (preset: 3, seed-1b 1).
    #[arg(long)]
    warmup: Option<usize>,
    /// Timed steps per round (preset: 10, seed-1b 2).
    #[arg(long)]
    steps: Option<usize>,
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
    /// Our device (`cpu`, `wgpu:0`, `cuda:0`, …; see `kd_model::parse_device`). Off the CPU
    /// the step also reports the device memory wgpu/CUDA's allocator holds.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// PyTorch's device (`cpu` or `cuda`).
    #[arg(long, default_value = "cpu")]
    torch_device: String,
}

/// glibc tunables equal to what `kd_train::retain_freed_memory` sets.
const RETAIN_TUNABLES: &str = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647";

/// The multiply-adds of one LoRA train step's products (forward, input gradients, adapter
/// gradients; the frozen weights get none) and the LM head, for `n` tokens.
fn step_macs(c: &LlamaConfig, r: usize, n: usize, seq: usize) -> f64 {
    let (hid, ff, l) = (c.hidden_size, c.intermediate_size, c.num_hidden_layers);
    let (q, kv) = (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    );
    // (in, out) of the seven projections.
    let projections = [
        (hid, q),
        (hid, kv),
        (hid, kv),
        (q, hid),
        (hid, ff),
        (hid, ff),
        (ff, hid),
    ];
    let per_token: usize = projections
        .iter()
        .map(|&(i, o)| {
            // base: forward + dx; adapter: x·A and ·B forward, then x·A again, u = g·Bᵀ, dA,
            // dB and u·Aᵀ: four products of r·i and three of r·o.
            2 * i * o + r * (4 * i + 3 * o)
        })
        .sum();
    // Attention (causal: half the keys): QKᵀ and PV forward; the recomputed scores, dV, dP,
    // dQ and dK backward: 7 products.
    let attention =
        l as f64 * c.num_attention_heads as f64 * c.head_dim as f64 * (seq as f64 / 2.0) * 7.0;
    let head = 2 * hid * c.vocab_size;
    n as f64 * ((l * per_token + head) as f64 + attention)
}

/// Multiply-adds per second of the GEMM on the step's largest shapes (rows × in × out of
/// the base projections and the LM head), measured here.
fn gemm_rate(c: &LlamaConfig, n: usize) -> f64 {
    use kd_kernels::gemm::{MatMut, MatRef, Threads, Write, matmul};
    let (hid, ff) = (c.hidden_size, c.intermediate_size);
    let shapes = [
        (n, hid, hid),
        (n, hid, ff),
        (n, ff, hid),
        (n.min(1024), hid, c.vocab_size.min(32768)),
    ];
    let (mut macs, mut secs) = (0f64, 0f64);
    for (m, k, o) in shapes {
        let a = vec![0.5f32; m * k];
        let b = vec![0.25f32; k * o];
        let mut y = vec![0f32; m * o];
        let mut run = || {
            matmul(
                MatMut::row_major(&mut y, m, o).expect("shape"),
                MatRef::row_major(&a, m, k).expect("shape"),
                MatRef::row_major(&b, k, o).expect("shape"),
                Write::Overwrite,
                1.0,
                Threads::All,
            )
            .expect("shape")
        };
        run();
        let t = Instant::now();
        run();
        secs += t.elapsed().as_secs_f64();
        macs += (m * k * o) as f64;
    }
    macs / secs
}

/// The most device memory seen in use (live tensors) and reserved (the allocator's pools),
/// sampled after the forward pass, the backward pass and the optimizer step.
#[derive(Default)]
struct DevicePeak {
    in_use: u64,
    reserved: u64,
    sampled: bool,
}

impl DevicePeak {
    fn sample(&mut self, device: &burn::tensor::Device) {
        if let Some(u) = device.memory_pool_usage() {
            self.in_use = self.in_use.max(u.bytes_in_use);
            self.reserved = self.reserved.max(u.bytes_reserved);
            self.sampled = true;
        }
    }

    fn report(&self) -> Option<String> {
        self.sampled.then(|| {
            format!(
                "peak in use {:.2} GB, peak reserved {:.2} GB (allocator figures)",
                self.in_use as f64 / 1e9,
                self.reserved as f64 / 1e9
            )
        })
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    kd_benches::print_machine()?;
    if args.retain_freed_memory && !kd_train::retain_freed_memory() {
        bail!("--retain-freed-memory needs glibc");
    }
    let device = parse_device(&args.device)?;
    let on_cpu = device == parse_device("cpu")?;
    println!("device: {}", kd_model::device::describe(&device));
    device.seed(0);
    let seed_1b = args.preset == Preset::Seed1b;
    let (name, mut config, lora, shape) = if seed_1b {
        let lora = LoraConfig {
            r: 64,
            alpha: 128.0,
            dropout: 0.05,
            ..LoraConfig::default()
        };
        ("seed-1b", Preset::Seed1b.config()?, lora, (1, 2048, 1, 2))
    } else {
        let lora = LoraConfig {
            r: 16,
            alpha: 32.0,
            dropout: 0.0,
            ..LoraConfig::default()
        };
        (
            "bench-155m",
            LlamaConfig::bench_155m(),
            lora,
            (4, 256, 3, 10),
        )
    };
    if let Some(v) = args.vocab {
        config.vocab_size = v;
    }
    let b = args.batch.unwrap_or(shape.0);
    let s = args.seq.unwrap_or(shape.1);
    let warmup = args.warmup.unwrap_or(shape.2);
    let steps = args.steps.unwrap_or(shape.3);
    let llama = Llama::random(&config, &device).apply_lora_seeded(&lora, 0)?;
    println!(
        "{name}: {} parameters; {}; batch {b} × {s}, LoRA r{} α{} dropout {}",
        config.num_parameters(),
        llama.parameter_report(),
        lora.r,
        lora.alpha,
        lora.dropout
    );
    // An Option so that the last round can free it before PyTorch runs.
    let mut model = Some(TrainModel::new(llama.train()));
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
    let tokens = (b * s) as f64;
    let mut step = 0u64;
    let mut device_peak = DevicePeak::default();
    for round in 0..args.rounds.max(1) {
        let mut times = Vec::new();
        let mut phases = [Vec::new(), Vec::new(), Vec::new()];
        let mut last_loss = 0.0;
        // CPU and wall clock at the first timed step.
        let mut timed_from = (cpu_seconds(), Instant::now());
        let first = if round == 0 { warmup } else { 0 };
        for i in 0..first + steps {
            if i == first {
                timed_from = (cpu_seconds(), Instant::now());
            }
            let t = Instant::now();
            let current = model
                .take()
                .expect("the model lives until the last PyTorch run");
            let l = loss_fn.loss(&current, &batch, n, step)?;
            step += 1;
            last_loss = l.total.clone().into_scalar::<f32>();
            let t_forward = t.elapsed().as_secs_f64();
            device_peak.sample(&device);
            let grads = GradientsParams::from_grads(l.total.backward(), &current);
            device.sync()?;
            let t_backward = t.elapsed().as_secs_f64();
            device_peak.sample(&device);
            let norm = global_grad_norm(&current, &grads);
            model = Some(opt.step(current, &grads, params, 2e-4, clip_coefficient(norm, 1.0)));
            device.sync()?;
            device_peak.sample(&device);
            if i >= first {
                let total = t.elapsed().as_secs_f64();
                times.push(total);
                phases[0].push(t_forward);
                phases[1].push(t_backward - t_forward);
                phases[2].push(total - t_backward);
            }
        }
        let cpu_ratio =
            (cpu_seconds() - timed_from.0) / timed_from.1.elapsed().as_secs_f64().max(1e-9);
        let [f, bw, o] = phases.map(median);
        let m = median(times);
        let peak = proc_status_bytes("VmHWM").unwrap_or(0) as f64 / 1e9;
        println!(
            "ours (round {}): median step {:.3} s, {:.1} tokens/s, peak RSS {:.2} GB, loss {:.4}, CPU/wall {:.2}",
            round + 1,
            m,
            tokens / m,
            peak,
            last_loss,
            cpu_ratio
        );
        println!("ours:    forward {f:.3} s, backward {bw:.3} s, optimizer {o:.3} s (medians)");
        if let Some(report) = device_peak.report() {
            println!("ours:    device memory: {report}");
        }
        if round == 0 && on_cpu {
            let rate = gemm_rate(&config, b * s);
            let bound = step_macs(&config, lora.r, b * s, s) / rate;
            println!(
                "ours:    GEMM-bound time {bound:.3} s ({:.1} G multiply-adds at {:.1} G/s measured on the step's shapes): the step takes {:.2}× it",
                step_macs(&config, lora.r, b * s, s) / 1e9,
                rate / 1e9,
                m / bound
            );
        }
        if let Some(py) = &args.python {
            if round + 1 == args.rounds.max(1) {
                // The last PyTorch run gets the memory ours held (the seed-1b shape needs
                // about 12 GB on each side of a 24 GB machine).
                drop(model.take());
            }
            let mut cmd = kd_benches::python_command(py);
            if args.retain_freed_memory {
                cmd.env("GLIBC_TUNABLES", RETAIN_TUNABLES);
            }
            if seed_1b {
                cmd.args(["benches/train_step_pytorch.py", "--preset", "seed-1b"]);
            } else {
                cmd.arg("benches/train_step_pytorch.py");
            }
            let status = cmd
                .args(["--batch", &b.to_string(), "--seq", &s.to_string()])
                .args(["--vocab", &config.vocab_size.to_string()])
                .args(["--device", &args.torch_device])
                .args([
                    "--warmup",
                    &warmup.to_string(),
                    "--steps",
                    &steps.to_string(),
                ])
                .status()?;
            if !status.success() {
                bail!("the PyTorch script failed");
            }
        }
    }
    Ok(())
}

//! One distill step on the bench model (`docs/src/benchmarks.md`: bench-155m, batch 4 × seq
//! 256 random ids; LoRA r16 α32 dropout 0 on the seven projections, AdamW lr 2e-4 wd 0.01,
//! clip 1.0) with a teacher of the same shape (its own random weights): the teacher's forward
//! and top-64 log-probs (no gradient), the student's forward, `0.5·CE + 0.5·forward KL` over the
//! teacher's top-64 (ROLL's renormalised semantics, `kd_loss::linear_kd` fused with the LM
//! head), backward, AdamW. Tokens/s and peak RSS beside the same loop in PyTorch + PEFT
//! (`benches/distill_step_pytorch.py`) in the same run; 2 warm-up + 6 timed steps.
//!
//! `cargo run --release -p kd-benches --bin distill_step -- --python <venv>/bin/python`

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use burn::module::Module;
use burn::optim::GradientsParams;
use clap::Parser;
use kd_benches::{proc_status_bytes, random_batch};
use kd_distill::phases::DistillLoss;
use kd_loss::{KdConfig, KdObjective};
use kd_model::{Llama, LlamaConfig, LoraConfig, parse_device};
use kd_teacher::{LocalTeacher, ScoreOptions, Teacher};
use kd_train::advanced::{AdamW, AdamWParams, clip_coefficient, global_grad_norm};
use kd_train::{StepLossFn, TrainModel};

#[derive(Parser, Debug)]
struct Args {
    /// Rows per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Tokens per row.
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Untimed steps.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 6)]
    steps: usize,
    /// Python with torch + transformers + peft for the PyTorch column.
    #[arg(long)]
    python: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    kd_benches::print_machine()?;
    let device = parse_device("cpu")?;
    let config = LlamaConfig::bench_155m();
    device.seed(1);
    let teacher = LocalTeacher::new(Llama::random(&config, &device), args.batch, "bench-teacher");
    device.seed(0);
    let lora = LoraConfig {
        r: 16,
        alpha: 32.0,
        dropout: 0.0,
        ..LoraConfig::default()
    };
    let llama = Llama::random(&config, &device).apply_lora_seeded(&lora, 0)?;
    let mut model = TrainModel::new(llama.train());
    let (b, s) = (args.batch, args.seq);
    let batch = random_batch(b, s, config.vocab_size);
    let sequences: Vec<Vec<u32>> = batch.input_ids.chunks(s).map(<[u32]>::to_vec).collect();
    let n = batch.label_tokens() as f32;
    let kd = KdConfig {
        logits_topk: 64,
        ..KdConfig::new(KdObjective::ForwardKl)
    };
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
        let scores = teacher.score_with(&sequences, &ScoreOptions::top_k(64))?;
        let t_teacher = t.elapsed().as_secs_f64();
        let loss_fn = DistillLoss {
            distill_loss_weight: 0.5,
            kd,
            scores: &scores,
        };
        let l = loss_fn.loss(&model, &batch, n, i as u64)?;
        last_loss = l.total.clone().into_scalar::<f32>();
        let grads = GradientsParams::from_grads(l.total.backward(), &model);
        let t_student = t.elapsed().as_secs_f64();
        let norm = global_grad_norm(&model, &grads);
        model = opt.step(model, &grads, params, 2e-4, clip_coefficient(norm, 1.0));
        if i >= args.warmup {
            let total = t.elapsed().as_secs_f64();
            times.push(total);
            phases[0].push(t_teacher);
            phases[1].push(t_student - t_teacher);
            phases[2].push(total - t_student);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let [tt, st, o] = phases.each_mut().map(median);
    let median = median(&mut times);
    let tokens = (b * s) as f64;
    let peak = proc_status_bytes("VmHWM").unwrap_or(0) as f64 / 1e9;
    println!(
        "ours:    median step {median:.3} s, {:.1} tokens/s, peak RSS {peak:.2} GB, loss {last_loss:.4}",
        tokens / median
    );
    println!(
        "ours:    teacher {tt:.3} s, student forward + backward {st:.3} s, optimizer {o:.3} s (medians)"
    );
    if let Some(py) = args.python {
        let status = kd_benches::python_command(py)
            .arg("benches/distill_step_pytorch.py")
            .args(["--batch", &b.to_string(), "--seq", &s.to_string()])
            .args([
                "--warmup",
                &args.warmup.to_string(),
                "--steps",
                &args.steps.to_string(),
            ])
            .status()?;
        if !status.success() {
            bail!("the PyTorch script failed");
        }
    }
    Ok(())
}

//! Greedy generation throughput on the bench model (`reference/benchmarks.md`: bench-155m,
//! batch 8 prompts × 32 tokens, 64 new tokens with the KV cache), in generated tokens/s,
//! beside transformers' `generate` on the same workload (`benches/generate_pytorch.py`).
//!
//! `cargo run --release -p kd-benches --bin generate_throughput -- --python <venv>/bin/python`

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Parser;
use kd_model::{Llama, LlamaConfig, parse_device};
use kd_teacher::{LocalTeacher, Prompt, SamplingParams, Teacher};

#[derive(Parser, Debug)]
struct Args {
    /// Prompts.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Prompt length.
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// New tokens per prompt.
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Timed repetitions (after one warm-up).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Python with torch + transformers for the HF column.
    #[arg(long)]
    python: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = parse_device("cpu")?;
    device.seed(0);
    let config = LlamaConfig::bench_155m();
    let teacher = LocalTeacher::new(Llama::random(&config, &device), args.batch, "bench-155m");
    let mut state = 7u64;
    let prompts: Vec<Prompt> = (0..args.batch)
        .map(|i| Prompt {
            index: i as u64,
            ids: (0..args.prompt_len)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 33) % config.vocab_size as u64) as u32
                })
                .collect(),
        })
        .collect();
    // No eos: every row generates all tokens, as the HF run does.
    let params = SamplingParams {
        max_new_tokens: args.new_tokens,
        stop_token_ids: vec![u32::MAX],
        ..SamplingParams::default()
    };
    teacher.generate(&prompts, &params)?;
    let mut times = Vec::new();
    for _ in 0..args.repeats {
        let t = Instant::now();
        let out = teacher.generate(&prompts, &params)?;
        times.push(t.elapsed().as_secs_f64());
        assert!(out.iter().all(|g| g.ids.len() == args.new_tokens));
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let tokens = (args.batch * args.new_tokens) as f64;
    println!(
        "ours:    {:.3} s per run, {:.1} generated tokens/s",
        median,
        tokens / median
    );
    if let Some(py) = args.python {
        let status = Command::new(py)
            .arg("benches/generate_pytorch.py")
            .args([
                "--batch",
                &args.batch.to_string(),
                "--prompt-len",
                &args.prompt_len.to_string(),
            ])
            .args([
                "--new-tokens",
                &args.new_tokens.to_string(),
                "--repeats",
                &args.repeats.to_string(),
            ])
            .env("OMP_WAIT_POLICY", "PASSIVE")
            .status()?;
        if !status.success() {
            bail!("the PyTorch script failed");
        }
    }
    Ok(())
}

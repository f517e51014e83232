//! Greedy generation throughput on the bench model (`docs/src/benchmarks.md`: bench-155m,
//! batch 8 prompts × 32 tokens, 64 new tokens with the KV cache), in generated tokens/s,
//! beside transformers' `generate` on the same workload (`benches/generate_pytorch.py`).
//!
//! `cargo run --release -p kd-benches --bin generate_throughput -- --python <venv>/bin/python`
//!
//! `--per-position` instead decodes one sequence (batch 1) token by token with the KV cache
//! and prints the decode time per token around given positions (default 100 and 2000): the
//! cache's append must not grow with the length, so the ratio stays near what attention's own
//! linear growth explains (printed beside it, from the multiply-adds of a decode step).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Parser;
use kd_benches::Preset;
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
    /// Decode one sequence token by token and time the steps at `--positions`.
    #[arg(long)]
    per_position: bool,
    /// Positions (cached tokens) at which `--per-position` reports the time per token; each
    /// is the median of the 21 steps centred on it.
    #[arg(long, value_delimiter = ',', default_values_t = [100usize, 2000])]
    positions: Vec<usize>,
    /// The model's shape (random weights): bench-155m, or the seed's Llama-3.2-1B.
    #[arg(long, value_enum, default_value_t = Preset::Bench155m)]
    preset: Preset,
    /// Our device (`cpu`, `wgpu:0`, `cuda:0`, …).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Vocabulary size (default: the preset's); a software driver binds at most 128 MiB per
    /// buffer, less than a 128k-token embedding.
    #[arg(long)]
    vocab: Option<usize>,
    /// transformers' device (`cpu` or `cuda`).
    #[arg(long, default_value = "cpu")]
    torch_device: String,
}

/// Decode time per token at each position of `positions`, batch 1, greedy, KV cache.
fn per_position(model: &Llama, config: &LlamaConfig, positions: &[usize]) -> Result<()> {
    use kd_model::sampling::argmax;
    use kd_model::{ForwardOptions, TokenBatch, generate::to_host};
    let last = *positions.iter().max().unwrap_or(&100) + 11;
    let prompt: Vec<u32> = (1..9).collect();
    let mut cache = model.new_cache();
    let opts = ForwardOptions::last_positions(1);
    let logits = to_host(
        model
            .forward_cached(&TokenBatch::single(&prompt), &mut cache, &opts)?
            .into_logits()?,
    );
    let mut tok = argmax(&logits);
    let mut times = Vec::with_capacity(last);
    while cache.len() < last {
        let t = Instant::now();
        let logits = model
            .forward_cached(&TokenBatch::single(&[tok]), &mut cache, &opts)?
            .into_logits()?;
        tok = argmax(&to_host(logits));
        times.push((cache.len() - 1, t.elapsed().as_secs_f64()));
    }
    // Multiply-adds of one decode step: projections and LM head, plus attention over `p`
    // cached keys (QKᵀ and PV for every query head).
    let (h, d, l) = (
        config.num_attention_heads,
        config.head_dim,
        config.num_hidden_layers,
    );
    let (hid, kv, ff) = (
        config.hidden_size,
        config.num_key_value_heads,
        config.intermediate_size,
    );
    let fixed = l * (2 * hid * h * d + 2 * hid * kv * d + 3 * hid * ff) + hid * config.vocab_size;
    let macs = |p: usize| (fixed + l * h * 2 * p * d) as f64;
    let at = |p: usize| {
        let mut w: Vec<f64> = times
            .iter()
            .filter(|(q, _)| q.abs_diff(p) <= 10)
            .map(|(_, t)| *t)
            .collect();
        w.sort_by(f64::total_cmp);
        w[w.len() / 2]
    };
    let base = positions[0];
    for &p in positions {
        println!(
            "ours: position {p}: {:.2} ms per token ({:.2}× position {base}; attention's growth alone: {:.2}×), cache capacity {}",
            at(p) * 1e3,
            at(p) / at(base),
            macs(p) / macs(base),
            cache.capacity()
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    kd_benches::print_machine()?;
    let device = parse_device(&args.device)?;
    println!("device: {}", kd_model::device::describe(&device));
    device.seed(0);
    let mut config = args.preset.config()?;
    if let Some(v) = args.vocab {
        config.vocab_size = v;
    }
    if args.per_position {
        return per_position(&Llama::random(&config, &device), &config, &args.positions);
    }
    let preset = args.preset.name();
    let teacher = LocalTeacher::new(Llama::random(&config, &device), args.batch, preset);
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
        let status = kd_benches::python_command(py)
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
            .args(["--preset", preset, "--device", &args.torch_device])
            .args(["--vocab", &config.vocab_size.to_string()])
            .status()?;
        if !status.success() {
            bail!("the PyTorch script failed");
        }
    }
    Ok(())
}

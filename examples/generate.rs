//! Greedy generation with the KV cache from a Hugging Face Llama directory, through
//! [`Llama::generate`] (rows stop at the model's eos ids).
//!
//! ```text
//! cargo run -p kd-examples --example generate -- fixtures/tiny-models/tiny-llama3 \
//!     --prompt 1,17,45,200 --prompt 1,88 --max-new-tokens 8
//! ```
//!
//! Each prompt (token ids) is one row of a left-padded batch; the output lists each row's new
//! tokens, and the throughput.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kd_model::{ComputeDType, GenerateOptions, Llama, SeededPrompt, parse_device};

/// Greedy generation with a Llama model in Hugging Face layout.
#[derive(Parser, Debug)]
struct Args {
    /// Model directory (config.json + model.safetensors or shards).
    model: PathBuf,
    /// A prompt as comma-separated token ids; repeat for a batch.
    #[arg(long, required = true)]
    prompt: Vec<String>,
    /// Tokens to generate per prompt.
    #[arg(long, default_value_t = 16)]
    max_new_tokens: usize,
    /// `cpu` or `cuda:N` (CUDA builds).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compute in bf16 instead of f32.
    #[arg(long)]
    bf16: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = parse_device(&args.device)?;
    let dtype = if args.bf16 {
        ComputeDType::BF16
    } else {
        ComputeDType::F32
    };
    let model = Llama::load_with(&args.model, dtype, &device)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let rows: Vec<Vec<u32>> = args
        .prompt
        .iter()
        .map(|p| {
            p.split(',')
                .map(|t| {
                    t.trim()
                        .parse::<u32>()
                        .with_context(|| format!("bad token id {t:?} in --prompt {p:?}"))
                })
                .collect()
        })
        .collect::<Result<_>>()?;
    if rows.iter().any(Vec::is_empty) {
        bail!("every --prompt needs at least one token id");
    }
    let c = model.config();
    println!(
        "model: {} layers, hidden {}, vocab {}, {} parameters",
        c.num_hidden_layers,
        c.hidden_size,
        c.vocab_size,
        c.num_parameters()
    );

    let b = rows.len();
    let prompts: Vec<SeededPrompt<'_>> = rows
        .iter()
        .map(|ids| SeededPrompt { ids, seed: 0 })
        .collect();
    let start = Instant::now();
    let completions = model.generate(&prompts, &GenerateOptions::greedy(args.max_new_tokens))?;
    let secs = start.elapsed().as_secs_f64();
    for (i, (prompt, c)) in rows.iter().zip(&completions).enumerate() {
        println!(
            "row {i}: prompt {prompt:?} -> {:?} ({:?})",
            c.ids, c.finish_reason
        );
    }
    let tokens: usize = completions.iter().map(|c| c.ids.len()).sum();
    println!(
        "{tokens} tokens in {secs:.3} s ({:.1} tokens/s, batch {b})",
        tokens as f64 / secs
    );
    Ok(())
}

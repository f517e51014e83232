//! Peak extra memory of local teacher scoring at the seed's shape: 4 sequences × 2048 tokens,
//! top-64 log-probabilities, on the Llama-3.2-1B configuration (random weights;
//! `fixtures/configs/llama-3.2-1b-instruct.json`). Extra = peak resident set while scoring
//! minus the resident set before (the model's weights loaded), scores included.
//!
//! Inference keeps no activations between layers, so the peak does not grow with the layer
//! count: `--layers` (default 2) keeps the run short without changing what is measured; pass
//! `--layers 16` for the whole model.
//!
//! `cargo run --release -p kd-benches --bin score_memory`

use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use kd_benches::{peak_extra, proc_status_bytes, random_prompts};
use kd_model::{Llama, LlamaConfig, parse_device};
use kd_teacher::{LocalTeacher, ScoreOptions, Teacher};

#[derive(Parser, Debug)]
struct Args {
    /// Sequences.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    /// Top-k log-probabilities per position.
    #[arg(long, default_value_t = 64)]
    top_k: usize,
    /// Decoder layers of the 1B configuration to keep.
    #[arg(long, default_value_t = 2)]
    layers: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    kd_benches::print_machine()?;
    let device = parse_device("cpu")?;
    device.seed(0);
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fixtures/configs/llama-3.2-1b-instruct.json"
    );
    let mut config = LlamaConfig::from_file(path)?;
    config.num_hidden_layers = args.layers;
    let teacher = LocalTeacher::new(Llama::random(&config, &device), args.batch, "seed-1b");
    let sequences = random_prompts(args.batch, args.seq, 0, config.vocab_size as u64);
    // Parameters initialise lazily: one tiny scoring call materialises them first.
    teacher.score_with(&[vec![1, 2, 3]], &ScoreOptions::top_k(args.top_k))?;
    let weights = proc_status_bytes("VmRSS").unwrap_or(0) as f64 / 1e9;
    let t = Instant::now();
    let (scores, extra) =
        peak_extra(|| teacher.score_with(&sequences, &ScoreOptions::top_k(args.top_k)));
    let scores = scores?;
    let positions: usize = scores.iter().map(|s| s.len).sum();
    println!(
        "ours: scoring {} × {} tokens, top-{} on the 1B shape ({} layers): {:.1} s, peak extra memory {:.2} GB (resident before: {:.2} GB), {} positions scored",
        args.batch,
        args.seq,
        args.top_k,
        args.layers,
        t.elapsed().as_secs_f64(),
        extra.unwrap_or(0) as f64 / 1e9,
        weights,
        positions
    );
    Ok(())
}

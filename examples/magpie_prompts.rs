//! Training prompts written by the target itself (Magpie): the chat template up to a user's
//! message is the whole prompt, and each sampled user turn becomes one line of an OpenAI
//! batch file that the speculator's `--data_dir` reads (`kd_speculator::magpie::magpie_prompts`).
//!
//! ```text
//! fixtures/fetch-smollm2.sh
//! cargo run --release -p kd-examples --example magpie_prompts -- \
//!     --target fixtures/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --count 2000 \
//!     --system "You are a helpful assistant." --out target/magpie/smollm2/batch_input.jsonl
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use kd_data::ChatTokenizer;
use kd_model::{Llama, parse_device};
use kd_speculator::{magpie::MagpieOptions, magpie::magpie_prompts, magpie::write_batch_input};

#[derive(Parser, Debug)]
struct Args {
    /// The target: a Hugging Face directory or a .gguf file.
    #[arg(long)]
    target: PathBuf,
    /// The batch file to write (`DIR/NAME/batch_input.jsonl` for a `--data_dir DIR`).
    #[arg(long)]
    out: PathBuf,
    /// Distinct prompts to write.
    #[arg(long, default_value_t = 1000)]
    count: usize,
    /// A system message before each user turn, when sampling and in the file.
    #[arg(long)]
    system: Option<String>,
    /// Tokens per sampled message at most (longer ones are dropped).
    #[arg(long, default_value_t = 64)]
    max_prompt_tokens: usize,
    /// Sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Nucleus sampling.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Messages sampled together.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Seed: sample `i` is drawn from seed `seed + i`, so nearby seeds repeat each other's
    /// prompts; for more prompts beside a set written with seed S and count N, pass a seed of
    /// at least S + 10·N (this tool's most samples) and a new --id-prefix.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Each line's `custom_id` is `{id_prefix}-{i:05}`: give sets read from one --data_dir
    /// different prefixes, so that their ids stay distinct.
    #[arg(long, default_value = "magpie")]
    id_prefix: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = parse_device("cpu")?;
    let target = Llama::load_for_inference(&args.target, &device)?;
    // A model directory or a .gguf file alike.
    let tokenizer = ChatTokenizer::from_dir(&args.target)?;
    let options = MagpieOptions {
        count: args.count,
        system: args.system.clone(),
        max_prompt_tokens: args.max_prompt_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        batch_size: args.batch_size,
        seed: args.seed,
        max_attempts: args.count.saturating_mul(10),
    };
    let start = Instant::now();
    let prompts = magpie_prompts(&target, &tokenizer, &options)?;
    write_batch_input(&args.out, &prompts, args.system.as_deref(), &args.id_prefix)?;
    println!(
        "{} prompts in {:.1} s → {}",
        prompts.len(),
        start.elapsed().as_secs_f64(),
        args.out.display()
    );
    for p in prompts.iter().take(5) {
        println!("  {p:?}");
    }
    Ok(())
}

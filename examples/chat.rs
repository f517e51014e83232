//! Chat with a model through its own tokenizer and chat template: greedy answers to one or
//! more questions, from a Hugging Face directory or a llama.cpp `.gguf` file.
//!
//! ```text
//! fixtures/fetch-smollm2.sh
//! cargo run -p kd-examples --example chat -- fixtures/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
//!     --prompt "What is the capital of France?"
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use kd_data::{ChatTokenizer, Message};
use kd_model::{GenerateOptions, Llama, SeededPrompt, parse_device};

/// Greedy chat answers from a model and its chat template.
#[derive(Parser, Debug)]
struct Args {
    /// A Hugging Face model directory, a `.gguf` file, or a directory holding one.
    model: PathBuf,
    /// A user message; repeat for a batch (one conversation each).
    #[arg(long, required = true)]
    prompt: Vec<String>,
    /// Tokens to generate per answer.
    #[arg(long, default_value_t = 48)]
    max_new_tokens: usize,
    /// `cpu` or `cuda:N` (CUDA builds).
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = parse_device(&args.device)?;
    let start = Instant::now();
    let model = Llama::load_for_inference(&args.model, &device)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let tokenizer = ChatTokenizer::from_dir(&args.model)?;
    println!("loaded in {:.2} s", start.elapsed().as_secs_f64());
    let conversations: Vec<Vec<Message>> = args
        .prompt
        .iter()
        .map(|p| vec![Message::new("user", p)])
        .collect();
    let ids = tokenizer.encode_prompts(&conversations)?;
    let prompts: Vec<SeededPrompt<'_>> = ids
        .iter()
        .map(|ids| SeededPrompt { ids, seed: 0 })
        .collect();
    let start = Instant::now();
    let completions = model.generate(&prompts, &GenerateOptions::greedy(args.max_new_tokens))?;
    let secs = start.elapsed().as_secs_f64();
    for (question, c) in args.prompt.iter().zip(&completions) {
        println!("> {question}\n{}\n", tokenizer.decode(&c.ids, true)?);
    }
    let tokens: usize = completions.iter().map(|c| c.ids.len()).sum();
    println!(
        "{tokens} tokens in {secs:.2} s ({:.1} tokens/s, batch {})",
        tokens as f64 / secs,
        prompts.len()
    );
    Ok(())
}

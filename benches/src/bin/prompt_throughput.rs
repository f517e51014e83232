//! kd-data throughput: 100k OpenAI batch prompts read from JSONL, rendered with the Llama 3.1
//! chat template and tokenized (rayon), in prompts/s per stage.
//!
//! `cargo run --release -p kd-benches --bin prompt_throughput -- --prompts 100000`

use std::io::Write;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use kd_data::{ChatTokenizer, OpenAiBatchSource, Sampling};
use rayon::prelude::*;

#[derive(Parser, Debug)]
struct Args {
    /// Number of prompts.
    #[arg(long, default_value_t = 100_000)]
    prompts: usize,
    /// Tokenizer directory.
    #[arg(long, default_value = "fixtures/llama3-tokenizer")]
    tokenizer: std::path::PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    kd_benches::print_machine()?;
    let dir = tempfile::tempdir()?;
    let part = dir.path().join("part-0");
    std::fs::create_dir_all(&part)?;
    let path = part.join("batch_input.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path)?);
    let words = [
        "alpha", "river", "quantum", "bread", "sky", "number", "café", "日本", "graph", "engine",
    ];
    for i in 0..args.prompts {
        let n = 20 + (i * 37) % 120;
        let text: Vec<&str> = (0..n).map(|j| words[(i + j * 7) % words.len()]).collect();
        let mut messages = vec![];
        if i % 3 == 0 {
            messages.push(
                serde_json::json!({"role": "system", "content": "You are a helpful assistant."}),
            );
        }
        messages.push(serde_json::json!({"role": "user", "content": text.join(" ")}));
        let line = serde_json::json!({"custom_id": format!("r{i}"), "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": messages}});
        writeln!(f, "{line}")?;
    }
    f.flush()?;
    drop(f);
    let bytes = std::fs::metadata(&path)?.len();

    let t = Instant::now();
    let source = OpenAiBatchSource::from_data_dir(dir.path())?;
    let records = Sampling::default().apply(source.records())?;
    let read = t.elapsed().as_secs_f64();

    let tok = ChatTokenizer::from_dir(&args.tokenizer)?;
    let conversations: Vec<_> = records.iter().map(|r| r.messages.clone()).collect();
    let t = Instant::now();
    let template = tok.template().expect("the tokenizer has a chat template");
    let texts: Vec<String> = conversations
        .par_iter()
        .map(|m| template.render(m, true))
        .collect::<kd_data::Result<_>>()?;
    let render = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let _ids: Vec<Vec<u32>> = texts
        .par_iter()
        .map(|s| tok.encode(s, false))
        .collect::<kd_data::Result<_>>()?;
    let tokenize = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let ids = tok.encode_prompts(&conversations)?;
    let encode = t.elapsed().as_secs_f64();
    let tokens: usize = ids.iter().map(Vec::len).sum();
    let n = records.len() as f64;
    println!(
        "{} prompts, {:.1} MB of JSONL, {} prompt tokens",
        records.len(),
        bytes as f64 / 1e6,
        tokens
    );
    println!(
        "read + parse:        {:>8.2} s  {:>10.0} prompts/s",
        read,
        n / read
    );
    println!(
        "  template only:     {:>8.2} s  {:>10.0} prompts/s",
        render,
        n / render
    );
    println!(
        "  tokenize only:     {:>8.2} s  {:>10.0} prompts/s",
        tokenize,
        n / tokenize
    );
    println!(
        "template + tokenize: {:>8.2} s  {:>10.0} prompts/s ({} threads)",
        encode,
        n / encode,
        rayon::current_num_threads()
    );
    println!(
        "total:               {:>8.2} s  {:>10.0} prompts/s",
        read + encode,
        n / (read + encode)
    );
    Ok(())
}

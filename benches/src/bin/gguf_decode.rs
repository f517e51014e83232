//! Greedy decoding of a real GGUF model (SmolLM2-135M-Instruct Q4_1, fetched by
//! `fixtures/fetch-smollm2.sh`) at batch 1 and batch 8, in generated tokens/s after the
//! prompt, beside llama.cpp's `llama-batched-bench` on the same file, prompt length, new
//! tokens and thread count (its `S_TG`: generation speed excluding prompt processing).
//!
//! Our decode time is measured as the time of `prompt + N` tokens minus the time of
//! `prompt + 1` token (the prefill and the first token), over `(N − 1) · batch` tokens.
//! Ours twice: with the weights dequantised to f32 (`Llama::load`), and with the Q8_0/Q4
//! blocks kept for decoding (`Llama::load_for_inference`, the one compared with llama.cpp).
//!
//! `cargo run --release -p kd-benches --bin gguf_decode -- --llama-cpp-bin target/llama.cpp/bin`

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kd_benches::median;
use kd_model::{GenerateOptions, Llama, SeededPrompt, parse_device};

#[derive(Parser, Debug)]
struct Args {
    /// The GGUF file.
    #[arg(
        long,
        default_value = "fixtures/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )]
    model: PathBuf,
    /// Batch sizes (parallel sequences).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batch: Vec<usize>,
    /// Prompt length.
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// New tokens per sequence.
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Timed repetitions (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Threads for llama.cpp (ours uses rayon's pool: all cores).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Keep only the first N decoder layers (to split the step time into per-layer and
    /// embedding + head parts; llama.cpp is then not comparable and not run).
    #[arg(long)]
    keep_layers: Option<usize>,
    /// Directory with llama.cpp's `llama-batched-bench` (`fixtures/build-llama-server.sh`).
    #[arg(long)]
    llama_cpp_bin: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    kd_benches::print_machine()?;
    if !args.model.is_file() {
        bail!(
            "{} is missing: run fixtures/fetch-smollm2.sh",
            args.model.display()
        );
    }
    let device = parse_device("cpu")?;
    let mut ours = Vec::new();
    for packed in [false, true] {
        let start = Instant::now();
        let mut model = if packed {
            Llama::load_for_inference(&args.model, &device)?
        } else {
            Llama::load(&args.model, &device)?
        };
        if let Some(n) = args.keep_layers {
            model = model.keep_layers(&(0..n).collect::<Vec<_>>())?;
        }
        let label = if packed { "packed" } else { "f32" };
        println!(
            "loaded {} in {:.2} s ({})",
            args.model.display(),
            start.elapsed().as_secs_f64(),
            if packed {
                "f32 copy + Q8_0/Q4 blocks kept for decoding"
            } else {
                "dequantised to f32"
            }
        );
        let vocab = model.config().vocab_size as u64;
        for &b in &args.batch {
            // Skip the 17 control tokens at the start of the vocabulary.
            let rows = kd_benches::random_prompts(b, args.prompt_len, 17, vocab);
            let prompts: Vec<SeededPrompt<'_>> = rows
                .iter()
                .map(|ids| SeededPrompt { ids, seed: 0 })
                .collect();
            let run = |n: usize| -> Result<f64> {
                let mut options = GenerateOptions::greedy(n);
                options.stop_token_ids = vec![u32::MAX]; // no eos: every row decodes n tokens
                let t = Instant::now();
                let out = model.generate(&prompts, &options)?;
                assert!(out.iter().all(|c| c.ids.len() == n));
                Ok(t.elapsed().as_secs_f64())
            };
            run(args.new_tokens)?; // warm-up
            let mut speeds = Vec::new();
            for _ in 0..args.repeats {
                let full = run(args.new_tokens)?;
                let first = run(1)?;
                speeds.push(((args.new_tokens - 1) * b) as f64 / (full - first));
            }
            let s = median(speeds);
            println!("ours {label:>6} batch {b}: {s:.1} tokens/s (decode after the prompt)");
            if packed {
                ours.push((b, s));
            }
        }
    }

    if args.keep_layers.is_some() {
        return Ok(());
    }
    let Some(bin) = &args.llama_cpp_bin else {
        println!(
            "llama.cpp: not run (pass --llama-cpp-bin DIR; fixtures/build-llama-server.sh builds it)"
        );
        return Ok(());
    };
    let exe = bin.join("llama-batched-bench");
    let npl: Vec<String> = args.batch.iter().map(usize::to_string).collect();
    let out = Command::new(&exe)
        .args(["-m"])
        .arg(&args.model)
        .args(["-t", &args.threads.to_string()])
        .args(["-c", "4096", "-b", "2048", "-ub", "512"])
        .args(["-npp", &args.prompt_len.to_string()])
        .args(["-ntg", &args.new_tokens.to_string()])
        .args(["-npl", &npl.join(",")])
        .args(["--output-format", "jsonl"])
        .output()
        .with_context(|| format!("running {}", exe.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            exe.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    for line in text.lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let (pl, tg) = (v["pl"].as_u64(), v["speed_tg"].as_f64());
        if let (Some(pl), Some(tg)) = (pl, tg) {
            let mine = ours.iter().find(|(b, _)| *b as u64 == pl).map(|(_, s)| *s);
            match mine {
                Some(m) => println!(
                    "llama.cpp batch {pl}: {tg:.1} tokens/s (S_TG, {} threads) -> ours {:.2}x",
                    args.threads,
                    m / tg
                ),
                None => println!("llama.cpp batch {pl}: {tg:.1} tokens/s"),
            }
        }
    }
    Ok(())
}

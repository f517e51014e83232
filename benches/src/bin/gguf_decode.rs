//! Greedy decoding of a real GGUF model (SmolLM2-135M-Instruct Q4_1, fetched by
//! `fixtures/fetch-smollm2.sh`) at batch 1 and batch 8, in generated tokens/s after the
//! prompt, beside llama.cpp's `llama-batched-bench` on the same file, prompt length, new
//! tokens and thread count (its `S_TG`: generation speed excluding prompt processing).
//!
//! Our decode time is that of the steps after the prefill (`Llama::generate_timed`: the
//! prompt's pass and the first token timed apart), over `(N − 1) · batch` tokens.
//! Ours three times: with the weights dequantised to f32 (`Llama::load`), with the quantised
//! blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) kept for decoding
//! (`Llama::load_for_inference`) and f32 activations, and with the blocks meeting 8-bit activations in integer dot products
//! (`with_int8_activations`, as llama.cpp computes); the last two are compared with llama.cpp.
//! `--paths amx` adds the 8-bit products on AMX tiles (`with_amx_tiles`; CPUs with AMX-INT8).
//! `--verify 2,5,9` also times single cached passes over that many new tokens (a speculative
//! verification's shape).
//!
//! `cargo run --release -p kd-benches --bin gguf_decode -- --llama-cpp-bin target/llama.cpp/bin`

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kd_benches::median;
use kd_model::{
    ForwardOptions, GenerateOptions, GenerateTimings, Llama, SeededPrompt, TokenBatch, parse_device,
};

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
    /// Also time one cached pass over N new tokens after a prompt, batch 1, for each N given
    /// (a speculative verification of N − 1 drafts costs one such pass), beside N = 1.
    #[arg(long, value_delimiter = ',')]
    verify: Vec<usize>,
    /// Which of our paths to run (`f32`; `packed`, decoding layers on the host; `packed-ops`,
    /// the same blocks with each layer as Burn operations; `int8`; `amx`, int8 on AMX tiles
    /// where the CPU has AMX-INT8).
    #[arg(long, value_delimiter = ',', default_value = "f32,packed,int8")]
    paths: Vec<String>,
    /// Directory with llama.cpp's `llama-batched-bench` (`fixtures/build-llama-server.sh`).
    #[arg(long)]
    llama_cpp_bin: Option<PathBuf>,
}

/// Our decoding paths, in the order they run.
const PATHS: [&str; 5] = ["f32", "packed", "packed-ops", "int8", "amx"];

fn main() -> Result<()> {
    let args = Args::parse();
    kd_benches::print_machine()?;
    if !args.model.is_file() {
        bail!(
            "{} is missing: run fixtures/fetch-smollm2.sh",
            args.model.display()
        );
    }
    if args.new_tokens < 2 {
        bail!(
            "--new-tokens {}: at least 2 (the first comes with the prefill)",
            args.new_tokens
        );
    }
    if let Some(bad) = args.verify.iter().find(|n| **n == 0 || **n > 16) {
        bail!("--verify {bad}: passes of 1 to 16 new tokens are timed");
    }
    let device = parse_device("cpu")?;
    let mut ours = Vec::new();
    if let Some(bad) = args.paths.iter().find(|p| !PATHS.contains(&p.as_str())) {
        bail!("--paths {bad}: the paths are f32, packed, packed-ops, int8 and amx");
    }
    for label in PATHS {
        if !args.paths.iter().any(|p| p == label) {
            continue;
        }
        let start = Instant::now();
        let packed = label != "f32";
        let mut model = if packed {
            Llama::load_for_inference(&args.model, &device)?
                .with_int8_activations(label == "int8" || label == "amx")
                .with_amx_tiles(label == "amx")
                .with_host_layers(label != "packed-ops")
        } else {
            Llama::load(&args.model, &device)?
        };
        if label == "amx" && !model.amx_tiles() {
            bail!("--paths amx: this CPU (or KD_SIMD) offers no AMX-INT8 tiles");
        }
        if let Some(n) = args.keep_layers {
            model = model.keep_layers(&(0..n).collect::<Vec<_>>())?;
        }
        println!(
            "loaded {} in {:.2} s ({label}: {})",
            args.model.display(),
            start.elapsed().as_secs_f64(),
            match label {
                "f32" => "dequantised to f32",
                "packed" =>
                    "lean: the quantised blocks, f32 copies made only on demand; f32 activations",
                "packed-ops" =>
                    "the same blocks, each layer as Burn operations (f32 copies for wide passes)",
                "amx" => "the blocks with 8-bit activations, integer products on AMX tiles",
                _ => "the blocks with 8-bit activations, integer dot products",
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
            let run = |n: usize| -> Result<GenerateTimings> {
                let mut options = GenerateOptions::greedy(n);
                options.stop_token_ids = vec![u32::MAX]; // no eos: every row decodes n tokens
                let (out, timings) = model.generate_timed(&prompts, &options)?;
                assert!(out.iter().all(|c| c.ids.len() == n));
                Ok(timings)
            };
            run(args.new_tokens)?; // warm-up
            let (mut speeds, mut prefills) = (Vec::new(), Vec::new());
            for _ in 0..args.repeats {
                // The steps after the prefill, timed apart from it (a long prompt's pass
                // outweighs many steps, and its variation theirs).
                let t = run(args.new_tokens)?;
                speeds.push(t.decode_tokens_per_s().unwrap_or(f64::NAN));
                prefills.push((args.prompt_len * b) as f64 / t.prefill.as_secs_f64());
            }
            let s = median(speeds);
            println!(
                "ours {label:>10} batch {b}: {s:.1} tokens/s (decode after the prompt); \
                 prompt {:.1} tokens/s (prefill and the first token)",
                median(prefills)
            );
            if packed {
                ours.push((label, b, s));
            }
        }
        if !args.verify.is_empty() {
            verification_passes(&model, &args, label)?;
        }
        if let Some((made, n)) = model.f32_copies_made() {
            println!(
                "ours {label:>10}: f32 copies made of {made} of the {n} weights held in blocks"
            );
        }
        println!(
            "ours {label:>10}: peak resident memory so far {}",
            kd_benches::proc_status_bytes("VmHWM")
                .map_or("unknown".into(), |b| format!("{:.0} MB", b as f64 / 1e6))
        );
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
        let (pl, tg, pp) = (
            v["pl"].as_u64(),
            v["speed_tg"].as_f64(),
            v["speed_pp"].as_f64(),
        );
        if let (Some(pl), Some(tg)) = (pl, tg) {
            println!(
                "llama.cpp batch {pl}: {tg:.1} tokens/s (S_TG, {} threads); prompt {:.1} tokens/s (S_PP)",
                args.threads,
                pp.unwrap_or(f64::NAN)
            );
            for (label, _, m) in ours.iter().filter(|(_, b, _)| *b as u64 == pl) {
                println!("  ours {label:>10} / llama.cpp: {:.2}x", m / tg);
            }
        }
    }
    Ok(())
}

/// Median time of one cached pass over `n` new tokens after a prompt of `--prompt-len`
/// tokens (batch 1; the cache rolled back after each pass), for `n = 1` and each `--verify`.
fn verification_passes(model: &Llama, args: &Args, label: &str) -> Result<()> {
    let vocab = model.config().vocab_size as u64;
    let rows = kd_benches::random_prompts(1, args.prompt_len + 16, 17, vocab);
    let (prompt, extra) = rows[0].split_at(args.prompt_len);
    let mut cache = model.new_cache();
    let options = ForwardOptions::default();
    model.forward_cached(&TokenBatch::single(prompt), &mut cache, &options)?;
    let base = cache.real_lengths()[0];
    let mut time = |n: usize| -> Result<f64> {
        let fed = &extra[..n];
        let mut times = Vec::new();
        for _ in 0..args.repeats.max(1) * 4 + 1 {
            let t = Instant::now();
            let out = model.forward_cached(&TokenBatch::single(fed), &mut cache, &options)?;
            kd_model::generate::to_host(out.into_logits()?);
            times.push(t.elapsed().as_secs_f64());
            cache.truncate(&[base])?;
        }
        times.remove(0); // warm-up
        Ok(median(times))
    };
    let one = time(1)?;
    println!(
        "ours {label:>10} pass over 1 new token: {:.2} ms",
        one * 1e3
    );
    for &n in &args.verify {
        let t = time(n)?;
        println!(
            "ours {label:>10} pass over {n} new tokens: {:.2} ms ({:.2}x the 1-token pass)",
            t * 1e3,
            t / one
        );
    }
    Ok(())
}

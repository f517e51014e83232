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
//! Every path is loaded first, and then the paths take turns: each of `--repeats` rounds (after
//! one warm-up round) times every path once, llama.cpp included, in the order given, and every
//! other round in the reverse order. So a drift of the machine's speed within the run, and any
//! advantage of running first or second, falls on every path alike. Besides each path's median
//! (and range) over the rounds, the bench prints paired ratios: per round, one path's speed
//! over another's, and the median of those ratios.
//!
//! `cargo run --release -p kd-benches --bin gguf_decode -- --llama-cpp-bin target/llama.cpp/bin`

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kd_benches::median;
use kd_model::{
    ForwardOptions, GenerateOptions, KvCache, Llama, SeededPrompt, TokenBatch, parse_device,
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
    /// Timed rounds (after one warm-up round), each path once a round; medians are reported.
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

/// One of our paths, loaded, with what its rounds measured.
struct Path {
    label: &'static str,
    model: Llama,
    /// Per batch size (as `--batch` lists them): decode tokens/s and prefill tokens/s, one
    /// per timed round.
    speeds: Vec<Vec<f64>>,
    prefills: Vec<Vec<f64>>,
    /// Per pass length (1, then `--verify`): per timed round, the median of its passes (s).
    passes: Vec<Vec<f64>>,
    /// With `--verify`: the cache after the verification prompt.
    verification: Option<Verification>,
}

/// Token ids the random prompts skip: the control tokens at the start of SmolLM2's vocabulary.
const CONTROL_TOKENS: u64 = 17;

/// llama.cpp's rounds: per batch size, `S_TG` and `S_PP` of each timed round.
struct LlamaCpp {
    exe: PathBuf,
    tg: Vec<Vec<f64>>,
    pp: Vec<Vec<f64>>,
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
    if args.new_tokens < 2 {
        bail!(
            "--new-tokens {}: at least 2 (the first comes with the prefill)",
            args.new_tokens
        );
    }
    if args.repeats == 0 {
        bail!("--repeats 0: at least one timed round");
    }
    if let Some(bad) = args.verify.iter().find(|n| **n == 0 || **n > 16) {
        bail!("--verify {bad}: passes of 1 to 16 new tokens are timed");
    }
    if let Some(bad) = args.paths.iter().find(|p| !PATHS.contains(&p.as_str())) {
        bail!("--paths {bad}: the paths are f32, packed, packed-ops, int8 and amx");
    }
    let device = parse_device("cpu")?;
    // In the order `--paths` gives them (the rounds' order).
    let mut paths = Vec::new();
    for given in &args.paths {
        let Some(&label) = PATHS.iter().find(|p| **p == given.as_str()) else {
            continue;
        };
        if paths.iter().any(|p: &Path| p.label == label) {
            continue;
        }
        let start = Instant::now();
        let mut model = if label == "f32" {
            Llama::load(&args.model, &device)?
        } else {
            Llama::load_for_inference(&args.model, &device)?
                .with_int8_activations(label == "int8" || label == "amx")
                .with_amx_tiles(label == "amx")
                .with_host_layers(label != "packed-ops")
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
        let verification = if args.verify.is_empty() {
            None
        } else {
            Some(Verification::new(&model, &args)?)
        };
        paths.push(Path {
            label,
            model,
            speeds: vec![Vec::new(); args.batch.len()],
            prefills: vec![Vec::new(); args.batch.len()],
            passes: vec![Vec::new(); args.verify.len() + 1],
            verification,
        });
    }
    let mut llama = match (&args.llama_cpp_bin, args.keep_layers) {
        (Some(bin), None) => Some(LlamaCpp {
            exe: bin.join("llama-batched-bench"),
            tg: vec![Vec::new(); args.batch.len()],
            pp: vec![Vec::new(); args.batch.len()],
        }),
        _ => None,
    };
    let Some(first) = paths.first() else {
        bail!("--paths: no path to run");
    };
    let vocab = first.model.config().vocab_size as u64;
    let prompts: Vec<Vec<Vec<u32>>> = args
        .batch
        .iter()
        .map(|&b| kd_benches::random_prompts(b, args.prompt_len, CONTROL_TOKENS, vocab))
        .collect();

    // Round 0 warms every path up and is not recorded; odd rounds run the paths in reverse.
    let turns = paths.len() + usize::from(llama.is_some());
    for round in 0..=args.repeats {
        let timed = round > 0;
        for turn in 0..turns {
            let i = if round % 2 == 1 {
                turns - 1 - turn
            } else {
                turn
            };
            match paths.get_mut(i) {
                Some(path) => path_round(path, &args, &prompts, timed)?,
                None => {
                    if let Some(l) = llama.as_mut() {
                        llama_round(l, &args, timed)?;
                    }
                }
            }
        }
    }

    report(&paths, llama.as_ref(), &args);
    for path in &paths {
        if let Some((made, n)) = path.model.f32_copies_made() {
            println!(
                "ours {:>10}: f32 copies made of {made} of the {n} weights held in blocks",
                path.label
            );
        }
    }
    println!(
        "peak resident memory of the run (every path loaded at once; run one path for its own): {}",
        kd_benches::proc_status_bytes("VmHWM")
            .map_or("unknown".into(), |b| format!("{:.0} MB", b as f64 / 1e6))
    );
    if args.keep_layers.is_none() && llama.is_none() {
        println!(
            "llama.cpp: not run (pass --llama-cpp-bin DIR; fixtures/build-llama-server.sh builds it)"
        );
    }
    Ok(())
}

/// One round of a path: one greedy generation per batch size, then (with `--verify`) four
/// cached passes per pass length.
fn path_round(path: &mut Path, args: &Args, prompts: &[Vec<Vec<u32>>], timed: bool) -> Result<()> {
    for (bi, rows) in prompts.iter().enumerate() {
        let prompts: Vec<SeededPrompt<'_>> = rows
            .iter()
            .map(|ids| SeededPrompt { ids, seed: 0 })
            .collect();
        let mut options = GenerateOptions::greedy(args.new_tokens);
        options.stop_token_ids = vec![u32::MAX]; // no eos: every row decodes n tokens
        let (out, t) = path.model.generate_timed(&prompts, &options)?;
        assert!(out.iter().all(|c| c.ids.len() == args.new_tokens));
        if timed {
            // The steps after the prefill, timed apart from it (a long prompt's pass
            // outweighs many steps, and its variation theirs).
            path.speeds[bi].push(t.decode_tokens_per_s().unwrap_or(f64::NAN));
            path.prefills[bi].push((args.prompt_len * rows.len()) as f64 / t.prefill.as_secs_f64());
        }
    }
    let Some(Verification { cache, base, extra }) = path.verification.as_mut() else {
        return Ok(());
    };
    let options = ForwardOptions::default();
    for (k, n) in std::iter::once(1)
        .chain(args.verify.iter().copied())
        .enumerate()
    {
        let mut times = Vec::new();
        for _ in 0..4 {
            let t = Instant::now();
            let out =
                path.model
                    .forward_cached(&TokenBatch::single(&extra[..n]), cache, &options)?;
            kd_model::generate::to_host(out.into_logits()?);
            times.push(t.elapsed().as_secs_f64());
            cache.truncate(&[*base])?;
        }
        if timed {
            path.passes[k].push(median(times));
        }
    }
    Ok(())
}

/// What the verification passes of a path read: a cache holding their prompt, its length
/// (what each pass rolls back to), and the tokens the passes feed.
struct Verification {
    cache: KvCache,
    base: i64,
    extra: Vec<u32>,
}

impl Verification {
    fn new(model: &Llama, args: &Args) -> Result<Self> {
        let vocab = model.config().vocab_size as u64;
        let mut row =
            kd_benches::random_prompts(1, args.prompt_len + 16, CONTROL_TOKENS, vocab).remove(0);
        let extra = row.split_off(args.prompt_len);
        let mut cache = model.new_cache();
        model.forward_cached(
            &TokenBatch::single(&row),
            &mut cache,
            &ForwardOptions::default(),
        )?;
        let base = cache.real_lengths()[0];
        Ok(Self { cache, base, extra })
    }
}

/// One run of `llama-batched-bench` over every batch size: its `S_TG` and `S_PP`.
fn llama_round(l: &mut LlamaCpp, args: &Args, timed: bool) -> Result<()> {
    let npl: Vec<String> = args.batch.iter().map(usize::to_string).collect();
    let out = Command::new(&l.exe)
        .args(["-m"])
        .arg(&args.model)
        .args(["-t", &args.threads.to_string()])
        .args(["-c", "4096", "-b", "2048", "-ub", "512"])
        .args(["-npp", &args.prompt_len.to_string()])
        .args(["-ntg", &args.new_tokens.to_string()])
        .args(["-npl", &npl.join(",")])
        .args(["--output-format", "jsonl"])
        .output()
        .with_context(|| format!("running {}", l.exe.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            l.exe.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut seen = vec![false; args.batch.len()];
    for line in text.lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let (Some(pl), Some(tg)) = (v["pl"].as_u64(), v["speed_tg"].as_f64()) else {
            continue;
        };
        if let Some(bi) = args.batch.iter().position(|&b| b as u64 == pl) {
            seen[bi] = true;
            if timed {
                l.tg[bi].push(tg);
                l.pp[bi].push(v["speed_pp"].as_f64().unwrap_or(f64::NAN));
            }
        }
    }
    if let Some(bi) = seen.iter().position(|s| !s) {
        bail!(
            "{} printed no result for batch {}",
            l.exe.display(),
            args.batch[bi]
        );
    }
    Ok(())
}

/// The median of `v` with its range, as `m (lo–hi)`, or `mx (lo–hi)` with `unit` "x".
fn spread(v: &[f64], digits: usize, unit: &str) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!(
        "{:.digits$}{unit} ({lo:.digits$}–{hi:.digits$})",
        median(v.to_vec())
    )
}

/// Round by round `a[i] / b[i]`: the median and range of the ratios.
fn paired(a: &[f64], b: &[f64]) -> String {
    let ratios: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
    spread(&ratios, 2, "x")
}

fn report(paths: &[Path], llama: Option<&LlamaCpp>, args: &Args) {
    let rounds = args.repeats;
    for (bi, b) in args.batch.iter().enumerate() {
        for p in paths {
            println!(
                "ours {:>10} batch {b}: {} tokens/s (decode after the prompt; median and range of \
                 {rounds} rounds); prompt {:.1} tokens/s (prefill and the first token)",
                p.label,
                spread(&p.speeds[bi], 1, ""),
                median(p.prefills[bi].clone())
            );
        }
        if let Some(l) = llama {
            println!(
                "llama.cpp  batch {b}: {} tokens/s (S_TG, {} threads); prompt {:.1} tokens/s (S_PP)",
                spread(&l.tg[bi], 1, ""),
                args.threads,
                median(l.pp[bi].clone())
            );
        }
        // Paired within rounds: each path against the first, and against llama.cpp.
        for p in paths.iter().skip(1) {
            println!(
                "  batch {b}, paired by round: {} / {}: {}",
                p.label,
                paths[0].label,
                paired(&p.speeds[bi], &paths[0].speeds[bi])
            );
        }
        if let Some(l) = llama {
            for p in paths.iter().filter(|p| p.label != "f32") {
                println!(
                    "  batch {b}, paired by round: ours {} / llama.cpp: {}",
                    p.label,
                    paired(&p.speeds[bi], &l.tg[bi])
                );
            }
        }
    }
    if args.verify.is_empty() {
        return;
    }
    for p in paths {
        println!(
            "ours {:>10} pass over 1 new token: {} ms",
            p.label,
            spread(&ms(&p.passes[0]), 2, "")
        );
        for (k, n) in args.verify.iter().enumerate() {
            println!(
                "ours {:>10} pass over {n} new tokens: {} ms ({} the 1-token pass, paired by round)",
                p.label,
                spread(&ms(&p.passes[k + 1]), 2, ""),
                paired(&p.passes[k + 1], &p.passes[0])
            );
        }
    }
    for p in paths.iter().skip(1) {
        for (k, n) in std::iter::once(1)
            .chain(args.verify.iter().copied())
            .enumerate()
        {
            println!(
                "  a pass over {n} new token{}, paired by round: time of {} / time of {}: {}",
                if n == 1 { "" } else { "s" },
                p.label,
                paths[0].label,
                paired(&p.passes[k], &paths[0].passes[k])
            );
        }
    }
}

/// Seconds to milliseconds.
fn ms(v: &[f64]) -> Vec<f64> {
    v.iter().map(|s| s * 1e3).collect()
}

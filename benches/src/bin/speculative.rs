//! Speculative decoding on the bench pair: the bench-155m target (`docs/src/benchmarks.md`,
//! random weights, seeded) and a 2-layer draft derived from it (its first and last layers,
//! sharing its embeddings, final norm and LM head). Batch 1 (the latency case speculative
//! decoding is for), greedy, k drafted tokens per verification: wall-clock speedup over
//! plain target decoding at the measured acceptance, beside transformers' assisted
//! generation (`generate(assistant_model=…)`, `benches/speculative_pytorch.py`) on the same
//! weights, which this binary writes to a temporary directory for it.
//!
//! `cargo run --release -p kd-benches --bin speculative -- --python <venv>/bin/python`

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Parser;
use kd_benches::median;
use kd_eval::{SpecConfig, SpecStats, expected_length, speculative_generate};
use kd_model::{
    GenerateOptions, Llama, LlamaConfig, Sampling, SaveDType, SeededPrompt, parse_device,
};

#[derive(Parser, Debug)]
struct Args {
    /// Prompts, decoded one at a time.
    #[arg(long, default_value_t = 4)]
    prompts: usize,
    /// Prompt length.
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// New tokens per prompt.
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Tokens drafted per verification.
    #[arg(long, default_value_t = 4)]
    k: usize,
    /// Sampling temperature (0 = greedy; with sampling the outputs follow the target's
    /// distribution but are not token-for-token those of plain sampling).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Layers of the target the draft keeps.
    #[arg(long, value_delimiter = ',', default_value = "0,7")]
    draft_layers: Vec<usize>,
    /// Timed repetitions (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Python with torch + transformers for the HF column.
    #[arg(long)]
    python: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    kd_benches::print_machine()?;
    kd_train::retain_freed_memory();
    let device = parse_device("cpu")?;
    device.seed(0);
    let config = LlamaConfig::bench_155m();
    let target = Llama::random(&config, &device);
    let dir = tempfile::tempdir()?;
    let (tdir, ddir) = (dir.path().join("target"), dir.path().join("draft"));
    target.save(&tdir, SaveDType::F32)?;
    let draft = Llama::load(&tdir, &device)?.keep_layers(&args.draft_layers)?;
    draft.save(&ddir, SaveDType::F32)?;

    let rows =
        kd_benches::random_prompts(args.prompts, args.prompt_len, 0, config.vocab_size as u64);
    let prompts: Vec<SeededPrompt<'_>> = rows
        .iter()
        .enumerate()
        .map(|(i, ids)| SeededPrompt {
            ids,
            seed: i as u64,
        })
        .collect();
    // No stop token: every prompt generates all its tokens, as the HF runs do.
    let sampling = Sampling::temperature(args.temperature);
    let plain = GenerateOptions {
        stop_token_ids: vec![u32::MAX],
        sampling,
        ..GenerateOptions::greedy(args.new_tokens)
    };
    let spec = SpecConfig {
        k: args.k,
        max_new_tokens: args.new_tokens,
        stop_token_ids: vec![u32::MAX],
        sampling,
        draft_p_min: 0.0,
    };

    let run_plain = |model: &Llama| -> Result<(f64, Vec<Vec<u32>>)> {
        let t = Instant::now();
        let mut out = Vec::new();
        for p in &prompts {
            out.push(
                model
                    .generate(std::slice::from_ref(p), &plain)?
                    .remove(0)
                    .ids,
            );
        }
        Ok((t.elapsed().as_secs_f64(), out))
    };
    let run_spec = || -> Result<(f64, Vec<Vec<u32>>, SpecStats)> {
        let t = Instant::now();
        let mut out = Vec::new();
        let mut stats = SpecStats::default();
        for p in &prompts {
            let r = speculative_generate(&target, &draft, std::slice::from_ref(p), &spec)?;
            stats.merge(&r.stats);
            out.push(r.completions.into_iter().next().expect("one row").ids);
        }
        Ok((t.elapsed().as_secs_f64(), out, stats))
    };
    // Warm-up, then alternate the three so that a loaded moment hits all of them.
    run_plain(&target)?;
    run_spec()?;
    let (mut tp, mut td, mut ts) = (Vec::new(), Vec::new(), Vec::new());
    let mut same = true;
    let mut stats = SpecStats::default();
    for _ in 0..args.repeats {
        let (t, plain_ids) = run_plain(&target)?;
        tp.push(t);
        let (t, spec_ids, s) = run_spec()?;
        ts.push(t);
        same &= plain_ids == spec_ids;
        stats = s;
        td.push(run_plain(&draft)?.0);
    }
    let tokens = (args.prompts * args.new_tokens) as f64;
    let (tp, td, ts) = (median(tp), median(td), median(ts));
    let c = td / tp;
    let alpha = stats.alpha();
    println!(
        "bench pair: target bench-155m (8 layers), draft layers {:?}; batch 1, {} prompts × {} tokens, {} new, k = {}, {}",
        args.draft_layers,
        args.prompts,
        args.prompt_len,
        args.new_tokens,
        args.k,
        if args.temperature == 0.0 {
            "greedy".to_string()
        } else {
            format!("sampling at temperature {}", args.temperature)
        }
    );
    println!(
        "ours:    target alone {:.1} tokens/s, draft alone {:.1} tokens/s (cost ratio c = {c:.3})",
        tokens / tp,
        tokens / td
    );
    println!(
        "ours:    speculative {:.1} tokens/s = {:.2}× the target alone{}",
        tokens / ts,
        tp / ts,
        if sampling.is_greedy() {
            format!("; output equals plain greedy: {same}")
        } else {
            String::new()
        }
    );
    println!(
        "ours:    acceptance {:.1}%, mean accepted length {:.2} (+1 bonus = {:.2}), α {alpha:.3}, top-1 {:.1}%",
        100.0 * stats.acceptance_rate(),
        stats.mean_accepted_length(),
        stats.mean_accepted_length_with_bonus(),
        100.0 * stats.top1_agreement()
    );
    let k = args.k as f64;
    println!(
        "ours:    theoretical speedup at c = {c:.3}: {:.2}× (measured tokens per verification), {:.2}× (from α, i.i.d.)",
        stats.mean_accepted_length_with_bonus() / (k * c + 1.0),
        expected_length(alpha, args.k) / (k * c + 1.0)
    );
    println!(
        "ours:    time per verification: draft {:.1} ms, target {:.1} ms (one forward of k + 1 tokens)",
        1e3 * stats.draft_seconds / stats.verify_steps.max(1) as f64,
        1e3 * stats.verification_pass_seconds()
    );
    if let Some(py) = args.python {
        let status = kd_benches::python_command(py)
            .arg("benches/speculative_pytorch.py")
            .arg("--target")
            .arg(&tdir)
            .arg("--draft")
            .arg(&ddir)
            .args(["--k", &args.k.to_string()])
            .args(["--temperature", &args.temperature.to_string()])
            .args(["--new-tokens", &args.new_tokens.to_string()])
            .args(["--repeats", &args.repeats.to_string()])
            .args([
                "--prompts",
                &rows
                    .iter()
                    .map(|r| r.iter().map(u32::to_string).collect::<Vec<_>>().join(","))
                    .collect::<Vec<_>>()
                    .join(";"),
            ])
            .status()?;
        if !status.success() {
            bail!("the PyTorch script failed");
        }
    }
    Ok(())
}

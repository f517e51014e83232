//! An EAGLE-3 draft for a real target, end to end, measured by wall clock: the target writes
//! completions of the training prompts, a fresh one-layer EAGLE-3 draft learns them with TTT,
//! and greedy decoding of the held-out prompts runs with the target alone and with the draft,
//! one prompt at a time (`--batch N`: N at a time), in the same process; outputs are checked
//! equal. `--draft DIR` measures a trained draft instead (a pipeline checkpoint); `--k 1,2,4
//! --draft-p-min 0,0.5` measures every combination, each prompt decoded by the target alone and
//! by every combination in turn (so that the machine's drift falls on all of them alike).
//!
//! ```text
//! fixtures/fetch-smollm2.sh
//! cargo run --release -p kd-examples --example eagle3_study -- \
//!     --target fixtures/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out target/eagle3-smollm2
//! ```
//!
//! The target's completions are kept in `OUT/completions.json` and reused by a rerun.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use kd_data::{ChatTokenizer, Example};
use kd_model::{
    Eagle3Config, Eagle3Draft, GenerateOptions, Llama, Sampling, SeededPrompt, parse_device,
};
use kd_speculator::SpeculatorConfig;
use kd_speculator::eagle3::{
    Eagle3Loss, Eagle3Model, TargetCache, TargetRowsManifest, default_feature_layers,
    draft_vocab_from_examples,
};
use kd_train::{LogRecord, TrainConfig, TrainMode, TrainObserver, Trainer};

#[derive(Parser, Debug)]
struct Args {
    /// The target: a Hugging Face directory or a .gguf file.
    #[arg(long)]
    target: PathBuf,
    /// OpenAI batch prompts (`*/batch_input.jsonl`).
    #[arg(long, default_value = "fixtures/demo/data")]
    data_dir: PathBuf,
    /// Output directory (completions, checkpoints, training log).
    #[arg(long)]
    out: PathBuf,
    /// Tokens the target writes per training prompt, and per held-out prompt when measuring.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Training epochs.
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// TTT steps.
    #[arg(long, default_value_t = 7)]
    ttt_length: usize,
    /// Draft vocabulary size.
    #[arg(long, default_value_t = 8192)]
    draft_vocab_size: usize,
    /// MiB kept of the target's outputs per training row, so that epochs after the first skip
    /// the target (0: the target runs on every micro-batch).
    #[arg(long, default_value_t = SpeculatorConfig::default().target_cache_mb)]
    target_cache_mb: usize,
    /// Also keep the target's outputs per training row on disk in DIR, and read them back
    /// there in later runs (the speculator's `--target_cache_dir`): a rerun with other
    /// training settings skips the target.
    #[arg(long, value_name = "DIR")]
    target_cache_dir: Option<PathBuf>,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    learning_rate: f64,
    /// Tokens drafted per verification; several (`1,2,4`) measure each.
    #[arg(long, value_delimiter = ',', default_value = "4")]
    k: Vec<usize>,
    /// Use at most this many training prompts.
    #[arg(long)]
    max_train_prompts: Option<usize>,
    /// Held-out prompts at most, as the pipeline's `--eval_max_prompts` (give the value of
    /// the run that trained `--draft`, so that the held-out prompts are the ones it held out).
    #[arg(long, default_value_t = 200)]
    eval_max_prompts: usize,
    /// Seed.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Measure this trained draft (a directory `OUT/draft` of an earlier run) instead of
    /// training one.
    #[arg(long)]
    draft: Option<PathBuf>,
    /// Decode with 8-bit activations against the GGUF blocks (integer dot products, as
    /// llama.cpp computes: `Llama::with_int8_activations`), for the target alone and with
    /// the draft alike.
    #[arg(long)]
    int8: bool,
    /// `--int8` with the target's Q4_1 and Q8_0 products on AMX tiles
    /// (`Llama::with_amx_tiles`; CPUs with AMX-INT8 only).
    #[arg(long)]
    amx: bool,
    /// Stop drafting at the first draft whose probability under the draft is below this
    /// (llama.cpp's --draft-p-min; 0 always drafts k); several (`0,0.5`) measure each, for
    /// every k.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    draft_p_min: Vec<f32>,
    /// Decode the draft from Q8_0 blocks of its weights (`Eagle3Draft::with_q8_0_weights`).
    #[arg(long)]
    draft_q8_0: bool,
    /// Run the draft's decoding passes on Burn's tensor operations instead of the host
    /// (`Eagle3Draft::with_host_decoding(false)`), to compare the two.
    #[arg(long)]
    draft_burn_ops: bool,
    /// Held-out prompts decoded together (the target alone and every arm alike); tokens/s is
    /// over all rows of a batch.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Decode the held-out prompts this many times over (every arm each time, interleaved as
    /// in one pass) and print each arm's speedup per repeat with their median: on a host whose
    /// clock drifts, one pass's speedup is one sample. Counts and τ are the first repeat's
    /// (greedy decoding repeats them exactly); tokens/s is over all repeats.
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// Sampled completions per training prompt, beside the greedy one: more training rows in
    /// the target's own distribution without more prompts (kept in
    /// `OUT/sampled-{N}-t{T}.json`; 0: the greedy completions only).
    #[arg(long, default_value_t = 0)]
    sampled_completions: usize,
    /// Temperature of `--sampled-completions`.
    #[arg(long, default_value_t = 1.0)]
    sample_temperature: f32,
    /// Write the held-out prompts (chat-templated token ids, and their records' ids), the
    /// tokens to generate and the stop ids to this JSON file and stop: the input of
    /// fixtures/check_llamacpp_eagle3.py, which measures the same prompts with llama.cpp, and
    /// of fixtures/exclude_held_out.py.
    #[arg(long)]
    write_held_out: Option<PathBuf>,
}

struct Print;

impl TrainObserver for Print {
    fn on_log(&mut self, r: &LogRecord) {
        // The first draft's accuracy on the training batches (the trainer's `ttt_step0_acc`).
        let acc = r
            .terms
            .iter()
            .find(|(name, _)| name == "ttt_step0_acc")
            .map_or(f64::NAN, |(_, v)| *v);
        println!(
            "  step {:>4}  loss {:.4}  first-draft accuracy {:.1}%  lr {:.2e}  tokens/s {:.0}",
            r.step,
            r.loss,
            100.0 * acc,
            r.learning_rate,
            r.tokens_per_second
        );
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = parse_device("cpu")?;
    device.seed(args.seed);
    std::fs::create_dir_all(&args.out)?;
    let int8 = args.int8 || args.amx;
    let target = Llama::load_for_inference(&args.target, &device)?
        .with_int8_activations(int8)
        .with_amx_tiles(args.amx);
    anyhow::ensure!(
        !args.amx || target.amx_tiles(),
        "--amx: this CPU (or KD_SIMD) offers no AMX-INT8 tiles, or the target no Q4_1/Q8_0 blocks"
    );
    let tc = target.config().clone();
    // A model directory or a .gguf file alike.
    let tokenizer = ChatTokenizer::from_dir(&args.target)?;
    let config = SpeculatorConfig {
        data_dir: args.data_dir.clone(),
        seed: args.seed,
        eval_max_prompts: args.eval_max_prompts,
        ..SpeculatorConfig::default()
    };
    let limit = kd_speculator::phases::prompt_limit(
        Some(config.max_seq_length),
        &[("target", tc.max_position_embeddings)],
    );
    let prompts = kd_speculator::phases::load_prompts(&config, &tokenizer, limit)?;
    if let Some(w) = prompts.too_long.warning() {
        println!("warning: {w}");
    }
    let mut train = prompts.train_prompts();
    if let Some(n) = args.max_train_prompts {
        train.truncate(n);
    }
    let held_out = prompts.eval_ids();
    let stop = tc.eos_token_ids.clone();
    println!(
        "target {} ({} layers, width {}, vocabulary {}); {} training prompts, {} held out",
        args.target.display(),
        tc.num_hidden_layers,
        tc.hidden_size,
        tc.vocab_size,
        train.len(),
        held_out.len()
    );

    if let Some(path) = &args.write_held_out {
        let json = serde_json::json!({
            "target": args.target,
            "max_new_tokens": args.max_new_tokens,
            "stop_token_ids": tc.eos_token_ids,
            "prompts": held_out,
            // Their records' ids (`custom_id`, else `file:line`), in the same order.
            "record_ids": prompts.eval.iter().map(|&i| &prompts.records[i].id).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!(
            "wrote {} held-out prompts to {}",
            held_out.len(),
            path.display()
        );
        return Ok(());
    }
    let layers = default_feature_layers(tc.num_hidden_layers);
    let draft = match &args.draft {
        Some(dir) => Eagle3Draft::load(dir, Some(target.embed_tokens.weight.val()), &device)?,
        None => train_draft(&args, &target, &train, layers)?,
    }
    .with_q8_0_weights(args.draft_q8_0)
    .with_host_decoding(!args.draft_burn_ops);

    // 3. Greedy decoding of the held-out prompts, one at a time, interleaved: for each prompt
    //    the target alone, then the draft at each k and draft_p_min, so that the machine's
    //    drift over the run falls on every arm alike.
    let drafter = kd_eval::Eagle3Drafter::new(&draft, layers);
    let mut specs = Vec::new();
    for &k in &args.k {
        for &draft_p_min in &args.draft_p_min {
            specs.push(kd_eval::SpecConfig {
                k,
                max_new_tokens: args.max_new_tokens,
                sampling: kd_model::Sampling::GREEDY,
                stop_token_ids: stop.clone(),
                draft_p_min,
            });
        }
    }
    let mut options = GenerateOptions::greedy(args.max_new_tokens);
    options.stop_token_ids = stop.clone();
    let mut plain_steps = 0usize;
    let mut first_token = options.clone();
    first_token.max_new_tokens = 1;
    // Per arm: counts, rows equal to the target alone, and each batch's counts for τ's
    // confidence interval (all of the first repeat, which greedy decoding repeats exactly).
    type Arm = (kd_eval::SpecStats, usize, Vec<kd_eval::SpecStats>);
    let mut arms: Vec<Arm> = vec![(kd_eval::SpecStats::default(), 0, Vec::new()); specs.len()];
    anyhow::ensure!(
        args.batch > 0,
        "--batch 0: decode at least one prompt at a time"
    );
    anyhow::ensure!(
        args.repeats > 0,
        "--repeats 0: decode the prompts at least once"
    );
    let mut repeats: Vec<Repeat> = Vec::with_capacity(args.repeats);
    for repeat in 0..args.repeats {
        let mut this = Repeat {
            arms: vec![Decoded::default(); specs.len()],
            ..Repeat::default()
        };
        for (b, chunk) in held_out.chunks(args.batch).enumerate() {
            let prompts: Vec<SeededPrompt<'_>> = chunk
                .iter()
                .enumerate()
                .map(|(j, p)| SeededPrompt {
                    ids: p,
                    seed: (b * args.batch + j) as u64,
                })
                .collect();
            let started = Instant::now();
            target.generate(&prompts, &first_token)?;
            this.prefill_seconds += started.elapsed().as_secs_f64();
            let started = Instant::now();
            let plain: Vec<Vec<u32>> = target
                .generate(&prompts, &options)?
                .into_iter()
                .map(|c| c.ids)
                .collect();
            this.plain.seconds += started.elapsed().as_secs_f64();
            this.plain.tokens += plain.iter().map(Vec::len).sum::<usize>();
            // A batch decodes until its longest row ends.
            plain_steps += plain.iter().map(Vec::len).max().unwrap_or(0);
            for ((spec, arm), decoded) in specs.iter().zip(&mut arms).zip(&mut this.arms) {
                let started = Instant::now();
                let out = kd_eval::speculative_generate(&target, &drafter, &prompts, spec)?;
                decoded.seconds += started.elapsed().as_secs_f64();
                for (j, (c, plain)) in out.completions.iter().zip(&plain).enumerate() {
                    decoded.tokens += c.ids.len();
                    // With f32 activations every row must equal the target alone's; with 8-bit
                    // ones too while a verification pass holds at most 16 tokens per row (each
                    // row then has one-token passes' bits), but a longer pass may round
                    // differently, so they are counted.
                    anyhow::ensure!(
                        int8 || c.ids == *plain,
                        "k {}, draft_p_min {}: prompt {} differs from the target alone",
                        spec.k,
                        spec.draft_p_min,
                        b * args.batch + j
                    );
                    if repeat == 0 {
                        arm.1 += usize::from(c.ids == *plain);
                    }
                }
                if repeat == 0 {
                    arm.0.merge(&out.stats);
                    arm.2.push(out.stats);
                }
            }
        }
        repeats.push(this);
    }
    // Every repeat together.
    let all = Repeat::total(&repeats);
    let prefill_seconds = all.prefill_seconds;
    let Decoded {
        seconds: plain_seconds,
        tokens: plain_tokens,
    } = all.plain;
    let plain_rate = plain_tokens as f64 / plain_seconds;
    println!(
        "held-out prompts: {}, batch {}, greedy, each batch decoded by every arm in turn; target \
         alone {plain_rate:.1} tokens/s ({plain_tokens} tokens in {plain_seconds:.1} s, \
         {plain_steps} steps: a batch's longest row)",
        held_out.len(),
        args.batch
    );
    // Decoding after the prefill and the first token, which every arm shares.
    let rows_total = held_out.len() * args.repeats;
    println!(
        "prefill and first token alone: {prefill_seconds:.1} s ({:.0}% of the target alone's \
         time); after them the target alone decodes {:.1} tokens/s",
        100.0 * prefill_seconds / plain_seconds,
        all.decode_rate(all.plain, rows_total)
    );
    let rows: Vec<_> = specs
        .iter()
        .zip(arms)
        .enumerate()
        .map(|(i, (spec, (stats, equal, batches)))| {
            let arm = all.arms[i];
            (
                spec.k,
                spec.draft_p_min,
                arm.tokens as f64 / arm.seconds,
                stats,
                equal,
                // The first repeat's seconds, which its counts describe.
                repeats[0].arms[i].seconds,
                all.decode_rate(arm, rows_total) / all.decode_rate(all.plain, rows_total),
                kd_eval::acceptance_intervals(&batches, spec.k).1,
            )
        })
        .collect();
    let batches = held_out.len().div_ceil(args.batch) * args.repeats;
    // A decode step of the target alone after the prefill and the first token.
    let decode_step =
        (plain_seconds - prefill_seconds) / plain_steps.saturating_sub(batches).max(1) as f64;
    println!(
        "| k | draft_p_min | tokens/s | speedup | τ (95% CI over the batches) | drafted per round | per position | \
         verification pass (× a decode step) | draft per round | passes | time in passes, draft \
         | speedup after the prefill | target's token in the draft's top 1 / 2 / 4 / 8 | rows \
         equal to the target alone |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    // Verification passes over a batch (a row's round is `verify_steps`).
    let batch_rounds =
        |s: &kd_eval::SpecStats| s.target_forwards.saturating_sub(s.prefill_forwards).max(1) as f64;
    for (k, p_min, rate, s, equal, seconds, decode_speedup, tau_ci) in rows {
        let tau_ci = tau_ci
            .map(|i| format!(" ({:.2}–{:.2})", i.low, i.high))
            .unwrap_or_default();
        let rounds = s.verify_steps.max(1) as f64;
        let pass = s.verification_pass_seconds();
        let positions: Vec<String> = s
            .per_position_acceptance()
            .iter()
            .map(|a| format!("{:.0}%", 100.0 * a))
            .collect();
        println!(
            "| {k} | {p_min} | {rate:.1} | {:.2}× | {:.2}{tau_ci} | {:.2} | {} | {:.1} ms ({:.2}×) | {:.1} ms | {} | {:.0}%, {:.0}% | {decode_speedup:.2}× | {} | {equal}/{} |",
            rate / plain_rate,
            s.mean_accepted_length_with_bonus(),
            s.drafted as f64 / rounds,
            positions.join(" "),
            1e3 * pass,
            pass / decode_step,
            1e3 * s.draft_seconds / batch_rounds(&s),
            s.target_forwards,
            100.0 * s.target_seconds / seconds,
            100.0 * s.draft_seconds / seconds,
            [1, 2, 4, 8]
                .map(|m| format!("{:.0}%", 100.0 * s.top_m_agreement(m)))
                .join(" / "),
            held_out.len(),
        );
    }
    if args.repeats > 1 {
        // Each repeat's speedup after the prefill (the table's last speedup, per repeat).
        let rows = held_out.len();
        for (i, spec) in specs.iter().enumerate() {
            let mut speedups: Vec<f64> = repeats
                .iter()
                .map(|r| r.decode_rate(r.arms[i], rows) / r.decode_rate(r.plain, rows))
                .collect();
            let each: Vec<String> = speedups.iter().map(|x| format!("{x:.2}")).collect();
            speedups.sort_by(f64::total_cmp);
            let n = speedups.len();
            let median = if n % 2 == 1 {
                speedups[n / 2]
            } else {
                0.5 * (speedups[n / 2 - 1] + speedups[n / 2])
            };
            println!(
                "k {}, draft_p_min {}: speedup after the prefill per repeat {} — median {median:.2}× \
                 (range {:.2}–{:.2}×, {n} repeats)",
                spec.k,
                spec.draft_p_min,
                each.join(" "),
                speedups[0],
                speedups[n - 1],
            );
        }
    }
    Ok(())
}

/// Seconds and tokens of decoding.
#[derive(Clone, Copy, Default)]
struct Decoded {
    seconds: f64,
    tokens: usize,
}

/// One decoding of the held-out prompts: the prompts' prefill and first token alone (timed
/// apart: every arm pays it once per batch, and llama.cpp's tokens/s leaves it out), the
/// target alone, and each arm.
#[derive(Default)]
struct Repeat {
    prefill_seconds: f64,
    plain: Decoded,
    arms: Vec<Decoded>,
}

impl Repeat {
    /// The repeats' seconds and tokens added up.
    fn total(repeats: &[Repeat]) -> Repeat {
        let add = |a: Decoded, d: Decoded| Decoded {
            seconds: a.seconds + d.seconds,
            tokens: a.tokens + d.tokens,
        };
        repeats.iter().fold(Repeat::default(), |mut all, r| {
            all.prefill_seconds += r.prefill_seconds;
            all.plain = add(all.plain, r.plain);
            all.arms.resize(r.arms.len(), Decoded::default());
            for (a, d) in all.arms.iter_mut().zip(&r.arms) {
                *a = add(*a, *d);
            }
            all
        })
    }

    /// Tokens/s of `d` after this repeat's prefill and first tokens (`rows` prompts).
    fn decode_rate(&self, d: Decoded, rows: usize) -> f64 {
        d.tokens.saturating_sub(rows) as f64 / (d.seconds - self.prefill_seconds).max(1e-9)
    }
}

/// The target's completions of the training prompts (kept in `OUT/completions.json`), then a
/// fresh draft trained on them with TTT (saved to `OUT/draft`).
fn train_draft(
    args: &Args,
    target: &Llama,
    train: &[kd_teacher::Prompt],
    layers: [usize; 3],
) -> Result<Eagle3Draft> {
    let tc = target.config();
    let device = target.embed_tokens.weight.val().device();
    let stop = tc.eos_token_ids.clone();
    // 1. The target's completions of the training prompts (kept for reruns).
    let generate = |file: &str, sampling: Sampling, copy: u64| -> Result<Vec<Vec<u32>>> {
        let cache = args.out.join(file);
        if let Ok(text) = std::fs::read_to_string(&cache) {
            return serde_json::from_str(&text).with_context(|| file.to_string());
        }
        let started = Instant::now();
        let mut all = Vec::with_capacity(train.len());
        let mut options = GenerateOptions::greedy(args.max_new_tokens);
        options.sampling = sampling;
        options.stop_token_ids = stop.clone();
        for chunk in train.chunks(32) {
            let seeded: Vec<SeededPrompt<'_>> = chunk
                .iter()
                .map(|p| SeededPrompt {
                    ids: &p.ids,
                    seed: (p.index << 20) + copy,
                })
                .collect();
            for c in target.generate(&seeded, &options)? {
                all.push(c.ids);
            }
        }
        let tokens: usize = all.iter().map(Vec::len).sum();
        println!(
            "generated {tokens} tokens ({file}) in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        kd_model::weights::write_atomic(&cache, serde_json::to_string(&all)?.as_bytes())?;
        Ok(all)
    };
    let mut sets = vec![generate("completions.json", Sampling::GREEDY, 0)?];
    for copy in 1..=args.sampled_completions as u64 {
        let file = format!("sampled-t{}-{copy}.json", args.sample_temperature);
        sets.push(generate(
            &file,
            Sampling::temperature(args.sample_temperature),
            copy,
        )?);
    }
    let examples: Vec<Example> = sets
        .iter()
        .enumerate()
        .flat_map(|(copy, set)| train.iter().zip(set).map(move |(p, c)| (copy, p, c)))
        .filter(|(_, _, c)| !c.is_empty())
        .map(|(copy, p, c)| {
            let mut ids = p.ids.clone();
            ids.extend(c);
            let mut labels = vec![-100i64; p.ids.len()];
            labels.extend(c.iter().map(|&t| t as i64));
            Example {
                id: if copy == 0 {
                    format!("prompt-{}", p.index)
                } else {
                    format!("prompt-{}-sample-{copy}", p.index)
                },
                input_ids: ids,
                labels,
                prompt_len: p.ids.len(),
            }
        })
        .collect();

    // 2. A fresh EAGLE-3 draft, trained with TTT.
    let vocab = draft_vocab_from_examples(&examples, tc.vocab_size, args.draft_vocab_size)?;
    let draft = Eagle3Draft::new(
        Eagle3Config::for_target(tc, vocab.len())?,
        vocab,
        target.embed_tokens.weight.val(),
        args.seed,
        &device,
    )?;
    let mut cache = TargetCache::new(args.target_cache_mb.saturating_mul(1 << 20));
    if let Some(dir) = &args.target_cache_dir {
        let fingerprint = kd_teacher::model_fingerprint(&args.target)?;
        cache = cache.with_dir(dir, &TargetRowsManifest::new(fingerprint, layers, tc))?;
    }
    let loss = Eagle3Loss {
        target,
        layers,
        ttt_length: args.ttt_length,
        cache,
    };
    let train_config = TrainConfig {
        output_dir: args.out.join("train"),
        mode: TrainMode::Full,
        num_epochs: args.epochs,
        learning_rate: args.learning_rate,
        train_batch_size: 8,
        gradient_accumulation_steps: 1,
        logging_steps: 10,
        save_steps: 0,
        seed: args.seed,
        ..TrainConfig::default()
    };
    println!(
        "training: features of layers {layers:?}, draft vocabulary {}, TTT {} steps, {} epochs",
        draft.config().draft_vocab_size,
        args.ttt_length,
        args.epochs
    );
    let started = Instant::now();
    let (trained, summary) = Trainer::new(train_config, &loss)
        .observer(&mut Print)
        .run(Eagle3Model { draft }, &examples)?;
    let kept = loss.cache.stats();
    println!(
        "trained {} steps in {:.1} s (the target ran on {} rows, {} read back; {} rows kept, \
         {:.0} MB)",
        summary.global_step,
        started.elapsed().as_secs_f64(),
        kept.misses,
        kept.hits,
        kept.rows,
        kept.bytes as f64 / 1e6
    );
    trained.draft.save(args.out.join("draft"))?;
    Ok(trained.draft)
}

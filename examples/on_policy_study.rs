//! On-policy distillation against off-policy training, measured as a speculator: four arms
//! trained on the same prompts for the same steps (the same rows per step, the same
//! `max_new_tokens` for the target's and the draft's completions), from the same seed:
//!
//! - (a) cross-entropy on the target's generations (the seed's default);
//! - (b) (a) + KD on the target's top-k at those positions;
//! - (c) (b) with half of every step's rows completed by the draft itself, scored by the
//!   target (λ = 0.5);
//! - (d) only such rows (λ = 1).
//!
//! Every draft-written row is cut to the length of the target-written row it replaces
//! (`on_policy_match_length`), so the target supervises at most as many tokens in (c) and (d)
//! as in (a) and (b).
//!
//! Each arm's draft is measured before and after training by real speculative decoding on
//! the held-out prompts (k from the configuration, 4 in the bundled ones), greedy and sampling
//! at temperature 1. The arms share one teacher cache, so the target generates and scores
//! the training set once.
//!
//! ```text
//! cargo run --release -p kd-examples --example on_policy_study -- --pair demo
//! fixtures/fetch-smollm2.sh
//! cargo run --release -p speculator -- derive-draft \
//!     --from fixtures/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --keep 6 --out target/smollm2-draft6
//! cargo run --release -p kd-examples --example on_policy_study -- --pair smollm2
//! ```
//!
//! The table is printed and written to `OUT/study.md` (with `OUT/study.json`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kd_eval::{AcceptanceReport, evaluate};
use kd_model::{Llama, Sampling};
use kd_speculator::{
    Quiet, SpeculatorConfig, SpeculatorSummary, files::ACCEPTANCE_FILE, phases::eval_options,
    phases::setup, run,
};
use serde_json::{Value, json};

/// The study's command line.
#[derive(Parser, Debug)]
struct Args {
    /// The pair: `demo` (fixtures/demo) or `smollm2`; its configuration is
    /// examples/speculator/PAIR.yaml.
    #[arg(long, default_value = "demo")]
    pair: String,
    /// Where the arms go [default: target/on-policy-study/PAIR].
    #[arg(long)]
    out: Option<PathBuf>,
    /// The arms to run, of a, b, c, d.
    #[arg(long, default_value = "a,b,c,d", value_delimiter = ',')]
    arms: Vec<String>,
    /// The KD objective of arms b–d.
    #[arg(long, default_value = "tv_distance")]
    objective: String,
    /// Extra settings for every arm, `key=value` (YAML values, the speculator's flag names).
    #[arg(long = "set")]
    set: Vec<String>,
}

/// One arm: its name, what it trains with, and the settings that make it so.
struct Arm {
    name: &'static str,
    what: &'static str,
    kd_weight: f64,
    ratio: f64,
}

const ARMS: [Arm; 4] = [
    Arm {
        name: "a",
        what: "CE on the target's generations",
        kd_weight: 0.0,
        ratio: 0.0,
    },
    Arm {
        name: "b",
        what: "+ KD on the target's top-k",
        kd_weight: 1.0,
        ratio: 0.0,
    },
    Arm {
        name: "c",
        what: "+ on-policy rows, λ = 0.5",
        kd_weight: 1.0,
        ratio: 0.5,
    },
    Arm {
        name: "d",
        what: "on-policy rows only, λ = 1",
        kd_weight: 1.0,
        ratio: 1.0,
    },
];

/// What an arm measured.
struct Outcome {
    summary: SpeculatorSummary,
    sampled_before: AcceptanceReport,
    sampled_after: AcceptanceReport,
    seconds: f64,
    seed: u64,
}

fn overrides(args: &Args, arm: &Arm, out: &Path) -> Result<serde_json::Map<String, Value>> {
    let mut m = serde_json::Map::new();
    m.insert(
        "output_dir".into(),
        json!(out.join(format!("arm-{}", arm.name))),
    );
    m.insert("teacher_cache_dir".into(), json!(out.join("teacher_cache")));
    m.insert("overwrite_output_dir".into(), json!(false));
    m.insert("eval_temperature".into(), json!(0.0));
    m.insert("kd_weight".into(), json!(arm.kd_weight));
    m.insert("on_policy_ratio".into(), json!(arm.ratio));
    m.insert("kd_objective".into(), json!(args.objective));
    // KD and the draft's sampling at temperature 1: the distribution speculative sampling at
    // T = 1 accepts from.
    m.insert("temperature".into(), json!(1.0));
    m.insert("on_policy_temperature".into(), json!(1.0));
    // Equal teacher tokens: an on-policy row has at most the label tokens of the row it
    // replaces.
    m.insert("on_policy_match_length".into(), json!(true));
    for s in &args.set {
        let (k, v) = s
            .split_once('=')
            .with_context(|| format!("--set {s}: expected key=value"))?;
        let v: Value = serde_yaml::from_str(v).unwrap_or(Value::String(v.into()));
        m.insert(k.trim().into(), v);
    }
    Ok(m)
}

/// Acceptance of `draft` against `target` on the held-out prompts `eval_ids` at temperature 1.
fn sampled(
    config: &SpeculatorConfig,
    eval_ids: &[Vec<u32>],
    target: &Llama,
    draft: &Llama,
) -> Result<AcceptanceReport> {
    let mut options = eval_options(config);
    options.spec.sampling = Sampling::temperature(1.0);
    Ok(evaluate(target, draft, eval_ids, &options, |_, _, _| {})?)
}

fn run_arm(
    args: &Args,
    arm: &Arm,
    out: &Path,
    sampled_before: &mut Option<AcceptanceReport>,
) -> Result<Outcome> {
    let yaml = PathBuf::from(format!("examples/speculator/{}.yaml", args.pair));
    let config = SpeculatorConfig::layered(Some(&yaml), overrides(args, arm, out)?)?;
    let dir = &config.output_dir;
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir)?;
    // The draft before training is the same in every arm: the first arm's measurement is
    // reused (the pipeline checks that its settings and prompts match).
    let first = out
        .join(format!("arm-{}", ARMS[0].name))
        .join(ACCEPTANCE_FILE);
    if first.exists() && arm.name != ARMS[0].name {
        std::fs::copy(&first, dir.join(ACCEPTANCE_FILE))?;
    }
    eprintln!("arm ({}) {}: training", arm.name, arm.what);
    let started = Instant::now();
    let summary = run(&config, &mut Quiet)?;
    let seconds = started.elapsed().as_secs_f64();
    // The run's prompts and devices (its output directory now holds its checkpoints).
    let config = SpeculatorConfig {
        overwrite_output_dir: true,
        ..config
    };
    let s = setup(&config)?;
    let eval_ids = s.prompts.eval_ids();
    let target = Llama::load_for_inference(&config.target_model, &s.target_devices[0])?;
    let base = Llama::load(&config.draft_model, &s.draft_device)?;
    let before = match sampled_before {
        Some(b) => b.clone(),
        None => {
            eprintln!("arm ({}): acceptance at T = 1 before training", arm.name);
            let b = sampled(&config, &eval_ids, &target, &base)?;
            *sampled_before = Some(b.clone());
            b
        }
    };
    let last = summary
        .train
        .checkpoints
        .last()
        .context("the run wrote no checkpoint")?;
    let trained = base.load_adapter(last)?.0.merge_and_unload();
    eprintln!("arm ({}): acceptance at T = 1 after training", arm.name);
    let after = sampled(&config, &eval_ids, &target, &trained)?;
    Ok(Outcome {
        summary,
        sampled_before: before,
        sampled_after: after,
        seconds,
        seed: config.seed,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !["demo", "smollm2"].contains(&args.pair.as_str()) {
        bail!("--pair {}: expected demo or smollm2", args.pair);
    }
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("target/on-policy-study/{}", args.pair)));
    std::fs::create_dir_all(&out)?;
    let mut sampled_before = None;
    let mut rows = Vec::new();
    let mut records = Vec::new();
    let mut seed = None;
    for arm in ARMS
        .iter()
        .filter(|a| args.arms.iter().any(|n| n == a.name))
    {
        let o = run_arm(&args, arm, &out, &mut sampled_before)?;
        seed = Some(o.seed);
        let acc = o
            .summary
            .acceptance
            .as_ref()
            .context("acceptance was not measured")?;
        let (gb, ga) = (
            acc.before.as_ref().context("no acceptance before")?,
            acc.after.as_ref().context("no acceptance after")?,
        );
        let t = &o.summary.train;
        let (drafted, sampling_s, scoring_s) =
            o.summary.on_policy.as_ref().map_or((0, 0.0, 0.0), |p| {
                (p.generated_tokens, p.generation_seconds, p.scoring_seconds)
            });
        let per_k = (t.step_seconds - sampling_s) / t.label_tokens.max(1) as f64 * 1000.0;
        let row = format!(
            "| ({}) {} | {:.2} → {:.2} | {:.1}% → {:.1}% | {:.2} → {:.2} | {:.1}% → {:.1}% | {} + {} | {:.0} s | {:.0} s / {:.0} s | {:.2} s | {:.0} s |",
            arm.name,
            arm.what,
            gb.mean_accepted_length,
            ga.mean_accepted_length,
            100.0 * gb.acceptance_rate,
            100.0 * ga.acceptance_rate,
            o.sampled_before.mean_accepted_length,
            o.sampled_after.mean_accepted_length,
            100.0 * o.sampled_before.acceptance_rate,
            100.0 * o.sampled_after.acceptance_rate,
            t.label_tokens - drafted,
            drafted,
            t.step_seconds,
            sampling_s,
            scoring_s,
            per_k,
            o.seconds,
        );
        eprintln!("{row}");
        rows.push(row);
        records.push(json!({
            "arm": arm.name,
            "what": arm.what,
            "kd_weight": arm.kd_weight,
            "on_policy_ratio": arm.ratio,
            "greedy": {"before": gb, "after": ga},
            "sampled_t1": {"before": o.sampled_before, "after": o.sampled_after},
            "label_tokens": t.label_tokens,
            "draft_written_label_tokens": drafted,
            "step_seconds": t.step_seconds,
            "on_policy": o.summary.on_policy.as_ref().map(|p| json!({
                "rows": p.rows,
                "generated_tokens": p.generated_tokens,
                "generation_seconds": p.generation_seconds,
                "scored_tokens": p.scored_tokens,
                "scoring_seconds": p.scoring_seconds,
            })),
            "phase_seconds": o.summary.phase_seconds.iter()
                .map(|(p, s)| json!([p.name(), s])).collect::<Vec<_>>(),
            "wall_seconds": o.seconds,
        }));
    }
    let k = records
        .first()
        .and_then(|r| r["greedy"]["after"]["k"].as_u64())
        .unwrap_or(0);
    let table = format!(
        "Pair `{}`, KD objective of (b)–(d) `{}`, k = {k}, seed {}, settings of examples/speculator/{}.yaml{}.\n\n\
         | arm | greedy: mean accepted length | greedy: acceptance | T = 1: mean accepted length | T = 1: acceptance | label tokens (target-written + draft-written) | train steps | of which draft sampling / target scoring | step time per 1k label tokens without sampling | arm wall time |\n\
         |---|---|---|---|---|---|---|---|---|---|\n{}\n",
        args.pair,
        args.objective,
        seed.unwrap_or_default(),
        args.pair,
        if args.set.is_empty() {
            String::new()
        } else {
            format!(", with {}", args.set.join(", "))
        },
        rows.join("\n")
    );
    println!("{table}");
    std::fs::write(out.join("study.md"), &table)?;
    std::fs::write(
        out.join("study.json"),
        serde_json::to_string_pretty(&records)?,
    )?;
    eprintln!("written to {}", out.join("study.md").display());
    Ok(())
}

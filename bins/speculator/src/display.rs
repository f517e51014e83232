//! Progress bars (generation: prompts and tokens/s; training: step, loss, lr, tokens/s,
//! ETA; acceptance: prompts) and the final summary.

use std::path::Path;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use kd_eval::{AcceptanceReport, EvalPhase, Interval};
use kd_speculator::{Phase, SpeculatorObserver, SpeculatorSummary, process::StopSignals};
use kd_teacher::CacheProgress;
use kd_train::{LogRecord, TrainObserver};

/// Draws the run on stderr.
pub struct Display {
    bar: Option<ProgressBar>,
    started: Instant,
    tokens: usize,
    phase: Option<Phase>,
    train_start: usize,
    stop: StopSignals,
    stop_said: bool,
}

impl Display {
    /// A display that relays `stop` (SIGTERM/SIGINT) to the run.
    pub fn new(stop: StopSignals) -> Self {
        Self {
            bar: None,
            started: Instant::now(),
            tokens: 0,
            phase: None,
            train_start: 0,
            stop,
            stop_said: false,
        }
    }

    fn bar(&mut self, len: usize, template: &str, prefix: &str) -> &ProgressBar {
        if self.bar.as_ref().is_none_or(|b| b.is_finished()) {
            let bar = ProgressBar::new(len as u64);
            bar.set_style(
                ProgressStyle::with_template(template)
                    .expect("a valid template")
                    .progress_chars("=> "),
            );
            bar.set_prefix(prefix.to_string());
            self.bar = Some(bar);
        }
        self.bar.as_ref().expect("just set")
    }

    /// Ends the current bar.
    pub fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish();
        }
    }

    pub fn eval_progress(&mut self, phase: EvalPhase, done: usize, total: usize) {
        let what = match phase {
            EvalPhase::Speculative => "speculative",
            EvalPhase::Target => "target alone",
            EvalPhase::Draft => "draft alone",
        };
        let bar = self.bar(
            total,
            "{prefix:>12} [{bar:30}] {pos}/{len} prompts {msg}",
            "acceptance",
        );
        if done <= 1 || bar.position() > done as u64 {
            bar.set_position(0);
        }
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        bar.set_message(what.to_string());
    }
}

impl TrainObserver for Display {
    fn on_start(&mut self, start_step: usize, total_steps: usize) {
        self.finish();
        self.train_start = start_step;
        let bar = self.bar(
            total_steps,
            "{prefix:>12} [{bar:30}] {pos}/{len} steps {msg} ETA {eta}",
            "train",
        );
        bar.set_position(start_step as u64);
        bar.reset_eta();
    }

    fn on_step(&mut self, step: usize, _loss: f64) {
        if let Some(b) = &self.bar {
            b.set_position(step as u64);
        }
    }

    fn on_log(&mut self, r: &LogRecord) {
        if let Some(b) = &self.bar {
            b.set_message(format!(
                "loss {:.4} lr {:.2e} {:.0} tok/s",
                r.loss, r.learning_rate, r.tokens_per_second
            ));
        }
    }

    fn on_checkpoint(&mut self, path: &Path) {
        if let Some(b) = &self.bar {
            b.println(format!("  saved {}", path.display()));
        }
    }

    fn stop_requested(&mut self) -> bool {
        let stop = self.stop.requested();
        if stop && !self.stop_said {
            self.stop_said = true;
            let msg = "stop requested: saving, then exiting (a second signal exits at once)";
            match &self.bar {
                Some(b) => b.println(msg),
                None => eprintln!("{msg}"),
            }
        }
        stop
    }

    fn on_skipped_step(&mut self, step: usize) {
        if let Some(b) = &self.bar {
            b.println(format!(
                "  step {step}: non-finite loss or gradient, skipped"
            ));
        }
    }
}

impl SpeculatorObserver for Display {
    fn on_phase(&mut self, phase: Phase) {
        self.finish();
        self.phase = Some(phase);
        self.started = Instant::now();
        self.tokens = 0;
        eprintln!("== {}", phase.name());
    }

    fn on_warning(&mut self, message: &str) {
        match &self.bar {
            Some(b) if !b.is_finished() => b.println(format!("warning: {message}")),
            _ => eprintln!("warning: {message}"),
        }
    }

    fn on_teacher_progress(&mut self, phase: Phase, p: &CacheProgress, total: usize) {
        self.tokens += p.tokens;
        let tps = self.tokens as f64 / self.started.elapsed().as_secs_f64().max(1e-9);
        let what = if phase == Phase::Generate {
            "tokens"
        } else {
            "positions"
        };
        let tokens = self.tokens;
        let bar = self.bar(
            total,
            "{prefix:>12} [{bar:30}] {pos}/{len} prompts {msg} ETA {eta}",
            phase.name(),
        );
        bar.set_position(p.prompts_done as u64);
        bar.set_message(if p.reused {
            format!("{tokens} {what} (cached)")
        } else {
            format!("{tokens} {what}, {tps:.0} {what}/s")
        });
    }

    fn on_eval_progress(&mut self, phase: EvalPhase, done: usize, total: usize) {
        self.eval_progress(phase, done, total);
    }

    fn on_acceptance(&mut self, label: &str, report: &AcceptanceReport) {
        self.finish();
        eprintln!("  {label}: {}", report.summary());
    }
}

/// Prints an acceptance report in full.
pub fn print_report(label: &str, r: &AcceptanceReport) {
    println!(
        "{label}: {} held-out prompts, k = {}, temperature {}",
        r.prompts, r.k, r.temperature
    );
    let ci = |i: Option<Interval>, scale: f64, digits: usize, unit: &str| {
        i.map(|i| {
            format!(
                "; 95% CI {:.digits$}–{:.digits$}{unit}",
                scale * i.low,
                scale * i.high
            )
        })
        .unwrap_or_default()
    };
    println!(
        "  acceptance rate        {:.1}%{}",
        100.0 * r.acceptance_rate,
        ci(r.acceptance_rate_ci95, 100.0, 1, "%")
    );
    println!(
        "  mean accepted length   {:.3} drafted tokens per verification ({:.3} with the target's bonus token{})",
        r.mean_accepted_length,
        r.mean_accepted_length_with_bonus,
        ci(r.mean_accepted_length_with_bonus_ci95, 1.0, 3, "")
    );
    let per: Vec<String> = r
        .per_position_acceptance
        .iter()
        .map(|p| format!("{:.1}%", 100.0 * p))
        .collect();
    println!("  per position           {}", per.join("  "));
    println!(
        "  α = E[Σ min(p, q)]     {:.3} (predicts {:.2} tokens per verification)",
        r.alpha, r.expected_length_from_alpha
    );
    println!("  top-1 agreement        {:.1}%", 100.0 * r.top1_agreement);
    if r.top_m_agreement.len() >= 8 {
        println!(
            "  top-2 / 4 / 8          {:.1}% / {:.1}% / {:.1}% (the target's token among the draft's most probable)",
            100.0 * r.top_m_agreement[1],
            100.0 * r.top_m_agreement[3],
            100.0 * r.top_m_agreement[7]
        );
    }
    println!(
        "  speculative decoding   {:.1} tokens/s ({} tokens in {:.2} s)",
        r.speculative_tokens_per_second, r.tokens, r.speculative_seconds
    );
    if let (Some(t), Some(dt)) = (r.target_tokens_per_second, r.draft_tokens_per_second) {
        println!("  target alone           {t:.1} tokens/s; draft alone {dt:.1} tokens/s");
    }
    if let (Some(m), Some(th), Some(c)) = (r.measured_speedup, r.theoretical_speedup, r.cost_ratio)
    {
        println!(
            "  speedup                {m:.2}× measured here; {th:.2}× theoretical at cost ratio c = {c:.3}"
        );
    }
    if let Some(n) = r.greedy_identical_rows {
        println!(
            "  greedy output          {n}/{} rows identical to the target alone",
            r.prompts
        );
    }
}

/// Prints the end-of-run summary.
pub fn print_summary(s: &SpeculatorSummary) {
    println!();
    println!("speculator: done");
    let (all, train, held) = s.prompts;
    println!("  prompts            {all} ({train} trained on, {held} held out)");
    println!(
        "  generated          {} tokens ({} empty completions)",
        s.generated_tokens, s.empty_completions
    );
    println!(
        "  trained            {} steps, {} label tokens per epoch",
        s.train.global_step, s.trained_tokens_per_epoch
    );
    if let Some(t) = &s.target_rows {
        println!(
            "  target rows        {} kept while generating, {} computed, {} read back from memory, \
             {} from disk ({} written)",
            t.captured, t.misses, t.hits, t.disk_reads, t.disk_writes
        );
    }
    if let Some(o) = &s.on_policy {
        println!(
            "  on-policy          {} rows: the draft sampled {} tokens ({:.1} s, {:.0} tokens/s), \
             the target scored {} ({:.1} s); {:.0}% + {:.0}% of the steps' {:.1} s",
            o.rows,
            o.generated_tokens,
            o.generation_seconds,
            o.generated_tokens as f64 / o.generation_seconds.max(1e-9),
            o.scored_tokens,
            o.scoring_seconds,
            100.0 * o.generation_seconds / s.train.step_seconds.max(1e-9),
            100.0 * o.scoring_seconds / s.train.step_seconds.max(1e-9),
            s.train.step_seconds
        );
    }
    if s.train.ranks > 1 {
        println!(
            "  data-parallel      {} ranks; the all-reduce took {:.1} s of the steps' {:.1} s \
             ({:.1}%)",
            s.train.ranks,
            s.train.reduce_seconds,
            s.train.step_seconds,
            100.0 * s.train.reduce_seconds / s.train.step_seconds.max(1e-9)
        );
    }
    if let Some(r) = &s.last_log {
        let terms: Vec<String> = r.terms.iter().map(|(k, v)| format!("{k} {v:.4}")).collect();
        println!("  final loss         {:.4} ({})", r.loss, terms.join(", "));
    }
    let phases: Vec<String> = s
        .phase_seconds
        .iter()
        .map(|(p, secs)| format!("{} {secs:.1} s", p.name()))
        .collect();
    println!("  wall time          {}", phases.join(", "));
    match &s.acceptance {
        Some(a) => {
            if let Some(b) = &a.before {
                print_report("\nbefore training", b);
            }
            if let Some(x) = &a.after {
                print_report("\nafter training", x);
            }
            if let (Some(b), Some(x)) = (&a.before, &a.after) {
                println!(
                    "\nacceptance before → after: {:.1}% → {:.1}%, mean accepted length {:.2} → {:.2} (k = {})",
                    100.0 * b.acceptance_rate,
                    100.0 * x.acceptance_rate,
                    b.mean_accepted_length,
                    x.mean_accepted_length,
                    x.k
                );
            }
            if let Some(best) = &a.best_checkpoint {
                println!(
                    "best checkpoint by mean accepted length: {}",
                    best.display()
                );
            }
        }
        None => println!("acceptance: not measured"),
    }
    println!("\nwritten to {}:", s.output_dir.display());
    // The checkpoints still there (`--save_total_limit` removed the older step ones).
    for c in s.train.checkpoints.iter().filter(|c| c.is_dir()) {
        println!("  {}", c.display());
    }
    println!("  {}", s.output_dir.join("training_log.txt").display());
    println!("  {} (TensorBoard)", s.output_dir.join("runs").display());
    if let Some(p) = &s.acceptance_path {
        println!("  {}", p.display());
        let chart = p.with_extension("svg");
        if chart.is_file() {
            println!("  {} (acceptance per drafted position)", chart.display());
        }
    }
    for w in &s.warnings {
        println!("warning: {w}");
    }
}

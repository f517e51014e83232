//! Progress bars (teacher scoring, training with loss / lr / tokens/s / ETA) and the final
//! summary.

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use kd_distill::{DistillObserver, DistillPhase, DistillSummary, Validation, process::StopSignals};
use kd_train::{LogRecord, TrainObserver};

/// Draws the run on stderr.
pub struct Display {
    bar: Option<ProgressBar>,
    started: Instant,
    last_val: Option<Validation>,
    stop: StopSignals,
    stop_said: bool,
}

impl Display {
    /// A display that relays `stop` (SIGTERM/SIGINT) to the run.
    pub fn new(stop: StopSignals) -> Self {
        Self {
            bar: None,
            started: Instant::now(),
            last_val: None,
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

    fn println(&self, line: &str) {
        match &self.bar {
            Some(b) if !b.is_finished() && !b.is_hidden() => b.println(line),
            _ => eprintln!("{line}"),
        }
    }
}

impl TrainObserver for Display {
    fn on_start(&mut self, start_step: usize, total_steps: usize) {
        self.finish();
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
        let kd = r
            .terms
            .iter()
            .find(|(k, _)| k == "train_distill_loss")
            .map(|(_, v)| format!(" kd {v:.4}"))
            .unwrap_or_default();
        let val = self
            .last_val
            .map(|v| format!(" | val {:.4}", v.val_loss))
            .unwrap_or_default();
        if let Some(b) = &self.bar {
            b.set_message(format!(
                "loss {:.4}{kd} lr {:.2e} {:.0} tok/s{val}",
                r.loss, r.learning_rate, r.tokens_per_second
            ));
        }
    }

    fn on_checkpoint(&mut self, path: &std::path::Path) {
        self.println(&format!("{:>12} {}", "saved", path.display()));
    }

    fn on_skipped_step(&mut self, step: usize) {
        self.println(&format!(
            "warning: step {step} skipped (non-finite loss or gradient)"
        ));
    }

    fn stop_requested(&mut self) -> bool {
        let stop = self.stop.requested();
        if stop && !self.stop_said {
            self.stop_said = true;
            self.println("stop requested: saving, then exiting (a second signal exits at once)");
        }
        stop
    }
}

impl DistillObserver for Display {
    fn on_phase(&mut self, phase: DistillPhase) {
        self.finish();
        eprintln!(
            "== {} (at {:.1} s)",
            phase.name(),
            self.started.elapsed().as_secs_f64()
        );
    }

    fn on_warning(&mut self, message: &str) {
        self.println(&format!("warning: {message}"));
    }

    fn on_score_progress(&mut self, done: usize, total: usize) {
        let bar = self.bar(
            total,
            "{prefix:>12} [{bar:30}] {pos}/{len} sequences ETA {eta}",
            "teacher",
        );
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    }

    fn on_validation(&mut self, v: &Validation) {
        self.last_val = Some(*v);
        self.println(&format!(
            "{:>12} step {}: student/val_loss {:.4} | kd {:.4} | α {:.3} | top-1 {:.1}% ({} tokens, {:.1}s)",
            "validation",
            v.step,
            v.val_loss,
            v.kd_loss,
            v.alpha,
            100.0 * v.top1_agreement,
            v.tokens,
            v.seconds
        ));
    }
}

/// The end-of-run summary on stdout.
pub fn print_summary(s: &DistillSummary) {
    println!(
        "distilled {} training examples ({} label tokens per epoch; {} validation examples)",
        s.examples.0, s.train_tokens, s.examples.1
    );
    let total = s.examples.0 + s.examples.1;
    println!(
        "  {} steps{}; teacher scoring {:.1} s ({} sequences scored, {} from the cache)",
        s.train.global_step,
        if s.train.skipped_steps > 0 {
            format!(" ({} skipped)", s.train.skipped_steps)
        } else {
            String::new()
        },
        s.teacher_seconds,
        s.scored_sequences,
        total - s.scored_sequences.min(total)
    );
    if s.train.ranks > 1 {
        println!(
            "  data-parallel: {} ranks (the scoring counts above are rank 0's share); the \
             all-reduce took {:.1} s of the steps' {:.1} s ({:.1}%)",
            s.train.ranks,
            s.train.reduce_seconds,
            s.train.step_seconds,
            100.0 * s.train.reduce_seconds / s.train.step_seconds.max(1e-9)
        );
    }
    if let Some(r) = &s.last_log {
        let terms: Vec<String> = r.terms.iter().map(|(k, v)| format!("{k} {v:.4}")).collect();
        println!("  last log: loss {:.4} | {}", r.loss, terms.join(" | "));
    }
    if let (Some(first), Some(last)) = (s.validations.first(), s.validations.last()) {
        println!(
            "  validation: student/val_loss {:.4} → {:.4}, kd {:.4} → {:.4}, α {:.3} → {:.3}, top-1 {:.1}% → {:.1}% (steps {} → {})",
            first.val_loss,
            last.val_loss,
            first.kd_loss,
            last.kd_loss,
            first.alpha,
            last.alpha,
            100.0 * first.top1_agreement,
            100.0 * last.top1_agreement,
            first.step,
            last.step
        );
    }
    for c in &s.train.checkpoints {
        println!("  checkpoint: {}", c.display());
    }
    println!(
        "  TensorBoard: tensorboard --logdir {}",
        s.logging_dir.display()
    );
    for w in &s.warnings {
        println!("  warning: {w}");
    }
}

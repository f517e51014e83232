//! The metrics between two log lines, and writing a log record.

use std::time::Instant;

use crate::error::Result;
use crate::metrics::{LogRecord, TensorBoard, TextLog};
use crate::trainer::step::StepOutcome;

/// Sums over the steps since the last log line.
pub(crate) struct MetricsWindow {
    /// Finite steps.
    steps: usize,
    loss_sum: f64,
    /// Per term: (name, sum, steps that have it).
    terms: Vec<(&'static str, f64, usize)>,
    /// Label tokens (all steps).
    tokens: usize,
    since: Instant,
}

impl MetricsWindow {
    pub fn new() -> Self {
        Self {
            steps: 0,
            loss_sum: 0.0,
            terms: Vec::new(),
            tokens: 0,
            since: Instant::now(),
        }
    }

    pub fn add(&mut self, o: &StepOutcome) {
        if o.finite {
            self.steps += 1;
            self.loss_sum += o.loss;
            for (k, v) in &o.terms {
                match self.terms.iter_mut().find(|(n, _, _)| n == k) {
                    Some((_, s, c)) => {
                        *s += v;
                        *c += 1;
                    }
                    None => self.terms.push((k, *v, 1)),
                }
            }
        }
        self.tokens += o.tokens;
    }

    /// The log record of the window, at `(step, epoch)`; `last` gives the learning rate and
    /// gradient norm.
    pub fn record(
        &self,
        (step, epoch): (usize, f64),
        last: &StepOutcome,
        elapsed: f64,
    ) -> LogRecord {
        let n = self.steps.max(1) as f64;
        LogRecord {
            step,
            epoch,
            loss: self.loss_sum / n,
            // Each term's mean over the steps that have it (on-policy terms are absent from
            // steps without on-policy rows).
            terms: self
                .terms
                .iter()
                .map(|(k, v, c)| (k.to_string(), v / (*c).max(1) as f64))
                .collect(),
            learning_rate: last.learning_rate,
            grad_norm: last.grad_norm,
            tokens_per_second: self.tokens as f64 / self.since.elapsed().as_secs_f64().max(1e-9),
            elapsed_seconds: elapsed,
        }
    }
}

/// Writes a log record to `training_log.txt` and TensorBoard.
pub(crate) fn write_log(
    record: &LogRecord,
    total_steps: usize,
    text_log: &mut TextLog,
    tb: &mut TensorBoard,
) -> Result<()> {
    text_log.line(&record.line(total_steps))?;
    tb.scalar("train/loss", record.loss, record.step)?;
    for (k, v) in &record.terms {
        tb.scalar(&format!("train/{k}"), *v, record.step)?;
    }
    tb.scalar("train/lr", record.learning_rate, record.step)?;
    tb.scalar("train/grad_norm", record.grad_norm, record.step)?;
    tb.scalar(
        "train/tokens_per_second",
        record.tokens_per_second,
        record.step,
    )?;
    Ok(())
}

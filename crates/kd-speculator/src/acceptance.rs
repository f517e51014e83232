//! `acceptance.json`, acceptance at checkpoints during training, and the best checkpoint.

use std::path::{Path, PathBuf};

use kd_eval::{AcceptanceReport, EvalOptions, evaluate};
use kd_model::Llama;
use serde::{Deserialize, Serialize};

use crate::error::{PipelineError, Result};
use crate::observe::SpeculatorObserver;
use kd_train::checkpoint::{TRAINER_STATE_FILE, TrainerState, read_state};
use kd_train::metrics::{LogRecord, TensorBoard, TrainObserver};

/// Acceptance of one checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointAcceptance {
    /// The checkpoint directory.
    pub checkpoint: PathBuf,
    /// Its optimizer step.
    pub step: usize,
    /// The report.
    pub report: AcceptanceReport,
}

/// `acceptance.json`: the untrained and the trained draft side by side, with the settings of
/// the measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AcceptanceFile {
    /// How acceptance was measured.
    pub options: EvalOptions,
    /// Number of held-out prompts.
    pub prompts: usize,
    /// SHA-256 of the held-out prompts' ids.
    pub prompts_hash: String,
    /// The draft before training.
    pub before: Option<AcceptanceReport>,
    /// The draft after training.
    pub after: Option<AcceptanceReport>,
    /// Every checkpoint measured during training (`--eval_steps`).
    pub checkpoints: Vec<CheckpointAcceptance>,
    /// The checkpoint with the longest mean accepted length.
    pub best_checkpoint: Option<PathBuf>,
}

/// Forwards training events and measures acceptance at checkpoints (`--eval_steps`).
pub(crate) struct TrainingWatcher<'a> {
    pub(crate) inner: &'a mut dyn SpeculatorObserver,
    pub(crate) last_log: Option<LogRecord>,
    pub(crate) eval: Option<CheckpointEval<'a>>,
}

pub(crate) struct CheckpointEval<'a> {
    pub(crate) target: &'a Llama,
    pub(crate) base: &'a Llama,
    pub(crate) prompts: &'a [Vec<u32>],
    pub(crate) options: &'a EvalOptions,
    pub(crate) every: usize,
    pub(crate) last_step: usize,
    pub(crate) results: Vec<CheckpointAcceptance>,
    pub(crate) error: Option<PipelineError>,
}

impl CheckpointEval<'_> {
    fn measure(&mut self, dir: &Path, inner: &mut dyn SpeculatorObserver) -> Result<()> {
        let step = read_state(dir)?.global_step;
        if self.every == 0 || step < self.last_step + self.every {
            return Ok(());
        }
        self.last_step = step;
        let (draft, _) = self.base.clone().load_adapter(dir)?;
        let report = evaluate(
            self.target,
            &draft.merge_and_unload(),
            self.prompts,
            self.options,
            |phase, d, t| inner.on_eval_progress(phase, d, t),
        )?;
        let label = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        inner.on_acceptance(&label, &report);
        self.results.push(CheckpointAcceptance {
            checkpoint: dir.to_path_buf(),
            step,
            report,
        });
        Ok(())
    }
}

impl TrainObserver for TrainingWatcher<'_> {
    fn on_start(&mut self, start_step: usize, total_steps: usize) {
        if let Some(e) = &mut self.eval {
            e.last_step = start_step;
        }
        self.inner.on_start(start_step, total_steps);
    }

    fn on_step(&mut self, step: usize, loss: f64) {
        self.inner.on_step(step, loss);
    }

    fn on_log(&mut self, record: &LogRecord) {
        self.last_log = Some(record.clone());
        self.inner.on_log(record);
    }

    fn on_checkpoint(&mut self, path: &Path) {
        self.inner.on_checkpoint(path);
        if let Some(e) = &mut self.eval
            && e.error.is_none()
            && let Err(err) = e.measure(path, self.inner)
        {
            e.error = Some(err);
        }
    }

    fn on_skipped_step(&mut self, step: usize) {
        self.inner.on_skipped_step(step);
    }

    fn stop_requested(&mut self) -> bool {
        self.inner.stop_requested()
    }
}

pub(crate) fn log_acceptance(
    tb: &mut TensorBoard,
    r: &AcceptanceReport,
    step: usize,
) -> Result<()> {
    tb.scalar("eval/acceptance_rate", r.acceptance_rate, step)?;
    tb.scalar("eval/mean_accepted_length", r.mean_accepted_length, step)?;
    tb.scalar(
        "eval/mean_accepted_length_with_bonus",
        r.mean_accepted_length_with_bonus,
        step,
    )?;
    tb.scalar("eval/alpha", r.alpha, step)?;
    tb.scalar("eval/top1_agreement", r.top1_agreement, step)?;
    if let Some(x) = r.measured_speedup {
        tb.scalar("eval/speedup", x, step)?;
    }
    Ok(())
}

/// Reads an `acceptance.json` (`None` when absent or unreadable).
pub fn read_acceptance(path: &Path) -> Option<AcceptanceFile> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str(&text).ok()
}

pub(crate) fn write_acceptance(path: &Path, file: &AcceptanceFile) -> Result<()> {
    let text = serde_json::to_string_pretty(file).expect("the report serialises");
    Ok(kd_model::write_atomic(path, text.as_bytes())?)
}

/// `output_dir/trainer_state.json`: the trainer's history at the last checkpoint plus the
/// best checkpoint by mean accepted length (Hugging Face's `best_model_checkpoint`).
pub(crate) fn write_best(out: &Path, last: Option<&PathBuf>, file: &AcceptanceFile) -> Result<()> {
    let Some(best) = &file.best_checkpoint else {
        return Ok(());
    };
    let mut state: serde_json::Value = last
        .and_then(|l| std::fs::read_to_string(l.join(TRAINER_STATE_FILE)).ok())
        .and_then(|t| serde_json::from_str::<TrainerState>(&t).ok())
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or_else(|| serde_json::json!({}));
    let metric = file
        .checkpoints
        .iter()
        .find(|c| &c.checkpoint == best)
        .map(|c| c.report.mean_accepted_length);
    state["best_model_checkpoint"] = serde_json::json!(best);
    state["best_metric"] = serde_json::json!(metric);
    state["metric_for_best_model"] = serde_json::json!("eval/mean_accepted_length");
    let text = serde_json::to_string_pretty(&state).expect("JSON values serialise");
    Ok(kd_model::write_atomic(
        &out.join(TRAINER_STATE_FILE),
        text.as_bytes(),
    )?)
}

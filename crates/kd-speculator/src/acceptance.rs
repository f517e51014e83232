//! `acceptance.json`, acceptance at checkpoints during training, and the best checkpoint.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Tensor};
use kd_eval::{AcceptanceReport, Drafter, Eagle3Drafter, EvalOptions, evaluate, evaluate_across};
use kd_model::{Eagle3Draft, Llama};
use kd_teacher::sequences_hash;
use kd_train::TrainSummary;
use serde::{Deserialize, Serialize};

use crate::config::SpeculatorConfig;
use crate::error::{PipelineError, Result};
use crate::observe::SpeculatorObserver;
use crate::run::Warnings;
use crate::settings::{TeacherBackend, eval_options};
use crate::setup::{ACCEPTANCE_FILE, Setup};
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
    /// How speculative decoding measured it ([`AcceptanceFile::DECODING`]; files from before
    /// the field read 1): a resumed run reuses a measurement only of the same decoding.
    #[serde(default = "decoding_v1")]
    pub decoding: u32,
    /// How acceptance was measured.
    pub options: EvalOptions,
    /// Whether the draft decoded from Q8_0 blocks of its weights (`--eval_draft_q8_0`).
    #[serde(default)]
    pub draft_q8_0: bool,
    /// Whether the target decoded with 8-bit activations (`--target_int8`, `--target_amx`), as
    /// the loaded model says.
    #[serde(default)]
    pub target_int8: bool,
    /// Whether the target's 8-bit products ran on AMX tiles (`--target_amx`).
    #[serde(default)]
    pub target_amx: bool,
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

impl AcceptanceFile {
    /// The decoding loop's version: 2 since every run starts from a target pass over the
    /// prompts alone (1: a Llama draft's first verification read the prompts).
    pub const DECODING: u32 = 2;
}

fn decoding_v1() -> u32 {
    1
}

/// Forwards training events and measures acceptance at checkpoints (`--eval_steps`).
pub(crate) struct TrainingWatcher<'a> {
    pub(crate) inner: &'a mut dyn SpeculatorObserver,
    pub(crate) last_log: Option<LogRecord>,
    pub(crate) eval: Option<CheckpointEval<'a>>,
}

/// How a checkpoint directory becomes a draft to measure.
pub(crate) enum CheckpointDraft<'a> {
    /// PEFT adapters on this base model, merged.
    Lora(&'a Llama),
    /// An EAGLE-3 draft directory over the target's embedding, reading these target layers.
    Eagle3(Box<Eagle3Source>),
}

/// What an EAGLE-3 checkpoint needs beside its directory.
pub(crate) struct Eagle3Source {
    pub(crate) embedding: Tensor<2>,
    pub(crate) device: Device,
    pub(crate) layers: [usize; 3],
}

pub(crate) struct CheckpointEval<'a> {
    pub(crate) target: &'a Llama,
    pub(crate) base: CheckpointDraft<'a>,
    pub(crate) prompts: &'a [Vec<u32>],
    pub(crate) options: &'a EvalOptions,
    pub(crate) draft_q8_0: bool,
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
        let progress = |phase, d, t| inner.on_eval_progress(phase, d, t);
        let report = match &self.base {
            CheckpointDraft::Lora(base) => {
                let (draft, _) = (*base).clone().load_adapter(dir)?;
                let merged = draft.merge_and_unload().with_q8_0_weights(self.draft_q8_0);
                evaluate(self.target, &merged, self.prompts, self.options, progress)?
            }
            CheckpointDraft::Eagle3(source) => {
                let Eagle3Source {
                    embedding,
                    device,
                    layers,
                } = source.as_ref();
                let draft = Eagle3Draft::load(dir, Some(embedding.clone()), device)?
                    .with_q8_0_weights(self.draft_q8_0);
                let drafter = Eagle3Drafter::new(&draft, *layers);
                evaluate(self.target, &drafter, self.prompts, self.options, progress)?
            }
        };
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

/// The acceptance measurement of a run on the held-out prompts (absent when the target is
/// remote only or no prompt is held out), and `acceptance.json`.
pub(crate) struct Acceptance<'a> {
    pub(crate) target: Option<&'a Llama>,
    pub(crate) prompts: Vec<Vec<u32>>,
    pub(crate) options: EvalOptions,
    /// Drafts are measured decoding from Q8_0 blocks of their weights.
    pub(crate) draft_q8_0: bool,
    pub(crate) path: PathBuf,
    output_dir: &'a std::path::Path,
    pub(crate) file: Option<AcceptanceFile>,
}

impl<'a> Acceptance<'a> {
    pub(crate) fn new(
        config: &'a SpeculatorConfig,
        setup: &Setup,
        teacher: &'a TeacherBackend,
        observer: &mut dyn SpeculatorObserver,
        warnings: &mut Warnings,
    ) -> Self {
        let prompts = setup.prompts.eval_ids();
        let options = eval_options(config);
        let target = teacher.target().filter(|_| !prompts.is_empty());
        let file = target.map(|t| AcceptanceFile {
            decoding: AcceptanceFile::DECODING,
            options: options.clone(),
            draft_q8_0: config.eval_draft_q8_0,
            target_int8: t.int8_activations(),
            target_amx: t.amx_tiles(),
            prompts: prompts.len(),
            prompts_hash: sequences_hash(&prompts),
            before: None,
            after: None,
            checkpoints: Vec::new(),
            best_checkpoint: None,
        });
        if prompts.is_empty() {
            let w = "no prompt is held out (--eval_fraction 0): acceptance is not measured";
            warnings.push(observer, w.to_string());
        }
        Self {
            target,
            prompts,
            options,
            draft_q8_0: config.eval_draft_q8_0,
            path: config.output_dir.join(ACCEPTANCE_FILE),
            output_dir: &config.output_dir,
            file,
        }
    }

    /// Acceptance of the untrained draft (reused from `acceptance.json` when a resumed run
    /// measured it with the same options and prompts).
    pub(crate) fn before(
        &mut self,
        draft: &dyn Drafter,
        tb: Option<&mut TensorBoard>,
        observer: &mut dyn SpeculatorObserver,
    ) -> Result<()> {
        let (Some(file), Some(target)) = (self.file.as_mut(), self.target) else {
            return Ok(());
        };
        let previous = read_acceptance(&self.path).filter(|p| {
            p.decoding == file.decoding
                && p.options == file.options
                && p.draft_q8_0 == file.draft_q8_0
                && (p.target_int8, p.target_amx) == (file.target_int8, file.target_amx)
                && p.prompts_hash == file.prompts_hash
        });
        let before = match previous.and_then(|p| p.before) {
            Some(before) => before,
            None => measure(&self.prompts, &self.options, target, draft, observer)?,
        };
        observer.on_acceptance("before", &before);
        file.before = Some(before.clone());
        // Rank 0 writes (the only one with a TensorBoard).
        let Some(tb) = tb else {
            return Ok(());
        };
        log_acceptance(tb, &before, 0)?;
        write_acceptance(&self.path, file)
    }

    /// Acceptance of the trained draft; every measured checkpoint (the last one included)
    /// competes for the best, which is recorded and linked.
    pub(crate) fn after(
        &mut self,
        draft: &dyn Drafter,
        summary: &TrainSummary,
        measured: &[CheckpointAcceptance],
        tb: Option<&mut TensorBoard>,
        observer: &mut dyn SpeculatorObserver,
    ) -> Result<()> {
        let (Some(file), Some(target)) = (self.file.as_mut(), self.target) else {
            return Ok(());
        };
        let after = measure(&self.prompts, &self.options, target, draft, observer)?;
        observer.on_acceptance("after", &after);
        // Rank 0 writes (the only one with a TensorBoard).
        let Some(tb) = tb else {
            file.after = Some(after);
            return Ok(());
        };
        log_acceptance(tb, &after, summary.global_step)?;
        for c in measured {
            log_acceptance(tb, &c.report, c.step)?;
        }
        // The last checkpoint holds the trained draft: it competes for the best too.
        let mut checkpoints = measured.to_vec();
        if let Some(last) = summary.checkpoints.last()
            && !checkpoints.iter().any(|c| &c.checkpoint == last)
        {
            checkpoints.push(CheckpointAcceptance {
                checkpoint: last.clone(),
                step: summary.global_step,
                report: after.clone(),
            });
        }
        file.after = Some(after);
        file.checkpoints = checkpoints;
        file.best_checkpoint = file
            .checkpoints
            .iter()
            .max_by(|a, b| {
                a.report
                    .mean_accepted_length
                    .total_cmp(&b.report.mean_accepted_length)
            })
            .map(|c| c.checkpoint.clone());
        write_acceptance(&self.path, file)?;
        write_best(self.output_dir, summary.checkpoints.last(), file)
    }

    /// The measurement at checkpoints during training (`--eval_steps`), when acceptance is
    /// measured at all.
    pub(crate) fn at_checkpoints<'b>(
        &'b self,
        base: CheckpointDraft<'b>,
        every: usize,
    ) -> Option<CheckpointEval<'b>> {
        let target = self.file.as_ref().and(self.target)?;
        Some(CheckpointEval {
            target,
            base,
            prompts: &self.prompts,
            options: &self.options,
            draft_q8_0: self.draft_q8_0,
            every,
            last_step: 0,
            results: Vec::new(),
            error: None,
        })
    }
}

/// The report of `draft` on the held-out prompts, shared between the ranks.
fn measure(
    prompts: &[Vec<u32>],
    options: &EvalOptions,
    target: &Llama,
    draft: &dyn Drafter,
    observer: &mut dyn SpeculatorObserver,
) -> Result<AcceptanceReport> {
    Ok(evaluate_across(
        kd_dist::world(),
        target,
        draft,
        prompts,
        options,
        |phase, d, t| observer.on_eval_progress(phase, d, t),
    )?)
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

/// Writes `acceptance.json` and, beside it, `acceptance.svg`: acceptance per drafted position
/// before → after training (whichever is measured yet), both atomically.
pub(crate) fn write_acceptance(path: &Path, file: &AcceptanceFile) -> Result<()> {
    let text = serde_json::to_string_pretty(file).expect("the report serialises");
    kd_model::weights::write_atomic(path, text.as_bytes())?;
    let reports: Vec<(&str, &AcceptanceReport)> =
        [("before", &file.before), ("after", &file.after)]
            .into_iter()
            .filter_map(|(label, r)| r.as_ref().map(|r| (label, r)))
            .collect();
    if reports.is_empty() {
        return Ok(());
    }
    let svg = kd_eval::acceptance_svg(&reports)?;
    Ok(kd_model::weights::write_atomic(
        &path.with_extension("svg"),
        svg.as_bytes(),
    )?)
}

/// Writes one acceptance report (`speculator eval --output`) as JSON at `path` and as a chart
/// of its per-position acceptance beside it (`path` with the extension `svg`), both
/// atomically. Returns the chart's path.
pub fn write_eval_report(path: &Path, report: &AcceptanceReport) -> Result<PathBuf> {
    let text = serde_json::to_string_pretty(report).expect("the report serialises");
    kd_model::weights::write_atomic(path, text.as_bytes())?;
    let chart = path.with_extension("svg");
    let svg = kd_eval::acceptance_svg(&[("draft", report)])?;
    kd_model::weights::write_atomic(&chart, svg.as_bytes())?;
    Ok(chart)
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
    Ok(kd_model::weights::write_atomic(
        &out.join(TRAINER_STATE_FILE),
        text.as_bytes(),
    )?)
}

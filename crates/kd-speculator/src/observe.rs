//! What a run tells its caller while it goes: the phases and the observer trait.

use kd_eval::{AcceptanceReport, EvalPhase};
use kd_teacher::CacheProgress;
use serde::{Deserialize, Serialize};

use kd_train::metrics::TrainObserver;

/// The stages of a run, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Checking the configuration, reading prompts and loading the models.
    Setup,
    /// The target generates completions.
    Generate,
    /// The target scores prompt + completion (hidden states, top-k log-probs).
    Score,
    /// Acceptance of the untrained draft.
    EvalBefore,
    /// LoRA training of the draft.
    Train,
    /// Acceptance of the trained draft.
    EvalAfter,
}

impl Phase {
    /// A short name for displays.
    pub fn name(self) -> &'static str {
        match self {
            Self::Setup => "setup",
            Self::Generate => "generate",
            Self::Score => "score",
            Self::EvalBefore => "eval before",
            Self::Train => "train",
            Self::EvalAfter => "eval after",
        }
    }
}

/// Progress callbacks of a run (the binary draws progress bars from them; the library
/// prints nothing). Training events arrive through the [`TrainObserver`] methods.
pub trait SpeculatorObserver: TrainObserver {
    /// A phase starts.
    fn on_phase(&mut self, _phase: Phase) {}
    /// Something the user should know that does not stop the run.
    fn on_warning(&mut self, _message: &str) {}
    /// A shard of generations (or scores) is done: prompts done of `total`.
    fn on_teacher_progress(&mut self, _phase: Phase, _progress: &CacheProgress, _total: usize) {}
    /// Speculative decoding of held-out prompts: `done` of `total` prompts.
    fn on_eval_progress(&mut self, _phase: EvalPhase, _done: usize, _total: usize) {}
    /// An acceptance measurement finished (`label`: `before`, `after`, or a checkpoint).
    fn on_acceptance(&mut self, _label: &str, _report: &AcceptanceReport) {}
}

/// An observer that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct Quiet;

impl TrainObserver for Quiet {}
impl SpeculatorObserver for Quiet {}

/// A data-parallel rank other than 0 reports nothing (it relays stop signals).
impl SpeculatorObserver for kd_pipeline::QuietRank {}

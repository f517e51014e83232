//! ROLL's DistillPipeline (`roll/pipeline/distill/`), driven by ROLL's YAML: the teacher scores
//! question/answer data (top-k log-probs, or the full vocabulary), the student learns with
//! `(1 − distill_loss_weight)·CE + distill_loss_weight·KD` for any [`kd_loss::KdObjective`],
//! validation every `eval_steps`, checkpoints with exact resume, TensorBoard with ROLL's metric
//! names.
//!
//! Where this differs from ROLL (each a fix of a ROLL quirk; the loss contract, `docs/src/loss-contract.md`):
//! - KD is shifted like CE (ROLL compares unshifted positions);
//! - the end-of-turn token is learned even when it equals the pad id;
//! - a key neither ROLL nor this toolkit knows is an error naming the nearest valid key (ROLL
//!   drops it silently); ROLL keys without meaning here (parallelism, strategies) warn once each;
//! - validation runs after the step it is due at and after the last step, and reports KD, α and
//!   top-1 agreement beside ROLL's `student/val_loss`;
//! - the teacher scores every example once before training (cached under
//!   `output_dir/teacher_cache/`, so a resumed or repeated run does not score again); its wall
//!   time is logged as `train/teacher_forward` at step 0.
//!
//! `logits_transfer_backend` picks where the teacher runs: `ipc+nccl` in-process on the
//! student's device, `nccl-only` in-process on `teacher.device_mapping`'s device, `ray` a remote
//! teacher server at `teacher.url`.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod config;
mod error;
mod load;
mod loss;
mod roll_keys;
mod run;
mod scores;
mod setup;
mod watch;

pub use config::DistillConfig;
pub use error::{PipelineError, Result, error_report};
pub use load::{LoadedConfig, config_file, load, to_yaml};
pub use run::{DistillObserver, DistillPhase, DistillSummary, QuietDistill, Validation, run};

/// The pieces [`run`] is made of, for callers that run some of them on their own (benches,
/// tools): the loss, the tokenizer and chat templates, the examples, the trainer's settings.
pub mod phases {
    pub use crate::loss::{DistillLoss, EvalSums, evaluate_batches};
    pub use crate::run::run_tokenizer;
    pub use crate::setup::{
        TEMPLATE_NAMES, chat_tokenizer, lora_config, read_examples, train_config,
    };
}

/// Stop signals, the output directory's lock and exit statuses of a run's process, for
/// binaries (kd-pipeline's).
pub mod process {
    pub use kd_pipeline::{EXIT_STOPPED, QuietRank, RunLock, StopSignals, exit_status};
}

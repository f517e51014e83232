//! The training loop shared by the speculator and distill pipelines, on Burn's autodiff.
//!
//! - [`TrainConfig`]: the seed's flags (epochs, `max_steps`, AdamW, warmup + cosine/linear/
//!   constant, global-norm clipping, gradient accumulation over micro-batches and shards,
//!   checkpointing).
//! - [`train`]: one optimizer step sums the gradients of all its micro-batches (and shards),
//!   every loss term normalised by the step's global count of label tokens; AdamW as PyTorch
//!   computes it ([`AdamW`]) with state keyed by parameter path; non-finite steps skipped and
//!   counted.
//! - Checkpoints `checkpoint-{step}` / `checkpoint-epoch-{e}` written atomically: the adapter
//!   in PEFT layout (or the whole model in HF layout), the projection, tokenizer files,
//!   `training_state/` (optimizer moments, step, epoch, data position) and
//!   `trainer_state.json`. Data order and dropout masks derive from (seed, epoch, step), so a
//!   resumed run ends with the same bytes as an uninterrupted one.
//! - Metrics: `training_log.txt`, TensorBoard event files under `runs/`, and a
//!   [`TrainObserver`] for progress bars.
//! - On-policy distillation ([`train_on_policy`], [`OnPolicy`]): a share λ of every step's
//!   rows is completed by the model being trained and scored by the teacher (GKD /
//!   DistillSpec), with the same exact resume.
//! - [`distill`]: ROLL's distill pipeline as a library function ([`distill::run`]), driven by
//!   ROLL's YAML.
//! - [`speculator`]: the speculator pipeline as a library function
//!   ([`speculator::run`]), with its acceptance report, merged export and teacher server.
#![warn(missing_docs)]

mod checkpoint;
mod config;
pub mod distill;
mod error;
mod kd_term;
mod memory;
mod metrics;
mod model_files;
mod on_policy;
mod optim;
mod schedule;
pub mod speculator;
mod trainer;
mod vocab;

pub use checkpoint::{
    OPTIMIZER_FILE, PROJECTION_FILE, STATE_FILE, TRAINER_STATE_FILE, TRAINING_STATE_DIR,
    TrainerState, TrainingState, prune, read_state, resolve_resume, step_checkpoints,
    write_checkpoint,
};
pub use config::{SchedulerType, TrainConfig, TrainMode};
pub use error::{Result, TrainError};
pub use memory::retain_freed_memory;
pub use metrics::{LogRecord, NoopObserver, TensorBoard, TextLog, TrainObserver, crc32c};
pub use model_files::{has_tokenizer, is_local_model, model_config, write_tokenizer_files};
pub use on_policy::{
    OnPolicy, OnPolicyConfig, OnPolicyLoss, OnPolicySamples, OnPolicyTotals, on_policy_rows,
    on_policy_terms, sample_seed,
};
pub use optim::{AdamW, AdamWParams, clip_coefficient, global_grad_norm};
pub use schedule::learning_rate;
pub use trainer::{
    CausalLmLoss, MixedStep, NoHook, RunInfo, StepGradients, StepHook, StepLoss, StepLossFn,
    TrainModel, TrainSummary, load_checkpoint_weights, mixed_step_gradients, shard_rows,
    step_gradients, token_batch, train, train_on_policy, train_with_hook,
};

//! The trainer as a library: one entry point, [`Trainer`], over any [`Trainable`] Burn module,
//! with the loss and the source of each step's rows plugged in through small traits.
//!
//! - [`TrainConfig`]: epochs or `max_steps`, AdamW, warmup + cosine/linear/constant,
//!   global-norm clipping, gradient accumulation over micro-batches and shards,
//!   checkpointing.
//! - [`Trainer::run`]: one optimizer step sums the gradients of all its micro-batches (and
//!   shards), every loss term normalised by the step's global count of label tokens; AdamW as
//!   PyTorch computes it, with state keyed by parameter path; non-finite steps skipped and
//!   counted.
//! - [`StepLossFn`]: how a micro-batch becomes a loss ([`CausalLmLoss`] here; the pipelines'
//!   KD and hidden-state terms in their crates). [`StepData`]: where a step's micro-batches
//!   come from (the planned rows by default; on-policy completions in `kd-pipeline`).
//! - Checkpoints `checkpoint-{step}` / `checkpoint-epoch-{e}` written atomically: the model's
//!   files ([`Trainable::save_files`]: the adapter in PEFT layout, or the whole model, the
//!   projection, tokenizer files), `training_state/` (optimizer moments, step, epoch, data
//!   position) and `trainer_state.json`. Data order and dropout masks derive from (seed,
//!   epoch, step), so a resumed run ends with the same bytes as an uninterrupted one.
//! - Metrics: `training_log.txt`, TensorBoard event files under `runs/`, and a
//!   [`TrainObserver`] for progress bars.
//!
//! ```no_run
//! use kd_train::{CausalLmLoss, TrainConfig, TrainModel, Trainer};
//! # fn demo(llama: kd_model::Llama, examples: &[kd_data::Example]) -> kd_train::Result<()> {
//! let llama = llama.apply_lora(&kd_model::LoraConfig::default())?;
//! let config = TrainConfig { output_dir: "out".into(), num_epochs: 1, ..TrainConfig::default() };
//! let (trained, summary) =
//!     Trainer::new(config, &CausalLmLoss { weight: 1.0 }).run(TrainModel::new(llama), examples)?;
//! println!("{} steps, last loss {:?}", summary.global_step, summary.last_loss);
//! # let _ = trained; Ok(()) }
//! ```
#![warn(missing_docs)]

pub mod checkpoint;
mod config;
mod data;
mod error;
mod loss;
mod memory;
pub mod metrics;
mod model;
mod optim;
mod schedule;
mod tokenizer_files;
mod trainer;

pub use config::{SchedulerType, TrainConfig, TrainMode};
pub use data::{MicroBatch, PlannedStep, StepData};
pub use error::{Result, TrainError};
pub use loss::{CausalLmLoss, FinalHidden, StepLoss, StepLossFn, final_hidden, token_batch};
pub use memory::retain_freed_memory;
pub use metrics::{LogRecord, NoopObserver, TrainObserver};
pub use model::{ModelFiles, TrainModel, Trainable};
pub use tokenizer_files::write_tokenizer_files;
pub use trainer::{StepHook, TrainSummary, Trainer};

/// The loop's building blocks, for callers that compose their own loop or benchmark a step:
/// the gradient of one step, row sharding, the optimizer, clipping and the schedule.
pub mod advanced {
    pub use crate::data::shard_rows;
    pub use crate::optim::{AdamW, AdamWParams, clip_coefficient, global_grad_norm};
    pub use crate::schedule::learning_rate;
    pub use crate::trainer::step::{PartLoss, StepGradients, step_gradients};
}

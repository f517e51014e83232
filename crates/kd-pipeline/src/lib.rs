//! What the speculator and distill pipelines share, below both (they never depend on each
//! other):
//!
//! - [`on_policy`]: on-policy distillation (GKD / DistillSpec) as a trainer step data source,
//!   [`OnPolicyData`]: a share λ of every step's rows completed by the model being trained and
//!   scored by the teacher;
//! - [`kd_term`]: the token-level KD term against the teacher's cached top-k log-probs;
//! - [`models`]: model paths (Hugging Face directories or GGUF files), their configurations
//!   and tokenizers, and [`vocab`]: whether two models share one vocabulary;
//! - [`clear_run`]: an earlier run's files in an output directory;
//! - [`ranks`]: data-parallel ranks ([`kd_dist::World`]): each rank's device from a device
//!   list, and work shared between ranks in turn;
//! - [`PipelineError`]: the error type of the pipeline crates.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod error;
#[cfg(feature = "hub-download")]
pub mod hub;
pub mod kd_term;
pub mod models;
pub mod on_policy;
mod output_dir;
pub mod ranks;
mod stop;
pub mod vocab;

pub use error::{PipelineError, Result, error_report};
pub use on_policy::{OnPolicy, OnPolicyConfig, OnPolicyData, OnPolicyTotals};
pub use output_dir::{LOCK_FILE, RunLock, clear_run};
pub use stop::{EXIT_STOPPED, QuietRank, StopSignals, continue_unless_stopped, exit_status};

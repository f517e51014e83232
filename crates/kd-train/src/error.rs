//! The crate's error type.

use std::path::PathBuf;

/// Everything that can stop a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A configuration value is out of range or inconsistent.
    #[error("invalid training configuration: {0}")]
    Config(String),
    /// A file or directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint is missing, incomplete or does not fit this run.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The checkpoint directory.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// Too many optimizer steps in a row had a non-finite loss or gradient.
    #[error(
        "{count} optimizer steps in a row had a non-finite loss or gradient (last at step {step}); \
         stopping: lower the learning rate, check the data, or raise max_consecutive_nonfinite"
    )]
    NonFinite {
        /// Steps in a row.
        count: usize,
        /// The last one.
        step: usize,
    },
    /// The observer asked to stop (a preemption signal, relayed): the run stopped after a
    /// step and wrote its checkpoint.
    #[error(
        "stopped on request after step {step} of {total_steps}; checkpoint {}: resume from it \
         to continue exactly",
        checkpoint.display()
    )]
    Stopped {
        /// The last step done.
        step: usize,
        /// Steps the run would have done.
        total_steps: usize,
        /// The checkpoint of that step.
        checkpoint: PathBuf,
    },
    /// The model failed.
    #[error(transparent)]
    Model(#[from] kd_model::ModelError),
    /// A loss failed.
    #[error(transparent)]
    Loss(#[from] kd_loss::LossError),
    /// LoRA failed.
    #[error(transparent)]
    Lora(#[from] kd_lora::LoraError),
    /// Data failed.
    #[error(transparent)]
    Data(#[from] kd_data::DataError),
    /// A pipeline's step data source or loss failed (e.g. the teacher scoring on-policy
    /// rows).
    #[error(transparent)]
    Step(Box<dyn std::error::Error + Send + Sync>),
}

/// Shorthand for results of this crate.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;

impl TrainError {
    /// A pipeline's error, carried through the trainer.
    pub fn step(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Step(Box::new(e))
    }

    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

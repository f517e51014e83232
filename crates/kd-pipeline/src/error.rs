//! The error type of the pipeline crates (this one, `kd-speculator` and `kd-distill`).

use std::path::PathBuf;

use kd_train::TrainError;

/// Everything that can stop a pipeline.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
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
    /// An output directory that holds another run.
    #[error("output directory {path}: {message}")]
    OutputDir {
        /// The directory.
        path: PathBuf,
        /// What it holds and what to do.
        message: String,
    },
    /// A checkpoint is missing, incomplete or does not fit this run.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The checkpoint directory.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// Training failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] kd_model::ModelError),
    /// The teacher failed.
    #[error(transparent)]
    Teacher(#[from] kd_teacher::TeacherError),
    /// Speculative decoding failed.
    #[error(transparent)]
    Eval(#[from] kd_eval::EvalError),
    /// A loss failed.
    #[error(transparent)]
    Loss(#[from] kd_loss::LossError),
    /// LoRA failed.
    #[error(transparent)]
    Lora(#[from] kd_lora::LoraError),
    /// Data failed.
    #[error(transparent)]
    Data(#[from] kd_data::DataError),
}

/// Shorthand for results of the pipeline crates.
pub type Result<T, E = PipelineError> = std::result::Result<T, E>;

impl PipelineError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

//! The error type of the pipeline crates (this one, `kd-speculator` and `kd-distill`).

use std::path::PathBuf;

use kd_train::TrainError;

/// Everything that can stop a pipeline.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// A configuration value is out of range or inconsistent.
    #[error("invalid training configuration: {0}")]
    Config(String),
    /// A hub id could not be downloaded into the Hugging Face cache.
    #[error("downloading {id} from the Hugging Face hub: {message}")]
    Download {
        /// The hub id (`org/name[@revision]`).
        id: String,
        /// What failed and what to do.
        message: String,
    },
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
    #[error("output directory (output_dir) {path}: {message}")]
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
    /// The ranks of a data-parallel job could not work together.
    #[error("data-parallel ranks: {0}")]
    Dist(#[from] kd_dist::DistError),
}

/// Shorthand for results of the pipeline crates.
pub type Result<T, E = PipelineError> = std::result::Result<T, E>;

impl PipelineError {
    /// Whether the run stopped on request ([`crate::StopSignals`]) after saving its work:
    /// a checkpoint of the last step, or the teacher cache's finished shards. Running the same
    /// command again (training: with `resume_from_checkpoint`) continues.
    pub fn is_stopped(&self) -> bool {
        matches!(
            self,
            Self::Train(TrainError::Stopped { .. })
                | Self::Teacher(kd_teacher::TeacherError::Stopped { .. })
        )
    }

    /// Whether every data-parallel rank stopped at the same point: training stops at the same
    /// step on every rank (the ranks agree on it), while a teacher cache stops each rank after
    /// its own shard. Ranks that stopped together can shut MPI down together
    /// ([`kd_dist::exit_together`]); otherwise the job must be aborted ([`kd_dist::exit`]).
    pub fn stopped_together(&self) -> bool {
        matches!(self, Self::Train(TrainError::Stopped { .. }))
    }

    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

/// An error and its causes on one line, each said once: the workspace's errors print their
/// cause in their own message (`path: cause`), so a cause whose text the line already holds
/// is not repeated (what `{:#}` of an `anyhow::Error` would do).
pub fn error_report(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = c.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_are_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        let e = PipelineError::io("/data", io);
        assert_eq!(error_report(&e), "/data: No such file or directory");
        #[derive(Debug)]
        struct Outer(PipelineError);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("reading the data")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        assert_eq!(
            error_report(&Outer(PipelineError::io("/x", io))),
            "reading the data: /x: gone"
        );
    }
}

//! The crate's error type.

use std::path::PathBuf;

/// Invalid LoRA configuration or adapter files.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// A configuration value is out of range or names no module.
    #[error("invalid LoRA configuration: {0}")]
    Config(String),
    /// Tensors whose shapes do not fit.
    #[error("adapter shape mismatch: {0}")]
    Shape(String),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An adapter file is malformed.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = LoraError> = std::result::Result<T, E>;

//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while reading, rendering or tokenizing data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file or directory could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A record is malformed (with the policy `error`).
    #[error("{path}:{line}{}: {reason}", record_suffix(*.record))]
    Record {
        /// The file.
        path: PathBuf,
        /// 1-based line of the record's start.
        line: usize,
        /// 1-based record number among a JSON array's elements (`None` for JSONL).
        record: Option<usize>,
        /// What is wrong.
        reason: String,
    },
    /// No input files were found.
    #[error("{path}: {message}")]
    NoInput {
        /// Where we looked.
        path: PathBuf,
        /// What was expected.
        message: String,
    },
    /// The chat template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
    /// The tokenizer failed to load or encode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// An option has an invalid value.
    #[error("invalid option: {0}")]
    Config(String),
}

/// Shorthand for results of this crate.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

fn record_suffix(record: Option<usize>) -> String {
    record.map(|r| format!(" (record {r})")).unwrap_or_default()
}

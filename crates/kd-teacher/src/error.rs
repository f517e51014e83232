//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while running or caching a teacher.
#[derive(Debug, thiserror::Error)]
pub enum TeacherError {
    /// Invalid sampling or scoring options.
    #[error("invalid teacher option: {0}")]
    Config(String),
    /// Inputs the teacher cannot take (empty prompts, ids beyond the vocabulary).
    #[error("invalid teacher input: {0}")]
    Input(String),
    /// A cache that belongs to another run.
    #[error(
        "teacher cache {path} was made with different settings: {differences}; use another cache directory or delete this one"
    )]
    CacheMismatch {
        /// The cache directory.
        path: PathBuf,
        /// What differs, field by field.
        differences: String,
    },
    /// The caller asked to stop (a preemption signal, relayed) between shards of a cache.
    #[error(
        "stopped on request after {shards_done} of {shards} shards; they are kept in {}: run \
         the same command again to continue from there",
        path.display()
    )]
    Stopped {
        /// The cache directory.
        path: PathBuf,
        /// Shards finished (written or read).
        shards_done: usize,
        /// Shards in all.
        shards: usize,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A cache file is malformed.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A remote teacher could not be reached or refused a request.
    #[error("teacher server {url}: {message}")]
    Remote {
        /// The endpoint.
        url: String,
        /// What happened.
        message: String,
    },
    /// A remote teacher answered something this client cannot use.
    #[error("teacher server {url}: {message}")]
    Protocol {
        /// The endpoint.
        url: String,
        /// What is wrong with the answer.
        message: String,
    },
    /// The teacher server could not start or stopped with an error.
    #[error("teacher server: {0}")]
    Serve(String),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] kd_model::ModelError),
    /// The tokenizer failed.
    #[error(transparent)]
    Data(#[from] kd_data::DataError),
    /// Data-parallel ranks sharing a cache could not work together.
    #[error("data-parallel ranks: {0}")]
    Dist(#[from] kd_dist::DistError),
}

/// Shorthand for results of this crate.
pub type Result<T, E = TeacherError> = std::result::Result<T, E>;

impl TeacherError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

//! The crate's error type.

/// Invalid loss inputs or configuration.
#[derive(Debug, thiserror::Error)]
pub enum LossError {
    /// Tensors whose shapes do not fit together.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// Out-of-range values (a target beyond the vocabulary, a zero normaliser).
    #[error("invalid input: {0}")]
    Input(String),
    /// A configuration value out of range.
    #[error("invalid loss configuration: {0}")]
    Config(String),
}

/// Shorthand for results of this crate.
pub type Result<T, E = LossError> = std::result::Result<T, E>;

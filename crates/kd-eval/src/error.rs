//! The crate's error type.

/// Everything that can go wrong while decoding speculatively or measuring acceptance.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// Invalid options.
    #[error("invalid speculative-decoding option: {0}")]
    Config(String),
    /// The draft cannot serve the target.
    #[error(
        "the draft's vocabulary ({draft} tokens) differs from the target's ({target}): a draft \
         must share the target's tokenizer"
    )]
    VocabMismatch {
        /// Target vocabulary size.
        target: usize,
        /// Draft vocabulary size.
        draft: usize,
    },
    /// The acceptance chart could not be drawn.
    #[error("drawing the acceptance chart: {0}")]
    Plot(String),
    /// A model failed.
    #[error(transparent)]
    Model(#[from] kd_model::ModelError),
}

/// Shorthand for results of this crate.
pub type Result<T, E = EvalError> = std::result::Result<T, E>;

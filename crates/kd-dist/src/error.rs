//! The crate's error type.

/// What can go wrong setting up ranks or in a collective.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The environment describes a launch this process cannot take part in.
    #[error("{0}")]
    Launch(String),
    /// The MPI library could not be opened or is not one this crate speaks to.
    #[error("{0}")]
    Library(String),
    /// An MPI call returned an error code.
    #[error("MPI call {call} failed with error code {code}{}", detail.as_deref().map(|d| format!(": {d}")).unwrap_or_default())]
    Call {
        /// The MPI function.
        call: &'static str,
        /// Its return code.
        code: i32,
        /// MPI's text for the code, when it gave one.
        detail: Option<String>,
    },
    /// A collective was given arguments that differ between ranks or cannot be sent.
    #[error("{0}")]
    Usage(String),
}

/// The crate's result type.
pub type Result<T, E = DistError> = std::result::Result<T, E>;

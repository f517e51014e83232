//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while reading a configuration, loading or saving weights,
/// choosing a device or running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },

    /// A JSON file is not valid JSON, or a field has the wrong type.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The cause (it names the line and column).
        #[source]
        source: serde_json::Error,
    },

    /// A `config.json` field holds a value this crate does not support, or is missing.
    #[error("{path}: field `{field}`: {message}")]
    Config {
        /// The configuration file (or `<memory>` for a configuration built in code).
        path: PathBuf,
        /// The offending field, as a dotted path (`rope_scaling.rope_type`).
        field: String,
        /// What is wrong and what is expected.
        message: String,
    },

    /// A safetensors file could not be parsed.
    #[error("{path}: invalid safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the parser reported.
        message: String,
    },

    /// The checkpoint's tensors do not match the configuration.
    ///
    /// Every problem is listed, not only the first one.
    #[error(
        "{dir}: the checkpoint does not match its configuration (config.json or GGUF \
         metadata):\n{}",
        problems.join("\n")
    )]
    Weights {
        /// The model directory.
        dir: PathBuf,
        /// One line per missing, unexpected or mis-shaped tensor.
        problems: Vec<String>,
    },

    /// A stored tensor has a dtype this crate cannot read.
    #[error("{path}: tensor `{name}` has dtype {dtype}; supported: F32, BF16, F16")]
    UnsupportedDType {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The stored dtype.
        dtype: String,
    },

    /// The model directory holds neither `model.safetensors` nor a sharded index.
    #[error(
        "{dir}: no weights found: expected model.safetensors or model.safetensors.index.json \
         (a Hugging Face model directory)"
    )]
    NoWeights {
        /// The model directory.
        dir: PathBuf,
    },

    /// A device name could not be parsed or is not available in this build.
    #[error("device `{name}`: {message}")]
    Device {
        /// The name as given.
        name: String,
        /// Why it cannot be used.
        message: String,
    },

    /// A GGUF file could not be read (the error names the key or tensor).
    #[error(transparent)]
    Gguf(#[from] kd_gguf::GgufError),

    /// A hub id whose repository is in the local Hugging Face cache, but not usable.
    #[error("model `{id}` in the Hugging Face cache: {message}")]
    HubCache {
        /// The id as given (`org/name` or `org/name@revision`).
        id: String,
        /// What was looked for and what to do.
        message: String,
    },

    /// A LoRA configuration or adapter problem.
    #[error("LoRA: {0}")]
    Lora(String),

    /// Inputs of a forward pass have inconsistent shapes or out-of-range values.
    #[error("invalid input: {0}")]
    Input(String),
}

/// Shorthand for results of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn config(
        path: impl Into<PathBuf>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self::Config {
            path: path.into(),
            field: field.into(),
            message: message.into(),
        }
    }
}

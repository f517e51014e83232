//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while reading or writing a GGUF file.
///
/// Every variant names the file (when there is one yet), and the key or tensor concerned
/// where there is one.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },

    /// The file does not start with the GGUF magic bytes.
    #[error(
        "{path}: not a GGUF file (the first bytes are {found:?}, expected \"GGUF\"); \
         pass a llama.cpp .gguf file"
    )]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The first four bytes.
        found: [u8; 4],
    },

    /// The GGUF version is not 2 or 3.
    #[error("{path}: GGUF version {version} is not supported (versions 2 and 3 are)")]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version in the header.
        version: u32,
    },

    /// The file ends before a structure it declares (a truncated download, usually).
    #[error(
        "{path}: truncated: {what} needs {needed} bytes at offset {offset}, but the file has \
         {len} bytes (re-download the file)"
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What was being read (`metadata key "general.name"`, `tensor "blk.0.attn_q.weight"`).
        what: String,
        /// Where it starts.
        offset: u64,
        /// How many bytes it needs.
        needed: u64,
        /// The file's size.
        len: u64,
    },

    /// A structure of the file holds an impossible value.
    #[error("{path}: {what}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The key, tensor or header field concerned.
        what: String,
        /// What is wrong.
        message: String,
    },

    /// A tensor is stored in a quantisation type this crate cannot dequantise.
    #[error(
        "{path}: tensor `{tensor}` is stored as {ty}; supported types: F32, F16, BF16, Q8_0, \
         Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (requantise the model, e.g. with llama.cpp's \
         llama-quantize, to one of these)"
    )]
    UnsupportedType {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The type's name (or `type id N` for an id this crate does not know).
        ty: String,
    },

    /// A metadata key the caller needs is absent.
    #[error("{path}: metadata key `{key}` is missing")]
    MissingKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
    },

    /// A metadata key holds a value of another type than the caller needs.
    #[error("{path}: metadata key `{key}` holds {found}, expected {expected}")]
    KeyType {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What was expected.
        expected: &'static str,
        /// What the file holds.
        found: String,
    },

    /// A file under construction ([`crate::GgufWriter`]) was given something GGUF cannot hold.
    #[error("cannot write GGUF: {what}: {message}")]
    Unwritable {
        /// The key or tensor concerned.
        what: String,
        /// What is wrong.
        message: String,
    },

    /// A tensor the caller needs is absent.
    #[error("{path}: tensor `{name}` is missing")]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;

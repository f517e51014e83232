//! GGUF, llama.cpp's model file format: a reader that checks every length and offset against
//! the file's size before it uses it, typed metadata access with errors that name the key,
//! dequantisation of the common tensor types to f32 ([`GgmlType`]), quantisation of f32 to
//! Q8_0 ([`quantize_q8_0`]), and a writer ([`GgufWriter`]) that lays a file out byte for byte
//! as the `gguf` Python package does.
//!
//! ```no_run
//! use kd_gguf::GgufFile;
//!
//! # fn main() -> Result<(), kd_gguf::GgufError> {
//! let file = GgufFile::open("SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! assert_eq!(file.str("general.architecture")?, "llama");
//! let layers = file.uint("llama.block_count")?;
//! let embedding = file.dequantize("token_embd.weight")?; // row-major [vocab, hidden]
//! # let _ = (layers, embedding);
//! # Ok(())
//! # }
//! ```
//!
//! The format: a header (`GGUF`, version, tensor count, key count), the metadata as typed
//! key/value pairs, the tensor descriptions (name, dimensions with the fastest-varying first,
//! type, offset), then the tensor data from the next multiple of `general.alignment`
//! (32 by default). Versions 2 and 3 are read (both little-endian with 64-bit counts).
#![warn(missing_docs)]

mod dequant;
mod error;
mod file;
mod quant;
mod value;
mod write;

use std::path::{Path, PathBuf};

pub use dequant::{BlockFn, DequantError, GgmlType, block_dequantizer, dequantize, scale_min_k4};
pub use error::{GgufError, Result};
pub use file::{GgufFile, SharedBytes, TensorInfo};
pub use quant::quantize_q8_0;
pub use value::Value;
pub use write::GgufWriter;

/// The GGUF file a model path names: the path itself when it is a file, or the only `.gguf`
/// file of a directory that lacks `hf_file` (the Hugging Face file that would take
/// precedence: `config.json` for weights, `tokenizer.json` for a tokenizer). `None` when the
/// path is such a Hugging Face directory or holds no `.gguf` file; an error when it holds
/// several.
pub fn locate(path: &Path, hf_file: &str) -> Result<Option<PathBuf>> {
    if path.is_file() {
        return Ok(Some(path.to_path_buf()));
    }
    if !path.is_dir() || path.join(hf_file).is_file() {
        return Ok(None);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf") && p.is_file())
        .collect();
    found.sort();
    if found.len() > 1 {
        let names: Vec<String> = found
            .iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        return Err(GgufError::Invalid {
            path: path.to_path_buf(),
            what: "the directory".into(),
            message: format!(
                "holds {} .gguf files ({}) and no {hf_file}; pass the file to load",
                found.len(),
                names.join(", ")
            ),
        });
    }
    Ok(found.pop())
}

//! Where a model path's configuration and tokenizer come from: a Hugging Face directory
//! (`config.json`, `tokenizer.json`) or a llama.cpp `.gguf` file (the file, or a directory
//! holding one), so that every command takes either.

use std::path::{Path, PathBuf};

use kd_model::LlamaConfig;

use crate::error::{PipelineError, Result};

/// A model argument as a local path: itself when it exists, else a hub id (`org/name`)
/// found in the local Hugging Face cache ([`kd_model::hub::resolve_model_path`]); with the
/// `hub-download` feature, a hub id the cache lacks is downloaded into it first
/// ([`crate::hub::download_model`]) unless `HF_HUB_OFFLINE` is set, as transformers does.
pub fn local_model(path: &Path) -> Result<PathBuf> {
    let resolved = kd_model::hub::resolve_model_path(path)?;
    #[cfg(feature = "hub-download")]
    if !resolved.exists()
        && !crate::hub::offline()
        && let (Some(id), Some(cache)) = (
            path.to_str()
                .filter(|s| kd_model::hub::parse_hub_id(s).is_some()),
            kd_model::hub::hf_hub_cache(),
        )
    {
        return crate::hub::download_model(id, &cache, &crate::hub::Endpoint::from_env());
    }
    Ok(resolved)
}

/// Whether `path` is a local model: a Hugging Face directory with `config.json`, a `.gguf`
/// file, or a directory holding one `.gguf` file.
pub fn is_local_model(path: &Path) -> bool {
    path.join("config.json").is_file()
        || matches!(kd_gguf::locate(path, "config.json"), Ok(Some(_)))
}

/// Whether `path` carries a tokenizer (`tokenizer.json`, or GGUF metadata).
pub fn has_tokenizer(path: &Path) -> bool {
    path.join("tokenizer.json").is_file()
        || matches!(kd_gguf::locate(path, "tokenizer.json"), Ok(Some(_)))
}

/// The configuration of a local model; `flag` names the option in the error.
pub fn model_config(flag: &str, path: &Path) -> Result<LlamaConfig> {
    if path.join("config.json").is_file() {
        return Ok(LlamaConfig::from_file(path.join("config.json"))?);
    }
    match kd_gguf::locate(path, "config.json") {
        Ok(Some(file)) => Ok(LlamaConfig::from_gguf(file)?),
        Ok(None) => Err(PipelineError::Config(format!(
            "--{flag} {}: not a model (no config.json there, and not a .gguf file); pass a \
             local Hugging Face model directory, a llama.cpp .gguf file, or a hub id \
             (org/name) downloaded into the Hugging Face cache ({})",
            path.display(),
            kd_model::hub::hf_hub_cache().map_or_else(
                || "HF_HUB_CACHE / HF_HOME unset and no home directory".to_string(),
                |c| format!("searched {}", c.display())
            )
        ))),
        Err(e) => Err(PipelineError::Config(format!("--{flag}: {e}"))),
    }
}

//! The tokenizer files a checkpoint carries, from a Hugging Face directory or a llama.cpp
//! `.gguf` file.

use std::path::Path;

use kd_data::ChatTokenizer;

use crate::error::Result;

/// Writes the tokenizer files of `src` into `dst`: copies a Hugging Face directory's files,
/// or writes `tokenizer.json` + `tokenizer_config.json` built from a GGUF file's metadata.
pub fn write_tokenizer_files(src: &Path, dst: &Path) -> Result<()> {
    if !src.join("tokenizer.json").is_file()
        && let Ok(Some(file)) = kd_gguf::locate(src, "tokenizer.json")
    {
        ChatTokenizer::from_gguf(file)?.save(dst)?;
        return Ok(());
    }
    Ok(kd_model::weights::copy_tokenizer_files(src, dst)?)
}

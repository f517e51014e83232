//! `speculator export`: an EAGLE-3 draft written for the server that will run it (a
//! directory for SGLang or vLLM, a GGUF file for llama.cpp).

use std::path::{Path, PathBuf};

pub use kd_model::eagle3::GgufWeightType;
use kd_model::{
    eagle3::Eagle3Format, eagle3::SpeculatorsVerifier, eagle3::export_eagle3,
    eagle3::export_eagle3_gguf, eagle3::is_eagle3_dir,
};
use serde::{Deserialize, Serialize};

use crate::config::SpeculatorConfig;
use crate::error::{PipelineError, Result};
use crate::setup::RUN_CONFIG_FILE;

/// The servers an EAGLE-3 draft is exported for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExportTarget {
    /// SGLang (SpecForge's layout; vLLM reads it too, but takes the feature layers from the
    /// top-level key only, which this layout also writes).
    Sglang,
    /// vLLM's `speculators` format.
    Vllm,
    /// llama.cpp: one GGUF file of architecture `eagle3` (`llama-server -m TARGET.gguf -md
    /// DRAFT.gguf --spec-type draft-eagle3`), which needs the target's GGUF file.
    Gguf,
}

/// What `speculator export` writes.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportConfig {
    /// The draft: a checkpoint of `--draft_method eagle3`, or any EAGLE-3 directory.
    pub draft: PathBuf,
    /// Where the exported directory goes (`--to gguf`: the file).
    pub out: PathBuf,
    /// For which server.
    pub to: ExportTarget,
    /// The target (verifier): as vLLM names it (`--to vllm`), or its GGUF file (`--to gguf`,
    /// whose tokenizer the draft file carries). Default: for `--to vllm` from a `speculators`
    /// draft, the verifier it names; otherwise the run's `target_model` (read from
    /// `speculator_config.json` beside the checkpoint).
    pub verifier: Option<String>,
    /// Tokens drafted per verification written into a `speculators` config.
    pub speculative_tokens: usize,
    /// `--to gguf`: the type of the draft's matrices.
    pub gguf_type: GgufWeightType,
}

/// Writes `config.draft` for its server, every tensor checked (a missing, misshapen or
/// foreign key is an error naming it). Returns the verifier named (`--to vllm`, `--to gguf`).
pub fn export(config: &ExportConfig) -> Result<Option<String>> {
    let draft = &config.draft;
    if !is_eagle3_dir(draft) {
        return Err(PipelineError::Config(format!(
            "--draft {}: not an EAGLE-3 draft directory (its config.json names neither \
             LlamaForCausalLMEagle3 nor speculators_model_type eagle3); a LoRA checkpoint is \
             served through `speculator merge`",
            draft.display()
        )));
    }
    let (format, verifier) = match config.to {
        ExportTarget::Gguf => {
            let target = target_gguf(config)?;
            export_eagle3_gguf(draft, &target, &config.out, config.gguf_type)?;
            return Ok(Some(target.display().to_string()));
        }
        ExportTarget::Sglang => (Eagle3Format::SpecForge, None),
        ExportTarget::Vllm => {
            let (name, architectures) = match &config.verifier {
                Some(v) => (v.clone(), vec![verifier_architecture(v)?]),
                None => match source_verifier(draft)? {
                    Some(named) => named,
                    None => {
                        let name = run_target(draft)?;
                        let architectures = vec![verifier_architecture(&name)?];
                        (name, architectures)
                    }
                },
            };
            (
                Eagle3Format::Speculators(SpeculatorsVerifier {
                    name_or_path: name.clone(),
                    architectures,
                    speculative_tokens: config.speculative_tokens,
                }),
                Some(name),
            )
        }
    };
    export_eagle3(draft, &config.out, &format)?;
    Ok(verifier)
}

/// The target's GGUF file for `--to gguf`: `--verifier`, else the run's `target_model`, either
/// a `.gguf` file or a directory holding one.
fn target_gguf(config: &ExportConfig) -> Result<PathBuf> {
    let (name, flag) = match &config.verifier {
        Some(v) => (v.clone(), "--verifier"),
        None => (run_target(&config.draft)?, "the run's target_model"),
    };
    let path = kd_model::hub::resolve_model_path(Path::new(&name))
        .map_err(|e| PipelineError::Config(format!("{flag} {name}: {e}")))?;
    match kd_gguf::locate(&path, "config.json") {
        Ok(Some(file)) => Ok(file),
        Ok(None) => Err(PipelineError::Config(format!(
            "{flag} {name} is not a GGUF file: llama.cpp serves the draft beside the target's \
             .gguf file, whose tokenizer the draft carries; name that file with --verifier"
        ))),
        Err(e) => Err(PipelineError::Config(format!("{flag} {name}: {e}"))),
    }
}

/// The verifier a `speculators`-layout draft names (`speculators_config.verifier`: its
/// `name_or_path` and `architectures`), so that re-exporting such a draft keeps it; `None`
/// for SpecForge's layout or a draft that names none.
fn source_verifier(draft: &Path) -> Result<Option<(String, Vec<String>)>> {
    let path = draft.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| PipelineError::io(&path, e))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| PipelineError::Config(format!("{}: {e}", path.display())))?;
    let verifier = &json["speculators_config"]["verifier"];
    let Some(name) = verifier["name_or_path"].as_str() else {
        return Ok(None);
    };
    let architectures: Vec<String> = verifier["architectures"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    if architectures.is_empty() {
        return Ok(None);
    }
    Ok(Some((name.to_string(), architectures)))
}

/// The `target_model` of the run a checkpoint belongs to.
fn run_target(checkpoint: &Path) -> Result<String> {
    let saved = checkpoint
        .parent()
        .map(|p| p.join(RUN_CONFIG_FILE))
        .filter(|p| p.is_file())
        .ok_or_else(|| {
            PipelineError::Config(format!(
                "--draft {} is not inside a run's output directory (no {RUN_CONFIG_FILE} beside \
                 it): name the target with --verifier",
                checkpoint.display()
            ))
        })?;
    let text = std::fs::read_to_string(&saved).map_err(|e| PipelineError::io(&saved, e))?;
    let run: SpeculatorConfig = serde_json::from_str(&text)
        .map_err(|e| PipelineError::Config(format!("{}: {e}", saved.display())))?;
    Ok(run.target_model.display().to_string())
}

/// The Hugging Face architecture of the verifier, from its configuration when it is found
/// here (a directory, a GGUF file, or a hub id in the local cache).
fn verifier_architecture(name: &str) -> Result<String> {
    let path = kd_model::hub::resolve_model_path(Path::new(name)).map_err(|e| {
        PipelineError::Config(format!(
            "--verifier {name}: {e} (its architecture goes into the speculators config)"
        ))
    })?;
    let config = kd_pipeline::models::model_config("verifier", &path)?;
    Ok(config.family.architecture().to_string())
}

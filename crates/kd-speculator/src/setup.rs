//! What both a run and its dry run establish before any weight is read: valid values, the
//! devices, both tokenizers agreeing, both model configurations, the prompts and their split,
//! an output directory that belongs to this run.

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use kd_data::ChatTokenizer;
use kd_model::{LlamaConfig, device::parse_device_list};

use crate::config::{DEFAULT_DRAFT_VOCAB_SIZE, DraftMethod, SpeculatorConfig};
use crate::data::{PromptSet, load_prompts, prompt_limit};
use crate::error::{PipelineError, Result};
use kd_pipeline::ranks::rank_device;
use kd_pipeline::vocab::{VocabDifference, vocab_difference};
use kd_train::checkpoint::step_checkpoints;

/// The file a run writes its configuration to, in `output_dir`.
pub const RUN_CONFIG_FILE: &str = "speculator_config.json";
/// The acceptance report of a run, in `output_dir`.
pub const ACCEPTANCE_FILE: &str = "acceptance.json";
/// The teacher cache directory inside `output_dir`.
pub const TEACHER_CACHE_DIR: &str = "teacher_cache";

/// A run's inputs, checked.
pub struct Setup {
    /// Devices of the target (one teacher replica each).
    pub target_devices: Vec<Device>,
    /// The device the draft trains on.
    pub draft_device: Device,
    /// The target's configuration, when the target is a local directory.
    pub target_config: Option<LlamaConfig>,
    /// The draft's configuration (with an EAGLE-3 draft, the target's: the draft shares its
    /// vocabulary and width).
    pub draft_config: LlamaConfig,
    /// The tokenizer prompts are rendered with (the target's when local, else the draft's).
    pub tokenizer: ChatTokenizer,
    /// The prompts and their split.
    pub prompts: PromptSet,
    /// Messages for the user that do not stop the run.
    pub warnings: Vec<String>,
}

fn devices(flag: &str, list: &str) -> Result<Vec<Device>> {
    let devices = parse_device_list(list)
        .map_err(|e| PipelineError::Config(format!("--{flag} {list:?}: {e}")))?;
    if devices.is_empty() {
        return Err(PipelineError::Config(format!("--{flag} names no device")));
    }
    Ok(devices)
}

/// Whether `dir` is a local model directory.
pub fn is_model_dir(dir: &Path) -> bool {
    kd_pipeline::models::is_local_model(dir)
}

fn model_config(flag: &str, dir: &Path) -> Result<LlamaConfig> {
    kd_pipeline::models::model_config(flag, dir)
}

/// Checks that draft and target share one vocabulary: same model vocabulary size and, when
/// both tokenizers are at hand, the same token → id map.
pub fn check_vocabularies(
    target: Option<(&LlamaConfig, Option<&ChatTokenizer>)>,
    draft: (&LlamaConfig, &ChatTokenizer),
) -> Result<()> {
    let Some((tc, tt)) = target else {
        return Ok(());
    };
    let (dc, dt) = draft;
    match vocab_difference((tc, tt), (dc, Some(dt))) {
        None => Ok(()),
        Some(VocabDifference::Size { first, second }) => Err(PipelineError::Config(format!(
            "vocabulary mismatch: the target's model has {first} tokens, the draft's {second}; a \
             draft must share the target's tokenizer"
        ))),
        Some(VocabDifference::Map {
            first,
            second,
            differing,
        }) => Err(PipelineError::Config(format!(
            "vocabulary mismatch: the target's tokenizer has {first} tokens, the draft's {second} \
             ({differing} of the target's map differently); a draft must share the target's \
             tokenizer"
        ))),
    }
}

/// Refuses an output directory that holds another run's checkpoints unless resuming.
pub fn check_output_dir(config: &SpeculatorConfig) -> Result<()> {
    let out = &config.output_dir;
    if out.exists() && !out.is_dir() {
        return Err(PipelineError::Config(format!(
            "--output_dir {} is a file, not a directory: choose another --output_dir",
            out.display()
        )));
    }
    if config.resume_from_checkpoint.is_some() || !out.exists() {
        return Ok(());
    }
    let checkpoints = step_checkpoints(out);
    let epoch_checkpoint = std::fs::read_dir(out)
        .map(|it| {
            it.flatten().any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("checkpoint-epoch-")
            })
        })
        .unwrap_or(false);
    if checkpoints.is_empty() && !epoch_checkpoint {
        return Ok(());
    }
    if config.overwrite_output_dir {
        // `run` clears it; a dry run must not.
        return Ok(());
    }
    let mut message = "holds checkpoints of an earlier run; continue it with \
                       --resume_from_checkpoint latest, replace it with --overwrite_output_dir, \
                       or choose another --output_dir"
        .to_string();
    let saved = out.join(RUN_CONFIG_FILE);
    if let Ok(text) = std::fs::read_to_string(&saved)
        && let Ok(old) = serde_json::from_str::<serde_json::Value>(&text)
        && let Ok(new) = serde_json::to_value(config)
    {
        let diffs: Vec<String> = new
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, v)| old.get(k.as_str()) != Some(v))
            .map(|(k, v)| {
                format!(
                    "{k} (then {}, now {v})",
                    old.get(k.as_str()).cloned().unwrap_or_default()
                )
            })
            .collect();
        if !diffs.is_empty() {
            message.push_str(&format!(
                "; that run's settings differ: {}",
                diffs.join(", ")
            ));
        }
    }
    Err(PipelineError::OutputDir {
        path: out.clone(),
        message,
    })
}

/// Removes an earlier run's checkpoints, logs and reports (not the teacher cache).
pub(crate) fn clear_run(out: &Path) -> Result<()> {
    kd_pipeline::clear_run(out, &[ACCEPTANCE_FILE, RUN_CONFIG_FILE])
}

/// An error naming `--data_dir` when it is missing or not a directory.
pub(crate) fn check_data_dir(data_dir: &Path) -> Result<()> {
    if data_dir.is_dir() {
        return Ok(());
    }
    Err(PipelineError::Config(format!(
        "--data_dir {} {}: it should hold */batch_input.jsonl files (OpenAI batch format)",
        data_dir.display(),
        if data_dir.exists() {
            "is not a directory"
        } else {
            "does not exist"
        }
    )))
}

/// Validates the configuration and reads everything but the weights.
pub fn setup(config: &SpeculatorConfig) -> Result<Setup> {
    config.validate()?;
    let mut warnings = Vec::new();
    let world = kd_dist::world();
    let mut target_devices = devices("target_gpus", &config.target_gpus)?;
    // Alone, the target keeps a replica on each device; across ranks, each rank's target
    // takes its own device, as the draft does.
    if world.is_distributed() {
        target_devices = vec![rank_device("--target_gpus", &target_devices, world)?.0];
    }
    let (draft_device, unused) = rank_device(
        "--draft_gpus",
        &devices("draft_gpus", &config.draft_gpus)?,
        world,
    )?;
    warnings.extend(unused);
    check_output_dir(config)?;
    let eagle3 = config.draft_method == DraftMethod::Eagle3;
    let target_local = is_model_dir(&config.target_model);
    let target_config = match (&config.teacher_url, target_local) {
        (None, _) => Some(model_config("target_model", &config.target_model)?),
        (Some(_), true) => Some(model_config("target_model", &config.target_model)?),
        (Some(url), false) if eagle3 => {
            return Err(PipelineError::Config(format!(
                "--target_model {} is not a local model directory: an EAGLE-3 draft is trained on \
                 the target's hidden states, computed here (the server at {url} may still \
                 generate the completions)",
                config.target_model.display()
            )));
        }
        (Some(url), false) => {
            warnings.push(format!(
                "--target_model {} is not a local directory: the target is only reachable at \
                 {url}, so acceptance (speculative decoding needs the target's logits here) \
                 will not be measured",
                config.target_model.display()
            ));
            None
        }
    };
    let target_tokenizer =
        if target_local && kd_pipeline::models::has_tokenizer(&config.target_model) {
            Some(
                ChatTokenizer::from_dir(&config.target_model)?
                    .with_template_variables(&config.chat_template_kwargs)?,
            )
        } else {
            None
        };
    // An EAGLE-3 draft has no model of its own: it shares the target's vocabulary and width.
    let (draft_config, draft_tokenizer) = match (eagle3, &target_config) {
        (true, Some(tc)) => {
            if target_tokenizer.is_none() {
                return Err(PipelineError::Config(format!(
                    "--target_model {} has no tokenizer (tokenizer.json or a GGUF's \
                     vocabulary): an EAGLE-3 run renders the prompts with it",
                    config.target_model.display()
                )));
            }
            check_eagle3_settings(config, tc)?;
            (tc.clone(), None)
        }
        _ => {
            let dc = model_config("draft_model", &config.draft_model)?;
            let dt = ChatTokenizer::from_dir(&config.draft_model)?
                .with_template_variables(&config.chat_template_kwargs)?;
            check_vocabularies(
                target_config
                    .as_ref()
                    .map(|c| (c, target_tokenizer.as_ref())),
                (&dc, &dt),
            )?;
            (dc, Some(dt))
        }
    };
    check_distill_layers(config, &draft_config, target_config.as_ref())?;
    let Some(tokenizer) = target_tokenizer.or(draft_tokenizer) else {
        unreachable!("a LoRA run reads the draft's tokenizer; an EAGLE-3 run the target's")
    };
    check_data_dir(&config.data_dir)?;
    let mut models = vec![("draft", draft_config.max_position_embeddings)];
    if let Some(tc) = &target_config {
        models.push(("target", tc.max_position_embeddings));
    }
    let prompts = load_prompts(
        config,
        &tokenizer,
        prompt_limit(Some(config.max_seq_length), &models),
    )?;
    warnings.extend(prompts.too_long.warning());
    if prompts.train.is_empty() {
        return Err(PipelineError::Config(
            "every prompt is held out for evaluation: lower --eval_fraction".into(),
        ));
    }
    Ok(Setup {
        target_devices,
        draft_device,
        target_config,
        draft_config,
        tokenizer,
        prompts,
        warnings,
    })
}

/// With `--use_distillation`, the hidden states named by `--distill_draft_layer` and
/// `--distill_target_layer` exist in their models.
fn check_distill_layers(
    config: &SpeculatorConfig,
    draft_config: &LlamaConfig,
    target_config: Option<&LlamaConfig>,
) -> Result<()> {
    if config.use_distillation
        && let Some(tc) = target_config
    {
        for (flag, layer, cfg) in [
            (
                "distill_draft_layer",
                config.distill_draft_layer,
                draft_config,
            ),
            ("distill_target_layer", config.distill_target_layer, tc),
        ] {
            if let Some(l) = layer
                && l > cfg.num_hidden_layers
            {
                return Err(PipelineError::Config(format!(
                    "--{flag} {l}: the model has hidden states 0..={} (0 = embeddings, {} = after \
                     the final norm)",
                    cfg.num_hidden_layers, cfg.num_hidden_layers
                )));
            }
        }
    }
    Ok(())
}

/// The EAGLE-3 settings that depend on the target: feature layers within its hidden states,
/// a draft vocabulary no larger than its own.
fn check_eagle3_settings(config: &SpeculatorConfig, target: &LlamaConfig) -> Result<()> {
    let layers = target.num_hidden_layers;
    if let Some(l) = config.aux_layers.iter().find(|l| **l == 0 || **l >= layers) {
        return Err(PipelineError::Config(format!(
            "--aux_layers {l}: expected 1 to {} for a target of {layers} layers (Hugging Face's \
             hidden_states[i], the input of decoder layer i, which SGLang, vLLM and llama.cpp \
             capture)",
            layers.saturating_sub(1)
        )));
    }
    if let Some(n) = config.draft_vocab_size
        && n > target.vocab_size
    {
        return Err(PipelineError::Config(format!(
            "--draft_vocab_size {n} is larger than the target's vocabulary ({} tokens): choose \
             at most {}",
            target.vocab_size, target.vocab_size
        )));
    }
    Ok(())
}

/// The draft vocabulary size of an EAGLE-3 run: `--draft_vocab_size`, else SpecForge's 32,000
/// or the target's vocabulary when smaller.
pub fn draft_vocab_size(config: &SpeculatorConfig, target_vocab: usize) -> usize {
    config
        .draft_vocab_size
        .unwrap_or(DEFAULT_DRAFT_VOCAB_SIZE.min(target_vocab))
}

/// The target layers an EAGLE-3 draft of this run reads: `--aux_layers`, else
/// `[2, L/2, L − 3]`.
pub fn aux_layers(config: &SpeculatorConfig, target: &LlamaConfig) -> [usize; 3] {
    match config.aux_layers.as_slice() {
        &[a, b, c] => [a, b, c],
        _ => crate::eagle3::default_feature_layers(target.num_hidden_layers),
    }
}

/// Where the teacher cache of a run lives.
pub fn teacher_cache_dir(config: &SpeculatorConfig) -> PathBuf {
    config
        .teacher_cache_dir
        .clone()
        .unwrap_or_else(|| config.output_dir.join(TEACHER_CACHE_DIR))
}

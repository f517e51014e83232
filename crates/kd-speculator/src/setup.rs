//! What both a run and its dry run establish before any weight is read: valid values, the
//! devices, both tokenizers agreeing, both model configurations, the prompts and their split,
//! an output directory that belongs to this run.

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use kd_data::ChatTokenizer;
use kd_model::{LlamaConfig, parse_device_list};

use crate::config::SpeculatorConfig;
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
    /// The draft's configuration.
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
    let draft_config = model_config("draft_model", &config.draft_model)?;
    let draft_tokenizer = ChatTokenizer::from_dir(&config.draft_model)?
        .with_template_variables(&config.chat_template_kwargs)?;
    let target_local = is_model_dir(&config.target_model);
    let target_config = match (&config.teacher_url, target_local) {
        (None, _) => Some(model_config("target_model", &config.target_model)?),
        (Some(_), true) => Some(model_config("target_model", &config.target_model)?),
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
    check_vocabularies(
        target_config
            .as_ref()
            .map(|c| (c, target_tokenizer.as_ref())),
        (&draft_config, &draft_tokenizer),
    )?;
    if config.use_distillation
        && let Some(tc) = &target_config
    {
        for (flag, layer, cfg) in [
            (
                "distill_draft_layer",
                config.distill_draft_layer,
                &draft_config,
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
    let tokenizer = target_tokenizer.unwrap_or(draft_tokenizer);
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

/// Where the teacher cache of a run lives.
pub fn teacher_cache_dir(config: &SpeculatorConfig) -> PathBuf {
    config
        .teacher_cache_dir
        .clone()
        .unwrap_or_else(|| config.output_dir.join(TEACHER_CACHE_DIR))
}

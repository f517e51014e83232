//! The speculator's other entry points: the acceptance report of any target/draft pair, the
//! merged export for serving, the teacher server, and the dry run's plan.

use std::path::{Path, PathBuf};

use kd_data::{ChatTokenizer, OpenAiBatchSource, Sampling};
use kd_eval::{AcceptanceReport, Eagle3Drafter, EvalOptions, EvalPhase, evaluate_across};
use kd_model::{Eagle3Draft, Llama, SaveDType, parse_device};
use kd_pipeline::models::local_model;
use kd_teacher::{LocalTeacher, ServeConfig, ServerHandle, model_fingerprint, spawn_server};
use serde::{Deserialize, Serialize};

use crate::config::SpeculatorConfig;
use crate::data::{LongPrompts, drop_long_prompts, prompt_limit};
use crate::error::{PipelineError, Result};
use crate::settings::eval_options;
use crate::setup::{check_data_dir, check_vocabularies, is_model_dir};

/// What `speculator eval` measures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Target model directory.
    pub target_model: PathBuf,
    /// Draft model directory, or an EAGLE-3 draft directory.
    pub draft_model: PathBuf,
    /// A PEFT adapter applied to the draft (a checkpoint directory of this pipeline or any
    /// PEFT adapter).
    pub adapter: Option<PathBuf>,
    /// `*/batch_input.jsonl` prompts (all of them, or `max_samples`).
    pub data_dir: PathBuf,
    /// Use at most this many prompts (a seeded sample).
    pub max_samples: Option<usize>,
    /// Device of both models.
    pub device: String,
    /// Speculative decoding settings.
    pub options: EvalOptions,
    /// Chat template variables (`--chat_template_kwargs`), as in training.
    pub chat_template_kwargs: std::collections::BTreeMap<String, serde_json::Value>,
    /// The target decodes from its GGUF blocks with 8-bit activations (integer dot products,
    /// `Llama::with_int8_activations`), for the target alone and with the draft alike.
    pub target_int8: bool,
    /// `target_int8` with the target's Q4_1 and Q8_0 products on AMX tiles
    /// (`Llama::with_amx_tiles`; CPUs with AMX-INT8 only).
    pub target_amx: bool,
    /// The draft decodes from Q8_0 blocks of its weights made at load, after merging the
    /// adapter (`Llama::with_q8_0_weights`, `Eagle3Draft::with_q8_0_weights`).
    pub draft_q8_0: bool,
}

impl Default for EvalConfig {
    fn default() -> Self {
        let spec = SpeculatorConfig::default();
        Self {
            target_model: spec.target_model.clone(),
            draft_model: spec.draft_model.clone(),
            adapter: None,
            data_dir: spec.data_dir.clone(),
            max_samples: Some(200),
            device: "cpu".into(),
            options: eval_options(&spec),
            chat_template_kwargs: spec.chat_template_kwargs,
            target_int8: false,
            target_amx: false,
            draft_q8_0: false,
        }
    }
}

/// What [`eval`] measured, and the prompts it left out.
#[derive(Debug, Clone)]
pub struct EvalOutcome {
    /// The acceptance report.
    pub report: AcceptanceReport,
    /// Prompts left out because they leave no room for a new token within the models'
    /// positions (the policy of training's generation: skipped, counted).
    pub too_long: LongPrompts,
}

/// The acceptance report of `config.draft_model` (plus adapter) serving
/// `config.target_model` on the prompts of `config.data_dir`. `draft_model` may also be an
/// EAGLE-3 draft directory (a checkpoint of `--draft_method eagle3`, or SpecForge's), which
/// reads the target layers its `config.json` names (else `[2, L/2, L − 3]`).
pub fn eval(
    config: &EvalConfig,
    mut progress: impl FnMut(EvalPhase, usize, usize),
) -> Result<EvalOutcome> {
    let device = parse_device(&config.device)?;
    // An EAGLE-3 draft directory (ours or SpecForge's) has no model or tokenizer of its own.
    let eagle3 = kd_model::eagle3::is_eagle3_dir(&config.draft_model);
    let config = &EvalConfig {
        target_model: local_model(&config.target_model)?,
        draft_model: if eagle3 {
            config.draft_model.clone()
        } else {
            local_model(&config.draft_model)?
        },
        ..config.clone()
    };
    if eagle3 && config.adapter.is_some() {
        return Err(PipelineError::Config(format!(
            "--draft_model {} is an EAGLE-3 draft: --adapter applies to a LoRA draft's base model",
            config.draft_model.display()
        )));
    }
    let tc = kd_pipeline::models::model_config("target_model", &config.target_model)?;
    let target_tok = ChatTokenizer::from_dir(&config.target_model)?
        .with_template_variables(&config.chat_template_kwargs)?;
    let mut limits = vec![("target", tc.max_position_embeddings)];
    let draft_config = if eagle3 {
        None
    } else {
        let dc = kd_pipeline::models::model_config("draft_model", &config.draft_model)?;
        let draft_tok = ChatTokenizer::from_dir(&config.draft_model)?
            .with_template_variables(&config.chat_template_kwargs)?;
        check_vocabularies(Some((&tc, Some(&target_tok))), (&dc, &draft_tok))?;
        limits.push(("draft", dc.max_position_embeddings));
        Some(dc)
    };
    check_data_dir(&config.data_dir)?;
    let source = OpenAiBatchSource::from_data_dir(&config.data_dir)?;
    let records = Sampling {
        max_samples: config.max_samples,
        shuffle: config.max_samples.is_some(),
        seed: config.options.seed,
    }
    .apply(source.records())?;
    let conversations: Vec<_> = records.iter().map(|r| r.messages.clone()).collect();
    let prompts = target_tok.encode_prompts(&conversations)?;
    let limit = prompt_limit(None, &limits);
    let (_, prompts, too_long) = drop_long_prompts(records, prompts, limit);
    if prompts.is_empty() {
        return Err(PipelineError::Config(format!(
            "--data_dir {}: no prompt to evaluate: {}",
            config.data_dir.display(),
            too_long
                .warning()
                .unwrap_or_else(|| "the batch files hold none".into())
        )));
    }
    let target = crate::settings::decoding_target(
        Llama::load_for_inference(&config.target_model, &device)?,
        &config.target_model,
        config.target_int8,
        config.target_amx,
    )?;
    // Under mpirun, each rank decodes its share of the prompts; all return the merged report.
    let world = kd_dist::world();
    let report = match draft_config {
        None => {
            let draft = Eagle3Draft::load(
                &config.draft_model,
                Some(target.embed_tokens.weight.val()),
                &device,
            )?
            .with_q8_0_weights(config.draft_q8_0);
            let layers = draft
                .config()
                .aux_layers
                .unwrap_or_else(|| crate::eagle3::default_feature_layers(tc.num_hidden_layers));
            let drafter = Eagle3Drafter::new(&draft, layers);
            evaluate_across(
                world,
                &target,
                &drafter,
                &prompts,
                &config.options,
                &mut progress,
            )?
        }
        Some(_) => {
            let mut draft = Llama::load(&config.draft_model, &device)?;
            if let Some(adapter) = &config.adapter {
                draft = draft.load_adapter(adapter)?.0.merge_and_unload();
            }
            let draft = draft.with_q8_0_weights(config.draft_q8_0);
            evaluate_across(
                world,
                &target,
                &draft,
                &prompts,
                &config.options,
                &mut progress,
            )?
        }
    };
    Ok(EvalOutcome { report, too_long })
}

/// The base model an adapter directory names (`base_model_name_or_path`).
pub fn adapter_base(adapter: &Path) -> Result<PathBuf> {
    let path = adapter.join("adapter_config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| PipelineError::io(&path, e))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| PipelineError::Config(format!("{}: invalid JSON: {e}", path.display())))?;
    value
        .get("base_model_name_or_path")
        .and_then(|v| v.as_str())
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .ok_or_else(|| {
            PipelineError::Config(format!(
                "{}: no base_model_name_or_path; pass the base model with --base_model",
                path.display()
            ))
        })
}

/// Merges an adapter into its base model and writes a Hugging Face directory (config,
/// safetensors, tokenizer files) that SGLang (`--speculative-draft-model-path`), vLLM and
/// transformers load. `base` defaults to the adapter's `base_model_name_or_path`.
pub fn merge(adapter: &Path, base: Option<&Path>, out: &Path, dtype: SaveDType) -> Result<()> {
    let base = local_model(&match base {
        Some(b) => b.to_path_buf(),
        None => adapter_base(adapter)?,
    })?;
    if !is_model_dir(&base) {
        return Err(PipelineError::Config(format!(
            "base model {}: not a model (no config.json, and not a .gguf file); pass it with \
             --base_model",
            base.display()
        )));
    }
    let device = parse_device("cpu")?;
    let (model, _) = Llama::load(&base, &device)?.load_adapter(adapter)?;
    // The checkpoint carries the tokenizer files; fall back to the base model's.
    let tokenizer_dir = if adapter.join("tokenizer.json").is_file() {
        adapter
    } else {
        base.as_path()
    };
    model.export_merged(out, dtype, None)?;
    kd_train::write_tokenizer_files(tokenizer_dir, out)?;
    Ok(())
}

/// Which layers a derived draft keeps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeepLayers {
    /// These layer indices.
    Layers(Vec<usize>),
    /// N layers spread evenly from the first to the last (first and last included).
    Evenly(usize),
}

impl KeepLayers {
    /// The layer indices for a model of `n` layers.
    pub fn indices(&self, n: usize) -> Result<Vec<usize>> {
        match self {
            Self::Layers(l) => Ok(l.clone()),
            Self::Evenly(0) => Err(PipelineError::Config("--keep must be at least 1".into())),
            Self::Evenly(k) if *k > n => Err(PipelineError::Config(format!(
                "--keep {k}: the model has only {n} layers"
            ))),
            Self::Evenly(1) => Ok(vec![0]),
            Self::Evenly(k) => Ok((0..*k).map(|i| i * (n - 1) / (k - 1)).collect()),
        }
    }
}

/// Derives a draft from a model: keeps the chosen decoder layers and shares the embeddings,
/// final norm and LM head; writes a Hugging Face directory (with the tokenizer files) in
/// the model's stored dtype. Returns the layers kept.
pub fn derive_draft(from: &Path, keep: &KeepLayers, out: &Path) -> Result<Vec<usize>> {
    let from = &local_model(from)?;
    if !is_model_dir(from) {
        return Err(PipelineError::Config(format!(
            "--from {}: not a model (no config.json, and not a .gguf file)",
            from.display()
        )));
    }
    let device = parse_device("cpu")?;
    let model = Llama::load(from, &device)?;
    let layers = keep.indices(model.config().num_hidden_layers)?;
    let dtype = match model.config().torch_dtype {
        Some(kd_model::StoredDType::BF16) => SaveDType::BF16,
        Some(kd_model::StoredDType::F16) => SaveDType::F16,
        _ => SaveDType::F32,
    };
    model.keep_layers(&layers)?.save(out, dtype)?;
    kd_train::write_tokenizer_files(from, out)?;
    Ok(layers)
}

/// `speculator serve-teacher`: the target behind SGLang's and OpenAI's APIs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeTeacherConfig {
    /// Target model directory.
    pub target_model: PathBuf,
    /// Address to listen on.
    pub listen: String,
    /// Device.
    pub device: String,
    /// Prompts generated together.
    pub batch_size: usize,
    /// Server settings (model name, batching wait, API key, limits).
    pub server: ServeConfig,
    /// Environment variable holding the API key (read at start: unset or empty is an error).
    pub api_key_env: Option<String>,
}

impl Default for ServeTeacherConfig {
    fn default() -> Self {
        Self {
            target_model: SpeculatorConfig::default().target_model,
            listen: "127.0.0.1:30000".into(),
            device: "cpu".into(),
            batch_size: 32,
            server: ServeConfig::default(),
            api_key_env: None,
        }
    }
}

/// Starts the teacher server (returns once it listens).
pub fn serve_teacher(config: &ServeTeacherConfig) -> Result<ServerHandle> {
    let mut server = config.server.clone();
    if let Some(name) = &config.api_key_env {
        server.api_key = Some(kd_teacher::api_key_from_env(name)?);
    }
    let device = parse_device(&config.device)?;
    let target = local_model(&config.target_model)?;
    let model = Llama::load_for_inference(&target, &device)?;
    let mut teacher = LocalTeacher::new(model, config.batch_size, model_fingerprint(&target)?);
    if kd_pipeline::models::has_tokenizer(&target) {
        teacher = teacher.with_tokenizer(ChatTokenizer::from_dir(&target)?);
    }
    Ok(spawn_server(teacher, &config.listen, server)?)
}

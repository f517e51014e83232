//! The speculator's other entry points: the acceptance report of any target/draft pair, the
//! merged export for serving, the teacher server, and the dry run's plan.

use std::path::{Path, PathBuf};

use kd_data::{ChatTokenizer, OpenAiBatchSource, Sampling};
use kd_eval::{AcceptanceReport, EvalOptions, EvalPhase, evaluate_across};
use kd_model::{Llama, LlamaConfig, SaveDType, parse_device};
use kd_pipeline::models::local_model;
use kd_teacher::{LocalTeacher, ServeConfig, ServerHandle, model_fingerprint, spawn_server};
use serde::{Deserialize, Serialize};

use crate::config::SpeculatorConfig;
use crate::data::{LongPrompts, drop_long_prompts, prompt_limit};
use crate::error::{PipelineError, Result};
use crate::settings::{eval_options, generation_params, lora_config, train_config};
use crate::setup::{check_data_dir, check_vocabularies, is_model_dir, setup, teacher_cache_dir};

/// What `speculator eval` measures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Target model directory.
    pub target_model: PathBuf,
    /// Draft model directory.
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
/// `config.target_model` on the prompts of `config.data_dir`.
pub fn eval(
    config: &EvalConfig,
    mut progress: impl FnMut(EvalPhase, usize, usize),
) -> Result<EvalOutcome> {
    let device = parse_device(&config.device)?;
    let config = &EvalConfig {
        target_model: local_model(&config.target_model)?,
        draft_model: local_model(&config.draft_model)?,
        ..config.clone()
    };
    let tc = kd_pipeline::models::model_config("target_model", &config.target_model)?;
    let dc = kd_pipeline::models::model_config("draft_model", &config.draft_model)?;
    let target_tok = ChatTokenizer::from_dir(&config.target_model)?
        .with_template_variables(&config.chat_template_kwargs)?;
    let draft_tok = ChatTokenizer::from_dir(&config.draft_model)?
        .with_template_variables(&config.chat_template_kwargs)?;
    check_vocabularies(Some((&tc, Some(&target_tok))), (&dc, &draft_tok))?;
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
    let limit = prompt_limit(
        None,
        &[
            ("target", tc.max_position_embeddings),
            ("draft", dc.max_position_embeddings),
        ],
    );
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
    let target = Llama::load_for_inference(&config.target_model, &device)?;
    let mut draft = Llama::load(&config.draft_model, &device)?;
    if let Some(adapter) = &config.adapter {
        draft = draft.load_adapter(adapter)?.0.merge_and_unload();
    }
    // Under mpirun, each rank decodes its share of the prompts; all return the merged report.
    let report = evaluate_across(
        kd_dist::world(),
        &target,
        &draft,
        &prompts,
        &config.options,
        &mut progress,
    )?;
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

/// What a run would do, established without reading any weight or writing anything.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Labelled lines: what, and its value.
    pub items: Vec<(String, String)>,
    /// Non-fatal problems.
    pub warnings: Vec<String>,
}

fn params(c: &LlamaConfig) -> String {
    format!(
        "{}, {} layers, hidden {}, vocab {}, {:.1}M parameters",
        c.family,
        c.num_hidden_layers,
        c.hidden_size,
        c.vocab_size,
        c.num_parameters() as f64 / 1e6
    )
}

/// The dry run: checks everything a run checks before loading weights and describes the
/// run (sizes, steps, where files go).
pub fn plan(config: &SpeculatorConfig) -> Result<Plan> {
    let given = config;
    let config = &config.with_local_models()?;
    let s = setup(config)?;
    let mut items = Vec::new();
    let mut put = |k: &str, v: String| items.push((k.to_string(), v));
    // Hub ids found in the Hugging Face cache: where they were found.
    for (what, id, path) in [
        ("target", &given.target_model, &config.target_model),
        ("draft", &given.draft_model, &config.draft_model),
    ] {
        if id != path {
            put(
                &format!("{what} id"),
                format!(
                    "{} found in the Hugging Face cache: {}",
                    id.display(),
                    path.display()
                ),
            );
        }
    }
    put(
        "target",
        match (&config.teacher_url, &s.target_config) {
            (Some(url), Some(c)) => format!(
                "{url} ({:?}); local copy: {}",
                config.teacher_api,
                params(c)
            ),
            (Some(url), None) => format!("{url} ({:?})", config.teacher_api),
            (None, Some(c)) => format!(
                "{} on {}: {}",
                config.target_model.display(),
                config.target_gpus,
                params(c)
            ),
            (None, None) => unreachable!("setup requires a local target without a URL"),
        },
    );
    put(
        "draft",
        format!(
            "{} on {}: {}",
            config.draft_model.display(),
            config.draft_gpus,
            params(&s.draft_config)
        ),
    );
    let p = &s.prompts;
    put(
        "prompts",
        format!(
            "{} from {} ({} for training, {} held out for acceptance; {} skipped, {} too \
             long for {} prompt tokens)",
            p.records.len(),
            config.data_dir.display(),
            p.train.len(),
            p.eval.len(),
            p.skipped.total(),
            p.too_long.ids.len(),
            p.too_long.max_prompt_tokens
        ),
    );
    let prompt_tokens: usize = p.train.iter().map(|i| p.ids[*i].len()).sum();
    let g = generation_params(config);
    put(
        "generation",
        format!(
            "{} prompts ({prompt_tokens} prompt tokens), at most {} new tokens each, {}, batch {}",
            p.train.len(),
            g.max_new_tokens,
            if g.temperature == 0.0 {
                "greedy".to_string()
            } else {
                format!(
                    "temperature {} top-p {} top-k {}",
                    g.temperature, g.top_p, g.top_k
                )
            },
            config.batch_size
        ),
    );
    let cache = teacher_cache_dir(config);
    let cached = std::fs::read_dir(cache.join("generations"))
        .map(|it| {
            it.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("shard-"))
                .count()
        })
        .unwrap_or(0);
    put(
        "teacher cache",
        format!(
            "{} ({cached} generation shards already there)",
            cache.display()
        ),
    );
    let lora = lora_config(config);
    let d = &s.draft_config;
    let per_layer: usize = lora_param_count(d, &config.lora_target_modules, lora.r);
    put(
        "LoRA",
        format!(
            "r {} α {} dropout {} on {}: {:.2}M trainable parameters ({:.2}% of the draft)",
            lora.r,
            lora.alpha,
            lora.dropout,
            config.lora_target_modules.join(","),
            (per_layer * d.num_hidden_layers) as f64 / 1e6,
            100.0 * (per_layer * d.num_hidden_layers) as f64 / d.num_parameters() as f64
        ),
    );
    let mut t = train_config(config);
    // Across ranks the trainer splits each micro-batch N ways more.
    let world = kd_dist::world();
    t.accumulation_shards *= world.size();
    if world.is_distributed() {
        put(
            "ranks",
            format!(
                "{} data-parallel ranks ({} on this machine), each on its share of every step",
                world.size(),
                world.local_size()
            ),
        );
    }
    let micro = p
        .train
        .len()
        .div_ceil(t.train_batch_size * t.accumulation_shards);
    let steps = micro.div_ceil(t.gradient_accumulation_steps) * t.num_epochs;
    put(
        "training",
        format!(
            "about {steps} optimizer steps ({} epochs × {} steps), effective batch {}, lr {:e} {} \
             with {:.0}% warmup, weight decay {}, clip {}",
            t.num_epochs,
            micro.div_ceil(t.gradient_accumulation_steps),
            t.effective_batch_size(),
            t.learning_rate,
            serde_json::to_value(t.scheduler_type)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
            t.warmup_ratio * 100.0,
            t.weight_decay,
            t.max_grad_norm
        ),
    );
    let mut loss = format!("{} · CE", config.ce_weight);
    if config.use_distillation {
        loss.push_str(&format!(
            " + {} · hidden MSE{}",
            config.distillation_weight,
            match &s.target_config {
                Some(tc) if tc.hidden_size != d.hidden_size =>
                    format!(" (projection {} → {})", d.hidden_size, tc.hidden_size),
                _ => String::new(),
            }
        ));
    }
    if config.kd_weight > 0.0 {
        loss.push_str(&format!(
            " + {} · {} over the target's top-{} at temperature {}",
            config.kd_weight,
            config.kd_objective().name(),
            config.kd_topk,
            config.temperature
        ));
    }
    put("loss", loss);
    if config.on_policy_ratio > 0.0 {
        put(
            "on-policy",
            format!(
                "{:.0}% of each step's rows completed by the draft (temperature {}, top-p {}, \
                 ≤ {} tokens), scored by the target, learned by {} · {} only",
                config.on_policy_ratio * 100.0,
                config.on_policy_temperature,
                config.on_policy_top_p,
                config.on_policy_max_new_tokens(),
                config.kd_weight,
                config.kd_objective().name(),
            ),
        );
    }
    put(
        "acceptance",
        if p.eval.is_empty() || s.target_config.is_none() {
            "not measured".to_string()
        } else {
            format!(
                "{} held-out prompts, k = {}, {} new tokens, batch {}, {}; before and after training{}",
                p.eval.len(),
                config.eval_k,
                config.eval_max_new_tokens,
                config.eval_batch_size,
                if config.eval_temperature == 0.0 {
                    "greedy".to_string()
                } else {
                    format!("temperature {}", config.eval_temperature)
                },
                if config.eval_steps > 0 {
                    format!(", and at checkpoints every {} steps", config.eval_steps)
                } else {
                    String::new()
                }
            )
        },
    );
    put(
        "output",
        format!(
            "{}: checkpoint-N/ (every {} steps, {} kept), checkpoint-epoch-E/, training_log.txt, \
             runs/, acceptance.json; teacher cache {}",
            config.output_dir.display(),
            config.save_steps,
            config.save_total_limit,
            teacher_cache_dir(config).display()
        ),
    );
    let mut warnings = s.warnings;
    if let Some(holder) = kd_pipeline::RunLock::holder(&config.output_dir)? {
        warnings.push(format!(
            "{} is in use by another run ({holder}): this run would be refused until it ends",
            config.output_dir.display()
        ));
    }
    Ok(Plan { items, warnings })
}

/// LoRA parameters of one layer for the named modules.
fn lora_param_count(c: &LlamaConfig, modules: &[String], r: usize) -> usize {
    let (d, q, kv, i) = (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.intermediate_size,
    );
    modules
        .iter()
        .map(|m| match m.as_str() {
            "q_proj" => r * (d + q),
            "k_proj" | "v_proj" => r * (d + kv),
            "o_proj" => r * (q + d),
            "gate_proj" | "up_proj" => r * (d + i),
            "down_proj" => r * (i + d),
            _ => 0,
        })
        .sum()
}

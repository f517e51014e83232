//! The command line: the seed's flags with their names and defaults (snake_case, as the seed
//! writes them; every `--a_b` is also accepted as `--a-b`), the subcommands, and the layering
//! of `--config FILE.yaml` under the flags given.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::str::FromStr;

use anyhow::{Result, bail};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory, Parser, Subcommand};
use kd_eval::{EvalOptions, SpecConfig};
use kd_model::{Sampling, SaveDType};
use kd_speculator::{EvalConfig, KeepLayers, ServeTeacherConfig, SpeculatorConfig};
use serde::Serialize;

fn d() -> SpeculatorConfig {
    SpeculatorConfig::default()
}

/// A serde enum's name (`cosine`, `forward_kl`, `sglang`).
fn name<T: Serialize>(v: T) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// A JSON object given on the command line (`--chat_template_kwargs '{"enable_thinking": false}'`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(transparent)]
pub struct JsonObject(pub BTreeMap<String, serde_json::Value>);

impl FromStr for JsonObject {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        serde_json::from_str(s).map(JsonObject).map_err(|e| {
            format!("expected a JSON object such as '{{\"enable_thinking\": false}}': {e}")
        })
    }
}

impl std::fmt::Display for JsonObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&serde_json::to_string(&self.0).map_err(|_| std::fmt::Error)?)
    }
}

/// Train a draft model for speculative decoding on a target model's generations.
///
/// Without a subcommand, `train` runs (so the seed's command lines work as written).
#[derive(Parser, Debug)]
#[command(
    name = "speculator",
    version,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    /// What to do (default: train).
    #[command(subcommand)]
    pub command: Option<Command>,
    /// `train`'s flags, accepted without the subcommand.
    #[command(flatten)]
    pub train: TrainArgs,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate with the target, train the draft's LoRA adapters, measure acceptance before
    /// and after (the default).
    Train(Box<TrainArgs>),
    /// The acceptance report of a target/draft pair (with an adapter or not).
    Eval(EvalArgs),
    /// Merge an adapter into its base model: a Hugging Face directory to serve as the draft.
    Merge(MergeArgs),
    /// Serve the target over SGLang's and OpenAI's HTTP APIs (generation on one machine,
    /// training on another with --teacher_url).
    ServeTeacher(ServeArgs),
    /// Derive a draft from a model: keep some decoder layers, share embeddings, norm and head.
    DeriveDraft(DeriveArgs),
    /// Write an EAGLE-3 draft (a checkpoint of --draft_method eagle3) for SGLang, vLLM or
    /// llama.cpp.
    Export(ExportArgs),
}

/// `speculator export`.
#[derive(Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct ExportArgs {
    /// The EAGLE-3 draft directory (e.g. OUTPUT_DIR/checkpoint-epoch-2).
    #[arg(long)]
    pub draft: PathBuf,
    /// The server: `sglang` (SpecForge's layout), `vllm` (the speculators format) or `gguf`
    /// (llama.cpp's `eagle3` GGUF file).
    #[arg(long, value_parser = ["sglang", "vllm", "gguf"])]
    pub to: String,
    /// Where the exported directory goes (`--to gguf`: the .gguf file).
    #[arg(long)]
    pub out: PathBuf,
    /// `--to vllm`: the target as vLLM names it; `--to gguf`: the target's .gguf file, whose
    /// tokenizer the draft carries [default: the run's --target_model].
    #[arg(long)]
    pub verifier: Option<String>,
    /// `--to vllm`: tokens drafted per verification written into the config.
    #[arg(long, default_value_t = 3)]
    pub speculative_tokens: usize,
    /// `--to gguf`: the type of the draft's matrices (norms stay f32).
    #[arg(long, default_value = "f16", value_parser = ["f32", "f16", "q8_0"])]
    pub gguf_type: String,
}

impl ExportArgs {
    /// The library configuration.
    pub fn config(&self) -> kd_speculator::ExportConfig {
        kd_speculator::ExportConfig {
            draft: self.draft.clone(),
            out: self.out.clone(),
            to: match self.to.as_str() {
                "vllm" => kd_speculator::ExportTarget::Vllm,
                "gguf" => kd_speculator::ExportTarget::Gguf,
                _ => kd_speculator::ExportTarget::Sglang,
            },
            verifier: self.verifier.clone(),
            speculative_tokens: self.speculative_tokens,
            gguf_type: match self.gguf_type.as_str() {
                "f32" => kd_speculator::GgufWeightType::F32,
                "q8_0" => kd_speculator::GgufWeightType::Q8_0,
                _ => kd_speculator::GgufWeightType::F16,
            },
        }
    }
}

/// `speculator derive-draft`.
#[derive(Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct DeriveArgs {
    /// The model to derive from (usually the target).
    #[arg(long)]
    pub from: PathBuf,
    /// Layer indices to keep, e.g. 0,4,8.
    #[arg(
        long,
        value_delimiter = ',',
        conflicts_with = "keep",
        required_unless_present = "keep"
    )]
    pub layers: Vec<usize>,
    /// Keep N layers spread evenly (first and last included).
    #[arg(long)]
    pub keep: Option<usize>,
    /// Where the draft goes.
    #[arg(long)]
    pub out: PathBuf,
}

impl DeriveArgs {
    /// The layers to keep.
    pub fn keep(&self) -> KeepLayers {
        match self.keep {
            Some(n) => KeepLayers::Evenly(n),
            None => KeepLayers::Layers(self.layers.clone()),
        }
    }
}

/// `speculator train`: the seed's flags and this toolkit's additions.
#[derive(Args, Debug, Serialize)]
#[command(rename_all = "snake_case")]
pub struct TrainArgs {
    /// A YAML file of flag names → values; flags given on the command line override it.
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Check everything, print the plan and sizes, write nothing.
    #[arg(long)]
    #[serde(skip)]
    pub dry_run: bool,

    /// Path of the target (teacher) model.
    #[arg(long, default_value_os_t = d().target_model)]
    pub target_model: PathBuf,
    /// Path of the draft (student) model.
    #[arg(long, default_value_os_t = d().draft_model)]
    pub draft_model: PathBuf,
    /// Directory containing */batch_input.jsonl files.
    #[arg(long, default_value_os_t = d().data_dir)]
    pub data_dir: PathBuf,
    /// Output directory for checkpoints.
    #[arg(long, default_value_os_t = d().output_dir)]
    pub output_dir: PathBuf,
    /// Batch size of the target's generation.
    #[arg(long, default_value_t = d().batch_size)]
    pub batch_size: usize,
    /// Training batch size per device.
    #[arg(long, default_value_t = d().train_batch_size)]
    pub train_batch_size: usize,
    /// Gradient accumulation steps.
    #[arg(long, default_value_t = d().gradient_accumulation_steps)]
    pub gradient_accumulation_steps: usize,
    /// Shards each micro-batch is split into, gradients summed (one process with N shards
    /// trains exactly what `mpirun -np N` ranks train).
    #[arg(long, default_value_t = d().accumulation_shards)]
    pub accumulation_shards: usize,
    /// Number of training epochs.
    #[arg(long, default_value_t = d().num_epochs)]
    pub num_epochs: usize,
    /// Learning rate.
    #[arg(long, default_value_t = d().learning_rate)]
    pub learning_rate: f64,
    /// Warmup ratio.
    #[arg(long, default_value_t = d().warmup_ratio)]
    pub warmup_ratio: f64,
    /// LR scheduler type: cosine, linear or constant.
    #[arg(long, default_value_t = name(d().scheduler_type))]
    pub scheduler_type: String,
    /// Maximum sequence length.
    #[arg(long, default_value_t = d().max_seq_length)]
    pub max_seq_length: usize,
    /// Enable the hidden-state distillation loss (a learned projection bridges different
    /// widths).
    #[arg(long)]
    pub use_distillation: bool,
    /// Weight of the distillation loss.
    #[arg(long, default_value_t = d().distillation_weight)]
    pub distillation_weight: f64,
    /// Weight of the cross-entropy loss.
    #[arg(long, default_value_t = d().ce_weight)]
    pub ce_weight: f64,
    /// Temperature for distillation (of the --kd_weight term).
    #[arg(long, default_value_t = d().temperature)]
    pub temperature: f64,
    /// LoRA rank.
    #[arg(long, default_value_t = d().lora_r)]
    pub lora_r: usize,
    /// LoRA alpha.
    #[arg(long, default_value_t = d().lora_alpha)]
    pub lora_alpha: f64,
    /// LoRA dropout.
    #[arg(long, default_value_t = d().lora_dropout)]
    pub lora_dropout: f64,
    /// Devices of the target: GPU ids ("0,1,2,3"), cuda:N, or cpu (the default without CUDA).
    #[arg(long, default_value_t = d().target_gpus)]
    pub target_gpus: String,
    /// Devices of the draft.
    #[arg(long, default_value_t = d().draft_gpus)]
    pub draft_gpus: String,
    /// Save a checkpoint every N steps.
    #[arg(long, default_value_t = d().save_steps)]
    pub save_steps: usize,
    /// Maximum step checkpoints to keep.
    #[arg(long, default_value_t = d().save_total_limit)]
    pub save_total_limit: usize,
    /// Log every N steps.
    #[arg(long, default_value_t = d().logging_steps)]
    pub logging_steps: usize,
    /// Limit the number of training samples.
    #[arg(long)]
    pub max_samples: Option<usize>,

    /// Weight of a token-level KD term over the target's top-k log-probs (0 = off).
    #[arg(long, default_value_t = d().kd_weight)]
    pub kd_weight: f64,
    /// Its divergence: forward_kl, reverse_kl, skewed_forward_kl, skewed_reverse_kl,
    /// adaptive_kl, js_divergence, tv_distance [default: tv_distance with
    /// --on_policy_ratio > 0 (it matches sampling acceptance), else forward_kl].
    #[arg(long)]
    pub kd_objective: Option<String>,
    /// Log-probs per position the target records for it.
    #[arg(long, default_value_t = d().kd_topk)]
    pub kd_topk: usize,
    /// A remote teacher (e.g. http://gpu-box:30000) instead of loading the target here.
    #[arg(long)]
    pub teacher_url: Option<String>,
    /// The remote teacher's API: sglang (/generate), openai (/v1/completions) or llamacpp
    /// (llama.cpp's /completion; generation only: llama.cpp cannot score prompts).
    #[arg(long, default_value_t = name(d().teacher_api))]
    pub teacher_api: String,
    /// The served model's name (OpenAI API).
    #[arg(long)]
    pub teacher_model_name: Option<String>,
    /// Requests to the remote teacher in flight at most.
    #[arg(long, default_value_t = d().teacher_max_concurrency)]
    pub teacher_max_concurrency: usize,
    /// Seconds one request to the remote teacher may take.
    #[arg(long, default_value_t = d().teacher_timeout_s)]
    pub teacher_timeout_s: f64,
    /// Retries of a failed request to the remote teacher (with exponential backoff).
    #[arg(long, default_value_t = d().teacher_max_retries)]
    pub teacher_max_retries: u32,
    /// Tokens the target generates at most per prompt.
    #[arg(long, default_value_t = d().max_new_tokens)]
    pub max_new_tokens: usize,
    /// Sampling temperature of the target's generations (0 = greedy).
    #[arg(long, default_value_t = d().generation_temperature)]
    pub generation_temperature: f32,
    /// Top-p of the target's generations.
    #[arg(long, default_value_t = d().generation_top_p)]
    pub generation_top_p: f32,
    /// Top-k of the target's generations (0 = all).
    #[arg(long, default_value_t = d().generation_top_k)]
    pub generation_top_k: usize,
    /// Seed of the split, data order, LoRA init, dropout and sampling.
    #[arg(long, default_value_t = d().seed)]
    pub seed: u64,
    /// Continue a run exactly: `latest` or a checkpoint directory.
    #[arg(long, conflicts_with = "init_adapter")]
    pub resume_from_checkpoint: Option<String>,
    /// Start from these adapter weights (a warm start; fresh optimizer and schedule).
    #[arg(long)]
    pub init_adapter: Option<PathBuf>,
    /// Replace an earlier run's checkpoints and reports in --output_dir (its teacher cache is
    /// kept and reused where it matches).
    #[arg(long, conflicts_with = "resume_from_checkpoint")]
    pub overwrite_output_dir: bool,
    /// Share of prompts held out for the acceptance measurement.
    #[arg(long, default_value_t = d().eval_fraction)]
    pub eval_fraction: f64,
    /// At most this many held-out prompts.
    #[arg(long, default_value_t = d().eval_max_prompts)]
    pub eval_max_prompts: usize,
    /// Tokens drafted per verification when measuring acceptance.
    #[arg(long, default_value_t = d().eval_k)]
    pub eval_k: usize,
    /// Measure acceptance at checkpoints every N steps too (0 = before/after only).
    #[arg(long, default_value_t = d().eval_steps)]
    pub eval_steps: usize,
    /// Tokens generated per held-out prompt when measuring acceptance.
    #[arg(long, default_value_t = d().eval_max_new_tokens)]
    pub eval_max_new_tokens: usize,
    /// Held-out prompts decoded together when measuring acceptance.
    #[arg(long, default_value_t = d().eval_batch_size)]
    pub eval_batch_size: usize,
    /// Sampling temperature when measuring acceptance (0 = greedy).
    #[arg(long, default_value_t = d().eval_temperature)]
    pub eval_temperature: f32,
    /// When measuring acceptance, stop drafting a row at the first draft whose probability
    /// under the draft is below this (llama.cpp's --draft-p-min); 0 always drafts --eval_k.
    #[arg(long, default_value_t = d().eval_draft_p_min)]
    pub eval_draft_p_min: f32,
    /// When measuring acceptance, decode the draft from Q8_0 blocks of its weights (made at
    /// load; training is unchanged).
    #[arg(long)]
    pub eval_draft_q8_0: bool,
    /// Draft hidden state distilled (output_hidden_states index; default the last).
    #[arg(long)]
    pub distill_draft_layer: Option<usize>,
    /// Target hidden state it is compared with (default the last).
    #[arg(long)]
    pub distill_target_layer: Option<usize>,
    /// Modules that get LoRA adapters.
    #[arg(long, value_delimiter = ',', default_values_t = d().lora_target_modules)]
    pub lora_target_modules: Vec<String>,
    /// Chat template variables as a JSON object, as vLLM's `chat_template_kwargs`
    /// (e.g. '{"enable_thinking": false}' for Qwen3).
    #[arg(long, default_value_t = JsonObject::default())]
    pub chat_template_kwargs: JsonObject,
    /// AdamW weight decay.
    #[arg(long, default_value_t = d().weight_decay)]
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0 = off).
    #[arg(long, default_value_t = d().max_grad_norm)]
    pub max_grad_norm: f64,
    /// On-policy distillation: the share λ of each step's rows the draft completes itself,
    /// scored by the target and learned through --kd_weight's KD term only (0 = off).
    #[arg(long, default_value_t = d().on_policy_ratio)]
    pub on_policy_ratio: f64,
    /// The draft's sampling temperature for on-policy rows (0 = greedy).
    #[arg(long, default_value_t = d().on_policy_temperature)]
    pub on_policy_temperature: f32,
    /// The draft's top-p for on-policy rows.
    #[arg(long, default_value_t = d().on_policy_top_p)]
    pub on_policy_top_p: f32,
    /// Tokens the draft samples at most per on-policy row [default: --max_new_tokens].
    #[arg(long)]
    pub on_policy_max_new_tokens: Option<usize>,
    /// Cut each on-policy completion to the length of the target's completion it replaces
    /// (equal label tokens per row, for comparisons at equal teacher tokens).
    #[arg(long)]
    pub on_policy_match_length: bool,
    /// Where the target's generations and scores are cached [default:
    /// OUTPUT_DIR/teacher_cache]; runs sharing one reuse each other's teacher work.
    #[arg(long)]
    pub teacher_cache_dir: Option<PathBuf>,
    /// The draft: `lora` (LoRA adapters on --draft_model) or `eagle3` (an EAGLE-3 head over
    /// the target's hidden states; --draft_model is not used, --init_adapter may name an
    /// EAGLE-3 draft directory to start from).
    #[arg(long, default_value = "lora", value_parser = ["lora", "eagle3"])]
    pub draft_method: String,
    /// EAGLE-3: tokens of the draft vocabulary [default: 32000, or the target's vocabulary
    /// when smaller].
    #[arg(long)]
    pub draft_vocab_size: Option<usize>,
    /// EAGLE-3: training-time-test steps unrolled per position.
    #[arg(long, default_value_t = d().ttt_length)]
    pub ttt_length: usize,
    /// EAGLE-3: the three target hidden states read, e.g. 2,15,27 [default: 2, L/2, L − 3].
    #[arg(long, value_delimiter = ',')]
    pub aux_layers: Vec<usize>,
    /// EAGLE-3: how a fresh draft's output layer starts: `random` (SpecForge's) or `target`
    /// (the target's LM head rows of the draft vocabulary and its final norm).
    #[arg(long, default_value_t = name(d().draft_head_init), value_parser = ["random", "target"])]
    pub draft_head_init: String,
}

/// `speculator eval`.
#[derive(Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct EvalArgs {
    /// Path of the target model.
    #[arg(long)]
    pub target_model: PathBuf,
    /// Path of the draft model, or of an EAGLE-3 draft directory (a checkpoint of
    /// `--draft_method eagle3`, or SpecForge's export).
    #[arg(long)]
    pub draft_model: PathBuf,
    /// A PEFT adapter for the draft (e.g. a checkpoint of `speculator train`).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Directory containing */batch_input.jsonl files.
    #[arg(long)]
    pub data_dir: PathBuf,
    /// Prompts to use (a seeded sample).
    #[arg(long, default_value_t = 200)]
    pub max_samples: usize,
    /// Tokens drafted per verification.
    #[arg(long, default_value_t = d().eval_k)]
    pub eval_k: usize,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = d().eval_max_new_tokens)]
    pub eval_max_new_tokens: usize,
    /// Prompts decoded together.
    #[arg(long, default_value_t = d().eval_batch_size)]
    pub eval_batch_size: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = d().eval_temperature)]
    pub eval_temperature: f32,
    /// A draft/target cost ratio for the theoretical speedup (default: measured).
    #[arg(long)]
    pub cost_ratio: Option<f64>,
    /// Stop drafting a row early at the first draft whose probability under the draft is below
    /// this (llama.cpp's --draft-p-min); 0 always drafts --eval_k.
    #[arg(long, default_value_t = 0.0)]
    pub draft_p_min: f32,
    /// Decode the target (a GGUF file) with 8-bit activations and integer dot products.
    #[arg(long)]
    pub target_int8: bool,
    /// Decode the draft from Q8_0 blocks of its weights, made at load (after merging the
    /// adapter).
    #[arg(long)]
    pub draft_q8_0: bool,
    /// Chat template variables as a JSON object (e.g. '{"enable_thinking": false}').
    #[arg(long, default_value_t = JsonObject::default())]
    pub chat_template_kwargs: JsonObject,
    /// Seed of the prompt sample and of sampling.
    #[arg(long, default_value_t = d().seed)]
    pub seed: u64,
    /// Device of both models.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Also write the report as JSON here, and its per-position acceptance as an SVG chart
    /// beside it (the same name, extension `svg`).
    #[arg(long)]
    pub output: Option<PathBuf>,
}

impl EvalArgs {
    /// The library configuration.
    pub fn config(&self) -> EvalConfig {
        EvalConfig {
            target_model: self.target_model.clone(),
            draft_model: self.draft_model.clone(),
            adapter: self.adapter.clone(),
            data_dir: self.data_dir.clone(),
            max_samples: Some(self.max_samples),
            device: self.device.clone(),
            chat_template_kwargs: self.chat_template_kwargs.0.clone(),
            target_int8: self.target_int8,
            draft_q8_0: self.draft_q8_0,
            options: EvalOptions {
                spec: SpecConfig {
                    k: self.eval_k,
                    max_new_tokens: self.eval_max_new_tokens,
                    sampling: Sampling::temperature(self.eval_temperature),
                    stop_token_ids: Vec::new(),
                    draft_p_min: self.draft_p_min,
                },
                batch_size: self.eval_batch_size,
                seed: self.seed,
                baselines: true,
                cost_ratio: self.cost_ratio,
            },
        }
    }
}

/// `speculator merge`.
#[derive(Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct MergeArgs {
    /// The adapter (a checkpoint directory).
    #[arg(long)]
    pub adapter: PathBuf,
    /// Where the merged model goes.
    #[arg(long)]
    pub out: PathBuf,
    /// The base model (default: the adapter's base_model_name_or_path).
    #[arg(long)]
    pub base_model: Option<PathBuf>,
    /// Weight dtype of the export: bf16, f16 or f32.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f16", "f32"])]
    pub dtype: String,
}

impl MergeArgs {
    /// The export dtype.
    pub fn dtype(&self) -> SaveDType {
        match self.dtype.as_str() {
            "f16" => SaveDType::F16,
            "f32" => SaveDType::F32,
            _ => SaveDType::BF16,
        }
    }
}

/// `speculator serve-teacher`.
#[derive(Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct ServeArgs {
    /// Path of the target model.
    #[arg(long)]
    pub target_model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:30000")]
    pub listen: String,
    /// Device.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Prompts generated together.
    #[arg(long, default_value_t = d().batch_size)]
    pub batch_size: usize,
    /// The model name reported to clients.
    #[arg(long, default_value = "teacher")]
    pub model_name: String,
    /// Require `Authorization: Bearer <key>` with the key in this environment variable
    /// (unset or empty is an error).
    #[arg(long)]
    pub api_key_env: Option<String>,
    /// Serve without a key on an address other than loopback (refused otherwise).
    #[arg(long)]
    pub allow_unauthenticated: bool,
    /// Most prompts in one request.
    #[arg(long, default_value_t = ServeTeacherConfig::default().server.max_prompts_per_request)]
    pub max_prompts_per_request: usize,
    /// Most new tokens a request may ask for per prompt.
    #[arg(long, default_value_t = ServeTeacherConfig::default().server.max_new_tokens)]
    pub max_new_tokens_limit: usize,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = ServeTeacherConfig::default().server.max_body_bytes)]
    pub max_body_bytes: usize,
}

impl ServeArgs {
    /// The library configuration.
    pub fn config(&self) -> ServeTeacherConfig {
        let mut c = ServeTeacherConfig {
            target_model: self.target_model.clone(),
            listen: self.listen.clone(),
            device: self.device.clone(),
            batch_size: self.batch_size,
            ..ServeTeacherConfig::default()
        };
        c.server.model_name = self.model_name.clone();
        c.server.allow_unauthenticated = self.allow_unauthenticated;
        c.server.max_prompts_per_request = self.max_prompts_per_request;
        c.server.max_new_tokens = self.max_new_tokens_limit;
        c.server.max_body_bytes = self.max_body_bytes;
        c.api_key_env = self.api_key_env.clone();
        c
    }
}

/// Adds the kebab-case spelling of every snake_case flag as an alias, in every subcommand.
fn kebab_aliases(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| match a.get_long().map(str::to_string) {
        // clap keeps `&'static str` names; the command is built once per process.
        Some(long) if long.contains('_') => {
            a.alias(&*Box::leak(long.replace('_', "-").into_boxed_str()))
        }
        _ => a,
    })
    .mut_subcommands(kebab_aliases)
}

/// The command with its aliases.
pub fn command() -> clap::Command {
    kebab_aliases(Cli::command())
}

/// The run's configuration: `--config` (when given) with the flags given on the command
/// line on top; without `--config`, the flags and their defaults (the seed's).
pub fn train_config(args: &TrainArgs, matches: &ArgMatches) -> Result<SpeculatorConfig> {
    let all = match serde_json::to_value(args)? {
        serde_json::Value::Object(m) => m,
        _ => bail!("the flags serialise to an object"),
    };
    let overrides = match &args.config {
        None => all,
        Some(_) => all
            .into_iter()
            .filter(|(k, _)| matches.value_source(k) == Some(ValueSource::CommandLine))
            .collect(),
    };
    Ok(SpeculatorConfig::layered(
        args.config.as_deref(),
        overrides,
    )?)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use clap::FromArgMatches;
    use kd_loss::KdObjective;
    use kd_train::SchedulerType;

    use super::*;

    /// Parses a command line as `main` does (the default subcommand included).
    fn parse(line: &str) -> Result<SpeculatorConfig> {
        let argv = std::iter::once("speculator").chain(line.split_whitespace());
        let matches = command().try_get_matches_from(argv)?;
        let cli = Cli::from_arg_matches(&matches)?;
        match cli.command {
            None => train_config(&cli.train, &matches),
            Some(Command::Train(t)) => {
                train_config(&t, matches.subcommand_matches("train").unwrap())
            }
            Some(other) => bail!("not a training command: {other:?}"),
        }
    }

    /// The seed's "Custom Configuration" command line, flag for flag.
    const SEED_CUSTOM: &str = "--target_model meta-llama/Llama-3.1-8B-Instruct \
        --draft_model meta-llama/Llama-3.2-1B-Instruct --data_dir /data/shared/datasets/sft_llama \
        --output_dir ./checkpoints_speculator --batch_size 32 --train_batch_size 4 \
        --gradient_accumulation_steps 4 --num_epochs 3 --learning_rate 2e-4 --lora_r 64 \
        --lora_alpha 128 --target_gpus 0,1,2,3 --draft_gpus 4,5,6,7 --save_steps 500";

    #[test]
    fn eagle3_flags_reach_the_configuration() {
        let c = parse(
            "--draft_method eagle3 --draft_vocab_size 8192 --ttt_length 5 --aux_layers 2,15,27",
        )
        .unwrap();
        assert_eq!(c.draft_method, kd_speculator::DraftMethod::Eagle3);
        assert_eq!(
            (c.draft_vocab_size, c.ttt_length, c.aux_layers),
            (Some(8192), 5, vec![2, 15, 27])
        );
        let c = parse("").unwrap();
        assert_eq!(c.draft_method, kd_speculator::DraftMethod::Lora);
        assert!(parse("--draft_method medusa").is_err());
        assert_eq!(c.draft_head_init, kd_speculator::DraftHeadInit::Random);
        let c = parse("--draft_method eagle3 --draft_head_init target").unwrap();
        assert_eq!(c.draft_head_init, kd_speculator::DraftHeadInit::Target);
        assert!(parse("--draft_head_init zeros").is_err());
    }

    #[test]
    fn the_seeds_command_lines_parse_with_its_meaning() {
        let c = parse(SEED_CUSTOM).unwrap();
        assert_eq!(
            c.target_model,
            Path::new("meta-llama/Llama-3.1-8B-Instruct")
        );
        assert_eq!(c.draft_model, Path::new("meta-llama/Llama-3.2-1B-Instruct"));
        assert_eq!(c.data_dir, Path::new("/data/shared/datasets/sft_llama"));
        assert_eq!(c.output_dir, Path::new("./checkpoints_speculator"));
        assert_eq!((c.batch_size, c.train_batch_size), (32, 4));
        assert_eq!((c.gradient_accumulation_steps, c.num_epochs), (4, 3));
        assert_eq!((c.learning_rate, c.lora_r, c.lora_alpha), (2e-4, 64, 128.0));
        assert_eq!(
            (c.target_gpus.as_str(), c.draft_gpus.as_str()),
            ("0,1,2,3", "4,5,6,7")
        );
        assert_eq!(c.save_steps, 500);
        // "Testing with Limited Data".
        let c = parse("--max_samples 10000 --num_epochs 1 --save_steps 100").unwrap();
        assert_eq!(
            (c.max_samples, c.num_epochs, c.save_steps),
            (Some(10_000), 1, 100)
        );
        // The `train` subcommand is the same command.
        assert_eq!(
            parse(&format!("train {SEED_CUSTOM}")).unwrap(),
            parse(SEED_CUSTOM).unwrap()
        );
        // Kebab-case spellings are the same flags.
        let kebab = SEED_CUSTOM
            .replace('_', "-")
            .replace("sft-llama", "sft_llama");
        let kebab = kebab.replace("checkpoints-speculator", "checkpoints_speculator");
        assert_eq!(parse(&kebab).unwrap(), parse(SEED_CUSTOM).unwrap());
    }

    /// The defaults of the seed's "Arguments Reference", one by one.
    #[test]
    fn defaults_are_the_seeds() {
        let c = parse("").unwrap();
        assert_eq!(c.max_seq_length, 2048);
        assert_eq!(c.batch_size, 32);
        assert_eq!(c.train_batch_size, 4);
        assert_eq!(c.gradient_accumulation_steps, 4);
        assert_eq!(c.num_epochs, 3);
        assert_eq!(c.learning_rate, 2e-4);
        assert_eq!(c.warmup_ratio, 0.03);
        assert_eq!(c.scheduler_type, SchedulerType::Cosine);
        assert!(!c.use_distillation);
        assert_eq!(c.distillation_weight, 0.5);
        assert_eq!(c.ce_weight, 0.5);
        assert_eq!(c.temperature, 2.0);
        assert_eq!((c.lora_r, c.lora_alpha, c.lora_dropout), (64, 128.0, 0.05));
        assert_eq!(
            (c.save_steps, c.save_total_limit, c.logging_steps),
            (500, 3, 10)
        );
        assert_eq!(c.max_samples, None);
        // "Gradient Clipping: Max norm of 1.0", "Weight Decay: 0.01", all seven projections.
        assert_eq!((c.max_grad_norm, c.weight_decay), (1.0, 0.01));
        assert_eq!(
            c.lora_target_modules,
            [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj"
            ]
        );
        // Devices: the seed's GPUs in a CUDA build, the CPU otherwise.
        let (t, d) = if kd_model::device::cuda_compiled() {
            ("0,1,2,3", "4,5,6,7")
        } else {
            ("cpu", "cpu")
        };
        assert_eq!((c.target_gpus.as_str(), c.draft_gpus.as_str()), (t, d));
        assert_eq!(c, SpeculatorConfig::default());
        let c =
            parse("--use_distillation --scheduler_type linear --kd_objective tv_distance").unwrap();
        assert!(c.use_distillation);
        assert_eq!(c.scheduler_type, SchedulerType::Linear);
        assert_eq!(c.kd_objective, Some(KdObjective::TvDistance));
    }

    #[test]
    fn a_config_file_is_overridden_by_the_flags_given() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("run.yaml");
        std::fs::write(&file, "lora_r: 8\nnum_epochs: 5\nscheduler_type: linear\n").unwrap();
        let c = parse(&format!("--config {} --num_epochs 2", file.display())).unwrap();
        assert_eq!((c.lora_r, c.num_epochs), (8, 2));
        assert_eq!(c.scheduler_type, SchedulerType::Linear);
        // Flags left at their defaults do not override the file.
        assert_eq!(c.learning_rate, 2e-4);
        // Unknown keys and bad values name the key and the file.
        std::fs::write(&file, "lora_rank: 8\n").unwrap();
        let e = parse(&format!("--config {}", file.display()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("lora_rank") && e.contains("run.yaml"), "{e}");
        std::fs::write(&file, "scheduler_type: cosine_with_restarts\n").unwrap();
        let e = parse(&format!("--config {}", file.display()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cosine_with_restarts") && e.contains("linear"),
            "{e}"
        );
        assert!(parse("--scheduler_type step").is_err());
        assert!(parse("--resume_from_checkpoint latest --init_adapter x").is_err());
    }

    #[test]
    fn chat_template_kwargs_are_a_json_object() {
        // split_whitespace in `parse`: the JSON must not contain spaces.
        let c = parse(r#"--chat_template_kwargs {"enable_thinking":false}"#).unwrap();
        assert_eq!(
            c.chat_template_kwargs.get("enable_thinking"),
            Some(&serde_json::Value::Bool(false))
        );
        assert!(parse("").unwrap().chat_template_kwargs.is_empty());
        let e = parse("--chat_template_kwargs [1]").unwrap_err().to_string();
        assert!(e.contains("JSON object"), "{e}");
    }
}

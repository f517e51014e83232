//! `speculator train`: its flags and the layering of `--config` under them.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args};
use kd_speculator::SpeculatorConfig;
use serde::Serialize;

use super::{JsonObject, d, name};

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
    /// At most this many held-out prompts (the rest of --eval_fraction's share is trained on).
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
    /// Decode the target from its GGUF blocks with 8-bit activations (integer dot products)
    /// for its generation, the hidden states training reads and the acceptance measurements.
    #[arg(long)]
    pub target_int8: bool,
    /// --target_int8 with the target's Q4_1 and Q8_0 products on AMX tiles (CPUs with
    /// AMX-INT8: Sapphire Rapids and later Xeons).
    #[arg(long)]
    pub target_amx: bool,
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
    /// EAGLE-3: the width of a fresh draft's MLP [default: the target's intermediate_size].
    #[arg(long)]
    pub draft_intermediate_size: Option<usize>,
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
    /// EAGLE-3: MiB of memory for the target's features and final hidden state of each
    /// training row, so that epochs after the first skip the target (0: run it on every
    /// micro-batch). Per process: N data-parallel ranks on one machine may hold N times it.
    #[arg(long, default_value_t = d().target_cache_mb)]
    pub target_cache_mb: usize,
    /// EAGLE-3: also keep what the target gives each training row on disk, in DIR (one
    /// safetensors file per row), and read it back there in later runs instead of running the
    /// target: reruns with other settings, resumes and continued drafts skip the target. A
    /// target in this process (on one device or several) keeps each row as it generates the
    /// completion, so that training runs no pass of the target (but over a row whose prompt
    /// --max_seq_length cuts).
    #[arg(long, value_name = "DIR")]
    pub target_cache_dir: Option<PathBuf>,
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

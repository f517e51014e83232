//! `SpeculatorConfig`: every flag of the speculator seed (same names, same defaults) and what
//! this toolkit adds, as one serde struct (YAML keys = flag names; unknown keys refused).

use std::path::{Path, PathBuf};

use kd_loss::KdObjective;
use kd_teacher::RemoteApi;
use serde::{Deserialize, Serialize};

use crate::error::{PipelineError, Result};
use kd_train::SchedulerType;

/// The speculator pipeline's configuration. Field names are the seed's flags
/// (`--target_model`, `--lora_r`, …); defaults are the seed's, except that the device lists
/// default to `cpu` in a build without CUDA.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpeculatorConfig {
    // --- The seed's flags ---
    /// Target (teacher) model directory (Hugging Face layout). With `teacher_url` it is used
    /// for the acceptance measurement only, when it exists locally.
    pub target_model: PathBuf,
    /// Draft (student) model directory (Hugging Face layout, with tokenizer files).
    pub draft_model: PathBuf,
    /// Directory of `*/batch_input.jsonl` files (OpenAI batch format).
    pub data_dir: PathBuf,
    /// Where checkpoints, logs, the teacher cache and the acceptance report go.
    pub output_dir: PathBuf,
    /// Prompts the teacher generates at once.
    pub batch_size: usize,
    /// Training rows per micro-batch.
    pub train_batch_size: usize,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Shards each micro-batch is split into on this rank, their gradients summed: one process
    /// with N shards trains exactly what N data-parallel ranks (`mpirun -np N`) train.
    pub accumulation_shards: usize,
    /// Passes over the training data.
    pub num_epochs: usize,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Warmup as a fraction of all steps.
    pub warmup_ratio: f64,
    /// `cosine` or `linear` decay after warmup (`constant` too).
    pub scheduler_type: SchedulerType,
    /// Longest training example (prompt + completion) in tokens.
    pub max_seq_length: usize,
    /// Add the hidden-state MSE between draft and target (through a learned projection when
    /// the widths differ).
    pub use_distillation: bool,
    /// Weight of the hidden-state MSE.
    pub distillation_weight: f64,
    /// Weight of the cross-entropy on the target's completions.
    pub ce_weight: f64,
    /// Temperature of the distillation term (applies to `kd_weight`'s logit KD).
    pub temperature: f64,
    /// LoRA rank.
    pub lora_r: usize,
    /// LoRA alpha.
    pub lora_alpha: f64,
    /// LoRA dropout.
    pub lora_dropout: f64,
    /// Devices of the target: GPU indices (`"0,1,2,3"`), `cuda:N`, or `cpu`.
    pub target_gpus: String,
    /// Devices of the draft (the first one trains).
    pub draft_gpus: String,
    /// Save `checkpoint-N` every this many steps (0 = only at the end).
    pub save_steps: usize,
    /// Step checkpoints kept at most.
    pub save_total_limit: usize,
    /// Log every this many steps.
    pub logging_steps: usize,
    /// Use at most this many prompts.
    pub max_samples: Option<usize>,

    // --- Beyond the seed ---
    /// Weight of a token-level KD term over the target's top-k log-probs (0 = off).
    pub kd_weight: f64,
    /// The divergence of that term (default: `tv_distance` with on-policy rows, whose
    /// minimiser is the sampling acceptance; `forward_kl` otherwise).
    pub kd_objective: Option<KdObjective>,
    /// Log-probs the target records per position for it.
    pub kd_topk: usize,
    /// A remote teacher (SGLang `/generate` or an OpenAI-compatible `/v1/completions`)
    /// instead of loading the target in this process.
    pub teacher_url: Option<String>,
    /// The remote teacher's API.
    pub teacher_api: RemoteApi,
    /// The served model's name (OpenAI API `model` field).
    pub teacher_model_name: Option<String>,
    /// Requests to the remote teacher in flight at most.
    pub teacher_max_concurrency: usize,
    /// Seconds one request to the remote teacher may take.
    pub teacher_timeout_s: f64,
    /// Retries of a failed request to the remote teacher (connection errors, 429, 5xx), with
    /// exponential backoff.
    pub teacher_max_retries: u32,
    /// Tokens the target generates at most per prompt.
    pub max_new_tokens: usize,
    /// Sampling temperature of the target's generations (0 = greedy).
    pub generation_temperature: f32,
    /// Top-p of the target's generations.
    pub generation_top_p: f32,
    /// Top-k of the target's generations (0 = all).
    pub generation_top_k: usize,
    /// Seed of the data split, order, LoRA init, dropout and sampling.
    pub seed: u64,
    /// Continue a run exactly: `latest` or a checkpoint directory.
    pub resume_from_checkpoint: Option<String>,
    /// Start from these adapter weights (a warm start: fresh optimizer and schedule); with
    /// `draft_method: eagle3`, an EAGLE-3 draft directory (ours or SpecForge's).
    pub init_adapter: Option<PathBuf>,
    /// Replace an earlier run's checkpoints, logs and reports in `output_dir` (its teacher
    /// cache is kept and reused where it matches).
    pub overwrite_output_dir: bool,
    /// Share of the prompts held out for the acceptance measurement (never trained on).
    pub eval_fraction: f64,
    /// At most this many held-out prompts.
    pub eval_max_prompts: usize,
    /// Tokens the draft proposes per verification in the acceptance measurement.
    pub eval_k: usize,
    /// Measure acceptance at every checkpoint too, every this many steps (0 = before and
    /// after training only).
    pub eval_steps: usize,
    /// Tokens generated per held-out prompt in the acceptance measurement.
    pub eval_max_new_tokens: usize,
    /// Held-out prompts decoded together in the acceptance measurement.
    pub eval_batch_size: usize,
    /// Sampling temperature of the acceptance measurement (0 = greedy).
    pub eval_temperature: f32,
    /// In the acceptance measurement, a row stops drafting at the first draft whose
    /// probability under the draft is below this (llama.cpp's `--draft-p-min`; 0 always drafts
    /// `eval_k`).
    pub eval_draft_p_min: f32,
    /// In the acceptance measurement, the draft decodes from Q8_0 blocks of its weights, made
    /// at load (`Llama::with_q8_0_weights`, `Eagle3Draft::with_q8_0_weights`), as `speculator
    /// eval --draft_q8_0` does; training is unchanged.
    pub eval_draft_q8_0: bool,
    /// The local target decodes from its GGUF blocks with 8-bit activations (integer dot
    /// products, `Llama::with_int8_activations`), as `speculator eval --target_int8` does:
    /// its generation, the hidden states training reads, and the acceptance measurements.
    pub target_int8: bool,
    /// `target_int8` with the target's Q4_1 and Q8_0 products on AMX tiles
    /// (`Llama::with_amx_tiles`; CPUs with AMX-INT8 only).
    pub target_amx: bool,
    /// The draft's hidden state distilled (transformers' `output_hidden_states` index;
    /// default: the last, after the final norm).
    pub distill_draft_layer: Option<usize>,
    /// The target's hidden state it is compared with (default: the last).
    pub distill_target_layer: Option<usize>,
    /// Modules that get LoRA adapters.
    pub lora_target_modules: Vec<String>,
    /// Variables for the chat templates of target and draft, as vLLM's and SGLang's
    /// `chat_template_kwargs` (e.g. Qwen3's `{"enable_thinking": false}`); empty, each
    /// template's own defaults apply, as in transformers.
    pub chat_template_kwargs: std::collections::BTreeMap<String, serde_json::Value>,
    /// On-policy distillation (DistillSpec / GKD): the share λ of every step's rows that the
    /// draft completes itself, scored by the target and learned through the KD term (0 = off,
    /// 1 = only on-policy rows).
    pub on_policy_ratio: f64,
    /// The draft's sampling temperature for on-policy rows (0 = greedy).
    pub on_policy_temperature: f32,
    /// The draft's top-p for on-policy rows.
    pub on_policy_top_p: f32,
    /// Tokens the draft samples at most per on-policy row (default: `max_new_tokens`).
    pub on_policy_max_new_tokens: Option<usize>,
    /// Cut each on-policy completion to the length of the target's completion it replaces
    /// (equal label tokens per row: arms compared at equal teacher tokens).
    pub on_policy_match_length: bool,
    /// Where the target's generations and scores are cached (default:
    /// `output_dir/teacher_cache`); runs sharing one reuse each other's teacher work.
    pub teacher_cache_dir: Option<PathBuf>,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0 = off).
    pub max_grad_norm: f64,
    /// The kind of draft trained: `lora` (the seed's: LoRA adapters on `draft_model`) or
    /// `eagle3` (an EAGLE-3 head reading the target's hidden states; `draft_model` unused).
    pub draft_method: DraftMethod,
    /// EAGLE-3: tokens of the draft vocabulary, the most frequent of the training
    /// completions (default: 32,000, SpecForge's, or the target's vocabulary when smaller).
    pub draft_vocab_size: Option<usize>,
    /// EAGLE-3: the width of a fresh draft's MLP (its `intermediate_size`; default: the
    /// target's, as SpecForge builds it). A draft started from `init_adapter` keeps its own.
    pub draft_intermediate_size: Option<usize>,
    /// EAGLE-3: training-time-test steps unrolled per position (SpecForge's default 7).
    pub ttt_length: usize,
    /// EAGLE-3: the three target hidden states the draft reads, low / mid / high, in Hugging
    /// Face's `output_hidden_states` indexing (empty: `[2, L/2, L − 3]` for `L` layers, the
    /// choice of EAGLE-3, SpecForge and SGLang).
    pub aux_layers: Vec<usize>,
    /// EAGLE-3: how a fresh draft's output layer starts (`random`: N(0, 0.02²) and a final
    /// norm of ones, SpecForge's; `target`: the target's LM head rows of the draft vocabulary
    /// and its final norm, as vLLM's `speculators` starts its `lm_head`).
    pub draft_head_init: DraftHeadInit,
    /// EAGLE-3: memory, in MiB, for what the target gives each training row (its features and
    /// final hidden state), so that later epochs skip the target's forward pass;
    /// rows beyond it run through the target every epoch (0: every row, every epoch). Each
    /// data-parallel rank keeps its own rows up to it.
    pub target_cache_mb: usize,
    /// EAGLE-3: a directory where what the target gives each training row also goes to disk
    /// (one safetensors file per row, about 9.2 KB a token position at SmolLM2's width), and
    /// where a later run over the same rows reads it back instead of running the target
    /// (`None`: memory only, [`target_cache_mb`](Self::target_cache_mb)). With the target in
    /// this process (on one device or several), each row is kept as the target generates its
    /// completion, and training runs no pass of the target (except over a row whose prompt
    /// `max_seq_length` cut). Refused when it holds the rows of another target or other
    /// layers.
    pub target_cache_dir: Option<PathBuf>,
}

/// How a fresh EAGLE-3 draft's output layer (`norm`, `lm_head`) starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DraftHeadInit {
    /// Drawn from N(0, 0.02²), the norm at one (SpecForge's).
    #[default]
    Random,
    /// The target's LM head rows of the draft vocabulary and the target's final norm.
    Target,
}

/// The kind of draft a run trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DraftMethod {
    /// LoRA adapters on a small model sharing the target's tokenizer (the seed's draft).
    #[default]
    Lora,
    /// An EAGLE-3 head: one decoder layer over three of the target's hidden states, a reduced
    /// vocabulary, trained with training-time test (SpecForge's `LlamaForCausalLMEagle3`).
    Eagle3,
}

/// SpecForge's default draft vocabulary size.
pub const DEFAULT_DRAFT_VOCAB_SIZE: usize = 32_000;

/// The default device list of the target: the seed's GPUs in a CUDA build, else the CPU.
pub fn default_target_devices() -> &'static str {
    if kd_model::device::cuda_compiled() {
        "0,1,2,3"
    } else {
        "cpu"
    }
}

/// The default device list of the draft.
pub fn default_draft_devices() -> &'static str {
    if kd_model::device::cuda_compiled() {
        "4,5,6,7"
    } else {
        "cpu"
    }
}

impl Default for SpeculatorConfig {
    fn default() -> Self {
        Self {
            target_model: "meta-llama/Llama-3.1-8B-Instruct".into(),
            draft_model: "meta-llama/Llama-3.2-1B-Instruct".into(),
            data_dir: "/data/shared/datasets/sft_llama".into(),
            output_dir: "./checkpoints_speculator".into(),
            batch_size: 32,
            train_batch_size: 4,
            gradient_accumulation_steps: 4,
            accumulation_shards: 1,
            num_epochs: 3,
            learning_rate: 2e-4,
            warmup_ratio: 0.03,
            scheduler_type: SchedulerType::Cosine,
            max_seq_length: 2048,
            use_distillation: false,
            distillation_weight: 0.5,
            ce_weight: 0.5,
            temperature: 2.0,
            lora_r: 64,
            lora_alpha: 128.0,
            lora_dropout: 0.05,
            target_gpus: default_target_devices().into(),
            draft_gpus: default_draft_devices().into(),
            save_steps: 500,
            save_total_limit: 3,
            logging_steps: 10,
            max_samples: None,
            kd_weight: 0.0,
            kd_objective: None,
            kd_topk: 20,
            teacher_url: None,
            teacher_api: RemoteApi::Sglang,
            teacher_model_name: None,
            teacher_max_concurrency: 32,
            teacher_timeout_s: 600.0,
            teacher_max_retries: 6,
            max_new_tokens: 512,
            generation_temperature: 0.0,
            generation_top_p: 1.0,
            generation_top_k: 0,
            seed: 42,
            resume_from_checkpoint: None,
            init_adapter: None,
            overwrite_output_dir: false,
            eval_fraction: 0.05,
            eval_max_prompts: 200,
            eval_k: 4,
            eval_steps: 0,
            eval_max_new_tokens: 128,
            eval_batch_size: 8,
            eval_temperature: 0.0,
            eval_draft_p_min: 0.0,
            eval_draft_q8_0: false,
            target_int8: false,
            target_amx: false,
            distill_draft_layer: None,
            distill_target_layer: None,
            lora_target_modules: [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ]
            .map(String::from)
            .to_vec(),
            chat_template_kwargs: Default::default(),
            weight_decay: 0.01,
            max_grad_norm: 1.0,
            on_policy_ratio: 0.0,
            on_policy_temperature: 1.0,
            on_policy_top_p: 1.0,
            on_policy_max_new_tokens: None,
            on_policy_match_length: false,
            teacher_cache_dir: None,
            draft_method: DraftMethod::Lora,
            draft_vocab_size: None,
            draft_intermediate_size: None,
            ttt_length: 7,
            aux_layers: Vec::new(),
            draft_head_init: DraftHeadInit::Random,
            target_cache_mb: 4096,
            target_cache_dir: None,
        }
    }
}

impl SpeculatorConfig {
    /// The same configuration with `target_model` and `draft_model` as local paths: a hub id
    /// (`meta-llama/Llama-3.2-1B-Instruct`, as the seed's command lines name models) found in
    /// the local Hugging Face cache becomes its snapshot directory
    /// ([`kd_model::hub::resolve_model_path`]); anything else is left as given.
    /// With a remote teacher (`teacher_url`) the target is only looked up, never downloaded.
    pub fn with_local_models(&self) -> crate::error::Result<Self> {
        Ok(Self {
            target_model: if self.teacher_url.is_some() {
                kd_model::hub::resolve_model_path(&self.target_model)?
            } else {
                kd_pipeline::models::local_model(&self.target_model)?
            },
            // An EAGLE-3 run has no draft model to find.
            draft_model: match self.draft_method {
                DraftMethod::Lora => kd_pipeline::models::local_model(&self.draft_model)?,
                DraftMethod::Eagle3 => self.draft_model.clone(),
            },
            ..self.clone()
        })
    }

    /// The KD objective: the one given, else `tv_distance` with on-policy rows and
    /// `forward_kl` without.
    pub fn kd_objective(&self) -> KdObjective {
        self.kd_objective.unwrap_or(if self.on_policy_ratio > 0.0 {
            KdObjective::TvDistance
        } else {
            KdObjective::ForwardKl
        })
    }

    /// Tokens the draft samples at most per on-policy row.
    pub fn on_policy_max_new_tokens(&self) -> usize {
        self.on_policy_max_new_tokens.unwrap_or(self.max_new_tokens)
    }

    /// Reads a YAML file (keys = flag names; unknown keys are errors naming the key).
    pub fn from_yaml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| PipelineError::io(path, e))?;
        Self::from_yaml_str(&text).map_err(|e| match e {
            PipelineError::Config(m) => PipelineError::Config(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// A configuration in layers: the YAML file (when given), then `overrides` (flag name →
    /// value, e.g. what was given on the command line) on top. Unknown keys in either are
    /// errors naming the key (and the file).
    pub fn layered(
        file: Option<&Path>,
        overrides: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self> {
        let mut value = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| PipelineError::io(path, e))?;
                let v: serde_json::Value = if text.trim().is_empty() {
                    serde_json::Value::Object(Default::default())
                } else {
                    serde_yaml::from_str(&text).map_err(|e| {
                        PipelineError::Config(format!("{}: invalid YAML: {e}", path.display()))
                    })?
                };
                if !v.is_object() {
                    return Err(PipelineError::Config(format!(
                        "{}: expected a mapping of flag names to values",
                        path.display()
                    )));
                }
                v
            }
            None => serde_json::Value::Object(Default::default()),
        };
        let map = value.as_object_mut().expect("checked to be an object");
        map.extend(overrides);
        serde_json::from_value(value).map_err(|e| {
            PipelineError::Config(match file {
                Some(path) => format!("{}: {e}", path.display()),
                None => e.to_string(),
            })
        })
    }

    /// Parses YAML text (see [`from_yaml_file`](Self::from_yaml_file)).
    pub fn from_yaml_str(text: &str) -> Result<Self> {
        if text.trim().is_empty() {
            return Ok(Self::default());
        }
        serde_yaml::from_str(text).map_err(|e| PipelineError::Config(e.to_string()))
    }

    /// Checks every value; messages name the flag.
    pub fn validate(&self) -> Result<()> {
        self.validate_counts_and_weights()?;
        self.validate_ranges_and_combinations()
    }

    /// Counts at least 1, rates positive, weights ≥ 0, and at least one loss term on (an
    /// EAGLE-3 run checks its own settings there instead, `validate_eagle3`).
    fn validate_counts_and_weights(&self) -> Result<()> {
        let bad = |m: String| Err(PipelineError::Config(m));
        for (flag, v) in [
            ("batch_size", self.batch_size),
            ("train_batch_size", self.train_batch_size),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
            ("accumulation_shards", self.accumulation_shards),
            ("max_seq_length", self.max_seq_length),
            ("lora_r", self.lora_r),
            ("logging_steps", self.logging_steps),
            ("max_new_tokens", self.max_new_tokens),
            ("eval_k", self.eval_k),
            ("eval_max_new_tokens", self.eval_max_new_tokens),
            ("eval_batch_size", self.eval_batch_size),
        ] {
            if v == 0 {
                return bad(format!("--{flag} must be at least 1"));
            }
        }
        if self.num_epochs == 0 {
            return bad("--num_epochs must be at least 1".into());
        }
        if self.max_samples == Some(0) {
            return bad("--max_samples must be at least 1 when given".into());
        }
        for (flag, v) in [
            ("learning_rate", self.learning_rate),
            ("temperature", self.temperature),
            ("lora_alpha", self.lora_alpha),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                return bad(format!("--{flag} must be a positive number, got {v}"));
            }
        }
        for (flag, v) in [
            ("ce_weight", self.ce_weight),
            ("distillation_weight", self.distillation_weight),
            ("kd_weight", self.kd_weight),
            ("weight_decay", self.weight_decay),
            ("max_grad_norm", self.max_grad_norm),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return bad(format!("--{flag} must be ≥ 0, got {v}"));
            }
        }
        if self.draft_method == DraftMethod::Eagle3 {
            // The LoRA draft's loss terms do not apply (refused there by name).
            self.validate_eagle3()?;
        } else if self.ce_weight == 0.0
            && self.kd_weight == 0.0
            && !(self.use_distillation && self.distillation_weight > 0.0)
        {
            return bad(
                "every loss term is off: set --ce_weight, --kd_weight or --use_distillation with \
                 --distillation_weight above 0"
                    .into(),
            );
        }
        Ok(())
    }

    /// Ranges of the fractions and sampling settings, and the flags that exclude each other.
    fn validate_ranges_and_combinations(&self) -> Result<()> {
        let bad = |m: String| Err(PipelineError::Config(m));
        if !(0.0..1.0).contains(&self.warmup_ratio) {
            return bad(format!(
                "--warmup_ratio must lie in [0, 1), got {}",
                self.warmup_ratio
            ));
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return bad(format!(
                "--lora_dropout must lie in [0, 1), got {}",
                self.lora_dropout
            ));
        }
        if !(0.0..1.0).contains(&self.eval_fraction) {
            return bad(format!(
                "--eval_fraction must lie in [0, 1), got {}",
                self.eval_fraction
            ));
        }
        if self.kd_weight > 0.0 && self.kd_topk == 0 {
            return bad("--kd_topk must be at least 1 when --kd_weight > 0".into());
        }
        kd_pipeline::on_policy::check_on_policy_settings(
            self.on_policy_ratio,
            self.on_policy_max_new_tokens(),
            self.on_policy_temperature,
            self.on_policy_top_p,
            &|k| format!("--{k}"),
        )?;
        if self.on_policy_ratio > 0.0 {
            if self.kd_weight == 0.0 {
                return bad(
                    "--on_policy_ratio > 0: the draft's own completions learn through the KD \
                     term only; set --kd_weight (e.g. 1.0)"
                        .into(),
                );
            }
            if self.teacher_url.is_some() && self.teacher_api == RemoteApi::Llamacpp {
                return bad(
                    "--on_policy_ratio > 0 needs a teacher that scores the draft's completions; \
                     llama.cpp's server returns no prompt log-probs: use --teacher_api sglang or \
                     openai (vLLM), or the target in this process"
                        .into(),
                );
            }
        }
        for (flag, t) in [
            ("generation_temperature", self.generation_temperature),
            ("eval_temperature", self.eval_temperature),
        ] {
            if !(t >= 0.0 && t.is_finite()) {
                return bad(format!("--{flag} must be ≥ 0, got {t}"));
            }
        }
        if !(0.0..=1.0).contains(&self.eval_draft_p_min) {
            return bad(format!(
                "--eval_draft_p_min is a probability in [0, 1], got {}",
                self.eval_draft_p_min
            ));
        }
        if !(self.generation_top_p > 0.0 && self.generation_top_p <= 1.0) {
            return bad(format!(
                "--generation_top_p must lie in (0, 1], got {}",
                self.generation_top_p
            ));
        }
        if self.resume_from_checkpoint.is_some() && self.init_adapter.is_some() {
            return bad(
                "--resume_from_checkpoint (exact continuation) and --init_adapter (warm start \
                 from adapter weights) exclude each other: give one"
                    .into(),
            );
        }
        if self.resume_from_checkpoint.is_some() && self.overwrite_output_dir {
            return bad(
                "--resume_from_checkpoint continues the run in --output_dir and \
                 --overwrite_output_dir replaces it: give one"
                    .into(),
            );
        }
        if self.lora_target_modules.is_empty() {
            return bad("--lora_target_modules names no module".into());
        }
        Ok(())
    }

    /// What an EAGLE-3 run checks beyond the common values.
    fn validate_eagle3(&self) -> Result<()> {
        let bad = |m: String| Err(PipelineError::Config(m));
        if self.ttt_length == 0 {
            return bad("--ttt_length must be at least 1".into());
        }
        if self.draft_vocab_size == Some(0) {
            return bad("--draft_vocab_size must be at least 1".into());
        }
        if self.draft_intermediate_size == Some(0) {
            return bad("--draft_intermediate_size must be at least 1".into());
        }
        if !matches!(self.aux_layers.len(), 0 | 3) {
            return bad(format!(
                "--aux_layers {:?}: an EAGLE-3 draft reads three target hidden states (low, mid, \
                 high), e.g. --aux_layers 2,15,27",
                self.aux_layers
            ));
        }
        for (flag, on) in [
            ("use_distillation", self.use_distillation),
            ("kd_weight", self.kd_weight > 0.0),
            ("on_policy_ratio", self.on_policy_ratio > 0.0),
        ] {
            if on {
                return bad(format!(
                    "--{flag} applies to the LoRA draft; an EAGLE-3 draft learns the target's \
                     distributions through its TTT loss: drop --{flag} or use --draft_method lora"
                ));
            }
        }
        Ok(())
    }
}

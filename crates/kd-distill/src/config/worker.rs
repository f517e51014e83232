//! The sections of a worker (`student`, `teacher`, `validation`): ROLL's `WorkerConfig` with
//! its `model_args`, `training_args` and `data_args`, the fields with a meaning here, and the
//! device mappings ROLL writes as Python expressions.

use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Numeric precision of a worker (`model_args.dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ModelDType {
    /// f32.
    #[default]
    Fp32,
    /// bfloat16.
    Bf16,
    /// float16.
    Fp16,
}

/// `model_args` of a worker (ROLL's `ModelArguments`, the fields with a meaning here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelArgs {
    /// The model directory (Hugging Face layout). Defaults to `student_pretrain` /
    /// `teacher_pretrain`.
    pub model_name_or_path: Option<PathBuf>,
    /// A PEFT adapter to start from (student) or to apply (teacher).
    pub adapter_name_or_path: Option<PathBuf>,
    /// Precision. The CPU backend computes in f32 whatever is asked (a warning says so).
    pub dtype: ModelDType,
    /// LoRA rank (used when `lora_target` is set).
    pub lora_rank: Option<usize>,
    /// LoRA alpha; absent = 2 × rank (ROLL's rule).
    pub lora_alpha: Option<f64>,
    /// LoRA dropout.
    pub lora_dropout: f64,
    /// Modules that get adapters: comma-separated names (`q_proj,v_proj`), `all-linear` /
    /// `all`, or a list. Set = LoRA training; absent = full fine-tuning.
    pub lora_target: Option<LoraTarget>,
}

impl Default for ModelArgs {
    fn default() -> Self {
        Self {
            model_name_or_path: None,
            adapter_name_or_path: None,
            dtype: ModelDType::Fp32,
            lora_rank: None,
            lora_alpha: None,
            lora_dropout: 0.0,
            lora_target: None,
        }
    }
}

/// `lora_target`: a comma-separated string or a list of module names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LoraTarget {
    /// `"q_proj,v_proj"` or `"all-linear"`.
    Text(String),
    /// `[q_proj, v_proj]`.
    List(Vec<String>),
}

impl LoraTarget {
    /// Module names; `all-linear` / `all` = the seven projections of a Llama layer.
    pub fn modules(&self) -> Vec<String> {
        let names: Vec<String> = match self {
            Self::Text(s) => s.split(',').map(|x| x.trim().to_string()).collect(),
            Self::List(v) => v.iter().map(|x| x.trim().to_string()).collect(),
        };
        let names: Vec<String> = names.into_iter().filter(|n| !n.is_empty()).collect();
        if names.iter().any(|n| n == "all-linear" || n == "all")
            && let kd_lora::TargetModules::Names(all) = kd_lora::TargetModules::default()
        {
            return all;
        }
        names
    }
}

/// The learning-rate schedule (`lr_scheduler_type`, transformers' names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LrScheduler {
    /// Linear decay to 0 after warmup (ROLL's default).
    #[default]
    Linear,
    /// Half a cosine to 0 after warmup.
    Cosine,
    /// Constant after warmup (`constant`, `constant_with_warmup`).
    #[serde(alias = "constant_with_warmup")]
    Constant,
}

/// `training_args` of a worker (ROLL's `TrainingArguments`, the fields with a meaning here;
/// defaults are ROLL's / transformers').
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingArgs {
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Schedule after warmup.
    pub lr_scheduler_type: LrScheduler,
    /// Passes over the data (a fraction rounds up to whole epochs; `max_steps` usually stops
    /// the run first).
    pub num_train_epochs: f64,
    /// Steps of this worker (−1 = from the epochs); the top-level `max_steps` wins when set.
    pub max_steps: i64,
    /// Rows per micro-batch.
    pub per_device_train_batch_size: usize,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// AdamW β₁.
    pub adam_beta1: f64,
    /// AdamW β₂.
    pub adam_beta2: f64,
    /// AdamW ε.
    pub adam_epsilon: f64,
    /// Warmup in steps (wins over `warmup_ratio` when > 0).
    pub warmup_steps: usize,
    /// Warmup as a fraction of the steps.
    pub warmup_ratio: f64,
    /// Gradient clipping (0 = none; not a ROLL key here: ROLL clips by the top-level
    /// `max_grad_norm`, which wins when both are set).
    pub max_grad_norm: f64,
}

impl Default for TrainingArgs {
    fn default() -> Self {
        Self {
            learning_rate: 5e-5,
            lr_scheduler_type: LrScheduler::Linear,
            num_train_epochs: 1.0,
            max_steps: -1,
            per_device_train_batch_size: 8,
            gradient_accumulation_steps: 1,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            warmup_steps: 0,
            warmup_ratio: 0.0,
            max_grad_norm: 0.0,
        }
    }
}

/// One file or several (`file_name`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FileNames {
    /// One path.
    One(PathBuf),
    /// Several paths.
    Many(Vec<PathBuf>),
}

impl FileNames {
    /// The paths.
    pub fn paths(&self) -> Vec<PathBuf> {
        match self {
            Self::One(p) => vec![p.clone()],
            Self::Many(v) => v.clone(),
        }
    }
}

/// `data_args` of a worker (ROLL's `DataArguments`, the fields with a meaning here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct DataArgs {
    /// Question/answer files (JSON array or JSONL).
    pub file_name: Option<FileNames>,
    /// Validation files (used when the `validation` section names none).
    pub eval_file_name: Option<FileNames>,
    /// The chat template: `native` (the student's own, from its tokenizer files) or a path to
    /// a Jinja file. Absent = `native`.
    pub template: Option<String>,
    /// Use at most this many records (in file order).
    pub max_samples: Option<usize>,
}

/// GPU indices, as ROLL writes them: a list or a Python expression.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceMapping(pub Vec<usize>);

impl Serialize for DeviceMapping {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for DeviceMapping {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            List(Vec<usize>),
            Text(String),
            One(usize),
        }
        match Raw::deserialize(d)? {
            Raw::List(v) => Ok(Self(v)),
            Raw::One(i) => Ok(Self(vec![i])),
            Raw::Text(t) => parse_device_mapping(&t)
                .map(Self)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// Parses ROLL's device expressions: `list(range(a,b))`, `list(range(a, b, step))`,
/// `[0,1,2]`, `0,1,2`, `range(a,b)`.
pub fn parse_device_mapping(text: &str) -> std::result::Result<Vec<usize>, String> {
    let t: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    let inner = t
        .strip_prefix("list(")
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or(&t);
    let num = |s: &str| {
        s.parse::<usize>()
            .map_err(|_| format!("`{text}`: `{s}` is not a GPU index"))
    };
    if let Some(args) = inner
        .strip_prefix("range(")
        .and_then(|r| r.strip_suffix(')'))
    {
        let parts: Vec<&str> = args.split(',').collect();
        let (a, b, step) = match parts.as_slice() {
            [b] => (0, num(b)?, 1),
            [a, b] => (num(a)?, num(b)?, 1),
            [a, b, s] => (num(a)?, num(b)?, num(s)?),
            _ => return Err(format!("`{text}`: range takes 1 to 3 arguments")),
        };
        if step == 0 {
            return Err(format!("`{text}`: the range step must be positive"));
        }
        return Ok((a..b).step_by(step).collect());
    }
    let list = inner
        .strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .unwrap_or(inner);
    list.split(',')
        .filter(|s| !s.is_empty())
        .map(num)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| {
            format!("{e} (expected `list(range(a,b))`, `[0,1,…]` or a list of GPU indices)")
        })
}

/// A worker section (`student`, `teacher`, `validation`): ROLL's `WorkerConfig`, the fields
/// with a meaning here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// The model.
    pub model_args: ModelArgs,
    /// Optimisation (the student's is used for training).
    pub training_args: TrainingArgs,
    /// Data files and the template.
    pub data_args: DataArgs,
    /// GPU indices. In a build without CUDA the worker runs on the CPU (with a warning).
    pub device_mapping: Option<DeviceMapping>,
    /// Rows per forward pass when scoring or validating.
    pub infer_batch_size: usize,
    /// Pack several examples per row (one attention segment each).
    pub use_sequence_packing: bool,
    /// The teacher server (`logits_transfer_backend: ray`): our `serve-teacher`, or an
    /// SGLang / vLLM server that returns prompt log-probs.
    pub url: Option<String>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            model_args: ModelArgs::default(),
            training_args: TrainingArgs::default(),
            data_args: DataArgs::default(),
            device_mapping: None,
            infer_batch_size: 16,
            use_sequence_packing: false,
            url: None,
        }
    }
}

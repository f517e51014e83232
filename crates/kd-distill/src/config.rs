//! `DistillConfig`: ROLL's `DistillConfig` (with its `BaseConfig` parents and worker configs),
//! same names and defaults, as serde structs. Loading (YAML, Hydra overrides, interpolation,
//! ROLL keys without meaning here) is in [`super::load`].

use std::path::PathBuf;

use kd_loss::{KdConfig, KdObjective, SparseStudent};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{PipelineError, Result};

/// Where metrics go (`track_with`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TrackWith {
    /// TensorBoard event files under `logging_dir` (and the console).
    #[default]
    Tensorboard,
    /// The console (and `training_log.txt`) only.
    Stdout,
}

/// How the teacher's log-probs reach the student (`logits_transfer_backend`). ROLL's names
/// for its transports, mapped onto where the teacher runs here:
/// `ipc+nccl` → in-process on the student's device, `nccl-only` → in-process on the teacher
/// worker's own device (`teacher.device_mapping`), `ray` → a remote teacher server
/// (`teacher.url`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum TransferBackend {
    /// The teacher runs beside the student, on the student's device.
    #[default]
    #[serde(rename = "ipc+nccl")]
    IpcNccl,
    /// The teacher runs on its own device.
    #[serde(rename = "nccl-only")]
    NcclOnly,
    /// The teacher is a server (`teacher.url`).
    #[serde(rename = "ray")]
    Ray,
}

/// `resume_from_checkpoint`: `false`, `true` (the latest checkpoint under `output_dir`) or a
/// checkpoint path.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ResumeFrom {
    /// Start fresh.
    #[default]
    No,
    /// The newest `checkpoint-N` under `output_dir`.
    Latest,
    /// This checkpoint directory.
    Path(PathBuf),
}

impl Serialize for ResumeFrom {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Self::No => s.serialize_bool(false),
            Self::Latest => s.serialize_bool(true),
            Self::Path(p) => p.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for ResumeFrom {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bool(bool),
            Path(String),
        }
        Ok(match Option::<Raw>::deserialize(d)? {
            None | Some(Raw::Bool(false)) => Self::No,
            Some(Raw::Bool(true)) => Self::Latest,
            Some(Raw::Path(p)) => match p.trim() {
                "" | "false" | "False" => Self::No,
                "true" | "True" | "latest" => Self::Latest,
                _ => Self::Path(PathBuf::from(p)),
            },
        })
    }
}

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

/// The distill pipeline's configuration: ROLL's keys, names and defaults
/// (`roll/pipeline/distill/distill_config.py`), plus `kd_topk_student` below.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistillConfig {
    /// Name of the experiment (a subdirectory of nothing: it labels logs).
    pub exp_name: String,
    /// Seed of data order, dropout and initialisation.
    pub seed: u64,
    /// Checkpoints go here.
    pub output_dir: PathBuf,
    /// TensorBoard event files go here.
    pub logging_dir: PathBuf,
    /// Metrics sink.
    pub track_with: TrackWith,
    /// Optimizer steps of the run (ROLL's default 500; ≤ 0 = from the student's epochs).
    pub max_steps: i64,
    /// Save a checkpoint every this many steps (0 = only at the end).
    pub save_steps: usize,
    /// Log every this many steps.
    pub logging_steps: usize,
    /// Validate every this many steps (0 = never; the end of the run always validates when
    /// there is validation data).
    pub eval_steps: usize,
    /// Keep at most this many checkpoints (0 = all).
    pub max_ckpt_to_keep: usize,
    /// Continue from a checkpoint.
    pub resume_from_checkpoint: ResumeFrom,
    /// The student model directory.
    pub student_pretrain: Option<PathBuf>,
    /// The teacher model directory.
    pub teacher_pretrain: Option<PathBuf>,
    /// Field of the question in the data records (dotted paths allowed).
    pub question_key: String,
    /// Field of the answer.
    pub answer_key: String,
    /// K of the teacher's top-k (0 = the full vocabulary).
    pub logits_topk: usize,
    /// L = (1 − w)·CE + w·KD.
    pub distill_loss_weight: f64,
    /// τ, applied to both sides.
    pub kd_temperature: f32,
    /// τ_T, the teacher's extra temperature.
    pub teacher_temperature: f32,
    /// The divergence.
    pub kd_objective: KdObjective,
    /// α of adaptive KL.
    pub adaptive_kl_alpha: f32,
    /// λ of the skewed objectives.
    pub skew_lambda: f32,
    /// Train (CE and KD) on the prompt tokens too.
    pub distill_on_prompt: bool,
    /// Gradient clipping (0 = off); wins over `student.training_args.max_grad_norm`.
    pub max_grad_norm: f64,
    /// Longest example in tokens (prompt + answer); longer ones are cut.
    pub sequence_length: usize,
    /// Where the teacher runs (see [`TransferBackend`]).
    pub logits_transfer_backend: TransferBackend,
    /// Beyond ROLL: the student distribution in top-k mode (`renormalized` = ROLL's).
    pub sparse_student: SparseStudent,
    /// Beyond ROLL: on-policy distillation (GKD): the share λ of every step's rows the
    /// student completes itself (sampled with the weights of the step), scored by the teacher
    /// and learned through `distill_loss_weight ·` KD on the completion only (0 = off). TRL's
    /// `lmbda` is accepted as its alias.
    pub on_policy_ratio: f64,
    /// Beyond ROLL: the student's sampling temperature for on-policy rows (0 = greedy).
    pub on_policy_temperature: f32,
    /// Beyond ROLL: the student's top-p for on-policy rows.
    pub on_policy_top_p: f32,
    /// Beyond ROLL: tokens the student samples at most per on-policy row (TRL's default
    /// 128).
    pub on_policy_max_new_tokens: usize,
    /// Beyond ROLL: cut each on-policy answer to the length of the dataset answer it replaces
    /// (equal label tokens per row).
    pub on_policy_match_length: bool,
    /// Beyond ROLL: shards each micro-batch is split into on this rank, their gradients
    /// summed; one process with N shards trains exactly what N data-parallel ranks
    /// (`mpirun -np N distill …`) train.
    pub accumulation_shards: usize,
    /// Beyond ROLL: variables for the chat template, as vLLM's and SGLang's
    /// `chat_template_kwargs` (e.g. Qwen3's `{enable_thinking: false}`); empty, the template's
    /// own defaults apply, as in transformers.
    pub chat_template_kwargs: std::collections::BTreeMap<String, serde_json::Value>,
    /// Beyond ROLL: remove an earlier run's checkpoints and logs from `output_dir` (and
    /// `logging_dir`) before starting; the teacher cache is kept.
    pub overwrite_output_dir: bool,
    /// The student worker.
    pub student: WorkerConfig,
    /// The teacher worker.
    pub teacher: WorkerConfig,
    /// The validation worker (its `data_args.file_name` is the validation set).
    pub validation: Option<WorkerConfig>,
}

impl Default for DistillConfig {
    fn default() -> Self {
        Self {
            exp_name: "distill".into(),
            seed: 42,
            output_dir: PathBuf::from("./output"),
            logging_dir: PathBuf::from("./output/logs"),
            track_with: TrackWith::Tensorboard,
            max_steps: 500,
            save_steps: 50,
            logging_steps: 1,
            eval_steps: 10,
            max_ckpt_to_keep: 0,
            resume_from_checkpoint: ResumeFrom::No,
            student_pretrain: None,
            teacher_pretrain: None,
            question_key: "question".into(),
            answer_key: "answer".into(),
            logits_topk: 64,
            distill_loss_weight: 0.5,
            kd_temperature: 1.0,
            teacher_temperature: 1.0,
            kd_objective: KdObjective::ForwardKl,
            adaptive_kl_alpha: 0.5,
            skew_lambda: 0.1,
            distill_on_prompt: false,
            max_grad_norm: 0.0,
            sequence_length: 2048,
            logits_transfer_backend: TransferBackend::IpcNccl,
            sparse_student: SparseStudent::Renormalized,
            on_policy_ratio: 0.0,
            on_policy_temperature: 1.0,
            on_policy_top_p: 1.0,
            on_policy_max_new_tokens: 128,
            on_policy_match_length: false,
            accumulation_shards: 1,
            chat_template_kwargs: Default::default(),
            overwrite_output_dir: false,
            student: WorkerConfig::default(),
            teacher: WorkerConfig::default(),
            validation: None,
        }
    }
}

impl DistillConfig {
    /// The student's model directory: `student.model_args.model_name_or_path`, else
    /// `student_pretrain`; a hub id (`Qwen/Qwen2.5-7B-Instruct`, as ROLL's examples name
    /// models) found in the local Hugging Face cache is its snapshot directory.
    pub fn student_path(&self) -> Result<PathBuf> {
        let path = self
            .student
            .model_args
            .model_name_or_path
            .clone()
            .or_else(|| self.student_pretrain.clone())
            .ok_or_else(|| {
                PipelineError::Config(
                    "no student model: set `student_pretrain` (or \
                     `student.model_args.model_name_or_path`)"
                        .into(),
                )
            })?;
        kd_pipeline::models::local_model(&path)
    }

    /// The teacher's model directory (absent for a remote teacher without local weights),
    /// resolved as [`student_path`](Self::student_path) is.
    pub fn teacher_path(&self) -> Result<Option<PathBuf>> {
        self.teacher
            .model_args
            .model_name_or_path
            .clone()
            .or_else(|| self.teacher_pretrain.clone())
            .map(|p| kd_pipeline::models::local_model(&p))
            .transpose()
    }

    /// The KD loss settings.
    pub fn kd_config(&self) -> KdConfig {
        KdConfig {
            objective: self.kd_objective,
            kd_temperature: self.kd_temperature,
            teacher_temperature: self.teacher_temperature,
            skew_lambda: self.skew_lambda,
            adaptive_kl_alpha: self.adaptive_kl_alpha,
            logits_topk: self.logits_topk,
            sparse_student: self.sparse_student,
            scale_by_temperature_squared: false,
        }
    }

    /// Checks ranges; messages name the key.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(PipelineError::Config(m));
        if !(0.0..=1.0).contains(&self.distill_loss_weight) {
            return bad(format!(
                "`distill_loss_weight` must lie in [0, 1], got {}",
                self.distill_loss_weight
            ));
        }
        self.kd_config().validate()?;
        kd_pipeline::on_policy::check_on_policy_settings(
            self.on_policy_ratio,
            self.on_policy_max_new_tokens,
            self.on_policy_temperature,
            self.on_policy_top_p,
            &|k| match k {
                "on_policy_ratio" => "`on_policy_ratio` (TRL's `lmbda`)".to_string(),
                _ => format!("`{k}`"),
            },
        )?;
        if self.on_policy_ratio > 0.0 && self.distill_loss_weight == 0.0 {
            return bad(
                "`on_policy_ratio` > 0: the student's own completions learn through the KD \
                 term only, and `distill_loss_weight: 0` switches it off; set it above 0"
                    .into(),
            );
        }
        if self.logging_steps == 0 {
            return bad("`logging_steps` must be positive".into());
        }
        if self.accumulation_shards == 0 {
            return bad("`accumulation_shards` must be positive".into());
        }
        if self.sequence_length < 2 {
            return bad("`sequence_length` must be at least 2".into());
        }
        if self.max_grad_norm < 0.0 {
            return bad("`max_grad_norm` must be ≥ 0".into());
        }
        let t = &self.student.training_args;
        if t.per_device_train_batch_size == 0 {
            return bad(
                "`student.training_args.per_device_train_batch_size` must be positive".into(),
            );
        }
        if t.gradient_accumulation_steps == 0 {
            return bad(
                "`student.training_args.gradient_accumulation_steps` must be positive".into(),
            );
        }
        if self.student.infer_batch_size == 0 || self.teacher.infer_batch_size == 0 {
            return bad("`infer_batch_size` must be positive".into());
        }
        if let Some(target) = &self.student.model_args.lora_target {
            if target.modules().is_empty() {
                return bad("`student.model_args.lora_target` names no module".into());
            }
            if self.student.model_args.lora_rank.unwrap_or(0) == 0 {
                return bad(
                    "`student.model_args.lora_target` is set but `lora_rank` is not: LoRA \
                     training needs a positive rank (e.g. `lora_rank: 8`)"
                        .into(),
                );
            }
        }
        if self.logits_transfer_backend == TransferBackend::Ray && self.teacher.url.is_none() {
            return bad(
                "`logits_transfer_backend: ray` means a remote teacher: set `teacher.url` \
                 (e.g. the address `speculator serve-teacher` prints)"
                    .into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_mapping_expressions() {
        assert_eq!(
            parse_device_mapping("list(range(0,8))").unwrap(),
            (0..8).collect::<Vec<_>>()
        );
        assert_eq!(
            parse_device_mapping("list(range(4, 8))").unwrap(),
            vec![4, 5, 6, 7]
        );
        assert_eq!(
            parse_device_mapping("list(range(0,8,2))").unwrap(),
            vec![0, 2, 4, 6]
        );
        assert_eq!(parse_device_mapping("[0, 1,2]").unwrap(), vec![0, 1, 2]);
        assert_eq!(parse_device_mapping("3").unwrap(), vec![3]);
        assert!(
            parse_device_mapping("list(range(a,8))")
                .unwrap_err()
                .contains("`a`")
        );
        let m: DeviceMapping = serde_yaml::from_str("[0, 1]").unwrap();
        assert_eq!(m.0, vec![0, 1]);
        let m: DeviceMapping = serde_yaml::from_str("list(range(0,2))").unwrap();
        assert_eq!(m.0, vec![0, 1]);
    }

    #[test]
    fn resume_and_lora_target_forms() {
        let r: ResumeFrom = serde_yaml::from_str("false").unwrap();
        assert_eq!(r, ResumeFrom::No);
        let r: ResumeFrom = serde_yaml::from_str("true").unwrap();
        assert_eq!(r, ResumeFrom::Latest);
        let r: ResumeFrom = serde_yaml::from_str("out/checkpoint-10").unwrap();
        assert_eq!(r, ResumeFrom::Path("out/checkpoint-10".into()));
        let t: LoraTarget = serde_yaml::from_str("q_proj, v_proj").unwrap();
        assert_eq!(t.modules(), vec!["q_proj", "v_proj"]);
        let t: LoraTarget = serde_yaml::from_str("all-linear").unwrap();
        assert_eq!(t.modules().len(), 7);
    }
}

//! `DistillConfig`: ROLL's `DistillConfig` (with its `BaseConfig` parents and worker configs),
//! same names and defaults, as serde structs. Loading (YAML, Hydra overrides, interpolation,
//! ROLL keys without meaning here) is in [`super::load`].

use std::path::PathBuf;

use kd_loss::{KdConfig, KdObjective, SparseStudent};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{PipelineError, Result};

mod worker;

pub use worker::{
    DataArgs, DeviceMapping, FileNames, LoraTarget, LrScheduler, ModelArgs, ModelDType,
    TrainingArgs, WorkerConfig, parse_device_mapping,
};

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
mod tests;

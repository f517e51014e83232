//! `TrainConfig`: the seed's training flags as a serde struct (unknown keys refused).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// What is trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TrainMode {
    /// LoRA adapters (and the hidden-state projection, when used); the base is frozen.
    #[default]
    Lora,
    /// Every parameter of the model (ROLL's distill default).
    Full,
}

/// The learning-rate shape after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SchedulerType {
    /// Half a cosine from the peak to 0 (transformers' `get_cosine_schedule_with_warmup`).
    #[default]
    Cosine,
    /// Straight line from the peak to 0.
    Linear,
    /// The peak learning rate throughout.
    Constant,
}

/// Training options; defaults are the speculator seed's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Where checkpoints, `training_log.txt` and `runs/` go.
    pub output_dir: PathBuf,
    /// LoRA or full fine-tuning.
    pub mode: TrainMode,
    /// Passes over the data.
    pub num_epochs: usize,
    /// Stop after this many optimizer steps (overrides epochs).
    pub max_steps: Option<usize>,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Warmup as a fraction of all steps (used unless `warmup_steps` is set).
    pub warmup_ratio: f64,
    /// Warmup in steps.
    pub warmup_steps: Option<usize>,
    /// Decay after warmup.
    pub scheduler_type: SchedulerType,
    /// AdamW decoupled weight decay (not applied to norms and biases).
    pub weight_decay: f64,
    /// AdamW β₁.
    pub adam_beta1: f64,
    /// AdamW β₂.
    pub adam_beta2: f64,
    /// AdamW ε (PyTorch's default 1e-8, not Burn's 1e-5).
    pub adam_epsilon: f64,
    /// Clip the global gradient norm to this (0 = no clipping).
    pub max_grad_norm: f64,
    /// Rows per micro-batch (per shard).
    pub train_batch_size: usize,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Shards each micro-batch is split into, run one after another on the one training
    /// device with their gradients summed: gradient accumulation that computes exactly what as
    /// many data-parallel replicas would (training on several devices is not implemented).
    /// The rows of a step are shards × train_batch_size × gradient_accumulation_steps.
    #[serde(alias = "data_parallel")]
    pub accumulation_shards: usize,
    /// Save `checkpoint-{step}` every this many steps (0 = never).
    pub save_steps: usize,
    /// Keep at most this many step checkpoints (the oldest are pruned).
    pub save_total_limit: Option<usize>,
    /// Save `checkpoint-epoch-{e}` at the end of every epoch.
    pub save_epoch_checkpoints: bool,
    /// Log every this many steps.
    pub logging_steps: usize,
    /// Seed of the data order and of dropout.
    pub seed: u64,
    /// A checkpoint directory, or `latest`, to continue from.
    pub resume_from_checkpoint: Option<String>,
    /// Stop after this many optimizer steps in a row with non-finite loss or gradients.
    pub max_consecutive_nonfinite: usize,
    /// Group examples of similar length into batches.
    pub group_by_length: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            output_dir: PathBuf::from("checkpoints"),
            mode: TrainMode::Lora,
            num_epochs: 3,
            max_steps: None,
            learning_rate: 2e-4,
            warmup_ratio: 0.03,
            warmup_steps: None,
            scheduler_type: SchedulerType::Cosine,
            weight_decay: 0.01,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            max_grad_norm: 1.0,
            train_batch_size: 4,
            gradient_accumulation_steps: 4,
            accumulation_shards: 1,
            save_steps: 500,
            save_total_limit: Some(3),
            save_epoch_checkpoints: true,
            logging_steps: 10,
            seed: 42,
            resume_from_checkpoint: None,
            max_consecutive_nonfinite: 10,
            group_by_length: true,
        }
    }
}

impl TrainConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(TrainError::Config(m.to_string()));
        if self.train_batch_size == 0 {
            return bad("`train_batch_size` must be positive");
        }
        if self.gradient_accumulation_steps == 0 {
            return bad("`gradient_accumulation_steps` must be positive");
        }
        if self.accumulation_shards == 0 {
            return bad("`accumulation_shards` must be positive");
        }
        if self.num_epochs == 0 && self.max_steps.is_none() {
            return bad("`num_epochs` is 0 and `max_steps` unset: nothing to train");
        }
        if !(self.learning_rate > 0.0 && self.learning_rate.is_finite()) {
            return bad("`learning_rate` must be a positive number");
        }
        if !(0.0..1.0).contains(&self.warmup_ratio) {
            return bad("`warmup_ratio` must lie in [0, 1)");
        }
        if !(0.0..1.0).contains(&self.adam_beta1) || !(0.0..1.0).contains(&self.adam_beta2) {
            return bad("`adam_beta1` and `adam_beta2` must lie in [0, 1)");
        }
        if self.max_grad_norm < 0.0 || self.weight_decay < 0.0 || self.adam_epsilon <= 0.0 {
            return bad("`max_grad_norm` and `weight_decay` must be ≥ 0, `adam_epsilon` > 0");
        }
        if self.logging_steps == 0 {
            return bad("`logging_steps` must be positive");
        }
        Ok(())
    }

    /// Rows per optimizer step over all micro-batches and their shards.
    pub fn effective_batch_size(&self) -> usize {
        self.accumulation_shards * self.train_batch_size * self.gradient_accumulation_steps
    }

    /// Warmup steps for a run of `total` steps.
    pub fn warmup(&self, total: usize) -> usize {
        self.warmup_steps
            .unwrap_or_else(|| (self.warmup_ratio * total as f64).ceil() as usize)
    }
}

//! What a run will do: its batching, step counts and the fingerprint a resumed run must match.

use kd_data::{BatchOptions, Example, plan_batches};
use serde_json::json;

use crate::config::{TrainConfig, TrainMode};

pub(crate) struct RunPlan {
    pub lengths: Vec<usize>,
    pub batch_opts: BatchOptions,
    /// Planned micro-batches per optimizer step.
    pub per_step: usize,
    pub steps_per_epoch: usize,
    pub total_steps: usize,
    pub warmup: usize,
    pub fingerprint: serde_json::Value,
}

impl RunPlan {
    /// The plan of `config` over `examples`; `extra` is the step data's fingerprint entry.
    pub fn new(
        config: &TrainConfig,
        examples: &[Example],
        extra: Option<(&'static str, serde_json::Value)>,
    ) -> Self {
        let lengths: Vec<usize> = examples.iter().map(Example::len).collect();
        let batch_opts = BatchOptions {
            batch_size: config.train_batch_size * config.accumulation_shards,
            bucket_by_length: config.group_by_length,
            shuffle: true,
            seed: config.seed,
            ..BatchOptions::default()
        };
        let per_step = config.gradient_accumulation_steps;
        let micro_per_epoch = plan_batches(&lengths, &batch_opts, 0).len();
        let steps_per_epoch = micro_per_epoch.div_ceil(per_step);
        let total_steps = config
            .max_steps
            .unwrap_or(steps_per_epoch * config.num_epochs);
        let warmup = config.warmup(total_steps);
        let mut fingerprint = json!({
            "seed": config.seed,
            "train_batch_size": config.train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            // The key keeps its first name so that earlier checkpoints still resume.
            "data_parallel": config.accumulation_shards,
            "learning_rate": config.learning_rate,
            "scheduler_type": config.scheduler_type,
            "total_steps": total_steps,
            "warmup_steps": warmup,
            "examples": examples.len(),
            "mode": config.mode,
        });
        if let Some((key, value)) = extra {
            fingerprint[key] = value;
        }
        Self {
            lengths,
            batch_opts,
            per_step,
            steps_per_epoch,
            total_steps,
            warmup,
            fingerprint,
        }
    }

    /// The first line of `training_log.txt`.
    pub fn header(&self, config: &TrainConfig, examples: usize, resumed_at: usize) -> String {
        format!(
            "# {} run: {} examples, {} steps ({} per epoch), effective batch {} = {} shard(s) × {} × {} accumulation steps, warmup {} steps{}",
            match config.mode {
                TrainMode::Lora => "LoRA",
                TrainMode::Full => "full fine-tuning",
            },
            examples,
            self.total_steps,
            self.steps_per_epoch,
            config.effective_batch_size(),
            config.accumulation_shards,
            config.train_batch_size,
            config.gradient_accumulation_steps,
            self.warmup,
            if resumed_at > 0 {
                format!(", resumed at step {resumed_at}")
            } else {
                String::new()
            }
        )
    }
}

//! Shared helpers: fixture paths, a tiny model and synthetic examples.

use std::path::PathBuf;

use burn::tensor::Device;
use kd_data::{Example, ExampleOptions, build_example};
use kd_model::{Llama, LoraConfig};
use kd_train::{
    ModelFiles, StepLossFn, TrainConfig, TrainModel, TrainObserver, TrainSummary, Trainer,
};

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

pub fn cpu() -> Device {
    Device::flex()
}

pub fn base_model() -> Llama {
    Llama::load(fixtures().join("tiny-models/tiny-llama3"), &cpu()).unwrap()
}

pub fn lora_config() -> LoraConfig {
    LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.1,
        ..LoraConfig::default()
    }
}

pub fn lora_model() -> TrainModel {
    // Seeded initialisation: tests run in parallel and share the device's generator.
    TrainModel::new(
        base_model()
            .apply_lora_seeded(&lora_config(), 1234)
            .unwrap(),
    )
}

/// Deterministic synthetic prompt/completion examples over the tiny vocabulary: the
/// completion repeats a pattern so that the loss can fall.
pub fn examples(n: usize) -> Vec<Example> {
    (0..n)
        .map(|i| {
            let prompt: Vec<u32> = (0..3 + i % 5)
                .map(|j| (1 + (i * 7 + j * 13) % 250) as u32)
                .collect();
            let completion: Vec<u32> = (0..4 + i % 6)
                .map(|j| (10 + (j * 3) % 20) as u32)
                .chain([2])
                .collect();
            build_example(
                &format!("ex{i}"),
                &prompt,
                &completion,
                &ExampleOptions::default(),
            )
            .0
        })
        .collect()
}

pub fn run_info() -> ModelFiles {
    ModelFiles {
        base_model: "fixtures/tiny-models/tiny-llama3".into(),
        tokenizer_dir: None,
    }
}

/// A run through [`Trainer`] with the files `files` names.
pub fn train(
    config: &TrainConfig,
    files: &ModelFiles,
    model: TrainModel,
    examples: &[Example],
    loss: &dyn StepLossFn,
    observer: &mut dyn TrainObserver,
) -> kd_train::Result<(TrainModel, TrainSummary)> {
    Trainer::new(config.clone(), loss)
        .observer(observer)
        .run(model.with_files(files.clone()), examples)
}

pub fn small_config(dir: &std::path::Path) -> TrainConfig {
    TrainConfig {
        output_dir: dir.to_path_buf(),
        num_epochs: 2,
        learning_rate: 5e-3,
        warmup_ratio: 0.1,
        train_batch_size: 2,
        gradient_accumulation_steps: 2,
        save_steps: 2,
        save_total_limit: Some(2),
        logging_steps: 1,
        seed: 7,
        ..TrainConfig::default()
    }
}

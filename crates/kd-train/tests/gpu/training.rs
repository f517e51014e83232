//! A whole LoRA run on the GPU (AdamW, schedule, checkpoints) against the same run on the
//! CPU; the checkpoint reloads and the merged export loads on the CPU with equal logits.

use burn::tensor::Device;
use kd_data::{Example, ExampleOptions, build_example};
use kd_model::{Llama, LoraConfig, SaveDType, TokenBatch};
use kd_train::{CausalLmLoss, ModelFiles, TrainConfig, TrainModel, TrainObserver, Trainer};

use crate::util::*;

#[derive(Default)]
struct Losses(Vec<f64>);

impl TrainObserver for Losses {
    fn on_step(&mut self, _step: usize, loss: f64) {
        self.0.push(loss);
    }
}

fn examples(n: usize) -> Vec<Example> {
    (0..n)
        .map(|i| {
            let prompt: Vec<u32> = (0..3 + i % 4)
                .map(|j| (1 + (i * 7 + j * 13) % 250) as u32)
                .collect();
            let completion: Vec<u32> = (0..4 + i % 5)
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

/// Three AdamW steps with warm-up, LoRA dropout, gradient accumulation and a checkpoint,
/// on `device`: the per-step losses, the trained model and the output directory.
fn run(device: &Device) -> (Vec<f64>, Llama, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let lora = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.1,
        ..LoraConfig::default()
    };
    let config = TrainConfig {
        output_dir: dir.path().to_path_buf(),
        num_epochs: 1,
        learning_rate: 1e-2,
        warmup_ratio: 0.3,
        train_batch_size: 2,
        gradient_accumulation_steps: 2,
        save_steps: 3,
        logging_steps: 1,
        seed: 7,
        ..TrainConfig::default()
    };
    let files = ModelFiles {
        base_model: "fixtures/tiny-models/tiny-llama3".into(),
        tokenizer_dir: None,
    };
    let model = TrainModel::new(
        load("tiny-llama3", device)
            .apply_lora_seeded(&lora, 1234)
            .unwrap(),
    )
    .with_files(files);
    let mut losses = Losses::default();
    let (trained, summary) = Trainer::new(config, &CausalLmLoss { weight: 1.0 })
        .observer(&mut losses)
        .run(model, &examples(12))
        .unwrap();
    assert_eq!(summary.global_step, 3);
    assert_eq!(summary.skipped_steps, 0);
    (losses.0, trained.llama, dir)
}

pub fn run_checkpoint_and_export_match_cpu(gpu: &Device) {
    let (loss_gpu, model_gpu, dir_gpu) = run(gpu);
    let (loss_cpu, _, _dir_cpu) = run(&cpu());
    println!("  losses on the GPU {loss_gpu:.6?}, on the CPU {loss_cpu:.6?}");
    let a: Vec<f32> = loss_gpu.iter().map(|x| *x as f32).collect();
    let b: Vec<f32> = loss_cpu.iter().map(|x| *x as f32).collect();
    assert_close("per-step training losses vs CPU", &a, &b, 1e-4);
    assert!(
        loss_gpu[2] < loss_gpu[0],
        "the loss did not fall: {loss_gpu:?}"
    );

    let batch = TokenBatch::single(&[1, 17, 45, 200, 3, 9, 11]);
    let trained = values(model_gpu.logits(&batch).unwrap());
    // The step-3 checkpoint (PEFT layout) reloads onto a fresh base model on the GPU.
    let ck = dir_gpu.path().join("checkpoint-3");
    let (reloaded, _) = load("tiny-llama3", gpu).load_adapter(&ck).unwrap();
    assert_close(
        "checkpoint reloaded on the GPU vs the trained model",
        &values(reloaded.logits(&batch).unwrap()),
        &trained,
        1e-5,
    );
    // The merged export, written from the GPU, loads on the CPU with the same logits.
    let export = dir_gpu.path().join("merged");
    model_gpu
        .export_merged(&export, SaveDType::F32, None)
        .unwrap();
    let merged = Llama::load(&export, &cpu()).unwrap();
    assert_close(
        "merged export loaded on the CPU vs the trained GPU model",
        &values(merged.logits(&batch).unwrap()),
        &trained,
        1e-4,
    );
}

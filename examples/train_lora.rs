//! Trains LoRA adapters on a fixture model with synthetic prompt/completion data, writing
//! checkpoints, `training_log.txt` and TensorBoard events: the trainer used from another
//! crate in a few lines.
//!
//! ```text
//! cargo run -p kd-examples --example train_lora -- fixtures/tiny-models/tiny-llama3 /tmp/train-out
//! tail training_log.txt; tensorboard --logdir /tmp/train-out/runs
//! ```

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use kd_data::{ExampleOptions, build_example};
use kd_model::{Llama, LoraConfig, parse_device};
use kd_train::{
    CausalLmLoss, LogRecord, ModelFiles, TrainConfig, TrainModel, TrainObserver, Trainer,
};

#[derive(Parser, Debug)]
struct Args {
    /// Base model directory.
    model: PathBuf,
    /// Output directory.
    out: PathBuf,
    /// Epochs.
    #[arg(long, default_value_t = 3)]
    epochs: usize,
}

struct Print;

impl TrainObserver for Print {
    fn on_log(&mut self, r: &LogRecord) {
        println!(
            "step {:>3}  loss {:.4}  lr {:.2e}",
            r.step, r.loss, r.learning_rate
        );
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = parse_device("cpu")?;
    device.seed(0);
    let lora = LoraConfig {
        r: 8,
        alpha: 16.0,
        dropout: 0.05,
        ..LoraConfig::default()
    };
    let llama = Llama::load(&args.model, &device)?.apply_lora(&lora)?;
    println!("{}", llama.parameter_report());
    let vocab = llama.config().vocab_size as u32;
    let examples: Vec<_> = (0..64usize)
        .map(|i| {
            let prompt: Vec<u32> = (0..4 + i % 5)
                .map(|j| 1 + ((i * 31 + j * 17) as u32) % (vocab - 1))
                .collect();
            let completion: Vec<u32> = (0..6).map(|j| 10 + ((i + j) % 8) as u32).collect();
            build_example(
                &format!("ex{i}"),
                &prompt,
                &completion,
                &ExampleOptions::default(),
            )
            .0
        })
        .collect();
    let config = TrainConfig {
        output_dir: args.out.clone(),
        num_epochs: args.epochs,
        learning_rate: 1e-2,
        save_steps: 10,
        logging_steps: 2,
        ..TrainConfig::default()
    };
    let model = TrainModel::new(llama).with_files(ModelFiles {
        base_model: args.model.display().to_string(),
        tokenizer_dir: None,
    });
    let (_, summary) = Trainer::new(config, &CausalLmLoss { weight: 1.0 })
        .observer(&mut Print)
        .run(model, &examples)?;
    println!(
        "{} steps, checkpoints: {:?}",
        summary.global_step, summary.checkpoints
    );
    Ok(())
}

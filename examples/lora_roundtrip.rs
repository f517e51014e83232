//! Trains LoRA adapters for a few steps on a fixture model, then writes them in PEFT layout,
//! exports the merged model, and records logits — so that Python PEFT can check our files
//! (`fixtures/check_adapter_with_peft.py`).
//!
//! ```text
//! cargo run -p kd-examples --example lora_roundtrip -- fixtures/tiny-models/tiny-llama3 /tmp/lora-out
//! /path/to/python fixtures/check_adapter_with_peft.py --base fixtures/tiny-models/tiny-llama3 \
//!     --adapter /tmp/lora-out/adapter --logits /tmp/lora-out/logits.safetensors --merged /tmp/lora-out/merged
//! ```

use std::path::PathBuf;

use anyhow::{Context, Result};
use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Tensor, TensorData};
use clap::Parser;
use kd_model::{
    Llama, LoraConfig, PaddingSide, SaveDType, TokenBatch, parse_device, weights::write_safetensors,
};

#[derive(Parser, Debug)]
struct Args {
    /// Base model directory.
    model: PathBuf,
    /// Output directory (gets `adapter/`, `merged/`, `logits.safetensors`).
    out: PathBuf,
    /// Optimizer steps.
    #[arg(long, default_value_t = 5)]
    steps: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = parse_device("cpu")?;
    device.seed(0);
    let config = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        ..LoraConfig::default()
    };
    let base = Llama::load(&args.model, &device)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let mut model = base.apply_lora(&config)?.train();
    println!("{}", model.parameter_report());
    let rows = vec![
        vec![1, 17, 45, 200, 3, 99, 150],
        vec![1, 88, 12, 7],
        vec![1, 250],
    ];
    let batch = TokenBatch::from_rows(&rows, 0, PaddingSide::Right);
    let mut optim = AdamWConfig::new()
        .with_weight_decay(0.01)
        .with_epsilon(1e-8)
        .init();
    for step in 0..args.steps {
        // A toy objective: push the logits of every position towards token 7.
        let logits = model.logits(&batch)?;
        let [b, s, v] = logits.dims();
        let logp = burn::tensor::activation::log_softmax(logits, 2);
        let target = logp.slice([0..b, 0..s, 7..8]);
        let loss: Tensor<1> = target.mean().neg();
        println!(
            "step {step}: loss {:.4}",
            loss.clone().into_data().try_into_vec_as::<f32>()?[0]
        );
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(5e-2, model, grads);
        let _ = v;
    }
    let model = model.valid();
    std::fs::create_dir_all(&args.out)?;
    model.save_adapter(args.out.join("adapter"), &args.model.display().to_string())?;
    // The "right" batch of fixtures/golden/tiny-llama3.safetensors (same rows, right-padded).
    let logits = model.logits(&batch)?;
    let dims = logits.dims();
    let values: Vec<f32> = logits.into_data().try_into_vec_as::<f32>()?;
    write_safetensors(
        &args.out.join("logits.safetensors"),
        &[("right.logits".to_string(), TensorData::new(values, dims))],
        SaveDType::F32,
    )?;
    let tok = PathBuf::from("fixtures/llama3-tokenizer");
    model.export_merged(
        args.out.join("merged"),
        SaveDType::F32,
        tok.is_dir().then_some(tok.as_path()),
    )?;
    println!("wrote {}", args.out.display());
    Ok(())
}

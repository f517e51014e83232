//! The speculator pipeline end to end on the bench shapes: the bench-155m target
//! (`docs/src/benchmarks.md`, random weights, Llama 3's tokenizer from the fixtures), a
//! 2-layer draft derived from it, real prompts from the demo data; the target generates
//! (greedy, batch 32) and the draft's LoRA adapters (r16 α32, dropout 0, the seven
//! projections) train one epoch on the completions (batch 4 × 4 accumulation, AdamW,
//! cosine). Beside it, the same work through the kernels alone (`LocalTeacher::generate` and
//! `kd_train::train` called directly) to show the pipeline's own overhead, and the
//! equivalent PyTorch script (`benches/pipeline_pytorch.py`: HF `generate` and a PEFT
//! training loop with the same hyper-parameters) on the same weights and prompts.
//!
//! `cargo run --release -p kd-benches --bin pipeline -- --python <venv>/bin/python`

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kd_model::{Llama, LlamaConfig, SaveDType, parse_device};
use kd_speculator::{
    Phase, Quiet, SpeculatorConfig, phases::build_examples, phases::generation_params,
    phases::lora_config, phases::setup, phases::train_config, run,
};
use kd_teacher::{LocalTeacher, Teacher};
use kd_train::{CausalLmLoss, ModelFiles, TrainModel, Trainer};

#[derive(Parser, Debug)]
struct Args {
    /// Prompts (the first ones of fixtures/demo/data).
    #[arg(long, default_value_t = 64)]
    prompts: usize,
    /// New tokens per prompt.
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Python with torch + transformers + peft for the PyTorch column.
    #[arg(long)]
    python: Option<PathBuf>,
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

fn with_tokenizer(dir: &Path) -> Result<()> {
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixtures().join("llama3-tokenizer").join(f), dir.join(f))?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    kd_benches::print_machine()?;
    kd_train::retain_freed_memory();
    let device = parse_device("cpu")?;
    device.seed(0);
    let tmp = tempfile::tempdir()?;
    let (tdir, ddir) = (tmp.path().join("target"), tmp.path().join("draft"));
    Llama::random(&LlamaConfig::bench_155m(), &device).save(&tdir, SaveDType::F32)?;
    with_tokenizer(&tdir)?;
    Llama::load(&tdir, &device)?
        .keep_layers(&[0, 7])?
        .save(&ddir, SaveDType::F32)?;
    with_tokenizer(&ddir)?;
    // The first prompts of the demo data, in file order.
    let data = tmp.path().join("data/bench");
    std::fs::create_dir_all(&data)?;
    let mut lines = Vec::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures().join("demo/data"))?
        .flatten()
        .map(|e| e.path())
        .collect();
    dirs.sort();
    for d in dirs {
        let text = std::fs::read_to_string(d.join("batch_input.jsonl"))?;
        lines.extend(text.lines().map(str::to_string));
    }
    if lines.len() < args.prompts {
        bail!("only {} prompts in fixtures/demo/data", lines.len());
    }
    let mut f = std::fs::File::create(data.join("batch_input.jsonl"))?;
    for l in &lines[..args.prompts] {
        writeln!(f, "{l}")?;
    }
    drop(f);

    let config = SpeculatorConfig {
        target_model: tdir.clone(),
        draft_model: ddir.clone(),
        data_dir: data.clone(),
        output_dir: tmp.path().join("out"),
        max_new_tokens: args.new_tokens,
        num_epochs: 1,
        lora_r: 16,
        lora_alpha: 32.0,
        lora_dropout: 0.0,
        eval_fraction: 0.0,
        save_steps: 0,
        logging_steps: 1,
        ..SpeculatorConfig::default()
    };

    // The pipeline.
    let started = Instant::now();
    let summary = run(&config, &mut Quiet)?;
    let total = started.elapsed().as_secs_f64();
    let phase = |p: Phase| {
        summary
            .phase_seconds
            .iter()
            .find(|(q, _)| *q == p)
            .map_or(0.0, |(_, s)| *s)
    };
    let trained: usize = summary.trained_tokens_per_epoch;
    println!(
        "bench pipeline: target bench-155m, draft its layers 0 and 7; {} prompts, {} new tokens, \
         LoRA r16 one epoch ({} steps, {trained} label tokens)",
        args.prompts, args.new_tokens, summary.train.global_step
    );
    println!(
        "ours:    pipeline {total:.1} s (setup {:.1} s, generation {:.1} s = {:.1} tokens/s, training {:.1} s = {:.1} tokens/s)",
        phase(Phase::Setup),
        phase(Phase::Generate),
        summary.generated_tokens as f64 / phase(Phase::Generate),
        phase(Phase::Train),
        trained as f64 / phase(Phase::Train)
    );

    // The same work through the kernels alone.
    let s = setup(&SpeculatorConfig {
        output_dir: tmp.path().join("kernels"),
        ..config.clone()
    })?;
    let prompts = s.prompts.train_prompts();
    let teacher = LocalTeacher::new(Llama::load(&tdir, &device)?, config.batch_size, "bench");
    let t = Instant::now();
    let generations = teacher.generate(&prompts, &generation_params(&config))?;
    let gen_secs = t.elapsed().as_secs_f64();
    let examples = build_examples(&s.prompts, &generations, config.max_seq_length);
    let lora = lora_config(&config);
    let draft = Llama::load(&ddir, &device)?.apply_lora_seeded(&lora, config.seed)?;
    let train_cfg = kd_train::TrainConfig {
        output_dir: tmp.path().join("kernels"),
        ..train_config(&config)
    };
    let model = TrainModel::new(draft).with_files(ModelFiles {
        base_model: ddir.display().to_string(),
        tokenizer_dir: None,
    });
    let t = Instant::now();
    let loss = CausalLmLoss {
        weight: config.ce_weight,
    };
    Trainer::new(train_cfg, &loss).run(model, &examples.examples)?;
    let train_secs = t.elapsed().as_secs_f64();
    let kernels = gen_secs + train_secs;
    println!(
        "ours:    kernels alone {kernels:.1} s (generation {gen_secs:.1} s, training {train_secs:.1} s): the pipeline's overhead is {:.1} s = {:.1}%",
        total - kernels,
        100.0 * (total - kernels) / kernels
    );

    if let Some(py) = args.python {
        let status = kd_benches::python_command(py)
            .arg("benches/pipeline_pytorch.py")
            .arg("--target")
            .arg(&tdir)
            .arg("--draft")
            .arg(&ddir)
            .arg("--data")
            .arg(data.join("batch_input.jsonl"))
            .args(["--new-tokens", &args.new_tokens.to_string()])
            .arg("--out")
            .arg(tmp.path().join("pytorch"))
            .status()
            .context("running the PyTorch script")?;
        if !status.success() {
            bail!("the PyTorch script failed");
        }
        println!("(ours total {total:.1} s, to compare with the PyTorch total above)");
    }
    Ok(())
}

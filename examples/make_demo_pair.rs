//! Builds the bundled demo pair under `fixtures/demo/`: a byte-level BPE tokenizer with
//! Llama-3-style special tokens and chat template (trained with the `tokenizers` crate on the
//! corpus), a target fully fine-tuned by this project's trainer on the corpus's question /
//! answer pairs in chat format, and a smaller draft (narrower, fewer layers, same tokenizer)
//! trained as a plain-text language model on the same pairs written as "question\nanswer",
//! without the chat template: it knows the content but not the target's format, so
//! speculator training has something to teach that carries over to held-out prompts.
//!
//! The corpus is `chatterbot-corpus==1.3.3` (BSD-3-Clause), converted by
//! `fixtures/demo/make_demo_data.py`. Regenerate everything (from the repository root; a few
//! minutes on 2 cores, release build):
//!
//! ```text
//! python3 fixtures/demo/make_demo_data.py
//! cargo run --release -p kd-examples --example make_demo_pair -- fixtures/demo
//! ```
//!
//! Everything is seeded: the same inputs give the same files.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Parser;
use kd_data::{
    BadRecordPolicy, ChatTokenizer, ExampleOptions, Message, QaKeys, QaSource, build_example,
};
use kd_model::{Llama, LlamaConfig, SaveDType, parse_device};
use kd_train::{
    CausalLmLoss, LogRecord, ModelFiles, SchedulerType, TrainConfig, TrainMode, TrainModel,
    TrainObserver, Trainer,
};
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper,
    PreTokenizerWrapper, Tokenizer, TokenizerBuilder, TokenizerImpl,
};

/// The special tokens, in id order (Llama 3's names).
const SPECIAL: [&str; 6] = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|finetune_right_pad_id|>",
];

/// The system prompt of every demo conversation (as in `data/*/batch_input.jsonl`).
const SYSTEM: &str = "You are a helpful assistant.";

#[derive(Parser, Debug)]
struct Args {
    /// The demo directory (holds `corpus/`; gets `tokenizer/`, `target/`, `draft/`).
    dir: PathBuf,
    /// Tokenizer vocabulary size (special tokens included).
    #[arg(long, default_value_t = 1024)]
    vocab: usize,
    /// Epochs of full fine-tuning of the target on the question/answer pairs.
    #[arg(long, default_value_t = 40)]
    target_epochs: usize,
    /// Epochs of plain-text training of the draft.
    #[arg(long, default_value_t = 60)]
    draft_epochs: usize,
    /// Scratch directory for training runs.
    #[arg(long, default_value = "/tmp/kd-demo-pair")]
    work: PathBuf,
    /// Rebuild the draft only (the tokenizer and target already exist).
    #[arg(long)]
    only_draft: bool,
}

struct Print(&'static str);

impl TrainObserver for Print {
    fn on_log(&mut self, r: &LogRecord) {
        println!(
            "{}: step {:>4}  epoch {:.2}  loss {:.4}  lr {:.2e}",
            self.0, r.step, r.epoch, r.loss, r.learning_rate
        );
    }
}

fn train_tokenizer(corpus: &Path, vocab: usize, out: &Path) -> Result<()> {
    let specials: Vec<AddedToken> = SPECIAL.iter().map(|t| AddedToken::from(*t, true)).collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let post = TemplateProcessing::builder()
        .try_single(format!("{} $A", SPECIAL[0]))
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .special_tokens(vec![(SPECIAL[0], 0)])
        .build()?;
    let mut tokenizer: TokenizerImpl<
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerBuilder::new()
        .with_model(BPE::default().into())
        .with_normalizer(None)
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false).into()))
        .with_post_processor(Some(post.into()))
        .with_decoder(Some(ByteLevel::default().into()))
        .build()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    tokenizer
        .train_from_files(&mut trainer, vec![corpus.display().to_string()])
        .map_err(|e| anyhow::anyhow!("training the tokenizer: {e}"))?;
    std::fs::create_dir_all(out)?;
    let tokenizer: Tokenizer = tokenizer.into();
    tokenizer
        .save(out.join("tokenizer.json"), true)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for (i, t) in SPECIAL.iter().enumerate() {
        if tokenizer.token_to_id(t) != Some(i as u32) {
            bail!("special token {t} did not get id {i}");
        }
    }
    let template = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
    let config = serde_json::json!({
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[4],
        "pad_token": SPECIAL[5],
        "chat_template": template,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    std::fs::write(
        out.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&config)? + "\n",
    )?;
    Ok(())
}

fn model_config(vocab: usize, hidden: usize, inter: usize, layers: usize) -> Result<LlamaConfig> {
    let mut c = LlamaConfig::new(vocab, hidden, inter, layers, 4, 2)?;
    c.tie_word_embeddings = true;
    c.max_position_embeddings = 512;
    c.rms_norm_eps = 1e-5;
    c.bos_token_ids = vec![0];
    c.eos_token_ids = vec![4, 1];
    c.pad_token_id = Some(5);
    Ok(c)
}

fn train_config(out: &Path, epochs: usize, lr: f64) -> TrainConfig {
    TrainConfig {
        output_dir: out.to_path_buf(),
        mode: TrainMode::Full,
        num_epochs: epochs,
        learning_rate: lr,
        warmup_ratio: 0.03,
        scheduler_type: SchedulerType::Cosine,
        weight_decay: 0.01,
        train_batch_size: 16,
        gradient_accumulation_steps: 1,
        save_steps: 0,
        save_total_limit: Some(1),
        save_epoch_checkpoints: false,
        logging_steps: 20,
        seed: 7,
        ..TrainConfig::default()
    }
}

fn save(model: &Llama, tokenizer_dir: &Path, out: &Path) -> Result<()> {
    if out.exists() {
        std::fs::remove_dir_all(out)?;
    }
    model.save(out, SaveDType::BF16)?;
    kd_model::weights::copy_tokenizer_files(tokenizer_dir, out)?;
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = parse_device("cpu")?;
    kd_train::retain_freed_memory();
    let corpus = args.dir.join("corpus");
    let tok_dir = args.dir.join("tokenizer");
    if !args.only_draft {
        train_tokenizer(&corpus.join("text.txt"), args.vocab, &tok_dir)?;
    }
    let tokenizer = ChatTokenizer::from_dir(&tok_dir)?;
    println!("tokenizer: {} tokens", tokenizer.vocab_size());
    // Model vocabularies are padded to a multiple of 64, as real checkpoints do.
    let vocab = tokenizer.vocab_size().div_ceil(64) * 64;

    // The target: question/answer pairs as chat, labels on the answer (end of turn included).
    let source = QaSource {
        files: vec![corpus.join("qa.jsonl")],
        keys: QaKeys::default(),
        policy: BadRecordPolicy::Error,
    };
    let options = ExampleOptions {
        max_seq_length: 256,
        train_on_prompt: false,
    };
    let mut examples = Vec::new();
    let mut plain = Vec::new();
    for record in source.records() {
        let mut record = record?;
        let text = format!("{}\n{}", record.messages[0].content, record.answer);
        let ids = tokenizer.encode(&text, true)?;
        plain.push(build_example(&record.id, &[], &ids, &options).0);
        record.messages.insert(0, Message::new("system", SYSTEM));
        examples.push(tokenizer.qa_example(&record, &options)?.0);
    }
    let tokens: usize = examples.iter().map(|e| e.len()).sum();
    println!("target data: {} examples, {tokens} tokens", examples.len());
    let files = ModelFiles {
        base_model: "random".into(),
        tokenizer_dir: Some(tok_dir.clone()),
    };
    if !args.only_draft {
        device.seed(1);
        let target = Llama::random(&model_config(vocab, 96, 256, 3)?, &device);
        let config = train_config(&args.work.join("target"), args.target_epochs, 3e-3);
        let (target, summary) = Trainer::new(config, &CausalLmLoss { weight: 1.0 })
            .observer(&mut Print("target"))
            .run(TrainModel::new(target).with_files(files.clone()), &examples)
            .context("training the target")?;
        println!("target: final loss {:?}", summary.last_loss);
        save(&target.llama, &tok_dir, &args.dir.join("target"))?;
    }

    // The draft: the same pairs as plain text, "question\nanswer", no chat format.
    println!("draft data: {} pairs as plain text", plain.len());
    device.seed(2);
    let draft = Llama::random(&model_config(vocab, 64, 176, 2)?, &device);
    let config = train_config(&args.work.join("draft"), args.draft_epochs, 3e-3);
    let (draft, summary) = Trainer::new(config, &CausalLmLoss { weight: 1.0 })
        .observer(&mut Print("draft"))
        .run(TrainModel::new(draft).with_files(files), &plain)
        .context("training the draft")?;
    println!("draft: final loss {:?}", summary.last_loss);
    save(&draft.llama, &tok_dir, &args.dir.join("draft"))?;
    println!("wrote {}/{{tokenizer,target,draft}}", args.dir.display());
    Ok(())
}

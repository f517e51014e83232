use std::path::Path;

use clap::FromArgMatches;
use kd_loss::KdObjective;
use kd_train::SchedulerType;

use anyhow::{Result, bail};

use super::*;

/// Parses a command line as `main` does (the default subcommand included).
fn parse(line: &str) -> Result<SpeculatorConfig> {
    let argv = std::iter::once("speculator").chain(line.split_whitespace());
    let matches = command().try_get_matches_from(argv)?;
    let cli = Cli::from_arg_matches(&matches)?;
    match cli.command {
        None => train_config(&cli.train, &matches),
        Some(Command::Train(t)) => train_config(&t, matches.subcommand_matches("train").unwrap()),
        Some(other) => bail!("not a training command: {other:?}"),
    }
}

/// The seed's "Custom Configuration" command line, flag for flag.
const SEED_CUSTOM: &str = "--target_model meta-llama/Llama-3.1-8B-Instruct \
    --draft_model meta-llama/Llama-3.2-1B-Instruct --data_dir /data/shared/datasets/sft_llama \
    --output_dir ./checkpoints_speculator --batch_size 32 --train_batch_size 4 \
    --gradient_accumulation_steps 4 --num_epochs 3 --learning_rate 2e-4 --lora_r 64 \
    --lora_alpha 128 --target_gpus 0,1,2,3 --draft_gpus 4,5,6,7 --save_steps 500";

#[test]
fn eagle3_flags_reach_the_configuration() {
    let c =
        parse("--draft_method eagle3 --draft_vocab_size 8192 --ttt_length 5 --aux_layers 2,15,27")
            .unwrap();
    assert_eq!(c.draft_method, kd_speculator::DraftMethod::Eagle3);
    assert_eq!(
        (c.draft_vocab_size, c.ttt_length, c.aux_layers),
        (Some(8192), 5, vec![2, 15, 27])
    );
    assert_eq!(c.draft_intermediate_size, None);
    let c = parse("--draft_method eagle3 --draft_intermediate_size 3072").unwrap();
    assert_eq!(c.draft_intermediate_size, Some(3072));
    assert_eq!(c.target_cache_dir, None);
    let c = parse("--draft_method eagle3 --target_cache_dir /tmp/rows").unwrap();
    assert_eq!(
        c.target_cache_dir,
        Some(std::path::PathBuf::from("/tmp/rows"))
    );
    let c = parse("").unwrap();
    assert_eq!(c.draft_method, kd_speculator::DraftMethod::Lora);
    assert!(parse("--draft_method medusa").is_err());
    assert_eq!(c.draft_head_init, kd_speculator::DraftHeadInit::Random);
    let c = parse("--draft_method eagle3 --draft_head_init target").unwrap();
    assert_eq!(c.draft_head_init, kd_speculator::DraftHeadInit::Target);
    assert!(parse("--draft_head_init zeros").is_err());
    let c = parse("--target_amx").unwrap();
    assert!(c.target_amx && !c.target_int8);
    let c = parse("--target-int8").unwrap();
    assert!(c.target_int8 && !c.target_amx);
}

#[test]
fn the_seeds_command_lines_parse_with_its_meaning() {
    let c = parse(SEED_CUSTOM).unwrap();
    assert_eq!(
        c.target_model,
        Path::new("meta-llama/Llama-3.1-8B-Instruct")
    );
    assert_eq!(c.draft_model, Path::new("meta-llama/Llama-3.2-1B-Instruct"));
    assert_eq!(c.data_dir, Path::new("/data/shared/datasets/sft_llama"));
    assert_eq!(c.output_dir, Path::new("./checkpoints_speculator"));
    assert_eq!((c.batch_size, c.train_batch_size), (32, 4));
    assert_eq!((c.gradient_accumulation_steps, c.num_epochs), (4, 3));
    assert_eq!((c.learning_rate, c.lora_r, c.lora_alpha), (2e-4, 64, 128.0));
    assert_eq!(
        (c.target_gpus.as_str(), c.draft_gpus.as_str()),
        ("0,1,2,3", "4,5,6,7")
    );
    assert_eq!(c.save_steps, 500);
    // "Testing with Limited Data".
    let c = parse("--max_samples 10000 --num_epochs 1 --save_steps 100").unwrap();
    assert_eq!(
        (c.max_samples, c.num_epochs, c.save_steps),
        (Some(10_000), 1, 100)
    );
    // The `train` subcommand is the same command.
    assert_eq!(
        parse(&format!("train {SEED_CUSTOM}")).unwrap(),
        parse(SEED_CUSTOM).unwrap()
    );
    // Kebab-case spellings are the same flags.
    let kebab = SEED_CUSTOM
        .replace('_', "-")
        .replace("sft-llama", "sft_llama");
    let kebab = kebab.replace("checkpoints-speculator", "checkpoints_speculator");
    assert_eq!(parse(&kebab).unwrap(), parse(SEED_CUSTOM).unwrap());
}

/// The defaults of the seed's "Arguments Reference", one by one.
#[test]
fn defaults_are_the_seeds() {
    let c = parse("").unwrap();
    assert_eq!(c.max_seq_length, 2048);
    assert_eq!(c.batch_size, 32);
    assert_eq!(c.train_batch_size, 4);
    assert_eq!(c.gradient_accumulation_steps, 4);
    assert_eq!(c.num_epochs, 3);
    assert_eq!(c.learning_rate, 2e-4);
    assert_eq!(c.warmup_ratio, 0.03);
    assert_eq!(c.scheduler_type, SchedulerType::Cosine);
    assert!(!c.use_distillation);
    assert_eq!(c.distillation_weight, 0.5);
    assert_eq!(c.ce_weight, 0.5);
    assert_eq!(c.temperature, 2.0);
    assert_eq!((c.lora_r, c.lora_alpha, c.lora_dropout), (64, 128.0, 0.05));
    assert_eq!(
        (c.save_steps, c.save_total_limit, c.logging_steps),
        (500, 3, 10)
    );
    assert_eq!(c.max_samples, None);
    // "Gradient Clipping: Max norm of 1.0", "Weight Decay: 0.01", all seven projections.
    assert_eq!((c.max_grad_norm, c.weight_decay), (1.0, 0.01));
    assert_eq!(
        c.lora_target_modules,
        [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj"
        ]
    );
    // Devices: the seed's GPUs in a CUDA build, the CPU otherwise.
    let (t, d) = if kd_model::device::cuda_compiled() {
        ("0,1,2,3", "4,5,6,7")
    } else {
        ("cpu", "cpu")
    };
    assert_eq!((c.target_gpus.as_str(), c.draft_gpus.as_str()), (t, d));
    assert_eq!(c, SpeculatorConfig::default());
    let c = parse("--use_distillation --scheduler_type linear --kd_objective tv_distance").unwrap();
    assert!(c.use_distillation);
    assert_eq!(c.scheduler_type, SchedulerType::Linear);
    assert_eq!(c.kd_objective, Some(KdObjective::TvDistance));
}

#[test]
fn a_config_file_is_overridden_by_the_flags_given() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("run.yaml");
    std::fs::write(&file, "lora_r: 8\nnum_epochs: 5\nscheduler_type: linear\n").unwrap();
    let c = parse(&format!("--config {} --num_epochs 2", file.display())).unwrap();
    assert_eq!((c.lora_r, c.num_epochs), (8, 2));
    assert_eq!(c.scheduler_type, SchedulerType::Linear);
    // Flags left at their defaults do not override the file.
    assert_eq!(c.learning_rate, 2e-4);
    // Unknown keys and bad values name the key and the file.
    std::fs::write(&file, "lora_rank: 8\n").unwrap();
    let e = parse(&format!("--config {}", file.display()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("lora_rank") && e.contains("run.yaml"), "{e}");
    std::fs::write(&file, "scheduler_type: cosine_with_restarts\n").unwrap();
    let e = parse(&format!("--config {}", file.display()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cosine_with_restarts") && e.contains("linear"),
        "{e}"
    );
    assert!(parse("--scheduler_type step").is_err());
    assert!(parse("--resume_from_checkpoint latest --init_adapter x").is_err());
}

#[test]
fn chat_template_kwargs_are_a_json_object() {
    // split_whitespace in `parse`: the JSON must not contain spaces.
    let c = parse(r#"--chat_template_kwargs {"enable_thinking":false}"#).unwrap();
    assert_eq!(
        c.chat_template_kwargs.get("enable_thinking"),
        Some(&serde_json::Value::Bool(false))
    );
    assert!(parse("").unwrap().chat_template_kwargs.is_empty());
    let e = parse("--chat_template_kwargs [1]").unwrap_err().to_string();
    assert!(e.contains("JSON object"), "{e}");
}

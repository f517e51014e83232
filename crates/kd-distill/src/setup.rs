//! Setting a run up: the chat template, the examples, devices, the model family check, and
//! the trainer's and LoRA's settings from the YAML.

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use kd_data::{
    BadRecordPolicy, ChatTemplate, ChatTokenizer, Example, ExampleOptions, QaKeys, QaSource,
    Truncation, special_tokens,
};
use kd_lora::{LoraConfig, TargetModules};
use kd_model::{LlamaConfig, parse_device};

use crate::config::{DistillConfig, LrScheduler, ResumeFrom};
use crate::error::{PipelineError, Result};
use kd_pipeline::vocab::{VocabDifference, vocab_difference};
use kd_train::{SchedulerType, TrainConfig, TrainMode};

/// The chat template names `data_args.template` accepts besides a path to a Jinja file.
pub const TEMPLATE_NAMES: [&str; 2] = ["native", "qwen2_5"];

/// Qwen2.5's chat template (ChatML) without the tool-calling branches, as ROLL's `qwen2_5`.
const QWEN2_5_TEMPLATE: &str = "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// The student's tokenizer with the template `data_args.template` names: `native` (absent =
/// native: the student's own), `qwen2_5`, or a path to a Jinja file.
pub fn chat_tokenizer(student: &Path, template: Option<&str>) -> Result<ChatTokenizer> {
    let tok = ChatTokenizer::from_dir(student)?;
    let name = template.unwrap_or("native").trim();
    // The special tokens a template may name (`bos_token`, …), from the student's files.
    let special = || {
        let v: serde_json::Value = std::fs::read_to_string(student.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        special_tokens(&v)
    };
    match name {
        "native" => {
            if tok.template().is_none() {
                return Err(PipelineError::Config(format!(
                    "`data_args.template: native`: the student {} has no chat template in its \
                     tokenizer files; name one of {:?} or a Jinja file",
                    student.display(),
                    &TEMPLATE_NAMES[1..]
                )));
            }
            Ok(tok)
        }
        "qwen2_5" => Ok(tok.with_template(ChatTemplate::new(QWEN2_5_TEMPLATE, special())?)),
        path if Path::new(path).is_file() => {
            let source = std::fs::read_to_string(path)
                .map_err(|e| PipelineError::io(PathBuf::from(path), e))?;
            Ok(tok.with_template(ChatTemplate::new(&source, special())?))
        }
        other => Err(PipelineError::Config(format!(
            "`data_args.template`: unknown template `{other}`; available: {} or a path to a \
             Jinja file",
            TEMPLATE_NAMES
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// Tokenized question/answer examples of `files`.
pub fn read_examples(
    config: &DistillConfig,
    tokenizer: &ChatTokenizer,
    files: &[PathBuf],
    what: &str,
) -> Result<(Vec<Example>, Truncation)> {
    for f in files {
        if !f.is_file() {
            return Err(PipelineError::Config(format!(
                "{what}: data file {} does not exist",
                f.display()
            )));
        }
    }
    let source = QaSource {
        files: files.to_vec(),
        keys: QaKeys {
            question_key: config.question_key.clone(),
            answer_key: config.answer_key.clone(),
            ..QaKeys::default()
        },
        policy: BadRecordPolicy::Error,
    };
    let options = ExampleOptions {
        max_seq_length: config.sequence_length,
        train_on_prompt: config.distill_on_prompt,
    };
    let max = config.student.data_args.max_samples.unwrap_or(usize::MAX);
    let mut examples = Vec::new();
    let mut cut = Truncation::default();
    for record in source.records().take(max) {
        let (e, t) = tokenizer.qa_example(&record?, &options)?;
        cut.add(t);
        examples.push(e);
    }
    if examples.is_empty() {
        return Err(PipelineError::Config(format!(
            "{what}: no records in {}",
            files
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok((examples, cut))
}

/// The device of a worker: its first GPU where this build reaches one (CUDA, or a hardware
/// wgpu adapter), the CPU otherwise.
pub(crate) fn worker_device(
    mapping: Option<&super::config::DeviceMapping>,
    what: &str,
    warnings: &mut Vec<String>,
) -> Result<Device> {
    match mapping.and_then(|m| m.0.first()) {
        Some(_) if kd_model::device::gpus_available() => {
            // One data-parallel rank per listed GPU (mpirun -np N); alone, the first one.
            let listed = mapping.map(|m| m.0.as_slice()).unwrap_or_default();
            let devices = listed
                .iter()
                .map(|g| parse_device(&g.to_string()))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let (device, unused) = kd_pipeline::ranks::rank_device(
                &format!("`{what}.device_mapping`"),
                &devices,
                kd_dist::world(),
            )?;
            warnings.extend(unused);
            Ok(device)
        }
        Some(_) => {
            warnings.push(format!(
                "`{what}.device_mapping` names GPUs, but this build reaches none (no CUDA, no \
                 hardware wgpu adapter): the {what} runs on the CPU"
            ));
            Ok(Device::flex())
        }
        None => Ok(Device::flex()),
    }
}

pub(crate) fn check_same_family(
    student: &LlamaConfig,
    teacher: &LlamaConfig,
    student_tok: &ChatTokenizer,
    teacher_dir: &Path,
) -> Result<()> {
    let same_type = "ROLL's distill pipeline (and this one) needs a student and a teacher of the \
                     same type, sharing one tokenizer";
    let teacher_tok = if kd_pipeline::models::has_tokenizer(teacher_dir) {
        Some(ChatTokenizer::from_dir(teacher_dir)?)
    } else {
        None
    };
    match vocab_difference(
        (student, Some(student_tok)),
        (teacher, teacher_tok.as_ref()),
    ) {
        None => Ok(()),
        Some(VocabDifference::Size { first, second }) => Err(PipelineError::Config(format!(
            "vocabulary mismatch: the student has {first} tokens, the teacher {second}; {same_type}"
        ))),
        Some(VocabDifference::Map {
            first, differing, ..
        }) => Err(PipelineError::Config(format!(
            "tokenizer mismatch: {differing} of the student's {first} tokens map to other ids in \
             the teacher's tokenizer ({}); {same_type}",
            teacher_dir.display()
        ))),
    }
}

/// The trainer's settings of a run.
pub fn train_config(config: &DistillConfig) -> TrainConfig {
    let t = &config.student.training_args;
    let max_steps = if config.max_steps > 0 {
        Some(config.max_steps as usize)
    } else if t.max_steps > 0 {
        Some(t.max_steps as usize)
    } else {
        None
    };
    TrainConfig {
        output_dir: config.output_dir.clone(),
        mode: if config.student.model_args.lora_target.is_some() {
            TrainMode::Lora
        } else {
            TrainMode::Full
        },
        num_epochs: t.num_train_epochs.ceil().max(1.0) as usize,
        max_steps,
        learning_rate: t.learning_rate,
        warmup_ratio: t.warmup_ratio,
        warmup_steps: (t.warmup_steps > 0).then_some(t.warmup_steps),
        scheduler_type: match t.lr_scheduler_type {
            LrScheduler::Linear => SchedulerType::Linear,
            LrScheduler::Cosine => SchedulerType::Cosine,
            LrScheduler::Constant => SchedulerType::Constant,
        },
        weight_decay: t.weight_decay,
        adam_beta1: t.adam_beta1,
        adam_beta2: t.adam_beta2,
        adam_epsilon: t.adam_epsilon,
        max_grad_norm: t.max_grad_norm,
        train_batch_size: t.per_device_train_batch_size,
        gradient_accumulation_steps: t.gradient_accumulation_steps,
        accumulation_shards: config.accumulation_shards,
        save_steps: config.save_steps,
        save_total_limit: (config.max_ckpt_to_keep > 0).then_some(config.max_ckpt_to_keep),
        save_epoch_checkpoints: false,
        logging_steps: config.logging_steps,
        seed: config.seed,
        resume_from_checkpoint: match &config.resume_from_checkpoint {
            ResumeFrom::No => None,
            ResumeFrom::Latest => Some("latest".into()),
            ResumeFrom::Path(p) => Some(p.display().to_string()),
        },
        ..TrainConfig::default()
    }
}

/// The LoRA settings of the student (when `lora_target` is set).
pub fn lora_config(config: &DistillConfig) -> Option<LoraConfig> {
    let m = &config.student.model_args;
    let target = m.lora_target.as_ref()?;
    let r = m.lora_rank.unwrap_or(8);
    Some(LoraConfig {
        r,
        alpha: m.lora_alpha.unwrap_or(2.0 * r as f64),
        dropout: m.lora_dropout,
        target_modules: TargetModules::Names(target.modules()),
        use_rslora: false,
    })
}

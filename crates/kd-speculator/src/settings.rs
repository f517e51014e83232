//! A run's settings for each library it drives (sampling, acceptance measurement, LoRA, the
//! trainer, on-policy rows) and its teacher, from the flags.

use std::path::Path;

use kd_eval::{EvalOptions, SpecConfig};
use kd_lora::{LoraConfig, TargetModules};
use kd_model::{CapturedRow, Llama, Sampling};
use kd_teacher::{
    Generation, LocalTeacher, Prompt, RemoteConfig, RemoteTeacher, ReplicatedTeacher,
    SamplingParams, Teacher, model_fingerprint,
};

use crate::config::SpeculatorConfig;
use crate::error::{PipelineError, Result};
use crate::loss::SpeculatorLoss;
use crate::setup::Setup;
use kd_pipeline::on_policy::OnPolicyConfig;
use kd_train::{TrainConfig, TrainMode};

/// The teacher of a run.
pub(crate) enum TeacherBackend {
    Local(Box<LocalTeacher>),
    Replicated(ReplicatedTeacher<LocalTeacher>),
    Remote(Box<RemoteTeacher>, Option<Box<Llama>>),
}

impl TeacherBackend {
    pub(crate) fn teacher(&self) -> &dyn Teacher {
        match self {
            Self::Local(t) => t.as_ref(),
            Self::Replicated(t) => t,
            Self::Remote(t, _) => t.as_ref(),
        }
    }

    /// The target in this process (on one device or several), whose decode loop can keep what
    /// it computes ([`LocalTeacher::generate_captured`]); not a remote one.
    pub(crate) fn in_process(&self) -> bool {
        !matches!(self, Self::Remote(..))
    }

    /// [`Teacher::generate`] with what the target in this process computed at every position
    /// of each prompt and completion (`layers`' hidden states, the logits' normaliser and
    /// argmax); an error for a remote target ([`in_process`](Self::in_process)).
    pub(crate) fn generate_captured(
        &self,
        prompts: &[Prompt],
        params: &SamplingParams,
        layers: &[usize],
    ) -> kd_teacher::Result<Vec<(Generation, CapturedRow)>> {
        match self {
            Self::Local(t) => t.generate_captured(prompts, params, layers),
            Self::Replicated(t) => t.generate_captured(prompts, params, layers),
            Self::Remote(..) => Err(kd_teacher::TeacherError::Config(
                "a remote target keeps no hidden states while it generates".into(),
            )),
        }
    }

    /// The target's weights here, for speculative decoding.
    pub(crate) fn target(&self) -> Option<&Llama> {
        match self {
            Self::Local(t) => Some(t.model()),
            Self::Replicated(t) => Some(t.replicas()[0].model()),
            Self::Remote(_, m) => m.as_deref(),
        }
    }
}

/// `target` (loaded from `path`) set to decode with 8-bit activations (`int8`), on AMX tiles
/// (`amx`, which implies `int8`), or as loaded; an error naming the flag where the target
/// cannot (no packed GGUF blocks; no AMX tiles on this CPU or for these block types).
pub(crate) fn decoding_target(target: Llama, path: &Path, int8: bool, amx: bool) -> Result<Llama> {
    let int8 = int8 || amx;
    let target = target.with_int8_activations(int8).with_amx_tiles(amx);
    if int8 && !target.int8_activations() {
        return Err(no_blocks(path, amx));
    }
    check_cpu(int8, amx)?;
    if amx && !target.amx_tiles() {
        return Err(no_tiles(path));
    }
    Ok(target)
}

/// The check of `--target_int8` / `--target_amx` from the target's file header and this CPU,
/// before any weight is read (the dry run's, and the first thing [`load_teacher`] does):
/// what [`decoding_target`] refuses, but for the block types an AMX target needs (only the
/// loaded blocks tell).
pub(crate) fn check_decoding_flags(config: &SpeculatorConfig, setup: &Setup) -> Result<()> {
    let (int8, amx) = (config.target_int8 || config.target_amx, config.target_amx);
    if !int8 {
        return Ok(());
    }
    if setup.target_config.is_none() {
        return Err(remote_only(amx));
    }
    let path = &config.target_model;
    let on_cpu = setup.target_devices.first() == Some(&burn::tensor::Device::flex());
    if !on_cpu || !matches!(Llama::packed_projections(path)?, Some((n, _)) if n > 0) {
        return Err(no_blocks(path, amx));
    }
    check_cpu(int8, amx)?;
    if amx && !Llama::amx_tiles_available() {
        return Err(no_tiles(path));
    }
    Ok(())
}

/// The flags need a local target: one reached only at `--teacher_url` decodes as its server
/// does.
fn remote_only(amx: bool) -> PipelineError {
    PipelineError::Config(format!(
        "{}: the target is only reachable at --teacher_url here, which decodes as its \
         server does; the flag sets a local target's arithmetic (give --target_model \
         a local GGUF file, or leave the flag out)",
        target_flag(amx)
    ))
}

/// The target at `path` has no packed blocks for 8-bit activations to meet.
fn no_blocks(path: &Path, amx: bool) -> PipelineError {
    PipelineError::Config(format!(
        "{}: the target {} has no packed GGUF blocks to decode from (a .gguf \
         file of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K projections on the cpu device)",
        target_flag(amx),
        path.display()
    ))
}

/// 8-bit activations below AVX2 would stand down to f32 products.
fn check_cpu(int8: bool, amx: bool) -> Result<()> {
    if int8 && kd_kernels::cpu::level() < kd_kernels::cpu::SimdLevel::Avx2 {
        return Err(PipelineError::Config(format!(
            "{}: 8-bit activations need AVX2 or above, and decoding here runs at {} (the \
             CPU, or KD_SIMD); leave the flag out",
            target_flag(amx),
            kd_kernels::cpu::level().name()
        )));
    }
    Ok(())
}

/// No AMX tiles for the target at `path` (this CPU or its block types).
fn no_tiles(path: &Path) -> PipelineError {
    PipelineError::Config(format!(
        "--target_amx: no AMX tiles for the target {}: they need a CPU with AMX-INT8 \
         (Sapphire Rapids or a later Xeon) under Linux, KD_SIMD not capping it below avx512, \
         and Q4_1 or Q8_0 projections (use --target_int8 elsewhere)",
        path.display()
    ))
}

/// The flag that asked for 8-bit activations (`--target_amx` implies them).
fn target_flag(amx: bool) -> &'static str {
    if amx { "--target_amx" } else { "--target_int8" }
}

/// The teacher cache's fingerprint of the target at `path` as this run decodes it: 8-bit
/// activations give other completions than f32 ones, so their outputs are cached apart.
fn decoding_fingerprint(config: &SpeculatorConfig, path: &Path) -> Result<String> {
    let base = model_fingerprint(path)?;
    Ok(if config.target_amx {
        format!("{base}+int8-amx")
    } else if config.target_int8 {
        format!("{base}+int8")
    } else {
        base
    })
}

pub(crate) fn load_teacher(config: &SpeculatorConfig, setup: &Setup) -> Result<TeacherBackend> {
    // What the dry run checks of the 8-bit flags, before anything is loaded; the loaded
    // blocks are checked again by `decoding_target`.
    check_decoding_flags(config, setup)?;
    let dir = &config.target_model;
    if let Some(urls) = &config.teacher_url {
        // Several servers: rank r talks to server r mod n.
        let (url, servers) = kd_pipeline::ranks::rank_url(urls, kd_dist::world())?;
        let remote = RemoteTeacher::new(RemoteConfig {
            url,
            api: config.teacher_api,
            model: config.teacher_model_name.clone(),
            vocab_size: Some(setup.draft_config.vocab_size),
            max_concurrency: config.teacher_max_concurrency,
            request_timeout_s: config.teacher_timeout_s,
            max_retries: config.teacher_max_retries,
            fingerprint: match setup.target_config {
                Some(_) => Some(model_fingerprint(dir)?),
                None => servers,
            },
            ..RemoteConfig::default()
        })?;
        let local = match &setup.target_config {
            Some(_) => Some(Box::new(decoding_target(
                Llama::load_for_inference(dir, &setup.target_devices[0])?,
                dir,
                config.target_int8,
                config.target_amx,
            )?)),
            None => None,
        };
        return Ok(TeacherBackend::Remote(Box::new(remote), local));
    }
    let fingerprint = decoding_fingerprint(config, dir)?;
    let mut replicas = Vec::with_capacity(setup.target_devices.len());
    for device in &setup.target_devices {
        let model = decoding_target(
            Llama::load_for_inference(dir, device)?,
            dir,
            config.target_int8,
            config.target_amx,
        )?;
        replicas.push(LocalTeacher::new(
            model,
            config.batch_size,
            fingerprint.clone(),
        ));
    }
    Ok(if replicas.len() == 1 {
        TeacherBackend::Local(Box::new(replicas.pop().expect("one replica")))
    } else {
        TeacherBackend::Replicated(ReplicatedTeacher::new(replicas)?)
    })
}

/// The target's sampling parameters of a run.
pub fn generation_params(config: &SpeculatorConfig) -> SamplingParams {
    SamplingParams {
        max_new_tokens: config.max_new_tokens,
        temperature: config.generation_temperature,
        top_k: config.generation_top_k,
        top_p: config.generation_top_p,
        seed: config.seed,
        ..SamplingParams::default()
    }
}

/// The acceptance measurement of a run.
pub fn eval_options(config: &SpeculatorConfig) -> EvalOptions {
    EvalOptions {
        spec: SpecConfig {
            k: config.eval_k,
            max_new_tokens: config.eval_max_new_tokens,
            sampling: Sampling::temperature(config.eval_temperature),
            stop_token_ids: Vec::new(),
            draft_p_min: config.eval_draft_p_min,
        },
        batch_size: config.eval_batch_size,
        seed: config.seed,
        baselines: true,
        cost_ratio: None,
    }
}

/// The LoRA settings of a run.
pub fn lora_config(config: &SpeculatorConfig) -> LoraConfig {
    LoraConfig {
        r: config.lora_r,
        alpha: config.lora_alpha,
        dropout: config.lora_dropout,
        target_modules: TargetModules::Names(config.lora_target_modules.clone()),
        use_rslora: false,
    }
}

/// The trainer's settings of a run.
pub fn train_config(config: &SpeculatorConfig) -> TrainConfig {
    TrainConfig {
        output_dir: config.output_dir.clone(),
        mode: TrainMode::Lora,
        num_epochs: config.num_epochs,
        learning_rate: config.learning_rate,
        warmup_ratio: config.warmup_ratio,
        scheduler_type: config.scheduler_type,
        weight_decay: config.weight_decay,
        max_grad_norm: config.max_grad_norm,
        train_batch_size: config.train_batch_size,
        gradient_accumulation_steps: config.gradient_accumulation_steps,
        accumulation_shards: config.accumulation_shards,
        save_steps: config.save_steps,
        save_total_limit: Some(config.save_total_limit),
        save_epoch_checkpoints: true,
        logging_steps: config.logging_steps,
        seed: config.seed,
        resume_from_checkpoint: config.resume_from_checkpoint.clone(),
        ..TrainConfig::default()
    }
}

/// The on-policy settings of a run (λ = 0: none).
pub fn on_policy_config(config: &SpeculatorConfig) -> OnPolicyConfig {
    OnPolicyConfig {
        ratio: config.on_policy_ratio,
        temperature: config.on_policy_temperature,
        top_p: config.on_policy_top_p,
        top_k: 0,
        max_new_tokens: config.on_policy_max_new_tokens(),
        max_seq_length: config.max_seq_length,
        match_length: config.on_policy_match_length,
        teacher_top_k: config.kd_topk,
        kd: SpeculatorLoss::kd_config(config.kd_objective(), config.temperature, config.kd_topk),
        kd_weight: config.kd_weight,
    }
}

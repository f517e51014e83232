//! The distill pipeline end to end: question/answer records → the student's chat template →
//! the teacher's top-k log-probs of the same tokens (cached) → the student trained on
//! `(1 − w)·CE + w·KD` → validation every `eval_steps` → checkpoints, exact resume and
//! TensorBoard under `logging_dir` with ROLL's metric names.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::Device;
use kd_data::{Batch, BatchOptions, ChatTokenizer, Example, Truncation, collate, plan_batches};
use kd_model::Llama;
use kd_teacher::{LocalTeacher, RemoteConfig, RemoteTeacher, Teacher, model_fingerprint};
use serde::Serialize;

use super::config::{DistillConfig, ModelDType, ResumeFrom, TrackWith, TransferBackend};
use super::loss::DistillLoss;
use crate::error::{PipelineError, Result};
use crate::scores::{TeacherScores, score_data};
use crate::setup::{
    chat_tokenizer, check_same_family, lora_config, read_examples, train_config, worker_device,
};
use crate::watch::{RollMetrics, Validator};
use kd_pipeline::on_policy::{OnPolicy, OnPolicyConfig, OnPolicyData, OnPolicyTotals};
use kd_train::TrainMode;
use kd_train::checkpoint::step_checkpoints;
use kd_train::metrics::{LogRecord, TensorBoard, TrainObserver};
use kd_train::{ModelFiles, TrainModel, TrainSummary, Trainer};

/// The stages of a run, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DistillPhase {
    /// Reading the data and loading the models.
    Setup,
    /// The teacher scores every training and validation example.
    Score,
    /// Training (with validation every `eval_steps`).
    Train,
}

impl DistillPhase {
    /// A short name for displays.
    pub fn name(self) -> &'static str {
        match self {
            Self::Setup => "setup",
            Self::Score => "teacher scoring",
            Self::Train => "train",
        }
    }
}

/// One validation pass.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Validation {
    /// The optimizer step it followed.
    pub step: usize,
    /// ROLL's `student/val_loss`: the student's CE per counted token.
    pub val_loss: f64,
    /// The KD objective per counted token.
    pub kd_loss: f64,
    /// α = mean Σ min(p, q) on the teacher's support.
    pub alpha: f64,
    /// Share of positions where the student's and the teacher's argmax agree.
    pub top1_agreement: f64,
    /// Counted positions.
    pub tokens: usize,
    /// Wall time (`time/val`).
    pub seconds: f64,
}

/// Progress callbacks of a run (the library prints nothing).
pub trait DistillObserver: TrainObserver {
    /// A phase starts.
    fn on_phase(&mut self, _phase: DistillPhase) {}
    /// Something the user should know that does not stop the run.
    fn on_warning(&mut self, _message: &str) {}
    /// The teacher scored `done` of `total` sequences.
    fn on_score_progress(&mut self, _done: usize, _total: usize) {}
    /// A validation pass finished.
    fn on_validation(&mut self, _v: &Validation) {}
}

/// An observer that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct QuietDistill;

impl TrainObserver for QuietDistill {}
impl DistillObserver for QuietDistill {}

/// A data-parallel rank other than 0 reports nothing (it relays stop signals).
impl DistillObserver for kd_pipeline::QuietRank {}

/// How a run went.
#[derive(Debug, Clone, PartialEq)]
pub struct DistillSummary {
    /// Checkpoints are here.
    pub output_dir: PathBuf,
    /// TensorBoard files are here (with `track_with: tensorboard`).
    pub logging_dir: PathBuf,
    /// Training and validation examples.
    pub examples: (usize, usize),
    /// Label tokens per epoch.
    pub train_tokens: usize,
    /// Seconds the teacher spent scoring (about 0 when every score came from the cache).
    pub teacher_seconds: f64,
    /// Sequences the teacher scored in this run (0 when every score came from the cache).
    pub scored_sequences: usize,
    /// The trainer's summary.
    pub train: TrainSummary,
    /// What the on-policy rows cost (runs with on-policy rows only).
    pub on_policy: Option<OnPolicyTotals>,
    /// The last logged record.
    pub last_log: Option<LogRecord>,
    /// Every validation pass of this run.
    pub validations: Vec<Validation>,
    /// Non-fatal problems met on the way.
    pub warnings: Vec<String>,
}

/// Runs the pipeline: setup, the data, the models, the teacher's scores (cached), then
/// training with validation.
pub fn run(config: &DistillConfig, observer: &mut dyn DistillObserver) -> Result<DistillSummary> {
    observer.on_phase(DistillPhase::Setup);
    config.validate()?;
    // Across ranks (mpirun -np N), every rank runs every phase on its share; rank 0 alone
    // writes the run's files and validates. Hub ids are downloaded by one rank per machine at
    // a time, the others then find them in the cache.
    let world = kd_dist::world();
    let (student_dir, teacher_dir) = kd_pipeline::ranks::local_turns(world, || {
        Ok((config.student_path()?, config.teacher_path()?))
    })?;
    // Held until the run returns: a second run into the same directory is refused.
    let _lock = world.root_first(|| {
        if world.is_root() {
            prepare_output_dir(config).map(Some)
        } else {
            Ok(None)
        }
    })?;
    let mut warnings = Vec::new();
    let (student_device, teacher_device) = devices(config, &mut warnings)?;
    for w in &warnings {
        observer.on_warning(w);
    }

    let tokenizer = run_tokenizer(config, &student_dir)?;
    let data = read_data(config, &tokenizer)?;
    for w in &data.warnings {
        observer.on_warning(w);
    }
    warnings.extend(data.warnings.iter().cloned());

    let student = Llama::load(&student_dir, &student_device)?;
    let teacher = load_teacher(config, teacher_dir, (&student, &tokenizer), &teacher_device)?;

    observer.on_phase(DistillPhase::Score);
    let scores = score_data(
        config,
        teacher.as_ref(),
        &data,
        student.config().vocab_size,
        observer,
    )?;

    observer.on_phase(DistillPhase::Train);
    let trained = train_student(TrainInputs {
        config,
        student_dir: &student_dir,
        student: &student,
        teacher: teacher.as_ref(),
        data: &data,
        scores: &scores,
        observer,
    })?;
    let train_tokens = data
        .train
        .iter()
        .map(|e| e.labels.iter().skip(1).filter(|l| **l >= 0).count())
        .sum();
    Ok(DistillSummary {
        output_dir: config.output_dir.clone(),
        logging_dir: config.logging_dir.clone(),
        examples: (data.train.len(), data.validation.len()),
        train_tokens,
        teacher_seconds: scores.seconds,
        scored_sequences: scores.sequences,
        train: trained.summary,
        on_policy: trained.on_policy,
        last_log: trained.last_log,
        validations: trained.validations,
        warnings,
    })
}

/// The tokenizer a run renders its data with: the student's, with `data_args.template` and
/// the template variables `chat_template_kwargs`.
pub fn run_tokenizer(config: &DistillConfig, student_dir: &Path) -> Result<ChatTokenizer> {
    Ok(
        chat_tokenizer(student_dir, config.student.data_args.template.as_deref())?
            .with_template_variables(&config.chat_template_kwargs)?,
    )
}

/// Clears the output (and TensorBoard event files) when asked to; refuses a directory with an
/// earlier run's checkpoints unless resuming, and a `resume_from_checkpoint` path that is no
/// checkpoint.
fn prepare_output_dir(config: &DistillConfig) -> Result<kd_pipeline::RunLock> {
    let out = &config.output_dir;
    let lock = kd_pipeline::RunLock::acquire(out)?;
    if config.overwrite_output_dir && config.resume_from_checkpoint == ResumeFrom::No {
        if out.exists() {
            kd_pipeline::clear_run(out, &[])?;
        }
        if config.track_with == TrackWith::Tensorboard && config.logging_dir.is_dir() {
            for e in std::fs::read_dir(&config.logging_dir)
                .map_err(|e| PipelineError::io(&config.logging_dir, e))?
                .flatten()
            {
                if e.file_name()
                    .to_string_lossy()
                    .starts_with("events.out.tfevents.")
                {
                    std::fs::remove_file(e.path())
                        .map_err(|err| PipelineError::io(e.path(), err))?;
                }
            }
        }
    }
    if config.resume_from_checkpoint == ResumeFrom::No && !step_checkpoints(out).is_empty() {
        return Err(PipelineError::OutputDir {
            path: out.clone(),
            message: "holds checkpoints of an earlier run; continue it with \
                      `resume_from_checkpoint=true`, replace it with \
                      `overwrite_output_dir=true`, or choose another `output_dir`"
                .into(),
        });
    }
    if let ResumeFrom::Path(p) = &config.resume_from_checkpoint {
        kd_train::checkpoint::read_state(p).map_err(|_| PipelineError::Checkpoint {
            path: p.clone(),
            message: "`resume_from_checkpoint` names no checkpoint: expected a `checkpoint-N` \
                      directory written by this pipeline (with training_state/)"
                .into(),
        })?;
    }
    Ok(lock)
}

/// The student's and the teacher's devices, with warnings for settings the CPU backend does
/// not honour.
fn devices(config: &DistillConfig, warnings: &mut Vec<String>) -> Result<(Device, Device)> {
    for (what, w) in [("student", &config.student), ("teacher", &config.teacher)] {
        if w.model_args.dtype != ModelDType::Fp32 {
            warnings.push(format!(
                "`{what}.model_args.dtype: {:?}`: the CPU backend computes in f32",
                w.model_args.dtype
            ));
        }
    }
    if config.student.use_sequence_packing || config.teacher.use_sequence_packing {
        warnings.push(
            "`use_sequence_packing` is ignored: distillation aligns the teacher's scores with one \
             example per row"
                .into(),
        );
    }
    let student_device =
        worker_device(config.student.device_mapping.as_ref(), "student", warnings)?;
    let teacher_device = match config.logits_transfer_backend {
        TransferBackend::IpcNccl => student_device.clone(),
        TransferBackend::NcclOnly => {
            worker_device(config.teacher.device_mapping.as_ref(), "teacher", warnings)?
        }
        TransferBackend::Ray => Device::flex(),
    };
    Ok((student_device, teacher_device))
}

/// The training and validation examples of a run.
pub(crate) struct Data {
    pub(crate) train: Vec<Example>,
    pub(crate) validation: Vec<Example>,
    /// What reading them met (cut examples, no validation data).
    pub(crate) warnings: Vec<String>,
}

/// Reads the question/answer files named by the config, rendered through the chat template.
fn read_data(config: &DistillConfig, tokenizer: &ChatTokenizer) -> Result<Data> {
    let mut warnings = Vec::new();
    let files = config
        .student
        .data_args
        .file_name
        .as_ref()
        .map(|f| f.paths())
        .ok_or_else(|| {
            PipelineError::Config(
                "`student.data_args.file_name` is not set: name the question/answer JSON files"
                    .into(),
            )
        })?;
    let (train, cut) = read_examples(config, tokenizer, &files, "student.data_args.file_name")?;
    let val_files = config
        .validation
        .as_ref()
        .and_then(|v| v.data_args.file_name.as_ref())
        .or(config.student.data_args.eval_file_name.as_ref())
        .map(|f| f.paths());
    let (validation, val_cut) = match &val_files {
        Some(f) => read_examples(config, tokenizer, f, "validation.data_args.file_name")?,
        None => (Vec::new(), Truncation::default()),
    };
    if cut.examples + val_cut.examples > 0 {
        warnings.push(format!(
            "{} examples were cut to `sequence_length` {}",
            cut.examples + val_cut.examples,
            config.sequence_length
        ));
    }
    if validation.is_empty() && config.eval_steps > 0 {
        warnings.push(
            "no validation data (`validation.data_args.file_name`): validation is skipped".into(),
        );
    }
    Ok(Data {
        train,
        validation,
        warnings,
    })
}

/// The teacher: a local model (checked to be of the student's family), or a teacher server
/// (`logits_transfer_backend: ray`).
fn load_teacher(
    config: &DistillConfig,
    teacher_dir: Option<PathBuf>,
    (student, tokenizer): (&Llama, &ChatTokenizer),
    device: &Device,
) -> Result<Box<dyn Teacher>> {
    let vocab = student.config().vocab_size;
    Ok(match (&config.logits_transfer_backend, teacher_dir) {
        (TransferBackend::Ray, local) => {
            if let Some(dir) = &local
                && kd_pipeline::models::is_local_model(dir)
            {
                let tc = kd_pipeline::models::model_config("teacher", dir)?;
                check_same_family(student.config(), &tc, tokenizer, dir)?;
            }
            // Several servers: rank r talks to server r mod n.
            let (url, fingerprint) = kd_pipeline::ranks::rank_url(
                config.teacher.url.as_deref().unwrap_or_default(),
                kd_dist::world(),
            )?;
            Box::new(RemoteTeacher::new(RemoteConfig {
                url,
                vocab_size: Some(vocab),
                fingerprint,
                ..RemoteConfig::default()
            })?)
        }
        (_, None) => {
            return Err(PipelineError::Config(
                "no teacher model: set `teacher_pretrain` (or \
                 `teacher.model_args.model_name_or_path`), or a teacher server with \
                 `logits_transfer_backend: ray` and `teacher.url`"
                    .into(),
            ));
        }
        (_, Some(dir)) => {
            let model = Llama::load_for_inference(&dir, device)?;
            check_same_family(student.config(), model.config(), tokenizer, &dir)?;
            Box::new(LocalTeacher::new(
                model,
                config.teacher.infer_batch_size,
                model_fingerprint(&dir)?,
            ))
        }
    })
}

/// What the training phase needs.
struct TrainInputs<'a, 'o> {
    config: &'a DistillConfig,
    student_dir: &'a Path,
    student: &'a Llama,
    teacher: &'a dyn Teacher,
    data: &'a Data,
    scores: &'a TeacherScores,
    observer: &'o mut dyn DistillObserver,
}

/// What the training phase produced.
struct TrainedStudent {
    summary: TrainSummary,
    on_policy: Option<OnPolicyTotals>,
    last_log: Option<LogRecord>,
    validations: Vec<Validation>,
}

/// The validation batches: length-bucketed, in a fixed order.
fn validation_batches(config: &DistillConfig, examples: &[Example], pad_id: u32) -> Vec<Batch> {
    if examples.is_empty() {
        return Vec::new();
    }
    let lengths: Vec<usize> = examples.iter().map(Example::len).collect();
    let plan = plan_batches(
        &lengths,
        &BatchOptions {
            batch_size: config.student.infer_batch_size,
            bucket_by_length: true,
            shuffle: false,
            seed: config.seed,
            ..BatchOptions::default()
        },
        0,
    );
    plan.iter()
        .map(|rows| collate(examples, rows, pad_id, usize::MAX))
        .collect()
}

/// Trains the student (LoRA, fresh or from an adapter, or full fine-tuning) on
/// `(1 − w)·CE + w·KD`, validating every `eval_steps` (and at step 0 of a fresh run), with
/// ROLL's metrics and on-policy rows when asked for.
fn train_student(inputs: TrainInputs<'_, '_>) -> Result<TrainedStudent> {
    let TrainInputs {
        config,
        student_dir,
        student,
        teacher,
        data,
        scores,
        observer,
    } = inputs;
    let llama = match (
        &config.student.model_args.adapter_name_or_path,
        lora_config(config),
    ) {
        (Some(dir), _) => student.clone().load_adapter(dir)?.0,
        (None, Some(l)) => student.clone().apply_lora_seeded(&l, config.seed)?,
        (None, None) => student.clone(),
    };
    let mut tconfig = train_config(config);
    if config.student.model_args.adapter_name_or_path.is_some() {
        tconfig.mode = TrainMode::Lora;
    }
    let files = ModelFiles {
        base_model: student_dir.display().to_string(),
        tokenizer_dir: Some(student_dir.to_path_buf()),
    };
    let root = kd_dist::world().is_root();
    let tb = if config.track_with == TrackWith::Tensorboard && root {
        let mut tb = TensorBoard::create(&config.logging_dir)?;
        tb.scalar("train/teacher_forward", scores.seconds, 0)?;
        Some(RefCell::new(tb))
    } else {
        None
    };
    let kd = config.kd_config();
    let loss = DistillLoss {
        distill_loss_weight: config.distill_loss_weight,
        kd,
        scores: &scores.train,
    };
    let shared: RefCell<&mut dyn DistillObserver> = RefCell::new(observer);
    let mut metrics = RollMetrics {
        inner: &shared,
        tb: tb.as_ref(),
        last_log: None,
        step_started: Instant::now(),
        step_seconds: 0.0,
        steps_in_window: 0,
        error: None,
    };
    let mut validator = Validator {
        batches: validation_batches(config, &data.validation, student.pad_id()),
        scores: &scores.validation,
        kd,
        every: config.eval_steps,
        tb: tb.as_ref(),
        results: Vec::new(),
        observer: &shared,
    };
    if config.resume_from_checkpoint == ResumeFrom::No && !validator.batches.is_empty() && root {
        let v = validator.validate(0, &llama)?;
        shared.borrow_mut().on_validation(&v);
    }
    let mut on_policy = OnPolicyData::new(OnPolicy {
        config: OnPolicyConfig {
            ratio: config.on_policy_ratio,
            temperature: config.on_policy_temperature,
            top_p: config.on_policy_top_p,
            top_k: 0,
            max_new_tokens: config.on_policy_max_new_tokens,
            max_seq_length: config.sequence_length,
            match_length: config.on_policy_match_length,
            teacher_top_k: scores.top_k,
            kd,
            kd_weight: config.distill_loss_weight,
        },
        teacher,
    })?;
    let (_, summary) = Trainer::new(tconfig, &loss)
        .observer(&mut metrics)
        .hook(&mut validator)
        .step_data(&mut on_policy)
        .run(TrainModel::new(llama).with_files(files), &data.train)?;
    if let Some(e) = metrics.error.take() {
        return Err(e);
    }
    Ok(TrainedStudent {
        summary,
        on_policy: on_policy.totals().cloned(),
        last_log: metrics.last_log.take(),
        validations: validator.results,
    })
}

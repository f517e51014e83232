//! The training loop: micro-batches of a step share one global token count (every loss term
//! of the step is a sum over counted tokens divided by it), gradients are summed over
//! micro-batches and their shards, clipped by global norm, AdamW with a step-derived learning
//! rate; checkpoints and metrics; exact resume.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor};
use kd_data::{Batch, BatchOptions, Example, collate, plan_batches};
use kd_lora::{LoraConfig, derive_seed};
use kd_loss::{HiddenProjection, LossStats, linear_cross_entropy};
use kd_model::{Llama, SaveDType, TokenBatch};
use serde_json::json;

use crate::checkpoint::{
    OPTIMIZER_FILE, PROJECTION_FILE, STATE_FILE, TRAINER_STATE_FILE, TRAINING_STATE_DIR,
    TrainerState, TrainingState, prune, read_state, resolve_resume, write_checkpoint,
};
use crate::config::{TrainConfig, TrainMode};
use crate::error::{Result, TrainError};
use crate::metrics::{LogRecord, TensorBoard, TextLog, TrainObserver};
use crate::on_policy::{
    OnPolicy, OnPolicyLoss, OnPolicySamples, OnPolicyTotals, on_policy_rows, on_policy_terms,
};
use crate::optim::{AdamW, AdamWParams, clip_coefficient, global_grad_norm};
use crate::schedule::learning_rate;

/// What is trained: the model and, for hidden-state distillation, the projection.
#[derive(Module, Debug)]
pub struct TrainModel {
    /// The student / draft model (with adapters in LoRA mode).
    pub llama: Llama,
    /// Student → teacher hidden-state projection, trained with the adapters.
    pub projection: Option<HiddenProjection>,
}

/// The loss of one micro-batch; every term is already a sum over counted tokens divided by
/// the step's global token count.
pub struct StepLoss {
    /// The differentiable total.
    pub total: Tensor<1>,
    /// Each term's value (`ce_loss`, `kd_loss`, `hidden_mse`), weighted as in the total.
    pub terms: Vec<(&'static str, f64)>,
    /// The KD term's statistics (unweighted sums over the batch's counted positions), when
    /// the loss has one: the trainer reports on-policy and off-policy rows apart from them.
    pub kd: Option<LossStats>,
}

/// How a micro-batch becomes a loss (the pipelines implement it; the teacher can be in the
/// loop here).
pub trait StepLossFn {
    /// The loss of `batch` (examples `batch.examples` of the training set) normalised by
    /// `normalizer`, with dropout masks derived from `dropout_seed`.
    fn loss(
        &self,
        model: &TrainModel,
        batch: &Batch,
        normalizer: f32,
        dropout_seed: u64,
    ) -> Result<StepLoss>;
}

/// The model input of a collated batch (packed rows attend within their sequence).
pub fn token_batch(batch: &Batch) -> Result<TokenBatch> {
    let tb = TokenBatch::new(
        batch.batch_size,
        batch.seq_len,
        batch.input_ids.clone(),
        batch.attention_mask.clone(),
    )?
    .with_positions(batch.position_ids.clone())?;
    Ok(if batch.is_packed() {
        tb.with_segments(batch.sequence_ids.clone())?
    } else {
        tb
    })
}

/// Next-token cross-entropy on the batch's labels (the speculator's language-modelling term,
/// and SFT).
#[derive(Debug, Clone, Copy)]
pub struct CausalLmLoss {
    /// Weight of the term in the total (the seed's `--ce_weight`; 1 for plain SFT).
    pub weight: f64,
}

impl StepLossFn for CausalLmLoss {
    fn loss(
        &self,
        model: &TrainModel,
        batch: &Batch,
        normalizer: f32,
        dropout_seed: u64,
    ) -> Result<StepLoss> {
        // The final hidden states, then the LM head fused with the loss (the logits are
        // never materialised whole).
        let h = crate::kd_term::final_hidden(&model.llama, batch, Some(dropout_seed), &[])?;
        let ce = linear_cross_entropy(
            h.flat,
            model.llama.lm_head_weight(),
            &h.shifted.targets,
            normalizer,
        )?;
        let value = ce.stats.loss_sum / normalizer as f64 * self.weight;
        Ok(StepLoss {
            total: ce.loss * self.weight,
            terms: vec![("ce_loss", value)],
            kd: None,
        })
    }
}

/// Splits the rows of one micro-batch into `shards` (contiguous, the first ones one row
/// longer when it does not divide): the shards of [`TrainConfig::accumulation_shards`].
pub fn shard_rows<T: Clone>(rows: &[T], shards: usize) -> Vec<Vec<T>> {
    let r = shards.max(1);
    let base = rows.len() / r;
    let extra = rows.len() % r;
    let mut out = Vec::with_capacity(r);
    let mut at = 0;
    for k in 0..r {
        let n = base + usize::from(k < extra);
        out.push(rows[at..at + n].to_vec());
        at += n;
    }
    out
}

/// Gradients, total loss and the loss terms of one optimizer step.
pub type StepGradients = (GradientsParams, f64, Vec<(&'static str, f64)>);

/// The gradient of one optimizer step: every micro-batch (and shard) with the same
/// global normaliser, gradients summed — what an all-reduce of per-rank sums gives.
pub fn step_gradients(
    model: &TrainModel,
    micro_batches: &[Batch],
    normalizer: f32,
    loss_fn: &dyn StepLossFn,
    seeds: &[u64],
) -> Result<StepGradients> {
    let parts: Vec<(&Batch, &dyn StepLossFn)> =
        micro_batches.iter().map(|b| (b, loss_fn)).collect();
    let step = mixed_step_gradients(model, &parts, normalizer, seeds)?;
    Ok((step.grads, step.loss, step.terms))
}

/// Gradients and losses of one optimizer step whose micro-batches may each have their own
/// loss (off-policy and on-policy rows).
pub struct MixedStep {
    /// Summed gradients.
    pub grads: GradientsParams,
    /// The step's total loss.
    pub loss: f64,
    /// Each term summed over the micro-batches.
    pub terms: Vec<(&'static str, f64)>,
    /// KD statistics of each micro-batch (None where its loss has no KD term).
    pub kd: Vec<Option<LossStats>>,
}

/// [`step_gradients`] with a loss per micro-batch.
pub fn mixed_step_gradients(
    model: &TrainModel,
    parts: &[(&Batch, &dyn StepLossFn)],
    normalizer: f32,
    seeds: &[u64],
) -> Result<MixedStep> {
    let mut acc = GradientsAccumulator::<TrainModel>::new();
    let mut total = 0.0;
    let mut terms: Vec<(&'static str, f64)> = Vec::new();
    let mut kd = Vec::with_capacity(parts.len());
    for ((mb, loss_fn), seed) in parts.iter().zip(seeds) {
        let l = loss_fn.loss(model, mb, normalizer, *seed)?;
        total += l.total.clone().into_scalar::<f32>() as f64;
        for (k, v) in l.terms {
            match terms.iter_mut().find(|(n, _)| *n == k) {
                Some((_, s)) => *s += v,
                None => terms.push((k, v)),
            }
        }
        kd.push(l.kd);
        let grads = GradientsParams::from_grads(l.total.backward(), model);
        acc.accumulate(model, grads);
    }
    Ok(MixedStep {
        grads: acc.grads(),
        loss: total,
        terms,
        kd,
    })
}

/// What the run is: files to copy into checkpoints and how to name the base model.
#[derive(Debug, Clone, Default)]
pub struct RunInfo {
    /// LoRA settings (LoRA mode).
    pub lora: Option<LoraConfig>,
    /// `base_model_name_or_path` written into adapter configs.
    pub base_model: String,
    /// Tokenizer files copied into every checkpoint.
    pub tokenizer_dir: Option<PathBuf>,
    /// The pad id used to collate batches.
    pub pad_id: u32,
}

/// How a finished run went.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSummary {
    /// Optimizer steps done (including skipped ones).
    pub global_step: usize,
    /// Steps skipped for non-finite values.
    pub skipped_steps: usize,
    /// Checkpoints written by this run.
    pub checkpoints: Vec<PathBuf>,
    /// The last logged loss.
    pub last_loss: Option<f64>,
    /// What the on-policy rows cost (runs with on-policy rows only).
    pub on_policy: Option<OnPolicyTotals>,
    /// Label tokens of the steps this run did (a resumed run counts its own).
    pub label_tokens: usize,
    /// Wall time of those steps (batches, forward, backward, update; on-policy sampling and
    /// scoring included; logging and checkpoints not).
    pub step_seconds: f64,
}

/// Loads the weights of a checkpoint into `model` (adapters and projection in LoRA mode, the
/// whole model in full mode).
pub fn load_checkpoint_weights(
    model: TrainModel,
    dir: &Path,
    mode: TrainMode,
    device: &Device,
) -> Result<TrainModel> {
    let llama = match mode {
        TrainMode::Lora => model.llama.load_adapter(dir)?.0,
        TrainMode::Full => Llama::load(dir, device)?,
    };
    let projection = match model.projection {
        None => None,
        Some(p) => {
            let path = dir.join(PROJECTION_FILE);
            let bytes = std::fs::read(&path).map_err(|e| TrainError::io(&path, e))?;
            let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
                TrainError::Checkpoint {
                    path: path.clone(),
                    message: e.to_string(),
                }
            })?;
            let w = st.tensor("weight").map_err(|e| TrainError::Checkpoint {
                path: path.clone(),
                message: e.to_string(),
            })?;
            let (ds, dt) = p.dims();
            let values: Vec<f32> = w
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            Some(HiddenProjection::from_torch_weight(values, dt, ds, device)?)
        }
    };
    Ok(TrainModel { llama, projection })
}

fn save_model_files(model: &TrainModel, dir: &Path, mode: TrainMode, info: &RunInfo) -> Result<()> {
    match mode {
        TrainMode::Lora => {
            let lora = info.lora.as_ref().ok_or_else(|| {
                TrainError::Config("LoRA mode needs the LoRA configuration in RunInfo".into())
            })?;
            model.llama.save_adapter(dir, lora, &info.base_model)?;
        }
        TrainMode::Full => model.llama.save(dir, SaveDType::F32)?,
    }
    if let Some(p) = &model.projection {
        let w = p.proj.weight.val().transpose().into_data();
        kd_model::write_safetensors(
            &dir.join(PROJECTION_FILE),
            &[("weight".to_string(), w)],
            SaveDType::F32,
        )?;
    }
    if let Some(tok) = &info.tokenizer_dir {
        crate::model_files::write_tokenizer_files(tok, dir)?;
    }
    Ok(())
}

/// Whether every parameter of the model is finite (checked before saving).
fn all_finite(model: &TrainModel) -> bool {
    struct V(bool);
    impl burn::module::ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            if self.0 {
                let bad: i64 = p.val().is_finite().bool_not().int().sum().into_scalar();
                self.0 = bad == 0;
            }
        }
    }
    let mut v = V(true);
    model.visit(&mut v);
    v.0
}

/// Work done between optimizer steps with the model being trained (the distill pipeline's
/// validation every `eval_steps`).
pub trait StepHook {
    /// Called after optimizer step `step` (1-based) of `total_steps`, after its metrics and
    /// checkpoints; an error stops the run.
    fn after_step(&mut self, step: usize, total_steps: usize, model: &TrainModel) -> Result<()>;
}

/// A hook that does nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoHook;

impl StepHook for NoHook {
    fn after_step(&mut self, _: usize, _: usize, _: &TrainModel) -> Result<()> {
        Ok(())
    }
}

/// Trains `model` on `examples` with `loss_fn`. Returns the trained model (without autodiff)
/// and a summary. With `resume_from_checkpoint` set, weights, optimizer state and data
/// position come from that checkpoint and the run continues exactly.
pub fn train(
    config: &TrainConfig,
    info: &RunInfo,
    model: TrainModel,
    examples: &[Example],
    loss_fn: &dyn StepLossFn,
    observer: &mut dyn TrainObserver,
) -> Result<(TrainModel, TrainSummary)> {
    train_with_hook(
        config,
        info,
        model,
        examples,
        loss_fn,
        observer,
        &mut NoHook,
    )
}

/// [`train`] with a [`StepHook`] called after every optimizer step.
pub fn train_with_hook(
    config: &TrainConfig,
    info: &RunInfo,
    model: TrainModel,
    examples: &[Example],
    loss_fn: &dyn StepLossFn,
    observer: &mut dyn TrainObserver,
    hook: &mut dyn StepHook,
) -> Result<(TrainModel, TrainSummary)> {
    train_on_policy(config, info, model, examples, loss_fn, observer, hook, None)
}

/// [`train_with_hook`] with on-policy rows: in every step a share λ of the planned rows
/// ([`on_policy_rows`]) is completed by the model being trained, scored by `on_policy`'s
/// teacher and learned through [`OnPolicyLoss`]; the other rows go through `loss_fn`. All
/// rows of a step share one normaliser (their label tokens).
#[allow(clippy::too_many_arguments)]
pub fn train_on_policy(
    config: &TrainConfig,
    info: &RunInfo,
    model: TrainModel,
    examples: &[Example],
    loss_fn: &dyn StepLossFn,
    observer: &mut dyn TrainObserver,
    hook: &mut dyn StepHook,
    on_policy: Option<&OnPolicy<'_>>,
) -> Result<(TrainModel, TrainSummary)> {
    config.validate()?;
    let on_policy = on_policy.filter(|o| o.config.ratio > 0.0);
    if let Some(o) = on_policy {
        o.config.validate()?;
    }
    if examples.is_empty() {
        return Err(TrainError::Config("no training examples".into()));
    }
    let out = &config.output_dir;
    std::fs::create_dir_all(out).map_err(|e| TrainError::io(out, e))?;
    let device = model.llama.embed_tokens.weight.device();
    let run = RunPlan::new(config, examples, on_policy);
    let Resumed {
        model,
        mut optimizer,
        mut state,
        mut history,
    } = resume(config, &run, model, &device)?;
    history.max_steps = run.total_steps;
    history.logging_steps = config.logging_steps;
    history.save_steps = config.save_steps;
    history.train_batch_size = config.train_batch_size;

    let mut text_log = TextLog::open(out)?;
    let mut tb = TensorBoard::create(&out.join("runs"))?;
    let header = run.header(config, examples.len(), state.global_step);
    text_log.line(&header)?;
    tracing::info!("{header}");
    if info.lora.is_some() && config.mode == TrainMode::Lora {
        text_log.line(&format!("# {}", model.llama.parameter_report()))?;
    }

    let mut model = TrainModel {
        llama: model.llama.train(),
        projection: model.projection.map(Module::train),
    };
    observer.on_start(state.global_step, run.total_steps);
    let started = Instant::now();
    let mut window = MetricsWindow::new();
    let mut summary = TrainSummary {
        global_step: state.global_step,
        skipped_steps: state.skipped_steps,
        checkpoints: Vec::new(),
        last_loss: None,
        on_policy: None,
        label_tokens: 0,
        step_seconds: 0.0,
    };
    let mut plan = plan_batches(&run.lengths, &run.batch_opts, state.epoch as u64);

    while state.global_step < run.total_steps {
        if state.next_micro_batch >= plan.len() {
            state.epoch += 1;
            state.next_micro_batch = 0;
            plan = plan_batches(&run.lengths, &run.batch_opts, state.epoch as u64);
        }
        let step = state.global_step;
        let step_started = Instant::now();
        let end = (state.next_micro_batch + run.per_step).min(plan.len());
        let batches = step_batches(
            config,
            info,
            examples,
            &plan[state.next_micro_batch..end],
            &model,
            on_policy,
            (state.epoch, step),
        )?;
        let lr = learning_rate(
            config.scheduler_type,
            config.learning_rate,
            step,
            run.warmup,
            run.total_steps,
        );
        let (next, mut outcome) = run_step(
            config,
            model,
            &mut optimizer,
            &batches,
            loss_fn,
            on_policy,
            step,
            lr,
        )?;
        model = next;
        let step_seconds = step_started.elapsed().as_secs_f64();
        summary.label_tokens += outcome.tokens;
        summary.step_seconds += step_seconds;
        if on_policy.is_some() {
            let on: Vec<bool> = batches.micro.iter().map(|(_, on)| *on).collect();
            outcome.terms.extend(on_policy_terms(
                &batches.samples,
                batches.step_examples,
                &on,
                &outcome.kd,
                step_seconds,
            ));
            let t = summary
                .on_policy
                .get_or_insert_with(OnPolicyTotals::default);
            t.add(&batches.samples);
        }
        state.global_step += 1;
        state.next_micro_batch = end;
        state.optimizer_steps = optimizer.steps;
        if outcome.finite {
            state.consecutive_nonfinite = 0;
        } else {
            state.consecutive_nonfinite += 1;
            state.skipped_steps += 1;
            observer.on_skipped_step(state.global_step);
            tracing::warn!(
                step = state.global_step,
                "non-finite loss or gradient: step skipped"
            );
            if state.consecutive_nonfinite >= config.max_consecutive_nonfinite {
                return Err(TrainError::NonFinite {
                    count: state.consecutive_nonfinite,
                    step: state.global_step,
                });
            }
        }
        observer.on_step(state.global_step, outcome.loss);

        // Metrics.
        window.add(&outcome);
        let epoch_f = state.epoch as f64 + state.next_micro_batch as f64 / plan.len().max(1) as f64;
        if state.global_step.is_multiple_of(config.logging_steps)
            || state.global_step == run.total_steps
        {
            let record = window.record(
                (state.global_step, epoch_f),
                &outcome,
                started.elapsed().as_secs_f64(),
            );
            write_log(&record, run.total_steps, &mut text_log, &mut tb)?;
            summary.last_loss = Some(record.loss);
            observer.on_log(&record);
            history.log_history.push(record);
            window = MetricsWindow::new();
        }
        history.global_step = state.global_step;
        history.epoch = epoch_f;

        // Checkpoints.
        let saved = save_checkpoints(
            config,
            info,
            (&model, &optimizer),
            (&state, &history),
            state.next_micro_batch >= plan.len(),
        )?;
        for path in saved {
            observer.on_checkpoint(&path);
            summary.checkpoints.push(path);
        }
        hook.after_step(state.global_step, run.total_steps, &model)?;
    }
    summary.global_step = state.global_step;
    summary.skipped_steps = state.skipped_steps;
    let model = TrainModel {
        llama: model.llama.valid(),
        projection: model.projection.map(|p| p.valid()),
    };
    Ok((model, summary))
}

/// What a run will do: its batching, step counts and the fingerprint a resumed run must
/// match.
struct RunPlan {
    lengths: Vec<usize>,
    batch_opts: BatchOptions,
    /// Planned micro-batches per optimizer step.
    per_step: usize,
    steps_per_epoch: usize,
    total_steps: usize,
    warmup: usize,
    fingerprint: serde_json::Value,
}

impl RunPlan {
    fn new(config: &TrainConfig, examples: &[Example], on_policy: Option<&OnPolicy<'_>>) -> Self {
        let lengths: Vec<usize> = examples.iter().map(Example::len).collect();
        let batch_opts = BatchOptions {
            batch_size: config.train_batch_size * config.accumulation_shards,
            bucket_by_length: config.group_by_length,
            shuffle: true,
            seed: config.seed,
            ..BatchOptions::default()
        };
        let per_step = config.gradient_accumulation_steps;
        let micro_per_epoch = plan_batches(&lengths, &batch_opts, 0).len();
        let steps_per_epoch = micro_per_epoch.div_ceil(per_step);
        let total_steps = config
            .max_steps
            .unwrap_or(steps_per_epoch * config.num_epochs);
        let warmup = config.warmup(total_steps);
        let mut fingerprint = json!({
            "seed": config.seed,
            "train_batch_size": config.train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            // The key keeps its first name so that earlier checkpoints still resume.
            "data_parallel": config.accumulation_shards,
            "learning_rate": config.learning_rate,
            "scheduler_type": config.scheduler_type,
            "total_steps": total_steps,
            "warmup_steps": warmup,
            "examples": examples.len(),
            "mode": config.mode,
        });
        if let Some(o) = on_policy {
            fingerprint["on_policy"] = o.config.fingerprint();
        }
        Self {
            lengths,
            batch_opts,
            per_step,
            steps_per_epoch,
            total_steps,
            warmup,
            fingerprint,
        }
    }

    /// The first line of `training_log.txt`.
    fn header(&self, config: &TrainConfig, examples: usize, resumed_at: usize) -> String {
        format!(
            "# {} run: {} examples, {} steps ({} per epoch), effective batch {} = {} shard(s) × {} × {} accumulation steps, warmup {} steps{}",
            match config.mode {
                TrainMode::Lora => "LoRA",
                TrainMode::Full => "full fine-tuning",
            },
            examples,
            self.total_steps,
            self.steps_per_epoch,
            config.effective_batch_size(),
            config.accumulation_shards,
            config.train_batch_size,
            config.gradient_accumulation_steps,
            self.warmup,
            if resumed_at > 0 {
                format!(", resumed at step {resumed_at}")
            } else {
                String::new()
            }
        )
    }
}

/// The model, optimizer and counters a run starts from: fresh, or a checkpoint's.
struct Resumed {
    model: TrainModel,
    optimizer: AdamW,
    state: TrainingState,
    history: TrainerState,
}

/// Fresh state, or the state of `config.resume_from_checkpoint` after checking that its
/// fingerprint equals the run's (an error lists the settings that differ).
fn resume(
    config: &TrainConfig,
    run: &RunPlan,
    model: TrainModel,
    device: &Device,
) -> Result<Resumed> {
    let fresh = TrainingState {
        global_step: 0,
        epoch: 0,
        next_micro_batch: 0,
        total_steps: run.total_steps,
        optimizer_steps: 0,
        consecutive_nonfinite: 0,
        skipped_steps: 0,
        fingerprint: run.fingerprint.clone(),
    };
    let Some(spec) = &config.resume_from_checkpoint else {
        return Ok(Resumed {
            model,
            optimizer: AdamW::default(),
            state: fresh,
            history: TrainerState::default(),
        });
    };
    let dir = resolve_resume(&config.output_dir, spec)?;
    let saved = read_state(&dir)?;
    if saved.fingerprint != run.fingerprint {
        let mut diffs = Vec::new();
        if let (Some(a), Some(b)) = (saved.fingerprint.as_object(), run.fingerprint.as_object()) {
            for (k, v) in b {
                if a.get(k) != Some(v) {
                    diffs.push(format!(
                        "{k}: checkpoint {} vs now {v}",
                        a.get(k).cloned().unwrap_or_default()
                    ));
                }
            }
        }
        return Err(TrainError::Checkpoint {
            path: dir,
            message: format!(
                "the run's settings differ from the checkpoint's: {}",
                diffs.join("; ")
            ),
        });
    }
    let model = load_checkpoint_weights(model, &dir, config.mode, device)?;
    let optimizer = AdamW::load(
        &dir.join(TRAINING_STATE_DIR).join(OPTIMIZER_FILE),
        saved.optimizer_steps,
        device,
    )?;
    let history = std::fs::read_to_string(dir.join(TRAINER_STATE_FILE))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default();
    tracing::info!(checkpoint = %dir.display(), step = saved.global_step, "resuming");
    Ok(Resumed {
        model,
        optimizer,
        state: saved,
        history,
    })
}

/// The micro-batches of one step, each marked on-policy or not, and the on-policy samples.
struct StepBatches {
    micro: Vec<(Batch, bool)>,
    samples: OnPolicySamples,
    /// Examples the step planned (before on-policy rows replaced some).
    step_examples: usize,
}

/// Collates the step's planned micro-batches into shards; with on-policy distillation, first
/// replaces a share of the rows by the model's own completions, scored by the teacher.
fn step_batches(
    config: &TrainConfig,
    info: &RunInfo,
    examples: &[Example],
    planned: &[Vec<Vec<usize>>],
    model: &TrainModel,
    on_policy: Option<&OnPolicy<'_>>,
    (epoch, step): (usize, usize),
) -> Result<StepBatches> {
    let mut off_rows: Cow<'_, [Vec<Vec<usize>>]> = Cow::Borrowed(planned);
    let mut on_rows: Vec<Vec<Vec<usize>>> = vec![Vec::new(); planned.len()];
    let mut samples = OnPolicySamples::default();
    let mut step_examples = 0usize;
    if let Some(op) = on_policy {
        let flat: Vec<(usize, usize)> = planned
            .iter()
            .enumerate()
            .flat_map(|(m, rows)| (0..rows.len()).map(move |r| (m, r)))
            .collect();
        let chosen = on_policy_rows(flat.len(), op.config.ratio, config.seed, epoch, step);
        let mut kept = vec![Vec::new(); planned.len()];
        let mut wanted = Vec::new();
        let mut micro_of = Vec::new();
        for ((m, r), on) in flat.iter().zip(chosen) {
            let row = &planned[*m][*r];
            step_examples += row.len();
            if on && row.iter().all(|e| op.usable(&examples[*e])) {
                for e in row {
                    wanted.push(*e);
                    micro_of.push(*m);
                }
            } else {
                kept[*m].push(row.clone());
            }
        }
        off_rows = Cow::Owned(kept);
        if !wanted.is_empty() {
            samples = op.sample(
                &model.llama.valid(),
                examples,
                &wanted,
                config.seed,
                epoch,
                step,
            )?;
        }
        for (i, m) in micro_of.iter().enumerate() {
            on_rows[*m].push(vec![i]);
        }
    }
    // Each planned micro-batch holds accumulation_shards × train_batch_size rows; shard it.
    let mut micro: Vec<(Batch, bool)> = Vec::new();
    for (rows, set, on) in off_rows.iter().map(|r| (r, examples, false)).chain(
        on_rows
            .iter()
            .map(|r| (r, samples.examples.as_slice(), true)),
    ) {
        for shard in shard_rows(rows, config.accumulation_shards) {
            if !shard.is_empty() {
                micro.push((collate(set, &shard, info.pad_id, usize::MAX), on));
            }
        }
    }
    Ok(StepBatches {
        micro,
        samples,
        step_examples,
    })
}

/// What one optimizer step computed.
struct StepOutcome {
    /// Whether the loss and the gradient norm were finite (else the update was skipped).
    finite: bool,
    /// The step's total loss.
    loss: f64,
    /// Each loss term, summed over the micro-batches.
    terms: Vec<(&'static str, f64)>,
    /// Global gradient norm before clipping.
    grad_norm: f64,
    /// KD statistics per micro-batch (on-policy metrics).
    kd: Vec<Option<LossStats>>,
    /// Learning rate of the step.
    learning_rate: f64,
    /// Label tokens of the step (the normaliser).
    tokens: usize,
}

/// Gradients of the step's micro-batches under one normaliser, clipping and the AdamW
/// update (skipped when non-finite or when the step has no label tokens).
#[allow(clippy::too_many_arguments)]
fn run_step(
    config: &TrainConfig,
    model: TrainModel,
    optimizer: &mut AdamW,
    batches: &StepBatches,
    loss_fn: &dyn StepLossFn,
    on_policy: Option<&OnPolicy<'_>>,
    step: usize,
    lr: f64,
) -> Result<(TrainModel, StepOutcome)> {
    let on_loss = on_policy.map(|op| OnPolicyLoss {
        scores: &batches.samples.scores,
        kd: op.config.kd,
        kd_weight: op.config.kd_weight,
    });
    let parts: Vec<(&Batch, &dyn StepLossFn)> = batches
        .micro
        .iter()
        .map(|(b, on)| match (&on_loss, on) {
            (Some(l), true) => (b, l as &dyn StepLossFn),
            _ => (b, loss_fn),
        })
        .collect();
    let tokens: usize = batches.micro.iter().map(|(b, _)| b.label_tokens()).sum();
    let mut outcome = StepOutcome {
        finite: true,
        loss: 0.0,
        terms: Vec::new(),
        grad_norm: 0.0,
        kd: Vec::new(),
        learning_rate: lr,
        tokens,
    };
    if tokens == 0 {
        tracing::warn!(
            step,
            "no label tokens in this step's batches; skipping the update"
        );
        return Ok((model, outcome));
    }
    let seeds: Vec<u64> = (0..parts.len())
        .map(|k| derive_seed(config.seed, &[step as u64, k as u64]))
        .collect();
    let mixed = mixed_step_gradients(&model, &parts, tokens as f32, &seeds)?;
    let norm = global_grad_norm(&model, &mixed.grads);
    outcome.finite = mixed.loss.is_finite() && norm.is_finite();
    outcome.loss = mixed.loss;
    outcome.terms = mixed.terms;
    outcome.grad_norm = norm;
    outcome.kd = mixed.kd;
    let params = AdamWParams {
        beta1: config.adam_beta1,
        beta2: config.adam_beta2,
        eps: config.adam_epsilon,
        weight_decay: config.weight_decay,
    };
    let model = if outcome.finite {
        let coef = clip_coefficient(norm, config.max_grad_norm);
        optimizer.step(model, &mixed.grads, params, lr, coef)
    } else {
        model
    };
    Ok((model, outcome))
}

/// Sums over the steps since the last log line.
struct MetricsWindow {
    /// Finite steps.
    steps: usize,
    loss_sum: f64,
    /// Per term: (name, sum, steps that have it).
    terms: Vec<(&'static str, f64, usize)>,
    /// Label tokens (all steps).
    tokens: usize,
    since: Instant,
}

impl MetricsWindow {
    fn new() -> Self {
        Self {
            steps: 0,
            loss_sum: 0.0,
            terms: Vec::new(),
            tokens: 0,
            since: Instant::now(),
        }
    }

    fn add(&mut self, o: &StepOutcome) {
        if o.finite {
            self.steps += 1;
            self.loss_sum += o.loss;
            for (k, v) in &o.terms {
                match self.terms.iter_mut().find(|(n, _, _)| n == k) {
                    Some((_, s, c)) => {
                        *s += v;
                        *c += 1;
                    }
                    None => self.terms.push((k, *v, 1)),
                }
            }
        }
        self.tokens += o.tokens;
    }

    /// The log record of the window, at `(step, epoch)`; `last` gives the learning rate and
    /// gradient norm.
    fn record(&self, (step, epoch): (usize, f64), last: &StepOutcome, elapsed: f64) -> LogRecord {
        let n = self.steps.max(1) as f64;
        LogRecord {
            step,
            epoch,
            loss: self.loss_sum / n,
            // Each term's mean over the steps that have it (on-policy terms are absent from
            // steps without on-policy rows).
            terms: self
                .terms
                .iter()
                .map(|(k, v, c)| (k.to_string(), v / (*c).max(1) as f64))
                .collect(),
            learning_rate: last.learning_rate,
            grad_norm: last.grad_norm,
            tokens_per_second: self.tokens as f64 / self.since.elapsed().as_secs_f64().max(1e-9),
            elapsed_seconds: elapsed,
        }
    }
}

/// Writes a log record to `training_log.txt` and TensorBoard.
fn write_log(
    record: &LogRecord,
    total_steps: usize,
    text_log: &mut TextLog,
    tb: &mut TensorBoard,
) -> Result<()> {
    text_log.line(&record.line(total_steps))?;
    tb.scalar("train/loss", record.loss, record.step)?;
    for (k, v) in &record.terms {
        tb.scalar(&format!("train/{k}"), *v, record.step)?;
    }
    tb.scalar("train/lr", record.learning_rate, record.step)?;
    tb.scalar("train/grad_norm", record.grad_norm, record.step)?;
    tb.scalar(
        "train/tokens_per_second",
        record.tokens_per_second,
        record.step,
    )?;
    Ok(())
}

/// The checkpoints due after a step (periodic, end of epoch, the last step), written
/// atomically with the optimizer and counters; prunes old ones. Returns their paths.
fn save_checkpoints(
    config: &TrainConfig,
    info: &RunInfo,
    (model, optimizer): (&TrainModel, &AdamW),
    (state, history): (&TrainingState, &TrainerState),
    epoch_done: bool,
) -> Result<Vec<PathBuf>> {
    let out = &config.output_dir;
    let mut names = Vec::new();
    let last = state.global_step == state.total_steps;
    let periodic = config.save_steps > 0 && state.global_step.is_multiple_of(config.save_steps);
    // The last step always leaves a checkpoint (an epoch checkpoint when it ends an epoch).
    if periodic || (last && !(config.save_epoch_checkpoints && epoch_done)) {
        names.push(format!("checkpoint-{}", state.global_step));
    }
    if config.save_epoch_checkpoints && epoch_done {
        names.push(format!("checkpoint-epoch-{}", state.epoch));
    }
    if names.is_empty() {
        return Ok(Vec::new());
    }
    if !all_finite(model) {
        return Err(TrainError::NonFinite {
            count: state.consecutive_nonfinite.max(1),
            step: state.global_step,
        });
    }
    let mut paths = Vec::with_capacity(names.len());
    for name in names {
        let path = write_checkpoint(out, &name, |dir| {
            save_model_files(model, dir, config.mode, info)?;
            let ts = dir.join(TRAINING_STATE_DIR);
            std::fs::create_dir_all(&ts).map_err(|e| TrainError::io(&ts, e))?;
            optimizer.save(&ts.join(OPTIMIZER_FILE))?;
            let s = serde_json::to_string_pretty(state).expect("state serialises");
            std::fs::write(ts.join(STATE_FILE), s).map_err(|e| TrainError::io(&ts, e))?;
            let h = serde_json::to_string_pretty(history).expect("history serialises");
            std::fs::write(dir.join(TRAINER_STATE_FILE), h).map_err(|e| TrainError::io(dir, e))?;
            Ok(())
        })?;
        paths.push(path);
    }
    if let Some(limit) = config.save_total_limit {
        prune(out, limit)?;
    }
    Ok(paths)
}

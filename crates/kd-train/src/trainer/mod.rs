//! The training loop: micro-batches of a step share one global token count (every loss term
//! of the step is a sum over counted tokens divided by it), gradients are summed over
//! micro-batches and their shards, clipped by global norm, AdamW with a step-derived learning
//! rate; checkpoints and metrics; exact resume.

mod plan;
mod reduce;
mod resume;
mod save;
pub(crate) mod step;
mod window;

use std::path::PathBuf;
use std::time::Instant;

use kd_data::{Example, plan_batches};
use kd_dist::World;

use crate::config::TrainConfig;
use crate::data::{PlannedStep, StepData};
use crate::error::{Result, TrainError};
use crate::loss::StepLossFn;
use crate::metrics::{NoopObserver, TensorBoard, TextLog, TrainObserver};
use crate::model::{TrainModel, Trainable};
use crate::schedule::learning_rate;
use plan::RunPlan;
use resume::{Resumed, resume};
use save::{save_checkpoints, save_stop_checkpoint};
use step::run_step;
use window::{MetricsWindow, write_log};

/// Work done between optimizer steps with the model being trained (the distill pipeline's
/// validation every `eval_steps`). Across ranks, only rank 0 calls it.
pub trait StepHook<M = TrainModel> {
    /// Called after optimizer step `step` (1-based) of `total_steps`, after its metrics and
    /// checkpoints; an error stops the run.
    fn after_step(&mut self, step: usize, total_steps: usize, model: &M) -> Result<()>;
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
    /// Label tokens of the steps this run did (a resumed run counts its own).
    pub label_tokens: usize,
    /// Wall time of those steps (batches, forward, backward, update; the step data's work —
    /// on-policy sampling and scoring — included; logging and checkpoints not).
    pub step_seconds: f64,
    /// Of `step_seconds`, the time spent exchanging gradients and losses with the other
    /// ranks, waits for slower ranks included (0 alone).
    pub reduce_seconds: f64,
    /// Ranks that trained together (1 alone).
    pub ranks: usize,
}

/// The trainer: a configuration and a loss, with an optional observer (progress), hook
/// (validation) and step data source (on-policy rows); [`run`](Self::run) trains.
///
/// Across ranks ([`kd_dist::World`]: `mpirun -np N …`), every rank runs the same trainer on
/// the same examples: each step's rows are split N ways more (N ranks × `accumulation_shards`
/// shards per planned micro-batch, so the effective batch grows N-fold), each rank computes
/// the gradients of its shards under the step's global label-token count, the sums are
/// all-reduced, and every rank applies the same update. Rank 0 alone writes `training_log.txt`,
/// TensorBoard and checkpoints, and alone reports checkpoints and calls the hook. A stop
/// request on any rank stops all of them at the same step.
///
/// ```no_run
/// use kd_train::{CausalLmLoss, TrainConfig, TrainModel, Trainer};
/// # fn demo(llama: kd_model::Llama, examples: &[kd_data::Example]) -> kd_train::Result<()> {
/// let config = TrainConfig { output_dir: "out".into(), ..TrainConfig::default() };
/// let (trained, summary) =
///     Trainer::new(config, &CausalLmLoss { weight: 1.0 }).run(TrainModel::new(llama), examples)?;
/// # Ok(()) }
/// ```
pub struct Trainer<'a, M = TrainModel> {
    config: TrainConfig,
    loss: &'a dyn StepLossFn<M>,
    observer: Option<&'a mut dyn TrainObserver>,
    hook: Option<&'a mut dyn StepHook<M>>,
    data: Option<&'a mut dyn StepData<M>>,
    world: &'a World,
}

impl<'a, M: Trainable> Trainer<'a, M> {
    /// A trainer for `config` with `loss` for every micro-batch that brings none of its own.
    pub fn new(config: TrainConfig, loss: &'a dyn StepLossFn<M>) -> Self {
        Self {
            config,
            loss,
            observer: None,
            hook: None,
            data: None,
            world: kd_dist::world(),
        }
    }

    /// Trains as one rank of `world` (default: the process's, [`kd_dist::world`]).
    pub fn world(mut self, world: &'a World) -> Self {
        self.world = world;
        self
    }

    /// Reports progress to `observer`.
    pub fn observer(mut self, observer: &'a mut dyn TrainObserver) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Calls `hook` after every optimizer step.
    pub fn hook(mut self, hook: &'a mut dyn StepHook<M>) -> Self {
        self.hook = Some(hook);
        self
    }

    /// Takes every step's micro-batches from `data` instead of the planned rows as they are.
    pub fn step_data(mut self, data: &'a mut dyn StepData<M>) -> Self {
        self.data = Some(data);
        self
    }

    /// Trains `model` on `examples`. Returns the trained model (without autodiff) and a
    /// summary. With `resume_from_checkpoint` set, weights, optimizer state and data position
    /// come from that checkpoint and the run continues exactly.
    pub fn run(self, model: M, examples: &[Example]) -> Result<(M, TrainSummary)> {
        let Self {
            mut config,
            loss,
            observer,
            mut hook,
            mut data,
            world,
        } = self;
        let mut noop = NoopObserver;
        let observer = observer.unwrap_or(&mut noop);
        config.validate()?;
        // N ranks × S shards: the one-process run with N·S shards (what the plan, the
        // fingerprint, the effective batch and the log header count).
        config.accumulation_shards *= world.size();
        let root = world.is_root();
        if model.mode() != config.mode {
            return Err(TrainError::Config(format!(
                "the configuration trains in {:?} mode but the model is set up for {:?} mode \
                 (LoRA mode needs adapters: attach them with apply_lora or load_adapter; full \
                 mode needs none)",
                config.mode,
                model.mode()
            )));
        }
        if examples.is_empty() {
            return Err(TrainError::Config("no training examples".into()));
        }
        let out = &config.output_dir;
        std::fs::create_dir_all(out).map_err(|e| TrainError::io(out, e))?;
        let run = RunPlan::new(
            &config,
            examples,
            data.as_ref().and_then(|d| d.fingerprint()),
        );
        if world.is_distributed() {
            reduce::check_same_run(world, &run.fingerprint, examples)?;
        }
        let Resumed {
            model,
            mut optimizer,
            mut state,
            mut history,
        } = resume(&config, &run, model)?;
        history.max_steps = run.total_steps;
        history.logging_steps = config.logging_steps;
        history.save_steps = config.save_steps;
        history.train_batch_size = config.train_batch_size;

        // Rank 0 writes the run's files.
        let mut logs = if root {
            Some((TextLog::open(out)?, TensorBoard::create(&out.join("runs"))?))
        } else {
            None
        };
        let header = run.header(&config, examples.len(), state.global_step);
        if let Some((text_log, _)) = logs.as_mut() {
            text_log.line(&header)?;
            if world.is_distributed() {
                text_log.line(&format!(
                    "# data-parallel: {} ranks, {} shard(s) each per micro-batch",
                    world.size(),
                    config.accumulation_shards / world.size()
                ))?;
            }
            if let Some(line) = model.describe() {
                text_log.line(&format!("# {line}"))?;
            }
        }
        tracing::info!("{header}");

        let mut model = model.train();
        observer.on_start(state.global_step, run.total_steps);
        let started = Instant::now();
        let mut window = MetricsWindow::new();
        let mut summary = TrainSummary {
            global_step: state.global_step,
            skipped_steps: state.skipped_steps,
            checkpoints: Vec::new(),
            last_loss: None,
            label_tokens: 0,
            step_seconds: 0.0,
            reduce_seconds: 0.0,
            ranks: world.size(),
        };
        let pad_id = model.pad_id();
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
            let planned = PlannedStep {
                examples,
                micro_batches: &plan[state.next_micro_batch..end],
                epoch: state.epoch,
                step,
                seed: config.seed,
                shards: config.accumulation_shards,
                pad_id,
            };
            let micro = match data.as_mut() {
                Some(d) => d.micro_batches(&planned, &model)?,
                None => planned.collate(),
            };
            let lr = learning_rate(
                config.scheduler_type,
                config.learning_rate,
                step,
                run.warmup,
                run.total_steps,
            );
            let (next, mut outcome) = run_step(
                &config,
                (model, world),
                &mut optimizer,
                &micro,
                loss,
                (step, lr),
            )?;
            model = next;
            let step_seconds = step_started.elapsed().as_secs_f64();
            summary.label_tokens += outcome.tokens;
            summary.step_seconds += step_seconds;
            summary.reduce_seconds += outcome.reduce_seconds;
            if let Some(d) = data.as_mut() {
                outcome
                    .terms
                    .extend(d.step_terms(&outcome.kd, step_seconds));
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
            let epoch_f =
                state.epoch as f64 + state.next_micro_batch as f64 / plan.len().max(1) as f64;
            if state.global_step.is_multiple_of(config.logging_steps)
                || state.global_step == run.total_steps
            {
                let record = window.record(
                    (state.global_step, epoch_f),
                    &outcome,
                    started.elapsed().as_secs_f64(),
                );
                if let Some((text_log, tb)) = logs.as_mut() {
                    write_log(&record, run.total_steps, text_log, tb)?;
                }
                summary.last_loss = Some(record.loss);
                observer.on_log(&record);
                history.log_history.push(record);
                window = MetricsWindow::new();
            }
            history.global_step = state.global_step;
            history.epoch = epoch_f;

            // Checkpoints.
            let epoch_done = state.next_micro_batch >= plan.len();
            let saved = if root {
                save_checkpoints(
                    &config,
                    (&model, &optimizer),
                    (&state, &history),
                    epoch_done,
                    false,
                )?
            } else {
                Vec::new()
            };
            let step_checkpoint = saved.first().cloned();
            for path in saved {
                observer.on_checkpoint(&path);
                summary.checkpoints.push(path);
            }
            if root && let Some(h) = hook.as_mut() {
                h.after_step(state.global_step, run.total_steps, &model)?;
            }
            let stop = state.global_step < run.total_steps && observer.stop_requested();
            // Every rank stops at the same step when any was asked to.
            let stop = if world.is_distributed() {
                world
                    .any(stop)
                    .map_err(|e| TrainError::Config(format!("data-parallel stop request: {e}")))?
            } else {
                stop
            };
            if stop {
                let checkpoint = match step_checkpoint {
                    Some(path) => path,
                    // Not reported through `on_checkpoint`: no evaluation on the way out.
                    None if root => save_stop_checkpoint(
                        &config,
                        (&model, &optimizer),
                        (&state, &history),
                        epoch_done,
                    )?,
                    // Rank 0 writes it.
                    None => out.join(format!("checkpoint-{}", state.global_step)),
                };
                // No rank leaves before rank 0 has written the checkpoint (a launcher may end
                // the job when the first rank exits).
                world
                    .barrier()
                    .map_err(|e| TrainError::Config(format!("data-parallel stop request: {e}")))?;
                return Err(TrainError::Stopped {
                    step: state.global_step,
                    total_steps: run.total_steps,
                    checkpoint,
                });
            }
        }
        summary.global_step = state.global_step;
        summary.skipped_steps = state.skipped_steps;
        Ok((model.valid(), summary))
    }
}

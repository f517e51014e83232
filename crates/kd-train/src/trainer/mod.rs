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

use burn::tensor::Device;
use kd_data::{BatchPlan, Example, plan_batches};
use kd_dist::World;

use crate::checkpoint::{TrainerState, TrainingState};
use crate::config::TrainConfig;
use crate::data::{PlannedStep, StepData};
use crate::error::{Result, TrainError};
use crate::loss::StepLossFn;
use crate::metrics::{NoopObserver, TensorBoard, TextLog, TrainObserver};
use crate::model::{TrainModel, Trainable};
use crate::optim::AdamW;
use crate::schedule::learning_rate;
use plan::RunPlan;
use resume::{Resumed, resume};
use save::{save_checkpoints, save_stop_checkpoint};
use step::{StepOutcome, run_step};
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
            config,
            loss,
            observer,
            mut hook,
            mut data,
            world,
        } = self;
        let mut noop = NoopObserver;
        let observer = observer.unwrap_or(&mut noop);
        let (mut session, model) = Session::start(config, world, examples, model, data.as_deref())?;
        let mut model = model.train();
        observer.on_start(session.state.global_step, session.run.total_steps);
        session.started = Instant::now();
        while session.state.global_step < session.run.total_steps {
            let (next, outcome) = session.step(model, loss, data.as_deref_mut())?;
            model = next;
            session.count(&outcome, observer)?;
            session.log(&outcome, observer)?;
            let step_checkpoint = session.checkpoint(&model, observer)?;
            if session.world.is_root()
                && let Some(h) = hook.as_mut()
            {
                h.after_step(session.state.global_step, session.run.total_steps, &model)?;
            }
            if session.stop_requested(observer)? {
                return Err(session.stop(&model, step_checkpoint)?);
            }
        }
        let summary = session.finish();
        Ok((model.valid(), summary))
    }
}

/// A run under way: its plan, optimizer, counters, logs and summary, which the phases of a
/// step read and update.
struct Session<'s> {
    config: TrainConfig,
    world: &'s World,
    examples: &'s [Example],
    run: RunPlan,
    optimizer: AdamW,
    state: TrainingState,
    history: TrainerState,
    /// Rank 0's `training_log.txt` and TensorBoard files.
    logs: Option<(TextLog, TensorBoard)>,
    window: MetricsWindow,
    summary: TrainSummary,
    started: Instant,
    /// The current epoch's micro-batches.
    plan: BatchPlan,
}

impl<'s> Session<'s> {
    /// Checks the configuration, model and examples; plans the run; resumes from the
    /// configured checkpoint; opens rank 0's logs and writes the header.
    fn start<M: Trainable>(
        mut config: TrainConfig,
        world: &'s World,
        examples: &'s [Example],
        model: M,
        data: Option<&dyn StepData<M>>,
    ) -> Result<(Self, M)> {
        config.validate()?;
        // N ranks × S shards: the one-process run with N·S shards (what the plan, the
        // fingerprint, the effective batch and the log header count).
        config.accumulation_shards *= world.size();
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
        let run = RunPlan::new(&config, examples, data.and_then(|d| d.fingerprint()));
        if world.is_distributed() {
            reduce::check_same_run(world, &run.fingerprint, examples)?;
        }
        let Resumed {
            model,
            optimizer,
            state,
            mut history,
        } = resume(&config, &run, model)?;
        history.max_steps = run.total_steps;
        history.logging_steps = config.logging_steps;
        history.save_steps = config.save_steps;
        history.train_batch_size = config.train_batch_size;

        // Rank 0 writes the run's files.
        let mut logs = if world.is_root() {
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
        let summary = TrainSummary {
            global_step: state.global_step,
            skipped_steps: state.skipped_steps,
            checkpoints: Vec::new(),
            last_loss: None,
            label_tokens: 0,
            step_seconds: 0.0,
            reduce_seconds: 0.0,
            ranks: world.size(),
        };
        let plan = plan_batches(&run.lengths, &run.batch_opts, state.epoch as u64);
        let session = Self {
            config,
            world,
            examples,
            run,
            optimizer,
            state,
            history,
            logs,
            window: MetricsWindow::new(),
            summary,
            started: Instant::now(),
            plan,
        };
        Ok((session, model))
    }

    /// The next optimizer step: its micro-batches (from `data`, or the planned rows as they
    /// are), the learning rate, gradients and update. Moves the data position on.
    fn step<'d, M: Trainable>(
        &mut self,
        model: M,
        loss: &dyn StepLossFn<M>,
        data: Option<&mut (dyn StepData<M> + 'd)>,
    ) -> Result<(M, StepOutcome)> {
        let state = &mut self.state;
        if state.next_micro_batch >= self.plan.len() {
            state.epoch += 1;
            state.next_micro_batch = 0;
            self.plan = plan_batches(&self.run.lengths, &self.run.batch_opts, state.epoch as u64);
        }
        let step = state.global_step;
        let step_started = Instant::now();
        let end = (state.next_micro_batch + self.run.per_step).min(self.plan.len());
        let planned = PlannedStep {
            examples: self.examples,
            micro_batches: &self.plan[state.next_micro_batch..end],
            epoch: state.epoch,
            step,
            seed: self.config.seed,
            shards: self.config.accumulation_shards,
            pad_id: model.pad_id(),
        };
        let (micro, data) = match data {
            Some(d) => (d.micro_batches(&planned, &model)?, Some(d)),
            None => (planned.collate(), None),
        };
        let lr = learning_rate(
            self.config.scheduler_type,
            self.config.learning_rate,
            step,
            self.run.warmup,
            self.run.total_steps,
        );
        let (config, world, optimizer) = (&self.config, self.world, &mut self.optimizer);
        let device = model.device();
        let (model, mut outcome) = on_pool_for_steps(world, &device, || {
            run_step(config, (model, world), optimizer, &micro, loss, (step, lr))
        })?;
        let step_seconds = step_started.elapsed().as_secs_f64();
        self.summary.label_tokens += outcome.tokens;
        self.summary.step_seconds += step_seconds;
        self.summary.reduce_seconds += outcome.reduce_seconds;
        if let Some(d) = data {
            outcome
                .terms
                .extend(d.step_terms(&outcome.kd, step_seconds));
        }
        self.state.global_step += 1;
        self.state.next_micro_batch = end;
        self.state.optimizer_steps = self.optimizer.steps;
        Ok((model, outcome))
    }

    /// Counts a skipped (non-finite) step, and stops the run after too many in a row.
    fn count(&mut self, outcome: &StepOutcome, observer: &mut dyn TrainObserver) -> Result<()> {
        let state = &mut self.state;
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
            if state.consecutive_nonfinite >= self.config.max_consecutive_nonfinite {
                return Err(TrainError::NonFinite {
                    count: state.consecutive_nonfinite,
                    step: state.global_step,
                });
            }
        }
        observer.on_step(state.global_step, outcome.loss);
        Ok(())
    }

    /// Adds the step to the metrics window; every `logging_steps` (and at the last step)
    /// writes the window's record to the logs and the history.
    fn log(&mut self, outcome: &StepOutcome, observer: &mut dyn TrainObserver) -> Result<()> {
        let state = &self.state;
        self.window.add(outcome);
        let epoch_f = self.epoch_f();
        if state.global_step.is_multiple_of(self.config.logging_steps)
            || state.global_step == self.run.total_steps
        {
            let record = self.window.record(
                (state.global_step, epoch_f),
                outcome,
                self.started.elapsed().as_secs_f64(),
            );
            if let Some((text_log, tb)) = self.logs.as_mut() {
                write_log(&record, self.run.total_steps, text_log, tb)?;
            }
            self.summary.last_loss = Some(record.loss);
            observer.on_log(&record);
            self.history.log_history.push(record);
            self.window = MetricsWindow::new();
        }
        self.history.global_step = state.global_step;
        self.history.epoch = epoch_f;
        Ok(())
    }

    /// The data position as a fraction of epochs.
    fn epoch_f(&self) -> f64 {
        self.state.epoch as f64 + self.state.next_micro_batch as f64 / self.plan.len().max(1) as f64
    }

    /// Whether the last step ended an epoch.
    fn epoch_done(&self) -> bool {
        self.state.next_micro_batch >= self.plan.len()
    }

    /// Rank 0 writes the checkpoints due after the step and reports them; the step's own
    /// checkpoint, if one was due.
    fn checkpoint<M: Trainable>(
        &mut self,
        model: &M,
        observer: &mut dyn TrainObserver,
    ) -> Result<Option<PathBuf>> {
        let saved = if self.world.is_root() {
            save_checkpoints(
                &self.config,
                (model, &self.optimizer),
                (&self.state, &self.history),
                self.epoch_done(),
                false,
            )?
        } else {
            Vec::new()
        };
        let step_checkpoint = saved.first().cloned();
        for path in saved {
            observer.on_checkpoint(&path);
            self.summary.checkpoints.push(path);
        }
        Ok(step_checkpoint)
    }

    /// Whether the run stops here on request; every rank stops at the same step when any
    /// was asked to.
    fn stop_requested(&self, observer: &mut dyn TrainObserver) -> Result<bool> {
        let stop = self.state.global_step < self.run.total_steps && observer.stop_requested();
        if self.world.is_distributed() {
            self.world
                .any(stop)
                .map_err(|e| TrainError::Config(format!("data-parallel stop request: {e}")))
        } else {
            Ok(stop)
        }
    }

    /// Stops on request: the step's checkpoint, or a stop checkpoint that rank 0 writes now;
    /// the error that says where to resume.
    fn stop<M: Trainable>(
        &self,
        model: &M,
        step_checkpoint: Option<PathBuf>,
    ) -> Result<TrainError> {
        let checkpoint = match step_checkpoint {
            Some(path) => path,
            // Not reported through `on_checkpoint`: no evaluation on the way out.
            None if self.world.is_root() => save_stop_checkpoint(
                &self.config,
                (model, &self.optimizer),
                (&self.state, &self.history),
                self.epoch_done(),
            )?,
            // Rank 0 writes it.
            None => self
                .config
                .output_dir
                .join(format!("checkpoint-{}", self.state.global_step)),
        };
        // No rank leaves before rank 0 has written the checkpoint (a launcher may end the job
        // when the first rank exits).
        self.world
            .barrier()
            .map_err(|e| TrainError::Config(format!("data-parallel stop request: {e}")))?;
        Ok(TrainError::Stopped {
            step: self.state.global_step,
            total_steps: self.run.total_steps,
            checkpoint,
        })
    }

    fn finish(mut self) -> TrainSummary {
        self.summary.global_step = self.state.global_step;
        self.summary.skipped_steps = self.state.skipped_steps;
        self.summary
    }
}

/// Runs an optimizer step's work (`f`) on the CPU backend on a worker of rayon's pool, as
/// decoding runs (`Llama::run_decoding`). A step is hundreds to thousands of short parallel
/// operations; from a thread outside the pool each one hands its work over and sleeps until it
/// is done, from a worker they fork and join inside the pool. When this is the only rank on
/// its machine, the pool's other workers also poll for work instead of sleeping between
/// operations ([`kd_kernels::keep_awake`]); ranks sharing a machine's cores would take them
/// from each other by spinning, so there the workers sleep as before. Which thread runs a task
/// never changes what it computes: the step's results are the same bits.
///
/// Other backends run `f` here, on the caller's thread. CubeCL queues work per thread: on
/// wgpu, a model trained by steps on a pool worker and then read on the caller's thread did
/// not match its own last checkpoint (the logits 1e-2 apart; within 1e-5 when every step
/// runs on the caller's thread).
fn on_pool_for_steps<R: Send>(world: &World, device: &Device, f: impl FnOnce() -> R + Send) -> R {
    if device.clone().without_autodiff() != Device::flex() {
        f()
    } else if world.local_size() == 1 {
        kd_kernels::keep_awake(f)
    } else {
        kd_kernels::on_pool(f)
    }
}

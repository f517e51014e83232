//! Watching training: validation every `eval_steps` and ROLL's metrics (TensorBoard names,
//! per-step timing).

use std::cell::RefCell;
use std::path::Path;
use std::time::Instant;

use burn::module::Module;
use kd_data::Batch;
use kd_model::Llama;
use kd_teacher::Scores;

use crate::error::{PipelineError, Result};
use crate::loss::{EvalSums, evaluate_batches};
use crate::run::{DistillObserver, Validation};
use kd_train::metrics::{LogRecord, TensorBoard, TrainObserver};
use kd_train::{StepHook, TrainError, TrainModel};

/// Validation every `eval_steps` (and after the last step), written to TensorBoard.
pub(crate) struct Validator<'a> {
    pub(crate) batches: Vec<Batch>,
    pub(crate) scores: &'a [Scores],
    pub(crate) kd: kd_loss::KdConfig,
    pub(crate) every: usize,
    pub(crate) tb: Option<&'a RefCell<TensorBoard>>,
    pub(crate) results: Vec<Validation>,
    pub(crate) observer: &'a RefCell<&'a mut dyn DistillObserver>,
}

impl Validator<'_> {
    pub(crate) fn validate(&mut self, step: usize, llama: &Llama) -> Result<Validation> {
        let started = Instant::now();
        let sums: EvalSums = evaluate_batches(llama, &self.batches, self.scores, &self.kd)?;
        let v = Validation {
            step,
            val_loss: sums.ce(),
            kd_loss: sums.kd(),
            alpha: sums.kd.acceptance_rate(),
            top1_agreement: sums.kd.top1_agreement(),
            tokens: sums.tokens(),
            seconds: started.elapsed().as_secs_f64(),
        };
        if let Some(tb) = self.tb {
            let mut tb = tb.borrow_mut();
            tb.scalar("student/val_loss", v.val_loss, step)?;
            tb.scalar("student/val_distill_loss", v.kd_loss, step)?;
            tb.scalar("student/val_alpha", v.alpha, step)?;
            tb.scalar("student/val_top1_agreement", v.top1_agreement, step)?;
            tb.scalar("time/val", v.seconds, step)?;
        }
        self.results.push(v);
        Ok(v)
    }
}

impl StepHook for Validator<'_> {
    fn after_step(
        &mut self,
        step: usize,
        total: usize,
        model: &TrainModel,
    ) -> kd_train::Result<()> {
        if self.batches.is_empty() {
            return Ok(());
        }
        let due = (self.every > 0 && step.is_multiple_of(self.every)) || step == total;
        if !due {
            return Ok(());
        }
        let v = self
            .validate(step, &model.llama.valid())
            .map_err(TrainError::step)?;
        self.observer.borrow_mut().on_validation(&v);
        Ok(())
    }
}

/// Forwards training events and writes ROLL's training metrics.
pub(crate) struct RollMetrics<'a> {
    pub(crate) inner: &'a RefCell<&'a mut dyn DistillObserver>,
    pub(crate) tb: Option<&'a RefCell<TensorBoard>>,
    pub(crate) last_log: Option<LogRecord>,
    pub(crate) step_started: Instant,
    pub(crate) step_seconds: f64,
    pub(crate) steps_in_window: usize,
    pub(crate) error: Option<PipelineError>,
}

impl RollMetrics<'_> {
    fn write(&mut self, r: &LogRecord) -> Result<()> {
        let Some(tb) = self.tb else {
            return Ok(());
        };
        let mut tb = tb.borrow_mut();
        let step = r.step;
        tb.scalar("train/loss", r.loss, step)?;
        for (k, v) in &r.terms {
            tb.scalar(&format!("train/{k}"), *v, step)?;
        }
        tb.scalar("student/lr", r.learning_rate, step)?;
        tb.scalar("student/grad_norm", r.grad_norm, step)?;
        let per_step = self.step_seconds / self.steps_in_window.max(1) as f64;
        tb.scalar("train/student_train_step", per_step, step)?;
        tb.scalar("train/step_train", per_step, step)?;
        tb.scalar("train/tokens_per_second", r.tokens_per_second, step)?;
        tb.scalar("system/step", step as f64, step)?;
        Ok(())
    }
}

impl TrainObserver for RollMetrics<'_> {
    fn on_start(&mut self, start: usize, total: usize) {
        self.step_started = Instant::now();
        self.inner.borrow_mut().on_start(start, total);
    }
    fn on_step(&mut self, step: usize, loss: f64) {
        // From the end of the previous step (its logging, checkpoint and validation included).
        self.step_seconds += self.step_started.elapsed().as_secs_f64();
        self.step_started = Instant::now();
        self.steps_in_window += 1;
        self.inner.borrow_mut().on_step(step, loss);
    }
    fn on_log(&mut self, record: &LogRecord) {
        if self.error.is_none()
            && let Err(e) = self.write(record)
        {
            self.error = Some(e);
        }
        self.step_seconds = 0.0;
        self.steps_in_window = 0;
        self.last_log = Some(record.clone());
        self.inner.borrow_mut().on_log(record);
    }
    fn on_checkpoint(&mut self, path: &Path) {
        self.inner.borrow_mut().on_checkpoint(path);
    }
    fn on_skipped_step(&mut self, step: usize) {
        self.inner.borrow_mut().on_skipped_step(step);
    }
    fn stop_requested(&mut self) -> bool {
        self.inner.borrow_mut().stop_requested()
    }
}

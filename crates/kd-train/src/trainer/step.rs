//! One optimizer step: the gradients of its micro-batches under one normaliser, summed,
//! clipped by global norm, and the AdamW update.

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use kd_data::Batch;
use kd_dist::World;
use kd_lora::derive_seed;
use kd_loss::LossStats;

use crate::config::TrainConfig;
use crate::data::MicroBatch;
use crate::error::Result;
use crate::loss::StepLossFn;
use crate::optim::{AdamW, AdamWParams, clip_coefficient, global_grad_norm};
use crate::trainer::reduce::sharded_step;

/// Gradients and losses of one optimizer step.
pub struct StepGradients {
    /// Summed gradients.
    pub grads: GradientsParams,
    /// The step's total loss.
    pub loss: f64,
    /// Each term summed over the micro-batches.
    pub terms: Vec<(&'static str, f64)>,
    /// KD statistics of each micro-batch (None where its loss has no KD term).
    pub kd: Vec<Option<LossStats>>,
    /// Each micro-batch's loss and terms, in order.
    pub parts: Vec<PartLoss>,
}

/// The loss of one micro-batch of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct PartLoss {
    /// Its total loss (under the step's normaliser).
    pub loss: f64,
    /// Its terms.
    pub terms: Vec<(&'static str, f64)>,
}

/// Adds `value` to the term `name` of `terms` (appended when new).
fn add_term(terms: &mut Vec<(&'static str, f64)>, name: &'static str, value: f64) {
    match terms.iter_mut().find(|(n, _)| *n == name) {
        Some((_, s)) => *s += value,
        None => terms.push((name, value)),
    }
}

/// The gradient of one optimizer step whose micro-batches may each have their own loss:
/// every micro-batch with the same global normaliser, gradients summed — what an all-reduce
/// of per-rank sums gives. `seeds[k]` seeds micro-batch `k`'s dropout masks.
pub fn step_gradients<M: Module>(
    model: &M,
    parts: &[(&Batch, &dyn StepLossFn<M>)],
    normalizer: f32,
    seeds: &[u64],
) -> Result<StepGradients> {
    let mut acc = GradientsAccumulator::<M>::new();
    let mut total = 0.0;
    let mut terms: Vec<(&'static str, f64)> = Vec::new();
    let mut kd = Vec::with_capacity(parts.len());
    let mut per_part = Vec::with_capacity(parts.len());
    for ((mb, loss_fn), seed) in parts.iter().zip(seeds) {
        let l = loss_fn.loss(model, mb, normalizer, *seed)?;
        let loss = l.total.clone().into_scalar::<f32>() as f64;
        total += loss;
        for (k, v) in &l.terms {
            add_term(&mut terms, k, *v);
        }
        per_part.push(PartLoss {
            loss,
            terms: l.terms,
        });
        kd.push(l.kd);
        let grads = GradientsParams::from_grads(l.total.backward(), model);
        acc.accumulate(model, grads);
    }
    Ok(StepGradients {
        grads: acc.grads(),
        loss: total,
        terms,
        kd,
        parts: per_part,
    })
}

/// What one optimizer step computed.
pub(crate) struct StepOutcome {
    /// Whether the loss and the gradient norm were finite (else the update was skipped).
    pub finite: bool,
    /// The step's total loss.
    pub loss: f64,
    /// Each loss term, summed over the micro-batches.
    pub terms: Vec<(&'static str, f64)>,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// KD statistics per micro-batch.
    pub kd: Vec<Option<LossStats>>,
    /// Learning rate of the step.
    pub learning_rate: f64,
    /// Label tokens of the step (the normaliser).
    pub tokens: usize,
    /// Seconds spent in the all-reduce (0 alone).
    pub reduce_seconds: f64,
}

/// Gradients of the step's micro-batches under one normaliser, clipping and the AdamW
/// update (skipped when non-finite or when the step has no label tokens).
///
/// Across ranks (`world` of several), this rank computes its share of the micro-batches
/// ([`reduce`](super::reduce)) and every rank applies the same reduced update.
pub(crate) fn run_step<M: Module>(
    config: &TrainConfig,
    (model, world): (M, &World),
    optimizer: &mut AdamW,
    micro: &[MicroBatch<M>],
    loss_fn: &dyn StepLossFn<M>,
    (step, lr): (usize, f64),
) -> Result<(M, StepOutcome)> {
    let parts: Vec<(&Batch, &dyn StepLossFn<M>)> = micro
        .iter()
        .map(|m| (&m.batch, m.loss.as_deref().unwrap_or(loss_fn)))
        .collect();
    let tokens: usize = micro.iter().map(|m| m.batch.label_tokens()).sum();
    let mut outcome = StepOutcome {
        finite: true,
        loss: 0.0,
        terms: Vec::new(),
        grad_norm: 0.0,
        kd: Vec::new(),
        learning_rate: lr,
        tokens,
        reduce_seconds: 0.0,
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
    // Sharded steps (accumulation shards or ranks) add their gradients in f64, so that N ranks
    // train what one process with N shards trains.
    let mixed = if config.accumulation_shards > 1 || world.is_distributed() {
        let (mixed, seconds) = sharded_step(world, &model, &parts, tokens as f32, &seeds)?;
        outcome.reduce_seconds = seconds;
        mixed
    } else {
        step_gradients(&model, &parts, tokens as f32, &seeds)?
    };
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

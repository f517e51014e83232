//! One optimizer step: the gradients of its micro-batches under one normaliser, summed,
//! clipped by global norm, and the AdamW update.

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use kd_data::Batch;
use kd_lora::derive_seed;
use kd_loss::LossStats;

use crate::config::TrainConfig;
use crate::data::MicroBatch;
use crate::error::Result;
use crate::loss::StepLossFn;
use crate::optim::{AdamW, AdamWParams, clip_coefficient, global_grad_norm};

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
    Ok(StepGradients {
        grads: acc.grads(),
        loss: total,
        terms,
        kd,
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
}

/// Gradients of the step's micro-batches under one normaliser, clipping and the AdamW
/// update (skipped when non-finite or when the step has no label tokens).
pub(crate) fn run_step<M: Module>(
    config: &TrainConfig,
    model: M,
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
    let mixed = step_gradients(&model, &parts, tokens as f32, &seeds)?;
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

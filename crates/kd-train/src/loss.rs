//! How a micro-batch becomes a loss: the [`StepLossFn`] trait, its output [`StepLoss`], the
//! causal-LM cross-entropy every pipeline starts from ([`CausalLmLoss`]), and the shared
//! first half of every loss: the micro-batch through the model up to its final hidden states
//! ([`final_hidden`]).

use burn::tensor::Tensor;
use kd_data::Batch;
use kd_loss::{LossStats, NextTokenTargets, linear_cross_entropy, next_token_targets};
use kd_model::{ForwardOptions, HiddenStates, Llama, ModelOutput, TokenBatch};

use crate::error::Result;
use crate::model::TrainModel;

/// The loss of one micro-batch; every term is already a sum over counted tokens divided by
/// the step's global token count.
pub struct StepLoss {
    /// The differentiable total.
    pub total: Tensor<1>,
    /// Each term's value (`ce_loss`, `kd_loss`, `hidden_mse`), weighted as in the total.
    pub terms: Vec<(&'static str, f64)>,
    /// The KD term's statistics (unweighted sums over the batch's counted positions), when
    /// the loss has one: step data sources report on-policy and off-policy rows apart from
    /// them.
    pub kd: Option<LossStats>,
}

/// How a micro-batch of model `M` becomes a loss (the pipelines implement it).
///
/// `Sync`, because the trainer runs each optimizer step on a worker of rayon's pool, and the
/// step borrows the loss there.
pub trait StepLossFn<M = TrainModel>: Sync {
    /// The loss of `batch` (examples `batch.examples` of the training set) normalised by
    /// `normalizer`, with dropout masks derived from `dropout_seed`.
    fn loss(
        &self,
        model: &M,
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

/// A micro-batch through the model up to its final hidden states (no logits: the losses fuse
/// the LM head).
pub struct FinalHidden {
    /// The forward pass (the final hidden state and the `extra_layers` asked for).
    pub out: ModelOutput,
    /// The final hidden states flattened to `[batch · seq, hidden]`.
    pub flat: Tensor<2>,
    /// The shifted labels: row `r · seq + t` predicts label `t + 1` of row `r`.
    pub shifted: NextTokenTargets,
    /// The padded sequence length.
    pub seq: usize,
}

/// The forward pass every loss of the pipelines starts with: final hidden states (and the
/// hidden states of `extra_layers`), with dropout masks from `dropout_seed`, and the batch's
/// shifted labels.
pub fn final_hidden(
    llama: &Llama,
    batch: &Batch,
    dropout_seed: Option<u64>,
    extra_layers: &[usize],
) -> Result<FinalHidden> {
    let last = llama.layers.len();
    let mut layers = vec![last];
    layers.extend(extra_layers.iter().filter(|l| **l != last));
    let opts = ForwardOptions {
        logits: false,
        hidden_states: HiddenStates::Layers(layers),
        dropout_seed,
        ..ForwardOptions::default()
    };
    let out = llama.forward(&token_batch(batch)?, &opts)?;
    let hidden = out.hidden_state(last).expect("requested").clone();
    let [b, s, d] = hidden.dims();
    Ok(FinalHidden {
        out,
        flat: hidden.reshape([b * s, d]),
        shifted: next_token_targets(&batch.labels, b, s),
        seq: s,
    })
}

/// Next-token cross-entropy on the batch's labels (the speculator's language-modelling term,
/// and SFT).
#[derive(Debug, Clone, Copy)]
pub struct CausalLmLoss {
    /// Weight of the term in the total (the speculator's `--ce_weight`; 1 for plain SFT).
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
        let h = final_hidden(&model.llama, batch, Some(dropout_seed), &[])?;
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

//! The training-time-test (TTT) loss of EAGLE-3 drafts, as SpecForge computes it
//! (`OnlineEagle3Model.forward`, `_compute_target_p`, `_acc_and_loss`; the contract's
//! EAGLE-3 section in `docs/src/loss-contract.md`).
//!
//! Inputs are aligned as SpecForge's target head leaves them: row `t` of the target's logits
//! and of the loss mask belongs to the draft's input position `t` (already shifted by one).
//!
//! - `target_p = softmax(target[..., t2d])`: the target's logits restricted to the draft
//!   vocabulary and renormalised over it.
//! - `position_mask = t2d[argmax target] · loss_mask`: a position counts only where the
//!   target's own choice is in the draft vocabulary.
//! - Step `k` reads `target_p` shifted left `k` rows (rows of `1/|draft vocab|` fill the end)
//!   and the masks shifted left `k` (zeros fill).
//! - `loss_k = Σ_{b,t} mask_k · (−Σ_v p_k · log_softmax(logits_k)) / (batch · seq)`: the mean
//!   is over every row, masked ones included.
//! - The run's loss is `Σ_k 0.8^k · loss_k` ([`TTT_DECAY`]).

use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};

/// SpecForge's step weighting (`ploss_decay`): step `k` weighs `0.8^k`.
pub const TTT_DECAY: f64 = 0.8;

/// What the draft is trained towards at every position, from the target's logits.
#[derive(Debug, Clone)]
pub struct TttTargets {
    /// `[batch, seq, draft_vocab]`: the target's distribution over the draft vocabulary,
    /// renormalised.
    pub target_p: Tensor<3>,
    /// `[batch, seq, draft_vocab]`: the same probabilities, not renormalised (for the
    /// acceptance-rate metric).
    pub target_p_on_draft: Tensor<3>,
    /// `[batch, seq]`: the target's argmax (a target id).
    pub target_ids: Tensor<2, Int>,
    /// `[batch, seq]`, 0/1: positions that count in the loss.
    pub position_mask: Tensor<2>,
    /// `[batch, seq]`, 0/1: the loss mask as given (shifted for later steps).
    pub loss_mask: Tensor<2>,
}

/// What the TTT loss reads of the target's logits `[batch, seq, target_vocab]`: the logits of
/// the draft vocabulary, the log-normaliser over the whole vocabulary and the argmax. Small
/// enough to keep per position (a draft vocabulary and two numbers, not the target's
/// vocabulary), and all [`TttTargets::from_reduced`] needs.
#[derive(Debug, Clone)]
pub struct ReducedLogits {
    /// `[batch, seq, draft_vocab]`: the target's logits of the draft vocabulary's tokens.
    pub restricted: Tensor<3>,
    /// `[batch, seq, 1]`: `log Σ_v exp(logit_v)` over the target's whole vocabulary.
    pub log_z: Tensor<3>,
    /// `[batch, seq]`: the target's argmax (a target id).
    pub target_ids: Tensor<2, Int>,
}

impl ReducedLogits {
    /// From the target's logits and the draft vocabulary's target ids (ascending).
    pub fn new(target_logits: Tensor<3>, draft_to_target: &[u32]) -> Self {
        let index = id_tensor(draft_to_target, &target_logits.device());
        let restricted = target_logits.clone().select(2, index);
        let (log_z, target_ids) = Self::log_z_and_argmax(target_logits);
        Self {
            restricted,
            log_z,
            target_ids,
        }
    }

    /// The two fields that need the whole vocabulary, [`log_z`](Self::log_z) `[batch, seq, 1]`
    /// and [`target_ids`](Self::target_ids) `[batch, seq]`, from the target's logits
    /// `[batch, seq, target_vocab]`: what a caller that makes the draft vocabulary's logits
    /// elsewhere keeps.
    pub fn log_z_and_argmax(target_logits: Tensor<3>) -> (Tensor<3>, Tensor<2, Int>) {
        let [b, s, _] = target_logits.dims();
        (
            log_sum_exp(target_logits.clone()),
            target_logits.argmax(2).reshape([b, s]),
        )
    }
}

impl TttTargets {
    /// From the target's logits `[batch, seq, target_vocab]`, the loss mask `[batch, seq]`
    /// (0/1) and the draft vocabulary's target ids (ascending, `draft_to_target[i]` = the
    /// target id of draft id `i`).
    pub fn new(target_logits: Tensor<3>, loss_mask: Tensor<2>, draft_to_target: &[u32]) -> Self {
        let vocab = target_logits.dims()[2];
        Self::from_reduced(
            ReducedLogits::new(target_logits, draft_to_target),
            loss_mask,
            draft_to_target,
            vocab,
        )
    }

    /// From what [`ReducedLogits`] keeps of the target's logits (the same tensors as
    /// [`new`](Self::new) from the full logits), the loss mask and the draft vocabulary's
    /// target ids, of a target vocabulary of `target_vocab` tokens.
    ///
    /// # Panics
    ///
    /// If a target id (of the draft vocabulary or an argmax) is not below `target_vocab`.
    pub fn from_reduced(
        reduced: ReducedLogits,
        loss_mask: Tensor<2>,
        draft_to_target: &[u32],
        target_vocab: usize,
    ) -> Self {
        let ReducedLogits {
            restricted,
            log_z,
            target_ids,
        } = reduced;
        let [b, s, dv] = restricted.dims();
        let device = restricted.device();
        let target_p = softmax(restricted.clone(), 2);
        let target_p_on_draft = (restricted - log_z.expand([b, s, dv])).exp();
        let mut in_draft = vec![0.0f32; target_vocab];
        for &t in draft_to_target {
            in_draft[t as usize] = 1.0;
        }
        let in_draft = Tensor::<1>::from_data(
            TensorData::new(in_draft, [target_vocab]),
            (&device, DType::F32),
        );
        let position_mask = in_draft
            .select(0, target_ids.clone().reshape([b * s]))
            .reshape([b, s])
            * loss_mask.clone();
        Self {
            target_p,
            target_p_on_draft,
            target_ids,
            position_mask,
            loss_mask,
        }
    }

    /// The targets of TTT step `k`: every tensor shifted left `k` rows; `target_p` filled with
    /// the uniform distribution, the rest with zeros.
    pub fn step(&self, k: usize) -> Self {
        let [b, s, dv] = self.target_p.dims();
        let k = k.min(s);
        let device = self.target_p.device();
        let shift3 = |t: &Tensor<3>, fill: f64| {
            Tensor::cat(
                vec![
                    t.clone().slice([0..b, k..s, 0..dv]),
                    Tensor::<3>::full([b, k, dv], fill, (&device, DType::F32)),
                ],
                1,
            )
        };
        let shift2 = |t: &Tensor<2>| {
            Tensor::cat(
                vec![
                    t.clone().slice([0..b, k..s]),
                    Tensor::<2>::zeros([b, k], (&device, DType::F32)),
                ],
                1,
            )
        };
        Self {
            target_p: shift3(&self.target_p, 1.0 / dv as f64),
            target_p_on_draft: shift3(&self.target_p_on_draft, 0.0),
            target_ids: Tensor::cat(
                vec![
                    self.target_ids.clone().slice([0..b, k..s]),
                    Tensor::<2, Int>::zeros([b, k], &device),
                ],
                1,
            ),
            position_mask: shift2(&self.position_mask),
            loss_mask: shift2(&self.loss_mask),
        }
    }
}

/// `log Σ exp` over the last axis, kept as `[batch, seq, 1]`.
fn log_sum_exp(x: Tensor<3>) -> Tensor<3> {
    let max = x.clone().max_dim(2);
    let [b, s, v] = x.dims();
    (x - max.clone().expand([b, s, v])).exp().sum_dim(2).log() + max
}

/// One step's loss: `Σ mask · (−Σ_v p · log_softmax(logits)) / (batch · seq)`, shape `[1]`.
pub fn ttt_step_loss(logits: Tensor<3>, targets: &TttTargets) -> Tensor<1> {
    let [b, s, _] = logits.dims();
    let per_row = (targets.target_p.clone() * log_softmax(logits, 2))
        .sum_dim(2)
        .reshape([b, s])
        .neg();
    (per_row * targets.position_mask.clone())
        .sum()
        .div_scalar((b * s) as f64)
}

/// The weighted sum over steps, `Σ_k 0.8^k · loss_k`, from the step-0 targets and each step's
/// logits.
pub fn ttt_loss(step_logits: &[Tensor<3>], targets: &TttTargets) -> Tensor<1> {
    let mut total: Option<Tensor<1>> = None;
    for (k, logits) in step_logits.iter().enumerate() {
        let loss =
            ttt_step_loss(logits.clone(), &targets.step(k)).mul_scalar(TTT_DECAY.powi(k as i32));
        total = Some(match total {
            Some(t) => t + loss,
            None => loss,
        });
    }
    total.expect("at least one step")
}

/// One TTT step's metric sums over a batch. Sums rather than ratios, so that micro-batches and
/// ranks add up before dividing.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TttStepCounts {
    /// Positions under the step's loss mask where the draft's argmax, as a target id, is the
    /// target's argmax: the numerator of SpecForge's `acc` (a position whose target token lies
    /// outside the draft vocabulary is never correct).
    pub correct: f64,
    /// `Σ position_mask · Σ_v min(p_target, p_draft)`: the expected accepted drafts, the
    /// numerator of SpecForge's acceptance rate (the target's probabilities not renormalised).
    pub overlap: f64,
    /// `Σ position_mask`: the acceptance rate's denominator.
    pub positions: f64,
    /// `Σ loss_mask`: `acc`'s denominator.
    pub labels: f64,
}

impl TttStepCounts {
    /// SpecForge's `acc`: `correct / max(labels, 1e-6)`.
    pub fn accuracy(&self) -> f64 {
        self.correct / self.labels.max(1e-6)
    }

    /// SpecForge's acceptance rate: `overlap / max(positions, 1e-8)`.
    pub fn acceptance_rate(&self) -> f64 {
        self.overlap / self.positions.max(1e-8)
    }
}

/// The metric sums of one step (`logits` `[batch, seq, draft_vocab]`; detach them first when
/// they carry gradients), as SpecForge's `_acc_and_loss` and `compute_acceptance_rate`
/// compute them. `draft_to_target[i]` is the target id of draft id `i`.
pub fn ttt_step_counts(
    logits: Tensor<3>,
    targets: &TttTargets,
    draft_to_target: &[u32],
) -> TttStepCounts {
    let [b, s, _] = logits.dims();
    let device = logits.device();
    let overlap = overlap(logits.clone(), targets);
    let to_target = id_tensor(draft_to_target, &device);
    let predicted = to_target
        .select(0, logits.argmax(2).reshape([b * s]))
        .reshape([b, s]);
    let hits = predicted
        .equal(targets.target_ids.clone())
        .float()
        .cast(DType::F32);
    TttStepCounts {
        correct: sum(hits * targets.loss_mask.clone()),
        overlap: sum(overlap * targets.position_mask.clone()),
        positions: sum(targets.position_mask.clone()),
        labels: sum(targets.loss_mask.clone()),
    }
}

/// `Σ_v min(p_target, p_draft)` per position, `[batch, seq]`.
fn overlap(logits: Tensor<3>, targets: &TttTargets) -> Tensor<2> {
    let [b, s, _] = logits.dims();
    targets
        .target_p_on_draft
        .clone()
        .min_pair(softmax(logits, 2))
        .sum_dim(2)
        .reshape([b, s])
}

/// The draft vocabulary's target ids as an index tensor.
fn id_tensor(draft_to_target: &[u32], device: &Device) -> Tensor<1, Int> {
    let ids: Vec<i64> = draft_to_target.iter().map(|&t| t as i64).collect();
    Tensor::from_data(TensorData::new(ids, [draft_to_target.len()]), device)
}

/// A tensor's sum as an `f64`.
fn sum(t: Tensor<2>) -> f64 {
    t.sum().into_scalar::<f32>() as f64
}

/// SpecForge's acceptance-rate metric of a step: `Σ mask · Σ_v min(p_target, p_draft) /
/// max(Σ mask, 1e-8)`, with the target's probabilities not renormalised.
pub fn ttt_acceptance_rate(logits: Tensor<3>, targets: &TttTargets) -> f64 {
    let counted = sum(overlap(logits, targets) * targets.position_mask.clone());
    counted / sum(targets.position_mask.clone()).max(1e-8)
}

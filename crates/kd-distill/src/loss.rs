//! The distill loss, `(1 − w)·CE + w·KD` (`docs/src/loss-contract.md`), both terms in one pass of
//! the LM head fused with the losses (`kd_loss::linear_kd`: no `[tokens, vocab]` logits are
//! kept for autodiff). Both are sums over the step's counted positions divided by their global
//! count; KD is shifted like CE (the logits
//! at t are compared with the teacher's at t where label t + 1 counts; ROLL compares
//! unshifted positions) and the end-of-turn token is not masked.

use burn::tensor::Tensor;
use kd_data::Batch;
use kd_loss::{KdConfig, LossStats};
use kd_model::Llama;
use kd_teacher::Scores;

use kd_pipeline::kd_term::{counted_positions, topk_kd};
use kd_train::{FinalHidden, Result, StepLoss, StepLossFn, TrainModel, final_hidden};

/// The loss of one micro-batch of the distill pipeline.
pub struct DistillLoss<'a> {
    /// `distill_loss_weight` (w).
    pub distill_loss_weight: f64,
    /// The objective and its parameters.
    pub kd: KdConfig,
    /// The teacher's top-k log-probs of every training example (full vocabulary when K = V).
    pub scores: &'a [Scores],
}

/// Sums of one evaluation pass (CE and KD on the same positions).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EvalSums {
    /// Σ CE over counted positions.
    pub ce_sum: f64,
    /// KD statistics (Σ loss, Σ α, top-1 matches, counted).
    pub kd: LossStats,
}

impl EvalSums {
    /// Counted positions.
    pub fn tokens(&self) -> usize {
        self.kd.counted
    }

    /// Mean CE (`student/val_loss`).
    pub fn ce(&self) -> f64 {
        self.ce_sum / self.tokens().max(1) as f64
    }

    /// Mean KD.
    pub fn kd(&self) -> f64 {
        self.kd.loss_sum / self.tokens().max(1) as f64
    }
}

/// The student's loss on one batch, `(1 − w)·CE + w·KD` (`w` = `kd_weight`), its CE and KD
/// statistics; CE and KD share the counted positions and one pass of the fused LM head.
fn terms(
    llama: &Llama,
    batch: &Batch,
    scores: &[Scores],
    kd: &KdConfig,
    kd_weight: f64,
    normalizer: f32,
    dropout_seed: Option<u64>,
) -> Result<(Tensor<1>, LossStats, LossStats)> {
    let FinalHidden {
        flat, shifted, seq, ..
    } = final_hidden(llama, batch, dropout_seed, &[])?;
    if shifted.count == 0 {
        // Nothing counted: a zero that still reaches the graph.
        return Ok((flat.sum() * 0.0, LossStats::default(), LossStats::default()));
    }
    let counted = counted_positions(batch, &shifted.mask, seq, None)?;
    let out = topk_kd(
        flat,
        llama.lm_head_weight(),
        &counted,
        scores,
        normalizer,
        kd,
        kd_weight as f32,
        Some((&shifted.targets, (1.0 - kd_weight) as f32)),
    )?;
    let ce = out.ce.expect("CE was asked for");
    Ok((out.loss, ce, out.kd))
}

impl StepLossFn for DistillLoss<'_> {
    fn loss(
        &self,
        model: &TrainModel,
        batch: &Batch,
        normalizer: f32,
        dropout_seed: u64,
    ) -> Result<StepLoss> {
        let (total, ce, kd) = terms(
            &model.llama,
            batch,
            self.scores,
            &self.kd,
            self.distill_loss_weight,
            normalizer,
            Some(dropout_seed),
        )?;
        let n = normalizer as f64;
        let terms = vec![
            ("train_student_loss", ce.loss_sum / n),
            ("train_distill_loss", kd.loss_sum / n),
            ("kd_alpha", kd.acceptance_sum / n),
            ("kd_top1", kd.top1_matches as f64 / n),
        ];
        Ok(StepLoss {
            total,
            terms,
            kd: Some(kd),
        })
    }
}

/// CE and KD sums of `llama` over `batches` (no gradient, no dropout): the validation pass.
pub fn evaluate_batches(
    llama: &Llama,
    batches: &[Batch],
    scores: &[Scores],
    kd: &KdConfig,
) -> Result<EvalSums> {
    let mut sums = EvalSums::default();
    for batch in batches {
        // Only the statistics are read: the weight of the (unused) total does not matter.
        let (_, ce, kd_stats) = terms(llama, batch, scores, kd, 0.5, 1.0, None)?;
        sums.ce_sum += ce.loss_sum;
        sums.kd.merge(&kd_stats);
    }
    Ok(sums)
}

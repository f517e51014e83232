//! The public entry points: distillation loss and cross-entropy over rows of logits.

use burn::tensor::{Device, Int, Tensor};

use crate::config::KdConfig;
use crate::error::{LossError, Result};
use crate::fused::{self, FusedJob, FusedTeacherInput};
use crate::kernels::BatchStats;
use crate::reference::{self, RefTeacher};

/// The teacher's side of a KD loss, one row per student row.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // tensors are handles; boxing buys nothing
pub enum Teacher {
    /// Full-vocabulary logits `[rows, vocab]` (top-k is then taken by the loss when
    /// `logits_topk > 0`).
    Logits(Tensor<2>),
    /// The teacher's top-k entries (as a teacher server or cache returns them): vocabulary
    /// indices `[rows, k]` and their logits or log-probs `[rows, k]` (equivalent: the
    /// distribution is renormalised over the K entries).
    TopK {
        /// Vocabulary indices.
        indices: Tensor<2, Int>,
        /// Logits or log-probs at those indices.
        values: Tensor<2>,
    },
}

/// Which implementation computes a loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelPath {
    /// The fused host kernels on the CPU backend, the reference path elsewhere.
    #[default]
    Auto,
    /// The fused kernels (CPU backend only).
    Fused,
    /// Burn's generic tensor operations (any backend).
    Reference,
}

/// Statistics of one loss call (no gradient), summed over the counted rows.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossStats {
    /// Σ of per-row losses (divide by the normaliser for the loss value).
    pub loss_sum: f64,
    /// Rows that counted (mask set / target not ignored), non-finite ones included.
    pub counted: usize,
    /// Counted rows skipped because a side held NaN or +∞.
    pub nonfinite_positions: usize,
    /// Σ_rows Σ_v min(p, q): the speculative-sampling acceptance (KD only).
    pub acceptance_sum: f64,
    /// Rows where argmax q == argmax p (KD only).
    pub top1_matches: usize,
}

impl LossStats {
    pub(crate) fn from_batch(b: BatchStats) -> Self {
        Self {
            loss_sum: b.loss_sum,
            counted: b.counted,
            nonfinite_positions: b.nonfinite,
            acceptance_sum: b.acceptance_sum,
            top1_matches: b.top1,
        }
    }

    fn finite_rows(&self) -> usize {
        self.counted - self.nonfinite_positions
    }

    /// Mean acceptance α = Σ min(p, q) over finite counted rows.
    pub fn acceptance_rate(&self) -> f64 {
        self.acceptance_sum / self.finite_rows().max(1) as f64
    }

    /// Fraction of finite counted rows whose argmaxes agree (greedy acceptance).
    pub fn top1_agreement(&self) -> f64 {
        self.top1_matches as f64 / self.finite_rows().max(1) as f64
    }

    /// Expected accepted length for `k` drafted tokens, (1 − α^(k+1)) / (1 − α).
    pub fn mean_accepted_length(&self, k: u32) -> f64 {
        mean_accepted_length(self.acceptance_rate(), k)
    }

    /// Adds another call's statistics (micro-batches of one step).
    pub fn merge(&mut self, other: &Self) {
        self.loss_sum += other.loss_sum;
        self.counted += other.counted;
        self.nonfinite_positions += other.nonfinite_positions;
        self.acceptance_sum += other.acceptance_sum;
        self.top1_matches += other.top1_matches;
    }
}

/// (1 − α^(k+1)) / (1 − α): expected tokens per verification step with k drafted tokens at
/// per-token acceptance α (Leviathan et al. 2023).
pub fn mean_accepted_length(alpha: f64, k: u32) -> f64 {
    if (1.0 - alpha).abs() < 1e-12 {
        (k + 1) as f64
    } else {
        (1.0 - alpha.powi(k as i32 + 1)) / (1.0 - alpha)
    }
}

/// A loss value and its statistics.
#[derive(Debug, Clone)]
pub struct LossOutput {
    /// The loss `[1]`: Σ over counted rows / normaliser; differentiable w.r.t. the student.
    pub loss: Tensor<1>,
    /// Statistics.
    pub stats: LossStats,
}

pub(crate) fn on_flex(device: &Device) -> bool {
    device.clone().without_autodiff() == Device::flex()
}

/// One target per row, each below the vocabulary size (negative = ignored).
pub(crate) fn check_targets(targets: &[i64], rows: usize, vocab: usize, what: &str) -> Result<()> {
    if targets.len() != rows {
        return Err(LossError::Shape(format!(
            "{} targets for {rows} rows of {what}",
            targets.len()
        )));
    }
    if let Some((r, t)) = targets
        .iter()
        .enumerate()
        .find(|(_, t)| **t >= vocab as i64)
    {
        return Err(LossError::Input(format!(
            "target {t} at row {r} is out of range for a vocabulary of {vocab}"
        )));
    }
    Ok(())
}

pub(crate) fn check_normalizer(normalizer: f32) -> Result<()> {
    if normalizer.is_finite() && normalizer > 0.0 {
        Ok(())
    } else {
        Err(LossError::Input(format!(
            "the normaliser (global count of label tokens) must be positive, got {normalizer}"
        )))
    }
}

fn use_fused(path: KernelPath, device: &Device) -> Result<bool> {
    match path {
        KernelPath::Auto => Ok(on_flex(device)),
        KernelPath::Reference => Ok(false),
        KernelPath::Fused if on_flex(device) => Ok(true),
        KernelPath::Fused => Err(LossError::Input(
            "the fused loss kernels run on the CPU backend only; use KernelPath::Auto or Reference"
                .into(),
        )),
    }
}

/// Distillation loss over rows of student logits `[rows, vocab]` (see `docs/src/loss-contract.md`):
/// Σ over rows with `mask[r]` of the objective, divided by `normalizer` (the global number of
/// counted tokens of the optimizer step). Rows are positions already aligned with the teacher
/// (use [`crate::next_token_targets`] for the shift).
pub fn kd_loss(
    student: Tensor<2>,
    teacher: Teacher,
    mask: &[bool],
    normalizer: f32,
    config: &KdConfig,
) -> Result<LossOutput> {
    kd_loss_with(student, teacher, mask, normalizer, config, KernelPath::Auto)
}

/// [`kd_loss`] with a chosen implementation.
pub fn kd_loss_with(
    student: Tensor<2>,
    teacher: Teacher,
    mask: &[bool],
    normalizer: f32,
    config: &KdConfig,
    path: KernelPath,
) -> Result<LossOutput> {
    config.validate()?;
    check_normalizer(normalizer)?;
    let [rows, vocab] = student.dims();
    if mask.len() != rows {
        return Err(LossError::Shape(format!(
            "mask has {} entries for {rows} student rows",
            mask.len()
        )));
    }
    match &teacher {
        Teacher::Logits(t) => {
            if t.dims() != [rows, vocab] {
                return Err(LossError::Shape(format!(
                    "teacher logits {:?} vs student logits {:?}: the vocabularies or row counts differ",
                    t.dims(),
                    [rows, vocab]
                )));
            }
        }
        Teacher::TopK { indices, values } => {
            if indices.dims() != values.dims() || indices.dims()[0] != rows {
                return Err(LossError::Shape(format!(
                    "teacher top-k indices {:?} and values {:?} for {rows} student rows",
                    indices.dims(),
                    values.dims()
                )));
            }
            let max = indices.clone().max().into_scalar::<i64>();
            let min = indices.clone().min().into_scalar::<i64>();
            if min < 0 || max >= vocab as i64 {
                return Err(LossError::Input(format!(
                    "teacher top-k index out of range [{min}, {max}] for a student vocabulary of {vocab}"
                )));
            }
        }
    }
    let scale = config.extra_scale() / normalizer;
    if use_fused(path, &student.device())? {
        let input = match teacher {
            Teacher::Logits(t) => FusedTeacherInput::Full(t),
            Teacher::TopK { indices, values } => FusedTeacherInput::Sparse(indices, values),
        };
        let job = FusedJob {
            kd: Some(config.kernel_params()),
            mask: mask.to_vec(),
            targets: Vec::new(),
            scale,
            force_grad: false,
        };
        let (loss, stats, _) = fused::run(student, input, job);
        Ok(LossOutput {
            loss,
            stats: LossStats::from_batch(stats),
        })
    } else {
        let t = match teacher {
            Teacher::Logits(t) => RefTeacher::Full(t),
            Teacher::TopK { indices, values } => RefTeacher::Sparse(indices, values),
        };
        let (loss, stats) = reference::kd(student, t, mask, scale, config);
        Ok(LossOutput {
            loss,
            stats: LossStats::from_batch(stats),
        })
    }
}

/// Cross-entropy over rows of logits `[rows, vocab]` against `targets` (−100, or any
/// negative value, = ignored): Σ over counted rows of `−log softmax(z)[target]`, divided by
/// `normalizer`.
pub fn cross_entropy(logits: Tensor<2>, targets: &[i64], normalizer: f32) -> Result<LossOutput> {
    cross_entropy_with(logits, targets, normalizer, KernelPath::Auto)
}

/// [`cross_entropy`] with a chosen implementation.
pub fn cross_entropy_with(
    logits: Tensor<2>,
    targets: &[i64],
    normalizer: f32,
    path: KernelPath,
) -> Result<LossOutput> {
    check_normalizer(normalizer)?;
    let [rows, vocab] = logits.dims();
    check_targets(targets, rows, vocab, "logits")?;
    let scale = 1.0 / normalizer;
    if use_fused(path, &logits.device())? {
        let job = FusedJob {
            kd: None,
            mask: Vec::new(),
            targets: targets.to_vec(),
            scale,
            force_grad: false,
        };
        let (loss, stats, _) = fused::run(logits, FusedTeacherInput::None, job);
        Ok(LossOutput {
            loss,
            stats: LossStats::from_batch(stats),
        })
    } else {
        let (loss, stats) = reference::ce(logits, targets, scale);
        Ok(LossOutput {
            loss,
            stats: LossStats::from_batch(stats),
        })
    }
}

/// Value and gradient of a KD loss without autodiff (benchmarks; tests): runs the fused
/// kernel on a plain CPU tensor and returns `(loss, d loss / d student, stats)`.
pub fn kd_loss_and_grad(
    student: Tensor<2>,
    teacher: Teacher,
    mask: &[bool],
    normalizer: f32,
    config: &KdConfig,
) -> Result<(f32, Tensor<2>, LossStats)> {
    config.validate()?;
    check_normalizer(normalizer)?;
    if !on_flex(&student.device()) || student.is_autodiff() {
        return Err(LossError::Input(
            "kd_loss_and_grad takes a plain (non-autodiff) CPU tensor".into(),
        ));
    }
    let input = match teacher {
        Teacher::Logits(t) => FusedTeacherInput::Full(t),
        Teacher::TopK { indices, values } => FusedTeacherInput::Sparse(indices, values),
    };
    let job = FusedJob {
        kd: Some(config.kernel_params()),
        mask: mask.to_vec(),
        targets: Vec::new(),
        scale: config.extra_scale() / normalizer,
        force_grad: true,
    };
    let (loss, stats, grad) = fused::run(student, input, job);
    let value = loss.into_data().try_into_vec_as::<f32>().expect("f32")[0];
    Ok((
        value,
        grad.expect("gradient requested"),
        LossStats::from_batch(stats),
    ))
}

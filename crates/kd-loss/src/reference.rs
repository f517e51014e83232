//! The reference path: every loss written with Burn's generic tensor operations, so it runs on
//! any backend (CUDA included) and differentiates through autodiff. It materialises the
//! distributions; the fused path ([`crate::fused`]) is the memory- and speed-optimised twin,
//! and tests hold the two to the same PyTorch numbers.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Bool, Int, Tensor, TensorData};

use crate::config::{KdConfig, KdObjective, SparseStudent};
use crate::kernels::BatchStats;

/// Rows of `x` holding NaN or +∞ (host-side).
fn nonfinite_rows(x: &Tensor<2>) -> Vec<bool> {
    let [rows, cols] = x.dims();
    let bad = x
        .clone()
        .without_autodiff()
        .is_nan()
        .bool_or(x.clone().without_autodiff().equal_elem(f32::INFINITY))
        .int()
        .sum_dim(1);
    let bad: Vec<i64> = bad
        .into_data()
        .convert::<i64>()
        .try_into_vec_as::<i64>()
        .expect("i64");
    debug_assert_eq!(bad.len(), rows);
    let _ = cols;
    bad.into_iter().map(|b| b > 0).collect()
}

fn row_mask(rows: &[bool], cols: usize, device: &burn::tensor::Device) -> Tensor<2, Bool> {
    let data: Vec<bool> = rows
        .iter()
        .flat_map(|b| std::iter::repeat_n(*b, cols))
        .collect();
    Tensor::from_data(TensorData::new(data, [rows.len(), cols]), device)
}

fn weights(rows: &[bool], device: &burn::tensor::Device) -> Tensor<1> {
    let data: Vec<f32> = rows.iter().map(|b| if *b { 1.0 } else { 0.0 }).collect();
    Tensor::from_data(TensorData::new(data, [rows.len()]), device)
}

/// The teacher as the reference path takes it.
#[allow(clippy::large_enum_variant)] // short-lived, moved once
pub(crate) enum RefTeacher {
    Full(Tensor<2>),
    Sparse(Tensor<2, Int>, Tensor<2>),
}

/// KD loss (`Σ_counted ℓ_r · scale`), per-row losses and statistics.
pub(crate) fn kd(
    student: Tensor<2>,
    teacher: RefTeacher,
    mask: &[bool],
    scale: f32,
    cfg: &KdConfig,
) -> (Tensor<1>, BatchStats) {
    let device = student.device();
    let is = 1.0 / cfg.kd_temperature;
    let it = 1.0 / (cfg.kd_temperature * cfg.teacher_temperature);

    // Rows with NaN/+∞ on either side are zeroed out and do not contribute.
    let mut bad = nonfinite_rows(&student);
    let teacher_values = match &teacher {
        RefTeacher::Full(t) | RefTeacher::Sparse(_, t) => t.clone(),
    };
    for (b, t) in bad.iter_mut().zip(nonfinite_rows(&teacher_values)) {
        *b |= t;
    }
    let sanitize = |x: Tensor<2>| {
        let cols = x.dims()[1];
        x.mask_fill(row_mask(&bad, cols, &device), 0.0)
    };
    let student = sanitize(student);

    // Aligned student and teacher values over the support (V, or the K teacher entries).
    let (zs, zt, gathered_lse) = match teacher {
        RefTeacher::Full(t) if cfg.logits_topk == 0 => (student.clone(), sanitize(t), None),
        RefTeacher::Full(t) => {
            let t = sanitize(t);
            let k = cfg.logits_topk.min(t.dims()[1]);
            let (values, idx) = t.topk_with_indices(k, 1);
            (student.clone().gather(1, idx.clone()), values, Some(idx))
        }
        RefTeacher::Sparse(idx, values) => (
            student.clone().gather(1, idx.clone()),
            sanitize(values),
            Some(idx),
        ),
    };
    let out = zs
        .clone()
        .equal_elem(f32::NEG_INFINITY)
        .bool_or(zt.clone().equal_elem(f32::NEG_INFINITY));
    let zs = zs.mask_fill(out.clone(), f32::NEG_INFINITY);
    let zt = zt.mask_fill(out.clone(), f32::NEG_INFINITY);
    let support = out.bool_not();

    let lq = match (&gathered_lse, cfg.sparse_student) {
        (Some(idx), SparseStudent::FullLogsumexp) => {
            log_softmax(student * is, 1).gather(1, idx.clone())
        }
        _ => log_softmax(zs.clone() * is, 1),
    };
    let lp = log_softmax(zt.clone() * it, 1);
    // Logs outside the support are −∞: replace them so that 0 · (…) stays 0, also in backward.
    let lq = lq.mask_where(support.clone().bool_not(), Tensor::zeros_like(&zs));
    let lp = lp.mask_where(support.clone().bool_not(), Tensor::zeros_like(&zt));
    let zero = |x: Tensor<2>| x.mask_fill(support.clone().bool_not(), 0.0);
    let q = zero(lq.clone().exp());
    let p = zero(lp.clone().exp());

    let per_row = divergence(cfg, [&p, &q, &lp, &lq], &support);
    let per_row: Tensor<1> = per_row.squeeze_dim(1);

    let counted: Vec<bool> = mask.iter().zip(&bad).map(|(m, b)| *m && !b).collect();
    let w = weights(&counted, &device);
    let loss = (per_row.clone() * w.clone()).sum() * scale;

    let stats = kd_stats(per_row, w, (&p, &q), (zs, zt), mask, &bad);
    (loss, stats)
}

/// Each row's divergence `[rows, 1]` of the configured objective between the teacher's p and
/// the student's q over the support (`lp`, `lq`: their logs, 0 outside the support).
fn divergence(
    cfg: &KdConfig,
    [p, q, lp, lq]: [&Tensor<2>; 4],
    support: &Tensor<2, Bool>,
) -> Tensor<2> {
    let lam = cfg.skew_lambda;
    let fkl = || (p.clone() * (lp.clone() - lq.clone())).sum_dim(1);
    let rkl = || (q.clone() * (lq.clone() - lp.clone())).sum_dim(1);
    let safe_log = |m: Tensor<2>| m.mask_fill(support.clone().bool_not(), 1.0).log();
    match cfg.objective {
        KdObjective::ForwardKl => fkl(),
        KdObjective::ReverseKl => rkl(),
        KdObjective::SkewedForwardKl => {
            let m = p.clone() * lam + q.clone() * (1.0 - lam);
            (p.clone() * (lp.clone() - safe_log(m))).sum_dim(1)
        }
        KdObjective::SkewedReverseKl => {
            let m = p.clone() * (1.0 - lam) + q.clone() * lam;
            (q.clone() * (lq.clone() - safe_log(m))).sum_dim(1)
        }
        KdObjective::JsDivergence => {
            let eps = 1e-9;
            let m = (p.clone() + q.clone()) * 0.5;
            let lm = (m + eps).log();
            let a = p.clone() * ((p.clone() + eps).log() - lm.clone());
            let b = q.clone() * ((q.clone() + eps).log() - lm);
            (a + b).sum_dim(1) * 0.5
        }
        KdObjective::TvDistance => (p.clone() - q.clone()).abs().sum_dim(1) * 0.5,
        KdObjective::AdaptiveKl => {
            let (pd, qd) = (p.clone().detach(), q.clone().detach());
            let (sorted, idx) = pd.sort_with_indices(1);
            let q_sorted = qd.gather(1, idx);
            let gap = (sorted.clone() - q_sorted).abs();
            let tail = sorted
                .cumsum(1)
                .lower_equal_elem(cfg.adaptive_kl_alpha)
                .float();
            let g_tail = (gap.clone() * tail.clone()).sum_dim(1);
            let g_head = (gap * (tail.neg() + 1.0)).sum_dim(1);
            let denom = g_head.clone() + g_tail.clone();
            let zero_denom = denom.clone().equal_elem(0.0);
            let w_head = (g_head / denom.clone().mask_fill(zero_denom.clone(), 1.0))
                .mask_fill(zero_denom.clone(), 0.5);
            let w_tail =
                (g_tail / denom.mask_fill(zero_denom.clone(), 1.0)).mask_fill(zero_denom, 0.5);
            w_head * fkl() + w_tail * rkl()
        }
    }
}

/// The batch's statistics (no gradient): summed row losses, acceptance Σ min(p, q), top-1
/// agreement, counted and non-finite rows.
fn kd_stats(
    per_row: Tensor<1>,
    w: Tensor<1>,
    (p, q): (&Tensor<2>, &Tensor<2>),
    (zs, zt): (Tensor<2>, Tensor<2>),
    mask: &[bool],
    bad: &[bool],
) -> BatchStats {
    let rows = per_row.dims()[0];
    let row_loss: Vec<f32> = (per_row.without_autodiff() * w.clone().without_autodiff())
        .into_data()
        .try_into_vec_as::<f32>()
        .expect("f32");
    let acceptance: Vec<f32> = p
        .clone()
        .without_autodiff()
        .min_pair(q.clone().without_autodiff())
        .sum_dim(1)
        .squeeze_dim::<1>(1)
        .into_data()
        .try_into_vec_as::<f32>()
        .expect("f32");
    let am = |x: Tensor<2>| -> Vec<i64> {
        x.without_autodiff()
            .argmax(1)
            .into_data()
            .convert::<i64>()
            .try_into_vec_as::<i64>()
            .expect("i64")
    };
    let (top_s, top_t) = (am(zs), am(zt));
    let mut stats = BatchStats::default();
    for r in 0..rows {
        if !mask[r] {
            continue;
        }
        stats.counted += 1;
        if bad[r] {
            stats.nonfinite += 1;
            continue;
        }
        stats.loss_sum += row_loss[r] as f64;
        stats.acceptance_sum += acceptance[r] as f64;
        stats.top1 += (top_s[r] == top_t[r]) as usize;
    }
    stats
}

/// Cross-entropy `Σ_counted −log softmax(z)[target] · scale`.
pub(crate) fn ce(logits: Tensor<2>, targets: &[i64], scale: f32) -> (Tensor<1>, BatchStats) {
    let [rows, _] = logits.dims();
    let device = logits.device();
    let bad = nonfinite_rows(&logits);
    let cols = logits.dims()[1];
    let logits = logits.mask_fill(row_mask(&bad, cols, &device), 0.0);
    let idx: Vec<i64> = targets.iter().map(|t| (*t).max(0)).collect();
    let idx = Tensor::<2, Int>::from_data(TensorData::new(idx, [rows, 1]), &device);
    let nll: Tensor<1> = log_softmax(logits, 1)
        .gather(1, idx)
        .squeeze_dim::<1>(1)
        .neg();
    let counted: Vec<bool> = targets
        .iter()
        .zip(&bad)
        .map(|(t, b)| *t >= 0 && !b)
        .collect();
    let w = weights(&counted, &device);
    let loss = (nll.clone() * w.clone()).sum() * scale;
    let row_loss: Vec<f32> = (nll.without_autodiff() * w.without_autodiff())
        .into_data()
        .try_into_vec_as::<f32>()
        .expect("f32");
    let mut stats = BatchStats::default();
    for r in 0..rows {
        if targets[r] < 0 {
            continue;
        }
        stats.counted += 1;
        if bad[r] {
            stats.nonfinite += 1;
        } else {
            stats.loss_sum += row_loss[r] as f64;
        }
    }
    (loss, stats)
}

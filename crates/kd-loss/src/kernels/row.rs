//! Per-row loss kernels on host slices: value and gradient w.r.t. the student logits in one
//! pass over the row (plus a pass for the log-sum-exps), with row-sized scratch only.
//!
//! For an objective L(p, q) with q = softmax(z_S/τ) the gradient is
//! dL/dz_S,j = (c_j − q_j · Σᵢ cᵢ) / τ with c_j = q_j · ∂L/∂q_j; each objective supplies its
//! loss term and c_j in closed form (so that a vanishing q_j never divides by zero).

// Lane loops index fixed-size accumulator arrays on purpose: that is what vectorises.
#![allow(clippy::needless_range_loop)]

use super::math::{LANES, exp, ln, max, sum_map, sum_map2};
use super::terms::{Fkl, Js, Rkl, SkewedFkl, SkewedRkl, Term, Tv};
use crate::config::{KdObjective, SparseStudent};

/// Constant parameters of a KD kernel call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KdParams {
    /// The objective.
    pub objective: KdObjective,
    /// 1/τ for the student.
    pub inv_tau_student: f32,
    /// 1/(τ·τ_T) for the teacher.
    pub inv_tau_teacher: f32,
    /// λ of the skewed objectives.
    pub skew_lambda: f32,
    /// α of adaptive KL.
    pub adaptive_alpha: f32,
    /// K of top-k mode (0 = full vocabulary).
    pub topk: usize,
    /// The student distribution in top-k mode.
    pub sparse_student: SparseStudent,
}

/// A teacher row: full logits, or the top-k entries (indices and logits or log-probs).
#[derive(Debug, Clone, Copy)]
pub enum TeacherRow<'a> {
    /// Logits over the whole vocabulary.
    Full(&'a [f32]),
    /// K (index, value) pairs.
    Sparse {
        /// Vocabulary indices.
        indices: &'a [u32],
        /// Logits or log-probs at those indices.
        values: &'a [f32],
    },
}

/// What one row contributes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RowStats {
    /// The per-row loss (before normalisation).
    pub loss: f32,
    /// Σ min(p, q).
    pub acceptance: f32,
    /// argmax q == argmax p.
    pub top1: bool,
    /// The row held NaN or +∞ and was skipped.
    pub nonfinite: bool,
}

/// Row-sized work buffers, reused across rows by one thread.
#[derive(Debug, Default)]
pub struct Scratch {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    s: Vec<f32>,
    t: Vec<f32>,
    d: Vec<f32>,
    terms: Vec<f32>,
    mins: Vec<f32>,
    idx: Vec<u32>,
    pairs: Vec<(f32, f32)>,
}

/// Scans a row in one pass: (max over entries > −∞, holds −∞, holds NaN or +∞).
#[inline(always)]
fn scan(xs: &[f32]) -> (f32, bool, bool) {
    let mut mx = [f32::NEG_INFINITY; LANES];
    let mut bad = [0f32; LANES];
    let mut neg = [0f32; LANES];
    let full = xs.len() / LANES * LANES;
    for b in (0..full).step_by(LANES) {
        let c: &[f32; LANES] = xs[b..b + LANES].try_into().expect("lane block");
        for l in 0..LANES {
            let x = c[l];
            mx[l] = if x > mx[l] { x } else { mx[l] };
            bad[l] = if x.is_nan() || x == f32::INFINITY {
                1.0
            } else {
                bad[l]
            };
            neg[l] = if x == f32::NEG_INFINITY { 1.0 } else { neg[l] };
        }
    }
    let (mut m, mut b, mut ng) = (f32::NEG_INFINITY, false, false);
    for l in 0..LANES {
        m = if mx[l] > m { mx[l] } else { m };
        b |= bad[l] > 0.0;
        ng |= neg[l] > 0.0;
    }
    for &x in &xs[full..] {
        m = if x > m { x } else { m };
        b |= x.is_nan() || x == f32::INFINITY;
        ng |= x == f32::NEG_INFINITY;
    }
    (m, ng, b)
}

/// First index of the maximum.
#[inline(always)]
fn argmax(xs: &[f32]) -> usize {
    let m = max(xs);
    xs.iter().position(|x| *x == m).unwrap_or(0)
}

/// `(max, ln Σ exp((x − max)·inv_t))`: log q_i = (x_i − max)·inv_t − lse.
#[inline(always)]
fn log_sum_exp(xs: &[f32], max: f32, inv_t: f32) -> f32 {
    ln(sum_map(xs, |x| exp((x - max) * inv_t)))
}

/// Sums of one objective pass.
#[derive(Default, Clone, Copy)]
struct PassSums {
    loss: f32,
    c: f32,
    acceptance: f32,
}

/// Shifts and log-normalisers: log q_i = (zs_i − ms)·is − ls, log p_i = (zt_i − mt)·it − lt.
#[derive(Clone, Copy)]
struct Norms {
    ms: f32,
    ls: f32,
    is: f32,
    mt: f32,
    lt: f32,
    it: f32,
}

/// One pass over aligned student/teacher values computing p, q, the loss terms and c; stores
/// q in `q_out`, c in `c_out`, the loss terms in `t_out`, min(p, q) in `m_out` and, with
/// `STORE`, p in `p_out` and lq − lp in `d_out` (adaptive KL). The element loop has no
/// loop-carried dependence, so it vectorises; the three sums follow in lane-parallel passes.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn objective_pass<T: Term, const STORE: bool>(
    zs: &[f32],
    zt: &[f32],
    k: Norms,
    lam: f32,
    out: &mut PassBuffers<'_>,
) -> PassSums {
    let n = zs.len();
    let PassBuffers { q, c, t, m, p, d } = out;
    let (q, c, t, m) = (&mut q[..n], &mut c[..n], &mut t[..n], &mut m[..n]);
    let (zs, zt) = (&zs[..n], &zt[..n]);
    for i in 0..n {
        let lq = (zs[i] - k.ms) * k.is - k.ls;
        let lp = (zt[i] - k.mt) * k.it - k.lt;
        let (pi, qi) = (exp(lp), exp(lq));
        let (term, ci) = T::term(lam, pi, qi, lp, lq);
        q[i] = qi;
        c[i] = ci;
        t[i] = term;
        m[i] = if pi < qi { pi } else { qi };
    }
    if STORE {
        let (p, d) = (&mut p[..n], &mut d[..n]);
        for i in 0..n {
            let lq = (zs[i] - k.ms) * k.is - k.ls;
            let lp = (zt[i] - k.mt) * k.it - k.lt;
            p[i] = exp(lp);
            d[i] = if q[i] > 0.0 { lq - lp } else { 0.0 };
        }
    }
    PassSums {
        loss: sum_map(t, |x| x),
        c: sum_map(c, |x| x),
        acceptance: sum_map(m, |x| x),
    }
}

/// The row-sized outputs of an objective pass.
struct PassBuffers<'a> {
    q: &'a mut [f32],
    c: &'a mut [f32],
    t: &'a mut [f32],
    m: &'a mut [f32],
    p: &'a mut [f32],
    d: &'a mut [f32],
}

/// [`objective_pass`] specialised for each objective (one loop per objective).
#[inline(always)]
fn run_objective(
    obj: KdObjective,
    lam: f32,
    zs: &[f32],
    zt: &[f32],
    k: Norms,
    out: &mut PassBuffers<'_>,
) -> PassSums {
    macro_rules! go {
        ($t:ty) => {
            objective_pass::<$t, false>(zs, zt, k, lam, out)
        };
    }
    match obj {
        KdObjective::ForwardKl | KdObjective::AdaptiveKl => go!(Fkl),
        KdObjective::ReverseKl => go!(Rkl),
        KdObjective::SkewedForwardKl => go!(SkewedFkl),
        KdObjective::SkewedReverseKl => go!(SkewedRkl),
        KdObjective::JsDivergence => go!(Js),
        KdObjective::TvDistance => go!(Tv),
    }
}

/// Adaptive-KL weights (w_head, w_tail) from p and |p − q| (Wu et al. 2024): the tail is the
/// ascending prefix of p whose cumulative mass is ≤ α. Found by quickselect on the mass
/// instead of a full sort.
fn adaptive_weights(pairs: &mut [(f32, f32)], alpha: f32) -> (f32, f32) {
    let total_gap: f32 = pairs.iter().map(|(_, g)| *g).sum();
    let mut budget = alpha;
    let mut g_tail = 0.0f32;
    let mut lo = 0;
    let mut hi = pairs.len();
    // Invariant: pairs[..lo] are in the tail, pairs[hi..] are in the head.
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let slice = &mut pairs[lo..hi];
        let k = mid - lo;
        slice.select_nth_unstable_by(k, |a, b| a.0.total_cmp(&b.0));
        let mass: f32 = slice[..k].iter().map(|(p, _)| *p).sum();
        if mass + slice[k].0 <= budget {
            // Everything up to and including the pivot fits in the tail.
            budget -= mass + slice[k].0;
            g_tail += slice[..=k].iter().map(|(_, g)| *g).sum::<f32>();
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let g_head = (total_gap - g_tail).max(0.0);
    let denom = g_head + g_tail;
    if denom > 0.0 {
        (g_head / denom, g_tail / denom)
    } else {
        (0.5, 0.5)
    }
}

/// KD on one row. `grad`, when given, receives `scale · dL_row/dz_S` (zeros where the row
/// does not contribute). `student` is the full-vocabulary row.
#[inline(always)]
pub fn kd_row(
    params: &KdParams,
    student: &[f32],
    teacher: TeacherRow<'_>,
    scratch: &mut Scratch,
    grad: Option<&mut [f32]>,
    scale: f32,
) -> RowStats {
    let (ms_full, s_neg_inf, s_bad) = scan(student);
    let (_, t_neg_inf, t_bad) = scan(match teacher {
        TeacherRow::Full(t) => t,
        TeacherRow::Sparse { values, .. } => values,
    });
    if s_bad || t_bad {
        if let Some(g) = grad {
            g.fill(0.0);
        }
        return RowStats {
            nonfinite: true,
            ..RowStats::default()
        };
    }

    // Gather the aligned (student, teacher) values the distributions are built from.
    let full_mode = params.topk == 0 && matches!(teacher, TeacherRow::Full(_));
    let masked = s_neg_inf || t_neg_inf;
    let Scratch { s, t, idx, .. } = scratch;
    let (zs, zt) = aligned(
        params,
        student,
        teacher,
        (full_mode, masked),
        (s, t, &mut *idx),
    );
    let sparse = !full_mode;
    let n = zs.len();
    let ms = if sparse || masked { max(zs) } else { ms_full };
    let mt = max(zt);
    if ms == f32::NEG_INFINITY || mt == f32::NEG_INFINITY {
        // Empty support: nothing to compare.
        if let Some(g) = grad {
            g.fill(0.0);
        }
        return RowStats::default();
    }
    let (is, it) = (params.inv_tau_student, params.inv_tau_teacher);
    let full_lse = sparse && params.sparse_student == SparseStudent::FullLogsumexp;
    // log q_i = (z_i − ms)·is − ls, over K (renormalised) or over the whole row.
    let (ms, ls) = if full_lse {
        (ms_full, log_sum_exp(student, ms_full, is))
    } else {
        (ms, log_sum_exp(zs, ms, is))
    };
    let lt = log_sum_exp(zt, mt, it);

    let top1 = argmax(zs) == argmax(zt);
    let norms = Norms {
        ms,
        ls,
        is,
        mt,
        lt,
        it,
    };
    let Scratch {
        a,
        b,
        c,
        d,
        terms,
        mins,
        pairs,
        ..
    } = scratch;
    for v in [&mut *a, &mut *b, &mut *c, &mut *d, &mut *terms, &mut *mins] {
        if v.len() < n {
            v.resize(n, 0.0);
        }
    }
    let mut bufs = PassBuffers {
        q: a,
        c,
        t: terms,
        m: mins,
        p: b,
        d,
    };
    let (loss, c_sum, acceptance) = if params.objective == KdObjective::AdaptiveKl {
        adaptive_pass(zs, zt, norms, bufs, pairs, params.adaptive_alpha)
    } else {
        let sums = run_objective(
            params.objective,
            params.skew_lambda,
            zs,
            zt,
            norms,
            &mut bufs,
        );
        (sums.loss, sums.c, sums.acceptance)
    };
    let (a, c) = (&scratch.a[..n], &scratch.c[..n]);

    if let Some(g) = grad {
        let support = if sparse {
            Some((&idx[..], full_lse))
        } else {
            None
        };
        write_grad(g, student, (a, c, c_sum), support, (scale * is, ms, is, ls));
    }
    RowStats {
        loss,
        acceptance,
        top1,
        nonfinite: false,
    }
}

/// The aligned (student, teacher) values the distributions are built from: the whole row, or
/// the teacher's top-k / sparse entries gathered into `s`, `t` (their vocabulary ids in
/// `idx`). Entries −∞ on either side leave the support of both.
#[inline(always)]
fn aligned<'a>(
    params: &KdParams,
    student: &'a [f32],
    teacher: TeacherRow<'a>,
    (full_mode, masked): (bool, bool),
    (s, t, idx): (&'a mut Vec<f32>, &'a mut Vec<f32>, &mut Vec<u32>),
) -> (&'a [f32], &'a [f32]) {
    match teacher {
        TeacherRow::Full(tf) if full_mode => {
            if masked {
                // Entries −∞ on either side leave the support of both.
                s.clear();
                t.clear();
                for (a, b) in student.iter().zip(tf) {
                    let out = *a == f32::NEG_INFINITY || *b == f32::NEG_INFINITY;
                    s.push(if out { f32::NEG_INFINITY } else { *a });
                    t.push(if out { f32::NEG_INFINITY } else { *b });
                }
                (&s[..], &t[..])
            } else {
                (student, tf)
            }
        }
        TeacherRow::Full(tf) => {
            let k = params.topk.min(tf.len());
            idx.clear();
            idx.extend(0..tf.len() as u32);
            if k < tf.len() {
                idx.select_nth_unstable_by(k, |a, b| tf[*b as usize].total_cmp(&tf[*a as usize]));
                idx.truncate(k);
            }
            idx.sort_unstable_by(|a, b| tf[*b as usize].total_cmp(&tf[*a as usize]).then(a.cmp(b)));
            gather(student, tf, idx, s, t);
            (&s[..], &t[..])
        }
        TeacherRow::Sparse { indices, values } => {
            idx.clear();
            idx.extend_from_slice(indices);
            s.clear();
            t.clear();
            for (i, v) in indices.iter().zip(values) {
                let a = student[*i as usize];
                let out = a == f32::NEG_INFINITY || *v == f32::NEG_INFINITY;
                s.push(if out { f32::NEG_INFINITY } else { a });
                t.push(if out { f32::NEG_INFINITY } else { *v });
            }
            (&s[..], &t[..])
        }
    }
}

/// Adaptive KL: the FKL pass (c = −p) plus p and lq − lp for the RKL half, mixed by the
/// adaptive weights; `(loss, Σc, acceptance)` with c in `bufs.c`.
#[inline(always)]
fn adaptive_pass(
    zs: &[f32],
    zt: &[f32],
    norms: Norms,
    mut bufs: PassBuffers<'_>,
    pairs: &mut Vec<(f32, f32)>,
    alpha: f32,
) -> (f32, f32, f32) {
    let n = zs.len();
    let sums = objective_pass::<Fkl, true>(zs, zt, norms, 0.0, &mut bufs);
    let PassBuffers { q, c, p, d, .. } = bufs;
    let (q, c, p, d) = (&q[..n], &mut c[..n], &p[..n], &d[..n]);
    let fkl = sums.loss;
    let rkl = sum_map2(q, d, |q, d| q * d);
    pairs.clear();
    pairs.extend(p.iter().zip(q).map(|(p, q)| (*p, (p - q).abs())));
    let (wh, wt) = adaptive_weights(pairs, alpha);
    for i in 0..n {
        let rc = if q[i] > 0.0 { q[i] * (d[i] + 1.0) } else { 0.0 };
        c[i] = wh * (-p[i]) + wt * rc;
    }
    (wh * fkl + wt * rkl, sum_map(c, |x| x), sums.acceptance)
}

/// Writes `dL_row/dz_S · f` into `g` (`f` = scale/τ) from q (over the support) and c:
/// over the whole row, or over the support's vocabulary ids (`support`: with the full
/// row's log-sum-exp when the student is normalised over the whole vocabulary).
#[inline(always)]
fn write_grad(
    g: &mut [f32],
    student: &[f32],
    (q, c, c_sum): (&[f32], &[f32], f32),
    support: Option<(&[u32], bool)>,
    (f, ms, is, ls): (f32, f32, f32, f32),
) {
    match support {
        None => {
            for ((g, q), c) in g.iter_mut().zip(q.iter()).zip(c.iter()) {
                *g = f * (c - q * c_sum);
            }
        }
        Some((idx, true)) => {
            // dL/dz_j = (1_{j∈K} c_j − Q_j·Σc)/τ with Q the full-vocabulary softmax.
            for (g, z) in g.iter_mut().zip(student) {
                *g = -f * c_sum * exp((z - ms) * is - ls);
            }
            for (k, i) in idx.iter().enumerate() {
                g[*i as usize] += f * c[k];
            }
        }
        Some((idx, false)) => {
            g.fill(0.0);
            for (k, i) in idx.iter().enumerate() {
                g[*i as usize] = f * (c[k] - q[k] * c_sum);
            }
        }
    }
}

fn gather(student: &[f32], teacher: &[f32], idx: &[u32], s: &mut Vec<f32>, t: &mut Vec<f32>) {
    s.clear();
    t.clear();
    for i in idx {
        let (a, b) = (student[*i as usize], teacher[*i as usize]);
        let out = a == f32::NEG_INFINITY || b == f32::NEG_INFINITY;
        s.push(if out { f32::NEG_INFINITY } else { a });
        t.push(if out { f32::NEG_INFINITY } else { b });
    }
}

/// [`ce_row`] with the gradient written over the logits (the same arithmetic, so the same
/// bits as `ce_row` into a separate buffer).
#[inline(always)]
pub fn ce_row_in_place(z: &mut [f32], target: usize, scale: f32) -> Option<f32> {
    let (m, _, bad) = scan(z);
    if bad || m == f32::NEG_INFINITY {
        z.fill(0.0);
        return None;
    }
    let picked = z[target];
    // The exponentials are written in place and summed from there: one `exp` per entry
    // instead of two, the same values in the same order as `ce_row`.
    for x in z.iter_mut() {
        *x = exp(*x - m);
    }
    let sum = sum_map(z, |e| e);
    let loss = m + ln(sum) - picked;
    let inv = 1.0 / sum;
    for x in z.iter_mut() {
        *x = scale * *x * inv;
    }
    z[target] -= scale;
    Some(loss)
}

/// Cross-entropy of one row against `target`; `grad` receives `scale · (softmax − onehot)`.
/// Returns `None` when the row holds NaN or +∞ (then the gradient row is zero).
#[inline(always)]
pub fn ce_row(logits: &[f32], target: usize, grad: Option<&mut [f32]>, scale: f32) -> Option<f32> {
    let (m, _, bad) = scan(logits);
    if bad || m == f32::NEG_INFINITY {
        if let Some(g) = grad {
            g.fill(0.0);
        }
        return None;
    }
    let sum = sum_map(logits, |x| exp(x - m));
    let lse = m + ln(sum);
    if let Some(g) = grad {
        let inv = 1.0 / sum;
        for (g, z) in g.iter_mut().zip(logits) {
            *g = scale * exp(z - m) * inv;
        }
        g[target] -= scale;
    }
    Some(lse - logits[target])
}

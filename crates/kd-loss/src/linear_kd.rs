//! KD (and optionally CE) fused with the student's LM head (`logits = hidden · Wᵀ`), in blocks
//! of rows: per block the logits are computed by one GEMM, each row's KD gradient (plus its CE
//! gradient) is written beside it, and the block's gradient is multiplied back into the
//! gradients of the hidden states (and of `W` when it trains) before the next block, all in
//! the forward pass. Nothing of `[rows, vocab]` outlives a block and nothing is kept for
//! autodiff beyond `[rows, hidden]` (and `[vocab, hidden]` when `W` trains): the backward
//! pass only scales the stored gradients.
//!
//! Both top-k mode (the teacher's `[rows, k]` indices and values, ROLL's renormalised
//! semantics or `full_logsumexp`) and full-vocabulary mode (`[rows, vocab]` teacher logits),
//! every objective of [`crate::KdObjective`], with the semantics of [`crate::kd_loss`]: same
//! loss, gradients and statistics as `kd_loss(hidden · Wᵀ, …)` (+ `cross_entropy`).

use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, Flex, backend_extension};
use burn::tensor::{DType, Tensor};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::ops::{Backward, OpsKind};
use burn_flex::FlexTensor;
use rayon::prelude::*;

use crate::config::KdConfig;
use crate::config::SparseStudent;
use crate::error::{LossError, Result};
use crate::fused::{
    FusedTeacher, f32_view, flex, grad_or_placeholder, i64_view, stats_from_values, stats_values,
};
use crate::kernels::{self, BatchStats, KdParams, Scratch, TeacherRow, TeacherRows, math};
use crate::linear::{StoredGradsBackward, hidden_grad_block, logits_block, weight_grad_block};
use crate::loss::{LossStats, Teacher, check_normalizer, check_targets, on_flex};

/// Largest logits block in elements (16 Mi f32 = 64 MiB; the block's gradient takes as
/// much again).
const BLOCK_ELEMENTS: usize = 1 << 24;

/// The non-tensor inputs of a fused call.
#[derive(Debug, Clone)]
pub struct LinearKdJob {
    /// The KD kernel parameters.
    pub kd: KdParams,
    /// Rows that count for KD.
    pub mask: Vec<bool>,
    /// Multiplier of the summed KD loss (weight / normaliser, × τ² when asked).
    pub kd_scale: f32,
    /// CE targets per row (negative = ignored); empty = no CE term.
    pub targets: Vec<i64>,
    /// Multiplier of the summed CE loss (weight / normaliser).
    pub ce_scale: f32,
}

/// The fused LM head + KD (+ CE) as a Burn backend extension (CPU backend and autodiff).
#[backend_extension(Flex, Autodiff)]
pub trait LinearKdBackend: Backend {
    /// Returns `(loss [1], stats [10], d hidden [rows, hidden] or [1], d weight [vocab,
    /// hidden] or [1])`; stats are the KD `[loss_sum, acceptance_sum, top1, counted,
    /// nonfinite]` then the CE `[loss_sum, 0, 0, counted, nonfinite]`.
    fn linear_kd(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        #[extension_type] teacher: FusedTeacher<Self>,
        job: LinearKdJob,
        grad_hidden: bool,
        grad_weight: bool,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );
}

/// Host results: KD and CE statistics and the requested gradients.
type HostOut = (BatchStats, BatchStats, Option<Vec<f32>>, Option<Vec<f32>>);

/// The host computation: the gathered path where it applies, else blocks of `block` rows.
#[allow(clippy::too_many_arguments)]
fn host_linear_kd(
    h: &[f32],
    w: &[f32],
    dims: (usize, usize, usize),
    teacher: TeacherRows<'_>,
    job: &LinearKdJob,
    grad_hidden: bool,
    grad_weight: bool,
    block: usize,
) -> HostOut {
    let (rows, dim, vocab) = dims;
    let with_ce = !job.targets.is_empty();
    // ROLL's top-k semantics without CE: both distributions live on the teacher's K entries,
    // so only the student's logits there are needed (K dot products per row, no GEMM over the
    // vocabulary).
    if let TeacherRows::Sparse { indices, values, k } = teacher
        && !with_ce
        && job.kd.sparse_student == SparseStudent::Renormalized
    {
        return host_gathered_kd(
            h,
            w,
            (rows, dim, vocab),
            (indices, values, k),
            job,
            grad_hidden,
            grad_weight,
        );
    }
    host_blocked_kd(h, w, dims, teacher, job, grad_hidden, grad_weight, block)
}

/// The host computation in blocks of `block` rows: logits by GEMM, the row kernels, the
/// gradients by GEMM.
#[allow(clippy::too_many_arguments)]
fn host_blocked_kd(
    h: &[f32],
    w: &[f32],
    (rows, dim, vocab): (usize, usize, usize),
    teacher: TeacherRows<'_>,
    job: &LinearKdJob,
    grad_hidden: bool,
    grad_weight: bool,
    block: usize,
) -> HostOut {
    let want_grad = grad_hidden || grad_weight;
    let with_ce = !job.targets.is_empty();
    let mut dh = grad_hidden.then(|| vec![0f32; rows * dim]);
    let mut dw = grad_weight.then(|| vec![0f32; vocab * dim]);
    let block = block.clamp(1, rows.max(1));
    let mut z: Vec<f32> = Vec::with_capacity(block * vocab);
    let mut g: Vec<f32> = if want_grad {
        vec![0f32; block * vocab]
    } else {
        Vec::new()
    };
    let (mut kd_stats, mut ce_stats) = (BatchStats::default(), BatchStats::default());
    let mut per_row = vec![(BatchStats::default(), BatchStats::default()); block];
    for r0 in (0..rows).step_by(block) {
        let n = block.min(rows - r0);
        let hb = &h[r0 * dim..(r0 + n) * dim];
        logits_block(&mut z, hb, w, (n, dim, vocab));
        let one = |scratch: &mut Scratch,
                   i: usize,
                   zr: &mut [f32],
                   mut gr: Option<&mut [f32]>|
         -> (BatchStats, BatchStats) {
            let r = r0 + i;
            let mut kd = BatchStats::default();
            let mut ce = BatchStats::default();
            if job.mask[r] {
                let row = teacher.row(r, vocab);
                let stats =
                    kernels::kd_row(&job.kd, zr, row, scratch, gr.as_deref_mut(), job.kd_scale);
                kd = kd.add(stats);
            } else if let Some(gr) = gr.as_deref_mut() {
                gr.fill(0.0);
            }
            if with_ce && job.targets[r] >= 0 {
                let target = job.targets[r] as usize;
                let loss = match gr {
                    // The CE gradient over the logits, added to the KD gradient.
                    Some(gr) => {
                        let loss = kernels::ce_row_in_place(zr, target, job.ce_scale);
                        for (a, b) in gr.iter_mut().zip(zr.iter()) {
                            *a += *b;
                        }
                        loss
                    }
                    None => kernels::ce_row(zr, target, None, job.ce_scale),
                };
                ce = kernels::ce_stats(loss);
            }
            (kd, ce)
        };
        // Per-row results are summed in row order, so the loss does not depend on how rayon
        // splits the work.
        let out = &mut per_row[..n];
        if want_grad {
            z.par_chunks_mut(vocab)
                .zip(g[..n * vocab].par_chunks_mut(vocab))
                .zip(out.par_iter_mut())
                .enumerate()
                .for_each_init(Scratch::default, |scratch, (i, ((zr, gr), o))| {
                    *o = one(scratch, i, zr, Some(gr))
                });
        } else {
            z.par_chunks_mut(vocab)
                .zip(out.par_iter_mut())
                .enumerate()
                .for_each_init(Scratch::default, |scratch, (i, (zr, o))| {
                    *o = one(scratch, i, zr, None)
                });
        }
        for (k, c) in out.iter() {
            kd_stats = kd_stats.merge(*k);
            ce_stats = ce_stats.merge(*c);
        }
        if let Some(dh) = dh.as_mut() {
            hidden_grad_block(&mut dh[r0 * dim..(r0 + n) * dim], &g, w, (n, dim, vocab));
        }
        if let Some(dw) = dw.as_mut() {
            weight_grad_block(dw, &g, hb, (n, dim, vocab), r0 > 0);
        }
    }
    (kd_stats, ce_stats, dh, dw)
}

/// Top-k KD with the student renormalised on the teacher's support: per row, the logits at the
/// K indices are `h · W[idx]ᵀ`, the kernel's gradient w.r.t. them goes back as
/// `dh = Σⱼ gⱼ · W[idxⱼ]` and `dW[idxⱼ] += gⱼ · h`.
fn host_gathered_kd(
    h: &[f32],
    w: &[f32],
    (rows, dim, vocab): (usize, usize, usize),
    (indices, values, k): (&[u32], &[f32], usize),
    job: &LinearKdJob,
    grad_hidden: bool,
    grad_weight: bool,
) -> HostOut {
    let want_grad = grad_hidden || grad_weight;
    // The student row handed to the kernel is the K gathered logits: the teacher's indices
    // into it are 0..K.
    let local: Vec<u32> = (0..k as u32).collect();
    let row_of = |i: u32| {
        let i = i as usize;
        assert!(
            i < vocab,
            "teacher index {i} outside the vocabulary of {vocab}"
        );
        &w[i * dim..(i + 1) * dim]
    };
    let per_row: Vec<(BatchStats, Vec<f32>)> = (0..rows)
        .into_par_iter()
        .map_init(Scratch::default, |scratch, r| {
            if !job.mask[r] {
                return (BatchStats::default(), Vec::new());
            }
            let hr = &h[r * dim..(r + 1) * dim];
            let idx = &indices[r * k..(r + 1) * k];
            let z: Vec<f32> = idx
                .iter()
                .map(|i| math::sum_map2(hr, row_of(*i), |a, b| a * b))
                .collect();
            let mut g = if want_grad { vec![0f32; k] } else { Vec::new() };
            let stats = kernels::kd_row(
                &job.kd,
                &z,
                TeacherRow::Sparse {
                    indices: &local,
                    values: &values[r * k..(r + 1) * k],
                },
                scratch,
                want_grad.then_some(g.as_mut_slice()),
                job.kd_scale,
            );
            (BatchStats::default().add(stats), g)
        })
        .collect();
    let kd_stats = per_row
        .iter()
        .fold(BatchStats::default(), |a, (s, _)| a.merge(*s));
    let dh = grad_hidden.then(|| {
        let mut dh = vec![0f32; rows * dim];
        dh.par_chunks_mut(dim).enumerate().for_each(|(r, out)| {
            let g = &per_row[r].1;
            for (j, gj) in g.iter().enumerate() {
                if *gj != 0.0 {
                    for (o, wv) in out.iter_mut().zip(row_of(indices[r * k + j])) {
                        *o += gj * wv;
                    }
                }
            }
        });
        dh
    });
    let dw = grad_weight.then(|| {
        let mut dw = vec![0f32; vocab * dim];
        for (r, (_, g)) in per_row.iter().enumerate() {
            let hr = &h[r * dim..(r + 1) * dim];
            for (j, gj) in g.iter().enumerate() {
                let i = indices[r * k + j] as usize;
                for (o, hv) in dw[i * dim..(i + 1) * dim].iter_mut().zip(hr) {
                    *o += gj * hv;
                }
            }
        }
        dw
    });
    (kd_stats, BatchStats::default(), dh, dw)
}

impl LinearKdBackend for Flex {
    fn linear_kd(
        hidden: FlexTensor,
        weight: FlexTensor,
        teacher: FusedTeacher<Self>,
        job: LinearKdJob,
        grad_hidden: bool,
        grad_weight: bool,
    ) -> (FlexTensor, FlexTensor, FlexTensor, FlexTensor) {
        let hshape = hidden.layout().shape().to_vec();
        let wshape = weight.layout().shape().to_vec();
        let (rows, dim, vocab) = (hshape[0], hshape[1], wshape[0]);
        let h = f32_view(&hidden);
        let w = f32_view(&weight);
        let block = (BLOCK_ELEMENTS / vocab.max(1)).max(1);
        let (kd, ce, dh, dw) = match &teacher {
            FusedTeacher::Full(t) => {
                let t = f32_view(t);
                host_linear_kd(
                    &h,
                    &w,
                    (rows, dim, vocab),
                    TeacherRows::Full(&t),
                    &job,
                    grad_hidden,
                    grad_weight,
                    block,
                )
            }
            FusedTeacher::Sparse(idx, values) => {
                let k = *values.layout().shape().to_vec().last().expect("2-D values");
                let values = f32_view(values);
                let indices = i64_view(idx);
                host_linear_kd(
                    &h,
                    &w,
                    (rows, dim, vocab),
                    TeacherRows::Sparse {
                        indices: &indices,
                        values: &values,
                        k,
                    },
                    &job,
                    grad_hidden,
                    grad_weight,
                    block,
                )
            }
            FusedTeacher::None(_) => unreachable!("linear_kd always has a teacher"),
        };
        let loss = (kd.loss_sum * job.kd_scale as f64 + ce.loss_sum * job.ce_scale as f64) as f32;
        let mut stats = stats_values(&kd).to_vec();
        stats.extend(stats_values(&ce));
        (
            flex(vec![loss], vec![1]),
            flex(stats, vec![10]),
            grad_or_placeholder(dh, hshape),
            grad_or_placeholder(dw, wshape),
        )
    }
}

impl<B: Backend + LinearKdBackend, C: CheckpointStrategy> LinearKdBackend for Autodiff<B, C> {
    fn linear_kd(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        teacher: FusedTeacher<Self>,
        job: LinearKdJob,
        _grad_hidden: bool,
        _grad_weight: bool,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let inner_teacher = match teacher {
            FusedTeacher::None(t) => FusedTeacher::None(t.into_primitive()),
            FusedTeacher::Full(t) => FusedTeacher::Full(t.into_primitive()),
            FusedTeacher::Sparse(i, v) => FusedTeacher::Sparse(i, v.into_primitive()),
        };
        let (track_h, track_w) = (hidden.is_tracked(), weight.is_tracked());
        let guards = [hidden.node(), weight.node()];
        let (loss, stats, dh, dw) = B::linear_kd(
            hidden.into_primitive(),
            weight.into_primitive(),
            inner_teacher,
            job,
            track_h,
            track_w,
        );
        let loss = match StoredGradsBackward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((dh, dw), loss),
            OpsKind::UnTracked(prep) => prep.finish(loss),
        };
        let stats = <Self as AutodiffBackend>::from_inner(stats);
        (loss, stats.clone(), stats.clone(), stats)
    }
}

/// What [`linear_kd`] returns.
#[derive(Debug, Clone)]
pub struct LinearKdOutput {
    /// `kd_weight · KD + ce_weight · CE` `[1]`, each a sum over counted rows divided by the
    /// normaliser; differentiable w.r.t. the hidden states and the LM head.
    pub loss: Tensor<1>,
    /// KD statistics (loss sum unweighted, α, top-1).
    pub kd: LossStats,
    /// CE statistics (loss sum unweighted), when CE was asked for.
    pub ce: Option<LossStats>,
}

/// The CE term of a [`linear_kd`] call.
#[derive(Debug, Clone, Copy)]
pub struct LinearCe<'a> {
    /// Next-token target per row (negative = ignored).
    pub targets: &'a [i64],
    /// Weight of the CE term.
    pub weight: f32,
}

fn stats_of(v: &[f32]) -> LossStats {
    LossStats::from_batch(stats_from_values(v))
}

/// KD between the student's logits `hidden · Wᵀ` and the teacher, fused with the LM head (see
/// the module docs), plus CE on the same logits when `ce` is given:
/// `kd_weight · Σ_{mask} KD / normalizer + ce.weight · Σ_{targets ≥ 0} CE / normalizer`.
///
/// - `hidden`: `[rows, hidden]`, rows aligned with the teacher's (after the next-token shift);
/// - `weight`: the LM head `[vocab, hidden]`, frozen or trained;
/// - `teacher`: full logits `[rows, vocab]` or top-k `[rows, k]` (as for [`kd_loss`](crate::kd_loss); top-k
///   indices distinct within a row, as a teacher's are).
///
/// In top-k mode with ROLL's renormalised student and no CE, only the student's logits at the
/// teacher's K indices are computed (K dot products per row instead of a GEMM over the
/// vocabulary).
///
/// On the CPU backend in f32 the logits never exist beyond one block of rows and the
/// gradients are computed during the forward pass; elsewhere it runs
/// [`linear_kd_chunked`](crate::linear_kd_chunked): `kd_loss(hidden · Wᵀ)` (+ `cross_entropy`)
/// chunk by chunk in Burn's generic operations. Both give the same loss, gradients and
/// statistics.
#[allow(clippy::too_many_arguments)] // the arguments of kd_loss, plus the two weights and CE
pub fn linear_kd(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    teacher: Teacher,
    mask: &[bool],
    normalizer: f32,
    config: &KdConfig,
    kd_weight: f32,
    ce: Option<LinearCe<'_>>,
) -> Result<LinearKdOutput> {
    check_linear_kd(
        &hidden,
        &weight,
        &teacher,
        mask,
        normalizer,
        config,
        ce.as_ref(),
    )?;
    let [vocab, _] = weight.dims();
    let fused =
        on_flex(&hidden.device()) && hidden.dtype() == DType::F32 && weight.dtype() == DType::F32;
    if !fused {
        return crate::chunked::linear_kd_chunked(
            hidden,
            weight,
            teacher,
            mask,
            normalizer,
            config,
            kd_weight,
            ce,
            crate::chunked::chunk_rows(vocab),
        );
    }
    let job = LinearKdJob {
        kd: config.kernel_params(),
        mask: mask.to_vec(),
        kd_scale: kd_weight * config.extra_scale() / normalizer,
        targets: ce.map(|c| c.targets.to_vec()).unwrap_or_default(),
        ce_scale: ce.map_or(0.0, |c| c.weight / normalizer),
    };
    let teacher = match teacher {
        Teacher::Logits(t) => FusedTeacher::Full(t.without_autodiff().into_dispatch()),
        Teacher::TopK { indices, values } => FusedTeacher::Sparse(
            indices.into_dispatch(),
            values.without_autodiff().into_dispatch(),
        ),
    };
    let (loss, stats, _, _) = <burn::backend::Dispatch as LinearKdBackend>::linear_kd(
        hidden.into_dispatch(),
        weight.into_dispatch(),
        teacher,
        job,
        false,
        false,
    );
    let loss = Tensor::<1>::from_dispatch(loss);
    let stats: Vec<f32> = Tensor::<1>::from_dispatch(stats)
        .into_data()
        .try_into_vec_as::<f32>()
        .expect("f32 stats");
    Ok(LinearKdOutput {
        loss,
        kd: stats_of(&stats[..5]),
        ce: ce.map(|_| stats_of(&stats[5..])),
    })
}

/// The checks [`linear_kd`] and [`linear_kd_chunked`](crate::linear_kd_chunked) make before
/// any work: shapes of the head, mask, targets and teacher, top-k indices in range.
pub(crate) fn check_linear_kd(
    hidden: &Tensor<2>,
    weight: &Tensor<2>,
    teacher: &Teacher,
    mask: &[bool],
    normalizer: f32,
    config: &KdConfig,
    ce: Option<&LinearCe<'_>>,
) -> Result<()> {
    config.validate()?;
    check_normalizer(normalizer)?;
    crate::chunked::check_head(hidden, weight)?;
    let [rows, _] = hidden.dims();
    let [vocab, _] = weight.dims();
    if mask.len() != rows {
        return Err(LossError::Shape(format!(
            "mask has {} entries for {rows} rows of hidden states",
            mask.len()
        )));
    }
    if let Some(c) = ce {
        check_targets(c.targets, rows, vocab, "hidden states")?;
    }
    let teacher_ok = match teacher {
        Teacher::Logits(t) => t.dims() == [rows, vocab],
        Teacher::TopK { indices, values } => {
            indices.dims() == values.dims() && indices.dims()[0] == rows
        }
    };
    if !teacher_ok {
        return Err(LossError::Shape(format!(
            "teacher rows do not match {rows} hidden rows over a vocabulary of {vocab}"
        )));
    }
    if let Teacher::TopK { indices, .. } = teacher {
        let max = indices.clone().max().into_scalar::<i64>();
        let min = indices.clone().min().into_scalar::<i64>();
        if min < 0 || max >= vocab as i64 {
            return Err(LossError::Input(format!(
                "teacher top-k index out of range [{min}, {max}] for a student vocabulary of {vocab}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod gathered_tests;

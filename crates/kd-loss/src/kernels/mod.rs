//! Host kernels: whole batches of rows, in parallel (rayon), with AVX-512, AVX2 and baseline
//! builds of the row kernels chosen at run time (`kd_kernels::cpu::level`).

pub use kd_kernels::math;
pub mod row;
mod terms;

use rayon::prelude::*;

pub use row::{KdParams, RowStats, Scratch, TeacherRow};

/// Teacher rows of a batch.
#[derive(Debug, Clone, Copy)]
pub enum TeacherRows<'a> {
    /// `[rows, vocab]` logits.
    Full(&'a [f32]),
    /// `[rows, k]` indices and values (logits or log-probs).
    Sparse {
        /// Vocabulary indices, row-major.
        indices: &'a [u32],
        /// Values at those indices, row-major.
        values: &'a [f32],
        /// Entries per row.
        k: usize,
    },
}

impl<'a> TeacherRows<'a> {
    pub(crate) fn row(&self, r: usize, vocab: usize) -> TeacherRow<'a> {
        match *self {
            Self::Full(t) => TeacherRow::Full(&t[r * vocab..(r + 1) * vocab]),
            Self::Sparse { indices, values, k } => TeacherRow::Sparse {
                indices: &indices[r * k..(r + 1) * k],
                values: &values[r * k..(r + 1) * k],
            },
        }
    }
}

/// Sums over the rows of a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BatchStats {
    /// Σ of the per-row losses over counted rows (not normalised).
    pub loss_sum: f64,
    /// Σ acceptance over counted, finite rows.
    pub acceptance_sum: f64,
    /// Number of counted, finite rows whose argmaxes agree.
    pub top1: usize,
    /// Number of counted rows.
    pub counted: usize,
    /// Number of counted rows skipped for NaN/+∞.
    pub nonfinite: usize,
}

impl BatchStats {
    pub(crate) fn add(mut self, r: RowStats) -> Self {
        self.counted += 1;
        if r.nonfinite {
            self.nonfinite += 1;
        } else {
            self.loss_sum += r.loss as f64;
            self.acceptance_sum += r.acceptance as f64;
            self.top1 += r.top1 as usize;
        }
        self
    }

    pub(crate) fn merge(mut self, o: Self) -> Self {
        self.loss_sum += o.loss_sum;
        self.acceptance_sum += o.acceptance_sum;
        self.top1 += o.top1;
        self.counted += o.counted;
        self.nonfinite += o.nonfinite;
        self
    }
}

kd_kernels::dispatch! {
    /// [`row::kd_row`] built for `level`.
    fn kd_row_at(
        p: &KdParams,
        s: &[f32],
        t: TeacherRow<'_>,
        scratch: &mut Scratch,
        g: Option<&mut [f32]>,
        scale: f32,
    ) -> RowStats {
        row::kd_row(p, s, t, scratch, g, scale)
    }
}

pub(crate) fn kd_row(
    p: &KdParams,
    s: &[f32],
    t: TeacherRow<'_>,
    scratch: &mut Scratch,
    g: Option<&mut [f32]>,
    scale: f32,
) -> RowStats {
    kd_row_at(kd_kernels::cpu::level(), p, s, t, scratch, g, scale)
}

kd_kernels::dispatch! {
    /// [`row::ce_row`] built for `level`.
    fn ce_row_at(z: &[f32], target: usize, g: Option<&mut [f32]>, scale: f32) -> Option<f32> {
        row::ce_row(z, target, g, scale)
    }
}

pub(crate) fn ce_row(z: &[f32], target: usize, g: Option<&mut [f32]>, scale: f32) -> Option<f32> {
    ce_row_at(kd_kernels::cpu::level(), z, target, g, scale)
}

kd_kernels::dispatch! {
    /// [`row::ce_row_in_place`] built for `level`.
    fn ce_row_in_place_at(z: &mut [f32], target: usize, scale: f32) -> Option<f32> {
        row::ce_row_in_place(z, target, scale)
    }
}

pub(crate) fn ce_row_in_place(z: &mut [f32], target: usize, scale: f32) -> Option<f32> {
    ce_row_in_place_at(kd_kernels::cpu::level(), z, target, scale)
}

/// KD over a batch of rows. Rows with `mask[r] == false` contribute nothing (their gradient
/// rows are zeroed). `grad`, when given (`[rows, vocab]`), receives `scale · dL/dz_S`.
pub fn kd_rows(
    params: &KdParams,
    student: &[f32],
    vocab: usize,
    teacher: TeacherRows<'_>,
    mask: &[bool],
    scale: f32,
    grad: Option<&mut [f32]>,
) -> BatchStats {
    let rows = mask.len();
    debug_assert_eq!(student.len(), rows * vocab);
    let one = |scratch: &mut Scratch, r: usize, g: Option<&mut [f32]>| -> BatchStats {
        if !mask[r] {
            if let Some(g) = g {
                g.fill(0.0);
            }
            return BatchStats::default();
        }
        let s = &student[r * vocab..(r + 1) * vocab];
        BatchStats::default().add(kd_row(params, s, teacher.row(r, vocab), scratch, g, scale))
    };
    // Per-row results are summed in row order afterwards, so the loss does not depend on
    // how rayon splits the work.
    let mut per_row = vec![BatchStats::default(); rows];
    match grad {
        Some(grad) => grad
            .par_chunks_mut(vocab)
            .zip(per_row.par_iter_mut())
            .enumerate()
            .for_each_init(Scratch::default, |scratch, (r, (g, out))| {
                *out = one(scratch, r, Some(g))
            }),
        None => per_row
            .par_iter_mut()
            .enumerate()
            .for_each_init(Scratch::default, |scratch, (r, out)| {
                *out = one(scratch, r, None)
            }),
    }
    per_row
        .into_iter()
        .fold(BatchStats::default(), BatchStats::merge)
}

/// The statistics of one counted cross-entropy row (`None` = non-finite logits).
pub(crate) fn ce_stats(loss: Option<f32>) -> BatchStats {
    let row = match loss {
        Some(loss) => RowStats {
            loss,
            ..RowStats::default()
        },
        None => RowStats {
            nonfinite: true,
            ..RowStats::default()
        },
    };
    BatchStats::default().add(row)
}

/// Cross-entropy over a batch of rows; `targets[r] < 0` means ignored. Returns the summed
/// loss over counted finite rows, the number of counted rows and of non-finite rows.
pub fn ce_rows(
    logits: &[f32],
    vocab: usize,
    targets: &[i64],
    scale: f32,
    grad: Option<&mut [f32]>,
) -> BatchStats {
    let one = |r: usize, g: Option<&mut [f32]>| -> BatchStats {
        let t = targets[r];
        if t < 0 {
            if let Some(g) = g {
                g.fill(0.0);
            }
            return BatchStats::default();
        }
        let z = &logits[r * vocab..(r + 1) * vocab];
        ce_stats(ce_row(z, t as usize, g, scale))
    };
    let mut per_row = vec![BatchStats::default(); targets.len()];
    match grad {
        Some(grad) => grad
            .par_chunks_mut(vocab)
            .zip(per_row.par_iter_mut())
            .enumerate()
            .for_each(|(r, (g, out))| *out = one(r, Some(g))),
        None => per_row
            .par_iter_mut()
            .enumerate()
            .for_each(|(r, out)| *out = one(r, None)),
    }
    per_row
        .into_iter()
        .fold(BatchStats::default(), BatchStats::merge)
}

/// [`ce_rows`] with each row's gradient (`scale · (softmax − onehot)`, zero for ignored and
/// non-finite rows) written over its logits.
pub fn ce_rows_in_place(
    logits: &mut [f32],
    vocab: usize,
    targets: &[i64],
    scale: f32,
) -> BatchStats {
    debug_assert_eq!(logits.len(), targets.len() * vocab);
    let mut per_row = vec![BatchStats::default(); targets.len()];
    logits
        .par_chunks_mut(vocab)
        .zip(per_row.par_iter_mut())
        .zip(targets.par_iter())
        .for_each(|((z, out), t)| {
            if *t < 0 {
                z.fill(0.0);
                return;
            }
            *out = ce_stats(ce_row_in_place(z, *t as usize, scale));
        });
    per_row
        .into_iter()
        .fold(BatchStats::default(), BatchStats::merge)
}

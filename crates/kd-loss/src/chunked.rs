//! The LM-head losses on any backend (GPUs through wgpu or CUDA) in bounded memory: the rows
//! are taken in chunks; each chunk's logits `hidden[chunk] · Wᵀ` are computed, its loss and
//! the gradients of the chunk's hidden states (and of `W`) are found by a local backward pass,
//! and the chunk's logits are freed before the next one. No `[rows, vocab]` tensor exists at
//! once, and none is kept for the caller's backward pass.
//!
//! The caller's graph receives the stored gradients through a surrogate,
//! `Σ hidden ⊙ Gₕ + Σ W ⊙ G_W`, whose gradients are exactly `Gₕ` and `G_W` (times the upstream
//! gradient), with its value replaced by the loss. Its backward pass costs two element-wise
//! products; it keeps `Gₕ` (`[rows, hidden]`) and, when the head trains, `G_W`.
//!
//! This is the CPU's fused formulation (`linear.rs`, `linear_kd.rs`) written in Burn's generic
//! tensor operations, and gives the same loss, gradients and statistics as the unchunked
//! reference path.

use std::ops::Range;

use burn::tensor::Tensor;

use crate::config::KdConfig;
use crate::error::{LossError, Result};
use crate::linear_kd::{LinearCe, LinearKdOutput};
use crate::loss::{
    KernelPath, LossOutput, LossStats, Teacher, check_normalizer, check_targets,
    cross_entropy_with, kd_loss_with,
};

/// Largest chunk of logits, in elements (16 Mi f32 = 64 MiB): well inside the 128 MiB a
/// wgpu device may bind as one buffer at least (lavapipe's limit), 130 rows at a
/// 128,256-token vocabulary.
pub const CHUNK_ELEMENTS: usize = 1 << 24;

/// Rows per chunk for a vocabulary of `vocab` (at least 1).
pub fn chunk_rows(vocab: usize) -> usize {
    (CHUNK_ELEMENTS / vocab.max(1)).max(1)
}

/// Runs `chunk_loss` on the logits of each chunk of `rows_per_chunk` rows and returns the
/// summed loss, differentiable w.r.t. `hidden` and `weight` where they are tracked, with the
/// per-chunk values `chunk_loss` returned beside its loss.
///
/// `chunk_loss(logits, rows)` must return the loss of rows `rows` alone (each a sum over its
/// rows with the call's global normaliser, so the chunks add up) and anything it wants back.
pub(crate) fn chunked_head_loss<S>(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    rows_per_chunk: usize,
    mut chunk_loss: impl FnMut(Tensor<2>, Range<usize>) -> Result<(Tensor<1>, S)>,
) -> Result<(Tensor<1>, Vec<S>)> {
    let [rows, _] = hidden.dims();
    let rows_per_chunk = rows_per_chunk.max(1);
    let (track_h, track_w) = (hidden.is_tracked(), weight.is_tracked());
    let h_in = hidden.clone().without_autodiff();
    let w_in = weight.clone().without_autodiff();
    let inner_device = h_in.device();
    // One leaf for the head, shared by the chunks' local graphs (each backward pass consumes
    // only its own chunk's graph).
    let w_leaf = track_w.then(|| w_in.clone().autodiff().require_grad());
    let mut total: Option<Tensor<1>> = None;
    let mut values = Vec::new();
    let mut dh_chunks = Vec::new();
    let mut dw: Option<Tensor<2>> = None;
    for r0 in (0..rows).step_by(rows_per_chunk) {
        let range = r0..(r0 + rows_per_chunk).min(rows);
        let h_chunk = h_in.clone().slice(range.clone());
        let (loss, value) = if track_h || track_w {
            let h_leaf = if track_h {
                h_chunk.autodiff().require_grad()
            } else {
                h_chunk.autodiff()
            };
            let w = w_leaf.clone().unwrap_or_else(|| w_in.clone().autodiff());
            let logits = h_leaf.clone().matmul(w.clone().transpose());
            let (loss, value) = chunk_loss(logits, range.clone())?;
            let grads = loss.backward();
            if track_h {
                dh_chunks.push(
                    h_leaf
                        .grad(&grads)
                        .unwrap_or_else(|| h_in.clone().slice(range.clone()).zeros_like()),
                );
            }
            if let Some(g) = w_leaf.as_ref().and_then(|w| w.grad(&grads)) {
                dw = Some(match dw {
                    Some(acc) => acc + g,
                    None => g,
                });
            }
            (loss.without_autodiff(), value)
        } else {
            let logits = h_chunk.matmul(w_in.clone().transpose());
            let (loss, value) = chunk_loss(logits, range)?;
            (loss.without_autodiff(), value)
        };
        values.push(value);
        total = Some(match total {
            Some(t) => t + loss,
            None => loss,
        });
    }
    let total = total.unwrap_or_else(|| Tensor::<1>::zeros([1], &inner_device));
    if !(track_h || track_w) {
        return Ok((total, values));
    }
    // The surrogate: gradients Gₕ and G_W, value 0 (x − detach(x)), plus the loss as a
    // constant.
    let mut surrogate: Option<Tensor<1>> = None;
    if track_h && !dh_chunks.is_empty() {
        let dh = Tensor::cat(dh_chunks, 0);
        surrogate = Some((hidden.clone() * dh).sum());
    }
    if let Some(dw) = dw {
        let term = (weight.clone() * dw).sum();
        surrogate = Some(match surrogate {
            Some(s) => s + term,
            None => term,
        });
    }
    let loss = match surrogate {
        Some(s) => s.clone() - s.detach() + total,
        // No rows: nothing to differentiate, but the loss stays in the caller's graph
        // (through the head when it trains: an empty tensor's sum may be a constant).
        None => {
            let anchor = if track_w { weight } else { hidden };
            anchor.sum() * 0.0 + total
        }
    };
    Ok((loss, values))
}

/// [`linear_cross_entropy`](crate::linear_cross_entropy) through Burn's generic operations in
/// chunks of `rows_per_chunk` rows (what it runs off the CPU backend, with
/// [`chunk_rows`]`(vocab)`); any backend, any float dtype.
pub fn linear_cross_entropy_chunked(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    targets: &[i64],
    normalizer: f32,
    rows_per_chunk: usize,
) -> Result<LossOutput> {
    check_normalizer(normalizer)?;
    check_head(&hidden, &weight)?;
    let [rows, _] = hidden.dims();
    let [vocab, _] = weight.dims();
    check_targets(targets, rows, vocab, "hidden states")?;
    let (loss, stats) = chunked_head_loss(hidden, weight, rows_per_chunk, |logits, range| {
        let out = cross_entropy_with(logits, &targets[range], normalizer, KernelPath::Reference)?;
        Ok((out.loss, out.stats))
    })?;
    Ok(LossOutput {
        loss,
        stats: merged(stats.iter()),
    })
}

/// [`linear_kd`](crate::linear_kd) through Burn's generic operations in chunks of
/// `rows_per_chunk` rows (what it runs off the CPU backend, with [`chunk_rows`]`(vocab)`);
/// any backend, any float dtype.
#[allow(clippy::too_many_arguments)] // linear_kd's arguments and the chunk size
pub fn linear_kd_chunked(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    teacher: Teacher,
    mask: &[bool],
    normalizer: f32,
    config: &KdConfig,
    kd_weight: f32,
    ce: Option<LinearCe<'_>>,
    rows_per_chunk: usize,
) -> Result<LinearKdOutput> {
    crate::linear_kd::check_linear_kd(
        &hidden,
        &weight,
        &teacher,
        mask,
        normalizer,
        config,
        ce.as_ref(),
    )?;
    let teacher = match teacher {
        Teacher::Logits(t) => Teacher::Logits(t.without_autodiff()),
        Teacher::TopK { indices, values } => Teacher::TopK {
            indices,
            values: values.without_autodiff(),
        },
    };
    let (loss, stats) = chunked_head_loss(hidden, weight, rows_per_chunk, |logits, range| {
        let part = match &teacher {
            Teacher::Logits(t) => Teacher::Logits(t.clone().slice(range.clone())),
            Teacher::TopK { indices, values } => Teacher::TopK {
                indices: indices.clone().slice(range.clone()),
                values: values.clone().slice(range.clone()),
            },
        };
        let kd = kd_loss_with(
            logits.clone(),
            part,
            &mask[range.clone()],
            normalizer,
            config,
            KernelPath::Reference,
        )?;
        let mut loss = kd.loss * kd_weight;
        let ce_stats = match ce {
            Some(c) => {
                let out = cross_entropy_with(
                    logits,
                    &c.targets[range],
                    normalizer,
                    KernelPath::Reference,
                )?;
                loss = loss + out.loss * c.weight;
                Some(out.stats)
            }
            None => None,
        };
        Ok((loss, (kd.stats, ce_stats)))
    })?;
    Ok(LinearKdOutput {
        loss,
        kd: merged(stats.iter().map(|(kd, _)| kd)),
        ce: ce.map(|_| merged(stats.iter().filter_map(|(_, ce)| ce.as_ref()))),
    })
}

fn merged<'a>(stats: impl Iterator<Item = &'a LossStats>) -> LossStats {
    stats.fold(LossStats::default(), |mut acc, s| {
        acc.merge(s);
        acc
    })
}

pub(crate) fn check_head(hidden: &Tensor<2>, weight: &Tensor<2>) -> Result<()> {
    let [rows, dim] = hidden.dims();
    let [vocab, wdim] = weight.dims();
    if wdim != dim {
        return Err(LossError::Shape(format!(
            "LM head weight [{vocab}, {wdim}] does not fit hidden states [{rows}, {dim}] \
             (expected [vocab, {dim}])"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;
    use crate::KdObjective;

    fn tensor(rows: usize, cols: usize, seed: usize, device: &Device) -> Tensor<2> {
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| (((i + seed) * 37 % 23) as f32 - 11.0) / 9.0)
            .collect();
        Tensor::from_data(TensorData::new(v, [rows, cols]), device)
    }

    fn values(t: Tensor<2>) -> Vec<f32> {
        t.into_data().try_into_vec_as::<f32>().unwrap()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
    }

    /// On the CPU, chunks of any size give the fused kernels' loss, statistics and
    /// gradients (hidden states and head both trained), for CE and for KD + CE.
    #[test]
    fn chunks_equal_the_fused_kernels() {
        let device = Device::flex().autodiff();
        let (rows, dim, vocab) = (7, 5, 33);
        let targets: Vec<i64> = (0..rows as i64)
            .map(|r| if r == 2 { -100 } else { r * 4 })
            .collect();
        let mask: Vec<bool> = (0..rows).map(|r| r != 4).collect();
        let teacher = tensor(rows, vocab, 3, &Device::flex());
        let config = KdConfig {
            objective: KdObjective::SkewedReverseKl,
            ..KdConfig::default()
        };
        let run = |chunk: Option<usize>, kd: bool| {
            let h = tensor(rows, dim, 1, &device).require_grad();
            let w = tensor(vocab, dim, 2, &device).require_grad();
            let ce = LinearCe {
                targets: &targets,
                weight: 0.7,
            };
            let t = Teacher::Logits(teacher.clone());
            let (loss, sum) = match (kd, chunk) {
                (false, Some(c)) => {
                    let o = linear_cross_entropy_chunked(h.clone(), w.clone(), &targets, 5.0, c)
                        .unwrap();
                    (o.loss, o.stats.loss_sum)
                }
                (false, None) => {
                    let o =
                        crate::linear_cross_entropy(h.clone(), w.clone(), &targets, 5.0).unwrap();
                    (o.loss, o.stats.loss_sum)
                }
                (true, Some(c)) => {
                    let o = linear_kd_chunked(
                        h.clone(),
                        w.clone(),
                        t,
                        &mask,
                        5.0,
                        &config,
                        0.9,
                        Some(ce),
                        c,
                    )
                    .unwrap();
                    (o.loss, o.kd.loss_sum + o.ce.unwrap().loss_sum)
                }
                (true, None) => {
                    let o = crate::linear_kd(
                        h.clone(),
                        w.clone(),
                        t,
                        &mask,
                        5.0,
                        &config,
                        0.9,
                        Some(ce),
                    )
                    .unwrap();
                    (o.loss, o.kd.loss_sum + o.ce.unwrap().loss_sum)
                }
            };
            let grads = loss.backward();
            (
                loss.into_scalar::<f32>(),
                sum,
                values(h.grad(&grads).unwrap()),
                values(w.grad(&grads).unwrap()),
            )
        };
        for kd in [false, true] {
            let (l, s, dh, dw) = run(None, kd);
            for chunk in [1, 2, 3, 7, 100] {
                let (lc, sc, dhc, dwc) = run(Some(chunk), kd);
                assert!(
                    (l - lc).abs() <= 1e-6 * l.abs().max(1.0),
                    "{kd} {chunk}: {l} {lc}"
                );
                assert!(
                    (s - sc).abs() <= 1e-5 * s.abs().max(1.0),
                    "{kd} {chunk}: stats"
                );
                assert!(max_diff(&dh, &dhc) <= 1e-6, "{kd} {chunk}: d hidden");
                assert!(max_diff(&dw, &dwc) <= 1e-6, "{kd} {chunk}: d W");
            }
        }
    }

    /// No rows: a zero loss whose backward pass still runs.
    #[test]
    fn no_rows_give_a_zero_loss() {
        let device = Device::flex().autodiff();
        let h = Tensor::<2>::zeros([0, 4], &device).require_grad();
        let w = tensor(9, 4, 2, &device).require_grad();
        let out = linear_cross_entropy_chunked(h, w.clone(), &[], 1.0, 3).unwrap();
        assert_eq!(out.stats.counted, 0);
        let grads = out.loss.backward();
        assert_eq!(out.loss.into_scalar::<f32>(), 0.0);
        assert!(
            w.grad(&grads)
                .is_none_or(|g| values(g).iter().all(|x| *x == 0.0))
        );
    }

    /// Without gradients (evaluation) the chunks still add up to the loss.
    #[test]
    fn untracked_inputs_give_the_loss_alone() {
        let device = Device::flex();
        let (rows, dim, vocab) = (6, 4, 19);
        let targets: Vec<i64> = (0..rows as i64).map(|r| r * 3).collect();
        let whole = crate::linear_cross_entropy(
            tensor(rows, dim, 1, &device),
            tensor(vocab, dim, 2, &device),
            &targets,
            6.0,
        )
        .unwrap();
        let chunked = linear_cross_entropy_chunked(
            tensor(rows, dim, 1, &device),
            tensor(vocab, dim, 2, &device),
            &targets,
            6.0,
            4,
        )
        .unwrap();
        let (a, b) = (
            whole.loss.into_scalar::<f32>(),
            chunked.loss.into_scalar::<f32>(),
        );
        assert!((a - b).abs() <= 1e-6, "{a} vs {b}");
        assert_eq!(chunked.stats.counted, rows);
    }
}

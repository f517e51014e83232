//! Cross-entropy fused with the LM head (`logits = hidden · Wᵀ`): the logits of a block of
//! rows are computed, turned into their gradient in place, and multiplied back into the
//! gradients of the hidden states (and of `W` when it trains) before the next block, all in
//! the forward pass. No `[rows, vocab]` tensor outlives the call and none is kept for
//! autodiff; the backward pass only scales the stored `[rows, hidden]` gradient.
//!
//! On the bench model (1024 rows × 128256 × 512) this removes the separate logits and
//! gradient buffers (1 GB), the CE pass reading one into the other and the pass scaling the
//! gradient; the two products run as single multithreaded GEMMs.

use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, Flex, backend_extension};
use burn::tensor::{DType, Tensor};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_flex::FlexTensor;
use kd_kernels::gemm::{MatMut, MatRef, Threads, Write, matmul, matmul_into};

use crate::error::Result;
use crate::fused::{f32_view, flex, grad_or_placeholder, read_stats, stats_values};
use crate::kernels::{self, BatchStats};
use crate::loss::{LossOutput, LossStats, check_normalizer, check_targets, on_flex};

/// Largest logits block, in elements (256 Mi f32 = 1 GiB); rows are processed in blocks of at
/// most this many logits.
const BLOCK_ELEMENTS: usize = 1 << 28;

/// The non-tensor inputs of a fused call.
#[derive(Debug, Clone)]
pub struct LinearCeJob {
    /// Target of each row (negative = ignored).
    pub targets: Vec<i64>,
    /// Multiplier of the summed loss (1 / normaliser).
    pub scale: f32,
}

/// The fused LM head + cross-entropy as a Burn backend extension (CPU backend and autodiff).
#[backend_extension(Flex, Autodiff)]
pub trait LinearCeBackend: Backend {
    /// Returns `(loss [1], stats [5], d hidden [rows, hidden] or [1], d weight [vocab,
    /// hidden] or [1])`; stats are `[loss_sum, 0, 0, counted, nonfinite]`. The gradients are
    /// of the scaled loss and are computed when asked for.
    fn linear_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        job: LinearCeJob,
        grad_hidden: bool,
        grad_weight: bool,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );
}

/// Rows of logits per block for a vocabulary of `vocab`.
fn block_rows(vocab: usize) -> usize {
    (BLOCK_ELEMENTS / vocab.max(1)).max(1)
}

/// The host computation in blocks of `block` rows: returns the batch statistics and the
/// requested gradients.
#[allow(clippy::too_many_arguments)]
fn host_linear_ce(
    h: &[f32],
    w: &[f32],
    (rows, dim, vocab): (usize, usize, usize),
    job: &LinearCeJob,
    grad_hidden: bool,
    grad_weight: bool,
    block: usize,
) -> (BatchStats, Option<Vec<f32>>, Option<Vec<f32>>) {
    let mut dh = grad_hidden.then(|| vec![0f32; rows * dim]);
    let mut dw = grad_weight.then(|| vec![0f32; vocab * dim]);
    let block = block.clamp(1, rows.max(1));
    let mut z: Vec<f32> = Vec::with_capacity(block * vocab);
    let mut stats = BatchStats::default();
    for r0 in (0..rows).step_by(block) {
        let n = block.min(rows - r0);
        let hb = &h[r0 * dim..(r0 + n) * dim];
        logits_block(&mut z, hb, w, (n, dim, vocab));
        stats = stats.merge(kernels::ce_rows_in_place(
            &mut z,
            vocab,
            &job.targets[r0..r0 + n],
            job.scale,
        ));
        if let Some(dh) = dh.as_mut() {
            hidden_grad_block(&mut dh[r0 * dim..(r0 + n) * dim], &z, w, (n, dim, vocab));
        }
        if let Some(dw) = dw.as_mut() {
            weight_grad_block(dw, &z, hb, (n, dim, vocab), r0 > 0);
        }
    }
    (stats, dh, dw)
}

/// `z = h · Wᵀ` for a block of `n` rows: `h` is `[n, dim]`, `w` is `[vocab, dim]`; `z` is
/// cleared and refilled with `[n, vocab]`.
pub(crate) fn logits_block(
    z: &mut Vec<f32>,
    h: &[f32],
    w: &[f32],
    (n, dim, vocab): (usize, usize, usize),
) {
    matmul_into(
        z,
        MatRef::row_major(h, n, dim).expect("hidden block [n, dim]"),
        MatRef::row_major(w, vocab, dim)
            .expect("weight [vocab, dim]")
            .t(),
        1.0,
        Threads::All,
    )
    .expect("logits block shapes");
}

/// `dh = G · W` for a block: `g` is `[n, vocab]`, `w` `[vocab, dim]`, `dh` `[n, dim]`
/// (overwritten).
pub(crate) fn hidden_grad_block(
    dh: &mut [f32],
    g: &[f32],
    w: &[f32],
    (n, dim, vocab): (usize, usize, usize),
) {
    matmul(
        MatMut::row_major(dh, n, dim).expect("hidden gradient [n, dim]"),
        MatRef::row_major(g, n, vocab).expect("logit gradient [n, vocab]"),
        MatRef::row_major(w, vocab, dim).expect("weight [vocab, dim]"),
        Write::Overwrite,
        1.0,
        Threads::All,
    )
    .expect("hidden gradient shapes");
}

/// `dW (+)= Gᵀ · H` for a block: `g` is `[n, vocab]`, `h` `[n, dim]`, `dw` `[vocab, dim]`
/// (accumulated into when `accumulate`, overwritten otherwise).
pub(crate) fn weight_grad_block(
    dw: &mut [f32],
    g: &[f32],
    h: &[f32],
    (n, dim, vocab): (usize, usize, usize),
    accumulate: bool,
) {
    matmul(
        MatMut::row_major(dw, vocab, dim).expect("weight gradient [vocab, dim]"),
        MatRef::row_major(g, n, vocab)
            .expect("logit gradient [n, vocab]")
            .t(),
        MatRef::row_major(h, n, dim).expect("hidden block [n, dim]"),
        if accumulate {
            Write::Accumulate
        } else {
            Write::Overwrite
        },
        1.0,
        Threads::All,
    )
    .expect("weight gradient shapes");
}

impl LinearCeBackend for Flex {
    fn linear_cross_entropy(
        hidden: FlexTensor,
        weight: FlexTensor,
        job: LinearCeJob,
        grad_hidden: bool,
        grad_weight: bool,
    ) -> (FlexTensor, FlexTensor, FlexTensor, FlexTensor) {
        let hshape = hidden.layout().shape().to_vec();
        let wshape = weight.layout().shape().to_vec();
        let (rows, dim, vocab) = (hshape[0], hshape[1], wshape[0]);
        let (stats, dh, dw) = host_linear_ce(
            &f32_view(&hidden),
            &f32_view(&weight),
            (rows, dim, vocab),
            &job,
            grad_hidden,
            grad_weight,
            block_rows(vocab),
        );
        let loss = (stats.loss_sum * job.scale as f64) as f32;
        (
            flex(vec![loss], vec![1]),
            flex(stats_values(&stats).to_vec(), vec![5]),
            grad_or_placeholder(dh, hshape),
            grad_or_placeholder(dw, wshape),
        )
    }
}

/// The backward step of the fused LM-head losses: the gradients of the hidden states and of
/// the head, computed in the forward pass, scaled by the upstream gradient.
#[derive(Debug)]
pub(crate) struct StoredGradsBackward;

impl<B: Backend> Backward<B, 2> for StoredGradsBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let upstream = grads.consume::<B>(&ops.node);
        let upstream = B::float_reshape(upstream, vec![1, 1].into());
        let (dh, dw) = ops.state;
        for (parent, grad) in ops.parents.into_iter().zip([dh, dw]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, B::float_mul(grad, upstream.clone()));
            }
        }
    }
}

impl<B: Backend + LinearCeBackend, C: CheckpointStrategy> LinearCeBackend for Autodiff<B, C> {
    fn linear_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        job: LinearCeJob,
        _grad_hidden: bool,
        _grad_weight: bool,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let (track_h, track_w) = (hidden.is_tracked(), weight.is_tracked());
        let guards = [hidden.node(), weight.node()];
        let (loss, stats, dh, dw) = B::linear_cross_entropy(
            hidden.into_primitive(),
            weight.into_primitive(),
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

/// Next-token cross-entropy through the LM head: Σ over rows with `targets[r] ≥ 0` of
/// `−log softmax(hidden[r] · Wᵀ)[target]`, divided by `normalizer`.
///
/// - `hidden`: `[rows, hidden]` (the final-norm hidden states, already aligned with
///   `targets`, e.g. by [`crate::next_token_targets`]);
/// - `weight`: the LM head in the checkpoint layout `[vocab, hidden]`; frozen or trained.
///
/// On the CPU backend in f32 this never materialises the logits beyond one block of rows and
/// computes the gradients during the forward pass (see the module docs); elsewhere it runs
/// [`linear_cross_entropy_chunked`](crate::linear_cross_entropy_chunked), the same in Burn's
/// generic operations, chunk by chunk. Both give the same loss, gradients and statistics.
pub fn linear_cross_entropy(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    targets: &[i64],
    normalizer: f32,
) -> Result<LossOutput> {
    check_normalizer(normalizer)?;
    crate::chunked::check_head(&hidden, &weight)?;
    let [rows, _] = hidden.dims();
    let [vocab, _] = weight.dims();
    check_targets(targets, rows, vocab, "hidden states")?;
    let fused =
        on_flex(&hidden.device()) && hidden.dtype() == DType::F32 && weight.dtype() == DType::F32;
    if !fused {
        return crate::chunked::linear_cross_entropy_chunked(
            hidden,
            weight,
            targets,
            normalizer,
            crate::chunked::chunk_rows(vocab),
        );
    }
    let job = LinearCeJob {
        targets: targets.to_vec(),
        scale: 1.0 / normalizer,
    };
    let (loss, stats, _, _) = <burn::backend::Dispatch as LinearCeBackend>::linear_cross_entropy(
        hidden.into_dispatch(),
        weight.into_dispatch(),
        job,
        false,
        false,
    );
    let loss = Tensor::<1>::from_dispatch(loss);
    let stats = read_stats(stats);
    Ok(LossOutput {
        loss,
        stats: LossStats::from_batch(stats),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks of rows give the same numbers as one block (the dW accumulation included).
    #[test]
    fn blocks_equal_one_block() {
        let (rows, dim, vocab) = (7, 5, 33);
        let h: Vec<f32> = (0..rows * dim)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) / 7.0)
            .collect();
        let w: Vec<f32> = (0..vocab * dim)
            .map(|i| ((i * 53 % 13) as f32 - 6.0) / 9.0)
            .collect();
        let job = LinearCeJob {
            targets: (0..rows as i64)
                .map(|r| if r == 2 { -1 } else { r * 4 })
                .collect(),
            scale: 0.25,
        };
        let one = host_linear_ce(&h, &w, (rows, dim, vocab), &job, true, true, rows);
        for block in [1, 2, 3] {
            let (stats, dh, dw) =
                host_linear_ce(&h, &w, (rows, dim, vocab), &job, true, true, block);
            assert_eq!(stats.counted, 6);
            assert!((stats.loss_sum - one.0.loss_sum).abs() < 1e-9);
            assert_eq!(dh, one.1, "block {block}");
            let (a, b) = (dw.unwrap(), one.2.clone().unwrap());
            let d = a
                .iter()
                .zip(&b)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(d < 1e-6, "block {block}: {d}");
        }
    }
}

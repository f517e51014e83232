//! RMSNorm over the last axis (`burn::nn::RmsNorm`'s arithmetic: `x / sqrt(mean(x²) + eps) ·
//! gamma`), forward and backward in one pass each, rows in parallel; the `gamma` gradient is
//! summed over per-task partials in task order (deterministic).

use burn::backend::Backend;
use burn::backend::tensor::FloatTensor;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_flex::FlexTensor;
use kd_kernels::math;
use kd_kernels::{dispatch, f32_view};
use rayon::prelude::*;

use super::{AdTensor, TrainOpsBackend, flex, shape};

/// Rows per parallel task of the RMSNorm kernels.
const NORM_ROWS: usize = 32;

dispatch! {
    /// `y = x / rms · gamma` for rows of `gamma.len()` values.
    pub(crate) fn rms_norm_rows(y: &mut [f32], x: &[f32], gamma: &[f32], eps: f32) {
        let d = gamma.len();
        for (yr, xr) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            let rms = (math::sum_map(xr, |v| v * v) / d as f32 + eps).sqrt();
            for ((o, v), g) in yr.iter_mut().zip(xr).zip(gamma) {
                *o = v / rms * g;
            }
        }
    }
}

dispatch! {
    /// `dx` of rows and their `dgamma` contributions (added into `dgamma` row by row).
    fn rms_norm_grad_rows(
        dx: &mut [f32],
        dgamma: &mut [f32],
        x: &[f32],
        gamma: &[f32],
        dy: &[f32],
        eps: f32,
    ) {
        let d = gamma.len();
        for ((dxr, xr), dyr) in dx.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(dy.chunks_exact(d)) {
            let rms = (math::sum_map(xr, |v| v * v) / d as f32 + eps).sqrt();
            // Σ x · dy · gamma with eight lane sums (vectorisable, fixed order).
            let mut lanes = [0f32; 8];
            let chunks = xr.chunks_exact(8).zip(dyr.chunks_exact(8)).zip(gamma.chunks_exact(8));
            for ((v, g), w) in chunks {
                for l in 0..8 {
                    lanes[l] += v[l] * g[l] * w[l];
                }
            }
            let tail = d / 8 * 8;
            let mut dot: f32 = lanes.iter().sum();
            for i in tail..d {
                dot += xr[i] * dyr[i] * gamma[i];
            }
            let k = dot / (d as f32 * rms * rms * rms);
            for (((o, v), g), w) in dxr.iter_mut().zip(xr).zip(dyr).zip(gamma) {
                *o = w * g / rms - v * k;
            }
            for ((acc, v), g) in dgamma.iter_mut().zip(xr).zip(dyr) {
                *acc += g * (v / rms);
            }
        }
    }
}

/// RMSNorm operands: `gamma` is the last axis of `x` (and the output gradient has `x`'s
/// shape); the row kernels walk `x` in rows of `gamma`'s length.
fn check_norm(x: &[usize], gamma: &FlexTensor, dout: Option<&FlexTensor>) {
    let gs = shape(gamma);
    assert!(
        gs.len() == 1 && gs[0] > 0 && x.last() == Some(&gs[0]),
        "rms_norm: gamma {gs:?} must be the last axis of x {x:?}"
    );
    if let Some(g) = dout {
        assert_eq!(
            shape(g),
            x,
            "rms_norm_backward: the output gradient's shape"
        );
    }
}

/// [`TrainOpsBackend::rms_norm`] on the CPU backend.
pub(crate) fn flex_forward(x: FlexTensor, gamma: FlexTensor, eps: f32) -> FlexTensor {
    let dims = shape(&x);
    check_norm(&dims, &gamma, None);
    let (x, gamma) = (f32_view(&x), f32_view(&gamma));
    let d = gamma.len();
    let simd = kd_kernels::cpu::level();
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(NORM_ROWS * d)
        .zip(x.par_chunks(NORM_ROWS * d))
        .for_each(|(yc, xc)| rms_norm_rows(simd, yc, xc, &gamma, eps));
    flex(y, dims)
}

/// [`TrainOpsBackend::rms_norm_backward`] on the CPU backend.
pub(crate) fn flex_backward(
    x: FlexTensor,
    gamma: FlexTensor,
    dout: FlexTensor,
    eps: f32,
) -> (FlexTensor, FlexTensor) {
    let dims = shape(&x);
    check_norm(&dims, &gamma, Some(&dout));
    let (x, gamma, dy) = (f32_view(&x), f32_view(&gamma), f32_view(&dout));
    let d = gamma.len();
    let simd = kd_kernels::cpu::level();
    let mut dx = vec![0f32; x.len()];
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(NORM_ROWS * d)
        .zip(
            x.par_chunks(NORM_ROWS * d)
                .zip(dy.par_chunks(NORM_ROWS * d)),
        )
        .map(|(dxc, (xc, dyc))| {
            let mut dg = vec![0f32; d];
            rms_norm_grad_rows(simd, dxc, &mut dg, xc, &gamma, dyc, eps);
            dg
        })
        .collect();
    let mut dgamma = vec![0f32; d];
    for part in &partials {
        for (a, b) in dgamma.iter_mut().zip(part) {
            *a += b;
        }
    }
    (flex(dx, dims), flex(dgamma, vec![d]))
}

/// The autodiff node: forward on the inner backend, keeping `(x, gamma, eps)`.
pub(crate) fn autodiff_forward<B: Backend + TrainOpsBackend, C: CheckpointStrategy>(
    x: AdTensor<B, C>,
    gamma: AdTensor<B, C>,
    eps: f32,
) -> AdTensor<B, C> {
    #[derive(Debug)]
    struct RmsNormBackward;

    impl<B: Backend + TrainOpsBackend> Backward<B, 2> for RmsNormBackward {
        type State = (FloatTensor<B>, FloatTensor<B>, f32);

        fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            let (x, gamma, eps) = ops.state;
            let dout = grads.consume::<B>(&ops.node);
            let (dx, dgamma) = B::rms_norm_backward(x, gamma, dout, eps);
            for (parent, grad) in ops.parents.into_iter().zip([dx, dgamma]) {
                if let Some(node) = parent {
                    grads.register::<B>(node.id, grad);
                }
            }
        }
    }

    let guards = [x.node(), gamma.node()];
    let (x, gamma) = (x.into_primitive(), gamma.into_primitive());
    let y = B::rms_norm(x.clone(), gamma.clone(), eps);
    match RmsNormBackward
        .prepare::<C>(guards)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((x, gamma, eps), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

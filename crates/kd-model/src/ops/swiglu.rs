//! SwiGLU, `silu(gate) · up`, elementwise, forward and backward in one pass each (Burn's SiLU
//! under autodiff is `x · exp(−ln(1 + e^−x))`, several passes and buffers).

use burn::backend::Backend;
use burn::backend::tensor::FloatTensor;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_flex::FlexTensor;
use kd_kernels::math::exp;
use kd_kernels::{dispatch, f32_view};
use rayon::prelude::*;

use super::{AdTensor, TrainOpsBackend, flex, shape};

/// Elements per parallel task of the SwiGLU kernels.
const SWIGLU_CHUNK: usize = 1 << 14;

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

dispatch! {
    /// `out = silu(gate) · up`.
    pub(crate) fn swiglu_chunk(out: &mut [f32], gate: &[f32], up: &[f32]) {
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = g * sigmoid(*g) * u;
        }
    }
}

dispatch! {
    /// The gradients of `silu(gate) · up` given the output gradient `dout`.
    fn swiglu_grad_chunk(dg: &mut [f32], du: &mut [f32], gate: &[f32], up: &[f32], dout: &[f32]) {
        for ((((dg, du), g), u), go) in dg.iter_mut().zip(du.iter_mut()).zip(gate).zip(up).zip(dout) {
            let sg = sigmoid(*g);
            *du = go * g * sg;
            *dg = go * u * sg * (1.0 + g * (1.0 - sg));
        }
    }
}

fn swiglu_forward(gate: &[f32], up: &[f32]) -> Vec<f32> {
    let simd = kd_kernels::cpu::level();
    let mut out = vec![0f32; gate.len()];
    out.par_chunks_mut(SWIGLU_CHUNK)
        .zip(gate.par_chunks(SWIGLU_CHUNK))
        .zip(up.par_chunks(SWIGLU_CHUNK))
        .for_each(|((o, g), u)| swiglu_chunk(simd, o, g, u));
    out
}

fn swiglu_grads(gate: &[f32], up: &[f32], dout: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let simd = kd_kernels::cpu::level();
    let mut dg = vec![0f32; gate.len()];
    let mut du = vec![0f32; gate.len()];
    dg.par_chunks_mut(SWIGLU_CHUNK)
        .zip(du.par_chunks_mut(SWIGLU_CHUNK))
        .zip(gate.par_chunks(SWIGLU_CHUNK))
        .zip(
            up.par_chunks(SWIGLU_CHUNK)
                .zip(dout.par_chunks(SWIGLU_CHUNK)),
        )
        .for_each(|(((dg, du), g), (u, go))| swiglu_grad_chunk(simd, dg, du, g, u, go));
    (dg, du)
}

/// [`TrainOpsBackend::swiglu`] on the CPU backend.
pub(crate) fn flex_forward(gate: FlexTensor, up: FlexTensor) -> FlexTensor {
    let dims = shape(&gate);
    assert_eq!(shape(&up), dims, "swiglu: gate and up must have one shape");
    flex(swiglu_forward(&f32_view(&gate), &f32_view(&up)), dims)
}

/// [`TrainOpsBackend::swiglu_backward`] on the CPU backend.
pub(crate) fn flex_backward(
    gate: FlexTensor,
    up: FlexTensor,
    dout: FlexTensor,
) -> (FlexTensor, FlexTensor) {
    let dims = shape(&gate);
    assert!(
        shape(&up) == dims && shape(&dout) == dims,
        "swiglu_backward: gate, up and the output gradient must have one shape"
    );
    let (dg, du) = swiglu_grads(&f32_view(&gate), &f32_view(&up), &f32_view(&dout));
    (flex(dg, dims.clone()), flex(du, dims))
}

/// The autodiff node: forward on the inner backend, keeping `(gate, up)`.
pub(crate) fn autodiff_forward<B: Backend + TrainOpsBackend, C: CheckpointStrategy>(
    gate: AdTensor<B, C>,
    up: AdTensor<B, C>,
) -> AdTensor<B, C> {
    #[derive(Debug)]
    struct SwigluBackward;

    impl<B: Backend + TrainOpsBackend> Backward<B, 2> for SwigluBackward {
        type State = (FloatTensor<B>, FloatTensor<B>);

        fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            let (gate, up) = ops.state;
            let dout = grads.consume::<B>(&ops.node);
            let (dg, du) = B::swiglu_backward(gate, up, dout);
            for (parent, grad) in ops.parents.into_iter().zip([dg, du]) {
                if let Some(node) = parent {
                    grads.register::<B>(node.id, grad);
                }
            }
        }
    }

    let guards = [gate.node(), up.node()];
    let (gate, up) = (gate.into_primitive(), up.into_primitive());
    let out = B::swiglu(gate.clone(), up.clone());
    match SwigluBackward
        .prepare::<C>(guards)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((gate, up), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

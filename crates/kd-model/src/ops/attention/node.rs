//! The attention kernel as Burn operations: on the CPU backend's tensors, and as an autodiff
//! node that keeps what the backward pass recomputes from.

use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_flex::FlexTensor;
use kd_kernels::f32_view;

use super::{AttentionJob, attention_dims, backward, forward, head_view};
use crate::ops::{AdTensor, TrainOpsBackend, flex};

/// [`TrainOpsBackend::masked_attention`] on the CPU backend.
pub(crate) fn flex_forward(
    q: FlexTensor,
    k: FlexTensor,
    v: FlexTensor,
    job: AttentionJob,
) -> (FlexTensor, FlexTensor) {
    let n = attention_dims(&q, &k, &v, &job, None);
    let (kh, hs) = head_view(&k);
    let (vh, vs) = head_view(&v);
    let (kh, vh, hs) = if hs == vs {
        (kh, vh, hs)
    } else {
        // Differently strided K and V: both contiguous.
        (f32_view(&k), f32_view(&v), n.t * n.d)
    };
    let (out, lse) = forward(&f32_view(&q), (&kh, &vh, hs), &job, n);
    (
        flex(out, vec![n.b, n.h, n.s, n.d]),
        flex(lse, vec![n.b, n.h, n.s]),
    )
}

/// [`TrainOpsBackend::masked_attention_backward`] on the CPU backend.
pub(crate) fn flex_backward(
    q: FlexTensor,
    k: FlexTensor,
    v: FlexTensor,
    (out, lse, dout): (FlexTensor, FlexTensor, FlexTensor),
    job: AttentionJob,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let n = attention_dims(&q, &k, &v, &job, Some((&out, &lse, &dout)));
    let (dq, dk, dv) = backward(
        &f32_view(&q),
        (&f32_view(&k), &f32_view(&v), n.t * n.d),
        &f32_view(&out),
        &f32_view(&lse),
        &f32_view(&dout),
        &job,
        n,
    );
    (
        flex(dq, vec![n.b, n.h, n.s, n.d]),
        flex(dk, vec![n.b, n.kv, n.t, n.d]),
        flex(dv, vec![n.b, n.kv, n.t, n.d]),
    )
}

/// The autodiff node: forward on the inner backend, keeping `(q, k, v, out, lse, job)`.
pub(crate) fn autodiff_forward<B: Backend + TrainOpsBackend, C: CheckpointStrategy>(
    q: AdTensor<B, C>,
    k: AdTensor<B, C>,
    v: AdTensor<B, C>,
    job: AttentionJob,
) -> (AdTensor<B, C>, AdTensor<B, C>) {
    #[derive(Debug)]
    struct AttentionBackward;

    type State<B> = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        AttentionJob,
    );

    impl<B: Backend + TrainOpsBackend> Backward<B, 3> for AttentionBackward {
        type State = State<B>;

        fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
            let (q, k, v, out, lse, job) = ops.state;
            let dout = grads.consume::<B>(&ops.node);
            let (dq, dk, dv) = B::masked_attention_backward(q, k, v, out, lse, dout, job);
            for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
                if let Some(node) = parent {
                    grads.register::<B>(node.id, grad);
                }
            }
        }
    }

    let guards = [q.node(), k.node(), v.node()];
    let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
    let (out, lse) = B::masked_attention(q.clone(), k.clone(), v.clone(), job.clone());
    let tracked = match AttentionBackward
        .prepare::<C>(guards)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((q, k, v, out.clone(), lse.clone(), job), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    (
        tracked,
        <Autodiff<B, C> as AutodiffBackend>::from_inner(lse),
    )
}

//! Fused CPU training kernels, one forward pass and one backward pass each on host memory,
//! handed to autodiff as Burn backend extensions (the flex backend, with or without autodiff
//! over it):
//!
//! - [`attention`] — masked attention with grouped K/V heads, FlashAttention-2 style (memory
//!   linear in the sequence; K/V may be views into the KV cache's capacity);
//! - [`lora`] — the LoRA projection with the frozen base product, LoRA dropout inside;
//! - [`norm`] — RMSNorm;
//! - [`swiglu`] — `silu(gate) · up`.
//!
//! Burn's attention under autodiff falls back to a graph of matmul, mask, max, exp, sum and
//! div ops (with the key/value heads repeated for grouped-query attention), and its SiLU is
//! `x · exp(−ln(1 + e^−x))`: on the bench model these two took about 60% of the time of the
//! transformer body. The products go through `kd_kernels::gemm`'s checked views, so no shape
//! handed to these functions can make them read or write out of bounds (a mismatch panics
//! with the shapes); the exponentials are `kd_kernels::math`'s vectorised ones.
//!
//! Other devices and dtypes take Burn's own ops ([`applies`]).

pub mod attention;
pub mod lora;
pub mod norm;
pub mod swiglu;

use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, Flex, backend_extension};
use burn::tensor::{Bool, DType, Device, Tensor, TensorData};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_flex::FlexTensor;

pub use attention::AttentionJob;
pub use lora::{LoraDropout, fused_lora_calls};

use crate::error::Result;

/// Fused training kernels as a Burn backend extension.
#[backend_extension(Flex, Autodiff)]
pub trait TrainOpsBackend: Backend {
    /// Masked softmax attention with grouped K/V heads: `q [b, h, s, d]`, `k`, `v`
    /// `[b, kv, t, d]` → `(out [b, h, s, d], log-sum-exp [b, h, s])`; queries that see no key
    /// give 0 (and a log-sum-exp of −∞).
    fn masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        job: AttentionJob,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients `(dq, dk, dv)` of [`masked_attention`](Self::masked_attention) given its
    /// output and log-sum-exp and the gradient of its output.
    #[allow(clippy::too_many_arguments)]
    fn masked_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        job: AttentionJob,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// A LoRA projection `x · W + scale · (dropout(x) · A) · B` with `W` frozen: `x [n, in]`,
    /// `w [in, out]`, `a [in, r]`, `b [r, out]` → `[n, out]`. Under autodiff the gradients
    /// of `x`, `A` and `B` come from [`lora_linear_backward`](Self::lora_linear_backward).
    fn lora_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        scale: f32,
        dropout: Option<LoraDropout>,
    ) -> FloatTensor<Self>;

    /// `(dx, dA, dB)` of [`lora_linear`](Self::lora_linear) given the output gradient; `dx`
    /// only when `want_dx` (else a `[1]` placeholder).
    #[allow(clippy::too_many_arguments)]
    fn lora_linear_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        scale: f32,
        dropout: Option<LoraDropout>,
        want_dx: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// RMSNorm over the last axis: `x / sqrt(mean(x²) + eps) · gamma`.
    fn rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f32) -> FloatTensor<Self>;

    /// `(dx, dgamma)` of [`rms_norm`](Self::rms_norm).
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `silu(gate) · up`, elementwise.
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;

    /// The gradients `(dgate, dup)` of [`swiglu`](Self::swiglu).
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dout: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// Whether the fused kernels serve a tensor on `device` with `dtype` (the CPU backend, f32).
pub fn applies(device: &Device, dtype: DType) -> bool {
    dtype == DType::F32 && device.clone().without_autodiff() == Device::flex()
}

/// Masked attention through the fused kernels (see [`TrainOpsBackend::masked_attention`]);
/// `mask` is `[batch, 1, seq, keys]` with `true` = masked. An error when the mask is not of
/// that shape; operands that do not fit it panic with their shapes.
pub fn fused_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: &Tensor<4, Bool>,
    scale: f64,
) -> Result<Tensor<4>> {
    Ok(fused_attention_job(
        q,
        k,
        v,
        AttentionJob::from_mask(mask, scale)?,
    ))
}

/// [`fused_attention`] with a job built once (a model builds one per forward pass and shares
/// it between its layers).
pub fn fused_attention_job(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    job: AttentionJob,
) -> Tensor<4> {
    let (out, _) = <burn::backend::Dispatch as TrainOpsBackend>::masked_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        job,
    );
    Tensor::from_dispatch(out)
}

/// A LoRA projection `x · W + scale · (dropout(x) · A) · B` through the fused kernels (see
/// [`TrainOpsBackend::lora_linear`]). `W` must not require gradients.
pub fn fused_lora_linear(
    x: Tensor<2>,
    w: Tensor<2>,
    a: Tensor<2>,
    b: Tensor<2>,
    scale: f64,
    dropout: Option<LoraDropout>,
) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as TrainOpsBackend>::lora_linear(
        x.into_dispatch(),
        w.into_dispatch(),
        a.into_dispatch(),
        b.into_dispatch(),
        scale as f32,
        dropout,
    ))
}

/// `x [n, in] · W [in, out]` with `W` frozen through the fused kernels: the LoRA projection
/// with a rank-0 adapter (empty `A`, `B`), so that frozen projections take the workspace's
/// GEMM at the instruction-set level in use (`kd_kernels::cpu::level`), as adapted ones do.
/// `W` must not require gradients; `x` may (its gradient is `g · Wᵀ`).
pub fn fused_frozen_linear(x: Tensor<2>, w: Tensor<2>) -> Tensor<2> {
    let [din, dout] = w.dims();
    let device = x.device();
    let empty = |shape: [usize; 2]| {
        Tensor::<2>::from_data(TensorData::new(Vec::<f32>::new(), shape), &device)
    };
    fused_lora_linear(x, w, empty([din, 0]), empty([0, dout]), 0.0, None)
}

/// RMSNorm over the last axis (`burn::nn::RmsNorm`'s arithmetic) through the fused kernels.
pub fn fused_rms_norm<const D: usize>(x: Tensor<D>, gamma: Tensor<1>, eps: f64) -> Tensor<D> {
    Tensor::from_dispatch(<burn::backend::Dispatch as TrainOpsBackend>::rms_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        eps as f32,
    ))
}

/// `silu(gate) · up` through the fused kernels.
pub fn fused_swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<burn::backend::Dispatch as TrainOpsBackend>::swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
    ))
}

pub(crate) fn flex(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

pub(crate) fn shape(t: &FlexTensor) -> Vec<usize> {
    t.layout().shape().to_vec()
}

impl TrainOpsBackend for Flex {
    fn masked_attention(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        job: AttentionJob,
    ) -> (FlexTensor, FlexTensor) {
        attention::flex_forward(q, k, v, job)
    }

    fn masked_attention_backward(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        out: FlexTensor,
        lse: FlexTensor,
        dout: FlexTensor,
        job: AttentionJob,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        attention::flex_backward(q, k, v, (out, lse, dout), job)
    }

    fn lora_linear(
        x: FlexTensor,
        w: FlexTensor,
        a: FlexTensor,
        b: FlexTensor,
        scale: f32,
        dropout: Option<LoraDropout>,
    ) -> FlexTensor {
        lora::flex_forward(x, w, (a, b), scale, dropout)
    }

    fn lora_linear_backward(
        x: FlexTensor,
        w: FlexTensor,
        a: FlexTensor,
        b: FlexTensor,
        dout: FlexTensor,
        scale: f32,
        dropout: Option<LoraDropout>,
        want_dx: bool,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        lora::flex_backward(x, w, (a, b), dout, scale, dropout, want_dx)
    }

    fn rms_norm(x: FlexTensor, gamma: FlexTensor, eps: f32) -> FlexTensor {
        norm::flex_forward(x, gamma, eps)
    }

    fn rms_norm_backward(
        x: FlexTensor,
        gamma: FlexTensor,
        dout: FlexTensor,
        eps: f32,
    ) -> (FlexTensor, FlexTensor) {
        norm::flex_backward(x, gamma, dout, eps)
    }

    fn swiglu(gate: FlexTensor, up: FlexTensor) -> FlexTensor {
        swiglu::flex_forward(gate, up)
    }

    fn swiglu_backward(
        gate: FlexTensor,
        up: FlexTensor,
        dout: FlexTensor,
    ) -> (FlexTensor, FlexTensor) {
        swiglu::flex_backward(gate, up, dout)
    }
}

/// A float tensor of the autodiff backend over `B`.
pub(crate) type AdTensor<B, C> = FloatTensor<Autodiff<B, C>>;

/// `from_inner` of the autodiff backend, for the gradients of the explicit backward ops.
fn inner<B: Backend, C: CheckpointStrategy>(t: FloatTensor<B>) -> FloatTensor<Autodiff<B, C>> {
    <Autodiff<B, C> as AutodiffBackend>::from_inner(t)
}

impl<B: Backend + TrainOpsBackend, C: CheckpointStrategy> TrainOpsBackend for Autodiff<B, C> {
    fn masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        job: AttentionJob,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention::autodiff_forward::<B, C>(q, k, v, job)
    }

    fn masked_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        job: AttentionJob,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dk, dv) = B::masked_attention_backward(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            out.into_primitive(),
            lse.into_primitive(),
            dout.into_primitive(),
            job,
        );
        (inner::<B, C>(dq), inner::<B, C>(dk), inner::<B, C>(dv))
    }

    fn lora_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        scale: f32,
        dropout: Option<LoraDropout>,
    ) -> FloatTensor<Self> {
        lora::autodiff_forward::<B, C>(x, w, (a, b), scale, dropout)
    }

    fn lora_linear_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        scale: f32,
        dropout: Option<LoraDropout>,
        want_dx: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, da, db) = B::lora_linear_backward(
            x.into_primitive(),
            w.into_primitive(),
            a.into_primitive(),
            b.into_primitive(),
            dout.into_primitive(),
            scale,
            dropout,
            want_dx,
        );
        (inner::<B, C>(dx), inner::<B, C>(da), inner::<B, C>(db))
    }

    fn rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        norm::autodiff_forward::<B, C>(x, gamma, eps)
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dgamma) = B::rms_norm_backward(
            x.into_primitive(),
            gamma.into_primitive(),
            dout.into_primitive(),
            eps,
        );
        (inner::<B, C>(dx), inner::<B, C>(dgamma))
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu::autodiff_forward::<B, C>(gate, up)
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dout: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dg, du) = B::swiglu_backward(
            gate.into_primitive(),
            up.into_primitive(),
            dout.into_primitive(),
        );
        (inner::<B, C>(dg), inner::<B, C>(du))
    }
}

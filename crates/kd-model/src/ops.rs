//! Fused CPU training kernels: masked attention and SwiGLU, each one forward pass and one
//! backward pass on host memory, handed to autodiff as Burn backend extensions (the flex
//! backend, with or without autodiff over it).
//!
//! Burn's attention under autodiff falls back to a graph of matmul, mask, max, exp, sum and
//! div ops (with the key/value heads repeated for grouped-query attention), and its SiLU is
//! `x · exp(−ln(1 + e^−x))`: on the bench model these two took about 60% of the time of the
//! transformer body. Here attention runs per (batch, KV head) with the query heads of the group
//! sharing K and V, keeps the softmax probabilities for the backward pass (the memory Burn's
//! graph keeps anyway), and the exponentials are the vectorised ones of `kd_loss`.
//!
//! Other devices and dtypes take Burn's own ops ([`applies`]).

use std::sync::Arc;

use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, Flex, backend_extension};
use burn::tensor::{Bool, DType, Device, Tensor, TensorData};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_flex::FlexTensor;
use gemm::{Parallelism, gemm};
use kd_loss::f32_view;
use kd_loss::kernels::math::{self, exp};
use rayon::prelude::*;

/// The mask and scale of one attention call.
#[derive(Debug, Clone)]
pub struct AttentionJob {
    /// `[batch, seq, keys]`, `true` = masked out (shared by all heads).
    pub mask: Arc<[bool]>,
    /// The key range of each batch row's query blocks ([`key_spans`] of `mask`), shared by
    /// the forward and backward passes.
    pub spans: Arc<[(usize, usize)]>,
    /// Multiplier of `q · k`.
    pub scale: f32,
}

/// Fused training kernels as a Burn backend extension.
#[backend_extension(Flex, Autodiff)]
pub trait TrainOpsBackend: Backend {
    /// Masked softmax attention with grouped K/V heads: `q [b, h, s, d]`, `k`, `v`
    /// `[b, kv, t, d]` → `(out [b, h, s, d], probabilities [b, h, s, t])`.
    fn masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        job: AttentionJob,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients `(dq, dk, dv)` of [`masked_attention`](Self::masked_attention) given the
    /// probabilities it returned and the gradient of its output.
    fn masked_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        job: AttentionJob,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// A LoRA projection `x · W + scale · (x · A) · B` with `W` frozen: `x [n, in]`,
    /// `w [in, out]`, `a [in, r]`, `b [r, out]` → `[n, out]`. Under autodiff the gradients
    /// of `x`, `A` and `B` come from [`lora_linear_backward`](Self::lora_linear_backward).
    fn lora_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        scale: f32,
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
/// `mask` is `[batch, 1, seq, keys]` with `true` = masked. Fully masked rows give zeros.
pub fn fused_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: &Tensor<4, Bool>,
    scale: f64,
) -> Tensor<4> {
    let [b, _, s, t] = mask.dims();
    let mask: Vec<bool> = mask
        .clone()
        .into_data()
        .convert::<bool>()
        .try_into_vec::<bool>()
        .expect("bool mask");
    debug_assert_eq!(mask.len(), b * s * t);
    let job = AttentionJob {
        spans: key_spans(&mask, b, s, t).into(),
        mask: mask.into(),
        scale: scale as f32,
    };
    let (out, _) = <burn::backend::Dispatch as TrainOpsBackend>::masked_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        job,
    );
    Tensor::from_dispatch(out)
}

/// A LoRA projection `x · W + scale · (x · A) · B` through the fused kernels (see
/// [`TrainOpsBackend::lora_linear`]): one product with the frozen `W` forward, one backward,
/// the low-rank terms added into their outputs. `W` must not require gradients.
pub fn fused_lora_linear(
    x: Tensor<2>,
    w: Tensor<2>,
    a: Tensor<2>,
    b: Tensor<2>,
    scale: f64,
) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as TrainOpsBackend>::lora_linear(
        x.into_dispatch(),
        w.into_dispatch(),
        a.into_dispatch(),
        b.into_dispatch(),
        scale as f32,
    ))
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

fn dims4(t: &FlexTensor) -> [usize; 4] {
    let shape = t.layout().shape().to_vec();
    shape.try_into().expect("a rank-4 tensor")
}

fn flex(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// `dst [m, n] = beta · lhs [m, k] · rhs [k, n] (+ dst when accumulate)`, each operand given
/// by its pointer and (row, column) strides; single-threaded (callers run heads in parallel).
///
/// # Safety
/// Every index `(i, j)` inside the shapes must be in bounds of its buffer under its strides.
#[allow(clippy::too_many_arguments)]
unsafe fn matmul(
    dims: (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    lhs: *const f32,
    lhs_strides: (usize, usize),
    rhs: *const f32,
    rhs_strides: (usize, usize),
    beta: f32,
) {
    // SAFETY: forwarded contract.
    unsafe {
        matmul_with(
            Parallelism::None,
            dims,
            dst,
            dst_rs,
            accumulate,
            lhs,
            lhs_strides,
            rhs,
            rhs_strides,
            beta,
        )
    }
}

/// [`matmul`] with a choice of threading.
///
/// # Safety
/// As [`matmul`].
#[allow(clippy::too_many_arguments)]
unsafe fn matmul_with(
    parallelism: Parallelism,
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    lhs: *const f32,
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: *const f32,
    (rhs_rs, rhs_cs): (usize, usize),
    beta: f32,
) {
    // SAFETY: the caller guarantees the strided ranges are in bounds.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs,
            lhs_cs as isize,
            lhs_rs as isize,
            rhs,
            rhs_cs as isize,
            rhs_rs as isize,
            if accumulate { 1.0 } else { 0.0 },
            beta,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Whether the AVX2/FMA builds of the elementwise kernels can run here.
fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines `$name(simd, args..)`: the body compiled twice, for AVX2/FMA (chosen at run time)
/// and for the baseline target. Plain `*` and `+` only, so both give the same bits.
macro_rules! dispatch {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$doc])*
        fn $name(simd: bool, $($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) {
                body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: the caller checked that the CPU has AVX2 and FMA.
                unsafe { avx2($($arg),*) };
                return;
            }
            let _ = simd;
            body($($arg),*)
        }
    };
}

dispatch! {
    /// Softmax of one row of scores in place; masked entries and a fully masked row give 0.
    fn masked_softmax_row(row: &mut [f32], mask: &[bool]) {
        for (x, m) in row.iter_mut().zip(mask) {
            if *m {
                *x = f32::NEG_INFINITY;
            }
        }
        let max = math::max(row);
        if max == f32::NEG_INFINITY {
            row.fill(0.0);
            return;
        }
        for x in row.iter_mut() {
            *x = exp(*x - max);
        }
        let sum = math::sum_map(row, |x| x);
        for x in row.iter_mut() {
            *x /= sum;
        }
    }
}

dispatch! {
    /// dS = P ⊙ (dP − Σ_j P dP) · scale for one row (the softmax backward, then the score
    /// scale), in place of dP.
    fn softmax_backward_row(ds: &mut [f32], probs: &[f32], scale: f32) {
        let dot = math::sum_map2(ds, probs, |a, b| a * b);
        for (x, p) in ds.iter_mut().zip(probs) {
            *x = p * (*x - dot) * scale;
        }
    }
}

/// Query rows per block of the attention kernels; each block only visits the keys between
/// the first and the last one any of its rows may see (about half the work when causal).
const QUERY_BLOCK: usize = 64;

/// For each batch row and block of [`QUERY_BLOCK`] queries, the key range `k0..k1` that
/// holds every unmasked key of the block (`(0, 0)` when the block sees none).
pub fn key_spans(mask: &[bool], b: usize, s: usize, t: usize) -> Vec<(usize, usize)> {
    let blocks = s.div_ceil(QUERY_BLOCK);
    let mut spans = Vec::with_capacity(b * blocks);
    for bi in 0..b {
        for blk in 0..blocks {
            let (mut k0, mut k1) = (t, 0);
            for i in blk * QUERY_BLOCK..((blk + 1) * QUERY_BLOCK).min(s) {
                let row = &mask[(bi * s + i) * t..][..t];
                if let Some(first) = row.iter().position(|m| !m) {
                    let last = row.iter().rposition(|m| !m).expect("an unmasked key");
                    k0 = k0.min(first);
                    k1 = k1.max(last + 1);
                }
            }
            spans.push(if k1 > k0 { (k0, k1) } else { (0, 0) });
        }
    }
    spans
}

struct AttnDims {
    b: usize,
    h: usize,
    kv: usize,
    s: usize,
    t: usize,
    d: usize,
}

fn shape(t: &FlexTensor) -> Vec<usize> {
    t.layout().shape().to_vec()
}

/// The dimensions of an attention call, after checking that every operand fits them: the
/// kernels index raw buffers with these dimensions, so a mismatch must stop here (a panic
/// naming the shapes) rather than reach an unchecked GEMM.
fn attention_dims(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    job: &AttentionJob,
    backward: Option<(&FlexTensor, &FlexTensor)>,
) -> AttnDims {
    let (qs, ks, vs) = (shape(q), shape(k), shape(v));
    assert!(
        qs.len() == 4 && ks.len() == 4 && ks == vs,
        "masked_attention: q {qs:?}, k {ks:?} and v {vs:?} must be [b, h, s, d], [b, kv, t, d], [b, kv, t, d]"
    );
    let [b, h, s, d] = dims4(q);
    let [kb, kv, t, kd] = dims4(k);
    assert!(
        kb == b && kd == d && kv > 0 && h % kv == 0,
        "masked_attention: q {qs:?} and k {ks:?} do not agree (batch, head width, heads a multiple of the K/V heads)"
    );
    assert_eq!(
        job.mask.len(),
        b * s * t,
        "masked_attention: the mask must hold [b, s, t] = [{b}, {s}, {t}] entries"
    );
    let blocks = s.div_ceil(QUERY_BLOCK);
    assert!(
        job.spans.len() == b * blocks && job.spans.iter().all(|(k0, k1)| k0 <= k1 && *k1 <= t),
        "masked_attention: the key spans must be `key_spans` of the mask ({} blocks of keys 0..{t})",
        b * blocks
    );
    if let Some((probs, dout)) = backward {
        assert_eq!(
            shape(probs),
            [b, h, s, t],
            "masked_attention_backward: the probabilities' shape"
        );
        assert_eq!(
            shape(dout),
            qs,
            "masked_attention_backward: the output gradient's shape"
        );
    }
    AttnDims { b, h, kv, s, t, d }
}

fn attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    job: &AttentionJob,
    n: &AttnDims,
) -> (Vec<f32>, Vec<f32>) {
    let AttnDims { b, h, kv, s, t, d } = *n;
    let (mask, spans, scale) = (&job.mask, &job.spans, job.scale);
    let groups = h / kv;
    let simd = simd();
    let mut out = vec![0f32; b * h * s * d];
    let mut probs = vec![0f32; b * h * s * t];
    let blocks = s.div_ceil(QUERY_BLOCK);
    out.par_chunks_mut(s * d)
        .zip(probs.par_chunks_mut(s * t))
        .enumerate()
        .for_each(|(bh, (o, p))| {
            let (bi, hi) = (bh / h, bh % h);
            let g = bi * kv + hi / groups;
            let qh = &q[bh * s * d..][..s * d];
            let kh = &k[g * t * d..][..t * d];
            let vh = &v[g * t * d..][..t * d];
            let mh = &mask[bi * s * t..][..s * t];
            for (blk, &(k0, k1)) in spans[bi * blocks..(bi + 1) * blocks].iter().enumerate() {
                // Rows that see no key stay zero (out and probabilities).
                if k1 == 0 {
                    continue;
                }
                let i0 = blk * QUERY_BLOCK;
                let (rb, kl) = (QUERY_BLOCK.min(s - i0), k1 - k0);
                // SAFETY: rows i0..i0 + rb, keys k0..k1 lie inside the slices above, whose
                // strides are given.
                unsafe {
                    // scores = scale · Q Kᵀ
                    matmul(
                        (rb, kl, d),
                        p[i0 * t + k0..].as_mut_ptr(),
                        t,
                        false,
                        qh[i0 * d..].as_ptr(),
                        (d, 1),
                        kh[k0 * d..].as_ptr(),
                        (1, d),
                        scale,
                    );
                }
                for i in i0..i0 + rb {
                    let at = i * t;
                    masked_softmax_row(simd, &mut p[at + k0..at + k1], &mh[at + k0..at + k1]);
                }
                // SAFETY: as above.
                unsafe {
                    matmul(
                        (rb, d, kl),
                        o[i0 * d..].as_mut_ptr(),
                        d,
                        false,
                        p[i0 * t + k0..].as_ptr(),
                        (t, 1),
                        vh[k0 * d..].as_ptr(),
                        (d, 1),
                        1.0,
                    );
                }
            }
        });
    (out, probs)
}

#[allow(clippy::too_many_arguments)]
fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[f32],
    dout: &[f32],
    job: &AttentionJob,
    n: &AttnDims,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let AttnDims { b, h, kv, s, t, d } = *n;
    let (spans, scale) = (&job.spans, job.scale);
    let groups = h / kv;
    let simd = simd();
    let mut dq = vec![0f32; b * h * s * d];
    let mut dk = vec![0f32; b * kv * t * d];
    let mut dv = vec![0f32; b * kv * t * d];
    let blocks = s.div_ceil(QUERY_BLOCK);
    // One task per (batch, KV head): the query heads of a group add into the same dK, dV.
    dq.par_chunks_mut(groups * s * d)
        .zip(dk.par_chunks_mut(t * d))
        .zip(dv.par_chunks_mut(t * d))
        .enumerate()
        .for_each(|(bg, ((dqg, dkg), dvg))| {
            let bi = bg / kv;
            let kh = &k[bg * t * d..][..t * d];
            let vh = &v[bg * t * d..][..t * d];
            let mut ds = vec![0f32; s * t];
            for j in 0..groups {
                let bh = bi * h + (bg % kv) * groups + j;
                let ph = &probs[bh * s * t..][..s * t];
                let doh = &dout[bh * s * d..][..s * d];
                let qh = &q[bh * s * d..][..s * d];
                let dqh = &mut dqg[j * s * d..][..s * d];
                for (blk, &(k0, k1)) in spans[bi * blocks..(bi + 1) * blocks].iter().enumerate() {
                    if k1 == 0 {
                        continue;
                    }
                    let i0 = blk * QUERY_BLOCK;
                    let (rb, kl) = (QUERY_BLOCK.min(s - i0), k1 - k0);
                    // SAFETY: rows i0..i0 + rb, keys k0..k1 lie inside the slices above,
                    // whose strides are given; dK and dV start zeroed and accumulate.
                    unsafe {
                        // dV += Pᵀ dO
                        matmul(
                            (kl, d, rb),
                            dvg[k0 * d..].as_mut_ptr(),
                            d,
                            true,
                            ph[i0 * t + k0..].as_ptr(),
                            (1, t),
                            doh[i0 * d..].as_ptr(),
                            (d, 1),
                            1.0,
                        );
                        // dP = dO Vᵀ
                        matmul(
                            (rb, kl, d),
                            ds[i0 * t + k0..].as_mut_ptr(),
                            t,
                            false,
                            doh[i0 * d..].as_ptr(),
                            (d, 1),
                            vh[k0 * d..].as_ptr(),
                            (1, d),
                            1.0,
                        );
                    }
                    for i in i0..i0 + rb {
                        let at = i * t;
                        let (drow, prow) = (&mut ds[at + k0..at + k1], &ph[at + k0..at + k1]);
                        softmax_backward_row(simd, drow, prow, scale);
                    }
                    // SAFETY: as above.
                    unsafe {
                        // dQ = dS K
                        matmul(
                            (rb, d, kl),
                            dqh[i0 * d..].as_mut_ptr(),
                            d,
                            false,
                            ds[i0 * t + k0..].as_ptr(),
                            (t, 1),
                            kh[k0 * d..].as_ptr(),
                            (d, 1),
                            1.0,
                        );
                        // dK += dSᵀ Q
                        matmul(
                            (kl, d, rb),
                            dkg[k0 * d..].as_mut_ptr(),
                            d,
                            true,
                            ds[i0 * t + k0..].as_ptr(),
                            (1, t),
                            qh[i0 * d..].as_ptr(),
                            (d, 1),
                            1.0,
                        );
                    }
                }
            }
        });
    (dq, dk, dv)
}

/// Elements per parallel task of the SwiGLU kernels.
const SWIGLU_CHUNK: usize = 1 << 14;

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

dispatch! {
    /// `out = silu(gate) · up`.
    fn swiglu_chunk(out: &mut [f32], gate: &[f32], up: &[f32]) {
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
    let simd = simd();
    let mut out = vec![0f32; gate.len()];
    out.par_chunks_mut(SWIGLU_CHUNK)
        .zip(gate.par_chunks(SWIGLU_CHUNK))
        .zip(up.par_chunks(SWIGLU_CHUNK))
        .for_each(|((o, g), u)| swiglu_chunk(simd, o, g, u));
    out
}

fn swiglu_grads(gate: &[f32], up: &[f32], dout: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let simd = simd();
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

/// Rows per parallel task of the RMSNorm kernels.
const NORM_ROWS: usize = 32;

dispatch! {
    /// `y = x / rms · gamma` for rows of `gamma.len()` values.
    fn rms_norm_rows(y: &mut [f32], x: &[f32], gamma: &[f32], eps: f32) {
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

/// Whether a product of this size is worth threading inside the GEMM.
fn threads_for(m: usize, n: usize, k: usize) -> Parallelism {
    if m * n * k >= 1 << 18 {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}

/// `x · W + scale · (x · A) · B`, all row-major.
fn lora_forward(
    x: &[f32],
    w: &[f32],
    a: &[f32],
    b: &[f32],
    (n, din, dout, r): (usize, usize, usize, usize),
    scale: f32,
) -> Vec<f32> {
    let mut y = vec![0f32; n * dout];
    let mut t = vec![0f32; n * r];
    // SAFETY: every operand is a contiguous row-major buffer of the shape given.
    unsafe {
        matmul_with(
            threads_for(n, dout, din),
            (n, dout, din),
            y.as_mut_ptr(),
            dout,
            false,
            x.as_ptr(),
            (din, 1),
            w.as_ptr(),
            (dout, 1),
            1.0,
        );
        matmul_with(
            threads_for(n, r, din),
            (n, r, din),
            t.as_mut_ptr(),
            r,
            false,
            x.as_ptr(),
            (din, 1),
            a.as_ptr(),
            (r, 1),
            1.0,
        );
        matmul_with(
            threads_for(n, dout, r),
            (n, dout, r),
            y.as_mut_ptr(),
            dout,
            true,
            t.as_ptr(),
            (r, 1),
            b.as_ptr(),
            (dout, 1),
            scale,
        );
    }
    y
}

/// `(dx, dA, dB)` of [`lora_forward`] given `g = d y`.
#[allow(clippy::too_many_arguments)]
fn lora_grads(
    x: &[f32],
    w: &[f32],
    a: &[f32],
    b: &[f32],
    g: &[f32],
    (n, din, dout, r): (usize, usize, usize, usize),
    scale: f32,
    want_dx: bool,
) -> (Option<Vec<f32>>, Vec<f32>, Vec<f32>) {
    let mut t = vec![0f32; n * r];
    let mut u = vec![0f32; n * r];
    let mut da = vec![0f32; din * r];
    let mut db = vec![0f32; r * dout];
    let mut dx = want_dx.then(|| vec![0f32; n * din]);
    // SAFETY: every operand is a contiguous row-major buffer of the shape given; transposes
    // are expressed by swapped strides.
    unsafe {
        // t = x · A (recomputed: cheaper than keeping it), u = g · Bᵀ
        matmul_with(
            threads_for(n, r, din),
            (n, r, din),
            t.as_mut_ptr(),
            r,
            false,
            x.as_ptr(),
            (din, 1),
            a.as_ptr(),
            (r, 1),
            1.0,
        );
        matmul_with(
            threads_for(n, r, dout),
            (n, r, dout),
            u.as_mut_ptr(),
            r,
            false,
            g.as_ptr(),
            (dout, 1),
            b.as_ptr(),
            (1, dout),
            1.0,
        );
        // dA = scale · xᵀ · u, dB = scale · tᵀ · g
        matmul_with(
            threads_for(din, r, n),
            (din, r, n),
            da.as_mut_ptr(),
            r,
            false,
            x.as_ptr(),
            (1, din),
            u.as_ptr(),
            (r, 1),
            scale,
        );
        matmul_with(
            threads_for(r, dout, n),
            (r, dout, n),
            db.as_mut_ptr(),
            dout,
            false,
            t.as_ptr(),
            (1, r),
            g.as_ptr(),
            (dout, 1),
            scale,
        );
        if let Some(dx) = dx.as_mut() {
            // dx = g · Wᵀ + scale · u · Aᵀ
            matmul_with(
                threads_for(n, din, dout),
                (n, din, dout),
                dx.as_mut_ptr(),
                din,
                false,
                g.as_ptr(),
                (dout, 1),
                w.as_ptr(),
                (1, dout),
                1.0,
            );
            matmul_with(
                threads_for(n, din, r),
                (n, din, r),
                dx.as_mut_ptr(),
                din,
                true,
                u.as_ptr(),
                (r, 1),
                a.as_ptr(),
                (1, r),
                scale,
            );
        }
    }
    (dx, da, db)
}

/// `(n, in, out, r)` of a LoRA projection, after checking that `x [n, in]`, `w [in, out]`,
/// `a [in, r]`, `b [r, out]` (and the output gradient `[n, out]`) agree: the GEMMs index raw
/// buffers with these dimensions.
fn lora_dims(
    x: &FlexTensor,
    w: &FlexTensor,
    a: &FlexTensor,
    b: &FlexTensor,
    dout: Option<&FlexTensor>,
) -> (usize, usize, usize, usize) {
    let (xs, ws, as_, bs) = (shape(x), shape(w), shape(a), shape(b));
    assert!(
        xs.len() == 2 && ws.len() == 2 && as_.len() == 2 && bs.len() == 2,
        "lora_linear: x {xs:?}, w {ws:?}, a {as_:?}, b {bs:?} must all be matrices"
    );
    let (n, din, dout_dim, r) = (xs[0], xs[1], ws[1], as_[1]);
    assert!(
        ws[0] == din && as_[0] == din && bs == [r, dout_dim],
        "lora_linear: x {xs:?}, w {ws:?}, a {as_:?}, b {bs:?} do not form x [n, in] · w [in, out] + x · a [in, r] · b [r, out]"
    );
    if let Some(g) = dout {
        assert_eq!(
            shape(g),
            [n, dout_dim],
            "lora_linear_backward: the output gradient's shape"
        );
    }
    (n, din, dout_dim, r)
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

impl TrainOpsBackend for Flex {
    fn rms_norm(x: FlexTensor, gamma: FlexTensor, eps: f32) -> FlexTensor {
        let shape = x.layout().shape().to_vec();
        check_norm(&shape, &gamma, None);
        let (x, gamma) = (f32_view(&x), f32_view(&gamma));
        let d = gamma.len();
        let simd = simd();
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(NORM_ROWS * d)
            .zip(x.par_chunks(NORM_ROWS * d))
            .for_each(|(yc, xc)| rms_norm_rows(simd, yc, xc, &gamma, eps));
        flex(y, shape)
    }

    fn rms_norm_backward(
        x: FlexTensor,
        gamma: FlexTensor,
        dout: FlexTensor,
        eps: f32,
    ) -> (FlexTensor, FlexTensor) {
        let shape = x.layout().shape().to_vec();
        check_norm(&shape, &gamma, Some(&dout));
        let (x, gamma, dy) = (f32_view(&x), f32_view(&gamma), f32_view(&dout));
        let d = gamma.len();
        let simd = simd();
        let mut dx = vec![0f32; x.len()];
        // Per-task partial dgamma, summed in task order (deterministic).
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
        (flex(dx, shape), flex(dgamma, vec![d]))
    }

    fn lora_linear(
        x: FlexTensor,
        w: FlexTensor,
        a: FlexTensor,
        b: FlexTensor,
        scale: f32,
    ) -> FlexTensor {
        let dims = lora_dims(&x, &w, &a, &b, None);
        let y = lora_forward(
            &f32_view(&x),
            &f32_view(&w),
            &f32_view(&a),
            &f32_view(&b),
            dims,
            scale,
        );
        flex(y, vec![dims.0, dims.2])
    }

    fn lora_linear_backward(
        x: FlexTensor,
        w: FlexTensor,
        a: FlexTensor,
        b: FlexTensor,
        dout: FlexTensor,
        scale: f32,
        want_dx: bool,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        let dims = lora_dims(&x, &w, &a, &b, Some(&dout));
        let (n, din, dout_dim, r) = dims;
        let (dx, da, db) = lora_grads(
            &f32_view(&x),
            &f32_view(&w),
            &f32_view(&a),
            &f32_view(&b),
            &f32_view(&dout),
            dims,
            scale,
            want_dx,
        );
        let dx = match dx {
            Some(dx) => flex(dx, vec![n, din]),
            None => flex(vec![0.0], vec![1]),
        };
        (dx, flex(da, vec![din, r]), flex(db, vec![r, dout_dim]))
    }

    fn masked_attention(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        job: AttentionJob,
    ) -> (FlexTensor, FlexTensor) {
        let n = attention_dims(&q, &k, &v, &job, None);
        let (out, probs) = attention_forward(&f32_view(&q), &f32_view(&k), &f32_view(&v), &job, &n);
        (
            flex(out, vec![n.b, n.h, n.s, n.d]),
            flex(probs, vec![n.b, n.h, n.s, n.t]),
        )
    }

    fn masked_attention_backward(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        probs: FlexTensor,
        dout: FlexTensor,
        job: AttentionJob,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        let n = attention_dims(&q, &k, &v, &job, Some((&probs, &dout)));
        let (dq, dk, dv) = attention_backward(
            &f32_view(&q),
            &f32_view(&k),
            &f32_view(&v),
            &f32_view(&probs),
            &f32_view(&dout),
            &job,
            &n,
        );
        (
            flex(dq, vec![n.b, n.h, n.s, n.d]),
            flex(dk, vec![n.b, n.kv, n.t, n.d]),
            flex(dv, vec![n.b, n.kv, n.t, n.d]),
        )
    }

    fn swiglu(gate: FlexTensor, up: FlexTensor) -> FlexTensor {
        let shape = gate.layout().shape().to_vec();
        assert_eq!(
            self::shape(&up),
            shape,
            "swiglu: gate and up must have one shape"
        );
        flex(swiglu_forward(&f32_view(&gate), &f32_view(&up)), shape)
    }

    fn swiglu_backward(
        gate: FlexTensor,
        up: FlexTensor,
        dout: FlexTensor,
    ) -> (FlexTensor, FlexTensor) {
        let shape = gate.layout().shape().to_vec();
        assert!(
            self::shape(&up) == shape && self::shape(&dout) == shape,
            "swiglu_backward: gate, up and the output gradient must have one shape"
        );
        let (dg, du) = swiglu_grads(&f32_view(&gate), &f32_view(&up), &f32_view(&dout));
        (flex(dg, shape.clone()), flex(du, shape))
    }
}

impl<B: Backend + TrainOpsBackend, C: CheckpointStrategy> TrainOpsBackend for Autodiff<B, C> {
    fn masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        job: AttentionJob,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        #[derive(Debug)]
        struct AttentionBackward;

        impl<B: Backend + TrainOpsBackend> Backward<B, 3> for AttentionBackward {
            type State = (
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                AttentionJob,
            );

            fn backward(
                self,
                ops: Ops<Self::State, 3>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let (q, k, v, probs, job) = ops.state;
                let dout = grads.consume::<B>(&ops.node);
                let (dq, dk, dv) = B::masked_attention_backward(q, k, v, probs, dout, job);
                for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
                    if let Some(node) = parent {
                        grads.register::<B>(node.id, grad);
                    }
                }
            }
        }

        let guards = [q.node(), k.node(), v.node()];
        let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
        let (out, probs) = B::masked_attention(q.clone(), k.clone(), v.clone(), job.clone());
        let out = match AttentionBackward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((q, k, v, probs.clone(), job), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        (out, <Self as AutodiffBackend>::from_inner(probs))
    }

    fn masked_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        job: AttentionJob,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dk, dv) = B::masked_attention_backward(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            probs.into_primitive(),
            dout.into_primitive(),
            job,
        );
        (
            <Self as AutodiffBackend>::from_inner(dq),
            <Self as AutodiffBackend>::from_inner(dk),
            <Self as AutodiffBackend>::from_inner(dv),
        )
    }

    fn lora_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LoraBackward;

        impl<B: Backend + TrainOpsBackend> Backward<B, 3> for LoraBackward {
            type State = (
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                f32,
            );

            fn backward(
                self,
                ops: Ops<Self::State, 3>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let (x, w, a, b, scale) = ops.state;
                let dout = grads.consume::<B>(&ops.node);
                let [px, pa, pb] = ops.parents;
                let (dx, da, db) = B::lora_linear_backward(x, w, a, b, dout, scale, px.is_some());
                for (parent, grad) in [(px, dx), (pa, da), (pb, db)] {
                    if let Some(node) = parent {
                        grads.register::<B>(node.id, grad);
                    }
                }
            }
        }

        assert!(
            !w.is_tracked(),
            "lora_linear: the base weight must be frozen (it gets no gradient)"
        );
        let guards = [x.node(), a.node(), b.node()];
        let (x, w, a, b) = (
            x.into_primitive(),
            w.into_primitive(),
            a.into_primitive(),
            b.into_primitive(),
        );
        let y = B::lora_linear(x.clone(), w.clone(), a.clone(), b.clone(), scale);
        match LoraBackward.prepare::<C>(guards).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x, w, a, b, scale), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn lora_linear_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        scale: f32,
        want_dx: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, da, db) = B::lora_linear_backward(
            x.into_primitive(),
            w.into_primitive(),
            a.into_primitive(),
            b.into_primitive(),
            dout.into_primitive(),
            scale,
            want_dx,
        );
        (
            <Self as AutodiffBackend>::from_inner(dx),
            <Self as AutodiffBackend>::from_inner(da),
            <Self as AutodiffBackend>::from_inner(db),
        )
    }

    fn rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct RmsNormBackward;

        impl<B: Backend + TrainOpsBackend> Backward<B, 2> for RmsNormBackward {
            type State = (FloatTensor<B>, FloatTensor<B>, f32);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
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
        (
            <Self as AutodiffBackend>::from_inner(dx),
            <Self as AutodiffBackend>::from_inner(dgamma),
        )
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct SwigluBackward;

        impl<B: Backend + TrainOpsBackend> Backward<B, 2> for SwigluBackward {
            type State = (FloatTensor<B>, FloatTensor<B>);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
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
        (
            <Self as AutodiffBackend>::from_inner(dg),
            <Self as AutodiffBackend>::from_inner(du),
        )
    }
}

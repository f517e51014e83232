//! The LoRA projection `x · W + scale · (dropout(x) · A) · B` with `W` frozen: one product
//! with `W` forward and one backward, the low-rank terms added into their outputs. LoRA
//! dropout is the mask of [`kd_lora::dropout_mask`] on the input of A, regenerated from its
//! seed in the backward pass (never stored), so the fused path gives the masks — and the
//! exact resume — of the unfused one.

use std::cell::Cell;

use burn::backend::Backend;
use burn::backend::tensor::FloatTensor;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_flex::FlexTensor;
use kd_kernels::f32_view;
use kd_kernels::gemm::{MatMut, MatRef, Threads, Write, matmul, matmul_into};
use rayon::prelude::*;

use super::{AdTensor, TrainOpsBackend, flex, shape};

/// LoRA dropout inside a fused projection: element `i` of the `[n, in]` input of A is kept
/// (and scaled by 1/(1 − p)) as [`kd_lora::dropout_mask`]`([n, in], p, seed)` decides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoraDropout {
    /// Probability of dropping an element, in [0, 1).
    pub p: f64,
    /// The mask's seed (the trainer's per-step, per-module seed).
    pub seed: u64,
}

thread_local! {
    static CALLS: Cell<u64> = const { Cell::new(0) };
}

/// How many fused LoRA projections (forward passes) the calling thread has run: a
/// diagnostic that lets tests check which path a model took.
pub fn fused_lora_calls() -> u64 {
    CALLS.with(Cell::get)
}

/// Elements per parallel task when applying a dropout mask.
const MASK_CHUNK: usize = 1 << 14;

/// `x ⊙ mask`, or `None` without dropout.
fn dropped(x: &[f32], dropout: Option<LoraDropout>) -> Option<Vec<f32>> {
    let LoraDropout { p, seed } = dropout.filter(|d| d.p > 0.0)?;
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(MASK_CHUNK)
        .zip(x.par_chunks(MASK_CHUNK))
        .enumerate()
        .for_each(|(c, (o, xc))| {
            kd_lora::dropout_fill(o, (c * MASK_CHUNK) as u64, p, seed);
            for (o, x) in o.iter_mut().zip(xc) {
                *o *= x;
            }
        });
    Some(out)
}

const GEMM: &str = "LoRA projection shapes";

/// `x · W + scale · (dropout(x) · A) · B`, all row-major.
fn forward(
    x: &[f32],
    w: &[f32],
    (a, b): (&[f32], &[f32]),
    (n, din, dout, r): (usize, usize, usize, usize),
    scale: f32,
    dropout: Option<LoraDropout>,
) -> Vec<f32> {
    // Outputs written whole by their first product: no zeroing pass.
    let (mut y, mut t) = (Vec::new(), Vec::new());
    let xm = dropped(x, dropout);
    let xa = xm.as_deref().unwrap_or(x);
    let m = |data, rows, cols| MatRef::row_major(data, rows, cols).expect(GEMM);
    matmul_into(&mut y, m(x, n, din), m(w, din, dout), 1.0, Threads::Auto).expect(GEMM);
    matmul_into(&mut t, m(xa, n, din), m(a, din, r), 1.0, Threads::Auto).expect(GEMM);
    matmul(
        MatMut::row_major(&mut y, n, dout).expect(GEMM),
        m(&t, n, r),
        m(b, r, dout),
        Write::Accumulate,
        scale,
        Threads::Auto,
    )
    .expect(GEMM);
    y
}

/// `(dx, dA, dB)` of [`forward`] given `g = d y`; `dx` only when `want_dx`.
#[allow(clippy::too_many_arguments)]
fn grads(
    x: &[f32],
    w: &[f32],
    (a, b): (&[f32], &[f32]),
    g: &[f32],
    (n, din, dout, r): (usize, usize, usize, usize),
    scale: f32,
    dropout: Option<LoraDropout>,
    want_dx: bool,
) -> (Option<Vec<f32>>, Vec<f32>, Vec<f32>) {
    let xm = dropped(x, dropout);
    let xa = xm.as_deref().unwrap_or(x);
    let m = |data, rows, cols| MatRef::row_major(data, rows, cols).expect(GEMM);
    let (mut t, mut u, mut da, mut db) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // t = dropout(x) · A (recomputed: cheaper than keeping it), u = g · Bᵀ
    matmul_into(&mut t, m(xa, n, din), m(a, din, r), 1.0, Threads::Auto).expect(GEMM);
    matmul_into(&mut u, m(g, n, dout), m(b, r, dout).t(), 1.0, Threads::Auto).expect(GEMM);
    // dA = scale · dropout(x)ᵀ · u, dB = scale · tᵀ · g
    matmul_into(
        &mut da,
        m(xa, n, din).t(),
        m(&u, n, r),
        scale,
        Threads::Auto,
    )
    .expect(GEMM);
    matmul_into(
        &mut db,
        m(&t, n, r).t(),
        m(g, n, dout),
        scale,
        Threads::Auto,
    )
    .expect(GEMM);
    let dx = want_dx.then(|| {
        // dx = g · Wᵀ + scale · (u · Aᵀ) ⊙ mask
        let mut dx = Vec::new();
        matmul_into(
            &mut dx,
            m(g, n, dout),
            m(w, din, dout).t(),
            1.0,
            Threads::Auto,
        )
        .expect(GEMM);
        match dropout.filter(|d| d.p > 0.0) {
            None => matmul(
                MatMut::row_major(&mut dx, n, din).expect(GEMM),
                m(&u, n, r),
                m(a, din, r).t(),
                Write::Accumulate,
                scale,
                Threads::Auto,
            )
            .expect(GEMM),
            Some(LoraDropout { p, seed }) => {
                let mut low = Vec::new();
                matmul_into(
                    &mut low,
                    m(&u, n, r),
                    m(a, din, r).t(),
                    scale,
                    Threads::Auto,
                )
                .expect(GEMM);
                dx.par_chunks_mut(MASK_CHUNK)
                    .zip(low.par_chunks_mut(MASK_CHUNK))
                    .enumerate()
                    .for_each(|(c, (dxc, lc))| {
                        let mut mask = vec![0f32; lc.len()];
                        kd_lora::dropout_fill(&mut mask, (c * MASK_CHUNK) as u64, p, seed);
                        for ((o, l), k) in dxc.iter_mut().zip(lc.iter()).zip(&mask) {
                            *o += l * k;
                        }
                    });
            }
        }
        dx
    });
    (dx, da, db)
}

/// `(n, in, out, r)` of a LoRA projection, after checking that `x [n, in]`, `w [in, out]`,
/// `a [in, r]`, `b [r, out]` (and the output gradient `[n, out]`) agree.
fn dims(
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

/// [`TrainOpsBackend::lora_linear`] on the CPU backend.
pub(crate) fn flex_forward(
    x: FlexTensor,
    w: FlexTensor,
    (a, b): (FlexTensor, FlexTensor),
    scale: f32,
    dropout: Option<LoraDropout>,
) -> FlexTensor {
    let d = dims(&x, &w, &a, &b, None);
    if let Some(LoraDropout { p, .. }) = dropout {
        assert!(
            (0.0..1.0).contains(&p),
            "lora_linear: the dropout probability must lie in [0, 1), got {p}"
        );
    }
    CALLS.with(|c| c.set(c.get() + 1));
    let y = forward(
        &f32_view(&x),
        &f32_view(&w),
        (&f32_view(&a), &f32_view(&b)),
        d,
        scale,
        dropout,
    );
    flex(y, vec![d.0, d.2])
}

/// [`TrainOpsBackend::lora_linear_backward`] on the CPU backend.
#[allow(clippy::too_many_arguments)]
pub(crate) fn flex_backward(
    x: FlexTensor,
    w: FlexTensor,
    (a, b): (FlexTensor, FlexTensor),
    dout: FlexTensor,
    scale: f32,
    dropout: Option<LoraDropout>,
    want_dx: bool,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let d = dims(&x, &w, &a, &b, Some(&dout));
    let (n, din, dout_dim, r) = d;
    let (dx, da, db) = grads(
        &f32_view(&x),
        &f32_view(&w),
        (&f32_view(&a), &f32_view(&b)),
        &f32_view(&dout),
        d,
        scale,
        dropout,
        want_dx,
    );
    let dx = match dx {
        Some(dx) => flex(dx, vec![n, din]),
        None => flex(vec![0.0], vec![1]),
    };
    (dx, flex(da, vec![din, r]), flex(db, vec![r, dout_dim]))
}

/// The autodiff node: forward on the inner backend, keeping `(x, w, a, b, scale, dropout)`.
pub(crate) fn autodiff_forward<B: Backend + TrainOpsBackend, C: CheckpointStrategy>(
    x: AdTensor<B, C>,
    w: AdTensor<B, C>,
    (a, b): (AdTensor<B, C>, AdTensor<B, C>),
    scale: f32,
    dropout: Option<LoraDropout>,
) -> AdTensor<B, C> {
    #[derive(Debug)]
    struct LoraBackward;

    type State<B> = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        f32,
        Option<LoraDropout>,
    );

    impl<B: Backend + TrainOpsBackend> Backward<B, 3> for LoraBackward {
        type State = State<B>;

        fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
            let (x, w, a, b, scale, dropout) = ops.state;
            let dout = grads.consume::<B>(&ops.node);
            let [px, pa, pb] = ops.parents;
            let (dx, da, db) =
                B::lora_linear_backward(x, w, a, b, dout, scale, dropout, px.is_some());
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
    let y = B::lora_linear(x.clone(), w.clone(), a.clone(), b.clone(), scale, dropout);
    match LoraBackward.prepare::<C>(guards).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((x, w, a, b, scale, dropout), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

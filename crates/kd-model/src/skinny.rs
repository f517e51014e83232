//! Matmuls for few rows (decoding) on the CPU backend: against the vocabulary matrix
//! (`[batch, hidden] · [vocab, hidden]ᵀ`) and against projection weights in Burn's `[in, out]`
//! layout. A general GEMM packs the whole right-hand matrix on every call, which for a
//! handful of rows costs more than the product; these kernels stream the matrix once, in
//! blocks in parallel, with register accumulators. Each output is a sequential FMA chain over
//! the inner dimension, so a row's result does not depend on the other rows of the batch.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Flex, backend_extension};
use burn::tensor::{DType, Tensor, TensorData};
use burn_flex::FlexTensor;
use kd_kernels::cpu::SimdLevel;
use kd_kernels::f32_view;
use rayon::prelude::*;

/// At most this many rows take the skinny path.
pub const MAX_ROWS: usize = 32;
const BLOCK: usize = 512;

/// The skinny matmul as a backend extension (CPU backend only).
#[backend_extension(Flex)]
pub trait SkinnyMatmulBackend: Backend {
    /// `x [rows, k] · eᵀ` with `e [n, k]` (a tied embedding used as the LM head).
    fn skinny_matmul_t(x: FloatTensor<Self>, e: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `x [rows, k] · w` with `w [k, n]` (a projection in Burn's layout).
    fn skinny_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// Columns per parallel task of [`skinny_matmul_host`].
const STRIP: usize = 64;

/// Scalar `x · w` for columns `j0..j0 + nb` into `acc [rows, nb]`.
fn axpy_strip(x: &[f32], w: &[f32], k: usize, n: usize, j0: usize, nb: usize, acc: &mut [f32]) {
    let rows = x.len() / k;
    for r in 0..rows {
        for j in 0..nb {
            let mut sum = 0f32;
            for i in 0..k {
                sum = x[r * k + i].mul_add(w[i * n + j0 + j], sum);
            }
            acc[r * nb + j] = sum;
        }
    }
}

/// The same with AVX2/FMA: blocks of 4 rows × 16 columns in eight register accumulators;
/// columns past a multiple of 16 take the scalar path (the same FMA chain).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn axpy_strip_avx2(
    x: &[f32],
    w: &[f32],
    k: usize,
    n: usize,
    j0: usize,
    nb: usize,
    acc: &mut [f32],
) {
    use std::arch::x86_64::*;
    let rows = x.len() / k;
    let vec_cols = nb / 16 * 16;
    assert!(w.len() >= k * n && j0 + nb <= n);
    let mut c = 0;
    while c < vec_cols {
        let mut r0 = 0;
        while r0 < rows {
            let g = (rows - r0).min(4);
            let xr = |q: usize| &x[(r0 + q.min(g - 1)) * k..(r0 + q.min(g - 1) + 1) * k];
            let (x0, x1, x2, x3) = (xr(0), xr(1), xr(2), xr(3));
            let z = _mm256_setzero_ps();
            let mut a = [z; 8];
            for i in 0..k {
                // `wrapping_add`: no per-load precondition checks in debug-assertion builds.
                // SAFETY: i * n + j0 + c + 16 <= k * n <= w.len() (asserted above).
                let (w0, w1) = unsafe {
                    let p = w.as_ptr().wrapping_add(i * n + j0 + c);
                    (_mm256_loadu_ps(p), _mm256_loadu_ps(p.wrapping_add(8)))
                };
                let b = [
                    _mm256_broadcast_ss(&x0[i]),
                    _mm256_broadcast_ss(&x1[i]),
                    _mm256_broadcast_ss(&x2[i]),
                    _mm256_broadcast_ss(&x3[i]),
                ];
                for q in 0..4 {
                    a[2 * q] = _mm256_fmadd_ps(b[q], w0, a[2 * q]);
                    a[2 * q + 1] = _mm256_fmadd_ps(b[q], w1, a[2 * q + 1]);
                }
            }
            for q in 0..g {
                let row = &mut acc[(r0 + q) * nb + c..(r0 + q) * nb + c + 16];
                // SAFETY: `row` holds 16 floats.
                unsafe {
                    _mm256_storeu_ps(row.as_mut_ptr(), a[2 * q]);
                    _mm256_storeu_ps(row.as_mut_ptr().wrapping_add(8), a[2 * q + 1]);
                }
            }
            r0 += g;
        }
        c += 16;
    }
    if vec_cols < nb {
        let mut tail = vec![0f32; rows * (nb - vec_cols)];
        axpy_strip(x, w, k, n, j0 + vec_cols, nb - vec_cols, &mut tail);
        let t = nb - vec_cols;
        for r in 0..rows {
            acc[r * nb + vec_cols..(r + 1) * nb].copy_from_slice(&tail[r * t..(r + 1) * t]);
        }
    }
}

/// Output `[rows, n]` computed in column blocks of `block` in parallel: `kernel(j0, nb, acc)`
/// fills `acc [rows, nb]` for columns `j0..j0 + nb`.
fn par_column_blocks(
    rows: usize,
    n: usize,
    block: usize,
    kernel: impl Fn(usize, usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    let starts: Vec<usize> = (0..n).step_by(block).collect();
    let parts: Vec<Vec<f32>> = starts
        .par_iter()
        .map(|&j0| {
            let nb = block.min(n - j0);
            let mut acc = vec![0f32; rows * nb];
            kernel(j0, nb, &mut acc);
            acc
        })
        .collect();
    let mut out = vec![0f32; rows * n];
    for (&j0, part) in starts.iter().zip(&parts) {
        let nb = part.len() / rows.max(1);
        for r in 0..rows {
            out[r * n + j0..r * n + j0 + nb].copy_from_slice(&part[r * nb..(r + 1) * nb]);
        }
    }
    out
}

/// `x [rows, k] · w` with `w [k, n]`, on host slices.
pub fn skinny_matmul_host(x: &[f32], w: &[f32], rows: usize, k: usize, n: usize) -> Vec<f32> {
    skinny_matmul_host_at(avx2(), x, w, rows, k, n)
}

/// [`skinny_matmul_host`] on the AVX2/FMA kernels (`simd`, where the CPU has them) or the
/// portable ones.
fn skinny_matmul_host_at(
    simd: bool,
    x: &[f32],
    w: &[f32],
    rows: usize,
    k: usize,
    n: usize,
) -> Vec<f32> {
    let simd = simd && kd_kernels::cpu::detected() >= SimdLevel::Avx2;
    par_column_blocks(rows, n, STRIP, |j0, nb, acc| {
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: the CPU supports the features the function was compiled for.
            unsafe { axpy_strip_avx2(x, w, k, n, j0, nb, acc) };
            return;
        }
        let _ = simd;
        axpy_strip(x, w, k, n, j0, nb, acc);
    })
}

#[inline(always)]
fn dot(x: &[f32], e: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (xc, ec) = (x.chunks_exact(8), e.chunks_exact(8));
    let (xt, et) = (xc.remainder(), ec.remainder());
    for (xa, ea) in xc.zip(ec) {
        let xa: &[f32; 8] = xa.try_into().expect("8 lanes");
        let ea: &[f32; 8] = ea.try_into().expect("8 lanes");
        for l in 0..8 {
            lanes[l] += xa[l] * ea[l];
        }
    }
    let mut sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
        + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    for (a, b) in xt.iter().zip(et) {
        sum += a * b;
    }
    sum
}

#[inline(always)]
fn dot_rows(x: &[f32], e: &[f32], k: usize, j0: usize, nb: usize, acc: &mut [f32]) {
    let rows = x.len() / k;
    for j in 0..nb {
        let erow = &e[(j0 + j) * k..(j0 + j + 1) * k];
        for r in 0..rows {
            acc[r * nb + j] = dot(&x[r * k..(r + 1) * k], erow);
        }
    }
}

/// The same with AVX2/FMA intrinsics: rows in groups of four with register accumulators,
/// each matrix row loaded once per group.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_rows_avx2(x: &[f32], e: &[f32], k: usize, j0: usize, nb: usize, acc: &mut [f32]) {
    use std::arch::x86_64::*;
    let rows = x.len() / k;
    let full = k / 8 * 8;
    let hsum = |v: __m256| -> f32 {
        let mut l = [0f32; 8];
        // SAFETY: `l` holds 8 floats.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), v) };
        ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
    };
    for j in 0..nb {
        let erow = &e[(j0 + j) * k..(j0 + j + 1) * k];
        let mut r0 = 0;
        while r0 < rows {
            let g = (rows - r0).min(4);
            // Rows past the group's end alias the last real row; their sums are discarded.
            let xr = |q: usize| &x[(r0 + q.min(g - 1)) * k..(r0 + q.min(g - 1) + 1) * k];
            let (x0, x1, x2, x3) = (xr(0), xr(1), xr(2), xr(3));
            let (mut s0, mut s1, mut s2, mut s3) = (
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
            );
            // `wrapping_add`, not `add`: no per-load precondition checks in builds with debug
            // assertions (tests, the dev profile), which otherwise dominate this loop.
            let (pe, p0, p1, p2, p3) = (
                erow.as_ptr(),
                x0.as_ptr(),
                x1.as_ptr(),
                x2.as_ptr(),
                x3.as_ptr(),
            );
            let mut i = 0;
            while i < full {
                // SAFETY: i + 8 <= full <= k, the length of every slice read.
                unsafe {
                    let ev = _mm256_loadu_ps(pe.wrapping_add(i));
                    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(p0.wrapping_add(i)), ev, s0);
                    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(p1.wrapping_add(i)), ev, s1);
                    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(p2.wrapping_add(i)), ev, s2);
                    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(p3.wrapping_add(i)), ev, s3);
                }
                i += 8;
            }
            for (q, (s, xq)) in [(s0, x0), (s1, x1), (s2, x2), (s3, x3)]
                .into_iter()
                .enumerate()
                .take(g)
            {
                let mut sum = hsum(s);
                for t in full..k {
                    sum += xq[t] * erow[t];
                }
                acc[(r0 + q) * nb + j] = sum;
            }
            r0 += g;
        }
    }
}

/// `x [rows, k] · eᵀ` with `e [n, k]`, on host slices.
pub fn skinny_matmul_t_host(x: &[f32], e: &[f32], rows: usize, k: usize, n: usize) -> Vec<f32> {
    skinny_matmul_t_host_at(avx2(), x, e, rows, k, n)
}

/// [`skinny_matmul_t_host`] on the AVX2/FMA kernels (`simd`, where the CPU has them) or the
/// portable ones.
fn skinny_matmul_t_host_at(
    simd: bool,
    x: &[f32],
    e: &[f32],
    rows: usize,
    k: usize,
    n: usize,
) -> Vec<f32> {
    let simd = simd && kd_kernels::cpu::detected() >= SimdLevel::Avx2;
    par_column_blocks(rows, n, BLOCK, |j0, nb, acc| {
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: the CPU supports the features the function was compiled for.
            unsafe { dot_rows_avx2(x, e, k, j0, nb, acc) };
            return;
        }
        let _ = simd;
        dot_rows(x, e, k, j0, nb, acc);
    })
}

/// Whether the AVX2/FMA kernels run at the level in use (`kd_kernels::cpu::level`, which
/// `KD_SIMD` may cap).
pub(crate) fn avx2() -> bool {
    kd_kernels::cpu::level() >= SimdLevel::Avx2
}

impl SkinnyMatmulBackend for Flex {
    fn skinny_matmul_t(x: FlexTensor, e: FlexTensor) -> FlexTensor {
        let xs = x.layout().shape().to_vec();
        let es = e.layout().shape().to_vec();
        let (rows, k, n) = (xs[0], xs[1], es[0]);
        let out = skinny_matmul_t_host(&f32_view(&x), &f32_view(&e), rows, k, n);
        FlexTensor::from_data(TensorData::new(out, [rows, n]))
    }

    fn skinny_matmul(x: FlexTensor, w: FlexTensor) -> FlexTensor {
        let xs = x.layout().shape().to_vec();
        let ws = w.layout().shape().to_vec();
        let (rows, k, n) = (xs[0], xs[1], ws[1]);
        let out = skinny_matmul_host(&f32_view(&x), &f32_view(&w), rows, k, n);
        FlexTensor::from_data(TensorData::new(out, [rows, n]))
    }
}

/// Whether `x · w` should take the skinny path: few rows, plain (non-autodiff) f32 tensors on
/// the CPU backend, and SIMD kernels at the level in use. Without them (other architectures,
/// or `KD_SIMD=scalar`) the general GEMM is faster than a scalar FMA chain per output.
pub fn applies(x: &Tensor<2>, w: &Tensor<2>) -> bool {
    applies_to_input(x, MAX_ROWS) && applies_to_weight(w)
}

/// The weight's half of [`applies`]: plain f32, no autodiff.
pub fn applies_to_weight(w: &Tensor<2>) -> bool {
    !w.is_autodiff() && w.dtype() == DType::F32
}

/// The input's half of [`applies`]: at most `max_rows` rows of plain f32 on the CPU backend,
/// and SIMD kernels at the level in use (what a packed matrix, whose weights are f32 blocks on
/// the host by construction, needs).
pub fn applies_to_input(x: &Tensor<2>, max_rows: usize) -> bool {
    let [rows, _] = x.dims();
    rows <= max_rows
        && avx2()
        && !x.is_autodiff()
        && x.dtype() == DType::F32
        && x.device() == burn::tensor::Device::flex()
}

/// `x [rows, k] · eᵀ` (`e [n, k]`) through the extension.
pub fn skinny_matmul_t(x: Tensor<2>, e: Tensor<2>) -> Tensor<2> {
    Tensor::from_dispatch(
        <burn::backend::Dispatch as SkinnyMatmulBackend>::skinny_matmul_t(
            x.into_dispatch(),
            e.into_dispatch(),
        ),
    )
}

/// `x [rows, k] · w` (`w [k, n]`) through the extension.
pub fn skinny_matmul(x: Tensor<2>, w: Tensor<2>) -> Tensor<2> {
    Tensor::from_dispatch(
        <burn::backend::Dispatch as SkinnyMatmulBackend>::skinny_matmul(
            x.into_dispatch(),
            w.into_dispatch(),
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_the_rounding_bound_at_every_level() {
        // |ĉ − c| ≤ γ_k Σ|x||w|, γ_k = k·u/(1 − k·u), u = 2⁻²⁴ (any summation order), c in
        // f64; and a row gives the same bits alone as in its batch.
        let u = 2f64.powi(-24);
        let levels: Vec<bool> = [false, true]
            .into_iter()
            .filter(|&simd| !simd || kd_kernels::cpu::detected() >= SimdLevel::Avx2)
            .collect();
        for simd in levels {
            for (rows, k, n) in [
                (1, 5, 7),
                (8, 64, 1000),
                (3, 33, 513),
                (9, 40, 200),
                (5, 16, 64),
            ] {
                let x: Vec<f32> = (0..rows * k)
                    .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0)
                    .collect();
                let w: Vec<f32> = (0..k * n)
                    .map(|i| ((i * 104_729 % 997) as f32 - 498.0) / 89.0)
                    .collect();
                let wt: Vec<f32> = (0..n * k).map(|i| w[(i % k) * n + i / k]).collect();
                let a = skinny_matmul_host_at(simd, &x, &w, rows, k, n);
                let b = skinny_matmul_t_host_at(simd, &x, &wt, rows, k, n);
                let gamma = k as f64 * u / (1.0 - k as f64 * u);
                for r in 0..rows {
                    for j in 0..n {
                        let (mut want, mut mag) = (0f64, 0f64);
                        for i in 0..k {
                            let p = x[r * k + i] as f64 * w[i * n + j] as f64;
                            want += p;
                            mag += p.abs();
                        }
                        for (what, got) in [("x·w", a[r * n + j]), ("x·eᵀ", b[r * n + j])] {
                            assert!(
                                (got as f64 - want).abs() <= gamma * mag,
                                "simd {simd} {what} [{rows}, {k}, {n}] at ({r}, {j}): {got} vs {want}"
                            );
                        }
                    }
                }
                let first = skinny_matmul_host_at(simd, &x[..k], &w, 1, k, n);
                assert_eq!(first, a[..n].to_vec(), "[{rows}, {k}, {n}] row 0 alone");
                let first = skinny_matmul_t_host_at(simd, &x[..k], &wt, 1, k, n);
                assert_eq!(
                    first,
                    b[..n].to_vec(),
                    "[{rows}, {k}, {n}] transposed row 0 alone"
                );
            }
        }
    }

    #[test]
    fn the_extension_equals_the_host_kernels() {
        let device = burn::tensor::Device::flex();
        let (rows, k, n) = (3, 33, 513);
        let x = Tensor::<2>::random(
            [rows, k],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &device,
        );
        let w = Tensor::<2>::random(
            [k, n],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &device,
        );
        let host = |t: &Tensor<2>| -> Vec<f32> { t.clone().into_data().try_into_vec_as().unwrap() };
        let (xs, ws) = (host(&x), host(&w));
        let e = Tensor::<2>::from_data(w.clone().transpose().into_data(), &device);
        assert_eq!(
            host(&skinny_matmul(x.clone(), w)),
            skinny_matmul_host(&xs, &ws, rows, k, n)
        );
        assert_eq!(
            host(&skinny_matmul_t(x, e.clone())),
            skinny_matmul_t_host(&xs, &host(&e), rows, k, n)
        );
    }
}

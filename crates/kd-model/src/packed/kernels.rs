//! The f32-activation kernels of [`PackedMatrix::matmul_t`](super::PackedMatrix::matmul_t):
//! each group of 32 weights dequantised (ggml's reference operations, bit-identical to the f32
//! copy; see [`group`](super::group)), then multiply-accumulated in f32 lanes. A scalar kernel,
//! an AVX2/FMA one and an AVX-512 one, chosen at run time, give the same bits.
//!
//! The order of the additions, shared by all three: each output keeps four accumulators of
//! eight lanes, accumulator `q` taking values `8q..8q + 8` of every group in turn; at the end
//! lane `l` is `(a0 + a2) + (a1 + a3)` and the eight lanes are summed as [`reduce`] does.
//! Four chains per output keep one FMA latency per group on each chain: with a single
//! accumulator, the four FMAs of a group made one dependency chain, and at one or two input
//! rows (decoding, a speculative verification) the kernel waited on that latency. The order
//! depends on nothing but the row's own values, so a row's result is the same alone as in any
//! batch — what makes a speculative verification agree with plain decoding bit for bit.

use kd_gguf::GgmlType;

use super::group::{self, Layout};
#[cfg(target_arch = "x86_64")]
use crate::q8::{GROUP, rows_in_registers};

/// An f32-activation kernel this CPU can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// Portable Rust.
    Scalar,
    /// AVX2, FMA and F16C, up to three input rows per pass over a matrix row's blocks.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 F, up to eight input rows per pass.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Kernel {
    /// The best kernel at the SIMD level in use (`kd_kernels::cpu::level`, which
    /// `KD_SIMD` may lower).
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use kd_kernels::cpu::{SimdLevel, level};
            match level() {
                SimdLevel::Avx512 => return Kernel::Avx512,
                SimdLevel::Avx2 => return Kernel::Avx2,
                SimdLevel::Scalar => {}
            }
        }
        Kernel::Scalar
    }

    /// Every kernel this CPU can run (for tests).
    #[cfg(test)]
    pub fn available() -> Vec<Self> {
        let mut out = vec![Kernel::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            use kd_kernels::cpu::{SimdLevel, detected};
            if detected() >= SimdLevel::Avx2 {
                out.push(Kernel::Avx2);
            }
            if detected() >= SimdLevel::Avx512 {
                out.push(Kernel::Avx512);
            }
        }
        out
    }

    /// Outputs `j0..j0 + m` of every row of `x [n, cols]` against `m` matrix rows (their
    /// blocks as stored, one after the other in `rows`), written to `acc[r * nb + j]`. The
    /// rows are taken in one call so that the kernel is chosen once per call, not per output;
    /// each output is computed alone, as by a call for its row only.
    ///
    /// # Panics
    /// If `rows` is not whole matrix rows of `cols` values, `x` or `acc` are shorter than
    /// `n`, `nb` and `j0 + m` say, or `ty` is not a packed type ([`group::packable`]).
    #[allow(clippy::too_many_arguments)]
    pub fn dot_rows(
        self,
        ty: GgmlType,
        rows: &[u8],
        x: &[f32],
        n: usize,
        cols: usize,
        acc: &mut [f32],
        nb: usize,
        j0: usize,
    ) {
        let layout = Layout::of(ty);
        let per_block = 32 << layout.shift;
        assert!(
            cols.is_multiple_of(per_block),
            "dot_rows: shapes do not match"
        );
        let rb = layout.row_bytes(cols);
        assert!(rb > 0, "dot_rows: shapes do not match");
        let m = rows.len() / rb;
        assert!(
            rows.len() == m * rb
                && x.len() >= n * cols
                && (n == 0 || m == 0 || acc.len() >= (n - 1) * nb + j0 + m),
            "dot_rows: shapes do not match"
        );
        match self {
            Kernel::Scalar => {
                for (i, row) in rows.chunks_exact(rb).enumerate() {
                    dot_row_scalar(ty, row, x, n, cols, acc, nb, j0 + i);
                }
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                assert!(std::arch::is_x86_feature_detected!("avx2"));
                assert!(std::arch::is_x86_feature_detected!("fma"));
                assert!(std::arch::is_x86_feature_detected!("f16c"));
                // SAFETY: the features are present (asserted), and the lengths were checked
                // above: rows 0..n of `x`, whole blocks of each matrix row, outputs within
                // `acc`.
                unsafe { rows_avx2(ty, rows, rb, x, n, cols, acc, nb, j0) }
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                assert!(std::arch::is_x86_feature_detected!("avx512f"));
                assert!(std::arch::is_x86_feature_detected!("f16c"));
                // SAFETY: as for AVX2 above.
                unsafe { rows_avx512(ty, rows, rb, x, n, cols, acc, nb, j0) }
            }
        }
    }
}

/// `f(row, g, out)` for each matrix row of `rb` bytes in `rows` (output `j0 + i`) and each
/// group of the `n` input rows (rows `r0..r0 + g`, `out` naming them), `g = next(n − r0)`
/// (at least one).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn row_groups(
    (rows, rb): (&[u8], usize),
    n: usize,
    next: impl Fn(usize) -> usize,
    acc: &mut [f32],
    nb: usize,
    j0: usize,
    mut f: impl FnMut(&[u8], usize, Out<'_>),
) {
    for (i, row) in rows.chunks_exact(rb).enumerate() {
        let mut r0 = 0;
        while r0 < n {
            let g = next(n - r0).clamp(1, n - r0);
            f(
                row,
                g,
                Out {
                    acc: &mut *acc,
                    nb,
                    j: j0 + i,
                    r0,
                },
            );
            r0 += g;
        }
    }
}

/// The AVX2 kernel's next group of input rows, with `left` rows left: three (twelve
/// accumulators and a group's four weight registers fill the sixteen; four rows spill and
/// cost what two groups of two do), but two and two for four, since a group of one pays a
/// whole pass over the blocks for a single row. Measured on SmolLM2 (Zen 3, 2026-12-07): a
/// 3-token pass cost 2.05× a 1-token pass as two groups, 1.55× as one; a 4-token pass
/// 2.2–2.3× as 2 + 2 and as one group of four.
#[cfg(target_arch = "x86_64")]
fn avx2_group(left: usize) -> usize {
    if left == 4 { 2 } else { left.min(3) }
}

/// [`Kernel::dot_rows`] on AVX2: each matrix row against the input rows up to three at a time
/// ([`avx2_group`]).
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `rows` holds whole matrix rows of `rb` bytes (blocks
/// of type `ty`, `cols` values); `x` holds `n` rows of `cols`; `acc` holds index
/// `(n − 1) · nb + j0 + m − 1` for the `m` matrix rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_avx2(
    ty: GgmlType,
    rows: &[u8],
    rb: usize,
    x: &[f32],
    n: usize,
    cols: usize,
    acc: &mut [f32],
    nb: usize,
    j0: usize,
) {
    group::with_type!(ty, T => row_groups((rows, rb), n, avx2_group, acc, nb, j0, |row, g, out| {
        // SAFETY: the caller's contract: rows r0..r0 + g of `x`, the row's whole blocks,
        // output j0 + i of row r0 + g − 1 within `acc`.
        unsafe {
            match g {
                1 => group_avx2::<1, T>(row, x, cols, out),
                2 => group_avx2::<2, T>(row, x, cols, out),
                _ => group_avx2::<3, T>(row, x, cols, out),
            }
        }
    }))
}

/// [`Kernel::dot_rows`] on AVX-512: each matrix row against up to [`GROUP`] (eight) input rows
/// at a time.
///
/// # Safety
/// As [`rows_avx2`], with AVX-512 F and F16C in place of AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_avx512(
    ty: GgmlType,
    rows: &[u8],
    rb: usize,
    x: &[f32],
    n: usize,
    cols: usize,
    acc: &mut [f32],
    nb: usize,
    j0: usize,
) {
    // The AVX-512 kernel keeps as many input rows in registers as the 8-bit kernels do.
    group::with_type!(ty, T => row_groups((rows, rb), n, |left| left.min(GROUP), acc, nb, j0, |row, g, out| {
        // SAFETY: as in `rows_avx2`.
        unsafe { rows_in_registers!(group_avx512, g, T, (row, x, cols, out)) }
    }))
}

/// The eight lanes' sum in the order every kernel uses.
#[inline]
fn reduce(l: [f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// Scalar kernel: the reference order (see the module documentation), from the blocks
/// dequantised by `kd_gguf` (an implementation apart from the SIMD kernels' [`group`] reading).
#[allow(clippy::too_many_arguments)]
fn dot_row_scalar(
    ty: GgmlType,
    w: &[u8],
    x: &[f32],
    n: usize,
    cols: usize,
    acc: &mut [f32],
    nb: usize,
    j: usize,
) {
    let (block, size) = ty.block().expect("a packed type");
    let values = kd_gguf::block_dequantizer(ty).expect("a packed type");
    let mut lanes = vec![[[0f32; 8]; 4]; n];
    let mut vals = [0f32; 256];
    for (blk, b) in w.chunks_exact(size).enumerate() {
        values(b, &mut vals[..block]);
        for (g, vals) in vals[..block].chunks_exact(32).enumerate() {
            let at = blk * block + g * 32;
            for (r, lane) in lanes.iter_mut().enumerate() {
                let xs = &x[r * cols + at..r * cols + at + 32];
                for (q, a) in lane.iter_mut().enumerate() {
                    for l in 0..8 {
                        a[l] = xs[q * 8 + l].mul_add(vals[q * 8 + l], a[l]);
                    }
                }
            }
        }
    }
    for (r, [a0, a1, a2, a3]) in lanes.iter().enumerate() {
        acc[r * nb + j] = reduce(std::array::from_fn(|l| (a0[l] + a2[l]) + (a1[l] + a3[l])));
    }
}

/// Where a group writes: output `j` of input rows `r0..` into `acc[r * nb + j]`.
#[cfg(target_arch = "x86_64")]
struct Out<'a> {
    acc: &'a mut [f32],
    nb: usize,
    j: usize,
    r0: usize,
}

/// Input rows `r0..r0 + G` against one matrix row, AVX2/FMA: each group of 32 weights
/// dequantised into four registers (values 0–7, 8–15, 16–23, 24–31), one FMA per register
/// and row.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `row` holds the whole blocks (of type `TYPES[T]`) of
/// `cols` values; rows `r0..r0 + G` of `x` (`cols` floats each) exist; `acc` holds index
/// `(r0 + G − 1) * nb + j`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2<const G: usize, const T: u8>(
    row: &[u8],
    x: &[f32],
    cols: usize,
    out: Out<'_>,
) {
    use std::arch::x86_64::*;
    // SAFETY: every pointer read lies within the slices the caller's contract sizes.
    unsafe {
        let ty = group::TYPES[T as usize];
        let layout = Layout::of(ty);
        let offset = group::has_offset(ty);
        let px = x.as_ptr().add(out.r0 * cols);
        let mut s = [[_mm256_setzero_ps(); 4]; G];
        for (blk, block) in row.chunks_exact(layout.size).enumerate() {
            group::prefetch_ahead(block);
            let scales = group::block_scales(ty, block, |h| group::halves_f16c(h));
            for (sub, sc) in scales.iter().enumerate().take(1 << layout.shift) {
                let g = (blk << layout.shift) + sub;
                let [q0, q1] = group::values_sse2(ty, block.as_ptr(), sub);
                let ints = [q0, _mm_srli_si128(q0, 8), q1, _mm_srli_si128(q1, 8)];
                let v: [__m256; 4] = std::array::from_fn(|k| {
                    let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ints[k]));
                    let f = _mm256_mul_ps(f, _mm256_set1_ps(sc.d[k / 2]));
                    if offset {
                        _mm256_add_ps(f, _mm256_set1_ps(sc.offset))
                    } else {
                        f
                    }
                });
                for (r, sr) in s.iter_mut().enumerate() {
                    let xr = px.add(r * cols + g * 32);
                    for q in 0..4 {
                        sr[q] = _mm256_fmadd_ps(_mm256_loadu_ps(xr.add(8 * q)), v[q], sr[q]);
                    }
                }
            }
        }
        for (r, [a0, a1, a2, a3]) in s.into_iter().enumerate() {
            let mut l = [0f32; 8];
            let t = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
            _mm256_storeu_ps(l.as_mut_ptr(), t);
            out.acc[(out.r0 + r) * out.nb + out.j] = reduce(l);
        }
    }
}

/// Input rows `r0..r0 + G` against one matrix row, AVX-512: each group dequantised into two
/// registers (values 0–15 and 16–31) whose halves are the AVX2 kernel's four, one FMA per
/// register and row; the same lanes, so the same bits.
///
/// # Safety
/// As [`group_avx2`], with AVX-512 F and F16C in place of AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn group_avx512<const G: usize, const T: u8>(
    row: &[u8],
    x: &[f32],
    cols: usize,
    out: Out<'_>,
) {
    use std::arch::x86_64::*;
    // SAFETY: every pointer read lies within the slices the caller's contract sizes.
    unsafe {
        let ty = group::TYPES[T as usize];
        let layout = Layout::of(ty);
        let offset = group::has_offset(ty);
        let px = x.as_ptr().add(out.r0 * cols);
        let mut s = [[_mm512_setzero_ps(); 2]; G];
        for (blk, block) in row.chunks_exact(layout.size).enumerate() {
            group::prefetch_ahead(block);
            let scales = group::block_scales(ty, block, |h| group::halves_f16c(h));
            for (sub, sc) in scales.iter().enumerate().take(1 << layout.shift) {
                let g = (blk << layout.shift) + sub;
                let q = group::values_sse2(ty, block.as_ptr(), sub);
                let v: [__m512; 2] = std::array::from_fn(|k| {
                    let f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q[k]));
                    let f = _mm512_mul_ps(f, _mm512_set1_ps(sc.d[k]));
                    if offset {
                        _mm512_add_ps(f, _mm512_set1_ps(sc.offset))
                    } else {
                        f
                    }
                });
                for (r, sr) in s.iter_mut().enumerate() {
                    let xr = px.add(r * cols + g * 32);
                    sr[0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), v[0], sr[0]);
                    sr[1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr.add(16)), v[1], sr[1]);
                }
            }
        }
        for (r, [a01, a23]) in s.into_iter().enumerate() {
            // [a0 + a2 | a1 + a3], then the halves added: (a0 + a2) + (a1 + a3).
            let t = _mm512_add_ps(a01, a23);
            let mut h = [0f32; 16];
            _mm512_storeu_ps(h.as_mut_ptr(), t);
            let l: [f32; 8] = std::array::from_fn(|i| h[i] + h[8 + i]);
            out.acc[(out.r0 + r) * out.nb + out.j] = reduce(l);
        }
    }
}

//! The f32-activation kernels of [`PackedMatrix::matmul_t`](super::PackedMatrix::matmul_t):
//! each weight block dequantised (ggml's reference operations, bit-identical to the f32 copy),
//! then multiply-accumulated in f32 lanes. A scalar kernel, an AVX2/FMA one and an AVX-512
//! one, chosen at run time, give the same bits.
//!
//! The order of the additions, shared by all three: each output keeps four accumulators of
//! eight lanes, accumulator `q` taking values `8q..8q + 8` of every block in turn; at the end
//! lane `l` is `(a0 + a2) + (a1 + a3)` and the eight lanes are summed as [`reduce`] does.
//! Four chains per output keep one FMA latency per block on each chain: with a single
//! accumulator, the four FMAs of a block made one dependency chain, and at one or two input
//! rows (decoding, a speculative verification) the kernel waited on that latency. The order
//! depends on nothing but the row's own values, so a row's result is the same alone as in any
//! batch — what makes a speculative verification agree with plain decoding bit for bit.

use kd_gguf::GgmlType;

use crate::q8::BlockRow;

/// An f32-activation kernel this CPU can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// Portable Rust.
    Scalar,
    /// AVX2 and FMA, two input rows per pass over a matrix row's blocks.
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

    /// Output `j` of every row of `x [n, cols]` against one matrix row, written to
    /// `acc[r * nb + j]`.
    ///
    /// # Panics
    /// If the blocks, scales or `x` are shorter than `cols` and `n` say, or `ty` is not Q8_0,
    /// Q4_0 or Q4_1.
    #[allow(clippy::too_many_arguments)]
    pub fn dot_row(
        self,
        ty: GgmlType,
        row: &BlockRow<'_>,
        x: &[f32],
        n: usize,
        cols: usize,
        acc: &mut [f32],
        nb: usize,
        j: usize,
    ) {
        let size = block_size(ty);
        let blocks = cols / 32;
        assert!(
            cols.is_multiple_of(32)
                && row.bytes.len() == blocks * size
                && row.d.len() == blocks
                && (ty != GgmlType::Q4_1 || row.m.len() == blocks)
                && x.len() >= n * cols
                && (n == 0 || acc.len() > (n - 1) * nb + j),
            "dot_row: shapes do not match"
        );
        match self {
            Kernel::Scalar => dot_row_scalar(ty, row.bytes, x, n, cols, acc, nb, j),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                assert!(std::arch::is_x86_feature_detected!("avx2"));
                assert!(std::arch::is_x86_feature_detected!("fma"));
                let mut r0 = 0;
                while r0 < n {
                    let g = (n - r0).min(2);
                    let out = Out { acc, nb, j, r0 };
                    // SAFETY: the features are present (asserted), and the lengths were
                    // checked above: rows r0..r0 + g of `x`, `blocks` blocks with their scales.
                    unsafe {
                        match g {
                            1 => group_avx2::<1>(ty, row, x, cols, out),
                            _ => group_avx2::<2>(ty, row, x, cols, out),
                        }
                    }
                    r0 += g;
                }
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                assert!(std::arch::is_x86_feature_detected!("avx512f"));
                let mut r0 = 0;
                while r0 < n {
                    let g = (n - r0).min(8);
                    let out = Out { acc, nb, j, r0 };
                    // SAFETY: as for AVX2 above.
                    unsafe {
                        match g {
                            1 => group_avx512::<1>(ty, row, x, cols, out),
                            2 => group_avx512::<2>(ty, row, x, cols, out),
                            3 => group_avx512::<3>(ty, row, x, cols, out),
                            4 => group_avx512::<4>(ty, row, x, cols, out),
                            5 => group_avx512::<5>(ty, row, x, cols, out),
                            6 => group_avx512::<6>(ty, row, x, cols, out),
                            7 => group_avx512::<7>(ty, row, x, cols, out),
                            _ => group_avx512::<8>(ty, row, x, cols, out),
                        }
                    }
                    r0 += g;
                }
            }
        }
    }
}

/// Bytes per 32-value block of the packed types.
fn block_size(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 => ty.block().expect("a block type").1,
        _ => panic!("PackedMatrix admits Q8_0, Q4_0 and Q4_1 only, not {ty:?}"),
    }
}

/// The eight lanes' sum in the order every kernel uses.
#[inline]
fn reduce(l: [f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// Scalar kernel: the reference order (see the module documentation).
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
    let size = block_size(ty);
    let values = kd_gguf::block_dequantizer(ty).expect("a supported type");
    let mut lanes = vec![[[0f32; 8]; 4]; n];
    let mut vals = [0f32; 32];
    for (blk, b) in w.chunks_exact(size).enumerate() {
        values(b, &mut vals);
        for (r, lane) in lanes.iter_mut().enumerate() {
            let xs = &x[r * cols + blk * 32..r * cols + blk * 32 + 32];
            for (q, a) in lane.iter_mut().enumerate() {
                for l in 0..8 {
                    a[l] = xs[q * 8 + l].mul_add(vals[q * 8 + l], a[l]);
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

/// Input rows `r0..r0 + G` against one matrix row, AVX2/FMA: each block dequantised into
/// four registers (values 0–7, 8–15, 16–23, 24–31), one FMA per register and row.
///
/// # Safety
/// The CPU supports AVX2 and FMA; `ty` is Q8_0, Q4_0 or Q4_1; `row` holds `cols / 32` blocks
/// with their scales (and minimums for Q4_1); rows `r0..r0 + G` of `x` (`cols` floats each)
/// exist; `acc` holds index `(r0 + G − 1) * nb + j`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn group_avx2<const G: usize>(
    ty: GgmlType,
    row: &BlockRow<'_>,
    x: &[f32],
    cols: usize,
    out: Out<'_>,
) {
    use std::arch::x86_64::*;
    // SAFETY: every pointer read lies within the slices the caller's contract sizes.
    unsafe {
        let (size, blocks) = (block_size(ty), cols / 32);
        let (pw, pd, pm) = (row.bytes.as_ptr(), row.d.as_ptr(), row.m.as_ptr());
        let px = x.as_ptr().add(out.r0 * cols);
        let mut s = [[_mm256_setzero_ps(); 4]; G];
        let low = _mm_set1_epi8(0x0F);
        for blk in 0..blocks {
            let b = pw.add(blk * size);
            let d = _mm256_set1_ps(*pd.add(blk));
            let v: [__m256; 4] = match ty {
                GgmlType::Q8_0 => {
                    let q = |o: usize| {
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                            b.add(2 + o) as *const __m128i
                        )))
                    };
                    [0, 8, 16, 24].map(|o| _mm256_mul_ps(q(o), d))
                }
                _ => {
                    let off = if ty == GgmlType::Q4_0 { 2 } else { 4 };
                    let qs = _mm_loadu_si128(b.add(off) as *const __m128i);
                    let lo = _mm_and_si128(qs, low);
                    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low);
                    let q = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)]
                        .map(|v| _mm256_cvtepu8_epi32(v));
                    if ty == GgmlType::Q4_0 {
                        let eight = _mm256_set1_epi32(8);
                        q.map(|v| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v, eight)), d))
                    } else {
                        let m = _mm256_set1_ps(*pm.add(blk));
                        q.map(|v| _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), d), m))
                    }
                }
            };
            for (r, sr) in s.iter_mut().enumerate() {
                let xr = px.add(r * cols + blk * 32);
                for q in 0..4 {
                    sr[q] = _mm256_fmadd_ps(_mm256_loadu_ps(xr.add(8 * q)), v[q], sr[q]);
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

/// Input rows `r0..r0 + G` against one matrix row, AVX-512: each block dequantised into two
/// registers (values 0–15 and 16–31) whose halves are the AVX2 kernel's four, one FMA per
/// register and row; the same lanes, so the same bits.
///
/// # Safety
/// As [`group_avx2`], with AVX-512 F in place of AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn group_avx512<const G: usize>(
    ty: GgmlType,
    row: &BlockRow<'_>,
    x: &[f32],
    cols: usize,
    out: Out<'_>,
) {
    use std::arch::x86_64::*;
    // SAFETY: every pointer read lies within the slices the caller's contract sizes.
    unsafe {
        let (size, blocks) = (block_size(ty), cols / 32);
        let (pw, pd, pm) = (row.bytes.as_ptr(), row.d.as_ptr(), row.m.as_ptr());
        let px = x.as_ptr().add(out.r0 * cols);
        let mut s = [[_mm512_setzero_ps(); 2]; G];
        let low = _mm_set1_epi8(0x0F);
        for blk in 0..blocks {
            let b = pw.add(blk * size);
            let d = _mm512_set1_ps(*pd.add(blk));
            let v: [__m512; 2] = match ty {
                GgmlType::Q8_0 => {
                    let q = |o: usize| {
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                            b.add(2 + o) as *const __m128i
                        )))
                    };
                    [0, 16].map(|o| _mm512_mul_ps(q(o), d))
                }
                _ => {
                    let off = if ty == GgmlType::Q4_0 { 2 } else { 4 };
                    let qs = _mm_loadu_si128(b.add(off) as *const __m128i);
                    let q = [
                        _mm_and_si128(qs, low),
                        _mm_and_si128(_mm_srli_epi16(qs, 4), low),
                    ]
                    .map(|v| _mm512_cvtepu8_epi32(v));
                    if ty == GgmlType::Q4_0 {
                        let eight = _mm512_set1_epi32(8);
                        q.map(|v| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(v, eight)), d))
                    } else {
                        let m = _mm512_set1_ps(*pm.add(blk));
                        q.map(|v| _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), d), m))
                    }
                }
            };
            for (r, sr) in s.iter_mut().enumerate() {
                let xr = px.add(r * cols + blk * 32);
                sr[0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), v[0], sr[0]);
                sr[1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr.add(16)), v[1], sr[1]);
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

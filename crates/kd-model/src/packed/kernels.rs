//! The f32-activation kernels of [`PackedMatrix::matmul_t`](super::PackedMatrix::matmul_t):
//! each weight block dequantised (ggml's reference operations, bit-identical to the f32 copy),
//! then multiply-accumulated in f32 lanes; a scalar version and an AVX2/FMA one that give the
//! same bits.

use kd_gguf::GgmlType;

/// Scalar kernel: output `j` of every row of `x` against one matrix row `w` (its blocks).
#[allow(clippy::too_many_arguments)]
pub(super) fn dot_row(
    ty: GgmlType,
    w: &[u8],
    x: &[f32],
    n: usize,
    cols: usize,
    acc: &mut [f32],
    nb: usize,
    j: usize,
) {
    let size = ty.block().expect("a supported type").1;
    let values = kd_gguf::block_dequantizer(ty).expect("a supported type");
    let mut lanes = vec![[0f32; 8]; n];
    let mut vals = [0f32; 32];
    for (blk, b) in w.chunks_exact(size).enumerate() {
        values(b, &mut vals);
        for (r, lane) in lanes.iter_mut().enumerate() {
            let xs = &x[r * cols + blk * 32..r * cols + blk * 32 + 32];
            for q in 0..4 {
                for l in 0..8 {
                    lane[l] = xs[q * 8 + l].mul_add(vals[q * 8 + l], lane[l]);
                }
            }
        }
    }
    for (r, l) in lanes.iter().enumerate() {
        acc[r * nb + j] = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    }
}

/// The same with AVX2/FMA: each block dequantised into four registers once per group of
/// eight rows, then one FMA per register and row. The lanes and their final sum follow the
/// scalar kernel's order exactly, so both give the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) fn dot_row_avx2(
    ty: GgmlType,
    (w, dw, mw): (&[u8], &[f32], &[f32]),
    x: &[f32],
    n: usize,
    cols: usize,
    acc: &mut [f32],
    nb: usize,
    j: usize,
) {
    let size = ty.block().expect("a supported type").1;
    let blocks = cols / 32;
    assert!(
        w.len() == blocks * size
            && dw.len() == blocks
            && (ty != GgmlType::Q4_1 || mw.len() == blocks)
            && x.len() >= n * cols
    );
    let mut r0 = 0;
    while r0 < n {
        let g = (n - r0).min(8);
        let block = (ty, size, w, dw, mw);
        // One instantiation per group size, so that the group's accumulators stay in
        // registers and the rows' FMA chains interleave (the arithmetic of each row is the same
        // whatever the group).
        // SAFETY: rows r0..r0 + g lie within `x` (n ≤ x.len() / cols, asserted above), and the
        // CPU supports the features this function was compiled for.
        unsafe {
            match g {
                1 => group_avx2::<1>(block, x, r0, cols, acc, nb, j),
                2 => group_avx2::<2>(block, x, r0, cols, acc, nb, j),
                3 => group_avx2::<3>(block, x, r0, cols, acc, nb, j),
                4 => group_avx2::<4>(block, x, r0, cols, acc, nb, j),
                5 => group_avx2::<5>(block, x, r0, cols, acc, nb, j),
                6 => group_avx2::<6>(block, x, r0, cols, acc, nb, j),
                7 => group_avx2::<7>(block, x, r0, cols, acc, nb, j),
                _ => group_avx2::<8>(block, x, r0, cols, acc, nb, j),
            }
        }
        r0 += g;
    }
}

/// A matrix row's blocks: type, bytes per block, the bytes, scales and (Q4_1) minimums.
#[cfg(target_arch = "x86_64")]
type Blocks<'a> = (GgmlType, usize, &'a [u8], &'a [f32], &'a [f32]);

/// Rows `r0..r0 + G` of [`dot_row_avx2`].
///
/// # Safety
/// The CPU supports AVX2 and FMA; rows `r0..r0 + G` of `x` (`cols` floats each) exist; the
/// blocks hold `cols / 32` blocks of `size` bytes and as many scales (and minimums for Q4_1).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn group_avx2<const G: usize>(
    (ty, size, w, dw, mw): Blocks<'_>,
    x: &[f32],
    r0: usize,
    cols: usize,
    acc: &mut [f32],
    nb: usize,
    j: usize,
) {
    use std::arch::x86_64::*;
    let blocks = cols / 32;
    let mut s = [_mm256_setzero_ps(); G];
    for blk in 0..blocks {
        let b = &w[blk * size..(blk + 1) * size];
        let d = _mm256_set1_ps(dw[blk]);
        // SAFETY: every load reads within `b` (size bytes).
        let v: [__m256; 4] = unsafe {
            match ty {
                GgmlType::Q8_0 => {
                    let p = b.as_ptr().add(2);
                    let f = |o: usize| {
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                            p.add(o) as *const __m128i
                        )))
                    };
                    [
                        _mm256_mul_ps(f(0), d),
                        _mm256_mul_ps(f(8), d),
                        _mm256_mul_ps(f(16), d),
                        _mm256_mul_ps(f(24), d),
                    ]
                }
                GgmlType::Q4_0 | GgmlType::Q4_1 => {
                    let off = if ty == GgmlType::Q4_0 { 2 } else { 4 };
                    let qs = _mm_loadu_si128(b.as_ptr().add(off) as *const __m128i);
                    let mask = _mm_set1_epi8(0x0F);
                    let lo = _mm_and_si128(qs, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                    let to_i32 = |v: __m128i| _mm256_cvtepu8_epi32(v);
                    let mut q = [
                        to_i32(lo),
                        to_i32(_mm_srli_si128(lo, 8)),
                        to_i32(hi),
                        to_i32(_mm_srli_si128(hi, 8)),
                    ];
                    if ty == GgmlType::Q4_0 {
                        let eight = _mm256_set1_epi32(8);
                        for v in &mut q {
                            *v = _mm256_sub_epi32(*v, eight);
                        }
                        q.map(|v| _mm256_mul_ps(_mm256_cvtepi32_ps(v), d))
                    } else {
                        let m = _mm256_set1_ps(mw[blk]);
                        q.map(|v| _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), d), m))
                    }
                }
                _ => unreachable!("PackedMatrix::new admits Q8_0, Q4_0 and Q4_1 only"),
            }
        };
        for (q, sq) in s.iter_mut().enumerate() {
            let px = x.as_ptr().wrapping_add((r0 + q) * cols + blk * 32);
            // SAFETY: (r0 + q) * cols + blk * 32 + 32 <= x.len() (the caller's contract).
            unsafe {
                *sq = _mm256_fmadd_ps(_mm256_loadu_ps(px), v[0], *sq);
                *sq = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(8)), v[1], *sq);
                *sq = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(16)), v[2], *sq);
                *sq = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(24)), v[3], *sq);
            }
        }
    }
    for (q, sq) in s.iter().enumerate() {
        let mut l = [0f32; 8];
        // SAFETY: `l` holds 8 floats.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), *sq) };
        acc[(r0 + q) * nb + j] = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    }
}

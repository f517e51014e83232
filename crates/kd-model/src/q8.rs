//! Integer dot products for decoding from packed GGUF blocks, as ggml's CPU backend computes
//! them: each input row is quantised once per product to 8-bit blocks of 32 values (ggml's
//! Q8_0/Q8_1: scale `d = amax / 127`, `q = round(x / d)`, `d` and `s = d·Σq` kept at f16
//! precision), then each weight block meets each input block in exact integer arithmetic,
//! `Σ w·q` in eight lanes of four products, scaled by `d_w·d_x` into eight f32 accumulators
//! (plus `m_w·s_x` for Q4_1's offset, summed apart), the lanes summed at the end in ggml's
//! order. The integer part is exact at every SIMD level, and the float part is the same
//! sequence of operations everywhere, so the scalar, AVX2 and AVX-512 VNNI kernels give the
//! same bits; a row's result does not depend on the other rows of the batch.
//!
//! The arithmetic differs from the f32 path (activations rounded to 8 bits): see
//! `Llama::with_int8_activations` for what that costs in agreement, measured.

use half::f16;
use kd_gguf::GgmlType;

/// Input rows quantised to 8-bit blocks of 32 (ggml's Q8_1: scale and scaled sum).
pub(crate) struct Q8Rows {
    /// Rows.
    pub n: usize,
    /// Values per row (a multiple of 32).
    pub cols: usize,
    /// The quantised values, `[n, cols]`.
    pub q: Vec<i8>,
    /// Each block's scale `d`, `[n, cols / 32]`, rounded to f16.
    pub d: Vec<f32>,
    /// Each block's `d·Σq`, `[n, cols / 32]`, rounded to f16 (Q4_1's offset term).
    pub s: Vec<f32>,
}

fn f16_round(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

impl Q8Rows {
    /// Quantises `x [n, cols]` (row-major, `cols` a multiple of 32) as ggml's reference
    /// `quantize_row_q8_1` does: `d = amax / 127`, `q = round(x / d)` (halves away from zero).
    pub fn quantize(x: &[f32], n: usize, cols: usize) -> Self {
        assert!(
            cols.is_multiple_of(32) && x.len() == n * cols,
            "x must be [n, cols] with cols a multiple of 32"
        );
        let blocks = n * cols / 32;
        let mut q = vec![0i8; n * cols];
        let mut d = Vec::with_capacity(blocks);
        let mut s = Vec::with_capacity(blocks);
        for (xs, qs) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)) {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / 127.0;
            let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            let mut sum = 0i32;
            for (v, o) in xs.iter().zip(qs.iter_mut()) {
                // `as` saturates; |v · inv| <= 127 up to rounding.
                *o = (v * inv).round() as i8;
                sum += i32::from(*o);
            }
            d.push(f16_round(scale));
            s.push(f16_round(sum as f32 * scale));
        }
        Self { n, cols, q, d, s }
    }
}

/// The three packed types' blocks, with their scales (and Q4_1's minimums) as f32.
pub(crate) struct BlockRow<'a> {
    /// The row's blocks as stored.
    pub bytes: &'a [u8],
    /// Per block, `d` as f32.
    pub d: &'a [f32],
    /// Per block, Q4_1's `m` as f32 (empty for the other types).
    pub m: &'a [f32],
}

/// The 32 weights of block `blk` as they meet the input bytes `0..32`: unsigned nibbles for
/// Q4_1 (`0..=15`), signed values for Q4_0 (`nibble − 8`) and Q8_0.
fn block_weights(ty: GgmlType, row: &BlockRow<'_>, blk: usize) -> [i16; 32] {
    let mut w = [0i16; 32];
    match ty {
        GgmlType::Q8_0 => {
            let b = &row.bytes[blk * 34 + 2..blk * 34 + 34];
            for (o, v) in w.iter_mut().zip(b) {
                *o = i16::from(*v as i8);
            }
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (size, off) = if ty == GgmlType::Q4_0 {
                (18, 2)
            } else {
                (20, 4)
            };
            let b = &row.bytes[blk * size + off..blk * size + off + 16];
            let bias = if ty == GgmlType::Q4_0 { 8 } else { 0 };
            for (i, v) in b.iter().enumerate() {
                w[i] = i16::from(v & 0x0F) - bias;
                w[i + 16] = i16::from(v >> 4) - bias;
            }
        }
        _ => unreachable!("PackedMatrix::new admits Q8_0, Q4_0 and Q4_1 only"),
    }
    w
}

/// The lanes summed as ggml's `hsum_float_8` does.
fn hsum(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// Scalar kernel: output `j` of every row of `x` against one matrix row, into `acc [n, nb]`.
pub(crate) fn dot_row(
    ty: GgmlType,
    row: &BlockRow<'_>,
    x: &Q8Rows,
    acc: &mut [f32],
    nb: usize,
    j: usize,
) {
    let blocks = x.cols / 32;
    let mut lanes = vec![[0f32; 8]; x.n];
    for blk in 0..blocks {
        let w = block_weights(ty, row, blk);
        for (r, lane) in lanes.iter_mut().enumerate() {
            let qs = &x.q[r * x.cols + blk * 32..r * x.cols + blk * 32 + 32];
            let d = row.d[blk] * x.d[r * blocks + blk];
            for (l, lv) in lane.iter_mut().enumerate() {
                let dot: i32 = (4 * l..4 * l + 4)
                    .map(|k| i32::from(w[k]) * i32::from(qs[k]))
                    .sum();
                *lv = d.mul_add(dot as f32, *lv);
            }
        }
    }
    for (r, l) in lanes.iter().enumerate() {
        let m = if ty == GgmlType::Q4_1 {
            mins(row, x, r)
        } else {
            0.0
        };
        acc[r * nb + j] = hsum(l) + m;
    }
}

/// Rows of `x` per register group of the SIMD kernels (one accumulator each).
#[cfg(target_arch = "x86_64")]
const GROUP: usize = 8;

/// The SIMD kernels, one body compiled for AVX2 (`maddubs` + `madd`) and for AVX-512 VNNI
/// (`dpbusd` on 256-bit registers): the same integers, the same float operations. `$group`
/// takes `G` rows at once (accumulators in registers) for one weight type `T` (0 Q8_0, 1
/// Q4_0, 2 Q4_1), both known at compile time; `$name` splits the rows into such groups.
#[cfg(target_arch = "x86_64")]
macro_rules! simd_dot_row {
    ($name:ident, $group:ident, $features:literal, $dot:ident) => {
        /// Rows `r0..r0 + G` of `x` against `row` into `out[..G]`.
        #[target_feature(enable = $features)]
        fn $group<const G: usize, const T: u8>(
            row: &BlockRow<'_>,
            x: &Q8Rows,
            r0: usize,
            out: &mut [f32; GROUP],
        ) {
            use std::arch::x86_64::*;
            let blocks = x.cols / 32;
            let size = [34, 18, 20][T as usize];
            assert!(
                G <= GROUP
                    && r0 + G <= x.n
                    && row.bytes.len() == blocks * size
                    && row.d.len() == blocks
                    && (T != 2 || row.m.len() == blocks)
                    && x.q.len() == x.n * x.cols
                    && x.d.len() == x.n * blocks
                    && x.s.len() == x.n * blocks
            );
            let mut s = [_mm256_setzero_ps(); G];
            for blk in 0..blocks {
                // SAFETY: every load reads within the block (asserted sizes above).
                let w = unsafe {
                    let p = row.bytes.as_ptr().add(blk * size);
                    if T == 0 {
                        _mm256_loadu_si256(p.add(2) as *const __m256i)
                    } else {
                        let qs = _mm_loadu_si128(p.add(if T == 2 { 4 } else { 2 }) as *const __m128i);
                        let mask = _mm_set1_epi8(0x0F);
                        let lo = _mm_and_si128(qs, mask);
                        let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                        let w = _mm256_set_m128i(hi, lo);
                        if T == 2 {
                            w
                        } else {
                            _mm256_sub_epi8(w, _mm256_set1_epi8(8))
                        }
                    }
                };
                // Unsigned weights meet the inputs as they are; signed ones as |w| and the
                // inputs with w's sign (ggml's `mul_sum_i8_pairs`): the same products.
                let a = if T == 2 { w } else { _mm256_sign_epi8(w, w) };
                let dw = row.d[blk];
                for (q, sq) in s.iter_mut().enumerate() {
                    let r = r0 + q;
                    // SAFETY: r * cols + blk * 32 + 32 <= n * cols = x.q.len() (asserted).
                    let qy = unsafe {
                        _mm256_loadu_si256(
                            x.q.as_ptr().add(r * x.cols + blk * 32) as *const __m256i
                        )
                    };
                    let b = if T == 2 { qy } else { _mm256_sign_epi8(qy, w) };
                    let dot = $dot(a, b);
                    let d = _mm256_set1_ps(dw * x.d[r * blocks + blk]);
                    *sq = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot), *sq);
                }
            }
            for (q, sq) in s.iter().enumerate() {
                let mut l = [0f32; 8];
                // SAFETY: `l` holds 8 floats.
                unsafe { _mm256_storeu_ps(l.as_mut_ptr(), *sq) };
                out[q] = hsum(&l) + if T == 2 { mins(row, x, r0 + q) } else { 0.0 };
            }
        }

        #[target_feature(enable = $features)]
        pub(crate) fn $name(
            ty: GgmlType,
            row: &BlockRow<'_>,
            x: &Q8Rows,
            acc: &mut [f32],
            nb: usize,
            j: usize,
        ) {
            macro_rules! groups {
                ($g:expr, $t:literal, $r0:expr, $out:expr) => {
                    match $g {
                        1 => $group::<1, $t>(row, x, $r0, $out),
                        2 => $group::<2, $t>(row, x, $r0, $out),
                        3 => $group::<3, $t>(row, x, $r0, $out),
                        4 => $group::<4, $t>(row, x, $r0, $out),
                        5 => $group::<5, $t>(row, x, $r0, $out),
                        6 => $group::<6, $t>(row, x, $r0, $out),
                        7 => $group::<7, $t>(row, x, $r0, $out),
                        _ => $group::<8, $t>(row, x, $r0, $out),
                    }
                };
            }
            let mut out = [0f32; GROUP];
            let mut r0 = 0;
            while r0 < x.n {
                let g = (x.n - r0).min(GROUP);
                match ty {
                    GgmlType::Q8_0 => groups!(g, 0, r0, &mut out),
                    GgmlType::Q4_0 => groups!(g, 1, r0, &mut out),
                    GgmlType::Q4_1 => groups!(g, 2, r0, &mut out),
                    _ => unreachable!("PackedMatrix::new admits Q8_0, Q4_0 and Q4_1 only"),
                }
                for (q, v) in out.iter().enumerate().take(g) {
                    acc[(r0 + q) * nb + j] = *v;
                }
                r0 += g;
            }
        }
    };
}

/// Q4_1's offset term of row `r`: `Σ m_w·s_x` over the blocks, in block order.
fn mins(row: &BlockRow<'_>, x: &Q8Rows, r: usize) -> f32 {
    let blocks = x.cols / 32;
    let mut sum = 0f32;
    for (m, s) in row.m.iter().zip(&x.s[r * blocks..(r + 1) * blocks]) {
        sum += m * s;
    }
    sum
}

/// Eight i32 lanes, each the sum of four `u8 × i8` products (no saturation: |a| <= 128 and
/// |b| <= 127 keep each pair's sum within i16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dot_avx2(
    a: std::arch::x86_64::__m256i,
    b: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
}

/// The same with one VNNI instruction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512vnni,avx512vl")]
fn dot_vnni(
    a: std::arch::x86_64::__m256i,
    b: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b)
}

#[cfg(target_arch = "x86_64")]
simd_dot_row!(dot_row_avx2, group_avx2, "avx2,fma", dot_avx2);
#[cfg(target_arch = "x86_64")]
simd_dot_row!(
    dot_row_vnni,
    group_vnni,
    "avx2,fma,avx512f,avx512vnni,avx512vl",
    dot_vnni
);

/// The kernel for the SIMD level in use (`KD_SIMD` caps it): VNNI on AVX-512 CPUs that
/// have it, AVX2, else scalar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Kernel {
    /// The best kernel at the level in use.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use kd_kernels::cpu::{SimdLevel, level};
            let l = level();
            if l >= SimdLevel::Avx512 && std::arch::is_x86_feature_detected!("avx512vnni") {
                return Kernel::Vnni;
            }
            if l >= SimdLevel::Avx2 {
                return Kernel::Avx2;
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
            if detected() >= SimdLevel::Avx512 && std::arch::is_x86_feature_detected!("avx512vnni")
            {
                out.push(Kernel::Vnni);
            }
        }
        out
    }

    /// Output `j` of every row of `x` against `row`, into `acc [n, nb]`.
    pub fn dot_row(
        self,
        ty: GgmlType,
        row: &BlockRow<'_>,
        x: &Q8Rows,
        acc: &mut [f32],
        nb: usize,
        j: usize,
    ) {
        match self {
            Kernel::Scalar => dot_row(ty, row, x, acc, nb, j),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                // SAFETY: `detect`/`available` chose it only where the CPU has AVX2 and FMA.
                unsafe { dot_row_avx2(ty, row, x, acc, nb, j) }
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => {
                // SAFETY: `detect`/`available` chose it only where the CPU has AVX-512 VNNI.
                unsafe { dot_row_vnni(ty, row, x, acc, nb, j) }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantisation_follows_ggml_reference() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.5) * 0.37).collect();
        let q = Q8Rows::quantize(&x, 2, 32);
        for b in 0..2 {
            let xs = &x[b * 32..b * 32 + 32];
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let qs = &q.q[b * 32..b * 32 + 32];
            let mut sum = 0;
            for (k, (v, got)) in xs.iter().zip(qs).enumerate() {
                // Within half a step of the value (the reconstruction error of rounding).
                let back = *got as f32 * d;
                assert!((back - v).abs() <= 0.5 * d * 1.0001, "{b} {k}");
                sum += i32::from(*got);
            }
            assert_eq!(q.d[b], f16::from_f32(d).to_f32());
            assert_eq!(q.s[b], f16::from_f32(sum as f32 * d).to_f32());
        }
        let zeros = Q8Rows::quantize(&[0.0; 32], 1, 32);
        assert!(zeros.q.iter().all(|v| *v == 0) && zeros.d == [0.0] && zeros.s == [0.0]);
    }
}

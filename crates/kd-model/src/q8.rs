//! Integer dot products for decoding from packed GGUF blocks, as ggml's CPU backend computes
//! them: each input row is quantised once per product to 8-bit blocks of 32 values (ggml's
//! Q8_0/Q8_1: scale `d = amax / 127`, `q = round(x / d)`, `d` and `s = d·Σq` kept at f16
//! precision), then each weight block meets each input block in exact integer arithmetic,
//! `Σ w·q` in eight lanes of four products, scaled by `d_w·d_x` into eight f32 accumulators
//! (plus `offset_w·s_x` for the types with an offset — Q4_1, Q4_K, Q5_K — summed apart), the
//! lanes summed at the end in ggml's order. A weight group is 32 values with their scales as
//! [`group`](crate::packed::group) reads them (a K-quant super-block is eight groups; a Q6_K
//! group's two halves have their own scales, so lanes 0–3 and 4–7 scale apart). The integer part is exact at every SIMD level, and the float part is the same
//! sequence of operations everywhere, so the scalar, AVX2 and AVX-512 VNNI kernels give the
//! same bits; a row's result does not depend on the other rows of the batch.
//!
//! The arithmetic differs from the f32 path (activations rounded to 8 bits): see
//! `Llama::with_int8_activations` for what that costs in agreement, measured.

use half::f16;
use kd_gguf::GgmlType;

use crate::packed::group::{self, Layout};

/// Input rows quantised to 8-bit blocks of 32 (ggml's Q8_1: scale and scaled sum).
pub(crate) struct Q8Rows {
    /// Rows.
    pub n: usize,
    /// Values per row (a multiple of 32).
    pub cols: usize,
    /// The quantised values, `[n, cols]`.
    pub q: Vec<i8>,
    /// Each block's scale `d`, rounded to f16, block-major: `[cols / 32, padded]`, the rows
    /// of block `b` side by side from `b · padded` and zeros past `n`, so that the SIMD
    /// kernels read the scales of a register group of rows with one load and scale them with
    /// one multiplication ([`d_at`](Self::d_at) reads one).
    pub d: Vec<f32>,
    /// Each block's `d·Σq`, rounded to f16 (Q4_1's offset term), laid out as `d`.
    pub s: Vec<f32>,
    /// `n` rounded up to a multiple of [`ROW_PAD`] (the row stride of `d` and `s`).
    pub padded: usize,
}

/// What the rows of `Q8Rows::d` and `Q8Rows::s` are padded to: the SIMD kernels' register
/// group of rows, read with one 8-lane load.
const ROW_PAD: usize = 8;

/// `v` rounded to the nearest integer, ties to even, for |v| < 2²², as ggml's `nearest_int`
/// does it: by adding and taking away 1.5 · 2²³. Plain arithmetic, so that it vectorises on
/// the x86-64 baseline, where `f32::round_ties_even` is a call to the C library per value.
#[inline(always)]
pub(crate) fn round_small(v: f32) -> f32 {
    (v + ROUND_MAGIC) - ROUND_MAGIC
}

/// 1.5 · 2²³: adding and taking it away rounds |v| < 2²² to an integer, ties to even.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `v` rounded to the nearest integer, halves away from zero (`f32::round`), for |v| < 2²²:
/// [`round_small`], with a half moved away from zero (`v ± 0.5` is exact there).
#[inline(always)]
pub(crate) fn round_away_small(v: f32) -> f32 {
    let r = round_small(v);
    if (v - r).abs() == 0.5 {
        v + 0.5f32.copysign(v)
    } else {
        r
    }
}

fn f16_round(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Blocks of 32 values of `x` to 8 bits as ggml's reference `quantize_row_q8_1` does
/// (`d = amax / 127`, `q = round(x / d)`, halves away from zero) into `q`, each block's `d`
/// into `scales` and `Σq` into `sums`; on AVX-512 sixteen values at a time, with the same
/// float operations (so the same bits).
fn quantize_blocks(
    level: kd_kernels::cpu::SimdLevel,
    x: &[f32],
    q: &mut [i8],
    scales: &mut [f32],
    sums: &mut [i32],
) {
    assert!(x.len() == q.len() && x.len() == 32 * scales.len() && scales.len() == sums.len());
    #[cfg(target_arch = "x86_64")]
    if level.min(kd_kernels::cpu::detected()) >= kd_kernels::cpu::SimdLevel::Avx512 {
        // SAFETY: the CPU has AVX-512 F/BW/DQ (`detected`); the lengths are asserted above.
        unsafe { quantize_blocks_avx512(x, q, scales, sums) };
        return;
    }
    let _ = level;
    for (((xs, qs), scale), sum) in x
        .chunks_exact(32)
        .zip(q.chunks_exact_mut(32))
        .zip(scales.iter_mut())
        .zip(sums.iter_mut())
    {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        *scale = amax / 127.0;
        let inv = if *scale != 0.0 { 1.0 / *scale } else { 0.0 };
        let mut total = 0i32;
        for (v, o) in xs.iter().zip(qs.iter_mut()) {
            // `as` saturates; |v · inv| <= 127 up to rounding.
            *o = round_away_small(v * inv) as i8;
            total += i32::from(*o);
        }
        *sum = total;
    }
}

/// [`quantize_blocks`] sixteen values at a time.
///
/// # Safety
/// The CPU has AVX-512 F, BW and DQ; `x` and `q` hold `32 · scales.len()` values and `sums`
/// `scales.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq")]
unsafe fn quantize_blocks_avx512(x: &[f32], q: &mut [i8], scales: &mut [f32], sums: &mut [i32]) {
    use std::arch::x86_64::*;
    let (sign, half, magic) = (
        _mm512_set1_ps(-0.0),
        _mm512_set1_ps(0.5),
        _mm512_set1_ps(ROUND_MAGIC),
    );
    for (i, (scale, sum)) in scales.iter_mut().zip(sums.iter_mut()).enumerate() {
        // SAFETY: values 32i..32i + 32 of x and q (the caller's lengths).
        let (xp, qp) = unsafe { (x.as_ptr().add(32 * i), q.as_mut_ptr().add(32 * i)) };
        // SAFETY: the block's 32 values at xp.
        let v = unsafe { [_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16))] };
        // The largest magnitude (a maximum is exact in any order). `max_ps` returns its second
        // operand where either is NaN: with the running maximum second, a NaN is passed
        // over, as `f32::max` passes it over in the scalar fold.
        let zero = _mm512_setzero_ps();
        let running = _mm512_max_ps(_mm512_andnot_ps(sign, v[0]), zero);
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v[1]), running));
        *scale = amax / 127.0;
        let inv = _mm512_set1_ps(if *scale != 0.0 { 1.0 / *scale } else { 0.0 });
        let mut total = _mm512_setzero_si512();
        for (h, v) in v.into_iter().enumerate() {
            // round_away_small(v · inv): ties to even by the magic number, then a half moved
            // away from zero.
            let y = _mm512_mul_ps(v, inv);
            let r = _mm512_sub_ps(_mm512_add_ps(y, magic), magic);
            let away = _mm512_add_ps(y, _mm512_or_ps(half, _mm512_and_ps(sign, y)));
            let tie =
                _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_andnot_ps(sign, _mm512_sub_ps(y, r)), half);
            let r = _mm512_mask_blend_ps(tie, r, away);
            // NaN (0 · ∞ where a block's tiny scale overflows 1/d, or a NaN input) becomes 0,
            // as `as i8` makes it; ±∞ saturates below.
            let r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r), r);
            // Integers within ±127 (up to rounding: clamped as `as i8` saturates).
            let n = _mm512_cvttps_epi32(_mm512_min_ps(
                _mm512_max_ps(r, _mm512_set1_ps(-128.0)),
                _mm512_set1_ps(127.0),
            ));
            // SAFETY: 16 bytes of q at 32i + 16h.
            unsafe { _mm_storeu_si128(qp.add(16 * h) as *mut __m128i, _mm512_cvtepi32_epi8(n)) };
            total = _mm512_add_epi32(total, n);
        }
        *sum = _mm512_reduce_add_epi32(total);
    }
}

impl Q8Rows {
    /// Quantises `x [n, cols]` (row-major, `cols` a multiple of 32) as ggml's reference
    /// `quantize_row_q8_1` does: `d = amax / 127`, `q = round(x / d)` (halves away from zero).
    pub fn quantize(x: &[f32], n: usize, cols: usize) -> Self {
        assert!(
            cols.is_multiple_of(32) && x.len() == n * cols,
            "x must be [n, cols] with cols a multiple of 32"
        );
        let (groups, padded) = (cols / 32, n.next_multiple_of(ROW_PAD));
        let mut q = vec![0i8; n * cols];
        let (mut scales, mut sums) = (vec![0f32; n * groups], vec![0i32; n * groups]);
        quantize_blocks(kd_kernels::cpu::level(), x, &mut q, &mut scales, &mut sums);
        let mut d = vec![0f32; groups * padded];
        let mut s = vec![0f32; groups * padded];
        for (i, (scale, sum)) in scales.iter().zip(&sums).enumerate() {
            // Block i is row i / groups's block i % groups.
            let at = (i % groups) * padded + i / groups;
            d[at] = f16_round(*scale);
            s[at] = f16_round(*sum as f32 * scale);
        }
        Self {
            n,
            cols,
            q,
            d,
            s,
            padded,
        }
    }

    /// Row `r`'s scale of block `g`.
    pub fn d_at(&self, r: usize, g: usize) -> f32 {
        self.d[g * self.padded + r]
    }

    /// Row `r`'s `d·Σq` of block `g`.
    pub fn s_at(&self, r: usize, g: usize) -> f32 {
        self.s[g * self.padded + r]
    }
}

/// The lanes summed as ggml's `hsum_float_8` does.
pub(crate) fn hsum(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// Scalar kernel: output `j` of every row of `x` against one matrix row (its blocks as
/// stored, of type `ty`), into `acc [n, nb]`.
pub(crate) fn dot_row(ty: GgmlType, row: &[u8], x: &Q8Rows, acc: &mut [f32], nb: usize, j: usize) {
    let layout = Layout::of(ty);
    let mut lanes = vec![[0f32; 8]; x.n];
    let mut offsets = vec![0f32; x.n];
    for (blk, block) in row.chunks_exact(layout.size).enumerate() {
        let scales = group::block_scales(ty, block, group::halves_to_f32);
        for (sub, sc) in scales.iter().enumerate().take(1 << layout.shift) {
            let g = (blk << layout.shift) + sub;
            let w = group::values(ty, block, sub);
            for (r, (lane, o)) in lanes.iter_mut().zip(&mut offsets).enumerate() {
                let qs = &x.q[r * x.cols + g * 32..r * x.cols + g * 32 + 32];
                let dx = x.d_at(r, g);
                for (l, lv) in lane.iter_mut().enumerate() {
                    let dot: i32 = (4 * l..4 * l + 4)
                        .map(|k| i32::from(w[k]) * i32::from(qs[k]))
                        .sum();
                    *lv = (sc.d[l / 4] * dx).mul_add(dot as f32, *lv);
                }
                if group::has_offset(ty) {
                    *o += sc.offset * x.s_at(r, g);
                }
            }
        }
    }
    for (r, (l, o)) in lanes.iter().zip(&offsets).enumerate() {
        acc[r * nb + j] = hsum(l) + o;
    }
}

/// Rows of `x` per register group of the SIMD kernels (one accumulator each).
#[cfg(target_arch = "x86_64")]
pub(crate) const GROUP: usize = ROW_PAD;

/// `$group::<G, T>$args` with `G` = `$g` (1 to [`GROUP`]) known at compile time: the SIMD
/// kernels' register groups of input rows.
#[cfg(target_arch = "x86_64")]
macro_rules! rows_in_registers {
    ($group:ident, $g:expr, $t:ident, $args:tt) => {
        match $g {
            1 => $group::<1, $t> $args,
            2 => $group::<2, $t> $args,
            3 => $group::<3, $t> $args,
            4 => $group::<4, $t> $args,
            5 => $group::<5, $t> $args,
            6 => $group::<6, $t> $args,
            7 => $group::<7, $t> $args,
            _ => $group::<8, $t> $args,
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use rows_in_registers;

/// Output `j` of a batch of `n` rows, [`GROUP`] rows at a time: `group(g, r0, out)` computes
/// rows `r0..r0 + g` into `out[..g]`, which go to `acc[(r0 + q) * nb + j]`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn by_row_groups(
    n: usize,
    acc: &mut [f32],
    nb: usize,
    j: usize,
    mut group: impl FnMut(usize, usize, &mut [f32; GROUP]),
) {
    let mut out = [0f32; GROUP];
    let mut r0 = 0;
    while r0 < n {
        let g = (n - r0).min(GROUP);
        group(g, r0, &mut out);
        for (q, v) in out.iter().enumerate().take(g) {
            acc[(r0 + q) * nb + j] = *v;
        }
        r0 += g;
    }
}

/// The SIMD kernels, one body compiled for AVX2 (`maddubs` + `madd`) and for AVX-512 VNNI
/// (`dpbusd` on 256-bit registers): the same integers, the same float operations. `$group`
/// takes `G` rows at once (accumulators in registers) for one weight type `TYPES[T]`, both
/// known at compile time; `$name` splits the rows into such groups.
#[cfg(target_arch = "x86_64")]
macro_rules! simd_dot_row {
    ($name:ident, $group:ident, $features:literal, $dot:ident) => {
        /// Rows `r0..r0 + G` of `x` against `row` into `out[..G]`.
        #[target_feature(enable = $features)]
        fn $group<const G: usize, const T: u8>(
            row: &[u8],
            x: &Q8Rows,
            r0: usize,
            out: &mut [f32; GROUP],
        ) {
            use std::arch::x86_64::*;
            let ty = group::TYPES[T as usize];
            let layout = Layout::of(ty);
            let groups = x.cols / 32;
            assert!(
                G <= GROUP
                    && r0 + G <= x.n
                    && r0 + GROUP <= x.padded
                    && x.cols.is_multiple_of(32 << layout.shift)
                    && row.len() == layout.row_bytes(x.cols)
                    && x.q.len() == x.n * x.cols
                    && x.d.len() == groups * x.padded
                    && x.s.len() == groups * x.padded
            );
            let (unsigned, offset) = (group::unsigned(ty), group::has_offset(ty));
            let mut s = [_mm256_setzero_ps(); G];
            // The offset terms of the group's rows, one per lane: lane q is row r0 + q.
            let mut offsets = _mm256_setzero_ps();
            // `d_w · d_x` of each row for the group at hand (and the second half's, Q6_K).
            let (mut d0, mut d1) = ([0f32; GROUP], [0f32; GROUP]);
            for (blk, block) in row.chunks_exact(layout.size).enumerate() {
                group::prefetch_ahead(block);
                // SAFETY: the kernel's features include F16C.
                let scales = group::block_scales(ty, block, |h| unsafe { group::halves_f16c(h) });
                for (sub, sc) in scales.iter().enumerate().take(1 << layout.shift) {
                let g = (blk << layout.shift) + sub;
                // SAFETY: `block` is a whole block of `ty` and `sub` one of its groups.
                let [lo, hi] = unsafe { group::values_sse2(ty, block.as_ptr(), sub) };
                let w = _mm256_set_m128i(hi, lo);
                // Unsigned weights meet the inputs as they are; signed ones as |w| and the
                // inputs with w's sign (ggml's `mul_sum_i8_pairs`): the same products.
                let a = if unsigned { w } else { _mm256_sign_epi8(w, w) };
                // The scalar kernel's per-row products, `d_w · d_x` and `offset · s_x`, for
                // eight rows at once (lane by lane the same operations, so the same bits).
                let at = g * x.padded + r0;
                // SAFETY: at + 8 <= groups * padded = the lengths of `d` and `s` (asserted).
                let dx = unsafe { _mm256_loadu_ps(x.d.as_ptr().add(at)) };
                // SAFETY: `d0` holds eight floats.
                unsafe { _mm256_storeu_ps(d0.as_mut_ptr(), _mm256_mul_ps(_mm256_set1_ps(sc.d[0]), dx)) };
                // Two scales (lanes 0–3 and 4–7) only in a Q6_K group.
                if ty == GgmlType::Q6K {
                    // SAFETY: `d1` holds eight floats.
                    unsafe { _mm256_storeu_ps(d1.as_mut_ptr(), _mm256_mul_ps(_mm256_set1_ps(sc.d[1]), dx)) };
                }
                if offset {
                    // SAFETY: as for `dx`.
                    let sx = unsafe { _mm256_loadu_ps(x.s.as_ptr().add(at)) };
                    offsets = _mm256_add_ps(offsets, _mm256_mul_ps(_mm256_set1_ps(sc.offset), sx));
                }
                for (q, sq) in s.iter_mut().enumerate() {
                    let r = r0 + q;
                    // SAFETY: r * cols + g * 32 + 32 <= n * cols = x.q.len() (asserted).
                    let qy = unsafe {
                        _mm256_loadu_si256(x.q.as_ptr().add(r * x.cols + g * 32) as *const __m256i)
                    };
                    let b = if unsigned { qy } else { _mm256_sign_epi8(qy, w) };
                    let dot = $dot(a, b);
                    let d = if ty == GgmlType::Q6K {
                        _mm256_set_m128(_mm_set1_ps(d1[q]), _mm_set1_ps(d0[q]))
                    } else {
                        _mm256_set1_ps(d0[q])
                    };
                    *sq = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot), *sq);
                }
                }
            }
            let mut o = [0f32; GROUP];
            // SAFETY: `o` holds eight floats.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), offsets) };
            for (q, (sq, o)) in s.iter().zip(&o).enumerate() {
                let mut l = [0f32; 8];
                // SAFETY: `l` holds 8 floats.
                unsafe { _mm256_storeu_ps(l.as_mut_ptr(), *sq) };
                out[q] = hsum(&l) + o;
            }
        }

        /// Outputs `0..m` of every row of `x` against the `m` matrix rows of `rb` bytes
        /// each in `rows`, into `acc [n, nb]`.
        #[target_feature(enable = $features)]
        pub(crate) fn $name(
            ty: GgmlType,
            rows: &[u8],
            rb: usize,
            x: &Q8Rows,
            acc: &mut [f32],
            nb: usize,
        ) {
            for (j, row) in rows.chunks_exact(rb).enumerate() {
                by_row_groups(x.n, acc, nb, j, |g, r0, out| {
                    group::with_type!(ty, T => rows_in_registers!($group, g, T, (row, x, r0, out)))
                });
            }
        }
    };
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
simd_dot_row!(dot_row_avx2, group_avx2, "avx2,fma,f16c", dot_avx2);
#[cfg(target_arch = "x86_64")]
simd_dot_row!(
    dot_row_vnni,
    group_vnni,
    "avx2,fma,f16c,avx512f,avx512vnni,avx512vl",
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

    /// Outputs `0..m` of every row of `x` against the `m` matrix rows whose blocks `rows`
    /// holds one after the other, into `acc [n, nb]`; each output as a call for its row alone
    /// computes it, the kernel chosen once per call.
    ///
    /// # Panics
    /// If `rows` is not whole matrix rows of `x.cols` values of `ty`.
    pub fn dot_rows(self, ty: GgmlType, rows: &[u8], x: &Q8Rows, acc: &mut [f32], nb: usize) {
        let rb = Layout::of(ty).row_bytes(x.cols);
        assert!(
            rb > 0 && rows.len().is_multiple_of(rb),
            "dot_rows: not whole matrix rows"
        );
        match self {
            Kernel::Scalar => {
                for (j, row) in rows.chunks_exact(rb).enumerate() {
                    dot_row(ty, row, x, acc, nb, j);
                }
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                // SAFETY: `detect`/`available` chose it only where the CPU has AVX2, FMA and
                // F16C (`SimdLevel::Avx2`).
                unsafe { dot_row_avx2(ty, rows, rb, x, acc, nb) }
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => {
                // SAFETY: `detect`/`available` chose it only where the CPU has AVX-512 VNNI.
                unsafe { dot_row_vnni(ty, rows, rb, x, acc, nb) }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The add-and-subtract roundings are the standard library's (ties to even, halves away
    /// from zero) over the range the quantisers use, exact halves included.
    #[test]
    fn small_values_round_to_nearest_even() {
        for i in -140_000..=140_000 {
            for v in [
                i as f32 / 1000.0,
                i as f32 / 1000.0 + 0.0005,
                (i / 500) as f32 * 0.5,
            ] {
                assert_eq!(round_small(v), v.round_ties_even(), "{v}");
                assert_eq!(round_away_small(v), v.round(), "{v}");
            }
        }
    }

    /// Every SIMD level quantises as the scalar loop, bit for bit: random values, exact
    /// halves of a step, zeros, a block of one value.
    #[test]
    fn quantisation_is_the_same_at_every_simd_level() {
        let mut state = 7u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        let mut x: Vec<f32> = (0..64 * 32)
            .map(|_| ((next() % 20001) as f32 - 10000.0) * 1e-3)
            .collect();
        // Block 1: halves of the step 1/127 · amax (amax 127: steps of 1).
        for (i, v) in x[32..64].iter_mut().enumerate() {
            *v = i as f32 - 15.5;
        }
        x[63] = 127.0;
        x[64..96].fill(0.0);
        x[96..128].fill(-3.25);
        // A block whose scale is so small that 1/d overflows (0 · ∞ is NaN), and blocks with
        // a NaN and infinities.
        x[128..160].fill(0.0);
        x[130] = 1e-37;
        x[140] = -3e-38;
        x[170] = f32::NAN;
        x[200] = f32::INFINITY;
        x[201] = f32::NEG_INFINITY;
        x[250] = f32::NAN;
        x[231] = f32::INFINITY;
        let blocks = x.len() / 32;
        let mut want = (vec![0i8; x.len()], vec![0f32; blocks], vec![0i32; blocks]);
        quantize_blocks(
            kd_kernels::cpu::SimdLevel::Scalar,
            &x,
            &mut want.0,
            &mut want.1,
            &mut want.2,
        );
        assert_eq!(
            want.0[32..36],
            [-16, -15, -14, -13],
            "halves away from zero"
        );
        for level in [
            kd_kernels::cpu::SimdLevel::Avx2,
            kd_kernels::cpu::SimdLevel::Avx512,
        ] {
            let mut got = (vec![0i8; x.len()], vec![0f32; blocks], vec![0i32; blocks]);
            quantize_blocks(level, &x, &mut got.0, &mut got.1, &mut got.2);
            assert_eq!(got.0, want.0, "{level:?}");
            assert_eq!(
                got.1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{level:?}"
            );
            assert_eq!(got.2, want.2, "{level:?}");
        }
    }

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
            assert_eq!(q.d_at(b, 0), f16::from_f32(d).to_f32());
            assert_eq!(q.s_at(b, 0), f16::from_f32(sum as f32 * d).to_f32());
        }
        // Block-major: block b's rows side by side, zeros past the last row.
        let x3: Vec<f32> = (0..3 * 64).map(|i| (i as f32 * 0.73).sin()).collect();
        let q3 = Q8Rows::quantize(&x3, 3, 64);
        assert_eq!(q3.padded, 8);
        for b in 0..2 {
            for r in 0..8 {
                let xs = &x3[r.min(2) * 64 + b * 32..][..32];
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = if r < 3 {
                    f16::from_f32(amax / 127.0).to_f32()
                } else {
                    0.0
                };
                assert_eq!(q3.d[b * 8 + r], d, "d {b} {r}");
                assert_eq!(q3.d_at(r, b), d, "d_at {b} {r}");
                assert!(r < 3 || q3.s[b * 8 + r] == 0.0, "s {b} {r}");
            }
        }
        let zeros = Q8Rows::quantize(&[0.0; 32], 1, 32);
        assert!(
            zeros.q.iter().all(|v| *v == 0) && zeros.d_at(0, 0) == 0.0 && zeros.s_at(0, 0) == 0.0
        );
    }
}

//! Integer dot products for the K-quant types (Q4_K, Q5_K, Q6_K), as ggml pairs them with
//! 8-bit activations of its Q8_K type: each input row is quantised once per product to
//! super-blocks of 256 values with one f32 scale (`d = max / −127`, the value of largest
//! magnitude `max` going to −127, `q = round(x / d)` with ties to even, as
//! `quantize_row_q8_K_ref`), and the sum of each group of 32 `q`s kept. A weight super-block
//! then meets an input super-block in integers throughout: `Σ_j sc_j · (w_j · q_j)` in eight
//! lanes (Q6_K: lanes 0–3 and 4–7 with a group's two scales) and `Σ_j m_j · Σq_j` for the
//! minimums, and in floats only once per super-block: `d_w·d_x` times the lanes, and
//! `dmin_w·d_x` times the minimums' sum, subtracted. [`q8`](crate::q8)'s 32-value activations
//! cost one float multiply-add per group of 32 instead, each waiting on the one before.
//!
//! As in [`q8`](crate::q8), the integer part is exact and the float part the same operations
//! in the same order, so the scalar and AVX2 kernels (which AVX-512 CPUs run too: VNNI's
//! `dpbusd` has no place for the group's scale) give the same bits, and a row's result does
//! not depend on the other rows of the batch.

use kd_gguf::GgmlType;

use crate::packed::group::{self, Layout};
#[cfg(target_arch = "x86_64")]
use crate::q8::{GROUP, by_row_groups, rows_in_registers};
use crate::q8::{Kernel, hsum, round_small};

/// Whether `ty` is a K-quant type, whose products take [`Q8KRows`].
pub(crate) fn is_kquant(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K)
}

/// Input rows quantised to 8-bit super-blocks of 256 (ggml's Q8_K).
pub(crate) struct Q8KRows {
    /// Rows.
    pub n: usize,
    /// Values per row (a multiple of 256).
    pub cols: usize,
    /// The quantised values, `[n, cols]`.
    pub q: Vec<i8>,
    /// Each super-block's scale, `[n, cols / 256]`.
    pub d: Vec<f32>,
    /// The sum of each group of 32 values, `[n, cols / 32]` (at most 32 · 127 in magnitude).
    pub sums: Vec<i16>,
}

impl Q8KRows {
    /// Quantises `x [n, cols]` (row-major, `cols` a multiple of 256) as ggml's reference
    /// `quantize_row_q8_K_ref` does.
    pub fn quantize(x: &[f32], n: usize, cols: usize) -> Self {
        assert!(
            cols.is_multiple_of(256) && x.len() == n * cols,
            "x must be [n, cols] with cols a multiple of 256"
        );
        let mut q = vec![0i8; n * cols];
        let mut d = Vec::with_capacity(n * cols / 256);
        for (xs, qs) in x.chunks_exact(256).zip(q.chunks_exact_mut(256)) {
            let (mut max, mut amax) = (0f32, 0f32);
            for &v in xs {
                if v.abs() > amax {
                    (amax, max) = (v.abs(), v);
                }
            }
            if amax == 0.0 {
                d.push(0.0);
                continue;
            }
            let iscale = -127.0 / max;
            for (v, o) in xs.iter().zip(qs.iter_mut()) {
                // |iscale · v| <= 127 up to rounding; `as` saturates below, ggml clamps above.
                *o = round_small(iscale * v).min(127.0) as i8;
            }
            d.push(1.0 / iscale);
        }
        let sums = q
            .chunks_exact(32)
            .map(|g| g.iter().map(|v| i16::from(*v)).sum())
            .collect();
        Self {
            n,
            cols,
            q,
            d,
            sums,
        }
    }
}

/// A K-quant super-block's scales as integers: `d` and `dmin` (Q6_K: no minimum), the
/// group scales as bytes (Q4_K/Q5_K: group `j`'s scale at `j`, unsigned; Q6_K: group `j`'s
/// scales for values 0–15 and 16–31 at `2j` and `2j + 1`, signed), and Q4_K's/Q5_K's group
/// minimums.
struct KScales {
    d: f32,
    dmin: f32,
    sc: [u8; 16],
    m: [u8; 8],
}

impl KScales {
    /// Group `j`'s scale for values 0–15 (`half` 0) or 16–31 (`half` 1) of type `ty`.
    #[inline(always)]
    fn scale(&self, ty: GgmlType, j: usize, half: usize) -> i32 {
        if ty == GgmlType::Q6K {
            i32::from(self.sc[2 * j + half] as i8)
        } else {
            i32::from(self.sc[j])
        }
    }
}

/// The eight 6-bit scales and minimums packed in a Q4_K/Q5_K super-block's 12 bytes
/// (`kd_gguf::scale_min_k4` for `j` = 0..8), unpacked with 32-bit operations as ggml's
/// kernels do.
#[inline(always)]
fn scales_mins_k4(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes(q[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    let (u0, u1, u2) = (word(0), word(1), word(2));
    let sc = [u0 & LOW6, (u2 & LOW4) | (((u0 >> 6) & LOW2) << 4)];
    let m = [u1 & LOW6, ((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4)];
    let bytes = |w: [u32; 2]| {
        let mut out = [0u8; 8];
        out[..4].copy_from_slice(&w[0].to_le_bytes());
        out[4..].copy_from_slice(&w[1].to_le_bytes());
        out
    };
    (bytes(sc), bytes(m))
}

/// The scales of super-block `block` of type `ty` (see [`group::block_scales`] for the f16
/// reads; `halves` converts two f16s).
#[inline(always)]
fn k_scales(ty: GgmlType, block: &[u8], halves: impl Fn(u32) -> [f32; 2]) -> KScales {
    let pair = |at: usize| group::f16_pair(block, at, &halves);
    if ty == GgmlType::Q6K {
        let [_, d] = pair(206);
        KScales {
            d,
            dmin: 0.0,
            sc: block[192..208].try_into().expect("16 scales"),
            m: [0; 8],
        }
    } else {
        let [d, dmin] = pair(0);
        let (sc, m) = scales_mins_k4(&block[4..16]);
        let mut scales = [0u8; 16];
        scales[..8].copy_from_slice(&sc);
        KScales {
            d,
            dmin,
            sc: scales,
            m,
        }
    }
}

/// The minimums' four lanes summed (the kernels' order).
fn hsum4(l: &[f32; 4]) -> f32 {
    (l[0] + l[2]) + (l[1] + l[3])
}

/// Scalar kernel: output `j` of every row of `x` against one matrix row (its super-blocks as
/// stored, of K-quant type `ty`), into `acc [n, nb]`.
pub(crate) fn dot_row(ty: GgmlType, row: &[u8], x: &Q8KRows, acc: &mut [f32], nb: usize, j: usize) {
    let layout = Layout::of(ty);
    let (groups, blocks) = (x.cols / 32, x.cols / 256);
    for r in 0..x.n {
        let mut lanes = [0f32; 8];
        let mut mins = [0f32; 4];
        for (blk, block) in row.chunks_exact(layout.size).enumerate() {
            let s = k_scales(ty, block, group::halves_to_f32);
            let mut sumi = [0i32; 8];
            for sub in 0..8 {
                let g = blk * 8 + sub;
                let w = group::values(ty, block, sub);
                let qs = &x.q[r * x.cols + g * 32..r * x.cols + g * 32 + 32];
                for (l, lane) in sumi.iter_mut().enumerate() {
                    let dot: i32 = (4 * l..4 * l + 4)
                        .map(|k| i32::from(w[k]) * i32::from(qs[k]))
                        .sum();
                    *lane += s.scale(ty, sub, l / 4) * dot;
                }
            }
            let dx = x.d[r * blocks + blk];
            for (lane, sumi) in lanes.iter_mut().zip(sumi) {
                *lane = (s.d * dx).mul_add(sumi as f32, *lane);
            }
            if group::has_offset(ty) {
                let sums = &x.sums[r * groups + blk * 8..r * groups + blk * 8 + 8];
                for (k, m) in mins.iter_mut().enumerate() {
                    let term = |i: usize| i32::from(s.m[i]) * i32::from(sums[i]);
                    let v = term(2 * k) + term(2 * k + 1);
                    *m = (s.dmin * dx).mul_add(v as f32, *m);
                }
            }
        }
        acc[r * nb + j] = hsum(&lanes) - hsum4(&mins);
    }
}

/// Rows `r0..r0 + G` of `x` against `row` into `out[..G]`, AVX2: per group of 32, `maddubs`
/// (byte pairs) then `madd` against the group's scales as 16-bit lanes (the scaled sums of
/// four products), added over the super-block in i32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn group_avx2<const G: usize, const T: u8>(
    row: &[u8],
    x: &Q8KRows,
    r0: usize,
    out: &mut [f32; GROUP],
) {
    use std::arch::x86_64::*;
    let ty = group::TYPES[T as usize];
    let layout = Layout::of(ty);
    let (groups, blocks) = (x.cols / 32, x.cols / 256);
    assert!(
        G <= GROUP
            && r0 + G <= x.n
            && layout.shift == 3
            && x.cols.is_multiple_of(256)
            && row.len() == blocks * layout.size
            && x.q.len() == x.n * x.cols
            && x.d.len() == x.n * blocks
            && x.sums.len() == x.n * groups
    );
    let (unsigned, offset) = (group::unsigned(ty), group::has_offset(ty));
    // Shuffles picking 16-bit lane `lo` for values 0–15 and `hi` for 16–31.
    let pick = |lo: usize, hi: usize| {
        let pair = |i: usize| (((2 * i + 1) << 8) | (2 * i)) as i16;
        _mm256_set_m128i(_mm_set1_epi16(pair(hi)), _mm_set1_epi16(pair(lo)))
    };
    let mut lanes = [_mm256_setzero_ps(); G];
    let mut mins = [_mm_setzero_ps(); G];
    for (blk, block) in row.chunks_exact(layout.size).enumerate() {
        group::prefetch_ahead(block);
        // SAFETY: the kernel's features include F16C.
        let s = k_scales(ty, block, |h| unsafe { group::halves_f16c(h) });
        // The scales as 16-bit lanes: Q4_K/Q5_K's eight in both halves; Q6_K's first and
        // last eight, each in both halves.
        // SAFETY: `s.sc` holds 16 bytes.
        let sc = unsafe { _mm_loadu_si128(s.sc.as_ptr() as *const __m128i) };
        let (first, last) = if ty == GgmlType::Q6K {
            let all = _mm256_cvtepi8_epi16(sc);
            (
                _mm256_permute2x128_si256::<0x00>(all, all),
                _mm256_permute2x128_si256::<0x11>(all, all),
            )
        } else {
            let eight = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sc));
            (eight, eight)
        };
        let mut sumi = [_mm256_setzero_si256(); G];
        for sub in 0..8 {
            let g = blk * 8 + sub;
            // SAFETY: `block` is a whole super-block of `ty` and `sub` one of its groups.
            let [lo, hi] = unsafe { group::values_sse2(ty, block.as_ptr(), sub) };
            let w = _mm256_set_m128i(hi, lo);
            // Signed weights (Q6_K) meet the inputs as |w| and the inputs with w's sign.
            let a = if unsigned { w } else { _mm256_sign_epi8(w, w) };
            let scale = if ty == GgmlType::Q6K {
                let i = 2 * sub % 8;
                _mm256_shuffle_epi8(if sub < 4 { first } else { last }, pick(i, i + 1))
            } else {
                _mm256_shuffle_epi8(first, pick(sub, sub))
            };
            for (q, si) in sumi.iter_mut().enumerate() {
                let r = r0 + q;
                // SAFETY: r * cols + g * 32 + 32 <= n * cols = x.q.len() (asserted).
                let qy = unsafe {
                    _mm256_loadu_si256(x.q.as_ptr().add(r * x.cols + g * 32) as *const __m256i)
                };
                let b = if unsigned {
                    qy
                } else {
                    _mm256_sign_epi8(qy, w)
                };
                let pairs = _mm256_maddubs_epi16(a, b);
                *si = _mm256_add_epi32(*si, _mm256_madd_epi16(pairs, scale));
            }
        }
        // SAFETY: `s.m` holds 8 bytes.
        let m = unsafe { _mm_cvtepu8_epi16(_mm_loadl_epi64(s.m.as_ptr() as *const __m128i)) };
        for (q, ((l, mn), si)) in lanes.iter_mut().zip(&mut mins).zip(&sumi).enumerate() {
            let r = r0 + q;
            let dx = x.d[r * blocks + blk];
            *l = _mm256_fmadd_ps(_mm256_set1_ps(s.d * dx), _mm256_cvtepi32_ps(*si), *l);
            if offset {
                let at = r * groups + blk * 8;
                // SAFETY: at + 8 <= n * groups = x.sums.len() (asserted).
                let sums = unsafe { _mm_loadu_si128(x.sums.as_ptr().add(at) as *const __m128i) };
                let v = _mm_cvtepi32_ps(_mm_madd_epi16(m, sums));
                *mn = _mm_fmadd_ps(_mm_set1_ps(s.dmin * dx), v, *mn);
            }
        }
    }
    for (q, (l, mn)) in lanes.iter().zip(&mins).enumerate() {
        let (mut v, mut w) = ([0f32; 8], [0f32; 4]);
        // SAFETY: `v` holds 8 floats and `w` 4.
        unsafe {
            _mm256_storeu_ps(v.as_mut_ptr(), *l);
            _mm_storeu_ps(w.as_mut_ptr(), *mn);
        }
        out[q] = hsum(&v) - hsum4(&w);
    }
}

/// Outputs `0..m` of every row of `x` against the `m` matrix rows of `rb` bytes each in
/// `rows`, AVX2, in register groups of `GROUP` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_rows_avx2(ty: GgmlType, rows: &[u8], rb: usize, x: &Q8KRows, acc: &mut [f32], nb: usize) {
    for (j, row) in rows.chunks_exact(rb).enumerate() {
        by_row_groups(
            x.n,
            acc,
            nb,
            j,
            |g, r0, out| group::with_type!(ty, T => rows_in_registers!(group_avx2, g, T, (row, x, r0, out))),
        );
    }
}

impl Kernel {
    /// Outputs `0..m` of every row of `x` against the `m` matrix rows (K-quant super-blocks)
    /// whose blocks `rows` holds one after the other, into `acc [n, nb]`; each output as a
    /// call for its row alone computes it.
    ///
    /// # Panics
    /// If `ty` is not a K-quant type or `rows` is not whole matrix rows of `x.cols` values.
    pub fn dot_rows_k(self, ty: GgmlType, rows: &[u8], x: &Q8KRows, acc: &mut [f32], nb: usize) {
        assert!(is_kquant(ty), "not a K-quant type: {ty:?}");
        let rb = Layout::of(ty).row_bytes(x.cols);
        assert!(
            rb > 0 && rows.len().is_multiple_of(rb),
            "dot_rows_k: not whole matrix rows"
        );
        match self {
            Kernel::Scalar => {
                for (j, row) in rows.chunks_exact(rb).enumerate() {
                    dot_row(ty, row, x, acc, nb, j);
                }
            }
            // VNNI's `dpbusd` sums four products without a scale; the AVX2 kernel's `madd`
            // against the scales does both in the same two instructions.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 | Kernel::Vnni => {
                // SAFETY: `detect`/`available` chose either only where the CPU has AVX2, FMA
                // and F16C (`SimdLevel::Avx2` or above).
                unsafe { dot_rows_avx2(ty, rows, rb, x, acc, nb) }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantisation_follows_ggml_reference() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 101) as f32 - 50.3) * 0.021)
            .collect();
        let q = Q8KRows::quantize(&x, 1, 512);
        for b in 0..2 {
            let xs = &x[b * 256..b * 256 + 256];
            let max = xs
                .iter()
                .fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
            let d = q.d[b];
            assert_eq!(d, 1.0 / (-127.0 / max));
            let qs = &q.q[b * 256..b * 256 + 256];
            for (k, (v, got)) in xs.iter().zip(qs).enumerate() {
                // Within half a step; the value of largest magnitude at −127.
                assert!(
                    (*got as f32 * d - v).abs() <= 0.5 * d.abs() * 1.0001,
                    "{b} {k}"
                );
                if *v == max {
                    assert_eq!(*got, -127);
                }
            }
            for g in 0..8 {
                let want: i16 = qs[g * 32..g * 32 + 32].iter().map(|v| i16::from(*v)).sum();
                assert_eq!(q.sums[b * 8 + g], want);
            }
        }
        let zeros = Q8KRows::quantize(&[0.0; 256], 1, 256);
        assert!(zeros.q.iter().all(|v| *v == 0) && zeros.d == [0.0] && zeros.sums == [0; 8]);
    }

    /// The 32-bit unpacking gives ggml's reference `get_scale_min_k4` for every group, over
    /// byte patterns covering every bit of the 12 bytes.
    #[test]
    fn scales_and_mins_unpack_as_the_reference() {
        let mut state = 99u64;
        for case in 0..2000 {
            let q: [u8; 12] = std::array::from_fn(|i| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                match case {
                    0 => 0xFF,
                    1 => 0,
                    _ => (state >> 33) as u8 ^ (i as u8),
                }
            });
            let (sc, m) = scales_mins_k4(&q);
            for j in 0..8 {
                assert_eq!((sc[j], m[j]), kd_gguf::scale_min_k4(j, &q), "{q:?} {j}");
            }
        }
    }
}

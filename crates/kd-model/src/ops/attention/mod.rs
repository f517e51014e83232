//! Masked attention with grouped K/V heads, FlashAttention-2 style on the CPU.
//!
//! Forward: per (batch row, query head), blocks of `QUERY_BLOCK` queries walk blocks of
//! `KEY_BLOCK` keys with an online softmax (running maximum and sum per query; earlier
//! partial outputs rescaled when the maximum grows), so that only one block of scores exists
//! at a time; what is kept for the backward pass is the output and one log-sum-exp per query.
//! Backward: per (batch row, K/V head), the probabilities of each block are recomputed from the
//! scores and the log-sum-exp, and dQ, dK, dV accumulated block by block (`D = rowsum(dO ⊙ O)`
//! replaces the softmax's row dot product). Memory is linear in the sequence: O(batch · heads ·
//! seq · head_dim) plus one score block per thread, where keeping the probabilities took
//! `batch · heads · seq · keys` floats (34 GB for the Llama-3.2-1B shape at 4 × 2048).
//!
//! Each query block only visits the keys between the first and the last one any of its rows
//! may see ([`AttentionJob`]'s key spans: about half the work when causal). K and V may be
//! views into a larger buffer (the KV cache's capacity): each head's keys are contiguous, and
//! heads are `head stride` values apart.

use std::borrow::Cow;
use std::sync::Arc;

use burn::tensor::{Bool, DType, Tensor};
use burn_flex::FlexTensor;
use kd_kernels::gemm::{MatMut, MatRef, Threads, Write, matmul};
use kd_kernels::math::{self, exp, ln};
use kd_kernels::{dispatch, f32_view};
use rayon::prelude::*;

use super::shape;
use crate::error::{ModelError, Result};
#[cfg(target_arch = "x86_64")]
use crate::packed::group::prefetch_ahead;

/// Cached keys from which a short pass with few K/V heads cuts its queries evenly across the
/// threads rather than one task per head. Measured on SmolLM2 (three K/V heads, two cores),
/// batch 1, paired runs alternating in one process: decoding after 1024 and 2048 prompt
/// tokens 0–20% faster (geometric means of six pairs per path and length), after 32 tokens
/// unclear (−6% to +1%), so shorter caches keep a task per head.
const EVEN_SPLIT_FROM_KEYS: usize = 1024;

/// Query rows per block.
pub(crate) const QUERY_BLOCK: usize = 64;
/// Keys per block of the online softmax.
pub(crate) const KEY_BLOCK: usize = 256;
/// Queries per batch row up to which each query is computed alone, over its own keys (the
/// bits of a one-token pass); longer passes take blocks of [`QUERY_BLOCK`].
pub(crate) const ROW_BY_ROW: usize = 16;

/// The mask and scale of one attention call, with the key span of every block of queries.
///
/// Built by [`AttentionJob::new`], which checks the mask's size and derives the spans, so
/// that a job always describes its mask.
#[derive(Debug, Clone)]
pub struct AttentionJob {
    mask: Arc<[bool]>,
    spans: Arc<[(usize, usize)]>,
    scale: f32,
    batch: usize,
    seq: usize,
    keys: usize,
}

impl AttentionJob {
    /// A job for `mask` (`[batch, seq, keys]` row-major, `true` = masked out, shared by all
    /// heads) and the score multiplier `scale`; an error when the mask has the wrong size or
    /// the scale is not finite.
    pub fn new(mask: Vec<bool>, batch: usize, seq: usize, keys: usize, scale: f32) -> Result<Self> {
        if mask.len() != batch * seq * keys {
            return Err(ModelError::Input(format!(
                "attention: a mask of {} entries for [batch, seq, keys] = [{batch}, {seq}, {keys}]",
                mask.len()
            )));
        }
        if !scale.is_finite() {
            return Err(ModelError::Input(format!(
                "attention: the score scale must be finite, got {scale}"
            )));
        }
        let spans = key_spans(&mask, batch, seq, keys);
        Ok(Self {
            mask: mask.into(),
            spans: spans.into(),
            scale,
            batch,
            seq,
            keys,
        })
    }

    /// A job for a `[batch, 1, seq, keys]` boolean mask tensor.
    pub fn from_mask(mask: &Tensor<4, Bool>, scale: f64) -> Result<Self> {
        let [b, one, s, t] = mask.dims();
        if one != 1 {
            return Err(ModelError::Input(format!(
                "attention: the mask must be [batch, 1, seq, keys], got {:?}",
                mask.dims()
            )));
        }
        let values = mask
            .clone()
            .into_data()
            .convert::<bool>()
            .try_into_vec::<bool>()
            .map_err(|e| ModelError::Input(format!("attention: the mask is not boolean: {e:?}")))?;
        Self::new(values, b, s, t, scale as f32)
    }

    /// `(batch, seq, keys)` of the mask.
    pub fn dims(&self) -> (usize, usize, usize) {
        (self.batch, self.seq, self.keys)
    }
}

/// For each batch row and block of [`QUERY_BLOCK`] queries, the key range `k0..k1` that
/// holds every unmasked key of the block (`(0, 0)` when the block sees none).
fn key_spans(mask: &[bool], b: usize, s: usize, t: usize) -> Vec<(usize, usize)> {
    let blocks = s.div_ceil(QUERY_BLOCK);
    let mut spans = Vec::with_capacity(b * blocks);
    for bi in 0..b {
        for blk in 0..blocks {
            let (mut k0, mut k1) = (t, 0);
            for i in blk * QUERY_BLOCK..((blk + 1) * QUERY_BLOCK).min(s) {
                let row = &mask[(bi * s + i) * t..][..t];
                if let Some(first) = row.iter().position(|m| !m) {
                    let last = row.iter().rposition(|m| !m).unwrap_or(first);
                    k0 = k0.min(first);
                    k1 = k1.max(last + 1);
                }
            }
            spans.push(if k1 > k0 { (k0, k1) } else { (0, 0) });
        }
    }
    spans
}

/// Dimensions of a call (K/V head spacing is passed beside the K/V values).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnDims {
    pub(crate) b: usize,
    pub(crate) h: usize,
    pub(crate) kv: usize,
    pub(crate) s: usize,
    pub(crate) t: usize,
    pub(crate) d: usize,
}

/// The dimensions of an attention call, after checking that every operand fits them and the
/// job (a panic naming the shapes: the model builds these operands itself).
fn attention_dims(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    job: &AttentionJob,
    backward: Option<(&FlexTensor, &FlexTensor, &FlexTensor)>,
) -> AttnDims {
    let (qs, ks, vs) = (shape(q), shape(k), shape(v));
    assert!(
        qs.len() == 4 && ks.len() == 4 && ks == vs,
        "masked_attention: q {qs:?}, k {ks:?} and v {vs:?} must be [b, h, s, d], [b, kv, t, d], [b, kv, t, d]"
    );
    let (b, h, s, d) = (qs[0], qs[1], qs[2], qs[3]);
    let (kb, kv, t, kd) = (ks[0], ks[1], ks[2], ks[3]);
    assert!(
        kb == b && kd == d && kv > 0 && h % kv == 0,
        "masked_attention: q {qs:?} and k {ks:?} do not agree (batch, head width, heads a multiple of the K/V heads)"
    );
    assert_eq!(
        job.dims(),
        (b, s, t),
        "masked_attention: the mask must be [b, s, t] = [{b}, {s}, {t}]"
    );
    if let Some((out, lse, dout)) = backward {
        assert_eq!(
            shape(out),
            qs,
            "masked_attention_backward: the output's shape"
        );
        assert_eq!(
            shape(lse),
            [b, h, s],
            "masked_attention_backward: the log-sum-exp's shape"
        );
        assert_eq!(
            shape(dout),
            qs,
            "masked_attention_backward: the output gradient's shape"
        );
    }
    AttnDims { b, h, kv, s, t, d }
}

/// The values of a K or V tensor `[b, kv, t, d]` and the distance between its heads: the
/// storage itself when each head's `t · d` values are contiguous (a view of the first `t`
/// slots of a larger cache qualifies), a contiguous copy otherwise.
fn head_view(x: &FlexTensor) -> (Cow<'_, [f32]>, usize) {
    let dims = shape(x);
    let (heads, t, d) = (dims[0] * dims[1], dims[2], dims[3]);
    let layout = x.layout();
    let st = layout.strides();
    if x.dtype() == DType::F32 && layout.start_offset() == 0 && heads > 0 && t > 0 {
        let (b, kv) = (dims[0], dims[1]);
        // The distance between consecutive heads (a size-1 axis's stride is arbitrary).
        let hs = if kv > 1 {
            st[1]
        } else if b > 1 {
            st[0]
        } else {
            (t * d) as isize
        };
        let rows_contiguous = (t == 1 || st[2] == d as isize) && (d == 1 || st[3] == 1);
        let heads_even = kv == 1 || b == 1 || st[0] == hs * kv as isize;
        if rows_contiguous && heads_even && hs >= (t * d) as isize {
            let hs = hs as usize;
            let storage = x.storage::<f32>();
            let needed = (heads - 1) * hs + t * d;
            if storage.len() >= needed {
                return (Cow::Borrowed(&storage[..needed]), hs);
            }
        }
    }
    (f32_view(x), t * d)
}

dispatch! {
    /// One block of scores of one query row into probabilities against the running maximum
    /// `state.0` and sum `state.1` (online softmax); `state.2` receives the factor the row's
    /// earlier partial output must be multiplied by. Masked scores become 0.
    fn online_softmax_row(row: &mut [f32], mask: &[bool], state: &mut (f32, f32, f32)) {
        for (x, m) in row.iter_mut().zip(mask) {
            if *m {
                *x = f32::NEG_INFINITY;
            }
        }
        let block_max = math::max(row);
        if block_max == f32::NEG_INFINITY {
            row.fill(0.0);
            state.2 = 1.0;
            return;
        }
        let (m, l) = (state.0, state.1);
        let m_new = if block_max > m { block_max } else { m };
        let correction = if m == f32::NEG_INFINITY { 0.0 } else { exp(m - m_new) };
        for x in row.iter_mut() {
            *x = exp(*x - m_new);
        }
        let sum = math::sum_map(row, |x| x);
        *state = (m_new, l * correction + sum, correction);
    }
}

/// Lanes of a short pass's dot products (one AVX-512 register of f32).
const DOT_LANES: usize = 16;

/// Keys per tile of a short pass: every query of a K/V head meets a tile's keys (and then its
/// values) while they sit in the L1 cache, so that each key is read from memory once per pass
/// rather than once per query.
const KEY_TILE: usize = 64;

/// A query of a short pass and where its result goes.
struct QueryRow<'a> {
    /// The query, `[d]`.
    q: &'a [f32],
    /// The keys it sees: `first..end` of its keys and values (all visible).
    first: usize,
    end: usize,
    /// Its output `[d]` and log-sum-exp.
    out: &'a mut [f32],
    lse: &'a mut f32,
    /// Its scores, then probabilities (`end − first`).
    scores: Vec<f32>,
}

/// Queries of one K/V head against their spans of `keys` and `values` (`[t, d]` rows):
/// each query's scores as [`scores_into`] computes them, its softmax at once, then
/// `out = (Σ_j p_j v_j) / Σ_j p_j` with each output a sum in key order ([`weighted_into`]),
/// and the log-sum-exp. The queries share each tile of [`KEY_TILE`] keys, but every query's
/// arithmetic is its own, the same whichever and however many queries come with it: a
/// query's output has the same bits in every short pass, and on every SIMD level. A short
/// pass's rows (see [`ROW_BY_ROW`]).
fn attend_rows(
    simd: kd_kernels::cpu::SimdLevel,
    rows: &mut [QueryRow<'_>],
    (keys, values): (&[f32], &[f32]),
    d: usize,
    scale: f32,
) {
    let (lo, hi) = rows.iter().fold((usize::MAX, 0), |(lo, hi), r| {
        (lo.min(r.first), hi.max(r.end))
    });
    for r in rows.iter_mut() {
        r.scores.clear();
        r.scores.resize(r.end - r.first, 0.0);
        r.out.fill(0.0);
    }
    // `f(row, keys a..b)` for each row and the part of each tile it sees.
    let tiles = |rows: &mut [QueryRow<'_>], f: &mut dyn FnMut(&mut QueryRow<'_>, usize, usize)| {
        for j0 in (lo..hi).step_by(KEY_TILE) {
            let j1 = (j0 + KEY_TILE).min(hi);
            for r in rows.iter_mut() {
                let (a, b) = (j0.max(r.first), j1.min(r.end));
                if a < b {
                    f(r, a, b);
                }
            }
        }
    };
    tiles(rows, &mut |r, a, b| {
        let at = a - r.first..b - r.first;
        scores_into(simd, r.q, &keys[a * d..b * d], scale, &mut r.scores[at]);
    });
    let norms: Vec<(f32, f32)> = rows
        .iter_mut()
        .map(|r| softmax_row(simd, &mut r.scores))
        .collect();
    tiles(rows, &mut |r, a, b| {
        let at = a - r.first..b - r.first;
        weighted_into(simd, &r.scores[at], &values[a * d..b * d], r.out);
    });
    for (r, (m, l)) in rows.iter_mut().zip(norms) {
        let inv = 1.0 / l;
        for o in r.out.iter_mut() {
            *o *= inv;
        }
        *r.lse = m + ln(l);
    }
}

dispatch! {
    /// Scores into probabilities in place, `exp(x − max)`; returns the maximum and the sum.
    fn softmax_row(row: &mut [f32]) -> (f32, f32) {
        let m = math::max(row);
        for x in row.iter_mut() {
            *x = exp(*x - m);
        }
        (m, math::sum_map(row, |x| x))
    }
}

/// `scores[j] = scale · (q · k_j)` for the key rows of `keys` (`[scores.len(), q.len()]`).
/// Each dot product: [`DOT_LANES`] partial sums (lane = index mod 16; a ragged tail as one
/// more chunk padded with zeros), each `acc += x · y` (a product, then a sum: no fused
/// multiply-add), then added up in a fixed tree — `b_l = a_l + a_{l+8}`, `c_l = b_l + b_{l+4}`,
/// `(c_0 + c_2) + (c_1 + c_3)` — the same operations at every SIMD level, so the same bits.
fn scores_into(
    simd: kd_kernels::cpu::SimdLevel,
    q: &[f32],
    keys: &[f32],
    scale: f32,
    scores: &mut [f32],
) {
    let d = q.len();
    assert!(
        keys.len() >= scores.len() * d,
        "scores_into: keys shorter than the scores"
    );
    #[cfg(target_arch = "x86_64")]
    {
        use kd_kernels::cpu::{SimdLevel, detected};
        match simd.min(detected()) {
            // SAFETY: the CPU has AVX-512 F/DQ (detected); lengths asserted above.
            SimdLevel::Avx512 => return unsafe { scores_avx512(q, keys, scale, scores) },
            // SAFETY: the CPU has AVX2 (detected); lengths asserted above.
            SimdLevel::Avx2 => return unsafe { scores_avx2(q, keys, scale, scores) },
            SimdLevel::Scalar => {}
        }
    }
    let _ = simd;
    for (s, k) in scores.iter_mut().zip(keys.chunks_exact(d.max(1))) {
        let mut acc = [0f32; DOT_LANES];
        for (c, x) in q.chunks(DOT_LANES).enumerate() {
            for (l, x) in x.iter().enumerate() {
                acc[l] += x * k[c * DOT_LANES + l];
            }
            // A ragged chunk's missing lanes add 0 · 0 in the SIMD kernels.
            for a in acc.iter_mut().skip(x.len()) {
                *a += 0.0;
            }
        }
        let a8: [f32; 8] = std::array::from_fn(|l| acc[l] + acc[l + 8]);
        let a4: [f32; 4] = std::array::from_fn(|l| a8[l] + a8[l + 4]);
        *s = scale * ((a4[0] + a4[2]) + (a4[1] + a4[3]));
    }
}

/// A ragged last chunk of `x` (`len < DOT_LANES`) padded with zeros.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn padded(x: &[f32]) -> [f32; DOT_LANES] {
    let mut p = [0f32; DOT_LANES];
    p[..x.len()].copy_from_slice(x);
    p
}

/// [`scores_into`] on AVX-512.
///
/// # Safety
/// The CPU has AVX-512 F and DQ; `keys` holds `scores.len()` rows of `q.len()` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn scores_avx512(q: &[f32], keys: &[f32], scale: f32, scores: &mut [f32]) {
    use std::arch::x86_64::*;
    let d = q.len();
    let (full, rem) = (d / DOT_LANES, d % DOT_LANES);
    let qt = padded(&q[full * DOT_LANES..]);
    for (j, s) in scores.iter_mut().enumerate() {
        let k = &keys[j * d..][..d];
        prefetch_ahead(k);
        // SAFETY: chunks c < full lie within q and k (d values each); the tail is padded.
        unsafe {
            let mut acc = _mm512_setzero_ps();
            for c in 0..full {
                let x = _mm512_loadu_ps(q.as_ptr().add(c * DOT_LANES));
                let y = _mm512_loadu_ps(k.as_ptr().add(c * DOT_LANES));
                acc = _mm512_add_ps(acc, _mm512_mul_ps(x, y));
            }
            if rem > 0 {
                let kt = padded(&k[full * DOT_LANES..]);
                let (x, y) = (_mm512_loadu_ps(qt.as_ptr()), _mm512_loadu_ps(kt.as_ptr()));
                acc = _mm512_add_ps(acc, _mm512_mul_ps(x, y));
            }
            let a8 = _mm256_add_ps(
                _mm512_castps512_ps256(acc),
                _mm512_extractf32x8_ps::<1>(acc),
            );
            *s = scale * reduce8(a8);
        }
    }
}

/// [`scores_into`] on AVX2: each chunk of sixteen lanes in two registers.
///
/// # Safety
/// The CPU has AVX2; `keys` holds `scores.len()` rows of `q.len()` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scores_avx2(q: &[f32], keys: &[f32], scale: f32, scores: &mut [f32]) {
    use std::arch::x86_64::*;
    let d = q.len();
    let (full, rem) = (d / DOT_LANES, d % DOT_LANES);
    let qt = padded(&q[full * DOT_LANES..]);
    // One chunk of sixteen lanes into the two running sums.
    #[inline(always)]
    unsafe fn chunk(x: *const f32, y: *const f32, lo: &mut __m256, hi: &mut __m256) {
        // SAFETY: the caller's x and y hold sixteen values each.
        unsafe {
            *lo = _mm256_add_ps(*lo, _mm256_mul_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(y)));
            *hi = _mm256_add_ps(
                *hi,
                _mm256_mul_ps(_mm256_loadu_ps(x.add(8)), _mm256_loadu_ps(y.add(8))),
            );
        }
    }
    for (j, s) in scores.iter_mut().enumerate() {
        let k = &keys[j * d..][..d];
        prefetch_ahead(k);
        // SAFETY: as for AVX-512, eight lanes at a time: chunks c < full lie within q and k,
        // and the ragged tail (the last chunk, as there) is padded.
        unsafe {
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for c in 0..full {
                let at = c * DOT_LANES;
                chunk(q.as_ptr().add(at), k.as_ptr().add(at), &mut lo, &mut hi);
            }
            if rem > 0 {
                let kt = padded(&k[full * DOT_LANES..]);
                chunk(qt.as_ptr(), kt.as_ptr(), &mut lo, &mut hi);
            }
            *s = scale * reduce8(_mm256_add_ps(lo, hi));
        }
    }
}

/// `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))` of eight lanes, as the scalar tree.
///
/// # Safety
/// The CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn reduce8(a8: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps::<1>(a8));
    // [a4_0 + a4_2, a4_1 + a4_3], then their sum.
    let t = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
    _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps::<1>(t, t)))
}

/// `out[i] += Σ_j p_j · v_j[i]` (`values [p.len(), out.len()]`), each output a running sum
/// over `j` in order of products (no fused multiply-add): the same bits at every SIMD level,
/// which take several outputs at a time in registers, and the same bits whether the keys come
/// in one call or in consecutive tiles.
fn weighted_into(simd: kd_kernels::cpu::SimdLevel, p: &[f32], values: &[f32], out: &mut [f32]) {
    let d = out.len();
    assert!(
        values.len() >= p.len() * d,
        "weighted_into: values shorter than the weights"
    );
    let mut c0 = 0;
    #[cfg(target_arch = "x86_64")]
    {
        use kd_kernels::cpu::{SimdLevel, detected};
        match simd.min(detected()) {
            // SAFETY: the CPU has AVX-512 F (detected); lengths asserted above.
            SimdLevel::Avx512 => c0 = unsafe { weighted_avx512(p, values, out) },
            // SAFETY: the CPU has AVX (detected with AVX2); lengths asserted above.
            SimdLevel::Avx2 => c0 = unsafe { weighted_avx2(p, values, out) },
            SimdLevel::Scalar => {}
        }
    }
    let _ = simd;
    for i in c0..d {
        let mut a = out[i];
        for (j, pj) in p.iter().enumerate() {
            a += pj * values[j * d + i];
        }
        out[i] = a;
    }
}

/// `weighted_into`'s outputs in registers: `$group` outputs `c0..c0 + G · W` (`G` registers
/// of `W` lanes: independent chains of additions) for `G` = `$wide` while they fit (64
/// outputs, a whole head of 64 values, so that one sweep over the value rows reads each row
/// whole), then 4, then 1; returns the first output left to the caller's scalar loop.
#[cfg(target_arch = "x86_64")]
macro_rules! weighted_simd {
    ($name:ident, $features:literal, $w:expr, $wide:expr, $reg:ty, $set1:ident, $load:ident, $store:ident, $add:ident, $mul:ident) => {
        /// # Safety
        /// The CPU has the features named; `values` holds `p.len()` rows of `out.len()`.
        #[target_feature(enable = $features)]
        unsafe fn $name(p: &[f32], values: &[f32], out: &mut [f32]) -> usize {
            use std::arch::x86_64::*;
            #[inline(always)]
            unsafe fn group<const G: usize>(p: &[f32], values: &[f32], out: &mut [f32], c0: usize) {
                let d = out.len();
                // SAFETY: outputs c0..c0 + G·W lie within a row of d values (the caller's
                // loop), and rows j < p.len() within `values`.
                unsafe {
                    let at = out.as_mut_ptr().add(c0);
                    let mut acc: [$reg; G] = std::array::from_fn(|g| $load(at.add(g * $w)));
                    for (j, pj) in p.iter().enumerate() {
                        let (pv, row) = ($set1(*pj), values.as_ptr().add(j * d + c0));
                        prefetch_ahead(std::slice::from_raw_parts(row, G * $w));
                        for (g, a) in acc.iter_mut().enumerate() {
                            *a = $add(*a, $mul(pv, $load(row.add(g * $w))));
                        }
                    }
                    for (g, a) in acc.into_iter().enumerate() {
                        $store(at.add(g * $w), a);
                    }
                }
            }
            let d = out.len();
            let mut c0 = 0;
            // SAFETY: each group's outputs end within d.
            unsafe {
                while c0 + $wide * $w <= d {
                    group::<$wide>(p, values, out, c0);
                    c0 += $wide * $w;
                }
                while c0 + 4 * $w <= d {
                    group::<4>(p, values, out, c0);
                    c0 += 4 * $w;
                }
                while c0 + $w <= d {
                    group::<1>(p, values, out, c0);
                    c0 += $w;
                }
            }
            c0
        }
    };
}

#[cfg(target_arch = "x86_64")]
weighted_simd!(
    weighted_avx512,
    "avx512f",
    16,
    4,
    __m512,
    _mm512_set1_ps,
    _mm512_loadu_ps,
    _mm512_storeu_ps,
    _mm512_add_ps,
    _mm512_mul_ps
);
#[cfg(target_arch = "x86_64")]
weighted_simd!(
    weighted_avx2,
    "avx",
    8,
    8,
    __m256,
    _mm256_set1_ps,
    _mm256_loadu_ps,
    _mm256_storeu_ps,
    _mm256_add_ps,
    _mm256_mul_ps
);

dispatch! {
    /// Recomputed probabilities of one block of scores: `exp(score − lse)`, 0 where masked.
    fn probabilities_row(row: &mut [f32], mask: &[bool], lse: f32) {
        for (x, m) in row.iter_mut().zip(mask) {
            *x = if *m { 0.0 } else { exp(*x - lse) };
        }
    }
}

dispatch! {
    /// dS = P ⊙ (dP − D) · scale for one row, in place of dP.
    fn score_grad_row(ds: &mut [f32], probs: &[f32], dot: f32, scale: f32) {
        for (x, p) in ds.iter_mut().zip(probs) {
            *x = p * (*x - dot) * scale;
        }
    }
}

mod node;

pub(crate) use node::{autodiff_forward, flex_backward, flex_forward};

const GEMM: &str = "attention block shapes";

/// The output `[b, h, s, d]` and per-query log-sum-exp `[b, h, s]` (−∞ for queries that see
/// no key, whose output is 0). `k`, `v`: heads `hs` values apart.
pub(crate) fn forward(
    q: &[f32],
    (k, v, hs): (&[f32], &[f32], usize),
    job: &AttentionJob,
    n: AttnDims,
) -> (Vec<f32>, Vec<f32>) {
    let AttnDims { b, h, kv, s, t, d } = n;
    let (mask, spans, scale) = (&job.mask, &job.spans, job.scale);
    let groups = h / kv;
    let simd = kd_kernels::cpu::level();
    let mut out = vec![0f32; b * h * s * d];
    let mut lse = vec![f32::NEG_INFINITY; b * h * s];
    if out.is_empty() || t * d == 0 {
        return (out, lse);
    }
    let blocks = s.div_ceil(QUERY_BLOCK);
    // A short pass (see ROW_BY_ROW): each query's first and last visible key + 1, and whether
    // masked keys lie between them; `None` when it sees none. Shared by every head.
    let row_spans: Vec<Option<(usize, usize, bool)>> = if s <= ROW_BY_ROW {
        mask.chunks_exact(t)
            .map(|row| {
                let first = row.iter().position(|m| !m)?;
                let end = row.iter().rposition(|m| !m).unwrap_or(first) + 1;
                Some((first, end, row[first..end].contains(&true)))
            })
            .collect()
    } else {
        Vec::new()
    };
    if s <= ROW_BY_ROW {
        // A decoding pass of a few tokens (a speculative verification): each query alone over
        // its own keys, as a one-token pass computes it, so that a row's output does not
        // depend on the other rows of the pass; the queries of a K/V head (its heads' queries
        // at every position) read its keys together ([`attend_rows`]). Masked keys between a
        // query's first and last visible ones (the slots of drafts another row of a batch
        // kept) are left out: its visible keys and values, gathered, are what a one-row pass
        // without them reads.
        // Queries of one K/V head from its `gi0`-th on, into `o` and `lse`.
        let attend_head = |bg: usize, gi0: usize, o: &mut [f32], lse: &mut [f32]| {
            let bi = bg / kv;
            let (kh, vh) = (&k[bg * hs..][..t * d], &v[bg * hs..][..t * d]);
            let (mut rows, mut gathered) = (Vec::new(), Vec::new());
            // Query `gi` of the K/V head: head `gi / s` of its group at position `gi % s`.
            for (gi, (out, lse)) in (gi0..).zip(o.chunks_mut(d).zip(lse.iter_mut())) {
                let i = gi % s;
                let Some((first, end, holes)) = row_spans[bi * s + i] else {
                    continue; // sees no key: output 0, lse −∞
                };
                let query = QueryRow {
                    q: &q[(bg * groups * s + gi) * d..][..d],
                    first,
                    end,
                    out,
                    lse,
                    scores: Vec::new(),
                };
                if holes {
                    gathered.push((i, query));
                } else {
                    rows.push(query);
                }
            }
            attend_rows(simd, &mut rows, (kh, vh), d, scale);
            let (mut keys, mut values) = (Vec::new(), Vec::new());
            for (i, mut query) in gathered {
                let row = &mask[(bi * s + i) * t..][..t];
                keys.clear();
                values.clear();
                for j in (query.first..query.end).filter(|&j| !row[j]) {
                    keys.extend_from_slice(&kh[j * d..][..d]);
                    values.extend_from_slice(&vh[j * d..][..d]);
                }
                (query.first, query.end) = (0, keys.len() / d);
                attend_rows(
                    simd,
                    std::slice::from_mut(&mut query),
                    (&keys, &values),
                    d,
                    scale,
                );
            }
        };
        // A task per K/V head; or, over a long cache with fewer heads than twice the threads
        // (a decode step at batch 1: SmolLM2's three heads on two cores, a 2:1 split), the
        // queries cut into one run per thread, a head's queries within a run still sharing
        // its tiles. Which queries come together changes no query's bits.
        let per_head = groups * s;
        let threads = rayon::current_num_threads().max(1);
        let run = if t < EVEN_SPLIT_FROM_KEYS || b * kv >= 2 * threads {
            per_head
        } else {
            (b * kv * per_head).div_ceil(threads)
        };
        out.par_chunks_mut(run * d)
            .zip(lse.par_chunks_mut(run))
            .enumerate()
            .for_each(|(c, (o, lse))| {
                let mut at = 0;
                while at < lse.len() {
                    let first = c * run + at;
                    let (bg, gi0) = (first / per_head, first % per_head);
                    let n = (per_head - gi0).min(lse.len() - at);
                    attend_head(bg, gi0, &mut o[at * d..][..n * d], &mut lse[at..at + n]);
                    at += n;
                }
            });
        return (out, lse);
    }
    out.par_chunks_mut(s * d)
        .zip(lse.par_chunks_mut(s))
        .enumerate()
        .for_each(|(bh, (o, lse))| {
            let (bi, hi) = (bh / h, bh % h);
            let g = bi * kv + hi / groups;
            let qh = &q[bh * s * d..][..s * d];
            let kh = &k[g * hs..][..t * d];
            let vh = &v[g * hs..][..t * d];
            let mh = &mask[bi * s * t..][..s * t];
            let mut scores = vec![0f32; QUERY_BLOCK * KEY_BLOCK.min(t)];
            let mut state = [(f32::NEG_INFINITY, 0f32, 1f32); QUERY_BLOCK];
            for (blk, &(k0, k1)) in spans[bi * blocks..(bi + 1) * blocks].iter().enumerate() {
                // Queries i0..i0 + rb against keys k0..k1, in blocks of KEY_BLOCK from k0.
                let (i0, rb) = (blk * QUERY_BLOCK, QUERY_BLOCK.min(s - blk * QUERY_BLOCK));
                if k1 == 0 {
                    continue; // rows that see no key: output 0, lse −∞
                }
                state[..rb].fill((f32::NEG_INFINITY, 0.0, 1.0));
                for kb0 in (k0..k1).step_by(KEY_BLOCK) {
                    let kl = KEY_BLOCK.min(k1 - kb0);
                    let sc = &mut scores[..rb * kl];
                    // scores = scale · Q Kᵀ
                    matmul(
                        MatMut::row_major(sc, rb, kl).expect(GEMM),
                        MatRef::rows(&qh[i0 * d..], rb, d, d).expect(GEMM),
                        MatRef::rows(&kh[kb0 * d..], kl, d, d).expect(GEMM).t(),
                        Write::Overwrite,
                        scale,
                        Threads::One,
                    )
                    .expect(GEMM);
                    for (r, st) in state[..rb].iter_mut().enumerate() {
                        let at = (i0 + r) * t + kb0;
                        online_softmax_row(simd, &mut sc[r * kl..][..kl], &mh[at..at + kl], st);
                        if st.2 != 1.0 {
                            for x in &mut o[(i0 + r) * d..][..d] {
                                *x *= st.2;
                            }
                        }
                    }
                    // O += P V
                    matmul(
                        MatMut::rows(&mut o[i0 * d..], rb, d, d).expect(GEMM),
                        MatRef::row_major(sc, rb, kl).expect(GEMM),
                        MatRef::rows(&vh[kb0 * d..], kl, d, d).expect(GEMM),
                        Write::Accumulate,
                        1.0,
                        Threads::One,
                    )
                    .expect(GEMM);
                }
                for (r, &(m, l, _)) in state[..rb].iter().enumerate() {
                    if l > 0.0 {
                        let inv = 1.0 / l;
                        for x in &mut o[(i0 + r) * d..][..d] {
                            *x *= inv;
                        }
                        lse[i0 + r] = m + ln(l);
                    }
                }
            }
        });
    (out, lse)
}

/// `(dq, dk, dv)` from the operands, the forward's output and log-sum-exp, and the output
/// gradient; `dk`, `dv` are contiguous `[b, kv, t, d]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    q: &[f32],
    (k, v, hs): (&[f32], &[f32], usize),
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    job: &AttentionJob,
    n: AttnDims,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let AttnDims { b, h, kv, s, t, d } = n;
    let (mask, spans, scale) = (&job.mask, &job.spans, job.scale);
    let groups = h / kv;
    let simd = kd_kernels::cpu::level();
    let mut dq = vec![0f32; b * h * s * d];
    let mut dk = vec![0f32; b * kv * t * d];
    let mut dv = vec![0f32; b * kv * t * d];
    if dq.is_empty() || dk.is_empty() {
        return (dq, dk, dv);
    }
    let blocks = s.div_ceil(QUERY_BLOCK);
    // One task per (batch, KV head): the query heads of a group add into the same dK, dV.
    dq.par_chunks_mut(groups * s * d)
        .zip(dk.par_chunks_mut(t * d))
        .zip(dv.par_chunks_mut(t * d))
        .enumerate()
        .for_each(|(bg, ((dqg, dkg), dvg))| {
            let bi = bg / kv;
            let kh = &k[bg * hs..][..t * d];
            let vh = &v[bg * hs..][..t * d];
            let mh = &mask[bi * s * t..][..s * t];
            let block = QUERY_BLOCK * KEY_BLOCK.min(t);
            let (mut p, mut ds) = (vec![0f32; block], vec![0f32; block]);
            let mut dots = [0f32; QUERY_BLOCK];
            for j in 0..groups {
                let bh = bi * h + (bg % kv) * groups + j;
                let qh = &q[bh * s * d..][..s * d];
                let oh = &out[bh * s * d..][..s * d];
                let doh = &dout[bh * s * d..][..s * d];
                let lh = &lse[bh * s..][..s];
                let dqh = &mut dqg[j * s * d..][..s * d];
                for (blk, &(k0, k1)) in spans[bi * blocks..(bi + 1) * blocks].iter().enumerate() {
                    if k1 == 0 {
                        continue;
                    }
                    let i0 = blk * QUERY_BLOCK;
                    let rb = QUERY_BLOCK.min(s - i0);
                    for (r, dot) in dots[..rb].iter_mut().enumerate() {
                        let at = (i0 + r) * d;
                        *dot = math::sum_map2(&doh[at..at + d], &oh[at..at + d], |a, b| a * b);
                    }
                    for kb0 in (k0..k1).step_by(KEY_BLOCK) {
                        let kl = KEY_BLOCK.min(k1 - kb0);
                        let tile = Tile {
                            q: MatRef::rows(&qh[i0 * d..], rb, d, d).expect(GEMM),
                            dout: MatRef::rows(&doh[i0 * d..], rb, d, d).expect(GEMM),
                            k: MatRef::rows(&kh[kb0 * d..], kl, d, d).expect(GEMM),
                            v: MatRef::rows(&vh[kb0 * d..], kl, d, d).expect(GEMM),
                            mask: &mh[i0 * t + kb0..],
                            mask_stride: t,
                            lse: &lh[i0..i0 + rb],
                            dots: &dots[..rb],
                            scale,
                            dims: (rb, kl, d),
                        };
                        tile.backward(
                            simd,
                            (&mut p[..rb * kl], &mut ds[..rb * kl]),
                            &mut dqh[i0 * d..],
                            &mut dkg[kb0 * d..],
                            &mut dvg[kb0 * d..],
                        );
                    }
                }
            }
        });
    (dq, dk, dv)
}

/// One (query block × key block) tile of the backward pass: `rb` queries, `kl` keys.
struct Tile<'a> {
    q: MatRef<'a>,
    dout: MatRef<'a>,
    k: MatRef<'a>,
    v: MatRef<'a>,
    /// Query row r's mask over the tile's keys at `mask[r · mask_stride..][..kl]`.
    mask: &'a [bool],
    mask_stride: usize,
    /// Each query's log-sum-exp from the forward pass.
    lse: &'a [f32],
    /// Each query's D = rowsum(dO ⊙ O).
    dots: &'a [f32],
    scale: f32,
    /// Queries, keys and head width: `(rb, kl, d)`.
    dims: (usize, usize, usize),
}

impl Tile<'_> {
    /// Recomputes the tile's probabilities into `p` and adds its part of dV, dQ and dK
    /// (`dq`: the block's query rows, `dk`, `dv`: its key rows); `ds` is scratch.
    fn backward(
        &self,
        simd: kd_kernels::cpu::SimdLevel,
        (p, ds): (&mut [f32], &mut [f32]),
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
    ) {
        let (rb, kl, d) = self.dims;
        // P = exp(scale · Q Kᵀ − lse)
        matmul(
            MatMut::row_major(p, rb, kl).expect(GEMM),
            self.q,
            self.k.t(),
            Write::Overwrite,
            self.scale,
            Threads::One,
        )
        .expect(GEMM);
        for r in 0..rb {
            let row = &mut p[r * kl..][..kl];
            if self.lse[r] == f32::NEG_INFINITY {
                row.fill(0.0);
            } else {
                let mask = &self.mask[r * self.mask_stride..][..kl];
                probabilities_row(simd, row, mask, self.lse[r]);
            }
        }
        // dV += Pᵀ dO
        matmul(
            MatMut::rows(dv, kl, d, d).expect(GEMM),
            MatRef::row_major(p, rb, kl).expect(GEMM).t(),
            self.dout,
            Write::Accumulate,
            1.0,
            Threads::One,
        )
        .expect(GEMM);
        // dP = dO Vᵀ, then dS = P ⊙ (dP − D) · scale
        matmul(
            MatMut::row_major(ds, rb, kl).expect(GEMM),
            self.dout,
            self.v.t(),
            Write::Overwrite,
            1.0,
            Threads::One,
        )
        .expect(GEMM);
        for (r, dot) in self.dots.iter().enumerate() {
            let range = r * kl..(r + 1) * kl;
            score_grad_row(simd, &mut ds[range.clone()], &p[range], *dot, self.scale);
        }
        // dQ += dS K, dK += dSᵀ Q
        matmul(
            MatMut::rows(dq, rb, d, d).expect(GEMM),
            MatRef::row_major(ds, rb, kl).expect(GEMM),
            self.k,
            Write::Accumulate,
            1.0,
            Threads::One,
        )
        .expect(GEMM);
        matmul(
            MatMut::rows(dk, kl, d, d).expect(GEMM),
            MatRef::row_major(ds, rb, kl).expect(GEMM).t(),
            self.q,
            Write::Accumulate,
            1.0,
            Threads::One,
        )
        .expect(GEMM);
    }
}

#[cfg(test)]
mod tests {
    use kd_kernels::cpu::{SimdLevel, detected};

    /// Values spread over several magnitudes and both signs, from a fixed seed.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let unit = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                unit * [0.01f32, 1.0, 30.0][(x % 3) as usize]
            })
            .collect()
    }

    /// The SIMD levels above scalar that this CPU has.
    fn simd_levels() -> Vec<SimdLevel> {
        [SimdLevel::Avx2, SimdLevel::Avx512]
            .into_iter()
            .filter(|l| *l <= detected())
            .collect()
    }

    /// Every SIMD level this CPU has gives the scalar tree's bits, whatever the head width
    /// (multiples of sixteen and ragged ones) and however many keys.
    #[test]
    fn scores_have_the_same_bits_at_every_level() {
        let levels = simd_levels();
        for d in [16, 32, 64, 80, 128, 7, 72] {
            for n in [1, 3, 4, 5, 8, 13, 64, 67] {
                let (q, keys) = (values(d, d as u64), values(n * d, (n * 1000 + d) as u64));
                let mut want = vec![0f32; n];
                super::scores_into(SimdLevel::Scalar, &q, &keys, 0.125, &mut want);
                for &level in &levels {
                    let mut got = vec![f32::NAN; n];
                    super::scores_into(level, &q, &keys, 0.125, &mut got);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{level:?}, d {d}, {n} keys");
                }
            }
        }
        eprintln!("levels compared with the scalar tree: {levels:?}");
    }

    /// The weighted sums of values likewise: every level's bits are the scalar loop's, for
    /// widths that fill the wide group (64 outputs), the wide group and four registers (96),
    /// four registers, one, or neither, and an output that already holds a partial sum
    /// (consecutive tiles).
    #[test]
    fn weighted_sums_have_the_same_bits_at_every_level() {
        let levels = simd_levels();
        for d in [64, 128, 96, 40, 16, 24, 72, 7] {
            for n in [1, 5, 64] {
                let (p, v) = (values(n, n as u64 + 7), values(n * d, (n * 31 + d) as u64));
                let start = values(d, d as u64 + 99);
                let mut want = start.clone();
                super::weighted_into(SimdLevel::Scalar, &p, &v, &mut want);
                for &level in &levels {
                    let mut got = start.clone();
                    super::weighted_into(level, &p, &v, &mut got);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{level:?}, d {d}, {n} keys");
                }
            }
        }
    }
}

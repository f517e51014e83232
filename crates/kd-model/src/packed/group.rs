//! A packed row as every kernel reads it: groups of 32 values, each with its quantised values
//! and the scales that turn them into weights, read straight from the blocks as the file
//! stores them (no f32 copy of any scale is kept).
//!
//! Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 blocks are one group each. A K-quant super-block (Q4_K,
//! Q5_K, Q6_K: 256 values) is eight: group `j` of a Q4_K/Q5_K super-block is its sub-block `j`
//! (scale `d · sc_j`, minimum `dmin · m_j`); group `j` of a Q6_K super-block holds two
//! sub-blocks of 16 with their own scales `d · sc`. A group's weights are `q · scale (+ offset)`, computed with
//! exactly the operations of ggml's reference dequantisation (`kd_gguf::dequantize`), so every
//! kernel meets the f32 copy's values bit for bit:
//!
//! | type | q | scale (values 0–15, 16–31) | offset |
//! |---|---|---|---|
//! | Q8_0 | signed byte | `d` | — |
//! | Q4_0 | nibble − 8 | `d` | — |
//! | Q4_1 | nibble | `d` | `+ m` |
//! | Q5_0 | nibble + 16 · high bit − 16 | `d` | — |
//! | Q5_1 | nibble + 16 · high bit | `d` | `+ m` |
//! | Q4_K | nibble of sub-block `j` | `d · sc_j` | `− dmin · m_j` |
//! | Q5_K | nibble + 16 · high bit `j` | `d · sc_j` | `− dmin · m_j` |
//! | Q6_K | 6 bits − 32 | `d · sc_2k`, `d · sc_2k+1` | — |
//!
//! (`a − b` and `a + (−b)` round alike, so the offset is always added.)

use half::f16;
use kd_gguf::{GgmlType, scale_min_k4};

/// The types whose blocks the kernels read ([`TYPES`]).
pub(crate) fn packable(ty: GgmlType) -> bool {
    TYPES.contains(&ty)
}

/// The packed types, by the index a kernel's type parameter takes (see [`with_type!`]).
pub(crate) const TYPES: [GgmlType; 8] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// `$body` with `$t` a `const u8` naming `$ty`'s index in [`TYPES`], so that a kernel
/// monomorphised on it reads its type's layout, scales and values with no branch per group.
///
/// # Panics
/// When `$ty` is not a packed type.
macro_rules! with_type {
    ($ty:expr, $t:ident => $body:expr) => {
        $crate::packed::group::with_type!(@arms $ty, $t, $body;
            0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0, 4 Q5_1, 5 Q4K, 6 Q5K, 7 Q6K)
    };
    (@arms $ty:expr, $t:ident, $body:expr; $($i:literal $v:ident),*) => {
        match $ty {
            $(kd_gguf::GgmlType::$v => {
                const $t: u8 = $i;
                debug_assert_eq!($crate::packed::group::TYPES[$i], kd_gguf::GgmlType::$v);
                $body
            })*
            other => unreachable!("not a packed type: {other:?}"),
        }
    };
}
pub(crate) use with_type;

/// A packed type's layout: bytes per block, and groups of 32 per block as a power of two.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layout {
    /// Bytes per block (or super-block).
    pub size: usize,
    /// log2 of the groups per block: 0 for the 32-value blocks, 3 for super-blocks.
    pub shift: u32,
}

impl Layout {
    /// The layout of a [`packable`] type.
    ///
    /// # Panics
    /// For any other type.
    #[inline(always)]
    pub fn of(ty: GgmlType) -> Self {
        // A match the compiler folds where `ty` is a kernel's constant (so that the block
        // size, and every bound checked against it, is one too).
        let (size, shift) = match ty {
            GgmlType::Q8_0 => (34, 0),
            GgmlType::Q4_0 => (18, 0),
            GgmlType::Q4_1 => (20, 0),
            GgmlType::Q5_0 => (22, 0),
            GgmlType::Q5_1 => (24, 0),
            GgmlType::Q4K => (144, 3),
            GgmlType::Q5K => (176, 3),
            GgmlType::Q6K => (210, 3),
            _ => panic!("not a packed type: {ty:?}"),
        };
        debug_assert_eq!(ty.block(), Some((32 << shift, size)));
        Self { size, shift }
    }

    /// Bytes of a matrix row of `cols` values: its whole blocks (0 for fewer values than a
    /// block holds).
    #[inline(always)]
    pub fn row_bytes(self, cols: usize) -> usize {
        ((cols / 32) >> self.shift) * self.size
    }
}

/// Whether a type's q values are unsigned (`0..=31`; an offset carries the weights' sign).
#[inline(always)]
pub(crate) fn unsigned(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K
    )
}

/// Whether a type's groups have an offset.
#[inline(always)]
pub(crate) fn has_offset(ty: GgmlType) -> bool {
    unsigned(ty)
}

/// A group's scales: values 0–15 are `q · d[0]`, values 16–31 `q · d[1]` (equal but for
/// Q6_K), then `+ offset` where the type has one (zero otherwise, and not added).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Scales {
    pub d: [f32; 2],
    pub offset: f32,
}

/// The scales of every group of `block` (a whole block or super-block of type `ty`; a
/// 32-value block's one group is the first), with `halves` converting two f16s (the
/// little-endian bytes of a `u32`) to f32 (a kernel passes its CPU's instruction). A block's
/// f16 fields are read as one 32-bit load: the scale with the bytes after it (Q4_1's, Q5_1's
/// and the K-quants' minimum; the other types' first values or high bits, unused), or Q6_K's
/// scale with the two bytes before it. The kernels take a block's scales once, before its groups.
#[inline(always)]
pub(crate) fn block_scales(
    ty: GgmlType,
    block: &[u8],
    halves: impl Fn(u32) -> [f32; 2],
) -> [Scales; 8] {
    let pair = |at: usize| f16_pair(block, at, &halves);
    let one = |d: f32, offset: f32| [Scales { d: [d; 2], offset }; 8];
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 => {
            let [d, m] = pair(0);
            one(d, m)
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let [d, dmin] = pair(0);
            let scales = &block[4..16];
            std::array::from_fn(|j| {
                let (sc, m) = scale_min_k4(j, scales);
                Scales {
                    d: [d * sc as f32; 2],
                    offset: -(dmin * m as f32),
                }
            })
        }
        GgmlType::Q6K => {
            let [_, d] = pair(206);
            let sc = |i: usize| (block[192 + i] as i8) as f32;
            std::array::from_fn(|j| {
                let i = (j / 4) * 8 + 2 * (j % 4);
                Scales {
                    d: [d * sc(i), d * sc(i + 1)],
                    offset: 0.0,
                }
            })
        }
        // Q8_0, Q4_0, Q5_0.
        _ => one(pair(0)[0], 0.0),
    }
}

/// The two f16s at `block[at..at + 4]` as f32, read as one 32-bit load (see
/// [`block_scales`]); `halves` converts them.
#[inline(always)]
pub(crate) fn f16_pair(block: &[u8], at: usize, halves: impl Fn(u32) -> [f32; 2]) -> [f32; 2] {
    let bytes: [u8; 4] = block[at..at + 4].try_into().expect("4 bytes");
    halves(u32::from_le_bytes(bytes))
}

/// Two f16s (a `u32`'s little-endian halves) as f32, portably.
pub(crate) fn halves_to_f32(bits: u32) -> [f32; 2] {
    [bits as u16, (bits >> 16) as u16].map(|h| f16::from_bits(h).to_f32())
}

/// The 32 q values of group `sub` of `block` (see the module's table), in value order.
pub(crate) fn values(ty: GgmlType, block: &[u8], sub: usize) -> [i8; 32] {
    let mut q = [0i8; 32];
    let nib = |b: u8, high: bool| if high { b >> 4 } else { b & 0x0F };
    for (l, o) in q.iter_mut().enumerate() {
        *o = match ty {
            GgmlType::Q8_0 => block[2 + l] as i8,
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let off = if ty == GgmlType::Q4_0 { 2 } else { 4 };
                let v = nib(block[off + l % 16], l >= 16) as i8;
                if ty == GgmlType::Q4_0 { v - 8 } else { v }
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let (qh, qs) = if ty == GgmlType::Q5_0 { (2, 6) } else { (4, 8) };
                let high = (block[qh + l / 8] >> (l % 8)) & 1;
                let v = (nib(block[qs + l % 16], l >= 16) | (high << 4)) as i8;
                if ty == GgmlType::Q5_0 { v - 16 } else { v }
            }
            GgmlType::Q4K => nib(block[16 + 32 * (sub / 2) + l], sub % 2 == 1) as i8,
            GgmlType::Q5K => {
                let low = nib(block[48 + 32 * (sub / 2) + l], sub % 2 == 1);
                let high = (block[16 + l] >> sub) & 1;
                (low | (high << 4)) as i8
            }
            GgmlType::Q6K => {
                let (half, k) = (sub / 4, sub % 4);
                let low = nib(block[half * 64 + 32 * (k & 1) + l], k >= 2);
                let high = (block[128 + half * 32 + l] >> (2 * k)) & 3;
                (low | (high << 4)) as i8 - 32
            }
            _ => unreachable!("not a packed type: {ty:?}"),
        };
    }
    q
}

/// [`values`] with SSE2 (the x86-64 baseline), as two registers: values 0–15 and 16–31.
///
/// # Safety
/// `block` points to a whole block (or super-block) of type `ty`, a [`packable`] type, and
/// `sub` is a group of it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn values_sse2(
    ty: GgmlType,
    block: *const u8,
    sub: usize,
) -> [std::arch::x86_64::__m128i; 2] {
    use std::arch::x86_64::*;
    // SAFETY: every load reads 16 bytes inside the block (the caller's contract; offsets as in
    // `values`).
    unsafe {
        let load = |at: usize| _mm_loadu_si128(block.add(at) as *const __m128i);
        let mask = _mm_set1_epi8(0x0F);
        let low = |v: __m128i| _mm_and_si128(v, mask);
        let high_nibbles = |v: __m128i| _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        let nib = |v: __m128i, hi: bool| if hi { high_nibbles(v) } else { low(v) };
        // Bits `shift..shift + width` of each byte, moved to bits 4..
        let bits = |v: __m128i, shift: usize, width: i8| {
            let v = _mm_srl_epi16(v, _mm_cvtsi32_si128(shift as i32));
            _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi8((1 << width) - 1)), 4)
        };
        match ty {
            GgmlType::Q8_0 => [load(2), load(18)],
            GgmlType::Q4_0 => {
                let qs = load(2);
                let eight = _mm_set1_epi8(8);
                [
                    _mm_sub_epi8(low(qs), eight),
                    _mm_sub_epi8(high_nibbles(qs), eight),
                ]
            }
            GgmlType::Q4_1 => {
                let qs = load(4);
                [low(qs), high_nibbles(qs)]
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let (qh, qs) = if ty == GgmlType::Q5_0 { (2, 6) } else { (4, 8) };
                let high = high_bits_sse2(u32::from_le_bytes([
                    *block.add(qh),
                    *block.add(qh + 1),
                    *block.add(qh + 2),
                    *block.add(qh + 3),
                ]));
                let qs = load(qs);
                let v = [
                    _mm_or_si128(low(qs), high[0]),
                    _mm_or_si128(high_nibbles(qs), high[1]),
                ];
                if ty == GgmlType::Q5_0 {
                    let sixteen = _mm_set1_epi8(16);
                    v.map(|v| _mm_sub_epi8(v, sixteen))
                } else {
                    v
                }
            }
            GgmlType::Q4K => {
                let at = 16 + 32 * (sub / 2);
                [0, 16].map(|o| nib(load(at + o), sub % 2 == 1))
            }
            GgmlType::Q5K => {
                let at = 48 + 32 * (sub / 2);
                [0, 16].map(|o| {
                    _mm_or_si128(nib(load(at + o), sub % 2 == 1), bits(load(16 + o), sub, 1))
                })
            }
            GgmlType::Q6K => {
                let (half, k) = (sub / 4, sub % 4);
                let (at, ah) = (half * 64 + 32 * (k & 1), 128 + half * 32);
                [0, 16].map(|o| {
                    let q = _mm_or_si128(nib(load(at + o), k >= 2), bits(load(ah + o), 2 * k, 2));
                    _mm_sub_epi8(q, _mm_set1_epi8(32))
                })
            }
            _ => unreachable!("not a packed type: {ty:?}"),
        }
    }
}

/// Bit `j` of `qh` as 16 in byte `j` (0 where clear), for bytes 0–15 and 16–31 (ggml's
/// `bytes_from_bits_32`, with SSE2 alone).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn high_bits_sse2(qh: u32) -> [std::arch::x86_64::__m128i; 2] {
    use std::arch::x86_64::*;
    // SAFETY: SSE2 is the x86-64 baseline.
    unsafe {
        // Each byte of qh repeated: [b0 × 8, b1 × 8] and [b2 × 8, b3 × 8].
        let v = _mm_cvtsi32_si128(qh as i32);
        let v = _mm_unpacklo_epi8(v, v);
        let v = _mm_unpacklo_epi16(v, v);
        let halves = [_mm_unpacklo_epi32(v, v), _mm_unpackhi_epi32(v, v)];
        let bit = _mm_set_epi8(-128, 64, 32, 16, 8, 4, 2, 1, -128, 64, 32, 16, 8, 4, 2, 1);
        halves.map(|h| {
            let set = _mm_cmpeq_epi8(_mm_and_si128(h, bit), bit);
            _mm_and_si128(set, _mm_set1_epi8(16))
        })
    }
}

/// Two f16s (a `u32`'s little-endian halves) as f32 with F16C, in inline assembly: `vmovd`
/// writes the whole register. With intrinsics the compiler narrows the move to a 16-bit
/// insert where only the first half is used (Q8_0, Q4_0, Q5_0), and an insert merges into
/// whatever register it picks — at one input row, the accumulator, so each block waited on
/// the previous block's FMA (measured: 8-bit Q8_0 decoding at half speed).
///
/// # Safety
/// The CPU has AVX and F16C.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn halves_f16c(bits: u32) -> [f32; 2] {
    use std::arch::x86_64::*;
    let v: __m128;
    // SAFETY: the caller's CPU has AVX and F16C; the asm reads a register and writes one.
    unsafe {
        std::arch::asm!(
            "vmovd {v}, {bits:e}",
            "vcvtph2ps {v}, {v}",
            bits = in(reg) bits,
            v = out(xmm_reg) v,
            options(pure, nomem, nostack, preserves_flags),
        );
        [_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v))]
    }
}

/// Bytes ahead of the block at hand that the SIMD kernels ask the cache for
/// ([`prefetch_ahead`]).
#[cfg(target_arch = "x86_64")]
pub(crate) const PREFETCH_AHEAD: usize = 2048;

/// Asks the CPU to bring the cache lines [`PREFETCH_AHEAD`] bytes past `block` (one per 64
/// bytes of the block) into its L1 cache, so that a kernel walking a matrix's blocks in order
/// finds the blocks it will read next already loaded. Decoding reads every weight block once
/// per pass, and at one or two input rows the kernels otherwise wait on those loads (measured
/// on a 2-core Xeon: SmolLM2 Q4_1 at batch 1, 52 → 98 tokens/s with f32 activations and 76 →
/// 134 with 8-bit ones; 1024 bytes ahead gave 96 and 130, 4096 bytes 100 and 139).
/// A prefetch is only a hint: past the end of the matrix it reads nothing and cannot fault.
/// (The short pass's attention walks its cached keys and values the same way.)
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_ahead<T>(block: &[T]) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    let start = block.as_ptr().cast::<u8>();
    for at in (0..std::mem::size_of_val(block)).step_by(64) {
        let p = start.wrapping_add(PREFETCH_AHEAD + at);
        // SAFETY: a prefetch does not access memory as far as the program can observe (no
        // fault, no value read), whatever the address; SSE is part of x86-64's baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>()) };
    }
}

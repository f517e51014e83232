//! Intel AMX tiles (AMX-INT8: Sapphire Rapids and later Xeons) for the 8-bit-activation
//! products of Q4_1 and Q8_0 weights: one tile instruction multiplies up to 16 input rows by
//! a block of 32 weights of 16 outputs, so a pass over 2 to 16 tokens (a speculative
//! verification) costs about what one token costs, where the AVX-512 kernels pay for every
//! row again.
//!
//! The weights are repacked once, at [`AmxMatrix::new`], into the tiles' layout: per 16
//! outputs and block of 32 inputs, the 32 weights of each output as 8 tile rows of four
//! bytes (Q4_1's 4-bit values two to a byte, unpacked into a scratch tile before each load;
//! Q8_0's bytes as they are), then the 16 outputs' f16 scales (and Q4_1's minimums). The
//! activations are [`Q8Rows`] as for the other 8-bit kernels.
//!
//! The arithmetic is its own, not ggml's: each block's 32 products are summed exactly in one
//! i32 (ggml sums eight lanes of four apart, in f32), then, for input row `r`, output `j`
//! and block `b` in order, `acc = fma(Σ q_x·q_w, d_w·d_x, acc)` and, for Q4_1, `acc =
//! fma(m_w, s_x, acc)`. The integer part is exact and the float part the same sequence of
//! operations for every row, so a row's result does not depend on the other rows of the
//! batch (greedy speculative decoding keeps its exact outputs), and the scalar
//! [`reference`](AmxMatrix::reference) gives the same bits; the difference from the
//! AVX-512 kernels is float rounding.
//!
//! Linux hands a process the tiles' state only on request (`arch_prctl` with
//! `ARCH_REQ_XCOMP_PERM`): [`available`] asks once. The tile instructions are written as
//! inline assembly (Rust's AMX intrinsics are not stable).

use std::ops::Range;
use std::sync::OnceLock;

#[cfg(test)]
use half::f16;
use kd_gguf::GgmlType;

use crate::q8::Q8Rows;

/// Outputs per tile: a tile row holds 16 i32 sums.
pub(crate) const OUTPUTS: usize = 16;

/// Input rows per tile.
const INPUT_ROWS: usize = 16;

/// How far ahead of the chunk at hand the kernel asks for the weights' stream.
#[cfg(target_arch = "x86_64")]
const PREFETCH: usize = 2048;

/// Whether this process can use AMX-INT8 tiles: the CPU has them, the SIMD level in use is
/// AVX-512 (`KD_SIMD` caps it; the kernel scales with AVX-512 instructions), and Linux
/// granted the tile state. Asked once.
pub(crate) fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            use kd_kernels::cpu::{SimdLevel, level};
            if level() < SimdLevel::Avx512 || !std::arch::is_x86_feature_detected!("f16c") {
                return false;
            }
            // Leaf 7: EDX bit 24 is AMX-TILE, bit 25 AMX-INT8.
            let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
            if (leaf7.edx >> 24) & 0b11 != 0b11 {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: the request takes two integers and touches no memory of ours.
            unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                ) == 0
            }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

/// A `[rows, cols]` matrix of Q4_1 or Q8_0 blocks in the tiles' layout (see the module).
pub(crate) struct AmxMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    /// Per 16 outputs, per block of 32 inputs: the tile's bytes, then 16 f16 scales (and,
    /// for Q4_1, 16 f16 minimums).
    data: Vec<u8>,
}

impl std::fmt::Debug for AmxMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "AmxMatrix({} [{}, {}])",
            self.ty.name(),
            self.rows,
            self.cols
        )
    }
}

/// Bytes of one block's tile: 8 rows of 64 (Q4_1's values two to a byte: half).
fn tile_bytes(ty: GgmlType) -> usize {
    if ty == GgmlType::Q4_1 { 256 } else { 512 }
}

/// Bytes per 16 outputs and block: the tile and the f16 scales (and minimums).
fn chunk_bytes(ty: GgmlType) -> usize {
    tile_bytes(ty) + if ty == GgmlType::Q4_1 { 64 } else { 32 }
}

impl AmxMatrix {
    /// The tiles of `[rows, cols]` GGUF blocks (`bytes`, row by row); `None` for another type
    /// than Q4_1 or Q8_0, or `rows` not a multiple of 16.
    pub(crate) fn new(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        if !matches!(ty, GgmlType::Q4_1 | GgmlType::Q8_0)
            || !rows.is_multiple_of(OUTPUTS)
            || !cols.is_multiple_of(32)
        {
            return None;
        }
        let (_, size) = ty.block()?;
        let blocks = cols / 32;
        if bytes.len() != rows * blocks * size {
            return None;
        }
        let (tile, chunk) = (tile_bytes(ty), chunk_bytes(ty));
        let mut data = vec![0u8; rows / OUTPUTS * blocks * chunk];
        let mut values = [0u8; 512];
        for (c, out) in data.chunks_exact_mut(chunk).enumerate() {
            let (g, b) = (c / blocks, c % blocks);
            for n in 0..OUTPUTS {
                let row = g * OUTPUTS + n;
                let block = &bytes[(row * blocks + b) * size..][..size];
                for i in 0..32 {
                    // Tile row i / 4 holds, for output n, bytes 4n..4n + 4: inputs i..i + 4.
                    values[(i / 4) * 64 + n * 4 + i % 4] = match ty {
                        GgmlType::Q4_1 if i < 16 => block[4 + i] & 0x0f,
                        GgmlType::Q4_1 => block[4 + i - 16] >> 4,
                        _ => block[2 + i],
                    };
                }
                out[tile + 2 * n..][..2].copy_from_slice(&block[..2]);
                if ty == GgmlType::Q4_1 {
                    out[tile + 32 + 2 * n..][..2].copy_from_slice(&block[2..4]);
                }
            }
            if ty == GgmlType::Q4_1 {
                for i in 0..256 {
                    out[i] = values[i] | (values[i + 256] << 4);
                }
            } else {
                out[..512].copy_from_slice(&values);
            }
        }
        Some(Self {
            ty,
            rows,
            cols,
            data,
        })
    }

    /// Block `b` of outputs `16g..16g + 16`: its weights (as they meet the inputs: 0 to 15
    /// for Q4_1, signed for Q8_0), scales and minimums.
    #[cfg(test)]
    fn block(&self, g: usize, b: usize) -> ([[i32; 32]; OUTPUTS], [f32; OUTPUTS], [f32; OUTPUTS]) {
        let (tile, chunk) = (tile_bytes(self.ty), chunk_bytes(self.ty));
        let c = &self.data[(g * self.cols / 32 + b) * chunk..][..chunk];
        let (mut w, mut d, mut m) = ([[0i32; 32]; OUTPUTS], [0f32; OUTPUTS], [0f32; OUTPUTS]);
        let half = |at: usize| f16::from_le_bytes([c[at], c[at + 1]]).to_f32();
        for n in 0..OUTPUTS {
            for (i, v) in w[n].iter_mut().enumerate() {
                let at = (i / 4) * 64 + n * 4 + i % 4;
                *v = if self.ty == GgmlType::Q4_1 {
                    i32::from(if at < 256 {
                        c[at] & 0x0f
                    } else {
                        c[at - 256] >> 4
                    })
                } else {
                    i32::from(c[at] as i8)
                };
            }
            d[n] = half(tile + 2 * n);
            if self.ty == GgmlType::Q4_1 {
                m[n] = half(tile + 32 + 2 * n);
            }
        }
        (w, d, m)
    }

    /// The kernel's arithmetic in plain Rust (the same bits): outputs `range` of every row of
    /// `x` into `acc [x.n, range.len()]`.
    #[cfg(test)]
    pub(crate) fn reference(&self, x: &Q8Rows, range: Range<usize>, acc: &mut [f32]) {
        let (nb, blocks) = (range.len(), self.cols / 32);
        for j in range.clone() {
            let (g, n) = (j / OUTPUTS, j % OUTPUTS);
            for r in 0..x.n {
                let mut a = 0f32;
                for b in 0..blocks {
                    let (w, d, m) = self.block(g, b);
                    let q = &x.q[r * self.cols + b * 32..][..32];
                    let p: i32 = w[n].iter().zip(q).map(|(w, q)| w * i32::from(*q)).sum();
                    a = (p as f32).mul_add(d[n] * x.d_at(r, b), a);
                    if self.ty == GgmlType::Q4_1 {
                        a = m[n].mul_add(x.s_at(r, b), a);
                    }
                }
                acc[r * nb + j - range.start] = a;
            }
        }
    }

    /// Outputs `range` (whole tiles of 16) of every row of `x` into `acc [x.n,
    /// range.len()]`, on the tiles. Only where [`available`].
    pub(crate) fn rows(&self, x: &Q8Rows, range: Range<usize>, acc: &mut [f32]) {
        assert!(
            available()
                && range.start.is_multiple_of(OUTPUTS)
                && range.end.is_multiple_of(OUTPUTS)
                && range.start <= range.end
                && range.end <= self.rows
                && x.cols == self.cols
                && x.n <= x.padded
                && x.q.len() == x.n * x.cols
                && x.d.len() == self.cols / 32 * x.padded
                && x.s.len() == x.d.len()
                && acc.len() == x.n * range.len(),
            "AMX product: outputs {range:?} of {self:?} for {} rows of {}",
            x.n,
            x.cols
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AMX-INT8, AVX-512 and F16C and Linux granted the tile state
        // (`available`); the bounds the kernel reads and writes within are asserted above.
        unsafe {
            rows_amx(self, x, range, acc)
        }
    }
}

/// 64-byte aligned storage.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct Aligned<T>(T);

/// Tiles 0–3 hold sums (`m` rows of 16 i32), 4–5 inputs (`m` rows of 32 bytes), 6–7 weights
/// (8 rows of 64 bytes).
#[cfg(target_arch = "x86_64")]
unsafe fn configure(m: usize) {
    let mut c = Aligned([0u8; 64]);
    c.0[0] = 1; // palette 1
    let mut set = |t: usize, rows: usize, bytes: u16| {
        c.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&bytes.to_le_bytes());
        c.0[48 + t] = rows as u8;
    };
    for t in 0..4 {
        set(t, m, 64);
    }
    for t in 4..6 {
        set(t, m, 32);
    }
    for t in 6..8 {
        set(t, 8, 64);
    }
    // SAFETY: (caller) the tile state is granted; `c` is a valid 64-byte configuration.
    unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) c.0.as_ptr(), options(nostack, readonly)) };
}

/// Four blocks' products: inputs at `a` (row stride `sa`, blocks 32 bytes apart), weight
/// tiles at `w`, sums to `c` (four tiles of 16 × 16 i32, 1 KiB apart). `$op` is `tdpbsud`
/// (unsigned weights) or `tdpbssd` (signed).
#[cfg(target_arch = "x86_64")]
macro_rules! four_blocks {
    ($op:literal, $a:expr, $sa:expr, $w:expr, $c:expr) => {
        std::arch::asm!(
            "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
            "tileloadd tmm4, [{a} + {sa}*1]",
            "tileloadd tmm6, [{w0} + {s}*1]",
            "tileloadd tmm5, [{a} + {sa}*1 + 32]",
            "tileloadd tmm7, [{w1} + {s}*1]",
            concat!($op, " tmm0, tmm4, tmm6"),
            concat!($op, " tmm1, tmm5, tmm7"),
            "tileloadd tmm4, [{a} + {sa}*1 + 64]",
            "tileloadd tmm6, [{w2} + {s}*1]",
            "tileloadd tmm5, [{a} + {sa}*1 + 96]",
            "tileloadd tmm7, [{w3} + {s}*1]",
            concat!($op, " tmm2, tmm4, tmm6"),
            concat!($op, " tmm3, tmm5, tmm7"),
            "tilestored [{c} + {s}*1], tmm0",
            "tilestored [{c} + {s}*1 + 1024], tmm1",
            "tilestored [{c} + {s}*1 + 2048], tmm2",
            "tilestored [{c} + {s}*1 + 3072], tmm3",
            a = in(reg) $a, sa = in(reg) $sa,
            w0 = in(reg) $w[0], w1 = in(reg) $w[1], w2 = in(reg) $w[2], w3 = in(reg) $w[3],
            c = in(reg) $c, s = in(reg) 64usize,
            options(nostack),
        )
    };
}

/// One block's product (as [`four_blocks`], into the first sum tile).
#[cfg(target_arch = "x86_64")]
macro_rules! one_block {
    ($op:literal, $a:expr, $sa:expr, $w:expr, $c:expr) => {
        std::arch::asm!(
            "tilezero tmm0",
            "tileloadd tmm4, [{a} + {sa}*1]",
            "tileloadd tmm6, [{w} + {s}*1]",
            concat!($op, " tmm0, tmm4, tmm6"),
            "tilestored [{c} + {s}*1], tmm0",
            a = in(reg) $a, sa = in(reg) $sa, w = in(reg) $w,
            c = in(reg) $c, s = in(reg) 64usize,
            options(nostack),
        )
    };
}

/// [`AmxMatrix::rows`] on the tiles.
///
/// # Safety
/// The CPU has AMX-INT8, AVX-512 F and F16C, Linux granted the tile state, and the bounds
/// `rows` asserts hold.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn rows_amx(w: &AmxMatrix, x: &Q8Rows, range: Range<usize>, acc: &mut [f32]) {
    for r0 in (0..x.n).step_by(INPUT_ROWS) {
        let m = (x.n - r0).min(INPUT_ROWS);
        // SAFETY: (caller) the tile state is granted.
        unsafe { configure(m) };
        // SAFETY: (caller) as for this function; rows r0..r0 + m of x, m tiles' rows.
        unsafe {
            match m {
                1 => tile_rows::<1>(w, x, &range, acc, r0),
                2 => tile_rows::<2>(w, x, &range, acc, r0),
                3 => tile_rows::<3>(w, x, &range, acc, r0),
                4 => tile_rows::<4>(w, x, &range, acc, r0),
                5 => tile_rows::<5>(w, x, &range, acc, r0),
                6 => tile_rows::<6>(w, x, &range, acc, r0),
                7 => tile_rows::<7>(w, x, &range, acc, r0),
                8 => tile_rows::<8>(w, x, &range, acc, r0),
                9 => tile_rows::<9>(w, x, &range, acc, r0),
                10 => tile_rows::<10>(w, x, &range, acc, r0),
                11 => tile_rows::<11>(w, x, &range, acc, r0),
                12 => tile_rows::<12>(w, x, &range, acc, r0),
                13 => tile_rows::<13>(w, x, &range, acc, r0),
                14 => tile_rows::<14>(w, x, &range, acc, r0),
                15 => tile_rows::<15>(w, x, &range, acc, r0),
                _ => tile_rows::<16>(w, x, &range, acc, r0),
            }
        }
    }
    // SAFETY: (caller) the tile state is granted; releasing it is always valid.
    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
}

/// Input rows `r0..r0 + M` (the tiles configured for `M` rows) against outputs `range`,
/// the accumulators of the `M` rows in registers.
///
/// # Safety
/// As [`rows_amx`], with the tiles configured for `M` rows and `r0 + M <= x.n`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn tile_rows<const M: usize>(
    w: &AmxMatrix,
    x: &Q8Rows,
    range: &Range<usize>,
    acc: &mut [f32],
    r0: usize,
) {
    use std::arch::x86_64::*;
    let (nb, cols, blocks) = (range.len(), w.cols, w.cols / 32);
    let (tile, chunk, q4) = (tile_bytes(w.ty), chunk_bytes(w.ty), w.ty == GgmlType::Q4_1);
    let mut sums = Aligned([0i32; 4 * 256]);
    let mut scratch = Aligned([0u8; 4 * 512]);
    let (sp, cp) = (scratch.0.as_mut_ptr(), sums.0.as_mut_ptr());
    let low = _mm512_set1_epi8(0x0f);
    for g in range.start / OUTPUTS..range.end / OUTPUTS {
        let mut out = [_mm512_setzero_ps(); M];
        let mut b = 0;
        while b < blocks {
            let t = (blocks - b).min(4);
            let mut tiles = [std::ptr::null::<u8>(); 4];
            for (i, tp) in tiles.iter_mut().enumerate().take(t) {
                let at = (g * blocks + b + i) * chunk;
                // The stream of chunks, PREFETCH bytes ahead (a hint: any address).
                _mm_prefetch::<_MM_HINT_T0>(
                    w.data.as_ptr().wrapping_add(at + PREFETCH) as *const i8
                );
                // SAFETY: chunk g · blocks + b + i < rows / 16 · blocks, within `data`.
                let c = unsafe { w.data.as_ptr().add(at) };
                *tp = if q4 {
                    // 4-bit values two to a byte: low nibbles are tile rows 0–3, high
                    // ones rows 4–7.
                    // SAFETY: 256 bytes of the chunk; 512 of the scratch tile i.
                    unsafe {
                        let s = sp.add(i * 512);
                        for q in 0..4 {
                            let v = _mm512_loadu_si512(c.add(q * 64) as *const _);
                            _mm512_store_si512(s.add(q * 64) as *mut _, _mm512_and_si512(v, low));
                            let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                            _mm512_store_si512(s.add(256 + q * 64) as *mut _, hi);
                        }
                        s
                    }
                } else {
                    c
                };
            }
            // SAFETY: rows r0..r0 + m of the inputs' blocks b..b + t are within `x.q`
            // (m rows of 32 bytes at stride cols); the weight tiles are 512 bytes each.
            unsafe {
                let a = x.q.as_ptr().add(r0 * cols + b * 32);
                match (t, q4) {
                    (4, true) => four_blocks!("tdpbsud", a, cols, tiles, cp),
                    (4, false) => four_blocks!("tdpbssd", a, cols, tiles, cp),
                    _ => {
                        for (i, tp) in tiles.iter().enumerate().take(t) {
                            let (a, c) = (a.add(i * 32), cp.add(i * 256));
                            if q4 {
                                one_block!("tdpbsud", a, cols, *tp, c);
                            } else {
                                one_block!("tdpbssd", a, cols, *tp, c);
                            }
                        }
                    }
                }
            }
            for i in 0..t {
                let blk = b + i;
                // SAFETY: the chunk's scales (and, for Q4_1, minimums) follow its tile; the sums are
                // m rows of 16 of tile i; d and s hold `blocks · padded` values.
                unsafe {
                    let c = w.data.as_ptr().add((g * blocks + blk) * chunk + tile);
                    let dw = _mm512_cvtph_ps(_mm256_loadu_si256(c as *const _));
                    // Only Q4_1's chunks hold minimums (a Q8_0 chunk ends with its scales).
                    let mw = if q4 {
                        _mm512_cvtph_ps(_mm256_loadu_si256(c.add(32) as *const _))
                    } else {
                        _mm512_setzero_ps()
                    };
                    let (dx, sx) = (
                        x.d.as_ptr().add(blk * x.padded + r0),
                        x.s.as_ptr().add(blk * x.padded + r0),
                    );
                    for (r, o) in out.iter_mut().enumerate() {
                        let p = _mm512_cvtepi32_ps(_mm512_load_si512(
                            cp.add(i * 256 + r * 16) as *const _
                        ));
                        let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*dx.add(r)));
                        *o = _mm512_fmadd_ps(p, scale, *o);
                        if q4 {
                            *o = _mm512_fmadd_ps(mw, _mm512_set1_ps(*sx.add(r)), *o);
                        }
                    }
                }
            }
            b += t;
        }
        let j = g * OUTPUTS - range.start;
        for (r, o) in out.iter().enumerate() {
            // SAFETY: row r0 + r < n, outputs j..j + 16 <= nb: within `acc [n, nb]`.
            unsafe { _mm512_storeu_ps(acc.as_mut_ptr().add((r0 + r) * nb + j), *o) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packed::tests::lcg;

    /// Random blocks of `ty` with finite scales (and minimums).
    fn blocks(ty: GgmlType, rows: usize, cols: usize, next: &mut impl FnMut() -> u32) -> Vec<u8> {
        let (block, size) = ty.block().unwrap();
        let mut bytes: Vec<u8> = (0..rows * cols / block * size)
            .map(|_| next() as u8)
            .collect();
        for blk in bytes.chunks_exact_mut(size) {
            let d = f16::from_f32(((next() % 1000) as f32 / 1000.0 - 0.5) * 0.1);
            blk[..2].copy_from_slice(&d.to_le_bytes());
            if ty == GgmlType::Q4_1 {
                let m = f16::from_f32(((next() % 1000) as f32 / 1000.0 - 0.5) * 0.2);
                blk[2..4].copy_from_slice(&m.to_le_bytes());
            }
        }
        bytes
    }

    /// The repacked tiles hold the weights the GGUF blocks dequantise to, and the reference
    /// arithmetic equals the exact sum it stands for (in f64) within f32 rounding, on every
    /// CPU.
    #[test]
    fn tiles_hold_the_blocks_and_the_reference_sums_them() {
        let mut next = lcg(3);
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
            let (rows, cols, n) = (32, 288, 3);
            let bytes = blocks(ty, rows, cols, &mut next);
            let a = AmxMatrix::new(ty, rows, cols, &bytes).unwrap();
            let mut w = vec![0f32; rows * cols];
            kd_gguf::dequantize(ty, &bytes, &mut w).unwrap();
            for j in 0..rows {
                for b in 0..cols / 32 {
                    let (q, d, m) = a.block(j / 16, b);
                    for i in 0..32 {
                        let v = d[j % 16] * q[j % 16][i] as f32 + m[j % 16];
                        assert_eq!(v, w[j * cols + b * 32 + i], "{ty:?} {j} {b} {i}");
                    }
                }
            }
            let x: Vec<f32> = (0..n * cols)
                .map(|_| (next() % 2000) as f32 / 1000.0 - 1.0)
                .collect();
            let xq = Q8Rows::quantize(&x, n, cols);
            let mut got = vec![0f32; n * rows];
            a.reference(&xq, 0..rows, &mut got);
            for r in 0..n {
                for j in 0..rows {
                    let (mut want, mut size) = (0f64, 0f64);
                    for b in 0..cols / 32 {
                        let (q, d, m) = a.block(j / 16, b);
                        let p: i64 = (0..32)
                            .map(|i| {
                                i64::from(q[j % 16][i]) * i64::from(xq.q[r * cols + b * 32 + i])
                            })
                            .sum();
                        let t = [
                            p as f64 * d[j % 16] as f64 * xq.d_at(r, b) as f64,
                            m[j % 16] as f64 * xq.s_at(r, b) as f64,
                        ];
                        want += t[0] + t[1];
                        size += t[0].abs() + t[1].abs();
                    }
                    let g = got[r * rows + j] as f64;
                    assert!(
                        (g - want).abs() <= 1e-6 * size + 1e-12,
                        "{ty:?} {r} {j}: {g} vs {want}"
                    );
                }
            }
        }
        assert!(AmxMatrix::new(GgmlType::Q4_0, 16, 32, &[0; 18 * 16]).is_none());
        assert!(AmxMatrix::new(GgmlType::Q8_0, 8, 32, &[0; 34 * 8]).is_none());
    }

    /// On a CPU with AMX-INT8: the tiles give the reference's bits for 1, 2, 5, 16, 17 and 40
    /// input rows (remainder tiles of rows past 16 and 32), blocks in fours and a remainder,
    /// a range that starts inside the matrix; and a row alone gives what it gives in the
    /// batch.
    #[test]
    fn tiles_equal_the_reference_bit_for_bit() {
        if !available() {
            eprintln!("skipped: this CPU (or KD_SIMD) offers no AMX-INT8 tiles");
            return;
        }
        let mut next = lcg(9);
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
            // 18 blocks: four fours and two alone.
            let (rows, cols) = (64, 576);
            let bytes = blocks(ty, rows, cols, &mut next);
            let a = AmxMatrix::new(ty, rows, cols, &bytes).unwrap();
            for n in [1, 2, 5, 16, 17, 40] {
                let x: Vec<f32> = (0..n * cols)
                    .map(|_| (next() % 2000) as f32 / 1000.0 - 1.0)
                    .collect();
                let xq = Q8Rows::quantize(&x, n, cols);
                for range in [0..rows, 16..48] {
                    let (mut got, mut want) =
                        (vec![0f32; n * range.len()], vec![0f32; n * range.len()]);
                    a.rows(&xq, range.clone(), &mut got);
                    a.reference(&xq, range.clone(), &mut want);
                    assert_eq!(got, want, "{ty:?} n {n} {range:?}");
                }
                let one = Q8Rows::quantize(&x[(n - 1) * cols..], 1, cols);
                let mut alone = vec![0f32; rows];
                a.rows(&one, 0..rows, &mut alone);
                let mut all = vec![0f32; n * rows];
                a.rows(&xq, 0..rows, &mut all);
                assert_eq!(
                    alone,
                    all[(n - 1) * rows..],
                    "{ty:?} n {n}: the last row alone"
                );
            }
        }
    }
}

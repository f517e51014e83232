//! GGML tensor types and their dequantisation to f32, exactly as ggml's reference
//! `dequantize_row_*` functions compute it (same operations in the same order, so the values
//! are bit-identical to ggml's and to the `gguf` Python package's).

use half::{bf16, f16};
use rayon::prelude::*;

/// A GGML tensor type, by the id GGUF stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// Blocks of 32: an f16 scale and 32 signed bytes.
    Q8_0,
    /// Blocks of 32: an f16 scale and 32 4-bit values offset by 8.
    Q4_0,
    /// Blocks of 32: an f16 scale, an f16 minimum and 32 4-bit values.
    Q4_1,
    /// Blocks of 32: an f16 scale and 32 5-bit values offset by 16 (llama.cpp's fallback
    /// for Q4_K where a row is not a multiple of 256).
    Q5_0,
    /// Blocks of 32: an f16 scale, an f16 minimum and 32 5-bit values (the fallback for Q5_K).
    Q5_1,
    /// Super-blocks of 256: 8 sub-blocks of 32 with 6-bit scales and minimums, 4-bit values.
    Q4K,
    /// Super-blocks of 256: like Q4_K with a fifth bit per value.
    Q5K,
    /// Super-blocks of 256: 16 sub-blocks of 16 with 8-bit scales, 6-bit values.
    Q6K,
    /// 32-bit signed integers (stored and copied, not dequantised).
    I32,
    /// 64-bit signed integers (an EAGLE-3 draft's `d2t`; stored and copied, not dequantised).
    I64,
    /// A type this crate knows by name but does not dequantise.
    Other(u32),
}

impl GgmlType {
    /// The type with GGUF id `id` (ggml's `enum ggml_type`).
    pub fn from_id(id: u32) -> Self {
        match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            26 => Self::I32,
            27 => Self::I64,
            30 => Self::BF16,
            other => Self::Other(other),
        }
    }

    /// The GGUF id.
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::I32 => 26,
            Self::I64 => 27,
            Self::BF16 => 30,
            Self::Other(id) => id,
        }
    }

    /// ggml's name for the type (`"Q4_K"`), or `"type id N"` for ids outside the supported set
    /// that ggml names differently.
    pub fn name(self) -> String {
        match self {
            Self::F32 => "F32".into(),
            Self::F16 => "F16".into(),
            Self::BF16 => "BF16".into(),
            Self::Q8_0 => "Q8_0".into(),
            Self::Q4_0 => "Q4_0".into(),
            Self::Q4_1 => "Q4_1".into(),
            Self::Q5_0 => "Q5_0".into(),
            Self::Q5_1 => "Q5_1".into(),
            Self::Q4K => "Q4_K".into(),
            Self::Q5K => "Q5_K".into(),
            Self::Q6K => "Q6_K".into(),
            Self::I32 => "I32".into(),
            Self::I64 => "I64".into(),
            Self::Other(id) => match other_name(id) {
                Some(n) => n.into(),
                None => format!("type id {id}"),
            },
        }
    }

    /// `(elements per block, bytes per block)`, or `None` for a type whose layout this crate
    /// does not know. The integer types have one (their bytes can be read and written) but no
    /// dequantiser ([`block_dequantizer`]).
    /// Inlined: the packed kernels ask it once per matrix row.
    #[inline]
    pub fn block(self) -> Option<(usize, usize)> {
        Some(match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q8_0 => (32, 34),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q4K => (256, 144),
            Self::Q5K => (256, 176),
            Self::Q6K => (256, 210),
            Self::I32 => (1, 4),
            Self::I64 => (1, 8),
            Self::Other(_) => return None,
        })
    }
}

/// Names of the ggml types this crate does not dequantise, for error messages.
fn other_name(id: u32) -> Option<&'static str> {
    Some(match id {
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    })
}

/// Why a buffer cannot be dequantised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DequantError {
    /// The type is not one this crate reads.
    Unsupported(GgmlType),
    /// `bytes` and `out` do not hold the same whole number of blocks.
    Length {
        /// Bytes given.
        bytes: usize,
        /// Values requested.
        values: usize,
    },
}

impl std::fmt::Display for DequantError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unsupported(t) => write!(f, "type {} cannot be dequantised", t.name()),
            Self::Length { bytes, values } => write!(
                f,
                "{bytes} bytes do not hold exactly {values} values of this type"
            ),
        }
    }
}

impl std::error::Error for DequantError {}

/// Blocks handed to one rayon task.
const BLOCKS_PER_TASK: usize = 256;

/// Dequantises `bytes` (whole blocks of type `ty`) into `out`, in parallel.
///
/// `out.len()` must be the number of values the bytes encode.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    let (block, size) = ty.block().ok_or(DequantError::Unsupported(ty))?;
    if !out.len().is_multiple_of(block) || bytes.len() != out.len() / block * size {
        return Err(DequantError::Length {
            bytes: bytes.len(),
            values: out.len(),
        });
    }
    let f = block_dequantizer(ty).ok_or(DequantError::Unsupported(ty))?;
    bytes
        .par_chunks(size * BLOCKS_PER_TASK)
        .zip(out.par_chunks_mut(block * BLOCKS_PER_TASK))
        .for_each(|(b, y)| {
            for (b, y) in b.chunks_exact(size).zip(y.chunks_exact_mut(block)) {
                f(b, y);
            }
        });
    Ok(())
}

/// Dequantises one block: its bytes into its values.
pub type BlockFn = fn(&[u8], &mut [f32]);

/// The function that dequantises one block of type `ty` (its `block().1` bytes into its
/// `block().0` values), sequentially; `None` for a type this crate cannot dequantise (the
/// integer types and the unknown ones).
pub fn block_dequantizer(ty: GgmlType) -> Option<BlockFn> {
    Some(match ty {
        GgmlType::F32 => |b, y| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, y| y[0] = f16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::BF16 => |b, y| y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q4K => q4_k,
        GgmlType::Q5K => q5_k,
        GgmlType::Q6K => q6_k,
        GgmlType::I32 | GgmlType::I64 | GgmlType::Other(_) => return None,
    })
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// `dequantize_row_q8_0`: `y = d · q`.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = (q as i8) as f32 * d;
    }
}

/// `dequantize_row_q4_0`: low nibbles are elements 0..16, high nibbles 16..32, offset by 8.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// `dequantize_row_q4_1`: `y = d · q + m`.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let m = half_at(b, 2);
    for (j, &q) in b[4..20].iter().enumerate() {
        y[j] = (q & 0x0F) as f32 * d + m;
        y[j + 16] = (q >> 4) as f32 * d + m;
    }
}

/// The fifth bit of each of a Q5_0/Q5_1 block's 32 values: bit `j` of the little-endian
/// `qh` is value `j`'s.
fn high_bits(qh: &[u8]) -> u32 {
    u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]])
}

/// `dequantize_row_q5_0`: d (f16), qh\[4\], qs\[16\]; `y = ((nibble | high << 4) − 16) · d`.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let qh = high_bits(&b[2..6]);
    for (j, &q) in b[6..22].iter().enumerate() {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        y[j] = (((q & 0x0F) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((q >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

/// `dequantize_row_q5_1`: d, m (f16), qh\[4\], qs\[16\]; `y = (nibble | high << 4) · d + m`.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let m = half_at(b, 2);
    let qh = high_bits(&b[4..8]);
    for (j, &q) in b[8..24].iter().enumerate() {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        y[j] = ((q & 0x0F) | h0) as f32 * d + m;
        y[j + 16] = ((q >> 4) | h1) as f32 * d + m;
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and minimum of sub-block `j` (0–7) of a
/// Q4_K/Q5_K super-block, from the super-block's 12 bytes of packed scales `q` (its bytes
/// 4..16). Packed-block kernels read them with it too.
///
/// # Panics
/// If `j > 7` or `q` is shorter than 12 bytes.
// Always inlined: the packed kernels call it per sub-block inside their hottest loop, where
// a call (the inliner's choice with a plain hint, measured) halved Q4_K decoding speed.
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `dequantize_row_q4_K`: d, dmin (f16), scales\[12\], qs\[128\].
fn q4_k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let min = half_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (chunk, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc, m) = scale_min_k4(2 * chunk, scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = scale_min_k4(2 * chunk + 1, scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// `dequantize_row_q5_K`: d, dmin (f16), scales\[12\], qh\[32\], qs\[128\].
fn q5_k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let min = half_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (chunk, (ql, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        let (sc, m) = scale_min_k4(2 * chunk, scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = scale_min_k4(2 * chunk + 1, scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        for l in 0..32 {
            let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql[l] & 0x0F) + hi1) as f32 - m1;
            y[l + 32] = d2 * ((ql[l] >> 4) + hi2) as f32 - m2;
        }
    }
}

/// `dequantize_row_q6_K`: ql\[128\], qh\[64\], scales\[16\] (i8), d (f16).
fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 208);
    for half in 0..2 {
        let ql = &b[half * 64..half * 64 + 64];
        let qh = &b[128 + half * 32..128 + half * 32 + 32];
        let sc = &b[192 + half * 8..192 + half * 8 + 8];
        let y = &mut y[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| (sc[is + k] as i8) as f32;
            y[l] = d * s(0) * q1 as f32;
            y[l + 32] = d * s(2) * q2 as f32;
            y[l + 64] = d * s(4) * q3 as f32;
            y[l + 96] = d * s(6) * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_are_checked() {
        let mut out = vec![0.0; 32];
        assert_eq!(
            dequantize(GgmlType::Q8_0, &[0; 33], &mut out),
            Err(DequantError::Length {
                bytes: 33,
                values: 32
            })
        );
        let mut odd = vec![0.0; 31];
        assert!(dequantize(GgmlType::Q8_0, &[0; 34], &mut odd).is_err());
        assert_eq!(
            dequantize(GgmlType::Other(10), &[], &mut []),
            Err(DequantError::Unsupported(GgmlType::Other(10)))
        );
    }

    #[test]
    fn ids_round_trip() {
        for id in 0..40 {
            assert_eq!(GgmlType::from_id(id).id(), id);
        }
        assert_eq!(GgmlType::from_id(10).name(), "Q2_K");
        assert_eq!(GgmlType::from_id(99).name(), "type id 99");
    }
}

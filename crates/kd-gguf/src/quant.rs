//! Quantisation of f32 values to Q8_0 blocks, exactly as ggml's reference
//! `quantize_row_q8_0_ref` computes it (and the `gguf` Python package's `gguf.quants.quantize`):
//! per block of 32, `d = amax / 127`, `q = round(x · (1 / d))` with halves away from zero, and
//! `d` stored as f16.

use half::f16;

use crate::GgmlType;
use crate::dequant::DequantError;

/// Values per Q8_0 block.
const BLOCK: usize = 32;
/// Bytes per Q8_0 block: the f16 scale and 32 signed bytes.
const BLOCK_BYTES: usize = 34;

/// `x` as Q8_0 blocks (`x.len() / 32 · 34` bytes, in order). `x.len()` must be a multiple of
/// 32 ([`DequantError::Length`] otherwise). Non-finite values give a non-finite scale, as in
/// ggml.
pub fn quantize_q8_0(x: &[f32]) -> Result<Vec<u8>, DequantError> {
    if !x.len().is_multiple_of(BLOCK) {
        return Err(DequantError::Length {
            bytes: x.len() / BLOCK * BLOCK_BYTES,
            values: x.len(),
        });
    }
    debug_assert_eq!(GgmlType::Q8_0.block(), Some((BLOCK, BLOCK_BYTES)));
    let mut out = Vec::with_capacity(x.len() / BLOCK * BLOCK_BYTES);
    for block in x.chunks_exact(BLOCK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        // `roundf` rounds halves away from zero, as `f32::round` does.
        out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
    }
    Ok(out)
}

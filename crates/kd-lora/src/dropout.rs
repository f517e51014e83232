//! Dropout masks derived from a seed, not from the backend's generator: Burn's CPU generator
//! state cannot be read back, and exact resume needs the same masks after a restart. The
//! trainer derives one seed per (run seed, step, micro-batch, module).

use burn::tensor::{Device, Tensor, TensorData};

/// SplitMix64: a fast, well-mixed 64-bit hash (Steele et al. 2014).
#[inline]
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Combines a seed with further values (step, micro-batch, module index, …).
pub fn derive_seed(seed: u64, parts: &[u64]) -> u64 {
    parts.iter().fold(splitmix64(seed), |acc, p| {
        splitmix64(acc ^ p.wrapping_mul(0x2545_F491_4F6C_DD1D))
    })
}

/// An inverted-dropout mask of the given shape: each element is 0 with probability `p` and
/// 1/(1 − p) otherwise, element i decided by hash(seed, i).
pub fn dropout_mask<const D: usize>(
    dims: &[usize; D],
    p: f64,
    seed: u64,
    device: &Device,
) -> Tensor<D> {
    let n: usize = dims.iter().product();
    let mut values = vec![0f32; n];
    dropout_fill(&mut values, 0, p, seed);
    Tensor::from_data(TensorData::new(values, *dims), device)
}

/// Writes the mask values of the flat elements `start .. start + out.len()` of
/// [`dropout_mask`]`(.., p, seed, ..)` into `out`: fused kernels regenerate any part of a
/// mask without materialising the whole of it, with the same values.
pub fn dropout_fill(out: &mut [f32], start: u64, p: f64, seed: u64) {
    let keep = 1.0 - p;
    let threshold = (p * (1u64 << 32) as f64) as u64;
    let scale = (1.0 / keep) as f32;
    let base = splitmix64(seed);
    for (x, i) in out.iter_mut().zip(start..) {
        let h = splitmix64(base ^ i) >> 32;
        *x = if h < threshold { 0.0 } else { scale };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_are_deterministic_and_have_the_right_rate() {
        let device = Device::flex();
        let a = dropout_mask(&[64, 1000], 0.1, 7, &device)
            .into_data()
            .try_into_vec_as::<f32>()
            .unwrap();
        let b = dropout_mask(&[64, 1000], 0.1, 7, &device)
            .into_data()
            .try_into_vec_as::<f32>()
            .unwrap();
        let c = dropout_mask(&[64, 1000], 0.1, 8, &device)
            .into_data()
            .try_into_vec_as::<f32>()
            .unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        let dropped = a.iter().filter(|v| **v == 0.0).count() as f64 / a.len() as f64;
        assert!((dropped - 0.1).abs() < 0.01, "{dropped}");
        let mean = a.iter().map(|v| *v as f64).sum::<f64>() / a.len() as f64;
        assert!((mean - 1.0).abs() < 0.02, "{mean}");
        assert_ne!(derive_seed(1, &[2, 3]), derive_seed(1, &[3, 2]));
    }
}

//! Rotary position embeddings as Hugging Face Llama computes them: `rotate_half` pairs
//! (i, i + d/2), not Burn's interleaved pairs, with optional llama3 frequency scaling.
//!
//! The frequency tables are computed on the host in f32, in the same order of operations as
//! transformers' `_compute_default_rope_parameters`, `_compute_llama3_parameters` and
//! `LlamaRotaryEmbedding.forward`, so the angles agree with PyTorch's to the rounding.

use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::config::{LlamaConfig, RopeScaling};

/// Inverse frequencies of one head, `[head_dim / 2]`, in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    /// The inverse frequencies for a configuration (llama3 scaling applied when configured).
    pub fn new(config: &LlamaConfig) -> Self {
        let dim = config.head_dim;
        let base = config.rope_theta as f32;
        // inv_freq = 1 / base ** (arange(0, dim, 2) / dim), in f32.
        let mut inv_freq: Vec<f32> = (0..dim)
            .step_by(2)
            .map(|i| 1.0 / base.powf(i as f32 / dim as f32))
            .collect();
        if let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } = config.rope_scaling
        {
            let (factor, low, high) = (
                factor as f32,
                low_freq_factor as f32,
                high_freq_factor as f32,
            );
            let old_context_len = original_max_position_embeddings as f32;
            let low_freq_wavelen = old_context_len / low;
            let high_freq_wavelen = old_context_len / high;
            for f in &mut inv_freq {
                let wavelen = 2.0 * std::f32::consts::PI / *f;
                let scaled = if wavelen > low_freq_wavelen {
                    *f / factor
                } else {
                    *f
                };
                // transformers: ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
                let is_medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                *f = if is_medium {
                    let smooth = (old_context_len / wavelen - low) / (high - low);
                    (1.0 - smooth) * scaled / factor + smooth * scaled
                } else {
                    scaled
                };
            }
        }
        Self { inv_freq }
    }

    /// The inverse frequencies, `[head_dim / 2]`.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// `cos` and `sin` tables for the given positions, each `[batch, 1, seq, head_dim]`,
    /// with `positions` laid out row-major as `[batch, seq]`.
    pub fn tables(
        &self,
        positions: &[i64],
        batch: usize,
        seq: usize,
        dtype: DType,
        device: &Device,
    ) -> (Tensor<4>, Tensor<4>) {
        debug_assert_eq!(positions.len(), batch * seq);
        let dim = 2 * self.inv_freq.len();
        let (cos, sin) = self.host_tables(positions);
        let shape = [batch, 1, seq, dim];
        let make = |v: Vec<f32>| Tensor::from_data(TensorData::new(v, shape), (device, dtype));
        (make(cos), make(sin))
    }

    /// The values of [`tables`](Self::tables): `cos` and `sin`, `[positions, head_dim]` each.
    pub fn host_tables(&self, positions: &[i64]) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let dim = 2 * half;
        let mut cos = Vec::with_capacity(positions.len() * dim);
        let mut sin = Vec::with_capacity(positions.len() * dim);
        for &p in positions {
            let p = p as f32;
            let start = cos.len();
            for &f in &self.inv_freq {
                let angle = f * p;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
            // emb = cat(freqs, freqs)
            cos.extend_from_within(start..start + half);
            sin.extend_from_within(start..start + half);
        }
        (cos, sin)
    }
}

/// Applies the rotation to `x` `[batch, heads, seq, head_dim]`:
/// `x · cos + rotate_half(x) · sin`, with `rotate_half(x) = cat(-x₂, x₁)`.
pub fn apply_rotary(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
    let [b, h, s, d] = x.dims();
    let half = d / 2;
    let x1 = x.clone().slice([0..b, 0..h, 0..s, 0..half]);
    let x2 = x.clone().slice([0..b, 0..h, 0..s, half..d]);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos.clone() + rotated * sin.clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> LlamaConfig {
        LlamaConfig::from_json_str(json).unwrap()
    }

    #[test]
    fn default_frequencies() {
        let c = config(
            r#"{"vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
                "num_hidden_layers": 1, "num_attention_heads": 4, "rope_theta": 10000.0}"#,
        );
        let rope = Rope::new(&c);
        assert_eq!(rope.inv_freq().len(), 8);
        assert_eq!(rope.inv_freq()[0], 1.0);
        let expected = 1.0 / 10000f64.powf(14.0 / 16.0);
        assert!((rope.inv_freq()[7] as f64 - expected).abs() < 1e-9);
    }

    #[test]
    fn llama3_scaling_regions() {
        // Llama 3.1 values: frequencies with wavelength above 8192 are divided by 8, below
        // 2048 kept, in between interpolated.
        let c = config(
            r#"{"vocab_size": 8, "hidden_size": 128, "intermediate_size": 8,
                "num_hidden_layers": 1, "num_attention_heads": 1, "rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#,
        );
        let mut plain_config = c.clone();
        plain_config.rope_scaling = RopeScaling::Default;
        let plain = Rope::new(&plain_config);
        let scaled = Rope::new(&c);
        for (p, s) in plain.inv_freq().iter().zip(scaled.inv_freq()) {
            let wavelen = 2.0 * std::f32::consts::PI / p;
            if wavelen < 2048.0 {
                assert_eq!(p, s);
            } else if wavelen > 8192.0 {
                assert_eq!(p / 8.0, *s);
            } else {
                assert!(*s < *p && *s > p / 8.0);
            }
        }
    }
}

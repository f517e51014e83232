//! Decoding a whole decoder layer on the host: for a pass of a few rows (a decode step, a
//! speculative verification) of a model that decodes from packed blocks, the layer runs on
//! plain f32 rows — RMSNorm, the packed q/k/v products and their biases, Qwen3's q/k norms,
//! RoPE, the KV cache (written in place) and attention over its slots, o, the residual,
//! RMSNorm, gate/up, SwiGLU, down — with no Burn tensor operation. The Burn path issues some
//! seventy tensor operations per layer for such a pass, each a dispatch, an allocation and
//! often a fork of the pool; at batch 1 they cost as much as the products.
//!
//! Every step calls the kernels the Burn path calls, in the same order, on the same values
//! (the RMSNorm and SwiGLU row kernels, the packed products, the fused attention), and the
//! elementwise steps (bias, RoPE, residual) are the same single f32 operations, so the output
//! is bit-identical to the Burn path's.

use burn::nn::RmsNorm;
use burn::tensor::{Tensor, TensorData};
use kd_kernels::cpu::SimdLevel;
use kd_lora::LoraLinear;

use super::LayerPacks;
use super::layer::DecoderLayer;
use crate::cache::KvCache;
use crate::ops::attention::{self, AttnDims};
use crate::ops::{self, AttentionJob};
use crate::packed::{self, PackedMatrix};

/// What a layer's host pass reads besides the packed blocks: the norms' weights and the
/// projections' biases, copied once when the blocks are made.
#[derive(Debug, Clone)]
pub(crate) struct HostLayer {
    input_norm: HostNorm,
    post_norm: HostNorm,
    q_norm: Option<HostNorm>,
    k_norm: Option<HostNorm>,
    /// q, k, v, o, gate, up, down.
    biases: [Option<Vec<f32>>; 7],
}

/// An RMSNorm's weight and ε on the host.
#[derive(Debug, Clone)]
pub(crate) struct HostNorm {
    gamma: Vec<f32>,
    eps: f32,
}

impl HostNorm {
    /// The norm with weight `gamma` and ε `eps`.
    pub(crate) fn new(gamma: Vec<f32>, eps: f32) -> Self {
        Self { gamma, eps }
    }

    fn of(norm: &RmsNorm) -> Option<Self> {
        Some(Self {
            gamma: host_values(&norm.gamma.val())?,
            eps: norm.epsilon as f32,
        })
    }

    /// `x` in rows of `gamma.len()` values, normalised (the fused RMSNorm's row kernel).
    pub(crate) fn apply(&self, simd: SimdLevel, x: &[f32]) -> Vec<f32> {
        let mut y = vec![0f32; x.len()];
        ops::norm::rms_norm_rows(simd, &mut y, x, &self.gamma, self.eps);
        y
    }
}

/// The values of an f32 tensor, or `None` for another dtype.
fn host_values<const D: usize>(t: &Tensor<D>) -> Option<Vec<f32>> {
    t.to_data().try_into_vec::<f32>().ok()
}

impl HostLayer {
    /// The host copies of `layer`'s norms and biases; `None` when one is not f32.
    pub(crate) fn of(layer: &DecoderLayer) -> Option<Self> {
        let a = &layer.self_attn;
        let bias = |p: &LoraLinear| match &p.base.bias {
            Some(b) => host_values(&b.val()).map(Some),
            None => Some(None),
        };
        let [q, k, v, o, gate, up, down] = layer.projections().map(bias);
        let qk = |n: Option<&RmsNorm>| match n {
            Some(n) => HostNorm::of(n).map(Some),
            None => Some(None),
        };
        Some(Self {
            input_norm: HostNorm::of(&layer.input_layernorm)?,
            post_norm: HostNorm::of(&layer.post_attention_layernorm)?,
            q_norm: qk(a.q_norm.as_ref())?,
            k_norm: qk(a.k_norm.as_ref())?,
            biases: [q?, k?, v?, o?, gate?, up?, down?],
        })
    }
}

/// The per-pass state every layer shares: batch shape, RoPE tables and the attention job.
pub(crate) struct HostPass<'a> {
    pub batch: usize,
    pub seq: usize,
    /// `cos`, `sin` per row of the pass (`[batch · seq, head_dim]`).
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub job: &'a AttentionJob,
    pub device: &'a burn::tensor::Device,
}

/// `x [n, in] · mᵀ + bias`.
fn project(m: &PackedMatrix, x: &[f32], n: usize, bias: Option<&Vec<f32>>) -> Vec<f32> {
    let mut y = m.project(x, n);
    add_bias(&mut y, bias);
    y
}

/// `y [n, out] += bias` where there is one.
fn add_bias(y: &mut [f32], bias: Option<&Vec<f32>>) {
    if let Some(bias) = bias {
        for row in y.chunks_exact_mut(bias.len()) {
            for (v, b) in row.iter_mut().zip(bias) {
                *v += b;
            }
        }
    }
}

/// The products of projections `ids` of one input, in one parallel job, biases added.
fn project_all<const N: usize>(
    (packs, host): (&LayerPacks, &HostLayer),
    ids: [usize; N],
    x: &[f32],
    n: usize,
) -> [Vec<f32>; N] {
    let ms = ids.map(|i| packs[i].as_ref().expect("every projection packed"));
    let mut ys = packed::project_all(&ms, x, n);
    for (y, i) in ys.iter_mut().zip(ids) {
        add_bias(y, host.biases[i].as_ref());
    }
    ys.try_into().expect("one output per matrix")
}

/// Rotates rows `[n, heads, d]` in place: `x · cos + rotate_half(x) · sin` with the row's
/// `cos`/`sin` (as `rope::apply_rotary`, one f32 operation per step).
pub(crate) fn rotate(x: &mut [f32], heads: usize, d: usize, cos: &[f32], sin: &[f32]) {
    let half = d / 2;
    for ((row, c), s) in x
        .chunks_exact_mut(heads * d)
        .zip(cos.chunks_exact(d))
        .zip(sin.chunks_exact(d))
    {
        for head in row.chunks_exact_mut(d) {
            let (x1, x2) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                x1[i] = a * c[i] + -b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

/// `[b, s, heads, d]` ↔ `[b, heads, s, d]` (the same permutation both ways); `x` itself when
/// one of the two axes has length 1.
pub(crate) fn swap_seq_heads(x: Vec<f32>, b: usize, s: usize, heads: usize, d: usize) -> Vec<f32> {
    if s == 1 || heads == 1 {
        return x;
    }
    let mut out = vec![0f32; x.len()];
    for bi in 0..b {
        for si in 0..s {
            for h in 0..heads {
                let from = ((bi * s + si) * heads + h) * d;
                let to = ((bi * heads + h) * s + si) * d;
                out[to..to + d].copy_from_slice(&x[from..from + d]);
            }
        }
    }
    out
}

/// One decoder layer over `x [batch · seq, hidden]` (updated in place), appending the pass's
/// keys and values to `cache`'s layer `index`.
pub(crate) fn decode_layer(
    layer: &DecoderLayer,
    packs: &LayerPacks,
    host: &HostLayer,
    x: &mut [f32],
    pass: &HostPass<'_>,
    (cache, index): (&mut KvCache, usize),
) {
    let simd = kd_kernels::cpu::level();
    let attn = &layer.self_attn;
    let (b, s) = (pass.batch, pass.seq);
    let n = b * s;
    let (h, kv, d) = (attn.num_heads, attn.num_kv_heads, attn.head_dim);
    let pk = |i: usize| packs[i].as_ref().expect("every projection packed");
    let bias = |i: usize| host.biases[i].as_ref();

    let normed = host.input_norm.apply(simd, x);
    let [mut q, mut k, v] = project_all((packs, host), [0, 1, 2], &normed, n);
    if let Some(norm) = &host.q_norm {
        q = norm.apply(simd, &q);
    }
    if let Some(norm) = &host.k_norm {
        k = norm.apply(simd, &k);
    }
    rotate(&mut q, h, d, pass.cos, pass.sin);
    rotate(&mut k, kv, d, pass.cos, pass.sin);

    // [b, s, heads, d] → [b, heads, s, d], the layout of the cache and the attention kernel.
    let (q, k, v) = (
        swap_seq_heads(q, b, s, h, d),
        swap_seq_heads(k, b, s, kv, d),
        swap_seq_heads(v, b, s, kv, d),
    );
    let attend = |ks: &[f32], vs: &[f32], stride: usize, t: usize| {
        assert_eq!(
            pass.job.dims(),
            (b, s, t),
            "the pass's mask is [b, s, cached]"
        );
        let dims = AttnDims { b, h, kv, s, t, d };
        attention::forward(&q, (ks, vs, stride), pass.job, dims).0
    };
    let out = match cache.append_host(index, (&k, &v), [b, kv, s, d], attend) {
        Some(out) => out,
        None => {
            // A cache held as other tensors (not the CPU backend's f32): Burn's append.
            let tensor = |values: Vec<f32>, heads: usize| {
                Tensor::<4>::from_data(TensorData::new(values, [b, heads, s, d]), pass.device)
            };
            let (k, v) = cache.append(index, tensor(k, kv), tensor(v, kv));
            ops::fused_attention_job(tensor(q, h), k, v, pass.job.clone())
                .into_data()
                .try_into_vec()
                .expect("the fused attention's output is f32")
        }
    };
    let out = swap_seq_heads(out, b, h, s, d);
    let o = project(pk(3), &out, n, bias(3));
    for (xv, ov) in x.iter_mut().zip(&o) {
        *xv += ov;
    }

    let normed = host.post_norm.apply(simd, x);
    let [gate, up] = project_all((packs, host), [4, 5], &normed, n);
    let mut act = vec![0f32; gate.len()];
    ops::swiglu::swiglu_chunk(simd, &mut act, &gate, &up);
    let down = project(pk(6), &act, n, bias(6));
    for (xv, dv) in x.iter_mut().zip(&down) {
        *xv += dv;
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    use crate::batch::{ForwardOptions, HiddenStates, PaddingSide, TokenBatch};
    use crate::{Llama, LlamaConfig};

    fn model(json: &str) -> Llama {
        let config = LlamaConfig::from_json_str(json).unwrap();
        Llama::random(&config, &Device::flex()).with_q8_0_weights(true)
    }

    fn bits(t: &burn::tensor::Tensor<3>) -> Vec<u32> {
        let v: Vec<f32> = t.to_data().try_to_vec().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Prefill, single-token steps and multi-token (verification) steps of a left-padded
    /// batch, with passes too wide for the host (40 and 34 rows, Burn's path, on the same
    /// cache) between them: the host layers give the Burn path's logits and hidden states bit
    /// for bit, and the cache they share grows as it would.
    fn host_equals_burn(model: Llama) {
        assert!(model.host_layers(), "every projection packed: host layers");
        let used = model
            .layers_on_host(10, &ForwardOptions::default())
            .is_some();
        assert_eq!(
            used,
            crate::skinny::avx2(),
            "the host layers serve with AVX2"
        );
        let burn = model.clone().with_host_layers(false);
        assert!(!burn.host_layers() && burn.has_packed_weights());
        let rows = |a: &[u32], b: &[u32]| {
            TokenBatch::from_rows(&[a.to_vec(), b.to_vec()], 0, PaddingSide::Left)
        };
        let ids = |n: u32, from: u32| (from..from + n).map(|i| i % 60 + 1).collect::<Vec<_>>();
        let steps = [
            rows(&[1, 2, 3, 4, 5], &[6, 7]),
            rows(&[9], &[10]),
            rows(&[11], &[12]),
            rows(&[13, 14, 15], &[16, 17, 18]),
            rows(&ids(17, 20), &ids(17, 40)),
            rows(&[19], &[20]),
            rows(&[21, 22], &[23, 24]),
        ];
        same_steps(&model, &burn, &steps);
        // A prompt too wide for the host first, then host steps on the cache it wrote.
        let steps = [
            rows(&ids(20, 1), &ids(12, 30)),
            rows(&[5], &[6]),
            rows(&[7, 8], &[9, 10]),
        ];
        same_steps(&model, &burn, &steps);
    }

    /// Runs `steps` through both models, each on its own cache, and compares every output.
    fn same_steps(model: &Llama, burn: &Llama, steps: &[TokenBatch]) {
        let options = ForwardOptions::with_hidden_states(HiddenStates::All);
        let (mut host_cache, mut burn_cache) = (model.new_cache(), burn.new_cache());
        for (i, step) in steps.iter().enumerate() {
            let a = model
                .forward_cached(step, &mut host_cache, &options)
                .unwrap();
            let b = burn
                .forward_cached(step, &mut burn_cache, &options)
                .unwrap();
            assert_eq!(
                bits(a.logits.as_ref().unwrap()),
                bits(b.logits.as_ref().unwrap()),
                "logits of step {i}"
            );
            assert_eq!(a.hidden_states.len(), b.hidden_states.len());
            for ((ia, ha), (ib, hb)) in a.hidden_states.iter().zip(&b.hidden_states) {
                assert_eq!(
                    (ia, bits(ha)),
                    (ib, bits(hb)),
                    "hidden state {ia} of step {i}"
                );
            }
        }
        assert_eq!(host_cache.capacity(), burn_cache.capacity());
    }

    const BASE: &str = r#""vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2"#;

    #[test]
    fn llama_layers_on_the_host_equal_the_burn_path() {
        host_equals_burn(model(&format!("{{{BASE}}}")));
    }

    #[test]
    fn qwen3_layers_with_biases_on_the_host_equal_the_burn_path() {
        // q/k norms, head_dim 32 ≠ 64 / 4, biases on q, k, v and o.
        host_equals_burn(model(&format!(
            r#"{{{BASE}, "model_type": "qwen3", "head_dim": 32, "attention_bias": true}}"#
        )));
    }

    #[test]
    fn int8_activations_on_the_host_equal_the_burn_path() {
        host_equals_burn(model(&format!("{{{BASE}}}")).with_int8_activations(true));
    }

    #[test]
    fn adapters_and_wide_passes_stay_on_the_burn_path() {
        let m = model(&format!("{{{BASE}}}"));
        let options = ForwardOptions::default();
        // Below AVX2 (`KD_SIMD=scalar`) the packed products, and so the host layers, stand down.
        assert_eq!(
            m.layers_on_host(32, &options).is_some(),
            crate::skinny::avx2()
        );
        assert!(m.layers_on_host(33, &options).is_none());
        let off = m.clone().with_host_layers(false);
        assert!(off.layers_on_host(1, &options).is_none());
        assert!(off.with_host_layers(true).host_layers());
        let dropout = ForwardOptions {
            dropout_seed: Some(1),
            ..ForwardOptions::default()
        };
        assert!(m.layers_on_host(1, &dropout).is_none());
        let lora = kd_lora::LoraConfig::default();
        let adapted = m.clone().apply_lora_seeded(&lora, 3).unwrap();
        assert!(adapted.layers_on_host(1, &options).is_none());
    }
}

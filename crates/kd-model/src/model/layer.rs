//! One decoder layer of the Llama family: attention (GQA, RoPE, optional per-head q/k norms,
//! the fused CPU kernel or Burn's attention), the SwiGLU MLP, and the projections they share
//! (LoRA adapters, packed GGUF blocks and the skinny kernel for decoding).

use burn::module::Module;
use burn::nn::RmsNorm;
use burn::tensor::activation::silu;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, DType, Tensor, TensorData};
use kd_lora::{LoraLinear, derive_seed};

use crate::cache::KvCache;
use crate::error::Result;
use crate::ops;
use crate::rope::apply_rotary;
use crate::skinny;

/// Grouped-query self-attention (`self_attn`).
#[derive(Module, Debug)]
pub struct Attention {
    /// Query projection, `hidden → heads · head_dim`.
    pub q_proj: LoraLinear,
    /// Key projection, `hidden → kv_heads · head_dim`.
    pub k_proj: LoraLinear,
    /// Value projection, `hidden → kv_heads · head_dim`.
    pub v_proj: LoraLinear,
    /// Output projection, `heads · head_dim → hidden`.
    pub o_proj: LoraLinear,
    /// RMSNorm over each query head (`head_dim`) before RoPE: Qwen3's `q_norm`.
    pub q_norm: Option<RmsNorm>,
    /// RMSNorm over each key head before RoPE: Qwen3's `k_norm`.
    pub k_norm: Option<RmsNorm>,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
}

impl Attention {
    /// # Shapes
    /// - `x`: `[batch, seq, hidden]`
    /// - `cos`, `sin`: `[batch, 1, seq, head_dim]`
    /// - `mask`: `[batch, 1, seq, past + seq]`, `true` = masked out
    /// - output: `[batch, seq, hidden]`
    #[allow(clippy::too_many_arguments)] // the per-call state of one layer, passed through
    fn forward(
        &self,
        x: Tensor<3>,
        cos: &Tensor<4>,
        sin: &Tensor<4>,
        mask: &LayerMask,
        cache: Option<(&mut KvCache, usize)>,
        seed: Option<u64>,
        packs: Option<&LayerPacks>,
    ) -> Tensor<3> {
        let [b, s, _] = x.dims();
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let pk = |i: usize| packs.and_then(|p| p[i].as_ref());
        // [b, s, n·d] → [b, n, s, d], each head normalised over its width where the family
        // asks (one RMSNorm over b·s·n rows of d).
        let heads = |t: Tensor<3>, n: usize, norm: Option<&RmsNorm>| {
            let t = match norm {
                Some(norm) => rms_norm(norm, t.reshape([b, s * n, d])),
                None => t,
            };
            t.reshape([b, s, n, d]).swap_dims(1, 2)
        };
        let q = apply_rotary(
            heads(
                project(&self.q_proj, pk(0), x.clone(), module_seed(seed, 0)),
                h,
                self.q_norm.as_ref(),
            ),
            cos,
            sin,
        );
        let k = apply_rotary(
            heads(
                project(&self.k_proj, pk(1), x.clone(), module_seed(seed, 1)),
                kv,
                self.k_norm.as_ref(),
            ),
            cos,
            sin,
        );
        let v = heads(
            project(&self.v_proj, pk(2), x, module_seed(seed, 2)),
            kv,
            None,
        );
        let (k, v) = match cache {
            Some((cache, layer)) => cache.append(layer, k, v),
            None => (k, v),
        };
        let scale = 1.0 / (d as f64).sqrt();
        let out = if let Some(job) = &mask.job {
            // f32 on the CPU: the fused kernel (K/V heads shared, memory linear in the
            // sequence, the cache's slots read in place), forward and backward.
            ops::fused_attention_job(q, k, v, job.clone())
        } else {
            // Flex's attention kernel shares K/V heads natively; autodiff's fallback and the
            // other backends need them repeated (transformers' `repeat_kv`).
            let shares_heads =
                !q.is_autodiff() && q.device().without_autodiff() == burn::tensor::Device::flex();
            let (k, v) = if h != kv && !shares_heads {
                (repeat_kv(k, h / kv), repeat_kv(v, h / kv))
            } else {
                (k, v)
            };
            attention(
                q,
                k,
                v,
                Some(
                    mask.tensor
                        .clone()
                        .expect("a mask tensor wherever the fused kernel does not serve"),
                ),
                None,
                AttentionModuleOptions {
                    scale: Some(scale),
                    softcap: None,
                    is_causal: false,
                },
            )
        };
        project(
            &self.o_proj,
            pk(3),
            out.swap_dims(1, 2).reshape([b, s, h * d]),
            module_seed(seed, 3),
        )
    }
}

/// `norm(x)`: the fused kernel on the CPU in f32, Burn's `RmsNorm` elsewhere.
pub(super) fn rms_norm(norm: &RmsNorm, x: Tensor<3>) -> Tensor<3> {
    if ops::applies(&x.device(), x.dtype()) && norm.gamma.val().dtype() == DType::F32 {
        ops::fused_rms_norm(x, norm.gamma.val(), norm.epsilon)
    } else {
        norm.forward(x)
    }
}

/// The dropout seed of projection `index` of a layer (0–3 attention, 4–6 MLP).
fn module_seed(layer_seed: Option<u64>, index: u64) -> Option<u64> {
    layer_seed.map(|s| derive_seed(s, &[index]))
}

/// `[b, kv, t, d]` → `[b, kv · groups, t, d]`, each KV head repeated for its query group.
pub(crate) fn repeat_kv(x: Tensor<4>, groups: usize) -> Tensor<4> {
    let [b, kv, t, d] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .expand([b, kv, groups, t, d])
        .reshape([b, kv * groups, t, d])
}

/// A layer's packed projections: q, k, v, o, gate, up, down.
pub(crate) type LayerPacks = [Option<crate::packed::PackedMatrix>; 7];

/// The SwiGLU feed-forward block (`mlp`): `down(silu(gate(x)) · up(x))`.
#[derive(Module, Debug)]
pub struct Mlp {
    /// Gate projection, `hidden → intermediate`.
    pub gate_proj: LoraLinear,
    /// Up projection, `hidden → intermediate`.
    pub up_proj: LoraLinear,
    /// Down projection, `intermediate → hidden`.
    pub down_proj: LoraLinear,
}

impl Mlp {
    fn forward(&self, x: Tensor<3>, seed: Option<u64>, packs: Option<&LayerPacks>) -> Tensor<3> {
        let pk = |i: usize| packs.and_then(|p| p[i].as_ref());
        let gate = project(&self.gate_proj, pk(4), x.clone(), module_seed(seed, 4));
        let up = project(&self.up_proj, pk(5), x, module_seed(seed, 5));
        let act = if ops::applies(&gate.device(), gate.dtype()) {
            ops::fused_swiglu(gate, up)
        } else {
            silu(gate) * up
        };
        project(&self.down_proj, pk(6), act, module_seed(seed, 6))
    }
}

/// One pre-norm decoder layer (`model.layers.{i}`).
#[derive(Module, Debug)]
pub struct DecoderLayer {
    /// Norm before attention.
    pub input_layernorm: RmsNorm,
    /// Self-attention.
    pub self_attn: Attention,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// Feed-forward block.
    pub mlp: Mlp,
}

impl DecoderLayer {
    /// The layer's projections in checkpoint order: q, k, v, o, gate, up, down.
    pub(crate) fn projections(&self) -> [&LoraLinear; 7] {
        let (a, m) = (&self.self_attn, &self.mlp);
        [
            &a.q_proj,
            &a.k_proj,
            &a.v_proj,
            &a.o_proj,
            &m.gate_proj,
            &m.up_proj,
            &m.down_proj,
        ]
    }

    #[allow(clippy::too_many_arguments)] // the per-call state of one layer, passed through
    pub(super) fn forward(
        &self,
        x: Tensor<3>,
        cos: &Tensor<4>,
        sin: &Tensor<4>,
        mask: &LayerMask,
        cache: Option<(&mut KvCache, usize)>,
        seed: Option<u64>,
        packs: Option<&LayerPacks>,
    ) -> Tensor<3> {
        let normed = rms_norm(&self.input_layernorm, x.clone());
        let attn = self
            .self_attn
            .forward(normed, cos, sin, mask, cache, seed, packs);
        let x = x + attn;
        let normed = rms_norm(&self.post_attention_layernorm, x.clone());
        x + self.mlp.forward(normed, seed, packs)
    }
}

/// A projection `[batch, seq, in] → [batch, seq, out]`; a few rows of plain f32 on the CPU
/// (decoding) take the skinny kernel for the base weight, everything else Burn's matmul.
fn project(
    p: &LoraLinear,
    packed: Option<&crate::packed::PackedMatrix>,
    x: Tensor<3>,
    seed: Option<u64>,
) -> Tensor<3> {
    let [b, s, d] = x.dims();
    if b * s <= skinny::MAX_ROWS {
        let flat = x.clone().reshape([b * s, d]);
        // A packed matrix needs nothing of the f32 weight (a lean model's is not made).
        let packed = packed.filter(|_| {
            skinny::applies_to_input(&flat, skinny::MAX_ROWS)
                && (!p.base.weight.is_initialized()
                    || skinny::applies_to_weight(&p.base.weight.val()))
        });
        let dense = || {
            let weight = p.base.weight.val();
            skinny::applies(&flat, &weight).then_some(weight)
        };
        let y = match packed {
            Some(m) => Some((crate::packed::packed_project(m, flat.clone()), m.dims()[0])),
            None => dense().map(|w| {
                let out = w.dims()[1];
                (skinny::skinny_matmul(flat.clone(), w), out)
            }),
        };
        if let Some((y, out)) = y {
            let mut y = y.reshape([b, s, out]);
            if let Some(bias) = &p.base.bias {
                y = y + bias.val().reshape([1, 1, out]);
            }
            if let Some(adapter) = &p.adapter {
                y = y + adapter.forward(x, seed);
            }
            return y;
        }
    }
    // One [b·s, in] matrix: a single GEMM over all rows (threaded inside) instead of a batch
    // of b small ones, and a weight gradient without a reduction over the batch.
    let out = p.base.weight.dims()[1];
    let flat = x.reshape([b * s, d]);
    let weight = p.base.weight.val();
    // The bias (Qwen2's q/k/v) joins after the fused product: `x·W + Δ + b`.
    let with_bias = |y: Tensor<2>| match &p.base.bias {
        Some(bias) => y + bias.val().unsqueeze_dim(0),
        None => y,
    };
    if let Some(adapter) = &p.adapter
        && !weight.is_require_grad()
        && ops::applies(&flat.device(), flat.dtype())
    {
        // Training the adapter on the CPU: one fused op, the low-rank term added into the
        // base product's output (and its gradient into the input's); LoRA dropout (the
        // unfused path's mask, from the same seed) on the input of A inside it.
        let dropout = seed
            .filter(|_| adapter.dropout > 0.0)
            .map(|seed| ops::LoraDropout {
                p: adapter.dropout,
                seed,
            });
        let y = ops::fused_lora_linear(
            flat,
            weight,
            adapter.lora_a.weight.val(),
            adapter.lora_b.weight.val(),
            adapter.scale,
            dropout,
        );
        return with_bias(y).reshape([b, s, out]);
    }
    if p.adapter.is_none()
        && !weight.is_require_grad()
        && ops::applies(&flat.device(), flat.dtype())
    {
        // A frozen projection on the CPU: the same GEMM (and instruction-set level) as the
        // adapted ones, so that a rank-0 or zero adapter changes no bit of the output.
        return with_bias(ops::fused_frozen_linear(flat, weight)).reshape([b, s, out]);
    }
    p.forward(flat, seed).reshape([b, s, out])
}

/// The attention mask of a forward pass, shared by its layers: where the fused kernel
/// serves, its job (built once); elsewhere the `[batch, 1, seq, keys]` tensor for Burn's
/// attention. One of the two is built, never both.
pub(crate) struct LayerMask {
    tensor: Option<Tensor<4, Bool>>,
    job: Option<ops::AttentionJob>,
}

impl LayerMask {
    /// The fused kernel's job, where it serves.
    pub(super) fn job(&self) -> Option<&ops::AttentionJob> {
        self.job.as_ref()
    }

    pub(super) fn new(
        values: Vec<bool>,
        [b, s, t]: [usize; 3],
        scale: f64,
        fused: bool,
        device: &burn::tensor::Device,
    ) -> Result<Self> {
        Ok(if fused {
            Self {
                tensor: None,
                job: Some(ops::AttentionJob::new(values, b, s, t, scale as f32)?),
            }
        } else {
            Self {
                tensor: Some(Tensor::from_data(
                    TensorData::new(values, [b, 1, s, t]),
                    device,
                )),
                job: None,
            }
        })
    }
}

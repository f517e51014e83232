//! The draft's decoding passes on the host: for the few positions a speculative round runs
//! (the verified tokens, then each drafted one), the layer runs on plain f32 rows — RMSNorm,
//! the Q8_0 products, a Qwen3 layer's per-head norms, RoPE, the KV cache and attention over it, o, the residual, RMSNorm,
//! SwiGLU, down — and the LM head after the final norm, with no Burn tensor operation between
//! the products. Through Burn the same pass issues some sixty tensor operations, each a
//! dispatch and an allocation, which on SmolLM2's draft cost more than the products.
//!
//! The kernels are the target's host layers' (`model::host`): the fused RMSNorm and SwiGLU row
//! kernels, the packed products, the FlashAttention-style kernel; the Burn path's RMSNorm,
//! softmax and SiLU are plain tensor operations, so the two paths agree to f32 rounding, not
//! bit for bit.

use super::decode::{DecodePacks, Proj};
use super::{DraftKvCache, Eagle3Draft};
use crate::model::{HostNorm, rotate, swap_seq_heads};
use crate::ops::attention::{self, AttentionJob, AttnDims};
use crate::ops::swiglu;
use crate::packed::{self, PackedMatrix};

/// The norms on the host, read once when the Q8_0 blocks are made.
#[derive(Debug, Clone)]
pub(crate) struct HostNorms {
    input: HostNorm,
    hidden: HostNorm,
    post: HostNorm,
    last: HostNorm,
    /// A Qwen3 layer's per-head query and key norms.
    q: Option<HostNorm>,
    k: Option<HostNorm>,
}

impl HostNorms {
    /// `None` when a norm's weight is not f32 (the host path then stands down).
    pub(crate) fn of(draft: &Eagle3Draft) -> Option<Self> {
        let eps = draft.config.llama.rms_norm_eps as f32;
        let norm = |p: &burn::module::Param<burn::tensor::Tensor<1>>| {
            let gamma = p.val().into_data().try_into_vec::<f32>().ok()?;
            Some(HostNorm::new(gamma, eps))
        };
        let head_norm = |p: &Option<burn::module::Param<burn::tensor::Tensor<1>>>| match p {
            Some(p) => norm(p).map(Some),
            None => Some(None),
        };
        Some(Self {
            q: head_norm(&draft.q_norm)?,
            k: head_norm(&draft.k_norm)?,
            input: norm(&draft.input_layernorm)?,
            hidden: norm(&draft.hidden_norm)?,
            post: norm(&draft.post_attention_layernorm)?,
            last: norm(&draft.norm)?,
        })
    }
}

fn pack(packs: &DecodePacks, p: Proj) -> &PackedMatrix {
    packs.matrices[p as usize]
        .as_ref()
        .expect("host decoding only with every projection packed")
}

/// The decoding pass of [`Eagle3Draft::forward_cached`] on the host: `embedded`, `hidden`
/// `[s, d]` (the tokens' embedding rows and the hidden inputs) → the hidden outputs `[s, d]`,
/// the keys and values appended to `cache`.
pub(crate) fn forward_cached(
    draft: &Eagle3Draft,
    (packs, n): (&DecodePacks, &HostNorms),
    embedded: &[f32],
    hidden: &[f32],
    cache: &mut DraftKvCache,
) -> Vec<f32> {
    let c = &draft.config.llama;
    let (h, kv, hd, d) = (
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.hidden_size,
    );
    let s = hidden.len() / d;
    let past = cache.len();
    // cat(RMSNorm(embedding), RMSNorm(hidden)) row by row.
    let simd = kd_kernels::cpu::level();
    let (e, hn) = (n.input.apply(simd, embedded), n.hidden.apply(simd, hidden));
    let mut x = Vec::with_capacity(2 * s * d);
    for (er, hr) in e.chunks_exact(d).zip(hn.chunks_exact(d)) {
        x.extend_from_slice(er);
        x.extend_from_slice(hr);
    }
    let [mut q, mut k, v]: [Vec<f32>; 3] = packed::project_all(
        &[
            pack(packs, Proj::Q),
            pack(packs, Proj::K),
            pack(packs, Proj::V),
        ],
        &x,
        s,
    )
    .try_into()
    .expect("three products");
    // A Qwen3 layer normalises each head (rows of `head_dim`) before RoPE.
    if let Some(norm) = &n.q {
        q = norm.apply(simd, &q);
    }
    if let Some(norm) = &n.k {
        k = norm.apply(simd, &k);
    }
    let positions: Vec<i64> = (past..past + s).map(|p| p as i64).collect();
    let (cos, sin) = draft.rope.host_tables(&positions);
    rotate(&mut q, h, hd, &cos, &sin);
    rotate(&mut k, kv, hd, &cos, &sin);
    // [s, heads, d] → [heads, s, d], the layout of the cache and the attention kernel.
    let (q, k, v) = (
        swap_seq_heads(q, 1, s, h, hd),
        swap_seq_heads(k, 1, s, kv, hd),
        swap_seq_heads(v, 1, s, kv, hd),
    );
    let t = past + s;
    // New position i (absolute past + i) sees keys up to past + i; `true` = masked out.
    let mask = (0..s)
        .flat_map(|i| (0..t).map(move |key| key > past + i))
        .collect();
    let job = AttentionJob::new(mask, 1, s, t, 1.0 / (hd as f32).sqrt())
        .expect("the mask is [1, s, t] and the scale finite");
    let dims = AttnDims {
        b: 1,
        h,
        kv,
        s,
        t,
        d: hd,
    };
    let out = cache.append_host((&k, &v), [kv, s, hd], |ks, vs, stride| {
        attention::forward(&q, (ks, vs, stride), &job, dims).0
    });
    let out = swap_seq_heads(out, 1, h, s, hd);
    let mut x = if draft.config.norm_before_residual {
        hn
    } else {
        hidden.to_vec()
    };
    for (xv, ov) in x.iter_mut().zip(pack(packs, Proj::O).project(&out, s)) {
        *xv += ov;
    }
    let normed = n.post.apply(simd, &x);
    let [gate, up]: [Vec<f32>; 2] = packed::project_all(
        &[pack(packs, Proj::Gate), pack(packs, Proj::Up)],
        &normed,
        s,
    )
    .try_into()
    .expect("two products");
    let mut act = vec![0f32; gate.len()];
    swiglu::swiglu_chunk(simd, &mut act, &gate, &up);
    for (xv, dv) in x.iter_mut().zip(pack(packs, Proj::Down).project(&act, s)) {
        *xv += dv;
    }
    x
}

/// The draft's logits `[s, draft_vocab]` from hidden outputs `[s, d]`: the final norm, then
/// the LM head's blocks.
pub(crate) fn logits((packs, n): (&DecodePacks, &HostNorms), hidden: &[f32]) -> Vec<f32> {
    let (lm_head, normed) = (
        pack(packs, Proj::LmHead),
        n.last.apply(kd_kernels::cpu::level(), hidden),
    );
    lm_head.project(&normed, normed.len() / lm_head.dims()[1])
}

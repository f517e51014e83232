//! How a draft's projections run while it decodes: a few rows at a time, so each product reads
//! its whole weight matrix per drafted token. With [`Eagle3Draft::with_q8_0_weights`] they are
//! read from Q8_0 blocks made once (a quarter of the f32 bytes) by the packed kernels; f32
//! weights, training and prefill take Burn's matmul.

use std::sync::Arc;

use burn::module::Param;
use burn::tensor::{DType, Device, Tensor};

use super::host::HostNorms;
use super::{Eagle3Draft, project};
use crate::packed::{PackedMatrix, packed_project};
use crate::skinny;

/// A projection of the draft.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Proj {
    Fc,
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
    LmHead,
}

const PROJECTIONS: [Proj; 9] = [
    Proj::Fc,
    Proj::Q,
    Proj::K,
    Proj::V,
    Proj::O,
    Proj::Gate,
    Proj::Up,
    Proj::Down,
    Proj::LmHead,
];

/// What decoding reads besides the module: Q8_0 copies of the projections, by [`Proj`]
/// (`None` where the input width is not a multiple of 32), and the norms' weights for the
/// host path.
#[derive(Debug)]
pub(crate) struct Decoding {
    pub(crate) matrices: [Option<PackedMatrix>; 9],
    /// `None` where a norm is not f32.
    pub(crate) norms: Option<HostNorms>,
}

/// Shared by the draft's clones.
pub(crate) type DecodePacks = Arc<Decoding>;

impl Eagle3Draft {
    fn weight(&self, p: Proj) -> &Param<Tensor<2>> {
        match p {
            Proj::Fc => &self.fc,
            Proj::Q => &self.q_proj,
            Proj::K => &self.k_proj,
            Proj::V => &self.v_proj,
            Proj::O => &self.o_proj,
            Proj::Gate => &self.gate_proj,
            Proj::Up => &self.up_proj,
            Proj::Down => &self.down_proj,
            Proj::LmHead => &self.lm_head,
        }
    }

    /// Decoding from Q8_0 blocks of the projection weights (`fc`, q/k/v/o, the MLP and the LM
    /// head), quantised now from the f32 weights as llama.cpp's `quantize_row_q8_0` does: a
    /// quarter of the bytes each drafted token reads, and no longer the f32 arithmetic (each
    /// weight is rounded to 8 bits in blocks of 32; opt in). Training, and passes over more
    /// than a few positions, still read the f32 weights, and so does decoding below AVX2
    /// (`KD_SIMD=scalar`). `on = false` drops the blocks. A
    /// draft whose weights change afterwards must call it again.
    pub fn with_q8_0_weights(mut self, on: bool) -> Self {
        self.packed = on.then(|| {
            Arc::new(Decoding {
                // Weights are held `[in, out]`; blocks run along `in`.
                matrices: PROJECTIONS.map(|p| PackedMatrix::q8_0(self.weight(p).val().transpose())),
                norms: HostNorms::of(&self),
            })
        });
        self
    }

    /// Whether decoding passes of a few positions run on the host (the default: the layer,
    /// its KV cache, attention, the final norm and the LM head on f32 rows through the
    /// target's host kernels, no Burn operation between the products; the two paths agree to
    /// f32 rounding) where they can: Q8_0 blocks of every projection
    /// ([`with_q8_0_weights`](Self::with_q8_0_weights)), AVX2 kernels at the level in use, the
    /// CPU backend, one row of at most 32 positions. `false` keeps them on Burn's operations
    /// (what the tests compare the host path with).
    pub fn with_host_decoding(mut self, on: bool) -> Self {
        self.host_decoding = on;
        self
    }

    /// The blocks the host path reads for a pass of `rows` positions of `batch` rows, when
    /// it applies ([`with_host_decoding`](Self::with_host_decoding)).
    pub(crate) fn host_packs(
        &self,
        batch: usize,
        rows: usize,
        x: &Tensor<3>,
    ) -> Option<(&DecodePacks, &HostNorms)> {
        let packs = self.packed.as_ref()?;
        let norms = packs.norms.as_ref()?;
        let applies = self.host_decoding
            && batch == 1
            && rows <= skinny::MAX_ROWS
            && skinny::avx2()
            && !x.is_autodiff()
            && x.dtype() == DType::F32
            && x.device() == Device::flex()
            && packs.matrices.iter().all(Option::is_some);
        applies.then_some((packs, norms))
    }

    /// Whether decoding reads Q8_0 blocks ([`with_q8_0_weights`](Self::with_q8_0_weights)).
    pub fn has_q8_0_weights(&self) -> bool {
        self.packed.is_some()
    }

    /// `x · W` for projection `p`: in decoding (`decode`, a few rows on the CPU backend without
    /// autodiff) from the Q8_0 blocks when there are any; otherwise Burn's matmul. (The skinny
    /// f32 kernel, which reads `[in, out]` column by column, measured 3–4× slower than Burn's
    /// matmul on these shapes: 45.8 against 11–18 ms per verification round on SmolLM2.)
    pub(crate) fn proj(&self, x: Tensor<3>, p: Proj, decode: bool) -> Tensor<3> {
        let weight = self.weight(p);
        let [b, s, i] = x.dims();
        if decode
            && let Some(m) = self
                .packed
                .as_ref()
                .and_then(|m| m.matrices[p as usize].as_ref())
        {
            let flat = x.clone().reshape([b * s, i]);
            let w = weight.val();
            if skinny::applies(&flat, &w) {
                let out = w.dims()[1];
                return packed_project(m, flat).reshape([b, s, out]);
            }
        }
        project(x, weight)
    }
}

//! The ends of the model: token embeddings (from a lean model's blocks when its f32 copy is
//! not made) and the LM head (the tied embedding, an untied head, or their blocks).

use burn::module::{Module, Param};
use burn::tensor::module::linear;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use super::Llama;
use crate::batch::TokenBatch;
use crate::skinny;

impl Llama {
    /// The embedding's device, dtype and whether it is an autodiff tensor, read without
    /// making a lean model's lazy embedding (f32 on its device by construction).
    pub(super) fn embedding_meta(&self) -> (Device, DType, bool) {
        let w = &self.embed_tokens.weight;
        if w.is_initialized() {
            let w = w.val();
            (w.device(), w.dtype(), w.is_autodiff())
        } else {
            (w.lazy_device(), DType::F32, false)
        }
    }

    /// Token embeddings `[b, s, hidden]` of `ids`: a lean model whose tied embedding is held
    /// in blocks (and has no f32 copy made) reads each token's row from them, the same values
    /// the f32 copy holds.
    pub(super) fn embed(&self, batch: &TokenBatch, device: &Device) -> Tensor<3> {
        let (b, s) = (batch.batch_size(), batch.seq_len());
        if let Some(packed) = self.packed.as_ref()
            && packed.lean
            && self.lm_head.is_none()
            && let Some(head) = packed.head.as_ref()
            && !self.embed_tokens.weight.is_initialized()
        {
            let rows: Vec<usize> = batch.ids().iter().map(|id| *id as usize).collect();
            let d = head.dims()[1];
            return Tensor::from_data(
                TensorData::new(head.dequantize_rows(&rows), [b, s, d]),
                device,
            );
        }
        let ids = Tensor::<2, Int>::from_data(
            TensorData::new(batch.ids().iter().map(|i| *i as i64).collect(), [b, s]),
            device,
        );
        self.embed_tokens.forward(ids)
    }

    /// The LM head's parameter (the embedding's when tied), not read.
    pub(crate) fn head_param(&self) -> &Param<Tensor<2>> {
        match &self.lm_head {
            Some(head) => &head.weight,
            None => &self.embed_tokens.weight,
        }
    }

    /// The LM head's weight `[vocab, hidden]` (the embedding matrix when tied), for losses
    /// that fuse the head with the loss (`kd_loss::linear_cross_entropy`).
    pub fn lm_head_weight(&self) -> Tensor<2> {
        match &self.lm_head {
            Some(head) => head.weight.val(),
            None => self.embed_tokens.weight.val(),
        }
    }

    /// Rows `rows` of the LM head (the embedding's when tied) as f32 `[rows, hidden]`, read
    /// from a lean model's blocks when its f32 copy is not made (the values that copy holds).
    ///
    /// # Panics
    /// If a row is not below the vocabulary size.
    pub fn lm_head_rows(&self, rows: &[usize]) -> TensorData {
        if let Some(packed) = self.packed.as_ref()
            && let Some(head) = packed.head.as_ref()
            && !self.head_param().is_initialized()
        {
            let d = head.dims()[1];
            return TensorData::new(head.dequantize_rows(rows), [rows.len(), d]);
        }
        let weight = self.lm_head_weight();
        let ids: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
        let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [rows.len()]), &weight.device());
        weight.select(0, ids).into_data().convert::<f32>()
    }

    /// Applies the LM head (or the tied embedding) to hidden states `[batch, seq, hidden]`.
    pub fn lm_head_forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, s, d] = x.dims();
        let flat = x.clone().reshape([b * s, d]);
        // Decoding: a few rows against the vocabulary matrix's blocks. A lean model reads
        // them for any number of rows, and decides without making its f32 weight.
        if let Some(packed) = self.packed.as_ref()
            && let Some(head) = packed.head.as_ref()
        {
            let applies = if packed.lean {
                skinny::applies_to_input(&flat, usize::MAX) && !trains(self.head_param())
            } else {
                skinny::applies(&flat, &self.lm_head_weight())
            };
            if applies {
                let y = crate::packed::packed_project(head, flat);
                return y.reshape([b, s, head.dims()[0]]);
            }
        }
        let weight = self.lm_head_weight();
        // A general GEMM would repack the whole matrix on every call.
        if skinny::applies(&flat, &weight) {
            let y = skinny::skinny_matmul_t(flat, weight);
            let v = y.dims()[1];
            return y.reshape([b, s, v]);
        }
        linear(x, weight.transpose(), None)
    }
}

/// Whether `weight` takes part in training (autodiff with a gradient); a lazy weight not made
/// yet does not (and is not made to tell).
pub(crate) fn trains(weight: &Param<Tensor<2>>) -> bool {
    weight.is_initialized() && weight.is_require_grad()
}

/// The untied LM head, stored as checkpoints store it: `[vocab, hidden]`.
#[derive(Module, Debug)]
pub struct LmHead {
    /// `lm_head.weight`, `[vocab, hidden]`.
    pub weight: Param<Tensor<2>>,
}

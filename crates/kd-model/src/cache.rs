//! The key/value cache for incremental decoding of a padded batch.

use burn::tensor::{Int, Tensor, TensorData};

use crate::error::{ModelError, Result};

/// Keys and values of every layer for the tokens seen so far, plus which of those tokens are
/// real (not padding) in each row.
///
/// Rows may hold different numbers of real tokens (prompts of different lengths, left-padded);
/// padding keys are masked out of attention, and positions count real tokens only, so each
/// row decodes as it would alone.
#[derive(Debug, Clone)]
pub struct KvCache {
    /// Per layer: keys and values `[batch, kv_heads, len, head_dim]`.
    layers: Vec<Option<(Tensor<4>, Tensor<4>)>>,
    /// Per row: which cached tokens are real.
    valid: Vec<Vec<bool>>,
    /// Per row: number of real tokens cached (the next real token's position).
    real_len: Vec<i64>,
}

impl KvCache {
    /// An empty cache for a model with `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            valid: Vec::new(),
            real_len: Vec::new(),
        }
    }

    /// Number of cached token slots per row (padding included).
    pub fn len(&self) -> usize {
        self.valid.first().map_or(0, Vec::len)
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of rows, once something is cached.
    pub fn batch_size(&self) -> Option<usize> {
        (!self.valid.is_empty()).then_some(self.valid.len())
    }

    /// Number of real (non-padding) tokens cached in each row.
    pub fn real_lengths(&self) -> &[i64] {
        &self.real_len
    }

    /// Keeps only the given rows, in the given order (rows that finished generating can be
    /// dropped so that later steps cost less).
    pub fn retain_rows(&mut self, rows: &[usize]) -> Result<()> {
        let batch = self.valid.len();
        if let Some(bad) = rows.iter().find(|r| **r >= batch) {
            return Err(ModelError::Input(format!(
                "row {bad} is out of range for a cache of {batch} rows"
            )));
        }
        for (k, v) in self.layers.iter_mut().flatten() {
            let device = k.device();
            let idx = Tensor::<1, Int>::from_data(
                TensorData::new(rows.iter().map(|r| *r as i64).collect(), [rows.len()]),
                &device,
            );
            *k = k.clone().select(0, idx.clone());
            *v = v.clone().select(0, idx);
        }
        self.valid = rows.iter().map(|r| self.valid[*r].clone()).collect();
        self.real_len = rows.iter().map(|r| self.real_len[*r]).collect();
        Ok(())
    }

    /// Rolls each row back to its first `real_len[row]` real tokens (speculative decoding
    /// drops the rejected drafts): later real slots are masked out, and trailing slots no row
    /// needs any more are freed. A row then continues exactly as if the dropped tokens had
    /// never been fed.
    pub fn truncate(&mut self, real_len: &[i64]) -> Result<()> {
        let batch = self.valid.len();
        if real_len.len() != batch {
            return Err(ModelError::Input(format!(
                "{} lengths to roll back a cache of {batch} rows",
                real_len.len()
            )));
        }
        let mut keep = 0;
        for (row, (valid, &want)) in self.valid.iter_mut().zip(real_len).enumerate() {
            let have = self.real_len[row];
            if want < 0 || want > have {
                return Err(ModelError::Input(format!(
                    "row {row} holds {have} real tokens and cannot be rolled back to {want}"
                )));
            }
            let mut seen = 0;
            for (slot, v) in valid.iter_mut().enumerate() {
                if *v {
                    if seen < want {
                        keep = keep.max(slot + 1);
                    } else {
                        *v = false;
                    }
                    seen += 1;
                }
            }
            self.real_len[row] = want;
        }
        if keep < self.len() {
            for v in &mut self.valid {
                v.truncate(keep);
            }
            for layer in &mut self.layers {
                if let Some((k, v)) = layer.take()
                    && keep > 0
                {
                    let [b, h, _, d] = k.dims();
                    let range = [0..b, 0..h, 0..keep, 0..d];
                    *layer = Some((k.slice(range.clone()), v.slice(range)));
                }
            }
        }
        Ok(())
    }

    pub(crate) fn check_batch(&self, batch: usize) -> Result<()> {
        match self.batch_size() {
            Some(b) if b != batch => Err(ModelError::Input(format!(
                "the cache holds {b} rows but the batch has {batch}"
            ))),
            _ => Ok(()),
        }
    }

    pub(crate) fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Records the new tokens' mask (`[batch, seq]`, row-major) after a forward pass.
    pub(crate) fn push_mask(&mut self, batch: usize, seq: usize, mask: &[bool]) {
        if self.valid.is_empty() {
            self.valid = vec![Vec::new(); batch];
            self.real_len = vec![0; batch];
        }
        for b in 0..batch {
            let row = &mask[b * seq..(b + 1) * seq];
            self.valid[b].extend_from_slice(row);
            self.real_len[b] += row.iter().filter(|m| **m).count() as i64;
        }
    }

    pub(crate) fn valid_rows(&self) -> &[Vec<bool>] {
        &self.valid
    }

    /// Appends this step's keys/values of one layer and returns the whole sequence's.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: Tensor<4>,
        v: Tensor<4>,
    ) -> (Tensor<4>, Tensor<4>) {
        let (k, v) = match self.layers[layer].take() {
            Some((pk, pv)) => (Tensor::cat(vec![pk, k], 2), Tensor::cat(vec![pv, v], 2)),
            None => (k, v),
        };
        self.layers[layer] = Some((k.clone(), v.clone()));
        (k, v)
    }
}

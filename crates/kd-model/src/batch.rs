//! Host-side inputs of a forward pass: token ids, attention mask and positions of a padded
//! batch, and the options saying what to return.

use crate::error::{ModelError, Result};

/// Where padding goes when rows of different lengths are batched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PaddingSide {
    /// Pad at the end (training).
    #[default]
    Right,
    /// Pad at the start (batched generation: every row's last token is at the same index).
    Left,
}

/// A padded batch of token ids, row-major `[batch, seq]`, with its attention mask and
/// position ids.
///
/// Positions default to "number of real tokens before this one in the row" (padding takes
/// position 0), which is what Hugging Face's `generate` derives from the attention mask;
/// a left-padded row therefore gets the same positions as the row alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBatch {
    batch: usize,
    seq: usize,
    ids: Vec<u32>,
    mask: Vec<bool>,
    positions: Option<Vec<i64>>,
    segments: Option<Vec<u32>>,
}

impl TokenBatch {
    /// A batch from explicit `[batch, seq]` data. `mask[i]` is `true` for real tokens.
    pub fn new(batch: usize, seq: usize, ids: Vec<u32>, mask: Vec<bool>) -> Result<Self> {
        let n = batch * seq;
        if ids.len() != n || mask.len() != n {
            return Err(ModelError::Input(format!(
                "a [{batch}, {seq}] batch needs {n} ids and {n} mask values, got {} and {}",
                ids.len(),
                mask.len()
            )));
        }
        Ok(Self {
            batch,
            seq,
            ids,
            mask,
            positions: None,
            segments: None,
        })
    }

    /// A batch of one unpadded row.
    pub fn single(ids: &[u32]) -> Self {
        Self {
            batch: 1,
            seq: ids.len(),
            ids: ids.to_vec(),
            mask: vec![true; ids.len()],
            positions: None,
            segments: None,
        }
    }

    /// Pads rows of different lengths to the longest with `pad_id` on the given side.
    pub fn from_rows(rows: &[Vec<u32>], pad_id: u32, side: PaddingSide) -> Self {
        let batch = rows.len();
        let seq = rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(batch * seq);
        let mut mask = Vec::with_capacity(batch * seq);
        for row in rows {
            let pad = seq - row.len();
            if side == PaddingSide::Left {
                ids.extend(std::iter::repeat_n(pad_id, pad));
                mask.extend(std::iter::repeat_n(false, pad));
            }
            ids.extend_from_slice(row);
            mask.extend(std::iter::repeat_n(true, row.len()));
            if side == PaddingSide::Right {
                ids.extend(std::iter::repeat_n(pad_id, pad));
                mask.extend(std::iter::repeat_n(false, pad));
            }
        }
        Self {
            batch,
            seq,
            ids,
            mask,
            positions: None,
            segments: None,
        }
    }

    /// Marks packed sequences: tokens attend only to earlier tokens of the same segment
    /// (row-major `[batch, seq]`, e.g. kd-data's `sequence_ids`). Full forward passes only.
    pub fn with_segments(mut self, segments: Vec<u32>) -> Result<Self> {
        if segments.len() != self.ids.len() {
            return Err(ModelError::Input(format!(
                "{} segment ids for a [{}, {}] batch",
                segments.len(),
                self.batch,
                self.seq
            )));
        }
        self.segments = Some(segments);
        Ok(self)
    }

    /// Segment ids, if the batch is packed.
    pub fn segments(&self) -> Option<&[u32]> {
        self.segments.as_deref()
    }

    /// Sets explicit position ids, row-major `[batch, seq]`.
    pub fn with_positions(mut self, positions: Vec<i64>) -> Result<Self> {
        if positions.len() != self.ids.len() {
            return Err(ModelError::Input(format!(
                "{} position ids for a [{}, {}] batch",
                positions.len(),
                self.batch,
                self.seq
            )));
        }
        if let Some(p) = positions.iter().find(|p| **p < 0) {
            return Err(ModelError::Input(format!("negative position id {p}")));
        }
        self.positions = Some(positions);
        Ok(self)
    }

    /// Number of rows.
    pub fn batch_size(&self) -> usize {
        self.batch
    }

    /// Padded length of the rows.
    pub fn seq_len(&self) -> usize {
        self.seq
    }

    /// The token ids, row-major.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The attention mask, row-major (`true` = real token).
    pub fn mask(&self) -> &[bool] {
        &self.mask
    }

    /// Explicit position ids, if set.
    pub fn positions(&self) -> Option<&[i64]> {
        self.positions.as_deref()
    }

    /// The position ids used for this batch when it follows `past` cached tokens per row
    /// (`past[b]` real tokens already seen by row b).
    pub(crate) fn resolved_positions(&self, past_real: &[i64]) -> Vec<i64> {
        if let Some(p) = &self.positions {
            return p.clone();
        }
        let mut out = Vec::with_capacity(self.ids.len());
        for b in 0..self.batch {
            let mut next = past_real.get(b).copied().unwrap_or(0);
            for s in 0..self.seq {
                if self.mask[b * self.seq + s] {
                    out.push(next);
                    next += 1;
                } else {
                    out.push(0);
                }
            }
        }
        out
    }
}

/// Which hidden states a forward pass returns, indexed as Hugging Face's
/// `output_hidden_states`: 0 = the embeddings, i = the output of layer i, and
/// `num_hidden_layers` = the output of the last layer after the final norm.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum HiddenStates {
    /// None.
    #[default]
    None,
    /// All `num_hidden_layers + 1` of them.
    All,
    /// The listed indices, in the order given.
    Layers(Vec<usize>),
}

/// What a forward pass computes besides running the layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardOptions {
    /// Compute logits (`false` saves the LM head when only hidden states are needed).
    pub logits: bool,
    /// Compute logits only for the last `n` positions of each row (`Some(1)` while decoding,
    /// `Some(k + 1)` to verify k drafted tokens); `None` = every position.
    pub last_positions: Option<usize>,
    /// Hidden states to return.
    pub hidden_states: HiddenStates,
    /// Training: the seed LoRA dropout masks are derived from (`None` = no dropout, as in
    /// evaluation). The trainer derives it from (run seed, step, micro-batch).
    pub dropout_seed: Option<u64>,
}

impl Default for ForwardOptions {
    fn default() -> Self {
        Self {
            logits: true,
            last_positions: None,
            hidden_states: HiddenStates::None,
            dropout_seed: None,
        }
    }
}

impl ForwardOptions {
    /// Logits of the last `n` positions of each row only.
    pub fn last_positions(n: usize) -> Self {
        Self {
            last_positions: Some(n),
            ..Self::default()
        }
    }

    /// Logits and the given hidden states.
    pub fn with_hidden_states(hidden_states: HiddenStates) -> Self {
        Self {
            hidden_states,
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn left_padding_gives_row_alone_positions() {
        let b = TokenBatch::from_rows(&[vec![5, 6, 7], vec![8]], 0, PaddingSide::Left);
        assert_eq!(b.ids(), &[5, 6, 7, 0, 0, 8]);
        assert_eq!(b.mask(), &[true, true, true, false, false, true]);
        assert_eq!(b.resolved_positions(&[0, 0]), vec![0, 1, 2, 0, 0, 0]);
        assert_eq!(b.resolved_positions(&[4, 9]), vec![4, 5, 6, 0, 0, 9]);
    }

    #[test]
    fn right_padding_and_errors() {
        let b = TokenBatch::from_rows(&[vec![1], vec![2, 3]], 9, PaddingSide::Right);
        assert_eq!(b.ids(), &[1, 9, 2, 3]);
        assert_eq!(b.resolved_positions(&[]), vec![0, 0, 0, 1]);
        assert!(TokenBatch::new(2, 2, vec![1, 2, 3], vec![true; 4]).is_err());
        assert!(b.clone().with_positions(vec![0, 1, 2]).is_err());
        assert!(b.with_positions(vec![0, -1, 0, 1]).is_err());
    }
}

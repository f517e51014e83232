//! The draft vocabulary of an EAGLE-3 draft and SpecForge's rule for choosing it.

use crate::error::{ModelError, Result};

/// The draft vocabulary: which target token each draft token stands for.
///
/// SpecForge stores it as `d2t` (draft id `i` ↔ target id `i + d2t[i]`) and `t2d` (a mask over
/// the target vocabulary); the draft's ids are the chosen target ids in ascending order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftVocab {
    /// Target id of each draft id, ascending.
    targets: Vec<u32>,
    /// Size of the target vocabulary.
    target_vocab: usize,
}

impl DraftVocab {
    /// SpecForge's rule (`process_token_dict_to_mappings`) over token counts (`counts[id]` =
    /// how often target token `id` occurs in the training completions): the `size` most
    /// frequent, ties to the lower id; when fewer than `size` tokens occur, the smallest ids
    /// below `size` that did not occur fill the rest.
    pub fn from_counts(counts: &[u64], size: usize) -> Result<Self> {
        if size == 0 || size > counts.len() {
            return Err(ModelError::Input(format!(
                "draft vocabulary of {size} tokens over a target vocabulary of {}: expected 1 \
                 to {}",
                counts.len(),
                counts.len()
            )));
        }
        let mut present: Vec<usize> = (0..counts.len()).filter(|&i| counts[i] > 0).collect();
        let mut chosen: Vec<usize> = if present.len() >= size {
            // Count descending; a stable sort keeps ties in id order.
            present.sort_by(|a, b| counts[*b].cmp(&counts[*a]));
            present.truncate(size);
            present
        } else {
            let missing = (0..size).filter(|i| counts[*i] == 0);
            let need = size - present.len();
            present.extend(missing.take(need));
            present
        };
        chosen.sort_unstable();
        Ok(Self {
            targets: chosen.into_iter().map(|i| i as u32).collect(),
            target_vocab: counts.len(),
        })
    }

    /// From SpecForge's `d2t` offsets over a target vocabulary of `target_vocab` tokens.
    pub fn from_d2t(d2t: &[i64], target_vocab: usize) -> Result<Self> {
        let mut targets = Vec::with_capacity(d2t.len());
        for (i, offset) in d2t.iter().enumerate() {
            let t = i as i64 + offset;
            if t < 0 || t as usize >= target_vocab || targets.last().is_some_and(|&p| p >= t) {
                return Err(ModelError::Input(format!(
                    "d2t[{i}] = {offset} maps draft id {i} to target id {t}: expected strictly \
                     increasing target ids below {target_vocab}"
                )));
            }
            targets.push(t);
        }
        Ok(Self {
            targets: targets.into_iter().map(|t| t as u32).collect(),
            target_vocab,
        })
    }

    /// Tokens in the draft vocabulary.
    pub fn len(&self) -> usize {
        self.targets.len()
    }

    /// Whether the draft vocabulary is empty (never, once built).
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// Size of the target vocabulary.
    pub fn target_vocab(&self) -> usize {
        self.target_vocab
    }

    /// The target id of draft id `draft` (`draft < len()`).
    pub fn target_id(&self, draft: usize) -> u32 {
        self.targets[draft]
    }

    /// The target ids, in draft-id order (ascending).
    pub fn target_ids(&self) -> &[u32] {
        &self.targets
    }

    /// SpecForge's `d2t`: `target_id(i) − i`.
    pub fn d2t(&self) -> Vec<i64> {
        self.targets
            .iter()
            .enumerate()
            .map(|(i, &t)| t as i64 - i as i64)
            .collect()
    }

    /// SpecForge's `t2d`: whether each target id is in the draft vocabulary.
    pub fn t2d(&self) -> Vec<bool> {
        let mut mask = vec![false; self.target_vocab];
        for &t in &self.targets {
            mask[t as usize] = true;
        }
        mask
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocab_rule_ties_and_padding() {
        // Ties at the cut go to the lower id; chosen ids come back ascending.
        let v = DraftVocab::from_counts(&[5, 1, 3, 3, 0, 3], 3).unwrap();
        assert_eq!(v.target_ids(), &[0, 2, 3]);
        assert_eq!(v.d2t(), vec![0, 1, 1]);
        assert_eq!(v.t2d(), vec![true, false, true, true, false, false]);
        // Fewer tokens seen than the size: the smallest unseen ids below the size fill in.
        let v = DraftVocab::from_counts(&[0, 0, 7, 0, 0, 9], 4).unwrap();
        assert_eq!(v.target_ids(), &[0, 1, 2, 5]);
        assert_eq!(DraftVocab::from_d2t(&v.d2t(), 6).unwrap(), v);
        assert!(DraftVocab::from_counts(&[1, 2], 3).is_err());
        assert!(DraftVocab::from_d2t(&[0, -1], 4).is_err());
        assert!(DraftVocab::from_d2t(&[0, 5], 4).is_err());
    }
}

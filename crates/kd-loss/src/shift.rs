//! The next-token shift shared by CE and KD: logits at position t are compared where
//! `labels[t + 1]` counts (`docs/src/loss-contract.md`; ROLL compares unshifted positions for KD,
//! a quirk we do not copy).

/// Per-row targets and mask of `[batch, seq]` logits flattened to `[batch · seq, vocab]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextTokenTargets {
    /// `labels[b, t + 1]`, or −100 where it does not count (and at t = seq − 1).
    pub targets: Vec<i64>,
    /// `targets != −100`: the rows KD compares.
    pub mask: Vec<bool>,
    /// Number of counted rows (the local token count; sum it over micro-batches and devices
    /// for the normaliser).
    pub count: usize,
}

pub use kd_kernels::IGNORE_INDEX;

/// Shifts `labels` (`[batch, seq]`, row-major, −100 = ignored) so that row `b · seq + t` of
/// the flattened logits predicts `labels[b, t + 1]`. No slicing of the logits is needed: the
/// last position of each sequence simply does not count.
pub fn next_token_targets(labels: &[i64], batch: usize, seq: usize) -> NextTokenTargets {
    assert_eq!(labels.len(), batch * seq, "labels must be [batch, seq]");
    let mut targets = Vec::with_capacity(labels.len());
    for b in 0..batch {
        for t in 0..seq {
            let next = if t + 1 < seq {
                labels[b * seq + t + 1]
            } else {
                IGNORE_INDEX
            };
            targets.push(if next < 0 { IGNORE_INDEX } else { next });
        }
    }
    let mask: Vec<bool> = targets.iter().map(|t| *t >= 0).collect();
    let count = mask.iter().filter(|m| **m).count();
    NextTokenTargets {
        targets,
        mask,
        count,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shift() {
        // prompt (ignored), two answer tokens, padding.
        let labels = [-100, -100, 7, 8, -100, -100, 5, 6, 9, 4];
        let s = next_token_targets(&labels, 2, 5);
        assert_eq!(s.targets, vec![-100, 7, 8, -100, -100, 5, 6, 9, 4, -100]);
        assert_eq!(s.count, 6);
        assert!(s.mask[1]);
        assert!(!s.mask[4]);
    }
}

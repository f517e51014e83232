//! Batches: length-bucketed plans (deterministic for a seed and epoch), padding to the
//! longest row, and optional packing of several sequences into one row.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::tokenize::{Example, IGNORE_INDEX};

/// How examples are grouped into batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BatchOptions {
    /// Rows per batch.
    pub batch_size: usize,
    /// Group examples of similar length (less padding); batches are then shuffled.
    pub bucket_by_length: bool,
    /// Examples per length bucket, in batches (a bucket is sorted, then cut into batches).
    pub bucket_batches: usize,
    /// Shuffle examples (and batches) each epoch.
    pub shuffle: bool,
    /// Seed of the shuffles (combined with the epoch).
    pub seed: u64,
    /// Drop a last, smaller batch.
    pub drop_last: bool,
    /// Pack several examples into each row of `max_seq_length` tokens.
    pub pack: bool,
    /// Row length when packing.
    pub max_seq_length: usize,
}

impl Default for BatchOptions {
    fn default() -> Self {
        Self {
            batch_size: 4,
            bucket_by_length: true,
            bucket_batches: 50,
            shuffle: true,
            seed: 42,
            drop_last: false,
            pack: false,
            max_seq_length: 2048,
        }
    }
}

/// Which examples go into which row of which batch, for one epoch: `plan[b][r]` lists the
/// example indices of row r of batch b (one per row unless packing).
pub type BatchPlan = Vec<Vec<Vec<usize>>>;

/// The batch plan of an epoch; the same (lengths, options, epoch) always give the same plan,
/// which is what exact resume relies on.
pub fn plan_batches(lengths: &[usize], options: &BatchOptions, epoch: u64) -> BatchPlan {
    let mut rng =
        ChaCha8Rng::seed_from_u64(options.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    if options.shuffle {
        order.shuffle(&mut rng);
    }
    let rows: Vec<Vec<usize>> = if options.pack {
        pack_rows(&order, lengths, options.max_seq_length)
    } else {
        order.into_iter().map(|i| vec![i]).collect()
    };
    let row_len = |r: &Vec<usize>| r.iter().map(|i| lengths[*i]).sum::<usize>();
    let bs = options.batch_size.max(1);
    let mut batches: Vec<Vec<Vec<usize>>> = Vec::new();
    if options.bucket_by_length && !options.pack {
        let bucket = bs * options.bucket_batches.max(1);
        for chunk in rows.chunks(bucket) {
            let mut sorted = chunk.to_vec();
            sorted.sort_by_key(|r| std::cmp::Reverse(row_len(r)));
            batches.extend(sorted.chunks(bs).map(<[Vec<usize>]>::to_vec));
        }
    } else {
        batches.extend(rows.chunks(bs).map(<[Vec<usize>]>::to_vec));
    }
    if options.drop_last {
        batches.retain(|b| b.len() == bs);
    }
    if options.shuffle && options.bucket_by_length {
        batches.shuffle(&mut rng);
    }
    batches
}

/// Greedy packing in the given order: each row takes examples while they fit. An example
/// longer than a row gets a row of its own (the collator cuts it).
fn pack_rows(order: &[usize], lengths: &[usize], max_len: usize) -> Vec<Vec<usize>> {
    let mut rows: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut used = 0;
    for &i in order {
        let n = lengths[i];
        if !current.is_empty() && used + n > max_len {
            rows.push(std::mem::take(&mut current));
            used = 0;
        }
        current.push(i);
        used += n;
    }
    if !current.is_empty() {
        rows.push(current);
    }
    rows
}

/// A padded batch, row-major `[batch, seq]`, as plain vectors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// Rows.
    pub batch_size: usize,
    /// Padded row length.
    pub seq_len: usize,
    /// Token ids (padding = `pad_id`).
    pub input_ids: Vec<u32>,
    /// `true` on real tokens.
    pub attention_mask: Vec<bool>,
    /// Labels (−100 on prompts, padding and the first token of each packed sequence).
    pub labels: Vec<i64>,
    /// Position ids, restarting at 0 for each packed sequence (0 on padding).
    pub position_ids: Vec<i64>,
    /// Sequence number within the row (1, 2, … for packed sequences; 0 on padding): tokens
    /// attend only within their sequence.
    pub sequence_ids: Vec<u32>,
    /// The example indices of each row.
    pub examples: Vec<Vec<usize>>,
}

impl Batch {
    /// Number of label tokens that count after the next-token shift (label at t + 1 != −100).
    pub fn label_tokens(&self) -> usize {
        let s = self.seq_len;
        (0..self.batch_size)
            .map(|b| {
                (1..s)
                    .filter(|t| self.labels[b * s + t] != IGNORE_INDEX)
                    .count()
            })
            .sum()
    }

    /// Whether any row holds more than one sequence.
    pub fn is_packed(&self) -> bool {
        self.examples.iter().any(|r| r.len() > 1)
    }
}

/// Builds the batch of one plan entry: rows padded on the right with `pad_id` to the longest
/// row (cut to `max_len`).
pub fn collate(examples: &[Example], rows: &[Vec<usize>], pad_id: u32, max_len: usize) -> Batch {
    let row_tokens: Vec<usize> = rows
        .iter()
        .map(|r| {
            r.iter()
                .map(|i| examples[*i].len())
                .sum::<usize>()
                .min(max_len)
        })
        .collect();
    let seq_len = row_tokens.iter().copied().max().unwrap_or(0);
    let n = rows.len() * seq_len;
    let mut batch = Batch {
        batch_size: rows.len(),
        seq_len,
        input_ids: vec![pad_id; n],
        attention_mask: vec![false; n],
        labels: vec![IGNORE_INDEX; n],
        position_ids: vec![0; n],
        sequence_ids: vec![0; n],
        examples: rows.to_vec(),
    };
    for (r, row) in rows.iter().enumerate() {
        let mut t = 0;
        for (k, &i) in row.iter().enumerate() {
            let e = &examples[i];
            for (pos, (id, label)) in e.input_ids.iter().zip(&e.labels).enumerate() {
                if t >= seq_len {
                    break;
                }
                let at = r * seq_len + t;
                batch.input_ids[at] = *id;
                batch.attention_mask[at] = true;
                // The first token of a packed sequence must not be learned from the previous
                // sequence's last position.
                batch.labels[at] = if pos == 0 && k > 0 {
                    IGNORE_INDEX
                } else {
                    *label
                };
                batch.position_ids[at] = pos as i64;
                batch.sequence_ids[at] = k as u32 + 1;
                t += 1;
            }
        }
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(n: usize, first: u32) -> Example {
        Example {
            id: format!("e{first}"),
            input_ids: (first..first + n as u32).collect(),
            labels: (0..n)
                .map(|i| {
                    if i < 1 {
                        -100
                    } else {
                        (first + i as u32) as i64
                    }
                })
                .collect(),
            prompt_len: 1,
        }
    }

    #[test]
    fn plans_are_deterministic_and_cover_everything() {
        let lengths: Vec<usize> = (0..103).map(|i| 5 + (i * 37) % 50).collect();
        let opts = BatchOptions {
            batch_size: 4,
            bucket_batches: 3,
            ..BatchOptions::default()
        };
        let a = plan_batches(&lengths, &opts, 0);
        assert_eq!(a, plan_batches(&lengths, &opts, 0));
        assert_ne!(a, plan_batches(&lengths, &opts, 1));
        let mut seen: Vec<usize> = a.iter().flatten().flatten().copied().collect();
        seen.sort();
        assert_eq!(seen, (0..103).collect::<Vec<_>>());
        // Within a batch, lengths are close (sorted buckets).
        let spread: usize = a
            .iter()
            .map(|b| {
                let l: Vec<usize> = b.iter().map(|r| lengths[r[0]]).collect();
                l.iter().max().unwrap() - l.iter().min().unwrap()
            })
            .max()
            .unwrap();
        assert!(spread < 25, "{spread}");
        let dropped = plan_batches(
            &lengths,
            &BatchOptions {
                drop_last: true,
                ..opts
            },
            0,
        );
        assert!(dropped.iter().all(|b| b.len() == 4));
    }

    #[test]
    fn collate_pads_right_and_masks_by_position() {
        let examples = vec![ex(3, 10), ex(5, 20)];
        let b = collate(&examples, &[vec![0], vec![1]], 0, 100);
        assert_eq!(b.seq_len, 5);
        assert_eq!(&b.input_ids[..5], &[10, 11, 12, 0, 0]);
        assert_eq!(&b.attention_mask[..5], &[true, true, true, false, false]);
        assert_eq!(&b.labels[..5], &[-100, 11, 12, -100, -100]);
        assert_eq!(&b.position_ids[5..], &[0, 1, 2, 3, 4]);
        assert_eq!(b.label_tokens(), 2 + 4);
    }

    #[test]
    fn packing_restarts_positions_and_separates_sequences() {
        let mut examples = vec![ex(3, 10), ex(2, 20), ex(4, 30)];
        // As with train_on_prompt: the first token carries a label of its own.
        examples[1].labels[0] = 20;
        let lengths: Vec<usize> = examples.iter().map(Example::len).collect();
        let opts = BatchOptions {
            pack: true,
            max_seq_length: 6,
            shuffle: false,
            batch_size: 8,
            ..BatchOptions::default()
        };
        let plan = plan_batches(&lengths, &opts, 0);
        assert_eq!(plan, vec![vec![vec![0, 1], vec![2]]]);
        let b = collate(&examples, &plan[0], 0, 6);
        assert!(b.is_packed());
        assert_eq!(&b.input_ids[..5], &[10, 11, 12, 20, 21]);
        assert_eq!(&b.position_ids[..5], &[0, 1, 2, 0, 1]);
        assert_eq!(&b.sequence_ids[..5], &[1, 1, 1, 2, 2]);
        // The second sequence's first token is not a target of the first sequence.
        assert_eq!(&b.labels[..5], &[-100, 11, 12, -100, 21]);
    }
}

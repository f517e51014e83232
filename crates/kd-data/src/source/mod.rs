//! Record sources: OpenAI batch prompts, question/answer sets, plain text; the bad-record
//! policy; deterministic sampling.

mod completion;
mod openai;
mod qa;
pub mod reader;
mod text;

use std::collections::BTreeMap;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

pub use completion::PromptCompletion;
pub use openai::{OpenAiBatchSource, PromptRecord, find_batch_files};
pub use qa::{QaKeys, QaRecord, QaSource};
pub use reader::{Location, RawRecord, RawRecords, get_path};
pub use text::{TextRecord, TextSource};

use crate::error::{DataError, Result};

/// One chat message (content already flattened to text).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message with the given role and text.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// What to do with a malformed record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BadRecordPolicy {
    /// Stop with an error naming file, line and reason.
    #[default]
    Error,
    /// Skip it and count it by reason.
    Skip,
}

/// Why a record was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BadRecordKind {
    /// Not valid JSON.
    InvalidJson,
    /// Not valid UTF-8.
    InvalidUtf8,
    /// No `body.messages` (or an empty list).
    NoMessages,
    /// No user turn to prompt with.
    NoUserTurn,
    /// A user turn with no text.
    EmptyPrompt,
    /// A message role the chat format does not know.
    UnknownRole,
    /// The text to learn from is empty.
    EmptyText,
    /// A required key is absent.
    MissingKey,
    /// A field has the wrong JSON type.
    WrongType,
    /// Content parts that are not text (images, audio).
    NonTextPart,
}

/// A rejected record: the kind and a human-readable detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRecord {
    /// The kind (the skip counters are keyed by it).
    pub kind: BadRecordKind,
    /// What exactly is wrong.
    pub detail: String,
}

impl BadRecord {
    pub(crate) fn new(kind: BadRecordKind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
        }
    }
}

/// Counts of skipped records by reason (policy `skip`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SkipReport {
    /// Skipped records per reason.
    pub counts: BTreeMap<BadRecordKind, usize>,
}

impl SkipReport {
    /// Total number of skipped records.
    pub fn total(&self) -> usize {
        self.counts.values().sum()
    }
}

/// Turns raw records into typed ones under a bad-record policy.
pub struct Records<T, F> {
    raw: RawRecords,
    parse: F,
    policy: BadRecordPolicy,
    skipped: SkipReport,
    failed: bool,
    _marker: std::marker::PhantomData<fn() -> T>,
}

impl<T, F> Records<T, F>
where
    F: FnMut(&RawRecord, &serde_json::Value) -> std::result::Result<T, BadRecord>,
{
    pub(crate) fn new(raw: RawRecords, policy: BadRecordPolicy, parse: F) -> Self {
        Self {
            raw,
            parse,
            policy,
            skipped: SkipReport::default(),
            failed: false,
            _marker: std::marker::PhantomData,
        }
    }

    /// What was skipped so far.
    pub fn skipped(&self) -> &SkipReport {
        &self.skipped
    }
}

impl<T, F> Iterator for Records<T, F>
where
    F: FnMut(&RawRecord, &serde_json::Value) -> std::result::Result<T, BadRecord>,
{
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        if self.failed {
            return None;
        }
        loop {
            let raw = match self.raw.next()? {
                Ok(raw) => raw,
                Err(e) => {
                    self.failed = true;
                    return Some(Err(e));
                }
            };
            let parsed = match &raw.value {
                Ok(v) => (self.parse)(&raw, v),
                Err(bad) => Err(bad.clone()),
            };
            match parsed {
                Ok(t) => return Some(Ok(t)),
                Err(bad) => match self.policy {
                    BadRecordPolicy::Skip => {
                        *self.skipped.counts.entry(bad.kind).or_default() += 1;
                    }
                    BadRecordPolicy::Error => {
                        self.failed = true;
                        return Some(Err(DataError::Record {
                            path: raw.location.path.to_path_buf(),
                            line: raw.location.line,
                            record: raw.location.record,
                            reason: format!(
                                "{} (set the bad-record policy to `skip` to skip such records)",
                                bad.detail
                            ),
                        }));
                    }
                },
            }
        }
    }
}

/// How many records to take and in which order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Sampling {
    /// Keep at most this many records.
    pub max_samples: Option<usize>,
    /// Shuffle (with `seed`).
    pub shuffle: bool,
    /// Seed of the shuffle and of the sample (ChaCha8, stable across platforms).
    pub seed: u64,
}

impl Sampling {
    /// Applies the sampling to a stream of records. Deterministic for a given seed.
    ///
    /// Without shuffling the first `max_samples` records are taken and reading stops there;
    /// with shuffling and `max_samples`, a uniform sample is drawn by reservoir sampling (memory
    /// bounded by `max_samples`) and then shuffled.
    pub fn apply<T>(&self, records: impl Iterator<Item = Result<T>>) -> Result<Vec<T>> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let mut out: Vec<T> = match (self.shuffle, self.max_samples) {
            (false, Some(n)) => records.take(n).collect::<Result<_>>()?,
            (_, None) => records.collect::<Result<_>>()?,
            (true, Some(n)) => {
                let mut reservoir = Vec::with_capacity(n.min(1 << 20));
                for (i, r) in records.enumerate() {
                    let r = r?;
                    if i < n {
                        reservoir.push(r);
                    } else {
                        let j = rng.random_range(0..=i);
                        if j < n {
                            reservoir[j] = r;
                        }
                    }
                }
                reservoir
            }
        };
        if self.shuffle {
            out.shuffle(&mut rng);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(n: usize) -> impl Iterator<Item = Result<usize>> {
        (0..n).map(Ok)
    }

    #[test]
    fn sampling_is_deterministic() {
        let s = Sampling {
            max_samples: Some(5),
            shuffle: true,
            seed: 7,
        };
        let a = s.apply(items(100)).unwrap();
        assert_eq!(a, s.apply(items(100)).unwrap());
        assert_eq!(a.len(), 5);
        let other = Sampling { seed: 8, ..s }.apply(items(100)).unwrap();
        assert_ne!(a, other);
        let head = Sampling {
            max_samples: Some(3),
            shuffle: false,
            seed: 0,
        }
        .apply(items(100))
        .unwrap();
        assert_eq!(head, vec![0, 1, 2]);
        let all = Sampling {
            max_samples: None,
            shuffle: true,
            seed: 1,
        }
        .apply(items(10))
        .unwrap();
        let mut sorted = all.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_ne!(all, sorted);
    }
}

//! How two models' vocabularies differ: both pipelines need teacher and student (target and
//! draft) to share one tokenizer, and each words the refusal in its own terms.

use kd_data::ChatTokenizer;
use kd_model::LlamaConfig;

/// A difference between two vocabularies, `first` against `second`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabDifference {
    /// The models' `vocab_size` differ.
    Size {
        /// `first`'s.
        first: usize,
        /// `second`'s.
        second: usize,
    },
    /// The tokenizers' token → id maps differ.
    Map {
        /// Tokens in `first`'s map.
        first: usize,
        /// Tokens in `second`'s map.
        second: usize,
        /// Tokens of `first` that `second` lacks or maps to another id.
        differing: usize,
    },
}

/// The first difference between two models' vocabularies: their sizes, then (when both
/// tokenizers are given) their token → id maps.
pub fn vocab_difference(
    first: (&LlamaConfig, Option<&ChatTokenizer>),
    second: (&LlamaConfig, Option<&ChatTokenizer>),
) -> Option<VocabDifference> {
    if first.0.vocab_size != second.0.vocab_size {
        return Some(VocabDifference::Size {
            first: first.0.vocab_size,
            second: second.0.vocab_size,
        });
    }
    let (a, b) = (
        first.1?.inner().get_vocab(true),
        second.1?.inner().get_vocab(true),
    );
    (a != b).then(|| VocabDifference::Map {
        first: a.len(),
        second: b.len(),
        differing: a.iter().filter(|(k, v)| b.get(*k) != Some(v)).count(),
    })
}

//! What speculative decoding asks of a draft, as a trait both kinds of draft implement: a
//! small Llama (the LoRA draft, or any model sharing the target's vocabulary) and an EAGLE-3
//! draft, which reads the target's own hidden features. One decoding loop
//! ([`speculative_generate`](crate::speculative_generate)) drives either.
//!
//! A [`Drafter`] starts a [`DraftSession`] over the rows of a batch. Each round the loop asks
//! the session for `k` next-token distributions in a chain (`propose`), the target verifies
//! the drafts in one pass, and the session learns what was kept (`verified`): how many drafts
//! each row accepted, the target's own token after them, which rows are finished, and, for a
//! drafter that reads them, the target's features at the verified positions.

use burn::tensor::{Int, Tensor, TensorData};
use kd_model::{
    Eagle3Draft, ForwardOptions, KvCache, Llama, PaddingSide, TokenBatch, eagle3::DraftKvCache,
    generate::to_host,
};

use crate::error::{EvalError, Result};

/// A draft model speculative decoding can use.
pub trait Drafter: Sync {
    /// Checks that this draft can serve `target` (same vocabulary; an EAGLE-3 draft also needs
    /// the target's width and layers).
    fn check_target(&self, target: &Llama) -> Result<()>;

    /// The target's hidden states (Hugging Face `output_hidden_states` indices) every target
    /// pass must return for this drafter, concatenated in this order; empty when it reads none.
    /// Such a drafter gets them over the prompts with the prefill every run starts from.
    fn feature_layers(&self) -> &[usize] {
        &[]
    }

    /// Starts decoding `prompts` after the target's `prefill`: the target has read each
    /// prompt and chosen its first token (`prefill.first[r]` for row r); its features come
    /// with it for drafters with [`feature_layers`].
    ///
    /// [`feature_layers`]: Drafter::feature_layers
    fn start<'s>(
        &'s self,
        prompts: &[&[u32]],
        prefill: Prefill,
    ) -> Result<Box<dyn DraftSession + 's>>;

    /// The draft as a model that decodes alone (the cost baseline of the acceptance report);
    /// `None` for a draft that cannot (EAGLE-3 reads the target's features).
    fn standalone(&self) -> Option<&Llama> {
        None
    }
}

/// The target's reading of the prompts, before the first round: what every drafter starts
/// from. The target reads the prompts in a pass of their own, so that the verifications that
/// follow are short passes, which give a row the bits of one-token passes (a pass that held
/// the prompt and the first drafts together would round the drafts' rows otherwise, and with
/// 8-bit activations that can change a greedy token).
#[derive(Debug, Clone)]
pub struct Prefill {
    /// The target's first token of each row.
    pub first: Vec<u32>,
    /// The target's features over each row's prompt, `[rows, seq, features]`, left-padded:
    /// row r's prompt fills the last `prompts[r].len()` positions; `None` for a drafter
    /// without [`feature_layers`](Drafter::feature_layers).
    pub features: Option<Tensor<3>>,
}

/// What one round kept for one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowOutcome {
    /// Drafts accepted (a prefix of the round's `k`).
    pub accepted: usize,
    /// The accepted drafts followed by the target's own token.
    pub tokens: Vec<u32>,
    /// Whether the row is finished (stop token or length); finished rows leave the session.
    pub done: bool,
}

/// A draft decoding the rows of one batch.
pub trait DraftSession {
    /// Logits over the target's vocabulary, `[rows · vocab]` row-major, of the next drafted
    /// token of every active row. `step` counts the drafts of this round so far (0 first);
    /// `previous[r]` is row r's draft of step `step − 1` (empty at step 0).
    fn propose(&mut self, step: usize, previous: &[u32]) -> Result<Vec<f32>>;

    /// The round's verification: one outcome per active row (in row order). For drafters that
    /// read them, `features[r]` are the target's features at row r's verified positions,
    /// `[1, tokens.len(), features]`: the last token verified before the round, then each
    /// accepted draft. Finished rows are dropped; the remaining rows keep their order.
    fn verified(&mut self, outcomes: &[RowOutcome], features: Option<Vec<Tensor<3>>>)
    -> Result<()>;
}

/// Real tokens cached per row (0 for every row of an empty cache).
pub(crate) fn real_lengths(cache: &KvCache, rows: usize) -> Vec<i64> {
    if cache.batch_size().is_some() {
        cache.real_lengths().to_vec()
    } else {
        vec![0; rows]
    }
}

/// Refuses a prefill whose first tokens are not one per prompt.
fn check_first_tokens(prompts: &[&[u32]], prefill: &Prefill) -> Result<()> {
    if prefill.first.len() != prompts.len() {
        return Err(EvalError::Config(format!(
            "a prefill of {} first tokens for {} prompts",
            prefill.first.len(),
            prompts.len()
        )));
    }
    Ok(())
}

/// Checks that a draft can serve a target: same vocabulary size. (Whether the two
/// tokenizers map ids to the same strings is the caller's to check.)
pub fn check_pair(target: &Llama, draft: &Llama) -> Result<()> {
    let (t, d) = (target.config().vocab_size, draft.config().vocab_size);
    if t != d {
        return Err(EvalError::VocabMismatch {
            target: t,
            draft: d,
        });
    }
    Ok(())
}

impl Drafter for Llama {
    fn check_target(&self, target: &Llama) -> Result<()> {
        check_pair(target, self)
    }

    fn start<'s>(
        &'s self,
        prompts: &[&[u32]],
        prefill: Prefill,
    ) -> Result<Box<dyn DraftSession + 's>> {
        check_first_tokens(prompts, &prefill)?;
        let pending = prompts
            .iter()
            .zip(&prefill.first)
            .map(|(p, first)| p.iter().copied().chain([*first]).collect())
            .collect();
        Ok(Box::new(LlamaSession {
            model: self,
            cache: self.new_cache(),
            pending,
            base: Vec::new(),
            drafted: 0,
        }))
    }

    fn standalone(&self) -> Option<&Llama> {
        Some(self)
    }
}

/// A Llama draft's session: one batched KV cache, left-padded rows.
struct LlamaSession<'a> {
    model: &'a Llama,
    cache: KvCache,
    /// Tokens each row has not been fed yet (the prompt and the target's first token at
    /// first, then the round's last verified tokens).
    pending: Vec<Vec<u32>>,
    /// Real tokens cached per row when the round began.
    base: Vec<i64>,
    /// Drafts proposed this round.
    drafted: usize,
}

impl DraftSession for LlamaSession<'_> {
    fn propose(&mut self, step: usize, previous: &[u32]) -> Result<Vec<f32>> {
        let fed: Vec<Vec<u32>> = if step == 0 {
            self.base = real_lengths(&self.cache, self.pending.len());
            self.pending.clone()
        } else {
            previous.iter().map(|t| vec![*t]).collect()
        };
        self.drafted = step + 1;
        let batch = TokenBatch::from_rows(&fed, self.model.pad_id(), PaddingSide::Left);
        let logits = self
            .model
            .forward_cached(&batch, &mut self.cache, &ForwardOptions::last_positions(1))?
            .into_logits()?;
        Ok(to_host(logits))
    }

    fn verified(
        &mut self,
        outcomes: &[RowOutcome],
        _features: Option<Vec<Tensor<3>>>,
    ) -> Result<()> {
        // The cache was fed the pending tokens and the first k − 1 drafts: it keeps the pending
        // tokens and the accepted drafts among those; when all k were accepted, the last draft
        // and the target's token are fed next round.
        let seen_max = self.drafted.saturating_sub(1);
        let mut keep = Vec::with_capacity(outcomes.len());
        let mut active = Vec::with_capacity(outcomes.len());
        let mut pending = Vec::with_capacity(outcomes.len());
        for (r, o) in outcomes.iter().enumerate() {
            let seen = o.accepted.min(seen_max);
            keep.push(self.base[r] + self.pending[r].len() as i64 + seen as i64);
            if !o.done {
                active.push(r);
                let next = *o.tokens.last().expect("the target's token");
                pending.push(if seen < o.accepted {
                    vec![o.tokens[o.accepted - 1], next]
                } else {
                    vec![next]
                });
            }
        }
        self.cache.truncate(&keep)?;
        if active.len() < outcomes.len() && !active.is_empty() {
            self.cache.retain_rows(&active)?;
        }
        self.pending = pending;
        Ok(())
    }
}

/// An EAGLE-3 draft serving a target: the draft and the target layers whose hidden states it
/// reads (Hugging Face indexing, low / mid / high).
#[derive(Debug, Clone, Copy)]
pub struct Eagle3Drafter<'a> {
    /// The draft.
    pub draft: &'a Eagle3Draft,
    /// The target layers `fc` reads.
    pub layers: [usize; 3],
}

impl<'a> Eagle3Drafter<'a> {
    /// The draft reading `layers` of the target.
    pub fn new(draft: &'a Eagle3Draft, layers: [usize; 3]) -> Self {
        Self { draft, layers }
    }
}

impl Drafter for Eagle3Drafter<'_> {
    fn check_target(&self, target: &Llama) -> Result<()> {
        let dc = self.draft.config();
        let tc = target.config();
        if dc.llama.vocab_size != tc.vocab_size || dc.target_hidden_size != tc.hidden_size {
            return Err(EvalError::Config(format!(
                "the EAGLE-3 draft reads a target of vocabulary {} and width {}; this target has \
                 {} and {}",
                dc.llama.vocab_size, dc.target_hidden_size, tc.vocab_size, tc.hidden_size
            )));
        }
        if let Some(l) = self.layers.iter().find(|l| **l > tc.num_hidden_layers) {
            return Err(EvalError::Config(format!(
                "the EAGLE-3 draft reads target layer {l}; the target has hidden states \
                 0..={} (0 = embeddings)",
                tc.num_hidden_layers
            )));
        }
        Ok(())
    }

    fn feature_layers(&self) -> &[usize] {
        &self.layers
    }

    fn start<'s>(
        &'s self,
        prompts: &[&[u32]],
        prefill: Prefill,
    ) -> Result<Box<dyn DraftSession + 's>> {
        check_first_tokens(prompts, &prefill)?;
        let Prefill { first, features } = prefill;
        let Some(features) = features else {
            return Err(EvalError::Config(
                "an EAGLE-3 draft starts from the target's features over the prompts (a \
                 prefill with features)"
                    .into(),
            ));
        };
        let draft = self.draft;
        let device = draft.fc.val().device();
        let features = to_device(features, &device);
        let [_, s, f] = features.dims();
        let mut rows = Vec::with_capacity(prompts.len());
        for (r, prompt) in prompts.iter().enumerate() {
            let n = prompt.len();
            if n == 0 || n > s {
                return Err(EvalError::Config(format!(
                    "prompt {r} of {n} tokens against a prefill of {s} positions"
                )));
            }
            // Position t reads the target's features at t and token t + 1.
            let mut shifted = prompt[1..].to_vec();
            shifted.push(first[r]);
            let mut cache = DraftKvCache::new();
            let h = draft.forward_cached(
                ids_tensor(&shifted, &device),
                draft.fuse_decoding(features.clone().slice([r..r + 1, s - n..s, 0..f])),
                &mut cache,
            );
            rows.push(Eagle3Row {
                verified: cache.len(),
                h: last_position(h),
                cache,
            });
        }
        Ok(Box::new(Eagle3Session {
            draft,
            vocab: draft.config().llama.vocab_size,
            rows,
        }))
    }
}

/// One row of an EAGLE-3 session.
struct Eagle3Row {
    cache: DraftKvCache,
    /// Positions of the cache the target has verified.
    verified: usize,
    /// The draft's hidden output the next draft is read from, `[1, 1, d]`.
    h: Tensor<3>,
}

/// An EAGLE-3 draft's session: each row decodes with its own cache (rows diverge in length).
struct Eagle3Session<'a> {
    draft: &'a Eagle3Draft,
    vocab: usize,
    rows: Vec<Eagle3Row>,
}

impl DraftSession for Eagle3Session<'_> {
    fn propose(&mut self, step: usize, previous: &[u32]) -> Result<Vec<f32>> {
        let mut out = vec![f32::NEG_INFINITY; self.rows.len() * self.vocab];
        let device = self.draft.fc.val().device();
        for (r, row) in self.rows.iter_mut().enumerate() {
            if step > 0 {
                // The previous draft, read with the draft's own output before it (TTT's input).
                row.h = self.draft.forward_cached(
                    ids_tensor(&previous[r..r + 1], &device),
                    row.h.clone(),
                    &mut row.cache,
                );
            }
            // Over the draft vocabulary; the rest of the target's stays at −∞ (probability 0).
            let logits = to_host(self.draft.logits_decoding(row.h.clone()));
            let slot = &mut out[r * self.vocab..(r + 1) * self.vocab];
            for (d, v) in logits.iter().enumerate() {
                slot[self.draft.vocab().target_id(d) as usize] = *v;
            }
        }
        Ok(out)
    }

    fn verified(
        &mut self,
        outcomes: &[RowOutcome],
        features: Option<Vec<Tensor<3>>>,
    ) -> Result<()> {
        let Some(features) = features else {
            return Err(EvalError::Config(
                "an EAGLE-3 draft needs the target's features of every verification".into(),
            ));
        };
        let device = self.draft.fc.val().device();
        let rows = std::mem::take(&mut self.rows);
        for ((mut row, o), features) in rows.into_iter().zip(outcomes).zip(features) {
            if o.done {
                continue;
            }
            // The verified positions: the last verified token (paired with the first new token),
            // then each accepted draft; their features replace the draft's own guesses.
            row.cache.truncate(row.verified);
            let h = self.draft.forward_cached(
                ids_tensor(&o.tokens, &device),
                self.draft.fuse_decoding(to_device(features, &device)),
                &mut row.cache,
            );
            row.h = last_position(h);
            row.verified = row.cache.len();
            self.rows.push(row);
        }
        Ok(())
    }
}

fn ids_tensor(ids: &[u32], device: &burn::tensor::Device) -> Tensor<2, Int> {
    Tensor::from_data(
        TensorData::new(
            ids.iter().map(|&i| i as i64).collect::<Vec<_>>(),
            [1, ids.len()],
        ),
        device,
    )
}

/// `[1, s, d]` → its last position, `[1, 1, d]`.
fn last_position(h: Tensor<3>) -> Tensor<3> {
    let [b, s, d] = h.dims();
    h.slice([0..b, s - 1..s, 0..d])
}

fn to_device(t: Tensor<3>, device: &burn::tensor::Device) -> Tensor<3> {
    if &t.device() == device {
        t
    } else {
        Tensor::from_data(t.into_data(), device)
    }
}

//! Greedy speculative decoding with an EAGLE-3 draft (a chain of `k` drafted tokens per
//! target pass, one prompt at a time): the output equals the target's own greedy decoding.
//!
//! Each round:
//! 1. the draft proposes `k` tokens: the first from its hidden state at the last verified
//!    position, each next one from its own previous hidden output (what TTT trains);
//! 2. the target runs once over the last verified token and the `k` drafts, returning its
//!    logits and the chosen layers' hidden states at those `k + 1` positions;
//! 3. the longest prefix of drafts equal to the target's argmaxes is accepted, plus the
//!    target's own next token;
//! 4. both caches roll back to the verified positions, and the draft reads the target's
//!    features of the newly verified positions.

use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData};
use kd_model::{
    DraftKvCache, Eagle3Draft, ForwardOptions, HiddenStates, Llama, TokenBatch, to_host,
};

use crate::error::{EvalError, Result};

/// What a run of [`eagle3_generate`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Eagle3Stats {
    /// Target passes that verified drafts (prefills not counted).
    pub verifications: usize,
    /// Tokens drafted.
    pub drafted: usize,
    /// Drafted tokens the target accepted.
    pub accepted: usize,
    /// Tokens generated (accepted drafts plus the target's own tokens).
    pub generated: usize,
    /// Wall time of the whole run, seconds.
    pub seconds: f64,
    /// Of which the draft's forward passes.
    pub draft_seconds: f64,
}

impl Eagle3Stats {
    /// Accepted drafts per drafted token.
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }

    /// Accepted drafts per verification (τ − 1: the target's own token comes on top).
    pub fn mean_accepted_length(&self) -> f64 {
        self.accepted as f64 / self.verifications.max(1) as f64
    }

    /// Generated tokens per second.
    pub fn tokens_per_second(&self) -> f64 {
        self.generated as f64 / self.seconds.max(1e-9)
    }
}

fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}

/// Features `[1, n, 3·d]` of a target pass: the chosen layers' hidden states concatenated.
fn features(hidden: &[(usize, Tensor<3>)]) -> Tensor<3> {
    Tensor::cat(hidden.iter().map(|(_, h)| h.clone()).collect(), 2)
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

/// The draft reads this target: same vocabulary, features of the target's width.
fn check_eagle3_pair(target: &Llama, draft: &Eagle3Draft) -> Result<()> {
    let dc = &draft.config().llama;
    let tc = target.config();
    if dc.vocab_size != tc.vocab_size || draft.config().target_hidden_size != tc.hidden_size {
        return Err(EvalError::Config(format!(
            "the EAGLE-3 draft reads a target of vocabulary {} and width {}; this target has {} \
             and {}",
            dc.vocab_size,
            draft.config().target_hidden_size,
            tc.vocab_size,
            tc.hidden_size
        )));
    }
    Ok(())
}

/// `k` greedy drafts in a chain: the first from `hidden` (the draft's output at the last
/// verified position), each next one from the draft's own output for the previous draft
/// (appended to `cache`).
fn draft_chain(
    draft: &Eagle3Draft,
    hidden: Tensor<3>,
    k: usize,
    cache: &mut DraftKvCache,
) -> Vec<u32> {
    let device = hidden.device();
    let mut drafts: Vec<u32> = Vec::with_capacity(k);
    let mut h = hidden;
    for i in 0..k {
        if i > 0 {
            let prev = drafts[i - 1];
            h = draft.forward_cached(ids_tensor(&[prev], &device), h, cache);
        }
        let l = to_host(draft.logits(h.clone()));
        drafts.push(draft.vocab().target_id(argmax(&l)));
    }
    drafts
}

/// Greedy decoding of each prompt with `draft` proposing `k` tokens per target pass; `layers`
/// are the target layers the draft reads (Hugging Face indexing), `stop` ends a row (kept).
/// Returns the new tokens of each prompt and the run's statistics.
pub fn eagle3_generate(
    target: &Llama,
    draft: &Eagle3Draft,
    layers: [usize; 3],
    prompts: &[Vec<u32>],
    k: usize,
    max_new_tokens: usize,
    stop: &[u32],
) -> Result<(Vec<Vec<u32>>, Eagle3Stats)> {
    if k == 0 {
        return Err(EvalError::Config(
            "k (tokens drafted per verification) must be at least 1".into(),
        ));
    }
    check_eagle3_pair(target, draft)?;
    let dc = &draft.config().llama;
    let tc = target.config();
    let started = Instant::now();
    let mut stats = Eagle3Stats::default();
    let mut outputs = Vec::with_capacity(prompts.len());
    let with_features = |last: Option<usize>| ForwardOptions {
        hidden_states: HiddenStates::Layers(layers.to_vec()),
        last_positions: last,
        ..ForwardOptions::default()
    };
    for prompt in prompts {
        if prompt.is_empty() {
            return Err(EvalError::Config("an empty prompt".into()));
        }
        let device = draft.fc.val().device();
        let mut out = Vec::new();
        // Prefill: the target's next token and its features over the prompt.
        let mut tcache = target.new_cache();
        let pass = target.forward_cached(
            &TokenBatch::single(prompt),
            &mut tcache,
            &with_features(Some(1)),
        )?;
        let feats = features(&pass.hidden_states);
        let logits = to_host(pass.into_logits()?);
        let mut next = argmax(&logits) as u32;
        out.push(next);
        if stop.contains(&next) || max_new_tokens <= 1 {
            outputs.push(out);
            continue;
        }
        // The draft over the prompt: position t reads the target's features at t and token t + 1.
        let t0 = Instant::now();
        let mut dcache = DraftKvCache::new();
        let mut shifted: Vec<u32> = prompt[1..].to_vec();
        shifted.push(next);
        let h = draft.forward_cached(
            ids_tensor(&shifted, &device),
            draft.fuse(feats),
            &mut dcache,
        );
        let n = prompt.len();
        let d = dc.hidden_size;
        let mut last_h = h.slice([0..1, n - 1..n, 0..d]);
        stats.draft_seconds += t0.elapsed().as_secs_f64();
        let mut verified = dcache.len();

        'rows: while out.len() < max_new_tokens {
            // 1. Draft k tokens.
            let t0 = Instant::now();
            let drafts = draft_chain(draft, last_h.clone(), k, &mut dcache);
            stats.draft_seconds += t0.elapsed().as_secs_f64();
            stats.drafted += k;
            // 2. Verify: the last verified token and the drafts.
            let mut fed = vec![next];
            fed.extend(&drafts);
            let pass = target.forward_cached(
                &TokenBatch::single(&fed),
                &mut tcache,
                &with_features(None),
            )?;
            stats.verifications += 1;
            let feats = features(&pass.hidden_states);
            let logits = pass.into_logits()?;
            let vocab = logits.dims()[2];
            let host = to_host(logits);
            let choice: Vec<u32> = (0..=k)
                .map(|i| argmax(&host[i * vocab..(i + 1) * vocab]) as u32)
                .collect();
            // 3. Accept the longest agreeing prefix, then the target's own token.
            let mut accepted = 0;
            while accepted < k && drafts[accepted] == choice[accepted] {
                accepted += 1;
            }
            stats.accepted += accepted;
            let mut new_tokens: Vec<u32> = drafts[..accepted].to_vec();
            new_tokens.push(choice[accepted]);
            // 4. Roll back and feed the draft the verified positions' features.
            let real = tcache.real_lengths()[0] - (k - accepted) as i64;
            tcache.truncate(&[real])?;
            let t0 = Instant::now();
            dcache.truncate(verified);
            let rows = accepted + 1;
            let h = draft.forward_cached(
                ids_tensor(&new_tokens, &device),
                draft.fuse(feats.slice([0..1, 0..rows, 0..3 * tc.hidden_size])),
                &mut dcache,
            );
            last_h = h.slice([0..1, rows - 1..rows, 0..d]);
            verified = dcache.len();
            stats.draft_seconds += t0.elapsed().as_secs_f64();
            next = *new_tokens.last().expect("the target's token");
            for t in new_tokens {
                out.push(t);
                if stop.contains(&t) || out.len() >= max_new_tokens {
                    break 'rows;
                }
            }
        }
        outputs.push(out);
    }
    stats.generated = outputs.iter().map(Vec::len).sum();
    stats.seconds = started.elapsed().as_secs_f64();
    Ok((outputs, stats))
}

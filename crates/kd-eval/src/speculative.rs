//! Speculative decoding (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv
//! 2302.01318): the draft proposes `k` tokens one at a time, the target scores all of them in
//! one forward pass over its KV cache, the longest acceptable prefix is kept, and one more
//! token comes from the target (the correction at the first rejection, or the bonus token
//! after `k` acceptances). Both caches then roll back to the accepted prefix.
//!
//! Greedy decoding accepts a drafted token when it is the target's argmax, so the output is
//! the target's own greedy output. Sampling accepts token x with probability
//! min(1, p(x)/q(x)) and on rejection draws from norm(max(0, p − q)), so the output follows
//! the target's (warped) sampling distribution exactly; p and q are the target's and the
//! draft's distributions after the same temperature / top-k / top-p.

use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData};
use kd_model::sampling::{argmax, distribution, sample_from};
use kd_model::{
    Completion, FinishReason, ForwardOptions, HiddenStates, KvCache, Llama, PaddingSide, Sampling,
    SeededPrompt, TokenBatch, generate::to_host,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::draft::{DraftSession, Drafter, Prefill, RowOutcome, real_lengths};
use crate::error::{EvalError, Result};
use crate::stats::SpecStats;
use crate::verify::{choose, top_probability, verify_row};

/// What [`speculative_generate`] does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpecConfig {
    /// Tokens the draft proposes per verification (≥ 1).
    pub k: usize,
    /// Tokens to generate at most per prompt.
    pub max_new_tokens: usize,
    /// Greedy (temperature 0) or sampled; applied to both models.
    pub sampling: Sampling,
    /// Ids that end a completion; the target's eos ids when empty.
    pub stop_token_ids: Vec<u32>,
    /// A row stops drafting early, before `k`, at the first draft whose top probability under
    /// the draft (after the sampling warp; the plain softmax when greedy) is below this, as
    /// llama.cpp's `--draft-p-min` does; that token is not proposed. 0 (the default) always
    /// drafts `k`. The target's output distribution does not change: the decision reads only
    /// the draft. What it saves is the verification of drafts that were likely rejected.
    pub draft_p_min: f32,
}

impl Default for SpecConfig {
    fn default() -> Self {
        Self {
            k: 4,
            max_new_tokens: 64,
            sampling: Sampling::GREEDY,
            stop_token_ids: Vec::new(),
            draft_p_min: 0.0,
        }
    }
}

/// Completions and the counts of the run.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecOutput {
    /// One completion per prompt, in input order.
    pub completions: Vec<Completion>,
    /// Acceptance counts and timings.
    pub stats: SpecStats,
}

/// A row being decoded.
struct Row {
    /// Index into the outputs.
    out: usize,
    rng: ChaCha8Rng,
    /// Tokens the target has not been fed yet (the whole prompt at first, then the last
    /// token).
    target_pending: Vec<u32>,
}

/// Appends `tokens` to a completion, cut at a stop token or the length limit; whether the
/// completion is finished.
fn emit(
    c: &mut Completion,
    tokens: impl IntoIterator<Item = u32>,
    stop: &[u32],
    max_new_tokens: usize,
    stats: &mut SpecStats,
) -> bool {
    for tok in tokens {
        c.ids.push(tok);
        stats.emitted += 1;
        if stop.contains(&tok) {
            c.finish_reason = FinishReason::Stop;
            return true;
        }
        if c.ids.len() >= max_new_tokens {
            return true;
        }
    }
    false
}

/// The target layers' hidden states of a pass concatenated, `[rows, seq, 3·d]`.
fn concat_features(hidden: Vec<(usize, Tensor<3>)>) -> Option<Tensor<3>> {
    (!hidden.is_empty()).then(|| Tensor::cat(hidden.into_iter().map(|(_, h)| h).collect(), 2))
}

/// Decodes all `prompts` as one batch with the draft proposing `config.k` tokens per target
/// pass (rows finish independently); results in input order. The draft is a [`Drafter`]:
/// a Llama sharing the target's vocabulary, or an EAGLE-3 draft
/// ([`Eagle3Drafter`](crate::Eagle3Drafter)), which reads the target's features of every
/// verified position. Every run starts with a target pass over the prompts alone, which
/// chooses each row's first token ([`Prefill`](crate::Prefill)); the verifications after it
/// are short passes.
pub fn speculative_generate<D: Drafter + ?Sized>(
    target: &Llama,
    draft: &D,
    prompts: &[SeededPrompt<'_>],
    config: &SpecConfig,
) -> Result<SpecOutput> {
    // The whole loop on a worker of rayon's pool: the draft's and the target's operations
    // then need no hand-off each.
    target.run_decoding(|| speculative_loop(target, draft, prompts, config))
}

fn speculative_loop<D: Drafter + ?Sized>(
    target: &Llama,
    draft: &D,
    prompts: &[SeededPrompt<'_>],
    config: &SpecConfig,
) -> Result<SpecOutput> {
    draft.check_target(target)?;
    config.sampling.validate()?;
    target.check_prompts(prompts)?;
    check_config(config)?;
    let mut run = Run::new(target, draft.feature_layers().to_vec(), prompts, config);
    if prompts.is_empty() || config.max_new_tokens == 0 {
        return Ok(run.finish());
    }
    // Every drafter starts from the target's prefill: the target reads the prompts alone and
    // chooses each row's first token (a drafter that reads them gets the features too), so
    // that every verification is a short pass (see `Prefill`).
    let Some(prefill) = run.prefill()? else {
        return Ok(run.finish());
    };
    let ids: Vec<&[u32]> = run.rows.iter().map(|r| prompts[r.out].ids).collect();
    let started = Instant::now();
    let mut session = draft.start(&ids, prefill)?;
    run.stats.draft_seconds += started.elapsed().as_secs_f64();
    while !run.rows.is_empty() {
        let proposal = run.propose(session.as_mut())?;
        let scored = run.score(&proposal)?;
        let round = run.judge(&proposal, &scored)?;
        let started = Instant::now();
        session.verified(&round.outcomes, round.features)?;
        run.stats.draft_seconds += started.elapsed().as_secs_f64();
        if !run.keep_rows(&round.active)? {
            break;
        }
    }
    Ok(run.finish())
}

/// Rejects a `k` of 0 and a `draft_p_min` outside [0, 1].
fn check_config(config: &SpecConfig) -> Result<()> {
    if config.k == 0 {
        return Err(EvalError::Config(
            "k (tokens drafted per verification) must be at least 1".into(),
        ));
    }
    if !(0.0..=1.0).contains(&config.draft_p_min) {
        return Err(EvalError::Config(format!(
            "draft_p_min is a probability in [0, 1], not {}",
            config.draft_p_min
        )));
    }
    Ok(())
}

/// One decoding run: the rows still decoding, the target's cache, the completions and counts.
struct Run<'a> {
    target: &'a Llama,
    config: &'a SpecConfig,
    vocab: usize,
    stop: Vec<u32>,
    /// The target's hidden states the drafter reads (empty: none).
    layers: Vec<usize>,
    stats: SpecStats,
    out: Vec<Completion>,
    rows: Vec<Row>,
    cache: KvCache,
}

/// What the draft proposed in one round, per row: a chain of up to k tokens, of which the
/// first `drafted` are proposals (a row that stopped drafting runs on with the draft's argmax,
/// since the draft is fed every row's previous token).
struct Proposal {
    chain: Vec<Vec<u32>>,
    drafted: Vec<usize>,
    /// The draft's logits of each step, `[rows · vocab]`.
    logits: Vec<Vec<f32>>,
    /// Sampling: each row's draft distributions q_1..q_drafted, kept for the verification.
    probs: Vec<Vec<Vec<f32>>>,
}

/// The target's pass over each row's pending token and drafts (left-padded to the longest).
struct Scored {
    /// Drafts of the longest row: every row's pass returned its last `m + 1` positions.
    m: usize,
    /// Each row's cached length before the pass.
    base: Vec<i64>,
    /// `[rows · (m + 1) · vocab]`.
    logits: Vec<f32>,
    /// The target's features of the last `m + 1` positions, when the drafter reads them.
    features: Option<Tensor<3>>,
}

/// What one round decided: each row's outcome, the features of its verified positions, and
/// the rows that go on.
struct Round {
    outcomes: Vec<RowOutcome>,
    features: Option<Vec<Tensor<3>>>,
    active: Vec<usize>,
}

impl<'a> Run<'a> {
    fn new(
        target: &'a Llama,
        layers: Vec<usize>,
        prompts: &[SeededPrompt<'_>],
        config: &'a SpecConfig,
    ) -> Self {
        let stop = if config.stop_token_ids.is_empty() {
            target.config().eos_token_ids.clone()
        } else {
            config.stop_token_ids.clone()
        };
        let out = prompts
            .iter()
            .map(|_| Completion {
                ids: Vec::new(),
                finish_reason: FinishReason::Length,
                logprobs: None,
            })
            .collect();
        let rows = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| Row {
                out: i,
                rng: ChaCha8Rng::seed_from_u64(p.seed),
                target_pending: p.ids.to_vec(),
            })
            .collect();
        Self {
            target,
            config,
            vocab: target.config().vocab_size,
            stop,
            layers,
            stats: SpecStats::new(config.k),
            out,
            rows,
            cache: target.new_cache(),
        }
    }

    fn finish(self) -> SpecOutput {
        SpecOutput {
            completions: self.out,
            stats: self.stats,
        }
    }

    /// A target pass that returns the last `n` positions (and the drafter's features).
    fn pass_options(&self, n: usize) -> ForwardOptions {
        ForwardOptions {
            last_positions: Some(n),
            hidden_states: if self.layers.is_empty() {
                HiddenStates::None
            } else {
                HiddenStates::Layers(self.layers.clone())
            },
            ..ForwardOptions::default()
        }
    }

    /// Appends `tokens` to row `out`'s completion; whether it is finished.
    fn emit(&mut self, out: usize, tokens: impl IntoIterator<Item = u32>) -> bool {
        emit(
            &mut self.out[out],
            tokens,
            &self.stop,
            self.config.max_new_tokens,
            &mut self.stats,
        )
    }

    /// The target reads the prompts and chooses each row's first token; the rows that go on
    /// (and their features over the prompt, for a feature-reading drafter) are what the
    /// drafter starts from (`None` when every row finished at its first token).
    fn prefill(&mut self) -> Result<Option<Prefill>> {
        let pending: Vec<Vec<u32>> = self.rows.iter().map(|r| r.target_pending.clone()).collect();
        let batch = TokenBatch::from_rows(&pending, self.target.pad_id(), PaddingSide::Left);
        let started = Instant::now();
        let options = self.pass_options(1);
        let mut pass = self
            .target
            .forward_cached(&batch, &mut self.cache, &options)?;
        let features = concat_features(std::mem::take(&mut pass.hidden_states));
        let logits = to_host(pass.into_logits()?);
        let seconds = started.elapsed().as_secs_f64();
        self.stats.target_seconds += seconds;
        self.stats.target_forwards += 1;
        self.stats.prefill_seconds += seconds;
        self.stats.prefill_forwards += 1;
        let vocab = self.vocab;
        let mut first = Vec::with_capacity(self.rows.len());
        let mut active = Vec::with_capacity(self.rows.len());
        for r in 0..self.rows.len() {
            let row = &mut self.rows[r];
            let tok = choose(
                &logits[r * vocab..(r + 1) * vocab],
                &self.config.sampling,
                &mut row.rng,
            );
            let out = row.out;
            if !self.emit(out, [tok]) {
                active.push(r);
                first.push(tok);
                self.rows[r].target_pending = vec![tok];
            }
        }
        if active.is_empty() {
            return Ok(None);
        }
        let features = match features {
            Some(f) if active.len() < self.rows.len() => {
                let idx = Tensor::<1, Int>::from_data(
                    TensorData::new(
                        active.iter().map(|r| *r as i64).collect::<Vec<_>>(),
                        [active.len()],
                    ),
                    &f.device(),
                );
                Some(f.select(0, idx))
            }
            f => f,
        };
        self.keep_rows(&active)?;
        Ok(Some(Prefill { first, features }))
    }

    /// 1. The draft proposes up to k tokens per row, in a chain. A row whose draft is not
    ///    confident enough stops drafting; its chain goes on (the draft's argmax, no draw)
    ///    while other rows draft, since the draft is fed every row's previous token.
    fn propose(&mut self, session: &mut dyn DraftSession) -> Result<Proposal> {
        let (n, k, vocab) = (self.rows.len(), self.config.k, self.vocab);
        let sampling = &self.config.sampling;
        let p_min = self.config.draft_p_min;
        let mut chain: Vec<Vec<u32>> = vec![Vec::with_capacity(k); n];
        let mut drafted = vec![0usize; n];
        let mut open = vec![true; n];
        let mut draft_logits: Vec<Vec<f32>> = Vec::with_capacity(k);
        let mut draft_probs: Vec<Vec<Vec<f32>>> = vec![Vec::new(); n];
        for i in 0..k {
            if !open.contains(&true) {
                break;
            }
            let previous: Vec<u32> = if i == 0 {
                Vec::new()
            } else {
                chain.iter().map(|c| c[i - 1]).collect()
            };
            let started = Instant::now();
            let logits = session.propose(i, &previous)?;
            self.stats.draft_seconds += started.elapsed().as_secs_f64();
            self.stats.draft_forwards += 1;
            for (r, row) in self.rows.iter_mut().enumerate() {
                let z = &logits[r * vocab..(r + 1) * vocab];
                let tok = if !open[r] {
                    argmax(z)
                } else if sampling.is_greedy() {
                    let tok = argmax(z);
                    if p_min > 0.0 && top_probability(z) < p_min {
                        open[r] = false;
                    }
                    tok
                } else {
                    let q = distribution(z, sampling);
                    if q.iter().copied().fold(0.0, f32::max) < p_min {
                        open[r] = false;
                        argmax(z)
                    } else {
                        let tok = sample_from(&q, &mut row.rng);
                        draft_probs[r].push(q);
                        tok
                    }
                };
                if open[r] {
                    drafted[r] += 1;
                }
                chain[r].push(tok);
            }
            draft_logits.push(logits);
        }
        Ok(Proposal {
            chain,
            drafted,
            logits: draft_logits,
            probs: draft_probs,
        })
    }

    /// 2. The target scores the pending tokens and every row's drafts in one pass (rows
    ///    left-padded to the longest).
    fn score(&mut self, proposal: &Proposal) -> Result<Scored> {
        let n = self.rows.len();
        let m = proposal.drafted.iter().copied().max().unwrap_or(0);
        let base = real_lengths(&self.cache, n);
        let verify: Vec<Vec<u32>> = self
            .rows
            .iter()
            .zip(&proposal.chain)
            .zip(&proposal.drafted)
            .map(|((r, c), d)| r.target_pending.iter().chain(&c[..*d]).copied().collect())
            .collect();
        let batch = TokenBatch::from_rows(&verify, self.target.pad_id(), PaddingSide::Left);
        let started = Instant::now();
        let options = self.pass_options(m + 1);
        let mut pass = self
            .target
            .forward_cached(&batch, &mut self.cache, &options)?;
        let features = concat_features(std::mem::take(&mut pass.hidden_states)).map(|f| {
            let [b, s, d] = f.dims();
            f.slice([0..b, s - (m + 1)..s, 0..d])
        });
        let logits = to_host(pass.into_logits()?);
        self.stats.target_seconds += started.elapsed().as_secs_f64();
        self.stats.target_forwards += 1;
        Ok(Scored {
            m,
            base,
            logits,
            features,
        })
    }

    /// 3. Accept, correct or add the bonus token, emit, and roll the target's cache back.
    fn judge(&mut self, proposal: &Proposal, scored: &Scored) -> Result<Round> {
        let (n, m, vocab) = (self.rows.len(), scored.m, self.vocab);
        let mut keep_target = Vec::with_capacity(n);
        let mut outcomes = Vec::with_capacity(n);
        let mut active = Vec::with_capacity(n);
        let mut features = scored.features.as_ref().map(|_| Vec::with_capacity(n));
        for r in 0..n {
            // Row r's pending token sits m − drafted[r] positions into the last m + 1.
            let offset = m - proposal.drafted[r];
            let p = &scored.logits[(r * (m + 1) + offset) * vocab..(r + 1) * (m + 1) * vocab];
            let drafts = &proposal.chain[r][..proposal.drafted[r]];
            let row = &mut self.rows[r];
            let (accepted, next) = verify_row(
                drafts,
                p,
                |i| &proposal.logits[i][r * vocab..(r + 1) * vocab],
                &proposal.probs[r],
                &self.config.sampling,
                &mut row.rng,
                &mut self.stats,
            );
            if let (Some(all), Some(f)) = (&scored.features, &mut features) {
                let [_, _, d] = all.dims();
                f.push(
                    all.clone()
                        .slice([r..r + 1, offset..offset + accepted + 1, 0..d]),
                );
            }
            // Emit the accepted drafts and the target's token, cut at stop / length.
            let tokens: Vec<u32> = drafts[..accepted].iter().copied().chain([next]).collect();
            let pending = row.target_pending.len();
            let done = self.emit(self.rows[r].out, tokens.iter().copied());
            keep_target.push(scored.base[r] + pending as i64 + accepted as i64);
            if !done {
                active.push(r);
                self.rows[r].target_pending = vec![next];
            }
            outcomes.push(RowOutcome {
                accepted,
                tokens,
                done,
            });
        }
        self.cache.truncate(&keep_target)?;
        Ok(Round {
            outcomes,
            features,
            active,
        })
    }

    /// Keeps the rows `active` (indices into the current rows, ascending) and their cache
    /// rows; whether any row goes on.
    fn keep_rows(&mut self, active: &[usize]) -> Result<bool> {
        if active.len() == self.rows.len() {
            return Ok(true);
        }
        if active.is_empty() {
            return Ok(false);
        }
        self.cache.retain_rows(active)?;
        let mut old: Vec<Option<Row>> = std::mem::take(&mut self.rows)
            .into_iter()
            .map(Some)
            .collect();
        self.rows = active
            .iter()
            .map(|r| old[*r].take().expect("each row is kept once"))
            .collect();
        Ok(true)
    }
}

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
    Completion, FinishReason, ForwardOptions, HiddenStates, Llama, PaddingSide, Sampling,
    SeededPrompt, TokenBatch, to_host,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::draft::{Drafter, Prefill, RowOutcome, real_lengths};
use crate::error::{EvalError, Result};

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

/// Counts gathered while decoding; [`SpecStats::merge`] adds runs together.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecStats {
    /// Tokens drafted per verification.
    pub k: usize,
    /// Verifications (target forward passes over drafted tokens), summed over rows.
    pub verify_steps: usize,
    /// Drafted tokens (k per verification, fewer with `draft_p_min`).
    pub drafted: usize,
    /// Drafted tokens accepted.
    pub accepted: usize,
    /// Tokens emitted into completions (after cutting at stop tokens and the length limit).
    pub emitted: usize,
    /// `reached[i]`: verifications in which drafted position i was examined (every earlier
    /// draft accepted).
    pub reached: Vec<usize>,
    /// `accepted_at[i]`: verifications in which drafted position i was accepted.
    pub accepted_at: Vec<usize>,
    /// Σ over examined positions of Σ_x min(p(x), q(x)) (see [`SpecStats::alpha`]).
    pub alpha_sum: f64,
    /// Examined positions where the argmax of p equals the argmax of q.
    pub top1_agree: usize,
    /// Positions examined (the denominator of α and top-1 agreement).
    pub examined: usize,
    /// Forward passes of the draft.
    pub draft_forwards: usize,
    /// Forward passes of the target.
    pub target_forwards: usize,
    /// Seconds in draft forward passes.
    pub draft_seconds: f64,
    /// Seconds in target forward passes.
    pub target_seconds: f64,
}

impl SpecStats {
    fn new(k: usize) -> Self {
        Self {
            k,
            reached: vec![0; k],
            accepted_at: vec![0; k],
            ..Self::default()
        }
    }

    /// Adds another run's counts (same k).
    pub fn merge(&mut self, o: &Self) {
        if self.reached.is_empty() {
            self.k = o.k;
            self.reached = vec![0; o.k];
            self.accepted_at = vec![0; o.k];
        }
        self.verify_steps += o.verify_steps;
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        self.emitted += o.emitted;
        for (a, b) in self.reached.iter_mut().zip(&o.reached) {
            *a += b;
        }
        for (a, b) in self.accepted_at.iter_mut().zip(&o.accepted_at) {
            *a += b;
        }
        self.alpha_sum += o.alpha_sum;
        self.top1_agree += o.top1_agree;
        self.examined += o.examined;
        self.draft_forwards += o.draft_forwards;
        self.target_forwards += o.target_forwards;
        self.draft_seconds += o.draft_seconds;
        self.target_seconds += o.target_seconds;
    }

    /// Accepted drafted tokens / drafted tokens.
    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.accepted, self.drafted)
    }

    /// Drafted tokens accepted per verification (the bonus / correction token not counted).
    pub fn mean_accepted_length(&self) -> f64 {
        ratio(self.accepted, self.verify_steps)
    }

    /// Tokens gained per verification, counting the target's own token (the bonus after k
    /// acceptances, or the correction at the first rejection): `mean_accepted_length + 1`.
    pub fn mean_accepted_length_with_bonus(&self) -> f64 {
        ratio(self.accepted + self.verify_steps, self.verify_steps)
    }

    /// P(position i accepted | every earlier position accepted), for i = 0..k.
    pub fn per_position_acceptance(&self) -> Vec<f64> {
        self.accepted_at
            .iter()
            .zip(&self.reached)
            .map(|(a, r)| ratio(*a, *r))
            .collect()
    }

    /// α = E[Σ_x min(p(x), q(x))] over the examined positions: the probability that
    /// speculative *sampling* accepts a draft. With sampling, p and q are the warped
    /// distributions decoding used; with greedy decoding they are the plain softmax at
    /// temperature 1 (what sampling at T = 1 would accept).
    pub fn alpha(&self) -> f64 {
        if self.examined == 0 {
            0.0
        } else {
            self.alpha_sum / self.examined as f64
        }
    }

    /// Share of examined positions where the draft's argmax equals the target's.
    pub fn top1_agreement(&self) -> f64 {
        ratio(self.top1_agree, self.examined)
    }
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
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

/// The next token from logits `z`: the argmax, or a draw from the warped distribution.
fn choose(z: &[f32], sampling: &Sampling, rng: &mut ChaCha8Rng) -> u32 {
    if sampling.is_greedy() {
        argmax(z)
    } else {
        sample_from(&distribution(z, sampling), rng)
    }
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
/// ([`Eagle3Drafter`](crate::Eagle3Drafter)), which starts after a target prefill and reads
/// the target's features of every verified position.
pub fn speculative_generate<D: Drafter + ?Sized>(
    target: &Llama,
    draft: &D,
    prompts: &[SeededPrompt<'_>],
    config: &SpecConfig,
) -> Result<SpecOutput> {
    // The whole loop on a worker of rayon's pool: the draft's and the target's operations
    // then need no hand-off each.
    kd_kernels::on_pool(|| speculative_loop(target, draft, prompts, config))
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
    let p_min = config.draft_p_min;
    let k = config.k;
    let vocab = target.config().vocab_size;
    let stop = if config.stop_token_ids.is_empty() {
        target.config().eos_token_ids.clone()
    } else {
        config.stop_token_ids.clone()
    };
    let mut stats = SpecStats::new(k);
    let mut out: Vec<Completion> = prompts
        .iter()
        .map(|_| Completion {
            ids: Vec::new(),
            finish_reason: FinishReason::Length,
            logprobs: None,
        })
        .collect();
    if prompts.is_empty() || config.max_new_tokens == 0 {
        return Ok(SpecOutput {
            completions: out,
            stats,
        });
    }
    let mut rows: Vec<Row> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Row {
            out: i,
            rng: ChaCha8Rng::seed_from_u64(p.seed),
            target_pending: p.ids.to_vec(),
        })
        .collect();
    let mut target_cache = target.new_cache();
    let sampling = config.sampling;
    let greedy = sampling.is_greedy();
    let t_pad = target.pad_id();
    let layers = draft.feature_layers().to_vec();
    let pass_options = |n: usize| ForwardOptions {
        last_positions: Some(n),
        hidden_states: if layers.is_empty() {
            HiddenStates::None
        } else {
            HiddenStates::Layers(layers.clone())
        },
        ..ForwardOptions::default()
    };

    // A drafter that reads the target's features starts from the target's prefill: the
    // target reads the prompts and chooses each row's first token.
    let mut session = if layers.is_empty() {
        let ids: Vec<&[u32]> = prompts.iter().map(|p| p.ids).collect();
        draft.start(&ids, None)?
    } else {
        let pending: Vec<Vec<u32>> = rows.iter().map(|r| r.target_pending.clone()).collect();
        let batch = TokenBatch::from_rows(&pending, t_pad, PaddingSide::Left);
        let started = Instant::now();
        let mut pass = target.forward_cached(&batch, &mut target_cache, &pass_options(1))?;
        let features = concat_features(std::mem::take(&mut pass.hidden_states));
        let logits = to_host(pass.into_logits()?);
        stats.target_seconds += started.elapsed().as_secs_f64();
        stats.target_forwards += 1;
        let mut first = Vec::with_capacity(rows.len());
        let mut active = Vec::with_capacity(rows.len());
        for (r, row) in rows.iter_mut().enumerate() {
            let tok = choose(&logits[r * vocab..(r + 1) * vocab], &sampling, &mut row.rng);
            if !emit(
                &mut out[row.out],
                [tok],
                &stop,
                config.max_new_tokens,
                &mut stats,
            ) {
                active.push(r);
                first.push(tok);
                row.target_pending = vec![tok];
            }
        }
        if active.is_empty() {
            return Ok(SpecOutput {
                completions: out,
                stats,
            });
        }
        let features = features.expect("a drafter with feature layers gets features");
        let features = if active.len() < rows.len() {
            target_cache.retain_rows(&active)?;
            let idx = Tensor::<1, Int>::from_data(
                TensorData::new(
                    active.iter().map(|r| *r as i64).collect::<Vec<_>>(),
                    [active.len()],
                ),
                &features.device(),
            );
            let mut old: Vec<Option<Row>> = rows.into_iter().map(Some).collect();
            rows = active
                .iter()
                .map(|r| old[*r].take().expect("each row is kept once"))
                .collect();
            features.select(0, idx)
        } else {
            features
        };
        let ids: Vec<&[u32]> = rows.iter().map(|r| prompts[r.out].ids).collect();
        let started = Instant::now();
        let session = draft.start(&ids, Some(Prefill { first, features }))?;
        stats.draft_seconds += started.elapsed().as_secs_f64();
        session
    };

    while !rows.is_empty() {
        let n = rows.len();
        // 1. The draft proposes up to k tokens per row, in a chain. A row whose draft is not
        //    confident enough stops drafting; its chain goes on (the draft's argmax, no draw)
        //    while other rows draft, since the draft is fed every row's previous token.
        let mut chain: Vec<Vec<u32>> = vec![Vec::with_capacity(k); n];
        let mut drafted = vec![0usize; n];
        let mut open = vec![true; n];
        let mut draft_logits: Vec<Vec<f32>> = Vec::with_capacity(k);
        // Sampling: each row's draft distributions q_1..q_k, kept for the verification.
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
            stats.draft_seconds += started.elapsed().as_secs_f64();
            stats.draft_forwards += 1;
            for (r, row) in rows.iter_mut().enumerate() {
                let z = &logits[r * vocab..(r + 1) * vocab];
                let tok = if !open[r] {
                    argmax(z)
                } else if greedy {
                    let tok = argmax(z);
                    if p_min > 0.0 && top_probability(z) < p_min {
                        open[r] = false;
                    }
                    tok
                } else {
                    let q = distribution(z, &sampling);
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

        // 2. The target scores the pending tokens and every row's drafts in one pass (rows
        //    left-padded to the longest).
        let m = drafted.iter().copied().max().unwrap_or(0);
        let target_base: Vec<i64> = real_lengths(&target_cache, n);
        let verify: Vec<Vec<u32>> = rows
            .iter()
            .zip(&chain)
            .zip(&drafted)
            .map(|((r, c), d)| r.target_pending.iter().chain(&c[..*d]).copied().collect())
            .collect();
        let batch = TokenBatch::from_rows(&verify, t_pad, PaddingSide::Left);
        let started = Instant::now();
        let mut pass = target.forward_cached(&batch, &mut target_cache, &pass_options(m + 1))?;
        let features = concat_features(std::mem::take(&mut pass.hidden_states)).map(|f| {
            let [b, s, d] = f.dims();
            f.slice([0..b, s - (m + 1)..s, 0..d])
        });
        let target_logits = to_host(pass.into_logits()?);
        stats.target_seconds += started.elapsed().as_secs_f64();
        stats.target_forwards += 1;

        // 3. Accept, correct or add the bonus token; roll both caches back.
        let mut keep_target = Vec::with_capacity(n);
        let mut outcomes = Vec::with_capacity(n);
        let mut still_active = Vec::with_capacity(n);
        let mut row_features = features.as_ref().map(|_| Vec::with_capacity(n));
        for (r, row) in rows.iter_mut().enumerate() {
            // Row r's pending token sits m − drafted[r] positions into the last m + 1.
            let offset = m - drafted[r];
            let p_at = |i: usize| {
                let at = (r * (m + 1) + offset + i) * vocab;
                &target_logits[at..at + vocab]
            };
            let drafts = &chain[r][..drafted[r]];
            let q_at = |i: usize| &draft_logits[i][r * vocab..(r + 1) * vocab];
            let mut accepted = 0;
            let mut next = None;
            for (i, &d) in drafts.iter().enumerate() {
                let (zp, zq) = (p_at(i), q_at(i));
                stats.reached[i] += 1;
                stats.examined += 1;
                if argmax(zp) == argmax(zq) {
                    stats.top1_agree += 1;
                }
                let ok = if greedy {
                    stats.alpha_sum += overlap(&softmax(zp), &softmax(zq));
                    argmax(zp) == d
                } else {
                    let (p, q) = (distribution(zp, &sampling), &draft_probs[r][i]);
                    stats.alpha_sum += overlap(&p, q);
                    let (pd, qd) = (p[d as usize], q[d as usize]);
                    let u: f32 = row.rng.random();
                    // q(d) > 0: d was drawn from q.
                    let ok = u < (pd / qd).min(1.0);
                    if !ok {
                        next = Some(residual_sample(&p, q, &mut row.rng));
                    }
                    ok
                };
                if ok {
                    accepted += 1;
                    stats.accepted_at[i] += 1;
                } else {
                    if greedy {
                        next = Some(argmax(zp));
                    }
                    break;
                }
            }
            let next = next.unwrap_or_else(|| choose(p_at(drafts.len()), &sampling, &mut row.rng));
            stats.verify_steps += 1;
            stats.drafted += drafts.len();
            stats.accepted += accepted;
            if let (Some(all), Some(f)) = (&features, &mut row_features) {
                let [_, _, d] = all.dims();
                f.push(
                    all.clone()
                        .slice([r..r + 1, offset..offset + accepted + 1, 0..d]),
                );
            }

            // Emit the accepted drafts and the target's token, cut at stop / length.
            let tokens: Vec<u32> = drafts[..accepted].iter().copied().chain([next]).collect();
            let done = emit(
                &mut out[row.out],
                tokens.iter().copied(),
                &stop,
                config.max_new_tokens,
                &mut stats,
            );
            keep_target.push(target_base[r] + row.target_pending.len() as i64 + accepted as i64);
            if !done {
                still_active.push(r);
                row.target_pending = vec![next];
            }
            outcomes.push(RowOutcome {
                accepted,
                tokens,
                done,
            });
        }
        target_cache.truncate(&keep_target)?;
        let started = Instant::now();
        session.verified(&outcomes, row_features)?;
        stats.draft_seconds += started.elapsed().as_secs_f64();
        if still_active.len() < n {
            if still_active.is_empty() {
                break;
            }
            target_cache.retain_rows(&still_active)?;
            let mut old: Vec<Option<Row>> = rows.into_iter().map(Some).collect();
            rows = still_active
                .iter()
                .map(|r| old[*r].take().expect("each row is kept once"))
                .collect();
        }
    }
    Ok(SpecOutput {
        completions: out,
        stats,
    })
}

/// The largest probability of softmax(z) at temperature 1.
fn top_probability(z: &[f32]) -> f32 {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    1.0 / z.iter().map(|v| (v - max).exp()).sum::<f32>()
}

/// softmax(z) at temperature 1.
fn softmax(z: &[f32]) -> Vec<f32> {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut e: Vec<f32> = z.iter().map(|v| (v - max).exp()).collect();
    let s: f32 = e.iter().sum();
    for v in &mut e {
        *v /= s;
    }
    e
}

/// Σ_x min(p(x), q(x)).
fn overlap(p: &[f32], q: &[f32]) -> f64 {
    p.iter().zip(q).map(|(a, b)| a.min(*b) as f64).sum()
}

/// A draw from norm(max(0, p − q)); from p itself when the residual has no mass (p ≤ q
/// everywhere up to rounding, which makes a rejection all but impossible).
fn residual_sample(p: &[f32], q: &[f32], rng: &mut ChaCha8Rng) -> u32 {
    let mut r: Vec<f32> = p.iter().zip(q).map(|(a, b)| (a - b).max(0.0)).collect();
    let total: f32 = r.iter().sum();
    if total <= 0.0 || !total.is_finite() {
        return sample_from(p, rng);
    }
    for v in &mut r {
        *v /= total;
    }
    sample_from(&r, rng)
}

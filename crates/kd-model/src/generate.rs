//! The decode loop: a left-padded batch of prompts generated with the KV cache, rows
//! finishing independently (a finished row leaves the batch, so later steps cost less), each
//! row sampling from its own seeded stream so that results do not depend on batching.

use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::batch::{ForwardOptions, HiddenStates, PaddingSide, TokenBatch};
use crate::error::{ModelError, Result};
use crate::model::{Llama, ModelOutput};
use crate::sampling::{Sampling, argmax, choose, log_prob};

/// New-token slots `generate` allocates up front per row (the KV cache grows beyond).
const PREALLOCATED_NEW: usize = 1024;

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token was generated (it is the completion's last token).
    Stop,
    /// `max_new_tokens` was reached.
    Length,
}

/// What [`Llama::generate`] does.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to generate at most per prompt.
    pub max_new_tokens: usize,
    /// Greedy or sampled.
    pub sampling: Sampling,
    /// Token ids that end a completion (kept as its last token); the model's eos ids when
    /// empty.
    pub stop_token_ids: Vec<u32>,
    /// Return the log-probability (temperature 1) of each generated token.
    pub return_logprobs: bool,
}

impl GenerateOptions {
    /// Greedy decoding of at most `max_new_tokens`, stopping at the model's eos ids.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            sampling: Sampling::GREEDY,
            stop_token_ids: Vec::new(),
            return_logprobs: false,
        }
    }
}

/// One generated completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The new ids (the stop token included when one ended the completion).
    pub ids: Vec<u32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Log-probability of each new token (when asked).
    pub logprobs: Option<Vec<f32>>,
}

/// Where the time of one [`Llama::generate_timed`] call went: the prefill apart from the
/// steps after it, so that a decoding rate does not carry the prompt's pass (which, for a
/// long prompt, outweighs many steps and varies more than they take).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GenerateTimings {
    /// The prompts' pass and the choice of every row's first token.
    pub prefill: Duration,
    /// Every step after it: one pass over one token per row still decoding, and the
    /// choices.
    pub decode: Duration,
    /// The passes after the prefill.
    pub steps: usize,
    /// The tokens those passes chose (each row's tokens after its first).
    pub decode_tokens: usize,
}

impl GenerateTimings {
    /// Tokens per second after the prefill (`None` when no step ran or none took time).
    pub fn decode_tokens_per_s(&self) -> Option<f64> {
        let s = self.decode.as_secs_f64();
        (self.decode_tokens > 0 && s > 0.0).then(|| self.decode_tokens as f64 / s)
    }
}

/// What the model computed at each position of a prompt and its completion while generating
/// it ([`Llama::generate_captured`]): the decode loop's own hidden states and logits, kept
/// instead of a second pass over the finished sequence. Position `t` is token `t` of prompt +
/// completion.
#[derive(Debug, Clone, PartialEq)]
pub struct CapturedRow {
    /// Positions: the prompt's tokens and the completion's.
    pub len: usize,
    /// The hidden states asked for at every position, `[len, layers · hidden]`: each
    /// position's states in the order the layers were asked for, side by side.
    pub hidden: Vec<f32>,
    /// The first position whose logits the loop computed: the prompt's last (its pass
    /// computes the logits of that position only). Every later position has them too: the
    /// completion's last token, which no step feeds, runs through one more pass.
    pub logits_from: usize,
    /// The log-normaliser `ln Σ exp(logits)` of each position from
    /// [`logits_from`](Self::logits_from) on (`len − logits_from` values).
    pub log_z: Vec<f32>,
    /// The argmax of the logits at those positions (the lowest id among equal maxima).
    pub argmax: Vec<u32>,
}

impl CapturedRow {
    /// Nothing yet, room for `positions` positions of `width` values.
    fn with_capacity(positions: usize, width: usize) -> Self {
        Self {
            len: 0,
            hidden: Vec::with_capacity(positions * width),
            logits_from: 0,
            log_z: Vec::new(),
            argmax: Vec::new(),
        }
    }
}

/// The log-normaliser `ln Σ exp(logits)` and the argmax (the lowest id among equal maxima)
/// of one position's logits.
fn log_z_and_argmax(logits: &[f32]) -> (f32, u32) {
    let at = argmax(logits);
    let best = logits[at as usize];
    let sum: f64 = logits.iter().map(|&v| f64::from((v - best).exp())).sum();
    (best + sum.ln() as f32, at)
}

/// The hidden states the decode loop keeps ([`Llama::generate_captured`]).
struct Capture {
    layers: Vec<usize>,
    rows: Vec<CapturedRow>,
}

impl Capture {
    /// The options of a pass that keeps these hidden states and the last position's logits.
    fn options(&self) -> ForwardOptions {
        ForwardOptions {
            hidden_states: HiddenStates::Layers(self.layers.clone()),
            ..ForwardOptions::last_positions(1)
        }
    }

    /// Appends what a pass over `rows` (the captured rows its batch rows are, in order; the
    /// real positions of each are its last `lens[i]`) computed: every real position's hidden
    /// states, and the last position's logits (`[rows, vocab]`, on the host).
    fn record(&mut self, out: &ModelOutput, rows: &[usize], lens: &[usize], logits: &[f32]) {
        let [_, s, d] = out.hidden_states[0].1.dims();
        let hidden: Vec<Vec<f32>> = out
            .hidden_states
            .iter()
            .map(|(_, h)| to_host(h.clone()))
            .collect();
        let vocab = logits.len() / rows.len().max(1);
        // One row's normaliser is a pass of exponentials over the vocabulary: rows side by side.
        let scored: Vec<(f32, u32)> = logits
            .par_chunks_exact(vocab.max(1))
            .map(log_z_and_argmax)
            .collect();
        for (slot, (&r, &n)) in rows.iter().zip(lens).enumerate() {
            let row = &mut self.rows[r];
            for t in s - n..s {
                let at = (slot * s + t) * d;
                for layer in &hidden {
                    row.hidden.extend_from_slice(&layer[at..at + d]);
                }
            }
            if row.log_z.is_empty() {
                row.logits_from = row.len + n - 1;
            }
            row.len += n;
            row.log_z.push(scored[slot].0);
            row.argmax.push(scored[slot].1);
        }
    }
}

/// A prompt and the seed of its sampling stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeededPrompt<'a> {
    /// Token ids (at least one).
    pub ids: &'a [u32],
    /// Seed of this prompt's random stream (derive it from the run seed and the prompt's
    /// index, so that results do not depend on how prompts are batched).
    pub seed: u64,
}

impl Llama {
    /// The id used for padding: the configured pad id, else the first eos id, else 0 (padding
    /// is masked out, so any valid id will do).
    pub fn pad_id(&self) -> u32 {
        let c = self.config();
        c.pad_token_id
            .or(c.eos_token_ids.first().copied())
            .filter(|t| (*t as usize) < c.vocab_size)
            .unwrap_or(0)
    }

    /// The stop ids of `options`, or the model's eos ids when it names none.
    pub fn stop_ids(&self, options: &GenerateOptions) -> Vec<u32> {
        if options.stop_token_ids.is_empty() {
            self.config().eos_token_ids.clone()
        } else {
            options.stop_token_ids.clone()
        }
    }

    /// Checks that prompts are non-empty and inside the vocabulary.
    pub fn check_prompts(&self, prompts: &[SeededPrompt<'_>]) -> Result<()> {
        let vocab = self.config().vocab_size;
        for (i, p) in prompts.iter().enumerate() {
            if p.ids.is_empty() {
                return Err(ModelError::Input(format!("prompt {i} is empty")));
            }
            if let Some(bad) = p.ids.iter().find(|t| **t as usize >= vocab) {
                return Err(ModelError::Input(format!(
                    "prompt {i} holds token {bad}, beyond the model's vocabulary of {vocab}"
                )));
            }
        }
        Ok(())
    }

    /// Generates completions of all `prompts` as one batch with the KV cache; results in
    /// input order. Split large prompt sets into batches yourself (memory grows with the
    /// batch).
    pub fn generate(
        &self,
        prompts: &[SeededPrompt<'_>],
        options: &GenerateOptions,
    ) -> Result<Vec<Completion>> {
        Ok(self.generate_timed(prompts, options)?.0)
    }

    /// [`generate`](Self::generate), with where its time went: the prefill and the steps
    /// after it, timed apart (the completions are the same).
    pub fn generate_timed(
        &self,
        prompts: &[SeededPrompt<'_>],
        options: &GenerateOptions,
    ) -> Result<(Vec<Completion>, GenerateTimings)> {
        // The whole loop on a worker of the pool: no hand-off per step.
        self.run_decoding(|| {
            let mut timings = GenerateTimings::default();
            let out = self.generate_here(prompts, options, &mut timings, None)?;
            Ok((out, timings))
        })
    }

    /// [`generate`](Self::generate), keeping what the decode loop computes at every position
    /// of each prompt and its completion: the hidden states of `layers` (Hugging Face's
    /// `output_hidden_states` indexing: 0 = the embeddings, `num_hidden_layers` = after the
    /// final norm) and the log-normaliser and argmax of the logits ([`CapturedRow`]). The
    /// completions are the ones [`generate`](Self::generate) makes: the passes that choose
    /// tokens are the same, and the completion's last token, which no step feeds, runs
    /// through one more pass of the finished rows alone (their cache rows copied). Nothing is
    /// captured when `max_new_tokens` is 0.
    pub fn generate_captured(
        &self,
        prompts: &[SeededPrompt<'_>],
        options: &GenerateOptions,
        layers: &[usize],
    ) -> Result<Vec<(Completion, CapturedRow)>> {
        let n_layers = self.config().num_hidden_layers;
        if layers.is_empty() {
            return Err(ModelError::Input(
                "no hidden state to capture: name at least one layer".into(),
            ));
        }
        if let Some(bad) = layers.iter().find(|l| **l > n_layers) {
            return Err(ModelError::Input(format!(
                "hidden state {bad} to capture; valid indices are 0..={n_layers} \
                 (0 = embeddings, {n_layers} = after the final norm)"
            )));
        }
        let width = layers.len() * self.config().hidden_size;
        // Room for the prompts (a completion's length is not known: its rows grow as needed).
        let mut capture = Capture {
            layers: layers.to_vec(),
            rows: prompts
                .iter()
                .map(|p| CapturedRow::with_capacity(p.ids.len() + 1, width))
                .collect(),
        };
        let completions = self.run_decoding(|| {
            self.generate_here(
                prompts,
                options,
                &mut GenerateTimings::default(),
                Some(&mut capture),
            )
        })?;
        Ok(completions.into_iter().zip(capture.rows).collect())
    }

    fn generate_here(
        &self,
        prompts: &[SeededPrompt<'_>],
        options: &GenerateOptions,
        timings: &mut GenerateTimings,
        mut capture: Option<&mut Capture>,
    ) -> Result<Vec<Completion>> {
        let start = Instant::now();
        options.sampling.validate()?;
        self.check_prompts(prompts)?;
        let mut out: Vec<Completion> = prompts
            .iter()
            .map(|_| Completion {
                ids: Vec::new(),
                finish_reason: FinishReason::Length,
                logprobs: options.return_logprobs.then(Vec::new),
            })
            .collect();
        if prompts.is_empty() || options.max_new_tokens == 0 {
            return Ok(out);
        }
        let vocab = self.config().vocab_size;
        let stop = self.stop_ids(options);
        let rows: Vec<Vec<u32>> = prompts.iter().map(|p| p.ids.to_vec()).collect();
        let mut rngs: Vec<ChaCha8Rng> = prompts
            .iter()
            .map(|p| ChaCha8Rng::seed_from_u64(p.seed))
            .collect();
        let mut active: Vec<usize> = (0..prompts.len()).collect();
        // Preallocate for the prompt and up to PREALLOCATED_NEW tokens (requests may ask for
        // far more than rows will generate); the cache doubles beyond that.
        let longest = prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
        let slots = longest.saturating_add(options.max_new_tokens.min(PREALLOCATED_NEW));
        let mut cache = self.new_cache_with_capacity(slots);
        let mut batch = TokenBatch::from_rows(&rows, self.pad_id(), PaddingSide::Left);
        let last = match &capture {
            Some(c) => c.options(),
            None => ForwardOptions::last_positions(1),
        };
        let mut prefill_end: Option<Instant> = None;
        loop {
            let mut output = self.forward_cached(&batch, &mut cache, &last)?;
            let logits = to_host(take_logits(&mut output)?);
            if let Some(c) = capture.as_deref_mut() {
                // The prompts' pass (left-padded: a prompt's positions are its row's last),
                // then one position per row and step.
                let lens: Vec<usize> = match prefill_end {
                    None => active.iter().map(|r| prompts[*r].ids.len()).collect(),
                    Some(_) => vec![1; active.len()],
                };
                c.record(&output, &active, &lens, &logits);
            }
            let mut keep = Vec::with_capacity(active.len());
            let mut next = Vec::with_capacity(active.len());
            let mut finished: Vec<(usize, u32)> = Vec::new();
            for (slot, &r) in active.iter().enumerate() {
                let row = &logits[slot * vocab..(slot + 1) * vocab];
                let tok = choose(row, &options.sampling, &mut rngs[r]);
                let c = &mut out[r];
                c.ids.push(tok);
                if let Some(l) = &mut c.logprobs {
                    l.push(log_prob(row, tok));
                }
                if stop.contains(&tok) {
                    c.finish_reason = FinishReason::Stop;
                    finished.push((slot, tok));
                } else if c.ids.len() < options.max_new_tokens {
                    keep.push(slot);
                    next.push(tok);
                } else {
                    finished.push((slot, tok));
                }
            }
            if let Some(c) = capture.as_deref_mut()
                && !finished.is_empty()
            {
                // The finished rows' last tokens, which no step feeds: one pass of those rows
                // alone, on a copy of their cache rows (the batch's own passes stay as they
                // are without capture).
                let slots: Vec<usize> = finished.iter().map(|(s, _)| *s).collect();
                let mut rows_cache = cache.clone();
                rows_cache.retain_rows(&slots)?;
                let tokens = finished.iter().map(|(_, t)| *t).collect();
                let step = TokenBatch::new(slots.len(), 1, tokens, vec![true; slots.len()])?;
                let mut output = self.forward_cached(&step, &mut rows_cache, &last)?;
                let logits = to_host(take_logits(&mut output)?);
                let rows: Vec<usize> = slots.iter().map(|s| active[*s]).collect();
                c.record(&output, &rows, &vec![1; rows.len()], &logits);
            }
            match prefill_end {
                None => {
                    timings.prefill = start.elapsed();
                    prefill_end = Some(Instant::now());
                }
                Some(t) => {
                    timings.decode = t.elapsed();
                    timings.steps += 1;
                    timings.decode_tokens += active.len();
                }
            }
            if keep.is_empty() {
                return Ok(out);
            }
            if keep.len() < active.len() {
                cache.retain_rows(&keep)?;
                active = keep.iter().map(|s| active[*s]).collect();
            }
            batch = TokenBatch::new(next.len(), 1, next, vec![true; active.len()])?;
        }
    }
}

/// The logits of a pass that was asked for them.
fn take_logits(output: &mut ModelOutput) -> Result<burn::tensor::Tensor<3>> {
    output
        .logits
        .take()
        .ok_or_else(|| ModelError::Input("the pass computed no logits".into()))
}

/// The seed of prompt `index`'s sampling stream in a run seeded with `seed` (remote teachers
/// send it as the request's seed, so that a server running this model samples what the
/// local model samples).
pub fn stream_seed(seed: u64, index: u64) -> u64 {
    seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// A tensor's values as f32 on the host.
pub fn to_host<const D: usize>(t: burn::tensor::Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("converted to f32")
}

//! The decode loop: a left-padded batch of prompts generated with the KV cache, rows
//! finishing independently (a finished row leaves the batch, so later steps cost less), each
//! row sampling from its own seeded stream so that results do not depend on batching.

use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::batch::{ForwardOptions, PaddingSide, TokenBatch};
use crate::error::{ModelError, Result};
use crate::model::Llama;
use crate::sampling::{Sampling, choose, log_prob};

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
            let out = self.generate_here(prompts, options, &mut timings)?;
            Ok((out, timings))
        })
    }

    fn generate_here(
        &self,
        prompts: &[SeededPrompt<'_>],
        options: &GenerateOptions,
        timings: &mut GenerateTimings,
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
        let last = ForwardOptions::last_positions(1);
        let mut prefill_end: Option<Instant> = None;
        loop {
            let logits = self
                .forward_cached(&batch, &mut cache, &last)?
                .into_logits()?;
            let logits = to_host(logits);
            let mut keep = Vec::with_capacity(active.len());
            let mut next = Vec::with_capacity(active.len());
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
                } else if c.ids.len() < options.max_new_tokens {
                    keep.push(slot);
                    next.push(tok);
                }
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

//! The in-process teacher: a kd-model Llama generating batches with the KV cache (rows finish
//! independently and leave the batch) and scoring sequences.

use std::sync::Arc;

use kd_data::ChatTokenizer;
pub use kd_model::generate::stream_seed;
use kd_model::{
    CapturedRow, Completion, ForwardOptions, HiddenStates, Llama, PaddingSide, SeededPrompt,
    TokenBatch,
};
use rayon::prelude::*;

use crate::error::{Result, TeacherError};
use crate::types::{
    Generation, LAST_HIDDEN_LAYER, LayerHidden, SamplingParams, ScoreOptions, Scores,
};

/// A prompt with its index in the whole prompt set (the sampling stream derives from it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    /// Index in the prompt set.
    pub index: u64,
    /// Token ids.
    pub ids: Vec<u32>,
}

/// What a teacher does.
pub trait Teacher {
    /// Completions of `prompts`, in the same order.
    fn generate(&self, prompts: &[Prompt], params: &SamplingParams) -> Result<Vec<Generation>>;

    /// Top-`k` log-probabilities at every position of each sequence.
    fn score(&self, sequences: &[Vec<u32>], k: usize) -> Result<Vec<Scores>> {
        self.score_with(sequences, &ScoreOptions::top_k(k))
    }

    /// Top-k log-probabilities and, when asked, hidden states of chosen layers.
    fn score_with(&self, sequences: &[Vec<u32>], options: &ScoreOptions) -> Result<Vec<Scores>>;

    /// A stable description of the teacher (model files, dtype) for cache keys.
    fn fingerprint(&self) -> String;
}

/// A Llama in this process.
pub struct LocalTeacher {
    model: Llama,
    tokenizer: Option<Arc<ChatTokenizer>>,
    batch_size: usize,
    fingerprint: String,
    score_block_rows: Option<usize>,
}

impl std::fmt::Debug for LocalTeacher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTeacher")
            .field("batch_size", &self.batch_size)
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

impl LocalTeacher {
    /// A teacher generating `batch_size` prompts at a time (the seed's default is 32).
    /// `fingerprint` identifies the weights in cache keys (see [`crate::model_fingerprint`]).
    pub fn new(model: Llama, batch_size: usize, fingerprint: impl Into<String>) -> Self {
        Self {
            model,
            tokenizer: None,
            batch_size: batch_size.max(1),
            fingerprint: fingerprint.into(),
            score_block_rows: None,
        }
    }

    /// Rows of each block of the LM head when scoring (default: about 64 MiB of logits per
    /// block, 128 rows at a 128k vocabulary): the memory scoring needs beyond the forward
    /// pass is one block of logits, whatever the batch and sequence length.
    pub fn with_score_block_rows(mut self, rows: usize) -> Self {
        self.score_block_rows = Some(rows.max(1));
        self
    }

    /// Decodes completions to text with this tokenizer.
    pub fn with_tokenizer(mut self, tokenizer: ChatTokenizer) -> Self {
        self.tokenizer = Some(Arc::new(tokenizer));
        self
    }

    /// The model.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// Generates one batch; each prompt comes with the seed of its own sampling stream.
    fn generate_batch(
        &self,
        prompts: &[(&[u32], u64)],
        params: &SamplingParams,
    ) -> Result<Vec<Generation>> {
        let seeded: Vec<SeededPrompt<'_>> = prompts
            .iter()
            .map(|(ids, seed)| SeededPrompt { ids, seed: *seed })
            .collect();
        let completions = self.model.generate(&seeded, &params.generate_options())?;
        completions
            .into_iter()
            .map(|c| self.generation(c))
            .collect()
    }

    /// A completion as a [`Generation`] (its text decoded when the teacher has a tokenizer).
    fn generation(&self, c: Completion) -> Result<Generation> {
        let text = match &self.tokenizer {
            Some(tok) => Some(tok.decode(&c.ids, true)?),
            None => None,
        };
        Ok(Generation {
            ids: c.ids,
            text,
            finish_reason: c.finish_reason,
            logprobs: c.logprobs,
            hidden_states: Vec::new(),
        })
    }

    /// The prompts' ids (checked against the vocabulary) with the seeds of their sampling
    /// streams ([`stream_seed`] of the run's seed and each prompt's index).
    fn seeded<'a>(
        &self,
        prompts: &'a [Prompt],
        params: &SamplingParams,
    ) -> Result<Vec<(&'a [u32], u64)>> {
        prompts
            .iter()
            .map(|p| {
                self.check_ids(&p.ids, &format!("prompt {}", p.index))?;
                Ok((p.ids.as_slice(), stream_seed(params.seed, p.index)))
            })
            .collect()
    }

    /// Runs `run` on the prompts `batch_size` at a time, longest first (similar lengths
    /// together waste less on padding); results in input order.
    fn in_batches<T>(
        &self,
        prompts: &[(&[u32], u64)],
        mut run: impl FnMut(&[(&[u32], u64)]) -> Result<Vec<T>>,
    ) -> Result<Vec<T>> {
        let mut order: Vec<usize> = (0..prompts.len()).collect();
        order.sort_by_key(|i| std::cmp::Reverse(prompts[*i].0.len()));
        let mut results: Vec<Option<T>> = (0..prompts.len()).map(|_| None).collect();
        for chunk in order.chunks(self.batch_size) {
            let batch: Vec<(&[u32], u64)> = chunk.iter().map(|i| prompts[*i]).collect();
            for (i, g) in chunk.iter().zip(run(&batch)?) {
                results[*i] = Some(g);
            }
        }
        Ok(results
            .into_iter()
            .map(|g| g.expect("every prompt was run"))
            .collect())
    }

    /// [`Teacher::generate`], keeping what the decode loop computed at every position of
    /// each prompt and its completion: the hidden states of `layers` (transformers'
    /// `output_hidden_states` indexing) and the log-normaliser and argmax of the logits
    /// ([`Llama::generate_captured`]). The completions are those `generate` makes, batched
    /// alike; `params.hidden_layers` is not read.
    pub fn generate_captured(
        &self,
        prompts: &[Prompt],
        params: &SamplingParams,
        layers: &[usize],
    ) -> Result<Vec<(Generation, CapturedRow)>> {
        params.validate()?;
        let seeded = self.seeded(prompts, params)?;
        let options = params.generate_options();
        self.in_batches(&seeded, |batch| {
            let seeded: Vec<SeededPrompt<'_>> = batch
                .iter()
                .map(|(ids, seed)| SeededPrompt { ids, seed: *seed })
                .collect();
            self.model
                .generate_captured(&seeded, &options, layers)?
                .into_iter()
                .map(|(c, row)| Ok((self.generation(c)?, row)))
                .collect()
        })
    }

    /// Checks that a sequence is non-empty and inside the vocabulary; `what` names it in the
    /// error ("prompt 3").
    pub(crate) fn check_ids(&self, ids: &[u32], what: &str) -> Result<()> {
        let vocab = self.model.config().vocab_size as u32;
        if ids.is_empty() {
            return Err(TeacherError::Input(format!("{what} is empty")));
        }
        if let Some(bad) = ids.iter().find(|t| **t >= vocab) {
            return Err(TeacherError::Input(format!(
                "{what} holds token {bad}, beyond the teacher's vocabulary of {vocab}: \
                 teacher and tokenizer do not match"
            )));
        }
        Ok(())
    }

    /// Generates completions of prompts given with the seeds of their sampling streams
    /// (see [`stream_seed`]), `batch_size` at a time, results in input order.
    pub(crate) fn generate_seeded(
        &self,
        prompts: &[(&[u32], u64)],
        params: &SamplingParams,
    ) -> Result<Vec<Generation>> {
        params.validate()?;
        let mut out = self.in_batches(prompts, |batch| self.generate_batch(batch, params))?;
        if !params.hidden_layers.is_empty() {
            let seqs: Vec<Vec<u32>> = prompts
                .iter()
                .zip(&out)
                .map(|((ids, _), g)| ids.iter().chain(&g.ids).copied().collect())
                .collect();
            let options = ScoreOptions {
                top_k: 1,
                hidden_layers: params.hidden_layers.clone(),
            };
            for (g, s) in out.iter_mut().zip(self.score_with(&seqs, &options)?) {
                g.hidden_states = s.hidden_states;
            }
        }
        Ok(out)
    }

    /// The batch size.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The tokenizer, if any.
    pub fn tokenizer(&self) -> Option<&ChatTokenizer> {
        self.tokenizer.as_deref()
    }

    /// The tokenizer, shared (the server tokenizes text prompts with it off the worker).
    pub(crate) fn shared_tokenizer(&self) -> Option<Arc<ChatTokenizer>> {
        self.tokenizer.clone()
    }
}

impl Teacher for LocalTeacher {
    fn generate(&self, prompts: &[Prompt], params: &SamplingParams) -> Result<Vec<Generation>> {
        let seeded = self.seeded(prompts, params)?;
        self.generate_seeded(&seeded, params)
    }

    fn score_with(&self, sequences: &[Vec<u32>], options: &ScoreOptions) -> Result<Vec<Scores>> {
        let k = options.top_k;
        let cfg = self.model.config();
        let (vocab, layers, dim) = (cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size);
        let hidden_layers: Vec<usize> = options
            .hidden_layers
            .iter()
            .map(|l| if *l == LAST_HIDDEN_LAYER { layers } else { *l })
            .collect();
        let options = &ScoreOptions {
            top_k: k,
            hidden_layers,
        };
        if let Some(bad) = options.hidden_layers.iter().find(|l| **l > layers) {
            return Err(TeacherError::Config(format!(
                "hidden layer {bad} does not exist: indices run from 0 (embeddings) to \
                 {layers} (after the final norm)"
            )));
        }
        if k == 0 || k > vocab {
            return Err(TeacherError::Config(format!(
                "top-k must lie in 1..={vocab}, got {k}"
            )));
        }
        for (i, seq) in sequences.iter().enumerate() {
            self.check_ids(seq, &format!("sequence {i}"))?;
        }
        let mut out = Vec::with_capacity(sequences.len());
        for chunk in sequences.chunks(self.batch_size) {
            let batch = TokenBatch::from_rows(chunk, 0, PaddingSide::Right);
            let s = batch.seq_len();
            // The final hidden states (and the layers asked for), no logits: the LM head
            // runs below on blocks of rows, so no `[batch, seq, vocab]` tensor exists.
            let mut wanted = options.hidden_layers.clone();
            if !wanted.contains(&layers) {
                wanted.push(layers);
            }
            let opts = ForwardOptions {
                logits: false,
                hidden_states: HiddenStates::Layers(wanted),
                ..ForwardOptions::default()
            };
            let output = self.model.forward(&batch, &opts)?;
            let hidden: Vec<(usize, Vec<f32>)> = options
                .hidden_layers
                .iter()
                .map(|l| {
                    let t = output.hidden_state(*l).expect("requested").clone();
                    (*l, kd_model::generate::to_host(t))
                })
                .collect();
            let last = output.hidden_state(layers).expect("requested").clone();
            let rows = chunk.len() * s;
            let flat = last.reshape([rows, dim]);
            let mut values = Vec::with_capacity(rows * k);
            let mut indices = Vec::with_capacity(rows * k);
            // One GEMM per block against the head's f32 weights (never the decoding kernels,
            // so a row's scores do not depend on where a block ends).
            let head = self.model.lm_head_weight().transpose();
            let block = self
                .score_block_rows
                .unwrap_or_else(|| score_block_rows(vocab));
            for start in (0..rows).step_by(block) {
                let end = (start + block).min(rows);
                let h = flat.clone().slice([start..end, 0..dim]);
                let logits = h.matmul(head.clone());
                let (v, i) = top_k_log_probs(&kd_model::generate::to_host(logits), vocab, k);
                values.extend(v);
                indices.extend(i);
            }
            for (r, seq) in chunk.iter().enumerate() {
                let len = seq.len();
                let at = |t: usize| (r * s + t) * k;
                out.push(Scores {
                    len,
                    k,
                    indices: (0..len)
                        .flat_map(|t| indices[at(t)..at(t) + k].iter().copied())
                        .collect(),
                    logprobs: (0..len)
                        .flat_map(|t| values[at(t)..at(t) + k].iter().copied())
                        .collect(),
                    hidden_states: hidden
                        .iter()
                        .map(|(layer, v)| LayerHidden {
                            layer: *layer,
                            dim,
                            values: v[r * s * dim..(r * s + len) * dim].to_vec(),
                        })
                        .collect(),
                });
            }
        }
        Ok(out)
    }

    fn fingerprint(&self) -> String {
        self.fingerprint.clone()
    }
}

/// Several teachers (one replica per device) sharing the prompts out: each replica takes a
/// contiguous share, all run at once on threads of their own, results come back in input
/// order. Sampling streams depend on the prompt index only, so the result equals one
/// replica's.
pub struct ReplicatedTeacher<T> {
    replicas: Vec<T>,
}

impl<T: Teacher + Sync> ReplicatedTeacher<T> {
    /// At least one replica.
    pub fn new(replicas: Vec<T>) -> Result<Self> {
        if replicas.is_empty() {
            return Err(TeacherError::Config("no teacher replica given".into()));
        }
        Ok(Self { replicas })
    }

    /// The replicas.
    pub fn replicas(&self) -> &[T] {
        &self.replicas
    }

    fn fan_out<I: Sync, O: Send>(
        &self,
        items: &[I],
        run: impl Fn(&T, &[I]) -> Result<Vec<O>> + Sync,
    ) -> Result<Vec<O>> {
        let share = items.len().div_ceil(self.replicas.len()).max(1);
        let results: Vec<Result<Vec<O>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .replicas
                .iter()
                .zip(items.chunks(share))
                .map(|(r, chunk)| {
                    let run = &run;
                    scope.spawn(move || run(r, chunk))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("teacher replica panicked"))
                .collect()
        });
        let mut out = Vec::with_capacity(items.len());
        for r in results {
            out.extend(r?);
        }
        Ok(out)
    }
}

impl ReplicatedTeacher<LocalTeacher> {
    /// [`LocalTeacher::generate_captured`] on every replica at once, each over its share of
    /// the prompts as [`Teacher::generate`] shares them: the completions are those `generate`
    /// makes (a prompt's seed comes from its index, not from its replica), and each row's
    /// numbers those of the replica that decoded it. Results in prompt order.
    pub fn generate_captured(
        &self,
        prompts: &[Prompt],
        params: &SamplingParams,
        layers: &[usize],
    ) -> Result<Vec<(Generation, CapturedRow)>> {
        self.fan_out(prompts, |t, chunk| {
            t.generate_captured(chunk, params, layers)
        })
    }
}

impl<T: Teacher + Sync> Teacher for ReplicatedTeacher<T> {
    fn generate(&self, prompts: &[Prompt], params: &SamplingParams) -> Result<Vec<Generation>> {
        self.fan_out(prompts, |t, chunk| t.generate(chunk, params))
    }

    fn score_with(&self, sequences: &[Vec<u32>], options: &ScoreOptions) -> Result<Vec<Scores>> {
        self.fan_out(sequences, |t, chunk| t.score_with(chunk, options))
    }

    fn fingerprint(&self) -> String {
        self.replicas[0].fingerprint()
    }
}

/// Rows of one block of the scoring LM head: about 64 MiB of logits (at least one row), so
/// that a 128k vocabulary takes blocks of 128 rows whatever the batch and sequence length.
fn score_block_rows(vocab: usize) -> usize {
    ((16 << 20) / vocab.max(1)).max(1)
}

/// Per row of `logits` (`[rows, vocab]`): the `k` largest log-probabilities (temperature 1),
/// most likely first, and their vocabulary indices. One pass for the top-k (a sorted buffer of
/// `k`, ties to the lower index) and one for the log-sum-exp per row, rows in parallel: no
/// `[rows, vocab]` log-softmax is materialised.
fn top_k_log_probs(logits: &[f32], vocab: usize, k: usize) -> (Vec<f32>, Vec<u32>) {
    let rows = logits.len() / vocab.max(1);
    let mut values = vec![0f32; rows * k];
    let mut indices = vec![0u32; rows * k];
    logits
        .par_chunks(vocab)
        .zip(values.par_chunks_mut(k).zip(indices.par_chunks_mut(k)))
        .for_each(|(row, (vals, idx))| {
            let mut top: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
            for (i, &v) in row.iter().enumerate() {
                if top.len() == k
                    && v.partial_cmp(&top[k - 1].0) != Some(std::cmp::Ordering::Greater)
                {
                    continue;
                }
                let pos = top.partition_point(|(x, _)| *x >= v);
                top.insert(pos, (v, i as u32));
                top.truncate(k);
            }
            let max = top.first().map_or(f32::NEG_INFINITY, |t| t.0);
            let lse = if max.is_finite() {
                let sum: f64 = row.iter().map(|x| f64::from((x - max).exp())).sum();
                max + sum.ln() as f32
            } else {
                max
            };
            for (j, (v, i)) in top.into_iter().enumerate() {
                vals[j] = v - lse;
                idx[j] = i;
            }
        });
    (values, indices)
}

#[cfg(test)]
mod top_k_tests {
    use super::top_k_log_probs;

    /// The host top-k equals a sort of the log-softmax, row by row.
    #[test]
    fn equals_sorting_the_log_softmax() {
        let (rows, vocab, k) = (5, 97, 7);
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i * 7919 % 1013) as f32 - 500.0) / 37.0)
            .collect();
        let (values, indices) = top_k_log_probs(&logits, vocab, k);
        for r in 0..rows {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max
                + row
                    .iter()
                    .map(|x| ((x - max) as f64).exp())
                    .sum::<f64>()
                    .ln() as f32;
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|a, b| row[*b].total_cmp(&row[*a]).then(a.cmp(b)));
            for j in 0..k {
                assert_eq!(indices[r * k + j] as usize, order[j], "row {r} rank {j}");
                assert!((values[r * k + j] - (row[order[j]] - lse)).abs() < 1e-5);
            }
        }
    }
}

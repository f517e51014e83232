//! What a teacher is asked and what it answers.

use serde::{Deserialize, Serialize};

use kd_model::{FinishReason, GenerateOptions, Sampling};

use crate::error::{Result, TeacherError};

/// How completions are sampled (SGLang/vLLM names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingParams {
    /// Tokens to generate at most per prompt.
    pub max_new_tokens: usize,
    /// 0 = greedy; otherwise logits are divided by it before sampling.
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = all).
    pub top_p: f32,
    /// Seed of the sampling; each prompt draws from its own stream derived from (seed,
    /// prompt index), so results do not depend on batching.
    pub seed: u64,
    /// Token ids that end a completion (kept as its last token); the model's eos ids when
    /// empty.
    pub stop_token_ids: Vec<u32>,
    /// Return the log-probability of each generated token.
    pub return_logprobs: bool,
    /// Return these hidden states (indexed as transformers' `output_hidden_states`) over
    /// prompt and completion, computed by one forward pass over both after decoding.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hidden_layers: Vec<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            stop_token_ids: Vec::new(),
            return_logprobs: false,
            hidden_layers: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// The token-choice part (temperature, top-k, top-p).
    pub fn sampling(&self) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
        }
    }

    /// The model's decode-loop options for these parameters.
    pub fn generate_options(&self) -> GenerateOptions {
        GenerateOptions {
            max_new_tokens: self.max_new_tokens,
            sampling: self.sampling(),
            stop_token_ids: self.stop_token_ids.clone(),
            return_logprobs: self.return_logprobs,
        }
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<()> {
        if self.max_new_tokens == 0 {
            return Err(TeacherError::Config(
                "`max_new_tokens` must be positive".into(),
            ));
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(TeacherError::Config("`temperature` must be ≥ 0".into()));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(TeacherError::Config("`top_p` must lie in (0, 1]".into()));
        }
        Ok(())
    }
}

/// One completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    /// Generated ids (the stop token included when one ended the completion).
    pub ids: Vec<u32>,
    /// The decoded text (when the teacher has a tokenizer).
    pub text: Option<String>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Log-probability of each generated token under the teacher (if asked).
    pub logprobs: Option<Vec<f32>>,
    /// Hidden states over prompt + completion of the layers asked for
    /// ([`SamplingParams::hidden_layers`]), in that order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hidden_states: Vec<LayerHidden>,
}

impl Generation {
    /// Nothing generated yet.
    pub(crate) fn empty(with_logprobs: bool) -> Self {
        Self {
            ids: Vec::new(),
            text: None,
            finish_reason: FinishReason::Length,
            logprobs: with_logprobs.then(Vec::new),
            hidden_states: Vec::new(),
        }
    }
}

/// The teacher's view of one sequence: the top-k log-probabilities at every position
/// (position t predicts token t + 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Scores {
    /// Positions.
    pub len: usize,
    /// Entries per position.
    pub k: usize,
    /// Vocabulary indices, `[len, k]` row-major, most likely first.
    pub indices: Vec<u32>,
    /// Log-probabilities (temperature 1), `[len, k]`.
    pub logprobs: Vec<f32>,
    /// Hidden states of the layers asked for ([`ScoreOptions::hidden_layers`]), in that
    /// order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hidden_states: Vec<LayerHidden>,
}

/// The hidden state of one layer over a sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerHidden {
    /// Index as transformers' `output_hidden_states` (0 = embeddings, i = after layer i,
    /// `num_hidden_layers` = after the final norm).
    pub layer: usize,
    /// Width (the model's hidden size).
    pub dim: usize,
    /// `[len, dim]`, row-major.
    pub values: Vec<f32>,
}

/// The hidden-state index meaning "the last one (after the final norm), whatever the
/// model's depth": what SGLang's `return_hidden_states` returns, and what a caller that does
/// not know a remote model's layer count asks for.
pub const LAST_HIDDEN_LAYER: usize = usize::MAX;

/// What scoring returns besides the top-k log-probs.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScoreOptions {
    /// Entries per position (ROLL's default: 64).
    pub top_k: usize,
    /// Hidden states to return, indexed as transformers' `output_hidden_states`
    /// ([`LAST_HIDDEN_LAYER`] = the last, after the final norm).
    pub hidden_layers: Vec<usize>,
}

impl ScoreOptions {
    /// Top-k only.
    pub fn top_k(k: usize) -> Self {
        Self {
            top_k: k,
            hidden_layers: Vec::new(),
        }
    }
}

//! The JSON bodies of the two HTTP APIs a teacher speaks: SGLang's native `/generate` and the
//! OpenAI-compatible `/v1/completions` (vLLM, SGLang, llama.cpp server), in the shapes those
//! projects document. Requests are strict (an unknown field is an error naming it, so that a
//! sampling option this server does not implement is never silently ignored); responses are
//! read leniently (servers add fields).

use serde::{Deserialize, Serialize};

/// One token-id prompt or several.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum OneOrMany {
    /// A single prompt.
    One(Vec<u32>),
    /// A batch of prompts.
    Many(Vec<Vec<u32>>),
}

impl OneOrMany {
    pub(crate) fn into_vec(self) -> Vec<Vec<u32>> {
        match self {
            Self::One(v) => vec![v],
            Self::Many(v) => v,
        }
    }
}

/// One text prompt or several (SGLang's `text`; a string `prompt` of the OpenAI API),
/// tokenized by the served model's tokenizer with its special tokens (BOS), as SGLang's
/// `tokenizer.encode(text)` and vLLM's `add_special_tokens: true` default do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum TextOrMany {
    /// A single prompt.
    One(String),
    /// A batch of prompts.
    Many(Vec<String>),
}

/// An OpenAI `prompt`: token ids or text, one or several.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum PromptInput {
    /// Token ids.
    Ids(OneOrMany),
    /// Text.
    Text(TextOrMany),
}

fn minus_one() -> i64 {
    -1
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// SGLang `/generate` request: token ids (`input_ids`) or text (`text`), not both.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SglRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_ids: Option<OneOrMany>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextOrMany>,
    #[serde(default)]
    pub sampling_params: SglSampling,
    #[serde(default)]
    pub return_logprob: bool,
    /// First input position whose log-probs are returned (-1: none).
    #[serde(default = "minus_one")]
    pub logprob_start_len: i64,
    #[serde(default)]
    pub top_logprobs_num: usize,
    #[serde(default, skip_serializing_if = "is_false")]
    pub return_hidden_states: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rid: Option<serde_json::Value>,
}

/// SGLang's `sampling_params` (the subset a teacher needs; SGLang's defaults when absent).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SglSampling {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// -1 (or 0) = all tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sampling_seed: Option<u64>,
}

/// One `[logprob, token_id, token_text]` entry.
pub(crate) type SglLogprob = (Option<f32>, u32, Option<String>);

/// SGLang `/generate` response for one prompt.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SglResponse {
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub output_ids: Option<Vec<u32>>,
    pub meta_info: SglMeta,
}

/// SGLang's `meta_info`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SglMeta {
    #[serde(default)]
    pub id: Option<String>,
    pub finish_reason: Option<SglFinish>,
    #[serde(default)]
    pub prompt_tokens: usize,
    #[serde(default)]
    pub completion_tokens: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_token_logprobs: Option<Vec<SglLogprob>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_top_logprobs: Option<Vec<Option<Vec<SglLogprob>>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_top_logprobs: Option<Vec<Option<Vec<SglLogprob>>>>,
    /// With `return_hidden_states`: the last layer's hidden states (after the final norm),
    /// as SGLang writes them — the prefill's rows `[extend_len][hidden]` first, then one row
    /// per decode step (none for the last generated token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_states: Option<Vec<SglHidden>>,
}

/// One entry of SGLang's `meta_info.hidden_states`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum SglHidden {
    /// The prefill: one row per input position computed.
    Rows(Vec<Vec<f32>>),
    /// A decode step.
    Row(Vec<f32>),
}

/// `{"type": "stop", "matched": 128009}` or `{"type": "length", "length": 64}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SglFinish {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matched: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<usize>,
}

/// OpenAI-compatible `/v1/completions` request with token-id prompts (vLLM's extensions
/// `top_k`, `stop_token_ids`, `return_tokens_as_token_ids`, `return_token_ids`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct OaiRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub prompt: PromptInput,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Number of top log-probs per position (the chosen token's is always given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<usize>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub echo: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<usize>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub return_tokens_as_token_ids: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub return_token_ids: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

impl SglRequest {
    /// A request for one prompt, everything else at its default.
    pub(crate) fn new(ids: Vec<u32>, sampling_params: SglSampling) -> Self {
        Self {
            input_ids: Some(OneOrMany::One(ids)),
            text: None,
            sampling_params,
            return_logprob: false,
            logprob_start_len: -1,
            top_logprobs_num: 0,
            return_hidden_states: false,
            stream: false,
            rid: None,
        }
    }
}

impl OaiRequest {
    /// A request for one prompt, everything else at its default; token names as ids.
    pub(crate) fn new(model: Option<String>, ids: Vec<u32>) -> Self {
        Self {
            model,
            prompt: PromptInput::Ids(OneOrMany::One(ids)),
            max_tokens: None,
            temperature: None,
            top_p: None,
            top_k: None,
            seed: None,
            stop_token_ids: None,
            logprobs: None,
            echo: false,
            n: None,
            stream: false,
            return_tokens_as_token_ids: true,
            return_token_ids: false,
            user: None,
        }
    }
}

/// OpenAI-compatible completion response.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct OaiResponse {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub object: String,
    #[serde(default)]
    pub created: u64,
    #[serde(default)]
    pub model: String,
    pub choices: Vec<OaiChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<OaiUsage>,
}

/// One choice.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct OaiChoice {
    #[serde(default)]
    pub index: usize,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub finish_reason: Option<String>,
    /// vLLM's `return_token_ids`: the generated ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub logprobs: Option<OaiLogprobs>,
}

/// Legacy completions log-probs: parallel lists over the returned tokens (the prompt's too
/// with `echo`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct OaiLogprobs {
    #[serde(default)]
    pub tokens: Vec<String>,
    #[serde(default)]
    pub token_logprobs: Vec<Option<f32>>,
    /// Per position a map token → log-prob (null at the first prompt position).
    #[serde(default)]
    pub top_logprobs: Option<Vec<Option<serde_json::Map<String, serde_json::Value>>>>,
    #[serde(default)]
    pub text_offset: Vec<usize>,
    /// The chat-completions shape some servers (llama.cpp) return on `/v1/completions`:
    /// one entry per generated token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Vec<OaiContentLogprob>>,
}

/// One generated token in the chat-completions log-probs shape.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct OaiContentLogprob {
    /// The token id (llama.cpp adds it; OpenAI does not).
    #[serde(default)]
    pub id: Option<u32>,
    #[serde(default)]
    pub token: Option<String>,
    #[serde(default)]
    pub logprob: Option<f32>,
}

/// llama.cpp's native `/completion` reply (the fields used).
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct LlamacppResponse {
    #[serde(default)]
    pub content: Option<String>,
    /// The generated ids (`return_tokens: true`).
    #[serde(default)]
    pub tokens: Option<Vec<u32>>,
    #[serde(default)]
    pub stop_type: Option<String>,
    #[serde(default)]
    pub stopped_eos: Option<bool>,
    #[serde(default)]
    pub stopped_word: Option<bool>,
    #[serde(default)]
    pub stopped_limit: Option<bool>,
    #[serde(default)]
    pub tokens_predicted: Option<usize>,
    #[serde(default)]
    pub completion_probabilities: Option<Vec<LlamacppProb>>,
}

/// One entry of `completion_probabilities`.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct LlamacppProb {
    #[serde(default)]
    pub logprob: Option<f32>,
    /// Older servers (and `post_sampling_probs`) give a probability instead.
    #[serde(default)]
    pub prob: Option<f32>,
}

/// Token counts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct OaiUsage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

/// How a token is named in OpenAI log-probs when ids are asked for (vLLM's
/// `return_tokens_as_token_ids`).
pub(crate) fn token_key(id: u32) -> String {
    format!("token_id:{id}")
}

/// The id in a `token_id:N` key.
pub(crate) fn parse_token_key(key: &str) -> Option<u32> {
    key.strip_prefix("token_id:")?.parse().ok()
}

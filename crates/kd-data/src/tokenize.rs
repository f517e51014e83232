//! Tokenization: the model's tokenizer and chat template together; prompt/completion examples
//! with label masks decided by position, and truncation that keeps the end of the prompt and
//! the start of the completion.

use std::collections::BTreeMap;
use std::path::Path;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result};
use crate::source::{Message, PromptCompletion, QaRecord};
use crate::template::{ChatTemplate, load_template};

/// Writes through [`kd_kernels::write_atomic`].
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    kd_kernels::write_atomic(path, bytes).map_err(|e| DataError::io(path, e))
}

pub use kd_kernels::IGNORE_INDEX;

/// A Hugging Face tokenizer (`tokenizer.json`, or one built from a GGUF file's metadata)
/// with its chat template.
pub struct ChatTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
    /// For a tokenizer built from GGUF metadata: the `tokenizer_config.json` that
    /// [`save`](ChatTokenizer::save) writes beside `tokenizer.json`.
    gguf_config: Option<serde_json::Value>,
}

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("template", &self.template)
            .finish()
    }
}

impl ChatTokenizer {
    /// Loads the tokenizer and chat template of a model: `tokenizer.json` (+
    /// `tokenizer_config.json` / `chat_template.jinja`) of a Hugging Face directory, or the
    /// metadata of a `.gguf` file — the path itself, or the only `.gguf` file of a directory
    /// without `tokenizer.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        if let Some(gguf) = kd_gguf::locate(dir, "tokenizer.json")
            .map_err(|e| DataError::Tokenizer(e.to_string()))?
        {
            return Self::from_gguf(gguf);
        }
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(DataError::NoInput {
                path,
                message: "no tokenizer.json: the model directory needs Hugging Face tokenizer \
                          files (or a .gguf file)"
                    .into(),
            });
        }
        let tokenizer = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| DataError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Self {
            tokenizer,
            template: load_template(dir)?,
            gguf_config: None,
        })
    }

    /// Builds the tokenizer a GGUF file's metadata describes, as transformers'
    /// `AutoTokenizer.from_pretrained(dir, gguf_file=…)` builds it (byte-level BPE
    /// vocabularies), with the chat template of `tokenizer.chat_template`.
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<Self> {
        let built = crate::gguf::from_gguf(path.as_ref())?;
        let mut config = serde_json::Map::new();
        for (k, v) in &built.special_tokens {
            config.insert(k.clone(), v.clone().into());
        }
        config.insert("add_bos_token".into(), built.add_bos_token.into());
        if let Some(t) = &built.template {
            config.insert("chat_template".into(), t.source().into());
        }
        config.insert("clean_up_tokenization_spaces".into(), false.into());
        config.insert("tokenizer_class".into(), "PreTrainedTokenizerFast".into());
        Ok(Self {
            tokenizer: built.tokenizer,
            template: built.template,
            gguf_config: Some(serde_json::Value::Object(config)),
        })
    }

    /// Writes a tokenizer built from GGUF metadata as Hugging Face files in `dir`:
    /// `tokenizer.json` and `tokenizer_config.json` (special tokens, chat template), each
    /// atomically. A tokenizer loaded from `tokenizer.json` has its files already: copy those.
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        let Some(config) = &self.gguf_config else {
            return Err(DataError::Tokenizer(
                "this tokenizer was loaded from Hugging Face files: copy tokenizer.json and \
                 tokenizer_config.json instead of saving it"
                    .into(),
            ));
        };
        std::fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e))?;
        let json = self
            .tokenizer
            .to_string(true)
            .map_err(|e| DataError::Tokenizer(e.to_string()))?;
        write_atomic(&dir.join("tokenizer.json"), json.as_bytes())?;
        let text = serde_json::to_string_pretty(config).expect("JSON values serialise");
        write_atomic(&dir.join("tokenizer_config.json"), text.as_bytes())
    }

    /// Replaces the chat template (e.g. Meta's official one for a base tokenizer).
    pub fn with_template(mut self, template: ChatTemplate) -> Self {
        self.template = Some(template);
        self
    }

    /// Sets the chat template's variables (Qwen3's `enable_thinking`, …): see
    /// [`ChatTemplate::with_variables`]. An empty map changes nothing; variables for a
    /// tokenizer without a chat template are an error.
    pub fn with_template_variables(
        mut self,
        variables: &BTreeMap<String, serde_json::Value>,
    ) -> Result<Self> {
        if variables.is_empty() {
            return Ok(self);
        }
        let template = self.template.take().ok_or_else(|| {
            DataError::Template(format!(
                "chat template variables {:?} given, but the tokenizer has no chat template",
                variables.keys().collect::<Vec<_>>()
            ))
        })?;
        self.template = Some(template.with_variables(variables.clone())?);
        Ok(self)
    }

    /// The chat template, if the tokenizer has one.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.tokenizer
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The id of a token (`"<|eot_id|>"`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Encodes text; `add_special_tokens` applies the tokenizer's post-processor (BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| DataError::Tokenizer(e.to_string()))
    }

    /// Decodes ids to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| DataError::Tokenizer(e.to_string()))
    }

    fn require_template(&self) -> Result<&ChatTemplate> {
        self.template.as_ref().ok_or_else(|| {
            DataError::Template(
                "the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja); \
                 pass one with ChatTokenizer::with_template"
                    .into(),
            )
        })
    }

    /// The ids of a rendered conversation, as `apply_chat_template(messages,
    /// add_generation_prompt=…, tokenize=True)` gives them: the template writes the special
    /// tokens itself, so the text is encoded without adding any.
    pub fn encode_chat(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let text = self
            .require_template()?
            .render(messages, add_generation_prompt)?;
        self.encode(&text, false)
    }

    /// Prompt ids for the teacher: the conversation with the generation prompt.
    pub fn encode_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        self.encode_chat(messages, true)
    }

    /// Prompt ids of many conversations, in parallel, in input order.
    pub fn encode_prompts(&self, conversations: &[Vec<Message>]) -> Result<Vec<Vec<u32>>> {
        conversations
            .par_iter()
            .map(|m| self.encode_prompt(m))
            .collect()
    }

    /// A question/answer example: the prompt is the conversation with the generation prompt,
    /// the completion is what the template renders for the assistant turn (its end-of-turn
    /// token included).
    pub fn qa_example(
        &self,
        record: &QaRecord,
        options: &ExampleOptions,
    ) -> Result<(Example, Truncation)> {
        self.chat_example(
            &record.id,
            &record.location.to_string(),
            &record.messages,
            &record.answer,
            options,
        )
    }

    /// Training examples of prompt/completion pairs, as [`qa_example`](Self::qa_example) makes
    /// them: labels on the completion's tokens (its end-of-turn token included), cut to
    /// `options.max_seq_length`; with what the cutting removed.
    pub fn prompt_completion_examples(
        &self,
        pairs: &[PromptCompletion],
        options: &ExampleOptions,
    ) -> Result<(Vec<Example>, Truncation)> {
        let mut cut = Truncation::default();
        let mut out = Vec::with_capacity(pairs.len());
        for (i, p) in pairs.iter().enumerate() {
            let id = if p.id.is_empty() {
                format!("pair {i}")
            } else {
                p.id.clone()
            };
            let (e, t) = self.chat_example(&id, &id, &p.messages, &p.completion, options)?;
            cut.add(t);
            out.push(e);
        }
        Ok((out, cut))
    }

    fn chat_example(
        &self,
        id: &str,
        location: &str,
        messages: &[Message],
        answer: &str,
        options: &ExampleOptions,
    ) -> Result<(Example, Truncation)> {
        let prompt = self.encode_prompt(messages)?;
        let mut full_messages = messages.to_vec();
        full_messages.push(Message::new("assistant", answer));
        let full = self.encode_chat(&full_messages, false)?;
        if full.len() < prompt.len() || full[..prompt.len()] != prompt[..] {
            return Err(DataError::Template(format!(
                "{location}: the rendered conversation does not start with the rendered prompt,                  so the answer tokens cannot be located; this template is not prefix-stable"
            )));
        }
        Ok(build_example(id, &prompt, &full[prompt.len()..], options))
    }
}

/// How examples are cut and labelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExampleOptions {
    /// Longest example in tokens (the seed's `--max_seq_length`, 2048).
    pub max_seq_length: usize,
    /// Put labels on the prompt too (`distill_on_prompt` / SFT on the whole text).
    pub train_on_prompt: bool,
}

impl Default for ExampleOptions {
    fn default() -> Self {
        Self {
            max_seq_length: 2048,
            train_on_prompt: false,
        }
    }
}

/// A tokenized training example.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Example {
    /// Provenance (`custom_id` or `file:line`).
    pub id: String,
    /// Prompt then completion ids.
    pub input_ids: Vec<u32>,
    /// The token at each position, or −100 where it is not learned (the prompt). Labels are
    /// decided by position, never by token value: an end-of-turn token equal to the pad id
    /// keeps its label.
    pub labels: Vec<i64>,
    /// Number of prompt tokens kept.
    pub prompt_len: usize,
}

impl Example {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether the example has no tokens.
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }
}

/// What truncation cut from one example (sum them for a report).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Truncation {
    /// Examples that were cut.
    pub examples: usize,
    /// Prompt tokens removed (from the prompt's start).
    pub prompt_tokens: usize,
    /// Completion tokens removed (from the completion's end).
    pub completion_tokens: usize,
}

impl Truncation {
    /// Adds another example's counts.
    pub fn add(&mut self, o: Truncation) {
        self.examples += o.examples;
        self.prompt_tokens += o.prompt_tokens;
        self.completion_tokens += o.completion_tokens;
    }
}

/// Joins prompt and completion into an example, cutting to `max_seq_length`: the end of the
/// prompt (at least half the budget when the prompt is that long) and the start of the
/// completion are kept.
pub fn build_example(
    id: &str,
    prompt: &[u32],
    completion: &[u32],
    options: &ExampleOptions,
) -> (Example, Truncation) {
    let l = options.max_seq_length;
    let (p, c) = (prompt.len(), completion.len());
    let (keep_p, keep_c) = if p + c <= l {
        (p, c)
    } else {
        let keep_p = p.min((l.saturating_sub(c)).max(l / 2));
        (keep_p, c.min(l - keep_p))
    };
    let prompt = &prompt[p - keep_p..];
    let completion = &completion[..keep_c];
    let mut input_ids = Vec::with_capacity(keep_p + keep_c);
    input_ids.extend_from_slice(prompt);
    input_ids.extend_from_slice(completion);
    let mut labels = Vec::with_capacity(input_ids.len());
    labels.extend(prompt.iter().map(|t| {
        if options.train_on_prompt {
            *t as i64
        } else {
            IGNORE_INDEX
        }
    }));
    labels.extend(completion.iter().map(|t| *t as i64));
    let cut = Truncation {
        examples: usize::from(keep_p < p || keep_c < c),
        prompt_tokens: p - keep_p,
        completion_tokens: c - keep_c,
    };
    (
        Example {
            id: id.to_string(),
            input_ids,
            labels,
            prompt_len: keep_p,
        },
        cut,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_by_position_and_truncation() {
        let opts = ExampleOptions {
            max_seq_length: 8,
            train_on_prompt: false,
        };
        // The completion ends with the pad/eos id 0: it keeps its label.
        let (e, cut) = build_example("x", &[1, 2, 3], &[7, 0], &opts);
        assert_eq!(e.input_ids, vec![1, 2, 3, 7, 0]);
        assert_eq!(e.labels, vec![-100, -100, -100, 7, 0]);
        assert_eq!(cut, Truncation::default());
        // Long prompt, short completion: the prompt's end is kept.
        let (e, cut) = build_example("x", &[1, 2, 3, 4, 5, 6, 7, 8, 9], &[50, 51], &opts);
        assert_eq!(e.input_ids, vec![4, 5, 6, 7, 8, 9, 50, 51]);
        assert_eq!(
            (cut.examples, cut.prompt_tokens, cut.completion_tokens),
            (1, 3, 0)
        );
        // Both long: half the budget for the prompt's end, the rest for the completion's start.
        let (e, cut) = build_example("x", &[1, 2, 3, 4, 5, 6], &[10, 11, 12, 13, 14, 15], &opts);
        assert_eq!(e.input_ids, vec![3, 4, 5, 6, 10, 11, 12, 13]);
        assert_eq!(e.prompt_len, 4);
        assert_eq!((cut.prompt_tokens, cut.completion_tokens), (2, 2));
        // Training on the prompt labels it too.
        let on = ExampleOptions {
            train_on_prompt: true,
            ..opts
        };
        assert_eq!(
            build_example("x", &[1, 2], &[3], &on).0.labels,
            vec![1, 2, 3]
        );
    }
}

//! Prompt/completion pairs: the data a draft or student learns from when a program already
//! holds them (the pipelines read theirs from OpenAI batch files or question/answer sets).

use serde::{Deserialize, Serialize};

use super::{Message, QaRecord};

/// A prompt conversation and the completion to learn: the completion is the assistant turn
/// that follows the prompt (labels on its tokens only, the end-of-turn token included; see
/// [`ChatTokenizer::prompt_completion_examples`](crate::ChatTokenizer::prompt_completion_examples)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptCompletion {
    /// Provenance, named in errors.
    pub id: String,
    /// The prompt: the system turn (optional) and the user turn(s).
    pub messages: Vec<Message>,
    /// The assistant's answer.
    pub completion: String,
}

impl PromptCompletion {
    /// A single user turn and its completion; the id is left empty (errors then name the
    /// pair by its position).
    pub fn new(prompt: impl Into<String>, completion: impl Into<String>) -> Self {
        Self {
            id: String::new(),
            messages: vec![Message::user(prompt)],
            completion: completion.into(),
        }
    }
}

impl From<QaRecord> for PromptCompletion {
    fn from(r: QaRecord) -> Self {
        Self {
            id: r.id,
            messages: r.messages,
            completion: r.answer,
        }
    }
}

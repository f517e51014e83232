//! Question/answer sets (the distill seed, ROLL): a JSON array or JSONL of objects whose
//! fields are named by `question_key` / `answer_key` (and optionally `prompt_key`,
//! `system_key`), dotted paths allowed for nested fields.
//!
//! Field values must be strings, with one documented coercion: a JSON number (an answer such
//! as `42` or `3.5`, common in math sets) is taken as its JSON text (`"42"`, `"3.5"`).
//! `null`, booleans, arrays and objects are refused with the key and the type found. A
//! record is located by file and line, and for a JSON array also by its record number.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::openai::type_name;
use super::reader::{Location, RawRecord, RawRecords, get_path_raw};
use super::{BadRecord, BadRecordKind, BadRecordPolicy, Message, Records};

/// Which fields hold what.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QaKeys {
    /// The question (the user turn).
    pub question_key: String,
    /// The answer (the assistant turn the student learns).
    pub answer_key: String,
    /// An optional instruction placed before the question in the user turn (a blank line
    /// between them).
    pub prompt_key: Option<String>,
    /// An optional system message.
    pub system_key: Option<String>,
}

impl Default for QaKeys {
    fn default() -> Self {
        Self {
            question_key: "question".into(),
            answer_key: "answer".into(),
            prompt_key: None,
            system_key: None,
        }
    }
}

/// A question/answer example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QaRecord {
    /// `file:line`.
    pub id: String,
    /// The prompt conversation: the optional system turn and the user turn.
    pub messages: Vec<Message>,
    /// The answer text.
    pub answer: String,
    /// Where the record is.
    pub location: Location,
}

/// Question/answer records from files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QaSource {
    /// The files, in reading order.
    pub files: Vec<PathBuf>,
    /// Field names.
    pub keys: QaKeys,
    /// What to do with malformed records.
    pub policy: BadRecordPolicy,
}

/// The keys an object has, for error messages (`question`, `answer`, …; at most 12).
fn keys_present(v: &Value) -> String {
    match v.as_object() {
        Some(map) if map.is_empty() => "the record has no keys".into(),
        Some(map) => {
            let mut names: Vec<String> = map.keys().take(12).map(|k| format!("`{k}`")).collect();
            if map.len() > 12 {
                names.push(format!("… {} more", map.len() - 12));
            }
            format!("keys present: {}", names.join(", "))
        }
        None => String::new(),
    }
}

fn text_field(v: &Value, key: &str, required: bool) -> Result<Option<String>, BadRecord> {
    match get_path_raw(v, key) {
        None if required => Err(BadRecord::new(
            BadRecordKind::MissingKey,
            format!(
                "missing key `{key}` ({}; set question_key / answer_key to the right names)",
                keys_present(v)
            ),
        )),
        None => Ok(None),
        Some(Value::Null) if required => Err(BadRecord::new(
            BadRecordKind::WrongType,
            format!("`{key}` is null: expected a string"),
        )),
        Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        // Answers such as 42 are common in math sets: documented coercion to the JSON text.
        Some(Value::Number(n)) => Ok(Some(n.to_string())),
        Some(other) => Err(BadRecord::new(
            BadRecordKind::WrongType,
            format!("`{key}`: expected a string, found {}", type_name(other)),
        )),
    }
}

impl QaSource {
    /// The records, streamed in file order.
    pub fn records(
        &self,
    ) -> Records<QaRecord, impl FnMut(&RawRecord, &Value) -> Result<QaRecord, BadRecord> + use<>>
    {
        let keys = self.keys.clone();
        Records::new(
            RawRecords::new(self.files.clone()),
            self.policy,
            move |raw, v| {
                if !v.is_object() {
                    return Err(BadRecord::new(
                        BadRecordKind::WrongType,
                        format!("expected an object, found {}", type_name(v)),
                    ));
                }
                let question = text_field(v, &keys.question_key, true)?.unwrap_or_default();
                let answer = text_field(v, &keys.answer_key, true)?.unwrap_or_default();
                if answer.trim().is_empty() {
                    return Err(BadRecord::new(
                        BadRecordKind::EmptyText,
                        format!("`{}` is empty: nothing to learn", keys.answer_key),
                    ));
                }
                let mut user = question;
                if let Some(pk) = &keys.prompt_key
                    && let Some(prompt) = text_field(v, pk, false)?
                {
                    user = format!("{prompt}\n\n{user}");
                }
                if user.trim().is_empty() {
                    return Err(BadRecord::new(
                        BadRecordKind::EmptyText,
                        format!("`{}` is empty", keys.question_key),
                    ));
                }
                let mut messages = Vec::with_capacity(2);
                if let Some(sk) = &keys.system_key
                    && let Some(system) = text_field(v, sk, false)?
                {
                    messages.push(Message::new("system", system));
                }
                messages.push(Message::new("user", user));
                Ok(QaRecord {
                    id: raw.location.to_string(),
                    messages,
                    answer,
                    location: raw.location.clone(),
                })
            },
        )
    }
}

//! Prompts from OpenAI batch files (`data_dir/*/batch_input.jsonl`): each line's
//! `body.messages` is a conversation; the prompt is the conversation up to and including its
//! last user turn.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::reader::{Location, RawRecord, RawRecords};
use super::{BadRecord, BadRecordKind, BadRecordPolicy, Message, Records};
use crate::error::{DataError, Result};

/// The file name the seed's data layout uses.
pub const BATCH_FILE: &str = "batch_input.jsonl";

/// The roles of OpenAI's chat format.
pub const ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// A prompt for the teacher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptRecord {
    /// `custom_id` when the line has one, else `file:line`.
    pub id: String,
    /// The line's `custom_id`, kept for provenance.
    pub custom_id: Option<String>,
    /// The conversation up to and including the last user turn (system turns kept).
    pub messages: Vec<Message>,
    /// Where the line is.
    pub location: Location,
}

/// The batch files of a data directory, in a deterministic order: `data_dir` itself when it
/// is a file, else `data_dir/batch_input.jsonl` if present and every
/// `data_dir/<subdir>/batch_input.jsonl`, subdirectories sorted by name.
pub fn find_batch_files(data_dir: &Path) -> Result<Vec<PathBuf>> {
    if data_dir.is_file() {
        return Ok(vec![data_dir.to_path_buf()]);
    }
    let entries = std::fs::read_dir(data_dir).map_err(|e| DataError::io(data_dir, e))?;
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    let mut files: Vec<PathBuf> = Vec::new();
    let top = data_dir.join(BATCH_FILE);
    if top.is_file() {
        files.push(top);
    }
    files.extend(
        dirs.into_iter()
            .map(|d| d.join(BATCH_FILE))
            .filter(|f| f.is_file()),
    );
    if files.is_empty() {
        return Err(DataError::NoInput {
            path: data_dir.to_path_buf(),
            message: format!(
                "no {BATCH_FILE} found: expected data_dir/*/{BATCH_FILE} (OpenAI batch format), \
                 or pass the file itself"
            ),
        });
    }
    Ok(files)
}

/// OpenAI batch prompts from a set of files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenAiBatchSource {
    /// The files, in reading order.
    pub files: Vec<PathBuf>,
    /// Keep only the last user turn (drop system turns and earlier history).
    pub last_user_only: bool,
    /// What to do with malformed lines.
    pub policy: BadRecordPolicy,
}

impl OpenAiBatchSource {
    /// The source of a data directory (see [`find_batch_files`]).
    pub fn from_data_dir(data_dir: &Path) -> Result<Self> {
        Ok(Self {
            files: find_batch_files(data_dir)?,
            last_user_only: false,
            policy: BadRecordPolicy::Error,
        })
    }

    /// The prompts, streamed in file and line order.
    pub fn records(
        &self,
    ) -> Records<
        PromptRecord,
        impl FnMut(&RawRecord, &Value) -> Result<PromptRecord, BadRecord> + use<>,
    > {
        let last_user_only = self.last_user_only;
        Records::new(
            RawRecords::new(self.files.clone()),
            self.policy,
            move |raw, v| parse(raw, v, last_user_only),
        )
    }
}

/// Flattens OpenAI message content: a string, null (empty), or a list of parts whose text
/// parts are concatenated in order.
pub(crate) fn content_text(content: Option<&Value>, at: &str) -> Result<String, BadRecord> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (i, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                match (kind, part.get("text")) {
                    ("text", Some(Value::String(t))) => out.push_str(t),
                    ("text", _) => {
                        return Err(BadRecord::new(
                            BadRecordKind::WrongType,
                            format!("{at}.content[{i}]: a text part needs a string `text`"),
                        ));
                    }
                    (other, _) => {
                        return Err(BadRecord::new(
                            BadRecordKind::NonTextPart,
                            format!(
                                "{at}.content[{i}]: part of type {other:?} is not text; only \
                                 text parts are supported"
                            ),
                        ));
                    }
                }
            }
            Ok(out)
        }
        Some(other) => Err(BadRecord::new(
            BadRecordKind::WrongType,
            format!(
                "{at}.content: expected a string or a list of parts, found {}",
                type_name(other)
            ),
        )),
    }
}

pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn parse(raw: &RawRecord, v: &Value, last_user_only: bool) -> Result<PromptRecord, BadRecord> {
    let custom_id = v
        .get("custom_id")
        .and_then(Value::as_str)
        .map(str::to_string);
    let messages = v
        .get("body")
        .and_then(|b| b.get("messages"))
        .or_else(|| v.get("messages"));
    let messages = match messages {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) | None | Some(Value::Null) => {
            return Err(BadRecord::new(
                BadRecordKind::NoMessages,
                "no `body.messages` (or it is empty)",
            ));
        }
        Some(other) => {
            return Err(BadRecord::new(
                BadRecordKind::WrongType,
                format!(
                    "`body.messages` should be a list, found {}",
                    type_name(other)
                ),
            ));
        }
    };
    let mut parsed = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let at = format!("body.messages[{i}]");
        let role = match m.get("role") {
            Some(Value::String(r)) => r.clone(),
            Some(other) => {
                return Err(BadRecord::new(
                    BadRecordKind::WrongType,
                    format!("{at}.role: expected a string, found {}", type_name(other)),
                ));
            }
            None => {
                return Err(BadRecord::new(
                    BadRecordKind::MissingKey,
                    format!("{at}: no `role`"),
                ));
            }
        };
        if !ROLES.contains(&role.as_str()) {
            return Err(BadRecord::new(
                BadRecordKind::UnknownRole,
                format!(
                    "{at}.role: unknown role {role:?}; expected one of {}",
                    ROLES.join(", ")
                ),
            ));
        }
        let content = content_text(m.get("content"), &at)?;
        if role == "user" && content.trim().is_empty() {
            return Err(BadRecord::new(
                BadRecordKind::EmptyPrompt,
                format!("{at}: the user message is empty"),
            ));
        }
        parsed.push(Message { role, content });
    }
    let Some(last_user) = parsed.iter().rposition(|m| m.role == "user") else {
        return Err(BadRecord::new(
            BadRecordKind::NoUserTurn,
            "the conversation has no user turn",
        ));
    };
    parsed.truncate(last_user + 1);
    if last_user_only {
        parsed.drain(..last_user);
    }
    let location = raw.location.clone();
    Ok(PromptRecord {
        id: custom_id.clone().unwrap_or_else(|| location.to_string()),
        custom_id,
        messages: parsed,
        location,
    })
}

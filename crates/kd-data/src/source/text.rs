//! Plain text for causal-LM training: text files (read in pieces at line boundaries, never
//! whole) or JSONL/JSON with a text field.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use super::openai::type_name;
use super::reader::{Location, RawRecords, get_path};
use super::{BadRecord, BadRecordKind, BadRecordPolicy, Records};
use crate::error::{DataError, Result};

/// A piece of text; `document_end` marks the last piece of a document (an end-of-text token
/// goes after it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextRecord {
    /// The text.
    pub text: String,
    /// Where it starts.
    pub location: Location,
    /// Whether the document ends here.
    pub document_end: bool,
}

/// Text from files: `.jsonl`/`.json` files give one document per record (field `text_key`),
/// any other file is one document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextSource {
    /// The files.
    pub files: Vec<PathBuf>,
    /// The field holding the text in JSON records.
    pub text_key: String,
    /// What to do with malformed records.
    pub policy: BadRecordPolicy,
}

/// Plain-text files are handed out in pieces of about this many bytes (at line ends).
const PIECE_BYTES: usize = 1 << 20;

impl TextSource {
    /// The pieces of text, in file order.
    pub fn records(&self) -> impl Iterator<Item = Result<TextRecord>> + use<> {
        let files = self.files.clone();
        let key = self.text_key.clone();
        let policy = self.policy;
        files.into_iter().flat_map(
            move |path| -> Box<dyn Iterator<Item = Result<TextRecord>>> {
                let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
                if matches!(ext, "jsonl" | "json") {
                    let key = key.clone();
                    Box::new(Records::new(
                        RawRecords::new(vec![path]),
                        policy,
                        move |raw, v: &Value| match get_path(v, &key) {
                            None => Err(BadRecord::new(
                                BadRecordKind::MissingKey,
                                format!("missing key `{key}`"),
                            )),
                            Some(Value::String(s)) if s.trim().is_empty() => Err(BadRecord::new(
                                BadRecordKind::EmptyText,
                                format!("`{key}` is empty"),
                            )),
                            Some(Value::String(s)) => Ok(TextRecord {
                                text: s.clone(),
                                location: raw.location.clone(),
                                document_end: true,
                            }),
                            Some(other) => Err(BadRecord::new(
                                BadRecordKind::WrongType,
                                format!("`{key}`: expected a string, found {}", type_name(other)),
                            )),
                        },
                    ))
                } else {
                    match TextPieces::open(&path) {
                        Ok(p) => Box::new(p),
                        Err(e) => Box::new(std::iter::once(Err(e))),
                    }
                }
            },
        )
    }
}

struct TextPieces {
    reader: BufReader<File>,
    path: Arc<Path>,
    line: usize,
    done: bool,
}

impl TextPieces {
    fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| DataError::io(path, e))?;
        Ok(Self {
            reader: BufReader::new(file),
            path: Arc::from(path),
            line: 1,
            done: false,
        })
    }
}

impl Iterator for TextPieces {
    type Item = Result<TextRecord>;

    fn next(&mut self) -> Option<Result<TextRecord>> {
        if self.done {
            return None;
        }
        let start = self.line;
        let mut text = String::new();
        loop {
            match self.reader.read_line(&mut text) {
                Ok(0) => {
                    self.done = true;
                    break;
                }
                Ok(_) => {
                    self.line += 1;
                    if text.len() >= PIECE_BYTES {
                        // The document ends here if nothing follows.
                        self.done = self
                            .reader
                            .fill_buf()
                            .map(|b| b.is_empty())
                            .unwrap_or(false);
                        break;
                    }
                }
                Err(e) => {
                    self.done = true;
                    return Some(Err(DataError::io(self.path.to_path_buf(), e)));
                }
            }
        }
        if text.is_empty() && start > 1 {
            return None;
        }
        Some(Ok(TextRecord {
            text,
            location: Location {
                path: self.path.clone(),
                line: start,
                record: None,
            },
            document_end: self.done,
        }))
    }
}

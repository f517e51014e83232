//! Streaming JSON records from files: JSONL (one value per line) or a JSON array (elements
//! split at the top level without loading the file), auto-detected per file.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use super::{BadRecord, BadRecordKind};
use crate::error::{DataError, Result};

/// Where a record came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Location {
    /// The file.
    pub path: Arc<Path>,
    /// 1-based line of the record's start.
    pub line: usize,
    /// 1-based number of the record among the elements of a JSON array (`None` for JSONL and
    /// text, where the line alone locates it). Several records of a one-line array share
    /// their line; this tells them apart.
    pub record: Option<usize>,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.path.display(), self.line)?;
        if let Some(r) = self.record {
            write!(f, " (record {r})")?;
        }
        Ok(())
    }
}

/// A record as read: its location and its JSON value, or why it cannot be one (not UTF-8,
/// not JSON).
#[derive(Debug, Clone)]
pub struct RawRecord {
    /// Where it starts.
    pub location: Location,
    /// The parsed value, or what is wrong with the record's bytes.
    pub value: std::result::Result<Value, BadRecord>,
}

/// The UTF-8 byte-order mark some editors write at the start of a file.
const BOM: &[u8] = b"\xEF\xBB\xBF";

fn invalid_json(e: serde_json::Error) -> BadRecord {
    BadRecord::new(BadRecordKind::InvalidJson, format!("invalid JSON: {e}"))
}

enum Format {
    Lines(BufReader<File>),
    Array(ArrayElements<BufReader<File>>),
}

/// Raw records of several files, in order.
pub struct RawRecords {
    files: std::vec::IntoIter<PathBuf>,
    current: Option<(Arc<Path>, Format)>,
    line: usize,
    buf: Vec<u8>,
}

impl RawRecords {
    /// Reads the files in the given order.
    pub fn new(files: Vec<PathBuf>) -> Self {
        Self {
            files: files.into_iter(),
            current: None,
            line: 0,
            buf: Vec::new(),
        }
    }

    fn open(path: PathBuf) -> Result<(Arc<Path>, Format)> {
        let file = File::open(&path).map_err(|e| DataError::io(&path, e))?;
        let mut reader = BufReader::with_capacity(1 << 16, file);
        // A byte-order mark is not part of the first record.
        if reader
            .fill_buf()
            .map_err(|e| DataError::io(&path, e))?
            .starts_with(BOM)
        {
            reader.consume(BOM.len());
        }
        // Peek at the first non-whitespace byte: '[' means a JSON array.
        let first = loop {
            let buf = reader.fill_buf().map_err(|e| DataError::io(&path, e))?;
            if buf.is_empty() {
                break None;
            }
            match buf.iter().position(|b| !b.is_ascii_whitespace()) {
                Some(i) => break Some(buf[i]),
                None => {
                    let n = buf.len();
                    reader.consume(n);
                }
            }
        };
        let path: Arc<Path> = Arc::from(path.as_path());
        let format = if first == Some(b'[') {
            Format::Array(ArrayElements::new(reader))
        } else {
            Format::Lines(reader)
        };
        Ok((path, format))
    }
}

impl Iterator for RawRecords {
    type Item = Result<RawRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let Some((path, format)) = &mut self.current else {
                let next = self.files.next()?;
                match Self::open(next) {
                    Ok(opened) => {
                        self.current = Some(opened);
                        self.line = 0;
                        continue;
                    }
                    Err(e) => return Some(Err(e)),
                }
            };
            match format {
                Format::Lines(reader) => {
                    self.buf.clear();
                    match reader.read_until(b'\n', &mut self.buf) {
                        Ok(0) => {
                            self.current = None;
                        }
                        Ok(_) => {
                            self.line += 1;
                            let location = Location {
                                path: path.clone(),
                                line: self.line,
                                record: None,
                            };
                            let value = match std::str::from_utf8(&self.buf) {
                                Ok(text) if text.trim().is_empty() => continue,
                                Ok(text) => serde_json::from_str(text.trim()).map_err(invalid_json),
                                Err(e) => Err(BadRecord::new(
                                    BadRecordKind::InvalidUtf8,
                                    format!(
                                        "not valid UTF-8 (byte {} of the line); re-encode the \
                                         file as UTF-8",
                                        e.valid_up_to() + 1
                                    ),
                                )),
                            };
                            return Some(Ok(RawRecord { location, value }));
                        }
                        Err(e) => {
                            let e = DataError::io(path.to_path_buf(), e);
                            self.current = None;
                            return Some(Err(e));
                        }
                    }
                }
                Format::Array(elements) => match elements.next() {
                    None => self.current = None,
                    Some(Ok((line, bytes))) => {
                        elements.count += 1;
                        let location = Location {
                            path: path.clone(),
                            line,
                            record: Some(elements.count),
                        };
                        let value = serde_json::from_slice(&bytes).map_err(invalid_json);
                        return Some(Ok(RawRecord { location, value }));
                    }
                    Some(Err(message)) => {
                        let e = DataError::Record {
                            path: path.to_path_buf(),
                            line: elements.line,
                            record: Some(elements.count + 1),
                            reason: format!("malformed JSON array: {message}"),
                        };
                        self.current = None;
                        return Some(Err(e));
                    }
                },
            }
        }
    }
}

/// Splits a JSON array into its top-level elements as byte strings, streaming.
struct ArrayElements<R> {
    reader: R,
    line: usize,
    /// Elements returned so far.
    count: usize,
    started: bool,
    done: bool,
}

impl<R: Read> ArrayElements<R> {
    fn new(reader: R) -> Self {
        Self {
            reader,
            line: 1,
            count: 0,
            started: false,
            done: false,
        }
    }

    fn byte(&mut self) -> std::result::Result<Option<u8>, String> {
        let mut b = [0u8; 1];
        match self.reader.read(&mut b) {
            Ok(0) => Ok(None),
            Ok(_) => {
                if b[0] == b'\n' {
                    self.line += 1;
                }
                Ok(Some(b[0]))
            }
            Err(e) => Err(e.to_string()),
        }
    }

    fn next(&mut self) -> Option<std::result::Result<(usize, Vec<u8>), String>> {
        if self.done {
            return None;
        }
        let r = self.next_inner();
        if !matches!(r, Some(Ok(_))) {
            self.done = true;
        }
        r
    }

    fn next_inner(&mut self) -> Option<std::result::Result<(usize, Vec<u8>), String>> {
        // Skip to the start of the next element.
        loop {
            let b = match self.byte() {
                Ok(Some(b)) => b,
                Ok(None) => return Some(Err("unexpected end of file (missing `]`)".into())),
                Err(e) => return Some(Err(e)),
            };
            match b {
                b'[' if !self.started => self.started = true,
                b',' if self.started => {}
                b']' if self.started => return None,
                b if b.is_ascii_whitespace() => {}
                b => {
                    let start_line = self.line;
                    return Some(self.element(b).map(|bytes| (start_line, bytes)));
                }
            }
        }
    }

    /// Reads one element starting with byte `first`, up to (not including) the `,` or `]`
    /// that ends it; that delimiter is handled here.
    fn element(&mut self, first: u8) -> std::result::Result<Vec<u8>, String> {
        let mut out = vec![first];
        let mut depth: i64 = 0;
        let mut in_string = first == b'"';
        let mut escaped = false;
        if first == b'{' || first == b'[' {
            depth = 1;
        }
        loop {
            let Some(b) = self.byte()? else {
                return Err("unexpected end of file inside an element".into());
            };
            if in_string {
                out.push(b);
                if escaped {
                    escaped = false;
                } else if b == b'\\' {
                    escaped = true;
                } else if b == b'"' {
                    in_string = false;
                }
                continue;
            }
            match b {
                b'"' => in_string = true,
                b'{' | b'[' => depth += 1,
                b'}' | b']' if depth > 0 => depth -= 1,
                b',' if depth == 0 => return Ok(out),
                b']' if depth == 0 => {
                    self.done = true;
                    return Ok(out);
                }
                _ => {}
            }
            out.push(b);
        }
    }
}

/// The value at a dotted path (`"meta.question"`), if present and not null.
pub fn get_path<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    get_path_raw(value, path).filter(|v| !v.is_null())
}

/// Like [`get_path`], but a `null` value is returned as such (to tell "null" from "absent").
pub(crate) fn get_path_raw<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    let mut v = value;
    for key in path.split('.') {
        v = match v {
            Value::Object(map) => map.get(key)?,
            Value::Array(items) => items.get(key.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(text: &str) -> Vec<(usize, std::result::Result<Value, String>)> {
        records_of(text.as_bytes())
    }

    fn records_of(bytes: &[u8]) -> Vec<(usize, std::result::Result<Value, String>)> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.json");
        std::fs::write(&p, bytes).unwrap();
        RawRecords::new(vec![p])
            .map(|r| r.map(|r| (r.location.line, r.value.map_err(|b| b.detail))))
            .collect::<Result<Vec<_>>>()
            .unwrap_or_else(|e| vec![(0, Err(e.to_string()))])
    }

    #[test]
    fn byte_order_mark_and_invalid_utf8() {
        // A BOM before the first record (JSONL and JSON array) is not part of it.
        let r = records_of(b"\xEF\xBB\xBF{\"a\": 1}\n{\"a\": 2}\n");
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].1.as_ref().unwrap()["a"], 1);
        let r = records_of(b"\xEF\xBB\xBF [{\"a\": 1}]");
        assert_eq!(r[0].1.as_ref().unwrap()["a"], 1);
        // Invalid UTF-8 is a bad record on its own line; the next line still reads.
        let r = records_of(b"{\"a\": 1}\n{\"a\": \"\xFF\"}\n{\"a\": 3}\n");
        assert_eq!(r.len(), 3);
        assert_eq!(r[1].0, 2);
        let e = r[1].1.as_ref().unwrap_err();
        assert!(e.contains("UTF-8") && e.contains("byte 8"), "{e}");
        assert_eq!(r[2].1.as_ref().unwrap()["a"], 3);
    }

    #[test]
    fn jsonl_lines_and_blank_lines() {
        let r = records("{\"a\": 1}\n\n{\"a\": 2}\nnot json\n");
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].0, 1);
        assert_eq!(r[1].0, 3);
        assert_eq!(r[2].0, 4);
        assert!(r[2].1.is_err());
    }

    #[test]
    fn json_array_elements_with_tricky_strings() {
        let r = records(
            "  [\n {\"q\": \"a, ] }\\\" [\"},\n {\"q\": [1, {\"x\": 2}]},\n \"s\",\n 3 ]\n",
        );
        assert_eq!(r.len(), 4, "{r:?}");
        assert_eq!(r[0].1.as_ref().unwrap()["q"], "a, ] }\" [");
        assert_eq!(r[1].0, 3);
        assert_eq!(r[2].1.as_ref().unwrap(), "s");
        assert_eq!(r[3].1.as_ref().unwrap(), 3);
        assert!(records("[]").is_empty());
        let bad = records("[{\"a\": 1}, {\"b\": ");
        assert!(
            bad.iter()
                .any(|(_, v)| v.as_ref().is_err_and(|e| e.contains("end of file"))),
            "{bad:?}"
        );
    }

    #[test]
    fn dotted_paths() {
        let v: Value = serde_json::json!({"a": {"b": [10, {"c": "x"}]}, "n": null});
        assert_eq!(get_path(&v, "a.b.1.c").unwrap(), "x");
        assert_eq!(get_path(&v, "a.b.0").unwrap(), 10);
        assert!(get_path(&v, "a.z").is_none());
        assert!(get_path(&v, "n").is_none());
    }
}

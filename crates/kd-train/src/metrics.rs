//! Metric sinks: `training_log.txt` (one line per logging step, `tail -f`-able), TensorBoard
//! event files (TFRecord framing with masked CRC-32C, hand-encoded `Event` protobufs), and
//! the observer trait through which binaries draw progress (libraries print nothing).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// What one logging step reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogRecord {
    /// Optimizer step (1-based: steps done).
    pub step: usize,
    /// Fractional epoch.
    pub epoch: f64,
    /// Mean total loss over the steps since the last log.
    pub loss: f64,
    /// Each loss term (`ce_loss`, `kd_loss`, `hidden_mse`), averaged likewise.
    pub terms: Vec<(String, f64)>,
    /// Learning rate of the last step.
    pub learning_rate: f64,
    /// Global gradient norm (before clipping) of the last step.
    pub grad_norm: f64,
    /// Label tokens per second since the last log.
    pub tokens_per_second: f64,
    /// Seconds since the run (or the resumed run) started.
    pub elapsed_seconds: f64,
}

fn hms(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

impl LogRecord {
    /// The `training_log.txt` line.
    pub fn line(&self, total_steps: usize) -> String {
        let mut out = format!(
            "step {}/{} | epoch {:.3} | loss {:.6}",
            self.step, total_steps, self.epoch, self.loss
        );
        for (k, v) in &self.terms {
            out.push_str(&format!(" | {k} {v:.6}"));
        }
        out.push_str(&format!(
            " | lr {:.4e} | grad_norm {:.4} | tokens/s {:.1} | elapsed {}",
            self.learning_rate,
            self.grad_norm,
            self.tokens_per_second,
            hms(self.elapsed_seconds)
        ));
        out
    }
}

/// Appends lines to `training_log.txt`, flushing each.
pub struct TextLog {
    file: File,
    path: PathBuf,
}

impl TextLog {
    /// Opens (appending) the log in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let path = dir.join("training_log.txt");
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| TrainError::io(&path, e))?;
        Ok(Self { file, path })
    }

    /// Writes one line.
    pub fn line(&mut self, line: &str) -> Result<()> {
        writeln!(self.file, "{line}")
            .and_then(|_| self.file.flush())
            .map_err(|e| TrainError::io(&self.path, e))
    }
}

/// CRC-32C (Castagnoli), as TFRecord framing uses.
pub(crate) fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0x82F6_3B78 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *e = c;
        }
        t
    });
    let mut crc = !0u32;
    for b in data {
        crc = table[((crc ^ *b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn field_bytes(field: u32, bytes: &[u8], out: &mut Vec<u8>) {
    varint(((field as u64) << 3) | 2, out);
    varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

/// An `Event` protobuf: wall_time (1, double), step (2, int64), and either file_version (3)
/// or summary (5) with one `Value { tag (1), simple_value (2, float) }`.
fn event(wall_time: f64, step: i64, payload: EventPayload<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    varint((1 << 3) | 1, &mut out);
    out.extend_from_slice(&wall_time.to_le_bytes());
    varint(2 << 3, &mut out);
    varint(step as u64, &mut out);
    match payload {
        EventPayload::FileVersion(v) => field_bytes(3, v.as_bytes(), &mut out),
        EventPayload::Scalar(tag, value) => {
            let mut val = Vec::new();
            field_bytes(1, tag.as_bytes(), &mut val);
            varint((2 << 3) | 5, &mut val);
            val.extend_from_slice(&value.to_le_bytes());
            let mut summary = Vec::new();
            field_bytes(1, &val, &mut summary);
            field_bytes(5, &summary, &mut out);
        }
    }
    out
}

enum EventPayload<'a> {
    FileVersion(&'a str),
    Scalar(&'a str, f32),
}

/// Writes scalars to a TensorBoard event file (`events.out.tfevents.<time>.<host>`).
pub struct TensorBoard {
    file: File,
    path: PathBuf,
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl TensorBoard {
    /// Creates a new event file in `dir` (several writers of one process may share a
    /// directory: each gets a file of its own, and TensorBoard reads them as one run).
    pub fn create(dir: &Path) -> Result<Self> {
        static WRITERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
        let t = now();
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
        let n = WRITERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!(
            "events.out.tfevents.{}.{}.{}.{n}",
            t as u64,
            host,
            std::process::id()
        ));
        let file = File::create(&path).map_err(|e| TrainError::io(&path, e))?;
        let mut tb = Self { file, path };
        tb.record(&event(t, 0, EventPayload::FileVersion("brain.Event:2")))?;
        Ok(tb)
    }

    fn record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut buf = Vec::with_capacity(data.len() + 16);
        buf.extend_from_slice(&len);
        buf.extend_from_slice(&masked_crc(&len).to_le_bytes());
        buf.extend_from_slice(data);
        buf.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.file
            .write_all(&buf)
            .and_then(|_| self.file.flush())
            .map_err(|e| TrainError::io(&self.path, e))
    }

    /// Adds one scalar.
    pub fn scalar(&mut self, tag: &str, value: f64, step: usize) -> Result<()> {
        let e = event(now(), step as i64, EventPayload::Scalar(tag, value as f32));
        self.record(&e)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Progress callbacks; the binaries draw a progress bar from them.
pub trait TrainObserver {
    /// The run starts (or resumes) at `start_step` of `total_steps`.
    fn on_start(&mut self, _start_step: usize, _total_steps: usize) {}
    /// An optimizer step finished.
    fn on_step(&mut self, _step: usize, _loss: f64) {}
    /// A logging step.
    fn on_log(&mut self, _record: &LogRecord) {}
    /// A checkpoint was written.
    fn on_checkpoint(&mut self, _path: &Path) {}
    /// A step was skipped for a non-finite loss or gradient.
    fn on_skipped_step(&mut self, _step: usize) {}
    /// Polled after every optimizer step (after its checkpoints and hook): `true` ends the
    /// run there with a checkpoint of that step and [`TrainError::Stopped`](crate::TrainError)
    /// (how a binary relays SIGTERM from a scheduler that preempts the job).
    fn stop_requested(&mut self) -> bool {
        false
    }
}

/// An observer that does nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopObserver;

impl TrainObserver for NoopObserver {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_values() {
        // RFC 3720 test vectors.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    }

    #[test]
    fn log_line() {
        let r = LogRecord {
            step: 10,
            epoch: 0.5,
            loss: 1.25,
            terms: vec![("ce_loss".into(), 1.25)],
            learning_rate: 2e-4,
            grad_norm: 0.5,
            tokens_per_second: 123.4,
            elapsed_seconds: 3725.0,
        };
        assert_eq!(
            r.line(100),
            "step 10/100 | epoch 0.500 | loss 1.250000 | ce_loss 1.250000 | lr 2.0000e-4 | grad_norm 0.5000 | tokens/s 123.4 | elapsed 01:02:05"
        );
    }
}

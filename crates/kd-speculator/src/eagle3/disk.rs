//! What the target gives each training row, kept on disk (`--target_cache_dir`): one
//! safetensors file per row, named by the SHA-256 of the row's key, under a manifest that
//! names the target and the layers read. A later run on the same rows (a resumed one, another
//! learning rate, more epochs, a continued draft) reads them back instead of running the
//! target. A row's targets depend on its own tokens, positions and packed sequences alone,
//! which make its key. A row is written either while the target generates its completion
//! (`TargetCache::keep_generated`: the decode loop's numbers) or when training first meets it
//! (`Eagle3Loss::run_row`: one full pass); the two agree to rounding, and whichever was
//! written is what every later read, a resumed run's included, gets.
//!
//! Each file holds `key` (u32, the row's key: its tokens, then positions, then sequence ids),
//! `features` (f32 `[n, 3·d]`), `last` (f32 `[n, d]`: the final normed hidden state),
//! `log_z` (f32 `[n]`) and `argmax` (i64 `[n]`), readable by any safetensors reader. Files
//! are written atomically (a temporary file, then a rename), so a run killed midway leaves
//! whole rows only. A file that cannot be read back (damaged, or another row's) is computed
//! again and rewritten, with a warning.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use kd_model::LlamaConfig;
use kd_model::weights::RawTensor;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::RowTargets;
use crate::error::{PipelineError, Result};

/// The manifest file of a target-rows directory.
pub const TARGET_ROWS_MANIFEST: &str = "manifest.json";

/// The `format` of a target-rows manifest and of each row file's metadata.
const FORMAT: &str = "kd-eagle3-target-rows";

/// What determines the rows of a target-rows directory: the target (its files'
/// fingerprint, `kd_teacher::model_fingerprint`) and the hidden states kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetRowsManifest {
    /// Always `kd-eagle3-target-rows`.
    pub format: String,
    /// Format version (1).
    pub version: u32,
    /// The target's fingerprint.
    pub target: String,
    /// The three feature layers, then the target's layer count (its final hidden state), in
    /// Hugging Face's `output_hidden_states` indexing.
    pub layers: Vec<usize>,
    /// The target's hidden size.
    pub hidden_size: usize,
}

impl TargetRowsManifest {
    /// The manifest of rows from the target of fingerprint `target` (configuration `config`),
    /// features of `layers`.
    pub fn new(target: String, layers: [usize; 3], config: &LlamaConfig) -> Self {
        let mut kept = layers.to_vec();
        kept.push(config.num_hidden_layers);
        Self {
            format: FORMAT.to_string(),
            version: 1,
            target,
            layers: kept,
            hidden_size: config.hidden_size,
        }
    }

    /// `key: held …, this run …` for each field that differs.
    fn differences(&self, run: &Self) -> Vec<String> {
        let mut out = Vec::new();
        let mut check = |key: &str, held: String, now: String| {
            if held != now {
                out.push(format!("{key}: held {held}, this run {now}"));
            }
        };
        check("format", self.format.clone(), run.format.clone());
        check("version", self.version.to_string(), run.version.to_string());
        check("target", self.target.clone(), run.target.clone());
        check(
            "layers",
            format!("{:?}", self.layers),
            format!("{:?}", run.layers),
        );
        check(
            "hidden_size",
            self.hidden_size.to_string(),
            run.hidden_size.to_string(),
        );
        out
    }
}

/// A directory of target rows (see the module's documentation).
#[derive(Debug)]
pub(super) struct DiskRows {
    /// `DIR/rows`.
    rows: PathBuf,
    /// Cleared by the first write that fails (warned once); reads go on.
    writing: AtomicBool,
}

impl DiskRows {
    /// Opens `dir`, made with its manifest where it does not exist; refused, naming each
    /// difference, where it holds rows of another target or other layers.
    pub(super) fn open(dir: &Path, manifest: &TargetRowsManifest) -> Result<Self> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| PipelineError::Io { path, source }
        };
        let file = dir.join(TARGET_ROWS_MANIFEST);
        let again = format!(
            "delete {} or choose another --target_cache_dir",
            dir.display()
        );
        match std::fs::read(&file) {
            Ok(bytes) => {
                let held: TargetRowsManifest = serde_json::from_slice(&bytes).map_err(|e| {
                    PipelineError::Config(format!(
                        "--target_cache_dir: {} is not a target-rows manifest ({e}): {again}",
                        file.display()
                    ))
                })?;
                let differences = held.differences(manifest);
                if !differences.is_empty() {
                    return Err(PipelineError::Config(format!(
                        "--target_cache_dir {} holds the rows of another target or other \
                         layers ({}): {again}",
                        dir.display(),
                        differences.join("; ")
                    )));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(dir).map_err(io(dir))?;
                let json = serde_json::to_vec_pretty(manifest).expect("a manifest serialises");
                kd_kernels::write_atomic(&file, &json).map_err(io(&file))?;
            }
            Err(e) => return Err(io(&file)(e)),
        }
        let rows = dir.join("rows");
        std::fs::create_dir_all(&rows).map_err(io(&rows))?;
        Ok(Self {
            rows,
            writing: AtomicBool::new(true),
        })
    }

    /// The file of the row keyed `key`.
    fn path(&self, key: &[u32]) -> PathBuf {
        let mut h = Sha256::new();
        for k in key {
            h.update(k.to_le_bytes());
        }
        let name: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        self.rows.join(format!("{name}.safetensors"))
    }

    /// The row keyed `key`, if a whole file of it is there.
    pub(super) fn read(&self, key: &[u32]) -> Option<RowTargets> {
        let path = self.path(key);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "a kept target row could not be read: the target runs on it again");
                return None;
            }
        };
        match decode(&bytes, key) {
            Ok(row) => Some(row),
            Err(why) => {
                tracing::warn!(path = %path.display(), why, "a kept target row could not be read: the target runs on it again");
                None
            }
        }
    }

    /// Writes the row keyed `key` (atomically). Returns whether it was written; after the
    /// first failure (warned) no more rows are written.
    pub(super) fn write(&self, key: &[u32], row: &RowTargets) -> bool {
        if !self.writing.load(Ordering::Relaxed) {
            return false;
        }
        let path = self.path(key);
        match kd_kernels::write_atomic(&path, &encode(key, row)) {
            Ok(()) => true,
            Err(e) => {
                if self.writing.swap(false, Ordering::Relaxed) {
                    tracing::warn!(path = %path.display(), error = %e, "writing a target row failed: the rows not written yet run through the target in later runs (this run keeps them in memory up to --target_cache_mb)");
                }
                false
            }
        }
    }
}

/// The row file's bytes.
fn encode(key: &[u32], row: &RowTargets) -> Vec<u8> {
    let n = row.argmax.len();
    let d = row.last.len() / n.max(1);
    let le = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let tensors = [
        (
            "key",
            RawTensor {
                dtype: Dtype::U32,
                shape: vec![key.len()],
                bytes: key.iter().flat_map(|x| x.to_le_bytes()).collect(),
            },
        ),
        (
            "features",
            RawTensor {
                dtype: Dtype::F32,
                shape: vec![n, 3 * d],
                bytes: le(&row.features),
            },
        ),
        (
            "last",
            RawTensor {
                dtype: Dtype::F32,
                shape: vec![n, d],
                bytes: le(&row.last),
            },
        ),
        (
            "log_z",
            RawTensor {
                dtype: Dtype::F32,
                shape: vec![n],
                bytes: le(&row.log_z),
            },
        ),
        (
            "argmax",
            RawTensor {
                dtype: Dtype::I64,
                shape: vec![n],
                bytes: row.argmax.iter().flat_map(|x| x.to_le_bytes()).collect(),
            },
        ),
    ];
    let metadata = HashMap::from([("format".to_string(), FORMAT.to_string())]);
    safetensors::serialize(tensors.iter().map(|(k, v)| (*k, v)), Some(metadata))
        .expect("a row's tensors serialise")
}

/// The row keyed `key` from a row file's bytes, or why they are not one.
fn decode(bytes: &[u8], key: &[u32]) -> std::result::Result<RowTargets, String> {
    let (_, metadata) = SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())?;
    if metadata.metadata().as_ref().and_then(|m| m.get("format")) != Some(&FORMAT.to_string()) {
        return Err(format!("not a {FORMAT} file"));
    }
    let file = SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    let tensor = |name: &str, dtype: Dtype| {
        let t = file.tensor(name).map_err(|e| format!("{name}: {e}"))?;
        if t.dtype() != dtype {
            return Err(format!("{name}: {:?}, not {dtype:?}", t.dtype()));
        }
        Ok((t.shape().to_vec(), t.data()))
    };
    let words = |b: &[u8]| -> Vec<[u8; 4]> {
        b.chunks_exact(4)
            .map(|c| c.try_into().expect("four bytes"))
            .collect()
    };
    let (_, held) = tensor("key", Dtype::U32)?;
    if words(held)
        .into_iter()
        .map(u32::from_le_bytes)
        .ne(key.iter().copied())
    {
        return Err("the file holds another row (its key differs)".into());
    }
    // A key holds three numbers per position.
    let n = key.len() / 3;
    let floats = |name: &str, cols: Option<usize>| -> std::result::Result<Vec<f32>, String> {
        let (shape, data) = tensor(name, Dtype::F32)?;
        let fits = shape.first() == Some(&n)
            && match cols {
                Some(c) => shape.len() == 2 && shape[1] == c,
                None => shape.len() == 1,
            };
        if !fits {
            return Err(format!("{name}: shape {shape:?} for {n} positions"));
        }
        Ok(words(data).into_iter().map(f32::from_le_bytes).collect())
    };
    let (shape, _) = tensor("last", Dtype::F32)?;
    let d = *shape.get(1).ok_or("last: not a matrix")?;
    let (shape, data) = tensor("argmax", Dtype::I64)?;
    if shape != [n] {
        return Err(format!("argmax: shape {shape:?} for {n} positions"));
    }
    Ok(RowTargets {
        features: floats("features", Some(3 * d))?,
        last: floats("last", Some(d))?,
        log_z: floats("log_z", None)?,
        argmax: data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("eight bytes")))
            .collect(),
    })
}

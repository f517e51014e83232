//! Checkpoints: `checkpoint-{step}` and `checkpoint-epoch-{e}` directories written whole into
//! a temporary directory and renamed, pruning of old step checkpoints, and finding the one to
//! resume from.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::metrics::LogRecord;

/// The directory inside a checkpoint that holds what exact resume needs.
pub const TRAINING_STATE_DIR: &str = "training_state";
/// Scalars of the training state.
pub const STATE_FILE: &str = "state.json";
/// Optimizer moments.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The learned hidden-state projection (PyTorch layout `[d_T, d_S]`, key `weight`).
pub const PROJECTION_FILE: &str = "projection.safetensors";
/// Log history (Hugging Face `trainer_state.json` style).
pub const TRAINER_STATE_FILE: &str = "trainer_state.json";

/// Where a run stands; with the optimizer moments and the weights it determines the rest of
/// the run exactly (data order and dropout masks are derived from the seed, the epoch and the
/// step).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingState {
    /// Optimizer steps done.
    pub global_step: usize,
    /// The epoch the next step belongs to.
    pub epoch: usize,
    /// The next micro-batch of that epoch's plan.
    pub next_micro_batch: usize,
    /// Steps planned in all.
    pub total_steps: usize,
    /// Optimizer steps taken (differs from `global_step` by the skipped ones).
    pub optimizer_steps: u64,
    /// Non-finite steps in a row at the time of saving.
    pub consecutive_nonfinite: usize,
    /// Non-finite steps skipped so far.
    pub skipped_steps: usize,
    /// The settings a resumed run must share (seed, batch layout, schedule, data size).
    pub fingerprint: serde_json::Value,
}

/// `trainer_state.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps done.
    pub global_step: usize,
    /// Fractional epoch.
    pub epoch: f64,
    /// Steps planned.
    pub max_steps: usize,
    /// Logging period.
    pub logging_steps: usize,
    /// Saving period.
    pub save_steps: usize,
    /// Rows per micro-batch per device.
    pub train_batch_size: usize,
    /// Every logging step so far.
    pub log_history: Vec<LogRecord>,
}

/// Writes a checkpoint atomically: `fill` writes into a fresh temporary directory inside
/// `output_dir`, which is then renamed to `name` (replacing an older one of that name).
pub fn write_checkpoint(
    output_dir: &Path,
    name: &str,
    fill: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    let tmp = output_dir.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| TrainError::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| TrainError::io(&tmp, e))?;
    if let Err(e) = fill(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    // Make the contents durable before the directory becomes visible under its name.
    for entry in walk(&tmp) {
        if let Ok(f) = std::fs::File::open(&entry) {
            let _ = f.sync_all();
        }
    }
    let target = output_dir.join(name);
    if target.exists() {
        let old = output_dir.join(format!(".old-{name}-{}", std::process::id()));
        std::fs::rename(&target, &old).map_err(|e| TrainError::io(&target, e))?;
        let _ = std::fs::remove_dir_all(&old);
    }
    std::fs::rename(&tmp, &target).map_err(|e| TrainError::io(&target, e))?;
    if let Ok(d) = std::fs::File::open(output_dir) {
        let _ = d.sync_all();
    }
    Ok(target)
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// Step checkpoints (`checkpoint-{n}`) in `output_dir`, oldest first.
pub fn step_checkpoints(output_dir: &Path) -> Vec<(usize, PathBuf)> {
    let mut out: Vec<(usize, PathBuf)> = std::fs::read_dir(output_dir)
        .map(|it| {
            it.flatten()
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let n = name.strip_prefix("checkpoint-")?.parse::<usize>().ok()?;
                    e.path().is_dir().then_some((n, e.path()))
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// Removes the oldest step checkpoints beyond `limit` (epoch checkpoints are kept).
pub fn prune(output_dir: &Path, limit: usize) -> Result<Vec<PathBuf>> {
    let all = step_checkpoints(output_dir);
    let mut removed = Vec::new();
    if all.len() > limit {
        for (_, p) in &all[..all.len() - limit] {
            std::fs::remove_dir_all(p).map_err(|e| TrainError::io(p, e))?;
            removed.push(p.clone());
        }
    }
    Ok(removed)
}

/// Reads a checkpoint's training state.
pub fn read_state(dir: &Path) -> Result<TrainingState> {
    let path = dir.join(TRAINING_STATE_DIR).join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|_| TrainError::Checkpoint {
        path: dir.to_path_buf(),
        message: format!(
            "no {TRAINING_STATE_DIR}/{STATE_FILE}: not a complete checkpoint of this trainer"
        ),
    })?;
    serde_json::from_str(&text).map_err(|e| TrainError::Checkpoint {
        path: dir.to_path_buf(),
        message: format!("invalid {STATE_FILE}: {e}"),
    })
}

/// The checkpoint to resume from: a directory, or `latest` (the complete checkpoint with
/// the most steps in `output_dir`; temporary directories of interrupted saves are ignored).
pub fn resolve_resume(output_dir: &Path, spec: &str) -> Result<PathBuf> {
    if spec != "latest" {
        let p = PathBuf::from(spec);
        read_state(&p)?;
        return Ok(p);
    }
    let mut best: Option<(usize, PathBuf)> = None;
    if let Ok(entries) = std::fs::read_dir(output_dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with("checkpoint-") || !e.path().is_dir() {
                continue;
            }
            if let Ok(state) = read_state(&e.path())
                && best.as_ref().is_none_or(|(s, _)| state.global_step > *s)
            {
                best = Some((state.global_step, e.path()));
            }
        }
    }
    best.map(|(_, p)| p).ok_or_else(|| TrainError::Checkpoint {
        path: output_dir.to_path_buf(),
        message: "resume_from_checkpoint = latest, but there is no complete checkpoint here".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_prune_and_latest() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        for step in [2usize, 4, 6] {
            write_checkpoint(out, &format!("checkpoint-{step}"), |d| {
                let state = TrainingState {
                    global_step: step,
                    epoch: 0,
                    next_micro_batch: 0,
                    total_steps: 10,
                    optimizer_steps: step as u64,
                    consecutive_nonfinite: 0,
                    skipped_steps: 0,
                    fingerprint: serde_json::Value::Null,
                };
                std::fs::create_dir_all(d.join(TRAINING_STATE_DIR)).unwrap();
                std::fs::write(
                    d.join(TRAINING_STATE_DIR).join(STATE_FILE),
                    serde_json::to_string(&state).unwrap(),
                )
                .unwrap();
                Ok(())
            })
            .unwrap();
        }
        // A failed save leaves nothing behind.
        let e = write_checkpoint(out, "checkpoint-8", |_| {
            Err(TrainError::Config("boom".into()))
        });
        assert!(e.is_err());
        assert!(!out.join("checkpoint-8").exists());
        // An interrupted save (temporary directory) is not a checkpoint.
        std::fs::create_dir_all(out.join(".tmp-checkpoint-9-1")).unwrap();
        assert_eq!(
            resolve_resume(out, "latest").unwrap(),
            out.join("checkpoint-6")
        );
        prune(out, 2).unwrap();
        let left: Vec<usize> = step_checkpoints(out).into_iter().map(|(n, _)| n).collect();
        assert_eq!(left, vec![4, 6]);
        let empty = tempfile::tempdir().unwrap();
        assert!(resolve_resume(empty.path(), "latest").is_err());
    }
}

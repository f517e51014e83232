//! A pipeline's output directory: what a run writes there, and clearing an earlier run.

use std::path::Path;

use crate::error::{PipelineError, Result};

/// Removes an earlier run's checkpoints, TensorBoard events, `training_log.txt`,
/// `trainer_state.json` and the pipeline's own files named in `also` (never the teacher
/// cache).
pub fn clear_run(out: &Path, also: &[&str]) -> Result<()> {
    let entries = std::fs::read_dir(out).map_err(|e| PipelineError::io(out, e))?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        let ours = name.starts_with("checkpoint-")
            || name == "runs"
            || ["training_log.txt", kd_train::checkpoint::TRAINER_STATE_FILE]
                .contains(&name.as_str())
            || also.contains(&name.as_str());
        if !ours {
            continue;
        }
        let removed = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed.map_err(|e| PipelineError::io(&path, e))?;
    }
    Ok(())
}

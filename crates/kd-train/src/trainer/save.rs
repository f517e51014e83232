//! The checkpoints due after a step, written atomically with the optimizer and counters.

use std::path::PathBuf;

use crate::checkpoint::{
    OPTIMIZER_FILE, STATE_FILE, TRAINER_STATE_FILE, TRAINING_STATE_DIR, TrainerState,
    TrainingState, prune, write_checkpoint,
};
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::model::{Trainable, all_finite};
use crate::optim::AdamW;

/// The checkpoint of a run stopped on request after a step that had none due.
pub(crate) fn save_stop_checkpoint<M: Trainable>(
    config: &TrainConfig,
    model: (&M, &AdamW),
    state: (&TrainingState, &TrainerState),
    epoch_done: bool,
) -> Result<PathBuf> {
    let saved = save_checkpoints(config, model, state, epoch_done, true)?;
    Ok(saved
        .into_iter()
        .next()
        .expect("a forced save writes a checkpoint"))
}

/// The checkpoints due after a step (periodic, end of epoch, the last step, or any step when
/// `forced`: a stop on request), written atomically with the optimizer and counters; prunes
/// old ones. Returns their paths.
pub(crate) fn save_checkpoints<M: Trainable>(
    config: &TrainConfig,
    (model, optimizer): (&M, &AdamW),
    (state, history): (&TrainingState, &TrainerState),
    epoch_done: bool,
    forced: bool,
) -> Result<Vec<PathBuf>> {
    let out = &config.output_dir;
    let mut names = Vec::new();
    let last = state.global_step == state.total_steps;
    let periodic =
        forced || config.save_steps > 0 && state.global_step.is_multiple_of(config.save_steps);
    // The last step always leaves a checkpoint (an epoch checkpoint when it ends an epoch).
    if periodic || (last && !(config.save_epoch_checkpoints && epoch_done)) {
        names.push(format!("checkpoint-{}", state.global_step));
    }
    if config.save_epoch_checkpoints && epoch_done {
        names.push(format!("checkpoint-epoch-{}", state.epoch));
    }
    if names.is_empty() {
        return Ok(Vec::new());
    }
    if !all_finite(model) {
        return Err(TrainError::NonFinite {
            count: state.consecutive_nonfinite.max(1),
            step: state.global_step,
        });
    }
    let mut paths = Vec::with_capacity(names.len());
    for name in names {
        let path = write_checkpoint(out, &name, |dir| {
            model.save_files(dir)?;
            let ts = dir.join(TRAINING_STATE_DIR);
            std::fs::create_dir_all(&ts).map_err(|e| TrainError::io(&ts, e))?;
            optimizer.save(&ts.join(OPTIMIZER_FILE))?;
            let s = serde_json::to_string_pretty(state).expect("state serialises");
            std::fs::write(ts.join(STATE_FILE), s).map_err(|e| TrainError::io(&ts, e))?;
            let h = serde_json::to_string_pretty(history).expect("history serialises");
            std::fs::write(dir.join(TRAINER_STATE_FILE), h).map_err(|e| TrainError::io(dir, e))?;
            Ok(())
        })?;
        paths.push(path);
    }
    if let Some(limit) = config.save_total_limit {
        prune(out, limit)?;
    }
    Ok(paths)
}

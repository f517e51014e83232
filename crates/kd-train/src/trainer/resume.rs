//! The model, optimizer and counters a run starts from: fresh, or a checkpoint's.

use crate::checkpoint::{
    OPTIMIZER_FILE, TRAINER_STATE_FILE, TRAINING_STATE_DIR, TrainerState, TrainingState,
    read_state, resolve_resume,
};
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::model::Trainable;
use crate::optim::AdamW;
use crate::trainer::plan::RunPlan;

pub(crate) struct Resumed<M> {
    pub model: M,
    pub optimizer: AdamW,
    pub state: TrainingState,
    pub history: TrainerState,
}

/// Fresh state, or the state of `config.resume_from_checkpoint` after checking that its
/// fingerprint equals the run's (an error lists the settings that differ).
pub(crate) fn resume<M: Trainable>(
    config: &TrainConfig,
    run: &RunPlan,
    model: M,
) -> Result<Resumed<M>> {
    let fresh = TrainingState {
        global_step: 0,
        epoch: 0,
        next_micro_batch: 0,
        total_steps: run.total_steps,
        optimizer_steps: 0,
        consecutive_nonfinite: 0,
        skipped_steps: 0,
        fingerprint: run.fingerprint.clone(),
    };
    let Some(spec) = &config.resume_from_checkpoint else {
        return Ok(Resumed {
            model,
            optimizer: AdamW::default(),
            state: fresh,
            history: TrainerState::default(),
        });
    };
    let dir = resolve_resume(&config.output_dir, spec)?;
    let saved = read_state(&dir)?;
    if saved.fingerprint != run.fingerprint {
        let mut diffs = Vec::new();
        if let (Some(a), Some(b)) = (saved.fingerprint.as_object(), run.fingerprint.as_object()) {
            for (k, v) in b {
                if a.get(k) != Some(v) {
                    let mut d = format!(
                        "{k}: checkpoint {} vs now {v}",
                        a.get(k).cloned().unwrap_or_default()
                    );
                    if k == "data_parallel" {
                        d.push_str(
                            " (shards per micro-batch = ranks × accumulation_shards: resume with \
                             the same number of ranks, or with accumulation_shards making the \
                             same product, which continues exactly)",
                        );
                    }
                    diffs.push(d);
                }
            }
        }
        return Err(TrainError::Checkpoint {
            path: dir,
            message: format!(
                "the run's settings differ from the checkpoint's: {}",
                diffs.join("; ")
            ),
        });
    }
    let device = model.device();
    let model = model.load_files(&dir)?;
    let optimizer = AdamW::load(
        &dir.join(TRAINING_STATE_DIR).join(OPTIMIZER_FILE),
        saved.optimizer_steps,
        &device,
    )?;
    let history = read_history(&dir)?;
    tracing::info!(checkpoint = %dir.display(), step = saved.global_step, "resuming");
    Ok(Resumed {
        model,
        optimizer,
        state: saved,
        history,
    })
}

/// A checkpoint's `trainer_state.json` (its log history); absent is an empty history (the
/// file is informational), unreadable is an error naming it.
fn read_history(dir: &std::path::Path) -> Result<TrainerState> {
    let path = dir.join(TRAINER_STATE_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(TrainerState::default()),
        Err(e) => return Err(TrainError::io(&path, e)),
    };
    serde_json::from_str(&text).map_err(|e| TrainError::Checkpoint {
        path: dir.to_path_buf(),
        message: format!(
            "{TRAINER_STATE_FILE} is not valid ({e}): restore it from a copy, or delete it to \
             resume with an empty log history"
        ),
    })
}

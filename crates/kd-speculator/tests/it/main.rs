//! The speculator pipeline end to end on the demo fixtures.

mod eagle3;
mod magpie;
mod speculator;
mod speculator_eagle3;

pub fn fixtures() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// `speculator export` of `draft` to `out` for `to`, the verifier left to its default and
/// three speculative tokens.
pub fn export_config(
    draft: &std::path::Path,
    out: std::path::PathBuf,
    to: kd_speculator::ExportTarget,
) -> kd_speculator::ExportConfig {
    kd_speculator::ExportConfig {
        draft: draft.to_path_buf(),
        out,
        to,
        verifier: None,
        speculative_tokens: 3,
        gguf_type: Default::default(),
    }
}

/// Copies a directory tree (a run's output, to cut and resume).
pub fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).unwrap();
        }
    }
}

/// A copy of the finished run `full` at `cut` as a run killed after its first epoch leaves
/// it: every checkpoint but `checkpoint-epoch-0` gone, the teacher cache kept.
pub fn cut_after_first_epoch(full: &std::path::Path, cut: &std::path::Path) {
    copy_dir(full, cut);
    for e in std::fs::read_dir(cut).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("checkpoint-") && name != "checkpoint-epoch-0" {
            std::fs::remove_dir_all(e.path()).unwrap();
        }
    }
}

/// Asserts that `files` of the two runs' `checkpoint-epoch-1` hold the same bytes.
pub fn same_last_checkpoint(full: &std::path::Path, cut: &std::path::Path, files: &[&str]) {
    for f in files {
        let a = std::fs::read(full.join("checkpoint-epoch-1").join(f)).unwrap();
        let b = std::fs::read(cut.join("checkpoint-epoch-1").join(f)).unwrap();
        assert!(a == b, "{f} differs after resuming");
    }
}

/// The bundled demo pair.
pub fn demo() -> std::path::PathBuf {
    fixtures().join("demo")
}

/// The demo pipeline at test size: 240 prompts (24 held out), 32 new tokens.
pub fn small(out: &std::path::Path) -> kd_speculator::SpeculatorConfig {
    kd_speculator::SpeculatorConfig {
        target_model: demo().join("target"),
        draft_model: demo().join("draft"),
        data_dir: demo().join("data"),
        output_dir: out.to_path_buf(),
        max_samples: Some(240),
        num_epochs: 3,
        learning_rate: 3e-3,
        lora_r: 16,
        lora_alpha: 32.0,
        max_new_tokens: 32,
        eval_max_new_tokens: 32,
        eval_fraction: 0.1,
        save_steps: 1000,
        logging_steps: 5,
        ..kd_speculator::SpeculatorConfig::default()
    }
}

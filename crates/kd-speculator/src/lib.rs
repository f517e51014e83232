//! The speculator pipeline: a target model generates completions for the
//! prompts of `data_dir/*/batch_input.jsonl`; a draft model with LoRA adapters learns them
//! (cross-entropy on the completion tokens, optionally the hidden-state MSE through a learned
//! projection and a top-k KD term); checkpoints in PEFT layout; acceptance of the draft
//! before and after training measured by real speculative decoding on held-out prompts.
//!
//! ```no_run
//! use kd_speculator::{Quiet, SpeculatorConfig, run};
//!
//! # fn main() -> kd_speculator::Result<()> {
//! let config = SpeculatorConfig {
//!     target_model: "models/Llama-3.1-8B-Instruct".into(),
//!     draft_model: "models/Llama-3.2-1B-Instruct".into(),
//!     data_dir: "data/sft_llama".into(),
//!     ..SpeculatorConfig::default()
//! };
//! let summary = run(&config, &mut Quiet)?;
//! if let Some(a) = &summary.acceptance {
//!     let (before, after) = (a.before.as_ref().unwrap(), a.after.as_ref().unwrap());
//!     println!("{:.2} → {:.2}", before.mean_accepted_length, after.mean_accepted_length);
//! }
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod acceptance;
pub mod config;
mod data;
pub mod eagle3;
mod error;
mod export;
mod loss;
pub mod magpie;
mod observe;
mod plan;
mod run;
mod settings;
mod setup;
mod teacher;
mod tools;

pub use config::{DraftHeadInit, DraftMethod, SpeculatorConfig};
pub use error::{PipelineError, Result, error_report};
pub use export::{ExportConfig, ExportTarget, GgufWeightType, export};
pub use observe::{Phase, Quiet, SpeculatorObserver};
pub use plan::{Plan, plan};
pub use run::{SpeculatorSummary, run};
pub use tools::{
    EvalConfig, EvalOutcome, KeepLayers, ServeTeacherConfig, derive_draft, eval, merge,
    serve_teacher,
};

/// The pieces [`run`] is made of, for callers that run some of them on their own (benches,
/// studies): the setup, the prompts and examples, the trainer's settings, the loss.
pub mod phases {
    pub use crate::data::{
        Examples, LongPrompts, PromptSet, build_examples, drop_long_prompts, eval_count,
        load_prompts, prompt_limit,
    };
    pub use crate::loss::{SpeculatorLoss, TeacherTargets};
    pub use crate::settings::{
        eval_options, generation_params, lora_config, on_policy_config, train_config,
    };
    pub use crate::setup::{Setup, check_output_dir, check_vocabularies, setup, teacher_cache_dir};
    pub use crate::tools::adapter_base;
}

/// The files a run writes in its output directory and reads back.
pub mod files {
    pub use crate::acceptance::{
        AcceptanceFile, CheckpointAcceptance, read_acceptance, write_eval_report,
    };
    pub use crate::setup::{ACCEPTANCE_FILE, RUN_CONFIG_FILE, TEACHER_CACHE_DIR};
}

/// Stop signals and exit statuses of a run's process, for binaries (kd-pipeline's).
pub mod process {
    pub use kd_pipeline::{EXIT_STOPPED, QuietRank, StopSignals, exit_status};
}

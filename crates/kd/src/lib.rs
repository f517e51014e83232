//! kd — knowledge distillation and speculator (draft-model) training on Burn, in one
//! dependency.
//!
//! The pieces a user composes, re-exported by area, and a [`prelude`] with the names most
//! programs need: load a model, train LoRA on prompt/completion data, measure a draft by
//! speculative decoding.
//!
//! ```no_run
//! use kd::prelude::*;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let device = parse_device("cpu")?;
//! let target = Llama::load("fixtures/demo/target", &device)?;
//! let draft = Llama::load("fixtures/demo/draft", &device)?;
//! let tokenizer = ChatTokenizer::from_dir("fixtures/demo/target")?;
//! let data = vec![PromptCompletion::new("Say hi.", "Hi!")];
//! let (examples, _) = tokenizer.prompt_completion_examples(&data, &ExampleOptions::default())?;
//! let config = TrainConfig { output_dir: "out".into(), num_epochs: 1, ..TrainConfig::default() };
//! let draft = draft.apply_lora(&LoraConfig::default())?;
//! let (trained, _) = Trainer::new(config, &CausalLmLoss { weight: 1.0 })
//!     .run(TrainModel::new(draft), &examples)?;
//! let prompts = vec![tokenizer.encode_prompt(&[Message::user("Say hi.")])?];
//! let report = evaluate(&target, &trained.llama.merge_and_unload(), &prompts,
//!     &EvalOptions::default(), |_, _, _| {})?;
//! println!("acceptance {:.1}%", 100.0 * report.acceptance_rate);
//! # Ok(()) }
//! ```
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub use kd_data as data;
/// Data-parallel ranks: call [`dist::init`] first in a program that `mpirun` may start; the
/// trainer then trains as one rank of the job.
pub use kd_dist as dist;
pub use kd_distill as distill;
pub use kd_eval as eval;
pub use kd_lora as lora;
pub use kd_loss as loss;
pub use kd_model as model;
pub use kd_pipeline as pipeline;
pub use kd_speculator as speculator;
pub use kd_teacher as teacher;
pub use kd_train as train;

/// The names most programs use.
pub mod prelude {
    pub use kd_data::{ChatTokenizer, Example, ExampleOptions, Message, PromptCompletion};
    pub use kd_eval::{AcceptanceReport, EvalOptions, evaluate};
    pub use kd_model::{Llama, LoraConfig, parse_device};
    pub use kd_train::{CausalLmLoss, TrainConfig, TrainModel, Trainer};
}

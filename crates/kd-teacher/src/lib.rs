//! Teacher inference for distillation and speculator training.
//!
//! - [`Teacher`]: `generate` (completions, optional per-token log-probs) and `score` (top-k
//!   log-probs at every position).
//! - [`LocalTeacher`]: a kd-model Llama in this process; batched generation with the KV cache,
//!   rows finishing independently (finished rows leave the batch), greedy or temperature /
//!   top-k / top-p sampling from per-prompt seeded streams (results do not depend on
//!   batching), stop on eos ids.
//! - [`GenerationCache`]: completions on disk in atomically written shards under a manifest
//!   of what determines them; an interrupted run resumes without losing or repeating a
//!   prompt, a mismatching cache is refused with the differences.
#![warn(missing_docs)]

mod cache;
mod error;
mod local;
mod sampling;
mod types;

pub use cache::{
    CacheManifest, CacheProgress, GenerationCache, MANIFEST, model_fingerprint, prompts_hash,
    template_hash,
};
pub use error::{Result, TeacherError};
pub use local::{LocalTeacher, Prompt, Teacher};
pub use sampling::next_token;
pub use types::{FinishReason, Generation, SamplingParams, Scores};

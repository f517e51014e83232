//! Teacher inference for distillation and speculator training.
//!
//! - [`Teacher`]: `generate` (completions, optional per-token log-probs) and `score` (top-k
//!   log-probs at every position).
//! - [`LocalTeacher`]: a kd-model Llama in this process; batched generation with the KV cache,
//!   rows finishing independently (finished rows leave the batch), greedy or temperature /
//!   top-k / top-p sampling from per-prompt seeded streams (results do not depend on
//!   batching), stop on eos ids.
//! - [`RemoteTeacher`]: SGLang's `/generate` or an OpenAI-compatible `/v1/completions`
//!   server, with bounded concurrency, timeouts, retries with backoff and jitter, validated
//!   responses.
//! - [`spawn_server`] / [`router`]: the local teacher served over those two APIs.
//! - [`GenerationCache`]: completions on disk in atomically written shards under a manifest
//!   of what determines them; an interrupted run resumes without losing or repeating a
//!   prompt, a mismatching cache is refused with the differences.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod cache;
mod error;
mod local;
mod remote;
mod serve;
mod types;
mod wire;

pub use cache::{
    CacheManifest, CacheProgress, GenerationCache, MANIFEST, ScoreCache, ScoreCacheManifest,
    model_fingerprint, prompts_hash, sequences_hash, template_hash,
};
pub use error::{Result, TeacherError};
pub use kd_model::FinishReason;
pub use local::{LocalTeacher, Prompt, ReplicatedTeacher, Teacher, stream_seed};
pub use remote::{RemoteApi, RemoteConfig, RemoteTeacher};
pub use serve::{ServeConfig, ServerHandle, api_key_from_env, router, spawn_server};
pub use types::{Generation, LAST_HIDDEN_LAYER, LayerHidden, SamplingParams, ScoreOptions, Scores};

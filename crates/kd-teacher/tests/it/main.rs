//! kd-teacher integration tests: generation against transformers, batching invariance,
//! sampling determinism, scoring, the cache (resume after SIGKILL, mismatches), the remote
//! backends against the server (equality, faults, errors).

mod cache;
mod generation;
mod llamacpp;
mod remote;
mod smollm2;

use std::path::PathBuf;

use kd_model::Llama;
use kd_teacher::{LocalTeacher, Prompt};

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

pub fn teacher(batch: usize) -> LocalTeacher {
    let dir = fixtures().join("tiny-models/tiny-llama3");
    let model = Llama::load(&dir, &burn::tensor::Device::flex()).unwrap();
    LocalTeacher::new(model, batch, kd_teacher::model_fingerprint(&dir).unwrap())
}

/// Deterministic prompts over the tiny vocabulary, of varied lengths.
pub fn prompts(n: usize) -> Vec<Prompt> {
    (0..n)
        .map(|i| Prompt {
            index: i as u64,
            ids: (0..2 + i % 7)
                .map(|j| (1 + (i * 31 + j * 17) % 250) as u32)
                .collect(),
        })
        .collect()
}

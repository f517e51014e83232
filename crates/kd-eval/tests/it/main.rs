//! kd-eval integration tests: greedy speculative decoding equals the target's greedy output
//! (batched, rows finishing independently, stop tokens, several drafts and k); sampled
//! speculative decoding follows the target's distribution; the acceptance report.

mod greedy;
mod report;
mod sampling;

use std::path::PathBuf;

use burn::tensor::Device;
use kd_model::Llama;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

pub fn load(name: &str) -> Llama {
    Llama::load(fixtures().join("tiny-models").join(name), &Device::flex())
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Deterministic prompts over the tiny vocabulary (256), of varied lengths.
pub fn prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            (0..2 + i % 6)
                .map(|j| (4 + (i * 37 + j * 11) % 250) as u32)
                .collect()
        })
        .collect()
}

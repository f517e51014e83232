//! Losses for knowledge distillation and speculator training, on Burn 0.22.
//!
//! The contract is `docs/src/loss-contract.md`: distributions (full vocabulary or the teacher's
//! top-k, with kd and teacher temperatures), the objectives ([`KdObjective`]: forward,
//! reverse, skewed forward/reverse and adaptive KL, Jensen–Shannon, total variation),
//! cross-entropy, the hidden-state MSE with a learned projection, masks, and normalisation by a
//! global token count the caller passes.
//!
//! Two implementations share one API ([`KernelPath`]):
//! - the fused host kernels (CPU backend): one pass per row computes the loss and its
//!   gradient together, reading the logits in place; the gradient reaches autodiff through a
//!   custom backward op, so peak extra memory is the gradient itself plus O(vocab) per thread;
//! - the reference path in Burn's generic tensor ops (any backend, autodiff through it), which
//!   tests hold to the same PyTorch numbers.
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use kd_loss::{kd_loss, KdConfig, KdObjective, Teacher};
//!
//! let device = Device::flex().autodiff();
//! let student = Tensor::<2>::from_floats([[1.0, 2.0, 0.5], [0.1, 0.2, 0.3]], &device).require_grad();
//! let teacher = Tensor::<2>::from_floats([[1.5, 1.0, 0.0], [0.3, 0.2, 0.1]], &device);
//! let config = KdConfig { logits_topk: 0, ..KdConfig::new(KdObjective::ForwardKl) };
//! let out = kd_loss(student.clone(), Teacher::Logits(teacher), &[true, true], 2.0, &config).unwrap();
//! let grads = out.loss.backward();
//! assert!(student.grad(&grads).is_some());
//! assert!(out.stats.acceptance_rate() > 0.5);
//! ```
#![warn(missing_docs)]

mod chunked;
mod config;
mod eagle3;
mod error;
mod fused;
mod hidden;
pub mod kernels;
mod linear;
mod linear_kd;
mod loss;
mod reference;
mod shift;

pub use chunked::{CHUNK_ELEMENTS, chunk_rows, linear_cross_entropy_chunked, linear_kd_chunked};
pub use config::{KdConfig, KdObjective, SparseStudent};
pub use eagle3::{
    ReducedLogits, TTT_DECAY, TttStepCounts, TttTargets, ttt_acceptance_rate, ttt_loss,
    ttt_step_counts, ttt_step_loss,
};
pub use error::{LossError, Result};
pub use fused::f32_view;
pub use hidden::{HiddenProjection, hidden_mse};
pub use linear::linear_cross_entropy;
pub use linear_kd::{LinearCe, LinearKdBackend, LinearKdJob, LinearKdOutput, linear_kd};
pub use loss::{
    KernelPath, LossOutput, LossStats, Teacher, cross_entropy, cross_entropy_with, kd_loss,
    kd_loss_and_grad, kd_loss_with, mean_accepted_length,
};
pub use shift::{IGNORE_INDEX, NextTokenTargets, next_token_targets};

/// The unit tests again at every lower instruction-set level (`KD_SIMD`), in child processes.
#[cfg(test)]
mod levels {
    #[test]
    fn unit_tests_pass_at_every_lower_level() {
        kd_kernels::testing::assert_passes_at_lower_levels(&[], &["levels::"]);
    }
}

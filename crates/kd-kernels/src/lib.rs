//! CPU math shared by `kd-model` and `kd-loss`, below both in the crate graph:
//!
//! - [`math`]: branch-free `exp` and `ln` that the compiler vectorises, and lane-parallel
//!   reductions with a fixed summation order;
//! - [`gemm`](mod@gemm): a safe, slice-based wrapper of the `gemm` crate's matrix product
//!   (every operand's extent is checked against its slice before any pointer is formed);
//! - [`cpu`]: run-time CPU-feature detection, the instruction-set level in use
//!   ([`cpu::level`], capped by `KD_SIMD`) and the [`dispatch!`] macro that compiles a
//!   kernel body for AVX-512, AVX2/FMA and the baseline target;
//! - [`testing`]: re-runs a test binary's kernel cases at every lower level;
//! - [`f32_view`]: the f32 values of a CPU (`flex`) tensor, borrowed when contiguous;
//! - [`SeededDraws`]: initial weights from a seed of their own, the values Burn's CPU backend
//!   draws after `device.seed(seed)` without its process-wide generator;
//! - [`on_pool`]: runs work with many small parallel operations on a worker of rayon's pool;
//!   [`keep_awake`] does so with the pool's other workers polling for work until it returns
//!   (decoding);
//! - [`write_atomic`]: the workspace's one atomic file write (temporary file, fsync, rename,
//!   fsync of the directory);
//! - [`IGNORE_INDEX`]: the label of positions that do not count.
//!
//! ```
//! use kd_kernels::gemm::{MatMut, MatRef, Threads, Write, matmul};
//!
//! // [2, 3] · [3, 2]
//! let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
//! let b = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
//! let mut c = [0.0f32; 4];
//! matmul(
//!     MatMut::row_major(&mut c, 2, 2).unwrap(),
//!     MatRef::row_major(&a, 2, 3).unwrap(),
//!     MatRef::row_major(&b, 3, 2).unwrap(),
//!     Write::Overwrite,
//!     1.0,
//!     Threads::One,
//! )
//! .unwrap();
//! assert_eq!(c, [4.0, 5.0, 10.0, 11.0]);
//! ```
#![warn(missing_docs)]

pub mod cpu;
#[cfg(feature = "flex")]
mod draws;
mod error;
mod fs;
#[cfg(feature = "gemm")]
pub mod gemm;
pub mod math;
mod pool;
pub mod testing;
#[cfg(feature = "flex")]
mod view;

#[cfg(feature = "flex")]
pub use draws::SeededDraws;
pub use error::KernelError;
pub use fs::write_atomic;
pub use pool::{keep_awake, on_pool};
#[cfg(feature = "flex")]
pub use view::f32_view;

/// The label of positions that do not count (PyTorch's `ignore_index` default).
pub const IGNORE_INDEX: i64 = -100;

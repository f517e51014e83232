//! The error type: the pipeline crates share `kd_pipeline`'s.

pub use kd_pipeline::{PipelineError, Result, error_report};

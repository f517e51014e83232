//! kd-train integration tests: optimizer against PyTorch, global token normalisation and
//! shards, a whole run with checkpoints and metrics, exact resume after SIGKILL; the
//! speculator and distill pipelines end to end.

mod util;

mod distill;
mod normalisation;
mod optimizer;
mod resume;
mod runs;
mod speculator;

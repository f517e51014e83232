//! kd-train integration tests: optimizer against PyTorch, global token normalisation and
//! shards, a whole run with checkpoints and metrics, exact resume after SIGKILL.

mod util;

mod normalisation;
mod optimizer;
mod resume;
mod runs;

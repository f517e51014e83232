//! Stopping a run cleanly when the job is preempted: Slurm and Kubernetes send SIGTERM (a
//! user at a terminal SIGINT) some time before they kill. [`StopSignals`] turns the first such
//! signal into a request the pipelines poll at their safe points (after an optimizer step,
//! after a teacher-cache shard); they then save what they did and return an error for which
//! [`PipelineError::is_stopped`](crate::PipelineError::is_stopped) holds. A second signal ends
//! the process at once.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kd_train::metrics::TrainObserver;

use crate::error::{PipelineError, Result};

/// Exit status of a binary whose run stopped on request with its work saved: `EX_TEMPFAIL`
/// (75) of `sysexits.h`, "try again later" — run the same command to continue.
pub const EXIT_STOPPED: u8 = 75;

/// The first SIGTERM or SIGINT, as a flag a run's observer reads
/// ([`TrainObserver::stop_requested`](kd_train::metrics::TrainObserver::stop_requested)).
#[derive(Debug, Clone)]
pub struct StopSignals {
    flag: Arc<AtomicBool>,
}

impl StopSignals {
    /// Installs the handlers for the whole process: the first SIGTERM or SIGINT sets the
    /// flag, a second one of either ends the process at once with status 128 + the signal's
    /// number. Elsewhere than on Unix, a flag that nothing sets.
    pub fn install() -> Result<Self> {
        let flag = Arc::new(AtomicBool::new(false));
        #[cfg(unix)]
        for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
            let err = |e: std::io::Error| {
                PipelineError::Config(format!("cannot handle signal {sig}: {e}"))
            };
            // Registered first, so that it sees the flag as the earlier signal left it.
            signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, Arc::clone(&flag))
                .map_err(err)?;
            signal_hook::flag::register(sig, Arc::clone(&flag)).map_err(err)?;
        }
        Ok(Self { flag })
    }

    /// A flag that only [`request`](Self::request) sets (tests, embedding programs).
    pub fn manual() -> Self {
        Self {
            flag: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Whether a stop was asked for.
    pub fn requested(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// Asks for a stop, as a signal would.
    pub fn request(&self) {
        self.flag.store(true, Ordering::SeqCst);
    }
}

/// `Break` once `observer` asks to stop: what a pipeline passes to the teacher caches'
/// `generate_while` / `score_while` (the finished shards stay on disk).
pub fn continue_unless_stopped(observer: &mut dyn TrainObserver) -> ControlFlow<()> {
    if observer.stop_requested() {
        ControlFlow::Break(())
    } else {
        ControlFlow::Continue(())
    }
}

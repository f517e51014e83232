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

/// The observer of a data-parallel rank other than 0: it draws and prints nothing (rank 0
/// reports the run) and relays this process's stop signals, so that a SIGTERM any rank
/// receives stops every rank at the same step.
#[derive(Debug, Clone)]
pub struct QuietRank {
    /// The signals relayed.
    pub stop: StopSignals,
}

impl TrainObserver for QuietRank {
    fn stop_requested(&mut self) -> bool {
        self.stop.requested()
    }
}

/// How a binary's run ends, as one rank of a data-parallel job or alone: `Ok` a success,
/// `Err(Some(e))` a pipeline error, `Err(None)` any other failure. Shuts MPI down with the other
/// ranks where they all reached the same point (a success, a training stop they agreed on), and
/// otherwise aborts the job, since the others may be waiting for this rank. Returns the status to
/// exit with: 0, [`EXIT_STOPPED`] for a stop on request, or 1.
pub fn exit_status(outcome: std::result::Result<(), Option<&PipelineError>>) -> u8 {
    match outcome {
        Ok(()) => kd_dist::exit_together(0),
        Err(Some(e)) if e.stopped_together() => kd_dist::exit_together(EXIT_STOPPED),
        Err(Some(e)) if e.is_stopped() => kd_dist::exit(EXIT_STOPPED),
        Err(_) => kd_dist::exit(1),
    }
}

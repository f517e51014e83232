//! Ranks and collectives for data-parallel runs.
//!
//! A process is either alone ([`World::alone`]: rank 0 of 1, nothing loaded) or one rank of a
//! job an MPI launcher started — `mpirun -np N …`, `srun --mpi=pmix …`, Kubeflow's MPI
//! Operator — in which case [`init`] opens the MPI library **at run time** (Open MPI's
//! `libmpi.so.40`, or `KD_MPI_LIB`) and the ranks talk through it. Loading at run time rather
//! than linking keeps MPI out of the build: a newcomer without MPI builds and runs everything,
//! one binary serves both cases, and the test suite exercises the MPI path wherever `mpirun`
//! is installed, with the same build.
//!
//! - [`launch`]: what the environment says about the launch.
//! - [`World`]: rank, size, rank on this machine (which device a rank takes), and the
//!   collectives training needs — sums of `f32`/`f64` buffers (gradients, losses), a gather of
//!   bytes (metrics), a barrier.
//! - [`init`] / [`world`] / [`finish`]: the process's world, initialised once by a binary;
//!   libraries read it with [`world`] (alone until [`init`] ran).
//!
//! A rank that fails must not leave the others waiting in a collective: [`finish`] with an
//! error calls `MPI_Abort`, which ends every rank of the job; a rank killed outright (SIGKILL,
//! out of memory) is noticed by the launcher, which ends the others.
#![warn(missing_docs)]

mod error;
pub mod launch;
mod mpi;

use std::sync::{Mutex, OnceLock};

pub use error::{DistError, Result};
pub use launch::Launch;

use mpi::Mpi;

/// This process's place in the job and the means to talk to the other ranks.
pub struct World {
    rank: usize,
    size: usize,
    local_rank: usize,
    local_size: usize,
    mpi: Option<Mutex<Mpi>>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_rank", &self.local_rank)
            .field("local_size", &self.local_size)
            .field("mpi", &self.mpi.is_some())
            .finish()
    }
}

impl World {
    /// One process, alone: rank 0 of 1; every collective is the identity.
    pub fn alone() -> Self {
        Self {
            rank: 0,
            size: 1,
            local_rank: 0,
            local_size: 1,
            mpi: None,
        }
    }

    /// The world the environment describes: alone without a launcher, else MPI initialised
    /// from the library `KD_MPI_LIB` names or Open MPI's.
    pub fn from_env() -> Result<Self> {
        match launch::detect(&|k| std::env::var(k).ok())? {
            Launch::Alone => Ok(Self::alone()),
            Launch::Mpi { launcher } => {
                let mpi = Mpi::open(std::env::var("KD_MPI_LIB").ok(), launcher)?;
                let (rank, size, local_rank, local_size) = mpi.ranks()?;
                tracing::debug!(rank, size, local_rank, library = %mpi.path, version = %mpi.version, "MPI initialised");
                Ok(Self {
                    rank,
                    size,
                    local_rank,
                    local_size,
                    mpi: Some(Mutex::new(mpi)),
                })
            }
        }
    }

    /// This rank (0-based).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This rank among the ranks on the same machine: the index into a device list.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Ranks on this machine.
    pub fn local_size(&self) -> usize {
        self.local_size
    }

    /// Whether this rank writes the run's files (rank 0).
    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    /// " (rank R of N)" across ranks, "" alone: for messages a rank prints.
    pub fn label(&self) -> String {
        if self.is_distributed() {
            format!(" (rank {} of {})", self.rank, self.size)
        } else {
            String::new()
        }
    }

    /// Whether other ranks take part.
    pub fn is_distributed(&self) -> bool {
        self.size > 1
    }

    /// The MPI library's version line, when one is loaded.
    pub fn library(&self) -> Option<String> {
        self.mpi
            .as_ref()
            .map(|m| with(m, |m| format!("{} ({})", m.version, m.path)))
    }

    /// Sums `data` element-wise over the ranks, in place (every rank passes the same length).
    pub fn all_reduce_sum_f32(&self, data: &mut [f32]) -> Result<()> {
        match &self.mpi {
            Some(m) if self.size > 1 => with(m, |m| m.all_reduce_f32(data)),
            _ => Ok(()),
        }
    }

    /// Sums `data` element-wise over the ranks, in place (every rank passes the same length).
    pub fn all_reduce_sum_f64(&self, data: &mut [f64]) -> Result<()> {
        match &self.mpi {
            Some(m) if self.size > 1 => with(m, |m| m.all_reduce_f64(data)),
            _ => Ok(()),
        }
    }

    /// Every rank's `mine`, in rank order (lengths may differ).
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        match &self.mpi {
            Some(m) if self.size > 1 => with(m, |m| m.all_gather_bytes(mine, self.size)),
            _ => Ok(vec![mine.to_vec()]),
        }
    }

    /// Whether any rank says `flag` (e.g. a stop request one rank received).
    pub fn any(&self, flag: bool) -> Result<bool> {
        let mut v = [f64::from(u8::from(flag))];
        self.all_reduce_sum_f64(&mut v)?;
        Ok(v[0] > 0.0)
    }

    /// Runs `work` on rank 0 first and then, once it has returned, on the other ranks (a
    /// collective): for what must exist before they look — a cache's manifest, an output
    /// directory. Alone: just `work`.
    pub fn root_first<T, E: From<DistError>>(
        &self,
        work: impl FnOnce() -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        if !self.is_distributed() {
            return work();
        }
        if self.is_root() {
            let out = work();
            self.barrier()?;
            out
        } else {
            self.barrier()?;
            work()
        }
    }

    /// Waits until every rank reaches this point.
    pub fn barrier(&self) -> Result<()> {
        match &self.mpi {
            Some(m) if self.size > 1 => with(m, Mpi::barrier),
            _ => Ok(()),
        }
    }
}

fn with<T>(m: &Mutex<Mpi>, f: impl FnOnce(&Mpi) -> T) -> T {
    let guard = m.lock().unwrap_or_else(|p| p.into_inner());
    f(&guard)
}

static WORLD: OnceLock<World> = OnceLock::new();

/// `mpirun -np N` for N ranks on this machine, as tests and benchmarks start them: Open MPI's
/// `mpirun` from `PATH` (or `KD_MPIRUN`), more ranks than cores allowed (`--oversubscribe`),
/// as root when this process is (`--allow-run-as-root`), one compute thread per rank
/// (`RAYON_NUM_THREADS=1` unless set). `None` when no `mpirun` is found.
pub fn local_mpirun(ranks: usize) -> Option<std::process::Command> {
    let program = std::env::var("KD_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    let found = std::process::Command::new(&program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        return None;
    }
    let mut cmd = std::process::Command::new(program);
    cmd.args(["-np", &ranks.to_string(), "--oversubscribe"]);
    // The effective user (the third field of `Uid:`) is root's, 0: Open MPI refuses root
    // without the flag.
    let root = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            == Some("0")
    });
    if root {
        cmd.arg("--allow-run-as-root");
    }
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        cmd.args(["-x", "RAYON_NUM_THREADS=1"]);
    }
    Some(cmd)
}

/// A binary's exit after an outcome every rank reached at the same point (success, or a stop
/// the ranks agreed on): MPI is shut down with the other ranks, and `code` is the status to
/// exit with (1 when shutting down failed, said on stderr).
pub fn exit_together(code: u8) -> u8 {
    match finish(Ok(())) {
        Ok(()) => code,
        Err(e) => {
            eprintln!("error{}: {e}", world().label());
            1
        }
    }
}

/// A binary's exit: [`finish`] with `code` (0: success), and the status to exit with (1 when
/// shutting MPI down failed, said on stderr).
pub fn exit(code: u8) -> u8 {
    match finish(if code == 0 {
        Ok(())
    } else {
        Err(i32::from(code))
    }) {
        Ok(()) => code,
        Err(e) => {
            eprintln!("error{}: {e}", world().label());
            1
        }
    }
}

/// Initialises this process's world from the environment ([`World::from_env`]) once; later
/// calls return the same world. Binaries call it first thing.
pub fn init() -> Result<&'static World> {
    if let Some(w) = WORLD.get() {
        return Ok(w);
    }
    let w = World::from_env()?;
    Ok(WORLD.get_or_init(|| w))
}

/// This process's world: the one [`init`] made, or alone when it was not called. The world is
/// fixed by whichever of the two runs first: a program that `mpirun` may start calls [`init`]
/// before anything that reads the world (a trainer, a pipeline).
pub fn world() -> &'static World {
    WORLD.get_or_init(World::alone)
}

/// Ends this rank's part in the job. `Ok`: MPI is shut down in step with the other ranks.
/// `Err(code)`: the whole job is aborted with `code` (the other ranks may be waiting in a
/// collective this rank will never join), and this function does not return then; alone it
/// returns and the caller exits as usual.
pub fn finish(outcome: std::result::Result<(), i32>) -> Result<()> {
    let Some(w) = WORLD.get() else {
        return Ok(());
    };
    let Some(m) = &w.mpi else {
        return Ok(());
    };
    match outcome {
        Ok(()) => with(m, Mpi::finalize),
        Err(code) => {
            if w.size > 1 {
                with(m, |m| m.abort(code));
            }
            with(m, Mpi::finalize)
        }
    }
}

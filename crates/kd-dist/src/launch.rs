//! How this process was started: alone, or as one rank of a job that an MPI launcher started
//! (mpirun/mpiexec, `srun --mpi=pmix`, Kubeflow's MPI Operator, which runs mpirun).

use crate::error::{DistError, Result};

/// What the environment says about the launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Launch {
    /// No launcher: one process, no MPI library loaded.
    Alone,
    /// A launcher's process-management interface is present: MPI is initialised and tells the
    /// rank and size. `launcher` names the variable that said so (for messages).
    Mpi {
        /// The variable that marked the launch (`OMPI_COMM_WORLD_SIZE`, `PMIX_RANK`, …).
        launcher: &'static str,
    },
}

/// Variables an MPI launcher sets in every rank's environment: Open MPI's mpirun, PMIx
/// (Open MPI 5's prterun, `srun --mpi=pmix`), and PMI-1/2 (MPICH's Hydra, `srun --mpi=pmi2`).
const MARKERS: [&str; 4] = ["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK"];

/// Reads the launch from environment variables through `var` (`std::env::var` in a process).
///
/// A Slurm step of several tasks without any MPI process-management interface (a plain `srun`
/// where `srun --mpi=pmix` was meant) is an error: each task would otherwise train alone on
/// the whole data and write the same files.
pub fn detect(var: &dyn Fn(&str) -> Option<String>) -> Result<Launch> {
    if let Some(launcher) = MARKERS.iter().find(|k| var(k).is_some()) {
        return Ok(Launch::Mpi { launcher });
    }
    let tasks = var("SLURM_STEP_NUM_TASKS").or_else(|| var("SLURM_NTASKS"));
    if var("SLURM_PROCID").is_some()
        && let Some(n) = tasks.and_then(|t| t.trim().parse::<usize>().ok())
        && n > 1
    {
        return Err(DistError::Launch(format!(
            "Slurm started {n} tasks (SLURM_NTASKS) but none of them can reach the others: no \
             MPI process-management interface is in the environment ({}). Launch with \
             `srun --mpi=pmix …` (or `mpirun`), or with one task (`srun -n 1`)",
            MARKERS.join(", ")
        )));
    }
    Ok(Launch::Alone)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn no_launcher_is_one_process() {
        assert_eq!(detect(&env(&[])).unwrap(), Launch::Alone);
        // One Slurm task without MPI: alone.
        let one = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")];
        assert_eq!(detect(&env(&one)).unwrap(), Launch::Alone);
    }

    #[test]
    fn launchers_are_recognised() {
        for (k, v) in [
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("PMIX_RANK", "1"),
            ("PMI_SIZE", "4"),
            ("PMI_RANK", "0"),
        ] {
            match detect(&env(&[(k, v)])).unwrap() {
                Launch::Mpi { launcher } => assert_eq!(launcher, k),
                other => panic!("{k}: {other:?}"),
            }
        }
        // srun --mpi=pmix sets PMIX_RANK beside Slurm's variables.
        let pmix = [
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "8"),
            ("PMIX_RANK", "1"),
        ];
        assert!(matches!(detect(&env(&pmix)).unwrap(), Launch::Mpi { .. }));
    }

    #[test]
    fn slurm_tasks_without_mpi_are_refused() {
        let plain = [("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4")];
        let e = detect(&env(&plain)).unwrap_err().to_string();
        assert!(
            e.contains("4 tasks") && e.contains("srun --mpi=pmix"),
            "{e}"
        );
    }
}

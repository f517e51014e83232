//! `distill`: ROLL's distill pipeline, driven by ROLL's YAML. Flags and Hydra-style overrides
//! → [`kd_distill::load`] → [`kd_distill::run`]; everything else here is display.
//!
//! ```text
//! distill --config_path examples/distill --config_name demo                 # like ROLL
//! distill --config examples/distill/demo.yaml max_steps=20 kd_objective=js_divergence
//! distill --config run.yaml +teacher.url=http://127.0.0.1:30000 logits_transfer_backend=ray
//! ```

mod display;
#[cfg(feature = "hub-download")]
#[path = "../../common/download_bar.rs"]
mod download_bar;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Result, bail};
use clap::Parser;

use crate::display::{Display, print_summary};

/// ROLL's distill pipeline: the teacher scores question/answer data, the student learns with
/// (1 − distill_loss_weight)·CE + distill_loss_weight·KD.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    /// Directory of the YAML configuration (ROLL's `--config_path`).
    #[arg(long = "config_path", alias = "config-path", value_name = "DIR")]
    config_path: Option<PathBuf>,
    /// Name of the YAML file in that directory, with or without `.yaml` (ROLL's
    /// `--config_name`).
    #[arg(long = "config_name", alias = "config-name", value_name = "NAME")]
    config_name: Option<String>,
    /// The YAML configuration file (instead of `--config_path` + `--config_name`).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["config_path", "config_name"])]
    config: Option<PathBuf>,
    /// Print the resolved configuration and the warnings, then stop.
    #[arg(long = "dry_run", alias = "dry-run")]
    dry_run: bool,
    /// Hydra-style overrides: `key.sub=value`, `+key=value` (add), `++key=value` (add or
    /// replace), `~key` (remove).
    #[arg(value_name = "OVERRIDE", allow_hyphen_values = false)]
    overrides: Vec<String>,
}

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DISTILL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // One rank of a data-parallel job when an MPI launcher started this process (mpirun,
    // srun --mpi=pmix); alone otherwise.
    let world = match kd_dist::init() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Hub ids the cache lacks are downloaded with a progress bar (by the rank that fetches).
    #[cfg(feature = "hub-download")]
    kd_pipeline::hub::set_download_observer(Box::<download_bar::DownloadBar>::default());
    let result = run(cli);
    if let Err(e) = &result {
        eprintln!(
            "error{}: {}",
            world.label(),
            kd_distill::error_report(e.as_ref())
        );
    }
    let pipeline = result
        .as_ref()
        .map_err(|e| e.downcast_ref::<kd_distill::PipelineError>());
    if pipeline.is_err_and(|p| p.is_some_and(|p| p.is_stopped())) && world.is_root() {
        eprintln!(
            "the same command continues: with resume_from_checkpoint=true once \
                         training had started (exit status {})",
            kd_distill::process::EXIT_STOPPED
        );
    }
    // Across ranks, a success shuts MPI down with the others; a failure ends the whole job
    // (the other ranks may be waiting for this one).
    ExitCode::from(kd_distill::process::exit_status(pipeline.map(|_| ())))
}

fn run(cli: Cli) -> Result<()> {
    let file = match (&cli.config, &cli.config_path, &cli.config_name) {
        (Some(f), _, _) => Some(f.clone()),
        (None, Some(dir), Some(name)) => Some(kd_distill::config_file(dir, name)),
        (None, None, None) => None,
        _ => bail!("give both --config_path DIR and --config_name NAME (or --config FILE)"),
    };
    let loaded = kd_distill::load(file.as_deref(), &cli.overrides)?;
    for w in &loaded.warnings {
        eprintln!("warning: {w}");
    }
    if cli.dry_run {
        println!("{}", kd_distill::to_yaml(&loaded.config));
        let out = &loaded.config.output_dir;
        if let Some(holder) = kd_distill::process::RunLock::holder(out)? {
            eprintln!(
                "warning: output_dir {} is in use by another run ({holder}): this run would be \
                 refused until it ends",
                out.display()
            );
        }
        return Ok(());
    }
    kd_train::retain_freed_memory();
    let stop = kd_distill::process::StopSignals::install()?;
    if !kd_dist::world().is_root() {
        // Rank 0 reports the run.
        kd_distill::run(&loaded.config, &mut kd_distill::process::QuietRank { stop })?;
        return Ok(());
    }
    let mut display = Display::new(stop);
    let summary = kd_distill::run(&loaded.config, &mut display);
    display.finish();
    print_summary(&summary?);
    Ok(())
}

//! `speculator`: trains a draft model for speculative decoding on a target model's
//! generations, with the speculator seed's flags (`--target_model`, `--lora_r`, …; kebab-case
//! spellings work too). Flags → [`kd_speculator::SpeculatorConfig`] →
//! [`kd_speculator::run`]; everything else here is display.
//!
//! ```text
//! speculator --target_model T --draft_model D --data_dir data --output_dir out   # = train
//! speculator train --config run.yaml --num_epochs 1                              # flags win
//! speculator eval --target_model T --draft_model D --adapter out/checkpoint-epoch-2 --data_dir data
//! speculator merge --adapter out/checkpoint-epoch-2 --out merged
//! speculator serve-teacher --target_model T --listen 0.0.0.0:30000 --api_key_env VAR
//! speculator derive-draft --from T --keep 2 --out draft
//! speculator --draft_method eagle3 --target_model T --data_dir data --output_dir out
//! speculator export --draft out/checkpoint-epoch-2 --to vllm --out served
//! ```

mod args;
mod display;
#[cfg(feature = "hub-download")]
#[path = "../../common/download_bar.rs"]
mod download_bar;

use std::process::ExitCode;

use anyhow::Result;
use clap::FromArgMatches;

use crate::args::{Cli, Command, command};
use crate::display::{Display, print_report, print_summary};

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SPECULATOR_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
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
    let result = run();
    if let Err(e) = &result {
        eprintln!(
            "error{}: {}",
            world.label(),
            kd_speculator::error_report(e.as_ref())
        );
    }
    let pipeline = result
        .as_ref()
        .map_err(|e| e.downcast_ref::<kd_speculator::PipelineError>());
    if pipeline.is_err_and(|p| p.is_some_and(|p| p.is_stopped())) && world.is_root() {
        eprintln!(
            "the same command continues: with --resume_from_checkpoint latest once \
                         training had started (exit status {})",
            kd_speculator::process::EXIT_STOPPED
        );
    }
    // Across ranks, a success shuts MPI down with the others; a failure ends the whole job
    // (the other ranks may be waiting for this one).
    ExitCode::from(kd_speculator::process::exit_status(pipeline.map(|_| ())))
}

fn run() -> Result<()> {
    let matches = command().get_matches();
    let cli = Cli::from_arg_matches(&matches)?;
    match cli.command {
        None => train(args::train_config(&cli.train, &matches)?, cli.train.dry_run),
        Some(Command::Train(t)) => {
            let sub = matches
                .subcommand_matches("train")
                .expect("the train subcommand");
            train(args::train_config(&t, sub)?, t.dry_run)
        }
        Some(Command::Eval(e)) => {
            let config = e.config();
            let mut display = Display::new(kd_speculator::process::StopSignals::manual());
            let root = kd_dist::world().is_root();
            let outcome = kd_speculator::eval(&config, |phase, done, total| {
                if root {
                    display.eval_progress(phase, done, total)
                }
            })?;
            display.finish();
            if !root {
                // Rank 0 reports.
                return Ok(());
            }
            if let Some(w) = outcome.too_long.warning() {
                eprintln!("warning: {w}");
            }
            let report = outcome.report;
            print_report("acceptance", &report);
            if let Some(path) = &e.output {
                let chart = kd_speculator::files::write_eval_report(path, &report)?;
                println!(
                    "report written to {} (per-position acceptance: {})",
                    path.display(),
                    chart.display()
                );
            }
            Ok(())
        }
        Some(Command::Merge(m)) => {
            kd_speculator::merge(&m.adapter, m.base_model.as_deref(), &m.out, m.dtype())?;
            println!(
                "merged {} into a Hugging Face model directory: {}\n  serve it as the draft, e.g. \
                 SGLang --speculative-draft-model-path {}",
                m.adapter.display(),
                m.out.display(),
                m.out.display()
            );
            Ok(())
        }
        Some(Command::DeriveDraft(a)) => {
            let layers = kd_speculator::derive_draft(&a.from, &a.keep(), &a.out)?;
            println!(
                "derived a {}-layer draft (layers {layers:?} of {}) in {}",
                layers.len(),
                a.from.display(),
                a.out.display()
            );
            Ok(())
        }
        Some(Command::Export(x)) => {
            let config = x.config();
            let verifier = kd_speculator::export(&config)?;
            let out = config.out.display();
            match (config.to, verifier) {
                (kd_speculator::ExportTarget::Gguf, Some(t)) => println!(
                    "wrote {out} for llama.cpp: llama-server -m {t} -md {out} \
                     --spec-type draft-eagle3"
                ),
                (_, None) => println!(
                    "wrote {out} for SGLang: --speculative-algorithm EAGLE3 \
                     --speculative-draft-model-path {out}"
                ),
                (_, Some(v)) => println!(
                    "wrote {out} in the speculators format for vLLM (verifier {v}): \
                     vllm serve {out}"
                ),
            }
            Ok(())
        }
        Some(Command::ServeTeacher(s)) => {
            let config = s.config();
            let handle = kd_speculator::serve_teacher(&config)?;
            println!(
                "serving {} at {} (SGLang /generate, OpenAI /v1/completions); Ctrl-C stops",
                config.target_model.display(),
                handle.url()
            );
            handle.wait()?;
            Ok(())
        }
    }
}

fn train(config: kd_speculator::SpeculatorConfig, dry_run: bool) -> Result<()> {
    if dry_run {
        let plan = kd_speculator::plan(&config)?;
        println!("dry run: nothing was read beyond configs and prompts, nothing written");
        for w in &plan.warnings {
            println!("warning: {w}");
        }
        let width = plan.items.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        for (k, v) in &plan.items {
            println!("  {k:>width$}  {v}");
        }
        return Ok(());
    }
    kd_train::retain_freed_memory();
    let stop = kd_speculator::process::StopSignals::install()?;
    if !kd_dist::world().is_root() {
        // Rank 0 reports the run.
        kd_speculator::run(&config, &mut kd_speculator::process::QuietRank { stop })?;
        return Ok(());
    }
    let mut display = Display::new(stop);
    let summary = kd_speculator::run(&config, &mut display);
    display.finish();
    print_summary(&summary?);
    Ok(())
}

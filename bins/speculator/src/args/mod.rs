//! The command line: the seed's flags with their names and defaults (snake_case, as the seed
//! writes them; every `--a_b` is also accepted as `--a-b`), the subcommands, and the layering
//! of `--config FILE.yaml` under the flags given.

use std::collections::BTreeMap;
use std::str::FromStr;

use clap::{CommandFactory, Parser, Subcommand};
use kd_speculator::SpeculatorConfig;
use serde::Serialize;

mod tools;
mod train;

pub use tools::{DeriveArgs, EvalArgs, ExportArgs, MergeArgs, ServeArgs};
pub use train::{TrainArgs, train_config};

fn d() -> SpeculatorConfig {
    SpeculatorConfig::default()
}

/// A serde enum's name (`cosine`, `forward_kl`, `sglang`).
fn name<T: Serialize>(v: T) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// A JSON object given on the command line (`--chat_template_kwargs '{"enable_thinking": false}'`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(transparent)]
pub struct JsonObject(pub BTreeMap<String, serde_json::Value>);

impl FromStr for JsonObject {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        serde_json::from_str(s).map(JsonObject).map_err(|e| {
            format!("expected a JSON object such as '{{\"enable_thinking\": false}}': {e}")
        })
    }
}

impl std::fmt::Display for JsonObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&serde_json::to_string(&self.0).map_err(|_| std::fmt::Error)?)
    }
}

/// Train a draft model for speculative decoding on a target model's generations.
///
/// Without a subcommand, `train` runs (so the seed's command lines work as written).
#[derive(Parser, Debug)]
#[command(
    name = "speculator",
    version,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    /// What to do (default: train).
    #[command(subcommand)]
    pub command: Option<Command>,
    /// `train`'s flags, accepted without the subcommand.
    #[command(flatten)]
    pub train: TrainArgs,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate with the target, train the draft's LoRA adapters, measure acceptance before
    /// and after (the default).
    Train(Box<TrainArgs>),
    /// The acceptance report of a target/draft pair (with an adapter or not).
    Eval(EvalArgs),
    /// Merge an adapter into its base model: a Hugging Face directory to serve as the draft.
    Merge(MergeArgs),
    /// Serve the target over SGLang's and OpenAI's HTTP APIs (generation on one machine,
    /// training on another with --teacher_url).
    ServeTeacher(ServeArgs),
    /// Derive a draft from a model: keep some decoder layers, share embeddings, norm and head.
    DeriveDraft(DeriveArgs),
    /// Write an EAGLE-3 draft (a checkpoint of --draft_method eagle3) for SGLang, vLLM or
    /// llama.cpp.
    Export(ExportArgs),
}

/// Adds the kebab-case spelling of every snake_case flag as an alias, in every subcommand.
fn kebab_aliases(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| match a.get_long().map(str::to_string) {
        // clap keeps `&'static str` names; the command is built once per process.
        Some(long) if long.contains('_') => {
            a.alias(&*Box::leak(long.replace('_', "-").into_boxed_str()))
        }
        _ => a,
    })
    .mut_subcommands(kebab_aliases)
}

/// The command with its aliases.
pub fn command() -> clap::Command {
    kebab_aliases(Cli::command())
}

#[cfg(test)]
mod tests;

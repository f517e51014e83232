//! The flags of the other subcommands: `eval`, `merge`, `serve-teacher`, `derive-draft`,
//! `export`.

use std::path::PathBuf;

use clap::Args;
use kd_eval::{EvalOptions, SpecConfig};
use kd_model::{Sampling, SaveDType};
use kd_speculator::{EvalConfig, KeepLayers, ServeTeacherConfig};

use super::{JsonObject, d};

/// `speculator export`.
#[derive(Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct ExportArgs {
    /// The EAGLE-3 draft directory (e.g. OUTPUT_DIR/checkpoint-epoch-2).
    #[arg(long)]
    pub draft: PathBuf,
    /// The server: `sglang` (SpecForge's layout), `vllm` (the speculators format) or `gguf`
    /// (llama.cpp's `eagle3` GGUF file).
    #[arg(long, value_parser = ["sglang", "vllm", "gguf"])]
    pub to: String,
    /// Where the exported directory goes (`--to gguf`: the .gguf file).
    #[arg(long)]
    pub out: PathBuf,
    /// `--to vllm`: the target as vLLM names it; `--to gguf`: the target's .gguf file, whose
    /// tokenizer the draft carries [default: the verifier a speculators-format draft names
    /// (`--to vllm`), else the run's --target_model].
    #[arg(long)]
    pub verifier: Option<String>,
    /// `--to vllm`: tokens drafted per verification written into the config.
    #[arg(long, default_value_t = 3)]
    pub speculative_tokens: usize,
    /// `--to gguf`: the type of the draft's matrices (norms stay f32).
    #[arg(long, default_value = "f16", value_parser = ["f32", "f16", "q8_0"])]
    pub gguf_type: String,
}

impl ExportArgs {
    /// The library configuration.
    pub fn config(&self) -> kd_speculator::ExportConfig {
        kd_speculator::ExportConfig {
            draft: self.draft.clone(),
            out: self.out.clone(),
            to: match self.to.as_str() {
                "vllm" => kd_speculator::ExportTarget::Vllm,
                "gguf" => kd_speculator::ExportTarget::Gguf,
                _ => kd_speculator::ExportTarget::Sglang,
            },
            verifier: self.verifier.clone(),
            speculative_tokens: self.speculative_tokens,
            gguf_type: match self.gguf_type.as_str() {
                "f32" => kd_speculator::GgufWeightType::F32,
                "q8_0" => kd_speculator::GgufWeightType::Q8_0,
                _ => kd_speculator::GgufWeightType::F16,
            },
        }
    }
}

/// `speculator derive-draft`.
#[derive(Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct DeriveArgs {
    /// The model to derive from (usually the target).
    #[arg(long)]
    pub from: PathBuf,
    /// Layer indices to keep, e.g. 0,4,8.
    #[arg(
        long,
        value_delimiter = ',',
        conflicts_with = "keep",
        required_unless_present = "keep"
    )]
    pub layers: Vec<usize>,
    /// Keep N layers spread evenly (first and last included).
    #[arg(long)]
    pub keep: Option<usize>,
    /// Where the draft goes.
    #[arg(long)]
    pub out: PathBuf,
}

impl DeriveArgs {
    /// The layers to keep.
    pub fn keep(&self) -> KeepLayers {
        match self.keep {
            Some(n) => KeepLayers::Evenly(n),
            None => KeepLayers::Layers(self.layers.clone()),
        }
    }
}

/// `speculator eval`.
#[derive(Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct EvalArgs {
    /// Path of the target model.
    #[arg(long)]
    pub target_model: PathBuf,
    /// Path of the draft model, or of an EAGLE-3 draft directory (a checkpoint of
    /// `--draft_method eagle3`, or SpecForge's export).
    #[arg(long)]
    pub draft_model: PathBuf,
    /// A PEFT adapter for the draft (e.g. a checkpoint of `speculator train`).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Directory containing */batch_input.jsonl files.
    #[arg(long)]
    pub data_dir: PathBuf,
    /// Prompts to use (a seeded sample).
    #[arg(long, default_value_t = 200)]
    pub max_samples: usize,
    /// Tokens drafted per verification.
    #[arg(long, default_value_t = d().eval_k)]
    pub eval_k: usize,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = d().eval_max_new_tokens)]
    pub eval_max_new_tokens: usize,
    /// Prompts decoded together.
    #[arg(long, default_value_t = d().eval_batch_size)]
    pub eval_batch_size: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = d().eval_temperature)]
    pub eval_temperature: f32,
    /// A draft/target cost ratio for the theoretical speedup (default: measured).
    #[arg(long)]
    pub cost_ratio: Option<f64>,
    /// Stop drafting a row early at the first draft whose probability under the draft is below
    /// this (llama.cpp's --draft-p-min); 0 always drafts --eval_k.
    #[arg(long, default_value_t = 0.0)]
    pub draft_p_min: f32,
    /// Decode the target (a GGUF file) with 8-bit activations and integer dot products.
    #[arg(long)]
    pub target_int8: bool,
    /// --target_int8 with the target's Q4_1 and Q8_0 products on AMX tiles (CPUs with
    /// AMX-INT8: Sapphire Rapids and later Xeons).
    #[arg(long)]
    pub target_amx: bool,
    /// Decode the draft from Q8_0 blocks of its weights, made at load (after merging the
    /// adapter).
    #[arg(long)]
    pub draft_q8_0: bool,
    /// Chat template variables as a JSON object (e.g. '{"enable_thinking": false}').
    #[arg(long, default_value_t = JsonObject::default())]
    pub chat_template_kwargs: JsonObject,
    /// Seed of the prompt sample and of sampling.
    #[arg(long, default_value_t = d().seed)]
    pub seed: u64,
    /// Device of both models.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Also write the report as JSON here, and its per-position acceptance as an SVG chart
    /// beside it (the same name, extension `svg`).
    #[arg(long)]
    pub output: Option<PathBuf>,
}

impl EvalArgs {
    /// The library configuration.
    pub fn config(&self) -> EvalConfig {
        EvalConfig {
            target_model: self.target_model.clone(),
            draft_model: self.draft_model.clone(),
            adapter: self.adapter.clone(),
            data_dir: self.data_dir.clone(),
            max_samples: Some(self.max_samples),
            device: self.device.clone(),
            chat_template_kwargs: self.chat_template_kwargs.0.clone(),
            target_int8: self.target_int8,
            target_amx: self.target_amx,
            draft_q8_0: self.draft_q8_0,
            options: EvalOptions {
                spec: SpecConfig {
                    k: self.eval_k,
                    max_new_tokens: self.eval_max_new_tokens,
                    sampling: Sampling::temperature(self.eval_temperature),
                    stop_token_ids: Vec::new(),
                    draft_p_min: self.draft_p_min,
                },
                batch_size: self.eval_batch_size,
                seed: self.seed,
                baselines: true,
                cost_ratio: self.cost_ratio,
            },
        }
    }
}

/// `speculator merge`.
#[derive(Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct MergeArgs {
    /// The adapter (a checkpoint directory).
    #[arg(long)]
    pub adapter: PathBuf,
    /// Where the merged model goes.
    #[arg(long)]
    pub out: PathBuf,
    /// The base model (default: the adapter's base_model_name_or_path).
    #[arg(long)]
    pub base_model: Option<PathBuf>,
    /// Weight dtype of the export: bf16, f16 or f32.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f16", "f32"])]
    pub dtype: String,
}

impl MergeArgs {
    /// The export dtype.
    pub fn dtype(&self) -> SaveDType {
        match self.dtype.as_str() {
            "f16" => SaveDType::F16,
            "f32" => SaveDType::F32,
            _ => SaveDType::BF16,
        }
    }
}

/// `speculator serve-teacher`.
#[derive(Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct ServeArgs {
    /// Path of the target model.
    #[arg(long)]
    pub target_model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:30000")]
    pub listen: String,
    /// Device.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Prompts generated together.
    #[arg(long, default_value_t = d().batch_size)]
    pub batch_size: usize,
    /// The model name reported to clients.
    #[arg(long, default_value = "teacher")]
    pub model_name: String,
    /// Require `Authorization: Bearer <key>` with the key in this environment variable
    /// (unset or empty is an error).
    #[arg(long)]
    pub api_key_env: Option<String>,
    /// Serve without a key on an address other than loopback (refused otherwise).
    #[arg(long)]
    pub allow_unauthenticated: bool,
    /// Most prompts in one request.
    #[arg(long, default_value_t = ServeTeacherConfig::default().server.max_prompts_per_request)]
    pub max_prompts_per_request: usize,
    /// Most new tokens a request may ask for per prompt.
    #[arg(long, default_value_t = ServeTeacherConfig::default().server.max_new_tokens)]
    pub max_new_tokens_limit: usize,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = ServeTeacherConfig::default().server.max_body_bytes)]
    pub max_body_bytes: usize,
}

impl ServeArgs {
    /// The library configuration.
    pub fn config(&self) -> ServeTeacherConfig {
        let mut c = ServeTeacherConfig {
            target_model: self.target_model.clone(),
            listen: self.listen.clone(),
            device: self.device.clone(),
            batch_size: self.batch_size,
            ..ServeTeacherConfig::default()
        };
        c.server.model_name = self.model_name.clone();
        c.server.allow_unauthenticated = self.allow_unauthenticated;
        c.server.max_prompts_per_request = self.max_prompts_per_request;
        c.server.max_new_tokens = self.max_new_tokens_limit;
        c.server.max_body_bytes = self.max_body_bytes;
        c.api_key_env = self.api_key_env.clone();
        c
    }
}

//! The dry run: everything a run checks before reading weights, and a description of the
//! run (sizes, steps, where files go).

use kd_model::{Llama, LlamaConfig};

use crate::config::{DraftMethod, SpeculatorConfig};
use crate::error::Result;
use crate::settings::{generation_params, lora_config, train_config};
use crate::setup::{Setup, setup, teacher_cache_dir};

/// What a run would do, established without reading any weight or writing anything.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Labelled lines: what, and its value.
    pub items: Vec<(String, String)>,
    /// Non-fatal problems.
    pub warnings: Vec<String>,
}

fn params(c: &LlamaConfig) -> String {
    format!(
        "{}, {} layers, hidden {}, vocab {}, {:.1}M parameters",
        c.family,
        c.num_hidden_layers,
        c.hidden_size,
        c.vocab_size,
        c.num_parameters() as f64 / 1e6
    )
}

/// The dry run: checks everything a run checks before loading weights and describes the
/// run (sizes, steps, where files go).
pub fn plan(config: &SpeculatorConfig) -> Result<Plan> {
    let given = config;
    let config = &config.with_local_models()?;
    let s = setup(config)?;
    crate::settings::check_decoding_flags(config, &s)?;
    let mut items = Vec::new();
    let mut put = |k: &str, v: String| items.push((k.to_string(), v));
    // Hub ids found in the Hugging Face cache: where they were found.
    for (what, id, path) in [
        ("target", &given.target_model, &config.target_model),
        ("draft", &given.draft_model, &config.draft_model),
    ] {
        if id != path {
            put(
                &format!("{what} id"),
                format!(
                    "{} found in the Hugging Face cache: {}",
                    id.display(),
                    path.display()
                ),
            );
        }
    }
    put("target", target_line(config, &s));
    let eagle3 = config.draft_method == DraftMethod::Eagle3;
    if !eagle3 {
        put(
            "draft",
            format!(
                "{} on {}: {}",
                config.draft_model.display(),
                config.draft_gpus,
                params(&s.draft_config)
            ),
        );
    }
    let p = &s.prompts;
    put(
        "prompts",
        format!(
            "{} from {} ({} for training, {} held out for acceptance; {} skipped, {} too \
             long for {} prompt tokens)",
            p.records.len(),
            config.data_dir.display(),
            p.train.len(),
            p.eval.len(),
            p.skipped.total(),
            p.too_long.ids.len(),
            p.too_long.max_prompt_tokens
        ),
    );
    put("generation", generation_line(config, p));
    let cache = teacher_cache_dir(config);
    let cached = std::fs::read_dir(cache.join("generations"))
        .map(|it| {
            it.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("shard-"))
                .count()
        })
        .unwrap_or(0);
    put(
        "teacher cache",
        format!(
            "{} ({cached} generation shards already there)",
            cache.display()
        ),
    );
    if eagle3 {
        for (k, v) in eagle3_plan(config, &s.draft_config, p) {
            put(&k, v);
        }
    } else {
        put("LoRA", lora_line(config, &s.draft_config));
    }
    for (k, v) in training_items(config, p.train.len()) {
        put(&k, v);
    }
    if !eagle3 {
        put("loss", lora_loss(config, &s));
    }
    if config.on_policy_ratio > 0.0 {
        put(
            "on-policy",
            format!(
                "{:.0}% of each step's rows completed by the draft (temperature {}, top-p {}, \
                 ≤ {} tokens), scored by the target, learned by {} · {} only",
                config.on_policy_ratio * 100.0,
                config.on_policy_temperature,
                config.on_policy_top_p,
                config.on_policy_max_new_tokens(),
                config.kd_weight,
                config.kd_objective().name(),
            ),
        );
    }
    put("acceptance", acceptance_line(config, &s));
    put(
        "output",
        format!(
            "{}: checkpoint-N/ (every {} steps, {} kept), checkpoint-epoch-E/, training_log.txt, \
             runs/, acceptance.json; teacher cache {}",
            config.output_dir.display(),
            config.save_steps,
            config.save_total_limit,
            teacher_cache_dir(config).display()
        ),
    );
    let mut warnings = s.warnings;
    if let Some(holder) = kd_pipeline::RunLock::holder(&config.output_dir)? {
        warnings.push(format!(
            "{} is in use by another run ({holder}): this run would be refused until it ends",
            config.output_dir.display()
        ));
    }
    Ok(Plan { items, warnings })
}

/// The dry run's line on the target.
fn target_line(config: &SpeculatorConfig, s: &Setup) -> String {
    match (&config.teacher_url, &s.target_config) {
        (Some(url), Some(c)) => format!(
            "{url} ({:?}); local copy: {}",
            config.teacher_api,
            params(c)
        ),
        (Some(url), None) => format!("{url} ({:?})", config.teacher_api),
        (None, Some(c)) => format!(
            "{} on {}: {}{}{}",
            config.target_model.display(),
            config.target_gpus,
            params(c),
            decode_note(&config.target_model, &s.target_devices),
            if config.target_amx {
                "; 8-bit activations, Q4_1/Q8_0 products on AMX tiles (--target_amx)"
            } else if config.target_int8 {
                "; 8-bit activations (--target_int8)"
            } else {
                ""
            }
        ),
        (None, None) => unreachable!("setup requires a local target without a URL"),
    }
}

/// How the target decodes, for a GGUF target on the CPU: from its packed blocks (each layer on
/// the host when every projection is packed) or from f32 copies.
fn decode_note(model: &std::path::Path, devices: &[burn::tensor::Device]) -> String {
    if devices.first() != Some(&burn::tensor::Device::flex()) {
        return String::new();
    }
    match Llama::packed_projections(model) {
        Ok(Some((n, total))) if n == total => format!(
            "; decodes from its {n} packed projections alone (no f32 copy of them is made), \
             each layer on the host"
        ),
        Ok(Some((0, _))) => {
            "; decodes from f32 copies (no Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K projection in the file)"
                .into()
        }
        Ok(Some((n, total))) => format!(
            "; decodes {n} of its {total} projections from their quantised blocks, the rest from \
             f32 copies, each layer as tensor operations"
        ),
        _ => String::new(),
    }
}

/// The dry run's line on the target's generation.
fn generation_line(config: &SpeculatorConfig, p: &crate::data::PromptSet) -> String {
    let prompt_tokens: usize = p.train.iter().map(|i| p.ids[*i].len()).sum();
    let g = generation_params(config);
    format!(
        "{} prompts ({prompt_tokens} prompt tokens), at most {} new tokens each, {}, batch {}",
        p.train.len(),
        g.max_new_tokens,
        if g.temperature == 0.0 {
            "greedy".to_string()
        } else {
            format!(
                "temperature {} top-p {} top-k {}",
                g.temperature, g.top_p, g.top_k
            )
        },
        config.batch_size
    )
}

/// The dry run's lines on ranks and training steps.
fn training_items(config: &SpeculatorConfig, train_prompts: usize) -> Vec<(String, String)> {
    let mut items = Vec::new();
    let mut t = train_config(config);
    // Across ranks the trainer splits each micro-batch N ways more.
    let world = kd_dist::world();
    t.accumulation_shards *= world.size();
    if world.is_distributed() {
        items.push((
            "ranks".to_string(),
            format!(
                "{} data-parallel ranks ({} on this machine), each on its share of every step",
                world.size(),
                world.local_size()
            ),
        ));
    }
    let micro = train_prompts.div_ceil(t.train_batch_size * t.accumulation_shards);
    let steps = micro.div_ceil(t.gradient_accumulation_steps) * t.num_epochs;
    items.push((
        "training".to_string(),
        format!(
            "about {steps} optimizer steps ({} epochs × {} steps), effective batch {}, lr {:e} {} \
             with {:.0}% warmup, weight decay {}, clip {}",
            t.num_epochs,
            micro.div_ceil(t.gradient_accumulation_steps),
            t.effective_batch_size(),
            t.learning_rate,
            serde_json::to_value(t.scheduler_type)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
            t.warmup_ratio * 100.0,
            t.weight_decay,
            t.max_grad_norm
        ),
    ));
    items
}

/// The dry run's line on a LoRA draft's adapters.
fn lora_line(config: &SpeculatorConfig, d: &LlamaConfig) -> String {
    let lora = lora_config(config);
    let per_layer: usize = lora_param_count(d, &config.lora_target_modules, lora.r);
    format!(
        "r {} α {} dropout {} on {}: {:.2}M trainable parameters ({:.2}% of the draft)",
        lora.r,
        lora.alpha,
        lora.dropout,
        config.lora_target_modules.join(","),
        (per_layer * d.num_hidden_layers) as f64 / 1e6,
        100.0 * (per_layer * d.num_hidden_layers) as f64 / d.num_parameters() as f64
    )
}

/// The dry run's line on a LoRA draft's loss terms.
fn lora_loss(config: &SpeculatorConfig, s: &Setup) -> String {
    let d = &s.draft_config;
    let mut loss = format!("{} · CE", config.ce_weight);
    if config.use_distillation {
        loss.push_str(&format!(
            " + {} · hidden MSE{}",
            config.distillation_weight,
            match &s.target_config {
                Some(tc) if tc.hidden_size != d.hidden_size =>
                    format!(" (projection {} → {})", d.hidden_size, tc.hidden_size),
                _ => String::new(),
            }
        ));
    }
    if config.kd_weight > 0.0 {
        loss.push_str(&format!(
            " + {} · {} over the target's top-{} at temperature {}",
            config.kd_weight,
            config.kd_objective().name(),
            config.kd_topk,
            config.temperature
        ));
    }
    loss
}

/// The dry run's line on the acceptance measurement.
fn acceptance_line(config: &SpeculatorConfig, s: &Setup) -> String {
    let p = &s.prompts;
    if p.eval.is_empty() || s.target_config.is_none() {
        "not measured".to_string()
    } else {
        format!(
            "{} held-out prompts, k = {}{}{}, {} new tokens, batch {}, {}; before and after training{}",
            p.eval.len(),
            config.eval_k,
            if config.eval_draft_p_min > 0.0 {
                format!(
                    " (fewer below draft probability {})",
                    config.eval_draft_p_min
                )
            } else {
                String::new()
            },
            if config.eval_draft_q8_0 {
                ", the draft from Q8_0 blocks"
            } else {
                ""
            },
            config.eval_max_new_tokens,
            config.eval_batch_size,
            if config.eval_temperature == 0.0 {
                "greedy".to_string()
            } else {
                format!("temperature {}", config.eval_temperature)
            },
            if config.eval_steps > 0 {
                format!(", and at checkpoints every {} steps", config.eval_steps)
            } else {
                String::new()
            }
        )
    }
}

/// The dry run's lines of an EAGLE-3 run: the draft, its features, its loss. `target` is the
/// target's configuration (the draft's width and vocabulary).
fn eagle3_plan(
    config: &SpeculatorConfig,
    target: &LlamaConfig,
    prompts: &crate::data::PromptSet,
) -> Vec<(String, String)> {
    let layers = crate::setup::aux_layers(config, target);
    let size = crate::setup::draft_vocab_size(config, target.vocab_size);
    let d = target.hidden_size;
    let (q, kv) = (
        target.num_attention_heads * target.head_dim,
        target.num_key_value_heads * target.head_dim,
    );
    let i = config
        .draft_intermediate_size
        .unwrap_or(target.intermediate_size);
    // fc, q/k/v over 2d, o, the MLP, three norms, the head over the draft vocabulary.
    let trainable = 3 * d * d + 2 * d * (q + 2 * kv) + q * d + 3 * d * i + 4 * d + size * d;
    let start = match &config.init_adapter {
        Some(dir) => format!("from {}", dir.display()),
        None => match config.draft_head_init {
            crate::config::DraftHeadInit::Random => "fresh".to_string(),
            crate::config::DraftHeadInit::Target => {
                "fresh, lm_head and norm from the target's".to_string()
            }
        },
    };
    let bytes_per_token = crate::eagle3::TargetCache::bytes_per_position(d);
    // Every training prompt with a completion of the most new tokens allowed.
    let most_new = generation_params(config).max_new_tokens;
    let positions: usize = prompts
        .train
        .iter()
        .map(|i| prompts.ids[*i].len() + most_new)
        .sum();
    // Where rows beyond the memory go: back through the target, or back from disk.
    let beyond = match config.target_cache_dir {
        None => "run through the target every epoch",
        Some(_) => "are read back from disk every epoch",
    };
    let memory = if config.target_cache_mb == 0 {
        match config.target_cache_dir {
            None => "run through the target on every micro-batch (--target_cache_mb 0)".to_string(),
            Some(_) => "computed by the target once per training row, none kept in memory \
                        (--target_cache_mb 0)"
                .to_string(),
        }
    } else {
        format!(
            "computed by the target once per training row and kept in memory, {:.1} KB per \
             token position, up to --target_cache_mb {} MiB per process (about {} positions; \
             rows beyond it {beyond})",
            bytes_per_token as f64 / 1e3,
            config.target_cache_mb,
            config.target_cache_mb.saturating_mul(1 << 20) / bytes_per_token
        )
    };
    let kept = match &config.target_cache_dir {
        None => format!("{memory}; nothing on disk"),
        Some(dir) => format!(
            "{memory}; on disk in {}, {:.1} KB per token position, read back there in later \
             epochs and by later runs over the same rows (at most about {:.1} MB for this run's \
             rows: every training prompt with a completion of --max_new_tokens){}",
            dir.display(),
            bytes_per_token as f64 / 1e3,
            (bytes_per_token * positions) as f64 / 1e6,
            if config.teacher_url.is_none() {
                "; the target in this process writes each row as it generates the completion, \
                 and training runs no pass of the target (but over a row whose prompt \
                 --max_seq_length cuts)"
            } else {
                ""
            }
        ),
    };
    vec![
        (
            "draft".into(),
            format!(
                "EAGLE-3 head ({start}) on {}: one decoder layer of width {d} (MLP {i}), draft \
                 vocabulary {size} of {} tokens, {:.2}M trainable parameters; the target's embedding, \
                 frozen, is not exported",
                config.draft_gpus,
                target.vocab_size,
                trainable as f64 / 1e6
            ),
        ),
        (
            "features".into(),
            format!(
                "the target's hidden states {layers:?} (of 0..={}), its final hidden state \
                 (the draft vocabulary's logits are made again from it each step), log-normaliser \
                 and argmax: {kept}",
                target.num_hidden_layers,
            ),
        ),
        (
            "loss".into(),
            format!(
                "training-time test over {} steps: Σ_j 0.8^j · soft cross-entropy against the \
                 target's distribution on the draft vocabulary",
                config.ttt_length
            ),
        ),
    ]
}

/// LoRA parameters of one layer for the named modules.
fn lora_param_count(c: &LlamaConfig, modules: &[String], r: usize) -> usize {
    let (d, q, kv, i) = (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.intermediate_size,
    );
    modules
        .iter()
        .map(|m| match m.as_str() {
            "q_proj" => r * (d + q),
            "k_proj" | "v_proj" => r * (d + kv),
            "o_proj" => r * (q + d),
            "gate_proj" | "up_proj" => r * (d + i),
            "down_proj" => r * (i + d),
            _ => 0,
        })
        .sum()
}

//! Training prompts written by the target itself, as Magpie does (Xu et al., 2024, "Magpie:
//! Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing"): the chat
//! template rendered up to where a user's message begins is the whole prompt, and what the
//! model samples there, up to its end of turn, is a user message in the model's own
//! distribution. A speculator learns the target's behaviour, so prompts of that distribution,
//! as many as wanted, are one reproducible way past a small prompt corpus.
//!
//! [`magpie_prompts`] samples them; [`write_batch_input`] writes them as an OpenAI batch file
//! that `--data_dir` reads.

use std::collections::HashSet;
use std::path::Path;

use kd_data::{ChatTokenizer, Message};
use kd_model::{GenerateOptions, Llama, Sampling, SeededPrompt};

use crate::error::{PipelineError, Result};

/// How [`magpie_prompts`] samples.
#[derive(Debug, Clone, PartialEq)]
pub struct MagpieOptions {
    /// Distinct prompts wanted.
    pub count: usize,
    /// A system message before the user's turn (the one the prompts will be used with), or
    /// none.
    pub system: Option<String>,
    /// Tokens sampled per prompt at most; a message that does not end by then is dropped.
    pub max_prompt_tokens: usize,
    /// Sampling temperature (Magpie uses 1).
    pub temperature: f32,
    /// Nucleus sampling (Magpie uses 1; lower trades diversity for well-formed messages).
    pub top_p: f32,
    /// Messages sampled together.
    pub batch_size: usize,
    /// Seed: sample `i` (duplicates and unfinished ones counted) is drawn from seed
    /// `seed + i`, whatever the batch size. Nearby seeds therefore share most of their
    /// messages (2500 prompts of seed 43 held all 1500 of seed 42's); a set disjoint from one
    /// sampled with `seed` starts at `seed + max_attempts` or later.
    pub seed: u64,
    /// Give up after this many sampled messages (duplicates and unfinished ones included).
    pub max_attempts: usize,
}

impl Default for MagpieOptions {
    fn default() -> Self {
        Self {
            count: 1000,
            system: None,
            max_prompt_tokens: 64,
            temperature: 1.0,
            top_p: 1.0,
            batch_size: 32,
            seed: 42,
            max_attempts: 10_000,
        }
    }
}

/// The ids a user's message follows under the tokenizer's chat template (with `system`
/// first when given): the template rendered around a marker, cut at the marker.
pub fn magpie_prefix(tokenizer: &ChatTokenizer, system: Option<&str>) -> Result<Vec<u32>> {
    const MARK: &str = "\u{1}MAGPIE-USER-MESSAGE\u{1}";
    let template = tokenizer.template().ok_or_else(|| {
        PipelineError::Config(
            "Magpie prompts need the target's chat template, and its tokenizer has none".into(),
        )
    })?;
    let text = template.render(&conversation(system, MARK), false)?;
    let cut = text.find(MARK).ok_or_else(|| {
        PipelineError::Config(
            "the chat template does not write the user's message verbatim, so no prefix for \
             Magpie prompts can be cut from it"
                .into(),
        )
    })?;
    Ok(tokenizer.encode(&text[..cut], false)?)
}

/// `options.count` distinct user messages sampled by `target` after [`magpie_prefix`], in
/// the order sampled. A message counts when it ends with one of the target's end-of-turn ids
/// within `max_prompt_tokens`, is not blank, and was not sampled before (compared after
/// trimming whitespace).
///
/// # Errors
/// A template without a prefix (see [`magpie_prefix`]), a generation failure, or fewer than
/// `count` messages after `max_attempts` samples (the error says how many were found).
pub fn magpie_prompts(
    target: &Llama,
    tokenizer: &ChatTokenizer,
    options: &MagpieOptions,
) -> Result<Vec<String>> {
    if options.count == 0 || options.batch_size == 0 || options.max_prompt_tokens == 0 {
        return Err(PipelineError::Config(
            "Magpie prompts: count, batch_size and max_prompt_tokens must be at least 1".into(),
        ));
    }
    let prefix = magpie_prefix(tokenizer, options.system.as_deref())?;
    let stop = target.config().eos_token_ids.clone();
    let generate = GenerateOptions {
        max_new_tokens: options.max_prompt_tokens,
        sampling: Sampling {
            temperature: options.temperature,
            top_k: 0,
            top_p: options.top_p,
        },
        stop_token_ids: stop.clone(),
        return_logprobs: false,
    };
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(options.count);
    let mut attempts = 0usize;
    while out.len() < options.count && attempts < options.max_attempts {
        let n = options.batch_size.min(options.max_attempts - attempts);
        let prompts: Vec<SeededPrompt<'_>> = (0..n)
            .map(|i| SeededPrompt {
                ids: &prefix,
                seed: options.seed.wrapping_add((attempts + i) as u64),
            })
            .collect();
        attempts += n;
        for c in target.generate(&prompts, &generate)? {
            let Some((last, body)) = c.ids.split_last() else {
                continue;
            };
            if !stop.contains(last) {
                continue; // unfinished within max_prompt_tokens
            }
            let text = tokenizer.decode(body, true)?.trim().to_string();
            if !text.is_empty() && seen.insert(text.clone()) {
                out.push(text);
                if out.len() == options.count {
                    break;
                }
            }
        }
        tracing::debug!(found = out.len(), attempts, "Magpie prompts");
    }
    if out.len() < options.count {
        return Err(PipelineError::Config(format!(
            "Magpie prompts: {} distinct finished messages after {attempts} samples, {} wanted; \
             raise max_attempts or max_prompt_tokens, or lower count",
            out.len(),
            options.count
        )));
    }
    Ok(out)
}

/// Writes `prompts` to `path` as an OpenAI batch file (`custom_id` `{id_prefix}-{i}`, a
/// chat completion request per line, `system` first when given), atomically.
pub fn write_batch_input(
    path: &Path,
    prompts: &[String],
    system: Option<&str>,
    id_prefix: &str,
) -> Result<()> {
    let mut text = String::new();
    for (i, p) in prompts.iter().enumerate() {
        let line = serde_json::json!({
            "custom_id": format!("{id_prefix}-{i:05}"),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "target", "messages": conversation(system, p)},
        });
        text.push_str(&line.to_string());
        text.push('\n');
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| PipelineError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    kd_kernels::write_atomic(path, text.as_bytes()).map_err(|source| PipelineError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// `system` (when given), then `user`: the conversation a Magpie prompt is sampled in and
/// written as.
fn conversation(system: Option<&str>, user: &str) -> Vec<Message> {
    system
        .map(Message::system)
        .into_iter()
        .chain([Message::user(user)])
        .collect()
}

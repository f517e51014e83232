//! The speculator's data: prompts from `data_dir/*/batch_input.jsonl`, the held-out split,
//! chat-templated prompt ids, and training examples from the target's completions.

use kd_data::{
    ChatTokenizer, Example, ExampleOptions, OpenAiBatchSource, PromptRecord, Sampling, SkipReport,
    Truncation, build_example,
};
use kd_lora::derive_seed;
use kd_teacher::{Generation, Prompt};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use crate::config::SpeculatorConfig;
use crate::error::{PipelineError, Result};

/// The prompts of a run and how they are split.
#[derive(Debug, Clone)]
pub struct PromptSet {
    /// Every prompt record read (after `max_samples`), in run order.
    pub records: Vec<PromptRecord>,
    /// Their chat-templated ids (with the generation prompt), in the same order.
    pub ids: Vec<Vec<u32>>,
    /// Indices (into `records`) of the training prompts, increasing.
    pub train: Vec<usize>,
    /// Indices of the held-out prompts (never trained on), increasing.
    pub eval: Vec<usize>,
    /// Records skipped by the reader (always empty under the `error` policy).
    pub skipped: SkipReport,
    /// Prompts left out because they leave no room for a completion.
    pub too_long: LongPrompts,
}

/// Prompts left out because, after the chat template, they leave no room for a single new
/// token within `--max_seq_length` and the models' positions. Such a prompt is skipped (not
/// cut): cutting a chat-templated prompt at its start would drop the chat header and system
/// turn and train the draft on conversations the target never sees in serving.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LongPrompts {
    /// The most tokens a prompt may have (one position below the limit, for the first new
    /// token).
    pub max_prompt_tokens: usize,
    /// What set the limit (`--max_seq_length 2048`, `the target's 512 positions`, …).
    pub limit_from: String,
    /// The ids (`custom_id` or `file:line`) of the prompts left out, in data order.
    pub ids: Vec<String>,
    /// Tokens of the longest prompt left out.
    pub longest: usize,
}

impl LongPrompts {
    /// A warning saying what was left out and why, when anything was.
    pub fn warning(&self) -> Option<String> {
        let n = self.ids.len();
        if n == 0 {
            return None;
        }
        let shown: Vec<&str> = self.ids.iter().take(3).map(String::as_str).collect();
        Some(format!(
            "{n} prompt{} skipped: longer than {} tokens after the chat template, which leaves \
             no room for a completion within {} (the longest has {} tokens; {}{}); raise \
             --max_seq_length if the models' positions allow, or shorten those prompts",
            if n == 1 { "" } else { "s" },
            self.max_prompt_tokens,
            self.limit_from,
            self.longest,
            shown.join(", "),
            if n > shown.len() { ", …" } else { "" },
        ))
    }
}

/// The position limit prompts must fit: the smallest of `--max_seq_length` (when given) and
/// the named models' position counts, with what set it.
pub fn prompt_limit(max_seq_length: Option<usize>, models: &[(&str, usize)]) -> (usize, String) {
    let mut best = (usize::MAX, String::new());
    if let Some(l) = max_seq_length {
        best = (l, format!("--max_seq_length {l}"));
    }
    for (what, positions) in models {
        if *positions < best.0 {
            best = (*positions, format!("the {what}'s {positions} positions"));
        }
    }
    best
}

/// Keeps the prompts (records and their ids) with at most `limit − 1` tokens, reporting the
/// others.
pub fn drop_long_prompts(
    records: Vec<PromptRecord>,
    ids: Vec<Vec<u32>>,
    (limit, limit_from): (usize, String),
) -> (Vec<PromptRecord>, Vec<Vec<u32>>, LongPrompts) {
    let mut report = LongPrompts {
        max_prompt_tokens: limit.saturating_sub(1),
        limit_from,
        ..LongPrompts::default()
    };
    let (mut kept_records, mut kept_ids) = (Vec::new(), Vec::new());
    for (r, p) in records.into_iter().zip(ids) {
        if p.len() > report.max_prompt_tokens {
            report.longest = report.longest.max(p.len());
            report.ids.push(r.id);
        } else {
            kept_records.push(r);
            kept_ids.push(p);
        }
    }
    (kept_records, kept_ids, report)
}

impl PromptSet {
    /// The training prompts for the teacher, indexed by their position in the whole set (so
    /// that sampling streams do not depend on the split).
    pub fn train_prompts(&self) -> Vec<Prompt> {
        self.train
            .iter()
            .map(|i| Prompt {
                index: *i as u64,
                ids: self.ids[*i].clone(),
            })
            .collect()
    }

    /// The held-out prompts' ids.
    pub fn eval_ids(&self) -> Vec<Vec<u32>> {
        self.eval.iter().map(|i| self.ids[*i].clone()).collect()
    }
}

/// Number of held-out prompts for `n` prompts: `eval_fraction` of them (at least one when
/// the fraction is positive and there are two prompts or more), at most `eval_max_prompts`,
/// never all.
pub fn eval_count(n: usize, fraction: f64, max: usize) -> usize {
    if fraction <= 0.0 || n < 2 {
        return 0;
    }
    ((n as f64 * fraction).round() as usize)
        .max(1)
        .min(max)
        .min(n - 1)
}

/// Reads, samples, tokenizes and splits the prompts; prompts longer than `limit − 1` tokens
/// (see [`prompt_limit`]) are left out and reported.
pub fn load_prompts(
    config: &SpeculatorConfig,
    tokenizer: &ChatTokenizer,
    limit: (usize, String),
) -> Result<PromptSet> {
    let source = OpenAiBatchSource::from_data_dir(&config.data_dir)?;
    let mut records = source.records();
    let sampling = Sampling {
        max_samples: config.max_samples,
        shuffle: config.max_samples.is_some(),
        seed: config.seed,
    };
    let prompts = sampling.apply(&mut records)?;
    let skipped = records.skipped().clone();
    if prompts.is_empty() {
        return Err(PipelineError::Config(format!(
            "{}: the batch files hold no prompts",
            config.data_dir.display()
        )));
    }
    let conversations: Vec<_> = prompts.iter().map(|p| p.messages.clone()).collect();
    let ids = tokenizer.encode_prompts(&conversations)?;
    let (prompts, ids, too_long) = drop_long_prompts(prompts, ids, limit);
    if prompts.is_empty() {
        return Err(PipelineError::Config(format!(
            "{}: every prompt is too long: {}",
            config.data_dir.display(),
            too_long.warning().unwrap_or_default()
        )));
    }
    let n = prompts.len();
    let m = eval_count(n, config.eval_fraction, config.eval_max_prompts);
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(derive_seed(
        config.seed,
        &[0xE7A1],
    )));
    let mut eval: Vec<usize> = order[..m].to_vec();
    let mut train: Vec<usize> = order[m..].to_vec();
    eval.sort_unstable();
    train.sort_unstable();
    Ok(PromptSet {
        records: prompts,
        ids,
        train,
        eval,
        skipped,
        too_long,
    })
}

/// Training examples from the target's completions.
#[derive(Debug, Clone, Default)]
pub struct Examples {
    /// The examples (labels on completion tokens only).
    pub examples: Vec<Example>,
    /// For each example, the training prompt (index into [`PromptSet::train`]) it came from.
    pub source: Vec<usize>,
    /// For each example, prompt tokens cut from its start by truncation: position t of the
    /// example is position `offset + t` of prompt + completion.
    pub offsets: Vec<usize>,
    /// Completions the teacher returned empty (no example made).
    pub empty: usize,
    /// What truncation to `max_seq_length` cut.
    pub truncation: Truncation,
}

/// Builds one example per non-empty completion.
pub fn build_examples(
    prompts: &PromptSet,
    generations: &[Generation],
    max_seq_length: usize,
) -> Examples {
    let options = ExampleOptions {
        max_seq_length,
        train_on_prompt: false,
    };
    let mut out = Examples::default();
    for (k, (i, g)) in prompts.train.iter().zip(generations).enumerate() {
        if g.ids.is_empty() {
            out.empty += 1;
            continue;
        }
        let prompt = &prompts.ids[*i];
        let (example, cut) = build_example(&prompts.records[*i].id, prompt, &g.ids, &options);
        out.offsets.push(prompt.len() - example.prompt_len);
        out.truncation.add(cut);
        out.examples.push(example);
        out.source.push(k);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tightest_limit_is_named() {
        assert_eq!(
            prompt_limit(Some(2048), &[("draft", 512), ("target", 8192)]),
            (512, "the draft's 512 positions".into())
        );
        assert_eq!(
            prompt_limit(Some(100), &[("draft", 512)]),
            (100, "--max_seq_length 100".into())
        );
        assert_eq!(prompt_limit(None, &[]).0, usize::MAX);
    }

    #[test]
    fn eval_split_sizes() {
        assert_eq!(eval_count(748, 0.05, 200), 37);
        assert_eq!(eval_count(100_000, 0.05, 200), 200);
        assert_eq!(eval_count(10, 0.05, 200), 1);
        assert_eq!(eval_count(1, 0.05, 200), 0);
        assert_eq!(eval_count(2, 0.9, 200), 1);
        assert_eq!(eval_count(50, 0.0, 200), 0);
    }
}

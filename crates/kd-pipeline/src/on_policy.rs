//! On-policy distillation (GKD, Agarwal et al. 2023, arXiv 2306.13649; DistillSpec, Zhou et al.
//! 2023, arXiv 2310.08461): in every optimizer step a share λ of the rows is replaced by the
//! student's own completions of the same prompts, which the teacher scores (top-k log-probs
//! at every position); those rows learn through the KD term on the completion tokens only.
//!
//! Everything random derives from (seed, epoch, step, example): which rows are on-policy and
//! each row's sampling stream. The student samples with the weights of the step, so a resumed
//! run samples what an uninterrupted one samples.

use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;

use kd_data::{Batch, Example, IGNORE_INDEX};
use kd_lora::derive_seed;
use kd_loss::{KdConfig, LossStats};
use kd_model::{GenerateOptions, Llama, Sampling, SeededPrompt};
use kd_teacher::{Scores, Teacher};
use kd_train::{
    FinalHidden, MicroBatch, PlannedStep, StepData, StepLoss, StepLossFn, TrainModel, final_hidden,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use crate::error::{PipelineError, Result};
use crate::kd_term::{counted_positions, topk_kd};

/// Tag of the on-policy random streams (keeps them apart from data order and dropout).
const ON_POLICY_STREAM: u64 = 0x0FF0_11C7;

/// How on-policy rows are made and learned.
#[derive(Debug, Clone, PartialEq)]
pub struct OnPolicyConfig {
    /// λ: the share of each step's rows the student completes itself (0 = off, 1 = all).
    /// TRL's `lmbda`.
    pub ratio: f64,
    /// The student's sampling temperature (0 = greedy).
    pub temperature: f32,
    /// The student's top-p (1 = all).
    pub top_p: f32,
    /// The student's top-k (0 = all).
    pub top_k: usize,
    /// Tokens the student samples at most per prompt.
    pub max_new_tokens: usize,
    /// Longest prompt + completion; completions are cut to fit.
    pub max_seq_length: usize,
    /// Cut each sampled completion to the length of the completion it replaces, so that an
    /// on-policy row has no more label tokens than the off-policy row would have had (runs
    /// compared at equal teacher tokens).
    pub match_length: bool,
    /// Log-probs per position the teacher returns for the KD term.
    pub teacher_top_k: usize,
    /// The KD term of the on-policy rows.
    pub kd: KdConfig,
    /// Its weight in the loss (the pipeline's KD weight).
    pub kd_weight: f64,
}

/// The ranges of the on-policy settings both pipelines share; `name` spells a setting as its
/// pipeline does (`--on_policy_top_p`, `` `on_policy_top_p` ``). Nothing but the ratio is
/// checked when the ratio is 0 (off).
pub fn check_on_policy_settings(
    ratio: f64,
    max_new_tokens: usize,
    temperature: f32,
    top_p: f32,
    name: &dyn Fn(&str) -> String,
) -> Result<()> {
    let bad = |m: String| Err(PipelineError::Config(m));
    if !(0.0..=1.0).contains(&ratio) {
        return bad(format!(
            "{} must lie in [0, 1], got {ratio}",
            name("on_policy_ratio")
        ));
    }
    if ratio == 0.0 {
        return Ok(());
    }
    if max_new_tokens == 0 {
        return bad(format!(
            "{} must be at least 1",
            name("on_policy_max_new_tokens")
        ));
    }
    if !(temperature >= 0.0 && temperature.is_finite()) {
        return bad(format!(
            "{} must be ≥ 0, got {temperature}",
            name("on_policy_temperature")
        ));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return bad(format!(
            "{} must lie in (0, 1], got {top_p}",
            name("on_policy_top_p")
        ));
    }
    Ok(())
}

impl OnPolicyConfig {
    /// Checks ranges; messages name the setting.
    pub fn validate(&self) -> Result<()> {
        check_on_policy_settings(
            self.ratio,
            self.max_new_tokens,
            self.temperature,
            self.top_p,
            &|k| format!("the on-policy setting `{k}`"),
        )?;
        if self.ratio == 0.0 {
            return Ok(());
        }
        let bad = |m: String| Err(PipelineError::Config(m));
        if !(self.kd_weight > 0.0 && self.kd_weight.is_finite()) {
            return bad(
                "on-policy rows learn through the KD term only: its weight must be positive".into(),
            );
        }
        if self.teacher_top_k == 0 {
            return bad("the teacher's top-k for on-policy rows must be at least 1".into());
        }
        self.sampling()
            .validate()
            .map_err(|e| PipelineError::Config(format!("on-policy sampling: {e}")))?;
        self.kd.validate()?;
        Ok(())
    }

    /// The student's token choice.
    pub fn sampling(&self) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
        }
    }

    /// What a resumed run must share with the checkpoint.
    pub fn fingerprint(&self) -> serde_json::Value {
        json!({
            "ratio": self.ratio,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "match_length": self.match_length,
            "teacher_top_k": self.teacher_top_k,
            "kd_objective": format!("{:?}", self.kd.objective),
            "kd_weight": self.kd_weight,
        })
    }
}

/// On-policy rows of a run: the settings and the teacher that scores the student's samples
/// (local or remote).
pub struct OnPolicy<'a> {
    /// The settings.
    pub config: OnPolicyConfig,
    /// Scores prompt + sampled completion.
    pub teacher: &'a dyn Teacher,
}

impl std::fmt::Debug for OnPolicy<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnPolicy")
            .field("config", &self.config)
            .field("teacher", &self.teacher.fingerprint())
            .finish()
    }
}

/// Which of a step's `n` rows are on-policy: ⌊λn + u⌋ of them (u uniform in [0, 1), so the
/// expected share is exactly λ), chosen at random; all derived from (seed, epoch, step).
pub fn on_policy_rows(n: usize, ratio: f64, seed: u64, epoch: usize, step: usize) -> Vec<bool> {
    let mut rng = ChaCha8Rng::seed_from_u64(derive_seed(
        seed,
        &[ON_POLICY_STREAM, epoch as u64, step as u64],
    ));
    let u: f64 = rng.random();
    let count = ((ratio * n as f64 + u).floor() as usize).min(n);
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut rng);
    let mut chosen = vec![false; n];
    for i in &order[..count] {
        chosen[*i] = true;
    }
    chosen
}

/// The seed of the sampling stream of example `example` in step `step` of epoch `epoch`.
pub fn sample_seed(seed: u64, epoch: usize, step: usize, example: usize) -> u64 {
    derive_seed(
        seed,
        &[
            ON_POLICY_STREAM,
            epoch as u64,
            step as u64,
            example as u64,
            1,
        ],
    )
}

/// The student's completions of some prompts, scored by the teacher.
#[derive(Debug, Clone, Default)]
pub struct OnPolicySamples {
    /// Prompt + completion, labels on the completion (local indices: the batches of these rows
    /// index this list).
    pub examples: Vec<Example>,
    /// The teacher's view of each example, aligned with it.
    pub scores: Vec<Scores>,
    /// Tokens the student sampled (after cutting to `max_seq_length`).
    pub generated_tokens: usize,
    /// Wall time of the student's sampling.
    pub generation_seconds: f64,
    /// Tokens (prompt + completion) the teacher scored.
    pub scored_tokens: usize,
    /// Wall time of the teacher's scoring.
    pub scoring_seconds: f64,
}

impl OnPolicy<'_> {
    /// Whether example `e` can be completed on-policy: it has a prompt, room after it, and
    /// (with `match_length`) a completion whose length the sample may take.
    pub fn usable(&self, e: &Example) -> bool {
        e.prompt_len > 0
            && e.prompt_len < self.config.max_seq_length
            && (!self.config.match_length || e.len() > e.prompt_len)
    }

    /// The student's completions of the prompts of `rows` (indices into `examples`), sampled
    /// with `student` in one batch (rows finish independently), each from the stream of
    /// [`sample_seed`]; then the teacher's top-k over prompt + completion.
    pub fn sample(
        &self,
        student: &Llama,
        examples: &[Example],
        rows: &[usize],
        seed: u64,
        epoch: usize,
        step: usize,
    ) -> Result<OnPolicySamples> {
        let mut out = OnPolicySamples::default();
        if rows.is_empty() {
            return Ok(out);
        }
        let c = &self.config;
        let prompts: Vec<SeededPrompt<'_>> = rows
            .iter()
            .map(|e| SeededPrompt {
                ids: &examples[*e].input_ids[..examples[*e].prompt_len],
                seed: sample_seed(seed, epoch, step, *e),
            })
            .collect();
        // Tokens each row may keep: up to `max_seq_length`, and (with `match_length`) no more
        // than the completion it replaces. Decoding stops at the longest of them: a row's
        // stream is sampled in order, so stopping early leaves the kept tokens unchanged.
        let rooms: Vec<usize> = rows
            .iter()
            .zip(&prompts)
            .map(|(e, p)| {
                let room = c.max_seq_length.saturating_sub(p.ids.len());
                if c.match_length {
                    room.min(examples[*e].len().saturating_sub(p.ids.len()))
                } else {
                    room
                }
            })
            .collect();
        let longest = rooms.iter().copied().max().unwrap_or(0);
        let options = GenerateOptions {
            max_new_tokens: c.max_new_tokens.min(longest.max(1)),
            sampling: c.sampling(),
            stop_token_ids: Vec::new(),
            return_logprobs: false,
        };
        let started = Instant::now();
        let completions = student.generate(&prompts, &options)?;
        out.generation_seconds = started.elapsed().as_secs_f64();
        let mut sequences = Vec::with_capacity(rows.len());
        for (((e, p), completion), room) in rows.iter().zip(&prompts).zip(completions).zip(rooms) {
            let ids = &completion.ids[..completion.ids.len().min(room)];
            out.generated_tokens += ids.len();
            let input_ids: Vec<u32> = p.ids.iter().chain(ids).copied().collect();
            let labels: Vec<i64> = std::iter::repeat_n(IGNORE_INDEX, p.ids.len())
                .chain(ids.iter().map(|t| i64::from(*t)))
                .collect();
            out.examples.push(Example {
                id: format!("on-policy:{}", examples[*e].id),
                input_ids: input_ids.clone(),
                labels,
                prompt_len: p.ids.len(),
            });
            sequences.push(input_ids);
        }
        let started = Instant::now();
        out.scores = self.teacher.score(&sequences, c.teacher_top_k)?;
        out.scoring_seconds = started.elapsed().as_secs_f64();
        out.scored_tokens = sequences.iter().map(Vec::len).sum();
        if out.scores.len() != sequences.len()
            || out
                .scores
                .iter()
                .zip(&sequences)
                .any(|(s, q)| s.len != q.len())
        {
            return Err(PipelineError::Config(format!(
                "the teacher ({}) returned scores that do not match the {} sequences sent",
                self.teacher.fingerprint(),
                sequences.len()
            )));
        }
        Ok(out)
    }
}

/// The loss of a micro-batch of on-policy rows: `kd_weight ·` KD on the completion tokens
/// against the teacher's top-k, divided by the step's normaliser (no cross-entropy: the
/// tokens are the student's own).
pub struct OnPolicyLoss {
    /// The teacher's scores of the on-policy examples the batch indexes.
    pub scores: Arc<Vec<Scores>>,
    /// The objective.
    pub kd: KdConfig,
    /// Its weight.
    pub kd_weight: f64,
}

impl StepLossFn for OnPolicyLoss {
    fn loss(
        &self,
        model: &TrainModel,
        batch: &Batch,
        normalizer: f32,
        dropout_seed: u64,
    ) -> kd_train::Result<StepLoss> {
        let llama = &model.llama;
        let FinalHidden {
            flat, shifted, seq, ..
        } = final_hidden(llama, batch, Some(dropout_seed), &[])?;
        if shifted.count == 0 {
            return Ok(StepLoss {
                total: flat.sum() * 0.0,
                terms: Vec::new(),
                kd: Some(LossStats::default()),
            });
        }
        let counted = counted_positions(batch, &shifted.mask, seq, None)?;
        let kd = topk_kd(
            flat,
            llama.lm_head_weight(),
            &counted,
            &self.scores,
            normalizer,
            &self.kd,
            self.kd_weight as f32,
            None,
        )?;
        let value = kd.kd.loss_sum / normalizer as f64 * self.kd_weight;
        Ok(StepLoss {
            total: kd.loss,
            terms: vec![("kd_loss_on_policy", value)],
            kd: Some(kd.kd),
        })
    }
}

/// What a run's on-policy rows cost, summed over its steps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OnPolicyTotals {
    /// On-policy rows trained on.
    pub rows: usize,
    /// Tokens the student sampled.
    pub generated_tokens: usize,
    /// Wall time of the student's sampling.
    pub generation_seconds: f64,
    /// Tokens the teacher scored.
    pub scored_tokens: usize,
    /// Wall time of the teacher's scoring.
    pub scoring_seconds: f64,
}

impl OnPolicyTotals {
    /// Adds one step.
    pub fn add(&mut self, s: &OnPolicySamples) {
        self.rows += s.examples.len();
        self.generated_tokens += s.generated_tokens;
        self.generation_seconds += s.generation_seconds;
        self.scored_tokens += s.scored_tokens;
        self.scoring_seconds += s.scoring_seconds;
    }
}

/// On-policy rows as the trainer's step data ([`kd_train::Trainer::step_data`]): in every step
/// a share λ of the planned rows ([`on_policy_rows`]) is completed by the model being trained
/// (with the weights of the step), scored by the teacher and learned through
/// [`OnPolicyLoss`]; the other rows keep the run's loss. All rows of a step share one
/// normaliser (their label tokens). With λ = 0 the planned rows pass through unchanged.
pub struct OnPolicyData<'a> {
    policy: OnPolicy<'a>,
    totals: OnPolicyTotals,
    /// The last step's samples (without their scores), which of its micro-batches are
    /// on-policy, and how many examples it planned.
    last: Option<(OnPolicySamples, Vec<bool>, usize)>,
}

impl<'a> OnPolicyData<'a> {
    /// The source for `policy` (its settings checked when λ > 0).
    pub fn new(policy: OnPolicy<'a>) -> Result<Self> {
        if policy.config.ratio > 0.0 {
            policy.config.validate()?;
        }
        Ok(Self {
            policy,
            totals: OnPolicyTotals::default(),
            last: None,
        })
    }

    /// What the run's on-policy rows cost so far; `None` when λ = 0.
    pub fn totals(&self) -> Option<&OnPolicyTotals> {
        (self.policy.config.ratio > 0.0).then_some(&self.totals)
    }

    fn active(&self) -> bool {
        self.policy.config.ratio > 0.0
    }
}

impl StepData<TrainModel> for OnPolicyData<'_> {
    fn micro_batches(
        &mut self,
        planned: &PlannedStep<'_>,
        model: &TrainModel,
    ) -> kd_train::Result<Vec<MicroBatch<TrainModel>>> {
        if !self.active() {
            return Ok(planned.collate());
        }
        let micro = planned.micro_batches;
        let flat: Vec<(usize, usize)> = micro
            .iter()
            .enumerate()
            .flat_map(|(m, rows)| (0..rows.len()).map(move |r| (m, r)))
            .collect();
        let c = &self.policy.config;
        let chosen = on_policy_rows(
            flat.len(),
            c.ratio,
            planned.seed,
            planned.epoch,
            planned.step,
        );
        let mut kept = vec![Vec::new(); micro.len()];
        let mut wanted = Vec::new();
        let mut micro_of = Vec::new();
        let mut step_examples = 0usize;
        for ((m, r), on) in flat.iter().zip(chosen) {
            let row = &micro[*m][*r];
            step_examples += row.len();
            if on
                && row
                    .iter()
                    .all(|e| self.policy.usable(&planned.examples[*e]))
            {
                for e in row {
                    wanted.push(*e);
                    micro_of.push(*m);
                }
            } else {
                kept[*m].push(row.clone());
            }
        }
        let mut samples = OnPolicySamples::default();
        if !wanted.is_empty() {
            samples = self
                .policy
                .sample(
                    &model.llama.valid(),
                    planned.examples,
                    &wanted,
                    planned.seed,
                    planned.epoch,
                    planned.step,
                )
                .map_err(kd_train::TrainError::step)?;
        }
        let mut on_rows: Vec<Vec<Vec<usize>>> = vec![Vec::new(); micro.len()];
        for (i, m) in micro_of.iter().enumerate() {
            on_rows[*m].push(vec![i]);
        }
        let mut out: Vec<MicroBatch<TrainModel>> = planned
            .collate_rows(&kept, planned.examples)
            .into_iter()
            .map(MicroBatch::new)
            .collect();
        let off = out.len();
        let on_batches = planned.collate_rows(&on_rows, &samples.examples);
        let scores = Arc::new(std::mem::take(&mut samples.scores));
        for batch in on_batches {
            out.push(MicroBatch {
                batch,
                loss: Some(Box::new(OnPolicyLoss {
                    scores: Arc::clone(&scores),
                    kd: c.kd,
                    kd_weight: c.kd_weight,
                })),
            });
        }
        let on: Vec<bool> = (0..out.len()).map(|k| k >= off).collect();
        self.totals.add(&samples);
        self.last = Some((samples, on, step_examples));
        Ok(out)
    }

    fn step_terms(
        &mut self,
        kd: &[Option<LossStats>],
        step_seconds: f64,
    ) -> Vec<(&'static str, f64)> {
        match &self.last {
            Some((samples, on, step_examples)) if self.active() => {
                on_policy_terms(samples, *step_examples, on, kd, step_seconds)
            }
            _ => Vec::new(),
        }
    }

    fn fingerprint(&self) -> Option<(&'static str, serde_json::Value)> {
        self.active()
            .then(|| ("on_policy", self.policy.config.fingerprint()))
    }
}

/// The on-policy metrics of one step (`train/…` in TensorBoard): the on-policy share of the
/// step's examples; KD per counted token on on-policy and off-policy rows apart; α (Σ min(p,
/// q)) and top-1 agreement on the on-policy rows; the student's sampling and the teacher's
/// scoring in tokens per second and as shares of the step's wall time. `on[k]` says whether
/// micro-batch k is on-policy and `kd[k]` holds its KD statistics.
pub fn on_policy_terms(
    samples: &OnPolicySamples,
    step_examples: usize,
    on: &[bool],
    kd: &[Option<LossStats>],
    step_seconds: f64,
) -> Vec<(&'static str, f64)> {
    let mut terms = vec![(
        "on_policy_fraction",
        samples.examples.len() as f64 / step_examples.max(1) as f64,
    )];
    let (mut on_stats, mut off_stats) = (LossStats::default(), None::<LossStats>);
    for (is_on, stats) in on.iter().zip(kd) {
        match (is_on, stats) {
            (true, Some(s)) => on_stats.merge(s),
            (false, Some(s)) => off_stats.get_or_insert_with(LossStats::default).merge(s),
            _ => {}
        }
    }
    if let Some(off) = off_stats.filter(|s| s.counted > 0) {
        terms.push(("kd_off_policy", off.loss_sum / off.counted as f64));
        terms.push(("off_policy_alpha", off.acceptance_sum / off.counted as f64));
        terms.push((
            "off_policy_top1",
            off.top1_matches as f64 / off.counted as f64,
        ));
    }
    if on_stats.counted > 0 {
        let n = on_stats.counted as f64;
        terms.push(("kd_on_policy", on_stats.loss_sum / n));
        terms.push(("on_policy_alpha", on_stats.acceptance_sum / n));
        terms.push(("on_policy_top1", on_stats.top1_matches as f64 / n));
    }
    if samples.generation_seconds > 0.0 {
        terms.push((
            "on_policy_generation_tokens_per_second",
            samples.generated_tokens as f64 / samples.generation_seconds,
        ));
        terms.push((
            "on_policy_scoring_tokens_per_second",
            samples.scored_tokens as f64 / samples.scoring_seconds.max(1e-9),
        ));
        let step = step_seconds.max(1e-9);
        terms.push((
            "on_policy_generation_share",
            samples.generation_seconds / step,
        ));
        terms.push(("on_policy_scoring_share", samples.scoring_seconds / step));
    }
    terms
}

#[cfg(test)]
mod tests;

//! The target's phases: its completions of the training prompts and its scores of them,
//! through the teacher caches (an interrupted run resumes from the finished shards; a stop on
//! request ends after the shard in progress).

use kd_teacher::{
    CacheManifest, Generation, GenerationCache, LAST_HIDDEN_LAYER, Prompt, SamplingParams,
    ScoreCache, ScoreCacheManifest, ScoreOptions, Scores, Teacher, prompts_hash, sequences_hash,
    template_hash,
};

use kd_pipeline::continue_unless_stopped;

use crate::config::SpeculatorConfig;
use crate::data::Examples;
use crate::eagle3::{TargetCache, captured_layers};
use crate::error::Result;
use crate::observe::{Phase, SpeculatorObserver};
use crate::run::off_policy_kd;
use crate::settings::TeacherBackend;
use crate::settings::generation_params;
use crate::setup::{Setup, teacher_cache_dir};

/// The target in this process generating (on one device, or a replica on each of several),
/// what it computes at every position kept as the targets of the EAGLE-3 training row each
/// completion makes ([`TargetCache::keep_generated`]), before the generation cache commits the
/// shard: a resumed run finds the rows of every shard it does not generate again. The
/// completions are those the target makes without it.
struct Capturing<'a> {
    teacher: &'a TeacherBackend,
    layers: Vec<usize>,
    rows: &'a TargetCache,
    max_seq_length: usize,
    vocab: usize,
}

impl Teacher for Capturing<'_> {
    fn generate(
        &self,
        prompts: &[Prompt],
        params: &SamplingParams,
    ) -> kd_teacher::Result<Vec<Generation>> {
        let captured = self
            .teacher
            .generate_captured(prompts, params, &self.layers)?;
        Ok(captured
            .into_iter()
            .zip(prompts)
            .map(|((generation, row), prompt)| {
                self.rows.keep_generated(
                    &prompt.ids,
                    &generation.ids,
                    &row,
                    self.max_seq_length,
                    self.vocab,
                );
                generation
            })
            .collect())
    }

    fn score_with(
        &self,
        sequences: &[Vec<u32>],
        options: &ScoreOptions,
    ) -> kd_teacher::Result<Vec<Scores>> {
        self.teacher.teacher().score_with(sequences, options)
    }

    fn fingerprint(&self) -> String {
        self.teacher.teacher().fingerprint()
    }
}

/// The target's completions of the training prompts, in prompt order, through the
/// generation cache (an interrupted run resumes from its finished shards). With an EAGLE-3
/// run's target-rows directory (`target_rows` that [captures](TargetCache::captures)) and the
/// target in this process (on one device or several), the rows of the training examples are
/// kept as the target generates them ([`Capturing`]).
pub(crate) fn generate_completions(
    config: &SpeculatorConfig,
    setup: &Setup,
    teacher: &TeacherBackend,
    target_rows: Option<&TargetCache>,
    observer: &mut dyn SpeculatorObserver,
) -> Result<Vec<Generation>> {
    // Longest prompts first: a shard is one teacher batch, and similar lengths together waste
    // less on padding. The generations go back to prompt order below.
    let train_prompts = setup.prompts.train_prompts();
    let mut order: Vec<usize> = (0..train_prompts.len()).collect();
    order.sort_by_key(|i| std::cmp::Reverse(train_prompts[*i].ids.len()));
    let prompts: Vec<Prompt> = order.iter().map(|i| train_prompts[*i].clone()).collect();
    let cache_dir = teacher_cache_dir(config);
    let shard = config.batch_size * setup.target_devices.len().max(1);
    let manifest = CacheManifest {
        version: 1,
        teacher: teacher.teacher().fingerprint(),
        template: template_hash(setup.tokenizer.template().map(|t| t.identity()).as_deref()),
        sampling: generation_params(config),
        prompts: prompts_hash(&prompts),
        count: prompts.len(),
        shard_size: shard,
    };
    // Across ranks, each makes its share of the shards, then every rank reads them all.
    let world = kd_dist::world();
    let gen_cache = GenerationCache::open_across(world, &cache_dir.join("generations"), manifest)?;
    let total = prompts.len();
    let capturing = match (teacher.target(), target_rows) {
        (Some(target), Some(rows)) if teacher.in_process() && rows.captures() => Some(Capturing {
            teacher,
            layers: captured_layers(config, target),
            rows,
            max_seq_length: config.max_seq_length,
            vocab: target.config().vocab_size,
        }),
        _ => None,
    };
    let generating: &dyn Teacher = match &capturing {
        Some(c) => c,
        None => teacher.teacher(),
    };
    let by_length = gen_cache.generate_across(world, generating, &prompts, |p| {
        observer.on_teacher_progress(Phase::Generate, &p, total);
        continue_unless_stopped(observer)
    })?;
    let mut generations = vec![None; by_length.len()];
    for (i, g) in order.iter().zip(by_length) {
        generations[*i] = Some(g);
    }
    Ok(generations
        .into_iter()
        .map(|g| g.expect("every prompt was generated"))
        .collect())
}

/// The target's scores of every training example's prompt + completion, through the score
/// cache.
pub(crate) fn score(
    config: &SpeculatorConfig,
    setup: &Setup,
    teacher: &TeacherBackend,
    examples: &Examples,
    generations: &[Generation],
    observer: &mut dyn SpeculatorObserver,
) -> Result<Vec<Scores>> {
    let sequences: Vec<Vec<u32>> = examples
        .source
        .iter()
        .map(|k| {
            let prompt = &setup.prompts.ids[setup.prompts.train[*k]];
            prompt.iter().chain(&generations[*k].ids).copied().collect()
        })
        .collect();
    let options = ScoreOptions {
        top_k: if off_policy_kd(config) {
            config.kd_topk
        } else {
            1
        },
        hidden_layers: if config.use_distillation {
            vec![config.distill_target_layer.unwrap_or(LAST_HIDDEN_LAYER)]
        } else {
            Vec::new()
        },
    };
    let manifest = ScoreCacheManifest {
        version: 1,
        teacher: teacher.teacher().fingerprint(),
        options,
        sequences: sequences_hash(&sequences),
        count: sequences.len(),
        shard_size: config.batch_size * setup.target_devices.len().max(1),
    };
    let world = kd_dist::world();
    let cache =
        ScoreCache::open_across(world, &teacher_cache_dir(config).join("scores"), manifest)?;
    let total = sequences.len();
    Ok(
        cache.score_across(world, teacher.teacher(), &sequences, |p| {
            observer.on_teacher_progress(Phase::Score, &p, total);
            continue_unless_stopped(observer)
        })?,
    )
}

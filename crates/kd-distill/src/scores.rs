//! The teacher's scores of the training and validation examples, through the score cache
//! (an interrupted run resumes from the finished shards; a stop on request ends after the
//! shard in progress).

use std::path::Path;
use std::time::Instant;

use kd_data::Example;
use kd_teacher::{ScoreCache, ScoreCacheManifest, ScoreOptions, Scores, Teacher, sequences_hash};

use kd_pipeline::continue_unless_stopped;

use crate::config::DistillConfig;
use crate::error::Result;
use crate::run::{Data, DistillObserver};

fn score_all(
    teacher: &dyn Teacher,
    examples: &[Example],
    top_k: usize,
    dir: &Path,
    shard: usize,
    scored: &mut usize,
    mut progress: impl FnMut(usize, usize) -> std::ops::ControlFlow<()>,
) -> Result<Vec<Scores>> {
    let sequences: Vec<Vec<u32>> = examples.iter().map(|e| e.input_ids.clone()).collect();
    let manifest = ScoreCacheManifest {
        version: 1,
        teacher: teacher.fingerprint(),
        options: ScoreOptions::top_k(top_k),
        sequences: sequences_hash(&sequences),
        count: sequences.len(),
        shard_size: shard,
    };
    // Across ranks, each scores its share of the shards; then every rank reads them all.
    let world = kd_dist::world();
    let cache = ScoreCache::open_across(world, dir, manifest)?;
    let total = sequences.len();
    // Counts only what this rank scored (a pass over a cached shard, as the second pass across
    // ranks is, scores nothing).
    let mut last = 0;
    let scores = cache.score_across(world, teacher, &sequences, |p| {
        if p.prompts_done < last {
            last = 0;
        }
        if !p.reused {
            *scored += p.prompts_done - last;
        }
        last = p.prompts_done;
        progress(p.prompts_done, total)
    })?;
    Ok(scores)
}

/// The teacher's scores of the training and validation examples.
pub(crate) struct TeacherScores {
    pub(crate) train: Vec<Scores>,
    pub(crate) validation: Vec<Scores>,
    /// Log-probs kept per position (`logits_topk`, or the whole vocabulary for 0).
    pub(crate) top_k: usize,
    /// Sequences scored in this run (cached shards are not scored again).
    pub(crate) sequences: usize,
    /// Wall time of the scoring.
    pub(crate) seconds: f64,
}

/// Scores every example through the teacher cache under the output directory: a resumed or
/// repeated run does not score twice.
pub(crate) fn score_data(
    config: &DistillConfig,
    teacher: &dyn Teacher,
    data: &Data,
    vocab: usize,
    observer: &mut dyn DistillObserver,
) -> Result<TeacherScores> {
    let started = Instant::now();
    let top_k = if config.logits_topk == 0 {
        vocab
    } else {
        config.logits_topk.min(vocab)
    };
    let cache = config.output_dir.join("teacher_cache");
    let shard = config.teacher.infer_batch_size;
    let total = data.train.len() + data.validation.len();
    let mut sequences = 0;
    let train = score_all(
        teacher,
        &data.train,
        top_k,
        &cache.join("train"),
        shard,
        &mut sequences,
        |d, _| {
            observer.on_score_progress(d, total);
            continue_unless_stopped(observer)
        },
    )?;
    let validation = if data.validation.is_empty() {
        Vec::new()
    } else {
        let n = data.train.len();
        score_all(
            teacher,
            &data.validation,
            top_k,
            &cache.join("validation"),
            shard,
            &mut sequences,
            |d, _| {
                observer.on_score_progress(n + d, total);
                continue_unless_stopped(observer)
            },
        )?
    };
    Ok(TeacherScores {
        train,
        validation,
        top_k,
        sequences,
        seconds: started.elapsed().as_secs_f64(),
    })
}

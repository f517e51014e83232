//! The cache: resume after SIGKILL without losing or repeating a prompt; mismatches refused.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kd_teacher::{
    CacheManifest, GenerationCache, SamplingParams, Teacher, prompts_hash, template_hash,
};

use crate::{prompts, teacher};

const CHILD_ENV: &str = "KD_TEACHER_CACHE_CHILD_DIR";

fn manifest(n: usize) -> CacheManifest {
    let t = teacher(4);
    CacheManifest {
        version: 1,
        teacher: t.fingerprint(),
        template: template_hash(None),
        sampling: SamplingParams {
            max_new_tokens: 6,
            temperature: 0.8,
            top_k: 40,
            seed: 9,
            stop_token_ids: vec![9999],
            ..SamplingParams::default()
        },
        prompts: prompts_hash(&prompts(n)),
        count: n,
        shard_size: 4,
    }
}

fn run(dir: &Path, slow: bool) -> Vec<kd_teacher::Generation> {
    let cache = GenerationCache::open(dir, manifest(18)).unwrap();
    cache
        .generate(&teacher(4), &prompts(18), |p| {
            if slow && p.shards_done == 2 && !p.reused {
                std::thread::sleep(Duration::from_secs(30));
            }
        })
        .unwrap()
}

#[test]
fn resume_after_sigkill() {
    // Started again by itself as the child (the variable names its directory): generates
    // slowly into it until the parent kills it.
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        run(Path::new(&dir), true);
        return;
    }
    let straight = tempfile::tempdir().unwrap();
    let expected = run(straight.path(), false);
    assert_eq!(expected.len(), 18);

    let killed = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "cache::resume_after_sigkill"])
        .env(CHILD_ENV, killed.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !killed.path().join("shard-00001.jsonl").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the child never wrote shard 1"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the child exited early"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !killed.path().join("shard-00004.jsonl").exists(),
        "the child finished before the kill"
    );

    let resumed = run(killed.path(), false);
    assert_eq!(resumed, expected, "resumed completions differ");
    // Every prompt exactly once across the shards.
    let mut indices = Vec::new();
    for s in 0..5 {
        let text =
            std::fs::read_to_string(killed.path().join(format!("shard-{s:05}.jsonl"))).unwrap();
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            indices.push(v["index"].as_u64().unwrap());
        }
    }
    assert_eq!(indices, (0..18).collect::<Vec<u64>>());
    assert!(
        std::fs::read_dir(killed.path())
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().contains(".tmp"))
    );
}

#[test]
fn mismatching_cache_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    GenerationCache::open(dir.path(), manifest(18)).unwrap();
    let mut other = manifest(18);
    other.sampling.temperature = 0.5;
    other.shard_size = 8;
    let e = GenerationCache::open(dir.path(), other)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sampling") && e.contains("shard_size") && e.contains("temperature"),
        "{e}"
    );
    // The same manifest reopens.
    GenerationCache::open(dir.path(), manifest(18)).unwrap();
    // Hidden states belong in a ScoreCache.
    let mut hidden = manifest(18);
    hidden.sampling.hidden_layers = vec![1];
    let e = GenerationCache::open(dir.path(), hidden)
        .unwrap_err()
        .to_string();
    assert!(e.contains("ScoreCache"), "{e}");
}

/// Counts the sequences a teacher is asked to score.
struct Counting<'a> {
    inner: &'a kd_teacher::LocalTeacher,
    scored: std::cell::Cell<usize>,
}

impl Teacher for Counting<'_> {
    fn generate(
        &self,
        prompts: &[kd_teacher::Prompt],
        params: &SamplingParams,
    ) -> kd_teacher::Result<Vec<kd_teacher::Generation>> {
        self.inner.generate(prompts, params)
    }

    fn score_with(
        &self,
        sequences: &[Vec<u32>],
        options: &kd_teacher::ScoreOptions,
    ) -> kd_teacher::Result<Vec<kd_teacher::Scores>> {
        self.scored.set(self.scored.get() + sequences.len());
        self.inner.score_with(sequences, options)
    }

    fn fingerprint(&self) -> String {
        self.inner.fingerprint()
    }
}

#[test]
fn score_cache_round_trips_exactly_and_recomputes_only_missing_shards() {
    use kd_teacher::{ScoreCache, ScoreCacheManifest, ScoreOptions, sequences_hash};
    let dir = tempfile::tempdir().unwrap();
    let local = teacher(3);
    let seqs: Vec<Vec<u32>> = prompts(7).into_iter().map(|p| p.ids).collect();
    let options = ScoreOptions {
        top_k: 6,
        hidden_layers: vec![0, 2],
    };
    let manifest = ScoreCacheManifest {
        version: 1,
        teacher: local.fingerprint(),
        options: options.clone(),
        sequences: sequences_hash(&seqs),
        count: seqs.len(),
        shard_size: 3,
    };
    let direct = local.score_with(&seqs, &options).unwrap();
    let counting = Counting {
        inner: &local,
        scored: std::cell::Cell::new(0),
    };
    let cache = ScoreCache::open(dir.path(), manifest.clone()).unwrap();
    assert_eq!(cache.score(&counting, &seqs, |_| {}).unwrap(), direct);
    assert_eq!(counting.scored.get(), 7);
    // Everything from disk, bit for bit.
    let again = ScoreCache::open(dir.path(), manifest.clone()).unwrap();
    assert_eq!(again.score(&counting, &seqs, |_| {}).unwrap(), direct);
    assert_eq!(counting.scored.get(), 7);
    // A lost shard is recomputed, alone.
    std::fs::remove_file(dir.path().join("scores-00001.safetensors")).unwrap();
    assert_eq!(again.score(&counting, &seqs, |_| {}).unwrap(), direct);
    assert_eq!(counting.scored.get(), 10);
    // Other options: refused, saying which.
    let other = ScoreCacheManifest {
        options: ScoreOptions::top_k(6),
        ..manifest
    };
    let err = ScoreCache::open(dir.path(), other).unwrap_err().to_string();
    assert!(err.contains("options"), "{err}");
    // A corrupt shard names the file.
    std::fs::write(dir.path().join("scores-00000.safetensors"), b"junk").unwrap();
    let err = again
        .score(&counting, &seqs, |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("scores-00000.safetensors"), "{err}");
}

/// Two data-parallel ranks sharing one cache: rank r makes the shards s with s mod 2 = r, and
/// together they write what one process writes, each shard once. A rank stopped after its
/// first shard keeps it; run again, it makes only the shards still missing, and a full read
/// then generates nothing.
#[test]
fn ranks_share_a_cache_shard_by_shard() {
    use std::ops::ControlFlow;
    let straight = tempfile::tempdir().unwrap();
    let expected = run(straight.path(), false);

    let shared = tempfile::tempdir().unwrap();
    let cache = GenerationCache::open(shared.path(), manifest(18)).unwrap();
    let counting = Counting {
        inner: &teacher(4),
        scored: std::cell::Cell::new(0),
    };
    // Rank 1 stops after its first shard (shard 1): a stop on request, the shard kept.
    let e = cache
        .generate_share_while(&counting, &prompts(18), (1, 2), |p| {
            assert_eq!(p.shards, 2, "rank 1 of 2 owns shards 1 and 3");
            ControlFlow::Break(())
        })
        .unwrap_err();
    assert!(e.to_string().contains("1 of 2"), "{e}");
    assert!(shared.path().join("shard-00001.jsonl").is_file());
    assert!(!shared.path().join("shard-00003.jsonl").exists());
    // Rank 0 makes shards 0, 2 and 4 and returns their 4 + 4 + 2 completions.
    let mine = cache
        .generate_share_while(&counting, &prompts(18), (0, 2), |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(mine.len(), 10);
    assert_eq!(mine[..4], expected[..4]);
    assert!(!shared.path().join("shard-00003.jsonl").exists());
    // Rank 1 again: only shard 3 is missing.
    let before = std::fs::metadata(shared.path().join("shard-00001.jsonl"))
        .unwrap()
        .modified()
        .unwrap();
    let rank1 = cache
        .generate_share_while(&counting, &prompts(18), (1, 2), |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(rank1.len(), 8);
    let after = std::fs::metadata(shared.path().join("shard-00001.jsonl"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(before, after, "rank 1 rewrote a finished shard");
    // Everything is there: a full read generates nothing and equals one process's run.
    let all = cache
        .generate_while(&PanicsOnGenerate, &prompts(18), |p| {
            assert!(p.reused);
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(all, expected);
}

/// A teacher that must not be asked.
struct PanicsOnGenerate;

impl Teacher for PanicsOnGenerate {
    fn generate(
        &self,
        _prompts: &[kd_teacher::Prompt],
        _params: &SamplingParams,
    ) -> kd_teacher::Result<Vec<kd_teacher::Generation>> {
        panic!("a cached shard was generated again")
    }

    fn score_with(
        &self,
        _sequences: &[Vec<u32>],
        _options: &kd_teacher::ScoreOptions,
    ) -> kd_teacher::Result<Vec<kd_teacher::Scores>> {
        panic!("not asked to score")
    }

    fn fingerprint(&self) -> String {
        teacher(4).fingerprint()
    }
}

//! The score cache: the teacher's top-k log-probs (and hidden states) per sequence, in
//! safetensors shards.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use sha2::{Digest, Sha256};

use kd_dist::World;

use super::{CacheProgress, open_manifest, stop_after, write_atomic};
use crate::error::{Result, TeacherError};
use crate::local::Teacher;
use crate::types::{LayerHidden, ScoreOptions, Scores};

/// What determines a score cache's contents.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreCacheManifest {
    /// Format version.
    pub version: u32,
    /// The teacher (see [`model_fingerprint`](super::model_fingerprint)).
    pub teacher: String,
    /// Top-k and hidden layers.
    pub options: ScoreOptions,
    /// SHA-256 of every sequence, in order.
    pub sequences: String,
    /// Number of sequences.
    pub count: usize,
    /// Sequences per shard.
    pub shard_size: usize,
}

/// SHA-256 of token sequences.
pub fn sequences_hash(sequences: &[Vec<u32>]) -> String {
    let mut h = Sha256::new();
    for s in sequences {
        h.update((s.len() as u64).to_le_bytes());
        for t in s {
            h.update(t.to_le_bytes());
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A cache directory of teacher scores (top-k log-probs and hidden states): shards in
/// safetensors (`lengths` `[n]` u32, `indices` `[positions, k]` u32, `logprobs` `[positions, k]`
/// f32, `hidden.{layer}` [positions, dim] f32), each written atomically.
#[derive(Debug, Clone)]
pub struct ScoreCache {
    dir: PathBuf,
    manifest: ScoreCacheManifest,
}

impl ScoreCache {
    /// Opens `dir` for `manifest` (creating it, or checking an existing one).
    pub fn open(dir: &Path, manifest: ScoreCacheManifest) -> Result<Self> {
        open_manifest(dir, &manifest)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
        })
    }

    fn shard_path(&self, s: usize) -> PathBuf {
        self.dir.join(format!("scores-{s:05}.safetensors"))
    }

    /// Scores of every sequence: shards on disk are read, the others computed by `teacher`
    /// and written before the next starts.
    pub fn score(
        &self,
        teacher: &dyn Teacher,
        sequences: &[Vec<u32>],
        mut progress: impl FnMut(CacheProgress),
    ) -> Result<Vec<Scores>> {
        self.score_while(teacher, sequences, |p| {
            progress(p);
            ControlFlow::Continue(())
        })
    }

    /// [`score`](Self::score), where `progress` may end the work after a shard, as in
    /// [`super::GenerationCache::generate_while`].
    pub fn score_while(
        &self,
        teacher: &dyn Teacher,
        sequences: &[Vec<u32>],
        progress: impl FnMut(CacheProgress) -> ControlFlow<()>,
    ) -> Result<Vec<Scores>> {
        self.score_share_while(teacher, sequences, (0, 1), progress)
    }

    /// [`open`](Self::open) by every rank of `world`, a collective: rank 0 first, as
    /// [`super::GenerationCache::open_across`].
    pub fn open_across(world: &World, dir: &Path, manifest: ScoreCacheManifest) -> Result<Self> {
        world.root_first(|| Self::open(dir, manifest))
    }

    /// [`score_while`](Self::score_while) by every rank of `world`, a collective: each rank
    /// scores its share, waits for the others, then reads them all, as
    /// [`super::GenerationCache::generate_across`].
    pub fn score_across(
        &self,
        world: &World,
        teacher: &dyn Teacher,
        sequences: &[Vec<u32>],
        mut progress: impl FnMut(CacheProgress) -> ControlFlow<()>,
    ) -> Result<Vec<Scores>> {
        if world.is_distributed() {
            self.score_share_while(
                teacher,
                sequences,
                (world.rank(), world.size()),
                &mut progress,
            )?;
            world.barrier()?;
        }
        self.score_while(teacher, sequences, progress)
    }

    /// [`score_while`](Self::score_while) for rank `rank` of `ranks` processes sharing the
    /// cache: only the shards `s` with `s % ranks == rank`, as in
    /// [`super::GenerationCache::generate_share_while`].
    pub fn score_share_while(
        &self,
        teacher: &dyn Teacher,
        sequences: &[Vec<u32>],
        (rank, ranks): (usize, usize),
        mut progress: impl FnMut(CacheProgress) -> ControlFlow<()>,
    ) -> Result<Vec<Scores>> {
        if sequences.len() != self.manifest.count
            || sequences_hash(sequences) != self.manifest.sequences
        {
            return Err(TeacherError::CacheMismatch {
                path: self.dir.clone(),
                differences: "the sequences differ from the manifest's".into(),
            });
        }
        let size = self.manifest.shard_size.max(1);
        let ranks = ranks.max(1);
        let shards = sequences
            .len()
            .div_ceil(size)
            .saturating_sub(rank)
            .div_ceil(ranks);
        let mut all = Vec::with_capacity(sequences.len());
        let mut done = 0;
        for (s, chunk) in sequences.chunks(size).enumerate() {
            if s % ranks != rank {
                continue;
            }
            let path = self.shard_path(s);
            let reused = path.is_file();
            let scores = if reused {
                self.read_shard(&path, chunk)?
            } else {
                let scores = teacher.score_with(chunk, &self.manifest.options)?;
                write_atomic(&path, &self.encode(&scores)?)?;
                scores
            };
            let tokens = scores.iter().map(|s| s.len).sum();
            all.extend(scores);
            done += 1;
            let p = CacheProgress {
                shards_done: done,
                shards,
                prompts_done: all.len(),
                reused,
                tokens,
            };
            stop_after(&self.dir, p, &mut progress)?;
        }
        Ok(all)
    }

    fn encode(&self, scores: &[Scores]) -> Result<Vec<u8>> {
        use safetensors::tensor::{Dtype, TensorView};
        let k = self.manifest.options.top_k;
        let positions: usize = scores.iter().map(|s| s.len).sum();
        let lengths: Vec<u8> = scores
            .iter()
            .flat_map(|s| (s.len as u32).to_le_bytes())
            .collect();
        let indices: Vec<u8> = scores
            .iter()
            .flat_map(|s| s.indices.iter().flat_map(|i| i.to_le_bytes()))
            .collect();
        let logprobs: Vec<u8> = scores
            .iter()
            .flat_map(|s| s.logprobs.iter().flat_map(|v| v.to_le_bytes()))
            .collect();
        let mut hidden = Vec::new();
        for (j, layer) in self.manifest.options.hidden_layers.iter().enumerate() {
            let dim = scores.first().map_or(0, |s| s.hidden_states[j].dim);
            let bytes: Vec<u8> = scores
                .iter()
                .flat_map(|s| {
                    s.hidden_states[j]
                        .values
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                })
                .collect();
            hidden.push((format!("hidden.{layer}"), dim, bytes));
        }
        fn view<'a>(
            dir: &Path,
            dtype: Dtype,
            shape: Vec<usize>,
            data: &'a [u8],
        ) -> Result<TensorView<'a>> {
            TensorView::new(dtype, shape, data).map_err(|e| TeacherError::Format {
                path: dir.to_path_buf(),
                message: format!("cannot encode scores: {e}"),
            })
        }
        let dir = self.dir.as_path();
        let mut tensors = vec![
            (
                "lengths".to_string(),
                view(dir, Dtype::U32, vec![scores.len()], &lengths)?,
            ),
            (
                "indices".to_string(),
                view(dir, Dtype::U32, vec![positions, k], &indices)?,
            ),
            (
                "logprobs".to_string(),
                view(dir, Dtype::F32, vec![positions, k], &logprobs)?,
            ),
        ];
        for (name, dim, bytes) in &hidden {
            tensors.push((
                name.clone(),
                view(dir, Dtype::F32, vec![positions, *dim], bytes)?,
            ));
        }
        safetensors::serialize(tensors, None).map_err(|e| TeacherError::Format {
            path: self.dir.clone(),
            message: format!("cannot encode scores: {e}"),
        })
    }

    fn read_shard(&self, path: &Path, expected: &[Vec<u32>]) -> Result<Vec<Scores>> {
        let bytes = std::fs::read(path).map_err(|e| TeacherError::io(path, e))?;
        let bad = |m: String| TeacherError::Format {
            path: path.to_path_buf(),
            message: m,
        };
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let get = |name: &str| {
            st.tensor(name)
                .map_err(|e| bad(format!("tensor `{name}`: {e}")))
        };
        let words = |data: &[u8]| -> Vec<u32> {
            data.chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect()
        };
        let floats = |data: &[u8]| -> Vec<f32> {
            data.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect()
        };
        let lengths = words(get("lengths")?.data());
        let want: Vec<u32> = expected.iter().map(|s| s.len() as u32).collect();
        if lengths != want {
            return Err(bad(format!(
                "sequence lengths {lengths:?} where {want:?} were expected"
            )));
        }
        let k = self.manifest.options.top_k;
        let positions: usize = want.iter().map(|l| *l as usize).sum();
        let indices = words(get("indices")?.data());
        let logprobs = floats(get("logprobs")?.data());
        if indices.len() != positions * k || logprobs.len() != positions * k {
            return Err(bad(format!("top-k tensors are not [{positions}, {k}]")));
        }
        let mut hidden = Vec::new();
        for layer in &self.manifest.options.hidden_layers {
            let t = get(&format!("hidden.{layer}"))?;
            let dim = t.shape().get(1).copied().unwrap_or(0);
            if t.shape() != [positions, dim] {
                return Err(bad(format!("hidden.{layer} has shape {:?}", t.shape())));
            }
            hidden.push((*layer, dim, floats(t.data())));
        }
        let mut out = Vec::with_capacity(expected.len());
        let mut at = 0;
        for len in want.iter().map(|l| *l as usize) {
            out.push(Scores {
                len,
                k,
                indices: indices[at * k..(at + len) * k].to_vec(),
                logprobs: logprobs[at * k..(at + len) * k].to_vec(),
                hidden_states: hidden
                    .iter()
                    .map(|(layer, dim, v)| LayerHidden {
                        layer: *layer,
                        dim: *dim,
                        values: v[at * dim..(at + len) * dim].to_vec(),
                    })
                    .collect(),
            });
            at += len;
        }
        Ok(out)
    }
}

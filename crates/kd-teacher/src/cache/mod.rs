//! The on-disk teacher caches: completions in JSONL shards (and scores in safetensors
//! shards, [`ScoreCache`]), each written atomically, under a
//! manifest keyed by what determines them (teacher files, chat template, sampling parameters,
//! prompts). A run killed midway resumes at the first missing shard, so no prompt is lost or
//! generated twice; a cache made with other settings is refused with the differences.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use kd_dist::World;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Result, TeacherError};
use crate::local::{Prompt, Teacher};
use crate::types::{Generation, SamplingParams};

mod score;

pub use score::{ScoreCache, ScoreCacheManifest, sequences_hash};

/// The manifest file of a cache directory.
pub const MANIFEST: &str = "manifest.json";

/// What determines a cache's contents.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheManifest {
    /// Format version.
    pub version: u32,
    /// The teacher (see [`model_fingerprint`]).
    pub teacher: String,
    /// SHA-256 of the chat template source (or of "none").
    pub template: String,
    /// The sampling parameters.
    pub sampling: SamplingParams,
    /// SHA-256 of every prompt's ids, in order.
    pub prompts: String,
    /// Number of prompts.
    pub count: usize,
    /// Prompts per shard.
    pub shard_size: usize,
}

pub(super) fn sha256_hex(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of the prompts' ids.
pub fn prompts_hash(prompts: &[Prompt]) -> String {
    let mut h = Sha256::new();
    for p in prompts {
        h.update(p.index.to_le_bytes());
        h.update((p.ids.len() as u64).to_le_bytes());
        for t in &p.ids {
            h.update(t.to_le_bytes());
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a chat template source.
pub fn template_hash(source: Option<&str>) -> String {
    sha256_hex(&[source.unwrap_or("none").as_bytes()])
}

/// A fingerprint of a model without reading all its weights: `config.json` (when there is
/// one), and for every safetensors or GGUF file its name, size and the hashes of its first and
/// last MiB. `path` is a model directory or a `.gguf` file.
pub fn model_fingerprint(path: &Path) -> Result<String> {
    let mut parts: Vec<Vec<u8>> = Vec::new();
    let mut files: Vec<PathBuf> = if path.is_file() {
        vec![path.to_path_buf()]
    } else {
        std::fs::read_dir(path)
            .map_err(|e| TeacherError::io(path, e))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.extension()
                    .is_some_and(|e| e == "safetensors" || e == "gguf")
            })
            .collect()
    };
    files.sort();
    let cfg = path.join("config.json");
    let gguf = files
        .iter()
        .any(|f| f.extension().is_some_and(|e| e == "gguf"));
    if !gguf || cfg.is_file() {
        parts.push(std::fs::read(&cfg).map_err(|e| TeacherError::io(&cfg, e))?);
    }
    for f in files {
        let (bytes_len, head, tail) = head_and_tail(&f, 1 << 20)?;
        let (head, tail) = (head.as_slice(), tail.as_slice());
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        parts.push(format!("{name}:{bytes_len}").into_bytes());
        parts.push(sha256_hex(&[head, tail]).into_bytes());
    }
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    Ok(sha256_hex(&refs))
}

/// A file's length, its first `n` bytes and its last `n` bytes (overlapping for files shorter
/// than `2n`), read without reading the rest.
fn head_and_tail(path: &Path, n: u64) -> Result<(u64, Vec<u8>, Vec<u8>)> {
    use std::io::{Read, Seek, SeekFrom};
    let io = |e| TeacherError::io(path, e);
    let mut file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    let mut head = Vec::new();
    (&mut file)
        .take(n.min(len))
        .read_to_end(&mut head)
        .map_err(io)?;
    file.seek(SeekFrom::Start(len.saturating_sub(n)))
        .map_err(io)?;
    let mut tail = Vec::new();
    file.read_to_end(&mut tail).map_err(io)?;
    Ok((len, head, tail))
}

/// A line of a shard file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Line {
    index: u64,
    #[serde(flatten)]
    generation: Generation,
}

/// Progress of a cached generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheProgress {
    /// Shards done (including those found on disk).
    pub shards_done: usize,
    /// Shards in all (this rank's, when ranks share the cache).
    pub shards: usize,
    /// Prompts done.
    pub prompts_done: usize,
    /// Whether the last shard came from disk.
    pub reused: bool,
    /// Tokens of the last shard: generated ids (generation cache) or scored positions
    /// (score cache).
    pub tokens: usize,
}

/// A cache directory of completions.
#[derive(Debug, Clone)]
pub struct GenerationCache {
    dir: PathBuf,
    manifest: CacheManifest,
}

impl GenerationCache {
    /// Opens `dir` for `manifest`: creates it, or checks that an existing cache was made with
    /// the same settings.
    pub fn open(dir: &Path, manifest: CacheManifest) -> Result<Self> {
        if !manifest.sampling.hidden_layers.is_empty() {
            return Err(TeacherError::Config(
                "the generation cache keeps ids and text only: cache hidden states with a \
                 ScoreCache over prompt + completion"
                    .into(),
            ));
        }
        open_manifest(dir, &manifest)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
        })
    }

    fn shard_path(&self, s: usize) -> PathBuf {
        self.dir.join(format!("shard-{s:05}.jsonl"))
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.manifest
            .count
            .div_ceil(self.manifest.shard_size.max(1))
    }

    fn read_shard(&self, s: usize, expected: &[Prompt]) -> Result<Vec<Generation>> {
        let path = self.shard_path(s);
        let text = std::fs::read_to_string(&path).map_err(|e| TeacherError::io(&path, e))?;
        let mut out = Vec::with_capacity(expected.len());
        for (i, (line, p)) in text.lines().zip(expected).enumerate() {
            let l: Line = serde_json::from_str(line).map_err(|e| TeacherError::Format {
                path: path.clone(),
                message: format!("line {}: {e}", i + 1),
            })?;
            if l.index != p.index {
                return Err(TeacherError::Format {
                    path: path.clone(),
                    message: format!(
                        "line {} holds prompt {} where {} was expected",
                        i + 1,
                        l.index,
                        p.index
                    ),
                });
            }
            out.push(l.generation);
        }
        if out.len() != expected.len() {
            return Err(TeacherError::Format {
                path,
                message: format!(
                    "{} completions where {} were expected",
                    out.len(),
                    expected.len()
                ),
            });
        }
        Ok(out)
    }

    /// Completions of every prompt: shards found on disk are read, the others generated by
    /// `teacher` and written (each atomically) before the next starts.
    pub fn generate(
        &self,
        teacher: &dyn Teacher,
        prompts: &[Prompt],
        mut progress: impl FnMut(CacheProgress),
    ) -> Result<Vec<Generation>> {
        self.generate_while(teacher, prompts, |p| {
            progress(p);
            ControlFlow::Continue(())
        })
    }

    /// [`generate`](Self::generate), where `progress` may end the work after a shard:
    /// [`ControlFlow::Break`] with shards left is [`TeacherError::Stopped`] (the finished
    /// shards stay on disk for the next run).
    pub fn generate_while(
        &self,
        teacher: &dyn Teacher,
        prompts: &[Prompt],
        progress: impl FnMut(CacheProgress) -> ControlFlow<()>,
    ) -> Result<Vec<Generation>> {
        self.generate_share_while(teacher, prompts, (0, 1), progress)
    }

    /// [`open`](Self::open) by every rank of `world`, a collective: rank 0 first (it writes
    /// the manifest), then the others (they check it).
    pub fn open_across(world: &World, dir: &Path, manifest: CacheManifest) -> Result<Self> {
        world.root_first(|| Self::open(dir, manifest))
    }

    /// [`generate_while`](Self::generate_while) by every rank of `world`, a collective: each
    /// rank makes its share of the shards ([`generate_share_while`](Self::generate_share_while)),
    /// waits for the others, then reads them all. `progress` hears of both passes. Alone: just
    /// [`generate_while`](Self::generate_while).
    pub fn generate_across(
        &self,
        world: &World,
        teacher: &dyn Teacher,
        prompts: &[Prompt],
        mut progress: impl FnMut(CacheProgress) -> ControlFlow<()>,
    ) -> Result<Vec<Generation>> {
        if world.is_distributed() {
            self.generate_share_while(
                teacher,
                prompts,
                (world.rank(), world.size()),
                &mut progress,
            )?;
            world.barrier()?;
        }
        self.generate_while(teacher, prompts, progress)
    }

    /// [`generate_while`](Self::generate_while) for one of `ranks` processes sharing the
    /// cache: rank `rank` makes (or reads) only the shards `s` with `s % ranks == rank` and
    /// returns their completions, in shard order. Once every rank has returned, any of them
    /// reads the whole cache with [`generate`](Self::generate) without generating anything.
    /// Ranks never write the same shard; a rank killed midway loses only its unfinished shard.
    pub fn generate_share_while(
        &self,
        teacher: &dyn Teacher,
        prompts: &[Prompt],
        (rank, ranks): (usize, usize),
        mut progress: impl FnMut(CacheProgress) -> ControlFlow<()>,
    ) -> Result<Vec<Generation>> {
        if prompts.len() != self.manifest.count || prompts_hash(prompts) != self.manifest.prompts {
            return Err(TeacherError::CacheMismatch {
                path: self.dir.clone(),
                differences: "the prompts differ from the manifest's".into(),
            });
        }
        let size = self.manifest.shard_size.max(1);
        let mut all = Vec::with_capacity(prompts.len());
        let ranks = ranks.max(1);
        let mine = self.shards().saturating_sub(rank).div_ceil(ranks);
        let mut done = 0;
        for (s, chunk) in prompts.chunks(size).enumerate() {
            if s % ranks != rank {
                continue;
            }
            let path = self.shard_path(s);
            let reused = path.is_file();
            let gens = if reused {
                self.read_shard(s, chunk)?
            } else {
                let gens = teacher.generate(chunk, &self.manifest.sampling)?;
                let mut buf = Vec::new();
                for (p, g) in chunk.iter().zip(&gens) {
                    let line = Line {
                        index: p.index,
                        generation: g.clone(),
                    };
                    serde_json::to_writer(&mut buf, &line).expect("serialises");
                    buf.push(b'\n');
                }
                write_atomic(&path, &buf)?;
                gens
            };
            let tokens = gens.iter().map(|g| g.ids.len()).sum();
            all.extend(gens);
            done += 1;
            let p = CacheProgress {
                shards_done: done,
                shards: mine,
                prompts_done: all.len(),
                reused,
                tokens,
            };
            stop_after(&self.dir, p, &mut progress)?;
        }
        Ok(all)
    }
}

/// Reports a finished shard; a stop asked for with shards left is [`TeacherError::Stopped`].
pub(super) fn stop_after(
    dir: &Path,
    p: CacheProgress,
    progress: &mut impl FnMut(CacheProgress) -> ControlFlow<()>,
) -> Result<()> {
    let (done, shards) = (p.shards_done, p.shards);
    if progress(p).is_break() && done < shards {
        return Err(TeacherError::Stopped {
            path: dir.to_path_buf(),
            shards_done: done,
            shards,
        });
    }
    Ok(())
}

/// Creates `dir` with `manifest`, or checks that the manifest there equals it (listing the
/// fields that differ).
pub(super) fn open_manifest<M>(dir: &Path, manifest: &M) -> Result<()>
where
    M: Serialize + serde::de::DeserializeOwned + PartialEq,
{
    std::fs::create_dir_all(dir).map_err(|e| TeacherError::io(dir, e))?;
    let path = dir.join(MANIFEST);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let existing: M = serde_json::from_str(&text).map_err(|e| TeacherError::Format {
                path: path.clone(),
                message: format!("invalid manifest (another kind of cache?): {e}"),
            })?;
            if existing != *manifest {
                let a = serde_json::to_value(&existing).expect("serialises");
                let b = serde_json::to_value(manifest).expect("serialises");
                let mut diffs = Vec::new();
                for (k, v) in b.as_object().expect("object") {
                    if a.get(k) != Some(v) {
                        diffs.push(format!(
                            "{k} (cache {} vs now {v})",
                            a.get(k).cloned().unwrap_or_default()
                        ));
                    }
                }
                return Err(TeacherError::CacheMismatch {
                    path: dir.to_path_buf(),
                    differences: diffs.join(", "),
                });
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let text = serde_json::to_string_pretty(manifest).expect("serialises");
            write_atomic(&path, text.as_bytes())
        }
        Err(e) => Err(TeacherError::io(&path, e)),
    }
}

pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    kd_kernels::write_atomic(path, bytes).map_err(|e| TeacherError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::head_and_tail;

    /// The first and last bytes read by seeking equal the slices of the whole file (which
    /// the fingerprint hashed before), for files longer and shorter than two windows.
    #[test]
    fn head_and_tail_equal_slices_of_the_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        for len in [0usize, 10, 1000, 5000] {
            let p = dir.path().join(format!("f{len}"));
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            std::fs::write(&p, &data).unwrap();
            let n = 1024;
            let (l, head, tail) = head_and_tail(&p, n as u64).unwrap();
            assert_eq!(l as usize, len);
            assert_eq!(head, &data[..len.min(n)]);
            assert_eq!(tail, &data[len.saturating_sub(n)..]);
        }
    }
}

//! Training EAGLE-3 drafts with the generic trainer: the draft as a [`Trainable`] model, and
//! the TTT loss over the target's features. The target runs without gradients on a row the
//! first time the row is seen; what the loss reads of it (the three layers' features, the
//! final normed hidden state, the log-normaliser and the argmax) is kept in memory up to a
//! budget ([`TargetCache`]), so that later epochs skip the target. The logits of the draft
//! vocabulary are made again from the final hidden state on every step (the target's LM head
//! rows of the draft vocabulary): a quarter of the memory a kept logit row would take at
//! SmolLM2's size. With a directory ([`TargetCache::with_dir`], `--target_cache_dir`) the rows
//! also go to disk, for later runs to read back instead of running the target
//! ([`TargetRowsManifest`]); and a target in this process keeps each row as it generates the
//! row's completion (`TargetCache::keep_generated`), so that training runs no pass of the
//! target over it at all.
//!
//! Alignment follows SpecForge's target head: the target runs over the unshifted tokens; the
//! draft's position `t` reads the target's features at `t` and the embedding of token `t + 1`,
//! and learns the target's distribution at `t + 1`; a position counts when token `t + 1` is a
//! completion token. The loss of a micro-batch is SpecForge's masked soft cross-entropy summed
//! over positions and steps (weights `0.8^k`), divided by the trainer's normaliser (the step's
//! label-token count) rather than SpecForge's `batch · seq`, so that gradient accumulation and
//! micro-batch sizes do not change the objective.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use kd_data::{Batch, Example};
use kd_eval::Drafter;
use kd_lora::derive_seed;
use kd_loss::{ReducedLogits, TTT_DECAY, TttTargets, ttt_step_counts, ttt_step_loss};
use kd_model::generate::to_host;
use kd_model::{DraftVocab, Eagle3Config, Eagle3Draft, ForwardOptions, HiddenStates, Llama};
use kd_train::{
    StepLoss, StepLossFn, TrainConfig, TrainError, TrainMode, Trainable, Trainer, token_batch,
};
use rayon::prelude::*;

use crate::acceptance::{CheckpointDraft, CheckpointEval, Eagle3Source, TrainingWatcher};
use crate::config::DraftHeadInit;
use crate::error::PipelineError;
use crate::observe::Phase;
use crate::run::{Phases, Trained};
use crate::settings::{TeacherBackend, train_config};
use crate::setup::{aux_layers, draft_vocab_size};

mod disk;

pub use disk::{TARGET_ROWS_MANIFEST, TargetRowsManifest};

/// The target layers whose hidden states the draft reads, in Hugging Face's
/// `output_hidden_states` indexing (index i is the input of decoder layer i): `[2, L/2, L − 3]`
/// for a target of `L` layers, the low / mid / high choice of EAGLE-3, SpecForge, vLLM and
/// SGLang. Small targets clamp into `1..L` (the inputs of layers 1 to L − 1, which every
/// server can capture).
pub fn default_feature_layers(num_layers: usize) -> [usize; 3] {
    let top = num_layers.saturating_sub(1).max(1);
    let high = num_layers.saturating_sub(3).clamp(1, top);
    let mid = (num_layers / 2).clamp(1, high);
    let low = 2.clamp(1, mid);
    [low, mid, high]
}

/// The draft vocabulary from the completion tokens of the training examples (the tokens the
/// draft learns to predict), by SpecForge's rule ([`DraftVocab::from_counts`]).
pub fn draft_vocab_from_examples(
    examples: &[Example],
    target_vocab: usize,
    size: usize,
) -> kd_model::Result<DraftVocab> {
    let mut counts = vec![0u64; target_vocab];
    for e in examples {
        for &l in &e.labels {
            if l >= 0 && (l as usize) < target_vocab {
                counts[l as usize] += 1;
            }
        }
    }
    DraftVocab::from_counts(&counts, size.min(target_vocab))
}

/// An EAGLE-3 draft under training: every draft weight trains, the target's embedding stays
/// frozen. Checkpoints hold the draft as SpecForge exports it ([`Eagle3Draft::save`]).
#[derive(Module, Debug)]
pub struct Eagle3Model {
    /// The draft.
    pub draft: Eagle3Draft,
}

impl Trainable for Eagle3Model {
    fn device(&self) -> Device {
        self.draft.fc.val().device()
    }

    fn mode(&self) -> TrainMode {
        TrainMode::Full
    }

    fn pad_id(&self) -> u32 {
        self.draft.config().llama.pad_token_id.unwrap_or(0)
    }

    fn save_files(&self, dir: &Path) -> kd_train::Result<()> {
        Ok(self.draft.save(dir)?)
    }

    fn load_files(self, dir: &Path) -> kd_train::Result<Self> {
        let device = self.device();
        let embedding = self.draft.embed_tokens.val();
        Ok(Self {
            draft: Eagle3Draft::load(dir, Some(embedding), &device)?,
        })
    }

    fn describe(&self) -> Option<String> {
        let c = self.draft.config();
        Some(format!(
            "EAGLE-3 draft: width {}, draft vocabulary {} of {}, features of 3 target layers",
            c.llama.hidden_size, c.draft_vocab_size, c.llama.vocab_size
        ))
    }
}

/// `["ttt_step0{suffix}", …, "ttt_step15{suffix}"]`.
macro_rules! step_names {
    ($suffix:literal) => {
        step_names!($suffix; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    ($suffix:literal; $($k:literal)*) => {
        [$(concat!("ttt_step", $k, $suffix)),*]
    };
}

/// The per-step metric names of the training log, for the first 16 TTT steps (later steps are
/// trained but not logged one by one). `ttt_step{k}_acc`: the share of the step's label tokens
/// where step `k`'s draft argmax is the target's argmax (SpecForge's `acc_k`; for `k > 0`
/// SpecForge divides by the labels left after the shift, a few fewer). `ttt_step{k}_alpha`:
/// `Σ min(p_target, p_draft)` per label token, a token outside the draft vocabulary counting
/// as rejected (SpecForge's acceptance rate divides by the in-vocabulary tokens instead), the
/// expected acceptance of that step's draft.
const STEP_ACC: [&str; 16] = step_names!("_acc");
/// See [`STEP_ACC`].
const STEP_ALPHA: [&str; 16] = step_names!("_alpha");

/// The TTT loss of an EAGLE-3 draft against a target run online, once per distinct row while
/// its [`TargetCache`] has room.
pub struct Eagle3Loss<'a> {
    /// The target (inference only).
    pub target: &'a Llama,
    /// Its layers the draft reads ([`default_feature_layers`]).
    pub layers: [usize; 3],
    /// TTT steps per position (SpecForge's default 7).
    pub ttt_length: usize,
    /// What the target gave each row already ([`TargetCache::new`]`(0)` keeps nothing).
    pub cache: TargetCache,
}

/// What the loss reads of the target for one row, at its real positions in order: the
/// features (`[n, 3·d]`), the final normed hidden state (`[n, d]`, what the target's LM head
/// reads), the log-normaliser over the target's vocabulary and the argmax (`[n]` each).
#[derive(Debug)]
struct RowTargets {
    features: Vec<f32>,
    last: Vec<f32>,
    log_z: Vec<f32>,
    argmax: Vec<i64>,
}

impl RowTargets {
    fn bytes(&self) -> usize {
        4 * (self.features.len() + self.last.len() + self.log_z.len()) + 8 * self.argmax.len()
    }
}

/// The target's outputs for the rows of EAGLE-3 training, kept in memory so that each distinct
/// row runs through the target once, not once per epoch (the target's forward pass is most of
/// a training step on the CPU). Rows are keyed by their contents (tokens, positions and
/// packed sequences): a kept row is what the target computed for those tokens. Once `budget`
/// bytes are held, further rows are computed on every visit and not kept in memory (with a
/// directory, [`with_dir`](Self::with_dir), they are read back from disk instead). Training
/// with it ends with the bytes of training without it (tested).
#[derive(Default)]
pub struct TargetCache {
    budget: usize,
    state: Mutex<CacheState>,
    /// Where rows also go, and are looked for when not in memory.
    disk: Option<disk::DiskRows>,
    /// The target's LM head rows of the draft vocabulary, transposed (`[d, draft_vocab]`),
    /// on the target's device, with the vocabulary's target ids they were made for.
    head: Mutex<Option<(Vec<u32>, Tensor<2>)>>,
}

impl std::fmt::Debug for TargetCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TargetCache")
            .field("budget", &self.budget)
            .field("disk", &self.disk)
            .field("stats", &self.stats())
            .finish()
    }
}

#[derive(Default)]
struct CacheState {
    bytes: usize,
    rows: HashMap<Vec<u32>, Arc<RowTargets>>,
    full: bool,
    hits: usize,
    misses: usize,
    disk_reads: usize,
    disk_writes: usize,
    captured: usize,
}

/// What a [`TargetCache`] holds and how often it was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Rows held.
    pub rows: usize,
    /// Bytes held (the rows' targets and keys).
    pub bytes: usize,
    /// Rows read back from memory instead of running the target.
    pub hits: usize,
    /// Rows the target ran on.
    pub misses: usize,
    /// Rows read back from disk instead of running the target
    /// ([`TargetCache::with_dir`]).
    pub disk_reads: usize,
    /// Rows written to disk.
    pub disk_writes: usize,
    /// Rows kept while the target generated them (with a directory and the target in this
    /// process): the target ran no pass of its own over them.
    pub captured: usize,
}

impl TargetCache {
    /// A cache holding at most `budget` bytes (0: nothing is kept; the target runs on every
    /// micro-batch).
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            state: Mutex::default(),
            disk: None,
            head: Mutex::default(),
        }
    }

    /// The same cache, its rows also kept on disk under `dir` (made where it does not exist)
    /// and looked for there when not in memory: a later run over the same rows reads them back
    /// instead of running the target, the same bits. Refused, naming each difference, where
    /// `dir` holds the rows of another target or other layers than `manifest`'s.
    pub fn with_dir(self, dir: &Path, manifest: &TargetRowsManifest) -> crate::Result<Self> {
        Ok(Self {
            disk: Some(disk::DiskRows::open(dir, manifest)?),
            ..self
        })
    }

    /// Bytes kept per real token position: three features and the final hidden state, of
    /// width `target_hidden` each, the log-normaliser (f32 each) and the argmax (i64). The
    /// logits of the draft vocabulary are not kept (they are made again on each step), so the
    /// draft vocabulary's size does not count.
    pub fn bytes_per_position(target_hidden: usize) -> usize {
        4 * (4 * target_hidden + 1) + 8
    }

    /// The target's LM head rows of `vocab`'s tokens, transposed, made once per vocabulary.
    fn head(&self, target: &Llama, vocab: &DraftVocab) -> Tensor<2> {
        let mut head = self
            .head
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match head.as_ref() {
            Some((ids, w)) if ids.as_slice() == vocab.target_ids() => w.clone(),
            _ => {
                let rows: Vec<usize> = vocab.target_ids().iter().map(|&t| t as usize).collect();
                let w = Tensor::<2>::from_data(
                    target.lm_head_rows(&rows),
                    (&target.embed_tokens.weight.lazy_device(), DType::F32),
                )
                .transpose();
                *head = Some((vocab.target_ids().to_vec(), w.clone()));
                w
            }
        }
    }

    /// What is held, and how often rows were read back or computed.
    pub fn stats(&self) -> CacheStats {
        let state = self.lock();
        CacheStats {
            rows: state.rows.len(),
            bytes: state.bytes,
            hits: state.hits,
            misses: state.misses,
            disk_reads: state.disk_reads,
            disk_writes: state.disk_writes,
            captured: state.captured,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheState> {
        // A panic while holding the lock leaves whole entries only: the map stays usable.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether rows are kept while the target generates them ([`keep_generated`](Self::keep_generated)):
    /// with a directory only. A resumed run reads a row back from there; a row held in memory
    /// alone would be made again by `Eagle3Loss::run_row`'s full pass, in other bits, and the
    /// resumed run would train on other numbers than the uninterrupted one.
    pub(crate) fn captures(&self) -> bool {
        self.disk.is_some()
    }

    /// Keeps what the target computed while it generated `completion` after `prompt`
    /// ([`kd_teacher::LocalTeacher::generate_captured`] over [`captured_layers`]) as the
    /// targets of the training row they make, so that training reads them instead of running
    /// the target over the row again. Such a row holds the decode loop's numbers (the prompt's
    /// batched pass, then one position a step), which agree with the full pass's to rounding;
    /// it goes to disk (and to memory while the budget has room) as a computed row does.
    /// Positions before the prompt's last have no logits: they get the padding's zero hidden
    /// state and uniform normaliser (no counted position reads them: a position counts when
    /// the next token is a completion token). A row that `max_seq_length` cuts at its
    /// completion's end (the prompt kept whole) is the first positions of the captured one: a
    /// position's numbers depend only on the tokens up to it. Nothing is kept for an empty
    /// completion, for a row whose prompt the cut shortened (it starts elsewhere, so its
    /// targets differ; training computes it), and without a directory
    /// ([`captures`](Self::captures)).
    pub(crate) fn keep_generated(
        &self,
        prompt: &[u32],
        completion: &[u32],
        row: &kd_model::CapturedRow,
        max_seq_length: usize,
        vocab: usize,
    ) {
        let n = prompt.len() + completion.len();
        if !self.captures() || completion.is_empty() || row.len != n || n == 0 {
            return;
        }
        let options = kd_data::ExampleOptions {
            max_seq_length,
            train_on_prompt: false,
        };
        let (example, _) = kd_data::build_example("", prompt, completion, &options);
        // The training row: all of the captured one, or its first `m` positions when the cut
        // took the completion's end only.
        let m = example.input_ids.len();
        if example.prompt_len != prompt.len() || m == 0 {
            return;
        }
        // The key the trainer's row of this example alone has.
        let batch = kd_data::collate(&[example], &[vec![0]], 0, m);
        let key = row_key(&batch, 0, &real_positions(&batch, 0));
        // Three features and the final hidden state per position ([`captured_layers`]).
        let width = row.hidden.len() / n;
        let d = width / 4;
        if d == 0 || width != 4 * d || row.hidden.len() != n * width {
            return;
        }
        let mut targets = RowTargets {
            features: Vec::with_capacity(m * 3 * d),
            last: Vec::with_capacity(m * d),
            log_z: vec![(vocab as f32).ln(); m],
            argmax: vec![0; m],
        };
        for (t, position) in row.hidden.chunks_exact(width).take(m).enumerate() {
            targets.features.extend_from_slice(&position[..3 * d]);
            if t < row.logits_from {
                targets.last.extend(std::iter::repeat_n(0f32, d));
            } else {
                targets.last.extend_from_slice(&position[3 * d..]);
            }
        }
        let logits = row.log_z.iter().zip(&row.argmax);
        for (j, (&z, &a)) in logits.take(m.saturating_sub(row.logits_from)).enumerate() {
            targets.log_z[row.logits_from + j] = z;
            targets.argmax[row.logits_from + j] = a as i64;
        }
        self.lock().captured += 1;
        self.insert(key, Arc::new(targets));
    }

    /// The row keyed `key` from memory, else from disk (then kept in memory while there is
    /// room); `None` (a miss) when the target must run on it.
    fn get(&self, key: &[u32]) -> Option<Arc<RowTargets>> {
        {
            let mut state = self.lock();
            if let Some(row) = state.rows.get(key).cloned() {
                state.hits += 1;
                return Some(row);
            }
        }
        // Read without holding the lock.
        let found = self.disk.as_ref().and_then(|disk| disk.read(key));
        match found {
            Some(row) => {
                let row = Arc::new(row);
                self.lock().disk_reads += 1;
                self.keep(key.to_vec(), row.clone());
                Some(row)
            }
            None => {
                self.lock().misses += 1;
                None
            }
        }
    }

    /// A row the target computed: to disk (with a directory), and kept in memory while there
    /// is room.
    fn insert(&self, key: Vec<u32>, row: Arc<RowTargets>) {
        if let Some(disk) = &self.disk
            && disk.write(&key, &row)
        {
            self.lock().disk_writes += 1;
        }
        self.keep(key, row);
    }

    /// Kept in memory, if the budget has room for it.
    fn keep(&self, key: Vec<u32>, row: Arc<RowTargets>) {
        let mut state = self.lock();
        let bytes = row.bytes() + 4 * key.len();
        if state.bytes + bytes > self.budget {
            if !state.full && self.budget > 0 {
                tracing::info!(
                    held_mb = state.bytes as f64 / 1e6,
                    rows = state.rows.len(),
                    "EAGLE-3 target cache full: further rows {} every epoch",
                    if self.disk.is_some() {
                        "are read back from disk"
                    } else {
                        "run through the target"
                    }
                );
            }
            state.full = true;
            return;
        }
        state.bytes += bytes;
        state.rows.insert(key, row);
    }
}

/// The real positions of row `r` (where the attention mask is set), in order.
fn real_positions(batch: &Batch, r: usize) -> Vec<usize> {
    let s = batch.seq_len;
    (0..s).filter(|t| batch.attention_mask[r * s + t]).collect()
}

/// What the target computes for a row depends on its real tokens, their positions and their
/// packed sequences: the row's key.
fn row_key(batch: &Batch, r: usize, real: &[usize]) -> Vec<u32> {
    let at = |t: usize| r * batch.seq_len + t;
    let mut key = Vec::with_capacity(3 * real.len());
    key.extend(real.iter().map(|&t| batch.input_ids[at(t)]));
    key.extend(real.iter().map(|&t| batch.position_ids[at(t)] as u32));
    key.extend(real.iter().map(|&t| batch.sequence_ids[at(t)]));
    key
}

/// Row `r` of `batch` alone, its real positions `real` only (no padding).
fn row_batch(batch: &Batch, r: usize, real: &[usize]) -> Batch {
    let at = |t: &usize| r * batch.seq_len + t;
    Batch {
        batch_size: 1,
        seq_len: real.len(),
        input_ids: real.iter().map(|t| batch.input_ids[at(t)]).collect(),
        attention_mask: vec![true; real.len()],
        labels: real.iter().map(|t| batch.labels[at(t)]).collect(),
        position_ids: real.iter().map(|t| batch.position_ids[at(t)]).collect(),
        sequence_ids: real.iter().map(|t| batch.sequence_ids[at(t)]).collect(),
        examples: vec![batch.examples[r].clone()],
    }
}

/// Rows shorter than this (positions) run through the target side by side. A longer row's
/// pass has GEMM tasks enough for every core, and each pass holds its `[positions, vocab]`
/// logits (at 2048 positions of a 128k vocabulary, 1 GB), which two at once would double.
const SIDE_BY_SIDE_BELOW: usize = 256;

/// What one micro-batch's target pass gives the draft.
struct TargetPass {
    ids: Tensor<2, Int>,
    features: Tensor<3>,
    targets: TttTargets,
}

impl Eagle3Loss<'_> {
    /// The target over one row alone (a batch of one, no padding), so that what it gives a
    /// row does not depend on the rows it was batched with: a kept row and a recomputed one
    /// are the same bits, and a resumed run trains on what an uninterrupted one did.
    fn run_row(&self, row: &Batch) -> kd_train::Result<RowTargets> {
        // The three layers, then the final normed hidden state (index L, HF's last entry).
        let mut layers = self.layers.to_vec();
        layers.push(self.target.config().num_hidden_layers);
        let mut out = self.target.forward(
            &token_batch(row)?,
            &ForwardOptions {
                hidden_states: HiddenStates::Layers(layers),
                ..ForwardOptions::default()
            },
        )?;
        let last = out
            .hidden_states
            .pop()
            .expect("the final hidden state was asked for")
            .1;
        let features = Tensor::cat(
            out.hidden_states.iter().map(|(_, h)| h.clone()).collect(),
            2,
        );
        // The draft vocabulary's logits are made again each step from `last`.
        let (log_z, argmax) = ReducedLogits::log_z_and_argmax(out.into_logits()?);
        Ok(RowTargets {
            features: to_host(features),
            last: to_host(last),
            log_z: to_host(log_z),
            argmax: argmax
                .into_data()
                .convert::<i64>()
                .try_into_vec::<i64>()
                .expect("converted to i64"),
        })
    }

    fn target_pass(
        &self,
        batch: &Batch,
        draft: &Eagle3Draft,
        device: &Device,
    ) -> kd_train::Result<TargetPass> {
        let (b, s) = (batch.batch_size, batch.seq_len);
        let real: Vec<Vec<usize>> = (0..b).map(|r| real_positions(batch, r)).collect();
        let keys: Vec<Vec<u32>> = (0..b).map(|r| row_key(batch, r, &real[r])).collect();
        // The rows the cache does not hold run through the target side by side: one row's
        // pass is too narrow to keep every core busy (a projection of 192 or 576 outputs is
        // one to three tasks), and what a row gets does not depend on the thread computing it.
        let kept: Vec<Option<Arc<RowTargets>>> =
            keys.iter().map(|key| self.cache.get(key)).collect();
        let mut todo: Vec<usize> = Vec::new();
        for r in 0..b {
            if kept[r].is_none() && !todo.iter().any(|&q| keys[q] == keys[r]) {
                todo.push(r);
            }
        }
        let run = |&r: &usize| self.run_row(&row_batch(batch, r, &real[r]));
        let computed: Vec<kd_train::Result<RowTargets>> =
            if todo.iter().all(|&r| real[r].len() < SIDE_BY_SIDE_BELOW) {
                todo.par_iter().map(run).collect()
            } else {
                todo.iter().map(run).collect()
            };
        // Kept in row order, so that a budget fills with the same rows as one row at a time.
        let mut fresh: HashMap<&[u32], Arc<RowTargets>> = HashMap::new();
        for (&r, row) in todo.iter().zip(computed) {
            let row = Arc::new(row?);
            self.cache.insert(keys[r].clone(), row.clone());
            fresh.insert(&keys[r], row);
        }
        // A row not kept has its key in `todo`, so in `fresh`.
        let rows: Vec<Arc<RowTargets>> = kept
            .into_iter()
            .zip(&keys)
            .map(|(row, key)| {
                row.or_else(|| fresh.get(key.as_slice()).cloned())
                    .expect("every row is kept or computed")
            })
            .collect();
        let d = self.target.config().hidden_size;
        let f = 3 * d;
        let dv = draft.vocab().len();
        let vocab = self.target.config().vocab_size;
        // Position t reads the features at t and the target's distribution at t + 1 (SpecForge's
        // shift); positions without one (padding, each row's last) get a zero hidden state, so
        // zero logits, as the shifted-in row of zeros had, and zero features: the loss masks
        // them, and under causal attention no counted position reads them.
        let mut features = vec![0f32; b * s * f];
        let mut last = vec![0f32; b * s * d];
        let mut log_z = vec![(vocab as f32).ln(); b * s];
        let mut argmax = vec![0i64; b * s];
        let mut ids = vec![0i64; b * s];
        let mut mask = vec![0f32; b * s];
        for (r, (row, positions)) in rows.iter().zip(&real).enumerate() {
            let mut rank = vec![None; s];
            for (j, &t) in positions.iter().enumerate() {
                rank[t] = Some(j);
                let i = r * s + t;
                features[i * f..(i + 1) * f].copy_from_slice(&row.features[j * f..(j + 1) * f]);
            }
            for t in 0..s - 1 {
                let (i, next) = (r * s + t, r * s + t + 1);
                ids[i] = batch.input_ids[next] as i64;
                mask[i] = (batch.labels[next] >= 0 && batch.attention_mask[next]) as u8 as f32;
                if let Some(j) = rank[t + 1] {
                    last[i * d..(i + 1) * d].copy_from_slice(&row.last[j * d..(j + 1) * d]);
                    log_z[i] = row.log_z[j];
                    argmax[i] = row.argmax[j];
                }
            }
        }
        // The targets are made on the target's device (plain, not autodiff, whose softmax
        // differs in the last bits), then moved to the draft's, as before the cache.
        let at = &self.target.embed_tokens.weight.lazy_device();
        let f32s = |v: Vec<f32>, shape: Vec<usize>, device: &Device| {
            Tensor::<3>::from_data(TensorData::new(v, shape), (device, DType::F32))
        };
        // The logits of the draft vocabulary: the final hidden states through the target's LM
        // head rows of those tokens. Whether a row was kept or computed, the same bits go in.
        let head = self.cache.head(self.target, draft.vocab());
        let restricted =
            Tensor::<2>::from_data(TensorData::new(last, [b * s, d]), (at, DType::F32))
                .matmul(head)
                .reshape([b, s, dv]);
        let reduced = ReducedLogits {
            restricted,
            log_z: f32s(log_z, vec![b, s, 1], at),
            target_ids: Tensor::from_data(TensorData::new(argmax, [b, s]), at),
        };
        let mask = Tensor::<2>::from_data(TensorData::new(mask, [b, s]), (at, DType::F32));
        let targets = TttTargets::from_reduced(reduced, mask, draft.vocab().target_ids(), vocab);
        let move3 = |t: Tensor<3>| Tensor::<3>::from_data(t.into_data(), device);
        let move2 = |t: Tensor<2>| Tensor::<2>::from_data(t.into_data(), device);
        Ok(TargetPass {
            ids: Tensor::from_data(TensorData::new(ids, [b, s]), device),
            features: f32s(features, vec![b, s, f], device),
            targets: TttTargets {
                target_p: move3(targets.target_p),
                target_p_on_draft: move3(targets.target_p_on_draft),
                target_ids: Tensor::from_data(targets.target_ids.into_data(), device),
                position_mask: move2(targets.position_mask),
                loss_mask: move2(targets.loss_mask),
            },
        })
    }
}

impl StepLossFn<Eagle3Model> for Eagle3Loss<'_> {
    fn loss(
        &self,
        model: &Eagle3Model,
        batch: &Batch,
        normalizer: f32,
        _dropout_seed: u64,
    ) -> kd_train::Result<StepLoss> {
        if self.ttt_length == 0 {
            return Err(TrainError::Config("ttt_length must be at least 1".into()));
        }
        let device = model.device();
        let pass = self.target_pass(batch, &model.draft, &device)?;
        let rows = (batch.batch_size * batch.seq_len) as f64;
        let logits = model.draft.unroll(pass.ids, pass.features, self.ttt_length);
        let mut total: Option<Tensor<1>> = None;
        let mut first = 0.0;
        let mut metrics = Vec::new();
        let per_token = 1.0 / normalizer.max(1.0) as f64;
        for (k, l) in logits.into_iter().enumerate() {
            let targets = pass.targets.step(k);
            if let (Some(acc), Some(alpha)) = (STEP_ACC.get(k), STEP_ALPHA.get(k)) {
                let counts = ttt_step_counts(
                    l.clone().detach(),
                    &targets,
                    model.draft.vocab().target_ids(),
                );
                metrics.push((*acc, counts.correct * per_token));
                metrics.push((*alpha, counts.overlap * per_token));
            }
            // ttt_step_loss divides by batch · seq: undo it, then divide by the normaliser.
            let step = ttt_step_loss(l, &targets)
                .mul_scalar(TTT_DECAY.powi(k as i32) * rows / normalizer.max(1.0) as f64);
            if k == 0 {
                first = step.clone().into_scalar::<f32>() as f64;
            }
            total = Some(match total {
                Some(t) => t + step,
                None => step,
            });
        }
        let total = total.expect("at least one step");
        let mut terms = vec![
            ("ttt_loss", total.clone().into_scalar::<f32>() as f64),
            ("ttt_step0_loss", first),
        ];
        terms.extend(metrics);
        Ok(StepLoss {
            terms,
            total,
            kd: None,
        })
    }
}

/// The EAGLE-3 phases of a speculator run (after generation): a fresh draft for the target
/// (or `init_adapter`'s draft directory), acceptance before, TTT training with the generic
/// trainer (checkpoints are SpecForge draft directories), acceptance after.
/// `cache` is the run's [`target_cache`], opened in setup; `None` where the target is not
/// local (refused here).
pub(crate) fn train_eagle3(
    phases: Phases<'_, '_>,
    cache: Option<TargetCache>,
) -> crate::Result<Trained> {
    let Phases {
        config,
        setup,
        teacher,
        examples,
        timer,
        mut tb,
        eval,
        observer,
        warnings,
    } = phases;
    let (Some(target), Some(cache)) = (teacher.target(), cache) else {
        return Err(PipelineError::Config(
            "--draft_method eagle3 reads the target's hidden states: --target_model must be a \
             local model directory"
                .into(),
        ));
    };
    let tc = target.config();
    let layers = aux_layers(config, tc);
    let device = &setup.draft_device;
    let embedding = Tensor::<2>::from_data(target.embed_tokens.weight.val().into_data(), device);
    let draft = match &config.init_adapter {
        Some(dir) => {
            let draft = Eagle3Draft::load(dir, Some(embedding.clone()), device)?;
            kd_eval::Eagle3Drafter::new(&draft, layers).check_target(target)?;
            for w in ignored_shape_flags(config, &draft, dir) {
                warnings.push(observer, w);
            }
            draft
        }
        None => {
            let size = draft_vocab_size(config, tc.vocab_size);
            let vocab = draft_vocab_from_examples(&examples.examples, tc.vocab_size, size)?;
            let mut draft_config = Eagle3Config::for_target(tc, vocab.len())?;
            draft_config.aux_layers = Some(layers);
            if let Some(width) = config.draft_intermediate_size {
                draft_config.llama.intermediate_size = width;
            }
            let seed = derive_seed(config.seed, &[0xEA3]);
            let draft = Eagle3Draft::new(draft_config, vocab, embedding.clone(), seed, device)?;
            match config.draft_head_init {
                DraftHeadInit::Random => draft,
                DraftHeadInit::Target => draft.with_target_head(target)?,
            }
        }
    };
    let coverage = vocab_coverage(draft.vocab(), &examples.examples);
    if coverage < 0.95 {
        let w = format!(
            "the draft vocabulary of {} tokens covers {:.1}% of the completion tokens: a draft \
             never proposes the rest (raise --draft_vocab_size)",
            draft.vocab().len(),
            100.0 * coverage
        );
        warnings.push(observer, w);
    }
    if eval.file.is_some() {
        observer.on_phase(Phase::EvalBefore);
        let head = draft.clone().with_q8_0_weights(eval.draft_q8_0);
        eval.before(
            &kd_eval::Eagle3Drafter::new(&head, layers),
            tb.as_deref_mut(),
            observer,
        )?;
        timer.end(Phase::EvalBefore);
    }

    observer.on_phase(Phase::Train);
    let loss = Eagle3Loss {
        target,
        layers,
        ttt_length: config.ttt_length,
        cache,
    };
    let base = CheckpointDraft::Eagle3(Box::new(Eagle3Source {
        embedding,
        device: device.clone(),
        layers,
    }));
    let mut watcher = TrainingWatcher {
        inner: observer,
        last_log: None,
        eval: eval.at_checkpoints(base, config.eval_steps),
    };
    let train = TrainConfig {
        mode: TrainMode::Full,
        ..train_config(config)
    };
    let (trained, summary) = Trainer::new(train, &loss)
        .observer(&mut watcher)
        .run(Eagle3Model { draft }, &examples.examples)?;
    let measured = match watcher.eval.take() {
        Some(CheckpointEval { error: Some(e), .. }) => return Err(e),
        Some(e) => e.results,
        None => Vec::new(),
    };
    let last_log = watcher.last_log.take();
    timer.end(Phase::Train);

    if eval.file.is_some() {
        observer.on_phase(Phase::EvalAfter);
        let head = trained.draft.clone().with_q8_0_weights(eval.draft_q8_0);
        eval.after(
            &kd_eval::Eagle3Drafter::new(&head, layers),
            &summary,
            &measured,
            tb,
            observer,
        )?;
        timer.end(Phase::EvalAfter);
    }
    Ok(Trained {
        summary,
        on_policy: None,
        target_rows: Some(loss.cache.stats()),
        last_log,
    })
}

/// The target's hidden states an EAGLE-3 training row reads, in Hugging Face's
/// `output_hidden_states` indexing: the three feature layers, then the final normed state.
pub(crate) fn captured_layers(config: &crate::SpeculatorConfig, target: &Llama) -> Vec<usize> {
    let tc = target.config();
    let mut layers = aux_layers(config, tc).to_vec();
    layers.push(tc.num_hidden_layers);
    layers
}

/// The cache of what the target gives each training row: `--target_cache_mb` of memory, and
/// `--target_cache_dir` opened (made, or checked against this run's target and layers).
pub(crate) fn target_cache(
    config: &crate::SpeculatorConfig,
    teacher: &TeacherBackend,
    target: &Llama,
) -> crate::Result<TargetCache> {
    let cache = TargetCache::new(config.target_cache_mb.saturating_mul(1 << 20));
    match &config.target_cache_dir {
        None => Ok(cache),
        Some(dir) => {
            let tc = target.config();
            let layers = aux_layers(config, tc);
            let manifest = TargetRowsManifest::new(teacher.teacher().fingerprint(), layers, tc);
            cache.with_dir(dir, &manifest)
        }
    }
}

/// A draft started from `--init_adapter` keeps its own shape: the warnings for a
/// `--draft_vocab_size` or `--draft_intermediate_size` that differs from it (each naming both
/// values), which is then not applied.
fn ignored_shape_flags(
    config: &crate::SpeculatorConfig,
    draft: &Eagle3Draft,
    dir: &Path,
) -> Vec<String> {
    let c = draft.config();
    [
        (
            "draft_vocab_size",
            config.draft_vocab_size,
            c.draft_vocab_size,
        ),
        (
            "draft_intermediate_size",
            config.draft_intermediate_size,
            c.llama.intermediate_size,
        ),
    ]
    .into_iter()
    .filter_map(|(flag, asked, has)| {
        let asked = asked.filter(|a| *a != has)?;
        Some(format!(
            "--{flag} {asked} is not applied: the draft of --init_adapter {} has {has}, and a \
             draft started from a checkpoint keeps its shape (start without --init_adapter for \
             a fresh draft of that shape)",
            dir.display()
        ))
    })
    .collect()
}

/// Share of the examples' completion tokens inside the draft vocabulary.
fn vocab_coverage(vocab: &DraftVocab, examples: &[Example]) -> f64 {
    let inside: std::collections::HashSet<u32> = vocab.target_ids().iter().copied().collect();
    let (mut hit, mut all) = (0usize, 0usize);
    for l in examples.iter().flat_map(|e| &e.labels) {
        if *l >= 0 {
            all += 1;
            hit += inside.contains(&(*l as u32)) as usize;
        }
    }
    if all == 0 {
        1.0
    } else {
        hit as f64 / all as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kd_model::parse_device;

    /// The rows of a micro-batch that the target computes side by side get the bits each gets
    /// computed alone: SmolLM2 decoding from its Q4_1 blocks, four rows of 70–85 positions
    /// (so the products dequantise their weights and run GEMMs in tasks), what the cache keeps
    /// of each row against `run_row` on that row alone, bit for bit.
    #[test]
    fn rows_computed_side_by_side_are_the_rows_computed_alone() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
        assert!(
            path.is_file(),
            "{} is missing: run fixtures/fetch-smollm2.sh (the real-model tests need it)",
            path.display()
        );
        let device = parse_device("cpu").unwrap();
        let target = Llama::load_for_inference(&path, &device).unwrap();
        assert!(
            target.f32_copies_made().is_some(),
            "decoding from the blocks"
        );
        let tc = target.config().clone();
        let vocab_size = tc.vocab_size as u32;
        let examples: Vec<Example> = (0..4usize)
            .map(|i| {
                let prompt: Vec<u32> = (0..20 + 5 * i)
                    .map(|j| 300 + ((i * 131 + j * 17) as u32) % (vocab_size - 400))
                    .collect();
                let completion: Vec<u32> =
                    (0..50).map(|j| 1000 + ((i + j * 7) % 90) as u32).collect();
                let options = kd_data::ExampleOptions::default();
                kd_data::build_example(&format!("r{i}"), &prompt, &completion, &options).0
            })
            .collect();
        let vocab = draft_vocab_from_examples(&examples, tc.vocab_size, 64).unwrap();
        let draft = Eagle3Draft::new(
            Eagle3Config::for_target(&tc, vocab.len()).unwrap(),
            vocab,
            target.embed_tokens.weight.val(),
            0,
            &device,
        )
        .unwrap();
        let loss = Eagle3Loss {
            target: &target,
            layers: default_feature_layers(tc.num_hidden_layers),
            ttt_length: 1,
            cache: TargetCache::new(1 << 30),
        };
        let rows: Vec<Vec<usize>> = (0..4).map(|r| vec![r]).collect();
        let batch = kd_data::collate(&examples, &rows, 0, 128);
        assert!(batch.seq_len >= 70, "rows of {} positions", batch.seq_len);
        loss.target_pass(&batch, &draft, &device).unwrap();
        assert_eq!(loss.cache.stats().misses, 4);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for r in 0..4 {
            let real = real_positions(&batch, r);
            assert!(real.len() >= 70 && real.len() < SIDE_BY_SIDE_BELOW);
            let kept = loss.cache.get(&row_key(&batch, r, &real)).unwrap();
            let alone = loss.run_row(&row_batch(&batch, r, &real)).unwrap();
            assert!(
                bits(&kept.features) == bits(&alone.features),
                "row {r}: features"
            );
            assert!(
                bits(&kept.last) == bits(&alone.last),
                "row {r}: last hidden"
            );
            assert!(bits(&kept.log_z) == bits(&alone.log_z), "row {r}: log_z");
            assert_eq!(kept.argmax, alone.argmax, "row {r}: argmax");
        }
    }
}

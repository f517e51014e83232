//! What one optimizer step trains on: the rows the trainer planned ([`PlannedStep`]) and the
//! [`StepData`] trait through which a pipeline replaces or adds rows (on-policy completions
//! sampled with the model of the step), each micro-batch with the loss it learns through.

use kd_data::{Batch, Example, collate};
use kd_loss::LossStats;

use crate::error::Result;
use crate::loss::StepLossFn;

/// The rows the trainer planned for one optimizer step.
#[derive(Debug, Clone, Copy)]
pub struct PlannedStep<'a> {
    /// The training examples the plan indexes.
    pub examples: &'a [Example],
    /// Per planned micro-batch, its rows; each row holds the indices of its examples (one, or
    /// several when packed).
    pub micro_batches: &'a [Vec<Vec<usize>>],
    /// The epoch the step belongs to (0-based).
    pub epoch: usize,
    /// The step (0-based).
    pub step: usize,
    /// The run's seed.
    pub seed: u64,
    /// Shards each planned micro-batch is split into
    /// ([`TrainConfig::accumulation_shards`](crate::TrainConfig::accumulation_shards)).
    pub shards: usize,
    /// The padding id batches are collated with.
    pub pad_id: u32,
}

impl PlannedStep<'_> {
    /// The step as planned: every micro-batch split into its shards and collated, each
    /// learning through the run's loss.
    pub fn collate<M>(&self) -> Vec<MicroBatch<M>> {
        self.collate_rows(self.micro_batches, self.examples)
            .into_iter()
            .map(MicroBatch::new)
            .collect()
    }

    /// `micro_batches` (rows indexing `set`) split into the step's shards and collated;
    /// empty shards are dropped.
    pub fn collate_rows(&self, micro_batches: &[Vec<Vec<usize>>], set: &[Example]) -> Vec<Batch> {
        let mut out = Vec::new();
        for rows in micro_batches {
            for shard in shard_rows(rows, self.shards) {
                if !shard.is_empty() {
                    out.push(collate(set, &shard, self.pad_id, usize::MAX));
                }
            }
        }
        out
    }
}

/// A micro-batch of a step and the loss it learns through.
pub struct MicroBatch<M> {
    /// The collated rows.
    pub batch: Batch,
    /// Its own loss; `None`: the run's loss.
    pub loss: Option<Box<dyn StepLossFn<M>>>,
}

impl<M> MicroBatch<M> {
    /// A micro-batch that learns through the run's loss.
    pub fn new(batch: Batch) -> Self {
        Self { batch, loss: None }
    }
}

/// Where the micro-batches of every step come from. Without one the trainer trains on the
/// planned rows as they are ([`PlannedStep::collate`]).
pub trait StepData<M> {
    /// The micro-batches of one step, made before its forward passes with the model of the
    /// step (e.g. some rows replaced by the model's own completions).
    fn micro_batches(&mut self, step: &PlannedStep<'_>, model: &M) -> Result<Vec<MicroBatch<M>>>;

    /// Metric terms of the step that just ran (logged with the loss terms): `kd[k]` holds the
    /// KD statistics of micro-batch `k` of the last [`micro_batches`](Self::micro_batches),
    /// `step_seconds` the step's wall time.
    fn step_terms(
        &mut self,
        _kd: &[Option<LossStats>],
        _step_seconds: f64,
    ) -> Vec<(&'static str, f64)> {
        Vec::new()
    }

    /// A key and value the run's fingerprint carries (a resumed run must match it).
    fn fingerprint(&self) -> Option<(&'static str, serde_json::Value)> {
        None
    }
}

/// Splits the rows of one micro-batch into `shards` (contiguous, the first ones one row
/// longer when it does not divide): the shards of
/// [`TrainConfig::accumulation_shards`](crate::TrainConfig::accumulation_shards).
pub fn shard_rows<T: Clone>(rows: &[T], shards: usize) -> Vec<Vec<T>> {
    let r = shards.max(1);
    let base = rows.len() / r;
    let extra = rows.len() % r;
    let mut out = Vec::with_capacity(r);
    let mut at = 0;
    for k in 0..r {
        let n = base + usize::from(k < extra);
        out.push(rows[at..at + n].to_vec());
        at += n;
    }
    out
}

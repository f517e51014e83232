//! Steps whose micro-batches are split into shards — `accumulation_shards` > 1, or several
//! data-parallel ranks — sum their gradients in f64 on the host, so that the result does not
//! depend on how the shards are spread over ranks: every rank plans and collates the whole step
//! (cheap, and identical everywhere), computes the gradients of its share — micro-batch k on
//! rank k mod N — under the step's **global** label-token count, adds each into an f64 sum in
//! step order, and the f64 sums are all-reduced; the f32 gradient is the rounded total, so
//! every rank clips and applies the same update. N ranks thus train what one process with N
//! times the shards trains: same rows, same dropout seeds, same normaliser, and sums that agree
//! to f64 rounding (≈1e-16 relative) before they are rounded to f32.

use std::sync::Mutex;
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use kd_data::Batch;
use kd_dist::World;
use kd_loss::LossStats;
use serde_json::{Value, json};

use crate::error::{Result, TrainError};
use crate::loss::StepLossFn;
use crate::trainer::step::{PartLoss, StepGradients};

/// One micro-batch's losses as a rank sends them: its index in the step, its loss, its terms
/// and its KD statistics, floats as bits.
type Entry = (
    usize,
    u64,
    Vec<(String, u64)>,
    Option<(u64, usize, usize, u64, usize)>,
);

/// A micro-batch's losses and KD statistics.
type Part = (PartLoss, Option<LossStats>);

/// The micro-batches of a step of `parts` this rank computes.
pub(crate) fn my_parts(parts: usize, world: &World) -> Vec<usize> {
    (0..parts)
        .filter(|k| k % world.size() == world.rank())
        .collect()
}

/// The gradients of a sharded step (see the module docs): this rank's share of `parts`,
/// summed in f64 and, across ranks, all-reduced; the losses of every micro-batch gathered in
/// step order. Returns them and the seconds spent exchanging with the other ranks.
pub(crate) fn sharded_step<M: Module>(
    world: &World,
    model: &M,
    parts: &[(&Batch, &dyn StepLossFn<M>)],
    normalizer: f32,
    seeds: &[u64],
) -> Result<(StepGradients, f64)> {
    let owned = my_parts(parts.len(), world);
    let slots = Slots::of(model);
    let mut sum = vec![0.0f64; slots.len];
    let mut present = vec![0.0f64; slots.slots.len()];
    let mut local_parts = Vec::with_capacity(owned.len());
    let mut local_kd = Vec::with_capacity(owned.len());
    for k in &owned {
        let (mb, loss_fn) = parts[*k];
        let l = loss_fn.loss(model, mb, normalizer, seeds[*k])?;
        let loss = l.total.clone().into_scalar::<f32>() as f64;
        let grads = GradientsParams::from_grads(l.total.backward(), model);
        model.visit(&mut Add {
            grads: &grads,
            walk: Walk::new(&slots.slots),
            sum: &mut sum,
            present: &mut present,
        });
        local_parts.push(PartLoss {
            loss,
            terms: l.terms,
        });
        local_kd.push(l.kd);
    }
    if !world.is_distributed() {
        let mut out = merge(local_parts.into_iter().zip(local_kd).map(Some).collect())?;
        out.grads = slots.gradients(model, &sum, &present);
        return Ok((out, 0.0));
    }
    let started = Instant::now();
    sum.extend(&present);
    world.all_reduce_sum_f64(&mut sum).map_err(dist)?;
    let present = sum.split_off(slots.len);
    let by_part = gather_losses(world, &owned, &local_parts, &local_kd, parts.len())?;
    let mut out = merge(by_part)?;
    out.grads = slots.gradients(model, &sum, &present);
    Ok((out, started.elapsed().as_secs_f64()))
}

/// Every rank's micro-batch losses, by step index.
fn gather_losses(
    world: &World,
    owned: &[usize],
    local_parts: &[PartLoss],
    local_kd: &[Option<LossStats>],
    parts: usize,
) -> Result<Vec<Option<Part>>> {
    // Floats travel as their bits: exact, and NaN/∞ survive (JSON has neither).
    let mine: Vec<Value> = owned
        .iter()
        .zip(local_parts.iter().zip(local_kd))
        .map(|(k, (p, kd))| {
            let terms: Vec<(&str, u64)> = p.terms.iter().map(|(n, v)| (*n, v.to_bits())).collect();
            json!([
                k,
                p.loss.to_bits(),
                terms,
                kd.map(|s| json!([
                    s.loss_sum.to_bits(),
                    s.counted,
                    s.nonfinite_positions,
                    s.acceptance_sum.to_bits(),
                    s.top1_matches
                ]))
            ])
        })
        .collect();
    let bytes = serde_json::to_vec(&mine).expect("losses serialise");
    let mut by_part: Vec<Option<Part>> = vec![None; parts];
    for rank_bytes in world.all_gather_bytes(&bytes).map_err(dist)? {
        let entries: Vec<Entry> = serde_json::from_slice(&rank_bytes).map_err(|e| {
            TrainError::Config(format!("a rank sent losses this rank cannot read: {e}"))
        })?;
        for (k, loss, terms, kd) in entries {
            let slot = by_part.get_mut(k).ok_or_else(|| {
                TrainError::Config(format!(
                    "a rank reported micro-batch {k} of a step of {parts}: the ranks run \
                     different plans (same program, data and settings on every rank?)"
                ))
            })?;
            *slot = Some((
                PartLoss {
                    loss: f64::from_bits(loss),
                    terms: terms
                        .into_iter()
                        .map(|(n, v)| (intern(&n), f64::from_bits(v)))
                        .collect(),
                },
                kd.map(
                    |(loss_sum, counted, nonfinite_positions, acceptance_sum, top1_matches)| {
                        LossStats {
                            loss_sum: f64::from_bits(loss_sum),
                            counted,
                            nonfinite_positions,
                            acceptance_sum: f64::from_bits(acceptance_sum),
                            top1_matches,
                        }
                    },
                ),
            ));
        }
    }
    Ok(by_part)
}

/// The losses of a step's micro-batches, added in step order as one process adds them (the
/// gradients are filled in by the caller).
fn merge(by_part: Vec<Option<Part>>) -> Result<StepGradients> {
    let parts = by_part.len();
    let mut out = StepGradients {
        grads: GradientsParams::new(),
        loss: 0.0,
        terms: Vec::new(),
        kd: Vec::with_capacity(parts),
        parts: Vec::with_capacity(parts),
    };
    for (k, slot) in by_part.into_iter().enumerate() {
        let (part, kd) = slot.ok_or_else(|| {
            TrainError::Config(format!("no rank computed micro-batch {k} of the step"))
        })?;
        out.loss += part.loss;
        for (n, v) in &part.terms {
            match out.terms.iter_mut().find(|(m, _)| m == n) {
                Some((_, s)) => *s += v,
                None => out.terms.push((n, *v)),
            }
        }
        out.kd.push(kd);
        out.parts.push(part);
    }
    Ok(out)
}

fn dist(e: kd_dist::DistError) -> TrainError {
    TrainError::Config(format!("data-parallel step: {e}"))
}

/// A loss term's name received from another rank, as the `&'static str` the metrics use
/// (each distinct name is allocated once per process; a run has a handful).
fn intern(name: &str) -> &'static str {
    static NAMES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut names = NAMES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(n) = names.iter().find(|n| **n == name) {
        return n;
    }
    let leaked: &'static str = Box::leak(name.to_owned().into_boxed_str());
    names.push(leaked);
    leaked
}

/// One trainable parameter's place in the flat buffer.
struct Slot {
    id: burn::module::ParamId,
    dims: Vec<usize>,
    device: burn::tensor::Device,
    offset: usize,
}

/// The trainable parameters of a model (those that require a gradient), in visit order.
struct Slots {
    slots: Vec<Slot>,
    /// Their values in all.
    len: usize,
}

impl ModuleVisitor for Slots {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        if !value.is_require_grad() {
            return;
        }
        let dims = value.dims().to_vec();
        let n: usize = dims.iter().product();
        self.slots.push(Slot {
            id: param.id,
            dims,
            device: value.device(),
            offset: self.len,
        });
        self.len += n;
    }
}

impl Slots {
    fn of<M: Module>(model: &M) -> Self {
        let mut s = Slots {
            slots: Vec::new(),
            len: 0,
        };
        model.visit(&mut s);
        s
    }

    /// The f32 gradients of the parameters some micro-batch had a gradient of.
    fn gradients<M: Module>(&self, model: &M, sum: &[f64], present: &[f64]) -> GradientsParams {
        let mut out = GradientsParams::new();
        model.visit(&mut Fill {
            walk: Walk::new(&self.slots),
            present,
            sum,
            out: &mut out,
        });
        out
    }
}

/// Walks the parameters in [`Slots`] order: the slot of the parameter being visited, if it is
/// trainable.
struct Walk<'a> {
    slots: &'a [Slot],
    next: usize,
}

impl<'a> Walk<'a> {
    fn new(slots: &'a [Slot]) -> Self {
        Self { slots, next: 0 }
    }

    /// The index and slot of parameter `id`, when it is the next trainable one.
    fn step(&mut self, id: burn::module::ParamId) -> Option<(usize, &'a Slot)> {
        let slot = self.slots.get(self.next)?;
        if slot.id != id {
            return None;
        }
        self.next += 1;
        Some((self.next - 1, slot))
    }
}

/// Adds one micro-batch's gradients into the f64 sum.
struct Add<'a> {
    grads: &'a GradientsParams,
    walk: Walk<'a>,
    sum: &'a mut [f64],
    present: &'a mut [f64],
}

impl ModuleVisitor for Add<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some((i, slot)) = self.walk.step(param.id) else {
            return;
        };
        let Some(g) = self.grads.get::<D>(param.id) else {
            return;
        };
        let n: usize = slot.dims.iter().product();
        let dst = &mut self.sum[slot.offset..slot.offset + n];
        match g.without_autodiff().into_data().try_into_vec_as::<f32>() {
            Ok(v) if v.len() == n => {
                for (d, x) in dst.iter_mut().zip(v) {
                    *d += f64::from(x);
                }
            }
            // A gradient this rank cannot read as f32: poison the step (it is skipped as
            // non-finite on every rank) rather than train on a partial sum.
            _ => dst.fill(f64::NAN),
        }
        self.present[i] = 1.0;
    }
}

/// Registers the rounded f32 totals.
struct Fill<'a> {
    walk: Walk<'a>,
    present: &'a [f64],
    sum: &'a [f64],
    out: &'a mut GradientsParams,
}

impl ModuleVisitor for Fill<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some((i, slot)) = self.walk.step(param.id) else {
            return;
        };
        if self.present[i] <= 0.0 {
            return;
        }
        let n: usize = slot.dims.iter().product();
        let values: Vec<f32> = self.sum[slot.offset..slot.offset + n]
            .iter()
            .map(|v| *v as f32)
            .collect();
        let data = TensorData::new(values, slot.dims.clone());
        self.out
            .register::<D>(slot.id, Tensor::<D>::from_data(data, &slot.device));
    }
}

/// Checks that every rank plans the same run as rank 0: the same settings (the run's
/// fingerprint) and the same examples, token for token. Ranks that read different data (a
/// file that differs between machines, a node without the shared data directory) would
/// otherwise train on mismatched steps without a word.
pub(crate) fn check_same_run(
    world: &World,
    fingerprint: &serde_json::Value,
    examples: &[kd_data::Example],
) -> Result<()> {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same value in every process of one build.
    let mut h = std::hash::DefaultHasher::new();
    fingerprint.to_string().hash(&mut h);
    for e in examples {
        e.input_ids.hash(&mut h);
        e.labels.hash(&mut h);
    }
    let mine = h.finish().to_le_bytes();
    let all = world.all_gather_bytes(&mine).map_err(dist)?;
    match all.iter().position(|b| b != &all[0]) {
        None => Ok(()),
        Some(rank) => Err(TrainError::Config(format!(
            "rank {rank} plans another run than rank 0: its settings or its {} training \
             examples differ. Every rank must run the same program with the same settings on \
             the same data (a data directory every machine sees)",
            examples.len()
        ))),
    }
}

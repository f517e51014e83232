//! The key/value cache for incremental decoding of a padded batch.
//!
//! Keys and values live in preallocated tensors `[batch, kv_heads, capacity, head_dim]`:
//! a decode step writes its slots in place (Burn's `slice_assign` on a uniquely held CPU
//! tensor does not copy), and attention reads the first `len` slots as a view, so appending
//! costs O(new tokens), not O(cached tokens). When a step needs more slots than the capacity,
//! the capacity doubles (or grows to what the step needs). Rolling back ([`KvCache::truncate`])
//! only moves the length: the slots are reused by the next tokens.

use burn::backend::{BackendTensor, DispatchAutodiffContext, DispatchTensor, DispatchTensorKind};
use burn::tensor::{Int, Tensor, TensorData};
use burn_flex::FlexTensor;

use crate::error::{ModelError, Result};

/// Keys and values of every layer for the tokens seen so far, plus which of those tokens are
/// real (not padding) in each row.
///
/// Rows may hold different numbers of real tokens (prompts of different lengths, left-padded);
/// padding keys are masked out of attention, and positions count real tokens only, so each
/// row decodes as it would alone.
#[derive(Debug, Clone)]
pub struct KvCache {
    /// Per layer: keys and values `[batch, kv_heads, capacity, head_dim]`; slots at and
    /// after [`len`](Self::len) hold nothing that is read.
    layers: Vec<Option<(Tensor<4>, Tensor<4>)>>,
    /// Slots allocated on the first append (at least what it needs).
    reserve: usize,
    /// Per row: which cached tokens are real.
    valid: Vec<Vec<bool>>,
    /// Per row: number of real tokens cached (the next real token's position).
    real_len: Vec<i64>,
}

impl KvCache {
    /// An empty cache for a model with `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self::with_capacity(num_layers, 0)
    }

    /// An empty cache that allocates `slots` token slots per row on its first append (a
    /// decode loop that knows prompt + new tokens never reallocates).
    pub fn with_capacity(num_layers: usize, slots: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            reserve: slots,
            valid: Vec::new(),
            real_len: Vec::new(),
        }
    }

    /// Token slots allocated per row (0 before the first append).
    pub fn capacity(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .next()
            .map_or(0, |(k, _)| k.dims()[2])
    }

    /// Number of cached token slots per row (padding included).
    pub fn len(&self) -> usize {
        self.valid.first().map_or(0, Vec::len)
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of rows, once something is cached.
    pub fn batch_size(&self) -> Option<usize> {
        (!self.valid.is_empty()).then_some(self.valid.len())
    }

    /// Number of real (non-padding) tokens cached in each row.
    pub fn real_lengths(&self) -> &[i64] {
        &self.real_len
    }

    /// Keeps only the given rows, in the given order (rows that finished generating can be
    /// dropped so that later steps cost less).
    pub fn retain_rows(&mut self, rows: &[usize]) -> Result<()> {
        let batch = self.valid.len();
        if let Some(bad) = rows.iter().find(|r| **r >= batch) {
            return Err(ModelError::Input(format!(
                "row {bad} is out of range for a cache of {batch} rows"
            )));
        }
        for (k, v) in self.layers.iter_mut().flatten() {
            let device = k.device();
            let idx = Tensor::<1, Int>::from_data(
                TensorData::new(rows.iter().map(|r| *r as i64).collect(), [rows.len()]),
                &device,
            );
            *k = k.clone().select(0, idx.clone());
            *v = v.clone().select(0, idx);
        }
        self.valid = rows.iter().map(|r| self.valid[*r].clone()).collect();
        self.real_len = rows.iter().map(|r| self.real_len[*r]).collect();
        Ok(())
    }

    /// Rolls each row back to its first `real_len[row]` real tokens (speculative decoding
    /// drops the rejected drafts): later real slots are masked out, and trailing slots no row
    /// needs any more are released for the next tokens (they stay allocated). A row then
    /// continues exactly as if the dropped tokens had never been fed.
    pub fn truncate(&mut self, real_len: &[i64]) -> Result<()> {
        let batch = self.valid.len();
        if real_len.len() != batch {
            return Err(ModelError::Input(format!(
                "{} lengths to roll back a cache of {batch} rows",
                real_len.len()
            )));
        }
        let mut keep = 0;
        for (row, (valid, &want)) in self.valid.iter_mut().zip(real_len).enumerate() {
            let have = self.real_len[row];
            if want < 0 || want > have {
                return Err(ModelError::Input(format!(
                    "row {row} holds {have} real tokens and cannot be rolled back to {want}"
                )));
            }
            let mut seen = 0;
            for (slot, v) in valid.iter_mut().enumerate() {
                if *v {
                    if seen < want {
                        keep = keep.max(slot + 1);
                    } else {
                        *v = false;
                    }
                    seen += 1;
                }
            }
            self.real_len[row] = want;
        }
        if keep < self.len() {
            // The slots stay allocated; the next tokens overwrite them.
            for v in &mut self.valid {
                v.truncate(keep);
            }
        }
        Ok(())
    }

    pub(crate) fn check_batch(&self, batch: usize) -> Result<()> {
        match self.batch_size() {
            Some(b) if b != batch => Err(ModelError::Input(format!(
                "the cache holds {b} rows but the batch has {batch}"
            ))),
            _ => Ok(()),
        }
    }

    pub(crate) fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Records the new tokens' mask (`[batch, seq]`, row-major) after a forward pass.
    pub(crate) fn push_mask(&mut self, batch: usize, seq: usize, mask: &[bool]) {
        if self.valid.is_empty() {
            self.valid = vec![Vec::new(); batch];
            self.real_len = vec![0; batch];
        }
        for b in 0..batch {
            let row = &mask[b * seq..(b + 1) * seq];
            self.valid[b].extend_from_slice(row);
            self.real_len[b] += row.iter().filter(|m| **m).count() as i64;
        }
    }

    pub(crate) fn valid_rows(&self) -> &[Vec<bool>] {
        &self.valid
    }

    /// [`append`](Self::append) on the host, for a layer held as the CPU backend's f32
    /// tensors: writes this step's keys and values (`[batch, kv_heads, new, head_dim]`,
    /// row-major) into the slots after [`len`](Self::len), in place, and hands `read` every
    /// cached slot's keys and values (heads `stride` values apart) and the number of slots.
    /// `None`, with nothing written, when the layer is held otherwise (another device, dtype
    /// or autodiff).
    pub(crate) fn append_host<R>(
        &mut self,
        layer: usize,
        (k, v): (&[f32], &[f32]),
        [b, h, s, d]: [usize; 4],
        read: impl FnOnce(&[f32], &[f32], usize, usize) -> R,
    ) -> Option<R> {
        assert!(
            k.len() == b * h * s * d && v.len() == k.len(),
            "append_host: keys and values of [{b}, {h}, {s}, {d}]"
        );
        let (at, need) = (self.len(), self.len() + s);
        let (mut ck, mut cv) = match self.layers[layer].take() {
            None => {
                let cap = need.max(self.reserve);
                (host_zeros([b, h, cap, d]), host_zeros([b, h, cap, d]))
            }
            Some((ck, cv)) => match (host_of(ck), host_of(cv)) {
                (Ok(ck), Ok(cv)) => (ck, cv),
                (ck, cv) => {
                    self.layers[layer] = Some((
                        ck.map_or_else(|t| *t, tensor_of),
                        cv.map_or_else(|t| *t, tensor_of),
                    ));
                    return None;
                }
            },
        };
        let cap = ck.layout().shape()[2];
        assert_eq!(
            (ck.layout().shape().to_vec(), cv.layout().shape().to_vec()),
            (vec![b, h, cap, d], vec![b, h, cap, d]),
            "append_host: the cached layer's shape"
        );
        if cap < need {
            // Grow geometrically, keeping the slots in use.
            let grown = need.max(2 * cap);
            let grow = |old: &FlexTensor| {
                let mut fresh = host_zeros([b, h, grown, d]);
                let (from, to) = (old.storage::<f32>(), fresh.storage_mut::<f32>());
                for head in 0..b * h {
                    to[head * grown * d..][..at * d]
                        .copy_from_slice(&from[head * cap * d..][..at * d]);
                }
                fresh
            };
            (ck, cv) = (grow(&ck), grow(&cv));
        }
        let cap = ck.layout().shape()[2];
        for (cache, new) in [(&mut ck, k), (&mut cv, v)] {
            // In place when the cache holds the only reference, as `append`'s `slice_assign`.
            let slots = cache.storage_mut::<f32>();
            for head in 0..b * h {
                slots[(head * cap + at) * d..][..s * d]
                    .copy_from_slice(&new[head * s * d..][..s * d]);
            }
        }
        let out = read(ck.storage(), cv.storage(), cap * d, need);
        self.layers[layer] = Some((tensor_of(ck), tensor_of(cv)));
        Some(out)
    }

    /// Writes this step's keys/values `[batch, kv_heads, new, head_dim]` of one layer into
    /// the slots after [`len`](Self::len) and returns views of every cached slot
    /// (`[batch, kv_heads, len + new, head_dim]`).
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: Tensor<4>,
        v: Tensor<4>,
    ) -> (Tensor<4>, Tensor<4>) {
        let [b, h, s, d] = k.dims();
        let at = self.len();
        let need = at + s;
        let (ck, cv) = match self.layers[layer].take() {
            None => {
                let cap = need.max(self.reserve);
                let zeros = || Tensor::<4>::zeros([b, h, cap, d], (&k.device(), k.dtype()));
                (zeros(), zeros())
            }
            Some((ck, cv)) if ck.dims()[2] < need => {
                // Grow geometrically, keeping the slots in use.
                let cap = need.max(2 * ck.dims()[2]);
                let grow = |old: Tensor<4>| {
                    let fresh = Tensor::<4>::zeros([b, h, cap, d], (&old.device(), old.dtype()));
                    if at == 0 {
                        fresh
                    } else {
                        fresh.slice_assign(
                            [0..b, 0..h, 0..at, 0..d],
                            old.slice([0..b, 0..h, 0..at, 0..d]),
                        )
                    }
                };
                (grow(ck), grow(cv))
            }
            Some(pair) => pair,
        };
        // In place when the cache holds the only reference (the previous step's views are
        // gone by now).
        let ck = ck.slice_assign([0..b, 0..h, at..need, 0..d], k);
        let cv = cv.slice_assign([0..b, 0..h, at..need, 0..d], v);
        let views = (
            ck.clone().slice([0..b, 0..h, 0..need, 0..d]),
            cv.clone().slice([0..b, 0..h, 0..need, 0..d]),
        );
        self.layers[layer] = Some((ck, cv));
        views
    }
}

/// A contiguous f32 tensor of zeros on the CPU backend.
fn host_zeros(shape: [usize; 4]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(vec![0f32; shape.iter().product()], shape))
}

/// The CPU backend's contiguous f32 tensor behind `t` (copied into one when strided), or `t`
/// back when it is held otherwise.
fn host_of(t: Tensor<4>) -> std::result::Result<FlexTensor, Box<Tensor<4>>> {
    let DispatchTensor { kind, autodiff } = t.into_dispatch();
    match (kind, autodiff) {
        (DispatchTensorKind::Flex(BackendTensor::Float(f)), DispatchAutodiffContext::Disabled)
            if f.dtype() == burn::tensor::DType::F32 =>
        {
            if f.layout().is_contiguous() && f.layout().start_offset() == 0 {
                Ok(f)
            } else {
                Ok(FlexTensor::from_data(f.into_data()))
            }
        }
        (kind, autodiff) => Err(Box::new(Tensor::from_dispatch(DispatchTensor {
            kind,
            autodiff,
        }))),
    }
}

/// `f` as a tensor of the CPU backend.
fn tensor_of(f: FlexTensor) -> Tensor<4> {
    Tensor::from_dispatch(DispatchTensor {
        kind: DispatchTensorKind::Flex(BackendTensor::Float(f)),
        autodiff: DispatchAutodiffContext::Disabled,
    })
}

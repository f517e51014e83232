//! The draft's attention state: the TTT steps' keys and values while training, and the
//! decoding KV cache.

use burn::tensor::Tensor;

/// The keys and values of the TTT steps run so far: step 0's for every position, and each
/// later step's, of which a query reads only its own position's.
#[derive(Debug, Default)]
pub struct TttCache {
    pub(super) keys: Vec<Tensor<4>>,
    pub(super) values: Vec<Tensor<4>>,
}

impl TttCache {
    /// An empty cache, for step 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Steps run so far.
    pub fn steps(&self) -> usize {
        self.keys.len()
    }
}

/// The draft layer's keys and values while decoding, `[1, kv_heads, len, head_dim]`; rolled
/// back with [`DraftKvCache::truncate`] when drafted positions are rejected.
#[derive(Debug, Default)]
pub struct DraftKvCache {
    kv: Option<(Tensor<4>, Tensor<4>)>,
}

impl DraftKvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, _)| k.dims()[2])
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len() {
            return;
        }
        self.kv = self.kv.take().and_then(|(k, v)| {
            (len > 0).then(|| {
                let [b, h, _, d] = k.dims();
                (
                    k.slice([0..b, 0..h, 0..len, 0..d]),
                    v.slice([0..b, 0..h, 0..len, 0..d]),
                )
            })
        });
    }

    pub(super) fn append(&mut self, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        let kv = match self.kv.take() {
            Some((pk, pv)) => (Tensor::cat(vec![pk, k], 2), Tensor::cat(vec![pv, v], 2)),
            None => (k, v),
        };
        self.kv = Some(kv.clone());
        kv
    }
}

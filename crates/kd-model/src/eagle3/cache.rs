//! The draft's attention state: the TTT steps' keys and values while training, and the
//! decoding KV cache.

use burn::tensor::{Tensor, TensorData};

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
/// back with [`DraftKvCache::truncate`] when drafted positions are rejected. Held as tensors
/// by the Burn path and as host buffers by the host path
/// ([`Eagle3Draft::with_host_decoding`](super::Eagle3Draft::with_host_decoding)); each path
/// takes the other's over once (a copy of the positions held).
#[derive(Debug, Default)]
pub struct DraftKvCache {
    kv: Option<Kv>,
}

#[derive(Debug)]
enum Kv {
    /// Boxed: a tensor is far larger than the host variant's vectors.
    Tensors(Box<(Tensor<4>, Tensor<4>)>),
    Host(HostKv),
}

/// Keys and values on the host, `[kv_heads, cap, head_dim]` each, the first `len` positions
/// of every head in use.
#[derive(Debug)]
struct HostKv {
    k: Vec<f32>,
    v: Vec<f32>,
    heads: usize,
    dim: usize,
    len: usize,
    cap: usize,
}

impl HostKv {
    /// Buffers of `cap` positions holding `k`, `v` (`[heads, len, dim]` each).
    fn new(k: &[f32], v: &[f32], [heads, len, dim]: [usize; 3], cap: usize) -> Self {
        let (mut hk, mut hv) = (vec![0f32; heads * cap * dim], vec![0f32; heads * cap * dim]);
        for h in 0..heads {
            let (from, to) = (h * len * dim, h * cap * dim);
            hk[to..to + len * dim].copy_from_slice(&k[from..from + len * dim]);
            hv[to..to + len * dim].copy_from_slice(&v[from..from + len * dim]);
        }
        Self {
            k: hk,
            v: hv,
            heads,
            dim,
            len,
            cap,
        }
    }

    /// The positions in use, `[heads, len, dim]` each.
    fn compact(&self) -> (Vec<f32>, Vec<f32>) {
        let (n, mut k, mut v) = (self.len * self.dim, Vec::new(), Vec::new());
        for h in 0..self.heads {
            let at = h * self.cap * self.dim;
            k.extend_from_slice(&self.k[at..at + n]);
            v.extend_from_slice(&self.v[at..at + n]);
        }
        (k, v)
    }
}

fn host_values(t: Tensor<4>) -> Vec<f32> {
    t.into_data()
        .try_into_vec::<f32>()
        .expect("the draft's keys and values are f32")
}

impl DraftKvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        match &self.kv {
            None => 0,
            Some(Kv::Tensors(kv)) => kv.0.dims()[2],
            Some(Kv::Host(h)) => h.len,
        }
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
        if len == 0 {
            self.kv = None;
            return;
        }
        match &mut self.kv {
            Some(Kv::Tensors(kv)) => {
                let [b, h, _, d] = kv.0.dims();
                let (k, v) = &mut **kv;
                *k = k.clone().slice([0..b, 0..h, 0..len, 0..d]);
                *v = v.clone().slice([0..b, 0..h, 0..len, 0..d]);
            }
            Some(Kv::Host(h)) => h.len = len,
            None => {}
        }
    }

    /// Appends `k`, `v` (`[1, kv_heads, s, head_dim]`) and returns every position's.
    pub(super) fn append(&mut self, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        let device = k.device();
        let kv = match self.kv.take() {
            Some(Kv::Tensors(past)) => {
                let (pk, pv) = *past;
                (Tensor::cat(vec![pk, k], 2), Tensor::cat(vec![pv, v], 2))
            }
            Some(Kv::Host(h)) => {
                let (hk, hv) = h.compact();
                let shape = [1, h.heads, h.len, h.dim];
                let t = |x: Vec<f32>| Tensor::<4>::from_data(TensorData::new(x, shape), &device);
                (
                    Tensor::cat(vec![t(hk), k], 2),
                    Tensor::cat(vec![t(hv), v], 2),
                )
            }
            None => (k, v),
        };
        self.kv = Some(Kv::Tensors(Box::new(kv.clone())));
        kv
    }

    /// Appends `k`, `v` (`[heads, s, dim]` each, host values) and calls `read` with every
    /// position's keys and values (`[heads, cap, dim]` buffers: heads `cap · dim` values apart,
    /// the first `len` positions of each in use) and that stride.
    pub(super) fn append_host<R>(
        &mut self,
        (k, v): (&[f32], &[f32]),
        [heads, s, dim]: [usize; 3],
        read: impl FnOnce(&[f32], &[f32], usize) -> R,
    ) -> R {
        assert!(
            k.len() == heads * s * dim && v.len() == k.len(),
            "append_host: keys and values of [{heads}, {s}, {dim}]"
        );
        let mut h = match self.kv.take() {
            None => HostKv::new(&[], &[], [heads, 0, dim], s.max(64)),
            Some(Kv::Host(h)) => h,
            Some(Kv::Tensors(past)) => {
                let (pk, pv) = *past;
                let [_, hh, len, d] = pk.dims();
                assert_eq!((hh, d), (heads, dim), "append_host: the cached shape");
                let cap = (len + s).max(2 * len).max(64);
                HostKv::new(&host_values(pk), &host_values(pv), [heads, len, dim], cap)
            }
        };
        assert_eq!(
            (h.heads, h.dim),
            (heads, dim),
            "append_host: the cached shape"
        );
        if h.len + s > h.cap {
            // Grow geometrically, keeping the positions in use.
            let (ck, cv) = h.compact();
            let cap = (h.len + s).max(2 * h.cap);
            h = HostKv::new(&ck, &cv, [heads, h.len, dim], cap);
        }
        for hd in 0..heads {
            let (from, to) = (hd * s * dim, (hd * h.cap + h.len) * dim);
            h.k[to..to + s * dim].copy_from_slice(&k[from..from + s * dim]);
            h.v[to..to + s * dim].copy_from_slice(&v[from..from + s * dim]);
        }
        h.len += s;
        let out = read(&h.k, &h.v, h.cap * dim);
        self.kv = Some(Kv::Host(h));
        out
    }
}

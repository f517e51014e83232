//! Decoding straight from a GGUF file's quantised blocks: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
//! Q5_K and Q6_K projection weights (and a tied embedding used as the LM head) kept as the
//! file stores them, `[out, in]` rows of 32-value blocks or 256-value super-blocks, scales
//! included (no f32 copy of any scale: the kernels read them from the blocks, see [`group`]).
//! A model loaded for inference is lean: the f32 copy that every other path (training,
//! merging, saving, other devices) uses is made from the blocks only when such a path first
//! reads it ([`PackedMatrix::lazy_weight`]).
//!
//! Decoding reads every weight once per generated token, so its speed is the memory traffic:
//! a Q4_1 block is 20 bytes for 32 weights where f32 is 128. The kernels dequantise each
//! group of 32 weights in registers with exactly the operations of ggml's reference
//! dequantisation (the values are bit-identical to the f32 copy's), then multiply-accumulate
//! in f32; only the order of the additions differs from the f32 kernels. Each output is a sum over one input
//! row, so a row's result does not depend on the other rows of the batch.
//!
//! The blocks mirror the weights the model was loaded with: a model whose base weights
//! change (merged adapters, full fine-tuning) must not keep them —
//! [`Llama::merge_and_unload`](crate::Llama::merge_and_unload) drops them, and only
//! [`Llama::load_for_inference`](crate::Llama::load_for_inference) creates them.

use burn::module::{Param, ParamId};
use burn::tensor::{Device, Shape, Tensor, TensorData};
use kd_gguf::{GgmlType, GgufFile, SharedBytes};
use kd_kernels::gemm::{MatMut, MatRef, Threads, Write, matmul};
use rayon::prelude::*;

use crate::model::{HostLayer, LayerPacks};
use crate::q8::{self, Q8Rows};
use crate::q8k::{Q8KRows, is_kquant};

mod amx;
pub(crate) use amx::available as amx_available;
pub(crate) mod group;
mod kernels;
use kernels::Kernel;

/// The packed weights of a model loaded from GGUF: per layer q, k, v, o, gate, up, down (each
/// when stored in a packed type), and the LM head (`output.weight`, or the tied embedding).
#[derive(Debug, Clone)]
pub(crate) struct Packed {
    pub layers: Vec<LayerPacks>,
    pub head: Option<PackedMatrix>,
    /// Per layer, the norms and biases a host decode pass reads (see `model::host`); `None`
    /// when some layer is not fully packed, or its small weights are not f32.
    pub host: Option<Vec<HostLayer>>,
    /// The model was loaded lean: the f32 weights these blocks hold are made only when a
    /// path reads them ([`PackedMatrix::lazy_weight`]), so every pass the host layers can
    /// take, however wide, takes them (and the LM head reads its blocks).
    pub lean: bool,
}

impl Packed {
    /// The packed matrices of a GGUF file for a model of configuration `c`: per layer q, k,
    /// v, o, gate, up, down, and the LM head (`output.weight`, or the tied embedding); the
    /// blocks of every tensor stored in a packed type ([`group::packable`]), the queries' and
    /// keys' rows put back
    /// in Hugging Face order.
    pub fn matrices(
        file: &GgufFile,
        c: &crate::LlamaConfig,
    ) -> (Vec<LayerPacks>, Option<PackedMatrix>) {
        let get = |name: &str, heads: Option<usize>| -> Option<PackedMatrix> {
            let t = file.tensor(name)?;
            let [rows, cols] = t.shape()[..] else {
                return None;
            };
            let bytes = file.shared_tensor_bytes(name).ok()?;
            let m = PackedMatrix::shared(t.ty, rows, cols, bytes)?;
            match heads {
                Some(h) => m.unpermute_rows(h),
                None => Some(m),
            }
        };
        // Only a Llama's converter interleaves the query/key rows (see `gguf`).
        let permuted = |heads: usize| c.family.gguf_permutes_qk().then_some(heads);
        let layers = (0..c.num_hidden_layers)
            .map(|l| {
                let n = |m: &str| format!("blk.{l}.{m}.weight");
                [
                    get(&n("attn_q"), permuted(c.num_attention_heads)),
                    get(&n("attn_k"), permuted(c.num_key_value_heads)),
                    get(&n("attn_v"), None),
                    get(&n("attn_output"), None),
                    get(&n("ffn_gate"), None),
                    get(&n("ffn_up"), None),
                    get(&n("ffn_down"), None),
                ]
            })
            .collect();
        let head = if c.tie_word_embeddings {
            get("token_embd.weight", None)
        } else {
            get("output.weight", None)
        };
        (layers, head)
    }

    /// The packs with the host copies of `model`'s norms and biases, where every projection
    /// of every layer is packed.
    pub fn with_host(
        layers: Vec<LayerPacks>,
        head: Option<PackedMatrix>,
        model: &crate::Llama,
    ) -> Self {
        let mut packed = Self {
            layers,
            head,
            host: None,
            lean: false,
        };
        packed.set_host(Some(model));
        packed
    }

    /// Host copies of `model`'s norms and biases where every projection of every layer is
    /// packed (`None`: no host layers).
    pub fn set_host(&mut self, model: Option<&crate::Llama>) {
        self.host = model
            .filter(|_| self.layers.iter().all(|l| l.iter().all(Option::is_some)))
            .and_then(|m| m.layers.iter().map(HostLayer::of).collect());
    }

    /// Q8_0 blocks of every projection and of the LM head (the tied embedding when there is
    /// no head), quantised from `model`'s f32 weights as llama.cpp's `quantize_row_q8_0`
    /// does. A matrix whose input width is not a multiple of 32, or whose weights are not f32,
    /// gets none (it decodes from its f32 weights).
    pub fn q8_0_from_weights(model: &crate::Llama) -> Self {
        let proj = |p: &kd_lora::LoraLinear| PackedMatrix::q8_0(p.base.weight.val().transpose());
        let layers = model
            .layers
            .iter()
            .map(|l| l.projections().map(proj))
            .collect();
        Self::with_host(layers, PackedMatrix::q8_0(model.lm_head_weight()), model)
    }

    /// The packs of the kept layers (see `Llama::keep_layers`).
    pub fn keep(&self, keep: &[usize]) -> Self {
        Self {
            layers: keep.iter().map(|&i| self.layers[i].clone()).collect(),
            head: self.head.clone(),
            host: self
                .host
                .as_ref()
                .map(|h| keep.iter().map(|&i| h[i].clone()).collect()),
            lean: self.lean,
        }
    }

    /// Switches every matrix between f32 and 8-bit activations.
    pub fn set_int8(&mut self, on: bool) {
        for m in self.layers.iter_mut().flatten().flatten() {
            m.int8 = on;
            m.amx = m.amx.take().filter(|_| on);
        }
        if let Some(h) = &mut self.head {
            h.int8 = on;
            h.amx = h.amx.take().filter(|_| on);
        }
    }

    /// Runs the 8-bit products of Q4_1 and Q8_0 matrices on AMX tiles ([`amx`]) where this
    /// process can use them, or back on the AVX-512 kernels ([`amx`](Self::amx) says whether
    /// any took). Applies to the matrices set to 8-bit activations.
    pub fn set_amx(&mut self, on: bool) {
        let on = on && amx::available();
        for m in self
            .layers
            .iter_mut()
            .flatten()
            .flatten()
            .chain(&mut self.head)
        {
            m.amx = (on && m.int8)
                .then(|| amx::AmxMatrix::new(m.ty, m.rows, m.cols, &m.bytes))
                .flatten()
                .map(std::sync::Arc::new);
        }
    }

    /// Whether some matrix runs on AMX tiles.
    pub fn amx(&self) -> bool {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .chain(&self.head)
            .any(|m| m.amx.is_some())
    }

    /// Whether the matrices take 8-bit activations.
    pub fn int8(&self) -> bool {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .chain(&self.head)
            .any(|m| m.int8)
    }

    /// Number of packed matrices.
    pub fn count(&self) -> usize {
        self.layers.iter().flatten().flatten().count() + usize::from(self.head.is_some())
    }
}

/// `x [n, in] · mᵀ` → `[n, out]` on the CPU backend.
pub(crate) fn packed_project(m: &PackedMatrix, x: Tensor<2>) -> Tensor<2> {
    let [n, k] = x.dims();
    assert_eq!(
        k, m.cols,
        "packed matrix of {} columns for input width {k}",
        m.cols
    );
    let device = x.device();
    let xs: Vec<f32> = x.into_data().try_into_vec_as::<f32>().expect("f32 input");
    Tensor::from_data(TensorData::new(m.project(&xs, n), [n, m.rows]), &device)
}

/// A `[rows, cols]` matrix (a projection's `[out, in]`) in the blocks of a packed type
/// ([`group::packable`]).
#[derive(Clone)]
pub struct PackedMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    /// The blocks, row by row: the mapped file's own pages where its rows are in order, else
    /// a copy (shared: clones, and a lean model's lazy f32 weights, read the same bytes).
    bytes: SharedBytes,
    /// Whether products quantise their input to 8 bits ([`q8`]) instead of dequantising.
    int8: bool,
    /// The blocks in AMX tiles' layout, where 8-bit products run on them ([`amx`]).
    amx: Option<std::sync::Arc<amx::AmxMatrix>>,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PackedMatrix({} [{}, {}])",
            self.ty.name(),
            self.rows,
            self.cols
        )
    }
}

/// Output rows per parallel task at least, and what a task's rows are a multiple of (AMX
/// tiles take 16 at a time).
const ROWS_PER_TASK: usize = 64;

/// Tasks per thread of the pool a product of few input rows is split into, at most: enough
/// that a thread that starts late still gets a share, few enough that handing the tasks out
/// costs little beside them (a SmolLM2 decode step's products made 3,200 tasks of 64 rows).
const TASKS_PER_THREAD: usize = 4;

/// Output rows per parallel task of a wide pass ([`WIDE_PASS`] input rows or more).
const WIDE_ROWS_PER_TASK: usize = 256;

/// Input rows the f32-activation kernels take at a time (even: the AVX2 kernel pairs rows).
const INPUT_TILE: usize = 32;

/// Input rows from which an f32 product dequantises its weights once and runs a GEMM (only a
/// lean model's wide passes have so many: the others take Burn's GEMM on their f32 copies).
const WIDE_PASS: usize = 64;

/// `[n, rows[m]]` for each matrix `m`, all in one parallel job of tasks of [`ROWS_PER_TASK`]
/// matrix rows: `kernel(m, j0..j0 + nb, acc)` writes outputs `j0..j0 + nb` of matrix `m` for
/// every input row into `acc [n, nb]`.
fn par_rows_of(
    rows: &[usize],
    n: usize,
    kernel: impl Fn(usize, std::ops::Range<usize>, &mut [f32]) + Sync,
) -> Vec<Vec<f32>> {
    // A wide pass's tasks each run a GEMM: fewer, larger ones block better. Otherwise
    // TASKS_PER_THREAD tasks per thread over all the matrices, in multiples of ROWS_PER_TASK.
    // Each output is computed alone, so the split does not change a bit of it.
    let per_task = if n >= WIDE_PASS {
        WIDE_ROWS_PER_TASK
    } else {
        let tasks = rayon::current_num_threads().max(1) * TASKS_PER_THREAD;
        rows.iter()
            .sum::<usize>()
            .div_ceil(tasks)
            .next_multiple_of(ROWS_PER_TASK)
            .max(ROWS_PER_TASK)
    };
    let tasks: Vec<(usize, usize)> = rows
        .iter()
        .enumerate()
        .flat_map(|(m, &r)| (0..r).step_by(per_task).map(move |j0| (m, j0)))
        .collect();
    let parts: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(m, j0)| {
            let nb = per_task.min(rows[m] - j0);
            let mut acc = vec![0f32; n * nb];
            kernel(m, j0..j0 + nb, &mut acc);
            acc
        })
        .collect();
    let mut out: Vec<Vec<f32>> = rows.iter().map(|r| vec![0f32; n * r]).collect();
    for (&(m, j0), part) in tasks.iter().zip(&parts) {
        let (width, nb) = (rows[m], part.len() / n.max(1));
        for r in 0..n {
            out[m][r * width + j0..r * width + j0 + nb]
                .copy_from_slice(&part[r * nb..(r + 1) * nb]);
        }
    }
    out
}

/// `x [n, cols] · mᵀ` for every matrix `m` of `ms` (of one input width), as
/// [`PackedMatrix::project`] computes each, in one parallel job: a layer's q, k and v, or its
/// gate and up, share the pool's threads evenly and the input is quantised once.
pub(crate) fn project_all(ms: &[&PackedMatrix], x: &[f32], n: usize) -> Vec<Vec<f32>> {
    let Some(cols) = ms.first().map(|m| m.cols) else {
        return Vec::new();
    };
    assert!(
        ms.iter().all(|m| m.cols == cols) && x.len() == n * cols,
        "project_all: matrices of {cols} columns and x [{n}, {cols}]"
    );
    // 8-bit activations as each weight type pairs with them: super-blocks of 256 for the
    // K-quants, blocks of 32 for the rest (ggml's Q8_K and Q8_0/Q8_1).
    let int8 = |k: bool| ms.iter().any(|m| m.int8 && is_kquant(m.ty) == k);
    let q8 = int8(false).then(|| Q8Rows::quantize(x, n, cols));
    let q8k = int8(true).then(|| Q8KRows::quantize(x, n, cols));
    let (kernel, q8_kernel) = (Kernel::detect(), q8::Kernel::detect());
    let rows: Vec<usize> = ms.iter().map(|m| m.rows).collect();
    par_rows_of(&rows, n, |mi, range, acc| {
        let m = ms[mi];
        match (&q8, &q8k, &m.amx) {
            (_, Some(xk), _) if m.int8 && is_kquant(m.ty) => {
                m.int8_rows(range, acc, |rows, acc, nb| {
                    q8_kernel.dot_rows_k(m.ty, rows, xk, acc, nb)
                })
            }
            // Tasks start at multiples of 64 outputs, and tiled matrices have a multiple of 16
            // (`AmxMatrix::new`).
            (Some(xq), _, Some(tiles)) => tiles.rows(xq, range, acc),
            (Some(xq), _, _) if m.int8 && !is_kquant(m.ty) => {
                m.int8_rows(range, acc, |rows, acc, nb| {
                    q8_kernel.dot_rows(m.ty, rows, xq, acc, nb)
                })
            }
            _ => m.f32_rows(kernel, x, n, range, acc),
        }
    })
}

impl PackedMatrix {
    /// Wraps the raw blocks of a `[rows, cols]` tensor; `None` for another type or a size
    /// that does not match.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        Self::shared(ty, rows, cols, bytes.to_vec().into())
    }

    /// [`new`](Self::new) over bytes held elsewhere (a mapped GGUF file's tensor), not
    /// copied.
    pub(crate) fn shared(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: SharedBytes,
    ) -> Option<Self> {
        if !group::packable(ty) {
            return None;
        }
        let (block, size) = ty.block()?;
        if !cols.is_multiple_of(block) || bytes.len() != rows * cols / block * size {
            return None;
        }
        Some(Self {
            ty,
            rows,
            cols,
            bytes,
            int8: false,
            amx: None,
        })
    }

    /// `w` (`[rows, cols]`, f32) quantised to Q8_0 blocks as llama.cpp's `quantize_row_q8_0`
    /// does; `None` when `cols` is not a multiple of 32 or the values are not f32.
    pub(crate) fn q8_0(w: Tensor<2>) -> Option<Self> {
        let [rows, cols] = w.dims();
        let values = w.into_data().try_to_vec::<f32>().ok()?;
        Self::new(
            GgmlType::Q8_0,
            rows,
            cols,
            &kd_gguf::quantize_q8_0(&values).ok()?,
        )
    }

    /// Undoes llama.cpp's Q/K row permutation (see `gguf::unpermute_rows`) on whole rows of
    /// blocks; `None` when the rows are not `heads` heads of even width.
    fn unpermute_rows(self, heads: usize) -> Option<Self> {
        if heads == 0 || !self.rows.is_multiple_of(2 * heads) {
            return None;
        }
        let rb = self.row_bytes();
        let mut out = vec![0u8; self.bytes.len()];
        for (dst, src) in crate::gguf::unpermuted_order(self.rows, heads)
            .into_iter()
            .enumerate()
        {
            out[dst * rb..(dst + 1) * rb].copy_from_slice(&self.bytes[src * rb..(src + 1) * rb]);
        }
        Some(Self {
            bytes: out.into(),
            ..self
        })
    }

    /// Bytes per matrix row.
    fn row_bytes(&self) -> usize {
        let (block, size) = self.ty.block().expect("a supported type");
        self.cols / block * size
    }

    /// The matrix `[rows, cols]` in f32: exactly the values `kd_gguf::dequantize` gives the
    /// file's blocks (the values every f32 path of a GGUF model computes with).
    pub(crate) fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.rows * self.cols];
        self.dequantize_into(0..self.rows, &mut w);
        w
    }

    /// Matrix rows `rows` in f32 into `dst` (`[rows.len(), cols]`).
    fn dequantize_into(&self, rows: std::ops::Range<usize>, dst: &mut [f32]) {
        let rb = self.row_bytes();
        kd_gguf::dequantize(self.ty, &self.bytes[rows.start * rb..rows.end * rb], dst)
            .expect("blocks of a supported type");
    }

    /// The f32 weight these blocks hold, made only when a path reads it: a parameter of
    /// shape `[cols, rows]` (a Burn `Linear`'s `[in, out]`) when `transpose`, else `[rows,
    /// cols]` (an LM head's or an embedding's layout), on `device`.
    pub(crate) fn lazy_weight(&self, transpose: bool, device: &Device) -> Param<Tensor<2>> {
        let m = self.clone();
        let shape = if transpose {
            [self.cols, self.rows]
        } else {
            [self.rows, self.cols]
        };
        Param::uninitialized(
            ParamId::new(),
            move |device, require_grad| {
                let data =
                    crate::weights::transpose_data(m.dequantize(), vec![m.rows, m.cols], transpose);
                Tensor::<2>::from_data(data, device).set_require_grad(require_grad)
            },
            device.clone(),
            false,
            Shape::new(shape),
        )
    }

    /// Rows `ids` of the matrix in f32 (an embedding lookup from blocks), `[ids.len(), cols]`;
    /// the same values as the rows of [`dequantize`](Self::dequantize).
    pub(crate) fn dequantize_rows(&self, ids: &[usize]) -> Vec<f32> {
        let mut out = vec![0f32; ids.len() * self.cols];
        for (dst, &row) in out.chunks_exact_mut(self.cols).zip(ids) {
            self.dequantize_into(row..row + 1, dst);
        }
        out
    }

    /// Rows and columns: `[out, in]` of a projection.
    pub(crate) fn dims(&self) -> [usize; 2] {
        [self.rows, self.cols]
    }

    /// `x [n, cols] · selfᵀ` → `[n, rows]` as decoding computes it: from 8-bit activations
    /// when the matrix is set to take them, else from `x` as it is.
    pub(crate) fn project(&self, x: &[f32], n: usize) -> Vec<f32> {
        project_all(&[self], x, n).pop().expect("one matrix")
    }

    /// `x [n, cols] · selfᵀ` → `[n, rows]`, with `x` row-major, f32 activations.
    #[cfg(test)]
    pub fn matmul_t(&self, x: &[f32], n: usize) -> Vec<f32> {
        self.matmul_t_with(x, n, Kernel::detect())
    }

    #[cfg(test)]
    fn matmul_t_with(&self, x: &[f32], n: usize, kernel: Kernel) -> Vec<f32> {
        assert_eq!(x.len(), n * self.cols, "x must be [n, cols]");
        let mut out = par_rows_of(&[self.rows], n, |_, range, acc| {
            self.f32_rows(kernel, x, n, range, acc)
        });
        out.pop().expect("one matrix")
    }

    /// The same product from 8-bit activations, with integer dot products (see [`q8`]).
    #[cfg(test)]
    pub(crate) fn matmul_t_q8(&self, x: &Q8Rows) -> Vec<f32> {
        self.matmul_t_q8_with(x, q8::Kernel::detect())
    }

    #[cfg(test)]
    fn matmul_t_q8_with(&self, x: &Q8Rows, kernel: q8::Kernel) -> Vec<f32> {
        assert_eq!(x.cols, self.cols, "x must be [n, cols]");
        let mut out = par_rows_of(&[self.rows], x.n, |_, range, acc| {
            self.int8_rows(range, acc, |rows, acc, nb| {
                kernel.dot_rows(self.ty, rows, x, acc, nb)
            })
        });
        out.pop().expect("one matrix")
    }

    /// The same product from 8-bit super-block activations (K-quant types, see [`crate::q8k`]).
    #[cfg(test)]
    fn matmul_t_q8k_with(&self, x: &Q8KRows, kernel: q8::Kernel) -> Vec<f32> {
        assert_eq!(x.cols, self.cols, "x must be [n, cols]");
        let mut out = par_rows_of(&[self.rows], x.n, |_, range, acc| {
            self.int8_rows(range, acc, |rows, acc, nb| {
                kernel.dot_rows_k(self.ty, rows, x, acc, nb)
            })
        });
        out.pop().expect("one matrix")
    }

    /// Outputs `range` of every row of `x [n, cols]` into `acc [n, range.len()]`, f32
    /// activations.
    fn f32_rows(
        &self,
        kernel: Kernel,
        x: &[f32],
        n: usize,
        range: std::ops::Range<usize>,
        acc: &mut [f32],
    ) {
        let nb = range.len();
        if n >= WIDE_PASS {
            // A wide pass (prefill): the task's rows dequantised once into an f32 block, then
            // one GEMM over all input rows, instead of dequantising every block again for
            // each pair of input rows. Each row's sums then follow the GEMM's order.
            let mut w = vec![0f32; nb * self.cols];
            self.dequantize_into(range.clone(), &mut w);
            let shapes = "packed product shapes";
            matmul(
                MatMut::row_major(acc, n, nb).expect(shapes),
                MatRef::row_major(x, n, self.cols).expect(shapes),
                MatRef::row_major(&w, nb, self.cols).expect(shapes).t(),
                Write::Overwrite,
                1.0,
                Threads::One,
            )
            .expect(shapes);
            return;
        }
        // Input rows in tiles of INPUT_TILE (a multiple of the kernels' row pairs, so that
        // each row's sum is the same as untiled).
        for r0 in (0..n).step_by(INPUT_TILE) {
            let rows = INPUT_TILE.min(n - r0);
            let (x, acc) = (&x[r0 * self.cols..], &mut acc[r0 * nb..]);
            kernel.dot_rows(
                self.ty,
                self.block_rows(range.clone()),
                x,
                rows,
                self.cols,
                acc,
                nb,
                0,
            );
        }
    }

    /// Outputs `range` of every 8-bit input row into `acc [n, range.len()]`: `dot(rows, acc,
    /// nb)` writes outputs `0..range.len()` of the matrix rows whose blocks `rows` holds (one
    /// of the [`q8`] kernels).
    fn int8_rows(
        &self,
        range: std::ops::Range<usize>,
        acc: &mut [f32],
        dot: impl Fn(&[u8], &mut [f32], usize),
    ) {
        let nb = range.len();
        dot(self.block_rows(range), acc, nb);
    }

    /// Matrix rows `rows`: their blocks as stored, one row after the other.
    fn block_rows(&self, rows: std::ops::Range<usize>) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes[rows.start * rb..rows.end * rb]
    }
}

#[cfg(test)]
mod tests;

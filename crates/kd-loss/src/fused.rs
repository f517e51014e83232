//! The fused path: one host pass computes the loss and d loss / d logits together (the row
//! kernels of [`crate::kernels`]), reading the logits in place; the gradient is handed to
//! autodiff by a custom backward op that scales it in place.
//!
//! Peak extra memory is the gradient itself (`[rows, vocab]`, which autodiff needs anyway)
//! plus O(vocab) scratch per thread: no softmax, log-softmax or intermediate of the size of the
//! logits is materialised. Runs on the CPU (`flex`) backend, with or without autodiff.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{
    AutodiffBackend, Backend, ExtensionType, Flex, TensorMetadata, backend_extension,
};
use burn::tensor::{Tensor, TensorData};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn_flex::FlexTensor;

use crate::kernels::{self, BatchStats, KdParams, TeacherRows};

/// What to compute, besides the tensors.
#[derive(Debug, Clone)]
pub struct FusedJob {
    /// KD parameters, or `None` for cross-entropy.
    pub kd: Option<KdParams>,
    /// Rows that count (KD).
    pub mask: Vec<bool>,
    /// Targets (cross-entropy; negative = ignored).
    pub targets: Vec<i64>,
    /// Multiplier of the summed loss (1/N, times τ² when asked).
    pub scale: f32,
    /// Compute the gradient even if the student is not tracked (benchmarks).
    pub force_grad: bool,
}

/// The teacher side of a fused call.
#[derive(ExtensionType)]
pub enum FusedTeacher<B: Backend> {
    /// No teacher (cross-entropy).
    None(FloatTensor<B>),
    /// Full logits `[rows, vocab]`.
    Full(FloatTensor<B>),
    /// Top-k indices and values `[rows, k]`.
    Sparse(IntTensor<B>, FloatTensor<B>),
}

/// Fused loss kernels as a Burn backend extension (CPU backend and autodiff over it).
#[backend_extension(Flex, Autodiff)]
pub trait FusedLossBackend: Backend {
    /// Returns `(loss [1], stats [5], grad [rows, vocab] or [1])`; stats are
    /// `[loss_sum, acceptance_sum, top1, counted, nonfinite]`.
    fn fused_loss(
        student: FloatTensor<Self>,
        #[extension_type] teacher: FusedTeacher<Self>,
        job: FusedJob,
        want_grad: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

pub use kd_kernels::f32_view;

pub(crate) fn i64_view(t: &FlexTensor) -> Vec<u32> {
    let data = t.clone().into_data().convert::<i64>();
    data.try_into_vec_as::<i64>()
        .expect("i64 data after conversion")
        .into_iter()
        .map(|i| i as u32)
        .collect()
}

/// A zeroed buffer for a logits-sized gradient. Fresh pages of a large allocation are mapped
/// on first write; asking for transparent huge pages cuts those page faults 512-fold (they
/// cost about as much as the kernel itself at 1024 × 128256).
fn gradient_buffer(len: usize) -> Vec<f32> {
    let v = vec![0f32; len];
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let bytes = len * std::mem::size_of::<f32>();
        if bytes >= 4 * HUGE {
            let start = v.as_ptr() as usize;
            let aligned = start.next_multiple_of(HUGE);
            let end = (start + bytes) / HUGE * HUGE;
            if end > aligned {
                // SAFETY: advice only (no change of contents or ownership) on a range inside
                // the vector's own allocation; failure is harmless and ignored.
                unsafe {
                    libc::madvise(
                        aligned as *mut libc::c_void,
                        end - aligned,
                        libc::MADV_HUGEPAGE,
                    );
                }
            }
        }
    }
    v
}

pub(crate) fn flex(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// A computed gradient as a tensor of `shape`, or the `[1]` placeholder when none was asked.
pub(crate) fn grad_or_placeholder(g: Option<Vec<f32>>, shape: Vec<usize>) -> FlexTensor {
    match g {
        Some(g) => flex(g, shape),
        None => flex(vec![0.0], vec![1]),
    }
}

/// Batch statistics as the kernels hand them to the caller:
/// `[loss_sum, acceptance_sum, top1, counted, nonfinite]`.
pub(crate) fn stats_values(s: &BatchStats) -> [f32; 5] {
    [
        s.loss_sum as f32,
        s.acceptance_sum as f32,
        s.top1 as f32,
        s.counted as f32,
        s.nonfinite as f32,
    ]
}

/// The inverse of [`stats_values`].
pub(crate) fn stats_from_values(v: &[f32]) -> BatchStats {
    BatchStats {
        loss_sum: v[0] as f64,
        acceptance_sum: v[1] as f64,
        top1: v[2] as usize,
        counted: v[3] as usize,
        nonfinite: v[4] as usize,
    }
}

impl FusedLossBackend for Flex {
    fn fused_loss(
        student: FlexTensor,
        teacher: FusedTeacher<Self>,
        job: FusedJob,
        want_grad: bool,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        let shape = student.layout().shape().to_vec();
        let vocab = *shape.last().expect("2-D logits");
        let rows = student.layout().num_elements() / vocab.max(1);
        let s = f32_view(&student);
        let mut grad = (want_grad || job.force_grad).then(|| gradient_buffer(rows * vocab));
        let stats: BatchStats = match (&job.kd, &teacher) {
            (Some(params), FusedTeacher::Full(t)) => {
                let t = f32_view(t);
                kernels::kd_rows(
                    params,
                    &s,
                    vocab,
                    TeacherRows::Full(&t),
                    &job.mask,
                    job.scale,
                    grad.as_deref_mut(),
                )
            }
            (Some(params), FusedTeacher::Sparse(idx, values)) => {
                let k = *values
                    .layout()
                    .shape()
                    .to_vec()
                    .last()
                    .expect("2-D top-k values");
                let values = f32_view(values);
                let indices = i64_view(idx);
                let rows_t = TeacherRows::Sparse {
                    indices: &indices,
                    values: &values,
                    k,
                };
                kernels::kd_rows(
                    params,
                    &s,
                    vocab,
                    rows_t,
                    &job.mask,
                    job.scale,
                    grad.as_deref_mut(),
                )
            }
            (None, _) => kernels::ce_rows(&s, vocab, &job.targets, job.scale, grad.as_deref_mut()),
            (Some(_), FusedTeacher::None(_)) => {
                unreachable!("KD without a teacher is rejected earlier")
            }
        };
        let loss = (stats.loss_sum * job.scale as f64) as f32;
        let stats_t = flex(stats_values(&stats).to_vec(), vec![5]);
        (
            flex(vec![loss], vec![1]),
            stats_t,
            grad_or_placeholder(grad, shape),
        )
    }
}

impl<B: Backend + FusedLossBackend, C: CheckpointStrategy> FusedLossBackend for Autodiff<B, C> {
    fn fused_loss(
        student: FloatTensor<Self>,
        teacher: FusedTeacher<Self>,
        job: FusedJob,
        _want_grad: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        /// The backward step: the stored gradient, scaled by the upstream gradient.
        #[derive(Debug)]
        struct FusedBackward;

        impl<B: Backend> Backward<B, 1> for FusedBackward {
            type State = FloatTensor<B>;

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let stored = ops.state;
                unary::<B, _>(ops.parents, ops.node, grads, |upstream| {
                    // upstream is the [1] gradient of the loss; the stored gradient is unique,
                    // so the backend multiplies in place.
                    let rank = stored.shape().num_dims();
                    let upstream = B::float_reshape(upstream, vec![1; rank].into());
                    B::float_mul(stored, upstream)
                });
            }
        }

        let inner_teacher = match teacher {
            FusedTeacher::None(t) => FusedTeacher::None(t.into_primitive()),
            FusedTeacher::Full(t) => FusedTeacher::Full(t.into_primitive()),
            FusedTeacher::Sparse(i, v) => FusedTeacher::Sparse(i, v.into_primitive()),
        };
        let tracked = student.is_tracked();
        let guard = student.node();
        let (loss, stats, grad) =
            B::fused_loss(student.into_primitive(), inner_teacher, job, tracked);
        let loss = match FusedBackward
            .prepare::<C>([guard])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(grad, loss),
            OpsKind::UnTracked(prep) => prep.finish(loss),
        };
        // The gradient travels with the loss node; the third output is a placeholder.
        let placeholder = <Self as AutodiffBackend>::from_inner(stats.clone());
        let stats = <Self as AutodiffBackend>::from_inner(stats);
        (loss, stats, placeholder)
    }
}

/// Runs the fused kernel on `student` (`[rows, vocab]`, flex device, with or without
/// autodiff). Returns the loss `[1]` (differentiable), the batch statistics and, when
/// `return_grad`, the gradient as a plain tensor (benchmarks and tests).
pub(crate) fn run(
    student: Tensor<2>,
    teacher: FusedTeacherInput,
    job: FusedJob,
) -> (Tensor<1>, BatchStats, Option<Tensor<2>>) {
    let return_grad = job.force_grad && !student.is_autodiff();
    let teacher = match teacher {
        FusedTeacherInput::None => {
            FusedTeacher::None(student.clone().without_autodiff().into_dispatch())
        }
        FusedTeacherInput::Full(t) => FusedTeacher::Full(t.without_autodiff().into_dispatch()),
        FusedTeacherInput::Sparse(i, v) => {
            FusedTeacher::Sparse(i.into_dispatch(), v.without_autodiff().into_dispatch())
        }
    };
    let (loss, stats, grad) = <burn::backend::Dispatch as FusedLossBackend>::fused_loss(
        student.into_dispatch(),
        teacher,
        job,
        return_grad,
    );
    let loss = Tensor::<1>::from_dispatch(loss);
    let stats = read_stats(stats);
    let grad = return_grad.then(|| Tensor::<2>::from_dispatch(grad));
    (loss, stats, grad)
}

/// The `[loss_sum, acceptance_sum, top1, counted, nonfinite]` tensor of a fused call.
pub(crate) fn read_stats(stats: FloatTensor<burn::backend::Dispatch>) -> BatchStats {
    let stats: Vec<f32> = Tensor::<1>::from_dispatch(stats)
        .into_data()
        .try_into_vec_as::<f32>()
        .expect("f32 stats");
    stats_from_values(&stats)
}

/// The teacher as the public API passes it to the fused path.
#[allow(clippy::large_enum_variant)] // short-lived, moved once
pub(crate) enum FusedTeacherInput {
    None,
    Full(Tensor<2>),
    Sparse(Tensor<2, burn::tensor::Int>, Tensor<2>),
}

//! f32 views of CPU tensors.

use std::borrow::Cow;

use burn::tensor::DType;
use burn_flex::FlexTensor;

/// The values of a CPU tensor as f32, row-major: borrowed when the tensor is contiguous f32
/// from the start of its buffer, copied (and converted) otherwise.
pub fn f32_view(t: &FlexTensor) -> Cow<'_, [f32]> {
    let n = t.layout().num_elements();
    if t.dtype() == DType::F32 && t.is_contiguous() && t.layout().start_offset() == 0 {
        Cow::Borrowed(&t.storage::<f32>()[..n])
    } else {
        let data = t.clone().into_data().convert::<f32>();
        Cow::Owned(
            data.try_into_vec_as::<f32>()
                .expect("f32 data after conversion"),
        )
    }
}

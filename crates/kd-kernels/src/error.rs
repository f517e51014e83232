//! The crate's error type.

/// What a kernel refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    /// A matrix view does not fit in its slice.
    #[error(
        "a {rows} × {cols} matrix with strides ({row_stride}, {col_stride}) needs {needed} values but its slice holds {len}"
    )]
    OutOfBounds {
        /// Rows of the view.
        rows: usize,
        /// Columns of the view.
        cols: usize,
        /// Distance between consecutive rows.
        row_stride: usize,
        /// Distance between consecutive columns.
        col_stride: usize,
        /// Values the view reaches (its last index + 1).
        needed: usize,
        /// Length of the slice.
        len: usize,
    },
    /// A destination view whose elements would overlap (row stride below the row length).
    #[error(
        "a destination of {rows} × {cols} values needs a row stride of at least {cols}, not {row_stride}"
    )]
    OverlappingRows {
        /// Rows of the view.
        rows: usize,
        /// Columns of the view.
        cols: usize,
        /// The row stride given.
        row_stride: usize,
    },
    /// Operands of a product whose shapes do not chain.
    #[error(
        "cannot multiply [{lhs_rows}, {lhs_cols}] · [{rhs_rows}, {rhs_cols}] into [{dst_rows}, {dst_cols}]"
    )]
    Shapes {
        /// Rows of the destination.
        dst_rows: usize,
        /// Columns of the destination.
        dst_cols: usize,
        /// Rows of the left operand.
        lhs_rows: usize,
        /// Columns of the left operand.
        lhs_cols: usize,
        /// Rows of the right operand.
        rhs_rows: usize,
        /// Columns of the right operand.
        rhs_cols: usize,
    },
    /// An instruction-set level that is not one of the known names.
    #[error(
        "`KD_SIMD={value}` is not an instruction-set level: use scalar, avx2, avx512 or native (or unset it)"
    )]
    SimdLevel {
        /// The value given.
        value: String,
    },
}

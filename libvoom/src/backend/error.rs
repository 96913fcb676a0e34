//! The error type of the backend interface, the same for every backend.

use voom_formats::DType;

/// An error from a backend op's argument checks, or a KV layout that is full.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The weight dtype is not one the kernels compute on.
    #[error("weight dtype {0} is not supported by the compute kernels (BF16, F16, F32 are)")]
    UnsupportedDType(DType),
    /// `rows * cols * dtype size` overflows `usize`.
    #[error("weight shape {rows}x{cols} of {dtype} overflows the address space")]
    ShapeOverflow {
        rows: usize,
        cols: usize,
        dtype: DType,
    },
    /// The weight bytes do not match the shape.
    #[error("weight {rows}x{cols} of {dtype} needs {expected} bytes, got {actual}")]
    WeightLen {
        rows: usize,
        cols: usize,
        dtype: DType,
        expected: usize,
        actual: usize,
    },
    /// A block-scaled weight whose scales do not match its shape.
    #[error("weight {rows}x{cols} of {format} needs {expected} bytes of scales, got {actual}")]
    ScalesLen {
        rows: usize,
        cols: usize,
        format: String,
        expected: usize,
        actual: usize,
    },
    /// A block shape the kernels do not compute on (FP8 blocks of columns are a
    /// power of two of at least 8; MXFP4 rows are whole blocks of 32).
    #[error(
        "weight blocks of {block_rows}x{block_cols} (from row {row0} of the first) are not \
         supported: blocks of columns are a power of two, at least 8, and divide MXFP4 rows"
    )]
    BlockShape {
        block_rows: usize,
        block_cols: usize,
        row0: usize,
    },
    /// A weight format this backend does not compute on (a ggml type with no
    /// dequantization, or a format a backend refuses).
    #[error("weight format {0} is not supported by this backend's kernels")]
    UnsupportedFormat(String),
    /// A ggml-block weight whose rows are not whole blocks.
    #[error("a {format} weight of {cols} columns is not whole blocks of {block}")]
    PartialBlock {
        cols: usize,
        format: String,
        block: usize,
    },
    /// The activation or output slice does not match `n` and the weight shape.
    #[error("{what} has {actual} elements, expected {expected} ({n} tokens x {per_token})")]
    ActivationLen {
        what: &'static str,
        n: usize,
        per_token: usize,
        expected: usize,
        actual: usize,
    },
    /// A backend's own library failed (MLX's message).
    #[error("{0}")]
    Backend(String),
    /// A row index (a token id into an embedding table) past the table.
    #[error("token id {id} is out of range for a vocabulary of {rows}")]
    RowOutOfRange { id: u32, rows: usize },
    /// A part of a table (an embedding stored in row parts) that does not fit it.
    #[error(
        "a table part of {rows}x{cols} from row {first} does not fit a table of \
         {table_rows}x{table_cols}"
    )]
    TablePart {
        first: usize,
        rows: usize,
        cols: usize,
        table_rows: usize,
        table_cols: usize,
    },
    /// A spilled KV page whose copy on disk cannot be used (it fails its checksum,
    /// or cannot be read): its positions are lost and must be recomputed.
    #[error("KV page {page} of layer {layer} is lost: {why}")]
    KvPageLost {
        layer: usize,
        page: usize,
        why: String,
    },
    /// A KV cache that cannot take more positions.
    #[error("context full: {cached} positions cached + {new} new exceed the limit of {limit}")]
    ContextFull {
        cached: usize,
        new: usize,
        limit: usize,
    },
}

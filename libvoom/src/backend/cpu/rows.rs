//! The CPU backend's activations: `rows × cols` f32 values, row-major, on the heap.

/// Activations of the CPU backend.
#[derive(Debug, Clone, PartialEq)]
pub struct Rows {
    data: Vec<f32>,
    rows: usize,
    cols: usize,
}

impl Rows {
    /// `rows × cols` zeros.
    pub fn zeros(rows: usize, cols: usize) -> Self {
        Rows {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        }
    }

    /// `data` as `rows × cols`; `None` when the length does not match.
    pub fn from_vec(rows: usize, cols: usize, data: Vec<f32>) -> Option<Self> {
        (rows.checked_mul(cols) == Some(data.len())).then_some(Rows { data, rows, cols })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }

    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data
    }

    pub fn into_vec(self) -> Vec<f32> {
        self.data
    }
}

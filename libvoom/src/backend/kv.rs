//! The KV cache: per layer, the rotated keys and the values of every position so far,
//! in f32, laid out `[position][kv_head][head_dim]`.
//!
//! Memory grows with the positions computed, never with the capacity: a capacity is a
//! bound (the context limit, at most `max_position_embeddings`), so a config's context
//! length sizes no allocation. The layer count and width come from a config checked
//! against the checkpoint (`model::llama::Llama::load`).

use super::KernelError;

pub struct KvCache {
    /// Floats per position per layer (`kv_heads * head_dim`).
    width: usize,
    capacity: usize,
    len: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    /// An empty cache for `layers` layers of `width` floats per position, holding at most
    /// `capacity` positions. Allocates `layers` empty lists, nothing per position.
    pub fn new(layers: usize, width: usize, capacity: usize) -> Self {
        KvCache {
            width,
            capacity,
            len: 0,
            k: vec![Vec::new(); layers],
            v: vec![Vec::new(); layers],
        }
    }

    /// Positions stored (in every layer once a forward pass completes).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Floats per position per layer (`kv_heads * head_dim`).
    pub fn width(&self) -> usize {
        self.width
    }

    /// Layers it holds.
    pub fn layers(&self) -> usize {
        self.k.len()
    }

    /// Bytes held by keys and values.
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|x| x.len() * 4).sum()
    }

    /// Positions `layer` holds: the committed ones and those appended since.
    pub fn layer_len(&self, layer: usize) -> usize {
        self.k[layer].len() / self.width.max(1)
    }

    /// Appends `n` positions of keys and values to `layer`, after those it holds
    /// ([`KvCache::layer_len`]): a pass computing its positions in chunks appends
    /// each chunk in turn.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), KernelError> {
        let n = k.len() / self.width;
        let held = self.layer_len(layer);
        if held + n > self.capacity {
            return Err(KernelError::ContextFull {
                cached: held,
                new: n,
                limit: self.capacity,
            });
        }
        debug_assert!(held >= self.len);
        self.k[layer].extend_from_slice(k);
        self.v[layer].extend_from_slice(v);
        Ok(())
    }

    /// Marks `n` appended positions as committed (after every layer appended them).
    pub fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Keys and values of `layer`, including positions appended but not yet committed.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.k[layer], &self.v[layer])
    }

    /// Drops positions from `len` on (to reuse a prompt prefix).
    pub fn truncate(&mut self, len: usize) {
        let len = len.min(self.len);
        for x in self.k.iter_mut().chain(self.v.iter_mut()) {
            x.truncate(len * self.width);
        }
        self.len = len;
    }

    pub fn clear(&mut self) {
        self.truncate(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_reserves_nothing_for_its_capacity() {
        // Issue 8: a context of 2^24 positions must cost nothing until it is used.
        let mut kv = KvCache::new(2, 4, 1 << 24);
        assert_eq!((kv.capacity(), kv.bytes()), (1 << 24, 0));
        kv.append(0, &[1.0; 8], &[2.0; 8]).unwrap();
        kv.append(1, &[1.0; 8], &[2.0; 8]).unwrap();
        kv.commit(2);
        assert_eq!((kv.len(), kv.bytes()), (2, 2 * 2 * 8 * 4));
    }

    #[test]
    fn appending_past_the_capacity_is_an_error() {
        let mut kv = KvCache::new(1, 2, 2);
        let e = kv.append(0, &[0.0; 6], &[0.0; 6]).unwrap_err();
        assert!(e.to_string().contains("limit of 2"), "{e}");
        assert_eq!(kv.bytes(), 0);
    }
}

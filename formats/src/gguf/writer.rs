//! A GGUF v3 writer, to build test files and fixtures in memory.

use super::reader::{GgufArray, GgufValue};
use super::{GgmlType, DEFAULT_ALIGNMENT, GGUF_MAGIC};

/// Builds a GGUF v3 file in memory: metadata in insertion order, tensors laid out in
/// insertion order at `general.alignment` (default 32) boundaries.
///
/// The writer trusts its caller (it is for tests and fixtures): tensor byte lengths
/// are not checked against dims and type, so it can also build malformed files.
#[derive(Debug, Default, Clone)]
pub struct GgufWriter {
    kvs: Vec<(String, GgufValue)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata entry.
    pub fn add_kv(&mut self, key: &str, value: GgufValue) -> &mut Self {
        self.kvs.push((key.to_string(), value));
        self
    }

    /// Adds a tensor with ggml dims (ne0 first) and its raw bytes.
    pub fn add_tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        bytes: &[u8],
    ) -> &mut Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, bytes.to_vec()));
        self
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let alignment = self
            .kvs
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| match v {
                GgufValue::U32(a) if a.is_power_of_two() => Some(u64::from(*a)),
                _ => None,
            })
            .unwrap_or(DEFAULT_ALIGNMENT) as usize;
        let mut b = GGUF_MAGIC.to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut b, k);
            b.extend(v.value_type().id().to_le_bytes());
            put_value(&mut b, v);
        }
        let mut offset = 0usize;
        for (name, dims, ty, bytes) in &self.tensors {
            put_str(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.id().to_le_bytes());
            b.extend((offset as u64).to_le_bytes());
            offset = (offset + bytes.len()).next_multiple_of(alignment);
        }
        b.resize(b.len().next_multiple_of(alignment), 0);
        for (_, _, _, bytes) in &self.tensors {
            b.extend(bytes);
            b.resize(b.len().next_multiple_of(alignment), 0);
        }
        b
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

fn put_value(b: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => b.push(*x),
        GgufValue::I8(x) => b.extend(x.to_le_bytes()),
        GgufValue::U16(x) => b.extend(x.to_le_bytes()),
        GgufValue::I16(x) => b.extend(x.to_le_bytes()),
        GgufValue::U32(x) => b.extend(x.to_le_bytes()),
        GgufValue::I32(x) => b.extend(x.to_le_bytes()),
        GgufValue::F32(x) => b.extend(x.to_le_bytes()),
        GgufValue::Bool(x) => b.push(u8::from(*x)),
        GgufValue::String(s) => put_str(b, s),
        GgufValue::Array(a) => put_array(b, a),
        GgufValue::U64(x) => b.extend(x.to_le_bytes()),
        GgufValue::I64(x) => b.extend(x.to_le_bytes()),
        GgufValue::F64(x) => b.extend(x.to_le_bytes()),
    }
}

fn put_array(b: &mut Vec<u8>, a: &GgufArray) {
    b.extend(a.elem_type().id().to_le_bytes());
    b.extend((a.len() as u64).to_le_bytes());
    match a {
        GgufArray::U8(v) => b.extend(v),
        GgufArray::I8(v) => v.iter().for_each(|x| b.extend(x.to_le_bytes())),
        GgufArray::U16(v) => v.iter().for_each(|x| b.extend(x.to_le_bytes())),
        GgufArray::I16(v) => v.iter().for_each(|x| b.extend(x.to_le_bytes())),
        GgufArray::U32(v) => v.iter().for_each(|x| b.extend(x.to_le_bytes())),
        GgufArray::I32(v) => v.iter().for_each(|x| b.extend(x.to_le_bytes())),
        GgufArray::F32(v) => v.iter().for_each(|x| b.extend(x.to_le_bytes())),
        GgufArray::Bool(v) => v.iter().for_each(|x| b.push(u8::from(*x))),
        GgufArray::String(v) => v.iter().for_each(|s| put_str(b, s)),
        GgufArray::Array(v) => v.iter().for_each(|a| put_array(b, a)),
        GgufArray::U64(v) => v.iter().for_each(|x| b.extend(x.to_le_bytes())),
        GgufArray::I64(v) => v.iter().for_each(|x| b.extend(x.to_le_bytes())),
        GgufArray::F64(v) => v.iter().for_each(|x| b.extend(x.to_le_bytes())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    #[test]
    fn honours_custom_alignment() {
        let mut w = GgufWriter::new();
        w.add_kv("general.alignment", GgufValue::U32(64));
        w.add_tensor("a", &[3], GgmlType::F32, &[0; 12]);
        w.add_tensor("b", &[1], GgmlType::F32, &1.0f32.to_le_bytes());
        let f = GgufFile::from_bytes("a.gguf", w.to_bytes()).unwrap();
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.data_start() % 64, 0);
        assert_eq!(f.tensor("b").unwrap().offset(), 64);
        assert_eq!(f.dequantize_tensor(f.tensor("b").unwrap()).unwrap(), [1.0]);
    }
}

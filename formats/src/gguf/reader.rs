//! Parsing and validation of a whole GGUF file.

use std::collections::HashMap;
use std::ops::Deref;
use std::path::{Path, PathBuf};

use super::dequant::dequantize;
use super::{GgmlType, DEFAULT_ALIGNMENT, GGUF_MAGIC};
use crate::error::{FormatError, Result};
use crate::mapguard::GuardedMap;

/// Most dimensions a ggml tensor has (`GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// Deepest nesting of arrays accepted. Real files nest at most one level; the bound
/// keeps a crafted file from exhausting the stack.
const MAX_ARRAY_DEPTH: usize = 4;

/// The type tag of a metadata value, as stored in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl GgufValueType {
    /// The type with this numeric tag, `None` for an unknown tag.
    pub fn from_id(id: u32) -> Option<GgufValueType> {
        use GgufValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The numeric tag.
    pub fn id(self) -> u32 {
        use GgufValueType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }

    /// Fewest bytes one value of this type takes in the file: bounds the number of
    /// elements an array can claim before anything is allocated for them.
    fn min_encoded_len(self) -> u64 {
        use GgufValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            // element type tag + count
            Array => 12,
        }
    }
}

/// An array value: one vector per element type, so memory stays proportional to the
/// bytes in the file.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufArray {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }

    /// True when the array has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements' type.
    pub fn elem_type(&self) -> GgufValueType {
        match self {
            GgufArray::U8(_) => GgufValueType::U8,
            GgufArray::I8(_) => GgufValueType::I8,
            GgufArray::U16(_) => GgufValueType::U16,
            GgufArray::I16(_) => GgufValueType::I16,
            GgufArray::U32(_) => GgufValueType::U32,
            GgufArray::I32(_) => GgufValueType::I32,
            GgufArray::F32(_) => GgufValueType::F32,
            GgufArray::Bool(_) => GgufValueType::Bool,
            GgufArray::String(_) => GgufValueType::String,
            GgufArray::Array(_) => GgufValueType::Array,
            GgufArray::U64(_) => GgufValueType::U64,
            GgufArray::I64(_) => GgufValueType::I64,
            GgufArray::F64(_) => GgufValueType::F64,
        }
    }

    /// The elements as i64 when the array holds integers (any width) that all fit.
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        fn conv<T: Copy + TryInto<i64>>(v: &[T]) -> Option<Vec<i64>> {
            v.iter().map(|&x| x.try_into().ok()).collect()
        }
        match self {
            GgufArray::U8(v) => conv(v),
            GgufArray::I8(v) => conv(v),
            GgufArray::U16(v) => conv(v),
            GgufArray::I16(v) => conv(v),
            GgufArray::U32(v) => conv(v),
            GgufArray::I32(v) => conv(v),
            GgufArray::U64(v) => conv(v),
            GgufArray::I64(v) => conv(v),
            _ => None,
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The value's type tag.
    pub fn value_type(&self) -> GgufValueType {
        match self {
            GgufValue::U8(_) => GgufValueType::U8,
            GgufValue::I8(_) => GgufValueType::I8,
            GgufValue::U16(_) => GgufValueType::U16,
            GgufValue::I16(_) => GgufValueType::I16,
            GgufValue::U32(_) => GgufValueType::U32,
            GgufValue::I32(_) => GgufValueType::I32,
            GgufValue::F32(_) => GgufValueType::F32,
            GgufValue::Bool(_) => GgufValueType::Bool,
            GgufValue::String(_) => GgufValueType::String,
            GgufValue::Array(_) => GgufValueType::Array,
            GgufValue::U64(_) => GgufValueType::U64,
            GgufValue::I64(_) => GgufValueType::I64,
            GgufValue::F64(_) => GgufValueType::F64,
        }
    }

    /// An integer of any width, as i128 (holds every u64 and i64 exactly).
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(x) => x.into(),
            GgufValue::I8(x) => x.into(),
            GgufValue::U16(x) => x.into(),
            GgufValue::I16(x) => x.into(),
            GgufValue::U32(x) => x.into(),
            GgufValue::I32(x) => x.into(),
            GgufValue::U64(x) => x.into(),
            GgufValue::I64(x) => x.into(),
            _ => return None,
        })
    }

    /// A float value: F32, or F64 when it converts to f32 exactly.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            GgufValue::F32(x) => Some(x),
            GgufValue::F64(x) if (x as f32) as f64 == x => Some(x as f32),
            _ => None,
        }
    }

    /// A bool value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// An array value.
    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's entry: name, shape, type and where its bytes are. Only [`GgufFile`]
/// makes these, after checking the bytes lie inside the file.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    offset: u64,
    n_elements: u64,
    n_bytes: u64,
}

impl GgufTensorInfo {
    /// The tensor's name (`"blk.0.attn_q.weight"`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// ggml's dims: `dims()[0]` (ne0) varies fastest. Torch's shape is the reverse.
    pub fn dims(&self) -> &[u64] {
        &self.dims
    }

    /// The shape as PyTorch/safetensors write it (slowest-varying first).
    pub fn torch_shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    /// Element type.
    pub fn ggml_type(&self) -> GgmlType {
        self.ggml_type
    }

    /// Offset of the bytes from the start of the data section.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Number of elements (product of dims; 1 for a tensor with no dims).
    pub fn n_elements(&self) -> u64 {
        self.n_elements
    }

    /// Number of bytes in the data section.
    pub fn n_bytes(&self) -> u64 {
        self.n_bytes
    }
}

enum Bytes {
    Mapped(GuardedMap),
    Owned(Vec<u8>),
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A validated GGUF file: metadata parsed into memory, tensor data left in the
/// (read-only) mapping.
pub struct GgufFile {
    path: PathBuf,
    bytes: Bytes,
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .finish()
    }
}

impl GgufFile {
    /// Opens and validates a GGUF file, memory mapping it read-only.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = crate::file::open(path).map_err(|e| FormatError::io(path, e))?;
        let len = file.metadata().map_err(|e| FormatError::io(path, e))?.len();
        let bytes = if len == 0 {
            // mmap of an empty file fails on some platforms; parse reports truncation.
            Bytes::Owned(Vec::new())
        } else {
            // Reads are bounds-checked against the length captured at map time; a file
            // truncated while mapped reads as zeros past its new end, reported by
            // check_faults (below, and after every use of the bytes).
            Bytes::Mapped(GuardedMap::map(&file, path)?)
        };
        Self::parse(path.to_path_buf(), bytes)
    }

    /// Parses a GGUF held in memory; `path` only names it in errors.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile> {
        Self::parse(path.into(), Bytes::Owned(bytes))
    }

    fn parse(path: PathBuf, bytes: Bytes) -> Result<GgufFile> {
        let parsed = Parser::new(&path, &bytes).parse();
        if let Bytes::Mapped(m) = &bytes {
            // A fault while parsing: the parser saw zeros, whatever it concluded.
            m.check()?;
        }
        let parsed = parsed?;
        Ok(GgufFile {
            path,
            bytes,
            version: parsed.version,
            metadata: parsed.metadata,
            metadata_index: parsed.metadata_index,
            tensors: parsed.tensors,
            tensor_index: parsed.tensor_index,
            alignment: parsed.alignment,
            data_start: parsed.data_start,
        })
    }

    /// The file's path (as given to `open`).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Offset of the data section in the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// Every metadata key/value, in file order.
    pub fn metadata_entries(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// One metadata value.
    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Every tensor info, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// One tensor's info by name.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The error for a required key that is absent.
    pub fn missing_key(&self, key: &str) -> FormatError {
        FormatError::Missing {
            path: self.path.clone(),
            what: format!("GGUF metadata key '{key}'"),
        }
    }

    fn wrong_type(&self, key: &str, want: &str, got: &GgufValue) -> FormatError {
        FormatError::Malformed {
            path: self.path.clone(),
            what: "GGUF metadata",
            detail: format!(
                "key '{key}': expected {want}, found a {:?} value",
                got.value_type()
            ),
        }
    }

    /// An integer key that must fit `T`; `Ok(None)` when absent, an error when it has
    /// another type or is out of range.
    fn get_int<T: TryFrom<i128>>(&self, key: &str, want: &str) -> Result<Option<T>> {
        let Some(v) = self.metadata(key) else {
            return Ok(None);
        };
        match v.as_integer() {
            Some(x) => T::try_from(x)
                .map(Some)
                .map_err(|_| FormatError::Malformed {
                    path: self.path.clone(),
                    what: "GGUF metadata",
                    detail: format!("key '{key}': value {x} does not fit {want}"),
                }),
            None => Err(self.wrong_type(key, want, v)),
        }
    }

    /// An unsigned integer key (any integer type whose value fits a u32).
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        self.get_int(key, "an integer in u32 range")
    }

    /// An unsigned integer key (any integer type whose value fits a u64).
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get_int(key, "an integer in u64 range")
    }

    /// A signed integer key (any integer type whose value fits an i64).
    pub fn get_i64(&self, key: &str) -> Result<Option<i64>> {
        self.get_int(key, "an integer in i64 range")
    }

    /// A float key (F32, or F64 exactly representable as f32).
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.metadata(key) {
            None => Ok(None),
            Some(v) => v
                .as_f32()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "an f32", v)),
        }
    }

    /// A bool key.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.metadata(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a bool", v)),
        }
    }

    /// A string key.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.metadata(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a string", v)),
        }
    }

    /// An array-of-strings key.
    pub fn get_str_array(&self, key: &str) -> Result<Option<&[String]>> {
        match self.metadata(key) {
            None => Ok(None),
            Some(GgufValue::Array(GgufArray::String(v))) => Ok(Some(v)),
            Some(v) => Err(self.wrong_type(key, "an array of strings", v)),
        }
    }

    /// An array-of-integers key (any integer width), as i64.
    pub fn get_int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        match self.metadata(key) {
            None => Ok(None),
            Some(v) => v
                .as_array()
                .and_then(GgufArray::to_i64_vec)
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "an array of integers", v)),
        }
    }

    /// `Ok` while no read of the file's mapping has faulted; else
    /// [`FormatError::Fault`] naming the file and the offset of the first faulting read
    /// (the file was truncated while mapped). Call it after using bytes from
    /// [`GgufFile::tensor_bytes`]; on `Err`, discard what was computed from them.
    /// [`GgufFile::dequantize_tensor`] checks by itself.
    pub fn check_faults(&self) -> Result<()> {
        match &self.bytes {
            Bytes::Mapped(m) => m.check(),
            Bytes::Owned(_) => Ok(()),
        }
    }

    /// The bytes of a tensor of this file, in place in the mapping. If the file is
    /// truncated while mapped they may read as zeros: see [`GgufFile::check_faults`].
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> Result<&[u8]> {
        let range = self
            .data_start
            .checked_add(info.offset)
            .and_then(|s| Some(s..s.checked_add(info.n_bytes)?))
            .and_then(|r| Some(usize::try_from(r.start).ok()?..usize::try_from(r.end).ok()?));
        range
            .and_then(|r| self.bytes.get(r))
            .ok_or_else(|| FormatError::BadTensor {
                path: self.path.clone(),
                tensor: info.name.clone(),
                detail: "tensor info does not describe bytes of this file".into(),
            })
    }

    /// A tensor dequantized to f32 (see [`dequantize`]), in ggml element order.
    pub fn dequantize_tensor(&self, info: &GgufTensorInfo) -> Result<Vec<f32>> {
        let bytes = self.tensor_bytes(info)?;
        let n = usize::try_from(info.n_elements).map_err(|_| FormatError::BadTensor {
            path: self.path.clone(),
            tensor: info.name.clone(),
            detail: "too many elements for this platform".into(),
        })?;
        let values = dequantize(info.ggml_type, bytes, n);
        // Values computed from a faulted read are discarded, whatever they are.
        self.check_faults()?;
        values.map_err(|e| match e {
            super::DequantError::Unsupported(t) => FormatError::Unsupported {
                path: self.path.clone(),
                what: format!("tensor '{}': dequantization of ggml type {t}", info.name),
            },
            other => FormatError::BadTensor {
                path: self.path.clone(),
                tensor: info.name.clone(),
                detail: other.to_string(),
            },
        })
    }
}

struct Parsed {
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_start: u64,
}

/// A bounds-checked little-endian cursor over the file.
struct Parser<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Parser<'a> {
    fn new(path: &'a Path, buf: &'a [u8]) -> Self {
        Parser { path, buf, pos: 0 }
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn malformed(&self, what: &'static str, detail: String) -> FormatError {
        FormatError::Malformed {
            path: self.path.to_path_buf(),
            what,
            detail,
        }
    }

    /// `n` bytes, or a truncation error saying what was being read (`ctx`).
    fn take(&mut self, n: u64, what: &'static str, ctx: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.malformed(
                what,
                format!(
                    "{}: file truncated at byte {} (needs {n} more bytes, {} left)",
                    ctx(),
                    self.pos,
                    self.remaining()
                ),
            ));
        }
        // n <= remaining, which fits usize.
        let n = n as usize;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(
        &mut self,
        what: &'static str,
        ctx: &dyn Fn() -> String,
    ) -> Result<[u8; N]> {
        let s = self.take(N as u64, what, ctx)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &'static str, ctx: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what, ctx)?))
    }

    fn u64(&mut self, what: &'static str, ctx: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what, ctx)?))
    }

    fn string(&mut self, what: &'static str, ctx: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(what, ctx)?;
        let bytes = self.take(len, what, ctx)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.malformed(
                what,
                format!("{}: string of {len} bytes is not UTF-8 ({e})", ctx()),
            )),
        }
    }

    /// Reads `count` elements of fixed size `N`, after checking they fit in the file.
    fn numbers<T, const N: usize>(
        &mut self,
        count: u64,
        ctx: &dyn Fn() -> String,
        conv: fn([u8; N]) -> T,
    ) -> Result<Vec<T>> {
        let bytes = count
            .checked_mul(N as u64)
            .filter(|&b| b <= self.remaining())
            .ok_or_else(|| {
                self.malformed(
                    "GGUF metadata",
                    format!(
                        "{}: array of {count} elements does not fit in the {} bytes left",
                        ctx(),
                        self.remaining()
                    ),
                )
            })?;
        let raw = self.take(bytes, "GGUF metadata", ctx)?;
        Ok(raw
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                conv(a)
            })
            .collect())
    }

    fn bool_byte(&self, b: u8, ctx: &dyn Fn() -> String) -> Result<bool> {
        match b {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(self.malformed(
                "GGUF metadata",
                format!("{}: bool byte {other:#04x} is neither 0 nor 1", ctx()),
            )),
        }
    }

    fn value_type(&mut self, ctx: &dyn Fn() -> String) -> Result<GgufValueType> {
        let id = self.u32("GGUF metadata", ctx)?;
        GgufValueType::from_id(id).ok_or_else(|| {
            self.malformed(
                "GGUF metadata",
                format!("{}: unknown value type {id}", ctx()),
            )
        })
    }

    fn value(&mut self, ty: GgufValueType, ctx: &dyn Fn() -> String) -> Result<GgufValue> {
        const W: &str = "GGUF metadata";
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(self.array::<1>(W, ctx)?[0]),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(W, ctx)?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(W, ctx)?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(W, ctx)?)),
            GgufValueType::U32 => GgufValue::U32(u32::from_le_bytes(self.array(W, ctx)?)),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(W, ctx)?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(W, ctx)?)),
            GgufValueType::U64 => GgufValue::U64(u64::from_le_bytes(self.array(W, ctx)?)),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(W, ctx)?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(W, ctx)?)),
            GgufValueType::Bool => {
                let b = self.array::<1>(W, ctx)?[0];
                GgufValue::Bool(self.bool_byte(b, ctx)?)
            }
            GgufValueType::String => GgufValue::String(self.string(W, ctx)?),
            GgufValueType::Array => GgufValue::Array(self.array_value(0, ctx)?),
        })
    }

    fn array_value(&mut self, depth: usize, ctx: &dyn Fn() -> String) -> Result<GgufArray> {
        const W: &str = "GGUF metadata";
        let elem = self.value_type(ctx)?;
        let count = self.u64(W, ctx)?;
        // Every element takes at least `min_encoded_len` bytes, so a count the rest of
        // the file cannot hold is rejected before anything is allocated for it.
        if count > self.remaining() / elem.min_encoded_len() {
            return Err(self.malformed(
                W,
                format!(
                    "{}: array of {count} {elem:?} elements does not fit in the {} bytes left",
                    ctx(),
                    self.remaining()
                ),
            ));
        }
        let n = count as usize; // bounded by the file length above
        Ok(match elem {
            GgufValueType::U8 => GgufArray::U8(self.numbers(count, ctx, |a: [u8; 1]| a[0])?),
            GgufValueType::I8 => GgufArray::I8(self.numbers(count, ctx, i8::from_le_bytes)?),
            GgufValueType::U16 => GgufArray::U16(self.numbers(count, ctx, u16::from_le_bytes)?),
            GgufValueType::I16 => GgufArray::I16(self.numbers(count, ctx, i16::from_le_bytes)?),
            GgufValueType::U32 => GgufArray::U32(self.numbers(count, ctx, u32::from_le_bytes)?),
            GgufValueType::I32 => GgufArray::I32(self.numbers(count, ctx, i32::from_le_bytes)?),
            GgufValueType::F32 => GgufArray::F32(self.numbers(count, ctx, f32::from_le_bytes)?),
            GgufValueType::U64 => GgufArray::U64(self.numbers(count, ctx, u64::from_le_bytes)?),
            GgufValueType::I64 => GgufArray::I64(self.numbers(count, ctx, i64::from_le_bytes)?),
            GgufValueType::F64 => GgufArray::F64(self.numbers(count, ctx, f64::from_le_bytes)?),
            GgufValueType::Bool => {
                let raw = self.numbers(count, ctx, |a: [u8; 1]| a[0])?;
                let mut v = Vec::with_capacity(n);
                for (i, b) in raw.into_iter().enumerate() {
                    v.push(self.bool_byte(b, &|| format!("{}[{i}]", ctx()))?);
                }
                GgufArray::Bool(v)
            }
            GgufValueType::String => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.string(W, &|| format!("{}[{i}]", ctx()))?);
                }
                GgufArray::String(v)
            }
            GgufValueType::Array => {
                if depth + 1 >= MAX_ARRAY_DEPTH {
                    return Err(self.malformed(
                        W,
                        format!("{}: arrays nested deeper than {MAX_ARRAY_DEPTH}", ctx()),
                    ));
                }
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.array_value(depth + 1, &|| format!("{}[{i}]", ctx()))?);
                }
                GgufArray::Array(v)
            }
        })
    }

    fn parse(mut self) -> Result<Parsed> {
        const H: &str = "GGUF header";
        let header = || "header".to_string();
        let magic = self.array::<4>(H, &header)?;
        if magic != GGUF_MAGIC {
            return Err(self.malformed(
                H,
                format!("not a GGUF file: magic is {magic:02x?}, expected \"GGUF\""),
            ));
        }
        let version = self.u32(H, &header)?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(FormatError::Unsupported {
                    path: self.path.to_path_buf(),
                    what: "GGUF version 1 (32-bit counts); re-convert the model".into(),
                })
            }
            v if matches!(v.swap_bytes(), 2 | 3) => {
                return Err(FormatError::Unsupported {
                    path: self.path.to_path_buf(),
                    what: "big-endian GGUF".into(),
                })
            }
            v => return Err(self.malformed(H, format!("unknown GGUF version {v}"))),
        }
        let n_tensors = self.u64(H, &header)?;
        let n_kv = self.u64(H, &header)?;

        // Smallest key/value: 8-byte key length, 4-byte type, 1-byte value.
        if n_kv > self.remaining() / 13 {
            return Err(self.malformed(
                H,
                format!(
                    "{n_kv} metadata entries cannot fit in the {} bytes left",
                    self.remaining()
                ),
            ));
        }
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut metadata_index = HashMap::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let key = self.string("GGUF metadata", &|| format!("key of entry #{i}"))?;
            let ctx = || format!("key '{key}'");
            let ty = self.value_type(&ctx)?;
            let value = self.value(ty, &ctx)?;
            if metadata_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(self.malformed(
                    "GGUF metadata",
                    format!("key '{key}' appears more than once"),
                ));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata_index
            .get("general.alignment")
            .map(|&i| &metadata[i].1)
        {
            None => DEFAULT_ALIGNMENT,
            Some(GgufValue::U32(a)) if a.is_power_of_two() => u64::from(*a),
            Some(v) => {
                return Err(self.malformed(
                    "GGUF metadata",
                    format!("key 'general.alignment': {v:?} is not a u32 power of two"),
                ))
            }
        };

        // Smallest tensor info: name length, n_dims, type, offset.
        if n_tensors > self.remaining() / 24 {
            return Err(self.malformed(
                H,
                format!(
                    "{n_tensors} tensor infos cannot fit in the {} bytes left",
                    self.remaining()
                ),
            ));
        }
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let info = self.tensor_info(i)?;
            if tensor_index
                .insert(info.name.clone(), tensors.len())
                .is_some()
            {
                return Err(FormatError::BadTensor {
                    path: self.path.to_path_buf(),
                    tensor: info.name,
                    detail: "name appears more than once".into(),
                });
            }
            tensors.push(info);
        }

        let file_len = self.buf.len() as u64;
        let data_start = (self.pos as u64)
            .checked_next_multiple_of(alignment)
            .filter(|&s| s <= file_len || tensors.is_empty())
            .ok_or_else(|| {
                self.malformed(H, "file truncated before its data section".to_string())
            })?;
        for t in &tensors {
            let bad = |detail: String| FormatError::BadTensor {
                path: self.path.to_path_buf(),
                tensor: t.name.clone(),
                detail,
            };
            if t.offset % alignment != 0 {
                return Err(bad(format!(
                    "data offset {} is not a multiple of the alignment {alignment}",
                    t.offset
                )));
            }
            let end = data_start
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.n_bytes));
            match end {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(bad(format!(
                        "data at offset {} ({} bytes) extends beyond the end of the file ({file_len} bytes, data section at {data_start})",
                        t.offset, t.n_bytes
                    )))
                }
            }
        }

        Ok(Parsed {
            version,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
            alignment,
            data_start,
        })
    }

    fn tensor_info(&mut self, i: u64) -> Result<GgufTensorInfo> {
        const T: &str = "GGUF tensor info";
        let name = self.string(T, &|| format!("name of tensor #{i}"))?;
        let ctx = || format!("tensor '{name}'");
        let bad = |detail: String| FormatError::BadTensor {
            path: self.path.to_path_buf(),
            tensor: name.clone(),
            detail,
        };
        let n_dims = self.u32(T, &ctx)?;
        if n_dims > MAX_DIMS {
            return Err(bad(format!(
                "{n_dims} dims, ggml allows at most {MAX_DIMS}"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64(T, &ctx)?);
        }
        let type_id = self.u32(T, &ctx)?;
        let offset = self.u64(T, &ctx)?;
        let Some(ggml_type) = GgmlType::from_id(type_id) else {
            return Err(FormatError::Unsupported {
                path: self.path.to_path_buf(),
                what: format!("tensor '{name}': unknown ggml type id {type_id}"),
            });
        };
        // ggml keeps counts in i64.
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| bad(format!("dims {dims:?} overflow the element count")))?;
        if let Some(&ne0) = dims.first() {
            if ne0 % ggml_type.block_size() != 0 {
                return Err(bad(format!(
                    "first dim {ne0} is not a multiple of the {ggml_type} block size {}",
                    ggml_type.block_size()
                )));
            }
        }
        let n_bytes = ggml_type.bytes_for(n_elements).ok_or_else(|| {
            bad(format!(
                "{n_elements} elements of {ggml_type} do not make whole blocks or overflow"
            ))
        })?;
        Ok(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            n_elements,
            n_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufWriter;
    use proptest::prelude::*;

    fn sample() -> Vec<u8> {
        let mut w = GgufWriter::new();
        w.add_kv("general.architecture", GgufValue::String("llama".into()));
        w.add_kv("llama.block_count", GgufValue::U32(2));
        w.add_kv("llama.rope.freq_base", GgufValue::F32(10000.0));
        w.add_kv("flag", GgufValue::Bool(true));
        w.add_kv(
            "tokenizer.ggml.tokens",
            GgufValue::Array(GgufArray::String(vec!["a".into(), "é".into()])),
        );
        w.add_kv(
            "tokenizer.ggml.token_type",
            GgufValue::Array(GgufArray::I32(vec![1, 3])),
        );
        w.add_kv(
            "nested",
            GgufValue::Array(GgufArray::Array(vec![
                GgufArray::U8(vec![1, 2]),
                GgufArray::F64(vec![0.5]),
            ])),
        );
        let f32s: Vec<u8> = [1.0f32, -2.0, 3.5]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        w.add_tensor("t.f32", &[3], GgmlType::F32, &f32s);
        let q8 = [vec![0x00, 0x3c], vec![1u8; 32]].concat(); // d = 1.0, q = 1
        w.add_tensor("t.q8", &[32, 1], GgmlType::Q8_0, &q8);
        w.to_bytes()
    }

    #[test]
    fn reads_what_the_writer_wrote() {
        let f = GgufFile::from_bytes("mem.gguf", sample()).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), 32);
        assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
        assert_eq!(f.get_u32("llama.block_count").unwrap(), Some(2));
        assert_eq!(f.get_u64("llama.block_count").unwrap(), Some(2));
        assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), Some(10000.0));
        assert_eq!(f.get_bool("flag").unwrap(), Some(true));
        assert_eq!(f.get_u32("absent").unwrap(), None);
        let toks = f.get_str_array("tokenizer.ggml.tokens").unwrap().unwrap();
        assert_eq!(toks, ["a", "é"]);
        assert_eq!(
            f.get_int_array("tokenizer.ggml.token_type").unwrap(),
            Some(vec![1, 3])
        );
        let nested = f.metadata("nested").unwrap().as_array().unwrap();
        assert_eq!(nested.len(), 2);
        assert_eq!(nested.elem_type(), GgufValueType::Array);
        // Wrong type is an error naming the key, not a None.
        let e = f.get_u32("general.architecture").unwrap_err().to_string();
        assert!(
            e.contains("mem.gguf") && e.contains("general.architecture"),
            "{e}"
        );

        let t = f.tensor("t.f32").unwrap();
        assert_eq!(t.dims(), [3]);
        assert_eq!(f.dequantize_tensor(t).unwrap(), [1.0, -2.0, 3.5]);
        let q = f.tensor("t.q8").unwrap();
        assert_eq!(q.torch_shape(), [1, 32]);
        assert_eq!(q.n_bytes(), 34);
        assert_eq!(f.dequantize_tensor(q).unwrap(), vec![1.0; 32]);
        assert_eq!(f.tensor_bytes(q).unwrap().len(), 34);
    }

    #[test]
    fn open_maps_a_real_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        std::fs::write(&p, sample()).unwrap();
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.tensors().len(), 2);
        std::fs::write(&p, b"").unwrap();
        let e = GgufFile::open(&p).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
    }

    /// Defect 4 on the GGUF path: a file truncated while mapped is an error naming the
    /// file and the offset of the read, never a SIGBUS.
    #[test]
    fn sigbus_a_gguf_truncated_while_open_is_an_error_naming_file_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big.gguf");
        let n = 64 * 1024; // 256 KiB of f32: many pages
        let vals: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let mut w = GgufWriter::new();
        w.add_kv("general.architecture", GgufValue::String("llama".into()));
        w.add_tensor("w", &[n as u64], GgmlType::F32, &vals);
        std::fs::write(&p, w.to_bytes()).unwrap();
        let f = GgufFile::open(&p).unwrap();
        let t = f.tensor("w").unwrap().clone();
        assert_eq!(f.dequantize_tensor(&t).unwrap()[n - 1], (n - 1) as f32);
        f.check_faults().unwrap();
        let start = f.data_start() + t.offset();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(start + 4096)
            .unwrap();
        let e = f.dequantize_tensor(&t).unwrap_err();
        match &e {
            FormatError::Fault { path, offset } => {
                assert_eq!(path, &p);
                assert!(
                    *offset >= start + 4096 && *offset < start + t.n_bytes(),
                    "{e}"
                );
            }
            other => panic!("expected a fault, got {other:?}"),
        }
        assert!(e.to_string().contains("big.gguf"), "{e}");
        // Borrowed bytes: the same report through check_faults.
        let _ = f
            .tensor_bytes(&t)
            .unwrap()
            .iter()
            .map(|&b| b as u64)
            .sum::<u64>();
        assert!(f.check_faults().is_err());
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample();
        let f = GgufFile::from_bytes("whole.gguf", bytes.clone()).unwrap();
        // The writer pads after the last tensor; everything before that padding is needed.
        let needed = f
            .tensors()
            .iter()
            .map(|t| f.data_start() + t.offset() + t.n_bytes())
            .max()
            .unwrap() as usize;
        assert!(needed < bytes.len());
        assert!(GgufFile::from_bytes("exact.gguf", bytes[..needed].to_vec()).is_ok());
        for n in 0..needed {
            let r = GgufFile::from_bytes("cut.gguf", bytes[..n].to_vec());
            assert!(r.is_err(), "truncation to {n} bytes was accepted");
        }
    }

    fn err(bytes: Vec<u8>) -> String {
        GgufFile::from_bytes("bad.gguf", bytes)
            .unwrap_err()
            .to_string()
    }

    fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(n_tensors.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        b
    }

    fn kv(b: &mut Vec<u8>, key: &str, ty: u32) {
        b.extend((key.len() as u64).to_le_bytes());
        b.extend(key.as_bytes());
        b.extend(ty.to_le_bytes());
    }

    #[test]
    fn malformed_inputs_are_named_errors() {
        assert!(err(b"GGUX\x03\0\0\0".to_vec()).contains("not a GGUF"));
        let mut v1 = header(0, 0);
        v1[4] = 1;
        assert!(err(v1).contains("version 1"));
        let mut be = header(0, 0);
        be[4..8].copy_from_slice(&3u32.to_be_bytes());
        assert!(err(be).contains("big-endian"));

        // Absurd counts are rejected before allocating.
        assert!(err(header(0, u64::MAX)).contains("metadata entries cannot fit"));
        assert!(err(header(u64::MAX, 0)).contains("tensor infos cannot fit"));

        // Array count larger than the file.
        let mut b = header(0, 1);
        kv(&mut b, "big", 9);
        b.extend(4u32.to_le_bytes());
        b.extend(u64::MAX.to_le_bytes());
        b.extend([0u8; 16]);
        let e = err(b);
        assert!(e.contains("'big'") && e.contains("does not fit"), "{e}");

        // String length larger than the file.
        let mut b = header(0, 1);
        kv(&mut b, "s", 8);
        b.extend((1u64 << 40).to_le_bytes());
        assert!(err(b).contains("truncated"));

        // Not UTF-8.
        let mut b = header(0, 1);
        kv(&mut b, "s", 8);
        b.extend(2u64.to_le_bytes());
        b.extend([0xff, 0xfe]);
        let e = err(b);
        assert!(e.contains("'s'") && e.contains("UTF-8"), "{e}");

        // Unknown value type.
        let mut b = header(0, 1);
        kv(&mut b, "k", 13);
        b.extend([0u8; 8]);
        let e = err(b);
        assert!(
            e.contains("'k'") && e.contains("unknown value type 13"),
            "{e}"
        );

        // Deeply nested arrays.
        let mut b = header(0, 1);
        kv(&mut b, "deep", 9);
        for _ in 0..64 {
            b.extend(9u32.to_le_bytes());
            b.extend(1u64.to_le_bytes());
        }
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        assert!(err(b).contains("nested deeper"));

        // Duplicate key.
        let mut b = header(0, 2);
        kv(&mut b, "a", 0);
        b.push(1);
        kv(&mut b, "a", 0);
        b.push(2);
        assert!(err(b).contains("more than once"));

        // Bad alignment.
        let mut b = header(0, 1);
        kv(&mut b, "general.alignment", 4);
        b.extend(3u32.to_le_bytes());
        assert!(err(b).contains("general.alignment"));
    }

    fn tensor_file(dims: &[u64], ty: u32, offset: u64, data: usize) -> Vec<u8> {
        let mut b = header(1, 0);
        b.extend(2u64.to_le_bytes());
        b.extend(b"w0");
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        b.resize(b.len().next_multiple_of(32) + data, 0);
        b
    }

    #[test]
    fn bad_tensor_infos_are_named_errors() {
        assert!(GgufFile::from_bytes("ok", tensor_file(&[4, 2], 0, 0, 32)).is_ok());
        let e = err(tensor_file(&[4, 2], 0, 0, 31));
        assert!(e.contains("'w0'") && e.contains("beyond the end"), "{e}");
        let e = err(tensor_file(&[4, 2], 0, u64::MAX - 31, 32));
        assert!(e.contains("'w0'") && e.contains("beyond the end"), "{e}");
        let e = err(tensor_file(&[4, 2], 0, 4, 64));
        assert!(e.contains("alignment"), "{e}");
        let e = err(tensor_file(&[u64::MAX, 2], 0, 0, 32));
        assert!(e.contains("overflow"), "{e}");
        let e = err(tensor_file(&[1 << 62, 1], 0, 0, 32));
        assert!(e.contains("overflow"), "{e}");
        let e = err(tensor_file(&[4, 2], 31, 0, 32));
        assert!(
            e.contains("'w0'") && e.contains("unknown ggml type id 31"),
            "{e}"
        );
        let e = err(tensor_file(&[16, 2], 3, 0, 64));
        assert!(e.contains("block size"), "{e}");
        let e = err(tensor_file(&[1, 1, 1, 1, 1], 0, 0, 32));
        assert!(e.contains("5 dims"), "{e}");
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = GgufFile::from_bytes("random.gguf", bytes);
        }

        #[test]
        fn corrupted_files_never_panic(
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
            cut in any::<prop::sample::Index>(),
        ) {
            let mut bytes = sample();
            for (i, b) in flips {
                let i = i.index(bytes.len());
                bytes[i] = b;
            }
            let n = cut.index(bytes.len() + 1);
            bytes.truncate(n);
            if let Ok(f) = GgufFile::from_bytes("corrupt.gguf", bytes) {
                for t in f.tensors() {
                    let _ = f.dequantize_tensor(t);
                }
            }
        }
    }
}

//! Single-file safetensors checkpoints: a validating header parser, a read-only
//! memory-mapped file, and a deterministic writer.
//!
//! Layout (little-endian; `docs/formats.md` draws it as a byte table):
//!
//! ```text
//! [0, 8)          u64 N: length of the JSON header
//! [8, 8+N)        UTF-8 JSON object: {"__metadata__": {str: str}?, NAME: {"dtype", "shape", "data_offsets"}, ...}
//! [8+N, EOF)      data region; a tensor's bytes are [8+N+begin, 8+N+end)
//! ```
//!
//! Every structural fault is a [`FormatError`] naming the file and, where there is one,
//! the tensor. The parser never indexes past the bytes it was given, so a truncated or
//! corrupted file cannot cause a panic or an out-of-bounds read.

mod write;

pub(crate) use write::write_atomically;
pub use write::{write, write_with};

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

use crate::dtype::DType;
use crate::error::{FormatError, Result};
use crate::mapguard::{FileIdentity, GuardedMap};

/// Largest header vOOM accepts. Real checkpoints with tens of thousands of tensors
/// have headers of a few MiB; a larger length is corruption or an attack.
pub const MAX_HEADER_LEN: u64 = 100 * 1024 * 1024;

/// The reserved header key holding free-form string metadata.
pub const METADATA_KEY: &str = "__metadata__";

const WHAT: &str = "safetensors header";

/// Element types the reference format defines that vOOM does not compute on.
/// They are reported as unsupported rather than unknown.
const KNOWN_UNSUPPORTED_DTYPES: &[&str] = &["F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64"];

/// One tensor's entry in a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Absolute byte offset of the tensor's first byte in the file.
    pub offset: u64,
    /// Length of the tensor's bytes; always `numel() * dtype.size()`.
    pub len: u64,
}

impl TensorInfo {
    /// Number of elements (1 for a scalar, 0 when a dimension is 0).
    ///
    /// Cannot overflow for a `TensorInfo` produced by [`parse_header`], which
    /// rejects shapes whose product overflows.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The byte range of this tensor in its file.
    pub fn range(&self) -> std::ops::Range<u64> {
        self.offset..self.offset + self.len
    }
}

/// A parsed and validated safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Every tensor, sorted by `offset` (ties, only possible between empty tensors,
    /// by name). Ranges of non-empty tensors do not overlap.
    pub tensors: Vec<TensorInfo>,
    /// The `__metadata__` map (empty when absent or `null`).
    pub metadata: BTreeMap<String, String>,
    /// Absolute offset of the data region: `8 + N`.
    pub data_start: u64,
}

/// Reads the 8-byte length prefix and checks it against the file length and the
/// header size limit. Returns `data_start = 8 + N`. Useful to a caller that reads
/// the header with `pread` instead of mapping the file.
pub fn header_end(path: &Path, prefix: &[u8], file_len: u64) -> Result<u64> {
    let malformed = |detail: String| FormatError::Malformed {
        path: path.to_path_buf(),
        what: WHAT,
        detail,
    };
    if file_len < 8 || prefix.len() < 8 {
        return Err(malformed(format!(
            "file is {} bytes, shorter than the 8-byte header length prefix",
            file_len.min(prefix.len() as u64)
        )));
    }
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&prefix[..8]);
    let n = u64::from_le_bytes(len_bytes);
    if n > MAX_HEADER_LEN {
        return Err(malformed(format!(
            "header length {n} exceeds the {MAX_HEADER_LEN}-byte limit"
        )));
    }
    // Cannot overflow: n <= MAX_HEADER_LEN.
    let data_start = 8 + n;
    if data_start > file_len {
        return Err(malformed(format!(
            "header length {n} runs past the end of the {file_len}-byte file"
        )));
    }
    Ok(data_start)
}

/// Parses and validates a header.
///
/// `file` is the full file contents, or at least its first `8 + N` bytes; `file_len`
/// is the file's length, against which tensor offsets are checked. Holes in the data
/// region (bytes no tensor covers) are accepted; overlapping tensors are not.
pub fn parse_header(path: &Path, file: &[u8], file_len: u64) -> Result<Header> {
    let malformed = |detail: String| FormatError::Malformed {
        path: path.to_path_buf(),
        what: WHAT,
        detail,
    };
    let data_start = header_end(path, file, file_len)?;
    if (file.len() as u64) < data_start {
        return Err(malformed(format!(
            "only {} bytes of the {data_start}-byte header were provided",
            file.len()
        )));
    }
    // In bounds: checked just above.
    let json = &file[8..data_start as usize];
    let text = std::str::from_utf8(json).map_err(|e| {
        malformed(format!(
            "header is not valid UTF-8 (at byte {})",
            8 + e.valid_up_to()
        ))
    })?;
    let entries: OrderedEntries = serde_json::from_str(text)
        .map_err(|e| malformed(format!("header is not a valid JSON object: {e}")))?;

    let data_len = file_len - data_start;
    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::with_capacity(entries.0.len());
    for (name, value) in entries.0 {
        if name == METADATA_KEY {
            metadata = parse_metadata(path, value)?;
        } else {
            tensors.push(parse_tensor(path, name, value, data_start, data_len)?);
        }
    }

    tensors.sort_by(|a, b| (a.offset, a.len, &a.name).cmp(&(b.offset, b.len, &b.name)));
    // Sorted by start: a non-empty tensor overlaps an earlier one exactly when it starts
    // before the furthest end seen so far. Empty tensors occupy no bytes.
    let mut furthest: Option<&TensorInfo> = None;
    for t in tensors.iter().filter(|t| t.len > 0) {
        if let Some(prev) = furthest {
            if t.offset < prev.offset + prev.len {
                return Err(FormatError::BadTensor {
                    path: path.to_path_buf(),
                    tensor: t.name.clone(),
                    detail: format!(
                        "data_offsets [{}, {}) overlap tensor '{}' at [{}, {})",
                        t.offset - data_start,
                        t.offset + t.len - data_start,
                        prev.name,
                        prev.offset - data_start,
                        prev.offset + prev.len - data_start
                    ),
                });
            }
        }
        if furthest.is_none_or(|p| t.offset + t.len > p.offset + p.len) {
            furthest = Some(t);
        }
    }

    Ok(Header {
        tensors,
        metadata,
        data_start,
    })
}

fn parse_metadata(path: &Path, value: Value) -> Result<BTreeMap<String, String>> {
    let malformed = |detail: String| FormatError::Malformed {
        path: path.to_path_buf(),
        what: WHAT,
        detail,
    };
    match value {
        Value::Null => Ok(BTreeMap::new()),
        Value::Object(map) => map
            .into_iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k, s)),
                other => Err(malformed(format!(
                    "{METADATA_KEY} value of key '{k}' is {}, not a string",
                    json_kind(&other)
                ))),
            })
            .collect(),
        other => Err(malformed(format!(
            "{METADATA_KEY} is {}, not a map of strings",
            json_kind(&other)
        ))),
    }
}

fn parse_tensor(
    path: &Path,
    name: String,
    value: Value,
    data_start: u64,
    data_len: u64,
) -> Result<TensorInfo> {
    let bad = |detail: String| FormatError::BadTensor {
        path: path.to_path_buf(),
        tensor: name.clone(),
        detail,
    };
    let Value::Object(fields) = value else {
        return Err(bad(format!(
            "entry is {}, not an object",
            json_kind(&value)
        )));
    };
    if let Some(key) = fields
        .keys()
        .find(|k| !matches!(k.as_str(), "dtype" | "shape" | "data_offsets"))
    {
        return Err(bad(format!("unknown field '{key}'")));
    }

    let dtype = match fields.get("dtype") {
        None => return Err(bad("missing field 'dtype'".into())),
        Some(Value::String(s)) => match DType::from_safetensors(s) {
            Some(d) => d,
            None if KNOWN_UNSUPPORTED_DTYPES.contains(&s.as_str()) => {
                return Err(FormatError::Unsupported {
                    path: path.to_path_buf(),
                    what: format!("dtype '{s}' of tensor '{name}'"),
                })
            }
            None => return Err(bad(format!("unknown dtype '{s}'"))),
        },
        Some(other) => return Err(bad(format!("dtype is {}, not a string", json_kind(other)))),
    };

    let shape = match fields.get("shape") {
        None => return Err(bad("missing field 'shape'".into())),
        Some(Value::Array(dims)) => dims
            .iter()
            .map(|d| {
                d.as_u64()
                    .and_then(|d| usize::try_from(d).ok())
                    .ok_or_else(|| {
                        bad(format!("shape dimension {d} is not a non-negative integer"))
                    })
            })
            .collect::<Result<Vec<usize>>>()?,
        Some(other) => return Err(bad(format!("shape is {}, not an array", json_kind(other)))),
    };
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            bad(format!(
                "shape {shape:?} has more elements than fit in usize"
            ))
        })?;
    let expected_len = numel
        .checked_mul(dtype.size())
        .and_then(|b| u64::try_from(b).ok())
        .ok_or_else(|| {
            bad(format!(
                "shape {shape:?} of {dtype} overflows the byte length"
            ))
        })?;

    let (begin, end) = match fields.get("data_offsets") {
        None => return Err(bad("missing field 'data_offsets'".into())),
        Some(Value::Array(pair)) => match pair.as_slice() {
            [b, e] => match (b.as_u64(), e.as_u64()) {
                (Some(b), Some(e)) => (b, e),
                _ => {
                    return Err(bad(format!(
                        "data_offsets [{b}, {e}] are not non-negative integers"
                    )))
                }
            },
            _ => {
                return Err(bad(format!(
                    "data_offsets has {} elements, not [begin, end]",
                    pair.len()
                )))
            }
        },
        Some(other) => {
            return Err(bad(format!(
                "data_offsets is {}, not an array",
                json_kind(other)
            )))
        }
    };
    if begin > end {
        return Err(bad(format!(
            "data_offsets [{begin}, {end}] have begin > end"
        )));
    }
    if end - begin != expected_len {
        return Err(bad(format!(
            "data_offsets [{begin}, {end}] hold {} bytes but shape {shape:?} of {dtype} needs {expected_len}",
            end - begin
        )));
    }
    if end > data_len {
        return Err(bad(format!(
            "data_offsets [{begin}, {end}] run past the {data_len}-byte data region"
        )));
    }
    Ok(TensorInfo {
        name,
        dtype,
        shape,
        // Cannot overflow: data_start + end <= file_len.
        offset: data_start + begin,
        len: expected_len,
    })
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The top-level JSON object's entries in file order. Unlike a map, it rejects
/// duplicate keys: with a map the last duplicate would silently win, and two readers
/// could disagree about which bytes a tensor is.
struct OrderedEntries(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for OrderedEntries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OrderedEntries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                let mut seen = HashSet::new();
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Value>()? {
                    if !seen.insert(k.clone()) {
                        return Err(serde::de::Error::custom(format!("duplicate key '{k}'")));
                    }
                    out.push((k, v));
                }
                Ok(OrderedEntries(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// A safetensors file, memory mapped read-only, with its validated header.
///
/// The mapping is a [`GuardedMap`]: a read past a truncation reads zeros instead of
/// raising `SIGBUS`, and [`SafetensorsFile::check_faults`] reports it. Readers of
/// [`SafetensorsFile::tensor_bytes`] and [`SafetensorsFile::mapping`] call
/// `check_faults` after using the bytes and discard what they computed on `Err`. The
/// file stays open beside the mapping, so its current identity ([`FileIdentity`]) can
/// be compared with the one it had when it was opened.
pub struct SafetensorsFile {
    pub path: PathBuf,
    pub header: Header,
    map: GuardedMap,
    file: File,
    identity: FileIdentity,
    by_name: HashMap<String, usize>,
}

impl fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("len", &self.map.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl SafetensorsFile {
    /// Maps `path` read-only and validates its header.
    pub fn open(path: &Path) -> Result<Self> {
        let file = crate::file::open(path).map_err(|e| FormatError::io(path, e))?;
        let meta = file.metadata().map_err(|e| FormatError::io(path, e))?;
        if !meta.is_file() {
            return Err(FormatError::Malformed {
                path: path.to_path_buf(),
                what: WHAT,
                detail: "not a regular file".into(),
            });
        }
        if meta.len() < 8 {
            // Reported before mapping: an empty file cannot be mapped on every platform.
            return Err(FormatError::Malformed {
                path: path.to_path_buf(),
                what: WHAT,
                detail: format!(
                    "file is {} bytes, shorter than the 8-byte header length prefix",
                    meta.len()
                ),
            });
        }
        // The header is read with read(2), not through the mapping: on a network mount
        // that goes away, a read fails with an I/O error where a fault on the mapping
        // would kill the process with SIGBUS. Opening a file (and so a checkpoint, and
        // checking a manifest against it) touches no mapped page.
        let io = |e| FormatError::io(path, e);
        let mut head = vec![0u8; 8];
        (&file).read_exact(&mut head).map_err(io)?;
        let data_start = header_end(path, &head, meta.len())?;
        // In range: data_start <= 8 + MAX_HEADER_LEN (header_end).
        head.resize(data_start as usize, 0);
        (&file).read_exact(&mut head[8..]).map_err(io)?;
        let header = parse_header(path, &head, meta.len())?;
        // A model store's files are immutable while served (the store only replaces
        // files by rename, which leaves existing mappings intact). A file truncated by
        // another process faults into the guard (check_faults); one rewritten in place
        // is for the reader to notice (identity, manifest hashes).
        let map = GuardedMap::map(&file, path)?;
        if map.len() as u64 != meta.len() {
            return Err(FormatError::Malformed {
                path: path.to_path_buf(),
                what: WHAT,
                detail: format!(
                    "the file changed while it was opened ({} bytes, then {})",
                    meta.len(),
                    map.len()
                ),
            });
        }
        let by_name = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            header,
            map,
            file,
            identity: FileIdentity::of_metadata(&meta),
            by_name,
        })
    }

    /// `Ok` while no read of the mapping has faulted; else [`FormatError::Fault`]
    /// naming this file and the offset of the first faulting read (for good: reopen
    /// the file). Call it after using bytes from [`SafetensorsFile::tensor_bytes`] or
    /// [`SafetensorsFile::mapping`]; on `Err`, discard what was computed from them.
    pub fn check_faults(&self) -> Result<()> {
        self.map.check()
    }

    /// The open file behind the mapping (to `fstat` it; it is never read through).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The file's identity when it was opened (the `fstat` the mapping was sized by).
    pub fn identity(&self) -> FileIdentity {
        self.identity
    }

    /// The file's identity now (one `fstat` of the open descriptor): differs from
    /// [`SafetensorsFile::identity`] once the file was written, truncated or touched.
    /// A rename over the path does not change it: the descriptor keeps the old inode.
    pub fn current_identity(&self) -> Result<FileIdentity> {
        FileIdentity::of_file(&self.file, &self.path)
    }

    /// The tensor called `name`, if this file has it.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.header.tensors[i])
    }

    /// The bytes of `t`, in place in the mapping (no copy). If the file is truncated
    /// while mapped they may read as zeros: see [`SafetensorsFile::check_faults`].
    ///
    /// # Panics
    /// If `t` is not a tensor of this file's header and lies outside the mapping.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        let start = usize::try_from(t.offset).expect("tensor offset fits in usize");
        let len = usize::try_from(t.len).expect("tensor length fits in usize");
        self.map
            .get(start..start.saturating_add(len))
            .unwrap_or_else(|| {
                panic!(
                    "tensor '{}' [{}, +{}) is not in {} ({} bytes)",
                    t.name,
                    t.offset,
                    t.len,
                    self.path.display(),
                    self.map.len()
                )
            })
    }

    /// The whole mapped file (reads past a truncation: zeros, reported by
    /// [`SafetensorsFile::check_faults`]).
    pub fn mapping(&self) -> &[u8] {
        self.map.bytes()
    }

    /// The file's length in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// True when the file is empty (never, for an opened file: it holds a header).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests;

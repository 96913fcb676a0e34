//! The safetensors writer, and the atomic file replacement it shares with the manifest.

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::METADATA_KEY;
use crate::dtype::DType;
use crate::error::{FormatError, Result};

/// Writes a safetensors file deterministically.
///
/// The header lists `__metadata__` first (omitted when `metadata` is empty, keys in
/// sorted order), then the tensors in the given order, as compact JSON padded with
/// spaces to a multiple of 8 bytes so the data region starts 8-byte aligned, as the
/// reference writer does. Tensor bytes follow contiguously in the given order with no
/// holes, so the reference implementation accepts the file; like the reference writer
/// (which orders tensors by decreasing element size), a caller that wants every tensor
/// aligned to its element size orders them so.
///
/// The file is written to a temporary file in the same directory, synced, then renamed
/// over `path`: a crash never leaves a half-written file under the final name.
pub fn write(
    path: &Path,
    tensors: &[(&str, DType, &[usize], &[u8])],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let bad = |name: &str, detail: String| FormatError::BadTensor {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        detail,
    };
    for &(name, dtype, shape, bytes) in tensors {
        let expected = tensor_len(shape, dtype)
            .ok_or_else(|| bad(name, format!("shape {shape:?} overflows")))?;
        if bytes.len() != expected {
            return Err(bad(
                name,
                format!(
                    "{} bytes given but shape {shape:?} of {dtype} needs {expected}",
                    bytes.len()
                ),
            ));
        }
    }
    let specs: Vec<(&str, DType, &[usize])> =
        tensors.iter().map(|&(n, d, s, _)| (n, d, s)).collect();
    write_with(path, &specs, metadata, &mut |i, w| {
        w.write_all(tensors[i].3)
    })
}

/// Like [`write`], with each tensor's bytes produced when they are due: `fill(i, w)`
/// writes tensor `i`'s bytes (exactly the length its dtype and shape give) into `w`,
/// in order. Only one tensor need exist in memory at a time, so a file larger than
/// memory can be written. A fill that writes too few or too many bytes, or fails, is
/// an error and leaves `path` untouched.
pub fn write_with(
    path: &Path,
    tensors: &[(&str, DType, &[usize])],
    metadata: &BTreeMap<String, String>,
    fill: &mut dyn FnMut(usize, &mut dyn Write) -> io::Result<()>,
) -> Result<()> {
    let header = header_bytes(path, tensors, metadata)?;
    let mut wrong: Option<FormatError> = None;
    let r = write_atomically(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        for (i, &(name, dtype, shape)) in tensors.iter().enumerate() {
            let expected = tensor_len(shape, dtype).expect("checked by header_bytes") as u64;
            let mut counted = Counted { inner: w, n: 0 };
            fill(i, &mut counted)?;
            if counted.n != expected {
                wrong = Some(FormatError::BadTensor {
                    path: path.to_path_buf(),
                    tensor: name.to_string(),
                    detail: format!(
                        "{} bytes written but shape {shape:?} of {dtype} needs {expected}",
                        counted.n
                    ),
                });
                return Err(io::Error::other("a tensor's bytes have the wrong length"));
            }
        }
        Ok(())
    });
    match (r, wrong) {
        (_, Some(e)) => Err(e),
        (r, None) => r,
    }
}

/// Bytes of a tensor of `shape` and `dtype`, if that fits a usize.
fn tensor_len(shape: &[usize], dtype: DType) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .and_then(|n| n.checked_mul(dtype.size()))
}

/// A writer that counts the bytes through it.
struct Counted<'a> {
    inner: &'a mut dyn Write,
    n: u64,
}

impl Write for Counted<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Builds the padded JSON header, validating every tensor's name and shape.
fn header_bytes(
    path: &Path,
    tensors: &[(&str, DType, &[usize])],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let bad = |name: &str, detail: String| FormatError::BadTensor {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        detail,
    };
    let mut out = String::from("{");
    let mut first = true;
    if !metadata.is_empty() {
        out.push_str(&json_string(METADATA_KEY));
        out.push(':');
        // A BTreeMap<String, String> always serializes.
        out.push_str(&serde_json::to_string(metadata).expect("string map serializes"));
        first = false;
    }
    let mut seen = HashSet::new();
    let mut offset = 0u64;
    for &(name, dtype, shape) in tensors {
        if name == METADATA_KEY {
            return Err(bad(name, format!("'{METADATA_KEY}' is reserved")));
        }
        if !seen.insert(name) {
            return Err(bad(name, "tensor name given twice".into()));
        }
        let expected = tensor_len(shape, dtype)
            .ok_or_else(|| bad(name, format!("shape {shape:?} overflows")))?;
        let end = offset + expected as u64;
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(&json_string(name));
        out.push_str(r#":{"dtype":""#);
        out.push_str(dtype.as_str());
        out.push_str(r#"","shape":["#);
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        out.push_str(&dims.join(","));
        out.push_str(&format!(r#"],"data_offsets":[{offset},{end}]}}"#));
        offset = end;
    }
    out.push('}');
    while out.len() % 8 != 0 {
        out.push(' ');
    }
    if out.len() as u64 > super::MAX_HEADER_LEN {
        return Err(FormatError::Malformed {
            path: path.to_path_buf(),
            what: "safetensors header",
            detail: format!(
                "header would be {} bytes, over the {}-byte limit",
                out.len(),
                super::MAX_HEADER_LEN
            ),
        });
    }
    Ok(out.into_bytes())
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).expect("a str serializes")
}

/// Writes `path` atomically: `fill` writes into a fresh temporary file in the same
/// directory, which is synced and then renamed over `path`. On any error the temporary
/// file is removed and `path` is untouched.
pub(crate) fn write_atomically(
    path: &Path,
    fill: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let file_name = path.file_name().ok_or_else(|| {
        FormatError::io(
            path,
            io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"),
        )
    })?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(
        ".{}.{}.tmp",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let tmp: PathBuf = path.with_file_name(tmp_name);

    let result = (|| -> io::Result<()> {
        let file = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        fill(&mut w)?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, path)
    })();
    match result {
        Ok(()) => {
            // Make the rename itself durable. Best effort: not every platform or file
            // system lets a directory be opened and synced, and the data is in place.
            if let Some(dir) = path.parent() {
                let dir = if dir.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    dir
                };
                if let Ok(d) = File::open(dir) {
                    let _ = d.sync_all();
                }
            }
            Ok(())
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(FormatError::io(path, e))
        }
    }
}

//! A Hugging Face model directory's safetensors checkpoint: one `model.safetensors`,
//! the shards named by `model.safetensors.index.json`, or every `*.safetensors` file.
//!
//! Every file is memory mapped and its header validated when the checkpoint opens, and
//! every tensor name resolves to exactly one file.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use crate::error::{FormatError, Result};
use crate::safetensors::{SafetensorsFile, TensorInfo};

/// The single-file checkpoint's name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The shard index's name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The largest shard index read.
pub const INDEX_MAX_BYTES: u64 = 64 << 20;

/// Where one tensor lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLocation {
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    pub info: TensorInfo,
}

/// A model directory's safetensors files, opened.
#[derive(Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    /// The files, sorted by their name relative to `dir`.
    pub files: Vec<SafetensorsFile>,
    /// `files[i]`'s path relative to `dir`, with `/` separators.
    names: Vec<String>,
    by_name: BTreeMap<String, TensorLocation>,
}

#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens `dir`'s checkpoint: `model.safetensors`; else the shards listed in
    /// `model.safetensors.index.json` (its `weight_map`); else, with neither, every
    /// `*.safetensors` file in `dir`, sorted by name.
    ///
    /// Errors: no checkpoint at all, a missing or malformed shard, a shard name that
    /// leaves the directory, a tensor the index lists but its shard lacks, a tensor
    /// present in two files.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        let (names, expected): (Vec<String>, Option<BTreeMap<String, String>>) =
            if crate::file::is_present(&single)? {
                (vec![SINGLE_FILE.to_string()], None)
            } else if crate::file::is_present(&index)? {
                let map = read_index(&index)?;
                let mut names: Vec<String> = map.values().cloned().collect();
                names.sort();
                names.dedup();
                (names, Some(map))
            } else {
                (list_safetensors(dir)?, None)
            };
        if names.is_empty() {
            return Err(FormatError::Missing {
                path: dir.to_path_buf(),
                what: format!(
                    "safetensors checkpoint ({SINGLE_FILE}, {INDEX_FILE} or *.safetensors)"
                ),
            });
        }

        let mut files = Vec::with_capacity(names.len());
        for name in &names {
            let path = dir.join(name);
            if !crate::file::is_present(&path)? {
                return Err(FormatError::Missing {
                    path: dir.to_path_buf(),
                    what: format!("shard '{name}'"),
                });
            }
            files.push(SafetensorsFile::open(&path)?);
        }

        let mut by_name: BTreeMap<String, TensorLocation> = BTreeMap::new();
        for (i, f) in files.iter().enumerate() {
            for t in &f.header.tensors {
                if let Some(prev) = by_name.get(&t.name) {
                    return Err(FormatError::BadTensor {
                        path: f.path.clone(),
                        tensor: t.name.clone(),
                        detail: format!("also present in {}", names[prev.file]),
                    });
                }
                by_name.insert(
                    t.name.clone(),
                    TensorLocation {
                        file: i,
                        info: t.clone(),
                    },
                );
            }
        }
        if let Some(map) = expected {
            for (tensor, shard) in &map {
                let found = by_name.get(tensor).map(|loc| names[loc.file].as_str());
                if found != Some(shard.as_str()) {
                    return Err(FormatError::Missing {
                        path: dir.join(shard),
                        what: match found {
                            None => format!("tensor '{tensor}' listed in {INDEX_FILE}"),
                            Some(other) => format!(
                                "tensor '{tensor}' listed in {INDEX_FILE} (it is in {other})"
                            ),
                        },
                    });
                }
            }
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            files,
            names,
            by_name,
        })
    }

    /// Where tensor `name` lives.
    pub fn get(&self, name: &str) -> Option<&TensorLocation> {
        self.by_name.get(name)
    }

    /// Tensor `name`'s bytes, in place in its file's mapping.
    pub fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        let loc = self.by_name.get(name)?;
        Some(self.files[loc.file].tensor_bytes(&loc.info))
    }

    /// Every tensor, sorted by name.
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &TensorLocation)> {
        self.by_name.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// True when the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// The path of the file holding `loc`.
    pub fn file_path(&self, loc: &TensorLocation) -> &Path {
        &self.files[loc.file].path
    }

    /// `files[file]`'s path relative to [`Checkpoint::dir`] (`/`-separated), as the
    /// manifest records it.
    pub fn file_name(&self, file: usize) -> &str {
        &self.names[file]
    }

    /// Sum of all tensors' byte lengths (headers and holes excluded).
    pub fn total_bytes(&self) -> u64 {
        self.by_name.values().map(|l| l.info.len).sum()
    }
}

fn read_index(path: &Path) -> Result<BTreeMap<String, String>> {
    let text =
        crate::file::read_limited(path, INDEX_MAX_BYTES).map_err(|e| FormatError::io(path, e))?;
    let index: Index = serde_json::from_slice(&text).map_err(|e| FormatError::Malformed {
        path: path.to_path_buf(),
        what: "safetensors index",
        detail: e.to_string(),
    })?;
    for shard in index.weight_map.values() {
        check_relative(path, shard)?;
    }
    Ok(index.weight_map)
}

/// A shard name must stay inside the model directory: relative, no `..`, not empty.
fn check_relative(index: &Path, name: &str) -> Result<()> {
    let p = Path::new(name);
    let ok = !name.is_empty()
        && !name.contains('\\')
        && p.components().all(|c| matches!(c, Component::Normal(_)));
    if ok {
        Ok(())
    } else {
        Err(FormatError::Malformed {
            path: index.to_path_buf(),
            what: "safetensors index",
            detail: format!("shard name '{name}' is not a plain path inside the model directory"),
        })
    }
}

fn list_safetensors(dir: &Path) -> Result<Vec<String>> {
    let entries = std::fs::read_dir(dir).map_err(|e| FormatError::io(dir, e))?;
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| FormatError::io(dir, e))?;
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "safetensors") || !path.is_file() {
            continue;
        }
        let name = entry
            .file_name()
            .into_string()
            .map_err(|n| FormatError::Unsupported {
                path: dir.join(&n),
                what: "file name that is not UTF-8".into(),
            })?;
        names.push(name);
    }
    names.sort();
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::safetensors::write;

    fn put(dir: &Path, file: &str, tensors: &[(&str, &[u8])]) {
        let t: Vec<_> = tensors
            .iter()
            .map(|&(n, b)| (n, DType::U8, vec![b.len()], b))
            .collect();
        let t: Vec<(&str, DType, &[usize], &[u8])> = t
            .iter()
            .map(|(n, d, s, b)| (*n, *d, s.as_slice(), *b))
            .collect();
        write(&dir.join(file), &t, &BTreeMap::new()).unwrap();
    }

    fn index(dir: &Path, map: &[(&str, &str)]) {
        let m: BTreeMap<_, _> = map.iter().copied().collect();
        let json = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": m});
        std::fs::write(dir.join(INDEX_FILE), json.to_string()).unwrap();
    }

    #[test]
    fn opens_a_single_file() {
        let d = tempfile::tempdir().unwrap();
        put(d.path(), SINGLE_FILE, &[("b", &[1, 2]), ("a", &[3])]);
        // A stray file next to model.safetensors is not part of the checkpoint.
        put(d.path(), "other.safetensors", &[("a", &[3])]);
        let c = Checkpoint::open(d.path()).unwrap();
        assert_eq!(c.files.len(), 1);
        let names: Vec<_> = c.tensors().map(|(n, _)| n).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(c.tensor_bytes("b"), Some(&[1u8, 2][..]));
        assert_eq!(c.tensor_bytes("zz"), None);
        assert_eq!(c.total_bytes(), 3);
        assert_eq!(c.file_path(c.get("a").unwrap()), d.path().join(SINGLE_FILE));
        assert_eq!(c.file_name(0), SINGLE_FILE);
    }

    #[test]
    fn opens_indexed_shards() {
        let d = tempfile::tempdir().unwrap();
        put(d.path(), "s2.safetensors", &[("x", &[7]), ("y", &[8, 9])]);
        put(d.path(), "s1.safetensors", &[("w", &[1, 2, 3])]);
        index(
            d.path(),
            &[
                ("x", "s2.safetensors"),
                ("y", "s2.safetensors"),
                ("w", "s1.safetensors"),
            ],
        );
        let c = Checkpoint::open(d.path()).unwrap();
        assert_eq!(c.files.len(), 2);
        assert_eq!(c.file_name(0), "s1.safetensors");
        assert_eq!(c.get("y").unwrap().file, 1);
        assert_eq!(c.tensor_bytes("y"), Some(&[8u8, 9][..]));
        assert_eq!(c.total_bytes(), 6);
    }

    #[test]
    fn without_index_takes_every_safetensors_file_sorted() {
        let d = tempfile::tempdir().unwrap();
        put(d.path(), "b.safetensors", &[("x", &[1])]);
        put(d.path(), "a.safetensors", &[("y", &[2])]);
        std::fs::write(d.path().join("notes.txt"), "hi").unwrap();
        std::fs::create_dir(d.path().join("dir.safetensors")).unwrap();
        let c = Checkpoint::open(d.path()).unwrap();
        assert_eq!(c.file_name(0), "a.safetensors");
        assert_eq!(c.file_name(1), "b.safetensors");
        assert_eq!(c.get("x").unwrap().file, 1);
    }

    #[test]
    fn no_checkpoint_is_missing() {
        let d = tempfile::tempdir().unwrap();
        let e = Checkpoint::open(d.path()).unwrap_err();
        assert!(matches!(e, FormatError::Missing { .. }), "{e}");
        assert!(e.to_string().contains("safetensors checkpoint"), "{e}");
    }

    #[test]
    fn missing_shard_is_reported() {
        let d = tempfile::tempdir().unwrap();
        put(d.path(), "s1.safetensors", &[("w", &[1])]);
        index(
            d.path(),
            &[("w", "s1.safetensors"), ("v", "s2.safetensors")],
        );
        let e = Checkpoint::open(d.path()).unwrap_err();
        assert!(
            matches!(e, FormatError::Missing { ref what, .. } if what == "shard 's2.safetensors'"),
            "{e}"
        );
    }

    #[test]
    fn tensor_absent_from_its_shard_is_reported() {
        let d = tempfile::tempdir().unwrap();
        put(d.path(), "s1.safetensors", &[("w", &[1])]);
        put(d.path(), "s2.safetensors", &[("v", &[1])]);
        index(
            d.path(),
            &[("w", "s1.safetensors"), ("q", "s2.safetensors")],
        );
        let e = Checkpoint::open(d.path()).unwrap_err();
        assert!(e.to_string().contains("tensor 'q' listed in"), "{e}");
        index(
            d.path(),
            &[("w", "s1.safetensors"), ("v", "s1.safetensors")],
        );
        let e = Checkpoint::open(d.path()).unwrap_err();
        assert!(e.to_string().contains("tensor 'v' listed in"), "{e}");
        index(
            d.path(),
            &[
                ("w", "s1.safetensors"),
                ("v", "s1.safetensors"),
                ("x", "s2.safetensors"),
            ],
        );
        let e = Checkpoint::open(d.path()).unwrap_err();
        assert!(
            e.to_string().contains(
                "tensor 'v' listed in model.safetensors.index.json (it is in s2.safetensors)"
            ),
            "{e}"
        );
    }

    #[test]
    fn tensor_in_two_files_is_reported() {
        let d = tempfile::tempdir().unwrap();
        put(d.path(), "a.safetensors", &[("w", &[1])]);
        put(d.path(), "b.safetensors", &[("w", &[1])]);
        let e = Checkpoint::open(d.path()).unwrap_err();
        assert!(
            matches!(e, FormatError::BadTensor { ref tensor, ref detail, .. } if tensor == "w" && detail == "also present in a.safetensors"),
            "{e}"
        );
    }

    #[test]
    fn index_naming_a_path_outside_the_dir_is_rejected() {
        let d = tempfile::tempdir().unwrap();
        for bad in ["../x.safetensors", "/etc/passwd", "", "a/../../b"] {
            index(d.path(), &[("w", bad)]);
            let e = Checkpoint::open(d.path()).unwrap_err();
            assert!(e.to_string().contains("not a plain path"), "{bad}: {e}");
        }
    }

    #[test]
    fn malformed_index_is_reported() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(INDEX_FILE), "{\"metadata\":{}}").unwrap();
        let e = Checkpoint::open(d.path()).unwrap_err();
        assert!(e.to_string().contains("weight_map"), "{e}");
    }

    fn mkfifo(path: &Path) {
        let st = std::process::Command::new("mkfifo")
            .arg(path)
            .status()
            .unwrap();
        assert!(st.success());
    }

    /// A FIFO (or any file that is not regular) in place of a checkpoint file is an
    /// error naming it, found without opening it: opening a FIFO would block for good.
    #[test]
    fn a_fifo_in_place_of_a_checkpoint_file_is_refused_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        mkfifo(&d.path().join(SINGLE_FILE));
        let e = Checkpoint::open(d.path()).unwrap_err();
        assert!(
            e.to_string().contains(SINGLE_FILE)
                && e.to_string().contains("is a FIFO, not a regular file"),
            "{e}"
        );
        std::fs::remove_file(d.path().join(SINGLE_FILE)).unwrap();

        mkfifo(&d.path().join(INDEX_FILE));
        let e = Checkpoint::open(d.path()).unwrap_err();
        assert!(
            e.to_string().contains(INDEX_FILE) && e.to_string().contains("FIFO"),
            "{e}"
        );
        std::fs::remove_file(d.path().join(INDEX_FILE)).unwrap();

        put(d.path(), "s1.safetensors", &[("w", &[1])]);
        mkfifo(&d.path().join("s2.safetensors"));
        index(
            d.path(),
            &[("w", "s1.safetensors"), ("v", "s2.safetensors")],
        );
        let e = Checkpoint::open(d.path()).unwrap_err();
        assert!(
            e.to_string().contains("s2.safetensors") && e.to_string().contains("FIFO"),
            "{e}"
        );
        // A symbolic link to a regular file is one (a Hugging Face cache snapshot).
        std::fs::remove_file(d.path().join(INDEX_FILE)).unwrap();
        std::fs::remove_file(d.path().join("s2.safetensors")).unwrap();
        std::os::unix::fs::symlink(d.path().join("s1.safetensors"), d.path().join(SINGLE_FILE))
            .unwrap();
        assert_eq!(Checkpoint::open(d.path()).unwrap().len(), 1);
    }

    #[test]
    fn malformed_shard_names_its_file() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(SINGLE_FILE), [0u8; 4]).unwrap();
        let e = Checkpoint::open(d.path()).unwrap_err();
        assert!(e.to_string().contains(SINGLE_FILE), "{e}");
    }
}

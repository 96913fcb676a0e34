//! The page manifest of a model store (`voom-manifest.json`): every page with its
//! dtype, shape, location, encoding, group and the blake3 of its decoded bytes.
//!
//! The manifest is the authority on what a page's bytes must be: checkpoint headers
//! carry no body hashes. A page is served only after its bytes hash to the manifest's
//! value ([`Manifest::verify`]). `docs/formats.md` gives the JSON schema.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use serde::{Deserialize, Serialize};

use crate::checkpoint::Checkpoint;
use crate::dtype::DType;
use crate::error::{FormatError, Result};
use crate::safetensors::write_atomically;

/// The manifest's file name inside a model directory.
pub const MANIFEST_FILE: &str = "voom-manifest.json";
/// The manifest format this build reads and writes.
pub const MANIFEST_VERSION: u32 = 1;

const WHAT: &str = "page manifest";

/// Hashing works in pieces of this size so progress moves during a huge tensor.
const HASH_PIECE: usize = 16 << 20;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format_version: u32,
    pub pages: Vec<PageEntry>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PageEntry {
    /// Unique within the manifest; [`Manifest::build`] numbers pages 0.. in name order.
    pub id: u32,
    /// The tensor's name in the checkpoint; unique within the manifest.
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// The file holding the page's bytes, relative to the model directory, `/`-separated.
    pub file: String,
    /// Absolute byte offset of the page's bytes in `file`.
    pub offset: u64,
    /// Length of the page's bytes in `file` (encoded length; for `raw`, the tensor's).
    pub len: u64,
    pub encoding: Encoding,
    /// Lowercase hex blake3 of the page's decoded bytes.
    pub blake3: String,
    pub group: PageGroup,
}

/// How a page's bytes are stored in its file.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// The checkpoint's bytes as they are.
    Raw,
}

/// The part of the model a page belongs to; pages of one group are requested together.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum PageGroup {
    /// Token embeddings.
    Embedding,
    /// Transformer block N.
    Layer(u32),
    /// After the last block: final norm, LM head.
    Final,
    /// Anything else (vision towers, projectors, ...).
    Other,
}

/// Path segments that introduce a block index: `model.layers.N` (Llama and most HF
/// models), `transformer.h.N` (GPT-2, Falcon), `blocks.N`, `blk.N` (GGUF names),
/// `encoder.layer.N` (BERT).
const LAYER_SEGMENTS: &[&str] = &["layers", "h", "blocks", "blk", "layer"];
/// Segments naming a token embedding besides anything containing `embed_tokens`.
const EMBEDDING_SEGMENTS: &[&str] = &[
    "wte",
    "word_embeddings",
    "tok_embeddings",
    "token_embd",
    "embed_in",
];
/// First segments of output heads.
const HEAD_SEGMENTS: &[&str] = &["lm_head", "embed_out", "output"];
/// Segments naming a final norm when they occur outside a block.
const FINAL_NORM_SEGMENTS: &[&str] = &[
    "norm",
    "ln_f",
    "final_layernorm",
    "final_norm",
    "output_norm",
];

impl PageGroup {
    /// Classifies a tensor by name: `*.layers.N.*` is `Layer(N)`; `*embed_tokens*` is
    /// `Embedding`; `lm_head*` and `model.norm*` (a final norm outside any block) are
    /// `Final`; the common spellings of other families (see the segment lists) too.
    pub fn of_tensor(name: &str) -> PageGroup {
        let segs: Vec<&str> = name.split('.').collect();
        for w in segs.windows(2) {
            if LAYER_SEGMENTS.contains(&w[0]) {
                if let Ok(n) = w[1].parse::<u32>() {
                    return PageGroup::Layer(n);
                }
            }
        }
        if segs
            .iter()
            .any(|s| s.contains("embed_tokens") || EMBEDDING_SEGMENTS.contains(s))
        {
            return PageGroup::Embedding;
        }
        if name.starts_with("lm_head")
            || HEAD_SEGMENTS.contains(&segs[0])
            || segs.iter().any(|s| FINAL_NORM_SEGMENTS.contains(s))
        {
            return PageGroup::Final;
        }
        PageGroup::Other
    }
}

impl Manifest {
    /// Hashes every tensor of `ckpt` into a manifest: one raw page per tensor, numbered
    /// in name order. Pages are hashed on all cores; `progress(done_bytes, total_bytes)`
    /// is called on the calling thread as bytes are hashed.
    pub fn build(ckpt: &Checkpoint, progress: &mut dyn FnMut(u64, u64)) -> Manifest {
        let tensors: Vec<_> = ckpt.tensors().collect();
        let bodies: Vec<&[u8]> = tensors
            .iter()
            .map(|(_, loc)| ckpt.files[loc.file].tensor_bytes(&loc.info))
            .collect();
        let hashes = hash_all(&bodies, progress);
        let pages = tensors
            .iter()
            .zip(hashes)
            .enumerate()
            .map(|(i, ((name, loc), hash))| PageEntry {
                id: u32::try_from(i).expect("fewer than 2^32 tensors"),
                name: name.to_string(),
                dtype: loc.info.dtype,
                shape: loc.info.shape.clone(),
                file: ckpt.file_name(loc.file).to_string(),
                offset: loc.info.offset,
                len: loc.info.len,
                encoding: Encoding::Raw,
                blake3: hash.to_hex().to_string(),
                group: PageGroup::of_tensor(name),
            })
            .collect();
        Manifest {
            format_version: MANIFEST_VERSION,
            pages,
        }
    }

    /// Reads `dir/voom-manifest.json`: `Ok(None)` when there is none; a manifest that
    /// is malformed, of another format version or internally inconsistent is an error.
    pub fn load(dir: &Path) -> Result<Option<Manifest>> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(FormatError::io(&path, e)),
        };
        let malformed = |detail: String| FormatError::Malformed {
            path: path.clone(),
            what: WHAT,
            detail,
        };
        // Read the version alone first, so a future format is "unsupported", not "malformed".
        #[derive(Deserialize)]
        struct Version {
            format_version: u32,
        }
        let v: Version = serde_json::from_slice(&bytes).map_err(|e| malformed(e.to_string()))?;
        if v.format_version != MANIFEST_VERSION {
            return Err(FormatError::Unsupported {
                path,
                what: format!(
                    "manifest format_version {} (this build reads {MANIFEST_VERSION})",
                    v.format_version
                ),
            });
        }
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| malformed(e.to_string()))?;
        m.validate().map_err(malformed)?;
        Ok(Some(m))
    }

    /// Checks what the schema cannot: unique names and ids, well-formed hashes and
    /// file names, ranges that do not overflow, lengths that match dtype and shape.
    fn validate(&self) -> std::result::Result<(), String> {
        let mut names = HashSet::new();
        let mut ids = HashSet::new();
        for p in &self.pages {
            let page = &p.name;
            if !names.insert(p.name.as_str()) {
                return Err(format!("page '{page}' listed twice"));
            }
            if !ids.insert(p.id) {
                return Err(format!("page '{page}': id {} used twice", p.id));
            }
            if p.blake3.len() != 64
                || !p
                    .blake3
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            {
                return Err(format!(
                    "page '{page}': blake3 '{}' is not 64 lowercase hex digits",
                    p.blake3
                ));
            }
            if p.file.is_empty()
                || p.file.contains('\\')
                || !Path::new(&p.file)
                    .components()
                    .all(|c| matches!(c, std::path::Component::Normal(_)))
            {
                return Err(format!(
                    "page '{page}': file '{}' is not a plain path inside the model directory",
                    p.file
                ));
            }
            if p.offset.checked_add(p.len).is_none() {
                return Err(format!("page '{page}': offset + len overflows"));
            }
            let decoded = p
                .shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .and_then(|n| n.checked_mul(p.dtype.size()));
            match p.encoding {
                Encoding::Raw if decoded.map(|d| d as u64) != Some(p.len) => {
                    return Err(format!(
                        "page '{page}': len {} does not match shape {:?} of {}",
                        p.len, p.shape, p.dtype
                    ));
                }
                Encoding::Raw => {}
            }
        }
        Ok(())
    }

    /// Writes `dir/voom-manifest.json` atomically (temporary file, then rename).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let json = serde_json::to_vec_pretty(self).expect("a manifest serializes");
        write_atomically(&dir.join(MANIFEST_FILE), |w| {
            w.write_all(&json)?;
            w.write_all(b"\n")
        })
    }

    /// The page called `name`.
    pub fn page(&self, name: &str) -> Option<&PageEntry> {
        // Built manifests are sorted by name; fall back to a scan for any other order.
        match self.pages.binary_search_by(|p| p.name.as_str().cmp(name)) {
            Ok(i) => Some(&self.pages[i]),
            Err(_) => self.pages.iter().find(|p| p.name == name),
        }
    }

    /// Checks that `bytes` hash to `entry.blake3`; otherwise a `ChecksumMismatch` naming
    /// the page, `path` (where the bytes came from) and both hashes.
    pub fn verify(entry: &PageEntry, bytes: &[u8], path: &Path) -> Result<()> {
        let actual = blake3::hash(bytes);
        check_hash(entry, &actual, path)
    }

    /// Checks that this manifest describes `ckpt`: the same tensor names and, for each,
    /// the same dtype, shape, file, offset and length. A stale manifest is an error
    /// naming the first difference.
    pub fn check_matches(&self, ckpt: &Checkpoint) -> Result<()> {
        let stale = |detail: String| FormatError::Malformed {
            path: ckpt.dir.join(MANIFEST_FILE),
            what: WHAT,
            detail: format!("stale (the checkpoint changed since it was built): {detail}"),
        };
        let pages: HashMap<&str, &PageEntry> =
            self.pages.iter().map(|p| (p.name.as_str(), p)).collect();
        for (name, loc) in ckpt.tensors() {
            let Some(p) = pages.get(name) else {
                return Err(stale(format!("tensor '{name}' has no page")));
            };
            let file = ckpt.file_name(loc.file);
            let t = &loc.info;
            let diff = if p.encoding != Encoding::Raw {
                Some(format!("encoding {:?}, checkpoint is raw", p.encoding))
            } else if p.dtype != t.dtype {
                Some(format!("dtype {} vs checkpoint {}", p.dtype, t.dtype))
            } else if p.shape != t.shape {
                Some(format!("shape {:?} vs checkpoint {:?}", p.shape, t.shape))
            } else if p.file != file {
                Some(format!("file '{}' vs checkpoint '{file}'", p.file))
            } else if p.offset != t.offset {
                Some(format!("offset {} vs checkpoint {}", p.offset, t.offset))
            } else if p.len != t.len {
                Some(format!("len {} vs checkpoint {}", p.len, t.len))
            } else {
                None
            };
            if let Some(d) = diff {
                return Err(stale(format!("page '{name}': {d}")));
            }
        }
        if let Some(p) = self.pages.iter().find(|p| ckpt.get(&p.name).is_none()) {
            return Err(stale(format!(
                "page '{}' names no tensor of the checkpoint",
                p.name
            )));
        }
        Ok(())
    }

    /// Re-hashes every page of `ckpt` against this manifest (on all cores) and returns
    /// one `ChecksumMismatch` per page whose bytes differ, in page-name order. A manifest
    /// that does not describe `ckpt` is an error ([`Manifest::check_matches`]).
    pub fn verify_checkpoint(
        &self,
        ckpt: &Checkpoint,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Vec<FormatError>> {
        self.check_matches(ckpt)?;
        let mut pages: Vec<&PageEntry> = self.pages.iter().collect();
        pages.sort_by(|a, b| a.name.cmp(&b.name));
        let locs: Vec<_> = pages
            .iter()
            .map(|p| ckpt.get(&p.name).expect("check_matches found every page"))
            .collect();
        let bodies: Vec<&[u8]> = locs
            .iter()
            .map(|loc| ckpt.files[loc.file].tensor_bytes(&loc.info))
            .collect();
        let hashes = hash_all(&bodies, progress);
        Ok(pages
            .iter()
            .zip(locs)
            .zip(hashes)
            .filter_map(|((p, loc), h)| check_hash(p, &h, ckpt.file_path(loc)).err())
            .collect())
    }

    /// Total bytes of all pages as stored.
    pub fn total_bytes(&self) -> u64 {
        self.pages.iter().map(|p| p.len).sum()
    }
}

fn check_hash(entry: &PageEntry, actual: &blake3::Hash, path: &Path) -> Result<()> {
    let actual = actual.to_hex();
    if entry.blake3.eq_ignore_ascii_case(actual.as_str()) {
        Ok(())
    } else {
        Err(FormatError::ChecksumMismatch {
            path: path.to_path_buf(),
            page: entry.name.clone(),
            expected: entry.blake3.clone(),
            actual: actual.to_string(),
        })
    }
}

enum Msg {
    Hashed(u64),
    Done(usize, blake3::Hash),
}

/// blake3 of every body, hashed by a pool of scoped threads that take bodies largest
/// first (so one huge embedding does not end up last on one core). Progress is reported
/// on the calling thread because `progress` need not be `Send`.
fn hash_all(bodies: &[&[u8]], progress: &mut dyn FnMut(u64, u64)) -> Vec<blake3::Hash> {
    let total: u64 = bodies.iter().map(|b| b.len() as u64).sum();
    progress(0, total);
    let mut order: Vec<usize> = (0..bodies.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(bodies[i].len()));
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(bodies.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let mut hashes: Vec<Option<blake3::Hash>> = vec![None; bodies.len()];
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        for _ in 0..workers {
            let tx = tx.clone();
            let (next, order) = (&next, &order);
            s.spawn(move || loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(&i) = order.get(k) else { break };
                let mut h = blake3::Hasher::new();
                for piece in bodies[i].chunks(HASH_PIECE) {
                    h.update(piece);
                    // The receiver lives until every sender is gone.
                    let _ = tx.send(Msg::Hashed(piece.len() as u64));
                }
                let _ = tx.send(Msg::Done(i, h.finalize()));
            });
        }
        drop(tx);
        let mut done = 0u64;
        for msg in rx {
            match msg {
                Msg::Hashed(n) => {
                    done += n;
                    progress(done, total);
                }
                Msg::Done(i, h) => hashes[i] = Some(h),
            }
        }
    });
    hashes
        .into_iter()
        .map(|h| h.expect("every body was hashed"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::write;
    use std::collections::BTreeMap;

    fn model(dir: &Path) -> Checkpoint {
        let emb: Vec<u8> = (0..64u8).collect();
        let q: Vec<u8> = (0..32u8).map(|x| x.wrapping_mul(7)).collect();
        let norm = [1u8, 2, 3, 4];
        write(
            &dir.join("model.safetensors"),
            &[
                ("model.embed_tokens.weight", DType::BF16, &[4, 8], &emb),
                (
                    "model.layers.0.self_attn.q_proj.weight",
                    DType::BF16,
                    &[4, 4],
                    &q,
                ),
                ("model.norm.weight", DType::BF16, &[2], &norm),
                ("lm_head.weight", DType::F32, &[1], &norm),
            ],
            &BTreeMap::new(),
        )
        .unwrap();
        Checkpoint::open(dir).unwrap()
    }

    #[test]
    fn groups_from_tensor_names() {
        use PageGroup::*;
        for (name, g) in [
            ("model.embed_tokens.weight", Embedding),
            ("model.language_model.embed_tokens.weight", Embedding),
            ("transformer.wte.weight", Embedding),
            ("model.layers.0.self_attn.q_proj.weight", Layer(0)),
            ("model.layers.61.mlp.experts.3.down_proj.weight", Layer(61)),
            ("transformer.h.11.ln_1.weight", Layer(11)),
            ("blk.7.attn_q.weight", Layer(7)),
            ("lm_head.weight", Final),
            ("model.norm.weight", Final),
            ("transformer.ln_f.bias", Final),
            ("output_norm.weight", Final),
            ("model.layers.x.weight", Other),
            ("vision_tower.patch_embed.proj.weight", Other),
            ("", Other),
        ] {
            assert_eq!(PageGroup::of_tensor(name), g, "{name}");
        }
    }

    #[test]
    fn build_hashes_every_tensor() {
        let d = tempfile::tempdir().unwrap();
        let c = model(d.path());
        let mut calls = vec![];
        let m = Manifest::build(&c, &mut |done, total| calls.push((done, total)));
        assert_eq!(m.format_version, MANIFEST_VERSION);
        assert_eq!(m.pages.len(), 4);
        assert_eq!(calls.first(), Some(&(0, 104)));
        assert_eq!(calls.last(), Some(&(104, 104)));
        for (i, p) in m.pages.iter().enumerate() {
            assert_eq!(p.id as usize, i);
            let bytes = c.tensor_bytes(&p.name).unwrap();
            assert_eq!(p.blake3, blake3::hash(bytes).to_hex().as_str());
            assert_eq!(p.len as usize, bytes.len());
            assert_eq!(p.file, "model.safetensors");
            assert_eq!(p.offset, c.get(&p.name).unwrap().info.offset);
        }
        let q = m.page("model.layers.0.self_attn.q_proj.weight").unwrap();
        assert_eq!(q.group, PageGroup::Layer(0));
        assert_eq!(q.shape, vec![4, 4]);
        assert_eq!(q.dtype, DType::BF16);
        assert!(m.page("nope").is_none());
        m.check_matches(&c).unwrap();
        assert!(m.verify_checkpoint(&c, &mut |_, _| {}).unwrap().is_empty());
    }

    #[test]
    fn verify_detects_a_flipped_bit() {
        let d = tempfile::tempdir().unwrap();
        let c = model(d.path());
        let m = Manifest::build(&c, &mut |_, _| {});
        let p = m.page("model.norm.weight").unwrap();
        let mut bytes = c.tensor_bytes(&p.name).unwrap().to_vec();
        Manifest::verify(p, &bytes, Path::new("f")).unwrap();
        bytes[1] ^= 0x10;
        match Manifest::verify(p, &bytes, Path::new("f")).unwrap_err() {
            FormatError::ChecksumMismatch {
                path,
                page,
                expected,
                actual,
            } => {
                assert_eq!(path, Path::new("f"));
                assert_eq!(page, "model.norm.weight");
                assert_eq!(expected, p.blake3);
                assert_eq!(actual, blake3::hash(&bytes).to_hex().as_str());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn save_load_round_trip_and_absent_is_none() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(Manifest::load(d.path()).unwrap(), None);
        let c = model(d.path());
        let m = Manifest::build(&c, &mut |_, _| {});
        m.save(d.path()).unwrap();
        assert_eq!(Manifest::load(d.path()).unwrap(), Some(m.clone()));
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.path().join(MANIFEST_FILE)).unwrap()).unwrap();
        assert_eq!(json["pages"][0]["encoding"], "raw");
        assert_eq!(json["pages"][0]["group"], "final"); // lm_head.weight sorts first
        assert_eq!(json["pages"][2]["group"]["layer"], 0);
        assert_eq!(json["pages"][2]["dtype"], "BF16");
    }

    fn load_err(dir: &Path, json: &str) -> FormatError {
        std::fs::write(dir.join(MANIFEST_FILE), json).unwrap();
        Manifest::load(dir).unwrap_err()
    }

    #[test]
    fn load_rejects_malformed_manifests() {
        let d = tempfile::tempdir().unwrap();
        let c = model(d.path());
        let m = Manifest::build(&c, &mut |_, _| {});
        let good = serde_json::to_value(&m).unwrap();

        let e = load_err(d.path(), "{not json");
        assert!(matches!(e, FormatError::Malformed { .. }), "{e}");
        let e = load_err(d.path(), r#"{"format_version":2,"pages":[]}"#);
        assert!(matches!(e, FormatError::Unsupported { .. }), "{e}");

        let mutate = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = good.clone();
            f(&mut v);
            load_err(d.path(), &v.to_string()).to_string()
        };
        let e = mutate(&|v| v["pages"][1]["name"] = v["pages"][0]["name"].clone());
        assert!(e.contains("listed twice"), "{e}");
        let e = mutate(&|v| v["pages"][1]["id"] = 0.into());
        assert!(e.contains("id 0 used twice"), "{e}");
        let e = mutate(&|v| v["pages"][1]["blake3"] = "abc".into());
        assert!(e.contains("not 64 lowercase hex"), "{e}");
        let e = mutate(&|v| v["pages"][1]["file"] = "../x".into());
        assert!(e.contains("not a plain path"), "{e}");
        let e = mutate(&|v| v["pages"][1]["len"] = 3.into());
        assert!(e.contains("does not match shape"), "{e}");
        let e = mutate(&|v| v["pages"][1]["encoding"] = "zip".into());
        assert!(e.contains("unknown variant"), "{e}");
        let e = mutate(&|v| v["pages"][1]["extra"] = 1.into());
        assert!(e.contains("unknown field"), "{e}");
        let e = mutate(&|v| v["pages"][1]["offset"] = u64::MAX.into());
        assert!(e.contains("overflows"), "{e}");
    }

    #[test]
    fn check_matches_names_the_first_difference() {
        let d = tempfile::tempdir().unwrap();
        let c = model(d.path());
        let m = Manifest::build(&c, &mut |_, _| {});
        let stale = |f: &dyn Fn(&mut Manifest)| {
            let mut m = m.clone();
            f(&mut m);
            m.check_matches(&c).unwrap_err().to_string()
        };
        let e = stale(&|m| m.pages[0].offset += 1);
        assert!(e.contains("page 'lm_head.weight': offset"), "{e}");
        let e = stale(&|m| m.pages[1].shape = vec![1, 8, 4]);
        assert!(e.contains("shape [1, 8, 4] vs checkpoint [4, 8]"), "{e}");
        let e = stale(&|m| m.pages[1].dtype = DType::F16);
        assert!(e.contains("dtype F16 vs checkpoint BF16"), "{e}");
        let e = stale(&|m| m.pages[1].file = "b.safetensors".into());
        assert!(e.contains("file 'b.safetensors'"), "{e}");
        let e = stale(&|m| m.pages[1].len = 1);
        assert!(e.contains("len 1 vs checkpoint 64"), "{e}");
        let e = stale(&|m| {
            m.pages.remove(2);
        });
        assert!(
            e.contains("tensor 'model.layers.0.self_attn.q_proj.weight' has no page"),
            "{e}"
        );
        let e = stale(&|m| {
            let mut extra = m.pages[0].clone();
            extra.name = "ghost".into();
            m.pages.push(extra);
        });
        assert!(e.contains("page 'ghost' names no tensor"), "{e}");
    }

    #[test]
    fn hash_all_handles_many_and_empty_bodies() {
        let big: Vec<u8> = (0..(HASH_PIECE * 2 + 5)).map(|i| (i % 251) as u8).collect();
        let bodies: Vec<&[u8]> = vec![&[], &big, b"abc", &[]];
        let mut last = (0, 0);
        let h = hash_all(&bodies, &mut |d, t| last = (d, t));
        assert_eq!(last, (big.len() as u64 + 3, big.len() as u64 + 3));
        for (b, h) in bodies.iter().zip(&h) {
            assert_eq!(*h, blake3::hash(b));
        }
        assert!(hash_all(&[], &mut |_, _| {}).is_empty());
    }
}

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

use crate::checkpoint::{Checkpoint, TensorLocation};
use crate::dtype::DType;
use crate::error::{FormatError, Result};
use crate::safetensors::write_atomically;
use crate::vpack;

/// The manifest's file name inside a model directory.
pub const MANIFEST_FILE: &str = "voom-manifest.json";
/// The largest manifest read (one of a trillion-parameter checkpoint's tens of
/// thousands of pages is a few MB).
pub const MANIFEST_MAX_BYTES: u64 = 256 << 20;
/// The manifest format of raw-only manifests: what [`Manifest::build`] writes, and what
/// builds that predate encoded bodies read.
pub const MANIFEST_VERSION: u32 = 1;
/// The manifest format of manifests whose pages list encoded bodies
/// ([`PageEntry::encoded`]). A manifest is saved with the lowest version that describes
/// it ([`Manifest::required_version`]), so raw-only stores stay readable by older builds
/// and an older build refuses a packed store as "unsupported", not as malformed.
pub const MANIFEST_VERSION_ENCODED: u32 = 2;
/// The manifest format of manifests with pages that hold part of a tensor (a range of
/// its rows, [`PageEntry::rows`]): an older build refuses them as "unsupported"
/// rather than serving one part as the whole tensor.
pub const MANIFEST_VERSION_PARTS: u32 = 3;
/// The manifest format of manifests that name routed experts' pages
/// ([`PageGroup::Expert`]): an older build refuses them as "unsupported" rather than
/// failing on the group it does not know.
pub const MANIFEST_VERSION_EXPERTS: u32 = 4;

/// The bytes [`Manifest::build`] aims at for each part of a tensor it splits into
/// row parts (an embedding table whose rows a token reads one at a time).
pub const PART_BYTES: u64 = 1 << 20;

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
    /// Encoding of the bytes at `file`/`offset`/`len`; `raw` in every manifest so far.
    pub encoding: Encoding,
    /// Lowercase hex blake3 of the page's decoded bytes.
    pub blake3: String,
    pub group: PageGroup,
    /// Other stored copies of the page's bytes in other encodings (a vpack body in
    /// `model.vpack`), at most one per encoding. Each decodes to the same bytes, checked
    /// against `blake3`. Absent from the JSON when empty (format version 1).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub encoded: Vec<EncodedBody>,
    /// Set when the page holds part of tensor `name`: these rows of its first
    /// dimension (`shape`, `offset` and `len` are the part's). The parts of a tensor
    /// tile it in order. Absent from the JSON for a page that is a whole tensor (format
    /// versions 1 and 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<Rows>,
}

/// Rows `start..start + count` of a tensor's first dimension.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(deny_unknown_fields)]
pub struct Rows {
    pub start: u64,
    pub count: u64,
}

impl Rows {
    /// One past the last row.
    pub fn end(&self) -> u64 {
        self.start.saturating_add(self.count)
    }
}

/// Where an encoded copy of a page lives.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct EncodedBody {
    /// Never `raw` (the raw copy is the page's own location).
    pub encoding: Encoding,
    /// The file holding the body, relative to the model directory, `/`-separated.
    pub file: String,
    /// Absolute byte offset of the body in `file`.
    pub offset: u64,
    /// Length of the encoded body.
    pub len: u64,
}

impl PageEntry {
    /// How errors and listings name the page: the tensor's name, with the rows it
    /// holds when it is a part (`model.embed_tokens.weight rows 256..512`).
    pub fn label(&self) -> String {
        page_label(&self.name, self.rows)
    }

    /// The page's vpack body, if it has one.
    pub fn vpack(&self) -> Option<&EncodedBody> {
        self.encoded.iter().find(|e| e.encoding == Encoding::Vpack)
    }

    /// Bytes the page decodes to (`numel * dtype size`), `None` on overflow.
    pub fn decoded_len(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(self.dtype.size()))
            .map(|d| d as u64)
    }
}

/// [`PageEntry::label`] of a page of tensor `name` holding `rows`.
pub fn page_label(name: &str, rows: Option<Rows>) -> String {
    match rows {
        None => name.to_string(),
        Some(r) => format!("{name} rows {}..{}", r.start, r.end()),
    }
}

/// How a page's bytes are stored in its file.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// The checkpoint's bytes as they are.
    Raw,
    /// A [`vpack`] body: BF16/F16 split into byte planes, the high plane zstd-compressed.
    Vpack,
}

impl Encoding {
    /// The manifest's spelling: `raw`, `vpack`.
    pub fn as_str(self) -> &'static str {
        match self {
            Encoding::Raw => "raw",
            Encoding::Vpack => "vpack",
        }
    }
}

/// The part of the model a page belongs to; pages of one group are requested together.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum PageGroup {
    /// Token embeddings.
    Embedding,
    /// Transformer block N.
    Layer(u32),
    /// One routed expert of block `layer`: its own tensors
    /// (`model.layers.L.mlp.experts.E.*`), or its part of the experts fused in one
    /// tensor (`mlp.experts.gate_up_proj`, split one expert per page). A token reads
    /// only the experts its router picks.
    Expert { layer: u32, expert: u32 },
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
        for (i, w) in segs.windows(2).enumerate() {
            if LAYER_SEGMENTS.contains(&w[0]) {
                if let Ok(n) = w[1].parse::<u32>() {
                    // `...experts.E...` inside the block: one routed expert's tensor.
                    let expert = segs[i + 2..]
                        .windows(2)
                        .find(|x| x[0] == "experts")
                        .and_then(|x| x[1].parse::<u32>().ok());
                    return match expert {
                        Some(e) => PageGroup::Expert {
                            layer: n,
                            expert: e,
                        },
                        None => PageGroup::Layer(n),
                    };
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

    /// The block a page belongs to: its layer's, or its expert's layer's.
    pub fn layer(self) -> Option<u32> {
        match self {
            PageGroup::Layer(l) | PageGroup::Expert { layer: l, .. } => Some(l),
            _ => None,
        }
    }

    /// The group of a page of tensor `name` holding `rows` of it: a part of routed
    /// experts fused in one tensor ([`split_experts`]) is its expert's.
    fn of_page(name: &str, rows: Option<Rows>) -> PageGroup {
        match (PageGroup::of_tensor(name), rows) {
            (PageGroup::Layer(l), Some(r)) if is_fused_experts(name) && r.count == 1 => {
                PageGroup::Expert {
                    layer: l,
                    expert: u32::try_from(r.start).unwrap_or(u32::MAX),
                }
            }
            (g, _) => g,
        }
    }
}

/// Whether tensor `name` holds a block's routed experts fused along its first
/// dimension (`model.layers.L.mlp.experts.gate_up_proj`, `...experts.down_proj`).
fn is_fused_experts(name: &str) -> bool {
    let segs: Vec<&str> = name.split('.').collect();
    segs.windows(2)
        .any(|w| w[0] == "experts" && w[1].parse::<u32>().is_err())
        && matches!(PageGroup::of_tensor(name), PageGroup::Layer(_))
}

impl Manifest {
    /// Hashes every tensor of `ckpt` into a manifest: raw pages numbered in name order,
    /// one per tensor except for tables split into row parts ([`split_rows`]), whose
    /// parts follow each other in row order. Pages are hashed on all cores;
    /// `progress(done_bytes, total_bytes)` is called on the calling thread as bytes are
    /// hashed. A file truncated while it is hashed is a [`FormatError::Fault`] naming the
    /// file and the offset (each tensor's file is checked after the tensor is hashed),
    /// never a signal and never a manifest of zeros.
    pub fn build(ckpt: &Checkpoint, progress: &mut dyn FnMut(u64, u64)) -> Result<Manifest> {
        Self::build_parted(ckpt, PART_BYTES, progress)
    }

    /// [`Manifest::build`] with parts of about `part_bytes` (at least one row each).
    pub fn build_parted(
        ckpt: &Checkpoint,
        part_bytes: u64,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Manifest> {
        // Every page: its tensor, and the rows it holds where it is a part.
        let mut planned: Vec<(&str, &TensorLocation, Option<Rows>)> = Vec::new();
        for (name, loc) in ckpt.tensors() {
            match split_rows(ckpt, name, loc, part_bytes).or_else(|| split_experts(name, loc)) {
                None => planned.push((name, loc, None)),
                Some(per) => {
                    let rows = loc.info.shape[0] as u64;
                    planned.extend(row_parts(rows, per).map(|r| (name, loc, Some(r))));
                }
            }
        }
        let located: Vec<TensorLocation> = planned
            .iter()
            .map(|&(_, loc, rows)| narrow(loc, rows))
            .collect();
        let bodies: Vec<&[u8]> = located
            .iter()
            .map(|loc| ckpt.files[loc.file].tensor_bytes(&loc.info))
            .collect();
        let hashes = hash_all(&bodies, progress, &|i| {
            ckpt.files[located[i].file].check_faults()
        })?;
        let pages = planned
            .iter()
            .zip(&located)
            .zip(hashes)
            .enumerate()
            .map(|(i, ((&(name, _, rows), loc), hash))| PageEntry {
                id: u32::try_from(i).expect("fewer than 2^32 pages"),
                name: name.to_string(),
                dtype: loc.info.dtype,
                shape: loc.info.shape.clone(),
                file: ckpt.file_name(loc.file).to_string(),
                offset: loc.info.offset,
                len: loc.info.len,
                encoding: Encoding::Raw,
                blake3: hash.to_hex().to_string(),
                group: PageGroup::of_page(name, rows),
                encoded: Vec::new(),
                rows,
            })
            .collect();
        let mut m = Manifest {
            format_version: MANIFEST_VERSION,
            pages,
        };
        m.format_version = m.required_version();
        Ok(m)
    }

    /// Splits whole page `name` (a tensor of `ckpt` with at least one dimension) into
    /// parts of `rows_per_part` rows, each hashed from `ckpt`, and numbers the pages
    /// again in order. For tables [`Manifest::build`]'s rule keeps whole (a tied
    /// embedding, read whole as the output head every token, gains nothing from parts,
    /// but may be stored so); an encoded body of the page is dropped (pack again).
    pub fn split_table(&mut self, ckpt: &Checkpoint, name: &str, rows_per_part: u64) -> Result<()> {
        let missing = || FormatError::Missing {
            path: ckpt.dir.clone(),
            what: format!("a whole page '{name}' to split"),
        };
        let i = self
            .pages
            .iter()
            .position(|p| p.name == name && p.rows.is_none())
            .ok_or_else(missing)?;
        let loc = ckpt.get(name).ok_or_else(missing)?;
        let rows = *loc.info.shape.first().ok_or_else(missing)? as u64;
        let whole = self.pages.remove(i);
        let parts: Vec<PageEntry> = row_parts(rows, rows_per_part)
            .map(|r| {
                let part = narrow(loc, Some(r));
                let bytes = ckpt.files[part.file].tensor_bytes(&part.info);
                PageEntry {
                    shape: part.info.shape.clone(),
                    offset: part.info.offset,
                    len: part.info.len,
                    blake3: blake3::hash(bytes).to_hex().to_string(),
                    encoded: Vec::new(),
                    rows: Some(r),
                    ..whole.clone()
                }
            })
            .collect();
        ckpt.files[loc.file].check_faults()?;
        self.pages.splice(i..i, parts);
        for (k, p) in self.pages.iter_mut().enumerate() {
            p.id = u32::try_from(k).expect("fewer than 2^32 pages");
        }
        self.format_version = self.required_version();
        Ok(())
    }

    /// Where page `p`'s bytes are in `ckpt`: its tensor's location, narrowed to the
    /// page's rows when it is a part. `None` when the checkpoint has no such tensor;
    /// the narrowing is only meaningful for a manifest [`Manifest::check_matches`]
    /// accepted.
    pub fn locate(ckpt: &Checkpoint, p: &PageEntry) -> Option<TensorLocation> {
        ckpt.get(&p.name).map(|loc| narrow(loc, p.rows))
    }

    /// Reads `dir/voom-manifest.json`: `Ok(None)` when there is none; a manifest that
    /// is malformed, of another format version or internally inconsistent is an error,
    /// and so is one that is not a regular file (refused before it is opened: a FIFO
    /// would block the reader for good).
    pub fn load(dir: &Path) -> Result<Option<Manifest>> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = match crate::file::read_limited(&path, MANIFEST_MAX_BYTES) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(FormatError::io(&path, e)),
        };
        Self::from_bytes(&path, &bytes).map(Some)
    }

    /// Parses and checks manifest bytes read from `path` (named in errors), as
    /// [`Manifest::load`] does: for a reader that read the file itself (and hashes the
    /// very bytes it parsed).
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Manifest> {
        let path = path.to_path_buf();
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
        let v: Version = serde_json::from_slice(bytes).map_err(|e| malformed(e.to_string()))?;
        if !(MANIFEST_VERSION..=MANIFEST_VERSION_EXPERTS).contains(&v.format_version) {
            return Err(FormatError::Unsupported {
                path,
                what: format!(
                    "manifest format_version {} (this build reads {MANIFEST_VERSION} to \
                     {MANIFEST_VERSION_EXPERTS})",
                    v.format_version
                ),
            });
        }
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| malformed(e.to_string()))?;
        m.validate().map_err(malformed)?;
        Ok(m)
    }

    /// Checks what the schema cannot: unique names and ids, well-formed hashes and
    /// file names, ranges that do not overflow, lengths that match dtype and shape.
    fn validate(&self) -> std::result::Result<(), String> {
        let need = self.required_version();
        if self.format_version < need {
            let what = if need == MANIFEST_VERSION_EXPERTS {
                "name routed experts' pages"
            } else if need == MANIFEST_VERSION_PARTS {
                "list pages that hold part of a tensor"
            } else {
                "list encoded bodies"
            };
            return Err(format!(
                "format_version {} cannot {what} (that needs {need})",
                self.format_version
            ));
        }
        check_parts(&self.pages)?;
        let mut ids = HashSet::new();
        for p in &self.pages {
            let label = p.label();
            let page = &label;
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
            check_location(page, &p.file, p.offset, p.len)?;
            match p.encoding {
                Encoding::Raw if p.decoded_len() != Some(p.len) => {
                    return Err(format!(
                        "page '{page}': len {} does not match shape {:?} of {}",
                        p.len, p.shape, p.dtype
                    ));
                }
                Encoding::Raw => {}
                Encoding::Vpack => {
                    return Err(format!(
                        "page '{page}': encoding vpack at the page's own location (only raw; \
                         vpack bodies are listed under 'encoded')"
                    ));
                }
            }
            let mut seen = HashSet::new();
            for e in &p.encoded {
                if !seen.insert(e.encoding) {
                    return Err(format!(
                        "page '{page}': two encoded bodies of encoding {}",
                        e.encoding.as_str()
                    ));
                }
                check_location(page, &e.file, e.offset, e.len)?;
                match e.encoding {
                    Encoding::Raw => {
                        return Err(format!(
                            "page '{page}': an encoded body of encoding raw (the raw copy is \
                             the page's own location)"
                        ));
                    }
                    Encoding::Vpack if !vpack::supports(p.dtype) => {
                        return Err(format!(
                            "page '{page}': a vpack body for a {} page (vpack is BF16/F16 only)",
                            p.dtype
                        ));
                    }
                    Encoding::Vpack if e.len < vpack::HEADER_LEN as u64 => {
                        return Err(format!(
                            "page '{page}': vpack body of {} bytes is shorter than its header",
                            e.len
                        ));
                    }
                    Encoding::Vpack => {}
                }
            }
        }
        Ok(())
    }

    /// The lowest format version that describes this manifest: [`MANIFEST_VERSION`]
    /// unless a page lists encoded bodies ([`MANIFEST_VERSION_ENCODED`]) or holds part
    /// of a tensor ([`MANIFEST_VERSION_PARTS`]).
    pub fn required_version(&self) -> u32 {
        if self
            .pages
            .iter()
            .any(|p| matches!(p.group, PageGroup::Expert { .. }))
        {
            MANIFEST_VERSION_EXPERTS
        } else if self.pages.iter().any(|p| p.rows.is_some()) {
            MANIFEST_VERSION_PARTS
        } else if self.pages.iter().any(|p| !p.encoded.is_empty()) {
            MANIFEST_VERSION_ENCODED
        } else {
            MANIFEST_VERSION
        }
    }

    /// Whether the checkpoint has routed experts that this manifest does not page one
    /// expert at a time (a manifest built before format 4): every expert is then a
    /// trunk page to the planner and the caches, and the experts fused in one tensor
    /// (`mlp.experts.gate_up_proj`) are one page, read whole for any expert picked.
    /// Correct, but slow out of core: `vpagectl hash` writes the manifest anew.
    pub fn experts_ungrouped(&self) -> bool {
        let grouped = self
            .pages
            .iter()
            .any(|p| matches!(p.group, PageGroup::Expert { .. }));
        !grouped
            && self.pages.iter().any(|p| {
                matches!(PageGroup::of_tensor(&p.name), PageGroup::Expert { .. })
                    || is_fused_experts(&p.name)
            })
    }

    /// Writes `dir/voom-manifest.json` atomically (temporary file, then rename).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let json = serde_json::to_vec_pretty(self).expect("a manifest serializes");
        write_atomically(&dir.join(MANIFEST_FILE), |w| {
            w.write_all(&json)?;
            w.write_all(b"\n")
        })
    }

    /// The page called `name`: the tensor's first part where it is split
    /// ([`Manifest::parts`] gives them all).
    pub fn page(&self, name: &str) -> Option<&PageEntry> {
        self.parts(name).into_iter().next()
    }

    /// The pages of tensor `name` in row order: one for a whole tensor, its parts for
    /// a split one, none for a name the manifest lacks.
    pub fn parts(&self, name: &str) -> Vec<&PageEntry> {
        let mut out: Vec<&PageEntry> = self.pages.iter().filter(|p| p.name == name).collect();
        out.sort_by_key(|p| p.rows.map(|r| r.start));
        out
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
        let mut pages: HashMap<&str, Vec<&PageEntry>> = HashMap::new();
        for p in &self.pages {
            pages.entry(p.name.as_str()).or_default().push(p);
        }
        for (name, loc) in ckpt.tensors() {
            let Some(parts) = pages.get(name) else {
                return Err(stale(format!("tensor '{name}' has no page")));
            };
            let rows = loc.info.shape.first().map(|&n| n as u64);
            let covered = parts.iter().filter_map(|p| p.rows).map(|r| r.end()).max();
            if let (Some(end), Some(rows)) = (covered, rows) {
                if end != rows {
                    return Err(stale(format!(
                        "the parts of '{name}' cover rows 0..{end} of its {rows}"
                    )));
                }
            }
            for p in parts {
                if p.rows.is_some() && rows.is_none() {
                    return Err(stale(format!(
                        "page '{}': the checkpoint's tensor has no rows to part",
                        p.label()
                    )));
                }
                let file = ckpt.file_name(loc.file);
                let narrowed = narrow(loc, p.rows);
                let t = &narrowed.info;
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
                    return Err(stale(format!("page '{}': {d}", p.label())));
                }
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
    /// that does not describe `ckpt` is an error ([`Manifest::check_matches`]), and so
    /// is a file truncated while it is hashed ([`FormatError::Fault`]).
    pub fn verify_checkpoint(
        &self,
        ckpt: &Checkpoint,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Vec<FormatError>> {
        self.check_matches(ckpt)?;
        let mut pages: Vec<&PageEntry> = self.pages.iter().collect();
        pages.sort_by_key(|p| (&p.name, p.rows.map(|r| r.start)));
        let locs: Vec<_> = pages
            .iter()
            .map(|p| Self::locate(ckpt, p).expect("check_matches found every page"))
            .collect();
        let bodies: Vec<&[u8]> = locs
            .iter()
            .map(|loc| ckpt.files[loc.file].tensor_bytes(&loc.info))
            .collect();
        let hashes = hash_all(&bodies, progress, &|i| {
            ckpt.files[locs[i].file].check_faults()
        })?;
        Ok(pages
            .iter()
            .zip(locs)
            .zip(hashes)
            .filter_map(|((p, loc), h)| check_hash(p, &h, ckpt.file_path(&loc)).err())
            .collect())
    }

    /// Decodes every encoded body (vpack) the manifest lists, from files in `dir`, and
    /// checks the decoded bytes against each page's blake3, on all cores. Returns one
    /// error per bad page in page-name order: a `ChecksumMismatch` naming the page and
    /// the body's file, or a `BadTensor` naming both for a body that runs past the end
    /// of its file, does not decode, or decodes to the wrong length. A body file that
    /// cannot be opened is one `Io` error naming it. `progress(done, total)` counts
    /// decoded bytes.
    pub fn verify_encoded(
        &self,
        dir: &Path,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Vec<FormatError>> {
        let mut work: Vec<(&PageEntry, &EncodedBody)> = self
            .pages
            .iter()
            .flat_map(|p| p.encoded.iter().map(move |e| (p, e)))
            .collect();
        work.sort_by(|a, b| a.0.name.cmp(&b.0.name));
        let mut errors = Vec::new();
        // Open each body file once; pages in a file that cannot be opened are skipped.
        let mut files: HashMap<&str, Option<(std::fs::File, u64)>> = HashMap::new();
        for (_, e) in &work {
            files.entry(e.file.as_str()).or_insert_with(|| {
                // A regular file only: a FIFO in its place would block for good.
                let path = dir.join(&e.file);
                let opened = crate::file::open(&path)
                    .and_then(|f| Ok((f.metadata()?.len(), f)))
                    .map(|(len, f)| (f, len));
                match opened {
                    Ok(opened) => Some(opened),
                    Err(err) => {
                        errors.push(FormatError::io(&path, err));
                        None
                    }
                }
            });
        }
        work.retain(|(_, e)| files[e.file.as_str()].is_some());
        let total: u64 = work.iter().map(|(p, _)| p.decoded_len().unwrap_or(0)).sum();
        progress(0, total);
        let workers = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(work.len())
            .max(1);
        let next = AtomicUsize::new(0);
        let mut results: Vec<Option<FormatError>> = (0..work.len()).map(|_| None).collect();
        std::thread::scope(|s| {
            let (tx, rx) = mpsc::channel();
            for _ in 0..workers {
                let tx = tx.clone();
                let (next, work, files) = (&next, &work, &files);
                s.spawn(move || {
                    let (mut body, mut out) = (Vec::new(), Vec::new());
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(page, enc)) = work.get(i) else {
                            break;
                        };
                        let (file, file_len) =
                            files[enc.file.as_str()].as_ref().expect("opened above");
                        let path = dir.join(&enc.file);
                        let r =
                            check_encoded(page, enc, file, *file_len, &path, &mut body, &mut out);
                        // The receiver lives until every sender is gone.
                        let _ = tx.send((i, page.decoded_len().unwrap_or(0), r.err()));
                    }
                });
            }
            drop(tx);
            let mut done = 0;
            for (i, n, err) in rx {
                done += n;
                progress(done, total);
                results[i] = err;
            }
        });
        errors.extend(results.into_iter().flatten());
        Ok(errors)
    }

    /// Total bytes of all pages as stored.
    pub fn total_bytes(&self) -> u64 {
        self.pages.iter().map(|p| p.len).sum()
    }
}

/// The rows per part [`Manifest::build`] splits tensor `name` into, or `None` to keep
/// it one page. Split: an embedding table (2-D, [`PageGroup::Embedding`]) of at
/// least two [`PART_BYTES`] whose checkpoint has a separate output head of the same
/// shape, so that the table is only ever read a row per token; parts of about
/// [`PART_BYTES`] each let a store that loads whole pages read one part per token
/// instead of the table. A table that is also the output head (tied embeddings) is
/// read whole every token and stays one page.
fn split_rows(ckpt: &Checkpoint, name: &str, loc: &TensorLocation, part_bytes: u64) -> Option<u64> {
    let shape = &loc.info.shape;
    if PageGroup::of_tensor(name) != PageGroup::Embedding
        || shape.len() != 2
        || shape[0] < 2
        || loc.info.len < part_bytes.saturating_mul(2)
    {
        return None;
    }
    let untied = ckpt.tensors().any(|(other, o)| {
        other != name && PageGroup::of_tensor(other) == PageGroup::Final && o.info.shape == *shape
    });
    if !untied {
        return None;
    }
    let row = loc.info.len / shape[0] as u64;
    Some((part_bytes / row.max(1)).max(1))
}

/// One row per part for a block's routed experts fused in one tensor
/// ([`is_fused_experts`], at least two experts along its first dimension), so that each
/// expert is a page of its own and a token reads only those its router picks; `None`
/// for any other tensor.
fn split_experts(name: &str, loc: &TensorLocation) -> Option<u64> {
    let shape = &loc.info.shape;
    (is_fused_experts(name) && shape.len() >= 2 && shape[0] >= 2).then_some(1)
}

/// Each tensor is one whole page or parts that follow each other: rows from 0 in
/// order, one dtype, file and row shape, each part's bytes right after the previous
/// part's. (That they cover the whole tensor is checked against the checkpoint, by
/// [`Manifest::check_matches`].)
fn check_parts(pages: &[PageEntry]) -> std::result::Result<(), String> {
    let mut by_name: HashMap<&str, Vec<&PageEntry>> = HashMap::new();
    for p in pages {
        by_name.entry(p.name.as_str()).or_default().push(p);
    }
    for (name, mut ps) in by_name {
        if ps.len() == 1 && ps[0].rows.is_none() {
            continue;
        }
        if ps.iter().any(|p| p.rows.is_none()) {
            return Err(format!("page '{name}' listed twice"));
        }
        ps.sort_by_key(|p| p.rows.map(|r| r.start));
        let mut next_row = 0u64;
        let mut next_byte = None;
        for p in &ps {
            let r = p.rows.expect("checked above");
            let label = p.label();
            if r.start != next_row {
                return Err(format!(
                    "page '{label}': parts of '{name}' must cover rows from 0 in order, \
                     but the rows before it end at {next_row}"
                ));
            }
            if r.count == 0 || p.shape.first().map(|&n| n as u64) != Some(r.count) {
                return Err(format!(
                    "page '{label}': shape {:?} does not hold its {} rows",
                    p.shape, r.count
                ));
            }
            let first = ps[0];
            if p.dtype != first.dtype || p.file != first.file || p.shape[1..] != first.shape[1..] {
                return Err(format!(
                    "page '{label}': dtype, file or row shape differs from the tensor's first part"
                ));
            }
            if next_byte.is_some_and(|b| b != p.offset) {
                return Err(format!(
                    "page '{label}': starts at byte {}, not where the part before it ends",
                    p.offset
                ));
            }
            next_row = r.end();
            next_byte = p.offset.checked_add(p.len);
        }
    }
    Ok(())
}

/// Rows `0..rows` in consecutive parts of `per` rows (at least one), the last one
/// shorter where they do not divide.
fn row_parts(rows: u64, per: u64) -> impl Iterator<Item = Rows> {
    let per = per.max(1);
    (0..rows.div_ceil(per)).map(move |k| {
        let start = k * per;
        Rows {
            start,
            count: per.min(rows - start),
        }
    })
}

/// `loc` narrowed to `rows` of its first dimension (all of it for `None`).
fn narrow(loc: &TensorLocation, rows: Option<Rows>) -> TensorLocation {
    let Some(r) = rows else {
        return loc.clone();
    };
    let t = &loc.info;
    let all = t.shape.first().copied().unwrap_or(0).max(1) as u64;
    let row = t.len / all;
    let mut info = t.clone();
    info.offset = t.offset + r.start * row;
    info.len = r.count * row;
    info.shape[0] = r.count as usize;
    TensorLocation {
        file: loc.file,
        info,
    }
}

/// A page's (or encoded body's) file must be a plain relative path and its range must
/// not overflow.
fn check_location(
    page: &str,
    file: &str,
    offset: u64,
    len: u64,
) -> std::result::Result<(), String> {
    if file.is_empty()
        || file.contains('\\')
        || !Path::new(file)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
    {
        return Err(format!(
            "page '{page}': file '{file}' is not a plain path inside the model directory"
        ));
    }
    if offset.checked_add(len).is_none() {
        return Err(format!("page '{page}': offset + len overflows"));
    }
    Ok(())
}

/// Reads `enc` (a body of `page`) from `file`, decodes it into `out` and checks its hash.
fn check_encoded(
    page: &PageEntry,
    enc: &EncodedBody,
    file: &std::fs::File,
    file_len: u64,
    path: &Path,
    body: &mut Vec<u8>,
    out: &mut Vec<u8>,
) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let bad = |detail: String| FormatError::BadTensor {
        path: path.to_path_buf(),
        tensor: page.label(),
        detail,
    };
    let end = enc.offset + enc.len; // validated not to overflow
    if end > file_len {
        return Err(bad(format!(
            "{} body at bytes {}..{end} runs past the end of the file ({file_len} bytes)",
            enc.encoding.as_str(),
            enc.offset
        )));
    }
    let len = usize::try_from(enc.len).map_err(|_| {
        bad(format!(
            "{} body of {} bytes",
            enc.encoding.as_str(),
            enc.len
        ))
    })?;
    body.clear();
    body.resize(len, 0);
    file.read_exact_at(body, enc.offset)
        .map_err(|e| bad(format!("reading bytes {}..{end}: {e}", enc.offset)))?;
    match enc.encoding {
        Encoding::Raw => Manifest::verify(page, body, path),
        Encoding::Vpack => {
            let header = vpack::Header::parse(body).map_err(|e| e.in_page(path, &page.label()))?;
            if header.dtype != page.dtype || Some(header.decoded_len() as u64) != page.decoded_len()
            {
                return Err(bad(format!(
                    "vpack body holds {} bytes of {}, the page is {:?} bytes of {}",
                    header.decoded_len(),
                    header.dtype,
                    page.decoded_len(),
                    page.dtype
                )));
            }
            out.clear();
            out.resize(header.decoded_len(), 0);
            vpack::decode(body, out).map_err(|e| e.in_page(path, &page.label()))?;
            Manifest::verify(page, out, path)
        }
    }
}

fn check_hash(entry: &PageEntry, actual: &blake3::Hash, path: &Path) -> Result<()> {
    let actual = actual.to_hex();
    if entry.blake3.eq_ignore_ascii_case(actual.as_str()) {
        Ok(())
    } else {
        Err(FormatError::ChecksumMismatch {
            path: path.to_path_buf(),
            page: entry.label(),
            expected: entry.blake3.clone(),
            actual: actual.to_string(),
        })
    }
}

enum Msg {
    Hashed(u64),
    Done(usize, blake3::Hash),
    Failed(FormatError),
}

/// blake3 of every body, hashed by a pool of scoped threads that take bodies largest
/// first (so one huge embedding does not end up last on one core). Progress is reported
/// on the calling thread because `progress` need not be `Send`. `check(i)` runs after
/// body `i` is hashed (the fault check of its mapping): its first error stops the work
/// and is returned.
fn hash_all(
    bodies: &[&[u8]],
    progress: &mut dyn FnMut(u64, u64),
    check: &(dyn Fn(usize) -> Result<()> + Sync),
) -> Result<Vec<blake3::Hash>> {
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
    let mut failure = None;
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
                if let Err(e) = check(i) {
                    // No worker takes another body.
                    next.store(order.len(), Ordering::Relaxed);
                    let _ = tx.send(Msg::Failed(e));
                    break;
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
                Msg::Failed(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(hashes
        .into_iter()
        .map(|h| h.expect("every body was hashed"))
        .collect())
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
            (
                "model.layers.61.mlp.experts.3.down_proj.weight",
                Expert {
                    layer: 61,
                    expert: 3,
                },
            ),
            (
                "model.layers.2.block_sparse_moe.experts.0.w1.weight",
                Expert {
                    layer: 2,
                    expert: 0,
                },
            ),
            ("model.layers.5.mlp.experts.gate_up_proj", Layer(5)),
            (
                "model.layers.5.mlp.shared_experts.gate_proj.weight",
                Layer(5),
            ),
            ("model.layers.5.mlp.gate.weight", Layer(5)),
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
        let m = Manifest::build(&c, &mut |done, total| calls.push((done, total))).unwrap();
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
        let m = Manifest::build(&c, &mut |_, _| {}).unwrap();
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
        let m = Manifest::build(&c, &mut |_, _| {}).unwrap();
        m.save(d.path()).unwrap();
        assert_eq!(Manifest::load(d.path()).unwrap(), Some(m.clone()));
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.path().join(MANIFEST_FILE)).unwrap()).unwrap();
        assert_eq!(json["pages"][0]["encoding"], "raw");
        assert_eq!(json["pages"][0]["group"], "final"); // lm_head.weight sorts first
        assert_eq!(json["pages"][2]["group"]["layer"], 0);
        assert_eq!(json["pages"][2]["dtype"], "BF16");
    }

    /// A FIFO in place of the manifest (or of a vpack body file) is an error naming
    /// it, found without opening it: opening a FIFO blocks until a writer comes.
    #[test]
    fn a_fifo_manifest_is_refused_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        let c = model(d.path());
        let path = d.path().join(MANIFEST_FILE);
        let st = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(st.success());
        let e = Manifest::load(d.path()).unwrap_err();
        assert!(
            e.to_string().contains(MANIFEST_FILE)
                && e.to_string().contains("is a FIFO, not a regular file"),
            "{e}"
        );
        std::fs::remove_file(&path).unwrap();
        let mut m = Manifest::build(&c, &mut |_, _| {}).unwrap();
        m.pages[0].encoded.push(EncodedBody {
            encoding: Encoding::Vpack,
            file: vpack::PACK_FILE.into(),
            offset: 0,
            len: 1,
        });
        let st = std::process::Command::new("mkfifo")
            .arg(d.path().join(vpack::PACK_FILE))
            .status()
            .unwrap();
        assert!(st.success());
        let errors = m.verify_encoded(d.path(), &mut |_, _| {}).unwrap();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].to_string().contains("FIFO"), "{}", errors[0]);
    }

    /// Routed experts fused in one tensor (as transformers 5 can save them) are paged
    /// one expert per page, each named by its expert's group; experts stored one
    /// tensor each are named so too; the manifest needs the experts' format version
    /// and one that claims an older one is refused.
    #[test]
    fn routed_experts_are_pages_of_their_own() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny");
        let fused = Checkpoint::open(&fixtures.join("qwen3_moe_fused_sparse_step")).unwrap();
        let m = Manifest::build(&fused, &mut |_, _| {}).unwrap();
        assert_eq!(m.format_version, MANIFEST_VERSION_EXPERTS);
        for name in [
            "model.layers.1.mlp.experts.gate_up_proj",
            "model.layers.1.mlp.experts.down_proj",
        ] {
            let parts = m.parts(name);
            assert_eq!(parts.len(), 8, "{name}");
            let whole = fused.get(name).unwrap().info.clone();
            for (e, p) in parts.iter().enumerate() {
                assert_eq!(
                    p.group,
                    PageGroup::Expert {
                        layer: 1,
                        expert: e as u32
                    }
                );
                assert_eq!(p.rows.unwrap().start, e as u64);
                assert_eq!(p.shape[0], 1);
                assert_eq!(p.len, whole.len / 8);
                assert_eq!(p.offset, whole.offset + e as u64 * whole.len / 8);
            }
        }
        assert_eq!(
            m.page("model.layers.1.mlp.gate.weight").unwrap().group,
            PageGroup::Layer(1)
        );
        m.check_matches(&fused).unwrap();

        let separate = Checkpoint::open(&fixtures.join("qwen3_moe_dense_layer")).unwrap();
        let m = Manifest::build(&separate, &mut |_, _| {}).unwrap();
        let p = m
            .page("model.layers.2.mlp.experts.5.up_proj.weight")
            .unwrap();
        assert_eq!(
            (p.group, p.rows),
            (
                PageGroup::Expert {
                    layer: 2,
                    expert: 5
                },
                None
            )
        );
        assert_eq!(m.format_version, MANIFEST_VERSION_EXPERTS);

        let d = tempfile::tempdir().unwrap();
        let mut v = serde_json::to_value(&m).unwrap();
        v["format_version"] = MANIFEST_VERSION_PARTS.into();
        let e = load_err(d.path(), &v.to_string()).to_string();
        assert!(e.contains("cannot name routed experts' pages"), "{e}");

        // A manifest built before experts had pages of their own: the same pages in
        // their layers' group, format 3. It loads, and says its experts are ungrouped.
        assert!(!m.experts_ungrouped());
        let mut old = m.clone();
        for p in &mut old.pages {
            if let PageGroup::Expert { layer, .. } = p.group {
                p.group = PageGroup::Layer(layer);
            }
        }
        old.format_version = MANIFEST_VERSION_PARTS;
        old.save(d.path()).unwrap();
        let old = Manifest::load(d.path()).unwrap().unwrap();
        assert!(old.experts_ungrouped());
        let dense = Manifest::build(
            &Checkpoint::open(&fixtures.join("llama_gqa_untied")).unwrap(),
            &mut |_, _| {},
        )
        .unwrap();
        assert!(!dense.experts_ungrouped());
    }

    fn load_err(dir: &Path, json: &str) -> FormatError {
        std::fs::write(dir.join(MANIFEST_FILE), json).unwrap();
        Manifest::load(dir).unwrap_err()
    }

    #[test]
    fn load_rejects_malformed_manifests() {
        let d = tempfile::tempdir().unwrap();
        let c = model(d.path());
        let m = Manifest::build(&c, &mut |_, _| {}).unwrap();
        let good = serde_json::to_value(&m).unwrap();

        let e = load_err(d.path(), "{not json");
        assert!(matches!(e, FormatError::Malformed { .. }), "{e}");
        let e = load_err(d.path(), r#"{"format_version":5,"pages":[]}"#);
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

    /// Packs every BF16 page of `m` into `dir/model.vpack` the way `vpagectl pack` does.
    fn pack(dir: &Path, c: &Checkpoint, m: &mut Manifest) {
        let path = dir.join(vpack::PACK_FILE);
        let mut bodies = vec![];
        vpack::write_pack_file::<FormatError>(&path, |w| {
            for (i, p) in m.pages.iter().enumerate() {
                if vpack::supports(p.dtype) {
                    let body = vpack::encode(p.dtype, c.tensor_bytes(&p.name).unwrap()).unwrap();
                    bodies.push((i, w.push(&body)?, body.len() as u64));
                }
            }
            Ok(())
        })
        .unwrap();
        for (i, offset, len) in bodies {
            m.pages[i].encoded = vec![EncodedBody {
                encoding: Encoding::Vpack,
                file: vpack::PACK_FILE.into(),
                offset,
                len,
            }];
        }
        m.format_version = m.required_version();
    }

    #[test]
    fn encoded_bodies_round_trip_and_verify() {
        let d = tempfile::tempdir().unwrap();
        let c = model(d.path());
        let mut m = Manifest::build(&c, &mut |_, _| {}).unwrap();
        assert_eq!(m.required_version(), MANIFEST_VERSION);
        pack(d.path(), &c, &mut m);
        assert_eq!(m.format_version, MANIFEST_VERSION_ENCODED);
        m.save(d.path()).unwrap();
        let loaded = Manifest::load(d.path()).unwrap().unwrap();
        assert_eq!(loaded, m);
        m.check_matches(&c).unwrap();
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.path().join(MANIFEST_FILE)).unwrap()).unwrap();
        assert_eq!(json["format_version"], 2);
        assert!(
            json["pages"][0].get("encoded").is_none(),
            "F32 lm_head stays raw"
        );
        assert_eq!(json["pages"][1]["encoded"][0]["encoding"], "vpack");
        assert_eq!(json["pages"][1]["encoded"][0]["file"], "model.vpack");
        assert_eq!(json["pages"][2]["encoded"][0]["offset"], vpack::PACK_ALIGN);

        let mut last = (0, 0);
        let errs = m
            .verify_encoded(d.path(), &mut |a, b| last = (a, b))
            .unwrap();
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(last, (100, 100), "three BF16 pages: 64 + 32 + 4 bytes");

        // A flipped byte in the raw low plane of the q_proj body: a checksum mismatch
        // naming the page and model.vpack.
        let q = m.page("model.layers.0.self_attn.q_proj.weight").unwrap();
        let body = q.vpack().unwrap();
        let pack_path = d.path().join(vpack::PACK_FILE);
        let mut file = std::fs::read(&pack_path).unwrap();
        let at = (body.offset + body.len - 1) as usize;
        file[at] ^= 0x40;
        std::fs::write(&pack_path, &file).unwrap();
        let errs = m.verify_encoded(d.path(), &mut |_, _| {}).unwrap();
        assert_eq!(errs.len(), 1, "{errs:?}");
        match &errs[0] {
            FormatError::ChecksumMismatch { path, page, .. } => {
                assert_eq!(page, &q.name);
                assert_eq!(path, &pack_path);
            }
            e => panic!("{e}"),
        }
        file[at] ^= 0x40;
        // A broken header: a typed error naming page and file.
        file[body.offset as usize] = b'X';
        std::fs::write(&pack_path, &file).unwrap();
        let errs = m.verify_encoded(d.path(), &mut |_, _| {}).unwrap();
        let e = errs[0].to_string();
        assert!(
            e.contains("q_proj") && e.contains("bad magic") && e.contains("model.vpack"),
            "{e}"
        );

        // Truncated: every body past the new end is named.
        std::fs::write(&pack_path, &file[..vpack::PACK_ALIGN as usize + 10]).unwrap();
        let errs = m.verify_encoded(d.path(), &mut |_, _| {}).unwrap();
        let text: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        assert_eq!(errs.len(), 2, "{text:?}");
        assert!(
            text.iter()
                .any(|e| e.contains("runs past the end of the file")),
            "{text:?}"
        );

        // Missing: one I/O error naming the file.
        std::fs::remove_file(&pack_path).unwrap();
        let errs = m.verify_encoded(d.path(), &mut |_, _| {}).unwrap();
        assert_eq!(errs.len(), 1);
        assert!(matches!(&errs[0], FormatError::Io { path, .. } if path == &pack_path));
    }

    #[test]
    fn load_checks_encoded_bodies() {
        let d = tempfile::tempdir().unwrap();
        let c = model(d.path());
        let mut m = Manifest::build(&c, &mut |_, _| {}).unwrap();
        pack(d.path(), &c, &mut m);
        let good = serde_json::to_value(&m).unwrap();
        let mutate = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = good.clone();
            f(&mut v);
            load_err(d.path(), &v.to_string()).to_string()
        };
        let e = mutate(&|v| v["format_version"] = 1.into());
        assert!(
            e.contains("format_version 1 cannot list encoded bodies"),
            "{e}"
        );
        let e = mutate(&|v| v["pages"][1]["encoded"][0]["encoding"] = "raw".into());
        assert!(e.contains("encoding raw"), "{e}");
        let e = mutate(&|v| {
            let b = v["pages"][1]["encoded"][0].clone();
            v["pages"][1]["encoded"].as_array_mut().unwrap().push(b);
        });
        assert!(e.contains("two encoded bodies"), "{e}");
        let e = mutate(&|v| v["pages"][0]["encoded"] = v["pages"][1]["encoded"].clone());
        assert!(e.contains("vpack body for a F32 page"), "{e}");
        let e = mutate(&|v| v["pages"][1]["encoded"][0]["file"] = "/abs".into());
        assert!(e.contains("not a plain path"), "{e}");
        let e = mutate(&|v| v["pages"][1]["encoded"][0]["len"] = 5.into());
        assert!(e.contains("shorter than its header"), "{e}");
        let e = mutate(&|v| v["pages"][1]["encoding"] = "vpack".into());
        assert!(e.contains("own location"), "{e}");
        let e = mutate(&|v| v["pages"][1]["encoded"][0]["extra"] = 1.into());
        assert!(e.contains("unknown field"), "{e}");
        // A raw-only manifest of format version 1 (what older builds wrote) still loads,
        // and so does one that says 2 without any encoded body.
        let raw = Manifest::build(&c, &mut |_, _| {}).unwrap();
        raw.save(d.path()).unwrap();
        let text = std::fs::read_to_string(d.path().join(MANIFEST_FILE)).unwrap();
        assert!(text.contains("\"format_version\": 1") && !text.contains("encoded"));
        assert_eq!(Manifest::load(d.path()).unwrap().unwrap(), raw);
        let mut v = serde_json::to_value(&raw).unwrap();
        v["format_version"] = 2.into();
        std::fs::write(d.path().join(MANIFEST_FILE), v.to_string()).unwrap();
        assert!(Manifest::load(d.path()).unwrap().is_some());
    }

    #[test]
    fn check_matches_names_the_first_difference() {
        let d = tempfile::tempdir().unwrap();
        let c = model(d.path());
        let m = Manifest::build(&c, &mut |_, _| {}).unwrap();
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
        let h = hash_all(&bodies, &mut |d, t| last = (d, t), &|_| Ok(())).unwrap();
        assert_eq!(last, (big.len() as u64 + 3, big.len() as u64 + 3));
        for (b, h) in bodies.iter().zip(&h) {
            assert_eq!(*h, blake3::hash(b));
        }
        assert!(hash_all(&[], &mut |_, _| {}, &|_| Ok(()))
            .unwrap()
            .is_empty());
    }

    /// Defect 4 while hashing: a checkpoint truncated after it was opened is an error
    /// naming the file and the offset, from try_build and verify_checkpoint alike.
    #[test]
    fn sigbus_a_file_truncated_while_hashed_is_an_error_naming_file_and_offset() {
        let d = tempfile::tempdir().unwrap();
        let big: Vec<u8> = (0..(256 << 10)).map(|i| (i % 253) as u8).collect();
        let f = d.path().join("model.safetensors");
        write(
            &f,
            &[
                ("a.weight", DType::U8, &[16], &big[..16]),
                ("b.weight", DType::U8, &[big.len()], &big),
            ],
            &BTreeMap::new(),
        )
        .unwrap();
        let ckpt = Checkpoint::open(d.path()).unwrap();
        let m = Manifest::build(&ckpt, &mut |_, _| {}).unwrap();
        let b = ckpt.get("b.weight").unwrap().info.clone();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .unwrap()
            .set_len(b.offset + 8192)
            .unwrap();
        for e in [
            Manifest::build(&ckpt, &mut |_, _| {}).unwrap_err(),
            m.verify_checkpoint(&ckpt, &mut |_, _| {}).unwrap_err(),
        ] {
            match &e {
                FormatError::Fault { path, offset } => {
                    assert_eq!(path, &f);
                    assert!(
                        *offset >= b.offset + 8192 && *offset < b.offset + b.len,
                        "{e}"
                    );
                }
                other => panic!("expected a fault, got {other:?}"),
            }
            assert!(e.to_string().contains("model.safetensors"), "{e}");
        }
    }

    /// A checkpoint with an embedding table of `rows` rows of 4 KiB (BF16, 2048
    /// columns) and, when `untied`, an output head of the same shape.
    fn table_model(dir: &Path, rows: usize, untied: bool) -> Checkpoint {
        let emb: Vec<u8> = (0..rows * 4096)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(7) as u8)
            .collect();
        let norm = [1u8, 2, 3, 4];
        let shape = [rows, 2048];
        let mut tensors: Vec<(&str, DType, &[usize], &[u8])> = vec![
            ("model.embed_tokens.weight", DType::BF16, &shape, &emb),
            ("model.norm.weight", DType::BF16, &[2], &norm),
        ];
        if untied {
            tensors.push(("lm_head.weight", DType::BF16, &shape, &emb));
        }
        write(&dir.join("model.safetensors"), &tensors, &BTreeMap::new()).unwrap();
        Checkpoint::open(dir).unwrap()
    }

    #[test]
    fn an_untied_embedding_table_is_split_into_row_parts_each_hashed() {
        let d = tempfile::tempdir().unwrap();
        let c = table_model(d.path(), 600, true);
        let m = Manifest::build(&c, &mut |_, _| {}).unwrap();
        assert_eq!(m.format_version, MANIFEST_VERSION_PARTS);
        let parts = m.parts("model.embed_tokens.weight");
        let rows: Vec<_> = parts.iter().map(|p| p.rows.unwrap()).collect();
        assert_eq!(
            rows,
            [(0, 256), (256, 256), (512, 88)].map(|(start, count)| Rows { start, count })
        );
        let t = c.get("model.embed_tokens.weight").unwrap().info.clone();
        let all = c.tensor_bytes("model.embed_tokens.weight").unwrap();
        for p in &parts {
            let r = p.rows.unwrap();
            assert_eq!(p.shape, [r.count as usize, 2048]);
            assert_eq!(p.offset, t.offset + r.start * 4096);
            assert_eq!(p.len, r.count * 4096);
            assert_eq!(p.group, PageGroup::Embedding);
            let bytes = &all[(r.start * 4096) as usize..(r.end() * 4096) as usize];
            assert_eq!(p.blake3, blake3::hash(bytes).to_hex().to_string());
        }
        assert_eq!(m.page("model.embed_tokens.weight"), Some(parts[0]));
        assert_eq!(parts[1].label(), "model.embed_tokens.weight rows 256..512");
        // The head and the norm stay whole; ids run in name order, parts in row order.
        assert_eq!(m.parts("lm_head.weight").len(), 1);
        let ids: Vec<u32> = m.pages.iter().map(|p| p.id).collect();
        assert_eq!(ids, (0..m.pages.len() as u32).collect::<Vec<_>>());
        assert_eq!(m.pages.len(), 5);

        m.save(d.path()).unwrap();
        let back = Manifest::load(d.path()).unwrap().unwrap();
        assert_eq!(back, m);
        back.check_matches(&c).unwrap();
        assert!(back
            .verify_checkpoint(&c, &mut |_, _| {})
            .unwrap()
            .is_empty());

        // A flipped bit in the second part is that part's mismatch, named by its rows.
        drop(c);
        let path = d.path().join("model.safetensors");
        let mut f = std::fs::read(&path).unwrap();
        f[(t.offset + 300 * 4096) as usize] ^= 1;
        std::fs::write(&path, f).unwrap();
        let c = Checkpoint::open(d.path()).unwrap();
        let bad = back.verify_checkpoint(&c, &mut |_, _| {}).unwrap();
        assert_eq!(bad.len(), 1, "{bad:?}");
        assert!(bad[0].to_string().contains("rows 256..512"), "{}", bad[0]);
    }

    #[test]
    fn a_tied_or_small_table_stays_one_page() {
        let d = tempfile::tempdir().unwrap();
        let c = table_model(d.path(), 600, false);
        let m = Manifest::build(&c, &mut |_, _| {}).unwrap();
        assert_eq!(m.format_version, MANIFEST_VERSION);
        assert!(m.pages.iter().all(|p| p.rows.is_none()));
        let d = tempfile::tempdir().unwrap();
        let c = table_model(d.path(), 500, true); // under two parts' bytes
        let m = Manifest::build(&c, &mut |_, _| {}).unwrap();
        assert!(m.pages.iter().all(|p| p.rows.is_none()));
    }

    #[test]
    fn parts_that_do_not_tile_their_tensor_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let c = table_model(d.path(), 600, true);
        let m = Manifest::build(&c, &mut |_, _| {}).unwrap();
        let good = serde_json::to_value(&m).unwrap();
        // Pages 0..3 are the table's parts (name order: model.embed... after lm_head).
        let first = m
            .pages
            .iter()
            .position(|p| p.name == "model.embed_tokens.weight")
            .unwrap();
        let mutate = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = good.clone();
            f(&mut v);
            load_err(d.path(), &v.to_string()).to_string()
        };
        let (a, b) = (first, first + 1);
        let e = mutate(&|v| v["format_version"] = 2.into());
        assert!(e.contains("part of a tensor"), "{e}");
        let e = mutate(&|v| v["pages"][b]["rows"]["start"] = 300.into());
        assert!(e.contains("cover rows from 0 in order"), "{e}");
        let e = mutate(&|v| v["pages"][b]["offset"] = (m.pages[b].offset + 2).into());
        assert!(e.contains("not where the part before it ends"), "{e}");
        let e = mutate(&|v| v["pages"][a]["rows"]["count"] = 200.into());
        assert!(e.contains("does not hold its 200 rows"), "{e}");
        let e = mutate(&|v| {
            v["pages"][b].as_object_mut().unwrap().remove("rows");
        });
        assert!(e.contains("listed twice"), "{e}");
        // Parts that stop short of the tensor's rows load, and are stale against it.
        let mut short = m.clone();
        short.pages.remove(first + 2);
        for (i, p) in short.pages.iter_mut().enumerate() {
            p.id = i as u32;
        }
        short.save(d.path()).unwrap();
        let e = Manifest::load(d.path()).unwrap().unwrap().check_matches(&c);
        let e = e.unwrap_err().to_string();
        assert!(e.contains("cover rows 0..512 of its 600"), "{e}");
    }

    #[test]
    fn row_parts_pack_and_verify_like_whole_pages() {
        let d = tempfile::tempdir().unwrap();
        let c = table_model(d.path(), 600, true);
        let mut m = Manifest::build(&c, &mut |_, _| {}).unwrap();
        m.save(d.path()).unwrap();
        drop(c);
        let report = crate::pack::pack_model(d.path(), &mut m, &mut |_, _| {}).unwrap();
        assert_eq!(report.pages, 5, "three parts, the head and the norm");
        assert!(m
            .parts("model.embed_tokens.weight")
            .iter()
            .all(|p| p.vpack().is_some()));
        let back = Manifest::load(d.path()).unwrap().unwrap();
        assert_eq!(back.format_version, MANIFEST_VERSION_PARTS);
        assert!(back
            .verify_encoded(d.path(), &mut |_, _| {})
            .unwrap()
            .is_empty());
    }
}

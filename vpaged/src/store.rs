//! The store core: model stores (manifest + tiers) over one page cache.
//!
//! The daemon serves engines from it over its socket; [`StoreSource`] serves an
//! engine in the same process through the [`PageSource`] seam. Every page enters the
//! cache through [`PageLoader`]: read from the fastest tier holding a copy, verified
//! against the manifest before it becomes visible.
//!
//! A model's own directory is local or lies under a configured NAS mount (the path
//! given to [`Store::open_model`] is on the NAS). A model on a NAS is read only through
//! its [`NasTier`]: opening it and every page read are bounded by the mount's timeout,
//! a dead mount is re-checked and remounted, and loads resume when it is back. A local
//! model may also have a NAS copy (same directory name under a mount), tried after
//! the local files.
//!
//! A model keeps the manifest it was opened with, and the blake3 of the very bytes that
//! manifest was parsed from (what the daemon reports to engines). Opening the same
//! directory again re-checks the manifest on disk (a `stat`; the file is read again only
//! if that changed, and on a NAS only through its tier's timed calls): if it now says
//! something else, it is opened as a new model with a new id, and the old id keeps
//! serving the engines that opened it.
//!
//! Pinned pages (`pin_first_layers`, `pin_last_layers`) may take at most half of the
//! cache, so that unpinned pages always have room to stream through.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use voom_formats::manifest::{Encoding, Manifest, PageEntry, PageGroup, MANIFEST_FILE};
use voom_formats::{Checkpoint, FormatError};

use crate::ahead::{Landing, ReadAhead, Refused};
use crate::arena::{Arena, SLOT_ALIGN};
use crate::cache::{CacheError, CacheStats, Lease, PageCache, PageKey, Reservation, Reserve};
use crate::direct::{DirectFile, ReadMode};
use crate::loader::{PageLoader, Served};
use crate::read_pool::{ReadPool, RunPart};
use crate::seal::Seals;
use crate::source::{PageId, PageLease, PageMeta, PageSource};
use crate::tier::{FastTier, FileTier, Health, ModelTier, NasConfig, NasTier, TierStats};
use crate::StoreError;

/// What a store is built with.
#[derive(Debug, Clone, Default)]
pub struct StoreConfig {
    /// Bytes of the shared page cache.
    pub cache_bytes: usize,
    /// Fast tier directory and capacity.
    pub fast_tier: Option<(PathBuf, u64)>,
    /// NAS mounts. A model opened by a path under one lives there; a local model with
    /// a directory of the same name right under one has a copy there. `model` is
    /// ignored (set per model).
    pub nas: Vec<NasConfig>,
    /// Keep the first/last N decoder layers (and embeddings, final norm, LM head when
    /// either is non-zero) resident once loaded: as many of them as fit in half of the
    /// cache (all models' pins together), in that order of priority.
    pub pin_first_layers: u32,
    pub pin_last_layers: u32,
    /// How model files are read: `Some` as given; `None` chooses per model, direct
    /// (around the OS page cache) when the model is larger than the page cache, so
    /// that streaming it never fills the OS page cache, and buffered otherwise.
    pub read_mode: Option<ReadMode>,
    /// How many reads are in flight.
    pub io: IoConfig,
    /// Open a local checkpoint that has no page manifest by hashing it once (every
    /// tensor's blake3, progress in the log) and writing the manifest beside it, as
    /// `vpagectl hash` would. Off: such a directory is refused, naming the command.
    pub hash_on_open: bool,
    /// Where the manifests of checkpoints hashed on open are kept when their own
    /// directory cannot be written (the daemon's state directory): one
    /// sub-directory per checkpoint, with a record of the checkpoint files it was
    /// computed from, so a checkpoint that changed is hashed again. `None`: such a
    /// checkpoint is an error naming `vpagectl hash`.
    pub manifest_dir: Option<PathBuf>,
}

/// How the store reads: reads in flight and pages loaded at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoConfig {
    /// Reader threads: pieces of model files read at once (0: every read on the
    /// thread that needs the page, one at a time).
    pub read_threads: usize,
    /// Bytes of one piece.
    pub read_piece: usize,
    /// Threads taking prefetch hints, in order. A raw page of the primary copy is
    /// only queued on the readers (they verify and publish it); other pages (a vpack
    /// body, a staged copy, a NAS) load on these threads, one page each at a time.
    pub prefetch_threads: usize,
    /// Room for vpack bodies read ahead of their pages' slots ([`crate::ahead`]), in
    /// decoder layers of the first model with bodies that opens (its largest
    /// layer's bodies): bodies are read there while earlier ones decode (0: none;
    /// then, and without reader threads, a body is read when its page loads).
    pub read_ahead_layers: usize,
}

impl Default for IoConfig {
    fn default() -> Self {
        IoConfig {
            read_threads: crate::read_pool::DEFAULT_THREADS,
            read_piece: crate::read_pool::DEFAULT_PIECE,
            prefetch_threads: DEFAULT_PREFETCH_THREADS,
            read_ahead_layers: DEFAULT_READ_AHEAD_LAYERS,
        }
    }
}

impl IoConfig {
    /// The most memory the store's own read buffers hold at once, besides the cache:
    /// a bounce buffer per reader (one piece and its alignment margins, for direct
    /// reads; one reader when reads run on the requesting thread), and for a model
    /// with vpack bodies (its `manifest`) the pool of bodies read ahead
    /// ([`IoConfig::read_ahead_bytes`]), through which every body is then read (a
    /// load makes room there for one not read ahead); without a pool, a body on each
    /// prefetch thread and on the requesting thread as it is read and decoded: the
    /// largest bodies, one each (a page loads on one thread at a time).
    pub fn buffer_bytes(&self, manifest: Option<&Manifest>) -> u64 {
        let align = crate::direct::DIRECT_ALIGN as u64;
        let bounce = self.read_piece as u64 + 2 * align;
        let mut bodies: Vec<u64> = manifest
            .map(|m| {
                m.pages
                    .iter()
                    .filter_map(|p| p.vpack().map(|b| b.len.next_multiple_of(align)))
                    .collect()
            })
            .unwrap_or_default();
        bodies.sort_unstable_by(|a, b| b.cmp(a));
        let ahead = manifest.map_or(0, |m| self.read_ahead_bytes(m)) as u64;
        let decoding: u64 = if ahead > 0 {
            0
        } else {
            bodies.iter().take(self.prefetch_threads + 1).sum()
        };
        self.read_threads.max(1) as u64 * bounce + decoding + ahead
    }

    /// Bytes of the pool of bodies read ahead for a store whose first model with
    /// vpack bodies is `manifest`'s: [`read_ahead_layers`](Self::read_ahead_layers)
    /// of its largest decoder layer's bodies, and one more of the largest body in a
    /// layer (what the pool's holes can waste, as for the cache's streaming window:
    /// [`streaming_window_bytes`]), in whole pool units. 0 when no layer has bodies,
    /// or the store reads on the requesting thread (no reader threads to read ahead
    /// with).
    pub fn read_ahead_bytes(&self, manifest: &Manifest) -> usize {
        if self.read_threads == 0 || self.read_ahead_layers == 0 {
            return 0;
        }
        let unit = crate::ahead::UNIT as u64;
        let mut per_layer: HashMap<u32, u64> = HashMap::new();
        let mut largest = 0;
        for p in &manifest.pages {
            if let (PageGroup::Layer(l), Some(b)) = (p.group, p.vpack()) {
                let room = b.len.next_multiple_of(unit);
                *per_layer.entry(l).or_default() += room;
                largest = largest.max(room);
            }
        }
        let layer = per_layer.into_values().max().unwrap_or(0);
        if layer == 0 {
            return 0;
        }
        usize::try_from(layer.saturating_mul(self.read_ahead_layers as u64) + largest)
            .unwrap_or(usize::MAX)
    }
}

/// Default room for bodies read ahead, in decoder layers. Measured on the out-of-core
/// bench's 42-layer model with a 1 GiB budget (`voom generate --read-ahead-layers`,
/// 10 tokens): none, 0.48 tok/s with the device busy 72% of the run; 1 layer, 0.51;
/// 2 layers, 0.58-0.59 with it busy 90%; 4 and 6 layers, 0.60 and 0.58 (the room
/// they take from the planner's pins costs what the reads gain).
pub const DEFAULT_READ_AHEAD_LAYERS: usize = 2;

/// Default threads loading prefetched pages.
pub const DEFAULT_PREFETCH_THREADS: usize = 4;

/// One open model store.
pub struct OpenModel {
    pub id: u32,
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// blake3 of the manifest file's bytes that `manifest` was parsed from.
    pub manifest_digest: [u8; 32],
    pub pages: Vec<PageMeta>,
    /// The manifest file it was opened by: beside the checkpoint, or in the store's
    /// manifest directory ([`StoreConfig::manifest_dir`]).
    manifest_path: PathBuf,
    /// The manifest file as `stat` saw it before it was read, for a cheap re-check when
    /// the model is opened again (updated when a re-read found the same bytes).
    manifest_stamp: Mutex<FileStamp>,
    /// Set when a later open found another manifest in `dir` and opened it as a new
    /// model; this one still serves the sessions that opened it.
    superseded: AtomicBool,
    /// The pages an engine last named to read ahead ([`Store::read_ahead`]), in order.
    read_ahead: Mutex<Vec<u32>>,
    /// The pages pinned for this model and their slot bytes (part of the pin budget).
    pins: Vec<PageKey>,
    pinned_slot_bytes: usize,
    /// The model's own directory: local, or on a NAS mount.
    primary: ModelTier,
    /// The NAS copy of a local model.
    nas: Option<NasTier>,
    /// Demand requests per page.
    accesses: Vec<AtomicU64>,
    /// Loads per page from any tier into the cache: the reads a fast-tier copy would
    /// have served (what staging ranks pages by).
    loads: Vec<AtomicU64>,
    /// Pages whose copies the fast tier keeps once read: the planner's static set
    /// ([`Store::keep_on_fast_tier`]).
    kept_fast: Vec<AtomicBool>,
    served: [AtomicU64; 3],
    /// The seals of pages verified once ([`Seals`]).
    seals: Seals,
    /// The room its unpinned pages stream through ([`streaming_window_bytes`]).
    window: usize,
}

impl OpenModel {
    /// The manifest file the model was opened by.
    pub fn manifest_path(&self) -> &Path {
        &self.manifest_path
    }

    /// Demand requests of each page since the model was opened.
    pub fn access_counts(&self) -> Vec<u64> {
        self.accesses
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect()
    }

    /// Loads of each page into the cache since the model was opened.
    pub fn load_counts(&self) -> Vec<u64> {
        self.loads
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect()
    }

    /// Pages served from the fast tier, the primary store and the NAS.
    pub fn served_counts(&self) -> [u64; 3] {
        [0, 1, 2].map(|i| self.served[i].load(Ordering::Relaxed))
    }

    /// Statistics of the model's own directory (its NAS tier's for a model on a NAS).
    pub fn primary_stats(&self) -> TierStats {
        self.primary.stats()
    }

    /// Statistics of the model's NAS tier, whether it holds the model or a copy.
    pub fn nas_stats(&self) -> Option<TierStats> {
        self.nas_tier().map(|n| n.stats())
    }

    /// The model's own directory's tier.
    pub fn location(&self) -> &ModelTier {
        &self.primary
    }

    /// The NAS tier holding the model or its copy.
    pub fn nas_tier(&self) -> Option<&NasTier> {
        self.primary.nas().or(self.nas.as_ref())
    }

    /// The NAS's last known health (no I/O), if the model has a NAS tier.
    pub fn nas_health(&self) -> Option<Health> {
        self.nas_tier().map(|n| n.health())
    }

    /// The error a load of `page` would end in, found before the cache makes room for
    /// it (evicting pages it could still serve): the model lives on a NAS that is
    /// down, and the fast tier holds no copy of the page. [`NasCheck::IfDown`] looks again
    /// only while the NAS was last found down (no I/O while it is healthy: a demand
    /// request's latency); [`NasCheck::IfDue`] also checks a healthy NAS whose check is
    /// due (a prefetch, which would otherwise be what finds an outage, after making
    /// room). `None` when the load may succeed.
    fn unreachable(
        &self,
        fast: Option<&FastTier>,
        page: u32,
        check: NasCheck,
    ) -> Option<StoreError> {
        let entry = self.manifest.pages.get(page as usize)?;
        let ModelTier::Nas(nas) = &self.primary else {
            return None;
        };
        if fast.is_some_and(|f| f.contains(&entry.blake3)) {
            return None;
        }
        let down = match check {
            NasCheck::IfDown => nas.still_down(),
            NasCheck::IfDue => nas.check_if_due(),
        };
        down.err().map(|e| StoreError::Unavailable {
            page: entry.label(),
            reasons: vec![e.to_string()],
        })
    }

    /// Whether a later open of `dir` found another manifest and opened it as a new
    /// model (this one then serves only the sessions that had opened it).
    pub fn is_superseded(&self) -> bool {
        self.superseded.load(Ordering::Relaxed)
    }

    /// The pages pinned for this model (at most what fit in the pin budget).
    pub fn pinned_pages(&self) -> &[PageKey] {
        &self.pins
    }

    fn stamp(&self) -> FileStamp {
        *self
            .manifest_stamp
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn set_stamp(&self, stamp: FileStamp) {
        *self
            .manifest_stamp
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = stamp;
    }
}

/// A manifest file's identity and version as `stat` sees it: if none of it changed, the
/// file holds the bytes it held (rewrites change the modification or change time, or
/// the inode when a new file is renamed over it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileStamp {
    /// The stamp of the file at `path` (a `stat`, which never blocks on what it finds).
    fn of(path: &Path) -> std::io::Result<FileStamp> {
        Ok(Self::from_metadata(&std::fs::metadata(path)?))
    }

    fn from_metadata(m: &std::fs::Metadata) -> FileStamp {
        FileStamp {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

/// A checked manifest with the digest of the bytes it was parsed from.
struct LoadedManifest {
    /// The file it was read from.
    path: PathBuf,
    manifest: Manifest,
    digest: [u8; 32],
    stamp: FileStamp,
}

/// Where I/O in a model directory runs: in place for a local one; for one on a NAS, on
/// the tier's helper thread, bounded by its timeout (a dead mount can block a `stat`
/// for minutes).
#[derive(Clone, Copy)]
enum DirIo<'a> {
    Local,
    Nas(&'a NasTier),
}

impl DirIo<'_> {
    fn run<T: Send + 'static>(
        self,
        what: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, StoreError> {
        match self {
            DirIo::Local => Ok(f()),
            DirIo::Nas(t) => Ok(t.call(what, f)?),
        }
    }
}

pub struct Store {
    cache: PageCache,
    fast: Option<FastTier>,
    models: RwLock<Vec<Arc<OpenModel>>>,
    /// Slot bytes of every current model's pins; changed only under the `models` write
    /// lock.
    pinned_reserved: AtomicUsize,
    cfg: StoreConfig,
    prefetch_tx: Mutex<Option<mpsc::SyncSender<Hint>>>,
    /// Reads model files with many pieces in flight.
    readers: Arc<ReadPool>,
    /// Held while a checkpoint without a manifest is hashed ([`Store::load_or_hash`]).
    hashing: Mutex<()>,
    /// Pins engines' memory planners asked for ([`Store::pin_planned`]).
    planned: Mutex<PlannedState>,
    /// Bodies read ahead ([`Store::read_ahead`]), sized when the first model with
    /// vpack bodies opens.
    ahead: OnceLock<Arc<ReadAhead>>,
}

/// Pins asked for by engines' planners: how many holders each page has, the slot
/// bytes of the distinct pages, and the holders per model.
#[derive(Default)]
struct PlannedState {
    holders: HashMap<PageKey, u32>,
    bytes: usize,
    per_model: HashMap<u32, usize>,
}

/// Pins an engine's memory planner was granted ([`Store::pin_planned`]); dropped,
/// they are withdrawn (a page another holder pinned stays pinned).
pub struct PlannedPins {
    store: std::sync::Weak<Store>,
    model: u32,
    keys: Vec<PageKey>,
    bytes: usize,
}

impl PlannedPins {
    /// Pages granted.
    pub fn pages(&self) -> usize {
        self.keys.len()
    }

    /// Slot bytes of the pages granted that no other holder had pinned.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for PlannedPins {
    fn drop(&mut self) {
        if let Some(store) = self.store.upgrade() {
            store.unpin_planned(self.model, &self.keys);
        }
    }
}

/// A prefetch hint: a model and a group of its pages read together (a layer).
type Hint = (u32, Vec<u32>);

/// Longest a demand request waits for in-flight loads to make room.
const FULL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The prefetch queue's length: hints beyond it are dropped, never waited on.
const PREFETCH_QUEUE: usize = 256;

/// Pinned pages may take at most 1/`PIN_SHARE_DIVISOR` of the cache, so a budget
/// smaller than a layer still streams the unpinned pages.
const PIN_SHARE_DIVISOR: usize = 2;

/// Page names listed in the warning about pages left unpinned.
const UNPINNED_NAMES_SHOWN: usize = 8;

impl Store {
    /// A store with a fresh shared-memory cache of `cfg.cache_bytes`.
    pub fn new(cfg: StoreConfig) -> Result<Arc<Store>, StoreError> {
        let arena = Arena::new(cfg.cache_bytes).map_err(|e| StoreError::Store {
            store: PathBuf::from("<cache>"),
            detail: format!("cannot create the {}-byte page cache: {e}", cfg.cache_bytes),
        })?;
        let fast = match &cfg.fast_tier {
            Some((dir, cap)) => Some(FastTier::open("fast", dir, *cap)?),
            None => None,
        };
        let threads_error = |e: std::io::Error| StoreError::Store {
            store: PathBuf::from("<cache>"),
            detail: format!("cannot start the store's I/O threads: {e}"),
        };
        let readers =
            Arc::new(ReadPool::new(cfg.io.read_threads, cfg.io.read_piece).map_err(threads_error)?);
        let loaders = cfg.io.prefetch_threads.max(1);
        let store = Arc::new(Store {
            cache: PageCache::new(arena),
            fast,
            models: RwLock::new(Vec::new()),
            pinned_reserved: AtomicUsize::new(0),
            cfg,
            prefetch_tx: Mutex::new(None),
            readers,
            hashing: Mutex::new(()),
            planned: Mutex::new(PlannedState::default()),
            ahead: OnceLock::new(),
        });
        // Prefetch hints are loaded on background threads, so a hint never blocks the
        // engine, several pages at once, in the order hinted; their reads queue behind
        // demand reads. The threads hold only a weak reference and end with the store.
        let (tx, rx) = mpsc::sync_channel::<Hint>(PREFETCH_QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..loaders {
            let weak = Arc::downgrade(&store);
            let rx = Arc::clone(&rx);
            std::thread::Builder::new()
                .name(format!("vpaged-prefetch-{i}"))
                .spawn(move || {
                    crate::read_pool::mark_hint_thread();
                    loop {
                        let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                        let Ok((model, pages)) = next else { break };
                        let Some(store) = weak.upgrade() else { break };
                        // A failed prefetch is not an error: the demand request will
                        // report it if the page is really unavailable.
                        store.prefetch_now(model, &pages);
                    }
                })
                .map_err(threads_error)?;
        }
        *store.prefetch_tx.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
        Ok(store)
    }

    pub fn cache(&self) -> &PageCache {
        &self.cache
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    pub fn fast_tier(&self) -> Option<&FastTier> {
        self.fast.as_ref()
    }

    pub fn models(&self) -> Vec<Arc<OpenModel>> {
        self.models
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn model(&self, id: u32) -> Result<Arc<OpenModel>, StoreError> {
        self.models
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(id as usize)
            .cloned()
            .ok_or_else(|| StoreError::NotFound {
                store: PathBuf::from(format!("<model {id}>")),
                detail: "no such open model".into(),
            })
    }

    /// Opens a model store (its manifest is required: `vpagectl hash` writes it), or
    /// returns the id it already has if its manifest did not change since (see the
    /// module doc). A `dir` under a configured NAS mount is opened through the mount's
    /// [`NasTier`] (bounded by its timeout; a dead mount is an error naming it, after
    /// the remount command had its chance). A directory or manifest that does not exist
    /// is [`StoreError::NotFound`].
    pub fn open_model(&self, dir: &Path) -> Result<u32, StoreError> {
        // A path on a NAS is not touched outside the NAS tier: on a dead mount even
        // `canonicalize` can block for minutes.
        if let Some(nas) = self.nas_holding(&lexical_absolute(dir)) {
            return self.open_on_nas(nas);
        }
        let dir = dir.canonicalize().map_err(|e| {
            let detail = format!("cannot open: {e}");
            let store = dir.to_path_buf();
            match e.kind() {
                std::io::ErrorKind::NotFound => StoreError::NotFound { store, detail },
                _ => StoreError::Store { store, detail },
            }
        })?;
        // Reached through a symbolic link.
        if let Some(nas) = self.nas_holding(&dir) {
            return self.open_on_nas(nas);
        }
        let loaded = match self.current(&dir) {
            Some(m) => match self.changed_manifest(&m, DirIo::Local)? {
                None => return Ok(m.id),
                Some(loaded) => loaded,
            },
            None => self.load_or_hash(&dir)?,
        };
        let name = dir.file_name().map(PathBuf::from).unwrap_or_default();
        // The copy on a mount is looked for with a timed probe (never a plain `stat`
        // of the mount, which could hang).
        let nas = self
            .cfg
            .nas
            .iter()
            .map(|n| {
                NasTier::new(
                    "nas",
                    NasConfig {
                        model: name.clone(),
                        ..n.clone()
                    },
                )
            })
            .find(|t| t.probe().is_ok());
        let model_bytes: u64 = loaded.manifest.pages.iter().map(|p| p.len).sum();
        let mode = self
            .cfg
            .read_mode
            .unwrap_or(if model_bytes > self.cache.capacity() as u64 {
                ReadMode::Direct
            } else {
                ReadMode::Buffered
            });
        let primary = ModelTier::File(
            FileTier::with_mode("primary", &dir, mode).with_pool(Arc::clone(&self.readers)),
        );
        Ok(self.insert(dir, primary, nas, loaded))
    }

    /// [`load_checked`], hashing the checkpoint first when it has no manifest and
    /// [`StoreConfig::hash_on_open`] allows: once (opens of other directories wait,
    /// and an open of the same one finds the manifest the first wrote), with progress
    /// in the log, the manifest written beside the checkpoint, or, where that
    /// directory cannot be written, in [`StoreConfig::manifest_dir`] (a manifest kept
    /// there is used while the checkpoint's files are the ones it was computed
    /// from). With neither, a directory that cannot be written is an error saying so.
    fn load_or_hash(&self, dir: &Path) -> Result<LoadedManifest, StoreError> {
        // No manifest, but safetensors files to hash (a directory with neither is
        // no model store: `load_checked` says so, naming `vpagectl hash`).
        let unhashed = |dir: &Path| {
            !dir.join(MANIFEST_FILE).exists()
                && std::fs::read_dir(dir).is_ok_and(|mut entries| {
                    entries.any(|e| {
                        e.is_ok_and(|e| {
                            let name = e.file_name();
                            let name = name.to_string_lossy();
                            name.ends_with(".safetensors")
                                || name.ends_with(".safetensors.index.json")
                        })
                    })
                })
        };
        if !self.cfg.hash_on_open || !unhashed(dir) {
            return load_checked(dir);
        }
        let kept = self
            .cfg
            .manifest_dir
            .as_ref()
            .map(|d| KeptManifest::of(d, dir));
        let fresh = |k: &KeptManifest| k.is_fresh(dir);
        if let Some(k) = kept.as_ref().filter(|k| fresh(k)) {
            return load_checked_at(dir, &k.manifest());
        }
        let _one = self.hashing.lock().unwrap_or_else(|e| e.into_inner());
        if !unhashed(dir) {
            return load_checked(dir);
        }
        if let Some(k) = kept.as_ref().filter(|k| fresh(k)) {
            return load_checked_at(dir, &k.manifest());
        }
        let manifest = hash_checkpoint(dir)?;
        match manifest.save(dir) {
            Ok(()) => {
                log_written(dir, &dir.join(MANIFEST_FILE), &manifest);
                load_checked(dir)
            }
            Err(e) => match &kept {
                Some(k) => {
                    k.save(&manifest, dir)?;
                    log_written(dir, &k.manifest(), &manifest);
                    load_checked_at(dir, &k.manifest())
                }
                None => Err(StoreError::Store {
                    store: dir.to_path_buf(),
                    detail: format!(
                        "no page manifest ({MANIFEST_FILE}), and the one just computed \
                         cannot be written beside the checkpoint: {e}; run `vpagectl hash` \
                         where the directory is writable"
                    ),
                }),
            },
        }
    }

    /// The NAS tier of the configured mount that `dir` (absolute, normalized) lies
    /// under, if any.
    fn nas_holding(&self, dir: &Path) -> Option<NasTier> {
        self.cfg.nas.iter().find_map(|n| {
            let mount = lexical_absolute(&n.mount);
            let model = dir.strip_prefix(&mount).ok()?;
            if model.as_os_str().is_empty() {
                return None;
            }
            Some(NasTier::new(
                "nas",
                NasConfig {
                    model: model.to_path_buf(),
                    mount,
                    ..n.clone()
                },
            ))
        })
    }

    fn open_on_nas(&self, tier: NasTier) -> Result<u32, StoreError> {
        let dir = tier.root().to_path_buf();
        if let Some(m) = self.current(&dir) {
            // The open model's own tier, which keeps the mount's health.
            let own = m.location().nas().unwrap_or(&tier);
            if let Some(loaded) = self.changed_manifest(&m, DirIo::Nas(own))? {
                return Ok(self.insert(dir, ModelTier::Nas(tier), None, loaded));
            }
            return Ok(m.id);
        }
        tier.check_now()?;
        let d = dir.clone();
        let loaded = tier.call("opening the model store", move || load_checked(&d))??;
        Ok(self.insert(dir, ModelTier::Nas(tier), None, loaded))
    }

    /// The open model of `dir` that new opens get (not superseded).
    fn current(&self, dir: &Path) -> Option<Arc<OpenModel>> {
        self.models()
            .into_iter()
            .rev()
            .find(|m| m.dir == dir && !m.is_superseded())
    }

    /// Re-checks the manifest of an open model before its id is handed out again:
    /// `None` if it is still the one the model was loaded from (one `stat` when nothing
    /// changed), the new manifest if it changed. If the manifest cannot even be
    /// `stat`ed (a NAS that is down, or known to be), the model is kept as it is: its
    /// resident pages are still served, and the digest an engine gets is still that
    /// of the bytes the store uses. A manifest that changed but cannot be loaded is an
    /// error.
    fn changed_manifest(
        &self,
        m: &OpenModel,
        io: DirIo<'_>,
    ) -> Result<Option<LoadedManifest>, StoreError> {
        if let DirIo::Nas(t) = io {
            if let Health::Unavailable(reason) = t.health() {
                tracing::warn!(
                    "{}: not re-checking the page manifest while the NAS is down ({reason}); \
                     serving the one opened before",
                    m.dir.display()
                );
                return Ok(None);
            }
        }
        // A manifest the store wrote for a checkpoint it could not write beside is
        // stale once the checkpoint's files change: hashed again.
        if matches!(io, DirIo::Local) && m.manifest_path != m.dir.join(MANIFEST_FILE) {
            if let Some(state) = &self.cfg.manifest_dir {
                let loaded = self.load_or_hash(&m.dir)?;
                if loaded.digest == m.manifest_digest {
                    m.set_stamp(loaded.stamp);
                    return Ok(None);
                }
                tracing::info!(
                    "{}: the checkpoint changed since model {} was opened; opening the \
                     manifest hashed again (in {}) as a new model",
                    m.dir.display(),
                    m.id,
                    state.display()
                );
                return Ok(Some(loaded));
            }
        }
        let path = m.manifest_path.clone();
        let stamp = match io.run("checking the page manifest", move || FileStamp::of(&path)) {
            Ok(Ok(stamp)) => stamp,
            Ok(Err(e)) => return Ok(keep_unchecked(m, &e)),
            Err(e) => return Ok(keep_unchecked(m, &e)),
        };
        if stamp == m.stamp() {
            return Ok(None);
        }
        let (dir, path) = (m.dir.clone(), m.manifest_path.clone());
        let loaded = io.run("re-reading the page manifest", move || {
            load_checked_at(&dir, &path)
        })??;
        if loaded.digest == m.manifest_digest {
            m.set_stamp(loaded.stamp);
            return Ok(None);
        }
        tracing::info!(
            "{}: the page manifest changed since model {} was opened; opening it as a new \
             model (sessions that opened model {} keep it)",
            m.dir.display(),
            m.id,
            m.id
        );
        Ok(Some(loaded))
    }

    /// Adds an opened model (or returns the id a concurrent open gave the same
    /// manifest). A current model of the same directory with another manifest is
    /// superseded: it keeps its id for the sessions that opened it, and its pins go.
    fn insert(
        &self,
        dir: PathBuf,
        primary: ModelTier,
        nas: Option<NasTier>,
        loaded: LoadedManifest,
    ) -> u32 {
        let LoadedManifest {
            path: manifest_path,
            manifest,
            digest,
            stamp,
        } = loaded;
        let pages: Vec<PageMeta> = manifest.pages.iter().map(PageMeta::from_entry).collect();
        let ahead = self.cfg.io.read_ahead_bytes(&manifest);
        if ahead > 0 {
            self.ahead.get_or_init(|| Arc::new(ReadAhead::new(ahead)));
        }
        let mut models = self.models.write().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = models.iter().find(|m| m.dir == dir && !m.is_superseded()) {
            if old.manifest_digest == digest {
                return old.id;
            }
            old.superseded.store(true, Ordering::Relaxed);
            self.cache.unpin(old.pins.iter().copied());
            self.pinned_reserved
                .fetch_sub(old.pinned_slot_bytes, Ordering::Relaxed);
        }
        let id = models.len() as u32;
        let (pins, pinned_slot_bytes) = self.pins_within_budget(id, &dir, &manifest);
        self.cache.pin(pins.iter().copied());
        self.pinned_reserved
            .fetch_add(pinned_slot_bytes, Ordering::Relaxed);
        let n = pages.len();
        let window = streaming_window_bytes(&manifest, routed_top_k(&dir));
        let model = Arc::new(OpenModel {
            id,
            window,
            primary,
            dir,
            nas,
            accesses: (0..n).map(|_| AtomicU64::new(0)).collect(),
            loads: (0..n).map(|_| AtomicU64::new(0)).collect(),
            kept_fast: (0..n).map(|_| AtomicBool::new(false)).collect(),
            seals: Seals::new(n),
            served: Default::default(),
            pages,
            manifest,
            manifest_digest: digest,
            manifest_path,
            manifest_stamp: Mutex::new(stamp),
            superseded: AtomicBool::new(false),
            read_ahead: Mutex::new(Vec::new()),
            pins,
            pinned_slot_bytes,
        });
        models.push(model);
        id
    }

    /// The pages of a new model to pin: the candidates in priority order (see
    /// [`pin_candidates`]) while they fit in what is left of the pin budget (half the
    /// cache, shared by every model); the rest are named in a warning. Returns the keys
    /// and their slot bytes. Called under the `models` write lock.
    fn pins_within_budget(
        &self,
        id: u32,
        dir: &Path,
        manifest: &Manifest,
    ) -> (Vec<PageKey>, usize) {
        let (first, last) = (self.cfg.pin_first_layers, self.cfg.pin_last_layers);
        let wanted = pin_candidates(manifest, first, last);
        let cap = self.cache.capacity() / PIN_SHARE_DIVISOR;
        let budget = cap.saturating_sub(self.pinned_reserved.load(Ordering::Relaxed));
        let mut used = 0usize;
        let fitting = wanted
            .iter()
            .take_while(|p| {
                let bytes = slot_bytes(p);
                if used + bytes > budget {
                    return false;
                }
                used += bytes;
                true
            })
            .count();
        if fitting < wanted.len() {
            let left: Vec<String> = wanted[fitting..]
                .iter()
                .take(UNPINNED_NAMES_SHOWN)
                .map(|p| p.label())
                .collect();
            let more = wanted.len() - fitting - left.len();
            tracing::warn!(
                "{}: pinned {fitting} of the {} pages asked for ({used} bytes): pins may take \
                 at most {cap} bytes (half the cache, all models together), so these stay \
                 unpinned: {}{}",
                dir.display(),
                wanted.len(),
                left.join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            );
        }
        let keys = wanted[..fitting]
            .iter()
            .map(|p| PageKey {
                model: id,
                page: p.id,
            })
            .collect();
        (keys, used)
    }

    fn load_into(&self, m: &OpenModel, page: u32, buf: &mut [u8]) -> Result<(), StoreError> {
        let entry = &m.manifest.pages[page as usize];
        if m.is_superseded() {
            // The files now hold the new model: reading them for the old manifest
            // would only fail verification (and count as a tier's integrity failure).
            return Err(StoreError::NotFound {
                store: m.dir.clone(),
                detail: format!(
                    "page '{}' of model {} is no longer cached and its files have changed \
                     (the manifest was rewritten since this model was opened): open the \
                     model store again",
                    entry.label(),
                    m.id
                ),
            });
        }
        let ahead = self.ahead.get();
        let (staged, own_body_buffers) = match ahead {
            Some(a) => self.body_in_pool(a, m, page),
            None => (None, true),
        };
        let loader = PageLoader {
            fast: self.fast.as_ref(),
            primary: &m.primary,
            nas: m.nas.as_ref(),
            seals: &m.seals,
            body: staged.as_deref(),
            own_body_buffers,
        };
        let served = loader.load(entry, buf);
        if staged.is_some() {
            drop(staged);
            if let Ok(m) = self.model(m.id) {
                self.read_on(&m, page);
            }
        }
        let served = served?;
        let i = match served {
            Served::Fast => 0,
            Served::Primary => 1,
            Served::Nas => 2,
        };
        m.served[i].fetch_add(1, Ordering::Relaxed);
        m.loads[page as usize].fetch_add(1, Ordering::Relaxed);
        if served != Served::Fast {
            self.keep_fast(m, page, buf);
        }
        Ok(())
    }

    /// The vpack body of `page` in the pool `a`, for a store whose bodies all go
    /// through it: the body read ahead (waiting while it is read), else read now,
    /// on this thread, into room the pool makes for it
    /// ([`ReadAhead::reserve_for_load`]). Also whether the loader may read a body
    /// into a buffer of its own after all: only when this read failed, so the
    /// loader's own read reports what is wrong (an error path; that thread keeps
    /// its buffer for a later body, up to 64 MiB, as a store without a pool does).
    /// The body is read from the model's own tier (its directory, local
    /// or on a NAS). A page with no body, one staged on the fast tier, or a body
    /// larger than the pool gets none: the loader reads the raw bytes.
    fn body_in_pool(
        &self,
        a: &Arc<ReadAhead>,
        m: &OpenModel,
        page: u32,
    ) -> (Option<crate::ahead::TakenBody>, bool) {
        let key = PageKey { model: m.id, page };
        if let Some(body) = a.take(key) {
            return (Some(body), false);
        }
        let entry = &m.manifest.pages[page as usize];
        let Some(body) = entry.vpack() else {
            return (None, false);
        };
        if self
            .fast
            .as_ref()
            .is_some_and(|f| f.contains(&entry.blake3))
        {
            return (None, false);
        }
        let Ok(len) = usize::try_from(body.len) else {
            return (None, false);
        };
        let Some(landing) = a.reserve_for_load(key, len) else {
            // Read ahead meanwhile (take it), or larger than the pool (none).
            return (a.take(key), false);
        };
        let ext = crate::tier::Extent {
            file: body.file.clone(),
            offset: body.offset,
            len: body.len,
        };
        // SAFETY: the landing's room is this thread's alone until it lands, below.
        let room = unsafe { std::slice::from_raw_parts_mut(landing.ptr(), landing.len()) };
        let ok = match &m.primary {
            ModelTier::File(t) => t.read_extent(&ext, room).is_ok(),
            ModelTier::Nas(t) => t.read_extent(&ext, room).is_ok(),
        };
        match landing.land_taken(ok) {
            Some(body) => (Some(body), false),
            None => (None, true),
        }
    }

    /// Keeps a copy of a verified page on the fast tier when it is in the model's
    /// static set and fits there. A failed write is logged and changes nothing else:
    /// the page is read from its slow tier again next time.
    fn keep_fast(&self, m: &OpenModel, page: u32, bytes: &[u8]) {
        let Some(fast) = &self.fast else { return };
        if !m.kept_fast[page as usize].load(Ordering::Relaxed) {
            return;
        }
        let entry = &m.manifest.pages[page as usize];
        if let Err(e) = fast.keep(&entry.blake3, bytes) {
            tracing::warn!(
                "page '{}': keeping a copy on the fast tier: {e}",
                entry.label()
            );
        }
    }

    /// Chooses the static set of `model` on the fast tier (replacing the one before)
    /// from `by_value`, the candidates most valuable first (the planner's:
    /// `libvoom::placement::fast_tier_order`): in that order, each page that fits in
    /// the tier's room (its capacity less other models' copies), skipping one that
    /// does not for smaller ones after it. Each page of the set has its copy kept on
    /// the tier once it is read from its slow tier, and later reads of it are served
    /// from the copy. Returns the set's pages and bytes; none without a fast tier.
    ///
    /// Copies of the model's other pages are removed from the tier (one kept by an
    /// earlier set, or a staged hot page), so the room is the set's; a page another
    /// model holds too (copies are by content) is read from its own tier after.
    /// With `append`, `by_value` continues the set chosen before (the daemon's
    /// `KeepFast` carries a long list in parts) instead of replacing it.
    pub fn keep_on_fast_tier(
        &self,
        model: u32,
        by_value: &[u32],
        append: bool,
    ) -> Result<(usize, u64), StoreError> {
        let m = self.model(model)?;
        if !append {
            for flag in &m.kept_fast {
                flag.store(false, Ordering::Relaxed);
            }
        }
        let Some(fast) = &self.fast else {
            return Ok((0, 0));
        };
        // The room: the capacity less other models' copies and the pages this
        // model's set holds already (copied or not yet).
        let (mut mine, mut claimed) = (0u64, 0u64);
        for (p, kept) in m.manifest.pages.iter().zip(&m.kept_fast) {
            if fast.contains(&p.blake3) {
                mine += p.len;
            }
            if kept.load(Ordering::Relaxed) {
                claimed += p.len;
            }
        }
        let mut room = fast
            .capacity()
            .saturating_sub(fast.used().saturating_sub(mine))
            .saturating_sub(claimed);
        let (mut pages, mut bytes) = (0usize, 0u64);
        for &page in by_value {
            let (Some(flag), Some(entry)) = (
                m.kept_fast.get(page as usize),
                m.manifest.pages.get(page as usize),
            ) else {
                continue;
            };
            if flag.load(Ordering::Relaxed) || entry.len > room {
                continue;
            }
            room -= entry.len;
            flag.store(true, Ordering::Relaxed);
            pages += 1;
            bytes += entry.len;
        }
        for (entry, kept) in m.manifest.pages.iter().zip(&m.kept_fast) {
            if !kept.load(Ordering::Relaxed) && fast.contains(&entry.blake3) {
                fast.unstage(&entry.blake3)?;
            }
        }
        Ok((pages, bytes))
    }

    fn page_len(m: &OpenModel, page: u32) -> Result<usize, StoreError> {
        m.pages
            .get(page as usize)
            .map(|p| p.len as usize)
            .ok_or_else(|| StoreError::NoSuchPage {
                id: page,
                store: m.dir.clone(),
            })
    }

    /// Demand request: leases the page, loading and verifying it if needed.
    pub fn acquire(&self, model: u32, page: u32) -> Result<Lease, StoreError> {
        let m = self.model(model)?;
        let len = Self::page_len(&m, page)?;
        m.accesses[page as usize].fetch_add(1, Ordering::Relaxed);
        let key = PageKey { model, page };
        if !self.cache.present(key) {
            if let Some(e) = m.unreachable(self.fast.as_ref(), page, NasCheck::IfDown) {
                return Err(e);
            }
        }
        // A cache full only because other pages are still loading (prefetches, other
        // engines' requests) has room once they land: wait for them rather than fail.
        let deadline = std::time::Instant::now() + FULL_WAIT;
        loop {
            let r = self
                .cache
                .acquire(key, len, |buf| self.load_into(&m, page, buf));
            match r {
                Err(CacheError::Full { loading, .. })
                    if loading > 0 && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                r => return r.map_err(|e| cache_error(&m, page, e)),
            }
        }
    }

    /// Queues a prefetch hint for one page; see [`Store::prefetch_group`].
    pub fn prefetch(&self, model: u32, page: u32) {
        self.prefetch_group(model, &[page]);
    }

    /// Queues a prefetch hint for pages read together (a layer, hinted ahead): their
    /// slots are reserved as one run where one can be made
    /// ([`PageCache::reserve_group`]), and their reads queued at once, in order.
    /// Never blocks (a full queue drops the hint). Pages already resident or loading
    /// are dropped here, without waking a prefetch thread (a model that fits is
    /// hinted every layer of every token).
    pub fn prefetch_group(&self, model: u32, pages: &[u32]) {
        let missing: Vec<u32> = pages
            .iter()
            .copied()
            .filter(|&page| !self.cache.present(PageKey { model, page }))
            .collect();
        if missing.is_empty() {
            return;
        }
        if let Some(tx) = self
            .prefetch_tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            let _ = tx.try_send((model, missing));
        }
    }

    /// Loads a hinted group: pages that are one plain read ([`Store::streamed`]) are
    /// reserved together and read in flight; the first of the others loads on this
    /// thread through [`PageLoader`], the rest are hinted again one by one, for every
    /// prefetch thread to share. Errors are dropped: a demand request for the page
    /// reports them. Pages only a NAS that is down holds are dropped before any room
    /// is made for them ([`OpenModel::unreachable`]).
    fn prefetch_now(self: &Arc<Self>, model: u32, pages: &[u32]) {
        let Ok(m) = self.model(model) else { return };
        let mut streamed = Vec::new();
        let mut others = Vec::new();
        for &page in pages {
            let Ok(len) = Self::page_len(&m, page) else {
                continue;
            };
            if m.unreachable(self.fast.as_ref(), page, NasCheck::IfDue)
                .is_some()
            {
                continue;
            }
            match self.streamed(&m, page) {
                Some(file) => streamed.push((page, len, file)),
                None => others.push((page, len)),
            }
        }
        let keys: Vec<(PageKey, usize)> = streamed
            .iter()
            .map(|&(page, len, _)| (PageKey { model, page }, len))
            .collect();
        if let Ok(reserved) = self.cache.reserve_group::<StoreError>(&keys) {
            let reads: Vec<(Arc<DirectFile>, u64, (u32, Reservation))> = streamed
                .into_iter()
                .zip(reserved)
                .filter_map(|((page, _, file), r)| match r {
                    Reserve::Reserved(r) => {
                        Some((file, m.manifest.pages[page as usize].offset, (page, r)))
                    }
                    _ => None,
                })
                .collect();
            // Pages that lie one after another read as one run.
            let runs = file_runs(reads, |at, (_, r), next| at + r.len() as u64 == next);
            for (file, offset, run) in runs {
                let pages = run.into_iter().map(|(_, page)| page).collect();
                self.read_slots(Arc::clone(&m), file, offset, pages);
            }
        }
        // Loads that hold a thread (a vpack body is read, then decoded) are shared
        // out: every page after the first goes back to the queue as a hint of its
        // own, for the next free prefetch thread, so a layer's pages read and decode
        // on every thread at once rather than one after another on this one.
        let mut mine = Vec::with_capacity(1);
        for (k, (page, len)) in others.into_iter().enumerate() {
            if k == 0 || !self.requeue(model, page) {
                mine.push((page, len));
            }
        }
        for (page, len) in mine {
            let key = PageKey { model, page };
            let _ = self
                .cache
                .prefetch(key, len, |buf| self.load_into(&m, page, buf));
        }
    }

    /// Reads the vpack bodies of `pages` (those the engine will need after its hints,
    /// in order) into the pool of bodies read ahead ([`crate::ahead`]), as far as it
    /// has room: pages resident or loading, already held there, not read from the
    /// model's own files as a body (no body, a copy staged on the fast tier, a model
    /// on a NAS or superseded) are skipped; the first that finds no room ends the
    /// call, so bodies are read in the order they will be decoded. Bodies that lie one
    /// after another in the pack file are read as one run. The list is kept: each
    /// time a load has taken a body and freed its room, reading goes on down it
    /// ([`Store::read_on`]). Never blocks for I/O.
    pub fn read_ahead(&self, model: u32, pages: &[u32]) {
        let Some(ahead) = self.ahead.get() else {
            return;
        };
        let Ok(m) = self.model(model) else { return };
        ahead.next_round();
        pages.clone_into(&mut m.read_ahead.lock().unwrap_or_else(|e| e.into_inner()));
        self.read_bodies_ahead(ahead, &m, pages);
    }

    /// Goes on down `m`'s last read-ahead list, after a load took the body of
    /// `page` from the pool and freed its room: the device reads the next body while
    /// others decode, not only when the engine next names its pages. The list is cut
    /// after `page` first: the pages before it are loaded or loading, and one already
    /// used and evicted must not be read again.
    fn read_on(&self, m: &Arc<OpenModel>, page: u32) {
        let Some(ahead) = self.ahead.get() else {
            return;
        };
        let pages = {
            let mut list = m.read_ahead.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = list.iter().position(|&p| p == page) {
                list.drain(..=i);
            }
            list.clone()
        };
        self.read_bodies_ahead(ahead, m, &pages);
    }

    fn read_bodies_ahead(&self, ahead: &Arc<ReadAhead>, m: &Arc<OpenModel>, pages: &[u32]) {
        let ModelTier::File(tier) = &m.primary else {
            return;
        };
        if m.is_superseded() {
            return;
        }
        let model = m.id;
        let mut reads: Vec<(Arc<DirectFile>, u64, Landing)> = Vec::new();
        for &page in pages {
            let Some(entry) = m.manifest.pages.get(page as usize) else {
                continue;
            };
            let Some(body) = entry.vpack() else { continue };
            let key = PageKey { model, page };
            if self.cache.present(key)
                || ahead.holds(key)
                || self
                    .fast
                    .as_ref()
                    .is_some_and(|f| f.contains(&entry.blake3))
            {
                continue;
            }
            let Ok(len) = usize::try_from(body.len) else {
                continue;
            };
            let Ok(file) = tier.open(&body.file) else {
                continue;
            };
            // A body past its file's end is left to the load, which names the error.
            if body
                .offset
                .checked_add(body.len)
                .is_none_or(|end| end > file.len())
            {
                continue;
            }
            match ahead.reserve(key, len) {
                Ok(landing) => reads.push((file, body.offset, landing)),
                // A body the pool can never hold is read raw when its page loads;
                // the bodies after it may still fit.
                Err(Refused::Held | Refused::TooLarge) => continue,
                Err(Refused::NoRoom) => break,
            }
        }
        // Bodies that follow one another (the gap between them is the pack file's
        // alignment padding) read as one run: the next body starts past this one's
        // end (bodies of a corrupt manifest may overlap: each is then read on its
        // own) and within its room.
        let runs = file_runs(reads, |at, l, next| {
            let room = l.len().next_multiple_of(crate::ahead::UNIT) as u64;
            next >= at + l.len() as u64 && next - at <= room
        });
        for (file, _, run) in runs {
            self.read_bodies(m, file, run);
        }
    }

    /// Reads bodies of one file, each at its offset in order, as one run: a body's
    /// part stretches to the next body's offset (within its room in the pool), so the
    /// padding between them is read too and the run has no holes.
    fn read_bodies(&self, m: &Arc<OpenModel>, file: Arc<DirectFile>, bodies: Vec<(u64, Landing)>) {
        let Some(&(first, _)) = bodies.first() else {
            return;
        };
        let next: Vec<Option<u64>> = bodies
            .iter()
            .skip(1)
            .map(|(at, _)| Some(*at))
            .chain(std::iter::once(None))
            .collect();
        let start = std::time::Instant::now();
        let parts = bodies
            .into_iter()
            .zip(next)
            .map(|((at, landing), next)| {
                let len = next.map_or(landing.len(), |n| (n - at) as usize);
                let body = landing.len() as u64;
                let dst = landing.ptr();
                let m = Arc::clone(m);
                let then = move |read: std::io::Result<()>| {
                    if read.is_ok() {
                        if let ModelTier::File(tier) = &m.primary {
                            tier.counters().record_read(body, start.elapsed());
                        }
                    }
                    landing.land(read.is_ok());
                };
                RunPart {
                    dst,
                    len,
                    then: Box::new(then),
                }
            })
            .collect();
        // SAFETY: each part's `dst..dst + len` lies in its landing's room in the pool
        // (a part is at most its body's length rounded up to whole pool units, which
        // is the room reserved), which nothing else reads or writes until the landing
        // lands, in the part's completion.
        unsafe { self.readers.submit_run(&file, first, parts, false) };
    }

    /// Counters of the pool of bodies read ahead, once a model with bodies opened.
    pub fn read_ahead_stats(&self) -> Option<crate::ahead::ReadAheadStats> {
        self.ahead.get().map(|a| a.stats())
    }

    /// Queues `page` as a hint of its own; false when the queue is full or closed.
    fn requeue(&self, model: u32, page: u32) -> bool {
        self.prefetch_tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|tx| tx.try_send((model, vec![page])).is_ok())
    }

    /// The open primary file of a page whose load is one plain read there
    /// (raw bytes, no staged copy on the fast tier, no vpack body to try first): such
    /// a prefetch is read in flight without holding a thread. Other pages load on a
    /// prefetch thread through [`PageLoader`], which tries every copy.
    fn streamed(&self, m: &OpenModel, page: u32) -> Option<Arc<DirectFile>> {
        let entry = m.manifest.pages.get(page as usize)?;
        let ModelTier::File(tier) = &m.primary else {
            return None;
        };
        if entry.encoding != Encoding::Raw
            || entry.vpack().is_some()
            || m.is_superseded()
            || self
                .fast
                .as_ref()
                .is_some_and(|f| f.contains(&entry.blake3))
        {
            return None;
        }
        tier.open(&entry.file).ok()
    }

    /// Reads reserved pages that lie one after another in `file` in flight, as one run
    /// ([`ReadPool::submit_run`]: requests of whole pieces across the pages' ends),
    /// and publishes each once verified, from the reader that lands the last piece
    /// holding any of it. A read that fails, or bytes that fail verification, are
    /// loaded again through [`PageLoader`] on a thread of their own (rare: a bad copy,
    /// a truncated file), which tries every copy and reports the error that names page
    /// and tier; so a prefetch ends as a demand load would.
    fn read_slots(
        self: &Arc<Self>,
        m: Arc<OpenModel>,
        file: Arc<DirectFile>,
        offset: u64,
        pages: Vec<(u32, Reservation)>,
    ) {
        let parts = pages
            .into_iter()
            .map(|(page, r)| self.completion(Arc::clone(&m), page, r))
            .collect();
        // SAFETY: each part's `dst..dst + len` is its reserved slot, written by nothing
        // else until its completion finishes the reservation (see `completion`).
        unsafe { self.readers.submit_run(&file, offset, parts, false) };
    }

    /// The read of reserved `page` into its slot, and what publishes it once every
    /// piece holding it has landed (see [`Store::read_slots`]).
    fn completion(self: &Arc<Self>, m: Arc<OpenModel>, page: u32, mut r: Reservation) -> RunPart {
        let len = r.len();
        // SAFETY: the slot is the reservation's alone until it is finished, which
        // only the completion below does, after every piece has landed; the
        // reservation moves into the completion, so the slot outlives the reads.
        let dst = unsafe { r.buf() }.as_mut_ptr();
        let store = Arc::downgrade(self);
        let start = std::time::Instant::now();
        let then = move |read: std::io::Result<()>| {
            let entry = &m.manifest.pages[page as usize];
            let ModelTier::File(tier) = &m.primary else {
                unreachable!("`streamed` admits only a file tier");
            };
            // SAFETY: every piece has landed; the reservation is still unfinished, so
            // the slot is still this load's alone.
            let verified = read.is_ok()
                && m.seals
                    .verify(entry, unsafe { r.buf() }, tier.name())
                    .is_ok();
            if verified {
                tier.counters().record_read(len as u64, start.elapsed());
                m.served[1].fetch_add(1, Ordering::Relaxed);
                m.loads[page as usize].fetch_add(1, Ordering::Relaxed);
                if let Some(store) = store.upgrade() {
                    // SAFETY: as above: still this load's alone, and verified.
                    store.keep_fast(&m, page, unsafe { r.buf() });
                }
                let _ = r.finish(Ok::<(), StoreError>(()));
                return;
            }
            let Some(store) = store.upgrade() else { return };
            let retry = std::thread::Builder::new()
                .name("vpaged-reload".into())
                .spawn(move || {
                    crate::read_pool::mark_hint_thread();
                    // SAFETY: as above: the slot is this load's alone until `finish`.
                    let result = store.load_into(&m, page, unsafe { r.buf() });
                    let _ = r.finish(result);
                });
            // No thread: the reservation drops unfinished, failing this prefetch; the
            // demand request loads the page itself.
            drop(retry);
        };
        RunPart {
            dst,
            len,
            then: Box::new(then),
        }
    }

    /// Pins the pages an engine's memory planner chose (the daemon's `Pin`), in the
    /// order given, as far as they fit: the cache less the configured pins, less
    /// every other planner's, less a window of two of this model's largest layers
    /// (what its unpinned pages stream through). Then loads them, and marks the model
    /// as streaming its other pages ([`PageCache::set_streaming`]) while any planner's
    /// pins of it are held. A page another holder pinned already is granted at no
    /// cost. A page that fails to load stays pinned for its first request, which
    /// reports the error.
    pub fn pin_planned(
        self: &Arc<Self>,
        model: u32,
        pages: &[u32],
    ) -> Result<PlannedPins, StoreError> {
        let m = self.model(model)?;
        // Every page named must exist before any pin is counted (an error leaves no
        // holder behind).
        if let Some(&page) = pages
            .iter()
            .find(|&&p| m.manifest.pages.get(p as usize).is_none())
        {
            return Err(StoreError::NotFound {
                store: m.dir.clone(),
                detail: format!("no page {page} in model {model}"),
            });
        }
        let window = m.window;
        let configured: std::collections::HashSet<PageKey> = m.pins.iter().copied().collect();
        let mut granted = Vec::new();
        let mut new_keys = Vec::new();
        let mut bytes = 0usize;
        {
            let mut st = self.planned.lock().unwrap_or_else(|e| e.into_inner());
            let budget = self
                .cache
                .capacity()
                .saturating_sub(self.pinned_reserved.load(Ordering::Relaxed))
                .saturating_sub(window);
            for &page in pages {
                let entry = &m.manifest.pages[page as usize];
                let key = PageKey { model, page };
                if granted.contains(&key) {
                    continue;
                }
                // Pinned by the configuration already: granted at no cost, and never
                // unpinned when this planner's pins go.
                if configured.contains(&key) {
                    granted.push(key);
                    continue;
                }
                if let Some(n) = st.holders.get_mut(&key) {
                    *n += 1;
                    granted.push(key);
                    continue;
                }
                let b = slot_bytes(entry);
                if st.bytes + b > budget {
                    continue;
                }
                st.bytes += b;
                bytes += b;
                st.holders.insert(key, 1);
                granted.push(key);
                new_keys.push(key);
            }
            *st.per_model.entry(model).or_default() += 1;
        }
        self.cache.pin(new_keys.iter().copied());
        self.cache.set_streaming(model, true);
        // Routed experts stay admissible: the planner leaves them to the cache's
        // frequency-aware admission rather than to its static pins.
        self.cache.set_admissible(
            m.manifest
                .pages
                .iter()
                .filter(|p| matches!(p.group, PageGroup::Expert { .. }))
                .map(|p| PageKey { model, page: p.id }),
        );
        let pins = PlannedPins {
            store: Arc::downgrade(self),
            model,
            keys: granted,
            bytes,
        };
        for key in &new_keys {
            drop(self.acquire(model, key.page));
        }
        Ok(pins)
    }

    fn unpin_planned(&self, model: u32, keys: &[PageKey]) {
        let mut st = self.planned.lock().unwrap_or_else(|e| e.into_inner());
        let mut gone = Vec::new();
        for key in keys {
            if let Some(n) = st.holders.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    st.holders.remove(key);
                    gone.push(*key);
                }
            }
        }
        if let Ok(m) = self.model(model) {
            let freed: usize = gone
                .iter()
                .filter_map(|k| m.manifest.pages.get(k.page as usize))
                .map(slot_bytes)
                .sum();
            st.bytes = st.bytes.saturating_sub(freed);
        }
        let last = match st.per_model.get_mut(&model) {
            Some(n) => {
                *n -= 1;
                *n == 0
            }
            None => false,
        };
        if last {
            st.per_model.remove(&model);
        }
        drop(st);
        self.cache.unpin(gone);
        if last {
            self.cache.set_streaming(model, false);
        }
    }

    /// Copies the pages of `model` read from storage most often (verified bytes) onto
    /// the fast tier, hottest first, up to `max_bytes`: for a mixture of experts, the
    /// routed experts loaded again and again, before trunk pages the cache keeps.
    /// Returns (pages staged, bytes staged).
    pub fn stage_hot(&self, model: u32, max_bytes: u64) -> Result<(usize, u64), StoreError> {
        let Some(fast) = &self.fast else {
            return Err(StoreError::Store {
                store: PathBuf::from("<fast tier>"),
                detail: "no fast tier is configured".into(),
            });
        };
        let m = self.model(model)?;
        // The pages read from storage most often save the most reads a byte of fast
        // tier: a routed expert loaded on many passes before a trunk page pinned after
        // one load, however often the trunk page is requested. Requests break ties
        // (and rank pages never loaded since the model opened, by how hot they are).
        let (loads, accesses) = (m.load_counts(), m.access_counts());
        let mut order: Vec<(u64, u64, u32)> = loads
            .into_iter()
            .zip(accesses)
            .enumerate()
            .filter(|(_, (l, a))| *l > 0 || *a > 0)
            .map(|(i, (l, a))| (l, a, i as u32))
            .collect();
        order.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
        let order: Vec<(u64, u32)> = order.into_iter().map(|(l, _, p)| (l, p)).collect();
        let (mut pages, mut bytes) = (0, 0u64);
        for (_, page) in order {
            let entry = &m.manifest.pages[page as usize];
            let len = m.pages[page as usize].len;
            if bytes + len > max_bytes.min(fast.capacity()) {
                continue;
            }
            if !fast.contains(&entry.blake3) {
                let lease = self.acquire(model, page)?;
                fast.stage(&entry.blake3, lease.bytes())?;
            }
            pages += 1;
            bytes += len;
        }
        Ok((pages, bytes))
    }
}

impl Store {
    /// Removes the model's pages from the fast tier. Returns (pages, bytes) removed.
    pub fn unstage(&self, model: u32) -> Result<(usize, u64), StoreError> {
        let Some(fast) = &self.fast else {
            return Err(StoreError::Store {
                store: PathBuf::from("<fast tier>"),
                detail: "no fast tier is configured".into(),
            });
        };
        let m = self.model(model)?;
        let (mut pages, mut bytes) = (0, 0);
        for (e, p) in m.manifest.pages.iter().zip(&m.pages) {
            if fast.unstage(&e.blake3)? {
                pages += 1;
                bytes += p.len;
            }
        }
        Ok((pages, bytes))
    }
}

/// How far [`OpenModel::unreachable`] looks at a NAS before a load makes room.
#[derive(Clone, Copy)]
enum NasCheck {
    /// Again only while it was last found down.
    IfDown,
    /// Also while it is healthy, when its recheck interval has passed.
    IfDue,
}

fn cache_error(m: &OpenModel, page: u32, e: CacheError<StoreError>) -> StoreError {
    match e {
        // The loader's own error says what was wrong, and where.
        CacheError::Load { source, .. } => match Arc::try_unwrap(source) {
            Ok(inner) => inner,
            // Another request's load (a prefetch, another engine) failed: the same
            // error, so it keeps its kind (and the daemon its error code).
            Err(shared) => match &*shared {
                StoreError::Unavailable { page, reasons } => StoreError::Unavailable {
                    page: page.clone(),
                    reasons: reasons.clone(),
                },
                StoreError::Integrity {
                    page,
                    tier,
                    expected,
                    actual,
                } => StoreError::Integrity {
                    page: page.clone(),
                    tier: tier.clone(),
                    expected: expected.clone(),
                    actual: actual.clone(),
                },
                StoreError::Corrupt {
                    page,
                    expected,
                    copies,
                } => StoreError::Corrupt {
                    page: page.clone(),
                    expected: expected.clone(),
                    copies: copies.clone(),
                },
                other => StoreError::Store {
                    store: m.dir.clone(),
                    detail: other.to_string(),
                },
            },
        },
        other => StoreError::Store {
            store: m.dir.clone(),
            detail: format!("page '{}': {other}", m.pages[page as usize].label()),
        },
    }
}

/// The pages `--pin-first-layers`/`--pin-last-layers` ask to pin, most valuable
/// first: embeddings, final norm and LM head (used by every token), then the chosen
/// decoder layers from the ends of the stack inwards (layer 0, the last layer, layer
/// 1, ...); page id order within each. Nothing when both counts are zero.
fn pin_candidates(manifest: &Manifest, first: u32, last: u32) -> Vec<&PageEntry> {
    if first == 0 && last == 0 {
        return vec![];
    }
    let layers = manifest
        .pages
        .iter()
        .filter_map(|p| match p.group {
            PageGroup::Layer(l) => Some(l + 1),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    // (rank, page id): 0 for the always-used pages, 1 + distance from the nearer end
    // of the stack for a chosen layer.
    let mut ranked: Vec<(u32, &PageEntry)> = manifest
        .pages
        .iter()
        .filter_map(|p| match p.group {
            PageGroup::Embedding | PageGroup::Final => Some((0, p)),
            PageGroup::Layer(l) if l < first || l + last >= layers => {
                Some((1 + l.min(layers - 1 - l), p))
            }
            PageGroup::Layer(_) | PageGroup::Expert { .. } | PageGroup::Other => None,
        })
        .collect();
    ranked.sort_by_key(|(rank, p)| (*rank, p.id));
    ranked.into_iter().map(|(_, p)| p).collect()
}

/// The room a model's unpinned pages stream through, which planner pins never take:
/// its largest layer and three more of its largest page, and one position's routed
/// experts (`top_k` of a layer's largest: read beside what a layer holds once the
/// router has picked them; a layer's experts are not part of the layer here). An
/// engine's sweep
/// (`libvoom::model::sweep`) leases a decode step one matrix at a time and hints a
/// layer's worth of the pages after it; a pass of several chunks of positions leases
/// a layer whole, so that the layer is read once per pass, and hints a page's worth
/// after it. Either way the lease and the pages hinted take all but two pages of the
/// room: the page cache places each page in one run of slots, and that margin is
/// what the holes the pages before it left may waste (with too little, a page's hint
/// found no run, its demand load evicted prefetched pages still to be used, and a
/// pass read more than it streams: 7% on a 42-layer sweep with two layers and no
/// margin). The memory planner sizes its window the same way (`libvoom::placement`).
pub fn streaming_window_bytes(manifest: &Manifest, top_k: usize) -> usize {
    let mut per_layer: HashMap<u32, usize> = HashMap::new();
    let mut per_expert: HashMap<(u32, u32), usize> = HashMap::new();
    let mut largest_page = 0;
    for p in &manifest.pages {
        match p.group {
            PageGroup::Layer(l) => {
                *per_layer.entry(l).or_default() += slot_bytes(p);
                largest_page = largest_page.max(slot_bytes(p));
            }
            PageGroup::Expert { layer, expert } => {
                *per_expert.entry((layer, expert)).or_default() += slot_bytes(p);
            }
            _ => {}
        }
    }
    // One position's experts: the `top_k` largest of a layer's.
    let mut by_layer: HashMap<u32, Vec<usize>> = HashMap::new();
    for ((layer, _), bytes) in per_expert {
        by_layer.entry(layer).or_default().push(bytes);
    }
    let batch = by_layer
        .into_values()
        .map(|mut v| {
            v.sort_unstable_by(|a, b| b.cmp(a));
            v.iter().take(top_k.max(1)).sum::<usize>()
        })
        .max()
        .unwrap_or(0);
    per_layer.into_values().max().unwrap_or(0) + 3 * largest_page + batch
}

/// The experts a position picks per layer of the mixture of experts in `dir`
/// (`config.json`'s `num_experts_per_tok`, else its family's default as the engine
/// reads it: 2 for mixtral, 8 for the others); 8, the most any family defaults to,
/// where the config cannot be read (a larger window only pins less).
pub fn routed_top_k(dir: &Path) -> usize {
    let Some(v) = voom_formats::file::read_limited(
        &dir.join("config.json"),
        voom_formats::file::SIDE_FILE_MAX_BYTES,
    )
    .ok()
    .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok()) else {
        return 8;
    };
    match v.get("num_experts_per_tok").and_then(|k| k.as_u64()) {
        Some(k) => k.clamp(1, 1 << 16) as usize,
        None if v.get("model_type").and_then(|t| t.as_str()) == Some("mixtral") => 2,
        None => 8,
    }
}

/// A run of reads in one file: the file, the run's first offset, and its items with
/// their offsets.
type FileRun<T> = (Arc<DirectFile>, u64, Vec<(u64, T)>);

/// Reads of (file, offset, item), in file order, grouped into runs: an item joins the
/// run before it when it is in the same file and `follows(offset, item, next)` says
/// the item at `next` follows the one at `offset`. Each run comes with its file and
/// first offset, and its items with their offsets.
fn file_runs<T>(
    mut reads: Vec<(Arc<DirectFile>, u64, T)>,
    follows: impl Fn(u64, &T, u64) -> bool,
) -> Vec<FileRun<T>> {
    reads.sort_by(|(f, a, _), (g, b, _)| f.path().cmp(g.path()).then(a.cmp(b)));
    let mut runs: Vec<FileRun<T>> = Vec::new();
    for (file, offset, item) in reads {
        match runs.last_mut() {
            Some((f, _, run))
                if Arc::ptr_eq(f, &file)
                    && run
                        .last()
                        .is_some_and(|(at, prev)| follows(*at, prev, offset)) =>
            {
                run.push((offset, item));
            }
            _ => runs.push((file, offset, vec![(offset, item)])),
        }
    }
    runs
}

/// Bytes of the cache slot a page takes (whole 16 KiB units, at least one).
fn slot_bytes(p: &PageEntry) -> usize {
    let len = p.decoded_len().unwrap_or(p.len);
    usize::try_from(len)
        .unwrap_or(usize::MAX)
        .div_ceil(SLOT_ALIGN)
        .max(1)
        .saturating_mul(SLOT_ALIGN)
}

/// Warns that an open model's manifest could not be re-checked, and keeps the model.
fn keep_unchecked(m: &OpenModel, e: &dyn std::fmt::Display) -> Option<LoadedManifest> {
    tracing::warn!(
        "{}: cannot re-check the page manifest ({e}); serving the one opened before",
        m.dir.display()
    );
    None
}

/// A model store's manifest, checked against the checkpoint that is there, with the
/// blake3 of the very bytes it was parsed from.
/// Hashes the checkpoint in `dir` (what `vpagectl hash` does), logging progress
/// every tenth of the bytes.
fn hash_checkpoint(dir: &Path) -> Result<Manifest, StoreError> {
    let ckpt = Checkpoint::open(dir)?;
    tracing::info!(
        "{}: no page manifest; hashing the checkpoint once to write one",
        dir.display()
    );
    let mut shown = 0u64;
    let manifest = Manifest::build(&ckpt, &mut |done, total| {
        let tenth = (done * 10).checked_div(total).unwrap_or(10);
        if tenth > shown {
            shown = tenth;
            tracing::info!(
                "{}: hashed {:.2} of {:.2} GB",
                dir.display(),
                done as f64 / 1e9,
                total as f64 / 1e9
            );
        }
    })?;
    Ok(manifest)
}

fn log_written(dir: &Path, path: &Path, manifest: &Manifest) {
    tracing::info!(
        "{}: wrote its page manifest {} ({} pages)",
        dir.display(),
        path.display(),
        manifest.pages.len()
    );
}

/// A manifest the store keeps for a checkpoint whose own directory it cannot write:
/// `<manifest_dir>/<name>-<16 hex digits of the path's blake3>/voom-manifest.json`,
/// beside `checkpoint.json`, the identity (name, length, inode, modification and
/// change times) of every checkpoint file it was computed from. It is used only while
/// those files are unchanged.
struct KeptManifest {
    dir: PathBuf,
}

/// File name of a kept manifest's record of the checkpoint files.
const KEPT_RECORD: &str = "checkpoint.json";

impl KeptManifest {
    fn of(root: &Path, model: &Path) -> KeptManifest {
        use std::os::unix::ffi::OsStrExt;
        let key = blake3::hash(model.as_os_str().as_bytes()).to_hex();
        let name = model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        KeptManifest {
            dir: root.join(format!("{name}-{}", &key[..16])),
        }
    }

    fn manifest(&self) -> PathBuf {
        self.dir.join(MANIFEST_FILE)
    }

    /// The identity of the checkpoint's files in `model` now, sorted by name.
    fn files_of(model: &Path) -> Vec<serde_json::Value> {
        let mut files: Vec<serde_json::Value> = std::fs::read_dir(model)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                if !(name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json")) {
                    return None;
                }
                let m = std::fs::metadata(e.path()).ok()?;
                Some(serde_json::json!([
                    name,
                    m.len(),
                    m.ino(),
                    [m.mtime(), m.mtime_nsec()],
                    [m.ctime(), m.ctime_nsec()]
                ]))
            })
            .collect();
        files.sort_by(|a, b| a[0].as_str().cmp(&b[0].as_str()));
        files
    }

    fn is_fresh(&self, model: &Path) -> bool {
        let Ok(text) = voom_formats::file::read_limited(
            &self.dir.join(KEPT_RECORD),
            voom_formats::file::SIDE_FILE_MAX_BYTES,
        ) else {
            return false;
        };
        self.manifest().is_file()
            && serde_json::from_slice::<Vec<serde_json::Value>>(&text)
                .is_ok_and(|rec| rec == Self::files_of(model))
    }

    fn save(&self, manifest: &Manifest, model: &Path) -> Result<(), StoreError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| StoreError::Store {
            store: model.to_path_buf(),
            detail: format!(
                "no page manifest ({MANIFEST_FILE}), the checkpoint's directory cannot be \
                 written, and {what} {}: {e}",
                self.dir.display()
            ),
        };
        std::fs::create_dir_all(&self.dir).map_err(|e| fail("cannot create", &e))?;
        manifest
            .save(&self.dir)
            .map_err(|e| fail("the manifest cannot be written in", &e))?;
        // Written after the manifest, by rename: a record names a complete manifest.
        let record = serde_json::to_vec(&Self::files_of(model)).expect("JSON values serialize");
        let tmp = self
            .dir
            .join(format!(".{KEPT_RECORD}.{}", std::process::id()));
        std::fs::write(&tmp, &record)
            .and_then(|()| std::fs::rename(&tmp, self.dir.join(KEPT_RECORD)))
            .map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                fail("the checkpoint record cannot be written in", &e)
            })
    }
}

fn load_checked(dir: &Path) -> Result<LoadedManifest, StoreError> {
    load_checked_at(dir, &dir.join(MANIFEST_FILE))
}

/// The manifest at `path` for the checkpoint in `dir`, checked against it.
fn load_checked_at(dir: &Path, path: &Path) -> Result<LoadedManifest, StoreError> {
    let path = path.to_path_buf();
    let missing = || StoreError::NotFound {
        store: dir.to_path_buf(),
        detail: "no page manifest (voom-manifest.json): run `vpagectl hash` on it".into(),
    };
    let io = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound => missing(),
        _ => StoreError::Format(FormatError::io(path.clone(), e)),
    };
    // A regular file only, opened without blocking (a FIFO in its place is refused).
    let mut file = voom_formats::file::open(&path).map_err(io)?;
    // Taken before reading: a change after it shows at the next re-check.
    let stamp = FileStamp::from_metadata(&file.metadata().map_err(io)?);
    let limit = voom_formats::manifest::MANIFEST_MAX_BYTES;
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(&mut file, limit + 1), &mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("more than {limit} bytes is refused"),
        )));
    }
    // Parsed from the very bytes read, which the digest describes.
    let manifest = Manifest::from_bytes(&path, &bytes)?;
    manifest.check_matches(&Checkpoint::open(dir)?)?;
    warn_if_experts_ungrouped(&manifest, &path);
    Ok(LoadedManifest {
        path,
        manifest,
        digest: *blake3::hash(&bytes).as_bytes(),
        stamp,
    })
}

/// A manifest that predates per-expert pages ([`Manifest::experts_ungrouped`]) gives
/// the right answers slowly: says so, and how to fix it.
pub fn warn_if_experts_ungrouped(manifest: &Manifest, path: &Path) {
    if manifest.experts_ungrouped() {
        tracing::warn!(
            "{}: this page manifest predates per-expert pages (format {}): the routed \
             experts are paged as trunk, and experts fused in one tensor are read whole \
             for any one picked; run `vpagectl hash` on the model to write it anew",
            path.display(),
            manifest.format_version
        );
    }
}

/// `p` made absolute (against the current directory) with `.` and `..` resolved
/// lexically, touching no file system.
fn lexical_absolute(p: &Path) -> PathBuf {
    use std::path::Component;
    let joined = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(p)
    };
    let mut out = PathBuf::new();
    for c in joined.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// The store as an engine's [`PageSource`] in the same process.
pub struct StoreSource {
    store: Arc<Store>,
    model: Arc<OpenModel>,
    /// The pins its engine's planner was granted ([`Store::pin_planned`]), held for
    /// as long as the source lives.
    planned: Mutex<Option<PlannedPins>>,
}

impl StoreSource {
    pub fn open(store: Arc<Store>, dir: &Path) -> Result<Self, StoreError> {
        let id = store.open_model(dir)?;
        let model = store.model(id)?;
        Ok(StoreSource {
            store,
            model,
            planned: Mutex::new(None),
        })
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }
}

impl PageSource for StoreSource {
    fn pages(&self) -> &[PageMeta] {
        &self.model.pages
    }

    fn acquire(&self, id: PageId) -> Result<PageLease, StoreError> {
        let lease = self.store.acquire(self.model.id, id.0)?;
        let bytes = lease.bytes();
        let (ptr, len) = (bytes.as_ptr(), bytes.len());
        // SAFETY: the bytes lie in the cache's arena slot, which the lease keeps
        // resident and unchanged until it is dropped; the PageLease owns the lease.
        Ok(unsafe { PageLease::new(id, ptr, len, Arc::new(lease)) })
    }

    fn prefetch(&self, ids: &[PageId]) {
        let pages: Vec<u32> = ids.iter().map(|id| id.0).collect();
        self.store.prefetch_group(self.model.id, &pages);
    }

    fn ready(&self, ids: &[PageId]) -> bool {
        let cache = self.store.cache();
        ids.iter().all(|id| {
            cache.resident(PageKey {
                model: self.model.id,
                page: id.0,
            })
        })
    }

    fn read_ahead(&self, ids: &[PageId]) {
        let pages: Vec<u32> = ids.iter().map(|id| id.0).collect();
        self.store.read_ahead(self.model.id, &pages);
    }

    /// Pins the planner's pages as the daemon does ([`Store::pin_planned`]): as far
    /// as they fit beside the configured pins, other planners' and a window of two
    /// layers, marking the model as streaming the rest ([`PageCache::set_streaming`]:
    /// none of its other pages is admitted to the cache's main region, which would
    /// take the room the planner left for streaming), then loading them at once, in
    /// order: each takes its slot as high in the arena as it fits, so that pins sit
    /// together at the top and leave the bottom whole for the pages that stream. A
    /// page that fails to load is left to its first demand request, which reports
    /// the error. (Pinned straight into the cache, the planner's pages once took the
    /// room of the configured pins too: with `pin_last_layers` beside a
    /// `cache_budget`, a layer then found no room and the run failed.)
    fn pin(&self, ids: &[PageId]) {
        let pages: Vec<u32> = ids.iter().map(|id| id.0).collect();
        match self.store.pin_planned(self.model.id, &pages) {
            // Granted before the pins it replaces are dropped: pages in both stay.
            Ok(p) => drop(
                self.planned
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .replace(p),
            ),
            Err(e) => tracing::warn!("{}: the planner's pins: {e}", self.model.dir.display()),
        }
    }

    fn keep_on_fast_tier(&self, ids: &[PageId]) {
        let pages: Vec<u32> = ids.iter().map(|id| id.0).collect();
        if let Err(e) = self.store.keep_on_fast_tier(self.model.id, &pages, false) {
            tracing::warn!(
                "{}: the fast tier's static set: {e}",
                self.model.dir.display()
            );
        }
    }

    /// The cache less the configured pins: what a planner may place pages in.
    fn budget(&self) -> Option<u64> {
        let cache = self.store.cache().limit();
        Some(cache.saturating_sub(self.store.pinned_reserved.load(Ordering::Relaxed)) as u64)
    }

    fn set_cache_limit(&self, limit: u64) -> Option<u64> {
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        Some(self.store.cache().set_limit(limit) as u64)
    }

    fn cache_withheld(&self) -> u64 {
        let c = self.store.cache();
        (c.capacity() - c.limit()) as u64
    }

    fn cache_stats(&self) -> Option<crate::source::SourceCacheStats> {
        let c = self.store.cache_stats();
        Some(crate::source::SourceCacheStats {
            hits: c.hits,
            misses: c.misses,
            bytes_loaded: c.bytes_loaded,
            inflight_waits: c.inflight_dedups,
            prefetch_loads: c.prefetch_loads,
            prefetch_skipped: c.prefetch_skipped,
            unused_evictions: c.unused_evictions,
            bodies_read_ahead: self.store.read_ahead_stats().map_or(0, |s| s.taken),
            fast_tier_bytes: self.store.fast_tier().map_or(0, |f| f.stats().bytes),
            primary_bytes: match self.model.location() {
                ModelTier::File(t) => t.stats().bytes,
                ModelTier::Nas(_) => 0,
            },
            nas_bytes: self.model.nas_stats().map_or(0, |s| s.bytes),
            used_bytes: c.used as u64,
            capacity_bytes: c.capacity as u64,
            withheld_bytes: c.withheld as u64,
        })
    }

    /// The store core verifies every page it loads, on every tier (a checkpoint
    /// without a manifest is hashed when it opens).
    fn verifies(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        format!("store:{}", self.model.dir.display())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::{Duration, Instant};

    use voom_formats::DType;

    use super::*;
    use crate::tier::TierError;

    /// Writes a two-tensor checkpoint ('a': 8 KiB BF16, 'b': 64 bytes F32) and its
    /// manifest into `dir`.
    fn write_model(dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        let a: Vec<u8> = (0..=255u8).cycle().take(8192).collect();
        let b: Vec<u8> = (0..64u8).map(|x| x.wrapping_mul(13)).collect();
        write_checkpoint(
            dir,
            &[
                ("a", DType::BF16, &[64, 64], &a),
                ("b", DType::F32, &[16], &b),
            ],
        );
    }

    /// `dir/model.safetensors` of `tensors`, and its page manifest.
    fn write_checkpoint(dir: &Path, tensors: &[(&str, DType, &[usize], &[u8])]) {
        voom_formats::safetensors::write(&dir.join("model.safetensors"), tensors, &BTreeMap::new())
            .unwrap();
        Manifest::build(&Checkpoint::open(dir).unwrap(), &mut |_, _| {})
            .unwrap()
            .save(dir)
            .unwrap();
    }

    fn nas_config(mount: &Path, remount_command: Option<String>) -> NasConfig {
        NasConfig {
            mount: mount.to_path_buf(),
            model: PathBuf::new(),
            timeout: Duration::from_millis(500),
            recheck: Duration::ZERO,
            remount_command,
        }
    }

    fn store(nas: Vec<NasConfig>) -> Arc<Store> {
        Store::new(StoreConfig {
            cache_bytes: 1 << 20,
            nas,
            ..Default::default()
        })
        .unwrap()
    }

    fn page_id(m: &OpenModel, name: &str) -> u32 {
        m.manifest.page(name).unwrap().id
    }

    #[test]
    fn a_model_on_a_nas_is_read_through_its_nas_tier() {
        let d = tempfile::tempdir().unwrap();
        let mount = d.path().join("nas");
        write_model(&mount.join("models/m"));
        let s = store(vec![nas_config(&mount, None)]);
        let id = s.open_model(&mount.join("models/./m")).unwrap();
        // The same directory, spelled otherwise, is the same model.
        let again = s.open_model(&mount.join("models/x/../m")).unwrap();
        assert_eq!(id, again);
        let m = s.model(id).unwrap();
        assert_eq!(m.dir, mount.join("models/m"));
        assert!(matches!(m.location(), ModelTier::Nas(_)));
        assert_eq!(m.nas_tier().unwrap().mount(), mount);
        let a = page_id(&m, "a");
        let lease = s.acquire(id, a).unwrap();
        assert_eq!(
            blake3::hash(lease.bytes()).to_hex().as_str(),
            m.manifest.pages[a as usize].blake3
        );
        assert_eq!(m.served_counts(), [0, 0, 1]);
        assert_eq!(m.nas_stats().unwrap().reads, 1);
        assert_eq!(m.nas_health(), Some(Health::Ok));
    }

    #[test]
    fn resident_pages_are_served_while_the_nas_is_down_and_loads_resume_after() {
        let d = tempfile::tempdir().unwrap();
        let mount = d.path().join("nas");
        let away = d.path().join("nas.away");
        write_model(&mount.join("m"));
        let s = store(vec![nas_config(&mount, None)]);
        let id = s.open_model(&mount.join("m")).unwrap();
        let m = s.model(id).unwrap();
        let (a, b) = (page_id(&m, "a"), page_id(&m, "b"));
        drop(s.acquire(id, a).unwrap());

        std::fs::rename(&mount, &away).unwrap();
        let t = Instant::now();
        assert!(s.acquire(id, a).is_ok(), "a resident page is served");
        let e = s.acquire(id, b).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2));
        assert!(matches!(e, StoreError::Unavailable { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("page 'b'") && msg.contains(&format!("NAS mount {}", mount.display())),
            "{msg}"
        );
        assert!(matches!(m.nas_health(), Some(Health::Unavailable(_))));

        std::fs::rename(&away, &mount).unwrap();
        s.acquire(id, b).unwrap();
        assert_eq!(m.nas_health(), Some(Health::Ok));
        assert_eq!(m.nas_tier().unwrap().recoveries(), 1);
    }

    /// The fast tier's static set: candidates taken in order as far as the room goes
    /// (a later part appends), a copy written as a page is first read, and a new set
    /// removes the model's copies outside it.
    #[test]
    fn the_static_set_takes_what_fits_and_a_new_set_removes_the_old_copies() {
        let d = tempfile::tempdir().unwrap();
        write_model(&d.path().join("m"));
        let s = Store::new(StoreConfig {
            cache_bytes: 1 << 20,
            fast_tier: Some((d.path().join("fast"), 8192 + 63)),
            ..Default::default()
        })
        .unwrap();
        let id = s.open_model(&d.path().join("m")).unwrap();
        let m = s.model(id).unwrap();
        let (a, b) = (page_id(&m, "a"), page_id(&m, "b"));
        let fast = s.fast_tier().unwrap();
        // 'a' (8 KiB) fits; 'b' (64 bytes) then does not, whether in one list or in
        // a part appended after.
        assert_eq!(s.keep_on_fast_tier(id, &[a, b], false).unwrap(), (1, 8192));
        assert_eq!(s.keep_on_fast_tier(id, &[a], false).unwrap(), (1, 8192));
        assert_eq!(s.keep_on_fast_tier(id, &[b], true).unwrap(), (0, 0));
        let (ha, hb) = (
            &m.manifest.pages[a as usize].blake3,
            &m.manifest.pages[b as usize].blake3,
        );
        assert!(!fast.contains(ha), "nothing is copied before it is read");
        drop(s.acquire(id, a).unwrap());
        assert!(fast.contains(ha));
        // A set of 'b' alone: 'a's copy goes, 'b' is kept once read.
        assert_eq!(s.keep_on_fast_tier(id, &[b], false).unwrap(), (1, 64));
        assert!(!fast.contains(ha) && !fast.contains(hb));
        drop(s.acquire(id, b).unwrap());
        assert!(fast.contains(hb));
        assert_eq!(fast.used(), 64);
    }

    /// Staging ranks pages by the loads a fast-tier copy would have served, not by
    /// requests: a trunk page the cache kept after one load (requested every pass)
    /// comes after routed experts loaded pass after pass.
    #[test]
    fn staging_takes_the_pages_loaded_most_often_first() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("m");
        std::fs::create_dir_all(&dir).unwrap();
        let page = |seed: u8| -> Vec<u8> { (0..256).map(|i| (i as u8) ^ seed).collect() };
        let (t, e1, e2) = (page(1), page(2), page(3));
        write_checkpoint(
            &dir,
            &[
                ("trunk", DType::F32, &[64], &t),
                ("expert.1", DType::F32, &[64], &e1),
                ("expert.2", DType::F32, &[64], &e2),
            ],
        );
        let s = Store::new(StoreConfig {
            cache_bytes: SLOT_ALIGN,
            fast_tier: Some((d.path().join("fast"), 1 << 20)),
            ..Default::default()
        })
        .unwrap();
        let id = s.open_model(&dir).unwrap();
        let m = s.model(id).unwrap();
        let (tr, x1, x2) = (
            page_id(&m, "trunk"),
            page_id(&m, "expert.1"),
            page_id(&m, "expert.2"),
        );
        for _ in 0..10 {
            drop(s.acquire(id, tr).unwrap());
        }
        for _ in 0..3 {
            drop(s.acquire(id, x1).unwrap());
            drop(s.acquire(id, x2).unwrap());
        }
        let (loads, requests) = (m.load_counts(), m.access_counts());
        assert_eq!(
            [tr, x1, x2].map(|p| (loads[p as usize], requests[p as usize])),
            [(1, 10), (3, 3), (3, 3)]
        );
        assert_eq!(s.stage_hot(id, 512).unwrap(), (2, 512));
        let fast = s.fast_tier().unwrap();
        let staged = |p: u32| fast.contains(&m.manifest.pages[p as usize].blake3);
        assert_eq!([tr, x1, x2].map(staged), [false, true, true]);
    }

    /// A load of a page only a NAS that is down holds fails before the cache makes
    /// room for it: a one-slot cache keeps serving the page it holds through any
    /// number of hints and requests for the other, and loads resume once it is back.
    #[test]
    fn a_nas_that_is_down_evicts_no_resident_page() {
        let d = tempfile::tempdir().unwrap();
        let mount = d.path().join("nas");
        let away = d.path().join("nas.away");
        write_model(&mount.join("m"));
        let s = Store::new(StoreConfig {
            cache_bytes: SLOT_ALIGN,
            nas: vec![nas_config(&mount, None)],
            ..Default::default()
        })
        .unwrap();
        let id = s.open_model(&mount.join("m")).unwrap();
        let m = s.model(id).unwrap();
        let (a, b) = (page_id(&m, "a"), page_id(&m, "b"));
        drop(s.acquire(id, a).unwrap());

        // The outage is found by a health check (the daemon's, `vpagectl tiers`), or
        // by a prefetch: neither makes room first.
        std::fs::rename(&mount, &away).unwrap();
        s.prefetch_now(id, &[b]);
        assert!(matches!(m.nas_health(), Some(Health::Unavailable(_))));
        for _ in 0..3 {
            s.prefetch_now(id, &[b]);
            let e = s.acquire(id, b).unwrap_err();
            assert!(matches!(e, StoreError::Unavailable { .. }), "{e}");
            let msg = e.to_string();
            assert!(
                msg.contains("page 'b'") && msg.contains(&format!("NAS mount {}", mount.display())),
                "{msg}"
            );
        }
        let stats = s.cache_stats();
        assert_eq!((stats.evictions, stats.loads), (0, 1));
        assert!(s.cache().resident(PageKey { model: id, page: a }));
        let lease = s.acquire(id, a).unwrap();
        assert_eq!(
            blake3::hash(lease.bytes()).to_hex().as_str(),
            m.manifest.pages[a as usize].blake3
        );
        drop(lease);

        std::fs::rename(&away, &mount).unwrap();
        s.acquire(id, b).unwrap();
        assert_eq!(m.nas_health(), Some(Health::Ok));
        assert_eq!(s.cache_stats().evictions, 1);
    }

    #[test]
    fn a_dead_nas_at_open_is_an_error_naming_the_mount_unless_the_remount_fixes_it() {
        let d = tempfile::tempdir().unwrap();
        let mount = d.path().join("nas");
        let away = d.path().join("nas.away");
        write_model(&mount.join("m"));
        std::fs::rename(&mount, &away).unwrap();

        let e = store(vec![nas_config(&mount, None)])
            .open_model(&mount.join("m"))
            .unwrap_err();
        assert!(
            matches!(e, StoreError::Tier(TierError::MountUnavailable { .. })),
            "{e}"
        );
        assert!(
            e.to_string()
                .contains(&format!("NAS mount {} is unavailable", mount.display())),
            "{e}"
        );

        let remount = format!("mv '{}' '{}'", away.display(), mount.display());
        let s = store(vec![nas_config(&mount, Some(remount))]);
        let id = s.open_model(&mount.join("m")).unwrap();
        s.acquire(id, 0).unwrap();
    }

    /// Replaces `dir`'s manifest by a sparse file of 256 MiB: reading it takes far
    /// longer than [`SLOW_NAS_TIMEOUT`], like a read on a mount that has become very
    /// slow. (A FIFO, which blocks for good, is no longer opened at all: the store reads
    /// regular files only.)
    fn slow_manifest(dir: &Path) {
        let f = std::fs::File::create(dir.join(MANIFEST_FILE)).unwrap();
        f.set_len(256 << 20).unwrap();
    }

    /// The NAS timeout of the tests with a [`slow_manifest`].
    const SLOW_NAS_TIMEOUT: Duration = Duration::from_millis(50);

    fn slow_nas_config(mount: &Path) -> NasConfig {
        NasConfig {
            timeout: SLOW_NAS_TIMEOUT,
            ..nas_config(mount, None)
        }
    }

    #[test]
    fn opening_a_model_on_a_hanging_nas_is_bounded_by_its_timeout() {
        let d = tempfile::tempdir().unwrap();
        let mount = d.path().join("nas");
        let dir = mount.join("m");
        write_model(&dir);
        slow_manifest(&dir);
        let t = Instant::now();
        let e = store(vec![slow_nas_config(&mount)])
            .open_model(&dir)
            .unwrap_err()
            .to_string();
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        assert!(
            e.contains("opening the model store")
                && e.contains("within")
                && e.contains(&mount.display().to_string()),
            "{e}"
        );
    }

    /// The regression of a session stuck for good: a FIFO in place of a store file
    /// (the manifest, the checkpoint, its index or a shard) blocked `open_model` until
    /// a writer came. Each is refused at once with an error naming it, locally and on
    /// a NAS (without waiting for the mount's timeout).
    #[test]
    fn a_fifo_in_place_of_a_store_file_is_refused_at_once() {
        let d = tempfile::tempdir().unwrap();
        let mount = d.path().join("nas");
        let s = store(vec![nas_config(&mount, None)]);
        for (i, file) in [
            MANIFEST_FILE,
            "model.safetensors",
            "model.safetensors.index.json",
        ]
        .into_iter()
        .enumerate()
        {
            for dir in [
                d.path().join(format!("local{i}")),
                mount.join(format!("m{i}")),
            ] {
                write_model(&dir);
                if file == "model.safetensors.index.json" {
                    // A sharded checkpoint whose index is a FIFO.
                    std::fs::rename(dir.join("model.safetensors"), dir.join("s1.safetensors"))
                        .unwrap();
                }
                let path = dir.join(file);
                let _ = std::fs::remove_file(&path);
                let st = std::process::Command::new("mkfifo")
                    .arg(&path)
                    .status()
                    .unwrap();
                assert!(st.success());
                let t = Instant::now();
                let e = s.open_model(&dir).unwrap_err().to_string();
                assert!(
                    t.elapsed() < Duration::from_millis(400),
                    "{:?}",
                    t.elapsed()
                );
                assert!(
                    e.contains(&path.display().to_string())
                        && e.contains("is a FIFO, not a regular file"),
                    "{file}: {e}"
                );
            }
        }
    }

    #[test]
    fn a_local_model_keeps_its_nas_copy_behind_it() {
        let d = tempfile::tempdir().unwrap();
        let local = d.path().join("local/m");
        let mount = d.path().join("nas");
        write_model(&local);
        write_model(&mount.join("m"));
        let s = store(vec![nas_config(&mount, None)]);
        let id = s.open_model(&local).unwrap();
        let m = s.model(id).unwrap();
        assert!(matches!(m.location(), ModelTier::File(_)));
        assert!(m.nas_tier().is_some());
        // A flipped byte in the local copy: the NAS copy serves the page.
        let b = m.manifest.page("b").unwrap();
        let path = local.join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[b.offset as usize] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        s.acquire(id, b.id).unwrap();
        assert_eq!(m.served_counts(), [0, 0, 1]);
        assert_eq!(m.primary_stats().integrity_failures, 1);
    }

    /// Writes a model whose tensors fall in the manifest's page groups: embeddings and
    /// LM head of `big` bytes each, a final norm, and `layers` decoder layers of one
    /// `big`-byte matrix and one norm each.
    fn write_layered_model(dir: &Path, layers: u32, big: usize) {
        std::fs::create_dir_all(dir).unwrap();
        let big_bytes: Vec<u8> = (0..big).map(|i| (i % 251) as u8).collect();
        let norm = [1u8; 64];
        let mut names: Vec<(String, bool)> = vec![
            ("model.embed_tokens.weight".into(), true),
            ("lm_head.weight".into(), true),
            ("model.norm.weight".into(), false),
        ];
        for l in 0..layers {
            names.push((format!("model.layers.{l}.mlp.down_proj.weight"), true));
            names.push((format!("model.layers.{l}.input_layernorm.weight"), false));
        }
        let big_shape = [big / 2];
        let norm_shape = [16usize];
        let tensors: Vec<(&str, DType, &[usize], &[u8])> = names
            .iter()
            .map(|(n, is_big)| match is_big {
                true => (n.as_str(), DType::BF16, &big_shape[..], &big_bytes[..]),
                false => (n.as_str(), DType::F32, &norm_shape[..], &norm[..]),
            })
            .collect();
        voom_formats::safetensors::write(
            &dir.join("model.safetensors"),
            &tensors,
            &BTreeMap::new(),
        )
        .unwrap();
        Manifest::build(&Checkpoint::open(dir).unwrap(), &mut |_, _| {})
            .unwrap()
            .save(dir)
            .unwrap();
    }

    /// An engine's planner on the in-process source plans in the cache less the
    /// configured pins and is granted what fits beside them and a window of two
    /// layers: every page then streams, where pinning the planner's pages straight
    /// into the cache left no room for a layer.
    #[test]
    fn a_planner_beside_configured_pins_leaves_room_to_stream() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("m");
        write_layered_model(&dir, 8, 4 * SLOT_ALIGN);
        let s = Store::new(StoreConfig {
            cache_bytes: 40 * SLOT_ALIGN,
            pin_last_layers: 3,
            ..Default::default()
        })
        .unwrap();
        let src = StoreSource::open(Arc::clone(&s), &dir).unwrap();
        let m = s.model(src.model.id).unwrap();
        let budget = src.budget().unwrap() as usize;
        assert_eq!(budget, 40 * SLOT_ALIGN - m.pinned_slot_bytes);
        // The planner asks for every page (it cannot know the window the store keeps).
        let all: Vec<PageId> = (0..m.pages.len() as u32).map(PageId).collect();
        src.pin(&all);
        for k in m.pinned_pages() {
            drop(s.acquire(m.id, k.page).unwrap());
        }
        let window = streaming_window_bytes(&m.manifest, routed_top_k(&m.dir));
        let pinned = s.cache_stats().pinned_bytes;
        assert!(
            pinned + window <= 40 * SLOT_ALIGN,
            "pinned {pinned}, window {window}"
        );
        for _ in 0..2 {
            for p in &all {
                drop(src.acquire(*p).unwrap());
            }
        }
        drop(src);
        // The planner's pins go with the source; the configured ones stay.
        assert_eq!(s.cache_stats().pinned_bytes, m.pinned_slot_bytes);
    }

    /// A planner's pin request naming a page the model lacks is refused whole: it
    /// leaves no holder behind, so the same page pinned after is new and counted.
    #[test]
    fn a_planned_pin_of_a_missing_page_pins_nothing() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("m");
        write_layered_model(&dir, 2, 2 * SLOT_ALIGN);
        let s = Store::new(StoreConfig {
            cache_bytes: 64 * SLOT_ALIGN,
            ..Default::default()
        })
        .unwrap();
        let id = s.open_model(&dir).unwrap();
        let e = s.pin_planned(id, &[0, 9999]).err().expect("refused");
        assert!(matches!(e, StoreError::NotFound { .. }), "{e}");
        assert_eq!(s.cache_stats().pinned_bytes, 0);
        let pins = s.pin_planned(id, &[0]).unwrap();
        assert_eq!(pins.pages(), 1);
        assert!(
            pins.bytes() > 0,
            "page 0 was left held by the refused request"
        );
        drop(pins);
        assert_eq!(s.cache_stats().pinned_bytes, 0);
    }

    /// Pins never take more than half the cache, in priority order, so a cache too
    /// small for everything asked to be pinned still streams every other page.
    #[test]
    fn pins_are_capped_at_half_the_cache_and_unpinned_pages_still_stream() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("m");
        // 32 KiB matrices: two slots each. Asked for: embeddings, LM head, final norm,
        // layer 0 = 8 slots, the whole cache.
        write_layered_model(&dir, 4, 2 * SLOT_ALIGN);
        let s = Store::new(StoreConfig {
            cache_bytes: 8 * SLOT_ALIGN,
            pin_first_layers: 1,
            ..Default::default()
        })
        .unwrap();
        let id = s.open_model(&dir).unwrap();
        let m = s.model(id).unwrap();
        let pinned: Vec<&str> = m
            .pinned_pages()
            .iter()
            .map(|k| m.pages[k.page as usize].name.as_str())
            .collect();
        // Priority: the pages every token uses first, in page id order; the norm's slot
        // would pass half the cache, so pinning stops there.
        assert_eq!(pinned, ["lm_head.weight", "model.embed_tokens.weight"]);
        for k in m.pinned_pages() {
            drop(s.acquire(id, k.page).unwrap());
        }
        assert_eq!(s.cache_stats().pinned_bytes, 4 * SLOT_ALIGN);
        // Every other page streams through the other half, twice over.
        for _ in 0..2 {
            for p in 0..m.pages.len() as u32 {
                drop(s.acquire(id, p).unwrap());
            }
        }
        assert_eq!(s.cache_stats().full_refusals, 0);
        assert_eq!(s.cache_stats().pinned_bytes, 4 * SLOT_ALIGN);
    }

    /// The pin budget is shared: a second model gets what the first left.
    #[test]
    fn the_pin_budget_is_shared_by_every_model() {
        let d = tempfile::tempdir().unwrap();
        write_layered_model(&d.path().join("a"), 2, 2 * SLOT_ALIGN);
        write_layered_model(&d.path().join("b"), 2, 2 * SLOT_ALIGN);
        let s = Store::new(StoreConfig {
            cache_bytes: 12 * SLOT_ALIGN,
            pin_last_layers: 1,
            ..Default::default()
        })
        .unwrap();
        let a = s.model(s.open_model(&d.path().join("a")).unwrap()).unwrap();
        let b = s.model(s.open_model(&d.path().join("b")).unwrap()).unwrap();
        // Six slots in all: model a takes LM head, embeddings, final norm and its last
        // layer's norm (6 slots; the layer's matrix does not fit); model b gets none.
        assert_eq!(a.pinned_pages().len(), 4);
        assert!(b.pinned_pages().is_empty(), "{:?}", b.pinned_pages());
    }

    /// The digest a model reports is that of the manifest bytes it was loaded from; a
    /// manifest changed on disk opens as a new model, the old id still serving its
    /// sessions, while an unchanged (or rewritten but identical) one keeps its id.
    #[test]
    fn a_changed_manifest_opens_as_a_new_model_and_the_digest_is_the_parsed_one() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("m");
        write_model(&dir);
        let manifest_path = dir.join(MANIFEST_FILE);
        let s = store(vec![]);
        let old = s.open_model(&dir).unwrap();
        let m_old = s.model(old).unwrap();
        let old_bytes = std::fs::read(&manifest_path).unwrap();
        assert_eq!(m_old.manifest_digest, *blake3::hash(&old_bytes).as_bytes());
        let a = page_id(&m_old, "a");
        let old_page = s.acquire(old, a).unwrap().bytes().to_vec();

        // Rewritten with the same bytes: the same model.
        std::fs::write(&manifest_path, &old_bytes).unwrap();
        assert_eq!(s.open_model(&dir).unwrap(), old);

        // New weights, same shapes, re-hashed: a new model with the new digest.
        let a_new: Vec<u8> = (0..8192u32).map(|i| (i % 7) as u8).collect();
        let b: Vec<u8> = (0..64u8).map(|x| x.wrapping_mul(13)).collect();
        write_checkpoint(
            &dir,
            &[
                ("a", DType::BF16, &[64, 64], &a_new),
                ("b", DType::F32, &[16], &b),
            ],
        );
        let new = s.open_model(&dir).unwrap();
        assert_ne!(new, old);
        let m_new = s.model(new).unwrap();
        let new_bytes = std::fs::read(&manifest_path).unwrap();
        assert_eq!(m_new.manifest_digest, *blake3::hash(&new_bytes).as_bytes());
        assert!(m_old.is_superseded() && !m_new.is_superseded());
        assert_eq!(s.acquire(new, a).unwrap().bytes(), a_new.as_slice());
        // The old id still serves what its manifest says (resident here).
        assert_eq!(s.acquire(old, a).unwrap().bytes(), old_page.as_slice());
        // And later opens get the new model.
        assert_eq!(s.open_model(&dir).unwrap(), new);
    }

    /// Re-opening a model on a NAS touches the mount only through the tier's timed
    /// calls: a manifest that reads slower than the timeout (like a hung mount) is an
    /// error after the timeout, not a hang; a mount that is gone keeps the open model.
    #[test]
    fn reopening_a_model_on_a_nas_is_bounded_by_its_timeout() {
        let d = tempfile::tempdir().unwrap();
        let mount = d.path().join("nas");
        let dir = mount.join("m");
        write_model(&dir);
        let s = store(vec![slow_nas_config(&mount)]);
        let id = s.open_model(&dir).unwrap();

        // Gone: the open model is kept (its resident pages are still served).
        let away = d.path().join("nas.away");
        std::fs::rename(&mount, &away).unwrap();
        let t = Instant::now();
        assert_eq!(s.open_model(&dir).unwrap(), id);
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        std::fs::rename(&away, &mount).unwrap();
        s.model(id)
            .unwrap()
            .nas_tier()
            .unwrap()
            .check_now()
            .unwrap();

        // A manifest that takes longer than the timeout to read.
        slow_manifest(&dir);
        let t = Instant::now();
        let e = s.open_model(&dir).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        assert!(matches!(e, StoreError::Tier(_)), "{e}");
        assert!(
            e.to_string().contains("re-reading the page manifest"),
            "{e}"
        );
    }

    /// Prefetched pages are read in flight through the reader pool (pieces smaller
    /// than the page) and served verified, in both read modes; a prefetch of a page
    /// whose bytes changed on disk is never served: the demand request reports the
    /// integrity error naming page and tier.
    #[test]
    fn prefetched_pages_are_read_in_flight_and_verified() {
        for mode in [ReadMode::Buffered, ReadMode::Direct] {
            let d = tempfile::tempdir().unwrap();
            let dir = d.path().join("m");
            write_model(&dir);
            let s = Store::new(StoreConfig {
                cache_bytes: 1 << 20,
                read_mode: Some(mode),
                io: IoConfig {
                    read_threads: 3,
                    read_piece: 16 << 10,
                    prefetch_threads: 2,
                    ..IoConfig::default()
                },
                ..Default::default()
            })
            .unwrap();
            let id = s.open_model(&dir).unwrap();
            let m = s.model(id).unwrap();
            let a = page_id(&m, "a");
            s.prefetch(id, a);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !s.cache().resident(PageKey { model: id, page: a }) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{mode:?}: never loaded"
                );
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            let want: Vec<u8> = (0..=255u8).cycle().take(8192).collect();
            assert_eq!(s.acquire(id, a).unwrap().bytes(), &want[..]);
            let st = s.cache_stats();
            assert_eq!(
                (st.prefetch_loads, st.misses, st.hits),
                (1, 0, 1),
                "{mode:?}"
            );
            assert_eq!(m.served_counts()[1], 1);

            // Flip a byte of page b, then prefetch it.
            let b = page_id(&m, "b");
            let entry = m.manifest.pages[b as usize].clone();
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(dir.join(&entry.file))
                .unwrap();
            use std::os::unix::fs::FileExt;
            let mut byte = [0u8];
            f.read_exact_at(&mut byte, entry.offset + 3).unwrap();
            f.write_all_at(&[byte[0] ^ 0x40], entry.offset + 3).unwrap();
            f.sync_all().unwrap();
            s.prefetch(id, b);
            let e = s.acquire(id, b).unwrap_err();
            assert!(
                matches!(&e, StoreError::Integrity { page, tier, .. } if page == "b" && tier == "primary"),
                "{mode:?}: {e}"
            );
        }
    }

    /// The read buffers: a bounce buffer per reader, the largest vpack bodies, one
    /// for each thread that may decode one at once, and the pool of bodies read
    /// ahead (two of the largest layer's bodies and its largest body), in place of
    /// the largest bodies.
    #[test]
    fn read_buffers_count_readers_the_largest_bodies_and_the_read_ahead() {
        let io = IoConfig {
            read_threads: 4,
            read_piece: 1 << 20,
            prefetch_threads: 1,
            read_ahead_layers: 2,
        };
        let bounce = (1 << 20) + 2 * crate::direct::DIRECT_ALIGN as u64;
        assert_eq!(io.buffer_bytes(None), 4 * bounce);
        let page = |id: u32, body: Option<u64>| PageEntry {
            id,
            name: format!("w{id}"),
            dtype: DType::BF16,
            shape: vec![8],
            file: "model.safetensors".into(),
            offset: 0,
            len: 16,
            encoding: Encoding::Raw,
            blake3: String::new(),
            group: PageGroup::Other,
            encoded: body
                .map(|len| voom_formats::manifest::EncodedBody {
                    encoding: Encoding::Vpack,
                    file: "model.vpack".into(),
                    offset: 0,
                    len,
                })
                .into_iter()
                .collect(),
            rows: None,
        };
        let m = Manifest {
            format_version: 2,
            pages: vec![
                page(0, Some(112 << 10)),
                page(1, None),
                page(2, Some(320 << 10)),
                page(3, Some(1)),
                page(4, Some(200 << 10)),
            ],
        };
        // The two largest bodies (prefetch thread and requesting thread), each to
        // its 16 KiB.
        assert_eq!(
            io.buffer_bytes(Some(&m)),
            4 * bounce + (320 << 10) + (208 << 10),
            "no layers: nothing to read ahead"
        );
        let mut layered = m.clone();
        for (p, l) in layered.pages.iter_mut().zip([0, 0, 0, 1, 1]) {
            p.group = PageGroup::Layer(l);
        }
        // Layer 0's bodies take 112 + 320 KiB (page 1 has none), layer 1's 16 + 208.
        assert_eq!(io.read_ahead_bytes(&layered), (2 * 432 + 320) << 10);
        assert_eq!(
            io.buffer_bytes(Some(&layered)),
            4 * bounce + ((2 * 432 + 320) << 10),
            "with a pool, bodies are read nowhere else"
        );
        let off = IoConfig {
            read_ahead_layers: 0,
            ..io
        };
        assert_eq!(off.read_ahead_bytes(&layered), 0);
        let none = IoConfig {
            read_threads: 0,
            ..io
        };
        assert_eq!(
            none.read_ahead_bytes(&layered),
            0,
            "no readers to read ahead"
        );
        assert_eq!(
            none.buffer_bytes(None),
            bounce,
            "reads on the requesting thread"
        );
    }

    #[test]
    fn a_missing_model_is_not_found() {
        let d = tempfile::tempdir().unwrap();
        let s = store(vec![]);
        let e = s.open_model(&d.path().join("nope")).unwrap_err();
        assert!(matches!(e, StoreError::NotFound { .. }), "{e}");
        // A directory without a manifest is no model store either.
        let e = s.open_model(d.path()).unwrap_err();
        assert!(matches!(e, StoreError::NotFound { .. }), "{e}");
        assert!(e.to_string().contains("vpagectl hash"), "{e}");
        assert!(matches!(s.model(42), Err(StoreError::NotFound { .. })));
    }

    #[test]
    fn lexical_paths() {
        assert_eq!(
            lexical_absolute(Path::new("/a/./b/../c")),
            PathBuf::from("/a/c")
        );
        let rel = lexical_absolute(Path::new("x/../y"));
        assert!(rel.is_absolute() && rel.ends_with("y"), "{}", rel.display());
    }
}

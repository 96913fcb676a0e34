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

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock};

use voom_formats::manifest::{Manifest, PageGroup};
use voom_formats::Checkpoint;

use crate::arena::Arena;
use crate::cache::{CacheError, CacheStats, Lease, PageCache, PageKey};
use crate::loader::{PageLoader, Served};
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
    /// either is non-zero) resident once loaded.
    pub pin_first_layers: u32,
    pub pin_last_layers: u32,
}

/// One open model store.
pub struct OpenModel {
    pub id: u32,
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub pages: Vec<PageMeta>,
    /// The model's own directory: local, or on a NAS mount.
    primary: ModelTier,
    /// The NAS copy of a local model.
    nas: Option<NasTier>,
    /// Demand requests per page (for staging the hottest pages).
    accesses: Vec<AtomicU64>,
    served: [AtomicU64; 3],
}

impl OpenModel {
    /// Demand requests of each page since the model was opened.
    pub fn access_counts(&self) -> Vec<u64> {
        self.accesses
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
}

pub struct Store {
    cache: PageCache,
    fast: Option<FastTier>,
    models: RwLock<Vec<Arc<OpenModel>>>,
    cfg: StoreConfig,
    prefetch_tx: Mutex<Option<mpsc::SyncSender<(u32, u32)>>>,
}

/// Longest a demand request waits for in-flight loads to make room.
const FULL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The prefetch queue's length: hints beyond it are dropped, never waited on.
const PREFETCH_QUEUE: usize = 256;

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
        let store = Arc::new(Store {
            cache: PageCache::new(arena),
            fast,
            models: RwLock::new(Vec::new()),
            cfg,
            prefetch_tx: Mutex::new(None),
        });
        // Prefetch hints are loaded on a background thread, so a hint never blocks the
        // engine. The thread holds only a weak reference and ends with the store.
        let (tx, rx) = mpsc::sync_channel::<(u32, u32)>(PREFETCH_QUEUE);
        let weak = Arc::downgrade(&store);
        std::thread::Builder::new()
            .name("vpaged-prefetch".into())
            .spawn(move || {
                while let Ok((model, page)) = rx.recv() {
                    let Some(store) = weak.upgrade() else { break };
                    // A failed prefetch is not an error: the demand request will
                    // report it if the page is really unavailable.
                    let _ = store.prefetch_now(model, page);
                }
            })
            .map_err(|e| StoreError::Store {
                store: PathBuf::from("<cache>"),
                detail: format!("cannot start the prefetch thread: {e}"),
            })?;
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
            .ok_or_else(|| StoreError::Store {
                store: PathBuf::from(format!("<model {id}>")),
                detail: "no such open model".into(),
            })
    }

    /// Opens a model store (its manifest is required: `vpagectl hash` writes it), or
    /// returns the id it already has. A `dir` under a configured NAS mount is opened
    /// through the mount's [`NasTier`] (bounded by its timeout; a dead mount is an
    /// error naming it, after the remount command had its chance).
    pub fn open_model(&self, dir: &Path) -> Result<u32, StoreError> {
        // A path on a NAS is not touched outside the NAS tier: on a dead mount even
        // `canonicalize` can block for minutes.
        if let Some(nas) = self.nas_holding(&lexical_absolute(dir)) {
            return self.open_on_nas(nas);
        }
        let dir = dir.canonicalize().map_err(|e| StoreError::Store {
            store: dir.to_path_buf(),
            detail: format!("cannot open: {e}"),
        })?;
        // Reached through a symbolic link.
        if let Some(nas) = self.nas_holding(&dir) {
            return self.open_on_nas(nas);
        }
        if let Some(id) = self.find(&dir) {
            return Ok(id);
        }
        let manifest = load_checked(&dir)?;
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
        let primary = ModelTier::File(FileTier::new("primary", &dir));
        Ok(self.insert(dir, primary, nas, manifest))
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
        if let Some(id) = self.find(&dir) {
            return Ok(id);
        }
        tier.check_now()?;
        let d = dir.clone();
        let manifest = tier.call("opening the model store", move || load_checked(&d))??;
        Ok(self.insert(dir, ModelTier::Nas(tier), None, manifest))
    }

    fn find(&self, dir: &Path) -> Option<u32> {
        self.models().iter().find(|m| m.dir == dir).map(|m| m.id)
    }

    /// Adds an opened model (or returns the id a concurrent open gave it).
    fn insert(
        &self,
        dir: PathBuf,
        primary: ModelTier,
        nas: Option<NasTier>,
        manifest: Manifest,
    ) -> u32 {
        let pages: Vec<PageMeta> = manifest.pages.iter().map(PageMeta::from_entry).collect();
        let mut models = self.models.write().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = models.iter().find(|m| m.dir == dir) {
            return m.id;
        }
        let id = models.len() as u32;
        let n = pages.len();
        let model = Arc::new(OpenModel {
            id,
            primary,
            dir,
            nas,
            accesses: (0..n).map(|_| AtomicU64::new(0)).collect(),
            served: Default::default(),
            pages,
            manifest,
        });
        self.cache.pin(self.pins_of(&model));
        models.push(model);
        id
    }

    fn pins_of(&self, m: &OpenModel) -> Vec<PageKey> {
        let (first, last) = (self.cfg.pin_first_layers, self.cfg.pin_last_layers);
        if first == 0 && last == 0 {
            return vec![];
        }
        let layers = m
            .manifest
            .pages
            .iter()
            .filter_map(|p| match p.group {
                PageGroup::Layer(l) => Some(l + 1),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        m.manifest
            .pages
            .iter()
            .filter(|p| match p.group {
                PageGroup::Layer(l) => l < first || l + last >= layers,
                PageGroup::Embedding | PageGroup::Final => true,
                PageGroup::Other => false,
            })
            .map(|p| PageKey {
                model: m.id,
                page: p.id,
            })
            .collect()
    }

    fn load_into(&self, m: &OpenModel, page: u32, buf: &mut [u8]) -> Result<(), StoreError> {
        let entry = &m.manifest.pages[page as usize];
        let loader = PageLoader {
            fast: self.fast.as_ref(),
            primary: &m.primary,
            nas: m.nas.as_ref(),
        };
        let served = loader.load(entry, buf)?;
        let i = match served {
            Served::Fast => 0,
            Served::Primary => 1,
            Served::Nas => 2,
        };
        m.served[i].fetch_add(1, Ordering::Relaxed);
        Ok(())
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
        // A cache full only because other pages are still loading (prefetches, other
        // engines' requests) has room once they land: wait for them rather than fail.
        let deadline = std::time::Instant::now() + FULL_WAIT;
        loop {
            let r = self.cache.acquire(PageKey { model, page }, len, |buf| {
                self.load_into(&m, page, buf)
            });
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

    /// Queues a prefetch hint; never blocks (a full queue drops the hint). A hint for a
    /// page already resident or loading is dropped here, without waking the prefetch
    /// thread (a model that fits is hinted every layer of every token).
    pub fn prefetch(&self, model: u32, page: u32) {
        if self.cache.present(PageKey { model, page }) {
            return;
        }
        if let Some(tx) = self
            .prefetch_tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            let _ = tx.try_send((model, page));
        }
    }

    fn prefetch_now(&self, model: u32, page: u32) -> Result<(), StoreError> {
        let m = self.model(model)?;
        let len = Self::page_len(&m, page)?;
        self.cache
            .prefetch(PageKey { model, page }, len, |buf| {
                self.load_into(&m, page, buf)
            })
            .map(|_| ())
            .map_err(|e| cache_error(&m, page, e))
    }

    /// Copies the most requested pages of `model` (verified bytes) onto the fast tier,
    /// hottest first, up to `max_bytes`. Returns (pages staged, bytes staged).
    pub fn stage_hot(&self, model: u32, max_bytes: u64) -> Result<(usize, u64), StoreError> {
        let Some(fast) = &self.fast else {
            return Err(StoreError::Store {
                store: PathBuf::from("<fast tier>"),
                detail: "no fast tier is configured".into(),
            });
        };
        let m = self.model(model)?;
        let mut order: Vec<(u64, u32)> = m
            .access_counts()
            .into_iter()
            .enumerate()
            .filter(|(_, c)| *c > 0)
            .map(|(i, c)| (c, i as u32))
            .collect();
        order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
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
                other => StoreError::Store {
                    store: m.dir.clone(),
                    detail: other.to_string(),
                },
            },
        },
        other => StoreError::Store {
            store: m.dir.clone(),
            detail: format!("page '{}': {other}", m.pages[page as usize].name),
        },
    }
}

/// A model store's manifest, checked against the checkpoint that is there.
fn load_checked(dir: &Path) -> Result<Manifest, StoreError> {
    let manifest = Manifest::load(dir)?.ok_or_else(|| StoreError::Store {
        store: dir.to_path_buf(),
        detail: "no page manifest (voom-manifest.json): run `vpagectl hash` on it".into(),
    })?;
    manifest.check_matches(&Checkpoint::open(dir)?)?;
    Ok(manifest)
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
}

impl StoreSource {
    pub fn open(store: Arc<Store>, dir: &Path) -> Result<Self, StoreError> {
        let id = store.open_model(dir)?;
        let model = store.model(id)?;
        Ok(StoreSource { store, model })
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
        for id in ids {
            self.store.prefetch(self.model.id, id.0);
        }
    }

    fn budget(&self) -> Option<u64> {
        Some(self.store.cache().capacity() as u64)
    }

    fn cache_stats(&self) -> Option<crate::source::SourceCacheStats> {
        let c = self.store.cache_stats();
        Some(crate::source::SourceCacheStats {
            hits: c.hits,
            misses: c.misses,
            bytes_loaded: c.bytes_loaded,
            used_bytes: c.used as u64,
            capacity_bytes: c.capacity as u64,
        })
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
        voom_formats::safetensors::write(
            &dir.join("model.safetensors"),
            &[
                ("a", DType::BF16, &[64, 64], &a),
                ("b", DType::F32, &[16], &b),
            ],
            &BTreeMap::new(),
        )
        .unwrap();
        Manifest::build(&Checkpoint::open(dir).unwrap(), &mut |_, _| {})
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

    #[test]
    fn opening_a_model_on_a_hanging_nas_is_bounded_by_its_timeout() {
        let d = tempfile::tempdir().unwrap();
        let mount = d.path().join("nas");
        let dir = mount.join("m");
        write_model(&dir);
        // A manifest that blocks when opened (a FIFO without a writer), like a read
        // on a dead network mount.
        let manifest = dir.join(voom_formats::manifest::MANIFEST_FILE);
        std::fs::remove_file(&manifest).unwrap();
        let st = std::process::Command::new("mkfifo")
            .arg(&manifest)
            .status()
            .unwrap();
        assert!(st.success());
        let t = Instant::now();
        let e = store(vec![nas_config(&mount, None)])
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
        // Let the abandoned open finish (it reads an empty manifest and fails).
        drop(
            std::fs::OpenOptions::new()
                .write(true)
                .open(&manifest)
                .unwrap(),
        );
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

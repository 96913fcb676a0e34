//! The store core: model stores (manifest + tiers) over one page cache.
//!
//! The daemon serves engines from it over its socket; [`StoreSource`] serves an
//! engine in the same process through the [`PageSource`] seam. Every page enters the
//! cache through [`PageLoader`]: read from the fastest tier holding a copy, verified
//! against the manifest before it becomes visible.

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
use crate::tier::{FastTier, FileTier, NasConfig, NasTier, TierStats};
use crate::StoreError;

/// What a store is built with.
#[derive(Debug, Clone, Default)]
pub struct StoreConfig {
    /// Bytes of the shared page cache.
    pub cache_bytes: usize,
    /// Fast tier directory and capacity.
    pub fast_tier: Option<(PathBuf, u64)>,
    /// NAS mounts holding model stores by directory name.
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
    primary: FileTier,
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

    pub fn primary_stats(&self) -> TierStats {
        self.primary.stats()
    }

    pub fn nas_stats(&self) -> Option<TierStats> {
        self.nas.as_ref().map(|n| n.stats())
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
    /// returns the id it already has.
    pub fn open_model(&self, dir: &Path) -> Result<u32, StoreError> {
        let dir = dir.canonicalize().map_err(|e| StoreError::Store {
            store: dir.to_path_buf(),
            detail: format!("cannot open: {e}"),
        })?;
        if let Some(m) = self.models().iter().find(|m| m.dir == dir) {
            return Ok(m.id);
        }
        let manifest = Manifest::load(&dir)?.ok_or_else(|| StoreError::Store {
            store: dir.clone(),
            detail: "no page manifest (voom-manifest.json): run `vpagectl hash` on it".into(),
        })?;
        // The manifest must describe the checkpoint that is there.
        manifest.check_matches(&Checkpoint::open(&dir)?)?;
        let pages: Vec<PageMeta> = manifest
            .pages
            .iter()
            .map(|e| PageMeta {
                id: PageId(e.id),
                name: e.name.clone(),
                dtype: e.dtype,
                shape: e.shape.clone(),
                len: e.shape.iter().product::<usize>() as u64 * e.dtype.size() as u64,
            })
            .collect();
        let name = dir.file_name().map(PathBuf::from).unwrap_or_default();
        let nas = self
            .cfg
            .nas
            .iter()
            .find(|n| n.mount.join(&name).is_dir())
            .map(|n| {
                NasTier::new(
                    "nas",
                    NasConfig {
                        model: name.clone(),
                        ..n.clone()
                    },
                )
            });
        let mut models = self.models.write().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = models.iter().find(|m| m.dir == dir) {
            return Ok(m.id);
        }
        let id = models.len() as u32;
        let n = pages.len();
        let model = Arc::new(OpenModel {
            id,
            primary: FileTier::new("primary", &dir),
            dir,
            nas,
            accesses: (0..n).map(|_| AtomicU64::new(0)).collect(),
            served: Default::default(),
            pages,
            manifest,
        });
        self.cache.pin(self.pins_of(&model));
        models.push(model);
        Ok(id)
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
            Err(shared) => StoreError::Store {
                store: m.dir.clone(),
                detail: shared.to_string(),
            },
        },
        other => StoreError::Store {
            store: m.dir.clone(),
            detail: format!("page '{}': {other}", m.pages[page as usize].name),
        },
    }
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

    fn describe(&self) -> String {
        format!("store:{}", self.model.dir.display())
    }
}

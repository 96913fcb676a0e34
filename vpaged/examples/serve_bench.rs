//! Page serving through the vpaged daemon against reading the same bytes directly,
//! OS page cache warm and cold, each figure with its ratio to the physical bound
//! measured in the same run (BENCHMARKS.md). Medians over RUNS runs; a ratio is the
//! median of the per-run ratios (figure / bound of the same run).
//!
//! Pages are visited in engine order: embedding, layer 0, 1, ..., final, other; the
//! daemon's client acquires one manifest `PageGroup` (a layer) per request, like the
//! engine, reads every byte of every lease through its read-only mapping of the arena
//! (a sum of u64 words, checked against the same sum over the bytes read directly: a
//! bench that served wrong bytes fails), and releases the group.
//!
//! Physical figures (the bounds are built from them):
//! - direct, warm: `pread` of every page's bytes, OS page cache warm, GB/s;
//! - direct, cold: the same after dropping the model's files from the OS page cache
//!   (`posix_fadvise(POSIX_FADV_DONTNEED)`, checked with `mincore`: the output says
//!   when the drop left bytes resident or cold reads ran near warm speed), GB/s;
//!   measured just before each cold daemon figure (storage speed drifts), and that
//!   measurement is the figure's bound;
//! - blake3: hashing the same bytes, page by page, on one core, GB/s;
//! - arena touch: summing the u64 words of every page in place in the client's
//!   read-only mapping of the arena (pages resident and leased), GB/s; interleaved
//!   with the resident daemon sweeps it bounds;
//! - fresh arena, owner's first write: one byte written per 4 KiB page of a new
//!   shared-memory arena of the model's size (the kernel allocates, zeroes and maps each
//!   page), then the client mapping's first read: one byte read per page through a
//!   second, read-only mapping of it (the kernel maps each page again). Every first fill
//!   pays both (the daemon's `pread` lands in fresh pages; the engine's mapping is its
//!   own); reported to explain the first-fill figures, which are also given against
//!   the serial bound that includes them.
//!
//! Daemon figures (in-process daemon on a background tokio thread, a real Unix socket
//! in a temporary directory, a `DaemonClient` in this process mapping the arena
//! read-only, as an engine does):
//! - daemon, cold first fill: fresh arena holding the whole model, page cache dropped;
//!   bytes served / time, against the serial bound of read then hash from cold,
//!   1 / (1/direct_cold + 1/blake3);
//! - daemon, warm first fill: fresh arena, page cache warm; against
//!   1 / (1/direct_warm + 1/blake3). Both first fills also pay the fresh arena's first
//!   touch (above) and the client's sum, which these bounds leave out; a last line
//!   gives them against the serial bounds that add the first touch;
//! - daemon, steady state, page cache warm: a cache about half the model's size,
//!   after two sweeps that touched the whole arena; bytes loaded (misses) per second of
//!   full sweeps (hits included in the time), against the warm serial bound; the
//!   cache's hit, miss and admission counters say how much of the model was re-read;
//! - daemon, steady state, page cache cold: one such sweep after dropping the page
//!   cache, against the cold serial bound;
//! - daemon, resident: every page resident in the arena; acquire + touch + release of
//!   every page, GB/s, against the arena touch;
//! - daemon, acquire round trip: acquire of one resident page and its release
//!   (batched into the next request, protocol 1.2), µs per page, beside its peer: the
//!   same store's acquire + release in this process, without the socket.
//!
//! `cargo run --release -p vpaged --example serve_bench -- MODEL_DIR [RUNS] [--json]`
//! (MODEL_DIR needs a manifest: `vpagectl hash MODEL_DIR`; RUNS defaults to 5).

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use voom_formats::manifest::{Manifest, PageEntry, PageGroup};
use vpaged::arena::{Arena, ArenaView, SLOT_ALIGN};
use vpaged::client::{DaemonClient, DaemonSource};
use vpaged::store::{Store, StoreConfig};
use vpaged::{PageId, PageSource};

/// The cache counters reported for the steady state (page requests, not bytes).
const COUNTERS: [&str; 6] = [
    "hits",
    "misses",
    "admitted",
    "not_admitted",
    "evictions",
    "full_refusals",
];

/// Fraction of the model's file bytes that may stay in the page cache after a drop
/// for the cold figures to be called cold.
const DROP_TOLERANCE: f64 = 0.01;
/// Resident acquire round trips timed per run.
const ROUND_TRIPS: usize = 10_000;
/// Sweeps timed per run where one sweep is short (resident serving, touch bound).
const WARM_SWEEPS: usize = 3;

/// The model store under test: its pages in engine order, grouped as the engine
/// requests them.
struct Model {
    dir: PathBuf,
    pages: Vec<PageEntry>,
    /// Indices into `pages`, one group per request, in engine order.
    groups: Vec<Vec<usize>>,
    files: HashMap<String, File>,
    /// Page bytes (decoded), the bytes every sweep serves.
    total: u64,
    largest: usize,
    /// Bytes of the model's files, for the page cache residency check.
    file_bytes: u64,
}

fn group_rank(g: PageGroup) -> (u8, u32) {
    match g {
        PageGroup::Embedding => (0, 0),
        PageGroup::Layer(l) | PageGroup::Expert { layer: l, .. } => (1, l),
        PageGroup::Final => (2, 0),
        PageGroup::Other => (3, 0),
    }
}

impl Model {
    fn open(dir: &Path) -> Result<Model> {
        let manifest = Manifest::load(dir)
            .with_context(|| format!("reading the manifest of {}", dir.display()))?
            .with_context(|| {
                format!(
                    "{} has no page manifest: run `vpagectl hash {}` first",
                    dir.display(),
                    dir.display()
                )
            })?;
        ensure!(
            !manifest.pages.is_empty(),
            "the manifest of {} lists no pages",
            dir.display()
        );
        if let Some(p) = manifest.pages.iter().find(|p| p.vpack().is_some()) {
            // The daemon would read the packed body (fewer bytes, plus a decode); the
            // direct figures read the raw bytes: the comparison would be unfair.
            bail!(
                "page '{}' of {} has a vpack body: this bench compares raw reads; use a store without packed bodies",
                p.name,
                dir.display()
            );
        }
        let mut by_group: std::collections::BTreeMap<(u8, u32), Vec<usize>> = Default::default();
        for (i, p) in manifest.pages.iter().enumerate() {
            by_group.entry(group_rank(p.group)).or_default().push(i);
        }
        let names: BTreeSet<String> = manifest.pages.iter().map(|p| p.file.clone()).collect();
        let mut files = HashMap::new();
        let mut file_bytes = 0;
        for f in names {
            let path = dir.join(&f);
            let h = File::open(&path)
                .with_context(|| format!("opening model file {}", path.display()))?;
            file_bytes += h.metadata()?.len();
            files.insert(f, h);
        }
        for p in &manifest.pages {
            let end = p.offset.checked_add(p.len);
            let flen = files[&p.file].metadata()?.len();
            ensure!(
                end.is_some_and(|e| e <= flen),
                "page '{}' ({}+{}) lies past the end of {} ({flen} bytes)",
                p.name,
                p.offset,
                p.len,
                p.file
            );
        }
        let total = manifest.pages.iter().map(|p| p.len).sum();
        let largest = manifest.pages.iter().map(|p| p.len).max().unwrap_or(0) as usize;
        Ok(Model {
            dir: dir.to_path_buf(),
            pages: manifest.pages,
            groups: by_group.into_values().collect(),
            files,
            total,
            largest,
            file_bytes,
        })
    }

    fn order(&self) -> impl Iterator<Item = &PageEntry> {
        self.groups.iter().flatten().map(|&i| &self.pages[i])
    }

    fn slot_bytes(&self, pages: impl IntoIterator<Item = usize>) -> usize {
        pages
            .into_iter()
            .map(|i| (self.pages[i].len as usize).next_multiple_of(SLOT_ALIGN))
            .sum()
    }

    /// A cache that holds every page at once.
    fn full_cache(&self) -> usize {
        self.slot_bytes(0..self.pages.len()) + (1 << 20)
    }

    /// A cache of about half the model (at least two of its largest groups), or `None`
    /// when that would hold the whole model (no steady-state misses to measure).
    fn half_cache(&self) -> Option<usize> {
        let largest_group = self
            .groups
            .iter()
            .map(|g| self.slot_bytes(g.iter().copied()))
            .max()
            .unwrap_or(0);
        let half = (self.slot_bytes(0..self.pages.len()) / 2)
            .max(2 * largest_group + (1 << 20))
            .next_multiple_of(SLOT_ALIGN);
        (half < self.slot_bytes(0..self.pages.len())).then_some(half)
    }

    /// Reads every page into `buf` in engine order; seconds.
    fn read_all(&self, buf: &mut [u8]) -> Result<f64> {
        let t = Instant::now();
        for p in self.order() {
            self.files[&p.file]
                .read_exact_at(&mut buf[..p.len as usize], p.offset)
                .with_context(|| format!("reading page '{}' from {}", p.name, p.file))?;
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Hashes every page (read untimed first) on this core: (seconds hashing, the
    /// touch sum of every page, the reference for the daemon's sweeps).
    fn hash_all(&self, buf: &mut [u8]) -> Result<(f64, u64)> {
        let (mut secs, mut sum) = (0.0, 0u64);
        for p in self.order() {
            let b = &mut buf[..p.len as usize];
            self.files[&p.file]
                .read_exact_at(b, p.offset)
                .with_context(|| format!("reading page '{}' from {}", p.name, p.file))?;
            let t = Instant::now();
            std::hint::black_box(blake3::hash(b));
            secs += t.elapsed().as_secs_f64();
            sum = sum.wrapping_add(touch(b));
        }
        Ok((secs, sum))
    }

    /// Drops the model's files from the OS page cache; returns the fraction of their
    /// bytes still resident afterwards.
    fn drop_page_cache(&self) -> Result<f64> {
        for (name, f) in &self.files {
            // SAFETY: posix_fadvise only takes an open descriptor (borrowed from `f`,
            // alive for the call) and plain integers.
            let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            if rc != 0 {
                bail!(
                    "posix_fadvise(DONTNEED) on {name}: {}",
                    std::io::Error::from_raw_os_error(rc)
                );
            }
        }
        self.resident_fraction()
    }

    /// Fraction of the model files' bytes in the OS page cache (mincore).
    fn resident_fraction(&self) -> Result<f64> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
        let mut resident = 0u64;
        for (name, f) in &self.files {
            let len = f.metadata()?.len() as usize;
            if len == 0 {
                continue;
            }
            // SAFETY: the mapping is only handed to mincore, never read or written
            // through, so a change to the file underneath cannot affect this program.
            let map = unsafe { memmap2::Mmap::map(f) }
                .with_context(|| format!("mapping {name} for mincore"))?;
            let mut vec = vec![0u8; len.div_ceil(page)];
            // SAFETY: `map` is a live, page-aligned mapping of `len` bytes and `vec`
            // holds one byte per page of it, as mincore requires.
            let rc = unsafe {
                libc::mincore(
                    map.as_ptr() as *mut libc::c_void,
                    len,
                    vec.as_mut_ptr() as *mut libc::c_uchar,
                )
            };
            if rc != 0 {
                bail!("mincore on {name}: {}", std::io::Error::last_os_error());
            }
            resident += vec.iter().filter(|&&v| v & 1 != 0).count() as u64 * page as u64;
        }
        Ok((resident as f64 / self.file_bytes.max(1) as f64).min(1.0))
    }
}

/// Reads every byte of `bytes` (wrapping sum of little-endian u64 words, the tail
/// bytewise): what a kernel streaming over a page costs at least.
fn touch(bytes: &[u8]) -> u64 {
    let mut acc = [0u64; 8];
    let mut chunks = bytes.chunks_exact(64);
    for c in &mut chunks {
        for (a, w) in acc.iter_mut().zip(c.chunks_exact(8)) {
            *a = a.wrapping_add(u64::from_le_bytes(w.try_into().expect("8-byte chunk")));
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .enumerate()
        .fold(0u64, |s, (i, &b)| {
            s.wrapping_add(u64::from(b) << (8 * (i % 8)))
        });
    acc.iter().fold(tail, |s, &a| s.wrapping_add(a))
}

/// The first touch of a fresh shared arena of `bytes`, one byte per 4 KiB page:
/// seconds for the owner's writes (the kernel allocates, zeroes and maps each page), then
/// for reads through a second, read-only mapping of the same memory (the kernel only
/// maps each page): what a first fill pays on top of read + hash, in the daemon and in
/// its client.
fn fresh_arena_touch(bytes: usize) -> Result<(f64, f64)> {
    let arena = Arena::new(bytes).context("creating a fresh arena")?;
    let cap = arena.capacity();
    let fd = arena.fd().try_clone_to_owned()?;
    let view = ArenaView::map_readonly(fd, cap).context("mapping the fresh arena read-only")?;
    let written = {
        // SAFETY: this arena was just created here; the only other view of it is
        // `view`, which is not read until this slice is gone.
        let mem = unsafe { arena.bytes_mut(0, cap) }.context("viewing the fresh arena")?;
        let t = Instant::now();
        for i in (0..cap).step_by(4096) {
            mem[i] = 1;
        }
        std::hint::black_box(&mem[..]);
        t.elapsed().as_secs_f64()
    };
    // SAFETY: the owner's writes above are done, and nothing writes this arena while
    // `mem` lives.
    let mem = unsafe { view.bytes(0, cap) }?;
    let t = Instant::now();
    let mut sum = 0u8;
    for i in (0..cap).step_by(4096) {
        sum = sum.wrapping_add(mem[i]);
    }
    let mapped = t.elapsed().as_secs_f64();
    ensure!(
        sum == ((cap / 4096) % 256) as u8,
        "the read-only view of the fresh arena does not show its owner's writes"
    );
    Ok((written, mapped))
}

/// A daemon serving a fresh store on a background thread, and one client of it.
struct Served {
    store: Arc<Store>,
    client: Arc<DaemonClient>,
    source: DaemonSource,
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<std::io::Result<()>>,
    _socket_dir: tempfile::TempDir,
}

impl Served {
    fn start(model: &Model, cache_bytes: usize) -> Result<Served> {
        let store = Store::new(StoreConfig {
            cache_bytes,
            ..Default::default()
        })
        .context("creating the daemon's store")?;
        let socket_dir = tempfile::tempdir().context("creating the socket's directory")?;
        let socket = socket_dir.path().join("vpaged.sock");
        // Bound here, so the client can connect before the daemon's loop runs.
        let listener = std::os::unix::net::UnixListener::bind(&socket)
            .with_context(|| format!("binding {}", socket.display()))?;
        listener.set_nonblocking(true)?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let daemon = vpaged::daemon::Daemon::new(Arc::clone(&store));
        let path = socket.clone();
        let thread = std::thread::Builder::new()
            .name("serve-bench-vpaged".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    let listener = tokio::net::UnixListener::from_std(listener)?;
                    daemon
                        .serve(listener, path, async {
                            let _ = stopped.await;
                        })
                        .await
                })
            })
            .context("starting the daemon's thread")?;
        let client = DaemonClient::connect(&socket, "serve_bench")?;
        let source = DaemonSource::open(Arc::clone(&client), &model.dir)?;
        Ok(Served {
            store,
            client,
            source,
            stop,
            thread,
            _socket_dir: socket_dir,
        })
    }

    /// Acquires every group, touches every byte of it, releases it: (seconds, sum).
    fn sweep(&self, model: &Model) -> Result<(f64, u64)> {
        let t = Instant::now();
        let mut sum = 0u64;
        let mut ids = Vec::new();
        for g in &model.groups {
            ids.clear();
            ids.extend(g.iter().map(|&i| PageId(model.pages[i].id)));
            let leases = self.source.acquire_many(&ids)?;
            for l in &leases {
                sum = sum.wrapping_add(touch(l.bytes()));
            }
        }
        self.source.flush();
        Ok((t.elapsed().as_secs_f64(), sum))
    }

    /// Seconds to touch every page once in place in the client's mapping of the arena,
    /// every page leased (so resident and unchanged) but no request in the timed part.
    fn touch_arena(&self, model: &Model, reference: u64) -> Result<f64> {
        let ids: Vec<PageId> = model.order().map(|p| PageId(p.id)).collect();
        let leases = self.source.acquire_many(&ids)?;
        let arena = self.client.arena();
        let base = arena.as_ptr() as usize;
        let ranges: Vec<(usize, usize)> = leases
            .iter()
            .map(|l| (l.bytes().as_ptr() as usize - base, l.bytes().len()))
            .collect();
        let t = Instant::now();
        let mut sum = 0u64;
        for &(off, len) in &ranges {
            // SAFETY: every range is a slot of a lease in `leases`, held until after
            // the loop.
            sum = sum.wrapping_add(touch(unsafe { arena.bytes(off, len) }?));
        }
        let secs = t.elapsed().as_secs_f64();
        ensure!(
            sum == reference,
            "the arena holds other bytes than the model files"
        );
        drop(leases);
        self.source.flush();
        Ok(secs)
    }

    /// Seconds per acquire of one resident page and its release.
    fn round_trip(&self, model: &Model) -> Result<f64> {
        let ids: Vec<PageId> = model.order().map(|p| PageId(p.id)).collect();
        let t = Instant::now();
        for i in 0..ROUND_TRIPS {
            drop(self.source.acquire(ids[i % ids.len()])?);
        }
        self.source.flush();
        Ok(t.elapsed().as_secs_f64() / ROUND_TRIPS as f64)
    }

    /// Seconds per acquire + release of one resident page by the same store in this
    /// process, without the socket (the peer of `round_trip`).
    fn in_process(&self, model: &Model) -> Result<f64> {
        let id = self.store.open_model(&model.dir)?;
        let ids: Vec<u32> = model.order().map(|p| p.id).collect();
        let t = Instant::now();
        for i in 0..ROUND_TRIPS {
            drop(self.store.acquire(id, ids[i % ids.len()])?);
        }
        Ok(t.elapsed().as_secs_f64() / ROUND_TRIPS as f64)
    }

    fn bytes_loaded(&self) -> u64 {
        self.store.cache_stats().bytes_loaded
    }

    fn counters(&self) -> [u64; 6] {
        let c = self.store.cache_stats();
        [
            c.hits,
            c.misses,
            c.admitted,
            c.not_admitted,
            c.evictions,
            c.full_refusals,
        ]
    }

    fn stop(self) -> Result<()> {
        let Served {
            store,
            client,
            source,
            stop,
            thread,
            _socket_dir,
        } = self;
        // The connection closes with the last reference to the client; the session
        // ends, then the daemon.
        drop(source);
        drop(client);
        let _ = stop.send(());
        thread
            .join()
            .map_err(|_| anyhow::anyhow!("the daemon's thread panicked"))?
            .context("the daemon failed")?;
        drop(store);
        Ok(())
    }
}

/// One run's figures. GB/s unless named otherwise; NaN where not measured.
#[derive(Clone, Copy, Default)]
struct Run {
    direct_warm: f64,
    direct_cold: f64,
    /// Cold reads again, just before the steady-state cold sweep (its bound).
    direct_cold_steady: f64,
    blake3: f64,
    arena_touch: f64,
    fresh_arena: f64,
    fresh_view: f64,
    daemon_cold_fill: f64,
    daemon_warm_fill: f64,
    daemon_steady_warm: f64,
    daemon_steady_cold: f64,
    /// Fraction of swept bytes that were loaded (misses) in the steady state.
    steady_miss_fraction: f64,
    /// The cache's counters over the timed page-cache-warm steady sweeps, in the
    /// order of `COUNTERS`.
    steady_counters: [u64; 6],
    daemon_resident: f64,
    round_trip_us: f64,
    in_process_us: f64,
    /// Largest fraction of the model's file bytes left resident by a page cache drop.
    drop_residue: f64,
}

impl Run {
    fn bound_cold(&self) -> f64 {
        1.0 / (1.0 / self.direct_cold + 1.0 / self.blake3)
    }
    fn bound_cold_steady(&self) -> f64 {
        1.0 / (1.0 / self.direct_cold_steady + 1.0 / self.blake3)
    }
    fn bound_warm(&self) -> f64 {
        1.0 / (1.0 / self.direct_warm + 1.0 / self.blake3)
    }
    /// The serial bounds of a first fill counting the fresh arena's first touch (the
    /// daemon's zeroing and the client's mapping) too.
    fn fill_bound_cold(&self) -> f64 {
        1.0 / (1.0 / self.bound_cold() + 1.0 / self.fresh_arena + 1.0 / self.fresh_view)
    }
    fn fill_bound_warm(&self) -> f64 {
        1.0 / (1.0 / self.bound_warm() + 1.0 / self.fresh_arena + 1.0 / self.fresh_view)
    }
}

fn one_run(model: &Model, buf: &mut [u8]) -> Result<Run> {
    let gbps = |bytes: u64, secs: f64| bytes as f64 / secs / 1e9;
    let total = model.total;
    let mut r = Run::default();
    model.read_all(buf)?; // warms the page cache
    r.direct_warm = gbps(total, model.read_all(buf)?);
    let (hash_secs, reference) = model.hash_all(buf)?;
    r.blake3 = gbps(total, hash_secs);
    let (written, mapped) = fresh_arena_touch(model.full_cache())?;
    r.fresh_arena = gbps(total, written);
    r.fresh_view = gbps(total, mapped);
    let served = |sum: u64, what: &str| -> Result<()> {
        ensure!(
            sum == reference,
            "the daemon served other bytes than the model files ({what})"
        );
        Ok(())
    };

    // Cold first fill, its bound read just before (storage speed drifts), then
    // serving resident pages from the same daemon, interleaved with its bound.
    let d = Served::start(model, model.full_cache())?;
    let mut residue = model.drop_page_cache()?;
    r.direct_cold = gbps(total, model.read_all(buf)?);
    residue = residue.max(model.drop_page_cache()?);
    let (secs, sum) = d.sweep(model)?;
    served(sum, "cold first fill")?;
    r.daemon_cold_fill = gbps(total, secs);
    let (mut serve_secs, mut touch_secs) = (0.0, 0.0);
    for _ in 0..WARM_SWEEPS {
        let (s, sum) = d.sweep(model)?;
        served(sum, "resident")?;
        serve_secs += s;
        touch_secs += d.touch_arena(model, reference)?;
    }
    r.daemon_resident = gbps(total * WARM_SWEEPS as u64, serve_secs);
    r.arena_touch = gbps(total * WARM_SWEEPS as u64, touch_secs);
    r.round_trip_us = d.round_trip(model)? * 1e6;
    r.in_process_us = d.in_process(model)? * 1e6;
    d.stop()?;

    // Warm first fill: a fresh arena, the page cache warm.
    model.read_all(buf)?;
    let d = Served::start(model, model.full_cache())?;
    let (secs, sum) = d.sweep(model)?;
    served(sum, "warm first fill")?;
    r.daemon_warm_fill = gbps(total, secs);
    d.stop()?;

    // Steady state: a cache of half the model, its whole arena touched by two sweeps.
    r.daemon_steady_warm = f64::NAN;
    r.daemon_steady_cold = f64::NAN;
    r.direct_cold_steady = f64::NAN;
    r.steady_miss_fraction = f64::NAN;
    if let Some(half) = model.half_cache() {
        let d = Served::start(model, half)?;
        for _ in 0..2 {
            d.sweep(model)?;
        }
        let before = d.bytes_loaded();
        let counted = d.counters();
        let mut secs = 0.0;
        for _ in 0..WARM_SWEEPS {
            let (s, sum) = d.sweep(model)?;
            served(sum, "steady state")?;
            secs += s;
        }
        let loaded = d.bytes_loaded() - before;
        r.daemon_steady_warm = gbps(loaded, secs);
        r.steady_miss_fraction = loaded as f64 / (total * WARM_SWEEPS as u64) as f64;
        let now = d.counters();
        for (i, c) in r.steady_counters.iter_mut().enumerate() {
            *c = now[i] - counted[i];
        }
        residue = residue.max(model.drop_page_cache()?);
        r.direct_cold_steady = gbps(total, model.read_all(buf)?);
        residue = residue.max(model.drop_page_cache()?);
        let before = d.bytes_loaded();
        let (secs, sum) = d.sweep(model)?;
        served(sum, "steady state, cold")?;
        r.daemon_steady_cold = gbps(d.bytes_loaded() - before, secs);
        d.stop()?;
    }
    r.drop_residue = residue;
    Ok(r)
}

/// Median, minimum and maximum of the finite values; NaNs when there are none.
fn stats(v: impl Iterator<Item = f64>) -> (f64, f64, f64) {
    let mut v: Vec<f64> = v.filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// Reads one figure (or bound) out of a run.
type Figure = fn(&Run) -> f64;

struct Row {
    key: &'static str,
    label: &'static str,
    unit: &'static str,
    value: Figure,
    bound: Option<(&'static str, Figure)>,
}

fn rows() -> Vec<Row> {
    let warm: (&str, Figure) = ("read+hash, warm", Run::bound_warm);
    let cold: (&str, Figure) = ("read+hash, cold", Run::bound_cold);
    let touch: (&str, Figure) = ("arena touch", |r| r.arena_touch);
    vec![
        Row {
            key: "direct_warm",
            label: "direct pread, page cache warm",
            unit: "GB/s",
            value: |r| r.direct_warm,
            bound: None,
        },
        Row {
            key: "direct_cold",
            label: "direct pread, page cache cold",
            unit: "GB/s",
            value: |r| r.direct_cold,
            bound: None,
        },
        Row {
            key: "direct_cold_beside_steady",
            label: "  again, beside the steady cold sweep",
            unit: "GB/s",
            value: |r| r.direct_cold_steady,
            bound: None,
        },
        Row {
            key: "blake3",
            label: "blake3, one core",
            unit: "GB/s",
            value: |r| r.blake3,
            bound: None,
        },
        Row {
            key: "arena_touch",
            label: "arena touch (sum u64, in place)",
            unit: "GB/s",
            value: |r| r.arena_touch,
            bound: None,
        },
        Row {
            key: "fresh_arena_first_write",
            label: "fresh arena, owner's first write",
            unit: "GB/s",
            value: |r| r.fresh_arena,
            bound: None,
        },
        Row {
            key: "fresh_arena_first_read_other_mapping",
            label: "fresh arena, client mapping's first read",
            unit: "GB/s",
            value: |r| r.fresh_view,
            bound: None,
        },
        Row {
            key: "bound_read_hash_warm",
            label: "bound: read then hash, warm",
            unit: "GB/s",
            value: Run::bound_warm,
            bound: None,
        },
        Row {
            key: "bound_read_hash_cold",
            label: "bound: read then hash, cold",
            unit: "GB/s",
            value: Run::bound_cold,
            bound: None,
        },
        Row {
            key: "daemon_cold_first_fill",
            label: "daemon, cold: fresh arena, cache dropped",
            unit: "GB/s",
            value: |r| r.daemon_cold_fill,
            bound: Some(cold),
        },
        Row {
            key: "daemon_warm_first_fill",
            label: "daemon, fresh arena, page cache warm",
            unit: "GB/s",
            value: |r| r.daemon_warm_fill,
            bound: Some(warm),
        },
        Row {
            key: "daemon_steady_warm",
            label: "daemon, steady loads, page cache warm",
            unit: "GB/s",
            value: |r| r.daemon_steady_warm,
            bound: Some(warm),
        },
        Row {
            key: "daemon_steady_cold",
            label: "daemon, steady loads, page cache cold",
            unit: "GB/s",
            value: |r| r.daemon_steady_cold,
            bound: Some(("read+hash, cold", Run::bound_cold_steady)),
        },
        Row {
            key: "daemon_resident",
            label: "daemon, resident: acquire+touch+release",
            unit: "GB/s",
            value: |r| r.daemon_resident,
            bound: Some(touch),
        },
        Row {
            key: "daemon_acquire_round_trip",
            label: "daemon, resident acquire round trip",
            unit: "us/page",
            value: |r| r.round_trip_us,
            bound: None,
        },
        Row {
            key: "store_in_process_acquire",
            label: "peer: same store in process, acquire",
            unit: "us/page",
            value: |r| r.in_process_us,
            bound: None,
        },
    ]
}

fn main() -> Result<()> {
    let mut json = false;
    let mut positional = Vec::new();
    for a in std::env::args().skip(1) {
        match a.as_str() {
            "--json" => json = true,
            "-h" | "--help" => {
                println!("usage: serve_bench MODEL_DIR [RUNS] [--json]");
                return Ok(());
            }
            _ => positional.push(a),
        }
    }
    let (dir, runs) = match positional.as_slice() {
        [dir] => (PathBuf::from(dir), 5),
        [dir, runs] => (
            PathBuf::from(dir),
            runs.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .with_context(|| format!("RUNS must be a positive number, not '{runs}'"))?,
        ),
        _ => bail!("usage: serve_bench MODEL_DIR [RUNS] [--json]"),
    };
    let model = Model::open(&dir)?;
    let mut buf = vec![0u8; model.largest];
    let started = Instant::now();
    let mut all = Vec::with_capacity(runs);
    for i in 0..runs {
        let r = one_run(&model, &mut buf).with_context(|| format!("run {}", i + 1))?;
        if !json {
            eprintln!(
                "run {}/{runs}: daemon cold fill {:.2} GB/s, resident {:.2} GB/s",
                i + 1,
                r.daemon_cold_fill,
                r.daemon_resident
            );
        }
        all.push(r);
    }
    let elapsed = started.elapsed().as_secs_f64();

    // mincore says whether the drop emptied this kernel's page cache; the speed of
    // cold reads says whether something below (a VM host's cache) still serves them.
    let residue = stats(all.iter().map(|r| r.drop_residue)).2;
    let cold_over_warm = stats(all.iter().flat_map(|r| {
        [
            r.direct_cold / r.direct_warm,
            r.direct_cold_steady / r.direct_warm,
        ]
    }));
    let drop_ok = residue <= DROP_TOLERANCE;
    let drop_note = if !drop_ok {
        format!(
            "page cache drop DID NOT work: up to {:.1}% of the model's file bytes stayed resident (mapped by another process?): the cold figures are not cold",
            100.0 * residue
        )
    } else if cold_over_warm.0 > 0.8 {
        format!(
            "page cache drop worked (at most {:.2}% resident after it, by mincore), but cold reads ran at {:.0}% of warm speed: the storage below caches; the cold figures are optimistic",
            100.0 * residue,
            100.0 * cold_over_warm.0
        )
    } else {
        format!(
            "page cache drop worked: at most {:.2}% of the model's file bytes resident after a drop (mincore); cold reads at {:.0}% of warm speed (median, {:.0}% at most)",
            100.0 * residue,
            100.0 * cold_over_warm.0,
            100.0 * cold_over_warm.2
        )
    };
    let steady_miss = stats(all.iter().map(|r| r.steady_miss_fraction)).0;
    let last = *all.last().expect("at least one run");
    // First fills against serial bounds that count the fresh arena's first touch too.
    let fill_cold = stats(all.iter().map(|r| r.daemon_cold_fill / r.fill_bound_cold())).0;
    let fill_warm = stats(all.iter().map(|r| r.daemon_warm_fill / r.fill_bound_warm())).0;

    let rows = rows();
    if json {
        let mut figures = serde_json::Map::new();
        for row in &rows {
            let (m, lo, hi) = stats(all.iter().map(row.value));
            let mut f = serde_json::json!({
                "unit": row.unit,
                "median": m, "min": lo, "max": hi,
                "runs": all.iter().map(row.value).collect::<Vec<_>>(),
            });
            if let Some((name, b)) = &row.bound {
                f["bound"] = serde_json::json!(name);
                f["bound_median"] = serde_json::json!(stats(all.iter().map(b)).0);
                f["ratio_median"] =
                    serde_json::json!(stats(all.iter().map(|r| (row.value)(r) / b(r))).0);
            }
            figures.insert(row.key.to_string(), f);
        }
        let out = serde_json::json!({
            "model": model.dir,
            "pages": model.pages.len(),
            "groups": model.groups.len(),
            "bytes": model.total,
            "runs": runs,
            "seconds": elapsed,
            "steady_state_cache_bytes": model.half_cache(),
            "steady_state_miss_fraction": steady_miss,
            "steady_state_counters_last_run": COUNTERS
                .iter()
                .zip(last.steady_counters)
                .map(|(k, v)| (k.to_string(), serde_json::json!(v)))
                .collect::<serde_json::Map<_, _>>(),
            "page_cache_drop": {
                "worked": drop_ok,
                "max_resident_fraction_after_drop": residue,
                "cold_over_warm_read_median": cold_over_warm.0,
                "cold_over_warm_read_max": cold_over_warm.2,
            },
            "first_fill_with_first_touch": {
                "bound_cold_median": stats(all.iter().map(Run::fill_bound_cold)).0,
                "ratio_cold_median": fill_cold,
                "bound_warm_median": stats(all.iter().map(Run::fill_bound_warm)).0,
                "ratio_warm_median": fill_warm,
            },
            "figures": figures,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }

    println!(
        "{}: {} pages in {} groups, {:.1} MB; medians of {runs} runs ({:.0} s)",
        model.dir.display(),
        model.pages.len(),
        model.groups.len(),
        model.total as f64 / 1e6,
        elapsed
    );
    println!("{drop_note}");
    match model.half_cache() {
        Some(h) => println!(
            "steady state: cache of {:.1} MB, {:.1}% of the swept bytes loaded (misses); cache counters over the last run's {WARM_SWEEPS} timed sweeps: {}",
            h as f64 / 1e6,
            100.0 * steady_miss,
            COUNTERS
                .iter()
                .zip(last.steady_counters)
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        None => println!("steady state: not measured (the model is too small to page)"),
    }
    println!(
        "{:<42} {:>9} {:>17}   {:<16} {:>9} {:>6}",
        "figure", "median", "min..max", "bound", "bound", "ratio"
    );
    for row in &rows {
        let (m, lo, hi) = stats(all.iter().map(row.value));
        let mut line = format!(
            "{:<42} {:>9.2} {:>8.2}..{:<8.2} {:<7}",
            row.label, m, lo, hi, row.unit
        );
        if let Some((name, b)) = &row.bound {
            let bm = stats(all.iter().map(b)).0;
            let ratio = stats(all.iter().map(|r| (row.value)(r) / b(r))).0;
            line += &format!("   {name:<16} {bm:>9.2} {:>5.0}%", 100.0 * ratio);
        }
        println!("{}", line.trim_end());
    }
    println!(
        "first fills against first touch + read + hash in series: cold {:.2} GB/s bound, {:.0}%; warm {:.2} GB/s bound, {:.0}%",
        stats(all.iter().map(Run::fill_bound_cold)).0,
        100.0 * fill_cold,
        stats(all.iter().map(Run::fill_bound_warm)).0,
        100.0 * fill_warm
    );
    Ok(())
}

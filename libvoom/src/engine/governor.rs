//! The memory governor: a thread that watches live memory pressure and shrinks the
//! engine's caches before the system swaps or kills the process, restoring them as
//! pressure falls.
//!
//! - **Pressure.** Headroom is the lower of the machine's `MemAvailable` and what
//!   the process's memory cgroup leaves (v1 `memory.limit_in_bytes` less
//!   `memory.usage_in_bytes`, v2 `memory.max` less `memory.current`, both less the
//!   cgroup's reclaimable inactive file pages); on v2 a `memory.pressure` `some
//!   avg10` above 10% counts as pressure too. On macOS: the free share of physical
//!   memory (`kern.memorystatus_level`), and the VM's pressure level at warning or
//!   above (what its memory-pressure notifications report; [`darwin_pressure`]).
//!   Where nothing is readable, the governor does nothing.
//! - **Shrinking**, below [`GovernorConfig::low_headroom`]: it frees what brings the
//!   headroom back to [`GovernorConfig::high_headroom`], by the time each byte saves,
//!   least first:
//!   1. prompt prefixes kept for reuse (recomputable: they save time only if asked
//!      again);
//!   2. the weight cache's streaming room beyond the least a sweep works in
//!      ([`Placements::shrink`]; `PageSource::set_cache_limit`): its pages are read
//!      again as the sweep comes back to them, but a page is read once per pass
//!      wherever it streams, and the room beyond one layer's only reads ahead;
//!   3. KV pages of live sequences, spilled to disk ([`crate::kv::spill`]: read back
//!      for every pass, so they cost time on each);
//!   4. the planner's pins: the weight budget is placed again, smaller, between
//!      passes ([`crate::engine::placed`]), and the pages it no longer pins stream,
//!      read once a pass. A byte of weights is read for every sequence of a batch,
//!      a byte of KV for one, so pins go last; never below the least budget the
//!      model streams in.
//!
//!   Freed heap is returned to the OS (`malloc_trim`), freed cache room too (the
//!   arena's pages are released). A request never fails for it: a smaller budget
//!   only streams or spills more.
//! - **Restoring**, above twice the high mark: budgets grow back toward what was
//!   configured, a step each tick, in the reverse order (pins, then the weight
//!   cache's room, KV, prefixes).
//!
//! The memory-mapped store (the default) has no cache of its own: the OS reclaims
//! its file pages under pressure. A daemon's cache is the daemon's.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::placed::Placements;
use super::prefix::PrefixCache;
use crate::kv::KvPool;

/// When and how far the governor acts.
#[derive(Debug, Clone)]
pub struct GovernorConfig {
    /// Time between readings.
    pub interval: Duration,
    /// Headroom below which caches shrink.
    pub low_headroom: u64,
    /// Headroom a shrink aims for.
    pub high_headroom: u64,
    /// KV bytes never taken from live sequences (their open pages and a little).
    pub min_kv_budget: u64,
}

impl Default for GovernorConfig {
    fn default() -> Self {
        GovernorConfig {
            interval: Duration::from_millis(100),
            low_headroom: 64 << 20,
            high_headroom: 160 << 20,
            min_kv_budget: 4 << 20,
        }
    }
}

/// What the governor did.
#[derive(Debug, Default)]
pub struct GovernorStats {
    /// Times it shrank caches, and the bytes it asked them to give up.
    pub shrinks: AtomicU64,
    pub bytes_asked: AtomicU64,
    /// Times it grew a budget back.
    pub restores: AtomicU64,
    /// The lowest headroom it read.
    pub lowest_headroom: AtomicU64,
    /// Bytes of the weight cache withheld now, and the most at once.
    pub weights_withheld: AtomicU64,
    pub most_weights_withheld: AtomicU64,
    /// Slot bytes of the planner's pins given up now (unpinned: they stream), and
    /// the most at once.
    pub pins_released: AtomicU64,
    pub most_pins_released: AtomicU64,
}

impl GovernorStats {
    /// Notes where the weight budget stands.
    fn weights(&self, w: &Placements) {
        let b = w.budget();
        let released = b.pinned_at_open.saturating_sub(b.pinned);
        self.weights_withheld.store(b.withheld, Ordering::Relaxed);
        self.most_weights_withheld
            .fetch_max(b.withheld, Ordering::Relaxed);
        self.pins_released.store(released, Ordering::Relaxed);
        self.most_pins_released
            .fetch_max(released, Ordering::Relaxed);
    }
}

/// The governor's counters; its thread stops when the engine goes.
pub struct GovernorHandle {
    pub stats: Arc<GovernorStats>,
}

/// Memory headroom now, and where the figure comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct Pressure {
    pub headroom: u64,
    pub source: String,
    /// v2's `memory.pressure` `some avg10` (percent), where readable.
    pub psi_some_avg10: Option<f64>,
    /// The OS says memory is under pressure (macOS's warning or critical level).
    pub warned: bool,
}

/// macOS's figures, from the sysctls its memory-pressure notifications derive from:
/// `hw.memsize` bytes, `kern.memorystatus_level` percent of them free, and
/// `kern.memorystatus_vm_pressure_level` (1 normal, 2 warning, 4 critical).
pub fn darwin_pressure(memsize: u64, free_percent: u64, level: u64) -> Pressure {
    Pressure {
        headroom: (u128::from(memsize) * u128::from(free_percent.min(100)) / 100) as u64,
        source: format!(
            "macOS memory status ({free_percent}% of {memsize} free, pressure level {level})"
        ),
        psi_some_avg10: None,
        warned: level >= 2,
    }
}

/// An integer sysctl (4 or 8 bytes) by name.
#[cfg(target_os = "macos")]
fn sysctl_u64(name: &std::ffi::CStr) -> Option<u64> {
    let mut buf = [0u8; 8];
    let mut len: libc::size_t = buf.len();
    // SAFETY: `name` is NUL-terminated; `buf` is writable for `len` bytes and `len`
    // is updated by the call to what it wrote; nothing is set (null new value).
    let r = unsafe {
        libc::sysctlbyname(
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    match (r, len) {
        (0, 4) => Some(u64::from(u32::from_ne_bytes([
            buf[0], buf[1], buf[2], buf[3],
        ]))),
        (0, 8) => Some(u64::from_ne_bytes(buf)),
        _ => None,
    }
}

fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// `key value` from a `memory.stat` text.
fn stat_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// The headroom of the memory cgroup named in `proc_cgroup` (a `/proc/self/cgroup`
/// text) under the cgroup filesystem `root`: limit less usage less reclaimable
/// inactive file pages, with a description and v2's PSI; `None` without a limit.
pub fn cgroup_pressure(proc_cgroup: &str, root: &Path) -> Option<Pressure> {
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = path.trim_start_matches('/');
        let (dir, limit, usage, inactive_key) = if controllers.split(',').any(|c| c == "memory") {
            let d = root.join("memory").join(rel);
            let (l, u) = (
                read_u64(&d.join("memory.limit_in_bytes")),
                read_u64(&d.join("memory.usage_in_bytes")),
            );
            (d, l, u, "total_inactive_file")
        } else if controllers.is_empty() {
            let d = root.join(rel);
            let (l, u) = (
                read_u64(&d.join("memory.max")),
                read_u64(&d.join("memory.current")),
            );
            (d, l, u, "inactive_file")
        } else {
            continue;
        };
        let (Some(limit), Some(usage)) = (limit, usage) else {
            continue;
        };
        if limit >= 1 << 60 {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
        let inactive = stat_value(&stat, inactive_key).unwrap_or(0);
        let psi = std::fs::read_to_string(dir.join("memory.pressure"))
            .ok()
            .and_then(|t| {
                let some = t.lines().find(|l| l.starts_with("some "))?;
                some.split_whitespace()
                    .find_map(|f| f.strip_prefix("avg10="))?
                    .parse()
                    .ok()
            });
        let used = usage.saturating_sub(inactive);
        return Some(Pressure {
            headroom: limit.saturating_sub(used),
            source: format!(
                "memory cgroup {path} (limit {limit}, in use {used} not counting inactive files)"
            ),
            psi_some_avg10: psi,
            warned: false,
        });
    }
    None
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub fn meminfo_available(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// The pressure on this process now (`None` where the OS reports nothing).
pub fn pressure() -> Option<Pressure> {
    #[cfg(target_os = "macos")]
    if let (Some(m), Some(f), Some(l)) = (
        sysctl_u64(c"hw.memsize"),
        sysctl_u64(c"kern.memorystatus_level"),
        sysctl_u64(c"kern.memorystatus_vm_pressure_level"),
    ) {
        return Some(darwin_pressure(m, f, l));
    }
    let machine = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| meminfo_available(&m));
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| cgroup_pressure(&c, Path::new("/sys/fs/cgroup")));
    match (machine, cgroup) {
        (Some(m), Some(c)) if m < c.headroom => Some(Pressure {
            headroom: m,
            source: "MemAvailable".into(),
            psi_some_avg10: c.psi_some_avg10,
            warned: false,
        }),
        (_, Some(c)) => Some(c),
        (Some(m), None) => Some(Pressure {
            headroom: m,
            source: "MemAvailable".into(),
            psi_some_avg10: None,
            warned: false,
        }),
        (None, None) => None,
    }
}

/// Gives freed heap back to the OS.
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the OS.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn lock(p: &Mutex<PrefixCache>) -> std::sync::MutexGuard<'_, PrefixCache> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts the governor's thread over `prefixes` and `pool` (held weakly: the thread
/// ends when they go).
pub(crate) fn start(
    cfg: GovernorConfig,
    prefixes: &Arc<Mutex<PrefixCache>>,
    pool: Option<&KvPool>,
    weights: Option<&Arc<Placements>>,
) -> GovernorHandle {
    let stats = Arc::new(GovernorStats {
        lowest_headroom: AtomicU64::new(u64::MAX),
        ..GovernorStats::default()
    });
    let prefixes: Weak<Mutex<PrefixCache>> = Arc::downgrade(prefixes);
    let pool = pool.map(|p| p.downgrade());
    let weights: Option<Weak<Placements>> = weights.map(Arc::downgrade);
    let (st, thread_stats) = (Arc::clone(&stats), stats);
    let spawned = std::thread::Builder::new()
        .name("voom-governor".into())
        .spawn(move || {
            let (prefix_cfg, kv_cfg) = match prefixes.upgrade() {
                Some(p) => (
                    lock(&p).budget(),
                    pool.as_ref().and_then(|w| w.upgrade()).map(|p| p.budget()),
                ),
                None => return,
            };
            loop {
                std::thread::sleep(cfg.interval);
                let Some(prefixes) = prefixes.upgrade() else {
                    return;
                };
                let pool = pool.as_ref().and_then(|w| w.upgrade());
                let weights = weights.as_ref().and_then(|w| w.upgrade());
                if let Some(w) = &weights {
                    // Pins asked for while passes held the placement go now if none does.
                    w.settle();
                    thread_stats.weights(w);
                }
                let Some(p) = pressure() else { continue };
                thread_stats
                    .lowest_headroom
                    .fetch_min(p.headroom, Ordering::Relaxed);
                let pressed = p.headroom < cfg.low_headroom
                    || p.psi_some_avg10.is_some_and(|x| x > 10.0)
                    || p.warned;
                if pressed {
                    let mut need = cfg.high_headroom.saturating_sub(p.headroom).max(1 << 20);
                    thread_stats.shrinks.fetch_add(1, Ordering::Relaxed);
                    thread_stats.bytes_asked.fetch_add(need, Ordering::Relaxed);
                    {
                        let mut pc = lock(&prefixes);
                        let held = pc.bytes() as u64;
                        if held > 0 {
                            pc.set_budget(held.saturating_sub(need) as usize);
                            need = need.saturating_sub(held - pc.bytes() as u64);
                        }
                    }
                    if let (true, Some(w)) = (need > 0, &weights) {
                        need = need.saturating_sub(w.shrink(need, false));
                    }
                    if let (true, Some(pool)) = (need > 0, &pool) {
                        let s = pool.stats();
                        let now = s.resident_bytes + s.staged_bytes;
                        let target = now.saturating_sub(need).max(cfg.min_kv_budget);
                        if target < pool.budget() as u64 {
                            pool.set_budget(target as usize);
                        }
                    }
                    if let (true, Some(w)) = (need > 0, &weights) {
                        w.shrink(need, true);
                    }
                    if let Some(w) = &weights {
                        thread_stats.weights(w);
                    }
                    trim_heap();
                    tracing::info!(
                        "memory governor: headroom {} MiB ({}): caches shrunk",
                        p.headroom >> 20,
                        p.source
                    );
                } else if p.headroom > 2 * cfg.high_headroom {
                    let spare = (p.headroom - 2 * cfg.high_headroom) / 2;
                    let mut grew = false;
                    if let Some(w) = &weights {
                        grew |= w.restore(spare);
                        thread_stats.weights(w);
                    }
                    if let (Some(pool), Some(want)) = (&pool, kv_cfg) {
                        let b = pool.budget();
                        if b < want {
                            pool.set_budget(want.min(b.saturating_add(spare as usize)));
                            grew = true;
                        }
                    }
                    let mut pc = lock(&prefixes);
                    if pc.budget() < prefix_cfg {
                        let b = pc.budget();
                        pc.set_budget(prefix_cfg.min(b.saturating_add(spare as usize)));
                        grew = true;
                    }
                    if grew {
                        thread_stats.restores.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("memory governor: {e}: caches are not governed");
    }
    GovernorHandle { stats: st }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pressure_reads_v1_and_v2_cgroups_less_inactive_files() {
        let root = tempfile::tempdir().unwrap();
        let v1 = root.path().join("memory/user/run");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "1000000\n").unwrap();
        std::fs::write(v1.join("memory.usage_in_bytes"), "900000\n").unwrap();
        std::fs::write(
            v1.join("memory.stat"),
            "cache 5\ntotal_inactive_file 300000\n",
        )
        .unwrap();
        let p = cgroup_pressure("9:memory:/user/run\n", root.path()).unwrap();
        assert_eq!(p.headroom, 400_000);
        assert_eq!(p.psi_some_avg10, None);
        let v2 = root.path().join("app");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v2.join("memory.max"), "2000000\n").unwrap();
        std::fs::write(v2.join("memory.current"), "1500000\n").unwrap();
        std::fs::write(v2.join("memory.stat"), "anon 1\ninactive_file 100000\n").unwrap();
        std::fs::write(
            v2.join("memory.pressure"),
            "some avg10=12.50 avg60=1.00 avg300=0.00 total=5\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        )
        .unwrap();
        let p = cgroup_pressure("0::/app\n", root.path()).unwrap();
        assert_eq!(p.headroom, 600_000);
        assert_eq!(p.psi_some_avg10, Some(12.5));
        // macOS's figures: the free share of memory, and its warning level.
        let d = darwin_pressure(16 << 30, 25, 2);
        assert_eq!((d.headroom, d.warned), (4 << 30, true));
        assert!(!darwin_pressure(16 << 30, 60, 1).warned);
        // No limit: no cgroup figure.
        std::fs::write(v2.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_pressure("0::/app\n", root.path()), None);
    }
}

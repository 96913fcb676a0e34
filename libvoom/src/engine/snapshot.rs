//! Prompt prefixes on disk: the KV of a long prefix kept as an immutable file, so
//! that a restarted process reuses it ([`super::prefix`] is the in-memory side).
//!
//! A snapshot is valid only for the arithmetic that computed it: its directory is
//! named by a key over the checkpoint's page manifest (which names every page's
//! blake3), its `config.json` (rotary scaling, norms, routing...), the KV layout
//! (layers, floats per position) and [`ARITHMETIC`] (the version of the kernels'
//! bits). Another model, another checkpoint version or
//! other arithmetic has another directory, so its snapshots are never read.
//!
//! File format (little-endian): `VOOMKVS2`, the 32-byte key, as u32 the number of
//! ids `n`, layers, floats per position, halves (2: keys and values; 1: keys only),
//! layers holding a recurrent state instead (a hybrid's), floats of one copy of
//! those states and the copies kept (0, 1 or 2); the ids (u32 each); then per layer
//! of keys and values the keys of every position and then the values (f32); then
//! the recurrent state as of position `n`, and, in a second copy, as of `n - 1`
//! (where the cache's last pass started there: a prompt's last position is
//! computed alone when prefixes are kept); then the blake3 of everything before. A
//! snapshot with states serves a prompt only at those positions (a state cannot be
//! cut back); one without serves any prefix of its ids. A file that is short, whose
//! hash or header does not match, is deleted when read and the prefix recomputed.
//! Files are written under a temporary name and renamed, by one writer thread, so
//! a reader sees whole files only; a write that fails (a full disk) turns
//! persistence off with a warning and loses nothing else. The directory is kept
//! under a byte budget, the least recently used files deleted first.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use crate::kv::KvCache;

/// The version of the kernels' arithmetic: a snapshot computed by other kernels is
/// not this one's. Changed whenever an operation's bits change.
pub const ARITHMETIC: &str = "voom-cpu-kv-f32/attention-2/silu-exp-3";

const MAGIC: &[u8; 8] = b"VOOMKVS2";
const HEADER: usize = 8 + 32 + 28;

/// Where and how much to persist.
#[derive(Debug, Clone)]
pub struct DiskPrefixes {
    /// The root directory (each model and arithmetic gets a directory under it).
    pub dir: PathBuf,
    /// Bytes of snapshots kept at most.
    pub budget: u64,
    /// Prefixes of fewer ids are not written.
    pub min_tokens: usize,
}

/// One snapshot file.
#[derive(Debug, Clone)]
struct Snap {
    path: PathBuf,
    ids: Vec<u32>,
    bytes: u64,
    used: u64,
    /// The prefix lengths it serves: `None`, any up to its ids' (keys and values
    /// only); else those its recurrent state copies are at.
    at: Option<Vec<usize>>,
}

impl Snap {
    /// The most positions of `prompt` it serves, at most `limit`.
    fn serves(&self, prompt: &[u32], limit: usize) -> usize {
        let common = self
            .ids
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(limit);
        match &self.at {
            None => common,
            Some(at) => at
                .iter()
                .copied()
                .filter(|&a| a <= common)
                .max()
                .unwrap_or(0),
        }
    }
}

struct Shared {
    index: Vec<Snap>,
    /// Prefixes queued for the writer and not yet written.
    pending: Vec<Vec<u32>>,
    clock: u64,
    /// Why persistence is off, once a write failed.
    off: Option<String>,
}

/// The snapshots of one model and arithmetic.
pub struct SnapshotDir {
    dir: PathBuf,
    key: [u8; 32],
    cfg: DiskPrefixes,
    shared: Arc<Mutex<Shared>>,
    writer: Mutex<Option<mpsc::SyncSender<Job>>>,
}

enum Job {
    Write(Vec<u32>, Box<KvCache>),
    Flush(mpsc::Sender<()>),
}

/// The key of a model's snapshots: its page manifest, its `config.json`, its KV
/// layout, the arithmetic.
pub fn key_of(manifest: &[u8], config: &[u8], layers: usize, width: usize) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"voom kv snapshot\0");
    h.update(ARITHMETIC.as_bytes());
    h.update(&(layers as u64).to_le_bytes());
    h.update(&(width as u64).to_le_bytes());
    for part in [manifest, config] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    *h.finalize().as_bytes()
}

/// Temporary files older than this are a dead writer's.
const STALE_TMP: std::time::Duration = std::time::Duration::from_secs(3600);

impl SnapshotDir {
    /// The snapshots of `key` under `cfg.dir`, indexed from their headers (files
    /// whose header is not a snapshot of `key` are deleted).
    pub fn open(cfg: DiskPrefixes, key: [u8; 32]) -> std::io::Result<Self> {
        let dir = cfg.dir.join(&blake3::Hash::from(key).to_hex()[..32]);
        // Prompts are private: the directories and files are the owner's only.
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)?;
        }
        // Another user who can write the directory could put their KV under a
        // prompt's name: only the owner's own, private directories are used.
        for d in [cfg.dir.as_path(), dir.as_path()] {
            private_dir(d)?;
        }
        let mut index = Vec::new();
        for e in std::fs::read_dir(&dir)? {
            let path = e?.path();
            if path.extension().is_some_and(|x| x == "tmp") {
                // Another writer's, unless it is old.
                let old = std::fs::metadata(&path)
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > STALE_TMP);
                if old {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            match read_ids(&path, &key) {
                Ok((ids, bytes, at)) => index.push(Snap {
                    path,
                    ids,
                    bytes,
                    used: 0,
                    at,
                }),
                Err(_) => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        Ok(SnapshotDir {
            dir,
            key,
            cfg,
            shared: Arc::new(Mutex::new(Shared {
                index,
                pending: Vec::new(),
                clock: 0,
                off: None,
            })),
            writer: Mutex::new(None),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Snapshots held, and their bytes.
    pub fn held(&self) -> (usize, u64) {
        let s = self.lock();
        (s.index.len(), s.index.iter().map(|x| x.bytes).sum())
    }

    /// Why persistence is off, if it is.
    pub fn off(&self) -> Option<String> {
        self.lock().off.clone()
    }

    /// The longest prefix of `prompt` a snapshot holds, at most `prompt.len() - 1`
    /// ids and at least `min`: read, checked and made a cache like `like` (its
    /// capacity and page size). `None` when there is none, or when the file turns
    /// out damaged (then it is deleted).
    pub fn take(&self, prompt: &[u32], min: usize, like: &KvCache) -> Option<KvCache> {
        let limit = prompt.len().saturating_sub(1);
        let (path, len) = {
            let mut s = self.lock();
            let best = s
                .index
                .iter()
                .enumerate()
                .filter(|(_, e)| e.at.is_some() == like.has_states())
                .map(|(i, e)| (i, e.serves(prompt, limit)))
                .max_by_key(|&(_, n)| n)?;
            // A cache of a smaller context may take a prefix of a longer snapshot
            // (one with states only where a copy of them is: `read` checks).
            let len = best.1.min(like.capacity());
            if len < min {
                return None;
            }
            s.clock += 1;
            let clock = s.clock;
            s.index[best.0].used = clock;
            (s.index[best.0].path.clone(), len)
        };
        // The file is read again, whole: what it holds now is checked against the
        // prompt it is used for (it may have been replaced since it was indexed).
        match read(&path, &self.key, like, &prompt[..len]) {
            Ok(kv) => Some(kv),
            Err(why) => {
                tracing::warn!(
                    "prefix snapshot {} is damaged ({why}): deleted",
                    path.display()
                );
                let _ = std::fs::remove_file(&path);
                self.lock().index.retain(|e| e.path != path);
                None
            }
        }
    }

    /// Writes the first `ids.len()` positions of `kv` as a snapshot, on the writer
    /// thread (unless fewer than `min_tokens`, or one holds them already).
    pub fn save(&self, ids: &[u32], kv: &KvCache) {
        let n = ids.len().min(kv.len());
        // A recurrent state is kept only at its cache's length.
        if n < self.cfg.min_tokens || (kv.has_states() && n != kv.len()) {
            return;
        }
        {
            // Held, or queued already (a prompt repeated while its snapshot is
            // being written).
            let mut s = self.lock();
            let held = s
                .index
                .iter()
                .any(|e| e.ids.starts_with(&ids[..n]) && e.serves(&ids[..n], n) == n);
            if s.off.is_some() || held || s.pending.iter().any(|p| p.starts_with(&ids[..n])) {
                return;
            }
            s.pending.push(ids[..n].to_vec());
        }
        // One larger than the budget would be deleted as soon as written.
        let size = HEADER as u64 + 4 * n as u64 * (1 + (kv.width() * kv.layers() * 2) as u64) + 32;
        if size > self.cfg.budget {
            self.lock().pending.retain(|p| p.as_slice() != &ids[..n]);
            return;
        }
        let mut kv = kv.clone();
        kv.truncate(n);
        if !self.send(Job::Write(ids[..n].to_vec(), Box::new(kv))) {
            // The writer is behind: this one is dropped (it holds a cache's worth of
            // memory while queued).
            self.lock().pending.retain(|p| p.as_slice() != &ids[..n]);
        }
    }

    /// Waits until every snapshot asked for so far is written (or failed).
    pub fn flush(&self) {
        let (tx, rx) = mpsc::channel();
        let job = Job::Flush(tx);
        let w = self
            .writer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        // Waits for room: a flush is never dropped.
        if w.is_some_and(|w| w.send(job).is_ok()) {
            let _ = rx.recv();
        }
    }

    /// Queues `job` for the writer (started at the first); false when the queue
    /// is full.
    fn send(&self, job: Job) -> bool {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let tx = w.get_or_insert_with(|| {
            let (tx, rx) = mpsc::sync_channel::<Job>(WRITER_QUEUE);
            let (dir, key, budget) = (self.dir.clone(), self.key, self.cfg.budget);
            let shared = Arc::clone(&self.shared);
            std::thread::Builder::new()
                .name("voom-prefix-writer".into())
                .spawn(move || {
                    for job in rx {
                        match job {
                            Job::Flush(done) => {
                                let _ = done.send(());
                            }
                            Job::Write(ids, kv) => {
                                write_one(&dir, &key, budget, &shared, &ids, &kv)
                            }
                        }
                    }
                })
                .expect("spawning the prefix writer");
            tx
        });
        tx.try_send(job).is_ok()
    }
}

/// Checks that `dir` is this user's and that no one else can write it (an error of
/// kind `PermissionDenied` naming it otherwise).
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(dir)?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let why = if m.uid() != me {
        format!("belongs to uid {}, not this user ({me})", m.uid())
    } else if m.mode() & 0o022 != 0 {
        format!("is writable by others (mode {:o})", m.mode() & 0o7777)
    } else {
        return Ok(());
    };
    Err(std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        format!(
            "{} {why}: its snapshots could be another user's",
            dir.display()
        ),
    ))
}

/// Snapshots queued for the writer at most (each holds its cache's pages).
const WRITER_QUEUE: usize = 2;

/// Writes one snapshot, then keeps the directory within `budget`.
fn write_one(
    dir: &Path,
    key: &[u8; 32],
    budget: u64,
    shared: &Mutex<Shared>,
    ids: &[u32],
    kv: &KvCache,
) {
    let mut name = blake3::Hasher::new();
    for id in ids {
        name.update(&id.to_le_bytes());
    }
    let path = dir.join(format!("{}.kv", &name.finalize().to_hex()[..32]));
    // This process's own temporary name (another may write the same prefix).
    let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
    let file = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
    };
    let written = file.map_err(Failure::Io).and_then(|f| {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        let bytes = encode(&mut w, key, ids, kv)?;
        let f = w.into_inner().map_err(|e| Failure::Io(e.into_error()))?;
        f.sync_data().map_err(Failure::Io)?;
        Ok(bytes)
    });
    let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
    s.pending.retain(|p| p.as_slice() != ids);
    let bytes = match written {
        Ok(b) => b,
        Err(Failure::Pages(e)) => {
            // Its pages are not all readable (a spilled page lost): not kept.
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!("prefix snapshot not written: {e}");
            return;
        }
        Err(Failure::Io(e)) => {
            let _ = std::fs::remove_file(&tmp);
            let why = format!("writing {}: {e}", tmp.display());
            tracing::warn!("prefix snapshots off: {why}");
            s.off = Some(why);
            return;
        }
    };
    if let Err(e) = std::fs::rename(&tmp, &path) {
        // This one is lost (another process may have moved the directory); the
        // next may do better.
        let _ = std::fs::remove_file(&tmp);
        tracing::warn!("prefix snapshot {} not kept: {e}", path.display());
        return;
    }
    s.clock += 1;
    let used = s.clock;
    // A snapshot this one extends is no longer needed (where this one serves its
    // length: one with recurrent states serves only its own).
    let at = states_at(ids.len(), kv);
    s.index.retain(|e| {
        let stale = ids.starts_with(&e.ids)
            && at
                .as_ref()
                .is_none_or(|a| a.contains(&e.ids.len()) && e.at.is_some());
        if stale && e.path != path {
            let _ = std::fs::remove_file(&e.path);
        }
        !stale
    });
    s.index.push(Snap {
        path,
        ids: ids.to_vec(),
        bytes,
        used,
        at,
    });
    while s.index.iter().map(|e| e.bytes).sum::<u64>() > budget {
        let Some(oldest) = (0..s.index.len()).min_by_key(|&i| s.index[i].used) else {
            break;
        };
        let e = s.index.remove(oldest);
        let _ = std::fs::remove_file(&e.path);
    }
}

/// Why a snapshot was not written: its pages (a spilled page lost, positions
/// dropped), or the file.
enum Failure {
    Pages(String),
    Io(std::io::Error),
}

/// Writes the snapshot of `kv`'s first `ids.len()` positions to `w`, a layer at a
/// time, hashing as it goes; the bytes written.
fn encode(w: &mut impl Write, key: &[u8; 32], ids: &[u32], kv: &KvCache) -> Result<u64, Failure> {
    let n = ids.len();
    let width = kv.width();
    if kv.lost().is_some_and(|at| at < n) {
        return Err(Failure::Pages("positions of the prefix were lost".into()));
    }
    if kv.has_dropped() {
        return Err(Failure::Pages(
            "positions behind a sliding window were dropped".into(),
        ));
    }
    let pages = |e: crate::backend::KernelError| Failure::Pages(e.to_string());
    let (state_layers, state_floats) = kv.state_layout();
    let (state, before) = kv.export_states();
    if kv.has_states() && n != kv.len() {
        return Err(Failure::Pages(
            "a recurrent state is kept only at its cache's length".into(),
        ));
    }
    // The state where the last pass started, where that is the position before.
    let before = before.filter(|(at, _)| *at + 1 == n && n > 0);
    let copies = match (kv.has_states(), &before) {
        (false, _) => 0,
        (true, None) => 1,
        (true, Some(_)) => 2,
    };
    let kv_layers: Vec<usize> = (0..kv.layers())
        .filter(|&l| !kv.is_state_layer(l))
        .collect();
    let halves = match kv_layers.first() {
        Some(&l) if kv.layer(l).map_err(pages)?.v.is_empty() => 1,
        _ => 2,
    };
    let mut hash = blake3::Hasher::new();
    let mut bytes = 0u64;
    let mut put = |b: &[u8]| -> Result<(), Failure> {
        hash.update(b);
        bytes += b.len() as u64;
        w.write_all(b).map_err(Failure::Io)
    };
    let mut head = Vec::with_capacity(HEADER + 4 * n);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(key);
    for x in [
        n,
        kv.layers(),
        width,
        halves,
        state_layers,
        state_floats,
        copies,
    ] {
        head.extend_from_slice(&(x as u32).to_le_bytes());
    }
    for id in ids {
        head.extend_from_slice(&id.to_le_bytes());
    }
    put(&head)?;
    let mut out = Vec::with_capacity(4 * n * width);
    for &l in &kv_layers {
        let view = kv.layer(l).map_err(pages)?;
        for half in [&view.k, &view.v].into_iter().take(halves) {
            out.clear();
            for (p, off, m) in view.segments(0, n) {
                for x in &half[p][off * width..(off + m) * width] {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
            put(&out)?;
        }
    }
    let copies_of = [
        Some(state.as_slice()),
        before.as_ref().map(|(_, b)| b.as_slice()),
    ];
    for copy in copies_of.into_iter().take(copies).flatten() {
        out.clear();
        for x in copy {
            out.extend_from_slice(&x.to_le_bytes());
        }
        put(&out)?;
    }
    let h = hash.finalize();
    w.write_all(h.as_bytes()).map_err(Failure::Io)?;
    Ok(bytes + 32)
}

/// The lengths a snapshot of `kv`'s first `n` positions serves ([`Snap::at`]).
fn states_at(n: usize, kv: &KvCache) -> Option<Vec<usize>> {
    if !kv.has_states() {
        return None;
    }
    let before = kv.state_before_at().is_some_and(|at| at + 1 == n && n > 0);
    Some(if before { vec![n - 1, n] } else { vec![n] })
}

/// The lengths a snapshot serves from its header's `n` and state copies.
fn at_of(head: &[u8]) -> Option<Vec<usize>> {
    let (n, copies) = (u32_at(head, 40) as usize, u32_at(head, 64));
    match copies {
        0 => None,
        1 => Some(vec![n]),
        _ => Some(vec![n.saturating_sub(1), n]),
    }
}

/// A snapshot's ids, size and the lengths it serves, from its header (not its
/// hash: that is checked when it is read whole).
type Indexed = (Vec<u32>, u64, Option<Vec<usize>>);
fn read_ids(path: &Path, key: &[u8; 32]) -> Result<Indexed, String> {
    // A regular file only: a FIFO in the directory would block an open for ever.
    let mut f = voom_formats::file::open(path).map_err(|e| e.to_string())?;
    let bytes = f.metadata().map_err(|e| e.to_string())?.len();
    let head = header(&mut f, bytes, key)?;
    let n = u32_at(&head, 40) as usize;
    let mut ids = vec![0u8; 4 * n];
    f.read_exact(&mut ids).map_err(|e| e.to_string())?;
    Ok((
        ids.chunks_exact(4).map(|c| u32_at(c, 0)).collect(),
        bytes,
        at_of(&head),
    ))
}

/// A snapshot's header from `f` (a file of `size` bytes), checked against `key`
/// and the size it implies.
fn header(f: &mut impl Read, size: u64, key: &[u8; 32]) -> Result<[u8; HEADER], String> {
    let mut head = [0u8; HEADER];
    f.read_exact(&mut head).map_err(|e| e.to_string())?;
    if &head[..8] != MAGIC || &head[8..40] != key {
        return Err("not a snapshot of this model and arithmetic".into());
    }
    let expected = expected_len(&head);
    if size != expected {
        return Err(format!("{size} bytes where the header says {expected}"));
    }
    Ok(head)
}

/// The file size a header implies (`u64::MAX` for a header no snapshot has:
/// halves other than 1 or 2, or sizes that overflow).
fn expected_len(head: &[u8]) -> u64 {
    let (n, layers, width, halves, state_layers, state_floats, copies) = (
        u64::from(u32_at(head, 40)),
        u64::from(u32_at(head, 44)),
        u64::from(u32_at(head, 48)),
        u64::from(u32_at(head, 52)),
        u64::from(u32_at(head, 56)),
        u64::from(u32_at(head, 60)),
        u64::from(u32_at(head, 64)),
    );
    if !(1..=2).contains(&halves) || copies > 2 || state_layers > layers || (copies == 2 && n == 0)
    {
        return u64::MAX;
    }
    let states = state_floats.checked_mul(copies);
    n.checked_mul(width)
        .and_then(|x| x.checked_mul(layers - state_layers))
        .and_then(|x| x.checked_mul(halves))
        .and_then(|x| x.checked_add(n))
        .and_then(|x| x.checked_add(states?))
        .and_then(|x| x.checked_mul(4))
        .and_then(|x| x.checked_add(HEADER as u64 + 32))
        .unwrap_or(u64::MAX)
}

/// The positions of `prefix` from the snapshot at `path` (checked whole) as a cache
/// like `like`: read a layer's keys (then values) at a time, hashing as it goes;
/// the cache built is returned only when the whole file's blake3 matches and its
/// ids begin with `prefix`, all of it (a file renamed over another's, or replaced
/// since it was indexed, holds another prompt's KV: never used for this one).
fn read(path: &Path, key: &[u8; 32], like: &KvCache, prefix: &[u32]) -> Result<KvCache, String> {
    let len = prefix.len();
    let f = voom_formats::file::open(path).map_err(|e| e.to_string())?;
    let size = f.metadata().map_err(|e| e.to_string())?.len();
    let mut f = std::io::BufReader::with_capacity(1 << 20, f);
    let head = header(&mut f, size, key)?;
    let (n, layers, width, halves) = (
        u32_at(&head, 40) as usize,
        u32_at(&head, 44) as usize,
        u32_at(&head, 48) as usize,
        u32_at(&head, 52) as usize,
    );
    let (state_layers, state_floats, copies) = (
        u32_at(&head, 56) as usize,
        u32_at(&head, 60) as usize,
        u32_at(&head, 64) as usize,
    );
    if layers != like.layers()
        || width != like.width()
        || (state_layers, state_floats) != like.state_layout()
        || (copies > 0) != like.has_states()
    {
        return Err("its layout is not this model's".into());
    }
    let mut hash = blake3::Hasher::new();
    hash.update(&head);
    let mut take = |buf: &mut Vec<u8>, bytes: usize| -> Result<(), String> {
        buf.resize(bytes, 0);
        f.read_exact(buf).map_err(|e| e.to_string())?;
        hash.update(buf);
        Ok(())
    };
    let mut buf = Vec::new();
    take(&mut buf, 4 * n)?;
    // What was asked for (a cache of a smaller context may take a prefix of a
    // longer snapshot; one with states, only where a copy of them is).
    if len > n || len > like.capacity() {
        return Err(format!(
            "it holds {n} positions where {len} were asked for (replaced since it was indexed?)"
        ));
    }
    if let Some(at) = at_of(&head) {
        if !at.contains(&len) {
            return Err(format!("its recurrent state is not at position {len}"));
        }
    }
    let ids: Vec<u32> = buf[..4 * len]
        .chunks_exact(4)
        .map(|c| u32_at(c, 0))
        .collect();
    if let Some(at) = ids.iter().zip(prefix).position(|(a, b)| a != b) {
        return Err(format!(
            "its ids are not the prompt's (they differ at position {at}): another prompt's snapshot"
        ));
    }
    let mut kv = like.clone();
    kv.clear();
    let floats = |b: &[u8], count: usize| -> Vec<f32> {
        b[..4 * count]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    for l in (0..layers).filter(|&l| !like.is_state_layer(l)) {
        take(&mut buf, 4 * n * width)?;
        let k = floats(&buf, len * width);
        let v = if halves == 2 {
            take(&mut buf, 4 * n * width)?;
            floats(&buf, len * width)
        } else {
            Vec::new()
        };
        kv.append(l, &k, &v).map_err(|e| e.to_string())?;
    }
    let mut copies_read = Vec::new();
    for _ in 0..copies {
        take(&mut buf, 4 * state_floats)?;
        copies_read.push(floats(&buf, state_floats));
    }
    let mut tail = [0u8; 32];
    f.read_exact(&mut tail).map_err(|e| e.to_string())?;
    if hash.finalize().as_bytes() != &tail {
        return Err("its blake3 does not match".into());
    }
    kv.commit(&ids);
    match (copies_read.as_slice(), len == n) {
        ([], _) => {}
        ([now], _) => kv.import_states(now, None)?,
        ([now, before], true) => kv.import_states(now, Some((n - 1, before)))?,
        ([_, before], false) => kv.import_states(before, None)?,
        _ => return Err("more recurrent state copies than a snapshot has".into()),
    }
    Ok(kv)
}

/// A little-endian u32 of `b` at `at`.
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv_of(n: usize, seed: f32) -> KvCache {
        let mut kv = KvCache::with_page(3, 4, 1000, 16);
        for l in 0..3 {
            let k: Vec<f32> = (0..n * 4)
                .map(|i| seed + (l * 1000 + i) as f32 * 0.5)
                .collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            kv.append(l, &k, &v).unwrap();
        }
        kv.commit(&vec![0; n]);
        kv
    }

    fn bits(kv: &KvCache) -> Vec<u32> {
        let mut out = Vec::new();
        for l in 0..kv.layers() {
            let v = kv.layer(l).unwrap();
            for pages in [&v.k, &v.v] {
                for (p, off, m) in v.segments(0, v.len) {
                    out.extend(pages[p][off * 4..(off + m) * 4].iter().map(|x| x.to_bits()));
                }
            }
        }
        out
    }

    fn cfg(dir: &Path) -> DiskPrefixes {
        DiskPrefixes {
            dir: dir.to_path_buf(),
            budget: 1 << 20,
            min_tokens: 8,
        }
    }

    #[test]
    fn a_snapshot_comes_back_bit_for_bit_after_a_restart() {
        let d = tempfile::tempdir().unwrap();
        let key = key_of(b"manifest", b"{}", 3, 4);
        let ids: Vec<u32> = (0..40).collect();
        let kv = kv_of(40, 0.25);
        let s = SnapshotDir::open(cfg(d.path()), key).unwrap();
        s.save(&ids, &kv);
        // Asked again while queued: one write.
        s.save(&ids, &kv);
        s.save(&ids[..30], &kv);
        s.flush();
        assert_eq!(s.held().0, 1);
        assert_eq!(std::fs::read_dir(&s.dir).unwrap().count(), 1);
        drop(s);
        // A new process: indexed from the files.
        let s = SnapshotDir::open(cfg(d.path()), key).unwrap();
        let like = KvCache::with_page(3, 4, 1000, 7);
        let mut prompt = ids.clone();
        prompt.extend([99, 98]);
        let got = s.take(&prompt, 8, &like).unwrap();
        assert_eq!(got.len(), 40);
        assert_eq!(bits(&got), bits(&kv));
        // A cache of a smaller context takes what it asks for; the file stays.
        let small = KvCache::with_page(3, 4, 30, 16);
        let got = s.take(&ids[..25], 8, &small).unwrap();
        assert_eq!(got.len(), 24);
        assert_eq!(s.held().0, 1);
        // Another config (rope scaling, routing...) is another key.
        assert_ne!(key, key_of(b"manifest", br#"{"rope_theta": 1}"#, 3, 4));
        // Another model or arithmetic: nothing.
        let other = SnapshotDir::open(cfg(d.path()), key_of(b"other", b"{}", 3, 4)).unwrap();
        assert!(other.take(&prompt, 8, &like).is_none());
        // Too short a match.
        assert!(s.take(&[0, 1, 2, 3, 7, 7, 7, 7, 7, 7], 8, &like).is_none());
    }

    /// A hybrid model's cache (recurrent states in layer 1): its snapshot holds the
    /// state as of its length and, where its last pass started one position before,
    /// as of that one; it serves exactly those lengths, with the states they had,
    /// and is never taken for a cache without states (nor one of those for it).
    #[test]
    fn recurrent_states_come_back_where_they_were_kept() {
        use crate::kv::StateShape;
        let d = tempfile::tempdir().unwrap();
        let s = SnapshotDir::open(cfg(d.path()), key_of(b"m", b"{}", 3, 4)).unwrap();
        let ids: Vec<u32> = (0..40).collect();
        let shapes = [None, Some(StateShape { conv: 2, matrix: 3 }), None];
        let like = KvCache::with_page(3, 4, 1000, 16).with_states(&shapes);
        let mut hybrid = like.clone();
        let pass = |kv: &mut KvCache, ids: &[u32]| {
            for l in [0, 2] {
                let k: Vec<f32> = ids.iter().flat_map(|&i| [i as f32 + l as f32; 4]).collect();
                kv.append(l, &k, &k).unwrap();
            }
            for &i in ids {
                let st = kv.state_mut(1).unwrap();
                st.matrix.iter_mut().for_each(|m| *m = *m * 0.5 + i as f32);
                st.conv.iter_mut().for_each(|c| *c += 1.0);
            }
            kv.commit(ids);
        };
        pass(&mut hybrid, &ids[..39]);
        let at39 = hybrid.state(1).unwrap().clone();
        pass(&mut hybrid, &ids[39..]);
        let at40 = hybrid.state(1).unwrap().clone();
        s.save(&ids, &hybrid);
        s.flush();
        assert_eq!(s.held().0, 1);
        drop(s);
        let s = SnapshotDir::open(cfg(d.path()), key_of(b"m", b"{}", 3, 4)).unwrap();
        // An exact repeat: 39 positions, the state before the last.
        let got = s.take(&ids, 8, &like).unwrap();
        assert_eq!((got.len(), got.state(1)), (39, Some(&at39)));
        assert_eq!(
            bits(&got),
            bits(&{
                let mut k = hybrid.clone();
                k.truncate(39);
                k
            })
        );
        // An extension: all 40, the state at the end, and the one before kept.
        let mut longer = ids.clone();
        longer.extend([7, 7]);
        let mut got = s.take(&longer, 8, &like).unwrap();
        assert_eq!((got.len(), got.state(1)), (40, Some(&at40)));
        got.truncate(39);
        assert_eq!((got.lost(), got.state(1)), (None, Some(&at39)));
        // A shared beginning only: nothing (the state cannot be cut back to 20).
        let mut other = ids[..20].to_vec();
        other.extend([300; 30]);
        assert!(s.take(&other, 8, &like).is_none());
        // Not for a cache without states, nor theirs for a hybrid.
        assert!(s
            .take(&longer, 8, &KvCache::with_page(3, 4, 1000, 16))
            .is_none());
        s.save(&(100..140).collect::<Vec<_>>(), &kv_of(40, 0.5));
        s.flush();
        assert!(s.take(&(100..150).collect::<Vec<_>>(), 8, &like).is_none());
        // A state cut back before its cache's length is not written.
        let mut cut = hybrid.clone();
        cut.truncate(30);
        s.save(&ids[..30], &cut);
        s.flush();
        assert_eq!(s.held().0, 2);
    }

    #[test]
    fn a_directory_others_can_write_is_not_used() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("prefixes");
        std::fs::create_dir(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = SnapshotDir::open(cfg(&root), [7; 32]).err().unwrap();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
        assert!(e.to_string().contains("writable by others"), "{e}");
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(SnapshotDir::open(cfg(&root), [7; 32]).is_ok());
    }

    #[test]
    fn a_damaged_or_truncated_snapshot_is_deleted_never_used() {
        let key = key_of(b"m", b"{}", 3, 4);
        let ids: Vec<u32> = (0..20).collect();
        for damage in ["flip", "truncate"] {
            let d = tempfile::tempdir().unwrap();
            let s = SnapshotDir::open(cfg(d.path()), key).unwrap();
            s.save(&ids, &kv_of(20, 1.0));
            s.flush();
            let file = std::fs::read_dir(&s.dir)
                .unwrap()
                .next()
                .unwrap()
                .unwrap()
                .path();
            let mut b = std::fs::read(&file).unwrap();
            match damage {
                "flip" => {
                    let at = b.len() / 2;
                    b[at] ^= 0x10;
                }
                _ => b.truncate(b.len() - 5),
            }
            std::fs::write(&file, &b).unwrap();
            let like = KvCache::with_page(3, 4, 1000, 16);
            let mut prompt = ids.clone();
            prompt.push(5);
            // A flipped byte is found reading it whole; a truncated file at once.
            let s = SnapshotDir::open(cfg(d.path()), key).unwrap();
            assert!(s.take(&prompt, 8, &like).is_none(), "{damage}");
            assert!(!file.exists(), "{damage}: the damaged file stays");
            assert_eq!(s.held().0, 0);
        }
    }

    #[test]
    fn the_directory_stays_within_its_budget_and_extensions_replace_prefixes() {
        let d = tempfile::tempdir().unwrap();
        let key = key_of(b"m", b"{}", 3, 4);
        let mut bytes = Vec::new();
        let one = encode(
            &mut bytes,
            &key,
            &(0..20).collect::<Vec<_>>(),
            &kv_of(20, 0.0),
        )
        .ok()
        .unwrap();
        assert_eq!(one, bytes.len() as u64);
        let s = SnapshotDir::open(
            DiskPrefixes {
                budget: 2 * one,
                ..cfg(d.path())
            },
            key,
        )
        .unwrap();
        for k in 0..3u32 {
            let ids: Vec<u32> = (0..20).map(|i| i + 100 * k).collect();
            s.save(&ids, &kv_of(20, k as f32));
        }
        s.flush();
        let (n, bytes) = s.held();
        assert_eq!(n, 2);
        assert!(bytes <= 2 * one);
        assert_eq!(std::fs::read_dir(&s.dir).unwrap().count(), 2);
        // An extension of a held snapshot replaces it.
        let ids: Vec<u32> = (200..230).collect();
        s.save(&ids, &kv_of(30, 2.0));
        s.flush();
        assert!(s
            .lock()
            .index
            .iter()
            .all(|e| e.ids.len() == 30 || e.ids[0] != 200));
    }

    #[test]
    fn a_failed_write_turns_persistence_off_and_loses_nothing() {
        let d = tempfile::tempdir().unwrap();
        let s = SnapshotDir::open(cfg(d.path()), key_of(b"m", b"{}", 3, 4)).unwrap();
        // The directory is gone: the write fails.
        std::fs::remove_dir_all(&s.dir).unwrap();
        s.save(&(0..20).collect::<Vec<_>>(), &kv_of(20, 0.0));
        s.flush();
        assert!(s.off().is_some());
        assert_eq!(s.held().0, 0);
    }
}

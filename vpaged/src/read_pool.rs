//! Reads with many pieces in flight.
//!
//! A storage device reaches its bandwidth only with several reads queued: measured
//! here (fio, `O_DIRECT`, 8 MiB reads), one read at a time gives less than half of
//! what sixteen in flight give (NVMe drives reward queued reads too). A [`ReadPool`] splits
//! one extent into pieces and reads them on its threads at once, each into its own
//! aligned bounce buffer (direct reads) or straight into the destination (buffered
//! reads), and returns when every piece has landed. Threads blocked on storage cost
//! no compute, so the pool can be wider than the machine has cores.
//!
//! Two queues: pieces of demand reads (an engine waiting on the page) are taken before
//! pieces of hinted reads, so a demand read never waits behind prefetches that were
//! queued before it, only behind the pieces already being read. A read is a hint when
//! it is issued from a thread marked with [`mark_hint_thread`] (the store's prefetch
//! loaders).
//!
//! Pages that lie next to each other in a file are read as one run
//! ([`ReadPool::submit_run`]): the run is cut into pieces on piece boundaries of the
//! file, whatever the pages' own boundaries, and a piece that holds the end of one
//! page and the start of the next is one read whose bytes are copied to both. Each
//! page still completes on its own, when the last piece holding any of it lands. So a
//! layer streams in requests of a whole piece, not one short request at the end of
//! each page (measured before: 1.7 MiB per request for 2 MiB pieces). A run queued
//! where the last piece still queued ends (the next page of a sweep that hints a page
//! at a time) goes on from that piece: the piece they share is one read.
//!
//! The order pieces land in never matters: the caller sees the extent only once all of
//! it is there, and a failed piece fails the whole read (the first error is returned,
//! after every piece still in flight has finished, so nothing writes into the
//! caller's buffer once the call has returned).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::direct::{AlignedBuf, DirectFile, ReadMode, DIRECT_ALIGN};

/// Default bytes of one piece.
pub const DEFAULT_PIECE: usize = 2 << 20;
/// Default reader threads: reads in flight.
pub const DEFAULT_THREADS: usize = 16;

thread_local! {
    /// Whether reads issued from this thread are hints (queued behind demand reads).
    static HINT_THREAD: Cell<bool> = const { Cell::new(false) };
    /// This thread's bounce buffer for direct reads.
    static BOUNCE: RefCell<Option<AlignedBuf>> = const { RefCell::new(None) };
}

/// Marks the current thread's reads as hints: their pieces wait behind demand reads'.
pub fn mark_hint_thread() {
    HINT_THREAD.with(|h| h.set(true));
}

fn is_hint_thread() -> bool {
    HINT_THREAD.with(|h| h.get())
}

/// A pool of reader threads (see the module docs).
pub struct ReadPool {
    shared: Arc<Shared>,
    threads: usize,
    piece: usize,
}

struct Shared {
    queues: Mutex<Queues>,
    ready: Condvar,
}

#[derive(Default)]
struct Queues {
    demand: VecDeque<Piece>,
    hint: VecDeque<Piece>,
    closed: bool,
}

/// One piece of a run: `len` bytes of `file` at `offset`, its ranges each going to
/// one read's buffer.
struct Piece {
    file: Arc<DirectFile>,
    offset: u64,
    len: usize,
    targets: Vec<Target>,
}

impl Piece {
    /// Whether `next` starts in the same file where this piece ends, and the two
    /// together are no longer than a piece: a run queued after another that ended
    /// inside a piece (pages hinted one step at a time, each its own run) goes on
    /// from it, so the piece both share is one read, not two short ones.
    fn continues(&self, next: &Piece, piece_bytes: usize) -> bool {
        Arc::ptr_eq(&self.file, &next.file)
            && self.offset + self.len as u64 == next.offset
            && self.len + next.len <= piece_bytes
    }

    /// Takes `next` ([`Piece::continues`]) into this piece: its bytes follow this
    /// piece's, and its targets with them.
    fn absorb(&mut self, next: Piece) {
        let shift = self.len;
        self.len += next.len;
        self.targets.extend(next.targets.into_iter().map(|mut t| {
            t.at += shift;
            t
        }));
    }
}

/// A range of a piece (`at..at + len` of it) and where it goes: `dst`, in the buffer of
/// the read `read`.
struct Target {
    at: usize,
    len: usize,
    dst: Dst,
    read: Arc<Group>,
}

/// Where a range of a piece goes: a range of its reader's buffer.
struct Dst(*mut u8);

// SAFETY: a `Dst` points into the buffer of a read whose issuer keeps it valid and
// untouched until the read's completion runs (`ReadPool::read` blocks until then;
// `ReadPool::submit`'s caller promises it); pieces cover disjoint ranges of that
// buffer, so each is written by exactly one thread.
unsafe impl Send for Dst {}

/// What runs when a read's last piece has finished, with the read's result.
pub type Then = Box<dyn FnOnce(io::Result<()>) + Send>;

/// One read (a page of a run): how many of the pieces holding its bytes are left, the
/// first error, and what runs once none is left.
struct Group {
    state: Mutex<GroupState>,
}

struct GroupState {
    left: usize,
    error: Option<io::Error>,
    then: Option<Then>,
}

impl Group {
    fn lock(&self) -> MutexGuard<'_, GroupState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn failed(&self) -> bool {
        self.lock().error.is_some()
    }

    /// Counts one piece done; the last runs the completion (outside the lock).
    fn finish(&self, r: io::Result<()>) {
        let done = {
            let mut st = self.lock();
            if let Err(e) = r {
                st.error.get_or_insert(e);
            }
            st.left -= 1;
            if st.left == 0 {
                let result = match st.error.take() {
                    Some(e) => Err(e),
                    None => Ok(()),
                };
                st.then.take().map(|t| (t, result))
            } else {
                None
            }
        };
        if let Some((then, result)) = done {
            run_then(then, result);
        }
    }
}

/// Runs a completion; a panic in it is contained (the reader thread goes on).
fn run_then(then: Then, result: io::Result<()>) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| then(result))).is_err() {
        tracing::error!("a read's completion panicked");
    }
}

impl ReadPool {
    /// A pool of `threads` readers reading pieces of `piece` bytes (rounded up to
    /// [`DIRECT_ALIGN`]). With `threads == 0` every read runs on its caller's thread.
    pub fn new(threads: usize, piece: usize) -> io::Result<ReadPool> {
        let piece = piece.max(1).next_multiple_of(DIRECT_ALIGN);
        let shared = Arc::new(Shared {
            queues: Mutex::new(Queues::default()),
            ready: Condvar::new(),
        });
        for i in 0..threads {
            let s = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("vpaged-read-{i}"))
                .spawn(move || s.serve(piece))?;
        }
        Ok(ReadPool {
            shared,
            threads,
            piece,
        })
    }

    /// Reader threads (reads in flight at most).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Bytes of one piece.
    pub fn piece(&self) -> usize {
        self.piece
    }

    /// Reads `buf.len()` bytes of `file` at `offset` into `buf`, in pieces read at
    /// once by the pool. An extent of one piece (or a pool without threads) is read
    /// on this thread. Errors: the first piece's error (a short file is
    /// `UnexpectedEof`), after every piece has finished.
    pub fn read(&self, file: &Arc<DirectFile>, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let to_boundary = self.piece - (offset % self.piece as u64) as usize;
        if self.threads == 0 || buf.len() <= to_boundary {
            return read_piece(file, offset, buf, self.piece);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        // SAFETY: `buf` stays borrowed, and untouched, until the completion has
        // sent the result: this call blocks on it below.
        unsafe {
            self.submit(
                file,
                offset,
                buf.as_mut_ptr(),
                buf.len(),
                !is_hint_thread(),
                move |r| {
                    let _ = tx.send(r);
                },
            );
        }
        rx.recv()
            .unwrap_or_else(|_| Err(io::Error::other("a read's completion was lost")))
    }

    /// Queues a read of `len` bytes of `file` at `offset` into `dst`, in pieces, and
    /// returns at once; `then` runs with the result on the thread that finished the
    /// last piece (on this thread, before returning, for a pool without threads or an
    /// empty read). `demand`: queued before hints. `then` should be short (it holds a
    /// reader): verify a page, publish it.
    ///
    /// # Safety
    /// `dst..dst + len` must be valid for writes, and neither read nor written by
    /// anything else, until `then` starts.
    pub unsafe fn submit(
        &self,
        file: &Arc<DirectFile>,
        offset: u64,
        dst: *mut u8,
        len: usize,
        demand: bool,
        then: impl FnOnce(io::Result<()>) + Send + 'static,
    ) {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            self.submit_run(
                file,
                offset,
                vec![RunPart {
                    dst,
                    len,
                    then: Box::new(then),
                }],
                demand,
            )
        };
    }

    /// Queues reads of pages that lie one after another in `file` from `offset`
    /// (`parts[0]` there, each next one where the one before ends), as one run cut on
    /// the pool's piece boundaries (see the module docs), and returns at once. Each
    /// part's `then` runs with its own result on the thread that finished the last
    /// piece holding any of its bytes; a failed piece fails every part it holds.
    ///
    /// # Safety
    /// Each part's `dst..dst + len` must be valid for writes, and neither read nor
    /// written by anything else, until its `then` starts.
    pub unsafe fn submit_run(
        &self,
        file: &Arc<DirectFile>,
        offset: u64,
        parts: Vec<RunPart>,
        demand: bool,
    ) {
        let total: usize = parts.iter().map(|p| p.len).sum();
        if self.threads == 0 || total == 0 {
            let mut at = offset;
            for p in parts {
                // SAFETY: the caller's contract: `dst` is valid and exclusive for `len`.
                let buf = unsafe { std::slice::from_raw_parts_mut(p.dst, p.len) };
                run_then(p.then, read_piece(file, at, buf, self.piece));
                at += p.len as u64;
            }
            return;
        }
        let pieces = split(offset, total, self.piece);
        // Each part's extent within the run and its read (an empty part has nothing to
        // read: it completes now).
        let mut reads: Vec<(usize, usize, *mut u8, Arc<Group>)> = Vec::with_capacity(parts.len());
        let mut at = 0usize;
        for p in parts {
            if p.len == 0 {
                run_then(p.then, Ok(()));
                continue;
            }
            let group = Group {
                state: Mutex::new(GroupState {
                    left: 0,
                    error: None,
                    then: Some(p.then),
                }),
            };
            reads.push((at, p.len, p.dst, Arc::new(group)));
            at += p.len;
        }
        // Parts and pieces both run in file order: walk them together, counting for
        // each read the pieces that hold some of it. The counts are final before any
        // piece is queued, so no read completes early.
        let mut queued = Vec::with_capacity(pieces.len());
        let mut first = 0usize;
        for (ps, pn) in pieces {
            while first < reads.len() && reads[first].0 + reads[first].1 <= ps {
                first += 1;
            }
            let mut targets = Vec::with_capacity(1);
            for (s, n, dst, read) in &reads[first..] {
                if *s >= ps + pn {
                    break;
                }
                let (lo, hi) = ((*s).max(ps), (s + n).min(ps + pn));
                read.lock().left += 1;
                targets.push(Target {
                    at: lo - ps,
                    len: hi - lo,
                    // SAFETY: `lo - s + (hi - lo) <= n`: the pointer stays inside the
                    // part's range.
                    dst: Dst(unsafe { dst.add(lo - s) }),
                    read: Arc::clone(read),
                });
            }
            queued.push(Piece {
                file: Arc::clone(file),
                offset: offset + ps as u64,
                len: pn,
                targets,
            });
        }
        {
            let mut q = self.shared.lock();
            let queue = if demand { &mut q.demand } else { &mut q.hint };
            let mut queued = queued.into_iter();
            if let Some(first) = queued.next() {
                match queue.back_mut() {
                    Some(last) if last.continues(&first, self.piece) => last.absorb(first),
                    _ => queue.push_back(first),
                }
            }
            queue.extend(queued);
        }
        self.shared.ready.notify_all();
    }
}

/// One page of a run ([`ReadPool::submit_run`]): where its bytes go, how many, and
/// what runs once they are there.
pub struct RunPart {
    pub dst: *mut u8,
    pub len: usize,
    pub then: Then,
}

impl Drop for ReadPool {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.ready.notify_all();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A reader thread: takes demand pieces first, then hints, until the pool closes.
    fn serve(&self, piece_bytes: usize) {
        loop {
            let piece = {
                let mut q = self.lock();
                loop {
                    if let Some(p) = q.demand.pop_front().or_else(|| q.hint.pop_front()) {
                        break p;
                    }
                    if q.closed {
                        return;
                    }
                    q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            // Reads that already failed have nothing to gain from their other pieces.
            let r = if piece.targets.iter().all(|t| t.read.failed()) {
                Ok(())
            } else {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    read_targets(&piece, piece_bytes)
                }))
                .unwrap_or_else(|_| Err(io::Error::other("a reader thread panicked")))
            };
            for t in &piece.targets {
                t.read.finish(match &r {
                    Ok(()) => Ok(()),
                    Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
                });
            }
        }
    }
}

/// Splits `len` bytes at file offset `offset` into pieces of at most `piece` bytes
/// whose boundaries fall on multiples of `piece` in the file (so that direct reads
/// widen only the first and last): (start within the extent, length).
fn split(offset: u64, len: usize, piece: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(len / piece + 2);
    let mut at = 0usize;
    while at < len {
        let pos = offset + at as u64;
        let to_boundary = piece - (pos % piece as u64) as usize;
        let n = to_boundary.min(len - at);
        out.push((at, n));
        at += n;
    }
    out
}

/// Reads a piece into its targets on this thread: one target of the whole piece as
/// [`read_piece`] does; several (a piece holding the end of one page and the start of
/// the next) as one read of the piece whose bytes are copied to each (buffered: each
/// straight into its target; the page cache reads the piece once).
fn read_targets(piece: &Piece, piece_bytes: usize) -> io::Result<()> {
    let dst = |t: &Target| {
        // SAFETY: see `Dst`: this range of its read's buffer is this piece's alone
        // until that read's completion runs, after this piece.
        unsafe { std::slice::from_raw_parts_mut(t.dst.0, t.len) }
    };
    match piece.targets.as_slice() {
        [t] if t.at == 0 && t.len == piece.len => {
            read_piece(&piece.file, piece.offset, dst(t), piece_bytes)
        }
        targets => match piece.file.mode() {
            ReadMode::Buffered => targets.iter().try_for_each(|t| {
                piece
                    .file
                    .file()
                    .read_exact_at(dst(t), piece.offset + t.at as u64)
            }),
            ReadMode::Direct => BOUNCE.with(|b| {
                let mut b = b.borrow_mut();
                let bounce = bounce_of(&mut b, piece_bytes);
                let got = piece.file.read_at(piece.offset, piece.len, bounce)?;
                for t in targets {
                    dst(t).copy_from_slice(&got[t.at..t.at + t.len]);
                }
                Ok(())
            }),
        },
    }
}

/// This thread's bounce buffer, of at least a piece and its alignment margins.
fn bounce_of(b: &mut Option<AlignedBuf>, piece: usize) -> &mut AlignedBuf {
    let cap = piece + 2 * DIRECT_ALIGN;
    if b.as_ref().is_none_or(|b| b.capacity() < cap) {
        *b = Some(AlignedBuf::new(cap));
    }
    b.as_mut().expect("allocated above")
}

/// Reads `dst.len()` bytes of `file` at `offset` on this thread: buffered straight
/// into `dst`, direct in pieces of at most `piece` bytes, each straight into `dst`
/// where `dst` is aligned as the file is ([`DirectFile::read_into`]), else through
/// this thread's bounce buffer.
fn read_piece(file: &DirectFile, offset: u64, dst: &mut [u8], piece: usize) -> io::Result<()> {
    match file.mode() {
        ReadMode::Buffered => file.file().read_exact_at(dst, offset),
        ReadMode::Direct => BOUNCE.with(|b| {
            let mut b = b.borrow_mut();
            let bounce = bounce_of(&mut b, piece);
            let mut done = 0usize;
            while done < dst.len() {
                let pos = offset + done as u64;
                let to_boundary = piece - (pos % piece as u64) as usize;
                let n = (dst.len() - done).min(to_boundary);
                file.read_into(pos, &mut dst[done..done + n], bounce)?;
                done += n;
            }
            Ok(())
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_extent_on_piece_boundaries() {
        for (offset, len, piece) in [(0u64, 10usize, 4usize), (3, 10, 4), (4, 8, 4), (7, 1, 4)] {
            let p = split(offset, len, piece);
            assert_eq!(p.iter().map(|x| x.1).sum::<usize>(), len);
            let mut at = 0;
            for (i, &(s, n)) in p.iter().enumerate() {
                assert_eq!(s, at);
                assert!(n > 0 && n <= piece);
                if i > 0 {
                    assert_eq!((offset + s as u64) % piece as u64, 0);
                }
                at += n;
            }
        }
        assert!(split(5, 0, 4).is_empty());
    }

    fn data_file(len: usize) -> (tempfile::TempDir, std::path::PathBuf, Vec<u8>) {
        let d = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..len)
            .map(|i| (i % 253) as u8 ^ (i >> 13) as u8)
            .collect();
        let path = d.path().join("m.bin");
        std::fs::write(&path, &data).unwrap();
        (d, path, data)
    }

    /// Every mode, pool width and extent gives the file's bytes.
    #[test]
    fn reads_give_the_files_bytes_whatever_the_pool() {
        let piece = 2 * DIRECT_ALIGN;
        let len = 9 * piece + 777;
        let (_d, path, data) = data_file(len);
        for mode in [ReadMode::Buffered, ReadMode::Direct] {
            let file = Arc::new(DirectFile::open(&path, mode).unwrap());
            for threads in [0, 1, 3, 8] {
                let pool = ReadPool::new(threads, piece).unwrap();
                for (offset, n) in [
                    (0usize, 1usize),
                    (5, piece),
                    (piece - 1, 3 * piece + 2),
                    (12345, len - 12345),
                    (len - 9, 9),
                ] {
                    let mut buf = vec![0u8; n];
                    pool.read(&file, offset as u64, &mut buf).unwrap();
                    assert!(
                        buf == data[offset..offset + n],
                        "{mode:?} {threads} threads {offset}+{n}"
                    );
                }
            }
        }
    }

    /// Pieces of a huge page and more (bounce buffers that are mappings of their own)
    /// give the file's bytes too.
    #[test]
    fn huge_pieces_give_the_files_bytes() {
        let piece = 2 << 20;
        let len = 5 * piece / 2 + 777;
        let (_d, path, data) = data_file(len);
        for mode in [ReadMode::Direct, ReadMode::Buffered] {
            let file = Arc::new(DirectFile::open(&path, mode).unwrap());
            for threads in [0, 3] {
                let pool = ReadPool::new(threads, piece).unwrap();
                let (offset, n) = (4097, len - 5000);
                let mut buf = vec![0u8; n];
                pool.read(&file, offset as u64, &mut buf).unwrap();
                assert!(buf == data[offset..offset + n], "{mode:?} {threads}");
            }
        }
    }

    /// Submits `lens` as one run at `offset` and waits: each part's buffer and result.
    fn run_of(
        pool: &ReadPool,
        file: &Arc<DirectFile>,
        offset: u64,
        lens: &[usize],
    ) -> Vec<(Vec<u8>, io::Result<()>)> {
        let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
        let (tx, rx) = std::sync::mpsc::channel();
        let parts = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| {
                let tx = tx.clone();
                RunPart {
                    dst: b.as_mut_ptr(),
                    len: b.len(),
                    then: Box::new(move |r| {
                        let _ = tx.send((i, r));
                    }),
                }
            })
            .collect();
        // SAFETY: every buffer outlives its completion (all are received below) and
        // nothing else touches it meanwhile.
        unsafe { pool.submit_run(file, offset, parts, true) };
        let mut results: Vec<Option<io::Result<()>>> = lens.iter().map(|_| None).collect();
        for _ in lens {
            let (i, r) = rx.recv().unwrap();
            assert!(results[i].replace(r).is_none(), "part {i} completed twice");
        }
        bufs.into_iter()
            .zip(results)
            .map(|(b, r)| (b, r.unwrap()))
            .collect()
    }

    /// Pages one after another read as one run: each gets its own bytes, whatever the
    /// mode, the pool's width, and where the pages' ends fall in the pieces (within
    /// one, across several, on a boundary, an empty page).
    #[test]
    fn a_run_gives_each_part_its_bytes() {
        let piece = 2 * DIRECT_ALIGN;
        let lens = [1, piece - 3, 5, 3 * piece + 7, 0, piece, 11, 2 * piece];
        let total: usize = lens.iter().sum();
        let (_d, path, data) = data_file(total + 3 * piece);
        for mode in [ReadMode::Buffered, ReadMode::Direct] {
            let file = Arc::new(DirectFile::open(&path, mode).unwrap());
            for threads in [0, 1, 3, 8] {
                let pool = ReadPool::new(threads, piece).unwrap();
                for offset in [0usize, 4097, piece] {
                    let mut at = offset;
                    for (i, (buf, r)) in run_of(&pool, &file, offset as u64, &lens)
                        .into_iter()
                        .enumerate()
                    {
                        r.unwrap();
                        assert!(
                            buf == data[at..at + lens[i]],
                            "{mode:?} {threads} threads, run at {offset}, part {i}"
                        );
                        at += lens[i];
                    }
                }
            }
        }
    }

    /// Pages hinted one at a time, each its own run right after the one before: every
    /// page gets its bytes, whether its first piece went on from the last one queued
    /// or not (one reader, busy with a demand read queued first, leaves the hints
    /// queued so that they do).
    #[test]
    fn runs_queued_one_after_another_give_each_page_its_bytes() {
        let piece = 2 * DIRECT_ALIGN;
        let lens = [piece / 3, piece - 5, 7, 2 * piece + 1, piece / 2, piece];
        let total: usize = lens.iter().sum();
        let (_d, path, data) = data_file(total + 4 * piece + 16 * piece);
        for mode in [ReadMode::Buffered, ReadMode::Direct] {
            let file = Arc::new(DirectFile::open(&path, mode).unwrap());
            for threads in [1, 4] {
                let pool = ReadPool::new(threads, piece).unwrap();
                let (tx, rx) = std::sync::mpsc::channel();
                let mut busy = vec![0u8; 16 * piece];
                let t = tx.clone();
                // SAFETY: `busy` outlives the read: its completion is received below.
                unsafe {
                    pool.submit(&file, 0, busy.as_mut_ptr(), busy.len(), true, move |r| {
                        let _ = t.send((usize::MAX, r));
                    })
                };
                let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
                let mut at = 16 * piece + 4097;
                for (i, b) in bufs.iter_mut().enumerate() {
                    let t = tx.clone();
                    let part = RunPart {
                        dst: b.as_mut_ptr(),
                        len: b.len(),
                        then: Box::new(move |r| {
                            let _ = t.send((i, r));
                        }),
                    };
                    // SAFETY: every buffer outlives its completion (all are received
                    // below) and nothing else touches it meanwhile.
                    unsafe { pool.submit_run(&file, at as u64, vec![part], false) };
                    at += lens[i];
                }
                for _ in 0..=lens.len() {
                    let (_, r) = rx.recv().unwrap();
                    r.unwrap();
                }
                assert!(busy == data[..16 * piece]);
                let mut at = 16 * piece + 4097;
                for (i, b) in bufs.iter().enumerate() {
                    assert!(
                        *b == data[at..at + lens[i]],
                        "{mode:?} {threads} threads, page {i}"
                    );
                    at += lens[i];
                }
            }
        }
    }

    /// A piece goes on from another only in the same file, right where it ends, and
    /// within a piece's bytes; the targets it takes follow the first piece's bytes.
    #[test]
    fn a_piece_continues_only_the_one_it_follows() {
        let (_d, path, _) = data_file(1 << 20);
        let f = Arc::new(DirectFile::open(&path, ReadMode::Buffered).unwrap());
        let g = Arc::new(DirectFile::open(&path, ReadMode::Buffered).unwrap());
        let group = Arc::new(Group {
            state: Mutex::new(GroupState {
                left: 0,
                error: None,
                then: None,
            }),
        });
        let piece = |file: &Arc<DirectFile>, offset: u64, len: usize| Piece {
            file: Arc::clone(file),
            offset,
            len,
            targets: vec![Target {
                at: 0,
                len,
                dst: Dst(std::ptr::null_mut()),
                read: Arc::clone(&group),
            }],
        };
        let mut a = piece(&f, 100, 10);
        assert!(a.continues(&piece(&f, 110, 20), 30));
        assert!(!a.continues(&piece(&f, 110, 21), 30), "longer than a piece");
        assert!(!a.continues(&piece(&f, 111, 5), 30), "a gap");
        assert!(!a.continues(&piece(&g, 110, 5), 30), "another file");
        a.absorb(piece(&f, 110, 20));
        assert_eq!((a.offset, a.len), (100, 30));
        let ats: Vec<(usize, usize)> = a.targets.iter().map(|t| (t.at, t.len)).collect();
        assert_eq!(ats, [(0, 10), (10, 20)]);
    }

    /// A run that passes the end of the file fails the parts whose pieces reach it,
    /// with `UnexpectedEof`; parts wholly in earlier pieces get their bytes.
    #[test]
    fn a_run_past_the_end_fails_only_the_parts_it_reaches() {
        let piece = DIRECT_ALIGN;
        let (_d, path, data) = data_file(5 * piece);
        for mode in [ReadMode::Buffered, ReadMode::Direct] {
            let file = Arc::new(DirectFile::open(&path, mode).unwrap());
            let pool = ReadPool::new(4, piece).unwrap();
            let got = run_of(&pool, &file, 0, &[2 * piece, piece, 3 * piece]);
            for (i, (buf, r)) in got.iter().take(2).enumerate() {
                assert!(r.is_ok(), "{mode:?} part {i}");
                let at = 2 * piece * i;
                assert!(*buf == data[at..at + buf.len()], "{mode:?} part {i}");
            }
            let e = got[2].1.as_ref().unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{mode:?}: {e}");
        }
    }

    /// A read past the end is `UnexpectedEof` naming the file, after every piece has
    /// finished; the pool still serves later reads.
    #[test]
    fn a_read_past_the_end_fails_and_the_pool_goes_on() {
        let piece = DIRECT_ALIGN;
        let (_d, path, data) = data_file(6 * piece);
        for mode in [ReadMode::Buffered, ReadMode::Direct] {
            let file = Arc::new(DirectFile::open(&path, mode).unwrap());
            let pool = ReadPool::new(4, piece).unwrap();
            let mut buf = vec![0u8; 8 * piece];
            let e = pool.read(&file, 0, &mut buf).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{mode:?}: {e}");
            let mut ok = vec![0u8; 3 * piece];
            pool.read(&file, 100, &mut ok).unwrap();
            assert!(ok == data[100..100 + 3 * piece]);
        }
    }

    /// Reads from many threads at once (demand and hint threads) share the pool and
    /// each gets its own bytes.
    #[test]
    fn concurrent_reads_from_demand_and_hint_threads() {
        let piece = DIRECT_ALIGN;
        let len = 40 * piece;
        let (_d, path, data) = data_file(len);
        let file = Arc::new(DirectFile::open(&path, ReadMode::Direct).unwrap());
        let pool = Arc::new(ReadPool::new(5, piece).unwrap());
        let data = Arc::new(data);
        let handles: Vec<_> = (0..6)
            .map(|t| {
                let (pool, file, data) = (pool.clone(), file.clone(), data.clone());
                std::thread::spawn(move || {
                    if t % 2 == 1 {
                        mark_hint_thread();
                    }
                    for k in 0..10 {
                        let offset = (t * 977 + k * 4099) % (len / 2);
                        let n = len / 3 + k * 31;
                        let mut buf = vec![0u8; n];
                        pool.read(&file, offset as u64, &mut buf).unwrap();
                        assert!(buf == data[offset..offset + n]);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }
}

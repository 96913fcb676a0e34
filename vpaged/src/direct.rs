//! Reads that bypass the OS page cache, into reusable aligned buffers.
//!
//! Out of core, a model is swept once per token: the OS page cache keeps nothing of
//! a cyclic sweep larger than itself, and under a memory ceiling (a cgroup, a small
//! machine) the pages it fills count against the process and evict what the process
//! chose to keep. A [`ReadMode::Direct`] file is read with `O_DIRECT` on Linux and
//! `F_NOCACHE` on macOS: straight from the device into an [`AlignedBuf`], leaving
//! the page cache as it was. [`ReadMode::Buffered`] reads through the page cache
//! (faster on some devices for small files; `voom plan` measures both).
//!
//! Direct reads must start and end on [`DIRECT_ALIGN`] boundaries in the file and in
//! memory; [`DirectFile::read_at`] widens each read to them and returns the bytes
//! asked for.

use std::alloc::{self, Layout};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::time::Instant;

/// Alignment of direct reads, in the file and in memory (the largest logical block
/// size of common devices; 16 KiB also suits Metal's page size for wrapping).
pub const DIRECT_ALIGN: usize = 16 << 10;

/// Bytes of a huge page (x86-64 and arm64 Linux): a buffer of at least this is
/// mapped on its own, aligned to it, and backed by huge pages where the kernel
/// allows.
const HUGE_PAGE: usize = 2 << 20;

/// A buffer aligned to [`DIRECT_ALIGN`], reused across reads, zeroed when made.
///
/// One of a huge page or more is its own anonymous mapping, aligned to
/// [`HUGE_PAGE`] and advised to be backed by transparent huge pages before anything
/// touches it: a direct read into memory of 4 KiB pages is cut into requests of at
/// most `max_segments` pages (254 on the virtio disk measured here: 1 MiB), one
/// into huge pages only at `max_sectors_kb` (4 MiB there), as the kernel's own
/// readahead into its page cache is. Measured there, the page cache's readahead
/// averaged requests of 2.6 MiB and 1.2 GB/s while direct reads into 4 KiB pages
/// averaged 1.1 MiB and 0.8 GB/s.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    /// Whether it is a mapping of its own (else a heap allocation).
    mapped: bool,
}

// SAFETY: the buffer is plain owned memory; `&AlignedBuf` only yields `&[u8]` and
// `&mut AlignedBuf` gives exclusive access.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `bytes` (rounded up to [`DIRECT_ALIGN`]).
    pub fn new(bytes: usize) -> Self {
        let cap = bytes.max(1).next_multiple_of(DIRECT_ALIGN);
        if cap >= HUGE_PAGE {
            if let Some(b) = Self::mapped(cap) {
                return b;
            }
        }
        let layout = Layout::from_size_align(cap, DIRECT_ALIGN).expect("valid layout");
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf {
            ptr,
            cap,
            mapped: false,
        }
    }

    /// `cap` bytes of a fresh anonymous mapping (zero-filled by the OS) aligned to
    /// [`HUGE_PAGE`], advised to huge pages; `None` if the OS refuses the mapping.
    fn mapped(cap: usize) -> Option<Self> {
        let len = cap.checked_add(HUGE_PAGE)?;
        // SAFETY: a new private anonymous mapping; it aliases nothing.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANON,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let skip = (base as usize).next_multiple_of(HUGE_PAGE) - base as usize;
        // SAFETY: `skip < HUGE_PAGE`, so `base + skip .. + cap` lies in the mapping.
        let ptr = unsafe { base.cast::<u8>().add(skip) };
        // The mapping is trimmed to the buffer: nothing past `cap` can be backed by
        // a huge page of its own. (Both ends are multiples of the OS page size:
        // `base`, `skip` and `cap` are.)
        // SAFETY: unmaps the parts of this new mapping before and after the buffer,
        // which nothing refers to.
        unsafe {
            if skip > 0 {
                libc::munmap(base, skip);
            }
            if len - skip - cap > 0 {
                libc::munmap(ptr.add(cap).cast(), len - skip - cap);
            }
        }
        #[cfg(target_os = "linux")]
        // SAFETY: advice on memory of this mapping, which nothing has touched yet;
        // it changes how the memory is backed, not what it holds.
        unsafe {
            libc::madvise(ptr.cast(), cap, libc::MADV_HUGEPAGE);
        }
        Some(AlignedBuf {
            ptr: NonNull::new(ptr)?,
            cap,
            mapped: true,
        })
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The buffer's first byte, for writers that share it by disjoint ranges: a
    /// write through it needs the range to be the writer's alone (nothing reads or
    /// writes it meanwhile).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `cap` initialized (zeroed, then written) bytes
        // for the buffer's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.cap) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: the mapping made in `mapped` (trimmed to `ptr..ptr + cap`),
            // unmapped once; no slice of it outlives `self`.
            unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.cap);
            }
        } else {
            let layout = Layout::from_size_align(self.cap, DIRECT_ALIGN).expect("valid layout");
            // SAFETY: allocated in `new` with this very layout, freed once.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

/// How a file is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadMode {
    /// Around the OS page cache (`O_DIRECT`, `F_NOCACHE`).
    Direct,
    /// Through the OS page cache.
    Buffered,
}

impl ReadMode {
    pub fn name(self) -> &'static str {
        match self {
            ReadMode::Direct => "direct",
            ReadMode::Buffered => "buffered",
        }
    }

    /// The mode named `name` (as [`ReadMode::name`] gives it).
    pub fn from_name(name: &str) -> Option<ReadMode> {
        [ReadMode::Direct, ReadMode::Buffered]
            .into_iter()
            .find(|m| m.name() == name)
    }
}

/// A regular file opened for reads in one [`ReadMode`].
pub struct DirectFile {
    file: File,
    path: PathBuf,
    len: u64,
    mode: ReadMode,
}

impl DirectFile {
    /// Opens `path` (a regular file, checked without blocking) for reads in `mode`.
    /// A filesystem that cannot read around the page cache is an error naming it.
    pub fn open(path: &Path, mode: ReadMode) -> io::Result<Self> {
        let file = voom_formats::file::open(path)?;
        let len = file.metadata()?.len();
        if mode == ReadMode::Direct {
            set_direct(&file).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "{}: cannot read around the page cache on this filesystem: {e}",
                        path.display()
                    ),
                )
            })?;
        }
        Ok(DirectFile {
            file,
            path: path.to_path_buf(),
            len,
            mode,
        })
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn mode(&self) -> ReadMode {
        self.mode
    }

    /// The open file (for `fstat`).
    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads bytes `offset..offset + len` of the file into `buf` (widened to
    /// [`DIRECT_ALIGN`] boundaries; `buf` must hold the widened range, at most
    /// `len + 2 * DIRECT_ALIGN`) and returns them. A range past the end of the file
    /// is an `UnexpectedEof` error naming the file and the offsets.
    pub fn read_at<'b>(
        &self,
        offset: u64,
        len: usize,
        buf: &'b mut AlignedBuf,
    ) -> io::Result<&'b [u8]> {
        let end = self.end_within(offset, len)?;
        let a = DIRECT_ALIGN as u64;
        let start = offset / a * a;
        let wide_end = end.next_multiple_of(a);
        let wide = (wide_end - start) as usize;
        if wide > buf.capacity() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a read of {wide} bytes does not fit a buffer of {}",
                    buf.capacity()
                ),
            ));
        }
        let dst = &mut buf.as_mut_slice()[..wide];
        let mut done = 0usize;
        // The last block of the file is short: the read stops at the end of the file.
        let want = (end - start) as usize;
        while done < want {
            let n = self.file.read_at(&mut dst[done..], start + done as u64)?;
            if n == 0 {
                return Err(self.ended_early(start + done as u64, end));
            }
            done += n;
        }
        let skip = (offset - start) as usize;
        Ok(&buf.as_slice()[skip..skip + len])
    }

    /// Reads `dst.len()` bytes of the file at `offset` into `dst`. A direct file whose
    /// `offset` and `dst` fall at the same place within a [`DIRECT_ALIGN`] block is
    /// read straight into `dst` (the device writes the aligned middle where it
    /// belongs: no copy), the partial blocks at either end through `bounce`; any
    /// other read goes through `bounce` whole (it must then hold the widened range,
    /// as for [`read_at`](Self::read_at)). Errors as `read_at`'s.
    pub fn read_into(
        &self,
        offset: u64,
        dst: &mut [u8],
        bounce: &mut AlignedBuf,
    ) -> io::Result<()> {
        let a = DIRECT_ALIGN as u64;
        let in_phase = (dst.as_ptr() as u64) % a == offset % a;
        if self.mode == ReadMode::Buffered || !in_phase || dst.len() < DIRECT_ALIGN {
            let got = self.read_at(offset, dst.len(), bounce)?;
            dst.copy_from_slice(got);
            return Ok(());
        }
        let head = ((a - offset % a) % a) as usize;
        let middle = (dst.len() - head) / DIRECT_ALIGN * DIRECT_ALIGN;
        let (head_dst, rest) = dst.split_at_mut(head);
        let (middle_dst, tail_dst) = rest.split_at_mut(middle);
        if head > 0 {
            head_dst.copy_from_slice(self.read_at(offset, head, bounce)?);
        }
        if !middle_dst.is_empty() {
            self.read_aligned(offset + head as u64, middle_dst)?;
        }
        if !tail_dst.is_empty() {
            let at = offset + (head + middle) as u64;
            let got = self.read_at(at, tail_dst.len(), bounce)?;
            tail_dst.copy_from_slice(got);
        }
        Ok(())
    }

    /// Reads `dst` (at a [`DIRECT_ALIGN`] boundary, a whole number of blocks) from
    /// `offset` (a boundary too) straight into it.
    fn read_aligned(&self, offset: u64, dst: &mut [u8]) -> io::Result<()> {
        debug_assert!(offset.is_multiple_of(DIRECT_ALIGN as u64));
        debug_assert!((dst.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN));
        debug_assert!(dst.len().is_multiple_of(DIRECT_ALIGN));
        let end = self.end_within(offset, dst.len())?;
        let mut done = 0usize;
        while done < dst.len() {
            let n = self.file.read_at(&mut dst[done..], offset + done as u64)?;
            done += n;
            // A direct read stops short only at the end of the file (it shrank since
            // the check above); what is left cannot be read aligned.
            if n == 0 || (done < dst.len() && !n.is_multiple_of(DIRECT_ALIGN)) {
                return Err(self.ended_early(offset + done as u64, end));
            }
        }
        Ok(())
    }

    /// The end of bytes `offset..offset + len`, or an `UnexpectedEof` error naming the
    /// file when they pass its length now (it may have changed since it was opened).
    fn end_within(&self, offset: u64, len: usize) -> io::Result<u64> {
        let file_len = self.file.metadata()?.len();
        offset
            .checked_add(len as u64)
            .filter(|&e| e <= file_len)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "{}: bytes {offset}..{} are past its end ({file_len} bytes)",
                        self.path.display(),
                        offset.saturating_add(len as u64),
                    ),
                )
            })
    }

    /// The error of a read that found the file ending at `at`, short of `end`.
    fn ended_early(&self, at: u64, end: u64) -> io::Error {
        io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "{}: the file ended at byte {at} while bytes up to {end} were read",
                self.path.display()
            ),
        )
    }

    /// Asks the OS to drop the file's clean pages from its page cache (a cold
    /// buffered read after it; a no-op where the OS has no such call).
    pub fn drop_cached(&self) {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            // SAFETY: posix_fadvise on a descriptor this value owns; it only gives
            // the kernel advice and touches no memory of ours.
            unsafe {
                libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
            }
        }
    }
}

/// Makes `file`'s reads and writes bypass the OS page cache (`O_DIRECT` on Linux,
/// `F_NOCACHE` on macOS); an error where the file system or OS cannot (tmpfs, for
/// one). Direct transfers must be [`DIRECT_ALIGN`]-aligned in the file and memory.
#[cfg(target_os = "linux")]
pub fn set_direct(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl F_GETFL on a descriptor `file` owns; reads its status flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above; F_SETFL sets status flags from an int.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_DIRECT) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// As on Linux, with `F_NOCACHE`.
#[cfg(target_os = "macos")]
pub fn set_direct(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl F_NOCACHE on a descriptor `file` owns, with an int argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
/// Not supported on this OS.
pub fn set_direct(_file: &File) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "direct reads are implemented on Linux and macOS",
    ))
}

/// A measured read bandwidth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bandwidth {
    pub mode: ReadMode,
    pub bytes: u64,
    pub secs: f64,
    /// Reads in flight at once.
    pub readers: usize,
    /// Bytes per read.
    pub chunk: usize,
}

impl Bandwidth {
    pub fn bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.secs.max(1e-9)
    }
}

/// Reads up to `max_bytes` of `files` (in order, each from its start) in `chunk`-byte
/// reads in `mode`, `readers` of them in flight at once (each thread takes the next
/// chunk; devices that reward several outstanding reads show it), and times it. A
/// buffered measurement first drops the files' clean pages from the page cache, and
/// again after, so it reads cold and leaves nothing behind (pages another process
/// dirtied, or a device's own cache, may still be warm).
pub fn read_bandwidth(
    files: &[PathBuf],
    max_bytes: u64,
    chunk: usize,
    mode: ReadMode,
    readers: usize,
) -> io::Result<Bandwidth> {
    let mut opened = Vec::new();
    for f in files {
        let d = DirectFile::open(f, mode)?;
        if mode == ReadMode::Buffered {
            d.drop_cached();
        }
        opened.push(d);
    }
    let chunk = chunk.max(DIRECT_ALIGN).next_multiple_of(DIRECT_ALIGN);
    // Every (file, offset, len) to read, in order, up to `max_bytes`.
    let mut reads = Vec::new();
    let mut total = 0u64;
    'files: for (i, d) in opened.iter().enumerate() {
        let mut off = 0u64;
        while off < d.len() {
            let n = (chunk as u64).min(d.len() - off).min(max_bytes - total) as usize;
            if n == 0 {
                break 'files;
            }
            reads.push((i, off, n));
            off += n as u64;
            total += n as u64;
        }
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t0 = Instant::now();
    let results: Vec<io::Result<()>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..readers.max(1))
            .map(|_| {
                s.spawn(|| -> io::Result<()> {
                    let mut buf = AlignedBuf::new(chunk + 2 * DIRECT_ALIGN);
                    loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(i, off, n)) = reads.get(k) else {
                            return Ok(());
                        };
                        opened[i].read_at(off, n, &mut buf)?;
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err(io::Error::other("a reader panicked")))
            })
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    results.into_iter().collect::<io::Result<Vec<()>>>()?;
    if mode == ReadMode::Buffered {
        for d in &opened {
            d.drop_cached();
        }
    }
    Ok(Bandwidth {
        mode,
        bytes: total,
        secs,
        readers: readers.max(1),
        chunk,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(len: usize) -> (tempfile::TempDir, PathBuf, Vec<u8>) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.bin");
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        (dir, p, data)
    }

    /// `p` opened in `mode`; `None` (and a printed reason) where the file system
    /// refuses direct reads (tmpfs).
    fn open_or_skip(p: &Path, mode: ReadMode) -> Option<DirectFile> {
        match DirectFile::open(p, mode) {
            Ok(f) => Some(f),
            Err(e) if mode == ReadMode::Direct => {
                eprintln!("skipping direct reads: {e}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// Buffers of a huge page or more are mappings of their own, aligned to a huge
    /// page, zeroed, and as writable as heap ones; smaller ones come from the heap.
    #[test]
    fn large_buffers_are_aligned_zeroed_mappings() {
        for bytes in [1, DIRECT_ALIGN + 1, HUGE_PAGE, 3 * HUGE_PAGE + 5] {
            let mut b = AlignedBuf::new(bytes);
            assert!(b.capacity() >= bytes && b.capacity().is_multiple_of(DIRECT_ALIGN));
            assert_eq!(b.mapped, b.capacity() >= HUGE_PAGE, "{bytes}");
            let align = if b.mapped { HUGE_PAGE } else { DIRECT_ALIGN };
            assert_eq!(b.as_slice().as_ptr() as usize % align, 0, "{bytes}");
            assert!(b.as_slice().iter().all(|&x| x == 0));
            let n = b.capacity();
            b.as_mut_slice()[n - 1] = 7;
            b.as_mut_slice()[0] = 9;
            assert_eq!((b.as_slice()[0], b.as_slice()[n - 1]), (9, 7));
        }
    }

    #[test]
    fn unaligned_ranges_read_the_bytes_asked_for_in_both_modes() {
        let (_d, p, data) = file_with(3 * DIRECT_ALIGN + 123);
        for mode in [ReadMode::Direct, ReadMode::Buffered] {
            let Some(f) = open_or_skip(&p, mode) else {
                continue;
            };
            let mut buf = AlignedBuf::new(4 * DIRECT_ALIGN + 2 * DIRECT_ALIGN);
            for (off, len) in [
                (0usize, 10usize),
                (5, DIRECT_ALIGN),
                (DIRECT_ALIGN - 1, 2),
                (3 * DIRECT_ALIGN, 123),
                (17, data.len() - 17),
                (data.len(), 0),
            ] {
                let got = f.read_at(off as u64, len, &mut buf).unwrap();
                assert_eq!(got, &data[off..off + len], "{mode:?} {off}+{len}");
            }
        }
    }

    /// `read_into` gives the file's bytes for destinations in and out of phase with
    /// the file; in phase, the aligned middle never passes through the bounce buffer.
    #[test]
    fn reads_into_a_destination_give_the_bytes_and_skip_the_bounce_in_phase() {
        let (_d, p, data) = file_with(6 * DIRECT_ALIGN + 321);
        for mode in [ReadMode::Direct, ReadMode::Buffered] {
            let Some(f) = open_or_skip(&p, mode) else {
                continue;
            };
            let mut dst = AlignedBuf::new(8 * DIRECT_ALIGN);
            let mut bounce = AlignedBuf::new(6 * DIRECT_ALIGN);
            for (off, len, shift) in [
                (0usize, 4 * DIRECT_ALIGN, 0usize),
                (0, 3 * DIRECT_ALIGN + 7, 0),
                (100, 2 * DIRECT_ALIGN, 100),
                (DIRECT_ALIGN - 1, DIRECT_ALIGN + 2, DIRECT_ALIGN - 1),
                (5, 2 * DIRECT_ALIGN, 6),
                (17, 100, 17),
                (3 * DIRECT_ALIGN, data.len() - 3 * DIRECT_ALIGN, 0),
            ] {
                bounce.as_mut_slice().fill(0xAB);
                let out = &mut dst.as_mut_slice()[shift..shift + len];
                out.fill(0);
                f.read_into(off as u64, out, &mut bounce).unwrap();
                assert_eq!(
                    out,
                    &data[off..off + len],
                    "{mode:?} {off}+{len} at {shift}"
                );
                let whole_blocks = off % DIRECT_ALIGN == 0 && len % DIRECT_ALIGN == 0;
                if mode == ReadMode::Direct && shift == off % DIRECT_ALIGN && whole_blocks {
                    assert!(bounce.as_slice().iter().all(|&b| b == 0xAB), "{off}+{len}");
                }
            }
            let out = &mut dst.as_mut_slice()[..2 * DIRECT_ALIGN];
            let e = f
                .read_into(5 * DIRECT_ALIGN as u64, out, &mut bounce)
                .unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{mode:?}: {e}");
            assert!(e.to_string().contains("f.bin"), "{e}");
        }
    }

    #[test]
    fn a_range_past_the_end_is_an_error_naming_the_file() {
        let (_d, p, data) = file_with(1000);
        let f = DirectFile::open(&p, ReadMode::Buffered).unwrap();
        let mut buf = AlignedBuf::new(4 * DIRECT_ALIGN);
        let e = f.read_at(990, 11, &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert!(e.to_string().contains("f.bin") && e.to_string().contains("990..1001"));
        assert_eq!(f.read_at(990, 10, &mut buf).unwrap(), &data[990..]);
    }

    #[test]
    fn a_file_truncated_after_opening_is_an_eof_error_not_stale_bytes() {
        let (_d, p, _) = file_with(2 * DIRECT_ALIGN);
        let f = DirectFile::open(&p, ReadMode::Buffered).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(100)
            .unwrap();
        let mut buf = AlignedBuf::new(4 * DIRECT_ALIGN);
        let e = f.read_at(50, DIRECT_ALIGN, &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        // Seen by the length check before the read, or by the read itself.
        let m = e.to_string();
        assert!(
            m.contains("(100 bytes)") || m.contains("ended at byte 100"),
            "{e}"
        );
    }

    #[test]
    fn buffers_are_aligned_and_bandwidth_counts_what_it_read() {
        let b = AlignedBuf::new(1);
        assert_eq!(b.as_slice().as_ptr() as usize % DIRECT_ALIGN, 0);
        assert_eq!(b.capacity(), DIRECT_ALIGN);
        let (_d, p, data) = file_with(5 * DIRECT_ALIGN + 7);
        let bw = read_bandwidth(
            std::slice::from_ref(&p),
            u64::MAX,
            DIRECT_ALIGN * 2,
            ReadMode::Buffered,
            3,
        )
        .unwrap();
        assert_eq!(bw.bytes, data.len() as u64);
        let bw = read_bandwidth(
            &[p],
            3 * DIRECT_ALIGN as u64,
            DIRECT_ALIGN,
            ReadMode::Buffered,
            1,
        )
        .unwrap();
        assert_eq!(bw.bytes, 3 * DIRECT_ALIGN as u64);
        assert!(bw.bytes_per_sec() > 0.0);
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fifo");
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(DirectFile::open(&p, ReadMode::Direct).is_err());
    }
}

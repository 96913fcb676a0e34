//! The shared-memory arena that holds the page cache's slots.
//!
//! One region of `capacity` bytes backed by an anonymous shared-memory file: a sealed
//! `memfd` on Linux, a POSIX `shm_open` object (unlinked at once) on macOS and other
//! Unixes. The owner (the daemon or the embedded store) maps it read-write through
//! [`Arena`]; an engine in another process receives the file descriptor (SCM_RIGHTS,
//! done by the protocol layer) and maps it read-only through [`ArenaView`].
//!
//! Invariants:
//! - The capacity is a multiple of [`SLOT_ALIGN`] (16 KiB), so every slot offset handed
//!   out by the cache is 16 KiB aligned in both mappings (Apple's Metal can wrap such
//!   memory without copying).
//! - On Linux the size is sealed (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`): no
//!   process holding the descriptor can shrink it under another's mapping (which would
//!   turn reads into SIGBUS). [`ArenaView::map_readonly`] refuses an unsealed memfd.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

use memmap2::{MmapOptions, MmapRaw};

/// Alignment and granularity of cache slots: 16 KiB (Apple Silicon's page size, the
/// unit Metal's no-copy buffers need).
pub const SLOT_ALIGN: usize = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    #[error("arena capacity {capacity} bytes is smaller than one {SLOT_ALIGN}-byte slot")]
    TooSmall { capacity: usize },
    #[error("cannot {what} for the shared-memory arena of {capacity} bytes: {source}")]
    Os {
        what: &'static str,
        capacity: usize,
        #[source]
        source: io::Error,
    },
    #[error("arena file holds {actual} bytes, fewer than the {expected} bytes to map")]
    Short { expected: usize, actual: u64 },
    #[error("arena file descriptor is not sealed against shrinking (seals {seals:#x}); mapping it could fault")]
    NotSealed { seals: i32 },
    #[error("arena range {offset}+{len} is outside the {capacity}-byte arena")]
    OutOfRange {
        offset: usize,
        len: usize,
        capacity: usize,
    },
}

/// The owner's read-write mapping of the shared arena.
pub struct Arena {
    file: File,
    map: MmapRaw,
    capacity: usize,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl Arena {
    /// Creates a shared arena of `budget` bytes rounded *down* to a multiple of
    /// [`SLOT_ALIGN`] (the budget is a ceiling). Memory is committed lazily by the OS.
    pub fn new(budget: usize) -> Result<Arena, ArenaError> {
        let capacity = budget / SLOT_ALIGN * SLOT_ALIGN;
        if capacity == 0 {
            return Err(ArenaError::TooSmall { capacity: budget });
        }
        let os = |what: &'static str| {
            move |source: io::Error| ArenaError::Os {
                what,
                capacity,
                source,
            }
        };
        let fd = create_shared_fd(capacity).map_err(os("create shared memory"))?;
        let file = File::from(fd);
        let map = MmapOptions::new()
            .len(capacity)
            .map_raw(&file)
            .map_err(os("map"))?;
        Ok(Arena {
            file,
            map,
            capacity,
        })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The descriptor to pass to engines (they map it with [`ArenaView::map_readonly`]).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Base address of the owner's mapping.
    pub fn as_ptr(&self) -> *const u8 {
        self.map.as_ptr()
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), ArenaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.capacity => Ok(()),
            _ => Err(ArenaError::OutOfRange {
                offset,
                len,
                capacity: self.capacity,
            }),
        }
    }

    /// Shared view of `offset..offset+len`.
    ///
    /// # Safety
    /// No one may write the range while the returned slice lives (the page cache
    /// guarantees this for a leased slot).
    pub unsafe fn bytes(&self, offset: usize, len: usize) -> Result<&[u8], ArenaError> {
        self.check(offset, len)?;
        // SAFETY: the range is inside the live mapping (checked); the caller guarantees
        // that nothing writes it while the slice lives.
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(offset), len) })
    }

    /// Exclusive view of `offset..offset+len`, to fill a slot.
    ///
    /// # Safety
    /// The caller must have exclusive access to the range for the slice's lifetime: no
    /// other slice (shared or mutable) of an overlapping range may exist in this process
    /// (the page cache guarantees this for a slot being loaded). Other processes only
    /// map the arena read-only and never read a slot that is not yet visible.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, offset: usize, len: usize) -> Result<&mut [u8], ArenaError> {
        self.check(offset, len)?;
        // SAFETY: the range is inside the live, writable mapping (checked); the caller
        // guarantees exclusive access to it.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(offset), len) })
    }
}

impl Arena {
    /// Returns the memory of `offset..offset+len` to the OS; the range reads as
    /// zeros afterwards and is committed again when next written. `Ok(false)` where
    /// the platform cannot (the memory stays committed; nothing is wrong).
    ///
    /// Only for a range no slot, lease or reader uses (the page cache's withheld
    /// room): its bytes are discarded.
    pub fn release(&self, offset: usize, len: usize) -> Result<bool, ArenaError> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(true);
        }
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            // SAFETY: a hole punched in this arena's own shared-memory file, inside its
            // size (checked; KEEP_SIZE leaves the size, which is sealed, as it is);
            // the caller guarantees nothing uses the range.
            let r = unsafe {
                libc::fallocate(
                    self.file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset as libc::off_t,
                    len as libc::off_t,
                )
            };
            if r != 0 {
                return Err(ArenaError::Os {
                    what: "release a range (fallocate punch hole)",
                    capacity: self.capacity,
                    source: io::Error::last_os_error(),
                });
            }
            Ok(true)
        }
        #[cfg(not(target_os = "linux"))]
        {
            Ok(false)
        }
    }

    /// Commits every page of the arena now, so that loading a page later does not
    /// also pay for the kernel finding and zeroing fresh memory (measured on Linux: a
    /// fresh arena fills about 3-4x slower than a committed one). Meant for start-up,
    /// before any slot is handed out: the arena's bytes are zero then and stay so.
    /// The memory is committed whether or not pages are ever loaded.
    pub fn prefault(&self) -> Result<(), ArenaError> {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: the range is exactly this live mapping; MADV_POPULATE_WRITE only
            // faults pages in (writable, as if written with their current contents),
            // it never changes bytes.
            let r = unsafe {
                libc::madvise(
                    self.map.as_mut_ptr().cast(),
                    self.capacity,
                    libc::MADV_POPULATE_WRITE,
                )
            };
            if r == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            // Kernels before 5.14 do not know the advice: touch the pages instead.
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(ArenaError::Os {
                    what: "pre-fault",
                    capacity: self.capacity,
                    source: e,
                });
            }
        }
        self.touch_every_page();
        Ok(())
    }

    fn touch_every_page(&self) {
        let step = 4096;
        let base = self.map.as_mut_ptr();
        for off in (0..self.capacity).step_by(step) {
            // SAFETY: `off` is inside the live, writable mapping. Each byte is read and
            // written back unchanged (volatile, so the write is not elided): the
            // contents stay as they were, and the page is now committed.
            unsafe {
                let p = base.add(off);
                std::ptr::write_volatile(p, std::ptr::read_volatile(p));
            }
        }
    }
}

/// A read-only mapping of an arena received from its owner.
pub struct ArenaView {
    map: MmapRaw,
    len: usize,
    // Kept open so the descriptor can be inspected or re-passed; the mapping itself
    // stays valid after close.
    _file: File,
}

impl std::fmt::Debug for ArenaView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaView")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl ArenaView {
    /// Maps `len` bytes of the arena behind `fd` read-only. Fails if the file is
    /// shorter than `len` or (on Linux) not sealed against shrinking.
    pub fn map_readonly(fd: OwnedFd, len: usize) -> Result<ArenaView, ArenaError> {
        let os = |what: &'static str| {
            move |source: io::Error| ArenaError::Os {
                what,
                capacity: len,
                source,
            }
        };
        if len == 0 {
            return Err(ArenaError::TooSmall { capacity: 0 });
        }
        let file = File::from(fd);
        #[cfg(target_os = "linux")]
        {
            // SAFETY: fcntl(F_GET_SEALS) only reads the descriptor's seal set.
            let seals = unsafe { libc::fcntl(file.as_fd_raw(), libc::F_GET_SEALS) };
            // EINVAL: not a file that supports seals (not a memfd): unsealed.
            let seals = if seals < 0 {
                let err = io::Error::last_os_error();
                if err.raw_os_error() != Some(libc::EINVAL) {
                    return Err(os("read the seals")(err));
                }
                0
            } else {
                seals
            };
            if seals & libc::F_SEAL_SHRINK == 0 {
                return Err(ArenaError::NotSealed { seals });
            }
        }
        let actual = file.metadata().map_err(os("stat"))?.len();
        if actual < len as u64 {
            return Err(ArenaError::Short {
                expected: len,
                actual,
            });
        }
        let map = MmapOptions::new()
            .len(len)
            .map_raw_read_only(&file)
            .map_err(os("map read-only"))?;
        Ok(ArenaView {
            map,
            len,
            _file: file,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address of the read-only mapping (for wrapping by a GPU API).
    pub fn as_ptr(&self) -> *const u8 {
        self.map.as_ptr()
    }

    /// The bytes of `offset..offset+len`, checked against the mapping's length.
    ///
    /// # Safety
    /// The owner rewrites any slot that is not leased, so the range must be (part of) a
    /// slot the owner leased to this process (an `Acquired` slot of the daemon), and
    /// that lease must be held for as long as the returned slice lives. (The one other
    /// sound use: an arena whose owner writes nothing while the slice lives.)
    pub unsafe fn bytes(&self, offset: usize, len: usize) -> Result<&[u8], ArenaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {}
            _ => {
                return Err(ArenaError::OutOfRange {
                    offset,
                    len,
                    capacity: self.len,
                })
            }
        }
        // SAFETY: the range lies inside the live read-only mapping (checked above); the
        // memory is shared with the owner, which does not write a leased slot, and the
        // caller holds the lease while the slice lives (this function's contract).
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(offset), len) })
    }
}

#[cfg(target_os = "linux")]
trait AsFdRaw {
    fn as_fd_raw(&self) -> i32;
}
#[cfg(target_os = "linux")]
impl AsFdRaw for File {
    fn as_fd_raw(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.as_raw_fd()
    }
}

/// Linux: a memfd, sized then sealed so its size can never change.
#[cfg(target_os = "linux")]
fn create_shared_fd(capacity: usize) -> io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    // SAFETY: the name is a valid NUL-terminated string; flags are valid.
    let raw = unsafe {
        libc::memfd_create(
            c"vpaged-arena".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let file = File::from(fd);
    file.set_len(capacity as u64)?;
    // SAFETY: F_ADD_SEALS on our own memfd with valid seal flags.
    let rc = unsafe {
        libc::fcntl(
            file.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(OwnedFd::from(file))
}

/// macOS and other Unixes: a POSIX shared-memory object with a unique name, unlinked
/// at once so only descriptors reach it.
#[cfg(not(target_os = "linux"))]
fn create_shared_fd(capacity: usize) -> io::Result<OwnedFd> {
    create_posix_shm_fd(capacity)
}

/// The POSIX shared-memory arena file (the non-Linux path; also built for Linux tests,
/// so that the code macOS runs is exercised here too).
#[cfg(any(not(target_os = "linux"), test))]
fn create_posix_shm_fd(capacity: usize) -> io::Result<OwnedFd> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let mut attempt = 0;
    loop {
        // macOS limits names to 31 bytes (PSHMNAMLEN).
        let name = std::ffi::CString::new(format!(
            "/vpaged.{}.{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ))
        .expect("no NUL in a formatted name");
        // SAFETY: valid NUL-terminated name; O_EXCL makes the object ours alone; the
        // mode is passed as the promoted c_uint the variadic prototype expects.
        let raw = unsafe {
            libc::shm_open(
                name.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL,
                0o600 as libc::c_uint,
            )
        };
        if raw < 0 {
            let err = io::Error::last_os_error();
            attempt += 1;
            if err.kind() == io::ErrorKind::AlreadyExists && attempt < 16 {
                continue;
            }
            return Err(err);
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: unlinking the name we just created; the object lives on through `fd`.
        unsafe { libc::shm_unlink(name.as_ptr()) };
        let file = File::from(fd);
        file.set_len(capacity as u64)?;
        return Ok(OwnedFd::from(file));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The macOS arena path (POSIX shm, unlinked at once), run on this OS: a sized
    /// object whose writes through one mapping are seen through another, with no
    /// name left behind.
    #[test]
    fn posix_shm_arena_file_is_sized_shared_and_unlinked() {
        let fd = create_posix_shm_fd(4 * SLOT_ALIGN).unwrap();
        let file = File::from(fd);
        assert_eq!(file.metadata().unwrap().len(), 4 * SLOT_ALIGN as u64);
        let a = MmapOptions::new()
            .len(4 * SLOT_ALIGN)
            .map_raw(&file)
            .unwrap();
        let b = MmapOptions::new()
            .len(4 * SLOT_ALIGN)
            .map_raw(&file)
            .unwrap();
        // SAFETY: both mappings cover 4 slots of the same live object; nothing else
        // uses them.
        unsafe {
            a.as_mut_ptr().add(SLOT_ALIGN + 7).write(0xa5);
            assert_eq!(b.as_ptr().add(SLOT_ALIGN + 7).read(), 0xa5);
        }
        #[cfg(target_os = "linux")]
        {
            let leftovers = std::fs::read_dir("/dev/shm")
                .map(|d| {
                    d.flatten()
                        .filter(|e| {
                            e.file_name()
                                .to_string_lossy()
                                .starts_with(&format!("vpaged.{}.", std::process::id()))
                        })
                        .count()
                })
                .unwrap_or(0);
            assert_eq!(leftovers, 0, "the shm name must be unlinked at once");
        }
    }

    /// Pages of the mapping the kernel has resident (mincore).
    #[cfg(target_os = "linux")]
    fn resident_pages(a: &Arena) -> usize {
        let page = 4096;
        let mut vec = vec![0u8; a.capacity().div_ceil(page)];
        // SAFETY: the range is the live mapping; `vec` has one byte per page of it.
        let r = unsafe {
            libc::mincore(
                a.as_ptr() as *mut libc::c_void,
                a.capacity(),
                vec.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0, "{}", io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn prefault_commits_every_page_and_keeps_them_zero() {
        let a = Arena::new(64 * SLOT_ALIGN).unwrap();
        assert_eq!(resident_pages(&a), 0, "a fresh arena is not committed");
        a.prefault().unwrap();
        assert_eq!(resident_pages(&a), a.capacity() / 4096);
        // SAFETY: nothing else uses this arena.
        let bytes = unsafe { a.bytes(0, a.capacity()) }.unwrap();
        assert!(bytes.iter().all(|&b| b == 0));
        // The fallback path does the same.
        let b = Arena::new(16 * SLOT_ALIGN).unwrap();
        b.touch_every_page();
        assert_eq!(resident_pages(&b), b.capacity() / 4096);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_released_range_gives_its_memory_back_and_reads_zero() {
        let a = Arena::new(8 * SLOT_ALIGN).unwrap();
        a.prefault().unwrap();
        // SAFETY: nothing else uses this arena.
        unsafe { a.bytes_mut(0, a.capacity()) }.unwrap().fill(7);
        assert!(a.release(2 * SLOT_ALIGN, 3 * SLOT_ALIGN).unwrap());
        assert_eq!(resident_pages(&a), (a.capacity() - 3 * SLOT_ALIGN) / 4096);
        // SAFETY: as above.
        let b = unsafe { a.bytes(0, a.capacity()) }.unwrap();
        assert!(b[..2 * SLOT_ALIGN].iter().all(|&x| x == 7));
        assert!(b[2 * SLOT_ALIGN..5 * SLOT_ALIGN].iter().all(|&x| x == 0));
        assert!(b[5 * SLOT_ALIGN..].iter().all(|&x| x == 7));
        assert!(matches!(
            a.release(7 * SLOT_ALIGN, 2 * SLOT_ALIGN),
            Err(ArenaError::OutOfRange { .. })
        ));
    }

    #[test]
    fn capacity_is_rounded_down_to_slots() {
        let a = Arena::new(3 * SLOT_ALIGN + 100).unwrap();
        assert_eq!(a.capacity(), 3 * SLOT_ALIGN);
        assert!(matches!(
            Arena::new(SLOT_ALIGN - 1),
            Err(ArenaError::TooSmall { .. })
        ));
        assert_eq!(a.as_ptr() as usize % 4096, 0);
    }

    #[test]
    fn readonly_view_sees_owner_writes_and_checks_ranges() {
        let a = Arena::new(4 * SLOT_ALIGN).unwrap();
        // SAFETY: no other slice of the arena exists in this test.
        let w = unsafe { a.bytes_mut(SLOT_ALIGN, 8) }.unwrap();
        w.copy_from_slice(b"vpaged!!");
        let fd = a.fd().try_clone_to_owned().unwrap();
        let v = ArenaView::map_readonly(fd, a.capacity()).unwrap();
        // Nothing writes the arena while the slices below live; the owner's one later
        // write comes after they are dead.
        // SAFETY: as just said.
        assert_eq!(unsafe { v.bytes(SLOT_ALIGN, 8) }.unwrap(), b"vpaged!!");
        // SAFETY: as above.
        assert_eq!(unsafe { v.bytes(0, 4) }.unwrap(), &[0, 0, 0, 0]);
        assert!(matches!(
            // SAFETY: as above (and the range is refused).
            unsafe { v.bytes(4 * SLOT_ALIGN - 1, 2) },
            Err(ArenaError::OutOfRange { .. })
        ));
        // SAFETY: as above (and the range is refused).
        assert!(unsafe { v.bytes(usize::MAX, 2) }.is_err());
        // SAFETY: shared read of a range nothing writes now.
        assert!(unsafe { a.bytes(4 * SLOT_ALIGN, 1) }.is_err());
        // A later owner write is visible through the shared mapping.
        // SAFETY: exclusive: the view's earlier slices are dead.
        unsafe { a.bytes_mut(SLOT_ALIGN, 1) }.unwrap()[0] = b'V';
        // SAFETY: the owner's write is done and nothing writes while this slice lives.
        assert_eq!(unsafe { v.bytes(SLOT_ALIGN, 1) }.unwrap(), b"V");
    }

    #[test]
    fn view_longer_than_the_arena_is_refused() {
        let a = Arena::new(2 * SLOT_ALIGN).unwrap();
        let fd = a.fd().try_clone_to_owned().unwrap();
        assert!(matches!(
            ArenaView::map_readonly(fd, 3 * SLOT_ALIGN),
            Err(ArenaError::Short { .. })
        ));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn arena_size_is_sealed_and_unsealed_fds_are_refused() {
        let a = Arena::new(2 * SLOT_ALIGN).unwrap();
        let f = File::from(a.fd().try_clone_to_owned().unwrap());
        assert!(
            f.set_len(SLOT_ALIGN as u64).is_err(),
            "shrink must be sealed"
        );
        assert!(
            f.set_len(8 * SLOT_ALIGN as u64).is_err(),
            "grow must be sealed"
        );
        let tmp = tempfile::tempfile().unwrap();
        tmp.set_len(SLOT_ALIGN as u64).unwrap();
        assert!(matches!(
            ArenaView::map_readonly(OwnedFd::from(tmp), SLOT_ALIGN),
            Err(ArenaError::NotSealed { .. })
        ));
    }
}

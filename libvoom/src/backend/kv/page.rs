//! One closed KV page: its floats in memory, or spilled to its pool's file with a
//! checksum, read back on demand or ahead of the layer that needs it.
//!
//! A page moves between states under its own lock:
//!
//! ```text
//! Resident ──spill──> Spilled{staged: Empty} ──read ahead──> Spilled{Reading}
//!    ^                    ^      │ (a reader finds it Empty: read now, a stall)   │
//!    │                    │      v                                               v
//!    └──re-admitted── Spilled{Ready} <────────────── read and verified ──────────┘
//!                              │ read failed its checksum
//!                              v
//!                           Corrupt (never used: its positions are recomputed)
//! ```
//!
//! A staged copy stays until the pool evicts it (the read-ahead window is bounded in
//! bytes) or the page is re-admitted as resident when the budget has room.

use std::ops::Deref;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

use vpaged::direct::AlignedBuf;

use super::spill::PoolShared;

/// A page's floats: a plain heap copy (written in memory) or an aligned buffer (read
/// back from the spill file), returned to its pool's spare buffers when dropped.
pub enum Floats {
    Heap(Box<[f32]>),
    Aligned {
        buf: Option<AlignedBuf>,
        floats: usize,
        home: Weak<PoolShared>,
    },
}

impl Drop for Floats {
    fn drop(&mut self) {
        if let Floats::Aligned { buf, home, .. } = self {
            if let (Some(b), Some(pool)) = (buf.take(), home.upgrade()) {
                pool.spare(b);
            }
        }
    }
}

impl Deref for Floats {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            Floats::Heap(b) => b,
            Floats::Aligned { buf, floats, .. } => {
                let buf = buf.as_ref().expect("taken only when dropped");
                // SAFETY: the buffer is aligned to `DIRECT_ALIGN` (more than f32's
                // alignment), holds at least `floats * 4` initialized bytes (its
                // capacity is rounded up from them), and lives as long as `self`.
                unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<f32>(), *floats) }
            }
        }
    }
}

/// Where a spilled page's copy read ahead is.
pub(super) enum Staged {
    Empty,
    Reading,
    Ready(Arc<Floats>),
}

pub(super) enum State {
    Resident(Arc<Floats>),
    /// In the pool's spill file at `slot`, with the XXH3-128 of its bytes.
    Spilled {
        slot: u64,
        hash: u128,
        staged: Staged,
    },
    /// Its copy on disk failed its checksum (or could not be read): what went wrong.
    Corrupt(String),
    /// A cache's stand-in for a page behind a sliding window, no longer held.
    Dropped,
}

/// A closed page of one layer's keys or values, shared by the caches that hold its
/// positions (`Arc`).
pub struct KvPage {
    floats: usize,
    pub(super) state: Mutex<State>,
    /// Signalled when a read of it lands.
    pub(super) landed: Condvar,
    /// The pool that may spill it (`None`: always resident).
    pub(super) pool: Option<Arc<PoolShared>>,
}

impl KvPage {
    /// A resident page of `data`, counted in `pool` (if any) by its caller.
    pub(super) fn new(data: Vec<f32>, pool: Option<Arc<PoolShared>>) -> Arc<Self> {
        Arc::new(KvPage {
            floats: data.len(),
            state: Mutex::new(State::Resident(Arc::new(Floats::Heap(
                data.into_boxed_slice(),
            )))),
            landed: Condvar::new(),
            pool,
        })
    }

    /// A stand-in for a page of `floats` behind a sliding window (it holds nothing).
    pub(super) fn dropped(floats: usize) -> Arc<Self> {
        Arc::new(KvPage {
            floats,
            state: Mutex::new(State::Dropped),
            landed: Condvar::new(),
            pool: None,
        })
    }

    /// Whether it stands in for positions dropped behind a sliding window.
    pub fn is_dropped(&self) -> bool {
        matches!(*self.lock(), State::Dropped)
    }

    pub fn floats(&self) -> usize {
        self.floats
    }

    pub fn bytes(&self) -> usize {
        self.floats * 4
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether its floats are in memory (not spilled).
    pub fn is_resident(&self) -> bool {
        matches!(*self.lock(), State::Resident(_))
    }

    /// Its floats: in memory, read ahead, or read now (waiting for a read in flight);
    /// `Err` with what went wrong when its copy on disk is corrupt or unreadable.
    pub fn get(self: &Arc<Self>) -> Result<Arc<Floats>, String> {
        let mut st = self.lock();
        loop {
            match &mut *st {
                State::Resident(b) => return Ok(Arc::clone(b)),
                State::Corrupt(why) => return Err(why.clone()),
                State::Dropped => {
                    return Err("its positions were dropped behind a sliding window".into())
                }
                State::Spilled {
                    staged: Staged::Ready(b),
                    ..
                } => {
                    let b = Arc::clone(b);
                    if let Some(pool) = &self.pool {
                        pool.used(self, &mut st);
                    }
                    return Ok(b);
                }
                State::Spilled {
                    staged: Staged::Reading,
                    ..
                } => {
                    if let Some(pool) = &self.pool {
                        pool.note_wait();
                    }
                    st = self.landed.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                State::Spilled {
                    slot,
                    hash,
                    staged: staged @ Staged::Empty,
                } => {
                    let (slot, hash) = (*slot, *hash);
                    *staged = Staged::Reading;
                    let pool = Arc::clone(self.pool.as_ref().expect("a spilled page has a pool"));
                    pool.note_stall(self.bytes());
                    drop(st);
                    let read = pool.read(slot, self.floats, &hash);
                    st = self.lock();
                    pool.land(self, &mut st, read);
                }
            }
        }
    }
}

impl Drop for KvPage {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            let st = std::mem::replace(
                self.state.get_mut().unwrap_or_else(|e| e.into_inner()),
                State::Corrupt(String::new()),
            );
            pool.forget(self.floats, st);
        }
    }
}

/// A page of a [`super::KvView`]: the open page borrowed from its cache, or a closed
/// page's floats.
pub enum PageRef<'a> {
    Open(&'a [f32]),
    Closed(Arc<Floats>),
    /// Positions no longer held (behind a sliding window): nothing may read them.
    Dropped,
}

impl Deref for PageRef<'_> {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            PageRef::Open(s) => s,
            PageRef::Closed(f) => f,
            PageRef::Dropped => &[],
        }
    }
}

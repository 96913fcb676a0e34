//! Bodies read ahead: the encoded bodies (vpack) of pages an engine will need after
//! the ones it has hinted, read from storage into a pool of their own before their
//! pages have cache slots.
//!
//! A page with a vpack body loads in two stages: its body is read (the device's
//! work), then decoded into the page's slot (a core's). When both stages run on one
//! thread, one after the other, and the cache's streaming window holds one layer
//! ahead, the device idles while bodies decode and the cores idle while bodies are
//! read: measured on the out-of-core bench, each prefetch thread read, then decoded,
//! and the device was busy 72% of a run at 1.4 GB/s while it could read 3 GB/s. The
//! body is the smaller form of the page (a vpack body is about two thirds of it), so
//! holding bodies further ahead costs less memory than widening the window of
//! decoded pages would: the engine names the pages that follow its hints
//! ([`crate::source::PageSource::read_ahead`]), their bodies are read here in the
//! order named, as far as the pool has room, and the load that later decodes a page
//! takes its body from here ([`ReadAhead::take`]), waiting for it if it is still
//! being read, instead of reading it then.
//!
//! The pool is one buffer, allocated in 16 KiB units (a body starts on a unit, as it
//! does in its pack file, so a direct read lands in place). A body stays until its
//! page's load takes it; one that nobody takes (its page became resident another
//! way, or the engine's plan changed) is dropped when room is needed and it was
//! staged more than [`STALE_ROUNDS`] read-ahead calls ago. Nothing here changes a
//! page's bytes: a body is decoded and verified like any other copy.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::cache::slots::SlotAllocator;
use crate::cache::PageKey;
use crate::direct::AlignedBuf;

/// The allocation unit of the pool (a pack file's body alignment).
pub const UNIT: usize = 16 << 10;

/// Read-ahead calls after which a body nobody took may be dropped to make room.
pub const STALE_ROUNDS: u64 = 64;

/// A pool of bodies read ahead (see the module docs).
pub struct ReadAhead {
    buf: AlignedBuf,
    state: Mutex<State>,
    /// Signalled when a body lands or its room is freed.
    changed: Condvar,
}

struct State {
    alloc: SlotAllocator,
    bodies: HashMap<PageKey, Body>,
    /// Read-ahead calls so far.
    round: u64,
    /// Bodies reserved so far: a later one lies further ahead in the engine's order.
    seq: u64,
    /// Bodies taken by a load (read ahead and used).
    taken: u64,
    /// Bodies dropped unused (stale, or failed reads).
    dropped: u64,
}

struct Body {
    unit: u32,
    units: u32,
    len: usize,
    state: BodyState,
    round: u64,
    seq: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyState {
    Reading,
    Ready,
    /// Its read failed: the load that wants it reads the body itself (and reports
    /// the error, naming page and file).
    Failed,
    /// A load is decoding it.
    Taken,
}

/// Why [`ReadAhead::reserve`] gave no room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The pool holds the body already (or is reading it).
    Held,
    /// No run of room is free for it.
    NoRoom,
    /// It is empty, or larger than the whole pool: it is never held.
    TooLarge,
}

/// Counters of a [`ReadAhead`] pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReadAheadStats {
    /// Bytes of the pool.
    pub capacity_bytes: u64,
    /// Bodies a load took from the pool.
    pub taken: u64,
    /// Bodies dropped without being used.
    pub dropped: u64,
    /// Bodies held now (being read, read, or being decoded), and their bytes.
    pub held: u64,
    pub held_bytes: u64,
}

impl ReadAhead {
    /// A pool of `bytes` (rounded up to whole units; at least one).
    pub fn new(bytes: usize) -> ReadAhead {
        let units = bytes.div_ceil(UNIT).max(1);
        let buf = AlignedBuf::new(units * UNIT);
        ReadAhead {
            state: Mutex::new(State {
                alloc: SlotAllocator::new(units as u32),
                bodies: HashMap::new(),
                round: 0,
                seq: 0,
                taken: 0,
                dropped: 0,
            }),
            buf,
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    pub fn stats(&self) -> ReadAheadStats {
        let st = self.lock();
        ReadAheadStats {
            capacity_bytes: self.buf.capacity() as u64,
            taken: st.taken,
            dropped: st.dropped,
            held: st.bodies.len() as u64,
            held_bytes: st.bodies.values().map(|b| b.len as u64).sum(),
        }
    }

    /// Starts a read-ahead call: bodies staged before it age by one round.
    pub fn next_round(&self) {
        self.lock().round += 1;
    }

    /// Whether a body of `key` is held or being read.
    pub fn holds(&self, key: PageKey) -> bool {
        self.lock().bodies.contains_key(&key)
    }

    /// Room for the body of `key`, `len` bytes: the start of its bytes in the pool,
    /// which the caller reads the body into and then reports with [`Landing`].
    /// Refused when the pool already holds `key`, or has no run of room for it even
    /// after dropping stale bodies.
    ///
    /// # Safety of the returned pointer
    /// `ptr..ptr + len` is the caller's alone to write until its [`Landing`] lands
    /// (or drops): nothing else is handed those bytes while the body is held.
    pub fn reserve(self: &Arc<Self>, key: PageKey, len: usize) -> Result<Landing, Refused> {
        if len == 0 || len > self.buf.capacity() {
            return Err(Refused::TooLarge);
        }
        let units = len.div_ceil(UNIT) as u32;
        let mut st = self.lock();
        if st.bodies.contains_key(&key) {
            return Err(Refused::Held);
        }
        let unit = match st.alloc.alloc(units) {
            Some(u) => u,
            None => {
                Self::drop_stale(&mut st);
                st.alloc.alloc(units).ok_or(Refused::NoRoom)?
            }
        };
        Ok(self.insert(&mut st, key, unit, units, len))
    }

    /// Room for the body of `key` that a load is about to read itself (it was not
    /// read ahead): made by dropping bodies read ahead but not taken, those furthest
    /// ahead first (they are read again when named again), and otherwise waiting
    /// for bodies being read or decoded to land or be freed, which needs nothing
    /// from the caller, so it always comes. `None` when the body is larger than the
    /// pool, or the pool holds `key` after all (read ahead meanwhile: take it). The
    /// caller must hold no body of this pool while it waits here.
    pub fn reserve_for_load(self: &Arc<Self>, key: PageKey, len: usize) -> Option<Landing> {
        if len == 0 || len > self.buf.capacity() {
            return None;
        }
        let units = len.div_ceil(UNIT) as u32;
        let mut st = self.lock();
        loop {
            if st.bodies.contains_key(&key) {
                return None;
            }
            if let Some(unit) = st.alloc.alloc(units) {
                return Some(self.insert(&mut st, key, unit, units, len));
            }
            let furthest = st
                .bodies
                .iter()
                .filter(|(_, b)| matches!(b.state, BodyState::Ready | BodyState::Failed))
                .max_by_key(|(_, b)| b.seq)
                .map(|(k, _)| *k);
            match furthest {
                Some(k) => {
                    let b = st.bodies.remove(&k).expect("present");
                    st.alloc.free(b.unit, b.units);
                    st.dropped += 1;
                }
                None => st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }

    /// Holds `key`'s body, being read, in `units` units from `unit`.
    fn insert(
        self: &Arc<Self>,
        st: &mut State,
        key: PageKey,
        unit: u32,
        units: u32,
        len: usize,
    ) -> Landing {
        st.seq += 1;
        let (round, seq) = (st.round, st.seq);
        st.bodies.insert(
            key,
            Body {
                unit,
                units,
                len,
                state: BodyState::Reading,
                round,
                seq,
            },
        );
        // SAFETY: `unit * UNIT + len` lies inside the buffer (the allocator hands out
        // units below `units`, and the buffer holds all of them).
        let ptr = unsafe { self.buf.as_ptr().add(unit as usize * UNIT) };
        Landing {
            ahead: Arc::clone(self),
            key,
            ptr,
            len,
            done: false,
        }
    }

    /// Drops bodies that are ready, untaken and older than [`STALE_ROUNDS`] rounds.
    fn drop_stale(st: &mut State) {
        let now = st.round;
        let stale: Vec<PageKey> = st
            .bodies
            .iter()
            .filter(|(_, b)| {
                matches!(b.state, BodyState::Ready | BodyState::Failed)
                    && now.saturating_sub(b.round) > STALE_ROUNDS
            })
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            if let Some(b) = st.bodies.remove(&k) {
                st.alloc.free(b.unit, b.units);
                st.dropped += 1;
            }
        }
    }

    fn land(&self, key: PageKey, ok: bool) {
        let mut st = self.lock();
        if let Some(b) = st.bodies.get_mut(&key) {
            b.state = if ok {
                BodyState::Ready
            } else {
                BodyState::Failed
            };
        }
        drop(st);
        self.changed.notify_all();
    }

    /// The body of `key`, if one was read ahead: waits while its read is in flight.
    /// `None` when none is held, or its read failed (it is dropped then: the caller
    /// reads the body itself). The body's room is freed when the returned guard
    /// drops.
    pub fn take(self: &Arc<Self>, key: PageKey) -> Option<TakenBody> {
        let mut st = self.lock();
        loop {
            let state = st.bodies.get(&key)?.state;
            match state {
                BodyState::Reading => {
                    st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                BodyState::Taken => return None,
                BodyState::Failed => {
                    let b = st.bodies.remove(&key).expect("present");
                    st.alloc.free(b.unit, b.units);
                    st.dropped += 1;
                    return None;
                }
                BodyState::Ready => {
                    let b = st.bodies.get_mut(&key).expect("present");
                    b.state = BodyState::Taken;
                    let (unit, len) = (b.unit, b.len);
                    st.taken += 1;
                    return Some(self.taken_body(key, unit, len));
                }
            }
        }
    }

    fn taken_body(self: &Arc<Self>, key: PageKey, unit: u32, len: usize) -> TakenBody {
        // SAFETY: `unit * UNIT + len` lies inside the buffer (as in `insert`).
        let ptr = unsafe { self.buf.as_ptr().add(unit as usize * UNIT) };
        TakenBody {
            ahead: Arc::clone(self),
            key,
            ptr,
            len,
        }
    }

    /// A load's own read of `key`'s body landed: taken by it at once (no other
    /// load may drop it first), or, if the read failed, freed.
    fn land_taken(self: &Arc<Self>, key: PageKey, ok: bool) -> Option<TakenBody> {
        let mut st = self.lock();
        let b = st.bodies.get_mut(&key)?;
        if !ok {
            let b = st.bodies.remove(&key).expect("present");
            st.alloc.free(b.unit, b.units);
            drop(st);
            self.changed.notify_all();
            return None;
        }
        b.state = BodyState::Taken;
        let (unit, len) = (b.unit, b.len);
        drop(st);
        self.changed.notify_all();
        Some(self.taken_body(key, unit, len))
    }

    fn free(&self, key: PageKey) {
        let mut st = self.lock();
        if let Some(b) = st.bodies.remove(&key) {
            st.alloc.free(b.unit, b.units);
        }
        drop(st);
        self.changed.notify_all();
    }
}

/// Room reserved for a body being read ([`ReadAhead::reserve`]): report the read's
/// result with [`Landing::land`]. Dropped without landing (a read pool that shut
/// down before the read ran), the body counts as failed, so no load waits for it.
pub struct Landing {
    ahead: Arc<ReadAhead>,
    key: PageKey,
    ptr: *mut u8,
    len: usize,
    done: bool,
}

// SAFETY: the pointer is to pool bytes this landing alone may write (see
// `ReadAhead::reserve`); the pool is kept alive by the `Arc`.
unsafe impl Send for Landing {}

impl Landing {
    /// Where the body's bytes go.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The read finished: `ok` whether the bytes are the body's (as read; the load
    /// that takes it decodes and verifies them).
    pub fn land(mut self, ok: bool) {
        self.done = true;
        self.ahead.land(self.key, ok);
    }

    /// The caller's own read finished (room from [`ReadAhead::reserve_for_load`]):
    /// the body, taken by the caller; `None` (its room freed) if the read failed.
    pub fn land_taken(mut self, ok: bool) -> Option<TakenBody> {
        self.done = true;
        self.ahead.land_taken(self.key, ok)
    }
}

impl Drop for Landing {
    fn drop(&mut self) {
        if !self.done {
            self.ahead.land(self.key, false);
        }
    }
}

/// A body taken from the pool; its room is freed when this drops.
pub struct TakenBody {
    ahead: Arc<ReadAhead>,
    key: PageKey,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the body's bytes are only read, and stay unchanged while it is `Taken`
// (nothing writes or hands out its room until this drops); the `Arc` keeps the
// pool alive.
unsafe impl Send for TakenBody {}
// SAFETY: as above: `&TakenBody` only yields `&[u8]`.
unsafe impl Sync for TakenBody {}

impl std::ops::Deref for TakenBody {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` is the body's room, written by its read (which
        // landed before this was made) and unchanged while this lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for TakenBody {
    fn drop(&mut self) {
        self.ahead.free(self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(page: u32) -> PageKey {
        PageKey { model: 1, page }
    }

    fn write(l: &Landing, byte: u8) {
        // SAFETY: the landing's bytes are this test's alone until it lands.
        unsafe { std::ptr::write_bytes(l.ptr(), byte, l.len()) };
    }

    #[test]
    fn a_body_read_ahead_is_taken_once_and_its_room_comes_back() {
        let pool = Arc::new(ReadAhead::new(4 * UNIT));
        let l = pool.reserve(key(1), 3 * UNIT).unwrap();
        assert_eq!(
            pool.reserve(key(1), 3 * UNIT).err(),
            Some(Refused::Held),
            "already held"
        );
        assert_eq!(
            pool.reserve(key(2), 2 * UNIT).err(),
            Some(Refused::NoRoom),
            "one unit is left, not two"
        );
        write(&l, 7);
        l.land(true);
        {
            let body = pool.take(key(1)).unwrap();
            assert_eq!(body.len(), 3 * UNIT);
            assert!(body.iter().all(|&b| b == 7));
            assert!(pool.take(key(1)).is_none(), "a load is decoding it");
        }
        assert!(!pool.holds(key(1)));
        assert!(pool.take(key(1)).is_none());
        assert!(pool.reserve(key(2), 4 * UNIT).is_ok(), "the room is back");
        assert_eq!(pool.stats().taken, 1);
    }

    #[test]
    fn a_take_waits_for_the_read_in_flight() {
        let pool = Arc::new(ReadAhead::new(2 * UNIT));
        let l = pool.reserve(key(5), 100).unwrap();
        let reader = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            write(&l, 9);
            l.land(true);
        });
        let body = pool.take(key(5)).expect("waits, then takes");
        assert_eq!(&*body, &[9u8; 100][..]);
        reader.join().unwrap();
    }

    #[test]
    fn a_failed_or_abandoned_read_is_no_body_and_frees_its_room() {
        let pool = Arc::new(ReadAhead::new(2 * UNIT));
        pool.reserve(key(1), UNIT).unwrap().land(false);
        assert!(pool.take(key(1)).is_none());
        drop(pool.reserve(key(2), UNIT).unwrap());
        assert!(pool.take(key(2)).is_none(), "dropped unlanded: failed");
        assert!(
            pool.reserve(key(3), 2 * UNIT).is_ok(),
            "both rooms are back"
        );
        assert_eq!(pool.stats().dropped, 2);
    }

    #[test]
    fn an_untaken_body_is_dropped_for_room_only_once_stale() {
        let pool = Arc::new(ReadAhead::new(2 * UNIT));
        pool.reserve(key(1), 2 * UNIT).unwrap().land(true);
        for _ in 0..STALE_ROUNDS {
            pool.next_round();
        }
        assert!(pool.reserve(key(2), UNIT).is_err(), "not stale yet");
        pool.next_round();
        assert!(
            pool.reserve(key(2), UNIT).is_ok(),
            "stale: dropped for room"
        );
        assert!(!pool.holds(key(1)));
    }

    #[test]
    fn room_for_a_load_drops_the_bodies_furthest_ahead_first() {
        let pool = Arc::new(ReadAhead::new(4 * UNIT));
        for k in 1..=3 {
            pool.reserve(key(k), UNIT).unwrap().land(true);
        }
        let mine = pool.reserve_for_load(key(9), 2 * UNIT).expect("room made");
        assert!(pool.holds(key(1)) && pool.holds(key(2)));
        assert!(!pool.holds(key(3)), "the furthest ahead goes first");
        let body = mine.land_taken(true).expect("taken at once");
        assert_eq!(body.len(), 2 * UNIT);
        assert!(pool.take(key(9)).is_none(), "the load's own");
        drop(body);
        assert!(!pool.holds(key(9)));
        assert!(
            pool.reserve_for_load(key(8), 5 * UNIT).is_none(),
            "larger than the pool"
        );
        let failed = pool.reserve_for_load(key(7), UNIT).unwrap();
        assert!(failed.land_taken(false).is_none());
        assert!(!pool.holds(key(7)), "a failed read frees its room");
    }

    #[test]
    fn room_for_a_load_waits_for_reads_in_flight_and_bodies_decoding() {
        let pool = Arc::new(ReadAhead::new(2 * UNIT));
        let reading = pool.reserve(key(1), UNIT).unwrap();
        pool.reserve(key(2), UNIT).unwrap().land(true);
        let decoding = pool.take(key(2)).unwrap();
        let p = Arc::clone(&pool);
        let load = std::thread::spawn(move || p.reserve_for_load(key(5), 2 * UNIT).is_some());
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!load.is_finished(), "nothing can be dropped yet");
        reading.land(true);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!load.is_finished(), "one body is still decoding");
        drop(decoding);
        assert!(load.join().unwrap());
        assert!(!pool.holds(key(1)), "dropped once it landed");
    }
}

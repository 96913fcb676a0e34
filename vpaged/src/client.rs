//! The engine's side of the daemon: a [`PageSource`] whose pages live in the daemon's
//! shared arena, mapped read-only in this process. Acquire asks the daemon for a page
//! and returns a lease on its bytes in place (no copy); dropping the lease releases the
//! page at the daemon. If the daemon dies, requests fail with an error naming the
//! socket; leases already held stay readable (the mapping is this process's own).
//!
//! A daemon that never answers does not hang the engine: the handshake and every
//! request are bounded ([`HANDSHAKE_TIMEOUT`], [`DaemonClient::set_request_timeout`]).
//! After a timeout, an end of stream or any failure mid-frame the connection is out of
//! step and every later request fails at once with the first error; the socket itself
//! stays open until the client is dropped, so the daemon keeps the leases the engine
//! still holds (closing it would let the daemon reuse their slots under the engine).

use std::io::{ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use voom_formats::manifest::{Manifest, MANIFEST_FILE};

use crate::arena::ArenaView;
use crate::protocol::{
    read_frame, recv_frame_with_fd, write_frame, Frame, FrameDecoder, Message, ModelId,
    ProtocolError, Version, FLAG_NO_REPLY, PROTOCOL_VERSION,
};
use crate::source::{PageId, PageLease, PageMeta, PageSource};
use crate::StoreError;

struct Conn {
    stream: UnixStream,
    next_id: u32,
    /// Frames that want no reply (prefetch hints, releases; protocol 1.2), written
    /// with the next request or by [`DaemonClient::flush`]: one write, one wake-up of
    /// the daemon, instead of one each.
    pending: Vec<u8>,
    /// Why the connection can no longer be used (it is out of step with the daemon).
    broken: Option<String>,
    /// The socket's read and write timeout (for error messages).
    timeout: Option<Duration>,
}

impl Conn {
    fn take_id(&mut self) -> u32 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(2);
        id
    }

    /// Marks the connection unusable; returns the reason, for the error at hand.
    fn break_with(&mut self, reason: String) -> String {
        self.pending.clear();
        self.broken = Some(reason.clone());
        reason
    }
}

/// Longest the daemon may take to answer `Hello`.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest a request may wait for its reply (or a write for the daemon to take the
/// bytes), by default: far above any bounded wait in the daemon (a cache full of
/// loading pages, a NAS timeout), so only a daemon that is stuck reaches it.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// Longest `OpenModel` may take by default: the daemon hashes a checkpoint that has
/// no manifest when it is first opened (about a minute per 100 GB at the storage
/// speeds of a laptop's SSD, longer from a NAS).
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(3600);

/// Whether an I/O failure is a socket timeout.
fn timed_out(e: &ProtocolError) -> bool {
    matches!(e, ProtocolError::Io(x) if matches!(x.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut))
}

/// A connection to the daemon.
pub struct DaemonClient {
    socket: PathBuf,
    conn: Mutex<Conn>,
    arena: ArenaView,
    server_id: u64,
    /// The negotiated protocol minor version.
    minor: u16,
}

/// Sets the read and write timeouts of `stream`.
fn set_timeouts(stream: &UnixStream, t: Option<Duration>) -> std::io::Result<()> {
    stream.set_read_timeout(t)?;
    stream.set_write_timeout(t)
}

impl DaemonClient {
    fn err(socket: &Path, detail: impl std::fmt::Display) -> StoreError {
        StoreError::Daemon {
            socket: socket.to_path_buf(),
            detail: detail.to_string(),
        }
    }

    /// Connects, says hello and maps the arena read-only. The daemon must answer
    /// within [`HANDSHAKE_TIMEOUT`]; requests then wait at most
    /// [`DEFAULT_REQUEST_TIMEOUT`] (see [`set_request_timeout`](Self::set_request_timeout)).
    pub fn connect(socket: &Path, name: &str) -> Result<Arc<DaemonClient>, StoreError> {
        let e = |d: String| Self::err(socket, d);
        let mut stream =
            UnixStream::connect(socket).map_err(|x| e(format!("cannot connect: {x}")))?;
        crate::socket_path::check_peer(&stream).map_err(e)?;
        set_timeouts(&stream, Some(HANDSHAKE_TIMEOUT)).map_err(|x| e(x.to_string()))?;
        let hello = Message::Hello {
            version: PROTOCOL_VERSION,
            pid: std::process::id(),
            name: name.to_string(),
        };
        let sent = write_frame(
            &mut stream,
            &hello.to_frame(1).map_err(|x| e(x.to_string()))?,
        );
        let mut dec = FrameDecoder::new();
        if let Err(x) = sent {
            // A daemon that turns the connection away (too many sessions) writes why
            // and closes before reading Hello: the refusal is the error to report.
            if let Ok(Some((f, _))) = recv_frame_with_fd(&stream, &mut dec) {
                if let Ok(Message::Error { code, message }) = Message::decode(&f) {
                    return Err(e(format!("refused ({code:?}): {message}")));
                }
            }
            return Err(e(format!("handshake: {x}")));
        }
        let (frame, fd) = recv_frame_with_fd(&stream, &mut dec)
            .map_err(|x| {
                if timed_out(&x) {
                    e(format!("no answer to Hello within {HANDSHAKE_TIMEOUT:?}"))
                } else {
                    e(format!("handshake: {x}"))
                }
            })?
            .ok_or_else(|| e("the daemon closed the connection during the handshake".into()))?;
        let (arena_len, server_id, minor) =
            match Message::decode(&frame).map_err(|x| e(x.to_string()))? {
                Message::Welcome {
                    arena_len,
                    server_id,
                    version,
                } => (arena_len, server_id, Self::check_version(socket, version)?),
                Message::Error { code, message } => {
                    return Err(e(format!("refused ({code:?}): {message}")))
                }
                other => {
                    return Err(e(format!(
                        "unexpected {} during the handshake",
                        other.name()
                    )))
                }
            };
        let fd = fd.ok_or_else(|| e("the daemon sent no arena descriptor".into()))?;
        let arena = ArenaView::map_readonly(fd, arena_len as usize)
            .map_err(|x| e(format!("cannot map the arena: {x}")))?;
        set_timeouts(&stream, Some(DEFAULT_REQUEST_TIMEOUT)).map_err(|x| e(x.to_string()))?;
        Ok(Arc::new(DaemonClient {
            socket: socket.to_path_buf(),
            conn: Mutex::new(Conn {
                stream,
                next_id: 2,
                pending: Vec::new(),
                broken: None,
                timeout: Some(DEFAULT_REQUEST_TIMEOUT),
            }),
            arena,
            server_id,
            minor,
        }))
    }

    /// The minor version to speak, from the version in `Welcome`: the daemon's choice
    /// must have our major; a minor above ours (a daemon that sent its own version
    /// rather than the negotiated one) is brought down to ours.
    fn check_version(socket: &Path, welcome: Version) -> Result<u16, StoreError> {
        PROTOCOL_VERSION
            .negotiate(welcome)
            .map(|v| v.minor)
            .ok_or_else(|| {
                Self::err(
                    socket,
                    format!("the daemon answered with protocol {welcome}; this client speaks {PROTOCOL_VERSION}"),
                )
            })
    }

    /// The longest a request waits for its reply (and a write for the daemon to take
    /// its bytes); `None` waits forever. A request that times out breaks the
    /// connection (see the module doc).
    pub fn set_request_timeout(&self, timeout: Option<Duration>) -> Result<(), StoreError> {
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        set_timeouts(&c.stream, timeout).map_err(|x| Self::err(&self.socket, x))?;
        c.timeout = timeout;
        Ok(())
    }

    /// The current request timeout ([`DaemonClient::set_request_timeout`]).
    pub fn request_timeout(&self) -> Option<Duration> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner()).timeout
    }

    /// The negotiated protocol version.
    pub fn version(&self) -> Version {
        Version {
            major: PROTOCOL_VERSION.major,
            minor: self.minor,
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// This process's read-only mapping of the daemon's arena.
    pub fn arena(&self) -> &ArenaView {
        &self.arena
    }

    /// Identifies the daemon instance (changes when it restarts).
    pub fn server_id(&self) -> u64 {
        self.server_id
    }

    /// Sends a request (after any deferred frames, in the same write) and waits for its
    /// reply. Replies to earlier messages that nobody waits for are skipped; an error
    /// among them is logged. An `Error` reply is an error.
    fn request(&self, m: &Message) -> Result<Message, StoreError> {
        let frame = self.exchange(m)?;
        match Message::decode(&frame).map_err(|x| Self::err(&self.socket, x))? {
            Message::Error { code, message } => {
                Err(Self::err(&self.socket, format!("{code:?}: {message}")))
            }
            reply => Ok(reply),
        }
    }

    /// Sends a request and returns its reply frame, not decoded. Fails at once on a
    /// broken connection; a failure here breaks it.
    /// Marks the connection unusable (the daemon answered out of protocol): every
    /// later request fails at once naming `why`. Returns `why`.
    fn mark_broken(&self, why: String) -> String {
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        c.break_with(why)
    }

    fn exchange(&self, m: &Message) -> Result<Frame, StoreError> {
        let e = |d: String| Self::err(&self.socket, d);
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &c.broken {
            return Err(e(format!(
                "{} not sent: the connection is unusable since: {why}",
                m.name()
            )));
        }
        let id = c.take_id();
        let mut bytes = std::mem::take(&mut c.pending);
        m.to_frame(id)
            .and_then(|f| f.encode_into(&mut bytes))
            .map_err(|x| e(x.to_string()))?;
        if let Err(x) = c.stream.write_all(&bytes) {
            let why = match x.kind() {
                ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
                    "the daemon did not take the {} request within {:?}",
                    m.name(),
                    c.timeout.unwrap_or_default()
                ),
                _ => format!("{} request failed: {x}", m.name()),
            };
            return Err(e(c.break_with(why)));
        }
        loop {
            let frame = match read_frame(&mut c.stream) {
                Ok(Some(f)) => f,
                Ok(None) => {
                    return Err(e(c.break_with(format!(
                        "the daemon closed the connection before replying to {}",
                        m.name()
                    ))))
                }
                Err(x) if timed_out(&x) => {
                    let why = format!(
                        "no reply to {} within {:?}",
                        m.name(),
                        c.timeout.unwrap_or_default()
                    );
                    return Err(e(c.break_with(why)));
                }
                Err(x) => {
                    return Err(e(
                        c.break_with(format!("reading the reply to {}: {x}", m.name()))
                    ))
                }
            };
            if frame.request_id == id {
                return Ok(frame);
            }
            if let Ok(Message::Error { message, .. }) = Message::decode(&frame) {
                tracing::warn!("vpaged: an earlier release or prefetch failed: {message}");
            }
        }
    }

    /// Sends a message whose reply nobody waits for (`Prefetch`, `Release`). With a
    /// daemon of protocol 1.2 or later it is deferred to the next request or
    /// [`flush`](Self::flush) and asks for no reply; with an older one it is written
    /// now and its `Ack` is skipped later. Nothing is sent on a broken connection.
    fn send(&self, m: &Message) {
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if c.broken.is_some() {
            return;
        }
        let id = c.take_id();
        let Ok(mut f) = m.to_frame(id) else { return };
        if self.minor >= 2 {
            f.flags = FLAG_NO_REPLY;
            let mut pending = std::mem::take(&mut c.pending);
            let _ = f.encode_into(&mut pending);
            c.pending = pending;
        } else if let Err(x) = write_frame(&mut c.stream, &f) {
            c.break_with(format!("{} failed: {x}", m.name()));
        }
    }

    /// Writes the deferred frames now (the end of a forward pass: releases must not
    /// wait for a next request that may be long in coming).
    pub fn flush(&self) {
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if !c.pending.is_empty() && c.broken.is_none() {
            let bytes = std::mem::take(&mut c.pending);
            if let Err(x) = c.stream.write_all(&bytes) {
                c.break_with(format!("writing deferred releases and hints failed: {x}"));
            }
        }
    }

    /// Closes the connection now: the daemon releases every lease it holds (as when
    /// the engine's process dies). Later requests fail.
    pub fn disconnect(&self) {
        let c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
    }

    /// The daemon's statistics (JSON).
    pub fn stats(&self) -> Result<serde_json::Value, StoreError> {
        match self.request(&Message::Stats)? {
            Message::StatsReply { json } => serde_json::from_str(&json)
                .map_err(|x| Self::err(&self.socket, format!("stats are not JSON: {x}"))),
            other => Err(Self::err(
                &self.socket,
                format!("unexpected {}", other.name()),
            )),
        }
    }
}

/// One model store served by the daemon.
pub struct DaemonSource {
    client: Arc<DaemonClient>,
    model: ModelId,
    pages: Vec<PageMeta>,
}

impl DaemonSource {
    /// Opens the model store at `dir` through the daemon. The page table comes from
    /// the store's manifest, checked against the daemon's by digest.
    pub fn open(client: Arc<DaemonClient>, dir: &Path) -> Result<Self, StoreError> {
        let dir = dir.canonicalize().map_err(|x| StoreError::Store {
            store: dir.to_path_buf(),
            detail: format!("cannot open: {x}"),
        })?;
        let path = dir
            .to_str()
            .ok_or_else(|| DaemonClient::err(client.socket(), "the model path is not UTF-8"))?;
        // The daemon may hash a checkpoint that has no manifest before it answers
        // (minutes for a large one): a longer timeout than other requests, unless a
        // longer one (or none) is set.
        let before = client.request_timeout();
        let longer = before.is_some_and(|t| t < OPEN_TIMEOUT);
        if longer {
            client.set_request_timeout(Some(OPEN_TIMEOUT))?;
        }
        let reply = client.request(&Message::OpenModel { path: path.into() });
        if longer {
            client.set_request_timeout(before)?;
        }
        let (model, count, digest) = match reply? {
            Message::ModelOpened {
                model,
                page_count,
                manifest_digest,
            } => (model, page_count, manifest_digest),
            other => {
                return Err(DaemonClient::err(
                    client.socket(),
                    format!("unexpected {}", other.name()),
                ))
            }
        };
        // Beside the checkpoint, or (a checkpoint the daemon hashed in a directory it
        // could not write) where the daemon says it keeps it.
        let mut manifest_path = dir.join(MANIFEST_FILE);
        if !manifest_path.exists() && client.version().minor >= 3 {
            match client.request(&Message::ManifestPath { model })? {
                Message::ManifestAt { path } => manifest_path = PathBuf::from(path),
                other => {
                    return Err(DaemonClient::err(
                        client.socket(),
                        format!("unexpected {}", other.name()),
                    ))
                }
            }
        }
        let text = voom_formats::file::read_limited(
            &manifest_path,
            voom_formats::manifest::MANIFEST_MAX_BYTES,
        )
        .map_err(|x| StoreError::Store {
            store: dir.clone(),
            detail: format!("cannot read the manifest {}: {x}", manifest_path.display()),
        })?;
        if *blake3::hash(&text).as_bytes() != digest {
            return Err(StoreError::Store {
                store: dir,
                detail: "the daemon opened a different manifest than this one (changed since?)"
                    .into(),
            });
        }
        // Parsed from the bytes whose digest was checked (no second read).
        let manifest = Manifest::from_bytes(&manifest_path, &text)?;
        let pages: Vec<PageMeta> = manifest.pages.iter().map(PageMeta::from_entry).collect();
        if pages.len() != count as usize {
            return Err(DaemonClient::err(
                client.socket(),
                "page count differs from the daemon's",
            ));
        }
        Ok(DaemonSource {
            client,
            model,
            pages,
        })
    }
}

impl DaemonSource {
    /// The daemon's id of this model store (as in its stats).
    pub fn model_id(&self) -> ModelId {
        self.model
    }

    /// Asks the daemon to copy this model's most requested pages onto its fast tier,
    /// up to `max_bytes`; returns (pages, bytes) staged.
    pub fn stage(&self, max_bytes: u64) -> Result<(u64, u64), StoreError> {
        self.summary(&Message::Stage {
            model: self.model,
            max_bytes,
        })
    }

    /// Asks the daemon to remove this model's pages from its fast tier.
    pub fn unstage(&self) -> Result<(u64, u64), StoreError> {
        self.summary(&Message::Unstage { model: self.model })
    }

    fn summary(&self, m: &Message) -> Result<(u64, u64), StoreError> {
        let bad = |d: String| DaemonClient::err(self.client.socket(), d);
        match self.client.request(m)? {
            Message::StatsReply { json } => {
                let v: serde_json::Value =
                    serde_json::from_str(&json).map_err(|e| bad(e.to_string()))?;
                Ok((
                    v["pages"].as_u64().unwrap_or(0),
                    v["bytes"].as_u64().unwrap_or(0),
                ))
            }
            other => Err(bad(format!(
                "unexpected reply to {}: {}",
                m.name(),
                other.name()
            ))),
        }
    }
}

/// The pages of one acquire, released together at the daemon (one message) when the
/// engine has dropped the last of their leases.
struct Leased {
    client: Arc<DaemonClient>,
    model: ModelId,
    pages: Vec<PageId>,
}

impl Drop for Leased {
    fn drop(&mut self) {
        self.client.send(&Message::Release {
            model: self.model,
            pages: std::mem::take(&mut self.pages),
        });
    }
}

impl PageSource for DaemonSource {
    fn pages(&self) -> &[PageMeta] {
        &self.pages
    }

    fn acquire(&self, id: PageId) -> Result<PageLease, StoreError> {
        let mut v = self.acquire_many(&[id])?;
        Ok(v.pop().expect("one lease per page"))
    }

    fn acquire_many(&self, ids: &[PageId]) -> Result<Vec<PageLease>, StoreError> {
        let bad = |d: String| DaemonClient::err(self.client.socket(), d);
        let frame = self.client.exchange(&Message::Acquire {
            model: self.model,
            pages: ids.to_vec(),
        })?;
        let slots = match Message::decode(&frame) {
            Ok(Message::Acquired { slots, .. }) if slots.len() == ids.len() => slots,
            // The daemon leased nothing.
            Ok(Message::Error { code, message }) => {
                return Err(bad(format!("{code:?}: {message}")))
            }
            // Anything else may have leased some of the pages, and which is unknown:
            // releasing them all could drop an older lease of this connection that a
            // live PageLease still reads. The connection is marked unusable instead;
            // its leases go when the client is dropped.
            other => {
                let why = match other {
                    Ok(Message::Acquired { slots, .. }) => format!(
                        "the daemon answered Acquire of {} pages with {} slots",
                        ids.len(),
                        slots.len()
                    ),
                    Ok(m) => format!("unexpected reply to Acquire: {}", m.name()),
                    Err(x) => format!("the reply to Acquire does not decode: {x}"),
                };
                return Err(bad(self.client.mark_broken(why)));
            }
        };
        // One holder for the whole batch, created first, so an error below releases
        // every page of it.
        let holder = Arc::new(Leased {
            client: Arc::clone(&self.client),
            model: self.model,
            pages: slots.iter().map(|s| s.page).collect(),
        });
        let mut out = Vec::with_capacity(ids.len());
        for (slot, &id) in slots.iter().zip(ids) {
            if slot.page != id {
                return Err(bad(format!(
                    "the daemon answered page {} for page {}",
                    slot.page.0, id.0
                )));
            }
            let want = self.pages.get(id.0 as usize).map(|p| p.len);
            if want != Some(slot.len) {
                return Err(bad(format!(
                    "page {} has {} bytes at the daemon, {want:?} here",
                    id.0, slot.len
                )));
            }
            // SAFETY: the daemon leased this slot to this connection (`Acquired`), and
            // the lease is held until the last clone of `holder` drops; the slice only
            // yields the pointer and length the `PageLease` below keeps with `holder`.
            let bytes = unsafe {
                self.client
                    .arena
                    .bytes(slot.offset as usize, slot.len as usize)
            }
            .map_err(|x| bad(x.to_string()))?;
            let (ptr, len) = (bytes.as_ptr(), bytes.len());
            let holder: Arc<Leased> = Arc::clone(&holder);
            // SAFETY: the bytes lie in this process's read-only mapping of the arena,
            // which the client (kept alive by `holder`) owns; the daemon never rewrites
            // a slot while it is leased, and the batch is released only when the last
            // `holder` drops.
            out.push(unsafe { PageLease::new(id, ptr, len, holder) });
        }
        Ok(out)
    }

    fn prefetch(&self, ids: &[PageId]) {
        if !ids.is_empty() {
            self.client.send(&Message::Prefetch {
                model: self.model,
                pages: ids.to_vec(),
            });
        }
    }

    /// Asks a daemon that knows `Resident` (since 1.6) whether its cache holds every
    /// one of `ids`; an older daemon, or a failed request (the acquire that follows
    /// reports any error), answers `true`: the caller keeps its order.
    fn ready(&self, ids: &[PageId]) -> bool {
        self.ready_each(&[ids])[0]
    }

    /// [`PageSource::ready`] of each group, in one `Resident` request.
    fn ready_each(&self, groups: &[&[PageId]]) -> Vec<bool> {
        let all: Vec<PageId> = groups.iter().flat_map(|g| g.iter().copied()).collect();
        if all.is_empty() || self.client.version().minor < 6 {
            return vec![true; groups.len()];
        }
        let resident = match self.client.request(&Message::Resident {
            model: self.model,
            pages: all.clone(),
        }) {
            Ok(Message::ResidentPages { resident }) if resident.len() == all.len() => resident,
            _ => return vec![true; groups.len()],
        };
        let mut at = 0;
        groups
            .iter()
            .map(|g| {
                let r = resident[at..at + g.len()].iter().all(|&r| r);
                at += g.len();
                r
            })
            .collect()
    }

    /// Sends `ReadAhead` (since 1.5) to a daemon that knows it; an older one reads
    /// each body when its page loads, as before.
    fn read_ahead(&self, ids: &[PageId]) {
        if !ids.is_empty() && self.client.version().minor >= 5 {
            self.client.send(&Message::ReadAhead {
                model: self.model,
                pages: ids.to_vec(),
            });
        }
    }

    fn budget(&self) -> Option<u64> {
        Some(self.client.arena.len() as u64)
    }

    /// Sends the planner's pins to the daemon (`Pin`, since 1.3), which pins what
    /// fits its pin budget beside other engines' for as long as this connection
    /// lasts, and streams the model's other pages. A daemon that refuses, or speaks
    /// an older protocol, leaves every page streaming: never an error, never a
    /// different result.
    fn pin(&self, ids: &[PageId]) {
        if self.client.version().minor < 3 || ids.is_empty() {
            return;
        }
        for chunk in ids.chunks(crate::protocol::MAX_PAGES_PER_REQUEST) {
            let m = Message::Pin {
                model: self.model,
                pages: chunk.to_vec(),
            };
            match self.client.request(&m) {
                Ok(Message::StatsReply { json }) => {
                    tracing::info!("the daemon pinned pages of this model: {json}")
                }
                Ok(other) => tracing::warn!("Pin answered with {}", other.name()),
                Err(e) => tracing::warn!("the daemon did not pin this model's pages: {e}"),
            }
        }
    }

    /// Sends the planner's candidates for the fast tier to the daemon (`KeepFast`,
    /// since 1.4), in parts where they are many, most valuable first; the daemon
    /// keeps what its fast tier has room for. A daemon without a fast tier, or with
    /// an older protocol, keeps nothing: never an error, never a different result.
    fn keep_on_fast_tier(&self, by_value: &[PageId]) {
        if self.client.version().minor < 4 {
            return;
        }
        let mut parts = by_value.chunks(crate::protocol::MAX_PAGES_PER_REQUEST);
        let first = parts.next().unwrap_or(&[]);
        for (k, part) in std::iter::once(first).chain(parts).enumerate() {
            let m = Message::KeepFast {
                model: self.model,
                append: k > 0,
                pages: part.to_vec(),
            };
            match self.client.request(&m) {
                Ok(Message::StatsReply { json }) => {
                    tracing::info!("the daemon's fast tier keeps pages of this model: {json}")
                }
                Ok(other) => tracing::warn!("KeepFast answered with {}", other.name()),
                Err(e) => {
                    tracing::warn!("the daemon's fast tier keeps none of this model's pages: {e}");
                    return;
                }
            }
        }
    }

    fn flush(&self) {
        self.client.flush();
    }

    /// The daemon's cache counters (one Stats round trip); `None` if it cannot be
    /// asked.
    fn cache_stats(&self) -> Option<crate::source::SourceCacheStats> {
        let v = self.client.stats().ok()?;
        let c = &v["cache"];
        let n = |k: &str| c[k].as_u64().unwrap_or(0);
        // This model's tiers (in the full stats document; 0 where it was cut short).
        let me = v["models"]
            .as_array()
            .and_then(|ms| ms.iter().find(|m| m["id"] == self.model.0));
        let tier = |k: &str| me.and_then(|m| m[k]["bytes"].as_u64()).unwrap_or(0);
        let local = me.is_some_and(|m| m["location"] == "file");
        Some(crate::source::SourceCacheStats {
            hits: n("hits"),
            misses: n("misses"),
            bytes_loaded: n("bytes_loaded"),
            inflight_waits: n("inflight_dedups"),
            prefetch_loads: n("prefetch_loads"),
            prefetch_skipped: n("prefetch_skipped"),
            unused_evictions: n("unused_evictions"),
            bodies_read_ahead: v["read_ahead"]["taken"].as_u64().unwrap_or(0),
            fast_tier_bytes: v["fast_tier"]["stats"]["bytes"].as_u64().unwrap_or(0),
            primary_bytes: if local { tier("primary") } else { 0 },
            nas_bytes: tier("nas"),
            used_bytes: n("used"),
            capacity_bytes: n("capacity"),
            withheld_bytes: n("withheld"),
        })
    }

    /// The daemon publishes a page in its arena only once it is verified (a daemon
    /// the client checked is running as this user or root: `DaemonClient::connect`).
    fn verifies(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        format!("vpaged:{}", self.client.socket().display())
    }
}

//! The page daemon's server side: engines connect over a Unix socket, receive the
//! arena's descriptor (read-only) at the handshake, open model stores, and lease pages
//! by id; replies give each page's offset in the arena. A connection's leases are
//! released when it closes, however it closes.
//!
//! The accept loop and signal handling run on tokio. Each connection is served by a
//! blocking thread of its own: a session is a strict request/reply stream (requests
//! are answered one by one, in order) whose requests block on storage reads anyway,
//! engines are few, and blocking sockets make descriptor passing simple. A request's
//! work that may wait on storage ([`crate::request_work`]: opening a model store,
//! leasing pages not resident, staging) runs on a thread of its own while the session
//! watches its client ([`crate::watch`]): a client that hangs up mid-request ends its
//! session at once (slot and leases freed, the work abandoned), and work that outlives
//! [`DaemonLimits::request_timeout`] is answered with an error. Cache hits, releases,
//! hints and stats are answered on the session's thread.
//!
//! Robustness: a connection that fails to be set up is logged and dropped, never the
//! daemon; accept errors (out of descriptors) back off instead of spinning; a peer
//! must send `Hello` within [`DaemonLimits::hello_timeout`]; at most
//! [`DaemonLimits::max_sessions`] sessions run at once (more are refused with an
//! error). The server shuts a session's socket both ways when the session ends, so the
//! peer sees the end of the stream. On shutdown the listener stops, every session's
//! socket is shut for reading (the session finishes the request in hand and ends),
//! sessions get [`DaemonLimits::drain_grace`] to do so, then their sockets are shut
//! both ways (a session blocked writing to a peer that does not read fails its write,
//! one waiting on storage work abandons it), and the socket file is removed.

use std::collections::{HashMap, HashSet};
use std::io::{BufReader, ErrorKind};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cache::Lease;
use crate::protocol::{
    peer_uid, read_frame, send_frame_with_fd, write_frame, ErrorCode, Frame, Message, ModelId,
    ProtocolError, Slot, FLAG_NO_REPLY, MAX_STATS_LEN, PROTOCOL_VERSION,
};
use crate::request_work::{Done, Work};
use crate::store::{OpenModel, Store};
use crate::watch::{Outcome, Watch};
use crate::{PageId, StoreError};

/// Counters of the daemon's sessions, for stats.
#[derive(Default)]
pub struct SessionCounters {
    pub connected: AtomicUsize,
    pub total: AtomicU64,
    pub leases: AtomicUsize,
}

/// Bounds that keep idle, slow or too many peers from taking the daemon down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonLimits {
    /// Most sessions served at once; a connection beyond is refused (an `Error` frame
    /// with code `Unavailable`, then closed) and logged.
    pub max_sessions: usize,
    /// Longest a new connection may take to send its `Hello`; then it is closed.
    pub hello_timeout: Duration,
    /// On shutdown, how long sessions get to finish the request in hand before their
    /// sockets are shut both ways.
    pub drain_grace: Duration,
    /// Longest a session waits for a request's storage work (opening a model store,
    /// loading pages, unstaging) before answering `Error{Unavailable}` and abandoning it;
    /// `Stage` is not bounded (see [`Work::deadline`]).
    pub request_timeout: Duration,
}

/// Sessions served at once by default.
pub const DEFAULT_MAX_SESSIONS: usize = 128;

/// The default [`DaemonLimits::request_timeout`]: far beyond what a healthy store takes
/// (a NAS read gives up after its own timeout), and below the engine's own request
/// timeout ([`crate::client::DEFAULT_REQUEST_TIMEOUT`]), so the engine gets the
/// daemon's error rather than a timeout of its own.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

impl Default for DaemonLimits {
    fn default() -> Self {
        DaemonLimits {
            max_sessions: DEFAULT_MAX_SESSIONS,
            hello_timeout: Duration::from_secs(10),
            drain_grace: Duration::from_secs(3),
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }
}

/// First pause after a failed accept; it doubles on each failure in a row.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(50);
/// Longest pause after a failed accept.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Longest the accept loop waits to write a refusal to a connection it turns away.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_millis(100);

/// Why a new connection was not made a session (logged; the connection is dropped).
#[derive(Debug, thiserror::Error)]
enum AdmitError {
    #[error("cannot {what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("refused a connection from uid {uid} (the daemon runs as uid {daemon})")]
    ForeignUid { uid: u32, daemon: u32 },
    #[error("refused a connection: {max} sessions are already being served (--max-sessions)")]
    TooMany { max: usize },
}

impl AdmitError {
    fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> AdmitError {
        move |source| AdmitError::Io { what, source }
    }
}

/// A running session as the daemon tracks it: a handle on its socket (to shut it at
/// shutdown) and its thread.
struct SessionEntry {
    control: UnixStream,
    /// Set right after the thread starts; `None` only in between.
    thread: Option<JoinHandle<()>>,
}

impl SessionEntry {
    fn finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

pub struct Daemon {
    store: Arc<Store>,
    server_id: u64,
    counters: Arc<SessionCounters>,
    limits: DaemonLimits,
    /// Live sessions by id; a session removes itself when it ends.
    sessions: Mutex<HashMap<u64, SessionEntry>>,
    next_session: AtomicU64,
}

fn error_code(e: &StoreError) -> ErrorCode {
    match e {
        StoreError::Integrity { .. } | StoreError::Corrupt { .. } => ErrorCode::Integrity,
        StoreError::NoSuchPage { .. } | StoreError::NotFound { .. } => ErrorCode::NotFound,
        StoreError::Format(voom_formats::FormatError::Io { source, .. })
            if source.kind() == ErrorKind::NotFound =>
        {
            ErrorCode::NotFound
        }
        StoreError::Unavailable { .. } | StoreError::Tier(_) => ErrorCode::Unavailable,
        StoreError::Store { detail, .. } if detail.contains("no room") => ErrorCode::Full,
        _ => ErrorCode::Internal,
    }
}

/// A store error as an `Error` reply.
fn store_error(e: &StoreError) -> Message {
    Message::error(error_code(e), e.to_string())
}

/// A read-only descriptor of the arena for a client: on Linux the memfd is reopened
/// read-only through /proc, so the client cannot map it writable.
fn readonly_fd(store: &Store) -> std::io::Result<OwnedFd> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let fd = store.cache().arena().fd().as_raw_fd();
        let f = std::fs::File::open(format!("/proc/self/fd/{fd}"))?;
        Ok(f.into())
    }
    #[cfg(not(target_os = "linux"))]
    {
        store.cache().arena().fd().try_clone_to_owned()
    }
}

/// `reply` as a frame with `request_id`. A reply that cannot be encoded (a bug: every
/// reply is built within the protocol's bounds) becomes an `Internal` error, so the
/// request is still answered and the session goes on.
fn encode_reply(reply: &Message, request_id: u32) -> Frame {
    reply.to_frame(request_id).unwrap_or_else(|e| {
        tracing::error!("cannot encode a {} reply: {e}", reply.name());
        Message::error(
            ErrorCode::Internal,
            format!(
                "the daemon could not encode its {} reply: {e}",
                reply.name()
            ),
        )
        .to_frame(request_id)
        .expect("an Error with a nonzero code and a bounded message always encodes")
    })
}

/// Writes `reply` to the request `request_id`.
fn write_reply(
    w: &mut impl std::io::Write,
    reply: &Message,
    request_id: u32,
) -> Result<(), ProtocolError> {
    write_frame(w, &encode_reply(reply, request_id))
}

/// What ends a session, however its thread leaves: the socket shut both ways, the
/// session counted out and forgotten.
struct SessionEnd<'a> {
    daemon: &'a Daemon,
    id: u64,
    stream: &'a UnixStream,
}

impl Drop for SessionEnd<'_> {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.daemon
            .counters
            .connected
            .fetch_sub(1, Ordering::Relaxed);
        self.daemon.sessions().remove(&self.id);
    }
}

/// Reads from a socket until a deadline: each read waits at most the time left, so a
/// peer that sends a byte now and then cannot stretch the wait.
struct DeadlineReader<'a> {
    stream: &'a UnixStream,
    until: Instant,
}

impl std::io::Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        (&mut &*self.stream).read(buf)
    }
}

/// How much of each model a stats document lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StatsDetail {
    /// Everything, per-page residency and request counts included.
    Full,
    /// Per-model counters, without per-page arrays and tier statistics.
    Summary,
    /// Only the number of open models.
    Totals,
}

/// The model this request names, for the requests that need it open on the connection.
fn model_of(m: &Message) -> Option<ModelId> {
    match m {
        Message::Acquire { model, .. }
        | Message::Prefetch { model, .. }
        | Message::ReadAhead { model, .. }
        | Message::Resident { model, .. }
        | Message::Stage { model, .. }
        | Message::Unstage { model }
        | Message::ManifestPath { model }
        | Message::Pin { model, .. }
        | Message::KeepFast { model, .. } => Some(*model),
        _ => None,
    }
}

impl Daemon {
    /// A daemon over `store` with the default [`DaemonLimits`].
    pub fn new(store: Arc<Store>) -> Arc<Daemon> {
        Self::with_limits(store, DaemonLimits::default())
    }

    pub fn with_limits(store: Arc<Store>, limits: DaemonLimits) -> Arc<Daemon> {
        let server_id = {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            t ^ ((std::process::id() as u64) << 32)
        };
        Arc::new(Daemon {
            store,
            server_id,
            counters: Arc::new(SessionCounters::default()),
            limits,
            sessions: Mutex::new(HashMap::new()),
            next_session: AtomicU64::new(0),
        })
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    pub fn limits(&self) -> &DaemonLimits {
        &self.limits
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, HashMap<u64, SessionEntry>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Serves `listener` until `shutdown` resolves, then drains sessions and removes
    /// `socket_path`. A failure with one connection never ends it.
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::UnixListener,
        socket_path: PathBuf,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> std::io::Result<()> {
        tokio::pin!(shutdown);
        let my_uid = current_uid();
        let mut backoff = ACCEPT_BACKOFF_MIN;
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        backoff = ACCEPT_BACKOFF_MIN;
                        if let Err(e) = self.admit(stream, my_uid) {
                            tracing::warn!("{e}");
                        }
                    }
                    Err(e) => {
                        // Out of descriptors (EMFILE) and the like last until something
                        // closes: retrying at once would spin.
                        tracing::warn!("accept failed: {e}; retrying in {backoff:?}");
                        tokio::select! {
                            _ = &mut shutdown => break,
                            _ = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                    }
                },
            }
        }
        drop(listener);
        let _ = std::fs::remove_file(&socket_path);
        self.drain();
        Ok(())
    }

    /// Makes a new connection a session: a blocking socket, a peer of our uid (or any
    /// peer of a daemon run as root), room under the session cap.
    fn admit(
        self: &Arc<Self>,
        stream: tokio::net::UnixStream,
        my_uid: u32,
    ) -> Result<(), AdmitError> {
        let stream = stream
            .into_std()
            .map_err(AdmitError::io("take the connection's socket"))?;
        stream
            .set_nonblocking(false)
            .map_err(AdmitError::io("make the connection blocking"))?;
        let uid = peer_uid(&stream).map_err(AdmitError::io("read the peer's credentials"))?;
        if uid != my_uid && my_uid != 0 {
            return Err(AdmitError::ForeignUid {
                uid,
                daemon: my_uid,
            });
        }
        let max = self.limits.max_sessions;
        if self.sessions().len() >= max {
            refuse(
                &stream,
                &format!("vpaged serves at most {max} sessions at once; try again later"),
            );
            return Err(AdmitError::TooMany { max });
        }
        self.spawn_session(stream)
    }

    fn spawn_session(self: &Arc<Self>, stream: UnixStream) -> Result<(), AdmitError> {
        let control = stream
            .try_clone()
            .map_err(AdmitError::io("duplicate the connection's socket"))?;
        let id = self.next_session.fetch_add(1, Ordering::Relaxed);
        self.sessions().insert(
            id,
            SessionEntry {
                control,
                thread: None,
            },
        );
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("vpaged-session".into())
            .spawn(move || me.run_session(id, stream));
        let mut sessions = self.sessions();
        match spawned {
            // A session that already ended has removed its entry: its thread is done.
            Ok(thread) => {
                if let Some(e) = sessions.get_mut(&id) {
                    e.thread = Some(thread);
                }
                Ok(())
            }
            Err(e) => {
                sessions.remove(&id);
                Err(AdmitError::Io {
                    what: "start a session thread",
                    source: e,
                })
            }
        }
    }

    /// A session's thread: serves it, then shuts its socket both ways (the peer sees
    /// the end of the stream even while the daemon holds another handle on it) and
    /// forgets it (even if the session panicked, so it never counts against the cap).
    fn run_session(&self, id: u64, stream: UnixStream) {
        self.counters.connected.fetch_add(1, Ordering::Relaxed);
        self.counters.total.fetch_add(1, Ordering::Relaxed);
        let _forget = SessionEnd {
            daemon: self,
            id,
            stream: &stream,
        };
        if let Err(e) = self.session(&stream) {
            tracing::info!("session ended: {e}");
        }
    }

    /// Ends every session: shuts their sockets for reading, gives them
    /// [`DaemonLimits::drain_grace`] to finish, shuts the rest both ways and gives
    /// them one more grace period; joins those that ended (shutdown is bounded by two
    /// grace periods, whatever a session is doing).
    fn drain(&self) {
        let sessions: Vec<SessionEntry> = self.sessions().drain().map(|(_, e)| e).collect();
        for s in &sessions {
            let _ = s.control.shutdown(std::net::Shutdown::Read);
        }
        let deadline = Instant::now() + self.limits.drain_grace;
        while Instant::now() < deadline && sessions.iter().any(|s| !s.finished()) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let stuck = sessions.iter().filter(|s| !s.finished()).count();
        if stuck > 0 {
            tracing::warn!(
                "{stuck} sessions still busy after {:?} (a peer not reading its replies?): \
                 closing their connections",
                self.limits.drain_grace
            );
            for s in &sessions {
                let _ = s.control.shutdown(std::net::Shutdown::Both);
            }
            // A session inside a long request (a Stage, an Acquire waiting on a slow
            // tier) notices only when the request ends: give it one more grace
            // period, then leave it; the process exits and the arena goes with it.
            let deadline = Instant::now() + self.limits.drain_grace;
            while Instant::now() < deadline && sessions.iter().any(|s| !s.finished()) {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let mut left = 0;
        for s in sessions {
            match s.thread {
                Some(t) if t.is_finished() => {
                    let _ = t.join();
                }
                Some(_) => left += 1,
                None => {}
            }
        }
        if left > 0 {
            tracing::warn!("{left} sessions still inside a request at exit: left behind");
        }
    }

    /// Stats as JSON: cache, tiers, models, sessions.
    pub fn stats_json(&self) -> serde_json::Value {
        self.stats_at(StatsDetail::Full)
    }

    /// Stats as JSON text that fits a `StatsReply` ([`MAX_STATS_LEN`]): the full
    /// document if it fits, else one without the per-page arrays and tier statistics of
    /// each model (`"detail": "summary"`), else one without the model list (`"detail":
    /// "totals"`). Many open models must not make the reply unencodable.
    pub fn stats_text(&self) -> String {
        self.stats_text_within(MAX_STATS_LEN)
    }

    fn stats_text_within(&self, max: usize) -> String {
        for detail in [StatsDetail::Full, StatsDetail::Summary] {
            let text = self.stats_at(detail).to_string();
            if text.len() <= max {
                return text;
            }
        }
        self.stats_at(StatsDetail::Totals).to_string()
    }

    fn model_stats(&self, m: &OpenModel, detail: StatsDetail) -> serde_json::Value {
        let [fast, primary, nas] = m.served_counts();
        let resident: Vec<u32> = (0..m.pages.len() as u32)
            .filter(|&p| {
                self.store.cache().resident(crate::cache::PageKey {
                    model: m.id,
                    page: p,
                })
            })
            .collect();
        let mut v = serde_json::json!({
            "id": m.id,
            "dir": m.dir,
            "current": !m.is_superseded(),
            "pages": m.pages.len(),
            "resident_pages": resident.len(),
            "pinned_pages": m.pinned_pages().len(),
            "served": {"fast": fast, "primary": primary, "nas": nas},
            // Where the model's own directory is: a local file tier or a NAS mount
            // (then `primary` and `nas` below are the same tier).
            "location": match m.location() {
                crate::tier::ModelTier::File(_) => "file",
                crate::tier::ModelTier::Nas(_) => "nas",
            },
        });
        if detail == StatsDetail::Full {
            v["primary"] = serde_json::json!(m.primary_stats());
            v["nas"] = serde_json::json!(m.nas_stats());
            v["resident"] = resident.into();
            v["accesses"] = m.access_counts().into();
        }
        v
    }

    fn stats_at(&self, detail: StatsDetail) -> serde_json::Value {
        let c = self.store.cache_stats();
        let open = self.store.models();
        let mut v = serde_json::json!({
            "server_id": self.server_id,
            "detail": match detail {
                StatsDetail::Full => "full",
                StatsDetail::Summary => "summary",
                StatsDetail::Totals => "totals",
            },
            "cache": {
                "capacity": c.capacity, "used": c.used, "withheld": c.withheld, "leased_bytes": c.leased_bytes,
                "pinned_bytes": c.pinned_bytes, "resident_pages": c.resident_pages,
                "hits": c.hits, "misses": c.misses, "inflight_dedups": c.inflight_dedups,
                "evictions": c.evictions, "bytes_loaded": c.bytes_loaded,
                "loads": c.loads, "prefetch_loads": c.prefetch_loads,
                "prefetch_skipped": c.prefetch_skipped,
                "unused_evictions": c.unused_evictions,
                "load_failures": c.load_failures, "full_refusals": c.full_refusals,
                "hit_ratio": if c.hits + c.misses == 0 { 0.0 } else { c.hits as f64 / (c.hits + c.misses) as f64 },
            },
            // Bodies read ahead of their pages' slots (absent until a model with
            // vpack bodies opens).
            "read_ahead": self.store.read_ahead_stats(),
            "fast_tier": self.store.fast_tier().map(|f| serde_json::json!({
                "dir": f.dir(), "capacity": f.capacity(), "used": f.used(), "stats": f.stats(),
            })),
            "open_models": open.len(),
            "sessions": {
                "connected": self.counters.connected.load(Ordering::Relaxed),
                "total": self.counters.total.load(Ordering::Relaxed),
                "leases": self.counters.leases.load(Ordering::Relaxed),
            },
        });
        if detail != StatsDetail::Totals {
            v["models"] = open
                .iter()
                .map(|m| self.model_stats(m, detail))
                .collect::<Vec<_>>()
                .into();
        }
        v
    }

    /// One connection, from its `Hello` to its end.
    fn session(&self, stream: &UnixStream) -> Result<(), ProtocolError> {
        if !self.handshake(stream)? {
            return Ok(());
        }
        let mut state = SessionState::default();
        let result = self.serve_requests(stream, &mut state);
        let n: usize = state.leases.values().map(Vec::len).sum();
        self.counters.leases.fetch_sub(n, Ordering::Relaxed);
        drop(state);
        result
    }

    /// Reads `Hello` (within the hello timeout) and answers `Welcome` with the
    /// negotiated version and the arena's descriptor. `Ok(false)`: the peer left, or
    /// was answered with an error and the session ends.
    fn handshake(&self, stream: &UnixStream) -> Result<bool, ProtocolError> {
        let mut hello_reader = DeadlineReader {
            stream,
            until: Instant::now() + self.limits.hello_timeout,
        };
        let first = match read_frame(&mut hello_reader) {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(false),
            Err(ProtocolError::Io(e))
                if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
            {
                tracing::info!(
                    "closed a connection that sent no Hello within {:?}",
                    self.limits.hello_timeout
                );
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        let id = first.request_id;
        let version = match Message::decode(&first) {
            Ok(Message::Hello { version, name, pid }) => {
                match PROTOCOL_VERSION.negotiate(version) {
                    Some(v) => {
                        tracing::info!("engine '{name}' (pid {pid}) connected, protocol {v}");
                        v
                    }
                    None => {
                        let m = Message::error(
                            ErrorCode::Version,
                            format!("protocol {version} is not supported (this daemon speaks {PROTOCOL_VERSION})"),
                        );
                        write_reply(&mut &*stream, &m, id)?;
                        return Ok(false);
                    }
                }
            }
            _ => {
                let m = Message::error(ErrorCode::BadRequest, "the first message must be Hello");
                write_reply(&mut &*stream, &m, id)?;
                return Ok(false);
            }
        };
        stream.set_read_timeout(None)?;
        let fd = readonly_fd(&self.store)?;
        let welcome = Message::Welcome {
            version,
            arena_len: self.store.cache().capacity() as u64,
            server_id: self.server_id,
        };
        send_frame_with_fd(stream, &encode_reply(&welcome, id), fd.as_fd())?;
        Ok(true)
    }

    /// Answers requests, one by one in order, until `Close` or the end of the stream.
    fn serve_requests(
        &self,
        stream: &UnixStream,
        state: &mut SessionState,
    ) -> Result<(), ProtocolError> {
        // Buffered reads: a client batches hints and releases with its next request,
        // and they arrive together.
        let mut reader = BufReader::with_capacity(64 << 10, stream);
        let mut writer = stream;
        while let Some(frame) = read_frame(&mut reader)? {
            let id = frame.request_id;
            let reply = match Message::decode(&frame) {
                Err(e) if e.is_fatal() => return Err(e),
                Err(e) => Message::error(ErrorCode::BadRequest, e.to_string()),
                Ok(Message::Close) => {
                    write_reply(&mut writer, &Message::Ack, id)?;
                    return Ok(());
                }
                Ok(m) => match self.handle(m, state, stream) {
                    Some(reply) => reply,
                    None => {
                        tracing::info!("the client hung up mid-request: session ended");
                        return Ok(());
                    }
                },
            };
            // A hint or release sent with FLAG_NO_REPLY gets an answer only if it
            // failed.
            if frame.flags & FLAG_NO_REPLY != 0 && matches!(reply, Message::Ack) {
                continue;
            }
            write_reply(&mut writer, &reply, id)?;
        }
        Ok(())
    }

    /// The reply to request `m`, or `None` when the client hung up while it ran (the
    /// session then ends).
    fn handle(&self, m: Message, state: &mut SessionState, stream: &UnixStream) -> Option<Message> {
        if let Some(model) = model_of(&m) {
            if !state.opened.contains(&model.0) {
                return Some(Message::error(
                    ErrorCode::BadRequest,
                    format!("model {} is not open on this connection", model.0),
                ));
            }
        }
        let work = match m {
            Message::OpenModel { path } => Work::Open(PathBuf::from(path)),
            Message::Acquire { model, pages } => Work::Acquire { model, pages },
            Message::Stage { model, max_bytes } => Work::Stage { model, max_bytes },
            Message::Unstage { model } => Work::Unstage { model },
            Message::Pin { model, pages } => Work::Pin { model, pages },
            Message::KeepFast {
                model,
                append,
                pages,
            } => Work::KeepFast {
                model,
                append,
                pages,
            },
            Message::Release { model, pages } => {
                return Some(self.release(&mut state.leases, model, pages))
            }
            Message::Prefetch { model, pages } => {
                let pages: Vec<u32> = pages.iter().map(|p| p.0).collect();
                self.store.prefetch_group(model.0, &pages);
                return Some(Message::Ack);
            }
            Message::ReadAhead { model, pages } => {
                let pages: Vec<u32> = pages.iter().map(|p| p.0).collect();
                self.store.read_ahead(model.0, &pages);
                return Some(Message::Ack);
            }
            Message::Resident { model, pages } => {
                let cache = self.store.cache();
                return Some(Message::ResidentPages {
                    resident: pages
                        .iter()
                        .map(|p| {
                            cache.resident(crate::cache::PageKey {
                                model: model.0,
                                page: p.0,
                            })
                        })
                        .collect(),
                });
            }
            Message::Stats => {
                return Some(Message::StatsReply {
                    json: self.stats_text(),
                })
            }
            Message::ManifestPath { model } => {
                return Some(match self.store.model(model.0) {
                    Ok(m) => match m.manifest_path().to_str() {
                        Some(p) => Message::ManifestAt { path: p.into() },
                        None => Message::error(
                            ErrorCode::Internal,
                            format!(
                                "the manifest path {} is not UTF-8",
                                m.manifest_path().display()
                            ),
                        ),
                    },
                    Err(e) => Message::error(ErrorCode::BadRequest, e.to_string()),
                });
            }
            other => {
                return Some(Message::error(
                    ErrorCode::BadRequest,
                    format!("unexpected {} request", other.name()),
                ))
            }
        };
        match self.run_work(work, &mut state.watch, stream) {
            Ok(done) => Some(self.finish(done, state)),
            Err(reply) => reply,
        }
    }

    /// Drops one lease per listed page. All or nothing: a page this connection does not
    /// lease is a bad request and nothing is released.
    fn release(
        &self,
        leases: &mut HashMap<(u32, u32), Vec<Lease>>,
        model: ModelId,
        pages: Vec<PageId>,
    ) -> Message {
        let mut need: HashMap<u32, usize> = HashMap::new();
        for p in &pages {
            *need.entry(p.0).or_default() += 1;
        }
        for (p, n) in &need {
            if leases.get(&(model.0, *p)).map_or(0, Vec::len) < *n {
                return Message::error(
                    ErrorCode::BadRequest,
                    format!(
                        "page {p} of model {} is not leased by this connection",
                        model.0
                    ),
                );
            }
        }
        for p in pages {
            let v = leases.get_mut(&(model.0, p.0)).expect("checked above");
            v.pop();
            if v.is_empty() {
                leases.remove(&(model.0, p.0));
            }
            self.counters.leases.fetch_sub(1, Ordering::Relaxed);
        }
        Message::Ack
    }

    /// Runs a request's store work: in place when it cannot wait on storage (a cache
    /// hit), else on a thread of its own while `stream`'s client is watched
    /// ([`Watch`]). `Err(Some(reply))`: the error to answer with (the work outlived the
    /// request timeout, or could not start); `Err(None)`: the client hung up.
    fn run_work(
        &self,
        work: Work,
        watch: &mut Watch<Done>,
        stream: &UnixStream,
    ) -> Result<Done, Option<Message>> {
        if !work.may_wait_on_storage(&self.store) {
            return Ok(work.run(&self.store));
        }
        let what = work.name();
        let deadline = work.deadline(self.limits.request_timeout);
        let store = Arc::clone(&self.store);
        let failed = |code, message: String| Err(Some(Message::error(code, message)));
        match watch.run(stream, what, deadline, move || work.run(&store)) {
            Outcome::Done(done) => Ok(done),
            Outcome::PeerGone => Err(None),
            Outcome::TimedOut(after) => {
                tracing::warn!("a {what} request did not finish within {after:?}: abandoned");
                failed(
                    ErrorCode::Unavailable,
                    format!(
                        "the {what} request did not finish within {after:?} (storage too slow \
                         or stuck); it was abandoned"
                    ),
                )
            }
            Outcome::StillBusy {
                what: stuck,
                running,
            } => failed(
                ErrorCode::Unavailable,
                format!(
                    "this connection's earlier {stuck} request, abandoned after its timeout, \
                     is still waiting on storage ({:.1}s): no {what} until it ends",
                    running.as_secs_f64()
                ),
            ),
            Outcome::NoThread(e) => failed(
                ErrorCode::Internal,
                format!("cannot run the {what} request: {e}"),
            ),
        }
    }

    /// Applies finished work to the session's state and builds its reply.
    fn finish(&self, done: Done, state: &mut SessionState) -> Message {
        match done {
            Done::Opened(Ok(m)) => {
                state.opened.insert(m.id);
                // The digest of the manifest bytes the store parsed and serves by, never
                // a fresh read of the file.
                Message::ModelOpened {
                    model: ModelId(m.id),
                    page_count: m.pages.len() as u32,
                    manifest_digest: m.manifest_digest,
                }
            }
            Done::Acquired {
                model,
                pages,
                leases: Ok(got),
            } => {
                let slots = pages
                    .iter()
                    .zip(&got)
                    .map(|(p, l)| Slot {
                        page: *p,
                        offset: l.offset() as u64,
                        len: l.len() as u64,
                    })
                    .collect();
                self.counters.leases.fetch_add(got.len(), Ordering::Relaxed);
                for (p, l) in pages.iter().zip(got) {
                    state.leases.entry((model.0, p.0)).or_default().push(l);
                }
                Message::Acquired { model, slots }
            }
            Done::Staged(Ok((pages, bytes))) => Message::StatsReply {
                json: serde_json::json!({"pages": pages, "bytes": bytes}).to_string(),
            },
            Done::Pinned(Ok(pins)) => {
                let reply = Message::StatsReply {
                    json: serde_json::json!({"pinned": pins.pages(), "bytes": pins.bytes()})
                        .to_string(),
                };
                state.pins.push(pins);
                reply
            }
            Done::Opened(Err(e))
            | Done::Acquired { leases: Err(e), .. }
            | Done::Staged(Err(e))
            | Done::Pinned(Err(e)) => store_error(&e),
        }
    }
}

/// What a session holds: the models opened on it, its leases, and its storage work
/// (run where a client hangup is noticed).
#[derive(Default)]
struct SessionState {
    leases: HashMap<(u32, u32), Vec<Lease>>,
    opened: HashSet<u32>,
    /// Pins the session's engine asked for: withdrawn when the session ends.
    pins: Vec<crate::store::PlannedPins>,
    watch: Watch<Done>,
}

/// Binds a listening Unix socket at `path` that only this user can connect to: the
/// socket file is created with mode 0600 (the process umask is set to 0o177 around the
/// `bind`, and restored), so there is no moment when it has the umask's looser mode.
/// The umask is process-wide: call this before other threads create files.
pub fn bind_private(path: &Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    // SAFETY: umask only swaps the process's file-creation mask; it cannot fail.
    let old = unsafe { libc::umask(0o177) };
    let bound = std::os::unix::net::UnixListener::bind(path);
    // SAFETY: as above; this restores the mask found on entry.
    unsafe { libc::umask(old) };
    bound
}

fn current_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// Turns a connection away before its handshake: an `Error{Unavailable}` saying why
/// (best effort, bounded: the peer may not be reading), then the socket is shut.
fn refuse(stream: &UnixStream, why: &str) {
    let _ = stream.set_write_timeout(Some(REFUSAL_WRITE_TIMEOUT));
    let _ = write_reply(
        &mut &*stream,
        &Message::error(ErrorCode::Unavailable, why),
        0,
    );
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use voom_formats::{Checkpoint, DType, Manifest};

    use super::*;
    use crate::store::StoreConfig;

    fn daemon_with_models(n: usize) -> (tempfile::TempDir, Arc<Daemon>) {
        let d = tempfile::tempdir().unwrap();
        let store = Store::new(StoreConfig {
            cache_bytes: 1 << 20,
            ..Default::default()
        })
        .unwrap();
        for i in 0..n {
            let dir = d.path().join(format!("m{i}"));
            std::fs::create_dir_all(&dir).unwrap();
            let names: Vec<String> = (0..20).map(|t| format!("t{t}")).collect();
            let tensors: Vec<(&str, DType, &[usize], &[u8])> = names
                .iter()
                .map(|n| (n.as_str(), DType::F32, &[1usize][..], &[0u8; 4][..]))
                .collect();
            voom_formats::safetensors::write(
                &dir.join("model.safetensors"),
                &tensors,
                &BTreeMap::new(),
            )
            .unwrap();
            Manifest::build(&Checkpoint::open(&dir).unwrap(), &mut |_, _| {})
                .unwrap()
                .save(&dir)
                .unwrap();
            store.open_model(&dir).unwrap();
        }
        (d, Daemon::new(store))
    }

    /// Stats too large for a reply drop per-page detail, then the model list, rather
    /// than fail to encode.
    #[test]
    fn stats_fall_back_to_summaries_when_too_large() {
        let (_d, daemon) = daemon_with_models(3);
        let parse = |t: String| serde_json::from_str::<serde_json::Value>(&t).unwrap();
        let full = parse(daemon.stats_text());
        assert_eq!(full["detail"], "full");
        assert_eq!(full["models"][2]["accesses"].as_array().unwrap().len(), 20);
        let full_len = full.to_string().len();

        let summary = parse(daemon.stats_text_within(full_len - 1));
        assert_eq!(summary["detail"], "summary");
        let m = &summary["models"][2];
        assert_eq!(m["pages"], 20);
        assert!(m["accesses"].is_null() && m["resident"].is_null() && m["primary"].is_null());
        let summary_len = summary.to_string().len();

        let totals = parse(daemon.stats_text_within(summary_len - 1));
        assert_eq!(totals["detail"], "totals");
        assert!(totals["models"].is_null());
        assert_eq!(totals["open_models"], 3);
        assert_eq!(totals["cache"]["capacity"], 1 << 20);
    }

    /// A reply that cannot be encoded is answered with an `Internal` error carrying
    /// the request's id.
    #[test]
    fn an_unencodable_reply_becomes_an_internal_error() {
        let huge = Message::StatsReply {
            json: "x".repeat(MAX_STATS_LEN + 1),
        };
        let f = encode_reply(&huge, 77);
        assert_eq!(f.request_id, 77);
        match Message::decode(&f).unwrap() {
            Message::Error { code, message } => {
                assert_eq!(code, ErrorCode::Internal);
                assert!(message.contains("StatsReply"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let fine = encode_reply(&Message::Ack, 5);
        assert_eq!(Message::decode(&fine).unwrap(), Message::Ack);
    }

    #[test]
    fn error_codes_name_what_failed() {
        let nf = StoreError::NotFound {
            store: "/x".into(),
            detail: "gone".into(),
        };
        assert_eq!(error_code(&nf), ErrorCode::NotFound);
        let nas = StoreError::Tier(crate::tier::TierError::MountUnavailable {
            tier: "nas".into(),
            mount: "/mnt".into(),
            reason: "timed out".into(),
        });
        assert_eq!(error_code(&nas), ErrorCode::Unavailable);
        let other = StoreError::Store {
            store: "/x".into(),
            detail: "odd".into(),
        };
        assert_eq!(error_code(&other), ErrorCode::Internal);
    }
}

//! The page daemon's server side: engines connect over a Unix socket, receive the
//! arena's descriptor (read-only) at the handshake, open model stores, and lease pages
//! by id; replies give each page's offset in the arena. A connection's leases are
//! released when it closes, however it closes.
//!
//! The accept loop and signal handling run on tokio. Each connection is served by a
//! blocking thread of its own: a session is a strict request/reply stream whose
//! requests block on storage reads anyway, engines are few, and blocking sockets make
//! descriptor passing simple. On shutdown the listener stops, every session's socket
//! is shut for reading (the session finishes the request in hand and ends), and the
//! socket file is removed.

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::cache::Lease;
use crate::protocol::{
    peer_uid, read_frame, send_frame_with_fd, write_frame, ErrorCode, Message, ModelId, Slot,
    FLAG_NO_REPLY, PROTOCOL_VERSION,
};
use crate::store::Store;
use crate::StoreError;

/// Counters of the daemon's sessions, for stats.
#[derive(Default)]
pub struct SessionCounters {
    pub connected: AtomicUsize,
    pub total: AtomicU64,
    pub leases: AtomicUsize,
}

pub struct Daemon {
    store: Arc<Store>,
    server_id: u64,
    counters: Arc<SessionCounters>,
    sessions: Mutex<Vec<(UnixStream, std::thread::JoinHandle<()>)>>,
}

fn error_code(e: &StoreError) -> ErrorCode {
    match e {
        StoreError::Integrity { .. } => ErrorCode::Integrity,
        StoreError::NoSuchPage { .. } => ErrorCode::NotFound,
        StoreError::Unavailable { .. } | StoreError::Tier(_) => ErrorCode::Unavailable,
        StoreError::Store { detail, .. } if detail.contains("no room") => ErrorCode::Full,
        _ => ErrorCode::Internal,
    }
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

impl Daemon {
    pub fn new(store: Arc<Store>) -> Arc<Daemon> {
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
            sessions: Mutex::new(Vec::new()),
        })
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Serves `listener` until `shutdown` resolves, then drains sessions and removes
    /// `socket_path`.
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::UnixListener,
        socket_path: PathBuf,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> std::io::Result<()> {
        tokio::pin!(shutdown);
        let my_uid = unsafe_uid();
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => {
                    let (stream, _) = match accepted {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::warn!("accept failed: {e}");
                            continue;
                        }
                    };
                    let stream = stream.into_std()?;
                    stream.set_nonblocking(false)?;
                    match peer_uid(&stream) {
                        Ok(uid) if uid == my_uid || my_uid == 0 => {}
                        Ok(uid) => {
                            tracing::warn!("refused a connection from uid {uid}");
                            continue;
                        }
                        Err(e) => {
                            tracing::warn!("cannot read the peer's credentials: {e}");
                            continue;
                        }
                    }
                    self.spawn_session(stream)?;
                }
            }
        }
        drop(listener);
        let _ = std::fs::remove_file(&socket_path);
        let sessions =
            std::mem::take(&mut *self.sessions.lock().unwrap_or_else(|e| e.into_inner()));
        for (s, _) in &sessions {
            let _ = s.shutdown(std::net::Shutdown::Read);
        }
        for (_, h) in sessions {
            let _ = h.join();
        }
        Ok(())
    }

    fn spawn_session(self: &Arc<Self>, stream: UnixStream) -> std::io::Result<()> {
        let control = stream.try_clone()?;
        let me = Arc::clone(self);
        let h = std::thread::Builder::new()
            .name("vpaged-session".into())
            .spawn(move || {
                me.counters.connected.fetch_add(1, Ordering::Relaxed);
                me.counters.total.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = me.session(stream) {
                    tracing::info!("session ended: {e}");
                }
                me.counters.connected.fetch_sub(1, Ordering::Relaxed);
            })?;
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions.retain(|(_, h)| !h.is_finished());
        sessions.push((control, h));
        Ok(())
    }

    /// Stats as JSON: cache, tiers, models, sessions.
    pub fn stats_json(&self) -> serde_json::Value {
        let c = self.store.cache_stats();
        let models: Vec<_> = self
            .store
            .models()
            .iter()
            .map(|m| {
                let [fast, primary, nas] = m.served_counts();
                let resident: Vec<u32> = (0..m.pages.len() as u32)
                    .filter(|&p| {
                        self.store.cache().resident(crate::cache::PageKey {
                            model: m.id,
                            page: p,
                        })
                    })
                    .collect();
                serde_json::json!({
                    "resident": resident,
                    "accesses": m.access_counts(),
                    "id": m.id,
                    "dir": m.dir,
                    "pages": m.pages.len(),
                    "served": {"fast": fast, "primary": primary, "nas": nas},
                    "primary": m.primary_stats(),
                    "nas": m.nas_stats(),
                })
            })
            .collect();
        serde_json::json!({
            "server_id": self.server_id,
            "cache": {
                "capacity": c.capacity, "used": c.used, "leased_bytes": c.leased_bytes,
                "pinned_bytes": c.pinned_bytes, "resident_pages": c.resident_pages,
                "hits": c.hits, "misses": c.misses, "inflight_dedups": c.inflight_dedups,
                "evictions": c.evictions, "bytes_loaded": c.bytes_loaded,
                "loads": c.loads, "prefetch_loads": c.prefetch_loads,
                "load_failures": c.load_failures, "full_refusals": c.full_refusals,
                "hit_ratio": if c.hits + c.misses == 0 { 0.0 } else { c.hits as f64 / (c.hits + c.misses) as f64 },
            },
            "fast_tier": self.store.fast_tier().map(|f| serde_json::json!({
                "dir": f.dir(), "capacity": f.capacity(), "used": f.used(), "stats": f.stats(),
            })),
            "models": models,
            "sessions": {
                "connected": self.counters.connected.load(Ordering::Relaxed),
                "total": self.counters.total.load(Ordering::Relaxed),
                "leases": self.counters.leases.load(Ordering::Relaxed),
            },
        })
    }

    fn session(&self, mut stream: UnixStream) -> Result<(), crate::protocol::ProtocolError> {
        // Handshake: Hello, then Welcome with the arena's descriptor.
        let Some(first) = read_frame(&mut stream)? else {
            return Ok(());
        };
        let id = first.request_id;
        match Message::decode(&first) {
            Ok(Message::Hello { version, name, pid }) => {
                if PROTOCOL_VERSION.negotiate(version).is_none() {
                    let m = Message::Error {
                        code: ErrorCode::Version,
                        message: format!("protocol {version} is not supported (this daemon speaks {PROTOCOL_VERSION})"),
                    };
                    write_frame(&mut stream, &m.to_frame(id)?)?;
                    return Ok(());
                }
                tracing::info!("engine '{name}' (pid {pid}) connected");
            }
            _ => {
                let m = Message::Error {
                    code: ErrorCode::BadRequest,
                    message: "the first message must be Hello".into(),
                };
                write_frame(&mut stream, &m.to_frame(id)?)?;
                return Ok(());
            }
        }
        let fd = readonly_fd(&self.store)?;
        let welcome = Message::Welcome {
            version: PROTOCOL_VERSION,
            arena_len: self.store.cache().capacity() as u64,
            server_id: self.server_id,
        };
        send_frame_with_fd(&stream, &welcome.to_frame(id)?, fd.as_fd())?;
        drop(fd);

        let mut leases: HashMap<(u32, u32), Vec<Lease>> = HashMap::new();
        let mut opened: std::collections::HashSet<u32> = Default::default();
        // Buffered reads: a client batches hints and releases with its next request,
        // and they arrive together.
        let mut reader = std::io::BufReader::with_capacity(64 << 10, stream.try_clone()?);
        let result = (|| {
            while let Some(frame) = read_frame(&mut reader)? {
                let id = frame.request_id;
                let reply = match Message::decode(&frame) {
                    Err(e) if e.is_fatal() => return Err(e),
                    Err(e) => Message::Error {
                        code: ErrorCode::BadRequest,
                        message: e.to_string(),
                    },
                    Ok(Message::Close) => {
                        write_frame(&mut stream, &Message::Ack.to_frame(id)?)?;
                        return Ok(());
                    }
                    Ok(m) => self.handle(m, &mut leases, &mut opened),
                };
                // A hint or release sent with FLAG_NO_REPLY gets an answer only if it
                // failed.
                if frame.flags & FLAG_NO_REPLY != 0 && matches!(reply, Message::Ack) {
                    continue;
                }
                write_frame(&mut stream, &reply.to_frame(id)?)?;
                stream.flush()?;
            }
            Ok(())
        })();
        let n: usize = leases.values().map(Vec::len).sum();
        self.counters.leases.fetch_sub(n, Ordering::Relaxed);
        drop(leases);
        result
    }

    fn handle(
        &self,
        m: Message,
        leases: &mut HashMap<(u32, u32), Vec<Lease>>,
        opened: &mut std::collections::HashSet<u32>,
    ) -> Message {
        let err = |code, message: String| Message::Error { code, message };
        match m {
            Message::OpenModel { path } => match self.store.open_model(Path::new(&path)) {
                Ok(id) => {
                    opened.insert(id);
                    let m = self.store.model(id).expect("just opened");
                    let digest = std::fs::read(m.dir.join(voom_formats::manifest::MANIFEST_FILE))
                        .map(|b| *blake3::hash(&b).as_bytes())
                        .unwrap_or([0; 32]);
                    Message::ModelOpened {
                        model: ModelId(id),
                        page_count: m.pages.len() as u32,
                        manifest_digest: digest,
                    }
                }
                Err(e) => err(ErrorCode::NotFound, e.to_string()),
            },
            Message::Acquire { model, pages } => {
                if !opened.contains(&model.0) {
                    return err(
                        ErrorCode::BadRequest,
                        format!("model {} is not open on this connection", model.0),
                    );
                }
                let mut got = Vec::with_capacity(pages.len());
                for p in &pages {
                    match self.store.acquire(model.0, p.0) {
                        Ok(l) => got.push((p, l)),
                        // None of this request's pages stay leased.
                        Err(e) => return err(error_code(&e), e.to_string()),
                    }
                }
                let slots = got
                    .iter()
                    .map(|(p, l)| Slot {
                        page: **p,
                        offset: l.offset() as u64,
                        len: l.len() as u64,
                    })
                    .collect();
                self.counters.leases.fetch_add(got.len(), Ordering::Relaxed);
                for (p, l) in got {
                    leases.entry((model.0, p.0)).or_default().push(l);
                }
                Message::Acquired { model, slots }
            }
            Message::Release { model, pages } => {
                // All or nothing: a page this connection does not lease is a bad
                // request and nothing is released.
                let mut need: HashMap<u32, usize> = HashMap::new();
                for p in &pages {
                    *need.entry(p.0).or_default() += 1;
                }
                for (p, n) in &need {
                    if leases.get(&(model.0, *p)).map_or(0, Vec::len) < *n {
                        return err(
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
            Message::Prefetch { model, pages } => {
                for p in pages {
                    self.store.prefetch(model.0, p.0);
                }
                Message::Ack
            }
            Message::Stats => Message::StatsReply {
                json: self.stats_json().to_string(),
            },
            Message::Stage { model, .. } | Message::Unstage { model }
                if !opened.contains(&model.0) =>
            {
                err(
                    ErrorCode::BadRequest,
                    format!("model {} is not open on this connection", model.0),
                )
            }
            Message::Stage { model, max_bytes } => match self.store.stage_hot(model.0, max_bytes) {
                Ok((pages, bytes)) => Message::StatsReply {
                    json: serde_json::json!({"pages": pages, "bytes": bytes}).to_string(),
                },
                Err(e) => err(error_code(&e), e.to_string()),
            },
            Message::Unstage { model } => match self.store.unstage(model.0) {
                Ok((pages, bytes)) => Message::StatsReply {
                    json: serde_json::json!({"pages": pages, "bytes": bytes}).to_string(),
                },
                Err(e) => err(error_code(&e), e.to_string()),
            },
            other => err(
                ErrorCode::BadRequest,
                format!("unexpected {} request", other.name()),
            ),
        }
    }
}

fn unsafe_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

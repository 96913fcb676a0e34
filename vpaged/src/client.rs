//! The engine's side of the daemon: a [`PageSource`] whose pages live in the daemon's
//! shared arena, mapped read-only in this process. Acquire asks the daemon for a page
//! and returns a lease on its bytes in place (no copy); dropping the lease releases the
//! page at the daemon. If the daemon dies, requests fail with an error naming the
//! socket; leases already held stay readable (the mapping is this process's own).

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use voom_formats::manifest::{Manifest, MANIFEST_FILE};

use crate::arena::ArenaView;
use crate::protocol::{
    read_frame, recv_frame_with_fd, write_frame, FrameDecoder, Message, ModelId, FLAG_NO_REPLY,
    PROTOCOL_VERSION,
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
}

impl Conn {
    fn take_id(&mut self) -> u32 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(2);
        id
    }
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

impl DaemonClient {
    fn err(socket: &Path, detail: impl std::fmt::Display) -> StoreError {
        StoreError::Daemon {
            socket: socket.to_path_buf(),
            detail: detail.to_string(),
        }
    }

    /// Connects, says hello and maps the arena read-only.
    pub fn connect(socket: &Path, name: &str) -> Result<Arc<DaemonClient>, StoreError> {
        let e = |d: String| Self::err(socket, d);
        let mut stream =
            UnixStream::connect(socket).map_err(|x| e(format!("cannot connect: {x}")))?;
        let hello = Message::Hello {
            version: PROTOCOL_VERSION,
            pid: std::process::id(),
            name: name.to_string(),
        };
        write_frame(
            &mut stream,
            &hello.to_frame(1).map_err(|x| e(x.to_string()))?,
        )
        .map_err(|x| e(x.to_string()))?;
        let mut dec = FrameDecoder::new();
        let (frame, fd) = recv_frame_with_fd(&stream, &mut dec)
            .map_err(|x| e(format!("handshake: {x}")))?
            .ok_or_else(|| e("the daemon closed the connection during the handshake".into()))?;
        let (arena_len, server_id, minor) =
            match Message::decode(&frame).map_err(|x| e(x.to_string()))? {
                Message::Welcome {
                    arena_len,
                    server_id,
                    version,
                } => (arena_len, server_id, version.minor),
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
        Ok(Arc::new(DaemonClient {
            socket: socket.to_path_buf(),
            conn: Mutex::new(Conn {
                stream,
                next_id: 2,
                pending: Vec::new(),
            }),
            arena,
            server_id,
            minor,
        }))
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
    /// among them is logged.
    fn request(&self, m: &Message) -> Result<Message, StoreError> {
        let e = |d: String| Self::err(&self.socket, d);
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let id = c.take_id();
        let mut bytes = std::mem::take(&mut c.pending);
        m.to_frame(id)
            .and_then(|f| f.encode_into(&mut bytes))
            .map_err(|x| e(x.to_string()))?;
        c.stream
            .write_all(&bytes)
            .map_err(|x| e(format!("{} request failed: {x}", m.name())))?;
        loop {
            let frame = read_frame(&mut c.stream)
                .map_err(|x| e(format!("reading the reply to {}: {x}", m.name())))?
                .ok_or_else(|| {
                    e(format!(
                        "the daemon closed the connection before replying to {}",
                        m.name()
                    ))
                })?;
            if frame.request_id == id {
                return match Message::decode(&frame).map_err(|x| e(x.to_string()))? {
                    Message::Error { code, message } => Err(e(format!("{code:?}: {message}"))),
                    reply => Ok(reply),
                };
            }
            if let Ok(Message::Error { message, .. }) = Message::decode(&frame) {
                tracing::warn!("vpaged: an earlier release or prefetch failed: {message}");
            }
        }
    }

    /// Sends a message whose reply nobody waits for (`Prefetch`, `Release`). With a
    /// daemon of protocol 1.2 or later it is deferred to the next request or
    /// [`flush`](Self::flush) and asks for no reply; with an older one it is written
    /// now and its `Ack` is skipped later.
    fn send(&self, m: &Message) {
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let id = c.take_id();
        let Ok(mut f) = m.to_frame(id) else { return };
        if self.minor >= 2 {
            f.flags = FLAG_NO_REPLY;
            let mut pending = std::mem::take(&mut c.pending);
            let _ = f.encode_into(&mut pending);
            c.pending = pending;
        } else {
            let _ = write_frame(&mut c.stream, &f);
        }
    }

    /// Writes the deferred frames now (the end of a forward pass: releases must not
    /// wait for a next request that may be long in coming).
    pub fn flush(&self) {
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if !c.pending.is_empty() {
            let bytes = std::mem::take(&mut c.pending);
            let _ = c.stream.write_all(&bytes);
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
        let (model, count, digest) =
            match client.request(&Message::OpenModel { path: path.into() })? {
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
        let text = std::fs::read(dir.join(MANIFEST_FILE)).map_err(|x| StoreError::Store {
            store: dir.clone(),
            detail: format!("cannot read the manifest: {x}"),
        })?;
        if *blake3::hash(&text).as_bytes() != digest {
            return Err(StoreError::Store {
                store: dir,
                detail: "the daemon opened a different manifest than this one (changed since?)"
                    .into(),
            });
        }
        let manifest = Manifest::load(&dir)?.ok_or_else(|| StoreError::Store {
            store: dir.clone(),
            detail: "no manifest".into(),
        })?;
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
        let reply = self.client.request(&Message::Acquire {
            model: self.model,
            pages: ids.to_vec(),
        })?;
        let slots = match reply {
            Message::Acquired { slots, .. } if slots.len() == ids.len() => slots,
            other => {
                return Err(bad(format!(
                    "unexpected reply to Acquire: {}",
                    other.name()
                )))
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
            let bytes = self
                .client
                .arena
                .bytes(slot.offset as usize, slot.len as usize)
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

    fn budget(&self) -> Option<u64> {
        Some(self.client.arena.len() as u64)
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
        Some(crate::source::SourceCacheStats {
            hits: n("hits"),
            misses: n("misses"),
            bytes_loaded: n("bytes_loaded"),
            used_bytes: n("used"),
            capacity_bytes: n("capacity"),
        })
    }

    fn describe(&self) -> String {
        format!("vpaged:{}", self.client.socket().display())
    }
}

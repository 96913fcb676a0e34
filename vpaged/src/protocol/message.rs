//! Requests and replies, and their payload encoding.
//!
//! Every payload is a fixed sequence of fields, little-endian, with no padding:
//! `u16`, `u32`, `u64`, `digest` (32 raw bytes), `str` (`u32` byte length, then that
//! many bytes of UTF-8) and `pages` (`u32` count, then count `u32` page ids). Byte
//! tables for each message are in `docs/protocol.md`. Decoding checks every field
//! against the bytes present and the protocol's bounds before allocating, and rejects
//! trailing bytes.

use super::frame::{Frame, MAX_PAYLOAD_LEN};
use super::ProtocolError;
use crate::PageId;

/// Protocol major version: a peer with another major is refused (error code
/// [`ErrorCode::Version`]).
pub const PROTOCOL_MAJOR: u16 = 1;
/// Protocol minor version: additions that older peers of the same major can ignore
/// (new messages are only sent to a peer that announced a minor that knows them).
pub const PROTOCOL_MINOR: u16 = 6;
/// The version this build speaks.
pub const PROTOCOL_VERSION: Version = Version {
    major: PROTOCOL_MAJOR,
    minor: PROTOCOL_MINOR,
};

/// Frame flag (since 1.2), allowed on `Prefetch`, `Release` and `ReadAhead` only: the sender wants
/// no `Ack`. The server still answers a failure with an `Error` frame carrying the
/// request id.
pub const FLAG_NO_REPLY: u16 = 0x0001;

/// Longest client name (`Hello.name`), bytes.
pub const MAX_CLIENT_NAME_LEN: usize = 256;
/// Longest model path (`OpenModel.path`), bytes.
pub const MAX_PATH_LEN: usize = 4096;
/// Most pages named by one Acquire / Prefetch / Release (and answered by one Acquired).
pub const MAX_PAGES_PER_REQUEST: usize = 16384;
/// Longest error message (`Error.message`), bytes.
pub const MAX_ERROR_MESSAGE_LEN: usize = 4096;
/// Longest stats document (`StatsReply.json`), bytes.
pub const MAX_STATS_LEN: usize = 512 * 1024;

/// Size of one `Acquired` slot on the wire: page u32, offset u64, len u64.
const SLOT_SIZE: usize = 4 + 8 + 8;

// The largest message must fit in a frame.
const _: () = assert!(8 + MAX_PAGES_PER_REQUEST * SLOT_SIZE <= MAX_PAYLOAD_LEN);
const _: () = assert!(4 + MAX_STATS_LEN <= MAX_PAYLOAD_LEN);

/// Message type codes (the frame's `msg_type`). Client requests are below 0x8000,
/// server replies at or above.
pub mod msg_type {
    pub const HELLO: u16 = 0x0001;
    pub const OPEN_MODEL: u16 = 0x0002;
    pub const ACQUIRE: u16 = 0x0003;
    pub const PREFETCH: u16 = 0x0004;
    pub const RELEASE: u16 = 0x0005;
    pub const STATS: u16 = 0x0006;
    pub const CLOSE: u16 = 0x0007;
    pub const STAGE: u16 = 0x0008;
    pub const UNSTAGE: u16 = 0x0009;
    pub const MANIFEST_PATH: u16 = 0x000A;
    pub const PIN: u16 = 0x000B;
    pub const KEEP_FAST: u16 = 0x000C;
    pub const READ_AHEAD: u16 = 0x000D;
    pub const RESIDENT: u16 = 0x000E;
    pub const ERROR: u16 = 0x8000;
    pub const WELCOME: u16 = 0x8001;
    pub const MODEL_OPENED: u16 = 0x8002;
    pub const ACQUIRED: u16 = 0x8003;
    pub const ACK: u16 = 0x8004;
    pub const STATS_REPLY: u16 = 0x8005;
    pub const MANIFEST_AT: u16 = 0x8006;
    pub const RESIDENT_PAGES: u16 = 0x8007;
}

/// A protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    pub major: u16,
    pub minor: u16,
}

impl Version {
    /// Peers can talk iff their majors are equal; they then use the lower minor.
    pub fn negotiate(self, peer: Version) -> Option<Version> {
        (self.major == peer.major).then(|| Version {
            major: self.major,
            minor: self.minor.min(peer.minor),
        })
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// A model store opened by the daemon: its index among the daemon's open models, the
/// same on every connection that opens the same store (and manifest). A connection may
/// use only the ids the daemon gave it in `ModelOpened`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelId(pub u32);

/// Where one acquired page's bytes lie in the shared arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub page: PageId,
    /// Byte offset into the arena.
    pub offset: u64,
    /// Page length in bytes (its decoded length).
    pub len: u64,
}

/// The error codes of an `Error` frame. Codes this build does not know decode as
/// [`ErrorCode::Other`] so a newer peer's codes never break the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// 1: no such model, page or model id.
    NotFound,
    /// 2: a page failed blake3 verification on every tier holding it.
    Integrity,
    /// 3: the arena has no evictable room (everything is leased or pinned).
    Full,
    /// 4: a well-formed request the server refuses (wrong state, not leased, ...), or a
    /// malformed one it could still attribute to a request id.
    BadRequest,
    /// 5: protocol major version mismatch; the server closes the connection.
    Version,
    /// 6: a bug or unexpected server-side failure.
    Internal,
    /// 7: a storage tier is unreachable or timed out (NAS gone, remount failed).
    Unavailable,
    /// Any other nonzero code (from a newer peer).
    Other(u16),
}

impl ErrorCode {
    pub fn to_u16(self) -> u16 {
        match self {
            ErrorCode::NotFound => 1,
            ErrorCode::Integrity => 2,
            ErrorCode::Full => 3,
            ErrorCode::BadRequest => 4,
            ErrorCode::Version => 5,
            ErrorCode::Internal => 6,
            ErrorCode::Unavailable => 7,
            ErrorCode::Other(c) => c,
        }
    }

    /// `None` for 0, which is not a valid code.
    pub fn from_u16(code: u16) -> Option<ErrorCode> {
        Some(match code {
            0 => return None,
            1 => ErrorCode::NotFound,
            2 => ErrorCode::Integrity,
            3 => ErrorCode::Full,
            4 => ErrorCode::BadRequest,
            5 => ErrorCode::Version,
            6 => ErrorCode::Internal,
            7 => ErrorCode::Unavailable,
            c => ErrorCode::Other(c),
        })
    }
}

/// One protocol message (the payload of one frame).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Client's first frame.
    Hello {
        version: Version,
        pid: u32,
        name: String,
    },
    /// Open a model store by path (as seen by the daemon). Reply: `ModelOpened`.
    OpenModel {
        path: String,
    },
    /// Demand request: lease these pages. Reply: `Acquired` (one slot per page, in
    /// request order) or `Error` (no page of the request is then leased).
    Acquire {
        model: ModelId,
        pages: Vec<PageId>,
    },
    /// Hint: load these pages below demand priority. Reply: `Ack` once queued (not
    /// loaded); no lease is taken.
    Prefetch {
        model: ModelId,
        pages: Vec<PageId>,
    },
    /// Hint (since 1.5): these pages follow the prefetched ones, in this order; read
    /// their encoded bodies ahead of their cache slots as far as there is room.
    /// Reply: `Ack` once queued.
    ReadAhead {
        model: ModelId,
        pages: Vec<PageId>,
    },
    /// Which of these pages the cache holds resident and complete now (since 1.6): a
    /// hint for an engine free to take them in any order (a layer's routed experts).
    /// Reply: `ResidentPages`, one flag per page in request order.
    Resident {
        model: ModelId,
        pages: Vec<PageId>,
    },
    /// Drop one lease on each of these pages. Reply: `Ack` or `Error`.
    Release {
        model: ModelId,
        pages: Vec<PageId>,
    },
    /// Reply: `StatsReply`.
    Stats,
    /// End of session: the server releases every lease of the connection, replies
    /// `Ack` and closes the connection.
    Close,
    /// Copy the model's most requested pages onto the fast tier, up to `max_bytes`.
    /// Reply: `StatsReply` with `{"pages": N, "bytes": N}`.
    Stage {
        model: ModelId,
        max_bytes: u64,
    },
    /// Remove the model's pages from the fast tier. Reply: as for `Stage`.
    Unstage {
        model: ModelId,
    },
    /// Where the daemon keeps the model's page manifest (since 1.3): beside the
    /// checkpoint, or in its state directory for a checkpoint it hashed in a
    /// directory it cannot write. Reply: `ManifestAt`.
    ManifestPath {
        model: ModelId,
    },
    /// The pages an engine's memory planner chose to keep resident (since 1.3): the
    /// daemon pins those that fit its pin budget, in order, loads them, and streams
    /// the model's other pages; the pins last as long as this connection. Reply:
    /// `StatsReply` with `{"pinned": N, "bytes": N}` (pages granted, their slot
    /// bytes).
    Pin {
        model: ModelId,
        pages: Vec<PageId>,
    },
    /// Candidates for the model's static set on the fast tier (since 1.4), most
    /// valuable first (an engine's memory planner ranks them): the daemon keeps as
    /// many as its fast tier has room for, a copy of each written there once the
    /// page is read from its slow tier, and removes the model's other copies.
    /// `append`: these continue the previous `KeepFast`'s list (a long one comes in
    /// parts) rather than replace it. Reply: `StatsReply` with `{"pages": N,
    /// "bytes": N}` (the set chosen from these), both 0 without a fast tier.
    KeepFast {
        model: ModelId,
        append: bool,
        pages: Vec<PageId>,
    },
    /// Server's reply to `Hello`; the arena's fd travels with this frame's bytes.
    Welcome {
        version: Version,
        arena_len: u64,
        server_id: u64,
    },
    ModelOpened {
        model: ModelId,
        page_count: u32,
        /// blake3 of the model's manifest file bytes.
        manifest_digest: [u8; 32],
    },
    Acquired {
        model: ModelId,
        slots: Vec<Slot>,
    },
    /// Success without data (Prefetch, Release, Close).
    Ack,
    /// Reply to `Resident` (since 1.6): per page asked, whether it is resident.
    ResidentPages {
        resident: Vec<bool>,
    },
    /// The path of a model's page manifest file (reply to `ManifestPath`).
    ManifestAt {
        path: String,
    },
    /// UTF-8 JSON object with the daemon's statistics (for humans and tools; its keys
    /// are not part of the wire format).
    StatsReply {
        json: String,
    },
    Error {
        code: ErrorCode,
        message: String,
    },
}

impl Message {
    /// The frame `msg_type` of this message.
    pub fn msg_type(&self) -> u16 {
        use msg_type::*;
        match self {
            Message::Hello { .. } => HELLO,
            Message::OpenModel { .. } => OPEN_MODEL,
            Message::Acquire { .. } => ACQUIRE,
            Message::Prefetch { .. } => PREFETCH,
            Message::ReadAhead { .. } => READ_AHEAD,
            Message::Resident { .. } => RESIDENT,
            Message::ResidentPages { .. } => RESIDENT_PAGES,
            Message::Release { .. } => RELEASE,
            Message::Stats => STATS,
            Message::Close => CLOSE,
            Message::Stage { .. } => STAGE,
            Message::Unstage { .. } => UNSTAGE,
            Message::ManifestPath { .. } => MANIFEST_PATH,
            Message::Pin { .. } => PIN,
            Message::KeepFast { .. } => KEEP_FAST,
            Message::ManifestAt { .. } => MANIFEST_AT,
            Message::Welcome { .. } => WELCOME,
            Message::ModelOpened { .. } => MODEL_OPENED,
            Message::Acquired { .. } => ACQUIRED,
            Message::Ack => ACK,
            Message::StatsReply { .. } => STATS_REPLY,
            Message::Error { .. } => ERROR,
        }
    }

    /// The message's name, as used in errors and docs.
    pub fn name(&self) -> &'static str {
        type_name(self.msg_type()).unwrap_or("?")
    }

    /// Encodes the payload. Fails if a field exceeds its protocol bound (the peer would
    /// reject the message).
    pub fn encode_payload(&self) -> Result<Vec<u8>, ProtocolError> {
        let mut w = Writer {
            out: Vec::new(),
            message: self.name(),
        };
        match self {
            Message::Hello { version, pid, name } => {
                w.u16(version.major);
                w.u16(version.minor);
                w.u32(*pid);
                w.str("name", name, MAX_CLIENT_NAME_LEN)?;
            }
            Message::OpenModel { path } => {
                check_path(w.message, path)?;
                w.str("path", path, MAX_PATH_LEN)?;
            }
            Message::Acquire { model, pages }
            | Message::Prefetch { model, pages }
            | Message::ReadAhead { model, pages }
            | Message::Resident { model, pages }
            | Message::Release { model, pages }
            | Message::Pin { model, pages } => {
                w.u32(model.0);
                w.count("pages", pages.len())?;
                for p in pages {
                    w.u32(p.0);
                }
            }
            Message::KeepFast {
                model,
                append,
                pages,
            } => {
                w.u32(model.0);
                w.u16(u16::from(*append));
                w.count("pages", pages.len())?;
                for p in pages {
                    w.u32(p.0);
                }
            }
            Message::ResidentPages { resident } => {
                w.count("resident", resident.len())?;
                for &r in resident {
                    w.u16(u16::from(r));
                }
            }
            Message::Stats | Message::Close | Message::Ack => {}
            Message::Stage { model, max_bytes } => {
                w.u32(model.0);
                w.u64(*max_bytes);
            }
            Message::Unstage { model } | Message::ManifestPath { model } => w.u32(model.0),
            Message::ManifestAt { path } => {
                check_path(w.message, path)?;
                w.str("path", path, MAX_PATH_LEN)?;
            }
            Message::Welcome {
                version,
                arena_len,
                server_id,
            } => {
                w.u16(version.major);
                w.u16(version.minor);
                w.u64(*arena_len);
                w.u64(*server_id);
            }
            Message::ModelOpened {
                model,
                page_count,
                manifest_digest,
            } => {
                w.u32(model.0);
                w.u32(*page_count);
                w.out.extend_from_slice(manifest_digest);
            }
            Message::Acquired { model, slots } => {
                w.u32(model.0);
                w.count("slots", slots.len())?;
                for s in slots {
                    check_slot(w.message, s)?;
                    w.u32(s.page.0);
                    w.u64(s.offset);
                    w.u64(s.len);
                }
            }
            Message::StatsReply { json } => w.str("json", json, MAX_STATS_LEN)?,
            Message::Error { code, message } => {
                if code.to_u16() == 0 {
                    return Err(invalid(w.message, "code", "0 is not an error code"));
                }
                w.u16(code.to_u16());
                w.str("message", message, MAX_ERROR_MESSAGE_LEN)?;
            }
        }
        Ok(w.out)
    }

    /// An `Error` whose message is cut to [`MAX_ERROR_MESSAGE_LEN`] bytes (at a character
    /// boundary, ending in `…` when cut), so that it always encodes: an error about an
    /// over-long path or a long list of tier failures must still reach the peer.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Message {
        Message::Error {
            code,
            message: truncate_to(message.into(), MAX_ERROR_MESSAGE_LEN),
        }
    }

    /// This message as a frame with `request_id` (a reply carries its request's id).
    pub fn to_frame(&self, request_id: u32) -> Result<Frame, ProtocolError> {
        Ok(Frame {
            msg_type: self.msg_type(),
            flags: 0,
            request_id,
            payload: self.encode_payload()?,
        })
    }

    /// This message's complete wire bytes.
    pub fn encode(&self, request_id: u32) -> Result<Vec<u8>, ProtocolError> {
        self.to_frame(request_id)?.encode()
    }

    /// Parses a frame's message. Checks type, flags, every field and that no bytes
    /// trail.
    pub fn decode(frame: &Frame) -> Result<Message, ProtocolError> {
        use msg_type::*;
        let Some(name) = type_name(frame.msg_type) else {
            return Err(ProtocolError::UnknownMessageType {
                msg_type: frame.msg_type,
            });
        };
        let allowed = match frame.msg_type {
            PREFETCH | RELEASE | READ_AHEAD => FLAG_NO_REPLY,
            _ => 0,
        };
        if frame.flags & !allowed != 0 {
            return Err(ProtocolError::ReservedFlags {
                message: name,
                flags: frame.flags,
            });
        }
        let mut r = Reader {
            bytes: &frame.payload,
            pos: 0,
            message: name,
        };
        let msg = match frame.msg_type {
            HELLO => Message::Hello {
                version: Version {
                    major: r.u16("major")?,
                    minor: r.u16("minor")?,
                },
                pid: r.u32("pid")?,
                name: r.str("name", MAX_CLIENT_NAME_LEN)?,
            },
            OPEN_MODEL => {
                let path = r.str("path", MAX_PATH_LEN)?;
                check_path(name, &path)?;
                Message::OpenModel { path }
            }
            ACQUIRE | PREFETCH | RELEASE | PIN | READ_AHEAD | RESIDENT => {
                let model = ModelId(r.u32("model")?);
                let n = r.count("pages", 4)?;
                let mut pages = Vec::with_capacity(n);
                for _ in 0..n {
                    pages.push(PageId(r.u32("pages")?));
                }
                match frame.msg_type {
                    ACQUIRE => Message::Acquire { model, pages },
                    PREFETCH => Message::Prefetch { model, pages },
                    READ_AHEAD => Message::ReadAhead { model, pages },
                    RESIDENT => Message::Resident { model, pages },
                    PIN => Message::Pin { model, pages },
                    _ => Message::Release { model, pages },
                }
            }
            KEEP_FAST => {
                let model = ModelId(r.u32("model")?);
                let append = match r.u16("append")? {
                    0 => false,
                    1 => true,
                    v => {
                        return Err(ProtocolError::InvalidValue {
                            message: name,
                            field: "append",
                            detail: format!("{v}, not 0 or 1"),
                        })
                    }
                };
                let n = r.count("pages", 4)?;
                let mut pages = Vec::with_capacity(n);
                for _ in 0..n {
                    pages.push(PageId(r.u32("pages")?));
                }
                Message::KeepFast {
                    model,
                    append,
                    pages,
                }
            }
            STATS => Message::Stats,
            CLOSE => Message::Close,
            STAGE => Message::Stage {
                model: ModelId(r.u32("model")?),
                max_bytes: r.u64("max_bytes")?,
            },
            UNSTAGE => Message::Unstage {
                model: ModelId(r.u32("model")?),
            },
            MANIFEST_PATH => Message::ManifestPath {
                model: ModelId(r.u32("model")?),
            },
            MANIFEST_AT => {
                let path = r.str("path", MAX_PATH_LEN)?;
                check_path(name, &path)?;
                Message::ManifestAt { path }
            }
            RESIDENT_PAGES => {
                let n = r.count("resident", 2)?;
                let mut resident = Vec::with_capacity(n);
                for _ in 0..n {
                    resident.push(match r.u16("resident")? {
                        0 => false,
                        1 => true,
                        v => {
                            return Err(ProtocolError::InvalidValue {
                                message: name,
                                field: "resident",
                                detail: format!("{v}, not 0 or 1"),
                            })
                        }
                    });
                }
                Message::ResidentPages { resident }
            }
            ACK => Message::Ack,
            WELCOME => Message::Welcome {
                version: Version {
                    major: r.u16("major")?,
                    minor: r.u16("minor")?,
                },
                arena_len: r.u64("arena_len")?,
                server_id: r.u64("server_id")?,
            },
            MODEL_OPENED => Message::ModelOpened {
                model: ModelId(r.u32("model")?),
                page_count: r.u32("page_count")?,
                manifest_digest: *r.take_array::<32>("manifest_digest")?,
            },
            ACQUIRED => {
                let model = ModelId(r.u32("model")?);
                let n = r.count("slots", SLOT_SIZE)?;
                let mut slots = Vec::with_capacity(n);
                for _ in 0..n {
                    let s = Slot {
                        page: PageId(r.u32("slots.page")?),
                        offset: r.u64("slots.offset")?,
                        len: r.u64("slots.len")?,
                    };
                    check_slot(name, &s)?;
                    slots.push(s);
                }
                Message::Acquired { model, slots }
            }
            STATS_REPLY => Message::StatsReply {
                json: r.str("json", MAX_STATS_LEN)?,
            },
            ERROR => {
                let raw = r.u16("code")?;
                let code = ErrorCode::from_u16(raw)
                    .ok_or_else(|| invalid(name, "code", "0 is not an error code"))?;
                Message::Error {
                    code,
                    message: r.str("message", MAX_ERROR_MESSAGE_LEN)?,
                }
            }
            // `type_name` returned Some, so the type is one of the above.
            other => return Err(ProtocolError::UnknownMessageType { msg_type: other }),
        };
        r.finish()?;
        Ok(msg)
    }
}

/// The name of a known message type.
pub fn type_name(t: u16) -> Option<&'static str> {
    use msg_type::*;
    Some(match t {
        HELLO => "Hello",
        OPEN_MODEL => "OpenModel",
        ACQUIRE => "Acquire",
        PREFETCH => "Prefetch",
        RELEASE => "Release",
        STATS => "Stats",
        CLOSE => "Close",
        STAGE => "Stage",
        UNSTAGE => "Unstage",
        MANIFEST_PATH => "ManifestPath",
        PIN => "Pin",
        KEEP_FAST => "KeepFast",
        READ_AHEAD => "ReadAhead",
        RESIDENT => "Resident",
        RESIDENT_PAGES => "ResidentPages",
        MANIFEST_AT => "ManifestAt",
        ERROR => "Error",
        WELCOME => "Welcome",
        MODEL_OPENED => "ModelOpened",
        ACQUIRED => "Acquired",
        ACK => "Ack",
        STATS_REPLY => "StatsReply",
        _ => return None,
    })
}

/// `s` cut to at most `max` bytes at a character boundary, with `…` marking the cut.
fn truncate_to(mut s: String, max: usize) -> String {
    const MARK: &str = "…";
    if s.len() <= max {
        return s;
    }
    let mut end = max.saturating_sub(MARK.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s.push_str(MARK);
    s
}

fn invalid(message: &'static str, field: &'static str, detail: &str) -> ProtocolError {
    ProtocolError::InvalidValue {
        message,
        field,
        detail: detail.to_string(),
    }
}

/// A model path must be nonempty and free of NUL (it becomes an OS path).
fn check_path(message: &'static str, path: &str) -> Result<(), ProtocolError> {
    if path.is_empty() {
        return Err(invalid(message, "path", "empty path"));
    }
    if path.contains('\0') {
        return Err(invalid(message, "path", "path contains a NUL byte"));
    }
    Ok(())
}

/// A slot's end must be representable (offset + len <= u64::MAX).
fn check_slot(message: &'static str, s: &Slot) -> Result<(), ProtocolError> {
    if s.offset.checked_add(s.len).is_none() {
        return Err(invalid(
            message,
            "slots",
            &format!(
                "page {}: offset {} + len {} overflows u64",
                s.page.0, s.offset, s.len
            ),
        ));
    }
    Ok(())
}

struct Writer {
    out: Vec<u8>,
    message: &'static str,
}

impl Writer {
    fn u16(&mut self, v: u16) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn count(&mut self, field: &'static str, n: usize) -> Result<(), ProtocolError> {
        if n > MAX_PAGES_PER_REQUEST {
            return Err(ProtocolError::CountTooLarge {
                message: self.message,
                field,
                count: n as u64,
                max: MAX_PAGES_PER_REQUEST as u64,
            });
        }
        self.u32(n as u32);
        Ok(())
    }
    fn str(&mut self, field: &'static str, s: &str, max: usize) -> Result<(), ProtocolError> {
        if s.len() > max {
            return Err(ProtocolError::StringTooLong {
                message: self.message,
                field,
                len: s.len() as u64,
                max,
            });
        }
        self.u32(s.len() as u32);
        self.out.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

/// A cursor over a payload; every read is bounds-checked and names its field.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    message: &'static str,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, field: &'static str, n: usize) -> Result<&'a [u8], ProtocolError> {
        if n > self.remaining() {
            return Err(ProtocolError::ShortPayload {
                message: self.message,
                field,
                needed: n,
                available: self.remaining(),
            });
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn take_array<const N: usize>(
        &mut self,
        field: &'static str,
    ) -> Result<&'a [u8; N], ProtocolError> {
        let s = self.take(field, N)?;
        // `take` returned exactly N bytes.
        s.try_into().map_err(|_| ProtocolError::ShortPayload {
            message: self.message,
            field,
            needed: N,
            available: s.len(),
        })
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, ProtocolError> {
        Ok(u16::from_le_bytes(*self.take_array(field)?))
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, ProtocolError> {
        Ok(u32::from_le_bytes(*self.take_array(field)?))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, ProtocolError> {
        Ok(u64::from_le_bytes(*self.take_array(field)?))
    }

    /// A `u32` element count, checked against the protocol bound and against the bytes
    /// left for `elem_size`-byte elements, so the caller may allocate `count` elements.
    fn count(&mut self, field: &'static str, elem_size: usize) -> Result<usize, ProtocolError> {
        let n = self.u32(field)? as usize;
        if n > MAX_PAGES_PER_REQUEST {
            return Err(ProtocolError::CountTooLarge {
                message: self.message,
                field,
                count: n as u64,
                max: MAX_PAGES_PER_REQUEST as u64,
            });
        }
        // n <= MAX_PAGES_PER_REQUEST and elem_size <= 20: no overflow.
        let needed = n * elem_size;
        if needed > self.remaining() {
            return Err(ProtocolError::CountExceedsPayload {
                message: self.message,
                field,
                count: n as u64,
                needed,
                available: self.remaining(),
            });
        }
        Ok(n)
    }

    fn str(&mut self, field: &'static str, max: usize) -> Result<String, ProtocolError> {
        let n = self.u32(field)?;
        if n as usize > max {
            return Err(ProtocolError::StringTooLong {
                message: self.message,
                field,
                len: n as u64,
                max,
            });
        }
        let n = n as usize;
        if n > self.remaining() {
            return Err(ProtocolError::CountExceedsPayload {
                message: self.message,
                field,
                count: n as u64,
                needed: n,
                available: self.remaining(),
            });
        }
        let bytes = self.take(field, n)?;
        let s = std::str::from_utf8(bytes).map_err(|e| ProtocolError::InvalidUtf8 {
            message: self.message,
            field,
            valid_up_to: e.valid_up_to(),
        })?;
        Ok(s.to_string())
    }

    fn finish(self) -> Result<(), ProtocolError> {
        if self.remaining() != 0 {
            return Err(ProtocolError::TrailingBytes {
                message: self.message,
                count: self.remaining(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(t: u16, payload: Vec<u8>) -> Frame {
        Frame {
            msg_type: t,
            flags: 0,
            request_id: 1,
            payload,
        }
    }

    #[test]
    fn hello_bytes() {
        let m = Message::Hello {
            version: Version { major: 1, minor: 2 },
            pid: 0x01020304,
            name: "ab".into(),
        };
        let wire = m.encode(9).unwrap();
        assert_eq!(
            wire,
            [
                22, 0, 0, 0, 1, 0, 0, 0, 9, 0, 0, 0, // header: len = 8 + 14
                1, 0, 2, 0, 4, 3, 2, 1, 2, 0, 0, 0, b'a', b'b'
            ]
        );
    }

    #[test]
    fn acquired_bytes() {
        let m = Message::Acquired {
            model: ModelId(3),
            slots: vec![Slot {
                page: PageId(5),
                offset: 0x4000,
                len: 10,
            }],
        };
        let p = m.encode_payload().unwrap();
        let mut want = vec![3, 0, 0, 0, 1, 0, 0, 0, 5, 0, 0, 0];
        want.extend_from_slice(&0x4000u64.to_le_bytes());
        want.extend_from_slice(&10u64.to_le_bytes());
        assert_eq!(p, want);
        assert_eq!(Message::decode(&frame(msg_type::ACQUIRED, p)).unwrap(), m);
    }

    #[test]
    fn page_count_larger_than_payload_is_rejected_before_allocation() {
        // Claims 16384 pages but carries one.
        let mut p = 7u32.to_le_bytes().to_vec();
        p.extend_from_slice(&(MAX_PAGES_PER_REQUEST as u32).to_le_bytes());
        p.extend_from_slice(&1u32.to_le_bytes());
        let e = Message::decode(&frame(msg_type::ACQUIRE, p)).unwrap_err();
        assert!(
            matches!(
                e,
                ProtocolError::CountExceedsPayload {
                    field: "pages",
                    count: 16384,
                    needed: 65536,
                    available: 4,
                    ..
                }
            ),
            "{e:?}"
        );
        let mut p = 7u32.to_le_bytes().to_vec();
        p.extend_from_slice(&u32::MAX.to_le_bytes());
        let e = Message::decode(&frame(msg_type::RELEASE, p)).unwrap_err();
        assert!(
            matches!(e, ProtocolError::CountTooLarge { field: "pages", .. }),
            "{e:?}"
        );
    }

    #[test]
    fn error_code_zero_is_invalid_and_unknown_codes_survive() {
        let mut p = 0u16.to_le_bytes().to_vec();
        p.extend_from_slice(&0u32.to_le_bytes());
        let e = Message::decode(&frame(msg_type::ERROR, p)).unwrap_err();
        assert!(
            matches!(e, ProtocolError::InvalidValue { field: "code", .. }),
            "{e:?}"
        );
        let m = Message::Error {
            code: ErrorCode::Other(999),
            message: "newer".into(),
        };
        let f = m.to_frame(4).unwrap();
        assert_eq!(Message::decode(&f).unwrap(), m);
        for c in 1..=7 {
            assert_eq!(ErrorCode::from_u16(c).unwrap().to_u16(), c);
            assert!(!matches!(ErrorCode::from_u16(c), Some(ErrorCode::Other(_))));
        }
    }

    #[test]
    fn long_error_messages_are_cut_at_a_char_boundary_and_encode() {
        // 'é' is two bytes: a cut at an odd byte count would split one.
        let long = format!("x{}", "é".repeat(MAX_ERROR_MESSAGE_LEN));
        let m = Message::error(ErrorCode::NotFound, long.clone());
        let Message::Error { message, .. } = &m else {
            unreachable!()
        };
        assert!(message.len() <= MAX_ERROR_MESSAGE_LEN, "{}", message.len());
        assert!(message.ends_with('…') && long.starts_with(message.trim_end_matches('…')));
        assert_eq!(Message::decode(&m.to_frame(3).unwrap()).unwrap(), m);
        // A message within the bound is kept whole.
        let exact = "y".repeat(MAX_ERROR_MESSAGE_LEN);
        assert_eq!(
            Message::error(ErrorCode::Internal, exact.clone()),
            Message::Error {
                code: ErrorCode::Internal,
                message: exact
            }
        );
    }

    #[test]
    fn negotiate() {
        let v = |major, minor| Version { major, minor };
        assert_eq!(v(1, 3).negotiate(v(1, 1)), Some(v(1, 1)));
        assert_eq!(v(1, 0).negotiate(v(1, 4)), Some(v(1, 0)));
        assert_eq!(v(1, 0).negotiate(v(2, 0)), None);
    }

    #[test]
    fn encode_rejects_out_of_bound_fields() {
        let long = "x".repeat(MAX_CLIENT_NAME_LEN + 1);
        let e = Message::Hello {
            version: PROTOCOL_VERSION,
            pid: 1,
            name: long,
        }
        .encode(1)
        .unwrap_err();
        assert!(
            matches!(e, ProtocolError::StringTooLong { field: "name", .. }),
            "{e:?}"
        );
        let e = Message::Acquire {
            model: ModelId(0),
            pages: vec![PageId(0); MAX_PAGES_PER_REQUEST + 1],
        }
        .encode(1)
        .unwrap_err();
        assert!(matches!(e, ProtocolError::CountTooLarge { .. }), "{e:?}");
        let e = Message::OpenModel {
            path: String::new(),
        }
        .encode(1)
        .unwrap_err();
        assert!(
            matches!(e, ProtocolError::InvalidValue { field: "path", .. }),
            "{e:?}"
        );
    }
}

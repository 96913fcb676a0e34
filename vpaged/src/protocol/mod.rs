//! The vpaged socket protocol: how engines talk to the page daemon over a Unix stream
//! socket. Byte tables for everything here are in `docs/protocol.md`.
//!
//! - [`frame`]: length-prefixed frames (`u32` length, `u16` type, `u16` flags, `u32`
//!   request id, payload) and an incremental [`FrameDecoder`] that does no I/O, so
//!   tokio and blocking clients share it; plus blocking [`read_frame`]/[`write_frame`].
//! - [`message`]: the requests and replies ([`Message`]) and their payload encoding,
//!   little-endian by explicit conversion; every decode path is bounds-checked and
//!   returns a [`ProtocolError`] naming the message and field.
//! - [`fdpass`]: `SCM_RIGHTS` passing of the arena's descriptor alongside the
//!   `Welcome` frame, and [`peer_uid`] for admitting peers.
//!
//! A session: the client sends `Hello`; the server answers `Welcome` with the
//! negotiated version and the arena fd attached (or `Error{Version}` and closes); then
//! requests, each answered by exactly one reply carrying the request's id (in the order
//! the requests came; hints and releases flagged `NO_REPLY` only when they fail), until
//! `Close` or the connection drops (either way the server releases the connection's
//! leases and the peer sees the end of the stream).

pub mod fdpass;
pub mod frame;
pub mod message;

use std::io;

pub use fdpass::{
    peer_uid, recv_frame_with_fd, recv_with_fd, send_all_with_fd, send_frame_with_fd, send_with_fd,
};
pub use frame::{read_frame, write_frame, Frame, FrameDecoder, MAX_FRAME_LEN, MAX_PAYLOAD_LEN};
pub use message::{
    ErrorCode, Message, ModelId, Slot, Version, FLAG_NO_REPLY, MAX_CLIENT_NAME_LEN,
    MAX_ERROR_MESSAGE_LEN, MAX_PAGES_PER_REQUEST, MAX_PATH_LEN, MAX_STATS_LEN, PROTOCOL_VERSION,
};

/// Why bytes could not be framed, decoded or encoded, or an I/O failure underneath.
/// `message` and `field` name the message type and the payload field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("frame declares length {declared}, above the maximum of {max}")]
    FrameTooLarge { declared: u32, max: u32 },
    #[error("frame declares length {declared}, less than its 8 header bytes")]
    FrameTooShort { declared: u32 },
    #[error("payload of {len} bytes exceeds the maximum of {max}")]
    PayloadTooLarge { len: usize, max: usize },
    #[error("stream ended inside a frame: {got} of {expected} bytes")]
    Truncated { expected: usize, got: usize },
    #[error("byte stream out of step after an earlier framing error; close the connection")]
    Desynchronized,
    #[error("unknown message type 0x{msg_type:04x}")]
    UnknownMessageType { msg_type: u16 },
    #[error("{message}: reserved flags 0x{flags:04x} must be zero")]
    ReservedFlags { message: &'static str, flags: u16 },
    #[error("{message}.{field}: payload too short: {needed} bytes needed, {available} left")]
    ShortPayload {
        message: &'static str,
        field: &'static str,
        needed: usize,
        available: usize,
    },
    #[error("{message}: {count} trailing bytes after the last field")]
    TrailingBytes { message: &'static str, count: usize },
    #[error("{message}.{field}: count {count} exceeds the maximum of {max}")]
    CountTooLarge {
        message: &'static str,
        field: &'static str,
        count: u64,
        max: u64,
    },
    #[error(
        "{message}.{field}: count {count} needs {needed} bytes but the payload has {available} left"
    )]
    CountExceedsPayload {
        message: &'static str,
        field: &'static str,
        count: u64,
        needed: usize,
        available: usize,
    },
    #[error("{message}.{field}: string of {len} bytes exceeds the maximum of {max}")]
    StringTooLong {
        message: &'static str,
        field: &'static str,
        len: u64,
        max: usize,
    },
    #[error("{message}.{field}: not UTF-8 (valid up to byte {valid_up_to})")]
    InvalidUtf8 {
        message: &'static str,
        field: &'static str,
        valid_up_to: usize,
    },
    #[error("{message}.{field}: {detail}")]
    InvalidValue {
        message: &'static str,
        field: &'static str,
        detail: String,
    },
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl ProtocolError {
    /// True if the byte stream can no longer be trusted (framing or I/O failed): the
    /// connection must be closed. Otherwise the frame was intact and only its message
    /// was bad: a server may answer it with `Error{BadRequest}` and go on.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            ProtocolError::FrameTooLarge { .. }
                | ProtocolError::FrameTooShort { .. }
                | ProtocolError::PayloadTooLarge { .. }
                | ProtocolError::Truncated { .. }
                | ProtocolError::Desynchronized
                | ProtocolError::Io(_)
        )
    }
}

//! Length-prefixed framing.
//!
//! A frame on the wire (all integers little-endian):
//!
//! | offset | size | field        |
//! |-------:|-----:|--------------|
//! | 0      | 4    | `len`: bytes that follow this field (8 + payload length) |
//! | 4      | 2    | message type |
//! | 6      | 2    | flags (reserved, 0 in version 1) |
//! | 8      | 4    | request id   |
//! | 12     | len-8| payload      |
//!
//! The framing layer checks only `len` (8 ..= [`MAX_FRAME_LEN`]); message type, flags
//! and payload are checked by [`super::Message::decode`], so a receiver can answer a bad
//! message with an error frame carrying the right request id and keep the connection.
//! A framing error, by contrast, means the byte stream is out of step: close it.

use std::io::{self, Read, Write};

use super::ProtocolError;

/// Bytes of the `len` field.
pub const LEN_FIELD_SIZE: usize = 4;
/// Bytes of the header after `len`: message type, flags, request id.
pub const HEADER_AFTER_LEN: usize = 8;
/// Whole header size: `len` + type + flags + request id.
pub const HEADER_SIZE: usize = LEN_FIELD_SIZE + HEADER_AFTER_LEN;
/// Largest accepted value of `len` (header after `len` + payload): 1 MiB. Checked
/// before any allocation, so a peer cannot make the receiver reserve more.
pub const MAX_FRAME_LEN: u32 = 1 << 20;
/// Largest payload a frame may carry.
pub const MAX_PAYLOAD_LEN: usize = MAX_FRAME_LEN as usize - HEADER_AFTER_LEN;

/// One frame: its header fields and its (not yet parsed) payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub msg_type: u16,
    pub flags: u16,
    pub request_id: u32,
    pub payload: Vec<u8>,
}

impl Frame {
    /// The frame's wire bytes. Fails if the payload exceeds [`MAX_PAYLOAD_LEN`] (the
    /// peer would reject it).
    pub fn encode(&self) -> Result<Vec<u8>, ProtocolError> {
        let mut out = Vec::with_capacity(HEADER_SIZE + self.payload.len());
        self.encode_into(&mut out)?;
        Ok(out)
    }

    /// Appends the frame's wire bytes to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), ProtocolError> {
        if self.payload.len() > MAX_PAYLOAD_LEN {
            return Err(ProtocolError::PayloadTooLarge {
                len: self.payload.len(),
                max: MAX_PAYLOAD_LEN,
            });
        }
        // Cannot overflow: payload <= MAX_PAYLOAD_LEN, so len <= MAX_FRAME_LEN.
        let len = (HEADER_AFTER_LEN + self.payload.len()) as u32;
        out.reserve(HEADER_SIZE + self.payload.len());
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&self.msg_type.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.extend_from_slice(&self.request_id.to_le_bytes());
        out.extend_from_slice(&self.payload);
        Ok(())
    }

    /// Parses the 8 header bytes after `len` and takes `payload`.
    fn from_parts(header: &[u8; HEADER_AFTER_LEN], payload: Vec<u8>) -> Frame {
        Frame {
            msg_type: u16::from_le_bytes([header[0], header[1]]),
            flags: u16::from_le_bytes([header[2], header[3]]),
            request_id: u32::from_le_bytes([header[4], header[5], header[6], header[7]]),
            payload,
        }
    }
}

/// Checks a declared `len` field.
fn check_len(len: u32) -> Result<usize, ProtocolError> {
    if len > MAX_FRAME_LEN {
        return Err(ProtocolError::FrameTooLarge {
            declared: len,
            max: MAX_FRAME_LEN,
        });
    }
    if (len as usize) < HEADER_AFTER_LEN {
        return Err(ProtocolError::FrameTooShort { declared: len });
    }
    Ok(len as usize)
}

/// Incremental frame decoder over a byte buffer: feed it whatever the transport read
/// ([`FrameDecoder::push`]), then take complete frames ([`FrameDecoder::next_frame`]).
/// It does no I/O, so the same decoder serves a tokio connection and a blocking
/// `std::os::unix::net::UnixStream`.
///
/// After `next_frame` returns an error the stream is out of step; every later call
/// returns [`ProtocolError::Desynchronized`] and the connection should be closed.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Start of the unconsumed bytes in `buf`.
    pos: usize,
    failed: bool,
}

impl FrameDecoder {
    pub fn new() -> FrameDecoder {
        FrameDecoder::default()
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        // Drop consumed bytes before growing, so a long-lived connection's buffer stays
        // bounded by what is unconsumed plus one read.
        if self.pos > 0 && (self.pos == self.buf.len() || self.pos >= self.buf.len() / 2) {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received but not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Bytes of the frame in progress (header and payload) once its length field has
    /// arrived, else the length field's 4 bytes: what a truncated stream fell short of.
    pub fn frame_in_progress_len(&self) -> usize {
        match self.buf[self.pos..].first_chunk::<LEN_FIELD_SIZE>() {
            Some(len) => LEN_FIELD_SIZE + u32::from_le_bytes(*len) as usize,
            None => LEN_FIELD_SIZE,
        }
    }

    /// The next complete frame, `Ok(None)` if more bytes are needed. A declared length
    /// above [`MAX_FRAME_LEN`] is an error as soon as its 4 bytes have arrived.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, ProtocolError> {
        if self.failed {
            return Err(ProtocolError::Desynchronized);
        }
        let avail = &self.buf[self.pos..];
        let Some(len_bytes) = avail.first_chunk::<LEN_FIELD_SIZE>() else {
            return Ok(None);
        };
        let len = match check_len(u32::from_le_bytes(*len_bytes)) {
            Ok(len) => len,
            Err(e) => {
                self.failed = true;
                return Err(e);
            }
        };
        let Some(body) = avail.get(LEN_FIELD_SIZE..LEN_FIELD_SIZE + len) else {
            return Ok(None);
        };
        // `check_len` guarantees len >= HEADER_AFTER_LEN, so this split succeeds.
        let Some((header, payload)) = body.split_first_chunk::<HEADER_AFTER_LEN>() else {
            self.failed = true;
            return Err(ProtocolError::FrameTooShort {
                declared: len as u32,
            });
        };
        let frame = Frame::from_parts(header, payload.to_vec());
        self.pos += LEN_FIELD_SIZE + len;
        Ok(Some(frame))
    }
}

/// Reads one frame from a blocking reader. `Ok(None)` on a clean end of stream (no
/// byte of a next frame); [`ProtocolError::Truncated`] if the stream ends mid-frame.
/// Allocates only after the declared length has been checked.
pub fn read_frame(r: &mut impl Read) -> Result<Option<Frame>, ProtocolError> {
    let mut len_bytes = [0u8; LEN_FIELD_SIZE];
    let got = read_full(r, &mut len_bytes)?;
    if got == 0 {
        return Ok(None);
    }
    if got < LEN_FIELD_SIZE {
        return Err(ProtocolError::Truncated {
            expected: LEN_FIELD_SIZE,
            got,
        });
    }
    let len = check_len(u32::from_le_bytes(len_bytes))?;
    let mut header = [0u8; HEADER_AFTER_LEN];
    let got = read_full(r, &mut header)?;
    if got < HEADER_AFTER_LEN {
        return Err(ProtocolError::Truncated { expected: len, got });
    }
    let mut payload = vec![0u8; len - HEADER_AFTER_LEN];
    let got = read_full(r, &mut payload)?;
    if got < payload.len() {
        return Err(ProtocolError::Truncated {
            expected: len,
            got: HEADER_AFTER_LEN + got,
        });
    }
    Ok(Some(Frame::from_parts(&header, payload)))
}

/// Writes one frame to a blocking writer (one `write_all` of the whole frame).
pub fn write_frame(w: &mut impl Write, frame: &Frame) -> Result<(), ProtocolError> {
    let bytes = frame.encode()?;
    w.write_all(&bytes)?;
    Ok(())
}

/// Reads until `buf` is full or end of stream; returns the bytes read. Retries on
/// `Interrupted`.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(t: u16, id: u32, payload: &[u8]) -> Frame {
        Frame {
            msg_type: t,
            flags: 0,
            request_id: id,
            payload: payload.to_vec(),
        }
    }

    #[test]
    fn header_bytes_are_little_endian() {
        let f = Frame {
            msg_type: 0x0102,
            flags: 0x0304,
            request_id: 0x0506_0708,
            payload: vec![0xAA, 0xBB],
        };
        assert_eq!(
            f.encode().unwrap(),
            [10, 0, 0, 0, 0x02, 0x01, 0x04, 0x03, 0x08, 0x07, 0x06, 0x05, 0xAA, 0xBB]
        );
    }

    #[test]
    fn decoder_byte_by_byte() {
        let frames = [
            frame(1, 7, b"abc"),
            frame(2, 8, b""),
            frame(3, 9, &[0; 300]),
        ];
        let mut wire = Vec::new();
        for f in &frames {
            f.encode_into(&mut wire).unwrap();
        }
        let mut d = FrameDecoder::new();
        let mut out = Vec::new();
        for b in &wire {
            d.push(std::slice::from_ref(b));
            while let Some(f) = d.next_frame().unwrap() {
                out.push(f);
            }
        }
        assert_eq!(out, frames);
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn oversized_length_fails_before_body_arrives() {
        let mut d = FrameDecoder::new();
        d.push(&(MAX_FRAME_LEN + 1).to_le_bytes());
        assert!(matches!(
            d.next_frame(),
            Err(ProtocolError::FrameTooLarge { declared, .. }) if declared == MAX_FRAME_LEN + 1
        ));
        assert!(matches!(d.next_frame(), Err(ProtocolError::Desynchronized)));
    }

    #[test]
    fn length_below_header_is_an_error() {
        let mut d = FrameDecoder::new();
        d.push(&7u32.to_le_bytes());
        assert!(matches!(
            d.next_frame(),
            Err(ProtocolError::FrameTooShort { declared: 7 })
        ));
    }

    #[test]
    fn max_length_frame_is_accepted() {
        let f = frame(5, 1, &vec![0x5A; MAX_PAYLOAD_LEN]);
        let wire = f.encode().unwrap();
        assert_eq!(wire.len(), LEN_FIELD_SIZE + MAX_FRAME_LEN as usize);
        let mut d = FrameDecoder::new();
        d.push(&wire);
        assert_eq!(d.next_frame().unwrap(), Some(f.clone()));
        assert_eq!(read_frame(&mut &wire[..]).unwrap(), Some(f));
        let too_big = frame(5, 1, &vec![0; MAX_PAYLOAD_LEN + 1]);
        assert!(matches!(
            too_big.encode(),
            Err(ProtocolError::PayloadTooLarge { .. })
        ));
    }

    #[test]
    fn read_frame_eof_cases() {
        assert_eq!(read_frame(&mut &[][..]).unwrap(), None);
        let wire = frame(1, 2, b"hello").encode().unwrap();
        for cut in 1..wire.len() {
            let r = read_frame(&mut &wire[..cut]);
            assert!(
                matches!(r, Err(ProtocolError::Truncated { .. })),
                "cut {cut}: {r:?}"
            );
        }
        let mut two = wire.clone();
        two.extend_from_slice(&wire);
        let mut r = &two[..];
        assert!(read_frame(&mut r).unwrap().is_some());
        assert!(read_frame(&mut r).unwrap().is_some());
        assert_eq!(read_frame(&mut r).unwrap(), None);
    }

    #[test]
    fn write_then_read() {
        let f = frame(0x8003, u32::MAX, b"payload");
        let mut wire = Vec::new();
        write_frame(&mut wire, &f).unwrap();
        assert_eq!(read_frame(&mut &wire[..]).unwrap(), Some(f));
    }
}

//! Each kind of malformed input is a typed error naming what was wrong.

use vpaged::protocol::message::msg_type;
use vpaged::protocol::{
    read_frame, Frame, FrameDecoder, Message, ProtocolError, MAX_CLIENT_NAME_LEN, MAX_FRAME_LEN,
    MAX_PAGES_PER_REQUEST, MAX_PATH_LEN,
};

fn frame(t: u16, payload: Vec<u8>) -> Frame {
    Frame {
        msg_type: t,
        flags: 0,
        request_id: 3,
        payload,
    }
}

fn le32(v: u32) -> [u8; 4] {
    v.to_le_bytes()
}

fn decode(t: u16, payload: Vec<u8>) -> ProtocolError {
    let e = Message::decode(&frame(t, payload)).unwrap_err();
    assert!(
        !e.is_fatal(),
        "a bad message in an intact frame is not fatal: {e}"
    );
    e
}

#[test]
fn unknown_message_type() {
    for t in [0u16, 0x000f, 0x7fff, 0x8008, 0xffff] {
        let e = decode(t, vec![]);
        assert!(
            matches!(e, ProtocolError::UnknownMessageType { msg_type } if msg_type == t),
            "{e}"
        );
    }
}

#[test]
fn nonzero_flags() {
    let mut f = frame(msg_type::STATS, vec![]);
    f.flags = 0x0100;
    let e = Message::decode(&f).unwrap_err();
    assert!(
        matches!(
            e,
            ProtocolError::ReservedFlags {
                message: "Stats",
                flags: 0x0100
            }
        ),
        "{e}"
    );
    assert_eq!(e.to_string(), "Stats: reserved flags 0x0100 must be zero");
}

#[test]
fn short_payload_names_the_field() {
    // Hello with major and minor only: pid is missing.
    let e = decode(msg_type::HELLO, vec![1, 0, 0, 0]);
    assert!(
        matches!(
            e,
            ProtocolError::ShortPayload {
                message: "Hello",
                field: "pid",
                needed: 4,
                available: 0
            }
        ),
        "{e}"
    );
    // ModelOpened with a 31-byte digest.
    let mut p = Vec::new();
    p.extend_from_slice(&le32(1));
    p.extend_from_slice(&le32(10));
    p.extend_from_slice(&[0u8; 31]);
    let e = decode(msg_type::MODEL_OPENED, p);
    assert!(
        matches!(
            e,
            ProtocolError::ShortPayload {
                field: "manifest_digest",
                needed: 32,
                available: 31,
                ..
            }
        ),
        "{e}"
    );
    // Acquired whose one slot lacks its len.
    let mut p = Vec::new();
    p.extend_from_slice(&le32(1));
    p.extend_from_slice(&le32(1));
    p.extend_from_slice(&[0u8; 12]);
    let e = decode(msg_type::ACQUIRED, p);
    assert!(
        matches!(
            e,
            ProtocolError::CountExceedsPayload {
                field: "slots",
                count: 1,
                needed: 20,
                available: 12,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn trailing_bytes() {
    let e = decode(msg_type::CLOSE, vec![0]);
    assert!(
        matches!(
            e,
            ProtocolError::TrailingBytes {
                message: "Close",
                count: 1
            }
        ),
        "{e}"
    );
    let mut p = Message::Release {
        model: vpaged::protocol::ModelId(2),
        pages: vec![vpaged::PageId(1)],
    }
    .encode_payload()
    .unwrap();
    p.extend_from_slice(&[9, 9, 9]);
    let e = decode(msg_type::RELEASE, p);
    assert!(
        matches!(
            e,
            ProtocolError::TrailingBytes {
                message: "Release",
                count: 3
            }
        ),
        "{e}"
    );
}

#[test]
fn counts_beyond_bound_or_payload() {
    // Above the protocol bound: refused before looking at the payload.
    let mut p = le32(0).to_vec();
    p.extend_from_slice(&le32(MAX_PAGES_PER_REQUEST as u32 + 1));
    let e = decode(msg_type::PREFETCH, p);
    assert!(
        matches!(
            e,
            ProtocolError::CountTooLarge {
                message: "Prefetch",
                field: "pages",
                ..
            }
        ),
        "{e}"
    );
    // Within the bound but more than the payload holds.
    let mut p = le32(0).to_vec();
    p.extend_from_slice(&le32(3));
    p.extend_from_slice(&[0u8; 8]);
    let e = decode(msg_type::ACQUIRE, p);
    assert!(
        matches!(
            e,
            ProtocolError::CountExceedsPayload {
                message: "Acquire",
                field: "pages",
                count: 3,
                needed: 12,
                available: 8
            }
        ),
        "{e}"
    );
}

#[test]
fn strings_too_long_not_utf8_or_short() {
    // Declared longer than the field's bound.
    let mut p = vec![1, 0, 0, 0, 0, 0, 0, 0];
    p.extend_from_slice(&le32(MAX_CLIENT_NAME_LEN as u32 + 1));
    let e = decode(msg_type::HELLO, p);
    assert!(
        matches!(
            e,
            ProtocolError::StringTooLong {
                field: "name",
                len: 257,
                max: 256,
                ..
            }
        ),
        "{e}"
    );
    let mut p = le32(u32::MAX).to_vec();
    p.push(b'/');
    let e = decode(msg_type::OPEN_MODEL, p);
    assert!(
        matches!(
            e,
            ProtocolError::StringTooLong {
                field: "path",
                max: MAX_PATH_LEN,
                ..
            }
        ),
        "{e}"
    );
    // Declared longer than the payload.
    let mut p = le32(10).to_vec();
    p.extend_from_slice(b"/abc");
    let e = decode(msg_type::OPEN_MODEL, p);
    assert!(
        matches!(
            e,
            ProtocolError::CountExceedsPayload {
                field: "path",
                count: 10,
                available: 4,
                ..
            }
        ),
        "{e}"
    );
    // Not UTF-8.
    let mut p = le32(4).to_vec();
    p.extend_from_slice(&[b'/', b'a', 0xff, b'b']);
    let e = decode(msg_type::OPEN_MODEL, p);
    assert!(
        matches!(
            e,
            ProtocolError::InvalidUtf8 {
                field: "path",
                valid_up_to: 2,
                ..
            }
        ),
        "{e}"
    );
    let mut p = 4u16.to_le_bytes().to_vec();
    p.extend_from_slice(&le32(2));
    p.extend_from_slice(&[0xc3, 0x28]);
    let e = decode(msg_type::ERROR, p);
    assert!(
        matches!(
            e,
            ProtocolError::InvalidUtf8 {
                message: "Error",
                field: "message",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn invalid_values() {
    let mut p = le32(0).to_vec();
    let e = decode(msg_type::OPEN_MODEL, p.clone());
    assert!(
        matches!(e, ProtocolError::InvalidValue { field: "path", .. }),
        "{e}"
    );
    p = le32(3).to_vec();
    p.extend_from_slice(b"a\0b");
    let e = decode(msg_type::OPEN_MODEL, p);
    assert!(e.to_string().contains("NUL"), "{e}");
    // A slot whose end overflows u64.
    let mut p = le32(0).to_vec();
    p.extend_from_slice(&le32(1));
    p.extend_from_slice(&le32(7));
    p.extend_from_slice(&u64::MAX.to_le_bytes());
    p.extend_from_slice(&1u64.to_le_bytes());
    let e = decode(msg_type::ACQUIRED, p);
    assert!(
        matches!(
            e,
            ProtocolError::InvalidValue {
                message: "Acquired",
                field: "slots",
                ..
            }
        ),
        "{e}"
    );
    // KeepFast's append flag is 0 or 1.
    let mut p = le32(0).to_vec();
    p.extend_from_slice(&2u16.to_le_bytes());
    p.extend_from_slice(&le32(0));
    let e = decode(msg_type::KEEP_FAST, p);
    assert!(
        matches!(
            e,
            ProtocolError::InvalidValue {
                message: "KeepFast",
                field: "append",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn framing_errors_are_fatal() {
    // Length above the cap: an error from the first 4 bytes, before any body.
    let mut d = FrameDecoder::new();
    d.push(&le32(u32::MAX));
    let e = d.next_frame().unwrap_err();
    assert!(e.is_fatal());
    assert!(
        matches!(
            e,
            ProtocolError::FrameTooLarge {
                declared: u32::MAX,
                max: MAX_FRAME_LEN
            }
        ),
        "{e}"
    );
    // Blocking reader: same check, before allocating.
    let e = read_frame(&mut &le32(MAX_FRAME_LEN + 1)[..]).unwrap_err();
    assert!(matches!(e, ProtocolError::FrameTooLarge { .. }), "{e}");
    // Length below the header.
    for short in 0..8u32 {
        let e = read_frame(&mut &le32(short)[..]).unwrap_err();
        assert!(
            matches!(e, ProtocolError::FrameTooShort { declared } if declared == short),
            "{e}"
        );
    }
    // Stream ends mid-frame.
    let wire = Message::Stats.encode(1).unwrap();
    let e = read_frame(&mut &wire[..wire.len() - 1]).unwrap_err();
    assert!(e.is_fatal());
    assert!(matches!(e, ProtocolError::Truncated { .. }), "{e}");
}

#[test]
fn decoder_stays_failed_after_a_framing_error() {
    let mut d = FrameDecoder::new();
    d.push(&le32(3));
    assert!(matches!(
        d.next_frame(),
        Err(ProtocolError::FrameTooShort { declared: 3 })
    ));
    d.push(&Message::Stats.encode(1).unwrap());
    assert!(matches!(d.next_frame(), Err(ProtocolError::Desynchronized)));
}

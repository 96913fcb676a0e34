//! Arbitrary bytes through the frame decoder (whole, and split where the input says),
//! the blocking reader and the message parser: never a panic; what decodes re-encodes
//! to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vpaged::protocol::{read_frame, Frame, FrameDecoder, Message, FLAG_NO_REPLY};

fn check_frame(frame: &Frame) {
    let wire = frame.encode().expect("a decoded frame is within bounds");
    let back = read_frame(&mut &wire[..]).unwrap().unwrap();
    assert_eq!(&back, frame);
    if let Ok(msg) = Message::decode(frame) {
        // Canonical encoding: a message that decoded re-encodes to the same payload.
        // Flags belong to the frame, not the message (NO_REPLY on Prefetch and
        // Release: the sender sets it on the frame), so they are carried over.
        let mut again = msg
            .to_frame(frame.request_id)
            .expect("a decoded message encodes");
        assert_eq!(again.flags, 0);
        assert!(
            frame.flags & !FLAG_NO_REPLY == 0,
            "decoded with reserved flags"
        );
        again.flags = frame.flags;
        assert_eq!(&again, frame);
    }
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks a chunk size for feeding the incremental decoder.
    let (chunk, body) = match data.split_first() {
        Some((c, rest)) => (usize::from(*c).max(1), rest),
        None => return,
    };

    let mut whole = Vec::new();
    let mut d = FrameDecoder::new();
    d.push(body);
    let whole_err = loop {
        match d.next_frame() {
            Ok(Some(f)) => whole.push(f),
            Ok(None) => break false,
            Err(_) => break true,
        }
    };

    let mut split = Vec::new();
    let mut d = FrameDecoder::new();
    let mut split_err = false;
    'feed: for c in body.chunks(chunk) {
        d.push(c);
        loop {
            match d.next_frame() {
                Ok(Some(f)) => split.push(f),
                Ok(None) => break,
                Err(_) => {
                    split_err = true;
                    break 'feed;
                }
            }
        }
    }
    assert_eq!(whole, split);
    assert_eq!(whole_err, split_err);

    let mut r = body;
    let mut read = Vec::new();
    while let Ok(Some(f)) = read_frame(&mut r) {
        read.push(f);
    }
    assert_eq!(whole, read);

    for f in &whole {
        check_frame(f);
    }
    // The raw bytes as one payload of every message type.
    for t in [
        0x0001u16, 0x0002, 0x0003, 0x0004, 0x0005, 0x0006, 0x0007, 0x8000, 0x8001, 0x8002, 0x8003,
        0x8004, 0x8005,
    ] {
        let f = Frame {
            msg_type: t,
            flags: 0,
            request_id: 0,
            payload: body.to_vec(),
        };
        if let Ok(msg) = Message::decode(&f) {
            assert_eq!(msg.to_frame(0).unwrap(), f);
        }
    }
});

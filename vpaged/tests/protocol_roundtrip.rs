//! Every message type survives encode -> frame -> decode, however the byte stream is
//! split on its way.

use proptest::collection::vec;
use proptest::prelude::*;
use vpaged::protocol::{
    read_frame, write_frame, ErrorCode, Frame, FrameDecoder, Message, ModelId, Slot, Version,
    MAX_PAGES_PER_REQUEST,
};
use vpaged::PageId;

fn version() -> impl Strategy<Value = Version> {
    (any::<u16>(), any::<u16>()).prop_map(|(major, minor)| Version { major, minor })
}

fn pages() -> impl Strategy<Value = Vec<PageId>> {
    vec(any::<u32>().prop_map(PageId), 0..200)
}

fn slot() -> impl Strategy<Value = Slot> {
    (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(p, offset, len)| Slot {
        page: PageId(p),
        // Keep offset + len representable, as the protocol requires.
        offset: offset.min(u64::MAX - len),
        len,
    })
}

fn error_code() -> impl Strategy<Value = ErrorCode> {
    (1u16..=u16::MAX).prop_map(|c| ErrorCode::from_u16(c).unwrap())
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (version(), any::<u32>(), "\\PC{0,64}").prop_map(|(version, pid, name)| Message::Hello {
            version,
            pid,
            name
        }),
        "[^\\x00]{1,300}".prop_map(|path| Message::OpenModel { path }),
        (any::<u32>(), pages()).prop_map(|(m, pages)| Message::Acquire {
            model: ModelId(m),
            pages
        }),
        (any::<u32>(), pages()).prop_map(|(m, pages)| Message::Prefetch {
            model: ModelId(m),
            pages
        }),
        (any::<u32>(), pages()).prop_map(|(m, pages)| Message::Release {
            model: ModelId(m),
            pages
        }),
        (any::<u32>(), pages()).prop_map(|(m, pages)| Message::ReadAhead {
            model: ModelId(m),
            pages
        }),
        (any::<u32>(), pages()).prop_map(|(m, pages)| Message::Resident {
            model: ModelId(m),
            pages
        }),
        vec(any::<bool>(), 0..200).prop_map(|resident| Message::ResidentPages { resident }),
        Just(Message::Stats),
        Just(Message::Close),
        (any::<u32>(), any::<u64>()).prop_map(|(m, max_bytes)| Message::Stage {
            model: ModelId(m),
            max_bytes
        }),
        any::<u32>().prop_map(|m| Message::Unstage { model: ModelId(m) }),
        any::<u32>().prop_map(|m| Message::ManifestPath { model: ModelId(m) }),
        (any::<u32>(), pages()).prop_map(|(m, pages)| Message::Pin {
            model: ModelId(m),
            pages
        }),
        (any::<u32>(), any::<bool>(), pages()).prop_map(|(m, append, pages)| {
            Message::KeepFast {
                model: ModelId(m),
                append,
                pages,
            }
        }),
        "[^\\x00]{1,300}".prop_map(|path| Message::ManifestAt { path }),
        (version(), any::<u64>(), any::<u64>()).prop_map(|(version, arena_len, server_id)| {
            Message::Welcome {
                version,
                arena_len,
                server_id,
            }
        }),
        (any::<u32>(), any::<u32>(), any::<[u8; 32]>()).prop_map(
            |(m, page_count, manifest_digest)| Message::ModelOpened {
                model: ModelId(m),
                page_count,
                manifest_digest
            }
        ),
        (any::<u32>(), vec(slot(), 0..100)).prop_map(|(m, slots)| Message::Acquired {
            model: ModelId(m),
            slots
        }),
        Just(Message::Ack),
        "\\PC{0,2000}".prop_map(|json| Message::StatsReply { json }),
        (error_code(), "\\PC{0,500}").prop_map(|(code, message)| Message::Error { code, message }),
    ]
}

/// Cuts `wire` at the given points (taken modulo its length, sorted).
fn split(wire: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
    points.sort_unstable();
    let mut out = Vec::new();
    let mut last = 0;
    for p in points.into_iter().chain([wire.len()]) {
        out.push(wire[last..p].to_vec());
        last = p;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn message_round_trips(msg in message(), id in any::<u32>()) {
        let frame = msg.to_frame(id).unwrap();
        prop_assert_eq!(frame.request_id, id);
        prop_assert_eq!(frame.flags, 0);
        let wire = frame.encode().unwrap();
        prop_assert_eq!(wire.len(), 12 + frame.payload.len());
        prop_assert_eq!(&wire[..4], &((8 + frame.payload.len()) as u32).to_le_bytes());
        let back = read_frame(&mut &wire[..]).unwrap().unwrap();
        prop_assert_eq!(&back, &frame);
        prop_assert_eq!(Message::decode(&back).unwrap(), msg);
    }

    #[test]
    fn decoder_gives_same_frames_for_any_split(
        msgs in vec((message(), any::<u32>()), 1..8),
        cuts in vec(any::<usize>(), 0..40),
    ) {
        let mut wire = Vec::new();
        let mut frames = Vec::new();
        for (m, id) in &msgs {
            let f = m.to_frame(*id).unwrap();
            f.encode_into(&mut wire).unwrap();
            frames.push(f);
        }

        // Random splits.
        let mut d = FrameDecoder::new();
        let mut got = Vec::new();
        for chunk in split(&wire, &cuts) {
            d.push(&chunk);
            while let Some(f) = d.next_frame().unwrap() {
                got.push(f);
            }
        }
        prop_assert_eq!(&got, &frames);
        prop_assert_eq!(d.buffered(), 0);

        // Byte by byte.
        let mut d = FrameDecoder::new();
        let mut got = Vec::new();
        for b in &wire {
            d.push(std::slice::from_ref(b));
            while let Some(f) = d.next_frame().unwrap() {
                got.push(f);
            }
        }
        prop_assert_eq!(&got, &frames);

        // Blocking reader over the concatenation.
        let mut r = &wire[..];
        let mut got = Vec::new();
        while let Some(f) = read_frame(&mut r).unwrap() {
            got.push(f);
        }
        prop_assert_eq!(&got, &frames);

        let decoded: Vec<Message> = got.iter().map(|f| Message::decode(f).unwrap()).collect();
        let want: Vec<Message> = msgs.iter().map(|(m, _)| m.clone()).collect();
        prop_assert_eq!(decoded, want);
    }

    /// Every proper prefix of a payload is a typed error, never a panic or a success.
    #[test]
    fn truncated_payloads_are_errors(msg in message()) {
        let frame = msg.to_frame(1).unwrap();
        for cut in 0..frame.payload.len() {
            let short = Frame { payload: frame.payload[..cut].to_vec(), ..frame.clone() };
            prop_assert!(Message::decode(&short).is_err(), "{} cut at {}", msg.name(), cut);
        }
        let mut long = frame.clone();
        long.payload.push(0);
        let is_trailing = matches!(
            Message::decode(&long),
            Err(vpaged::protocol::ProtocolError::TrailingBytes { count: 1, .. })
        );
        prop_assert!(is_trailing);
    }
}

#[test]
fn largest_requests_round_trip() {
    let pages: Vec<PageId> = (0..MAX_PAGES_PER_REQUEST as u32).map(PageId).collect();
    let slots: Vec<Slot> = pages
        .iter()
        .map(|&page| Slot {
            page,
            offset: u64::from(page.0) << 14,
            len: 1 << 14,
        })
        .collect();
    for msg in [
        Message::Acquire {
            model: ModelId(1),
            pages: pages.clone(),
        },
        Message::Acquired {
            model: ModelId(1),
            slots,
        },
        Message::StatsReply {
            json: "x".repeat(vpaged::protocol::MAX_STATS_LEN),
        },
    ] {
        let mut wire = Vec::new();
        write_frame(&mut wire, &msg.to_frame(5).unwrap()).unwrap();
        let f = read_frame(&mut &wire[..]).unwrap().unwrap();
        assert_eq!(Message::decode(&f).unwrap(), msg);
    }
}

/// Fuzzing (vpaged/fuzz frame_decode) found that a `Prefetch` or `Release` frame with
/// `NO_REPLY` decodes, yet its message re-encodes without the flag: flags belong to
/// the frame (the sender sets them), never to the message. A hint with the flag
/// round-trips once the sender sets it again; any other flag is refused, and on
/// every other message `NO_REPLY` is refused too.
#[test]
fn a_no_reply_frame_decodes_and_the_flag_is_the_frames_not_the_messages() {
    use vpaged::protocol::FLAG_NO_REPLY;
    let pages = vec![PageId(3), PageId(7)];
    for msg in [
        Message::Prefetch {
            model: ModelId(2),
            pages: pages.clone(),
        },
        Message::Release {
            model: ModelId(2),
            pages: pages.clone(),
        },
        Message::ReadAhead {
            model: ModelId(2),
            pages: pages.clone(),
        },
    ] {
        let mut frame = msg.to_frame(9).unwrap();
        assert_eq!(frame.flags, 0, "a message never sets a flag itself");
        frame.flags = FLAG_NO_REPLY;
        let back = Message::decode(&frame).unwrap();
        assert_eq!(back, msg);
        let mut again = back.to_frame(9).unwrap();
        again.flags = FLAG_NO_REPLY;
        assert_eq!(again, frame);
        frame.flags = 0x0002;
        assert!(
            Message::decode(&frame).is_err(),
            "a reserved flag is refused"
        );
    }
    let mut acquire = Message::Acquire {
        model: ModelId(2),
        pages,
    }
    .to_frame(1)
    .unwrap();
    acquire.flags = FLAG_NO_REPLY;
    assert!(
        Message::decode(&acquire).is_err(),
        "NO_REPLY on an Acquire is refused"
    );
}

/// A `ResidentPages` flag is 0 or 1; anything else is malformed, naming the field.
#[test]
fn resident_flags_are_zero_or_one() {
    use vpaged::protocol::Frame;
    let good = Message::ResidentPages {
        resident: vec![true, false],
    }
    .to_frame(3)
    .unwrap();
    assert_eq!(
        Message::decode(&good).unwrap(),
        Message::ResidentPages {
            resident: vec![true, false]
        }
    );
    let mut payload = good.payload.clone();
    payload[4] = 2;
    let bad = Frame { payload, ..good };
    let e = Message::decode(&bad).unwrap_err();
    assert!(e.to_string().contains("resident"), "{e}");
}

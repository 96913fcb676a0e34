//! The engine's client against a scripted fake daemon on a real Unix socket: a daemon
//! that never answers, one that hangs up, one that answers with a version it should
//! not, one whose `Acquired` does not match the request.

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use voom_formats::manifest::MANIFEST_FILE;
use voom_formats::{Checkpoint, DType, Manifest};
use vpaged::arena::{Arena, SLOT_ALIGN};
use vpaged::client::{DaemonClient, DaemonSource};
use vpaged::protocol::message::msg_type;
use vpaged::protocol::{
    read_frame, send_frame_with_fd, write_frame, Frame, Message, ModelId, Slot, Version,
    PROTOCOL_VERSION,
};
use vpaged::{PageId, PageSource};

/// A fake daemon: accepts one connection, answers `Hello` with `Welcome{welcome}` and
/// a real arena's descriptor, then hands the stream to `script`.
fn fake_daemon(
    dir: &Path,
    welcome: Version,
    script: impl FnOnce(UnixStream) + Send + 'static,
) -> PathBuf {
    let socket = dir.join("fake.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let hello = read_frame(&mut s).unwrap().unwrap();
        assert!(matches!(
            Message::decode(&hello).unwrap(),
            Message::Hello { .. }
        ));
        let arena = Arena::new(4 * SLOT_ALIGN).unwrap();
        let w = Message::Welcome {
            version: welcome,
            arena_len: arena.capacity() as u64,
            server_id: 1,
        };
        send_frame_with_fd(
            &s,
            &w.to_frame(hello.request_id).unwrap(),
            arena.fd().as_fd(),
        )
        .unwrap();
        script(s);
    });
    socket
}

fn reply(s: &mut UnixStream, to: &Frame, m: &Message) {
    write_frame(s, &m.to_frame(to.request_id).unwrap()).unwrap();
}

#[test]
fn a_daemon_that_never_answers_is_a_timeout_and_the_connection_is_then_unusable() {
    let d = tempfile::tempdir().unwrap();
    let (hold_tx, hold_rx) = mpsc::channel::<()>();
    let socket = fake_daemon(d.path(), PROTOCOL_VERSION, move |s| {
        // Reads nothing, answers nothing, keeps the connection open.
        let _ = hold_rx.recv();
        drop(s);
    });
    let c = DaemonClient::connect(&socket, "test").unwrap();
    c.set_request_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let t = Instant::now();
    let e = c.stats().unwrap_err().to_string();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(e.contains("no reply to Stats within"), "{e}");
    // The stream is out of step: later requests fail at once, naming the cause.
    let t = Instant::now();
    let e = c.stats().unwrap_err().to_string();
    assert!(t.elapsed() < Duration::from_millis(100));
    assert!(
        e.contains("unusable") && e.contains("no reply to Stats"),
        "{e}"
    );
    drop(hold_tx);
}

#[test]
fn a_daemon_that_hangs_up_is_a_clear_error() {
    let d = tempfile::tempdir().unwrap();
    let socket = fake_daemon(d.path(), PROTOCOL_VERSION, |mut s| {
        let _ = read_frame(&mut s);
        let _ = s.shutdown(std::net::Shutdown::Both);
    });
    let c = DaemonClient::connect(&socket, "test").unwrap();
    let e = c.stats().unwrap_err().to_string();
    assert!(
        e.contains("closed the connection before replying to Stats") && e.contains("fake.sock"),
        "{e}"
    );
}

#[test]
fn welcome_versions_are_checked() {
    let d = tempfile::tempdir().unwrap();
    let other_major = fake_daemon(d.path(), Version { major: 2, minor: 0 }, |_| {});
    let e = DaemonClient::connect(&other_major, "test")
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("protocol 2.0"), "{e}");

    let d = tempfile::tempdir().unwrap();
    let newer = Version {
        major: PROTOCOL_VERSION.major,
        minor: PROTOCOL_VERSION.minor + 5,
    };
    let socket = fake_daemon(d.path(), newer, |_| {});
    let c = DaemonClient::connect(&socket, "test").unwrap();
    assert_eq!(c.version(), PROTOCOL_VERSION, "a minor above ours is ours");

    let d = tempfile::tempdir().unwrap();
    let older = Version { major: 1, minor: 0 };
    let socket = fake_daemon(d.path(), older, |_| {});
    let c = DaemonClient::connect(&socket, "test").unwrap();
    assert_eq!(c.version(), older);
}

/// A two-page model store with its manifest.
fn model(dir: &Path) -> PathBuf {
    let m = dir.join("m");
    std::fs::create_dir_all(&m).unwrap();
    let a = vec![1u8; 256];
    let b = vec![2u8; 256];
    voom_formats::safetensors::write(
        &m.join("model.safetensors"),
        &[
            ("a", DType::BF16, &[128], &a),
            ("b", DType::BF16, &[128], &b),
        ],
        &BTreeMap::new(),
    )
    .unwrap();
    Manifest::build(&Checkpoint::open(&m).unwrap(), &mut |_, _| {})
        .unwrap()
        .save(&m)
        .unwrap();
    m.canonicalize().unwrap()
}

/// An `Acquired` with the wrong number of slots, or a reply that does not decode:
/// which pages were leased is unknown, so the client releases none (a release could
/// drop an older lease a live page still reads) and marks the connection unusable;
/// its leases go when the connection closes.
#[test]
fn a_mismatched_acquire_reply_makes_the_connection_unusable() {
    for garbage in [false, true] {
        let d = tempfile::tempdir().unwrap();
        let m = model(d.path());
        let digest = *blake3::hash(&std::fs::read(m.join(MANIFEST_FILE)).unwrap()).as_bytes();
        let (seen_tx, seen_rx) = mpsc::channel::<Message>();
        let socket = fake_daemon(d.path(), PROTOCOL_VERSION, move |mut s| {
            let open = read_frame(&mut s).unwrap().unwrap();
            let opened = Message::ModelOpened {
                model: ModelId(7),
                page_count: 2,
                manifest_digest: digest,
            };
            reply(&mut s, &open, &opened);
            while let Ok(Some(f)) = read_frame(&mut s) {
                let m = Message::decode(&f).unwrap();
                if let Message::Acquire { .. } = m {
                    if garbage {
                        // An `Acquired` that does not decode.
                        let bad = Frame {
                            msg_type: msg_type::ACQUIRED,
                            flags: 0,
                            request_id: f.request_id,
                            payload: vec![1, 2, 3],
                        };
                        write_frame(&mut s, &bad).unwrap();
                    } else {
                        // One slot for a two-page request.
                        let short = Message::Acquired {
                            model: ModelId(7),
                            slots: vec![Slot {
                                page: PageId(0),
                                offset: 0,
                                len: 256,
                            }],
                        };
                        reply(&mut s, &f, &short);
                    }
                }
                let _ = seen_tx.send(m);
            }
        });
        let c = DaemonClient::connect(&socket, "test").unwrap();
        let src = DaemonSource::open(Arc::clone(&c), &m).unwrap();
        let ids = [PageId(0), PageId(1)];
        let e = src.acquire_many(&ids).err().unwrap().to_string();
        let want = if garbage {
            "does not decode"
        } else {
            "2 pages with 1 slots"
        };
        assert!(e.contains(want), "{e}");
        // Later requests fail at once, naming the first failure, and send nothing.
        let e = src.acquire_many(&ids).err().unwrap().to_string();
        assert!(e.contains("unusable") && e.contains(want), "{e}");
        src.flush();
        drop(src);
        drop(c);
        let seen: Vec<Message> = seen_rx.iter().collect();
        assert_eq!(
            seen.len(),
            1,
            "only the first Acquire reached the daemon: {seen:?}"
        );
        assert!(matches!(seen[0], Message::Acquire { .. }), "{seen:?}");
    }
}

//! Real sockets, real shared memory: the handshake passes a memfd arena that the client
//! maps read-only and sees the server's bytes (and later writes) through.

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};

use vpaged::protocol::{
    peer_uid, read_frame, recv_frame_with_fd, send_frame_with_fd, write_frame, FrameDecoder,
    Message, ModelId, Slot, PROTOCOL_VERSION,
};
use vpaged::PageId;

#[test]
fn peer_uid_over_a_listening_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vpaged.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let client = UnixStream::connect(&path).unwrap();
    let (server_side, _) = listener.accept().unwrap();
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    assert_eq!(peer_uid(&server_side).unwrap(), me);
    assert_eq!(peer_uid(&client).unwrap(), me);
}

#[cfg(target_os = "linux")]
mod linux {
    use super::*;
    use std::ffi::CString;
    use std::fs::File;
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::fs::FileExt;

    const ARENA_LEN: usize = 64 * 16384;

    fn pattern(i: usize) -> u8 {
        (i.wrapping_mul(31) ^ (i >> 8)) as u8
    }

    fn memfd_arena() -> File {
        let name = CString::new("vpaged-test-arena").unwrap();
        // SAFETY: memfd_create with a valid NUL-terminated name and flags.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(ARENA_LEN as u64).unwrap();
        let bytes: Vec<u8> = (0..ARENA_LEN).map(pattern).collect();
        file.write_all_at(&bytes, 0).unwrap();
        file
    }

    #[test]
    fn handshake_passes_the_arena_and_client_maps_it_read_only() {
        let (client, server) = UnixStream::pair().unwrap();
        let arena = memfd_arena();

        let server_thread = std::thread::spawn(move || {
            let mut s = &server;
            let hello = read_frame(&mut s).unwrap().unwrap();
            let Message::Hello { version, pid, name } = Message::decode(&hello).unwrap() else {
                panic!("expected Hello");
            };
            assert_eq!(version, PROTOCOL_VERSION);
            assert_eq!(pid, std::process::id());
            assert_eq!(name, "engine-test");
            let welcome = Message::Welcome {
                version: PROTOCOL_VERSION.negotiate(version).unwrap(),
                arena_len: ARENA_LEN as u64,
                server_id: 0xfeed,
            };
            // Pass a read-only descriptor of the arena (the memfd reopened O_RDONLY),
            // so engines can map it only for reading.
            let read_only = File::open(format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(&arena)
            ))
            .unwrap();
            send_frame_with_fd(
                &server,
                &welcome.to_frame(hello.request_id).unwrap(),
                read_only.as_fd(),
            )
            .unwrap();
            drop(read_only);
            // A reply sent right behind the Welcome must not be lost by the client.
            let acquired = Message::Acquired {
                model: ModelId(0),
                slots: vec![Slot {
                    page: PageId(3),
                    offset: 3 * 16384,
                    len: 16384,
                }],
            };
            write_frame(&mut s, &acquired.to_frame(2).unwrap()).unwrap();
            // Wait for the client to have mapped the arena, then change a byte: the
            // client sees it because the mapping is shared memory, not a copy.
            let f = read_frame(&mut s).unwrap().unwrap();
            assert_eq!(Message::decode(&f).unwrap(), Message::Stats);
            arena.write_all_at(&[0xAB], 5).unwrap();
            write_frame(&mut s, &Message::Ack.to_frame(f.request_id).unwrap()).unwrap();
            arena
        });

        let mut c = &client;
        let hello = Message::Hello {
            version: PROTOCOL_VERSION,
            pid: std::process::id(),
            name: "engine-test".into(),
        };
        write_frame(&mut c, &hello.to_frame(1).unwrap()).unwrap();
        let mut decoder = FrameDecoder::new();
        let (welcome, fd) = recv_frame_with_fd(&client, &mut decoder).unwrap().unwrap();
        assert_eq!(welcome.request_id, 1);
        let Message::Welcome {
            arena_len,
            server_id,
            ..
        } = Message::decode(&welcome).unwrap()
        else {
            panic!("expected Welcome");
        };
        assert_eq!(server_id, 0xfeed);
        let fd = fd.expect("the arena descriptor comes with Welcome");
        // SAFETY: F_GETFD on a valid descriptor.
        let flags = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&fd), libc::F_GETFD) };
        assert!(
            flags & libc::FD_CLOEXEC != 0,
            "received fd must be close-on-exec"
        );
        let arena_file = File::from(fd);
        assert_eq!(arena_file.metadata().unwrap().len(), arena_len);
        // SAFETY: the arena is a memfd that the server only changes at byte 5 after the
        // Stats/Ack exchange below; we read it only through this read-only mapping.
        let map = unsafe { memmap2::Mmap::map(&arena_file) }.unwrap();
        assert_eq!(map.len(), ARENA_LEN);
        assert!(map.iter().enumerate().all(|(i, &b)| b == pattern(i)));

        // The frame queued behind Welcome comes next, without a descriptor.
        let (next, fd2) = recv_frame_with_fd(&client, &mut decoder).unwrap().unwrap();
        assert!(fd2.is_none());
        let Message::Acquired { slots, .. } = Message::decode(&next).unwrap() else {
            panic!("expected Acquired");
        };
        let s = slots[0];
        let page = &map[s.offset as usize..(s.offset + s.len) as usize];
        assert!(page
            .iter()
            .enumerate()
            .all(|(i, &b)| b == pattern(s.offset as usize + i)));

        write_frame(&mut c, &Message::Stats.to_frame(7).unwrap()).unwrap();
        let ack = read_frame(&mut c).unwrap().unwrap();
        assert_eq!(
            (ack.request_id, Message::decode(&ack).unwrap()),
            (7, Message::Ack)
        );
        assert_eq!(map[5], 0xAB, "the mapping shares the server's memory");

        // The server passed a read-only descriptor: a shared writable mapping (which
        // could corrupt other engines' pages) is refused by the kernel.
        // SAFETY: the mapping is expected to fail; were it to succeed it is dropped
        // unused.
        let rw = unsafe { memmap2::MmapMut::map_mut(&arena_file) };
        assert_eq!(rw.err().map(|e| e.raw_os_error()), Some(Some(libc::EACCES)));
        drop(map);
        let arena = server_thread.join().unwrap();
        drop(arena);

        // Closed by the server: clean end of stream.
        drop(client);
    }

    #[test]
    fn end_of_stream_inside_a_frame_is_reported() {
        let (client, server) = UnixStream::pair().unwrap();
        let wire = Message::Ack.encode(1).unwrap();
        (&server).write_all(&wire[..5]).unwrap();
        drop(server);
        let mut d = FrameDecoder::new();
        let e = recv_frame_with_fd(&client, &mut d).unwrap_err();
        assert!(
            matches!(
                e,
                vpaged::protocol::ProtocolError::Truncated {
                    expected: 12,
                    got: 5
                }
            ),
            "{e}"
        );
    }
}

//! The daemon end to end: a real `vpaged` process, a real Unix socket, the arena
//! passed by SCM_RIGHTS and mapped read-only here.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use voom_formats::{Checkpoint, Manifest};
use vpaged::client::{DaemonClient, DaemonSource};
use vpaged::{PageId, PageSource};

mod common;
use common::model;

struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &Path, cache: &str) -> Daemon {
    start_with(dir, cache, &[])
}

/// A daemon with its socket and state directory under `dir`, and `extra` flags.
fn start_with(dir: &Path, cache: &str, extra: &[&str]) -> Daemon {
    let socket = dir.join("vpaged.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_vpaged"))
        .args(["--socket"])
        .arg(&socket)
        .args(["--cache-size", cache])
        .args(extra)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("VPAGED_LOG", "warn")
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !socket.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "vpaged did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Daemon { child, socket }
}

fn stats(c: &DaemonClient) -> serde_json::Value {
    c.stats().unwrap()
}

#[test]
fn engines_share_one_copy_and_leases_die_with_connections() {
    let d = tempfile::tempdir().unwrap();
    let (m, pages) = model(d.path(), 0);
    let daemon = start(d.path(), "4MiB");

    let c1 = DaemonClient::connect(&daemon.socket, "test-1").unwrap();
    let s1 = DaemonSource::open(Arc::clone(&c1), &m).unwrap();
    let c2 = DaemonClient::connect(&daemon.socket, "test-2").unwrap();
    let s2 = DaemonSource::open(Arc::clone(&c2), &m).unwrap();
    assert_eq!(s1.pages().len(), 4);

    for (i, want) in pages.iter().enumerate() {
        let l1 = s1.acquire(PageId(i as u32)).unwrap();
        let l2 = s2.acquire(PageId(i as u32)).unwrap();
        assert_eq!(l1.bytes(), want.as_slice());
        // Both engines read the same slot of the shared arena: one copy.
        let off1 = l1.bytes().as_ptr() as usize - c1.arena().as_ptr() as usize;
        let off2 = l2.bytes().as_ptr() as usize - c2.arena().as_ptr() as usize;
        assert_eq!(off1, off2);
        assert_eq!(off1 % (16 << 10), 0, "slots are 16 KiB aligned");
    }
    let s = stats(&c1);
    assert_eq!(s["cache"]["misses"], 4, "{s}");
    assert_eq!(s["cache"]["hits"], 4, "{s}");
    assert_eq!(s["sessions"]["connected"], 2, "{s}");
    // The engine sees the bytes read per tier: one read of each page, from the
    // model's own directory.
    let cs = s1.cache_stats().unwrap();
    assert_eq!(
        (cs.primary_bytes, cs.fast_tier_bytes, cs.nas_bytes),
        (4 * 40_000, 0, 0),
        "{cs:?}"
    );

    // Leases held by a connection that goes away (as when its engine is killed) are
    // released by the daemon.
    let held: Vec<_> = (0..4).map(|i| s2.acquire(PageId(i)).unwrap()).collect();
    let s = stats(&c1);
    assert_eq!(s["sessions"]["leases"], 4, "{s}");
    // The engine never releases them: its connection just closes (what the kernel
    // does when a process dies).
    c2.disconnect();
    let t = Instant::now();
    loop {
        let s = stats(&c1);
        if s["sessions"]["leases"] == 0 && s["sessions"]["connected"] == 1 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "leases not released: {s}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The pages are now evictable at the daemon.
    assert_eq!(stats(&c1)["cache"]["leased_bytes"], 0);
    drop(held);
}

#[test]
fn a_dead_daemon_is_a_clear_error_and_sigterm_exits_cleanly() {
    let d = tempfile::tempdir().unwrap();
    let (m, pages) = model(d.path(), 0);
    let mut daemon = start(d.path(), "4MiB");
    let c = DaemonClient::connect(&daemon.socket, "test").unwrap();
    let s = DaemonSource::open(Arc::clone(&c), &m).unwrap();
    let held = s.acquire(PageId(0)).unwrap();
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    let e = s.acquire(PageId(1)).unwrap_err().to_string();
    assert!(e.contains("vpaged at") && e.contains("vpaged.sock"), "{e}");
    // Bytes already leased stay readable: the mapping is this process's own.
    assert_eq!(held.bytes(), pages[0].as_slice());
    // The store on disk is intact.
    let ckpt = Checkpoint::open(&m).unwrap();
    let manifest = Manifest::load(&m).unwrap().unwrap();
    assert!(manifest
        .verify_checkpoint(&ckpt, &mut |_, _| {})
        .unwrap()
        .is_empty());
    drop(held);

    // A new daemon on the same socket path (the stale file is replaced); SIGTERM
    // drains and exits 0, removing the socket.
    let mut daemon = start_after_stale(d.path());
    let c = DaemonClient::connect(&daemon.socket, "test").unwrap();
    drop(c);
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(daemon.child.id() as i32, libc::SIGTERM) };
    let status = daemon.child.wait().unwrap();
    assert!(status.success(), "{status}");
    assert!(!daemon.socket.exists());
}

fn start_after_stale(dir: &Path) -> Daemon {
    let socket = dir.join("vpaged.sock");
    assert!(socket.exists(), "the killed daemon leaves its socket file");
    let child = Command::new(env!("CARGO_BIN_EXE_vpaged"))
        .arg("--socket")
        .arg(&socket)
        .args(["--cache-size", "4MiB"])
        .env("VPAGED_LOG", "warn")
        .spawn()
        .unwrap();
    let t = Instant::now();
    loop {
        if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "vpaged did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Daemon { child, socket }
}

#[test]
fn bad_requests_are_errors_not_crashes() {
    let d = tempfile::tempdir().unwrap();
    let (m, _) = model(d.path(), 0);
    let daemon = start(d.path(), "4MiB");
    let c = DaemonClient::connect(&daemon.socket, "test").unwrap();
    let e = DaemonSource::open(Arc::clone(&c), &d.path().join("nope"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("nope"), "{e}");
    let s = DaemonSource::open(Arc::clone(&c), &m).unwrap();
    let e = s.acquire(PageId(99)).unwrap_err().to_string();
    assert!(e.contains("99"), "{e}");
    // The daemon still serves.
    assert!(s.acquire(PageId(0)).is_ok());
}

#[test]
fn vpagectl_reports_status_and_residency() {
    let d = tempfile::tempdir().unwrap();
    let (m, _) = model(d.path(), 0);
    let daemon = start(d.path(), "4MiB");
    let c = DaemonClient::connect(&daemon.socket, "engine").unwrap();
    let s = DaemonSource::open(Arc::clone(&c), &m).unwrap();
    let _held = s.acquire(PageId(2)).unwrap();
    let ctl = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_vpagectl"))
            .arg("--socket")
            .arg(&daemon.socket)
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let status: serde_json::Value = serde_json::from_str(&ctl(&["status", "--json"])).unwrap();
    assert_eq!(status["sessions"]["leases"], 1, "{status}");
    assert_eq!(status["cache"]["misses"], 1, "{status}");
    let pages: serde_json::Value =
        serde_json::from_str(&ctl(&["pages", m.to_str().unwrap(), "--json"])).unwrap();
    let rows = pages["pages"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    let resident: Vec<bool> = rows
        .iter()
        .map(|r| r["resident"].as_bool().unwrap())
        .collect();
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["a", "b", "c", "d"]);
    assert!(rows.iter().all(|r| r["group"] == "other"), "{pages}");
    assert!(rows.iter().all(|r| r["format"] == r["dtype"]), "{pages}");
    assert_eq!(resident, [false, false, true, false]);
    assert_eq!(rows[2]["requests"], 1);
    // Text output too.
    let text = ctl(&["status"]);
    assert!(
        text.contains("1 leases held") && text.contains("of 4.00 MiB used"),
        "{text}"
    );
}

/// `vpagectl pages` names each page's stored format: an FP8 checkpoint's weights
/// and their block scales apart from its BF16 tensors.
#[test]
fn vpagectl_pages_shows_each_pages_format() {
    let d = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/tiny_fp8/qwen3_fp8_partial_blocks");
    let m = d.path().join("model");
    std::fs::create_dir(&m).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), m.join(f)).unwrap();
    }
    let ckpt = Checkpoint::open(&m).unwrap();
    Manifest::build(&ckpt, &mut |_, _| {})
        .unwrap()
        .save(&m)
        .unwrap();
    let daemon = start(d.path(), "4MiB");
    let run = |json: bool| {
        let o = Command::new(env!("CARGO_BIN_EXE_vpagectl"))
            .arg("--socket")
            .arg(&daemon.socket)
            .args(["pages", m.to_str().unwrap()])
            .args(json.then_some("--json"))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let pages: serde_json::Value = serde_json::from_str(&run(true)).unwrap();
    let format = |name: &str| {
        pages["pages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .unwrap_or_else(|| panic!("no page {name}"))["format"]
            .clone()
    };
    let q = "model.layers.0.self_attn.q_proj.weight";
    assert_eq!(format(q), "FP8 e4m3");
    assert_eq!(format(&format!("{q}_scale_inv")), "FP8 scales F32");
    assert_eq!(format("model.layers.0.input_layernorm.weight"), "BF16");
    let text = run(false);
    let line = text.lines().find(|l| l.ends_with(q)).unwrap();
    assert!(line.contains("FP8 e4m3"), "{text}");
}

#[test]
fn vpagectl_stages_hot_pages_onto_the_fast_tier_and_unstages_them() {
    let d = tempfile::tempdir().unwrap();
    let (m, _) = model(d.path(), 0);
    let socket = d.path().join("vpaged.sock");
    let fast = d.path().join("fast");
    let child = Command::new(env!("CARGO_BIN_EXE_vpaged"))
        .arg("--socket")
        .arg(&socket)
        .args(["--cache-size", "4MiB", "--fast-tier"])
        .arg(&fast)
        .args(["--fast-tier-size", "1MiB"])
        .env("VPAGED_LOG", "warn")
        .spawn()
        .unwrap();
    let daemon = Daemon { child, socket };
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(&daemon.socket).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "vpaged did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let c = DaemonClient::connect(&daemon.socket, "engine").unwrap();
    let s = DaemonSource::open(Arc::clone(&c), &m).unwrap();
    for p in [1, 1, 3] {
        drop(s.acquire(PageId(p)).unwrap());
    }
    let ctl = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_vpagectl"))
            .arg("--socket")
            .arg(&daemon.socket)
            .args(args)
            .arg(&m)
            .arg("--json")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    // Only requested pages are hot: pages 1 and 3.
    let r = ctl(&["stage"]);
    assert_eq!(r["staged_pages"], 2, "{r}");
    assert_eq!(r["staged_bytes"], 80_000, "{r}");
    let staged = std::fs::read_dir(&fast)
        .unwrap()
        .flat_map(|e| std::fs::read_dir(e.unwrap().path()).unwrap())
        .count();
    assert_eq!(staged, 2);
    let r = ctl(&["unstage"]);
    assert_eq!(r["unstaged_pages"], 2, "{r}");
    let left = std::fs::read_dir(&fast)
        .unwrap()
        .flat_map(|e| std::fs::read_dir(e.unwrap().path()).unwrap())
        .count();
    assert_eq!(left, 0);
}

/// Protocol 1.2's `FLAG_NO_REPLY`, on the wire: a hint or release that succeeds gets no
/// reply, one that fails still gets its error, and the flag on any other message is a
/// bad request.
#[test]
fn no_reply_frames_are_answered_only_when_they_fail() {
    use std::io::Write;
    use vpaged::protocol::{
        read_frame, recv_frame_with_fd, ErrorCode, FrameDecoder, Message, FLAG_NO_REPLY,
        PROTOCOL_VERSION,
    };
    let d = tempfile::tempdir().unwrap();
    let (m, _) = model(d.path(), 0);
    let daemon = start(d.path(), "4MiB");
    let mut s = std::os::unix::net::UnixStream::connect(&daemon.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let hello = Message::Hello {
        version: PROTOCOL_VERSION,
        pid: std::process::id(),
        name: "raw".into(),
    };
    s.write_all(&hello.encode(1).unwrap()).unwrap();
    let (welcome, fd) = recv_frame_with_fd(&s, &mut FrameDecoder::new())
        .unwrap()
        .unwrap();
    assert!(fd.is_some());
    match Message::decode(&welcome).unwrap() {
        Message::Welcome { version, .. } => assert!(version.minor >= 2, "{version}"),
        other => panic!("{other:?}"),
    }
    let open = Message::OpenModel {
        path: m.to_string_lossy().into_owned(),
    };
    s.write_all(&open.encode(2).unwrap()).unwrap();
    let model = match Message::decode(&read_frame(&mut s).unwrap().unwrap()).unwrap() {
        Message::ModelOpened { model, .. } => model,
        other => panic!("{other:?}"),
    };
    let frame = |m: Message, id: u32, flags: u16| {
        let mut f = m.to_frame(id).unwrap();
        f.flags = flags;
        f.encode().unwrap()
    };
    // In one write: a hint (succeeds: no reply), a release of a page not leased (fails:
    // an error with its id), an acquire, its release (no reply), then Stats.
    let mut bytes = frame(
        Message::Prefetch {
            model,
            pages: vec![PageId(1)],
        },
        3,
        FLAG_NO_REPLY,
    );
    bytes.extend(frame(
        Message::Release {
            model,
            pages: vec![PageId(2)],
        },
        4,
        FLAG_NO_REPLY,
    ));
    bytes.extend(frame(
        Message::Acquire {
            model,
            pages: vec![PageId(0)],
        },
        5,
        0,
    ));
    bytes.extend(frame(
        Message::Release {
            model,
            pages: vec![PageId(0)],
        },
        6,
        FLAG_NO_REPLY,
    ));
    bytes.extend(frame(Message::Stats, 7, 0));
    s.write_all(&bytes).unwrap();
    let mut replies = Vec::new();
    loop {
        let f = read_frame(&mut s).unwrap().unwrap();
        let id = f.request_id;
        replies.push((id, Message::decode(&f).unwrap()));
        if id == 7 {
            break;
        }
    }
    let ids: Vec<u32> = replies.iter().map(|r| r.0).collect();
    assert_eq!(ids, [4, 5, 7], "{replies:?}");
    assert!(
        matches!(&replies[0].1, Message::Error { code: ErrorCode::BadRequest, message } if message.contains("page 2")),
        "{replies:?}"
    );
    assert!(matches!(replies[1].1, Message::Acquired { .. }));
    match &replies[2].1 {
        Message::StatsReply { json } => {
            let v: serde_json::Value = serde_json::from_str(json).unwrap();
            assert_eq!(v["sessions"]["leases"], 0, "the release took effect: {v}");
        }
        other => panic!("{other:?}"),
    }
    // The flag means nothing on other messages: a bad request, and the session goes on.
    s.write_all(&frame(Message::Stats, 8, FLAG_NO_REPLY))
        .unwrap();
    let f = read_frame(&mut s).unwrap().unwrap();
    assert_eq!(f.request_id, 8);
    match Message::decode(&f).unwrap() {
        Message::Error { code, message } => {
            assert_eq!(code, ErrorCode::BadRequest);
            assert!(message.contains("flags"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    s.write_all(&Message::Stats.encode(9).unwrap()).unwrap();
    let f = read_frame(&mut s).unwrap().unwrap();
    assert!(matches!(
        Message::decode(&f).unwrap(),
        Message::StatsReply { .. }
    ));
}

/// A checkpoint without a page manifest opens through the daemon: it is hashed once
/// and the manifest written beside it (the same file `vpagectl hash` writes), and its
/// pages are served verified. Where the directory cannot be written, the manifest is
/// kept in the daemon's state directory, the client reads it there (`ManifestPath`),
/// and a changed checkpoint is hashed again; with `--no-hash-on-open` the daemon
/// refuses a checkpoint without a manifest, naming `vpagectl hash`.
#[test]
fn a_checkpoint_without_a_manifest_is_hashed_once_when_opened() {
    let d = tempfile::tempdir().unwrap();
    let (m, pages) = model(d.path(), 7);
    let manifest_path = m.join(voom_formats::manifest::MANIFEST_FILE);
    let want = std::fs::read(&manifest_path).unwrap();
    std::fs::remove_file(&manifest_path).unwrap();

    let daemon = start(d.path(), "4MiB");
    let c = DaemonClient::connect(&daemon.socket, "test").unwrap();
    let s = DaemonSource::open(Arc::clone(&c), &m).unwrap();
    assert_eq!(
        std::fs::read(&manifest_path).unwrap(),
        want,
        "the manifest vpagectl hash writes"
    );
    for (i, bytes) in pages.iter().enumerate() {
        assert_eq!(
            s.acquire(PageId(i as u32)).unwrap().bytes(),
            bytes.as_slice()
        );
    }
    // Opened again: the manifest written is the one used, not a second hash.
    let stamp = std::fs::metadata(&manifest_path)
        .unwrap()
        .modified()
        .unwrap();
    let again = DaemonSource::open(Arc::clone(&c), &m).unwrap();
    assert_eq!(again.model_id(), s.model_id());
    assert_eq!(
        std::fs::metadata(&manifest_path)
            .unwrap()
            .modified()
            .unwrap(),
        stamp
    );
    drop((s, again));

    // A directory that cannot be written (root writes into a 0555 one anyway; the
    // immutable attribute stops root too where the file system has it).
    let ro = d.path().join("ro");
    std::fs::create_dir_all(&ro).unwrap();
    std::fs::copy(m.join("model.safetensors"), ro.join("model.safetensors")).unwrap();
    let ro = ro.canonicalize().unwrap();
    struct Immutable(PathBuf);
    impl Immutable {
        fn set(dir: &Path, on: bool) -> bool {
            Command::new("chattr")
                .arg(if on { "+i" } else { "-i" })
                .arg(dir)
                .status()
                .is_ok_and(|s| s.success())
        }
    }
    impl Drop for Immutable {
        fn drop(&mut self) {
            Immutable::set(&self.0, false);
        }
    }
    let probe = |dir: &Path| {
        let ok = std::fs::File::create(dir.join("probe")).is_ok();
        let _ = std::fs::remove_file(dir.join("probe"));
        ok
    };
    let mut perm = std::fs::metadata(&ro).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o555);
    std::fs::set_permissions(&ro, perm).unwrap();
    let _immutable = (probe(&ro) && Immutable::set(&ro, true)).then(|| Immutable(ro.clone()));
    if probe(&ro) {
        eprintln!("skipping the read-only case: this user can write into the directory");
    } else {
        let s = DaemonSource::open(Arc::clone(&c), &ro).unwrap();
        assert!(!ro.join(voom_formats::manifest::MANIFEST_FILE).exists());
        for (i, bytes) in pages.iter().enumerate() {
            assert_eq!(
                s.acquire(PageId(i as u32)).unwrap().bytes(),
                bytes.as_slice()
            );
        }
        let kept: Vec<PathBuf> = std::fs::read_dir(d.path().join("state/manifests"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(kept.len(), 1, "{kept:?}");
        assert_eq!(
            std::fs::read(kept[0].join(voom_formats::manifest::MANIFEST_FILE)).unwrap(),
            want
        );
        // Opened again, unchanged: the same model.
        let again = DaemonSource::open(Arc::clone(&c), &ro).unwrap();
        assert_eq!(again.model_id(), s.model_id());
        drop((s, again));
        // The checkpoint changes (new bytes, same layout): hashed again, opened as a
        // new model whose pages are the new bytes.
        let (_, new_pages) = model(&d.path().join("other"), 99);
        Immutable::set(&ro, false);
        std::fs::copy(
            d.path().join("other/m/model.safetensors"),
            ro.join("model.safetensors"),
        )
        .unwrap();
        Immutable::set(&ro, true);
        let s = DaemonSource::open(Arc::clone(&c), &ro).unwrap();
        for (i, bytes) in new_pages.iter().enumerate() {
            assert_eq!(
                s.acquire(PageId(i as u32)).unwrap().bytes(),
                bytes.as_slice()
            );
        }
        assert_ne!(
            std::fs::read(kept[0].join(voom_formats::manifest::MANIFEST_FILE)).unwrap(),
            want
        );
    }
    drop(daemon);

    // Refused when hashing on open is off.
    let other = tempfile::tempdir().unwrap();
    let (m2, _) = model(other.path(), 1);
    std::fs::remove_file(m2.join(voom_formats::manifest::MANIFEST_FILE)).unwrap();
    let refusing = start_with(other.path(), "4MiB", &["--no-hash-on-open"]);
    let c = DaemonClient::connect(&refusing.socket, "test").unwrap();
    let e = DaemonSource::open(c, &m2).err().unwrap().to_string();
    assert!(e.contains("vpagectl hash"), "{e}");
    assert!(!m2.join(voom_formats::manifest::MANIFEST_FILE).exists());
}

/// An engine's planner pins through the daemon (`Pin`): what fits the pin budget is
/// pinned, loaded and kept through pressure, for as long as the connection lasts; a
/// second engine's pins of the same pages cost nothing more, and the pins go when
/// the last holder's connection does.
#[test]
fn planner_pins_last_as_long_as_their_connection() {
    let d = tempfile::tempdir().unwrap();
    let (m, _) = model(d.path(), 3);
    // Four pages of 40 000 bytes (three 16 KiB slots each): a 1 MiB cache keeps
    // every pin after a window of two of the largest "layers" (these pages form
    // none, so the window is empty).
    let daemon = start(d.path(), "1MiB");
    let c1 = DaemonClient::connect(&daemon.socket, "engine-1").unwrap();
    let s1 = DaemonSource::open(Arc::clone(&c1), &m).unwrap();
    s1.pin(&[PageId(0), PageId(2)]);
    let slot = 3 * (16 << 10);
    let st = stats(&c1);
    assert_eq!(st["cache"]["pinned_bytes"], 2 * slot, "{st}");
    assert_eq!(st["cache"]["resident_pages"], 2, "loaded at once: {st}");

    let c2 = DaemonClient::connect(&daemon.socket, "engine-2").unwrap();
    let s2 = DaemonSource::open(Arc::clone(&c2), &m).unwrap();
    s2.pin(&[PageId(2), PageId(3)]);
    assert_eq!(stats(&c1)["cache"]["pinned_bytes"], 3 * slot);

    // The first engine goes: page 0 is unpinned, page 2 stays (the second holds it).
    c1.disconnect();
    let t = Instant::now();
    // (The stats document is not one snapshot: the cache's counters may be read
    // before the session count, so wait for both.)
    loop {
        let st = stats(&c2);
        if st["sessions"]["connected"] == 1 && st["cache"]["pinned_bytes"] == 2 * slot {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "page 0's pin not withdrawn, or page 2's with it: {st}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(s1);
    c2.disconnect();
    let c3 = DaemonClient::connect(&daemon.socket, "observer").unwrap();
    let t = Instant::now();
    while stats(&c3)["cache"]["pinned_bytes"] != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "pins outlived their connections"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(s2);
}

/// `KeepFast` (protocol 1.4): the daemon keeps, of an engine's candidates (most
/// valuable first), those its fast tier has room for; a copy of each is written as
/// the page is first read, and once the cache has evicted it, the page is read back
/// from its copy, with the same bytes.
#[test]
fn the_planners_fast_tier_set_is_kept_as_its_pages_are_read() {
    let d = tempfile::tempdir().unwrap();
    let (m, bytes) = model(d.path(), 0);
    let fast = d.path().join("fast");
    // A cache of two pages (three 16 KiB slots each); a fast tier of two copies.
    let daemon = start_with(
        d.path(),
        "96KiB",
        &[
            "--fast-tier",
            fast.to_str().unwrap(),
            "--fast-tier-size",
            "100000",
        ],
    );
    let c = DaemonClient::connect(&daemon.socket, "engine").unwrap();
    let s = DaemonSource::open(Arc::clone(&c), &m).unwrap();
    s.keep_on_fast_tier(&[PageId(3), PageId(1), PageId(2), PageId(0)]);
    let copies = || {
        std::fs::read_dir(&fast)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.path().is_dir())
                    .flat_map(|e| std::fs::read_dir(e.path()).unwrap())
                    .count()
            })
            .unwrap_or(0)
    };
    assert_eq!(copies(), 0, "nothing is copied before it is read");
    for p in [3, 1, 2, 0] {
        let l = s.acquire(PageId(p)).unwrap();
        assert_eq!(l.bytes(), &bytes[p as usize][..]);
    }
    // Pages 3 and 1 fit; 2 and 0 do not.
    assert_eq!(copies(), 2);
    let before = s.cache_stats().unwrap();
    // Of pages 3 and 1, what 2 and 0 evicted is read back from its copy: nothing
    // from the slow tier.
    for p in [3, 1] {
        let l = s.acquire(PageId(p)).unwrap();
        assert_eq!(l.bytes(), &bytes[p as usize][..]);
    }
    let after = s.cache_stats().unwrap();
    let from_fast = after.fast_tier_bytes - before.fast_tier_bytes;
    assert!(
        from_fast > 0 && from_fast.is_multiple_of(40_000),
        "{from_fast}"
    );
    assert_eq!(after.primary_bytes, before.primary_bytes);
}

/// `Resident` (protocol 1.6) through the client: a page is ready once the daemon's
/// cache holds it, and a list is ready only when all of it is.
#[test]
fn the_daemon_says_which_pages_are_ready() {
    let d = tempfile::tempdir().unwrap();
    let (m, _) = model(d.path(), 0);
    let daemon = start(d.path(), "4MiB");
    let c = DaemonClient::connect(&daemon.socket, "engine").unwrap();
    assert!(c.version().minor >= 6, "{:?}", c.version());
    let s = DaemonSource::open(Arc::clone(&c), &m).unwrap();
    assert!(!s.ready(&[PageId(1)]));
    drop(s.acquire(PageId(1)).unwrap());
    assert!(s.ready(&[PageId(1)]));
    assert!(!s.ready(&[PageId(1), PageId(2)]));
    assert!(s.ready(&[]));
}

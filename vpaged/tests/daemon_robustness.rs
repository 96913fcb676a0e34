//! The daemon against peers that misbehave or fail: real Unix sockets, real model
//! files, the daemon in this process (with short limits) or as the `vpaged` binary.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vpaged::client::{DaemonClient, DaemonSource};
use vpaged::daemon::{Daemon, DaemonLimits};
use vpaged::protocol::{
    read_frame, recv_frame_with_fd, ErrorCode, FrameDecoder, Message, ModelId, Version,
    FLAG_NO_REPLY, MAX_ERROR_MESSAGE_LEN, PROTOCOL_VERSION,
};
use vpaged::store::{Store, StoreConfig};
use vpaged::tier::NasConfig;
use vpaged::{PageId, PageSource};

mod common;
use common::{mkfifo, model, packed_model};

/// A daemon served in this process on a thread of its own; stopped when dropped.
struct InProcess {
    socket: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(dir: &Path, cfg: StoreConfig, limits: DaemonLimits) -> InProcess {
    let socket = dir.join("vpaged.sock");
    let store = Store::new(StoreConfig {
        cache_bytes: 4 << 20,
        ..cfg
    })
    .unwrap();
    let daemon = Daemon::with_limits(store, limits);
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    listener.set_nonblocking(true).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let path = socket.clone();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::UnixListener::from_std(listener).unwrap();
            daemon
                .serve(listener, path, async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
    });
    InProcess {
        socket,
        stop: Some(stop),
        thread: Some(thread),
    }
}

fn limits() -> DaemonLimits {
    DaemonLimits {
        max_sessions: 8,
        hello_timeout: Duration::from_millis(300),
        drain_grace: Duration::from_millis(300),
        request_timeout: Duration::from_secs(30),
    }
}

/// A raw protocol connection: frames by hand, to see exactly what the daemon sends.
struct Raw {
    s: UnixStream,
    next_id: u32,
}

impl Raw {
    /// Connects and sends `Hello{version}`; returns the connection and the daemon's
    /// first reply.
    fn hello(socket: &Path, version: Version) -> (Raw, Message) {
        let mut s = UnixStream::connect(socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let hello = Message::Hello {
            version,
            pid: std::process::id(),
            name: "raw".into(),
        };
        s.write_all(&hello.encode(1).unwrap()).unwrap();
        let (f, _fd) = recv_frame_with_fd(&s, &mut FrameDecoder::new())
            .unwrap()
            .unwrap();
        let reply = Message::decode(&f).unwrap();
        (Raw { s, next_id: 2 }, reply)
    }

    fn connect(socket: &Path) -> Raw {
        let (raw, reply) = Raw::hello(socket, PROTOCOL_VERSION);
        assert!(matches!(reply, Message::Welcome { .. }), "{reply:?}");
        raw
    }

    fn send(&mut self, m: &Message, flags: u16) -> u32 {
        let id = self.next_id;
        self.next_id += 1;
        let mut f = m.to_frame(id).unwrap();
        f.flags = flags;
        self.s.write_all(&f.encode().unwrap()).unwrap();
        id
    }

    fn request(&mut self, m: &Message) -> Message {
        let id = self.send(m, 0);
        let f = read_frame(&mut self.s).unwrap().unwrap();
        assert_eq!(f.request_id, id);
        Message::decode(&f).unwrap()
    }

    /// Whether the daemon closes the connection (end of stream) within 5 s.
    fn sees_eof(&mut self) -> bool {
        self.s
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        matches!(read_frame(&mut self.s), Ok(None))
    }
}

fn open(raw: &mut Raw, dir: &Path) -> ModelId {
    match raw.request(&Message::OpenModel {
        path: dir.to_string_lossy().into_owned(),
    }) {
        Message::ModelOpened { model, .. } => model,
        other => panic!("{other:?}"),
    }
}

fn error_of(m: Message) -> (ErrorCode, String) {
    match m {
        Message::Error { code, message } => (code, message),
        other => panic!("expected an error, got {other:?}"),
    }
}

/// `Welcome` carries the negotiated version; a session the server ends (Close, a
/// version it refuses, a first message other than Hello) ends with the end of the
/// stream at the peer.
#[test]
fn the_server_negotiates_and_closes_the_sessions_it_ends() {
    let d = tempfile::tempdir().unwrap();
    let daemon = serve(d.path(), StoreConfig::default(), limits());
    let v10 = Version { major: 1, minor: 0 };
    let (mut raw, welcome) = Raw::hello(&daemon.socket, v10);
    match welcome {
        Message::Welcome { version, .. } => assert_eq!(version, v10),
        other => panic!("{other:?}"),
    }
    assert_eq!(raw.request(&Message::Close), Message::Ack);
    assert!(raw.sees_eof(), "no end of stream after Close");

    let (mut raw, reply) = Raw::hello(&daemon.socket, Version { major: 2, minor: 0 });
    assert_eq!(error_of(reply).0, ErrorCode::Version);
    assert!(raw.sees_eof(), "no end of stream after Error{{Version}}");

    let mut s = UnixStream::connect(&daemon.socket).unwrap();
    s.write_all(&Message::Stats.encode(4).unwrap()).unwrap();
    let mut raw = Raw { s, next_id: 5 };
    let f = read_frame(&mut raw.s).unwrap().unwrap();
    assert_eq!(
        error_of(Message::decode(&f).unwrap()).0,
        ErrorCode::BadRequest
    );
    assert!(raw.sees_eof(), "no end of stream after a bad first message");
}

/// An error whose text would pass the protocol's bound is cut, not dropped with the
/// session: the leases held stay held and the session goes on.
#[test]
fn an_over_long_error_is_cut_and_the_session_and_its_leases_survive() {
    let d = tempfile::tempdir().unwrap();
    let (m, _) = model(d.path(), 0);
    let daemon = serve(d.path(), StoreConfig::default(), limits());
    let mut raw = Raw::connect(&daemon.socket);
    let model = open(&mut raw, &m);
    let got = raw.request(&Message::Acquire {
        model,
        pages: vec![PageId(0)],
    });
    assert!(matches!(got, Message::Acquired { .. }), "{got:?}");
    let path = format!("/nonexistent/{}", "x".repeat(4080));
    let (code, message) = error_of(raw.request(&Message::OpenModel { path }));
    assert_eq!(code, ErrorCode::NotFound);
    assert!(message.len() <= MAX_ERROR_MESSAGE_LEN && message.ends_with('…'));
    match raw.request(&Message::Stats) {
        Message::StatsReply { json } => {
            let v: serde_json::Value = serde_json::from_str(&json).unwrap();
            assert_eq!(v["sessions"]["leases"], 1, "{v}");
        }
        other => panic!("{other:?}"),
    }
}

/// Requests naming a model need it opened on the connection, hints included; model
/// ids are the daemon's, the same for every connection.
#[test]
fn prefetch_needs_the_model_opened_on_the_connection() {
    let d = tempfile::tempdir().unwrap();
    let (m, _) = model(d.path(), 0);
    let daemon = serve(d.path(), StoreConfig::default(), limits());
    let mut a = Raw::connect(&daemon.socket);
    let model = open(&mut a, &m);
    let mut b = Raw::connect(&daemon.socket);
    let hint = Message::Prefetch {
        model,
        pages: vec![PageId(1)],
    };
    let (code, message) = error_of(b.request(&hint));
    assert_eq!(code, ErrorCode::BadRequest);
    assert!(message.contains("not open on this connection"), "{message}");
    // Sent without wanting a reply, the failure is still reported.
    let id = b.send(&hint, FLAG_NO_REPLY);
    let f = read_frame(&mut b.s).unwrap().unwrap();
    assert_eq!(f.request_id, id);
    assert_eq!(
        error_of(Message::decode(&f).unwrap()).0,
        ErrorCode::BadRequest
    );
    // Once opened there, the same id works.
    assert_eq!(open(&mut b, &m), model);
    assert_eq!(b.request(&hint), Message::Ack);
}

/// OpenModel's error code says what failed: a missing model is NotFound, a dead NAS
/// is Unavailable.
#[test]
fn open_model_errors_carry_their_codes() {
    let d = tempfile::tempdir().unwrap();
    let mount = d.path().join("nas");
    std::fs::create_dir_all(&mount).unwrap();
    let (m, _) = model(&mount, 0);
    let cfg = StoreConfig {
        nas: vec![NasConfig {
            mount: mount.clone(),
            model: PathBuf::new(),
            timeout: Duration::from_millis(500),
            recheck: Duration::ZERO,
            remount_command: None,
        }],
        ..Default::default()
    };
    let daemon = serve(d.path(), cfg, limits());
    let mut raw = Raw::connect(&daemon.socket);
    let missing = d.path().join("no-such-model");
    let (code, _) = error_of(raw.request(&Message::OpenModel {
        path: missing.to_string_lossy().into_owned(),
    }));
    assert_eq!(code, ErrorCode::NotFound);
    std::fs::rename(&mount, d.path().join("nas.away")).unwrap();
    let (code, message) = error_of(raw.request(&Message::OpenModel {
        path: m.to_string_lossy().into_owned(),
    }));
    assert_eq!(code, ErrorCode::Unavailable, "{message}");
    assert!(message.contains("NAS mount"), "{message}");
}

/// The digest in ModelOpened is that of the manifest the daemon serves by: an engine
/// with a new manifest gets the new model (and its bytes), one that opened the old
/// manifest keeps it.
#[test]
fn a_changed_manifest_gives_new_engines_the_new_model() {
    let d = tempfile::tempdir().unwrap();
    let (m, old_pages) = model(d.path(), 0);
    let daemon = serve(d.path(), StoreConfig::default(), limits());
    let c1 = DaemonClient::connect(&daemon.socket, "old").unwrap();
    let s1 = DaemonSource::open(Arc::clone(&c1), &m).unwrap();
    let held = s1.acquire(PageId(0)).unwrap();
    assert_eq!(held.bytes(), old_pages[0].as_slice());
    // The operator replaces the weights and re-hashes.
    let (_, new_pages) = model(d.path(), 1);
    let c2 = DaemonClient::connect(&daemon.socket, "new").unwrap();
    let s2 = DaemonSource::open(Arc::clone(&c2), &m).unwrap();
    assert_ne!(s1.model_id(), s2.model_id());
    assert_eq!(
        s2.acquire(PageId(0)).unwrap().bytes(),
        new_pages[0].as_slice()
    );
    // The old engine's resident page is still the old one.
    assert_eq!(
        s1.acquire(PageId(0)).unwrap().bytes(),
        old_pages[0].as_slice()
    );
    // A page of the old model that is not cached is not read from the new files (it
    // would fail verification): an error asking to reopen, no integrity failure.
    let e = s1.acquire(PageId(1)).err().unwrap().to_string();
    assert!(
        e.contains("NotFound") && e.contains("open the model store again"),
        "{e}"
    );
    let stats = c2.stats().unwrap();
    assert_eq!(stats["cache"]["load_failures"], 1, "{stats}");
    drop(held);
}

/// A connection that does not say Hello within the hello timeout is closed.
#[test]
fn a_silent_connection_is_closed_after_the_hello_timeout() {
    let d = tempfile::tempdir().unwrap();
    let daemon = serve(d.path(), StoreConfig::default(), limits());
    let mut s = UnixStream::connect(&daemon.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let t = Instant::now();
    assert!(matches!(read_frame(&mut s), Ok(None)));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // Nor can a peer stretch the wait by sending its Hello a byte at a time.
    let hello = Message::Hello {
        version: PROTOCOL_VERSION,
        pid: 1,
        name: "slow".into(),
    }
    .encode(1)
    .unwrap();
    let mut s = UnixStream::connect(&daemon.socket).unwrap();
    let t = Instant::now();
    let mut closed = false;
    for b in &hello {
        if s.write_all(std::slice::from_ref(b)).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(closed, "the whole Hello went through, slowly");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // The daemon still serves.
    DaemonClient::connect(&daemon.socket, "after").unwrap();
}

/// Beyond the session cap a connection is refused with a clear error; when a session
/// ends there is room again.
#[test]
fn sessions_beyond_the_cap_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let daemon = serve(
        d.path(),
        StoreConfig::default(),
        DaemonLimits {
            max_sessions: 2,
            ..limits()
        },
    );
    let c1 = DaemonClient::connect(&daemon.socket, "1").unwrap();
    let _c2 = DaemonClient::connect(&daemon.socket, "2").unwrap();
    let e = DaemonClient::connect(&daemon.socket, "3")
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("Unavailable") && e.contains("at most 2 sessions"),
        "{e}"
    );
    drop(c1);
    let t = Instant::now();
    loop {
        match DaemonClient::connect(&daemon.socket, "4") {
            Ok(c) => {
                assert_eq!(c.stats().unwrap()["sessions"]["connected"], 2);
                break;
            }
            Err(e) => assert!(t.elapsed() < Duration::from_secs(5), "{e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The `vpaged` binary, started by `sh` (for `ulimit`), its stderr discarded.
struct Binary {
    child: Child,
    socket: PathBuf,
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The CPU time (user and system) process `pid` has used so far, from /proc.
#[cfg(target_os = "linux")]
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name (which may hold spaces) follow its last ')':
    // state is the first of them, utime and stime the 12th and 13th.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no preconditions; _SC_CLK_TCK is always defined on Linux.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Duration::from_secs_f64(ticks as f64 / hz)
}

fn start_binary(dir: &Path, shell_prefix: &str) -> Binary {
    let socket = dir.join("bin.sock");
    let child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "{shell_prefix} exec \"$0\" --socket \"$1\" --cache-size 4MiB"
        ))
        .arg(env!("CARGO_BIN_EXE_vpaged"))
        .arg(&socket)
        .env("VPAGED_LOG", "warn")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while UnixStream::connect(&socket).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "vpaged did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Binary { child, socket }
}

fn exits_within(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// SIGTERM finishes even when a session is blocked writing replies to a peer that
/// does not read them: after the drain grace its connection is shut both ways.
#[test]
fn sigterm_drains_past_a_peer_that_does_not_read() {
    let d = tempfile::tempdir().unwrap();
    let mut daemon = start_binary(d.path(), "");
    let mut raw = Raw::connect(&daemon.socket);
    // Requests whose replies are never read, until the socket buffers are full.
    raw.s.set_nonblocking(true).unwrap();
    let stats = Message::Stats.encode(9).unwrap();
    let mut queued = 0;
    loop {
        match raw.s.write(&stats) {
            Ok(n) if n == stats.len() => queued += 1,
            _ => break,
        }
        assert!(queued < 1_000_000);
    }
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(daemon.child.id() as i32, libc::SIGTERM) };
    let status = exits_within(&mut daemon.child, Duration::from_secs(15))
        .expect("vpaged did not exit after SIGTERM");
    assert!(status.success(), "{status}");
    assert!(!daemon.socket.exists());
}

/// Idle connections that exhaust the daemon's descriptors do not take it down: the
/// failing connections are dropped, and once the idle ones go engines are served.
#[test]
fn running_out_of_descriptors_does_not_end_the_daemon() {
    let d = tempfile::tempdir().unwrap();
    let (m, pages) = model(d.path(), 0);
    let mut daemon = start_binary(d.path(), "ulimit -n 40 &&");
    let idle: Vec<UnixStream> = (0..30)
        .filter_map(|_| UnixStream::connect(&daemon.socket).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        daemon.child.try_wait().unwrap().is_none(),
        "vpaged exited with {} idle connections",
        idle.len()
    );
    // Out of descriptors, with connections waiting, every accept fails at once: the
    // daemon must back off, not spin (a spinning loop burns a whole core).
    #[cfg(target_os = "linux")]
    {
        let pid = daemon.child.id();
        let (cpu0, t0) = (cpu_time(pid), Instant::now());
        std::thread::sleep(Duration::from_millis(1500));
        let (used, wall) = (cpu_time(pid) - cpu0, t0.elapsed());
        assert!(
            used.as_secs_f64() < 0.3 * wall.as_secs_f64(),
            "vpaged used {used:?} of CPU in {wall:?} while out of descriptors"
        );
    }
    drop(idle);
    let t = Instant::now();
    let c = loop {
        match DaemonClient::connect(&daemon.socket, "after") {
            Ok(c) => break c,
            Err(e) => assert!(t.elapsed() < Duration::from_secs(10), "{e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let s = DaemonSource::open(Arc::clone(&c), &m).unwrap();
    assert_eq!(s.acquire(PageId(3)).unwrap().bytes(), pages[3].as_slice());
}

/// A NAS mount that is gone, whose remount command hangs for `secs` seconds: opening a
/// model on it waits on storage that long (a session's request stuck on storage).
fn hanging_nas(dir: &Path, secs: u32) -> (StoreConfig, PathBuf) {
    let mount = dir.join("nas");
    let cfg = StoreConfig {
        nas: vec![NasConfig {
            mount: mount.clone(),
            model: PathBuf::new(),
            // The remount command gets four times as long.
            timeout: Duration::from_secs(5),
            recheck: Duration::ZERO,
            remount_command: Some(format!("sleep {secs}")),
        }],
        ..Default::default()
    };
    (cfg, mount.join("m"))
}

/// The regression: `OpenModel` of a directory whose manifest is a FIFO blocked its
/// session for good (and so its slot under the cap, and shutdown). It is answered at
/// once with an error naming the FIFO; the session goes on. A FIFO in place of the
/// vpack file costs the page only its packed copy: the raw bytes serve it.
#[test]
fn a_fifo_manifest_blocked_its_session_forever() {
    let d = tempfile::tempdir().unwrap();
    let (m, _) = model(d.path(), 0);
    let manifest = m.join(voom_formats::manifest::MANIFEST_FILE);
    mkfifo(&manifest);
    let daemon = serve(
        d.path(),
        StoreConfig::default(),
        DaemonLimits {
            max_sessions: 1,
            ..limits()
        },
    );
    let mut raw = Raw::connect(&daemon.socket);
    let t = Instant::now();
    let (code, message) = error_of(raw.request(&Message::OpenModel {
        path: m.to_string_lossy().into_owned(),
    }));
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(code, ErrorCode::Internal);
    assert!(
        message.contains(&manifest.display().to_string()) && message.contains("is a FIFO"),
        "{message}"
    );
    assert!(matches!(
        raw.request(&Message::Stats),
        Message::StatsReply { .. }
    ));
    drop(raw);

    let p = tempfile::tempdir().unwrap();
    let (m, pages, manifest) = packed_model(p.path());
    mkfifo(&m.join(voom_formats::vpack::PACK_FILE));
    let t = Instant::now();
    let c = loop {
        // The first session's slot is free once it closed.
        match DaemonClient::connect(&daemon.socket, "vpack") {
            Ok(c) => break c,
            Err(e) => assert!(t.elapsed() < Duration::from_secs(5), "{e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let s = DaemonSource::open(Arc::clone(&c), &m).unwrap();
    let b = manifest.page("b").unwrap().id;
    let t = Instant::now();
    assert_eq!(
        s.acquire(PageId(b)).unwrap().bytes(),
        pages[b as usize].as_slice()
    );
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
}

/// The regression: a client that left while its request waited on storage kept its
/// session, and its slot under the session cap, until the request ended. Its session
/// ends at once, and the slot is free for the next engine.
#[test]
fn a_client_that_left_mid_request_kept_its_session_slot() {
    let d = tempfile::tempdir().unwrap();
    let (cfg, m) = hanging_nas(d.path(), 15);
    let daemon = serve(
        d.path(),
        cfg,
        DaemonLimits {
            max_sessions: 1,
            ..limits()
        },
    );
    let mut raw = Raw::connect(&daemon.socket);
    raw.send(
        &Message::OpenModel {
            path: m.to_string_lossy().into_owned(),
        },
        0,
    );
    std::thread::sleep(Duration::from_millis(300));
    drop(raw);
    let t = Instant::now();
    let c = loop {
        match DaemonClient::connect(&daemon.socket, "next") {
            Ok(c) => break c,
            Err(e) => assert!(t.elapsed() < Duration::from_secs(3), "{e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let s = c.stats().unwrap();
    assert_eq!(s["sessions"]["connected"], 1, "{s}");
}

/// A request that waits on storage longer than the request timeout is answered
/// `Unavailable` then; the session goes on, and refuses more storage work while the
/// abandoned request is still stuck.
#[test]
fn a_request_stuck_on_storage_is_answered_within_the_request_timeout() {
    let d = tempfile::tempdir().unwrap();
    let (cfg, m) = hanging_nas(d.path(), 15);
    let daemon = serve(
        d.path(),
        cfg,
        DaemonLimits {
            request_timeout: Duration::from_millis(500),
            ..limits()
        },
    );
    let mut raw = Raw::connect(&daemon.socket);
    let open = Message::OpenModel {
        path: m.to_string_lossy().into_owned(),
    };
    let t = Instant::now();
    let (code, message) = error_of(raw.request(&open));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert_eq!(code, ErrorCode::Unavailable);
    assert!(
        message.contains("OpenModel request did not finish within 500ms"),
        "{message}"
    );
    assert!(matches!(
        raw.request(&Message::Stats),
        Message::StatsReply { .. }
    ));
    let (code, message) = error_of(raw.request(&open));
    assert_eq!(code, ErrorCode::Unavailable);
    assert!(message.contains("still waiting on storage"), "{message}");
    // Other engines are served meanwhile.
    let (local, pages) = model(&d.path().join("local"), 0);
    let c = DaemonClient::connect(&daemon.socket, "other").unwrap();
    let s = DaemonSource::open(Arc::clone(&c), &local).unwrap();
    assert_eq!(s.acquire(PageId(2)).unwrap().bytes(), pages[2].as_slice());
}

/// The regression: on SIGTERM, a session whose request waited on storage was left
/// behind (and shutdown took two grace periods). Once its connection is shut both
/// ways the session abandons the request and ends; the daemon exits 0 and leaves no
/// session behind.
#[test]
fn shutdown_left_a_session_stuck_in_a_request_behind() {
    let d = tempfile::tempdir().unwrap();
    let (cfg, m) = hanging_nas(d.path(), 15);
    let nas = &cfg.nas[0];
    let config = d.path().join("vpaged.toml");
    std::fs::write(
        &config,
        format!(
            "[[nas]]\nmount = \"{}\"\ntimeout = \"5s\"\nremount_command = \"{}\"\n",
            nas.mount.display(),
            nas.remount_command.as_deref().unwrap()
        ),
    )
    .unwrap();
    let socket = d.path().join("bin.sock");
    let log = d.path().join("vpaged.log");
    let child = Command::new(env!("CARGO_BIN_EXE_vpaged"))
        .arg("--socket")
        .arg(&socket)
        .args(["--cache-size", "4MiB", "--config"])
        .arg(&config)
        .env("VPAGED_LOG", "info")
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .spawn()
        .unwrap();
    let mut daemon = Binary { child, socket };
    let t = Instant::now();
    while UnixStream::connect(&daemon.socket).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "vpaged did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut raw = Raw::connect(&daemon.socket);
    raw.send(
        &Message::OpenModel {
            path: m.to_string_lossy().into_owned(),
        },
        0,
    );
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(daemon.child.id() as i32, libc::SIGTERM) };
    let status = exits_within(&mut daemon.child, Duration::from_secs(10))
        .expect("vpaged did not exit after SIGTERM");
    assert!(status.success(), "{status}");
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(!log.contains("left behind"), "{log}");
    assert!(log.contains("hung up mid-request"), "{log}");
}

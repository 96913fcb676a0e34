//! Packed pages through the real daemon: a `vpaged` process, a packed model store
//! (`vpagectl pack`) whose bytes are damaged on disk, an engine on the socket; and
//! bodies the engine names for reading ahead.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use voom_formats::Manifest;
use vpaged::client::{DaemonClient, DaemonSource};
use vpaged::{PageId, PageSource};

mod common;
use common::packed_model;

/// The `vpaged` binary with its log (at `warn`) in a file.
struct Binary {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Binary {
    fn start(dir: &Path) -> Binary {
        let socket = dir.join("vpaged.sock");
        let log = dir.join("vpaged.log");
        let child = Command::new(env!("CARGO_BIN_EXE_vpaged"))
            .arg("--socket")
            .arg(&socket)
            .args(["--cache-size", "4MiB"])
            .env("VPAGED_LOG", "warn")
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .unwrap();
        let t = Instant::now();
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "vpaged did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Binary { child, socket, log }
    }

    /// Waits (up to 5 s) for the log to hold `what`; returns the log.
    fn log_showing(&self, what: &str) -> String {
        let t = Instant::now();
        loop {
            let log = std::fs::read_to_string(&self.log).unwrap();
            if log.contains(what) || t.elapsed() > Duration::from_secs(5) {
                return log;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Flips a byte of `file` at `at`.
fn flip(file: &Path, at: u64) {
    let mut bytes = std::fs::read(file).unwrap();
    bytes[at as usize] ^= 0x55;
    std::fs::write(file, bytes).unwrap();
}

/// Damages page `name`'s vpack body (in the middle) and, if `raw`, its raw bytes.
fn corrupt(dir: &Path, manifest: &Manifest, name: &str, raw: bool) {
    let p = manifest.page(name).unwrap();
    let body = p.vpack().unwrap();
    flip(&dir.join(&body.file), body.offset + body.len / 2);
    if raw {
        flip(&dir.join(&p.file), p.offset + 3);
    }
}

/// The regression: a page whose every copy (vpack body and raw bytes) fails its hash
/// was answered `Error{Unavailable}`; the code is `Integrity`, as docs/protocol.md
/// says, and the message names the page, the tier and the expected hash.
#[test]
fn every_copy_failing_its_hash_is_integrity_on_the_wire_not_unavailable() {
    let d = tempfile::tempdir().unwrap();
    let (m, _, manifest) = packed_model(d.path());
    corrupt(&m, &manifest, "b", true);
    let daemon = Binary::start(d.path());
    let c = DaemonClient::connect(&daemon.socket, "test").unwrap();
    let s = DaemonSource::open(Arc::clone(&c), &m).unwrap();
    let b = manifest.page("b").unwrap();
    let e = s.acquire(PageId(b.id)).err().unwrap().to_string();
    assert!(e.contains("Integrity: page 'b'"), "{e}");
    assert!(
        e.contains("tier 'primary' vpack body")
            && e.contains("tier 'primary' raw bytes: got blake3")
            && e.contains(&b.blake3),
        "{e}"
    );
    // The session goes on: another page serves.
    s.acquire(PageId(manifest.page("a").unwrap().id)).unwrap();
}

/// A corrupt vpack body with a good raw copy serves the raw bytes, and the daemon
/// logs a warning naming the page and the tier.
#[test]
fn falling_back_from_a_corrupt_vpack_body_logs_a_warning() {
    let d = tempfile::tempdir().unwrap();
    let (m, pages, manifest) = packed_model(d.path());
    corrupt(&m, &manifest, "c", false);
    let daemon = Binary::start(d.path());
    let c = DaemonClient::connect(&daemon.socket, "test").unwrap();
    let s = DaemonSource::open(Arc::clone(&c), &m).unwrap();
    let id = manifest.page("c").unwrap().id;
    assert_eq!(
        s.acquire(PageId(id)).unwrap().bytes(),
        pages[id as usize].as_slice()
    );
    let log = daemon.log_showing("falling back to the raw copy");
    let line = log
        .lines()
        .find(|l| l.contains("falling back to the raw copy"))
        .unwrap_or_else(|| panic!("no warning in the log:\n{log}"));
    assert!(
        line.contains("WARN") && line.contains("page 'c'") && line.contains("tier 'primary'"),
        "{line}"
    );
}

/// `ReadAhead` over the socket (protocol 1.5): the daemon reads the named pages'
/// vpack bodies into its pool ahead of their slots (its room holds five of the six,
/// and each body a load takes makes room for the next), and the pages' loads decode
/// those bodies; the engine gets the pages' bytes, and the daemon's stats count
/// every body as taken from the pool.
#[test]
fn bodies_named_over_the_socket_are_read_ahead_by_the_daemon() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("layered");
    let (manifest, bytes) = common::layered_packed_model(&dir, 3, 64);
    let daemon = Binary::start(d.path());
    let c = DaemonClient::connect(&daemon.socket, "test").unwrap();
    let s = DaemonSource::open(Arc::clone(&c), &dir).unwrap();
    let ids: Vec<PageId> = manifest.pages.iter().map(|p| PageId(p.id)).collect();
    s.read_ahead(&ids);
    for &id in &ids {
        assert_eq!(
            s.acquire(id).unwrap().bytes(),
            bytes[id.0 as usize].as_slice()
        );
    }
    let taken = s.cache_stats().unwrap().bodies_read_ahead;
    assert_eq!(taken, ids.len() as u64);
}

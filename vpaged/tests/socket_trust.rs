//! Who is at the other end of the daemon's socket (issue 41, 4): the daemon refuses
//! a socket directory that other users can write (they could move its socket away
//! and listen in its place), and an engine sends nothing to a socket served by
//! another user. Real processes, real sockets; the other user is `nobody`'s uid,
//! which needs root (skipped, saying so, otherwise).

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vpaged::client::DaemonClient;

/// A uid no test process runs as.
const OTHER_UID: u32 = 65534;

fn vpaged(socket: &Path, state: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vpaged"));
    c.arg("--socket")
        .arg(socket)
        .args(["--cache-size", "4MiB", "--state-dir"])
        .arg(state)
        .env("VPAGED_LOG", "warn");
    c
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn the_daemon_refuses_a_socket_directory_others_can_write() {
    let d = tempfile::tempdir().unwrap();
    let shared = d.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let socket = shared.join("vpaged.sock");
    let o = vpaged(&socket, &d.path().join("state")).output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "started in a world-writable directory: {e}"
    );
    assert!(
        e.contains("is writable by others") && e.contains(&*shared.to_string_lossy()),
        "{e}"
    );
    assert!(!socket.exists());

    // Group-writable is refused too; sticky and shared (as /tmp is) starts, with a
    // warning.
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o770)).unwrap();
    let o = vpaged(&socket, &d.path().join("state")).output().unwrap();
    assert!(!o.status.success());
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let mut child = vpaged(&socket, &d.path().join("state"))
        .stderr(Stdio::piped())
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
    let c = DaemonClient::connect(&socket, "test").unwrap();
    drop(c);
    child.kill().unwrap();
    let mut e = String::new();
    child.stderr.take().unwrap().read_to_string(&mut e).unwrap();
    child.wait().unwrap();
    assert!(e.contains("shared with other users"), "{e}");

    // A directory of another user's, whatever its mode.
    if is_root() {
        let theirs = d.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(OTHER_UID), None).unwrap();
        let o = vpaged(&theirs.join("v.sock"), &d.path().join("state"))
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && e.contains("belongs to another user"),
            "{e}"
        );
    } else {
        eprintln!("skipped: the other user's directory (needs root to chown)");
    }
}

#[test]
fn an_engine_sends_nothing_to_a_socket_served_by_another_user() {
    if !is_root() {
        eprintln!("skipped: needs root to listen as another user (uid {OTHER_UID})");
        return;
    }
    if Command::new("python3").arg("-V").output().is_err() {
        eprintln!("skipped: no python3 to listen as another user");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("sock");
    std::fs::create_dir(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(OTHER_UID), Some(OTHER_UID)).unwrap();
    let socket = dir.join("vpaged.sock");
    // Another user's listener where the daemon's socket would be: it counts what
    // it is sent.
    let script = r#"
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1]); s.listen(1)
print("ready", flush=True)
s.settimeout(20)
c, _ = s.accept()
c.settimeout(2)
got = b""
try:
    while True:
        b = c.recv(65536)
        if not b:
            break
        got += b
except socket.timeout:
    pass
print(len(got), flush=True)
"#;
    let mut other = {
        use std::os::unix::process::CommandExt;
        Command::new("python3")
            .args(["-c", script])
            .arg(&socket)
            .uid(OTHER_UID)
            .gid(OTHER_UID)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut out = other.stdout.take().unwrap();
    let mut seen = String::new();
    let mut b = [0u8; 1];
    while !seen.contains("ready\n") {
        assert_eq!(out.read(&mut b).unwrap(), 1, "the listener did not start");
        seen.push(b[0] as char);
    }
    let e = match DaemonClient::connect(&socket, "test") {
        Ok(_) => panic!("connected to another user's socket"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains(&format!("uid {OTHER_UID}")) && e.contains("refusing"),
        "{e}"
    );
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    other.wait().unwrap();
    assert_eq!(
        rest.trim(),
        "0",
        "the engine sent the other user's socket bytes"
    );
}

/// Regression (issue 41, 5): files `vpagectl` and `vpaged` are given are read
/// bounded, and only when they are regular files: a device or a FIFO is refused at
/// once, never read (`/dev/zero` grew a trace reader past 7 GB).
#[test]
fn devices_and_fifos_are_refused_not_read() {
    let d = tempfile::tempdir().unwrap();
    let fifo = d.path().join("fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    for path in [Path::new("/dev/zero"), fifo.as_path()] {
        let t = Instant::now();
        let o = Command::new(env!("CARGO_BIN_EXE_vpagectl"))
            .arg("expert-plan")
            .arg(path)
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{e}");
        assert!(
            e.contains(&*path.to_string_lossy()) && e.contains("not a regular file"),
            "{e}"
        );
        assert!(t.elapsed() < Duration::from_secs(30));
        let o = vpaged(&d.path().join("v.sock"), &d.path().join("state"))
            .arg("--config")
            .arg(path)
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && e.contains("not a regular file"),
            "{e}"
        );
    }
}

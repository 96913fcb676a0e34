//! `vpaged --socket PATH` deletes nothing but a stale socket: the real binary, started
//! on real files, directories, symbolic links and sockets at PATH.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Runs `vpaged --socket socket` and expects it to refuse to start: returns its stderr.
fn refused(socket: &Path) -> String {
    let o = run_expecting_exit(socket);
    assert!(
        !o.status.success(),
        "vpaged started on {}",
        socket.display()
    );
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn run_expecting_exit(socket: &Path) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_vpaged"))
        .arg("--socket")
        .arg(socket)
        .args(["--cache-size", "1MiB"])
        .env("VPAGED_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("vpaged kept running on {}", socket.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// The regression: a regular file at the socket path was deleted because nothing
/// accepted a connection there.
#[test]
fn vpaged_deletes_a_user_file_at_its_socket_path() {
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("notes.txt");
    std::fs::write(&file, b"precious").unwrap();
    let e = refused(&file);
    assert!(
        e.contains(&file.display().to_string()) && e.contains("is a regular file, not a socket"),
        "{e}"
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"precious");
}

#[test]
fn vpaged_refuses_a_directory_at_its_socket_path() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("sock.d");
    std::fs::create_dir(&dir).unwrap();
    let e = refused(&dir);
    assert!(e.contains("is a directory, not a socket"), "{e}");
    assert!(dir.is_dir());
}

/// A symbolic link is refused whatever it points to (a file, a stale socket, nothing),
/// and neither the link nor its target is removed.
#[test]
fn vpaged_refuses_a_symlink_at_its_socket_path_and_follows_none() {
    let d = tempfile::tempdir().unwrap();
    let target = d.path().join("target.txt");
    std::fs::write(&target, b"kept").unwrap();
    let stale = d.path().join("stale.sock");
    drop(UnixListener::bind(&stale).unwrap());
    assert!(UnixStream::connect(&stale).is_err(), "the socket is stale");
    for (name, to) in [
        ("to-file", target.clone()),
        ("to-stale-socket", stale.clone()),
        ("dangling", d.path().join("nothing")),
    ] {
        let link = d.path().join(name);
        std::os::unix::fs::symlink(&to, &link).unwrap();
        let e = refused(&link);
        assert!(
            e.contains("is a symbolic link, not a socket"),
            "{name}: {e}"
        );
        assert!(
            std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink(),
            "{name}: the link was removed"
        );
    }
    assert_eq!(std::fs::read(&target).unwrap(), b"kept");
    assert!(stale.exists(), "the stale socket behind a link was removed");
}

/// A live daemon's socket is refused and keeps serving; a stale socket (a socket file
/// nothing listens on) is replaced.
#[test]
fn vpaged_replaces_only_a_stale_socket() {
    let d = tempfile::tempdir().unwrap();
    let live = d.path().join("live.sock");
    let listener = UnixListener::bind(&live).unwrap();
    let e = refused(&live);
    assert!(e.contains("another vpaged is serving"), "{e}");
    assert!(
        UnixStream::connect(&live).is_ok(),
        "the live socket was removed"
    );
    drop(listener);

    // `live` is now a stale socket: the daemon replaces it and serves.
    let mut child = Command::new(env!("CARGO_BIN_EXE_vpaged"))
        .arg("--socket")
        .arg(&live)
        .args(["--cache-size", "1MiB"])
        .env("VPAGED_LOG", "warn")
        .spawn()
        .unwrap();
    let t = Instant::now();
    while vpaged::client::DaemonClient::connect(&live, "test").is_err() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "vpaged exited instead of replacing a stale socket"
        );
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "vpaged did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

//! The binaries' stdout closed early or unwritable: `vpagectl` and `vpaged` run as real
//! processes with stdout a pipe whose reader is gone (as after `| head -1`) or
//! `/dev/full`. A closed pipe ends quietly with status 0; any other write failure is an
//! error message and a non-zero status; neither panics.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A `vpaged` for `vpagectl status` to ask; killed when dropped.
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

fn daemon(dir: &Path) -> Daemon {
    let socket = dir.join("vpaged.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_vpaged"))
        .arg("--socket")
        .arg(&socket)
        .args(["--cache-size", "1MiB"])
        .env("VPAGED_LOG", "warn")
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
    Daemon { child, socket }
}

/// Where the command's stdout goes.
enum Stdout {
    /// A pipe whose read end is closed before the command starts: every write fails
    /// with EPIPE.
    ClosedPipe,
    /// `/dev/full`: every write fails with ENOSPC.
    Full,
}

fn run(bin: &str, args: &[&str], stdout: Stdout) -> Output {
    let out = match stdout {
        Stdout::ClosedPipe => {
            let (reader, writer) = std::io::pipe().unwrap();
            drop(reader);
            Stdio::from(writer)
        }
        Stdout::Full => Stdio::from(
            std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/full")
                .unwrap(),
        ),
    };
    Command::new(bin)
        .args(args)
        .stdout(out)
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A closed pipe: status 0, nothing on stderr (no panic message).
fn ends_quietly(o: &Output, what: &str) {
    assert!(o.status.success(), "{what}: {} {}", o.status, stderr(o));
    assert!(o.stderr.is_empty(), "{what}: {}", stderr(o));
}

/// `/dev/full`: a clear error and a non-zero status, no panic (status 101).
fn fails_clearly(o: &Output, program: &str, what: &str) {
    let e = stderr(o);
    assert!(
        !o.status.success() && o.status.code() != Some(101),
        "{what}: {} {e}",
        o.status
    );
    assert!(
        e.contains(&format!("{program}: error: writing to stdout:"))
            && e.contains("No space left on device")
            && !e.contains("panicked"),
        "{what}: {e}"
    );
}

/// The regression: `vpagectl status | head -1` panicked in `println!` (broken pipe).
#[test]
fn vpagectl_status_panicked_on_a_closed_pipe() {
    let d = tempfile::tempdir().unwrap();
    let daemon = daemon(d.path());
    let socket = daemon.socket.to_str().unwrap();
    let vpagectl = env!("CARGO_BIN_EXE_vpagectl");
    for args in [
        ["--socket", socket, "status"].as_slice(),
        ["--socket", socket, "status", "--json"].as_slice(),
    ] {
        ends_quietly(&run(vpagectl, args, Stdout::ClosedPipe), &args.join(" "));
        let o = run(vpagectl, args, Stdout::Full);
        fails_clearly(&o, "vpagectl", &args.join(" "));
        assert_eq!(o.status.code(), Some(2), "{}", args.join(" "));
    }
}

/// `--help` and `--version` of both binaries, written to a closed pipe or /dev/full.
#[test]
fn help_and_version_on_a_closed_or_full_stdout_never_panic() {
    for (bin, program) in [
        (env!("CARGO_BIN_EXE_vpagectl"), "vpagectl"),
        (env!("CARGO_BIN_EXE_vpaged"), "vpaged"),
    ] {
        for flag in ["--help", "--version"] {
            ends_quietly(
                &run(bin, &[flag], Stdout::ClosedPipe),
                &format!("{program} {flag}"),
            );
            fails_clearly(
                &run(bin, &[flag], Stdout::Full),
                program,
                &format!("{program} {flag}"),
            );
        }
    }
}

/// The regression: `vpagectl --help` listed pack's description under `status` (a doc
/// comment above the wrong variant), and `pack` had none.
#[test]
fn vpagectl_help_showed_packs_description_under_status() {
    let o = Command::new(env!("CARGO_BIN_EXE_vpagectl"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(o.status.success());
    let help = String::from_utf8(o.stdout).unwrap();
    let line = |cmd: &str| {
        help.lines()
            .find(|l| l.trim_start().starts_with(&format!("{cmd} ")))
            .unwrap_or_else(|| panic!("no '{cmd}' in:\n{help}"))
            .to_string()
    };
    let status = line("status");
    assert!(
        status.contains("The daemon's cache, tiers, models"),
        "{status}"
    );
    assert!(!status.contains("vpack"), "{status}");
    assert!(line("pack").contains("Write the vpack body"), "{help}");
}

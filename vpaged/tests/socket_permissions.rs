//! The daemon's socket is never reachable by other users, not even for a moment:
//! `bind_private` creates it with mode 0600 whatever the umask, and restores the umask.
//! (Alone in its test binary: the umask is process-wide.)

use std::os::unix::fs::PermissionsExt;

use vpaged::daemon::bind_private;

#[test]
fn the_socket_is_created_private_and_the_umask_is_restored() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("vpaged.sock");
    // SAFETY: umask only swaps this process's file-creation mask; no other thread of
    // this test binary creates files meanwhile.
    let saved = unsafe { libc::umask(0o000) };
    let listener = bind_private(&path);
    // SAFETY: as above; reads the mask back (and restores the one found first).
    let after = unsafe { libc::umask(saved) };
    let _listener = listener.unwrap();
    assert_eq!(after, 0o000, "bind_private must restore the umask");
    // No chmod happened: the mode is the one the socket was created with.
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{mode:o}");
}

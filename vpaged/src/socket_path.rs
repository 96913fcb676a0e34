//! Making room for the daemon's socket at the path it was given, deleting nothing that
//! is not a stale socket.
//!
//! `vpaged --socket PATH` must not destroy a user's file: only a socket file that
//! refuses connections (left behind by a daemon that crashed) is removed. A socket a
//! live daemon answers on, a regular file, a directory, a symbolic link (never
//! followed, whatever it points to) or anything else at the path is refused with an
//! error naming the path and what is there, and left as it is.
//!
//! Who else can reach the socket matters as much. A directory that others may write
//! (and that has no sticky bit) lets them move the daemon's socket away and listen in
//! its place: the daemon refuses such a directory, and such an ancestor, when it
//! starts ([`check_socket_dir`]), and warns where its directory is shared but sticky
//! (`/tmp`: others cannot move the socket, but may take its name while no daemon
//! runs). Engines check, before sending anything, that the process serving the socket
//! runs as their user or as root ([`check_peer`]).

use std::io::ErrorKind;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

/// Why the daemon cannot listen at a socket path.
#[derive(Debug, thiserror::Error)]
pub enum SocketPathError {
    #[error(
        "{path} (mode {mode:o}, owner uid {owner}) {why}: another user could put their \
         own socket in the daemon's place; choose a --socket in a directory only you \
         can write (such as $XDG_RUNTIME_DIR or ~/.voom)"
    )]
    SharedDirectory {
        path: PathBuf,
        mode: u32,
        owner: u32,
        why: &'static str,
    },
    #[error("another vpaged is serving {path}")]
    InUse { path: PathBuf },
    #[error(
        "{path} is {what}, not a socket: refusing to replace it (remove it yourself or \
         choose another --socket)"
    )]
    NotASocket { path: PathBuf, what: &'static str },
    #[error("cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What a file type is, in words, for the error that refuses it.
fn describe(t: std::fs::FileType) -> &'static str {
    if t.is_symlink() {
        "a symbolic link"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_file() {
        "a regular file"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else {
        "not a socket"
    }
}

/// Makes `path` free for the daemon to bind: nothing there, or a stale socket, which is
/// removed. Anything else is an error and is left untouched (see the module doc). The
/// path itself is examined with `lstat`, so a symbolic link is refused, never followed.
pub fn clear_stale_socket(path: &Path) -> Result<(), SocketPathError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(SocketPathError::Io {
                what: "inspect",
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let t = meta.file_type();
    if !t.is_socket() {
        return Err(SocketPathError::NotASocket {
            path: path.to_path_buf(),
            what: describe(t),
        });
    }
    // A live daemon answers; a stale socket file from a crash refuses the connection.
    // Anything else (no permission to connect, ...) is not known to be stale.
    match UnixStream::connect(path) {
        Ok(_) => Err(SocketPathError::InUse {
            path: path.to_path_buf(),
        }),
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
            std::fs::remove_file(path).map_err(|source| SocketPathError::Io {
                what: "remove the stale socket",
                path: path.to_path_buf(),
                source,
            })
        }
        Err(source) => Err(SocketPathError::Io {
            what: "check whether a daemon serves the socket",
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Checks the directories above a socket path (its parent and each ancestor, as
/// given, made absolute): each must be owned by this user or root, and not writable
/// by group or others unless it has the sticky bit (which keeps others from moving
/// what is not theirs). Returns a warning for a parent that is shared but sticky.
pub fn check_socket_dir(socket: &Path) -> Result<Option<String>, SocketPathError> {
    use std::os::unix::fs::MetadataExt;
    let socket = std::path::absolute(socket).map_err(|source| SocketPathError::Io {
        what: "resolve",
        path: socket.to_path_buf(),
        source,
    })?;
    // SAFETY: geteuid and getuid have no preconditions and cannot fail.
    let me = unsafe { (libc::geteuid(), libc::getuid()) };
    let mut warning = None;
    for (i, dir) in socket.ancestors().skip(1).enumerate() {
        let m = std::fs::metadata(dir).map_err(|source| SocketPathError::Io {
            what: "inspect",
            path: dir.to_path_buf(),
            source,
        })?;
        let (mode, owner) = (m.mode() & 0o7777, m.uid());
        let shared = |why| SocketPathError::SharedDirectory {
            path: dir.to_path_buf(),
            mode,
            owner,
            why,
        };
        if owner != 0 && owner != me.0 && owner != me.1 {
            return Err(shared("belongs to another user"));
        }
        let writable_by_others = mode & 0o022 != 0;
        let sticky = mode & 0o1000 != 0;
        if writable_by_others && !sticky {
            return Err(shared("is writable by others"));
        }
        if writable_by_others && i == 0 {
            warning = Some(format!(
                "the socket's directory {} (mode {mode:o}) is shared with other users: \
                 they cannot move the socket, but may take its name while no daemon runs \
                 (engines refuse a socket served by another user)",
                dir.display()
            ));
        }
    }
    Ok(warning)
}

/// Checks that the process serving a connected socket runs as this user (real or
/// effective uid) or as root, before anything is sent to it: another user's socket in
/// the daemon's place would read the engine's requests and could serve it anything.
pub fn check_peer(stream: &UnixStream) -> Result<(), String> {
    let peer = crate::protocol::fdpass::peer_uid(stream)
        .map_err(|e| format!("cannot tell which user serves it: {e}"))?;
    // SAFETY: geteuid and getuid have no preconditions and cannot fail.
    let me = unsafe { (libc::geteuid(), libc::getuid()) };
    if peer == 0 || peer == me.0 || peer == me.1 {
        return Ok(());
    }
    Err(format!(
        "it is served by a process of uid {peer}, not of this user (uid {}) or root: \
         refusing to send it anything (another user's socket may be in the daemon's place)",
        me.0
    ))
}

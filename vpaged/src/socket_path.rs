//! Making room for the daemon's socket at the path it was given, deleting nothing that
//! is not a stale socket.
//!
//! `vpaged --socket PATH` must not destroy a user's file: only a socket file that
//! refuses connections (left behind by a daemon that crashed) is removed. A socket a
//! live daemon answers on, a regular file, a directory, a symbolic link (never
//! followed, whatever it points to) or anything else at the path is refused with an
//! error naming the path and what is there, and left as it is.

use std::io::ErrorKind;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

/// Why the daemon cannot listen at a socket path.
#[derive(Debug, thiserror::Error)]
pub enum SocketPathError {
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

//! Opening a model store's files: regular files only, and never a blocking open.
//!
//! Every file vOOM reads from a model directory goes through here: the checkpoint's
//! `*.safetensors` files and shard index, `model.vpack`, the page manifest
//! (`voom-manifest.json`), `config.json`, the tokenizer's files,
//! `generation_config.json`, and the fast tier's staged pages. A FIFO in place of one
//! of them would block a plain `open` until a writer came (for ever), and a device is
//! no model file: a file is opened with `O_NONBLOCK`, which returns at once whatever
//! the path is, and the opened descriptor is checked (`fstat`) to be a regular file
//! before anything is read, so a path swapped between a check and the open cannot slip
//! through. Symbolic links are followed (a Hugging Face cache snapshot is links to
//! blobs); what they lead to must be a regular file. Small files are read with a
//! bound on their size ([`read_limited`]).

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The largest JSON side file of a model directory read (`config.json`,
/// `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`, templates):
/// published tokenizers reach tens of MB.
pub const SIDE_FILE_MAX_BYTES: u64 = 256 << 20;

/// Opens `path` for reading if it is a regular file; any other kind of file is an
/// `InvalidInput` error saying what it is, and opening never blocks.
pub fn open(path: &Path) -> std::io::Result<File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(meta.file_type()));
    }
    // Reads of a regular file ignore O_NONBLOCK; the flag is cleared anyway, so the
    // descriptor reads as any other.
    let fd = f.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function owns (`f` is open); F_GETFL takes no
    // argument and only reads the descriptor's status flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above; F_SETFL sets the status flags from an int argument.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(f)
}

/// Reads the whole of `path`, a regular file ([`open`]).
pub fn read(path: &Path) -> std::io::Result<Vec<u8>> {
    read_limited(path, u64::MAX)
}

/// Reads `path`, a regular file ([`open`]) of at most `limit` bytes: a larger one is
/// an `InvalidData` error giving its size and the limit, and no more than `limit + 1`
/// bytes are read whatever the file claims (it may grow while it is read).
pub fn read_limited(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let f = open(path)?;
    let len = f.metadata()?.len();
    let too_big = |len: u64| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("is {len} bytes; more than {limit} bytes is refused"),
        )
    };
    if len > limit {
        return Err(too_big(len));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    f.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// What a file type is, in words, for the error refusing a file that is not regular.
fn describe(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

/// The error refusing a model-store file of type `t` that is not a regular file (kind
/// `InvalidInput`, naming what it is). Readers of store files, here and in the page
/// store, refuse with this one error.
pub fn not_regular(t: std::fs::FileType) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!(
            "is {}, not a regular file: refusing to open it",
            describe(t)
        ),
    )
}

/// Whether a model-store file is there: `false` when nothing is at `path`, `true` for
/// a regular file (symbolic links followed, as in a Hugging Face cache snapshot), an
/// error naming it for anything else. Checked with `stat`, before the file is ever
/// opened: opening a FIFO blocks until a writer comes, and a device is no model file.
pub fn is_present(path: &Path) -> crate::error::Result<bool> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(true),
        Ok(m) => Err(crate::FormatError::io(path, not_regular(m.file_type()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(crate::FormatError::io(path, e)),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    /// A FIFO (no writer), a directory and a device are refused at once, naming what
    /// they are; a regular file and a link to one are read.
    #[test]
    fn only_regular_files_are_opened_and_a_fifo_never_blocks() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("voom-manifest.json");
        let st = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(st.success());
        let t = Instant::now();
        let e = open(&fifo).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        assert!(
            e.to_string().contains("is a FIFO, not a regular file"),
            "{e}"
        );
        let e = open(d.path()).unwrap_err();
        assert!(e.to_string().contains("is a directory"), "{e}");
        let e = open(Path::new("/dev/null")).unwrap_err();
        assert!(e.to_string().contains("is a device"), "{e}");

        let file = d.path().join("model.safetensors");
        std::fs::write(&file, b"bytes").unwrap();
        let link = d.path().join("link.safetensors");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(read(&link).unwrap(), b"bytes");
        let f = open(&file).unwrap();
        // SAFETY: fcntl F_GETFL on the descriptor `f` owns; reads its flags only.
        let flags = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
        assert_eq!(flags & libc::O_NONBLOCK, 0, "O_NONBLOCK is left set");
    }
}

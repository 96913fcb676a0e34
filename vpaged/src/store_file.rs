//! Opening a model store's files: regular files only, and never a blocking open.
//!
//! Every file the store reads bytes from goes through [`open`]: the checkpoint's
//! `*.safetensors` files and `model.vpack` (read by extent through the file tier, local
//! or on a NAS), the page manifest (`voom-manifest.json`), and the fast tier's staged
//! pages. A FIFO in place of one of them would block a plain `open` until a writer came
//! (for ever, for a session asking for it), and a device is no model file: the file is
//! opened with `O_NONBLOCK`, which returns at once whatever the path is, and the opened
//! descriptor is checked (`fstat`) to be a regular file before anything is read, so a
//! path swapped between a check and the open cannot slip through. Symbolic links are
//! followed (a Hugging Face cache snapshot is links to blobs); what they lead to must be
//! a regular file. The formats crate checks the files it opens itself the same way
//! ([`voom_formats::checkpoint::is_present`]), with the same error.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Opens `path` for reading if it is a regular file; any other kind of file is an
/// `InvalidInput` error saying what it is, and opening never blocks.
pub fn open(path: &Path) -> std::io::Result<File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(voom_formats::checkpoint::not_regular(meta.file_type()));
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
    let mut f = open(path)?;
    let len = f.metadata()?.len();
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    f.read_to_end(&mut bytes)?;
    Ok(bytes)
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

//! Passing a file descriptor over a Unix stream socket (`SCM_RIGHTS`), and reading
//! the peer's uid.
//!
//! The functions take any `AsFd` socket: `std::os::unix::net::UnixStream` (blocking)
//! or tokio's `UnixStream` (non-blocking: wrap the call in
//! `stream.try_io(Interest::WRITABLE | READABLE, || ...)` after awaiting readiness;
//! `WouldBlock` is returned as an `io::Error` of that kind and nothing was sent or
//! received). The daemon may equally run a connection's handshake on a blocking std
//! socket in a blocking thread.
//!
//! Semantics a caller relies on: the descriptor travels with the first byte of the
//! data sent with it, and a receiver gets it from the `recvmsg` that returns that byte.
//! Received descriptors are close-on-exec. A receiver accepts at most one descriptor
//! per call: more, or truncated control data, closes every received descriptor and is
//! an error.

use std::io;
use std::mem;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use super::frame::{Frame, FrameDecoder};
use super::ProtocolError;

/// Descriptors the receive buffer has room for. Only one is accepted, but room for a
/// few lets us see (and close) extra ones instead of having the kernel truncate them.
const RECV_MAX_FDS: usize = 4;
const FD_SIZE: usize = mem::size_of::<libc::c_int>();
// SAFETY: CMSG_SPACE is pure arithmetic on its argument.
const SEND_CMSG_SPACE: usize = unsafe { libc::CMSG_SPACE(FD_SIZE as libc::c_uint) } as usize;
// SAFETY: as above.
const RECV_CMSG_SPACE: usize =
    unsafe { libc::CMSG_SPACE((FD_SIZE * RECV_MAX_FDS) as libc::c_uint) } as usize;

/// Control-message buffer aligned for `cmsghdr` (its fields are `size_t`/`int`).
#[repr(C, align(8))]
struct CmsgBuf<const N: usize>([u8; N]);

#[cfg(any(target_os = "linux", target_os = "android"))]
const SEND_FLAGS: libc::c_int = libc::MSG_NOSIGNAL;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const SEND_FLAGS: libc::c_int = 0;

#[cfg(any(target_os = "linux", target_os = "android"))]
const RECV_FLAGS: libc::c_int = libc::MSG_CMSG_CLOEXEC;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const RECV_FLAGS: libc::c_int = 0;

/// Sends `bytes` (nonempty) with `fd` attached, in one `sendmsg`. Returns how many
/// bytes were sent (possibly fewer than `bytes.len()`; the fd went with the first).
/// Retries on `EINTR`.
pub fn send_with_fd(sock: &impl AsFd, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<usize> {
    if bytes.is_empty() {
        // A descriptor needs at least one data byte to ride on a stream socket.
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "send_with_fd needs at least one byte of data",
        ));
    }
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let mut cmsg_buf = CmsgBuf([0u8; SEND_CMSG_SPACE]);
    // SAFETY: msghdr is plain old data; all-zero is a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg_buf.0.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = SEND_CMSG_SPACE as _;
    // SAFETY: msg_control points at SEND_CMSG_SPACE writable, cmsghdr-aligned bytes,
    // which is room for one header and one int; CMSG_FIRSTHDR is therefore non-null and
    // CMSG_DATA points inside the buffer with FD_SIZE bytes of room.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(FD_SIZE as libc::c_uint) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut libc::c_int, fd.as_raw_fd());
    }
    loop {
        // SAFETY: msg points at a live iovec over `bytes` (read only by the kernel) and
        // a control buffer initialised above; both outlive the call.
        let n = unsafe { libc::sendmsg(sock.as_fd().as_raw_fd(), &msg, SEND_FLAGS) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Sends all of `bytes` with `fd` attached to the first of them, for a blocking socket:
/// the rest of a partial `sendmsg` goes out with plain sends.
pub fn send_all_with_fd(sock: &impl AsFd, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    let mut sent = send_with_fd(sock, bytes, fd)?;
    while sent < bytes.len() {
        let rest = &bytes[sent..];
        // SAFETY: `rest` is a live slice of rest.len() readable bytes.
        let n = unsafe {
            libc::send(
                sock.as_fd().as_raw_fd(),
                rest.as_ptr() as *const libc::c_void,
                rest.len(),
                SEND_FLAGS,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        sent += n as usize;
    }
    Ok(())
}

/// Receives into `buf` with one `recvmsg`, accepting at most one descriptor. Returns
/// the bytes read (0 at end of stream) and the descriptor if one came with them.
/// Retries on `EINTR`. Errors (after closing whatever was received): control data
/// truncated (`MSG_CTRUNC`), more than one descriptor.
pub fn recv_with_fd(sock: &impl AsFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let mut cmsg_buf = CmsgBuf([0u8; RECV_CMSG_SPACE]);
    // SAFETY: msghdr is plain old data; all-zero is a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg_buf.0.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = RECV_CMSG_SPACE as _;
    let n = loop {
        // SAFETY: the iovec covers `buf` (writable, live) and the control buffer is
        // RECV_CMSG_SPACE writable aligned bytes; the kernel writes within both.
        let n = unsafe { libc::recvmsg(sock.as_fd().as_raw_fd(), &mut msg, RECV_FLAGS) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // Take ownership of every received descriptor first, so each is closed on every
    // path below (OwnedFd's drop).
    let mut fds: Vec<OwnedFd> = Vec::new();
    // SAFETY: msg was filled by a successful recvmsg: msg_control/msg_controllen describe
    // the valid control data, which the CMSG_* macros walk within those bounds.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            let hdr = std::ptr::read_unaligned(cmsg);
            if hdr.cmsg_level == libc::SOL_SOCKET && hdr.cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let header_len = data as usize - cmsg as usize;
                let data_len = (hdr.cmsg_len as usize).saturating_sub(header_len);
                for i in 0..data_len / FD_SIZE {
                    let raw: RawFd = std::ptr::read_unaligned((data as *const libc::c_int).add(i));
                    // The kernel installed this descriptor in our table for us; we are
                    // its only owner.
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "control data truncated (MSG_CTRUNC): a descriptor may have been lost",
        ));
    }
    if fds.len() > 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("received {} descriptors, at most 1 expected", fds.len()),
        ));
    }
    let fd = fds.pop();
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    if let Some(fd) = &fd {
        set_cloexec(fd.as_fd())?;
    }
    Ok((n, fd))
}

/// Where `MSG_CMSG_CLOEXEC` does not exist: mark the received descriptor close-on-exec
/// (a window remains in which a concurrent fork+exec could inherit it).
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn set_cloexec(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: fcntl on a valid, owned descriptor with integer arguments.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sends one frame with `fd` attached (the server's `Welcome` with the arena), on a
/// blocking socket.
pub fn send_frame_with_fd(
    sock: &impl AsFd,
    frame: &Frame,
    fd: BorrowedFd<'_>,
) -> Result<(), ProtocolError> {
    let bytes = frame.encode()?;
    send_all_with_fd(sock, &bytes, fd)?;
    Ok(())
}

/// Reads from a blocking socket with `recvmsg` until `decoder` yields a frame; returns
/// it with the descriptor received meanwhile, if any. `Ok(None)` at a clean end of
/// stream. Bytes past the frame stay in `decoder`. A second descriptor before the frame
/// is complete is an error (both are closed).
pub fn recv_frame_with_fd(
    sock: &impl AsFd,
    decoder: &mut FrameDecoder,
) -> Result<Option<(Frame, Option<OwnedFd>)>, ProtocolError> {
    let mut fd: Option<OwnedFd> = None;
    let mut buf = [0u8; 4096];
    loop {
        if let Some(frame) = decoder.next_frame()? {
            return Ok(Some((frame, fd)));
        }
        let (n, got) = recv_with_fd(sock, &mut buf)?;
        if let Some(got) = got {
            if fd.is_some() {
                return Err(ProtocolError::Io(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a second descriptor arrived before the frame was complete",
                )));
            }
            fd = Some(got);
        }
        if n == 0 {
            if decoder.buffered() == 0 {
                return Ok(None);
            }
            return Err(ProtocolError::Truncated {
                expected: decoder.frame_in_progress_len(),
                got: decoder.buffered(),
            });
        }
        decoder.push(&buf[..n]);
    }
}

/// The effective uid of the process at the other end of a Unix socket (at connect
/// time). The daemon admits peers by uid.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub fn peer_uid(sock: &impl AsFd) -> io::Result<u32> {
    // SAFETY: ucred is plain old data; all-zero is valid.
    let mut cred: libc::ucred = unsafe { mem::zeroed() };
    let mut len = mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which is that large.
    let r = unsafe {
        libc::getsockopt(
            sock.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != mem::size_of::<libc::ucred>() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("SO_PEERCRED returned {len} bytes"),
        ));
    }
    Ok(cred.uid)
}

/// The effective uid of the process at the other end of a Unix socket (at connect
/// time). The daemon admits peers by uid.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub fn peer_uid(sock: &impl AsFd) -> io::Result<u32> {
    let mut uid: libc::uid_t = 0;
    let mut gid: libc::gid_t = 0;
    // SAFETY: getpeereid writes one uid_t and one gid_t through valid pointers.
    let r = unsafe { libc::getpeereid(sock.as_fd().as_raw_fd(), &mut uid, &mut gid) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(uid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[cfg(target_os = "linux")]
    fn fd_target(fd: &OwnedFd) -> std::path::PathBuf {
        std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap()
    }

    #[test]
    fn plain_bytes_without_fd() {
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(b"xyz").unwrap();
        let mut buf = [0u8; 8];
        let (n, fd) = recv_with_fd(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"xyz");
        assert!(fd.is_none());
        drop(a);
        assert_eq!(recv_with_fd(&b, &mut buf).unwrap().0, 0);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn passes_a_file_and_marks_it_cloexec() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"content").unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        send_all_with_fd(&a, b"hello", file.as_fd()).unwrap();
        let mut buf = [0u8; 16];
        let (n, fd) = recv_with_fd(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"hello");
        let fd = fd.expect("a descriptor");
        assert_ne!(fd.as_raw_fd(), file.as_raw_fd());
        assert_eq!(fd_target(&fd), path);
        // SAFETY: F_GETFD on a valid descriptor.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
        assert!(flags & libc::FD_CLOEXEC != 0);
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::fs::File::from(fd), &mut s).unwrap();
        assert_eq!(s, "content");
    }

    #[test]
    fn two_descriptors_are_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let f1 = tempfile::tempfile().unwrap();
        let f2 = tempfile::tempfile().unwrap();
        // Hand-build a message with two fds in one SCM_RIGHTS.
        let bytes = [1u8];
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut libc::c_void,
            iov_len: 1,
        };
        // SAFETY: pure arithmetic.
        const SPACE: usize = unsafe { libc::CMSG_SPACE(2 * FD_SIZE as libc::c_uint) } as usize;
        let mut cbuf = CmsgBuf([0u8; SPACE]);
        // SAFETY: msghdr is plain old data.
        let mut msg: libc::msghdr = unsafe { mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.0.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = SPACE as _;
        // SAFETY: the control buffer has room for one header and two ints.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(2 * FD_SIZE as libc::c_uint) as _;
            let d = libc::CMSG_DATA(c) as *mut libc::c_int;
            std::ptr::write_unaligned(d, f1.as_raw_fd());
            std::ptr::write_unaligned(d.add(1), f2.as_raw_fd());
            assert_eq!(libc::sendmsg(a.as_raw_fd(), &msg, 0), 1);
        }
        let mut buf = [0u8; 4];
        let e = recv_with_fd(&b, &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("2 descriptors"), "{e}");
    }

    #[test]
    fn control_truncation_is_an_error() {
        // More descriptors than the receive buffer holds: the kernel sets MSG_CTRUNC.
        let (a, b) = UnixStream::pair().unwrap();
        let files: Vec<_> = (0..RECV_MAX_FDS + 2)
            .map(|_| tempfile::tempfile().unwrap())
            .collect();
        let n = files.len();
        let bytes = [1u8];
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut libc::c_void,
            iov_len: 1,
        };
        const SPACE: usize =
            // SAFETY: pure arithmetic.
            unsafe { libc::CMSG_SPACE(((RECV_MAX_FDS + 2) * FD_SIZE) as libc::c_uint) }
                    as usize;
        let mut cbuf = CmsgBuf([0u8; SPACE]);
        // SAFETY: msghdr is plain old data.
        let mut msg: libc::msghdr = unsafe { mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.0.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = SPACE as _;
        // SAFETY: the control buffer has room for one header and n ints.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN((n * FD_SIZE) as libc::c_uint) as _;
            let d = libc::CMSG_DATA(c) as *mut libc::c_int;
            for (i, f) in files.iter().enumerate() {
                std::ptr::write_unaligned(d.add(i), f.as_raw_fd());
            }
            assert_eq!(libc::sendmsg(a.as_raw_fd(), &msg, 0), 1);
        }
        let mut buf = [0u8; 4];
        let e = recv_with_fd(&b, &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("MSG_CTRUNC"), "{e}");
    }

    #[test]
    fn empty_send_is_refused() {
        let (a, _b) = UnixStream::pair().unwrap();
        let f = tempfile::tempfile().unwrap();
        let e = send_with_fd(&a, &[], f.as_fd()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn peer_uid_is_ours() {
        let (a, _b) = UnixStream::pair().unwrap();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        assert_eq!(peer_uid(&a).unwrap(), me);
    }
}

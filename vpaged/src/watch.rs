//! Running a session's storage work off the session's thread, watching its client.
//!
//! A request that may wait on storage (opening a model store, loading pages, staging)
//! runs on a thread of its own while the session's thread waits for it and watches the
//! client's socket. If the client hangs up (it closed its end, or the daemon shut the
//! socket both ways at shutdown), the session stops waiting and ends at once: its slot
//! under the session cap is freed and its leases are released. The work is abandoned:
//! it finishes (or stays stuck) on its own thread, and its result is dropped there
//! (leases it took are released then). Work that outlives its deadline is abandoned
//! the same way and the request is answered with an error; while abandoned work of a
//! session is still running, further storage work of that session is refused, so a
//! session leaves at most one stuck thread behind.

use std::os::fd::{AsFd, AsRawFd};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How often a session waiting on its work checks whether the client hung up.
const HANGUP_POLL: Duration = Duration::from_millis(25);

/// How a watched piece of work ended for the session.
#[derive(Debug)]
pub enum Outcome<T> {
    /// The work finished; its result.
    Done(T),
    /// The client hung up while the work ran: the session ends.
    PeerGone,
    /// The work did not finish within its deadline; it is abandoned.
    TimedOut(Duration),
    /// Work of this session abandoned earlier (`what`, running for `running`) has not
    /// finished yet; nothing new was started.
    StillBusy {
        what: &'static str,
        running: Duration,
    },
    /// No thread could be started for the work.
    NoThread(std::io::Error),
}

/// Abandoned work still running.
struct Abandoned<T> {
    done: mpsc::Receiver<T>,
    what: &'static str,
    since: Instant,
}

impl<T> Abandoned<T> {
    /// Whether the work has ended (its result, if any, is dropped here).
    fn ended(&self) -> bool {
        !matches!(self.done.try_recv(), Err(mpsc::TryRecvError::Empty))
    }
}

/// Runs one session's storage work, one piece at a time (see the module doc).
pub struct Watch<T> {
    abandoned: Option<Abandoned<T>>,
}

impl<T> Default for Watch<T> {
    fn default() -> Self {
        Watch { abandoned: None }
    }
}

impl<T: Send + 'static> Watch<T> {
    /// Runs `work` (named `what` in errors) on a thread of its own and waits for it,
    /// for at most `deadline` (`None`: as long as it takes), while `client` has not
    /// hung up.
    pub fn run(
        &mut self,
        client: &impl AsFd,
        what: &'static str,
        deadline: Option<Duration>,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Outcome<T> {
        if let Some(a) = &self.abandoned {
            if !a.ended() {
                return Outcome::StillBusy {
                    what: a.what,
                    running: a.since.elapsed(),
                };
            }
            self.abandoned = None;
        }
        let (tx, done) = mpsc::sync_channel(1);
        let spawned = std::thread::Builder::new()
            .name("vpaged-request".into())
            .spawn(move || {
                // A session that stopped waiting has dropped the receiver: the result
                // is dropped here.
                let _ = tx.send(work());
            });
        if let Err(e) = spawned {
            return Outcome::NoThread(e);
        }
        let since = Instant::now();
        loop {
            let slice = match deadline {
                Some(d) => match d.checked_sub(since.elapsed()) {
                    Some(left) if !left.is_zero() => left.min(HANGUP_POLL),
                    _ => {
                        self.abandoned = Some(Abandoned { done, what, since });
                        return Outcome::TimedOut(d);
                    }
                },
                None => HANGUP_POLL,
            };
            match done.recv_timeout(slice) {
                Ok(result) => return Outcome::Done(result),
                // The work panicked (its sender dropped without a result).
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Outcome::NoThread(std::io::Error::other(format!(
                        "the thread running {what} panicked"
                    )))
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            if hung_up(client) {
                return Outcome::PeerGone;
            }
        }
    }
}

/// Whether the peer of the connected socket `s` has hung up, without reading from it:
/// `poll` with no events asked for reports only `POLLHUP` (the connection is shut both
/// ways: the peer closed it, or this side shut it at shutdown) and `POLLERR`. A peer
/// that only shut its writing half still reads replies, and a socket this side shut
/// only for reading (the first step of a drain) has not hung up.
pub fn hung_up(s: &impl AsFd) -> bool {
    let mut p = libc::pollfd {
        fd: s.as_fd().as_raw_fd(),
        events: 0,
        revents: 0,
    };
    // SAFETY: `p` is one valid pollfd for a descriptor `s` keeps open during the call;
    // a zero timeout never blocks.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn a_hangup_is_seen_without_reading_and_a_half_close_is_not_one() {
        let (a, b) = UnixStream::pair().unwrap();
        assert!(!hung_up(&a));
        b.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(!hung_up(&a), "a peer that only stopped writing still reads");
        a.shutdown(std::net::Shutdown::Read).unwrap();
        assert!(!hung_up(&a), "shut for reading here is no hangup");
        drop(b);
        assert!(hung_up(&a));
        let (c, _d) = UnixStream::pair().unwrap();
        c.shutdown(std::net::Shutdown::Both).unwrap();
        assert!(hung_up(&c));
    }

    /// Work that outlives the client or its deadline is abandoned; the next piece of
    /// work waits until abandoned work has ended.
    #[test]
    fn stuck_work_is_abandoned_on_hangup_and_deadline() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut w: Watch<u32> = Watch::default();
        assert!(matches!(w.run(&a, "quick", None, || 7), Outcome::Done(7)));

        let (release, wait) = mpsc::channel::<()>();
        let t = Instant::now();
        let o = w.run(&a, "stuck", Some(Duration::from_millis(100)), move || {
            let _ = wait.recv();
            1
        });
        assert!(matches!(o, Outcome::TimedOut(_)), "{o:?}");
        assert!(t.elapsed() < Duration::from_secs(2));
        match w.run(&a, "next", None, || 2) {
            Outcome::StillBusy { what, .. } => assert_eq!(what, "stuck"),
            other => panic!("{other:?}"),
        }
        release.send(()).unwrap();
        let t = Instant::now();
        loop {
            match w.run(&a, "next", None, || 2) {
                Outcome::Done(2) => break,
                Outcome::StillBusy { .. } => {
                    assert!(t.elapsed() < Duration::from_secs(5));
                    std::thread::sleep(Duration::from_millis(5));
                }
                other => panic!("{other:?}"),
            }
        }

        let (_release, wait) = mpsc::channel::<()>();
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(b);
        });
        let o = w.run(&a, "stuck", None, move || {
            let _ = wait.recv();
            3
        });
        assert!(matches!(o, Outcome::PeerGone), "{o:?}");
        closer.join().unwrap();
    }
}

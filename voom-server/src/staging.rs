//! Directories a command builds before renaming them into place: an import's new
//! model (`models/.NAME.importing-PID`), the model it replaces while the new one
//! moves in (`models/.NAME.old-PID`), a pull's downloads (`.pull-PID-*` in
//! `$VOOM_HOME`). Each is named with the id of the process that owns it, so that
//! nothing is left behind:
//!
//! - interrupted (SIGINT, SIGTERM, SIGHUP), the process removes what it registered
//!   with [`remove_on_interrupt`] and exits with 128 + the signal's number;
//! - killed outright (SIGKILL, a crash, a power cut), it cannot: the next import,
//!   pull or `voom list` reclaims ([`reclaim`]) every staging directory whose
//!   process is gone. An `.old` directory whose model was not replaced (the process
//!   died between the two renames) is put back where it was: nothing is lost.
//!
//! The signal handler only writes the signal's number to a pipe (async-signal
//! safe); a watcher thread does the removing, under the same lock that
//! [`uninterrupted`] holds while a staged directory is renamed into place, so a
//! directory is never removed half-way through becoming the model.

use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;

/// The signals after which staged directories are removed.
const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// The write end of the watcher's pipe while handlers are installed, else -1.
static WAKE: AtomicI32 = AtomicI32::new(-1);

struct Installed {
    previous: Vec<(libc::c_int, libc::sigaction)>,
    write_fd: RawFd,
    watcher: std::thread::JoinHandle<()>,
}

struct State {
    paths: Vec<PathBuf>,
    installed: Option<Installed>,
}

static STATE: Mutex<State> = Mutex::new(State {
    paths: Vec::new(),
    installed: None,
});

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A directory removed if the process is interrupted, until this is dropped.
#[must_use = "the directory is removed on interrupt only while this lives"]
pub struct Registration {
    path: PathBuf,
}

/// Removes `path` (a directory this process is building) if the process is
/// interrupted before the registration is dropped.
pub fn remove_on_interrupt(path: &Path) -> Registration {
    let mut s = state();
    s.paths.push(path.to_path_buf());
    if s.installed.is_none() {
        match install() {
            Ok(i) => s.installed = Some(i),
            // Without handlers the directory is still reclaimed later (its pid).
            Err(e) => tracing::warn!("no cleanup on interrupt for {}: {e}", path.display()),
        }
    }
    Registration {
        path: path.to_path_buf(),
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let installed = {
            let mut s = state();
            if let Some(i) = s.paths.iter().position(|p| p == &self.path) {
                s.paths.remove(i);
            }
            if s.paths.is_empty() {
                s.installed.take()
            } else {
                None
            }
        };
        if let Some(i) = installed {
            uninstall(i);
        }
    }
}

/// Runs `f` (renames that move a staged directory into place) with interrupts held
/// off: a signal that comes meanwhile is acted on after `f`, on what is staged then.
pub fn uninterrupted<T>(f: impl FnOnce() -> T) -> T {
    let _held = state();
    f()
}

extern "C" fn on_signal(sig: libc::c_int) {
    let fd = WAKE.load(Ordering::SeqCst);
    if fd >= 0 {
        let b = sig as u8;
        // SAFETY: write(2) is async-signal-safe; `b` is a live byte on this stack and
        // `fd` the pipe's write end, open while the handler is installed (closed only
        // after the handler is removed).
        unsafe { libc::write(fd, (&b as *const u8).cast(), 1) };
    }
}

fn install() -> std::io::Result<Installed> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two descriptors into the two-element array it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let (read_fd, write_fd) = (fds[0], fds[1]);
    WAKE.store(write_fd, Ordering::SeqCst);
    let watcher = std::thread::Builder::new()
        .name("voom-staging-cleanup".into())
        .spawn(move || watch(read_fd))?;
    let mut previous = Vec::new();
    for sig in SIGNALS {
        // SAFETY: a zeroed sigaction is a valid value to fill; sa_sigaction is set to
        // a handler of the right type (no SA_SIGINFO), the mask emptied by
        // sigemptyset, and sigaction reads `act` and writes `old`, both live here.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            act.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut act.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, &act, &mut old) == 0 {
                previous.push((sig, old));
            }
        }
    }
    Ok(Installed {
        previous,
        write_fd,
        watcher,
    })
}

fn uninstall(i: Installed) {
    for (sig, old) in &i.previous {
        // SAFETY: restores the disposition saved by `install` (a value sigaction
        // itself wrote); a null `oldact` is allowed.
        unsafe { libc::sigaction(*sig, old, std::ptr::null_mut()) };
    }
    WAKE.store(-1, Ordering::SeqCst);
    let quit = 0u8;
    // SAFETY: writes one byte from a live local to the pipe's write end, still open.
    unsafe { libc::write(i.write_fd, (&quit as *const u8).cast(), 1) };
    let _ = i.watcher.join();
    // SAFETY: the write end is this module's own; no handler can use it any more
    // (restored above, and WAKE cleared), and the watcher, which closed the read
    // end, has returned.
    unsafe { libc::close(i.write_fd) };
}

/// The watcher: on a signal's byte, removes what is registered and exits; on 0
/// (handlers removed), returns.
fn watch(read_fd: RawFd) {
    let mut b = 0u8;
    loop {
        // SAFETY: reads one byte into a live local from the pipe's read end, which
        // this thread owns.
        let n = unsafe { libc::read(read_fd, (&mut b as *mut u8).cast(), 1) };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        break;
    }
    // SAFETY: the read end is this thread's own and read no more.
    unsafe { libc::close(read_fd) };
    if b == 0 {
        return;
    }
    // Held until the process exits: nothing renames a staged directory meanwhile.
    let s = state();
    for (i, p) in s.paths.iter().enumerate() {
        if p.exists() {
            match remove_while_written(p, i) {
                Ok(()) => eprintln!("voom: interrupted: removed {}", p.display()),
                Err(e) => eprintln!("voom: interrupted: could not remove {}: {e}", p.display()),
            }
        }
    }
    std::process::exit(128 + i32::from(b));
}

/// Removes `path`, a directory that other threads of this process may still be
/// writing into. It is first renamed aside (to [`removing_name`]): no new entry can
/// then be made under its old name, so the removal does not race with files being
/// created in it (which would leave it non-empty). Should the rename fail, it is
/// removed where it is, a few times over.
fn remove_while_written(path: &Path, i: usize) -> std::io::Result<()> {
    let aside = path
        .parent()
        .map(|d| d.join(removing_name(i)))
        .filter(|a| std::fs::rename(path, a).is_ok());
    let target = aside.as_deref().unwrap_or(path);
    let mut tries = 0;
    loop {
        match std::fs::remove_dir_all(target) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(_) if tries < 10 => tries += 1,
            Err(e) => return Err(e),
        }
    }
}

/// The name a directory is renamed to while this process removes it: reclaimed like
/// the others should the process die meanwhile.
fn removing_name(i: usize) -> String {
    format!(".removing-{}-{i}", std::process::id())
}

/// The name of the directory staging the model `name` for this process.
pub fn importing_name(name: &str) -> String {
    format!(".{name}.importing-{}", std::process::id())
}

/// The name the model `name` is moved to while its replacement moves in.
pub fn old_name(name: &str) -> String {
    format!(".{name}.old-{}", std::process::id())
}

/// The prefix of a pull's work directory in `$VOOM_HOME` for this process.
pub fn pull_prefix() -> String {
    format!(".pull-{}-", std::process::id())
}

/// What a staging directory's name says: its kind, the model it is for (none for a
/// pull's), and the process that made it.
#[derive(Debug, PartialEq, Eq)]
pub enum Staged {
    /// `.NAME.importing-PID` (also an older voom's `..NAME.importing-PID.importing-PID`).
    Importing { model: String, pid: u32 },
    /// `.NAME.old-PID`.
    Old { model: String, pid: u32 },
    /// `.pull-PID-*`.
    Pull { pid: u32 },
    /// `.removing-PID-*`: one of the above, being removed after an interrupt.
    Removing { pid: u32 },
}

impl Staged {
    /// What `file_name` (an entry of the models directory or `$VOOM_HOME`) is, if it
    /// is a staging directory's name.
    pub fn parse(file_name: &str) -> Option<Staged> {
        if let Some(rest) = file_name.strip_prefix(".pull-") {
            let (pid, _) = rest.split_once('-')?;
            return Some(Staged::Pull {
                pid: pid.parse().ok()?,
            });
        }
        if let Some(rest) = file_name.strip_prefix(".removing-") {
            let (pid, _) = rest.split_once('-')?;
            return Some(Staged::Removing {
                pid: pid.parse().ok()?,
            });
        }
        let rest = file_name.strip_prefix('.')?;
        let (head, pid) = rest.rsplit_once('-')?;
        let pid: u32 = pid.parse().ok()?;
        if let Some(model) = head.strip_suffix(".importing") {
            // An older voom staged inside its own staging name: the model's name is
            // the innermost one.
            let model = model.trim_start_matches('.');
            let model = model
                .strip_suffix(&format!(".importing-{pid}"))
                .unwrap_or(model);
            return Some(Staged::Importing {
                model: model.to_string(),
                pid,
            });
        }
        let model = head.strip_suffix(".old")?;
        Some(Staged::Old {
            model: model.to_string(),
            pid,
        })
    }

    fn pid(&self) -> u32 {
        match self {
            Staged::Importing { pid, .. }
            | Staged::Old { pid, .. }
            | Staged::Pull { pid }
            | Staged::Removing { pid } => *pid,
        }
    }
}

/// Whether a process `pid` is running (one of another user counts: it may be an
/// import of theirs, and is not ours to judge).
fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 sends nothing; it only checks that `pid` exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Reclaims the staging directories in `dir` (the models directory, or
/// `$VOOM_HOME`) whose process is gone: removes them, except an `.old` directory
/// whose model is missing, which is renamed back to the model. Returns what it did,
/// a line each (also printed to stderr).
pub fn reclaim(dir: &Path) -> Vec<String> {
    let mut done = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return done;
    };
    let me = std::process::id();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(staged) = name.to_str().and_then(Staged::parse) else {
            continue;
        };
        let path = e.path();
        // Directories only (never follow a link), of a process that is gone.
        let is_dir = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
        if !is_dir || staged.pid() == me || alive(staged.pid()) {
            continue;
        }
        let line = match &staged {
            Staged::Old { model, .. } if !dir.join(model).exists() => {
                match std::fs::rename(&path, dir.join(model)) {
                    Ok(()) => format!(
                        "restored {} (an interrupted import had moved it aside)",
                        dir.join(model).display()
                    ),
                    Err(e) => format!("could not restore {}: {e}", path.display()),
                }
            }
            _ => match std::fs::remove_dir_all(&path) {
                Ok(()) => format!(
                    "removed {} (left by process {}, which is gone)",
                    path.display(),
                    staged.pid()
                ),
                Err(e) => format!("could not remove {}: {e}", path.display()),
            },
        };
        eprintln!("voom: {line}");
        done.push(line);
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_names_parse_back() {
        let pid = std::process::id();
        assert_eq!(
            Staged::parse(&importing_name("m.x")),
            Some(Staged::Importing {
                model: "m.x".into(),
                pid
            })
        );
        assert_eq!(
            Staged::parse(&old_name("m")),
            Some(Staged::Old {
                model: "m".into(),
                pid
            })
        );
        assert_eq!(
            Staged::parse(&format!("{}abc", pull_prefix())),
            Some(Staged::Pull { pid })
        );
        assert_eq!(
            Staged::parse(&removing_name(3)),
            Some(Staged::Removing { pid })
        );
        // An older voom's doubly prefixed name.
        assert_eq!(
            Staged::parse("..smollm2.importing-77.importing-77"),
            Some(Staged::Importing {
                model: "smollm2".into(),
                pid: 77
            })
        );
        for other in [
            "m",
            ".hidden",
            ".m.importing-x",
            ".pull-",
            ".removing-x-1",
            "prefixes",
            ".m.old-",
        ] {
            assert_eq!(Staged::parse(other), None, "{other}");
        }
    }

    #[test]
    fn only_directories_of_dead_processes_are_reclaimed_and_old_models_restored() {
        let d = tempfile::tempdir().unwrap();
        let dead = {
            let mut c = std::process::Command::new("true").spawn().unwrap();
            let pid = c.id();
            c.wait().unwrap();
            pid
        };
        let live = std::process::id();
        let mk = |n: &str| {
            std::fs::create_dir_all(d.path().join(n).join("sub")).unwrap();
            std::fs::write(d.path().join(n).join("sub/f"), b"x").unwrap();
        };
        mk(&format!(".a.importing-{dead}"));
        mk(&format!(".b.importing-{live}"));
        mk(&format!(".c.old-{dead}")); // c is missing: put back
        mk(&format!(".e.old-{dead}")); // e is there: the new one won
        mk("e");
        mk(&format!(".pull-{dead}-x1"));
        std::fs::write(d.path().join(format!(".f.importing-{dead}")), b"a file").unwrap();
        let done = reclaim(d.path());
        assert_eq!(done.len(), 4, "{done:?}");
        let mut left: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        let mut want = vec![
            format!(".b.importing-{live}"),
            "c".to_string(),
            "e".to_string(),
            format!(".f.importing-{dead}"),
        ];
        want.sort();
        assert_eq!(left, want);
        assert!(d.path().join("c/sub/f").exists());
    }

    /// Regression: a directory removed on interrupt while another thread still
    /// creates files in it (the import writing its next file) is removed all the
    /// same; removed in place, the last `rmdir` could find it non-empty.
    #[test]
    fn a_directory_still_being_written_is_removed() {
        for round in 0..20 {
            let d = tempfile::tempdir().unwrap();
            let staged = d.path().join(importing_name("m"));
            std::fs::create_dir(&staged).unwrap();
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let writer = {
                let (staged, stop) = (staged.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        // Fails once the directory has gone from its name.
                        let _ = std::fs::write(staged.join(format!("f{n}")), b"x");
                        n += 1;
                    }
                })
            };
            while std::fs::read_dir(&staged).unwrap().count() < 50 {
                std::thread::yield_now();
            }
            remove_while_written(&staged, round).unwrap();
            stop.store(true, Ordering::Relaxed);
            writer.join().unwrap();
            let left: Vec<_> = std::fs::read_dir(d.path()).unwrap().collect();
            assert!(left.is_empty(), "round {round}: {left:?}");
        }
    }
}

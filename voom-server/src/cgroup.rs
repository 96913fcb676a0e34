//! A memory ceiling for child processes: a memory cgroup of its own (v1's
//! `memory.limit_in_bytes` or v2's `memory.max`), as ../BENCHMARKS.md describes. The
//! page cache a process fills counts against it, so it is an honest stand-in for a
//! machine with less memory. Creating one needs write access to the cgroup
//! filesystem (root, or a delegated v2 subtree); where there is none,
//! [`Ceiling::create`] says why.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Which cgroup interface the ceiling uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// A memory cgroup with a limit, removed when dropped (once its processes exited).
#[derive(Debug)]
pub struct Ceiling {
    dir: PathBuf,
    version: Version,
    limit: u64,
}

fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

impl Ceiling {
    /// A new cgroup limited to `limit` bytes under this process's own memory cgroup.
    pub fn create(limit: u64) -> Result<Ceiling, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("no /proc/self/cgroup ({e}): not Linux, or no cgroups"))?;
        let name = format!("voom-bench-{}", std::process::id());
        let mut tried = Vec::new();
        for line in own.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(_), Some(ctl), Some(path)) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let rel = path.trim_start_matches('/');
            let (parent, version) = if ctl.split(',').any(|c| c == "memory") {
                (Path::new("/sys/fs/cgroup/memory").join(rel), Version::V1)
            } else if ctl.is_empty() {
                (Path::new("/sys/fs/cgroup").join(rel), Version::V2)
            } else {
                continue;
            };
            let limit_file = match version {
                Version::V1 => "memory.limit_in_bytes",
                Version::V2 => "memory.max",
            };
            if !parent.join(limit_file).exists() && version == Version::V2 {
                tried.push(format!("{}: no memory controller", parent.display()));
                continue;
            }
            let dir = parent.join(&name);
            if let Err(e) = std::fs::create_dir(&dir) {
                tried.push(format!("{}: {e}", dir.display()));
                continue;
            }
            let c = Ceiling {
                dir,
                version,
                limit,
            };
            if let Err(e) = std::fs::write(c.dir.join(limit_file), limit.to_string()) {
                tried.push(format!("{}: {e}", c.dir.join(limit_file).display()));
                continue;
            }
            if version == Version::V1 {
                // No swap beyond the limit (where the kernel accounts swap).
                let _ =
                    std::fs::write(c.dir.join("memory.memsw.limit_in_bytes"), limit.to_string());
            } else {
                let _ = std::fs::write(c.dir.join("memory.swap.max"), "0");
            }
            return Ok(c);
        }
        Err(if tried.is_empty() {
            "this process has no memory cgroup".into()
        } else {
            tried.join("; ")
        })
    }

    pub fn version(&self) -> Version {
        self.version
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `program args...` started inside the cgroup (it joins before it execs, so
    /// nothing it allocates is outside the ceiling).
    pub fn command(&self, program: &Path, args: &[String]) -> Command {
        let mut c = Command::new("/bin/sh");
        c.arg("-c")
            .arg("echo $$ > \"$0\" && exec \"$@\"")
            .arg(self.dir.join("cgroup.procs"))
            .arg(program)
            .args(args);
        c
    }

    /// The most memory the cgroup has held (private memory and page cache) since the
    /// last [`Ceiling::reset_peak`]; `None` where the kernel does not report it.
    pub fn peak(&self) -> Option<u64> {
        match self.version {
            Version::V1 => read_u64(&self.dir.join("memory.max_usage_in_bytes")),
            Version::V2 => read_u64(&self.dir.join("memory.peak")),
        }
    }

    /// Starts a new peak measurement (v1; v2 kernels from 6.12 accept it too).
    pub fn reset_peak(&self) {
        let f = match self.version {
            Version::V1 => "memory.max_usage_in_bytes",
            Version::V2 => "memory.peak",
        };
        let _ = std::fs::write(self.dir.join(f), "0");
    }

    /// Processes the kernel killed for memory in the cgroup so far.
    pub fn oom_kills(&self) -> u64 {
        let (file, key) = match self.version {
            Version::V1 => ("memory.oom_control", "oom_kill "),
            Version::V2 => ("memory.events", "oom_kill "),
        };
        std::fs::read_to_string(self.dir.join(file))
            .ok()
            .and_then(|t| {
                t.lines()
                    .find_map(|l| l.strip_prefix(key))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0)
    }
}

impl Drop for Ceiling {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Drops the OS page cache (`echo 3 > /proc/sys/vm/drop_caches` after `sync`);
/// `Err` says why not (it needs root).
pub fn drop_page_cache() -> Result<(), String> {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").map_err(|e| format!("drop_caches: {e}"))
}

/// Reads every byte of `files` through the OS page cache, so that a memory-mapped run
/// after it finds them in memory. Errors are left to that run.
pub fn warm_page_cache(files: &[std::path::PathBuf]) {
    use std::io::Read;
    let mut buf = vec![0u8; 8 << 20];
    for f in files {
        if let Ok(mut file) = std::fs::File::open(f) {
            while matches!(file.read(&mut buf), Ok(n) if n > 0) {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where this machine lets a process make a memory cgroup: a child in it that
    /// allocates past the limit is killed, and one within it is not.
    #[test]
    fn a_ceiling_kills_what_exceeds_it_and_spares_what_fits() {
        let c = match Ceiling::create(64 << 20) {
            Ok(c) => c,
            Err(why) => {
                eprintln!("skipping: no memory cgroup can be made here: {why}");
                return;
            }
        };
        let run = |mib: u32| {
            c.command(
                Path::new("/usr/bin/env"),
                &[
                    "python3".into(),
                    "-c".into(),
                    format!("b = bytearray({mib} << 20); print(len(b))"),
                ],
            )
            .output()
            .unwrap()
        };
        assert!(run(16).status.success());
        assert!(!run(256).status.success());
        assert!(c.oom_kills() >= 1 || c.version() == Version::V2);
        assert!(c.peak().is_some_and(|p| p <= 64 << 20));
    }
}

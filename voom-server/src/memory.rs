//! This process's memory, as the kernel accounts it: how much is private to it and how
//! much is the daemon's shared arena. Two engines on one daemon should each show a
//! small private figure and the arena once, shared.
//!
//! Linux reads `/proc/self/smaps`; elsewhere there is no report (`None`).

use std::path::{Path, PathBuf};

use serde::Serialize;

/// Byte counts summed over this process's mappings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ProcessMemory {
    /// Resident bytes of every mapping.
    pub rss_bytes: u64,
    /// Resident bytes mapped by this process alone (`Private_Clean + Private_Dirty`):
    /// what the process costs beyond pages it shares.
    pub private_bytes: u64,
    /// Proportional set size: each resident page divided by the processes mapping it.
    pub pss_bytes: u64,
    /// Resident bytes of the daemon's arena mapping (`/memfd:vpaged-arena`).
    pub arena_rss_bytes: u64,
    /// Of those, the bytes this process alone maps (0 when the daemon or another
    /// engine maps the same pages).
    pub arena_private_bytes: u64,
}

/// The current process's figures, where the OS reports them.
pub fn snapshot() -> Option<ProcessMemory> {
    #[cfg(target_os = "linux")]
    {
        std::fs::read_to_string("/proc/self/smaps")
            .ok()
            .map(|s| parse_smaps(&s))
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// Sums an smaps document. A mapping's header line names its range and (last field) its
/// path; its `Key: N kB` lines follow.
pub fn parse_smaps(text: &str) -> ProcessMemory {
    let mut m = ProcessMemory::default();
    let mut in_arena = false;
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else { continue };
        if let Some(key) = first.strip_suffix(':') {
            let Some(kb) = fields.next().and_then(|v| v.parse::<u64>().ok()) else {
                continue;
            };
            let bytes = kb * 1024;
            match key {
                "Rss" => {
                    m.rss_bytes += bytes;
                    if in_arena {
                        m.arena_rss_bytes += bytes;
                    }
                }
                "Pss" => m.pss_bytes += bytes,
                "Private_Clean" | "Private_Dirty" => {
                    m.private_bytes += bytes;
                    if in_arena {
                        m.arena_private_bytes += bytes;
                    }
                }
                _ => {}
            }
        } else if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            // A mapping header: "start-end perms offset dev inode [path]".
            in_arena = line.contains("/memfd:vpaged-arena");
        }
    }
    m
}

/// Resident bytes of this process now (`None` where the OS does not report them).
pub fn resident_bytes() -> Option<u64> {
    snapshot().map(|m| m.rss_bytes)
}

/// Bytes this process caused to be read from storage (`read_bytes` of
/// `/proc/self/io`: page-cache misses and direct reads, not cache hits).
pub fn storage_read_bytes() -> Option<u64> {
    proc_field("/proc/self/io", "read_bytes:")
}

/// This process's peak resident memory (`VmHWM`), in bytes.
pub fn peak_resident_bytes() -> Option<u64> {
    proc_field("/proc/self/status", "VmHWM:").map(|kb| kb * 1024)
}

/// The first number after `key` in the file at `path`.
fn proc_field(path: &str, key: &str) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Memory a process started now could use, and where the figure comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Available {
    pub bytes: u64,
    /// `MemAvailable`, `memory cgroup /path (limit L, in use U)`, or an estimate.
    pub source: String,
    /// The OS gave no figure: `bytes` is a guess.
    pub guessed: bool,
}

/// The lower of the machine's available memory (`MemAvailable`) and what this
/// process's memory cgroup leaves (its limit less its usage, v1 or v2). Where
/// neither is readable: 4 GiB, labelled as a guess.
pub fn available() -> Available {
    let machine = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| meminfo_available(&m));
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| cgroup_room(&c, Path::new("/sys/fs/cgroup")));
    match (machine, cgroup) {
        (_, Some((room, src))) if machine.is_none_or(|m| room < m) => Available {
            bytes: room,
            source: src,
            guessed: false,
        },
        (Some(m), _) => Available {
            bytes: m,
            source: "MemAvailable".into(),
            guessed: false,
        },
        _ => Available {
            bytes: 4 << 30,
            source: "a guess: this OS reports no available memory".into(),
            guessed: true,
        },
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes (the memory governor's
/// reading).
pub use libvoom::engine::governor::meminfo_available;

/// The room left in this process's memory cgroup (`/proc/self/cgroup` text, the
/// cgroup filesystem's root): limit less usage, with a description; `None` with no
/// limit.
pub fn cgroup_room(proc_cgroup: &str, root: &Path) -> Option<(u64, String)> {
    let read = |p: PathBuf| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = path.trim_start_matches('/');
        let (limit, usage) = if controllers.split(',').any(|c| c == "memory") {
            let d = root.join("memory").join(rel);
            (
                read(d.join("memory.limit_in_bytes")),
                read(d.join("memory.usage_in_bytes")),
            )
        } else if controllers.is_empty() {
            let d = root.join(rel);
            (read(d.join("memory.max")), read(d.join("memory.current")))
        } else {
            continue;
        };
        // v1 reports "no limit" as a huge number; v2 as "max" (which does not parse).
        if let (Some(l), Some(u)) = (limit, usage) {
            if l < (1 << 60) {
                return Some((
                    l.saturating_sub(u),
                    format!("memory cgroup {path} (limit {l}, in use {u})"),
                ));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn available_memory_comes_from_meminfo_or_the_cgroup_limit() {
        assert_eq!(
            meminfo_available("MemTotal: 100 kB\nMemAvailable:   2048 kB\n"),
            Some(2 << 20)
        );
        assert_eq!(meminfo_available("MemTotal: 100 kB\n"), None);
        let root = tempfile::tempdir().unwrap();
        let v1 = root.path().join("memory/user/bench");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "1073741824\n").unwrap();
        std::fs::write(v1.join("memory.usage_in_bytes"), "73741824\n").unwrap();
        let (room, src) = cgroup_room("4:cpu:/x\n7:memory:/user/bench\n", root.path()).unwrap();
        assert_eq!(room, 1_000_000_000);
        assert!(src.contains("/user/bench"), "{src}");
        // Unlimited (v1's huge number) is no limit.
        std::fs::write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        assert_eq!(cgroup_room("7:memory:/user/bench\n", root.path()), None);
        let v2 = root.path().join("svc");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v2.join("memory.max"), "max\n").unwrap();
        std::fs::write(v2.join("memory.current"), "5\n").unwrap();
        assert_eq!(cgroup_room("0::/svc\n", root.path()), None);
        std::fs::write(v2.join("memory.max"), "500\n").unwrap();
        assert_eq!(cgroup_room("0::/svc\n", root.path()).unwrap().0, 495);
    }

    const SMAPS: &str = "\
55d0c0a00000-55d0c0a21000 r--p 00000000 fd:01 1234   /usr/bin/voom
Size:                132 kB
Rss:                 128 kB
Pss:                 128 kB
Private_Clean:       128 kB
Private_Dirty:         0 kB
7f0000000000-7f0010000000 r--s 00000000 00:01 99     /memfd:vpaged-arena (deleted)
Size:             262144 kB
Rss:              200000 kB
Pss:               66666 kB
Shared_Clean:     200000 kB
Private_Clean:         0 kB
Private_Dirty:         0 kB
7fff00000000-7fff00021000 rw-p 00000000 00:00 0      [stack]
Rss:                  40 kB
Pss:                  40 kB
Private_Dirty:        40 kB
VmFlags: rd wr mr mw me gd ac
";

    #[test]
    fn sums_every_mapping_and_the_arena_apart() {
        let m = parse_smaps(SMAPS);
        assert_eq!(m.rss_bytes, (128 + 200_000 + 40) * 1024);
        assert_eq!(m.pss_bytes, (128 + 66_666 + 40) * 1024);
        assert_eq!(m.private_bytes, (128 + 40) * 1024);
        assert_eq!(m.arena_rss_bytes, 200_000 * 1024);
        assert_eq!(m.arena_private_bytes, 0);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_has_resident_private_memory() {
        let v = std::hint::black_box(vec![1u8; 8 << 20]);
        let m = snapshot().expect("linux has smaps");
        assert!(m.private_bytes >= 8 << 20, "{m:?}");
        assert!(m.rss_bytes >= m.private_bytes);
        drop(v);
    }
}

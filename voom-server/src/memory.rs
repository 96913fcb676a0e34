//! This process's memory, as the kernel accounts it: how much is private to it and how
//! much is the daemon's shared arena. Two engines on one daemon should each show a
//! small private figure and the arena once, shared.
//!
//! Linux reads `/proc/self/smaps`; elsewhere there is no report (`None`).

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

#[cfg(test)]
mod tests {
    use super::*;

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

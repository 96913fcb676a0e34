//! The block device a file lives on, and its counters (Linux:
//! `/sys/dev/block/MAJOR:MINOR/stat`, the kernel's per-device I/O statistics, for a
//! disk or a partition alike): requests completed, bytes read, and the time the device
//! had any request in flight. `voom bench out-of-core` reads them around each run, so
//! a report says what the device did (how large its read requests were, how much of
//! the run it was busy, what it delivered while busy) beside what the process read.
//! The counters are the device's: they include every other process's I/O on it.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// A block device whose counters can be read.
#[derive(Debug, Clone)]
pub struct Device {
    name: String,
    stat: PathBuf,
}

/// The device's read counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Read requests completed.
    pub reads: u64,
    /// Bytes read (the kernel counts 512-byte sectors, whatever the device's block).
    pub bytes: u64,
    /// Milliseconds the device had at least one request in flight (`io_ticks`).
    pub busy_ms: u64,
}

/// What the device did between two readings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Activity {
    pub reads: u64,
    pub bytes: u64,
    pub busy: Duration,
}

impl Activity {
    /// Mean bytes of a read request (0 without requests).
    pub fn mean_request_bytes(&self) -> u64 {
        self.bytes.checked_div(self.reads).unwrap_or(0)
    }

    /// Bytes per second while the device was busy (`None` if it never was).
    pub fn busy_bytes_per_sec(&self) -> Option<f64> {
        let s = self.busy.as_secs_f64();
        (s > 0.0).then(|| self.bytes as f64 / s)
    }
}

impl Counters {
    /// Parses a `stat` line: read requests (field 1), sectors read (field 3) and
    /// `io_ticks` (field 10). `None` if it has fewer fields or one is not a number.
    pub fn parse(line: &str) -> Option<Counters> {
        let f: Vec<u64> = line
            .split_whitespace()
            .take(10)
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        (f.len() == 10).then(|| Counters {
            reads: f[0],
            bytes: f[2] * 512,
            busy_ms: f[9],
        })
    }

    /// What happened from `before` to these counters (counters that went back, as
    /// when a device is reset, count as nothing).
    pub fn since(&self, before: &Counters) -> Activity {
        Activity {
            reads: self.reads.saturating_sub(before.reads),
            bytes: self.bytes.saturating_sub(before.bytes),
            busy: Duration::from_millis(self.busy_ms.saturating_sub(before.busy_ms)),
        }
    }
}

impl Device {
    /// The block device holding `path`; `None` where there is none to read (not
    /// Linux, or a file system without one of its own, such as overlayfs or tmpfs).
    pub fn of(path: &Path) -> Option<Device> {
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::fs::MetadataExt;
            let dev = std::fs::metadata(path).ok()?.dev();
            let (major, minor) = (libc::major(dev), libc::minor(dev));
            let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
            let name = std::fs::read_link(&sys)
                .ok()
                .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| format!("{major}:{minor}"));
            let d = Device {
                name,
                stat: sys.join("stat"),
            };
            d.read().map(|_| d)
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = path;
            None
        }
    }

    /// The device's name (`vda`, `nvme0n1p2`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its counters now.
    pub fn read(&self) -> Option<Counters> {
        Counters::parse(&std::fs::read_to_string(&self.stat).ok()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernels_stat_line_and_differences() {
        // A real line (virtio disk): 17 fields on recent kernels, 11 on old ones.
        let a = Counters::parse(
            "  270364    12026 152301064   983460   154035   118306 12542688   379617        0   585772  1391052        0        0        0        0    26766    28974",
        )
        .unwrap();
        assert_eq!(
            a,
            Counters {
                reads: 270364,
                bytes: 152301064 * 512,
                busy_ms: 585772
            }
        );
        let old = Counters::parse("1 0 8 3 0 0 0 0 0 7 9").unwrap();
        assert_eq!((old.reads, old.bytes, old.busy_ms), (1, 4096, 7));
        assert_eq!(Counters::parse("1 2 3"), None);
        assert_eq!(Counters::parse("1 2 x 4 5 6 7 8 9 10"), None);

        let b = Counters {
            reads: a.reads + 10,
            bytes: a.bytes + (20 << 20),
            busy_ms: a.busy_ms + 500,
        };
        let d = b.since(&a);
        assert_eq!(d.reads, 10);
        assert_eq!(d.mean_request_bytes(), (20 << 20) / 10);
        assert_eq!(d.busy, Duration::from_millis(500));
        assert_eq!(d.busy_bytes_per_sec(), Some((20 << 20) as f64 / 0.5));
        assert_eq!(a.since(&b), Activity::default(), "counters that went back");
        assert_eq!(Activity::default().busy_bytes_per_sec(), None);
    }

    /// On Linux a file on a disk-backed file system has a device whose counters read
    /// and only grow; elsewhere (tmpfs, overlayfs, not Linux) there is none.
    #[test]
    fn the_device_of_a_file_reads_counters_that_grow() {
        let d = tempfile::tempdir_in(std::env::current_dir().unwrap()).unwrap();
        let p = d.path().join("f");
        std::fs::write(&p, b"x").unwrap();
        let Some(dev) = Device::of(&p) else {
            eprintln!("skipping: no block device under {}", p.display());
            return;
        };
        let a = dev.read().unwrap();
        let b = dev.read().unwrap();
        assert!(b.reads >= a.reads && b.bytes >= a.bytes && b.busy_ms >= a.busy_ms);
        assert!(!dev.name().is_empty());
    }
}

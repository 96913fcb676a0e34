//! The daemon's configuration: command-line flags, environment variables and a TOML
//! config file, in that order of precedence, over built-in defaults.
//!
//! ```toml
//! socket = "/run/user/1000/vpaged.sock"
//! cache_size = "2GiB"
//! fast_tier = "/Volumes/fast/vpaged"
//! fast_tier_size = "20GiB"
//! pin_first_layers = 1
//! pin_last_layers = 1
//! max_sessions = 128
//! read_mode = "auto"    # or "direct" (around the OS page cache) or "buffered"
//! read_threads = 16     # pieces of model files read at once
//! prefetch_threads = 4  # threads taking prefetch hints
//! read_ahead_layers = 2 # decoder layers of vpack bodies read ahead of their slots
//! hash_on_open = true   # hash a checkpoint without a manifest when it is opened
//! state_dir = "/var/lib/vpaged"  # manifests of read-only checkpoints it hashed
//!
//! [[nas]]
//! mount = "/Volumes/nas"
//! timeout = "5s"
//! recheck = "5s"
//! remount_command = "mount -a"
//! ```
//!
//! A model opened by a path under a `[[nas]]` mount (e.g. `/Volumes/nas/models/foo`)
//! is read only through that mount's NAS tier; a local model whose directory name
//! also exists right under a mount has its copy there as a fallback.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// A byte count written as `123`, `512MiB`, `8GiB`, `1.5GB` (binary and decimal
/// suffixes, case-insensitive; `B` optional).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl std::str::FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let num: f64 = num
            .parse()
            .map_err(|_| format!("'{s}' is not a byte size (e.g. 512MiB, 8GiB)"))?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1_000,
            "m" | "mb" => 1_000_000,
            "g" | "gb" => 1_000_000_000,
            "t" | "tb" => 1_000_000_000_000,
            "ki" | "kib" => 1 << 10,
            "mi" | "mib" => 1 << 20,
            "gi" | "gib" => 1 << 30,
            "ti" | "tib" => 1 << 40,
            other => return Err(format!("unknown byte unit '{other}' in '{s}'")),
        };
        let v = num * mult as f64;
        if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
            return Err(format!("byte size '{s}' is out of range"));
        }
        Ok(ByteSize(v.round() as u64))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(ByteSize(n)),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// A duration written as `250ms`, `5s`, `2m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration (e.g. 500ms, 5s)"))?;
    let secs = match unit.trim() {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" | "min" => n * 60.0,
        other => return Err(format!("unknown duration unit '{other}' in '{s}'")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("duration '{s}': {e}"))
}

fn de_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let s: Option<String> = Option::deserialize(d)?;
    s.map(|s| parse_duration(&s).map_err(serde::de::Error::custom))
        .transpose()
}

/// A NAS mount holding model stores.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NasMount {
    /// The mount point.
    pub mount: PathBuf,
    /// Longest a read, a health probe or opening a model on the mount may take before
    /// it is abandoned with an error (default [`NasMount::DEFAULT_TIMEOUT`]).
    #[serde(default, deserialize_with = "de_duration")]
    pub timeout: Option<Duration>,
    /// Shortest interval between health checks of the mount, healthy or not; a check
    /// of a dead mount runs `remount_command` (default [`NasMount::DEFAULT_RECHECK`]).
    #[serde(default, deserialize_with = "de_duration")]
    pub recheck: Option<Duration>,
    /// Run with `sh -c` when the mount is found dead, before checking it again (e.g.
    /// `mount -a`); it should also succeed when the mount is already there.
    #[serde(default)]
    pub remount_command: Option<String>,
}

impl NasMount {
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
    pub const DEFAULT_RECHECK: Duration = Duration::from_secs(5);

    /// The store's settings for this mount, defaults filled in.
    pub fn nas_config(&self) -> crate::tier::NasConfig {
        crate::tier::NasConfig {
            mount: self.mount.clone(),
            model: PathBuf::new(),
            timeout: self.timeout.unwrap_or(Self::DEFAULT_TIMEOUT),
            recheck: self.recheck.unwrap_or(Self::DEFAULT_RECHECK),
            remount_command: self.remount_command.clone(),
        }
    }
}

/// The config file's contents; every key optional.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub socket: Option<PathBuf>,
    pub cache_size: Option<ByteSize>,
    pub fast_tier: Option<PathBuf>,
    pub fast_tier_size: Option<ByteSize>,
    pub pin_first_layers: Option<u32>,
    pub pin_last_layers: Option<u32>,
    pub prefault: Option<bool>,
    pub max_sessions: Option<usize>,
    pub read_mode: Option<String>,
    pub read_threads: Option<usize>,
    pub prefetch_threads: Option<usize>,
    pub read_ahead_layers: Option<usize>,
    pub hash_on_open: Option<bool>,
    pub state_dir: Option<PathBuf>,
    #[serde(default)]
    pub nas: Vec<NasMount>,
}

/// The largest daemon configuration file read.
pub const CONFIG_MAX_BYTES: u64 = 1 << 20;

impl FileConfig {
    pub fn load(path: &Path) -> Result<Self, String> {
        // A regular file only (a FIFO or a device is refused, never read), bounded.
        let bytes = voom_formats::file::read_limited(path, CONFIG_MAX_BYTES)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let text = String::from_utf8(bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// Flags and environment variables (both optional: unset ones fall back to the file).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DaemonArgs {
    /// Unix socket to listen on.
    #[arg(long, env = "VPAGED_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Shared page cache size (e.g. 2GiB).
    #[arg(long, env = "VPAGED_CACHE_SIZE")]
    pub cache_size: Option<ByteSize>,
    /// Fast tier directory (staged copies of hot pages).
    #[arg(long, env = "VPAGED_FAST_TIER")]
    pub fast_tier: Option<PathBuf>,
    /// Fast tier capacity (e.g. 20GiB).
    #[arg(long, env = "VPAGED_FAST_TIER_SIZE")]
    pub fast_tier_size: Option<ByteSize>,
    /// Keep the first N decoder layers of each model resident.
    #[arg(long, env = "VPAGED_PIN_FIRST_LAYERS")]
    pub pin_first_layers: Option<u32>,
    /// Keep the last N decoder layers of each model resident.
    #[arg(long, env = "VPAGED_PIN_LAST_LAYERS")]
    pub pin_last_layers: Option<u32>,
    /// Commit the whole cache's memory at start-up, so that first loads do not pay
    /// for the kernel zeroing fresh pages (about 3-4x faster first fills).
    #[arg(long, env = "VPAGED_PREFAULT")]
    pub prefault: bool,
    /// Most engine connections served at once (default 128); more are refused.
    #[arg(long, env = "VPAGED_MAX_SESSIONS")]
    pub max_sessions: Option<usize>,
    /// How model files are read: `direct` (around the OS page cache), `buffered`,
    /// or `auto` (the default: direct for a model larger than the cache).
    #[arg(long, env = "VPAGED_READ_MODE")]
    pub read_mode: Option<String>,
    /// Reads of model files in flight at once (reader threads; default 16, 0 reads
    /// on the requesting thread).
    #[arg(long, env = "VPAGED_READ_THREADS")]
    pub read_threads: Option<usize>,
    /// Threads taking prefetch hints (default 4); pages that are not one plain read
    /// of the primary copy (vpack, staged, NAS) load on them, one each at a time.
    #[arg(long, env = "VPAGED_PREFETCH_THREADS")]
    pub prefetch_threads: Option<usize>,
    /// Decoder layers of vpack bodies read ahead of their pages' cache slots while
    /// earlier ones decode, sized by the first model with bodies (default 2; 0:
    /// none). Held beside the cache, not in it.
    #[arg(long, env = "VPAGED_READ_AHEAD_LAYERS")]
    pub read_ahead_layers: Option<usize>,
    /// Refuse a checkpoint that has no page manifest (`vpagectl hash` writes one)
    /// instead of hashing it when it is first opened (the default).
    #[arg(long, env = "VPAGED_NO_HASH_ON_OPEN")]
    pub no_hash_on_open: bool,
    /// Where the daemon keeps what it computes (the manifests of checkpoints it
    /// hashed whose own directory it cannot write). Default:
    /// `$XDG_STATE_HOME/vpaged`, else `$HOME/.local/state/vpaged`.
    #[arg(long, env = "VPAGED_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// TOML config file.
    #[arg(long, env = "VPAGED_CONFIG")]
    pub config: Option<PathBuf>,
}

/// The resolved configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct DaemonConfig {
    pub socket: PathBuf,
    pub cache_size: u64,
    pub fast_tier: Option<PathBuf>,
    pub fast_tier_size: u64,
    pub pin_first_layers: u32,
    pub pin_last_layers: u32,
    pub prefault: bool,
    pub max_sessions: usize,
    /// `None`: chosen per model (see [`crate::store::StoreConfig::read_mode`]).
    pub read_mode: Option<crate::direct::ReadMode>,
    /// Reads in flight and prefetched pages loading at once.
    pub io: crate::store::IoConfig,
    /// See [`crate::store::StoreConfig::hash_on_open`].
    pub hash_on_open: bool,
    /// See [`DaemonArgs::state_dir`].
    pub state_dir: PathBuf,
    pub nas: Vec<NasMount>,
}

/// `$XDG_STATE_HOME/vpaged`, else `$HOME/.local/state/vpaged`.
pub fn default_state_dir() -> PathBuf {
    xdg_or_home("XDG_STATE_HOME", &[".local", "state"]).join("vpaged")
}

/// The directory `$var` names, else `$HOME` joined with `under` (`/tmp` without
/// `HOME`).
fn xdg_or_home(var: &str, under: &[&str]) -> PathBuf {
    if let Some(d) = std::env::var_os(var) {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    under.iter().fold(home, |p, part| p.join(part))
}

/// `$XDG_RUNTIME_DIR/vpaged.sock`, else `$HOME/.voom/vpaged.sock`.
pub fn default_socket() -> PathBuf {
    xdg_or_home("XDG_RUNTIME_DIR", &[".voom"]).join("vpaged.sock")
}

impl DaemonConfig {
    /// Flags/environment over the config file over defaults.
    pub fn resolve(args: &DaemonArgs) -> Result<Self, String> {
        let file = match &args.config {
            Some(p) => FileConfig::load(p)?,
            None => FileConfig::default(),
        };
        Self::merge(args, &file)
    }

    pub fn merge(args: &DaemonArgs, file: &FileConfig) -> Result<Self, String> {
        let fast_tier = args.fast_tier.clone().or_else(|| file.fast_tier.clone());
        let fast_tier_size = args.fast_tier_size.or(file.fast_tier_size).map(|b| b.0);
        if fast_tier.is_some() && fast_tier_size.is_none() {
            return Err("a fast tier needs a size (--fast-tier-size, VPAGED_FAST_TIER_SIZE or fast_tier_size)".into());
        }
        let cache_size = args.cache_size.or(file.cache_size).map_or(2 << 30, |b| b.0);
        if cache_size < (16 << 10) {
            return Err(format!(
                "cache size {cache_size} bytes is below one 16 KiB slot"
            ));
        }
        let max_sessions = args
            .max_sessions
            .or(file.max_sessions)
            .unwrap_or(crate::daemon::DEFAULT_MAX_SESSIONS);
        if max_sessions == 0 {
            return Err("max_sessions must be at least 1".into());
        }
        let mut io = crate::store::IoConfig::default();
        if let Some(n) = args.read_threads.or(file.read_threads) {
            io.read_threads = n;
        }
        if let Some(n) = args.prefetch_threads.or(file.prefetch_threads) {
            if n == 0 {
                return Err("prefetch_threads must be at least 1".into());
            }
            io.prefetch_threads = n;
        }
        if let Some(n) = args.read_ahead_layers.or(file.read_ahead_layers) {
            io.read_ahead_layers = n;
        }
        Ok(DaemonConfig {
            socket: args
                .socket
                .clone()
                .or_else(|| file.socket.clone())
                .unwrap_or_else(default_socket),
            cache_size,
            fast_tier,
            fast_tier_size: fast_tier_size.unwrap_or(0),
            pin_first_layers: args.pin_first_layers.or(file.pin_first_layers).unwrap_or(0),
            pin_last_layers: args.pin_last_layers.or(file.pin_last_layers).unwrap_or(0),
            prefault: args.prefault || file.prefault.unwrap_or(false),
            max_sessions,
            read_mode: parse_read_mode(
                args.read_mode
                    .as_deref()
                    .or(file.read_mode.as_deref())
                    .unwrap_or("auto"),
            )?,
            io,
            hash_on_open: !args.no_hash_on_open && file.hash_on_open.unwrap_or(true),
            state_dir: args
                .state_dir
                .clone()
                .or_else(|| file.state_dir.clone())
                .unwrap_or_else(default_state_dir),
            nas: file.nas.clone(),
        })
    }
}

/// `direct`, `buffered` or `auto` (`None`).
pub fn parse_read_mode(s: &str) -> Result<Option<crate::direct::ReadMode>, String> {
    use crate::direct::ReadMode;
    match s {
        "direct" => Ok(Some(ReadMode::Direct)),
        "buffered" => Ok(Some(ReadMode::Buffered)),
        "auto" => Ok(None),
        other => Err(format!(
            "read_mode '{other}' is not one of direct, buffered, auto"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_modes_parse_and_a_bad_one_is_named() {
        use crate::direct::ReadMode;
        assert_eq!(parse_read_mode("direct"), Ok(Some(ReadMode::Direct)));
        assert_eq!(parse_read_mode("auto"), Ok(None));
        assert!(parse_read_mode("fast").unwrap_err().contains("'fast'"));
    }

    #[test]
    fn byte_sizes() {
        assert_eq!("8GiB".parse::<ByteSize>().unwrap().0, 8 << 30);
        assert_eq!("512mib".parse::<ByteSize>().unwrap().0, 512 << 20);
        assert_eq!("1.5GB".parse::<ByteSize>().unwrap().0, 1_500_000_000);
        assert_eq!("4096".parse::<ByteSize>().unwrap().0, 4096);
        assert!("12 parsecs"
            .parse::<ByteSize>()
            .unwrap_err()
            .contains("parsecs"));
        assert!("GiB".parse::<ByteSize>().is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("5s").unwrap(), Duration::from_secs(5));
        assert!(parse_duration("5 fortnights").is_err());
    }

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let file: FileConfig = toml::from_str(
            r#"
            cache_size = "1GiB"
            fast_tier = "/fast"
            fast_tier_size = "20GiB"
            pin_last_layers = 2
            max_sessions = 16
            [[nas]]
            mount = "/mnt/nas"
            timeout = "3s"
            recheck = "250ms"
            remount_command = "mount -a"
            "#,
        )
        .unwrap();
        let args = DaemonArgs {
            cache_size: Some(ByteSize(3 << 30)),
            ..Default::default()
        };
        let c = DaemonConfig::merge(&args, &file).unwrap();
        assert_eq!(c.cache_size, 3 << 30);
        assert_eq!(c.fast_tier.as_deref(), Some(Path::new("/fast")));
        assert_eq!(c.fast_tier_size, 20 << 30);
        assert_eq!((c.pin_first_layers, c.pin_last_layers), (0, 2));
        assert_eq!(c.max_sessions, 16);
        assert_eq!(c.nas[0].timeout, Some(Duration::from_secs(3)));
        let n = c.nas[0].nas_config();
        assert_eq!(n.mount, Path::new("/mnt/nas"));
        assert_eq!(n.timeout, Duration::from_secs(3));
        assert_eq!(n.recheck, Duration::from_millis(250));
        assert_eq!(n.remount_command.as_deref(), Some("mount -a"));
        let c = DaemonConfig::merge(&DaemonArgs::default(), &FileConfig::default()).unwrap();
        assert_eq!(c.cache_size, 2 << 30);
        assert_eq!(c.max_sessions, crate::daemon::DEFAULT_MAX_SESSIONS);
        let zero = DaemonArgs {
            max_sessions: Some(0),
            ..Default::default()
        };
        assert!(DaemonConfig::merge(&zero, &FileConfig::default()).is_err());
    }

    #[test]
    fn bad_configs_are_clear_errors() {
        let e = toml::from_str::<FileConfig>("cache_sise = \"1GiB\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cache_sise"), "{e}");
        let e = DaemonConfig::merge(
            &DaemonArgs {
                fast_tier: Some("/f".into()),
                ..Default::default()
            },
            &FileConfig::default(),
        )
        .unwrap_err();
        assert!(e.contains("fast-tier-size"), "{e}");
        let e = toml::from_str::<FileConfig>("[[nas]]\nmount = \"/n\"\nrecheck = \"5 weeks\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("5 weeks"), "{e}");
    }

    #[test]
    fn a_nas_mount_alone_gets_default_timeouts() {
        let file: FileConfig = toml::from_str("[[nas]]\nmount = \"/n\"").unwrap();
        let n = file.nas[0].nas_config();
        assert_eq!(
            (n.timeout, n.recheck, n.remount_command),
            (NasMount::DEFAULT_TIMEOUT, NasMount::DEFAULT_RECHECK, None)
        );
    }
}

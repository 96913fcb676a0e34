//! Runtime profiles: named YAML files of engine settings (`profiles/NAME.yaml`).
//!
//! A profile sets any of [`KEYS`]; `inherits: OTHER` takes another profile's values
//! first. A run's settings are resolved per key by precedence: CLI flag, then
//! environment (`VOOM_*`), then the profile chain (the child's value over its
//! parent's), then the built-in default. [`Resolved`] keeps where each value came
//! from and a digest of the settings, which the CLI's JSON output and the server
//! report with every response.
//!
//! Profiles are looked up in a directory (`--profiles-dir`, `VOOM_PROFILES_DIR`, else
//! `$VOOM_HOME/profiles` when it exists), then among the profiles shipped in the
//! repository's `profiles/`, compiled into the binary. Every profile is exact: no
//! lossy encoding exists, and a file claiming one is refused.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The profile used when none is named.
pub const DEFAULT_PROFILE: &str = "default";

/// The shipped profiles, compiled in so an installed binary has them.
pub const BUILTIN: &[(&str, &str)] = &[
    ("default", include_str!("../../profiles/default.yaml")),
    ("low-memory", include_str!("../../profiles/low-memory.yaml")),
    ("throughput", include_str!("../../profiles/throughput.yaml")),
];

/// The keys a profile file may have.
pub const KEYS: &[&str] = &[
    "inherits",
    "notes",
    "exact",
    "lossy",
    "memory_budget",
    "memory_mapped",
    "cache_budget",
    "fast_tier",
    "fast_tier_size",
    "pin_first_layers",
    "pin_last_layers",
    "prefetch_depth",
    "read_threads",
    "read_piece",
    "read_ahead_layers",
    "expert_prefetch",
    "kv_budget",
    "prefix_cache",
    "prefix_disk",
    "prefix_disk_min",
    "max_context",
    "threads",
    "backend",
    "verify",
    "sampling",
];

/// The keys of a profile's `sampling` map.
pub const SAMPLING_KEYS: &[&str] = &["temperature", "top_p", "top_k"];

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("no profile '{name}' (looked in {looked}; profiles there: {available})")]
    NotFound {
        name: String,
        looked: String,
        available: String,
    },
    #[error("'{name}' is not a profile name (letters, digits, '-', '_' and '.' only)")]
    BadName { name: String },
    #[error("profile {file}: unknown key '{key}' (known keys: {known})")]
    UnknownKey {
        file: String,
        key: String,
        known: String,
    },
    #[error("profile {file}: {detail}")]
    Invalid { file: String, detail: String },
    #[error("profile {file}: no lossy encodings are implemented; every profile is exact")]
    Lossy { file: String },
    #[error("profile {file} inherits '{parent}', which does not exist ({detail})")]
    MissingParent {
        file: String,
        parent: String,
        detail: String,
    },
    #[error("profiles inherit in a cycle: {chain}")]
    Cycle { chain: String },
    #[error("cannot read profile {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("profiles directory {dir} {detail}")]
    Dir { dir: PathBuf, detail: String },
    #[error("environment variable {var}='{value}': {detail}")]
    Env {
        var: &'static str,
        value: String,
        detail: String,
    },
    #[error(
        "{set} are set at the same level: each chooses how the weights are held \
         (memory_budget plans a page cache, cache_budget sizes one, memory_mapped uses \
         none); give one of them"
    )]
    StoreConflict { set: String },
}

/// Page verification against the manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verify {
    Off,
    FirstUse,
    Eager,
}

impl Verify {
    pub fn as_str(self) -> &'static str {
        match self {
            Verify::Off => "off",
            Verify::FirstUse => "first-use",
            Verify::Eager => "eager",
        }
    }

    pub fn mode(self) -> vpaged::VerifyMode {
        match self {
            Verify::Off => vpaged::VerifyMode::Off,
            Verify::FirstUse => vpaged::VerifyMode::FirstUse,
            Verify::Eager => vpaged::VerifyMode::Eager,
        }
    }
}

impl std::str::FromStr for Verify {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Verify::Off),
            "first-use" => Ok(Verify::FirstUse),
            "eager" => Ok(Verify::Eager),
            other => Err(format!("must be off, first-use or eager, not '{other}'")),
        }
    }
}

/// A byte size such as `2GiB`, `512MiB` or `1000000`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    s.parse::<vpaged::config::ByteSize>().map(|b| b.0)
}

/// `n` bytes in the largest binary unit that divides it exactly (`2GiB`, `1536B`).
pub fn format_size(n: u64) -> String {
    for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n != 0 && n.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", n >> shift);
        }
    }
    format!("{n}B")
}

/// Where a profile file came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    File(PathBuf),
    /// Compiled into the binary from the repository's `profiles/NAME.yaml`.
    Builtin(&'static str),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File(p) => write!(f, "{}", p.display()),
            Origin::Builtin(n) => write!(f, "built-in profiles/{n}.yaml"),
        }
    }
}

/// Where one resolved setting came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Flag(&'static str),
    Env(&'static str),
    Profile(String),
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Flag(n) => write!(f, "flag {n}"),
            Source::Env(n) => write!(f, "env {n}"),
            Source::Profile(o) => write!(f, "profile {o}"),
            Source::Default => f.write_str("default"),
        }
    }
}

/// Sampling defaults for requests that leave them out (the server's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sampling {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
}

/// The resolved engine settings. Every one leaves arithmetic unchanged.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Settings {
    /// Always true: no lossy encoding exists.
    pub exact: bool,
    /// Bytes of memory for the whole process (weights held, KV, scratch, read
    /// buffers, the process itself): the memory planner's budget. `None`: the
    /// memory available when an engine opens, used only for a model that does not
    /// fit in it (see `cli::budget`).
    pub memory_budget: Option<u64>,
    /// Read the weights through the memory-mapped store whatever their size (the
    /// kernel pages them), with no memory planning.
    pub memory_mapped: bool,
    /// Bytes of an in-process page cache (vpaged store) for the weights; `None`: the
    /// embedded memory-mapped store. That cache verifies every page it loads against
    /// the manifest, whatever `verify` says.
    pub cache_budget: Option<u64>,
    /// A directory on faster storage than the model's (an internal SSD under a model
    /// on a USB disk or a NAS) where a page cache keeps copies of the pages the
    /// planner cannot pin, so their reads leave the slow tier.
    pub fast_tier: Option<PathBuf>,
    /// Bytes the fast tier may hold (default: nine tenths of its free space).
    pub fast_tier_size: Option<u64>,
    pub pin_first_layers: u32,
    pub pin_last_layers: u32,
    pub prefetch_depth: usize,
    /// Reads of model files in flight for an in-process page cache (its reader
    /// threads; 0: each page read on the thread that needs it).
    pub read_threads: usize,
    /// Bytes of one of those reads (a page is read as pieces of it at once).
    pub read_piece: u64,
    /// Decoder layers of vpack bodies read ahead of their pages' cache slots (the
    /// largest layer's bodies each; 0: none, a body is read when its page loads).
    pub read_ahead_layers: usize,
    /// Predict each layer of routed experts' picks from the hidden state a layer
    /// before and hint them (a mixture of experts; opt-in until shown to help).
    pub expert_prefetch: bool,
    /// Bytes of KV pages kept in memory; pages beyond spill to `$VOOM_HOME/kv`
    /// (`None`: no budget, or under a `memory_budget` the KV it plans).
    pub kv_budget: Option<u64>,
    /// Bytes of prompt-prefix KV kept in memory for reuse; `None`:
    /// [`DEFAULT_PREFIX_CACHE`] without a memory budget, none within one.
    pub prefix_cache: Option<u64>,
    /// Bytes of prompt-prefix snapshots kept on disk under `$VOOM_HOME/prefixes`
    /// (0: none persisted); `None`: [`DEFAULT_PREFIX_DISK`] without a memory
    /// budget, none within one.
    pub prefix_disk: Option<u64>,
    /// Prompt prefixes of fewer tokens are not persisted.
    pub prefix_disk_min: usize,
    pub max_context: Option<usize>,
    /// Compute threads (0: all cores).
    pub threads: usize,
    /// The compute backend (`libvoom::backend::BackendKind::parse`): `cpu` (the
    /// fastest CPU kernels), `cpu-avx512`, `cpu-avx2`, `cpu-neon`, `cpu-portable`, or
    /// `mlx`.
    pub backend: String,
    pub verify: Verify,
    pub sampling: Sampling,
}

/// Bytes of prompt-prefix KV a process without a memory budget keeps for reuse.
pub const DEFAULT_PREFIX_CACHE: u64 = 256 << 20;
/// Bytes of prompt-prefix snapshots kept on disk.
pub const DEFAULT_PREFIX_DISK: u64 = 4 << 30;
/// Prompt prefixes of fewer tokens are not persisted.
pub const DEFAULT_PREFIX_DISK_MIN: usize = 1024;

impl Settings {
    /// Bytes of prompt-prefix snapshots to keep on disk: `prefix_disk`, else
    /// [`DEFAULT_PREFIX_DISK`] without a memory budget and none within one (as the
    /// prefix cache in memory, which a snapshot read back joins).
    pub fn prefix_disk_bytes(&self) -> u64 {
        self.prefix_disk.unwrap_or(if self.memory_budget.is_some() {
            0
        } else {
            DEFAULT_PREFIX_DISK
        })
    }

    /// Bytes of prompt-prefix KV to keep: `prefix_cache`, else
    /// [`DEFAULT_PREFIX_CACHE`] without a memory budget and none within one (the
    /// memory planner does not set it aside).
    pub fn prefix_cache_bytes(&self) -> u64 {
        self.prefix_cache
            .unwrap_or(if self.memory_budget.is_some() {
                0
            } else {
                DEFAULT_PREFIX_CACHE
            })
    }
}

impl Default for Settings {
    /// The built-in defaults (what `profiles/default.yaml` also states).
    fn default() -> Self {
        Settings {
            exact: true,
            memory_budget: None,
            memory_mapped: false,
            cache_budget: None,
            fast_tier: None,
            fast_tier_size: None,
            pin_first_layers: 0,
            pin_last_layers: 0,
            prefetch_depth: 1,
            read_threads: vpaged::read_pool::DEFAULT_THREADS,
            read_piece: vpaged::read_pool::DEFAULT_PIECE as u64,
            read_ahead_layers: vpaged::store::DEFAULT_READ_AHEAD_LAYERS,
            expert_prefetch: false,
            kv_budget: None,
            prefix_cache: None,
            prefix_disk: None,
            prefix_disk_min: DEFAULT_PREFIX_DISK_MIN,
            max_context: None,
            threads: 0,
            backend: "cpu".into(),
            verify: Verify::FirstUse,
            sampling: Sampling::default(),
        }
    }
}

/// A yes/no setting's value: `1`, `true`, `yes`, `on`, or `0`, `false`, `no`, `off`.
pub fn parse_bool(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!(
            "not a yes/no value (1/0, true/false, yes/no, on/off): '{s}'"
        )),
    }
}

/// The context a memory budget plans KV for: the KV of this many positions (the
/// model's maximum when that is less, `max_context` when set) is set aside, and
/// becomes the KV budget beyond which pages spill to disk.
pub const BUDGET_CONTEXT: usize = 4096;

impl Settings {
    /// The context limit for a model: `max_context`, else the model's own maximum
    /// (`None`). Neither `kv_budget` nor `memory_budget` bounds it: KV beyond its
    /// budget spills to disk ([`libvoom::kv::spill`]).
    pub fn max_context_for(
        &self,
        _cfg: &libvoom::config::ModelConfig,
    ) -> Result<Option<usize>, ProfileError> {
        Ok(self.max_context)
    }
}

/// Values given outside profiles for one run: CLI flags, or environment variables.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    pub memory_budget: Option<u64>,
    pub memory_mapped: Option<bool>,
    pub cache_budget: Option<u64>,
    pub fast_tier: Option<PathBuf>,
    pub fast_tier_size: Option<u64>,
    pub pin_first_layers: Option<u32>,
    pub pin_last_layers: Option<u32>,
    pub prefetch_depth: Option<usize>,
    pub read_threads: Option<usize>,
    pub read_piece: Option<u64>,
    pub read_ahead_layers: Option<usize>,
    pub expert_prefetch: Option<bool>,
    pub kv_budget: Option<u64>,
    pub prefix_cache: Option<u64>,
    pub prefix_disk: Option<u64>,
    pub prefix_disk_min: Option<usize>,
    pub max_context: Option<usize>,
    pub threads: Option<usize>,
    pub backend: Option<String>,
    pub verify: Option<Verify>,
}

/// Per setting: its profile key, flag and environment variable.
const NAMES: &[(&str, &str, &str)] = &[
    ("memory_budget", "--memory-budget", "VOOM_MEMORY_BUDGET"),
    ("memory_mapped", "--memory-mapped", "VOOM_MEMORY_MAPPED"),
    ("cache_budget", "--cache-budget", "VOOM_CACHE_BUDGET"),
    ("fast_tier", "--fast-tier", "VOOM_FAST_TIER"),
    ("fast_tier_size", "--fast-tier-size", "VOOM_FAST_TIER_SIZE"),
    (
        "pin_first_layers",
        "--pin-first-layers",
        "VOOM_PIN_FIRST_LAYERS",
    ),
    (
        "pin_last_layers",
        "--pin-last-layers",
        "VOOM_PIN_LAST_LAYERS",
    ),
    ("prefetch_depth", "--prefetch-depth", "VOOM_PREFETCH_DEPTH"),
    ("read_threads", "--read-threads", "VOOM_READ_THREADS"),
    ("read_piece", "--read-piece", "VOOM_READ_PIECE"),
    (
        "read_ahead_layers",
        "--read-ahead-layers",
        "VOOM_READ_AHEAD_LAYERS",
    ),
    (
        "expert_prefetch",
        "--expert-prefetch",
        "VOOM_EXPERT_PREFETCH",
    ),
    ("kv_budget", "--kv-budget", "VOOM_KV_BUDGET"),
    ("prefix_cache", "--prefix-cache", "VOOM_PREFIX_CACHE"),
    ("prefix_disk", "--prefix-disk", "VOOM_PREFIX_DISK"),
    (
        "prefix_disk_min",
        "--prefix-disk-min",
        "VOOM_PREFIX_DISK_MIN",
    ),
    ("max_context", "--max-context", "VOOM_MAX_CONTEXT"),
    ("threads", "--threads", "VOOM_THREADS"),
    ("backend", "--backend", "VOOM_BACKEND"),
    ("verify", "--verify", "VOOM_VERIFY"),
];

fn names(key: &str) -> (&'static str, &'static str) {
    let (_, flag, env) = NAMES
        .iter()
        .find(|(k, _, _)| *k == key)
        .expect("every overridable key is in NAMES");
    (flag, env)
}

impl Overrides {
    /// The `VOOM_*` variables that `get` returns (empty values count as unset).
    /// Taking a lookup function keeps tests off the process environment.
    pub fn from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<Overrides, ProfileError> {
        fn read<T>(
            get: &dyn Fn(&str) -> Option<String>,
            key: &str,
            parse: impl Fn(&str) -> Result<T, String>,
        ) -> Result<Option<T>, ProfileError> {
            let var = names(key).1;
            match get(var) {
                Some(v) if !v.trim().is_empty() => {
                    parse(v.trim())
                        .map(Some)
                        .map_err(|detail| ProfileError::Env {
                            var,
                            value: v,
                            detail,
                        })
                }
                _ => Ok(None),
            }
        }
        let num = |s: &str| s.parse().map_err(|e| format!("not a count: {e}"));
        let num32 = |s: &str| s.parse().map_err(|e| format!("not a count: {e}"));
        Ok(Overrides {
            memory_budget: read(get, "memory_budget", parse_size)?,
            memory_mapped: read(get, "memory_mapped", parse_bool)?,
            cache_budget: read(get, "cache_budget", parse_size)?,
            fast_tier: read(get, "fast_tier", |s| Ok(PathBuf::from(s)))?,
            fast_tier_size: read(get, "fast_tier_size", parse_size)?,
            pin_first_layers: read(get, "pin_first_layers", num32)?,
            pin_last_layers: read(get, "pin_last_layers", num32)?,
            prefetch_depth: read(get, "prefetch_depth", num)?,
            read_threads: read(get, "read_threads", num)?,
            read_piece: read(get, "read_piece", parse_size)?,
            read_ahead_layers: read(get, "read_ahead_layers", num)?,
            expert_prefetch: read(get, "expert_prefetch", parse_bool)?,
            kv_budget: read(get, "kv_budget", parse_size)?,
            prefix_cache: read(get, "prefix_cache", parse_size)?,
            prefix_disk: read(get, "prefix_disk", parse_size)?,
            prefix_disk_min: read(get, "prefix_disk_min", num)?,
            max_context: read(get, "max_context", num)?,
            threads: read(get, "threads", num)?,
            backend: read(get, "backend", |s| {
                libvoom::backend::BackendKind::parse(s).map(|_| s.to_string())
            })?,
            verify: read(get, "verify", str::parse)?,
        })
    }
}

/// One profile file as written (every key optional).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileFile {
    inherits: Option<String>,
    notes: Option<String>,
    exact: Option<bool>,
    lossy: Option<bool>,
    memory_budget: Option<vpaged::config::ByteSize>,
    memory_mapped: Option<bool>,
    cache_budget: Option<vpaged::config::ByteSize>,
    fast_tier: Option<PathBuf>,
    fast_tier_size: Option<vpaged::config::ByteSize>,
    pin_first_layers: Option<u32>,
    pin_last_layers: Option<u32>,
    prefetch_depth: Option<usize>,
    read_threads: Option<usize>,
    read_piece: Option<vpaged::config::ByteSize>,
    read_ahead_layers: Option<usize>,
    expert_prefetch: Option<bool>,
    kv_budget: Option<vpaged::config::ByteSize>,
    prefix_cache: Option<vpaged::config::ByteSize>,
    prefix_disk: Option<vpaged::config::ByteSize>,
    prefix_disk_min: Option<usize>,
    max_context: Option<usize>,
    threads: Option<usize>,
    backend: Option<String>,
    verify: Option<String>,
    sampling: Option<Sampling>,
}

/// A profile file read and checked.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub name: String,
    pub origin: Origin,
    pub inherits: Option<String>,
    pub notes: Option<String>,
    file: ProfileFile,
}

/// Parses and checks one profile file's text; `file` names it in errors.
/// Collections nested deeper than this are refused before the YAML is parsed (a
/// profile nests two levels).
pub const MAX_NESTING: usize = 32;

/// Refuses YAML whose collections nest deeper than [`MAX_NESTING`], in one linear
/// pass, before the parser sees it: the YAML parser's work grows with the square
/// of the nesting (100,000 levels of `[` took 28 s of CPU to reject). Counted:
/// flow collections (`[`, `{`) outside quoted scalars and comments, and compact
/// block entries opened on one line (`- - - x`). Indented block nesting needs a
/// line per level, each longer than the last: the file's size bound keeps it
/// small. The count is conservative: a bracket in an unquoted scalar counts too.
fn check_nesting(text: &str) -> Result<(), String> {
    let deep = |line: usize, col: usize| {
        Err(format!(
            "line {line}, column {col}: collections nested more than {MAX_NESTING} deep"
        ))
    };
    let mut flow = 0usize;
    // Inside a quoted scalar (they may span lines): its quote character.
    let mut quote: Option<char> = None;
    for (ln, line) in text.lines().enumerate() {
        let mut prev = None::<char>; // the last character that was not a space
        let mut escaped = false;
        let mut compact = 0usize;
        let mut at_entry = true; // only indentation and compact entries so far
        let mut chars = line.char_indices().peekable();
        while let Some((col, c)) = chars.next() {
            if let Some(q) = quote {
                if escaped {
                    escaped = false;
                } else if q == '"' && c == '\\' {
                    escaped = true;
                } else if c == q {
                    quote = None;
                }
                prev = Some(c);
                continue;
            }
            let next_blank = chars.peek().is_none_or(|&(_, n)| n == ' ' || n == '\t');
            match c {
                ' ' | '\t' => continue,
                '#' if col == 0 || line[..col].ends_with([' ', '\t']) => break,
                '\'' | '"' if prev.is_none_or(|p| "[{,:-?".contains(p)) => quote = Some(c),
                '[' | '{' => {
                    flow += 1;
                    if flow > MAX_NESTING {
                        return deep(ln + 1, col + 1);
                    }
                }
                ']' | '}' => flow = flow.saturating_sub(1),
                '-' | '?' if at_entry && next_blank => {
                    compact += 1;
                    if compact > MAX_NESTING {
                        return deep(ln + 1, col + 1);
                    }
                }
                _ => {}
            }
            if !(matches!(c, '-' | '?') && at_entry && next_blank) {
                at_entry = false;
            }
            prev = Some(c);
        }
    }
    Ok(())
}

fn parse(text: &str, file: &str) -> Result<ProfileFile, ProfileError> {
    let invalid = |detail: String| ProfileError::Invalid {
        file: file.to_string(),
        detail,
    };
    check_nesting(text).map_err(invalid)?;
    let value: serde_norway::Value =
        serde_norway::from_str(text).map_err(|e| invalid(format!("not valid YAML: {e}")))?;
    let value = match value {
        // An empty file is an empty profile.
        serde_norway::Value::Null => serde_norway::Value::Mapping(Default::default()),
        v @ serde_norway::Value::Mapping(_) => v,
        _ => return Err(invalid("must be a mapping of keys to values".into())),
    };
    // Unknown keys first, by name, so a typo is reported as such.
    let check_keys = |map: &serde_norway::Mapping, known: &[&str], prefix: &str| {
        for k in map.keys() {
            let key = match k.as_str() {
                Some(s) => s.to_string(),
                None => format!("{k:?}"),
            };
            if !known.contains(&key.as_str()) {
                return Err(ProfileError::UnknownKey {
                    file: file.to_string(),
                    key: format!("{prefix}{key}"),
                    known: known.join(", "),
                });
            }
        }
        Ok(())
    };
    if let serde_norway::Value::Mapping(m) = &value {
        check_keys(m, KEYS, "")?;
        if let Some(serde_norway::Value::Mapping(s)) = m.get("sampling") {
            check_keys(s, SAMPLING_KEYS, "sampling.")?;
        }
    }
    let p: ProfileFile = match serde_norway::from_value(value.clone()) {
        Ok(p) => p,
        Err(e) => {
            // Name the key: the first one that fails on its own.
            let mut detail = e.to_string();
            if let serde_norway::Value::Mapping(m) = &value {
                for (k, v) in m {
                    let mut one = serde_norway::Mapping::new();
                    one.insert(k.clone(), v.clone());
                    let r = serde_norway::from_value::<ProfileFile>(one.into());
                    if let (Err(e), Some(k)) = (r, k.as_str()) {
                        detail = format!("{k}: {e}");
                        break;
                    }
                }
            }
            return Err(invalid(detail));
        }
    };
    if p.lossy == Some(true) {
        return Err(ProfileError::Lossy {
            file: file.to_string(),
        });
    }
    if p.exact == Some(false) {
        return Err(ProfileError::Lossy {
            file: file.to_string(),
        });
    }
    if let Some(v) = &p.verify {
        v.parse::<Verify>()
            .map_err(|e| invalid(format!("verify {e}")))?;
    }
    if let Some(b) = &p.backend {
        libvoom::backend::BackendKind::parse(b).map_err(|e| invalid(format!("backend: {e}")))?;
    }
    if p.memory_budget.is_some_and(|b| b.0 == 0) {
        return Err(invalid("memory_budget must be more than 0 bytes".into()));
    }
    if p.cache_budget.is_some_and(|b| b.0 == 0) {
        return Err(invalid("cache_budget must be more than 0 bytes".into()));
    }
    if p.fast_tier_size.is_some_and(|b| b.0 == 0) {
        return Err(invalid("fast_tier_size must be more than 0 bytes".into()));
    }
    if p.kv_budget.is_some_and(|b| b.0 == 0) {
        return Err(invalid("kv_budget must be more than 0 bytes".into()));
    }
    if p.max_context == Some(0) {
        return Err(invalid("max_context must be at least 1".into()));
    }
    if let Some(s) = &p.sampling {
        if let Some(t) = s.temperature {
            if !(t.is_finite() && t >= 0.0) {
                return Err(invalid(format!(
                    "sampling.temperature must be a number >= 0, not {t}"
                )));
            }
        }
        if let Some(t) = s.top_p {
            if !(t > 0.0 && t <= 1.0) {
                return Err(invalid(format!(
                    "sampling.top_p must be in (0, 1], not {t}"
                )));
            }
        }
    }
    if let Some(parent) = &p.inherits {
        check_name(parent).map_err(|_| {
            invalid(format!(
                "inherits '{parent}' is not a profile name (letters, digits, '-', '_', '.')"
            ))
        })?;
    }
    Ok(p)
}

fn check_name(name: &str) -> Result<(), ProfileError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(ProfileError::BadName {
            name: name.to_string(),
        })
    }
}

/// Where profiles are looked up: a directory (optional), then the built-in ones.
#[derive(Debug, Clone)]
pub struct ProfileDirs {
    dir: Option<PathBuf>,
}

impl ProfileDirs {
    /// `explicit` (`--profiles-dir` / `VOOM_PROFILES_DIR`) must be a directory;
    /// otherwise `home_profiles` (`$VOOM_HOME/profiles`) is used when it is one.
    pub fn new(
        explicit: Option<PathBuf>,
        home_profiles: Option<PathBuf>,
    ) -> Result<Self, ProfileError> {
        if let Some(d) = explicit {
            if !d.is_dir() {
                return Err(ProfileError::Dir {
                    dir: d,
                    detail: "does not exist or is not a directory".into(),
                });
            }
            return Ok(ProfileDirs { dir: Some(d) });
        }
        Ok(ProfileDirs {
            dir: home_profiles.filter(|d| d.is_dir()),
        })
    }

    /// Only the built-in profiles.
    #[cfg(test)]
    pub fn builtin_only() -> Self {
        ProfileDirs { dir: None }
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    fn looked(&self) -> String {
        match &self.dir {
            Some(d) => format!("{} and the built-in profiles", d.display()),
            None => "the built-in profiles".into(),
        }
    }

    /// The profile `name`: `dir/NAME.yaml` (or `.yml`) if present, else built-in.
    pub fn load(&self, name: &str) -> Result<Loaded, ProfileError> {
        check_name(name)?;
        if let Some(d) = &self.dir {
            for ext in ["yaml", "yml"] {
                let p = d.join(format!("{name}.{ext}"));
                if p.is_file() {
                    return load_file(&p, name);
                }
            }
        }
        if let Some((n, text)) = BUILTIN.iter().find(|(n, _)| *n == name) {
            let origin = Origin::Builtin(n);
            let file = parse(text, &origin.to_string())?;
            return Ok(Loaded::new(name, origin, file));
        }
        Err(ProfileError::NotFound {
            name: name.to_string(),
            looked: self.looked(),
            available: self.names()?.join(", "),
        })
    }

    /// Names of every profile found, sorted (a directory's shadow the built-ins).
    pub fn names(&self) -> Result<Vec<String>, ProfileError> {
        let mut out: Vec<String> = BUILTIN.iter().map(|(n, _)| n.to_string()).collect();
        if let Some(d) = &self.dir {
            let rd = std::fs::read_dir(d).map_err(|e| ProfileError::Io {
                path: d.clone(),
                source: e,
            })?;
            for e in rd.flatten() {
                let p = e.path();
                let is_yaml =
                    matches!(p.extension().and_then(|x| x.to_str()), Some("yaml" | "yml"));
                if let (true, Some(stem)) = (is_yaml, p.file_stem().and_then(|s| s.to_str())) {
                    if check_name(stem).is_ok() && !out.iter().any(|n| n == stem) {
                        out.push(stem.to_string());
                    }
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// Every profile found, read and checked (the first bad file is an error).
    pub fn list(&self) -> Result<Vec<Loaded>, ProfileError> {
        self.names()?.iter().map(|n| self.load(n)).collect()
    }

    /// A profile by name, or by the path of a YAML file (anything with a '/' or a
    /// `.yaml`/`.yml` ending); its parents are looked up by name.
    pub fn load_arg(&self, arg: &str) -> Result<Loaded, ProfileError> {
        let path = Path::new(arg);
        let is_path = arg.contains('/') || arg.ends_with(".yaml") || arg.ends_with(".yml");
        if is_path {
            let stem = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or(arg)
                .to_string();
            return load_file(path, &stem);
        }
        self.load(arg)
    }
}

/// The largest profile file read: profiles are a few lines.
pub const PROFILE_MAX_BYTES: u64 = 1 << 20;

fn load_file(path: &Path, name: &str) -> Result<Loaded, ProfileError> {
    let io = |source| ProfileError::Io {
        path: path.to_path_buf(),
        source,
    };
    // A regular file only (a FIFO or a device is refused, never read), bounded.
    let bytes = voom_formats::file::read_limited(path, PROFILE_MAX_BYTES).map_err(io)?;
    let text = String::from_utf8(bytes)
        .map_err(|e| io(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
    let file = parse(&text, &path.display().to_string())?;
    Ok(Loaded::new(name, Origin::File(path.to_path_buf()), file))
}

impl Loaded {
    fn new(name: &str, origin: Origin, file: ProfileFile) -> Self {
        Loaded {
            name: name.to_string(),
            origin,
            inherits: file.inherits.clone(),
            notes: file.notes.clone(),
            file,
        }
    }

    /// The first line of the notes (for listings).
    pub fn summary(&self) -> &str {
        self.notes
            .as_deref()
            .and_then(|n| n.lines().map(str::trim).find(|l| !l.is_empty()))
            .unwrap_or("")
    }
}

/// A profile resolved against flags and environment.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub name: String,
    pub origin: Origin,
    pub notes: Option<String>,
    /// The profile and its ancestors, child first.
    pub chain: Vec<String>,
    pub settings: Settings,
    /// Per setting key (`sampling.top_p` for sampling), where its value came from.
    pub sources: BTreeMap<String, Source>,
    /// blake3 of [`canonical_json`] of the settings, first 16 hex digits.
    pub digest: String,
    /// What resolving set aside, for the user to hear (a setting overridden by
    /// another of higher precedence that excludes it).
    pub warnings: Vec<String>,
}

/// `v` as JSON with object keys sorted at every level: one text per value.
pub fn canonical_json(v: &serde_json::Value) -> String {
    fn sorted(v: &serde_json::Value) -> serde_json::Value {
        match v {
            serde_json::Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                let mut out = serde_json::Map::new();
                for k in keys {
                    out.insert(k.clone(), sorted(&m[k]));
                }
                serde_json::Value::Object(out)
            }
            serde_json::Value::Array(a) => serde_json::Value::Array(a.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    sorted(v).to_string()
}

impl Resolved {
    /// The settings as a JSON object (sizes in bytes).
    pub fn settings_json(&self) -> serde_json::Value {
        serde_json::to_value(&self.settings).expect("settings serialize to JSON")
    }

    /// Sources as a JSON object of strings.
    pub fn sources_json(&self) -> serde_json::Value {
        self.sources
            .iter()
            .map(|(k, s)| (k.clone(), serde_json::Value::String(s.to_string())))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }

    /// Everything about the profile, for `voom profiles show --json`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.name,
            "digest": self.digest,
            "exact": self.settings.exact,
            "origin": self.origin.to_string(),
            "chain": self.chain,
            "notes": self.notes,
            "settings": self.settings_json(),
            "sources": self.sources_json(),
        })
    }
}

/// Resolves the profile `arg` (a name or a YAML path) under `dirs`, with `flags`
/// over `env` over the profile chain over the built-in defaults.
pub fn resolve(
    dirs: &ProfileDirs,
    arg: &str,
    flags: &Overrides,
    env: &Overrides,
) -> Result<Resolved, ProfileError> {
    let top = dirs.load_arg(arg)?;
    // The chain, child first; a name seen twice is a cycle.
    let mut chain = vec![top];
    let mut seen: HashSet<String> = HashSet::from([chain[0].name.clone()]);
    while let Some(parent) = chain.last().and_then(|l| l.inherits.clone()) {
        let child = chain.last().expect("chain is never empty");
        if !seen.insert(parent.clone()) {
            let mut names: Vec<&str> = chain.iter().map(|l| l.name.as_str()).collect();
            names.push(&parent);
            return Err(ProfileError::Cycle {
                chain: names.join(" -> "),
            });
        }
        let loaded = dirs.load(&parent).map_err(|e| match e {
            ProfileError::NotFound { .. } | ProfileError::BadName { .. } => {
                ProfileError::MissingParent {
                    file: child.origin.to_string(),
                    parent: parent.clone(),
                    detail: e.to_string(),
                }
            }
            other => other,
        })?;
        chain.push(loaded);
    }

    let mut s = Settings::default();
    let mut sources: BTreeMap<String, Source> = BTreeMap::new();
    // The profile's value of each key: the nearest file in the chain that sets it.
    macro_rules! from_profile {
        ($key:ident, $conv:expr) => {{
            chain.iter().find_map(|l| {
                l.file
                    .$key
                    .clone()
                    .map(|v| ($conv(v), Source::Profile(l.origin.to_string())))
            })
        }};
    }
    // One overridable setting: flag > env > profile > default.
    macro_rules! pick {
        ($key:ident, $conv:expr, $wrap:expr) => {{
            let (flag, env_var) = names(stringify!($key));
            let chosen = flags
                .$key
                .clone()
                .map(|v| (v, Source::Flag(flag)))
                .or_else(|| env.$key.clone().map(|v| (v, Source::Env(env_var))))
                .or_else(|| from_profile!($key, $conv));
            let source = match chosen {
                Some((v, source)) => {
                    s.$key = $wrap(v);
                    source
                }
                None => Source::Default,
            };
            sources.insert(stringify!($key).to_string(), source);
        }};
    }
    fn id<T>(v: T) -> T {
        v
    }
    let bytes = |b: vpaged::config::ByteSize| b.0;
    pick!(memory_budget, bytes, Some);
    pick!(memory_mapped, id, id);
    pick!(cache_budget, bytes, Some);
    pick!(fast_tier, id, Some);
    pick!(fast_tier_size, bytes, Some);
    pick!(pin_first_layers, id, id);
    pick!(pin_last_layers, id, id);
    pick!(prefetch_depth, id, id);
    pick!(read_threads, id, id);
    pick!(read_piece, bytes, id);
    pick!(read_ahead_layers, id, id);
    pick!(expert_prefetch, id, id);
    pick!(kv_budget, bytes, Some);
    pick!(prefix_cache, bytes, Some);
    pick!(prefix_disk, bytes, Some);
    pick!(prefix_disk_min, id, id);
    pick!(max_context, id, Some);
    pick!(threads, id, id);
    pick!(backend, id, id);
    // Checked when the file was parsed.
    let verify = |v: String| v.parse::<Verify>().unwrap_or(Verify::FirstUse);
    pick!(verify, verify, id);
    // Sampling is set by profiles only (requests set their own), field by field.
    for (key, l) in SAMPLING_KEYS.iter().flat_map(|k| {
        chain
            .iter()
            .find(|l| {
                l.file.sampling.is_some_and(|sm| match *k {
                    "temperature" => sm.temperature.is_some(),
                    "top_p" => sm.top_p.is_some(),
                    _ => sm.top_k.is_some(),
                })
            })
            .map(|l| (*k, l))
    }) {
        let sm = l.file.sampling.expect("found above");
        match key {
            "temperature" => s.sampling.temperature = sm.temperature,
            "top_p" => s.sampling.top_p = sm.top_p,
            _ => s.sampling.top_k = sm.top_k,
        }
        sources.insert(
            format!("sampling.{key}"),
            Source::Profile(l.origin.to_string()),
        );
    }
    for k in SAMPLING_KEYS {
        sources
            .entry(format!("sampling.{k}"))
            .or_insert(Source::Default);
    }
    sources.insert("exact".into(), Source::Default);
    let warnings = one_store_choice(&mut s, &mut sources, &chain)?;

    let json = serde_json::to_value(&s).expect("settings serialize to JSON");
    let digest = blake3::hash(canonical_json(&json).as_bytes()).to_hex()[..16].to_string();
    let top = &chain[0];
    Ok(Resolved {
        name: top.name.clone(),
        origin: top.origin.clone(),
        notes: top.notes.clone(),
        chain: chain.iter().map(|l| l.name.clone()).collect(),
        settings: s,
        sources,
        digest,
        warnings,
    })
}

/// Of `memory_budget`, `cache_budget` and `memory_mapped`, which exclude one
/// another, keeps the one given with the highest precedence (flag, environment, the
/// nearest profile of the chain: a child's over its parent's) and unsets the others,
/// returning a warning that names them; two at the top level are an error naming
/// them.
fn one_store_choice(
    s: &mut Settings,
    sources: &mut BTreeMap<String, Source>,
    chain: &[Loaded],
) -> Result<Vec<String>, ProfileError> {
    let rank = |src: &Source| -> usize {
        match src {
            Source::Flag(_) => usize::MAX,
            Source::Env(_) => usize::MAX - 1,
            Source::Profile(origin) => {
                let depth = chain
                    .iter()
                    .position(|l| l.origin.to_string() == *origin)
                    .unwrap_or(chain.len());
                1 + chain.len() - depth
            }
            Source::Default => 0,
        }
    };
    let mut given: Vec<(&str, Source)> = [
        ("memory_budget", s.memory_budget.is_some()),
        ("cache_budget", s.cache_budget.is_some()),
        ("memory_mapped", s.memory_mapped),
    ]
    .into_iter()
    .filter(|(_, set)| *set)
    .map(|(k, _)| (k, sources.get(k).cloned().unwrap_or(Source::Default)))
    .collect();
    if given.len() < 2 {
        return Ok(Vec::new());
    }
    given.sort_by_key(|(_, src)| std::cmp::Reverse(rank(src)));
    let named = |g: &[(&str, Source)]| {
        g.iter()
            .map(|(k, src)| format!("{k} ({src})"))
            .collect::<Vec<_>>()
            .join(" and ")
    };
    if rank(&given[0].1) == rank(&given[1].1) {
        let top = rank(&given[0].1);
        let tied: Vec<(&str, Source)> = given
            .iter()
            .filter(|(_, src)| rank(src) == top)
            .cloned()
            .collect();
        return Err(ProfileError::StoreConflict { set: named(&tied) });
    }
    let warning = format!(
        "{} ({}) is used and {} ignored",
        given[0].0,
        given[0].1,
        named(&given[1..])
    );
    for (k, _) in &given[1..] {
        match *k {
            "memory_budget" => s.memory_budget = None,
            "cache_budget" => s.cache_budget = None,
            _ => s.memory_mapped = false,
        }
        sources.insert(k.to_string(), Source::Default);
    }
    Ok(vec![warning])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(files: &[(&str, &str)]) -> (tempfile::TempDir, ProfileDirs) {
        let d = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(d.path().join(name), text).unwrap();
        }
        let dirs = ProfileDirs::new(Some(d.path().to_path_buf()), None).unwrap();
        (d, dirs)
    }

    fn none() -> Overrides {
        Overrides::default()
    }

    /// Budgets do not bound the context: KV beyond its budget spills to disk.
    #[test]
    fn budgets_do_not_bound_the_context() {
        let cfg = libvoom::config::ModelConfig::from_dir(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny/llama_gqa_untied"),
        )
        .unwrap();
        let budgeted = Settings {
            memory_budget: Some(1 << 30),
            kv_budget: Some(1),
            ..Settings::default()
        };
        assert_eq!(budgeted.max_context_for(&cfg).unwrap(), None);
        let with_max = Settings {
            max_context: Some(100),
            ..budgeted.clone()
        };
        assert_eq!(with_max.max_context_for(&cfg).unwrap(), Some(100));
    }

    #[test]
    fn builtin_profiles_parse_and_resolve() {
        let dirs = ProfileDirs::builtin_only();
        assert_eq!(
            dirs.names().unwrap(),
            vec!["default", "low-memory", "throughput"]
        );
        for l in dirs.list().unwrap() {
            assert!(!l.summary().is_empty(), "{} has no notes", l.name);
            let r = resolve(&dirs, &l.name, &none(), &none()).unwrap();
            assert!(r.settings.exact);
        }
        // The default profile states the built-in defaults.
        let d = resolve(&dirs, "default", &none(), &none()).unwrap();
        assert_eq!(d.settings, Settings::default());
        assert_eq!(
            d.sources["threads"].to_string(),
            "profile built-in profiles/default.yaml"
        );
        assert_eq!(d.sources["cache_budget"], Source::Default);
    }

    #[test]
    fn inherits_takes_the_parent_values_and_overrides_them() {
        let dirs = ProfileDirs::builtin_only();
        let r = resolve(&dirs, "low-memory", &none(), &none()).unwrap();
        assert_eq!(r.chain, vec!["low-memory", "default"]);
        assert_eq!(r.settings.cache_budget, Some(2 << 30));
        assert_eq!(r.settings.kv_budget, Some(512 << 20));
        assert_eq!(r.settings.pin_first_layers, 1);
        assert_eq!(r.settings.verify, Verify::FirstUse);
        assert_eq!(
            r.sources["cache_budget"].to_string(),
            "profile built-in profiles/low-memory.yaml"
        );
        assert_eq!(
            r.sources["verify"].to_string(),
            "profile built-in profiles/default.yaml"
        );
        assert_eq!(r.sources["max_context"], Source::Default);
        // Three levels, in a directory, with the built-in default as the root.
        let (_d, dirs) = dir_with(&[
            ("a.yaml", "inherits: b\nthreads: 3\nsampling: {temperature: 0.5}\n"),
            ("b.yml", "inherits: low-memory\nthreads: 2\nprefetch_depth: 4\nsampling: {top_k: 7, temperature: 0.9}\n"),
        ]);
        let r = resolve(&dirs, "a", &none(), &none()).unwrap();
        assert_eq!(r.chain, vec!["a", "b", "low-memory", "default"]);
        assert_eq!(r.settings.threads, 3);
        assert_eq!(r.settings.prefetch_depth, 4);
        assert_eq!(r.settings.cache_budget, Some(2 << 30));
        assert_eq!(r.settings.sampling.temperature, Some(0.5));
        assert_eq!(r.settings.sampling.top_k, Some(7));
        assert_eq!(r.settings.sampling.top_p, None);
        assert!(r.sources["sampling.top_k"].to_string().ends_with("b.yml"));
        assert!(r.sources["sampling.temperature"]
            .to_string()
            .ends_with("a.yaml"));
        assert_eq!(r.sources["sampling.top_p"], Source::Default);
    }

    #[test]
    fn a_directory_profile_shadows_the_builtin_one() {
        let (_d, dirs) = dir_with(&[("default.yaml", "threads: 5\n")]);
        let r = resolve(&dirs, "low-memory", &none(), &none()).unwrap();
        assert_eq!(r.settings.threads, 5);
        assert_eq!(r.settings.verify, Verify::FirstUse);
        assert_eq!(r.sources["verify"], Source::Default);
    }

    #[test]
    fn an_inherits_cycle_is_an_error() {
        let (_d, dirs) = dir_with(&[
            ("a.yaml", "inherits: b\n"),
            ("b.yaml", "inherits: c\n"),
            ("c.yaml", "inherits: a\n"),
            ("self.yaml", "inherits: self\n"),
        ]);
        let e = resolve(&dirs, "a", &none(), &none()).unwrap_err();
        assert!(matches!(e, ProfileError::Cycle { .. }), "{e}");
        assert!(e.to_string().contains("a -> b -> c -> a"), "{e}");
        let e = resolve(&dirs, "self", &none(), &none()).unwrap_err();
        assert!(e.to_string().contains("self -> self"), "{e}");
    }

    #[test]
    fn a_missing_parent_is_an_error_naming_the_file() {
        let (d, dirs) = dir_with(&[("orphan.yaml", "inherits: nowhere\n")]);
        let e = resolve(&dirs, "orphan", &none(), &none()).unwrap_err();
        assert!(matches!(e, ProfileError::MissingParent { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("nowhere"), "{msg}");
        assert!(
            msg.contains(&d.path().join("orphan.yaml").display().to_string()),
            "{msg}"
        );
    }

    #[test]
    fn unknown_keys_are_errors_naming_file_and_key() {
        let (d, dirs) = dir_with(&[
            ("typo.yaml", "prefetch_dpeth: 2\n"),
            ("deep.yaml", "sampling:\n  temprature: 0.3\n"),
        ]);
        let e = resolve(&dirs, "typo", &none(), &none()).unwrap_err();
        match &e {
            ProfileError::UnknownKey { file, key, .. } => {
                assert_eq!(key, "prefetch_dpeth");
                assert_eq!(file, &d.path().join("typo.yaml").display().to_string());
            }
            other => panic!("{other}"),
        }
        let e = resolve(&dirs, "deep", &none(), &none()).unwrap_err();
        assert!(e.to_string().contains("'sampling.temprature'"), "{e}");
    }

    #[test]
    fn bad_values_are_errors() {
        let cases = [
            ("verify: sometimes\n", "verify"),
            ("backend: metal\n", "backend"),
            ("cache_budget: 2QiB\n", "unknown byte unit"),
            ("cache_budget: 0\n", "cache_budget"),
            ("threads: -1\n", "threads"),
            ("threads: [1]\n", "threads"),
            ("sampling: {top_p: 1.5}\n", "top_p"),
            ("sampling: {temperature: -1}\n", "temperature"),
            ("- a\n- b\n", "mapping"),
            ("threads: 1\nthreads: 2\n", "duplicate"),
            ("inherits: ../etc/x\n", "inherits"),
            ("notes: [unclosed\n", "YAML"),
        ];
        for (text, want) in cases {
            let (_d, dirs) = dir_with(&[("bad.yaml", text)]);
            let e = resolve(&dirs, "bad", &none(), &none()).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains("bad.yaml"), "{text:?}: {msg}");
            assert!(msg.contains(want), "{text:?}: {msg}");
        }
    }

    #[test]
    fn lossy_profiles_are_refused() {
        let (_d, dirs) = dir_with(&[
            ("l.yaml", "inherits: default\nlossy: true\n"),
            ("x.yaml", "exact: false\n"),
            ("ok.yaml", "exact: true\nlossy: false\n"),
        ]);
        for n in ["l", "x"] {
            let e = resolve(&dirs, n, &none(), &none()).unwrap_err();
            assert!(
                e.to_string().contains("no lossy encodings are implemented"),
                "{e}"
            );
        }
        assert!(
            resolve(&dirs, "ok", &none(), &none())
                .unwrap()
                .settings
                .exact
        );
    }

    #[test]
    fn missing_profiles_and_bad_names_are_errors() {
        let dirs = ProfileDirs::builtin_only();
        let e = resolve(&dirs, "nope", &none(), &none()).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("no profile 'nope'") && msg.contains("low-memory"),
            "{msg}"
        );
        let e = resolve(&dirs, "..", &none(), &none()).unwrap_err();
        assert!(matches!(e, ProfileError::BadName { .. }), "{e}");
        let e = ProfileDirs::new(Some("/no/such/dir".into()), None).unwrap_err();
        assert!(e.to_string().contains("/no/such/dir"), "{e}");
        // A missing $VOOM_HOME/profiles is not an error: only the built-ins are used.
        let d = ProfileDirs::new(None, Some("/no/such/dir".into())).unwrap();
        assert!(d.dir().is_none());
    }

    #[test]
    fn a_profile_can_be_a_file_path() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("mine.yaml");
        std::fs::write(&p, "inherits: throughput\nthreads: 2\n").unwrap();
        let r = resolve(
            &ProfileDirs::builtin_only(),
            p.to_str().unwrap(),
            &none(),
            &none(),
        )
        .unwrap();
        assert_eq!(r.name, "mine");
        assert_eq!(r.settings.prefetch_depth, 2);
        assert_eq!(r.settings.threads, 2);
    }

    #[test]
    fn precedence_is_flag_then_env_then_profile_then_default() {
        let dirs = ProfileDirs::builtin_only();
        let flags = Overrides {
            threads: Some(3),
            cache_budget: Some(1 << 30),
            ..Overrides::default()
        };
        let env = Overrides::from_env(&|k| match k {
            "VOOM_THREADS" => Some("7".into()),
            "VOOM_PREFETCH_DEPTH" => Some("5".into()),
            "VOOM_MAX_CONTEXT" => Some("".into()),
            "VOOM_VERIFY" => Some("eager".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(env.max_context, None, "an empty variable is unset");
        let r = resolve(&dirs, "low-memory", &flags, &env).unwrap();
        // Flag over env (threads) and over profile (cache_budget).
        assert_eq!(r.settings.threads, 3);
        assert_eq!(r.sources["threads"], Source::Flag("--threads"));
        assert_eq!(r.settings.cache_budget, Some(1 << 30));
        assert_eq!(r.sources["cache_budget"], Source::Flag("--cache-budget"));
        // Env over profile.
        assert_eq!(r.settings.prefetch_depth, 5);
        assert_eq!(
            r.sources["prefetch_depth"],
            Source::Env("VOOM_PREFETCH_DEPTH")
        );
        assert_eq!(r.settings.verify, Verify::Eager);
        // Profile over default.
        assert_eq!(r.settings.kv_budget, Some(512 << 20));
        assert!(matches!(r.sources["kv_budget"], Source::Profile(_)));
        // Default.
        assert_eq!(r.settings.max_context, None);
        assert_eq!(r.sources["max_context"], Source::Default);
        // Different settings, different digests; the same settings, the same digest.
        let plain = resolve(&dirs, "low-memory", &none(), &none()).unwrap();
        assert_ne!(r.digest, plain.digest);
        assert_eq!(
            plain.digest,
            resolve(&dirs, "low-memory", &none(), &none())
                .unwrap()
                .digest
        );
        assert_eq!(plain.digest.len(), 16);
        // The digest is of the canonical settings JSON.
        assert_eq!(
            plain.digest,
            blake3::hash(canonical_json(&plain.settings_json()).as_bytes()).to_hex()[..16]
        );
    }

    /// The in-process page cache's reads in flight: a profile sets them, the
    /// environment and flags override them, and the defaults are the reader pool's.
    #[test]
    fn read_threads_and_pieces_resolve_like_every_setting() {
        let plain = resolve(&ProfileDirs::builtin_only(), "default", &none(), &none()).unwrap();
        assert_eq!(
            (plain.settings.read_threads, plain.settings.read_piece),
            (
                vpaged::read_pool::DEFAULT_THREADS,
                vpaged::read_pool::DEFAULT_PIECE as u64
            )
        );
        let (_d, dirs) = dir_with(&[(
            "io.yaml",
            "read_threads: 4
read_piece: 8MiB
",
        )]);
        let r = resolve(&dirs, "io", &none(), &none()).unwrap();
        assert_eq!(
            (r.settings.read_threads, r.settings.read_piece),
            (4, 8 << 20)
        );
        assert!(matches!(r.sources["read_piece"], Source::Profile(_)));
        assert_ne!(r.digest, plain.digest);
        let env =
            Overrides::from_env(&|k| (k == "VOOM_READ_PIECE").then(|| "4MiB".into())).unwrap();
        let flags = Overrides {
            read_threads: Some(2),
            ..Overrides::default()
        };
        let r = resolve(&dirs, "io", &flags, &env).unwrap();
        assert_eq!(
            (r.settings.read_threads, r.settings.read_piece),
            (2, 4 << 20)
        );
        assert_eq!(r.sources["read_threads"], Source::Flag("--read-threads"));
        assert_eq!(r.sources["read_piece"], Source::Env("VOOM_READ_PIECE"));
        let e =
            Overrides::from_env(&|k| (k == "VOOM_READ_PIECE").then(|| "big".into())).unwrap_err();
        assert!(e.to_string().contains("VOOM_READ_PIECE='big'"), "{e}");
    }

    #[test]
    fn bad_environment_values_name_the_variable() {
        let e =
            Overrides::from_env(&|k| (k == "VOOM_KV_BUDGET").then(|| "lots".into())).unwrap_err();
        assert!(e.to_string().contains("VOOM_KV_BUDGET='lots'"), "{e}");
        let e = Overrides::from_env(&|k| (k == "VOOM_VERIFY").then(|| "never".into())).unwrap_err();
        assert!(e.to_string().contains("VOOM_VERIFY"), "{e}");
        let e =
            Overrides::from_env(&|k| (k == "VOOM_BACKEND").then(|| "metal".into())).unwrap_err();
        assert!(e.to_string().contains("VOOM_BACKEND='metal'"), "{e}");
    }

    /// The backend is a setting like the others: flag over environment over
    /// profile over the built-in `cpu`, each source recorded.
    #[test]
    fn the_backend_comes_from_flag_env_or_profile() {
        let (_d, dirs) = dir_with(&[("p.yaml", "backend: cpu-portable\n")]);
        let r = resolve(&dirs, "p", &none(), &none()).unwrap();
        assert_eq!(r.settings.backend, "cpu-portable");
        let env = Overrides::from_env(&|k| (k == "VOOM_BACKEND").then(|| "cpu".into())).unwrap();
        let r = resolve(&dirs, "p", &none(), &env).unwrap();
        assert_eq!(r.settings.backend, "cpu");
        assert_eq!(r.sources["backend"].to_string(), "env VOOM_BACKEND");
        let flags = Overrides {
            backend: Some("cpu-portable".into()),
            ..Overrides::default()
        };
        let r = resolve(&dirs, "p", &flags, &env).unwrap();
        assert_eq!(r.sources["backend"].to_string(), "flag --backend");
        let r = resolve(&dirs, "default", &none(), &none()).unwrap();
        assert_eq!(r.settings.backend, "cpu");
    }

    #[test]
    fn sizes_parse_and_format() {
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("2 parsecs").is_err());
        assert_eq!(format_size(2 << 30), "2GiB");
        assert_eq!(format_size(1536), "1536B");
        assert_eq!(format_size(3 << 10), "3KiB");
        assert_eq!(format_size(0), "0B");
        // A YAML size may be a string with a unit or a plain number of bytes.
        let (_d, dirs) = dir_with(&[("s.yaml", "cache_budget: 1048576\nkv_budget: 1.5MiB\n")]);
        let r = resolve(&dirs, "s", &none(), &none()).unwrap();
        assert_eq!(r.settings.cache_budget, Some(1 << 20));
        assert_eq!(r.settings.kv_budget, Some(3 << 19));
    }

    #[test]
    fn canonical_json_sorts_keys_at_every_level() {
        let a = serde_json::json!({"b": 1, "a": {"d": [1, {"z": 0, "y": 1}], "c": null}});
        assert_eq!(
            canonical_json(&a),
            r#"{"a":{"c":null,"d":[1,{"y":1,"z":0}]},"b":1}"#
        );
    }
}

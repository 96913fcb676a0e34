//! Pieces shared by the generating commands: engine options, sampling flags,
//! prompt building, streaming output.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use clap::Args;
use libvoom::draft::DraftModel;
use libvoom::engine::{Decoding, Engine, EngineOptions, GenerateParams, Generation, MAX_DRAFT};
use libvoom::mtp::MtpDrafter;
use libvoom::sampler::SamplingParams;
use libvoom::speculate::lookup::PromptLookup;
use libvoom::speculate::Drafter;
use libvoom::text::StreamDecoder;
use vpaged::store::{Store, StoreConfig, StoreSource};

use crate::cli::budget;
use crate::profile::{self, Overrides, ProfileDirs, Resolved, Settings, Verify};
use crate::store;

/// Engine settings. The profile's values apply where neither a flag nor its `VOOM_*`
/// variable is given (see [`crate::profile`]); defaults below are the built-in ones.
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Runtime profile: a name (profiles/NAME.yaml) or the path of a YAML file.
    #[arg(long, env = "VOOM_PROFILE", default_value = profile::DEFAULT_PROFILE)]
    pub profile: String,
    /// Directory of profiles (default: $VOOM_HOME/profiles when it exists; the
    /// shipped profiles are always available).
    #[arg(long, env = "VOOM_PROFILES_DIR")]
    pub profiles_dir: Option<PathBuf>,
    /// Compute threads, 0 for all cores [env: VOOM_THREADS] [default: 0].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Verify pages against the manifest: off, first-use or eager [env: VOOM_VERIFY]
    /// [default: first-use].
    #[arg(long)]
    pub verify: Option<Verify>,
    /// Longest context (prompt + generated) in tokens [env: VOOM_MAX_CONTEXT]
    /// [default: the model's].
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Compute backend: `cpu` (the fastest CPU kernels this machine has, the
    /// default), `cpu-avx512`, `cpu-avx2` (x86_64), `cpu-neon` (aarch64), `cpu-portable`
    /// (all the same bits), or
    /// `mlx` (MLX on its default device: Metal on Apple Silicon; in builds with
    /// the `mlx` feature). Every response names the backend.
    /// [env: VOOM_BACKEND] [profile: backend] [default: cpu]
    #[arg(long, value_parser = parse_backend)]
    pub backend: Option<libvoom::backend::BackendKind>,
    /// Positions per KV page (what a page of the KV budget spills and reads back;
    /// results do not depend on it) [default: 128].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub kv_page_positions: Option<u32>,
    /// Get pages from the vpaged daemon at this socket instead of the embedded store.
    #[arg(long, env = "VOOM_VPAGED")]
    pub vpaged: Option<PathBuf>,
    /// If the daemon cannot be reached, use the embedded store (with a warning).
    #[arg(long, env = "VOOM_VPAGED_FALLBACK")]
    pub vpaged_fallback: bool,
    /// Decoder layers hinted to the page source ahead of the one computing, 0 for off
    /// [env: VOOM_PREFETCH_DEPTH] [default: 1].
    #[arg(long)]
    pub prefetch_depth: Option<usize>,
    /// Reads of model files in flight for an in-process page cache (0: each page on
    /// the thread that needs it) [env: VOOM_READ_THREADS] [default: 16].
    #[arg(long)]
    pub read_threads: Option<usize>,
    /// Bytes of one such read, e.g. 4MiB: a page is read as pieces of it at once
    /// [env: VOOM_READ_PIECE] [default: 2MiB].
    #[arg(long, value_parser = profile::parse_size)]
    pub read_piece: Option<u64>,
    /// Decoder layers of vpack bodies an in-process page cache reads ahead of their
    /// pages' slots, while earlier ones decode (the largest layer's bodies each, set
    /// aside from the budget; 0: none) [env: VOOM_READ_AHEAD_LAYERS] [default: 2].
    #[arg(long)]
    pub read_ahead_layers: Option<usize>,
    /// Memory for the whole process, e.g. 4GiB: the memory planner sets aside KV,
    /// scratch, read buffers and the process, and memory-maps the model if it fits,
    /// else pins what saves the most reads in a page cache of the rest and streams
    /// the others; too little to stream is an error saying how much is needed
    /// [env: VOOM_MEMORY_BUDGET] [default: the memory available, used only for a
    /// model that does not fit in it].
    #[arg(long, value_parser = profile::parse_size)]
    pub memory_budget: Option<u64>,
    /// Read the weights through the memory-mapped store whatever their size, the
    /// kernel paging them, with no memory planning (the naive baseline)
    /// [env: VOOM_MEMORY_MAPPED=1].
    #[arg(long)]
    pub memory_mapped: bool,
    /// Predict each layer of routed experts' picks from the hidden state a layer
    /// before and hint them while that layer computes (a mixture of experts; opt-in:
    /// it never changes results, and on the benchmarks here it has not shown a gain
    /// yet) [env: VOOM_EXPERT_PREFETCH=1].
    #[arg(long)]
    pub expert_prefetch: bool,
    /// Bytes of an in-process page cache for the weights, e.g. 4GiB, as given
    /// rather than planned from a memory budget (needs the model's page manifest)
    /// [env: VOOM_CACHE_BUDGET] [default: none].
    #[arg(long, value_parser = profile::parse_size)]
    pub cache_budget: Option<u64>,
    /// A directory on faster storage than the model's where a page cache keeps
    /// copies of the pages the memory planner cannot pin, so that their reads leave
    /// the slow tier (copies are verified whenever read) [env: VOOM_FAST_TIER]
    /// [default: none].
    #[arg(long)]
    pub fast_tier: Option<PathBuf>,
    /// Bytes the fast tier may hold [env: VOOM_FAST_TIER_SIZE] [default: nine
    /// tenths of the free space where it is].
    #[arg(long, value_parser = profile::parse_size)]
    pub fast_tier_size: Option<u64>,
    /// Keep the first N decoder layers resident in the page cache
    /// [env: VOOM_PIN_FIRST_LAYERS] [default: 0].
    #[arg(long)]
    pub pin_first_layers: Option<u32>,
    /// Keep the last N decoder layers resident in the page cache
    /// [env: VOOM_PIN_LAST_LAYERS] [default: 0].
    #[arg(long)]
    pub pin_last_layers: Option<u32>,
    /// Bytes of KV cache, e.g. 512MiB; bounds the context [env: VOOM_KV_BUDGET]
    /// [default: none].
    #[arg(long, value_parser = profile::parse_size)]
    pub kv_budget: Option<u64>,
    /// Bytes of prompt-prefix KV kept in memory, so that a prompt repeating or
    /// extending one already computed computes only what is new; 0 keeps none
    /// [env: VOOM_PREFIX_CACHE] [default: 256MiB, none with a memory budget].
    #[arg(long, value_parser = profile::parse_size)]
    pub prefix_cache: Option<u64>,
    /// Bytes of prompt-prefix snapshots kept on disk under `$VOOM_HOME/prefixes`, so
    /// that a restarted process reuses long prompts computed before; 0 persists none
    /// [env: VOOM_PREFIX_DISK] [default: 4GiB, none with a memory budget].
    #[arg(long, value_parser = profile::parse_size)]
    pub prefix_disk: Option<u64>,
    /// Prompt prefixes of fewer tokens are not persisted [env: VOOM_PREFIX_DISK_MIN]
    /// [default: 1024].
    #[arg(long)]
    pub prefix_disk_min: Option<usize>,
    /// The profile resolved once for a long-lived process (the server), so every
    /// engine it opens uses, and reports, the same settings.
    #[arg(skip)]
    pub resolved: Option<Arc<Resolved>>,
}

/// The profile of the engine most recently opened by [`open_engine`], which
/// [`result_json`] reports (one-shot commands open one engine).
static OPENED_PROFILE: Mutex<Option<Arc<Resolved>>> = Mutex::new(None);

/// Smallest and largest `read_piece`: one direct-read alignment unit, and a piece
/// whose bounce buffer (one per reader) is still a small part of a budget.
const READ_PIECE_RANGE: (u64, u64) = (16 << 10, 256 << 20);

/// The in-process page cache's reads in flight, from the settings.
fn read_io(s: &Settings) -> Result<vpaged::store::IoConfig> {
    let (lo, hi) = READ_PIECE_RANGE;
    if !(lo..=hi).contains(&s.read_piece) {
        bail!(
            "read_piece {} is outside {}..={} (each reader holds a buffer of one piece)",
            profile::format_size(s.read_piece),
            profile::format_size(lo),
            profile::format_size(hi)
        );
    }
    if s.read_threads > 1024 {
        bail!(
            "read_threads {} is more than 1024 reader threads",
            s.read_threads
        );
    }
    Ok(vpaged::store::IoConfig {
        read_threads: s.read_threads,
        read_piece: s.read_piece as usize,
        read_ahead_layers: s.read_ahead_layers,
        ..vpaged::store::IoConfig::default()
    })
}

/// A `--backend` name this machine has.
pub fn parse_backend(s: &str) -> Result<libvoom::backend::BackendKind, String> {
    libvoom::backend::BackendKind::parse(s)
}

impl EngineArgs {
    /// The values given by flags.
    pub fn flag_overrides(&self) -> Overrides {
        Overrides {
            memory_budget: self.memory_budget,
            memory_mapped: self.memory_mapped.then_some(true),
            cache_budget: self.cache_budget,
            fast_tier: self.fast_tier.clone(),
            fast_tier_size: self.fast_tier_size,
            pin_first_layers: self.pin_first_layers,
            pin_last_layers: self.pin_last_layers,
            prefetch_depth: self.prefetch_depth,
            read_threads: self.read_threads,
            read_piece: self.read_piece,
            read_ahead_layers: self.read_ahead_layers,
            expert_prefetch: self.expert_prefetch.then_some(true),
            kv_budget: self.kv_budget,
            prefix_cache: self.prefix_cache,
            prefix_disk: self.prefix_disk,
            prefix_disk_min: self.prefix_disk_min,
            max_context: self.max_context,
            threads: self.threads,
            backend: self.backend.map(|b| b.name().to_string()),
            verify: self.verify,
        }
    }

    /// Where profiles are looked up.
    pub fn profile_dirs(&self) -> Result<ProfileDirs> {
        let home = crate::store::voom_home().ok().map(|h| h.join("profiles"));
        Ok(ProfileDirs::new(self.profiles_dir.clone(), home)?)
    }

    /// The profile with flags and environment applied (the pinned one, if any).
    pub fn resolve(&self) -> Result<Arc<Resolved>> {
        if let Some(r) = &self.resolved {
            return Ok(Arc::clone(r));
        }
        let env = Overrides::from_env(&|k| std::env::var(k).ok())?;
        let r = profile::resolve(
            &self.profile_dirs()?,
            &self.profile,
            &self.flag_overrides(),
            &env,
        )?;
        Ok(Arc::new(r))
    }

    /// Resolves the profile once and keeps it for every later [`open_engine`].
    pub fn pin_profile(&mut self) -> Result<Arc<Resolved>> {
        let r = self.resolve()?;
        self.resolved = Some(Arc::clone(&r));
        Ok(r)
    }

    /// Engine options from resolved settings, with `max_context` for the model
    /// (bounded by the KV budget).
    pub fn options(settings: &Settings, max_context: Option<usize>) -> EngineOptions {
        EngineOptions {
            threads: settings.threads,
            // Checked when the settings were resolved.
            backend: libvoom::backend::BackendKind::parse(&settings.backend).unwrap_or_default(),
            verify: settings.verify.mode(),
            max_context,
            prefetch_depth: settings.prefetch_depth,
            expert_prefetch: settings.expert_prefetch,
            prefix_cache_bytes: settings.prefix_cache_bytes() as usize,
            prefix_disk: (settings.prefix_disk_bytes() > 0)
                .then(crate::store::voom_home)
                .and_then(Result::ok)
                .map(|home| libvoom::engine::snapshot::DiskPrefixes {
                    dir: home.join("prefixes"),
                    budget: settings.prefix_disk_bytes(),
                    min_tokens: settings.prefix_disk_min,
                }),
            // Without a budget, KV pages still have a pool (never full) so that the
            // memory governor can spill them under pressure.
            kv_budget: kv_spill_dir()
                .map(|d| (settings.kv_budget.map_or(UNBOUNDED_KV, |b| b as usize), d)),
            ..EngineOptions::default()
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy (the default, deterministic).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
}

impl SamplingArgs {
    pub fn params(&self) -> GenerateParams {
        GenerateParams {
            max_new_tokens: self.max_new_tokens,
            sampling: SamplingParams {
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                seed: self.seed,
            },
            ignore_eos: self.ignore_eos,
            ..GenerateParams::default()
        }
    }
}

/// Speculative decoding: a drafter proposes tokens that each pass of the model
/// verifies beside the one it computes. The output is the same ids (greedy, sampled
/// or constrained); where proposals are kept it takes fewer passes, each one sweep
/// of the weights.
#[derive(Args, Debug, Clone, Default)]
pub struct SpecArgs {
    /// Draft with a smaller model of the same tokenizer (a directory or a name in the
    /// local store); it runs beside the model, memory-mapped.
    #[arg(
        long,
        value_name = "MODEL",
        env = "VOOM_DRAFT",
        conflicts_with = "prompt_lookup"
    )]
    pub draft: Option<String>,
    /// Draft by prompt lookup: the tokens that followed the last few tokens where
    /// they occurred earlier in the prompt or the output (no second model; strong on
    /// edits, summaries and tool outputs).
    #[arg(long, env = "VOOM_PROMPT_LOOKUP", conflicts_with = "mtp")]
    pub prompt_lookup: bool,
    /// Draft with the checkpoint's own multi-token-prediction layer (DeepSeek-V3,
    /// GLM-4.5: `num_nextn_predict_layers`), computed beside the model on the same
    /// pages: no second model.
    #[arg(long, env = "VOOM_MTP", conflicts_with = "draft")]
    pub mtp: bool,
    /// The most tokens a pass verifies beyond the one it computes.
    #[arg(long, default_value_t = MAX_DRAFT, env = "VOOM_MAX_DRAFT")]
    pub max_draft: usize,
    /// Draft --max-draft tokens every pass, instead of a length that follows the
    /// measured acceptance and pass times (and stops drafting where that does not pay).
    #[arg(long)]
    pub fixed_draft: bool,
    /// Sampled runs with a draft model: speculative sampling (the draft samples its
    /// proposals; each is kept with probability min(1, p/q), else an id is drawn
    /// from what is left of the model's distribution). The same distribution as
    /// plain sampling, not the same draws, and more proposals kept. Without it a
    /// sampled run draws exactly plain decoding's ids.
    #[arg(long)]
    pub speculative_sampling: bool,
}

/// What [`SpecArgs`] asks for, opened: a drafter is made per generation from it.
pub enum Speculation {
    Off,
    PromptLookup,
    DraftModel(Box<DraftModel>),
    /// The model's own multi-token-prediction layer.
    Mtp,
}

impl SpecArgs {
    /// Opens the drafter for `target` (a draft model: its engine, with `target`'s
    /// threads and backend; an error if its tokenizer is another).
    pub fn open(&self, target: &Engine, engine: &EngineArgs) -> Result<Speculation> {
        if self.max_draft == 0 && (self.draft.is_some() || self.prompt_lookup || self.mtp) {
            bail!("--max-draft must be at least 1 to draft");
        }
        if self.prompt_lookup {
            return Ok(Speculation::PromptLookup);
        }
        if self.mtp {
            target.check_mtp().context("--mtp")?;
            return Ok(Speculation::Mtp);
        }
        let Some(name) = &self.draft else {
            return Ok(Speculation::Off);
        };
        let dir = resolve_model(name, false).with_context(|| format!("--draft {name}"))?;
        let opts = EngineOptions {
            threads: target.threads(),
            backend: EngineArgs::options(&engine.resolve()?.settings, None).backend,
            max_context: Some(target.max_context()),
            ..EngineOptions::default()
        };
        let draft = Engine::open(&dir, opts)
            .with_context(|| format!("--draft: opening {}", dir.display()))?;
        let d = DraftModel::new(Arc::new(draft), target).context("--draft")?;
        Ok(Speculation::DraftModel(Box::new(d)))
    }

    /// Sets the draft length in `params`.
    pub fn apply(&self, params: &mut GenerateParams) {
        params.max_draft = self.max_draft;
        params.adaptive_draft = !self.fixed_draft;
        params.speculative_sampling = self.speculative_sampling;
    }
}

impl Speculation {
    /// A drafter for one generation of `engine` (the engine it was opened for;
    /// none when off).
    pub fn drafter<'e>(&self, engine: &'e Engine) -> Result<Option<Box<dyn Drafter + 'e>>> {
        Ok(match self {
            Speculation::Off => None,
            Speculation::PromptLookup => Some(Box::new(PromptLookup::default())),
            Speculation::DraftModel(d) => Some(Box::new(d.fresh())),
            Speculation::Mtp => Some(Box::new(MtpDrafter::new(engine)?)),
        })
    }
}

/// Resolves MODEL: an existing directory, a GGUF file (imported into the store the
/// first time: [`crate::cli::pull::model_of_gguf`]), or a name in the local store
/// (pulled first when it is a known model that is missing and `pull_missing` is set).
pub fn resolve_model(model: &str, pull_missing: bool) -> Result<PathBuf> {
    let p = Path::new(model);
    if p.is_file()
        && p.extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return crate::cli::pull::model_of_gguf(p);
    }
    if p.is_dir() {
        if !store::is_model_dir(p) {
            bail!("{} is a directory but has no config.json", p.display());
        }
        return Ok(p.to_path_buf());
    }
    if model.contains('/') {
        bail!("model directory {model} does not exist");
    }
    let dir = store::model_path(model)?;
    if store::is_model_dir(&dir) {
        store::check_lossy_id(model, &dir)?;
        return Ok(dir);
    }
    if pull_missing && crate::registry::find(model).is_some() {
        eprintln!("voom: {model} is not in the local store; pulling it");
        crate::cli::pull::pull_known(model, false)?;
        return Ok(dir);
    }
    let known: Vec<&str> = crate::registry::KNOWN.iter().map(|m| m.name).collect();
    bail!(
        "no model '{model}': not a directory, and not in the local store {} (models there: {}; `voom pull` knows: {})",
        store::models_dir()?.display(),
        store::list_models()?.join(", "),
        known.join(", ")
    )
}

/// Opens the engine for the model in `dir` with the resolved profile: over the
/// vpaged daemon (`--vpaged`), over an in-process page cache (a `cache_budget`, or a
/// memory budget the model does not fit in: [`budget`]), or over the embedded
/// memory-mapped store. None of these changes results.
///
/// The memory governor watches the process's memory pressure while the engine
/// lives, shrinking its prefix cache, its page cache's room, spilling KV pages and
/// unpinning weights before the system swaps or kills it
/// ([`libvoom::engine::governor`]).
pub fn open_engine(dir: &Path, args: &EngineArgs) -> Result<Engine> {
    let engine = open_engine_ungoverned(dir, args)?;
    let g = engine.govern(libvoom::engine::governor::GovernorConfig::default());
    *GOVERNOR.lock().unwrap_or_else(|e| e.into_inner()) = Some(g.stats);
    Ok(engine)
}

fn open_engine_ungoverned(dir: &Path, args: &EngineArgs) -> Result<Engine> {
    let resolved = args.resolve()?;
    for w in &resolved.warnings {
        eprintln!("voom: warning: {w}");
    }
    let s = &resolved.settings;
    let max_context = if s.kv_budget.is_some() || s.memory_budget.is_some() {
        let cfg = libvoom::config::ModelConfig::from_dir(dir)
            .with_context(|| format!("opening model {}", dir.display()))?;
        s.max_context_for(&cfg)
            .with_context(|| format!("profile {} for model {}", resolved.name, dir.display()))?
    } else {
        s.max_context
    };
    let mut opts = EngineArgs::options(s, max_context);
    if let Some(b) = args.backend {
        opts.backend = b;
    }
    if let Some(p) = args.kv_page_positions {
        opts.kv_page_positions = p as usize;
    }
    *OPENED_PROFILE.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(&resolved));
    *OPENED_BUDGET.lock().unwrap_or_else(|e| e.into_inner()) = None;
    let pins = s.pin_first_layers > 0 || s.pin_last_layers > 0;
    if let Some(socket) = &args.vpaged {
        let source = vpaged::client::DaemonClient::connect(socket, "voom")
            .and_then(|c| vpaged::client::DaemonSource::open(c, dir));
        match source {
            Ok(src) => {
                if s.memory_budget.is_some()
                    || s.cache_budget.is_some()
                    || s.fast_tier.is_some()
                    || pins
                {
                    eprintln!(
                        "voom: warning: the vpaged daemon's own cache budget, pins and fast \
                         tier apply; the profile's memory_budget/cache_budget/fast_tier/\
                         pin_*_layers are ignored"
                    );
                }
                return Engine::with_source(dir, Arc::new(src), opts)
                    .with_context(|| format!("opening model {}", dir.display()));
            }
            Err(e) if args.vpaged_fallback => {
                eprintln!("voom: warning: {e}; using the embedded store");
            }
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("opening model {} through vpaged", dir.display()))
            }
        }
    }
    let sizing = budget::sizing(&resolved, || {
        // What is available to this process: what is free, and what it holds. A
        // figure the OS does not give is no budget.
        let a = Some(crate::memory::available()).filter(|a| !a.guessed)?;
        let own = crate::memory::resident_bytes().unwrap_or(0);
        Some((a.bytes + own, a.source))
    });
    // The engine the planner opened, when it is the one to run.
    let mut planned = None;
    let cache = match sizing {
        budget::Sizing::Mapped => None,
        budget::Sizing::Cache(bytes) => Some(bytes),
        budget::Sizing::Memory(b) => match plan_store(dir, s, &mut opts, &b)? {
            Planned::Cache(bytes) => Some(bytes),
            Planned::Mapped(engine) => {
                planned = engine;
                None
            }
        },
    };
    if let Some(budget) = cache {
        let cache_bytes = usize::try_from(budget)
            .with_context(|| format!("a page cache of {budget} bytes does not fit this machine"))?;
        let store = Store::new(StoreConfig {
            cache_bytes,
            pin_first_layers: s.pin_first_layers,
            pin_last_layers: s.pin_last_layers,
            // A checkpoint without a page manifest is hashed once, the manifest
            // written beside it, or under $VOOM_HOME/manifests where its directory
            // cannot be written.
            hash_on_open: true,
            manifest_dir: store::voom_home().ok().map(|h| h.join("manifests")),
            io: read_io(s)?,
            fast_tier: fast_tier(s)?,
            ..StoreConfig::default()
        })
        .with_context(|| {
            format!(
                "creating the {} page cache of profile {}",
                profile::format_size(budget),
                resolved.name
            )
        })?;
        let hashed = dir.join(voom_formats::manifest::MANIFEST_FILE).is_file();
        match StoreSource::open(store, dir) {
            Ok(src) => {
                return Engine::with_source(dir, Arc::new(src), opts)
                    .with_context(|| format!("opening model {}", dir.display()))
            }
            // The page manifest could not be made (no room to write one): the
            // memory-mapped store needs none.
            Err(e) if !hashed => eprintln!(
                "voom: warning: {e}; the page cache is not used and the weights are read \
                 through the memory-mapped store"
            ),
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("opening model {} in the page cache", dir.display()))
            }
        }
    } else if pins || s.fast_tier.is_some() {
        eprintln!(
            "voom: warning: pin_first_layers/pin_last_layers/fast_tier apply only with a \
             page cache (a cache_budget, or a memory budget the model does not fit in); \
             ignored: the model is memory-mapped"
        );
    }
    if let Some(engine) = planned {
        return Ok(*engine);
    }
    Engine::open(dir, opts).with_context(|| format!("opening model {}", dir.display()))
}

/// The fast tier of the settings: its directory (created) and the bytes it may hold.
fn fast_tier(s: &Settings) -> Result<Option<(PathBuf, u64)>> {
    let Some(dir) = &s.fast_tier else {
        if s.fast_tier_size.is_some() {
            eprintln!("voom: warning: fast_tier_size applies only with a fast_tier; ignored");
        }
        return Ok(None);
    };
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the fast tier {}", dir.display()))?;
    let size = fast_tier_size(dir, s.fast_tier_size)?;
    Ok(Some((dir.clone(), size)))
}

/// The bytes a fast tier in `dir` may hold: `size` where given, else nine tenths of
/// what it could hold (the free space of its file system and its own copies).
pub fn fast_tier_size(dir: &Path, size: Option<u64>) -> Result<u64> {
    match size {
        Some(b) => Ok(b),
        None => free_bytes(dir)
            .map(|b| (b + dir_bytes(dir)) / 10 * 9)
            .with_context(|| format!("the free space of the fast tier {}", dir.display())),
    }
}

/// Bytes of the files under `dir` (a fast tier: its copies), as far as it can be read.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// Bytes free for an unprivileged user on the file system holding `dir`.
fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c =
        std::ffi::CString::new(dir.as_os_str().as_bytes()).context("the path has a NUL byte")?;
    // SAFETY: an all-zero statvfs is a valid value for the call to overwrite.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid statvfs to write.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// The plan of the engine most recently opened by [`open_engine`] under a memory
/// budget, which [`result_json`] reports.
static OPENED_BUDGET: Mutex<Option<serde_json::Value>> = Mutex::new(None);

/// The counters of the memory governor of the engine opened last.
static GOVERNOR: Mutex<Option<Arc<libvoom::engine::governor::GovernorStats>>> = Mutex::new(None);

/// What [`plan_store`] chose.
enum Planned {
    /// A page cache of these bytes.
    Cache(u64),
    /// The memory-mapped store: the engine it opened to plan, where it is the one to
    /// run (opened with the run's options).
    Mapped(Option<Box<Engine>>),
}

/// Plans the model in `dir` under memory budget `b` ([`budget`]): a page cache to
/// read it through, or the memory-mapped store (it fits, or, under the memory
/// available by default, not even streaming fits and the kernel is left to page
/// it). An explicit budget too small to stream is an error naming what the model
/// needs. With a page cache, the engine's context is bounded to the one planned, so
/// that its KV cache never outgrows its share.
fn plan_store(
    dir: &Path,
    s: &Settings,
    opts: &mut EngineOptions,
    b: &budget::Budget,
) -> Result<Planned> {
    // The model's shapes and page plan, from its memory-mapped files (nothing read).
    // Opened as the run would open it unless that verifies every page at once, so
    // that a model that stays memory-mapped is not opened twice.
    let reuse = opts.verify != vpaged::VerifyMode::Eager;
    let probe_opts = if reuse {
        opts.clone()
    } else {
        EngineOptions {
            verify: vpaged::VerifyMode::Off,
            ..opts.clone()
        }
    };
    let probe = Engine::open(dir, probe_opts)
        .with_context(|| format!("opening model {}", dir.display()))?;
    let context = opts
        .max_context
        .unwrap_or(profile::BUDGET_CONTEXT)
        .min(probe.config().max_position_embeddings)
        .max(1);
    let manifest = voom_formats::Manifest::load(dir).ok().flatten();
    let needs = budget::needs(
        &probe,
        context,
        opts.prefill_chunk,
        &read_io(s)?,
        manifest.as_ref(),
        crate::memory::resident_bytes(),
    );
    // Planned as a page cache would read it (whole pages), should it stream.
    let choice = budget::choose(&probe.model().plan().whole_pages(), &needs, b.bytes);
    let mapped = |probe: Engine| Planned::Mapped(reuse.then(|| Box::new(probe)));
    let store = match choice {
        Ok(store) => store,
        Err(e) if b.explicit => {
            return Err(e).with_context(|| {
                format!(
                    "memory_budget ({}) for model {} at a context of {context} positions",
                    b.from,
                    dir.display()
                )
            })
        }
        Err(e) => {
            eprintln!(
                "voom: warning: model {} cannot stream within {}: {e}; the weights are \
                 memory-mapped and the kernel pages them (--memory-budget and --max-context \
                 set what is planned)",
                dir.display(),
                b.from
            );
            return Ok(mapped(probe));
        }
    };
    let line = budget::describe(b, &needs, &store);
    tracing::info!("{line}");
    if store != budget::Store::Mapped || b.explicit {
        // The KV planned is the KV budget: pages beyond it spill to disk, so the
        // context is not bounded by the plan.
        if let Some((bytes, _)) = opts.kv_budget.as_mut().filter(|(b, _)| *b == UNBOUNDED_KV) {
            *bytes = needs.kv_bytes as usize;
        }
        if !b.explicit {
            eprintln!(
                "voom: {line}; KV beyond the {context} positions planned spills to disk \
                 (--kv-budget, --max-context to plan another)"
            );
        }
    }
    *OPENED_BUDGET.lock().unwrap_or_else(|e| e.into_inner()) =
        Some(budget::to_json(b, &needs, &store));
    Ok(match store {
        budget::Store::Mapped => mapped(probe),
        budget::Store::Cache { cache_bytes, .. } => {
            drop(probe);
            Planned::Cache(cache_bytes)
        }
    })
}

/// The KV budget of a run that sets none: nothing spills unless the memory governor
/// lowers it.
pub const UNBOUNDED_KV: usize = usize::MAX / 4;

/// Where KV pages beyond the KV budget spill: `$VOOM_HOME/kv` (`None`, with a
/// warning, where there is no home).
pub fn kv_spill_dir() -> Option<PathBuf> {
    match crate::store::voom_home() {
        Ok(home) => Some(home.join("kv")),
        Err(e) => {
            eprintln!("voom: warning: no KV budget: {e}");
            None
        }
    }
}

/// Token ids of a chat: the messages rendered with the model's chat template.
pub fn chat_ids(engine: &Engine, messages: &[serde_json::Value]) -> Result<Vec<u32>> {
    let tok = engine
        .tokenizer()
        .context("this model has no tokenizer.json: use --prompt-ids")?;
    let tpl = tok
        .chat_template()
        .context("this model has no chat template: use --prompt")?;
    let text = tpl.render(messages, None, true, None)?;
    Ok(tok.encode(&text, false)?)
}

/// Token ids of a raw text prompt (with the tokenizer's special tokens, as HF does).
pub fn text_ids(engine: &Engine, text: &str) -> Result<Vec<u32>> {
    let tok = engine
        .tokenizer()
        .context("this model has no tokenizer.json: use --prompt-ids")?;
    Ok(tok.encode(text, true)?)
}

/// What a generation answered: its text, and a reasoning model's reasoning apart
/// (None for a model without a reasoning format, or a prompt not rendered through
/// its chat template).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reply {
    pub text: String,
    pub reasoning: Option<String>,
    /// Generated tokens of the reasoning, as the server counts them
    /// (`serve::harmony::TokenOffsets`; 0 without reasoning).
    pub reasoning_tokens: usize,
}

/// Whether `engine`'s chat template and tokenizer speak harmony (gpt-oss): its
/// chat output is read as reasoning and answer.
pub fn is_harmony(engine: &Engine) -> bool {
    engine.tokenizer().is_some_and(|t| {
        t.chat_template()
            .is_some_and(|c| crate::serve::harmony::Harmony::detect(c.source(), t).is_some())
    })
}

/// Generates, streaming text to stdout as it completes (when `stream`), and returns
/// the generation and its reply. With `harmony` (a chat prompt to a harmony model)
/// the output is read as harmony (`serve::harmony`): the answer streams to stdout,
/// the reasoning to stderr (dimmed on a terminal), apart. A write to stdout that
/// fails stops generation and is the error (a closed pipe, `voom run ... | head -c
/// 10`, ends the command quietly: see `vpaged::stdout::exit_code`). `on_token` runs
/// as each id is sampled, before it is shown (the first call marks the end of
/// prefill).
pub fn generate_streaming(
    engine: &Engine,
    ids: &[u32],
    params: &GenerateParams,
    spec: &Speculation,
    stream: bool,
    harmony: bool,
    on_token: &mut dyn FnMut(),
) -> Result<(Generation, Reply)> {
    use crate::serve::harmony::{HarmonyParser, Piece, TokenOffsets};
    use std::io::{IsTerminal, Write};
    let mut drafter = spec.drafter(engine)?;
    let mut reply = Reply {
        text: String::new(),
        reasoning: harmony.then(String::new),
        reasoning_tokens: 0,
    };
    // Where each shown token's text begins, for the reasoning's token count.
    let mut offsets = TokenOffsets::default();
    let dim = std::io::stderr().is_terminal();
    // Whether reasoning was shown last (so the answer starts on a line of its own).
    let mut thinking = false;
    let mut show = |p: Piece, reply: &mut Reply| -> std::io::Result<()> {
        match p {
            Piece::Reasoning(t) => {
                reply.reasoning.get_or_insert_with(String::new).push_str(&t);
                if stream {
                    let mut e = std::io::stderr().lock();
                    if dim {
                        write!(e, "\x1b[2m{t}\x1b[0m")?;
                    } else {
                        write!(e, "{t}")?;
                    }
                    e.flush()?;
                    thinking = true;
                }
            }
            // (No tools are offered here: a call is text as written.)
            Piece::Content(t) | Piece::Call { raw: t, .. } => {
                reply.text.push_str(&t);
                if stream {
                    if std::mem::take(&mut thinking) {
                        eprintln!();
                    }
                    vpaged::stdout::text(&t)?;
                    vpaged::stdout::flush()?;
                }
            }
        }
        Ok(())
    };
    let eos = engine.eos_ids().to_vec();
    let g = match engine.tokenizer() {
        Some(tok) => {
            // Harmony's markers are special tokens: kept to be read.
            let mut dec = StreamDecoder::new(tok, !harmony);
            let mut parser = harmony.then(HarmonyParser::new);
            let mut read = |piece: &str, reply: &mut Reply| -> std::io::Result<()> {
                let pieces = match parser.as_mut() {
                    Some(h) => h.push(piece),
                    None => vec![Piece::Content(piece.to_string())],
                };
                pieces.into_iter().try_for_each(|p| show(p, reply))
            };
            let mut err: Option<anyhow::Error> = None;
            let d = Decoding {
                constraint: None,
                drafter: drafter.as_deref_mut().map(|d| d as &mut dyn Drafter),
            };
            let g = engine.generate_with(ids, params, d, &mut |id| {
                on_token();
                if eos.contains(&id) && !params.ignore_eos {
                    return ControlFlow::Continue(());
                }
                let shown = dec.push(id).map_err(anyhow::Error::from).and_then(|piece| {
                    offsets.token(&piece);
                    Ok(read(&piece, &mut reply)?)
                });
                match shown {
                    Ok(()) => ControlFlow::Continue(()),
                    Err(e) => {
                        err = Some(e);
                        ControlFlow::Break(())
                    }
                }
            })?;
            if let Some(e) = err {
                return Err(e);
            }
            let rest = dec.finish()?;
            offsets.text(&rest);
            read(&rest, &mut reply)?;
            if let Some(mut h) = parser {
                let ended = g.finish == libvoom::engine::FinishReason::Eos;
                for p in h.finish(ended) {
                    show(p, &mut reply)?;
                }
                reply.reasoning_tokens = offsets.count_in(h.reasoning_spans());
            }
            g
        }
        None => {
            let d = Decoding {
                constraint: None,
                drafter: drafter.as_deref_mut().map(|d| d as &mut dyn Drafter),
            };
            engine.generate_with(ids, params, d, &mut |_| {
                on_token();
                ControlFlow::Continue(())
            })?
        }
    };
    if stream && thinking {
        eprintln!();
    }
    if stream {
        vpaged::stdout::text("\n")?;
        vpaged::stdout::flush()?;
    }
    Ok((g, reply))
}

/// The `--json` result object.
pub fn result_json(
    engine: &Engine,
    prompt_ids: &[u32],
    g: &Generation,
    reply: &Reply,
) -> serde_json::Value {
    let text = &reply.text;
    let profile = OPENED_PROFILE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let wb = engine.weight_budget();
    serde_json::json!({
        "model": engine.name(),
        "profile": profile.as_ref().map(|p| p.name.as_str()),
        "profile_digest": profile.as_ref().map(|p| p.digest.as_str()),
        // Lossy weights (a quantized GGUF kept as stored) are never exact; the
        // scheme names them.
        "exact": engine.lossy_scheme().is_none(),
        "scheme": engine.lossy_scheme(),
        // The backend that computed it, and what was turned off to keep its ids
        // exact (a backend not shown batch invariant: no prefix reuse, speculation
        // or batching).
        "backend": g.backend,
        "exactness_note": g.exactness_note,
        // Weight and KV bytes the backend copied instead of computing on them in
        // place (0 on the CPU; MLX where it cannot wrap a page).
        "backend_copied_bytes": engine.backend_copied_bytes(),
        // Graph evaluations of a lazy backend (MLX: one a layer a pass; 0 on the CPU).
        "backend_evaluations": engine.backend_evaluations(),
        "page_source": engine.source().describe(),
        // How a memory budget placed the weights (none with a cache_budget or the
        // daemon).
        "memory_budget": OPENED_BUDGET.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        "prompt_ids": prompt_ids,
        "ids": g.ids,
        "text": text,
        // A reasoning model's reasoning, apart from the text (null for others).
        "reasoning": reply.reasoning,
        "finish_reason": g.finish.as_str(),
        "usage": {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.ids.len(),
            "reasoning_tokens": reply.reasoning_tokens},
        "timing": {
            "prefill_secs": g.prefill_secs,
            "decode_secs": g.decode_secs,
            "prefill_tokens_per_sec": g.prefill_tokens_per_sec(),
            "decode_tokens_per_sec": g.decode_tokens_per_sec(),
            // Of those seconds, the time the passes waited for pages.
            "prefill_page_wait_secs": g.prefill_page_wait_secs,
            "decode_page_wait_secs": g.decode_page_wait_secs,
        },
        // Forward passes of decode, and what a drafter did (speculative decoding).
        "decode_passes": g.decode_passes,
        "prefix_tokens_reused": g.prefix_reused,
        // The KV budget's pages: spilled to disk, read back, lost and recomputed
        // (over the engine's life; none without a budget).
        "kv": engine.kv_pool_stats().map(|k| serde_json::json!({
            "budget_bytes": k.budget,
            "resident_bytes": k.resident_bytes,
            "spilled_bytes": k.spilled_bytes,
            "written_bytes": k.written_bytes,
            "read_bytes": k.read_bytes,
            "read_ahead_pages": k.read_ahead,
            "stalled_pages": k.stalls,
            "corrupt_pages": k.corrupt,
            "recomputed_positions": k.recomputed_positions,
            "direct_io": k.direct,
            "spill_off": k.off,
        })),
        // The page cache the weights are read through (the in-process one, or the
        // daemon's; none for the memory-mapped store) as it is at the end, and what
        // this process's memory governor did.
        "page_cache_room": engine.source().cache_stats().map(|c| serde_json::json!({
            "capacity_bytes": c.capacity_bytes,
            "used_bytes": c.used_bytes,
            "withheld_bytes": c.withheld_bytes,
        })),
        "governor": GOVERNOR.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|s| {
            use std::sync::atomic::Ordering::Relaxed;
            let lowest = s.lowest_headroom.load(Relaxed);
            serde_json::json!({
                "shrinks": s.shrinks.load(Relaxed),
                "restores": s.restores.load(Relaxed),
                "lowest_headroom_bytes": (lowest != u64::MAX).then_some(lowest),
                "weights_withheld_bytes": s.weights_withheld.load(Relaxed),
                "most_weights_withheld_bytes": s.most_weights_withheld.load(Relaxed),
                "pins_released_bytes": s.pins_released.load(Relaxed),
                "most_pins_released_bytes": s.most_pins_released.load(Relaxed),
            })
        }),
        // The weights' budget: as placed at open, what the governor took back, and
        // the pins at open and at the end.
        "weight_budget": {
            "configured_bytes": wb.configured,
            "taken_bytes": wb.taken,
            "pinned_at_open_bytes": wb.pinned_at_open,
            "pinned_bytes": wb.pinned,
        },
        "speculation": g.speculation.as_ref().map(|r| {
            let mut v = speculation_json(r);
            // Ids decoded per pass (the first id comes from the prompt's pass).
            v["tokens_per_pass"] = serde_json::json!(
                g.ids.len().saturating_sub(1) as f64 / r.passes.max(1) as f64
            );
            v
        }),
        "threads": engine.threads(),
        // This process's memory at the end (Linux): private bytes against the
        // daemon's shared arena.
        "memory": crate::memory::snapshot(),
        "peak_rss_bytes": crate::memory::peak_resident_bytes(),
        // The page cache's traffic in this generation (sources with a cache).
        "page_cache": g.pages.as_ref().map(traffic_json),
        // Its part from the first sampled id on (decode).
        "decode_page_cache": g.decode_pages.as_ref().map(traffic_json),
        // Bytes read from storage by this process in all (the weights it streamed).
        "storage_read_bytes": crate::memory::storage_read_bytes(),
    })
}

/// What a drafter did, as the CLI's and the server's reports print it.
pub fn speculation_json(r: &libvoom::speculate::SpecReport) -> serde_json::Value {
    serde_json::json!({
        "drafter": r.drafter,
        "scheme": r.scheme,
        "drafted": r.drafted,
        "accepted": r.accepted,
        "acceptance": r.acceptance(),
        "passes": r.passes,
        "verify_passes": r.verify_passes,
        "stopped": r.stopped,
    })
}

/// A page cache's traffic as the JSON reports print it.
fn traffic_json(p: &libvoom::engine::PageTraffic) -> serde_json::Value {
    serde_json::json!({
        "hits": p.hits,
        "misses": p.misses,
        "hit_ratio": p.hit_ratio(),
        "bytes_loaded": p.bytes_loaded,
        "inflight_waits": p.inflight_waits,
        "prefetch_loads": p.prefetch_loads,
        "prefetch_skipped": p.prefetch_skipped,
        "unused_evictions": p.unused_evictions,
        "bodies_read_ahead": p.bodies_read_ahead,
        // Bytes read from each tier.
        "bytes_read": {
            "fast_tier": p.fast_tier_bytes,
            "primary": p.primary_bytes,
            "nas": p.nas_bytes,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A piece outside the range a reader's buffer can take is an error naming the
    /// setting and the range; the settings' values reach the store's config.
    #[test]
    fn read_settings_become_the_store_reads_or_a_clear_error() {
        let s = Settings {
            read_threads: 3,
            read_piece: 4 << 20,
            ..Settings::default()
        };
        let io = read_io(&s).unwrap();
        assert_eq!((io.read_threads, io.read_piece), (3, 4 << 20));
        for piece in [0, 1 << 30] {
            let e = read_io(&Settings {
                read_piece: piece,
                ..Settings::default()
            })
            .unwrap_err()
            .to_string();
            assert!(e.contains("read_piece") && e.contains("16KiB"), "{e}");
        }
    }
}

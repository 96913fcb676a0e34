//! The engine: a model, its page source, its tokenizer and a thread pool; prefill of
//! the prompt, then decode until a stop condition.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use vpaged::{EmbeddedStore, PageSource, SourceCacheStats, VerifyMode};

use crate::backend::BackendKind;
use crate::config::ModelConfig;
use crate::constrain::{ConstrainError, TokenConstraint, TokenMask};
use crate::kv::{KvCache, KvPool, KvPoolStats};
use crate::model::{self, Logits, Model, SeqPass, Sweep};
use crate::sampler::{Sampler, SamplingParams};
use crate::speculate::{Drafter, SpecReport};
use crate::text::Tokenizer;
use crate::VoomError;

pub mod governor;
pub mod placed;
pub mod prefix;
mod sequence;
pub mod snapshot;
pub use sequence::Sequence;

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Compute threads (0: all available cores).
    pub threads: usize,
    /// Verification of pages against the manifest (embedded store).
    pub verify: VerifyMode,
    /// Longest context (prompt + generated); defaults to the model's maximum.
    pub max_context: Option<usize>,
    /// Positions each layer computes at a time (bounding activations); a prompt is
    /// still one forward pass, one sweep of the weights. Results do not depend on it.
    pub prefill_chunk: usize,
    /// Decoder layers hinted to the page source ahead of the one computing (0: off).
    /// Results do not depend on it.
    pub prefetch_depth: usize,
    /// The compute backend. Results do not depend on it.
    pub backend: BackendKind,
    /// A mixture of experts: predict the next layer of experts' picks from the
    /// hidden state a layer early and hint them. Results do not depend on it.
    pub expert_prefetch: bool,
    /// A mixture of experts: bytes of a layer's routed experts' outputs that may be
    /// held so that the experts compute in the order their pages are ready (resident
    /// ones while the others load), at most
    /// [`crate::model::sweep::EXPERT_HOLD_BYTES`]; 0 computes them in ascending order.
    /// Results do not depend on it.
    pub expert_hold_bytes: usize,
    /// Positions per page of the KV cache ([`crate::kv::KvCache`]). Results do not
    /// depend on it.
    pub kv_page_positions: usize,
    /// Bytes of prompt-prefix KV kept for reuse ([`prefix::PrefixCache`]; 0: none).
    /// Results do not depend on it.
    pub prefix_cache_bytes: usize,
    /// Prompt prefixes persisted on disk ([`snapshot`]; `None`: not persisted).
    /// Results do not depend on it.
    pub prefix_disk: Option<snapshot::DiskPrefixes>,
    /// A byte budget for the closed KV pages of every cache the engine makes
    /// (sequences and kept prefixes together), and the directory their pages spill
    /// to beyond it ([`crate::kv::spill`]); `None`: no budget. Results do not
    /// depend on it.
    pub kv_budget: Option<(usize, PathBuf)>,
    /// Treat the backend as not batch invariant whatever it claims: prefix reuse,
    /// speculation and batching off, one sequence a pass, as on a backend whose
    /// invariance is not shown ([`Engine::exactness_note`]). The ids do not change.
    pub distrust_batch_invariance: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            threads: 0,
            verify: VerifyMode::FirstUse,
            max_context: None,
            prefill_chunk: 256,
            prefetch_depth: 1,
            backend: BackendKind::best(),
            expert_prefetch: false,
            expert_hold_bytes: crate::model::sweep::EXPERT_HOLD_BYTES,
            kv_page_positions: crate::kv::DEFAULT_PAGE_POSITIONS,
            prefix_cache_bytes: 0,
            prefix_disk: None,
            kv_budget: None,
            distrust_batch_invariance: false,
        }
    }
}

#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop when an end-of-sequence token is generated (it is included in the output).
    pub ignore_eos: bool,
    /// Keep the logits of every generated step (for conformance tests and tools).
    pub record_logits: bool,
    /// With a drafter ([`Decoding::drafter`]): the most tokens one pass verifies
    /// beyond the one it computes.
    pub max_draft: usize,
    /// Whether the draft length adapts to measured acceptance and pass times
    /// ([`Adaptive`], stopping where drafting does not pay), or is always
    /// `max_draft` (as far as the tokens wanted and the context allow).
    pub adaptive_draft: bool,
    /// With a drafter that samples (a draft model) and sampling (temperature > 0, no
    /// constraint): speculative sampling. Proposals are drawn from the draft's
    /// distribution and kept with probability min(1, p/q), else an id is drawn
    /// from max(0, p - q): the target's distribution exactly, more proposals kept,
    /// but not plain sampling's draws. Off: a sampled run draws plain decoding's ids.
    pub speculative_sampling: bool,
}

/// Why prefix reuse, speculation and batching are off on a backend that is not
/// batch invariant.
const NOT_INVARIANT: &str = "this backend's bits are not shown independent of the rows \
    computed with them, so prefix reuse, speculation and batching are off (exact ids, \
    one sequence a pass)";

/// Passes repeated at most to recompute lost KV positions (each finds at least one
/// more damaged page, and drops it).
const MAX_RECOVERIES: usize = 256;

/// The longest draft a pass verifies by default.
pub const MAX_DRAFT: usize = 8;

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_new_tokens: 0,
            sampling: SamplingParams::default(),
            ignore_eos: false,
            record_logits: false,
            max_draft: MAX_DRAFT,
            adaptive_draft: true,
            speculative_sampling: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was generated.
    Eos,
    /// `max_new_tokens` reached.
    Length,
    /// The context limit was reached.
    ContextFull,
    /// The caller's callback asked to stop.
    Stopped,
    /// Constrained generation: the constraint admits no further token (a grammar's
    /// output is complete). No end-of-sequence token is generated or included.
    Complete,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "stop",
            FinishReason::Length => "length",
            FinishReason::ContextFull => "context_full",
            FinishReason::Stopped => "stopped",
            FinishReason::Complete => "stop",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated token ids (an end-of-sequence token that stopped generation included).
    pub ids: Vec<u32>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    /// Logits of each generated step, when asked for (the model's, before any
    /// constraint masks them).
    pub logits: Vec<Vec<f32>>,
    /// Seconds of `decode_secs` spent in the constraint (masks, advancing); 0
    /// without one.
    pub constraint_secs: f64,
    /// The page cache's traffic during this generation, for sources with a cache
    /// of their own (`None` for memory-mapped files, whose caching is the OS's).
    pub pages: Option<PageTraffic>,
    /// The part of `pages` from the first sampled id on (what decode asked).
    pub decode_pages: Option<PageTraffic>,
    /// Seconds of `prefill_secs` and of `decode_secs` the forward passes spent
    /// waiting for pages (the rest computed). Memory-mapped pages fault inside the
    /// computation, so their waits count as computing.
    pub prefill_page_wait_secs: f64,
    pub decode_page_wait_secs: f64,
    /// Forward passes of decode (one sweep of the weights each): the generated ids
    /// less one without speculation, fewer with it.
    pub decode_passes: usize,
    /// Prompt positions taken from a prefix computed before ([`prefix`]) instead of
    /// computed.
    pub prefix_reused: usize,
    /// Multiply-adds of the products and attention the backend computed from the
    /// start to the end of the prefill ([`crate::backend::Backend::multiply_adds`]):
    /// this sequence's, and those of any sequence stepped with it meanwhile.
    pub prefill_multiply_adds: u64,
    /// What speculation did, when a drafter ran.
    pub speculation: Option<SpecReport>,
    /// The backend that computed it ("cpu-avx512", "mlx-cpu").
    pub backend: String,
    /// What the engine turned off to keep the ids exact on this backend, when
    /// anything ([`Engine::exactness_note`]).
    pub exactness_note: Option<String>,
}

/// How a generation decodes beyond its parameters: a constraint on what it may
/// generate, a drafter proposing tokens to verify several per pass. Neither changes
/// the ids or logits a constraint-free, drafter-free run would give for the same
/// constraint: the drafter changes only how many passes it takes.
#[derive(Default)]
pub struct Decoding<'a> {
    pub constraint: Option<&'a mut dyn TokenConstraint>,
    pub drafter: Option<&'a mut dyn Drafter>,
}

/// What a generation asked of its source's page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PageTraffic {
    /// Demand requests served from resident pages.
    pub hits: u64,
    /// Demand requests that loaded a page.
    pub misses: u64,
    /// Bytes loaded into the cache (demand and prefetch).
    pub bytes_loaded: u64,
    /// Demand requests that waited for a load in flight (a prefetch not landed yet).
    pub inflight_waits: u64,
    /// Pages loaded on a hint, and hints dropped for want of room.
    pub prefetch_loads: u64,
    pub prefetch_skipped: u64,
    /// Prefetched pages evicted before their request (each read twice).
    pub unused_evictions: u64,
    /// Pages decoded from a vpack body read ahead of their load.
    pub bodies_read_ahead: u64,
    /// Bytes read from each tier: the fast tier, the model's local directory, a NAS.
    pub fast_tier_bytes: u64,
    pub primary_bytes: u64,
    pub nas_bytes: u64,
}

impl PageTraffic {
    /// The traffic between two readings of a source's cache counters (`None` unless
    /// both were read).
    pub fn between(a: Option<&SourceCacheStats>, b: Option<&SourceCacheStats>) -> Option<Self> {
        let (a, b) = (a?, b?);
        Some(PageTraffic {
            hits: b.hits.saturating_sub(a.hits),
            misses: b.misses.saturating_sub(a.misses),
            bytes_loaded: b.bytes_loaded.saturating_sub(a.bytes_loaded),
            inflight_waits: b.inflight_waits.saturating_sub(a.inflight_waits),
            prefetch_loads: b.prefetch_loads.saturating_sub(a.prefetch_loads),
            prefetch_skipped: b.prefetch_skipped.saturating_sub(a.prefetch_skipped),
            unused_evictions: b.unused_evictions.saturating_sub(a.unused_evictions),
            bodies_read_ahead: b.bodies_read_ahead.saturating_sub(a.bodies_read_ahead),
            fast_tier_bytes: b.fast_tier_bytes.saturating_sub(a.fast_tier_bytes),
            primary_bytes: b.primary_bytes.saturating_sub(a.primary_bytes),
            nas_bytes: b.nas_bytes.saturating_sub(a.nas_bytes),
        })
    }

    /// Hits over all demand requests (0 with none).
    pub fn hit_ratio(&self) -> f64 {
        let all = self.hits + self.misses;
        if all == 0 {
            0.0
        } else {
            self.hits as f64 / all as f64
        }
    }
}

impl Generation {
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }

    /// Decode speed over the tokens after the first (the first comes from prefill).
    pub fn decode_tokens_per_sec(&self) -> f64 {
        let n = self.ids.len().saturating_sub(1);
        if n == 0 {
            0.0
        } else {
            n as f64 / self.decode_secs.max(1e-9)
        }
    }
}

pub struct Engine {
    dir: PathBuf,
    name: String,
    model: Box<dyn Model>,
    source: Arc<dyn PageSource>,
    tokenizer: Option<Tokenizer>,
    eos: Vec<u32>,
    opts: EngineOptions,
    /// Where the memory planner put the weights (pins, streaming room, the walk
    /// every pass's sweep follows), which a memory governor may change between
    /// passes ([`placed`]).
    placements: Arc<placed::Placements>,
    /// Layers and floats per position of the model's KV caches, and of its
    /// multi-token-prediction layer's.
    kv_layout: (usize, usize),
    mtp_kv_layout: (usize, usize),
    /// Prompt prefixes computed before ([`EngineOptions::prefix_cache_bytes`]).
    prefixes: Arc<std::sync::Mutex<prefix::PrefixCache>>,
    /// Their snapshots on disk ([`EngineOptions::prefix_disk`]).
    snapshots: Option<snapshot::SnapshotDir>,
    /// The routing trace being recorded ([`Engine::record_expert_trace`]).
    trace: std::sync::Mutex<Option<Vec<vpaged::expert_trace::TracePass>>>,
    /// The budget of its KV caches' pages ([`EngineOptions::kv_budget`]).
    kv_pool: Option<KvPool>,
}

/// The prefix snapshots of the model in `dir` (`name`), keyed by its page manifest;
/// `None`, with a warning, without a manifest or where the directory cannot be made.
fn open_snapshots(
    dir: &Path,
    name: &str,
    model: &dyn Model,
    cfg: &snapshot::DiskPrefixes,
) -> Option<snapshot::SnapshotDir> {
    use voom_formats::manifest::{MANIFEST_FILE, MANIFEST_MAX_BYTES};
    let manifest = match voom_formats::file::read_limited(
        &dir.join(MANIFEST_FILE),
        MANIFEST_MAX_BYTES,
    ) {
        Ok(m) => m,
        Err(e) => {
            // Usual for a checkpoint not hashed: nothing identifies its weights.
            tracing::debug!(
                "model {name}: prompt prefixes are not persisted: no page manifest ({MANIFEST_FILE}: {e}; `vpagectl hash` writes one)"
            );
            return None;
        }
    };
    let config = match voom_formats::file::read_limited(
        &dir.join("config.json"),
        voom_formats::file::SIDE_FILE_MAX_BYTES,
    ) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("model {name}: prompt prefixes are not persisted: config.json: {e}");
            return None;
        }
    };
    let kv = model.new_kv(1, 1);
    let key = snapshot::key_of(&manifest, &config, kv.layers(), kv.width());
    match snapshot::SnapshotDir::open(cfg.clone(), key) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(
                "model {name}: prompt prefixes are not persisted: {}: {e}",
                cfg.dir.display()
            );
            None
        }
    }
}

/// The end-of-sequence ids an engine on `dir` stops on, as transformers' generate()
/// does: `generation_config.json`'s `eos_token_id` (one id or a list; `config.json`'s
/// when it has none), plus the tokenizer's end-of-turn token. Ids that are not in
/// the vocabulary are dropped with a warning ([`crate::config::token_ids`]), never
/// wrapped; an unreadable or malformed `generation_config.json` counts as absent, as
/// in transformers. Computed without loading weights, so a server can compile
/// grammars for the engine before it loads.
pub fn eos_ids(dir: &Path, cfg: &ModelConfig, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
    let path = dir.join("generation_config.json");
    let gen: Option<serde_json::Value> =
        voom_formats::file::read_limited(&path, voom_formats::file::SIDE_FILE_MAX_BYTES)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
    let mut eos = crate::config::token_ids(
        gen.as_ref().and_then(|g| g.get("eos_token_id")),
        "eos_token_id",
        cfg.vocab_size,
        &path,
    );
    if eos.is_empty() {
        eos = cfg.eos_token_ids.clone();
    }
    if let Some(t) = tokenizer {
        eos.extend_from_slice(t.eos_ids());
    }
    eos.sort_unstable();
    eos.dedup();
    eos
}

impl Engine {
    /// Opens a model directory through the embedded store.
    pub fn open(dir: &Path, opts: EngineOptions) -> Result<Self, VoomError> {
        let store = EmbeddedStore::open(dir, opts.verify)?;
        Self::with_source(dir, Arc::new(store), opts)
    }

    /// Opens a model directory (config, tokenizer) whose weights come from `source`.
    pub fn with_source(
        dir: &Path,
        source: Arc<dyn PageSource>,
        opts: EngineOptions,
    ) -> Result<Self, VoomError> {
        let cfg = ModelConfig::from_dir(dir)?;
        let name = dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| dir.display().to_string());
        let model = model::load(cfg, source.as_ref(), &name, opts.backend, opts.threads)?;
        let placements = Arc::new(placed::Placements::open(
            Arc::clone(&source),
            model.as_ref(),
        ));
        let layout = |m: &dyn Model| {
            let kv = m.new_kv(1, 1);
            (kv.layers(), kv.width())
        };
        let kv_layout = layout(model.as_ref());
        let mtp_kv_layout = model.mtp().map_or((0, 0), layout);
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(Tokenizer::from_dir(dir)?)
        } else {
            None
        };
        let eos = eos_ids(dir, model.config(), tokenizer.as_ref());
        // Reusing a prefix continues from positions computed in another pass: exact
        // only on a batch-invariant backend.
        let invariant = model.batch_invariant() && !opts.distrust_batch_invariance;
        if !invariant {
            tracing::warn!(
                backend = %model.backend_name(),
                "{}",
                NOT_INVARIANT
            );
        }
        let prefix_bytes = if invariant {
            opts.prefix_cache_bytes
        } else {
            0
        };
        let opts_kv_pool = opts
            .kv_budget
            .as_ref()
            .map(|(bytes, dir)| KvPool::new(*bytes, dir));
        // A snapshot is keyed by the manifest: it is written (and read) only by a
        // run whose every page was checked against that manifest, or a copy of the
        // model with changed weights would leave KV the genuine one reuses.
        let verified = source.verifies();
        let has_manifest = dir.join(voom_formats::manifest::MANIFEST_FILE).exists();
        if opts.prefix_disk.is_some() && invariant && !verified && has_manifest {
            tracing::warn!(
                "model {name}: prompt prefixes are not persisted: {} serves pages not verified against the page manifest (verification is off)",
                source.describe()
            );
        }
        let snapshots = opts
            .prefix_disk
            .as_ref()
            .filter(|_| invariant && verified)
            .and_then(|cfg| open_snapshots(dir, &name, model.as_ref(), cfg));
        Ok(Engine {
            dir: dir.to_path_buf(),
            name,
            model,
            source,
            tokenizer,
            eos,
            opts,
            placements,
            kv_layout,
            mtp_kv_layout,
            prefixes: Arc::new(std::sync::Mutex::new(prefix::PrefixCache::new(
                prefix_bytes,
            ))),
            snapshots,
            trace: std::sync::Mutex::new(None),
            kv_pool: opts_kv_pool,
        })
    }

    /// Starts recording which routed experts each forward pass reads (a mixture of
    /// experts; a dense model's passes read none), dropping what was recorded before.
    pub fn record_expert_trace(&self) {
        *self.trace.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
    }

    /// Stops recording and returns the routing trace of the passes since
    /// [`Engine::record_expert_trace`] (`None` if it was not recording), with its
    /// header: the layers that route and each one's expert bytes.
    pub fn take_expert_trace(&self) -> Option<vpaged::expert_trace::Trace> {
        use vpaged::expert_trace::{Trace, TraceHeader, TRACE_VERSION};
        let passes = self
            .trace
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        let cfg = self.model.config();
        let moe = cfg.moe.as_ref();
        let plan = self.model.plan();
        let layers: Vec<usize> = (0..cfg.num_layers)
            .filter(|&l| !plan.layers[l].experts().is_empty())
            .collect();
        let pages = self.source.pages();
        Some(Trace {
            header: TraceHeader {
                voom_expert_trace: TRACE_VERSION,
                model: self.name.clone(),
                num_experts: moe.map_or(0, |m| m.num_experts as u32),
                top_k: moe.map_or(0, |m| m.top_k as u32),
                layers: layers.iter().map(|&l| l as u32).collect(),
                // One expert's pages (a fused tensor shared by all counts whole).
                expert_bytes: layers
                    .iter()
                    .map(|&l| {
                        plan.layers[l].experts()[0]
                            .iter()
                            .map(|id| pages[id.0 as usize].len)
                            .sum()
                    })
                    .collect(),
            },
            passes,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    pub fn model(&self) -> &dyn Model {
        self.model.as_ref()
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    pub fn source(&self) -> &dyn PageSource {
        self.source.as_ref()
    }

    /// A shared handle on the page source (to read its statistics from elsewhere).
    pub fn source_arc(&self) -> Arc<dyn PageSource> {
        Arc::clone(&self.source)
    }

    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    pub fn threads(&self) -> usize {
        self.model.threads()
    }

    /// The backend it computes on ("cpu-avx2").
    /// Whether its backend is batch invariant ([`crate::backend::Backend::batch_invariant`]).
    /// Where not, prefix reuse, speculation and batching are off (each sequence a
    /// pass of its own, its prompt in one pass), so that the ids stay exact.
    pub fn batch_invariant(&self) -> bool {
        self.model.batch_invariant() && !self.opts.distrust_batch_invariance
    }

    /// The lossy scheme of the model's weights (`q4_k_m`: a quantized GGUF kept as
    /// stored, `docs/lossy.md`); `None` for weights as published (exact).
    pub fn lossy_scheme(&self) -> Option<&str> {
        self.config().quant.scheme()
    }

    /// What the engine turned off to keep the ids exact on this backend (`None`:
    /// nothing).
    pub fn exactness_note(&self) -> Option<String> {
        (!self.batch_invariant()).then(|| format!("{}: {NOT_INVARIANT}", self.backend_name()))
    }

    /// Bytes of weight and KV pages the backend copied instead of computing on them
    /// in place, over the engine's life ([`crate::backend::Backend::copied_bytes`]).
    pub fn backend_copied_bytes(&self) -> u64 {
        self.model.backend_copied_bytes()
    }

    /// Graph evaluations of a lazy backend over the engine's life (MLX: one a layer
    /// and one for the logits, each pass; 0 on the CPU)
    /// ([`crate::backend::Backend::evaluations`]).
    pub fn backend_evaluations(&self) -> u64 {
        self.model.backend_evaluations()
    }

    /// Multiply-adds of the products and attention computed over the engine's life
    /// ([`crate::backend::Backend::multiply_adds`]).
    pub fn backend_multiply_adds(&self) -> u64 {
        self.model.backend_multiply_adds()
    }

    pub fn backend_name(&self) -> String {
        self.model.backend_name()
    }

    /// The longest context this engine accepts.
    pub fn max_context(&self) -> usize {
        self.opts
            .max_context
            .unwrap_or(usize::MAX)
            .min(self.config().max_position_embeddings)
    }

    /// The longest prefix of `prompt` computed before, from memory, or from disk
    /// where a snapshot holds a longer one (then kept in memory too).
    pub(crate) fn take_prefix(&self, prompt: &[u32]) -> Option<KvCache> {
        let mem = self.prefixes().take(prompt);
        let need = mem.as_ref().map_or(prefix::MIN_PREFIX, |kv| kv.len() + 1);
        if let Some(s) = &self.snapshots {
            // `take` checked the snapshot's ids against the prompt; so does this,
            // before its KV reaches the memory cache (where a wrong one would stick).
            let kv = s
                .take(prompt, need, &self.new_kv())
                .filter(|kv| kv.ids().get(..kv.len()) == prompt.get(..kv.len()));
            if let Some(kv) = kv {
                let mut p = self.prefixes();
                p.insert(&prompt[..kv.len()], &kv);
                p.count_reused(kv.len());
                return Some(kv);
            }
        }
        if let Some(kv) = &mem {
            self.prefixes().count_reused(kv.len());
        }
        mem
    }

    /// Whether it keeps prompt prefixes for reuse (in memory or on disk).
    pub(crate) fn keeps_prefixes(&self) -> bool {
        self.opts.prefix_cache_bytes > 0 || self.snapshots.is_some()
    }

    /// Keeps `kv`'s positions of `ids` for reuse in memory and, when `persist`, on
    /// disk.
    pub(crate) fn keep_prefix(&self, ids: &[u32], kv: &KvCache, persist: bool) {
        self.prefixes().insert(ids, kv);
        if let (true, Some(s)) = (persist, &self.snapshots) {
            s.save(ids, kv);
        }
    }

    /// Waits until the prefix snapshots asked for are written.
    pub fn flush_prefixes(&self) {
        if let Some(s) = &self.snapshots {
            s.flush();
        }
    }

    /// The prefix snapshots on disk: how many, their bytes, and why persistence is
    /// off if it is (`None` without snapshots).
    pub fn snapshot_status(&self) -> Option<(usize, u64, Option<String>)> {
        self.snapshots.as_ref().map(|s| {
            let (n, b) = s.held();
            (n, b, s.off())
        })
    }

    /// The prompt-prefix cache (its counters; [`prefix::PrefixCache`]).
    pub fn prefixes(&self) -> std::sync::MutexGuard<'_, prefix::PrefixCache> {
        self.prefixes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A fresh KV cache for one sequence (its pages in the engine's KV budget, when
    /// it has one).
    pub fn new_kv(&self) -> KvCache {
        let kv = self
            .model
            .new_kv(self.max_context(), self.opts.kv_page_positions);
        match &self.kv_pool {
            Some(pool) => kv.in_pool(pool),
            None => kv,
        }
    }

    /// Starts the memory governor ([`governor`]) over this engine's caches: a
    /// thread that lives as long as the engine. Its lever on the weights (where
    /// they are in an in-process page cache) is [`placed::Placements`].
    pub fn govern(&self, cfg: governor::GovernorConfig) -> governor::GovernorHandle {
        let weights = self.placements.govern().then_some(&self.placements);
        governor::start(cfg, &self.prefixes, self.kv_pool.as_ref(), weights)
    }

    /// The weight budget: as placed at open, and what a memory governor took back.
    pub fn weight_budget(&self) -> placed::WeightBudget {
        self.placements.budget()
    }

    /// The placements of its weights: the lever a memory governor (or an operator)
    /// takes weight budget back and gives it back with.
    pub fn weights(&self) -> &placed::Placements {
        &self.placements
    }

    /// The budget of its KV caches' pages, when it has one.
    pub fn kv_pool(&self) -> Option<&KvPool> {
        self.kv_pool.as_ref()
    }

    /// What the KV budget did: pages spilled, read back, lost and recomputed.
    pub fn kv_pool_stats(&self) -> Option<KvPoolStats> {
        self.kv_pool.as_ref().map(|p| p.stats())
    }

    /// Runs `tokens` after what `kv` holds and returns the last position's logits.
    /// One forward pass (one sweep of the weights), each layer computing the
    /// positions `prefill_chunk` at a time; the result does not depend on the
    /// chunking.
    pub fn prefill(&self, kv: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>, VoomError> {
        self.prefill_timed(kv, tokens, &mut Duration::default())
    }

    /// [`Engine::prefill`], adding the time its passes waited for pages to `waited`.
    fn prefill_timed(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        waited: &mut Duration,
    ) -> Result<Vec<f32>, VoomError> {
        self.forward_checked(kv, tokens, Logits::Last, waited)
    }

    /// Logits of every position of `tokens` after what `kv` holds.
    pub fn forward_all(&self, kv: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>, VoomError> {
        self.forward_checked(kv, tokens, Logits::All, &mut Duration::default())
    }

    /// Adds `sweep`'s pass over `positions` tokens to the routing trace, when one is
    /// recorded.
    fn trace_pass(&self, sweep: &Sweep<'_>, positions: usize) {
        let mut trace = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(passes) = trace.as_mut() {
            passes.push(vpaged::expert_trace::TracePass {
                positions: positions as u32,
                experts: sweep
                    .routes()
                    .into_iter()
                    .map(|(_, experts)| experts.into_iter().map(|e| e as u32).collect())
                    .collect(),
            });
        }
    }

    /// One forward pass, then the source's check that the bytes it computed on were
    /// the verified pages ([`PageSource::check_reads`]). The pass's positions are
    /// committed to `kv` only when both succeed; on `Err` the logits are discarded
    /// and the positions cut (their keys and values came from the same bytes), so
    /// `kv` is as it was. The check runs after a failed pass too: when the pass
    /// failed for another reason than the store, the check's error (bytes that were
    /// not the pages) is the one reported. Adds the time the pass waited for pages
    /// to `waited`.
    fn forward_checked(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        want: Logits,
        waited: &mut Duration,
    ) -> Result<Vec<f32>, VoomError> {
        let mut seqs = [SeqPass::new(tokens, kv, want)];
        let mut out = self.forward_batch_timed(&mut seqs, waited)?;
        Ok(out.pop().expect("one sequence, one result"))
    }

    /// One forward pass over several sequences, in one sweep of the weights
    /// ([`Model::forward_batch`]): each sequence's `tokens` after what its `kv`
    /// holds, its logits as its `want` asks. Each position's logits bits are the ones
    /// it gets computed alone. Checked and committed as one pass: on `Err` every
    /// sequence's KV is as it was.
    pub fn forward_batch(&self, seqs: &mut [SeqPass<'_>]) -> Result<Vec<Vec<f32>>, VoomError> {
        self.forward_batch_timed(seqs, &mut Duration::default())
    }

    /// [`Engine::forward_batch`], adding the time the pass waited for pages to
    /// `waited`. The source's check that the bytes computed on were the verified
    /// pages ([`PageSource::check_reads`]) runs after the pass, failed or not: when
    /// the pass failed for another reason than the store, the check's error (bytes
    /// that were not the pages) is the one reported.
    fn forward_batch_timed(
        &self,
        seqs: &mut [SeqPass<'_>],
        waited: &mut Duration,
    ) -> Result<Vec<Vec<f32>>, VoomError> {
        self.pass(self.model.as_ref(), seqs, waited)
    }

    /// Why this engine's model has no multi-token-prediction layer to draft with
    /// ([`crate::mtp::MtpDrafter`]), or `Ok`.
    pub fn check_mtp(&self) -> Result<(), VoomError> {
        self.model.mtp().map(|_| ()).map_err(|why| {
            VoomError::Request(format!(
                "model {} cannot draft with multi-token prediction: {why}",
                self.name
            ))
        })
    }

    /// A fresh KV cache for the multi-token-prediction layer of one sequence.
    pub fn new_mtp_kv(&self) -> Result<KvCache, VoomError> {
        self.check_mtp()?;
        let m = self.model.mtp().expect("checked");
        Ok(m.new_kv(self.max_context(), self.opts.kv_page_positions))
    }

    /// A pass of the multi-token-prediction layer ([`crate::model::Model::mtp`]) over
    /// several sequences, each with its [`SeqPass::hidden_in`]: checked and committed
    /// as [`Engine::forward_batch`]'s, over the same page source.
    pub fn mtp_forward(&self, seqs: &mut [SeqPass<'_>]) -> Result<Vec<Vec<f32>>, VoomError> {
        self.check_mtp()?;
        let m = self.model.mtp().expect("checked");
        self.pass(m, seqs, &mut Duration::default())
    }

    /// One checked pass of `model` (this engine's, or its multi-token-prediction
    /// layer's) following its walk of the placement the pass holds until it ends
    /// ([`placed::Placements::begin_pass`]); only the decoder's passes join the
    /// routing trace.
    ///
    /// A sequence whose KV cache lost positions (a spilled page that failed its
    /// checksum: [`KvCache::lost`]) has them computed again from their token ids
    /// first: the same bits, since a position's KV does not depend on how its
    /// prompt was cut into passes. A pass that finds a page lost is retried once
    /// that way.
    fn pass(
        &self,
        model: &dyn Model,
        seqs: &mut [SeqPass<'_>],
        waited: &mut Duration,
    ) -> Result<Vec<Vec<f32>>, VoomError> {
        let placed = self.placements.begin_pass();
        for attempt in 0.. {
            for s in seqs.iter_mut() {
                self.recompute_lost(model, &placed, s.kv, waited)?;
            }
            match self.pass_once(model, &placed, seqs, waited) {
                Err(e)
                    if attempt < MAX_RECOVERIES && seqs.iter().any(|s| s.kv.lost().is_some()) =>
                {
                    tracing::warn!("{e}: recomputing the lost positions, then the pass again");
                }
                r => return r,
            }
        }
        unreachable!("the loop returns")
    }

    /// Computes again the positions `kv` lost ([`KvCache::take_lost`]), until none
    /// is (each pass may find another damaged page among the ones it reads).
    fn recompute_lost(
        &self,
        model: &dyn Model,
        placed: &placed::Placed,
        kv: &mut KvCache,
        waited: &mut Duration,
    ) -> Result<(), VoomError> {
        // The ids to compute after what `kv` holds: a pass that fails on another
        // damaged page cuts `kv` back further, and those ids go before these.
        let mut pending: Vec<u32> = Vec::new();
        for attempt in 0.. {
            if let Some(from) = kv.lost() {
                let Some(mut ids) = kv.take_lost() else {
                    return Err(VoomError::Request(format!(
                        "KV positions from {from} on were lost and their token ids are not known"
                    )));
                };
                tracing::warn!(
                    "recomputing {} KV positions from {from} on (a spilled page was lost)",
                    ids.len()
                );
                if let Some(pool) = kv.pool() {
                    pool.note_recomputed(ids.len());
                }
                ids.append(&mut pending);
                pending = ids;
            }
            if pending.is_empty() {
                return Ok(());
            }
            let mut one = [SeqPass::new(&pending, kv, Logits::Last)];
            match self.pass_once(model, placed, &mut one, waited) {
                Ok(_) => return Ok(()),
                Err(e) if attempt >= MAX_RECOVERIES || kv.lost().is_none() => return Err(e),
                Err(_) => {}
            }
        }
        unreachable!("the loop returns")
    }

    /// [`Engine::pass`] without the recovery of lost positions.
    fn pass_once(
        &self,
        model: &dyn Model,
        placed: &placed::Placed,
        seqs: &mut [SeqPass<'_>],
        waited: &mut Duration,
    ) -> Result<Vec<Vec<f32>>, VoomError> {
        if seqs.is_empty() {
            return Err(VoomError::Request("no sequences to compute".into()));
        }
        // The layout of the model's caches (computed once per engine), and its walk.
        let (layout, walk) = if std::ptr::addr_eq(model, self.model.as_ref()) {
            (self.kv_layout, &placed.walk)
        } else {
            let walk = placed.mtp_walk.as_ref();
            (
                self.mtp_kv_layout,
                walk.expect("a model with an MTP layer has its walk"),
            )
        };
        for s in seqs.iter() {
            if (s.kv.layers(), s.kv.width()) != layout {
                return Err(VoomError::Request(format!(
                    "a KV cache of {} layers of {} floats for a model of {} of {}",
                    s.kv.layers(),
                    s.kv.width(),
                    layout.0,
                    layout.1
                )));
            }
            self.check_pass(s.kv, s.tokens)?;
        }
        let starts: Vec<usize> = seqs.iter().map(|s| s.kv.len()).collect();
        let chunk = self.opts.prefill_chunk.max(1);
        let positions: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        // The planner's streaming room, less what a memory governor took back from
        // the cache since (never below the least a sweep works in: see `placed`).
        let room = placed.room(self.source.cache_withheld());
        let sweep = Sweep::new(
            self.source.as_ref(),
            model.plan(),
            self.opts.prefetch_depth,
            room,
            walk,
            seqs.iter().map(|s| s.tokens.len().div_ceil(chunk)).sum(),
        )
        .with_value_checks(model.value_checks());
        sweep.set_expert_prefetch(self.opts.expert_prefetch);
        sweep.set_expert_hold(self.opts.expert_hold_bytes);
        let pass = model.forward_batch(&sweep, seqs, chunk);
        *waited += sweep.waited();
        if pass.is_ok() && std::ptr::addr_eq(model, self.model.as_ref()) {
            self.trace_pass(&sweep, positions);
        }
        // Every lease of the pass is dropped by now.
        sweep.finish();
        let r = match (pass, self.source.check_reads()) {
            (Ok(logits), Ok(())) => Ok(logits),
            (Ok(_), Err(e)) => Err(e.into()),
            (Err(e @ VoomError::Store(_)), _) | (Err(e), Ok(())) => Err(e),
            (Err(_), Err(e)) => Err(e.into()),
        };
        match r {
            Ok(logits) => {
                for s in seqs.iter_mut() {
                    s.kv.commit(s.tokens);
                }
                Ok(logits)
            }
            Err(e) => {
                for (s, &start) in seqs.iter_mut().zip(&starts) {
                    s.kv.truncate(start);
                }
                Err(e)
            }
        }
    }

    /// What every architecture's pass may assume: tokens to compute, each in the
    /// vocabulary, and room for them in `kv`.
    fn check_pass(&self, kv: &KvCache, tokens: &[u32]) -> Result<(), VoomError> {
        let vocab = self.config().vocab_size;
        if tokens.is_empty() {
            return Err(VoomError::Request("no tokens to compute".into()));
        }
        if let Some(&tok) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(VoomError::Request(format!(
                "token id {tok} is out of range for a vocabulary of {vocab}"
            )));
        }
        let (pos0, n) = (kv.len(), tokens.len());
        if pos0 + n > kv.capacity() {
            let full = crate::backend::KernelError::ContextFull {
                cached: pos0,
                new: n,
                limit: kv.capacity(),
            };
            return Err(VoomError::Request(full.to_string()));
        }
        Ok(())
    }

    /// Generates after `prompt`. `on_token` sees each new id as it is chosen and may
    /// stop generation.
    pub fn generate(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
        on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
    ) -> Result<Generation, VoomError> {
        self.generate_with(prompt, params, Decoding::default(), on_token)
    }

    /// Generates after `prompt` what `constraint` allows (see
    /// [`crate::constrain`]). Before each token the constraint's mask is applied:
    /// the sampler (greedy, temperature, top-k, top-p, as `params.sampling` says)
    /// chooses among the allowed ids only, exactly as if every other logit were
    /// negative infinity. Ids past the tokenizer's vocabulary are never allowed.
    /// The engine's end-of-sequence ids are allowed only when the
    /// constraint may stop; one of them ends generation with [`FinishReason::Eos`]
    /// (included in `ids`, as in [`Engine::generate`]; `params.ignore_eos` has no
    /// effect here). When the constraint admits no further token, generation ends
    /// with [`FinishReason::Complete`] without generating an end-of-sequence token, so
    /// the ids (an end-of-sequence id aside) decode to exactly the constrained output.
    /// `max_new_tokens` and the context limit still apply ([`FinishReason::Length`]:
    /// the output is then incomplete). Recorded logits are the model's, unmasked.
    pub fn generate_constrained(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
        constraint: &mut dyn TokenConstraint,
        on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
    ) -> Result<Generation, VoomError> {
        self.generate_with(
            prompt,
            params,
            Decoding {
                constraint: Some(constraint),
                drafter: None,
            },
            on_token,
        )
    }

    /// Chooses the next token among those `constraint` allows: masks (scratch
    /// buffers reused across steps), then samples over the allowed logits.
    fn pick_constrained(
        &self,
        constraint: &mut dyn TokenConstraint,
        step: usize,
        logits: &[f32],
        sampler: &mut Sampler,
        scratch: &mut ConstrainScratch,
    ) -> Result<u32, ConstrainError> {
        if scratch.mask.len() != logits.len() {
            scratch.mask = TokenMask::new(logits.len());
        } else {
            scratch.mask.clear();
        }
        constraint.fill_mask(step, &mut scratch.mask)?;
        if let Some(t) = &self.tokenizer {
            // Ids past the tokenizer (padded embeddings) are never generated.
            scratch.mask.disallow_from(t.vocab_size());
        }
        let may_stop = constraint.may_stop(step)?;
        for &e in &self.eos {
            if may_stop {
                scratch.mask.allow(e);
            } else {
                scratch.mask.disallow(e);
            }
        }
        scratch
            .mask
            .gather(logits, &mut scratch.ids, &mut scratch.values);
        if scratch.ids.is_empty() {
            return Err(ConstrainError::NothingAllowed {
                step,
                vocab: logits.len(),
            });
        }
        let k = sampler.sample(&scratch.values) as usize;
        Ok(scratch.ids[k])
    }

    /// Generates after `prompt` as [`Engine::generate`] or, with a constraint,
    /// [`Engine::generate_constrained`] do, with `decoding`'s drafter (if any)
    /// proposing tokens that each pass verifies beside the one it computes
    /// ([`crate::speculate`]): the ids and recorded logits are the same bits, greedy
    /// or sampled, in fewer passes where the proposals are kept.
    /// [`Generation::speculation`] reports what the drafter did.
    pub fn generate_with(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
        decoding: Decoding<'_>,
        on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
    ) -> Result<Generation, VoomError> {
        let mut s = self.sequence(prompt, params, decoding)?;
        if s.finished() {
            return Ok(s.into_generation());
        }
        let before = self.source.cache_stats();
        let mut at_decode = None;
        while !s.finished() {
            let prefilling = s.prefilling();
            // Alone, the prompt is one pass.
            self.step(&mut [&mut s], usize::MAX, &mut |_, id| on_token(id))?;
            if let Some(e) = s.take_error() {
                return Err(e);
            }
            if prefilling && !s.prefilling() {
                at_decode = self.source.cache_stats();
            }
        }
        let mut out = s.into_generation();
        let end = self.source.cache_stats();
        out.pages = PageTraffic::between(before.as_ref(), end.as_ref());
        out.decode_pages = PageTraffic::between(at_decode.as_ref(), end.as_ref());
        // One line per generation (VOOM_LOG=libvoom=info shows it).
        tracing::info!(
            model = %self.name,
            source = %self.source.describe(),
            prompt_tokens = out.prompt_tokens,
            generated = out.ids.len(),
            prefill_tok_s = format_args!("{:.2}", out.prefill_tokens_per_sec()),
            decode_tok_s = format_args!("{:.2}", out.decode_tokens_per_sec()),
            decode_page_wait_s = format_args!("{:.3}", out.decode_page_wait_secs),
            cache_hit_ratio = out.pages.map(|p| p.hit_ratio()),
            bytes_loaded = out.pages.map(|p| p.bytes_loaded),
            primary_read_bytes = out.pages.map(|p| p.primary_bytes),
            fast_tier_read_bytes = out.pages.map(|p| p.fast_tier_bytes),
            nas_read_bytes = out.pages.map(|p| p.nas_bytes),
            "generation finished: {}",
            out.finish.as_str()
        );
        Ok(out)
    }
}

/// Buffers of constrained sampling, reused across the steps of one generation.
#[derive(Default)]
struct ConstrainScratch {
    mask: TokenMask,
    ids: Vec<u32>,
    values: Vec<f32>,
}

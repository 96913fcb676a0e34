//! How a memory budget becomes the engine's page store.
//!
//! The budget is a ceiling for the whole process. What the run needs besides weights
//! is set aside first ([`Needs`]: the KV cache at the planned context, the scratch of
//! the largest pass, the page store's read buffers, and the process itself as
//! measured once the model is open, plus a margin for its growth). Then the memory
//! planner ([`placement::place`]) places the weights in what is left:
//!
//! - everything fits: the memory-mapped store, whose pages the kernel keeps resident
//!   (no copy, shared with every process mapping the same files);
//! - it does not: an in-process page cache of the room left, in which the planner
//!   pins the pages that save the most reads per token, and through which the others
//!   stream, read around the OS page cache;
//! - not even the streaming window of its largest step fits: an error that says how
//!   much the model needs.
//!
//! The budget comes from `memory_budget` (flag, environment or profile). Instead,
//! `cache_budget` sizes the cache itself, and `memory_mapped` asks for the
//! memory-mapped store whatever the model's size; of those given, the one with the
//! highest precedence is used ([`sizing`]). With none, the budget is the memory
//! available when the engine opens, and then only a model that does not fit in it
//! is planned (one that fits is memory-mapped, and its context is not bounded by
//! the plan).

use libvoom::engine::Engine;
use libvoom::placement::{self, human, Needs, Placement, PlacementError};
use voom_formats::Manifest;
use vpaged::store::IoConfig;

use crate::profile::{Resolved, Source};

/// Memory the process may grow by while it runs, beyond what it holds once the
/// model is open (heap fragmentation, request buffers), counted as part of it.
pub const PROCESS_MARGIN: u64 = 32 << 20;

/// The process's own memory where it cannot be measured (no `/proc`).
pub const PROCESS_GUESS: u64 = 96 << 20;

/// The budget a run plans with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    pub bytes: u64,
    /// Where it comes from: `flag --memory-budget`, `MemAvailable`, a cgroup.
    pub from: String,
    /// Set by the user (`memory_budget`): a ceiling that bounds the context and is
    /// an error when too small. Otherwise the memory available now: used only for
    /// a model that does not fit in it.
    pub explicit: bool,
}

/// How the settings size the weights' memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sizing {
    /// `memory_mapped`: the memory-mapped store, unplanned.
    Mapped,
    /// `cache_budget`: an in-process page cache of these bytes, as given.
    Cache(u64),
    /// A budget for the whole process, to plan.
    Memory(Budget),
}

/// What the settings ask for: `memory_budget`, `cache_budget` or `memory_mapped`
/// (resolving keeps at most one of them: `profile::resolve`). With none, the budget
/// is `available()`, the memory available now and where that figure comes from;
/// where it cannot be known (`None`), the model is memory-mapped, unplanned.
pub fn sizing(resolved: &Resolved, available: impl FnOnce() -> Option<(u64, String)>) -> Sizing {
    let s = &resolved.settings;
    let source = |key: &str| {
        resolved
            .sources
            .get(key)
            .cloned()
            .unwrap_or(Source::Default)
    };
    if let Some(bytes) = s.memory_budget {
        return Sizing::Memory(Budget {
            bytes,
            from: source("memory_budget").to_string(),
            explicit: true,
        });
    }
    if let Some(bytes) = s.cache_budget {
        return Sizing::Cache(bytes);
    }
    if s.memory_mapped {
        return Sizing::Mapped;
    }
    match available() {
        Some((bytes, from)) => Sizing::Memory(Budget {
            bytes,
            from: format!("the memory available now: {from}"),
            explicit: false,
        }),
        None => Sizing::Mapped,
    }
}

/// What a run of `engine`'s model needs besides weights: KV for `context`
/// positions (and a hybrid's recurrent states), the scratch of a prompt of the whole context computed
/// `prefill_chunk` positions at a time, the read buffers of a page store reading
/// with `io` (its vpack bodies too, where `manifest` has them), and `process`
/// bytes (the process as measured, or [`PROCESS_GUESS`]) plus [`PROCESS_MARGIN`].
pub fn needs(
    engine: &Engine,
    context: usize,
    prefill_chunk: usize,
    io: &IoConfig,
    manifest: Option<&Manifest>,
    process: Option<u64>,
) -> Needs {
    let model = engine.model();
    Needs {
        // A hybrid's recurrent states beside its keys and values.
        kv_bytes: model.kv_bytes_per_position() * context as u64 + model.state_bytes(),
        scratch_bytes: model.scratch_bytes(context, prefill_chunk, context),
        process_bytes: process.unwrap_or(PROCESS_GUESS) + PROCESS_MARGIN,
        io_bytes: io.buffer_bytes(manifest),
    }
}

/// The page store a budget chooses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Store {
    /// Everything fits: the memory-mapped store.
    Mapped,
    /// An in-process page cache of `cache_bytes` (the budget less the needs),
    /// placed as `placement` says.
    Cache {
        cache_bytes: u64,
        placement: Placement,
    },
}

/// The store for `plan`'s pages under `budget` with `needs` set aside.
pub fn choose(
    plan: &libvoom::model::plan::PagePlan,
    needs: &Needs,
    budget: u64,
) -> Result<Store, PlacementError> {
    let p = placement::place(plan, needs, budget)?;
    if p.streamed_per_token == 0 {
        return Ok(Store::Mapped);
    }
    Ok(Store::Cache {
        cache_bytes: budget - needs.total(),
        placement: p,
    })
}

/// One line on what a budget chose, for the log and stderr.
pub fn describe(budget: &Budget, needs: &Needs, store: &Store) -> String {
    match store {
        Store::Mapped => format!(
            "memory budget {} ({}): the model fits, memory-mapped",
            human(budget.bytes),
            budget.from
        ),
        Store::Cache {
            cache_bytes,
            placement: p,
        } => format!(
            "memory budget {} ({}): {} for KV, scratch, read buffers and the process; \
             a {} page cache pins {} and streams {} per token from storage",
            human(budget.bytes),
            budget.from,
            human(needs.total()),
            human(*cache_bytes),
            human(p.pinned_bytes),
            human(p.streamed_per_token)
        ),
    }
}

/// The plan as JSON, for `voom generate --json`.
pub fn to_json(budget: &Budget, needs: &Needs, store: &Store) -> serde_json::Value {
    let (kind, cache, placement) = match store {
        Store::Mapped => ("memory-mapped", None, None),
        Store::Cache {
            cache_bytes,
            placement,
        } => ("page cache", Some(*cache_bytes), Some(placement)),
    };
    serde_json::json!({
        "bytes": budget.bytes,
        "from": budget.from,
        "explicit": budget.explicit,
        "needs": {
            "kv": needs.kv_bytes,
            "scratch": needs.scratch_bytes,
            "process": needs.process_bytes,
            "read_buffers": needs.io_bytes,
        },
        "store": kind,
        "cache_bytes": cache,
        "pinned_bytes": placement.map(|p| p.pinned_bytes),
        "streamed_bytes_per_token": placement.map(|p| p.streamed_per_token),
        "minimum_budget": placement.map(|p| p.minimum_budget()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{self, Overrides, ProfileDirs, ProfileError};

    /// The profile `p` (with `text`, inheriting `parent` when given) or the default,
    /// resolved with `flags` and `env`.
    fn resolve(
        flags: Overrides,
        env: Overrides,
        text: Option<&str>,
    ) -> Result<Resolved, ProfileError> {
        let d = tempfile::tempdir().unwrap();
        let dirs = match text {
            Some(t) => {
                std::fs::write(d.path().join("p.yaml"), t).unwrap();
                ProfileDirs::new(Some(d.path().to_path_buf()), None).unwrap()
            }
            None => ProfileDirs::builtin_only(),
        };
        let name = if text.is_some() { "p" } else { "default" };
        profile::resolve(&dirs, name, &flags, &env)
    }

    fn never() -> Option<(u64, String)> {
        panic!("the available memory is not asked for when a budget is set")
    }

    #[test]
    fn the_setting_given_with_the_highest_precedence_sizes_the_memory() {
        let none = Overrides::default;
        // None: the memory available now, not explicit; unknown: memory-mapped.
        let r = resolve(none(), none(), None).unwrap();
        let s = sizing(&r, || Some((5 << 30, "MemAvailable".into())));
        assert_eq!(
            s,
            Sizing::Memory(Budget {
                bytes: 5 << 30,
                from: "the memory available now: MemAvailable".into(),
                explicit: false
            })
        );
        assert_eq!(sizing(&r, || None), Sizing::Mapped);

        // One of them.
        let flags = Overrides {
            memory_budget: Some(3 << 30),
            ..none()
        };
        let r = resolve(flags, none(), None).unwrap();
        assert_eq!(
            sizing(&r, never),
            Sizing::Memory(Budget {
                bytes: 3 << 30,
                from: "flag --memory-budget".into(),
                explicit: true
            })
        );
        let r = resolve(none(), none(), Some("cache_budget: 1GiB\n")).unwrap();
        assert_eq!(sizing(&r, never), Sizing::Cache(1 << 30));

        // Both: the flag over the profile's, either way round, with a warning; the
        // one set aside is unset (so it bounds no context).
        let flags = Overrides {
            memory_budget: Some(3 << 30),
            ..none()
        };
        let r = resolve(flags, none(), Some("cache_budget: 1GiB\n")).unwrap();
        assert!(
            matches!(sizing(&r, never), Sizing::Memory(Budget { bytes, .. }) if bytes == 3 << 30)
        );
        assert_eq!(r.settings.cache_budget, None);
        let w = &r.warnings[0];
        assert!(
            w.contains("memory_budget (flag --memory-budget) is used")
                && w.contains("and cache_budget (profile")
                && w.ends_with("ignored"),
            "{w}"
        );
        let env = Overrides {
            cache_budget: Some(1 << 30),
            ..none()
        };
        let r = resolve(none(), env, Some("memory_budget: 3GiB\n")).unwrap();
        assert_eq!(sizing(&r, never), Sizing::Cache(1 << 30));
        assert_eq!(r.settings.memory_budget, None);
        assert!(r.warnings[0].contains("cache_budget (env VOOM_CACHE_BUDGET) is used"));

        // A child profile's over its parent's (low-memory sets cache_budget).
        let r = resolve(
            none(),
            none(),
            Some("inherits: low-memory\nmemory_budget: 3GiB\n"),
        )
        .unwrap();
        assert!(
            matches!(sizing(&r, never), Sizing::Memory(Budget { bytes, .. }) if bytes == 3 << 30)
        );
        assert_eq!(r.settings.cache_budget, None);

        // Both at one level: an error naming both.
        let e = resolve(
            none(),
            none(),
            Some("memory_budget: 3GiB\ncache_budget: 1GiB\n"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("memory_budget (profile") && e.contains("cache_budget (profile"),
            "{e}"
        );

        // The memory-mapped store, asked for over a profile's budget.
        let env = Overrides {
            memory_mapped: Some(true),
            ..none()
        };
        let r = resolve(none(), env, Some("memory_budget: 3GiB\n")).unwrap();
        assert_eq!(sizing(&r, never), Sizing::Mapped);
        assert!(r.warnings[0].starts_with("memory_mapped (env VOOM_MEMORY_MAPPED) is used"));
        let r = resolve(none(), none(), Some("memory_mapped: false\n")).unwrap();
        assert!(matches!(
            sizing(&r, || Some((1, "x".into()))),
            Sizing::Memory(_)
        ));
    }
}

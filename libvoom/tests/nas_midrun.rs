//! A model that lives on a NAS, under a live engine, while the NAS disappears mid-run
//! and comes back (issue 3). The model directory lies under a configured NAS mount and
//! the store's cache holds about one decoder layer, so every token reads pages from the
//! NAS again. The mount disappears from the generate callback (its directory is
//! renamed away, as an unmounted mount point loses its contents; open file handles
//! keep working, so only the mount's health check can notice).
//!
//! - Without a remount command, the next token fails with an error naming the page
//!   and the mount, promptly; resident pages are still served; once the directory is
//!   back, the same engine generates the embedded store's ids and logits bits.
//! - With a remount command that puts the directory back, generation continues across
//!   the outage with the embedded store's ids and logits bits.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libvoom::engine::{Engine, EngineOptions, GenerateParams};
use vpaged::cache::PageKey;
use vpaged::store::{Store, StoreConfig, StoreSource};
use vpaged::tier::{Health, ModelTier, NasConfig};

const CASE: &str = "llama_gqa_untied";
const TOKENS: usize = 10;
/// Tokens generated before the NAS disappears.
const BEFORE_OUTAGE: usize = 3;

fn copy_model(dir: &Path) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/tiny")
        .join(CASE);
    std::fs::create_dir_all(dir).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let ckpt = voom_formats::Checkpoint::open(dir).unwrap();
    voom_formats::Manifest::build(&ckpt, &mut |_, _| {})
        .unwrap()
        .save(dir)
        .unwrap();
}

/// A local copy (the reference, through the embedded store) and a copy on the "NAS"
/// at `<tmp>/nas/models/<case>`.
struct Setup {
    d: tempfile::TempDir,
    local: PathBuf,
    mount: PathBuf,
    away: PathBuf,
    on_nas: PathBuf,
}

impl Setup {
    fn new() -> Setup {
        let d = tempfile::tempdir().unwrap();
        let local = d.path().join("local").join(CASE);
        let mount = d.path().join("nas");
        let on_nas = mount.join("models").join(CASE);
        copy_model(&local);
        copy_model(&on_nas);
        Setup {
            away: d.path().join("nas.away"),
            local,
            mount,
            on_nas,
            d,
        }
    }

    fn nas_config(&self, remount_command: Option<String>) -> NasConfig {
        NasConfig {
            mount: self.mount.clone(),
            model: PathBuf::new(),
            timeout: Duration::from_secs(2),
            recheck: Duration::ZERO,
            remount_command,
        }
    }

    /// A store whose cache holds about one decoder layer (so every sweep evicts and
    /// reloads), over the NAS mount.
    fn store(&self, nas: NasConfig) -> Arc<Store> {
        let m = voom_formats::Manifest::load(&self.local).unwrap().unwrap();
        let mut per_layer = std::collections::HashMap::new();
        for p in &m.pages {
            if let voom_formats::manifest::PageGroup::Layer(l) = p.group {
                *per_layer.entry(l).or_insert(0usize) += p.len as usize;
            }
        }
        let layer = per_layer.into_values().max().unwrap();
        let largest_page = m.pages.iter().map(|p| p.len as usize).max().unwrap();
        let total: usize = m
            .pages
            .iter()
            .map(|p| (p.len as usize).next_multiple_of(16 << 10))
            .sum();
        let one_layer = (layer + 8 * (16 << 10))
            .max(largest_page * 2)
            .next_multiple_of(16 << 10);
        assert!(one_layer < total / 2, "{one_layer} of {total}: not paging");
        Store::new(StoreConfig {
            cache_bytes: one_layer,
            nas: vec![nas],
            ..Default::default()
        })
        .unwrap()
    }

    fn disappear(&self) {
        std::fs::rename(&self.mount, &self.away).unwrap();
    }

    fn come_back(&self) {
        std::fs::rename(&self.away, &self.mount).unwrap();
    }
}

fn prompt() -> Vec<u32> {
    (0..11).map(|i| (i * 23 + 5) % 200).collect()
}

fn params() -> GenerateParams {
    GenerateParams {
        max_new_tokens: TOKENS,
        ignore_eos: true,
        record_logits: true,
        ..Default::default()
    }
}

/// Ids and the logits' bits of each generated step.
type Bits = (Vec<u32>, Vec<Vec<u32>>);

fn bits(g: &libvoom::engine::Generation) -> Bits {
    (
        g.ids.clone(),
        g.logits
            .iter()
            .map(|l| l.iter().map(|v| v.to_bits()).collect())
            .collect(),
    )
}

fn reference(s: &Setup) -> Bits {
    let e = Engine::open(&s.local, EngineOptions::default()).unwrap();
    let g = e
        .generate(&prompt(), &params(), &mut |_| ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(g.ids.len(), TOKENS);
    bits(&g)
}

fn engine_on_nas(s: &Setup, store: &Arc<Store>) -> Engine {
    let src = StoreSource::open(Arc::clone(store), &s.on_nas).unwrap();
    let e = Engine::with_source(&s.on_nas, Arc::new(src), EngineOptions::default()).unwrap();
    // The model's weights are read through the NAS tier, never a plain directory.
    let m = store.model(0).unwrap();
    assert!(matches!(m.location(), ModelTier::Nas(_)));
    assert_eq!(m.nas_tier().unwrap().mount(), s.mount);
    e
}

#[test]
fn without_a_remount_the_next_token_fails_clearly_and_the_engine_resumes_after() {
    let s = Setup::new();
    let want = reference(&s);
    let store = s.store(s.nas_config(None));

    // Down at open: a clear error naming the mount, nothing opened.
    s.disappear();
    let e = StoreSource::open(Arc::clone(&store), &s.on_nas)
        .err()
        .expect("opening a model on a NAS that is down fails");
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("NAS mount {} is unavailable", s.mount.display())),
        "{msg}"
    );
    assert!(store.models().is_empty());
    s.come_back();

    let engine = engine_on_nas(&s, &store);
    let mut seen = Vec::new();
    let mut failed_at = None;
    let r = engine.generate(&prompt(), &params(), &mut |id| {
        seen.push(id);
        if seen.len() == BEFORE_OUTAGE {
            s.disappear();
            failed_at = Some(Instant::now());
        }
        ControlFlow::Continue(())
    });
    let took = failed_at.unwrap().elapsed();
    let e = r.expect_err("the token after the outage fails");
    let msg = e.to_string();
    assert!(
        msg.contains("page '")
            && msg.contains(&format!("NAS mount {} is unavailable", s.mount.display())),
        "{msg}"
    );
    // No hang: the failure is prompt (the NAS timeout is 2 s; a vanished directory
    // answers at once).
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert_eq!(seen, want.0[..BEFORE_OUTAGE], "tokens before the outage");

    // Pages already in the cache are still served while the NAS is down.
    let m = store.model(0).unwrap();
    assert!(matches!(m.nas_health(), Some(Health::Unavailable(_))));
    let resident: Vec<u32> = (0..m.pages.len() as u32)
        .filter(|&page| store.cache().resident(PageKey { model: 0, page }))
        .collect();
    assert!(!resident.is_empty());
    for &page in &resident {
        store.acquire(0, page).unwrap();
    }
    let missing = (0..m.pages.len() as u32)
        .find(|&page| !store.cache().present(PageKey { model: 0, page }))
        .unwrap();
    let e = store.acquire(0, missing).unwrap_err().to_string();
    assert!(
        e.contains(&format!("page '{}'", m.pages[missing as usize].name)),
        "{e}"
    );

    // The NAS comes back: the same engine over the same store generates the
    // embedded bits, nothing restarted.
    s.come_back();
    let g = engine
        .generate(&prompt(), &params(), &mut |_| ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(bits(&g), want);
    let nas = m.nas_tier().unwrap();
    assert!(nas.outages() >= 1 && nas.recoveries() >= 1);
    assert_eq!(m.nas_health(), Some(Health::Ok));
    let [fast, primary, from_nas] = m.served_counts();
    assert_eq!((fast, primary), (0, 0));
    assert!(from_nas > 0);
}

#[test]
fn with_a_remount_command_generation_continues_across_the_outage_bit_for_bit() {
    let s = Setup::new();
    let want = reference(&s);
    let log = s.d.path().join("remounts.log");
    let remount = format!(
        "if test -d '{away}'; then mv '{away}' '{mount}' && echo remounted >> '{log}'; fi",
        away = s.away.display(),
        mount = s.mount.display(),
        log = log.display()
    );
    let store = s.store(s.nas_config(Some(remount)));
    let engine = engine_on_nas(&s, &store);
    let m = store.model(0).unwrap();
    let loaded_before = std::cell::Cell::new(0);
    let mut seen = 0;
    let g = engine
        .generate(&prompt(), &params(), &mut |_| {
            seen += 1;
            if seen == BEFORE_OUTAGE {
                loaded_before.set(m.served_counts()[2]);
                s.disappear();
            }
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(bits(&g), want);

    // The outage happened, was seen and was repaired by the command, and the tokens
    // after it read their pages from the NAS again.
    let runs = std::fs::read_to_string(&log).unwrap().lines().count();
    assert!(runs >= 1, "the remount command ran {runs} times");
    assert!(s.mount.is_dir() && !s.away.exists());
    let nas = m.nas_tier().unwrap();
    assert!(
        nas.outages() >= 1 && nas.recoveries() >= 1,
        "outages {}, recoveries {}",
        nas.outages(),
        nas.recoveries()
    );
    assert!(m.served_counts()[2] > loaded_before.get());
    assert_eq!(m.nas_health(), Some(Health::Ok));
}

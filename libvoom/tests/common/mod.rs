//! Helpers shared by libvoom's integration tests over the committed fixtures.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The tiny random-weights checkpoints of every architecture (tests/fixtures/tiny).
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny")
}

/// The hybrid linear-attention checkpoints (tests/fixtures/tiny_hybrid).
pub fn hybrid_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny_hybrid")
}

/// Every fixture case's name and directory: the architectures of `tiny`, then the
/// hybrids of `tiny_hybrid`.
pub fn case_dirs() -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = cases()
        .into_iter()
        .map(|c| (c.clone(), fixtures().join(c)))
        .collect();
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(hybrid_fixtures().join("index.json")).unwrap(),
    )
    .unwrap();
    for c in index["cases"].as_array().unwrap() {
        let name = c["name"].as_str().unwrap().to_string();
        out.push((name.clone(), hybrid_fixtures().join(name)));
    }
    out
}

/// The fixture cases the index lists.
pub fn cases() -> Vec<String> {
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("index.json")).unwrap())
            .unwrap();
    index["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect()
}

/// Prompt `i` of a fixture's reference.
pub fn prompt_of(dir: &Path, i: usize) -> Vec<u32> {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    reference["prompts"][i]["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A copy of the model directory `src` in a temporary directory, under its own
/// name, with a page manifest (what the store core's cache and prefix snapshots
/// need). The directory lives as long as the `TempDir`.
pub fn copy_with_manifest(src: &Path) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join(src.file_name().unwrap());
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let ckpt = voom_formats::Checkpoint::open(&dir).unwrap();
    voom_formats::Manifest::build(&ckpt, &mut |_, _| {})
        .unwrap()
        .save(&dir)
        .unwrap();
    (d, dir)
}

/// Greedy generation of `n` ids after `prompt` (end-of-sequence ignored), with
/// the logits of every step.
pub fn greedy(
    e: &libvoom::engine::Engine,
    prompt: &[u32],
    n: usize,
) -> libvoom::engine::Generation {
    use libvoom::engine::{Decoding, GenerateParams};
    let params = GenerateParams {
        max_new_tokens: n,
        ignore_eos: true,
        record_logits: true,
        ..GenerateParams::default()
    };
    e.generate_with(prompt, &params, Decoding::default(), &mut |_| {
        std::ops::ControlFlow::Continue(())
    })
    .unwrap()
}

/// Asserts that two generations have the same ids and logits bits.
pub fn same(
    case: &str,
    what: &str,
    want: &libvoom::engine::Generation,
    got: &libvoom::engine::Generation,
) {
    assert_eq!(want.ids, got.ids, "{case} {what}: ids");
    assert_eq!(
        bits(&want.logits),
        bits(&got.logits),
        "{case} {what}: logits bits"
    );
}

/// Bits are compared within a family of backends: every CPU instruction set gives
/// the same bits (DESIGN.md invariant 6); MLX gives its own, with the same ids.
pub fn family(backend: libvoom::backend::BackendKind) -> &'static str {
    match backend {
        libvoom::backend::BackendKind::Cpu(_) => "cpu",
        libvoom::backend::BackendKind::Mlx => "mlx",
    }
}

/// Per family ([`family`]), the first bits seen; asserts later ones equal them
/// (saying how many differ, and where first).
#[derive(Default)]
pub struct SameBits(std::collections::HashMap<&'static str, Vec<u32>>);

impl SameBits {
    pub fn check(&mut self, backend: libvoom::backend::BackendKind, got: Vec<u32>, what: &str) {
        if !backend.batch_invariant() {
            // MLX's GPU kernels: not claimed (the engine turns off what needs it).
            eprintln!(
                "not compared: {} is not claimed batch invariant ({what})",
                backend.describe()
            );
            return;
        }
        let want = self.0.entry(family(backend)).or_insert_with(|| got.clone());
        let differ = want.iter().zip(&got).filter(|(a, b)| a != b).count();
        let first = want.iter().zip(&got).position(|(a, b)| a != b);
        assert!(
            want.len() == got.len() && differ == 0,
            "logits bits change ({differ} of {} differ, first at {first:?}; lengths {} and {}): {what}",
            want.len(),
            want.len(),
            got.len()
        );
    }
}

/// Each row's float bits.
pub fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// SmolLM2-135M-Instruct from `VOOM_SMOLLM2_DIR`; `None` (with a line saying so)
/// without it, unless `VOOM_REQUIRE_SMOLLM2=1` (scripts/test), which fails.
pub fn smollm2_dir() -> Option<PathBuf> {
    match std::env::var_os("VOOM_SMOLLM2_DIR") {
        Some(d) if Path::new(&d).join("config.json").exists() => Some(PathBuf::from(d)),
        _ => {
            if std::env::var("VOOM_REQUIRE_SMOLLM2").as_deref() == Ok("1") {
                panic!("VOOM_REQUIRE_SMOLLM2=1 but VOOM_SMOLLM2_DIR does not hold the model");
            }
            eprintln!("skipping: set VOOM_SMOLLM2_DIR (scripts/test does)");
            None
        }
    }
}

/// The ids of a JSON array.
pub fn json_ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Conformance of the fixture in `dir` with its transformers reference
/// (`reference.json`) on `opts`: each prompt's greedy ids and eos stop equal, and
/// its first-step logits within 1e-3 (relative) of transformers'.
pub fn check_case(dir: &Path, opts: libvoom::engine::EngineOptions) {
    use libvoom::engine::{Engine, FinishReason, GenerateParams};
    let name = dir.file_name().unwrap().to_string_lossy();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let backend = opts.backend.name();
    let engine = Engine::open(dir, opts).unwrap_or_else(|e| panic!("{name} on {backend}: {e}"));
    let max_new = reference["generation"]["max_new_tokens"].as_u64().unwrap() as usize;
    for p in reference["prompts"].as_array().unwrap() {
        let prompt = json_ids(&p["prompt_ids"]);
        let want = json_ids(&p["generated_ids"]);
        let params = GenerateParams {
            max_new_tokens: max_new,
            record_logits: true,
            ..Default::default()
        };
        let g = engine
            .generate(&prompt, &params, &mut |_| {
                std::ops::ControlFlow::Continue(())
            })
            .unwrap();
        let ref_logits: Vec<f32> = p["first_step_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let ours = &g.logits[0];
        assert_eq!(ours.len(), ref_logits.len());
        let worst = ours
            .iter()
            .zip(&ref_logits)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
            .fold(0f32, f32::max);
        assert_eq!(
            g.ids,
            want,
            "{name} on {backend}: prompt of {} tokens: generated ids differ from transformers' \
             (first-step logits {worst} away, relative)",
            prompt.len()
        );
        assert_eq!(
            g.finish == FinishReason::Eos,
            p["stopped_on_eos"].as_bool().unwrap(),
            "{name}: prompt of {}: eos stop differs",
            prompt.len()
        );
        assert!(
            worst <= 1e-3,
            "{name} on {backend}: prompt of {}: first-step logits differ from transformers' by {worst} (relative)",
            prompt.len()
        );
    }
}

/// The bits of `engine`'s logits at every position of `prompt`, and the ids of a
/// greedy generation of `max_new` after it.
pub fn run_bits(
    engine: &libvoom::engine::Engine,
    prompt: &[u32],
    max_new: usize,
) -> (Vec<u32>, Vec<u32>) {
    let mut kv = engine.new_kv();
    let logits = engine.forward_all(&mut kv, prompt).unwrap();
    let params = libvoom::engine::GenerateParams {
        max_new_tokens: max_new,
        ..Default::default()
    };
    let g = engine
        .generate(
            prompt,
            &params,
            &mut |_| std::ops::ControlFlow::Continue(()),
        )
        .unwrap();
    (logits.iter().map(|v| v.to_bits()).collect(), g.ids)
}

/// An engine with `opts` over a fresh store core of `budget` bytes of page cache
/// (`read_mode` `None`: the store's choice), and the store.
pub fn over_store_with(
    dir: &Path,
    budget: usize,
    read_mode: Option<vpaged::direct::ReadMode>,
    opts: libvoom::engine::EngineOptions,
) -> (
    std::sync::Arc<vpaged::store::Store>,
    libvoom::engine::Engine,
) {
    use std::sync::Arc;
    use vpaged::store::{Store, StoreConfig, StoreSource};
    let store = Store::new(StoreConfig {
        cache_bytes: budget,
        read_mode,
        ..Default::default()
    })
    .unwrap();
    let src = StoreSource::open(Arc::clone(&store), dir).unwrap();
    let e = libvoom::engine::Engine::with_source(dir, Arc::new(src), opts).unwrap();
    (store, e)
}

/// A copy of the checkpoint in `from` whose tensors `edit` may change (name, dtype,
/// shape, bytes; returning false drops one) and whose config.json `cfg` may change.
pub fn edited_copy(
    from: &Path,
    edit: impl Fn(&str, &mut voom_formats::DType, &mut Vec<usize>, &mut Vec<u8>) -> bool,
    cfg: impl Fn(&mut Value),
) -> tempfile::TempDir {
    use voom_formats::{Checkpoint, DType};
    let d = tempfile::tempdir().unwrap();
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(from.join("config.json")).unwrap()).unwrap();
    cfg(&mut c);
    std::fs::write(d.path().join("config.json"), c.to_string()).unwrap();
    std::fs::copy(
        from.join("generation_config.json"),
        d.path().join("generation_config.json"),
    )
    .unwrap();
    let ckpt = Checkpoint::open(from).unwrap();
    let mut owned = Vec::new();
    for (name, loc) in ckpt.tensors() {
        let (mut dt, mut shape) = (loc.info.dtype, loc.info.shape.clone());
        let mut bytes = ckpt.tensor_bytes(name).unwrap().to_vec();
        if edit(name, &mut dt, &mut shape, &mut bytes) {
            owned.push((name.to_string(), dt, shape, bytes));
        }
    }
    let refs: Vec<(&str, DType, &[usize], &[u8])> = owned
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    voom_formats::safetensors::write(
        &d.path().join("model.safetensors"),
        &refs,
        &std::collections::BTreeMap::new(),
    )
    .unwrap();
    d
}

/// The error opening `dir` gives (it must not open).
pub fn open_err(dir: &Path) -> String {
    match libvoom::engine::Engine::open(dir, libvoom::engine::EngineOptions::default()) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// The first error a prefill over `dir` gives (it opens).
pub fn run_err(dir: &Path) -> String {
    let e = libvoom::engine::Engine::open(dir, libvoom::engine::EngineOptions::default()).unwrap();
    let mut kv = e.new_kv();
    match e.prefill(&mut kv, &[3, 4, 5]) {
        Ok(_) => panic!("{} computed", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// The logits bits of every position of prompt `prompt_index` of the fixture in
/// `dir` are the same whatever the thread count, prefill chunk, KV page size and
/// CPU instruction set (`backends`; one family's bits each).
pub fn check_bits_across_runs(
    dir: &Path,
    prompt_index: usize,
    backends: &[libvoom::backend::BackendKind],
) {
    use libvoom::engine::{Engine, EngineOptions};
    let case = dir.file_name().unwrap().to_string_lossy();
    let prompt = prompt_of(dir, prompt_index);
    let mut seen = SameBits::default();
    for &backend in backends {
        for (threads, chunk, page) in [(1, 1, 1), (2, 3, 3), (3, 256, 128), (2, 7, 16)] {
            let e = Engine::open(
                dir,
                EngineOptions {
                    threads,
                    prefill_chunk: chunk,
                    backend,
                    kv_page_positions: page,
                    ..Default::default()
                },
            )
            .unwrap();
            let mut kv = e.new_kv();
            let all = e.forward_all(&mut kv, &prompt).unwrap();
            seen.check(
                backend,
                all.iter().map(|v| v.to_bits()).collect(),
                &format!(
                    "{case}: threads {threads}, chunk {chunk}, KV pages {page}, {}",
                    backend.name()
                ),
            );
        }
    }
}

/// A copy of the fixture `src` with a manifest, served by the store core at a
/// budget below one layer (every page streamed) and at a roomy one, gives the
/// mapped model's bits and ids for prompt `prompt_index`.
pub fn check_store_below_one_layer(src: &Path, prompt_index: usize) {
    use libvoom::engine::{Engine, EngineOptions};
    let case = src.file_name().unwrap().to_string_lossy();
    let (_d, dir) = copy_with_manifest(src);
    let prompt = prompt_of(&dir, prompt_index);
    let want = run_bits(
        &Engine::open(&dir, EngineOptions::default()).unwrap(),
        &prompt,
        8,
    );
    let m = voom_formats::Manifest::load(&dir).unwrap().unwrap();
    let largest = m.pages.iter().map(|p| p.len as usize).max().unwrap();
    for budget in [
        64 << 20,
        (largest * 2).next_multiple_of(16 << 10) + (256 << 10),
    ] {
        let (_store, e) = over_store_with(&dir, budget, None, EngineOptions::default());
        assert_eq!(run_bits(&e, &prompt, 8), want, "{case}: budget {budget}");
    }
}

//! DESIGN.md invariant 1: paging is invisible to arithmetic. The same model gives
//! the same ids and the same logits bits whether its pages come from the embedded
//! mapping or through the store core's shared page cache, with an ample budget or
//! about one decoder layer (streaming), with prefetch off or on, from the fast tier,
//! and through the daemon's socket and shared arena, with two engines at once.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::over_store_with;
use libvoom::engine::{Engine, EngineOptions};
use vpaged::direct::ReadMode;
use vpaged::store::{Store, StoreConfig, StoreSource};

/// A copy (with its manifest) of a case of `tests/fixtures/tiny`, or of
/// `tests/fixtures/tiny_hybrid`, `tiny_fp8` or `tiny_gpt_oss` where the first has
/// none of that name.
fn fixture_copy(case: &str) -> (tempfile::TempDir, PathBuf) {
    let tiny = common::fixtures().join(case);
    let fp8 = common::fixtures().join("../tiny_fp8").join(case);
    let gpt_oss = common::fixtures().join("../tiny_gpt_oss").join(case);
    let dir = if tiny.exists() {
        tiny
    } else if fp8.exists() {
        fp8
    } else if gpt_oss.exists() {
        gpt_oss
    } else {
        common::hybrid_fixtures().join(case)
    };
    common::copy_with_manifest(&dir)
}

fn run(engine: &Engine, prompt: &[u32]) -> (Vec<u32>, Vec<u32>) {
    common::run_bits(engine, prompt, 12)
}

/// Cache bytes the largest layer's pages occupy (16 KiB slots), its routed experts'
/// included.
fn layer_slot_bytes(dir: &Path) -> usize {
    let m = voom_formats::Manifest::load(dir).unwrap().unwrap();
    let mut per_layer = std::collections::HashMap::new();
    for p in &m.pages {
        if let Some(l) = p.group.layer() {
            *per_layer.entry(l).or_insert(0usize) += (p.len as usize).next_multiple_of(16 << 10);
        }
    }
    per_layer.into_values().max().unwrap()
}

/// Bytes of the largest layer's pages that a whole-layer lease holds (not its routed
/// experts), and of its largest routed expert.
fn largest_layer_bytes(dir: &Path) -> usize {
    let m = voom_formats::Manifest::load(dir).unwrap().unwrap();
    let mut per_layer = std::collections::HashMap::new();
    for p in &m.pages {
        if let voom_formats::manifest::PageGroup::Layer(l) = p.group {
            *per_layer.entry(l).or_insert(0usize) += p.len as usize;
        }
    }
    per_layer.into_values().max().unwrap() + largest_expert_slots(dir)
}

/// Cache budgets: ample; about one decoder layer (the engine leases a layer at a
/// time, and every sweep evicts and reloads); and below one layer, where the engine
/// leases one matrix at a time and streams.
fn budgets(dir: &Path) -> [usize; 3] {
    let layer = largest_layer_bytes(dir);
    let largest_page = voom_formats::Manifest::load(dir)
        .unwrap()
        .unwrap()
        .pages
        .iter()
        .map(|p| p.len as usize)
        .max()
        .unwrap();
    let slots = |b: usize| b.next_multiple_of(16 << 10);
    let one_layer = slots((layer + 8 * (16 << 10)).max(largest_page * 2));
    let below = slots(largest_page).max(largest_expert_slots(dir)) + (64 << 10);
    [64 << 20, one_layer, below]
}

/// Slot bytes of the largest routed expert's pages (0 without experts): its own
/// tensors, or its parts of the fused ones (the manifest pages each expert).
fn largest_expert_slots(dir: &Path) -> usize {
    let m = voom_formats::Manifest::load(dir).unwrap().unwrap();
    let mut per = std::collections::HashMap::<(u32, u32), usize>::new();
    for p in &m.pages {
        if let voom_formats::manifest::PageGroup::Expert { layer, expert } = p.group {
            *per.entry((layer, expert)).or_default() += (p.len as usize).next_multiple_of(16 << 10);
        }
    }
    per.into_values().max().unwrap_or(0)
}

/// An engine over a fresh store core of `budget` bytes (`read_mode` `None`: the
/// store's choice), and the store.
fn over_store(
    dir: &Path,
    budget: usize,
    prefetch_depth: usize,
    read_mode: Option<ReadMode>,
) -> (Arc<Store>, Engine) {
    let opts = EngineOptions {
        prefetch_depth,
        ..EngineOptions::default()
    };
    over_store_with(dir, budget, read_mode, opts)
}

#[test]
fn store_core_gives_the_embedded_bits_at_any_budget() {
    for case in [
        "llama_gqa_untied",
        "qwen2_bias_tied",
        "llama_sharded",
        "qwen3_moe_dense_layer",
        "qwen3_moe_fused_sparse_step",
        "mixtral_block_sparse",
        "glm4_moe_partial_rotary_shared",
        "deepseek_v3_mla_yarn",
        "qwen3_next_moe_legacy_config",
        "qwen3_5_text_dense",
        "qwen3_5_moe_vlm_form",
        "qwen3_fp8_partial_blocks",
        "qwen3_moe_fp8_fused_experts",
        "deepseek_v3_fp8_mla",
        "gpt_oss_mxfp4",
    ] {
        let (_d, dir) = fixture_copy(case);
        let prompt: Vec<u32> = (0..21).map(|i| (i * 17 + 3) % 200).collect();
        let reference = run(
            &Engine::open(&dir, EngineOptions::default()).unwrap(),
            &prompt,
        );

        let [ample, one_layer, below] = budgets(&dir);
        let layer_slots = layer_slot_bytes(&dir);
        assert!(
            below < layer_slots,
            "{case}: {below} is not below one layer ({layer_slots})"
        );
        // Prefetch off, one layer ahead (the default) and three ahead; reads
        // around the OS page cache and through it.
        let runs = [ample, one_layer, below].into_iter().flat_map(|b| {
            [0, 1, 3]
                .into_iter()
                .flat_map(move |d| [ReadMode::Direct, ReadMode::Buffered].map(move |m| (b, d, m)))
        });
        for (budget, prefetch_depth, read_mode) in runs {
            {
                let (store, e) = over_store(&dir, budget, prefetch_depth, Some(read_mode));
                assert_eq!(
                    run(&e, &prompt),
                    reference,
                    "{case}: budget {budget}, prefetch depth {prefetch_depth}, {read_mode:?} reads"
                );
                let s = store.cache_stats();
                assert!(s.misses > 0 && s.bytes_loaded > 0, "{case}: {s:?}");
                if budget == ample {
                    // The memory planner pinned the model it found room for.
                    assert!(s.pinned_bytes > 0, "{case}: nothing pinned: {s:?}");
                }
                if prefetch_depth == 0 {
                    assert_eq!(s.prefetch_loads, 0, "{case}: prefetch off: {s:?}");
                }
            }
        }
    }
}

/// Splits `dir`'s embedding table into parts of `rows` rows in its manifest; returns
/// how many.
fn split_embedding(dir: &Path, rows: u64) -> usize {
    let ckpt = voom_formats::Checkpoint::open(dir).unwrap();
    let mut m = voom_formats::Manifest::load(dir).unwrap().unwrap();
    m.split_table(&ckpt, "model.embed_tokens.weight", rows)
        .unwrap();
    m.save(dir).unwrap();
    m.parts("model.embed_tokens.weight").len()
}

/// An embedding stored in row parts gives the bits of the table stored whole, through
/// the mapping, the store core at every budget and the daemon, untied and as a tied
/// output head (computed part by part); a store that loads whole pages requests only
/// the parts holding the tokens a pass embeds.
#[test]
fn a_table_in_row_parts_gives_the_bits_of_the_whole_table() {
    for (case, tied) in [("llama_gqa_untied", false), ("qwen2_bias_tied", true)] {
        let (d, dir) = fixture_copy(case);
        let prompt: Vec<u32> = (0..21).map(|i| (i * 17 + 3) % 200).collect();
        let reference = run(
            &Engine::open(&dir, EngineOptions::default()).unwrap(),
            &prompt,
        );
        let whole = Engine::open(&dir, EngineOptions::default()).unwrap();
        let (vocab, hidden) = (whole.config().vocab_size, whole.config().hidden_size);
        let row = 2 * hidden as u64; // BF16
                                     // A token reads a row of the mapping, and all of a table stored whole from a
                                     // source that loads pages whole.
        let plan = whole.model().plan();
        assert_eq!(plan.head.per_token(), row, "{case}");
        assert_eq!(plan.whole_pages().head.per_token(), row * vocab as u64);
        drop(whole);
        let per = 32;
        assert_eq!(
            split_embedding(&dir, per as u64),
            vocab.div_ceil(per),
            "{case}"
        );
        let mapped = Engine::open(&dir, EngineOptions::default()).unwrap();
        // In parts: about a row, and about one part (the shares round up).
        let parts = vocab.div_ceil(per) as u64;
        let plan = mapped.model().plan();
        let head = plan.head.per_token();
        assert!((row..row + parts).contains(&head), "{case}: {head}");
        let head = plan.whole_pages().head.per_token();
        let part = row * per as u64;
        assert!((part..part + parts).contains(&head), "{case}: {head}");
        assert_eq!(
            run(&mapped, &prompt),
            reference,
            "{case}: memory-mapped parts"
        );
        drop(mapped);

        // Rows the passes embed: the prompt, then each generated id but the last.
        let mut fed: Vec<u32> = prompt.clone();
        fed.extend(&reference.1[..reference.1.len() - 1]);
        let m = voom_formats::Manifest::load(&dir).unwrap().unwrap();
        let unused: Vec<usize> = m
            .parts("model.embed_tokens.weight")
            .iter()
            .filter(|p| {
                let r = p.rows.unwrap();
                !fed.iter()
                    .any(|&t| (r.start..r.end()).contains(&(t as u64)))
            })
            .map(|p| p.id as usize)
            .collect();
        assert!(!unused.is_empty(), "{case}: the prompt touches every part");

        let [ample, ..] = budgets(&dir);
        for budget in budgets(&dir) {
            for depth in [0, 1] {
                let (store, e) = over_store(&dir, budget, depth, None);
                assert_eq!(
                    run(&e, &prompt),
                    reference,
                    "{case}: parts, budget {budget}, prefetch depth {depth}"
                );
                let counts = store.models()[0].access_counts();
                let requested: Vec<usize> =
                    unused.iter().copied().filter(|&i| counts[i] > 0).collect();
                if tied {
                    // The head reads every part each pass.
                    assert_eq!(requested, unused, "{case}: budget {budget}");
                } else if budget != ample {
                    // (An ample budget pins, and so loads, every page.)
                    assert!(
                        requested.is_empty(),
                        "{case}: budget {budget}, depth {depth}: parts {requested:?} \
                         hold no token embedded, yet were requested"
                    );
                }
            }
        }
        let layer = largest_layer_bytes(&dir);
        through_the_daemon(
            &d,
            &dir,
            &prompt,
            &reference,
            (layer * 3 / 2).next_multiple_of(16 << 10) + (512 << 10),
            0,
        );
    }
}

#[test]
fn pages_from_the_fast_tier_give_the_same_bits() {
    let (d, dir) = fixture_copy("llama_gqa_untied");
    let prompt: Vec<u32> = (0..9).map(|i| (i * 5 + 1) % 200).collect();
    let reference = run(
        &Engine::open(&dir, EngineOptions::default()).unwrap(),
        &prompt,
    );
    let fast = d.path().join("fast");
    {
        let store = Store::new(StoreConfig {
            cache_bytes: 64 << 20,
            fast_tier: Some((fast.clone(), 64 << 20)),
            ..Default::default()
        })
        .unwrap();
        let src = StoreSource::open(Arc::clone(&store), &dir).unwrap();
        let e = Engine::with_source(&dir, Arc::new(src), EngineOptions::default()).unwrap();
        run(&e, &prompt);
        let (pages, bytes) = store.stage_hot(0, u64::MAX).unwrap();
        assert!(pages > 0 && bytes > 0);
    }
    // A new store (cold cache) over the same fast tier: pages come from it.
    let store = Store::new(StoreConfig {
        cache_bytes: 64 << 20,
        fast_tier: Some((fast, 64 << 20)),
        ..Default::default()
    })
    .unwrap();
    let src = StoreSource::open(Arc::clone(&store), &dir).unwrap();
    let e = Engine::with_source(&dir, Arc::new(src), EngineOptions::default()).unwrap();
    assert_eq!(run(&e, &prompt), reference);
    let m = store.model(0).unwrap();
    let [fast_served, primary_served, _] = m.served_counts();
    assert!(
        fast_served > 0,
        "fast {fast_served}, primary {primary_served}"
    );
}

/// Runs a daemon over `store` on `socket` in a background thread (a real Unix socket;
/// the arena is passed by SCM_RIGHTS and mapped read-only by the clients).
fn serve(
    store: Arc<Store>,
    socket: PathBuf,
) -> (
    std::thread::JoinHandle<()>,
    tokio::sync::oneshot::Sender<()>,
) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let h = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::UnixListener::bind(&socket).unwrap();
            let d = vpaged::daemon::Daemon::new(store);
            d.serve(listener, socket, async {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
    });
    (h, tx)
}

#[test]
fn two_engines_through_the_daemon_give_the_embedded_bits() {
    for case in [
        "qwen3_qk_norm_eos_list",
        "qwen3_moe_dense_layer",
        "deepseek_v3_mla_yarn",
        "qwen3_next_moe_legacy_config",
        "qwen3_moe_fp8_bf16_scales_not_convert",
        "gpt_oss_mxfp4",
    ] {
        let (d, dir) = fixture_copy(case);
        let prompt: Vec<u32> = (0..19).map(|i| (i * 13 + 7) % 250).collect();
        let reference = run(
            &Engine::open(&dir, EngineOptions::default()).unwrap(),
            &prompt,
        );
        let model_bytes = slot_bytes(&dir);
        for (i, cache_bytes) in daemon_caches(&dir).into_iter().enumerate() {
            let (pinned, _) = through_the_daemon(&d, &dir, &prompt, &reference, cache_bytes, i);
            if i == 1 {
                assert!(
                    pinned > 0,
                    "{case}: the planners pinned nothing through the daemon"
                );
                assert!(
                    pinned < model_bytes,
                    "{case}: everything was pinned: nothing streamed"
                );
            }
        }
    }
}

/// Bytes of the cache slots of every page of the model in `dir`.
fn slot_bytes(dir: &Path) -> usize {
    voom_formats::Manifest::load(dir)
        .unwrap()
        .unwrap()
        .pages
        .iter()
        .map(|p| (p.len as usize).next_multiple_of(16 << 10))
        .sum()
}

/// The daemon's caches the two-engine tests run with: below two layers (the engines
/// stream step by step); and room for the streaming window (two layers and a page)
/// and part of the rest, which the engines' planners pin through the daemon (`Pin`)
/// while the other pages stream.
fn daemon_caches(dir: &Path) -> [usize; 2] {
    let layer = largest_layer_bytes(dir);
    let manifest = voom_formats::Manifest::load(dir).unwrap().unwrap();
    let window = vpaged::store::streaming_window_bytes(&manifest, vpaged::store::routed_top_k(dir));
    [
        (layer * 3 / 2).next_multiple_of(16 << 10) + (512 << 10),
        (window + slot_bytes(dir) / 2).next_multiple_of(16 << 10),
    ]
}

/// Packs the model in `dir` (`voom_formats::pack`, what `vpagectl pack` writes), then
/// flips a byte of every packed page's raw copy, so only the vpack bodies can give
/// the model's bits.
fn pack_and_damage_raw(dir: &Path) {
    use std::os::unix::fs::FileExt;
    let mut manifest = voom_formats::Manifest::load(dir).unwrap().unwrap();
    let report = voom_formats::pack::pack_model(dir, &mut manifest, &mut |_, _| {}).unwrap();
    assert!(report.pages > 0, "{}: nothing packed", dir.display());
    for p in manifest.pages.iter().filter(|p| p.vpack().is_some()) {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join(&p.file))
            .unwrap();
        let mut b = [0u8];
        f.read_exact_at(&mut b, p.offset + 1).unwrap();
        f.write_all_at(&[b[0] ^ 0x20], p.offset + 1).unwrap();
    }
}

/// Two engines over a daemon with a cache of `cache_bytes` give `reference`; returns
/// the bytes the daemon had pinned while they ran, and the vpack bodies its loads
/// took from its pool of bodies read ahead.
fn through_the_daemon(
    d: &tempfile::TempDir,
    dir: &Path,
    prompt: &[u32],
    reference: &(Vec<u32>, Vec<u32>),
    cache_bytes: usize,
    round: usize,
) -> (usize, u64) {
    let store = Store::new(StoreConfig {
        cache_bytes,
        ..Default::default()
    })
    .unwrap();
    let socket = d.path().join(format!("vpaged-{round}.sock"));
    let (h, stop) = serve(Arc::clone(&store), socket.clone());
    while !socket.exists() {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let engines: Vec<_> = (0..2)
        .map(|i| {
            let c = vpaged::client::DaemonClient::connect(&socket, &format!("engine-{i}")).unwrap();
            let src = vpaged::client::DaemonSource::open(c, dir).unwrap();
            Engine::with_source(dir, Arc::new(src), EngineOptions::default()).unwrap()
        })
        .collect();
    std::thread::scope(|s| {
        for e in &engines {
            s.spawn(move || assert_eq!(&run(e, prompt), reference, "cache {cache_bytes}"));
        }
    });
    let pinned = store.cache_stats().pinned_bytes;
    assert!(engines[0].source().describe().starts_with("vpaged:"));
    drop(engines);
    let _ = stop.send(());
    h.join().unwrap();
    (pinned, store.read_ahead_stats().map_or(0, |s| s.taken))
}

/// vpack pages through the daemon give the raw pages' bits: two engines at once over
/// a packed copy (every packed page's raw bytes then damaged, so only the bodies can
/// give those bits), below two layers and with room for the planners' pins, each
/// engine naming the pages it will need (`ReadAhead`) so the daemon reads their
/// bodies ahead.
#[test]
fn packed_pages_through_the_daemon_give_the_raw_bits() {
    let (d, dir) = fixture_copy("llama_gqa_untied");
    let prompt: Vec<u32> = (0..19).map(|i| (i * 13 + 7) % 200).collect();
    let reference = run(
        &Engine::open(&dir, EngineOptions::default()).unwrap(),
        &prompt,
    );
    pack_and_damage_raw(&dir);
    let mut read_ahead = 0;
    for (i, cache_bytes) in daemon_caches(&dir).into_iter().enumerate() {
        read_ahead += through_the_daemon(&d, &dir, &prompt, &reference, cache_bytes, i).1;
    }
    assert!(read_ahead > 0, "the daemon read no body ahead");
}

/// A prompt is one sweep of the weights, however many chunks its layers compute it
/// in: with a cache of about one layer (every layer evicted by the next), prefilling
/// 21 positions 4 at a time loads exactly the bytes one position loads, and gives
/// the bits of one chunk of 21.
#[test]
fn a_chunked_prompt_reads_the_weights_once() {
    let (_d, dir) = fixture_copy("llama_gqa_untied");
    let prompt: Vec<u32> = (0..21).map(|i| (i * 17 + 3) % 200).collect();
    let layer = largest_layer_bytes(&dir);
    let budget = (layer + 8 * (16 << 10)).next_multiple_of(16 << 10);
    let prefill = |tokens: &[u32], chunk: usize| {
        let store = Store::new(StoreConfig {
            cache_bytes: budget,
            ..Default::default()
        })
        .unwrap();
        let src = StoreSource::open(Arc::clone(&store), &dir).unwrap();
        let opts = EngineOptions {
            prefill_chunk: chunk,
            prefetch_depth: 0,
            ..EngineOptions::default()
        };
        let e = Engine::with_source(&dir, Arc::new(src), opts).unwrap();
        let before = store.cache_stats().bytes_loaded;
        let mut kv = e.new_kv();
        let logits = e.prefill(&mut kv, tokens).unwrap();
        assert_eq!(kv.len(), tokens.len());
        let bits: Vec<u32> = logits.iter().map(|v| v.to_bits()).collect();
        (store.cache_stats().bytes_loaded - before, bits)
    };
    let (one, _) = prefill(&prompt[..1], 4);
    let (chunked, bits) = prefill(&prompt, 4);
    let (whole, want) = prefill(&prompt, prompt.len());
    assert!(one > 0);
    assert_eq!(
        chunked, one,
        "21 positions in 6 chunks read more than one sweep"
    );
    assert_eq!(whole, one);
    assert_eq!(bits, want, "chunking changed the logits' bits");
}

/// vpack pages give the raw pages' bits: the same model packed (`voom_formats::pack`,
/// what `vpagectl pack` writes) and read through the store core's cache, whose loads
/// decode each page's vpack body before verifying it, gives the ids and logits bits
/// of the mapped raw checkpoint, with an ample cache, about one layer and below one,
/// prefetch off and on. After packing, a byte of every packed page's raw copy is
/// flipped, so only the vpack bodies can give those bits.
#[test]
fn vpack_pages_give_the_raw_bits_at_any_budget() {
    for case in [
        "llama_gqa_untied",
        "qwen3_qk_norm_eos_list",
        "olmoe_clip_qkv",
        "deepseek_v3_plain_q_legacy_yarn",
        "qwen3_moe_fp8_bf16_scales_not_convert",
        "gpt_oss_mxfp4",
    ] {
        let (_d, dir) = fixture_copy(case);
        let prompt: Vec<u32> = (0..17).map(|i| (i * 11 + 5) % 200).collect();
        let reference = run(
            &Engine::open(&dir, EngineOptions::default()).unwrap(),
            &prompt,
        );
        pack_and_damage_raw(&dir);
        let mut read_ahead = 0;
        for budget in budgets(&dir) {
            for prefetch_depth in [0, 1] {
                let (store, e) = over_store(&dir, budget, prefetch_depth, None);
                assert_eq!(
                    run(&e, &prompt),
                    reference,
                    "{case}: vpack pages, budget {budget}, prefetch depth {prefetch_depth}"
                );
                let taken = store.read_ahead_stats().map_or(0, |s| s.taken);
                if prefetch_depth == 0 {
                    assert_eq!(taken, 0, "{case}: no hints, nothing read ahead");
                }
                read_ahead += taken;
            }
        }
        // Bodies read ahead of their slots (the default) decoded some of those pages.
        assert!(read_ahead > 0, "{case}: no body was read ahead");
    }
}

/// A pass reads the routed experts its router picks and no others: through a store
/// core too small to keep a layer (prefetch off), one position's pass loads every
/// page but the experts' (a tied table twice: it is evicted between the embedding and
/// the head), and `top_k` experts of each layer of experts, less what the planner
/// pinned; far less than the model.
#[test]
fn a_pass_reads_only_the_experts_its_router_picks() {
    use voom_formats::manifest::PageGroup;
    for case in [
        "qwen3_moe_dense_layer",
        "qwen3_moe_fused_sparse_step",
        "mixtral_block_sparse",
        "olmoe_clip_qkv",
        "glm4_moe_partial_rotary_shared",
        "deepseek_v3_plain_q_legacy_yarn",
        "qwen3_moe_fp8_fused_experts",
        "deepseek_v3_fp8_mla",
    ] {
        let (_d, dir) = fixture_copy(case);
        let m = voom_formats::Manifest::load(&dir).unwrap().unwrap();
        let cfg = libvoom::config::ModelConfig::from_dir(&dir).unwrap();
        let moe = cfg.moe.clone().unwrap();
        // A tied table is read at both ends of the pass (evicted in between here).
        let again = if cfg.tie_word_embeddings {
            m.page("model.embed_tokens.weight").unwrap().len
        } else {
            0
        };
        let trunk: u64 = m
            .pages
            .iter()
            .filter(|p| !matches!(p.group, PageGroup::Expert { .. }))
            .map(|p| p.len)
            .sum();
        let mut per_expert = std::collections::HashMap::<(u32, u32), u64>::new();
        for p in &m.pages {
            if let PageGroup::Expert { layer, expert } = p.group {
                *per_expert.entry((layer, expert)).or_default() += p.len;
            }
        }
        let expert = *per_expert.values().next().unwrap();
        assert!(
            per_expert.values().all(|&b| b == expert),
            "{case}: experts differ"
        );
        let layers = moe.sparse[..cfg.num_layers].iter().filter(|&&s| s).count() as u64;
        assert_eq!(per_expert.len() as u64, layers * moe.num_experts as u64);
        let picked = trunk + layers * moe.top_k as u64 * expert;
        let everything: u64 = m.pages.iter().map(|p| p.len).sum();
        assert!(picked < everything, "{case}");

        let [_, _, below] = budgets(&dir);
        let (store, e) = over_store(&dir, below, 0, None);
        let before = store.cache_stats();
        let mut kv = e.new_kv();
        e.forward_all(&mut kv, &[7]).unwrap();
        let after = store.cache_stats();
        let loaded = after.bytes_loaded - before.bytes_loaded;
        let pinned = after.pinned_bytes as u64;
        assert!(
            loaded <= picked + again && loaded + pinned >= picked,
            "{case}: a pass loaded {loaded} bytes; the pages it needs are {picked} \
             ({pinned} pinned), the model {everything}"
        );
    }
}

/// A generation reports its page traffic over decode apart: the part of the whole
/// generation's counters from the first sampled id on, what the store counted over
/// the decode passes alone.
#[test]
fn decode_traffic_is_the_decode_passes_part() {
    let (_d, dir) = fixture_copy("qwen3_moe_fused_sparse_step");
    let [_, _, below] = budgets(&dir);
    let (store, e) = over_store(&dir, below, 0, None);
    let params = libvoom::engine::GenerateParams {
        max_new_tokens: 6,
        ignore_eos: true,
        ..Default::default()
    };
    let prompt = [5u32, 9, 300, 17];
    let before = store.cache_stats();
    let g = e
        .generate(&prompt, &params, &mut |_| {
            std::ops::ControlFlow::Continue(())
        })
        .unwrap();
    let after = store.cache_stats();
    let all = g.pages.expect("a page cache counts");
    let decode = g.decode_pages.expect("a page cache counts decode");
    assert_eq!(all.bytes_loaded, after.bytes_loaded - before.bytes_loaded);
    assert_eq!(
        all.hits + all.misses,
        after.hits + after.misses - before.hits - before.misses
    );
    // Five decode passes below one layer's experts: each loads pages, and the
    // prompt's pass loaded some too.
    assert!(
        decode.bytes_loaded > 0 && decode.bytes_loaded < all.bytes_loaded,
        "{decode:?} {all:?}"
    );
    assert!(decode.hits + decode.misses < all.hits + all.misses);

    // Replayed alone, the prompt's pass loads what the generation's counters less
    // decode's say it did (the same pages, the same budget, a cold store).
    let (store, e) = over_store(&dir, below, 0, None);
    let before = store.cache_stats();
    let mut kv = e.new_kv();
    e.forward_all(&mut kv, &prompt).unwrap();
    let prompt_loaded = store.cache_stats().bytes_loaded - before.bytes_loaded;
    assert_eq!(prompt_loaded, all.bytes_loaded - decode.bytes_loaded);
}

/// The routing trace of a pass does not depend on how its positions are chunked:
/// each layer of experts reads, once, every expert any position picked.
#[test]
fn a_chunked_prompt_reads_each_picked_expert_once() {
    let (_d, dir) = fixture_copy("mixtral_block_sparse");
    let prompt: Vec<u32> = (0..21).map(|i| (i * 17 + 3) % 300).collect();
    let trace_with = |chunk: usize| {
        let e = Engine::open(
            &dir,
            EngineOptions {
                prefill_chunk: chunk,
                ..EngineOptions::default()
            },
        )
        .unwrap();
        e.record_expert_trace();
        let mut kv = e.new_kv();
        e.forward_all(&mut kv, &prompt).unwrap();
        e.take_expert_trace().unwrap()
    };
    let whole = trace_with(256);
    assert_eq!(whole.passes.len(), 1);
    assert_eq!(whole.passes[0].positions, 21);
    for list in &whole.passes[0].experts {
        assert!(
            list.len() >= 2 && list.windows(2).all(|w| w[0] < w[1]),
            "{list:?}"
        );
    }
    assert_eq!(trace_with(4), whole);
    assert_eq!(trace_with(1), whole);
}

/// Predicting the next layer's experts and hinting them (`expert_prefetch`) leaves
/// the ids and logits bits as they are, at every budget, and does read ahead.
#[test]
fn predicted_expert_hints_give_the_same_bits() {
    for case in [
        "qwen3_moe_dense_layer",
        "mixtral_block_sparse",
        "deepseek_v3_mla_yarn",
    ] {
        let (_d, dir) = fixture_copy(case);
        let prompt: Vec<u32> = (0..13).map(|i| (i * 29 + 1) % 300).collect();
        let reference = run(
            &Engine::open(&dir, EngineOptions::default()).unwrap(),
            &prompt,
        );
        let [ample, ..] = budgets(&dir);
        for budget in budgets(&dir) {
            let opts = EngineOptions {
                expert_prefetch: true,
                ..EngineOptions::default()
            };
            let (store, e) = over_store_with(&dir, budget, None, opts);
            assert_eq!(run(&e, &prompt), reference, "{case}: budget {budget}");
            // An ample cache pins the whole model: nothing to hint.
            if budget != ample {
                let s = store.cache_stats();
                assert!(s.prefetch_loads > 0, "{case}: budget {budget}: {s:?}");
            }
        }
    }
}

/// Experts computed in the order their pages are ready (the default, where their
/// outputs fit what may be held) and in ascending order (`expert_hold_bytes` 0) give
/// the same ids and logits bits, at every budget (where some experts are resident
/// and others load, so the two orders differ).
#[test]
fn experts_in_ready_order_and_ascending_give_the_same_bits() {
    for case in [
        "qwen3_moe_dense_layer",
        "glm4_moe_partial_rotary_shared",
        "deepseek_v3_mla_yarn",
    ] {
        let (_d, dir) = fixture_copy(case);
        let prompt: Vec<u32> = (0..11).map(|i| (i * 31 + 7) % 300).collect();
        let reference = run(
            &Engine::open(&dir, EngineOptions::default()).unwrap(),
            &prompt,
        );
        for budget in budgets(&dir) {
            for hold in [0, libvoom::model::sweep::EXPERT_HOLD_BYTES] {
                let opts = EngineOptions {
                    expert_hold_bytes: hold,
                    ..EngineOptions::default()
                };
                let (_store, e) = over_store_with(&dir, budget, None, opts);
                assert_eq!(
                    run(&e, &prompt),
                    reference,
                    "{case}: budget {budget}, expert outputs held {hold}"
                );
            }
        }
    }
}

//! The weight budget taken back and given back while an engine runs (a memory
//! governor's lever, `libvoom::engine::placed`): the page cache's spare room first,
//! then pins, which the engine places again smaller; the pages given up stream, and
//! every result keeps its bits.

mod common;

use libvoom::engine::{Engine, EngineOptions};

fn run(engine: &Engine, prompt: &[u32]) -> (Vec<u32>, Vec<u32>) {
    common::run_bits(engine, prompt, 6)
}

#[test]
fn pins_given_up_and_given_back_keep_the_bits() {
    // A dense model, a mixture of experts, and MLA (all pinned in an ample cache).
    for case in [
        "llama_gqa_untied",
        "qwen3_moe_fused_sparse_step",
        "deepseek_v3_mla_yarn",
    ] {
        let (_d, dir) = common::copy_with_manifest(&common::fixtures().join(case));
        let prompt: Vec<u32> = (0..19).map(|i| (i * 13 + 5) % 200).collect();
        let reference = run(
            &Engine::open(&dir, EngineOptions::default()).unwrap(),
            &prompt,
        );
        let (store, e) = common::over_store_with(&dir, 64 << 20, None, EngineOptions::default());
        let w = e.weights();
        assert!(w.govern(), "{case}: an in-process cache is a lever");
        let open = w.budget();
        assert!(open.pinned_at_open > 0, "{case}: {open:?}");
        assert_eq!(open.pinned, open.pinned_at_open);
        assert!(
            open.least < open.pinned_at_open,
            "{case}: the fixture streams in less than its pins: {open:?}"
        );
        assert_eq!(run(&e, &prompt), reference, "{case}: as opened");

        // The spare room alone: pins stay, nothing is read again.
        let withheld = w.shrink(u64::MAX, false);
        let b = w.budget();
        assert!(withheld > 0 && b.withheld == withheld, "{case}: {b:?}");
        assert_eq!(b.pinned, open.pinned, "{case}: {b:?}");
        let loaded = store.cache_stats().bytes_loaded;
        assert_eq!(run(&e, &prompt), reference, "{case}: spare room withheld");
        assert_eq!(
            store.cache_stats().bytes_loaded,
            loaded,
            "{case}: read again"
        );

        // Pins too: no pass is under way, so the smaller placement is made at once.
        w.shrink(u64::MAX, true);
        let b = w.budget();
        assert!(b.pinned < open.pinned, "{case}: {b:?}");
        assert_eq!(b.taken, b.configured - b.least, "{case}: {b:?}");
        assert!(b.withheld >= b.taken, "{case}: {b:?}");
        let s = store.cache_stats();
        assert!(
            s.used <= s.capacity - b.taken as usize,
            "{case}: {s:?} {b:?}"
        );
        assert_eq!(run(&e, &prompt), reference, "{case}: pins given up");
        let streamed = store.cache_stats().bytes_loaded - loaded;
        assert!(streamed > 0, "{case}: the pages given up did not stream");

        // Given back: the placement of the open budget again.
        assert!(w.restore(u64::MAX));
        let b = w.budget();
        assert_eq!(
            (b.pinned, b.taken, b.withheld),
            (open.pinned, 0, 0),
            "{case}: {b:?}"
        );
        assert_eq!(run(&e, &prompt), reference, "{case}: given back");
        assert!(!w.restore(u64::MAX), "{case}: nothing more to give back");
    }
}

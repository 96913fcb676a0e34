//! The KV budget (`EngineOptions::kv_budget`, `libvoom::kv::spill`): pages beyond it
//! spill to a file and are read back for attention. Runs that spill, read back,
//! reuse spilled prefixes, or lose a spilled page to corruption on disk all give a
//! resident run's ids and every logits bit, on every attention kind.

mod common;

use std::ops::ControlFlow;
use std::os::unix::fs::FileExt;

use libvoom::engine::{Decoding, Engine, EngineOptions, GenerateParams};

use common::{fixtures, greedy, prompt_of, same};

const CASES: [&str; 4] = [
    "llama_gqa_untied",
    "mistral_sliding_window",
    "qwen3_moe_fused_sparse_step",
    "deepseek_v3_mla_yarn",
];

/// Options with KV pages of 8 positions under a budget of `budget` bytes, spilling
/// to `dir`.
fn spilling(budget: usize, dir: &std::path::Path, prefix_cache_bytes: usize) -> EngineOptions {
    EngineOptions {
        prefill_chunk: 7,
        kv_page_positions: 8,
        prefix_cache_bytes,
        kv_budget: Some((budget, dir.to_path_buf())),
        ..EngineOptions::default()
    }
}

#[test]
fn spilled_kv_gives_resident_ids_and_bits() {
    for case in CASES {
        let dir = fixtures().join(case);
        let spill = tempfile::tempdir().unwrap();
        let resident = Engine::open(&dir, EngineOptions::default()).unwrap();
        // A budget of a few pages: most of a long prompt's KV lives on disk.
        let e = Engine::open(&dir, spilling(16 << 10, spill.path(), 64 << 20)).unwrap();
        let long = prompt_of(&dir, 3);
        let want = greedy(&resident, &long, 8);
        same(case, "spilled", &want, &greedy(&e, &long, 8));
        let s = e.kv_pool_stats().unwrap();
        assert!(s.written_bytes > 0 && s.read_bytes > 0, "{case}: {s:?}");
        assert!(s.read_ahead > 0, "{case}: nothing was read ahead: {s:?}");
        assert_eq!(s.corrupt, 0, "{case}");
        // The prompt again: its prefix (spilled pages among it) reused.
        let again = greedy(&e, &long, 8);
        assert_eq!(again.prefix_reused, long.len() - 1, "{case}");
        same(case, "spilled prefix reused", &want, &again);
        // Several sequences batched, sharing the budget.
        let params = GenerateParams {
            max_new_tokens: 5,
            ignore_eos: true,
            record_logits: true,
            ..GenerateParams::default()
        };
        let mut next = long.clone();
        next.extend([11, 12, 13]);
        let prompts = [long.clone(), next, prompt_of(&dir, 2)];
        let mut seqs: Vec<_> = prompts
            .iter()
            .map(|p| e.sequence(p, &params, Decoding::default()).unwrap())
            .collect();
        while seqs.iter().any(|s| !s.finished()) {
            let mut batch: Vec<_> = seqs.iter_mut().filter(|s| !s.finished()).collect();
            e.step(&mut batch, 9, &mut |_, _| ControlFlow::Continue(()))
                .unwrap();
        }
        for (p, s) in prompts.iter().zip(seqs) {
            same(
                case,
                "batched",
                &greedy(&resident, p, 5),
                &s.into_generation(),
            );
        }
    }
}

/// Flips a byte in every slot of the spill file at `path`.
fn corrupt(path: &std::path::Path) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let len = f.metadata().unwrap().len();
    let slot = vpaged::direct::DIRECT_ALIGN as u64;
    let mut at = 0;
    while at < len {
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at + 3).unwrap();
        f.write_all_at(&[b[0] ^ 0x10], at + 3).unwrap();
        at += slot;
    }
    f.sync_all().unwrap();
}

/// Pages whose copies on disk are damaged between passes are detected, never
/// used: the positions they held are computed again from their ids, and the next
/// pass's logits bits equal a resident run's.
#[test]
fn a_corrupt_spilled_page_is_recomputed_exactly() {
    for case in CASES {
        let dir = fixtures().join(case);
        let spill = tempfile::tempdir().unwrap();
        let resident = Engine::open(&dir, EngineOptions::default()).unwrap();
        let e = Engine::open(&dir, spilling(16 << 10, spill.path(), 0)).unwrap();
        let long = prompt_of(&dir, 3);
        let cut = long.len() - 9;
        let mut want_kv = resident.new_kv();
        resident.prefill(&mut want_kv, &long[..cut]).unwrap();
        let want = resident.forward_all(&mut want_kv, &long[cut..]).unwrap();

        let mut kv = e.new_kv();
        e.prefill(&mut kv, &long[..cut]).unwrap();
        corrupt(&e.kv_pool_stats().unwrap().path.unwrap());
        let got = e.forward_all(&mut kv, &long[cut..]).unwrap();
        let s = e.kv_pool_stats().unwrap();
        assert!(s.corrupt > 0, "{case}: no damage was found: {s:?}");
        assert!(s.recomputed_positions > 0, "{case}: {s:?}");
        assert_eq!(
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{case}: logits bits after recomputing"
        );
        assert_eq!(kv.len(), long.len());
    }
}

/// A prompt whose KV spilled is persisted as a snapshot (its spilled pages read
/// back to write it), and a fresh engine with a budget reuses it: a resident cold
/// run's ids and bits.
#[test]
fn spilled_prefixes_persist_and_restart_exactly() {
    use libvoom::engine::snapshot::DiskPrefixes;
    for case in ["llama_gqa_untied", "deepseek_v3_mla_yarn"] {
        let (_d, dir) = common::copy_with_manifest(&fixtures().join(case));
        let spill = tempfile::tempdir().unwrap();
        let store = tempfile::tempdir().unwrap();
        let opts = || EngineOptions {
            prefix_disk: Some(DiskPrefixes {
                dir: store.path().to_path_buf(),
                budget: 64 << 20,
                min_tokens: 32,
            }),
            ..spilling(16 << 10, spill.path(), 64 << 20)
        };
        let long = prompt_of(&dir, 3);
        let want = greedy(
            &Engine::open(&dir, EngineOptions::default()).unwrap(),
            &long,
            6,
        );
        let first = Engine::open(&dir, opts()).unwrap();
        same(case, "first", &want, &greedy(&first, &long, 6));
        first.flush_prefixes();
        assert_eq!(first.snapshot_status().unwrap().0, 1, "{case}");
        assert!(first.kv_pool_stats().unwrap().written_bytes > 0, "{case}");
        drop(first);
        let restarted = Engine::open(&dir, opts()).unwrap();
        let g = greedy(&restarted, &long, 6);
        assert_eq!(g.prefix_reused, long.len() - 1, "{case}");
        same(case, "restarted", &want, &g);
    }
}

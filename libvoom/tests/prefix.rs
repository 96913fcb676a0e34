//! Prompt-prefix reuse (`libvoom::engine::prefix`): a prompt that repeats, extends
//! or shares a beginning with one computed before takes those positions from the
//! cache, and its ids and every logits bit equal a cold run's, on every attention
//! kind (grouped-query, sliding window, latent), alone and batched.

mod common;

use std::ops::ControlFlow;

use libvoom::engine::{Decoding, Engine, EngineOptions, GenerateParams};

use common::{copy_with_manifest, fixtures, greedy, prompt_of, same};

/// A hybrid's recurrent state is cut back only to where a pass started: an exact
/// repeat (the prompt's last position has a pass of its own, so the state before it
/// is kept) and a strict extension of a kept prompt or conversation reuse it, with
/// a cold run's ids and bits; a prompt sharing only a beginning reuses nothing.
#[test]
fn hybrid_prefixes_are_reused_on_repeats_and_extensions_only() {
    for case in ["qwen3_next_moe_legacy_config", "qwen3_5_text_dense"] {
        let dir = common::hybrid_fixtures().join(case);
        let opts = |prefix_cache_bytes| EngineOptions {
            prefill_chunk: 7,
            kv_page_positions: 16,
            prefix_cache_bytes,
            ..EngineOptions::default()
        };
        let cold = Engine::open(&dir, opts(0)).unwrap();
        let warm = Engine::open(&dir, opts(64 << 20)).unwrap();
        let long = prompt_of(&dir, 3);
        let n = 6;
        let a = greedy(&warm, &long, n);
        assert_eq!(a.prefix_reused, 0, "{case}");
        same(case, "first run", &greedy(&cold, &long, n), &a);
        let b = greedy(&warm, &long, n);
        assert_eq!(b.prefix_reused, long.len() - 1, "{case}: exact repeat");
        same(case, "repeat", &a, &b);
        let mut next = long.clone();
        next.extend(&a.ids[..5]);
        next.extend([11, 12, 13]);
        let c = greedy(&warm, &next, n);
        assert_eq!(c.prefix_reused, long.len() + 5, "{case}: extension");
        same(case, "extension", &greedy(&cold, &next, n), &c);
        let mut whole = long.clone();
        whole.extend(&a.ids);
        let d = greedy(&warm, &whole, n);
        assert_eq!(
            d.prefix_reused,
            whole.len() - 1,
            "{case}: the conversation repeated"
        );
        same(case, "conversation", &greedy(&cold, &whole, n), &d);
        let mut other = long[..40].to_vec();
        other.extend(prompt_of(&dir, 2));
        let e = greedy(&warm, &other, n);
        assert_eq!(e.prefix_reused, 0, "{case}: a shared beginning only");
        same(case, "shared beginning", &greedy(&cold, &other, n), &e);
    }
}

#[test]
fn reused_prefixes_give_cold_ids_and_bits() {
    for case in [
        "llama_gqa_untied",
        "mistral_sliding_window",
        "qwen3_moe_fused_sparse_step",
        "deepseek_v3_mla_yarn",
    ] {
        let dir = fixtures().join(case);
        let opts = |prefix_cache_bytes| EngineOptions {
            prefill_chunk: 7,
            kv_page_positions: 16,
            prefix_cache_bytes,
            ..EngineOptions::default()
        };
        let cold = Engine::open(&dir, opts(0)).unwrap();
        let warm = Engine::open(&dir, opts(64 << 20)).unwrap();
        let long = prompt_of(&dir, 3);
        assert!(long.len() > 100);

        // First time: nothing to reuse.
        let a = greedy(&warm, &long, 6);
        assert_eq!(a.prefix_reused, 0, "{case}");
        same(case, "first run", &greedy(&cold, &long, 6), &a);
        // The same prompt again: all but its last position reused.
        let b = greedy(&warm, &long, 6);
        assert_eq!(b.prefix_reused, long.len() - 1, "{case}");
        same(case, "repeat", &a, &b);
        // The next turn: the prompt, the answer, more: the conversation reused.
        let mut next = long.clone();
        next.extend(&a.ids[..5]);
        next.extend([11, 12, 13]);
        let c = greedy(&warm, &next, 6);
        assert_eq!(c.prefix_reused, long.len() + 5, "{case}");
        same(case, "extension", &greedy(&cold, &next, 6), &c);
        // A prompt that shares only a beginning (across a KV page boundary).
        let mut other = long[..40].to_vec();
        other.extend(prompt_of(&dir, 2));
        let d = greedy(&warm, &other, 6);
        // A sliding window's pages behind it are dropped (the window is 16): the
        // cached conversation no longer holds what a cut at 40 needs.
        let shared = if case == "mistral_sliding_window" {
            0
        } else {
            40
        };
        assert_eq!(d.prefix_reused, shared, "{case}");
        same(case, "shared beginning", &greedy(&cold, &other, 6), &d);
        assert!(warm.prefixes().reused_positions() > 0);
        // Batched: sequences taking prefixes beside one that does not.
        let params = GenerateParams {
            max_new_tokens: 5,
            ignore_eos: true,
            record_logits: true,
            ..GenerateParams::default()
        };
        let prompts = [long.clone(), next.clone(), prompt_of(&dir, 2)];
        let mut seqs: Vec<_> = prompts
            .iter()
            .map(|p| warm.sequence(p, &params, Decoding::default()).unwrap())
            .collect();
        while seqs.iter().any(|s| !s.finished()) {
            let mut batch: Vec<_> = seqs.iter_mut().filter(|s| !s.finished()).collect();
            warm.step(&mut batch, 9, &mut |_, _| ControlFlow::Continue(()))
                .unwrap();
        }
        for (p, s) in prompts.iter().zip(seqs) {
            let g = s.into_generation();
            same(case, "batched", &greedy(&cold, p, 5), &g);
        }
    }
}

/// Prefixes persisted on disk: a fresh engine (a restarted process) reuses the
/// prompt another computed, with a cold run's ids and bits; a damaged snapshot is
/// deleted and the prompt computed again, exactly; another checkpoint's snapshots
/// are never used.
#[test]
fn snapshots_survive_a_restart_exactly_and_damage_is_recomputed() {
    use libvoom::engine::snapshot::DiskPrefixes;
    // A hybrid's snapshot holds its recurrent state too, as of the prompt's end
    // and of the position before (an exact repeat computes that one again).
    for (case, src) in [
        ("llama_gqa_untied", fixtures()),
        ("deepseek_v3_mla_yarn", fixtures()),
        ("qwen3_next_moe_legacy_config", common::hybrid_fixtures()),
    ] {
        let (_d, dir) = copy_with_manifest(&src.join(case));
        let store = tempfile::tempdir().unwrap();
        let opts = |persist: bool| EngineOptions {
            prefix_cache_bytes: 64 << 20,
            prefix_disk: persist.then(|| DiskPrefixes {
                dir: store.path().to_path_buf(),
                budget: 64 << 20,
                min_tokens: 32,
            }),
            ..EngineOptions::default()
        };
        let cold = Engine::open(&dir, EngineOptions::default()).unwrap();
        let long = prompt_of(&dir, 3);
        let want = greedy(&cold, &long, 6);

        let first = Engine::open(&dir, opts(true)).unwrap();
        same(case, "first", &want, &greedy(&first, &long, 6));
        first.flush_prefixes();
        assert_eq!(first.snapshot_status().unwrap().0, 1, "{case}");
        drop(first);

        let restarted = Engine::open(&dir, opts(true)).unwrap();
        let g = greedy(&restarted, &long, 6);
        assert_eq!(g.prefix_reused, long.len() - 1, "{case}");
        // Counted once, from disk (the memory cache held nothing).
        assert_eq!(
            restarted.prefixes().reused_positions(),
            (long.len() - 1) as u64,
            "{case}"
        );
        same(case, "after a restart", &want, &g);
        drop(restarted);

        // Damage every snapshot: each is found, deleted, and the prompt recomputed.
        for f in walk(store.path()) {
            let mut b = std::fs::read(&f).unwrap();
            let at = b.len() - 40;
            b[at] ^= 1;
            std::fs::write(&f, b).unwrap();
        }
        let damaged = Engine::open(&dir, opts(true)).unwrap();
        let g = greedy(&damaged, &long, 6);
        assert_eq!(g.prefix_reused, 0, "{case}: a damaged snapshot was used");
        same(case, "after damage", &want, &g);

        // Another checkpoint version (its manifest differs: here by one byte of
        // whitespace) with the same store: the snapshot the restarted engines
        // wrote is not read.
        let fresh = Engine::open(&dir, opts(true)).unwrap();
        greedy(&fresh, &long, 6);
        fresh.flush_prefixes();
        drop(fresh);
        let (_e, other) = copy_with_manifest(&src.join(case));
        let m = other.join("voom-manifest.json");
        let text = std::fs::read_to_string(&m).unwrap();
        std::fs::write(&m, text + " ").unwrap();
        let e = Engine::open(&other, opts(true)).unwrap();
        assert_eq!(greedy(&e, &long, 6).prefix_reused, 0, "{case}");
        assert_eq!(
            greedy(&Engine::open(&dir, opts(true)).unwrap(), &long, 6).prefix_reused,
            long.len() - 1
        );
    }
}

fn walk(d: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Regression (issue 41, 1): a snapshot file replaced under its name after it was
/// indexed (another prompt's snapshot moved over it) is never used for the prompt
/// the name was indexed for, and nothing of it reaches the memory cache: the
/// prompt is computed cold, exactly, then and on every later repeat.
#[test]
fn a_snapshot_replaced_under_its_name_is_never_used_for_another_prompt() {
    use libvoom::engine::snapshot::DiskPrefixes;
    for (case, src) in [
        ("llama_gqa_untied", fixtures()),
        ("qwen3_next_moe_legacy_config", common::hybrid_fixtures()),
    ] {
        let (_d, dir) = copy_with_manifest(&src.join(case));
        let store = tempfile::tempdir().unwrap();
        let opts = || EngineOptions {
            prefix_cache_bytes: 64 << 20,
            prefix_disk: Some(DiskPrefixes {
                dir: store.path().to_path_buf(),
                budget: 64 << 20,
                min_tokens: 32,
            }),
            ..EngineOptions::default()
        };
        let cold = Engine::open(&dir, EngineOptions::default()).unwrap();
        let a = prompt_of(&dir, 3);
        let mut b = prompt_of(&dir, 2);
        b.extend(prompt_of(&dir, 3));
        assert_ne!(a[..32], b[..32], "{case}: the two prompts share no prefix");
        let want = greedy(&cold, &a, 6);

        let first = Engine::open(&dir, opts()).unwrap();
        greedy(&first, &a, 6);
        first.flush_prefixes();
        let a_file = walk(store.path());
        assert_eq!(a_file.len(), 1, "{case}");
        greedy(&first, &b, 6);
        first.flush_prefixes();
        let b_file: Vec<_> = walk(store.path())
            .into_iter()
            .filter(|f| f != &a_file[0])
            .collect();
        assert_eq!(b_file.len(), 1, "{case}");
        drop(first);

        // A server that indexed both snapshots; then B's file is moved over A's.
        let server = Engine::open(&dir, opts()).unwrap();
        assert_eq!(server.snapshot_status().unwrap().0, 2, "{case}");
        let tmp = a_file[0].with_extension("swap");
        std::fs::copy(&b_file[0], &tmp).unwrap();
        std::fs::rename(&tmp, &a_file[0]).unwrap();
        let g = greedy(&server, &a, 6);
        assert_eq!(g.prefix_reused, 0, "{case}: another prompt's KV was used");
        same(case, "after the swap", &want, &g);
        // Nothing wrong stuck in memory: a repeat reuses the prompt's own KV.
        let g = greedy(&server, &a, 6);
        same(case, "repeated after the swap", &want, &g);
        // B's own snapshot is still B's.
        let cold_b = greedy(&cold, &b, 6);
        same(case, "B after the swap", &cold_b, &greedy(&server, &b, 6));
    }
}

/// Regression (issue 41, 2): a run whose pages are not verified (verification
/// off) writes no snapshot, so a copy of the model with changed weights (and the
/// genuine manifest) leaves nothing that the genuine model would reuse.
#[test]
fn a_run_on_unverified_weights_writes_no_snapshot() {
    use libvoom::engine::snapshot::DiskPrefixes;
    use vpaged::VerifyMode;
    let case = "llama_gqa_untied";
    let (_g, genuine) = copy_with_manifest(&fixtures().join(case));
    let (_c, changed) = copy_with_manifest(&fixtures().join(case));
    // Change the bytes of one weight (the manifest still names the genuine ones).
    let ckpt = voom_formats::Checkpoint::open(&changed).unwrap();
    let (name, loc) = ckpt
        .tensors()
        .map(|(n, l)| (n.to_string(), l.clone()))
        .find(|(n, _)| n.ends_with("layers.0.self_attn.v_proj.weight"))
        .unwrap();
    let path = ckpt.files[loc.file].path.clone();
    let (offset, len) = (loc.info.offset as usize, loc.info.len as usize);
    drop(ckpt);
    let mut bytes = std::fs::read(&path).unwrap();
    for (i, b) in bytes[offset..offset + len].iter_mut().enumerate() {
        // BF16 pairs: the high byte's exponent bits scaled, the low byte scrambled.
        *b = if i % 2 == 1 { b.wrapping_add(1) } else { !*b };
    }
    std::fs::write(&path, bytes).unwrap();

    let store = tempfile::tempdir().unwrap();
    let opts = |verify| EngineOptions {
        verify,
        prefix_cache_bytes: 64 << 20,
        prefix_disk: Some(DiskPrefixes {
            dir: store.path().to_path_buf(),
            budget: 64 << 20,
            min_tokens: 32,
        }),
        ..EngineOptions::default()
    };
    let long = prompt_of(&genuine, 3);
    let want = greedy(
        &Engine::open(&genuine, EngineOptions::default()).unwrap(),
        &long,
        6,
    );
    let off = Engine::open(&changed, opts(VerifyMode::Off)).unwrap();
    let bad = greedy(&off, &long, 6);
    assert_ne!(
        common::bits(&bad.logits),
        common::bits(&want.logits),
        "{name}: the changed weight changes nothing"
    );
    assert!(
        off.snapshot_status().is_none(),
        "unverified pages kept snapshots"
    );
    off.flush_prefixes();
    drop(off);
    assert!(walk(store.path()).is_empty(), "a snapshot was written");
    let g = greedy(
        &Engine::open(&genuine, opts(VerifyMode::FirstUse)).unwrap(),
        &long,
        6,
    );
    assert_eq!(g.prefix_reused, 0);
    same(case, "genuine after the changed copy", &want, &g);
}

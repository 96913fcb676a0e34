//! A backend whose batch invariance is not shown (MLX's GPU kernels) keeps exact ids
//! by turning off what needs invariance: prefix reuse, speculation and batching (one
//! sequence a pass, its prompt in one pass), and every generation says so. Run here
//! on the CPU backend told to distrust its invariance
//! (`EngineOptions::distrust_batch_invariance`): the same ids and logits bits as a
//! plain engine, nothing reused, drafted or batched.

mod common;

use std::ops::ControlFlow;

use libvoom::engine::{Decoding, Engine, EngineOptions, GenerateParams};
use libvoom::speculate::lookup::PromptLookup;

use common::{bits, fixtures, prompt_of};

fn open(distrust: bool) -> Engine {
    let dir = fixtures().join("llama_gqa_untied");
    Engine::open(
        &dir,
        EngineOptions {
            prefix_cache_bytes: 64 << 20,
            distrust_batch_invariance: distrust,
            ..Default::default()
        },
    )
    .unwrap()
}

fn params() -> GenerateParams {
    GenerateParams {
        max_new_tokens: 12,
        ignore_eos: true,
        record_logits: true,
        ..Default::default()
    }
}

#[test]
fn without_invariance_nothing_is_reused_drafted_or_batched_and_ids_stay() {
    let (plain, gated) = (open(false), open(true));
    assert!(plain.batch_invariant() && plain.exactness_note().is_none());
    assert!(!gated.batch_invariant());
    let note = gated.exactness_note().expect("a note");
    assert!(
        note.contains("prefix reuse, speculation and batching are off"),
        "{note}"
    );
    let dir = fixtures().join("llama_gqa_untied");
    let prompt = prompt_of(&dir, 2);
    let go = |e: &Engine| {
        e.generate(&prompt, &params(), &mut |_| ControlFlow::Continue(()))
            .unwrap()
    };

    // Prefix reuse: the plain engine reuses the repeated prompt, the gated one
    // computes it again; the same ids and bits.
    let (p1, p2) = (go(&plain), go(&plain));
    assert!(p2.prefix_reused > 0, "the plain engine reuses the prompt");
    let (g1, g2) = (go(&gated), go(&gated));
    assert_eq!((g1.prefix_reused, g2.prefix_reused), (0, 0));
    for g in [&g1, &g2, &p2] {
        assert_eq!(g.ids, p1.ids);
        assert_eq!(bits(&g.logits), bits(&p1.logits));
    }
    assert_eq!(g1.exactness_note.as_deref(), Some(note.as_str()));
    assert_eq!(p1.exactness_note, None);
    assert_eq!(g1.backend, plain.backend_name());

    // Speculation: the drafter is not used; one pass a token.
    let mut lookup = PromptLookup::default();
    let s = gated
        .generate_with(
            &prompt,
            &params(),
            Decoding {
                constraint: None,
                drafter: Some(&mut lookup),
            },
            &mut |_| ControlFlow::Continue(()),
        )
        .unwrap();
    assert!(s.speculation.is_none());
    assert_eq!(s.decode_passes, s.ids.len() - 1);
    assert_eq!(s.ids, p1.ids);
    assert_eq!(bits(&s.logits), bits(&p1.logits));

    // Batching: two sequences stepped together advance one at a time, each with
    // the ids and bits it gets alone.
    let prompts = [prompt_of(&dir, 0), prompt_of(&dir, 1)];
    let alone: Vec<_> = prompts
        .iter()
        .map(|p| {
            plain
                .generate(p, &params(), &mut |_| ControlFlow::Continue(()))
                .unwrap()
        })
        .collect();
    let mut a = gated
        .sequence(&prompts[0], &params(), Decoding::default())
        .unwrap();
    let mut b = gated
        .sequence(&prompts[1], &params(), Decoding::default())
        .unwrap();
    let mut steps = 0;
    while !(a.finished() && b.finished()) {
        let mut heard = std::collections::BTreeSet::new();
        gated
            .step(&mut [&mut a, &mut b], usize::MAX, &mut |i, _| {
                heard.insert(i);
                ControlFlow::Continue(())
            })
            .unwrap();
        assert!(heard.len() <= 1, "a pass computed {heard:?}");
        steps += 1;
        assert!(steps < 100, "the sequences do not finish");
    }
    for (g, want) in [a.into_generation(), b.into_generation()]
        .iter()
        .zip(&alone)
    {
        assert_eq!(g.ids, want.ids);
        assert_eq!(bits(&g.logits), bits(&want.logits));
    }
    // One pass for each prompt and each id after the first: no pass was shared.
    assert_eq!(steps, 2 * params().max_new_tokens);
}

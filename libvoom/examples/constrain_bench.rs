//! The cost of token-level constrained decoding (`libvoom::constrain`), against the
//! decode step it rides on, measured in the same runs (BENCHMARKS.md):
//!
//! - token table: building the grammar compiler's vocabulary table (once per
//!   tokenizer), ms;
//! - schema compile: one JSON schema to a grammar (once per request), ms;
//! - mask: computing the allowed-token mask, checking end of sequence and accepting
//!   the chosen token, µs per generated token, and its share of the decode step (the
//!   bound: a mask costing 0% leaves decode at its unconstrained speed);
//! - decode: the same generation's decode step, µs per token, and an unconstrained
//!   generation's for comparison.
//!
//! `cargo run --release -p libvoom --example constrain_bench -- MODEL_DIR [RUNS]`
//! (a model with a tokenizer and a chat template, e.g. `~/.voom/models/smollm2-135m-instruct`).

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Instant;

use libvoom::constrain::{Grammar, GrammarCompiler};
use libvoom::engine::{Engine, EngineOptions, GenerateParams};
use serde_json::json;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .expect("usage: constrain_bench MODEL_DIR [RUNS]"),
    );
    let runs: usize = args
        .next()
        .map_or(5, |r| r.parse().expect("RUNS is a number"));
    let engine = Engine::open(&dir, EngineOptions::default()).expect("model");
    let tok = engine.tokenizer().expect("a tokenizer");
    let text = tok
        .chat_template()
        .expect("a chat template")
        .render(
            &[json!({"role": "user", "content": "Weather request for Rome, 2 days, as JSON."})],
            None,
            true,
            None,
        )
        .expect("render");
    let prompt = tok.encode(&text, false).expect("encode");
    let schema = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
        },
        "required": ["city", "unit", "days"],
        "additionalProperties": false
    });
    let params = GenerateParams {
        max_new_tokens: 200,
        ..Default::default()
    };

    let (mut table_ms, mut compile_ms, mut mask_us, mut step_us, mut free_us, mut share) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    let mut tokens = 0;
    for _ in 0..=runs {
        let t = Instant::now();
        let fresh = GrammarCompiler::new(tok, engine.config().vocab_size, engine.eos_ids())
            .expect("grammar compiler");
        table_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        let grammar = fresh
            .compile(&Grammar::json_schema(&schema).expect("schema"))
            .expect("compile");
        compile_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let g = engine
            .generate_constrained(&prompt, &params, &mut grammar.matcher(), &mut |_| {
                ControlFlow::Continue(())
            })
            .expect("constrained generation");
        let free = engine
            .generate(&prompt, &params, &mut |_| ControlFlow::Continue(()))
            .expect("generation");
        let n = g.ids.len() as f64;
        tokens = g.ids.len();
        mask_us.push(g.constraint_secs / n * 1e6);
        step_us.push(g.decode_secs / n * 1e6);
        share.push(g.constraint_secs / g.decode_secs);
        free_us.push(free.decode_secs / free.ids.len() as f64 * 1e6);
    }
    // The first run warms the caches; medians of the rest.
    let m = |v: Vec<f64>| median(v[1..].to_vec());
    println!(
        "{tokens} constrained tokens; medians of {runs} runs\n\
         token table (once per tokenizer) {:>9.1} ms\n\
         schema compile (once per request) {:>8.2} ms\n\
         mask, per token                  {:>9.1} us = {:.2}% of the decode step\n\
         decode step, constrained         {:>9.1} us/token\n\
         decode step, unconstrained       {:>9.1} us/token",
        m(table_ms),
        m(compile_ms),
        m(mask_us),
        100.0 * m(share),
        m(step_us),
        m(free_us),
    );
}

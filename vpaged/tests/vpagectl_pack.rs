//! `vpagectl pack` on a real (small) checkpoint written with the safetensors writer:
//! every BF16/F16 page gets a vpack body in `model.vpack` that decodes to exactly its
//! raw bytes, F32 pages stay raw, `verify` checks the bodies, and a flipped byte or a
//! truncated pack file makes `verify` fail naming the page and file, never panic.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use voom_formats::dtype::{f32_to_bf16, DType};
use voom_formats::manifest::{Encoding, Manifest, MANIFEST_FILE, MANIFEST_VERSION_ENCODED};
use voom_formats::vpack::{self, PACK_ALIGN, PACK_FILE};
use voom_formats::{safetensors, Checkpoint};

fn vpagectl(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vpagectl"))
        .args(args)
        .arg(dir)
        .output()
        .expect("runs vpagectl")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn bf16_bytes(n: usize, seed: f32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| f32_to_bf16((i as f32 * 0.37 + seed).sin() * 0.05).to_le_bytes())
        .collect()
}

fn write_model(dir: &Path) {
    let emb = bf16_bytes(64 * 32, 0.1);
    let q = bf16_bytes(32 * 32, 0.2);
    let up = bf16_bytes(32 * 96, 0.3);
    let f16: Vec<u8> = (0..32 * 8u16)
        .flat_map(|i| (0x3C00u16 ^ (i * 7)).to_le_bytes())
        .collect();
    let norm_f32: Vec<u8> = (0..32)
        .flat_map(|i| (1.0f32 + i as f32).to_le_bytes())
        .collect();
    let norm = bf16_bytes(32, 0.5);
    safetensors::write(
        &dir.join("model.safetensors"),
        &[
            ("model.embed_tokens.weight", DType::BF16, &[64, 32], &emb),
            (
                "model.layers.0.self_attn.q_proj.weight",
                DType::BF16,
                &[32, 32],
                &q,
            ),
            (
                "model.layers.0.mlp.up_proj.weight",
                DType::BF16,
                &[96, 32],
                &up,
            ),
            ("model.layers.0.extra.weight", DType::F16, &[32, 8], &f16),
            (
                "model.layers.0.input_layernorm.weight",
                DType::F32,
                &[32],
                &norm_f32,
            ),
            ("model.norm.weight", DType::BF16, &[32], &norm),
        ],
        &BTreeMap::from([("format".to_string(), "pt".to_string())]),
    )
    .unwrap();
}

fn stdout_json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", text(out)))
}

fn packed(dir: &Path) -> Manifest {
    assert!(vpagectl(&["hash"], dir).status.success());
    let out = vpagectl(&["pack", "--json"], dir);
    assert!(out.status.success(), "{}", text(&out));
    let report = stdout_json(&out);
    assert_eq!(report["ok"], true);
    assert_eq!(report["pages"], 5);
    assert_eq!(report["raw_pages"], 1);
    assert!(report["ratio"].as_f64().unwrap() < 1.0, "{report}");
    assert!(report["decode_gb_per_s"].as_f64().unwrap() > 0.0);
    Manifest::load(dir).unwrap().unwrap()
}

#[test]
fn pack_writes_bodies_that_decode_to_the_raw_bytes() {
    let d = tempfile::tempdir().unwrap();
    write_model(d.path());
    let m = packed(d.path());
    assert_eq!(m.format_version, MANIFEST_VERSION_ENCODED);
    let ckpt = Checkpoint::open(d.path()).unwrap();
    m.check_matches(&ckpt).unwrap();
    let file = std::fs::read(d.path().join(PACK_FILE)).unwrap();
    let mut last_offset = None;
    for p in &m.pages {
        let raw = ckpt.tensor_bytes(&p.name).unwrap();
        // The raw location is untouched.
        assert_eq!(p.encoding, Encoding::Raw);
        assert_eq!(p.file, "model.safetensors");
        let Some(body) = p.vpack() else {
            assert_eq!(p.dtype, DType::F32, "{}", p.name);
            assert!(p.encoded.is_empty());
            continue;
        };
        assert_eq!(body.file, PACK_FILE);
        assert_eq!(body.offset % PACK_ALIGN, 0, "{}", p.name);
        // Bodies are in manifest order.
        assert!(last_offset < Some(body.offset));
        last_offset = Some(body.offset);
        let bytes = &file[body.offset as usize..(body.offset + body.len) as usize];
        let mut out = vec![0; vpack::decoded_len(bytes).unwrap()];
        vpack::decode(bytes, &mut out).unwrap();
        assert!(out == raw, "{}", p.name);
    }

    let out = vpagectl(&["verify"], d.path());
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("verified 6 pages (5 with vpack bodies)"),
        "{}",
        text(&out)
    );

    // Packing again replaces the bodies and still verifies.
    let again = packed(d.path());
    assert_eq!(again, m);
    assert!(vpagectl(&["verify"], d.path()).status.success());
}

#[test]
fn verify_names_a_page_whose_vpack_body_is_damaged() {
    let d = tempfile::tempdir().unwrap();
    write_model(d.path());
    let m = packed(d.path());
    let up = m.page("model.layers.0.mlp.up_proj.weight").unwrap();
    let body = up.vpack().unwrap();
    let pack_path = d.path().join(PACK_FILE);
    let good = std::fs::read(&pack_path).unwrap();

    // One byte flipped in the middle of the body.
    let mut bad = good.clone();
    bad[(body.offset + body.len / 2) as usize] ^= 0x08;
    std::fs::write(&pack_path, &bad).unwrap();
    let out = vpagectl(&["verify"], d.path());
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("MISMATCH page 'model.layers.0.mlp.up_proj.weight'") && t.contains(PACK_FILE),
        "{t}"
    );
    assert_eq!(t.matches("MISMATCH").count(), 1, "{t}");
    let out = vpagectl(&["verify", "--json"], d.path());
    assert_eq!(out.status.code(), Some(1));
    let report = stdout_json(&out);
    assert_eq!(report["ok"], false);
    let list = report["mismatches"].as_array().unwrap();
    assert_eq!(list.len(), 1, "{report}");
    assert_eq!(list[0]["page"], "model.layers.0.mlp.up_proj.weight");
    assert!(list[0]["file"].as_str().unwrap().ends_with(PACK_FILE));

    // The body's header damaged: a decode error naming the page.
    let mut bad = good.clone();
    bad[body.offset as usize + 1] ^= 0xFF;
    std::fs::write(&pack_path, &bad).unwrap();
    let out = vpagectl(&["verify"], d.path());
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("MISMATCH page 'model.layers.0.mlp.up_proj.weight'") && t.contains("bad magic"),
        "{t}"
    );

    // Truncated inside the up_proj body: that page and every later one are named,
    // with a clear error and no panic.
    let cut = (body.offset + body.len / 3) as usize;
    std::fs::write(&pack_path, &good[..cut]).unwrap();
    let out = vpagectl(&["verify"], d.path());
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let t = text(&out);
    assert!(!t.contains("panicked"), "{t}");
    let later: Vec<_> = m
        .pages
        .iter()
        .filter(|p| p.vpack().is_some_and(|b| b.offset >= body.offset))
        .collect();
    assert!(later.len() >= 2);
    for p in later {
        assert!(
            t.contains(&format!("MISMATCH page '{}'", p.name)),
            "{}: {t}",
            p.name
        );
    }
    assert!(
        t.contains(&format!("runs past the end of the file ({cut} bytes)")),
        "{t}"
    );

    // Gone: one clear error naming the file.
    std::fs::remove_file(&pack_path).unwrap();
    let out = vpagectl(&["verify"], d.path());
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains(PACK_FILE), "{}", text(&out));
}

#[test]
fn pack_needs_a_manifest_and_refuses_a_mismatching_page() {
    let d = tempfile::tempdir().unwrap();
    write_model(d.path());
    let out = vpagectl(&["pack"], d.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains(MANIFEST_FILE), "{}", text(&out));

    assert!(vpagectl(&["hash"], d.path()).status.success());
    let m = Manifest::load(d.path()).unwrap().unwrap();
    let q = m.page("model.layers.0.self_attn.q_proj.weight").unwrap();
    let st = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    bytes[(q.offset + 3) as usize] ^= 0x01;
    std::fs::write(&st, &bytes).unwrap();
    let out = vpagectl(&["pack"], d.path());
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains(&q.name), "{}", text(&out));
    assert!(!d.path().join(PACK_FILE).exists());
    assert_eq!(Manifest::load(d.path()).unwrap().unwrap(), m);
}

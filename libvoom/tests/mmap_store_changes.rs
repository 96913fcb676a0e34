//! Issue 8, defects 4 and 5, through a real engine on the memory-mapped (embedded)
//! store over a real random-weights checkpoint: a checkpoint truncated while the
//! engine runs is an error naming the file (never SIGBUS), and bytes that change on
//! disk after verification are an error (never a different answer with success). A
//! checkpoint replaced by rename keeps being served, bit for bit, from the old inode.

use std::ops::ControlFlow;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use libvoom::engine::{Engine, EngineOptions, GenerateParams};
use libvoom::VoomError;
use vpaged::StoreError;

const CASE: &str = "llama_gqa_untied";
const TENSOR: &str = "model.layers.0.self_attn.q_proj.weight";

/// A copy of a tiny fixture, with a page manifest when `manifest`.
fn fixture_copy(manifest: bool) -> (tempfile::TempDir, PathBuf) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/tiny")
        .join(CASE);
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join(CASE);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    if manifest {
        let ckpt = voom_formats::Checkpoint::open(&dir).unwrap();
        voom_formats::Manifest::build(&ckpt, &mut |_, _| {})
            .unwrap()
            .save(&dir)
            .unwrap();
    }
    (d, dir)
}

fn weights(dir: &Path) -> PathBuf {
    dir.join("model.safetensors")
}

fn prompt() -> Vec<u32> {
    (0..9).map(|i| (i * 37 + 5) % 300).collect()
}

fn params(n: usize) -> GenerateParams {
    GenerateParams {
        max_new_tokens: n,
        ignore_eos: true,
        record_logits: true,
        ..Default::default()
    }
}

/// Greedy ids and the bits of every step's logits.
fn generate(engine: &Engine, n: usize) -> Result<(Vec<u32>, Vec<u32>), VoomError> {
    generate_with(engine, n, &mut |_| ControlFlow::Continue(()))
}

fn generate_with(
    engine: &Engine,
    n: usize,
    on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
) -> Result<(Vec<u32>, Vec<u32>), VoomError> {
    let g = engine.generate(&prompt(), &params(n), on_token)?;
    let bits = g.logits.iter().flatten().map(|v| v.to_bits()).collect();
    Ok((g.ids, bits))
}

/// Where `name`'s bytes are in the fixture's file.
fn range_of(dir: &Path, name: &str) -> std::ops::Range<u64> {
    let ckpt = voom_formats::Checkpoint::open(dir).unwrap();
    ckpt.get(name).unwrap().info.range()
}

fn overwrite(dir: &Path, name: &str) {
    let r = range_of(dir, name);
    // Same length, other bytes: BF16 1.0 everywhere.
    let junk: Vec<u8> = (0..r.end - r.start)
        .map(|i| if i % 2 == 0 { 0x80 } else { 0x3f })
        .collect();
    std::fs::OpenOptions::new()
        .write(true)
        .open(weights(dir))
        .unwrap()
        .write_all_at(&junk, r.start)
        .unwrap();
}

fn truncate(dir: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(weights(dir))
        .unwrap()
        .set_len(len)
        .unwrap();
}

fn open(dir: &Path) -> Engine {
    Engine::open(
        dir,
        EngineOptions {
            threads: 1,
            ..Default::default()
        },
    )
    .unwrap()
}

/// An error of the mmap store about `file`: truncated (file and byte range), a read
/// fault (file and byte offset), changed while in use (file), or bytes that fail
/// their page's verification (page, and a tier that names the file).
fn assert_names_the_file(e: &VoomError, file: &Path) {
    let msg = e.to_string();
    match e {
        VoomError::Store(StoreError::Truncated {
            file: f,
            start,
            end,
            ..
        }) => {
            assert_eq!(f, file);
            assert!(msg.contains(&format!("bytes {start}..{end}")), "{msg}");
        }
        VoomError::Store(StoreError::Format(voom_formats::FormatError::Fault { path, offset })) => {
            assert_eq!(path, file);
            assert!(msg.contains(&format!("byte offset {offset}")), "{msg}");
        }
        VoomError::Store(StoreError::FileChanged { file: f, .. }) => assert_eq!(f, file),
        // A page verified on its first use after the cut: the bytes up to the end of
        // the OS page that holds the new end of the file read as zeros, without a
        // fault, and fail the page's blake3 (its tier names the file).
        VoomError::Store(StoreError::Integrity { tier, .. }) => {
            assert!(tier.contains(&file.display().to_string()), "{msg}")
        }
        other => panic!("expected an error naming {}, got {other}", file.display()),
    }
    assert!(msg.contains(&file.display().to_string()), "{msg}");
}

/// Defect 4: truncating the checkpoint under a running engine (between generations,
/// and between two decode steps of one generation) is an error naming the file and
/// the byte range, and the process lives on.
#[test]
fn sigbus_a_checkpoint_truncated_under_the_engine_is_an_error_naming_the_file() {
    for manifest in [true, false] {
        let (_d, dir) = fixture_copy(manifest);
        let file = weights(&dir);
        let len = std::fs::metadata(&file).unwrap().len();
        let engine = open(&dir);
        let reference = generate(&engine, 12).unwrap();
        truncate(&dir, len / 2);
        let e = generate(&engine, 12).unwrap_err();
        assert_names_the_file(&e, &file);
        assert!(
            matches!(e, VoomError::Store(StoreError::Truncated { .. })),
            "{e}"
        );

        let (_d, dir) = fixture_copy(manifest);
        let file = weights(&dir);
        let engine = open(&dir);
        assert_eq!(generate(&engine, 12).unwrap(), reference);
        let mut step = 0;
        let e = generate_with(&engine, 12, &mut |_| {
            step += 1;
            if step == 2 {
                truncate(&dir, len / 2);
            }
            ControlFlow::Continue(())
        })
        .unwrap_err();
        assert_eq!(step, 2, "no token is emitted after the truncation");
        assert_names_the_file(&e, &file);
    }
}

/// Defect 4, racing: the file is truncated by another thread at arbitrary moments of
/// a generation (inside forward passes too, where the engine reads pages past the new
/// end: SIGBUS without the guard). Every generation either completes before the cut
/// with the reference answer or fails with an error naming the file; the process
/// survives every one.
#[test]
fn sigbus_a_checkpoint_truncated_mid_pass_never_kills_the_engine_or_changes_its_answer() {
    let (_d, dir) = fixture_copy(true);
    let file = weights(&dir);
    let original = std::fs::read(&file).unwrap();
    let engine = open(&dir);
    let reference = generate(&engine, 40).unwrap();
    let t = Instant::now();
    generate(&engine, 40).unwrap();
    let took = t.elapsed();
    drop(engine);

    let (mut ok, mut truncated, mut faults, mut changed) = (0, 0, 0, 0);
    for trial in 0..24u32 {
        // Restored (rewritten in place) before the engine opens: a new mapping.
        std::fs::write(&file, &original).unwrap();
        let engine = open(&dir);
        let delay = took.mul_f64(f64::from(trial) / 30.0);
        // Not page-aligned: the page holding the new end reads zeros past it without
        // faulting, the pages after it fault.
        let cut = original.len() as u64 / 3 + 1000;
        let dir2 = dir.clone();
        let cutter = std::thread::spawn(move || {
            std::thread::sleep(delay);
            truncate(&dir2, cut);
        });
        let r = generate(&engine, 40);
        cutter.join().unwrap();
        match r {
            Ok(got) => {
                assert_eq!(got, reference, "trial {trial}: a different answer");
                ok += 1;
            }
            Err(e) => {
                assert_names_the_file(&e, &file);
                match e {
                    VoomError::Store(StoreError::Truncated { .. }) => truncated += 1,
                    VoomError::Store(StoreError::Format(_)) => faults += 1,
                    _ => changed += 1,
                }
            }
        }
    }
    eprintln!(
        "24 trials: {ok} finished before the cut, {truncated} truncated before a lease, \
         {faults} read faults, {changed} changed while leased"
    );
    assert!(ok < 24, "no trial saw the truncation");
}

/// Defect 5: a tensor overwritten in place after its first-use verification is never
/// computed on: the next generation is an integrity error naming the page and the
/// file, whether the overwrite happens between generations or between two decode
/// steps of one.
#[test]
fn changed_bytes_overwritten_in_place_after_verification_are_an_integrity_error() {
    let (_d, dir) = fixture_copy(true);
    let file = weights(&dir);
    let engine = open(&dir);
    let reference = generate(&engine, 12).unwrap();
    overwrite(&dir, TENSOR);
    for _ in 0..2 {
        let e = generate(&engine, 12).unwrap_err();
        match &e {
            VoomError::Store(StoreError::Integrity { page, tier, .. }) => {
                assert_eq!(page, TENSOR);
                assert!(tier.contains(&file.display().to_string()), "{tier}");
                assert!(tier.contains("changed on disk"), "{tier}");
            }
            other => panic!("expected an integrity error, got {other}"),
        }
    }

    let (_d, dir) = fixture_copy(true);
    let engine = open(&dir);
    assert_eq!(generate(&engine, 12).unwrap(), reference);
    let mut step = 0;
    let e = generate_with(&engine, 12, &mut |_| {
        step += 1;
        if step == 3 {
            overwrite(&dir, TENSOR);
        }
        ControlFlow::Continue(())
    })
    .unwrap_err();
    assert_eq!(step, 3, "no token is emitted after the overwrite");
    assert!(
        matches!(&e, VoomError::Store(StoreError::Integrity { page, .. }) if page == TENSOR),
        "{e}"
    );
}

/// Defect 5 without a manifest: there is nothing to re-verify against, so a file that
/// changed on disk is an error saying so (never a different answer).
#[test]
fn changed_bytes_without_a_manifest_are_an_error_that_the_file_changed() {
    let (_d, dir) = fixture_copy(false);
    let file = weights(&dir);
    let engine = open(&dir);
    generate(&engine, 12).unwrap();
    overwrite(&dir, TENSOR);
    let e = generate(&engine, 12).unwrap_err();
    assert!(
        matches!(&e, VoomError::Store(StoreError::FileChanged { file: f, .. }) if f == &file),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("changed on disk since the model was opened"),
        "{e}"
    );
}

/// A checkpoint replaced by rename (a new inode at the path, as `voom pull` and the
/// writer do) leaves the engine on the old inode: the same verified bytes, the same ids
/// and logits bits, with and without a manifest.
#[test]
fn a_checkpoint_replaced_by_rename_keeps_serving_the_verified_old_bytes() {
    for manifest in [true, false] {
        let (_d, dir) = fixture_copy(manifest);
        let file = weights(&dir);
        let engine = open(&dir);
        let reference = generate(&engine, 12).unwrap();
        // The replacement: the same checkpoint with one tensor changed.
        let tmp = dir.join(".model.safetensors.new");
        std::fs::copy(&file, &tmp).unwrap();
        let r = range_of(&dir, TENSOR);
        let f = std::fs::OpenOptions::new().write(true).open(&tmp).unwrap();
        f.write_all_at(&vec![0x3f; (r.end - r.start) as usize], r.start)
            .unwrap();
        std::fs::rename(&tmp, &file).unwrap();
        for _ in 0..2 {
            assert_eq!(generate(&engine, 12).unwrap(), reference);
        }
        // A new engine sees the new file (different weights).
        if !manifest {
            let fresh = open(&dir);
            assert_ne!(generate(&fresh, 12).unwrap().1, reference.1);
        }
    }
}

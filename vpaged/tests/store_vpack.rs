//! The store core serves pages from their vpack bodies (fewer bytes from storage),
//! verified to the manifest's hash, and falls back to the raw bytes when a body is
//! damaged.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use voom_formats::{DType, Manifest};
use vpaged::store::{Store, StoreConfig};

mod common;
use common::{layered_packed_model, weights};

fn vpagectl(args: &[&str], dir: &Path) {
    let o = Command::new(env!("CARGO_BIN_EXE_vpagectl"))
        .args(args)
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "vpagectl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn pages_come_from_vpack_bodies_and_fall_back_to_raw() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("m");
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (weights(64 * 1024, 1), weights(32 * 1024, 2));
    let norm: Vec<u8> = (0..256u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    voom_formats::safetensors::write(
        &dir.join("model.safetensors"),
        &[
            ("a", DType::BF16, &[256, 256], &a),
            ("b", DType::BF16, &[128, 256], &b),
            ("n", DType::F32, &[256], &norm),
        ],
        &BTreeMap::new(),
    )
    .unwrap();
    vpagectl(&["hash"], &dir);
    vpagectl(&["pack"], &dir);
    let manifest = Manifest::load(&dir).unwrap().unwrap();
    assert!(manifest.page("a").unwrap().vpack().is_some());
    assert!(manifest.page("n").unwrap().vpack().is_none());
    let raw_total: u64 = manifest.pages.iter().map(|p| p.len).sum();

    let store = Store::new(StoreConfig {
        cache_bytes: 8 << 20,
        ..Default::default()
    })
    .unwrap();
    let id = store.open_model(&dir).unwrap();
    for (name, want) in [("a", &a), ("b", &b), ("n", &norm)] {
        let p = manifest.page(name).unwrap();
        let lease = store.acquire(id, p.id).unwrap();
        assert_eq!(lease.bytes(), want.as_slice(), "{name}");
    }
    let m = store.model(id).unwrap();
    let read = m.primary_stats().bytes;
    assert!(
        read < raw_total * 9 / 10,
        "read {read} bytes of {raw_total}: the packed bodies were not used"
    );

    // A damaged body: the raw bytes serve, and the failure is counted.
    let b_entry = manifest.page("b").unwrap();
    let body = b_entry.vpack().unwrap();
    let pack = dir.join(&body.file);
    let mut bytes = std::fs::read(&pack).unwrap();
    bytes[(body.offset + body.len / 2) as usize] ^= 0x55;
    std::fs::write(&pack, bytes).unwrap();
    let store = Store::new(StoreConfig {
        cache_bytes: 8 << 20,
        ..Default::default()
    })
    .unwrap();
    let id = store.open_model(&dir).unwrap();
    let lease = store.acquire(id, b_entry.id).unwrap();
    assert_eq!(lease.bytes(), b.as_slice());
    let s = store.model(id).unwrap().primary_stats();
    assert!(s.integrity_failures + s.errors >= 1, "{s:?}");
}

/// Out of core a page is loaded again and again from its body: once a body decoded to
/// the verified page it is sealed, and a later copy that differs from it (the pack
/// file changed under the store) is still refused, the raw bytes serving instead.
#[test]
fn a_body_changed_after_it_was_sealed_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("m");
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (weights(64 * 1024, 3), weights(64 * 1024, 4));
    voom_formats::safetensors::write(
        &dir.join("model.safetensors"),
        &[
            ("a", DType::BF16, &[256, 256], &a),
            ("b", DType::BF16, &[256, 256], &b),
        ],
        &BTreeMap::new(),
    )
    .unwrap();
    vpagectl(&["hash"], &dir);
    vpagectl(&["pack"], &dir);
    let manifest = Manifest::load(&dir).unwrap().unwrap();
    let (ea, eb) = (manifest.page("a").unwrap(), manifest.page("b").unwrap());
    // Room for one page: each load of one evicts the other.
    let store = Store::new(StoreConfig {
        cache_bytes: 160 << 10,
        ..Default::default()
    })
    .unwrap();
    let id = store.open_model(&dir).unwrap();
    let m = store.model(id).unwrap();
    for round in 0..3 {
        for (e, want) in [(ea, &a), (eb, &b)] {
            let lease = store.acquire(id, e.id).unwrap();
            assert_eq!(lease.bytes(), want.as_slice(), "round {round}");
        }
    }
    let s = m.primary_stats();
    assert_eq!(s.integrity_failures, 0, "{s:?}");
    let body_bytes = ea.vpack().unwrap().len + eb.vpack().unwrap().len;
    assert_eq!(
        s.bytes,
        3 * body_bytes,
        "every round reads both bodies, nothing more"
    );

    let body = ea.vpack().unwrap();
    let pack = dir.join(&body.file);
    let mut bytes = std::fs::read(&pack).unwrap();
    bytes[(body.offset + body.len - 3) as usize] ^= 0x01;
    std::fs::write(&pack, bytes).unwrap();
    let lease = store.acquire(id, ea.id).unwrap();
    assert_eq!(lease.bytes(), a.as_slice());
    let s = m.primary_stats();
    assert_eq!(s.integrity_failures, 1, "{s:?}");
}

/// A hinted layer of vpack pages is shared out between the prefetch threads: every
/// page of the group is loaded ahead (none is lost on the way), verified, and served
/// without a miss.
#[test]
fn a_hinted_group_of_packed_pages_is_loaded_ahead_whole() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("m");
    std::fs::create_dir_all(&dir).unwrap();
    let pages: Vec<(String, Vec<u8>)> = (0..6)
        .map(|i| (format!("w{i}"), weights(32 * 1024, 10 + i)))
        .collect();
    let tensors: Vec<(&str, DType, &[usize], &[u8])> = pages
        .iter()
        .map(|(n, b)| (n.as_str(), DType::BF16, &[128usize, 256][..], b.as_slice()))
        .collect();
    voom_formats::safetensors::write(&dir.join("model.safetensors"), &tensors, &BTreeMap::new())
        .unwrap();
    vpagectl(&["hash"], &dir);
    vpagectl(&["pack"], &dir);
    let manifest = Manifest::load(&dir).unwrap().unwrap();
    let store = Store::new(StoreConfig {
        cache_bytes: 4 << 20,
        io: vpaged::store::IoConfig {
            read_threads: 4,
            read_piece: 16 << 10,
            prefetch_threads: 3,
            read_ahead_layers: 0,
        },
        ..Default::default()
    })
    .unwrap();
    let id = store.open_model(&dir).unwrap();
    let ids: Vec<u32> = pages
        .iter()
        .map(|(n, _)| manifest.page(n).unwrap().id)
        .collect();
    store.prefetch_group(id, &ids);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !ids.iter().all(|&p| {
        store
            .cache()
            .resident(vpaged::cache::PageKey { model: id, page: p })
    }) {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            store.cache_stats()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    for ((_, want), &p) in pages.iter().zip(&ids) {
        assert_eq!(store.acquire(id, p).unwrap().bytes(), want.as_slice());
    }
    let s = store.cache_stats();
    assert_eq!((s.misses, s.prefetch_loads), (0, ids.len() as u64), "{s:?}");
}

fn reading_store(read_ahead_layers: usize) -> std::sync::Arc<Store> {
    Store::new(StoreConfig {
        cache_bytes: 8 << 20,
        io: vpaged::store::IoConfig {
            read_threads: 4,
            read_piece: 16 << 10,
            prefetch_threads: 2,
            read_ahead_layers,
        },
        ..Default::default()
    })
    .unwrap()
}

/// Bodies named to `read_ahead` are read into the pool as far as its room goes, in
/// the order named; each page's load then decodes the body read ahead instead of
/// reading it again, and each body it takes frees room for the next one named, so
/// reading goes on down the list: every body is read from storage exactly once, every
/// page is the manifest's bytes, and every body was read ahead.
#[test]
fn bodies_read_ahead_serve_their_pages_and_are_read_once() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("m");
    let (manifest, bytes) = layered_packed_model(&dir, 5, 128);
    let store = reading_store(2);
    let id = store.open_model(&dir).unwrap();
    let m = store.model(id).unwrap();
    let pool = store
        .read_ahead_stats()
        .expect("a model with bodies sizes the pool");
    let rooms: Vec<u64> = manifest
        .pages
        .iter()
        .map(|p| p.vpack().unwrap().len.next_multiple_of(16 << 10))
        .collect();
    // Pages are in manifest order, two to a layer.
    let layer = rooms
        .chunks(2)
        .map(|l| l.iter().sum::<u64>())
        .max()
        .unwrap();
    assert_eq!(
        pool.capacity_bytes,
        2 * layer + rooms.iter().max().unwrap(),
        "two layers of bodies and the largest body"
    );
    // In the order the engine would lease them: layer by layer.
    let order: Vec<u32> = (0..5)
        .flat_map(|l| {
            ["up", "down"].map(|w| {
                manifest
                    .page(&format!("model.layers.{l}.mlp.{w}_proj.weight"))
                    .unwrap()
                    .id
            })
        })
        .collect();
    store.read_ahead(id, &order);
    // Room for the first bodies (two layers and one more); the rest wait for room.
    let fit = rooms
        .iter()
        .scan(0, |used, r| {
            *used += r;
            Some(*used <= pool.capacity_bytes)
        })
        .take_while(|&f| f)
        .count();
    assert!((5..order.len()).contains(&fit), "{fit}");
    assert_eq!(store.read_ahead_stats().unwrap().held, fit as u64);
    // Naming them again reads nothing twice.
    store.read_ahead(id, &order);
    assert_eq!(store.read_ahead_stats().unwrap().held, fit as u64);
    for &p in &order {
        assert_eq!(
            store.acquire(id, p).unwrap().bytes(),
            bytes[p as usize].as_slice()
        );
    }
    let s = store.read_ahead_stats().unwrap();
    assert_eq!(
        (s.taken, s.dropped, s.held),
        (order.len() as u64, 0, 0),
        "{s:?}"
    );
    let bodies: u64 = manifest.pages.iter().map(|p| p.vpack().unwrap().len).sum();
    let t = m.primary_stats();
    assert_eq!(t.bytes, bodies, "each body read once: {t:?}");
    assert_eq!(t.integrity_failures, 0);
}

/// A body read ahead is verified like any copy: one changed on disk before it was
/// read ahead decodes to the wrong bytes (or not at all) and is refused, the raw
/// bytes serve the page, and the failure is counted on the tier.
#[test]
fn a_damaged_body_read_ahead_is_refused_and_the_raw_bytes_serve() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("m");
    let (manifest, bytes) = layered_packed_model(&dir, 2, 64);
    let hurt = manifest.page("model.layers.0.mlp.up_proj.weight").unwrap();
    let body = hurt.vpack().unwrap();
    let pack = dir.join(&body.file);
    let mut all = std::fs::read(&pack).unwrap();
    all[(body.offset + body.len - 5) as usize] ^= 0x10;
    std::fs::write(&pack, all).unwrap();
    let store = reading_store(2);
    let id = store.open_model(&dir).unwrap();
    let ids: Vec<u32> = manifest.pages.iter().map(|p| p.id).collect();
    store.read_ahead(id, &ids);
    for &p in &ids {
        assert_eq!(
            store.acquire(id, p).unwrap().bytes(),
            bytes[p as usize].as_slice()
        );
    }
    assert_eq!(store.read_ahead_stats().unwrap().taken, ids.len() as u64);
    assert_eq!(
        store.model(id).unwrap().primary_stats().integrity_failures,
        1
    );
}

/// With no room configured, or no reader threads to read with, there is no pool and
/// `read_ahead` reads nothing: each body is read when its page loads.
#[test]
fn no_room_or_no_readers_reads_nothing_ahead() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("m");
    let (manifest, bytes) = layered_packed_model(&dir, 2, 64);
    let ids: Vec<u32> = manifest.pages.iter().map(|p| p.id).collect();
    let no_readers = Store::new(StoreConfig {
        cache_bytes: 8 << 20,
        io: vpaged::store::IoConfig {
            read_threads: 0,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    for store in [reading_store(0), no_readers] {
        let id = store.open_model(&dir).unwrap();
        store.read_ahead(id, &ids);
        assert!(store.read_ahead_stats().is_none());
        assert_eq!(store.model(id).unwrap().primary_stats().bytes, 0);
        for &p in &ids {
            assert_eq!(
                store.acquire(id, p).unwrap().bytes(),
                bytes[p as usize].as_slice()
            );
        }
    }
}

/// A store with a pool reads every body there: a page whose body is larger than the
/// pool is read raw, with no buffer for the body anywhere, and named to read ahead it
/// is skipped without stopping the bodies after it; a load of a page not read ahead
/// makes room for its body in the pool and reads it once. The bytes are the
/// manifest's either way.
#[test]
fn loads_not_read_ahead_read_their_body_into_the_pool_or_else_the_raw_bytes() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("m");
    std::fs::create_dir_all(&dir).unwrap();
    let (small, big) = (weights(64 * 256, 7), weights(1024 * 256, 8));
    voom_formats::safetensors::write(
        &dir.join("model.safetensors"),
        &[
            (
                "model.layers.0.mlp.up_proj.weight",
                DType::BF16,
                &[64, 256],
                &small,
            ),
            ("lm_head.weight", DType::BF16, &[1024, 256], &big),
        ],
        &BTreeMap::new(),
    )
    .unwrap();
    vpagectl(&["hash"], &dir);
    vpagectl(&["pack"], &dir);
    let manifest = Manifest::load(&dir).unwrap().unwrap();
    let (up, head) = (
        manifest.page("model.layers.0.mlp.up_proj.weight").unwrap(),
        manifest.page("lm_head.weight").unwrap(),
    );
    let store = reading_store(1);
    let id = store.open_model(&dir).unwrap();
    let pool = store.read_ahead_stats().unwrap();
    assert!(head.vpack().unwrap().len > pool.capacity_bytes, "{pool:?}");
    let m = store.model(id).unwrap();
    store.read_ahead(id, &[head.id, up.id]);
    assert_eq!(
        store.read_ahead_stats().unwrap().held,
        1,
        "the body after it"
    );
    assert_eq!(store.acquire(id, up.id).unwrap().bytes(), small.as_slice());
    assert_eq!(m.primary_stats().bytes, up.vpack().unwrap().len, "its body");
    assert_eq!(store.acquire(id, head.id).unwrap().bytes(), big.as_slice());
    assert_eq!(
        m.primary_stats().bytes,
        up.vpack().unwrap().len + head.len,
        "the raw bytes of a page whose body the pool cannot hold"
    );
    let s = store.read_ahead_stats().unwrap();
    assert_eq!((s.taken, s.held), (1, 0), "{s:?}");

    // Not read ahead: the load reads the body into room it makes in the pool.
    let store = reading_store(1);
    let id = store.open_model(&dir).unwrap();
    assert_eq!(store.acquire(id, up.id).unwrap().bytes(), small.as_slice());
    let m = store.model(id).unwrap();
    assert_eq!(m.primary_stats().bytes, up.vpack().unwrap().len, "its body");
    let s = store.read_ahead_stats().unwrap();
    assert_eq!((s.taken, s.held), (0, 0), "{s:?}");
}

/// A packed model on a NAS mount, in a store with a pool: its bodies are read from
/// the NAS into the pool (the body's bytes, not the raw page's, cross the network),
/// and the pages are the manifest's bytes.
#[test]
fn a_packed_model_on_a_nas_reads_its_bodies_into_the_pool() {
    let d = tempfile::tempdir().unwrap();
    let mount = d.path().join("nas");
    let dir = mount.join("models/m");
    let (manifest, bytes) = layered_packed_model(&dir, 2, 64);
    let store = Store::new(StoreConfig {
        cache_bytes: 8 << 20,
        nas: vec![vpaged::tier::NasConfig {
            mount: mount.clone(),
            model: std::path::PathBuf::new(),
            timeout: std::time::Duration::from_secs(5),
            recheck: std::time::Duration::ZERO,
            remount_command: None,
        }],
        ..Default::default()
    })
    .unwrap();
    let id = store.open_model(&dir).unwrap();
    assert!(store.read_ahead_stats().is_some(), "the pool");
    let m = store.model(id).unwrap();
    for p in &manifest.pages {
        assert_eq!(
            store.acquire(id, p.id).unwrap().bytes(),
            bytes[p.id as usize].as_slice()
        );
    }
    let bodies: u64 = manifest.pages.iter().map(|p| p.vpack().unwrap().len).sum();
    assert_eq!(
        m.nas_stats().unwrap().bytes,
        bodies,
        "bodies, not raw pages"
    );
}

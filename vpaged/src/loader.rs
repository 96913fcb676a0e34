//! Filling a page's bytes from the fastest tier that holds a verified copy.
//!
//! Order: the fast tier's staged copy (by blake3), then the model's own directory (a
//! local one, or one on a NAS mount), then the NAS copy of a local model. Every copy is
//! verified after it is read (and decoded) and before the caller may use it (by its
//! blake3, or by the seal of a copy that matched it: [`Seals`]); a copy that fails is
//! recorded as an integrity failure on its tier and the next tier is tried. Only when
//! no tier yields the manifest's bytes does the load fail, with every tier's reason.

use std::cell::RefCell;

use voom_formats::manifest::PageEntry;
use voom_formats::vpack;

use crate::direct::AlignedBuf;
use crate::seal::Seals;
use crate::tier::{Extent, FastTier, FileTier, ModelTier, NasTier, TierError};
use crate::StoreError;

/// The tier a page was served from (`Nas` for a model that lives on a NAS, too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Served {
    Fast,
    Primary,
    Nas,
}

/// The tiers of one model store.
pub struct PageLoader<'a> {
    pub fast: Option<&'a FastTier>,
    /// The model's own directory.
    pub primary: &'a ModelTier,
    /// A NAS copy of a model whose own directory is local.
    pub nas: Option<&'a NasTier>,
    /// The model's seals: a copy is checked against its page's seal once one copy
    /// has matched the blake3 ([`Seals`]).
    pub seals: &'a Seals,
    /// The page's vpack body on the model's own tier, already read (ahead of the
    /// load: [`crate::ahead`]): decoded and verified like a body read now, in its
    /// place; if it fails, the load goes on as if it were not there.
    pub body: Option<&'a [u8]>,
    /// Whether a body not given in `body` may be read into this thread's own
    /// buffer. A store whose bodies all go through its pool of bodies read ahead
    /// sets none aside for threads: a packed copy it has not read there is skipped,
    /// and the raw bytes are read instead.
    pub own_body_buffers: bool,
}

impl PageLoader<'_> {
    /// Fills `buf` (the page's decoded length) with the page's verified bytes.
    ///
    /// When no copy serves: a lone copy that failed verification is
    /// [`StoreError::Integrity`]; several copies that all failed verification (hash
    /// mismatches, vpack bodies that do not decode) are [`StoreError::Corrupt`]; if any
    /// copy could not be read at all, [`StoreError::Unavailable`] with every reason.
    pub fn load(&self, entry: &PageEntry, buf: &mut [u8]) -> Result<Served, StoreError> {
        let mut failed = Failures::default();

        if let Some(fast) = self.fast.filter(|f| f.contains(&entry.blake3)) {
            match fast.read(&entry.blake3, buf) {
                Ok(()) => match self.verify(entry, buf, fast.name()) {
                    Ok(()) => return Ok(Served::Fast),
                    Err(e) => {
                        fast.counters().record_integrity_failure();
                        failed.corrupt(e, fast.name(), "staged copy");
                        Self::drop_copy(fast, entry);
                    }
                },
                Err(e) => {
                    failed.unreadable(e.to_string());
                    Self::drop_copy(fast, entry);
                }
            }
        }

        // On each location tier: the packed body if the store has one (fewer bytes
        // from storage), then the raw bytes.
        let raw = Extent {
            file: entry.file.clone(),
            offset: entry.offset,
            len: entry.len,
        };
        let packed = entry.vpack().map(|b| Extent {
            file: b.file.clone(),
            offset: b.offset,
            len: b.len,
        });
        let own = match self.primary {
            ModelTier::File(t) => (Served::Primary, Location::File(t)),
            ModelTier::Nas(t) => (Served::Nas, Location::Nas(t)),
        };
        let copy = self.nas.map(|t| (Served::Nas, Location::Nas(t)));
        for (k, (served, loc)) in std::iter::once(own).chain(copy).enumerate() {
            let read_ahead = self.body.filter(|_| k == 0);
            let packed = packed
                .as_ref()
                .filter(|_| read_ahead.is_some() || self.own_body_buffers);
            if let Some(p) = packed {
                let loaded = match read_ahead {
                    Some(body) => loc.unpack(entry, p, body, buf, self.seals),
                    None => loc.load_packed(entry, p, buf, self.seals),
                };
                match loaded {
                    Ok(()) => return Ok(served),
                    Err(Packed::Corrupt(e)) => {
                        tracing::warn!(
                            "page '{}': the vpack body on tier '{}' is corrupt ({e}); falling back to the raw copy",
                            entry.label(),
                            loc.name()
                        );
                        failed.corrupt(e, loc.name(), "vpack body");
                    }
                    Err(Packed::Unreadable(e)) => {
                        tracing::warn!(
                            "page '{}': cannot read the vpack body on tier '{}' ({e}); falling back to the raw copy",
                            entry.label(),
                            loc.name()
                        );
                        failed.unreadable(format!("{e} (vpack)"));
                    }
                }
            }
            match loc.read(&raw, buf) {
                Ok(()) => match self.verify(entry, buf, loc.name()) {
                    Ok(()) => return Ok(served),
                    Err(e) => {
                        loc.record_integrity_failure();
                        failed.corrupt(e, loc.name(), "raw bytes");
                    }
                },
                Err(e) => failed.unreadable(e.to_string()),
            }
        }
        Err(failed.into_error(entry))
    }

    /// Removes a staged copy that could not serve (torn by a crash, changed, gone),
    /// so the page is read from its own tier from now on and may be staged again.
    fn drop_copy(fast: &FastTier, entry: &PageEntry) {
        if let Err(e) = fast.unstage(&entry.blake3) {
            tracing::warn!(
                "page '{}': removing its bad copy from tier '{}': {e}",
                entry.label(),
                fast.name()
            );
        }
    }

    fn verify(&self, entry: &PageEntry, bytes: &[u8], tier: &str) -> Result<(), StoreError> {
        self.seals.verify(entry, bytes, tier)
    }
}

/// Why a copy of a page did not serve, gathered over every copy tried.
#[derive(Default)]
struct Failures {
    /// Every copy's reason, in the order tried.
    reasons: Vec<String>,
    /// Each copy that failed verification (hash mismatch or undecodable body): its
    /// tier and part, and what was wrong, without the page name.
    corrupt: Vec<String>,
    /// Copies that could not be read (I/O error, timeout, truncated file).
    unreadable: usize,
    /// The last verification failure, reported as is when it was the only copy.
    last_integrity: Option<StoreError>,
}

impl Failures {
    fn corrupt(&mut self, e: StoreError, tier: &str, part: &str) {
        self.reasons.push(format!("{e} ({part})"));
        self.corrupt.push(match &e {
            StoreError::Integrity { actual, .. } => {
                format!("tier '{tier}' {part}: got blake3 {actual}")
            }
            other => format!("tier '{tier}' {part}: {other}"),
        });
        self.last_integrity = Some(e);
    }

    fn unreadable(&mut self, reason: String) {
        self.reasons.push(reason);
        self.unreadable += 1;
    }

    /// The load's error once every copy failed (see [`PageLoader::load`]).
    fn into_error(self, entry: &PageEntry) -> StoreError {
        match (self.unreadable, self.corrupt.len(), self.last_integrity) {
            (0, 1, Some(e @ StoreError::Integrity { .. })) => e,
            (0, n, _) if n > 0 => StoreError::Corrupt {
                page: entry.label(),
                expected: entry.blake3.clone(),
                copies: self.corrupt,
            },
            _ => StoreError::Unavailable {
                page: entry.label(),
                reasons: self.reasons,
            },
        }
    }
}

/// Bodies up to this many bytes leave their buffer to the thread's next body.
const KEEP_BODY_BUFFER: usize = 64 << 20;

thread_local! {
    /// This thread's buffer for vpack bodies.
    static BODY: RefCell<Option<AlignedBuf>> = const { RefCell::new(None) };
}

/// Runs `f` on a buffer of `len` bytes for a vpack body, aligned for direct reads
/// (a pack file's bodies start at 16 KiB boundaries, so the device writes them in
/// place: [`DirectFile::read_into`](crate::direct::DirectFile::read_into)) and reused
/// by this thread's next body: no allocation, no zeroing, no page faults per page.
/// Its bytes before `f` writes them are a previous body's.
fn with_body_buffer<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    let mut buf = BODY
        .with(|b| b.borrow_mut().take())
        .filter(|b| b.capacity() >= len)
        .unwrap_or_else(|| AlignedBuf::new(len));
    let r = f(&mut buf.as_mut_slice()[..len]);
    if buf.capacity() <= KEEP_BODY_BUFFER {
        BODY.with(|b| *b.borrow_mut() = Some(buf));
    }
    r
}

/// Why a vpack body did not yield the page.
enum Packed {
    /// It was read but is corrupt: it does not decode, or decodes to the wrong bytes.
    Corrupt(StoreError),
    /// It could not be read.
    Unreadable(StoreError),
}

/// A tier holding the model's files.
#[derive(Clone, Copy)]
enum Location<'a> {
    File(&'a FileTier),
    Nas(&'a NasTier),
}

impl Location<'_> {
    fn name(&self) -> &str {
        match self {
            Location::File(t) => t.name(),
            Location::Nas(t) => t.name(),
        }
    }

    fn read(&self, ext: &Extent, buf: &mut [u8]) -> Result<(), TierError> {
        match self {
            Location::File(t) => t.read_extent(ext, buf),
            Location::Nas(t) => t.read_extent(ext, buf),
        }
    }

    /// Checks that `ext` lies inside its file, before a buffer is sized by it.
    fn check_extent(&self, ext: &Extent) -> Result<(), TierError> {
        match self {
            Location::File(t) => t.check_extent(ext),
            Location::Nas(t) => t.check_extent(ext),
        }
    }

    fn record_integrity_failure(&self) {
        match self {
            Location::File(t) => t.counters().record_integrity_failure(),
            Location::Nas(t) => t.counters().record_integrity_failure(),
        }
    }

    /// Reads a vpack body, decodes it into `buf` and verifies the page: a body that
    /// matches its seal decodes to the bytes verified before ([`Seals::body_is_sealed`]);
    /// any other is decoded and the page's bytes checked, then the body is sealed.
    fn load_packed(
        &self,
        entry: &PageEntry,
        ext: &Extent,
        buf: &mut [u8],
        seals: &Seals,
    ) -> Result<(), Packed> {
        let unreadable = |e: TierError| Packed::Unreadable(e.into());
        // The body's length comes from the manifest: allocate only what the file holds.
        self.check_extent(ext).map_err(unreadable)?;
        let len = usize::try_from(ext.len).map_err(|_| {
            Packed::Unreadable(StoreError::Store {
                store: std::path::PathBuf::from(&ext.file),
                detail: format!("vpack body of {} bytes does not fit in memory", ext.len),
            })
        })?;
        with_body_buffer(len, |body| {
            self.read(ext, body).map_err(unreadable)?;
            self.unpack(entry, ext, body, buf, seals)
        })
    }

    /// Decodes the vpack `body` read from `ext` into `buf` and verifies the page (see
    /// [`load_packed`](Self::load_packed)).
    fn unpack(
        &self,
        entry: &PageEntry,
        ext: &Extent,
        body: &[u8],
        buf: &mut [u8],
        seals: &Seals,
    ) -> Result<(), Packed> {
        let sealed = seals.body_is_sealed(entry.id, body);
        self.decode(entry, ext, body, buf)?;
        if !sealed {
            seals.verify(entry, buf, self.name()).map_err(|e| {
                self.record_integrity_failure();
                Packed::Corrupt(e)
            })?;
            seals.seal_body(entry.id, body);
        }
        Ok(())
    }

    /// Decodes the vpack `body` read from `ext` into `buf`.
    fn decode(
        &self,
        entry: &PageEntry,
        ext: &Extent,
        body: &[u8],
        buf: &mut [u8],
    ) -> Result<(), Packed> {
        vpack::decode(body, buf).map_err(|e| {
            // A body that does not decode is corrupt: an integrity failure of the tier.
            self.record_integrity_failure();
            Packed::Corrupt(StoreError::Store {
                store: std::path::PathBuf::from(&ext.file),
                detail: format!(
                    "tier '{}': page '{}': vpack body: {e}",
                    self.name(),
                    entry.label()
                ),
            })
        })
    }
}

impl From<TierError> for StoreError {
    fn from(e: TierError) -> Self {
        StoreError::Tier(e)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    use voom_formats::{Checkpoint, DType, Manifest};

    use super::*;
    use crate::tier::NasConfig;

    struct Fixture {
        _dir: tempfile::TempDir,
        primary_dir: PathBuf,
        nas_mount: PathBuf,
        fast_dir: PathBuf,
        manifest: Manifest,
    }

    fn fixture() -> Fixture {
        let d = tempfile::tempdir().unwrap();
        let primary_dir = d.path().join("primary/m");
        std::fs::create_dir_all(&primary_dir).unwrap();
        let a: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
        let b: Vec<u8> = (0..64u8).map(|x| x.wrapping_mul(13)).collect();
        voom_formats::safetensors::write(
            &primary_dir.join("model.safetensors"),
            &[
                ("a", DType::BF16, &[64, 32], &a),
                ("b", DType::F32, &[16], &b),
            ],
            &BTreeMap::new(),
        )
        .unwrap();
        let manifest =
            Manifest::build(&Checkpoint::open(&primary_dir).unwrap(), &mut |_, _| {}).unwrap();
        let nas_mount = d.path().join("nas");
        std::fs::create_dir_all(nas_mount.join("m")).unwrap();
        std::fs::copy(
            primary_dir.join("model.safetensors"),
            nas_mount.join("m/model.safetensors"),
        )
        .unwrap();
        Fixture {
            fast_dir: d.path().join("fast"),
            primary_dir,
            nas_mount,
            manifest,
            _dir: d,
        }
    }

    fn flip(path: &Path, at: u64) {
        let mut bytes = std::fs::read(path).unwrap();
        bytes[at as usize] ^= 0x10;
        std::fs::write(path, bytes).unwrap();
    }

    fn nas(f: &Fixture) -> NasTier {
        NasTier::new(
            "nas",
            NasConfig {
                mount: f.nas_mount.clone(),
                model: "m".into(),
                timeout: Duration::from_secs(2),
                recheck: Duration::ZERO,
                remount_command: None,
            },
        )
    }

    #[test]
    fn a_model_on_a_nas_is_served_by_it_and_a_dead_mount_names_page_and_mount() {
        let f = fixture();
        let primary = ModelTier::Nas(nas(&f));
        let loader = PageLoader {
            fast: None,
            primary: &primary,
            nas: None,
            seals: &Seals::new(2),
            body: None,
            own_body_buffers: true,
        };
        let a = f.manifest.page("a").unwrap();
        let mut buf = vec![0u8; a.len as usize];
        assert_eq!(loader.load(a, &mut buf).unwrap(), Served::Nas);
        assert_eq!(blake3::hash(&buf).to_hex().as_str(), a.blake3);

        let away = f.nas_mount.with_extension("away");
        std::fs::rename(&f.nas_mount, &away).unwrap();
        let e = loader.load(a, &mut buf).unwrap_err();
        assert!(matches!(e, StoreError::Unavailable { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("page 'a'")
                && msg.contains(&format!("NAS mount {}", f.nas_mount.display())),
            "{msg}"
        );
        std::fs::rename(&away, &f.nas_mount).unwrap();
        buf.fill(0);
        assert_eq!(loader.load(a, &mut buf).unwrap(), Served::Nas);
        assert_eq!(blake3::hash(&buf).to_hex().as_str(), a.blake3);
    }

    #[test]
    fn serves_from_the_fastest_verified_copy_and_skips_bad_ones() {
        let f = fixture();
        let primary = ModelTier::File(FileTier::new("primary", &f.primary_dir));
        let fast = FastTier::open("fast", &f.fast_dir, 1 << 20).unwrap();
        let nas = nas(&f);
        let loader = PageLoader {
            fast: Some(&fast),
            primary: &primary,
            nas: Some(&nas),
            seals: &Seals::new(2),
            body: None,
            own_body_buffers: true,
        };
        let a = f.manifest.page("a").unwrap();
        let mut buf = vec![0u8; a.len as usize];
        assert_eq!(loader.load(a, &mut buf).unwrap(), Served::Primary);
        let good = buf.clone();

        fast.stage(&a.blake3, &good).unwrap();
        buf.fill(0);
        assert_eq!(loader.load(a, &mut buf).unwrap(), Served::Fast);
        assert_eq!(buf, good);

        // A flipped byte in the fast copy: detected, and the primary serves.
        let staged = f
            .fast_dir
            .join(&a.blake3[..2])
            .join(format!("{}.page", a.blake3));
        flip(&staged, 100);
        buf.fill(0);
        assert_eq!(loader.load(a, &mut buf).unwrap(), Served::Primary);
        assert_eq!(buf, good);
        assert_eq!(fast.stats().integrity_failures, 1);
        // The bad copy is gone: the page is read from its own tier from now on, and
        // may be staged again.
        assert!(!fast.contains(&a.blake3) && !staged.exists());
        assert_eq!(loader.load(a, &mut buf).unwrap(), Served::Primary);
        assert_eq!(fast.stats().integrity_failures, 1);
        // A bad copy staged again, for what follows.
        fast.stage(&a.blake3, &good).unwrap();
        flip(&staged, 100);

        // And in the primary too: the NAS copy serves.
        flip(&f.primary_dir.join("model.safetensors"), a.offset + 7);
        let ModelTier::File(p) = &primary else {
            unreachable!()
        };
        p.reopen();
        buf.fill(0);
        assert_eq!(loader.load(a, &mut buf).unwrap(), Served::Nas);
        assert_eq!(buf, good);
        assert_eq!(primary.stats().integrity_failures, 1);

        // Everywhere: an integrity error naming the page, every tier and the hashes.
        fast.stage(&a.blake3, &good).unwrap();
        flip(&staged, 100);
        flip(&f.nas_mount.join("m/model.safetensors"), a.offset + 9);
        let e = loader.load(a, &mut buf).unwrap_err();
        assert!(
            matches!(e, StoreError::Corrupt { ref copies, .. } if copies.len() == 3),
            "{e}"
        );
        let e = e.to_string();
        assert!(
            e.contains("'a'")
                && e.contains("tier 'fast'")
                && e.contains("tier 'primary'")
                && e.contains("tier 'nas'")
                && e.contains(&a.blake3),
            "{e}"
        );
    }

    /// The regression: when every copy failed its hash but there was more than one
    /// copy, the load was `Unavailable` (the daemon's wire code too); it is `Corrupt`
    /// (wire code `Integrity`). One unreadable copy among them keeps it `Unavailable`.
    #[test]
    fn every_copy_failing_its_hash_is_an_integrity_error_not_unavailable() {
        let f = fixture();
        let primary = ModelTier::File(FileTier::new("primary", &f.primary_dir));
        let copy = nas(&f);
        let loader = PageLoader {
            fast: None,
            primary: &primary,
            nas: Some(&copy),
            seals: &Seals::new(2),
            body: None,
            own_body_buffers: true,
        };
        let b = f.manifest.page("b").unwrap();
        flip(&f.primary_dir.join("model.safetensors"), b.offset);
        flip(&f.nas_mount.join("m/model.safetensors"), b.offset + 1);
        let mut buf = vec![0u8; b.len as usize];
        match loader.load(b, &mut buf).unwrap_err() {
            StoreError::Corrupt {
                page,
                expected,
                copies,
            } => {
                assert_eq!((page.as_str(), expected.as_str()), ("b", b.blake3.as_str()));
                assert_eq!(copies.len(), 2, "{copies:?}");
                assert!(copies[0].starts_with("tier 'primary' raw bytes: got blake3 "));
                assert!(copies[1].starts_with("tier 'nas' raw bytes: got blake3 "));
            }
            other => panic!("{other}"),
        }
        // The NAS copy gone: one copy is corrupt, the other unreadable.
        std::fs::remove_file(f.nas_mount.join("m/model.safetensors")).unwrap();
        let fresh = nas(&f);
        let loader = PageLoader {
            fast: None,
            primary: &primary,
            nas: Some(&fresh),
            seals: &Seals::new(2),
            body: None,
            own_body_buffers: true,
        };
        let e = loader.load(b, &mut buf).unwrap_err();
        assert!(matches!(e, StoreError::Unavailable { .. }), "{e}");
    }

    /// Whether the page was sealed by a good copy first (so the bad one is checked
    /// against the seal) or not, the error is the same.
    #[test]
    fn a_lone_tier_reports_integrity_with_both_hashes() {
        for sealed_first in [false, true] {
            let f = fixture();
            let primary = ModelTier::File(FileTier::new("primary", &f.primary_dir));
            let seals = Seals::new(2);
            let loader = PageLoader {
                fast: None,
                primary: &primary,
                nas: None,
                seals: &seals,
                body: None,
                own_body_buffers: true,
            };
            let b = f.manifest.page("b").unwrap();
            let mut buf = vec![0u8; b.len as usize];
            if sealed_first {
                loader.load(b, &mut buf).unwrap();
                assert!(seals.is_sealed(b.id));
            }
            flip(&f.primary_dir.join("model.safetensors"), b.offset + 3);
            match loader.load(b, &mut buf).unwrap_err() {
                StoreError::Integrity {
                    page,
                    tier,
                    expected,
                    actual,
                } => {
                    assert_eq!((page.as_str(), tier.as_str()), ("b", "primary"));
                    assert_eq!(expected, b.blake3);
                    assert_ne!(actual, expected);
                }
                other => panic!("sealed first {sealed_first}: {other}"),
            }
            assert_eq!(seals.is_sealed(b.id), sealed_first);
        }
    }

    /// A vpack body whose manifest length is far beyond its file (a hostile or corrupt
    /// manifest) is refused before a buffer is sized by it; the raw copy serves.
    #[test]
    fn a_vpack_body_longer_than_its_file_is_refused_before_allocating() {
        let f = fixture();
        let primary = ModelTier::File(FileTier::new("primary", &f.primary_dir));
        let nas_primary = ModelTier::Nas(nas(&f));
        let mut a = f.manifest.page("a").unwrap().clone();
        a.encoded = vec![voom_formats::manifest::EncodedBody {
            encoding: voom_formats::manifest::Encoding::Vpack,
            file: "model.safetensors".into(),
            offset: 0,
            len: 1 << 50,
        }];
        for tier in [&primary, &nas_primary] {
            let loader = PageLoader {
                fast: None,
                primary: tier,
                nas: None,
                seals: &Seals::new(2),
                body: None,
                own_body_buffers: true,
            };
            let mut buf = vec![0u8; a.len as usize];
            loader.load(&a, &mut buf).unwrap();
            assert_eq!(blake3::hash(&buf).to_hex().as_str(), a.blake3);
        }
        // With no raw copy to fall back on, the error names the short file (a fresh
        // tier: the old one holds the replaced file open).
        std::fs::write(f.nas_mount.join("m/model.safetensors"), b"tiny").unwrap();
        let fresh = ModelTier::Nas(nas(&f));
        let loader = PageLoader {
            fast: None,
            primary: &fresh,
            nas: None,
            seals: &Seals::new(2),
            body: None,
            own_body_buffers: true,
        };
        let mut buf = vec![0u8; a.len as usize];
        let e = loader.load(&a, &mut buf).unwrap_err().to_string();
        assert!(e.contains("ends before"), "{e}");
    }

    #[test]
    fn a_truncated_file_is_an_error_not_a_panic() {
        let f = fixture();
        let p = f.primary_dir.join("model.safetensors");
        let len = std::fs::metadata(&p).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(len - 10)
            .unwrap();
        let primary = ModelTier::File(FileTier::new("primary", &f.primary_dir));
        let loader = PageLoader {
            fast: None,
            primary: &primary,
            nas: None,
            seals: &Seals::new(2),
            body: None,
            own_body_buffers: true,
        };
        let b = f.manifest.page("b").unwrap();
        let mut buf = vec![0u8; b.len as usize];
        let e = loader.load(b, &mut buf).unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("ends before"),
            "{e}"
        );
    }
}

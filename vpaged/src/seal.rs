//! Re-verifying a page's later copies at memory speed.
//!
//! Every copy of a page is verified before it is served (DESIGN.md, invariant 3). The
//! manifest's blake3 is the authority, but blake3 hashes about 1.8 GB/s on one core
//! of the machine this was measured on (AMD EPYC, AVX2), while a model run out of core
//! reads every page again each token: verifying a 3 GB sweep took 1.7 core-seconds,
//! half of all CPU time in the run, more than the matrix products.
//!
//! So the first copy of a page that matches its blake3 is *sealed*: its XXH3-128
//! under a key drawn at random when the store starts (6.4 GB/s here, 0.82 of reading
//! the bytes once: `cargo run --release -p vpaged --example verify_bench`) is kept in
//! memory. A later copy is verified against the seal; one that
//! does not match is hashed with blake3 after all, so the error still names the
//! expected and actual blake3 (and a copy that matches the blake3 is served). A
//! corrupted copy passes only if its XXH3-128 under a key it cannot know collides
//! with the verified bytes': a chance near 2^-128. Seals live only in memory, so
//! each process verifies each page's first copy in full.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

use twox_hash::XxHash3_128;
use voom_formats::manifest::PageEntry;

use crate::StoreError;

/// The seals of one model's pages (see the module docs).
pub struct Seals {
    key: u64,
    seals: Box<[OnceLock<u128>]>,
    /// Seals of vpack bodies that decoded to their page's verified bytes.
    bodies: Box<[OnceLock<u128>]>,
}

impl Seals {
    /// No page sealed yet, under a fresh random key.
    pub fn new(pages: usize) -> Seals {
        // `RandomState` is seeded from the OS's randomness once per process, and each
        // one differs from the last: no dependency needed for 64 random bits.
        let key = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        Seals {
            key,
            seals: (0..pages).map(|_| OnceLock::new()).collect(),
            bodies: (0..pages).map(|_| OnceLock::new()).collect(),
        }
    }

    fn digest(&self, bytes: &[u8]) -> u128 {
        XxHash3_128::oneshot_with_seed(self.key, bytes)
    }

    /// Whether the page of manifest id `id` is sealed (a copy matched its blake3).
    pub fn is_sealed(&self, id: u32) -> bool {
        self.seals
            .get(id as usize)
            .is_some_and(|s| s.get().is_some())
    }

    /// Verifies `bytes` as the page `entry` (sealed by its manifest id), read from
    /// `tier`: against the seal when there is one, else against the blake3, sealing
    /// them then. A mismatch is [`StoreError::Integrity`] naming page and tier. A page
    /// whose id is past the table is checked by blake3 each time.
    pub fn verify(&self, entry: &PageEntry, bytes: &[u8], tier: &str) -> Result<(), StoreError> {
        let Some(seal) = self.seals.get(entry.id as usize) else {
            return check(entry, bytes, tier);
        };
        if let Some(&known) = seal.get() {
            if self.digest(bytes) == known {
                return Ok(());
            }
            // Not the sealed bytes: blake3 says what they are (and names the error).
            return check(entry, bytes, tier);
        }
        check(entry, bytes, tier)?;
        let _ = seal.set(self.digest(bytes));
        Ok(())
    }

    /// Whether `body` is the vpack body of the page of manifest id `id` that once
    /// decoded to the page's verified bytes ([`seal_body`](Self::seal_body)).
    /// Decoding is a function of the body alone, so a body that matches the seal
    /// decodes to those bytes again: they need no check of their own, and the body
    /// is fewer bytes to hash than what it decodes to.
    pub fn body_is_sealed(&self, id: u32, body: &[u8]) -> bool {
        self.bodies
            .get(id as usize)
            .and_then(|s| s.get())
            .is_some_and(|&known| self.digest(body) == known)
    }

    /// Seals `body` as the vpack body of page `id`. Only for a body whose decoded
    /// bytes were just verified as the page.
    pub fn seal_body(&self, id: u32, body: &[u8]) {
        if let Some(s) = self.bodies.get(id as usize) {
            if s.get().is_none() {
                let _ = s.set(self.digest(body));
            }
        }
    }
}

/// Whether `bytes` are the page's (its blake3), else [`StoreError::Integrity`] naming
/// page and tier.
pub(crate) fn check(entry: &PageEntry, bytes: &[u8], tier: &str) -> Result<(), StoreError> {
    let actual = blake3::hash(bytes).to_hex();
    if actual.as_str() == entry.blake3 {
        Ok(())
    } else {
        Err(StoreError::Integrity {
            page: entry.name.clone(),
            tier: tier.to_string(),
            expected: entry.blake3.clone(),
            actual: actual.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use voom_formats::manifest::{Encoding, PageEntry, PageGroup};
    use voom_formats::DType;

    fn entry(bytes: &[u8]) -> PageEntry {
        PageEntry {
            id: 0,
            name: "w".into(),
            dtype: DType::BF16,
            shape: vec![bytes.len() / 2],
            file: "model.safetensors".into(),
            offset: 0,
            len: bytes.len() as u64,
            encoding: Encoding::Raw,
            blake3: blake3::hash(bytes).to_hex().to_string(),
            group: PageGroup::Other,
            encoded: Vec::new(),
            rows: None,
        }
    }

    /// A page's first copy is checked by blake3 and sealed; later copies by the seal;
    /// a flipped byte anywhere fails either way, naming the blake3s.
    #[test]
    fn the_seal_catches_what_blake3_catches() {
        let good: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let e = entry(&good);
        let seals = Seals::new(1);

        let mut bad = good.clone();
        bad[54_321] ^= 0x10;
        // Unsealed: blake3 refuses it and nothing is sealed.
        assert!(matches!(
            seals.verify(&e, &bad, "primary"),
            Err(StoreError::Integrity { .. })
        ));
        assert!(!seals.is_sealed(0));

        seals.verify(&e, &good, "primary").unwrap();
        assert!(seals.is_sealed(0));
        seals.verify(&e, &good, "primary").unwrap();
        for at in [0, 1, 4095, 54_321, good.len() - 1] {
            let mut bad = good.clone();
            bad[at] ^= 1;
            match seals.verify(&e, &bad, "nas").unwrap_err() {
                StoreError::Integrity {
                    tier,
                    expected,
                    actual,
                    ..
                } => {
                    assert_eq!(tier, "nas");
                    assert_eq!(expected, e.blake3);
                    assert_eq!(actual, blake3::hash(&bad).to_hex().as_str());
                }
                other => panic!("{other}"),
            }
        }
        // A page the table does not know is checked by blake3.
        let far = PageEntry { id: 7, ..e.clone() };
        seals.verify(&far, &good, "primary").unwrap();
        assert!(seals.verify(&far, &bad, "primary").is_err());
        assert!(!seals.is_sealed(7));
    }

    /// A body is sealed only when asked, after its decoding was verified; a body
    /// that differs anywhere from the sealed one is not taken for it.
    #[test]
    fn bodies_are_sealed_apart_from_pages() {
        let body: Vec<u8> = (0..50_000u32).map(|i| (i * 13 % 241) as u8).collect();
        let seals = Seals::new(2);
        assert!(!seals.body_is_sealed(1, &body));
        seals.seal_body(1, &body);
        assert!(seals.body_is_sealed(1, &body));
        assert!(!seals.body_is_sealed(0, &body), "another page's body");
        assert!(!seals.is_sealed(1), "sealing a body seals no page bytes");
        for at in [0, 31, 32, 49_999] {
            let mut bad = body.clone();
            bad[at] ^= 0x80;
            assert!(!seals.body_is_sealed(1, &bad), "flipped byte {at}");
        }
        assert!(!seals.body_is_sealed(1, &body[..body.len() - 1]));
        // Ids past the table are never sealed.
        seals.seal_body(9, &body);
        assert!(!seals.body_is_sealed(9, &body));
    }

    /// Two stores seal under different keys.
    #[test]
    fn keys_differ_between_stores() {
        let (a, b) = (Seals::new(1), Seals::new(1));
        assert_ne!(a.key, b.key);
        assert_ne!(a.digest(b"page"), b.digest(b"page"));
    }
}

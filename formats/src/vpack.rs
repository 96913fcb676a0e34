//! vpack: the lossless page encoding of BF16 and F16 pages.
//!
//! Each 16-bit element is split into its high byte (for BF16: the sign and the top 7
//! exponent bits) and its low byte. Across a weight tensor the high bytes take few
//! values (weights cluster around a few binades), so the high plane compresses well
//! with zstd; the low bytes are close to uniform and are stored raw unless zstd saves
//! at least [`MIN_SAVING_DIVISOR`]ths of them. Decoding reproduces the original bytes
//! exactly; the manifest's blake3 (of the decoded bytes) is checked after decoding.
//!
//! A body is a 32-byte header followed by the high plane and then the low plane;
//! `docs/formats.md` ("vpack") draws the header as a byte table. Everything is
//! little-endian. Decoding writes straight into a caller's buffer (a page-cache slot)
//! of exactly [`decoded_len`] bytes: the high plane is decompressed into the buffer's
//! upper half and interleaved with the low plane in place, block by block, so no
//! page-sized scratch is needed.
//!
//! Every malformed or truncated body is a [`VpackError`] naming what is wrong, never a
//! panic; [`VpackError::in_page`] turns it into a [`FormatError`] naming file and page.

use std::cell::RefCell;
use std::io::{self, Write};
use std::path::Path;

use crate::dtype::DType;
use crate::error::FormatError;

/// First four bytes of every body.
pub const MAGIC: [u8; 4] = *b"VPAK";
/// The body format this build reads and writes.
pub const VERSION: u16 = 1;
/// Bytes of the header before the planes.
pub const HEADER_LEN: usize = 32;
/// Flag: the high plane is one zstd frame (else the plane's bytes as they are).
pub const FLAG_HIGH_ZSTD: u8 = 0x01;
/// Flag: the low plane is one zstd frame (else the plane's bytes as they are).
pub const FLAG_LOW_ZSTD: u8 = 0x02;
const KNOWN_FLAGS: u8 = FLAG_HIGH_ZSTD | FLAG_LOW_ZSTD;
/// zstd level of the encoder, with [`ZSTD_HASH_LOG`] and [`ZSTD_MIN_MATCH`].
///
/// The high plane of weights is near-memoryless: long matches are rare, and every match
/// zstd takes splits the literals (which Huffman codes well) and costs the decoder a
/// sequence. With the smallest match finder (hash log 6) and the longest minimum match
/// (7) zstd emits almost only Huffman-coded literals: on SmolLM2 that compresses
/// better than levels 1 to 19 with default parameters and decodes twice as fast (figures
/// in `docs/formats.md`). The decoder does not depend on these choices.
pub const ZSTD_LEVEL: i32 = 1;
/// zstd's `hashLog` for the encoder (its minimum).
pub const ZSTD_HASH_LOG: u32 = 6;
/// zstd's `minMatch` for the encoder (its maximum).
pub const ZSTD_MIN_MATCH: u32 = 7;
/// A plane is stored compressed only when zstd saves at least 1/16 of it: a plane that
/// barely compresses costs decode time for nothing.
pub const MIN_SAVING_DIVISOR: usize = 16;
/// Bodies in a pack file (`model.vpack`) start at multiples of this (16 KiB), so a
/// body can be read with direct I/O and a page-cache slot is page aligned on every OS.
pub const PACK_ALIGN: u64 = 16 << 10;
/// The pack file `vpagectl pack` writes beside the raw checkpoint files.
pub const PACK_FILE: &str = "model.vpack";

/// Header codes of the element types.
const DTYPE_BF16: u8 = 1;
const DTYPE_F16: u8 = 2;

/// Interleaving works in blocks of this many elements (see [`interleave_in_place`]).
const BLOCK: usize = 4096;

/// One of the two byte planes of a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plane {
    High,
    Low,
}

impl std::fmt::Display for Plane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Plane::High => "high",
            Plane::Low => "low",
        })
    }
}

/// What is wrong with a page to encode or a body to decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VpackError {
    #[error("vpack encodes BF16 and F16 pages, not {0}")]
    UnsupportedDType(DType),
    #[error("a page of {0} bytes is not a whole number of 2-byte elements")]
    OddLength(usize),
    #[error("body of {0} bytes is shorter than the {HEADER_LEN}-byte header")]
    TruncatedHeader(usize),
    #[error("bad magic {0:02x?} (expected \"VPAK\")")]
    BadMagic([u8; 4]),
    #[error("body format version {0} (this build reads {VERSION})")]
    UnsupportedVersion(u16),
    #[error("element type code {0} is neither BF16 (1) nor F16 (2)")]
    BadDType(u8),
    #[error("unknown flag bits {0:#04x}")]
    BadFlags(u8),
    #[error("nonzero reserved header bytes")]
    BadReserved,
    #[error("element count {0} does not fit in memory")]
    CountTooLarge(u64),
    #[error("header declares {declared} plane bytes after the header, the body holds {actual}")]
    BodyLength { declared: u128, actual: usize },
    #[error("{plane} plane stored raw is {len} bytes, the page has {count} elements")]
    RawPlaneLength { plane: Plane, len: u64, count: u64 },
    #[error("{plane} plane: zstd: {detail}")]
    Zstd { plane: Plane, detail: String },
    #[error("{plane} plane decompresses to {got} bytes, the page has {count} elements")]
    PlaneLength {
        plane: Plane,
        got: usize,
        count: u64,
    },
    #[error("output buffer is {got} bytes, the body decodes to {expected}")]
    OutputLength { got: usize, expected: usize },
    #[error("zstd encoder: {0}")]
    Encoder(String),
}

impl VpackError {
    /// The same error as a [`FormatError`] naming the file the body came from and its page.
    pub fn in_page(self, path: &Path, page: &str) -> FormatError {
        FormatError::BadTensor {
            path: path.to_path_buf(),
            tensor: page.to_string(),
            detail: format!("vpack body: {self}"),
        }
    }
}

pub type Result<T, E = VpackError> = std::result::Result<T, E>;

/// The parsed header of a body whose length has been checked against it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub dtype: DType,
    pub flags: u8,
    /// Elements of the page (its decoded length is twice this).
    pub count: usize,
    /// Stored length of the high plane (compressed or raw, per `flags`).
    pub high_len: usize,
    /// Stored length of the low plane.
    pub low_len: usize,
}

impl Header {
    /// Parses and checks the header of `body`: magic, version, element type, flags,
    /// reserved bytes, and that the planes fill the body exactly.
    pub fn parse(body: &[u8]) -> Result<Header> {
        let Some(h) = body.get(..HEADER_LEN) else {
            return Err(VpackError::TruncatedHeader(body.len()));
        };
        let u64_at = |at: usize| u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"));
        let magic: [u8; 4] = h[0..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(VpackError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([h[4], h[5]]);
        if version != VERSION {
            return Err(VpackError::UnsupportedVersion(version));
        }
        let dtype = match h[6] {
            DTYPE_BF16 => DType::BF16,
            DTYPE_F16 => DType::F16,
            c => return Err(VpackError::BadDType(c)),
        };
        let flags = h[7];
        if flags & !KNOWN_FLAGS != 0 {
            return Err(VpackError::BadFlags(flags & !KNOWN_FLAGS));
        }
        let (count, high_len, low_len) = (u64_at(8), u64_at(16), u64_at(24));
        // Decoded bytes must be addressable: 2 * count fits in usize.
        let count_usize = usize::try_from(count)
            .ok()
            .filter(|c| c.checked_mul(2).is_some())
            .ok_or(VpackError::CountTooLarge(count))?;
        let declared = u128::from(high_len) + u128::from(low_len);
        let actual = body.len() - HEADER_LEN;
        if declared != actual as u128 {
            return Err(VpackError::BodyLength { declared, actual });
        }
        // Both fit in usize now: their sum equals a slice length.
        let header = Header {
            dtype,
            flags,
            count: count_usize,
            high_len: high_len as usize,
            low_len: low_len as usize,
        };
        for plane in [Plane::High, Plane::Low] {
            let (flag, len) = header.plane(plane);
            if !flag && len != count_usize {
                return Err(VpackError::RawPlaneLength {
                    plane,
                    len: len as u64,
                    count,
                });
            }
        }
        Ok(header)
    }

    /// Bytes the body decodes to.
    pub fn decoded_len(&self) -> usize {
        self.count * 2
    }

    /// (compressed?, stored length) of `plane`.
    fn plane(&self, plane: Plane) -> (bool, usize) {
        match plane {
            Plane::High => (self.flags & FLAG_HIGH_ZSTD != 0, self.high_len),
            Plane::Low => (self.flags & FLAG_LOW_ZSTD != 0, self.low_len),
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.push(match self.dtype {
            DType::F16 => DTYPE_F16,
            _ => DTYPE_BF16,
        });
        out.push(self.flags);
        out.extend_from_slice(&(self.count as u64).to_le_bytes());
        out.extend_from_slice(&(self.high_len as u64).to_le_bytes());
        out.extend_from_slice(&(self.low_len as u64).to_le_bytes());
    }
}

/// True for the element types vpack encodes.
pub fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// Bytes `body` decodes to, after checking its header against its length.
pub fn decoded_len(body: &[u8]) -> Result<usize> {
    Header::parse(body).map(|h| h.decoded_len())
}

thread_local! {
    // zstd contexts are reused per thread: creating one costs more than decoding a
    // small page (a norm vector).
    static COMPRESSOR: RefCell<Option<zstd::bulk::Compressor<'static>>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// Encodes one page of `dtype` (BF16 or F16) elements, little-endian as in safetensors.
pub fn encode(dtype: DType, bytes: &[u8]) -> Result<Vec<u8>> {
    if !supports(dtype) {
        return Err(VpackError::UnsupportedDType(dtype));
    }
    if !bytes.len().is_multiple_of(2) {
        return Err(VpackError::OddLength(bytes.len()));
    }
    let count = bytes.len() / 2;
    let mut high = vec![0u8; count];
    let mut low = vec![0u8; count];
    split(bytes, &mut high, &mut low);
    let high_z = compress_if_worth(&high)?;
    let low_z = compress_if_worth(&low)?;
    let mut flags = 0;
    if high_z.is_some() {
        flags |= FLAG_HIGH_ZSTD;
    }
    if low_z.is_some() {
        flags |= FLAG_LOW_ZSTD;
    }
    let high_stored = high_z.as_deref().unwrap_or(&high);
    let low_stored = low_z.as_deref().unwrap_or(&low);
    let header = Header {
        dtype,
        flags,
        count,
        high_len: high_stored.len(),
        low_len: low_stored.len(),
    };
    let mut out = Vec::with_capacity(HEADER_LEN + high_stored.len() + low_stored.len());
    header.write(&mut out);
    out.extend_from_slice(high_stored);
    out.extend_from_slice(low_stored);
    Ok(out)
}

/// A zstd compressor with the encoder's parameters.
pub fn compressor() -> io::Result<zstd::bulk::Compressor<'static>> {
    use zstd::zstd_safe::CParameter;
    let mut c = zstd::bulk::Compressor::new(ZSTD_LEVEL)?;
    c.set_parameter(CParameter::HashLog(ZSTD_HASH_LOG))?;
    c.set_parameter(CParameter::MinMatch(ZSTD_MIN_MATCH))?;
    Ok(c)
}

/// zstd frame of `plane` when it saves at least 1/[`MIN_SAVING_DIVISOR`] of it.
fn compress_if_worth(plane: &[u8]) -> Result<Option<Vec<u8>>> {
    if plane.is_empty() {
        return Ok(None);
    }
    let frame = COMPRESSOR.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_none() {
            *c = Some(compressor()?);
        }
        c.as_mut().expect("set above").compress(plane)
    });
    let frame = frame.map_err(|e| VpackError::Encoder(e.to_string()))?;
    Ok((frame.len() <= plane.len() - plane.len() / MIN_SAVING_DIVISOR).then_some(frame))
}

/// Decodes `body` into `out`, which must be exactly [`decoded_len`] bytes.
pub fn decode(body: &[u8], out: &mut [u8]) -> Result<()> {
    let h = Header::parse(body)?;
    if out.len() != h.decoded_len() {
        return Err(VpackError::OutputLength {
            got: out.len(),
            expected: h.decoded_len(),
        });
    }
    let (high_src, low_src) = body[HEADER_LEN..].split_at(h.high_len);
    let count = h.count;
    // The low plane: borrowed from the body, or (rarely: real low bytes do not
    // compress) decompressed into a scratch buffer.
    let low_buf;
    let low: &[u8] = if h.flags & FLAG_LOW_ZSTD != 0 {
        let mut buf = vec![0u8; count];
        decompress_exact(Plane::Low, low_src, &mut buf, count)?;
        low_buf = buf;
        &low_buf
    } else {
        low_src
    };
    if h.flags & FLAG_HIGH_ZSTD != 0 {
        decompress_exact(Plane::High, high_src, &mut out[count..], count)?;
        interleave_in_place(out, low);
    } else {
        interleave(high_src, low, out);
    }
    Ok(())
}

/// Decompresses the one-frame `src` into `dst` (`count` bytes), which it must fill exactly.
fn decompress_exact(plane: Plane, src: &[u8], dst: &mut [u8], count: usize) -> Result<()> {
    let got = DECOMPRESSOR.with(|d| {
        let mut d = d.borrow_mut();
        if d.is_none() {
            *d = Some(zstd::bulk::Decompressor::new()?);
        }
        d.as_mut()
            .expect("set above")
            .decompress_to_buffer(src, dst)
    });
    let got = got.map_err(|e| VpackError::Zstd {
        plane,
        detail: e.to_string(),
    })?;
    if got != count {
        return Err(VpackError::PlaneLength {
            plane,
            got,
            count: count as u64,
        });
    }
    Ok(())
}

/// Splits little-endian 16-bit elements into their high and low bytes.
pub fn split(bytes: &[u8], high: &mut [u8], low: &mut [u8]) {
    assert!(bytes.len() == 2 * high.len() && high.len() == low.len());
    // Fixed-size chunks let LLVM vectorise the byte shuffle.
    let mut b = bytes.chunks_exact(32);
    let mut h = high.chunks_exact_mut(16);
    let mut l = low.chunks_exact_mut(16);
    for ((b, h), l) in (&mut b).zip(&mut h).zip(&mut l) {
        let b: &[u8; 32] = b.try_into().expect("32 bytes");
        let h: &mut [u8; 16] = h.try_into().expect("16 bytes");
        let l: &mut [u8; 16] = l.try_into().expect("16 bytes");
        for k in 0..16 {
            l[k] = b[2 * k];
            h[k] = b[2 * k + 1];
        }
    }
    let (b, h, l) = (b.remainder(), h.into_remainder(), l.into_remainder());
    for k in 0..h.len() {
        l[k] = b[2 * k];
        h[k] = b[2 * k + 1];
    }
}

/// Interleaves planes back into little-endian 16-bit elements: `out[2i] = low[i]`,
/// `out[2i + 1] = high[i]`.
pub fn interleave(high: &[u8], low: &[u8], out: &mut [u8]) {
    assert!(out.len() == 2 * high.len() && high.len() == low.len());
    let mut o = out.chunks_exact_mut(32);
    let mut h = high.chunks_exact(16);
    let mut l = low.chunks_exact(16);
    for ((o, h), l) in (&mut o).zip(&mut h).zip(&mut l) {
        let o: &mut [u8; 32] = o.try_into().expect("32 bytes");
        let h: &[u8; 16] = h.try_into().expect("16 bytes");
        let l: &[u8; 16] = l.try_into().expect("16 bytes");
        for k in 0..16 {
            o[2 * k] = l[k];
            o[2 * k + 1] = h[k];
        }
    }
    let (o, h, l) = (o.into_remainder(), h.remainder(), l.remainder());
    for k in 0..h.len() {
        o[2 * k] = l[k];
        o[2 * k + 1] = h[k];
    }
}

/// Interleaves the high plane held in `out[count..]` with `low` into all of `out`.
///
/// Block `[i, i + n)` writes `out[2i .. 2i + 2n]` after copying its high bytes
/// `out[count + i .. count + i + n]` aside; later blocks read from `count + i + n` on,
/// and `2i + 2n <= count + i + n` because `i + n <= count`, so no write reaches a high
/// byte that is still to be read.
fn interleave_in_place(out: &mut [u8], low: &[u8]) {
    let count = low.len();
    debug_assert_eq!(out.len(), 2 * count);
    let mut high = [0u8; BLOCK];
    let mut i = 0;
    while i < count {
        let n = BLOCK.min(count - i);
        high[..n].copy_from_slice(&out[count + i..count + i + n]);
        interleave(&high[..n], &low[i..i + n], &mut out[2 * i..2 * (i + n)]);
        i += n;
    }
}

/// Appends page bodies to a pack file, each starting at a multiple of [`PACK_ALIGN`]
/// (zero padding between bodies).
pub struct PackWriter<'w> {
    w: &'w mut dyn Write,
    path: &'w Path,
    pos: u64,
}

impl PackWriter<'_> {
    /// Writes `body` at the next aligned offset and returns that offset.
    pub fn push(&mut self, body: &[u8]) -> std::result::Result<u64, FormatError> {
        self.push_io(body)
            .map_err(|e| FormatError::io(self.path, e))
    }

    fn push_io(&mut self, body: &[u8]) -> io::Result<u64> {
        let at = self.pos.next_multiple_of(PACK_ALIGN);
        let pad = (at - self.pos) as usize;
        const ZEROS: [u8; 4096] = [0; 4096];
        let mut left = pad;
        while left > 0 {
            let k = left.min(ZEROS.len());
            self.w.write_all(&ZEROS[..k])?;
            left -= k;
        }
        self.w.write_all(body)?;
        self.pos = at + body.len() as u64;
        Ok(at)
    }

    /// Bytes written so far (the file's length once done).
    pub fn len(&self) -> u64 {
        self.pos
    }

    /// True before the first body.
    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }
}

/// Writes the pack file `path` atomically (temporary file, sync, rename): `fill` pushes
/// the bodies. On any error `path` is left as it was. `fill`'s own error type passes
/// through; I/O errors become `FormatError::Io` naming `path`.
pub fn write_pack_file<E: From<FormatError>>(
    path: &Path,
    fill: impl FnOnce(&mut PackWriter<'_>) -> std::result::Result<(), E>,
) -> std::result::Result<u64, E> {
    let mut inner: Option<E> = None;
    let mut len = 0;
    let written = crate::safetensors::write_atomically(path, |w| {
        let mut pw = PackWriter { w, path, pos: 0 };
        let r = fill(&mut pw);
        len = pw.pos;
        r.map_err(|e| {
            inner = Some(e);
            io::Error::other("pack aborted")
        })
    });
    match (written, inner) {
        (_, Some(e)) => Err(e),
        (Err(e), None) => Err(e.into()),
        (Ok(()), None) => Ok(len),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(dtype: DType, bytes: &[u8]) -> Vec<u8> {
        let body = encode(dtype, bytes).unwrap();
        assert_eq!(decoded_len(&body).unwrap(), bytes.len());
        let mut out = vec![0xA5; bytes.len()];
        decode(&body, &mut out).unwrap();
        assert_eq!(out, bytes);
        body
    }

    /// BF16 weights like a trained layer's: normal around zero, std 0.02.
    fn weights(n: usize) -> Vec<u8> {
        let mut s = 0x1234_5678_9abc_def0u64;
        let mut out = Vec::with_capacity(n * 2);
        for _ in 0..n {
            // Sum of uniforms: roughly normal.
            let mut x = 0.0f32;
            for _ in 0..4 {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                x += (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            }
            out.extend_from_slice(&crate::dtype::f32_to_bf16(x * 0.035).to_le_bytes());
        }
        out
    }

    #[test]
    fn header_bytes_are_as_documented() {
        let bytes = weights(5000);
        let body = round_trip(DType::BF16, &bytes);
        assert_eq!(&body[0..4], b"VPAK");
        assert_eq!(&body[4..6], &[1, 0]);
        assert_eq!(body[6], 1);
        assert_eq!(
            body[7], FLAG_HIGH_ZSTD,
            "weights: high plane compressed, low raw"
        );
        assert_eq!(u64::from_le_bytes(body[8..16].try_into().unwrap()), 5000);
        let high_len = u64::from_le_bytes(body[16..24].try_into().unwrap());
        assert_eq!(u64::from_le_bytes(body[24..32].try_into().unwrap()), 5000);
        assert_eq!(body.len() as u64, 32 + high_len + 5000);
        // The low plane is stored raw, after the high plane.
        let low: Vec<u8> = bytes.iter().step_by(2).copied().collect();
        assert_eq!(&body[32 + high_len as usize..], &low[..]);
        assert!(
            high_len < 2500,
            "high plane of weights compresses: {high_len}"
        );
    }

    #[test]
    fn round_trips_edge_shapes_and_values() {
        for n in [
            0usize,
            1,
            15,
            16,
            17,
            31,
            33,
            BLOCK - 1,
            BLOCK,
            BLOCK + 1,
            3 * BLOCK + 7,
        ] {
            let w = weights(n);
            round_trip(DType::BF16, &w);
            round_trip(DType::F16, &w);
            round_trip(DType::BF16, &vec![0; 2 * n]);
            round_trip(DType::F16, &vec![0xFF; 2 * n]);
            let nans: Vec<u8> = (0..n)
                .flat_map(|i| [0x7FC0u16, 0xFFC1, 0x7F80, 0x0001][i % 4].to_le_bytes())
                .collect();
            round_trip(DType::BF16, &nans);
        }
        // All zeros compresses both planes.
        let body = round_trip(DType::BF16, &vec![0; 1 << 16]);
        assert_eq!(body[7], FLAG_HIGH_ZSTD | FLAG_LOW_ZSTD);
        assert!(body.len() < 200);
    }

    #[test]
    fn rejects_what_it_cannot_encode() {
        assert_eq!(
            encode(DType::F32, &[0; 8]),
            Err(VpackError::UnsupportedDType(DType::F32))
        );
        assert_eq!(encode(DType::BF16, &[0; 7]), Err(VpackError::OddLength(7)));
    }

    #[test]
    fn names_what_is_wrong_with_a_body() {
        let good = encode(DType::BF16, &weights(3000)).unwrap();
        let mut out = vec![0; 6000];
        let bad = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = good.clone();
            f(&mut b);
            let mut out = vec![0; 6000];
            decode(&b, &mut out).unwrap_err()
        };
        assert_eq!(
            decode(&good[..10], &mut out),
            Err(VpackError::TruncatedHeader(10))
        );
        assert!(matches!(bad(&|b| b[0] = b'X'), VpackError::BadMagic(_)));
        assert_eq!(bad(&|b| b[4] = 2), VpackError::UnsupportedVersion(2));
        assert_eq!(bad(&|b| b[6] = 9), VpackError::BadDType(9));
        assert_eq!(bad(&|b| b[7] |= 0x80), VpackError::BadFlags(0x80));
        assert!(matches!(
            bad(&|b| b[15] = 0xFF),
            VpackError::CountTooLarge(_)
        ));
        let e = bad(&|b| {
            b.pop();
        });
        assert!(matches!(e, VpackError::BodyLength { .. }), "{e}");
        assert!(matches!(bad(&|b| b.push(0)), VpackError::BodyLength { .. }));
        // A raw low plane whose length disagrees with the count.
        let e = bad(&|b| {
            b[8] = b[8].wrapping_add(1);
        });
        assert!(
            matches!(
                e,
                VpackError::RawPlaneLength {
                    plane: Plane::Low,
                    ..
                }
            ),
            "{e}"
        );
        // Garbage in the zstd frame.
        let e = bad(&|b| b[HEADER_LEN..HEADER_LEN + 8].copy_from_slice(&[0xEE; 8]));
        assert!(
            matches!(
                e,
                VpackError::Zstd {
                    plane: Plane::High,
                    ..
                }
            ),
            "{e}"
        );
        // Wrong output length.
        assert_eq!(
            decode(&good, &mut [0; 5998]),
            Err(VpackError::OutputLength {
                got: 5998,
                expected: 6000
            })
        );
        let e = VpackError::BadDType(9).in_page(Path::new("m.vpack"), "w");
        assert_eq!(
            e.to_string(),
            "m.vpack: tensor 'w': vpack body: element type code 9 is neither BF16 (1) nor F16 (2)"
        );
    }

    #[test]
    fn a_frame_of_the_wrong_size_is_an_error() {
        // Two bodies whose high frames decode to 2000 and 4000 bytes; a header claiming
        // 3000 elements around either frame must fail, not read or write out of bounds.
        for n in [2000usize, 4000] {
            let body = encode(DType::BF16, &weights(n)).unwrap();
            let h = Header::parse(&body).unwrap();
            let frame = &body[HEADER_LEN..HEADER_LEN + h.high_len];
            let mut forged = Vec::new();
            Header {
                dtype: DType::BF16,
                flags: FLAG_HIGH_ZSTD,
                count: 3000,
                high_len: frame.len(),
                low_len: 3000,
            }
            .write(&mut forged);
            forged.extend_from_slice(frame);
            forged.extend_from_slice(&[7; 3000]);
            let e = decode(&forged, &mut vec![0; 6000]).unwrap_err();
            assert!(
                matches!(
                    e,
                    VpackError::PlaneLength {
                        plane: Plane::High,
                        ..
                    } | VpackError::Zstd {
                        plane: Plane::High,
                        ..
                    }
                ),
                "{n}: {e}"
            );
        }
    }

    #[test]
    fn pack_writer_aligns_bodies() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join(PACK_FILE);
        let mut at = vec![];
        let len = write_pack_file::<FormatError>(&path, |w| {
            assert!(w.is_empty());
            at.push(w.push(b"abc")?);
            at.push(w.push(&[9; 20000])?);
            at.push(w.push(b"")?);
            at.push(w.push(b"z")?);
            Ok(())
        })
        .unwrap();
        assert_eq!(at, vec![0, PACK_ALIGN, 3 * PACK_ALIGN, 3 * PACK_ALIGN]);
        let file = std::fs::read(&path).unwrap();
        assert_eq!(file.len() as u64, len);
        assert_eq!(len, 3 * PACK_ALIGN + 1);
        assert_eq!(&file[..3], b"abc");
        assert!(file[3..PACK_ALIGN as usize].iter().all(|&b| b == 0));
        // A failing fill leaves the old file alone and passes its error through.
        let e = write_pack_file(&path, |w| {
            w.push(b"new")?;
            Err(FormatError::Missing {
                path: "x".into(),
                what: "y".into(),
            })
        })
        .unwrap_err();
        assert!(matches!(e, FormatError::Missing { .. }));
        assert_eq!(std::fs::read(&path).unwrap(), file);
    }
}

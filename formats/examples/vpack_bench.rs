//! vpack on a real model: compression ratio, encode and decode speed, and the bounds
//! decode is under, all measured in the same run on one thread.
//!
//! `cargo run --release -p voom-formats --example vpack_bench -- MODEL_DIR [RUNS]`
//!
//! Every BF16/F16 page of the checkpoint is encoded and decoded; each figure is the
//! median over RUNS (default 5) passes over all pages. Bounds beside decode:
//! - memcpy of the same decoded bytes (a decode cannot beat writing its output), and
//! - zstd's own decode of the high planes alone (vpack decode = that + interleave).
//!
//! Also printed, to justify the format's choices: the high plane's ratio at other zstd
//! levels and what zstd would save on the low plane.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use voom_formats::vpack::{self, Header, HEADER_LEN};
use voom_formats::Checkpoint;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / 1e9 / t.as_secs_f64()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().expect("usage: vpack_bench MODEL_DIR [RUNS]"));
    let runs: usize = args
        .next()
        .map_or(5, |r| r.parse().expect("RUNS is a number"));
    let ckpt = Checkpoint::open(&dir).expect("opens the checkpoint");

    // Copy pages into memory once, so every pass reads the same warm bytes.
    let pages: Vec<(String, voom_formats::DType, Vec<u8>)> = ckpt
        .tensors()
        .filter(|(_, loc)| vpack::supports(loc.info.dtype))
        .map(|(name, loc)| {
            let bytes = ckpt.files[loc.file].tensor_bytes(&loc.info).to_vec();
            (name.to_string(), loc.info.dtype, bytes)
        })
        .collect();
    let raw: usize = pages.iter().map(|p| p.2.len()).sum();
    let skipped = ckpt.tensors().count() - pages.len();
    println!(
        "{}: {} BF16/F16 pages, {raw} bytes ({:.1} MiB); {skipped} pages of other types stay raw",
        dir.display(),
        pages.len(),
        raw as f64 / (1 << 20) as f64
    );

    let mut bodies: Vec<Vec<u8>> = Vec::new();
    let mut outs: Vec<Vec<u8>> = pages.iter().map(|p| vec![0u8; p.2.len()]).collect();
    let (mut enc, mut dec, mut copy, mut zhigh, mut inter) =
        (vec![], vec![], vec![], vec![], vec![]);
    for run in 0..runs {
        let t = Instant::now();
        bodies = pages
            .iter()
            .map(|(_, dt, b)| vpack::encode(*dt, b).expect("encodes"))
            .collect();
        enc.push(gbps(raw, t.elapsed()));

        let t = Instant::now();
        for (body, out) in bodies.iter().zip(&mut outs) {
            vpack::decode(body, out).expect("decodes");
        }
        dec.push(gbps(raw, t.elapsed()));
        if run == 0 {
            for ((name, _, b), out) in pages.iter().zip(&outs) {
                assert!(b == out, "{name}: decode differs from the original");
            }
        }

        let t = Instant::now();
        for ((_, _, b), out) in pages.iter().zip(&mut outs) {
            out.copy_from_slice(black_box(b));
        }
        black_box(&outs);
        copy.push(gbps(raw, t.elapsed()));

        // zstd alone on the high planes, into a buffer as long as the plane.
        let t = Instant::now();
        let mut d = zstd::bulk::Decompressor::new().unwrap();
        for (body, out) in bodies.iter().zip(&mut outs) {
            let h = Header::parse(body).unwrap();
            if h.flags & vpack::FLAG_HIGH_ZSTD != 0 {
                let frame = &body[HEADER_LEN..HEADER_LEN + h.high_len];
                d.decompress_to_buffer(frame, &mut out[..h.count]).unwrap();
            }
        }
        black_box(&outs);
        zhigh.push(gbps(raw, t.elapsed()));

        // The interleave alone (planes already apart), in decoded bytes.
        let t = Instant::now();
        for ((_, _, b), out) in pages.iter().zip(&mut outs) {
            let n = b.len() / 2;
            let (high, low) = b.split_at(n); // any two planes of the right size
            vpack::interleave(black_box(high), black_box(low), out);
        }
        black_box(&outs);
        inter.push(gbps(raw, t.elapsed()));
    }
    let (enc, dec, copy, zhigh, inter) = (
        median(enc),
        median(dec),
        median(copy),
        median(zhigh),
        median(inter),
    );

    let packed: usize = bodies.iter().map(|b| b.len()).sum();
    let (mut high_raw, mut high_stored, mut low_stored) = (0usize, 0usize, 0usize);
    let mut low_zstd_pages = 0;
    for b in &bodies {
        let h = Header::parse(b).unwrap();
        high_raw += h.count;
        high_stored += h.high_len;
        low_stored += h.low_len;
        low_zstd_pages += usize::from(h.flags & vpack::FLAG_LOW_ZSTD != 0);
    }
    println!("median of {runs} runs, one thread, GB/s of decoded (raw) bytes:");
    println!(
        "  ratio packed/raw      {:.4}  ({packed} / {raw} bytes; high plane {:.4}, low plane {:.4}; low plane zstd in {low_zstd_pages} pages)",
        packed as f64 / raw as f64,
        high_stored as f64 / high_raw as f64,
        low_stored as f64 / high_raw as f64,
    );
    println!(
        "  encode                {enc:.2} GB/s (zstd level {}, hash log {}, min match {})",
        vpack::ZSTD_LEVEL,
        vpack::ZSTD_HASH_LOG,
        vpack::ZSTD_MIN_MATCH
    );
    println!("  decode                {dec:.2} GB/s");
    println!(
        "  bound: memcpy         {copy:.2} GB/s   decode/memcpy = {:.3}",
        dec / copy
    );
    println!(
        "  bound: zstd high only {zhigh:.2} GB/s   decode/zstd-high = {:.3}",
        dec / zhigh
    );
    println!(
        "  interleave alone      {inter:.2} GB/s   (memcpy ratio {:.3})",
        inter / copy
    );

    // Why these choices: the high plane at other levels, and zstd on the low plane.
    let mut high_all = Vec::with_capacity(raw / 2);
    let mut low_all = Vec::with_capacity(raw / 2);
    for (_, _, b) in &pages {
        let n = b.len() / 2;
        let (mut h, mut l) = (vec![0; n], vec![0; n]);
        vpack::split(b, &mut h, &mut l);
        high_all.push(h);
        low_all.push(l);
    }
    // Other zstd settings for the high plane: default parameters at several levels,
    // and vpack's (level 1, hash log 6, min match 7). Decode speed is measured too:
    // matches cost the decoder more than plain Huffman literals.
    let mut d = zstd::bulk::Decompressor::new().unwrap();
    let mut scratch = vec![0u8; high_all.iter().map(|h| h.len()).max().unwrap_or(0)];
    let settings: [(&str, i32); 5] = [
        ("default parameters, level 1", 1),
        ("default parameters, level 3", 3),
        ("default parameters, level 9", 9),
        ("default parameters, level 19", 19),
        ("vpack's parameters", 0),
    ];
    for (what, level) in settings {
        if level == 19 && std::env::var_os("VPACK_BENCH_SLOW").is_none() {
            continue; // minutes per pass; set VPACK_BENCH_SLOW=1 to include it
        }
        let mut c = if level == 0 {
            vpack::compressor().unwrap()
        } else {
            zstd::bulk::Compressor::new(level).unwrap()
        };
        let t = Instant::now();
        let frames: Vec<Vec<u8>> = high_all.iter().map(|h| c.compress(h).unwrap()).collect();
        let el = t.elapsed();
        let z: usize = frames.iter().map(|f| f.len()).sum();
        let mut dt = vec![];
        for _ in 0..runs {
            let t = Instant::now();
            for (f, h) in frames.iter().zip(&high_all) {
                d.decompress_to_buffer(f, &mut scratch[..h.len()]).unwrap();
            }
            dt.push(gbps(high_raw, t.elapsed()));
        }
        println!(
            "  high plane, zstd {what:<29}: ratio {:.4}, compress {:.3}, decompress {:.3} GB/s of plane",
            z as f64 / high_raw as f64,
            gbps(high_raw, el),
            median(dt)
        );
    }
    let t = Instant::now();
    let frames: Vec<Vec<u8>> = low_all
        .iter()
        .map(|l| vpack::compressor().unwrap().compress(l).unwrap())
        .collect();
    let el = t.elapsed();
    let z: usize = frames.iter().map(|f| f.len()).sum();
    let mut d = zstd::bulk::Decompressor::new().unwrap();
    let t = Instant::now();
    for (f, l) in frames.iter().zip(&mut low_all) {
        d.decompress_to_buffer(f, l).unwrap();
    }
    let dl = t.elapsed();
    println!(
        "  low plane, zstd with vpack's parameters: ratio {:.4} (compress {:.3}, decompress {:.3} GB/s of plane)",
        z as f64 / high_raw as f64,
        gbps(high_raw, el),
        gbps(high_raw, dl)
    );
}

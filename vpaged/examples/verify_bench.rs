//! What verifying a page costs: blake3 (a page's first copy) against its seal, the
//! keyed XXH3-128 of later copies (`vpaged::seal`), on one core over the same
//! buffer, beside the physical bound measured in the same run: reading the buffer
//! once (a sum of its words), which no hash of it can beat.
//!
//! `cargo run --release -p vpaged --example verify_bench [-- MIB]` (default 256 MiB,
//! larger than any cache, as pages streamed out of core are).

use std::hint::black_box;
use std::time::Instant;

use twox_hash::XxHash3_128;

fn best_gbps(bytes: usize, mut f: impl FnMut()) -> f64 {
    let secs = (0..5)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    bytes as f64 / secs / 1e9
}

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(256);
    let n = mib << 20;
    let buf: Vec<u8> = (0..n).map(|i| (i * 31 + i / 4093) as u8).collect();
    let read = best_gbps(n, || {
        let s: u64 = buf
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .fold(0, u64::wrapping_add);
        black_box(s);
    });
    let b3 = best_gbps(n, || {
        black_box(blake3::hash(&buf));
    });
    let seal = best_gbps(n, || {
        black_box(XxHash3_128::oneshot_with_seed(0x5eed, &buf));
    });
    println!("{mib} MiB, one core, best of 5:");
    println!("  read once (the bound) {read:6.2} GB/s");
    println!(
        "  blake3                {b3:6.2} GB/s  {:.2} of the bound",
        b3 / read
    );
    println!(
        "  seal (XXH3-128)       {seal:6.2} GB/s  {:.2} of the bound",
        seal / read
    );
    println!("  seal / blake3         {:6.2}x", seal / b3);
}

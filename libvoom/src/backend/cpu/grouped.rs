//! Attention's grouped kernels: the scores, and the weighted sums of values, of
//! several query rows that attend the same keys (the query heads of one position
//! that share a KV head), each key and value loaded once for the group.
//!
//! Every element keeps the bits of the one-row kernels of [`super::matmul`]: a
//! score is [`super::matmul::dot_f32`] of its query and key, times the scale; an
//! output element is one fused multiply-add per term, in increasing position.
//! Grouping changes which values share a register load, never an element's
//! operations or their order.

use super::matmul::{attention_scores_isa, weighted_sum_add_isa, Isa};

impl Isa {
    /// The most rows [`scores`] and [`weighted_sums`] take at once with their
    /// grouped kernels (more rows are a caller's choice: they run in groups of it).
    pub fn attention_group(self) -> usize {
        match self {
            Isa::Avx512 => 4,
            Isa::Avx2 => 2,
            Isa::Neon | Isa::Portable => 1,
        }
    }
}

/// Checks a group's rows: as many of `a` as of `b`, `a`'s of one length and `b`'s
/// of one length, and `count` vectors of `width` floats at `stride` within `len`
/// floats (`count` and `width` taken from `(a's length, b's length)` by `pick`).
/// `false`: nothing to compute (no rows, or no vectors).
///
/// # Panics
/// On any mismatch, naming `what`.
fn checked(
    what: &str,
    a: &[&[f32]],
    b: &[&mut [f32]],
    pick: fn((usize, usize)) -> (usize, usize),
    stride: usize,
    len: usize,
) -> bool {
    assert_eq!(a.len(), b.len(), "{what}: rows of the two sides differ");
    let (Some(fa), Some(fb)) = (a.first(), b.first()) else {
        return false;
    };
    let lens = (fa.len(), fb.len());
    assert!(
        a.iter().all(|r| r.len() == lens.0) && b.iter().all(|r| r.len() == lens.1),
        "{what}: rows differ in length"
    );
    let (count, width) = pick(lens);
    if count == 0 {
        return false;
    }
    assert!(
        (count - 1) * stride + width <= len,
        "{what}: {count} vectors of {width} floats at stride {stride} exceed {len} floats"
    );
    true
}

/// `s[r][j] = dot_f32(q[r], key_j) * scale` for every row `r` and `j <
/// s[r].len()`, the key of `j` at `j * stride` of `keys`.
///
/// # Panics
/// If the rows' query lengths or score lengths differ, or `keys` is too short.
pub fn scores(
    isa: Isa,
    q: &[&[f32]],
    keys: &[f32],
    stride: usize,
    scale: f32,
    s: &mut [&mut [f32]],
) {
    if !checked("grouped scores", q, s, |(d, n)| (n, d), stride, keys.len()) {
        return;
    }
    let g = isa.attention_group();
    for (qr, sr) in q.chunks(g).zip(s.chunks_mut(g)) {
        #[cfg(target_arch = "x86_64")]
        if qr.len() > 1 && isa.avx2() {
            // SAFETY: `isa` is supported (every caller's `Isa` comes from
            // `Isa::detect`/`available` or was checked); lengths and bounds checked
            // above.
            unsafe {
                match isa {
                    Isa::Avx512 => wide::scores(qr, keys, stride, scale, sr),
                    _ => narrow::scores(qr, keys, stride, scale, sr),
                }
            }
            continue;
        }
        for (qv, sv) in qr.iter().zip(sr.iter_mut()) {
            attention_scores_isa(isa, qv, keys, stride, scale, sv);
        }
    }
}

/// `out[r] = Σ_j fma(p[r][j], value_j, out[r])` in increasing `j`, from `out[r]`
/// as it is, for every row `r`, the value of `j` at `j * stride` of `values`.
///
/// # Panics
/// If the rows' probability lengths or output lengths differ, or `values` is too
/// short.
pub fn weighted_sums(
    isa: Isa,
    p: &[&[f32]],
    values: &[f32],
    stride: usize,
    out: &mut [&mut [f32]],
) {
    if !checked(
        "grouped sums",
        p,
        out,
        |(n, d)| (n, d),
        stride,
        values.len(),
    ) {
        return;
    }
    let g = isa.attention_group();
    for (pr, or) in p.chunks(g).zip(out.chunks_mut(g)) {
        #[cfg(target_arch = "x86_64")]
        if pr.len() > 1 && isa.avx2() {
            // SAFETY: as in `scores`.
            unsafe {
                match isa {
                    Isa::Avx512 => wide::sums(pr, values, stride, or),
                    _ => narrow::sums(pr, values, stride, or),
                }
            }
            continue;
        }
        for (pv, ov) in pr.iter().zip(or.iter_mut()) {
            weighted_sum_add_isa(isa, pv, values, stride, ov);
        }
    }
}

/// The grouped kernels, compiled for one set of target features; `$scores` and
/// `$sums` map a group size to the kernel's shape (rows x keys held in registers,
/// rows x 8-float chunks of the output held in registers).
#[cfg(target_arch = "x86_64")]
macro_rules! grouped_kernels {
    ($features:literal, scores: [$(($qs:literal, $ks:literal)),*], sums: [$(($qw:literal, $cw:literal)),*]) => {
        use super::super::matmul::avx2::{dot_f32, hsum8x};
        use std::arch::x86_64::*;

        /// # Safety
        /// The CPU has `$features`; the rows are 2..=group, of equal lengths, and
        /// every key is within `keys` (as [`super::scores`] asserts).
        #[target_feature(enable = $features)]
        pub(super) unsafe fn scores(
            q: &[&[f32]],
            keys: &[f32],
            stride: usize,
            scale: f32,
            s: &mut [&mut [f32]],
        ) {
            // SAFETY: forwarded contract.
            unsafe {
                match q.len() {
                    $($qs => scores_q::<$qs, $ks>(q, keys, stride, scale, s),)*
                    _ => unreachable!("group of {} rows", q.len()),
                }
            }
        }

        /// # Safety
        /// The CPU has `$features`; the rows are 2..=group, of equal lengths, and
        /// every value is within `values` (as [`super::weighted_sums`] asserts).
        #[target_feature(enable = $features)]
        pub(super) unsafe fn sums(
            p: &[&[f32]],
            values: &[f32],
            stride: usize,
            out: &mut [&mut [f32]],
        ) {
            let d = out[0].len();
            let d8 = d - d % 8;
            // SAFETY: forwarded contract; chunks within 0..d8.
            unsafe {
                match p.len() {
                    $($qw => {
                        let mut c0 = 0;
                        while c0 + 8 * $cw <= d8 {
                            sums_q::<$qw, $cw>(p, values, stride, out, c0);
                            c0 += 8 * $cw;
                        }
                        while c0 < d8 {
                            sums_q::<$qw, 1>(p, values, stride, out, c0);
                            c0 += 8;
                        }
                    })*
                    _ => unreachable!("group of {} rows", p.len()),
                }
            }
            for (pr, o) in p.iter().zip(out.iter_mut()) {
                for (k, y) in o.iter_mut().enumerate().skip(d8) {
                    for (j, &pj) in pr.iter().enumerate() {
                        *y = pj.mul_add(values[j * stride + k], *y);
                    }
                }
            }
        }

        /// `Q` rows' scores against `K` keys at a time, `Q x K` accumulators; the
        /// sums reduced eight at a time by `hsum8x` (each with `hsum`'s additions),
        /// then the tail of `dot_f32`, then the scale.
        ///
        /// # Safety
        /// As [`scores`], with `q.len() == Q` and `K` 4 (with `Q` even) or a multiple of 8.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn scores_q<const Q: usize, const K: usize>(
            q: &[&[f32]],
            keys: &[f32],
            stride: usize,
            scale: f32,
            s: &mut [&mut [f32]],
        ) {
            let d = q[0].len();
            let d8 = d - d % 8;
            let n = s[0].len();
            let qp: [*const f32; Q] = std::array::from_fn(|r| q[r].as_ptr());
            let kp = keys.as_ptr();
            let mut j = 0;
            while j + K <= n {
                let mut acc = [[_mm256_setzero_ps(); K]; Q];
                let mut k = 0;
                while k < d8 {
                    // SAFETY: k + 8 <= d8 <= d for every query; keys j..j+K are
                    // within the caller's bound.
                    unsafe {
                        let mut qv = [_mm256_setzero_ps(); Q];
                        for r in 0..Q {
                            qv[r] = _mm256_loadu_ps(qp[r].add(k));
                        }
                        for u in 0..K {
                            let kv = _mm256_loadu_ps(kp.add((j + u) * stride + k));
                            for r in 0..Q {
                                acc[r][u] = _mm256_fmadd_ps(qv[r], kv, acc[r][u]);
                            }
                        }
                    }
                    k += 8;
                }
                // The Q x K sums reduced eight at a time: two rows' four (K = 4),
                // or eight of one row (K a multiple of 8). Indices are constants
                // once the loops unroll, so the accumulators stay in registers.
                let vscale = _mm256_set1_ps(scale);
                // Stores eight reduced sums: `v[e]` is row `r + e / w`'s score of
                // key `j + u + e % w`, `w` the sums per row in `v` (4 or 8).
                let mut emit = |v: __m256, r: usize, u: usize, w: usize| {
                    if d8 == d {
                        // SAFETY: keys j + u .. j + u + w are within every score
                        // row (j + K <= n, u + w <= K).
                        unsafe {
                            let v = _mm256_mul_ps(v, vscale);
                            if w == 8 {
                                _mm256_storeu_ps(s[r].as_mut_ptr().add(j + u), v);
                            } else {
                                let (lo, hi) = (_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                                _mm_storeu_ps(s[r].as_mut_ptr().add(j + u), lo);
                                _mm_storeu_ps(s[r + 1].as_mut_ptr().add(j + u), hi);
                            }
                        }
                        return;
                    }
                    let mut each = [0f32; 8];
                    // SAFETY: eight floats into an array of eight.
                    unsafe { _mm256_storeu_ps(each.as_mut_ptr(), v) };
                    for (e, &sum) in each.iter().enumerate() {
                        let (r, u) = (r + e / w, u + e % w);
                        let key = &keys[(j + u) * stride..(j + u) * stride + d];
                        let mut v = sum;
                        for kk in d8..d {
                            v = q[r][kk].mul_add(key[kk], v);
                        }
                        s[r][j + u] = v * scale;
                    }
                };
                if K == 4 {
                    for r in (0..Q).step_by(2) {
                        let (a, b) = (&acc[r], &acc[r + 1]);
                        let eight = [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]];
                        // SAFETY: features as the caller's.
                        emit(unsafe { hsum8x(&eight) }, r, 0, 4);
                    }
                } else {
                    for (r, a) in acc.iter().enumerate() {
                        for h in 0..K / 8 {
                            let o = 8 * h;
                            let eight = [
                                a[o],
                                a[o + 1],
                                a[o + 2],
                                a[o + 3],
                                a[o + 4],
                                a[o + 5],
                                a[o + 6],
                                a[o + 7],
                            ];
                            // SAFETY: features as the caller's.
                            emit(unsafe { hsum8x(&eight) }, r, o, 8);
                        }
                    }
                }
                j += K;
            }
            for jj in j..n {
                let key = &keys[jj * stride..jj * stride + d];
                for r in 0..Q {
                    // SAFETY: features as the caller's; equal lengths.
                    s[r][jj] = unsafe { dot_f32(q[r], key) } * scale;
                }
            }
        }

        /// `Q` rows' weighted sums over the `C` chunks of eight floats from `c0`,
        /// `Q x C` accumulators: each value chunk loaded once for the `Q` rows.
        ///
        /// # Safety
        /// As [`sums`], with `p.len() == Q` and `c0 + 8 * C <= out[r].len()`.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn sums_q<const Q: usize, const C: usize>(
            p: &[&[f32]],
            values: &[f32],
            stride: usize,
            out: &mut [&mut [f32]],
            c0: usize,
        ) {
            let n = p[0].len();
            let pp: [*const f32; Q] = std::array::from_fn(|r| p[r].as_ptr());
            // SAFETY: floats c0..c0 + 8 * C of every output and every value are in
            // bounds (the caller's bound); j < n for every row's weights.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); C]; Q];
                for r in 0..Q {
                    let o = out[r].as_ptr().add(c0);
                    for c in 0..C {
                        acc[r][c] = _mm256_loadu_ps(o.add(8 * c));
                    }
                }
                for j in 0..n {
                    let v = values.as_ptr().add(j * stride + c0);
                    let mut pv = [_mm256_setzero_ps(); Q];
                    for r in 0..Q {
                        pv[r] = _mm256_set1_ps(*pp[r].add(j));
                    }
                    for c in 0..C {
                        let vv = _mm256_loadu_ps(v.add(8 * c));
                        for r in 0..Q {
                            acc[r][c] = _mm256_fmadd_ps(pv[r], vv, acc[r][c]);
                        }
                    }
                }
                for r in 0..Q {
                    let o = out[r].as_mut_ptr().add(c0);
                    for c in 0..C {
                        _mm256_storeu_ps(o.add(8 * c), acc[r][c]);
                    }
                }
            }
        }
    };
}

/// AVX2's 16 registers: two rows at a time.
#[cfg(target_arch = "x86_64")]
mod narrow {
    grouped_kernels!("avx2,fma,f16c", scores: [(2, 4)], sums: [(2, 4)]);
}

/// AVX-512's 32 registers (eight-lane arithmetic): up to four rows at a time.
#[cfg(target_arch = "x86_64")]
mod wide {
    grouped_kernels!(
        "avx2,fma,f16c,avx512f,avx512vl,avx512bw",
        scores: [(2, 8), (3, 8), (4, 4)],
        sums: [(2, 8), (3, 8), (4, 6)]
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Every group size, head size (with and without a tail) and key count gives
    /// each row the bits of the one-row kernels.
    #[test]
    fn grouped_rows_have_the_bits_of_one_row_at_a_time() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for isa in Isa::available() {
            for rows in 1..=6 {
                for (d, n, stride) in [(64, 64, 192), (12, 13, 24), (128, 7, 128), (20, 33, 60)] {
                    let mut r = |len| -> Vec<f32> {
                        (0..len).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
                    };
                    let kv = r((n - 1) * stride + d);
                    let qs: Vec<Vec<f32>> = (0..rows).map(|_| r(d)).collect();
                    let q: Vec<&[f32]> = qs.iter().map(|v| v.as_slice()).collect();
                    let mut got = vec![vec![0f32; n]; rows];
                    let mut s: Vec<&mut [f32]> = got.iter_mut().map(|v| v.as_mut_slice()).collect();
                    scores(isa, &q, &kv, stride, 0.125, &mut s);
                    let start: Vec<Vec<f32>> = (0..rows).map(|_| r(d)).collect();
                    let mut sums = start.clone();
                    let p: Vec<&[f32]> = got.iter().map(|v| v.as_slice()).collect();
                    let mut o: Vec<&mut [f32]> =
                        sums.iter_mut().map(|v| v.as_mut_slice()).collect();
                    weighted_sums(isa, &p, &kv, stride, &mut o);
                    for row in 0..rows {
                        let mut want = vec![0f32; n];
                        attention_scores_isa(
                            Isa::Portable,
                            &qs[row],
                            &kv,
                            stride,
                            0.125,
                            &mut want,
                        );
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&got[row]),
                            bits(&want),
                            "{isa:?} scores, {rows} rows, d {d}, n {n}"
                        );
                        let mut want = start[row].clone();
                        weighted_sum_add_isa(Isa::Portable, &got[row], &kv, stride, &mut want);
                        assert_eq!(
                            bits(&sums[row]),
                            bits(&want),
                            "{isa:?} sums, {rows} rows, d {d}, n {n}"
                        );
                    }
                }
            }
        }
    }
}

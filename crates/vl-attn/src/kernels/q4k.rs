//! vl's q4_K quantizer: the blocks candle's `QTensor::quantize(_,
//! GgmlDType::Q4K)` writes, byte for byte, about eight times faster
//! (vit-gpt2's linear layers: ~4.5 s of CPU in candle, ~0.6 s here).
//!
//! candle's `BlockQ4K::from_float` searches each 32-value sub-block's
//! scale and minimum (`make_qkx1_quants`, five rounds), allocating a
//! buffer per sub-block and rounding every value through libm's `roundf`
//! (x86-64's baseline has no rounding instruction): 80% of a `--quantize
//! q4k` load. This is the same arithmetic in the same order, with the
//! buffers on the stack, sixteen sub-blocks searched side by side, and
//! rounding from `trunc`, compiled per instruction set so that it
//! vectorises; the tests check the bytes against candle's.

use half::f16;

/// Values per q4_K block.
pub(crate) const BLOCK_VALUES: usize = 256;
/// Bytes per q4_K block: `d` and `dmin` (f16), 12 bytes of 6-bit
/// sub-block scales and minimums, 128 bytes of 4-bit values (candle's and
/// ggml's `block_q4_K`).
pub(crate) const BLOCK_BYTES: usize = 144;

/// Quantizes `x` (whole blocks of [`BLOCK_VALUES`]) into `out`
/// ([`BLOCK_BYTES`] per block, as candle keeps `BlockQ4K` in memory),
/// on the calling thread.
///
/// # Panics
/// When `x` is not whole blocks or `out` is not their size (callers
/// check the layer's input width first).
pub(crate) fn quantize(x: &[f32], out: &mut [u8]) {
    assert!(
        x.len().is_multiple_of(BLOCK_VALUES) && out.len() == x.len() / BLOCK_VALUES * BLOCK_BYTES,
        "q4k::quantize: {} values into {} bytes",
        x.len(),
        out.len()
    );
    blocks_on(crate::kernels::CpuFeatures::get().isa(), x, out);
}

crate::kernels::micro::per_isa! {
    /// [`blocks`] compiled for the given instruction set.
    fn blocks_on(x: &[f32], out: &mut [u8]) = blocks::<crate::kernels::micro::Avx512>
}

/// Sub-blocks searched side by side, one per lane: two blocks.
const LANES: usize = 16;

/// Two blocks at a time: their sixteen sub-blocks' searches run in
/// lanes ([`search_lanes`]: each lane's arithmetic is the scalar search's,
/// in its order, so the compiler can vectorise across sub-blocks without
/// changing a bit); a pair holding a NaN, and a last odd block, take the
/// scalar search.
#[inline(always)]
fn blocks<K: crate::kernels::micro::Kernel>(x: &[f32], out: &mut [u8]) {
    let _ = K::FMA;
    let pairs = x.chunks_exact(2 * BLOCK_VALUES);
    let tail = pairs.remainder();
    let mut outs = out.chunks_exact_mut(2 * BLOCK_BYTES);
    for (x, out) in pairs.zip(&mut outs) {
        if x.iter().any(|v| v.is_nan()) {
            for (x, out) in x
                .chunks_exact(BLOCK_VALUES)
                .zip(out.chunks_exact_mut(BLOCK_BYTES))
            {
                block(x, out);
            }
            continue;
        }
        let (scales, mins) = search_lanes(x);
        for (b, (x, out)) in x
            .chunks_exact(BLOCK_VALUES)
            .zip(out.chunks_exact_mut(BLOCK_BYTES))
            .enumerate()
        {
            let sub = b * 8..b * 8 + 8;
            finish(
                x,
                scales[sub.clone()].try_into().expect("8 sub-blocks"),
                mins[sub].try_into().expect("8 sub-blocks"),
                out,
            );
        }
    }
    if !tail.is_empty() {
        block(tail, outs.into_remainder());
    }
}

/// candle's `nearest_int`: to nearest, halves away from zero, saturated
/// to `i32` (NaN to 0).
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    round_away(v) as i32
}

/// `nearest_int(v).clamp(0, nmax)` for `nmax >= 0`, without the
/// saturating float-to-int conversion (which the compiler does not
/// vectorise): NaN goes to 0 (`f32::max` returns the other operand), as
/// it does through `nearest_int`.
#[inline(always)]
fn level(v: f32, nmax: i32) -> i32 {
    let r = round_away(v).max(0.0).min(nmax as f32);
    // SAFETY: `r` is a whole number in [0, nmax], not NaN.
    unsafe { r.to_int_unchecked() }
}

/// `v.round()` (halves away from zero) for every `v`, NaN and infinities
/// included, from operations that vectorise (`round` is a libm call the
/// compiler does not vectorise): `v - trunc(v)` is exact.
#[inline(always)]
fn round_away(v: f32) -> f32 {
    let t = v.trunc();
    if (v - t).abs() >= 0.5 {
        t + 1f32.copysign(v)
    } else {
        t
    }
}

/// [`make_qkx1_quants`]`(15, 5, ·)` of the sixteen sub-blocks of the
/// 512 values `x` (no NaN), lane `l` the sub-block `x[32 l..32 l + 32]`:
/// (scales, negated minimums). Every lane performs the scalar search's
/// operations in its order (sums left to right from `-0.0`, as `Sum`
/// does); a lane that has settled (or whose values are all equal) keeps
/// its result while the others go on. `min_by(total_cmp)` and `<` pick
/// the same values here (no NaN; `-0.0` and `0.0` lead to the same bytes).
#[inline(always)]
fn search_lanes(x: &[f32]) -> ([f32; LANES], [f32; LANES]) {
    const NMAX: i32 = 15;
    let mut xt = [[0f32; LANES]; 32];
    for (l, sub) in x.chunks_exact(32).enumerate() {
        for (i, &v) in sub.iter().enumerate() {
            xt[i][l] = v;
        }
    }
    let (mut min, mut max) = (xt[0], xt[0]);
    for row in &xt[1..] {
        for l in 0..LANES {
            min[l] = if row[l] < min[l] { row[l] } else { min[l] };
            max[l] = if row[l] > max[l] { row[l] } else { max[l] };
        }
    }
    let mut done = [false; LANES];
    let mut flat = [false; LANES];
    let (mut iscale, mut scale) = ([0f32; LANES], [0f32; LANES]);
    for l in 0..LANES {
        flat[l] = max[l] == min[l];
        done[l] = flat[l];
        min[l] = min[l].min(0.);
        iscale[l] = NMAX as f32 / (max[l] - min[l]);
        scale[l] = 1.0 / iscale[l];
    }
    let mut q = [[0u8; LANES]; 32];
    for _ in 0..5 {
        if done.iter().all(|&d| d) {
            break;
        }
        let mut sumlx = [0f32; LANES];
        let mut suml2 = [0i32; LANES];
        let mut changed = [false; LANES];
        for (row, qrow) in xt.iter().zip(q.iter_mut()) {
            for l in 0..LANES {
                let li = level(iscale[l] * (row[l] - min[l]), NMAX);
                changed[l] |= li as u8 != qrow[l];
                qrow[l] = li as u8;
                sumlx[l] += (row[l] - min[l]) * li as f32;
                suml2[l] += li * li;
            }
        }
        let mut new_scale = [0f32; LANES];
        for l in 0..LANES {
            new_scale[l] = sumlx[l] / suml2[l] as f32;
        }
        let mut sum = [-0f32; LANES];
        for (row, qrow) in xt.iter().zip(&q) {
            for l in 0..LANES {
                sum[l] += row[l] - new_scale[l] * qrow[l] as f32;
            }
        }
        for l in 0..LANES {
            if !done[l] {
                scale[l] = new_scale[l];
                min[l] = sum[l] / 32.0;
                if min[l] > 0.0 {
                    min[l] = 0.0;
                }
                iscale[l] = 1.0 / scale[l];
                done[l] = !changed[l];
            }
        }
    }
    let mut neg_min = [0f32; LANES];
    for l in 0..LANES {
        if flat[l] {
            (scale[l], neg_min[l]) = (0.0, 0.0);
        } else {
            neg_min[l] = -min[l];
        }
    }
    (scale, neg_min)
}

/// One block: candle 0.11's `BlockQ4K::from_float`, statement for
/// statement.
#[inline(always)]
fn block(x: &[f32], out: &mut [u8]) {
    let mut mins = [0f32; 8];
    let mut scales = [0f32; 8];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        (scales[j], mins[j]) = make_qkx1_quants(15, 5, sub);
    }
    finish(x, scales, mins, out);
}

/// The rest of `from_float` once the sub-blocks' scales and minimums are
/// known: both quantized to 6 bits under the block's f16 `d` and `dmin`,
/// the values to 4 bits, all packed.
#[inline(always)]
fn finish(x: &[f32], scales: [f32; 8], mins: [f32; 8], out: &mut [u8]) {
    let max_scale = scales.iter().fold(0.0, |max, &val: &f32| val.max(max));
    let max_min = mins.iter().fold(0.0, |max, &val: &f32| val.max(max));
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        let ls = nearest_int(inv_scale * scales[j]).min(63) as u8;
        let lm = nearest_int(inv_min * mins[j]).min(63) as u8;
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    let mut l = [0u8; BLOCK_VALUES];
    for j in 0..8 {
        let (sc, m) = scale_min(j, &packed);
        let dj = d.to_f32() * sc as f32;
        if dj != 0.0 {
            let dm = dmin.to_f32() * m as f32;
            for ii in 0..32 {
                l[32 * j + ii] = level((x[32 * j + ii] + dm) / dj, 15) as u8;
            }
        }
    }
    out[0..2].copy_from_slice(&d.to_bits().to_ne_bytes());
    out[2..4].copy_from_slice(&dmin.to_bits().to_ne_bytes());
    out[4..16].copy_from_slice(&packed);
    let qs = &mut out[16..BLOCK_BYTES];
    for j in (0..BLOCK_VALUES).step_by(64) {
        for v in 0..32 {
            qs[(j / 64) * 32 + v] = l[j + v] | (l[j + v + 32] << 4);
        }
    }
}

/// Sub-block `j`'s 6-bit scale and minimum from the 12 packed bytes.
#[inline(always)]
pub(crate) fn scale_min(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// candle 0.11's `make_qkx1_quants` for one sub-block of up to 32 values
/// (its per-call buffer on the stack): the scale and the negated minimum
/// that `ntry` rounds of alternating least squares settle on.
#[inline(always)]
fn make_qkx1_quants(nmax: i32, ntry: usize, x: &[f32]) -> (f32, f32) {
    let n = x.len();
    let mut l = [0u8; 32];
    let min = *x.iter().min_by(|a, b| a.total_cmp(b)).unwrap_or(&f32::NAN);
    let max = *x.iter().max_by(|a, b| a.total_cmp(b)).unwrap_or(&f32::NAN);
    if max == min {
        return (0.0, 0.0);
    }
    let mut min = min.min(0.);
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    for _ in 0..ntry {
        let mut sumlx = 0.0;
        let mut suml2 = 0;
        let mut did_change = false;
        for (i, value) in x.iter().enumerate() {
            let li = nearest_int(iscale * (value - min)).clamp(0, nmax);
            let clamped_li = li as u8;
            if clamped_li != l[i] {
                l[i] = clamped_li;
                did_change = true;
            }
            sumlx += (value - min) * li as f32;
            suml2 += li * li;
        }
        scale = sumlx / suml2 as f32;
        let sum: f32 = x
            .iter()
            .zip(l.iter())
            .map(|(xi, &li)| xi - scale * li as f32)
            .sum();
        min = sum / n as f32;
        if min > 0.0 {
            min = 0.0;
        }
        iscale = 1.0 / scale;
        if !did_change {
            break;
        }
    }
    (scale, -min)
}

/// Every instruction set this CPU has (for tests: each must give
/// candle's bytes).
#[cfg(test)]
fn isas() -> Vec<crate::kernels::Isa> {
    crate::kernels::CpuFeatures::get().isas()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use proptest::prelude::*;

    /// candle's bytes for `x`.
    fn candle_q4k(x: &[f32]) -> Vec<u8> {
        let t = Tensor::from_slice(x, (x.len() / BLOCK_VALUES, BLOCK_VALUES), &Device::Cpu)
            .expect("tensor");
        QTensor::quantize(&t, GgmlDType::Q4K)
            .expect("quantize")
            .data()
            .expect("data")
            .into_owned()
    }

    fn check(x: &[f32]) {
        let want = candle_q4k(x);
        for isa in isas() {
            let mut got = vec![0u8; want.len()];
            blocks_on(isa, x, &mut got);
            for (b, (g, w)) in got
                .chunks(BLOCK_BYTES)
                .zip(want.chunks(BLOCK_BYTES))
                .enumerate()
            {
                assert_eq!(g, w, "{isa:?}: block {b} differs from candle's");
            }
        }
        let mut got = vec![0u8; want.len()];
        quantize(x, &mut got);
        assert_eq!(got, want);
    }

    /// A deterministic pseudo-normal sequence (no rand dependency).
    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        (0..n)
            .map(|_| {
                let mut u = 0f32;
                for _ in 0..4 {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    u += (s >> 40) as f32 / (1u64 << 24) as f32;
                }
                (u - 2.0) * scale
            })
            .collect()
    }

    #[test]
    fn blocks_are_candles_on_weights_of_every_scale() {
        for (seed, scale) in [(1, 1.0), (2, 0.02), (3, 1e-3), (4, 300.0), (5, 1e-30)] {
            check(&values(BLOCK_VALUES * 24, seed, scale));
        }
    }

    #[test]
    fn blocks_are_candles_at_the_edges() {
        let mut cases: Vec<Vec<f32>> = vec![
            vec![0.0; BLOCK_VALUES],
            vec![1.5; BLOCK_VALUES],
            vec![-2.0; BLOCK_VALUES],
            values(BLOCK_VALUES, 7, 1.0)
                .iter()
                .map(|v| v.abs() + 1.0)
                .collect(),
            values(BLOCK_VALUES, 8, 1.0)
                .iter()
                .map(|v| -v.abs() - 1.0)
                .collect(),
            (0..BLOCK_VALUES)
                .map(|i| if i % 2 == 0 { 0.0 } else { -0.0 })
                .collect(),
            (0..BLOCK_VALUES)
                .map(|i| if i == 17 { 1.0 } else { 0.0 })
                .collect(),
            (0..BLOCK_VALUES).map(|i| (i % 16) as f32).collect(),
            (0..BLOCK_VALUES).map(|i| (i % 16) as f32 - 7.5).collect(),
            // Halves from 0 to 15: ties in the first round of each
            // sub-block's search (rounded away from zero, not to even).
            (0..BLOCK_VALUES)
                .map(|i| (i % 32).min(30) as f32 * 0.5)
                .collect(),
            (0..BLOCK_VALUES)
                .map(|i| f32::MIN_POSITIVE * i as f32 / 3.0)
                .collect(),
            (0..BLOCK_VALUES)
                .map(|i| if i % 3 == 0 { 3e38 } else { -1e38 })
                .collect(),
        ];
        // One odd value among normal ones: infinite and NaN weights round
        // as candle rounds them too.
        for odd in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut v = values(BLOCK_VALUES, 9, 1.0);
            v[40] = odd;
            cases.push(v);
        }
        // Each case alone (the scalar search of a last odd block), then
        // beside an ordinary block on either side (the lanes, or the
        // scalar search for a pair holding a NaN), then all in a row.
        let plain = values(BLOCK_VALUES, 10, 1.0);
        for (i, x) in cases.iter().enumerate() {
            let want = candle_q4k(x);
            for isa in isas() {
                let mut got = vec![0u8; BLOCK_BYTES];
                blocks_on(isa, x, &mut got);
                assert_eq!(got, want, "case {i}, {isa:?}");
            }
            check(&[x.as_slice(), &plain].concat());
            check(&[plain.as_slice(), x].concat());
        }
        check(&cases.concat());
        check(
            &[plain.clone()]
                .iter()
                .chain(&cases)
                .flatten()
                .copied()
                .collect::<Vec<f32>>(),
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn blocks_are_candles_on_any_values(
            x in proptest::collection::vec(-1e4f32..1e4, BLOCK_VALUES * 2),
            scale in prop_oneof![Just(1.0f32), Just(1e-3), Just(1e3)],
        ) {
            let x: Vec<f32> = x.iter().map(|v| v * scale).collect();
            check(&x);
        }
    }

    #[test]
    #[should_panic(expected = "q4k::quantize: 100 values into 144 bytes")]
    fn partial_blocks_are_refused() {
        quantize(&[0.0; 100], &mut [0u8; BLOCK_BYTES]);
    }
}

//! Keys and values in 8 bits: each head's row of `head_dim` values (a
//! multiple of 32) as `head_dim / 32` blocks of GGML's `block_q8_0` — an
//! f16 scale `d` (little-endian) and 32 signed bytes `q`, the values
//! `d · q`. Half the bytes of bf16 (34 against 64 a block), what a decode
//! step's attention reads from a cache of many images or long texts.
//!
//! The rounding of a block: `d = max |x| / 127`, `q = round(x / d)` to
//! the nearest, ties to even (`x · (1 / d)`, as GGML's SIMD quantizer
//! computes it), `d` kept as f16 (2^-11 relative; below a largest value
//! of 2^-14 · 127 ≈ 0.0078, an f16 subnormal, 2^-25 absolute). A block holding a NaN or an infinity
//! gets a NaN scale, so that it reads back as NaN rather than as finite
//! values that were never there; one whose scale passes f16's range
//! (values past 65504 · 127) reads back as infinities.
//!
//! [`quantize`] (AVX-512F, portable) and [`widen`] (portable, vectorised
//! by the compiler) run on the rayon pool; the per-row attention kernel
//! (`attention`) reads the blocks in place.

use half::f16;
use rayon::prelude::*;

use super::features::Isa;
#[cfg(target_arch = "x86_64")]
use super::features::Simd;

/// Values per block.
pub const BLOCK_VALUES: usize = 32;

/// Bytes per block: the f16 scale and the 32 values.
pub const BLOCK_BYTES: usize = 2 + BLOCK_VALUES;

/// Blocks per task of [`quantize`] and [`widen`].
const TASK_BLOCKS: usize = 1024;

/// The bytes of a row of `head_dim` values (a multiple of
/// [`BLOCK_VALUES`]).
pub const fn row_bytes(head_dim: usize) -> usize {
    head_dim / BLOCK_VALUES * BLOCK_BYTES
}

/// The values of a row of `bytes` bytes, `None` when that is not a whole
/// number of blocks.
pub const fn row_values(bytes: usize) -> Option<usize> {
    if bytes.is_multiple_of(BLOCK_BYTES) {
        Some(bytes / BLOCK_BYTES * BLOCK_VALUES)
    } else {
        None
    }
}

/// The scale of the block at `block` (its first two bytes), as f32.
#[inline(always)]
pub(crate) fn scale(block: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([block[0], block[1]])).to_f32()
}

/// One block of `x` (32 values) into `out` (34 bytes), portably.
fn block_plain(x: &[f32], out: &mut [u8]) {
    let finite = x.iter().all(|v| v.is_finite());
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let stored = if finite { d } else { f32::NAN };
    out[..2].copy_from_slice(&f16::from_f32(stored).to_bits().to_le_bytes());
    for (o, &v) in out[2..].iter_mut().zip(x) {
        // `as` saturates; a finite block's values are within ±127.
        *o = ((v * id).round_ties_even() as i8) as u8;
    }
}

/// [`block_plain`] with AVX-512F: the same bytes.
///
/// # Safety
/// The CPU has AVX-512F; `x` holds 32 values and `out` 34 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn block_avx512(x: &[f32], out: &mut [u8]) {
    use std::arch::x86_64::*;
    debug_assert!(x.len() >= BLOCK_VALUES && out.len() >= BLOCK_BYTES);
    // SAFETY: 32 values readable at `x`, 34 bytes writable at `out`.
    unsafe {
        let x0 = _mm512_loadu_ps(x.as_ptr());
        let x1 = _mm512_loadu_ps(x.as_ptr().add(16));
        // Exponent bits all set: an infinity or a NaN.
        let exp = _mm512_set1_epi32(0x7F80_0000);
        let special =
            |v: __m512| _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), exp), exp);
        let finite = special(x0) | special(x1) == 0;
        // `max` of the absolute values is exact, in any order: the plain
        // fold's value (no NaN in a finite block).
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let stored = if finite { d } else { f32::NAN };
        out[..2].copy_from_slice(&f16::from_f32(stored).to_bits().to_le_bytes());
        let idv = _mm512_set1_ps(id);
        // The default rounding (to nearest, ties to even); saturated to
        // i8 as `as` saturates (NaN aside, which a finite block lacks).
        let q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, idv));
        let q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, idv));
        _mm_storeu_si128(out.as_mut_ptr().add(2).cast(), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128(out.as_mut_ptr().add(18).cast(), _mm512_cvtsepi32_epi8(q1));
        if !finite {
            // NaN products convert to i32::MIN; the plain code's `as`
            // gives 0. The scale is NaN either way: keep the bytes alike.
            for (o, &v) in out[2..BLOCK_BYTES].iter_mut().zip(x) {
                *o = ((v * id).round_ties_even() as i8) as u8;
            }
        }
    }
}

/// The blocks of `x` (a whole number of 32-value blocks) on `isa`, split
/// across the rayon pool.
///
/// # Panics
/// If `x.len()` is not a multiple of [`BLOCK_VALUES`].
pub fn quantize(x: &[f32], isa: Isa) -> Vec<u8> {
    assert!(
        x.len().is_multiple_of(BLOCK_VALUES),
        "q8 keys and values: {} values are not whole blocks of {BLOCK_VALUES}",
        x.len()
    );
    let blocks = x.len() / BLOCK_VALUES;
    let mut out = vec![0u8; blocks * BLOCK_BYTES];
    out.par_chunks_mut(TASK_BLOCKS * BLOCK_BYTES)
        .zip(x.par_chunks(TASK_BLOCKS * BLOCK_VALUES))
        .for_each(|(o, x)| {
            let pairs = o
                .chunks_exact_mut(BLOCK_BYTES)
                .zip(x.chunks_exact(BLOCK_VALUES));
            match isa.simd() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the token proves AVX-512F; whole blocks.
                Simd::Avx512 => pairs.for_each(|(o, x)| unsafe { block_avx512(x, o) }),
                _ => pairs.for_each(|(o, x)| block_plain(x, o)),
            }
        });
    out
}

/// The values of `blocks` (whole blocks), split across the rayon pool.
///
/// # Panics
/// If `blocks.len()` is not a multiple of [`BLOCK_BYTES`].
pub fn widen(blocks: &[u8]) -> Vec<f32> {
    assert!(
        blocks.len().is_multiple_of(BLOCK_BYTES),
        "q8 keys and values: {} bytes are not whole blocks of {BLOCK_BYTES}",
        blocks.len()
    );
    let mut out = vec![0f32; blocks.len() / BLOCK_BYTES * BLOCK_VALUES];
    out.par_chunks_mut(TASK_BLOCKS * BLOCK_VALUES)
        .zip(blocks.par_chunks(TASK_BLOCKS * BLOCK_BYTES))
        .for_each(|(o, b)| {
            for (o, b) in o
                .chunks_exact_mut(BLOCK_VALUES)
                .zip(b.chunks_exact(BLOCK_BYTES))
            {
                let d = scale(b);
                for (o, &q) in o.iter_mut().zip(&b[2..]) {
                    *o = d * f32::from(q as i8);
                }
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::CpuFeatures;

    /// A sweep of blocks: random scales, ties, zeros, the largest and
    /// smallest magnitudes, infinities and NaNs.
    fn cases() -> Vec<f32> {
        let mut x = Vec::new();
        let mut s = 0x2545_f491_u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        for b in 0..200 {
            let scale = 10f32.powi(b % 9 - 4);
            x.extend((0..BLOCK_VALUES).map(|_| next() * scale));
        }
        // Ties: 127 · k / 2 over an absolute maximum of 127.
        x.extend((0..BLOCK_VALUES).map(|i| i as f32 * 0.5 - 8.0));
        x[200 * BLOCK_VALUES + 31] = 127.0;
        x.extend([0f32; BLOCK_VALUES]);
        x.extend([1e-30f32; BLOCK_VALUES]);
        x.extend([-3e9f32; BLOCK_VALUES]);
        for special in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut b: Vec<f32> = (0..BLOCK_VALUES).map(|i| i as f32).collect();
            b[7] = special;
            x.extend(b);
        }
        x
    }

    #[test]
    fn every_isa_rounds_as_the_plain_code() {
        let x = cases();
        let plain = quantize(&x, Isa::portable());
        // Whole blocks, one task or several.
        let long: Vec<f32> = x.iter().cycle().take(x.len() * 8).copied().collect();
        let long_plain = quantize(&long, Isa::portable());
        for isa in CpuFeatures::get().isas() {
            assert_eq!(quantize(&x, isa), plain, "{isa:?}");
            assert_eq!(quantize(&long, isa), long_plain, "{isa:?}");
        }
    }

    #[test]
    fn blocks_read_back_within_half_a_step() {
        let x = cases();
        let back = widen(&quantize(&x, Isa::portable()));
        for (i, (b, v)) in back
            .chunks(BLOCK_VALUES)
            .zip(x.chunks(BLOCK_VALUES))
            .enumerate()
        {
            if v.iter().any(|x| !x.is_finite()) {
                assert!(b.iter().all(|x| x.is_nan()), "block {i}: {b:?}");
                continue;
            }
            let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            // Half a step of the stored scale, plus the scale's own
            // rounding to f16 over the 127 steps of the largest value
            // (2^-11 relative; absolute below 2^-14, f16's subnormals).
            let (d, stored) = (amax / 127.0, scale(&quantize(v, Isa::portable())));
            if d > f16::MAX.to_f32() {
                // Past f16's range: read back as infinities, never as
                // finite values that were not there.
                assert!(b.iter().all(|x| !x.is_finite()), "block {i}: {b:?}");
                continue;
            }
            let bound = stored * 0.5 + (stored - d).abs() * 127.0;
            for (g, w) in b.iter().zip(v) {
                assert!(
                    (g - w).abs() <= bound * (1.0 + 1e-6),
                    "block {i}: {g} against {w} (max {amax})"
                );
            }
            assert!((stored - d).abs() <= (d * 2f32.powi(-11)).max(2f32.powi(-25)));
        }
        // The tie block: x / d = k / 2 rounds to even.
        let ties = quantize(&x[200 * BLOCK_VALUES..201 * BLOCK_VALUES], Isa::portable());
        assert_eq!(scale(&ties), 1.0);
        assert_eq!(ties[2 + 1] as i8, -8, "-7.5 to even");
        assert_eq!(ties[2 + 3] as i8, -6, "-6.5 to even");
        // Zeros: a zero scale, zero values.
        let zeros = quantize(&[0f32; BLOCK_VALUES], Isa::portable());
        assert!(zeros.iter().all(|&b| b == 0));
    }

    #[test]
    #[should_panic(expected = "not whole blocks")]
    fn a_partial_block_is_refused() {
        quantize(&[1f32; 33], Isa::portable());
    }

    #[test]
    fn sizes() {
        assert_eq!(row_bytes(64), 68);
        assert_eq!(row_values(68), Some(64));
        assert_eq!(row_values(64), None);
    }
}

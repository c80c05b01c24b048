//! Depth-wise 2-D convolution of channels-last maps (stride 1, zero
//! padding), the residual added in the same pass: DaViT's position
//! encodings, 48 of them per Florence-2 image.
//!
//! candle runs a convolution of `groups = channels` as one convolution per
//! channel (an im2col and a product of one row each), on channels-first
//! maps that the rest of a DaViT block holds channels-last. Here each
//! output row is a sum of `k × k` shifted input rows scaled per channel:
//! the innermost loop runs over a chunk of 16 channels, contiguous in both
//! the input and the transposed weight, summed in registers and stored
//! once per pixel; rows split across the rayon pool. Plain Rust compiled
//! per instruction set (AVX-512F, AVX2, the baseline: each vectorised by
//! the compiler, the same additions in the same order), tested against
//! candle's grouped convolution.

use crate::kernels::micro::Kernel;
use crate::kernels::{CpuFeatures, Isa};

/// The sizes of one depth-wise convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DwShape {
    /// Images.
    pub batch: usize,
    /// Rows of the map.
    pub height: usize,
    /// Columns of the map.
    pub width: usize,
    /// Channels (one filter each).
    pub channels: usize,
    /// Filter height and width (odd; padding `kernel / 2` keeps the size).
    pub kernel: usize,
}

/// `out = conv(x) + bias (+ x when residual)` over `x: (batch, height,
/// width, channels)` with `taps: (kernel * kernel, channels)` (the
/// weight `(channels, 1, k, k)` transposed to tap-major), zero padding
/// `kernel / 2` on each side.
///
/// # Panics
/// When the slices' lengths do not match `shape` (the caller's checks).
pub fn depthwise_nhwc(
    x: &[f32],
    taps: &[f32],
    bias: Option<&[f32]>,
    shape: DwShape,
    residual: bool,
) -> Vec<f32> {
    depthwise_nhwc_on(CpuFeatures::get().isa(), x, taps, bias, shape, residual)
}

/// [`depthwise_nhwc`] on the instruction set `isa` names.
fn depthwise_nhwc_on(
    isa: Isa,
    x: &[f32],
    taps: &[f32],
    bias: Option<&[f32]>,
    shape: DwShape,
    residual: bool,
) -> Vec<f32> {
    let DwShape {
        batch,
        height,
        width,
        channels: c,
        kernel: k,
    } = shape;
    assert_eq!(x.len(), batch * height * width * c, "depthwise_nhwc: x");
    assert_eq!(taps.len(), k * k * c, "depthwise_nhwc: taps");
    if let Some(b) = bias {
        assert_eq!(b.len(), c, "depthwise_nhwc: bias");
    }
    let row = width * c;
    crate::kernels::host::par_filled(x.len(), row, |r, out_row| {
        let (img, y) = (r / height, r % height);
        let image = &x[img * height * row..(img + 1) * height * row];
        output_row(isa, image, taps, bias, shape, residual, y, out_row);
    })
}

/// Channels per register-held chunk of an output pixel (an AVX-512
/// register of f32).
const LANES: usize = 16;

/// Output row `y` of one image (`image: (height, width, channels)`): per
/// pixel and chunk of [`LANES`] channels, the bias, the residual and the
/// `k²` taps summed in registers and stored once, in the order the
/// portable loop adds them (so every instruction set gives the same
/// values).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn output_row_on<K: Kernel>(
    image: &[f32],
    taps: &[f32],
    bias: Option<&[f32]>,
    shape: DwShape,
    residual: bool,
    y: usize,
    out_row: &mut [f32],
) {
    let _ = K::FMA;
    let DwShape {
        height,
        width,
        channels: c,
        kernel: k,
        ..
    } = shape;
    let pad = k / 2;
    // The filter rows that fall inside the map for this output row.
    let ky0 = pad.saturating_sub(y);
    let ky1 = (height + pad - y).min(k);
    let full = c - c % LANES;
    // Per pixel, where each tap inside the map reads the input and the
    // filter, listed once (in the order the taps are added) and then
    // used by every chunk of channels: an index computation per tap and
    // chunk was most of the kernel's work.
    let mut offsets: Vec<(usize, usize)> = Vec::with_capacity(k * k);
    for (px, o) in out_row.chunks_exact_mut(c).enumerate() {
        let kx0 = pad.saturating_sub(px);
        let kx1 = (width + pad - px).min(k);
        offsets.clear();
        for ky in ky0..ky1 {
            for kx in kx0..kx1 {
                let at = ((y + ky - pad) * width + px + kx - pad) * c;
                offsets.push((at, (ky * k + kx) * c));
            }
        }
        let centre = (y * width + px) * c;
        for c0 in (0..full).step_by(LANES) {
            let mut acc = [0f32; LANES];
            if let Some(b) = bias {
                acc = b[c0..c0 + LANES].try_into().expect("a full chunk");
            }
            if residual {
                let xin: &[f32; LANES] = image[centre + c0..][..LANES]
                    .try_into()
                    .expect("a full chunk");
                for i in 0..LANES {
                    acc[i] += xin[i];
                }
            }
            for &(at, tap) in &offsets {
                let src: &[f32; LANES] =
                    image[at + c0..][..LANES].try_into().expect("a full chunk");
                let w: &[f32; LANES] = taps[tap + c0..][..LANES].try_into().expect("a full chunk");
                for i in 0..LANES {
                    acc[i] += src[i] * w[i];
                }
            }
            o[c0..c0 + LANES].copy_from_slice(&acc);
        }
        // The last channels, fewer than a chunk, one at a time.
        for ch in full..c {
            let mut acc = bias.map_or(0.0, |b| b[ch]);
            if residual {
                acc += image[centre + ch];
            }
            for &(at, tap) in &offsets {
                acc += image[at + ch] * taps[tap + ch];
            }
            o[ch] = acc;
        }
    }
}

crate::kernels::micro::per_isa! {
    /// [`output_row_on`] compiled for the given instruction set.
    #[allow(clippy::too_many_arguments)]
    fn output_row(
        image: &[f32],
        taps: &[f32],
        bias: Option<&[f32]>,
        shape: DwShape,
        residual: bool,
        y: usize,
        out_row: &mut [f32],
    ) = output_row_on::<crate::kernels::micro::Avx512>
}

/// The weight of a depth-wise convolution as stored, `(channels, 1, k, k)`
/// row-major, transposed to the tap-major `(k * k, channels)` that
/// [`depthwise_nhwc`] reads.
pub fn taps_of(weight: &[f32], channels: usize, kernel: usize) -> Vec<f32> {
    let kk = kernel * kernel;
    let mut taps = vec![0f32; kk * channels];
    for ch in 0..channels {
        for t in 0..kk {
            taps[t * channels + ch] = weight[ch * kk + t];
        }
    }
    taps
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction set the CPU runs gives the portable loop's bits,
    /// and those are a direct sum over the taps: channel counts around the
    /// chunk of 16, maps smaller than the filter, with and without bias
    /// and residual.
    #[test]
    fn every_isa_gives_the_direct_sum() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        for &(batch, height, width, channels, kernel, with_bias, residual) in &[
            (1, 5, 6, 16, 3, true, true),
            (2, 3, 4, 37, 3, false, true),
            (1, 2, 1, 7, 5, true, false),
            (1, 4, 4, 48, 3, true, true),
        ] {
            let shape = DwShape {
                batch,
                height,
                width,
                channels,
                kernel,
            };
            let x: Vec<f32> = (0..batch * height * width * channels)
                .map(|_| next())
                .collect();
            let taps: Vec<f32> = (0..kernel * kernel * channels).map(|_| next()).collect();
            let b: Vec<f32> = (0..channels).map(|_| next()).collect();
            let bias = with_bias.then_some(b.as_slice());
            let portable = depthwise_nhwc_on(Isa::portable(), &x, &taps, bias, shape, residual);
            // The direct sum, in f64.
            let pad = (kernel / 2) as isize;
            for (i, &got) in portable.iter().enumerate() {
                let ch = i % channels;
                let px = (i / channels) % width;
                let y = (i / channels / width) % height;
                let img = i / channels / width / height;
                let mut want = bias.map_or(0.0, |b| b[ch] as f64);
                if residual {
                    want += x[i] as f64;
                }
                for ky in 0..kernel as isize {
                    for kx in 0..kernel as isize {
                        let (iy, ix) = (y as isize + ky - pad, px as isize + kx - pad);
                        if iy < 0 || ix < 0 || iy >= height as isize || ix >= width as isize {
                            continue;
                        }
                        let at =
                            ((img * height + iy as usize) * width + ix as usize) * channels + ch;
                        let tap = (ky as usize * kernel + kx as usize) * channels + ch;
                        want += x[at] as f64 * taps[tap] as f64;
                    }
                }
                assert!(
                    (got as f64 - want).abs() <= 1e-5,
                    "{shape:?} at {i}: {got} vs {want}"
                );
            }
            for isa in CpuFeatures::get().isas() {
                let got = depthwise_nhwc_on(isa, &x, &taps, bias, shape, residual);
                assert!(
                    got.iter()
                        .zip(&portable)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa:?} differs from the portable loop on {shape:?}"
                );
            }
        }
    }
}

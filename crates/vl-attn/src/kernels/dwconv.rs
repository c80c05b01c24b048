//! Depth-wise 2-D convolution of channels-last maps (stride 1, zero
//! padding), the residual added in the same pass: DaViT's position
//! encodings, 48 of them per Florence-2 image.
//!
//! candle runs a convolution of `groups = channels` as one convolution per
//! channel (an im2col and a product of one row each), on channels-first
//! maps that the rest of a DaViT block holds channels-last. Here each
//! output row is a sum of `k × k` shifted input rows scaled per channel:
//! the innermost loop runs over the channels, contiguous in both the input
//! and the transposed weight, which the compiler vectorises; rows split
//! across the rayon pool. Plain Rust only: it is also its own portable
//! implementation, tested against candle's grouped convolution.

use rayon::prelude::*;

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
    let pad = k / 2;
    let row = width * c;
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(row)
        .enumerate()
        .for_each(|(r, out_row)| {
            let (img, y) = (r / height, r % height);
            let image = &x[img * height * row..(img + 1) * height * row];
            // Start from the bias and the residual.
            for (px, o) in out_row.chunks_exact_mut(c).enumerate() {
                match bias {
                    Some(b) => o.copy_from_slice(b),
                    None => o.fill(0.0),
                }
                if residual {
                    let xin = &image[y * row + px * c..][..c];
                    for (o, v) in o.iter_mut().zip(xin) {
                        *o += v;
                    }
                }
            }
            for ky in 0..k {
                let Some(iy) = (y + ky).checked_sub(pad).filter(|&iy| iy < height) else {
                    continue;
                };
                let in_row = &image[iy * row..(iy + 1) * row];
                for kx in 0..k {
                    let w = &taps[(ky * k + kx) * c..][..c];
                    // Output columns whose input column `x + kx - pad` exists.
                    let first = pad.saturating_sub(kx);
                    let last = (width + pad).saturating_sub(kx).min(width);
                    for px in first..last {
                        let ix = px + kx - pad;
                        let src = &in_row[ix * c..][..c];
                        let dst = &mut out_row[px * c..][..c];
                        for ((d, s), w) in dst.iter_mut().zip(src).zip(w) {
                            *d += s * w;
                        }
                    }
                }
            }
        });
    out
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

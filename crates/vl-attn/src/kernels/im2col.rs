//! The patches of a strided convolution over a channels-last map, one row
//! per output position (im2col), so that the convolution is a product
//! with its weight `(out, in · k · k)` — on vl's products, dense, bf16 or
//! quantized ([`crate::layers::conv::PatchConv`]).
//!
//! candle's CPU convolution takes channels-first maps and an f32 weight,
//! and gathers its patches element by element: for DaViT's four patch
//! embeddings that gather cost as much as the product (16% of a
//! Florence-2 encode, both together). A row's columns are in the weight's
//! own order, channel-major (`c · k² + ky · k + kx`), so that the stored
//! weight, flattened, is the product's matrix as it is; each tap of an
//! output position copies the `c` contiguous values of one input pixel.
//! Plain Rust, rows split across the rayon pool.

/// The sizes of one strided convolution's patches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PatchShape {
    /// Images.
    pub batch: usize,
    /// Rows of the input map.
    pub height: usize,
    /// Columns of the input map.
    pub width: usize,
    /// Channels of the input map.
    pub channels: usize,
    /// Filter height and width.
    pub kernel: usize,
    /// Step between output positions, in both directions.
    pub stride: usize,
    /// Zero padding on each side.
    pub padding: usize,
}

impl PatchShape {
    /// The output map's `(rows, columns)`: `(side + 2 · padding − kernel)
    /// / stride + 1` each, `None` when the padded map is smaller than the
    /// filter or the stride is 0.
    pub fn output(&self) -> Option<(usize, usize)> {
        let side = |n: usize| {
            (n + 2 * self.padding)
                .checked_sub(self.kernel)
                .filter(|_| self.stride > 0)
                .map(|d| d / self.stride + 1)
        };
        Some((side(self.height)?, side(self.width)?))
    }

    /// Columns of a patch row: `channels · kernel²`.
    pub fn columns(&self) -> usize {
        self.channels * self.kernel * self.kernel
    }
}

/// The patches of `x: (batch, height, width, channels)` as `(batch ·
/// out_h · out_w, channels · kernel²)` rows, columns channel-major (`c ·
/// k² + ky · k + kx`), the padding's taps zero.
///
/// # Panics
/// When `x`'s length does not match `shape` or the output is empty (the
/// caller's checks).
pub fn patches_nhwc(x: &[f32], shape: PatchShape) -> Vec<f32> {
    let PatchShape {
        batch,
        height,
        width,
        channels: c,
        kernel: k,
        stride,
        padding: pad,
    } = shape;
    assert_eq!(x.len(), batch * height * width * c, "patches_nhwc: x");
    let (oh, ow) = shape.output().expect("patches_nhwc: an empty output");
    let kk = k * k;
    let cols = c * kk;
    // Each row zeroed by its task (the padding's taps stay zero).
    crate::kernels::host::par_filled(batch * oh * ow * cols, ow * cols, |r, out_row| {
        let (img, oy) = (r / oh, r % oh);
        let image = &x[img * height * width * c..][..height * width * c];
        for (ox, patch) in out_row.chunks_exact_mut(cols).enumerate() {
            for ky in 0..k {
                let Some(iy) = (oy * stride + ky)
                    .checked_sub(pad)
                    .filter(|&iy| iy < height)
                else {
                    continue;
                };
                for kx in 0..k {
                    let Some(ix) = (ox * stride + kx).checked_sub(pad).filter(|&ix| ix < width)
                    else {
                        continue;
                    };
                    let src = &image[(iy * width + ix) * c..][..c];
                    let tap = ky * k + kx;
                    for (ch, &v) in src.iter().enumerate() {
                        patch[ch * kk + tap] = v;
                    }
                }
            }
        }
    })
}

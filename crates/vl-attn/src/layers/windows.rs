//! Window attention's token order: a map of `hp × wp` tokens, rolled by
//! `-shift` on both axes (Swin's shifted windows; 0 for plain windows),
//! cut into `window × window` windows, window by window and row by row —
//! what transformers writes as `torch.roll`, a view and a permute.
//!
//! [`WindowOrder::split_heads`] takes a projection's output in map order
//! straight to the attention's `(windows, heads, window², head_dim)`
//! layout, and [`WindowOrder::merge_heads`] takes the attention's output
//! back to map order: one pass each way. On the CPU in f32 these are
//! single gathers of whole head rows; the obvious composition of candle's
//! ops (window permute, then each of q, k, v and the output transposed to
//! heads) copied the map six times per block, element by element where the
//! head width is small — 10% of a Florence-2 encode (DaViT's heads are 32
//! wide). Elsewhere the same values come from candle's ops.

use candle_core::{DType, Device, Tensor};

use crate::error::{AttnError, Result};
use crate::kernels::host::par_filled;
use crate::kernels::with_values;
use crate::layers::proj::Proj;

const MODULE: &str = "WindowOrder";

/// Where each token of a `hp × wp` map goes when it is rolled by `-shift`
/// and cut into `window × window` windows.
#[derive(Debug, Clone)]
pub struct WindowOrder {
    hp: usize,
    wp: usize,
    window: usize,
    /// `(hp · wp)`: the map token at each window-order position.
    gather: Vec<u32>,
    /// `(hp · wp)`: the window-order position of each map token.
    scatter: Vec<u32>,
}

impl WindowOrder {
    /// The order of a `hp × wp` map in `window × window` windows, rolled by
    /// `-shift` first (token `(y, x)` of the rolled map is token `((y +
    /// shift) mod hp, (x + shift) mod wp)` of the map).
    ///
    /// # Errors
    /// [`AttnError::Config`] for a window of 0, a side that is not a
    /// multiple of it, or a map of more tokens than `u32` counts.
    pub fn new(hp: usize, wp: usize, window: usize, shift: usize) -> Result<Self> {
        if window == 0
            || hp == 0
            || wp == 0
            || !hp.is_multiple_of(window)
            || !wp.is_multiple_of(window)
        {
            return Err(AttnError::Config {
                module: MODULE,
                reason: format!(
                    "a {hp} × {wp} map is not whole windows of {window} × {window} (pad it first)"
                ),
            });
        }
        if u32::try_from(hp * wp).is_err() {
            return Err(AttnError::Config {
                module: MODULE,
                reason: format!("a {hp} × {wp} map has more tokens than u32 counts"),
            });
        }
        let (nh, nw) = (hp / window, wp / window);
        let mut gather = Vec::with_capacity(hp * wp);
        for wy in 0..nh {
            for wx in 0..nw {
                for yy in 0..window {
                    for xx in 0..window {
                        let y = (wy * window + yy + shift) % hp;
                        let x = (wx * window + xx + shift) % wp;
                        gather.push((y * wp + x) as u32);
                    }
                }
            }
        }
        let mut scatter = vec![0u32; hp * wp];
        for (at, &token) in gather.iter().enumerate() {
            scatter[token as usize] = at as u32;
        }
        Ok(Self {
            hp,
            wp,
            window,
            gather,
            scatter,
        })
    }

    /// Tokens per window, `window²`.
    pub fn window_len(&self) -> usize {
        self.window * self.window
    }

    /// Windows per image.
    pub fn windows(&self) -> usize {
        (self.hp / self.window) * (self.wp / self.window)
    }

    /// Columns `offset .. offset + heads · head_dim` of each token of `x`
    /// (`(b, hp, wp, width)` or `(b, hp · wp, width)`, map order, such as
    /// a fused q/k/v projection's output), windowed and split into heads:
    /// `(b · windows, heads, window², head_dim)`, contiguous. Image `i`'s
    /// window `w` is sample `i · windows + w`.
    ///
    /// # Errors
    /// An `x` of another token count, too narrow for the columns, or a
    /// `head_dim` of 0, named.
    pub fn split_heads(
        &self,
        x: &Tensor,
        offset: usize,
        heads: usize,
        head_dim: usize,
    ) -> Result<Tensor> {
        let (b, width) = self.check(x, "x")?;
        let inner = heads * head_dim;
        if inner == 0 || offset + inner > width {
            return Err(AttnError::Config {
                module: MODULE,
                reason: format!(
                    "split_heads: columns {offset}..{} ({heads} heads of {head_dim}) of x {:?} (width {width})",
                    offset + inner,
                    x.dims()
                ),
            });
        }
        let t = self.window_len();
        let n = b * self.windows();
        if on_host(x) {
            let tokens = self.hp * self.wp;
            let per_window = heads * t * head_dim;
            let out = with_values(x, |values: &[f32]| {
                par_filled(n * per_window, per_window, |sample, dst| {
                    let (img, w) = (sample / self.windows(), sample % self.windows());
                    for i in 0..t {
                        let token = self.gather[w * t + i] as usize;
                        let src = &values[(img * tokens + token) * width + offset..][..inner];
                        for (h, part) in src.chunks_exact(head_dim).enumerate() {
                            dst[(h * t + i) * head_dim..][..head_dim].copy_from_slice(part);
                        }
                    }
                })
            })?;
            return Ok(Tensor::from_vec(out, (n, heads, t, head_dim), x.device())?);
        }
        let gather = self.index(&self.gather, x.device())?;
        Ok(x.reshape((b, self.hp * self.wp, width))?
            .narrow(2, offset, inner)?
            .contiguous()?
            .index_select(&gather, 1)?
            .reshape((n, t, heads, head_dim))?
            .transpose(1, 2)?
            .contiguous()?)
    }

    /// A fused q/k/v projection of `x` (`(b, hp, wp, width)` or `(b, hp ·
    /// wp, width)`, map order) straight to the attention's layout: `[q, k,
    /// v]`, each `(b · windows, heads, window², head_dim)` — the values of
    /// [`WindowOrder::split_heads`] on `proj.forward(x)` at offsets 0,
    /// `heads · head_dim` and twice that — stored there by the product
    /// itself, where the projection's output in map order (3× the map)
    /// was written, then copied three times (in a Florence-2 q8_0 encode,
    /// a quarter of DaViT's first-stage window attention). `None` where
    /// that does not apply: a projection not held in vl's q8_0 or q4k
    /// tiles, an `x` not f32 on the CPU, or a head width that is not a
    /// multiple of 16 (a tile of outputs would straddle two heads).
    ///
    /// # Errors
    /// An `x` of another token count, or a projection of another shape
    /// than `(3 · heads · head_dim, width)`, named.
    pub fn project_heads(
        &self,
        proj: &Proj,
        x: &Tensor,
        heads: usize,
        head_dim: usize,
    ) -> Result<Option<[Tensor; 3]>> {
        const TILE: usize = crate::kernels::gemv_q8::TILE_ROWS;
        let (b, width) = self.check(x, "x")?;
        let inner = heads * head_dim;
        if proj.dims() != (3 * inner, width) || inner == 0 {
            return Err(AttnError::Config {
                module: MODULE,
                reason: format!(
                    "project_heads: a q/k/v projection of {heads} heads of {head_dim} takes ({}, {width}); got {:?}",
                    3 * inner,
                    proj.dims()
                ),
            });
        }
        if !on_host(x) || !head_dim.is_multiple_of(TILE) {
            return Ok(None);
        }
        let (t, windows, tokens) = (self.window_len(), self.windows(), self.hp * self.wp);
        let n = b * windows;
        let part = n * heads * t * head_dim;
        // Row `r` (image `img`, map token `token`): its window and place
        // in it; tile `c`: its part (q, k, v), head and first column.
        let rows: Vec<usize> = (0..b * tokens)
            .map(|r| {
                let (img, token) = (r / tokens, r % tokens);
                let at = self.scatter[token] as usize;
                ((img * windows + at / t) * heads * t + at % t) * head_dim
            })
            .collect();
        let tiles: Vec<usize> = (0..3 * inner / TILE)
            .map(|c| {
                let col = c * TILE;
                let (which, within) = (col / inner, col % inner);
                which * part + (within / head_dim) * t * head_dim + within % head_dim
            })
            .collect();
        let x = x.reshape((b * tokens, width))?;
        // SAFETY: `rows` is a permutation of the (sample, position) pairs
        // times `head_dim`, and `tiles` of the (part, head, 16-column
        // block) triples, whose offsets (multiples of `t · head_dim` and
        // of 16 within `head_dim`) are apart from the rows': every value
        // of the `3 · part` is one row's one tile's, once.
        let Some(y) = (unsafe { proj.matmul_placed(&x, &rows, &tiles, 3 * part) }) else {
            return Ok(None);
        };
        let all = Tensor::from_vec(y?, (3, n, heads, t, head_dim), x.device())?;
        Ok(Some([all.get(0)?, all.get(1)?, all.get(2)?]))
    }

    /// The inverse of [`WindowOrder::split_heads`] for an attention's
    /// output `y (b · windows, heads, window², head_dim)`: `(b, hp, wp,
    /// heads · head_dim)` in map order, contiguous.
    ///
    /// # Errors
    /// A `y` of another shape, named.
    pub fn merge_heads(&self, y: &Tensor) -> Result<Tensor> {
        let (n, heads, t, head_dim) = y.dims4().map_err(|_| self.shape_error(y, "y"))?;
        let windows = self.windows();
        if t != self.window_len() || n == 0 || !n.is_multiple_of(windows) {
            return Err(self.shape_error(y, "y"));
        }
        let b = n / windows;
        let c = heads * head_dim;
        let tokens = self.hp * self.wp;
        if on_host(y) {
            let out = with_values(y, |values: &[f32]| {
                par_filled(b * tokens * c, c, |row, dst| {
                    let (img, token) = (row / tokens, row % tokens);
                    let at = self.scatter[token] as usize;
                    let sample = img * windows + at / t;
                    let i = at % t;
                    for (h, part) in dst.chunks_exact_mut(head_dim).enumerate() {
                        part.copy_from_slice(
                            &values[((sample * heads + h) * t + i) * head_dim..][..head_dim],
                        );
                    }
                })
            })?;
            return Ok(Tensor::from_vec(out, (b, self.hp, self.wp, c), y.device())?);
        }
        let scatter = self.index(&self.scatter, y.device())?;
        Ok(y.transpose(1, 2)?
            .reshape((b, tokens, c))?
            .index_select(&scatter, 1)?
            .reshape((b, self.hp, self.wp, c))?)
    }

    /// `x`'s batch and width, if it is `(b, hp, wp, width)` or `(b, hp ·
    /// wp, width)`.
    fn check(&self, x: &Tensor, name: &str) -> Result<(usize, usize)> {
        match *x.dims() {
            [b, h, w, width] if (h, w) == (self.hp, self.wp) => Ok((b, width)),
            [b, tokens, width] if tokens == self.hp * self.wp => Ok((b, width)),
            _ => Err(self.shape_error(x, name)),
        }
    }

    fn shape_error(&self, x: &Tensor, name: &str) -> AttnError {
        AttnError::Config {
            module: MODULE,
            reason: format!(
                "{name} {:?} is not a {} × {} map in {} × {} windows",
                x.dims(),
                self.hp,
                self.wp,
                self.window,
                self.window
            ),
        }
    }

    fn index(&self, order: &[u32], device: &Device) -> Result<Tensor> {
        Ok(Tensor::from_slice(order, order.len(), device)?)
    }
}

/// Whether the gathers run on the host: f32 on the CPU.
fn on_host(x: &Tensor) -> bool {
    x.dtype() == DType::F32 && x.device().is_cpu()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x` rolled by `-shift` along `dim` (torch.roll(x, -shift, dim)).
    fn roll_back(x: &Tensor, shift: usize, dim: usize) -> Result<Tensor> {
        let n = x.dim(dim)?;
        let s = shift % n;
        if s == 0 {
            return Ok(x.clone());
        }
        Ok(Tensor::cat(
            &[x.narrow(dim, s, n - s)?, x.narrow(dim, 0, s)?],
            dim,
        )?)
    }

    /// transformers' way: roll, window permute, then the heads out of the
    /// columns `offset..`.
    fn reference(
        x: &Tensor,
        (window, shift): (usize, usize),
        offset: usize,
        heads: usize,
        hd: usize,
    ) -> Result<Tensor> {
        let (b, hp, wp, _) = x.dims4()?;
        let rolled = roll_back(&roll_back(x, shift, 1)?, shift, 2)?;
        let (nh, nw, t) = (hp / window, wp / window, window * window);
        Ok(rolled
            .narrow(3, offset, heads * hd)?
            .reshape((b, nh, window, nw, window, heads * hd))?
            .permute((0, 1, 3, 2, 4, 5))?
            .reshape((b * nh * nw, t, heads, hd))?
            .transpose(1, 2)?
            .contiguous()?)
    }

    /// On the host and through candle's ops (bf16), shifted or not,
    /// several images and windows a side: the split is the rolls and the
    /// permute, and the merge puts every head row back where it was.
    #[test]
    fn split_is_roll_and_permute_and_merge_inverts_it() -> Result<()> {
        let dev = Device::Cpu;
        let (b, hp, wp, window, heads, hd) = (2, 6, 9, 3, 2, 4);
        let width = 3 * heads * hd + 5;
        for shift in [0, 1] {
            let order = WindowOrder::new(hp, wp, window, shift)?;
            let x = Tensor::arange(0f32, (b * hp * wp * width) as f32, &dev)?
                .reshape((b, hp, wp, width))?;
            for dtype in [DType::F32, DType::BF16] {
                let x = x.to_dtype(dtype)?;
                for offset in [0, heads * hd, 2 * heads * hd + 5] {
                    let got = order.split_heads(&x, offset, heads, hd)?;
                    let want = reference(&x, (window, shift), offset, heads, hd)?;
                    assert_eq!(got.dims(), want.dims());
                    let diff = (got.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?
                        .abs()?
                        .max_all()?
                        .to_scalar::<f32>()?;
                    assert_eq!(diff, 0.0, "shift {shift} {dtype:?} offset {offset}");
                    let back = order.merge_heads(&got)?;
                    let cols = x.narrow(3, offset, heads * hd)?;
                    let diff = (back.to_dtype(DType::F32)? - cols.to_dtype(DType::F32)?)?
                        .abs()?
                        .max_all()?
                        .to_scalar::<f32>()?;
                    assert_eq!(diff, 0.0, "merge: shift {shift} {dtype:?} offset {offset}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn refuses_what_is_not_whole_windows() -> Result<()> {
        let err = WindowOrder::new(7, 9, 3, 0).unwrap_err().to_string();
        assert!(err.contains("7 × 9") && err.contains("3 × 3"), "{err}");
        let order = WindowOrder::new(6, 6, 3, 0)?;
        let x = Tensor::zeros((1, 6, 5, 8), DType::F32, &Device::Cpu)?;
        let err = order.split_heads(&x, 0, 2, 4).unwrap_err().to_string();
        assert!(err.contains("[1, 6, 5, 8]"), "{err}");
        let x = Tensor::zeros((1, 36, 8), DType::F32, &Device::Cpu)?;
        let err = order.split_heads(&x, 4, 2, 4).unwrap_err().to_string();
        assert!(err.contains("columns 4..12"), "{err}");
        let y = Tensor::zeros((3, 2, 9, 4), DType::F32, &Device::Cpu)?;
        let err = order.merge_heads(&y).unwrap_err().to_string();
        assert!(err.contains("[3, 2, 9, 4]"), "{err}");
        Ok(())
    }

    /// A q8_0 or q4k q/k/v projection placed straight into the heads
    /// gives the bits of `split_heads` on the projection's output, plain
    /// and shifted windows, two images, with and without a bias; declined
    /// for dense weights and heads narrower than a tile.
    #[test]
    fn project_heads_is_split_heads_of_the_projection() -> Result<()> {
        use crate::quantize::{Quantization, Quantizer};
        use candle_core::Module;
        let dev = Device::Cpu;
        let (heads, hd) = (2, 32);
        for (format, width) in [(Quantization::Q8_0, 64), (Quantization::Q4K, 256)] {
            for (bias, shift) in [(true, 0), (false, 3)] {
                let dense = Proj::from(candle_nn::Linear::new(
                    Tensor::randn(0f32, 0.1, (3 * heads * hd, width), &dev)?,
                    bias.then(|| Tensor::randn(0f32, 0.1, 3 * heads * hd, &dev))
                        .transpose()?,
                ));
                let proj = Quantizer::strict(format).proj("qkv", &dense)?;
                let order = WindowOrder::new(12, 18, 6, shift)?;
                let x = Tensor::randn(0f32, 1., (2, 12, 18, width), &dev)?;
                let placed = order
                    .project_heads(&proj, &x, heads, hd)?
                    .expect("q8_0 and q4k projections are placed");
                let y = proj.forward(&x)?;
                for (i, got) in placed.iter().enumerate() {
                    let want = order.split_heads(&y, i * heads * hd, heads, hd)?;
                    assert_eq!(got.dims(), want.dims());
                    assert!(
                        crate::layers::same_bits(got, &want)?,
                        "{format:?}, bias {bias}, shift {shift}: part {i}"
                    );
                }
                assert!(order.project_heads(&dense, &x, heads, hd)?.is_none());
                assert!(order.project_heads(&proj, &x, 4 * heads, hd / 4)?.is_none());
                assert!(order.project_heads(&proj, &x, heads, hd / 2).is_err());
            }
        }
        Ok(())
    }
}

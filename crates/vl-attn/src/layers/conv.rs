//! Convolutions over channels-last maps: a depth-wise one with the
//! residual added, `x + conv(x)` (DaViT's convolutional position
//! encoding, [`DepthwiseConv`]), and a strided one whose weight is a
//! [`Proj`] (DaViT's patch embeddings, [`PatchConv`]).
//!
//! On the CPU vl's kernels run ([`crate::kernels::dwconv`],
//! [`crate::kernels::im2col`] and the projection's product, in f32: 16-bit
//! maps are widened for them and narrowed after); other devices run
//! candle's `conv2d` on the map turned channels-first and back (the
//! reference the kernels are tested against).

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, VarBuilder};

use crate::error::{AttnError, Result};
use crate::kernels::dwconv::{depthwise_nhwc, taps_of, DwShape};
use crate::kernels::im2col::{patches_nhwc, PatchShape};
use crate::kernels::with_values;
use crate::proj::Proj;
use crate::quantize::Quantizer;

/// `x + conv(x)` with one `k × k` filter per channel, stride 1, zero
/// padding `k / 2`: `weight (channels, 1, k, k)`, `bias (channels,)`.
#[derive(Debug, Clone)]
pub struct DepthwiseConv {
    weight: Tensor,
    bias: Option<Tensor>,
    /// The weight transposed for the kernel, `(k * k, channels)` f32; kept
    /// for f32 CPU weights only.
    taps: Option<std::sync::Arc<Vec<f32>>>,
    bias_f32: Option<std::sync::Arc<Vec<f32>>>,
    channels: usize,
    kernel: usize,
}

impl DepthwiseConv {
    /// Loads `weight (channels, 1, kernel, kernel)` and `bias (channels,)`
    /// under `vb`.
    ///
    /// # Errors
    /// A missing tensor or one of another shape, named by the builder; an
    /// even `kernel`.
    pub fn load(vb: VarBuilder, channels: usize, kernel: usize, bias: bool) -> Result<Self> {
        let weight = vb.get((channels, 1, kernel, kernel), "weight")?;
        let bias = if bias {
            Some(vb.get(channels, "bias")?)
        } else {
            None
        };
        Self::new(weight, bias)
    }

    /// Builds from existing tensors.
    ///
    /// # Errors
    /// [`AttnError::Shape`] when `weight` is not `(channels, 1, k, k)`
    /// with an odd `k`, or `bias` not `(channels,)`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let (channels, one, kh, kw) = weight.dims4()?;
        if one != 1 || kh != kw || kh % 2 == 0 {
            return Err(AttnError::Shape {
                arg: "DepthwiseConv weight",
                expected: "(channels, 1, k, k) with an odd k".into(),
                actual: weight.dims().to_vec(),
            });
        }
        if let Some(b) = &bias {
            if b.dims() != [channels] {
                return Err(AttnError::Shape {
                    arg: "DepthwiseConv bias",
                    expected: format!("({channels},)"),
                    actual: b.dims().to_vec(),
                });
            }
        }
        // On the CPU the kernel runs in f32 whatever the weights' dtype
        // (16-bit maps are widened for it: candle has no 16-bit
        // convolution on the CPU).
        let on_cpu = weight.device().is_cpu();
        let taps = if on_cpu {
            let w32 = weight.to_dtype(DType::F32)?;
            Some(std::sync::Arc::new(with_values(&w32, |w: &[f32]| {
                taps_of(w, channels, kh)
            })?))
        } else {
            None
        };
        let bias_f32 = match (&bias, on_cpu) {
            (Some(b), true) => Some(std::sync::Arc::new(
                b.to_dtype(DType::F32)?.to_vec1::<f32>()?,
            )),
            _ => None,
        };
        Ok(Self {
            weight,
            bias,
            taps,
            bias_f32,
            channels,
            kernel: kh,
        })
    }

    /// Adds `prefix.weight` and `prefix.bias` (see [`crate::named`]).
    pub fn named_tensors(&self, prefix: &str, out: &mut crate::named::Named) {
        use crate::named::join;
        out.insert(join(prefix, "weight"), self.weight.clone());
        if let Some(b) = &self.bias {
            out.insert(join(prefix, "bias"), b.clone());
        }
    }

    /// Channels.
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// `x + conv(x)`.
    ///
    /// # Shapes
    /// `x: (batch, height, width, channels)` → the same shape.
    ///
    /// # Errors
    /// [`AttnError::Shape`] for another channel count.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (batch, height, width, channels) = x.dims4()?;
        if channels != self.channels {
            return Err(AttnError::Shape {
                arg: "x",
                expected: format!("(batch, height, width, {})", self.channels),
                actual: x.dims().to_vec(),
            });
        }
        match &self.taps {
            Some(taps) if matches!(x.device(), Device::Cpu) => {
                let shape = DwShape {
                    batch,
                    height,
                    width,
                    channels,
                    kernel: self.kernel,
                };
                let bias = self.bias_f32.as_deref().map(Vec::as_slice);
                let x32 = x.to_dtype(DType::F32)?;
                let out =
                    with_values(&x32, |v: &[f32]| depthwise_nhwc(v, taps, bias, shape, true))?;
                Ok(Tensor::from_vec(out, x.shape(), x.device())?.to_dtype(x.dtype())?)
            }
            _ => self.forward_reference(x),
        }
    }

    /// `x + conv(x)` by candle's grouped convolution (one per channel).
    ///
    /// # Shapes
    /// As [`DepthwiseConv::forward`].
    pub fn forward_reference(&self, x: &Tensor) -> Result<Tensor> {
        let nchw = x.permute((0, 3, 1, 2))?.contiguous()?;
        let w = self.weight.to_dtype(x.dtype())?;
        let y = nchw.conv2d(&w, self.kernel / 2, 1, 1, self.channels)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(&b.to_dtype(x.dtype())?.reshape((1, (), 1, 1))?)?,
            None => y,
        };
        Ok((y.permute((0, 2, 3, 1))? + x)?.contiguous()?)
    }
}

/// A strided 2-D convolution `(in → out, k × k, stride, padding)` over
/// channels-last maps, its weight `(out, in, k, k)` held flattened as the
/// projection `(out, in · k²)` it is once the map is cut into patches:
/// dense, 16-bit or quantized like any [`Proj`] (named `weight`, its
/// blocks `weight.q8_0` or `weight.q4k` — see [`Proj::named_tensors`]).
///
/// On the CPU the patches are gathered by [`patches_nhwc`] and multiplied
/// by [`Proj::forward_f32`] (vl's products, accumulating in f32);
/// elsewhere candle's `conv2d` runs with the weight the projection holds.
#[derive(Debug, Clone)]
pub struct PatchConv {
    proj: Proj,
    in_channels: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
}

impl PatchConv {
    /// Loads `weight (out, in, kernel, kernel)` and, with `bias`, `bias
    /// (out,)` under `vb`.
    ///
    /// # Errors
    /// A missing tensor or one of another shape, named by the builder; a
    /// zero stride or kernel.
    pub fn load(
        vb: VarBuilder,
        (in_channels, out_channels): (usize, usize),
        kernel: usize,
        (stride, padding): (usize, usize),
        bias: bool,
    ) -> Result<Self> {
        let weight = vb.get((out_channels, in_channels, kernel, kernel), "weight")?;
        let bias = if bias {
            Some(vb.get(out_channels, "bias")?)
        } else {
            None
        };
        Self::new(weight, bias, stride, padding)
    }

    /// Builds from existing tensors.
    ///
    /// # Errors
    /// [`AttnError::Shape`] when `weight` is not `(out, in, k, k)` with
    /// `k > 0`, `bias` not `(out,)`, or the stride is 0.
    pub fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        let (out, inp, kh, kw) = weight.dims4()?;
        if kh != kw || kh == 0 || stride == 0 {
            return Err(AttnError::Shape {
                arg: "PatchConv weight",
                expected: "(out, in, k, k) with k > 0, and a stride > 0".into(),
                actual: weight.dims().to_vec(),
            });
        }
        if let Some(b) = &bias {
            if b.dims() != [out] {
                return Err(AttnError::Shape {
                    arg: "PatchConv bias",
                    expected: format!("({out},)"),
                    actual: b.dims().to_vec(),
                });
            }
        }
        let flat = weight.reshape((out, inp * kh * kw))?;
        Ok(Self {
            proj: Proj::from(Linear::new(flat, bias)),
            in_channels: inp,
            kernel: kh,
            stride,
            padding,
        })
    }

    /// The flattened weight's projection `(out, in · k²)`.
    pub fn proj(&self) -> &Proj {
        &self.proj
    }

    /// Output channels.
    pub fn out_channels(&self) -> usize {
        self.proj.dims().0
    }

    /// A copy whose projection `q` converts (as layer `name`, falling back
    /// as `q` does: a fitting quantizer takes a width that `q4k`'s blocks
    /// do not divide to `q8_0`); a width `in · k²` that not even `q8_0`'s
    /// blocks of 32 divide (a stem over 3 pixel channels: 147 columns for
    /// a 7 × 7 filter, 48 for Swin's 4 × 4) keeps the weight as it is —
    /// the patch embeddings were dense before they were projections, and
    /// such a stem is a small share of the work.
    ///
    /// # Errors
    /// As [`Quantizer::proj`].
    pub fn quantize(&self, q: &Quantizer, name: &str) -> Result<Self> {
        let width = self.proj.dims().1;
        let smallest = |f: GgmlDType| f.block_size().min(GgmlDType::Q8_0.block_size());
        if q.format()
            .is_some_and(|f| !width.is_multiple_of(smallest(f)))
        {
            return Ok(self.clone());
        }
        Ok(Self {
            proj: q.proj(name, &self.proj)?,
            ..self.clone()
        })
    }

    /// Adds `prefix.weight` (dense or 16-bit as `(out, in, k, k)`; blocks
    /// as [`Proj::named_tensors`] writes them) and `prefix.bias`.
    ///
    /// # Errors
    /// candle's, reading a converted weight back.
    pub fn named_tensors(&self, prefix: &str, out: &mut crate::named::Named) -> Result<()> {
        let mut own = crate::named::Named::new();
        self.proj.named_tensors(prefix, &mut own)?;
        let dense = crate::named::join(prefix, "weight");
        let (k, inp, o) = (self.kernel, self.in_channels, self.out_channels());
        for (name, t) in own {
            let t = if name == dense {
                t.reshape((o, inp, k, k))?
            } else {
                t
            };
            out.insert(name, t);
        }
        Ok(())
    }

    /// The convolution.
    ///
    /// # Shapes
    /// `x: (batch, height, width, in)` → `(batch, out_h, out_w, out)` f32,
    /// `out_h = (height + 2 · padding − k) / stride + 1` (likewise
    /// `out_w`).
    ///
    /// # Errors
    /// [`AttnError::Shape`] for another channel count or a map smaller than
    /// the filter.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (batch, height, width, channels) = x.dims4()?;
        let shape = PatchShape {
            batch,
            height,
            width,
            channels,
            kernel: self.kernel,
            stride: self.stride,
            padding: self.padding,
        };
        let out = self.out_channels();
        let (oh, ow) = match shape.output() {
            Some(o) if channels == self.in_channels => o,
            _ => {
                return Err(AttnError::Shape {
                    arg: "x",
                    expected: format!(
                        "(batch, height, width, {}) with height and width + 2 × {} at least {}",
                        self.in_channels, self.padding, self.kernel
                    ),
                    actual: x.dims().to_vec(),
                })
            }
        };
        if !x.device().is_cpu() {
            return self.forward_reference(x);
        }
        let x32 = x.to_dtype(DType::F32)?;
        let patches = with_values(&x32, |v: &[f32]| patches_nhwc(v, shape))?;
        let patches = Tensor::from_vec(patches, (batch * oh * ow, shape.columns()), x.device())?;
        Ok(self
            .proj
            .forward_f32(&patches)?
            .reshape((batch, oh, ow, out))?)
    }

    /// The convolution by candle's `conv2d` on the map turned
    /// channels-first, with the weight the projection computes with.
    ///
    /// # Shapes
    /// As [`PatchConv::forward`].
    pub fn forward_reference(&self, x: &Tensor) -> Result<Tensor> {
        let (w, b) = self.proj.weight_and_bias()?;
        let (k, inp, o) = (self.kernel, self.in_channels, self.out_channels());
        let w = w.reshape((o, inp, k, k))?.to_dtype(DType::F32)?;
        let nchw = x
            .to_dtype(DType::F32)?
            .permute((0, 3, 1, 2))?
            .contiguous()?;
        let y = nchw.conv2d(&w, self.padding, self.stride, 1, 1)?;
        let y = match b {
            Some(b) => y.broadcast_add(&b.to_dtype(DType::F32)?.reshape((1, (), 1, 1))?)?,
            None => y,
        };
        Ok(y.permute((0, 2, 3, 1))?.contiguous()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeded(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let mut s = seed;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The kernel equals candle's grouped convolution on odd sizes (maps
    /// smaller than the filter, one row, one column, several images), with
    /// and without a bias.
    #[test]
    fn kernel_equals_grouped_conv2d() -> Result<()> {
        for (i, &(b, h, w, c, k, bias)) in [
            (1, 5, 7, 3, 3, true),
            (2, 1, 9, 17, 3, true),
            (1, 6, 1, 8, 3, false),
            (3, 2, 2, 5, 5, true),
            (1, 12, 13, 33, 3, true),
        ]
        .iter()
        .enumerate()
        {
            let seed = 100 * i as u64;
            let conv = DepthwiseConv::new(
                seeded(&[c, 1, k, k], seed),
                bias.then(|| seeded(&[c], seed + 1)),
            )?;
            let x = seeded(&[b, h, w, c], seed + 2);
            let fast = conv.forward(&x)?;
            let slow = conv.forward_reference(&x)?;
            let diff = (fast - slow)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(diff <= 1e-6, "case {i}: max |fast - reference| = {diff}");
        }
        Ok(())
    }

    /// The patches and the projection equal candle's convolution: odd
    /// sizes, strides, padding, a filter wider than the stride, several
    /// images; and through each weight format, the dequantized weight's
    /// convolution.
    #[test]
    fn patch_conv_equals_conv2d() -> Result<()> {
        use crate::quantize::Quantization;
        for (i, &(b, h, w, c, o, k, s, p)) in [
            (1, 9, 7, 3, 16, 7, 4, 3),
            (2, 6, 5, 32, 8, 3, 2, 1),
            (1, 4, 4, 4, 5, 4, 4, 0),
            (1, 3, 8, 64, 32, 3, 1, 1),
            (3, 2, 2, 32, 16, 3, 2, 1),
        ]
        .iter()
        .enumerate()
        {
            let seed = 300 + 10 * i as u64;
            let conv = PatchConv::new(
                seeded(&[o, c, k, k], seed),
                Some(seeded(&[o], seed + 1)),
                s,
                p,
            )?;
            let x = seeded(&[b, h, w, c], seed + 2);
            for q in [Quantization::None, Quantization::Bf16, Quantization::Q8_0] {
                let conv = conv.quantize(&Quantizer::strict(q), "conv")?;
                let fast = conv.forward(&x)?;
                let slow = conv.forward_reference(&x)?;
                assert_eq!(fast.dims(), slow.dims(), "case {i} {q}");
                let diff = (fast - slow)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?;
                // vl's bf16 GEMM rounds the patches to bf16 (8 bits), q8_0
                // per 32 values to 8 bits, as their products do for any
                // activations; dense weights sum in another order only.
                let tol = match q {
                    Quantization::None => 1e-5,
                    _ => 0.05,
                };
                assert!(diff <= tol, "case {i} {q}: max |fast - reference| = {diff}");
            }
        }
        Ok(())
    }

    /// A converted patch convolution's tensors: dense weights back as `(out,
    /// in, k, k)`, blocks as rows; a width no block holds stays dense.
    #[test]
    fn patch_conv_names_its_tensors() -> Result<()> {
        use crate::quantize::Quantization;
        let conv = PatchConv::new(seeded(&[16, 32, 3, 3], 1), Some(seeded(&[16], 2)), 2, 1)?;
        let mut named = crate::named::Named::new();
        conv.named_tensors("c", &mut named)?;
        assert_eq!(named["c.weight"].dims(), [16, 32, 3, 3]);
        assert_eq!(named["c.bias"].dims(), [16]);
        let mut named = crate::named::Named::new();
        let q8 = conv.quantize(&Quantizer::strict(Quantization::Q8_0), "c")?;
        q8.named_tensors("c", &mut named)?;
        assert_eq!(named["c.weight.q8_0"].dims(), [16, 288 / 32 * 34]);
        let stem = PatchConv::new(seeded(&[8, 3, 7, 7], 3), None, 4, 3)?;
        let kept = stem.quantize(&Quantizer::strict(Quantization::Q8_0), "stem")?;
        assert_eq!(kept.proj().quantization(), None);
        // 288 columns: no q4k blocks (256), q8_0 ones, said as a fallback.
        let q4k = Quantizer::fitting(Quantization::Q4K);
        let held = conv.quantize(&q4k, "c")?;
        assert_eq!(held.proj().quantization(), Some(GgmlDType::Q8_0));
        assert_eq!(q4k.fallbacks()[0].layer, "c");
        Ok(())
    }

    /// Wrong shapes are refused, naming what was expected.
    #[test]
    fn shapes_are_checked() -> Result<()> {
        let even = DepthwiseConv::new(seeded(&[4, 1, 2, 2], 1), None);
        assert!(even.unwrap_err().to_string().contains("odd k"));
        let conv = DepthwiseConv::new(seeded(&[4, 1, 3, 3], 1), None)?;
        let err = conv.forward(&seeded(&[1, 2, 2, 5], 2)).unwrap_err();
        assert!(
            err.to_string().contains("(batch, height, width, 4)"),
            "{err}"
        );
        Ok(())
    }
}

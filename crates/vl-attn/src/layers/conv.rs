//! A depth-wise convolution over channels-last maps, with the residual
//! added: `x + conv(x)`, DaViT's convolutional position encoding.
//!
//! On the CPU vl's kernel runs ([`crate::kernels::dwconv`], in f32: 16-bit
//! maps are widened for it and narrowed after); other devices run
//! candle's grouped `conv2d` on the map turned channels-first and back
//! (the reference the kernel is tested against).

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use crate::error::{AttnError, Result};
use crate::kernels::dwconv::{depthwise_nhwc, taps_of, DwShape};
use crate::kernels::with_values;

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

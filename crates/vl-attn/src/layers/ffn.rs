//! The position-wise feed-forward layer and its activations, shared by the
//! decoder and the ViT.

use crate::quantize::Quantizer;
use candle_core::Tensor;
use candle_nn::{Module, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::proj::Proj;

/// The feed-forward activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Activation {
    /// GELU with the exact erf (`gelu` in transformers).
    #[default]
    #[serde(rename = "gelu", alias = "gelu_erf")]
    Gelu,
    /// GELU with the tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    #[serde(
        rename = "gelu_tanh",
        alias = "gelu_new",
        alias = "gelu_pytorch_tanh",
        alias = "gelu_fast"
    )]
    GeluTanh,
    /// `max(0, x)`.
    #[serde(rename = "relu")]
    Relu,
    /// `x * sigmoid(x)`.
    #[serde(rename = "silu", alias = "swish")]
    Silu,
}

impl Activation {
    /// Applies the activation.
    pub fn forward(self, x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        match self {
            // vl's vectorised kernel for f32 on the CPU, candle's ops
            // otherwise.
            Self::Gelu => crate::kernels::gelu::forward(x, true),
            Self::GeluTanh => crate::kernels::gelu::forward(x, false),
            Self::Relu => x.relu(),
            Self::Silu => x.silu(),
        }
    }

    /// For a GELU, whether it is the exact (`erf`) form rather than the
    /// tanh approximation — what the fused kernels take; `None` for the
    /// other activations.
    fn gelu_exact(self) -> Option<bool> {
        match self {
            Self::Gelu => Some(true),
            Self::GeluTanh => Some(false),
            Self::Relu | Self::Silu => None,
        }
    }
}

/// The position-wise feed-forward layer `down(act(up(x)))`, dense or
/// quantized.
#[derive(Debug, Clone)]
pub struct FeedForward {
    up: Proj,
    down: Proj,
    act: Activation,
}

impl FeedForward {
    /// Loads `up (intermediate, hidden)` and `down (hidden, intermediate)`
    /// with biases.
    pub fn load(
        vb: VarBuilder,
        hidden: usize,
        intermediate: usize,
        act: Activation,
    ) -> Result<Self> {
        Ok(Self::from_parts(
            candle_nn::linear(hidden, intermediate, vb.pp("up"))?,
            candle_nn::linear(intermediate, hidden, vb.pp("down"))?,
            act,
        ))
    }

    /// Builds from existing layers: dense ones or [`Proj`]s of any format.
    pub fn from_parts(up: impl Into<Proj>, down: impl Into<Proj>, act: Activation) -> Self {
        Self {
            up: up.into(),
            down: down.into(),
            act,
        }
    }

    /// A copy with `up` and `down` quantized to `format`.
    ///
    /// # Errors
    /// [`crate::AttnError::Quantize`] naming `up` (or `down`) when
    /// `hidden` (or `intermediate`) is not a multiple of the format's block
    /// size.
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        Ok(Self {
            up: q.proj("up", &self.up)?,
            down: q.proj("down", &self.down)?,
            act: self.act,
        })
    }

    /// The activation between the projections.
    pub fn activation(&self) -> Activation {
        self.act
    }

    /// The up and down projections (a checkpoint's names for them differ:
    /// `fc1`/`fc2`, `up`/`down`).
    pub fn parts(&self) -> (&Proj, &Proj) {
        (&self.up, &self.down)
    }

    /// Adds `up` and `down` under `prefix` (see [`crate::named`]).
    pub fn named_tensors(&self, prefix: &str, out: &mut crate::named::Named) -> Result<()> {
        use crate::named::join;
        self.up.named_tensors(&join(prefix, "up"), out)?;
        self.down.named_tensors(&join(prefix, "down"), out)
    }

    /// # Shapes
    /// `x: (batch, len, hidden)` → `(batch, len, hidden)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_then(x, None)
    }

    /// `residual + forward(x)`: the bits of [`crate::kernels::add::add`] of
    /// the residual and [`FeedForward::forward`]'s output; where the
    /// second product runs on vl's q8_0 tiles on AMX, the residual is
    /// added as it stores its outputs ([`Proj::forward_add`]).
    ///
    /// # Errors
    /// The layer's; a residual of another shape than the output.
    ///
    /// # Shapes
    /// `x: (..., hidden)`, `residual: (..., hidden)` → `(..., hidden)`.
    pub fn forward_add(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.forward_then(x, Some(residual))
    }

    /// [`FeedForward::forward`]'s routes, plus `residual` if any: added as
    /// the second product stores where `fused_tiled` takes the layer,
    /// after the output elsewhere.
    fn forward_then(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        let plus = |y: Tensor| plus_residual(y, residual);
        if let Some(y) = self.fused_bf16(x)? {
            return plus(y);
        }
        if let Some(y) = self.packed_f32(x)? {
            return plus(y);
        }
        if let Some(y) = self.fused_tiled(x, residual)? {
            return Ok(y);
        }
        if let Some(y) = self.chunked_f32(x)? {
            return plus(y);
        }
        plus(
            self.down
                .forward(&self.act.forward(&self.up.forward(x)?)?)?,
        )
    }

    /// A dense f32 layer of an encoder's rows through vl's f32 product a
    /// chunk of rows at a time, the GELU as the first product stores
    /// ([`crate::kernels::gemm_f32::ffn`]; the same bits as the three
    /// steps apart), where [`crate::kernels::gemm_f32::ffn_applies`]; `None`
    /// elsewhere.
    fn chunked_f32(&self, x: &Tensor) -> Result<Option<Tensor>> {
        use crate::kernels::gemm_f32;
        let Some(exact) = self.act.gelu_exact() else {
            return Ok(None);
        };
        let (Some(up), Some(down)) = (self.up.dense_f32(), self.down.dense_f32()) else {
            return Ok(None);
        };
        let (_, k) = up.0.dims2()?;
        let rows = x.elem_count() / k.max(1);
        // The row count first: a decode step leaves here at once.
        if !gemm_f32::ffn_applies(rows)
            || x.dtype() != candle_core::DType::F32
            || !x.device().is_cpu()
            || x.track_op()
            || up.0.track_op()
            || down.0.track_op()
            || !up.0.is_contiguous()
            || !down.0.is_contiguous()
            || x.dims().last() != Some(&k)
        {
            return Ok(None);
        }
        let isa = crate::kernels::CpuFeatures::get().isa();
        Ok(Some(gemm_f32::ffn(isa, x, up, down, exact)?))
    }

    /// The layer in two products when both weights are packed f32
    /// ([`Proj::pack_f32`]) and the activation a GELU: the first applies
    /// the GELU as it stores ([`PackedF32::matmul_gelu`]) — the values of
    /// the three steps apart, bit for bit, without a GELU pass over the
    /// hidden layer. `None` where that does not apply.
    ///
    /// [`PackedF32::matmul_gelu`]: crate::kernels::gemm_f32::PackedF32::matmul_gelu
    fn packed_f32(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let Some(exact) = self.act.gelu_exact() else {
            return Ok(None);
        };
        let (Some(up), Some(down)) = (self.up.packed_f32(), self.down.packed_f32()) else {
            return Ok(None);
        };
        if x.dtype() != candle_core::DType::F32 || !x.device().is_cpu() || x.track_op() {
            return Ok(None);
        }
        let hidden = up.matmul_gelu(x, exact)?;
        Ok(Some(down.matmul(&hidden)?))
    }

    /// The layer in two products when both weights are packed bf16 under
    /// f32 activations, the activation a GELU and the rows many (an
    /// encoder's): the first product applies the GELU in its epilogue and
    /// stores the hidden layer as the second takes it
    /// ([`PackedBf16::matmul_gelu`]: bf16, which the `vdpbf16ps` and tile
    /// products would round it to anyway; f32 on FMAs, which keep it) —
    /// the values of the three steps apart, without a separate GELU pass.
    /// `None` where that does not apply.
    ///
    /// [`PackedBf16::matmul_gelu`]: crate::kernels::gemm_bf16::PackedBf16::matmul_gelu
    fn fused_bf16(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let Some(exact) = self.act.gelu_exact() else {
            return Ok(None);
        };
        let (Some(up), Some(down)) = (self.up.packed_bf16(), self.down.packed_bf16()) else {
            return Ok(None);
        };
        let rows = x.elem_count() / x.dims().last().copied().unwrap_or(1).max(1);
        if x.dtype() != candle_core::DType::F32
            || !x.device().is_cpu()
            || x.track_op()
            || rows <= crate::kernels::gemv::MAX_ROWS
        {
            return Ok(None);
        }
        let hidden = up.matmul_gelu(x, exact)?;
        Ok(Some(down.matmul_f32(&hidden)?))
    }
}

/// `residual + y` (vl's addition), or `y` without a residual.
fn plus_residual(y: Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
    match residual {
        Some(r) => Ok(crate::kernels::add::add(r, &y)?),
        None => Ok(y),
    }
}

impl FeedForward {
    /// The layer with the GELU in the first product's epilogue when that
    /// product is vl's q8_0 or q4k tiles under f32 activations on the CPU:
    /// the bits of the three steps apart (the same GELU, on the same f32
    /// values), without the hidden layer's extra pass — in a Florence-2
    /// q8_0 encode that pass wrote and read back the 19–75 MB hidden layer
    /// of every DaViT block. For an encoder's many rows and a hidden layer
    /// of up to a few thousand values, a chunk of rows at a time through
    /// both products, the hidden layer never leaving the core's cache
    /// (`Proj::ffn_tiled`; the same bits again): the f32 hidden layer is
    /// then neither stored nor read back to be rounded for the second
    /// product (`cargo bench -p vl-attn --bench gemv -- "ffn q8_0"`: a
    /// Florence-2 first-stage layer, 36,864 rows, 2.8× faster). `None`
    /// where neither applies.
    /// With a `residual`, it is added to the output: as the second
    /// product stores where that product runs alone
    /// ([`Proj::forward_add`]), after the chunks' output otherwise — the
    /// bits of the addition after either way.
    fn fused_tiled(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Option<Tensor>> {
        let Some(exact) = self.act.gelu_exact() else {
            return Ok(None);
        };
        if x.dtype() != candle_core::DType::F32 || !x.device().is_cpu() || x.track_op() {
            return Ok(None);
        }
        if let Some(y) = Proj::ffn_tiled(&self.up, &self.down, x, exact)? {
            return Ok(Some(plus_residual(y, residual)?));
        }
        let Some(hidden) = self.up.matmul_gelu_tiled(x, exact) else {
            return Ok(None);
        };
        let hidden = hidden?;
        Ok(Some(match residual {
            Some(r) => self.down.forward_add(&hidden, r)?,
            None => self.down.forward(&hidden)?,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::same_bits;
    use crate::quantize::{Quantization, Quantizer};
    use candle_core::{DType, Device};
    use candle_nn::Linear;

    /// A dense `(o, i)` layer of random weights, with a bias if asked.
    fn layer(o: usize, i: usize, bias: bool) -> Result<Proj> {
        let dev = Device::Cpu;
        Ok(Proj::from(Linear::new(
            Tensor::randn(0f32, 0.1, (o, i), &dev)?,
            bias.then(|| Tensor::randn(0f32, 0.1, o, &dev))
                .transpose()?,
        )))
    }

    /// With bf16 weights under f32 activations, the fused feed-forward
    /// (GELU in the first product's epilogue, the hidden layer in bf16)
    /// gives the bits of the three steps apart, for an encoder's rows and
    /// a decode step's.
    #[test]
    fn fused_bf16_equals_the_steps() -> Result<()> {
        let dev = Device::Cpu;
        for act in [Activation::Gelu, Activation::GeluTanh] {
            let ffn = FeedForward::from_parts(layer(96, 64, true)?, layer(64, 96, true)?, act);
            let q = Quantizer::strict(Quantization::Bf16);
            let (up, down) = ffn.parts();
            let ffn = FeedForward::from_parts(q.proj("up", up)?, q.proj("down", down)?, act);
            for rows in [3, 40] {
                let x = Tensor::randn(0f32, 1., (2, rows, 64), &dev)?;
                let fused = ffn.forward(&x)?;
                let (up, down) = ffn.parts();
                let apart = down.forward(&act.forward(&up.forward(&x)?)?)?;
                assert_eq!(fused.dtype(), DType::F32);
                assert!(same_bits(&fused, &apart)?, "{act:?}, {rows} rows");
            }
        }
        Ok(())
    }

    /// With both weights packed f32, the GELU in the first product's
    /// epilogue gives the bits of the three steps apart on those packed
    /// layers, and those of the dense layer (chunked or not) where the
    /// CPU's tuning runs dense products on vl's f32 GEMM (decode-shaped
    /// rows aside, which the dense layer runs on its GEMV); a ReLU takes
    /// the steps; a residual is added after, bit for bit.
    #[test]
    fn packed_f32_equals_the_steps_and_the_dense_layer() -> Result<()> {
        let dev = Device::Cpu;
        let (hidden, inter) = (64, 96);
        for act in [Activation::Gelu, Activation::GeluTanh, Activation::Relu] {
            for bias in [true, false] {
                let dense = FeedForward::from_parts(
                    layer(inter, hidden, bias)?,
                    layer(hidden, inter, bias)?,
                    act,
                );
                let packed = dense.quantize(Quantizer::packing_f32())?;
                let (up, down) = packed.parts();
                assert!(up.packed_f32().is_some() && down.packed_f32().is_some());
                for rows in [5, 40, 197] {
                    let x = Tensor::randn(0f32, 1., (rows, hidden), &dev)?;
                    let y = packed.forward(&x)?;
                    let apart = down.forward(&act.forward(&up.forward(&x)?)?)?;
                    assert!(same_bits(&y, &apart)?, "{act:?}, bias {bias}, {rows} rows");
                    assert_eq!(
                        packed.packed_f32(&x)?.is_some(),
                        act != Activation::Relu,
                        "{act:?}"
                    );
                    let want = dense.forward(&x)?;
                    let w = dense.parts().0.as_linear().unwrap().weight();
                    if crate::kernels::gemm_f32::applies(&x, w) {
                        assert!(same_bits(&y, &want)?, "{act:?}, {rows} rows, dense");
                    } else {
                        let err = (&y - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                        assert!(err < 1e-5, "{act:?}, {rows} rows: {err}");
                    }
                    let r = Tensor::randn(0f32, 1., (rows, hidden), &dev)?;
                    let added = packed.forward_add(&x, &r)?;
                    assert!(same_bits(&added, &crate::kernels::add::add(&r, &y)?)?);
                }
            }
        }
        Ok(())
    }

    /// A dense f32 layer of an encoder's rows runs a chunk of rows at a
    /// time where the CPU's tuning takes vl's f32 product, with the bits of
    /// the three steps apart; a batch's decode step, or a ReLU, takes the
    /// steps.
    #[test]
    fn chunked_f32_equals_the_steps() -> Result<()> {
        use crate::kernels::gemm_f32::ffn_applies;
        let dev = Device::Cpu;
        let (hidden, inter) = (16, 48);
        for act in [Activation::Gelu, Activation::GeluTanh, Activation::Relu] {
            let ffn = FeedForward::from_parts(
                layer(inter, hidden, true)?,
                layer(hidden, inter, true)?,
                act,
            );
            for rows in [5, 16, 150, 9000] {
                let x = Tensor::randn(0f32, 1., (rows, hidden), &dev)?;
                let chunked = ffn.chunked_f32(&x)?;
                assert_eq!(
                    chunked.is_some(),
                    act != Activation::Relu && ffn_applies(rows),
                    "{act:?}, {rows} rows"
                );
                let (up, down) = ffn.parts();
                let apart = down.forward(&act.forward(&up.forward(&x)?)?)?;
                assert!(
                    same_bits(&ffn.forward(&x)?, &apart)?,
                    "{act:?}, {rows} rows"
                );
            }
        }
        Ok(())
    }

    /// With q8_0 or q4k weights under f32 activations, the GELU in the
    /// first product's epilogue gives the bits of the three steps apart,
    /// for a decode step's rows and an encoder's (the two-tile kernel and
    /// its tails), with and without a bias; the f32 hidden layer is what
    /// the steps apart compute, so a ReLU layer takes the plain path.
    #[test]
    fn fused_tiled_equals_the_steps() -> Result<()> {
        let dev = Device::Cpu;
        for (format, hidden, inter) in [(Quantization::Q8_0, 64, 96), (Quantization::Q4K, 256, 512)]
        {
            for act in [Activation::Gelu, Activation::GeluTanh, Activation::Relu] {
                for bias in [true, false] {
                    let q = Quantizer::strict(format);
                    let ffn = FeedForward::from_parts(
                        q.proj("up", &layer(inter, hidden, bias)?)?,
                        q.proj("down", &layer(hidden, inter, bias)?)?,
                        act,
                    );
                    let (up, _) = ffn.parts();
                    assert_eq!(
                        up.matmul_gelu_tiled(&Tensor::zeros((1, hidden), DType::F32, &dev)?, true)
                            .is_some(),
                        dev.is_cpu(),
                        "{format:?} is held in vl's tiles"
                    );
                    for rows in [1, 5, 13, 70] {
                        let x = Tensor::randn(0f32, 1., (2, rows, hidden), &dev)?;
                        let fused = ffn.forward(&x)?;
                        let (up, down) = ffn.parts();
                        let apart = down.forward(&act.forward(&up.forward(&x)?)?)?;
                        assert!(
                            same_bits(&fused, &apart)?,
                            "{format:?} {act:?} bias {bias}, {rows} rows"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// An encoder's many rows through vl's tiles a chunk at a time, the
    /// hidden layer kept in cache (`Proj::ffn_tiled`): the bits of the
    /// steps apart for q8_0, q4k and the two mixed, both GELUs, with and
    /// without biases, a last chunk short of the rest (and of the
    /// two-tile kernel's rows), an odd last tile; declined for a few rows
    /// and for a hidden layer too wide for its chunks; with a residual
    /// (`forward_add`), the bits of the addition after.
    #[test]
    fn chunked_tiled_equals_the_steps() -> Result<()> {
        let dev = Device::Cpu;
        // The chunks' size and the threshold follow the pool's threads.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .map_err(|e| crate::AttnError::Argument {
                arg: "pool",
                reason: e.to_string(),
            })?;
        pool.install(|| -> Result<()> {
            // 1024 hidden values: chunks of 48 rows (the last of 526
            // rows 46, of 600 rows 24).
            let (width, hidden, out) = (256, 1024, 200);
            let formats = [
                (Quantization::Q8_0, Quantization::Q8_0),
                (Quantization::Q4K, Quantization::Q4K),
                (Quantization::Q8_0, Quantization::Q4K),
                (Quantization::Q4K, Quantization::Q8_0),
            ];
            for (i, (uf, df)) in formats.into_iter().enumerate() {
                let act = [Activation::Gelu, Activation::GeluTanh][i % 2];
                let exact = act == Activation::Gelu;
                for bias in [true, false] {
                    let up = Quantizer::strict(uf).proj("up", &layer(hidden, width, bias)?)?;
                    let down = Quantizer::strict(df).proj("down", &layer(out, hidden, bias)?)?;
                    // A q8_0 weight's many rows run on the tile unit where
                    // the CPU has one: the products apart, declined here.
                    let amx = crate::kernels::CpuFeatures::get().q8_isa().simd()
                        == crate::kernels::Q8Simd::Amx
                        && (uf == Quantization::Q8_0 || df == Quantization::Q8_0);
                    for rows in [263, 300] {
                        let x = Tensor::randn(0f32, 1., (2, rows, width), &dev)?;
                        let apart = down.forward(&act.forward(&up.forward(&x)?)?)?;
                        let ffn = FeedForward::from_parts(up.clone(), down.clone(), act);
                        assert!(same_bits(&ffn.forward(&x)?, &apart)?);
                        // With a residual (added as the second product
                        // stores where it runs on AMX): the same bits as
                        // the addition after.
                        let r = Tensor::randn(0f32, 1., (2, rows, out), &dev)?;
                        let with = ffn.forward_add(&x, &r)?;
                        let after = crate::kernels::add::add(&r, &apart)?;
                        assert!(same_bits(&with, &after)?, "{uf:?} then {df:?}, residual");
                        if amx {
                            assert!(Proj::ffn_tiled(&up, &down, &x, exact)?.is_none());
                            continue;
                        }
                        let chunked = Proj::ffn_tiled(&up, &down, &x, exact)?.ok_or_else(|| {
                            crate::AttnError::Argument {
                                arg: "rows",
                                reason: format!("{rows} × 2 rows were not chunked"),
                            }
                        })?;
                        assert_eq!(chunked.dims(), apart.dims());
                        assert!(
                            same_bits(&chunked, &apart)?,
                            "{uf:?} then {df:?}, {act:?}, bias {bias}, {rows} × 2 rows"
                        );
                    }
                    let few = Tensor::randn(0f32, 1., (1, 200, width), &dev)?;
                    assert!(Proj::ffn_tiled(&up, &down, &few, exact)?.is_none());
                }
            }
            let q = Quantizer::strict(Quantization::Q8_0);
            let (up, down) = (
                q.proj("up", &layer(3072, width, true)?)?,
                q.proj("down", &layer(width, 3072, true)?)?,
            );
            let x = Tensor::randn(0f32, 1., (1, 2000, width), &dev)?;
            assert!(Proj::ffn_tiled(&up, &down, &x, true)?.is_none(), "too wide");
            Ok(())
        })
    }
}

//! A linear projection whose weight is either dense or quantized.
//!
//! On CPU a decode step is one matrix-vector product per projection: a
//! dense weight runs it on vl's parallel kernel ([`crate::kernels::gemv`]) for 1 to
//! [`crate::kernels::gemv::MAX_ROWS`] untracked rows; more bf16 rows run on vl's
//! bf16 GEMM ([`crate::kernels::gemm_bf16`]) where the CPU has AVX512_BF16 (a
//! weight quantized to bf16 there is packed once for it, at load time);
//! everything else (f32 prefill and encoders, training, other devices) on
//! candle's matmul. A dense f32 weight of an encoder can be packed once,
//! at load ([`Proj::pack_f32`]), for vl's f32 product of many rows
//! ([`crate::kernels::gemm_f32::PackedF32`]: the same values, faster where
//! the weights come from memory). A `q8_0` weight on the CPU is packed once for vl's
//! own q8_0 kernels ([`crate::kernels::gemv_q8::PackedQ8`], any number of rows),
//! a `q4k` one for vl's q4_K kernels ([`crate::kernels::gemv_q4k::PackedQ4K`]);
//! other formats, and every format off the CPU, run on candle's quantized
//! kernels — all much faster than a dense bf16 or f32 weight while
//! holding 4 to 7 times fewer bytes.
//!
//! Quantizing a weight `(out, in)` needs `in` to be a multiple of the
//! format's block size (32 for `q8_0`, 256 for `q4k`); otherwise
//! [`Proj::quantize`] fails with [`AttnError::Quantize`] naming the layer and
//! the sizes. It never falls back to dense silently: a model is either
//! quantized as asked or not at all.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Linear;

use crate::error::{AttnError, Result};
use crate::kernels::gemm_bf16::PackedBf16;
use crate::kernels::gemm_f32::PackedF32;
use crate::kernels::gemv_q4k::PackedQ4K;
use crate::kernels::gemv_q8::PackedQ8;
use crate::named::{blocks_name, join, Named};
use crate::quantize::Quantization;

/// The row multiple quantized weights are padded to (candle's x86 tiles).
const QUANTIZED_ROWS: usize = 16;

/// A projection `y = x W^T + b` with `W (out, in)`, dense or quantized.
///
/// A quantized projection keeps the dtype of the dense weight it came from
/// as its activation dtype: it takes and returns activations of that dtype
/// (f32, f16 or bf16) and runs the quantized product in f32 in between. Its
/// bias stays dense (f32).
#[derive(Debug, Clone)]
pub struct Proj {
    inner: Inner,
}

#[derive(Debug, Clone)]
enum Inner {
    Dense(Linear),
    Quantized {
        weight: QMatMul,
        format: GgmlDType,
        /// f32, added before casting back.
        bias: Option<Tensor>,
        /// The activation dtype (the dense weight's dtype).
        dtype: DType,
        device: Device,
        out_dim: usize,
        in_dim: usize,
    },
    /// A 16-bit weight (`bf16` or `f16`, the format) under activations of
    /// another dtype (`dtype`, f32): half the bytes of an f32 weight, and
    /// on CPU vl's kernels take the f32 activations as they are. The bias
    /// stays in `dtype`.
    Half {
        weight: Tensor,
        bias: Option<Tensor>,
        format: GgmlDType,
        dtype: DType,
    },
    /// A bf16 weight packed once for vl's kernels (CPUs with
    /// AVX512_BF16): as `Half`, without a per-call packing.
    Packed {
        /// The bias inside, added in the kernels' epilogue.
        weight: Arc<PackedBf16>,
        dtype: DType,
    },
    /// A dense f32 weight packed once for vl's f32 product of many rows
    /// (on the CPU): the values of `Dense`, bit for bit, for an
    /// encoder's products ([`Proj::pack_f32`]).
    PackedF32 {
        /// The bias inside, added as the outputs are stored.
        weight: Arc<PackedF32>,
    },
    /// A q8_0 weight packed once for vl's q8_0 kernels (on the CPU).
    Q8 {
        /// The bias inside, added as the outputs are stored.
        weight: Arc<PackedQ8>,
        /// The activation dtype (the dense weight's dtype).
        dtype: DType,
    },
    /// A q4_K weight packed once for vl's q4_K kernels (on the CPU).
    Q4K {
        /// The bias inside, added as the outputs are stored.
        weight: Arc<PackedQ4K>,
        /// The activation dtype (the dense weight's dtype).
        dtype: DType,
    },
}

impl From<Linear> for Proj {
    fn from(linear: Linear) -> Self {
        Self {
            inner: Inner::Dense(linear),
        }
    }
}

impl Proj {
    /// Wraps a dense layer.
    pub fn dense(linear: Linear) -> Self {
        linear.into()
    }

    /// The packed bf16 weight vl's GEMM runs, if the layer holds one
    /// (`bf16` weights under f32 activations on an AVX512_BF16 CPU).
    /// The weight and bias of a dense f32 layer; `None` for the other
    /// forms.
    pub(crate) fn dense_f32(&self) -> Option<(&Tensor, Option<&Tensor>)> {
        match &self.inner {
            Inner::Dense(l) if l.weight().dtype() == DType::F32 => Some((l.weight(), l.bias())),
            _ => None,
        }
    }

    /// The packed f32 weight, if the layer holds one ([`Proj::pack_f32`]).
    pub(crate) fn packed_f32(&self) -> Option<&Arc<PackedF32>> {
        match &self.inner {
            Inner::PackedF32 { weight } => Some(weight),
            _ => None,
        }
    }

    /// A copy whose dense f32 CPU weight is packed once for vl's f32
    /// product of many rows ([`PackedF32`]), the bias inside; any other
    /// layer (quantized, 16-bit, on another device, tracked for training)
    /// is returned as it is. The products give the values of the dense
    /// layer, bit for bit, on every row count of more than a decode
    /// step's; a decode step's few rows run the packed product too, which
    /// is slower than the dense layer's GEMV: pack an encoder's layers,
    /// not a decoder's. The weight is held once (packed), as
    /// [`Proj::weight_and_bias`] unpacks it.
    ///
    /// # Errors
    /// Only candle's, reading the weight.
    pub fn pack_f32(&self) -> Result<Self> {
        match &self.inner {
            Inner::Dense(l)
                if l.weight().dtype() == DType::F32
                    && l.weight().device().is_cpu()
                    && !l.weight().track_op() =>
            {
                let bias = l.bias().map(|b| b.to_dtype(DType::F32)).transpose()?;
                Ok(Self {
                    inner: Inner::PackedF32 {
                        weight: Arc::new(PackedF32::pack(l.weight(), bias.as_ref())?),
                    },
                })
            }
            _ => Ok(self.clone()),
        }
    }

    pub(crate) fn packed_bf16(&self) -> Option<&Arc<PackedBf16>> {
        match &self.inner {
            Inner::Packed { weight, dtype } if *dtype == DType::F32 => Some(weight),
            _ => None,
        }
    }

    /// `GELU(x W^T + b)` in f32 with the GELU applied as the product
    /// stores its outputs, where the layer holds a weight in vl's q8_0 or
    /// q4k tiles; `None` for the other forms.
    pub(crate) fn matmul_gelu_tiled(
        &self,
        x: &Tensor,
        exact: bool,
    ) -> Option<candle_core::Result<Tensor>> {
        match &self.inner {
            Inner::Q8 { weight, .. } => Some(weight.matmul_gelu(x, exact)),
            Inner::Q4K { weight, .. } => Some(weight.matmul_gelu(x, exact)),
            _ => None,
        }
    }

    /// `residual + (x W^T + b)`: the bits of [`crate::kernels::add::add`]
    /// of the residual and [`Module::forward`]'s output. Where the layer
    /// holds vl's q8_0 tiles and the product runs on AMX (an encoder's
    /// many rows, [`crate::kernels::q8_amx`]), the residual is added as
    /// the product stores its outputs: no pass of its own over them (the
    /// residual additions of a Florence-2 q8_0 encode were 6% of it).
    ///
    /// # Errors
    /// The product's; a residual of another shape than the output.
    ///
    /// # Shapes
    /// `x: (..., in)`, `residual: (..., out)` → `(..., out)`.
    pub fn forward_add(&self, x: &Tensor, residual: &Tensor) -> candle_core::Result<Tensor> {
        if let Inner::Q8 { weight, .. } = &self.inner {
            if x.dtype() == DType::F32 && !x.track_op() && !residual.track_op() {
                let isa = crate::kernels::CpuFeatures::get().q8_isa();
                if let Some(y) =
                    crate::kernels::gemv_q8::matmul_tiled_add(&**weight, isa, x, residual)?
                {
                    return Ok(y);
                }
            }
        }
        crate::kernels::add::add(residual, &self.forward(x)?)
    }

    /// `down(GELU(up(x)))` for an encoder's many rows, a chunk of rows
    /// at a time with the hidden layer kept in cache, where both layers
    /// hold vl's q8_0 or q4k tiles (see
    /// `crate::kernels::gemv_q8::ffn_tiled`); `None` for the other forms,
    /// a few rows or a hidden layer too wide for it to pay.
    pub(crate) fn ffn_tiled(
        up: &Proj,
        down: &Proj,
        x: &Tensor,
        exact: bool,
    ) -> candle_core::Result<Option<Tensor>> {
        use crate::kernels::gemv_q8::ffn_tiled;
        let isa = crate::kernels::CpuFeatures::get().q8_isa();
        match (&up.inner, &down.inner) {
            (Inner::Q8 { weight: u, .. }, Inner::Q8 { weight: d, .. }) => {
                ffn_tiled(&**u, &**d, isa, x, exact)
            }
            (Inner::Q8 { weight: u, .. }, Inner::Q4K { weight: d, .. }) => {
                ffn_tiled(&**u, &**d, isa, x, exact)
            }
            (Inner::Q4K { weight: u, .. }, Inner::Q8 { weight: d, .. }) => {
                ffn_tiled(&**u, &**d, isa, x, exact)
            }
            (Inner::Q4K { weight: u, .. }, Inner::Q4K { weight: d, .. }) => {
                ffn_tiled(&**u, &**d, isa, x, exact)
            }
            _ => Ok(None),
        }
    }

    /// `x W^T + b` in f32 into a layout of the caller's, where the layer
    /// holds vl's q8_0 or q4k tiles (see
    /// `crate::kernels::gemv_q8::matmul_tiled_placed`); `None` for the
    /// other forms.
    ///
    /// # Safety
    /// The places of every row's every tile of 16 outputs are disjoint,
    /// within `len`, and together cover it.
    pub(crate) unsafe fn matmul_placed(
        &self,
        x: &Tensor,
        rows: &[usize],
        tiles: &[usize],
        len: usize,
    ) -> Option<candle_core::Result<Vec<f32>>> {
        use crate::kernels::gemv_q8::matmul_tiled_placed;
        let isa = crate::kernels::CpuFeatures::get().q8_isa();
        // SAFETY: the caller's contract.
        unsafe {
            match &self.inner {
                Inner::Q8 { weight, .. } => {
                    Some(matmul_tiled_placed(&**weight, isa, x, rows, tiles, len))
                }
                Inner::Q4K { weight, .. } => {
                    Some(matmul_tiled_placed(&**weight, isa, x, rows, tiles, len))
                }
                _ => None,
            }
        }
    }

    /// [`Proj::matmul_placed`] of several layers at once over the same
    /// `x`, as one product ([`crate::kernels::gemv_q8::Stacked`]: `x`
    /// rounded once, the tiles of all split across the pool): tile `t` of
    /// the whole is layer `w`'s tile `t - Σ tiles before w`. Where every
    /// layer holds vl's q8_0 tiles (or every one q4k tiles) of one width
    /// and whole tiles; `None` otherwise.
    ///
    /// # Safety
    /// As [`Proj::matmul_placed`], for the whole's tiles.
    pub(crate) unsafe fn matmul_placed_stacked(
        projs: &[&Proj],
        x: &Tensor,
        rows: &[usize],
        tiles: &[usize],
        len: usize,
    ) -> Option<candle_core::Result<Vec<f32>>> {
        use crate::kernels::gemv_q8::{matmul_tiled_placed, Stacked};
        let isa = crate::kernels::CpuFeatures::get().q8_isa();
        let q8: Option<Vec<&PackedQ8>> = projs.iter().map(|p| p.packed_q8()).collect();
        let q4k: Option<Vec<&PackedQ4K>> = projs.iter().map(|p| p.packed_q4k()).collect();
        // SAFETY: the caller's contract.
        unsafe {
            match (q8, q4k) {
                (Some(q8), _) => Some(matmul_tiled_placed(
                    &Stacked::new(&q8)?,
                    isa,
                    x,
                    rows,
                    tiles,
                    len,
                )),
                (_, Some(q4k)) => Some(matmul_tiled_placed(
                    &Stacked::new(&q4k)?,
                    isa,
                    x,
                    rows,
                    tiles,
                    len,
                )),
                _ => None,
            }
        }
    }

    /// The packed q8_0 weight, if the layer holds one.
    fn packed_q8(&self) -> Option<&PackedQ8> {
        match &self.inner {
            Inner::Q8 { weight, .. } => Some(weight),
            _ => None,
        }
    }

    /// The packed q4_K weight, if the layer holds one.
    fn packed_q4k(&self) -> Option<&PackedQ4K> {
        match &self.inner {
            Inner::Q4K { weight, .. } => Some(weight),
            _ => None,
        }
    }

    /// The weight's shape `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        match &self.inner {
            Inner::Dense(l) => match l.weight().dims() {
                &[out, inp] => (out, inp),
                _ => (0, 0),
            },
            Inner::Quantized {
                out_dim, in_dim, ..
            } => (*out_dim, *in_dim),
            Inner::Half { weight, .. } => weight.dims2().unwrap_or((0, 0)),
            Inner::Packed { weight, .. } => weight.dims(),
            Inner::PackedF32 { weight } => weight.dims(),
            Inner::Q8 { weight, .. } => weight.dims(),
            Inner::Q4K { weight, .. } => weight.dims(),
        }
    }

    /// The dtype of the activations it takes and returns.
    pub fn dtype(&self) -> DType {
        match &self.inner {
            Inner::Dense(l) => l.weight().dtype(),
            Inner::PackedF32 { .. } => DType::F32,
            Inner::Quantized { dtype, .. }
            | Inner::Half { dtype, .. }
            | Inner::Packed { dtype, .. }
            | Inner::Q8 { dtype, .. }
            | Inner::Q4K { dtype, .. } => *dtype,
        }
    }

    /// The device of the weight.
    pub fn device(&self) -> &Device {
        match &self.inner {
            Inner::Dense(l) => l.weight().device(),
            Inner::Quantized { device, .. } => device,
            Inner::Half { weight, .. } => weight.device(),
            Inner::Packed { .. }
            | Inner::PackedF32 { .. }
            | Inner::Q8 { .. }
            | Inner::Q4K { .. } => &Device::Cpu,
        }
    }

    /// The quantized format, `None` when dense (packed or not).
    pub fn quantization(&self) -> Option<GgmlDType> {
        match &self.inner {
            Inner::Dense(_) | Inner::PackedF32 { .. } => None,
            Inner::Quantized { format, .. } | Inner::Half { format, .. } => Some(*format),
            Inner::Packed { .. } => Some(GgmlDType::BF16),
            Inner::Q8 { .. } => Some(GgmlDType::Q8_0),
            Inner::Q4K { .. } => Some(GgmlDType::Q4K),
        }
    }

    /// The bytes the weight holds per weight, as this projection stores
    /// it: its dtype's size when dense or 16-bit; for `q8_0` and candle's
    /// quantized formats a block's bytes over its values (34/32 for
    /// `q8_0`, 144/256 for `q4k`); for `q4k` in vl's CPU tiles
    /// [`PackedQ4K::BYTES_PER_WEIGHT`] (148/256).
    pub fn bytes_per_weight(&self) -> f64 {
        let per_block = |f: GgmlDType| f.type_size() as f64 / f.block_size() as f64;
        match &self.inner {
            Inner::Dense(l) => l.weight().dtype().size_in_bytes() as f64,
            Inner::Half { weight, .. } => weight.dtype().size_in_bytes() as f64,
            Inner::Packed { .. } => DType::BF16.size_in_bytes() as f64,
            Inner::PackedF32 { .. } => DType::F32.size_in_bytes() as f64,
            Inner::Q8 { .. } => per_block(GgmlDType::Q8_0),
            Inner::Q4K { .. } => PackedQ4K::BYTES_PER_WEIGHT,
            Inner::Quantized { format, .. } => per_block(*format),
        }
    }

    /// The dense layer, `None` when quantized or packed.
    pub fn as_linear(&self) -> Option<&Linear> {
        match &self.inner {
            Inner::Dense(l) => Some(l),
            Inner::Quantized { .. }
            | Inner::Half { .. }
            | Inner::Packed { .. }
            | Inner::PackedF32 { .. }
            | Inner::Q8 { .. }
            | Inner::Q4K { .. } => None,
        }
    }

    /// Checks that the weight is `(out, inp)`, naming the layer otherwise.
    pub(crate) fn check(&self, name: &'static str, out: usize, inp: usize) -> Result<()> {
        if self.dims() != (out, inp) {
            let (o, i) = self.dims();
            return Err(AttnError::Shape {
                arg: name,
                expected: format!("({out}, {inp})"),
                actual: vec![o, i],
            });
        }
        Ok(())
    }

    /// A copy whose weight is quantized to `format` (e.g.
    /// [`GgmlDType::Q8_0`], [`GgmlDType::Q4K`]); the bias stays dense.
    ///
    /// [`GgmlDType::BF16`] and [`GgmlDType::F16`] keep the weight dense in
    /// that 16-bit type while the activations keep their dtype (f32): on
    /// CPU, [`crate::kernels::gemv`] and [`crate::kernels::gemm_bf16`] read the 16-bit weight
    /// with f32 activations and accumulate in f32; elsewhere the
    /// activations are cast to the weight's type around candle's matmul.
    ///
    /// `name` names the layer in errors (e.g. `"q_proj"`; callers prefix it
    /// with [`AttnError::within`]). A projection already in `format` is
    /// returned as is; one in another format is re-quantized from its
    /// dequantized weight, which adds the two rounding errors.
    ///
    /// # Errors
    /// [`AttnError::Quantize`] when the input width is not a multiple of the
    /// format's block size.
    pub fn quantize(&self, name: &str, format: GgmlDType) -> Result<Self> {
        let (out_dim, in_dim) = self.dims();
        let block = format.block_size();
        if in_dim % block != 0 {
            return Err(AttnError::Quantize {
                layer: name.to_string(),
                format: format!("{format:?}"),
                out_dim,
                in_dim,
                block,
            });
        }
        if self.quantization() == Some(format) {
            return Ok(self.clone());
        }
        let (weight, bias) = self.weight_and_bias()?;
        if let Some(half) = match format {
            GgmlDType::BF16 => Some(DType::BF16),
            GgmlDType::F16 => Some(DType::F16),
            _ => None,
        } {
            // A buffer of its own (a weight narrowed out of a fused one
            // would otherwise keep the whole storage alive).
            let weight = weight.to_dtype(half)?.copy()?;
            let bias = bias.map(|b| b.to_dtype(self.dtype())).transpose()?;
            if half == DType::BF16 && weight.device().is_cpu() && in_dim % 2 == 0 {
                if let Some(packed) = PackedBf16::new(&weight, bias.as_ref())? {
                    return Ok(Self {
                        inner: Inner::Packed {
                            weight: Arc::new(packed),
                            dtype: self.dtype(),
                        },
                    });
                }
            }
            return Ok(Self {
                inner: Inner::Half {
                    weight,
                    bias,
                    format,
                    dtype: self.dtype(),
                },
            });
        }
        if format == GgmlDType::Q8_0 && self.device().is_cpu() {
            // vl's q8_0 kernels: one packed copy, products on the pool.
            return Ok(Self {
                inner: Inner::Q8 {
                    weight: Arc::new(PackedQ8::quantize(&weight)?.with_bias(bias.as_ref())?),
                    dtype: self.dtype(),
                },
            });
        }
        if format == GgmlDType::Q4K && self.device().is_cpu() {
            // vl's q4_K kernels: likewise.
            return Ok(Self {
                inner: Inner::Q4K {
                    weight: Arc::new(PackedQ4K::quantize(&weight)?.with_bias(bias.as_ref())?),
                    dtype: self.dtype(),
                },
            });
        }
        // candle's `QTensor::quantize` reads the whole storage from its start
        // and ignores the view's layout: a weight narrowed out of a larger
        // one (a split fused projection) would quantize the wrong rows — only
        // a debug assertion catches it. Quantize from the view's own values
        // (read in place on the CPU, a copy elsewhere). candle's fastest x86 kernels
        // (VNNI tiles) take weights of a multiple of 16 rows: a layer of
        // another height (an LM head over 50257 tokens) gets zero rows in
        // that buffer, cut off after the product.
        let padded = out_dim.next_multiple_of(QUANTIZED_ROWS);
        let dense = weight.to_dtype(DType::F32)?;
        let q = if weight.device().is_cpu() {
            crate::kernels::with_values(&dense, |values: &[f32]| {
                quantize_rows(values, in_dim, padded, format)
            })??
        } else {
            let mut values = dense.flatten_all()?.to_vec1::<f32>()?;
            drop(dense);
            values.resize(padded * in_dim, 0.0);
            QTensor::quantize(
                &Tensor::from_vec(values, (padded, in_dim), weight.device())?,
                format,
            )?
        };
        Ok(Self {
            inner: Inner::Quantized {
                weight: QMatMul::from_arc(Arc::new(q))?,
                format,
                bias: bias.map(|b| b.to_dtype(DType::F32)).transpose()?,
                dtype: self.dtype(),
                device: self.device().clone(),
                out_dim,
                in_dim,
            },
        })
    }
}

impl Proj {
    /// The weight `(out, in)` and bias the layer computes with: a dense
    /// layer's own tensors; a converted layer's values in f32 (its blocks
    /// dequantized, its 16-bit values widened).
    pub fn weight_and_bias(&self) -> Result<(Tensor, Option<Tensor>)> {
        let out_dim = self.dims().0;
        Ok(match &self.inner {
            Inner::Dense(l) => (l.weight().clone(), l.bias().cloned()),
            Inner::Quantized { weight, bias, .. } => {
                let w = match weight {
                    QMatMul::QTensor(q) => q.dequantize(self.device())?,
                    QMatMul::Tensor(w) | QMatMul::TensorF16(w) => w.to_dtype(DType::F32)?,
                };
                // Without the zero rows of the padding.
                (w.narrow(0, 0, out_dim)?, bias.clone())
            }
            Inner::Half { weight, bias, .. } => (weight.to_dtype(DType::F32)?, bias.clone()),
            Inner::Packed { weight, .. } => {
                (weight.unpack()?.to_dtype(DType::F32)?, weight.bias()?)
            }
            Inner::PackedF32 { weight } => (weight.unpack()?, weight.bias()?),
            Inner::Q8 { weight, .. } => (weight.dequantize()?, weight.bias()?),
            Inner::Q4K { weight, .. } => (weight.dequantize()?, weight.bias()?),
        })
    }

    /// Adds the layer's tensors under `prefix` (see [`crate::named`]):
    /// `prefix.bias` when it has one, and its weight as it holds it —
    /// dense or 16-bit as `prefix.weight` in its own dtype; `q8_0` and
    /// `q4k` blocks as `prefix.weight.q8_0` or `prefix.weight.q4k`, a `u8`
    /// tensor `(out, bytes per row)` in candle's (ggml's) block layout,
    /// which [`Proj::from_blocks`] takes back; candle's other formats
    /// dequantized to f32.
    pub fn named_tensors(&self, prefix: &str, out: &mut Named) -> Result<()> {
        let (out_dim, in_dim) = self.dims();
        // A row's bytes in `q`'s blocks (q8_0 or q4k).
        let row_bytes =
            |q: Quantization| in_dim / q.block_size() * q.ggml_dtype().map_or(0, |f| f.type_size());
        let blocks = |q: Quantization, bytes: Vec<u8>| -> Result<(String, Tensor)> {
            let rows = Tensor::from_vec(bytes, (out_dim, row_bytes(q)), &Device::Cpu)?;
            Ok((blocks_name(&join(prefix, "weight"), q), rows))
        };
        let (weight, bias) = match &self.inner {
            Inner::Dense(l) => (
                (join(prefix, "weight"), l.weight().clone()),
                l.bias().cloned(),
            ),
            Inner::Half { weight, bias, .. } => {
                ((join(prefix, "weight"), weight.clone()), bias.clone())
            }
            Inner::Packed { weight, .. } => {
                ((join(prefix, "weight"), weight.unpack()?), weight.bias()?)
            }
            Inner::PackedF32 { weight } => {
                ((join(prefix, "weight"), weight.unpack()?), weight.bias()?)
            }
            Inner::Q8 { weight, .. } => (
                blocks(Quantization::Q8_0, weight.to_blocks())?,
                weight.bias()?,
            ),
            Inner::Q4K { weight, .. } => (
                blocks(Quantization::Q4K, weight.to_blocks())?,
                weight.bias()?,
            ),
            Inner::Quantized {
                weight: QMatMul::QTensor(q),
                format: format @ (GgmlDType::Q8_0 | GgmlDType::Q4K),
                bias,
                ..
            } => {
                let held = if *format == GgmlDType::Q8_0 {
                    Quantization::Q8_0
                } else {
                    Quantization::Q4K
                };
                // Without the padding rows' blocks.
                let bytes = q.data()?[..out_dim * row_bytes(held)].to_vec();
                (blocks(held, bytes)?, bias.clone())
            }
            Inner::Quantized { .. } => {
                let (w, b) = self.weight_and_bias()?;
                ((join(prefix, "weight"), w), b)
            }
        };
        out.insert(weight.0, weight.1);
        if let Some(b) = bias {
            out.insert(join(prefix, "bias"), b);
        }
        Ok(())
    }

    /// A layer of `q8_0` or `q4k` blocks (candle's layout, e.g. written by
    /// [`Proj::named_tensors`]) with `bias`, under activations of `dtype`:
    /// on the CPU packed for vl's kernels, elsewhere candle's. The blocks
    /// are taken as they are, not quantized again.
    ///
    /// # Errors
    /// A format other than `q8_0` and `q4k`, or blocks that do not make a
    /// 2-D weight, named.
    pub fn from_blocks(q: QTensor, bias: Option<&Tensor>, dtype: DType) -> Result<Self> {
        let (out_dim, in_dim) = q.shape().dims2()?;
        let bias = bias.map(|b| b.to_dtype(DType::F32)).transpose()?;
        let inner = match (q.dtype(), q.device().is_cpu()) {
            (GgmlDType::Q8_0, true) => Inner::Q8 {
                weight: Arc::new(PackedQ8::from_qtensor(&q)?.with_bias(bias.as_ref())?),
                dtype,
            },
            (GgmlDType::Q4K, true) => Inner::Q4K {
                weight: Arc::new(PackedQ4K::from_qtensor(&q)?.with_bias(bias.as_ref())?),
                dtype,
            },
            (format @ (GgmlDType::Q8_0 | GgmlDType::Q4K), false) => {
                let device = q.device();
                Inner::Quantized {
                    weight: QMatMul::from_arc(Arc::new(q))?,
                    format,
                    bias,
                    dtype,
                    device,
                    out_dim,
                    in_dim,
                }
            }
            (other, _) => {
                return Err(AttnError::Argument {
                    arg: "blocks",
                    reason: format!("takes q8_0 or q4k blocks, got {other:?}"),
                })
            }
        };
        Ok(Self { inner })
    }
}

/// candle's `QTensor::quantize` of a CPU weight `(rows, in_dim)` (row-major
/// `values`, `in_dim` a multiple of the format's block) followed by zero
/// rows up to `padded` rows, its rows split across the rayon pool: candle
/// quantizes on the calling thread, and a k-quant's search for each
/// block's scales is slow (q4k has vl's own, [`crate::kernels::q4k`]). Every row is whole
/// blocks, so the quantized rows of the parts, concatenated, are the bytes
/// of the whole; each part is copied once, into the tensor candle takes.
fn quantize_rows(
    values: &[f32],
    in_dim: usize,
    padded: usize,
    format: GgmlDType,
) -> Result<QTensor> {
    use rayon::prelude::*;
    let rows = values.len() / in_dim.max(1);
    let per_task = rows
        .div_ceil(rayon::current_num_threads().max(1) * 4)
        .max(QUANTIZED_ROWS);
    let quantize = |part: &[f32]| -> candle_core::Result<Vec<u8>> {
        let part = Tensor::from_slice(part, (part.len() / in_dim, in_dim), &Device::Cpu)?;
        Ok(QTensor::quantize(&part, format)?.data()?.into_owned())
    };
    let mut parts = values
        .par_chunks(per_task * in_dim)
        .map(quantize)
        .collect::<candle_core::Result<Vec<_>>>()?;
    if padded > rows {
        parts.push(quantize(&vec![0f32; (padded - rows) * in_dim])?);
    }
    let bytes = parts.concat();
    drop(parts);
    let storage = candle_core::quantized::QStorage::from_data(
        std::borrow::Cow::Owned(bytes),
        &Device::Cpu,
        format,
    )?;
    Ok(QTensor::new(storage, (padded, in_dim))?)
}

/// `x W^T + b` on vl's CPU kernels when one takes these operands —
/// decode shapes on [`crate::kernels::gemv`], many bf16 rows on
/// [`crate::kernels::gemm_bf16`], many f32 rows on
/// [`crate::kernels::gemm_f32`] where the CPU's tuning chose it (which
/// adds the bias as it stores) — `None` when none does (training, other
/// devices, f32 prefill on candle's product).
fn vl_product(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Option<candle_core::Result<Tensor>> {
    if crate::kernels::gemv::applies(x, w) {
        Some(crate::kernels::gemv::apply(x, w).and_then(|y| add_bias(y, b)))
    } else if crate::kernels::gemm_bf16::applies(x, w) {
        Some(crate::kernels::gemm_bf16::apply(x, w).and_then(|y| add_bias(y, b)))
    } else if crate::kernels::gemm_f32::applies(x, w) {
        Some(crate::kernels::gemm_f32::apply(x, w, b))
    } else {
        None
    }
}

impl Proj {
    /// [`Module::forward`] with f32 outputs whatever the activation dtype:
    /// what an LM head of a 16-bit model should give, since rounding
    /// logits to bf16 (8 significant bits) ties and flips the largest ones.
    ///
    /// On CPU every kind of weight takes the activations widened to f32
    /// and accumulates in f32 (dense and 16-bit weights on vl's kernels
    /// where [`crate::kernels::gemv`] or [`crate::kernels::gemm_bf16`] takes them; q8_0 and
    /// candle's quantized kernels, on every device, as always), so nothing
    /// is rounded to 16 bits on the way. Otherwise (dense weights on other
    /// devices, training, f16 prefill) the product runs in the activation
    /// dtype and is widened after.
    ///
    /// # Shapes
    /// `x: (..., in)` → `(..., out)` f32.
    pub fn forward_f32(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (weight, bias) = match &self.inner {
            Inner::Dense(l) => (l.weight(), l.bias()),
            Inner::Half { weight, bias, .. } => (weight, bias.as_ref()),
            Inner::Packed { weight, .. } => return weight.matmul(&x.to_dtype(DType::F32)?),
            Inner::PackedF32 { weight } => return weight.matmul(&x.to_dtype(DType::F32)?),
            Inner::Q8 { weight, .. } => return weight.matmul(&x.to_dtype(DType::F32)?),
            Inner::Q4K { weight, .. } => return weight.matmul(&x.to_dtype(DType::F32)?),
            // The quantized kernels take f32 activations on every device.
            Inner::Quantized { .. } => return self.forward(&x.to_dtype(DType::F32)?),
        };
        let wide = x.to_dtype(DType::F32)?;
        let bias = bias.map(|b| b.to_dtype(DType::F32)).transpose()?;
        match vl_product(&wide, weight, bias.as_ref()) {
            Some(y) => y,
            None => self
                .forward(&x.to_dtype(self.dtype())?)?
                .to_dtype(DType::F32),
        }
    }
}

/// `y + b`, broadcast over the rows.
fn add_bias(y: Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

impl Module for Proj {
    /// # Shapes
    /// `x: (..., in)` → `(..., out)`, in `x`'s dtype.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match &self.inner {
            Inner::Dense(l) => match vl_product(x, l.weight(), l.bias()) {
                Some(y) => y,
                None => l.forward(x),
            },
            Inner::Half { weight, bias, .. } => match vl_product(x, weight, bias.as_ref()) {
                Some(y) => y,
                // Activations cast to the weight's type and back.
                None => add_bias(
                    x.to_dtype(weight.dtype())?
                        .broadcast_matmul(&weight.t()?)?
                        .to_dtype(x.dtype())?,
                    bias.as_ref(),
                ),
            },
            Inner::Packed { weight, .. } => weight.matmul(x),
            Inner::PackedF32 { weight } => weight.matmul(x),
            Inner::Q8 { weight, .. } => weight.matmul(x)?.to_dtype(x.dtype()),
            Inner::Q4K { weight, .. } => weight.matmul(x)?.to_dtype(x.dtype()),
            Inner::Quantized {
                weight,
                bias,
                out_dim,
                ..
            } => {
                // The quantized kernels take contiguous f32 activations.
                let mut y = weight.forward(&x.to_dtype(DType::F32)?.contiguous()?)?;
                if y.dim(candle_core::D::Minus1)? > *out_dim {
                    y = y.narrow(candle_core::D::Minus1, 0, *out_dim)?;
                }
                add_bias(y, bias.as_ref())?.to_dtype(x.dtype())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `forward_add` is the residual plus `forward`, bit for bit, for
    /// every form of weight, a decode step's rows and an encoder's (which
    /// q8_0 tiles run on AMX where the CPU has it, the residual added as
    /// they store); a residual of another shape is an error.
    #[test]
    fn forward_add_is_the_residual_plus_forward() -> Result<()> {
        use crate::quantize::{Quantization, Quantizer};
        let dev = Device::Cpu;
        let dense = Proj::from(layer(80, 64, &dev)?);
        let forms = [
            ("dense", dense.clone()),
            (
                "q8_0",
                Quantizer::strict(Quantization::Q8_0).proj("p", &dense)?,
            ),
            (
                "q4k",
                Quantizer::strict(Quantization::Q4K)
                    .proj("p", &Proj::from(layer(80, 256, &dev)?))?,
            ),
            (
                "bf16",
                Quantizer::strict(Quantization::Bf16).proj("p", &dense)?,
            ),
            ("packed f32", Quantizer::packing_f32().proj("p", &dense)?),
        ];
        for (name, p) in &forms {
            let k = p.dims().1;
            for rows in [3, 150] {
                let x = Tensor::randn(0f32, 1., (2, rows, k), &dev)?;
                let r = Tensor::randn(0f32, 1., (2, rows, 80), &dev)?;
                let fused = p.forward_add(&x, &r)?;
                let apart = crate::kernels::add::add(&r, &p.forward(&x)?)?;
                assert!(
                    crate::layers::same_bits(&fused, &apart)?,
                    "{name}, {rows} rows"
                );
            }
            let x = Tensor::randn(0f32, 1., (150, k), &dev)?;
            let wrong = Tensor::zeros((150, 81), DType::F32, &dev)?;
            assert!(p.forward_add(&x, &wrong).is_err(), "{name}");
        }
        Ok(())
    }

    /// A dense f32 layer packed ([`Proj::pack_f32`]) gives the dense
    /// layer's values: bit for bit where the dense layer's many rows run
    /// vl's f32 product (this CPU's tuning), within 1e-5 relative where
    /// they run candle's; its weight, bias and saved tensors are the
    /// dense layer's, and quantizing it is quantizing the dense layer.
    /// Other forms are not packed.
    #[test]
    fn packed_f32_is_the_dense_layer() -> Result<()> {
        use crate::quantize::{Quantization, Quantizer};
        let dev = Device::Cpu;
        for (out, inp, bias) in [(80, 64, true), (33, 70, false), (768, 768, true)] {
            let l = layer(out, inp, &dev)?;
            let dense = if bias {
                Proj::from(l)
            } else {
                Proj::from(Linear::new(l.weight().clone(), None))
            };
            let packed = dense.pack_f32()?;
            assert!(packed.packed_f32().is_some() && packed.as_linear().is_none());
            assert_eq!(
                (packed.dims(), packed.dtype(), packed.quantization()),
                (dense.dims(), DType::F32, None)
            );
            for rows in [1, 9, 197] {
                let x = Tensor::randn(0f32, 1., (2, rows, inp), &dev)?;
                let (want, got) = (dense.forward(&x)?, packed.forward(&x)?);
                let x2 = x.flatten_to(1)?;
                if crate::kernels::gemm_f32::applies(&x2, dense.as_linear().unwrap().weight()) {
                    assert!(
                        crate::layers::same_bits(&want, &got)?,
                        "{out}x{inp}, {rows} rows"
                    );
                } else {
                    assert!(rel_err(&got, &want)? < 1e-5, "{out}x{inp}, {rows} rows");
                }
                let f32_out = packed.forward_f32(&x)?;
                assert!(crate::layers::same_bits(&f32_out, &got)?);
            }
            let (w, b) = dense.weight_and_bias()?;
            let (pw, pb) = packed.weight_and_bias()?;
            assert!(crate::layers::same_bits(&w, &pw)?);
            assert_eq!(b.is_some(), pb.is_some());
            if let (Some(b), Some(pb)) = (b, pb) {
                assert!(crate::layers::same_bits(&b, &pb)?);
            }
            let (mut a, mut z) = (Named::default(), Named::default());
            dense.named_tensors("p", &mut a)?;
            packed.named_tensors("p", &mut z)?;
            assert_eq!(a.len(), z.len());
            let q8 = |p: &Proj| -> Result<Vec<u8>> {
                let mut n = Named::default();
                Quantizer::strict(Quantization::Q8_0)
                    .proj("p", p)?
                    .named_tensors("p", &mut n)?;
                Ok(n.into_iter()
                    .find(|(k, _)| k.contains("weight"))
                    .unwrap()
                    .1
                    .flatten_all()?
                    .to_vec1::<u8>()?)
            };
            if inp % 32 == 0 {
                assert_eq!(q8(&dense)?, q8(&packed)?);
            }
        }
        let q8 =
            Quantizer::strict(Quantization::Q8_0).proj("p", &Proj::from(layer(8, 64, &dev)?))?;
        assert!(q8.pack_f32()?.packed_f32().is_none());
        let half = Proj::from(Linear::new(
            Tensor::zeros((8, 64), DType::BF16, &dev)?,
            None,
        ));
        assert!(half.pack_f32()?.packed_f32().is_none());
        Ok(())
    }

    fn rel_err(a: &Tensor, b: &Tensor) -> Result<f32> {
        let a = a.to_dtype(DType::F32)?;
        let b = b.to_dtype(DType::F32)?;
        let num = (&a - &b)?.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
        let den = b.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
        Ok(num / den)
    }

    fn layer(out: usize, inp: usize, dev: &Device) -> Result<Linear> {
        let w = (Tensor::randn(0f32, 1., (out, inp), dev)? / (inp as f64).sqrt())?;
        Ok(Linear::new(w, Some(Tensor::randn(0f32, 1., out, dev)?)))
    }

    /// Quantizing rows in parallel parts gives candle's bytes for the whole
    /// weight, exactly, for heights that split unevenly across the tasks.
    #[test]
    fn quantizing_rows_in_parts_is_quantizing_the_whole() -> Result<()> {
        let dev = Device::Cpu;
        for (rows, format) in [
            (37, GgmlDType::Q4K),
            (300, GgmlDType::Q4K),
            (300, GgmlDType::Q6K),
            (129, GgmlDType::Q4_0),
            (129, GgmlDType::Q8_0),
        ] {
            let w = Tensor::randn(0f32, 1., (rows, 256), &dev)?;
            let values = w.flatten_all()?.to_vec1::<f32>()?;
            let parts = quantize_rows(&values, 256, rows, format)?;
            let whole = QTensor::quantize(&w, format)?;
            assert_eq!(parts.shape().dims(), &[rows, 256]);
            assert_eq!(parts.dtype(), format);
            assert!(parts.data()? == whole.data()?, "{format:?} x {rows} rows");
        }
        Ok(())
    }

    /// A weight narrowed out of a fused one (a view with an offset, as the
    /// split of GPT-2's `c_attn`) quantizes its own rows, not the start of
    /// the shared buffer.
    #[test]
    fn narrowed_weights_quantize_their_own_rows() -> Result<()> {
        let dev = Device::Cpu;
        let fused = Tensor::randn(0f32, 1., (96, 32), &dev)?;
        let x = Tensor::randn(0f32, 1., (1, 2, 32), &dev)?;
        for part in 0..3 {
            let w = fused.narrow(0, 32 * part, 32)?.contiguous()?;
            let dense = Proj::from(Linear::new(w, None));
            let q = dense.quantize("k_proj", GgmlDType::Q8_0)?;
            let err = rel_err(&q.forward(&x)?, &dense.forward(&x)?)?;
            assert!(err < 0.015, "part {part}: relative error {err}");
        }
        Ok(())
    }

    /// A layer whose height is not a multiple of 16 (padded with zero rows
    /// for candle's tiled kernels) keeps its shape: outputs of its own
    /// width for 1 and many rows, each within the format's error of the
    /// dense layer, and re-quantizing sees its own rows. The error is on
    /// the scale of an output (rms of `x`: the weights have variance
    /// about `1 / in`), since a single output may be near 0; the inputs
    /// are seeded.
    #[test]
    fn quantized_layers_of_any_height_keep_their_width() -> Result<()> {
        let dev = Device::Cpu;
        // Reproducible values, uniform in [-1, 1).
        let seeded = |shape: (usize, usize), seed: u64| {
            let mut s = seed.wrapping_mul(6364136223846793005) | 1;
            let v: Vec<f32> = (0..shape.0 * shape.1)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
                })
                .collect();
            Tensor::from_vec(v, shape, &dev)
        };
        for out in [1, 37, 50, 64] {
            let w = (seeded((out, 256), out as u64)? / 16.0)?;
            let dense = Proj::from(Linear::new(w, None));
            for (format, tol) in [(GgmlDType::Q8_0, 0.02), (GgmlDType::Q4K, 0.2)] {
                let q = dense.quantize("lm_head", format)?;
                assert_eq!(q.dims(), (out, 256));
                for rows in [1, 3, 20] {
                    let x = seeded((rows, 256), 1000 + rows as u64)?;
                    let (got, want) = (q.forward(&x)?, dense.forward(&x)?);
                    assert_eq!(got.dims(), &[rows, out]);
                    let worst = (got - want)?.abs()?.max_all()?;
                    let err = (worst / x.sqr()?.mean_all()?.sqrt()?)?.to_scalar::<f32>()?;
                    assert!(err < tol, "{format:?} out {out} rows {rows}: {err}");
                }
                let again = q.quantize("lm_head", GgmlDType::Q8_0)?;
                assert_eq!(again.dims(), (out, 256));
                let x = seeded((2, 256), 7)?;
                assert_eq!(again.forward(&x)?.dims(), &[2, out]);
            }
        }
        Ok(())
    }

    /// A dense projection of decode shapes (1 to 8 rows, plain tensors)
    /// runs vl's kernel and equals candle's `Linear` within 1e-5 relative
    /// (f32) or 1e-2 (bf16), bias included; with a tracked weight it runs
    /// candle's matmul and the gradients reach the weight.
    #[test]
    fn dense_decode_shapes_match_linear_and_train() -> Result<()> {
        let dev = Device::Cpu;
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
            let l = layer(37, 70, &dev)?;
            let l = Linear::new(
                l.weight().to_dtype(dtype)?,
                l.bias().map(|b| b.to_dtype(dtype)).transpose()?,
            );
            let proj = Proj::from(l.clone());
            for rows in [1, 3, 8, 9, 70] {
                let x = Tensor::randn(0f32, 1., (rows, 1, 70), &dev)?.to_dtype(dtype)?;
                assert_eq!(crate::kernels::gemv::applies(&x, l.weight()), rows <= 8);
                let err = rel_err(&proj.forward(&x)?, &l.forward(&x)?)?;
                assert!(err < tol, "{dtype:?} rows {rows}: {err}");
            }
        }
        let w = candle_core::Var::from_tensor(&layer(5, 16, &dev)?.weight().clone())?;
        let proj = Proj::from(Linear::new(w.as_tensor().clone(), None));
        let x = Tensor::randn(0f32, 1., (1, 16), &dev)?;
        let grads = proj.forward(&x)?.sum_all()?.backward()?;
        assert!(grads.get(w.as_tensor()).is_some(), "no gradient");
        Ok(())
    }

    /// q8_0 keeps the output within 1.5% (relative L2; seen 0.6-0.7%), q4k
    /// within 10% (seen 5-6%).
    #[test]
    fn quantized_close_to_dense() -> Result<()> {
        let dev = Device::Cpu;
        let dense = Proj::from(layer(48, 256, &dev)?);
        let x = Tensor::randn(0f32, 1., (2, 3, 256), &dev)?;
        let want = dense.forward(&x)?;
        for (format, tol) in [(GgmlDType::Q8_0, 0.015), (GgmlDType::Q4K, 0.1)] {
            let q = dense.quantize("p", format)?;
            assert_eq!(q.quantization(), Some(format));
            assert_eq!(q.dims(), (48, 256));
            let got = q.forward(&x)?;
            assert_eq!(got.dims(), &[2, 3, 48]);
            let err = rel_err(&got, &want)?;
            assert!(err < tol, "{format:?}: relative error {err} >= {tol}");
        }
        Ok(())
    }

    /// `bytes_per_weight` is what each kind of weight holds: 4 dense f32,
    /// 2 for bf16 and f16 weights, q8_0 34/32, q4k 148/256 on the CPU
    /// (`gemv_q4k`'s tests check that against the packed weight's size).
    #[test]
    fn bytes_per_weight_per_kind() -> Result<()> {
        let dev = Device::Cpu;
        let dense = Proj::from(layer(48, 256, &dev)?);
        assert_eq!(dense.bytes_per_weight(), 4.0);
        for (format, want) in [
            (GgmlDType::BF16, 2.0),
            (GgmlDType::F16, 2.0),
            (GgmlDType::Q8_0, 34.0 / 32.0),
            (GgmlDType::Q4K, 148.0 / 256.0),
        ] {
            assert_eq!(
                dense.quantize("p", format)?.bytes_per_weight(),
                want,
                "{format:?}"
            );
        }
        Ok(())
    }

    /// Weights-only bf16 and f16 (`quantize` to `BF16`/`F16`): f32
    /// activations in and out, within 1% (relative L2) of the f32 layer
    /// for decode rows (vl's gemv), many rows (vl's bf16 GEMM where the CPU
    /// has it, candle's matmul on cast activations otherwise) and a
    /// re-quantization to q8_0 from the 16-bit weight.
    #[test]
    fn half_weights_keep_f32_activations() -> Result<()> {
        let dev = Device::Cpu;
        let dense = Proj::from(layer(40, 64, &dev)?);
        for format in [GgmlDType::BF16, GgmlDType::F16] {
            let half = dense.quantize("p", format)?;
            assert_eq!(half.quantization(), Some(format));
            assert_eq!((half.dims(), half.dtype()), ((40, 64), DType::F32));
            assert!(half.as_linear().is_none());
            for rows in [1, 3, 8, 9, 70] {
                let x = Tensor::randn(0f32, 1., (rows, 64), &dev)?;
                let got = half.forward(&x)?;
                assert_eq!(got.dtype(), DType::F32);
                let err = rel_err(&got, &dense.forward(&x)?)?;
                assert!(err < 0.01, "{format:?} rows {rows}: {err}");
            }
            let q = half.quantize("p", GgmlDType::Q8_0)?;
            let x = Tensor::randn(0f32, 1., (2, 64), &dev)?;
            let err = rel_err(&q.forward(&x)?, &dense.forward(&x)?)?;
            assert!(err < 0.02, "{format:?} -> q8_0: {err}");
        }
        Ok(())
    }

    /// f16 and bf16 activations go through the f32 kernel and come back in
    /// their own dtype, within 2% of the dense f32 output.
    #[test]
    fn half_activations() -> Result<()> {
        let dev = Device::Cpu;
        let l = layer(16, 64, &dev)?;
        let x = Tensor::randn(0f32, 1., (1, 2, 64), &dev)?;
        let want = Proj::from(l.clone()).forward(&x)?;
        for dtype in [DType::F16, DType::BF16] {
            let half = Linear::new(
                l.weight().to_dtype(dtype)?,
                l.bias().map(|b| b.to_dtype(dtype)).transpose()?,
            );
            let q = Proj::from(half).quantize("p", GgmlDType::Q8_0)?;
            assert_eq!(q.dtype(), dtype);
            // A transposed, non-contiguous input works too.
            let xt = x.to_dtype(dtype)?.transpose(0, 1)?;
            let got = q.forward(&xt)?;
            assert_eq!(got.dtype(), dtype);
            let err = rel_err(&got.transpose(0, 1)?, &want)?;
            assert!(err < 0.02, "{dtype:?}: relative error {err}");
        }
        Ok(())
    }

    #[test]
    fn unsupported_width_names_layer_and_sizes() -> Result<()> {
        let dense = Proj::from(layer(8, 48, &Device::Cpu)?);
        let err = dense
            .quantize("k_proj", GgmlDType::Q4K)
            .map_err(|e| e.within("blocks.1.cross_attn"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("blocks.1.cross_attn.k_proj") && err.contains("48") && err.contains("256"),
            "{err}"
        );
        assert!(dense.quantize("k_proj", GgmlDType::Q8_0).is_err());
        Ok(())
    }

    #[test]
    fn requantize_same_format_is_identity() -> Result<()> {
        let dev = Device::Cpu;
        let q = Proj::from(layer(8, 64, &dev)?).quantize("p", GgmlDType::Q8_0)?;
        let x = Tensor::randn(0f32, 1., (1, 1, 64), &dev)?;
        let again = q.quantize("p", GgmlDType::Q8_0)?;
        assert_eq!(rel_err(&again.forward(&x)?, &q.forward(&x)?)?, 0.0);
        let q4 = q.quantize("p", GgmlDType::Q4_0)?;
        assert_eq!(q4.quantization(), Some(GgmlDType::Q4_0));
        Ok(())
    }
}

//! The weight formats a model's linear layers can hold ([`Quantization`]),
//! and the one hook every module quantizes through ([`Quantizer`]).
//!
//! Each module's `quantize` hands its projections, by name, to a
//! [`Quantizer`]; the quantizer decides each layer's format. A strict one
//! ([`Quantizer::strict`], what a bare [`GgmlDType`] or [`Quantization`]
//! converts into) refuses a layer the format cannot hold, naming it. A
//! fitting one ([`Quantizer::fitting`], what loaders use) gives such a layer
//! the next format that fits — `q4k` → `q8_0` → dense, as llama.cpp's
//! quantizer does — and records it, so that the caller can say once which
//! layers fell back ([`Quantizer::fallbacks`]).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device};

use crate::error::{AttnError, Result};
use crate::proj::Proj;

/// How a model's linear layers hold their weights.
///
/// Parsed from `"none"` (also `"f32"`, `"dense"`), `"bf16"`, `"f16"`,
/// `"q8_0"` (also `"q8"`) and `"q4k"` (also `"q4_k"`), case-insensitively;
/// displayed as `none`, `bf16`, `f16`, `q8_0`, `q4k`.
///
/// ```
/// use vl_attn::Quantization;
///
/// let q: Quantization = "q8_0".parse().unwrap();
/// assert_eq!(q, Quantization::Q8_0);
/// assert_eq!(q.to_string(), "q8_0");
/// assert!("q3".parse::<Quantization>().is_err());
/// ```
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Quantization {
    /// Dense weights in the model's dtype.
    #[default]
    None,
    /// Dense 16-bit weights (bfloat16) under activations that keep the
    /// model's dtype: half the bytes of f32 weights, no blocks; on CPUs
    /// with AVX512_BF16 the many-row products run on `vdpbf16ps`.
    Bf16,
    /// Dense IEEE half-precision weights under the model's activations.
    F16,
    /// 8-bit blocks of 32 weights with one scale each (about 8.5 bits per
    /// weight); needs input widths that are multiples of 32.
    Q8_0,
    /// 4-bit k-quants: super-blocks of 256 weights (about 4.5 bits per
    /// weight); needs input widths that are multiples of 256.
    Q4K,
}

impl Quantization {
    /// Every format, in order of size.
    pub const ALL: [Self; 5] = [Self::None, Self::Bf16, Self::F16, Self::Q8_0, Self::Q4K];

    /// candle's format, `None` for dense weights.
    pub fn ggml_dtype(self) -> Option<GgmlDType> {
        match self {
            Self::None => None,
            Self::Bf16 => Some(GgmlDType::BF16),
            Self::F16 => Some(GgmlDType::F16),
            Self::Q8_0 => Some(GgmlDType::Q8_0),
            Self::Q4K => Some(GgmlDType::Q4K),
        }
    }

    /// The format of candle's `format`, `None` for one vl does not name
    /// (candle's other block formats, which [`Proj::quantize`] still
    /// takes).
    pub fn of(format: Option<GgmlDType>) -> Option<Self> {
        Self::ALL.into_iter().find(|q| q.ggml_dtype() == format)
    }

    /// The input width a layer needs to be a multiple of (1 for dense).
    pub fn block_size(self) -> usize {
        self.ggml_dtype().map_or(1, |d| d.block_size())
    }

    /// Whether the weights stay as they are.
    pub fn is_none(&self) -> bool {
        *self == Self::None
    }

    /// The name it is parsed from and displayed as.
    pub fn name(self) -> &'static str {
        // Also serde's names (`rename_all = "lowercase"`).
        match self {
            Self::None => "none",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::Q8_0 => "q8_0",
            Self::Q4K => "q4k",
        }
    }

    /// What a model loaded in `dtype` on `device` holds when `self` is
    /// asked: `self`, except that dense bf16 weights on a CPU with vl's
    /// bf16 kernels ([`crate::kernels::gemm_bf16::accelerated`]) are held
    /// as [`Quantization::Bf16`] — the same bf16 values in the layout those
    /// kernels read, packed once at load instead of on every product (the
    /// bias is added before the product's rounding). Loaders call this
    /// once and report what it chose.
    pub fn for_model(self, dtype: DType, device: &Device) -> Self {
        if self == Self::None
            && dtype == DType::BF16
            && device.is_cpu()
            && crate::kernels::gemm_bf16::accelerated()
        {
            Self::Bf16
        } else {
            self
        }
    }
}

impl fmt::Display for Quantization {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Quantization {
    type Err = AttnError;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "none" | "f32" | "dense" => Ok(Self::None),
            "bf16" => Ok(Self::Bf16),
            "f16" => Ok(Self::F16),
            "q8_0" | "q8" => Ok(Self::Q8_0),
            "q4k" | "q4_k" => Ok(Self::Q4K),
            _ => Err(AttnError::Argument {
                arg: "quantization",
                reason: format!("expected one of none, bf16, f16, q8_0, q4k, got {s:?}"),
            }),
        }
    }
}

/// A layer that got another format than the one asked, because the asked
/// one cannot hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fallback {
    /// The layer's path, e.g. `"decoder.blocks.0.cross_attn.k_proj"`.
    pub layer: String,
    /// The format asked.
    pub wanted: Option<GgmlDType>,
    /// The format it holds: the first of the fallbacks that fits, `None`
    /// for dense.
    pub got: Option<GgmlDType>,
    /// Its input width, which the asked format's block size does not
    /// divide.
    pub in_dim: usize,
}

/// How the layers of a model are converted: the format asked, whether a
/// layer that cannot hold it falls back or is refused, and the path of the
/// module being converted (each module passes [`Quantizer::within`] to its
/// parts, so that errors and fallbacks name the whole path).
///
/// Clones share their record of fallbacks.
///
/// ```
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::Linear;
/// use vl_attn::{Proj, Quantization, Quantizer};
///
/// // An input width of 64: a q8_0 layer (blocks of 32), not a q4k one (256).
/// let w = Tensor::zeros((16, 64), DType::F32, &Device::Cpu)?;
/// let proj = Proj::from(Linear::new(w, None));
/// assert!(Quantizer::strict(Quantization::Q4K).proj("up", &proj).is_err());
/// let q = Quantizer::fitting(Quantization::Q4K).within("ffn");
/// let held = q.proj("up", &proj)?;
/// assert_eq!(held.quantization(), Quantization::Q8_0.ggml_dtype());
/// assert_eq!(q.fallbacks()[0].layer, "ffn.up");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Quantizer {
    format: Option<GgmlDType>,
    fall_back: bool,
    /// With no format: pack each dense f32 CPU layer ([`Proj::pack_f32`]).
    pack_f32: bool,
    path: String,
    fell_back: Arc<Mutex<BTreeMap<String, Fallback>>>,
    stored: Option<Arc<dyn StoredBlocks>>,
}

impl fmt::Debug for Quantizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Quantizer")
            .field("format", &self.format)
            .field("fall_back", &self.fall_back)
            .field("pack_f32", &self.pack_f32)
            .field("path", &self.path)
            .field("stored", &self.stored.is_some())
            .finish()
    }
}

/// Blocks a checkpoint holds already (a model saved after conversion):
/// [`Quantizer::proj`] takes a CPU layer's from here rather than quantizing
/// its values again (`q4k`'s search for scales does not give back the same
/// blocks from dequantized values). Blocks are handed over on the CPU.
pub trait StoredBlocks: Send + Sync {
    /// The blocks of the weight `name` (e.g.
    /// `"decoder.blocks.0.ffn.down.weight"`) in `format`, `None` when the
    /// checkpoint has none.
    fn blocks(&self, name: &str, format: GgmlDType) -> Option<Result<QTensor>>;
}

impl Quantizer {
    fn new(format: Option<GgmlDType>, fall_back: bool) -> Self {
        Self {
            format,
            fall_back,
            pack_f32: false,
            path: String::new(),
            fell_back: Arc::default(),
            stored: None,
        }
    }

    /// The same quantizer, taking the blocks `stored` holds for a layer
    /// instead of quantizing it.
    #[must_use]
    pub fn with_stored(self, stored: Arc<dyn StoredBlocks>) -> Self {
        Self {
            stored: Some(stored),
            ..self
        }
    }

    /// Converts every layer to `q`, refusing one whose input width the
    /// format's block size does not divide ([`AttnError::Quantize`],
    /// naming it).
    pub fn strict(q: Quantization) -> Self {
        Self::new(q.ggml_dtype(), false)
    }

    /// Converts every layer to `q`, or, where its input width does not fit
    /// the format's blocks, to the next format that fits: `q4k` → `q8_0` →
    /// dense. Each such layer is recorded ([`Quantizer::fallbacks`]).
    pub fn fitting(q: Quantization) -> Self {
        Self::new(q.ggml_dtype(), true)
    }

    /// Keeps every layer's values and format, and packs each dense f32
    /// layer on the CPU once for vl's f32 product of many rows
    /// ([`Proj::pack_f32`]: the same values, bit for bit): what a loader
    /// gives an encoder's layers where
    /// [`crate::kernels::gemm_f32::packed::accelerated`]. Not for a
    /// decoder, whose decode steps read a dense weight as it lies.
    pub fn packing_f32() -> Self {
        Self {
            pack_f32: true,
            ..Self::new(None, false)
        }
    }

    /// The format asked, `None` for dense (nothing is converted).
    pub fn format(&self) -> Option<GgmlDType> {
        self.format
    }

    /// The dtype that keys and values computed by layers of this format
    /// are kept in under `activations` on `device`, for heads `head_dim`
    /// wide (an image's projected memory, see
    /// [`crate::CrossAttention::quantize`]; a text cache, see
    /// [`crate::CausalSelfAttention::with_cache_dtype`]): under f32
    /// activations on the CPU, the weights' own type for `bf16` and `f16`;
    /// for the integer formats (`q8_0`, `q4k`) `U8`, q8 rows
    /// ([`crate::quantize_kv`]: 8 bits and an f16 scale per 32 values,
    /// where `head_dim` is a multiple of 32; bf16 otherwise); `None` (the
    /// activations' dtype) elsewhere. A decode step then reads about half
    /// (16-bit) or a quarter (q8 rows) of f32's bytes of keys and values,
    /// rounded about as the weights that made them were: over 1,024
    /// teacher-forced positions of a vit-gpt2 base checkpoint under `q8_0`
    /// weights, top-1 agreement with f32 was 0.931 with both caches in
    /// bf16 and 0.931 with both in q8 rows (BENCHMARKS.md).
    pub fn kv_dtype(&self, activations: DType, device: &Device, head_dim: usize) -> Option<DType> {
        if activations != DType::F32 || !device.is_cpu() {
            return None;
        }
        match self.format? {
            GgmlDType::F32 => None,
            GgmlDType::F16 => Some(DType::F16),
            GgmlDType::BF16 => Some(DType::BF16),
            _ if head_dim > 0 && head_dim.is_multiple_of(crate::kernels::kv_q8::BLOCK_VALUES) => {
                Some(DType::U8)
            }
            _ => Some(DType::BF16),
        }
    }

    /// The same quantizer for the part `name` of the module being
    /// converted: its layers are named `path.name.layer`.
    #[must_use]
    pub fn within(&self, name: &str) -> Self {
        Self {
            path: self.name(name),
            ..self.clone()
        }
    }

    fn name(&self, layer: &str) -> String {
        if self.path.is_empty() {
            layer.to_string()
        } else {
            format!("{}.{layer}", self.path)
        }
    }

    /// `proj` (the layer `name` of the module) in the format this
    /// quantizer gives it. A layer already in that format is shared, not
    /// converted again; with no format asked, `proj` is returned as it is
    /// (packed, with [`Quantizer::packing_f32`], where it is dense f32 on
    /// the CPU).
    ///
    /// # Errors
    /// [`AttnError::Quantize`] naming the layer's whole path when a strict
    /// quantizer's format cannot hold it; candle's errors.
    pub fn proj(&self, name: &str, proj: &Proj) -> Result<Proj> {
        let Some(asked) = self.format else {
            return if self.pack_f32 {
                proj.pack_f32()
            } else {
                Ok(proj.clone())
            };
        };
        let layer = self.name(name);
        let in_dim = proj.dims().1;
        let fits = |f: GgmlDType| in_dim.is_multiple_of(f.block_size());
        // The formats tried, in order: the one asked; when falling back,
        // q8_0 for block sizes above its 32, then dense (`None`).
        let format = if fits(asked) {
            Some(asked)
        } else if !self.fall_back {
            // Strict: the format's own error, naming the layer.
            return proj.quantize(&layer, asked);
        } else {
            let q8 = GgmlDType::Q8_0;
            let got = (asked.block_size() > q8.block_size() && fits(q8)).then_some(q8);
            self.fell_back
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(
                    layer.clone(),
                    Fallback {
                        layer: layer.clone(),
                        wanted: Some(asked),
                        got,
                        in_dim,
                    },
                );
            got
        };
        let Some(f) = format else {
            // Dense: as the layer is (a layer quantized before stays so).
            return Ok(proj.clone());
        };
        // Stored blocks are read on the CPU, where vl packs them; a layer on
        // another device is quantized from its values.
        let stored = self
            .stored
            .as_ref()
            .filter(|_| proj.device().is_cpu())
            .and_then(|s| s.blocks(&format!("{layer}.weight"), f));
        match stored {
            Some(blocks) => {
                let (_, bias) = proj.weight_and_bias()?;
                Proj::from_blocks(blocks?, bias.as_ref(), proj.dtype())
            }
            None => proj.quantize(&layer, f),
        }
    }

    /// The layers that fell back so far, by path.
    pub fn fallbacks(&self) -> Vec<Fallback> {
        self.fell_back
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }
}

impl From<Quantization> for Quantizer {
    /// [`Quantizer::strict`].
    fn from(q: Quantization) -> Self {
        Self::strict(q)
    }
}

impl From<GgmlDType> for Quantizer {
    /// A strict quantizer to candle's `format` (any of candle's formats).
    fn from(format: GgmlDType) -> Self {
        Self::new(Some(format), false)
    }
}

impl From<&Quantizer> for Quantizer {
    fn from(q: &Quantizer) -> Self {
        q.clone()
    }
}

/// A format's name as vl displays it: [`Quantization`]'s where it has one,
/// candle's otherwise; `dense` for `None`.
pub fn format_name(format: Option<GgmlDType>) -> String {
    match Quantization::of(format) {
        Some(Quantization::None) => "dense".into(),
        Some(q) => q.name().into(),
        None => format!("{format:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;
    use candle_nn::Linear;

    #[test]
    fn round_trips_and_aliases() -> Result<()> {
        for q in Quantization::ALL {
            assert_eq!(q.to_string().parse::<Quantization>()?, q);
            assert_eq!(Quantization::of(q.ggml_dtype()), Some(q));
        }
        assert_eq!("Q4_K".parse::<Quantization>()?, Quantization::Q4K);
        assert_eq!(Quantization::Q8_0.block_size(), 32);
        assert_eq!(Quantization::Q4K.block_size(), 256);
        assert_eq!(Quantization::Bf16.block_size(), 1);
        let err = "int4".parse::<Quantization>().err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("quantization") && e.contains("int4")));
        Ok(())
    }

    fn proj(in_dim: usize) -> Result<Proj> {
        let w = Tensor::randn(0f32, 1.0, (8, in_dim), &Device::Cpu)?;
        Ok(Proj::from(Linear::new(w, None)))
    }

    /// Each width gets the first format of `q4k → q8_0 → dense` that holds
    /// it; only the layers that did not get `q4k` are recorded, once each,
    /// under their whole path.
    #[test]
    fn a_fitting_quantizer_falls_back_layer_by_layer() -> Result<()> {
        let q = Quantizer::fitting(Quantization::Q4K).within("decoder");
        let cases = [
            (512, Some(GgmlDType::Q4K)),
            (96, Some(GgmlDType::Q8_0)),
            (24, None),
        ];
        for (in_dim, want) in cases {
            let name = format!("w{in_dim}");
            let p = q.within("blocks.0").proj(&name, &proj(in_dim)?)?;
            assert_eq!(p.quantization(), want, "{in_dim}");
            // Converting again records nothing new.
            q.within("blocks.0").proj(&name, &p)?;
        }
        let fell: Vec<(String, Option<GgmlDType>, usize)> = q
            .fallbacks()
            .into_iter()
            .map(|f| (f.layer, f.got, f.in_dim))
            .collect();
        assert_eq!(
            fell,
            [
                ("decoder.blocks.0.w24".to_string(), None, 24),
                (
                    "decoder.blocks.0.w96".to_string(),
                    Some(GgmlDType::Q8_0),
                    96
                ),
            ]
        );
        // q8_0 falls back to dense only.
        let q8 = Quantizer::fitting(Quantization::Q8_0);
        assert_eq!(
            q8.proj("w", &proj(96)?)?.quantization(),
            Some(GgmlDType::Q8_0)
        );
        assert_eq!(q8.proj("v", &proj(24)?)?.quantization(), None);
        assert_eq!(q8.fallbacks().len(), 1);
        Ok(())
    }

    #[test]
    fn a_strict_quantizer_names_the_whole_path() -> Result<()> {
        let q = Quantizer::strict(Quantization::Q4K)
            .within("vision")
            .within("blocks.3");
        let err = q.proj("k_proj", &proj(96)?).err().map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.starts_with("vision.blocks.3.k_proj:") && e.contains("256")),
            "{err:?}"
        );
        assert!(q.fallbacks().is_empty());
        // Nothing asked: nothing converted, whatever the width.
        let none = Quantizer::fitting(Quantization::None);
        assert_eq!(none.proj("w", &proj(24)?)?.quantization(), None);
        assert!(none.fallbacks().is_empty());
        Ok(())
    }
}

//! The weight formats a decoder can run in, as chosen on a command line.

use std::fmt;
use std::str::FromStr;

use candle_core::quantized::GgmlDType;

use crate::error::DecoderError;

/// How the decoder's linear layers hold their weights.
///
/// Parsed from `"none"` (also `"f32"`, `"dense"`), `"bf16"`, `"f16"`,
/// `"q8_0"` (also `"q8"`) and `"q4k"` (also `"q4_k"`), case-insensitively;
/// displayed as `none`, `bf16`, `f16`, `q8_0`, `q4k`.
///
/// ```
/// use vl_decoder::Quantization;
///
/// let q: Quantization = "q8_0".parse().unwrap();
/// assert_eq!(q, Quantization::Q8_0);
/// assert_eq!(q.to_string(), "q8_0");
/// assert!("q3".parse::<Quantization>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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

    /// The input width a layer needs to be a multiple of (1 for dense).
    pub fn block_size(self) -> usize {
        self.ggml_dtype().map_or(1, |d| d.block_size())
    }

    /// The name it is parsed from and displayed as.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::Q8_0 => "q8_0",
            Self::Q4K => "q4k",
        }
    }
}

impl fmt::Display for Quantization {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Quantization {
    type Err = DecoderError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "none" | "f32" | "dense" => Ok(Self::None),
            "bf16" => Ok(Self::Bf16),
            "f16" => Ok(Self::F16),
            "q8_0" | "q8" => Ok(Self::Q8_0),
            "q4k" | "q4_k" => Ok(Self::Q4K),
            _ => Err(DecoderError::Argument {
                arg: "quantization",
                reason: format!("expected one of none, bf16, f16, q8_0, q4k, got {s:?}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_aliases() -> Result<(), DecoderError> {
        for q in Quantization::ALL {
            assert_eq!(q.to_string().parse::<Quantization>()?, q);
        }
        assert_eq!("Q4_K".parse::<Quantization>()?, Quantization::Q4K);
        assert_eq!(Quantization::Q8_0.block_size(), 32);
        assert_eq!(Quantization::Q4K.block_size(), 256);
        assert_eq!(Quantization::Bf16.block_size(), 1);
        let err = "int4".parse::<Quantization>().err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("quantization") && e.contains("int4")));
        Ok(())
    }
}

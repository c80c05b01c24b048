//! Every attention mask in vl is built here.
//!
//! **Polarity: `1` (true) = may attend, `0` = masked out.** There is no
//! other polarity anywhere in the project; additive biases are derived from
//! these masks inside the attention kernels and never leave them.
//!
//! A [`Mask`] is a `u8` tensor of shape `(batch | 1, q_len | 1, k_len)`:
//! a leading `1` broadcasts over the batch, a middle `1` over the queries.
//! It is broadcast over heads by the kernels.
//!
//! A query row whose keys are all masked out yields an exactly zero output
//! row and zero weights, never NaN, on every path and dtype.

use candle_core::{DType, Device, Tensor};

use crate::error::{AttnError, Result};

/// The most elements a mask built here may have: 2^30 bytes (1 GiB of `u8`),
/// e.g. a causal mask of 32768 × 32768. Larger sizes are refused with an
/// error naming the argument before anything is allocated, rather than
/// aborting on the allocation or overflowing the size product.
pub const MAX_MASK_ELEMENTS: usize = 1 << 30;

/// `dims`' product when it is at most [`MAX_MASK_ELEMENTS`]; otherwise an
/// [`AttnError::Argument`] naming `arg`, with the sizes.
fn checked_elements(arg: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &n| acc.checked_mul(n))
        .filter(|&n| n <= MAX_MASK_ELEMENTS)
        .ok_or_else(|| AttnError::Argument {
            arg,
            reason: format!(
                "a mask of shape {dims:?} has more than MAX_MASK_ELEMENTS = {MAX_MASK_ELEMENTS} elements"
            ),
        })
}

/// An attention mask: `u8`, shape `(batch | 1, q_len | 1, k_len)`, `1` = may attend.
#[derive(Debug, Clone)]
pub struct Mask(Tensor);

impl Mask {
    /// Wraps a `u8` tensor of shape `(q_len, k_len)` (shared by the batch) or
    /// `(batch | 1, q_len | 1, k_len)`.
    pub fn new(mask: Tensor) -> Result<Self> {
        if mask.dtype() != DType::U8 {
            return Err(AttnError::Argument {
                arg: "mask",
                reason: format!("expected dtype u8 (1 = may attend), got {:?}", mask.dtype()),
            });
        }
        match mask.rank() {
            2 => Ok(Self(mask.unsqueeze(0)?)),
            3 => Ok(Self(mask)),
            _ => Err(AttnError::Shape {
                arg: "mask",
                expected: "(q_len, k_len) or (batch | 1, q_len | 1, k_len)".into(),
                actual: mask.dims().to_vec(),
            }),
        }
    }

    /// A key mask `(batch, k_len)` applied to every query: `(batch, 1, k_len)`.
    pub fn from_keys(keys: &Tensor) -> Result<Self> {
        if keys.rank() != 2 {
            return Err(AttnError::Shape {
                arg: "key mask",
                expected: "(batch, k_len)".into(),
                actual: keys.dims().to_vec(),
            });
        }
        Self::new(keys.unsqueeze(1)?)
    }

    /// The `u8` tensor, `(batch | 1, q_len | 1, k_len)`.
    pub fn tensor(&self) -> &Tensor {
        &self.0
    }

    /// `(batch | 1, q_len | 1, k_len)`.
    pub fn dims(&self) -> (usize, usize, usize) {
        let d = self.0.dims();
        (d[0], d[1], d[2])
    }

    /// Positions allowed by both masks (logical and), broadcasting the
    /// leading dimensions.
    pub fn and(&self, other: &Mask) -> Result<Mask> {
        let (b1, q1, k1) = self.dims();
        let (b2, q2, k2) = other.dims();
        let join = |arg, a: usize, b: usize| -> Result<usize> {
            match (a, b) {
                (a, b) if a == b => Ok(a),
                (1, b) => Ok(b),
                (a, 1) => Ok(a),
                _ => Err(AttnError::Shape {
                    arg,
                    expected: format!("{a} or 1 to match the other mask"),
                    actual: vec![b],
                }),
            }
        };
        let b = join("mask batch", b1, b2)?;
        let q = join("mask q_len", q1, q2)?;
        if k1 != k2 {
            return Err(AttnError::Shape {
                arg: "mask",
                expected: format!("(_, _, {k1}) to match the other mask"),
                actual: vec![b2, q2, k2],
            });
        }
        let lhs = self.0.broadcast_as((b, q, k1))?;
        let rhs = other.0.broadcast_as((b, q, k1))?;
        Ok(Mask((lhs * rhs)?))
    }

    /// `(batch | 1, q_len | 1, 1)` in `dtype`: 1 where a query may attend to
    /// at least one key, 0 where it may attend to none. Modules multiply
    /// their output by it, so that a query with nothing to attend to
    /// receives exactly nothing (not even an output bias).
    pub fn any_key(&self, dtype: DType) -> Result<Tensor> {
        Ok(self.0.max_keepdim(2)?.to_dtype(dtype)?)
    }

    /// Checks that the mask fits queries `(batch, q_len)` over `k_len` keys.
    pub(crate) fn check(&self, batch: usize, q_len: usize, k_len: usize) -> Result<()> {
        let (b, q, k) = self.dims();
        if (b != batch && b != 1) || (q != q_len && q != 1) || k != k_len {
            return Err(AttnError::Shape {
                arg: "mask",
                expected: format!("({batch} | 1, {q_len} | 1, {k_len})"),
                actual: vec![b, q, k],
            });
        }
        Ok(())
    }

    /// Selects batch rows of a per-sample mask; a mask shared by the batch is
    /// returned as is.
    pub fn index_select(&self, indices: &Tensor) -> Result<Mask> {
        if self.dims().0 == 1 {
            return Ok(self.clone());
        }
        Ok(Mask(self.0.index_select(indices, 0)?))
    }
}

/// The causal mask `(len, len)`: query `i` may attend to keys `0..=i`
/// (lower-triangular ones).
pub fn causal(len: usize, device: &Device) -> Result<Tensor> {
    causal_with_offset(len, 0, device)
}

/// The causal mask for `q_len` new queries after `offset` cached keys:
/// `(q_len, offset + q_len)`, query `i` may attend to keys `0..=offset + i`
/// (bottom-right alignment).
///
/// # Errors
/// [`AttnError::Argument`] naming `q_len, offset` when `offset + q_len`
/// overflows or the mask has more than [`MAX_MASK_ELEMENTS`] elements.
pub fn causal_with_offset(q_len: usize, offset: usize, device: &Device) -> Result<Tensor> {
    let k_len = offset
        .checked_add(q_len)
        .ok_or_else(|| AttnError::Argument {
            arg: "q_len, offset",
            reason: format!("offset {offset} + q_len {q_len} overflows usize"),
        })?;
    checked_elements("q_len, offset", &[q_len, k_len])?;
    let data: Vec<u8> = (0..q_len)
        .flat_map(|i| (0..k_len).map(move |j| u8::from(j <= offset + i)))
        .collect();
    Ok(Tensor::from_vec(data, (q_len, k_len), device)?)
}

/// Where the padding of a batch of unequal lengths sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PaddingSide {
    /// Tokens first, then padding (the usual layout for encoders and for
    /// image tokens).
    Right,
    /// Padding first, then tokens (the usual layout for batched decoding,
    /// so that every sample's last token is at the same position).
    Left,
}

/// The key-padding mask `(batch, max_len)` of samples with `lengths` real
/// tokens each, padded on `side`.
///
/// # Errors
/// [`AttnError::Argument`] naming `lengths` when one is past `max_len`, or
/// `max_len` when the mask has more than [`MAX_MASK_ELEMENTS`] elements.
pub fn key_padding(
    lengths: &[usize],
    max_len: usize,
    side: PaddingSide,
    device: &Device,
) -> Result<Tensor> {
    if let Some((i, &len)) = lengths.iter().enumerate().find(|(_, &l)| l > max_len) {
        return Err(AttnError::Argument {
            arg: "lengths",
            reason: format!("sample {i} has length {len}, more than max_len {max_len}"),
        });
    }
    checked_elements("max_len", &[lengths.len(), max_len])?;
    let data: Vec<u8> = lengths
        .iter()
        .flat_map(|&len| {
            (0..max_len).map(move |j| match side {
                PaddingSide::Right => u8::from(j < len),
                PaddingSide::Left => u8::from(j >= max_len - len),
            })
        })
        .collect();
    Ok(Tensor::from_vec(data, (lengths.len(), max_len), device)?)
}

/// A per-sample image mask `(batch, 1, max_tokens)`: sample `b` has
/// `tokens[b]` image tokens (right-padded); `0` means the sample has no
/// image, and its text attends to nothing (its cross-attention output is 0).
pub fn image_tokens(tokens: &[usize], max_tokens: usize, device: &Device) -> Result<Mask> {
    Mask::from_keys(&key_padding(
        tokens,
        max_tokens,
        PaddingSide::Right,
        device,
    )?)
}

/// Which images a text position sees in interleaved (Flamingo-style) input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaAttention {
    /// Only the tokens of the most recent image before the position.
    MostRecent,
    /// The tokens of every image before the position.
    AllPrevious,
}

/// One image of an interleaved sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaSpan {
    /// The first text position after the image: positions `>= text_start`
    /// come after it and may see it.
    pub text_start: usize,
    /// How many memory tokens the image has; a sample's images occupy
    /// consecutive memory slots in order, from slot 0.
    pub tokens: usize,
}

/// The interleaved media mask `(batch, text_len, memory_len)`.
///
/// `samples[b]` lists sample `b`'s images in text order. Text before any
/// image sees nothing; memory slots past a sample's images are padding.
///
/// # Errors
/// [`AttnError::Argument`] naming `text_len, memory_len` when the mask has
/// more than [`MAX_MASK_ELEMENTS`] elements, or `media spans` when a
/// sample's images hold more than `memory_len` tokens (their sum may
/// overflow) or are out of text order.
pub fn interleaved(
    samples: &[Vec<MediaSpan>],
    text_len: usize,
    memory_len: usize,
    mode: MediaAttention,
    device: &Device,
) -> Result<Mask> {
    interleaved_rows(samples, 0, text_len, memory_len, mode, device)
}

/// Rows `offset..offset + len` of the interleaved media mask:
/// `(batch, len, memory_len)`, row `i` being text position `offset + i` —
/// what a cached decode step at `offset` needs. Rows `0..text_len` are
/// [`interleaved`]'s mask.
///
/// # Errors
/// As [`interleaved`], with `text_len, memory_len` named when `offset + len`
/// overflows.
pub fn interleaved_rows(
    samples: &[Vec<MediaSpan>],
    offset: usize,
    len: usize,
    memory_len: usize,
    mode: MediaAttention,
    device: &Device,
) -> Result<Mask> {
    let elements = checked_elements("text_len, memory_len", &[samples.len(), len, memory_len])?;
    if offset.checked_add(len).is_none() {
        return Err(AttnError::Argument {
            arg: "text_len, memory_len",
            reason: format!("offset {offset} + len {len} overflows usize"),
        });
    }
    let mut data = vec![0u8; elements];
    for (b, spans) in samples.iter().enumerate() {
        let total = spans
            .iter()
            .try_fold(0usize, |acc, s| acc.checked_add(s.tokens))
            .filter(|&total| total <= memory_len);
        if total.is_none() {
            return Err(AttnError::Argument {
                arg: "media spans",
                reason: format!(
                    "sample {b} has more image tokens than memory_len {memory_len}: {:?}",
                    spans.iter().map(|s| s.tokens).collect::<Vec<_>>()
                ),
            });
        }
        if let Some(w) = spans.windows(2).find(|w| w[1].text_start < w[0].text_start) {
            return Err(AttnError::Argument {
                arg: "media spans",
                reason: format!(
                    "sample {b}: images must be in text order, got text_start {} after {}",
                    w[1].text_start, w[0].text_start
                ),
            });
        }
        let mut slot = 0;
        let ranges: Vec<(usize, std::ops::Range<usize>)> = spans
            .iter()
            .map(|s| {
                let r = slot..slot + s.tokens;
                slot += s.tokens;
                (s.text_start, r)
            })
            .collect();
        for i in 0..len {
            let t = offset + i;
            let row = &mut data[(b * len + i) * memory_len..][..memory_len];
            let mut seen = ranges.iter().filter(|(start, _)| *start <= t);
            let seen: Vec<_> = match mode {
                MediaAttention::AllPrevious => seen.collect(),
                MediaAttention::MostRecent => seen.next_back().into_iter().collect(),
            };
            for (_, r) in seen {
                row[r.clone()].fill(1);
            }
        }
    }
    Mask::new(Tensor::from_vec(
        data,
        (samples.len(), len, memory_len),
        device,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_is_lower_triangular() -> Result<()> {
        let m = causal(4, &Device::Cpu)?;
        assert_eq!(m.dims(), &[4, 4]);
        assert_eq!(
            m.to_vec2::<u8>()?,
            vec![
                vec![1, 0, 0, 0],
                vec![1, 1, 0, 0],
                vec![1, 1, 1, 0],
                vec![1, 1, 1, 1]
            ]
        );
        Ok(())
    }

    #[test]
    fn causal_offset_is_bottom_right_aligned() -> Result<()> {
        let m = causal_with_offset(2, 3, &Device::Cpu)?;
        assert_eq!(
            m.to_vec2::<u8>()?,
            vec![vec![1, 1, 1, 1, 0], vec![1, 1, 1, 1, 1]]
        );
        Ok(())
    }

    #[test]
    fn key_padding_sides() -> Result<()> {
        let r = key_padding(&[2, 0], 3, PaddingSide::Right, &Device::Cpu)?;
        assert_eq!(r.to_vec2::<u8>()?, vec![vec![1, 1, 0], vec![0, 0, 0]]);
        let l = key_padding(&[2, 3], 3, PaddingSide::Left, &Device::Cpu)?;
        assert_eq!(l.to_vec2::<u8>()?, vec![vec![0, 1, 1], vec![1, 1, 1]]);
        assert!(key_padding(&[4], 3, PaddingSide::Left, &Device::Cpu).is_err());
        Ok(())
    }

    #[test]
    fn interleaved_modes() -> Result<()> {
        // Two images of 2 tokens: the first before text 1, the second before text 3.
        let spans = vec![vec![
            MediaSpan {
                text_start: 1,
                tokens: 2,
            },
            MediaSpan {
                text_start: 3,
                tokens: 2,
            },
        ]];
        let recent = interleaved(&spans, 4, 5, MediaAttention::MostRecent, &Device::Cpu)?;
        assert_eq!(
            recent.tensor().squeeze(0)?.to_vec2::<u8>()?,
            vec![
                vec![0, 0, 0, 0, 0],
                vec![1, 1, 0, 0, 0],
                vec![1, 1, 0, 0, 0],
                vec![0, 0, 1, 1, 0]
            ]
        );
        let all = interleaved(&spans, 4, 5, MediaAttention::AllPrevious, &Device::Cpu)?;
        assert_eq!(
            all.tensor().squeeze(0)?.to_vec2::<u8>()?[3],
            vec![1, 1, 1, 1, 0]
        );
        Ok(())
    }

    /// Every window of rows equals the same rows of the whole mask.
    #[test]
    fn interleaved_rows_are_windows_of_the_whole() -> Result<()> {
        let span = |text_start, tokens| MediaSpan { text_start, tokens };
        let samples = vec![vec![span(2, 3), span(5, 2)], vec![span(0, 1), span(4, 4)]];
        for mode in [MediaAttention::MostRecent, MediaAttention::AllPrevious] {
            let whole = interleaved(&samples, 8, 6, mode, &Device::Cpu)?;
            for offset in 0..8 {
                for len in 1..=8 - offset {
                    let rows = interleaved_rows(&samples, offset, len, 6, mode, &Device::Cpu)?;
                    assert_eq!(
                        rows.tensor().to_vec3::<u8>()?,
                        whole.tensor().narrow(1, offset, len)?.to_vec3::<u8>()?,
                        "{mode:?} offset {offset} len {len}"
                    );
                }
            }
        }
        let err = interleaved_rows(
            &samples,
            usize::MAX,
            2,
            6,
            MediaAttention::MostRecent,
            &Device::Cpu,
        );
        assert!(err.is_err());
        Ok(())
    }

    #[test]
    fn and_broadcasts_and_checks() -> Result<()> {
        let causal = Mask::new(causal(3, &Device::Cpu)?)?;
        let keys = Mask::from_keys(&key_padding(&[3, 2], 3, PaddingSide::Left, &Device::Cpu)?)?;
        let both = causal.and(&keys)?;
        assert_eq!(both.dims(), (2, 3, 3));
        assert_eq!(
            both.tensor().get(1)?.to_vec2::<u8>()?,
            vec![vec![0, 0, 0], vec![0, 1, 0], vec![0, 1, 1]]
        );
        assert!(both.check(2, 3, 3).is_ok());
        assert!(both.check(2, 3, 4).is_err());
        let wrong = Mask::new(Tensor::zeros((2, 2), DType::F32, &Device::Cpu)?);
        assert!(wrong.is_err());
        Ok(())
    }

    /// Absurd sizes are errors naming the argument, before any allocation:
    /// the old code aborted allocating (or overflowed `offset + q_len` /
    /// `batch * text_len * memory_len`).
    #[test]
    fn absurd_sizes_are_errors() {
        let dev = Device::Cpu;
        let msg = |r: Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
        // Overflowing sum.
        let err = msg(causal_with_offset(2, usize::MAX, &dev));
        assert!(
            err.starts_with("q_len, offset:") && err.contains("overflows"),
            "{err}"
        );
        // A product of 2^40 bytes.
        let err = msg(causal_with_offset(1 << 20, 0, &dev));
        assert!(
            err.contains("MAX_MASK_ELEMENTS") && err.contains("1048576"),
            "{err}"
        );
        // A product that overflows usize.
        let err = msg(causal_with_offset(1 << 40, 1 << 40, &dev));
        assert!(err.contains("MAX_MASK_ELEMENTS"), "{err}");
        // The limit itself is not refused by the check (not built here: 1 GiB).
        assert!(checked_elements("x", &[1 << 15, 1 << 15]).is_ok());
        assert!(checked_elements("x", &[1 << 15, (1 << 15) + 1]).is_err());
        let err = msg(key_padding(&[1], usize::MAX, PaddingSide::Right, &dev));
        assert!(err.starts_with("max_len:"), "{err}");

        let span = |tokens| MediaSpan {
            text_start: 0,
            tokens,
        };
        let mask_msg = |r: Result<Mask>| r.err().map(|e| e.to_string()).unwrap_or_default();
        let err = mask_msg(interleaved(
            &[vec![span(1)], vec![span(1)]],
            usize::MAX / 2,
            3,
            MediaAttention::MostRecent,
            &dev,
        ));
        assert!(err.starts_with("text_len, memory_len:"), "{err}");
        let err = mask_msg(interleaved(
            &[vec![span(1)]],
            1 << 16,
            1 << 16,
            MediaAttention::AllPrevious,
            &dev,
        ));
        assert!(err.contains("MAX_MASK_ELEMENTS"), "{err}");
        // Token counts whose sum overflows.
        let err = mask_msg(interleaved(
            &[vec![span(usize::MAX), span(2)]],
            2,
            3,
            MediaAttention::AllPrevious,
            &dev,
        ));
        assert!(
            err.starts_with("media spans:") && err.contains("sample 0"),
            "{err}"
        );
    }
}

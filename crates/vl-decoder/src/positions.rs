//! Position embeddings of the text tokens, chosen by
//! [`DecoderConfig::position_embedding`]:
//!
//! - learned rows (GPT-2; BART and TrOCR read them from row
//!   `position_offset` = 2 on), `embed_positions.weight`
//!   `(max_position_embeddings + position_offset, hidden)`;
//! - fixed sinusoids, fairseq's layout as transformers'
//!   `TrOCRSinusoidalPositionalEmbedding` builds them: for `half =
//!   hidden / 2`, row `p` is `sin(p * f_0), …, sin(p * f_{half-1}), cos(p *
//!   f_0), …, cos(p * f_{half-1})` with `f_i = exp(-i * ln(10000) / (half -
//!   1))`, a zero column appended when `hidden` is odd. With a
//!   `position_padding_idx` `p`, row `p` is zero, a padding token reads it,
//!   and every other token reads row `p + past + n`, `n` counting the
//!   non-padding tokens of its own call up to it (fairseq's
//!   `make_positions`, cumulated per call as transformers does).
//!
//! A position of the model is one of `0..max_position_embeddings`; the
//! tables hold the rows below the offset (or the padding row) besides.

use candle_core::{DType, Device, Tensor};
use candle_nn::{Embedding, Module};
use serde::{Deserialize, Serialize};

use crate::config::DecoderConfig;
use crate::error::{arg_err, config_err, Result};

/// How the decoder embeds positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PositionEmbedding {
    /// A learned table, `embed_positions.weight` (the default).
    #[default]
    Learned,
    /// Fixed sinusoids, no weights (fairseq; TrOCR with
    /// `use_learned_position_embeddings: false`).
    Sinusoidal,
}

/// The decoder's position embeddings.
#[derive(Debug, Clone)]
pub enum Positions {
    /// Learned rows, position `i` reading row `offset + i`.
    Learned {
        /// `(rows, hidden)`.
        table: Embedding,
        /// The first row read.
        offset: usize,
        /// `0..rows` as u32, built once, narrowed per call.
        ids: Tensor,
    },
    /// Fixed sinusoids.
    Sinusoidal {
        /// `(rows, hidden)`, see [`sinusoidal_table`].
        table: Tensor,
        /// Row of position 0 when there is no padding index.
        offset: usize,
        /// fairseq's padding index (see the module docs).
        padding_idx: Option<u32>,
    },
}

/// The rows of the position table of `cfg`: learned,
/// `max_position_embeddings + position_offset`; sinusoidal, as many and,
/// with a padding index `p`, `max_position_embeddings + p + 1`. `None`
/// when that overflows `u32`.
pub fn table_rows(cfg: &DecoderConfig) -> Option<usize> {
    let below = match (cfg.position_embedding, cfg.position_padding_idx) {
        (PositionEmbedding::Sinusoidal, Some(p)) => (p as usize).checked_add(1)?,
        _ => cfg.position_offset,
    };
    cfg.max_position_embeddings
        .checked_add(below)
        .filter(|&rows| u32::try_from(rows).is_ok())
}

/// fairseq's sinusoidal table, computed in f32 as transformers does, then
/// cast to `dtype`.
///
/// # Shapes
/// Returns `(rows, dim)`; `dim >= 4` (checked by
/// [`DecoderConfig::validate`]).
pub fn sinusoidal_table(
    rows: usize,
    dim: usize,
    padding_idx: Option<u32>,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let half = dim / 2;
    if half < 2 {
        return arg_err(
            "hidden_size",
            format!("sinusoidal positions need a width of at least 4, got {dim}"),
        );
    }
    // transformers: exp(arange(half).float() * -(ln(10000) / (half - 1))),
    // a float32 tensor times a Python float, so in f32.
    let step = -((10000f64).ln() / (half - 1) as f64) as f32;
    let freqs: Vec<f32> = (0..half).map(|i| (i as f32 * step).exp()).collect();
    let mut data = vec![0f32; rows * dim];
    for (p, row) in data.chunks_exact_mut(dim).enumerate() {
        if padding_idx.is_some_and(|pad| pad as usize == p) {
            continue;
        }
        for (i, f) in freqs.iter().enumerate() {
            let angle = p as f32 * f;
            row[i] = angle.sin();
            row[half + i] = angle.cos();
        }
    }
    Ok(Tensor::from_vec(data, (rows, dim), device)?.to_dtype(dtype)?)
}

impl Positions {
    /// Learned rows of `table`, position `i` reading row `offset + i`.
    ///
    /// # Errors
    /// `embed_positions` when the table has more rows than `u32` indexes.
    pub fn learned(table: Embedding, offset: usize) -> Result<Self> {
        let rows = table.embeddings().dims().first().copied().unwrap_or(0);
        let Ok(n) = u32::try_from(rows) else {
            return arg_err(
                "embed_positions",
                format!("expected at most {} rows, got {rows}", u32::MAX),
            );
        };
        let ids = Tensor::arange(0u32, n, table.embeddings().device())?;
        Ok(Self::Learned { table, offset, ids })
    }

    /// The positions `cfg` asks for, learned from `table` (which must be
    /// given exactly for learned positions) or sinusoidal.
    ///
    /// # Errors
    /// `embed_positions` when the table is missing, given for sinusoids, or
    /// not `(table_rows(cfg), hidden_size)`.
    pub fn for_config(
        cfg: &DecoderConfig,
        table: Option<Embedding>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let Some(rows) = table_rows(cfg) else {
            return config_err(
                "max_position_embeddings",
                "with the position offset, passes u32::MAX rows",
            );
        };
        match (cfg.position_embedding, table) {
            (PositionEmbedding::Learned, Some(t)) => {
                let want = [rows, cfg.hidden_size];
                if t.embeddings().dims() != want {
                    return arg_err(
                        "embed_positions",
                        format!(
                            "expected weight shape {want:?} (max_position_embeddings + \
                             position_offset, hidden_size), got {:?}",
                            t.embeddings().dims()
                        ),
                    );
                }
                Self::learned(t, cfg.position_offset)
            }
            (PositionEmbedding::Learned, None) => arg_err(
                "embed_positions",
                "learned positions need a table, got none",
            ),
            (PositionEmbedding::Sinusoidal, None) => Ok(Self::Sinusoidal {
                table: sinusoidal_table(
                    rows,
                    cfg.hidden_size,
                    cfg.position_padding_idx,
                    dtype,
                    device,
                )?,
                offset: cfg.position_offset,
                padding_idx: cfg.position_padding_idx,
            }),
            (PositionEmbedding::Sinusoidal, Some(_)) => arg_err(
                "embed_positions",
                "sinusoidal positions have no weights, got a table",
            ),
        }
    }

    /// The embeddings of `tokens` placed after `past` earlier tokens.
    ///
    /// # Shapes
    /// `tokens: (batch, len)` u32 → `(1, len, hidden)`, or `(batch, len,
    /// hidden)` for sinusoids with a padding index (they depend on the
    /// tokens). The caller has checked that `past + len` positions fit.
    pub fn forward(&self, tokens: &Tensor, past: usize) -> Result<Tensor> {
        // (batch, len)
        let (b, t) = tokens.dims2()?;
        match self {
            Self::Learned { table, offset, ids } => {
                // (len, hidden) -> (1, len, hidden)
                Ok(table
                    .forward(&ids.narrow(0, offset + past, t)?)?
                    .unsqueeze(0)?)
            }
            Self::Sinusoidal {
                table,
                offset,
                padding_idx: None,
            } => Ok(table.narrow(0, offset + past, t)?.unsqueeze(0)?),
            Self::Sinusoidal {
                table,
                padding_idx: Some(pad),
                ..
            } => {
                let (rows, hidden) = table.dims2()?;
                let mut ids = Vec::with_capacity(b * t);
                for row in tokens.to_vec2::<u32>()? {
                    let mut n = 0usize;
                    for tok in row {
                        if tok == *pad {
                            ids.push(*pad);
                        } else {
                            n += 1;
                            // Below `rows` (<= u32::MAX, checked at build):
                            // past + n <= max_position_embeddings.
                            let id = (*pad as usize + past + n).min(rows - 1);
                            ids.push(id as u32);
                        }
                    }
                }
                let ids = Tensor::from_vec(ids, b * t, table.device())?;
                // (b * t, hidden) -> (b, t, hidden)
                Ok(table.index_select(&ids, 0)?.reshape((b, t, hidden))?)
            }
        }
    }
}

//! A query pool: a fixed number of learned queries cross-attend to a memory
//! of any length and summarise it (as a Perceiver resampler or a Q-Former
//! does), so that a decoder attends to few tokens instead of many.

use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};

use crate::cross::{CrossAttention, CrossAttentionConfig};
use crate::dropout::{Dropout, Mode};
use crate::error::{AttnError, Result};
use crate::mask::Mask;

/// Learned queries `(num_queries, query_dim)` and a [`CrossAttention`].
///
/// Weights: `queries (num_queries, query_dim)`, `attn.*` as
/// [`CrossAttention::load`].
#[derive(Debug, Clone)]
pub struct QueryPool {
    queries: Tensor,
    attn: CrossAttention,
}

impl QueryPool {
    /// Loads or initialises the queries (normal, std 0.02) and the attention.
    pub fn load(vb: VarBuilder, num_queries: usize, cfg: &CrossAttentionConfig) -> Result<Self> {
        if num_queries == 0 {
            return Err(AttnError::Config {
                module: "QueryPool",
                reason: "num_queries must be positive".into(),
            });
        }
        let queries = vb.get_with_hints(
            (num_queries, cfg.query_dim),
            "queries",
            Init::Randn {
                mean: 0.0,
                stdev: 0.02,
            },
        )?;
        Ok(Self {
            queries,
            attn: CrossAttention::load(vb.pp("attn"), cfg)?,
        })
    }

    /// Sets the dropout on the attention probabilities (see
    /// [`CrossAttention::with_attention_dropout`]).
    pub fn with_attention_dropout(self, dropout: Dropout) -> Self {
        Self {
            attn: self.attn.with_attention_dropout(dropout),
            ..self
        }
    }

    /// Switches between training and inference.
    pub fn set_mode(&mut self, mode: Mode) {
        self.attn.set_mode(mode);
    }

    /// The number of output tokens.
    pub fn num_queries(&self) -> usize {
        self.queries.dims()[0]
    }

    /// Pools `memory` into `num_queries` tokens.
    ///
    /// # Shapes
    /// - `memory: (batch, mem_len, memory_dim)`
    /// - `mask: (batch | 1, 1, mem_len)`, `1` = may attend
    /// - returns `(batch, num_queries, out_dim)`
    pub fn forward(&self, memory: &Tensor, mask: Option<&Mask>) -> Result<Tensor> {
        let b = memory.dims().first().copied().unwrap_or(0);
        let (n, d) = self.queries.dims2()?;
        let queries = self
            .queries
            .to_dtype(memory.dtype())?
            .unsqueeze(0)?
            .broadcast_as((b, n, d))?;
        self.attn.forward(&queries, memory, mask)
    }
}

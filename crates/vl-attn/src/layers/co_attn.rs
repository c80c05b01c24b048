//! Co-attention: two streams, each querying the other in the same call
//! (ViLBERT's and LXMERT's co-attentional layers; audio ↔ video alike).
//!
//! ```text
//! a' = a_to_b(a, b, b_keys)      A's queries over B's keys and values
//! b' = b_to_a(b, a, a_keys)      B's queries over A's keys and values
//! ```
//!
//! Both directions read the *input* streams, never each other's output, and
//! each has its own key mask: `b_keys` (which of B's positions may be
//! attended) masks A's queries, `a_keys` masks B's. Masks follow
//! [`crate::mask`] (`1` = may attend); a query with no key left gets an
//! exactly zero update.

use crate::quantize::Quantizer;
use candle_core::quantized::GgmlDType;
use candle_core::Tensor;
use candle_nn::VarBuilder;

use crate::attention::{Backend, Weights};
use crate::cross::{CrossAttention, CrossAttentionConfig};
use crate::dropout::{Dropout, Mode};
use crate::error::{AttnError, Result};
use crate::mask::Mask;

/// The sizes of a [`CoAttention`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoAttentionConfig {
    /// Width of stream A (e.g. the text or audio hidden size).
    pub a_dim: usize,
    /// Width of stream B (e.g. the image or video hidden size).
    pub b_dim: usize,
    /// Width of the attention in both directions, `num_heads * head_dim`.
    pub inner_dim: usize,
    /// Query heads in both directions.
    pub num_heads: usize,
    /// Key/value heads in both directions; divides `num_heads`.
    pub num_kv_heads: usize,
    /// Whether the projections have biases.
    pub bias: bool,
}

impl CoAttentionConfig {
    /// Multi-head co-attention with biases.
    pub fn new(a_dim: usize, b_dim: usize, inner_dim: usize, num_heads: usize) -> Self {
        Self {
            a_dim,
            b_dim,
            inner_dim,
            num_heads,
            num_kv_heads: num_heads,
            bias: true,
        }
    }

    /// Rejects impossible sizes before any tensor is built.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [("a_dim", self.a_dim), ("b_dim", self.b_dim)] {
            if v == 0 {
                return Err(AttnError::Config {
                    module: "CoAttention",
                    reason: format!("{name} must be positive"),
                });
            }
        }
        // Both directions share inner_dim and the head counts: one check.
        self.a_to_b().validate().map_err(|e| match e {
            AttnError::Config { reason, .. } => AttnError::Config {
                module: "CoAttention",
                reason,
            },
            other => other,
        })
    }

    /// The A → B direction: queries and output of width `a_dim`, memory of
    /// width `b_dim`.
    pub fn a_to_b(&self) -> CrossAttentionConfig {
        CrossAttentionConfig {
            query_dim: self.a_dim,
            memory_dim: self.b_dim,
            inner_dim: self.inner_dim,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            out_dim: self.a_dim,
            bias: self.bias,
        }
    }

    /// The B → A direction: queries and output of width `b_dim`, memory of
    /// width `a_dim`.
    pub fn b_to_a(&self) -> CrossAttentionConfig {
        CrossAttentionConfig {
            query_dim: self.b_dim,
            memory_dim: self.a_dim,
            out_dim: self.b_dim,
            ..self.a_to_b()
        }
    }
}

/// What a co-attention call returns: both updates and, when
/// [`Weights::Return`] was asked, both weight tensors.
#[derive(Debug, Clone)]
pub struct CoAttentionOutput {
    /// Stream A's update (to be added to A), `(batch, a_len, a_dim)`.
    pub a: Tensor,
    /// Stream B's update (to be added to B), `(batch, b_len, b_dim)`.
    pub b: Tensor,
    /// A's queries over B's keys, `(batch, heads, a_len, b_len)`; rows sum
    /// to 1, or to 0 where `b_keys` leaves no key.
    pub a_weights: Option<Tensor>,
    /// B's queries over A's keys, `(batch, heads, b_len, a_len)`; rows sum
    /// to 1, or to 0 where `a_keys` leaves no key.
    pub b_weights: Option<Tensor>,
}

/// Two [`CrossAttention`]s, A → B and B → A, run on the same inputs in one
/// call.
///
/// Weights: `a_to_b.{q,k,v,o}_proj` (queries of width `a_dim` over a memory
/// of width `b_dim`, output `a_dim`) and `b_to_a.{q,k,v,o}_proj`
/// (symmetrically).
#[derive(Debug, Clone)]
pub struct CoAttention {
    a_to_b: CrossAttention,
    b_to_a: CrossAttention,
    cfg: CoAttentionConfig,
}

impl CoAttention {
    /// Loads or initialises both directions under `vb.pp("a_to_b")` and
    /// `vb.pp("b_to_a")`.
    pub fn load(vb: VarBuilder, cfg: &CoAttentionConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            a_to_b: CrossAttention::load(vb.pp("a_to_b"), &cfg.a_to_b())?,
            b_to_a: CrossAttention::load(vb.pp("b_to_a"), &cfg.b_to_a())?,
            cfg: cfg.clone(),
        })
    }

    /// A copy with every projection quantized to `format`.
    ///
    /// # Errors
    /// [`AttnError::Quantize`] naming the first projection whose input width
    /// is not a multiple of the block size, e.g. `a_to_b.q_proj`.
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        Ok(Self {
            a_to_b: self.a_to_b.quantize(q.within("a_to_b"))?,
            b_to_a: self.b_to_a.quantize(q.within("b_to_a"))?,
            cfg: self.cfg.clone(),
        })
    }

    /// The quantized format of the projections, `None` when dense.
    pub fn quantization(&self) -> Option<GgmlDType> {
        self.a_to_b.quantization()
    }

    /// Chooses the attention implementation of both directions.
    pub fn with_backend(self, backend: Backend) -> Self {
        Self {
            a_to_b: self.a_to_b.with_backend(backend),
            b_to_a: self.b_to_a.with_backend(backend),
            cfg: self.cfg,
        }
    }

    /// Sets the dropout on the attention probabilities of both directions
    /// (see [`CrossAttention::with_attention_dropout`]).
    pub fn with_attention_dropout(self, dropout: Dropout) -> Self {
        Self {
            a_to_b: self.a_to_b.with_attention_dropout(dropout),
            b_to_a: self.b_to_a.with_attention_dropout(dropout),
            cfg: self.cfg,
        }
    }

    /// Switches both directions between training and inference; they draw
    /// from the same generator.
    pub fn set_mode(&mut self, mode: Mode) {
        self.a_to_b.set_mode(mode.clone());
        self.b_to_a.set_mode(mode);
    }

    /// The sizes this module was built with.
    pub fn config(&self) -> &CoAttentionConfig {
        &self.cfg
    }

    /// The A → B direction.
    pub fn a_to_b(&self) -> &CrossAttention {
        &self.a_to_b
    }

    /// The B → A direction.
    pub fn b_to_a(&self) -> &CrossAttention {
        &self.b_to_a
    }

    /// A attends to B and B to A, both over the inputs; with
    /// [`Weights::Return`], also both weight tensors.
    ///
    /// # Shapes
    /// - `a: (batch, a_len, a_dim)`, `b: (batch, b_len, b_dim)`
    /// - `a_keys: (batch | 1, b_len | 1, a_len)`: which of A's positions B's
    ///   queries may attend to (`1` = may attend)
    /// - `b_keys: (batch | 1, a_len | 1, b_len)`: which of B's positions A's
    ///   queries may attend to
    /// - returns updates `a (batch, a_len, a_dim)`, `b (batch, b_len,
    ///   b_dim)` and weights `a_weights (batch, heads, a_len, b_len)`,
    ///   `b_weights (batch, heads, b_len, a_len)`
    ///
    /// # Errors
    /// Shape errors naming `a`, `b`, `a_keys` or `b_keys`; dtype and device
    /// errors naming `a`, `b` or the mask; `backend` when
    /// [`Backend::Fused`] is asked for weights.
    pub fn attend(
        &self,
        a: &Tensor,
        b: &Tensor,
        a_keys: Option<&Mask>,
        b_keys: Option<&Mask>,
        weights: Weights,
    ) -> Result<CoAttentionOutput> {
        let (batch, a_len) = check_stream("a", a, None, self.cfg.a_dim, "a_dim")?;
        let (_, b_len) = check_stream("b", b, Some(batch), self.cfg.b_dim, "b_dim")?;
        check_keys("a_keys", a_keys, batch, b_len, a_len)?;
        check_keys("b_keys", b_keys, batch, a_len, b_len)?;
        let b_kv = self
            .a_to_b
            .project_memory(b)
            .map_err(|e| rename(e, "b", "a", "b_keys"))?;
        let a_out = self
            .a_to_b
            .attend(a, &b_kv, b_keys, weights)
            .map_err(|e| rename(e, "b", "a", "b_keys"))?;
        let a_kv = self
            .b_to_a
            .project_memory(a)
            .map_err(|e| rename(e, "a", "b", "a_keys"))?;
        let b_out = self
            .b_to_a
            .attend(b, &a_kv, a_keys, weights)
            .map_err(|e| rename(e, "a", "b", "a_keys"))?;
        Ok(CoAttentionOutput {
            a: a_out.output,
            b: b_out.output,
            a_weights: a_out.weights,
            b_weights: b_out.weights,
        })
    }

    /// [`CoAttention::attend`] without the weights: the updates of A and B.
    ///
    /// # Shapes
    /// As [`CoAttention::attend`]: returns `(batch, a_len, a_dim)` and
    /// `(batch, b_len, b_dim)`.
    pub fn forward(
        &self,
        a: &Tensor,
        b: &Tensor,
        a_keys: Option<&Mask>,
        b_keys: Option<&Mask>,
    ) -> Result<(Tensor, Tensor)> {
        let out = self.attend(a, b, a_keys, b_keys, Weights::Skip)?;
        Ok((out.a, out.b))
    }
}

/// Checks a stream `(batch, len, width)` (with the batch of the other
/// stream, when given) and returns `(batch, len)`.
pub(crate) fn check_stream(
    arg: &'static str,
    x: &Tensor,
    batch: Option<usize>,
    width: usize,
    width_name: &str,
) -> Result<(usize, usize)> {
    match (x.dims(), batch) {
        (&[n, t, d], None) if d == width => Ok((n, t)),
        (&[n, t, d], Some(want)) if d == width && n == want => Ok((n, t)),
        (dims, batch) => Err(AttnError::Shape {
            arg,
            expected: match batch {
                None => format!("(batch, len, {width}) with {width_name} = {width}"),
                Some(n) => {
                    format!("({n}, len, {width}) with the batch of a and {width_name} = {width}")
                }
            },
            actual: dims.to_vec(),
        }),
    }
}

/// Checks a key mask over `k_len` positions for `q_len` queries.
pub(crate) fn check_keys(
    arg: &'static str,
    keys: Option<&Mask>,
    batch: usize,
    q_len: usize,
    k_len: usize,
) -> Result<()> {
    let Some(m) = keys else { return Ok(()) };
    let (mb, mq, mk) = m.dims();
    if (mb != batch && mb != 1) || (mq != q_len && mq != 1) || mk != k_len {
        return Err(AttnError::Shape {
            arg,
            expected: format!("({batch} | 1, {q_len} | 1, {k_len})"),
            actual: vec![mb, mq, mk],
        });
    }
    Ok(())
}

/// Names a direction's error by the co-attention's arguments: its memory,
/// its queries and its mask.
fn rename(
    e: AttnError,
    memory: &'static str,
    queries: &'static str,
    mask: &'static str,
) -> AttnError {
    let name = |arg: &'static str| match arg {
        "memory" => memory,
        "queries" => queries,
        "mask" => mask,
        other => other,
    };
    match e {
        AttnError::Shape {
            arg,
            expected,
            actual,
        } => AttnError::Shape {
            arg: name(arg),
            expected,
            actual,
        },
        AttnError::DType {
            arg,
            expected_from,
            expected,
            actual,
        } => AttnError::DType {
            arg: name(arg),
            expected_from,
            expected,
            actual,
        },
        AttnError::Device {
            arg,
            expected_from,
            expected,
            actual,
        } => AttnError::Device {
            arg: name(arg),
            expected_from,
            expected,
            actual,
        },
        AttnError::Argument { arg, reason } => AttnError::Argument {
            arg: name(arg),
            reason,
        },
        other => other,
    }
}

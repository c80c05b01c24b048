//! A pre-LN co-attention block (ViLBERT's co-attentional transformer layer):
//!
//! ```text
//! (a, b) += co_attn(co_attn_norm_a(a), co_attn_norm_b(b))   one call, both directions
//! a += ffn_a(ffn_norm_a(a))
//! b += ffn_b(ffn_norm_b(b))
//! ```

use crate::quantize::Quantizer;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use crate::attention::{Backend, Weights};
use crate::co_attn::{check_stream, CoAttention, CoAttentionConfig};
use crate::dropout::{Dropout, Mode};
use crate::error::{check_dtype_device, AttnError, Result};
use crate::ffn::{Activation, FeedForward};
use crate::mask::Mask;
use crate::norm::LayerNorm;

/// The sizes of a [`CoAttentionBlock`].
#[derive(Debug, Clone, PartialEq)]
pub struct CoAttentionBlockConfig {
    /// The co-attention between the streams.
    pub co_attn: CoAttentionConfig,
    /// Hidden width of stream A's feed-forward layer.
    pub a_intermediate: usize,
    /// Hidden width of stream B's feed-forward layer.
    pub b_intermediate: usize,
    /// The feed-forward activation of both streams.
    pub activation: Activation,
    /// The epsilon of every layer norm.
    pub layer_norm_eps: f64,
}

/// The default layer-norm epsilon of [`CoAttentionBlockConfig::new`].
pub const DEFAULT_LAYER_NORM_EPS: f64 = 1e-5;

/// The default ratio of feed-forward to stream width in
/// [`CoAttentionBlockConfig::new`].
pub const DEFAULT_FFN_RATIO: usize = 4;

impl CoAttentionBlockConfig {
    /// Feed-forward layers [`DEFAULT_FFN_RATIO`] times as wide as each
    /// stream, GELU, layer-norm epsilon [`DEFAULT_LAYER_NORM_EPS`].
    pub fn new(co_attn: CoAttentionConfig) -> Self {
        Self {
            a_intermediate: DEFAULT_FFN_RATIO * co_attn.a_dim,
            b_intermediate: DEFAULT_FFN_RATIO * co_attn.b_dim,
            co_attn,
            activation: Activation::default(),
            layer_norm_eps: DEFAULT_LAYER_NORM_EPS,
        }
    }

    /// Rejects impossible sizes before any tensor is built.
    pub fn validate(&self) -> Result<()> {
        self.co_attn.validate()?;
        let err = |reason: String| {
            Err(AttnError::Config {
                module: "CoAttentionBlock",
                reason,
            })
        };
        for (name, v) in [
            ("a_intermediate", self.a_intermediate),
            ("b_intermediate", self.b_intermediate),
        ] {
            if v == 0 {
                return err(format!("{name} must be positive"));
            }
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return err(format!(
                "layer_norm_eps must be positive and finite, got {}",
                self.layer_norm_eps
            ));
        }
        Ok(())
    }
}

/// What a [`CoAttentionBlock`] returns: both new streams (not updates) and,
/// when [`Weights::Return`] was asked, its co-attention weights.
#[derive(Debug, Clone)]
pub struct CoAttentionBlockOutput {
    /// The new stream A, `(batch, a_len, a_dim)`.
    pub a: Tensor,
    /// The new stream B, `(batch, b_len, b_dim)`.
    pub b: Tensor,
    /// A's queries over B's keys, `(batch, heads, a_len, b_len)`.
    pub a_weights: Option<Tensor>,
    /// B's queries over A's keys, `(batch, heads, b_len, a_len)`.
    pub b_weights: Option<Tensor>,
}

/// A pre-LN block in which streams A and B attend to each other, then each
/// goes through its own feed-forward layer; norms are named by role.
///
/// Weights: `co_attn_norm_a`, `co_attn_norm_b`, `co_attn.a_to_b.*`,
/// `co_attn.b_to_a.*`, `ffn_norm_a`, `ffn_a.{up,down}`, `ffn_norm_b`,
/// `ffn_b.{up,down}`.
#[derive(Debug, Clone)]
pub struct CoAttentionBlock {
    co_attn_norm_a: LayerNorm,
    co_attn_norm_b: LayerNorm,
    co_attn: CoAttention,
    ffn_norm_a: LayerNorm,
    ffn_a: FeedForward,
    ffn_norm_b: LayerNorm,
    ffn_b: FeedForward,
    /// The weights' dtype and device, which the streams must match.
    dtype: DType,
    device: Device,
}

impl CoAttentionBlock {
    /// Loads or initialises the block under `vb`.
    pub fn load(vb: VarBuilder, cfg: &CoAttentionBlockConfig) -> Result<Self> {
        cfg.validate()?;
        let (a_dim, b_dim) = (cfg.co_attn.a_dim, cfg.co_attn.b_dim);
        let norm = |width, name| LayerNorm::load(width, cfg.layer_norm_eps, vb.pp(name));
        Ok(Self {
            co_attn_norm_a: norm(a_dim, "co_attn_norm_a")?,
            co_attn_norm_b: norm(b_dim, "co_attn_norm_b")?,
            co_attn: CoAttention::load(vb.pp("co_attn"), &cfg.co_attn)?,
            ffn_norm_a: norm(a_dim, "ffn_norm_a")?,
            ffn_a: FeedForward::load(vb.pp("ffn_a"), a_dim, cfg.a_intermediate, cfg.activation)?,
            ffn_norm_b: norm(b_dim, "ffn_norm_b")?,
            ffn_b: FeedForward::load(vb.pp("ffn_b"), b_dim, cfg.b_intermediate, cfg.activation)?,
            dtype: vb.dtype(),
            device: vb.device().clone(),
        })
    }

    /// A copy with every projection (both attention directions, both
    /// feed-forward layers) quantized to `format`; norms stay dense.
    ///
    /// # Errors
    /// [`AttnError::Quantize`] naming the first projection whose input width
    /// is not a multiple of the block size, e.g. `co_attn.a_to_b.q_proj` or
    /// `ffn_b.down`.
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        Ok(Self {
            co_attn: self.co_attn.quantize(q.within("co_attn"))?,
            ffn_a: self.ffn_a.quantize(q.within("ffn_a"))?,
            ffn_b: self.ffn_b.quantize(q.within("ffn_b"))?,
            ..self.clone()
        })
    }

    /// Chooses the attention implementation of both directions.
    pub fn with_backend(self, backend: Backend) -> Self {
        Self {
            co_attn: self.co_attn.with_backend(backend),
            ..self
        }
    }

    /// Sets the dropout on the co-attention's probabilities, both
    /// directions (see [`CoAttention::with_attention_dropout`]).
    pub fn with_attention_dropout(self, dropout: Dropout) -> Self {
        Self {
            co_attn: self.co_attn.with_attention_dropout(dropout),
            ..self
        }
    }

    /// Switches the co-attention between training and inference.
    pub fn set_mode(&mut self, mode: Mode) {
        self.co_attn.set_mode(mode);
    }

    /// The co-attention between the streams.
    pub fn co_attn(&self) -> &CoAttention {
        &self.co_attn
    }

    /// Runs the block; with [`Weights::Return`], also the co-attention
    /// weights of both directions.
    ///
    /// # Shapes
    /// - `a: (batch, a_len, a_dim)`, `b: (batch, b_len, b_dim)`
    /// - `a_keys: (batch | 1, b_len | 1, a_len)`, `b_keys: (batch | 1,
    ///   a_len | 1, b_len)`, as in [`CoAttention::attend`]
    /// - returns the new streams `a (batch, a_len, a_dim)`, `b (batch,
    ///   b_len, b_dim)` and weights `a_weights (batch, heads, a_len,
    ///   b_len)`, `b_weights (batch, heads, b_len, a_len)`
    ///
    /// # Errors
    /// As [`CoAttention::attend`].
    pub fn attend(
        &self,
        a: &Tensor,
        b: &Tensor,
        a_keys: Option<&Mask>,
        b_keys: Option<&Mask>,
        weights: Weights,
    ) -> Result<CoAttentionBlockOutput> {
        let cfg = self.co_attn.config();
        // Checked before the norms, so that a wrong width names its argument.
        let (batch, _) = check_stream("a", a, None, cfg.a_dim, "a_dim")?;
        check_stream("b", b, Some(batch), cfg.b_dim, "b_dim")?;
        check_dtype_device("a", a, "the weights", self.dtype, &self.device)?;
        check_dtype_device("b", b, "the weights", self.dtype, &self.device)?;
        let co = self.co_attn.attend(
            &self.co_attn_norm_a.forward(a)?,
            &self.co_attn_norm_b.forward(b)?,
            a_keys,
            b_keys,
            weights,
        )?;
        let a = (a + co.a)?;
        let b = (b + co.b)?;
        let a = (&a + self.ffn_a.forward(&self.ffn_norm_a.forward(&a)?)?)?;
        let b = (&b + self.ffn_b.forward(&self.ffn_norm_b.forward(&b)?)?)?;
        Ok(CoAttentionBlockOutput {
            a,
            b,
            a_weights: co.a_weights,
            b_weights: co.b_weights,
        })
    }

    /// [`CoAttentionBlock::attend`] without the weights: the new streams.
    ///
    /// # Shapes
    /// As [`CoAttentionBlock::attend`]: returns `(batch, a_len, a_dim)` and
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

//! A resampler: a fixed number of learned queries that read a memory of
//! any length through a stack of pre-LN layers (Flamingo's Perceiver
//! resampler, BLIP-2's Q-Former without its text branch). Put between a
//! vision encoder and a decoder, it cuts the image tokens every
//! cross-attention reads from `mem_len` to `num_queries`.
//!
//! Each layer, on the queries `q`:
//!
//! ```text
//! q += self_attn(self_attn_norm(q))                 queries among themselves
//! q += cross_attn(cross_attn_norm(q), memory)       no causal mask
//! q += ffn(ffn_norm(q))
//! ```
//!
//! then `output_norm(q)`.

use crate::named::{join, Named};
use crate::quantize::Quantizer;
use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};

use crate::cross::{CrossAttention, CrossAttentionConfig};
use crate::error::{AttnError, Result};
use crate::ffn::{Activation, FeedForward};
use crate::mask::Mask;
use crate::norm::LayerNorm;
use crate::self_attn::{SelfAttention, SelfAttentionConfig};

/// The resampler's sizes, as a model directory's `config.json` holds them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ResamplerConfig {
    /// Width of the queries and of the output tokens.
    pub width: usize,
    /// Width of the memory tokens.
    pub memory_dim: usize,
    /// Learned queries: the number of output tokens.
    pub num_queries: usize,
    /// Layers.
    pub depth: usize,
    /// Attention heads; divides `width`.
    pub num_heads: usize,
    /// Feed-forward width.
    pub intermediate_size: usize,
    /// Feed-forward activation (default `gelu`).
    #[serde(default)]
    pub activation: Activation,
    /// Layer-norm epsilon (default 1e-5).
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
}

fn default_eps() -> f64 {
    DEFAULT_LAYER_NORM_EPS
}

/// Feed-forward width per unit of `width` in [`ResamplerConfig::new`].
pub const DEFAULT_FFN_RATIO: usize = 4;
/// Layer-norm epsilon in [`ResamplerConfig::new`].
pub const DEFAULT_LAYER_NORM_EPS: f64 = 1e-5;

impl ResamplerConfig {
    /// `num_queries` queries of `width` over a memory of `memory_dim`,
    /// `depth` layers of `num_heads` heads, a GELU feed-forward of
    /// [`DEFAULT_FFN_RATIO`] × `width`.
    pub fn new(
        width: usize,
        memory_dim: usize,
        num_queries: usize,
        depth: usize,
        num_heads: usize,
    ) -> Self {
        Self {
            width,
            memory_dim,
            num_queries,
            depth,
            num_heads,
            intermediate_size: DEFAULT_FFN_RATIO * width,
            activation: Activation::Gelu,
            layer_norm_eps: DEFAULT_LAYER_NORM_EPS,
        }
    }

    /// Rejects impossible sizes, naming the field.
    pub fn validate(&self) -> Result<()> {
        let err = |reason: String| {
            Err(AttnError::Config {
                module: "Resampler",
                reason,
            })
        };
        for (name, v) in [
            ("width", self.width),
            ("memory_dim", self.memory_dim),
            ("num_queries", self.num_queries),
            ("depth", self.depth),
            ("num_heads", self.num_heads),
            ("intermediate_size", self.intermediate_size),
        ] {
            if v == 0 {
                return err(format!("{name} must be positive, got 0"));
            }
        }
        if !self.width.is_multiple_of(self.num_heads) {
            return err(format!(
                "width {} is not divisible by num_heads {}",
                self.width, self.num_heads
            ));
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

/// One layer of the resampler; norms named by role.
#[derive(Debug, Clone)]
pub struct ResamplerLayer {
    self_attn_norm: LayerNorm,
    self_attn: SelfAttention,
    cross_attn_norm: LayerNorm,
    cross_attn: CrossAttention,
    ffn_norm: LayerNorm,
    ffn: FeedForward,
}

impl ResamplerLayer {
    /// Loads `self_attn_norm`, `self_attn.*`, `cross_attn_norm`,
    /// `cross_attn.*`, `ffn_norm`, `ffn.*` under `vb`.
    pub fn load(vb: VarBuilder, cfg: &ResamplerConfig) -> Result<Self> {
        let (w, eps) = (cfg.width, cfg.layer_norm_eps);
        Ok(Self {
            self_attn_norm: LayerNorm::load(w, eps, vb.pp("self_attn_norm"))?,
            self_attn: SelfAttention::load(
                vb.pp("self_attn"),
                &SelfAttentionConfig::new(w, cfg.num_heads),
            )?,
            cross_attn_norm: LayerNorm::load(w, eps, vb.pp("cross_attn_norm"))?,
            cross_attn: CrossAttention::load(
                vb.pp("cross_attn"),
                &CrossAttentionConfig::new(w, cfg.memory_dim, cfg.num_heads),
            )?,
            ffn_norm: LayerNorm::load(w, eps, vb.pp("ffn_norm"))?,
            ffn: FeedForward::load(vb.pp("ffn"), w, cfg.intermediate_size, cfg.activation)?,
        })
    }

    /// # Shapes
    /// - `q: (batch, num_queries, width)`
    /// - `memory: (batch, mem_len, memory_dim)`
    /// - `mask: (batch | 1, 1 | num_queries, mem_len)`, `1` = may attend
    /// - returns `(batch, num_queries, width)`
    pub fn forward(&self, q: &Tensor, memory: &Tensor, mask: Option<&Mask>) -> Result<Tensor> {
        let h = self
            .self_attn
            .forward(&self.self_attn_norm.forward(q)?, None)?;
        let q = (q + h)?;
        let h = self
            .cross_attn
            .forward(&self.cross_attn_norm.forward(&q)?, memory, mask)?;
        let q = (q + h)?;
        let h = self.ffn.forward(&self.ffn_norm.forward(&q)?)?;
        Ok((q + h)?)
    }

    fn named_tensors(&self, prefix: &str, out: &mut Named) -> Result<()> {
        self.self_attn_norm
            .named_tensors(&join(prefix, "self_attn_norm"), out);
        self.self_attn
            .named_tensors(&join(prefix, "self_attn"), out)?;
        self.cross_attn_norm
            .named_tensors(&join(prefix, "cross_attn_norm"), out);
        self.cross_attn
            .named_tensors(&join(prefix, "cross_attn"), out)?;
        self.ffn_norm.named_tensors(&join(prefix, "ffn_norm"), out);
        self.ffn.named_tensors(&join(prefix, "ffn"), out)
    }

    fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        Ok(Self {
            self_attn: self.self_attn.quantize(q.within("self_attn"))?,
            cross_attn: self.cross_attn.quantize(q.within("cross_attn"))?,
            ffn: self.ffn.quantize(q.within("ffn"))?,
            ..self.clone()
        })
    }
}

/// Learned queries `(num_queries, width)`, `depth` [`ResamplerLayer`]s and
/// an output norm.
///
/// Weights: `queries`, `layers.{i}.*`, `output_norm`.
#[derive(Debug, Clone)]
pub struct Resampler {
    queries: Tensor,
    layers: Vec<ResamplerLayer>,
    output_norm: LayerNorm,
    cfg: ResamplerConfig,
}

impl Resampler {
    /// Loads or initialises (queries normal with std 0.02) a resampler
    /// under `vb`.
    pub fn load(vb: VarBuilder, cfg: &ResamplerConfig) -> Result<Self> {
        cfg.validate()?;
        let queries = vb.get_with_hints(
            (cfg.num_queries, cfg.width),
            "queries",
            Init::Randn {
                mean: 0.0,
                stdev: 0.02,
            },
        )?;
        let layers = (0..cfg.depth)
            .map(|i| ResamplerLayer::load(vb.pp(format!("layers.{i}")), cfg))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            queries,
            layers,
            output_norm: LayerNorm::load(cfg.width, cfg.layer_norm_eps, vb.pp("output_norm"))?,
            cfg: cfg.clone(),
        })
    }

    /// The sizes it was built with.
    pub fn config(&self) -> &ResamplerConfig {
        &self.cfg
    }

    /// Adds `queries`, `layers.{i}.…` and `output_norm` under `prefix`
    /// (see [`crate::named`]).
    pub fn named_tensors(&self, prefix: &str, out: &mut Named) -> Result<()> {
        out.insert(join(prefix, "queries"), self.queries.clone());
        for (i, l) in self.layers.iter().enumerate() {
            l.named_tensors(&join(prefix, &format!("layers.{i}")), out)?;
        }
        self.output_norm
            .named_tensors(&join(prefix, "output_norm"), out);
        Ok(())
    }

    /// A copy with every projection quantized to `format`; queries and
    /// norms stay dense.
    ///
    /// # Errors
    /// [`AttnError::Quantize`] naming the first layer that does not fit the
    /// format's block size, e.g. `layers.0.self_attn.q_proj`.
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| l.quantize(q.within(&format!("layers.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            ..self.clone()
        })
    }

    /// Resamples `memory` into `num_queries` tokens.
    ///
    /// # Shapes
    /// - `memory: (batch, mem_len, memory_dim)`
    /// - `mask: (batch | 1, 1, mem_len)` over the memory, `1` = may attend
    /// - returns `(batch, num_queries, width)`
    ///
    /// # Errors
    /// A memory of the wrong rank or width, or a mask that does not fit,
    /// named.
    pub fn forward(&self, memory: &Tensor, mask: Option<&Mask>) -> Result<Tensor> {
        let (b, _, d) = match memory.dims() {
            &[b, t, d] if t > 0 => (b, t, d),
            dims => {
                return Err(AttnError::Shape {
                    arg: "memory",
                    expected: format!("(batch, mem_len >= 1, {})", self.cfg.memory_dim),
                    actual: dims.to_vec(),
                })
            }
        };
        if d != self.cfg.memory_dim {
            return Err(AttnError::Shape {
                arg: "memory",
                expected: format!("(batch, mem_len, {})", self.cfg.memory_dim),
                actual: memory.dims().to_vec(),
            });
        }
        let (n, w) = self.queries.dims2()?;
        // (n, w) -> (b, n, w)
        let mut q = self
            .queries
            .to_dtype(memory.dtype())?
            .unsqueeze(0)?
            .broadcast_as((b, n, w))?
            .contiguous()?;
        for layer in &self.layers {
            q = layer.forward(&q, memory, mask)?;
        }
        self.output_norm.forward(&q)
    }
}

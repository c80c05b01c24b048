//! The text encoder of an encoder-decoder language model (BART's): it
//! reads the image tokens followed by the prompt's, bidirectionally, and
//! its output is what the decoder's cross-attention reads — Florence-2's
//! "image context" is the encoder's output over `[image; prompt]`, computed
//! once per image and prompt.
//!
//! The input of the first layer is `[image_tokens; embed(prompt) ·
//! embed_scale]` plus learned positions (row `position_offset + i` for
//! position `i`, BART's offset 2), then `layernorm_embedding` when
//! configured (image tokens are placed unscaled, as transformers scatters
//! them into the scaled prompt embeddings). Each layer is post-LN:
//! `x = norm1(x + self_attn(x))`, `x = norm2(x + ffn(x))` (or pre-LN, with a
//! final norm, as mBART).

use candle_core::{Module, Tensor};
use candle_nn::{Embedding, VarBuilder};
use serde::{Deserialize, Serialize};
use vl_attn::{Activation, FeedForward, LayerNorm, Quantizer, SelfAttention, SelfAttentionConfig};

use crate::config::NormPlacement;
use crate::error::{arg_err, config_err, Result};

fn default_offset() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-5
}
fn default_true() -> bool {
    true
}

/// A [`TextEncoder`]'s sizes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextEncoderConfig {
    /// Tokens in the vocabulary (the decoder's).
    pub vocab_size: usize,
    /// Width.
    pub hidden_size: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Layers.
    pub num_hidden_layers: usize,
    /// Feed-forward width.
    pub intermediate_size: usize,
    /// Positions (image tokens and prompt together).
    pub max_position_embeddings: usize,
    /// The row of position 0 in the position table (BART's 2).
    #[serde(default = "default_offset")]
    pub position_offset: usize,
    /// Feed-forward activation.
    #[serde(default)]
    pub hidden_act: Activation,
    /// Layer-norm epsilon (default 1e-5).
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// Prompt embeddings times `sqrt(hidden_size)`.
    #[serde(default)]
    pub scale_embedding: bool,
    /// A LayerNorm on the embeddings (default true, BART's).
    #[serde(default = "default_true")]
    pub layernorm_embedding: bool,
    /// Post-LN layers (BART) or pre-LN (mBART).
    #[serde(default)]
    pub norm_placement: NormPlacement,
    /// A LayerNorm after the last layer (mBART).
    #[serde(default)]
    pub final_norm: bool,
    /// Whether the token table is the decoder's (then it is not stored
    /// twice: a vl directory holds it once, under the decoder).
    #[serde(default = "default_true")]
    pub shares_decoder_embeddings: bool,
}

impl TextEncoderConfig {
    /// Rejects impossible sizes, naming the field.
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return config_err(field, "must be at least 1");
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return config_err(
                "num_attention_heads",
                format!(
                    "{} does not divide hidden_size {}",
                    self.num_attention_heads, self.hidden_size
                ),
            );
        }
        Ok(())
    }

    fn embed_scale(&self) -> Option<f64> {
        self.scale_embedding
            .then(|| (self.hidden_size as f64).sqrt())
    }
}

/// One encoder layer: bidirectional self-attention and a feed-forward,
/// each with its LayerNorm.
#[derive(Debug, Clone)]
pub struct EncoderLayer {
    self_attn: SelfAttention,
    self_attn_norm: LayerNorm,
    ffn: FeedForward,
    ffn_norm: LayerNorm,
}

impl EncoderLayer {
    /// Builds from existing parts (checkpoint converters).
    pub fn from_parts(
        self_attn: SelfAttention,
        self_attn_norm: LayerNorm,
        ffn: FeedForward,
        ffn_norm: LayerNorm,
    ) -> Self {
        Self {
            self_attn,
            self_attn_norm,
            ffn,
            ffn_norm,
        }
    }

    fn load(vb: VarBuilder, cfg: &TextEncoderConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        let eps = cfg.layer_norm_eps;
        Ok(Self {
            self_attn: SelfAttention::load(
                vb.pp("self_attn"),
                &SelfAttentionConfig::new(h, cfg.num_attention_heads),
            )?,
            self_attn_norm: LayerNorm::load(h, eps, vb.pp("self_attn_norm"))?,
            ffn: FeedForward::load(vb.pp("ffn"), h, cfg.intermediate_size, cfg.hidden_act)?,
            ffn_norm: LayerNorm::load(h, eps, vb.pp("ffn_norm"))?,
        })
    }

    fn forward(&self, x: &Tensor, placement: NormPlacement) -> Result<Tensor> {
        Ok(match placement {
            NormPlacement::Post => {
                let x = self
                    .self_attn_norm
                    .forward(&(x + self.self_attn.forward(x, None)?)?)?;
                self.ffn_norm.forward(&(&x + self.ffn.forward(&x)?)?)?
            }
            NormPlacement::Pre => {
                let x = (x + self
                    .self_attn
                    .forward(&self.self_attn_norm.forward(x)?, None)?)?;
                (&x + self.ffn.forward(&self.ffn_norm.forward(&x)?)?)?
            }
        })
    }

    fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        use vl_attn::named::join;
        self.self_attn
            .named_tensors(&join(prefix, "self_attn"), out)?;
        self.self_attn_norm
            .named_tensors(&join(prefix, "self_attn_norm"), out);
        self.ffn.named_tensors(&join(prefix, "ffn"), out)?;
        self.ffn_norm.named_tensors(&join(prefix, "ffn_norm"), out);
        Ok(())
    }
}

/// The parts of a [`TextEncoder`] (checkpoint converters).
#[derive(Debug, Clone)]
pub struct TextEncoderParts {
    /// The token table `(vocab_size, hidden_size)`.
    pub embed_tokens: Tensor,
    /// The position table `(max_position_embeddings + position_offset,
    /// hidden_size)`.
    pub embed_positions: Tensor,
    /// `layernorm_embedding`, when configured.
    pub embedding_norm: Option<LayerNorm>,
    /// The layers.
    pub layers: Vec<EncoderLayer>,
    /// The norm after the last layer, when configured.
    pub final_norm: Option<LayerNorm>,
}

/// A BART-style text encoder over `[image tokens; prompt]`.
#[derive(Debug, Clone)]
pub struct TextEncoder {
    embed_tokens: Embedding,
    embed_positions: Embedding,
    embedding_norm: Option<LayerNorm>,
    layers: Vec<EncoderLayer>,
    final_norm: Option<LayerNorm>,
    cfg: TextEncoderConfig,
}

impl TextEncoder {
    /// Builds from existing parts, checked against `cfg`.
    ///
    /// # Errors
    /// [`crate::DecoderError::Config`] naming the field whose size a part
    /// does not have.
    pub fn from_parts(parts: TextEncoderParts, cfg: &TextEncoderConfig) -> Result<Self> {
        cfg.validate()?;
        let h = cfg.hidden_size;
        if parts.embed_tokens.dims() != [cfg.vocab_size, h] {
            return config_err(
                "vocab_size",
                format!(
                    "the token table is {:?}, expected [{}, {h}]",
                    parts.embed_tokens.dims(),
                    cfg.vocab_size
                ),
            );
        }
        let rows = cfg.max_position_embeddings + cfg.position_offset;
        if parts.embed_positions.dims() != [rows, h] {
            return config_err(
                "max_position_embeddings",
                format!(
                    "the position table is {:?}, expected [{rows}, {h}]",
                    parts.embed_positions.dims()
                ),
            );
        }
        if parts.layers.len() != cfg.num_hidden_layers {
            return config_err(
                "num_hidden_layers",
                format!(
                    "{} layers given, {} configured",
                    parts.layers.len(),
                    cfg.num_hidden_layers
                ),
            );
        }
        Ok(Self {
            embed_tokens: Embedding::new(parts.embed_tokens, h),
            embed_positions: Embedding::new(parts.embed_positions, h),
            embedding_norm: parts.embedding_norm,
            layers: parts.layers,
            final_norm: parts.final_norm,
            cfg: cfg.clone(),
        })
    }

    /// Loads vl's own layout under `vb` (what
    /// [`TextEncoder::named_tensors`] writes); the token table is
    /// `decoder_tokens` when the config says it is shared.
    ///
    /// # Errors
    /// A missing tensor or one of another shape, named.
    pub fn load(vb: VarBuilder, cfg: &TextEncoderConfig, decoder_tokens: &Tensor) -> Result<Self> {
        let h = cfg.hidden_size;
        let eps = cfg.layer_norm_eps;
        let embed_tokens = if cfg.shares_decoder_embeddings {
            decoder_tokens.clone()
        } else {
            vb.pp("embed_tokens").get((cfg.vocab_size, h), "weight")?
        };
        let parts = TextEncoderParts {
            embed_tokens,
            embed_positions: vb.pp("embed_positions").get(
                (cfg.max_position_embeddings + cfg.position_offset, h),
                "weight",
            )?,
            embedding_norm: if cfg.layernorm_embedding {
                Some(LayerNorm::load(h, eps, vb.pp("embedding_norm"))?)
            } else {
                None
            },
            layers: (0..cfg.num_hidden_layers)
                .map(|i| EncoderLayer::load(vb.pp("layers").pp(i), cfg))
                .collect::<Result<_>>()?,
            final_norm: if cfg.final_norm {
                Some(LayerNorm::load(h, eps, vb.pp("final_norm"))?)
            } else {
                None
            },
        };
        Self::from_parts(parts, cfg)
    }

    /// Its configuration.
    pub fn config(&self) -> &TextEncoderConfig {
        &self.cfg
    }

    /// Adds its tensors under `prefix` (the token table only when it is
    /// not the decoder's).
    ///
    /// # Errors
    /// candle's, dequantizing a converted layer.
    pub fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        use vl_attn::named::join;
        if !self.cfg.shares_decoder_embeddings {
            out.insert(
                join(prefix, "embed_tokens.weight"),
                self.embed_tokens.embeddings().clone(),
            );
        }
        out.insert(
            join(prefix, "embed_positions.weight"),
            self.embed_positions.embeddings().clone(),
        );
        if let Some(n) = &self.embedding_norm {
            n.named_tensors(&join(prefix, "embedding_norm"), out);
        }
        for (i, l) in self.layers.iter().enumerate() {
            l.named_tensors(&join(prefix, &format!("layers.{i}")), out)?;
        }
        if let Some(n) = &self.final_norm {
            n.named_tensors(&join(prefix, "final_norm"), out);
        }
        Ok(())
    }

    /// A copy with every layer's attention and feed-forward converted by
    /// `q` (named `layers.{i}.self_attn.…`, `layers.{i}.ffn.…`).
    ///
    /// # Errors
    /// As [`Quantizer::proj`].
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let ql = q.within(&format!("layers.{i}"));
                Ok(EncoderLayer {
                    self_attn: l.self_attn.quantize(ql.within("self_attn"))?,
                    ffn: l.ffn.quantize(ql.within("ffn"))?,
                    ..l.clone()
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            ..self.clone()
        })
    }

    /// The encoder's output over `[image_tokens; prompt]`: the memory the
    /// decoder's cross-attention reads.
    ///
    /// # Shapes
    /// - `image_tokens: (batch, image_len, hidden)` (`image_len` may be 0
    ///   only through `None`)
    /// - `prompt: (batch, len)` u32
    /// - returns `(batch, image_len + len, hidden)`
    ///
    /// # Errors
    /// [`crate::DecoderError::Argument`] naming `image_tokens` or `prompt`
    /// for a shape that does not fit, an id outside the vocabulary, or a
    /// sequence longer than the positions.
    pub fn forward(&self, image_tokens: Option<&Tensor>, prompt: &Tensor) -> Result<Tensor> {
        vl_attn::kernels::on_pool(|| self.encode(image_tokens, prompt))
    }

    fn encode(&self, image_tokens: Option<&Tensor>, prompt: &Tensor) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (batch, len) = match prompt.dims() {
            &[b, l] => (b, l),
            d => return arg_err("prompt", format!("expected (batch, len), got {d:?}")),
        };
        if let Some(&bad) = prompt
            .flatten_all()?
            .to_vec1::<u32>()?
            .iter()
            .find(|&&id| id as usize >= cfg.vocab_size)
        {
            return arg_err(
                "prompt",
                format!("token id {bad} is not below vocab_size {}", cfg.vocab_size),
            );
        }
        let tokens = self.embed_tokens.forward(prompt)?;
        let tokens = match cfg.embed_scale() {
            Some(s) => (tokens * s)?,
            None => tokens,
        };
        let x = match image_tokens {
            None => tokens,
            Some(img) => {
                match img.dims() {
                    &[b, _, h] if b == batch && h == cfg.hidden_size => {}
                    d => {
                        return arg_err(
                            "image_tokens",
                            format!(
                                "expected ({batch}, image_len, {}), got {d:?}",
                                cfg.hidden_size
                            ),
                        )
                    }
                }
                Tensor::cat(&[&img.to_dtype(tokens.dtype())?, &tokens], 1)?
            }
        };
        let total = x.dim(1)?;
        if total > cfg.max_position_embeddings {
            return arg_err(
                "prompt",
                format!(
                    "{total} tokens (image and {len} prompt) do not fit in max_position_embeddings {}",
                    cfg.max_position_embeddings
                ),
            );
        }
        let positions = Tensor::arange(
            cfg.position_offset as u32,
            (cfg.position_offset + total) as u32,
            x.device(),
        )?;
        let pos = self
            .embed_positions
            .forward(&positions)?
            .to_dtype(x.dtype())?;
        let mut x = x.broadcast_add(&pos.unsqueeze(0)?)?;
        if let Some(n) = &self.embedding_norm {
            x = n.forward(&x)?;
        }
        for layer in &self.layers {
            x = layer.forward(&x, cfg.norm_placement)?;
        }
        if let Some(n) = &self.final_norm {
            x = n.forward(&x)?;
        }
        Ok(x)
    }
}

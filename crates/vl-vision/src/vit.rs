//! A small, trainable ViT image encoder: patch embedding, a CLS token,
//! learned positions, pre-LN encoder blocks (bidirectional self-attention
//! and a feed-forward layer), a final norm.

use candle_core::{DType, Tensor};
use candle_nn::{Init, Linear, Module, VarBuilder};

use serde::{Deserialize, Serialize};
use vl_attn::LayerNorm;
use vl_attn::{CrossAttention, CrossAttentionConfig};

use crate::error::{arg_err, config_err, Result};
use crate::preprocess::MAX_IMAGE_SIDE;
use vl_attn::Activation;

fn default_eps() -> f64 {
    1e-5
}

fn default_half() -> [f32; 3] {
    [0.5; 3]
}

/// The ViT's sizes and its input normalisation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VitConfig {
    /// Input height and width, in pixels; images are resized to it.
    pub image_size: usize,
    /// Patch height and width; divides `image_size`.
    pub patch_size: usize,
    /// Input channels.
    pub num_channels: usize,
    /// Token width.
    pub hidden_size: usize,
    /// Encoder blocks.
    pub num_hidden_layers: usize,
    /// Attention heads; divides `hidden_size`.
    pub num_attention_heads: usize,
    /// Feed-forward width.
    pub intermediate_size: usize,
    /// Layer-norm epsilon (default 1e-5).
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// Per-channel mean subtracted from pixels scaled to [0, 1] (default 0.5).
    #[serde(default = "default_half")]
    pub image_mean: [f32; 3],
    /// Per-channel std dividing them (default 0.5).
    #[serde(default = "default_half")]
    pub image_std: [f32; 3],
    /// Feed-forward activation (default `gelu`, the erf form, as ViT).
    #[serde(default)]
    pub hidden_act: Activation,
    /// When set, a linear layer `output_proj` maps the tokens to this width
    /// (transformers' `enc_to_dec_proj`, for a decoder wider or narrower
    /// than the encoder).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_size: Option<usize>,
}

impl VitConfig {
    /// What the encoder expects of its pixels.
    pub fn pixel_spec(&self) -> crate::preprocess::PixelSpec {
        crate::preprocess::PixelSpec::new(self.image_size, self.image_mean, self.image_std)
    }

    /// The width of the encoder's output tokens.
    pub fn output_width(&self) -> usize {
        self.output_size.unwrap_or(self.hidden_size)
    }

    /// Patches per image.
    pub fn num_patches(&self) -> usize {
        (self.image_size / self.patch_size).pow(2)
    }

    /// Rejects impossible sizes.
    pub fn validate(&self) -> Result<()> {
        if self.patch_size == 0 || self.image_size == 0 || self.image_size % self.patch_size != 0 {
            return config_err(
                "vision.patch_size",
                format!(
                    "{} must divide image_size {}",
                    self.patch_size, self.image_size
                ),
            );
        }
        // Also keeps patches and patch widths far from overflowing.
        if self.image_size > MAX_IMAGE_SIDE as usize {
            return config_err(
                "vision.image_size",
                format!(
                    "{} is larger than the largest image side accepted, {MAX_IMAGE_SIDE}",
                    self.image_size
                ),
            );
        }
        for (field, v) in [
            ("vision.num_channels", self.num_channels),
            ("vision.hidden_size", self.hidden_size),
            ("vision.num_hidden_layers", self.num_hidden_layers),
            ("vision.num_attention_heads", self.num_attention_heads),
            ("vision.intermediate_size", self.intermediate_size),
            ("vision.output_size", self.output_size.unwrap_or(1)),
        ] {
            if v == 0 {
                return config_err(field, "must be positive, got 0");
            }
        }
        if self.num_channels != 3 {
            return config_err(
                "vision.num_channels",
                format!("only RGB (3) is supported, got {}", self.num_channels),
            );
        }
        if self.hidden_size % self.num_attention_heads != 0 {
            return config_err(
                "vision.hidden_size",
                format!(
                    "{} is not divisible by num_attention_heads {}",
                    self.hidden_size, self.num_attention_heads
                ),
            );
        }
        if let Some(s) = self.image_std.iter().find(|s| !s.is_finite() || **s <= 0.0) {
            return config_err("vision.image_std", format!("must be positive, got {s}"));
        }
        Ok(())
    }
}

/// One pre-LN encoder block: `x += attn(attn_norm(x))` (bidirectional),
/// `x += ffn(ffn_norm(x))`.
#[derive(Debug, Clone)]
pub struct VitBlock {
    attn_norm: LayerNorm,
    /// Self-attention as cross-attention of the tokens over themselves.
    attn: CrossAttention,
    ffn_norm: LayerNorm,
    up: Linear,
    down: Linear,
    act: Activation,
}

impl VitBlock {
    /// Builds a block from existing parts (checkpoint converters): `attn` is
    /// the tokens' attention over themselves (query and memory widths
    /// equal), `up`/`down` the feed-forward layer.
    pub fn from_parts(
        attn_norm: LayerNorm,
        attn: CrossAttention,
        ffn_norm: LayerNorm,
        up: Linear,
        down: Linear,
        act: Activation,
    ) -> Self {
        Self {
            attn_norm,
            attn,
            ffn_norm,
            up,
            down,
            act,
        }
    }

    fn load(vb: VarBuilder, cfg: &VitConfig) -> Result<Self> {
        let eps = cfg.layer_norm_eps;
        let d = cfg.hidden_size;
        Ok(Self {
            attn_norm: LayerNorm::load(d, eps, vb.pp("attn_norm"))?,
            attn: CrossAttention::load(
                vb.pp("attn"),
                &CrossAttentionConfig::new(d, d, cfg.num_attention_heads),
            )?,
            ffn_norm: LayerNorm::load(d, eps, vb.pp("ffn_norm"))?,
            up: candle_nn::linear(d, cfg.intermediate_size, vb.pp("ffn").pp("up"))?,
            down: candle_nn::linear(cfg.intermediate_size, d, vb.pp("ffn").pp("down"))?,
            act: cfg.hidden_act,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.attn_norm.forward(x)?;
        let x = (x + self.attn.forward(&h, &h, None)?)?;
        let h = self
            .act
            .forward(&self.up.forward(&self.ffn_norm.forward(&x)?)?)?;
        Ok((&x + self.down.forward(&h)?)?)
    }
}

/// The encoder.
///
/// Weights: `patch_embed (hidden, channels * patch * patch)` with bias
/// (a convolution of stride = kernel = patch, flattened channel-major),
/// `cls (1, 1, hidden)`, `positions (1, 1 + patches, hidden)`,
/// `blocks.{i}.*`, `final_norm`, and `output_proj` when `output_size` is
/// set.
#[derive(Debug, Clone)]
pub struct Vit {
    patch_embed: Linear,
    cls: Tensor,
    positions: Tensor,
    blocks: Vec<VitBlock>,
    final_norm: LayerNorm,
    output_proj: Option<Linear>,
    cfg: VitConfig,
}

impl Vit {
    /// Loads or initialises the encoder under `vb`.
    pub fn load(vb: VarBuilder, cfg: &VitConfig) -> Result<Self> {
        cfg.validate()?;
        let d = cfg.hidden_size;
        let fan_in = cfg.num_channels * cfg.patch_size * cfg.patch_size;
        let small = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| VitBlock::load(vb.pp("blocks").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let output_proj = match cfg.output_size {
            Some(out) => Some(candle_nn::linear(d, out, vb.pp("output_proj"))?),
            None => None,
        };
        Self::from_parts(
            candle_nn::linear(fan_in, d, vb.pp("patch_embed"))?,
            vb.get_with_hints((1, 1, d), "cls", small)?,
            vb.get_with_hints((1, 1 + cfg.num_patches(), d), "positions", small)?,
            blocks,
            LayerNorm::load(d, cfg.layer_norm_eps, vb.pp("final_norm"))?,
            output_proj,
            cfg,
        )
    }

    /// Builds the encoder from existing parts (checkpoint converters).
    /// `patch_embed` maps `channels * patch * patch` flattened channel-major
    /// to `hidden`; `output_proj` is present exactly when
    /// `cfg.output_size` is set.
    ///
    /// # Shapes
    /// `cls: (1, 1, hidden)`, `positions: (1, 1 + patches, hidden)`.
    pub fn from_parts(
        patch_embed: Linear,
        cls: Tensor,
        positions: Tensor,
        blocks: Vec<VitBlock>,
        final_norm: LayerNorm,
        output_proj: Option<Linear>,
        cfg: &VitConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        let d = cfg.hidden_size;
        if cls.dims() != [1, 1, d] {
            return arg_err(
                "cls",
                format!("expected shape (1, 1, {d}), got {:?}", cls.dims()),
            );
        }
        let n = 1 + cfg.num_patches();
        if positions.dims() != [1, n, d] {
            return arg_err(
                "positions",
                format!("expected shape (1, {n}, {d}), got {:?}", positions.dims()),
            );
        }
        if blocks.len() != cfg.num_hidden_layers {
            return arg_err(
                "blocks",
                format!(
                    "expected {} blocks, got {}",
                    cfg.num_hidden_layers,
                    blocks.len()
                ),
            );
        }
        if output_proj.is_some() != cfg.output_size.is_some() {
            return arg_err(
                "output_proj",
                "must be given exactly when the config sets output_size",
            );
        }
        Ok(Self {
            patch_embed,
            cls,
            positions,
            blocks,
            final_norm,
            output_proj,
            cfg: cfg.clone(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &VitConfig {
        &self.cfg
    }

    /// Image tokens: CLS first, then the patches in row-major order.
    ///
    /// # Shapes
    /// `pixels: (batch, channels, image_size, image_size)`, normalised →
    /// `(batch, 1 + patches, output_width)`.
    pub fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        let x = self.last_hidden_state(pixels)?;
        match &self.output_proj {
            Some(proj) => Ok(proj.forward(&x)?),
            None => Ok(x),
        }
    }

    /// The encoder's tokens after the final norm, before `output_proj`
    /// (transformers' `last_hidden_state`).
    ///
    /// # Shapes
    /// `pixels: (batch, channels, image_size, image_size)`, normalised →
    /// `(batch, 1 + patches, hidden)`.
    pub fn last_hidden_state(&self, pixels: &Tensor) -> Result<Tensor> {
        let c = &self.cfg;
        let dims = pixels.dims();
        if dims.len() != 4 || dims[1..] != [c.num_channels, c.image_size, c.image_size] {
            return arg_err(
                "pixels",
                format!(
                    "expected shape (batch, {}, {}, {}), got {dims:?}",
                    c.num_channels, c.image_size, c.image_size
                ),
            );
        }
        let b = dims[0];
        let (p, g) = (c.patch_size, c.image_size / c.patch_size);
        let dtype: DType = self.cls.dtype();
        // (b, c, g, p, g, p) -> (b, g, g, c, p, p) -> (b, g*g, c*p*p)
        let patches = pixels
            .to_dtype(dtype)?
            .reshape((b, c.num_channels, g, p, g, p))?
            .permute((0, 2, 4, 1, 3, 5))?
            .reshape((b, g * g, c.num_channels * p * p))?;
        let tokens = self.patch_embed.forward(&patches)?;
        let cls = self.cls.broadcast_as((b, 1, c.hidden_size))?;
        let mut x = Tensor::cat(&[&cls, &tokens], 1)?.broadcast_add(&self.positions)?;
        for block in &self.blocks {
            x = block.forward(&x)?;
        }
        Ok(self.final_norm.forward(&x)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `config` fuzz target: a validated config whose patch
    /// count overflowed.
    #[test]
    fn validate_refuses_an_image_side_past_the_limit() {
        let mut cfg: VitConfig = serde_json::from_str(
            r#"{"image_size": 4, "patch_size": 2, "num_channels": 3, "hidden_size": 4,
                "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 4}"#,
        )
        .expect("parse");
        cfg.validate().expect("valid");
        cfg.image_size = 1 << 40;
        cfg.patch_size = 1;
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("vision.image_size"), "{err}");
        cfg.image_size = MAX_IMAGE_SIDE as usize;
        cfg.validate().expect("the limit itself is valid");
        assert_eq!(cfg.num_patches(), 1 << 28);
    }
}

//! A small, trainable ViT image encoder: patch embedding, a CLS token (and
//! DeiT's distillation token after it, when configured), learned positions, pre-LN encoder blocks (bidirectional self-attention
//! and a feed-forward layer), a final norm.

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor};
use candle_nn::{Init, Linear, Module, VarBuilder};
use vl_attn::Quantizer;

use serde::{Deserialize, Serialize};
use vl_attn::{Dropout, FeedForward, LayerNorm, Mode, Proj, SelfAttention, SelfAttentionConfig};

use crate::error::{arg_err, config_err, Result};
use crate::preprocess::{PixelSpec, Resample, MAX_IMAGE_SIDE};
use vl_attn::Activation;

fn default_eps() -> f64 {
    1e-5
}

fn default_half() -> [f32; 3] {
    [0.5; 3]
}

fn default_rescale() -> f32 {
    1.0 / 255.0
}

fn is_default_rescale(f: &f32) -> bool {
    *f == default_rescale()
}

fn is_bilinear(r: &Resample) -> bool {
    *r == Resample::Bilinear
}

fn default_true() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
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
    /// Pixel values (0..=255) are multiplied by this before the mean is
    /// subtracted (default 1/255; 1.0 is transformers' `do_rescale =
    /// false`).
    #[serde(
        default = "default_rescale",
        skip_serializing_if = "is_default_rescale"
    )]
    pub rescale_factor: f32,
    /// The filter images are resized with (default `bilinear`).
    #[serde(default, skip_serializing_if = "is_bilinear")]
    pub resample: Resample,
    /// Whether images of another size are resized (default true); when
    /// false they must already be `image_size` square.
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub do_resize: bool,
    /// Feed-forward activation (default `gelu`, the erf form, as ViT).
    #[serde(default)]
    pub hidden_act: Activation,
    /// When set, a linear layer `output_proj` maps the tokens to this width
    /// (transformers' `enc_to_dec_proj`, for a decoder wider or narrower
    /// than the encoder).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_size: Option<usize>,
    /// Dropout on the attention probabilities, in training only (default
    /// 0; transformers' `attention_probs_dropout_prob`).
    #[serde(default, alias = "attention_probs_dropout_prob")]
    pub attention_dropout: f64,
    /// Dropout on the embeddings and on every residual branch, in training
    /// only (default 0; transformers' `hidden_dropout_prob`).
    #[serde(default, alias = "hidden_dropout_prob")]
    pub hidden_dropout: f64,
    /// DeiT's distillation token after the CLS token (default false): both
    /// lead the output tokens, and the positions cover them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub distillation_token: bool,
}

impl VitConfig {
    /// What the encoder expects of its pixels.
    pub fn pixel_spec(&self) -> PixelSpec {
        PixelSpec {
            height: self.image_size,
            width: self.image_size,
            mean: self.image_mean,
            std: self.image_std,
            rescale_factor: self.rescale_factor,
            resample: self.resample,
            resize: self.do_resize,
            document: None,
        }
    }

    /// The width of the encoder's output tokens.
    pub fn output_width(&self) -> usize {
        self.output_size.unwrap_or(self.hidden_size)
    }

    /// Tokens before the patches: CLS, and the distillation token (DeiT).
    pub fn num_prefix_tokens(&self) -> usize {
        1 + usize::from(self.distillation_token)
    }

    /// Patches per image.
    pub fn num_patches(&self) -> usize {
        (self.image_size / self.patch_size).pow(2)
    }

    /// Rejects impossible sizes.
    pub fn validate(&self) -> Result<()> {
        if self.patch_size == 0
            || self.image_size == 0
            || !self.image_size.is_multiple_of(self.patch_size)
        {
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
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
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
        self.dropouts()?;
        Ok(())
    }

    /// The attention and hidden dropouts, checked.
    ///
    /// # Errors
    /// A config error naming `vision.attention_dropout` or
    /// `vision.hidden_dropout` when it is not in `[0, 1)`.
    pub fn dropouts(&self) -> Result<(Dropout, Dropout)> {
        let check = |field, p| match Dropout::new(field, p) {
            Ok(d) => Ok(d),
            Err(_) => config_err(
                field,
                format!("expected a dropout probability in [0, 1), got {p}"),
            ),
        };
        Ok((
            check("vision.attention_dropout", self.attention_dropout)?,
            check("vision.hidden_dropout", self.hidden_dropout)?,
        ))
    }
}

/// One pre-LN encoder block: `x += attn(attn_norm(x))` (bidirectional),
/// `x += ffn(ffn_norm(x))`.
///
/// Weights: `attn_norm`, `attn.{q,k,v,o}_proj` (as [`SelfAttention::load`]),
/// `ffn_norm`, `ffn.up`, `ffn.down` (as [`FeedForward::load`]).
#[derive(Debug, Clone)]
pub struct VitBlock {
    attn_norm: LayerNorm,
    attn: SelfAttention,
    ffn_norm: LayerNorm,
    ffn: FeedForward,
    /// On each branch before it is added back, in training.
    resid_dropout: Dropout,
    mode: Mode,
}

impl VitBlock {
    /// Adds the block's tensors under `prefix` (see [`vl_attn::named`]).
    pub fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        use vl_attn::named::join;
        self.attn_norm
            .named_tensors(&join(prefix, "attn_norm"), out);
        self.attn.named_tensors(&join(prefix, "attn"), out)?;
        self.ffn_norm.named_tensors(&join(prefix, "ffn_norm"), out);
        self.ffn.named_tensors(&join(prefix, "ffn"), out)?;
        Ok(())
    }

    /// Builds a block from existing parts (checkpoint converters): `attn`
    /// the tokens' bidirectional self-attention, `ffn` the feed-forward
    /// layer.
    pub fn from_parts(
        attn_norm: LayerNorm,
        attn: SelfAttention,
        ffn_norm: LayerNorm,
        ffn: FeedForward,
    ) -> Self {
        Self {
            attn_norm,
            attn,
            ffn_norm,
            ffn,
            resid_dropout: Dropout::NONE,
            mode: Mode::Inference,
        }
    }

    /// Sets the attention dropout and the residual dropout; they act only
    /// in training.
    pub fn with_dropouts(self, attention: Dropout, residual: Dropout) -> Self {
        Self {
            attn: self.attn.with_attention_dropout(attention),
            resid_dropout: residual,
            ..self
        }
    }

    /// Switches between training and inference (the default).
    pub fn set_mode(&mut self, mode: Mode) {
        self.attn.set_mode(mode.clone());
        self.mode = mode;
    }

    fn load(vb: VarBuilder, cfg: &VitConfig) -> Result<Self> {
        let eps = cfg.layer_norm_eps;
        let d = cfg.hidden_size;
        Ok(Self::from_parts(
            LayerNorm::load(d, eps, vb.pp("attn_norm"))?,
            SelfAttention::load(
                vb.pp("attn"),
                &SelfAttentionConfig::new(d, cfg.num_attention_heads),
            )?,
            LayerNorm::load(d, eps, vb.pp("ffn_norm"))?,
            FeedForward::load(vb.pp("ffn"), d, cfg.intermediate_size, cfg.hidden_act)?,
        ))
    }

    /// A copy with the attention's and the feed-forward's projections
    /// quantized to `format`; the norms stay dense.
    ///
    /// # Errors
    /// [`vl_attn::AttnError::Quantize`] naming the first projection that
    /// cannot be quantized, e.g. `attn.q_proj`.
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        Ok(Self {
            attn: self.attn.quantize(q.within("attn"))?,
            ffn: self.ffn.quantize(q.within("ffn"))?,
            ..self.clone()
        })
    }

    /// # Shapes
    /// `x: (batch, tokens, hidden)` → `(batch, tokens, hidden)`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.attn.forward(&self.attn_norm.forward(x)?, None)?;
        // vl's addition for bf16 on CPU (candle's otherwise): the same sums.
        let x = vl_attn::kernels::add::add(x, &self.resid_dropout.forward(&h, &self.mode)?)?;
        let h = self.ffn.forward(&self.ffn_norm.forward(&x)?)?;
        Ok(vl_attn::kernels::add::add(
            &x,
            &self.resid_dropout.forward(&h, &self.mode)?,
        )?)
    }
}

/// The encoder.
///
/// Weights: `patch_embed (hidden, channels * patch * patch)` with bias
/// (a convolution of stride = kernel = patch, flattened channel-major),
/// `cls (1, prefix, hidden)` (CLS, then DeiT's distillation token when
/// configured), `positions (1, prefix + patches, hidden)`,
/// `blocks.{i}.*`, `final_norm`, and `output_proj` when `output_size` is
/// set.
#[derive(Debug, Clone)]
pub struct Vit {
    patch_embed: Proj,
    cls: Tensor,
    positions: Tensor,
    blocks: Vec<VitBlock>,
    final_norm: LayerNorm,
    output_proj: Option<Proj>,
    /// On the patch and position embeddings, in training.
    embd_dropout: Dropout,
    mode: Mode,
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
            vb.get_with_hints((1, cfg.num_prefix_tokens(), d), "cls", small)?,
            vb.get_with_hints(
                (1, cfg.num_prefix_tokens() + cfg.num_patches(), d),
                "positions",
                small,
            )?,
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
    /// `cls: (1, prefix, hidden)`, `positions: (1, prefix + patches,
    /// hidden)`, `prefix` being 1, or 2 with DeiT's distillation token
    /// (CLS first, then the distillation token).
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
        let prefix = cfg.num_prefix_tokens();
        if cls.dims() != [1, prefix, d] {
            return arg_err(
                "cls",
                format!("expected shape (1, {prefix}, {d}), got {:?}", cls.dims()),
            );
        }
        let n = prefix + cfg.num_patches();
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
        let (attention, hidden) = cfg.dropouts()?;
        let blocks = blocks
            .into_iter()
            .map(|b| b.with_dropouts(attention, hidden))
            .collect();
        Ok(Self {
            patch_embed: Proj::from(patch_embed),
            cls,
            positions,
            blocks,
            final_norm,
            output_proj: output_proj.map(Proj::from),
            embd_dropout: hidden,
            mode: Mode::Inference,
            cfg: cfg.clone(),
        })
    }

    /// A copy with the linear layers of every block (the attention's four
    /// projections, the feed-forward's two) and `output_proj` quantized to
    /// `format` (e.g. [`GgmlDType::Q8_0`], [`GgmlDType::Q4K`]), as
    /// the decoder's `VisionLanguageDecoder::quantize` does.
    /// The patch embedding stays dense for the block formats, as the
    /// decoder's embeddings do: it runs once per image, and its input width
    /// `channels * patch²` (48 for 4-pixel patches) is often not a multiple
    /// of the block size. With the 16-bit formats (`BF16`, `F16`) it is
    /// converted too, as transformers' bf16 model has it: in bf16 on CPU it
    /// runs on vl's bf16 kernels (in f32 on candle's it took ~3% of a
    /// ViT-B/16 encode). Norms, the CLS token and the positions stay dense;
    /// activations keep the model's dtype.
    ///
    /// # Errors
    /// [`vl_attn::AttnError::Quantize`] (wrapped in this crate's error)
    /// naming the first layer whose input width is not a multiple of the
    /// format's block size (32 for `q8_0`, 256 for `q4k`), e.g.
    /// `blocks.0.attn.q_proj` for a `hidden_size` of 48.
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        let blocks = self
            .blocks
            .iter()
            .enumerate()
            .map(|(i, b)| b.quantize(q.within(&format!("blocks.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let output_proj = match &self.output_proj {
            Some(p) => Some(q.proj("output_proj", p)?),
            None => None,
        };
        // The patch embedding reads raw pixels: it takes 16-bit weights,
        // never blocks.
        let patch_embed = match q.format() {
            Some(GgmlDType::BF16 | GgmlDType::F16) => q.proj("patch_embed", &self.patch_embed)?,
            _ => self.patch_embed.clone(),
        };
        Ok(Self {
            patch_embed,
            blocks,
            output_proj,
            ..self.clone()
        })
    }

    /// The quantized format of the blocks' linear layers, `None` when dense.
    pub fn quantization(&self) -> Option<GgmlDType> {
        self.blocks.first().and_then(|b| b.attn.quantization())
    }

    /// The configuration.
    pub fn config(&self) -> &VitConfig {
        &self.cfg
    }

    /// Switches the encoder between training and inference (the default).
    /// In training, `hidden_dropout` acts on the embeddings and on every
    /// residual branch and `attention_dropout` on the attention
    /// probabilities, with masks from the mode's generator; in inference
    /// the outputs are bit-identical to an encoder without dropout.
    pub fn set_mode(&mut self, mode: Mode) {
        for b in &mut self.blocks {
            b.set_mode(mode.clone());
        }
        self.mode = mode;
    }

    /// Adds the encoder's tensors under `prefix`, by the names
    /// [`Vit::load`] reads (see [`vl_attn::named`]).
    ///
    /// # Errors
    /// candle's, dequantizing a converted layer.
    pub fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        use vl_attn::named::join;
        self.patch_embed
            .named_tensors(&join(prefix, "patch_embed"), out)?;
        out.insert(join(prefix, "cls"), self.cls.clone());
        out.insert(join(prefix, "positions"), self.positions.clone());
        for (i, b) in self.blocks.iter().enumerate() {
            b.named_tensors(&join(prefix, &format!("blocks.{i}")), out)?;
        }
        self.final_norm
            .named_tensors(&join(prefix, "final_norm"), out);
        if let Some(p) = &self.output_proj {
            p.named_tensors(&join(prefix, "output_proj"), out)?;
        }
        Ok(())
    }

    /// Image tokens: CLS first (then DeiT's distillation token), then the
    /// patches in row-major order.
    ///
    /// # Shapes
    /// `pixels: (batch, channels, image_size, image_size)`, normalised →
    /// `(batch, prefix + patches, output_width)`, `prefix` 1 or 2 (DeiT).
    pub fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        // On the pool, so that each product does not wake it from the
        // caller's thread (see `vl_attn::kernels::on_pool`).
        vl_attn::kernels::on_pool(|| {
            // Inline on the worker this runs on (on_pool nests for free).
            let x = self.last_hidden_state(pixels)?;
            match &self.output_proj {
                Some(proj) => Ok(proj.forward(&x)?),
                None => Ok(x),
            }
        })
    }

    /// The encoder's tokens after the final norm, before `output_proj`
    /// (transformers' `last_hidden_state`).
    ///
    /// # Shapes
    /// `pixels: (batch, channels, image_size, image_size)`, normalised →
    /// `(batch, prefix + patches, hidden)`.
    pub fn last_hidden_state(&self, pixels: &Tensor) -> Result<Tensor> {
        vl_attn::kernels::on_pool(|| self.encode(pixels))
    }

    /// The patch embedding, the blocks and the final norm (see
    /// [`Vit::last_hidden_state`]).
    fn encode(&self, pixels: &Tensor) -> Result<Tensor> {
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
        let cls = self
            .cls
            .broadcast_as((b, c.num_prefix_tokens(), c.hidden_size))?;
        let x = Tensor::cat(&[&cls, &tokens], 1)?.broadcast_add(&self.positions)?;
        let mut x = self.embd_dropout.forward(&x, &self.mode)?;
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

    fn tiny(hidden_size: usize, output_size: Option<usize>) -> VitConfig {
        VitConfig {
            image_size: 8,
            patch_size: 4,
            num_channels: 3,
            hidden_size,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            intermediate_size: 2 * hidden_size,
            layer_norm_eps: 1e-5,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            rescale_factor: 1.0 / 255.0,
            resample: Resample::Bilinear,
            do_resize: true,
            hidden_act: Activation::Gelu,
            output_size,
            attention_dropout: 0.0,
            hidden_dropout: 0.0,
            distillation_token: false,
        }
    }

    /// Inference is bit-identical with and without the dropout fields;
    /// training drops, the same seed the same way; a probability out of
    /// range names its field.
    #[test]
    fn dropout_acts_only_in_training() -> Result<()> {
        let plain_cfg = tiny(16, None);
        let cfg = VitConfig {
            attention_dropout: 0.3,
            hidden_dropout: 0.2,
            ..plain_cfg.clone()
        };
        let (vars, plain) = load(&plain_cfg)?;
        let vb = VarBuilder::from_varmap(&vars, DType::F32, &candle_core::Device::Cpu);
        let mut dropped = Vit::load(vb, &cfg)?;
        let pixels = Tensor::randn(0f32, 1., (2, 3, 8, 8), &candle_core::Device::Cpu)?;
        let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
            Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
        };
        let want = plain.forward(&pixels)?;
        assert_eq!(diff(&want, &dropped.forward(&pixels)?)?, 0.0);
        let mut train = |seed| -> Result<Tensor> {
            dropped.set_mode(Mode::training(seed));
            dropped.forward(&pixels)
        };
        let (a, b, c) = (train(3)?, train(3)?, train(4)?);
        assert_eq!(diff(&a, &b)?, 0.0);
        assert!(diff(&a, &c)? > 0.0);
        assert!(diff(&a, &want)? > 0.0);
        for (field, edit) in [
            (
                "vision.attention_dropout",
                VitConfig {
                    attention_dropout: 1.0,
                    ..plain_cfg.clone()
                },
            ),
            (
                "vision.hidden_dropout",
                VitConfig {
                    hidden_dropout: -0.5,
                    ..plain_cfg.clone()
                },
            ),
        ] {
            let err = edit.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
        }
        Ok(())
    }

    fn load(cfg: &VitConfig) -> Result<(candle_nn::VarMap, Vit)> {
        let vars = candle_nn::VarMap::new();
        let vb = VarBuilder::from_varmap(&vars, DType::F32, &candle_core::Device::Cpu);
        let vit = Vit::load(vb, cfg)?;
        Ok((vars, vit))
    }

    /// The weight names stay those of the ViT before it shared vl-attn's
    /// modules, so that saved encoders still load.
    #[test]
    fn weight_names_are_unchanged() -> Result<()> {
        let (vars, _) = load(&tiny(32, Some(16)))?;
        let data = vars.data().lock().expect("an unpoisoned VarMap");
        let mut block0: Vec<&str> = data
            .keys()
            .filter_map(|k| k.strip_prefix("blocks.0."))
            .collect();
        block0.sort_unstable();
        let mut want = vec![
            "attn.k_proj.bias",
            "attn.k_proj.weight",
            "attn.o_proj.bias",
            "attn.o_proj.weight",
            "attn.q_proj.bias",
            "attn.q_proj.weight",
            "attn.v_proj.bias",
            "attn.v_proj.weight",
            "attn_norm.bias",
            "attn_norm.weight",
            "ffn.down.bias",
            "ffn.down.weight",
            "ffn.up.bias",
            "ffn.up.weight",
            "ffn_norm.bias",
            "ffn_norm.weight",
        ];
        want.sort_unstable();
        assert_eq!(block0, want);
        for top in [
            "patch_embed.weight",
            "cls",
            "positions",
            "final_norm.weight",
            "output_proj.weight",
        ] {
            assert!(data.contains_key(top), "{top}");
        }
        Ok(())
    }

    /// `|got - want| / |want|`, L2 norms over every element.
    fn relative_l2(got: &Tensor, want: &Tensor) -> Result<f32> {
        let norm =
            |t: &Tensor| -> Result<f32> { Ok(t.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?) };
        Ok(norm(&(got - want)?)? / norm(want)?)
    }

    /// A ViT of width 64 (a multiple of q8_0's block of 32) quantized to
    /// q8_0 gives tokens within 4% relative L2 error of the dense ones
    /// (seen: 2.1-2.2% over three runs of random weights and pixels: two
    /// blocks of six quantized projections, then `output_proj`).
    #[test]
    fn quantized_close_to_dense() -> Result<()> {
        let (_vars, dense) = load(&tiny(64, Some(32)))?;
        assert_eq!(dense.quantization(), None);
        let q = dense.quantize(GgmlDType::Q8_0)?;
        assert_eq!(q.quantization(), Some(GgmlDType::Q8_0));
        let pixels = Tensor::randn(0f32, 1., (2, 3, 8, 8), &candle_core::Device::Cpu)?;
        let want = dense.forward(&pixels)?;
        let got = q.forward(&pixels)?;
        assert_eq!(got.dims(), &[2, 5, 32]);
        let err = relative_l2(&got, &want)?;
        assert!(err < 0.04, "relative L2 error {err} >= 0.04");
        // Quantizing again to the same format changes nothing.
        let again = q.quantize(GgmlDType::Q8_0)?.forward(&pixels)?;
        assert_eq!((&again - &got)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
        Ok(())
    }

    /// Packed for vl's f32 product ([`vl_attn::Quantizer::packing_f32`]),
    /// the encoder gives the dense encoder's tokens: bit for bit where
    /// this CPU's tuning runs the dense products on vl's f32 GEMM (the
    /// packed product's sums are its sums), within 1e-6 relative L2
    /// elsewhere (candle's product).
    #[test]
    fn packed_f32_is_the_dense_encoder() -> Result<()> {
        use vl_attn::kernels::{CpuFeatures, F32Gemm};
        let (_vars, dense) = load(&tiny(64, Some(32)))?;
        let packed = dense.quantize(vl_attn::Quantizer::packing_f32())?;
        assert_eq!(packed.quantization(), None);
        let pixels = Tensor::randn(0f32, 1., (4, 3, 8, 8), &candle_core::Device::Cpu)?;
        let (want, got) = (dense.forward(&pixels)?, packed.forward(&pixels)?);
        if CpuFeatures::get().tuning.f32_gemm == F32Gemm::Vl {
            let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0);
        } else {
            let err = relative_l2(&got, &want)?;
            assert!(err < 1e-6, "relative L2 error {err}");
        }
        Ok(())
    }

    /// The 16-bit formats convert the patch embedding with the blocks (a
    /// bf16 or f16 encoder, as transformers' half-precision models have
    /// it), within 2% relative L2 error of the dense encoder (bf16 keeps 8
    /// bits of mantissa: ~0.4% per rounding); the block formats leave it
    /// dense.
    #[test]
    fn sixteen_bit_formats_convert_the_patch_embedding() -> Result<()> {
        let (_vars, dense) = load(&tiny(64, Some(32)))?;
        let pixels = Tensor::randn(0f32, 1., (2, 3, 8, 8), &candle_core::Device::Cpu)?;
        let want = dense.forward(&pixels)?;
        for format in [GgmlDType::BF16, GgmlDType::F16] {
            let q = dense.quantize(format)?;
            assert_eq!(q.patch_embed.quantization(), Some(format));
            let got = q.forward(&pixels)?;
            let err = relative_l2(&got, &want)?;
            assert!(err < 0.02, "{format:?}: relative L2 error {err}");
        }
        let q8 = dense.quantize(GgmlDType::Q8_0)?;
        assert_eq!(q8.patch_embed.quantization(), None);
        Ok(())
    }

    /// A width that does not fit the block size is an error naming the
    /// layer, its sizes and the block.
    #[test]
    fn unsupported_width_names_the_layer() -> Result<()> {
        let (_vars, vit) = load(&tiny(48, None))?;
        let err = vit
            .quantize(GgmlDType::Q8_0)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("blocks.0.attn.q_proj") && err.contains("48") && err.contains("32"),
            "{err}"
        );
        // Width 64 fits q8_0's 32 but not q4k's 256.
        let (_vars, vit) = load(&tiny(64, None))?;
        let err = vit
            .quantize(GgmlDType::Q4K)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("blocks.0.attn.q_proj") && err.contains("256"),
            "{err}"
        );
        Ok(())
    }

    /// DeiT's distillation token: a second prefix token, in `cls` after
    /// CLS, covered by the positions and leading the output with CLS.
    #[test]
    fn the_distillation_token_leads_the_output_with_cls() -> Result<()> {
        let cfg = VitConfig {
            distillation_token: true,
            ..tiny(16, None)
        };
        let (vars, vit) = load(&cfg)?;
        let dev = candle_core::Device::Cpu;
        let pixels = Tensor::randn(0f32, 1., (2, 3, 8, 8), &dev)?;
        // CLS + distillation + (8 / 4)^2 patches
        assert_eq!(vit.forward(&pixels)?.dims(), &[2, 6, 16]);
        let names: Vec<String> = vars.data().lock().expect("lock").keys().cloned().collect();
        assert!(names.iter().any(|n| n == "cls"), "{names:?}");
        let err = Vit::from_parts(
            vit.patch_embed.as_linear().expect("dense").clone(),
            Tensor::zeros((1, 1, 16), DType::F32, &dev)?,
            vit.positions.clone(),
            vit.blocks.clone(),
            vit.final_norm.clone(),
            None,
            &cfg,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("cls") && err.contains("(1, 2, 16)"), "{err}");
        Ok(())
    }
}

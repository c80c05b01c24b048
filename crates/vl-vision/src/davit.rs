//! DaViT, Florence-2's vision tower, and the projector that turns its last
//! map into the language model's image tokens (transformers'
//! `Florence2VisionBackbone` and `Florence2MultiModalProjector`).
//!
//! Per stage: a convolutional patch embedding (kernel, stride, padding as
//! configured; its LayerNorm before the convolution or after it), then
//! blocks of two halves:
//!
//! - spatial: `x += dwconv(x)`; `x += proj(window_attention(norm1(x)))`
//!   over non-overlapping `window_size²` windows (the map zero-padded
//!   right and bottom to whole windows *after* the norm, the padding taking
//!   part as keys, as transformers does); `x += dwconv(x)`;
//!   `x += mlp(norm2(x))`;
//! - channel: the same with channel attention: per group of
//!   `channels / num_groups` channels, the channels attend to each other
//!   over the tokens (`q kᵀ` is `(d, d)`, scaled by `1/√tokens`).
//!
//! The map is held channels-last `(batch, height, width, channels)` from
//! the first patch embedding to the projector, so that every token-wise
//! layer reads it in place and the depth-wise convolutions
//! ([`vl_attn::DepthwiseConv`]) run on it directly.
//!
//! The projector adds a learned 2-D position (column embedding, then row
//! embedding, concatenated) and the 1-D cosine temporal embedding of frame
//! 0 (`[0, 1, 0, 1, …]`), prepends the mean of the tokens (spatial
//! pooling; temporal pooling over one frame is the tokens themselves),
//! projects to `projection_dim` without bias and normalises: `1 + h·w`
//! image tokens.

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Module, Tensor};
use candle_nn::{Embedding, Linear, VarBuilder};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use vl_attn::attention::{attention, Backend, Weights};
use vl_attn::kernels::add::add;
use vl_attn::{
    Activation, DepthwiseConv, FeedForward, LayerNorm, PatchConv, Proj, Quantizer, WindowOrder,
};

use crate::error::{config_err, Result};
use crate::preprocess::{PixelSpec, Resample, MAX_IMAGE_SIDE};

/// DaViT's and the projector's LayerNorms: `torch.nn.LayerNorm`'s default.
pub const DAVIT_LAYER_NORM_EPS: f64 = 1e-5;

fn default_three() -> usize {
    3
}
fn default_mlp_ratio() -> f64 {
    4.0
}
fn default_true() -> bool {
    true
}
fn default_imagenet_mean() -> [f32; 3] {
    [0.485, 0.456, 0.406]
}
fn default_imagenet_std() -> [f32; 3] {
    [0.229, 0.224, 0.225]
}
fn default_rescale() -> f32 {
    1.0 / 255.0
}
fn default_bicubic() -> Resample {
    Resample::Bicubic
}
fn default_positions() -> usize {
    50
}
fn default_temporal() -> usize {
    100
}

/// DaViT's stages and the projector's sizes, with the input
/// normalisation (transformers' `Florence2VisionConfig` and the image
/// processor's settings).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DavitConfig {
    /// Input height and width, in pixels; images are resized to it.
    pub image_size: usize,
    /// Input channels (default 3).
    #[serde(default = "default_three")]
    pub in_channels: usize,
    /// Blocks per stage.
    pub depths: Vec<usize>,
    /// Patch-embedding kernel per stage.
    pub patch_size: Vec<usize>,
    /// Patch-embedding stride per stage.
    pub patch_stride: Vec<usize>,
    /// Patch-embedding zero padding per stage.
    pub patch_padding: Vec<usize>,
    /// Per stage: the patch embedding's LayerNorm before the convolution
    /// (over its input channels) rather than after it.
    pub patch_prenorm: Vec<bool>,
    /// Channels per stage.
    pub embed_dim: Vec<usize>,
    /// Window-attention heads per stage.
    pub num_heads: Vec<usize>,
    /// Channel-attention groups per stage.
    pub num_groups: Vec<usize>,
    /// Window side, in tokens.
    pub window_size: usize,
    /// The MLP's width over the channels (default 4).
    #[serde(default = "default_mlp_ratio")]
    pub mlp_ratio: f64,
    /// Whether the attention `qkv` projections have biases (default true).
    #[serde(default = "default_true")]
    pub qkv_bias: bool,
    /// The MLP's activation (default `gelu`, the erf form).
    #[serde(default)]
    pub activation_function: Activation,
    /// Width of the image tokens.
    pub projection_dim: usize,
    /// Rows and columns of the learned 2-D position table (default 50).
    #[serde(default = "default_positions")]
    pub max_position_embeddings: usize,
    /// Frames of the temporal embedding (default 100; one is used).
    #[serde(default = "default_temporal")]
    pub max_temporal_embeddings: usize,
    /// Per-channel mean subtracted from rescaled pixels (default ImageNet's).
    #[serde(default = "default_imagenet_mean")]
    pub image_mean: [f32; 3],
    /// Per-channel std dividing them (default ImageNet's).
    #[serde(default = "default_imagenet_std")]
    pub image_std: [f32; 3],
    /// Pixel values (0..=255) are multiplied by this first (default 1/255).
    #[serde(default = "default_rescale")]
    pub rescale_factor: f32,
    /// The resize filter (default bicubic, as Florence-2's processor).
    #[serde(default = "default_bicubic")]
    pub resample: Resample,
    /// Whether images of another size are resized (default true).
    #[serde(default = "default_true")]
    pub do_resize: bool,
}

impl DavitConfig {
    /// Stages.
    pub fn num_stages(&self) -> usize {
        self.embed_dim.len()
    }

    /// What the tower expects of its pixels.
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

    /// The side of each stage's map, from the input's.
    pub fn map_sides(&self) -> Vec<usize> {
        let mut side = self.image_size;
        (0..self.num_stages())
            .map(|s| {
                side = (side + 2 * self.patch_padding[s]).saturating_sub(self.patch_size[s])
                    / self.patch_stride[s].max(1)
                    + 1;
                side
            })
            .collect()
    }

    /// Image tokens per image: the pooled token and the last map's.
    pub fn num_tokens(&self) -> usize {
        let side = self.map_sides().last().copied().unwrap_or(0);
        1 + side * side
    }

    /// The hidden width of stage `s`'s MLP (`int(dim * mlp_ratio)`).
    pub fn mlp_width(&self, s: usize) -> usize {
        (self.embed_dim[s] as f64 * self.mlp_ratio) as usize
    }

    /// Rejects impossible sizes, naming the field.
    pub fn validate(&self) -> Result<()> {
        let n = self.num_stages();
        if n == 0 {
            return config_err("embed_dim", "no stage");
        }
        for (field, len) in [
            ("depths", self.depths.len()),
            ("patch_size", self.patch_size.len()),
            ("patch_stride", self.patch_stride.len()),
            ("patch_padding", self.patch_padding.len()),
            ("patch_prenorm", self.patch_prenorm.len()),
            ("num_heads", self.num_heads.len()),
            ("num_groups", self.num_groups.len()),
        ] {
            if len != n {
                return config_err(
                    field,
                    format!("has {len} entries, embed_dim has {n} stages"),
                );
            }
        }
        if self.image_size == 0 || self.image_size > MAX_IMAGE_SIDE as usize {
            return config_err(
                "image_size",
                format!("{} is not in 1..={MAX_IMAGE_SIDE}", self.image_size),
            );
        }
        if self.window_size == 0 {
            return config_err("window_size", "must be at least 1");
        }
        if self.in_channels != 3 {
            return config_err(
                "in_channels",
                format!("images have 3 channels, got {}", self.in_channels),
            );
        }
        if !(self.mlp_ratio > 0.0 && self.mlp_ratio.is_finite()) {
            return config_err("mlp_ratio", format!("{} is not positive", self.mlp_ratio));
        }
        let mut side = self.image_size;
        for s in 0..n {
            let dim = self.embed_dim[s];
            if dim == 0 || self.mlp_width(s) == 0 {
                return config_err("embed_dim", format!("stage {s}: width {dim}"));
            }
            for (field, parts) in [
                ("num_heads", self.num_heads[s]),
                ("num_groups", self.num_groups[s]),
            ] {
                if parts == 0 || !dim.is_multiple_of(parts) {
                    return config_err(
                        field,
                        format!("stage {s}: {parts} does not divide embed_dim {dim}"),
                    );
                }
            }
            if self.patch_stride[s] == 0 {
                return config_err("patch_stride", format!("stage {s}: 0"));
            }
            if side + 2 * self.patch_padding[s] < self.patch_size[s] || self.patch_size[s] == 0 {
                return config_err(
                    "patch_size",
                    format!(
                        "stage {s}: kernel {} does not fit a map of side {side} padded by {}",
                        self.patch_size[s], self.patch_padding[s]
                    ),
                );
            }
            side =
                (side + 2 * self.patch_padding[s] - self.patch_size[s]) / self.patch_stride[s] + 1;
        }
        if side > self.max_position_embeddings {
            return config_err(
                "max_position_embeddings",
                format!(
                    "the last map has side {side}, the position table {} rows",
                    self.max_position_embeddings
                ),
            );
        }
        if self.max_temporal_embeddings == 0 {
            return config_err("max_temporal_embeddings", "must be at least 1");
        }
        if self.projection_dim == 0 {
            return config_err("projection_dim", "must be at least 1");
        }
        Ok(())
    }
}

fn linear(vb: VarBuilder, inp: usize, out: usize, bias: bool) -> Result<Proj> {
    let weight = vb.get((out, inp), "weight")?;
    let bias = if bias {
        Some(vb.get(out, "bias")?)
    } else {
        None
    };
    Ok(Proj::from(Linear::new(weight, bias)))
}

fn norm(vb: VarBuilder, width: usize) -> Result<LayerNorm> {
    Ok(LayerNorm::new(
        vb.get(width, "weight")?,
        vb.get(width, "bias")?,
        DAVIT_LAYER_NORM_EPS,
    ))
}

/// A stage's convolutional patch embedding: a [`PatchConv`] over the
/// channels-last map (on the CPU, patches and one of vl's products,
/// quantized with the blocks — except a stem whose width no block format
/// holds), then its LayerNorm (before the convolution where configured).
#[derive(Debug, Clone)]
struct ConvEmbed {
    conv: PatchConv,
    norm: LayerNorm,
    pre_norm: bool,
    /// The activations' dtype.
    dtype: DType,
}

impl ConvEmbed {
    fn load(vb: VarBuilder, cfg: &DavitConfig, s: usize) -> Result<Self> {
        let inp = if s == 0 {
            cfg.in_channels
        } else {
            cfg.embed_dim[s - 1]
        };
        let out = cfg.embed_dim[s];
        let conv = PatchConv::load(
            vb.pp("conv"),
            (inp, out),
            cfg.patch_size[s],
            (cfg.patch_stride[s], cfg.patch_padding[s]),
            true,
        )?;
        let pre_norm = cfg.patch_prenorm[s];
        let norm = norm(vb.pp("norm"), if pre_norm { inp } else { out })?;
        Ok(Self {
            conv,
            norm,
            pre_norm,
            dtype: vb.dtype(),
        })
    }

    /// `x: (batch, h, w, in)` channels-last (stage 0: `(batch, 3, H, W)`
    /// pixels) → `(batch, h', w', out)`.
    fn forward(&self, x: &Tensor, channels_last: bool) -> Result<Tensor> {
        let x = if channels_last {
            x.clone()
        } else {
            x.permute((0, 2, 3, 1))?
        };
        let x = if self.pre_norm {
            self.norm.forward(&x)?
        } else {
            x
        };
        let x = self.conv.forward(&x)?.to_dtype(self.dtype)?;
        if self.pre_norm {
            Ok(x)
        } else {
            Ok(self.norm.forward(&x)?)
        }
    }

    fn quantize(&self, q: &Quantizer) -> Result<Self> {
        Ok(Self {
            conv: self.conv.quantize(q, "conv")?,
            ..self.clone()
        })
    }

    fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        use vl_attn::named::join;
        self.conv.named_tensors(&join(prefix, "conv"), out)?;
        self.norm.named_tensors(&join(prefix, "norm"), out);
        Ok(())
    }
}

/// Which attention a half-block runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mixer {
    /// Window attention with this many heads over `window²` windows.
    Window { heads: usize, window: usize },
    /// Channel attention in this many groups.
    Channel { groups: usize },
}

/// One half of a DaViT block: spatial (window attention) or channel.
#[derive(Debug, Clone)]
struct HalfBlock {
    conv1: DepthwiseConv,
    norm1: LayerNorm,
    qkv: Proj,
    proj: Proj,
    conv2: DepthwiseConv,
    norm2: LayerNorm,
    ffn: FeedForward,
    mixer: Mixer,
    /// `spatial_block` / `channel_block`, and the attention's name.
    names: (&'static str, &'static str),
}

impl HalfBlock {
    fn load(vb: VarBuilder, cfg: &DavitConfig, s: usize, mixer: Mixer) -> Result<Self> {
        let dim = cfg.embed_dim[s];
        let attn = match mixer {
            Mixer::Window { .. } => "window_attn",
            Mixer::Channel { .. } => "channel_attn",
        };
        let a = vb.pp(attn);
        let f = vb.pp("ffn");
        let hidden = cfg.mlp_width(s);
        Ok(Self {
            conv1: DepthwiseConv::load(vb.pp("conv1"), dim, 3, true)?,
            norm1: norm(vb.pp("norm1"), dim)?,
            qkv: linear(a.pp("qkv"), dim, 3 * dim, cfg.qkv_bias)?,
            proj: linear(a.pp("proj"), dim, dim, true)?,
            conv2: DepthwiseConv::load(vb.pp("conv2"), dim, 3, true)?,
            norm2: norm(vb.pp("norm2"), dim)?,
            ffn: FeedForward::from_parts(
                linear(f.pp("fc1"), dim, hidden, true)?,
                linear(f.pp("fc2"), hidden, dim, true)?,
                cfg.activation_function,
            ),
            mixer,
            names: (
                match mixer {
                    Mixer::Window { .. } => "spatial_block",
                    Mixer::Channel { .. } => "channel_block",
                },
                attn,
            ),
        })
    }

    /// `x: (batch, h, w, c)` → the same shape.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let x = self.conv1.forward(x)?;
        let normed = self.norm1.forward(&x)?;
        // Each residual added as the projection closing its branch stores
        // (where vl's kernels can: `Proj::forward_add`).
        let x = match self.mixer {
            Mixer::Window { heads, window } => self.window_attention(&normed, heads, window, &x)?,
            Mixer::Channel { groups } => self.channel_attention(
                &normed.reshape((b, h * w, c))?,
                groups,
                &x.reshape((b, h * w, c))?,
            )?,
        };
        let x = self.conv2.forward(&x.reshape((b, h, w, c))?)?;
        Ok(self.ffn.forward_add(&self.norm2.forward(&x)?, &x)?)
    }

    /// `residual` plus window attention of the normalised map `(b, h, w,
    /// c)`, projected → `(b, h, w, c)`. The projections run on the map in
    /// its own order (they see one token at a time); only the heads are
    /// gathered into windows, and the output scattered back
    /// ([`WindowOrder`]).
    fn window_attention(
        &self,
        x: &Tensor,
        heads: usize,
        ws: usize,
        residual: &Tensor,
    ) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let (ph, pw) = ((ws - h % ws) % ws, (ws - w % ws) % ws);
        if ph + pw > 0 {
            return Ok(add(residual, &self.padded_window_attention(x, heads, ws)?)?);
        }
        let order = WindowOrder::new(h, w, ws, 0)?;
        let hd = c / heads;
        // vl's tiles store the projection straight into the heads.
        let [q, k, v] = match order.project_heads(&self.qkv, x, heads, hd)? {
            Some(qkv) => qkv,
            None => {
                let qkv = self.qkv.forward(x)?;
                [
                    order.split_heads(&qkv, 0, heads, hd)?,
                    order.split_heads(&qkv, c, heads, hd)?,
                    order.split_heads(&qkv, 2 * c, heads, hd)?,
                ]
            }
        };
        let scale = (hd as f64).powf(-0.5);
        let out = attention(&q, &k, &v, None, scale, Backend::Auto, Weights::Skip)?.output;
        debug_assert_eq!(out.dims()[0], b * order.windows());
        let merged = order.merge_heads(&out)?;
        Ok(self
            .proj
            .forward_add(&merged, &residual.reshape(merged.dims())?)?)
    }

    /// [`HalfBlock::window_attention`] of a map that is not whole windows:
    /// padded with zeros after the norm, as transformers does, so that the
    /// padding's tokens are the projections' biases.
    fn padded_window_attention(&self, x: &Tensor, heads: usize, ws: usize) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let (ph, pw) = ((ws - h % ws) % ws, (ws - w % ws) % ws);
        let x = x.pad_with_zeros(1, 0, ph)?.pad_with_zeros(2, 0, pw)?;
        let (hp, wp) = (h + ph, w + pw);
        let (nh, nw) = (hp / ws, wp / ws);
        // (b, nh, ws, nw, ws, c) -> (b * nh * nw, ws², c)
        let windows = x
            .reshape((b, nh, ws, nw, ws, c))?
            .permute((0, 1, 3, 2, 4, 5))?
            .contiguous()?
            .reshape((b * nh * nw, ws * ws, c))?;
        let n = b * nh * nw;
        let t = ws * ws;
        let hd = c / heads;
        // (n, t, 3, heads, hd) -> 3 × (n, heads, t, hd)
        let qkv = self
            .qkv
            .forward(&windows)?
            .reshape((n, t, 3, heads, hd))?
            .permute((2, 0, 3, 1, 4))?;
        let (q, k, v) = (
            qkv.get(0)?.contiguous()?,
            qkv.get(1)?.contiguous()?,
            qkv.get(2)?.contiguous()?,
        );
        let scale = (hd as f64).powf(-0.5);
        let out = attention(&q, &k, &v, None, scale, Backend::Auto, Weights::Skip)?.output;
        // (n, heads, t, hd) -> (n, t, c)
        let out = out.transpose(1, 2)?.contiguous()?.reshape((n, t, c))?;
        let out = self.proj.forward(&out)?;
        // back to the padded map, then cut the padding
        let map = out
            .reshape((b, nh, nw, ws, ws, c))?
            .permute((0, 1, 3, 2, 4, 5))?
            .contiguous()?
            .reshape((b, hp, wp, c))?;
        Ok(map.narrow(1, 0, h)?.narrow(2, 0, w)?.contiguous()?)
    }

    /// `residual` plus channel attention of the normalised tokens `(b, n,
    /// c)`, projected → `(b, n, c)`.
    fn channel_attention(&self, x: &Tensor, groups: usize, residual: &Tensor) -> Result<Tensor> {
        if x.dtype() == DType::F32 && x.device().is_cpu() {
            return self.channel_attention_strided(x, groups, residual);
        }
        let (b, n, c) = x.dims3()?;
        let d = c / groups;
        // (b, n, 3, groups, d) -> 3 × (b, groups, d, n)
        let qkv = self
            .qkv
            .forward(x)?
            .reshape((b, n, 3, groups, d))?
            .permute((2, 0, 3, 4, 1))?;
        let (q, k, v) = (
            qkv.get(0)?.contiguous()?,
            qkv.get(1)?.contiguous()?,
            qkv.get(2)?.contiguous()?,
        );
        // The channels of a group attend to each other: "heads" are the
        // groups, the "sequence" the group's d channels, the "head width"
        // the n tokens.
        let scale = (n as f64).powf(-0.5);
        let out = attention(&q, &k, &v, None, scale, Backend::Auto, Weights::Skip)?.output;
        // (b, groups, d, n) -> (b, n, groups, d) -> (b, n, c)
        let out = out
            .permute((0, 3, 1, 2))?
            .contiguous()?
            .reshape((b, n, c))?;
        Ok(self.proj.forward_add(&out, residual)?)
    }

    /// [`HalfBlock::channel_attention`] in f32 without transposing the
    /// tokens: per image, the `(d, d)` scores of each group are `qᵀ k`
    /// and its output `v attnᵀ`, products that read `q`, `k`, `v` in place
    /// in the `qkv` projection's output (row stride `3c`), where moving
    /// the tokens last would copy them element by element.
    fn channel_attention_strided(
        &self,
        x: &Tensor,
        groups: usize,
        residual: &Tensor,
    ) -> Result<Tensor> {
        let (b, n, c) = x.dims3()?;
        let d = c / groups;
        let scale = (n as f64).powf(-0.5);
        // (b, n, 3, groups, d): a view of the projection's output.
        let qkv = self.qkv.forward(x)?.reshape((b, n, 3, groups, d))?;
        // One task per image and group: each product is a d × d matrix
        // over n tokens, which candle's GEMM runs on one thread (the
        // batched form ran every group on one core).
        let outs = (0..b * groups)
            .into_par_iter()
            .map(|ig| -> candle_core::Result<Tensor> {
                let (i, g) = (ig / groups, ig % groups);
                // (n, d) views, row stride 3c.
                let part = |p: usize| {
                    qkv.get(i)?
                        .narrow(1, p, 1)?
                        .narrow(2, g, 1)?
                        .squeeze(2)?
                        .squeeze(1)
                };
                let (q, k, v) = (part(0)?, part(1)?, part(2)?);
                // (d, n) · (n, d) -> (d, d)
                let scores = (q.t()?.matmul(&k)? * scale)?;
                let attn = candle_nn::ops::softmax_last_dim(&scores)?;
                // (n, d) · (d, d)ᵀ -> (n, d)
                v.matmul(&attn.t()?)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        // (b · groups) × (n, d) -> (b, n, groups · d)
        let out = Tensor::stack(&outs, 0)?
            .reshape((b, groups, n, d))?
            .transpose(1, 2)?
            .reshape((b, n, c))?;
        Ok(self.proj.forward_add(&out, residual)?)
    }

    fn quantize(&self, q: &Quantizer, prefix: &str) -> Result<Self> {
        let (half, attn) = self.names;
        let qa = q.within(&format!("{prefix}.{half}.{attn}"));
        Ok(Self {
            qkv: qa.proj("qkv", &self.qkv)?,
            proj: qa.proj("proj", &self.proj)?,
            // Named fc1/fc2 as DaViT's tensors are (the names a saved
            // model's stored blocks are found by).
            ffn: {
                let qf = q.within(&format!("{prefix}.{half}.ffn"));
                let (fc1, fc2) = self.ffn.parts();
                FeedForward::from_parts(
                    qf.proj("fc1", fc1)?,
                    qf.proj("fc2", fc2)?,
                    self.ffn.activation(),
                )
            },
            ..self.clone()
        })
    }

    fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        use vl_attn::named::join;
        let (half, attn) = self.names;
        let p = join(prefix, half);
        self.conv1.named_tensors(&join(&p, "conv1"), out);
        self.norm1.named_tensors(&join(&p, "norm1"), out);
        self.qkv
            .named_tensors(&join(&p, &format!("{attn}.qkv")), out)?;
        self.proj
            .named_tensors(&join(&p, &format!("{attn}.proj")), out)?;
        self.conv2.named_tensors(&join(&p, "conv2"), out);
        self.norm2.named_tensors(&join(&p, "norm2"), out);
        // DaViT's names for the MLP, which load reads.
        let (fc1, fc2) = self.ffn.parts();
        fc1.named_tensors(&join(&p, "ffn.fc1"), out)?;
        fc2.named_tensors(&join(&p, "ffn.fc2"), out)?;
        Ok(())
    }
}

/// DaViT: the stages' patch embeddings and blocks (transformers'
/// `Florence2VisionBackbone`, its tensors named as there).
#[derive(Debug, Clone)]
pub struct Davit {
    convs: Vec<ConvEmbed>,
    /// Per stage, per block: (spatial, channel).
    blocks: Vec<Vec<(HalfBlock, HalfBlock)>>,
    cfg: DavitConfig,
}

impl Davit {
    /// Loads the tower's tensors under `vb` (`convs.{s}.…`,
    /// `blocks.{s}.{i}.spatial_block.…`, `….channel_block.…`).
    ///
    /// # Errors
    /// [`crate::VisionError::Config`] for an impossible config; a missing
    /// tensor or one of another shape, named.
    pub fn load(vb: VarBuilder, cfg: &DavitConfig) -> Result<Self> {
        cfg.validate()?;
        let convs = (0..cfg.num_stages())
            .map(|s| ConvEmbed::load(vb.pp("convs").pp(s), cfg, s))
            .collect::<Result<Vec<_>>>()?;
        let blocks = (0..cfg.num_stages())
            .map(|s| {
                (0..cfg.depths[s])
                    .map(|i| {
                        let b = vb.pp("blocks").pp(s).pp(i);
                        Ok((
                            HalfBlock::load(
                                b.pp("spatial_block"),
                                cfg,
                                s,
                                Mixer::Window {
                                    heads: cfg.num_heads[s],
                                    window: cfg.window_size,
                                },
                            )?,
                            HalfBlock::load(
                                b.pp("channel_block"),
                                cfg,
                                s,
                                Mixer::Channel {
                                    groups: cfg.num_groups[s],
                                },
                            )?,
                        ))
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            convs,
            blocks,
            cfg: cfg.clone(),
        })
    }

    /// Its configuration.
    pub fn config(&self) -> &DavitConfig {
        &self.cfg
    }

    /// The last stage's map of normalised pixels.
    ///
    /// # Shapes
    /// `pixels: (batch, 3, size, size)` → `(batch, h, w, embed_dim[-1])`,
    /// channels-last.
    pub fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        let mut x = pixels.to_dtype(self.convs[0].dtype)?;
        for (s, (conv, blocks)) in self.convs.iter().zip(&self.blocks).enumerate() {
            x = conv.forward(&x, s > 0)?;
            for (spatial, channel) in blocks {
                x = spatial.forward(&x)?;
                x = channel.forward(&x)?;
            }
        }
        Ok(x)
    }

    fn quantize(&self, q: &Quantizer) -> Result<Self> {
        let blocks = self
            .blocks
            .iter()
            .enumerate()
            .map(|(s, stage)| {
                stage
                    .iter()
                    .enumerate()
                    .map(|(i, (a, b))| {
                        let p = format!("blocks.{s}.{i}");
                        Ok((a.quantize(q, &p)?, b.quantize(q, &p)?))
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let convs = self
            .convs
            .iter()
            .enumerate()
            .map(|(s, c)| c.quantize(&q.within(&format!("convs.{s}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            convs,
            blocks,
            ..self.clone()
        })
    }

    fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        use vl_attn::named::join;
        for (s, conv) in self.convs.iter().enumerate() {
            conv.named_tensors(&join(prefix, &format!("convs.{s}")), out)?;
        }
        for (s, stage) in self.blocks.iter().enumerate() {
            for (i, (a, b)) in stage.iter().enumerate() {
                let p = join(prefix, &format!("blocks.{s}.{i}"));
                a.named_tensors(&p, out)?;
                b.named_tensors(&p, out)?;
            }
        }
        Ok(())
    }
}

/// The last map → image tokens (transformers' `Florence2MultiModalProjector`).
#[derive(Debug, Clone)]
pub struct Florence2Projector {
    image_projection: Proj,
    image_proj_norm: LayerNorm,
    row_embeddings: Embedding,
    column_embeddings: Embedding,
    /// The cosine temporal embedding of frame 0: `[0, 1, 0, 1, …]`.
    temporal: Tensor,
}

impl Florence2Projector {
    /// Loads `image_projection.weight (projection_dim, width)` (no bias),
    /// `image_proj_norm`, `image_position_embed.{row,column}_embeddings`
    /// under `vb`.
    ///
    /// # Errors
    /// A missing tensor or one of another shape, named.
    pub fn load(vb: VarBuilder, cfg: &DavitConfig) -> Result<Self> {
        let width = *cfg.embed_dim.last().unwrap_or(&0);
        let projection = vb
            .pp("image_projection")
            .get((cfg.projection_dim, width), "weight")?;
        Self::from_parts(
            projection,
            norm(vb.pp("image_proj_norm"), cfg.projection_dim)?,
            &vb.pp("image_position_embed"),
            cfg,
        )
    }

    /// Builds from the projection weight `(projection_dim, width)`, its
    /// norm, and the position tables `row_embeddings.weight`,
    /// `column_embeddings.weight` under `positions` (checkpoint
    /// converters: microsoft's layout stores the projection transposed).
    ///
    /// # Errors
    /// A missing table or one of another shape, named; a projection of
    /// another shape.
    pub fn from_parts(
        projection: Tensor,
        image_proj_norm: LayerNorm,
        positions: &VarBuilder,
        cfg: &DavitConfig,
    ) -> Result<Self> {
        let width = *cfg.embed_dim.last().unwrap_or(&0);
        if projection.dims() != [cfg.projection_dim, width] {
            return config_err(
                "projection_dim",
                format!(
                    "the projection is {:?}, expected [{}, {width}]",
                    projection.dims(),
                    cfg.projection_dim
                ),
            );
        }
        let rows = width / 2;
        let temporal: Vec<f32> = (0..width).map(|i| (i % 2) as f32).collect();
        Ok(Self {
            image_projection: Proj::from(Linear::new(projection, None)),
            image_proj_norm,
            row_embeddings: Embedding::new(
                positions
                    .pp("row_embeddings")
                    .get((cfg.max_position_embeddings, rows), "weight")?,
                rows,
            ),
            column_embeddings: Embedding::new(
                positions
                    .pp("column_embeddings")
                    .get((cfg.max_position_embeddings, width - rows), "weight")?,
                width - rows,
            ),
            temporal: Tensor::from_vec(temporal, width, positions.device())?
                .to_dtype(positions.dtype())?,
        })
    }

    /// Loads a LayerNorm of DaViT's epsilon under `vb` (`weight`, `bias`).
    ///
    /// # Errors
    /// A missing tensor or one of another shape, named.
    pub fn load_norm(vb: VarBuilder, width: usize) -> Result<LayerNorm> {
        norm(vb, width)
    }

    /// Image tokens of the last map.
    ///
    /// # Shapes
    /// `map: (batch, h, w, width)` → `(batch, 1 + h·w, projection_dim)`.
    pub fn forward(&self, map: &Tensor) -> Result<Tensor> {
        let (b, h, w, c) = map.dims4()?;
        let dev = map.device();
        let cols = self
            .column_embeddings
            .forward(&Tensor::arange(0u32, w as u32, dev)?)?;
        let rows = self
            .row_embeddings
            .forward(&Tensor::arange(0u32, h as u32, dev)?)?;
        // pos[y][x] = [cols[x]; rows[y]]
        let (cc, rc) = (cols.dim(1)?, rows.dim(1)?);
        let pos = Tensor::cat(
            &[
                cols.unsqueeze(0)?.broadcast_as((h, w, cc))?,
                rows.unsqueeze(1)?.broadcast_as((h, w, rc))?,
            ],
            2,
        )?
        .to_dtype(map.dtype())?;
        let tokens = map
            .broadcast_add(&pos.unsqueeze(0)?)?
            .reshape((b, h * w, c))?
            .broadcast_add(&self.temporal.to_dtype(map.dtype())?)?;
        let pooled = tokens.mean_keepdim(1)?;
        let all = Tensor::cat(&[pooled, tokens], 1)?;
        let projected = self.image_projection.forward(&all)?;
        Ok(self.image_proj_norm.forward(&projected)?)
    }

    fn quantize(&self, q: &Quantizer) -> Result<Self> {
        Ok(Self {
            image_projection: q.proj("image_projection", &self.image_projection)?,
            ..self.clone()
        })
    }

    fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        use vl_attn::named::join;
        self.image_projection
            .named_tensors(&join(prefix, "image_projection"), out)?;
        self.image_proj_norm
            .named_tensors(&join(prefix, "image_proj_norm"), out);
        out.insert(
            join(prefix, "image_position_embed.row_embeddings.weight"),
            self.row_embeddings.embeddings().clone(),
        );
        out.insert(
            join(prefix, "image_position_embed.column_embeddings.weight"),
            self.column_embeddings.embeddings().clone(),
        );
        Ok(())
    }
}

/// Florence-2's vision side: [`Davit`], then [`Florence2Projector`].
#[derive(Debug, Clone)]
pub struct Florence2Vision {
    /// The tower.
    pub backbone: Davit,
    /// The projector.
    pub projector: Florence2Projector,
}

impl Florence2Vision {
    /// Loads the tower under `backbone` and the projector under
    /// `projector`.
    ///
    /// # Errors
    /// As [`Davit::load`] and [`Florence2Projector::load`].
    pub fn load(backbone: VarBuilder, projector: VarBuilder, cfg: &DavitConfig) -> Result<Self> {
        Ok(Self {
            backbone: Davit::load(backbone, cfg)?,
            projector: Florence2Projector::load(projector, cfg)?,
        })
    }

    /// Its configuration.
    pub fn config(&self) -> &DavitConfig {
        self.backbone.config()
    }

    /// Image tokens of normalised pixels.
    ///
    /// # Shapes
    /// `pixels: (batch, 3, size, size)` → `(batch, 1 + h·w,
    /// projection_dim)`.
    pub fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        vl_attn::kernels::on_pool(|| self.projector.forward(&self.backbone.forward(pixels)?))
    }

    /// A copy with the attention, MLP and projection layers converted by
    /// `q` (named `backbone.blocks.{s}.{i}.…` and `projector.…`).
    ///
    /// # Errors
    /// As [`Quantizer::proj`].
    pub fn quantize(&self, q: &Quantizer) -> Result<Self> {
        Ok(Self {
            backbone: self.backbone.quantize(&q.within("backbone"))?,
            projector: self.projector.quantize(&q.within("projector"))?,
        })
    }

    /// The format of the converted layers, if any.
    pub fn quantization(&self) -> Option<GgmlDType> {
        self.projector.image_projection.quantization()
    }

    /// Adds the tensors under `prefix` (`backbone.…` as transformers'
    /// `vision_tower.…`, `projector.…` as its `multi_modal_projector.…`).
    ///
    /// # Errors
    /// candle's, dequantizing a converted layer.
    pub fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        use vl_attn::named::join;
        self.backbone
            .named_tensors(&join(prefix, "backbone"), out)?;
        self.projector
            .named_tensors(&join(prefix, "projector"), out)
    }

    /// The dtype of its activations.
    pub fn dtype(&self) -> DType {
        self.projector.temporal.dtype()
    }
}

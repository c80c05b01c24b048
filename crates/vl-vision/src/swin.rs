//! Swin, the vision encoder of Donut and Nougat (transformers'
//! `DonutSwinModel`: no final LayerNorm, no absolute position embeddings).
//!
//! A convolutional patch embedding (the pixels zero-padded right and bottom
//! to whole patches) with its LayerNorm, then stages of blocks; between
//! stages a patch merging (2×2 neighbours concatenated, normalised and
//! reduced to twice the width, the map zero-padded to even sides first).
//! Each block:
//!
//! - `x += attn(norm1(x))`: multi-head self-attention inside non-overlapping
//!   `window²` windows, the normalised map zero-padded right and bottom to
//!   whole windows (the padding taking part as keys, as transformers does),
//!   each head's scores plus its relative position bias (a learned table of
//!   `(2·window − 1)²` entries indexed by the query–key offset); every other
//!   block first rolls the map by `window / 2` up and left (shifted
//!   windows), adds −100 (not −∞, as transformers) between tokens from
//!   different regions of the rolled map, and rolls the output back;
//! - `x += mlp(norm2(x))`.
//!
//! Where a stage's map is no larger than the window, its blocks take the
//! whole map as one window and do not shift. The map is held channels-last
//! `(batch, height, width, channels)` throughout; the output is the last
//! stage's tokens, row by row.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Linear, VarBuilder};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

use vl_attn::{Activation, FeedForward, LayerNorm, PatchConv, Proj, Quantizer, WindowOrder};

use crate::error::{config_err, Result};
use crate::preprocess::{DocumentFit, PixelSpec, Resample};

/// transformers' `DonutSwinConfig.layer_norm_eps` default.
pub const SWIN_LAYER_NORM_EPS: f64 = 1e-5;

fn default_three() -> usize {
    3
}
fn default_four() -> usize {
    4
}
fn default_mlp_ratio() -> f64 {
    4.0
}
fn default_true() -> bool {
    true
}
fn default_eps() -> f64 {
    SWIN_LAYER_NORM_EPS
}
fn half3() -> [f32; 3] {
    [0.5; 3]
}
fn default_rescale() -> f32 {
    1.0 / 255.0
}

/// An image size as transformers' configs give it: one side, or
/// `[height, width]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ImageSize {
    /// A square.
    Square(usize),
    /// `[height, width]`.
    HeightWidth([usize; 2]),
}

impl ImageSize {
    /// `(height, width)`.
    pub fn height_width(self) -> (usize, usize) {
        match self {
            Self::Square(s) => (s, s),
            Self::HeightWidth([h, w]) => (h, w),
        }
    }
}

/// Swin's sizes (transformers' `DonutSwinConfig`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwinConfig {
    /// Input size, in pixels.
    pub image_size: ImageSize,
    /// Patch side, in pixels (default 4).
    #[serde(default = "default_four")]
    pub patch_size: usize,
    /// Input channels (default 3).
    #[serde(default = "default_three")]
    pub num_channels: usize,
    /// The first stage's width; each stage doubles it.
    pub embed_dim: usize,
    /// Blocks per stage.
    pub depths: Vec<usize>,
    /// Attention heads per stage.
    pub num_heads: Vec<usize>,
    /// Window side, in tokens.
    pub window_size: usize,
    /// The MLP's width over the channels (default 4).
    #[serde(default = "default_mlp_ratio")]
    pub mlp_ratio: f64,
    /// Whether the query, key and value projections have biases (default
    /// true).
    #[serde(default = "default_true")]
    pub qkv_bias: bool,
    /// The MLP's activation (default `gelu`, the erf form).
    #[serde(default)]
    pub hidden_act: Activation,
    /// The LayerNorms' epsilon (default 1e-5).
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// Absolute position embeddings; vl takes only `false` (Donut's and
    /// Nougat's).
    #[serde(default)]
    pub use_absolute_embeddings: bool,
    /// The width of the tokens handed to the decoder when it differs from
    /// the last stage's (transformers' `enc_to_dec_proj`); `None`: the last
    /// stage's width.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_size: Option<usize>,
    /// The preprocessor's per-channel mean (default 0.5, Donut's).
    #[serde(default = "half3")]
    pub image_mean: [f32; 3],
    /// The preprocessor's per-channel std (default 0.5).
    #[serde(default = "half3")]
    pub image_std: [f32; 3],
    /// Pixel values are multiplied by this first (default 1/255).
    #[serde(default = "default_rescale")]
    pub rescale_factor: f32,
    /// The resize filter (default bilinear, Donut's and Nougat's).
    #[serde(default)]
    pub resample: Resample,
    /// Whether images are resized (default true).
    #[serde(default = "default_true")]
    pub do_resize: bool,
    /// The document processor's steps (Donut's and Nougat's); `None`:
    /// images are stretched to `image_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub document: Option<DocumentFit>,
}

impl SwinConfig {
    /// Stages.
    pub fn num_stages(&self) -> usize {
        self.depths.len()
    }

    /// Stage `s`'s width: `embed_dim · 2ˢ`.
    pub fn stage_dim(&self, s: usize) -> usize {
        self.embed_dim << s
    }

    /// Width of the last stage's tokens.
    pub fn hidden_size(&self) -> usize {
        self.stage_dim(self.num_stages().saturating_sub(1))
    }

    /// Width of the tokens the encoder hands on: `output_size`, else the
    /// last stage's.
    pub fn output_width(&self) -> usize {
        self.output_size.unwrap_or_else(|| self.hidden_size())
    }

    /// What the encoder expects of its pixels.
    pub fn pixel_spec(&self) -> PixelSpec {
        let (height, width) = self.image_size.height_width();
        PixelSpec {
            height,
            width,
            mean: self.image_mean,
            std: self.image_std,
            rescale_factor: self.rescale_factor,
            resample: self.resample,
            resize: self.do_resize,
            document: self.document,
        }
    }

    /// Each stage's map `(height, width)` in tokens, for an input of
    /// `height × width` pixels.
    pub fn stage_sides(&self, height: usize, width: usize) -> Vec<(usize, usize)> {
        let p = self.patch_size.max(1);
        let (mut h, mut w) = (height.div_ceil(p), width.div_ceil(p));
        (0..self.num_stages())
            .map(|s| {
                if s > 0 {
                    (h, w) = (h.div_ceil(2), w.div_ceil(2));
                }
                (h, w)
            })
            .collect()
    }

    /// Output tokens per image at the configured size.
    pub fn num_tokens(&self) -> usize {
        let (h, w) = self.image_size.height_width();
        self.stage_sides(h, w).last().map_or(0, |(h, w)| h * w)
    }

    /// The MLP's hidden width in stage `s` (`int(dim · mlp_ratio)`).
    pub fn mlp_width(&self, s: usize) -> usize {
        (self.stage_dim(s) as f64 * self.mlp_ratio) as usize
    }

    /// Rejects impossible sizes, naming the field.
    pub fn validate(&self) -> Result<()> {
        let n = self.num_stages();
        if n == 0 {
            return config_err("depths", "no stage");
        }
        if self.num_heads.len() != n {
            return config_err(
                "num_heads",
                format!(
                    "has {} entries, depths has {n} stages",
                    self.num_heads.len()
                ),
            );
        }
        if self.use_absolute_embeddings {
            return config_err(
                "use_absolute_embeddings",
                "true is not supported (Donut's and Nougat's encoders have none)",
            );
        }
        if self.num_channels != 3 {
            return config_err(
                "num_channels",
                format!("images have 3 channels, got {}", self.num_channels),
            );
        }
        if self.patch_size == 0 || self.window_size == 0 || self.embed_dim == 0 {
            return config_err(
                "patch_size",
                format!(
                    "patch_size {}, window_size {} and embed_dim {} must be at least 1",
                    self.patch_size, self.window_size, self.embed_dim
                ),
            );
        }
        if let Some(v) = self
            .image_std
            .iter()
            .find(|v| !(v.is_finite() && **v > 0.0))
        {
            return config_err("image_std", format!("must be positive, got {v}"));
        }
        if self.output_size == Some(0) {
            return config_err("output_size", "must be at least 1");
        }
        if !(self.mlp_ratio > 0.0 && self.mlp_ratio.is_finite()) {
            return config_err("mlp_ratio", format!("{} is not positive", self.mlp_ratio));
        }
        let (h, w) = self.image_size.height_width();
        if h == 0 || w == 0 || h > crate::preprocess::MAX_IMAGE_SIDE as usize {
            return config_err("image_size", format!("{h}x{w}"));
        }
        for (s, (sh, sw)) in self.stage_sides(h, w).into_iter().enumerate() {
            let (dim, heads) = (self.stage_dim(s), self.num_heads[s]);
            if heads == 0 || !dim.is_multiple_of(heads) {
                return config_err(
                    "num_heads",
                    format!("stage {s}: {heads} heads do not divide its width {dim}"),
                );
            }
            // A map smaller than the window: transformers' layer takes the
            // map as its window, but its bias table keeps the configured
            // window's size and the shapes no longer match.
            if sh.min(sw) < self.window_size {
                return config_err(
                    "window_size",
                    format!(
                        "stage {s}'s map is {sh}x{sw} tokens, smaller than the {} window \
                         (transformers cannot run such a model either)",
                        self.window_size
                    ),
                );
            }
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

fn norm(vb: VarBuilder, width: usize, eps: f64) -> Result<LayerNorm> {
    Ok(LayerNorm::new(
        vb.get(width, "weight")?,
        vb.get(width, "bias")?,
        eps,
    ))
}

/// The relative position index of a `window²` window: for query `i` and
/// key `j`, the table row of their offset.
fn relative_position_index(window: usize) -> Vec<u32> {
    let t = window * window;
    let mut index = Vec::with_capacity(t * t);
    for i in 0..t {
        let (yi, xi) = ((i / window) as isize, (i % window) as isize);
        for j in 0..t {
            let (yj, xj) = ((j / window) as isize, (j % window) as isize);
            let dy = (yi - yj + window as isize - 1) as usize;
            let dx = (xi - xj + window as isize - 1) as usize;
            index.push((dy * (2 * window - 1) + dx) as u32);
        }
    }
    index
}

/// The shifted windows' additive mask for a padded `hp × wp` map:
/// `(windows, window², window²)`, 0 within a region of the rolled map and
/// −100 across regions (symmetric in query and key).
fn shift_mask(
    hp: usize,
    wp: usize,
    window: usize,
    shift: usize,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let region =
        |i: usize, n: usize| -> u8 { u8::from(i >= n - window) + u8::from(i >= n - shift) };
    let (nh, nw) = (hp / window, wp / window);
    let t = window * window;
    let mut mask = Vec::with_capacity(nh * nw * t * t);
    for wy in 0..nh {
        for wx in 0..nw {
            let ids: Vec<u8> = (0..t)
                .map(|k| {
                    let (y, x) = (wy * window + k / window, wx * window + k % window);
                    region(y, hp) * 3 + region(x, wp)
                })
                .collect();
            for a in &ids {
                for b in &ids {
                    mask.push(if a == b { 0f32 } else { -100f32 });
                }
            }
        }
    }
    Ok(Tensor::from_vec(mask, (nh * nw, t, t), device)?.to_dtype(dtype)?)
}

/// What a stage's blocks share, built once per stage and forward pass
/// (Donut's third stage has fourteen blocks): for each window layout
/// `(hp, wp, window, shift)` the stage uses (shift 0 and `window / 2`), the
/// token order of its windows and, shifted, its mask. A new map size (the
/// next stage) starts over.
#[derive(Default)]
struct StageCache {
    layouts: Vec<WindowLayout>,
}

/// One window layout of a [`StageCache`].
struct WindowLayout {
    key: (usize, usize, usize, usize),
    order: Arc<WindowOrder>,
    /// The shifted-window mask `(windows, 1, t, t)`, once asked for.
    mask: Option<Tensor>,
}

impl StageCache {
    /// The layout of `key`, built if new (dropping the last map's).
    fn layout(&mut self, key: (usize, usize, usize, usize)) -> Result<&mut WindowLayout> {
        if self
            .layouts
            .first()
            .is_some_and(|l| (l.key.0, l.key.1) != (key.0, key.1))
        {
            self.layouts.clear();
        }
        let at = match self.layouts.iter().position(|l| l.key == key) {
            Some(at) => at,
            None => {
                let (hp, wp, window, shift) = key;
                let order = Arc::new(WindowOrder::new(hp, wp, window, shift)?);
                self.layouts.push(WindowLayout {
                    key,
                    order,
                    mask: None,
                });
                self.layouts.len() - 1
            }
        };
        Ok(&mut self.layouts[at])
    }

    fn order(&mut self, key: (usize, usize, usize, usize)) -> Result<Arc<WindowOrder>> {
        Ok(self.layout(key)?.order.clone())
    }

    fn mask(
        &mut self,
        key: (usize, usize, usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let layout = self.layout(key)?;
        if let Some(mask) = &layout.mask {
            return Ok(mask.clone());
        }
        let (hp, wp, window, shift) = key;
        let mask = shift_mask(hp, wp, window, shift, dtype, device)?.unsqueeze(1)?;
        layout.mask = Some(mask.clone());
        Ok(mask)
    }
}

/// One Swin block.
#[derive(Debug, Clone)]
struct Block {
    norm1: LayerNorm,
    query: Proj,
    key: Proj,
    value: Proj,
    out: Proj,
    norm2: LayerNorm,
    ffn: FeedForward,
    heads: usize,
    window: usize,
    /// 0, or `window / 2` in odd blocks.
    shift: usize,
    /// `(heads, window², window²)`: each head's bias over key × query
    /// (key-major; see `load`).
    bias: Tensor,
    /// The stored table the bias is gathered from, `((2·window − 1)²,
    /// heads)`, kept for saving.
    table: Tensor,
}

impl Block {
    fn load(vb: VarBuilder, cfg: &SwinConfig, s: usize, i: usize) -> Result<Self> {
        let dim = cfg.stage_dim(s);
        let heads = cfg.num_heads[s];
        let window = cfg.window_size;
        let a = vb.pp("attention");
        let sa = a.pp("self");
        let table = sa.get(
            ((2 * window - 1) * (2 * window - 1), heads),
            "relative_position_bias_table",
        )?;
        let t = window * window;
        let index = Tensor::from_vec(relative_position_index(window), t * t, vb.device())?;
        // (t·t, heads) = (query, key, heads) -> (heads, key, query):
        // key-major, as the CPU's attention kernel reads a bias (it is
        // passed as the transposed view, and then not rearranged).
        let bias = table
            .index_select(&index, 0)?
            .reshape((t, t, heads))?
            .permute((2, 1, 0))?
            .contiguous()?;
        let hidden = cfg.mlp_width(s);
        let eps = cfg.layer_norm_eps;
        Ok(Self {
            norm1: norm(vb.pp("layernorm_before"), dim, eps)?,
            query: linear(sa.pp("query"), dim, dim, cfg.qkv_bias)?,
            key: linear(sa.pp("key"), dim, dim, cfg.qkv_bias)?,
            value: linear(sa.pp("value"), dim, dim, cfg.qkv_bias)?,
            out: linear(a.pp("output").pp("dense"), dim, dim, true)?,
            norm2: norm(vb.pp("layernorm_after"), dim, eps)?,
            ffn: FeedForward::from_parts(
                linear(vb.pp("intermediate").pp("dense"), dim, hidden, true)?,
                linear(vb.pp("output").pp("dense"), hidden, dim, true)?,
                cfg.hidden_act,
            ),
            heads,
            window,
            shift: if i % 2 == 1 { window / 2 } else { 0 },
            bias,
            table,
        })
    }

    fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        use vl_attn::named::join;
        let sa = join(prefix, "attention.self");
        self.norm1
            .named_tensors(&join(prefix, "layernorm_before"), out);
        out.insert(
            join(&sa, "relative_position_bias_table"),
            self.table.clone(),
        );
        self.query.named_tensors(&join(&sa, "query"), out)?;
        self.key.named_tensors(&join(&sa, "key"), out)?;
        self.value.named_tensors(&join(&sa, "value"), out)?;
        self.out
            .named_tensors(&join(prefix, "attention.output.dense"), out)?;
        self.norm2
            .named_tensors(&join(prefix, "layernorm_after"), out);
        let (fc1, fc2) = self.ffn.parts();
        fc1.named_tensors(&join(prefix, "intermediate.dense"), out)?;
        fc2.named_tensors(&join(prefix, "output.dense"), out)?;
        Ok(())
    }

    /// `x: (b, h, w, c)` → the same shape; a shifted block takes its mask
    /// from `masks`.
    fn forward(&self, x: &Tensor, cache: &mut StageCache) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        // A map no larger than the window is one window, unshifted
        // (validate keeps it from being smaller).
        let (ws, shift) = if h.min(w) <= self.window {
            (h.min(w), 0)
        } else {
            (self.window, self.shift)
        };
        let normed = self.norm1.forward(x)?;
        let (ph, pw) = ((ws - h % ws) % ws, (ws - w % ws) % ws);
        let padded = if ph + pw > 0 {
            normed.pad_with_zeros(1, 0, ph)?.pad_with_zeros(2, 0, pw)?
        } else {
            normed
        };
        let (hp, wp) = (h + ph, w + pw);
        let (nh, nw) = (hp / ws, wp / ws);
        let n = b * nh * nw;
        let order = cache.order((hp, wp, ws, shift))?;
        let hd = c / self.heads;
        // The projections on the (padded) map in its own order — the
        // padding's tokens are their biases, as transformers' are — and
        // the heads gathered into the rolled windows.
        let split = |p: &Proj| -> Result<Tensor> {
            Ok(order.split_heads(&p.forward(&padded)?, 0, self.heads, hd)?)
        };
        let (q, k, v) = (split(&self.query)?, split(&self.key)?, split(&self.value)?);
        let scale = 1.0 / (hd as f64).sqrt();
        // Each head's relative position bias `(1, heads, t, t)`, and for
        // shifted windows each window's mask `(nh · nw, 1, t, t)` (window
        // `w` of image `i` is sample `i · nh · nw + w`): added to the
        // scores tile by tile on the CPU.
        // Both passed as transposed views of key-major tensors (the mask
        // is symmetric: its own key-major form).
        let bias = self.bias.unsqueeze(0)?.transpose(2, 3)?;
        let mask = if shift > 0 {
            Some(
                cache
                    .mask((hp, wp, ws, shift), q.dtype(), q.device())?
                    .transpose(2, 3)?,
            )
        } else {
            None
        };
        let biases: Vec<&Tensor> = std::iter::once(&bias).chain(mask.as_ref()).collect();
        let ctx = vl_attn::attention::attention_with_bias(
            &q,
            &k,
            &v,
            &biases,
            scale,
            vl_attn::Backend::Auto,
        )?;
        // (n, heads, t, hd) -> the (padded) map, then the projection.
        debug_assert_eq!(ctx.dim(0)?, n);
        let map = self.out.forward(&order.merge_heads(&ctx)?)?;
        let map = if ph + pw > 0 {
            map.narrow(1, 0, h)?.narrow(2, 0, w)?
        } else {
            map
        };
        let x = (x + map)?;
        let x = (&x + self.ffn.forward(&self.norm2.forward(&x)?)?)?;
        Ok(x)
    }

    fn quantize(&self, q: &Quantizer, prefix: &str) -> Result<Self> {
        let qa = q.within(&format!("{prefix}.attention.self"));
        let (fc1, fc2) = self.ffn.parts();
        Ok(Self {
            query: qa.proj("query", &self.query)?,
            key: qa.proj("key", &self.key)?,
            value: qa.proj("value", &self.value)?,
            out: q
                .within(&format!("{prefix}.attention.output"))
                .proj("dense", &self.out)?,
            ffn: FeedForward::from_parts(
                q.within(&format!("{prefix}.intermediate"))
                    .proj("dense", fc1)?,
                q.within(&format!("{prefix}.output")).proj("dense", fc2)?,
                self.ffn.activation(),
            ),
            ..self.clone()
        })
    }
}

/// Patch merging between stages: `(b, h, w, c)` → `(b, ⌈h/2⌉, ⌈w/2⌉, 2c)`.
#[derive(Debug, Clone)]
struct Merge {
    norm: LayerNorm,
    reduction: Proj,
}

impl Merge {
    fn load(vb: VarBuilder, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            norm: norm(vb.pp("norm"), 4 * dim, eps)?,
            reduction: linear(vb.pp("reduction"), 4 * dim, 2 * dim, false)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let x = x.pad_with_zeros(1, 0, h % 2)?.pad_with_zeros(2, 0, w % 2)?;
        let (h2, w2) = (h.div_ceil(2), w.div_ceil(2));
        let grid = x.reshape((b, h2, 2, w2, 2, c))?;
        // transformers' order: for col in 0..2, for row in 0..2.
        let mut parts = Vec::with_capacity(4);
        for col in 0..2 {
            for row in 0..2 {
                parts.push(
                    grid.narrow(2, row, 1)?
                        .narrow(4, col, 1)?
                        .reshape((b, h2, w2, c))?,
                );
            }
        }
        let x = Tensor::cat(&parts, 3)?;
        Ok(self.reduction.forward(&self.norm.forward(&x)?)?)
    }
}

/// Swin (transformers' `DonutSwinModel` without its pooler).
#[derive(Debug, Clone)]
pub struct Swin {
    /// The patch embedding (stride = kernel): on the CPU vl's patch
    /// gather and the layer's product ([`PatchConv`]).
    patch: PatchConv,
    embed_norm: LayerNorm,
    stages: Vec<(Vec<Block>, Option<Merge>)>,
    /// From the last stage's width to `output_size`.
    output_proj: Option<Proj>,
    cfg: SwinConfig,
    /// The activations' dtype.
    dtype: DType,
}

impl Swin {
    /// Loads the encoder's tensors under `vb` (`embeddings.…`,
    /// `encoder.layers.{s}.blocks.{i}.…`, `encoder.layers.{s}.downsample.…`).
    ///
    /// # Errors
    /// [`crate::VisionError::Config`] for an impossible config; a missing
    /// tensor or one of another shape, named.
    pub fn load(vb: VarBuilder, cfg: &SwinConfig) -> Result<Self> {
        Self::load_split(vb.clone(), vb.pp("output_proj"), cfg)
    }

    /// [`Swin::load`] with the output projection (when `output_size` asks
    /// for one) read under `projection` (transformers keeps it beside the
    /// encoder, as `enc_to_dec_proj`).
    ///
    /// # Errors
    /// As [`Swin::load`].
    pub fn load_split(vb: VarBuilder, projection: VarBuilder, cfg: &SwinConfig) -> Result<Self> {
        cfg.validate()?;
        let e = vb.pp("embeddings");
        let p = e.pp("patch_embeddings").pp("projection");
        let k = cfg.patch_size;
        let patch = PatchConv::load(p, (cfg.num_channels, cfg.embed_dim), k, (k, 0), true)?;
        let embed_norm = norm(e.pp("norm"), cfg.embed_dim, cfg.layer_norm_eps)?;
        let n = cfg.num_stages();
        let stages = (0..n)
            .map(|s| {
                let l = vb.pp("encoder").pp("layers").pp(s);
                let blocks = (0..cfg.depths[s])
                    .map(|i| Block::load(l.pp("blocks").pp(i), cfg, s, i))
                    .collect::<Result<Vec<_>>>()?;
                let merge = if s + 1 < n {
                    Some(Merge::load(
                        l.pp("downsample"),
                        cfg.stage_dim(s),
                        cfg.layer_norm_eps,
                    )?)
                } else {
                    None
                };
                Ok((blocks, merge))
            })
            .collect::<Result<Vec<_>>>()?;
        let output_proj = match cfg.output_size {
            Some(out) => Some(linear(projection, cfg.hidden_size(), out, true)?),
            None => None,
        };
        Ok(Self {
            patch,
            embed_norm,
            stages,
            output_proj,
            cfg: cfg.clone(),
            dtype: vb.dtype(),
        })
    }

    /// Its configuration.
    pub fn config(&self) -> &SwinConfig {
        &self.cfg
    }

    /// The last stage's tokens of normalised pixels (any size; the
    /// configured one is what the checkpoint was trained at).
    ///
    /// # Shapes
    /// `pixels: (batch, 3, height, width)` → `(batch, tokens,
    /// hidden_size)`, the tokens row by row of the last map.
    ///
    /// # Errors
    /// [`crate::VisionError::Argument`] naming `pixels` for another
    /// channel count, or a size whose stages' maps get smaller than the
    /// window.
    pub fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        let x = self.last_hidden_state(pixels)?;
        Ok(match &self.output_proj {
            Some(p) => p.forward(&x)?,
            None => x,
        })
    }

    /// The last stage's tokens before any output projection
    /// (transformers' `last_hidden_state`).
    ///
    /// # Shapes
    /// `pixels: (batch, 3, height, width)` → `(batch, tokens,
    /// last stage's width)`.
    ///
    /// # Errors
    /// As [`Swin::forward`].
    pub fn last_hidden_state(&self, pixels: &Tensor) -> Result<Tensor> {
        let (_, ch, height, width) = pixels.dims4()?;
        if ch != self.cfg.num_channels {
            return crate::error::arg_err(
                "pixels",
                format!("expected {} channels, got {ch}", self.cfg.num_channels),
            );
        }
        if let Some((s, (h, w))) = self
            .cfg
            .stage_sides(height, width)
            .into_iter()
            .enumerate()
            .find(|(_, (h, w))| (*h).min(*w) < self.cfg.window_size)
        {
            return crate::error::arg_err(
                "pixels",
                format!(
                    "a {height}x{width} input makes stage {s}'s map {h}x{w} tokens, smaller \
                     than the {} window",
                    self.cfg.window_size
                ),
            );
        }
        // Padded right and below to whole patches, as transformers pads.
        let p = self.cfg.patch_size;
        let x = pixels
            .to_dtype(DType::F32)?
            .pad_with_zeros(2, 0, (p - height % p) % p)?
            .pad_with_zeros(3, 0, (p - width % p) % p)?
            .permute((0, 2, 3, 1))?;
        let x = self.patch.forward(&x)?.to_dtype(self.dtype)?;
        let mut x = self.embed_norm.forward(&x)?;
        let mut cache = StageCache::default();
        for (blocks, merge) in &self.stages {
            for block in blocks {
                x = block.forward(&x, &mut cache)?;
            }
            if let Some(m) = merge {
                x = m.forward(&x)?;
            }
        }
        let (b, h, w, c) = x.dims4()?;
        Ok(x.reshape((b, h * w, c))?)
    }

    /// Adds the encoder's tensors under `prefix`, named as [`Swin::load`]
    /// reads them (see [`vl_attn::named`]).
    ///
    /// # Errors
    /// candle's, dequantizing a converted layer.
    pub fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        use vl_attn::named::join;
        let e = join(prefix, "embeddings");
        self.patch
            .named_tensors(&join(&e, "patch_embeddings.projection"), out)?;
        self.embed_norm.named_tensors(&join(&e, "norm"), out);
        for (s, (blocks, merge)) in self.stages.iter().enumerate() {
            let l = join(prefix, &format!("encoder.layers.{s}"));
            for (i, b) in blocks.iter().enumerate() {
                b.named_tensors(&join(&l, &format!("blocks.{i}")), out)?;
            }
            if let Some(m) = merge {
                let d = join(&l, "downsample");
                m.norm.named_tensors(&join(&d, "norm"), out);
                m.reduction.named_tensors(&join(&d, "reduction"), out)?;
            }
        }
        if let Some(p) = &self.output_proj {
            p.named_tensors(&join(prefix, "output_proj"), out)?;
        }
        Ok(())
    }

    /// The same encoder, its linear layers converted by `q` (tensor names
    /// as [`Swin::load`] reads them).
    ///
    /// # Errors
    /// A layer the format cannot hold and no fallback can.
    pub fn quantize(&self, q: &Quantizer) -> Result<Self> {
        let stages = self
            .stages
            .iter()
            .enumerate()
            .map(|(s, (blocks, merge))| {
                let blocks = blocks
                    .iter()
                    .enumerate()
                    .map(|(i, b)| b.quantize(q, &format!("encoder.layers.{s}.blocks.{i}")))
                    .collect::<Result<Vec<_>>>()?;
                let merge = match merge {
                    Some(m) => Some(Merge {
                        reduction: q
                            .within(&format!("encoder.layers.{s}.downsample"))
                            .proj("reduction", &m.reduction)?,
                        norm: m.norm.clone(),
                    }),
                    None => None,
                };
                Ok((blocks, merge))
            })
            .collect::<Result<Vec<_>>>()?;
        let output_proj = match &self.output_proj {
            Some(p) => Some(q.proj("output_proj", p)?),
            None => None,
        };
        Ok(Self {
            patch: self
                .patch
                .quantize(&q.within("embeddings.patch_embeddings"), "projection")?,
            stages,
            output_proj,
            ..self.clone()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_index_matches_transformers_layout() {
        // window 2: offsets (dy, dx) in {-1, 0, 1}², rows of 3.
        let idx = relative_position_index(2);
        assert_eq!(idx.len(), 16);
        // query 0 (0,0) vs key 3 (1,1): offset (-1,-1) -> (0,0) -> 0.
        assert_eq!(idx[3], 0);
        // query 3 (1,1) vs key 0 (0,0): offset (1,1) -> (2,2) -> 8.
        assert_eq!(idx[3 * 4], 8);
        // the diagonal is the zero offset (1,1) -> 4.
        assert!((0..4).all(|i| idx[i * 4 + i] == 4));
    }

    /// `x` rolled by `shift` along `dim` (torch.roll: element `i` moves to
    /// `i + shift`, wrapping).
    fn roll(x: &Tensor, shift: isize, dim: usize) -> Result<Tensor> {
        let n = x.dim(dim)? as isize;
        let s = shift.rem_euclid(n) as usize;
        if s == 0 {
            return Ok(x.clone());
        }
        let n = n as usize;
        Ok(Tensor::cat(
            &[x.narrow(dim, n - s, s)?, x.narrow(dim, 0, n - s)?],
            dim,
        )?)
    }

    #[test]
    fn roll_wraps_like_torch() -> Result<()> {
        let x = Tensor::arange(0u32, 5, &Device::Cpu)?;
        assert_eq!(roll(&x, -2, 0)?.to_vec1::<u32>()?, [2, 3, 4, 0, 1]);
        assert_eq!(roll(&x, 2, 0)?.to_vec1::<u32>()?, [3, 4, 0, 1, 2]);
        assert_eq!(roll(&x, 5, 0)?.to_vec1::<u32>()?, [0, 1, 2, 3, 4]);
        Ok(())
    }

    /// The window order Swin takes from `vl_attn::WindowOrder` is
    /// transformers' two rolls and the window permute, and the way back
    /// its inverse (the two opposite rolls), shifted or not, on a map of
    /// several windows a side and two images.
    #[test]
    fn window_order_is_rolls_and_the_window_permute() -> Result<()> {
        let (b, hp, wp, c, ws) = (2, 6, 9, 2, 3);
        let map = Tensor::arange(0f32, (b * hp * wp * c) as f32, &Device::Cpu)?
            .reshape((b, hp, wp, c))?;
        let (nh, nw, t) = (hp / ws, wp / ws, ws * ws);
        for shift in [0usize, 1] {
            let order = WindowOrder::new(hp, wp, ws, shift)?;
            let s = -(shift as isize);
            let rolled = roll(&roll(&map, s, 1)?, s, 2)?;
            let want = rolled
                .reshape((b, nh, ws, nw, ws, c))?
                .permute((0, 1, 3, 2, 4, 5))?
                .contiguous()?
                .reshape((b * nh * nw, 1, t, c))?;
            let windows = order.split_heads(&map, 0, 1, c)?;
            assert_eq!(
                windows.flatten_all()?.to_vec1::<f32>()?,
                want.flatten_all()?.to_vec1::<f32>()?,
                "shift {shift}"
            );
            let back = order.merge_heads(&windows)?;
            assert_eq!(
                back.flatten_all()?.to_vec1::<f32>()?,
                map.flatten_all()?.to_vec1::<f32>()?,
                "shift {shift}: the scatter undoes the gather"
            );
        }
        Ok(())
    }

    #[test]
    fn shift_mask_separates_regions() -> Result<()> {
        // A 4x4 map, window 2, shift 1: the last window holds tokens from
        // four regions, the first from one.
        let m = shift_mask(4, 4, 2, 1, DType::F32, &Device::Cpu)?.to_vec3::<f32>()?;
        assert_eq!(m.len(), 4);
        assert!(m[0].iter().flatten().all(|v| *v == 0.0));
        let last = &m[3];
        assert!((0..4).all(|i| last[i][i] == 0.0));
        assert_eq!(last[0][3], -100.0);
        Ok(())
    }

    #[test]
    fn config_names_a_map_smaller_than_the_window() {
        let cfg = SwinConfig {
            image_size: ImageSize::HeightWidth([64, 48]),
            patch_size: 4,
            num_channels: 3,
            embed_dim: 8,
            depths: vec![2, 2, 2],
            num_heads: vec![1, 2, 4],
            window_size: 5,
            mlp_ratio: 2.0,
            qkv_bias: true,
            hidden_act: Activation::Gelu,
            layer_norm_eps: 1e-5,
            use_absolute_embeddings: false,
            output_size: None,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            rescale_factor: 1.0 / 255.0,
            resample: Resample::Bilinear,
            do_resize: true,
            document: None,
        };
        // 16x12, 8x6, 4x3: stage 2 is smaller than 5.
        assert_eq!(cfg.stage_sides(64, 48), [(16, 12), (8, 6), (4, 3)]);
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("window_size") && e.contains("stage 2"), "{e}");
    }
}

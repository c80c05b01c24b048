//! The vision-language decoder: token embedding (optionally scaled) +
//! positions (learned or sinusoidal, [`crate::positions`]) → optional
//! embedding norm → blocks (pre- or post-LN) → optional final norm → LM
//! head; and its incremental use, an image context
//! built once per image and a decode state with the text caches.
//!
//! An image context may also hold several images per sample, interleaved
//! with the text (Flamingo-style, [`VisionLanguageDecoder::interleaved_context`]):
//! every decode step then builds the media-mask rows of the positions it
//! feeds, the same rows [`vl_attn::mask::interleaved`] gives a full forward.

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use candle_nn::{Embedding, Linear, Module, VarBuilder};
use vl_attn::Quantizer;

use vl_attn::mask::{self, MediaAttention, MediaSpan};
use vl_attn::LayerNorm;
use vl_attn::{CrossAttention, Dropout, DropoutRng, KvCache, Mask, Mode, Proj};

use crate::context::{ImageContext, Media};
use crate::state::{
    decode_rows, DecodeState, StepOptions, StepOutput, StepPositions, StepValues, MAX_ROWS,
};

use crate::block::{layer_norm, BlockGroup, BlockInputs, DecoderBlock, ImageInput};
use crate::config::{DecoderConfig, PositionEmbedding};
use crate::error::{arg_err, DecoderError, Result};
use crate::head::OutputTransform;
use crate::positions::Positions;

/// The masks of a full forward pass.
#[derive(Debug, Clone, Copy, Default)]
pub struct ForwardMasks<'a> {
    /// Text key mask `(batch | 1, len | 1, len)`, e.g. [`Mask::from_keys`]
    /// of a left-padding mask; combined with causality.
    pub text: Option<&'a Mask>,
    /// Image mask `(batch | 1, len | 1, image_len)`, e.g.
    /// [`vl_attn::mask::image_tokens`] or [`vl_attn::mask::interleaved`].
    pub image: Option<&'a Mask>,
}

/// The standard deviation of fresh embeddings (transformers'
/// `initializer_range`).
pub const EMBEDDING_INIT_STD: f64 = 0.02;

/// An embedding table `weight (n, width)`, initialised N(0, 0.02) when fresh.
fn embedding(n: usize, width: usize, vb: VarBuilder) -> Result<Embedding> {
    let init = candle_nn::Init::Randn {
        mean: 0.0,
        stdev: EMBEDDING_INIT_STD,
    };
    Ok(Embedding::new(
        vb.get_with_hints((n, width), "weight", init)?,
        width,
    ))
}

/// The pieces of a decoder, for [`VisionLanguageDecoder::from_parts`]
/// (checkpoint converters).
#[derive(Debug, Clone)]
pub struct DecoderParts {
    /// The token embedding, `(vocab_size, hidden_size)`.
    pub embed_tokens: Embedding,
    /// Learned positions, `(max_position_embeddings + position_offset,
    /// hidden_size)`; `None` for sinusoidal positions.
    pub embed_positions: Option<Embedding>,
    /// The norm on the embeddings, exactly when `layernorm_embedding`.
    pub embedding_norm: Option<LayerNorm>,
    /// The blocks, `num_hidden_layers` of them.
    pub blocks: Vec<DecoderBlock>,
    /// The norm after the last block, exactly when `final_norm`.
    pub final_norm: Option<LayerNorm>,
    /// The transform before the LM head, exactly when `output_transform`.
    pub output_transform: Option<OutputTransform>,
    /// The LM head, `(vocab_size, hidden_size)`, with or without a bias.
    pub lm_head: Linear,
}

/// The decoder.
#[derive(Debug, Clone)]
pub struct VisionLanguageDecoder {
    embed_tokens: Embedding,
    /// `sqrt(hidden_size)` when `scale_embedding`.
    embed_scale: Option<f64>,
    positions: Positions,
    embedding_norm: Option<LayerNorm>,
    blocks: Vec<DecoderBlock>,
    final_norm: Option<LayerNorm>,
    output_transform: Option<OutputTransform>,
    /// Dense, or quantized by [`VisionLanguageDecoder::quantize`].
    lm_head: Proj,
    /// On the token plus position embeddings, in training.
    embd_dropout: Dropout,
    mode: Mode,
    cfg: DecoderConfig,
}

impl VisionLanguageDecoder {
    /// Loads (or, with a `VarMap`-backed builder, initialises) the decoder:
    /// `embed_tokens`, `embed_positions` (learned positions only),
    /// `embedding_norm` (`layernorm_embedding` only), `blocks.{i}.*`,
    /// `final_norm` (unless `final_norm` is false), `output_transform.*`
    /// (`output_transform` only), and `lm_head` unless
    /// `tie_word_embeddings`.
    pub fn load(vb: VarBuilder, cfg: &DecoderConfig) -> Result<Self> {
        cfg.validate()?;
        let embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, vb.pp("embed_tokens"))?;
        let embed_positions = match cfg.position_embedding {
            PositionEmbedding::Learned => Some(embedding(
                cfg.max_position_embeddings + cfg.position_offset,
                cfg.hidden_size,
                vb.pp("embed_positions"),
            )?),
            PositionEmbedding::Sinusoidal => None,
        };
        let embedding_norm = if cfg.layernorm_embedding {
            Some(layer_norm(vb.pp("embedding_norm"), cfg)?)
        } else {
            None
        };
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| DecoderBlock::load(vb.pp("blocks").pp(i), cfg, i))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = if cfg.final_norm {
            Some(layer_norm(vb.pp("final_norm"), cfg)?)
        } else {
            None
        };
        let output_transform = if cfg.output_transform {
            Some(OutputTransform::load(vb.pp("output_transform"), cfg)?)
        } else {
            None
        };
        let head = vb.pp("lm_head");
        let bias = if cfg.lm_head_bias {
            Some(head.get_with_hints(cfg.vocab_size, "bias", candle_nn::Init::Const(0.0))?)
        } else {
            None
        };
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(embed_tokens.embeddings().clone(), bias)
        } else {
            let weight = head.get_with_hints(
                (cfg.vocab_size, cfg.hidden_size),
                "weight",
                candle_nn::init::DEFAULT_KAIMING_NORMAL,
            )?;
            Linear::new(weight, bias)
        };
        Self::from_parts(
            DecoderParts {
                embed_tokens,
                embed_positions,
                embedding_norm,
                blocks,
                final_norm,
                output_transform,
                lm_head,
            },
            cfg,
        )
    }

    /// Builds the decoder from existing parts (checkpoint converters). The
    /// blocks get `cfg`'s norm placement and dropouts.
    ///
    /// # Errors
    /// [`DecoderError::Config`] when `cfg` is impossible or its position
    /// table passes `u32::MAX` rows;
    /// [`DecoderError::Argument`] naming the part that does not fit `cfg`:
    /// `embed_tokens`, `lm_head` not `(vocab_size, hidden_size)`,
    /// `embed_positions` not `(max_position_embeddings + position_offset,
    /// hidden_size)`, missing for learned positions or given for
    /// sinusoids, `embedding_norm`, `final_norm` or `output_transform`
    /// present where the config
    /// has none or missing where it has one, `blocks` not
    /// `num_hidden_layers` blocks with cross-attention every
    /// `cross_attention_every`.
    pub fn from_parts(parts: DecoderParts, cfg: &DecoderConfig) -> Result<Self> {
        cfg.validate()?;
        let DecoderParts {
            embed_tokens,
            embed_positions,
            embedding_norm,
            blocks,
            final_norm,
            output_transform,
            lm_head,
        } = parts;
        let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
        for (arg, t) in [
            ("embed_tokens", embed_tokens.embeddings()),
            ("lm_head", lm_head.weight()),
        ] {
            if t.dims() != [vocab, hidden] {
                return arg_err(
                    arg,
                    format!(
                        "expected weight shape [{vocab}, {hidden}], got {:?}",
                        t.dims()
                    ),
                );
            }
        }
        for (arg, given, field, wanted) in [
            (
                "embedding_norm",
                embedding_norm.is_some(),
                "layernorm_embedding",
                cfg.layernorm_embedding,
            ),
            (
                "final_norm",
                final_norm.is_some(),
                "final_norm",
                cfg.final_norm,
            ),
            (
                "output_transform",
                output_transform.is_some(),
                "output_transform",
                cfg.output_transform,
            ),
            (
                "lm_head.bias",
                lm_head.bias().is_some(),
                "lm_head_bias",
                cfg.lm_head_bias,
            ),
        ] {
            if given != wanted {
                return arg_err(
                    arg,
                    format!("given: {given}, but the config's {field} is {wanted}"),
                );
            }
        }
        let cross: Vec<bool> = blocks
            .iter()
            .map(DecoderBlock::has_cross_attention)
            .collect();
        let want: Vec<bool> = (0..cfg.num_hidden_layers)
            .map(|i| cfg.has_cross_attention(i))
            .collect();
        if cross != want {
            return arg_err(
                "blocks",
                format!(
                    "expected {} blocks with cross-attention {want:?} (num_hidden_layers, \
                     cross_attention_every), got {} with {cross:?}",
                    want.len(),
                    cross.len()
                ),
            );
        }
        let device = embed_tokens.embeddings().device().clone();
        let dtype = embed_tokens.embeddings().dtype();
        let positions = Positions::for_config(cfg, embed_positions, dtype, &device)?;
        let dropouts = cfg.dropouts()?;
        let blocks = blocks
            .into_iter()
            .map(|b| {
                b.with_norm_placement(cfg.norm_placement)
                    .with_dropouts(dropouts)
            })
            .collect();
        Ok(Self {
            embed_tokens,
            embed_scale: cfg.scale_embedding.then(|| (cfg.hidden_size as f64).sqrt()),
            positions,
            embedding_norm,
            blocks,
            final_norm,
            output_transform,
            lm_head: lm_head.into(),
            embd_dropout: dropouts.embedding,
            mode: Mode::Inference,
            cfg: cfg.clone(),
        })
    }

    /// A copy with every linear layer quantized to `format` (e.g.
    /// [`GgmlDType::Q8_0`], [`GgmlDType::Q4K`]): the projections of every
    /// block and the LM head. Embeddings, norms and gates stay dense; a head
    /// tied to the token embedding gets a quantized copy while the embedding
    /// table stays dense. Activations keep the model's dtype.
    ///
    /// # Errors
    /// [`vl_attn::AttnError::Quantize`] naming the first layer whose input
    /// width is not a multiple of the format's block size (32 for `q8_0`,
    /// 256 for `q4k`), e.g. `blocks.0.cross_attn.k_proj` for a
    /// `memory_dim` of 48.
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        let blocks = self
            .blocks
            .iter()
            .enumerate()
            .map(|(i, b)| b.quantize(q.within(&format!("blocks.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            blocks,
            lm_head: q.proj("lm_head", &self.lm_head)?,
            ..self.clone()
        })
    }

    /// Adds the decoder's tensors under `prefix`, by the names
    /// [`VisionLanguageDecoder::load`] reads (see [`vl_attn::named`]): a
    /// head tied to the token embedding is not written (its bias is, as
    /// `lm_head.bias`).
    ///
    /// # Errors
    /// candle's, dequantizing a converted layer.
    pub fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        use vl_attn::named::join;
        out.insert(
            join(prefix, "embed_tokens.weight"),
            self.embed_tokens.embeddings().clone(),
        );
        if let Positions::Learned { table, .. } = &self.positions {
            out.insert(
                join(prefix, "embed_positions.weight"),
                table.embeddings().clone(),
            );
        }
        if let Some(n) = &self.embedding_norm {
            n.named_tensors(&join(prefix, "embedding_norm"), out);
        }
        for (i, b) in self.blocks.iter().enumerate() {
            b.named_tensors(&join(prefix, &format!("blocks.{i}")), out)?;
        }
        if let Some(n) = &self.final_norm {
            n.named_tensors(&join(prefix, "final_norm"), out);
        }
        if let Some(t) = &self.output_transform {
            t.named_tensors(&join(prefix, "output_transform"), out);
        }
        if !self.cfg.tie_word_embeddings {
            self.lm_head.named_tensors(&join(prefix, "lm_head"), out)?;
        } else if let (_, Some(b)) = self.lm_head.weight_and_bias()? {
            out.insert(join(prefix, "lm_head.bias"), b);
        }
        Ok(())
    }

    /// [`Self::quantize`], consuming the decoder: each block's dense
    /// weights are dropped as soon as its quantized copy exists, so the
    /// peak memory is the dense decoder and one quantized block, not two
    /// whole decoders (loaders quantize this way as they load).
    ///
    /// # Errors
    /// As [`Self::quantize`]; the decoder is consumed either way.
    pub fn into_quantized(mut self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        let dense = std::mem::take(&mut self.blocks);
        let mut blocks = Vec::with_capacity(dense.len());
        for (i, b) in dense.into_iter().enumerate() {
            blocks.push(b.quantize(q.within(&format!("blocks.{i}")))?);
        }
        self.blocks = blocks;
        self.lm_head = q.proj("lm_head", &self.lm_head)?;
        Ok(self)
    }

    /// The quantized format of the linear layers, `None` when dense.
    pub fn quantization(&self) -> Option<GgmlDType> {
        self.lm_head.quantization()
    }

    /// The token table `(vocab_size, hidden_size)` (shared with a text
    /// encoder that reads the same vocabulary).
    pub fn token_table(&self) -> &Tensor {
        self.embed_tokens.embeddings()
    }

    /// The LM head (dense or quantized as the blocks' linear layers are).
    pub fn lm_head(&self) -> &Proj {
        &self.lm_head
    }

    /// The configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// The blocks.
    pub fn blocks(&self) -> &[DecoderBlock] {
        &self.blocks
    }

    /// The device of the weights.
    pub fn device(&self) -> &Device {
        self.embed_tokens.embeddings().device()
    }

    /// The dtype of the weights.
    pub fn dtype(&self) -> DType {
        self.embed_tokens.embeddings().dtype()
    }

    /// Switches the decoder between training and inference (the default).
    ///
    /// In [`Mode::Training`], the config's dropouts act: `embedding_dropout`
    /// on the embeddings, `residual_dropout` on every branch of every
    /// block, `attention_dropout` on the attention probabilities, all
    /// drawing their masks, in call order, from the mode's generator — the
    /// same seed and the same calls give the same masks. Attention dropout
    /// runs on the reference path: [`vl_attn::Backend::Auto`] takes it, and
    /// a decoder set to [`vl_attn::Backend::Fused`] is refused while the
    /// dropout is active. Cached decoding and generation follow the mode
    /// too: switch to inference to evaluate. In [`Mode::Inference`] nothing
    /// is dropped and the outputs are bit-identical to those of a decoder
    /// without dropout.
    pub fn set_mode(&mut self, mode: Mode) {
        for b in &mut self.blocks {
            b.set_mode(mode.clone());
        }
        self.mode = mode;
    }

    /// The current mode.
    pub fn mode(&self) -> &Mode {
        &self.mode
    }

    /// Drops entries of every cross-attention map with probability `p`
    /// (inverted scaling, masks seeded by `seed` and drawn in call order),
    /// in inference as in training, while everything else follows the
    /// mode: with the decoder in inference, sampled captions read a
    /// randomly thinned image at every step. `p = 0` restores the
    /// config's attention dropout, as does [`Self::set_mode`].
    ///
    /// Attention dropout runs on the reference path (see
    /// [`Self::set_mode`]).
    ///
    /// # Errors
    /// `p` outside `[0, 1)`, named `cross_attention_map_dropout`.
    pub fn set_cross_map_dropout(&mut self, p: f64, seed: u64) -> Result<()> {
        let dropout = Dropout::new("cross_attention_map_dropout", p)?;
        if p == 0.0 {
            self.set_mode(self.mode.clone());
            return Ok(());
        }
        let rng = DropoutRng::new(seed);
        for b in &mut self.blocks {
            b.set_cross_map_dropout(dropout, rng.clone());
        }
        Ok(())
    }

    /// Sets the attention implementation of every block.
    pub fn set_backend(&mut self, backend: vl_attn::Backend) {
        for b in &mut self.blocks {
            b.set_backend(backend);
        }
    }

    /// Keeps every block's text cache (its self-attention's keys and
    /// values) in `dtype`: `None`, the activations' dtype, is the default;
    /// a 16-bit float under f32 activations halves the bytes a decode step
    /// reads from it — what long outputs (a 3,000-token page) are bound
    /// by — at the cost of rounding keys and values as transformers' bf16
    /// model does; `U8` (q8 rows, [`vl_attn::quantize_kv`]: 8-bit values
    /// with an f16 scale per 32, for head widths that are a multiple of
    /// 32) about halves bf16's bytes again.
    ///
    /// # Errors
    /// [`DecoderError::Argument`] naming `text_cache_dtype` when `dtype` is
    /// neither the activations' dtype nor, under f32 activations, bf16,
    /// f16 or u8, or is u8 over a head width that is not a multiple of 32.
    pub fn set_text_cache_dtype(&mut self, dtype: Option<DType>) -> Result<()> {
        if let Some(d) = dtype {
            let width = self.cfg.hidden_size / self.cfg.num_attention_heads.max(1);
            self.check_cache("text_cache_dtype", d, std::iter::once(width))?;
        }
        for b in &mut self.blocks {
            b.set_text_cache_dtype(dtype);
        }
        Ok(())
    }

    /// Keeps every block's image keys and values (what
    /// [`Self::image_context`] projects once per image) in `dtype`: `None`,
    /// as the blocks were built or quantized (under converted weights with
    /// f32 activations on the CPU, see [`vl_attn::Quantizer::kv_dtype`]); the activations' dtype;
    /// under f32 activations bf16 or f16, or `U8` for q8 rows
    /// ([`vl_attn::quantize_kv`]: 8-bit values with an f16 scale per 32,
    /// about half of bf16's bytes, for head widths that are a multiple of
    /// 32). A batch of images' keys and values is what a decode step of
    /// many requests reads most of after the weights.
    ///
    /// # Errors
    /// [`DecoderError::Argument`] naming `image_cache_dtype` when `dtype`
    /// is none of those, or is `U8` over a head width that is not a
    /// multiple of 32.
    pub fn set_image_cache_dtype(&mut self, dtype: Option<DType>) -> Result<()> {
        if let Some(d) = dtype {
            let widths = self
                .blocks
                .iter()
                .filter_map(|b| b.cross_attention())
                .map(|c| c.config().inner_dim / c.config().num_heads);
            self.check_cache("image_cache_dtype", d, widths)?;
        }
        for b in &mut self.blocks {
            b.set_image_cache_dtype(dtype);
        }
        Ok(())
    }

    /// The dtype the image's keys and values are kept in (`U8`: q8 rows),
    /// `None` for the activations'.
    pub fn image_cache_dtype(&self) -> Option<DType> {
        self.blocks
            .iter()
            .find_map(|b| b.cross_attention())
            .and_then(|c| c.memory_dtype())
    }

    /// Whether a cache (text or image keys and values) in `cache` serves
    /// activations in `activations`: the same dtype, or bf16/f16/u8 (q8
    /// rows) under f32.
    pub fn cache_fits(activations: DType, cache: DType) -> bool {
        cache == activations
            || (activations == DType::F32 && matches!(cache, DType::BF16 | DType::F16 | DType::U8))
    }

    /// A cache dtype `cache` for heads of `widths`, or an error naming
    /// `arg`: one that fits the activations ([`Self::cache_fits`]), and
    /// for q8 rows heads a multiple of 32 wide.
    fn check_cache(
        &self,
        arg: &'static str,
        cache: DType,
        mut widths: impl Iterator<Item = usize>,
    ) -> Result<()> {
        let activations = self.dtype();
        if !Self::cache_fits(activations, cache) {
            return arg_err(
                arg,
                format!(
                    "expected {activations:?} (the activations') or, under f32 \
                     activations, bf16, f16 or u8 (q8 rows); got {cache:?}"
                ),
            );
        }
        if cache == DType::U8 {
            if let Some(w) = widths.find(|w| !w.is_multiple_of(32)) {
                return arg_err(
                    arg,
                    format!("q8 rows need a head width that is a multiple of 32, got {w}"),
                );
            }
        }
        Ok(())
    }

    /// The dtype of the text cache, `None` for the activations'.
    pub fn text_cache_dtype(&self) -> Option<DType> {
        self.blocks.first().and_then(DecoderBlock::text_cache_dtype)
    }

    fn check_tokens(&self, tokens: &Tensor, offset: usize) -> Result<(usize, usize)> {
        let (b, t) = tokens.dims2().map_err(|_| DecoderError::Argument {
            arg: "tokens",
            reason: format!("expected shape (batch, len), got {:?}", tokens.dims()),
        })?;
        if tokens.dtype() != DType::U32 {
            return arg_err(
                "tokens",
                format!("expected dtype u32, got {:?}", tokens.dtype()),
            );
        }
        let max = self.cfg.max_position_embeddings;
        match offset.checked_add(t) {
            Some(end) if end <= max => {}
            // end > max >= 0, so end >= 1.
            end => {
                return Err(DecoderError::MaxPositions {
                    position: end.map_or(usize::MAX, |e| e - 1),
                    max,
                })
            }
        }
        self.check_token_ids(tokens)?;
        Ok((b, t))
    }

    /// Every id of `tokens` (u32) is below the vocabulary size: an embedding
    /// lookup past the table is an error on the CPU and reads out of bounds
    /// on some accelerators.
    fn check_token_ids(&self, tokens: &Tensor) -> Result<()> {
        if tokens.elem_count() == 0 {
            return Ok(());
        }
        let max_id = tokens.flatten_all()?.max(0)?.to_scalar::<u32>()?;
        if max_id as usize >= self.cfg.vocab_size {
            return arg_err(
                "tokens",
                format!(
                    "expected ids below the vocabulary size {}, got {max_id}",
                    self.cfg.vocab_size
                ),
            );
        }
        Ok(())
    }

    /// Whether `image` was made for this decoder's blocks: one entry per
    /// block, keys and values exactly in the blocks with cross-attention
    /// (or in none, text-only). `arg` names the caller's argument.
    fn check_context(&self, arg: &'static str, image: &ImageContext) -> Result<()> {
        if image.layers.len() != self.blocks.len() {
            return arg_err(
                arg,
                format!(
                    "expected an image context of {} blocks (this decoder's), got one of {}",
                    self.blocks.len(),
                    image.layers.len()
                ),
            );
        }
        if image.is_text_only() {
            return Ok(());
        }
        let wanted: Vec<bool> = self
            .blocks
            .iter()
            .map(DecoderBlock::has_cross_attention)
            .collect();
        let got: Vec<bool> = image.layers.iter().map(Option::is_some).collect();
        if wanted != got {
            return arg_err(
                arg,
                format!(
                    "expected image keys and values in the blocks with cross-attention \
                     {wanted:?}, got them in {got:?}"
                ),
            );
        }
        Ok(())
    }

    /// Whether `state` was started by a decoder of this one's blocks.
    fn check_state(&self, state: &DecodeState) -> Result<()> {
        if state.caches.len() != self.blocks.len() {
            return arg_err(
                "state",
                format!(
                    "expected a decode state of {} blocks (this decoder's), got one of {}",
                    self.blocks.len(),
                    state.caches.len()
                ),
            );
        }
        self.check_context("state", &state.image)
    }

    /// Token plus position embeddings of `tokens` placed at positions
    /// `offset..offset + len`: the input of the first block (after the
    /// embedding dropout, in training).
    ///
    /// # Shapes
    /// `tokens: (batch, len)` u32 → `(batch, len, hidden)`.
    pub fn embeddings(&self, tokens: &Tensor, offset: usize) -> Result<Tensor> {
        self.check_tokens(tokens, offset)?;
        self.embed(tokens, offset)
    }

    /// # Shapes
    /// `tokens: (batch, len)` u32, checked → `(batch, len, hidden)`.
    fn embed(&self, tokens: &Tensor, offset: usize) -> Result<Tensor> {
        let tok = self.embed_tokens.forward(tokens)?;
        let tok = match self.embed_scale {
            Some(scale) => (tok * scale)?,
            None => tok,
        };
        let x = tok.broadcast_add(&self.positions.forward(tokens, offset)?)?;
        let x = match &self.embedding_norm {
            Some(norm) => norm.forward(&x)?,
            None => x,
        };
        Ok(self.embd_dropout.forward(&x, &self.mode)?)
    }

    fn check_memory(&self, memory: &Tensor) -> Result<()> {
        match memory.dims() {
            &[_, _, d] if d == self.cfg.memory_dim => Ok(()),
            dims => arg_err(
                "memory",
                format!(
                    "expected shape (batch, image_len, {}), got {dims:?}",
                    self.cfg.memory_dim
                ),
            ),
        }
    }

    /// Logits of every position, in one pass with no cache.
    ///
    /// # Shapes
    /// - `tokens: (batch, len)` u32
    /// - `memory: (batch, image_len, memory_dim)`, or `None` for text only
    /// - returns `(batch, len, vocab)` f32 logits ([`Self::logits`])
    pub fn forward(
        &self,
        tokens: &Tensor,
        memory: Option<&Tensor>,
        masks: ForwardMasks<'_>,
    ) -> Result<Tensor> {
        // On the pool (see `vl_attn::kernels::on_pool`).
        vl_attn::kernels::on_pool(|| {
            self.check_tokens(tokens, 0)?;
            if let Some(m) = memory {
                self.check_memory(m)?;
            }
            let mut x = self.embed(tokens, 0)?;
            let image = memory.map_or(ImageInput::None, ImageInput::Memory);
            let inputs = BlockInputs {
                text_mask: masks.text,
                image_mask: masks.image,
                want_weights: false,
            };
            for block in &self.blocks {
                x = block.forward(&x, image, None, inputs)?.0;
            }
            self.logits(&x)
        })
    }

    /// LM-head logits of hidden states, in f32 whatever the decoder's
    /// dtype.
    ///
    /// A 16-bit decoder widens its last hidden state to f32 before the
    /// final norm and runs the LM head on f32 activations with f32
    /// accumulation and outputs ([`Proj::forward_f32`]), as llama.cpp
    /// does: rounding the norm's output and the logits to bf16 ties and
    /// flips the largest logits. On the random-weight vit-gpt2 base
    /// checkpoint `vl bench --dtype bf16` keeps 0.941 of f32's top-1
    /// choices instead of 0.918 (BENCHMARKS.md). While training (hidden states
    /// that track gradients) the norm and the head run in the decoder's
    /// dtype and only the logits are widened, so that gradients reach
    /// the norm's own weights.
    ///
    /// # Shapes
    /// `hidden: (batch, len, hidden)` → `(batch, len, vocab)` f32.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        // On the pool (see `vl_attn::kernels::on_pool`; inline when the
        // caller is already there, as `step` and `forward` are).
        vl_attn::kernels::on_pool(|| self.head(hidden))
    }

    /// The final norm and the LM head (see [`Self::logits`]).
    fn head(&self, hidden: &Tensor) -> Result<Tensor> {
        let tracked = hidden.track_op();
        let wide = !tracked && hidden.dtype() != DType::F32;
        let x = match &self.final_norm {
            // The norm's weights widened on each call (a vector each): a
            // copy kept beside them would go stale if they were trained.
            Some(norm) if wide => norm
                .to_dtype(DType::F32)?
                .forward(&hidden.to_dtype(DType::F32)?)?,
            Some(norm) => norm.forward(hidden)?,
            None => hidden.clone(),
        };
        let x = match &self.output_transform {
            Some(t) => t.forward(&x.to_dtype(hidden.dtype())?)?,
            None => x,
        };
        if tracked {
            return Ok(self.lm_head.forward(&x)?.to_dtype(DType::F32)?);
        }
        Ok(self.lm_head.forward_f32(&x)?)
    }

    /// Projects every block's image keys and values, once per image batch.
    ///
    /// # Shapes
    /// - `memory: (images, image_len, memory_dim)`
    /// - `mask: (images | 1, 1, image_len)`, for images of unequal token counts
    pub fn image_context(&self, memory: &Tensor, mask: Option<Mask>) -> Result<ImageContext> {
        // On the pool (see `vl_attn::kernels::on_pool`).
        vl_attn::kernels::on_pool(|| self.project_images(memory, mask))
    }

    /// Every block's image keys and values (see [`Self::image_context`]).
    fn project_images(&self, memory: &Tensor, mask: Option<Mask>) -> Result<ImageContext> {
        self.check_memory(memory)?;
        let images = memory.dims()[0];
        if let Some(m) = &mask {
            let (mb, mq, mk) = m.dims();
            if (mb != images && mb != 1) || mq != 1 || mk != memory.dims()[1] {
                return arg_err(
                    "image mask",
                    format!(
                        "expected shape ({images} | 1, 1, {}), got {:?}",
                        memory.dims()[1],
                        [mb, mq, mk]
                    ),
                );
            }
        }
        // Every cross-attention's keys and values at once (as one product
        // where their projections allow), handed back to their blocks.
        let crosses: Vec<&CrossAttention> = self
            .blocks
            .iter()
            .filter_map(|b| b.cross_attention())
            .collect();
        let mut kvs = CrossAttention::project_memories(&crosses, memory)?.into_iter();
        let layers = self
            .blocks
            .iter()
            .map(|b| b.cross_attention().and_then(|_| kvs.next()))
            .collect();
        Ok(ImageContext {
            layers,
            mask,
            images,
            media: None,
        })
    }

    /// Projects every block's keys and values of interleaved images
    /// (Flamingo-style: text, image, text, image, …), once per batch.
    ///
    /// `memory` row `b` holds sample `b`'s images' tokens in order from
    /// slot 0 (then padding); `spans[b]` lists those images in text order.
    /// At every decode step, text position `p` of sample `b` attends to the
    /// images with `text_start <= p` — all of them
    /// ([`MediaAttention::AllPrevious`]) or the last one
    /// ([`MediaAttention::MostRecent`]); text before any image attends to
    /// nothing and gets an exactly zero cross-attention output. These are
    /// the rows [`vl_attn::mask::interleaved`] gives a full
    /// [`VisionLanguageDecoder::forward`].
    ///
    /// # Shapes
    /// - `memory: (batch, memory_len, memory_dim)`
    /// - `spans`: `batch` lists, the token counts of each summing to at most
    ///   `memory_len`
    ///
    /// # Errors
    /// [`DecoderError::Argument`] naming `memory` when its shape is not
    /// `(batch, memory_len, memory_dim)` with `batch` and `memory_len`
    /// positive, or `spans` when there is not one list per sample, an
    /// image has no token, an image's `text_start` is past the model's last
    /// position or before the previous image's, or a sample's images hold
    /// more than `memory_len` tokens.
    pub fn interleaved_context(
        &self,
        memory: &Tensor,
        spans: &[Vec<MediaSpan>],
        mode: MediaAttention,
    ) -> Result<ImageContext> {
        self.check_memory(memory)?;
        // (batch, memory_len, memory_dim)
        let (batch, memory_len, _) = memory.dims3()?;
        if batch == 0 || memory_len == 0 {
            return arg_err(
                "memory",
                format!(
                    "expected at least one sample and one token, got shape {:?}",
                    memory.dims()
                ),
            );
        }
        if spans.len() != batch {
            return arg_err(
                "spans",
                format!(
                    "expected one list of images per sample of memory ({batch}), got {}",
                    spans.len()
                ),
            );
        }
        let max = self.cfg.max_position_embeddings;
        for (b, images) in spans.iter().enumerate() {
            let mut total = 0usize;
            let mut previous = 0;
            for (i, span) in images.iter().enumerate() {
                if span.tokens == 0 {
                    return arg_err("spans", format!("sample {b}, image {i}: has 0 tokens"));
                }
                if span.text_start >= max {
                    return arg_err(
                        "spans",
                        format!(
                            "sample {b}, image {i}: expected text_start below \
                             max_position_embeddings {max}, got {}",
                            span.text_start
                        ),
                    );
                }
                if span.text_start < previous {
                    return arg_err(
                        "spans",
                        format!(
                            "sample {b}, image {i}: images must be in text order, got \
                             text_start {} after {previous}",
                            span.text_start
                        ),
                    );
                }
                previous = span.text_start;
                total = match total.checked_add(span.tokens) {
                    Some(t) if t <= memory_len => t,
                    _ => {
                        return arg_err(
                            "spans",
                            format!(
                                "sample {b}: expected at most memory_len {memory_len} image \
                                 tokens, got {:?}",
                                images.iter().map(|s| s.tokens).collect::<Vec<_>>()
                            ),
                        )
                    }
                };
            }
        }
        let mut ctx = self.image_context(memory, None)?;
        ctx.media = Some(Media {
            spans: spans.to_vec(),
            mode,
            memory_len,
        });
        Ok(ctx)
    }

    /// A context with no image: cross-attention is skipped.
    pub fn text_only_context(&self) -> ImageContext {
        ImageContext {
            layers: vec![None; self.blocks.len()],
            mask: None,
            images: 0,
            media: None,
        }
    }

    /// The media-mask rows of the `len` positions a step of `state` feeds,
    /// one per decode row, for an interleaved context; `None` otherwise.
    fn media_mask(&self, state: &DecodeState, len: usize) -> Result<Option<Mask>> {
        let Some(media) = &state.image.media else {
            return Ok(None);
        };
        // (samples, len, memory_len)
        let rows = mask::interleaved_rows(
            &media.spans,
            state.offset,
            len,
            media.memory_len,
            media.mode,
            &state.device,
        )?;
        Ok(Some(match &state.row_samples {
            // (rows, len, memory_len)
            Some(idx) => rows.index_select(idx)?,
            None => rows,
        }))
    }

    /// A fresh decode state over `image`, with `per_image` rows per image
    /// (beams or samples), or `per_image` rows in text-only mode.
    ///
    /// # Errors
    /// [`DecoderError::Argument`] naming `per_image` when it is 0 or the
    /// rows (`per_image * images`) would pass `u32::MAX`, and naming `image`
    /// when the context was made by a decoder with other blocks (another
    /// block count or other blocks with cross-attention).
    pub fn start(&self, image: &ImageContext, per_image: usize) -> Result<DecodeState> {
        self.start_for(image, per_image, 256)
    }

    /// [`VisionLanguageDecoder::start`] for a decode of at most `tokens`
    /// tokens in all (prefix included): the text caches are allocated for
    /// that many positions (at most the model's), so that a short caption
    /// does not allocate and fault in a long cache. A longer decode still
    /// works: the caches grow by doubling.
    ///
    /// # Errors
    /// As [`VisionLanguageDecoder::start`].
    pub fn start_for(
        &self,
        image: &ImageContext,
        per_image: usize,
        tokens: usize,
    ) -> Result<DecodeState> {
        if per_image == 0 {
            return arg_err("per_image", "must be positive, got 0");
        }
        self.check_context("image", image)?;
        let Some(rows) = decode_rows(image.images, per_image) else {
            return arg_err(
                "per_image",
                format!(
                    "expected at most {MAX_ROWS} rows in all ({} images), got {per_image} per image",
                    image.images.max(1)
                ),
            );
        };
        let image_mask = match &image.mask {
            Some(m) if m.dims().0 > 1 && per_image > 1 => {
                // Both fit in u32: rows <= MAX_ROWS and per_image <= rows.
                let (rows, per_image) = (rows as u32, per_image as u32);
                let idx: Vec<u32> = (0..rows).map(|r| r / per_image).collect();
                Some(m.index_select(&Tensor::new(idx, self.device())?)?)
            }
            other => other.clone(),
        };
        let row_samples = if image.media.is_some() && image.images > 1 && per_image > 1 {
            // Both fit in u32: rows <= MAX_ROWS and per_image <= rows.
            let (rows, per_image) = (rows as u32, per_image as u32);
            let idx: Vec<u32> = (0..rows).map(|r| r / per_image).collect();
            Some(Tensor::new(idx, self.device())?)
        } else {
            None
        };
        let capacity = self.cfg.max_position_embeddings.min(tokens.max(1));
        Ok(DecodeState {
            image: image.clone(),
            image_mask,
            row_samples,
            caches: (0..self.blocks.len())
                .map(|_| KvCache::new(capacity))
                .collect::<vl_attn::Result<Vec<_>>>()?,
            rows,
            per_image,
            offset: 0,
            device: self.device().clone(),
        })
    }

    /// Feeds the next tokens of every row and returns what `options`
    /// asks for: logits (f32) or hidden states (before the final norm),
    /// of every new position or of the last one only, and block
    /// `weights_of`'s cross-attention weights per head. The one way to
    /// advance a [`DecodeState`]; the whole step, blocks and LM head, runs
    /// in one hand-over to the pool.
    ///
    /// # Shapes
    /// - `tokens: (rows, len)` u32, `len >= 1`
    /// - `values`: [`StepPositions::All`] `(rows, len, vocab | hidden)`,
    ///   [`StepPositions::Last`] `(rows, vocab | hidden)`
    /// - `weights`: [`StepPositions::All`] `(rows, heads, len, image_len)`,
    ///   [`StepPositions::Last`] `(rows, heads, image_len)`; `None` when not
    ///   asked for, or when that block has no image to read
    ///
    /// # Errors
    /// [`DecoderError::Argument`] naming `state` when it was started by a
    /// decoder with other blocks, `weights_of` when it is not a block
    /// index, `tokens` when their shape is not `(rows, len)` with
    /// `len >= 1`, their dtype not u32 or an id not below the vocabulary
    /// size; [`DecoderError::MaxPositions`] past the last position. The
    /// state is unchanged on error.
    pub fn step(
        &self,
        state: &mut DecodeState,
        tokens: &Tensor,
        options: StepOptions,
    ) -> Result<StepOutput> {
        // On the pool, so that the step's ~100 products do not each wake
        // it from the caller's thread (see `vl_attn::kernels::on_pool`).
        vl_attn::kernels::on_pool(|| {
            let (h, weights) = self.run_blocks(state, tokens, options.weights_of)?;
            let (values, mut weights) = self.step_values(h, vec![weights], options)?;
            Ok(StepOutput {
                values,
                weights: weights.pop().flatten(),
            })
        })
    }

    /// [`VisionLanguageDecoder::step`] for several states at once — e.g.
    /// requests that joined a running batch at different steps, each at its
    /// own position, over its own image: the embeddings, projections,
    /// feed-forwards and LM head run once over every state's rows, the
    /// attentions state by state over each one's caches and image. Each
    /// state advances as [`VisionLanguageDecoder::step`] would advance it
    /// alone, up to the products' rounding for another row count (the
    /// dense products' blocking may differ with the row count; the
    /// quantized ones compute each row alone).
    ///
    /// # Shapes
    /// `tokens[i]: (states[i].rows(), len)` u32, the same `len >= 1` for
    /// every state; the outputs as [`VisionLanguageDecoder::step`]'s, one
    /// per state.
    ///
    /// # Errors
    /// As [`VisionLanguageDecoder::step`], for each state; and
    /// [`DecoderError::Argument`] naming `tokens` when there is not one
    /// tensor per state or their lengths differ, `states` when there is
    /// none, one holds an interleaved context, or some read an image and
    /// others do not. Every check runs before any state changes.
    pub fn step_many(
        &self,
        states: &mut [&mut DecodeState],
        tokens: &[Tensor],
        options: StepOptions,
    ) -> Result<Vec<StepOutput>> {
        if states.is_empty() {
            return arg_err("states", "expected at least one decode state");
        }
        if tokens.len() != states.len() {
            return arg_err(
                "tokens",
                format!(
                    "expected one tensor per state ({}), got {}",
                    states.len(),
                    tokens.len()
                ),
            );
        }
        if let Some(layer) = options.weights_of {
            if self.blocks.get(layer).is_none() {
                return arg_err(
                    "weights_of",
                    format!("expected a block below {}, got {layer}", self.blocks.len()),
                );
            }
        }
        let mut len = None;
        for (i, (state, tokens)) in states.iter().zip(tokens).enumerate() {
            self.check_state(state)?;
            if state.image.media.is_some() {
                return arg_err(
                    "states",
                    format!("state {i} reads an interleaved context, which steps alone"),
                );
            }
            let (b, t) = self.check_tokens(tokens, state.offset)?;
            if b != state.rows || t == 0 || len.is_some_and(|l| l != t) {
                return arg_err(
                    "tokens",
                    format!(
                        "expected ({}, {}) for state {i}, got ({b}, {t})",
                        state.rows,
                        len.map_or("len >= 1".to_string(), |l: usize| l.to_string())
                    ),
                );
            }
            len = Some(t);
        }
        let with_image = states.iter().filter(|s| !s.image.is_text_only()).count();
        if with_image != 0 && with_image != states.len() {
            return arg_err(
                "states",
                format!(
                    "{with_image} of {} states read an image: every state or none must",
                    states.len()
                ),
            );
        }
        vl_attn::kernels::on_pool(|| {
            let embedded: Vec<Tensor> = states
                .iter()
                .zip(tokens)
                .map(|(s, t)| self.embed(t, s.offset))
                .collect::<Result<_>>()?;
            let mut x = Tensor::cat(&embedded, 0)?;
            let mut weights = vec![None; states.len()];
            for (i, block) in self.blocks.iter().enumerate() {
                let mut groups: Vec<BlockGroup<'_>> = states
                    .iter_mut()
                    .map(|s| {
                        let DecodeState {
                            image,
                            image_mask,
                            caches,
                            rows,
                            ..
                        } = &mut **s;
                        BlockGroup {
                            rows: *rows,
                            image: image.layer(i),
                            cache: &mut caches[i],
                            image_mask: image_mask.as_ref(),
                        }
                    })
                    .collect();
                let (y, w) =
                    block.forward_groups(&x, &mut groups, options.weights_of == Some(i))?;
                x = y;
                if options.weights_of == Some(i) {
                    weights = w;
                }
            }
            let t = len.unwrap_or(1);
            for s in states.iter_mut() {
                s.offset += t;
            }
            let (values, weights) = self.step_values(x, weights, options)?;
            let mut start = 0;
            states
                .iter()
                .zip(weights)
                .map(|(s, weights)| {
                    let values = values.narrow(0, start, s.rows)?;
                    start += s.rows;
                    Ok(StepOutput { values, weights })
                })
                .collect()
        })
    }

    /// What `options` asks of a step's last hidden states `h (rows, len,
    /// hidden)` and cross-attention weights (per group `(rows, heads, len,
    /// image_len)`): the positions kept, then logits or hidden states.
    fn step_values(
        &self,
        h: Tensor,
        weights: Vec<Option<Tensor>>,
        options: StepOptions,
    ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        let (h, weights) = match options.positions {
            StepPositions::All => (h, weights),
            StepPositions::Last => {
                // (rows, len, hidden), len >= 1 (checked by the callers)
                let (_, t, _) = h.dims3()?;
                let last = t - 1;
                let h = h.narrow(1, last, 1)?;
                // (rows, heads, len, image_len) -> (rows, heads, image_len)
                let weights = weights
                    .into_iter()
                    .map(|w| match w {
                        Some(w) => Ok(Some(w.narrow(2, last, 1)?.squeeze(2)?)),
                        None => Ok(None),
                    })
                    .collect::<Result<_>>()?;
                (h, weights)
            }
        };
        let values = match options.values {
            StepValues::Logits => self.head(&h)?,
            StepValues::Hidden => h,
        };
        let values = match options.positions {
            StepPositions::All => values,
            StepPositions::Last => values.squeeze(1)?,
        };
        Ok((values, weights))
    }

    /// The blocks over the next tokens: the last hidden states (before
    /// the final norm) and block `weights_of`'s cross-attention weights.
    fn run_blocks(
        &self,
        state: &mut DecodeState,
        tokens: &Tensor,
        weights_of: Option<usize>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.check_state(state)?;
        if let Some(layer) = weights_of {
            if self.blocks.get(layer).is_none() {
                return arg_err(
                    "weights_of",
                    format!("expected a block below {}, got {layer}", self.blocks.len()),
                );
            }
        }
        let (b, t) = self.check_tokens(tokens, state.offset)?;
        if b != state.rows {
            return arg_err("tokens", format!("expected {} rows, got {b}", state.rows));
        }
        if t == 0 {
            return arg_err(
                "tokens",
                format!("expected at least one token per row, got shape ({b}, 0)"),
            );
        }
        let media_mask = self.media_mask(state, t)?;
        let image_mask = media_mask.as_ref().or(state.image_mask.as_ref());
        let mut x = self.embed(tokens, state.offset)?;
        let mut weights = None;
        for (i, (block, cache)) in self.blocks.iter().zip(&mut state.caches).enumerate() {
            let image = state
                .image
                .layer(i)
                .map_or(ImageInput::None, ImageInput::Cached);
            let inputs = BlockInputs {
                text_mask: None,
                image_mask,
                want_weights: weights_of == Some(i),
            };
            let (y, w) = block.forward(&x, image, Some(cache), inputs)?;
            x = y;
            if w.is_some() {
                weights = w;
            }
        }
        state.offset += t;
        Ok((x, weights))
    }
}

//! One decoder block, pre-LN by default:
//!
//! ```text
//! x += self_attn(self_attn_norm(x))                 causal
//! x += [tanh(gate) *] cross_attn(cross_attn_norm(x), image)   no causal mask
//! x += tanh(cross_ffn_gate) * cross_ffn(cross_ffn_norm(x))     gated_cross_ffn only
//! x += ffn(ffn_norm(x))
//! ```
//!
//! or post-LN ([`NormPlacement::Post`]: BART, TrOCR), each branch reading
//! the stream as it is and its norm applied after the residual add:
//!
//! ```text
//! x = self_attn_norm(x + self_attn(x))
//! x = cross_attn_norm(x + [tanh(gate) *] cross_attn(x, image))
//! x = cross_ffn_norm(x + tanh(cross_ffn_gate) * cross_ffn(x))   gated_cross_ffn only
//! x = ffn_norm(x + ffn(x))
//! ```
//!
//! In training ([`DecoderBlock::set_mode`]), every branch goes through the
//! residual dropout before it is added, and both attentions drop
//! attention probabilities; in inference (the default) neither does
//! anything.
//!
//! Blocks without cross-attention (when `cross_attention_every > 1`) skip
//! the middle lines, and so does every block when there is no image. The
//! second middle line is Flamingo's gated dense layer: a feed-forward of
//! the cross-attention branch's own, behind a tanh gate that starts at 0.

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use vl_attn::Quantizer;
use vl_attn::{
    CacheGroup, CausalSelfAttention, CrossAttention, CrossAttentionConfig, CrossGroup, CrossKv,
    Dropout, DropoutRng, FeedForward, KvCache, Mask, Mode, SelfAttentionConfig, TanhGate, Weights,
};

use crate::config::{DecoderConfig, Dropouts, NormPlacement};
use crate::error::Result;
use vl_attn::LayerNorm;

/// The cross-attention branch of a block.
#[derive(Debug, Clone)]
pub struct CrossBranch {
    /// Pre-norm of the branch.
    pub cross_attn_norm: LayerNorm,
    /// Text queries over image keys and values.
    pub cross_attn: CrossAttention,
    /// Flamingo's tanh gate, when configured.
    pub gate: Option<TanhGate>,
    /// Flamingo's gated feed-forward after the cross-attention, when
    /// configured (`gated_cross_ffn`).
    pub ffn: Option<GatedFeedForward>,
}

/// A feed-forward branch behind a tanh gate (zero-initialised, so that it
/// starts closed): `x += tanh(gate) * ffn(ffn_norm(x))`.
#[derive(Debug, Clone)]
pub struct GatedFeedForward {
    /// Pre-norm of the branch.
    pub ffn_norm: LayerNorm,
    /// The feed-forward layer.
    pub ffn: FeedForward,
    /// The gate.
    pub gate: TanhGate,
}

impl GatedFeedForward {
    /// Loads `cross_ffn_norm`, `cross_ffn.{up,down}` and `cross_ffn_gate`
    /// under `vb`, with the decoder's widths and activation.
    pub fn load(vb: VarBuilder, cfg: &DecoderConfig) -> Result<Self> {
        Ok(Self {
            ffn_norm: layer_norm(vb.pp("cross_ffn_norm"), cfg)?,
            ffn: FeedForward::load(
                vb.pp("cross_ffn"),
                cfg.hidden_size,
                cfg.intermediate_size,
                cfg.hidden_act,
            )?,
            gate: TanhGate::load(vb, "cross_ffn_gate", 1)?,
        })
    }

    /// `tanh(gate) * ffn(ffn_norm(x))`, the branch's residual update
    /// (pre-LN).
    ///
    /// # Shapes
    /// `x: (batch, len, hidden)` → `(batch, len, hidden)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.update(&self.ffn_norm.forward(x)?)
    }

    /// `tanh(gate) * ffn(h)`, the update of an input already normed (or
    /// not, post-LN).
    fn update(&self, h: &Tensor) -> Result<Tensor> {
        Ok(self.gate.forward(&self.ffn.forward(h)?)?)
    }
}

/// What a block reads besides its input.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockInputs<'a> {
    /// Self-attention key mask, `(batch | 1, len | 1, keys)`, over every key
    /// including cached ones (e.g. left padding); combined with causality.
    pub text_mask: Option<&'a Mask>,
    /// Cross-attention mask, `(batch | 1, len | 1, image_len)`.
    pub image_mask: Option<&'a Mask>,
    /// Return this block's cross-attention weights.
    pub want_weights: bool,
}

/// Where a block's cross-attention reads the image from.
#[derive(Debug, Clone, Copy)]
pub enum ImageInput<'a> {
    /// No image: the cross-attention branch is skipped.
    None,
    /// Image tokens `(batch, image_len, memory_dim)`, projected on the spot.
    Memory(&'a Tensor),
    /// Keys and values projected once by [`DecoderBlock::project_image`].
    Cached(&'a CrossKv),
}

/// A decoder block, pre-LN or post-LN; norms are named by role.
#[derive(Debug, Clone)]
pub struct DecoderBlock {
    placement: NormPlacement,
    self_attn_norm: LayerNorm,
    self_attn: CausalSelfAttention,
    cross: Option<CrossBranch>,
    ffn_norm: LayerNorm,
    ffn: FeedForward,
    /// On each branch before it is added back, in training.
    resid_dropout: Dropout,
    mode: Mode,
}

pub(crate) fn layer_norm(vb: VarBuilder, cfg: &DecoderConfig) -> Result<LayerNorm> {
    Ok(LayerNorm::load(cfg.hidden_size, cfg.layer_norm_eps, vb)?)
}

impl DecoderBlock {
    /// Loads block `layer` under `vb`: `self_attn_norm`, `self_attn.*`,
    /// `cross_attn_norm`, `cross_attn.*`, `cross_attn_gate` (gated only),
    /// `cross_ffn_norm`, `cross_ffn.*`, `cross_ffn_gate` (`gated_cross_ffn`
    /// only), `ffn_norm`, `ffn.*`.
    pub fn load(vb: VarBuilder, cfg: &DecoderConfig, layer: usize) -> Result<Self> {
        let self_cfg = SelfAttentionConfig {
            hidden: cfg.hidden_size,
            num_heads: cfg.num_attention_heads,
            num_kv_heads: cfg.kv_heads(),
            bias: cfg.attention_bias,
        };
        let cross = if cfg.has_cross_attention(layer) {
            let cross_cfg = CrossAttentionConfig {
                num_kv_heads: cfg.kv_heads(),
                bias: cfg.attention_bias,
                ..CrossAttentionConfig::new(
                    cfg.hidden_size,
                    cfg.memory_dim,
                    cfg.num_attention_heads,
                )
            };
            Some(CrossBranch {
                cross_attn_norm: layer_norm(vb.pp("cross_attn_norm"), cfg)?,
                cross_attn: CrossAttention::load(vb.pp("cross_attn"), &cross_cfg)?,
                gate: if cfg.gated_cross_attention {
                    Some(TanhGate::load(vb.clone(), "cross_attn_gate", 1)?)
                } else {
                    None
                },
                ffn: if cfg.gated_cross_ffn {
                    Some(GatedFeedForward::load(vb.clone(), cfg)?)
                } else {
                    None
                },
            })
        } else {
            None
        };
        let block = Self {
            placement: cfg.norm_placement,
            self_attn_norm: layer_norm(vb.pp("self_attn_norm"), cfg)?,
            self_attn: CausalSelfAttention::load(vb.pp("self_attn"), &self_cfg)?,
            cross,
            ffn_norm: layer_norm(vb.pp("ffn_norm"), cfg)?,
            ffn: FeedForward::load(
                vb.pp("ffn"),
                cfg.hidden_size,
                cfg.intermediate_size,
                cfg.hidden_act,
            )?,
            resid_dropout: Dropout::NONE,
            mode: Mode::Inference,
        };
        Ok(block.with_dropouts(cfg.dropouts()?))
    }

    /// Adds the block's tensors under `prefix`, by the names
    /// [`DecoderBlock::load`] reads (see [`vl_attn::named`]).
    pub fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        use vl_attn::named::join;
        self.self_attn_norm
            .named_tensors(&join(prefix, "self_attn_norm"), out);
        self.self_attn
            .named_tensors(&join(prefix, "self_attn"), out)?;
        if let Some(c) = &self.cross {
            c.cross_attn_norm
                .named_tensors(&join(prefix, "cross_attn_norm"), out);
            c.cross_attn
                .named_tensors(&join(prefix, "cross_attn"), out)?;
            if let Some(g) = &c.gate {
                out.insert(join(prefix, "cross_attn_gate"), g.alpha().clone());
            }
            if let Some(f) = &c.ffn {
                f.ffn_norm
                    .named_tensors(&join(prefix, "cross_ffn_norm"), out);
                f.ffn.named_tensors(&join(prefix, "cross_ffn"), out)?;
                out.insert(join(prefix, "cross_ffn_gate"), f.gate.alpha().clone());
            }
        }
        self.ffn_norm.named_tensors(&join(prefix, "ffn_norm"), out);
        self.ffn.named_tensors(&join(prefix, "ffn"), out)?;
        Ok(())
    }

    /// Builds a pre-LN block from existing parts (checkpoint converters),
    /// without dropout (see [`DecoderBlock::with_dropouts`]; a post-LN block
    /// with [`DecoderBlock::with_norm_placement`]).
    pub fn from_parts(
        self_attn_norm: LayerNorm,
        self_attn: CausalSelfAttention,
        cross: Option<CrossBranch>,
        ffn_norm: LayerNorm,
        ffn: FeedForward,
    ) -> Self {
        Self {
            placement: NormPlacement::Pre,
            self_attn_norm,
            self_attn,
            cross,
            ffn_norm,
            ffn,
            resid_dropout: Dropout::NONE,
            mode: Mode::Inference,
        }
    }

    /// Places the block's norms before (the default) or after each
    /// residual add; the weights stay the same.
    pub fn with_norm_placement(mut self, placement: NormPlacement) -> Self {
        self.placement = placement;
        self
    }

    /// Where the block's norms sit.
    pub fn norm_placement(&self) -> NormPlacement {
        self.placement
    }

    /// The input of a branch whose norm is `norm`: `norm(x)` pre-LN, `x`
    /// post-LN.
    fn branch_input(&self, norm: &LayerNorm, x: &Tensor) -> Result<Tensor> {
        match self.placement {
            NormPlacement::Pre => Ok(norm.forward(x)?),
            NormPlacement::Post => Ok(x.clone()),
        }
    }

    /// `x + dropout(update)`, then `norm` of that post-LN.
    fn add_branch(&self, norm: &LayerNorm, x: &Tensor, update: &Tensor) -> Result<Tensor> {
        // vl's addition for bf16 on CPU (candle's otherwise): the same sums.
        let y = vl_attn::kernels::add::add(x, &self.residual(update)?)?;
        match self.placement {
            NormPlacement::Pre => Ok(y),
            NormPlacement::Post => Ok(norm.forward(&y)?),
        }
    }

    /// Sets the attention dropout of both attentions and the residual
    /// dropout of every branch; they act only in training.
    pub fn with_dropouts(mut self, dropouts: Dropouts) -> Self {
        self.self_attn = self.self_attn.with_attention_dropout(dropouts.attention);
        if let Some(c) = &mut self.cross {
            c.cross_attn = c
                .cross_attn
                .clone()
                .with_attention_dropout(dropouts.attention);
        }
        self.resid_dropout = dropouts.residual;
        self
    }

    /// Switches between training (dropout on, masks from the mode's
    /// generator) and inference (the default: dropout off).
    ///
    /// Also ends a [`DecoderBlock::set_cross_map_dropout`]: the
    /// cross-attention gets the config's attention dropout back.
    pub fn set_mode(&mut self, mode: Mode) {
        let attention = self.self_attn.attention_dropout();
        self.self_attn.set_mode(mode.clone());
        if let Some(c) = &mut self.cross {
            c.cross_attn = c.cross_attn.clone().with_attention_dropout(attention);
            c.cross_attn.set_mode(mode.clone());
        }
        self.mode = mode;
    }

    /// Drops entries of the cross-attention map whatever the block's mode:
    /// each query's weights over the image tokens are zeroed with
    /// probability `dropout.p()` and the kept ones scaled by `1 / (1 - p)`,
    /// masks drawn from `rng`. Self-attention, residual and embedding
    /// dropout keep following the mode, so in inference this changes only
    /// what each text position reads from the image — dropout on the
    /// query side of the map at sampling time. Ended by
    /// [`DecoderBlock::set_mode`]; a block without cross-attention is left
    /// as it is.
    pub fn set_cross_map_dropout(&mut self, dropout: Dropout, rng: DropoutRng) {
        if let Some(c) = &mut self.cross {
            c.cross_attn = c.cross_attn.clone().with_attention_dropout(dropout);
            c.cross_attn.set_mode(Mode::Training(rng));
        }
    }

    /// The current mode.
    pub fn mode(&self) -> &Mode {
        &self.mode
    }

    /// A branch's update after the residual dropout.
    fn residual(&self, branch: &Tensor) -> Result<Tensor> {
        Ok(self.resid_dropout.forward(branch, &self.mode)?)
    }

    /// A copy with every projection (self-attention, cross-attention,
    /// feed-forward) quantized to `format`; norms and gates stay dense.
    ///
    /// # Errors
    /// [`vl_attn::AttnError::Quantize`] naming the first projection that
    /// cannot be quantized, e.g. `cross_attn.k_proj`.
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        // In block order, so that the first failing layer is named.
        let self_attn = self.self_attn.quantize(q.within("self_attn"))?;
        let cross = match &self.cross {
            None => None,
            Some(c) => Some(CrossBranch {
                cross_attn: c.cross_attn.quantize(q.within("cross_attn"))?,
                ffn: match &c.ffn {
                    None => None,
                    Some(f) => Some(GatedFeedForward {
                        ffn: f.ffn.quantize(q.within("cross_ffn"))?,
                        ..f.clone()
                    }),
                },
                ..c.clone()
            }),
        };
        Ok(Self {
            self_attn,
            cross,
            ffn: self.ffn.quantize(q.within("ffn"))?,
            ..self.clone()
        })
    }

    /// The cross-attention branch, if the block has one.
    pub fn cross_branch(&self) -> Option<&CrossBranch> {
        self.cross.as_ref()
    }

    /// Whether the block has a cross-attention branch.
    pub fn has_cross_attention(&self) -> bool {
        self.cross.is_some()
    }

    /// Sets the attention implementation of both attentions.
    pub fn set_backend(&mut self, backend: vl_attn::Backend) {
        self.self_attn = self.self_attn.clone().with_backend(backend);
        if let Some(c) = &mut self.cross {
            c.cross_attn = c.cross_attn.clone().with_backend(backend);
        }
    }

    /// Keeps the self-attention's keys and values in `dtype` (`None`: the
    /// activations', the default); see
    /// [`vl_attn::CausalSelfAttention::with_cache_dtype`].
    pub fn set_text_cache_dtype(&mut self, dtype: Option<DType>) {
        self.self_attn = self.self_attn.clone().with_cache_dtype(dtype);
    }

    /// Keeps the image's keys and values in `dtype` (see
    /// [`vl_attn::CrossAttention::with_memory_dtype`]); nothing for a
    /// block without cross-attention.
    pub fn set_image_cache_dtype(&mut self, dtype: Option<DType>) {
        if let Some(c) = &mut self.cross {
            c.cross_attn = c.cross_attn.clone().with_memory_dtype(dtype);
        }
    }

    /// The dtype the self-attention's keys and values are kept in, `None`
    /// for the activations'.
    pub fn text_cache_dtype(&self) -> Option<DType> {
        self.self_attn.cache_dtype()
    }

    /// The image's keys and values for this block, `None` for a block
    /// without cross-attention.
    ///
    /// # Shapes
    /// `image: (batch, image_len, memory_dim)`.
    pub fn project_image(&self, image: &Tensor) -> Result<Option<CrossKv>> {
        match &self.cross {
            None => Ok(None),
            Some(c) => Ok(Some(c.cross_attn.project_memory(image)?)),
        }
    }

    /// The block's cross-attention, `None` for a block without one.
    pub fn cross_attention(&self) -> Option<&CrossAttention> {
        self.cross.as_ref().map(|c| &c.cross_attn)
    }

    /// Runs the block; with `cache`, the new tokens' keys and values are
    /// appended to it and attend to the cached ones.
    ///
    /// # Shapes
    /// `x: (batch, len, hidden)` → `(batch, len, hidden)`, and the
    /// cross-attention weights `(batch, heads, len, image_len)` when asked
    /// for and the block has cross-attention.
    ///
    /// # Errors
    /// Asking for weights from a block set to [`vl_attn::Backend::Fused`]
    /// is an error naming `backend` (the fused path has no weights).
    pub fn forward(
        &self,
        x: &Tensor,
        image: ImageInput<'_>,
        cache: Option<&mut KvCache>,
        inputs: BlockInputs<'_>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let want = if inputs.want_weights {
            Weights::Return
        } else {
            Weights::Skip
        };
        let self_attn = |h: &Tensor| {
            Ok(self
                .self_attn
                .attend(h, cache, inputs.text_mask, Weights::Skip)?
                .output)
        };
        let kv;
        let kv = match (&self.cross, image) {
            (_, ImageInput::None) | (None, _) => None,
            (Some(_), ImageInput::Cached(kv)) => Some(kv),
            (Some(c), ImageInput::Memory(m)) => {
                kv = c.cross_attn.project_memory(m)?;
                Some(&kv)
            }
        };
        let cross = kv.map(|kv| {
            move |attn: &CrossAttention, q: &Tensor| {
                let out = attn.attend(q, kv, inputs.image_mask, want)?;
                Ok((out.output, vec![out.weights]))
            }
        });
        let (y, mut weights) = self.run(x, self_attn, cross)?;
        Ok((y, weights.pop().flatten()))
    }

    /// [`DecoderBlock::forward`] over rows in groups that decode at
    /// different positions and read different images, each group with its
    /// own cache (e.g. requests that joined a running batch at different
    /// steps): the projections and feed-forwards run once over every row,
    /// the attentions group by group. Either every group reads an image or
    /// none does. Each row's output is what [`DecoderBlock::forward`] gives
    /// it in its group alone, up to the products' rounding for another row
    /// count.
    ///
    /// # Shapes
    /// `x: (rows, len, hidden)`, `rows` the sum of the groups' rows in
    /// their order → `(rows, len, hidden)`, and per group its
    /// cross-attention weights `(rows, heads, len, image_len)` when
    /// `want_weights` and the block reads an image.
    ///
    /// # Errors
    /// [`crate::DecoderError::Argument`] naming `groups` when some groups
    /// read an image and others do not; attention errors.
    pub fn forward_groups(
        &self,
        x: &Tensor,
        groups: &mut [BlockGroup<'_>],
        want_weights: bool,
    ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        let want = if want_weights {
            Weights::Return
        } else {
            Weights::Skip
        };
        let with_image = groups.iter().filter(|g| g.image.is_some()).count();
        if with_image != 0 && with_image != groups.len() {
            return crate::error::arg_err(
                "groups",
                format!(
                    "{with_image} of {} groups read an image: every group or none must",
                    groups.len()
                ),
            );
        }
        let cross_groups: Vec<CrossGroup<'_>> = groups
            .iter()
            .filter_map(|g| {
                g.image.map(|kv| CrossGroup {
                    rows: g.rows,
                    kv,
                    mask: g.image_mask,
                })
            })
            .collect();
        let mut caches: Vec<CacheGroup<'_>> = groups
            .iter_mut()
            .map(|g| CacheGroup {
                rows: g.rows,
                cache: &mut *g.cache,
                key_mask: None,
            })
            .collect();
        let self_attn = |h: &Tensor| {
            Ok(self
                .self_attn
                .attend_groups(h, &mut caches, Weights::Skip)?
                .output)
        };
        let cross = (!cross_groups.is_empty()).then_some(|attn: &CrossAttention, q: &Tensor| {
            let out = attn.attend_groups(q, &cross_groups, want)?;
            Ok((out.output, out.weights))
        });
        let (y, weights) = self.run(x, self_attn, cross)?;
        let weights = if weights.is_empty() {
            vec![None; groups.len()]
        } else {
            weights
        };
        Ok((y, weights))
    }

    /// The block's branches in order, the self-attention and the
    /// cross-attention (over whichever images) given by the caller; the
    /// cross branch returns its output and its weights per group.
    fn run(
        &self,
        x: &Tensor,
        self_attn: impl FnOnce(&Tensor) -> Result<Tensor>,
        cross: Option<
            impl FnOnce(&CrossAttention, &Tensor) -> Result<(Tensor, Vec<Option<Tensor>>)>,
        >,
    ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        let h = self_attn(&self.branch_input(&self.self_attn_norm, x)?)?;
        let mut x = self.add_branch(&self.self_attn_norm, x, &h)?;
        let mut weights = Vec::new();
        if let (Some(c), Some(cross)) = (&self.cross, cross) {
            let q = self.branch_input(&c.cross_attn_norm, &x)?;
            let (out, w) = cross(&c.cross_attn, &q)?;
            weights = w;
            let out = match &c.gate {
                Some(g) => g.forward(&out)?,
                None => out,
            };
            x = self.add_branch(&c.cross_attn_norm, &x, &out)?;
            if let Some(f) = &c.ffn {
                let update = f.update(&self.branch_input(&f.ffn_norm, &x)?)?;
                x = self.add_branch(&f.ffn_norm, &x, &update)?;
            }
        }
        let h = self.ffn.forward(&self.branch_input(&self.ffn_norm, &x)?)?;
        Ok((self.add_branch(&self.ffn_norm, &x, &h)?, weights))
    }
}

/// One group of rows of [`DecoderBlock::forward_groups`].
#[derive(Debug)]
pub struct BlockGroup<'a> {
    /// Rows of the group.
    pub rows: usize,
    /// The image keys and values its rows read (its rows a multiple of
    /// their batch), `None` for none.
    pub image: Option<&'a CrossKv>,
    /// Its text cache.
    pub cache: &'a mut KvCache,
    /// Its cross-attention mask, `(rows | 1, len | 1, image_len)`.
    pub image_mask: Option<&'a Mask>,
}

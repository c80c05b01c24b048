//! Self-attention: bidirectional ([`SelfAttention`], for encoders such as a
//! ViT) and causal with a text key/value cache ([`CausalSelfAttention`]).
//! Both share [`SelfAttentionConfig`] and the projection core.

use crate::quantize::Quantizer;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use crate::attention::{AttnOutput, Backend, GroupedOutput, Weights};
use crate::cache::KvCache;
use crate::dropout::{Dropout, Mode};
use crate::error::{AttnError, Result};
use crate::heads::{AttnCore, CoreDims, GroupKv};
use crate::mask::{self, Mask};
use crate::proj::Proj;

/// The sizes of a [`SelfAttention`] or a [`CausalSelfAttention`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelfAttentionConfig {
    /// Width of the input and output.
    pub hidden: usize,
    /// Query heads; divides `hidden`.
    pub num_heads: usize,
    /// Key/value heads; divides `num_heads`.
    pub num_kv_heads: usize,
    /// Whether the projections have biases.
    pub bias: bool,
}

impl SelfAttentionConfig {
    /// Multi-head attention with biases.
    pub fn new(hidden: usize, num_heads: usize) -> Self {
        Self {
            hidden,
            num_heads,
            num_kv_heads: num_heads,
            bias: true,
        }
    }

    /// Rejects impossible sizes before any tensor is built.
    pub fn validate(&self) -> Result<()> {
        self.dims("SelfAttention").layout().map(|_| ())
    }

    fn dims(&self, module: &'static str) -> CoreDims {
        CoreDims {
            module,
            query_dim: self.hidden,
            kv_dim: self.hidden,
            inner: self.hidden,
            out: self.hidden,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            bias: self.bias,
        }
    }
}

/// The constructors, quantization and backend of a self-attention type,
/// written once over its core.
macro_rules! self_attention_common {
    ($ty:ident, $module:literal) => {
        impl $ty {
            /// Loads or initialises the projections under `vb`
            /// (`q_proj`, `k_proj`, `v_proj`, `o_proj`).
            pub fn load(vb: VarBuilder, cfg: &SelfAttentionConfig) -> Result<Self> {
                Ok(Self::assemble(
                    AttnCore::load(vb, &cfg.dims($module))?,
                    cfg.clone(),
                ))
            }

            /// Builds from existing projections, dense layers (e.g. split
            /// from a fused `c_attn`) or [`Proj`]s of any format; their
            /// shapes must match `cfg`.
            pub fn from_parts(
                q_proj: impl Into<Proj>,
                k_proj: impl Into<Proj>,
                v_proj: impl Into<Proj>,
                o_proj: impl Into<Proj>,
                cfg: &SelfAttentionConfig,
            ) -> Result<Self> {
                Ok(Self::assemble(
                    AttnCore::from_projs(
                        [q_proj.into(), k_proj.into(), v_proj.into(), o_proj.into()],
                        &cfg.dims($module),
                    )?,
                    cfg.clone(),
                ))
            }

            /// A copy with the four projections quantized to `format` (e.g.
            /// [`GgmlDType::Q8_0`]); activations keep their dtype.
            ///
            /// # Errors
            /// [`crate::AttnError::Quantize`] naming `q_proj` when `hidden`
            /// is not a multiple of the format's block size (32 for `q8_0`,
            /// 256 for `q4k`).
            pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
                let q: Quantizer = q.into();
                let mut quantized = self.clone();
                quantized.core = self.core.quantize(&q)?;
                Ok(quantized.kept_for(&q))
            }

            /// Adds `q_proj`, `k_proj`, `v_proj` and `o_proj` under
            /// `prefix` (see [`crate::named`]).
            pub fn named_tensors(&self, prefix: &str, out: &mut crate::named::Named) -> Result<()> {
                self.core.named_tensors(prefix, out)
            }

            /// The quantized format of the projections, `None` when dense.
            pub fn quantization(&self) -> Option<GgmlDType> {
                self.core.quantization()
            }

            /// Chooses the attention implementation (the default is
            /// [`Backend::Auto`]).
            pub fn with_backend(mut self, backend: Backend) -> Self {
                self.core.set_backend(backend);
                self
            }

            /// The attention implementation in use.
            pub fn backend(&self) -> Backend {
                self.core.backend()
            }

            /// Sets the dropout on the attention probabilities (default
            /// [`Dropout::NONE`]); it acts only in [`Mode::Training`], where
            /// [`Backend::Auto`] takes the reference path and [`Backend::Fused`]
            /// is refused (see [`crate::attention::attention_with_dropout`]).
            pub fn with_attention_dropout(mut self, dropout: Dropout) -> Self {
                self.core.set_attn_dropout(dropout);
                self
            }

            /// The dropout on the attention probabilities.
            pub fn attention_dropout(&self) -> Dropout {
                self.core.attn_dropout()
            }

            /// Switches between training (dropout on, masks from the mode's
            /// generator) and inference (the default: dropout off).
            pub fn set_mode(&mut self, mode: Mode) {
                self.core.set_mode(mode);
            }

            /// The current mode.
            pub fn mode(&self) -> &Mode {
                self.core.mode()
            }

            /// The sizes this module was built with.
            pub fn config(&self) -> &SelfAttentionConfig {
                &self.cfg
            }

            /// Checks `x (b, t, hidden)` and projects it: queries `(b,
            /// heads, t, hd)`, keys and values `(b, kv_heads, t, hd)`.
            fn project(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor, usize, usize)> {
                let (b, t) = self.core.check_input("x", x, self.cfg.hidden, "hidden")?;
                let q = self.core.queries(x, b, t)?;
                let (k, v) = self.core.keys_values(x, b, t)?;
                Ok((q, k, v, b, t))
            }
        }
    };
}

/// Bidirectional multi-head self-attention (grouped-query when
/// `num_kv_heads < num_heads`): every token attends to every token the key
/// mask allows, before or after it. For encoders (a ViT's blocks).
///
/// Weights: `q_proj (hidden, hidden)`, `k_proj`, `v_proj (kv_inner,
/// hidden)`, `o_proj (hidden, hidden)`, with biases when configured; dense
/// or, after [`SelfAttention::quantize`], quantized.
#[derive(Debug, Clone)]
pub struct SelfAttention {
    core: AttnCore,
    cfg: SelfAttentionConfig,
}

self_attention_common!(SelfAttention, "SelfAttention");

impl SelfAttention {
    fn assemble(core: AttnCore, cfg: SelfAttentionConfig) -> Self {
        Self { core, cfg }
    }

    /// Nothing is kept between calls: quantizing changes no storage.
    fn kept_for(self, _: &Quantizer) -> Self {
        self
    }

    /// Self-attention of `x` over itself; with [`Weights::Return`], also the
    /// attention weights per head.
    ///
    /// # Shapes
    /// - `x: (batch, len, hidden)`
    /// - `key_mask: (batch | 1, len | 1, len)`, `1` = may attend (e.g.
    ///   [`Mask::from_keys`] of a right-padding mask)
    /// - returns `output (batch, len, hidden)` and `weights (batch, heads,
    ///   len, len)`
    pub fn attend(
        &self,
        x: &Tensor,
        key_mask: Option<&Mask>,
        weights: Weights,
    ) -> Result<AttnOutput> {
        let (q, k, v, b, t) = self.project(x)?;
        if let Some(m) = key_mask {
            m.check(b, t, t)?;
        }
        self.core.attend(&q, &k, &v, key_mask, weights, b, t)
    }

    /// [`SelfAttention::attend`] without the weights.
    ///
    /// # Shapes
    /// `x: (batch, len, hidden)`, `key_mask: (batch | 1, len | 1, len)` →
    /// `(batch, len, hidden)`.
    pub fn forward(&self, x: &Tensor, key_mask: Option<&Mask>) -> Result<Tensor> {
        Ok(self.attend(x, key_mask, Weights::Skip)?.output)
    }
}

/// Causal multi-head self-attention (grouped-query when `num_kv_heads <
/// num_heads`).
///
/// Weights: `q_proj (hidden, hidden)`, `k_proj`, `v_proj (kv_inner,
/// hidden)`, `o_proj (hidden, hidden)`, with biases when configured. The
/// projections are dense or, after [`CausalSelfAttention::quantize`],
/// quantized.
#[derive(Debug, Clone)]
pub struct CausalSelfAttention {
    core: AttnCore,
    cfg: SelfAttentionConfig,
    /// The dtype keys and values are kept in, when not the activations'
    /// (see [`CausalSelfAttention::with_cache_dtype`]).
    cache_dtype: Option<DType>,
}

self_attention_common!(CausalSelfAttention, "CausalSelfAttention");

impl CausalSelfAttention {
    fn assemble(core: AttnCore, cfg: SelfAttentionConfig) -> Self {
        Self {
            core,
            cfg,
            cache_dtype: None,
        }
    }

    /// After quantizing with `q`: keys and values kept as
    /// [`crate::CrossAttention::quantize`] keeps an image's (under f32
    /// activations on the CPU, [`Quantizer::kv_dtype`]: q8 rows for the
    /// integer formats where heads allow, bf16 for bf16 weights, f16 for
    /// f16 weights), unless a dtype was chosen.
    fn kept_for(mut self, q: &Quantizer) -> Self {
        self.cache_dtype = self.cache_dtype.or_else(|| {
            q.kv_dtype(
                self.core.dtype(),
                self.core.device(),
                self.core.heads().head_dim,
            )
        });
        self
    }

    /// Keeps keys and values in `dtype` (a 16-bit float under f32
    /// activations; `None`: the activations' dtype, the default), in the
    /// cache and without one alike, so that a cached step computes what an
    /// uncached pass does; kept through [`CausalSelfAttention::quantize`],
    /// which, when none was chosen, keeps them under f32 activations on the
    /// CPU as [`Quantizer::kv_dtype`] says (q8 rows for the integer formats
    /// where the head width is a multiple of 32, else bf16; bf16 for bf16
    /// weights, f16 for f16 weights: as [`crate::CrossAttention::quantize`]
    /// keeps an image's). `U8` keeps them as q8 rows ([`crate::quantize_kv`]:
    /// f32 activations, a head width that is a multiple of 32), about half
    /// of bf16's bytes. Attention widens them as it reads them (vl's CPU
    /// kernel in place, other paths by a cast or [`crate::widen_kv`]).
    ///
    /// A decode step then reads half the bytes of its text cache: at
    /// position 1,000 of a 1024-wide, 4-layer decoder (Nougat's) 16 MB
    /// instead of 33, beside 126 MB of `q8_0` weights; at 3,000 it is the
    /// larger part of a step. The rounding moves logits by about what
    /// bf16 keys and values do in transformers' bf16 model: under `q8_0`
    /// weights, top-1 agreement with f32 over 1,024 teacher-forced
    /// positions of vit-gpt2 is the same with an f32 and a bf16 cache
    /// (BENCHMARKS.md, "The text cache follows the weights").
    pub fn with_cache_dtype(mut self, dtype: Option<DType>) -> Self {
        self.cache_dtype = dtype;
        self
    }

    /// The dtype keys and values are kept in, `None` for the activations'.
    pub fn cache_dtype(&self) -> Option<DType> {
        self.cache_dtype
    }

    /// An empty cache sized for `capacity` tokens.
    ///
    /// # Errors
    /// As [`KvCache::new`]: `capacity` past [`KvCache::MAX_CAPACITY`].
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        KvCache::new(capacity)
    }

    /// Causal self-attention of the new tokens `x`; with [`Weights::Return`],
    /// also the attention weights per head.
    ///
    /// Without a cache, over `x` alone. With `cache` holding `p` tokens, over
    /// the cached tokens and themselves: new query `i` sees keys `0..=p + i`,
    /// and the new keys and values are appended to `cache`.
    ///
    /// # Shapes
    /// - `x: (batch, new, hidden)`
    /// - `key_mask: (batch | 1, new | 1, p + new)`, `1` = may attend, over
    ///   every key after the append (e.g. [`Mask::from_keys`] of a
    ///   left-padding mask); it is combined with the causal mask
    /// - returns `output (batch, new, hidden)` and `weights (batch, heads,
    ///   new, p + new)`
    pub fn attend(
        &self,
        x: &Tensor,
        cache: Option<&mut KvCache>,
        key_mask: Option<&Mask>,
        weights: Weights,
    ) -> Result<AttnOutput> {
        let (q, k, v, b, t) = self.project_kept(x)?;
        let group = cached_group(b, t, k, v, cache, key_mask, x.device())?;
        let mut out = self.core.attend_groups(&q, &[group], weights, t)?;
        Ok(AttnOutput {
            output: out.output,
            weights: out.weights.pop().flatten(),
        })
    }

    /// [`CausalSelfAttention::attend`] for rows in groups that decode at
    /// different positions, each with its own cache (e.g. requests that
    /// joined a running batch at different steps): the projections run
    /// once over every row, the attention group by group over each cache.
    /// Each row's output is what [`CausalSelfAttention::attend`] gives it in
    /// its group alone, up to the products' rounding for another row count.
    ///
    /// # Shapes
    /// - `x: (rows, new, hidden)`, `rows` the sum of the groups' rows, in
    ///   their order
    /// - each group's `key_mask`: `(rows | 1, new | 1, p + new)` over its
    ///   keys after the append (`p` = its cache's length)
    /// - returns `output (rows, new, hidden)` and, per group, `weights
    ///   (rows, heads, new, p + new)`
    ///
    /// # Errors
    /// As [`CausalSelfAttention::attend`]; [`AttnError::Argument`] naming
    /// `groups` when there is none or their rows do not add up to `x`'s.
    /// Shapes and masks are checked before any cache is appended to; a
    /// cache whose buffer does not fit its group's keys fails its own
    /// append, after the groups before it appended theirs.
    pub fn attend_groups(
        &self,
        x: &Tensor,
        groups: &mut [CacheGroup<'_>],
        weights: Weights,
    ) -> Result<GroupedOutput> {
        let (q, k, v, b, t) = self.project_kept(x)?;
        check_group_rows(groups.iter().map(|g| g.rows), b)?;
        for g in groups.iter() {
            if let Some(m) = g.key_mask {
                m.check(g.rows, t, g.cache.len() + t)?;
            }
        }
        let mut parts = Vec::with_capacity(groups.len());
        let mut start = 0;
        for g in groups.iter_mut() {
            let (k, v) = (k.narrow(0, start, g.rows)?, v.narrow(0, start, g.rows)?);
            start += g.rows;
            parts.push(cached_group(
                g.rows,
                t,
                k,
                v,
                Some(&mut *g.cache),
                g.key_mask,
                x.device(),
            )?);
        }
        self.core.attend_groups(&q, &parts, weights, t)
    }

    /// [`Self::project`], keys and values in the cache's dtype.
    fn project_kept(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor, usize, usize)> {
        let (q, k, v, b, t) = self.project(x)?;
        match self.cache_dtype {
            Some(DType::U8) => Ok((q, crate::quantize_kv(&k)?, crate::quantize_kv(&v)?, b, t)),
            Some(dtype) if dtype != k.dtype() => {
                Ok((q, k.to_dtype(dtype)?, v.to_dtype(dtype)?, b, t))
            }
            _ => Ok((q, k, v, b, t)),
        }
    }

    /// [`CausalSelfAttention::attend`] over `x` alone, without the weights.
    ///
    /// # Shapes
    /// `x: (batch, len, hidden)`, `key_mask: (batch | 1, len | 1, len)` →
    /// `(batch, len, hidden)`.
    pub fn forward(&self, x: &Tensor, key_mask: Option<&Mask>) -> Result<Tensor> {
        Ok(self.attend(x, None, key_mask, Weights::Skip)?.output)
    }
}

/// One group of rows of [`CausalSelfAttention::attend_groups`]: how many,
/// their cache and their key mask.
#[derive(Debug)]
pub struct CacheGroup<'a> {
    /// Rows of the group.
    pub rows: usize,
    /// Its keys and values so far, `(rows, kv_heads, p, head_dim)`.
    pub cache: &'a mut KvCache,
    /// Its key mask, combined with causality.
    pub key_mask: Option<&'a Mask>,
}

/// Checks that groups of `rows` add up to `total` rows, with at least one
/// group.
pub(crate) fn check_group_rows(rows: impl Iterator<Item = usize>, total: usize) -> Result<()> {
    let (mut n, mut sum) = (0usize, 0usize);
    for r in rows {
        n += 1;
        sum = sum.saturating_add(r);
    }
    if n == 0 || sum != total {
        return Err(AttnError::Argument {
            arg: "groups",
            reason: format!(
                "expected groups whose rows add up to {total}, got {n} groups of {sum} rows"
            ),
        });
    }
    Ok(())
}

/// A group's keys and values after appending the new ones to its cache
/// (if any), and its mask: causality after the cached keys, and'ed with
/// the key mask (checked against the keys after the append).
fn cached_group(
    rows: usize,
    t: usize,
    k: Tensor,
    v: Tensor,
    cache: Option<&mut KvCache>,
    key_mask: Option<&Mask>,
    device: &Device,
) -> Result<GroupKv> {
    let offset = cache.as_ref().map_or(0, |c| c.len());
    if let Some(m) = key_mask {
        m.check(rows, t, offset + t)?;
    }
    let (k, v) = match cache {
        Some(cache) => cache.append(&k, &v)?,
        None => (k, v),
    };
    Ok(GroupKv {
        rows,
        k,
        v,
        mask: combined_mask(t, offset, key_mask, device)?,
    })
}

/// The causal mask for `t` queries after `offset` keys, and'ed with the
/// caller's key mask; `None` when nothing is masked (one new query and no
/// key mask), so that a decode step builds no mask.
fn combined_mask(
    t: usize,
    offset: usize,
    key_mask: Option<&Mask>,
    device: &Device,
) -> Result<Option<Mask>> {
    if t == 1 {
        return Ok(key_mask.cloned());
    }
    let causal = Mask::new(mask::causal_with_offset(t, offset, device)?)?;
    Ok(Some(match key_mask {
        None => causal,
        Some(m) => causal.and(m)?,
    }))
}

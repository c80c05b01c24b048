//! Causal self-attention with a text key/value cache.

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor};
use candle_nn::{Linear, Module, VarBuilder};

use crate::cache::KvCache;
use crate::error::{check_dtype_device, Result};
use crate::kernel::{self, Backend};
use crate::linear::Proj;
use crate::mask::{self, Mask};
use crate::proj::{check_input, merge_heads, silence_unattending, split_heads, HeadLayout};

/// The sizes of a [`CausalSelfAttention`].
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
        HeadLayout::new(
            "CausalSelfAttention",
            self.hidden,
            self.num_heads,
            self.num_kv_heads,
        )
        .map(|_| ())
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
    q_proj: Proj,
    k_proj: Proj,
    v_proj: Proj,
    o_proj: Proj,
    heads: HeadLayout,
    cfg: SelfAttentionConfig,
    backend: Backend,
}

impl CausalSelfAttention {
    /// Loads or initialises the projections under `vb`
    /// (`q_proj`, `k_proj`, `v_proj`, `o_proj`).
    pub fn load(vb: VarBuilder, cfg: &SelfAttentionConfig) -> Result<Self> {
        cfg.validate()?;
        let heads = HeadLayout::new(
            "CausalSelfAttention",
            cfg.hidden,
            cfg.num_heads,
            cfg.num_kv_heads,
        )?;
        let lin = |o, name| candle_nn::linear_b(cfg.hidden, o, cfg.bias, vb.pp(name));
        Self::from_parts(
            lin(cfg.hidden, "q_proj")?,
            lin(heads.kv_inner(), "k_proj")?,
            lin(heads.kv_inner(), "v_proj")?,
            lin(cfg.hidden, "o_proj")?,
            cfg,
        )
    }

    /// Builds from existing projections (e.g. split from a fused `c_attn`).
    pub fn from_parts(
        q_proj: Linear,
        k_proj: Linear,
        v_proj: Linear,
        o_proj: Linear,
        cfg: &SelfAttentionConfig,
    ) -> Result<Self> {
        Self::from_projs(
            q_proj.into(),
            k_proj.into(),
            v_proj.into(),
            o_proj.into(),
            cfg,
        )
    }

    /// As [`CausalSelfAttention::from_parts`], from dense or quantized
    /// projections.
    pub fn from_projs(
        q_proj: Proj,
        k_proj: Proj,
        v_proj: Proj,
        o_proj: Proj,
        cfg: &SelfAttentionConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        let heads = HeadLayout::new(
            "CausalSelfAttention",
            cfg.hidden,
            cfg.num_heads,
            cfg.num_kv_heads,
        )?;
        for (name, p, out) in [
            ("q_proj", &q_proj, cfg.hidden),
            ("k_proj", &k_proj, heads.kv_inner()),
            ("v_proj", &v_proj, heads.kv_inner()),
            ("o_proj", &o_proj, cfg.hidden),
        ] {
            p.check(name, out, cfg.hidden)?;
        }
        Ok(Self {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            heads,
            cfg: cfg.clone(),
            backend: Backend::default(),
        })
    }

    /// A copy with the four projections quantized to `format` (e.g.
    /// [`GgmlDType::Q8_0`]); activations keep their dtype.
    ///
    /// # Errors
    /// [`crate::AttnError::Quantize`] naming `q_proj` when `hidden` is not a
    /// multiple of the format's block size (32 for `q8_0`, 256 for `q4k`).
    pub fn quantize(&self, format: GgmlDType) -> Result<Self> {
        Ok(Self {
            q_proj: self.q_proj.quantize("q_proj", format)?,
            k_proj: self.k_proj.quantize("k_proj", format)?,
            v_proj: self.v_proj.quantize("v_proj", format)?,
            o_proj: self.o_proj.quantize("o_proj", format)?,
            ..self.clone()
        })
    }

    /// The quantized format of the projections, `None` when dense.
    pub fn quantization(&self) -> Option<GgmlDType> {
        self.q_proj.quantization()
    }

    /// Chooses the attention implementation (the default is [`Backend::Auto`]).
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// The sizes this module was built with.
    pub fn config(&self) -> &SelfAttentionConfig {
        &self.cfg
    }

    fn dtype(&self) -> DType {
        self.q_proj.dtype()
    }

    /// An empty cache sized for `capacity` tokens.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        KvCache::new(capacity)
    }

    fn project(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor, usize, usize)> {
        let (b, t) = check_input("x", x, self.cfg.hidden, "hidden")?;
        check_dtype_device("x", x, "the weights", self.dtype(), self.q_proj.device())?;
        let hl = &self.heads;
        // each (b, heads, t, head_dim)
        let q = split_heads(&self.q_proj.forward(x)?, b, t, hl.num_heads, hl.head_dim)?;
        let k = split_heads(&self.k_proj.forward(x)?, b, t, hl.num_kv_heads, hl.head_dim)?;
        let v = split_heads(&self.v_proj.forward(x)?, b, t, hl.num_kv_heads, hl.head_dim)?;
        Ok((q, k, v, b, t))
    }

    /// Causal self-attention over `x` alone (no cache).
    ///
    /// # Shapes
    /// - `x: (batch, len, hidden)`
    /// - `key_mask: (batch | 1, len | 1, len)`, `1` = may attend (e.g.
    ///   [`Mask::from_keys`] of a left-padding mask); it is combined with the
    ///   causal mask
    /// - returns `(batch, len, hidden)`
    pub fn forward(&self, x: &Tensor, key_mask: Option<&Mask>) -> Result<Tensor> {
        let (q, k, v, b, t) = self.project(x)?;
        let mask = combined_mask(t, 0, key_mask, x.device())?;
        let attn = kernel::attention(&q, &k, &v, mask.as_ref(), self.heads.scale(), self.backend)?;
        silence_unattending(
            self.o_proj.forward(&merge_heads(&attn, b, t)?)?,
            mask.as_ref(),
        )
    }

    /// Causal self-attention of the new tokens `x` over the cached tokens and
    /// themselves; appends their keys and values to `cache`. With `p` tokens
    /// cached, new query `i` sees keys `0..=p + i`.
    ///
    /// # Shapes
    /// - `x: (batch, new, hidden)`
    /// - `key_mask: (batch | 1, new | 1, p + new)`, `1` = may attend, over
    ///   every key after the append (e.g. left padding)
    /// - returns `(batch, new, hidden)`
    pub fn forward_cached(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        key_mask: Option<&Mask>,
    ) -> Result<Tensor> {
        let (q, k, v, b, t) = self.project(x)?;
        let offset = cache.len();
        if let Some(m) = key_mask {
            m.check(b, t, offset + t)?;
        }
        let (k, v) = cache.append(&k, &v)?;
        let mask = combined_mask(t, offset, key_mask, x.device())?;
        let attn = kernel::attention(&q, &k, &v, mask.as_ref(), self.heads.scale(), self.backend)?;
        silence_unattending(
            self.o_proj.forward(&merge_heads(&attn, b, t)?)?,
            mask.as_ref(),
        )
    }
}

/// The causal mask for `t` queries after `offset` keys, and'ed with the
/// caller's key mask; `None` when nothing is masked (one new query and no
/// key mask), so that a decode step builds no mask.
fn combined_mask(
    t: usize,
    offset: usize,
    key_mask: Option<&Mask>,
    device: &candle_core::Device,
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

//! Cross-attention: queries from one sequence, keys and values from
//! another (the memory), with no causal mask.

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor};
use candle_nn::{Linear, Module, VarBuilder};

use crate::error::{check_dtype_device, AttnError, Result};
use crate::kernel::{self, Backend};
use crate::linear::Proj;
use crate::mask::Mask;
use crate::proj::{check_input, merge_heads, silence_unattending, split_heads, HeadLayout};

/// The sizes of a [`CrossAttention`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrossAttentionConfig {
    /// Width of the queries (e.g. the text hidden size).
    pub query_dim: usize,
    /// Width of the memory tokens (e.g. the image encoder's hidden size);
    /// may differ from `query_dim`.
    pub memory_dim: usize,
    /// Width of the attention itself, `num_heads * head_dim`.
    pub inner_dim: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads; divides `num_heads` (`num_heads` = multi-head,
    /// 1 = multi-query, between = grouped-query).
    pub num_kv_heads: usize,
    /// Width of the output.
    pub out_dim: usize,
    /// Whether the projections have biases.
    pub bias: bool,
}

impl CrossAttentionConfig {
    /// Multi-head attention with `inner_dim = out_dim = query_dim` and biases.
    pub fn new(query_dim: usize, memory_dim: usize, num_heads: usize) -> Self {
        Self {
            query_dim,
            memory_dim,
            inner_dim: query_dim,
            num_heads,
            num_kv_heads: num_heads,
            out_dim: query_dim,
            bias: true,
        }
    }

    /// Rejects impossible sizes before any tensor is built.
    pub fn validate(&self) -> Result<()> {
        HeadLayout::new(
            "CrossAttention",
            self.inner_dim,
            self.num_heads,
            self.num_kv_heads,
        )?;
        for (name, v) in [
            ("query_dim", self.query_dim),
            ("memory_dim", self.memory_dim),
            ("out_dim", self.out_dim),
        ] {
            if v == 0 {
                return Err(AttnError::Config {
                    module: "CrossAttention",
                    reason: format!("{name} must be positive"),
                });
            }
        }
        Ok(())
    }
}

/// The keys and values of one memory, projected once and reused at every
/// decode step.
///
/// Cloning is cheap and shares the tensors. A `CrossKv` of batch `n` serves
/// queries of batch `n * r`: query sample `b` reads memory sample `b / r`,
/// so the `r` beams or samples of one image share its keys and values with
/// no copy.
#[derive(Debug, Clone)]
pub struct CrossKv {
    k: Tensor,
    v: Tensor,
}

impl CrossKv {
    /// Wraps projected keys and values `(batch, kv_heads, len, head_dim)`.
    pub fn new(k: Tensor, v: Tensor) -> Result<Self> {
        if k.rank() != 4 || k.dims() != v.dims() {
            return Err(AttnError::Shape {
                arg: "cross kv",
                expected: format!(
                    "k and v both (batch, kv_heads, len, head_dim), k is {:?}",
                    k.dims()
                ),
                actual: v.dims().to_vec(),
            });
        }
        Ok(Self { k, v })
    }

    /// Keys, `(batch, kv_heads, len, head_dim)`.
    pub fn k(&self) -> &Tensor {
        &self.k
    }

    /// Values, `(batch, kv_heads, len, head_dim)`.
    pub fn v(&self) -> &Tensor {
        &self.v
    }

    /// The number of memory samples.
    pub fn batch(&self) -> usize {
        self.k.dims()[0]
    }

    /// The number of memory tokens.
    pub fn len(&self) -> usize {
        self.k.dims()[2]
    }

    /// Whether the memory has no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The memory samples at `indices` (a `u32` tensor), in that order, e.g.
    /// to drop finished samples from a batch.
    pub fn index_select(&self, indices: &Tensor) -> Result<Self> {
        Ok(Self {
            k: self.k.index_select(indices, 0)?,
            v: self.v.index_select(indices, 0)?,
        })
    }
}

/// Multi-head cross-attention (grouped-query when `num_kv_heads < num_heads`).
///
/// Weights: `q_proj (inner, query_dim)`, `k_proj`, `v_proj (kv_inner,
/// memory_dim)`, `o_proj (out_dim, inner)`, each with a bias when
/// configured, where `kv_inner = num_kv_heads * head_dim`. The projections
/// are dense or, after [`CrossAttention::quantize`], quantized.
#[derive(Debug, Clone)]
pub struct CrossAttention {
    q_proj: Proj,
    k_proj: Proj,
    v_proj: Proj,
    o_proj: Proj,
    heads: HeadLayout,
    cfg: CrossAttentionConfig,
    backend: Backend,
}

impl CrossAttention {
    /// Loads or initialises the projections under `vb`
    /// (`q_proj`, `k_proj`, `v_proj`, `o_proj`).
    pub fn load(vb: VarBuilder, cfg: &CrossAttentionConfig) -> Result<Self> {
        cfg.validate()?;
        let heads = HeadLayout::new(
            "CrossAttention",
            cfg.inner_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
        )?;
        let kv_inner = heads.kv_inner();
        let lin = |i, o, name| candle_nn::linear_b(i, o, cfg.bias, vb.pp(name));
        Self::from_parts(
            lin(cfg.query_dim, cfg.inner_dim, "q_proj")?,
            lin(cfg.memory_dim, kv_inner, "k_proj")?,
            lin(cfg.memory_dim, kv_inner, "v_proj")?,
            lin(cfg.inner_dim, cfg.out_dim, "o_proj")?,
            cfg,
        )
    }

    /// Builds from existing projections, e.g. split from a checkpoint's fused
    /// key/value matrix. Their shapes must match `cfg`.
    pub fn from_parts(
        q_proj: Linear,
        k_proj: Linear,
        v_proj: Linear,
        o_proj: Linear,
        cfg: &CrossAttentionConfig,
    ) -> Result<Self> {
        Self::from_projs(
            q_proj.into(),
            k_proj.into(),
            v_proj.into(),
            o_proj.into(),
            cfg,
        )
    }

    /// As [`CrossAttention::from_parts`], from dense or quantized
    /// projections.
    pub fn from_projs(
        q_proj: Proj,
        k_proj: Proj,
        v_proj: Proj,
        o_proj: Proj,
        cfg: &CrossAttentionConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        let heads = HeadLayout::new(
            "CrossAttention",
            cfg.inner_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
        )?;
        let kv_inner = heads.kv_inner();
        for (name, p, out, inp) in [
            ("q_proj", &q_proj, cfg.inner_dim, cfg.query_dim),
            ("k_proj", &k_proj, kv_inner, cfg.memory_dim),
            ("v_proj", &v_proj, kv_inner, cfg.memory_dim),
            ("o_proj", &o_proj, cfg.out_dim, cfg.inner_dim),
        ] {
            p.check(name, out, inp)?;
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
    /// [`AttnError::Quantize`] naming the first projection (`q_proj`,
    /// `k_proj`, `v_proj`, `o_proj`) whose input width (`query_dim`,
    /// `memory_dim`, `inner_dim`) is not a multiple of the format's block
    /// size (32 for `q8_0`, 256 for `q4k`).
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
    pub fn config(&self) -> &CrossAttentionConfig {
        &self.cfg
    }

    fn dtype(&self) -> DType {
        self.q_proj.dtype()
    }

    /// Projects the memory into keys and values, once per memory.
    ///
    /// # Shapes
    /// `memory: (batch, mem_len, memory_dim)` → keys and values
    /// `(batch, kv_heads, mem_len, head_dim)`.
    pub fn project_memory(&self, memory: &Tensor) -> Result<CrossKv> {
        let (b, t) = check_input("memory", memory, self.cfg.memory_dim, "memory_dim")?;
        check_dtype_device(
            "memory",
            memory,
            "the weights",
            self.dtype(),
            self.q_proj.device(),
        )?;
        let hl = &self.heads;
        // (b, t, kv_inner) -> (b, kv_heads, t, head_dim)
        let k = split_heads(
            &self.k_proj.forward(memory)?,
            b,
            t,
            hl.num_kv_heads,
            hl.head_dim,
        )?;
        let v = split_heads(
            &self.v_proj.forward(memory)?,
            b,
            t,
            hl.num_kv_heads,
            hl.head_dim,
        )?;
        CrossKv::new(k, v)
    }

    fn queries(
        &self,
        queries: &Tensor,
        kv: &CrossKv,
        mask: Option<&Mask>,
    ) -> Result<(Tensor, usize, usize)> {
        let (b, t) = check_input("queries", queries, self.cfg.query_dim, "query_dim")?;
        check_dtype_device(
            "queries",
            queries,
            "the weights",
            self.dtype(),
            self.q_proj.device(),
        )?;
        if b % kv.batch().max(1) != 0 || kv.batch() == 0 {
            return Err(AttnError::Shape {
                arg: "queries",
                expected: format!(
                    "(a multiple of the memory batch {}, q_len, {})",
                    kv.batch(),
                    self.cfg.query_dim
                ),
                actual: queries.dims().to_vec(),
            });
        }
        if kv.k().dims()[1] != self.heads.num_kv_heads || kv.k().dims()[3] != self.heads.head_dim {
            return Err(AttnError::Shape {
                arg: "cross kv",
                expected: format!(
                    "(batch, {}, len, {})",
                    self.heads.num_kv_heads, self.heads.head_dim
                ),
                actual: kv.k().dims().to_vec(),
            });
        }
        if let Some(m) = mask {
            m.check(b, t, kv.len())?;
        }
        // (b, t, inner) -> (b, heads, t, head_dim)
        let q = split_heads(
            &self.q_proj.forward(queries)?,
            b,
            t,
            self.heads.num_heads,
            self.heads.head_dim,
        )?;
        Ok((q, b, t))
    }

    fn output(&self, attn: &Tensor, b: usize, t: usize, mask: Option<&Mask>) -> Result<Tensor> {
        let out = self.o_proj.forward(&merge_heads(attn, b, t)?)?;
        silence_unattending(out, mask)
    }

    /// Cross-attention over a memory whose keys and values were projected by
    /// [`CrossAttention::project_memory`].
    ///
    /// # Shapes
    /// - `queries: (batch, q_len, query_dim)`, `batch` a multiple of `kv.batch()`
    /// - `mask: (batch | 1, q_len | 1, mem_len)`, `1` = may attend
    /// - returns `(batch, q_len, out_dim)`
    pub fn forward_cached(
        &self,
        queries: &Tensor,
        kv: &CrossKv,
        mask: Option<&Mask>,
    ) -> Result<Tensor> {
        let (q, b, t) = self.queries(queries, kv, mask)?;
        let attn = kernel::attention(&q, kv.k(), kv.v(), mask, self.heads.scale(), self.backend)?;
        self.output(&attn, b, t, mask)
    }

    /// As [`CrossAttention::forward_cached`], also returning the attention
    /// weights per head `(batch, heads, q_len, mem_len)`.
    pub fn forward_cached_with_weights(
        &self,
        queries: &Tensor,
        kv: &CrossKv,
        mask: Option<&Mask>,
    ) -> Result<(Tensor, Tensor)> {
        let (q, b, t) = self.queries(queries, kv, mask)?;
        let (attn, w) =
            kernel::attention_with_weights(&q, kv.k(), kv.v(), mask, self.heads.scale())?;
        Ok((self.output(&attn, b, t, mask)?, w))
    }

    /// Cross-attention of `queries` over `memory`.
    ///
    /// # Shapes
    /// - `queries: (batch, q_len, query_dim)`
    /// - `memory: (batch_m, mem_len, memory_dim)`, `batch` a multiple of `batch_m`
    /// - `mask: (batch | 1, q_len | 1, mem_len)`, `1` = may attend
    /// - returns `(batch, q_len, out_dim)`
    pub fn forward(
        &self,
        queries: &Tensor,
        memory: &Tensor,
        mask: Option<&Mask>,
    ) -> Result<Tensor> {
        check_dtype_device(
            "memory",
            memory,
            "queries",
            queries.dtype(),
            queries.device(),
        )?;
        self.forward_cached(queries, &self.project_memory(memory)?, mask)
    }

    /// As [`CrossAttention::forward`], also returning the attention weights
    /// per head `(batch, heads, q_len, mem_len)`.
    pub fn forward_with_weights(
        &self,
        queries: &Tensor,
        memory: &Tensor,
        mask: Option<&Mask>,
    ) -> Result<(Tensor, Tensor)> {
        check_dtype_device(
            "memory",
            memory,
            "queries",
            queries.dtype(),
            queries.device(),
        )?;
        self.forward_cached_with_weights(queries, &self.project_memory(memory)?, mask)
    }
}

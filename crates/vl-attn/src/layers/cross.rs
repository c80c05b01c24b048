//! Cross-attention: queries from one sequence, keys and values from
//! another (the memory), with no causal mask.

use crate::quantize::Quantizer;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

use crate::attention::{AttnOutput, Backend, GroupedOutput, Weights};
use crate::dropout::{Dropout, Mode};
use crate::error::{AttnError, Result};
use crate::heads::{AttnCore, CoreDims, GroupKv};
use crate::mask::Mask;
use crate::proj::Proj;

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
        self.dims().layout().map(|_| ())
    }

    fn dims(&self) -> CoreDims {
        CoreDims {
            module: "CrossAttention",
            query_dim: self.query_dim,
            kv_dim: self.memory_dim,
            inner: self.inner_dim,
            out: self.out_dim,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            bias: self.bias,
        }
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

/// One group of rows of [`CrossAttention::attend_groups`]: how many, the
/// memory they read and their mask.
#[derive(Debug, Clone, Copy)]
pub struct CrossGroup<'a> {
    /// Rows of the group, a multiple of `kv.batch()`.
    pub rows: usize,
    /// The memory's keys and values.
    pub kv: &'a CrossKv,
    /// `(rows | 1, q_len | 1, mem_len)`, `1` = may attend.
    pub mask: Option<&'a Mask>,
}

/// Multi-head cross-attention (grouped-query when `num_kv_heads < num_heads`).
///
/// Weights: `q_proj (inner, query_dim)`, `k_proj`, `v_proj (kv_inner,
/// memory_dim)`, `o_proj (out_dim, inner)`, each with a bias when
/// configured, where `kv_inner = num_kv_heads * head_dim`. The projections
/// are dense or, after [`CrossAttention::quantize`], quantized.
///
/// It counts the memories it projects ([`CrossAttention::memory_projections`]),
/// so that a caller can check that an image's keys and values are projected
/// once, not at every decode step.
#[derive(Debug, Clone)]
pub struct CrossAttention {
    core: AttnCore,
    cfg: CrossAttentionConfig,
    /// The dtype projected memories are kept in, when not the
    /// activations' (see [`CrossAttention::with_memory_dtype`]).
    memory_dtype: Option<DType>,
    /// Calls of `project_memory`, shared by clones.
    projections: Arc<AtomicUsize>,
}

impl CrossAttention {
    /// Loads or initialises the projections under `vb`
    /// (`q_proj`, `k_proj`, `v_proj`, `o_proj`).
    pub fn load(vb: VarBuilder, cfg: &CrossAttentionConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self::new(AttnCore::load(vb, &cfg.dims())?, cfg))
    }

    fn new(core: AttnCore, cfg: &CrossAttentionConfig) -> Self {
        Self {
            core,
            cfg: cfg.clone(),
            memory_dtype: None,
            projections: Arc::default(),
        }
    }

    /// Builds from existing projections, dense layers (e.g. split from a
    /// checkpoint's fused key/value matrix) or [`Proj`]s of any format.
    /// Their shapes must match `cfg`.
    pub fn from_parts(
        q_proj: impl Into<Proj>,
        k_proj: impl Into<Proj>,
        v_proj: impl Into<Proj>,
        o_proj: impl Into<Proj>,
        cfg: &CrossAttentionConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        let projs = [q_proj.into(), k_proj.into(), v_proj.into(), o_proj.into()];
        let core = AttnCore::from_projs(projs, &cfg.dims())?;
        Ok(Self::new(core, cfg))
    }

    /// A copy with the four projections quantized to `format` (e.g.
    /// [`GgmlDType::Q8_0`]); activations keep their dtype. The copy counts
    /// its memory projections afresh.
    ///
    /// # Errors
    /// [`AttnError::Quantize`] naming the first projection (`q_proj`,
    /// `k_proj`, `v_proj`, `o_proj`) whose input width (`query_dim`,
    /// `memory_dim`, `inner_dim`) is not a multiple of the format's block
    /// size (32 for `q8_0`, 256 for `q4k`).
    ///
    /// Over f32 activations on the CPU, projected memories are kept in 16
    /// bits ([`CrossAttention::with_memory_dtype`]): in the weights' own
    /// type for `bf16` and `f16`, in bf16 for the integer formats (`q8_0`,
    /// `q4k`). A decode step then reads half the bytes of keys and values
    /// (an eighth of a step's reads at 8-bit weights, a fifteenth at
    /// 16-bit ones, more for long images), and the rounding is that of
    /// the weights that made them.
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let quantizer: Quantizer = q.into();
        let q = Self::new(self.core.quantize(&quantizer)?, &self.cfg).with_backend(self.backend());
        let memory_dtype = self
            .memory_dtype
            .or_else(|| quantizer.kv_dtype(q.core.dtype(), q.core.device()));
        Ok(q.with_memory_dtype(memory_dtype))
    }

    /// Adds `q_proj`, `k_proj`, `v_proj` and `o_proj` under `prefix` (see
    /// [`crate::named`]).
    pub fn named_tensors(&self, prefix: &str, out: &mut crate::named::Named) -> Result<()> {
        self.core.named_tensors(prefix, out)
    }

    /// Keeps the keys and values of [`CrossAttention::project_memory`] in
    /// `dtype` (a 16-bit float under f32 activations; `None`: the
    /// activations' dtype, the default): half the bytes of an image cache.
    /// Attention widens them as it reads them (vl's CPU kernel in place,
    /// other paths by a cast).
    pub fn with_memory_dtype(mut self, dtype: Option<DType>) -> Self {
        self.memory_dtype = dtype;
        self
    }

    /// The dtype projected memories are kept in, `None` for the
    /// activations' dtype.
    pub fn memory_dtype(&self) -> Option<DType> {
        self.memory_dtype
    }

    /// The quantized format of the projections, `None` when dense.
    pub fn quantization(&self) -> Option<GgmlDType> {
        self.core.quantization()
    }

    /// Chooses the attention implementation (the default is [`Backend::Auto`]).
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
    pub fn config(&self) -> &CrossAttentionConfig {
        &self.cfg
    }

    /// How many memories [`CrossAttention::project_memory`] has projected
    /// (each call counts once, whatever its batch), [`CrossAttention::forward`]
    /// included. Clones share the count (a decoder that clones its blocks
    /// counts for all of them); [`CrossAttention::quantize`] starts a new
    /// one. Decoders use it in tests to check that an image is projected once
    /// per image, not once per step.
    pub fn memory_projections(&self) -> usize {
        self.projections.load(Ordering::Relaxed)
    }

    /// Projects the memory into keys and values, once per memory.
    ///
    /// # Shapes
    /// `memory: (batch, mem_len, memory_dim)` → keys and values
    /// `(batch, kv_heads, mem_len, head_dim)`.
    pub fn project_memory(&self, memory: &Tensor) -> Result<CrossKv> {
        let (b, t) = self
            .core
            .check_input("memory", memory, self.cfg.memory_dim, "memory_dim")?;
        // (b, t, kv_inner) -> (b, kv_heads, t, head_dim)
        let (k, v) = self.core.keys_values(memory, b, t)?;
        let (k, v) = match self.memory_dtype {
            Some(dtype) if dtype != k.dtype() => (k.to_dtype(dtype)?, v.to_dtype(dtype)?),
            _ => (k, v),
        };
        self.projections.fetch_add(1, Ordering::Relaxed);
        CrossKv::new(k, v)
    }

    /// Cross-attention over a memory whose keys and values were projected by
    /// [`CrossAttention::project_memory`]; with [`Weights::Return`], also the
    /// attention weights per head.
    ///
    /// # Shapes
    /// - `queries: (batch, q_len, query_dim)`, `batch` a multiple of `kv.batch()`
    /// - `mask: (batch | 1, q_len | 1, mem_len)`, `1` = may attend
    /// - returns `output (batch, q_len, out_dim)` and `weights (batch,
    ///   heads, q_len, mem_len)`
    ///
    /// # Errors
    /// Shape, dtype and device errors naming `queries`, `cross kv` or
    /// `mask`; `backend` when [`Backend::Fused`] is asked for weights.
    pub fn attend(
        &self,
        queries: &Tensor,
        kv: &CrossKv,
        mask: Option<&Mask>,
        weights: Weights,
    ) -> Result<AttnOutput> {
        let (b, _) = self
            .core
            .check_input("queries", queries, self.cfg.query_dim, "query_dim")?;
        let group = CrossGroup { rows: b, kv, mask };
        let mut out = self.attend_groups(queries, &[group], weights)?;
        Ok(AttnOutput {
            output: out.output,
            weights: out.weights.pop().flatten(),
        })
    }

    /// [`CrossAttention::attend`] for rows in groups that read different
    /// memories (e.g. requests over different images batched together):
    /// the query and output projections run once over every row, the
    /// attention group by group. Each row's output is what
    /// [`CrossAttention::attend`] gives it in its group alone, up to the
    /// products' rounding for another row count.
    ///
    /// # Shapes
    /// - `queries: (rows, q_len, query_dim)`, `rows` the sum of the groups'
    ///   rows, in their order; each group's rows a multiple of its
    ///   `kv.batch()`
    /// - each group's `mask: (rows | 1, q_len | 1, mem_len)`
    /// - returns `output (rows, q_len, out_dim)` and, per group, `weights
    ///   (rows, heads, q_len, mem_len)`
    ///
    /// # Errors
    /// As [`CrossAttention::attend`]; [`AttnError::Argument`] naming
    /// `groups` when there is none or their rows do not add up to the
    /// queries'.
    pub fn attend_groups(
        &self,
        queries: &Tensor,
        groups: &[CrossGroup<'_>],
        weights: Weights,
    ) -> Result<GroupedOutput> {
        let (b, t) = self
            .core
            .check_input("queries", queries, self.cfg.query_dim, "query_dim")?;
        crate::self_attn::check_group_rows(groups.iter().map(|g| g.rows), b)?;
        let hl = self.core.heads();
        for g in groups {
            let kv = g.kv;
            if kv.batch() == 0 || g.rows % kv.batch() != 0 {
                return Err(AttnError::Shape {
                    arg: "queries",
                    expected: format!(
                        "(a multiple of the memory batch {}, q_len, {})",
                        kv.batch(),
                        self.cfg.query_dim
                    ),
                    actual: vec![g.rows, t, self.cfg.query_dim],
                });
            }
            let (_, kv_heads, _, head_dim) = kv.k().dims4()?;
            if kv_heads != hl.num_kv_heads || head_dim != hl.head_dim {
                return Err(AttnError::Shape {
                    arg: "cross kv",
                    expected: format!("(batch, {}, len, {})", hl.num_kv_heads, hl.head_dim),
                    actual: kv.k().dims().to_vec(),
                });
            }
            if let Some(m) = g.mask {
                m.check(g.rows, t, kv.len())?;
            }
        }
        // (b, t, inner) -> (b, heads, t, head_dim)
        let q = self.core.queries(queries, b, t)?;
        let parts: Vec<GroupKv> = groups
            .iter()
            .map(|g| GroupKv {
                rows: g.rows,
                k: g.kv.k().clone(),
                v: g.kv.v().clone(),
                mask: g.mask.cloned(),
            })
            .collect();
        self.core.attend_groups(&q, &parts, weights, t)
    }

    /// Cross-attention of `queries` over `memory`, projected on the spot
    /// (use [`CrossAttention::project_memory`] and [`CrossAttention::attend`]
    /// to project once and reuse, or to get the weights).
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
        Ok(self
            .attend(queries, &self.project_memory(memory)?, mask, Weights::Skip)?
            .output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use candle_nn::VarMap;

    /// Every `project_memory` counts once, `forward` included; `attend`
    /// over an already projected memory does not count; clones share the
    /// count and a quantized copy starts its own.
    #[test]
    fn memory_projections_are_counted() -> Result<()> {
        let dev = Device::Cpu;
        let vars = VarMap::new();
        let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
        let attn = CrossAttention::load(vb, &CrossAttentionConfig::new(32, 32, 2))?;
        assert_eq!(attn.memory_projections(), 0);
        let memory = Tensor::randn(0f32, 1., (2, 5, 32), &dev)?;
        let text = Tensor::randn(0f32, 1., (2, 1, 32), &dev)?;
        let kv = attn.project_memory(&memory)?;
        for _ in 0..4 {
            attn.attend(&text, &kv, None, Weights::Skip)?;
        }
        assert_eq!(attn.memory_projections(), 1);
        attn.forward(&text, &memory, None)?;
        assert_eq!(attn.memory_projections(), 2);
        let clone = attn.clone().with_backend(Backend::Reference);
        clone.project_memory(&memory)?;
        assert_eq!(attn.memory_projections(), 3);
        assert_eq!(clone.memory_projections(), 3);
        let q = clone.quantize(GgmlDType::Q8_0)?;
        assert_eq!(q.memory_projections(), 0);
        assert_eq!(q.backend(), Backend::Reference);
        // A memory refused by its shape is not counted.
        assert!(attn.project_memory(&text.narrow(2, 0, 8)?).is_err());
        assert_eq!(attn.memory_projections(), 3);
        Ok(())
    }
}

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

    /// The width of a head's key or value: the last dimension, or for q8
    /// rows ([`crate::quantize_kv`]) the values its blocks hold.
    pub fn head_dim(&self) -> usize {
        let last = self.k.dims()[3];
        match self.k.dtype() {
            DType::U8 => crate::kernels::kv_q8::row_values(last).unwrap_or(0),
            _ => last,
        }
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
    /// Over f32 activations on the CPU, projected memories are kept as
    /// [`Quantizer::kv_dtype`] says ([`CrossAttention::with_memory_dtype`]):
    /// in the weights' own type for `bf16` and `f16`, as q8 rows
    /// ([`crate::quantize_kv`]) for the integer formats (`q8_0`, `q4k`)
    /// where the head width is a multiple of 32, else bf16. A decode step
    /// then reads about a half or a quarter of f32's bytes of keys and
    /// values (with 16 requests decoding together, their images' keys and
    /// values are most of a step's reads after the weights), and the
    /// rounding is about that of the weights that made them.
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let quantizer: Quantizer = q.into();
        let q = Self::new(self.core.quantize(&quantizer)?, &self.cfg).with_backend(self.backend());
        let memory_dtype = self.memory_dtype.or_else(|| {
            quantizer.kv_dtype(q.core.dtype(), q.core.device(), q.core.heads().head_dim)
        });
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
    /// `U8` keeps them as q8 rows ([`crate::quantize_kv`]; f32 activations,
    /// a head width that is a multiple of 32), a quarter of f32's bytes
    /// and about half of bf16's. Attention widens them as it reads them
    /// (vl's CPU kernel in place, other paths by a cast or
    /// [`crate::widen_kv`]).
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
            Some(DType::U8) => (crate::quantize_kv(&k)?, crate::quantize_kv(&v)?),
            Some(dtype) if dtype != k.dtype() => (k.to_dtype(dtype)?, v.to_dtype(dtype)?),
            _ => (k, v),
        };
        self.projections.fetch_add(1, Ordering::Relaxed);
        CrossKv::new(k, v)
    }

    /// Every layer's [`CrossAttention::project_memory`] of one memory
    /// (each layer counts one projection): the keys and values each
    /// layer's own call gives, bit for bit. Where every layer's key and
    /// value projections hold vl's q8_0 tiles (or every one q4k tiles) on
    /// the CPU, over an f32 memory, the layers run as one product per
    /// chunk of them — the memory rounded once, the keys and values stored
    /// by heads as the product writes them, then turned into the layers'
    /// memory dtype on the pool — rather than, per layer, two products, a
    /// copy by heads and a conversion on one thread (one 197-token image
    /// through a vit-gpt2 base checkpoint's 12 q8_0 layers: 7.7–8.2
    /// against 11.4–11.7 ms, `vl bench`, Intel Xeon model 167). Otherwise
    /// layer by layer.
    ///
    /// # Shapes
    /// `memory: (batch, mem_len, memory_dim)` → per layer, keys and
    /// values `(batch, kv_heads, mem_len, head_dim)`.
    ///
    /// # Errors
    /// As [`CrossAttention::project_memory`], for the first layer whose
    /// `memory_dim`, dtype or device does not fit `memory`.
    pub fn project_memories(layers: &[&CrossAttention], memory: &Tensor) -> Result<Vec<CrossKv>> {
        Self::project_memories_within(layers, memory, STACK_BYTES)
    }

    /// [`CrossAttention::project_memories`] with at most `bytes` of f32
    /// keys and values per product (at least one layer's).
    fn project_memories_within(
        layers: &[&CrossAttention],
        memory: &Tensor,
        bytes: usize,
    ) -> Result<Vec<CrossKv>> {
        for layer in layers {
            layer
                .core
                .check_input("memory", memory, layer.cfg.memory_dim, "memory_dim")?;
        }
        let stackable = |l: &&CrossAttention| {
            let (a, b) = (l.core.heads(), layers[0].core.heads());
            a.num_kv_heads == b.num_kv_heads
                && a.head_dim == b.head_dim
                && l.memory_dtype == layers[0].memory_dtype
        };
        if layers.len() < 2
            || memory.dtype() != DType::F32
            || !memory.device().is_cpu()
            || !layers.iter().all(stackable)
            || !layers[0].core.heads().head_dim.is_multiple_of(STACK_TILE)
        {
            return layers.iter().map(|l| l.project_memory(memory)).collect();
        }
        let (b, t, width) = memory.dims3()?;
        let hl = layers[0].core.heads();
        let (kv_heads, head_dim) = (hl.num_kv_heads, hl.head_dim);
        // One layer's keys (or values), `(b, kv_heads, t, head_dim)`.
        let part = b * kv_heads * t * head_dim;
        let per_chunk = (bytes / (2 * part * 4).max(1)).max(1);
        let x = memory.reshape((b * t, width))?;
        // Row `r` (sample `r / t`, position `r % t`): its place in a part.
        let rows: Vec<usize> = (0..b * t)
            .map(|r| (r / t) * kv_heads * t * head_dim + (r % t) * head_dim)
            .collect();
        let tiles_per = kv_heads * head_dim / STACK_TILE;
        // Tile `c` (part `c / tiles_per`: layer, then keys or values): its
        // head and first column within the part — the same for every
        // chunk, a shorter chunk taking the first of them.
        let all_tiles: Vec<usize> = (0..2 * per_chunk.min(layers.len()) * tiles_per)
            .map(|c| {
                let within = (c % tiles_per) * STACK_TILE;
                (c / tiles_per) * part + (within / head_dim) * t * head_dim + within % head_dim
            })
            .collect();
        let mut kvs = Vec::with_capacity(layers.len());
        for chunk in layers.chunks(per_chunk) {
            let projs: Vec<&Proj> = chunk.iter().flat_map(|l| l.core.kv_projs()).collect();
            let tiles = &all_tiles[..projs.len() * tiles_per];
            // SAFETY: `rows` are the (sample, position) pairs times
            // `head_dim`, `tiles` the (part, head, 16-column block)
            // triples, at offsets (multiples of `t · head_dim` and of 16
            // within `head_dim`) apart from the rows': every value of the
            // parts is one row's one tile's, once.
            let y = unsafe {
                Proj::matmul_placed_stacked(&projs, &x, &rows, tiles, projs.len() * part)
            };
            let Some(y) = y else {
                // Projections vl's tiles do not hold: layer by layer.
                for l in chunk {
                    kvs.push(l.project_memory(memory)?);
                }
                continue;
            };
            let shape = (projs.len(), b, kv_heads, t, head_dim);
            let all = in_dtype(y?, shape, layers[0].memory_dtype, memory.device())?;
            for (i, l) in chunk.iter().enumerate() {
                kvs.push(CrossKv::new(all.get(2 * i)?, all.get(2 * i + 1)?)?);
                l.projections.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(kvs)
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
            let (_, kv_heads, _, _) = kv.k().dims4()?;
            if kv_heads != hl.num_kv_heads || kv.head_dim() != hl.head_dim {
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

/// Columns per tile of vl's packed products: a head of the stacked
/// projection must hold whole tiles.
const STACK_TILE: usize = crate::kernels::gemv_q8::TILE_ROWS;

/// The most bytes of f32 keys and values one stacked product of
/// [`CrossAttention::project_memories`] writes before they are converted:
/// every layer of a 197-token image at once (1.2 MB a layer), a batch of
/// 16 such images a layer at a time.
const STACK_BYTES: usize = 16 << 20;

/// `values` of `shape` as a tensor of `dtype` (`None`: f32): 16-bit floats
/// converted on the pool as candle's `to_dtype` converts them
/// (`from_f32`, ties to even), rather than in a pass on one thread; `U8`:
/// q8 rows ([`crate::quantize_kv`]'s blocks), quantized on the pool.
fn in_dtype(
    values: Vec<f32>,
    shape: (usize, usize, usize, usize, usize),
    dtype: Option<DType>,
    device: &candle_core::Device,
) -> Result<Tensor> {
    use rayon::prelude::*;
    Ok(match dtype {
        Some(DType::BF16) => Tensor::from_vec(
            crate::kernels::gemm_bf16::to_bf16_exact(&values),
            shape,
            device,
        )?,
        Some(DType::F16) => {
            let v: Vec<half::f16> = values.par_iter().map(|&x| half::f16::from_f32(x)).collect();
            Tensor::from_vec(v, shape, device)?
        }
        Some(DType::F32) | None => Tensor::from_vec(values, shape, device)?,
        Some(DType::U8) => {
            let (p, b, h, t, hd) = shape;
            crate::attention::q8_rows(&values, &[p, b, h, t, hd], device)?
        }
        Some(other) => Tensor::from_vec(values, shape, device)?.to_dtype(other)?,
    })
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

    /// Keys and values as `(dtype, dims, bits of each value in f32)`.
    fn bits(t: &Tensor) -> Result<(DType, Vec<usize>, Vec<u32>)> {
        let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok((
            t.dtype(),
            t.dims().to_vec(),
            values.iter().map(|v| v.to_bits()).collect(),
        ))
    }

    /// `project_memories` gives every layer what its own `project_memory`
    /// gives, bit for bit, and counts one projection per layer: stacked
    /// (q8_0 and q4k tiles, memories kept in bf16, f16, f32 or q8 rows, one image
    /// or three, every layer in one product or a chunk of them at a time)
    /// and layer by layer (dense layers, in f32 or q8 rows, formats mixed); a memory of the
    /// wrong width is refused, named, and nothing is counted.
    #[test]
    fn stacked_memories_are_each_layers_own() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = CrossAttentionConfig::new(256, 256, 4);
        let dense: Vec<CrossAttention> = (0..3)
            .map(|_| {
                let vars = VarMap::new();
                CrossAttention::load(VarBuilder::from_varmap(&vars, DType::F32, &dev), &cfg)
            })
            .collect::<Result<_>>()?;
        let quantized = |format| -> Result<Vec<CrossAttention>> {
            dense.iter().map(|l| l.quantize(format)).collect()
        };
        let q8 = quantized(GgmlDType::Q8_0)?;
        let stacks: Vec<(&str, Vec<CrossAttention>)> = vec![
            ("q8_0", q8.clone()),
            ("q4k", quantized(GgmlDType::Q4K)?),
            (
                "q8_0 f32",
                q8.iter()
                    .map(|l| l.clone().with_memory_dtype(Some(DType::F32)))
                    .collect(),
            ),
            (
                "q8_0 f16",
                q8.iter()
                    .map(|l| l.clone().with_memory_dtype(Some(DType::F16)))
                    .collect(),
            ),
            (
                "q8_0 q8",
                q8.iter()
                    .map(|l| l.clone().with_memory_dtype(Some(DType::U8)))
                    .collect(),
            ),
            ("dense", dense.clone()),
            (
                "dense q8",
                dense
                    .iter()
                    .map(|l| l.clone().with_memory_dtype(Some(DType::U8)))
                    .collect(),
            ),
            (
                "mixed",
                vec![q8[0].clone(), dense[1].clone(), q8[2].clone()],
            ),
        ];
        // One layer's keys and values of one 7-token image: 2 · 7 · 256 f32.
        let layer_bytes = 2 * 7 * 256 * 4;
        for (name, layers) in &stacks {
            let refs: Vec<&CrossAttention> = layers.iter().collect();
            for images in [1, 3] {
                let memory = Tensor::randn(0f32, 1., (images, 7, 256), &dev)?;
                let want = refs
                    .iter()
                    .map(|l| l.project_memory(&memory))
                    .collect::<Result<Vec<_>>>()?;
                for bytes in [STACK_BYTES, 2 * images * layer_bytes, 1] {
                    let before: Vec<usize> = refs.iter().map(|l| l.memory_projections()).collect();
                    let got = CrossAttention::project_memories_within(&refs, &memory, bytes)?;
                    assert_eq!(got.len(), refs.len());
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let at = format!("{name}, {images} images, {bytes} bytes, layer {i}");
                        assert!(bits(g.k())? == bits(w.k())?, "keys differ: {at}");
                        assert!(bits(g.v())? == bits(w.v())?, "values differ: {at}");
                        assert_eq!(refs[i].memory_projections(), before[i] + 1, "{at}");
                        // Stacked where the layers allow: layer `i`'s keys
                        // are part `2 i` of the one product's output.
                        if bytes == STACK_BYTES && !matches!(*name, "dense" | "dense q8" | "mixed")
                        {
                            // q8 rows: 34 bytes per 32 values.
                            let row = if g.k().dtype() == DType::U8 { 272 } else { 256 };
                            let part = images * 7 * row;
                            assert_eq!(g.k().layout().start_offset(), 2 * i * part, "{at}");
                        }
                    }
                }
            }
            let wrong = Tensor::randn(0f32, 1., (1, 7, 128), &dev)?;
            let before: Vec<usize> = refs.iter().map(|l| l.memory_projections()).collect();
            let err = CrossAttention::project_memories(&refs, &wrong).unwrap_err();
            assert!(err.to_string().contains("memory"), "{name}: {err}");
            let after: Vec<usize> = refs.iter().map(|l| l.memory_projections()).collect();
            assert_eq!(before, after, "{name}");
        }
        Ok(())
    }
}

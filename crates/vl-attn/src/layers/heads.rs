//! How the attention modules split their width into heads, and the core
//! they share: the four projections `q_proj`, `k_proj`, `v_proj`, `o_proj`
//! with their shape checks, loading, quantization and backend, written once
//! for [`crate::CrossAttention`], [`crate::SelfAttention`] and
//! [`crate::CausalSelfAttention`].

use crate::quantize::Quantizer;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;

use crate::attention::{self, AttnOutput, Backend, GroupedOutput, Weights};
use crate::dropout::{Dropout, Mode};
use crate::error::{check_dtype_device, AttnError, Result};
use crate::mask::Mask;
use crate::proj::Proj;

/// How an inner width splits into heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeadLayout {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl HeadLayout {
    pub fn new(
        module: &'static str,
        inner: usize,
        num_heads: usize,
        num_kv_heads: usize,
    ) -> Result<Self> {
        let err = |reason: String| Err(AttnError::Config { module, reason });
        if num_heads == 0 || num_kv_heads == 0 {
            return err(format!(
                "heads ({num_heads}) and kv heads ({num_kv_heads}) must be positive"
            ));
        }
        if inner == 0 || !inner.is_multiple_of(num_heads) {
            return err(format!(
                "inner width {inner} is not a positive multiple of heads {num_heads}"
            ));
        }
        if !num_heads.is_multiple_of(num_kv_heads) {
            return err(format!(
                "heads {num_heads} is not divisible by kv heads {num_kv_heads}"
            ));
        }
        Ok(Self {
            num_heads,
            num_kv_heads,
            head_dim: inner / num_heads,
        })
    }

    pub fn kv_inner(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }
}

/// The widths of an attention module, from its public config.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CoreDims {
    /// The module, named in config errors.
    pub module: &'static str,
    /// Input width of `q_proj`.
    pub query_dim: usize,
    /// Input width of `k_proj` and `v_proj`.
    pub kv_dim: usize,
    /// `num_heads * head_dim`.
    pub inner: usize,
    /// Output width of `o_proj`.
    pub out: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub bias: bool,
}

impl CoreDims {
    /// The head layout; rejects impossible head counts before any tensor is
    /// built (the widths themselves are checked by each config's `validate`).
    pub fn layout(&self) -> Result<HeadLayout> {
        HeadLayout::new(self.module, self.inner, self.num_heads, self.num_kv_heads)
    }
}

/// The projections, head layout and backend of an attention module.
///
/// Weights: `q_proj (inner, query_dim)`, `k_proj`, `v_proj (kv_inner,
/// kv_dim)`, `o_proj (out, inner)`, where `kv_inner = num_kv_heads *
/// head_dim`; dense or quantized.
#[derive(Debug, Clone)]
pub(crate) struct AttnCore {
    q_proj: Proj,
    k_proj: Proj,
    v_proj: Proj,
    o_proj: Proj,
    heads: HeadLayout,
    backend: Backend,
    /// Dropout on the attention probabilities, active in training.
    attn_dropout: Dropout,
    mode: Mode,
}

impl AttnCore {
    /// Loads or initialises `q_proj`, `k_proj`, `v_proj`, `o_proj` under `vb`.
    pub fn load(vb: VarBuilder, d: &CoreDims) -> Result<Self> {
        let heads = d.layout()?;
        let lin = |i, o, name| candle_nn::linear_b(i, o, d.bias, vb.pp(name));
        Self::from_projs(
            [
                lin(d.query_dim, d.inner, "q_proj")?.into(),
                lin(d.kv_dim, heads.kv_inner(), "k_proj")?.into(),
                lin(d.kv_dim, heads.kv_inner(), "v_proj")?.into(),
                lin(d.inner, d.out, "o_proj")?.into(),
            ],
            d,
        )
    }

    /// Adds the four projections under `prefix` (see [`crate::named`]).
    pub fn named_tensors(&self, prefix: &str, out: &mut crate::named::Named) -> Result<()> {
        for (name, p) in [
            ("q_proj", &self.q_proj),
            ("k_proj", &self.k_proj),
            ("v_proj", &self.v_proj),
            ("o_proj", &self.o_proj),
        ] {
            p.named_tensors(&crate::named::join(prefix, name), out)?;
        }
        Ok(())
    }

    /// Builds from `[q_proj, k_proj, v_proj, o_proj]`, checking each shape
    /// (the error names the projection, expected and actual shape).
    pub fn from_projs(projs: [Proj; 4], d: &CoreDims) -> Result<Self> {
        let heads = d.layout()?;
        let [q_proj, k_proj, v_proj, o_proj] = projs;
        for (name, p, out, inp) in [
            ("q_proj", &q_proj, d.inner, d.query_dim),
            ("k_proj", &k_proj, heads.kv_inner(), d.kv_dim),
            ("v_proj", &v_proj, heads.kv_inner(), d.kv_dim),
            ("o_proj", &o_proj, d.out, d.inner),
        ] {
            p.check(name, out, inp)?;
        }
        Ok(Self {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            heads,
            backend: Backend::default(),
            attn_dropout: Dropout::NONE,
            mode: Mode::Inference,
        })
    }

    /// A copy with the four projections quantized to `format`; the error
    /// names the first projection (`q_proj`, `k_proj`, `v_proj`, `o_proj`)
    /// whose input width is not a multiple of the block size.
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        Ok(Self {
            q_proj: q.proj("q_proj", &self.q_proj)?,
            k_proj: q.proj("k_proj", &self.k_proj)?,
            v_proj: q.proj("v_proj", &self.v_proj)?,
            o_proj: q.proj("o_proj", &self.o_proj)?,
            ..self.clone()
        })
    }

    /// The quantized format of the projections, `None` when dense.
    pub fn quantization(&self) -> Option<GgmlDType> {
        self.q_proj.quantization()
    }

    pub fn set_backend(&mut self, backend: Backend) {
        self.backend = backend;
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn set_attn_dropout(&mut self, dropout: Dropout) {
        self.attn_dropout = dropout;
    }

    pub fn attn_dropout(&self) -> Dropout {
        self.attn_dropout
    }

    pub fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    pub fn mode(&self) -> &Mode {
        &self.mode
    }

    pub fn heads(&self) -> &HeadLayout {
        &self.heads
    }

    pub fn dtype(&self) -> DType {
        self.q_proj.dtype()
    }

    pub fn device(&self) -> &Device {
        self.q_proj.device()
    }

    /// Checks a `(batch, len, width)` input against the weights' dtype and
    /// device, and returns `(batch, len)`.
    pub fn check_input(
        &self,
        arg: &'static str,
        x: &Tensor,
        width: usize,
        width_name: &str,
    ) -> Result<(usize, usize)> {
        let bt = match x.dims() {
            &[b, t, d] if d == width => (b, t),
            dims => {
                return Err(AttnError::Shape {
                    arg,
                    expected: format!("(batch, len, {width}) with {width_name} = {width}"),
                    actual: dims.to_vec(),
                })
            }
        };
        check_dtype_device(arg, x, "the weights", self.dtype(), self.device())?;
        Ok(bt)
    }

    /// The key and value projections.
    pub fn kv_projs(&self) -> [&Proj; 2] {
        [&self.k_proj, &self.v_proj]
    }

    /// Queries `(b, heads, t, head_dim)` of a checked input `(b, t, query_dim)`.
    pub fn queries(&self, x: &Tensor, b: usize, t: usize) -> Result<Tensor> {
        let hl = &self.heads;
        split_heads(&self.q_proj.forward(x)?, b, t, hl.num_heads, hl.head_dim)
    }

    /// Keys and values, each `(b, kv_heads, t, head_dim)`, of a checked
    /// input `(b, t, kv_dim)`.
    pub fn keys_values(&self, x: &Tensor, b: usize, t: usize) -> Result<(Tensor, Tensor)> {
        let hl = &self.heads;
        let k = split_heads(&self.k_proj.forward(x)?, b, t, hl.num_kv_heads, hl.head_dim)?;
        let v = split_heads(&self.v_proj.forward(x)?, b, t, hl.num_kv_heads, hl.head_dim)?;
        Ok((k, v))
    }

    /// Attention of `q (b, heads, t, hd)` over `k`, `v`, merged and put
    /// through `o_proj`: output `(b, t, out)`, whose rows are zero for
    /// queries that the mask lets attend to nothing (not even a bias).
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Mask>,
        weights: Weights,
        b: usize,
        t: usize,
    ) -> Result<AttnOutput> {
        let group = GroupKv {
            rows: b,
            k: k.clone(),
            v: v.clone(),
            mask: mask.cloned(),
        };
        let mut out = self.attend_groups(q, &[group], weights, t)?;
        Ok(AttnOutput {
            output: out.output,
            weights: out.weights.pop().flatten(),
        })
    }

    /// [`AttnCore::attend`] for consecutive groups of the rows of `q (rows,
    /// heads, t, hd)`, each over its own keys, values and mask: the
    /// attention runs group by group, `o_proj` once over every row.
    pub fn attend_groups(
        &self,
        q: &Tensor,
        groups: &[GroupKv],
        weights: Weights,
        t: usize,
    ) -> Result<GroupedOutput> {
        // Several groups of decode rows on the CPU: one pass of the per-row
        // kernel over all of them (each row as its group alone computes it).
        let one_pass = if groups.len() > 1
            && weights == Weights::Skip
            && !self.attn_dropout.is_active(&self.mode)
        {
            let parts: Vec<(usize, &Tensor, &Tensor, Option<&Mask>)> = groups
                .iter()
                .map(|g| (g.rows, &g.k, &g.v, g.mask.as_ref()))
                .collect();
            attention::fused_row_groups(q, &parts, self.heads.scale(), self.backend)?
        } else {
            None
        };
        let rows = groups.iter().map(|g| g.rows).sum();
        let (output, group_weights) = match one_pass {
            Some(output) => (output, vec![None; groups.len()]),
            None => self.each_group(q, groups, weights)?,
        };
        let out = self.o_proj.forward(&merge_heads(&output, rows, t)?)?;
        // Queries with no key to attend to get exactly nothing.
        let output = if let [GroupKv { mask: Some(m), .. }] = groups {
            out.broadcast_mul(&m.any_key(out.dtype())?)?
        } else if groups.iter().any(|g| g.mask.is_some()) {
            let dtype = out.dtype();
            let any: Vec<Tensor> = groups
                .iter()
                .map(|g| match &g.mask {
                    Some(m) => Ok(m
                        .any_key(dtype)?
                        .broadcast_as((g.rows, t, 1))?
                        .contiguous()?),
                    None => Ok(Tensor::ones((g.rows, t, 1), dtype, out.device())?),
                })
                .collect::<Result<_>>()?;
            out.broadcast_mul(&Tensor::cat(&any, 0)?)?
        } else {
            out
        };
        Ok(GroupedOutput {
            output,
            weights: group_weights,
        })
    }

    /// The attention of [`AttnCore::attend_groups`] one group at a time:
    /// the heads' outputs of every row `(rows, heads, t, hd)` and each
    /// group's weights.
    fn each_group(
        &self,
        q: &Tensor,
        groups: &[GroupKv],
        weights: Weights,
    ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        let mut outputs = Vec::with_capacity(groups.len());
        let mut group_weights = Vec::with_capacity(groups.len());
        let mut start = 0;
        for g in groups {
            let q = if groups.len() == 1 {
                q.clone()
            } else {
                q.narrow(0, start, g.rows)?
            };
            start += g.rows;
            let AttnOutput { output, weights } = attention::attention_with_dropout(
                &q,
                &g.k,
                &g.v,
                g.mask.as_ref(),
                self.heads.scale(),
                self.backend,
                weights,
                (self.attn_dropout, &self.mode),
            )?;
            outputs.push(output);
            group_weights.push(weights);
        }
        let output = match outputs.len() {
            1 => outputs.pop().ok_or_else(empty_groups)?,
            0 => return Err(empty_groups()),
            _ => Tensor::cat(&outputs, 0)?,
        };
        Ok((output, group_weights))
    }
}

fn empty_groups() -> AttnError {
    AttnError::Argument {
        arg: "groups",
        reason: "expected at least one group of rows".into(),
    }
}

/// One group of a grouped attention call: its row count and what its rows
/// attend to.
#[derive(Debug, Clone)]
pub(crate) struct GroupKv {
    pub rows: usize,
    /// `(rows | divisor of rows, kv_heads, k_len, head_dim)`.
    pub k: Tensor,
    pub v: Tensor,
    /// `(rows | 1, t | 1, k_len)`.
    pub mask: Option<Mask>,
}

/// `(b, t, heads * head_dim)` -> `(b, heads, t, head_dim)`, contiguous.
fn split_heads(x: &Tensor, b: usize, t: usize, heads: usize, head_dim: usize) -> Result<Tensor> {
    // (b, t, h, hd) -> (b, h, t, hd)
    Ok(x.reshape((b, t, heads, head_dim))?
        .transpose(1, 2)?
        .contiguous()?)
}

/// `(b, heads, t, head_dim)` -> `(b, t, heads * head_dim)`.
fn merge_heads(x: &Tensor, b: usize, t: usize) -> Result<Tensor> {
    let (_, h, _, hd) = x.dims4()?;
    // (b, h, t, hd) -> (b, t, h, hd) -> (b, t, h * hd)
    Ok(x.transpose(1, 2)?.reshape((b, t, h * hd))?)
}

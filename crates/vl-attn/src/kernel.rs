//! Scaled dot-product attention over grouped heads: the reference path and
//! the fused path.
//!
//! Both paths take queries `(batch_q, heads, q_len, head_dim)` and keys and
//! values `(batch_k, kv_heads, k_len, head_dim)` where `heads` is a multiple
//! of `kv_heads` (grouped-query attention; `kv_heads = 1` is multi-query) and
//! `batch_q` a multiple of `batch_k`: query sample `b` reads key sample
//! `b / (batch_q / batch_k)`. That lets `r` beams or samples share one
//! image's keys and values with no copy — they are folded into the query
//! length of a single matrix product.
//!
//! Masks follow [`crate::mask`]: `1` = may attend. A query row with no key
//! left gives an exactly zero output row and zero weights.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor, D};
use rayon::prelude::*;

use crate::dropout::{Dropout, Mode};
use crate::error::{AttnError, Result};
use crate::gemv::{Isa, Weight};
use crate::mask::Mask;
#[cfg(target_arch = "x86_64")]
use crate::micro::Fma;
use crate::micro::{madd, Kernel};
use crate::tiled::exp_neg;

/// Which implementation computes attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// [`Backend::Fused`] on CPU, and elsewhere for short query blocks
    /// (decode steps, up to [`AUTO_FUSED_MAX_Q_LEN`] queries) and for score
    /// tensors larger than [`FUSED_BLOCK_BYTES`]; [`Backend::Reference`]
    /// otherwise (off CPU its matrix products are faster), and whenever
    /// the weights are asked for, an input tracks gradients, or attention
    /// dropout is active (training with `p > 0`: only the reference path
    /// applies it).
    #[default]
    Auto,
    /// Materialises the `(batch, heads, q_len, k_len)` scores with matrix
    /// products; differentiable; the only path that returns weights.
    Reference,
    /// Never materialises the score tensor: on CPU, vl's kernels — tiled
    /// (blocks of queries × blocks of keys, online softmax, f32; see the
    /// `tiled` module) when at least [`TILED_MIN_ROWS`] queries read each
    /// key head, one query row at a time otherwise (a decode step), both
    /// multi-threaded; on other devices,
    /// the reference path over blocks of queries whose scores fit in
    /// [`FUSED_BLOCK_BYTES`].
    ///
    /// Strict: a call that the fused path cannot serve — weights asked for
    /// ([`Weights::Return`]), an input that tracks gradients (a `Var`), or
    /// active attention dropout (neither the fused kernel nor its tiled
    /// off-CPU form draws masks) —
    /// is an [`AttnError::Argument`] naming `backend`, never a silent
    /// fallback to [`Backend::Reference`]. [`Backend::Auto`] is the choice
    /// that falls back.
    Fused,
}

/// Whether an attention call returns its weights besides its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Weights {
    /// Only the output (any backend).
    #[default]
    Skip,
    /// The output and the weights `(batch, heads, q_len, k_len)`; served by
    /// the reference path ([`Backend::Auto`] or [`Backend::Reference`]).
    Return,
}

/// What an attention call returns.
#[derive(Debug, Clone)]
pub struct AttnOutput {
    /// The attention output; its shape is documented by each caller.
    pub output: Tensor,
    /// The attention weights per head `(batch, heads, q_len, k_len)`, whose
    /// rows sum to 1, or to 0 where the mask leaves no key; `Some` exactly
    /// when [`Weights::Return`] was asked.
    pub weights: Option<Tensor>,
}

/// The longest query block that [`Backend::Auto`] sends to the fused path
/// off CPU (on CPU it sends every block there).
pub const AUTO_FUSED_MAX_Q_LEN: usize = 16;

/// The largest score block the fused path materialises off CPU, in bytes.
pub const FUSED_BLOCK_BYTES: usize = 64 << 20;

/// The dimensions of one attention call, checked once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub(crate) batch_q: usize,
    pub(crate) heads: usize,
    pub(crate) q_len: usize,
    pub(crate) head_dim: usize,
    pub(crate) batch_k: usize,
    pub(crate) kv_heads: usize,
    pub(crate) k_len: usize,
    /// `batch_q * heads * q_len * k_len`, checked not to overflow.
    pub(crate) score_elems: usize,
}

impl Dims {
    fn check(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Mask>) -> Result<Self> {
        let shape_err = |arg, expected: String, t: &Tensor| AttnError::Shape {
            arg,
            expected,
            actual: t.dims().to_vec(),
        };
        let (batch_q, heads, q_len, head_dim) = q
            .dims4()
            .map_err(|_| shape_err("q", "(batch, heads, q_len, head_dim)".into(), q))?;
        let (batch_k, kv_heads, k_len, k_dim) = k
            .dims4()
            .map_err(|_| shape_err("k", "(batch, kv_heads, k_len, head_dim)".into(), k))?;
        if k_dim != head_dim
            || batch_k == 0
            || kv_heads == 0
            || batch_q % batch_k != 0
            || heads % kv_heads != 0
        {
            return Err(shape_err(
                "k",
                format!(
                    "(a divisor of {batch_q}, a divisor of {heads}, k_len, {head_dim}) to match q"
                ),
                k,
            ));
        }
        if v.dims() != k.dims() {
            return Err(shape_err("v", format!("{:?} like k", k.dims()), v));
        }
        // Keys and values have the queries' dtype, or one 16-bit float
        // dtype under f32 queries (a quantized model's image cache: half
        // the bytes, read in place by the per-row kernel).
        let kv_dtype = match (q.dtype(), k.dtype()) {
            (DType::F32, half @ (DType::BF16 | DType::F16)) => half,
            (dtype, _) => dtype,
        };
        crate::error::check_dtype_device("k", k, "q", kv_dtype, q.device())?;
        crate::error::check_dtype_device("v", v, "k", kv_dtype, q.device())?;
        if let Some(m) = mask {
            m.check(batch_q, q_len, k_len)?;
            crate::error::check_dtype_device("mask", m.tensor(), "u8 mask", DType::U8, q.device())?;
        }
        // The scores are never materialised by the fused path, but their
        // count sizes the paths' blocks: it must fit in memory sizes.
        let score_elems = [heads, q_len, k_len, std::mem::size_of::<f32>()]
            .iter()
            .try_fold(batch_q, |acc, &n| acc.checked_mul(n))
            .map(|bytes| bytes / std::mem::size_of::<f32>())
            .ok_or_else(|| AttnError::Argument {
                arg: "q, k",
                reason: format!(
                    "the scores (batch {batch_q}, heads {heads}, q_len {q_len}, k_len {k_len}) \
                     overflow the address space"
                ),
            })?;
        Ok(Self {
            batch_q,
            heads,
            q_len,
            head_dim,
            batch_k,
            kv_heads,
            k_len,
            score_elems,
        })
    }

    /// Query samples per key sample.
    pub(crate) fn r(&self) -> usize {
        self.batch_q / self.batch_k
    }

    /// Query heads per key head.
    pub(crate) fn g(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Query rows that read one key head: `r · g · q_len`.
    pub(crate) fn group_rows(&self) -> usize {
        self.r() * self.g() * self.q_len
    }

    /// Whether the CPU kernel runs tiled (else one query row at a time).
    pub(crate) fn tiled(&self) -> bool {
        self.head_dim > 0 && self.k_len > 0 && self.group_rows() >= TILED_MIN_ROWS
    }
}

/// The fewest query rows sharing one key head (beams × grouped heads ×
/// positions) that the CPU kernel runs tiled; fewer (a decode step of one
/// sample or two beams) run one row at a time. A tile always computes 32
/// rows' scores, so its cost is flat up to 32 rows while the per-row
/// kernel's grows with each: over 577 keys × 12 heads (`bench_attention
/// --k-len 577`, two threads) the row kernel took 308 / 460 / 600 / 702 µs
/// for 2 / 3 / 4 / 8 rows, the tiled one 483 / 497 / 513 µs for 3 / 4 / 8.
pub const TILED_MIN_ROWS: usize = 4;

/// Scaled dot-product attention: the output `(batch_q, heads, q_len,
/// head_dim)` and, when `weights` is [`Weights::Return`], the weights.
///
/// The one entry point of the kernels: `backend` picks the path (see
/// [`Backend`]; [`Backend::Fused`] refuses what it cannot serve).
///
/// # Shapes
/// - `q`: `(batch_q, heads, q_len, head_dim)`
/// - `k`, `v`: `(batch_k, kv_heads, k_len, head_dim)`, `batch_q % batch_k == 0`,
///   `heads % kv_heads == 0`
/// - `mask`: `(batch_q | 1, q_len | 1, k_len)`, `1` = may attend
/// - returns `output (batch_q, heads, q_len, head_dim)` and
///   `weights (batch_q, heads, q_len, k_len)`
///
/// # Errors
/// [`AttnError::Shape`], [`AttnError::DType`] or [`AttnError::Device`]
/// naming the argument that does not match; [`AttnError::Argument`] naming
/// `q, k` when the score count overflows `usize`, or `backend` when
/// [`Backend::Fused`] is asked for weights or given inputs that track
/// gradients.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Mask>,
    scale: f64,
    backend: Backend,
    weights: Weights,
) -> Result<AttnOutput> {
    attention_with_dropout(
        q,
        k,
        v,
        mask,
        scale,
        backend,
        weights,
        (Dropout::NONE, &Mode::Inference),
    )
}

/// [`attention`] with dropout on the attention probabilities: in
/// [`Mode::Training`] with `p > 0`, each probability is zeroed with
/// probability `p` and the others scaled by `1 / (1 - p)` before they weigh
/// the values. Otherwise this is [`attention`], bit for bit.
///
/// Only the reference path applies dropout: while it is active,
/// [`Backend::Auto`] takes the reference path and [`Backend::Fused`] is an
/// error. The returned weights are the probabilities before dropout.
///
/// # Shapes
/// As [`attention`].
///
/// # Errors
/// As [`attention`]; also [`AttnError::Argument`] naming `backend` when
/// [`Backend::Fused`] is asked while dropout is active.
#[allow(clippy::too_many_arguments)]
pub fn attention_with_dropout(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Mask>,
    scale: f64,
    backend: Backend,
    weights: Weights,
    (dropout, mode): (Dropout, &Mode),
) -> Result<AttnOutput> {
    let dims = Dims::check(q, k, v, mask)?;
    let tracks = q.track_op() || k.track_op() || v.track_op();
    let want_weights = weights == Weights::Return;
    let drops = dropout.is_active(mode);
    let use_fused = match backend {
        Backend::Reference => false,
        Backend::Fused => {
            let refuse = |reason: &str| {
                Err(AttnError::Argument {
                    arg: "backend",
                    reason: format!(
                        "Backend::Fused {reason}; use Backend::Auto or Backend::Reference"
                    ),
                })
            };
            if want_weights {
                return refuse("never materialises the weights, but they were asked for");
            }
            if tracks {
                return refuse("is not differentiable, but an input tracks gradients");
            }
            if drops {
                return refuse(
                    "does not apply attention dropout, but dropout is active (training, p > 0)",
                );
            }
            true
        }
        Backend::Auto => {
            !want_weights
                && !tracks
                && !drops
                && (q.device().is_cpu()
                    || dims.q_len <= AUTO_FUSED_MAX_Q_LEN
                    || dims.score_elems > FUSED_BLOCK_BYTES / std::mem::size_of::<f32>())
        }
    };
    if use_fused {
        return Ok(AttnOutput {
            output: fused(q, k, v, mask, scale, dims)?,
            weights: None,
        });
    }
    let (output, w) = reference(q, k, v, mask, scale, dims, (dropout, mode))?;
    Ok(AttnOutput {
        output,
        weights: want_weights.then_some(w),
    })
}

/// The mask as `(batch_k | 1, 1, r | 1, 1, q_len | 1, k_len)`, to broadcast
/// over `(batch_k, kv_heads, r, g, q_len, k_len)`.
fn grouped_mask(mask: &Mask, dims: Dims) -> Result<Tensor> {
    let (mb, mq, tk) = mask.dims();
    let t = mask.tensor();
    let t = if mb == 1 {
        t.reshape((1, 1, 1, 1, mq, tk))?
    } else {
        t.reshape((dims.batch_k, 1, dims.r(), 1, mq, tk))?
    };
    Ok(t)
}

/// The reference path: the output and the weights (before dropout).
fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Mask>,
    scale: f64,
    dims: Dims,
    (dropout, mode): (Dropout, &Mode),
) -> Result<(Tensor, Tensor)> {
    let Dims {
        batch_q,
        heads,
        q_len,
        head_dim,
        batch_k,
        kv_heads,
        k_len,
        ..
    } = dims;
    // 16-bit keys and values under f32 queries: widened here.
    let (k, v) = (&k.to_dtype(q.dtype())?, &v.to_dtype(q.dtype())?);
    let (r, g) = (dims.r(), dims.g());
    // f16 queries and keys are widened first: their logits may pass f16's
    // largest value (65504) and turn into Inf, then NaN in the softmax,
    // where the fused path (scores in f32) stays finite. bf16 has f32's range.
    let (q, k) = match q.dtype() {
        DType::F16 => (q.to_dtype(DType::F32)?, k.to_dtype(DType::F32)?),
        _ => (q.clone(), k.clone()),
    };
    // (bq, h, tq, hd) -> (bk, r, hkv, g, tq, hd) -> (bk, hkv, r, g, tq, hd) -> (bk, hkv, r*g*tq, hd)
    let qg = (q * scale)?
        .reshape((batch_k, r, kv_heads, g, q_len, head_dim))?
        .permute((0, 2, 1, 3, 4, 5))?
        .reshape((batch_k, kv_heads, r * g * q_len, head_dim))?;
    // (bk, hkv, r*g*tq, tk), in f32 whatever the input dtype
    let scores = qg.matmul(&k.t()?)?.to_dtype(DType::F32)?;
    let grouped = (batch_k, kv_heads, r, g, q_len, k_len);
    let tracks = scores.track_op();
    let weights = match mask {
        None => softmax(&scores, tracks)?,
        Some(mask) => {
            let m = grouped_mask(mask, dims)?.broadcast_as(grouped)?;
            let floor = Tensor::new(f32::MIN, scores.device())?.broadcast_as(grouped)?;
            let masked = m.where_cond(&scores.reshape(grouped)?, &floor)?.reshape((
                batch_k,
                kv_heads,
                r * g * q_len,
                k_len,
            ))?;
            // A fully masked row is uniform after softmax; the mask zeroes it.
            let w = softmax(&masked, tracks)?.reshape(grouped)?;
            w.broadcast_mul(&m.to_dtype(DType::F32)?)?.reshape((
                batch_k,
                kv_heads,
                r * g * q_len,
                k_len,
            ))?
        }
    };
    // (bk, hkv, r*g*tq, tk); `weights` itself when dropout is off
    let dropped = dropout.forward(&weights, mode)?;
    // (bk, hkv, r*g*tq, hd)
    let out = dropped.to_dtype(v.dtype())?.matmul(v)?;
    let ungroup = |t: Tensor, last: usize| -> Result<Tensor> {
        // (bk, hkv, r, g, tq, last) -> (bk, r, hkv, g, tq, last) -> (bq, h, tq, last)
        Ok(t.reshape((batch_k, kv_heads, r, g, q_len, last))?
            .permute((0, 2, 1, 3, 4, 5))?
            .reshape((batch_q, heads, q_len, last))?)
    };
    Ok((ungroup(out, head_dim)?, ungroup(weights, k_len)?))
}

fn softmax(scores: &Tensor, differentiable: bool) -> Result<Tensor> {
    Ok(if differentiable {
        candle_nn::ops::softmax(scores, D::Minus1)?
    } else {
        candle_nn::ops::softmax_last_dim(scores)?
    })
}

fn fused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Mask>,
    scale: f64,
    dims: Dims,
) -> Result<Tensor> {
    if !q.device().is_cpu() {
        return blocked_reference(q, k, v, mask, scale, dims);
    }
    let dtype = q.dtype();
    let f32_contiguous =
        |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?.contiguous()?) };
    let mask = match mask {
        None => None,
        Some(m) => {
            let (batch, q_len, _) = m.dims();
            let data = m.tensor().flatten_all()?.to_vec1::<u8>()?;
            Some(HostMask { data, batch, q_len })
        }
    };
    let op = FusedCpu {
        dims,
        scale: scale as f32,
        mask,
        isa: crate::gemv::isa(),
    };
    // Keys and values are read in place when they have contiguous heads
    // and one head stride (a KV cache's prefix) and are f32, or 16-bit for
    // the per-row kernel (which widens them as it reads); copied to f32
    // otherwise.
    let readable = match k.dtype() {
        DType::F32 => true,
        DType::BF16 | DType::F16 => !dims.tiled(),
        _ => false,
    };
    let (k, v) = if readable
        && v.dtype() == k.dtype()
        && is_head_strided(k)
        && is_head_strided(v)
        && k.stride() == v.stride()
    {
        (k.clone(), v.clone())
    } else {
        (f32_contiguous(k)?, f32_contiguous(v)?)
    };
    let out = f32_contiguous(q)?.apply_op3_no_bwd(&k, &v, &op)?;
    Ok(out.to_dtype(dtype)?)
}

/// The reference path over blocks of queries, so that no score block is
/// larger than [`FUSED_BLOCK_BYTES`].
fn blocked_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Mask>,
    scale: f64,
    dims: Dims,
) -> Result<Tensor> {
    // Checked by `Dims::check`: the whole score count, in bytes, fits.
    let row_bytes = (dims.score_elems / dims.q_len.max(1)) * std::mem::size_of::<f32>();
    let block = (FUSED_BLOCK_BYTES / row_bytes.max(1)).clamp(1, dims.q_len.max(1));
    if block >= dims.q_len {
        return Ok(reference(
            q,
            k,
            v,
            mask,
            scale,
            dims,
            (Dropout::NONE, &Mode::Inference),
        )?
        .0);
    }
    let mut outs = Vec::with_capacity(dims.q_len.div_ceil(block));
    for start in (0..dims.q_len).step_by(block) {
        let len = block.min(dims.q_len - start);
        let qb = q.narrow(2, start, len)?;
        let mb = match mask {
            Some(m) if m.dims().1 != 1 => Some(Mask::new(m.tensor().narrow(1, start, len)?)?),
            other => other.cloned(),
        };
        let d = Dims { q_len: len, ..dims };
        outs.push(
            reference(
                &qb,
                k,
                v,
                mb.as_ref(),
                scale,
                d,
                (Dropout::NONE, &Mode::Inference),
            )?
            .0,
        );
    }
    Ok(Tensor::cat(&outs, 2)?)
}

/// The fused CPU kernel: the tiled kernel when enough queries share each
/// key head ([`TILED_MIN_ROWS`]); otherwise, for each query row, scores
/// against every key in f32 (one row of `k_len` floats per thread),
/// softmax, weighted sum of values. Inputs are contiguous f32.
struct FusedCpu {
    dims: Dims,
    scale: f32,
    mask: Option<HostMask>,
    /// The instruction set of the per-row kernel (the tiled one's too).
    isa: Isa,
}

/// A mask's bytes on the host, `(batch, q_len, k_len)` with its batch and
/// query extents each 1 (broadcast) or full: what the CPU kernels read.
pub(crate) struct HostMask {
    pub(crate) data: Vec<u8>,
    pub(crate) batch: usize,
    pub(crate) q_len: usize,
}

impl HostMask {
    /// The bytes of query sample `b`, position `i`: one per key, `1` = may
    /// attend.
    pub(crate) fn row(&self, b: usize, i: usize, k_len: usize) -> &[u8] {
        let b = if self.batch == 1 { 0 } else { b };
        let i = if self.q_len == 1 { 0 } else { i };
        &self.data[(b * self.q_len + i) * k_len..][..k_len]
    }
}

/// A dot product written so that the compiler vectorises it (for the
/// instruction set of the function it is inlined into).
#[inline(always)]
fn dot<K: Kernel, E: Weight>(a: &[f32], b: &[E]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] = madd(K::FMA, x[l], y[l].to_f32(), acc[l]);
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y.to_f32()).sum();
    acc.iter().sum::<f32>() + tail
}

/// One query row of [`FusedCpu`] (a decode step's row over its keys):
/// scores, a softmax with [`exp_neg`] over all of them at once, then the
/// weighted values; compiled once per instruction set below.
#[inline(always)]
fn row_generic<K: Kernel, E: Weight>(
    op: &FusedCpu,
    row: usize,
    q: &[f32],
    kv: KeysValues<'_, E>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let Dims {
        head_dim, k_len, ..
    } = op.dims;
    let RowInputs {
        q: q_row,
        keys,
        values,
        allowed,
    } = op.row_inputs(row, q, kv);
    let keys = keys.chunks_exact(head_dim);
    let mut max = f32::NEG_INFINITY;
    let mut any = false;
    match allowed {
        None => {
            for (s, k_row) in scores.iter_mut().zip(keys) {
                *s = dot::<K, E>(q_row, k_row) * op.scale;
                max = max.max(*s);
            }
            any = k_len > 0;
        }
        Some(allowed) => {
            for ((s, k_row), &open) in scores.iter_mut().zip(keys).zip(allowed) {
                *s = if open == 0 {
                    f32::NEG_INFINITY
                } else {
                    any = true;
                    dot::<K, E>(q_row, k_row) * op.scale
                };
                max = max.max(*s);
            }
        }
    }
    out.fill(0.0);
    if !any {
        return;
    }
    // Closed keys (-inf) get exactly 0.
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = exp_neg::<K>(*s - max);
        sum += *s;
    }
    let inv = 1.0 / sum;
    for (&p, v_row) in scores.iter().zip(values.chunks_exact(head_dim)) {
        if p == 0.0 {
            continue;
        }
        let p = p * inv;
        for (o, &x) in out.iter_mut().zip(v_row) {
            *o = madd(K::FMA, p, x.to_f32(), *o);
        }
    }
}

crate::micro::per_isa! {
    /// [`row_generic`] compiled for the op's instruction set.
    fn row_compiled<E: Weight>(
        op: &FusedCpu,
        row: usize,
        q: &[f32],
        kv: KeysValues<'_, E>,
        scores: &mut [f32],
        out: &mut [f32],
    ) = row_generic::<Fma>
}

/// One query row on the op's instruction set (which the CPU supports:
/// `fused` takes `gemv::isa()`, tests check with `gemv::supported`):
/// [`row_avx512`] for AVX-512 and head widths that are a multiple of 16,
/// [`row_generic`] compiled for it otherwise.
fn row<E: Lanes>(
    op: &FusedCpu,
    row: usize,
    q: &[f32],
    kv: KeysValues<'_, E>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if op.isa == Isa::Avx512 && op.dims.head_dim.is_multiple_of(16) {
        // SAFETY: `Isa::Avx512` only on CPUs with AVX-512F (the contract
        // above); the head width is a multiple of 16 (just checked).
        unsafe { row_avx512(op, row, q, kv, scores, out) };
        return;
    }
    row_compiled(op.isa, op, row, q, kv, scores, out)
}

/// Key and value elements the AVX-512 per-row kernel reads: 16 of them
/// widened to f32 lanes.
pub(crate) trait Lanes: Weight {
    /// The 16 values at `p`, as f32.
    ///
    /// # Safety
    /// 16 values are readable at `p`; the CPU has AVX-512F (callers are
    /// compiled for it, so that this inlines).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl Lanes for f32 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

impl Lanes for half::bf16 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const half::bf16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract. bf16 is the top half of an f32.
        unsafe {
            let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
        }
    }
}

impl Lanes for half::f16 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const half::f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

/// [`row_generic`] with AVX-512F intrinsics, for head widths that are a
/// multiple of 16 (the compiler vectorised the generic scores and softmax
/// poorly: 128-bit lanes, a serial sum; a decode step's 12 heads × 197
/// bf16 keys took 26 µs on one thread, 8 µs with this). Scores: one key at a time, two accumulators and a
/// reduction; max, `exp`, sum: 16 scores at a time; values: the output in
/// registers, 64 columns a pass, two accumulators over alternate keys.
/// The same results as the generic kernel up to summation order.
///
/// # Safety
/// The CPU has AVX-512F; `head_dim % 16 == 0`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_avx512<E: Lanes>(
    op: &FusedCpu,
    row: usize,
    q: &[f32],
    kv: KeysValues<'_, E>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let Dims {
        head_dim, k_len, ..
    } = op.dims;
    debug_assert!(head_dim.is_multiple_of(16));
    let RowInputs {
        q: q_row,
        keys,
        values,
        allowed,
    } = op.row_inputs(row, q, kv);
    let scores = &mut scores[..k_len];
    let out = &mut out[..head_dim];
    let chunks = head_dim / 16;
    // SAFETY: every pointer below stays within `q_row`, `keys`, `values`,
    // `scores` or `out` (sliced to their extents above): key `j < k_len`
    // spans `j * head_dim .. (j + 1) * head_dim`, chunks `c < chunks`.
    unsafe {
        let qp = q_row.as_ptr();
        for (j, s) in scores.iter_mut().enumerate() {
            if allowed.is_some_and(|a| a[j] == 0) {
                *s = f32::NEG_INFINITY;
                continue;
            }
            let kp = keys.as_ptr().add(j * head_dim);
            let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let mut c = 0;
            while c + 2 <= chunks {
                let (q0, q1) = (
                    _mm512_loadu_ps(qp.add(16 * c)),
                    _mm512_loadu_ps(qp.add(16 * c + 16)),
                );
                s0 = _mm512_fmadd_ps(q0, E::load16(kp.add(16 * c)), s0);
                s1 = _mm512_fmadd_ps(q1, E::load16(kp.add(16 * c + 16)), s1);
                c += 2;
            }
            if c < chunks {
                s0 = _mm512_fmadd_ps(
                    _mm512_loadu_ps(qp.add(16 * c)),
                    E::load16(kp.add(16 * c)),
                    s0,
                );
            }
            *s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * op.scale;
        }
        // The largest score, NaNs ignored (`max_ps` returns its second
        // operand when either is NaN).
        let sp = scores.as_mut_ptr();
        let full = k_len / 16 * 16;
        let mut vmax = _mm512_set1_ps(f32::NEG_INFINITY);
        for j in (0..full).step_by(16) {
            vmax = _mm512_max_ps(_mm512_loadu_ps(sp.add(j)), vmax);
        }
        let max = scores[full..]
            .iter()
            .fold(_mm512_reduce_max_ps(vmax), |m, &x| m.max(x));
        if max == f32::NEG_INFINITY {
            // No key open (or none scored above -inf): a row of zeros.
            out.fill(0.0);
            return;
        }
        // Closed keys (-inf) get exactly 0.
        for s in scores.iter_mut() {
            *s = exp_neg::<crate::micro::Avx512>(*s - max);
        }
        let mut vsum = _mm512_setzero_ps();
        for j in (0..full).step_by(16) {
            vsum = _mm512_add_ps(_mm512_loadu_ps(sp.add(j)), vsum);
        }
        let sum = scores[full..]
            .iter()
            .fold(_mm512_reduce_add_ps(vsum), |a, &x| a + x);
        let inv = _mm512_set1_ps(1.0 / sum);
        let mut c = 0;
        while c < chunks {
            let n = (chunks - c).min(4);
            let (vp, op) = (values.as_ptr().add(16 * c), out.as_mut_ptr().add(16 * c));
            match n {
                4 => values_pass::<E, 4>(scores, vp, head_dim, inv, op),
                3 => values_pass::<E, 3>(scores, vp, head_dim, inv, op),
                2 => values_pass::<E, 2>(scores, vp, head_dim, inv, op),
                _ => values_pass::<E, 1>(scores, vp, head_dim, inv, op),
            }
            c += n;
        }
    }
}

/// `out[..16 N] = inv × Σ_j p_j · v_j[..16 N]` for the keys whose weight
/// `p_j` is not 0 (closed keys add exactly nothing, whatever their values),
/// `v_j` starting at `v + j * stride`; two sets of `N` accumulators over
/// alternate keys.
///
/// # Safety
/// `16 N` values readable at `v + j * stride` for every `j < p.len()`,
/// `16 N` floats writable at `out`; the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn values_pass<E: Lanes, const N: usize>(
    p: &[f32],
    v: *const E,
    stride: usize,
    inv: std::arch::x86_64::__m512,
    out: *mut f32,
) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); N]; 2];
        let pairs = p.len() / 2;
        for n in 0..pairs {
            for (set, acc) in acc.iter_mut().enumerate() {
                let j = 2 * n + set;
                let pj = *p.get_unchecked(j);
                if pj != 0.0 {
                    let (pv, row) = (_mm512_set1_ps(pj), v.add(j * stride));
                    for (t, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(pv, E::load16(row.add(16 * t)), *a);
                    }
                }
            }
        }
        if p.len() % 2 == 1 {
            let j = p.len() - 1;
            let pj = *p.get_unchecked(j);
            if pj != 0.0 {
                let (pv, row) = (_mm512_set1_ps(pj), v.add(j * stride));
                for (t, a) in acc[0].iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(pv, E::load16(row.add(16 * t)), *a);
                }
            }
        }
        let [even, odd] = acc;
        for (t, (a, b)) in even.into_iter().zip(odd).enumerate() {
            _mm512_storeu_ps(out.add(16 * t), _mm512_mul_ps(_mm512_add_ps(a, b), inv));
        }
    }
}

/// Keys, values (each `(batch_k, kv_heads, k_len, head_dim)` with the given
/// head stride) and that stride, in elements; f32, or 16-bit values the
/// per-row kernel widens as it reads them.
type KeysValues<'a, E> = (&'a [E], &'a [E], usize);

/// Whether `t` (keys or values, `(batch_k, kv_heads, k_len, head_dim)`) is
/// laid out as the kernels read it: each head's `k_len` rows contiguous,
/// heads `stride >= k_len * head_dim` apart — contiguous, or a prefix of a
/// longer buffer such as [`crate::KvCache`]'s, which then needs no copy.
pub(crate) fn is_head_strided(t: &Tensor) -> bool {
    head_stride(t.layout(), t.dims()).is_some()
}

fn head_stride(l: &Layout, dims: &[usize]) -> Option<usize> {
    let (&[b, h, len, hd], &[s0, s1, s2, s3]) = (dims, l.stride()) else {
        return None;
    };
    // A dimension of extent 1 may carry any stride.
    let rows_ok = (len <= 1 || s2 == hd) && (hd <= 1 || s3 == 1);
    // Head `b * h + i` starts `(b * h + i) * stride` in.
    let stride = if h > 1 {
        s1
    } else if b > 1 {
        s0
    } else {
        len * hd
    };
    let heads_ok = stride >= len * hd && (b <= 1 || h <= 1 || s0 == h * s1);
    (rows_ok && heads_ok).then_some(stride)
}

/// The elements of `k` or `v` and their head stride (see
/// [`is_head_strided`]), or an error naming the argument.
fn head_strided<'a, E>(
    data: &'a [E],
    l: &Layout,
    d: Dims,
    name: &str,
) -> candle_core::Result<(&'a [E], usize)> {
    let dims = l.shape().dims();
    let Some(stride) = head_stride(l, dims) else {
        candle_core::bail!("fused attention: {name} {dims:?} must have contiguous heads");
    };
    let heads = d.batch_k * d.kv_heads;
    let len = match heads {
        0 => 0,
        n => (n - 1) * stride + d.k_len * d.head_dim,
    };
    match data.get(l.start_offset()..l.start_offset() + len) {
        Some(slice) => Ok((slice, stride)),
        None => candle_core::bail!("fused attention: {name} {dims:?} past its buffer"),
    }
}

/// Keys and values of one element type, with their common head stride.
fn keys_values<'a, E>(
    (k, lk): (&'a [E], &Layout),
    (v, lv): (&'a [E], &Layout),
    d: Dims,
) -> candle_core::Result<KeysValues<'a, E>> {
    let (k, k_stride) = head_strided(k, lk, d, "k")?;
    let (v, v_stride) = head_strided(v, lv, d, "v")?;
    if k_stride != v_stride {
        candle_core::bail!("fused attention: k and v head strides differ ({k_stride}, {v_stride})");
    }
    Ok((k, v, k_stride))
}

/// The part of a CPU buffer that a contiguous layout covers, or an error
/// naming the op and the argument: the input check of vl's `CustomOp`s
/// (this kernel, [`crate::gemv`], [`crate::gemm_bf16`]).
pub(crate) fn contiguous<'a, T>(
    data: &'a [T],
    layout: &Layout,
    op: &str,
    arg: &str,
) -> candle_core::Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("{op}: {arg} must be contiguous"),
    }
}

/// Runs `f` on a worker of the rayon pool (the process's pool, sized by
/// `RAYON_NUM_THREADS` or the application's `ThreadPoolBuilder`), and
/// returns its result: on the calling thread when that is already a
/// worker of a pool, else on a worker of the global pool while the
/// caller waits.
///
/// vl's kernels split each product across the pool. Started from a
/// worker, a product runs its first part on that worker and the rest on
/// the others; started from any other thread, every product sends its
/// work to the pool and puts the caller to sleep until it is done. On the
/// 2-core machine of BENCHMARKS.md a one-row q8_0 product of a
/// 32 × 768 weight (the dispatch alone) took 7.8–11.1 µs from the main
/// thread and 0.79 µs from a worker, and 72 distinct 768 × 768 products
/// 15.4 against 9.9 µs each: a decode step runs ~100 of them. The
/// decoder's and the vision encoder's entry points run their work through
/// this, so that a caller's own thread pays one hand-over per call.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        // `scope` runs its closure on a worker of the global pool when
        // called from outside every pool (`in_place_scope` would not).
        rayon::scope(|_| f())
    }
}

/// `f` applied to a tensor's values in row-major order: read in place
/// when the tensor is a contiguous CPU one (a weight just loaded), from a
/// copy otherwise. How vl's packers and loaders read a whole weight
/// without copying it first.
///
/// # Errors
/// A tensor not of element type `T`.
pub fn with_values<T: candle_core::WithDType, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> R,
) -> candle_core::Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&cpu.as_slice::<T>()?[start..end]));
        }
    }
    Ok(f(&t.flatten_all()?.to_vec1::<T>()?))
}

/// What one query row of the per-row kernels reads: its query
/// (`head_dim`), its key head's keys and values (`k_len` rows of
/// `head_dim`) and its mask row (one byte per key, `1` = may attend).
struct RowInputs<'a, E> {
    q: &'a [f32],
    keys: &'a [E],
    values: &'a [E],
    allowed: Option<&'a [u8]>,
}

impl FusedCpu {
    /// The inputs of query row `row = (b * heads + h) * q_len + i`: its
    /// sample's keys for `b` (beams share a sample's keys: `b / r`), the
    /// key head of `h`'s group (`h / g`).
    #[inline(always)]
    fn row_inputs<'a, E>(
        &'a self,
        row: usize,
        q: &'a [f32],
        (k, v, kv_stride): KeysValues<'a, E>,
    ) -> RowInputs<'a, E> {
        let Dims {
            heads,
            q_len,
            head_dim,
            kv_heads,
            k_len,
            ..
        } = self.dims;
        let (r, g) = (self.dims.r(), self.dims.g());
        let i = row % q_len;
        let h = (row / q_len) % heads;
        let b = row / (q_len * heads);
        let kv_base = ((b / r) * kv_heads + h / g) * kv_stride;
        RowInputs {
            q: &q[row * head_dim..][..head_dim],
            keys: &k[kv_base..][..k_len * head_dim],
            values: &v[kv_base..][..k_len * head_dim],
            allowed: self.mask.as_ref().map(|m| m.row(b, i, k_len)),
        }
    }

    /// The per-row kernel over every query row, on the pool.
    fn rows<E: Lanes>(&self, q: &[f32], kv: KeysValues<'_, E>, out: &mut [f32]) {
        let d = self.dims;
        if d.head_dim > 0 {
            out.par_chunks_mut(d.head_dim).enumerate().for_each_init(
                || vec![0f32; d.k_len],
                |scores, (r, o)| row(self, r, q, kv, scores, o),
            );
        }
    }
}

impl CustomOp3 for FusedCpu {
    fn name(&self) -> &'static str {
        "vl-fused-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        fn slice<'a>(s: &'a CpuStorage, l: &Layout, name: &str) -> candle_core::Result<&'a [f32]> {
            match s {
                CpuStorage::F32(d) => contiguous(d, l, "fused attention", name),
                _ => candle_core::bail!("fused attention: {name} must be f32"),
            }
        }
        let d = self.dims;
        let q = slice(s1, l1, "q")?;
        let len = [d.heads, d.q_len, d.head_dim]
            .iter()
            .try_fold(d.batch_q, |acc, &n| acc.checked_mul(n));
        let Some(len) = len else {
            candle_core::bail!(
                "fused attention: output ({}, {}, {}, {}) overflows usize",
                d.batch_q,
                d.heads,
                d.q_len,
                d.head_dim
            )
        };
        if d.tiled() {
            let (CpuStorage::F32(k), CpuStorage::F32(v)) = (s2, s3) else {
                candle_core::bail!("fused attention: the tiled kernel takes f32 k and v");
            };
            let (k, v, kv_stride) = keys_values((k, l2), (v, l3), d)?;
            let problem = crate::tiled::Problem {
                q,
                k,
                v,
                kv_stride,
                mask: self.mask.as_ref(),
                dims: d,
                scale: self.scale,
            };
            return Ok((
                CpuStorage::F32(crate::tiled::run(&problem, self.isa)),
                Shape::from((d.batch_q, d.heads, d.q_len, d.head_dim)),
            ));
        }
        let mut out = vec![0f32; len];
        match (s2, s3) {
            (CpuStorage::F32(k), CpuStorage::F32(v)) => {
                self.rows(q, keys_values((k, l2), (v, l3), d)?, &mut out)
            }
            (CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                self.rows(q, keys_values((k, l2), (v, l3), d)?, &mut out)
            }
            (CpuStorage::F16(k), CpuStorage::F16(v)) => {
                self.rows(q, keys_values((k, l2), (v, l3), d)?, &mut out)
            }
            _ => candle_core::bail!(
                "fused attention: k and v must be f32, bf16 or f16 alike, got {:?} and {:?}",
                s2.dtype(),
                s3.dtype()
            ),
        }
        Ok((
            CpuStorage::F32(out),
            Shape::from((d.batch_q, d.heads, d.q_len, d.head_dim)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The per-row kernel (fewer than [`TILED_MIN_ROWS`] rows per key
    /// head: decode steps) on every instruction set this CPU has against
    /// the reference: key counts past and off the vector width, head
    /// widths 7, 16, 32, 64, 80 (the AVX-512 kernel's passes of 64 columns
    /// and their tails), beams sharing keys, grouped key heads, a mask with closed keys and a
    /// closed row (exactly 0). Max abs error 1e-5.
    #[test]
    fn per_row_kernel_matches_the_reference_on_every_isa() -> Result<()> {
        let dev = Device::Cpu;
        // (batch_q, batch_k, heads, kv_heads, q_len, k_len, head_dim, masked)
        let shapes = [
            (1, 1, 12, 12, 1, 577, 64, false),
            (2, 2, 3, 3, 3, 33, 7, true),
            (4, 2, 2, 2, 1, 40, 16, true),
            (2, 1, 2, 2, 1, 17, 32, true),
            (2, 2, 4, 2, 1, 50, 80, true),
        ];
        for (bq, bk, heads, kvh, ql, kl, hd, masked) in shapes {
            let q = Tensor::randn(0f32, 1., (bq, heads, ql, hd), &dev)?;
            let k = Tensor::randn(0f32, 1., (bk, kvh, kl, hd), &dev)?;
            let v = Tensor::randn(0f32, 1., (bk, kvh, kl, hd), &dev)?;
            let mask = if masked {
                // Every third key closed; query row 0 of sample 1 closed.
                let m: Vec<u8> = (0..bq * ql * kl)
                    .map(|n| {
                        let (b, i, j) = (n / (ql * kl), (n / kl) % ql, n % kl);
                        u8::from(j % 3 != 1 && !(b == 1 && i == 0))
                    })
                    .collect();
                Some(Mask::new(Tensor::from_vec(m, (bq, ql, kl), &dev)?)?)
            } else {
                None
            };
            let dims = Dims::check(&q, &k, &v, mask.as_ref())?;
            assert!(dims.group_rows() < TILED_MIN_ROWS);
            let scale = 1.0 / (hd as f64).sqrt();
            let want = reference(
                &q,
                &k,
                &v,
                mask.as_ref(),
                scale,
                dims,
                (Dropout::NONE, &Mode::Inference),
            )?
            .0;
            let bytes = match &mask {
                Some(m) => Some(m.tensor().flatten_all()?.to_vec1::<u8>()?),
                None => None,
            };
            for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
                if !crate::gemv::supported(isa) {
                    continue;
                }
                let op = FusedCpu {
                    dims,
                    scale: scale as f32,
                    mask: bytes.clone().map(|data| HostMask {
                        data,
                        batch: bq,
                        q_len: ql,
                    }),
                    isa,
                };
                let got = q.apply_op3_no_bwd(&k, &v, &op)?;
                let err = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(err < 1e-5, "{isa:?} {:?}: {err}", (bq, heads, ql, kl, hd));
                if masked {
                    let closed = got.get(1)?.narrow(1, 0, 1)?.abs()?.max_all()?;
                    assert_eq!(closed.to_scalar::<f32>()?, 0.0, "{isa:?}");
                }
                // 16-bit keys and values, read in place, give what their
                // f32 widening gives.
                for half in [DType::BF16, DType::F16] {
                    let (kh, vh) = (k.to_dtype(half)?, v.to_dtype(half)?);
                    let widened = q.apply_op3_no_bwd(
                        &kh.to_dtype(DType::F32)?,
                        &vh.to_dtype(DType::F32)?,
                        &op,
                    )?;
                    let got = q.apply_op3_no_bwd(&kh, &vh, &op)?;
                    let err = (&got - &widened)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(err < 1e-5, "{isa:?} {half:?}: {err}");
                }
            }
        }
        Ok(())
    }

    /// Keys and values that are a prefix of a longer buffer (a KV cache's
    /// view, heads `capacity * head_dim` apart) are read in place and give
    /// bit for bit what their contiguous copies give, on the per-row and
    /// the tiled kernel, with and without a mask; keys and values whose
    /// heads are not contiguous (a transposed layout) are copied first and
    /// agree as well.
    #[test]
    fn strided_keys_and_values_equal_their_copies() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, cap, len, hd) = (2, 3, 50, 37, 16);
        let kbuf = Tensor::randn(0f32, 1., (b, h, cap, hd), &dev)?;
        let vbuf = Tensor::randn(0f32, 1., (b, h, cap, hd), &dev)?;
        let (k, v) = (kbuf.narrow(2, 0, len)?, vbuf.narrow(2, 0, len)?);
        assert!(!k.is_contiguous() && is_head_strided(&k));
        // (b, len, h, hd) transposed to (b, h, len, hd): rows hd * h apart.
        let kt = k.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
        assert!(!is_head_strided(&kt));
        for q_len in [1, 9] {
            let q = Tensor::randn(0f32, 1., (b, h, q_len, hd), &dev)?;
            let m: Vec<u8> = (0..b * q_len * len).map(|n| u8::from(n % 5 != 2)).collect();
            let mask = Mask::new(Tensor::from_vec(m, (b, q_len, len), &dev)?)?;
            for mask in [None, Some(&mask)] {
                let run = |k: &Tensor, v: &Tensor| -> Result<Tensor> {
                    Ok(attention(&q, k, v, mask, 0.25, Backend::Fused, Weights::Skip)?.output)
                };
                let want = run(&k.contiguous()?, &v.contiguous()?)?;
                let diff = |t: Tensor| -> Result<f32> {
                    Ok((t - &want)?.abs()?.max_all()?.to_scalar::<f32>()?)
                };
                assert_eq!(diff(run(&k, &v)?)?, 0.0, "q_len {q_len}: cache prefix");
                assert_eq!(diff(run(&kt, &v)?)?, 0.0, "q_len {q_len}: transposed keys");
            }
        }
        Ok(())
    }

    /// f16 inputs whose logits (360000) pass f16's largest value: every
    /// path stays finite and agrees with f32.
    #[test]
    fn f16_logits_past_f16_range_stay_finite() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::full(300f32, (1, 1, 2, 16), &dev)?;
        let k = Tensor::full(300f32, (1, 1, 3, 16), &dev)?;
        let v = Tensor::arange(0f32, 48., &dev)?.reshape((1, 1, 3, 16))?;
        let scale = 0.25;
        let want = attention(&q, &k, &v, None, scale, Backend::Reference, Weights::Skip)?.output;
        let half = |t: &Tensor| t.to_dtype(DType::F16);
        for backend in [Backend::Reference, Backend::Fused, Backend::Auto] {
            let got = attention(
                &half(&q)?,
                &half(&k)?,
                &half(&v)?,
                None,
                scale,
                backend,
                Weights::Skip,
            )?
            .output;
            let diff = (got.to_dtype(DType::F32)? - &want)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(diff <= 1e-2, "{backend:?}: {diff}");
        }
        Ok(())
    }

    /// Outside every pool, `on_pool` runs its closure on a worker of the
    /// global pool; on a worker, on that worker; and returns its result.
    #[test]
    fn on_pool_runs_on_a_worker() {
        // The test harness runs tests on threads of its own, not rayon's.
        assert_eq!(rayon::current_thread_index(), None);
        let (inside, nested) = on_pool(|| {
            let here = rayon::current_thread_index();
            (here, on_pool(rayon::current_thread_index) == here)
        });
        assert!(inside.is_some());
        assert!(nested);
        assert_eq!(on_pool(|| 6 * 7), 42);
    }

    /// Queries and keys of 2^33 tokens each (broadcast views of one
    /// element: nothing is allocated) have 2^66 scores: an error naming the
    /// inputs on every backend, not an overflow panic (in debug) or a
    /// wrapped size (in release).
    #[test]
    fn score_count_overflow_is_an_error() -> Result<()> {
        let dev = Device::Cpu;
        let huge = 1usize << 33;
        let q = Tensor::zeros((), DType::F32, &dev)?.broadcast_as((1, 1, huge, 1))?;
        for backend in [Backend::Reference, Backend::Fused, Backend::Auto] {
            let err = attention(&q, &q, &q, None, 1.0, backend, Weights::Skip)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(
                err.contains("q, k") && err.contains(&huge.to_string()),
                "{backend:?}: {err}"
            );
        }
        Ok(())
    }

    /// `Backend::Fused` refuses what it cannot serve instead of running the
    /// reference path behind the caller's back; `Auto` falls back.
    #[test]
    fn fused_refuses_weights_and_gradients() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1., (1, 2, 3, 4), &dev)?;
        let k = Tensor::randn(0f32, 1., (1, 2, 5, 4), &dev)?;
        let err = attention(&q, &k, &k, None, 0.5, Backend::Fused, Weights::Return)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.starts_with("backend:") && err.contains("weights"),
            "{err}"
        );
        let var = candle_core::Var::from_tensor(&q)?;
        let err = attention(
            var.as_tensor(),
            &k,
            &k,
            None,
            0.5,
            Backend::Fused,
            Weights::Skip,
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(
            err.starts_with("backend:") && err.contains("gradients"),
            "{err}"
        );
        let auto = attention(&q, &k, &k, None, 0.5, Backend::Auto, Weights::Return)?;
        assert_eq!(
            auto.weights.map(|w| w.dims().to_vec()),
            Some(vec![1, 2, 3, 5])
        );
        let plain = attention(&q, &k, &k, None, 0.5, Backend::Fused, Weights::Skip)?;
        assert!(plain.weights.is_none());
        let grads = attention(
            var.as_tensor(),
            &k,
            &k,
            None,
            0.5,
            Backend::Auto,
            Weights::Skip,
        )?;
        assert!(grads.output.track_op());
        Ok(())
    }
}

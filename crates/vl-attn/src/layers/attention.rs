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

use candle_core::{DType, Tensor, D};

use crate::dropout::{Dropout, Mode};
use crate::error::{AttnError, Result};
pub(crate) use crate::kernels::attention::Dims;
pub use crate::kernels::attention::TILED_MIN_ROWS;
use crate::kernels::attention::{is_head_strided, HostMask};
use crate::kernels::CpuFeatures;
use crate::mask::Mask;

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

/// What a grouped attention call returns: rows of several groups, each
/// attending to its own keys and values (e.g. requests decoding at
/// different positions, batched through the projections).
#[derive(Debug, Clone)]
pub struct GroupedOutput {
    /// The output of every row, groups in order; its shape is documented
    /// by each caller.
    pub output: Tensor,
    /// Per group, its attention weights per head `(rows, heads, q_len,
    /// k_len)` when [`Weights::Return`] was asked.
    pub weights: Vec<Option<Tensor>>,
}

/// The longest query block that [`Backend::Auto`] sends to the fused path
/// off CPU (on CPU it sends every block there).
pub const AUTO_FUSED_MAX_Q_LEN: usize = 16;

/// The largest score block the fused path materialises off CPU, in bytes.
pub const FUSED_BLOCK_BYTES: usize = 64 << 20;

fn check_dims(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Mask>) -> Result<Dims> {
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
    // q8 rows (`quantize_kv`): whole blocks of the queries' head width.
    let k_dim = match k.dtype() {
        DType::U8 => crate::kernels::kv_q8::row_values(k_dim).unwrap_or(usize::MAX),
        _ => k_dim,
    };
    if k_dim != head_dim
        || batch_k == 0
        || kv_heads == 0
        || batch_q % batch_k != 0
        || heads % kv_heads != 0
    {
        return Err(shape_err(
            "k",
            format!("(a divisor of {batch_q}, a divisor of {heads}, k_len, {head_dim}) to match q"),
            k,
        ));
    }
    if v.dims() != k.dims() {
        return Err(shape_err("v", format!("{:?} like k", k.dims()), v));
    }
    // Keys and values have the queries' dtype, or one 16-bit float
    // dtype under f32 queries (a quantized model's image cache: half
    // the bytes, read in place by the per-row kernel).
    // q8 rows likewise, under f32 queries.
    let kv_dtype = match (q.dtype(), k.dtype()) {
        (DType::F32, small @ (DType::BF16 | DType::F16 | DType::U8)) => small,
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
    Ok(Dims {
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
    let dims = check_dims(q, k, v, mask)?;
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

/// Scaled dot-product attention with additive float biases on the scaled
/// scores, `softmax(q kᵀ · scale + Σ bias) v`: Swin's windowed attention
/// (a relative position bias per head, and for shifted windows a mask of
/// 0 and -100 per window). On the CPU, unless `backend` is
/// [`Backend::Reference`], the tiled kernel adds them to each tile of
/// scores (the scores are never written out); otherwise the reference
/// path adds them to the whole score tensor.
///
/// # Shapes
/// - `q`: `(batch, heads, q_len, head_dim)`; `k`, `v`: `(batch, heads,
///   k_len, head_dim)` (one key head per query head, one key sample per
///   query sample)
/// - each bias: `(bias_batch, 1 | heads, q_len, k_len)`, `bias_batch`
///   dividing `batch`: query sample `b` reads bias sample `b % bias_batch`
///   (image `i`'s window `w` is sample `i · windows + w`: a per-window
///   mask has `windows` samples)
/// - returns `(batch, heads, q_len, head_dim)` in `q`'s dtype
///
/// # Errors
/// [`AttnError::Shape`] naming `k`, `v` or `biases[i]` when it does not
/// fit `q`; [`AttnError::DType`]/[`AttnError::Device`] naming the input
/// not in `q`'s dtype or on its device; [`AttnError::Argument`] naming
/// `biases` past four of them.
pub fn attention_with_bias(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    biases: &[&Tensor],
    scale: f64,
    backend: Backend,
) -> Result<Tensor> {
    let dims = check_dims(q, k, v, None)?;
    let shape_err = |arg, expected: String, t: &Tensor| AttnError::Shape {
        arg,
        expected,
        actual: t.dims().to_vec(),
    };
    if dims.batch_k != dims.batch_q || dims.kv_heads != dims.heads {
        return Err(shape_err(
            "k",
            format!(
                "({}, {}, k_len, {}) like q: biased attention shares no keys",
                dims.batch_q, dims.heads, dims.head_dim
            ),
            k,
        ));
    }
    const NAMES: [&str; 4] = ["biases[0]", "biases[1]", "biases[2]", "biases[3]"];
    if biases.len() > NAMES.len() {
        return Err(AttnError::Argument {
            arg: "biases",
            reason: format!(
                "expected at most {} biases, got {}",
                NAMES.len(),
                biases.len()
            ),
        });
    }
    for (bias, name) in biases.iter().zip(NAMES) {
        let fits = match bias.dims() {
            &[nb, nh, tq, tk] => {
                nb > 0
                    && dims.batch_q % nb == 0
                    && (nh == 1 || nh == dims.heads)
                    && tq == dims.q_len
                    && tk == dims.k_len
            }
            _ => false,
        };
        if !fits {
            return Err(shape_err(
                name,
                format!(
                    "(a divisor of {}, 1 or {}, {}, {})",
                    dims.batch_q, dims.heads, dims.q_len, dims.k_len
                ),
                bias,
            ));
        }
        crate::error::check_dtype_device(name, bias, "q", q.dtype(), q.device())?;
    }
    let fused = backend != Backend::Reference && q.device().is_cpu();
    if fused && dims.head_dim > 0 && dims.k_len > 0 {
        let f32_contiguous = |t: &Tensor| -> Result<Tensor> { widened(t, DType::F32) };
        let host = biases
            .iter()
            .map(|b| -> Result<crate::kernels::attention::HostBias> {
                let (nb, nh, tq, tk) = b.dims4()?;
                // Key-major (the kernel's layout): a copy in any case, and
                // none but that copy for a bias passed as the transposed
                // view of a key-major tensor (as Swin keeps its own).
                let key_major = b.to_dtype(DType::F32)?.transpose(2, 3)?.contiguous()?;
                Ok(crate::kernels::attention::HostBias {
                    data: key_major.flatten_all()?.to_vec1::<f32>()?,
                    batch: nb,
                    heads: nh,
                    q_len: tq,
                    k_len: tk,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let out = crate::kernels::attention::fused(
            &f32_contiguous(q)?,
            &f32_contiguous(k)?,
            &f32_contiguous(v)?,
            dims,
            scale as f32,
            None,
            host,
            CpuFeatures::get().isa(),
        )?;
        return Ok(out.to_dtype(q.dtype())?);
    }
    // (batch / nb, nb, heads, q_len, k_len) + (1, nb, 1 | heads, q_len, k_len)
    let (b, h, tq, tk) = (dims.batch_q, dims.heads, dims.q_len, dims.k_len);
    let mut scores = (q.matmul(&k.t()?)? * scale)?;
    for bias in biases {
        let (nb, nh, _, _) = bias.dims4()?;
        let bias = bias
            .to_dtype(scores.dtype())?
            .reshape((1, nb, nh, tq, tk))?;
        scores = scores
            .reshape((b / nb, nb, h, tq, tk))?
            .broadcast_add(&bias)?
            .reshape((b, h, tq, tk))?;
    }
    let probs = softmax(&scores.to_dtype(DType::F32)?, false)?.to_dtype(v.dtype())?;
    Ok(probs.matmul(v)?)
}

/// [`attention`] (without weights, dropout or gradients) of consecutive
/// groups of the rows of `q (rows, heads, q_len, head_dim)`, each `(rows,
/// k, v, mask)` over its own keys and values, in one pass of the CPU's
/// per-row kernel — what requests decoding side by side run, each over
/// its image and its own text cache. `None` when that kernel does not
/// serve them all (not the CPU, `q` not f32, [`Backend::Reference`], a
/// group the tiled kernel takes, keys and values of mixed dtypes or not
/// readable in place): the caller then runs [`attention`] group by group.
/// Each row's output is the one [`attention`] gives it, bit for bit.
///
/// # Errors
/// As [`attention`], naming the input of a group that does not fit its
/// queries.
pub(crate) fn fused_row_groups(
    q: &Tensor,
    groups: &[(usize, &Tensor, &Tensor, Option<&Mask>)],
    scale: f64,
    backend: Backend,
) -> Result<Option<Tensor>> {
    if backend == Backend::Reference
        || !q.device().is_cpu()
        || q.dtype() != DType::F32
        || q.track_op()
    {
        return Ok(None);
    }
    let dtype = match groups.first() {
        Some((_, k, _, _)) => k.dtype(),
        None => return Ok(None),
    };
    let mut parts = Vec::with_capacity(groups.len());
    let mut start = 0;
    for &(rows, k, v, mask) in groups {
        let qg = q.narrow(0, start, rows)?;
        start += rows;
        let dims = check_dims(&qg, k, v, mask)?;
        if dims.tiled()
            || k.dtype() != dtype
            || !readable_in_place(k, v, dims)
            || k.track_op()
            || v.track_op()
        {
            return Ok(None);
        }
        let mask = host_mask(mask)?;
        parts.push(crate::kernels::attention::RowGroup { k, v, dims, mask });
    }
    let out = crate::kernels::attention::fused_groups(
        &q.contiguous()?,
        parts,
        scale as f32,
        CpuFeatures::get().isa(),
    )?;
    Ok(Some(out))
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
    // 16-bit keys and values (or q8 rows) under f32 queries: widened here.
    let (k, v) = (&widened(k, q.dtype())?, &widened(v, q.dtype())?);
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

/// Whether the CPU kernels read `k` and `v` where they lie: contiguous
/// heads with one head stride (a KV cache's prefix), f32, or 16-bit or
/// q8 rows for the per-row kernel (which widens them as it reads).
/// Otherwise they are copied to f32.
fn readable_in_place(k: &Tensor, v: &Tensor, dims: Dims) -> bool {
    let element = match k.dtype() {
        DType::F32 => true,
        DType::BF16 | DType::F16 | DType::U8 => !dims.tiled(),
        _ => false,
    };
    element
        && v.dtype() == k.dtype()
        && is_head_strided(k)
        && is_head_strided(v)
        && k.stride() == v.stride()
}

/// Keys or values `(batch, kv_heads, len, head_dim)` of f32 as q8 rows:
/// `(batch, kv_heads, len, head_dim / 32 · 34)` u8, each head's row of
/// `head_dim` values as blocks of GGML's `block_q8_0` (an f16 scale and
/// 32 signed bytes; see [`crate::kernels::kv_q8`] for the rounding). Half
/// the bytes of bf16; every attention path takes them under f32 queries
/// (the CPU's per-row kernel reads them in place, the others widen them
/// first, [`widen_kv`]).
///
/// # Errors
/// [`AttnError::Shape`] naming `kv` when it is not 4-d with a head width
/// that is a multiple of 32; [`AttnError::DType`] when it is not f32.
pub fn quantize_kv(kv: &Tensor) -> Result<Tensor> {
    let (b, h, len, hd) = kv.dims4().map_err(|_| AttnError::Shape {
        arg: "kv",
        expected: "(batch, kv_heads, len, head_dim)".into(),
        actual: kv.dims().to_vec(),
    })?;
    crate::error::check_dtype_device("kv", kv, "f32 keys or values", DType::F32, kv.device())?;
    // Read in place where it can be: a decode step quantizes each layer's
    // new keys and values.
    crate::kernels::with_values(kv, |values: &[f32]| {
        q8_rows(values, &[b, h, len, hd], kv.device())
    })?
}

/// `values` (row-major, of `dims`, the last the head width) as q8 rows on
/// `device`: the last dimension becomes its blocks' bytes.
///
/// # Errors
/// [`AttnError::Shape`] naming `kv` when the head width is not a multiple
/// of 32.
pub(crate) fn q8_rows(
    values: &[f32],
    dims: &[usize],
    device: &candle_core::Device,
) -> Result<Tensor> {
    use crate::kernels::kv_q8;
    let hd = dims.last().copied().unwrap_or(0);
    if !hd.is_multiple_of(kv_q8::BLOCK_VALUES) {
        return Err(AttnError::Shape {
            arg: "kv",
            expected: format!("a head width that is a multiple of {}", kv_q8::BLOCK_VALUES),
            actual: dims.to_vec(),
        });
    }
    let mut shape = dims.to_vec();
    if let Some(last) = shape.last_mut() {
        *last = kv_q8::row_bytes(hd);
    }
    let blocks = kv_q8::quantize(values, CpuFeatures::get().isa());
    Ok(Tensor::from_vec(blocks, shape, device)?)
}

/// The values of q8 rows ([`quantize_kv`]) as `(batch, kv_heads, len,
/// head_dim)` of `dtype`.
///
/// # Errors
/// [`AttnError::Shape`] naming `kv` when it is not 4-d u8 rows of whole
/// blocks.
pub fn widen_kv(kv: &Tensor, dtype: DType) -> Result<Tensor> {
    use crate::kernels::kv_q8;
    let bad = || AttnError::Shape {
        arg: "kv",
        expected: format!(
            "q8 rows (batch, kv_heads, len, a multiple of {} bytes) of u8",
            kv_q8::BLOCK_BYTES
        ),
        actual: kv.dims().to_vec(),
    };
    let (b, h, len, bytes) = kv.dims4().map_err(|_| bad())?;
    let hd = kv_q8::row_values(bytes).ok_or_else(bad)?;
    if kv.dtype() != DType::U8 {
        return Err(bad());
    }
    let values = crate::kernels::with_values(kv, kv_q8::widen)?;
    Ok(Tensor::from_vec(values, (b, h, len, hd), kv.device())?.to_dtype(dtype)?)
}

/// `t` in `dtype`, contiguous: q8 rows widened ([`widen_kv`]), other
/// dtypes cast.
fn widened(t: &Tensor, dtype: DType) -> Result<Tensor> {
    match t.dtype() {
        DType::U8 => widen_kv(t, dtype),
        _ => Ok(t.to_dtype(dtype)?.contiguous()?),
    }
}

/// A mask's bytes on the host, as the CPU kernels read them.
fn host_mask(mask: Option<&Mask>) -> Result<Option<HostMask>> {
    let Some(m) = mask else {
        return Ok(None);
    };
    let (batch, q_len, _) = m.dims();
    let data = m.tensor().flatten_all()?.to_vec1::<u8>()?;
    Ok(Some(HostMask { data, batch, q_len }))
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
    let f32_contiguous = |t: &Tensor| -> Result<Tensor> { widened(t, DType::F32) };
    let mask = host_mask(mask)?;
    let (k, v) = if readable_in_place(k, v, dims) {
        (k.clone(), v.clone())
    } else {
        (f32_contiguous(k)?, f32_contiguous(v)?)
    };
    let isa = CpuFeatures::get().isa();
    let out = crate::kernels::attention::fused(
        &f32_contiguous(q)?,
        &k,
        &v,
        dims,
        scale as f32,
        mask,
        Vec::new(),
        isa,
    )?;
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
    // Checked by `check_dims`: the whole score count, in bytes, fits.
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Groups of decode rows side by side (a server's requests: each over
    /// its own image or text cache, of its own length, with or without a
    /// mask) in one pass equal each group run alone, bit for bit, for f32
    /// and 16-bit keys and values; a group the tiled kernel takes, or keys
    /// of mixed dtypes, leave it to the caller (`None`).
    #[test]
    fn grouped_rows_equal_each_group_alone() -> Result<()> {
        let dev = Device::Cpu;
        let (heads, hd) = (4, 32);
        // (rows, k_len, masked)
        let shapes = [
            (1usize, 5usize, false),
            (2, 197, true),
            (1, 33, false),
            (3, 1, false),
        ];
        let rows: usize = shapes.iter().map(|s| s.0).sum();
        let q = Tensor::randn(0f32, 1., (rows, heads, 1, hd), &dev)?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let kvs: Vec<(Tensor, Tensor, Option<Mask>)> = shapes
                .iter()
                .map(|&(r, k_len, masked)| -> Result<_> {
                    let k =
                        Tensor::randn(0f32, 1., (r, heads, k_len, hd), &dev)?.to_dtype(dtype)?;
                    let v =
                        Tensor::randn(0f32, 1., (r, heads, k_len, hd), &dev)?.to_dtype(dtype)?;
                    let mask = masked
                        .then(|| -> Result<Mask> {
                            let open: Vec<u8> =
                                (0..r * k_len).map(|j| u8::from(j % 3 != 0)).collect();
                            Mask::new(Tensor::from_vec(open, (r, 1, k_len), &dev)?)
                        })
                        .transpose()?;
                    Ok((k, v, mask))
                })
                .collect::<Result<_>>()?;
            let parts: Vec<(usize, &Tensor, &Tensor, Option<&Mask>)> = shapes
                .iter()
                .zip(&kvs)
                .map(|(s, (k, v, m))| (s.0, k, v, m.as_ref()))
                .collect();
            let got = fused_row_groups(&q, &parts, 0.3, Backend::Auto)?.expect("one pass");
            let mut start = 0;
            let mut alone = Vec::new();
            for &(r, k, v, m) in &parts {
                let qg = q.narrow(0, start, r)?;
                start += r;
                alone.push(attention(&qg, k, v, m, 0.3, Backend::Fused, Weights::Skip)?.output);
            }
            let want = Tensor::cat(&alone, 0)?;
            let diff = (got - &want)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "{dtype:?}");
            assert!(fused_row_groups(&q, &parts, 0.3, Backend::Reference)?.is_none());
        }
        // Four rows over one key sample: the tiled kernel's, not this pass's.
        let k = Tensor::randn(0f32, 1., (1, heads, 9, hd), &dev)?;
        let q4 = q.narrow(0, 0, 4)?;
        assert!(fused_row_groups(&q4, &[(4, &k, &k, None)], 0.3, Backend::Auto)?.is_none());
        // Keys of two dtypes across groups.
        let kh = k.to_dtype(DType::BF16)?;
        let q2 = q.narrow(0, 0, 2)?;
        let mixed = [(1, &k, &k, None), (1, &kh, &kh, None)];
        assert!(fused_row_groups(&q2, &mixed, 0.3, Backend::Auto)?.is_none());
        Ok(())
    }

    /// The per-row kernel (fewer than [`TILED_MIN_ROWS`] rows per key
    /// head: decode steps) on every instruction set this CPU has against
    /// the reference: key counts past and off the vector width, head
    /// widths 7, 16, 32, 64, 80, 96 (the AVX-512 kernel's passes of 64 columns
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
            (2, 2, 2, 1, 1, 23, 96, true),
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
            let dims = check_dims(&q, &k, &v, mask.as_ref())?;
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
            for isa in CpuFeatures::get().isas() {
                let mask = || {
                    bytes.clone().map(|data| HostMask {
                        data,
                        batch: bq,
                        q_len: ql,
                    })
                };
                let run = |k: &Tensor, v: &Tensor| {
                    crate::kernels::attention::fused(
                        &q,
                        k,
                        v,
                        dims,
                        scale as f32,
                        mask(),
                        Vec::new(),
                        isa,
                    )
                };
                let got = run(&k, &v)?;
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
                    let widened = run(&kh.to_dtype(DType::F32)?, &vh.to_dtype(DType::F32)?)?;
                    let got = run(&kh, &vh)?;
                    let err = (&got - &widened)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(err < 1e-5, "{isa:?} {half:?}: {err}");
                }
                // q8 rows (whole blocks of 32), read in place, likewise.
                if hd % 32 == 0 {
                    let (kq, vq) = (quantize_kv(&k)?, quantize_kv(&v)?);
                    let widened = run(&widen_kv(&kq, DType::F32)?, &widen_kv(&vq, DType::F32)?)?;
                    let got = run(&kq, &vq)?;
                    let err = (&got - &widened)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(
                        err < 1e-5,
                        "{isa:?} q8 {:?}: {err}",
                        (bq, heads, ql, kl, hd)
                    );
                    if masked {
                        let closed = got.get(1)?.narrow(1, 0, 1)?.abs()?.max_all()?;
                        assert_eq!(closed.to_scalar::<f32>()?, 0.0, "{isa:?} q8");
                    }
                }
            }
        }
        Ok(())
    }

    /// q8 rows ([`quantize_kv`]) on every path give what their widening
    /// ([`widen_kv`]) gives: the per-row kernel in place (one row, beams
    /// under `TILED_MIN_ROWS`, grouped passes of several groups), the tiled
    /// kernel, the reference path with its weights, and a cache's strided
    /// prefix; a head width off the blocks and the wrong dtype are refused,
    /// named. Max abs error 1e-5.
    #[test]
    fn q8_rows_attend_as_their_widening() -> Result<()> {
        let dev = Device::Cpu;
        let (heads, hd) = (4, 64);
        let close = |a: &Tensor, b: &Tensor, what: &str| -> Result<()> {
            let err = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(err < 1e-5, "{what}: {err}");
            Ok(())
        };
        for (bq, bk, q_len, k_len) in [(1, 1, 1, 197), (3, 1, 1, 50), (2, 2, 9, 70)] {
            let q = Tensor::randn(0f32, 1., (bq, heads, q_len, hd), &dev)?;
            let k = Tensor::randn(0f32, 1., (bk, heads, k_len, hd), &dev)?;
            let v = Tensor::randn(0f32, 1., (bk, heads, k_len, hd), &dev)?;
            let (kq, vq) = (quantize_kv(&k)?, quantize_kv(&v)?);
            assert_eq!(kq.dims(), &[bk, heads, k_len, 68]);
            let (kw, vw) = (widen_kv(&kq, DType::F32)?, widen_kv(&vq, DType::F32)?);
            let at = format!("{:?}", (bq, bk, q_len, k_len));
            for backend in [Backend::Auto, Backend::Fused, Backend::Reference] {
                let want = attention(&q, &kw, &vw, None, 0.125, backend, Weights::Skip)?.output;
                let got = attention(&q, &kq, &vq, None, 0.125, backend, Weights::Skip)?.output;
                close(&got, &want, &format!("{at} {backend:?}"))?;
            }
            let want = attention(&q, &kw, &vw, None, 0.125, Backend::Auto, Weights::Return)?;
            let got = attention(&q, &kq, &vq, None, 0.125, Backend::Auto, Weights::Return)?;
            close(&got.output, &want.output, &format!("{at} weights"))?;
            close(
                got.weights.as_ref().expect("weights"),
                want.weights.as_ref().expect("weights"),
                &format!("{at} weights"),
            )?;
        }
        // Groups side by side, each over its own q8 rows, one a cache's
        // strided prefix: the same rows as each group alone.
        let q = Tensor::randn(0f32, 1., (3, heads, 1, hd), &dev)?;
        let k1 = quantize_kv(&Tensor::randn(0f32, 1., (1, heads, 30, hd), &dev)?)?;
        let v1 = quantize_kv(&Tensor::randn(0f32, 1., (1, heads, 30, hd), &dev)?)?;
        let kbuf = quantize_kv(&Tensor::randn(0f32, 1., (2, heads, 40, hd), &dev)?)?;
        let vbuf = quantize_kv(&Tensor::randn(0f32, 1., (2, heads, 40, hd), &dev)?)?;
        let (k2, v2) = (kbuf.narrow(2, 0, 25)?, vbuf.narrow(2, 0, 25)?);
        assert!(!k2.is_contiguous() && is_head_strided(&k2));
        let parts = [(1, &k1, &v1, None), (2, &k2, &v2, None)];
        let got = fused_row_groups(&q, &parts, 0.125, Backend::Auto)?.expect("one pass");
        let mut start = 0;
        for (rows, k, v, _) in parts {
            let (kw, vw) = (widen_kv(k, DType::F32)?, widen_kv(v, DType::F32)?);
            let qg = q.narrow(0, start, rows)?;
            let want = attention(
                &qg,
                &kw,
                &vw,
                None,
                0.125,
                Backend::Reference,
                Weights::Skip,
            )?;
            close(&got.narrow(0, start, rows)?, &want.output, "groups")?;
            start += rows;
        }
        // Refused, named.
        let odd = Tensor::randn(0f32, 1., (1, 2, 5, 48), &dev)?;
        assert!(quantize_kv(&odd).unwrap_err().to_string().contains("kv"));
        assert!(quantize_kv(&odd.to_dtype(DType::BF16)?.narrow(3, 0, 32)?).is_err());
        assert!(widen_kv(&Tensor::zeros((1, 2, 5, 64), DType::U8, &dev)?, DType::F32).is_err());
        let q16 = Tensor::randn(0f32, 1., (1, 2, 1, 64), &dev)?.to_dtype(DType::BF16)?;
        let k = quantize_kv(&Tensor::randn(0f32, 1., (1, 2, 5, 64), &dev)?)?;
        let err = attention(&q16, &k, &k, None, 0.1, Backend::Auto, Weights::Skip).unwrap_err();
        assert!(err.to_string().contains('k'), "{err}");
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

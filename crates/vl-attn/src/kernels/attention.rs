//! The fused attention kernel on the CPU: for each query row, scores
//! against its keys, a softmax and the weighted values, in f32, either
//! tiled ([`crate::kernels::tiled`]: blocks of queries against blocks of
//! keys with an online softmax) when at least [`TILED_MIN_ROWS`] query
//! rows share a key head, or one row at a time (a decode step's rows,
//! whose keys and values may be 16-bit and are widened as they are read).
//!
//! The layer's entry point is [`crate::attention::attention`]; this is
//! what it runs on the CPU for [`crate::Backend::Fused`] and
//! [`crate::Backend::Auto`].

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::features::Simd;
use super::features::{CpuFeatures, Isa, PrefetchHint};
use super::gemv::{prefetch, Weight};
use super::host::{contiguous, leaf_len};
#[cfg(target_arch = "x86_64")]
use super::micro::Fma;
use super::micro::{madd, Kernel};
use super::tiled::exp_neg;

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

/// The fused CPU kernel: the tiled kernel when enough queries share each
/// key head ([`TILED_MIN_ROWS`]); otherwise, for each query row, scores
/// against every key in f32 (one row of `k_len` floats per thread),
/// softmax, weighted sum of values. Inputs are contiguous f32.
struct FusedCpu {
    dims: Dims,
    scale: f32,
    mask: Option<HostMask>,
    /// Additive biases on the scores: the tiled kernel runs whatever the
    /// row count.
    biases: Vec<HostBias>,
    /// The instruction set of the per-row kernel (the tiled one's too).
    isa: Isa,
    /// The per-row kernel's prefetch hint (the CPU's [`Tuning`]), read
    /// once per call rather than per row.
    ///
    /// [`Tuning`]: super::features::Tuning
    prefetch: PrefetchHint,
}

/// The fused kernel over `q (batch_q, heads, q_len, head_dim)` f32 and
/// `k`, `v (batch_k, kv_heads, k_len, head_dim)` (f32, or bf16/f16 for the
/// per-row kernel; head-strided, see [`is_head_strided`]), checked by the
/// layer into `dims`, on `isa`: `(batch_q, heads, q_len, head_dim)` f32.
/// With `biases` (additive, on the scaled scores) the tiled kernel runs
/// whatever the row count, over f32 keys and values.
///
/// # Errors
/// Inputs that do not fit `dims`, named.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dims: Dims,
    scale: f32,
    mask: Option<HostMask>,
    biases: Vec<HostBias>,
    isa: Isa,
) -> candle_core::Result<Tensor> {
    q.apply_op3_no_bwd(
        k,
        v,
        &FusedCpu {
            dims,
            scale,
            mask,
            biases,
            isa,
            prefetch: CpuFeatures::get().tuning.prefetch,
        },
    )
}

/// One group of [`fused_groups`]: its keys and values (f32, or bf16/f16;
/// head-strided, see [`is_head_strided`]), their dimensions against the
/// group's queries (checked by the layer) and its mask.
pub(crate) struct RowGroup<'a> {
    pub(crate) k: &'a Tensor,
    pub(crate) v: &'a Tensor,
    pub(crate) dims: Dims,
    pub(crate) mask: Option<HostMask>,
}

/// The per-row kernel over several groups of query rows at once, each
/// with its own keys and values (requests decoding side by side, each
/// over its image and its own text cache): `q (rows, heads, q_len,
/// head_dim)` f32, contiguous, the groups' query samples in order (group
/// `i` has `groups[i].dims.batch_q` of them) → `(rows, heads, q_len,
/// head_dim)` f32. One pass over the pool for every group's rows, where a
/// call per group would split each group's few rows (a decode step: one
/// per head) over the pool on its own. Each row computes what
/// [`fused`] gives it in its group alone, bit for bit.
///
/// # Errors
/// Keys and values of different dtypes across groups or not f32/bf16/f16,
/// not head-strided, or `q` not contiguous f32 on the CPU, named.
pub(crate) fn fused_groups(
    q: &Tensor,
    groups: Vec<RowGroup<'_>>,
    scale: f32,
    isa: Isa,
) -> candle_core::Result<Tensor> {
    use candle_core::{DType, Storage};
    let (q_storage, q_layout) = q.storage_and_layout();
    let q_data: &[f32] = match &*q_storage {
        Storage::Cpu(CpuStorage::F32(d)) => contiguous(d, q_layout, "grouped attention", "q")?,
        _ => candle_core::bail!("grouped attention: q must be f32 on the CPU"),
    };
    // Keys and values of another dtype than the first group's fail their
    // `as_slice` below, named by candle.
    let out = match groups.first().map_or(DType::F32, |g| g.k.dtype()) {
        DType::F32 => run_groups::<f32>(q_data, groups, scale, isa)?,
        DType::BF16 => run_groups::<half::bf16>(q_data, groups, scale, isa)?,
        DType::F16 => run_groups::<half::f16>(q_data, groups, scale, isa)?,
        DType::U8 => run_groups::<u8>(q_data, groups, scale, isa)?,
        other => candle_core::bail!("grouped attention: keys and values of {other:?}"),
    };
    drop(q_storage);
    Tensor::from_vec(out, q.shape(), q.device())
}

/// [`fused_groups`] for keys and values of element type `E`.
fn run_groups<E: RowKv + candle_core::WithDType>(
    q: &[f32],
    groups: Vec<RowGroup<'_>>,
    scale: f32,
    isa: Isa,
) -> candle_core::Result<Vec<f32>> {
    use candle_core::Storage;
    // The keys' and values' storage, held read for the pass.
    let guards: Vec<_> = groups
        .iter()
        .map(|g| (g.k.storage_and_layout(), g.v.storage_and_layout()))
        .collect();
    let mut ops = Vec::with_capacity(groups.len());
    let mut kvs: Vec<KeysValues<'_, E>> = Vec::with_capacity(groups.len());
    for (g, ((ks, kl), (vs, vl))) in groups.into_iter().zip(&guards) {
        let (Storage::Cpu(k), Storage::Cpu(v)) = (&**ks, &**vs) else {
            candle_core::bail!("grouped attention: keys and values must be on the CPU");
        };
        kvs.push(keys_values(
            (k.as_slice::<E>()?, kl),
            (v.as_slice::<E>()?, vl),
            g.dims,
        )?);
        ops.push(FusedCpu {
            dims: g.dims,
            scale,
            mask: g.mask,
            biases: Vec::new(),
            isa,
            prefetch: CpuFeatures::get().tuning.prefetch,
        });
    }
    let len: usize = ops
        .iter()
        .map(|op| op.dims.batch_q * op.dims.heads * op.dims.q_len * op.dims.head_dim)
        .sum();
    if len != q.len() {
        candle_core::bail!(
            "grouped attention: the groups' queries ({len} values) are not q's ({})",
            q.len()
        );
    }
    let mut out = vec![0f32; len];
    let groups: Vec<(&FusedCpu, KeysValues<'_, E>)> = ops.iter().zip(kvs).collect();
    rows(&groups, q, &mut out);
    Ok(out)
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

/// An additive float bias on the scaled scores of `(batch, heads, q_len,
/// k_len)`, its batch and head extents each 1 (broadcast) or more: query
/// sample `b` reads the bias's sample `b % batch` (a Swin stage's windows:
/// image `i`'s window `w` is sample `i · windows + w`, the shifted-window
/// mask has one sample per window), head `h` reads head `h` (or the one
/// head there is). Held key-major, `(batch, heads, k_len, q_len)`: the
/// tiled kernel's score tiles have a key per row and a query per lane, so
/// that a key's bias over a task's consecutive queries is one contiguous
/// run, added as a vector.
pub(crate) struct HostBias {
    pub(crate) data: Vec<f32>,
    pub(crate) batch: usize,
    pub(crate) heads: usize,
    pub(crate) q_len: usize,
    pub(crate) k_len: usize,
}

impl HostBias {
    /// The bias of query sample `b`, head `h` at key `j`, for the `len`
    /// positions from `i`.
    pub(crate) fn lanes(&self, b: usize, h: usize, j: usize, i: usize, len: usize) -> &[f32] {
        let b = b % self.batch;
        let h = if self.heads == 1 { 0 } else { h };
        &self.data[((b * self.heads + h) * self.k_len + j) * self.q_len + i..][..len]
    }

    /// The bias of query sample `b`, head `h`, position `i` at key `j`.
    pub(crate) fn at(&self, b: usize, h: usize, i: usize, j: usize) -> f32 {
        self.lanes(b, h, j, i, 1)[0]
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

/// How far ahead of the key being scored the per-row kernels ask for
/// keys. One head's keys in a decode step are short streams (8–32 KB:
/// 128–512 positions of 64 values), each a fresh start for the
/// hardware's prefetcher, which also stops at every 4 KB page. A 16-row
/// `vl serve` step of vit-gpt2 q8_0 (Xeon model 167, p50 over 482
/// steps, interleaved runs): no prefetch 25.8–27.2 ms; 1 KB ahead
/// 23.1–23.6, 2 KB 23.4–23.9, 4 KB 24.0–24.4.
const KV_AHEAD: usize = 2048;

/// Asks, with the CPU's hint, for the keys [`KV_AHEAD`] bytes past key
/// `j`'s row and for value `j`'s row (read after the softmax: both
/// streams are then in flight while the scores are computed); rows of
/// `head_dim` elements from `keys` and `values`. A prefetch never faults:
/// addresses past the ends are harmless.
#[inline(always)]
fn prefetch_key_value<E>(
    keys: *const E,
    values: *const E,
    j: usize,
    head_dim: usize,
    hint: PrefetchHint,
) {
    let bytes = head_dim * std::mem::size_of::<E>();
    let k = keys.cast::<u8>().wrapping_add(j * bytes);
    let v = values.cast::<u8>().wrapping_add(j * bytes);
    let mut line = 0;
    while line < bytes {
        prefetch(k.wrapping_add(line), KV_AHEAD, hint);
        prefetch(v.wrapping_add(line), 0, hint);
        line += 64;
    }
}

/// The scores' softmax without its division, in place: `exp(s - max)`
/// (closed keys, -inf, exactly 0); returns `1 / Σ`.
#[inline(always)]
fn softmax_generic<K: Kernel>(scores: &mut [f32], max: f32) -> f32 {
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = exp_neg::<K>(*s - max);
        sum += *s;
    }
    1.0 / sum
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
    } = op.row_inputs(row, q, kv, op.dims.head_dim);
    let (kp, vp, hint) = (keys.as_ptr(), values.as_ptr(), op.prefetch);
    let keys = keys.chunks_exact(head_dim);
    let mut max = f32::NEG_INFINITY;
    let mut any = false;
    match allowed {
        None => {
            for (j, (s, k_row)) in scores.iter_mut().zip(keys).enumerate() {
                prefetch_key_value(kp, vp, j, head_dim, hint);
                *s = dot::<K, E>(q_row, k_row) * op.scale;
                max = max.max(*s);
            }
            any = k_len > 0;
        }
        Some(allowed) => {
            for (j, ((s, k_row), &open)) in scores.iter_mut().zip(keys).zip(allowed).enumerate() {
                prefetch_key_value(kp, vp, j, head_dim, hint);
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
    let inv = softmax_generic::<K>(scores, max);
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

super::micro::per_isa! {
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

/// Keys and values as the per-row kernel reads them: floats (f32, or
/// 16-bit ones widened as they are read), or q8 rows (bytes of
/// [`super::kv_q8`] blocks).
trait RowKv: Copy + Send + Sync {
    /// Elements of one key or value row of `head_dim` values.
    fn width(head_dim: usize) -> usize;

    /// One query row of `op` (see [`row`]).
    fn row(
        op: &FusedCpu,
        row: usize,
        q: &[f32],
        kv: KeysValues<'_, Self>,
        scores: &mut [f32],
        out: &mut [f32],
    );
}

macro_rules! float_row_kv {
    ($($t:ty),*) => {$(
        impl RowKv for $t {
            fn width(head_dim: usize) -> usize {
                head_dim
            }

            fn row(
                op: &FusedCpu,
                r: usize,
                q: &[f32],
                kv: KeysValues<'_, Self>,
                scores: &mut [f32],
                out: &mut [f32],
            ) {
                row(op, r, q, kv, scores, out)
            }
        }
    )*};
}
float_row_kv!(f32, half::bf16, half::f16);

impl RowKv for u8 {
    fn width(head_dim: usize) -> usize {
        super::kv_q8::row_bytes(head_dim)
    }

    fn row(
        op: &FusedCpu,
        r: usize,
        q: &[f32],
        kv: KeysValues<'_, Self>,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if op.isa.simd() == Simd::Avx512 {
            // SAFETY: the token proves AVX-512F.
            unsafe { row_q8_avx512(op, r, q, kv, scores, out) };
            return;
        }
        row_q8_compiled(op.isa, op, r, q, kv, scores, out)
    }
}

/// One query row over q8 keys and values ([`super::kv_q8`]): a key's
/// score is the sum over its blocks of `d · Σ q_i k_i`, a value row
/// enters the output as `p_j d · v`; the softmax as [`row_generic`]'s.
#[inline(always)]
fn row_q8_generic<K: Kernel>(
    op: &FusedCpu,
    row: usize,
    q: &[f32],
    kv: KeysValues<'_, u8>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    use super::kv_q8::{scale, BLOCK_BYTES, BLOCK_VALUES};
    let Dims { head_dim, .. } = op.dims;
    let width = u8::width(head_dim);
    let RowInputs {
        q: q_row,
        keys,
        values,
        allowed,
    } = op.row_inputs(row, q, kv, width);
    let mut max = f32::NEG_INFINITY;
    for (j, (s, k_row)) in scores.iter_mut().zip(keys.chunks_exact(width)).enumerate() {
        *s = if allowed.is_some_and(|a| a[j] == 0) {
            f32::NEG_INFINITY
        } else {
            let mut acc = 0f32;
            for (qb, kb) in q_row
                .chunks_exact(BLOCK_VALUES)
                .zip(k_row.chunks_exact(BLOCK_BYTES))
            {
                let mut sum = [0f32; 8];
                for (i, (&x, &k)) in qb.iter().zip(&kb[2..]).enumerate() {
                    sum[i % 8] = madd(K::FMA, x, f32::from(k as i8), sum[i % 8]);
                }
                acc = madd(K::FMA, sum.iter().sum::<f32>(), scale(kb), acc);
            }
            acc * op.scale
        };
        max = max.max(*s);
    }
    out.fill(0.0);
    if max == f32::NEG_INFINITY {
        return;
    }
    let inv = softmax_generic::<K>(scores, max);
    for (&p, v_row) in scores.iter().zip(values.chunks_exact(width)) {
        if p == 0.0 {
            continue;
        }
        for (ob, vb) in out
            .chunks_exact_mut(BLOCK_VALUES)
            .zip(v_row.chunks_exact(BLOCK_BYTES))
        {
            let c = p * scale(vb);
            for (o, &x) in ob.iter_mut().zip(&vb[2..]) {
                *o = madd(K::FMA, c, f32::from(x as i8), *o);
            }
        }
    }
    for o in out.iter_mut() {
        *o *= inv;
    }
}

super::micro::per_isa! {
    /// [`row_q8_generic`] compiled for the op's instruction set.
    fn row_q8_compiled(
        op: &FusedCpu,
        row: usize,
        q: &[f32],
        kv: KeysValues<'_, u8>,
        scores: &mut [f32],
        out: &mut [f32],
    ) = row_q8_generic::<Fma>
}

/// [`row_q8_generic`] with AVX-512F intrinsics. Scores: per key, each
/// block's 32 products in two registers, scaled into one accumulator,
/// then a reduction of four keys' accumulators at once; the softmax of [`softmax_avx512`]; values: the
/// output in registers, 2 blocks (64 columns) a pass, two sets of
/// accumulators over alternate keys. The same results as the generic
/// kernel up to summation order.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_q8_avx512(
    op: &FusedCpu,
    row: usize,
    q: &[f32],
    kv: KeysValues<'_, u8>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    use super::kv_q8::{BLOCK_BYTES, BLOCK_VALUES};
    use std::arch::x86_64::*;
    let Dims {
        head_dim, k_len, ..
    } = op.dims;
    let width = u8::width(head_dim);
    let RowInputs {
        q: q_row,
        keys,
        values,
        allowed,
    } = op.row_inputs(row, q, kv, width);
    let scores = &mut scores[..k_len];
    let out = &mut out[..head_dim];
    let blocks = head_dim / BLOCK_VALUES;
    // SAFETY: key and value `j < k_len` span `j * width .. (j + 1) *
    // width` of `keys` and `values` (sliced to `k_len * width` above),
    // block `b < blocks` its bytes `b * 34 .. (b + 1) * 34`; the query's
    // and the output's `head_dim` values are `blocks * 32`.
    unsafe {
        let qp = q_row.as_ptr();
        let (kp0, vp0) = (keys.as_ptr(), values.as_ptr());
        // Four keys' sums reduced together (a reduction per key was a
        // third of the work).
        let scale4 = _mm_set1_ps(op.scale);
        let sp = scores.as_mut_ptr();
        let hint = op.prefetch;
        let mut j = 0;
        while j + 4 <= k_len {
            let sums = sum4([
                q8_key(qp, kp0, vp0, j, width, blocks, hint),
                q8_key(qp, kp0, vp0, j + 1, width, blocks, hint),
                q8_key(qp, kp0, vp0, j + 2, width, blocks, hint),
                q8_key(qp, kp0, vp0, j + 3, width, blocks, hint),
            ]);
            _mm_storeu_ps(sp.add(j), _mm_mul_ps(sums, scale4));
            j += 4;
        }
        for j in j..k_len {
            let acc = q8_key(qp, kp0, vp0, j, width, blocks, hint);
            *sp.add(j) = _mm512_reduce_add_ps(acc) * op.scale;
        }
        if let Some(allowed) = allowed {
            for (s, &open) in scores.iter_mut().zip(allowed) {
                if open == 0 {
                    *s = f32::NEG_INFINITY;
                }
            }
        }
        let Some(inv) = softmax_avx512(scores) else {
            out.fill(0.0);
            return;
        };
        let inv = _mm512_set1_ps(inv);
        let mut b = 0;
        while b < blocks {
            let n = (blocks - b).min(2);
            let (vp, o) = (vp0.add(b * BLOCK_BYTES), out.as_mut_ptr().add(32 * b));
            match n {
                2 => q8_values_pass::<2>(scores, vp, width, inv, o),
                _ => q8_values_pass::<1>(scores, vp, width, inv, o),
            }
            b += n;
        }
    }
}

/// Key `j`'s products with the query at `q`, block by block, each block's
/// sum scaled, in one register (its lanes' sum is the score); asks for
/// the key [`KV_AHEAD`] bytes on and for value `j`.
///
/// # Safety
/// Rows of `width` bytes (`blocks` blocks) at `k + j * width` and `v + j
/// * width`, `32 · blocks` floats at `q`; the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q8_key(
    q: *const f32,
    k: *const u8,
    v: *const u8,
    j: usize,
    width: usize,
    blocks: usize,
    hint: PrefetchHint,
) -> std::arch::x86_64::__m512 {
    use super::kv_q8::BLOCK_BYTES;
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let (kj, vj) = (k.add(j * width), v.add(j * width));
        // One line of each stream per 64 bytes of it, from the row's end
        // (a 68-byte row, two blocks: one; asking for both of its lines,
        // mostly the same as the last row's, cost 0.5 of 4.5 ms in
        // `decode_step_from_memory`): the hardware fills the odd line
        // left out.
        for i in 0..(width / 64).max(1) {
            prefetch(kj.add(width - 1 - 64 * i), KV_AHEAD, hint);
            prefetch(vj.add(width - 1 - 64 * i), 0, hint);
        }
        let mut acc = _mm512_setzero_ps();
        for b in 0..blocks {
            let blk = kj.add(b * BLOCK_BYTES);
            let (k0, k1) = (q8_load16(blk.add(2)), q8_load16(blk.add(18)));
            let t = _mm512_mul_ps(_mm512_loadu_ps(q.add(32 * b)), k0);
            let t = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(32 * b + 16)), k1, t);
            acc = _mm512_fmadd_ps(t, q8_scale16(blk), acc);
        }
        acc
    }
}

/// Value `j` (the row at `v + j * stride` bytes, `N` blocks) times its
/// weight `p[j]` into `acc`, the weight and each block's scale as one
/// factor; nothing for a weight of 0.
///
/// # Safety
/// `j < p.len()`, `N` blocks readable at `v + j * stride`; the CPU has
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q8_add_value<const N: usize>(
    acc: &mut [[std::arch::x86_64::__m512; 2]; N],
    p: &[f32],
    v: *const u8,
    stride: usize,
    j: usize,
) {
    use super::kv_q8::BLOCK_BYTES;
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let pj = *p.get_unchecked(j);
        if pj == 0.0 {
            return;
        }
        let (pv, row) = (_mm512_set1_ps(pj), v.add(j * stride));
        for (b, a) in acc.iter_mut().enumerate() {
            let blk = row.add(b * BLOCK_BYTES);
            let c = _mm512_mul_ps(pv, q8_scale16(blk));
            a[0] = _mm512_fmadd_ps(c, q8_load16(blk.add(2)), a[0]);
            a[1] = _mm512_fmadd_ps(c, q8_load16(blk.add(18)), a[1]);
        }
    }
}

/// The sums of four registers' lanes, `[Σ a0, Σ a1, Σ a2, Σ a3]`: halves
/// added, then three horizontal adds for all four at once.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn sum4(a: [std::arch::x86_64::__m512; 4]) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let mut h = [_mm256_setzero_ps(); 4];
        for (h, v) in h.iter_mut().zip(a) {
            let hi = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v));
            *h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(hi));
        }
        let [a0, a1, a2, a3] = h;
        let h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
    }
}

/// The 16 signed bytes at `p` as f32 lanes.
///
/// # Safety
/// 16 bytes readable at `p`; the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q8_load16(p: *const u8) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
}

/// The f16 scale of the block at `p`, as f32 in every lane (the
/// conversion in hardware: `half`'s, compiled without F16C, is a call).
///
/// # Safety
/// 2 bytes readable at `p`; the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q8_scale16(p: *const u8) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let bits = p.cast::<i16>().read_unaligned();
        _mm512_cvtph_ps(_mm256_set1_epi16(bits))
    }
}

/// `out[..32 N] = inv × Σ_j p_j d_j · v_j[..32 N]` over `N` blocks of each
/// value row (the row at `v + j * stride` bytes) for the keys whose
/// weight `p_j` is not 0; two sets of `2 N` accumulators over alternate
/// keys.
///
/// # Safety
/// `N` blocks readable at `v + j * stride` for every `j < p.len()`, `32 N`
/// floats writable at `out`; the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q8_values_pass<const N: usize>(
    p: &[f32],
    v: *const u8,
    stride: usize,
    inv: std::arch::x86_64::__m512,
    out: *mut f32,
) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let (mut even, mut odd) = ([[_mm512_setzero_ps(); 2]; N], [[_mm512_setzero_ps(); 2]; N]);
        let pairs = p.len() / 2;
        for n in 0..pairs {
            q8_add_value(&mut even, p, v, stride, 2 * n);
            q8_add_value(&mut odd, p, v, stride, 2 * n + 1);
        }
        if p.len() % 2 == 1 {
            q8_add_value(&mut even, p, v, stride, p.len() - 1);
        }
        for (b, (a, o)) in even.into_iter().zip(odd).enumerate() {
            for h in 0..2 {
                let sum = _mm512_add_ps(a[h], o[h]);
                _mm512_storeu_ps(out.add(32 * b + 16 * h), _mm512_mul_ps(sum, inv));
            }
        }
    }
}

/// One query row on the instruction set the op's token names:
/// [`row_avx512`] for AVX-512 and head widths that are a multiple of 16,
/// [`row_generic`] compiled for it otherwise.
fn row<E: Weight>(
    op: &FusedCpu,
    row: usize,
    q: &[f32],
    kv: KeysValues<'_, E>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if op.isa.simd() == Simd::Avx512 && op.dims.head_dim.is_multiple_of(16) {
        // SAFETY: the token proves AVX-512F; the head width is a multiple
        // of 16 (just checked).
        unsafe { row_avx512(op, row, q, kv, scores, out) };
        return;
    }
    row_compiled(op.isa, op, row, q, kv, scores, out)
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
unsafe fn row_avx512<E: Weight>(
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
    } = op.row_inputs(row, q, kv, op.dims.head_dim);
    let scores = &mut scores[..k_len];
    let out = &mut out[..head_dim];
    let chunks = head_dim / 16;
    // SAFETY: every pointer below stays within `q_row`, `keys`, `values`,
    // `scores` or `out` (sliced to their extents above): key `j < k_len`
    // spans `j * head_dim .. (j + 1) * head_dim`, chunks `c < chunks`.
    unsafe {
        let qp = q_row.as_ptr();
        for (j, s) in scores.iter_mut().enumerate() {
            prefetch_key_value(keys.as_ptr(), values.as_ptr(), j, head_dim, op.prefetch);
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
        let Some(inv) = softmax_avx512(scores) else {
            // No key open (or none scored above -inf): a row of zeros.
            out.fill(0.0);
            return;
        };
        let inv = _mm512_set1_ps(inv);
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

/// The scores' softmax without its division, in place: `exp(s - max)`
/// (closed keys, -inf, exactly 0), 16 at a time; returns `1 / Σ`, or
/// `None` when no key is open (no score above -inf).
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_avx512(scores: &mut [f32]) -> Option<f32> {
    use std::arch::x86_64::*;
    let k_len = scores.len();
    // SAFETY: every access is below `full <= k_len`.
    unsafe {
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
            return None;
        }
        // Closed keys (-inf) get exactly 0.
        for s in scores.iter_mut() {
            *s = exp_neg::<crate::kernels::micro::Avx512>(*s - max);
        }
        let mut vsum = _mm512_setzero_ps();
        for j in (0..full).step_by(16) {
            vsum = _mm512_add_ps(_mm512_loadu_ps(sp.add(j)), vsum);
        }
        let sum = scores[full..]
            .iter()
            .fold(_mm512_reduce_add_ps(vsum), |a, &x| a + x);
        Some(1.0 / sum)
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
unsafe fn values_pass<E: Weight, const N: usize>(
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
fn head_strided<'a, E: RowKv>(
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
        n => (n - 1) * stride + d.k_len * E::width(d.head_dim),
    };
    match data.get(l.start_offset()..l.start_offset() + len) {
        Some(slice) => Ok((slice, stride)),
        None => candle_core::bail!("fused attention: {name} {dims:?} past its buffer"),
    }
}

/// Keys and values of one element type, with their common head stride.
fn keys_values<'a, E: RowKv>(
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
    /// The inputs of query row `row = (b * heads + h) * q_len + i` (key
    /// and value rows of `width` elements): its sample's keys for `b` (beams share a sample's keys: `b / r`), the
    /// key head of `h`'s group (`h / g`).
    #[inline(always)]
    fn row_inputs<'a, E>(
        &'a self,
        row: usize,
        q: &'a [f32],
        (k, v, kv_stride): KeysValues<'a, E>,
        width: usize,
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
            keys: &k[kv_base..][..k_len * width],
            values: &v[kv_base..][..k_len * width],
            allowed: self.mask.as_ref().map(|m| m.row(b, i, k_len)),
        }
    }
}

/// The per-row kernel over every query row of `groups` (each an op and its
/// keys and values; their queries consecutive in `q`, their outputs in
/// `out`), on the pool in one pass.
fn rows<E: RowKv>(groups: &[(&FusedCpu, KeysValues<'_, E>)], q: &[f32], out: &mut [f32]) {
    // Each group's first query element, and the end of the last.
    let mut starts = Vec::with_capacity(groups.len() + 1);
    let mut at = 0;
    for (op, _) in groups {
        starts.push(at);
        let d = op.dims;
        at += d.batch_q * d.heads * d.q_len * d.head_dim;
    }
    starts.push(at);
    let head_dim = groups.first().map_or(0, |(op, _)| op.dims.head_dim);
    if head_dim == 0 {
        return;
    }
    let longest = groups
        .iter()
        .map(|(op, _)| op.dims.k_len)
        .max()
        .unwrap_or(0);
    let leaf = leaf_len(out.len() / head_dim);
    out.par_chunks_mut(head_dim)
        .enumerate()
        .with_max_len(leaf)
        .for_each_init(
            || vec![0f32; longest],
            |scores, (r, o)| {
                let e = r * head_dim;
                // The group holding element `e`: the last start at or before it.
                let gi = match groups.len() {
                    1 => 0,
                    _ => starts.partition_point(|&s| s <= e) - 1,
                };
                let ((op, kv), base) = (groups[gi], starts[gi]);
                let q_group = &q[base..starts[gi + 1]];
                let scores = &mut scores[..op.dims.k_len];
                E::row(op, (e - base) / head_dim, q_group, kv, scores, o);
            },
        );
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
        if d.tiled() || (!self.biases.is_empty() && d.head_dim > 0 && d.k_len > 0) {
            let (CpuStorage::F32(k), CpuStorage::F32(v)) = (s2, s3) else {
                candle_core::bail!("fused attention: the tiled kernel takes f32 k and v");
            };
            let (k, v, kv_stride) = keys_values((k, l2), (v, l3), d)?;
            let problem = super::tiled::Problem {
                q,
                k,
                v,
                kv_stride,
                mask: self.mask.as_ref(),
                biases: &self.biases,
                dims: d,
                scale: self.scale,
            };
            return Ok((
                CpuStorage::F32(super::tiled::run(&problem, self.isa)),
                Shape::from((d.batch_q, d.heads, d.q_len, d.head_dim)),
            ));
        }
        let mut out = vec![0f32; len];
        match (s2, s3) {
            (CpuStorage::F32(k), CpuStorage::F32(v)) => {
                rows(&[(self, keys_values((k, l2), (v, l3), d)?)], q, &mut out)
            }
            (CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                rows(&[(self, keys_values((k, l2), (v, l3), d)?)], q, &mut out)
            }
            (CpuStorage::F16(k), CpuStorage::F16(v)) => {
                rows(&[(self, keys_values((k, l2), (v, l3), d)?)], q, &mut out)
            }
            (CpuStorage::U8(k), CpuStorage::U8(v)) => {
                rows(&[(self, keys_values((k, l2), (v, l3), d)?)], q, &mut out)
            }
            _ => candle_core::bail!(
                "fused attention: k and v must be f32, bf16, f16 or q8 rows alike, got {:?} and {:?}",
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

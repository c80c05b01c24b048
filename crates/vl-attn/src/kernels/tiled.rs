//! Tiled attention on CPU: blocks of queries against blocks of keys with
//! an online softmax, f32 throughout — the fused path's kernel for every
//! query block longer than a couple of rows (prefill, a ViT's 197×197,
//! beams and grouped heads that share keys).
//!
//! Why vl owns it: the per-row kernel computes each score as a separate
//! dot product and each weighted sum one value row at a time, and the
//! reference path writes the whole score tensor and reads it back through
//! candle's softmax. Here the scores of a tile are one small matrix
//! product, `exp` is a vectorised polynomial, and the weights meet the
//! values in a second small product — the way PyTorch's CPU flash kernel
//! works, with vl's own micro-kernel instead of a BLAS call.
//!
//! # Layout of one task
//! Queries that read the same keys are one *group*: the `r` samples
//! (beams) that share a key sample and the `g` query heads that share a
//! key head, with all their positions — `r · g · q_len` virtual rows. A task
//! is up to [`BLOCK_Q`] rows of a group, and those rows are the vector
//! lanes: the task packs its queries once, transposed and scaled
//! (`head_dim × BLOCK_Q`), and then, for each block of up to [`BLOCK_K`]
//! keys,
//! 1. computes the scores transposed, `Sᵀ = K (scale · Q)ᵀ`, with the
//!    micro-kernel reading the keys where they lie (no copy), and sets
//!    masked keys to `-inf`;
//! 2. updates each row's running maximum `m` and sum `l` — lane-wise, a
//!    key at a time — rescales the rows' output accumulators by
//!    `exp(m_old - m_new)` and turns the scores into `exp(S - m_new)`;
//! 3. adds `P V` to the accumulators with the same micro-kernel, reading
//!    the values where they lie when `head_dim` is a multiple of the tile
//!    width (64, 128), from a zero-padded copy otherwise;
//!
//! skipping key blocks that the mask closes to every row of the task (a
//! causal mask's upper triangle). At the end each row is divided by its
//! `l`; a row that never saw an open key stays exactly zero.
//!
//! The micro-kernel (the `micro` module) has
//! AVX-512F intrinsics and a plain-Rust form compiled for AVX2+FMA and for
//! the target's baseline; `exp` is plain Rust that vectorises under each.
//! The best instruction set for the CPU is chosen once
//! ([`crate::kernels::CpuFeatures::isa`]).

use rayon::prelude::*;

use crate::kernels::aligned::CacheAligned;
use crate::kernels::attention::{Dims, HostBias, HostMask};
use crate::kernels::features::Isa;
#[cfg(target_arch = "x86_64")]
use crate::kernels::micro::Avx512;
use crate::kernels::micro::{madd, micro, micro_rows, Kernel, MR, NR};

/// Virtual rows per task: the lanes of the score tiles.
pub(crate) const BLOCK_Q: usize = NR;
/// Keys per block.
pub(crate) const BLOCK_K: usize = 256;

/// One attention call as the tiled kernel sees it: contiguous f32 inputs
/// `q (batch_q, heads, q_len, head_dim)`, `k`, `v (batch_k, kv_heads,
/// k_len, head_dim)`, their checked dimensions and the mask's bytes.
pub(crate) struct Problem<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// Elements between the keys (and values) of consecutive heads:
    /// `k_len * head_dim` when contiguous, more for a cache's prefix.
    pub kv_stride: usize,
    pub mask: Option<&'a HostMask>,
    /// Additive biases on the scaled scores (Swin's relative position bias
    /// and shifted-window mask), each read by every query row.
    pub biases: &'a [HostBias],
    pub dims: Dims,
    pub scale: f32,
}

impl Problem<'_> {
    /// The query/output row (in units of `head_dim`) of virtual row `v` of
    /// group `(bk, kvh)`, with its sample, head and position (for the mask
    /// and the biases).
    fn row_of(&self, bk: usize, kvh: usize, v: usize) -> (usize, usize, usize, usize) {
        let d = &self.dims;
        let (g, q_len) = (d.g(), d.q_len);
        let i = v % q_len;
        let gg = (v / q_len) % g;
        let rr = v / (q_len * g);
        let b = bk * d.r() + rr;
        let h = kvh * g + gg;
        ((b * d.heads + h) * q_len + i, b, h, i)
    }

    /// The mask bytes of sample `b`, position `i` (all keys), if any.
    fn mask_row(&self, b: usize, i: usize) -> Option<&[u8]> {
        self.mask.map(|m| m.row(b, i, self.dims.k_len))
    }
}

/// Runs the kernel: the output `(batch_q, heads, q_len, head_dim)`.
pub(crate) fn run(p: &Problem<'_>, isa: Isa) -> Vec<f32> {
    let d = &p.dims;
    let blocks = blocks_per_task(
        d.k_len * d.head_dim * 2 * std::mem::size_of::<f32>(),
        crate::kernels::CpuFeatures::get().l2_bytes,
    );
    run_with(p, isa, blocks)
}

/// [`run`] with `blocks` query blocks per task: the same values, bit for
/// bit, whatever `blocks` (each query block meets the key blocks in the
/// same order).
fn run_with(p: &Problem<'_>, isa: Isa, blocks: usize) -> Vec<f32> {
    let d = &p.dims;
    let rows = d.group_rows();
    let groups = d.batch_k * d.kv_heads;
    let tasks: Vec<(usize, usize)> = (0..groups)
        .flat_map(|grp| (0..rows).step_by(BLOCK_Q * blocks).map(move |v0| (grp, v0)))
        .collect();
    let total = d.batch_q * d.heads * d.q_len * d.head_dim;
    // Each task stores its rows where they go (in parallel: one thread
    // copying every result into place was a tenth of a Florence-2
    // encode's single-core time), into a buffer not zeroed first.
    let mut out: Vec<f32> = Vec::with_capacity(total);
    let dst = OutRows(out.as_mut_ptr());
    tasks.par_iter().for_each_init(
        || {
            (0..blocks)
                .map(|_| Scratch::new(d.head_dim))
                .collect::<Vec<_>>()
        },
        |scratch, &(grp, v0)| {
            let subs: Vec<(usize, usize)> = (v0..rows.min(v0 + BLOCK_Q * blocks))
                .step_by(BLOCK_Q)
                .map(|b0| (b0, BLOCK_Q.min(rows - b0)))
                .collect();
            let res = task(isa, p, grp, &subs, &mut scratch[..subs.len()]);
            let (bk, kvh) = (grp / d.kv_heads, grp % d.kv_heads);
            for (&(b0, _), res) in subs.iter().zip(res) {
                for (n, o) in res.chunks_exact(d.head_dim).enumerate() {
                    let (row, ..) = p.row_of(bk, kvh, b0 + n);
                    assert!(
                        (row + 1) * d.head_dim <= total,
                        "tiled: row {row} outside the output"
                    );
                    // SAFETY: the row is inside the buffer (just checked),
                    // and virtual rows map to distinct output rows, so no
                    // other task writes it.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            o.as_ptr(),
                            dst.at(row * d.head_dim),
                            d.head_dim,
                        )
                    };
                }
            }
        },
    );
    // SAFETY: the groups' virtual rows cover every output row (`groups ×
    // group_rows = batch_q × heads × q_len`), each written above.
    unsafe { out.set_len(total) };
    out
}

/// Query blocks per task, for a group's keys and values of `kv_bytes`
/// and an L2 of `l2` bytes: where they fit in half of it, one (each task
/// passes over them from the L2); past it, four, so that each block of
/// keys and values a task reads from memory serves four query blocks
/// while it is in the L2 (1024 queries over 16,384 keys a head: each
/// task of one query block read the head's 8 MB again).
fn blocks_per_task(kv_bytes: usize, l2: Option<usize>) -> usize {
    if kv_bytes <= l2.unwrap_or(2 << 20) / 2 {
        1
    } else {
        4
    }
}

/// The output of [`run`], written by its tasks at distinct rows.
struct OutRows(*mut f32);
// SAFETY: shared only by `run`'s tasks, which write distinct rows.
unsafe impl Sync for OutRows {}

impl OutRows {
    /// The element `i` on (a method, so that closures capture the whole
    /// `Sync` wrapper rather than its pointer).
    ///
    /// # Safety
    /// `i` is within the buffer.
    unsafe fn at(&self, i: usize) -> *mut f32 {
        // SAFETY: the caller's contract.
        unsafe { self.0.add(i) }
    }
}

/// A task's buffers, reused across its thread's tasks, each from a cache
/// line (the micro-kernels load and store them 64 bytes at a time).
struct Scratch {
    /// Scaled queries transposed, `(head_dim, BLOCK_Q)`, zero past the task.
    qt: CacheAligned<f32>,
    /// The last keys of a block when fewer than [`MR`] remain, zero-padded.
    k_tail: CacheAligned<f32>,
    /// Values zero-padded to `dp` = `head_dim` rounded up to [`NR`],
    /// `(BLOCK_K, dp)`, when `head_dim` is not a multiple of [`NR`].
    v: CacheAligned<f32>,
    /// Scores, then weights, transposed: `(BLOCK_K, BLOCK_Q)`.
    st: CacheAligned<f32>,
    /// Output accumulators, `(BLOCK_Q, dp)`.
    o: CacheAligned<f32>,
    /// Running maximum and sum per row, and the block's rescale factors.
    m: [f32; BLOCK_Q],
    l: [f32; BLOCK_Q],
    alpha: [f32; BLOCK_Q],
}

impl Scratch {
    fn new(head_dim: usize) -> Self {
        let dp = head_dim.next_multiple_of(NR);
        Self {
            qt: CacheAligned::new(head_dim * BLOCK_Q),
            k_tail: CacheAligned::new(MR * head_dim),
            v: CacheAligned::new(if dp == head_dim { 0 } else { BLOCK_K * dp }),
            st: CacheAligned::new(BLOCK_K.next_multiple_of(MR) * BLOCK_Q),
            o: CacheAligned::new(BLOCK_Q * dp),
            m: [0.0; BLOCK_Q],
            l: [0.0; BLOCK_Q],
            alpha: [0.0; BLOCK_Q],
        }
    }
}

crate::kernels::micro::per_isa! {
    /// The query blocks `subs` (rows `v0 .. v0 + len` each) of group
    /// `grp`, each with its scratch: their outputs, `(len, head_dim)`
    /// each.
    fn task(p: &Problem<'_>, grp: usize, subs: &[(usize, usize)], s: &mut [Scratch]) -> Vec<Vec<f32>>
        = task_generic::<Avx512>
}

/// `exp(x)` for `x <= 0` (and `-inf`, which gives exactly 0, as does NaN):
/// Cephes' `expf` reduction and polynomial (relative error ~1e-7; 0 below
/// -87, off by at most `exp(-87)` ≈ 1.7e-38), written so that a loop over
/// it vectorises.
#[inline(always)]
pub(crate) fn exp_neg<K: Kernel>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2^23: adding it rounds to an integer kept in the low bits.
    const ROUND: f32 = 12_582_912.0;
    const LOWEST: f32 = -87.0;
    let open = x >= LOWEST;
    let xc = if open { x } else { LOWEST };
    let t = madd(K::FMA, xc, LOG2E, ROUND);
    let n = t - ROUND;
    let r = madd(K::FMA, n, -LN2_HI, xc);
    let r = madd(K::FMA, n, -LN2_LO, r);
    let mut y = 1.987_569_1e-4;
    y = madd(K::FMA, y, r, 1.398_2e-3);
    y = madd(K::FMA, y, r, 8.333_452e-3);
    y = madd(K::FMA, y, r, 4.166_579_6e-2);
    y = madd(K::FMA, y, r, 1.666_666_5e-1);
    y = madd(K::FMA, y, r, 0.5);
    let y = madd(K::FMA, y, r * r, r + 1.0);
    // 2^n, n in [-126, 0]: the exponent field built from the rounded bits.
    let k = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let two_n = f32::from_bits(((k + 127) as u32) << 23);
    if open {
        y * two_n
    } else {
        0.0
    }
}

/// A query block's lanes within a task: which query/output row, sample,
/// head and position each is, their mask rows, and whether they are one
/// run of positions.
struct Lanes<'a> {
    len: usize,
    rows: Vec<(usize, usize, usize, usize)>,
    masks: Vec<Option<&'a [u8]>>,
    /// Whether the lanes are consecutive positions of one sample and head
    /// (always, with biases: they share no keys), so that a key's bias
    /// over them is one run of the key-major bias; and where they start.
    one_run: bool,
    b0: usize,
    h0: usize,
    i0: usize,
    /// Whether a block has been added yet: until then the accumulators
    /// are zero and need no rescale.
    first: bool,
}

#[inline(always)]
fn task_generic<K: Kernel>(
    p: &Problem<'_>,
    grp: usize,
    subs: &[(usize, usize)],
    scratch: &mut [Scratch],
) -> Vec<Vec<f32>> {
    let Dims {
        head_dim: hd,
        kv_heads,
        k_len,
        ..
    } = p.dims;
    let (bk, kvh) = (grp / kv_heads, grp % kv_heads);
    let kv_base = (bk * kv_heads + kvh) * p.kv_stride;
    let keys = &p.k[kv_base..][..k_len * hd];
    let values = &p.v[kv_base..][..k_len * hd];
    let mut lanes: Vec<Lanes<'_>> = subs
        .iter()
        .zip(scratch.iter_mut())
        .map(|(&(v0, len), s)| begin::<K>(p, bk, kvh, v0, len, s))
        .collect();
    // Key-block-major: a block of keys and values (in the L2) meets every
    // query block of the task before the next is read.
    for j0 in (0..k_len).step_by(BLOCK_K) {
        let kb = BLOCK_K.min(k_len - j0);
        for (ln, s) in lanes.iter_mut().zip(scratch.iter_mut()) {
            key_block::<K>(p, keys, values, j0, kb, ln, s);
        }
    }
    lanes
        .iter()
        .zip(scratch.iter())
        .map(|(ln, s)| finish(ln.len, hd, s))
        .collect()
}

/// A query block's start: its lanes, its queries packed (scaled,
/// transposed) into `s.qt`, its accumulators and running maxima and sums
/// reset.
#[inline(always)]
fn begin<'a, K: Kernel>(
    p: &'a Problem<'_>,
    bk: usize,
    kvh: usize,
    v0: usize,
    len: usize,
    s: &mut Scratch,
) -> Lanes<'a> {
    const Q: usize = BLOCK_Q;
    let hd = p.dims.head_dim;
    // Which query/output row, sample and position each lane is.
    let rows: Vec<(usize, usize, usize, usize)> =
        (0..len).map(|n| p.row_of(bk, kvh, v0 + n)).collect();
    let masks: Vec<Option<&[u8]>> = rows.iter().map(|&(_, b, _, i)| p.mask_row(b, i)).collect();
    let (_, b0, h0, i0) = rows[0];
    let one_run = rows
        .iter()
        .enumerate()
        .all(|(n, &(_, b, h, i))| (b, h, i) == (b0, h0, i0 + n));

    // Scaled queries transposed: consecutive rows by 16 × 16 blocks in
    // registers where AVX-512F runs (the element-by-element gather was a
    // tenth of the kernel's time on Swin's 100-row windows), otherwise
    // written a row of `qt` at a time.
    #[cfg(target_arch = "x86_64")]
    let transposed = if K::AVX512 && one_run && hd.is_multiple_of(16) {
        let first = rows[0].0 * hd;
        // SAFETY: `K::AVX512` is set by the AVX-512F kernel alone, which
        // `per_isa` runs only where the CPU has AVX-512F; the `len` rows
        // from `first` are consecutive rows of `q` (`one_run`), and `qt`
        // holds `hd × Q` values.
        unsafe { pack_q_avx512(&p.q[first..first + len * hd], hd, len, p.scale, &mut s.qt) };
        true
    } else {
        false
    };
    #[cfg(not(target_arch = "x86_64"))]
    let transposed = false;
    if !transposed {
        s.qt.fill(0.0);
        for (d, qt) in s.qt.chunks_exact_mut(Q).enumerate() {
            for (x, &(row, ..)) in qt.iter_mut().zip(&rows) {
                *x = p.q[row * hd + d] * p.scale;
            }
        }
    }
    s.o.fill(0.0);
    s.m = [f32::NEG_INFINITY; Q];
    s.l = [0.0; Q];
    Lanes {
        len,
        rows,
        masks,
        one_run,
        b0,
        h0,
        i0,
        first: true,
    }
}

/// Keys and values `j0 .. j0 + kb` against a query block: its scores,
/// its online softmax's update and `P V` into its accumulators; nothing
/// where the mask closes the block to every lane.
#[inline(always)]
fn key_block<K: Kernel>(
    p: &Problem<'_>,
    keys: &[f32],
    values: &[f32],
    j0: usize,
    kb: usize,
    ln: &mut Lanes<'_>,
    s: &mut Scratch,
) {
    const Q: usize = BLOCK_Q;
    let hd = p.dims.head_dim;
    let dp = hd.next_multiple_of(NR);
    let len = ln.len;
    if ln
        .masks
        .iter()
        .all(|m| m.is_some_and(|m| m[j0..j0 + kb].iter().all(|&x| x == 0)))
    {
        return;
    }
    // Sᵀ (kb, Q): MR keys × NR = Q lanes per tile, written in place
    // (`fresh`: no zeroing, no load), one pointer per key
    // (`micro_rows`: the general kernel's runtime row stride cost an
    // address computation per key and step).
    for t0 in (0..kb).step_by(MR) {
        let tile_keys = if kb - t0 >= MR {
            &keys[(j0 + t0) * hd..]
        } else {
            let rest = (kb - t0) * hd;
            s.k_tail[..rest].copy_from_slice(&keys[(j0 + t0) * hd..][..rest]);
            s.k_tail[rest..].fill(0.0);
            &s.k_tail[..]
        };
        micro_rows::<K>(
            tile_keys,
            hd,
            &s.qt,
            hd,
            &mut s.st[t0 * Q..],
            Q,
            true,
            false,
        );
    }
    for bias in p.biases {
        for j in 0..kb {
            let st = &mut s.st[j * Q..][..len];
            if ln.one_run {
                for (x, &b) in st
                    .iter_mut()
                    .zip(bias.lanes(ln.b0, ln.h0, j0 + j, ln.i0, len))
                {
                    *x += b;
                }
            } else {
                for (x, &(_, b, h, i)) in st.iter_mut().zip(&ln.rows) {
                    *x += bias.at(b, h, i, j0 + j);
                }
            }
        }
    }
    for (n, m) in ln.masks.iter().enumerate() {
        if let Some(m) = m.map(|m| &m[j0..j0 + kb]) {
            if !m.iter().all(|&x| x != 0) {
                for (j, &open) in m.iter().enumerate() {
                    if open == 0 {
                        s.st[j * Q + n] = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
    // Online softmax, lane-wise: the rows' new maxima, the rescale of
    // what they hold, and the weights. A lane whose maximum is still
    // -inf (nothing open yet) gets weights exp(NaN) = 0 and alpha 0
    // on an accumulator that is 0.
    let mut m_new = s.m;
    // SAFETY: `K` is only instantiated inside functions compiled for
    // its instruction set, which run only on CPUs that have it.
    unsafe { K::row_maxima(&mut m_new, &s.st[..kb * Q]) };
    for ((a, &m_old), &m) in s.alpha.iter_mut().zip(&s.m).zip(&m_new) {
        *a = exp_neg::<K>(m_old - m);
    }
    let mut sum = [0f32; Q];
    for j in 0..kb {
        let row: &mut [f32; Q] = (&mut s.st[j * Q..][..Q]).try_into().expect("Q floats");
        for ((x, &m), acc) in row.iter_mut().zip(&m_new).zip(&mut sum) {
            *x = exp_neg::<K>(*x - m);
            *acc += *x;
        }
    }
    for ((l, &a), &x) in s.l.iter_mut().zip(&s.alpha).zip(&sum) {
        *l = madd(K::FMA, *l, a, x);
    }
    s.m = m_new;
    if !ln.first {
        for (n, o) in s.o.chunks_exact_mut(dp).enumerate() {
            let a = s.alpha[n];
            if a != 1.0 {
                for x in o {
                    *x *= a;
                }
            }
        }
    }
    ln.first = false;
    // O += P V: MR rows × NR value columns per tile; P(n, j) = Sᵀ[j][n].
    let (vb, ldv) = if dp == hd {
        (&values[j0 * hd..], hd)
    } else {
        for j in 0..kb {
            let dst = &mut s.v[j * dp..][..dp];
            dst[..hd].copy_from_slice(&values[(j0 + j) * hd..][..hd]);
            dst[hd..].fill(0.0);
        }
        (&s.v[..], dp)
    };
    for i0 in (0..len.next_multiple_of(MR)).step_by(MR) {
        for c0 in (0..dp).step_by(NR) {
            let mut c: [[f32; NR]; MR] = std::array::from_fn(|i| {
                s.o[(i0 + i) * dp + c0..][..NR]
                    .try_into()
                    .expect("NR floats")
            });
            micro::<K>(&s.st[i0..], 1, Q, &vb[c0..], ldv, kb, &mut c);
            for (i, ci) in c.iter().enumerate() {
                s.o[(i0 + i) * dp + c0..][..NR].copy_from_slice(ci);
            }
        }
    }
}

/// A query block's outputs, `(len, hd)`: each row's accumulators over its
/// sum; a row that never saw an open key stays exactly zero.
fn finish(len: usize, hd: usize, s: &Scratch) -> Vec<f32> {
    let dp = hd.next_multiple_of(NR);
    let mut out = vec![0f32; len * hd];
    for n in 0..len {
        if s.l[n] > 0.0 {
            let inv = 1.0 / s.l[n];
            for (o, &a) in out[n * hd..][..hd].iter_mut().zip(&s.o[n * dp..][..hd]) {
                *o = a * inv;
            }
        }
    }
    out
}

/// `qt (hd, BLOCK_Q)`: `qt[d][n] = scale · q[n][d]` for the `len` rows of
/// `q (len, hd)` and zero past them, by 16 × 16 transposes in registers
/// ([`crate::kernels::micro::transpose16`]); the products are those of
/// the scalar loop.
///
/// # Safety
/// The CPU has AVX-512F; `hd` is a multiple of 16, `len <= BLOCK_Q`,
/// `q.len() == len * hd` and `qt.len() == hd * BLOCK_Q`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_q_avx512(q: &[f32], hd: usize, len: usize, scale: f32, qt: &mut [f32]) {
    assert!(hd.is_multiple_of(16) && len <= BLOCK_Q && q.len() == len * hd);
    assert_eq!(qt.len(), hd * BLOCK_Q);
    // SAFETY: `qt`'s values seen as possibly uninitialised, into which
    // only values are written; AVX-512F (the contract).
    unsafe {
        let qt = &mut *(qt as *mut [f32] as *mut [std::mem::MaybeUninit<f32>]);
        crate::kernels::micro::transpose_rows(q, hd, hd, Some(scale), qt)
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "x86_64")]
    use crate::kernels::micro::Fma;

    /// The transposes in registers give the scalar loop's values: every
    /// row count up to a task's, widths 16 to 64.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn packed_queries_are_the_scalar_loop() {
        if crate::kernels::CpuFeatures::get().isa().simd() != crate::kernels::Simd::Avx512 {
            return;
        }
        for hd in [16, 32, 48, 64] {
            for len in 1..=BLOCK_Q {
                let q = values(len * hd, (hd * 100 + len) as u64);
                let mut got = vec![f32::NAN; hd * BLOCK_Q];
                // SAFETY: the CPU has AVX-512F (checked above); the sizes
                // are the contract's.
                unsafe { pack_q_avx512(&q, hd, len, 0.3, &mut got) };
                for d in 0..hd {
                    for n in 0..BLOCK_Q {
                        let want = if n < len { q[n * hd + d] * 0.3 } else { 0.0 };
                        assert_eq!(
                            got[d * BLOCK_Q + n].to_bits(),
                            want.to_bits(),
                            "{hd} {len} ({d}, {n})"
                        );
                    }
                }
            }
        }
    }
    use crate::kernels::micro::Plain;

    /// The rows' maxima of every instruction set are the plain loop's,
    /// NaN scores and `-inf` (masked keys) included.
    #[test]
    fn row_maxima_are_the_plain_loop() {
        use crate::kernels::micro::Plain;
        let rows: Vec<f32> = (0..37 * BLOCK_Q)
            .map(|i| match i % 11 {
                3 => f32::NAN,
                5 => f32::NEG_INFINITY,
                _ => ((i * 7919) % 1009) as f32 / 100.0 - 5.0,
            })
            .collect();
        let start: [f32; BLOCK_Q] = std::array::from_fn(|l| match l % 3 {
            0 => f32::NEG_INFINITY,
            _ => l as f32 / 4.0,
        });
        let mut want = start;
        // SAFETY: the plain loop runs on every CPU.
        unsafe { Plain::row_maxima(&mut want, &rows) };
        assert!(want.iter().all(|m| !m.is_nan()));
        for isa in crate::kernels::CpuFeatures::get().isas() {
            let mut got = start;
            // SAFETY: `isas` lists only what this CPU runs.
            unsafe {
                match isa.simd() {
                    #[cfg(target_arch = "x86_64")]
                    crate::kernels::Simd::Avx512 => Avx512::row_maxima(&mut got, &rows),
                    #[cfg(target_arch = "x86_64")]
                    crate::kernels::Simd::Avx2 => {
                        crate::kernels::micro::Avx2::row_maxima(&mut got, &rows)
                    }
                    _ => Plain::row_maxima(&mut got, &rows),
                }
            }
            assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "{isa:?}");
        }
    }

    #[test]
    fn exp_matches_std() {
        let mut x = 0f32;
        while x > -90.0 {
            #[cfg(target_arch = "x86_64")]
            let fused = [exp_neg::<Fma>(x)];
            #[cfg(not(target_arch = "x86_64"))]
            let fused: [f32; 0] = [];
            for got in std::iter::once(exp_neg::<Plain>(x)).chain(fused) {
                let want = x.exp();
                // Below -87 the result is 0: off by at most exp(-87) = 1.65e-38.
                let tol = 2e-7 * want + 1.7e-38;
                assert!((got - want).abs() <= tol, "exp({x}) = {got}, want {want}");
            }
            x -= 0.013;
        }
        assert_eq!(exp_neg::<Plain>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_neg::<Plain>(f32::NAN), 0.0);
        assert_eq!(exp_neg::<Plain>(0.0), 1.0);
    }

    /// Plain f64 attention over the problem's layout: the oracle.
    fn reference(p: &Problem<'_>) -> Vec<f64> {
        let d = &p.dims;
        let hd = d.head_dim;
        let mut out = vec![0f64; d.batch_q * d.heads * d.q_len * hd];
        for grp in 0..d.batch_k * d.kv_heads {
            let (bk, kvh) = (grp / d.kv_heads, grp % d.kv_heads);
            let base = (bk * d.kv_heads + kvh) * d.k_len * hd;
            for v in 0..d.group_rows() {
                let (row, b, h, i) = p.row_of(bk, kvh, v);
                let q = &p.q[row * hd..][..hd];
                let open = |j: usize| p.mask_row(b, i).is_none_or(|m| m[j] != 0);
                let bias =
                    |j: usize| -> f64 { p.biases.iter().map(|x| x.at(b, h, i, j) as f64).sum() };
                let scores: Vec<Option<f64>> = (0..d.k_len)
                    .map(|j| {
                        open(j).then(|| {
                            let k = &p.k[base + j * hd..][..hd];
                            q.iter()
                                .zip(k)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                * p.scale as f64
                                + bias(j)
                        })
                    })
                    .collect();
                let max = scores
                    .iter()
                    .flatten()
                    .fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                let w: Vec<f64> = scores
                    .iter()
                    .map(|s| s.map_or(0.0, |s| (s - max).exp()))
                    .collect();
                let sum: f64 = w.iter().sum();
                if sum == 0.0 {
                    continue;
                }
                for (j, wj) in w.iter().enumerate() {
                    for d in 0..hd {
                        out[row * hd + d] += wj / sum * p.v[base + j * hd + d] as f64;
                    }
                }
            }
        }
        out
    }

    /// The largest absolute difference from the oracle.
    fn max_err(got: &[f32], want: &[f64]) -> f64 {
        got.iter()
            .zip(want)
            .map(|(&a, &b)| (a as f64 - b).abs())
            .fold(0f64, f64::max)
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        // A small LCG: reproducible values in [-2, 2).
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    /// Additive biases (Swin's: one per head, and one per window sample
    /// that closes keys with -100) against the f64 oracle on every
    /// instruction set, for row counts under and over a task and keys
    /// past a key block; with a mask too. Max abs error 1e-5.
    #[test]
    fn biases_match_the_reference_on_every_isa() {
        // (batch, heads, q_len, k_len, head_dim, bias batch, heads per key
        // head). Swin's are the first three (a task's lanes: consecutive
        // positions of one head, each key's bias one run); the last has two
        // heads share a key head, so that lanes span heads (the kernel then
        // adds the biases lane by lane).
        let shapes = [
            (6, 3, 49, 49, 32, 3, 1),
            (4, 2, 3, 300, 16, 2, 1),
            (2, 4, 100, 100, 7, 1, 1),
            (2, 4, 20, 45, 16, 2, 2),
        ];
        for (n, &(batch, heads, q_len, k_len, hd, nb, g)) in shapes.iter().enumerate() {
            let seed = 500 + 10 * n as u64;
            let q = values(batch * heads * q_len * hd, seed);
            let k = values(batch * heads * k_len * hd, seed + 1);
            let v = values(batch * heads * k_len * hd, seed + 2);
            let per_head = HostBias {
                data: values(heads * q_len * k_len, seed + 3),
                batch: 1,
                heads,
                q_len,
                k_len,
            };
            let cut = values(nb * q_len * k_len, seed + 4);
            let per_sample = HostBias {
                data: cut
                    .iter()
                    .map(|&x| if x > 1.0 { -100.0 } else { 0.0 })
                    .collect(),
                batch: nb,
                heads: 1,
                q_len,
                k_len,
            };
            let mask = HostMask {
                data: values(batch * q_len * k_len, seed + 5)
                    .iter()
                    .map(|&x| u8::from(x > -1.5))
                    .collect(),
                batch,
                q_len,
            };
            let biases = [per_head, per_sample];
            for masked in [false, true] {
                let p = Problem {
                    q: &q,
                    k: &k,
                    v: &v,
                    kv_stride: k_len * hd,
                    mask: masked.then_some(&mask),
                    biases: &biases,
                    dims: Dims {
                        batch_q: batch,
                        heads,
                        q_len,
                        head_dim: hd,
                        batch_k: batch,
                        kv_heads: heads / g,
                        k_len,
                        score_elems: batch * heads * q_len * k_len,
                    },
                    scale: 1.0 / (hd as f32).sqrt(),
                };
                let want = reference(&p);
                for isa in crate::kernels::CpuFeatures::get().isas() {
                    let err = max_err(&run(&p, isa), &want);
                    assert!(err <= 1e-5, "shape {n} masked {masked} on {isa:?}: {err}");
                }
            }
        }
    }

    /// A task takes four query blocks where a group's keys and values
    /// pass half the L2: 1024 keys of width 64 (512 KB) not, 16,384 (8
    /// MB) yes.
    #[test]
    fn query_blocks_per_task_follow_the_l2() {
        assert_eq!(blocks_per_task(1024 * 64 * 8, Some(2 << 20)), 1);
        assert_eq!(blocks_per_task(16384 * 64 * 8, Some(2 << 20)), 4);
        assert_eq!(blocks_per_task(2048 * 64 * 8, Some(1 << 20)), 4);
        assert_eq!(blocks_per_task(2048 * 64 * 8, None), 1);
    }

    /// Every instruction set the CPU has against the f64 oracle, on shapes
    /// that cross every block and tile edge: rows not a multiple of the
    /// micro-tile or of a task, keys past one and two key blocks and not a
    /// multiple of the tile, head widths 1, 7, 33 and 64, shared keys
    /// (beams and grouped heads), per-query masks with closed rows and
    /// closed key blocks. Max abs error 1e-5 on outputs of magnitude ~1.
    #[test]
    fn matches_the_reference_on_every_isa() {
        let shapes = [
            // (batch_k, r, kv_heads, g, q_len, k_len, head_dim, masked)
            (1, 1, 1, 1, 3, 1, 1, false),
            (1, 1, 2, 1, 9, 130, 7, true),
            (2, 2, 1, 3, 5, 257, 33, true),
            (1, 1, 3, 1, 70, 300, 64, false),
            (1, 3, 1, 1, 41, 129, 64, true),
            (2, 1, 2, 2, 17, 384, 16, true),
            // The second task (rows 32..39) finds its first key block closed.
            (1, 1, 1, 1, 40, 300, 64, true),
            // Swin-like windows: 20 rows per head, width 32.
            (2, 1, 2, 1, 20, 20, 32, false),
        ];
        for (n, &(batch_k, r, kv_heads, g, q_len, k_len, hd, masked)) in shapes.iter().enumerate() {
            let (batch_q, heads) = (batch_k * r, kv_heads * g);
            let q = values(batch_q * heads * q_len * hd, n as u64);
            let k = values(batch_k * kv_heads * k_len * hd, 100 + n as u64);
            let v = values(batch_k * kv_heads * k_len * hd, 200 + n as u64);
            // Per query: row 0 of every sample closed, the first key block
            // closed to rows past 4 (a causal-like pattern), others random.
            let bits = values(batch_q * q_len * k_len, 300 + n as u64);
            let mask = HostMask {
                data: (0..batch_q * q_len * k_len)
                    .map(|e| {
                        let (i, j) = ((e / k_len) % q_len, e % k_len);
                        u8::from(i != 0 && !(i > 4 && j < BLOCK_K) && bits[e] > -1.0)
                    })
                    .collect(),
                batch: batch_q,
                q_len,
            };
            let p = Problem {
                q: &q,
                k: &k,
                v: &v,
                kv_stride: k_len * hd,
                mask: masked.then_some(&mask),
                biases: &[],
                dims: Dims {
                    batch_q,
                    heads,
                    q_len,
                    head_dim: hd,
                    batch_k,
                    kv_heads,
                    k_len,
                    score_elems: batch_q * heads * q_len * k_len,
                },
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let want = reference(&p);
            for isa in crate::kernels::CpuFeatures::get().isas() {
                let got = run(&p, isa);
                // Four query blocks a task (long keys): the same bits.
                let four = run_with(&p, isa, 4);
                assert!(
                    got.iter()
                        .zip(&four)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "shape {n} on {isa:?}: four query blocks a task differ"
                );
                let err = max_err(&got, &want);
                assert!(err <= 1e-5, "shape {n} on {isa:?}: max abs error {err}");
                if masked {
                    // Query 0 of every sample attends to nothing: exactly 0.
                    for row in 0..batch_q * heads {
                        let o = &got[row * q_len * hd..][..hd];
                        assert!(
                            o.iter().all(|&x| x == 0.0),
                            "shape {n} {isa:?}: closed row {row}"
                        );
                    }
                }
            }
        }
    }
}

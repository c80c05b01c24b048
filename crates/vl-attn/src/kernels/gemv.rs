//! vl's CPU matrix-vector kernel for decode shapes: `y = x W^T` with `x`
//! of 1 to [`MAX_ROWS`] rows (a decode step, a few beams or a small batch)
//! and a dense weight `W (out, in)` in f32, f16 or bf16.
//!
//! Why vl owns it: for a one-row product candle's CPU matmul (gemm 0.19)
//! takes gemm's `gemv` path, which runs on one thread whatever the pool
//! size, and has no bf16 product at all; a decode step is a chain of such
//! products, bounded by the bytes of the weights it streams. This kernel
//! splits the output rows across the rayon pool (the process's one pool,
//! sized by `--threads`), streams each weight row once for all the rows of
//! `x`, converts f16/bf16 weights to f32 on the fly and accumulates in f32.
//!
//! The SIMD is chosen once per process ([`CpuFeatures::isa`]): AVX-512F
//! or AVX2+FMA intrinsics, NEON intrinsics on aarch64, or a plain Rust
//! loop (the portable fallback and oracle; compiled for those ISAs the
//! compiler vectorised it for one row but left it scalar for two or more).
//! Every path is tested against a plain f64 reference on odd shapes, and
//! each SIMD path computes a row the same way whatever the rows beside it.
//!
//! q8_0 weights have a kernel of their own, [`crate::kernels::gemv_q8`].
//!
//! [`gemv`] is a candle `CustomOp2`, so models stay candle modules; it runs
//! on CPU only and takes no part in autograd: [`crate::Proj`] routes to it
//! only for plain (untracked) CPU tensors of a supported shape, and to
//! candle's matmul otherwise (training, CUDA, Metal, prefill).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use super::features::{CpuFeatures, Isa, PrefetchHint, Simd, Tuning};
use crate::kernels::host::contiguous;

/// The most rows of `x` the kernel takes; more go to candle's matmul.
pub const MAX_ROWS: usize = 8;

/// Floats per accumulator: one AVX-512 register, two AVX2 ones.
const LANES: usize = 16;

/// Output rows per parallel task, at least; fewer tasks than threads
/// would leave cores idle, many tiny ones cost scheduling.
const MIN_TASK_ROWS: usize = 16;

/// Asks for the cache line holding `p + ahead` bytes with `hint` (the
/// CPU's [`Tuning`], read once per product or
/// tile by the caller). A prefetch never faults, whatever the address; a
/// no-op off x86-64.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T, ahead: usize, hint: PrefetchHint) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHNTA and PREFETCHT0 read nothing architecturally and
    // never fault (any address, mapped or not, is allowed); SSE is in the
    // x86-64 baseline. The address is formed with wrapping arithmetic.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_NTA, _MM_HINT_T0};
        let at = p.cast::<i8>().wrapping_add(ahead);
        match hint {
            PrefetchHint::NonTemporal => _mm_prefetch::<_MM_HINT_NTA>(at),
            PrefetchHint::T0 => _mm_prefetch::<_MM_HINT_T0>(at),
            PrefetchHint::Off => {}
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, ahead, hint);
}

/// An element vl's kernels read and widen to f32: a weight here, keys
/// and values in [`crate::attention`]'s per-row attention, the rows of
/// the LayerNorm and bf16 addition kernels; one vector load of it per
/// instruction set.
pub(crate) trait Weight: Copy + Send + Sync {
    fn to_f32(self) -> f32;

    /// The 4 values at `p`, widened to f32 lanes.
    ///
    /// # Safety
    /// 4 values are readable at `p`.
    #[cfg(target_arch = "aarch64")]
    unsafe fn load4(p: *const Self) -> std::arch::aarch64::float32x4_t;

    /// The 8 values at `p`, widened to f32 lanes.
    ///
    /// # Safety
    /// 8 values are readable at `p`; the CPU has AVX2 (callers are
    /// compiled for it, so that this inlines).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;

    /// The 16 values at `p`, widened to f32 lanes.
    ///
    /// # Safety
    /// 16 values are readable at `p`; the CPU has AVX-512F (callers are
    /// compiled for it, so that this inlines).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl Weight for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn load4(p: *const f32) -> std::arch::aarch64::float32x4_t {
        // SAFETY: the caller's contract.
        unsafe { std::arch::aarch64::vld1q_f32(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

impl Weight for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // bf16 is the top half of an f32: a shift, which vectorises.
        f32::from_bits((self.to_bits() as u32) << 16)
    }

    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn load4(p: *const bf16) -> std::arch::aarch64::float32x4_t {
        use std::arch::aarch64::*;
        // SAFETY: the caller's contract; widening each u16 to the top
        // half of a u32 is the f32 the bf16 stands for.
        unsafe { vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p.cast()))) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract. bf16 is the top half of an f32.
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract. bf16 is the top half of an f32.
        unsafe {
            let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
        }
    }
}

impl Weight for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn load4(p: *const f16) -> std::arch::aarch64::float32x4_t {
        // SAFETY: the caller's contract. Widened one by one: the vector
        // conversion needs the `fp16` feature, outside aarch64's baseline.
        unsafe {
            let v: [f32; 4] = std::array::from_fn(|i| (*p.add(i)).to_f32());
            std::arch::aarch64::vld1q_f32(v.as_ptr())
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        // F16C is not part of the AVX2 token: widened one by one (f16
        // weights are the rare case; f32 and bf16 load as vectors).
        // SAFETY: the caller's contract.
        unsafe {
            let v: [f32; 8] = std::array::from_fn(|i| p.add(i).read_unaligned().to_f32());
            std::arch::x86_64::_mm256_loadu_ps(v.as_ptr())
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX-512F carries the f16
        // conversion).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

/// `out[r] = x[r] · w` for the `R` rows of `x` (each `w.len()` long).
#[inline(always)]
fn dot_rows<W: Weight, const R: usize>(x: [&[f32]; R], w: &[W], out: &mut [f32; R], tune: Tuning) {
    let mut acc = [[0f32; LANES]; R];
    let body = w.len() / LANES * LANES;
    for (c, wc) in w[..body].chunks_exact(LANES).enumerate() {
        prefetch(wc.as_ptr(), tune.prefetch_ahead, tune.prefetch);
        let mut wf = [0f32; LANES];
        for (f, &v) in wf.iter_mut().zip(wc) {
            *f = v.to_f32();
        }
        for (a, xr) in acc.iter_mut().zip(&x) {
            let xc = &xr[c * LANES..c * LANES + LANES];
            for j in 0..LANES {
                a[j] += xc[j] * wf[j];
            }
        }
    }
    for (r, (a, xr)) in acc.iter().zip(&x).enumerate() {
        let mut s: f32 = a.iter().sum();
        for (xv, wv) in xr[body..].iter().zip(&w[body..]) {
            s += xv * wv.to_f32();
        }
        out[r] = s;
    }
}

/// [`dot_rows`] with NEON intrinsics: four accumulators of four lanes per
/// row (the generic loop's 16 lanes), the weights widened as they load,
/// `vfmaq_f32`, then the lanes summed; the tail one by one.
#[cfg(target_arch = "aarch64")]
#[inline(always)]
fn dot_rows_neon<W: Weight, const R: usize>(x: [&[f32]; R], w: &[W], out: &mut [f32; R]) {
    use std::arch::aarch64::*;
    let body = w.len() / LANES * LANES;
    // SAFETY (every `unsafe` here without another comment): NEON is part
    // of aarch64's baseline.
    let mut acc = [[unsafe { vdupq_n_f32(0.0) }; 4]; R];
    for c in (0..body).step_by(LANES) {
        // SAFETY: `c + 16 <= body <= w.len()`, and every row of `x` is
        // `w.len()` long (the callers slice them so).
        unsafe {
            let wp = w.as_ptr().add(c);
            let wv: [float32x4_t; 4] = std::array::from_fn(|l| W::load4(wp.add(4 * l)));
            for (a, xr) in acc.iter_mut().zip(&x) {
                let xp = xr[..w.len()].as_ptr().add(c);
                for l in 0..4 {
                    a[l] = vfmaq_f32(a[l], vld1q_f32(xp.add(4 * l)), wv[l]);
                }
            }
        }
    }
    for (r, (a, xr)) in acc.iter().zip(&x).enumerate() {
        // SAFETY: as above.
        let mut s = unsafe { vaddvq_f32(vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3]))) };
        for (xv, wv) in xr[body..].iter().zip(&w[body..]) {
            s += xv * wv.to_f32();
        }
        out[r] = s;
    }
}

/// [`dot_rows`] with AVX-512F intrinsics: per 16 weights, one load
/// widened to f32 lanes ([`Weight::load16`]) and one fused multiply-add
/// per row of `x` into that row's register; the lanes summed at the end,
/// the tail one by one. The compiler left the generic loop scalar for
/// two rows or more (a batch of 4 or 8 decode rows ran 18× slower than
/// one row, `cargo bench -p vl-attn --bench gemv`); here every row is
/// computed the same way whatever `R`, so a row of a batch equals the
/// row alone, bit for bit.
///
/// # Safety
/// The CPU has AVX-512F; every row of `x` is at least `w.len()` long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn dot_rows_avx512<W: Weight, const R: usize>(
    x: [&[f32]; R],
    w: &[W],
    out: &mut [f32; R],
    tune: Tuning,
) {
    use std::arch::x86_64::*;
    let body = w.len() / LANES * LANES;
    let mut acc = [_mm512_setzero_ps(); R];
    let wp = w.as_ptr();
    // SAFETY: `c + 16 <= body <= w.len()` and every row of `x` is at
    // least `w.len()` long (the caller's contract).
    unsafe {
        let mut c = 0;
        while c < body {
            prefetch(wp.add(c), tune.prefetch_ahead, tune.prefetch);
            let wv = W::load16(wp.add(c));
            for (a, xr) in acc.iter_mut().zip(&x) {
                *a = _mm512_fmadd_ps(_mm512_loadu_ps(xr.as_ptr().add(c)), wv, *a);
            }
            c += LANES;
        }
    }
    for (r, (a, xr)) in acc.iter().zip(&x).enumerate() {
        let mut s = _mm512_reduce_add_ps(*a);
        for (xv, wv) in xr[body..w.len()].iter().zip(&w[body..]) {
            s += xv * wv.to_f32();
        }
        out[r] = s;
    }
}

/// [`dot_rows_avx512`] on AVX2+FMA: per 16 weights two 8-lane loads and
/// two fused multiply-adds per row of `x` (the generic loop, left scalar
/// by the compiler for two rows or more, was 14× slower for 4 rows than
/// for one); every row computed the same way whatever `R`.
///
/// # Safety
/// The CPU has AVX2 and FMA; every row of `x` is at least `w.len()` long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn dot_rows_avx2<W: Weight, const R: usize>(
    x: [&[f32]; R],
    w: &[W],
    out: &mut [f32; R],
    tune: Tuning,
) {
    use std::arch::x86_64::*;
    let body = w.len() / LANES * LANES;
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let wp = w.as_ptr();
    // SAFETY: `c + 16 <= body <= w.len()` and every row of `x` is at
    // least `w.len()` long (the caller's contract).
    unsafe {
        let mut c = 0;
        while c < body {
            prefetch(wp.add(c), tune.prefetch_ahead, tune.prefetch);
            let wv = [W::load8(wp.add(c)), W::load8(wp.add(c + 8))];
            for (a, xr) in acc.iter_mut().zip(&x) {
                let xp = xr.as_ptr().add(c);
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xp), wv[0], a[0]);
                a[1] = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(8)), wv[1], a[1]);
            }
            c += LANES;
        }
    }
    for (r, (a, xr)) in acc.iter().zip(&x).enumerate() {
        let v = _mm256_add_ps(a[0], a[1]);
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_add_ss(h, _mm_movehdup_ps(h));
        let mut s = _mm_cvtss_f32(h);
        for (xv, wv) in xr[body..w.len()].iter().zip(&w[body..]) {
            s += xv * wv.to_f32();
        }
        out[r] = s;
    }
}

/// [`dot_rows`], or `dot_rows_neon` when `NEON` (compiled on aarch64 only).
#[inline(always)]
fn dot<W: Weight, const NEON: bool, const R: usize>(
    x: [&[f32]; R],
    w: &[W],
    out: &mut [f32; R],
    tune: Tuning,
) {
    #[cfg(target_arch = "aarch64")]
    if NEON {
        return dot_rows_neon(x, w, out);
    }
    dot_rows(x, w, out, tune)
}

/// `yt[o * rows + r] = x[r] · w[o]` for the output rows `o` of one task:
/// `w` holds those rows, `yt` their outputs, `x` all `rows` inputs; with
/// NEON intrinsics when `NEON`.
#[inline(always)]
fn task<W: Weight, const NEON: bool>(x: &[f32], rows: usize, inp: usize, w: &[W], yt: &mut [f32]) {
    rows_by_groups(
        x,
        rows,
        inp,
        w,
        yt,
        (
            |x, w, o, tune| dot::<W, NEON, 4>(x, w, o, tune),
            |x, w, o, tune| dot::<W, NEON, 2>(x, w, o, tune),
            |x, w, o, tune| dot::<W, NEON, 1>(x, w, o, tune),
        ),
    )
}

/// [`task`] on AVX-512F: [`dot_rows_avx512`].
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn task_avx512<W: Weight>(x: &[f32], rows: usize, inp: usize, w: &[W], yt: &mut [f32]) {
    // SAFETY (the three calls): the CPU has AVX-512F (this function's
    // contract); `rows_by_groups` hands rows of `inp` values, `w.len()`
    // being `inp`.
    rows_by_groups(
        x,
        rows,
        inp,
        w,
        yt,
        (
            |x, w, o, tune| unsafe { dot_rows_avx512::<W, 4>(x, w, o, tune) },
            |x, w, o, tune| unsafe { dot_rows_avx512::<W, 2>(x, w, o, tune) },
            |x, w, o, tune| unsafe { dot_rows_avx512::<W, 1>(x, w, o, tune) },
        ),
    )
}

/// `yt[o * rows + r] = x[r] · w[o]` for the output rows `o` of one task,
/// the rows of `x` in groups of 4, 2 and 1 (the products `dot4`, `dot2`,
/// `dot1`).
#[inline(always)]
fn rows_by_groups<W: Weight>(
    x: &[f32],
    rows: usize,
    inp: usize,
    w: &[W],
    yt: &mut [f32],
    (dot4, dot2, dot1): (
        impl Fn([&[f32]; 4], &[W], &mut [f32; 4], Tuning),
        impl Fn([&[f32]; 2], &[W], &mut [f32; 2], Tuning),
        impl Fn([&[f32]; 1], &[W], &mut [f32; 1], Tuning),
    ),
) {
    let xr = |r: usize| &x[r * inp..(r + 1) * inp];
    // Read once per task, not per weight row.
    let tune = CpuFeatures::get().tuning;
    for (wo, yo) in w.chunks_exact(inp).zip(yt.chunks_exact_mut(rows)) {
        // Groups of 4, 2, 1 rows: the weight row stays in L1 between them.
        let mut r = 0;
        while r < rows {
            match rows - r {
                n if n >= 4 => {
                    let mut o = [0f32; 4];
                    dot4(std::array::from_fn(|i| xr(r + i)), wo, &mut o, tune);
                    yo[r..r + 4].copy_from_slice(&o);
                    r += 4;
                }
                n if n >= 2 => {
                    let mut o = [0f32; 2];
                    dot2(std::array::from_fn(|i| xr(r + i)), wo, &mut o, tune);
                    yo[r..r + 2].copy_from_slice(&o);
                    r += 2;
                }
                _ => {
                    let mut o = [0f32; 1];
                    dot1([xr(r)], wo, &mut o, tune);
                    yo[r] = o[0];
                    r += 1;
                }
            }
        }
    }
}

/// [`task`] on AVX2+FMA: [`dot_rows_avx2`].
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn task_avx2<W: Weight>(x: &[f32], rows: usize, inp: usize, w: &[W], yt: &mut [f32]) {
    // SAFETY (the three calls): the CPU has AVX2 and FMA (this
    // function's contract); `rows_by_groups` hands rows of `inp` values,
    // `w.len()` being `inp`.
    rows_by_groups(
        x,
        rows,
        inp,
        w,
        yt,
        (
            |x, w, o, tune| unsafe { dot_rows_avx2::<W, 4>(x, w, o, tune) },
            |x, w, o, tune| unsafe { dot_rows_avx2::<W, 2>(x, w, o, tune) },
            |x, w, o, tune| unsafe { dot_rows_avx2::<W, 1>(x, w, o, tune) },
        ),
    )
}

/// Runs `run(outputs, yt)` over the output rows split into tasks across
/// the rayon pool, `yt` being those outputs' `(len, rows)` results, and
/// returns `y (rows, out)`.
pub(crate) fn parallel(
    out: usize,
    rows: usize,
    run: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
) -> Vec<f32> {
    let threads = rayon::current_num_threads().max(1);
    let per_task = out.div_ceil(threads * 4).max(MIN_TASK_ROWS);
    // Outputs transposed, (out, rows), so that each task writes one run.
    let mut yt = vec![0f32; out * rows];
    yt.par_chunks_mut(per_task * rows)
        .enumerate()
        .for_each(|(t, yt)| {
            let start = t * per_task;
            run(start..start + yt.len() / rows, yt)
        });
    if rows == 1 {
        // A decode step: (out, 1) is already (1, out).
        return yt;
    }
    let mut y = vec![0f32; rows * out];
    for (o, yo) in yt.chunks_exact(rows).enumerate() {
        for (r, v) in yo.iter().enumerate() {
            y[r * out + o] = *v;
        }
    }
    y
}

/// The product of `x (rows, inp)` (f32, row-major) and `w (out, inp)`:
/// returns `y (rows, out)`, computed with `isa`.
fn product<W: Weight>(isa: Isa, x: &[f32], rows: usize, w: &[W], out: usize) -> Vec<f32> {
    let inp = x.len() / rows.max(1);
    parallel(out, rows, |o, yt| {
        let w = &w[o.start * inp..o.end * inp];
        match isa.simd() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves the CPU has AVX-512F.
            Simd::Avx512 => unsafe { task_avx512(x, rows, inp, w, yt) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves the CPU has AVX2 and FMA.
            Simd::Avx2 => unsafe { task_avx2(x, rows, inp, w, yt) },
            Simd::Neon => task::<W, true>(x, rows, inp, w, yt),
            _ => task::<W, false>(x, rows, inp, w, yt),
        }
    })
}

/// The op: `x (..., inp)` times `w (out, inp)` transposed.
struct Gemv {
    isa: Isa,
}

/// `x` as f32 values, converted from its dtype.
fn x_f32(s: &CpuStorage, l: &Layout) -> candle_core::Result<Vec<f32>> {
    Ok(match s {
        CpuStorage::F32(d) => contiguous(d, l, "vl-gemv", "x")?.to_vec(),
        CpuStorage::BF16(d) => contiguous(d, l, "vl-gemv", "x")?
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        CpuStorage::F16(d) => contiguous(d, l, "vl-gemv", "x")?
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        _ => candle_core::bail!("vl-gemv: x must be f32, f16 or bf16, got {:?}", s.dtype()),
    })
}

impl CustomOp2 for Gemv {
    fn name(&self) -> &'static str {
        "vl-gemv"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (out, inp) = l2.shape().dims2()?;
        let dims = l1.shape().dims();
        let Some((&last, lead)) = dims.split_last() else {
            candle_core::bail!("vl-gemv: x must have a last dimension");
        };
        if last != inp {
            candle_core::bail!("vl-gemv: x is {dims:?}, the weight ({out}, {inp})");
        }
        let rows: usize = lead.iter().product();
        let x = x_f32(s1, l1)?;
        let y = match s2 {
            CpuStorage::F32(w) => {
                product(self.isa, &x, rows, contiguous(w, l2, "vl-gemv", "w")?, out)
            }
            CpuStorage::BF16(w) => {
                product(self.isa, &x, rows, contiguous(w, l2, "vl-gemv", "w")?, out)
            }
            CpuStorage::F16(w) => {
                product(self.isa, &x, rows, contiguous(w, l2, "vl-gemv", "w")?, out)
            }
            _ => candle_core::bail!("vl-gemv: weight dtype {:?}", s2.dtype()),
        };
        let storage = match s1.dtype() {
            DType::BF16 => CpuStorage::BF16(y.into_iter().map(bf16::from_f32).collect()),
            DType::F16 => CpuStorage::F16(y.into_iter().map(f16::from_f32).collect()),
            _ => CpuStorage::F32(y),
        };
        let mut shape = lead.to_vec();
        shape.push(out);
        Ok((storage, Shape::from(shape)))
    }
}

/// Whether [`gemv`] takes `x` and `w`: both on the CPU, untracked by
/// autograd, each f32, f16 or bf16 (not necessarily the same: a 16-bit
/// weight under f32 activations is the weights-only half precision of
/// [`crate::Proj::quantize`]), `w (out, inp)` contiguous, `x (..., inp)`
/// of 1 to [`MAX_ROWS`] rows.
pub fn applies(x: &Tensor, w: &Tensor) -> bool {
    let rows = x.elem_count() / x.dims().last().copied().unwrap_or(1).max(1);
    x.device().is_cpu()
        && w.device().is_cpu()
        && !x.track_op()
        && !w.track_op()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && matches!(w.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && w.rank() == 2
        && w.is_contiguous()
        && x.dims().last() == w.dims().get(1)
        && (1..=MAX_ROWS).contains(&rows)
}

/// `x W^T` with the kernel, on this CPU's best [`Isa`].
///
/// # Shapes
/// `x: (..., inp)` (1 to [`MAX_ROWS`] rows, made contiguous), `w: (out,
/// inp)` contiguous → `(..., out)` in `x`'s dtype.
///
/// # Errors
/// When [`applies`] is false, with the reason.
pub fn gemv(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    gemv_with(CpuFeatures::get().isa(), x, w)
}

/// [`gemv`] on a given implementation (tests compare them; the token
/// proves the CPU runs it).
///
/// # Errors
/// As [`gemv`].
pub fn gemv_with(isa: Isa, x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    if !applies(x, w) {
        candle_core::bail!(
            "vl-gemv: takes untracked CPU x (1..={MAX_ROWS} rows, ..., inp) and a contiguous w (out, inp) of one dtype (f32, f16, bf16); got x {:?} {:?}, w {:?} {:?}",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    apply_with(isa, x, w)
}

/// [`gemv`] for operands the caller has checked with [`applies`] (the op
/// itself still refuses what it cannot compute).
pub(crate) fn apply(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    apply_with(CpuFeatures::get().isa(), x, w)
}

fn apply_with(isa: Isa, x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op2_no_bwd(w, &Gemv { isa })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// `x W^T` in f64 from the f32 values of both.
    fn reference(x: &Tensor, w: &Tensor) -> Vec<f64> {
        let inp = w.dim(1).expect("w");
        let x: Vec<f32> = x
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1())
            .expect("x");
        let w: Vec<f32> = w
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1())
            .expect("w");
        let mut y = Vec::new();
        for xr in x.chunks(inp) {
            for wr in w.chunks(inp) {
                y.push(xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum());
            }
        }
        y
    }

    fn isas() -> Vec<Isa> {
        CpuFeatures::get().isas()
    }

    /// Every supported path equals the f64 reference on odd shapes (widths
    /// not a multiple of 16, 1 to 8 rows, 1 and many outputs), for f32,
    /// f16 and bf16: relative error under 1e-5 (f32) or 1e-2 (half
    /// types, whose output is rounded to them).
    #[test]
    fn matches_the_reference() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F16, 1e-2), (DType::BF16, 1e-2)] {
            for &(out, inp) in &[(1, 1), (7, 15), (33, 17), (100, 64), (257, 773)] {
                for rows in [1, 2, 3, 5, 8] {
                    let x = Tensor::randn(0f32, 1., (rows, 1, inp), &dev)?.to_dtype(dtype)?;
                    let w = Tensor::randn(0f32, 1., (out, inp), &dev)?.to_dtype(dtype)?;
                    let want = reference(&x, &w);
                    let scale = want.iter().map(|v| v.abs()).fold(1e-3, f64::max);
                    for isa in isas() {
                        let y = gemv_with(isa, &x, &w)?;
                        assert_eq!(y.dims(), &[rows, 1, out]);
                        assert_eq!(y.dtype(), dtype);
                        let got: Vec<f32> = y.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                        for (g, w) in got.iter().zip(&want) {
                            let err = (*g as f64 - w).abs() / scale;
                            assert!(
                                err < tol,
                                "{dtype:?} {isa:?} ({rows}, {inp}) x ({out}, {inp}): {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// On the SIMD paths a row's result does not depend on the rows beside
    /// it: each row of a 1-to-8-row product equals that row alone, bit
    /// for bit (a sample of a batch decodes as it would alone), for every
    /// weight dtype.
    #[test]
    fn a_row_of_a_batch_is_the_row_alone() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (out, inp) = (37, 200);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let w = Tensor::randn(0f32, 1., (out, inp), &dev)?.to_dtype(dtype)?;
            let x = Tensor::randn(0f32, 1., (8, inp), &dev)?.to_dtype(dtype)?;
            for isa in isas().into_iter().filter(|i| i.simd() != Simd::Portable) {
                for rows in 1..=8 {
                    let xs = x.narrow(0, 0, rows)?;
                    let y = gemv_with(isa, &xs, &w)?.to_dtype(DType::F32)?;
                    for r in 0..rows {
                        let alone =
                            gemv_with(isa, &xs.narrow(0, r, 1)?, &w)?.to_dtype(DType::F32)?;
                        assert_eq!(
                            y.get(r)?.to_vec1::<f32>()?,
                            alone.get(0)?.to_vec1::<f32>()?,
                            "{dtype:?} {isa:?}: row {r} of {rows}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// A non-contiguous `x` is copied first and gives the same result as
    /// its contiguous copy; the result equals candle's matmul.
    #[test]
    fn non_contiguous_x_and_candle_parity() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1., (40, 24), &dev)?;
        let xt = Tensor::randn(0f32, 1., (24, 3), &dev)?.t()?; // (3, 24), strided
        assert!(!xt.is_contiguous());
        let got = gemv(&xt, &w)?;
        let want = xt.contiguous()?.matmul(&w.t()?)?;
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-4, "{diff}");
        Ok(())
    }

    /// A prefetch past a buffer's end, at null or at the top of the
    /// address space does not fault (this test fails by crashing): the
    /// kernels prefetch past the last weight of every product.
    #[test]
    fn prefetch_anywhere_is_harmless() {
        let w = [1u8; 64];
        let ahead4k = crate::kernels::Tuning::PREFETCH_AHEAD;
        for hint in [
            PrefetchHint::NonTemporal,
            PrefetchHint::T0,
            PrefetchHint::Off,
        ] {
            for (p, ahead) in [
                (w.as_ptr(), ahead4k),
                (w.as_ptr(), usize::MAX),
                (std::ptr::null(), 0),
                (std::ptr::null(), ahead4k),
                (usize::MAX as *const u8, ahead4k),
            ] {
                prefetch(p, ahead, hint);
            }
        }
    }

    /// Shapes and operands outside its domain are refused with the reason:
    /// too many rows, mismatched widths, an integer dtype, a tracked
    /// weight, a non-contiguous weight.
    #[test]
    fn refuses_what_it_does_not_take() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1., (8, 16), &dev)?;
        let cases = [
            (
                Tensor::zeros((MAX_ROWS + 1, 16), DType::F32, &dev)?,
                w.clone(),
            ),
            (Tensor::zeros((1, 15), DType::F32, &dev)?, w.clone()),
            (Tensor::zeros((1, 16), DType::U32, &dev)?, w.clone()),
            (
                Tensor::zeros((1, 16), DType::F32, &dev)?,
                candle_core::Var::from_tensor(&w)?.as_tensor().clone(),
            ),
            (Tensor::zeros((1, 8), DType::F32, &dev)?, w.t()?),
        ];
        for (x, w) in cases {
            assert!(!applies(&x, &w));
            let err = gemv(&x, &w).unwrap_err().to_string();
            assert!(err.contains("vl-gemv"), "{err}");
        }
        Ok(())
    }
}

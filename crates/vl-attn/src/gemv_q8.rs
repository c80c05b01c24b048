//! vl's q8_0 kernel for decode shapes: `y = x W^T` with `W (out, in)` in
//! candle's q8_0 blocks (an f16 scale and 32 `i8` per 32 weights, 34
//! bytes) and `x` of 1 to [`MAX_ROWS`](crate::gemv::MAX_ROWS) rows.
//!
//! Why vl owns it: candle's x86 q8_0 product repacks each weight into
//! tiles on first use and keeps them beside the blocks it was given (two
//! copies of every quantized weight), and runs on a thread pool of its
//! own whose worker spins between products while vl's pool computes
//! everything else — on two cores a fifth of a decode step went to that
//! spinning. This kernel reads the blocks where candle holds them (no
//! second copy) and splits the output rows across the rayon pool, the
//! process's one pool.
//!
//! The arithmetic is ggml's q8_0 × q8_0 dot product: each row of `x` is
//! rounded to q8_0 itself (per 32 values, scale `max|x| / 127`, values
//! `round(x / scale)`), each block's integer dot product is exact in
//! `i32`, and `scale_w · scale_x · dot` accumulates in f32. candle rounds
//! `x` per 256 values (its `q8k` blocks), so this is the finer of the two.
//! Every output is computed the same way whatever the number of rows.
//!
//! [`crate::Proj`] routes decode shapes here and more rows (a prefill,
//! an encoder) to candle's tiled product, which reuses each weight tile
//! across rows and is 3.5 times faster there (a ViT-B/16 encode: 92 ms
//! against 323 ms with every row here); the two round `x` differently,
//! so a prefill of more than [`MAX_ROWS`](crate::gemv::MAX_ROWS) rows and
//! the same rows one step at a time agree within 8-bit precision, not to
//! the last bit.
//!
//! The instruction set is chosen once per process ([`isa`]): AVX-512 VNNI
//! (`vpdpbusd`, weights offset to unsigned with the offset taken back
//! through the activations' sums), AVX2 (`vpmaddubsw` on the weights'
//! magnitudes and the signs moved onto `x`, as ggml does), or plain code
//! for the target's baseline. Every path is tested against an f64
//! reference on odd shapes.

use std::sync::OnceLock;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Tensor};
use half::f16;

/// Values per q8_0 block.
pub const BLOCK_VALUES: usize = 32;
/// Bytes per q8_0 block: an f16 scale and 32 `i8`.
pub const BLOCK_BYTES: usize = 34;

/// Rows of `x` per block of a many-row product (64 rows of 3072 bytes
/// and their scales: an L2's share).
const ROW_BLOCK: usize = 64;

/// The instruction set of the q8_0 kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q8Isa {
    /// x86-64 with AVX-512F, AVX-512BW and AVX-512 VNNI.
    Vnni,
    /// x86-64 with AVX2 and FMA.
    Avx2,
    /// The target's baseline.
    Portable,
}

/// The best [`Q8Isa`] of this CPU, detected once.
pub fn isa() -> Q8Isa {
    static ISA: OnceLock<Q8Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        [Q8Isa::Vnni, Q8Isa::Avx2]
            .into_iter()
            .find(|i| supported(*i))
            .unwrap_or(Q8Isa::Portable)
    })
}

/// Whether this CPU can run `isa`.
pub fn supported(isa: Q8Isa) -> bool {
    match isa {
        Q8Isa::Portable => true,
        #[cfg(target_arch = "x86_64")]
        Q8Isa::Vnni => {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
        }
        #[cfg(target_arch = "x86_64")]
        Q8Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
        #[cfg(not(target_arch = "x86_64"))]
        _ => false,
    }
}

/// Rows of `x` rounded to q8_0, with what the kernels read besides.
pub(crate) struct Activations {
    rows: usize,
    /// Values per row, a multiple of [`BLOCK_VALUES`].
    k: usize,
    /// `(rows, k)` rounded values.
    q: Vec<i8>,
    /// `(rows, k / 32)` scales.
    d: Vec<f32>,
    /// `(rows, k / 4)`: for each group of 4 values, `-128 ×` their sum
    /// (VNNI: what the weights' +128 offset adds to each lane).
    offset: Vec<i32>,
    /// `(rows, k / 4)`: each group's block scale (VNNI lanes).
    lane_d: Vec<f32>,
}

impl Activations {
    /// Rounds `x (rows, k)` row by row, block by block: scale `max|x| /
    /// 127`, values `round(x / scale)` (ggml's `quantize_row_q8_0`).
    pub(crate) fn new(x: &[f32], rows: usize, k: usize) -> Self {
        let blocks = k / BLOCK_VALUES;
        let mut q = vec![0i8; rows * k];
        let mut d = vec![0f32; rows * blocks];
        for ((xb, qb), db) in x
            .chunks_exact(BLOCK_VALUES)
            .zip(q.chunks_exact_mut(BLOCK_VALUES))
            .zip(d.iter_mut())
        {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            *db = amax / 127.0;
            let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            for (qv, &xv) in qb.iter_mut().zip(xb) {
                *qv = (xv * id).round() as i8;
            }
        }
        let offset = q
            .chunks_exact(4)
            .map(|g| -128 * g.iter().map(|&v| v as i32).sum::<i32>())
            .collect();
        let lane_d = d.iter().flat_map(|&s| [s; BLOCK_VALUES / 4]).collect();
        Self {
            rows,
            k,
            q,
            d,
            offset,
            lane_d,
        }
    }

    /// Row `r`'s rounded values and block scales.
    #[cfg(test)]
    pub(crate) fn row(&self, r: usize) -> (&[i8], &[f32]) {
        let blocks = self.k / BLOCK_VALUES;
        (
            &self.q[r * self.k..][..self.k],
            &self.d[r * blocks..][..blocks],
        )
    }
}

/// `out[i] = x[r0 + i] · w` for one weight row `w` (its q8_0 blocks), on
/// the plain path: integer dot per block, scaled and summed in f32.
#[inline(always)]
fn dot_portable<const R: usize>(w: &[u8], a: &Activations, r0: usize, out: &mut [f32; R]) {
    let blocks = a.k / BLOCK_VALUES;
    let mut acc = [0f32; R];
    for (b, block) in w.chunks_exact(BLOCK_BYTES).enumerate() {
        let dw = f16::from_le_bytes([block[0], block[1]]).to_f32();
        for (i, acc) in acc.iter_mut().enumerate() {
            let r = r0 + i;
            let xq = &a.q[r * a.k + b * BLOCK_VALUES..][..BLOCK_VALUES];
            let s: i32 = block[2..]
                .iter()
                .zip(xq)
                .map(|(&wv, &xv)| (wv as i8) as i32 * xv as i32)
                .sum();
            *acc += s as f32 * (dw * a.d[r * blocks + b]);
        }
    }
    *out = acc;
}

/// [`dot_portable`] with AVX-512 VNNI: two blocks per `vpdpbusd`, the
/// weights offset by +128 to unsigned, the lanes started at `-128 × Σx`
/// so the offset cancels.
///
/// # Safety
/// The CPU supports AVX-512F, BW and VNNI; `w` is whole blocks of the
/// width of `a`, and rows `r0..r0 + R` exist in `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn dot_vnni<const R: usize>(w: &[u8], a: &Activations, r0: usize, out: &mut [f32; R]) {
    // SAFETY: the caller's contract (above): whole blocks, rows that
    // exist, and the instruction set; the one-block tail loads masked.
    unsafe {
        use std::arch::x86_64::*;
        let blocks = a.k / BLOCK_VALUES;
        debug_assert_eq!(w.len(), blocks * BLOCK_BYTES);
        let flip = _mm512_set1_epi8(-128);
        let mut acc = [_mm512_setzero_ps(); R];
        let wp = w.as_ptr();
        let q = a.q.as_ptr();
        let offset = a.offset.as_ptr();
        let lane_d = a.lane_d.as_ptr();
        let (k, lanes) = (a.k, a.k / 4);
        let mut b = 0;
        while b + 2 <= blocks {
            let p = wp.add(b * BLOCK_BYTES);
            let lo = _mm256_loadu_si256(p.add(2) as *const __m256i);
            let hi = _mm256_loadu_si256(p.add(BLOCK_BYTES + 2) as *const __m256i);
            let wu = _mm512_xor_si512(
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi),
                flip,
            );
            let d0 = (p as *const i16).read_unaligned();
            let d1 = (p.add(BLOCK_BYTES) as *const i16).read_unaligned();
            let dh = _mm256_inserti128_si256::<1>(
                _mm256_castsi128_si256(_mm_set1_epi16(d0)),
                _mm_set1_epi16(d1),
            );
            let dw = _mm512_cvtph_ps(dh);
            for (i, acc) in acc.iter_mut().enumerate() {
                let r = r0 + i;
                let xq = _mm512_loadu_si512(q.add(r * k + b * BLOCK_VALUES) as *const _);
                let c = _mm512_loadu_si512(offset.add(r * lanes + b * 8) as *const _);
                let s = _mm512_dpbusd_epi32(c, wu, xq);
                let dx = _mm512_loadu_ps(lane_d.add(r * lanes + b * 8));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), *acc);
            }
            b += 2;
        }
        if b < blocks {
            // One block left: the upper lanes load nothing (masked) and add 0.
            let p = wp.add(b * BLOCK_BYTES);
            let lo = _mm256_loadu_si256(p.add(2) as *const __m256i);
            let wu = _mm512_xor_si512(_mm512_zextsi256_si512(lo), flip);
            let d0 = (p as *const i16).read_unaligned();
            let dw = _mm512_cvtph_ps(_mm256_set1_epi16(d0));
            for (i, acc) in acc.iter_mut().enumerate() {
                let r = r0 + i;
                let xq = _mm512_maskz_loadu_epi8(u32::MAX as u64, q.add(r * k + b * BLOCK_VALUES));
                let c = _mm512_maskz_loadu_epi32(0x00ff, offset.add(r * lanes + b * 8));
                let s = _mm512_dpbusd_epi32(c, wu, xq);
                let dx = _mm512_maskz_loadu_ps(0x00ff, lane_d.add(r * lanes + b * 8));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), *acc);
            }
        }
        for (o, acc) in out.iter_mut().zip(acc) {
            *o = _mm512_reduce_add_ps(acc);
        }
    }
}

/// [`dot_portable`] with AVX2: per block, `vpmaddubsw` of the weights'
/// magnitudes and `x` carrying the weights' signs (no overflow: `x` is
/// within ±127), pairs summed by `vpmaddwd`.
///
/// # Safety
/// The CPU supports AVX2 and FMA; `w` is whole blocks of the width of
/// `a`, and rows `r0..r0 + R` exist in `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2<const R: usize>(w: &[u8], a: &Activations, r0: usize, out: &mut [f32; R]) {
    // SAFETY: the caller's contract (above): whole blocks, rows that
    // exist, and the instruction set; the one-block tail loads masked.
    unsafe {
        use std::arch::x86_64::*;
        let blocks = a.k / BLOCK_VALUES;
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, block) in w.chunks_exact(BLOCK_BYTES).enumerate() {
            let dw = f16::from_le_bytes([block[0], block[1]]).to_f32();
            let wv = _mm256_loadu_si256(block.as_ptr().add(2) as *const __m256i);
            let wabs = _mm256_sign_epi8(wv, wv);
            for (i, acc) in acc.iter_mut().enumerate() {
                let r = r0 + i;
                let xq =
                    _mm256_loadu_si256(a.q.as_ptr().add(r * a.k + b * BLOCK_VALUES) as *const _);
                let pairs = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xq, wv));
                let s = _mm256_madd_epi16(pairs, ones);
                let d = _mm256_set1_ps(dw * a.d[r * blocks + b]);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, *acc);
            }
        }
        for (o, acc) in out.iter_mut().zip(acc) {
            let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            let h = _mm_add_ss(h, _mm_movehdup_ps(h));
            *o = _mm_cvtss_f32(h);
        }
    }
}

/// Rows `r0..r0 + R` of `a` against one weight row, with `isa`.
#[inline(always)]
fn dot<const R: usize>(isa: Q8Isa, w: &[u8], a: &Activations, r0: usize, out: &mut [f32; R]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is one the CPU supports (`product`'s callers check
        // with `supported`); `task` passes whole weight rows of `a`'s width
        // and rows that exist.
        Q8Isa::Vnni => unsafe { dot_vnni(w, a, r0, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Q8Isa::Avx2 => unsafe { dot_avx2(w, a, r0, out) },
        _ => dot_portable(w, a, r0, out),
    }
}

/// `yt[o * rows + r] = x[r] · w[o]` for the weight rows `w` of one task.
fn task(isa: Q8Isa, a: &Activations, w: &[u8], yt: &mut [f32]) {
    let rows = a.rows;
    let row_bytes = a.k / BLOCK_VALUES * BLOCK_BYTES;
    for r0 in (0..rows).step_by(ROW_BLOCK) {
        let r1 = (r0 + ROW_BLOCK).min(rows);
        for (wo, yo) in w.chunks_exact(row_bytes).zip(yt.chunks_exact_mut(rows)) {
            // Groups of 4, 2, 1 rows: the weight row stays in L1 between them.
            let mut r = r0;
            while r < r1 {
                match r1 - r {
                    n if n >= 4 => {
                        let mut o = [0f32; 4];
                        dot(isa, wo, a, r, &mut o);
                        yo[r..r + 4].copy_from_slice(&o);
                        r += 4;
                    }
                    n if n >= 2 => {
                        let mut o = [0f32; 2];
                        dot(isa, wo, a, r, &mut o);
                        yo[r..r + 2].copy_from_slice(&o);
                        r += 2;
                    }
                    _ => {
                        let mut o = [0f32; 1];
                        dot(isa, wo, a, r, &mut o);
                        yo[r] = o[0];
                        r += 1;
                    }
                }
            }
        }
    }
}

/// `y (rows, out)` for the first `out` rows of the q8_0 weight `bytes`,
/// with `isa`, which the CPU supports.
fn product(isa: Q8Isa, a: &Activations, bytes: &[u8], out: usize) -> Vec<f32> {
    let row_bytes = a.k / BLOCK_VALUES * BLOCK_BYTES;
    crate::gemv::parallel(out, a.rows, |o, yt| {
        task(isa, a, &bytes[o.start * row_bytes..o.end * row_bytes], yt)
    })
}

/// Whether [`gemv_q8_0`] takes `x` and `w` as a decode-step product: both
/// on the CPU, `w` q8_0 `(out, k)`, `x (..., k)` a float tensor of 1 to
/// [`MAX_ROWS`](crate::gemv::MAX_ROWS) rows, untracked by autograd.
pub fn applies(x: &Tensor, w: &QTensor) -> bool {
    let Ok((_, k)) = w.shape().dims2() else {
        return false;
    };
    let rows = x.elem_count() / k.max(1);
    w.dtype() == GgmlDType::Q8_0
        && w.device().is_cpu()
        && x.device().is_cpu()
        && !x.track_op()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && x.dims().last() == Some(&k)
        && k.is_multiple_of(BLOCK_VALUES)
        && (1..=crate::gemv::MAX_ROWS).contains(&rows)
}

/// `x W^T` for a q8_0 weight, on this CPU's best [`isa`], with `x` rounded
/// to q8_0 (see the module's documentation); any number of rows, each
/// computed the same way.
///
/// # Shapes
/// `x: (..., k)` any float dtype; `w: (out, k)` q8_0 on the CPU, `k` a
/// multiple of 32 → `(..., out)` f32.
///
/// # Errors
/// A weight not q8_0 or not on the CPU, an `x` not on the CPU or empty,
/// widths that do not match — each named.
pub fn gemv_q8_0(x: &Tensor, w: &QTensor) -> candle_core::Result<Tensor> {
    let out = w.shape().dims2()?.0;
    gemv_q8_0_rows(isa(), x, w, out)
}

/// [`gemv_q8_0`] with a given instruction set (tests compare them).
///
/// # Errors
/// As [`gemv_q8_0`], and an `isa` this CPU does not support.
pub fn gemv_q8_0_with(isa: Q8Isa, x: &Tensor, w: &QTensor) -> candle_core::Result<Tensor> {
    let out = w.shape().dims2()?.0;
    gemv_q8_0_rows(isa, x, w, out)
}

/// [`gemv_q8_0`] for the first `out` rows of `w` only (a weight padded
/// with rows of zeros for another kernel's tiles).
pub(crate) fn gemv_q8_0_rows(
    isa: Q8Isa,
    x: &Tensor,
    w: &QTensor,
    out: usize,
) -> candle_core::Result<Tensor> {
    if !supported(isa) {
        candle_core::bail!("vl-gemv-q8_0: this CPU cannot run {isa:?}");
    }
    let (w_rows, k) = w.shape().dims2()?;
    let dims = x.dims();
    if w.dtype() != GgmlDType::Q8_0 || !w.device().is_cpu() || !x.device().is_cpu() {
        candle_core::bail!(
            "vl-gemv-q8_0: takes a q8_0 weight and x on the CPU; got a {:?} weight",
            w.dtype()
        );
    }
    let rows = x.elem_count() / k.max(1);
    if dims.last() != Some(&k) || !k.is_multiple_of(BLOCK_VALUES) || rows == 0 || out > w_rows {
        candle_core::bail!(
            "vl-gemv-q8_0: takes x (..., {k}) of at least one row and a weight (out, k * 32); got x {dims:?}, w ({w_rows}, {k})"
        );
    }
    let bytes = w.data()?;
    if bytes.len() != w_rows * k / BLOCK_VALUES * BLOCK_BYTES {
        candle_core::bail!(
            "vl-gemv-q8_0: a q8_0 weight of {} bytes for ({w_rows}, {k})",
            bytes.len()
        );
    }
    let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let a = Activations::new(&xs, rows, k);
    let y = product(isa, &a, &bytes, out);
    let mut shape = dims[..dims.len() - 1].to_vec();
    shape.push(out);
    Tensor::from_vec(y, shape, x.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Module};

    fn isas() -> Vec<Q8Isa> {
        [Q8Isa::Vnni, Q8Isa::Avx2, Q8Isa::Portable]
            .into_iter()
            .filter(|i| supported(*i))
            .collect()
    }

    /// The rounding is ggml's: scale `max|x| / 127`, values within ±127,
    /// each value within half a step of `x / scale`; a zero block stays
    /// zero with scale 0.
    #[test]
    fn activations_round_per_block() {
        let mut x: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        x[32..64].fill(0.0);
        let a = Activations::new(&x, 1, 96);
        let (q, d) = a.row(0);
        assert_eq!(d[1], 0.0);
        assert!(q[32..64].iter().all(|&v| v == 0));
        for b in [0, 2] {
            let xb = &x[b * 32..][..32];
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(d[b], amax / 127.0);
            for (qv, xv) in q[b * 32..][..32].iter().zip(xb) {
                assert!((-127..=127).contains(qv));
                assert!((*qv as f32 - xv / d[b]).abs() <= 0.5 + 1e-4, "{qv} vs {xv}");
            }
        }
    }

    /// Every supported path equals the f64 product of the dequantized
    /// weight and the rounded `x` (relative error under 1e-5: only the
    /// summation order differs) for 1 to 131 rows (past a row block),
    /// widths of 1 to 25 blocks (odd block counts: VNNI's half pair) and
    /// weight rows reaching the end of the buffer; `out` below the
    /// weight's rows computes those rows only.
    #[test]
    fn matches_the_dequantized_reference() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for &(out, k) in &[(1, 32), (7, 96), (33, 64), (65, 800)] {
            let w = Tensor::randn(0f32, 1., (out, k), &dev)?;
            let q = QTensor::quantize(&w, GgmlDType::Q8_0)?;
            let dq: Vec<f32> = q.dequantize(&dev)?.flatten_all()?.to_vec1()?;
            for rows in [1, 2, 3, 5, 8, 70, 131] {
                let x = Tensor::randn(0f32, 1., (1, rows, k), &dev)?;
                let a = Activations::new(&x.flatten_all()?.to_vec1::<f32>()?, rows, k);
                let mut want = Vec::new();
                for r in 0..rows {
                    let (xq, xd) = a.row(r);
                    for wr in dq.chunks(k) {
                        want.push(
                            wr.iter()
                                .zip(xq)
                                .enumerate()
                                .map(|(j, (wv, &qv))| *wv as f64 * qv as f64 * xd[j / 32] as f64)
                                .sum::<f64>(),
                        );
                    }
                }
                let scale = want.iter().map(|v| v.abs()).fold(1e-3, f64::max);
                for isa in isas() {
                    let y = gemv_q8_0_with(isa, &x, &q)?;
                    assert_eq!(y.dims(), &[1, rows, out]);
                    let got: Vec<f32> = y.flatten_all()?.to_vec1()?;
                    for (g, w) in got.iter().zip(&want) {
                        let err = (*g as f64 - w).abs() / scale;
                        assert!(
                            err < 1e-5,
                            "{isa:?} ({rows}, {k}) x ({out}, {k}): {g} vs {w}"
                        );
                    }
                    if out > 1 {
                        let y = gemv_q8_0_rows(isa, &x, &q, out - 1)?;
                        assert_eq!(y.dims(), &[1, rows, out - 1]);
                        let head = got
                            .chunks(out)
                            .flat_map(|r| r[..out - 1].to_vec())
                            .collect::<Vec<_>>();
                        assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, head);
                    }
                }
            }
        }
        Ok(())
    }

    /// Against the unrounded product: the error of rounding `x` stays
    /// within what 8 bits allow (relative L2 under 1%), and candle's own
    /// q8_0 product is no closer.
    #[test]
    fn close_to_the_f32_product() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (out, k) = (96, 768);
        let w = Tensor::randn(0f32, 1., (out, k), &dev)?;
        let q = QTensor::quantize(&w, GgmlDType::Q8_0)?;
        let x = Tensor::randn(0f32, 1., (3, k), &dev)?;
        let exact = x.matmul(&q.dequantize(&dev)?.t()?)?;
        let rel = |y: &Tensor| -> candle_core::Result<f32> {
            let num = (y - &exact)?.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
            let den = exact.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
            Ok(num / den)
        };
        let ours = rel(&gemv_q8_0(&x, &q)?)?;
        let candle = rel(&candle_core::quantized::QMatMul::from_qtensor(q)?.forward(&x)?)?;
        assert!(ours < 1e-2, "{ours}");
        assert!(ours <= candle * 1.05, "vl {ours} vs candle {candle}");
        Ok(())
    }

    /// Weights of another format, mismatched widths and an `out` past the
    /// weight are refused with the reason; `applies` says no to them and
    /// to more rows than a decode step has.
    #[test]
    fn refuses_what_it_does_not_take() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let q4 = QTensor::quantize(&Tensor::zeros((4, 256), DType::F32, &dev)?, GgmlDType::Q4K)?;
        let x = Tensor::zeros((1, 256), DType::F32, &dev)?;
        assert!(!applies(&x, &q4));
        let err = gemv_q8_0(&x, &q4).unwrap_err();
        assert!(err.to_string().contains("q8_0 weight"), "{err}");
        let q8 = QTensor::quantize(&Tensor::zeros((4, 32), DType::F32, &dev)?, GgmlDType::Q8_0)?;
        let wide = Tensor::zeros((2, 64), DType::F32, &dev)?;
        assert!(!applies(&wide, &q8));
        let err = gemv_q8_0(&wide, &q8).unwrap_err();
        assert!(err.to_string().contains("(out, k * 32)"), "{err}");
        let err =
            gemv_q8_0_rows(isa(), &Tensor::zeros((2, 32), DType::F32, &dev)?, &q8, 5).unwrap_err();
        assert!(err.to_string().contains("(4, 32)"), "{err}");
        assert!(applies(&Tensor::zeros((8, 32), DType::F32, &dev)?, &q8));
        assert!(!applies(&Tensor::zeros((9, 32), DType::F32, &dev)?, &q8));
        Ok(())
    }
}

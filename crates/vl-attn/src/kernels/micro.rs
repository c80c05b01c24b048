//! The register-tile micro-kernel of vl's tiled attention (both of its
//! products): `C (MR × NR) += A (MR × k) · B (k × NR)`
//! with `A` read at any row and column stride (rows of a matrix, or the
//! columns of a transposed one) and `B` as rows of [`NR`] floats.
//!
//! One implementation per instruction set behind [`Kernel`]: AVX-512F
//! intrinsics (16 accumulators of 16 lanes, a broadcast and two FMAs per
//! row and step), and plain Rust compiled for AVX2+FMA or for the target's
//! baseline. Callers compile their loops once per instruction set with
//! `#[target_feature]` ([`per_isa`]) and run the one an
//! [`crate::kernels::Isa`] token names.

/// Rows per micro-tile (keys in the score product, query rows in the
/// value product).
pub(crate) const MR: usize = 8;
/// Columns per micro-tile: two AVX-512 registers, four AVX2 ones.
pub(crate) const NR: usize = 32;

/// `a * b + c`, fused when `fused` (callers pass their kernel's
/// [`Kernel::FMA`], a constant, so the branch folds away; without FMA
/// `mul_add` would be a library call).
#[inline(always)]
pub(crate) fn madd(fused: bool, a: f32, b: f32, c: f32) -> f32 {
    if fused {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// What differs between the instruction sets: whether `mul_add` is an
/// instruction, and the micro-kernel.
pub(crate) trait Kernel {
    const FMA: bool;
    /// Whether this is the AVX-512F kernel (callers may then run AVX-512F
    /// code of their own: [`per_isa`] runs it only where the CPU has it).
    #[cfg(target_arch = "x86_64")]
    const AVX512: bool = false;

    /// `c[i][..] += Σ_p a(i, p) · b(p)` for `i < MR`, `p < kdim`, where
    /// `a(i, p) = a[i * rs + p * cs]` and `b(p)` is the [`NR`] floats at
    /// `b[p * ldb..]`.
    ///
    /// # Safety
    /// Every index named above is in bounds of the allocations behind `a`
    /// and `b` (checked by [`micro`]), and the CPU runs the instruction set.
    unsafe fn micro(
        a: *const f32,
        rs: usize,
        cs: usize,
        b: *const f32,
        ldb: usize,
        kdim: usize,
        c: &mut [[f32; NR]; MR],
    );

    /// [`Kernel::micro`] with `a`'s rows where they lie (`cs = 1`), `b`
    /// packed (`ldb = NR`) and `C` in place, rows `ldc` floats apart
    /// (zeros rather than its values when `fresh`): a matrix product's
    /// weight rows by a packed panel of its rows, into its scratch. The
    /// same sums in the same order. With `half`, only the first `NR / 2`
    /// columns are asked for (a last panel of at most 16 rows); the others
    /// may then hold anything.
    ///
    /// # Safety
    /// As [`Kernel::micro`], and `c` is valid for reads and writes of
    /// [`MR`] rows of [`NR`] floats, `ldc` apart.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro_rows(
        a: *const f32,
        rs: usize,
        b: *const f32,
        kdim: usize,
        c: *mut f32,
        ldc: usize,
        fresh: bool,
        half: bool,
    ) {
        let _ = half;
        let mut tile = [[0f32; NR]; MR];
        // SAFETY: the caller's contract.
        unsafe {
            if !fresh {
                for (i, row) in tile.iter_mut().enumerate() {
                    std::ptr::copy_nonoverlapping(c.add(i * ldc), row.as_mut_ptr(), NR);
                }
            }
            Self::micro(a, rs, 1, b, NR, kdim, &mut tile);
            for (i, row) in tile.iter().enumerate() {
                std::ptr::copy_nonoverlapping(row.as_ptr(), c.add(i * ldc), NR);
            }
        }
    }

    /// `m[l] = if x > m[l] { x } else { m[l] }` for each row `x` of `rows`
    /// ([`NR`] floats each, lane `l`): a NaN leaves `m` as it was. The
    /// same values on every instruction set; the SIMD forms keep `m` in
    /// registers (the plain loop compiled to a scalar compare and store
    /// per row and lane: 15% of the tiled attention on DaViT's windows).
    ///
    /// # Safety
    /// The CPU runs the instruction set.
    #[inline(always)]
    unsafe fn row_maxima(m: &mut [f32; NR], rows: &[f32]) {
        for row in rows.chunks_exact(NR) {
            for (m, &x) in m.iter_mut().zip(row) {
                *m = if x > *m { x } else { *m };
            }
        }
    }
}

/// Plain Rust over fixed-size arrays: `Portable<false>` ([`Plain`]) for
/// the target's baseline, `Portable<true>` ([`Fma`]) compiled with AVX2
/// and FMA, where `mul_add` is one instruction.
pub(crate) struct Portable<const FMA: bool>;
/// Plain Rust, vectorised by the compiler for the target's baseline.
pub(crate) type Plain = Portable<false>;
/// Plain Rust compiled with AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
pub(crate) type Fma = Portable<true>;
/// AVX-512F intrinsics: 16 accumulators of 16 lanes.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx512;
/// AVX2 and FMA intrinsics: the tile in four passes of 8 columns, 8
/// accumulators each (the plain form's 8 × 32 accumulators are 32 of the
/// 16 registers: the compiler spilled them every step).
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx2;

impl<const F: bool> Kernel for Portable<F> {
    const FMA: bool = F;

    #[inline(always)]
    unsafe fn micro(
        a: *const f32,
        rs: usize,
        cs: usize,
        b: *const f32,
        ldb: usize,
        kdim: usize,
        c: &mut [[f32; NR]; MR],
    ) {
        let mut acc = *c;
        for p in 0..kdim {
            // SAFETY: in bounds (the caller's contract).
            let brow: [f32; NR] = unsafe { std::ptr::read_unaligned(b.add(p * ldb).cast()) };
            // SAFETY: as above.
            let x: [f32; MR] = std::array::from_fn(|i| unsafe { *a.add(i * rs + p * cs) });
            for (acc_i, &x) in acc.iter_mut().zip(&x) {
                for l in 0..NR {
                    acc_i[l] = madd(F, x, brow[l], acc_i[l]);
                }
            }
        }
        *c = acc;
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernel for Avx512 {
    const FMA: bool = true;
    const AVX512: bool = true;

    /// One pointer per row of `a` and one index for all (the general
    /// kernel's address arithmetic for a runtime row stride, an `lea` or
    /// `add` per row and step, took the FMA ports' slots), and the tile
    /// loaded and stored where it lies; one register of columns when
    /// `half`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro_rows(
        a: *const f32,
        rs: usize,
        b: *const f32,
        kdim: usize,
        c: *mut f32,
        ldc: usize,
        fresh: bool,
        half: bool,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            if half {
                avx512_rows::<1>(a, rs, b, kdim, c, ldc, fresh)
            } else {
                avx512_rows::<2>(a, rs, b, kdim, c, ldc, fresh)
            }
        }
    }

    #[inline(always)]
    unsafe fn micro(
        a: *const f32,
        rs: usize,
        cs: usize,
        b: *const f32,
        ldb: usize,
        kdim: usize,
        c: &mut [[f32; NR]; MR],
    ) {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract: indices in bounds, AVX-512F present.
        unsafe {
            let cp = c.as_mut_ptr().cast::<f32>();
            let mut acc: [[__m512; 2]; MR] = std::array::from_fn(|i| {
                [
                    _mm512_loadu_ps(cp.add(i * NR)),
                    _mm512_loadu_ps(cp.add(i * NR + 16)),
                ]
            });
            for p in 0..kdim {
                let bp = b.add(p * ldb);
                let (b0, b1) = (_mm512_loadu_ps(bp), _mm512_loadu_ps(bp.add(16)));
                let ap = a.add(p * cs);
                for (i, acc_i) in acc.iter_mut().enumerate() {
                    let x = _mm512_set1_ps(*ap.add(i * rs));
                    acc_i[0] = _mm512_fmadd_ps(x, b0, acc_i[0]);
                    acc_i[1] = _mm512_fmadd_ps(x, b1, acc_i[1]);
                }
            }
            for (i, acc_i) in acc.iter().enumerate() {
                _mm512_storeu_ps(cp.add(i * NR), acc_i[0]);
                _mm512_storeu_ps(cp.add(i * NR + 16), acc_i[1]);
            }
        }
    }

    /// `vmaxps` is `if x > m { x } else { m }`, lane by lane.
    #[inline(always)]
    unsafe fn row_maxima(m: &mut [f32; NR], rows: &[f32]) {
        use std::arch::x86_64::*;
        // SAFETY: AVX-512F (the caller's contract); each load is within a
        // whole row (`chunks_exact`), `m` holds two registers.
        unsafe {
            let (mut m0, mut m1) = (
                _mm512_loadu_ps(m.as_ptr()),
                _mm512_loadu_ps(m.as_ptr().add(16)),
            );
            for row in rows.chunks_exact(NR) {
                m0 = _mm512_max_ps(_mm512_loadu_ps(row.as_ptr()), m0);
                m1 = _mm512_max_ps(_mm512_loadu_ps(row.as_ptr().add(16)), m1);
            }
            _mm512_storeu_ps(m.as_mut_ptr(), m0);
            _mm512_storeu_ps(m.as_mut_ptr().add(16), m1);
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernel for Avx2 {
    const FMA: bool = true;

    /// The same sums as [`Fma`]'s, in the same order: the same bits.
    #[inline(always)]
    unsafe fn micro(
        a: *const f32,
        rs: usize,
        cs: usize,
        b: *const f32,
        ldb: usize,
        kdim: usize,
        c: &mut [[f32; NR]; MR],
    ) {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract: indices in bounds, AVX2 and FMA
        // present.
        unsafe {
            let cp = c.as_mut_ptr().cast::<f32>();
            for col in (0..NR).step_by(8) {
                let mut acc: [__m256; MR] =
                    std::array::from_fn(|i| _mm256_loadu_ps(cp.add(i * NR + col)));
                for p in 0..kdim {
                    let bp = _mm256_loadu_ps(b.add(p * ldb + col));
                    let ap = a.add(p * cs);
                    for (i, acc_i) in acc.iter_mut().enumerate() {
                        *acc_i = _mm256_fmadd_ps(_mm256_set1_ps(*ap.add(i * rs)), bp, *acc_i);
                    }
                }
                for (i, acc_i) in acc.iter().enumerate() {
                    _mm256_storeu_ps(cp.add(i * NR + col), *acc_i);
                }
            }
        }
    }

    /// `vmaxps` is `if x > m { x } else { m }`, lane by lane.
    #[inline(always)]
    unsafe fn row_maxima(m: &mut [f32; NR], rows: &[f32]) {
        use std::arch::x86_64::*;
        // SAFETY: AVX2 (the caller's contract); each load is within a
        // whole row (`chunks_exact`), `m` holds four registers.
        unsafe {
            let mut acc: [__m256; NR / 8] = [_mm256_setzero_ps(); NR / 8];
            for (v, a) in acc.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(m.as_ptr().add(8 * v));
            }
            for row in rows.chunks_exact(NR) {
                for (v, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_max_ps(_mm256_loadu_ps(row.as_ptr().add(8 * v)), *a);
                }
            }
            for (v, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(m.as_mut_ptr().add(8 * v), *a);
            }
        }
    }
}

/// [`Kernel::micro`] over slices, every index checked once up front.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn micro<K: Kernel>(
    a: &[f32],
    rs: usize,
    cs: usize,
    b: &[f32],
    ldb: usize,
    kdim: usize,
    c: &mut [[f32; NR]; MR],
) {
    if kdim == 0 {
        return;
    }
    assert!(
        (MR - 1) * rs + (kdim - 1) * cs < a.len(),
        "micro-kernel: a too short"
    );
    assert!(
        (kdim - 1) * ldb + NR <= b.len(),
        "micro-kernel: b too short"
    );
    // SAFETY: the largest indices are checked above; `K` is only
    // instantiated inside functions compiled for its instruction set, which
    // `task` calls only on CPUs that have it.
    unsafe { K::micro(a.as_ptr(), rs, cs, b.as_ptr(), ldb, kdim, c) }
}

/// The 16 × 16 transpose of `r` (16 rows of 16 lanes) in registers:
/// lane `i` of the result's `d` is lane `d` of `r[i]`. Unpacks, then two
/// rounds of 128-bit lane shuffles.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn transpose16(
    r: &[std::arch::x86_64::__m512; 16],
) -> [std::arch::x86_64::__m512; 16] {
    use std::arch::x86_64::*;
    // Pairs of rows interleaved, per 128-bit lane.
    let t: [__m512; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    // u[4k + c], 128-bit lane j: column 4j + c of rows 4k..4k + 4.
    let mut u = [_mm512_setzero_ps(); 16];
    for k in 0..4 {
        u[4 * k] = _mm512_shuffle_ps::<0x44>(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm512_shuffle_ps::<0xEE>(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm512_shuffle_ps::<0x44>(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm512_shuffle_ps::<0xEE>(t[4 * k + 1], t[4 * k + 3]);
    }
    let mut out = [_mm512_setzero_ps(); 16];
    for c in 0..4 {
        let x0 = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
        let x1 = _mm512_shuffle_f32x4::<0xDD>(u[c], u[4 + c]);
        let y0 = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
        let y1 = _mm512_shuffle_f32x4::<0xDD>(u[8 + c], u[12 + c]);
        // Column 4j + c, rows 0..16 in order, for j = 0..4.
        out[c] = _mm512_shuffle_f32x4::<0x88>(x0, y0);
        out[4 + c] = _mm512_shuffle_f32x4::<0x88>(x1, y1);
        out[8 + c] = _mm512_shuffle_f32x4::<0xDD>(x0, y0);
        out[12 + c] = _mm512_shuffle_f32x4::<0xDD>(x1, y1);
    }
    out
}

/// The first `whole` columns (a multiple of 16) of `rows` (at most [`NR`]
/// rows of `k` values) transposed into `out` (`k × NR`: column `p` at `p ·
/// NR`), each times `scale` if any, the lanes past the last row zero: by
/// blocks of 16 × 16 through [`transpose16`]. The packing of gemm_f32's
/// rows and of the tiled attention's queries. `out` may be uninitialised:
/// every value of those columns is written.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose_rows(
    rows: &[f32],
    k: usize,
    whole: usize,
    scale: Option<f32>,
    out: &mut [std::mem::MaybeUninit<f32>],
) {
    use std::arch::x86_64::*;
    let here = rows.len() / k;
    assert!(
        here <= NR && rows.len() == here * k && whole.is_multiple_of(16) && whole <= k,
        "transpose_rows: {here} rows of {k}, {whole} columns"
    );
    assert!(out.len() >= whole * NR, "transpose_rows: out too short");
    for h in (0..NR).step_by(16) {
        for p0 in (0..whole).step_by(16) {
            let r: [__m512; 16] = std::array::from_fn(|i| {
                if h + i < here {
                    // SAFETY: row `h + i < here`, columns `p0 .. p0 + 16
                    // <= k` of it: inside `rows`.
                    unsafe { _mm512_loadu_ps(rows.as_ptr().add((h + i) * k + p0)) }
                } else {
                    _mm512_setzero_ps()
                }
            });
            // SAFETY: AVX-512F (the contract).
            let cols = unsafe { transpose16(&r) };
            for (t, col) in cols.into_iter().enumerate() {
                let v = scale.map_or(col, |s| _mm512_mul_ps(col, _mm512_set1_ps(s)));
                // SAFETY: `(p0 + t) · NR + h + 16 <= whole · NR` (`h + 16
                // <= NR`), inside `out` (asserted above).
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add((p0 + t) * NR + h).cast(), v) };
            }
        }
    }
}

/// [`Avx512`]'s [`Kernel::micro_rows`] on `V` registers of columns (16
/// each).
///
/// # Safety
/// As [`Kernel::micro_rows`], for the first `16 V` columns.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn avx512_rows<const V: usize>(
    a: *const f32,
    rs: usize,
    b: *const f32,
    kdim: usize,
    c: *mut f32,
    ldc: usize,
    fresh: bool,
) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract: indices in bounds, AVX-512F present.
    unsafe {
        // Opaque to the optimiser, which would otherwise derive each
        // row's address from the first again at every step.
        let rows: [*const f32; MR] = std::hint::black_box(std::array::from_fn(|i| a.add(i * rs)));
        let mut acc: [[__m512; V]; MR] = std::array::from_fn(|i| {
            std::array::from_fn(|v| {
                if fresh {
                    _mm512_setzero_ps()
                } else {
                    _mm512_loadu_ps(c.add(i * ldc + 16 * v))
                }
            })
        });
        for p in 0..kdim {
            let bp = b.add(p * NR);
            let bv: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(bp.add(16 * v)));
            for (row, acc_i) in rows.iter().zip(acc.iter_mut()) {
                let x = _mm512_set1_ps(*row.add(p));
                for (acc_v, &b_v) in acc_i.iter_mut().zip(&bv) {
                    *acc_v = _mm512_fmadd_ps(x, b_v, *acc_v);
                }
            }
        }
        for (i, acc_i) in acc.iter().enumerate() {
            for (v, acc_v) in acc_i.iter().enumerate() {
                _mm512_storeu_ps(c.add(i * ldc + 16 * v), *acc_v);
            }
        }
    }
}

/// [`Kernel::micro_rows`] over slices, every index checked once up front:
/// the tile `c` is [`MR`] rows of [`NR`] floats from `c[0]`, `ldc` apart.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn micro_rows<K: Kernel>(
    a: &[f32],
    rs: usize,
    b: &[f32],
    kdim: usize,
    c: &mut [f32],
    ldc: usize,
    fresh: bool,
    half: bool,
) {
    if kdim == 0 {
        return;
    }
    assert!((MR - 1) * rs + kdim <= a.len(), "micro-kernel: a too short");
    assert!(kdim * NR <= b.len(), "micro-kernel: b too short");
    assert!(
        ldc >= NR && (MR - 1) * ldc + NR <= c.len(),
        "micro-kernel: c too short"
    );
    // SAFETY: the largest indices are checked above; `K` is only
    // instantiated inside functions compiled for its instruction set.
    unsafe {
        K::micro_rows(
            a.as_ptr(),
            rs,
            b.as_ptr(),
            kdim,
            c.as_mut_ptr(),
            ldc,
            fresh,
            half,
        )
    }
}

/// `fn $name(isa, args…)`: `$generic::<K>(args…)` compiled once per
/// instruction set — for AVX-512F with `K = $k512`, for AVX2+FMA with
/// [`Fma`], for the target's baseline with [`Plain`] — and run with the one
/// the token `isa` names (which [`crate::kernels::CpuFeatures`] hands out
/// only for instruction sets the CPU runs).
/// `$generic` is `#[inline(always)]`, so each copy is vectorised for its
/// instruction set.
macro_rules! per_isa {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)?
        = $generic:ident::<$k512:ty>) => {
        $(#[$doc])*
        $vis fn $name(isa: crate::kernels::features::Isa, $($a: $t),*) $(-> $r)? {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            fn avx512($($a: $t),*) $(-> $r)? {
                $generic::<$k512>($($a),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($a: $t),*) $(-> $r)? {
                $generic::<crate::kernels::micro::Avx2>($($a),*)
            }
            match isa.simd() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the token proves the CPU has AVX-512F.
                crate::kernels::features::Simd::Avx512 => unsafe { avx512($($a),*) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the token proves the CPU has AVX2 and FMA.
                crate::kernels::features::Simd::Avx2 => unsafe { avx2($($a),*) },
                _ => $generic::<crate::kernels::micro::Plain>($($a),*),
            }
        }
    };
    // The same with one type or const parameter, passed on after `K`.
    ($(#[$doc:meta])* $vis:vis fn $name:ident<$g:ident: $bound:path>($($a:ident: $t:ty),* $(,)?)
        $(-> $r:ty)? = $generic:ident::<$k512:ty>) => {
        crate::kernels::micro::per_isa!(@one [$g: $bound] $g $(#[$doc])* $vis fn $name($($a: $t),*)
            $(-> $r)? = $generic::<$k512>);
    };
    ($(#[$doc:meta])* $vis:vis fn $name:ident<const $g:ident: usize>($($a:ident: $t:ty),* $(,)?)
        $(-> $r:ty)? = $generic:ident::<$k512:ty>) => {
        crate::kernels::micro::per_isa!(@one [const $g: usize] $g $(#[$doc])* $vis fn $name($($a: $t),*)
            $(-> $r)? = $generic::<$k512>);
    };
    (@one [$($decl:tt)*] $g:ident $(#[$doc:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),*)
        $(-> $r:ty)? = $generic:ident::<$k512:ty>) => {
        $(#[$doc])*
        $vis fn $name<$($decl)*>(isa: crate::kernels::features::Isa, $($a: $t),*) $(-> $r)? {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            fn avx512<$($decl)*>($($a: $t),*) $(-> $r)? {
                $generic::<$k512, $g>($($a),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2<$($decl)*>($($a: $t),*) $(-> $r)? {
                $generic::<crate::kernels::micro::Avx2, $g>($($a),*)
            }
            match isa.simd() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as in the first form.
                crate::kernels::features::Simd::Avx512 => unsafe { avx512($($a),*) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as in the first form.
                crate::kernels::features::Simd::Avx2 => unsafe { avx2($($a),*) },
                _ => $generic::<crate::kernels::micro::Plain, $g>($($a),*),
            }
        }
    };
}
pub(crate) use per_isa;

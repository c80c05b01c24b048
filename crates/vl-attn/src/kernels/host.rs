//! What the kernels do on the host around their loops: hand a whole
//! forward pass to the rayon pool once ([`on_pool`]), read a tensor's
//! values in place ([`with_values`]), check a `CustomOp`'s input is
//! contiguous ([`contiguous`]).

use candle_core::{Layout, Tensor};

/// The part of a CPU buffer that a contiguous layout covers, or an error
/// naming the op and the argument: the input check of vl's `CustomOp`s
/// (this kernel, [`crate::kernels::gemv`], [`crate::kernels::gemm_bf16`]).
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

#[cfg(test)]
mod tests {
    use super::*;

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
}

//! What the kernels do on the host around their loops: hand a whole
//! forward pass to the rayon pool once ([`on_pool`]), read a tensor's
//! values in place ([`with_values`]), check a `CustomOp`'s input is
//! contiguous ([`contiguous`]).

use std::sync::atomic::{AtomicUsize, Ordering};

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

/// [`KeepAwake`] guards alive, in every thread: the spinners run while
/// it is above zero.
static AWAKE: AtomicUsize = AtomicUsize::new(0);

/// Spinners running (for the tests).
static SPINNING: AtomicUsize = AtomicUsize::new(0);

/// While it lives, the other workers of the pool it was made in wait for
/// work awake, looking for it, rather than asleep: hold one over a loop
/// of small parallel steps, such as a decode.
///
/// Between two parallel parts of a step (a product, then an attention),
/// the caller's worker runs the serial part alone; a rayon worker that
/// finds no work for a few tens of microseconds goes to sleep, and the
/// next part must wake it. On a virtual machine whose idle CPUs halt, that
/// wake-up can take milliseconds: profiles of `vl serve` decoding 16
/// requests (BENCHMARKS.md, 2026-12-03 sixth session) found the second
/// worker asleep for 15% of the time while the first ran a step's
/// products and attention alone. The spinners — one job per other
/// worker, started by the first guard and ended when the last is dropped
/// — run the pool's work as it appears ([`rayon::yield_now`]) and
/// otherwise yield the CPU to the operating system, so that another
/// thread (the caller's, when it is not a worker) is not kept from it.
/// OpenMP's runtimes and llama.cpp's thread pool spin the same way
/// between parallel regions.
///
/// The cost: the other workers use their cores while a guard lives, even
/// when there is nothing to do. Guards nest (the first one starts the
/// spinners, in the pool of the thread that made it: the global pool
/// outside every pool); they are cheap to make when one is alive.
#[must_use = "the workers stay awake only while the guard lives"]
pub struct KeepAwake {
    /// Whether this guard counts in [`AWAKE`] (not one for another device).
    counted: bool,
}

impl KeepAwake {
    /// [`KeepAwake::new`] for work on `device` when it is the CPU; for any
    /// other device a guard that does nothing (a GPU's decode leaves the
    /// pool idle: spinning workers would only keep its cores busy).
    pub fn for_device(device: &candle_core::Device) -> Self {
        if device.is_cpu() {
            Self::new()
        } else {
            Self { counted: false }
        }
    }

    /// Keeps the pool's other workers awake until the guard is dropped.
    pub fn new() -> Self {
        if AWAKE.fetch_add(1, Ordering::AcqRel) == 0 {
            let me = rayon::current_thread_index();
            rayon::spawn_broadcast(move |ctx| {
                if Some(ctx.index()) == me {
                    return;
                }
                SPINNING.fetch_add(1, Ordering::AcqRel);
                while AWAKE.load(Ordering::Acquire) > 0 {
                    if rayon::yield_now() != Some(rayon::Yield::Executed) {
                        std::thread::yield_now();
                    }
                }
                SPINNING.fetch_sub(1, Ordering::AcqRel);
            });
        }
        Self { counted: true }
    }
}

impl Default for KeepAwake {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        if self.counted {
            AWAKE.fetch_sub(1, Ordering::AcqRel);
        }
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

/// A vector of `n` values written by `f` in parallel, chunk by chunk:
/// `f(i, chunk)` gets chunk `i` (`chunk` values, fewer at the end), zeroed
/// by its own task just before (while it is in cache) — rather than the
/// whole buffer zeroed by one thread up front, as `vec![0; n]` does once
/// the allocator reuses memory (a quarter of the time a Florence-2 encode
/// ran on one core was such zeroing, the kernels' allocations among it).
pub(crate) fn par_filled<T: Copy + Default + Send + Sync>(
    n: usize,
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) -> Vec<T> {
    use rayon::prelude::*;
    let mut v: Vec<T> = Vec::with_capacity(n);
    v.spare_capacity_mut()[..n]
        .par_chunks_mut(chunk.max(1))
        .enumerate()
        .for_each(|(i, c)| f(i, zeroed(c)));
    // SAFETY: the chunks cover `0..n`, each initialised by its task (a
    // task's panic would have propagated before this point).
    unsafe { v.set_len(n) };
    v
}

/// `c` (spare capacity of a vector) set to `T::default()`, as the
/// initialised slice: how a task of [`par_filled`] and its kin zero their
/// own part of a new buffer.
pub(crate) fn zeroed<T: Copy + Default>(c: &mut [std::mem::MaybeUninit<T>]) -> &mut [T] {
    for x in c.iter_mut() {
        x.write(T::default());
    }
    // SAFETY: every element of `c` was initialised just above, and
    // `MaybeUninit<T>` has `T`'s layout.
    unsafe { &mut *(c as *mut [std::mem::MaybeUninit<T>] as *mut [T]) }
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

    /// While a guard lives, the pool's other workers spin (all of them
    /// for a guard made outside the pool), nested guards start no more,
    /// work given meanwhile runs, and the spinners end once the last
    /// guard is dropped. (The only test here to make guards: their count
    /// is the process's.)
    #[test]
    fn keep_awake_spins_the_other_workers_until_dropped() {
        use rayon::prelude::*;
        use std::time::{Duration, Instant};
        let until = |what: &str, want: usize| {
            let t = Instant::now();
            while SPINNING.load(Ordering::Acquire) != want {
                let n = SPINNING.load(Ordering::Acquire);
                assert!(
                    t.elapsed() < Duration::from_secs(20),
                    "{what}: {n} spinners, want {want}"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        let work = || (0..100_000u64).into_par_iter().map(|x| x * x).sum::<u64>();
        let want = (0..100_000u64).map(|x| x * x).sum::<u64>();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("pool");
        pool.install(|| {
            let outer = KeepAwake::new();
            until("a guard on a worker of 3", 2);
            let inner = KeepAwake::new();
            assert_eq!(work(), want);
            drop(inner);
            assert_eq!(SPINNING.load(Ordering::Acquire), 2, "an inner guard's drop");
            assert_eq!(work(), want);
            drop(outer);
        });
        until("every guard dropped", 0);
        // Outside every pool: the global pool's workers, all of them.
        let guard = KeepAwake::for_device(&candle_core::Device::Cpu);
        until("a guard outside the pools", rayon::current_num_threads());
        assert_eq!(on_pool(work), want);
        drop(guard);
        until("the guard dropped", 0);
    }

    /// `par_filled` hands each task its chunk zeroed, in order, the last
    /// one short, and returns every value the tasks wrote.
    #[test]
    fn par_filled_writes_every_chunk() {
        for (n, chunk) in [(0, 4), (1, 4), (10, 4), (12, 4), (1000, 7)] {
            let v: Vec<u32> = par_filled(n, chunk, |i, c| {
                assert!(c.iter().all(|&x| x == 0) && !c.is_empty() && c.len() <= chunk);
                for (j, x) in c.iter_mut().enumerate() {
                    *x = (i * chunk + j) as u32 + 1;
                }
            });
            assert_eq!(
                v,
                (1..=n as u32).collect::<Vec<_>>(),
                "{n} in chunks of {chunk}"
            );
        }
    }
}

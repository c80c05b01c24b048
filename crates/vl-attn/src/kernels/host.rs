//! What the kernels do on the host around their loops: hand a whole
//! forward pass to the rayon pool once ([`on_pool`]), keep the pool's
//! workers awake through a loop of decode steps ([`KeepAwake`]), read a
//! tensor's values in place ([`with_values`]), check a `CustomOp`'s input
//! is contiguous ([`contiguous`]), fill new buffers in parallel
//! ([`par_filled`]), cut a parallel loop into leaves the other workers can
//! take from ([`leaf_len`]), keep glibc's freed memory for the next
//! product's outputs ([`keep_freed_memory`]).

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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

/// The longest a spinner runs before it returns (and queues its next
/// turn): a spinner that a busy worker picked up while waiting inside
/// other work holds that work back at most this long.
const SPIN_TURN: Duration = Duration::from_millis(1);

thread_local! {
    /// Whether this worker is running a spinner (a spinner it picks up
    /// inside one returns at once).
    static SPINNING_HERE: Cell<bool> = const { Cell::new(false) };
    /// Guards alive that this thread made: a worker running a guard's own
    /// work never spins (a spinner it picks up while it waits inside that
    /// work is handed on).
    static GUARDS_HERE: Cell<usize> = const { Cell::new(0) };
}

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
/// worker, started by the first guard — run the pool's work as it
/// appears ([`rayon::yield_now`]) and otherwise yield the CPU to the
/// operating system, so that another thread (the caller's, when it is not
/// a worker) is not kept from it. OpenMP's runtimes and llama.cpp's thread
/// pool spin the same way between parallel regions.
///
/// A spinner runs in turns of at most a millisecond, each queueing the
/// next ones while a guard lives (one per worker: on `n` workers, `n`
/// small jobs a turn), and never on a worker that made a guard still
/// alive: a worker that picks one up while it waits inside other
/// work (a stolen part of a product, say) resumes that work within a
/// turn, and one running a guard's own work (several decodes on the
/// workers at once) declines it — a spinner that waited for every guard
/// to drop there would wait for its own worker's.
///
/// The cost: the other workers use their cores while a guard lives, even
/// when there is nothing to do. Guards nest (the first one starts the
/// spinners, in the pool of the thread that made it: the global pool
/// outside every pool); they are cheap to make when one is alive.
///
/// A guard stays on the thread that made it (it is not `Send`).
#[must_use = "the workers stay awake only while the guard lives"]
pub struct KeepAwake {
    /// Whether this guard counts in [`AWAKE`] (not one for another device).
    counted: bool,
    /// Not `Send`: [`GUARDS_HERE`] is its thread's.
    _here: std::marker::PhantomData<*const ()>,
}

impl KeepAwake {
    /// [`KeepAwake::new`] for work on `device` when it is the CPU; for any
    /// other device a guard that does nothing (a GPU's decode leaves the
    /// pool idle: spinning workers would only keep its cores busy).
    pub fn for_device(device: &candle_core::Device) -> Self {
        if device.is_cpu() {
            Self::new()
        } else {
            Self {
                counted: false,
                _here: std::marker::PhantomData,
            }
        }
    }

    /// Keeps the pool's other workers awake until the guard is dropped.
    pub fn new() -> Self {
        GUARDS_HERE.with(|g| g.set(g.get() + 1));
        if AWAKE.fetch_add(1, Ordering::AcqRel) == 0 {
            rayon::spawn_broadcast(|_| turn());
        }
        Self {
            counted: true,
            _here: std::marker::PhantomData,
        }
    }
}

/// One turn of a spinner on this worker (none if one runs here already,
/// or the worker made a guard still alive): the pool's work as it
/// appears, for at most [`SPIN_TURN`] while a guard lives; then the next
/// turns are queued, one for every worker of the pool (each worker's own
/// queue, which no other takes from: those spinning or running a guard's
/// work decline theirs, and a worker whose spinner ended for whatever
/// reason gets one back).
fn turn() {
    if GUARDS_HERE.with(Cell::get) > 0 || SPINNING_HERE.with(|s| s.replace(true)) {
        return;
    }
    SPINNING.fetch_add(1, Ordering::AcqRel);
    let start = Instant::now();
    while AWAKE.load(Ordering::Acquire) > 0 && start.elapsed() < SPIN_TURN {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            std::thread::yield_now();
        }
    }
    SPINNING.fetch_sub(1, Ordering::AcqRel);
    SPINNING_HERE.with(|s| s.set(false));
    if AWAKE.load(Ordering::Acquire) > 0 {
        rayon::spawn_broadcast(|_| turn());
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
            GUARDS_HERE.with(|g| g.set(g.get() - 1));
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

/// Leaves per worker that [`leaf_len`] allows a parallel loop at least.
const LEAVES_PER_THREAD: usize = 16;

/// The most items of a parallel loop over `len` items that one rayon leaf
/// runs in a row — `len / (16 × workers)`, at least one — for `with_max_len`
/// on a loop whose tasks were sized for balance (a product's tile columns,
/// attention's rows).
///
/// Rayon's adaptive splitter halves a loop only as deep as the pool has
/// workers unless a part is stolen: on two workers, the one that starts a
/// loop runs its first quarter as one piece that the other cannot take
/// from, and the loop ends when the slower of the two ends its last
/// piece. A 16-request decode step of `vl serve` runs ~100 such loops
/// (its profile: one worker spinning for 8–16% of the step, mostly while
/// the other finished an attention's or a product's last piece). With
/// leaves of at most this many items, the step took 2–5% less time in 9
/// of 11 interleaved rounds and a Florence-2 encode 0.5–3% less in 9 of 11
/// (BENCHMARKS.md, Zen 4, twelfth session).
pub(crate) fn leaf_len(len: usize) -> usize {
    len.div_ceil(LEAVES_PER_THREAD * rayon::current_num_threads().max(1))
        .max(1)
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

/// Has glibc's allocator keep freed memory for reuse instead of handing it
/// back to the kernel. Call it first thing, before any thread starts (the
/// `vl` command does, and the Python package when it is imported); then,
/// once a model is loaded, [`return_freed_memory`].
///
/// Inference allocates and frees its activations layer after layer, many
/// of them larger than the 32 MB up to which glibc can serve a block from
/// its heap: with glibc's defaults each of those was a fresh mapping whose
/// every page faulted in again, zeroed by the kernel. So: every block from
/// the heap (no mappings at all), one heap for every thread (another
/// thread's heap holds at most 64 MB, past which glibc maps even with
/// mappings off — and a thread keeps the heap it first allocated from,
/// hence "before any thread starts"), no trimming of the heap's top, and
/// 64 MB of top padding. Donut-base's Swin encode of a 1280×960 page
/// (stage 1's tensors are 39–157 MB) faulted ≈ 1 M pages (≈ 4 GB) per
/// encode with only the last two settings, set after the load, and took
/// 2.41–2.56 s in bf16 weights and 5.6 s in f32, against 1.95–2.02 s and
/// 3.86 s now (BENCHMARKS.md); peak RSS 1.93 → 1.78 GB. Earlier, with the
/// last two alone: a BLIP-base caption of 8 images at batch 8 in bf16 went
/// from 2.34–2.43 to 2.19 s at the same peak.
///
/// The cost: memory kept can be fragmented, so a batch run's peak can grow
/// (`vl bench` of vit-gpt2 in f32, batch 8 included: 1122 → 1241 MB), and
/// what a loader frees stays with the process until
/// [`return_freed_memory`]. Elsewhere than Linux with glibc, a no-op.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets the allocator's parameters (it takes the
    // allocator's lock).
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

/// Hands the heap's free memory back to the kernel now (glibc's
/// `malloc_trim`): after a model's load under [`keep_freed_memory`], what
/// the loader freed (an f32 checkpoint's tensors before their
/// quantization, say) would otherwise stay resident. What inference frees
/// later is kept as [`keep_freed_memory`] says; the first batch faults in
/// what it needs once. Elsewhere than Linux with glibc, a no-op.
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only releases free memory (it takes the
    // allocator's locks).
    unsafe {
        libc::malloc_trim(0);
    }
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
        // Outside every pool: the global pool's workers, all of them.
        // (First: a pool dropped below may still hold a spinner's queued
        // turn, which a later guard anywhere would set spinning.)
        let guard = KeepAwake::for_device(&candle_core::Device::Cpu);
        until("a guard outside the pools", rayon::current_num_threads());
        assert_eq!(on_pool(work), want);
        drop(guard);
        until("the guard dropped", 0);
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
            until("after an inner guard's drop", 2);
            assert_eq!(work(), want);
            drop(outer);
        });
        until("every guard dropped", 0);
        // Guards on several workers at once (decodes inside a parallel
        // loop), each over parallel work: all of it ends.
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            pool.install(|| {
                (0..12).into_par_iter().for_each(|_| {
                    let _guard = KeepAwake::new();
                    assert_eq!(work(), want);
                })
            });
            let _ = done.send(());
        });
        finished
            .recv_timeout(Duration::from_secs(60))
            .expect("guards made on several workers at once: their work ended");
        until("the workers' guards dropped", 0);
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

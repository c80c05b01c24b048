//! `vl::keep_freed_memory` and `vl::return_freed_memory` on glibc: a freed
//! block larger than glibc's 32 MB mapping ceiling is reused without its
//! pages faulting in again, from the main thread and from a thread started
//! afterwards; `return_freed_memory` hands it back (its pages fault in on
//! the next use). Its own binary without the test harness (`harness =
//! false`): the settings must be in force before any other thread
//! allocates, as the `vl` command and the Python package set them.

/// 96 MB: three times glibc's mapping ceiling.
const BLOCK: usize = 96 << 20;
const PAGE: usize = 4096;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn minor_faults() -> i64 {
    // SAFETY: `getrusage` writes the struct it is given.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_SELF, &mut usage), 0);
        usage.ru_minflt
    }
}

/// The minor page faults of allocating a `BLOCK`, writing every page and
/// freeing it.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn faults_of_one_block() -> i64 {
    let before = minor_faults();
    let mut block: Vec<u8> = Vec::with_capacity(BLOCK);
    // Every page written (through the spare capacity: no zeroing pass of
    // our own to hide the allocator's), then the block freed.
    let spare = block.spare_capacity_mut();
    for page in spare.chunks_mut(PAGE) {
        page[0].write(1);
    }
    std::hint::black_box(&block);
    block.clear();
    drop(block);
    minor_faults() - before
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn main() {
    vl::keep_freed_memory();
    let pages = (BLOCK / PAGE) as i64;
    // The first use faults its pages in; a reuse must not (a few hundred
    // faults of bookkeeping allowed: 2% of the block's 24,576 pages).
    let reuse_bound = pages / 50;
    let first = faults_of_one_block();
    assert!(
        first > pages / 2,
        "the first block faulted only {first} pages of {pages}"
    );
    let again = faults_of_one_block();
    assert!(
        again < reuse_bound,
        "a freed {BLOCK}-byte block faulted {again} pages again on the main thread (bound {reuse_bound})"
    );
    // A thread started after the settings allocates from the same heap.
    let in_thread = std::thread::spawn(|| (faults_of_one_block(), faults_of_one_block()))
        .join()
        .expect("the thread");
    assert!(
        in_thread.1 < reuse_bound,
        "a freed block faulted {} pages again on another thread (bound {reuse_bound}; its first use: {})",
        in_thread.1,
        in_thread.0
    );
    // Handed back: the next use faults its pages in again.
    vl::return_freed_memory();
    let after_return = faults_of_one_block();
    assert!(
        after_return > pages / 2,
        "after return_freed_memory a block faulted only {after_return} pages of {pages}"
    );
    println!(
        "freed_memory: ok (faults per {pages}-page block: first {first}, reused {again}, \
         in a new thread {} then {}, after return_freed_memory {after_return})",
        in_thread.0, in_thread.1
    );
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn main() {
    // Both functions are no-ops off glibc: nothing to check.
    vl::keep_freed_memory();
    vl::return_freed_memory();
    println!("freed_memory: not glibc, skipped");
}

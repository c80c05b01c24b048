//! Beams share their image's keys and values without copies, measured: a
//! counting allocator records the peak bytes allocated while 6 beams (3
//! per image) attend to a 2-image memory, which must stay far below the
//! size of one copy of the keys per beam. Outputs alone cannot tell a
//! shared memory from a copied one; allocation can.
//!
//! One test in its own binary: the allocator counts every thread.
#![allow(missing_docs)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use common::frozen;
use vl_attn::{Backend, CrossAttention, CrossAttentionConfig, Weights};

/// The system allocator, counting live bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to `System` with the caller's layout; the
// counters are only arithmetic beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Peak bytes allocated beyond what was live before `f` ran.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let out = f();
    (out, PEAK.load(Ordering::Relaxed).saturating_sub(before))
}

#[test]
fn beams_attend_without_copying_the_memory() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    // Width 64, 4 heads; 2 images of 4096 tokens; 3 beams each, one
    // new token per beam (a decode step).
    let (images, beams, mem_len, d) = (2, 3, 4096, 64);
    let vars = VarMap::new();
    // Initialised weights in `vars`, then detached: plain tensors, so the
    // fused kernel may run.
    CrossAttention::load(
        VarBuilder::from_varmap(&vars, DType::F32, &dev),
        &CrossAttentionConfig::new(d, d, 4),
    )?;
    let attn = CrossAttention::load(
        frozen(&vars, DType::F32),
        &CrossAttentionConfig::new(d, d, 4),
    )?;
    let memory = Tensor::randn(0f32, 1., (images, mem_len, d), &dev)?;
    let kv = attn.project_memory(&memory)?;
    // One copy of the keys for every beam: what sharing must avoid.
    let one_copy = images * beams * mem_len * d * 4;
    let queries = Tensor::randn(0f32, 1., (images * beams, 1, d), &dev)?;
    for backend in [Backend::Auto, Backend::Fused, Backend::Reference] {
        let a = attn.clone().with_backend(backend);
        let (out, peak) = peak_during(|| a.attend(&queries, &kv, None, Weights::Skip));
        assert_eq!(out?.output.dims(), &[images * beams, 1, d]);
        // Measured: Auto and Fused under 1.6 MB; Reference 2.2 MB, as it
        // lays the keys out for its matrix product once per call (2 MB,
        // once per image, not per beam) beside (6, 4, 1, 4096) f32 scores.
        // A copy of the keys per beam alone is 6.3 MB.
        assert!(
            peak < one_copy / 2,
            "{backend:?}: {peak} bytes allocated while attending; one copy of the \
             keys per beam is {one_copy}"
        );
    }
    // The check can fail: materialising the keys per beam is caught.
    let (_, peak) = peak_during(|| {
        let idx = Tensor::new(&[0u32, 0, 0, 1, 1, 1], &dev)?;
        kv.k().index_select(&idx, 0)?.contiguous()
    });
    assert!(peak >= one_copy / 2, "{peak}");
    Ok(())
}

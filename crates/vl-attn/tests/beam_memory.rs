//! Beams share their image's keys and values without copies, measured: a
//! counting allocator records the peak bytes allocated while the beams of
//! a 2-image memory attend to it, once with 1 beam per image and once with
//! 4. A copy of the keys per beam would add at least one image's keys
//! (`mem_len × d` floats) per added beam; sharing adds only what grows
//! with the queries (per head one row of scores, `mem_len` floats, a
//! sixty-fourth of the keys here). The test bounds that marginal cost,
//! not the absolute peak: the absolute peak also holds what a path lays
//! out once per image or per call (the reference path's key layout for
//! its matrix product), which depends on the allocator, the profile and
//! the CPU's instruction set, not on sharing.
//!
//! Outputs alone cannot tell a shared memory from a copied one;
//! allocation can. One test in its own binary: the allocator counts every
//! thread.
#![allow(missing_docs)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use common::frozen;
use vl_attn::{Backend, CrossAttention, CrossAttentionConfig, CrossKv, Weights};

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

/// Peak bytes allocated while `images × beams` queries attend to `kv`.
fn attend_peak(
    attn: &CrossAttention,
    kv: &CrossKv,
    images: usize,
    beams: usize,
    d: usize,
) -> anyhow::Result<usize> {
    let queries = Tensor::randn(0f32, 1., (images * beams, 1, d), &Device::Cpu)?;
    let (out, peak) = peak_during(|| attn.attend(&queries, kv, None, Weights::Skip));
    assert_eq!(out?.output.dims(), &[images * beams, 1, d]);
    Ok(peak)
}

#[test]
fn beams_attend_without_copying_the_memory() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    // Width 256, 4 heads; 2 images of 4096 tokens; a decode step (one new
    // token per beam) with 1 and with 4 beams per image.
    let (images, mem_len, d, heads) = (2, 4096, 256, 4);
    let (few, many) = (1, 4);
    let config = CrossAttentionConfig::new(d, d, heads);
    let vars = VarMap::new();
    // Initialised weights in `vars`, then detached: plain tensors, so the
    // fused kernel may run.
    CrossAttention::load(VarBuilder::from_varmap(&vars, DType::F32, &dev), &config)?;
    let attn = CrossAttention::load(frozen(&vars, DType::F32), &config)?;
    let memory = Tensor::randn(0f32, 1., (images, mem_len, d), &dev)?;
    let kv = attn.project_memory(&memory)?;
    // What one added beam would cost if it copied its image's keys (the
    // values would add as much again).
    let key_copy = mem_len * d * 4;
    // What it may cost when sharing: a quarter of that, room for 16 rows
    // of scores per head (each `mem_len` f32) where a few are needed.
    let bound = key_copy / 4;
    let added_beams = images * (many - few);
    for backend in [Backend::Auto, Backend::Fused, Backend::Reference] {
        let a = attn.clone().with_backend(backend);
        // Once to warm up whatever a first call sets up (thread pool,
        // lazily built tables), then the two measured calls.
        attend_peak(&a, &kv, images, many, d)?;
        let base = attend_peak(&a, &kv, images, few, d)?;
        let peak = attend_peak(&a, &kv, images, many, d)?;
        let per_beam = peak.saturating_sub(base) / added_beams;
        // Measured on a Zen 5 (AVX-512), debug and release alike: 9.6 KB
        // per added beam for Auto and Fused, 219 KB for Reference (its
        // scores and probabilities, 64 KB a row of heads), against a
        // bound of 1 MB and a copy's 4 MB.
        assert!(
            per_beam < bound,
            "{backend:?}: each added beam allocated {per_beam} bytes while attending \
             ({base} bytes with {few} beam per image, {peak} with {many}); a copy of \
             its image's keys is {key_copy}, the bound {bound}"
        );
    }
    // The check can fail: materialising the keys per beam is caught.
    let copying = |beams: usize| {
        let idx: Vec<u32> = (0..images as u32)
            .flat_map(|i| std::iter::repeat_n(i, beams))
            .collect();
        let idx = Tensor::new(idx.as_slice(), &dev)?;
        kv.k().index_select(&idx, 0)?.contiguous()
    };
    let (_, base) = peak_during(|| copying(few));
    let (_, peak) = peak_during(|| copying(many));
    let per_beam = peak.saturating_sub(base) / added_beams;
    assert!(per_beam >= bound, "{per_beam}");
    Ok(())
}

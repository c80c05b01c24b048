//! The products of many rows alone, on a ViT-B/16's shapes (197 rows or a
//! batch of them; the q/k/v, output, and the two feed-forward products):
//! candle's f32 product, vl's f32 one (the weight where it lies, and
//! packed: `PackedF32`), vl's packed bf16 weights on every
//! bf16 implementation the CPU runs and its q8_0 weights on every q8_0
//! one (AMX where it has it; `x` rounded per call, as in a model), each
//! the least and the median of `--repeats` runs after a warm-up.
//!
//! ```bash
//! cargo run --release -p vl-attn --example bench_gemm -- --rows 197 --repeats 30
//! ```
//!
//! `--only TEXT` times only the kernels whose name contains it (`--only
//! Amx`: the tile unit's; to profile one kernel alone). `--davit` times
//! Florence-2 base's DaViT shapes instead (one 768² image: per stage its
//! tokens and the q/k/v, output and feed-forward products; `--rows` is
//! ignored); `--shape M,N,K` times one product of `M` rows by a weight
//! `(N, K)`. `--ffn` times vl's f32 feed-forward instead (`gemm_f32::ffn`,
//! a chunk of rows at a time, against its three steps apart: the product
//! plus bias, vl's GELU, the product plus bias) on a ViT-B's, Florence-2's
//! BART encoder's and its DaViT stages' shapes.
//!
//! `--cold` reads every weight cold, as a model's encode does (its
//! weights, 344 MB for a ViT-B in f32, pass the L3): each call takes the
//! next of enough copies of the weight to fill 512 MB, so that none is
//! left in a cache by the call before (vl's f32 products and `--ffn`).
//!
//! Two threads unless `RAYON_NUM_THREADS` says otherwise (as `vl bench
//! --threads 2`). GFLOP/s is `2 m n k` per product.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use vl_attn::kernels::gemm_bf16::PackedBf16;
use vl_attn::kernels::gemv_q8::PackedQ8;
use vl_attn::kernels::{gemm_f32, on_pool, CpuFeatures};

/// The value after `name` on the command line.
fn value(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1).cloned()
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}: expected a count, got {v:?}"))
        })
        .unwrap_or(default)
}

/// (least, median) ms of `f` over `repeats` runs after one warm-up.
fn time(repeats: usize, mut f: impl FnMut() -> candle_core::Result<Tensor>) -> (f64, f64) {
    f().expect("warm-up");
    let mut ms: Vec<f64> = (0..repeats)
        .map(|_| {
            let t = Instant::now();
            f().expect("product");
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    (ms[0], ms[ms.len() / 2])
}

fn main() -> candle_core::Result<()> {
    // As the `vl` command: every block from one heap that is kept, so that
    // an output of more than 32 MB (a DaViT's first stages) is not a fresh
    // mapping faulted in page by page on every call — that, not the
    // product, is what such shapes measured.
    vl_attn::kernels::keep_freed_memory();
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build_global()
            .expect("the global pool");
    }
    let rows = arg("--rows", 197);
    let only = value("--only").unwrap_or_default();
    let repeats = arg("--repeats", 20).max(1);
    let cold = std::env::args().any(|a| a == "--cold");
    let cpu = CpuFeatures::get();
    println!("{cpu}");
    println!(
        "threads {}, least / median of {repeats} runs",
        rayon::current_num_threads()
    );
    let dev = Device::Cpu;
    if std::env::args().any(|a| a == "--ffn") {
        return feed_forward(&dev, repeats, cold);
    }
    let davit = std::env::args().any(|a| a == "--davit");
    let shape = value("--shape").map(|s| {
        let d: Vec<usize> = s
            .split(',')
            .map(|v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("--shape: expected M,N,K, got {s:?}"))
            })
            .collect();
        assert!(d.len() == 3, "--shape: expected M,N,K, got {s:?}");
        (d[0], d[1], d[2])
    });
    let shapes: Vec<(usize, usize, usize)> = if let Some(one) = shape {
        vec![one]
    } else if davit {
        [(36864, 128), (9216, 256), (2304, 512), (576, 1024)]
            .into_iter()
            .flat_map(|(m, c)| [(m, 3 * c, c), (m, c, c), (m, 4 * c, c), (m, c, 4 * c)])
            .collect()
    } else {
        [(2304, 768), (768, 768), (3072, 768), (768, 3072)]
            .into_iter()
            .map(|(n, k)| (rows, n, k))
            .collect()
    };
    for (rows, n, k) in shapes {
        let x = Tensor::randn(0f32, 1., (rows, k), &dev)?;
        let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
        let flops = 2.0 * (rows * n * k) as f64;
        let timed = |name: &str| name.contains(&only);
        let report = |name: &str, (least, median): (f64, f64)| {
            println!(
                "({rows}, {k}) x ({n}, {k})ᵀ {name:<22} {least:8.3} ms {median:8.3} ms  {:7.1} GFLOP/s",
                flops / least / 1e6
            )
        };
        let wt = w.t()?;
        if timed("candle f32") {
            report("candle f32", time(repeats, || on_pool(|| x.matmul(&wt))));
        }
        if timed("vl f32") {
            let ws = copies(&w, cold)?;
            let mut next = 0;
            report(
                if cold { "vl f32 (cold)" } else { "vl f32" },
                time(repeats, || {
                    next += 1;
                    on_pool(|| gemm_f32::matmul(&x, &ws[next % ws.len()]))
                }),
            );
        }
        if timed("vl f32 packed") {
            let ps = copies(&w, cold)?
                .iter()
                .map(|w| gemm_f32::PackedF32::pack(w, None).map(Arc::new))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let mut next = 0;
            report(
                if cold {
                    "vl f32 packed (cold)"
                } else {
                    "vl f32 packed"
                },
                time(repeats, || {
                    next += 1;
                    on_pool(|| ps[next % ps.len()].matmul(&x))
                }),
            );
        }
        let packed = Arc::new(PackedBf16::pack(&w.to_dtype(DType::BF16)?, None)?);
        for isa in cpu.bf16_isas() {
            let name = format!("vl bf16 weights {:?}", isa.simd());
            if !timed(&name) {
                continue;
            }
            report(
                &name,
                time(repeats, || on_pool(|| packed.matmul_with(isa, &x))),
            );
        }
        let q8 = PackedQ8::quantize(&w)?;
        for isa in cpu.q8_isas() {
            let name = format!("vl q8_0 {:?}", isa.simd());
            if !timed(&name) {
                continue;
            }
            report(&name, time(repeats, || on_pool(|| q8.matmul_with(isa, &x))));
        }
    }
    Ok(())
}

/// `w` itself, or with `cold` as many copies of it as fill 512 MB (more
/// than an L3), to be taken in turn.
fn copies(w: &Tensor, cold: bool) -> candle_core::Result<Vec<Tensor>> {
    if !cold {
        return Ok(vec![w.clone()]);
    }
    let bytes = w.elem_count() * w.dtype().size_in_bytes();
    (0..(512usize << 20).div_ceil(bytes))
        .map(|_| w.copy())
        .collect()
}

/// `--ffn`: the f32 feed-forward in chunks against its steps apart, `(m,
/// k)` through `h`, GFLOP/s as `4 m k h`; with `cold`, weights taken in
/// turn from copies that pass the L3.
fn feed_forward(dev: &Device, repeats: usize, cold: bool) -> candle_core::Result<()> {
    let isa = CpuFeatures::get().isa();
    for (m, k, h) in [
        (16, 768, 3072),
        (197, 768, 3072),
        (600, 768, 3072),
        (1576, 768, 3072),
        (36864, 128, 512),
        (9216, 256, 1024),
        (2304, 512, 2048),
        (576, 1024, 4096),
    ] {
        let x = Tensor::randn(0f32, 1., (m, k), dev)?;
        let ups = copies(&Tensor::randn(0f32, 0.05, (h, k), dev)?, cold)?;
        let downs = copies(&Tensor::randn(0f32, 0.05, (k, h), dev)?, cold)?;
        let mut next = 0;
        let (ub, db) = (
            Tensor::randn(0f32, 1., h, dev)?,
            Tensor::randn(0f32, 1., k, dev)?,
        );
        let flops = 4.0 * (m * k * h) as f64;
        let apart = time(repeats, || {
            next += 1;
            let (up, down) = (&ups[next % ups.len()], &downs[next % downs.len()]);
            on_pool(|| {
                let hidden = gemm_f32::matmul_bias_with(isa, &x, up, Some(&ub))?;
                let hidden = vl_attn::Activation::Gelu.forward(&hidden)?;
                gemm_f32::matmul_bias_with(isa, &hidden, down, Some(&db))
            })
        });
        let chunked = time(repeats, || {
            next += 1;
            let (up, down) = (&ups[next % ups.len()], &downs[next % downs.len()]);
            on_pool(|| gemm_f32::ffn(isa, &x, (up, Some(&ub)), (down, Some(&db)), true))
        });
        for (name, (least, median)) in [("apart", apart), ("in chunks", chunked)] {
            println!(
                "({m}, {k}) through {h}: {name:<10}{} {least:8.3} ms {median:8.3} ms  {:7.1} GFLOP/s",
                if cold { " (cold)" } else { "" },
                flops / least / 1e6
            );
        }
    }
    Ok(())
}

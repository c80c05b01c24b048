//! Times vl's attention kernel and measures the memory of cross-attention
//! over many image tokens; prints one JSON line.
//!
//! `cargo run --release --example bench_attention -- --q-len 64 --k-len 576`
//!
//! With `--module`, the whole `CrossAttention` (projections included) runs
//! on `(1, q_len, 768)` text over `(1, k_len, 768)` image tokens, and the
//! peak resident memory is reported: at `--q-len 1024 --k-len 16384` a
//! materialised `(1, 12, 1024, 16384)` f32 score tensor alone would be
//! 805 MB. `scripts/bench_vs_torch.py` runs this next to PyTorch's
//! `scaled_dot_product_attention`.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::Linear;
use clap::Parser;
use vl::vl_attn::attention::{attention, Backend, Weights};
use vl::vl_attn::{CrossAttention, CrossAttentionConfig};

/// Time the attention kernel.
#[derive(Parser, Debug)]
#[command(about)]
struct Args {
    /// Queries (text tokens).
    #[arg(long, default_value_t = 64)]
    q_len: usize,
    /// Keys (image tokens).
    #[arg(long, default_value_t = 576)]
    k_len: usize,
    /// Model width.
    #[arg(long, default_value_t = 768)]
    width: usize,
    /// Heads.
    #[arg(long, default_value_t = 12)]
    heads: usize,
    /// fused, reference or auto.
    #[arg(long, default_value = "fused")]
    backend: String,
    /// Run the CrossAttention module (with projections) instead of the kernel.
    #[arg(long)]
    module: bool,
    /// Timed repetitions (median reported), after one warm-up.
    #[arg(long, default_value_t = 20)]
    repeats: usize,
}

fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let backend = match args.backend.as_str() {
        "fused" => Backend::Fused,
        "reference" => Backend::Reference,
        "auto" => Backend::Auto,
        other => anyhow::bail!("--backend {other}: expected fused, reference or auto"),
    };
    let dev = Device::Cpu;
    let hd = args.width / args.heads;
    let rss_before = peak_rss_mb();
    let mut run: Box<dyn FnMut() -> anyhow::Result<()>> = if args.module {
        // Plain tensors, not `Var`s: variables track gradients, which sends
        // attention to the differentiable (materialising) reference path.
        let d = args.width;
        let lin = || -> anyhow::Result<Linear> {
            let w = (Tensor::randn(0f32, 1.0, (d, d), &dev)? / (d as f64).sqrt())?;
            Ok(Linear::new(w, Some(Tensor::zeros(d, DType::F32, &dev)?)))
        };
        let cfg = CrossAttentionConfig::new(d, d, args.heads);
        let attn =
            CrossAttention::from_parts(lin()?, lin()?, lin()?, lin()?, &cfg)?.with_backend(backend);
        let x = Tensor::randn(0f32, 1.0, (1, args.q_len, args.width), &dev)?;
        let m = Tensor::randn(0f32, 1.0, (1, args.k_len, args.width), &dev)?;
        Box::new(move || {
            std::hint::black_box(attn.forward(&x, &m, None)?);
            Ok(())
        })
    } else {
        let q = Tensor::randn(0f32, 1.0, (1, args.heads, args.q_len, hd), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (1, args.heads, args.k_len, hd), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (1, args.heads, args.k_len, hd), &dev)?;
        let scale = 1.0 / (hd as f64).sqrt();
        Box::new(move || {
            std::hint::black_box(
                attention(&q, &k, &v, None, scale, backend, Weights::Skip)?.output,
            );
            Ok(())
        })
    };
    run()?;
    let mut times: Vec<f64> = (0..args.repeats.max(1))
        .map(|_| {
            let t = Instant::now();
            run().map(|()| t.elapsed().as_secs_f64() * 1e3)
        })
        .collect::<anyhow::Result<_>>()?;
    times.sort_by(f64::total_cmp);
    let score_mb = (args.heads * args.q_len * args.k_len * 4) as f64 / (1024.0 * 1024.0);
    let json = serde_json::json!({
        "q_len": args.q_len,
        "k_len": args.k_len,
        "width": args.width,
        "heads": args.heads,
        "backend": args.backend,
        "module": args.module,
        "ms": times[times.len() / 2],
        "score_tensor_mb": score_mb,
        "peak_rss_mb": peak_rss_mb(),
        "rss_before_mb": rss_before,
    });
    println!("{json}");
    Ok(())
}

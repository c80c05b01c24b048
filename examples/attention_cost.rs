//! What cross-attention costs next to self-attention, and what the image
//! cache and visual-token compression buy: width 768, 12 heads, a text of
//! Nt = 64 tokens, an image of Nv = 576 tokens (a 24 × 24 grid), and 32
//! resampled queries.
//!
//! `cargo run --release --example attention_cost [-- --repeats 20]`
//!
//! Each row gives the multiply-adds of the call counted as 2 FLOPs (the
//! four projections and the two attention products; softmax and masking
//! are left out), the bytes of one f32 score matrix over all heads, and the
//! measured median time. Modules run on plain tensors (no gradient
//! tracking), so the fused CPU kernel serves them.

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;
use vl::vl_attn::{
    CausalSelfAttention, CrossAttention, CrossAttentionConfig, QueryPool, SelfAttentionConfig,
    Weights,
};

/// The width of every stream.
const WIDTH: usize = 768;
/// Attention heads.
const HEADS: usize = 12;
/// Text tokens.
const TEXT: usize = 64;
/// Image tokens: a 24 × 24 grid of patches.
const IMAGE: usize = 576;
/// Queries of the resampler.
const QUERIES: usize = 32;

/// Time the attention rows of vl's cost comparison.
#[derive(Parser, Debug)]
struct Args {
    /// Timed repetitions per row (the median is printed), after one warm-up.
    #[arg(long, default_value_t = 10)]
    repeats: usize,
}

/// Weights initialised under `vars`, as plain (detached) tensors.
fn frozen(vars: &VarMap, dev: &Device) -> anyhow::Result<VarBuilder<'static>> {
    let tensors: HashMap<String, Tensor> = vars
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("the variable map's lock is poisoned"))?
        .iter()
        .map(|(name, var)| (name.clone(), var.as_tensor().detach()))
        .collect();
    Ok(VarBuilder::from_tensors(tensors, DType::F32, dev))
}

/// Median milliseconds of `f` over `repeats` runs after one warm-up.
fn median_ms(repeats: usize, mut f: impl FnMut() -> anyhow::Result<Tensor>) -> anyhow::Result<f64> {
    f()?;
    let mut ms = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        let out = f()?;
        // Force the work before the clock stops.
        out.sum_all()?.to_scalar::<f32>()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

/// FLOPs of one attention call: `q_len` queries over `kv_len` keys,
/// projecting `proj_q` query rows and `proj_kv` key/value rows.
fn flops(q_len: usize, kv_len: usize, proj_kv: usize) -> f64 {
    let d = WIDTH as f64;
    let (q, kv, p) = (q_len as f64, kv_len as f64, proj_kv as f64);
    let projections = 2.0 * d * d * (2.0 * q + 2.0 * p); // q, o and k, v
    let attention = 2.0 * 2.0 * q * kv * d; // scores and weighted sum
    projections + attention
}

fn score_bytes(q_len: usize, kv_len: usize) -> usize {
    HEADS * q_len * kv_len * 4
}

struct Row {
    name: &'static str,
    flops: f64,
    scores: usize,
    ms: f64,
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let init = VarBuilder::from_varmap(&vars, DType::F32, &dev);
    let cross_cfg = CrossAttentionConfig::new(WIDTH, WIDTH, HEADS);
    CausalSelfAttention::load(init.pp("self"), &SelfAttentionConfig::new(WIDTH, HEADS))?;
    CrossAttention::load(init.pp("cross"), &cross_cfg)?;
    QueryPool::load(init.pp("pool"), QUERIES, &cross_cfg)?;
    let vb = frozen(&vars, &dev)?;
    let self_attn =
        CausalSelfAttention::load(vb.pp("self"), &SelfAttentionConfig::new(WIDTH, HEADS))?;
    let cross = CrossAttention::load(vb.pp("cross"), &cross_cfg)?;
    let pool = QueryPool::load(vb.pp("pool"), QUERIES, &cross_cfg)?;

    let text = Tensor::randn(0f32, 1., (1, TEXT, WIDTH), &dev)?;
    let image = Tensor::randn(0f32, 1., (1, IMAGE, WIDTH), &dev)?;
    let image_kv = cross.project_memory(&image)?;
    let resampled = pool.forward(&image, None)?; // (1, 32, 768)
    let resampled_kv = cross.project_memory(&resampled)?;
    let reps = args.repeats;

    let rows = [
        Row {
            name: "self-attention, Nt = 64 (causal)",
            flops: flops(TEXT, TEXT, TEXT),
            scores: score_bytes(TEXT, TEXT),
            ms: median_ms(reps, || Ok(self_attn.forward(&text, None)?))?,
        },
        Row {
            name: "cross-attention 64 -> 576, K/V projected in the call",
            flops: flops(TEXT, IMAGE, IMAGE),
            scores: score_bytes(TEXT, IMAGE),
            ms: median_ms(reps, || Ok(cross.forward(&text, &image, None)?))?,
        },
        Row {
            name: "cross-attention 64 -> 576, K/V cached",
            flops: flops(TEXT, IMAGE, 0),
            scores: score_bytes(TEXT, IMAGE),
            ms: median_ms(reps, || {
                Ok(cross.attend(&text, &image_kv, None, Weights::Skip)?.output)
            })?,
        },
        Row {
            name: "cross-attention 64 -> 32 resampled, K/V cached",
            flops: flops(TEXT, QUERIES, 0),
            scores: score_bytes(TEXT, QUERIES),
            ms: median_ms(reps, || {
                Ok(cross
                    .attend(&text, &resampled_kv, None, Weights::Skip)?
                    .output)
            })?,
        },
        Row {
            name: "resampling 576 -> 32 (once per image)",
            flops: flops(QUERIES, IMAGE, IMAGE),
            scores: score_bytes(QUERIES, IMAGE),
            ms: median_ms(reps, || Ok(pool.forward(&image, None)?))?,
        },
    ];
    println!(
        "width {WIDTH}, {HEADS} heads, {} threads; median of {reps} runs",
        candle_core::utils::get_num_threads()
    );
    println!(
        "{:<54} {:>9} {:>12} {:>9}",
        "call", "MFLOP", "scores (KB)", "ms"
    );
    for r in &rows {
        println!(
            "{:<54} {:>9.1} {:>12.1} {:>9.3}",
            r.name,
            r.flops / 1e6,
            r.scores as f64 / 1024.0,
            r.ms
        );
    }
    let (self_row, cached, resampled_row) = (&rows[0], &rows[2], &rows[3]);
    println!(
        "cached cross-attention / self-attention: {:.2}x FLOPs, {:.2}x time",
        cached.flops / self_row.flops,
        cached.ms / self_row.ms
    );
    println!(
        "resampled / full cached cross-attention: {:.2}x FLOPs, {:.2}x time",
        resampled_row.flops / cached.flops,
        resampled_row.ms / cached.ms
    );
    Ok(())
}

fn main() -> ExitCode {
    match run().context("attention_cost") {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

//! `vl experiment cost`: what cross-attention costs next to self-attention
//! as the image grid grows, and what the image K/V cache and a resampler
//! buy. Width 768, 12 heads (a base-size decoder), a text of Nt = 64
//! tokens, image grids of g × g tokens (`--grids`), a resampler of 32
//! queries (one layer).
//!
//! Two phases, each timed (median of `--repeats` runs after a warm-up) and
//! counted (multiply-adds as 2 FLOPs: the projections and the two
//! attention products; softmax and masking left out):
//! - **prefill**: the 64 text positions at once;
//! - **decode step**: one new position after 63 cached ones.
//!
//! Rows of each phase: causal self-attention over the text; cross-attention
//! to the Nv image tokens with their keys and values projected in the call
//! (a decoder without an image cache re-projects them every step), with
//! them cached (projected once per image), and to the 32 resampled tokens
//! (cached); and the resampler itself, once per image. Writes `cost.json`
//! and `cost.png`, and prints each grid's table.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use vl::vl_attn::{
    CausalSelfAttention, CrossAttention, CrossAttentionConfig, Resampler, ResamplerConfig,
    SelfAttentionConfig, Weights,
};

use super::{command_line, write_json, Output};
use crate::plot::{self, Axis, Legend, Panel, Series};

/// The width of every stream.
pub const WIDTH: usize = 768;
/// Attention heads.
pub const HEADS: usize = 12;
/// Text tokens.
pub const TEXT: usize = 64;
/// Queries of the resampler.
pub const QUERIES: usize = 32;

/// Time and count attention as the image grid grows.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    out: Output,
    /// Image grid sides g (Nv = g × g tokens), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "7,8,12,16,20,24,28,32")]
    grids: Vec<usize>,
    /// Timed repetitions per row (the median is kept), after one warm-up.
    #[arg(long, default_value_t = 10)]
    repeats: usize,
}

/// The rows of each phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Row {
    /// Causal self-attention over the text.
    SelfAttention,
    /// Cross-attention, image K/V projected in the call.
    CrossUncached,
    /// Cross-attention over cached image K/V.
    CrossCached,
    /// Cross-attention over the cached K/V of the resampled tokens.
    CrossResampled,
    /// The resampler, once per image.
    Resampler,
}

impl Row {
    const ALL: [Row; 5] = [
        Row::SelfAttention,
        Row::CrossUncached,
        Row::CrossCached,
        Row::CrossResampled,
        Row::Resampler,
    ];

    fn label(self) -> &'static str {
        match self {
            Row::SelfAttention => "self-attention, Nt = 64 (causal)",
            Row::CrossUncached => "cross-attention, image K/V projected in the call",
            Row::CrossCached => "cross-attention, image K/V cached",
            Row::CrossResampled => "cross-attention to 32 resampled tokens, cached",
            Row::Resampler => "resampler Nv -> 32 (once per image)",
        }
    }
}

/// One measured row.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Measure {
    /// Which call.
    pub row: Row,
    /// Prefill (64 positions) or decode step (1 position after 63).
    pub phase: &'static str,
    /// Image tokens.
    pub image_tokens: usize,
    /// FLOPs of the call.
    pub flops: f64,
    /// Median milliseconds.
    pub ms: f64,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    command: String,
    threads: usize,
    width: usize,
    heads: usize,
    text_tokens: usize,
    resampler_queries: usize,
    repeats: usize,
    measures: Vec<Measure>,
}

/// FLOPs of one attention call: `q` query rows over `kv` keys, projecting
/// `q` query and output rows and `p` new key/value rows.
pub fn attention_flops(q: usize, kv: usize, p: usize) -> f64 {
    let d = WIDTH as f64;
    let (q, kv, p) = (q as f64, kv as f64, p as f64);
    let projections = 2.0 * d * d * (2.0 * q + 2.0 * p); // q, o and k, v
    let attention = 2.0 * 2.0 * q * kv * d; // scores and weighted sum
    projections + attention
}

/// FLOPs of the one-layer resampler over `nv` image tokens: self-attention
/// among the queries, cross-attention to the image, the 4×-wide FFN.
pub fn resampler_flops(nv: usize) -> f64 {
    let ffn = 2.0 * 2.0 * QUERIES as f64 * (WIDTH * 4 * WIDTH) as f64;
    attention_flops(QUERIES, QUERIES, QUERIES) + attention_flops(QUERIES, nv, nv) + ffn
}

/// Median milliseconds of `f` over `repeats` runs after one warm-up;
/// `setup` runs before each, untimed.
fn median_ms<S>(
    repeats: usize,
    mut setup: impl FnMut() -> anyhow::Result<S>,
    mut f: impl FnMut(S) -> anyhow::Result<Tensor>,
) -> anyhow::Result<f64> {
    f(setup()?)?;
    let mut ms = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let state = setup()?;
        let t = Instant::now();
        let out = f(state)?;
        // Force the work before the clock stops.
        out.sum_all()?.to_scalar::<f32>()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    // The true median (the mean of the middle two for an even count), as
    // `vl bench` takes it.
    Ok(crate::bench::median(ms))
}

/// Weights initialised under `vars`, as plain (detached) tensors, so that
/// the modules run without gradient tracking.
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

/// Measures every row of both phases at each grid.
pub fn measure(grids: &[usize], repeats: usize) -> anyhow::Result<Vec<Measure>> {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let init = VarBuilder::from_varmap(&vars, DType::F32, &dev);
    let self_cfg = SelfAttentionConfig::new(WIDTH, HEADS);
    let cross_cfg = CrossAttentionConfig::new(WIDTH, WIDTH, HEADS);
    let res_cfg = ResamplerConfig::new(WIDTH, WIDTH, QUERIES, 1, HEADS);
    CausalSelfAttention::load(init.pp("self"), &self_cfg)?;
    CrossAttention::load(init.pp("cross"), &cross_cfg)?;
    Resampler::load(init.pp("resampler"), &res_cfg)?;
    let vb = frozen(&vars, &dev)?;
    let self_attn = CausalSelfAttention::load(vb.pp("self"), &self_cfg)?;
    let cross = CrossAttention::load(vb.pp("cross"), &cross_cfg)?;
    let resampler = Resampler::load(vb.pp("resampler"), &res_cfg)?;

    let text = Tensor::randn(0f32, 1., (1, TEXT, WIDTH), &dev)?;
    let prefix = text.narrow(1, 0, TEXT - 1)?;
    let last = text.narrow(1, TEXT - 1, 1)?;
    // A cache holding the 63 earlier positions, rebuilt (untimed) before
    // each timed step.
    let cache = || -> anyhow::Result<_> {
        let mut c = self_attn.new_cache(TEXT)?;
        self_attn.attend(&prefix, Some(&mut c), None, Weights::Skip)?;
        Ok(c)
    };
    let mut out = Vec::new();
    for &g in grids {
        anyhow::ensure!(g > 0, "--grids: a grid side must be positive");
        let nv = g * g;
        let image = Tensor::randn(0f32, 1., (1, nv, WIDTH), &dev)?;
        let image_kv = cross.project_memory(&image)?;
        let resampled = resampler.forward(&image, None)?;
        let resampled_kv = cross.project_memory(&resampled)?;
        let none = || Ok(());
        for (phase, q) in [("prefill", &text), ("decode step", &last)] {
            let rows = q.dim(1)?;
            for row in Row::ALL {
                let (flops, ms) = match row {
                    Row::SelfAttention if rows == 1 => (
                        attention_flops(1, TEXT, 1),
                        median_ms(repeats, cache, |mut c| {
                            Ok(self_attn
                                .attend(q, Some(&mut c), None, Weights::Skip)?
                                .output)
                        })?,
                    ),
                    Row::SelfAttention => (
                        attention_flops(TEXT, TEXT, TEXT),
                        median_ms(repeats, none, |()| Ok(self_attn.forward(q, None)?))?,
                    ),
                    Row::CrossUncached => (
                        attention_flops(rows, nv, nv),
                        median_ms(repeats, none, |()| Ok(cross.forward(q, &image, None)?))?,
                    ),
                    Row::CrossCached => (
                        attention_flops(rows, nv, 0),
                        median_ms(repeats, none, |()| {
                            Ok(cross.attend(q, &image_kv, None, Weights::Skip)?.output)
                        })?,
                    ),
                    Row::CrossResampled => (
                        attention_flops(rows, QUERIES, 0),
                        median_ms(repeats, none, |()| {
                            Ok(cross.attend(q, &resampled_kv, None, Weights::Skip)?.output)
                        })?,
                    ),
                    // Once per image: listed with the prefill only.
                    Row::Resampler if rows > 1 => (
                        resampler_flops(nv),
                        median_ms(repeats, none, |()| Ok(resampler.forward(&image, None)?))?,
                    ),
                    Row::Resampler => continue,
                };
                out.push(Measure {
                    row,
                    phase,
                    image_tokens: nv,
                    flops,
                    ms,
                });
            }
        }
    }
    Ok(out)
}

/// Prints the measures as one table per grid and phase.
pub fn print_tables(measures: &[Measure]) {
    println!(
        "width {WIDTH}, {HEADS} heads, Nt = {TEXT}, {} threads",
        candle_core::utils::get_num_threads()
    );
    let mut last = None;
    for m in measures {
        if last != Some((m.image_tokens, m.phase)) {
            println!(
                "\nNv = {} ({}), {}\n{:<52} {:>10} {:>9}",
                m.image_tokens,
                grid_name(m.image_tokens),
                m.phase,
                "call",
                "MFLOP",
                "ms"
            );
            last = Some((m.image_tokens, m.phase));
        }
        println!(
            "{:<52} {:>10.1} {:>9.3}",
            m.row.label(),
            m.flops / 1e6,
            m.ms
        );
    }
}

fn grid_name(nv: usize) -> String {
    let g = (nv as f64).sqrt().round() as usize;
    format!("{g}×{g}")
}

/// The four panels: prefill and decode-step time, prefill and
/// decode-step FLOPs, against the image tokens.
fn panels(measures: &[Measure]) -> Vec<Panel> {
    let mut panels = Vec::new();
    for (what, unit) in [("time", "ms (median)"), ("FLOPs", "MFLOP")] {
        for phase in ["prefill", "decode step"] {
            let series = Row::ALL
                .iter()
                .filter_map(|&row| {
                    let points: Vec<(f64, f64)> = measures
                        .iter()
                        .filter(|m| m.row == row && m.phase == phase)
                        .map(|m| {
                            let y = if what == "time" { m.ms } else { m.flops / 1e6 };
                            (m.image_tokens as f64, y)
                        })
                        .collect();
                    let s = Series::new(row.label(), points);
                    match row {
                        _ if s.points.is_empty() => None,
                        Row::SelfAttention => Some(s.dashed()),
                        _ => Some(s),
                    }
                })
                .collect();
            let title = match phase {
                "prefill" => format!("{what}: prefill of {TEXT} text positions"),
                _ => format!("{what}: one decode step (position {TEXT})"),
            };
            panels.push(Panel {
                title,
                x: Axis::log("image tokens Nv"),
                y: Axis::log(unit),
                series,
                legend: Legend::UpperLeft,
            });
        }
    }
    panels
}

/// Runs `vl experiment cost`.
pub fn run(args: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(!args.grids.is_empty(), "--grids: give at least one");
    let (json, png) = args.out.paths("cost")?;
    let measures = measure(&args.grids, args.repeats)?;
    print_tables(&measures);
    plot::write_png(&png, &panels(&measures), 2, (640, 460))?;
    write_json(
        &json,
        &Report {
            command: command_line(),
            threads: candle_core::utils::get_num_threads(),
            width: WIDTH,
            heads: HEADS,
            text_tokens: TEXT,
            resampler_queries: QUERIES,
            repeats: args.repeats,
            measures,
        },
    )?;
    println!("\nwrote {} and {}", json.display(), png.display());
    Ok(())
}

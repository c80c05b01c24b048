//! Times captioning with a model directory and prints one JSON line of
//! medians: encode, decode per token, end to end, batch throughput, the
//! image and text caches, peak memory; and the machine's read bandwidth,
//! measured in the same process at its start and end, with the bytes a
//! decode step reads and the fraction of the bandwidth that reaches.
//!
//! `vl bench --model DIR [--dtype bf16] [--quantize q8_0]`
//!
//! Decoding is greedy and never stops early (no EOS), so every run decodes
//! exactly `--new-tokens` tokens. `scripts/bench_vs_torch.py` runs this next
//! to transformers on the same checkpoint and prints the ratios.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Device, Tensor, D};
use vl::vl_attn::Quantization;
use vl::vl_decoder::{ImageContext, StepOptions, VisionLanguageDecoder};
use vl::{LoadOptions, VlModel};

/// Time captioning with a model directory.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model directory (vl's own or a transformers ViT/DeiT + GPT-2/TrOCR checkpoint).
    #[arg(long)]
    model: PathBuf,
    /// f32, f16 or bf16.
    #[arg(long, default_value = "f32", value_parser = crate::args::dtype)]
    dtype: DType,
    /// Linear layers (decoder and ViT) in 8-bit (q8_0) or 4-bit (q4k) blocks, or dense 16-bit weights (bf16, f16) under --dtype activations; none = as loaded.
    #[arg(long, default_value = "none")]
    quantize: Quantization,
    /// The decoder's text cache: bf16, f16, f32 or q8 (see `vl caption --help`) [default: under --quantize with f32 activations on the CPU, q8 for q8_0 and q4k (bf16 where heads are not a multiple of 32), bf16 or f16 for 16-bit weights; else --dtype].
    #[arg(long, value_name = "FORMAT", value_parser = crate::args::cache_format)]
    text_cache: Option<DType>,
    /// The image's keys and values: bf16, f16, f32 or q8 (see `vl caption --help`) [default: under --quantize with f32 activations on the CPU, q8 for q8_0 and q4k (bf16 where heads are not a multiple of 32), bf16 or f16 for 16-bit weights; else --dtype].
    #[arg(long, value_name = "FORMAT", value_parser = crate::args::cache_format)]
    image_cache: Option<DType>,
    /// cpu, cuda, cuda:N, metal or metal:N.
    #[arg(long, default_value = "cpu", value_parser = crate::args::device)]
    device: Device,
    /// Tokens decoded per caption.
    #[arg(long, default_value = "16", value_parser = crate::args::positive)]
    new_tokens: NonZeroUsize,
    /// Images of the throughput run.
    #[arg(long, default_value = "8", value_parser = crate::args::positive)]
    batch: NonZeroUsize,
    /// Timed repetitions (the median is reported), after one warm-up.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Cached text length of the long-context measurement.
    #[arg(long, default_value_t = 200)]
    long_position: usize,
    /// Positions of the teacher-forced top-1 agreement check against the f32
    /// model (with --quantize or a --dtype other than f32); 0 skips it.
    #[arg(long, default_value_t = 256)]
    agreement_tokens: usize,
    /// Skip the slow measurements (no image cache, long context, batch).
    #[arg(long)]
    quick: bool,
    /// Tokens of the caption measurements (`e2e_ms`, `e2e_beam_ms`);
    /// default `--new-tokens`.
    #[arg(long, value_parser = crate::args::positive)]
    caption_tokens: Option<NonZeroUsize>,
    /// Also time a caption with this many beams (`e2e_beam_ms`: encode,
    /// then beam search of exactly `--caption-tokens` tokens).
    #[arg(long)]
    beams: Option<NonZeroUsize>,
    /// Also time decode steps with this many text tokens cached, for each
    /// position of a comma list (`ms_per_token_at_P`: 8 greedy steps
    /// after a prefix of P tokens; with --quick too), e.g. 100,1000,3000.
    #[arg(long, value_delimiter = ',')]
    positions: Vec<usize>,
}

/// Greedy steps timed after a prefix, per position of `--positions` (and
/// the long-context figures).
const STEPS_AFTER_PREFIX: usize = 8;

/// The median of `xs` (not empty): the middle value, or the mean of the
/// two middle ones for an even count — the upper one alone made the
/// 3-beam caption time (timed on half the repeats, rounded up: 2 of 3)
/// the slower of its two runs.
pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let m = xs.len() / 2;
    if xs.len().is_multiple_of(2) {
        (xs[m - 1] + xs[m]) / 2.0
    } else {
        xs[m]
    }
}

fn time<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<(f64, T)> {
    let t = Instant::now();
    let out = f()?;
    Ok((t.elapsed().as_secs_f64() * 1e3, out))
}

/// Repeats `f` (once untimed) and returns the median of its milliseconds.
fn bench(repeats: usize, mut f: impl FnMut() -> anyhow::Result<f64>) -> anyhow::Result<f64> {
    f()?;
    let runs = (0..repeats.max(1))
        .map(|_| f())
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(median(runs))
}

/// Greedy decoding of `n` tokens after a prefix of `prefix` start tokens
/// (fed in one step); returns the mean milliseconds per token of those `n`
/// steps. With `recompute`, every step also re-projects the image's keys
/// and values, as a decoder without an image cache would.
fn decode(
    dec: &VisionLanguageDecoder,
    ctx: &ImageContext,
    memory: &Tensor,
    prefix: usize,
    n: usize,
    recompute: bool,
) -> anyhow::Result<f64> {
    let rows = ctx.images();
    // As `generate` decodes: the pool's workers awake between the steps.
    let _awake = vl::vl_attn::kernels::KeepAwake::for_device(dec.device());
    let mut state = dec.start(ctx, 1)?;
    let start = vec![dec.config().bos_token_id; rows * prefix];
    let first = Tensor::from_vec(start, (rows, prefix), dec.device())?;
    let mut logits = dec.step(&mut state, &first, StepOptions::last())?.values;
    let t = Instant::now();
    for _ in 0..n {
        let next = logits.argmax(D::Minus1)?.unsqueeze(1)?;
        if recompute {
            std::hint::black_box(dec.image_context(memory, None)?);
        }
        logits = dec.step(&mut state, &next, StepOptions::last())?.values;
    }
    logits.to_vec2::<f32>()?;
    Ok(t.elapsed().as_secs_f64() * 1e3 / n as f64)
}

/// Milliseconds to caption `pixels` with beam search: encode, project the
/// image, then `num_beams` beams for exactly `n` tokens (no end token).
fn beam_caption_ms(
    model: &VlModel,
    pixels: &Tensor,
    n: usize,
    num_beams: usize,
) -> anyhow::Result<f64> {
    let mut cfg = vl::vl_decoder::GenerationConfig::greedy(model.decoder.config(), n)
        .with_strategy(vl::vl_decoder::Strategy::beam(num_beams));
    cfg.eos_token_ids.clear();
    let t = Instant::now();
    let memory = memory(model, pixels)?;
    let ctx = model.decoder.image_context(&memory, None)?;
    let out = vl::vl_decoder::generate(&model.decoder, &ctx, &cfg, &mut |_| {})?;
    anyhow::ensure!(
        out.iter().all(|g| g.tokens.len() == n),
        "beam search stopped before {n} tokens"
    );
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// What the decoder reads for `pixels`: the image tokens, or for a model
/// with a text encoder (Florence-2) its output over the image tokens and
/// the `<CAPTION>` prompt — the "encode" of every measurement.
fn memory(model: &VlModel, pixels: &Tensor) -> anyhow::Result<Tensor> {
    let image_tokens = model.encode_pixels(pixels)?;
    if model.text_encoder.is_none() {
        return Ok(image_tokens);
    }
    let prompt = vl::tasks::Task::Caption.prompt(None)?;
    let ids = model.encoder_prompt_ids(&prompt)?;
    Ok(model.encoder_memory(&image_tokens, &ids)?)
}

/// Milliseconds to caption `pixels`: encode, project the image, decode `n`
/// tokens.
fn caption_ms(model: &VlModel, pixels: &Tensor, n: usize) -> anyhow::Result<f64> {
    let t = Instant::now();
    let memory = memory(model, pixels)?;
    let ctx = model.decoder.image_context(&memory, None)?;
    decode(&model.decoder, &ctx, &memory, 1, n, false)?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

fn weights_mb(dir: &std::path::Path) -> f64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len() as f64 / (1024.0 * 1024.0))
        .sum()
}

/// The machine's read bandwidth in GB/s, measured in this process: the
/// best of three sums of a 256 MB buffer split across the pool (the
/// threads `--threads` gives), in 16-float lanes so that loads, not adds,
/// bound it.
fn read_gb_s() -> f64 {
    use rayon::prelude::*;
    let buf = vec![1f32; 64 << 20];
    let mut best = f64::MAX;
    let mut sink = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let s: f32 = buf
            .par_chunks(1 << 16)
            .map(|c| {
                let mut acc = [0f32; 16];
                for v in c.chunks_exact(16) {
                    for (a, x) in acc.iter_mut().zip(v) {
                        *a += x;
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum();
        best = best.min(t.elapsed().as_secs_f64());
        sink += f64::from(s);
    }
    std::hint::black_box(sink);
    (buf.len() * std::mem::size_of::<f32>()) as f64 / best / 1e9
}

/// The bytes one decode step of one sample reads, about: every weight it
/// multiplies by (self-attention, the cross-attention's query and output
/// projections, the feed-forward layers, the LM head; the image's keys and
/// values are projected once per image) at the bytes per weight of its
/// format, plus the image's keys and values as the cache holds them. The
/// text cache, biases and norms (well under 1% at 16 tokens) are left out.
fn decode_step_bytes(dec: &VisionLanguageDecoder, ctx: &ImageContext) -> f64 {
    let c = dec.config();
    let (h, inter) = (c.hidden_size as f64, c.intermediate_size as f64);
    let kv = h * c.num_key_value_heads.unwrap_or(c.num_attention_heads) as f64
        / c.num_attention_heads.max(1) as f64;
    // As the layers hold them (the LM head's format is every linear
    // layer's): q8_0 34/32, q4k 148/256 in vl's CPU tiles, bf16 2.
    let per_weight = dec.lm_head().bytes_per_weight();
    let mut weights = c.vocab_size as f64 * h;
    let mut image = 0f64;
    for layer in 0..c.num_hidden_layers {
        weights += 2.0 * h * h + 2.0 * kv * h + 2.0 * h * inter;
        if let Some(cross) = ctx.layer(layer) {
            weights += 2.0 * h * h;
            if c.gated_cross_ffn {
                weights += 2.0 * h * inter;
            }
            for t in [cross.k(), cross.v()] {
                image += (t.elem_count() * t.dtype().size_in_bytes()) as f64;
            }
        }
    }
    weights * per_weight + image
}

/// Runs `vl bench`: prints one JSON line of medians.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let (device, dtype) = (&args.device, args.dtype);
    // Before anything is loaded (so the buffer does not count in the peak
    // memory figure: the model's own peak is larger).
    let read_start = device.is_cpu().then(read_gb_s);
    // Quantized as `vl caption --quantize` does: part by part during the
    // load (its time counts in `load_ms`).
    let (load_ms, model) = time(|| {
        vl::load(
            &args.model,
            &LoadOptions::new(dtype, device)
                .quantized(args.quantize)
                .with_text_cache(args.text_cache)
                .with_image_cache(args.image_cache),
        )
        .with_context(|| {
            format!(
                "cannot load {} (--quantize {})",
                args.model.display(),
                args.quantize
            )
        })
    })?;
    // As `vl caption` does after its load.
    vl::return_freed_memory();
    let spec = *model.pixel_spec()?;
    let (h, w) = spec.size();
    // A fixed, non-constant test image at the input size.
    let pixels = Tensor::arange(0f32, (3 * h * w) as f32, device)?
        .affine(1.0 / (3 * h * w) as f64, -0.5)?
        .reshape((1, 3, h, w))?;
    let dec = &model.decoder;
    // Checked before anything is timed.
    let max_positions = dec.config().max_position_embeddings;
    for &pos in &args.positions {
        if pos == 0 || pos + STEPS_AFTER_PREFIX > max_positions {
            anyhow::bail!(
                "--positions: {pos} is not a position to time here: 1 to {} (the model's \
                 max_position_embeddings {max_positions} less the {STEPS_AFTER_PREFIX} timed steps)",
                max_positions.saturating_sub(STEPS_AFTER_PREFIX)
            );
        }
    }

    let encode_ms = bench(args.repeats, || {
        let (ms, m) = time(|| memory(&model, &pixels))?;
        m.flatten_all()?
            .sum_all()?
            .to_dtype(DType::F32)?
            .to_scalar::<f32>()?;
        Ok(ms)
    })?;
    let memory = memory(&model, &pixels)?;
    let ctx = dec.image_context(&memory, None)?;
    let ms_per_token = bench(args.repeats, || {
        decode(dec, &ctx, &memory, 1, args.new_tokens.get(), false)
    })?;
    let caption_tokens = args.caption_tokens.unwrap_or(args.new_tokens).get();
    let e2e_ms = bench(args.repeats, || caption_ms(&model, &pixels, caption_tokens))?;
    let e2e_beam_ms = match args.beams {
        Some(b) => Some(bench(args.repeats.div_ceil(2), || {
            beam_caption_ms(&model, &pixels, caption_tokens, b.get())
        })?),
        None => None,
    };
    let step_bytes = decode_step_bytes(dec, &ctx);
    let decode_gb_s = step_bytes / ms_per_token / 1e6;
    let mut json = serde_json::json!({
        "model": args.model.display().to_string(),
        "dtype": args.dtype.as_str(),
        "quantize": args.quantize.name(),
        "text_cache": vl::settings::cache_format_name(
            model.decoder.text_cache_dtype().unwrap_or(args.dtype)
        ),
        "image_cache": vl::settings::cache_format_name(
            model.decoder.image_cache_dtype().unwrap_or(args.dtype)
        ),
        "device": crate::args::device_name(&args.device),
        "new_tokens": args.new_tokens.get(),
        "load_ms": load_ms,
        "encode_ms": encode_ms,
        "ms_per_token": ms_per_token,
        "e2e_ms": e2e_ms,
        "decode_step_mb": step_bytes / 1e6,
        "decode_gb_s": decode_gb_s,
        // The CPU the figures belong to, and the kernels it chose.
        "cpu": vl::vl_attn::kernels::CpuFeatures::get().to_string(),
        "caption_tokens": caption_tokens,
    });
    if let (Some(ms), Some(b)) = (e2e_beam_ms, args.beams) {
        json["e2e_beam_ms"] = ms.into();
        json["beams"] = b.get().into();
    }
    // ms/token with `pos` text tokens cached.
    let reps = args.repeats.min(3);
    let at = |pos: usize| {
        bench(reps, || {
            decode(dec, &ctx, &memory, pos, STEPS_AFTER_PREFIX, false)
        })
    };
    if !args.quick {
        let no_cache = bench(reps, || {
            decode(dec, &ctx, &memory, 1, args.new_tokens.get().min(8), true)
        })?;
        // The text cache: ms/token with `long_position` tokens cached vs 10.
        let short = at(10)?;
        let long = at(args.long_position)?;
        let batch_pixels = pixels.repeat((args.batch.get(), 1, 1, 1))?;
        let batch_ms = bench(reps, || {
            caption_ms(&model, &batch_pixels, args.new_tokens.get())
        })?;
        json["no_image_cache_ms_per_token"] = no_cache.into();
        json["image_cache_speedup"] = (no_cache / ms_per_token).into();
        json["ms_per_token_at_10"] = short.into();
        json[format!("ms_per_token_at_{}", args.long_position)] = long.into();
        json["long_over_short"] = (long / short).into();
        json["batch"] = args.batch.get().into();
        json["images_per_s"] = (args.batch.get() as f64 * 1e3 / batch_ms).into();
    }
    for &pos in &args.positions {
        json[format!("ms_per_token_at_{pos}")] = at(pos)?.into();
    }
    let weights = weights_mb(&args.model);
    json["weights_mb"] = weights.into();
    if let Some(rss) = peak_rss_mb() {
        json["peak_rss_mb"] = rss.into();
        json["rss_over_weights"] = (rss / weights).into();
    }
    // After the memory figure (its buffer must not count in it), the
    // bandwidth again: the decode figures as a fraction of what the machine
    // read at the start and at the end of this run.
    if let Some(start) = read_start {
        let end = read_gb_s();
        json["read_gb_s_start"] = start.into();
        json["read_gb_s_end"] = end.into();
        json["decode_bandwidth_fraction"] = (decode_gb_s / ((start + end) / 2.0)).into();
    }
    // After the memory figure: the f32 reference loaded for the agreement
    // check must not count in it.
    if args.agreement_tokens > 0
        && (args.dtype != DType::F32 || args.quantize != Quantization::None)
    {
        let reference = vl::load(&args.model, &LoadOptions::new(DType::F32, device))
            .with_context(|| format!("cannot load {} in f32", args.model.display()))?;
        let (agreement, margin) = agreement(&reference, &model, &pixels, args.agreement_tokens)?;
        json["top1_agreement"] = agreement.into();
        json["dense_top1_margin_in_std"] = margin.into();
    }
    println!("{json}");
    Ok(())
}

/// Teacher-forced top-1 agreement of `model` (as benchmarked: its dtype,
/// its quantization, its own encoder) with the f32 `reference` over a fixed
/// pseudo-random token sequence of up to `tokens` positions, and how decided
/// the reference's choices are: the median gap between its two largest
/// logits, in units of the logits' std.
fn agreement(
    reference: &VlModel,
    model: &VlModel,
    pixels: &Tensor,
    tokens: usize,
) -> anyhow::Result<(f64, f64)> {
    let cfg = reference.decoder.config();
    let n = tokens.min(cfg.max_position_embeddings);
    let ids: Vec<u32> = (0..n as u64)
        .map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) % cfg.vocab_size as u64) as u32)
        .collect();
    let tokens = Tensor::from_vec(ids, (1, n), pixels.device())?;
    let logits_of = |m: &VlModel| -> anyhow::Result<Vec<Vec<f32>>> {
        let memory = memory(m, pixels)?;
        Ok(m.decoder
            .forward(&tokens, Some(&memory), Default::default())?
            .squeeze(0)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?)
    };
    // The index of the largest logit; the first on ties, as argmax.
    let top1 = |row: &[f32]| {
        row.iter()
            .enumerate()
            .fold(0, |best, (i, x)| if *x > row[best] { i } else { best })
    };
    let dense = logits_of(reference)?;
    let gaps: Vec<f64> = dense
        .iter()
        .map(|row| {
            let mut sorted = row.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let mean = row.iter().sum::<f32>() / row.len() as f32;
            let var = row.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / row.len() as f32;
            f64::from((sorted[0] - sorted[1]) / var.sqrt())
        })
        .collect();
    let got = logits_of(model)?;
    let same = dense
        .iter()
        .zip(&got)
        .filter(|(a, b)| top1(a) == top1(b))
        .count();
    Ok((same as f64 / n as f64, median(gaps)))
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_is_the_middle_or_the_mean_of_the_middle_two() {
        assert_eq!(median(vec![5.0]), 5.0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0]), 2.5);
        assert_eq!(median(vec![9.0, 1.0, 4.0, 2.0]), 3.0);
    }
}

//! Trains the shapes captioner — a small ViT and a `VisionLanguageDecoder`,
//! jointly, with candle autograd and AdamW — on freshly drawn scenes of the
//! shapes world, and writes a model directory.
//!
//! `vl train-shapes --out models/shapes-captioner`
//!
//! Seeded and reproducible: the same flags give the same weights. Progress
//! (step, loss, running token accuracy) goes to stderr.
//!
//! `--dropout P` trains the decoder with attention, residual and embedding
//! dropout `P`, and the ViT with attention and hidden dropout `P` (masks
//! seeded by `--dropout-seed`); evaluation runs in inference mode, without
//! dropout.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use indicatif::{ProgressBar, ProgressStyle};
use vl::captioner::Captioner;
use vl::shapes::{self, BOS, EOS, PAD};
use vl::vl_attn::{Resampler, ResamplerConfig};
use vl::vl_decoder::init::seeded_init;
use vl::vl_decoder::{generate, Dropout, ForwardMasks, Mode, VisionLanguageDecoder};
use vl::vl_shapes::scene_accuracy;
use vl::vl_vision::{VisionConfig, VisionEncoder};
use vl::{VlConfig, VlModel};

/// Train the shapes captioner.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Where to write the model directory.
    #[arg(long, default_value = "models/shapes-captioner")]
    out: PathBuf,
    /// Optimiser steps.
    #[arg(long, default_value_t = 9000)]
    steps: usize,
    /// Scenes per step.
    #[arg(long, default_value_t = 48)]
    batch_size: usize,
    /// Peak learning rate (linear warm-up, cosine decay).
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// Warm-up steps.
    #[arg(long, default_value_t = 200)]
    warmup: usize,
    /// Seed of the initial weights.
    #[arg(long, default_value_t = 0)]
    init_seed: u64,
    /// Seed of the training scenes (evaluation uses other seeds).
    #[arg(long, default_value_t = 1)]
    data_seed: u64,
    /// Evaluate scene accuracy on held-out scenes every this many steps.
    #[arg(long, default_value_t = 500)]
    eval_every: usize,
    /// Start from the weights of this model directory (same sizes) instead
    /// of fresh ones.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Width of the image and text streams.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Patch side of the image encoder, in pixels (divides 64).
    #[arg(long, default_value_t = 16)]
    patch: usize,
    /// Blocks of the encoder and of the decoder.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Dropout probability in [0, 1) of the attention probabilities,
    /// residual branches and embeddings of the decoder and the ViT, during
    /// training.
    #[arg(long, default_value_t = 0.0, value_parser = parse_dropout)]
    dropout: f64,
    /// Seed of the dropout masks.
    #[arg(long, default_value_t = 0)]
    dropout_seed: u64,
    /// Put a resampler of this many learned queries between the ViT and
    /// the decoder (0: none), so that cross-attention reads that many image
    /// tokens instead of every patch.
    #[arg(long, default_value_t = 0)]
    resampler_queries: usize,
    /// Layers of the resampler.
    #[arg(long, default_value_t = 1)]
    resampler_depth: usize,
}

/// Heads of the resampler's attentions (the ViT's and the decoder's too).
const RESAMPLER_HEADS: usize = 4;

/// Image tokens for the decoder: the ViT's, through the resampler if any.
///
/// # Shapes
/// `pixels: (batch, 3, size, size)` → `(batch, tokens | queries, hidden)`.
fn encode(
    vision: &VisionEncoder,
    resampler: Option<&Resampler>,
    pixels: &Tensor,
) -> anyhow::Result<Tensor> {
    let tokens = vision.forward(pixels)?;
    Ok(match resampler {
        None => tokens,
        Some(r) => r.forward(&tokens, None)?,
    })
}

/// `--dropout`: a probability in [0, 1).
fn parse_dropout(s: &str) -> Result<f64, String> {
    let p: f64 = s.parse().map_err(|e| format!("{e}"))?;
    Dropout::new("--dropout", p)
        .map(|d| d.p())
        .map_err(|e| e.to_string())
}

/// The held-out seed of evaluation during training.
const EVAL_SEED: u64 = 1_000_003;
/// Without a terminal, a progress line every this many steps.
const LOG_EVERY: usize = 50;
/// Scenes evaluated during training.
const EVAL_SCENES: usize = 200;
/// The longest caption, in words, plus start and end.
const MAX_TOKENS: usize = 14;

fn lr_at(step: usize, args: &Args) -> f64 {
    if step < args.warmup {
        return args.lr * (step + 1) as f64 / args.warmup as f64;
    }
    let t = (step - args.warmup) as f64 / (args.steps - args.warmup).max(1) as f64;
    let floor = args.lr * 0.02;
    floor + 0.5 * (args.lr - floor) * (1.0 + (std::f64::consts::PI * t).cos())
}

/// Runs `vl train-shapes`: trains, evaluates, writes the model directory.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let mut cfg = shapes::captioner_config(args.hidden, args.layers, args.patch);
    cfg.decoder.attention_dropout = args.dropout;
    cfg.decoder.residual_dropout = args.dropout;
    cfg.decoder.embedding_dropout = args.dropout;
    if let Some(VisionConfig::Vit(vit)) = &mut cfg.vision {
        vit.attention_dropout = args.dropout;
        vit.hidden_dropout = args.dropout;
    }
    if args.resampler_queries > 0 {
        cfg.resampler = Some(ResamplerConfig::new(
            args.hidden,
            args.hidden,
            args.resampler_queries,
            args.resampler_depth,
            RESAMPLER_HEADS,
        ));
    }
    cfg.validate()?;
    let tok = shapes::tokenizer()?;
    let id = |w: &str| tok.token_to_id(w).with_context(|| format!("token {w}"));
    let (bos, eos, pad) = (id(BOS)?, id(EOS)?, id(PAD)?);
    anyhow::ensure!(
        (bos, eos, pad)
            == (
                cfg.decoder.bos_token_id,
                cfg.decoder.eos_token_id,
                cfg.decoder.pad_token_id
            )
    );

    let mut vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
    let mut decoder = VisionLanguageDecoder::load(vb.pp("decoder"), &cfg.decoder)?;
    // Dropout acts in training only; evaluation switches to inference.
    let training = Mode::training(args.dropout_seed);
    let vision_cfg = cfg.vision.clone().context("vision config")?;
    let mut vision = VisionEncoder::load(vb.pp("vision"), &vision_cfg)?;
    let resampler = match &cfg.resampler {
        None => None,
        Some(r) => Some(Resampler::load(vb.pp("resampler"), r)?),
    };
    decoder.set_mode(training.clone());
    vision.set_mode(training.clone());
    seeded_init(&vars, args.init_seed)?;
    if let Some(dir) = &args.resume {
        let weights = dir.join(vl::checkpoint::WEIGHTS_FILE);
        vars.load(&weights)
            .with_context(|| format!("resume from {}", weights.display()))?;
        eprintln!("resumed from {}", weights.display());
    }
    let n_params: usize = vars.all_vars().iter().map(|v| v.elem_count()).sum();
    eprintln!("parameters: {n_params}");

    let mut opt = AdamW::new(
        vars.all_vars(),
        ParamsAdamW {
            lr: args.lr,
            weight_decay: 0.01,
            ..Default::default()
        },
    )?;
    let spec = vision_cfg.pixel_spec();
    let bar = ProgressBar::new(args.steps as u64);
    bar.set_style(ProgressStyle::with_template(
        "{elapsed_precise} [{bar:30}] {pos}/{len} {msg}",
    )?);
    let started = Instant::now();
    let (mut run_correct, mut run_total) = (0f64, 0f64);
    for step in 0..args.steps {
        opt.set_learning_rate(lr_at(step, args));
        let batch = shapes::batch(
            args.data_seed,
            (step * args.batch_size) as u64,
            args.batch_size,
            &spec,
            &dev,
        )?;
        // (b, MAX_TOKENS) ids, padded; input = ids[..-1], target = ids[1..].
        let mut rows = Vec::with_capacity(args.batch_size);
        for s in &batch.scenes {
            let mut ids = shapes::caption_ids(&tok, &s.caption(), bos, eos)?;
            anyhow::ensure!(ids.len() <= MAX_TOKENS, "caption too long: {}", s.caption());
            ids.resize(MAX_TOKENS, pad);
            rows.push(ids);
        }
        let ids = Tensor::new(rows, &dev)?;
        let input = ids.narrow(1, 0, MAX_TOKENS - 1)?;
        let target = ids.narrow(1, 1, MAX_TOKENS - 1)?.contiguous()?;
        let memory = encode(&vision, resampler.as_ref(), &batch.pixels)?;
        let logits = decoder.forward(&input, Some(&memory), ForwardMasks::default())?;
        // Cross-entropy over non-padding targets.
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let picked = logp.gather(&target.unsqueeze(2)?, 2)?.squeeze(2)?;
        let keep = target.ne(pad)?.to_dtype(DType::F32)?;
        let count = keep.sum_all()?;
        let loss = (picked * &keep)?.sum_all()?.neg()?.div(&count)?;
        opt.backward_step(&loss)?;

        let hit = (logits
            .argmax(D::Minus1)?
            .eq(&target)?
            .to_dtype(DType::F32)?
            * &keep)?
            .sum_all()?;
        run_correct = 0.98 * run_correct + hit.to_scalar::<f32>()? as f64;
        run_total = 0.98 * run_total + count.to_scalar::<f32>()? as f64;
        let msg = format!(
            "loss {:.4} token acc {:.4} lr {:.2e}",
            loss.to_scalar::<f32>()?,
            run_correct / run_total.max(1.0),
            lr_at(step, args)
        );
        if bar.is_hidden() && (step + 1) % LOG_EVERY == 0 {
            eprintln!("step {}: {msg}", step + 1);
        }
        bar.set_message(msg);
        bar.inc(1);
        if (step + 1) % args.eval_every == 0 || step + 1 == args.steps {
            decoder.set_mode(Mode::Inference);
            vision.set_mode(Mode::Inference);
            let acc = evaluate(&decoder, &vision, resampler.as_ref(), &cfg, &tok, &dev)?;
            // The same generator: the masks go on where they left off.
            decoder.set_mode(training.clone());
            vision.set_mode(training.clone());
            let secs = started.elapsed().as_secs_f64();
            bar.suspend(|| {
                eprintln!("step {} ({secs:.0}s): scene accuracy {acc:.3} on {EVAL_SCENES} held-out scenes", step + 1)
            });
        }
    }
    bar.finish();
    VlModel::save(&args.out, &cfg, &vars, &tok)?;
    // Check the directory loads and captions.
    let loaded = Captioner::load(&args.out, DType::F32, &dev)?;
    eprintln!(
        "wrote {} ({} s)",
        loaded.model.path.display(),
        started.elapsed().as_secs()
    );
    Ok(())
}

fn evaluate(
    decoder: &VisionLanguageDecoder,
    vision: &VisionEncoder,
    resampler: Option<&Resampler>,
    cfg: &VlConfig,
    tok: &vl::checkpoint::Tokenizer,
    dev: &Device,
) -> anyhow::Result<f64> {
    let spec = cfg.vision.as_ref().context("vision")?.pixel_spec();
    let batch = shapes::batch(EVAL_SEED, 0, EVAL_SCENES, &spec, dev)?;
    let memory = encode(vision, resampler, &batch.pixels)?.detach();
    let ctx = decoder.image_context(&memory, None)?;
    let gen = generate(
        decoder,
        &ctx,
        &vl::vl_decoder::GenerationConfig::greedy(&cfg.decoder, MAX_TOKENS),
        &mut |_| {},
    )?;
    let texts = gen
        .iter()
        .map(|g| {
            tok.decode(&g.tokens, true)
                .map_err(|e| anyhow::anyhow!("{e}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(scene_accuracy(texts.iter().zip(batch.scenes.iter())))
}

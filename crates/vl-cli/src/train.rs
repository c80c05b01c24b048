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
//!
//! `--gated` trains Flamingo's way: a tanh gate initialised at 0 on every
//! cross-attention branch and a gated feed-forward after it, so the first
//! steps train a text-only decoder and the image comes in as the gates
//! open. `--train-curve PNG` leaves the run's curve (loss, held-out scene
//! accuracy, gates) as a picture and as JSON.

use std::path::{Path, PathBuf};
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
use vl::{LoadOptions, VlConfig};

use crate::plot::{self, Axis, Legend, Panel, Series};

/// Train the shapes captioner.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Where to write the model directory.
    #[arg(long, default_value = "models/shapes-captioner")]
    pub out: PathBuf,
    /// Optimiser steps.
    #[arg(long, default_value_t = 9000)]
    pub steps: usize,
    /// Scenes per step.
    #[arg(long, default_value_t = 48)]
    pub batch_size: usize,
    /// Peak learning rate (linear warm-up, cosine decay).
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    /// Warm-up steps.
    #[arg(long, default_value_t = 200)]
    pub warmup: usize,
    /// Seed of the initial weights.
    #[arg(long, default_value_t = 0)]
    pub init_seed: u64,
    /// Seed of the training scenes (evaluation uses other seeds).
    #[arg(long, default_value_t = 1)]
    pub data_seed: u64,
    /// Evaluate scene accuracy on held-out scenes every this many steps.
    #[arg(long, default_value_t = 500)]
    pub eval_every: usize,
    /// Start from the weights of this model directory (same sizes) instead
    /// of fresh ones.
    #[arg(long, conflicts_with = "init_from")]
    pub resume: Option<PathBuf>,
    /// Start from the weights of this model directory wherever the new
    /// model has a tensor of the same name and shape (e.g. the shipped
    /// captioner's ViT and decoder under a fresh resampler); the others
    /// stay freshly initialised. A tensor of the same name and another
    /// shape is an error.
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// Width of the image and text streams.
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    /// Patch side of the image encoder, in pixels (divides 64).
    #[arg(long, default_value_t = 16)]
    pub patch: usize,
    /// Blocks of the encoder and of the decoder.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// Dropout probability in [0, 1) of the attention probabilities,
    /// residual branches and embeddings of the decoder and the ViT, during
    /// training.
    #[arg(long, default_value_t = 0.0, value_parser = parse_dropout)]
    pub dropout: f64,
    /// Seed of the dropout masks.
    #[arg(long, default_value_t = 0)]
    pub dropout_seed: u64,
    /// Put a resampler of this many learned queries between the ViT and
    /// the decoder (0: none), so that cross-attention reads that many image
    /// tokens instead of every patch.
    #[arg(long, default_value_t = 0)]
    pub resampler_queries: usize,
    /// Layers of the resampler.
    #[arg(long, default_value_t = 1)]
    pub resampler_depth: usize,
    /// Flamingo's gating: a tanh gate initialised at 0 on every
    /// cross-attention branch and a gated feed-forward after it, so that
    /// training starts from a text-only decoder.
    #[arg(long)]
    pub gated: bool,
    /// Write the run's curve — loss, held-out scene accuracy and, with
    /// `--gated`, each gate's tanh(alpha) over the steps — as this PNG,
    /// and its numbers as JSON beside it (the same name, `.json`).
    #[arg(long, value_name = "PNG")]
    pub train_curve: Option<PathBuf>,
}

impl Args {
    /// The defaults of `vl train-shapes` (the shipped captioner's recipe),
    /// for runs built in code.
    pub fn defaults() -> Self {
        #[derive(clap::Parser)]
        struct Defaults {
            #[command(flatten)]
            args: Args,
        }
        <Defaults as clap::Parser>::parse_from(["train-shapes"]).args
    }
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
pub const EVAL_SEED: u64 = 1_000_003;
/// Without a terminal, a progress line every this many steps.
const LOG_EVERY: usize = 50;
/// Scenes evaluated during training.
pub const EVAL_SCENES: usize = 200;
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

/// Every this many steps, the curve records the mean loss and the gates.
pub const CURVE_EVERY: usize = LOG_EVERY;

/// One point of a run's curve, every [`CURVE_EVERY`] steps and at the
/// last.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct LogPoint {
    /// Steps done.
    pub step: usize,
    /// Mean training loss over the steps since the previous point.
    pub loss: f64,
    /// Running (exponentially averaged) teacher-forced token accuracy.
    pub token_accuracy: f64,
    /// Seconds since the run started.
    pub seconds: f64,
    /// `tanh(alpha)` of each block's cross-attention gate (gated runs).
    pub cross_attention_gates: Vec<f32>,
    /// `tanh(alpha)` of each block's gated feed-forward (gated runs).
    pub cross_ffn_gates: Vec<f32>,
}

/// Held-out scene accuracy at one step.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EvalPoint {
    /// Steps done.
    pub step: usize,
    /// Seconds since the run started.
    pub seconds: f64,
    /// Scene accuracy on [`EVAL_SCENES`] held-out scenes (seed
    /// [`EVAL_SEED`]), greedy decoding.
    pub scene_accuracy: f64,
}

/// What a training run records: `--train-curve` writes it as JSON.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Curve {
    /// The run's name in plots.
    pub label: String,
    /// Steps of the run.
    pub steps: usize,
    /// Loss, token accuracy and gates over the steps.
    pub log: Vec<LogPoint>,
    /// Held-out scene accuracy over the steps.
    pub evals: Vec<EvalPoint>,
}

/// A finished run: its config, weights, tokenizer and curve.
pub struct Trained {
    /// The model directory's config.
    pub cfg: VlConfig,
    /// The trained weights.
    pub vars: VarMap,
    /// The shapes tokenizer.
    pub tok: vl::checkpoint::Tokenizer,
    /// The run's record.
    pub curve: Curve,
}

/// `tanh(alpha)` of each block's cross-attention gate and gated
/// feed-forward, in block order (empty lists when ungated).
pub fn gate_values(decoder: &VisionLanguageDecoder) -> anyhow::Result<(Vec<f32>, Vec<f32>)> {
    let tanh = |gate: &vl::vl_attn::TanhGate| -> anyhow::Result<f32> {
        let alpha = gate.alpha().flatten_all()?.to_vec1::<f32>()?;
        Ok(alpha.iter().map(|a| a.tanh()).sum::<f32>() / alpha.len().max(1) as f32)
    };
    let (mut attn, mut ffn) = (Vec::new(), Vec::new());
    for b in decoder.blocks() {
        if let Some(c) = b.cross_branch() {
            if let Some(g) = &c.gate {
                attn.push(tanh(g)?);
            }
            if let Some(f) = &c.ffn {
                ffn.push(tanh(&f.gate)?);
            }
        }
    }
    Ok((attn, ffn))
}

/// The model config of a run's flags.
fn config(args: &Args) -> anyhow::Result<VlConfig> {
    let mut cfg = shapes::captioner_config(args.hidden, args.layers, args.patch);
    cfg.decoder.attention_dropout = args.dropout;
    cfg.decoder.residual_dropout = args.dropout;
    cfg.decoder.embedding_dropout = args.dropout;
    cfg.decoder.gated_cross_attention = args.gated;
    cfg.decoder.gated_cross_ffn = args.gated;
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
    Ok(cfg)
}

/// Trains a captioner as `args` say and returns it with its curve; writes
/// nothing. `label` names the run in its curve.
pub fn train(args: &Args, label: &str) -> anyhow::Result<Trained> {
    let dev = Device::Cpu;
    let cfg = config(args)?;
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
    if let Some(dir) = &args.init_from {
        let (loaded, fresh, unused) = init_from(&vars, &dir.join(vl::checkpoint::WEIGHTS_FILE))?;
        eprintln!(
            "initialised {loaded} tensors from {}; fresh: {}; not used: {}",
            dir.display(),
            by_prefix(&fresh),
            by_prefix(&unused)
        );
    }
    let n_params: usize = vars.all_vars().iter().map(|v| v.elem_count()).sum();
    eprintln!("{label}: {n_params} parameters");

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
    let mut curve = Curve {
        label: label.to_string(),
        steps: args.steps,
        log: Vec::new(),
        evals: Vec::new(),
    };
    let (mut run_correct, mut run_total, mut window_loss) = (0f64, 0f64, 0f64);
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
        let loss = loss.to_scalar::<f32>()? as f64;
        window_loss += loss;
        run_correct = 0.98 * run_correct + hit.to_scalar::<f32>()? as f64;
        run_total = 0.98 * run_total + count.to_scalar::<f32>()? as f64;
        let token_accuracy = run_correct / run_total.max(1.0);
        let msg = format!(
            "loss {loss:.4} token acc {token_accuracy:.4} lr {:.2e}",
            lr_at(step, args)
        );
        if (step + 1) % CURVE_EVERY == 0 || step + 1 == args.steps {
            let (cross_attention_gates, cross_ffn_gates) = gate_values(&decoder)?;
            let window = step + 1 - curve.log.last().map_or(0, |p| p.step);
            curve.log.push(LogPoint {
                step: step + 1,
                loss: window_loss / window as f64,
                token_accuracy,
                seconds: started.elapsed().as_secs_f64(),
                cross_attention_gates,
                cross_ffn_gates,
            });
            window_loss = 0.0;
            if bar.is_hidden() {
                eprintln!("{label} step {}: {msg}", step + 1);
            }
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
            let seconds = started.elapsed().as_secs_f64();
            curve.evals.push(EvalPoint {
                step: step + 1,
                seconds,
                scene_accuracy: acc,
            });
            bar.suspend(|| {
                eprintln!(
                    "{label} step {} ({seconds:.0}s): scene accuracy {acc:.3} on {EVAL_SCENES} held-out scenes",
                    step + 1
                )
            });
        }
    }
    bar.finish();
    Ok(Trained {
        cfg,
        vars,
        tok,
        curve,
    })
}

/// Sets every variable of `vars` that `weights` holds under the same name;
/// returns how many were set, the names left fresh and the file's names
/// the model does not have (both sorted).
///
/// # Errors
/// The file unreadable, or a tensor whose shape differs from the
/// variable's, named with both shapes.
pub fn init_from(
    vars: &VarMap,
    weights: &Path,
) -> anyhow::Result<(usize, Vec<String>, Vec<String>)> {
    let mut tensors = candle_core::safetensors::load(weights, &Device::Cpu)
        .with_context(|| format!("--init-from {}", weights.display()))?;
    let data = vars
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("the variable map's lock is poisoned"))?;
    let (mut loaded, mut fresh) = (0, Vec::new());
    for (name, var) in data.iter() {
        match tensors.remove(name) {
            None => fresh.push(name.clone()),
            Some(t) => {
                anyhow::ensure!(
                    t.dims() == var.dims(),
                    "--init-from {}: tensor {name} has shape {:?}, the model's is {:?}",
                    weights.display(),
                    t.dims(),
                    var.dims()
                );
                var.set(&t.to_dtype(var.dtype())?)?;
                loaded += 1;
            }
        }
    }
    fresh.sort();
    let mut unused: Vec<String> = tensors.into_keys().collect();
    unused.sort();
    Ok((loaded, fresh, unused))
}

/// Names grouped by their first two components, with counts:
/// `resampler.layers (52), resampler.queries (1)`; `none` when empty.
fn by_prefix(names: &[String]) -> String {
    let mut groups: Vec<(String, usize)> = Vec::new();
    for n in names {
        let prefix: String = n.split('.').take(2).collect::<Vec<_>>().join(".");
        match groups.last_mut() {
            Some((p, c)) if *p == prefix => *c += 1,
            _ => groups.push((prefix, 1)),
        }
    }
    if groups.is_empty() {
        return "none".into();
    }
    groups
        .iter()
        .map(|(p, c)| format!("{p} ({c})"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Runs `vl train-shapes`: trains, evaluates, writes the model directory
/// (and the curve, when asked).
pub fn run(args: &Args) -> anyhow::Result<()> {
    let started = Instant::now();
    let label = if args.gated { "gated" } else { "train" };
    let trained = train(args, label)?;
    vl::checkpoint::native::save(&args.out, &trained.cfg, &trained.vars, &trained.tok)?;
    // Check the directory loads and captions.
    let loaded = Captioner::load(&args.out, &LoadOptions::default())?;
    eprintln!(
        "wrote {} ({} s)",
        loaded.model().path.display(),
        started.elapsed().as_secs()
    );
    if let Some(png) = &args.train_curve {
        write_curve(&[&trained.curve], png)?;
        eprintln!("wrote {} and its .json", png.display());
    }
    Ok(())
}

/// The panels of one or more runs' curves: training loss, held-out scene
/// accuracy and, when any run is gated, the gates' tanh(alpha).
pub fn curve_panels(curves: &[&Curve]) -> Vec<Panel> {
    let xy = |f: &dyn Fn(&LogPoint) -> f64, c: &Curve| -> Vec<(f64, f64)> {
        c.log.iter().map(|p| (p.step as f64, f(p))).collect()
    };
    let mut panels = vec![
        Panel {
            title: "training loss".into(),
            x: Axis::linear("step"),
            y: Axis::log(format!("cross-entropy, mean of {CURVE_EVERY} steps")),
            series: curves
                .iter()
                .map(|c| Series::new(c.label.clone(), xy(&|p| p.loss, c)))
                .collect(),
            legend: Legend::UpperRight,
        },
        Panel {
            title: format!("held-out scene accuracy ({EVAL_SCENES} scenes)"),
            x: Axis::linear("step"),
            y: Axis::linear("scene accuracy").range(0.0, 1.0),
            series: curves
                .iter()
                .map(|c| {
                    Series::new(
                        c.label.clone(),
                        c.evals
                            .iter()
                            .map(|e| (e.step as f64, e.scene_accuracy))
                            .collect(),
                    )
                })
                .collect(),
            legend: Legend::LowerRight,
        },
    ];
    let mut gates = Vec::new();
    for c in curves {
        let blocks = c.log.first().map_or(0, |p| p.cross_attention_gates.len());
        for b in 0..blocks {
            gates.push(Series::new(
                format!("{} block {b} attention", c.label),
                xy(&|p| p.cross_attention_gates[b] as f64, c),
            ));
        }
        let blocks = c.log.first().map_or(0, |p| p.cross_ffn_gates.len());
        for b in 0..blocks {
            gates.push(
                Series::new(
                    format!("{} block {b} ffn", c.label),
                    xy(&|p| p.cross_ffn_gates[b] as f64, c),
                )
                .dashed(),
            );
        }
    }
    if !gates.is_empty() {
        panels.push(Panel {
            title: "gates tanh(alpha), initialised at 0".into(),
            x: Axis::linear("step"),
            y: Axis::linear("tanh(alpha)"),
            series: gates,
            legend: Legend::LowerLeft,
        });
    }
    panels
}

/// Writes `curves` as `png` and their numbers as JSON beside it (`png`
/// with the extension `json`): one object for one run, a list for more.
pub fn write_curve(curves: &[&Curve], png: &Path) -> anyhow::Result<()> {
    let panels = curve_panels(curves);
    plot::write_png(png, &panels, panels.len(), (520, 400))?;
    let json = png.with_extension("json");
    let text = match curves {
        [one] => serde_json::to_string_pretty(one)?,
        many => serde_json::to_string_pretty(many)?,
    };
    std::fs::write(&json, text + "\n").with_context(|| format!("write {}", json.display()))
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

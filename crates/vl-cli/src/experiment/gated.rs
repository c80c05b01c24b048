//! `vl experiment gated`: the shapes captioner trained twice with the same
//! seeds, side by side — the shipped recipe, and the same with Flamingo's
//! zero-initialised tanh gates on every cross-attention branch and gated
//! feed-forward, for more steps (`--gated-steps`) — with
//! held-out scene accuracy and each gate's `tanh(alpha)` recorded over the
//! steps, and each final model's scene accuracy on 1000 fresh scenes.
//!
//! Writes `gated.json` (both curves, the final accuracies, when the gates
//! opened and when the accuracy rose) and `gated.png` (loss, accuracy and
//! gates against the steps), and the two model directories under
//! `--models`.
//!
//! At step 0 a gated model is a text-only decoder: `tanh(0) = 0` closes
//! every cross-attention branch, and the image can only come in as the
//! gates' own gradients move them.

use std::num::NonZeroUsize;
use std::path::PathBuf;

use vl::captioner::Captioner;
use vl::LoadOptions;

use super::{command_line, write_json, Output};
use crate::eval::{count_correct, EVAL_SEED};
use crate::train::{self, Curve};

/// Train gated and ungated captioners side by side.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    out: Output,
    /// Optimiser steps of the ungated run (the shipped recipe's).
    #[arg(long, default_value_t = 9000)]
    steps: usize,
    /// Optimiser steps of the gated run: with its gates closed at the
    /// start it needs more to reach the same accuracy.
    #[arg(long, default_value_t = 16000)]
    gated_steps: usize,
    /// Peak learning rate of the gated run (the ungated one keeps the
    /// recipe's 2e-3): behind a gate of tanh(alpha) ≈ 0.3, the branch's
    /// weights move the output that much less per step.
    #[arg(long, default_value_t = 3e-3)]
    gated_lr: f64,
    /// Held-out evaluation (200 scenes) every this many steps.
    #[arg(long, default_value_t = 500)]
    eval_every: usize,
    /// Scenes per step.
    #[arg(long, default_value_t = 48)]
    batch_size: usize,
    /// Fresh scenes of the final evaluation of each model.
    #[arg(long, default_value_t = 1000)]
    final_scenes: u64,
    /// Where the two model directories go (`ungated/`, `gated/`).
    #[arg(long, default_value = "target/experiments")]
    models: PathBuf,
}

/// A gate counts as open once `|tanh(alpha)|` passes this.
const OPEN: f32 = 0.1;
/// The accuracy counts as risen once it passes this.
const RISEN: f64 = 0.5;

/// One run's summary.
#[derive(Debug, serde::Serialize)]
struct Summary {
    label: String,
    model: PathBuf,
    final_scene_accuracy: f64,
    final_scenes: u64,
    final_seed: u64,
    /// First step with held-out accuracy ≥ [`RISEN`].
    accuracy_above_half_at: Option<usize>,
    /// First step with a cross-attention gate's `|tanh(alpha)|` ≥ [`OPEN`].
    first_gate_open_at: Option<usize>,
    seconds: f64,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    command: String,
    threads: usize,
    summaries: Vec<Summary>,
    curves: Vec<Curve>,
}

fn summarise(curve: &Curve, model: PathBuf, correct: u64, args: &Args) -> Summary {
    Summary {
        label: curve.label.clone(),
        model,
        final_scene_accuracy: correct as f64 / args.final_scenes.max(1) as f64,
        final_scenes: args.final_scenes,
        final_seed: EVAL_SEED,
        accuracy_above_half_at: curve
            .evals
            .iter()
            .find(|e| e.scene_accuracy >= RISEN)
            .map(|e| e.step),
        first_gate_open_at: curve
            .log
            .iter()
            .find(|p| p.cross_attention_gates.iter().any(|g| g.abs() >= OPEN))
            .map(|p| p.step),
        seconds: curve.log.last().map_or(0.0, |p| p.seconds),
    }
}

/// Trains one run (gated or not), saves it under `--models` and
/// evaluates it on the fresh scenes.
fn train_and_evaluate(args: &Args, gated: bool) -> anyhow::Result<(Summary, Curve)> {
    let label = if gated { "gated" } else { "ungated" };
    let mut run = train::Args::defaults();
    if gated {
        run.steps = args.gated_steps;
        run.lr = args.gated_lr;
    } else {
        run.steps = args.steps;
    }
    run.eval_every = args.eval_every;
    run.batch_size = args.batch_size;
    run.gated = gated;
    run.out = args.models.join(label);
    let trained = train::train(&run, label)?;
    vl::checkpoint::native::save(&run.out, &trained.cfg, &trained.vars, &trained.tok)?;
    let captioner = Captioner::load(&run.out, &LoadOptions::default())?;
    let batch = NonZeroUsize::new(100).expect("100 > 0");
    let correct = count_correct(
        &captioner,
        EVAL_SEED,
        args.final_scenes,
        batch,
        &mut |_, _, _| {},
    )?;
    let summary = summarise(&trained.curve, run.out.clone(), correct, args);
    eprintln!(
        "{label}: scene accuracy {:.3} on {} fresh scenes (seed {EVAL_SEED}); accuracy ≥ {RISEN} at step {:?}, first gate ≥ {OPEN} at step {:?}",
        summary.final_scene_accuracy,
        args.final_scenes,
        summary.accuracy_above_half_at,
        summary.first_gate_open_at,
    );
    Ok((summary, trained.curve))
}

/// Runs `vl experiment gated`.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let (json, png) = args.out.paths("gated")?;
    // The two runs train side by side, each on its own thread (candle's
    // products share the process's pool; `--threads 1` gives each run one
    // core on a 2-core machine).
    let runs = std::thread::scope(|scope| {
        let handles: Vec<_> = [false, true]
            .into_iter()
            .map(|gated| scope.spawn(move || train_and_evaluate(args, gated)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a training thread panicked")))
            })
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    let (summaries, curves): (Vec<Summary>, Vec<Curve>) = runs.into_iter().unzip();
    let refs: Vec<&Curve> = curves.iter().collect();
    let panels = train::curve_panels(&refs);
    crate::plot::write_png(&png, &panels, panels.len(), (560, 420))?;
    write_json(
        &json,
        &Report {
            command: command_line(),
            threads: candle_core::utils::get_num_threads(),
            summaries,
            curves,
        },
    )?;
    println!("wrote {} and {}", json.display(), png.display());
    Ok(())
}

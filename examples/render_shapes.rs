//! Draws scenes of the shapes world as PNGs, with their true captions.
//!
//! `cargo run --release --example render_shapes -- --out DIR --count 8 --seed 7`
//!
//! Writes `DIR/scene_NNNN.png` and prints `file<TAB>caption` lines.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use vl::vl_shapes::dataset_scene;

/// Draw shapes-world scenes.
#[derive(Parser, Debug)]
struct Args {
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Scenes to draw.
    #[arg(long, default_value_t = 8)]
    count: u64,
    /// Dataset seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.out).with_context(|| args.out.display().to_string())?;
    for i in 0..args.count {
        let scene = dataset_scene(args.seed, i);
        let file = args.out.join(format!("scene_{i:04}.png"));
        scene
            .render()
            .save(&file)
            .with_context(|| file.display().to_string())?;
        println!("{}\t{}", file.display(), scene.caption());
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

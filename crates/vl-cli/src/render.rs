//! Draws scenes of the shapes world as PNGs, with their true captions.
//!
//! `vl render-shapes --out DIR --count 8 --seed 7`
//!
//! Writes `DIR/scene_NNNN.png` and prints `file<TAB>caption` lines.

use std::path::PathBuf;

use anyhow::Context;
use vl::vl_shapes::dataset_scene;

/// Draw shapes-world scenes.
#[derive(clap::Args, Debug)]
pub struct Args {
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

/// Runs `vl render-shapes`: writes the PNGs, prints `file<TAB>caption` lines.
pub fn run(args: &Args) -> anyhow::Result<()> {
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

//! `vl experiment`: the claims of vl's design, each reproduced by one
//! seeded command that writes its numbers as JSON and its picture as PNG
//! (into `--out-dir`, `docs/experiments` by default):
//!
//! - [`gated`]: training from zero-initialised tanh gates converges; the
//!   gates leave 0 and the accuracy rises after them.
//! - [`diversity`]: dropout on the cross-attention map at sampling time
//!   makes sampled captions more diverse, at a cost in accuracy.
//! - [`cost`]: cross-attention's cost grows with the image's tokens and
//!   overtakes self-attention over the text; what the image K/V cache and
//!   a resampler buy.

use std::path::{Path, PathBuf};

use anyhow::Context;

pub mod cost;
pub mod diversity;
pub mod gated;

/// Run one of vl's experiments.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    which: Which,
}

#[derive(clap::Subcommand, Debug)]
enum Which {
    /// Train with zero-initialised tanh gates next to the ungated recipe;
    /// plot accuracy and gates over the steps.
    Gated(gated::Args),
    /// Sample captions at several rates of cross-attention-map dropout;
    /// plot distinct captions per image and scene accuracy.
    Diversity(diversity::Args),
    /// Time and count cross- and self-attention as the image grid grows.
    Cost(cost::Args),
}

/// Where an experiment writes its JSON and PNG.
#[derive(clap::Args, Debug, Clone)]
pub struct Output {
    /// Directory of the JSON and PNG files.
    #[arg(long, default_value = "docs/experiments")]
    pub out_dir: PathBuf,
}

impl Output {
    /// `name.json` and `name.png` in the output directory, created.
    pub fn paths(&self, name: &str) -> anyhow::Result<(PathBuf, PathBuf)> {
        std::fs::create_dir_all(&self.out_dir)
            .with_context(|| format!("create --out-dir {}", self.out_dir.display()))?;
        Ok((
            self.out_dir.join(format!("{name}.json")),
            self.out_dir.join(format!("{name}.png")),
        ))
    }
}

/// Writes `value` as pretty JSON to `path`.
pub fn write_json(path: &Path, value: &impl serde::Serialize) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("write {}", path.display()))
}

/// The command line that produced an experiment's files, for its JSON.
fn command_line() -> String {
    let args: Vec<String> = std::env::args().collect();
    let tail = args
        .iter()
        .position(|a| a == "experiment")
        .map_or(&args[..0], |i| &args[i..]);
    format!("vl {}", tail.join(" "))
}

/// Runs `vl experiment …`.
pub fn run(args: &Args) -> anyhow::Result<()> {
    match &args.which {
        Which::Gated(a) => gated::run(a),
        Which::Diversity(a) => diversity::run(a),
        Which::Cost(a) => cost::run(a),
    }
}

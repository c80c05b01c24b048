//! What cross-attention costs next to self-attention at one image size —
//! width 768, 12 heads, a text of Nt = 64 tokens, an image of Nv = 576
//! tokens (a 24 × 24 grid), a resampler of 32 queries — as a table of
//! FLOPs and median times, for the prefill and for one decode step.
//!
//! `cargo run --release --example attention_cost [-- --repeats 20]`
//!
//! The same as `vl experiment cost --grids 24` (see
//! `vl_cli::experiment::cost`), writing its JSON and plot under
//! `target/experiments/`; `vl experiment cost` sweeps the grid from 7 × 7
//! to 32 × 32.

use std::process::ExitCode;

fn main() -> ExitCode {
    let fixed = [
        "vl",
        "experiment",
        "cost",
        "--grids",
        "24",
        "--out-dir",
        "target/experiments",
    ];
    let args = fixed
        .iter()
        .map(|a| a.to_string())
        .chain(std::env::args().skip(1));
    vl_cli::main_with(args)
}

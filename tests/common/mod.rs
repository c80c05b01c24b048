//! What the CLI tests share: the built `caption` binary, a tiny model
//! directory, rendered images.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use vl::shapes;
use vl::vl_decoder::init::seeded_init;
use vl::vl_decoder::{VisionEncoder, VisionLanguageDecoder, VlModel};

/// The built `caption` example: `cargo test` builds examples next to the
/// test binaries' `deps` directory.
pub fn caption_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    dir.join("examples")
        .join(format!("caption{}", std::env::consts::EXE_SUFFIX))
}

/// A tiny randomly initialised (seeded) shapes captioner in `dir`.
pub fn tiny_model(dir: &Path) {
    let cfg = shapes::captioner_config(16, 1, 8);
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    VisionLanguageDecoder::load(vb.pp("decoder"), &cfg.decoder).expect("decoder");
    VisionEncoder::load(vb.pp("vision"), cfg.vision.as_ref().expect("vision")).expect("vision");
    seeded_init(&vars, 0).expect("init");
    VlModel::save(dir, &cfg, &vars, &shapes::tokenizer().expect("tokenizer")).expect("save");
}

/// `n` rendered shapes scenes as `img{i}.png` in `dir`.
pub fn images(dir: &Path, n: u64) -> Vec<PathBuf> {
    std::fs::create_dir_all(dir).expect("mkdir");
    (0..n)
        .map(|i| {
            let p = dir.join(format!("img{i}.png"));
            vl::vl_shapes::dataset_scene(99, i)
                .render()
                .save(&p)
                .expect("png");
            p
        })
        .collect()
}

/// Runs the CLI to completion.
pub fn run(args: &[&str]) -> Output {
    Command::new(caption_bin())
        .args(args)
        .output()
        .expect("run caption")
}

/// A path as a CLI argument.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

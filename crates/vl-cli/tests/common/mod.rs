//! What the CLI tests share: the built `vl` binary, a tiny model
//! directory, rendered images.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use vl::shapes;
use vl::vl_decoder::init::seeded_init;
use vl::vl_decoder::VisionLanguageDecoder;
use vl::vl_vision::VisionEncoder;

/// Asserts `out` exited 0 (showing its stderr otherwise) and returns its
/// stdout.
pub fn ok(out: &Output) -> String {
    assert_eq!(
        out.status.code(),
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).expect("utf-8 stdout")
}

/// The built `vl` binary (cargo builds it for this package's tests).
pub fn vl_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_vl"))
}

/// `vl caption`, ready for its arguments.
pub fn caption_cmd() -> Command {
    let mut cmd = Command::new(vl_bin());
    cmd.arg("caption");
    cmd
}

/// The repository's root, where `models/` and `tests/fixtures/` are.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A tiny randomly initialised (seeded) shapes captioner in `dir`.
pub fn tiny_model(dir: &Path) {
    let cfg = shapes::captioner_config(16, 1, 8);
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    VisionLanguageDecoder::load(vb.pp("decoder"), &cfg.decoder).expect("decoder");
    VisionEncoder::load(vb.pp("vision"), cfg.vision.as_ref().expect("vision")).expect("vision");
    seeded_init(&vars, 0).expect("init");
    vl::checkpoint::native::save(dir, &cfg, &vars, &shapes::tokenizer().expect("tokenizer"))
        .expect("save");
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
    caption_cmd().args(args).output().expect("run caption")
}

/// The shipped samples (their paths) and their true captions.
pub fn samples() -> Vec<(String, String)> {
    let dir = repo_root().join("models/shapes-captioner/samples");
    std::fs::read_to_string(dir.join("captions.tsv"))
        .expect("captions.tsv")
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .map(|(f, c)| (s(&dir.join(f)).to_string(), c.to_string()))
        .collect()
}

/// The `"caption"` of each JSON line of `vl caption --json`'s output.
pub fn captions(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            v["caption"].as_str().expect("caption").to_string()
        })
        .collect()
}

/// A path as a CLI argument.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

//! `vl experiment …` and `vl train-shapes --train-curve/--gated/--init-from`
//! on tiny settings: each writes its JSON and a PNG, and the numbers in the
//! JSON say what the experiment is about (gates leave 0, cross-attention
//! FLOPs grow with the image and overtake self-attention, dropout on the
//! cross-attention map changes the samples).
#![allow(missing_docs)]

mod common;

use std::path::Path;
use std::process::Command;

use common::{ok, s, vl_bin};
use vl_cli::experiment::cost::{attention_flops, TEXT};

fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("json")
}

/// A PNG of at least `w × h` pixels with more than a handful of colours.
fn assert_plot(path: &Path, w: u32, h: u32) {
    let img = image::open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .to_rgb8();
    assert!(
        img.width() >= w && img.height() >= h,
        "{:?}",
        img.dimensions()
    );
    let colours: std::collections::HashSet<_> = img.pixels().map(|p| p.0).collect();
    assert!(
        colours.len() > 10,
        "{}: {} colours",
        path.display(),
        colours.len()
    );
}

/// `vl experiment cost` on two small grids: every row of both phases, FLOPs
/// as the formula gives them, cross-attention growing with the image, the
/// cache cutting the uncached call's FLOPs; the table printed, the plot
/// written.
#[test]
fn cost_experiment() {
    let tmp = tempfile::tempdir().expect("tmp");
    let out = Command::new(vl_bin())
        .args(["experiment", "cost", "--grids", "2,6", "--repeats", "1"])
        .args(["--out-dir", s(tmp.path())])
        .output()
        .expect("run");
    let stdout = ok(&out);
    assert!(stdout.contains("Nv = 36 (6×6), decode step"), "{stdout}");
    let report = json(&tmp.path().join("cost.json"));
    let measures = report["measures"].as_array().expect("measures");
    // Per grid: 5 prefill rows (resampler included) and 4 decode-step rows.
    assert_eq!(measures.len(), 18, "{report}");
    let find = |row: &str, phase: &str, nv: u64| -> &serde_json::Value {
        measures
            .iter()
            .find(|m| m["row"] == row && m["phase"] == phase && m["image_tokens"] == nv)
            .unwrap_or_else(|| panic!("{row} {phase} {nv}"))
    };
    let flops = |row, phase, nv| find(row, phase, nv)["flops"].as_f64().expect("flops");
    assert_eq!(
        flops("cross_cached", "prefill", 36),
        attention_flops(TEXT, 36, 0)
    );
    assert_eq!(
        flops("self_attention", "decode step", 4),
        attention_flops(1, TEXT, 1)
    );
    for phase in ["prefill", "decode step"] {
        assert!(flops("cross_uncached", phase, 36) > flops("cross_uncached", phase, 4));
        assert!(flops("cross_cached", phase, 36) < flops("cross_uncached", phase, 36));
    }
    for m in measures {
        let ms = m["ms"].as_f64().expect("ms");
        assert!(ms.is_finite() && ms > 0.0, "{m}");
    }
    assert_plot(&tmp.path().join("cost.png"), 1000, 700);
}

/// The FLOPs of cached cross-attention over Nv image tokens overtake those
/// of self-attention over the 64 text tokens once Nv passes 64 + the
/// projections' share: at a 24×24 grid they are far above.
#[test]
fn cross_attention_overtakes_self_attention() {
    let self_attn = attention_flops(TEXT, TEXT, TEXT);
    let cross = |nv| attention_flops(TEXT, nv, 0);
    assert!(cross(49) < self_attn);
    assert!(cross(576 * 4) > self_attn);
    // Linear in Nv at a fixed text.
    let slope = cross(200) - cross(100);
    assert_eq!(cross(300) - cross(200), slope);
}

/// `vl experiment diversity` on the embedded captioner, 3 scenes, 4
/// samples, rates 0 and 0.6: one point per rate, counts within their
/// bounds, the samples of rate 0.6 not all those of rate 0.
#[test]
fn diversity_experiment() {
    let tmp = tempfile::tempdir().expect("tmp");
    let out = Command::new(vl_bin())
        .args(["experiment", "diversity", "--images", "3", "--samples", "4"])
        .args(["--rates", "0,0.6", "--out-dir", s(tmp.path())])
        .output()
        .expect("run");
    ok(&out);
    let report = json(&tmp.path().join("diversity.json"));
    let points = report["points"].as_array().expect("points");
    assert_eq!(points.len(), 2, "{report}");
    for p in points {
        let distinct = p["distinct_captions"].as_f64().expect("distinct");
        assert!((1.0..=4.0).contains(&distinct), "{p}");
        let acc = p["scene_accuracy"].as_f64().expect("accuracy");
        assert!((0.0..=1.0).contains(&acc), "{p}");
        assert_eq!(p["example"].as_array().map(Vec::len), Some(4), "{p}");
    }
    assert_ne!(points[0]["example"], points[1]["example"], "{report}");
    assert_plot(&tmp.path().join("diversity.png"), 1000, 400);

    let bad = Command::new(vl_bin())
        .args(["experiment", "diversity", "--images", "1", "--samples", "1"])
        .args(["--rates", "1.5", "--out-dir", s(tmp.path())])
        .output()
        .expect("run");
    assert_eq!(bad.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("--rates 1.5"), "{stderr}");
}

/// `vl experiment gated` for a few steps: both runs in the JSON, the gated
/// one's gates recorded (two blocks, attention and feed-forward) and moved
/// off 0, the ungated one without gates; both models written; the plot has
/// three panels.
#[test]
fn gated_experiment() {
    let tmp = tempfile::tempdir().expect("tmp");
    let out = Command::new(vl_bin())
        .args([
            "experiment",
            "gated",
            "--steps",
            "12",
            "--gated-steps",
            "12",
        ])
        .args(["--eval-every", "6"])
        .args(["--batch-size", "4", "--final-scenes", "10"])
        .args([
            "--out-dir",
            s(tmp.path()),
            "--models",
            s(&tmp.path().join("m")),
        ])
        .output()
        .expect("run");
    ok(&out);
    let report = json(&tmp.path().join("gated.json"));
    let curves = report["curves"].as_array().expect("curves");
    assert_eq!(curves.len(), 2, "{report}");
    assert_eq!(curves[0]["label"], "ungated");
    assert_eq!(curves[1]["label"], "gated");
    for c in curves {
        assert_eq!(c["evals"].as_array().map(Vec::len), Some(2), "{c}");
        // A point at the last step even though 12 < CURVE_EVERY.
        assert_eq!(c["log"][0]["step"], 12, "{c}");
    }
    assert_eq!(
        curves[0]["log"][0]["cross_attention_gates"],
        serde_json::json!([])
    );
    let gates = curves[1]["log"][0]["cross_attention_gates"]
        .as_array()
        .expect("gates");
    assert_eq!(gates.len(), 2, "{report}");
    assert!(
        gates.iter().all(|g| g.as_f64().expect("gate") != 0.0),
        "{report}"
    );
    assert_eq!(
        curves[1]["log"][0]["cross_ffn_gates"]
            .as_array()
            .map(Vec::len),
        Some(2)
    );
    for label in ["ungated", "gated"] {
        assert!(tmp
            .path()
            .join("m")
            .join(label)
            .join("config.json")
            .exists());
    }
    let summaries = report["summaries"].as_array().expect("summaries");
    assert_eq!(summaries[1]["final_scenes"], 10);
    assert_plot(&tmp.path().join("gated.png"), 1500, 400);
}

/// `train-shapes --train-curve` writes the PNG and the JSON beside it;
/// `--init-from` a model of the same sizes under a fresh resampler loads
/// its tensors, and a model of other sizes is refused naming a tensor and
/// both shapes.
#[test]
fn train_curve_and_init_from() {
    let tmp = tempfile::tempdir().expect("tmp");
    let small = ["--steps", "3", "--warmup", "1", "--batch-size", "2"];
    let sizes = ["--hidden", "16", "--layers", "1"];
    let base = tmp.path().join("base");
    let curve = tmp.path().join("curve.png");
    let out = Command::new(vl_bin())
        .args([
            "train-shapes",
            "--out",
            s(&base),
            "--train-curve",
            s(&curve),
        ])
        .args(small)
        .args(sizes)
        .args(["--gated"])
        .output()
        .expect("run");
    ok(&out);
    assert_plot(&curve, 1500, 400);
    let c = json(&curve.with_extension("json"));
    assert_eq!(c["steps"], 3, "{c}");
    assert_eq!(
        c["log"][0]["cross_attention_gates"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );

    let out = Command::new(vl_bin())
        .args([
            "train-shapes",
            "--out",
            s(&tmp.path().join("res")),
            "--init-from",
            s(&base),
        ])
        .args(small)
        .args(sizes)
        .args(["--gated", "--resampler-queries", "2"])
        .output()
        .expect("run");
    ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("fresh: resampler.layers (") && stderr.contains("not used: none"),
        "{stderr}"
    );

    let out = Command::new(vl_bin())
        .args([
            "train-shapes",
            "--out",
            s(&tmp.path().join("wide")),
            "--init-from",
            s(&base),
        ])
        .args(small)
        .args(["--hidden", "32", "--layers", "1", "--gated"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--init-from")
            && stderr.contains("has shape [")
            && stderr.contains("the model's is ["),
        "{stderr}"
    );
}

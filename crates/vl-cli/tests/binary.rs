//! The installed `vl` binary: the embedded captioner from any directory,
//! sharded runs equal to the unsharded one, lists of inputs, subcommands.
#![allow(missing_docs)]

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use common::{caption_cmd, images, ok, s, samples, tiny_model, vl_bin};

#[test]
fn the_embedded_captioner_works_from_an_empty_directory() {
    let empty = tempfile::tempdir().expect("tmp");
    let (image, want) = samples().into_iter().next().expect("a sample");
    let out = caption_cmd()
        .arg(&image)
        .current_dir(empty.path())
        .output()
        .expect("run vl");
    assert_eq!(ok(&out).trim(), want);
    // JSON output too, and nothing is written to the working directory.
    let out = caption_cmd()
        .args(["--json", &image])
        .current_dir(empty.path())
        .output()
        .expect("run vl");
    let line: serde_json::Value = serde_json::from_str(ok(&out).trim()).expect("json");
    assert_eq!(line["caption"], want.as_str());
    assert_eq!(std::fs::read_dir(empty.path()).expect("ls").count(), 0);
}

#[test]
fn shards_concatenate_to_the_unsharded_run() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    tiny_model(&model);
    let dir = tmp.path().join("imgs");
    images(&dir, 7);
    // A bad file among them is reported in exactly one shard too.
    std::fs::write(dir.join("img3b.png"), b"not a png").expect("write");
    let base = ["--model", s(&model), "--json", "--max-tokens", "4"];
    let whole = caption_cmd().args(base).arg(s(&dir)).output().expect("run");
    assert_eq!(whole.status.code(), Some(1));
    let whole = String::from_utf8(whole.stdout).expect("utf-8");
    assert_eq!(whole.lines().count(), 8);
    for n in [1, 3, 8] {
        let mut joined = String::new();
        for i in 0..n {
            let out = caption_cmd()
                .args(base)
                .args(["--shard", &format!("{i}/{n}"), s(&dir)])
                .output()
                .expect("run");
            joined.push_str(&String::from_utf8(out.stdout).expect("utf-8"));
        }
        let mut a: Vec<&str> = joined.lines().collect();
        let mut b: Vec<&str> = whole.lines().collect();
        // Errors come first within each run; compare as sets of lines, and
        // the captions in order.
        let captions = |v: &[&str]| -> Vec<String> {
            v.iter()
                .filter(|l| l.contains("caption"))
                .map(|l| l.to_string())
                .collect()
        };
        assert_eq!(captions(&a), captions(&b), "{n} shards");
        a.sort();
        b.sort();
        assert_eq!(a, b, "{n} shards");
    }
    // A shard index past the count is a usage error naming the flag.
    let out = caption_cmd()
        .args(base)
        .args(["--shard", "3/3", s(&dir)])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--shard") && err.contains("below the count"),
        "{err}"
    );
}

#[test]
fn files_from_a_list_or_stdin() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    tiny_model(&model);
    let imgs = images(&tmp.path().join("imgs"), 3);
    let list = tmp.path().join("list.txt");
    let text = format!("# images\n{}\n\n{}\n", s(&imgs[0]), s(&imgs[2]));
    std::fs::write(&list, &text).expect("write");
    let base = ["--model", s(&model), "--json", "--max-tokens", "4"];
    let out = caption_cmd()
        .args(base)
        .args(["--files-from", s(&list), s(&imgs[1])])
        .output()
        .expect("run");
    let got: Vec<String> = ok(&out)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            v["image"].as_str().expect("image").to_string()
        })
        .collect();
    assert_eq!(got, [s(&imgs[1]), s(&imgs[0]), s(&imgs[2])]);

    let mut child = caption_cmd()
        .args(base)
        .args(["--files-from", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write stdin");
    let out = child.wait_with_output().expect("wait");
    assert_eq!(ok(&out).lines().count(), 2);

    let out = caption_cmd()
        .args(base)
        .args(["--files-from", s(&tmp.path().join("nope.txt"))])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--files-from"));
}

#[test]
fn threads_flag_runs_and_zero_is_refused() {
    let (image, want) = samples().into_iter().next().expect("a sample");
    let out = Command::new(vl_bin())
        .args(["caption", "--threads", "1", &image])
        .output()
        .expect("run");
    assert_eq!(ok(&out).trim(), want);
    let out = Command::new(vl_bin())
        .args(["caption", "--threads", "0", &image])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--threads"));
}

#[test]
fn render_then_eval_with_the_subcommands() {
    let tmp = tempfile::tempdir().expect("tmp");
    let out = Command::new(vl_bin())
        .args([
            "render-shapes",
            "--out",
            s(tmp.path()),
            "--count",
            "3",
            "--seed",
            "5",
        ])
        .output()
        .expect("run");
    let listed = ok(&out);
    assert_eq!(listed.lines().count(), 3);
    assert!(Path::new(&tmp.path().join("scene_0000.png")).is_file());
    // The embedded captioner on 20 fresh scenes: one JSON line.
    let out = Command::new(vl_bin())
        .args(["eval-shapes", "--n", "20", "--batch-size", "10"])
        .output()
        .expect("run");
    let line: serde_json::Value = serde_json::from_str(ok(&out).trim()).expect("json");
    assert_eq!(line["n"], 20);
    assert!(
        line["scene_accuracy"].as_f64().expect("accuracy") >= 0.8,
        "{line}"
    );
    let out = Command::new(vl_bin())
        .args(["eval-shapes", "--batch-size", "0"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--batch-size"));
}

/// `train-shapes --dropout P`: out of [0, 1) is a usage error naming the
/// flag; a short run with dropout writes the probabilities into the model's
/// config (evaluation runs without them).
#[test]
fn train_shapes_with_dropout() {
    for bad in ["1", "-0.5", "x"] {
        let out = Command::new(vl_bin())
            .args(["train-shapes", &format!("--dropout={bad}")])
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(2), "{bad}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("--dropout"),
            "{bad}"
        );
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    let out = Command::new(vl_bin())
        .args([
            "train-shapes",
            "--out",
            s(&model),
            "--steps",
            "2",
            "--warmup",
            "1",
            "--batch-size",
            "2",
            "--hidden",
            "16",
            "--layers",
            "1",
            "--dropout",
            "0.25",
        ])
        .output()
        .expect("run");
    ok(&out);
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model.join("config.json")).expect("config.json"),
    )
    .expect("json");
    for field in ["attention_dropout", "residual_dropout", "embedding_dropout"] {
        assert_eq!(cfg["decoder"][field], 0.25, "{field}: {cfg}");
    }
    for field in ["attention_dropout", "hidden_dropout"] {
        assert_eq!(cfg["vision"][field], 0.25, "{field}: {cfg}");
    }
}

/// `train-shapes --resampler-queries`: the model directory it writes has
/// the resampler, loads, and captions through it.
#[test]
fn train_shapes_with_a_resampler() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    let out = Command::new(vl_bin())
        .args([
            "train-shapes",
            "--out",
            s(&model),
            "--steps",
            "2",
            "--warmup",
            "1",
            "--batch-size",
            "2",
            "--hidden",
            "16",
            "--layers",
            "1",
            "--patch",
            "8",
            "--resampler-queries",
            "4",
            "--resampler-depth",
            "2",
        ])
        .output()
        .expect("run");
    ok(&out);
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model.join("config.json")).expect("config.json"),
    )
    .expect("json");
    assert_eq!(cfg["resampler"]["num_queries"], 4, "{cfg}");
    assert_eq!(cfg["resampler"]["depth"], 2, "{cfg}");
    let (image, _) = samples().into_iter().next().expect("a sample");
    let out = caption_cmd()
        .args(["--model", s(&model), "--json", "--max-tokens", "3", &image])
        .output()
        .expect("run");
    let line: serde_json::Value = serde_json::from_str(ok(&out).trim()).expect("json");
    assert!(line["caption"].is_string(), "{line}");
}

//! Batch captioning loses nothing: a folder with corrupt files among good
//! ones, and `--output FILE.jsonl` resuming after a kill.
#![allow(missing_docs)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{caption_cmd, run, s, tiny_model};

/// Writes `n` images into `dir`; every 20th (starting at 7) is corrupt, in
/// turn truncated, garbage, empty, or text. Returns (good, bad) paths.
fn folder(dir: &Path, n: usize) -> (Vec<PathBuf>, Vec<PathBuf>) {
    std::fs::create_dir_all(dir).expect("mkdir");
    let mut png = Vec::new();
    vl::vl_shapes::dataset_scene(3, 0)
        .render()
        .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
        .expect("png");
    let (mut good, mut bad) = (Vec::new(), Vec::new());
    for i in 0..n {
        let p = dir.join(format!("img{i:04}.png"));
        if i % 20 == 7 {
            let bytes: Vec<u8> = match (i / 20) % 4 {
                0 => png[..png.len() / 2].to_vec(),
                1 => (0..512u32)
                    .map(|k| (k.wrapping_mul(2_654_435_761) >> 13) as u8)
                    .collect(),
                2 => Vec::new(),
                _ => b"not an image at all\n".to_vec(),
            };
            std::fs::write(&p, bytes).expect("write");
            bad.push(p);
        } else {
            std::fs::write(&p, &png).expect("write");
            good.push(p);
        }
    }
    (good, bad)
}

/// The results file as image → line; panics on a duplicate or a line that
/// is not a complete result.
fn results(path: &Path) -> BTreeMap<String, serde_json::Value> {
    let text = std::fs::read_to_string(path).expect("results");
    assert!(text.ends_with('\n'), "the last line is unfinished");
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        let image = v["image"].as_str().expect("image").to_string();
        assert!(
            v.get("caption").is_some() || v.get("error").is_some(),
            "{line}"
        );
        assert!(out.insert(image.clone(), v).is_none(), "{image} twice");
    }
    out
}

#[test]
fn a_thousand_images_with_fifty_corrupt_lose_nothing() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    tiny_model(&model);
    let dir = tmp.path().join("imgs");
    let (good, bad) = folder(&dir, 1000);
    assert_eq!(bad.len(), 50);
    let jsonl = tmp.path().join("out.jsonl");
    let out = run(&[
        "--model",
        s(&model),
        "--json",
        "--max-tokens",
        "2",
        "--batch-size",
        "32",
        "--output",
        s(&jsonl),
        s(&dir),
    ]);
    assert_eq!(out.status.code(), Some(1), "some inputs failed: exit 1");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.lines().count(),
        50,
        "one line per bad image:\n{stderr}"
    );
    for p in &bad {
        assert!(stderr.contains(s(p)), "{} not reported", p.display());
    }
    assert!(!stderr.to_lowercase().contains("panicked"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().count(), 1000);
    let file = results(&jsonl);
    assert_eq!(file.len(), 1000);
    for p in &good {
        assert!(file[s(p)].get("caption").is_some(), "{}", p.display());
    }
    for p in &bad {
        assert!(file[s(p)].get("error").is_some(), "{}", p.display());
    }
}

#[test]
fn output_resumes_after_a_kill() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    tiny_model(&model);
    let dir = tmp.path().join("imgs");
    let (good, bad) = folder(&dir, 300);
    let jsonl = tmp.path().join("out.jsonl");
    let args = [
        "--model",
        s(&model),
        "--max-tokens",
        "8",
        "--beams",
        "3",
        "--batch-size",
        "1",
        "--output",
        s(&jsonl),
        s(&dir),
    ];

    // Kill the first run once some results are in.
    let mut child = caption_cmd()
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        let lines = std::fs::read_to_string(&jsonl).map_or(0, |t| t.lines().count());
        if lines >= 40 || child.try_wait().expect("wait").is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = child.kill();
    let _ = child.wait();
    let first = std::fs::read_to_string(&jsonl).expect("results");
    // Only complete lines count (the kill may have cut the last one).
    let first = &first[..first.rfind('\n').map_or(0, |i| i + 1)];
    // A kill in the middle of a write leaves half a line: simulate one.
    std::fs::write(&jsonl, format!("{first}{{\"image\": \"{}", s(&good[0]))).expect("write");

    let out = run(&args);
    assert_eq!(out.status.code(), Some(1), "the corrupt files fail");
    let file = results(&jsonl);
    assert_eq!(file.len(), 300, "every image exactly once");
    for p in &bad {
        assert!(file[s(p)].get("error").is_some());
    }
    // Nothing the first run finished was done again.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unfinished last line"), "{stderr}");
    assert_eq!(
        stderr.lines().filter(|l| l.starts_with("error:")).count(),
        bad.len() - first.lines().filter(|l| l.contains("\"error\"")).count(),
        "{stderr}"
    );

    // A third run has nothing left to do.
    let out = run(&args);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(results(&jsonl).len(), 300);
}

#[test]
fn output_refuses_a_file_that_is_not_results() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    tiny_model(&model);
    let (good, _) = folder(&tmp.path().join("imgs"), 2);
    let jsonl = tmp.path().join("notes.txt");
    std::fs::write(&jsonl, "my notes\n").expect("write");
    let out = run(&["--model", s(&model), "--output", s(&jsonl), s(&good[0])]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("notes.txt") && stderr.contains("line 1") && stderr.lines().count() == 1,
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&jsonl).expect("read"), "my notes\n");
}

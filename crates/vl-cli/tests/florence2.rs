//! `vl caption --task` on a Florence-2 checkpoint (the tiny transformers
//! fixture): the task's output under the processor's key in `--json`, the
//! drawn PNGs of `--draw`, heatmaps of a text task, and the refusals that
//! name the flag.
#![allow(missing_docs)]

mod common;

use common::{images, ok, repo_root, run, s, tiny_model};

fn florence() -> std::path::PathBuf {
    repo_root().join("tests/fixtures/florence2/tiny-a")
}

#[test]
fn tasks_print_their_output_under_the_processors_key() {
    let model = florence();
    let tmp = tempfile::tempdir().expect("tmp");
    let drawn = tmp.path().join("drawn");
    let (a, b) = (model.join("image.png"), model.join("other.png"));
    let out = ok(&run(&[
        "--model",
        s(&model),
        "--task",
        "od",
        "--json",
        "--draw",
        s(&drawn),
        "--max-tokens",
        "8",
        s(&a),
        s(&b),
    ]));
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(lines.len(), 2);
    for l in &lines {
        let od = &l["<OD>"];
        let (bboxes, labels) = (od["bboxes"].as_array(), od["labels"].as_array());
        assert!(bboxes.is_some() && labels.is_some(), "{l}");
        assert_eq!(bboxes.unwrap().len(), labels.unwrap().len());
        assert!(l["token_ids"].as_array().is_some_and(|t| t.len() <= 8));
    }
    for name in ["image.png", "other.png"] {
        let drawn = image::open(drawn.join(name)).expect("drawn PNG");
        let original = image::open(model.join(name)).expect("image");
        assert_eq!(
            (drawn.width(), drawn.height()),
            (original.width(), original.height())
        );
    }

    // A text task prints text; with heatmaps of its cross-attention.
    let maps = tmp.path().join("maps");
    let out = ok(&run(&[
        "--model",
        s(&model),
        "--task",
        "caption",
        "--attention-map",
        s(&maps),
        "--max-tokens",
        "4",
        s(&a),
    ]));
    assert_eq!(out.lines().count(), 1);
    assert!(maps.join("image_grid.png").is_file());
}

#[test]
fn task_errors_name_the_flag() {
    let model = florence();
    let img = model.join("image.png");
    // A task that needs a text input, given none.
    let out = run(&["--model", s(&model), "--task", "phrase-grounding", s(&img)]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--text") && err.contains("needs a text input"),
        "{err}"
    );
    // An unknown task lists the tasks.
    let out = run(&["--model", s(&model), "--task", "segment", s(&img)]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown task") && err.contains("open-vocabulary-detection"),
        "{err}"
    );
    // --text without --task.
    let out = run(&["--model", s(&model), "--text", "a dog", s(&img)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--task"));
    // A model that takes no task.
    let tmp = tempfile::tempdir().expect("tmp");
    let tiny = tmp.path().join("model");
    tiny_model(&tiny);
    let imgs = images(&tmp.path().join("imgs"), 1);
    let out = run(&["--model", s(&tiny), "--task", "od", s(&imgs[0])]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--task od") && err.contains("takes no task"),
        "{err}"
    );
}

//! The caption CLI, run as a process: exit codes, stdout/stderr, JSON lines,
//! heatmaps. Uses a tiny randomly initialised model written to a temporary
//! directory.
#![allow(missing_docs)]

mod common;

use std::path::PathBuf;

use common::{images, run, s, tiny_model};

#[test]
fn json_lines_and_exit_codes() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    tiny_model(&model);
    let imgs = images(&tmp.path().join("imgs"), 3);

    // All good: exit 0, one JSON object per image.
    let out = run(&[
        "--model",
        s(&model),
        "--json",
        "--max-tokens",
        "5",
        s(&tmp.path().join("imgs")),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(lines.len(), 3);
    for (l, p) in lines.iter().zip(&imgs) {
        assert_eq!(l["image"], s(p));
        assert!(l["caption"].is_string());
        let ids = l["token_ids"].as_array().expect("ids");
        assert!(!ids.is_empty() && ids.len() <= 5);
    }

    // One missing input among good ones: exit 1, the others still captioned.
    let missing = tmp.path().join("missing.png");
    let garbage = tmp.path().join("garbage.png");
    std::fs::write(&garbage, b"not an image at all").expect("write");
    let out = run(&[
        "--model",
        s(&model),
        "--json",
        s(&imgs[0]),
        s(&missing),
        s(&garbage),
        s(&imgs[1]),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    assert_eq!(lines.len(), 4);
    assert_eq!(
        lines.iter().filter(|l| l.get("caption").is_some()).count(),
        2
    );
    let errs: Vec<&serde_json::Value> = lines.iter().filter(|l| l.get("error").is_some()).collect();
    assert_eq!(errs.len(), 2);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("missing.png") && stderr.contains("garbage.png"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    // Plain output: one line, the caption only; several: prefixed by the path.
    let out = run(&["--model", s(&model), s(&imgs[0])]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
    let out = run(&["--model", s(&model), s(&imgs[0]), s(&imgs[1])]);
    assert!(String::from_utf8_lossy(&out.stdout).starts_with(s(&imgs[0])));
}

#[test]
fn usage_and_model_errors_exit_2_with_one_line() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    tiny_model(&model);
    let img = &images(&tmp.path().join("imgs"), 1)[0];
    for (flags, culprit) in [
        (vec!["--beams", "0"], "--beams"),
        (vec!["--temperature", "-1"], "--temperature"),
        (vec!["--top-p", "1.5"], "--top-p"),
        (vec!["--max-tokens", "100"], "--max-tokens"),
        (vec!["--device", "tpu"], "tpu"),
        (vec!["--dtype", "f64"], "f64"),
    ] {
        let mut args = vec!["--model", s(&model)];
        args.extend(flags.iter());
        args.push(s(img));
        let out = run(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(culprit), "{flags:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{flags:?}: {stderr}");
        assert!(out.stdout.is_empty());
    }
    let out = run(&["--model", s(&tmp.path().join("no-model")), s(img)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no-model"));
}

#[test]
fn attention_maps_are_written() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    tiny_model(&model);
    let img = &images(&tmp.path().join("imgs"), 1)[0];
    let maps = tmp.path().join("maps");
    let out = run(&[
        "--model",
        s(&model),
        "--json",
        "--max-tokens",
        "3",
        "--attention-map",
        s(&maps),
        s(img),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let n = line["token_ids"].as_array().expect("ids").len();
    let mut words: Vec<PathBuf> = std::fs::read_dir(&maps)
        .expect("maps")
        .flatten()
        .map(|e| e.path())
        .filter(|p| !s(p).ends_with("_grid.png"))
        .collect();
    words.sort();
    assert_eq!(words.len(), n);
    let (w, h) = image::image_dimensions(&words[0]).expect("png");
    assert_eq!(
        (w, h),
        (64 * vl::heatmap::UPSCALE, 64 * vl::heatmap::UPSCALE + 24)
    );
    assert!(maps.join("img0_grid.png").is_file());
    // Each word's tile shows its own weights: no two are the same picture.
    let tiles: Vec<Vec<u8>> = words
        .iter()
        .map(|p| image::open(p).expect("png").to_rgb8().into_raw())
        .collect();
    for (i, a) in tiles.iter().enumerate() {
        for b in &tiles[i + 1..] {
            assert_ne!(a, b, "two words have the same heatmap");
        }
    }
}

#[test]
fn any_common_format_mode_and_size_is_captioned() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    tiny_model(&model);
    let scene = vl::vl_shapes::dataset_scene(5, 0).render();
    let dynamic = image::DynamicImage::ImageRgb8(scene);
    let dir = tmp.path().join("imgs");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let files = [
        ("gray.png", dynamic.to_luma8().into()),
        (
            "rgba.png",
            image::DynamicImage::ImageRgba8(dynamic.to_rgba8()),
        ),
        (
            "sixteen.png",
            image::DynamicImage::ImageRgb16(dynamic.to_rgb16()),
        ),
        (
            "big.png",
            dynamic.resize_exact(300, 200, image::imageops::FilterType::Nearest),
        ),
        ("one.png", dynamic.crop_imm(0, 0, 1, 1)),
        ("photo.jpg", dynamic.clone()),
        ("photo.bmp", dynamic.clone()),
    ];
    for (name, img) in &files {
        img.save(dir.join(name)).expect(name);
    }
    let out = run(&["--model", s(&model), "--json", "--max-tokens", "3", s(&dir)]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().count(),
        files.len()
    );
}

/// The CLI on the transformers fixtures, with the checkpoint's own
/// generation defaults: `--json` token_ids equal transformers' `generate()`
/// ids (after the start token, through the first EOS).
#[test]
fn hf_checkpoints_caption_as_transformers() {
    let root = common::repo_root().join("tests/fixtures/hf");
    for kind in ["equal", "narrow"] {
        let dir = root.join(kind);
        let expected: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("expected.json")).expect("expected.json"),
        )
        .expect("json");
        let out = run(&["--model", s(&dir), "--json", s(&dir.join("image.png"))]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{kind}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        assert_eq!(line["token_ids"], expected["defaults"], "{kind}");
        assert_eq!(line["caption"], expected["defaults_text"], "{kind}");
        // Flags override the checkpoint: --beams 1 is plain greedy decoding
        // (for `narrow`, still with its no_repeat_ngram_size 3).
        let out = run(&[
            "--model",
            s(&dir),
            "--json",
            "--beams",
            "1",
            "--no-repeat-ngram-size",
            "0",
            "--max-tokens",
            "20",
            s(&dir.join("image.png")),
        ]);
        let line: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        assert_eq!(line["token_ids"], expected["greedy"], "{kind} --beams 1");
    }
}

/// Documents through the CLI: Donut's task prompt replaces the start
/// token and `--json` carries the output's JSON as `document`; Nougat's
/// pages are written as Markdown, one `.mmd` per page with
/// `--output-dir`, and two pages of the same name are refused before any
/// is read.
#[test]
fn documents_print_json_and_write_one_markdown_file_per_page() {
    let root = common::repo_root().join("tests/fixtures/document");
    let donut = root.join("donut");
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(donut.join("expected.json")).expect("expected.json"),
    )
    .expect("json");
    let out = run(&[
        "--model",
        s(&donut),
        "--json",
        "--beams",
        "1",
        "--max-tokens",
        "20",
        "--prompt",
        "<s_cord-v2>",
        s(&donut.join("image.png")),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(line["token_ids"], expected["prompted"]);
    assert_eq!(line["caption"], expected["prompted_text"]);
    assert_eq!(line["document"], expected["prompted_json"]);

    let nougat = root.join("nougat");
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(nougat.join("expected.json")).expect("expected.json"),
    )
    .expect("json");
    let dir = tempfile::tempdir().expect("temp dir");
    let pages = dir.path().join("pages");
    let out = run(&[
        "--model",
        s(&nougat),
        "--output-dir",
        s(&pages),
        s(&nougat.join("image.png")),
        s(&nougat.join("other_0.png")),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = std::fs::read_to_string(pages.join("image.mmd")).expect("image.mmd");
    assert_eq!(
        page,
        expected["defaults_markdown"].as_str().expect("a string")
    );
    assert!(pages.join("other_0.mmd").is_file());

    // The same stem twice: refused by name, nothing written.
    let twin = dir.path().join("image.png");
    std::fs::copy(nougat.join("image.png"), &twin).expect("copy");
    let again = dir.path().join("again");
    let out = run(&[
        "--model",
        s(&nougat),
        "--output-dir",
        s(&again),
        s(&nougat.join("image.png")),
        s(&twin),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("would both write"), "{err}");
    assert!(!again.exists());
}

/// BLIP fixtures through the CLI: the checkpoint's defaults, and
/// `--prompt` continuing a prompt (the caption is the whole text, token_ids
/// the generated ones), as transformers; a model without prompts refuses
/// `--prompt` by name, exit 2.
#[test]
fn blip_checkpoints_caption_with_and_without_a_prompt() {
    let dir = common::repo_root().join("tests/fixtures/blip/vision24");
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("expected.json")).expect("expected.json"),
    )
    .expect("json");
    let image = dir.join("image.png");
    let out = run(&["--model", s(&dir), "--json", s(&image)]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(line["token_ids"], expected["defaults"]);
    assert_eq!(line["caption"], expected["defaults_text"]);
    let prompt = expected["prompt"].as_str().expect("prompt");
    let out = run(&["--model", s(&dir), "--json", "--prompt", prompt, s(&image)]);
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(line["token_ids"], expected["prompt_defaults"]);
    assert_eq!(line["caption"], expected["prompt_defaults_text"]);
    let hf = common::repo_root().join("tests/fixtures/hf/equal");
    let out = run(&[
        "--model",
        s(&hf),
        "--prompt",
        prompt,
        s(&hf.join("image.png")),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--prompt") && err.contains("only BLIP"),
        "{err}"
    );
}

#[cfg(not(feature = "hub"))]
#[test]
fn model_id_without_the_hub_feature_says_how_to_get_it() {
    let out = run(&["--model-id", "org/name", "image.png"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--features hub") && err.lines().count() == 1,
        "{err}"
    );
}

#[test]
fn quantize_flag() {
    // A 32-wide checkpoint quantizes to q8_0 blocks of 32 and captions.
    let dir = common::repo_root().join("tests/fixtures/hf/equal");
    let out = run(&[
        "--model",
        s(&dir),
        "--quantize",
        "q8_0",
        "--json",
        s(&dir.join("image.png")),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(!line["token_ids"].as_array().expect("ids").is_empty());
    // The shipped captioner in q8_0, and with bf16 weights under f32
    // activations, still gets every shipped sample right.
    let (files, want): (Vec<String>, Vec<String>) = common::samples().into_iter().unzip();
    // q4k asked of the 64-wide captioner: every layer falls back to q8_0.
    for format in ["q8_0", "bf16", "q4k"] {
        let mut args = vec!["--quantize", format, "--json"];
        args.extend(files.iter().map(String::as_str));
        let out = run(&args);
        assert_eq!(out.status.code(), Some(0), "{format}");
        let got = common::captions(&String::from_utf8_lossy(&out.stdout));
        assert_eq!(got, want, "{format}");
    }
    // q4k needs widths in multiples of 256: the 32-wide checkpoint's
    // layers fall back to q8_0, said once on stderr, and it captions.
    let out = run(&[
        "--model",
        s(&dir),
        "--quantize",
        "q4k",
        s(&dir.join("image.png")),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(
        warnings[0].contains("cannot hold q4k")
            && warnings[0].contains("256")
            && warnings[0].contains("q8_0 for"),
        "{err}"
    );
}

/// `--text-cache bf16|f16` keeps the decoder's keys and values in 16 bits
/// under f32 activations (under `--quantize` without the flag too, and
/// `f32` keeps them exact): the shipped captioner (q8_0 and f32 weights)
/// still gets every shipped sample right, and a transformers fixture's
/// greedy ids with an f16 cache are its f32 ones (its margins are wide
/// enough); a text cache the activations cannot read is refused naming
/// the flag and the dtypes.
#[test]
fn text_cache_flag() {
    let (files, want): (Vec<String>, Vec<String>) = common::samples().into_iter().unzip();
    for (quantize, cache) in [
        ("q8_0", Some("bf16")),
        ("q8_0", None),
        ("q8_0", Some("f32")),
        ("none", Some("f16")),
        ("none", Some("bf16")),
    ] {
        let mut args = vec!["--quantize", quantize, "--json"];
        if let Some(cache) = cache {
            args.extend(["--text-cache", cache]);
        }
        args.extend(files.iter().map(String::as_str));
        let got = common::captions(&common::ok(&run(&args)));
        assert_eq!(got, want, "--quantize {quantize} --text-cache {cache:?}");
    }
    let dir = common::repo_root().join("tests/fixtures/hf/equal");
    let image = dir.join("image.png");
    let ids = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["--model", s(&dir), "--json"];
        args.extend_from_slice(extra);
        args.push(s(&image));
        let line: serde_json::Value = serde_json::from_str(&common::ok(&run(&args))).expect("json");
        line["token_ids"].clone()
    };
    assert_eq!(ids(&["--text-cache", "f16"]), ids(&[]));
    let out = run(&["--dtype", "bf16", "--text-cache", "f32", &files[0]]);
    let err = String::from_utf8_lossy(&out.stderr);
    // 2: nothing captioned (1 is for some images failing).
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--text-cache f32")
            && err.contains("text_cache_dtype")
            && err.contains("BF16"),
        "{err}"
    );
}

/// `--image-cache` keeps the image's keys and values as asked (the
/// shipped captioner's wide margins give the same captions in f32, bf16
/// and f16 under q8_0 weights); `q8` rows (and `--text-cache q8`) need
/// heads a multiple of 32 wide, which the captioner's 16 are not: refused,
/// naming the flag and the reason; a format that is none is refused by
/// the parser.
#[test]
fn image_cache_flag() {
    let (files, want): (Vec<String>, Vec<String>) = common::samples().into_iter().unzip();
    for cache in ["f32", "bf16", "f16"] {
        let mut args = vec!["--quantize", "q8_0", "--json", "--image-cache", cache];
        args.extend(files.iter().map(String::as_str));
        let got = common::captions(&common::ok(&run(&args)));
        assert_eq!(got, want, "--image-cache {cache}");
    }
    for flag in ["--image-cache", "--text-cache"] {
        let out = run(&["--quantize", "q8_0", flag, "q8", &files[0]]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        let field = flag.trim_start_matches("--").replace('-', "_");
        assert!(
            err.contains(&format!("{flag} q8"))
                && err.contains(&format!("{field}_dtype"))
                && err.contains("multiple of 32, got 16"),
            "{err}"
        );
    }
    let out = run(&["--image-cache", "f8", &files[0]]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--image-cache") && err.contains("q8"),
        "{err}"
    );
}

/// `vl bench --quantize q8_0 --quick --repeats 1 --threads 1` on a
/// transformers fixture, with `extra` flags.
fn bench(extra: &[&str]) -> std::process::Output {
    let dir = common::repo_root().join("tests/fixtures/hf/equal");
    std::process::Command::new(common::vl_bin())
        .args(["bench", "--model", s(&dir), "--quantize", "q8_0", "--quick"])
        .args(["--repeats", "1", "--threads", "1"])
        .args(extra)
        .output()
        .expect("run bench")
}

/// `vl bench` on a transformers fixture, quantized: one JSON line whose
/// decode figures come with the bytes a step reads (q8_0 weights at 34
/// bytes per 32, bf16 image keys and values: fewer than the f32 file's
/// share) and the read bandwidth measured in the same process, start and
/// end, and the fraction the decode reaches.
#[test]
fn bench_reports_the_bandwidth_it_reaches() {
    let out = common::ok(&bench(&["--new-tokens", "2", "--agreement-tokens", "4"]));
    let json: serde_json::Value = serde_json::from_str(&out).expect("json");
    // q8_0 keeps the text cache in bf16 unless told otherwise.
    assert_eq!(json["text_cache"], "bf16", "{json}");
    let num = |k: &str| json[k].as_f64().unwrap_or_else(|| panic!("{k} in {json}"));
    let step = num("decode_step_mb");
    assert!(step > 0.0 && step < num("weights_mb") * 1.05, "{json}");
    for k in ["read_gb_s_start", "read_gb_s_end", "decode_gb_s"] {
        assert!(num(k) > 0.0, "{k}: {json}");
    }
    let fraction = num("decode_bandwidth_fraction");
    let want = num("decode_gb_s") / ((num("read_gb_s_start") + num("read_gb_s_end")) / 2.0);
    assert!((fraction - want).abs() < 1e-9 * want.max(1.0), "{json}");
}

/// `vl bench --agreement-tokens 0` skips the agreement check (no f32
/// reference loaded, no agreement figure); counts that must be positive
/// are refused by name.
#[test]
fn bench_skips_the_agreement_and_refuses_zero_counts() {
    let out = common::ok(&bench(&["--new-tokens", "2", "--agreement-tokens", "0"]));
    let json: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert!(json["ms_per_token"].as_f64().is_some(), "{json}");
    assert!(json.get("top1_agreement").is_none(), "{json}");
    for flag in ["--new-tokens", "--batch"] {
        let out = bench(&[flag, "0"]);
        assert_eq!(out.status.code(), Some(2), "{flag} 0");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{flag}: {err}");
    }
}

/// `vl bench --positions` times decode steps after each prefix (with
/// `--quick` too), and refuses a position the model cannot hold, naming
/// the flag and its range.
#[test]
fn bench_times_each_position_and_refuses_those_past_the_model() {
    let out = common::ok(&bench(&[
        "--new-tokens",
        "2",
        "--agreement-tokens",
        "0",
        "--positions",
        "3,20",
    ]));
    let json: serde_json::Value = serde_json::from_str(&out).expect("json");
    for k in ["ms_per_token_at_3", "ms_per_token_at_20"] {
        assert!(json[k].as_f64().is_some_and(|v| v > 0.0), "{k}: {json}");
    }
    for bad in ["0", "100000"] {
        let out = bench(&["--agreement-tokens", "0", "--positions", bad]);
        assert_eq!(out.status.code(), Some(1), "--positions {bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--positions")
                && err.contains(bad)
                && err.contains("max_position_embeddings"),
            "--positions {bad}: {err}"
        );
    }
}

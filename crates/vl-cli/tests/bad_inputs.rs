//! The bad-input catalogue of `docs/bad-inputs.md`, one test per row: the
//! caption CLI, run as a process on a broken model directory, image or
//! flag, answers with one `error:` line per problem naming the culprit,
//! and the documented exit code (2 for a model or usage problem, 1 when
//! some images of a batch failed and the rest were captioned) — never a
//! panic or a backtrace.
#![allow(missing_docs)]

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use candle_core::{DType, Device, Tensor};
use common::{caption_cmd, s, tiny_model};
use vl::shapes;

/// A temporary directory with a good tiny model (`model/`) and a good
/// image (`good.png`); rows break a copy of either.
struct Fixture {
    tmp: tempfile::TempDir,
    model: PathBuf,
    image: PathBuf,
}

impl Fixture {
    fn new() -> Self {
        let tmp = tempfile::tempdir().expect("tmp");
        let model = tmp.path().join("model");
        tiny_model(&model);
        let image = tmp.path().join("good.png");
        vl::vl_shapes::dataset_scene(99, 0)
            .render()
            .save(&image)
            .expect("png");
        Self { tmp, model, image }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    /// The caption CLI on `model` and the good image, with `flags`.
    fn caption_with(&self, model: &Path, flags: &[&str]) -> Output {
        let mut args = vec!["--model", s(model)];
        args.extend_from_slice(flags);
        args.push(s(&self.image));
        run(&args)
    }

    /// The caption CLI on the good model and `images`.
    fn caption_images(&self, images: &[&Path]) -> Output {
        let mut args = vec!["--model", s(&self.model)];
        args.extend(images.iter().map(|p| s(p)));
        run(&args)
    }

    /// Replaces the tiny model's file `name` with a directory.
    fn file_as_directory(&self, name: &str) {
        let p = self.model.join(name);
        std::fs::remove_file(&p).expect("rm");
        std::fs::create_dir(&p).expect("mkdir");
    }

    /// Rewrites the tiny model's `config.json` through `edit`.
    fn edit_config(&self, edit: impl FnOnce(&mut serde_json::Value)) {
        edit_json(&self.model.join("config.json"), edit);
    }

    /// A copy, under the fixture's directory, of the committed
    /// transformers checkpoint `tests/fixtures/{family}/{kind}` without the
    /// files named in `skip`.
    fn copy_checkpoint(&self, family: &str, kind: &str, skip: &[&str]) -> PathBuf {
        let src = common::repo_root()
            .join("tests/fixtures")
            .join(family)
            .join(kind);
        let dir = self.path(kind);
        std::fs::create_dir(&dir).expect("mkdir");
        for e in std::fs::read_dir(&src).expect("fixture").flatten() {
            let name = e.file_name();
            if !skip.iter().any(|s| name == *s) {
                std::fs::copy(e.path(), dir.join(&name)).expect("copy");
            }
        }
        dir
    }

    /// Rewrites the tiny model's tensors through `edit`.
    fn edit_weights(&self, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
        let p = self.model.join("model.safetensors");
        let mut tensors = candle_core::safetensors::load(&p, &Device::Cpu).expect("load");
        edit(&mut tensors);
        candle_core::safetensors::save(&tensors, &p).expect("save");
    }
}

/// Rewrites the JSON file `path` through `edit`.
fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json");
    edit(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).expect("json")).expect("write");
}

/// Runs the CLI with backtraces switched on, so that one would show.
fn run(args: &[&str]) -> Output {
    caption_cmd()
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env_remove("RUST_LOG")
        .output()
        .expect("run caption")
}

fn no_panic_or_backtrace(row: &str, stderr: &str) {
    let lower = stderr.to_lowercase();
    assert!(
        !lower.contains("panicked") && !lower.contains("backtrace"),
        "{row}: {stderr}"
    );
}

/// A model or usage problem: exit 2, nothing on stdout, one `error:` line
/// on stderr containing every one of `culprit`.
fn assert_fatal(row: &str, out: &Output, culprit: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The catalogue's messages: `cargo test --test bad_inputs -- --nocapture`.
    println!("{row} | {} | {stderr}", out.status);
    no_panic_or_backtrace(row, &stderr);
    assert_eq!(out.status.code(), Some(2), "{row}: {stderr}");
    assert!(out.stdout.is_empty(), "{row}: stdout not empty");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{row}: not one line: {stderr}");
    assert!(lines[0].starts_with("error: "), "{row}: {stderr}");
    for c in culprit {
        assert!(lines[0].contains(c), "{row}: no `{c}` in: {stderr}");
    }
}

/// A batch of the good image and `bad`: exit 1, the good image captioned
/// on stdout, one `error:` line on stderr naming `bad` and containing
/// every one of `culprit`.
fn assert_image_fails(row: &str, f: &Fixture, bad: &Path, culprit: &[&str]) {
    let out = f.caption_images(&[&f.image, bad]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{row} | {} | {stderr}", out.status);
    no_panic_or_backtrace(row, &stderr);
    assert_eq!(out.status.code(), Some(1), "{row}: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let captions: Vec<&str> = stdout.lines().collect();
    assert_eq!(captions.len(), 1, "{row}: stdout: {stdout}");
    let caption = captions[0]
        .strip_prefix(&format!("{}: ", s(&f.image)))
        .unwrap_or_else(|| panic!("{row}: the good image is not captioned: {stdout}"));
    assert!(!caption.trim().is_empty(), "{row}: empty caption");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{row}: not one line: {stderr}");
    assert!(lines[0].starts_with("error: "), "{row}: {stderr}");
    let name = bad.file_name().and_then(|n| n.to_str()).expect("name");
    for c in std::iter::once(&name).chain(culprit) {
        assert!(lines[0].contains(c), "{row}: no `{c}` in: {stderr}");
    }
}

// ---- the model directory ----

#[test]
fn model_dir_missing() {
    let f = Fixture::new();
    let out = f.caption_with(&f.path("no-such-model"), &[]);
    assert_fatal(
        "model dir missing",
        &out,
        &["no-such-model", "not a model directory"],
    );
}

#[test]
fn model_dir_empty() {
    let f = Fixture::new();
    let empty = f.path("empty-model");
    std::fs::create_dir(&empty).expect("mkdir");
    let out = f.caption_with(&empty, &[]);
    assert_fatal(
        "model dir empty",
        &out,
        &["empty-model/config.json", "No such file"],
    );
}

#[test]
fn model_dir_is_a_file() {
    let f = Fixture::new();
    let out = f.caption_with(&f.image, &[]);
    assert_fatal(
        "model dir is a file",
        &out,
        &["good.png", "not a model directory"],
    );
}

// ---- config.json ----

#[test]
fn config_unreadable() {
    let f = Fixture::new();
    f.file_as_directory("config.json");
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "config.json unreadable",
        &out,
        &["config.json", "directory"],
    );
}

#[test]
fn config_malformed_json() {
    let f = Fixture::new();
    std::fs::write(f.model.join("config.json"), "{\"model_type\": \"vl\",\n").expect("write");
    let out = f.caption_with(&f.model, &[]);
    assert_fatal("config.json malformed", &out, &["config.json", "line 2"]);
}

#[test]
fn config_missing_field() {
    let f = Fixture::new();
    f.edit_config(|c| {
        c["decoder"]
            .as_object_mut()
            .expect("decoder")
            .remove("vocab_size");
    });
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "config.json missing field",
        &out,
        &["config.json", "missing field `vocab_size`"],
    );
}

#[test]
fn config_wrong_type() {
    let f = Fixture::new();
    f.edit_config(|c| c["decoder"]["hidden_size"] = "sixteen".into());
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "config.json wrong type",
        &out,
        &[
            "config.json",
            "invalid type: string \"sixteen\", expected usize",
        ],
    );
}

#[test]
fn config_unknown_activation() {
    let f = Fixture::new();
    f.edit_config(|c| c["decoder"]["hidden_act"] = "tanhh".into());
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "config.json unknown activation",
        &out,
        &[
            "config.json",
            "unknown variant `tanhh`",
            "expected one of `gelu`",
        ],
    );
}

#[test]
fn config_hidden_not_divisible_by_heads() {
    let f = Fixture::new();
    f.edit_config(|c| c["decoder"]["num_attention_heads"] = 3.into());
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "config.json hidden % heads",
        &out,
        &[
            "config.json",
            "hidden_size: 16 is not divisible by num_attention_heads 3",
        ],
    );
}

#[test]
fn config_zero_layers() {
    let f = Fixture::new();
    f.edit_config(|c| c["decoder"]["num_hidden_layers"] = 0.into());
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "config.json zero layers",
        &out,
        &["config.json", "num_hidden_layers: must be positive, got 0"],
    );
}

#[test]
fn config_wrong_model_type() {
    let f = Fixture::new();
    f.edit_config(|c| c["model_type"] = "bert".into());
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "config.json wrong model_type",
        &out,
        &[
            "config.json",
            "model_type `bert` is not supported",
            "vl loads `vl`",
        ],
    );
}

// ---- model.safetensors ----

/// The header length of a safetensors file, then `rest`.
fn safetensors_bytes(header_len: u64, rest: &[u8]) -> Vec<u8> {
    let mut bytes = header_len.to_le_bytes().to_vec();
    bytes.extend_from_slice(rest);
    bytes
}

#[test]
fn weights_missing() {
    let f = Fixture::new();
    std::fs::remove_file(f.model.join("model.safetensors")).expect("rm");
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "weights missing",
        &out,
        &["model.safetensors", "no such file"],
    );
}

#[test]
fn weights_unreadable() {
    let f = Fixture::new();
    f.file_as_directory("model.safetensors");
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "weights unreadable",
        &out,
        &["model.safetensors", "directory"],
    );
}

#[test]
fn weights_truncated() {
    let f = Fixture::new();
    let p = f.model.join("model.safetensors");
    let bytes = std::fs::read(&p).expect("read");
    std::fs::write(&p, &bytes[..bytes.len() / 2]).expect("write");
    let out = f.caption_with(&f.model, &[]);
    let (expected, found) = (bytes.len().to_string(), (bytes.len() / 2).to_string());
    assert_fatal(
        "weights truncated",
        &out,
        &["model.safetensors", "truncated", &expected, &found],
    );
}

#[test]
fn weights_garbage_header() {
    let f = Fixture::new();
    let garbage = b"\x00\x01garbage, not a JSON header\xff\xfe";
    std::fs::write(
        f.model.join("model.safetensors"),
        safetensors_bytes(garbage.len() as u64, garbage),
    )
    .expect("write");
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "weights garbage header",
        &out,
        &["model.safetensors", "header"],
    );
}

#[test]
fn weights_header_longer_than_file() {
    let f = Fixture::new();
    std::fs::write(
        f.model.join("model.safetensors"),
        safetensors_bytes(1_000_000, b"{}"),
    )
    .expect("write");
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "weights header longer than file",
        &out,
        &["model.safetensors", "1000000", "2 bytes"],
    );
}

#[test]
fn weights_shorter_than_header_length() {
    let f = Fixture::new();
    std::fs::write(f.model.join("model.safetensors"), b"abc").expect("write");
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "weights shorter than 8 bytes",
        &out,
        &["model.safetensors", "3 bytes"],
    );
}

#[test]
fn weights_missing_tensor() {
    let f = Fixture::new();
    let name = "decoder.blocks.0.cross_attn.k_proj.weight";
    f.edit_weights(|t| {
        t.remove(name).expect("tensor");
    });
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "weights missing tensor",
        &out,
        &["model.safetensors", "missing tensor", name, "[16, 16]"],
    );
}

#[test]
fn weights_wrong_shape() {
    let f = Fixture::new();
    let name = "decoder.blocks.0.cross_attn.q_proj.weight";
    f.edit_weights(|t| {
        let w = Tensor::zeros((16, 8), DType::F32, &Device::Cpu).expect("zeros");
        t.insert(name.into(), w);
    });
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "weights wrong shape",
        &out,
        &["model.safetensors", name, "[16, 8]", "expected [16, 16]"],
    );
}

#[test]
fn weights_wrong_dtype() {
    let f = Fixture::new();
    let name = "decoder.final_norm.weight";
    f.edit_weights(|t| {
        let w = Tensor::zeros(16, DType::I64, &Device::Cpu).expect("zeros");
        t.insert(name.into(), w);
    });
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "weights wrong dtype",
        &out,
        &["model.safetensors", name, "I64", "expected a float"],
    );
}

#[test]
fn weights_tensor_bytes_do_not_match_shape() {
    let f = Fixture::new();
    let p = f.model.join("model.safetensors");
    let bytes = std::fs::read(&p).expect("read");
    let (len, rest) = bytes.split_at(8);
    let n = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
    let (header, data) = rest.split_at(n);
    let mut header: serde_json::Value = serde_json::from_slice(header).expect("header");
    let name = "decoder.final_norm.weight";
    header[name]["shape"] = serde_json::json!([17]);
    let header = serde_json::to_vec(&header).expect("json");
    let mut out = safetensors_bytes(header.len() as u64, &header);
    out.extend_from_slice(data);
    std::fs::write(&p, out).expect("write");
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "weights tensor bytes vs shape",
        &out,
        &[
            "model.safetensors",
            name,
            "[17]",
            "needs 68 bytes",
            "hold 64",
        ],
    );
}

#[test]
fn weights_pickle_only_checkpoint() {
    let f = Fixture::new();
    let dir = f.copy_checkpoint("hf", "equal", &["model.safetensors"]);
    std::fs::write(dir.join("pytorch_model.bin"), b"PK\x03\x04 pickled").expect("write");
    let out = f.caption_with(&dir, &[]);
    assert_fatal(
        "pytorch_model.bin only",
        &out,
        &["pytorch_model.bin", "safetensors"],
    );
}

// ---- tokenizer.json ----

#[test]
fn tokenizer_malformed() {
    let f = Fixture::new();
    std::fs::write(f.model.join("tokenizer.json"), "{\"version\": ").expect("write");
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "tokenizer.json malformed",
        &out,
        &["tokenizer.json", "not a valid tokenizer"],
    );
}

#[test]
fn tokenizer_fewer_tokens_than_model() {
    use tokenizers::models::wordlevel::WordLevel;
    let f = Fixture::new();
    let vocab: HashMap<String, u32> = ["<pad>", "<bos>", "<eos>", "a"]
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), i as u32))
        .collect();
    let model = WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("<pad>".into())
        .build()
        .expect("wordlevel");
    tokenizers::Tokenizer::new(model)
        .save(f.model.join("tokenizer.json"), false)
        .expect("save");
    let out = f.caption_with(&f.model, &[]);
    let vocab_size = format!("vocab_size {}", shapes::vocab_size());
    assert_fatal(
        "tokenizer.json too few tokens",
        &out,
        &["tokenizer.json", "has 4 tokens", &vocab_size],
    );
}

#[test]
fn tokenizer_unreadable() {
    let f = Fixture::new();
    f.file_as_directory("tokenizer.json");
    let out = f.caption_with(&f.model, &[]);
    assert_fatal(
        "tokenizer.json unreadable",
        &out,
        &["tokenizer.json", "directory"],
    );
}

// ---- images: one line per bad image, the rest still captioned ----

/// CRC-32 (IEEE) of PNG chunks.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// A PNG whose header says `width` x `height` (8-bit RGB), followed by a
/// few bytes of pixel data only (an empty zlib stream).
fn png_header_only(width: u32, height: u32) -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = width.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    png_chunk(&mut png, b"IHDR", &ihdr);
    png_chunk(
        &mut png,
        b"IDAT",
        &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01],
    );
    png_chunk(&mut png, b"IEND", &[]);
    png
}

#[test]
fn crc32_matches_the_standard_check_value() {
    assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
}

#[test]
fn image_missing() {
    let f = Fixture::new();
    let bad = f.path("missing.png");
    assert_image_fails("image missing", &f, &bad, &["cannot open", "No such file"]);
}

#[test]
fn image_not_an_image() {
    let f = Fixture::new();
    let bad = f.path("notes.png");
    std::fs::write(&bad, "plain text, not pixels\n").expect("write");
    assert_image_fails("not an image", &f, &bad, &["not an image"]);
}

#[test]
fn image_truncated_png() {
    let f = Fixture::new();
    let bad = f.path("half.png");
    let bytes = std::fs::read(&f.image).expect("read");
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).expect("write");
    assert_image_fails("truncated PNG", &f, &bad, &["cannot decode"]);
}

#[test]
fn image_zero_by_zero() {
    let f = Fixture::new();
    let bad = f.path("empty.png");
    std::fs::write(&bad, png_header_only(0, 0)).expect("write");
    assert_image_fails("0x0 image", &f, &bad, &["0x0"]);
}

#[test]
fn image_huge_header() {
    let f = Fixture::new();
    let bad = f.path("huge.png");
    std::fs::write(&bad, png_header_only(20_000, 20_000)).expect("write");
    assert_image_fails("20000x20000 header", &f, &bad, &["20000x20000", "16384"]);
}

#[test]
fn images_several_bad_one_line_each() {
    let f = Fixture::new();
    let missing = f.path("missing.png");
    let text = f.path("notes.png");
    std::fs::write(&text, "plain text").expect("write");
    let out = f.caption_images(&[&missing, &f.image, &text]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    no_panic_or_backtrace("several bad images", &stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(lines[0].starts_with("error: ") && lines[0].contains("missing.png"));
    assert!(lines[1].starts_with("error: ") && lines[1].contains("notes.png"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(stdout.starts_with(s(&f.image)), "{stdout}");
}

// ---- flags ----

fn flag_row(row: &str, flags: &[&str], culprit: &[&str]) {
    let f = Fixture::new();
    let out = f.caption_with(&f.model, flags);
    assert_fatal(row, &out, culprit);
}

#[test]
fn flag_beams_zero() {
    flag_row("--beams 0", &["--beams", "0"], &["--beams 0", "at least 1"]);
}

#[test]
fn flag_negative_temperature() {
    flag_row(
        "--temperature -1",
        &["--temperature", "-1"],
        &["--temperature -1", ">= 0"],
    );
}

#[test]
fn flag_top_p_above_one() {
    flag_row(
        "--top-p 1.5",
        &["--top-p", "1.5"],
        &["--top-p", "(0, 1]", "1.5"],
    );
}

#[test]
fn flag_top_p_zero() {
    flag_row(
        "--top-p 0",
        &["--top-p", "0"],
        &["--top-p", "(0, 1]", "got 0"],
    );
}

#[test]
fn flag_max_tokens_beyond_positions() {
    // The tiny model has 16 positions: the start token and 15 new ones.
    flag_row(
        "--max-tokens 100",
        &["--max-tokens", "100"],
        &["--max-tokens 100", "at most 15"],
    );
}

#[test]
fn flag_unknown_device() {
    flag_row(
        "--device tpu",
        &["--device", "tpu"],
        &["--device", "`tpu` is not one of cpu, cuda[:N], metal[:N]"],
    );
}

#[test]
fn flag_device_bad_ordinal() {
    flag_row(
        "--device cuda:x",
        &["--device", "cuda:x"],
        &["--device", "`x` is not a number"],
    );
}

#[cfg(not(feature = "cuda"))]
#[test]
fn flag_cuda_without_the_feature() {
    flag_row(
        "--device cuda",
        &["--device", "cuda"],
        &["--device", "no CUDA support", "--features cuda"],
    );
}

#[test]
fn flag_unknown_dtype() {
    flag_row(
        "--dtype f8",
        &["--dtype", "f8"],
        &["--dtype", "`f8` is not one of f32, f16, bf16"],
    );
}

#[test]
fn flag_batch_size_zero() {
    flag_row(
        "--batch-size 0",
        &["--batch-size", "0"],
        &["--batch-size", "'0'", "at least 1"],
    );
}

#[test]
fn flag_top_k_zero() {
    flag_row("--top-k 0", &["--top-k", "0"], &["--top-k", "got 0"]);
}

#[test]
fn flag_min_tokens_above_max_tokens() {
    flag_row(
        "--min-tokens 10 --max-tokens 5",
        &["--min-tokens", "10", "--max-tokens", "5"],
        &["--min-tokens", "10 is above --max-tokens 5"],
    );
}

/// Values clap itself rejects (not a number, an unknown flag) get clap's
/// usage error: its first line starts with `error:` and names the flag,
/// a hint follows; exit 2.
#[test]
fn flag_not_a_number() {
    let f = Fixture::new();
    let out = f.caption_with(&f.model, &["--beams", "x"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("--beams x | {} | {stderr}", out.status);
    no_panic_or_backtrace("--beams x", &stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(out.stdout.is_empty());
    let first = stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("error: ") && first.contains("--beams") && first.contains("'x'"),
        "{stderr}"
    );
}

#[test]
fn image_directory_without_images() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    tiny_model(&model);
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).expect("mkdir");
    std::fs::write(empty.join("notes.txt"), "no images here").expect("write");
    let out = run(&["--model", s(&model), s(&empty)]);
    assert_eq!(out.status.code(), Some(1), "row 45");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.lines().count() == 1 && err.contains("empty") && err.contains("no images"),
        "row 45: {err}"
    );
}

#[test]
fn trocr_unknown_activation() {
    let f = Fixture::new();
    let dir = f.copy_checkpoint("trocr", "vit_learned", &[]);
    edit_json(&dir.join("config.json"), |c| {
        c["decoder"]["activation_function"] = "swish2".into();
    });
    let out = f.caption_with(&dir, &[]);
    assert_fatal(
        "row 46",
        &out,
        &["config.json", "activation_function", "swish2"],
    );
}

#[test]
fn blip_without_text_config() {
    let f = Fixture::new();
    let dir = f.copy_checkpoint("blip", "vision24", &[]);
    edit_json(&dir.join("config.json"), |c| {
        c.as_object_mut().expect("object").remove("text_config");
    });
    let out = f.caption_with(&dir, &[]);
    assert_fatal("row 47", &out, &["config.json", "text_config"]);
}

#[test]
fn prompt_for_a_model_without_prompts() {
    let f = Fixture::new();
    let out = f.caption_with(&f.model, &["--prompt", "a picture of"]);
    assert_fatal("row 48", &out, &["prompt", "BLIP"]);
}

#[test]
fn flag_unknown_quantization() {
    flag_row(
        "--quantize q3",
        &["--quantize", "q3"],
        &["--quantize", "none, bf16, f16, q8_0, q4k", "\"q3\""],
    );
}

#[test]
fn flag_revision_without_model_id() {
    flag_row(
        "row 50",
        &["--revision", "refs/pr/1"],
        &["--revision refs/pr/1", "--model-id"],
    );
}

//! Caption images with a vl model directory.
//!
//! `cargo run --release --example caption -- [OPTIONS] <IMAGE|DIR>...`
//!
//! stdout carries only results: one caption per image (prefixed by its path
//! when there are several), or one JSON object per image with `--json`.
//! Logs and the progress bar go to stderr.
//!
//! Exit codes: 0 every image captioned; 1 some inputs failed (each reported,
//! every other one still captioned); 2 usage error or the model could not
//! be loaded.

use std::collections::HashSet;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::Parser;
use image::DynamicImage;
use indicatif::{ProgressBar, ProgressDrawTarget};
use vl::captioner::{Caption, Captioner};
use vl::heatmap;
use vl::vl_decoder::dir::{parse_device, parse_dtype};
use vl::vl_decoder::preprocess::load_image;
use vl::vl_decoder::{GenerationConfig, Quantization, Strategy};

/// File extensions taken from a directory.
const IMAGE_EXTENSIONS: &[&str] = &["png", "jpg", "jpeg", "gif", "bmp", "tif", "tiff", "webp"];

/// Caption images with a vl model.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Images, or directories whose every image is captioned.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// The model directory: vl's own, or a transformers ViT + GPT-2
    /// vision-encoder-decoder checkpoint.
    #[arg(long, default_value = "models/shapes-captioner")]
    model: PathBuf,
    /// Fetch the model ORG/NAME from the Hugging Face Hub instead (needs the `hub` feature).
    #[arg(long, conflicts_with = "model")]
    model_id: Option<String>,
    /// One JSON object per image per line: {"image", "caption", "token_ids"} or {"image", "error"}.
    #[arg(long)]
    json: bool,
    /// Also append each image's JSON line to FILE, flushed as it finishes; images already
    /// in FILE (from an interrupted run) are skipped, so each appears exactly once.
    #[arg(long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Most tokens generated per image (default: the checkpoint's, else as many as the model's positions allow).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// No end token before this many tokens (default: the checkpoint's, else 0).
    #[arg(long)]
    min_tokens: Option<usize>,
    /// Beam search with this many beams; 1 = no beam search (default: the checkpoint's).
    #[arg(long)]
    beams: Option<usize>,
    /// Beam search: finished captions are scored sum_logprobs / len^p (default: the checkpoint's, else 1).
    #[arg(long, allow_negative_numbers = true)]
    length_penalty: Option<f32>,
    /// Sample with this temperature; 0 = greedy (default: the checkpoint's).
    #[arg(long, allow_negative_numbers = true)]
    temperature: Option<f64>,
    /// Sample from the k most likely tokens only.
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample from the smallest set of tokens whose probability reaches p, in (0, 1].
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f64>,
    /// Penalise tokens already generated; 1 = off (default: the checkpoint's).
    #[arg(long, allow_negative_numbers = true)]
    repetition_penalty: Option<f32>,
    /// Never repeat an n-gram of this size; 0 = off (default: the checkpoint's).
    #[arg(long)]
    no_repeat_ngram_size: Option<usize>,
    /// Seed of sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Images captioned together.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// cpu, cuda[:N] or metal[:N].
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Decoder linear layers in 8-bit (q8_0) or 4-bit (q4k) blocks at load; none = as stored.
    #[arg(long, default_value = "none")]
    quantize: Quantization,
    /// Write, per image, one heatmap PNG per word and a grid of all words here.
    #[arg(long)]
    attention_map: Option<PathBuf>,
}

/// A usage or model problem: exit code 2.
struct Fatal(anyhow::Error);

/// The checkpoint's generation defaults with the flags applied over them.
fn generation_config(args: &Args, captioner: &Captioner) -> anyhow::Result<GenerationConfig> {
    let base = &captioner.model.generation;
    let dec = &captioner.model.config.decoder;
    let room = dec.max_position_embeddings - 1;
    let max_tokens = match args.max_tokens {
        Some(n) if n > room => bail!(
            "--max-tokens {n}: the model reads at most {} positions, so at most {room} new tokens",
            dec.max_position_embeddings
        ),
        Some(n) => n,
        None => base.max_new_tokens.min(room),
    };
    if let Some(t) = args.temperature.filter(|t| *t < 0.0 || !t.is_finite()) {
        bail!("--temperature {t}: must be a finite number >= 0");
    }
    let sampling =
        args.temperature.is_some_and(|t| t != 0.0) || args.top_k.is_some() || args.top_p.is_some();
    let strategy = match (args.beams, sampling) {
        (Some(0), _) => bail!("--beams 0: must be at least 1"),
        (Some(b), true) if b > 1 => {
            bail!("--beams {b} cannot be combined with sampling (--temperature/--top-k/--top-p)")
        }
        (_, true) => {
            let (t, k, p) = match &base.strategy {
                Strategy::Sample {
                    temperature,
                    top_k,
                    top_p,
                    ..
                } => (*temperature, *top_k, *top_p),
                _ => (1.0, None, None),
            };
            Strategy::Sample {
                temperature: args.temperature.unwrap_or(t),
                top_k: args.top_k.or(k),
                top_p: args.top_p.or(p),
                seed: args.seed,
            }
        }
        (_, false) if args.temperature == Some(0.0) && args.beams.is_none() => Strategy::Greedy,
        (Some(1), false) => Strategy::Greedy,
        (Some(b), false) => match &base.strategy {
            Strategy::Beam {
                length_penalty,
                early_stopping,
                ..
            } => Strategy::Beam {
                num_beams: b,
                length_penalty: *length_penalty,
                early_stopping: *early_stopping,
            },
            _ => Strategy::beam(b),
        },
        (None, false) => match &base.strategy {
            Strategy::Sample {
                temperature,
                top_k,
                top_p,
                ..
            } => Strategy::Sample {
                temperature: *temperature,
                top_k: *top_k,
                top_p: *top_p,
                seed: args.seed,
            },
            other => other.clone(),
        },
    };
    let strategy = match (strategy, args.length_penalty) {
        (
            Strategy::Beam {
                num_beams,
                early_stopping,
                ..
            },
            Some(lp),
        ) => Strategy::Beam {
            num_beams,
            length_penalty: lp,
            early_stopping,
        },
        (s, _) => s,
    };
    let cfg = GenerationConfig {
        max_new_tokens: max_tokens,
        min_new_tokens: args
            .min_tokens
            .unwrap_or(base.min_new_tokens.min(max_tokens)),
        repetition_penalty: args.repetition_penalty.unwrap_or(base.repetition_penalty),
        no_repeat_ngram_size: args
            .no_repeat_ngram_size
            .unwrap_or(base.no_repeat_ngram_size),
        ..base.clone()
    }
    .with_strategy(strategy);
    cfg.validate()
        .map_err(|e| anyhow::anyhow!("{}", flag_name(&e.to_string())))?;
    Ok(cfg)
}

/// Rewrites a generation field name in an error as the CLI flag.
fn flag_name(msg: &str) -> String {
    let pairs = [
        ("max_new_tokens", "--max-tokens"),
        ("min_new_tokens", "--min-tokens"),
        ("num_beams", "--beams"),
        ("temperature", "--temperature"),
        ("top_k", "--top-k"),
        ("top_p", "--top-p"),
        ("repetition_penalty", "--repetition-penalty"),
        ("length_penalty", "--length-penalty"),
    ];
    let mut out = msg.to_string();
    for (field, flag) in pairs {
        out = out.replace(field, flag);
    }
    out
}

/// Expands directories into their image files, sorted; files stay as given.
fn expand(inputs: &[PathBuf]) -> (Vec<PathBuf>, Vec<(PathBuf, anyhow::Error)>) {
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for p in inputs {
        if p.is_dir() {
            let entries = match std::fs::read_dir(p) {
                Ok(entries) => entries,
                Err(e) => {
                    problems.push((p.clone(), anyhow::anyhow!("cannot list the directory: {e}")));
                    continue;
                }
            };
            let mut files: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|f| {
                    f.extension().and_then(|e| e.to_str()).is_some_and(|e| {
                        IMAGE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str())
                    })
                })
                .collect();
            if files.is_empty() {
                problems.push((
                    p.clone(),
                    anyhow::anyhow!(
                        "a directory with no images (looked for {})",
                        IMAGE_EXTENSIONS.join(", ")
                    ),
                ));
            }
            files.sort();
            out.extend(files);
        } else {
            out.push(p.clone());
        }
    }
    (out, problems)
}

/// The results file of `--output`: JSON lines, appended and flushed one
/// image at a time.
struct ResultsFile {
    path: PathBuf,
    file: std::fs::File,
}

impl ResultsFile {
    /// Opens (or creates) `path` for appending and returns the images it
    /// already holds. A last line cut short by a kill is removed first;
    /// any other line that is not a result is an error, and nothing is
    /// appended to such a file.
    fn open(path: &Path) -> anyhow::Result<(Self, HashSet<String>)> {
        let name = || path.display().to_string();
        let mut done = HashSet::new();
        let mut keep = 0u64;
        match std::fs::read(path) {
            Ok(bytes) => {
                let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
                for (n, line) in bytes[..complete].split(|&b| b == b'\n').enumerate() {
                    if line.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    let image = serde_json::from_slice::<serde_json::Value>(line)
                        .ok()
                        .and_then(|v| v.get("image")?.as_str().map(String::from));
                    match image {
                        Some(image) => {
                            done.insert(image);
                        }
                        None => bail!(
                            "{}: line {} is not a result line ({{\"image\": ...}}); not appending to it",
                            name(),
                            n + 1
                        ),
                    }
                }
                if complete < bytes.len() {
                    tracing::warn!(
                        "{}: dropping an unfinished last line ({} bytes) from an interrupted run",
                        name(),
                        bytes.len() - complete
                    );
                }
                keep = complete as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("--output {}", name())),
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .with_context(|| format!("--output {}", name()))?;
        file.set_len(keep)
            .with_context(|| format!("--output {}", name()))?;
        let mut file = file;
        std::io::Seek::seek(&mut file, std::io::SeekFrom::End(0))
            .with_context(|| format!("--output {}", name()))?;
        Ok((
            Self {
                path: path.to_path_buf(),
                file,
            },
            done,
        ))
    }

    fn append(&mut self, line: &serde_json::Value) -> anyhow::Result<()> {
        writeln!(self.file, "{line}")
            .and_then(|()| self.file.flush())
            .with_context(|| format!("{}", self.path.display()))
    }
}

struct Output {
    json: bool,
    several: bool,
    failed: usize,
    file: Option<ResultsFile>,
}

impl Output {
    fn ok(&mut self, path: &Path, c: &Caption) -> anyhow::Result<()> {
        let line = serde_json::json!({"image": path.display().to_string(), "caption": c.text, "token_ids": c.token_ids});
        let mut out = std::io::stdout().lock();
        if self.json {
            writeln!(out, "{line}")?;
        } else if self.several {
            writeln!(out, "{}: {}", path.display(), c.text)?;
        } else {
            writeln!(out, "{}", c.text)?;
        }
        out.flush()?;
        if let Some(f) = &mut self.file {
            f.append(&line)?;
        }
        Ok(())
    }

    fn err(&mut self, path: &Path, e: &anyhow::Error) -> anyhow::Result<()> {
        self.failed += 1;
        let msg = one_line(e);
        let line = serde_json::json!({"image": path.display().to_string(), "error": msg});
        if self.json {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{line}")?;
            out.flush()?;
        }
        if let Some(f) = &mut self.file {
            f.append(&line)?;
        }
        let shown = path.display().to_string();
        if msg.starts_with(&shown) {
            eprintln!("error: {msg}");
        } else {
            eprintln!("error: {shown}: {msg}");
        }
        Ok(())
    }
}

fn write_maps(
    captioner: &Captioner,
    dir: &Path,
    path: &Path,
    img: &DynamicImage,
    c: &Caption,
) -> anyhow::Result<()> {
    let Some(spec) = &captioner.model.pixels else {
        bail!("the model has no vision encoder");
    };
    let size = spec.image_size as u32;
    let shown = image::imageops::resize(
        &img.to_rgb8(),
        size,
        size,
        image::imageops::FilterType::Triangle,
    );
    let maps = captioner.attention_maps(img, &c.token_ids)?;
    let grid = (maps.first().map_or(0, Vec::len) as f64).sqrt() as u32;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("image");
    std::fs::create_dir_all(dir).with_context(|| format!("{}", dir.display()))?;
    let tok = &captioner.model.tokenizer;
    let mut tiles = Vec::new();
    for (i, (id, w)) in c.token_ids.iter().zip(&maps).enumerate() {
        let word = tok.id_to_token(*id).unwrap_or_default();
        let tile = heatmap::overlay(&shown, w, grid, &word);
        let file = dir.join(format!("{stem}_{i:02}_{}.png", sanitize(&word)));
        tile.save(&file)
            .with_context(|| format!("{}", file.display()))?;
        tiles.push(tile);
    }
    let file = dir.join(format!("{stem}_grid.png"));
    heatmap::grid(&tiles, &c.text)
        .save(&file)
        .with_context(|| format!("{}", file.display()))?;
    Ok(())
}

fn sanitize(word: &str) -> String {
    word.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The model directory: `--model`, or `--model-id` fetched from the Hub.
fn model_dir(args: &Args) -> anyhow::Result<PathBuf> {
    match &args.model_id {
        None => Ok(args.model.clone()),
        #[cfg(feature = "hub")]
        Some(id) => vl::hub::fetch(id),
        #[cfg(not(feature = "hub"))]
        Some(id) => bail!(
            "--model-id {id}: this build has no Hub support; rebuild with `--features hub`, \
             or download the checkpoint and pass --model DIR"
        ),
    }
}

fn run(args: &Args) -> Result<usize, Fatal> {
    let device = parse_device(&args.device).map_err(|e| Fatal(anyhow::anyhow!("--{e}")))?;
    let dtype = parse_dtype(&args.dtype).map_err(|e| Fatal(anyhow::anyhow!("--{e}")))?;
    if args.batch_size == 0 {
        return Err(Fatal(anyhow::anyhow!("--batch-size 0: must be at least 1")));
    }
    let model_dir = model_dir(args).map_err(Fatal)?;
    let mut captioner = Captioner::load(&model_dir, dtype, &device)
        .with_context(|| format!("cannot load the model {}", model_dir.display()))
        .map_err(Fatal)?;
    captioner
        .quantize(args.quantize)
        .with_context(|| format!("--quantize {}", args.quantize))
        .map_err(Fatal)?;
    let gen = generation_config(args, &captioner).map_err(Fatal)?;
    let (mut inputs, problems) = expand(&args.inputs);
    let file = match &args.output {
        None => None,
        Some(path) => {
            let (file, mut done) = ResultsFile::open(path).map_err(Fatal)?;
            let before = inputs.len();
            // Skip what the file holds, and list each image once.
            inputs.retain(|p| done.insert(p.display().to_string()));
            if inputs.len() < before {
                tracing::info!(
                    skipped = before - inputs.len(),
                    "images already in {}",
                    path.display()
                );
            }
            Some(file)
        }
    };
    tracing::info!(images = inputs.len(), model = %model_dir.display(), "captioning");
    let bar = if inputs.len() > 1 && std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(Some(inputs.len() as u64), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    let mut out = Output {
        json: args.json,
        several: inputs.len() > 1,
        failed: 0,
        file,
    };
    let io = |e: anyhow::Error| Fatal(e.context("cannot write the results"));
    for (path, e) in &problems {
        out.err(path, e).map_err(io)?;
    }
    for chunk in inputs.chunks(args.batch_size) {
        // Each image is read and preprocessed on its own, so one bad file
        // costs only itself.
        let mut good: Vec<(&PathBuf, DynamicImage, candle_core::Tensor)> = Vec::new();
        for path in chunk {
            let loaded = load_image(path)
                .map_err(anyhow::Error::from)
                .and_then(|img| Ok((captioner.pixels(&img)?, img)));
            match loaded {
                Ok((pixels, img)) => good.push((path, img, pixels)),
                Err(e) => bar.suspend(|| out.err(path, &e)).map_err(io)?,
            }
        }
        let pixels: Vec<candle_core::Tensor> = good.iter().map(|(_, _, p)| p.clone()).collect();
        let captions: Vec<anyhow::Result<Caption>> = if pixels.is_empty() {
            Vec::new()
        } else {
            match captioner.caption_pixels(&pixels, &gen, &mut |_| {}) {
                Ok(c) => c.into_iter().map(Ok).collect(),
                // A failed batch is retried image by image.
                Err(_) if pixels.len() > 1 => pixels
                    .iter()
                    .map(|p| {
                        captioner
                            .caption_pixels(std::slice::from_ref(p), &gen, &mut |_| {})?
                            .pop()
                            .context("no caption")
                    })
                    .collect(),
                Err(e) => vec![Err(e)],
            }
        };
        for ((path, img, _), c) in good.iter().zip(captions) {
            let c = c.and_then(|c| {
                if let Some(dir) = &args.attention_map {
                    write_maps(&captioner, dir, path, img, &c).context("attention map")?;
                }
                Ok(c)
            });
            match c {
                Ok(c) => bar.suspend(|| out.ok(path, &c)).map_err(io)?,
                Err(e) => bar.suspend(|| out.err(path, &e)).map_err(io)?,
            }
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    Ok(out.failed)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match run(&args) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(Fatal(e)) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::from(2)
        }
    }
}

/// The error and its causes on one line, `a: b: c`, leaving out a cause
/// whose text the line already ends with (a file error of vl-decoder shows
/// its source itself).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

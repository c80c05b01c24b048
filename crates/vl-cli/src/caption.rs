//! `vl caption`: caption images with the embedded shapes captioner, a vl
//! model directory or a transformers ViT/DeiT + GPT-2/TrOCR checkpoint.
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
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use image::DynamicImage;
use indicatif::{ProgressBar, ProgressDrawTarget};
use vl::captioner::{Caption, Captioner, ImageInput, Request};
use vl::tasks::{Task, TaskOutput};
use vl::VlModel;

use crate::args::{GenerationArgs, ModelArgs};
use crate::inputs::{expand, read_list, Shard};

/// Caption images with a vl model.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Images, or directories whose every image is captioned.
    #[arg(required_unless_present = "files_from")]
    inputs: Vec<PathBuf>,
    /// Also caption the images listed in FILE, one path per line (`-` reads
    /// standard input); blank lines and lines starting with `#` are skipped.
    #[arg(long, value_name = "FILE")]
    files_from: Option<PathBuf>,
    /// Caption only shard I of N (`--shard 0/4`): the inputs are sorted and
    /// every N-th one from the I-th is taken, so N runs with I = 0..N
    /// caption each image exactly once between them.
    #[arg(long, value_name = "I/N", value_parser = Shard::parse)]
    shard: Option<Shard>,
    #[command(flatten)]
    model: ModelArgs,
    /// Fetch the model ORG/NAME from the Hugging Face Hub instead (needs the `hub` feature).
    #[arg(long, conflicts_with = "model")]
    model_id: Option<String>,
    /// With --model-id: the branch, tag or commit to fetch (e.g. refs/pr/12 for a repository
    /// whose safetensors live on a pull-request branch) [default: main].
    #[arg(long)]
    revision: Option<String>,
    /// One JSON object per image per line: {"image", "caption", "token_ids"} or {"image", "error"}.
    #[arg(long)]
    json: bool,
    /// Also append each image's JSON line to FILE, flushed as it finishes; images already
    /// in FILE (from an interrupted run) are skipped, so each appears exactly once.
    #[arg(long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Also write each image's text to DIR/STEM.mmd (Nougat's Markdown, one file per page)
    /// or DIR/STEM.txt (other models); DIR is created if needed.
    #[arg(long, value_name = "DIR")]
    output_dir: Option<PathBuf>,
    #[command(flatten)]
    generation: GenerationArgs,
    /// Images captioned together.
    #[arg(long, default_value = "8", value_parser = crate::args::positive)]
    batch_size: NonZeroUsize,
    /// Write, per image, one heatmap PNG per word and a grid of all words here.
    #[arg(long)]
    attention_map: Option<PathBuf>,
    /// Continue this text (BLIP checkpoints: conditional captioning, e.g. "a picture of");
    /// the caption printed is the whole text, token_ids the generated ones. Florence-2: a free
    /// prompt instead of a task's. Donut: the task prompt, which replaces the start token
    /// (e.g. "<s_cord-v2>", or "<s_docvqa><s_question>Total?</s_question><s_answer>").
    #[arg(long, value_name = "TEXT", conflicts_with = "task")]
    prompt: Option<String>,
    /// Florence-2's task: caption, detailed-caption, more-detailed-caption, ocr,
    /// ocr-with-region, od, dense-region-caption, region-proposal, phrase-grounding,
    /// referring-expression-segmentation, region-to-segmentation, open-vocabulary-detection,
    /// region-to-category, region-to-description, region-to-ocr [default: caption].
    #[arg(long, value_name = "NAME", value_parser = parse_task)]
    task: Option<Task>,
    /// The task's text input: the caption to ground, the object to find, or a region as
    /// four location tokens ("<loc_100><loc_200><loc_500><loc_700>").
    #[arg(long, value_name = "TEXT", requires = "task")]
    text: Option<String>,
    /// Write, per image, a PNG with the task's boxes, quadrilaterals or polygons and their
    /// labels drawn on it.
    #[arg(long, value_name = "DIR", requires = "task")]
    draw: Option<PathBuf>,
}

fn parse_task(s: &str) -> Result<Task, String> {
    s.parse::<Task>().map_err(|e| match e {
        vl::Error::Argument { reason, .. } => reason,
        other => other.to_string(),
    })
}

/// A usage or model problem: exit code 2.
struct Fatal(anyhow::Error);

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
    task: Option<Task>,
    several: bool,
    failed: usize,
    file: Option<ResultsFile>,
    /// `--output-dir` and the files' extension.
    dir: Option<(PathBuf, &'static str)>,
}

/// `--output-dir`'s file for the image at `path`.
fn text_file(dir: &Path, ext: &str, path: &Path) -> PathBuf {
    let stem = path.file_stem().unwrap_or(path.as_os_str());
    dir.join(stem).with_extension(ext)
}

impl Output {
    fn ok(&mut self, path: &Path, c: &Caption) -> anyhow::Result<()> {
        let mut line = c.to_json(self.task);
        line["image"] = path.display().to_string().into();
        let shown = match &c.task {
            Some(
                parsed @ (TaskOutput::Boxes { .. }
                | TaskOutput::Quads { .. }
                | TaskOutput::Polygons { .. }
                | TaskOutput::BoxesOrPolygons { .. }),
            ) => crate::draw::summary(parsed),
            _ => c.text.clone(),
        };
        let mut out = std::io::stdout().lock();
        if self.json {
            writeln!(out, "{line}")?;
        } else if self.several {
            writeln!(out, "{}: {shown}", path.display())?;
        } else {
            writeln!(out, "{shown}")?;
        }
        out.flush()?;
        if let Some(f) = &mut self.file {
            f.append(&line)?;
        }
        if let Some((dir, ext)) = &self.dir {
            let file = text_file(dir, ext, path);
            std::fs::write(&file, &c.text).with_context(|| format!("{}", file.display()))?;
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
    let maps = captioner.attention_maps(img, c)?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("image");
    std::fs::create_dir_all(dir).with_context(|| format!("{}", dir.display()))?;
    for (i, (word, tile)) in maps.words.iter().enumerate() {
        let file = dir.join(format!("{stem}_{i:02}_{}.png", sanitize(word)));
        tile.save(&file)
            .with_context(|| format!("{}", file.display()))?;
    }
    let file = dir.join(format!("{stem}_grid.png"));
    maps.grid
        .save(&file)
        .with_context(|| format!("{}", file.display()))?;
    Ok(())
}

fn sanitize(word: &str) -> String {
    word.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The model: `--model-id` fetched from the Hub, else `--model` or the
/// embedded captioner.
fn load_model(args: &Args) -> anyhow::Result<VlModel> {
    match &args.model_id {
        None => {
            if let Some(rev) = &args.revision {
                bail!(
                    "--revision {rev}: a revision of a Hub repository, which needs --model-id ORG/NAME"
                );
            }
            args.model.load()
        }
        #[cfg(feature = "hub")]
        Some(id) => {
            let dir = vl::hub::fetch(id, args.revision.as_deref())?;
            ModelArgs {
                model: Some(dir),
                ..args.model.clone()
            }
            .load()
        }
        #[cfg(not(feature = "hub"))]
        Some(id) => bail!(
            "--model-id {id}{}: this build has no Hub support; rebuild with `--features hub`, \
             or download the checkpoint and pass --model DIR",
            args.revision
                .as_deref()
                .map(|r| format!(" --revision {r}"))
                .unwrap_or_default()
        ),
    }
}

fn caption(args: &Args) -> Result<usize, Fatal> {
    let model = load_model(args).map_err(Fatal)?;
    let model_name = model.path.display().to_string();
    let captioner = Captioner::new(model).with_batch_size(args.batch_size);
    let generation = args
        .generation
        .overrides()
        .apply(captioner.generation(), &captioner.model().config.decoder)
        .map_err(|e| Fatal(e.into()))?;
    // Heatmaps come from the captioning pass itself.
    let generation = match &args.attention_map {
        Some(_) => captioner
            .with_heatmaps(&generation)
            .context("--attention-map")
            .map_err(Fatal)?,
        None => generation,
    };
    // A model without prompt handling is refused before any image is read.
    if let Some(p) = &args.prompt {
        let model = captioner.model();
        let checked = match model.text_encoder {
            Some(_) => model.encoder_prompt_ids(p),
            None => model.prompt_ids(p),
        };
        checked.context("--prompt").map_err(Fatal)?;
    }
    if let Some(task) = args.task {
        if captioner.model().text_encoder.is_none() {
            return Err(Fatal(anyhow::anyhow!(
                "--task {task}: the model takes no task; only Florence-2 checkpoints do"
            )));
        }
        task.prompt(args.text.as_deref())
            .context("--text")
            .map_err(Fatal)?;
    }
    let request = Request {
        generation,
        prompt: args.text.as_deref().or(args.prompt.as_deref()),
        task: args.task,
    };
    let mut listed = args.inputs.clone();
    if let Some(list) = &args.files_from {
        listed.extend(read_list(list).map_err(Fatal)?);
    }
    let (inputs, problems) = expand(&listed);
    let (mut inputs, problems) = match args.shard {
        None => (inputs, problems),
        Some(shard) => (shard.select(inputs), shard.select(problems)),
    };
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
    tracing::info!(images = inputs.len(), model = %model_name, "captioning");
    let bar = if inputs.len() > 1 && std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(Some(inputs.len() as u64), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    let dir = match &args.output_dir {
        None => None,
        Some(dir) => {
            let ext = match captioner.model().config.reader {
                Some(vl::donut::Reader::Nougat) => "mmd",
                _ => "txt",
            };
            // One file per image: two inputs of the same stem are refused
            // before any is read.
            let mut seen: std::collections::HashMap<PathBuf, &Path> = Default::default();
            for p in &inputs {
                if let Some(other) = seen.insert(text_file(dir, ext, p), p) {
                    return Err(Fatal(anyhow::anyhow!(
                        "--output-dir: {} and {} would both write {}",
                        other.display(),
                        p.display(),
                        text_file(dir, ext, p).display()
                    )));
                }
            }
            std::fs::create_dir_all(dir)
                .with_context(|| format!("--output-dir {}", dir.display()))
                .map_err(Fatal)?;
            Some((dir.clone(), ext))
        }
    };
    let mut out = Output {
        json: args.json,
        task: args.task,
        several: inputs.len() > 1,
        failed: 0,
        file,
        dir,
    };
    let io = |e: anyhow::Error| Fatal(e.context("cannot write the results"));
    for (path, e) in &problems {
        out.err(path, e).map_err(io)?;
    }
    let images: Vec<ImageInput> = inputs.iter().map(ImageInput::from).collect();
    // Only writing the results can stop the run; it is kept here.
    let mut write_error = None;
    let captioned = captioner.caption_each(&images, &request, |done| {
        let path = &inputs[done.index];
        let caption = done.caption.map_err(anyhow::Error::from).and_then(|c| {
            if let (Some(dir), Some(img)) = (&args.attention_map, done.image) {
                write_maps(&captioner, dir, path, img, &c).context("attention map")?;
            }
            if let (Some(dir), Some(img), Some(parsed)) = (&args.draw, done.image, &c.task) {
                crate::draw::write(dir, path, img, parsed).context("--draw")?;
            }
            Ok(c)
        });
        let written = match caption {
            Ok(c) => bar.suspend(|| out.ok(path, &c)),
            Err(e) => bar.suspend(|| out.err(path, &e)),
        };
        bar.inc(1);
        written.map_err(|e| {
            let stop = vl::Error::Argument {
                arg: "output",
                reason: one_line(&e),
            };
            write_error = Some(e);
            stop
        })
    });
    if let Some(e) = write_error {
        return Err(io(e));
    }
    captioned.context("captioning").map_err(Fatal)?;
    bar.finish_and_clear();
    Ok(out.failed)
}

/// Runs `vl caption`: 0 when every image was captioned, 1 when some
/// failed (each reported), 2 when nothing could start (the model, a flag,
/// the results file).
pub fn run(args: &Args) -> ExitCode {
    match caption(args) {
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
pub(crate) fn one_line(e: &anyhow::Error) -> String {
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

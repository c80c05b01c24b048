//! The `vl` command: caption images, and train, evaluate, draw and time the
//! shapes captioner.
//!
//! ```text
//! vl caption IMAGE...            the embedded shapes captioner, or --model DIR
//! vl eval-shapes                 scene accuracy on fresh scenes
//! vl train-shapes --out DIR      train the shapes captioner
//! vl render-shapes --out DIR     draw scenes with their true captions
//! vl bench --model DIR           time a checkpoint (one JSON line)
//! ```
//!
//! Every subcommand follows `main → run → ExitCode`: results on stdout,
//! logs and progress on stderr, errors as one `error:` line. Exit codes: 0
//! success; 1 some inputs failed (caption: each reported, the rest done) or
//! the job failed; 2 usage errors and models that cannot be loaded.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub mod args;
pub mod bench;
pub mod caption;
pub mod draw;
pub mod embedded;
pub mod eval;
pub mod experiment;
pub mod inputs;
pub mod plot;
pub mod render;
pub mod serve;
pub mod train;

use args::ThreadArgs;

/// A vision-language decoder: caption images, train and evaluate the
/// shapes captioner.
#[derive(Parser, Debug)]
#[command(name = "vl", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    threads: ThreadArgs,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Caption images (the embedded shapes captioner unless --model is given).
    Caption(Box<caption::Args>),
    /// Measure a captioner's scene accuracy on fresh shapes scenes.
    EvalShapes(eval::Args),
    /// Train the shapes captioner and write a model directory.
    TrainShapes(train::Args),
    /// Draw shapes scenes as PNGs with their true captions.
    RenderShapes(render::Args),
    /// Time a checkpoint: encode, decode per token, captions, caches, memory.
    Bench(bench::Args),
    /// Reproduce one of vl's experiments: its JSON and its plot.
    Experiment(experiment::Args),
    /// Serve a model over HTTP: OpenAI's chat completions with image inputs.
    Serve(Box<serve::Args>),
}

/// Logs (`RUST_LOG`, default `warn`) to stderr.
fn init_logging() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    // A second initialisation (a test calling `main_with` twice) keeps the first.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .try_init();
}

/// Prints a clap error and returns its exit code: help and version on
/// stdout (0); a bad flag value as one `error:` line naming the flag, the
/// value and what is wrong (2); other usage errors as clap renders them,
/// with their hints (2).
fn usage_error(e: &clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if !e.use_stderr() {
        let _ = e.print();
        return ExitCode::SUCCESS;
    }
    match e.kind() {
        ErrorKind::ValueValidation | ErrorKind::InvalidValue => {
            let text = e.render().to_string();
            eprintln!("{}", text.lines().next().unwrap_or("error: invalid value"));
        }
        _ => {
            let _ = e.print();
        }
    }
    ExitCode::from(2)
}

/// Parses `args` (the program name first) and runs the subcommand.
pub fn main_with<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    // Before any thread starts (see `vl::keep_freed_memory`).
    vl::keep_freed_memory();
    init_logging();
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => return usage_error(&e),
    };
    if let Err(e) = cli.threads.apply() {
        eprintln!("error: {}", caption::one_line(&e));
        return ExitCode::from(2);
    }
    let run = || {
        let result = match &cli.command {
            Command::Caption(args) => return caption::run(args),
            Command::EvalShapes(args) => eval::run(args),
            Command::TrainShapes(args) => train::run(args),
            Command::RenderShapes(args) => render::run(args),
            Command::Bench(args) => bench::run(args),
            Command::Experiment(args) => experiment::run(args),
            Command::Serve(args) => serve::run(args),
        };
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {}", caption::one_line(&e));
                ExitCode::FAILURE
            }
        }
    };
    match &cli.command {
        // The server stays off the pool: its async runtime would hold a
        // pool worker for as long as it serves (on two threads, half the
        // machine), and its model thread hands each step to the pool.
        Command::Serve(_) => run(),
        // On a pool worker: vl's parallel kernels then start on this
        // thread instead of waking the pool and parking it.
        _ => rayon::scope(|_| run()),
    }
}

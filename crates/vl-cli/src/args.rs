//! Flags shared by the subcommands, parsed by clap into typed values.

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::{DType, Device};
use vl::settings::{
    cache_format_name, parse_cache_format, parse_device, parse_dtype, GenerationOverrides,
};
use vl::vl_attn::Quantization;
use vl::{LoadOptions, Source, VlModel};

use crate::embedded;

/// Which model, and where and how to run it.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// The model directory: vl's own, a transformers ViT/DeiT + GPT-2/TrOCR
    /// vision-encoder-decoder checkpoint, or a BLIP captioner [default: the
    /// shapes captioner built into this binary].
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// cpu, cuda, cuda:N, metal or metal:N.
    #[arg(long, default_value = "cpu", value_parser = device)]
    pub device: Device,
    /// f32, f16 or bf16.
    #[arg(long, default_value = "f32", value_parser = dtype)]
    pub dtype: DType,
    /// Linear layers (decoder and ViT) at load: 8-bit (q8_0) or 4-bit (q4k) blocks, or dense 16-bit weights (bf16, f16) under activations in --dtype; none = as stored.
    #[arg(long, default_value = "none")]
    pub quantize: Quantization,
    /// The decoder's text cache (its keys and values): bf16 or f16 under f32 activations halves what each decode step reads from it (long outputs: a Nougat page), rounding them as a bf16 model does; q8 (8-bit values with an f16 scale per 32) about halves it again; f32 keeps them exact [default: under --quantize with f32 activations on the CPU, q8 for q8_0 and q4k (bf16 where heads are not a multiple of 32), bf16 or f16 for 16-bit weights; else --dtype].
    #[arg(long, value_name = "FORMAT", value_parser = cache_format)]
    pub text_cache: Option<DType>,
    /// The image's keys and values (projected once per image, read at every step): bf16, f16, f32, or q8 (8-bit values with an f16 scale per 32: about half of bf16's bytes, what a step of many requests reads most of after the weights) [default: under --quantize with f32 activations on the CPU, q8 for q8_0 and q4k (bf16 where heads are not a multiple of 32), bf16 or f16 for 16-bit weights; else --dtype].
    #[arg(long, value_name = "FORMAT", value_parser = cache_format)]
    pub image_cache: Option<DType>,
}

/// What is wrong with a flag's value, without the argument name (clap
/// names the flag).
fn reason(e: vl::Error) -> String {
    match e {
        vl::Error::Argument { reason, .. } => reason,
        other => other.to_string(),
    }
}

/// clap's parser of `--device`.
pub(crate) fn device(name: &str) -> Result<Device, String> {
    parse_device(name).map_err(reason)
}

/// clap's parser of `--dtype`.
pub(crate) fn dtype(name: &str) -> Result<DType, String> {
    parse_dtype(name).map_err(reason)
}

/// clap's parser of `--image-cache` and `--text-cache`.
pub(crate) fn cache_format(name: &str) -> Result<DType, String> {
    parse_cache_format(name).map_err(reason)
}

/// clap's parser of counts that must be positive (`--batch-size`,
/// `--threads`).
pub(crate) fn positive(text: &str) -> Result<NonZeroUsize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => NonZeroUsize::new(n).ok_or_else(|| "must be at least 1".into()),
        Err(e) => Err(format!("not a count: {e}")),
    }
}

/// The kind of `device`, as `--device` spells it.
pub(crate) fn device_name(device: &Device) -> &'static str {
    match device {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
        Device::Metal(_) => "metal",
    }
}

impl ModelArgs {
    /// Loads `--model`, or the embedded shapes captioner, on `--device` in
    /// `--dtype`, quantized as `--quantize` says (part by part during the
    /// load: [`vl::load`]).
    pub fn load(&self) -> anyhow::Result<VlModel> {
        let model = self.load_model()?;
        // What the loader freed goes back; what inference frees is kept
        // (`main_with` set the allocator so).
        vl::return_freed_memory();
        Ok(model)
    }

    fn load_model(&self) -> anyhow::Result<VlModel> {
        let options = LoadOptions::new(self.dtype, &self.device)
            .quantized(self.quantize)
            .with_text_cache(self.text_cache)
            .with_image_cache(self.image_cache);
        let (source, name) = match &self.model {
            Some(dir) => (Source::Dir(dir), format!("the model {}", dir.display())),
            None => (
                Source::Memory {
                    name: Path::new(embedded::NAME),
                    files: embedded::SHAPES_CAPTIONER,
                },
                "the embedded shapes captioner".to_string(),
            ),
        };
        vl::load(source, &options).with_context(|| {
            let mut flags = String::new();
            if self.quantize != Quantization::None {
                flags += &format!(" --quantize {}", self.quantize);
            }
            if let Some(d) = self.text_cache {
                flags += &format!(" --text-cache {}", cache_format_name(d));
            }
            if let Some(d) = self.image_cache {
                flags += &format!(" --image-cache {}", cache_format_name(d));
            }
            match flags.is_empty() {
                true => format!("cannot load {name}"),
                false => format!("cannot load {name} with{flags}"),
            }
        })
    }

    /// What `--model` names, for messages.
    pub fn name(&self) -> String {
        match &self.model {
            Some(dir) => dir.display().to_string(),
            None => embedded::NAME.into(),
        }
    }
}

/// Generation settings over the checkpoint's defaults.
#[derive(clap::Args, Debug, Clone)]
pub struct GenerationArgs {
    /// Most tokens generated per image (default: the checkpoint's, else as many as the model's positions allow).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// No end token before this many tokens (default: the checkpoint's, else 0).
    #[arg(long)]
    pub min_tokens: Option<usize>,
    /// Beam search with this many beams; 1 = no beam search (default: the checkpoint's).
    #[arg(long)]
    pub beams: Option<usize>,
    /// Beam search: finished captions are scored sum_logprobs / len^p (default: the checkpoint's, else 1).
    #[arg(long, allow_negative_numbers = true)]
    pub length_penalty: Option<f32>,
    /// Sample with this temperature; 0 = greedy (default: the checkpoint's).
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: Option<f64>,
    /// Sample from the k most likely tokens only.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample from the smallest set of tokens whose probability reaches p, in (0, 1].
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f64>,
    /// Penalise tokens already generated; 1 = off (default: the checkpoint's).
    #[arg(long, allow_negative_numbers = true)]
    pub repetition_penalty: Option<f32>,
    /// Never repeat an n-gram of this size; 0 = off (default: the checkpoint's).
    #[arg(long)]
    pub no_repeat_ngram_size: Option<usize>,
    /// Seed of sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl GenerationArgs {
    /// The flags as library overrides.
    pub fn overrides(&self) -> GenerationOverrides {
        GenerationOverrides {
            max_tokens: self.max_tokens,
            min_tokens: self.min_tokens,
            beams: self.beams,
            length_penalty: self.length_penalty,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            repetition_penalty: self.repetition_penalty,
            no_repeat_ngram_size: self.no_repeat_ngram_size,
            seed: self.seed,
        }
    }
}

/// Rounds candle's pool workers spin after an op before sleeping (candle's
/// default: 25 000); see [`ThreadArgs::apply`].
pub const SPIN_LIMIT: u32 = 2_000;

/// Threads for CPU work, before any is started.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct ThreadArgs {
    /// Threads for CPU work [default: one per core].
    #[arg(long, global = true, value_parser = positive)]
    pub threads: Option<NonZeroUsize>,
}

impl ThreadArgs {
    /// Sizes candle's thread pool (rayon's global pool, and the matrix
    /// product's, which reads `RAYON_NUM_THREADS`). Call first, before any
    /// tensor work.
    ///
    /// Also shortens how long candle's own worker pool (under its quantized
    /// products and elementwise ops) spins after each op before it sleeps,
    /// unless `CANDLE_BARRIER_POOL_SPIN_LIMIT` is set: at candle's default
    /// (25 000 rounds) that worker keeps a core busy between ops, taking it
    /// from vl's kernels on the rayon pool — the f32 ViT encode took 286–334
    /// ms with it and 229–255 ms with [`SPIN_LIMIT`] on the 2-core machine of
    /// BENCHMARKS.md, while q8_0 decoding (candle's kernels back to back)
    /// kept its speed (9.8 vs 10.1 ms/token; no spinning at all: 11.5).
    pub fn apply(self) -> anyhow::Result<()> {
        if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
            std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", SPIN_LIMIT.to_string());
        }
        let Some(n) = self.threads else {
            return Ok(());
        };
        // Read by candle's `get_num_threads` for every matrix product; set
        // before any thread is spawned.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        rayon::ThreadPoolBuilder::new()
            .num_threads(n.get())
            .build_global()
            .with_context(|| format!("--threads {n}"))
    }
}

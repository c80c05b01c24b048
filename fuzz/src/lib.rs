//! What the fuzz targets and the seed generator share: the packed form of a
//! model directory that the `model_dir` target reads, and the pixel spec of
//! the shipped model that the `image` target preprocesses with.
//!
//! A packed model directory is
//!
//! ```text
//! config length (u32 LE) | tokenizer length (u32 LE) | config.json | tokenizer.json | model.safetensors
//! ```
//!
//! the weights taking the rest. Every byte string unpacks: missing header
//! bytes read as 0 and lengths past the end are cut to what is there, so
//! that mutations of a seed stay meaningful.

use std::path::Path;

use vl_vision::PixelSpec;
use vl::VlConfig;

/// The three files of a model directory, as bytes.
#[derive(Debug, Clone, Copy)]
pub struct ModelDirBytes<'a> {
    /// `config.json`.
    pub config: &'a [u8],
    /// `tokenizer.json`.
    pub tokenizer: &'a [u8],
    /// `model.safetensors`.
    pub weights: &'a [u8],
}

fn take<'a>(data: &mut &'a [u8], n: usize) -> &'a [u8] {
    let (head, rest) = data.split_at(n.min(data.len()));
    *data = rest;
    head
}

fn take_len(data: &mut &[u8]) -> usize {
    let mut le = [0u8; 4];
    let head = take(data, 4);
    le[..head.len()].copy_from_slice(head);
    u32::from_le_bytes(le) as usize
}

/// Splits a packed model directory into its files.
pub fn unpack(mut data: &[u8]) -> ModelDirBytes<'_> {
    let config_len = take_len(&mut data);
    let tokenizer_len = take_len(&mut data);
    let config = take(&mut data, config_len);
    let tokenizer = take(&mut data, tokenizer_len);
    ModelDirBytes {
        config,
        tokenizer,
        weights: data,
    }
}

/// Packs a model directory's files.
///
/// # Panics
/// If the config or the tokenizer is 4 GiB or more.
pub fn pack(files: ModelDirBytes<'_>) -> Vec<u8> {
    let len = |b: &[u8]| u32::try_from(b.len()).expect("under 4 GiB").to_le_bytes();
    let mut out =
        Vec::with_capacity(8 + files.config.len() + files.tokenizer.len() + files.weights.len());
    out.extend_from_slice(&len(files.config));
    out.extend_from_slice(&len(files.tokenizer));
    out.extend_from_slice(files.config);
    out.extend_from_slice(files.tokenizer);
    out.extend_from_slice(files.weights);
    out
}

/// Writes the files into `dir` under the names a model directory uses.
pub fn write_dir(dir: &Path, files: ModelDirBytes<'_>) -> std::io::Result<()> {
    use vl::checkpoint::{CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE};
    std::fs::write(dir.join(CONFIG_FILE), files.config)?;
    std::fs::write(dir.join(TOKENIZER_FILE), files.tokenizer)?;
    std::fs::write(dir.join(WEIGHTS_FILE), files.weights)
}

/// The shipped model's `config.json`.
pub const SHAPES_CONFIG: &str = include_str!("../../models/shapes-captioner/config.json");

/// The pixel spec of the shipped model (64×64, mean and std 0.5).
///
/// # Panics
/// If the shipped config does not parse or has no vision encoder.
pub fn shapes_pixel_spec() -> PixelSpec {
    let cfg: VlConfig = serde_json::from_str(SHAPES_CONFIG).expect("the shipped config parses");
    cfg.vision
        .expect("the shipped model has a vision encoder")
        .pixel_spec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_then_unpack() {
        let files = ModelDirBytes {
            config: b"{}",
            tokenizer: b"tok",
            weights: b"weights",
        };
        let packed = pack(files);
        let back = unpack(&packed);
        assert_eq!(back.config, b"{}");
        assert_eq!(back.tokenizer, b"tok");
        assert_eq!(back.weights, b"weights");
        let short = unpack(&[200, 0]);
        assert!(short.config.is_empty() && short.weights.is_empty());
    }
}

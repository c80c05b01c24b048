//! Writes the committed seed corpus of the fuzz targets into
//! `fuzz/corpus/<target>/`, and, given a directory, the full shipped model
//! packed for the `model_dir` target there (1.2 MB: too large to commit).
//!
//! ```text
//! cargo run --manifest-path fuzz/Cargo.toml --example seeds [-- FULL_MODEL_DIR]
//! ```
//!
//! The tiny model directories are built by the library itself
//! (`VlModel::save` of freshly initialised weights), so they load.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use image::{DynamicImage, ImageFormat, Rgb, RgbImage};
use vl::VlConfig;
use vl_decoder::VisionLanguageDecoder;
use vl_vision::VisionEncoder;
use vl_fuzz::{pack, ModelDirBytes};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const SHAPES_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/shapes-captioner");

/// A word-level tokenizer of six tokens, the fewest the tiny models need.
const TINY_TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":{"type":"WhitespaceSplit"},"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"<pad>":0,"<bos>":1,"<eos>":2,"<unk>":3,"a":4,"circle":5},"unk_token":"<unk>"}}"#;

/// The smallest decoder: one block, width 4, two heads.
const TINY_DECODER: &str = r#"{"vocab_size":6,"hidden_size":4,"num_attention_heads":2,"num_hidden_layers":1,"intermediate_size":4,"max_position_embeddings":4,"memory_dim":4,"bos_token_id":1,"eos_token_id":2,"pad_token_id":0}"#;

fn tiny_config(vision: &str) -> String {
    format!(r#"{{"model_type":"vl","decoder":{TINY_DECODER},"vision":{vision}}}"#)
}

/// Saves a freshly initialised model of `config` with the tiny tokenizer
/// and packs it.
fn tiny_model(config: &str) -> Result<Vec<u8>> {
    let cfg: VlConfig = serde_json::from_str(config)?;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    VisionLanguageDecoder::load(vb.pp("decoder"), &cfg.decoder)?;
    if let Some(v) = &cfg.vision {
        VisionEncoder::load(vb.pp("vision"), v)?;
    }
    let tokenizer = TINY_TOKENIZER
        .parse::<tokenizers::Tokenizer>()
        .map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir()?;
    vl::checkpoint::native::save(dir.path(), &cfg, &vars, &tokenizer)?;
    vl::load(dir.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu))?;
    let weights = std::fs::read(dir.path().join("model.safetensors"))?;
    Ok(pack(ModelDirBytes {
        config: config.as_bytes(),
        tokenizer: TINY_TOKENIZER.as_bytes(),
        weights: &weights,
    }))
}

/// A 6×5 image with a few colours, encoded in `format` after `convert`.
fn image_bytes(format: ImageFormat, convert: fn(DynamicImage) -> DynamicImage) -> Result<Vec<u8>> {
    let img = RgbImage::from_fn(6, 5, |x, y| Rgb([(x * 40) as u8, (y * 50) as u8, 128]));
    let mut out = std::io::Cursor::new(Vec::new());
    convert(DynamicImage::ImageRgb8(img)).write_to(&mut out, format)?;
    Ok(out.into_inner())
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(name), bytes)?;
    println!("{:>8} B  {}", bytes.len(), dir.join(name).display());
    Ok(())
}

fn main() -> Result<()> {
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let shapes = Path::new(SHAPES_DIR);
    let shapes_config = std::fs::read(shapes.join("config.json"))?;
    let shapes_tokenizer = std::fs::read(shapes.join("tokenizer.json"))?;

    let mock = tiny_config(
        r#"{"kind":"mock_vit","image_size":4,"patch_size":2,"num_channels":3,"hidden_size":4,"seed":0}"#,
    );
    let vit = tiny_config(
        r#"{"kind":"vit","image_size":4,"patch_size":2,"num_channels":3,"hidden_size":4,"num_hidden_layers":1,"num_attention_heads":1,"intermediate_size":4}"#,
    );
    let text_only = tiny_config("null");

    let dir = corpus.join("config");
    write(&dir, "shapes-captioner.json", &shapes_config)?;
    write(&dir, "tiny-mock-vit.json", mock.as_bytes())?;
    write(&dir, "tiny-vit.json", vit.as_bytes())?;
    write(&dir, "decoder-gpt2-names.json", br#"{"n_vocab":50,"n_embd":16,"n_head":4,"n_layer":2,"n_inner":64,"n_positions":32,"encoder_hidden_size":24,"activation_function":"gelu_new","layer_norm_epsilon":1e-5,"bos_token_id":0,"eos_token_id":1,"pad_token_id":1,"num_key_value_heads":2,"cross_attention_every":2,"gated_cross_attention":true}"#)?;

    let dir = corpus.join("model_dir");
    write(&dir, "tiny-mock-vit", &tiny_model(&mock)?)?;
    write(&dir, "tiny-vit", &tiny_model(&vit)?)?;
    write(&dir, "tiny-text-only", &tiny_model(&text_only)?)?;
    // The shipped config and tokenizer over the tiny weights: loads as far
    // as the first tensor.
    let tiny_weights = vl_fuzz::unpack(&tiny_model(&vit)?).weights.to_vec();
    write(
        &dir,
        "shapes-captioner-files",
        &pack(ModelDirBytes {
            config: &shapes_config,
            tokenizer: &shapes_tokenizer,
            weights: &tiny_weights,
        }),
    )?;

    let dir = corpus.join("image");
    write(
        &dir,
        "scene_0000.png",
        &std::fs::read(shapes.join("samples/scene_0000.png"))?,
    )?;
    write(&dir, "rgb.png", &image_bytes(ImageFormat::Png, |i| i)?)?;
    write(
        &dir,
        "gray16.png",
        &image_bytes(ImageFormat::Png, |i| {
            DynamicImage::ImageLuma16(i.to_luma16())
        })?,
    )?;
    write(
        &dir,
        "rgba.png",
        &image_bytes(ImageFormat::Png, |i| DynamicImage::ImageRgba8(i.to_rgba8()))?,
    )?;
    write(&dir, "rgb.jpg", &image_bytes(ImageFormat::Jpeg, |i| i)?)?;
    write(
        &dir,
        "rgb.gif",
        &image_bytes(ImageFormat::Gif, |i| DynamicImage::ImageRgba8(i.to_rgba8()))?,
    )?;
    write(&dir, "rgb.bmp", &image_bytes(ImageFormat::Bmp, |i| i)?)?;
    write(&dir, "rgb.tiff", &image_bytes(ImageFormat::Tiff, |i| i)?)?;
    write(&dir, "rgb.webp", &image_bytes(ImageFormat::WebP, |i| i)?)?;

    if let Some(full) = std::env::args().nth(1) {
        let weights = std::fs::read(shapes.join("model.safetensors"))?;
        write(
            Path::new(&full),
            "shapes-captioner-full",
            &pack(ModelDirBytes {
                config: &shapes_config,
                tokenizer: &shapes_tokenizer,
                weights: &weights,
            }),
        )?;
    }
    Ok(())
}

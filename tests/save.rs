//! `VlModel::save` writes any loaded model — vl's own, a transformers
//! checkpoint of each family, dense or converted — as a vl directory that
//! loads back into the same model: dense tensors bit for bit, converted
//! layers to the same logits.
#![allow(missing_docs)]

mod parity;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use parity::{fixture, logits};
use vl::vl_attn::Quantization;
use vl::{LoadOptions, ModelFormat};

/// Every checkpoint layout vl reads.
fn sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    vec![
        root.join("models/shapes-captioner"),
        root.join("models/shapes-captioner-resampler"),
        fixture("hf", "equal"),
        fixture("hf", "narrow"),
        fixture("trocr", "vit_learned"),
        fixture("trocr", "deit_sinusoidal"),
        fixture("trocr", "vit_projected"),
        fixture("blip", "vision32"),
        fixture("blip", "vision24"),
        fixture("document", "donut"),
        fixture("document", "nougat"),
    ]
}

fn bits(t: &Tensor) -> anyhow::Result<Vec<u64>> {
    let t = t.flatten_all()?.to_dtype(DType::F64)?;
    Ok(t.to_vec1::<f64>()?.iter().map(|v| v.to_bits()).collect())
}

fn max_diff(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
    Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?)
}

#[test]
fn a_dense_model_round_trips_bit_for_bit() -> anyhow::Result<()> {
    for src in sources() {
        let name = src.display().to_string();
        let model = vl::load(&src, &LoadOptions::default())?;
        let out = tempfile::tempdir()?;
        model.save(out.path())?;
        let back = vl::load(out.path(), &LoadOptions::default())?;
        assert_eq!(back.format, ModelFormat::Vl, "{name}");
        assert_eq!(back.config.decoder, model.config.decoder, "{name}");
        assert_eq!(back.config.vision, model.config.vision, "{name}");
        assert_eq!(back.pixel_spec()?, model.pixel_spec()?, "{name}");
        assert_eq!(back.generation, model.generation, "{name}");
        let (want, got) = (model.named_tensors()?, back.named_tensors()?);
        assert_eq!(
            want.keys().collect::<Vec<_>>(),
            got.keys().collect::<Vec<_>>(),
            "{name}"
        );
        for (k, w) in &want {
            let g = &got[k];
            assert_eq!((g.dims(), g.dtype()), (w.dims(), w.dtype()), "{name}: {k}");
            assert!(bits(g)? == bits(w)?, "{name}: {k} differs");
        }
        assert_eq!(max_diff(&logits(&model)?, &logits(&back)?)?, 0.0, "{name}");
        assert_eq!(
            back.tokenizer.get_vocab(true),
            model.tokenizer.get_vocab(true),
            "{name}"
        );
    }
    Ok(())
}

/// A converted model (every format; q4k with layers that fell back) is
/// written with its format and loads back to the same logits, its layers in
/// the same formats.
#[test]
fn a_converted_model_round_trips_to_the_same_logits() -> anyhow::Result<()> {
    for src in sources() {
        for q in [
            Quantization::Q8_0,
            Quantization::Q4K,
            Quantization::Bf16,
            Quantization::F16,
        ] {
            let name = format!("{} {q}", src.display());
            let model = vl::load(&src, &LoadOptions::default().quantized(q))?;
            let out = tempfile::tempdir()?;
            model.save(out.path())?;
            let back = vl::load(out.path(), &LoadOptions::default())?;
            assert_eq!(back.quantization, q, "{name}");
            assert_eq!(back.fallbacks, model.fallbacks, "{name}");
            assert_eq!(
                back.decoder.quantization(),
                model.decoder.quantization(),
                "{name}"
            );
            let d = max_diff(&logits(&model)?, &logits(&back)?)?;
            assert_eq!(d, 0.0, "{name}: logits differ by {d}");
            // Block formats are written as their blocks (no f32 copy of
            // those layers); 16-bit ones in their own dtype.
            let file =
                candle_core::safetensors::load(out.path().join("model.safetensors"), &Device::Cpu)?;
            let is_blocks = |k: &String| k.ends_with(".weight.q8_0") || k.ends_with(".weight.q4k");
            match q {
                Quantization::Q8_0 | Quantization::Q4K => {
                    assert!(file.keys().any(is_blocks), "{name}: no blocks written");
                    for k in file.keys().filter(|k| is_blocks(k)) {
                        let dense = &k[..k.rfind('.').unwrap_or(k.len())];
                        assert!(!file.contains_key(dense), "{name}: {dense} written twice");
                        assert_eq!(file[k].dtype(), DType::U8, "{name}: {k}");
                    }
                    // (A head tied to the embedding is not written: it is
                    // converted again from the embedding, written as is.)
                    let tied = model.config.decoder.tie_word_embeddings;
                    for f in model
                        .fallbacks
                        .iter()
                        .filter(|f| !(tied && f.layer == "decoder.lm_head"))
                    {
                        let key = match Quantization::of(f.got) {
                            Some(Quantization::None) | None => format!("{}.weight", f.layer),
                            Some(got) => format!("{}.weight.{got}", f.layer),
                        };
                        assert!(file.contains_key(&key), "{name}: no {key}");
                    }
                }
                _ => {
                    let half = if q == Quantization::Bf16 {
                        DType::BF16
                    } else {
                        DType::F16
                    };
                    let key = "decoder.blocks.0.ffn.up.weight";
                    assert_eq!(file[key].dtype(), half, "{name}: {key}");
                }
            }
        }
    }
    Ok(())
}

/// A directory that cannot be written is named.
#[test]
fn an_unwritable_directory_is_named() -> anyhow::Result<()> {
    let model = vl::load(&sources()[0], &LoadOptions::default())?;
    let tmp = tempfile::tempdir()?;
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "not a directory")?;
    let err = model.save(&file.join("model")).unwrap_err().to_string();
    assert!(err.contains("a-file"), "{err}");
    Ok(())
}

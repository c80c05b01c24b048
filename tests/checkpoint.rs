//! vl model directories: save/load round trip, the mock ViT, bad
//! directories named, device and dtype parsing.
#![allow(missing_docs)]

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use vl::checkpoint::VlConfig;
use vl_decoder::{DecoderConfig, ForwardMasks, VisionLanguageDecoder};
use vl_vision::{MockVit, MockVitConfig, VisionConfig};

const VOCAB: usize = 23;
const MEM: usize = 24;

fn build(cfg: &DecoderConfig) -> (VarMap, VisionLanguageDecoder) {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let model = VisionLanguageDecoder::load(vb.pp("decoder"), cfg).expect("load");
    (vars, model)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .and_then(|d| d.abs())
        .and_then(|d| d.flatten_all())
        .and_then(|d| d.max(0))
        .and_then(|d| d.to_scalar::<f32>())
        .expect("diff")
}

fn tokens(rows: &[&[u32]]) -> Tensor {
    Tensor::new(
        rows.iter().map(|r| r.to_vec()).collect::<Vec<_>>(),
        &Device::Cpu,
    )
    .expect("tokens")
}

fn memory(b: usize, n: usize) -> Tensor {
    Tensor::randn(0f32, 1., (b, n, MEM), &Device::Cpu).expect("memory")
}

#[test]
fn mock_vit_gives_197_deterministic_tokens() -> anyhow::Result<()> {
    let cfg = MockVitConfig::base(MEM, 7);
    let img = Tensor::rand(0f32, 1., (2, 3, 224, 224), &Device::Cpu)?;
    let a = MockVit::new(&cfg, DType::F32, &Device::Cpu)?.forward(&img)?;
    let b = MockVit::new(&cfg, DType::F32, &Device::Cpu)?.forward(&img)?;
    assert_eq!(a.dims(), &[2, 197, MEM]);
    assert_eq!(max_abs_diff(&a, &b), 0.0);
    let other =
        MockVit::new(&MockVitConfig::base(MEM, 8), DType::F32, &Device::Cpu)?.forward(&img)?;
    assert!(max_abs_diff(&a, &other) > 1e-3);
    let err = MockVit::new(&cfg, DType::F32, &Device::Cpu)?
        .forward(&Tensor::zeros((1, 3, 64, 64), DType::F32, &Device::Cpu)?)
        .unwrap_err();
    assert!(err.to_string().contains("224"), "{err}");
    Ok(())
}

fn word_tokenizer(n: usize) -> tokenizers::Tokenizer {
    let vocab: HashMap<String, u32> = (0..n as u32).map(|i| (format!("w{i}"), i)).collect();
    let model = tokenizers::models::wordlevel::WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("w0".into())
        .build()
        .expect("wordlevel");
    tokenizers::Tokenizer::new(model)
}

fn vl_config(cfg: &DecoderConfig) -> VlConfig {
    VlConfig {
        model_type: "vl".into(),
        decoder: cfg.clone(),
        vision: Some(VisionConfig::MockVit(MockVitConfig {
            image_size: 32,
            patch_size: 8,
            num_channels: 3,
            hidden_size: cfg.memory_dim,
            seed: 3,
        })),
        resampler: None,
        quantization: vl::vl_attn::Quantization::None,
        generation: None,
        text_encoder: None,
        tasks: None,
        reader: None,
    }
}

#[test]
fn save_load_round_trip_gives_identical_logits() -> anyhow::Result<()> {
    let cfg = DecoderConfig::tiny(VOCAB, MEM);
    let (vars, model) = build(&cfg);
    let dir = tempfile::tempdir()?;
    vl::checkpoint::native::save(dir.path(), &vl_config(&cfg), &vars, &word_tokenizer(VOCAB))?;
    let loaded = vl::load(dir.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu))?;
    let toks = tokens(&[&[1, 4, 9]]);
    let mem = memory(1, 6);
    // Every tensor comes back bit for bit.
    let saved = candle_core::safetensors::load(dir.path().join("model.safetensors"), &Device::Cpu)?;
    for (name, var) in vars.data().lock().expect("lock").iter() {
        assert_eq!(max_abs_diff(var.as_tensor(), &saved[name]), 0.0, "{name}");
    }
    // Logits agree within 1e-5: gemm's blocking depends on the alignment of
    // the (reloaded) weights, so the last bits may differ.
    let a = model.forward(&toks, Some(&mem), ForwardMasks::default())?;
    let b = loaded
        .decoder
        .forward(&toks, Some(&mem), ForwardMasks::default())?;
    assert!(max_abs_diff(&a, &b) <= 1e-5);
    assert!(loaded.vision.is_some());
    // bf16 loads too, close to f32.
    let half = vl::load(dir.path(), &vl::LoadOptions::new(DType::BF16, &Device::Cpu))?;
    let c = half.decoder.forward(
        &toks,
        Some(&mem.to_dtype(DType::BF16)?),
        ForwardMasks::default(),
    )?;
    assert!(max_abs_diff(&a, &c.to_dtype(DType::F32)?) < 0.5);
    Ok(())
}

#[test]
fn bad_model_directories_name_the_culprit() -> anyhow::Result<()> {
    let cfg = DecoderConfig::tiny(VOCAB, MEM);
    let (vars, _) = build(&cfg);
    let dir = tempfile::tempdir()?;
    vl::checkpoint::native::save(dir.path(), &vl_config(&cfg), &vars, &word_tokenizer(VOCAB))?;
    let weights = dir.path().join("model.safetensors");

    // A missing tensor.
    let mut tensors = candle_core::safetensors::load(&weights, &Device::Cpu)?;
    tensors.remove("decoder.blocks.1.cross_attn.k_proj.weight");
    candle_core::safetensors::save(&tensors, &weights)?;
    let err = vl::load(dir.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.safetensors")
            && err.contains("decoder.blocks.1.cross_attn.k_proj.weight"),
        "{err}"
    );
    assert!(err.contains("missing"), "{err}");

    // A tensor of the wrong shape.
    tensors.insert(
        "decoder.blocks.1.cross_attn.k_proj.weight".into(),
        Tensor::zeros((32, 7), DType::F32, &Device::Cpu)?,
    );
    candle_core::safetensors::save(&tensors, &weights)?;
    let err = vl::load(dir.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu))
        .unwrap_err()
        .to_string();
    assert!(err.contains("[32, 7]") && err.contains("[32, 24]"), "{err}");

    // A tokenizer with fewer tokens than the model's ids.
    word_tokenizer(5)
        .save(dir.path().join("tokenizer.json"), false)
        .map_err(anyhow::Error::msg)?;
    let err = vl::load(dir.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("5 tokens"),
        "{err}"
    );

    // An impossible config.
    let mut bad = vl_config(&cfg);
    bad.decoder.num_attention_heads = 5;
    std::fs::write(dir.path().join("config.json"), serde_json::to_string(&bad)?)?;
    let err = vl::load(dir.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("hidden_size") && err.contains("config.json"),
        "{err}"
    );

    // Not a directory.
    let err = vl::load(
        &dir.path().join("nope"),
        &vl::LoadOptions::new(DType::F32, &Device::Cpu),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("nope"), "{err}");
    Ok(())
}

#[test]
fn devices_and_dtypes_parse_with_clear_errors() {
    use vl::settings::{parse_device, parse_dtype};
    assert!(parse_device("cpu").is_ok());
    assert!(parse_dtype("bf16").is_ok());
    assert!(parse_dtype("f64").unwrap_err().to_string().contains("f64"));
    assert!(parse_device("tpu").unwrap_err().to_string().contains("tpu"));
    if !cfg!(feature = "cuda") {
        assert!(parse_device("cuda:1")
            .unwrap_err()
            .to_string()
            .contains("--features cuda"));
    }
}

/// A checkpoint of a family vl does not load is named for what it is,
/// with what vl loads instead (a TrOCR checkpoint, before vl loaded them,
/// used to report "missing field `n_embd`").
#[test]
fn unsupported_checkpoints_are_named() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let cases = [
        (
            r#"{"model_type": "vision-encoder-decoder", "encoder": {"model_type": "vit"},
                "decoder": {"model_type": "bart", "d_model": 256}}"#,
            "decoder.model_type `bart` is not supported",
        ),
        (
            r#"{"model_type": "vision-encoder-decoder", "encoder": {"model_type": "swin"},
                "decoder": {"model_type": "trocr"}}"#,
            "encoder.model_type `swin` is not supported",
        ),
        (
            r#"{"model_type": "git", "text_config": {}}"#,
            "model_type `git` is not supported",
        ),
        (r#"{"decoder": {}}"#, "model_type `(none)` is not supported"),
    ];
    for (config, says) in cases {
        std::fs::write(dir.path().join("config.json"), config)?;
        let err =
            vl::load(dir.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu)).unwrap_err();
        assert!(
            matches!(err, vl::Error::UnsupportedModel { .. }),
            "{config}: {err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains(says), "{msg}");
        assert!(
            msg.contains("config.json")
                && msg.contains("`vl`")
                && msg.contains("gpt2")
                && msg.contains("trocr")
                && msg.contains("deit"),
            "{msg}"
        );
    }
    Ok(())
}

/// A weights error travels typed from the checked reader to the loader:
/// the file is named once, the tensor with expected vs found.
#[test]
fn weight_errors_name_the_file_once_and_the_tensor() -> anyhow::Result<()> {
    let cfg = DecoderConfig::tiny(VOCAB, MEM);
    let (vars, _) = build(&cfg);
    let dir = tempfile::tempdir()?;
    let tok = word_tokenizer(VOCAB);
    vl::checkpoint::native::save(dir.path(), &vl_config(&cfg), &vars, &tok)?;
    // Load with a wider decoder: every shape is wrong, the first is named.
    let mut wide = vl_config(&cfg);
    wide.decoder.hidden_size = 64;
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&wide)?,
    )?;
    let err = vl::load(dir.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu)).unwrap_err();
    let vl::Error::Weights { path, reason } = &err else {
        panic!("expected a weights error, got {err:?}");
    };
    assert!(path.ends_with("model.safetensors"), "{path:?}");
    assert!(
        reason.contains("decoder.") && reason.contains("64"),
        "{reason}"
    );
    assert!(!reason.contains("model.safetensors"), "{reason}");
    Ok(())
}

/// A model directory with a resampler between the (mock) ViT and the
/// decoder: saved and loaded with it, its weights under `resampler.`, the
/// image reaching the decoder as `num_queries` tokens.
#[test]
fn a_resampler_is_saved_and_loaded_with_the_model() -> anyhow::Result<()> {
    use vl::vl_attn::{Resampler, ResamplerConfig};
    let cfg = DecoderConfig::tiny(VOCAB, MEM);
    let mut config = vl_config(&DecoderConfig {
        memory_dim: 16, // the mock ViT's width; the resampler maps it to MEM
        ..cfg.clone()
    });
    config.decoder = cfg.clone();
    let resampler_cfg = ResamplerConfig::new(MEM, 16, 4, 1, 4);
    config.resampler = Some(resampler_cfg.clone());
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    VisionLanguageDecoder::load(vb.pp("decoder"), &cfg)?;
    let resampler = Resampler::load(vb.pp("resampler"), &resampler_cfg)?;
    let dir = tempfile::tempdir()?;
    vl::checkpoint::native::save(dir.path(), &config, &vars, &word_tokenizer(VOCAB))?;
    let loaded = vl::load(dir.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu))?;
    assert_eq!(loaded.config.resampler.as_ref(), Some(&resampler_cfg));
    let pixels = Tensor::rand(0f32, 1., (2, 3, 32, 32), &Device::Cpu)?;
    let tokens = loaded.encode_pixels(&pixels)?;
    assert_eq!(tokens.dims(), &[2, 4, MEM]);
    // The same as the mock ViT then the resampler as built.
    let vit = MockVit::new(
        &MockVitConfig {
            image_size: 32,
            patch_size: 8,
            num_channels: 3,
            hidden_size: 16,
            seed: 3,
        },
        DType::F32,
        &Device::Cpu,
    )?;
    let want = resampler.forward(&vit.forward(&pixels)?, None)?;
    assert!(max_abs_diff(&tokens, &want) <= 1e-5);

    // A resampler that does not fit the encoder is named.
    let mut bad = config.clone();
    bad.resampler = Some(ResamplerConfig::new(MEM, 20, 4, 1, 4));
    std::fs::write(dir.path().join("config.json"), serde_json::to_string(&bad)?)?;
    let err = vl::load(dir.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("resampler.memory_dim") && err.contains("20"),
        "{err}"
    );
    Ok(())
}

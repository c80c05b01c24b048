//! The decoder: step == full, image context reuse, batch == single, gates,
//! cross-attention every k blocks, model directories.
#![allow(missing_docs)]

use std::collections::HashMap;

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::{VarBuilder, VarMap};
use vl_attn::mask;
use vl_decoder::{
    DecoderConfig, ForwardMasks, MockVit, MockVitConfig, VisionConfig, VisionLanguageDecoder,
    VlConfig, VlModel,
};

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
fn step_by_step_equals_full_forward() -> anyhow::Result<()> {
    let (_v, model) = build(&DecoderConfig::tiny(VOCAB, MEM));
    let toks = tokens(&[&[1, 5, 7, 3, 9, 11], &[1, 4, 4, 8, 2, 0]]);
    let mem = memory(2, 13);
    let full = model.forward(&toks, Some(&mem), ForwardMasks::default())?;
    let ctx = model.image_context(&mem, None)?;
    let mut state = model.start(&ctx, 1)?;
    // A 2-token prompt, then one token at a time.
    let mut steps = vec![model.step(&mut state, &toks.narrow(1, 0, 2)?)?];
    for t in 2..6 {
        steps.push(model.step(&mut state, &toks.narrow(1, t, 1)?)?);
    }
    let stepped = Tensor::cat(&steps, 1)?;
    let diff = max_abs_diff(&stepped, &full);
    assert!(diff <= 1e-5, "step vs full: {diff}");
    assert_eq!(state.position(), 6);
    Ok(())
}

#[test]
fn image_context_reused_equals_recomputed() -> anyhow::Result<()> {
    let (_v, model) = build(&DecoderConfig::tiny(VOCAB, MEM));
    let mem = memory(1, 9);
    let ctx = model.image_context(&mem, None)?;
    let toks = tokens(&[&[1, 6, 2]]);
    // Two independent decodes over one context, and one over a fresh context.
    let run = |ctx: &vl_decoder::ImageContext| -> anyhow::Result<Tensor> {
        let mut s = model.start(ctx, 1)?;
        Ok(model.step(&mut s, &toks)?)
    };
    let (a, b) = (run(&ctx)?, run(&ctx)?);
    let c = run(&model.image_context(&mem, None)?)?;
    assert_eq!(max_abs_diff(&a, &b), 0.0);
    assert_eq!(max_abs_diff(&a, &c), 0.0);
    Ok(())
}

/// Each block's cross-attention projects an image's keys and values once,
/// in `image_context`, however many rows (beams) and steps read them.
#[test]
fn the_image_is_projected_once_per_image() -> anyhow::Result<()> {
    let (_v, model) = build(&DecoderConfig::tiny(VOCAB, MEM));
    let counts = |m: &VisionLanguageDecoder| -> Vec<usize> {
        m.blocks()
            .iter()
            .filter_map(|b| b.cross_branch())
            .map(|c| c.cross_attn.memory_projections())
            .collect()
    };
    let n = counts(&model).len();
    assert!(n > 0, "the tiny decoder has cross-attention");
    assert_eq!(counts(&model), vec![0; n]);
    let ctx = model.image_context(&memory(2, 9), None)?;
    assert_eq!(counts(&model), vec![1; n]);
    // 2 images, 3 rows each: a prompt, then 4 steps.
    let mut state = model.start(&ctx, 3)?;
    let prompt: &[u32] = &[1, 5];
    model.step(&mut state, &tokens(&[prompt; 6]))?;
    for t in 0..4u32 {
        let next: &[u32] = &[2 + t];
        model.step(&mut state, &tokens(&[next; 6]))?;
    }
    assert_eq!(counts(&model), vec![1; n]);
    model.image_context(&memory(1, 4), None)?;
    assert_eq!(counts(&model), vec![2; n]);
    Ok(())
}

#[test]
fn batch_equals_single() -> anyhow::Result<()> {
    let (_v, model) = build(&DecoderConfig::tiny(VOCAB, MEM));
    let toks = tokens(&[&[1, 5, 7], &[1, 3, 3], &[1, 9, 2]]);
    let mem = memory(3, 7);
    let all = model.forward(&toks, Some(&mem), ForwardMasks::default())?;
    for b in 0..3 {
        let one = model.forward(
            &toks.i(b..b + 1)?,
            Some(&mem.i(b..b + 1)?),
            ForwardMasks::default(),
        )?;
        assert!(max_abs_diff(&all.i(b..b + 1)?, &one) <= 1e-5);
    }
    Ok(())
}

#[test]
fn images_of_unequal_token_counts_and_a_missing_image() -> anyhow::Result<()> {
    let (_v, model) = build(&DecoderConfig::tiny(VOCAB, MEM));
    let mem = memory(3, 10);
    let img_mask = mask::image_tokens(&[10, 4, 0], 10, &Device::Cpu)?;
    let toks = tokens(&[&[1, 5], &[1, 5], &[1, 5]]);
    let masks = ForwardMasks {
        text: None,
        image: Some(&img_mask),
    };
    let all = model.forward(&toks, Some(&mem), masks)?;
    // Sample 1 equals running it with only its 4 tokens.
    let one = model.forward(
        &toks.i(1..2)?,
        Some(&mem.i(1..2)?.narrow(1, 0, 4)?),
        ForwardMasks::default(),
    )?;
    assert!(max_abs_diff(&all.i(1..2)?, &one) <= 1e-5);
    // Sample 2 has no image: it equals the text-only decoder.
    let text_only = model.forward(&toks.i(2..3)?, None, ForwardMasks::default())?;
    assert!(max_abs_diff(&all.i(2..3)?, &text_only) <= 1e-5);
    // The same through the image context and a decode state.
    let ctx = model.image_context(&mem, Some(img_mask.clone()))?;
    let mut state = model.start(&ctx, 2)?; // two rows per image
    let rows = toks
        .repeat((1, 1))?
        .index_select(&Tensor::new(&[0u32, 0, 1, 1, 2, 2], &Device::Cpu)?, 0)?;
    let stepped = model.step(&mut state, &rows)?;
    assert!(max_abs_diff(&stepped.i(2..3)?, &all.i(1..2)?) <= 1e-5);
    assert!(max_abs_diff(&stepped.i(5..6)?, &text_only) <= 1e-5);
    Ok(())
}

#[test]
fn zero_gates_equal_the_decoder_without_cross_attention() -> anyhow::Result<()> {
    let cfg = DecoderConfig {
        gated_cross_attention: true,
        ..DecoderConfig::tiny(VOCAB, MEM)
    };
    let (vars, gated) = build(&cfg);
    // Gates start at zero: tanh(0) = 0 closes every cross-attention branch.
    let toks = tokens(&[&[1, 5, 7, 3]]);
    let with_image = gated.forward(&toks, Some(&memory(1, 5)), ForwardMasks::default())?;
    let text_only = gated.forward(&toks, None, ForwardMasks::default())?;
    assert!(max_abs_diff(&with_image, &text_only) <= 1e-6);
    // Opening a gate lets the image in.
    for (name, var) in vars.data().lock().expect("lock").iter() {
        if name.ends_with("cross_attn_gate") {
            var.set(&Tensor::new(&[0.5f32], &Device::Cpu)?)?;
        }
    }
    let opened = gated.forward(&toks, Some(&memory(1, 5)), ForwardMasks::default())?;
    assert!(max_abs_diff(&opened, &text_only) > 1e-4);
    Ok(())
}

#[test]
fn cross_attention_every_two_blocks() -> anyhow::Result<()> {
    let cfg = DecoderConfig {
        num_hidden_layers: 4,
        cross_attention_every: 2,
        ..DecoderConfig::tiny(VOCAB, MEM)
    };
    let (vars, model) = build(&cfg);
    let has: Vec<bool> = model
        .blocks()
        .iter()
        .map(|b| b.has_cross_attention())
        .collect();
    assert_eq!(has, vec![true, false, true, false]);
    let names: Vec<String> = vars.data().lock().expect("lock").keys().cloned().collect();
    assert!(names
        .iter()
        .any(|n| n.starts_with("decoder.blocks.2.cross_attn.q_proj")));
    assert!(!names
        .iter()
        .any(|n| n.starts_with("decoder.blocks.1.cross_attn")));
    let toks = tokens(&[&[1, 2, 3]]);
    let mem = memory(1, 4);
    let full = model.forward(&toks, Some(&mem), ForwardMasks::default())?;
    let ctx = model.image_context(&mem, None)?;
    assert!(ctx.layer(1).is_none() && ctx.layer(2).is_some());
    let mut s = model.start(&ctx, 1)?;
    assert!(max_abs_diff(&model.step(&mut s, &toks)?, &full) <= 1e-5);
    Ok(())
}

#[test]
fn past_max_positions_is_an_error() -> anyhow::Result<()> {
    let cfg = DecoderConfig {
        max_position_embeddings: 4,
        ..DecoderConfig::tiny(VOCAB, MEM)
    };
    let (_v, model) = build(&cfg);
    let mut s = model.start(&model.text_only_context(), 1)?;
    model.step(&mut s, &tokens(&[&[1, 2, 3, 4]]))?;
    let err = model.step(&mut s, &tokens(&[&[5]])).unwrap_err();
    assert!(
        err.to_string().contains("max_position_embeddings 4"),
        "{err}"
    );
    Ok(())
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
    }
}

#[test]
fn save_load_round_trip_gives_identical_logits() -> anyhow::Result<()> {
    let cfg = DecoderConfig::tiny(VOCAB, MEM);
    let (vars, model) = build(&cfg);
    let dir = tempfile::tempdir()?;
    VlModel::save(dir.path(), &vl_config(&cfg), &vars, &word_tokenizer(VOCAB))?;
    let loaded = VlModel::load(dir.path(), DType::F32, &Device::Cpu)?;
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
    let half = VlModel::load(dir.path(), DType::BF16, &Device::Cpu)?;
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
    VlModel::save(dir.path(), &vl_config(&cfg), &vars, &word_tokenizer(VOCAB))?;
    let weights = dir.path().join("model.safetensors");

    // A missing tensor.
    let mut tensors = candle_core::safetensors::load(&weights, &Device::Cpu)?;
    tensors.remove("decoder.blocks.1.cross_attn.k_proj.weight");
    candle_core::safetensors::save(&tensors, &weights)?;
    let err = VlModel::load(dir.path(), DType::F32, &Device::Cpu)
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
    let err = VlModel::load(dir.path(), DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("[32, 7]") && err.contains("[32, 24]"), "{err}");

    // A tokenizer with fewer tokens than the model's ids.
    word_tokenizer(5)
        .save(dir.path().join("tokenizer.json"), false)
        .map_err(anyhow::Error::msg)?;
    let err = VlModel::load(dir.path(), DType::F32, &Device::Cpu)
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
    let err = VlModel::load(dir.path(), DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("hidden_size") && err.contains("config.json"),
        "{err}"
    );

    // Not a directory.
    let err = VlModel::load(&dir.path().join("nope"), DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("nope"), "{err}");
    Ok(())
}

#[test]
fn devices_and_dtypes_parse_with_clear_errors() {
    use vl_decoder::dir::{parse_device, parse_dtype};
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

/// Training must reach every parameter: candle-nn's fused layer norm has no
/// backward pass, and a cut graph trains only the output layer.
#[test]
fn every_parameter_receives_a_gradient() -> anyhow::Result<()> {
    use candle_core::D;
    use vl_decoder::{VisionEncoder, VitConfig};
    let cfg = DecoderConfig {
        gated_cross_attention: true,
        ..DecoderConfig::tiny(VOCAB, MEM)
    };
    let vit_cfg = VitConfig {
        image_size: 16,
        patch_size: 8,
        num_channels: 3,
        hidden_size: MEM,
        num_hidden_layers: 1,
        num_attention_heads: 4,
        intermediate_size: 32,
        layer_norm_eps: 1e-5,
        image_mean: [0.5; 3],
        image_std: [0.5; 3],
        hidden_act: vl_decoder::Activation::Gelu,
        output_size: None,
    };
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let decoder = VisionLanguageDecoder::load(vb.pp("decoder"), &cfg)?;
    let vision = VisionEncoder::load(vb.pp("vision"), &VisionConfig::Vit(vit_cfg))?;
    // Open the gates, or the cross-attention branch has a zero gradient.
    vl_decoder::init::seeded_init(&vars, 1)?;
    for (name, var) in vars.data().lock().expect("lock").iter() {
        if name.ends_with("cross_attn_gate") {
            var.set(&Tensor::new(&[0.5f32], &Device::Cpu)?)?;
        }
    }
    let pixels = Tensor::randn(0f32, 1., (2, 3, 16, 16), &Device::Cpu)?;
    let toks = tokens(&[&[1, 5, 7, 3], &[1, 4, 4, 8]]);
    let logits = decoder.forward(
        &toks,
        Some(&vision.forward(&pixels)?),
        ForwardMasks::default(),
    )?;
    let loss = candle_nn::ops::log_softmax(&logits, D::Minus1)?
        .mean_all()?
        .neg()?;
    let grads = loss.backward()?;
    for (name, var) in vars.data().lock().expect("lock").iter() {
        let g = grads.get(var.as_tensor());
        assert!(g.is_some(), "{name} has no gradient");
    }
    Ok(())
}

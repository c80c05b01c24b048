//! The decoder's dropout: inference is bit-identical with and without the
//! config's dropout fields; training drops, reproducibly per seed, and the
//! gradients flow; the fused backend is refused while attention dropout is
//! active.
#![allow(missing_docs)]

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use vl_decoder::{
    generate, DecoderConfig, ForwardMasks, GenerationConfig, Mode, VisionLanguageDecoder,
};

const VOCAB: usize = 23;
const MEM: usize = 24;
const SEED: u64 = 11;
/// Dropouts of the decoder under test (attention, residual, embedding).
const P: (f64, f64, f64) = (0.3, 0.2, 0.1);
/// Tokens generated in the inference comparison.
const MAX_TOKENS: usize = 6;

fn with_dropout(cfg: &DecoderConfig) -> DecoderConfig {
    DecoderConfig {
        attention_dropout: P.0,
        residual_dropout: P.1,
        embedding_dropout: P.2,
        ..cfg.clone()
    }
}

/// Two decoders over the same weights (plain tensors, so that every
/// backend serves them): without dropout and with the dropouts [`P`].
fn pair(cfg: &DecoderConfig) -> (VisionLanguageDecoder, VisionLanguageDecoder) {
    pair_with(cfg, &with_dropout(cfg))
}

/// Decoders of `cfg` and of `dropped_cfg` over the same weights.
fn pair_with(
    cfg: &DecoderConfig,
    dropped_cfg: &DecoderConfig,
) -> (VisionLanguageDecoder, VisionLanguageDecoder) {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    VisionLanguageDecoder::load(vb, cfg).expect("init");
    let tensors: HashMap<String, Tensor> = vars
        .data()
        .lock()
        .expect("vars")
        .iter()
        .map(|(name, var)| (name.clone(), var.as_tensor().detach()))
        .collect();
    let frozen = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let plain = VisionLanguageDecoder::load(frozen.clone(), cfg).expect("plain");
    let dropped = VisionLanguageDecoder::load(frozen, dropped_cfg).expect("dropped");
    (plain, dropped)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .and_then(|d| d.abs())
        .and_then(|d| d.flatten_all())
        .and_then(|d| d.max(0))
        .and_then(|d| d.to_scalar::<f32>())
        .expect("diff")
}

fn inputs() -> (Tensor, Tensor) {
    let toks =
        Tensor::new(&[[1u32, 5, 7, 3, 9, 11], [1, 4, 4, 8, 2, 0]], &Device::Cpu).expect("tokens");
    let mem = Tensor::randn(0f32, 1., (2, 13, MEM), &Device::Cpu).expect("memory");
    (toks, mem)
}

/// In inference (the default, and again after training), a decoder with
/// dropout fields gives exactly the logits and generations of one without:
/// full forward and cached decoding, gated branches included, on every
/// backend.
#[test]
fn inference_is_bit_identical_with_and_without_dropout() -> anyhow::Result<()> {
    let cfg = DecoderConfig {
        gated_cross_attention: true,
        gated_cross_ffn: true,
        ..DecoderConfig::tiny(VOCAB, MEM)
    };
    let (mut plain, mut dropped) = pair(&cfg);
    let (toks, mem) = inputs();
    for backend in [
        vl_attn::Backend::Auto,
        vl_attn::Backend::Reference,
        vl_attn::Backend::Fused,
    ] {
        plain.set_backend(backend);
        dropped.set_backend(backend);
        let want = plain.forward(&toks, Some(&mem), ForwardMasks::default())?;
        let got = dropped.forward(&toks, Some(&mem), ForwardMasks::default())?;
        assert_eq!(max_abs_diff(&want, &got), 0.0, "{backend:?}");
        dropped.set_mode(Mode::training(SEED));
        dropped.set_mode(Mode::Inference);
        let again = dropped.forward(&toks, Some(&mem), ForwardMasks::default())?;
        assert_eq!(
            max_abs_diff(&want, &again),
            0.0,
            "{backend:?} after training"
        );
        let gen = GenerationConfig::greedy(&cfg, MAX_TOKENS);
        let caption = |m: &VisionLanguageDecoder| -> anyhow::Result<Vec<Vec<u32>>> {
            let ctx = m.image_context(&mem, None)?;
            Ok(generate(m, &ctx, &gen, &mut |_| {})?
                .into_iter()
                .map(|g| g.tokens)
                .collect())
        };
        assert_eq!(caption(&plain)?, caption(&dropped)?, "{backend:?}");
    }
    Ok(())
}

/// Training with every dropout at 0 is inference, bit for bit.
#[test]
fn training_without_dropout_is_inference() -> anyhow::Result<()> {
    let (mut plain, _) = pair(&DecoderConfig::tiny(VOCAB, MEM));
    let (toks, mem) = inputs();
    let want = plain.forward(&toks, Some(&mem), ForwardMasks::default())?;
    plain.set_mode(Mode::training(SEED));
    let got = plain.forward(&toks, Some(&mem), ForwardMasks::default())?;
    assert_eq!(max_abs_diff(&want, &got), 0.0);
    Ok(())
}

/// In training the outputs change; the same seed gives the same outputs,
/// another seed others.
#[test]
fn training_drops_reproducibly() -> anyhow::Result<()> {
    let (plain, mut dropped) = pair(&DecoderConfig::tiny(VOCAB, MEM));
    let (toks, mem) = inputs();
    let mut run = |seed| -> anyhow::Result<Tensor> {
        dropped.set_mode(Mode::training(seed));
        Ok(dropped.forward(&toks, Some(&mem), ForwardMasks::default())?)
    };
    let (a, b, c) = (run(SEED)?, run(SEED)?, run(SEED + 1)?);
    let inference = plain.forward(&toks, Some(&mem), ForwardMasks::default())?;
    assert_eq!(max_abs_diff(&a, &b), 0.0, "same seed");
    assert!(max_abs_diff(&a, &c) > 0.0, "another seed");
    assert!(
        max_abs_diff(&a, &inference) > 0.0,
        "training dropped nothing"
    );
    Ok(())
}

/// Gradients reach every weight through the dropped attentions, branches
/// and embeddings.
#[test]
fn gradients_flow_in_training() -> anyhow::Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let mut model =
        VisionLanguageDecoder::load(vb, &with_dropout(&DecoderConfig::tiny(VOCAB, MEM)))?;
    model.set_mode(Mode::training(SEED));
    let (toks, mem) = inputs();
    let logits = model.forward(&toks, Some(&mem), ForwardMasks::default())?;
    let grads = logits.sqr()?.mean_all()?.backward()?;
    for (name, var) in vars.data().lock().expect("vars").iter() {
        let g = grads
            .get(var.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("{name}: no gradient"))?;
        let norm = g.sqr()?.sum_all()?.to_scalar::<f32>()?;
        assert!(
            norm.is_finite() && norm > 0.0,
            "{name}: gradient norm {norm}"
        );
    }
    Ok(())
}

/// A decoder set to the fused backend is refused in training while
/// attention dropout is active, naming the backend.
#[test]
fn fused_backend_is_refused_in_training() -> anyhow::Result<()> {
    let (_, mut dropped) = pair(&DecoderConfig::tiny(VOCAB, MEM));
    dropped.set_backend(vl_attn::Backend::Fused);
    dropped.set_mode(Mode::training(SEED));
    let (toks, mem) = inputs();
    let err = dropped
        .forward(&toks, Some(&mem), ForwardMasks::default())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.starts_with("backend:") && err.contains("dropout"),
        "{err}"
    );
    Ok(())
}

/// Cross-attention-map dropout acts in inference: the logits change,
/// reproducibly per seed, a text-only pass (no cross-attention) does not,
/// rate 0 and `set_mode` give the plain decoder back bit for bit, and a
/// rate outside [0, 1) is refused by name.
#[test]
fn cross_map_dropout_acts_at_inference() -> anyhow::Result<()> {
    let (plain, mut model) = pair_with(
        &DecoderConfig::tiny(VOCAB, MEM),
        &DecoderConfig::tiny(VOCAB, MEM),
    );
    let (toks, mem) = inputs();
    let want = plain.forward(&toks, Some(&mem), ForwardMasks::default())?;
    let text_only = plain.forward(&toks, None, ForwardMasks::default())?;
    let mut run = |seed| -> anyhow::Result<(Tensor, Tensor)> {
        model.set_cross_map_dropout(0.5, seed)?;
        Ok((
            model.forward(&toks, Some(&mem), ForwardMasks::default())?,
            model.forward(&toks, None, ForwardMasks::default())?,
        ))
    };
    let ((a, a_text), (b, _), (c, _)) = (run(SEED)?, run(SEED)?, run(SEED + 1)?);
    assert!(max_abs_diff(&a, &want) > 1e-3, "nothing was dropped");
    assert_eq!(max_abs_diff(&a, &b), 0.0, "same seed");
    assert!(max_abs_diff(&a, &c) > 0.0, "another seed");
    assert_eq!(max_abs_diff(&a_text, &text_only), 0.0, "text only");
    assert!(!model.mode().is_training(), "the mode stays inference");

    model.set_cross_map_dropout(0.0, SEED)?;
    let off = model.forward(&toks, Some(&mem), ForwardMasks::default())?;
    assert_eq!(max_abs_diff(&off, &want), 0.0, "rate 0");
    model.set_cross_map_dropout(0.5, SEED)?;
    model.set_mode(Mode::Inference);
    let reset = model.forward(&toks, Some(&mem), ForwardMasks::default())?;
    assert_eq!(max_abs_diff(&reset, &want), 0.0, "set_mode");

    let err = model
        .set_cross_map_dropout(1.0, SEED)
        .unwrap_err()
        .to_string();
    assert!(err.contains("cross_attention_map_dropout"), "{err}");
    Ok(())
}

//! The decoder layouts besides the default pre-LN GPT-2 one: post-LN
//! blocks without a final norm, scaled token embeddings, an embedding
//! norm, learned positions from an offset, sinusoidal positions with
//! fairseq's padding index, an untied head. Each must decode step by step
//! as it forwards in one pass, and a batch as its samples.
#![allow(missing_docs)]

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::{VarBuilder, VarMap};
use vl_decoder::positions::sinusoidal_table;
use vl_decoder::{
    DecoderConfig, DecoderError, DecoderParts, ForwardMasks, NormPlacement, PositionEmbedding,
    Positions, StepOptions, VisionLanguageDecoder,
};

const VOCAB: usize = 23;
const MEM: usize = 24;
/// fairseq's padding index in these tests (TrOCR's `pad_token_id`).
const PAD: u32 = 1;
/// Step-by-step and batched decoding against one pass, f32: the largest
/// difference, relative to the largest output (at least 1). The two sum
/// in different orders (one row's products on vl's GEMV, many rows' on
/// candle's matmul): measured up to 2.2e-6 over 40 runs of unseeded
/// weights, whose outputs reach 1.5 to 5.3 in magnitude; an absolute 1e-5
/// failed 2 of those 40 runs.
const TOL: f32 = 1e-5;

/// `max |a - b|` and the bound it must stay within: [`TOL`] times the
/// largest `|b|` (at least 1).
fn diff_and_bound(a: &Tensor, b: &Tensor) -> anyhow::Result<(f32, f32)> {
    let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    Ok((max_abs_diff(a, b)?, TOL * scale.max(1.0)))
}

/// TrOCR's layout: post-LN, no final norm, scaled embeddings, an
/// embedding norm, an untied head; positions as `positions`.
fn trocr_like(positions: PositionEmbedding) -> DecoderConfig {
    let mut cfg = DecoderConfig::tiny(VOCAB, MEM);
    cfg.norm_placement = NormPlacement::Post;
    cfg.final_norm = false;
    cfg.scale_embedding = true;
    cfg.layernorm_embedding = true;
    cfg.tie_word_embeddings = false;
    cfg.position_embedding = positions;
    match positions {
        PositionEmbedding::Learned => cfg.position_offset = 2,
        PositionEmbedding::Sinusoidal => cfg.position_padding_idx = Some(PAD),
    }
    cfg
}

fn build(cfg: &DecoderConfig) -> anyhow::Result<(VarMap, VisionLanguageDecoder)> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let model = VisionLanguageDecoder::load(vb, cfg)?;
    // Norms start at (1, 0): perturb every variable so that none is inert.
    for var in vars.data().lock().expect("lock").values() {
        let t = var.as_tensor();
        let noise = Tensor::randn(0f32, 0.1, t.dims(), &Device::Cpu)?;
        var.set(&(t + noise)?)?;
    }
    Ok((vars, model))
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
    assert_eq!(a.dims(), b.dims());
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

fn tokens(rows: &[&[u32]]) -> anyhow::Result<Tensor> {
    Ok(Tensor::new(
        rows.iter().map(|r| r.to_vec()).collect::<Vec<_>>(),
        &Device::Cpu,
    )?)
}

fn memory(b: usize, n: usize) -> anyhow::Result<Tensor> {
    Ok(Tensor::randn(0f32, 1., (b, n, MEM), &Device::Cpu)?)
}

fn layouts() -> Vec<(&'static str, DecoderConfig)> {
    let mut post_only = DecoderConfig::tiny(VOCAB, MEM);
    post_only.norm_placement = NormPlacement::Post;
    let mut gated_post = trocr_like(PositionEmbedding::Learned);
    gated_post.gated_cross_attention = true;
    gated_post.gated_cross_ffn = true;
    vec![
        ("post-LN", post_only),
        ("learned, offset 2", trocr_like(PositionEmbedding::Learned)),
        (
            "sinusoidal, padding",
            trocr_like(PositionEmbedding::Sinusoidal),
        ),
        ("gated post-LN", gated_post),
        ("bert-like, output transform", bert_like()),
    ]
}

/// BLIP's text decoder (BERT): post-LN, no final norm, an unscaled
/// embedding norm, learned positions from 0, a transform before the tied
/// head.
fn bert_like() -> DecoderConfig {
    let mut cfg = DecoderConfig::tiny(VOCAB, MEM);
    cfg.norm_placement = NormPlacement::Post;
    cfg.final_norm = false;
    cfg.layernorm_embedding = true;
    cfg.output_transform = true;
    cfg
}

/// The output transform acts, and parts must match the config's flag.
#[test]
fn output_transform_acts_and_must_fit() -> anyhow::Result<()> {
    let cfg = bert_like();
    let (vars, model) = build(&cfg)?;
    let toks = tokens(&[&[2, 5, 7]])?;
    let mem = memory(1, 4)?;
    let with = model.forward(&toks, Some(&mem), ForwardMasks::default())?;
    let mut plain = cfg.clone();
    plain.output_transform = false;
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let without = VisionLanguageDecoder::load(vb, &plain)?;
    let d = max_abs_diff(
        &with,
        &without.forward(&toks, Some(&mem), ForwardMasks::default())?,
    )?;
    assert!(d > 1e-3, "output_transform ignored");
    let s = serde_json::to_string(&cfg)?;
    assert!(s.contains("\"output_transform\":true"), "{s}");
    assert!(!serde_json::to_string(&plain)?.contains("output_transform"));
    let h = cfg.hidden_size;
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let bad = candle_nn::Linear::new(Tensor::zeros((h, h + 1), DType::F32, &Device::Cpu)?, None);
    let norm = vl_decoder::LayerNorm::load(h, 1e-5, vb.pp("tn"))?;
    match vl_decoder::OutputTransform::from_parts(bad, norm, &cfg) {
        Err(DecoderError::Argument { arg, .. }) => assert_eq!(arg, "output_transform.dense"),
        other => panic!("expected an argument error, got {other:?}"),
    }
    Ok(())
}

#[test]
fn cached_decoding_equals_the_full_forward() -> anyhow::Result<()> {
    for (name, cfg) in layouts() {
        let (_v, model) = build(&cfg)?;
        let toks = tokens(&[&[2, 5, 7, 3, 9, 11], &[2, 4, 4, 8, 0, 6]])?;
        let mem = memory(2, 9)?;
        let full = model.forward(&toks, Some(&mem), ForwardMasks::default())?;
        let ctx = model.image_context(&mem, None)?;
        let mut state = model.start(&ctx, 1)?;
        let mut steps = vec![
            model
                .step(&mut state, &toks.narrow(1, 0, 2)?, StepOptions::all())?
                .values,
        ];
        for t in 2..6 {
            steps.push(
                model
                    .step(&mut state, &toks.narrow(1, t, 1)?, StepOptions::all())?
                    .values,
            );
        }
        let (d, bound) = diff_and_bound(&Tensor::cat(&steps, 1)?, &full)?;
        assert!(d <= bound, "{name}: step vs full differ by {d} > {bound}");
        // Text only: the cross branches (and their post-norms) are skipped.
        let text = model.forward(&toks, None, ForwardMasks::default())?;
        let mut state = model.start(&model.text_only_context(), 2)?;
        let (d, bound) = diff_and_bound(
            &model.step(&mut state, &toks, StepOptions::all())?.values,
            &text,
        )?;
        assert!(
            d <= bound,
            "{name}: text-only step vs full differ by {d} > {bound}"
        );
        assert!(max_abs_diff(&text, &full)? > 1e-3, "{name}: image ignored");
    }
    Ok(())
}

#[test]
fn batch_equals_per_sample() -> anyhow::Result<()> {
    for (name, cfg) in layouts() {
        let (_v, model) = build(&cfg)?;
        let toks = tokens(&[&[2, 5, 7], &[2, 3, 3], &[2, 9, 2]])?;
        let mem = memory(3, 7)?;
        let all = model.forward(&toks, Some(&mem), ForwardMasks::default())?;
        for b in 0..3 {
            let one = model.forward(
                &toks.i(b..b + 1)?,
                Some(&mem.i(b..b + 1)?),
                ForwardMasks::default(),
            )?;
            let (d, bound) = diff_and_bound(&all.i(b..b + 1)?, &one)?;
            assert!(d <= bound, "{name}: sample {b} differs by {d} > {bound}");
        }
    }
    Ok(())
}

/// The options act: each changes the logits of the same weights.
#[test]
fn each_option_changes_the_output() -> anyhow::Result<()> {
    let base = trocr_like(PositionEmbedding::Learned);
    let (vars, model) = build(&base)?;
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let toks = tokens(&[&[2, 5, 7, 3]])?;
    let mem = memory(1, 5)?;
    let want = model.forward(&toks, Some(&mem), ForwardMasks::default())?;
    let mut pre = base.clone();
    pre.norm_placement = NormPlacement::Pre;
    let mut unscaled = base.clone();
    unscaled.scale_embedding = false;
    for (name, cfg) in [("pre-LN", pre), ("unscaled", unscaled)] {
        let other = VisionLanguageDecoder::load(vb.clone(), &cfg)?;
        let got = other.forward(&toks, Some(&mem), ForwardMasks::default())?;
        assert!(max_abs_diff(&got, &want)? > 1e-3, "{name} changed nothing");
    }
    Ok(())
}

/// fairseq's positions: row `PAD` is zero and read by padding tokens; the
/// others count from `PAD + 1`, skipping padding, after `past` tokens.
#[test]
fn sinusoidal_positions_skip_padding() -> anyhow::Result<()> {
    let cfg = trocr_like(PositionEmbedding::Sinusoidal);
    let dev = Device::Cpu;
    let table = sinusoidal_table(70, 32, Some(PAD), DType::F32, &dev)?;
    assert_eq!(
        table
            .i(PAD as usize)?
            .abs()?
            .sum_all()?
            .to_scalar::<f32>()?,
        0.0
    );
    // Row 2, column 0: sin(2 * f_0) with f_0 = 1; column 16: cos(2).
    let row: Vec<f32> = table.i(2)?.to_vec1()?;
    assert!((row[0] - 2f32.sin()).abs() < 1e-6 && (row[16] - 2f32.cos()).abs() < 1e-6);
    // Column 1: sin(2 * exp(-ln(10000) / 15)).
    let f1 = (-(10000f64.ln()) / 15.0).exp();
    assert!((row[1] as f64 - (2.0 * f1).sin()).abs() < 1e-6);
    let positions = Positions::for_config(&cfg, None, DType::F32, &dev)?;
    let got = positions.forward(&tokens(&[&[5, PAD, 7], &[PAD, 4, 4]])?, 3)?;
    for (b, rows) in [[5, 1, 6], [1, 5, 6]].iter().enumerate() {
        for (t, &r) in rows.iter().enumerate() {
            let d = max_abs_diff(&got.i((b, t))?, &table.i(r)?)?;
            assert_eq!(d, 0.0, "row {b}, token {t}: expected table row {r}");
        }
    }
    // An odd width gets a zero column, as transformers appends.
    let odd = sinusoidal_table(4, 9, None, DType::F32, &dev)?;
    assert_eq!(odd.i((3, 8))?.to_scalar::<f32>()?, 0.0);
    Ok(())
}

#[test]
fn impossible_layouts_are_config_errors() {
    let field = |cfg: DecoderConfig| match cfg.validate() {
        Err(DecoderError::Config { field, .. }) => field,
        other => panic!("expected a config error, got {other:?}"),
    };
    let mut cfg = DecoderConfig::tiny(VOCAB, MEM);
    cfg.position_padding_idx = Some(PAD);
    assert_eq!(field(cfg), "position_padding_idx");
    let mut cfg = trocr_like(PositionEmbedding::Sinusoidal);
    cfg.position_offset = 2;
    assert_eq!(field(cfg), "position_offset");
    let mut cfg = trocr_like(PositionEmbedding::Sinusoidal);
    cfg.hidden_size = 2;
    cfg.num_attention_heads = 1;
    assert_eq!(field(cfg), "hidden_size");
    let mut cfg = trocr_like(PositionEmbedding::Learned);
    cfg.max_position_embeddings = u32::MAX as usize;
    assert_eq!(field(cfg), "max_position_embeddings");
}

/// Parts that do not fit the layout name themselves.
#[test]
fn parts_must_fit_the_layout() -> anyhow::Result<()> {
    let learned = trocr_like(PositionEmbedding::Learned);
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let full = |cfg: &DecoderConfig| -> anyhow::Result<DecoderParts> {
        let h = cfg.hidden_size;
        let table = |n: usize| Tensor::randn(0f32, 0.02, (n, h), &Device::Cpu);
        Ok(DecoderParts {
            embed_tokens: candle_nn::Embedding::new(table(VOCAB)?, h),
            embed_positions: Some(candle_nn::Embedding::new(table(64 + 2)?, h)),
            embedding_norm: Some(vl_decoder::LayerNorm::load(h, 1e-5, vb.pp("en"))?),
            blocks: (0..cfg.num_hidden_layers)
                .map(|i| vl_decoder::DecoderBlock::load(vb.pp("b").pp(i), cfg, i))
                .collect::<Result<_, _>>()?,
            final_norm: None,
            output_transform: None,
            lm_head: candle_nn::Linear::new(table(VOCAB)?, None),
        })
    };
    let arg = |r: vl_decoder::Result<VisionLanguageDecoder>| match r {
        Err(DecoderError::Argument { arg, .. }) => arg,
        other => panic!("expected an argument error, got {other:?}"),
    };
    VisionLanguageDecoder::from_parts(full(&learned)?, &learned)?;
    let mut parts = full(&learned)?;
    parts.embed_positions = Some(candle_nn::Embedding::new(
        Tensor::zeros((64, 32), DType::F32, &Device::Cpu)?,
        32,
    ));
    assert_eq!(
        arg(VisionLanguageDecoder::from_parts(parts, &learned)),
        "embed_positions"
    );
    let mut parts = full(&learned)?;
    parts.embedding_norm = None;
    assert_eq!(
        arg(VisionLanguageDecoder::from_parts(parts, &learned)),
        "embedding_norm"
    );
    let parts = full(&learned)?;
    let sinusoidal = trocr_like(PositionEmbedding::Sinusoidal);
    assert_eq!(
        arg(VisionLanguageDecoder::from_parts(parts, &sinusoidal)),
        "embed_positions"
    );
    let mut with_norm = learned.clone();
    with_norm.final_norm = true;
    assert_eq!(
        arg(VisionLanguageDecoder::from_parts(
            full(&learned)?,
            &with_norm
        )),
        "final_norm"
    );
    Ok(())
}

/// The default layout writes none of the new keys: configs saved before
/// them read back the same, and so do saved ones.
#[test]
fn defaults_serialise_as_before() -> anyhow::Result<()> {
    let json = serde_json::to_value(DecoderConfig::tiny(VOCAB, MEM))?;
    for key in [
        "norm_placement",
        "final_norm",
        "scale_embedding",
        "layernorm_embedding",
        "position_embedding",
        "position_offset",
        "position_padding_idx",
    ] {
        assert!(json.get(key).is_none(), "{key} written: {json}");
    }
    let cfg = trocr_like(PositionEmbedding::Sinusoidal);
    let back: DecoderConfig = serde_json::from_str(&serde_json::to_string(&cfg)?)?;
    assert_eq!(back, cfg);
    Ok(())
}

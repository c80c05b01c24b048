//! Caller input the decoder must reject with an error that names the
//! argument, with the expected and the actual value — never a panic.
#![allow(missing_docs)]

use candle_core::{DType, Device, Tensor};
use candle_nn::{Embedding, Linear, VarBuilder, VarMap};
use vl_attn::mask;
use vl_decoder::{
    generate, DecoderBlock, DecoderConfig, DecoderError, DecoderParts, ForwardMasks,
    GenerationConfig, LayerNorm, StepOptions, Strategy, VisionLanguageDecoder,
};

const VOCAB: usize = 23;
const MEM: usize = 24;

fn config(edit: impl FnOnce(&mut DecoderConfig)) -> DecoderConfig {
    let mut cfg = DecoderConfig::tiny(VOCAB, MEM);
    edit(&mut cfg);
    cfg
}

fn build(cfg: &DecoderConfig) -> anyhow::Result<(VarMap, VisionLanguageDecoder)> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let model = VisionLanguageDecoder::load(vb, cfg)?;
    Ok((vars, model))
}

fn memory(images: usize, len: usize) -> anyhow::Result<Tensor> {
    Ok(Tensor::randn(0f32, 1., (images, len, MEM), &Device::Cpu)?)
}

fn tokens(rows: usize, len: usize) -> anyhow::Result<Tensor> {
    Ok(Tensor::ones((rows, len), DType::U32, &Device::Cpu)?)
}

/// Asserts `r` is an [`DecoderError::Argument`] naming `arg` whose message
/// holds every one of `parts` (the expected and the actual values).
#[track_caller]
fn assert_arg<T: std::fmt::Debug>(r: vl_decoder::Result<T>, arg: &str, parts: &[&str]) {
    match r {
        Err(DecoderError::Argument { arg: got, reason }) => {
            assert_eq!(got, arg, "{reason}");
            for p in parts {
                assert!(reason.contains(p), "{arg}: {reason:?} lacks {p:?}");
            }
        }
        other => panic!("expected an argument error naming {arg}, got {other:?}"),
    }
}

#[test]
fn step_last_with_no_tokens_is_an_error() -> anyhow::Result<()> {
    let (_v, model) = build(&config(|_| {}))?;
    for ctx in [
        model.text_only_context(),
        model.image_context(&memory(1, 4)?, None)?,
    ] {
        let mut state = model.start(&ctx, 2)?;
        let empty = tokens(2, 0)?;
        assert_arg(
            model
                .step(&mut state, &empty, StepOptions::last())
                .map(|o| o.values),
            "tokens",
            &["at least one", "(2, 0)"],
        );
        assert_arg(
            model
                .step(&mut state, &empty, StepOptions::all())
                .map(|o| o.values),
            "tokens",
            &["(2, 0)"],
        );
        // The state is unchanged and still usable.
        assert_eq!(state.position(), 0);
        let last = model
            .step(&mut state, &tokens(2, 3)?, StepOptions::last())?
            .values;
        assert_eq!(last.dims(), &[2, VOCAB]);
        assert_eq!(state.position(), 3);
    }
    Ok(())
}

#[test]
fn a_state_or_context_of_other_blocks_is_an_error() -> anyhow::Result<()> {
    let (_a, one) = build(&config(|c| c.num_hidden_layers = 1))?;
    let (_b, two) = build(&config(|_| {}))?;
    let mem = memory(1, 4)?;
    let gen = GenerationConfig::greedy(two.config(), 3);
    for (what, ctx) in [
        ("image", one.image_context(&mem, None)?),
        ("text-only", one.text_only_context()),
    ] {
        // A 1-block context or state given to a 2-block decoder.
        assert_arg(two.start(&ctx, 1), "image", &["2 blocks", "of 1"]);
        let mut state = one.start(&ctx, 1)?;
        let toks = tokens(1, 2)?;
        assert_arg(
            two.step(&mut state, &toks, StepOptions::all())
                .map(|o| o.values),
            "state",
            &["2 blocks", "of 1"],
        );
        assert_arg(
            two.step(&mut state, &toks, StepOptions::last())
                .map(|o| o.values),
            "state",
            &["2 blocks"],
        );
        assert_arg(
            two.step(
                &mut state,
                &toks,
                StepOptions {
                    weights_of: Some(0),
                    ..StepOptions::all().hidden()
                },
            )
            .map(|o| (o.values, o.weights)),
            "state",
            &["2 blocks"],
        );
        assert_eq!(state.position(), 0, "{what}");
        for strategy in [Strategy::Greedy, Strategy::beam(2)] {
            assert_arg(
                generate(
                    &two,
                    &ctx,
                    &gen.clone().with_strategy(strategy),
                    &mut |_| {},
                ),
                "image",
                &["2 blocks", "of 1"],
            );
        }
        // And the other way round.
        let ctx2 = match what {
            "image" => two.image_context(&mem, None)?,
            _ => two.text_only_context(),
        };
        assert_arg(one.start(&ctx2, 1), "image", &["1 blocks", "of 2"]);
        let mut state2 = two.start(&ctx2, 1)?;
        assert_arg(
            one.step(&mut state2, &toks, StepOptions::all())
                .map(|o| o.values),
            "state",
            &["1 blocks", "of 2"],
        );
    }
    // As many blocks, but cross-attention in other blocks: the image would
    // be silently skipped in block 1.
    let (_c, every2) = build(&config(|c| c.cross_attention_every = 2))?;
    let ctx = every2.image_context(&mem, None)?;
    assert_arg(
        two.start(&ctx, 1),
        "image",
        &["[true, true]", "[true, false]"],
    );
    let mut state = every2.start(&ctx, 1)?;
    assert_arg(
        two.step(&mut state, &tokens(1, 1)?, StepOptions::all())
            .map(|o| o.values),
        "state",
        &["[true, true]"],
    );
    Ok(())
}

#[test]
fn absurd_per_image_is_an_error() -> anyhow::Result<()> {
    let (_v, model) = build(&config(|_| {}))?;
    // Two images of 5 and 3 tokens: the mask is expanded per row.
    let ctx = model.image_context(
        &memory(2, 5)?,
        Some(mask::image_tokens(&[5, 3], 5, &Device::Cpu)?),
    )?;
    let over_u32 = u32::MAX as usize / 2 + 1; // 2 * this = 2^32 rows
    for per_image in [usize::MAX, usize::MAX / 2 + 1, over_u32] {
        assert_arg(
            model.start(&ctx, per_image),
            "per_image",
            &[&per_image.to_string(), &u32::MAX.to_string(), "2 images"],
        );
    }
    let text = model.text_only_context();
    assert_arg(
        model.start(&text, u32::MAX as usize + 1),
        "per_image",
        &[&(u32::MAX as usize + 1).to_string()],
    );
    assert_arg(model.start(&text, 0), "per_image", &["0"]);
    Ok(())
}

#[test]
fn num_beams_that_overflow_are_an_error() -> anyhow::Result<()> {
    let (_v, model) = build(&config(|_| {}))?;
    let ctx = model.image_context(&memory(2, 5)?, None)?;
    let gen = GenerationConfig::greedy(model.config(), 3);
    // `max(2, 1 + eos ids) * num_beams` candidates overflow.
    for num_beams in [usize::MAX, usize::MAX / 2 + 1] {
        assert_arg(
            generate(
                &model,
                &ctx,
                &gen.clone().with_strategy(Strategy::beam(num_beams)),
                &mut |_| {},
            ),
            "num_beams",
            &[&num_beams.to_string()],
        );
    }
    Ok(())
}

/// Not run against the old code: there it allocates 2^31 beams per image.
#[test]
fn num_beams_whose_rows_pass_u32_are_an_error() -> anyhow::Result<()> {
    let (_v, model) = build(&config(|_| {}))?;
    let ctx = model.image_context(&memory(2, 5)?, None)?;
    let gen = GenerationConfig::greedy(model.config(), 3);
    let num_beams = u32::MAX as usize / 2 + 1; // 2 images: 2^32 rows
    assert_arg(
        generate(
            &model,
            &ctx,
            &gen.with_strategy(Strategy::beam(num_beams)),
            &mut |_| {},
        ),
        "num_beams",
        &[&num_beams.to_string(), "2 images"],
    );
    Ok(())
}

#[test]
fn token_ids_past_the_vocabulary_are_an_error() -> anyhow::Result<()> {
    let (_v, model) = build(&config(|_| {}))?;
    let bad = Tensor::new(&[[1u32, VOCAB as u32]], &Device::Cpu)?;
    let want = [&*VOCAB.to_string(), "vocabulary"];
    assert_arg(
        model.forward(&bad, None, ForwardMasks::default()),
        "tokens",
        &want,
    );
    assert_arg(model.embeddings(&bad, 0), "tokens", &want);
    let mut state = model.start(&model.text_only_context(), 1)?;
    assert_arg(
        model
            .step(&mut state, &bad, StepOptions::all())
            .map(|o| o.values),
        "tokens",
        &want,
    );
    assert_eq!(state.position(), 0);
    Ok(())
}

#[test]
fn an_offset_past_usize_is_an_error() -> anyhow::Result<()> {
    let (_v, model) = build(&config(|_| {}))?;
    for offset in [usize::MAX, usize::MAX - 1, 64] {
        match model.embeddings(&tokens(1, 2)?, offset) {
            Err(DecoderError::MaxPositions { max: 64, .. }) => {}
            other => panic!("offset {offset}: expected MaxPositions, got {other:?}"),
        }
    }
    Ok(())
}

#[test]
fn weights_of_a_block_that_does_not_exist_is_an_error() -> anyhow::Result<()> {
    let (_v, model) = build(&config(|_| {}))?;
    let ctx = model.image_context(&memory(1, 4)?, None)?;
    let mut state = model.start(&ctx, 1)?;
    assert_arg(
        model
            .step(
                &mut state,
                &tokens(1, 2)?,
                StepOptions {
                    weights_of: Some(2),
                    ..StepOptions::all().hidden()
                },
            )
            .map(|o| (o.values, o.weights)),
        "weights_of",
        &["below 2", "got 2"],
    );
    let (_, w) = model
        .step(
            &mut state,
            &tokens(1, 2)?,
            StepOptions {
                weights_of: Some(1),
                ..StepOptions::all().hidden()
            },
        )
        .map(|o| (o.values, o.weights))?;
    assert_eq!(w.map(|w| w.dims().to_vec()), Some(vec![1, 4, 2, 4]));
    Ok(())
}

#[test]
fn parts_that_do_not_fit_the_config_are_errors() -> anyhow::Result<()> {
    let cfg = config(|_| {});
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let h = cfg.hidden_size;
    let table = |n: usize| -> anyhow::Result<Tensor> {
        Ok(Tensor::randn(0f32, 0.02, (n, h), &Device::Cpu)?)
    };
    let blocks = |n: usize| -> anyhow::Result<Vec<DecoderBlock>> {
        (0..n)
            .map(|i| Ok(DecoderBlock::load(vb.pp("blocks").pp(i), &cfg, i)?))
            .collect()
    };
    let norm = LayerNorm::load(h, cfg.layer_norm_eps, vb.pp("final_norm"))?;
    let parts = |tok: usize, pos: usize, nblocks: usize, head: usize, cfg: &DecoderConfig| {
        Ok::<_, anyhow::Error>(VisionLanguageDecoder::from_parts(
            DecoderParts {
                embed_tokens: Embedding::new(table(tok)?, h),
                embed_positions: Some(Embedding::new(table(pos)?, h)),
                embedding_norm: None,
                blocks: blocks(nblocks)?,
                final_norm: Some(norm.clone()),
                output_transform: None,
                lm_head: Linear::new(table(head)?, None),
            },
            cfg,
        ))
    };
    let max = cfg.max_position_embeddings;
    parts(VOCAB, max, 2, VOCAB, &cfg)??;
    assert_arg(
        parts(VOCAB, max, 1, VOCAB, &cfg)?,
        "blocks",
        &["expected 2", "got 1"],
    );
    assert_arg(
        parts(VOCAB, 10, 2, VOCAB, &cfg)?,
        "embed_positions",
        &["[64, 32]", "[10, 32]"],
    );
    assert_arg(
        parts(VOCAB - 1, max, 2, VOCAB, &cfg)?,
        "embed_tokens",
        &["[23, 32]", "[22, 32]"],
    );
    assert_arg(
        parts(VOCAB, max, 2, VOCAB + 1, &cfg)?,
        "lm_head",
        &["[23, 32]", "[24, 32]"],
    );
    // Blocks whose cross-attention is where another config puts it.
    let every2 = config(|c| c.cross_attention_every = 2);
    assert_arg(
        parts(VOCAB, max, 2, VOCAB, &every2)?,
        "blocks",
        &["[true, false]", "[true, true]"],
    );
    // Positions are u32: a larger count would be truncated.
    let huge = config(|c| c.max_position_embeddings = u32::MAX as usize + 2);
    match parts(VOCAB, 4, 2, VOCAB, &huge)? {
        Err(DecoderError::Config { field, reason }) => {
            assert_eq!(field, "max_position_embeddings", "{reason}");
            assert!(
                reason.contains(&(u32::MAX as usize + 2).to_string()),
                "{reason}"
            );
        }
        other => panic!("expected a config error, got {other:?}"),
    }
    Ok(())
}

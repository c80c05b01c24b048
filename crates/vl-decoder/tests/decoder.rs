//! The decoder: step == full, image context reuse, batch == single, gates,
//! cross-attention every k blocks, gradients.
#![allow(missing_docs)]

use candle_core::{DType, Device, IndexOp, Storage, Tensor, TensorId};
use candle_nn::{VarBuilder, VarMap};
use vl_attn::mask;
use vl_decoder::{DecoderConfig, ForwardMasks, ImageContext, StepOptions, VisionLanguageDecoder};

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
    let stepped = Tensor::cat(&steps, 1)?;
    let diff = max_abs_diff(&stepped, &full);
    assert!(diff <= 1e-5, "step vs full: {diff}");
    assert_eq!(state.position(), 6);
    Ok(())
}

/// The identity of a tensor: its id, and the address of its storage
/// (shared by views of one allocation, different for a copy).
type Identity = (TensorId, usize);

fn identity(t: &Tensor) -> Identity {
    let (storage, _) = t.storage_and_layout();
    (t.id(), std::ptr::from_ref::<Storage>(&storage).addr())
}

/// Blocks of [`DecoderConfig::tiny`].
const TINY_BLOCKS: usize = 2;

/// The identity of every block's image keys and values, with their batch,
/// in a context of a [`DecoderConfig::tiny`] decoder.
fn kv_identity(ctx: &ImageContext) -> Vec<Option<(Identity, Identity, usize)>> {
    (0..TINY_BLOCKS)
        .map(|i| {
            ctx.layer(i)
                .map(|kv| (identity(kv.k()), identity(kv.v()), kv.batch()))
        })
        .collect()
}

#[test]
fn image_context_reused_equals_recomputed() -> anyhow::Result<()> {
    let (_v, model) = build(&DecoderConfig::tiny(VOCAB, MEM));
    assert_eq!(model.blocks().len(), TINY_BLOCKS);
    let mem = memory(1, 9);
    let ctx = model.image_context(&mem, None)?;
    let projected = kv_identity(&ctx);
    assert!(projected.iter().all(Option::is_some));
    // PROJECTION COUNT: when `CrossAttention::memory_projections()` lands,
    // read every block's counter here and assert that `image_context` added
    // exactly 1 per block and the decodes below add 0.
    let toks = tokens(&[&[1, 6, 2, 7, 3]]);
    // Two independent decodes over one context, and one over a fresh context.
    let run = |ctx: &ImageContext| -> anyhow::Result<Tensor> {
        let mut s = model.start(ctx, 1)?;
        // Every step reads the context's own keys and values: the state
        // holds the same tensors (same ids, same storage), not a copy.
        let mut steps = vec![
            model
                .step(&mut s, &toks.narrow(1, 0, 2)?, StepOptions::all())?
                .values,
        ];
        for t in 2..5 {
            assert_eq!(kv_identity(s.image()), kv_identity(ctx), "step {t}");
            steps.push(
                model
                    .step(&mut s, &toks.narrow(1, t, 1)?, StepOptions::all())?
                    .values,
            );
        }
        assert_eq!(kv_identity(s.image()), kv_identity(ctx));
        Ok(Tensor::cat(&steps, 1)?)
    };
    let (a, b) = (run(&ctx)?, run(&ctx)?);
    // Decoding neither re-projected nor replaced the context's tensors.
    assert_eq!(kv_identity(&ctx), projected);
    // A fresh projection is told apart by this check.
    let fresh = model.image_context(&mem, None)?;
    assert!(kv_identity(&fresh)
        .iter()
        .zip(&projected)
        .all(|(f, p)| f.map(|f| (f.0 .0, f.1 .0)) != p.map(|p| (p.0 .0, p.1 .0))));
    let c = run(&fresh)?;
    assert_eq!(max_abs_diff(&a, &b), 0.0);
    assert_eq!(max_abs_diff(&a, &c), 0.0);
    Ok(())
}

/// Beams read their image's keys and values, projected once: the state
/// holds the context's tensors at batch `images` (not one copy per row),
/// and beam reorders move only the text caches.
#[test]
fn beams_share_one_image_context_without_copies() -> anyhow::Result<()> {
    let (_v, model) = build(&DecoderConfig::tiny(VOCAB, MEM));
    let img_mask = mask::image_tokens(&[7, 4], 7, &Device::Cpu)?;
    let ctx = model.image_context(&memory(2, 7), Some(img_mask))?;
    let projected = kv_identity(&ctx);
    assert!(projected.iter().all(|l| l.is_some_and(|(_, _, b)| b == 2)));
    // Projected once per block, in `image_context`; steps and reorders
    // below never project again.
    let projections = projection_counts(&model);
    assert!(projections.iter().all(|&n| n == 1), "{projections:?}");
    let prompt = tokens(&[&[1, 5], &[1, 6], &[1, 7], &[1, 8], &[1, 9], &[1, 3]]);
    let reorders: [[u32; 6]; 3] = [[2, 0, 1, 5, 5, 3], [1, 1, 1, 3, 4, 5], [0, 2, 1, 4, 3, 3]];
    let next = tokens(&[&[4], &[5], &[6], &[7], &[8], &[9]]);
    // 2 images, 3 beams each; two states decoded alike.
    let decode = || -> anyhow::Result<vl_decoder::DecodeState> {
        let mut state = model.start(&ctx, 3)?;
        assert_eq!(kv_identity(state.image()), projected, "start");
        model.step(&mut state, &prompt, StepOptions::all())?;
        for (i, order) in reorders.iter().enumerate() {
            state.reorder(order)?;
            assert_eq!(kv_identity(state.image()), projected, "reorder {i}");
            model.step(&mut state, &next, StepOptions::all())?;
            assert_eq!(kv_identity(state.image()), projected, "step {i}");
        }
        Ok(state)
    };
    let (mut a, mut b) = (decode()?, decode()?);
    assert_eq!(kv_identity(&ctx), projected);
    assert_eq!(projection_counts(&model), projections);
    // The state reads the context's storage itself: overwriting the
    // context's values in place changes what the state computes. (A state
    // holding a copy would not see it.)
    let before = model.step(&mut b, &next, StepOptions::all())?.values;
    for i in 0..TINY_BLOCKS {
        if let Some(kv) = ctx.layer(i) {
            kv.v().slice_set(&kv.v().zeros_like()?, 0, 0)?;
        }
    }
    let after = model.step(&mut a, &next, StepOptions::all())?.values;
    let d = max_abs_diff(&before, &after);
    assert!(
        d > 1e-3,
        "zeroing the context's values changed nothing: {d}"
    );
    Ok(())
}

/// How many times each cross-attention block has projected an image.
fn projection_counts(m: &VisionLanguageDecoder) -> Vec<usize> {
    m.blocks()
        .iter()
        .filter_map(|b| b.cross_branch())
        .map(|c| c.cross_attn.memory_projections())
        .collect()
}

/// Each block's cross-attention projects an image's keys and values once,
/// in `image_context`, however many rows (beams) and steps read them.
#[test]
fn the_image_is_projected_once_per_image() -> anyhow::Result<()> {
    let (_v, model) = build(&DecoderConfig::tiny(VOCAB, MEM));
    let counts = projection_counts;
    let n = counts(&model).len();
    assert!(n > 0, "the tiny decoder has cross-attention");
    assert_eq!(counts(&model), vec![0; n]);
    let ctx = model.image_context(&memory(2, 9), None)?;
    assert_eq!(counts(&model), vec![1; n]);
    // 2 images, 3 rows each: a prompt, then 4 steps.
    let mut state = model.start(&ctx, 3)?;
    let prompt: &[u32] = &[1, 5];
    model.step(&mut state, &tokens(&[prompt; 6]), StepOptions::all())?;
    for t in 0..4u32 {
        let next: &[u32] = &[2 + t];
        model.step(&mut state, &tokens(&[next; 6]), StepOptions::all())?;
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
    let stepped = model.step(&mut state, &rows, StepOptions::all())?.values;
    assert!(max_abs_diff(&stepped.i(2..3)?, &all.i(1..2)?) <= 1e-5);
    assert!(max_abs_diff(&stepped.i(5..6)?, &text_only) <= 1e-5);
    Ok(())
}

#[test]
fn zero_gates_equal_the_decoder_without_cross_attention() -> anyhow::Result<()> {
    for gated_cross_ffn in [false, true] {
        let cfg = DecoderConfig {
            gated_cross_attention: true,
            gated_cross_ffn,
            ..DecoderConfig::tiny(VOCAB, MEM)
        };
        let (vars, gated) = build(&cfg);
        // Gates start at zero: tanh(0) = 0 closes every cross-attention
        // branch, and the gated feed-forward after it.
        let toks = tokens(&[&[1, 5, 7, 3]]);
        let with_image = gated.forward(&toks, Some(&memory(1, 5)), ForwardMasks::default())?;
        let text_only = gated.forward(&toks, None, ForwardMasks::default())?;
        assert!(max_abs_diff(&with_image, &text_only) <= 1e-6);
        // Opening a gate lets the image in: each gate on its own.
        let names: &[&str] = if gated_cross_ffn {
            &["cross_attn_gate", "cross_ffn_gate"]
        } else {
            &["cross_attn_gate"]
        };
        for open in names {
            for (name, var) in vars.data().lock().expect("lock").iter() {
                let value = if name.ends_with(open) { 0.5f32 } else { 0.0 };
                if name.ends_with("_gate") {
                    var.set(&Tensor::new(&[value], &Device::Cpu)?)?;
                }
            }
            let opened = gated.forward(&toks, Some(&memory(1, 5)), ForwardMasks::default())?;
            assert!(
                max_abs_diff(&opened, &text_only) > 1e-4,
                "opening {open} changed nothing"
            );
        }
    }
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
    assert!(
        max_abs_diff(
            &model.step(&mut s, &toks, StepOptions::all())?.values,
            &full
        ) <= 1e-5
    );
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
    model.step(&mut s, &tokens(&[&[1, 2, 3, 4]]), StepOptions::all())?;
    let err = model
        .step(&mut s, &tokens(&[&[5]]), StepOptions::all())
        .map(|o| o.values)
        .unwrap_err();
    assert!(
        err.to_string().contains("max_position_embeddings 4"),
        "{err}"
    );
    Ok(())
}

/// The largest entry of a parameter's gradient must pass this to count as
/// non-zero. With the inputs below the smallest such entry is about 2e-5
/// (`blocks.1.self_attn.q_proj.bias`), and a gradient that is zero in exact
/// arithmetic (a key bias) comes out below 1e-11: a branch cut off or
/// multiplied by 0 fails by orders of magnitude.
const MIN_GRADIENT: f32 = 1e-7;
/// The largest entry of a gradient that is 0 in exact arithmetic, after
/// rounding.
const ZERO_GRADIENT: f32 = 1e-9;

/// Training must reach every parameter: candle-nn's fused layer norm has no
/// backward pass, a cut graph trains only the output layer, and a closed
/// gate gives the cross-attention branch a gradient of exact zeros — so
/// each gradient must be present and not zero.
#[test]
fn every_parameter_receives_a_gradient() -> anyhow::Result<()> {
    use candle_core::D;
    use vl_vision::{VisionConfig, VisionEncoder, VitConfig};
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
        rescale_factor: 1.0 / 255.0,
        resample: vl_vision::Resample::Bilinear,
        do_resize: true,
        hidden_act: vl_decoder::Activation::Gelu,
        output_size: None,
        attention_dropout: 0.0,
        hidden_dropout: 0.0,
        distillation_token: false,
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
    let mut checked = 0;
    for (name, var) in vars.data().lock().expect("lock").iter() {
        let Some(g) = grads.get(var.as_tensor()) else {
            panic!("{name} has no gradient");
        };
        let largest = g.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(largest.is_finite(), "{name}: gradient {largest}");
        if name.ends_with("k_proj.bias") {
            // A key bias adds q·b to every score of a query: softmax is
            // shift-invariant, so its gradient is 0 up to rounding.
            assert!(largest <= ZERO_GRADIENT, "{name}: {largest:e}");
        } else {
            assert!(
                largest > MIN_GRADIENT,
                "{name}: largest gradient {largest:e} is not above {MIN_GRADIENT:e}"
            );
            checked += 1;
        }
    }
    assert!(checked > 50, "only {checked} parameters checked");
    Ok(())
}

/// Stepping states at different positions and row counts together gives
/// each the logits and weights of its own step, and leaves each where its
/// own step would.
#[test]
fn step_many_equals_each_state_alone() -> anyhow::Result<()> {
    let (_v, model) = build(&DecoderConfig::tiny(VOCAB, MEM));
    let mem = memory(2, 13);
    let ctx = model.image_context(&mem, None)?;
    let images = ctx.split()?;
    let opts = StepOptions::last().with_weights_of(1);
    // State a: 2 rows (beams) of image 0, three tokens in; state b: one
    // row of image 1, fresh.
    let mut a = model.start(&images[0], 2)?;
    let mut a_alone = model.start(&images[0], 2)?;
    for s in [&mut a, &mut a_alone] {
        model.step(s, &tokens(&[&[1, 5, 7], &[1, 4, 4]]), opts)?;
    }
    let mut b = model.start(&images[1], 1)?;
    let mut b_alone = model.start(&images[1], 1)?;
    for step in 0..4u32 {
        let ta = tokens(&[&[step + 2], &[step + 9]]);
        let tb = tokens(&[&[step + 1]]);
        let together = model.step_many(&mut [&mut a, &mut b], &[ta.clone(), tb.clone()], opts)?;
        let alone = [
            model.step(&mut a_alone, &ta, opts)?,
            model.step(&mut b_alone, &tb, opts)?,
        ];
        for (t, s) in together.iter().zip(&alone) {
            assert_eq!(t.values.dims(), s.values.dims());
            assert!(max_abs_diff(&t.values, &s.values) < 1e-5, "step {step}");
            let (tw, sw) = (t.weights.as_ref(), s.weights.as_ref());
            let (tw, sw) = (tw.expect("weights"), sw.expect("weights"));
            assert!(max_abs_diff(tw, sw) < 1e-6, "step {step}: weights");
        }
    }
    assert_eq!((a.position(), b.position()), (7, 4));
    // Lengths that differ are refused before anything moves.
    let err = model.step_many(
        &mut [&mut a, &mut b],
        &[tokens(&[&[1, 2], &[3, 4]]), tokens(&[&[1]])],
        opts,
    );
    assert!(
        matches!(
            err,
            Err(vl_decoder::DecoderError::Argument { arg: "tokens", .. })
        ),
        "{err:?}"
    );
    assert_eq!((a.position(), b.position()), (7, 4));
    Ok(())
}

//! Interleaved images (Flamingo-style: text, image, text, image, text) in
//! cached decoding: an [`ImageContext`] from
//! [`VisionLanguageDecoder::interleaved_context`] against the full forward
//! with [`mask::interleaved`], in both media-attention modes.
//!
//! The tiny models' weights and image tokens are drawn from a seeded
//! generator (candle's CPU `randn` cannot be seeded), so every run tests
//! the same numbers. Tolerance for cached == full: 1e-5 (f32, absolute, on
//! logits of magnitude ~1), as the other cache-parity tests.

use anyhow::{anyhow, Result};
use candle_core::{DType, Device, IndexOp, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use vl_attn::mask::{self, MediaAttention, MediaSpan};
use vl_decoder::{
    generate, DecoderConfig, DecoderError, ForwardMasks, GenerationConfig, ImageContext,
    StepOptions, Strategy, VisionLanguageDecoder,
};

const VOCAB: usize = 23;
const MEMORY_DIM: usize = 16;
/// Memory slots per sample: both samples' images fit, with padding.
const MEMORY_LEN: usize = 8;
/// text (0..2), image A, text (2..5), image B, text (5..9).
const TEXT_LEN: usize = 9;
/// Where sample 0's second image starts: the modes differ from here on.
const SECOND_IMAGE: usize = 5;
/// Where sample 0's first image starts: the cross branch is 0 before it.
const FIRST_IMAGE: usize = 2;
/// Cached decoding against the full forward (f32).
const PARITY_TOL: f32 = 1e-5;
/// The least difference counted as "the modes differ" after the second
/// image: the logits are of magnitude ~1, so attending to one more image
/// moves them far more than this.
const MODES_DIFFER: f32 = 1e-3;
const MODES: [MediaAttention; 2] = [MediaAttention::MostRecent, MediaAttention::AllPrevious];

fn span(text_start: usize, tokens: usize) -> MediaSpan {
    MediaSpan { text_start, tokens }
}

/// Sample 0: image A (3 tokens) before position 2, image B (4 tokens)
/// before position 5, one padding slot. Sample 1: other places and counts
/// (2 tokens before position 1, 5 before position 6, one padding slot).
fn spans() -> Vec<Vec<MediaSpan>> {
    vec![
        vec![span(FIRST_IMAGE, 3), span(SECOND_IMAGE, 4)],
        vec![span(1, 2), span(6, 5)],
    ]
}

struct Tiny {
    model: VisionLanguageDecoder,
    cfg: DecoderConfig,
    /// Keeps the weights alive.
    _vars: VarMap,
}

fn normal(rng: &mut ChaCha8Rng, n: usize, std: f32) -> Result<Vec<f32>> {
    let dist = Normal::new(0f32, std)?;
    Ok((0..n).map(|_| dist.sample(rng)).collect())
}

/// A tiny decoder (2 blocks, both with cross-attention, output biases on)
/// whose weights are redrawn from `seed`: constant tensors (norm weights)
/// are kept, matrices `(rows, cols)` get N(0, 1/cols), vectors N(0, 0.1).
fn tiny(seed: u64) -> Result<Tiny> {
    let dev = Device::Cpu;
    let cfg = DecoderConfig::tiny(VOCAB, MEMORY_DIM);
    let vars = VarMap::new();
    let model =
        VisionLanguageDecoder::load(VarBuilder::from_varmap(&vars, DType::F32, &dev), &cfg)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let data = vars.data().lock().map_err(|e| anyhow!("{e}"))?;
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        let var = &data[name];
        let t = var.as_tensor().flatten_all()?;
        let (lo, hi) = (t.min(0)?.to_scalar::<f32>()?, t.max(0)?.to_scalar::<f32>()?);
        if lo == hi {
            continue;
        }
        let std = match var.dims() {
            [_, fan_in] => 1.0 / (*fan_in as f32).sqrt(),
            _ => 0.1,
        };
        let values = normal(&mut rng, var.elem_count(), std)?;
        var.set(&Tensor::from_vec(values, var.shape(), &dev)?)?;
    }
    drop(data);
    Ok(Tiny {
        model,
        cfg,
        _vars: vars,
    })
}

/// Image tokens `(batch, MEMORY_LEN, MEMORY_DIM)` drawn from `seed`.
fn memory(batch: usize, seed: u64) -> Result<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let values = normal(&mut rng, batch * MEMORY_LEN * MEMORY_DIM, 1.0)?;
    Ok(Tensor::from_vec(
        values,
        (batch, MEMORY_LEN, MEMORY_DIM),
        &Device::Cpu,
    )?)
}

/// Token ids `(rows, len)` drawn from `seed`, avoiding none.
fn tokens(rows: usize, len: usize, seed: u64) -> Result<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let ids: Vec<u32> = (0..rows * len)
        .map(|_| rand::Rng::random_range(&mut rng, 0..VOCAB as u32))
        .collect();
    Ok(Tensor::from_vec(ids, (rows, len), &Device::Cpu)?)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// The full forward with the interleaved media mask: `(batch, len, vocab)`.
fn full(
    model: &VisionLanguageDecoder,
    toks: &Tensor,
    memory: &Tensor,
    spans: &[Vec<MediaSpan>],
    mode: MediaAttention,
) -> Result<Tensor> {
    // (batch, len)
    let (_, len) = toks.dims2()?;
    let image = mask::interleaved(spans, len, MEMORY_LEN, mode, &Device::Cpu)?;
    Ok(model.forward(
        toks,
        Some(memory),
        ForwardMasks {
            text: None,
            image: Some(&image),
        },
    )?)
}

/// Cached decoding of `toks` fed in chunks of `chunks` tokens (summing to
/// the length), `per_image` rows per sample: `(rows, len, vocab)`.
fn cached(
    model: &VisionLanguageDecoder,
    ctx: &ImageContext,
    per_image: usize,
    toks: &Tensor,
    chunks: &[usize],
) -> Result<Tensor> {
    let mut state = model.start(ctx, per_image)?;
    let mut out = Vec::new();
    let mut at = 0;
    for &n in chunks {
        out.push(
            model
                .step(&mut state, &toks.narrow(1, at, n)?, StepOptions::all())?
                .values,
        );
        at += n;
    }
    assert_eq!(state.position(), at);
    Ok(Tensor::cat(&out, 1)?)
}

/// (a) One token at a time, and in chunks straddling each image boundary
/// (0..3 holds position 2, where image A starts; 3..7 holds position 5 and
/// sample 1's 6), equal the full forward with `mask::interleaved`, for a
/// batch of two samples with different spans, in both modes. Would catch a
/// step that reads the whole memory, the rows of the wrong positions
/// (offset ignored), or the wrong sample's spans.
#[test]
fn cached_decoding_equals_full_forward() -> Result<()> {
    let tiny = tiny(1)?;
    let model = &tiny.model;
    let mem = memory(2, 2)?;
    let toks = tokens(2, TEXT_LEN, 3)?;
    for mode in MODES {
        let want = full(model, &toks, &mem, &spans(), mode)?;
        let ctx = model.interleaved_context(&mem, &spans(), mode)?;
        assert_eq!(ctx.images(), 2);
        assert_eq!(ctx.media_attention(), Some(mode));
        for chunks in [&[1; TEXT_LEN][..], &[3, 4, 2], &[TEXT_LEN]] {
            let got = cached(model, &ctx, 1, &toks, chunks)?;
            let diff = max_abs_diff(&got, &want)?;
            assert!(
                diff <= PARITY_TOL,
                "{mode:?}, chunks {chunks:?}: cached vs full differ by {diff}"
            );
        }
    }
    Ok(())
}

/// (b) The modes agree before the second image (the mask rows are equal)
/// and differ from it on (AllPrevious still sees image A). Would catch a
/// mode ignored by the cached path, or one applied before it matters.
#[test]
fn modes_differ_only_after_the_second_image() -> Result<()> {
    let tiny = tiny(4)?;
    let model = &tiny.model;
    let mem = memory(1, 5)?;
    let toks = tokens(1, TEXT_LEN, 6)?;
    let sample = &spans()[..1];
    let logits = MODES
        .iter()
        .map(|&mode| {
            let ctx = model.interleaved_context(&mem, sample, mode)?;
            cached(model, &ctx, 1, &toks, &[1; TEXT_LEN])
        })
        .collect::<Result<Vec<_>>>()?;
    let before = max_abs_diff(
        &logits[0].narrow(1, 0, SECOND_IMAGE)?,
        &logits[1].narrow(1, 0, SECOND_IMAGE)?,
    )?;
    assert!(
        before == 0.0,
        "before the second image the modes differ by {before}"
    );
    for p in SECOND_IMAGE..TEXT_LEN {
        let after = max_abs_diff(&logits[0].i((.., p))?, &logits[1].i((.., p))?)?;
        assert!(
            after > MODES_DIFFER,
            "position {p}: MostRecent and AllPrevious differ by only {after}"
        );
    }
    Ok(())
}

/// (c) Positions before the first image see no image: their logits are
/// exactly (tolerance 0) those of text-only cached decoding, also with the
/// output biases of the cross-attention on; from the first image on they
/// differ. Would catch an output bias or a softmax over nothing (uniform
/// weights) leaking into text that has no image yet.
#[test]
fn text_before_any_image_is_text_only() -> Result<()> {
    let tiny = tiny(7)?;
    let model = &tiny.model;
    let mem = memory(1, 8)?;
    let toks = tokens(1, TEXT_LEN, 9)?;
    for mode in MODES {
        let ctx = model.interleaved_context(&mem, &spans()[..1], mode)?;
        for chunks in [&[1; TEXT_LEN][..], &[3, 4, 2]] {
            let got = cached(model, &ctx, 1, &toks, chunks)?;
            let text_only = cached(model, &model.text_only_context(), 1, &toks, chunks)?;
            let diff = max_abs_diff(
                &got.narrow(1, 0, FIRST_IMAGE)?,
                &text_only.narrow(1, 0, FIRST_IMAGE)?,
            )?;
            assert!(
                diff == 0.0,
                "{mode:?}, chunks {chunks:?}: before the first image, {diff} from text-only"
            );
            let at_image =
                max_abs_diff(&got.i((.., FIRST_IMAGE))?, &text_only.i((.., FIRST_IMAGE))?)?;
            assert!(
                at_image > MODES_DIFFER,
                "{mode:?}: the first image changes nothing ({at_image})"
            );
        }
    }
    Ok(())
}

/// (d) A batch of two samples with different spans equals each sample
/// alone (its own context and full forward); with 2 rows per sample fed
/// different tokens, row `r` reads sample `r / 2`'s image tokens and spans.
/// Would catch spans taken from the wrong sample, or rows laid out
/// `r % samples` instead of `r / per_image`.
#[test]
fn batch_equals_per_sample() -> Result<()> {
    let tiny = tiny(10)?;
    let model = &tiny.model;
    let mem = memory(2, 11)?;
    let spans = spans();
    // Rows 0, 1 read sample 0; rows 2, 3 sample 1.
    let toks = tokens(4, TEXT_LEN, 12)?;
    for mode in MODES {
        let ctx = model.interleaved_context(&mem, &spans, mode)?;
        let batch = cached(model, &ctx, 2, &toks, &[3, 4, 2])?;
        for row in 0..4 {
            let sample = row / 2;
            let alone_mem = mem.narrow(0, sample, 1)?;
            let alone_spans = &spans[sample..=sample];
            let row_toks = toks.narrow(0, row, 1)?;
            let alone_ctx = model.interleaved_context(&alone_mem, alone_spans, mode)?;
            let alone = cached(model, &alone_ctx, 1, &row_toks, &[1; TEXT_LEN])?;
            let want = full(model, &row_toks, &alone_mem, alone_spans, mode)?;
            let got = batch.narrow(0, row, 1)?;
            for (what, other) in [("cached alone", &alone), ("full alone", &want)] {
                let diff = max_abs_diff(&got, other)?;
                assert!(
                    diff <= PARITY_TOL,
                    "{mode:?}, row {row}: batch vs {what} differ by {diff}"
                );
            }
        }
    }
    Ok(())
}

/// The log-probabilities of `generated` after the start token, from the
/// uncached forward of sample `sample` alone, and whether each token is the
/// forward's argmax: `(sum of log-probs, all argmax)`.
fn replay(
    tiny: &Tiny,
    mem: &Tensor,
    spans: &[Vec<MediaSpan>],
    sample: usize,
    mode: MediaAttention,
    generated: &[u32],
) -> Result<(f32, bool)> {
    let mut seq = vec![tiny.cfg.bos_token_id];
    seq.extend_from_slice(&generated[..generated.len() - 1]);
    let toks = Tensor::from_vec(seq, (1, generated.len()), &Device::Cpu)?;
    let logits = full(
        &tiny.model,
        &toks,
        &mem.narrow(0, sample, 1)?,
        &spans[sample..=sample],
        mode,
    )?
    .squeeze(0)?; // (len, vocab)
    let argmax = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?.to_vec2::<f32>()?;
    let sum = generated
        .iter()
        .zip(&logp)
        .map(|(&t, row)| row[t as usize])
        .sum();
    Ok((sum, argmax == generated))
}

/// (e) `generate` runs on an interleaved context, greedy and with 2 beams
/// per sample. Greedy tokens are the argmax of the uncached forward with
/// the media mask; each beam result's score is its log-probability under
/// that forward divided by its length (length_penalty 1), so the beams
/// read their own sample's spans, also after reordering. Would catch
/// generation dropping the media mask, or beams reading another sample.
#[test]
fn generate_greedy_and_beam() -> Result<()> {
    const NEW: usize = 8;
    let tiny = tiny(13)?;
    let mem = memory(2, 14)?;
    let spans = spans();
    let greedy = GenerationConfig {
        eos_token_ids: Vec::new(),
        ..GenerationConfig::greedy(&tiny.cfg, NEW)
    };
    for mode in MODES {
        let ctx = tiny.model.interleaved_context(&mem, &spans, mode)?;
        let out = generate(&tiny.model, &ctx, &greedy, &mut |_| {})?;
        assert_eq!(out.len(), 2);
        for (sample, g) in out.iter().enumerate() {
            assert_eq!(g.tokens.len(), NEW);
            let (_, is_argmax) = replay(&tiny, &mem, &spans, sample, mode, &g.tokens)?;
            assert!(
                is_argmax,
                "{mode:?}, sample {sample}: greedy {:?} is not the forward's argmax",
                g.tokens
            );
        }
        let beam = greedy.clone().with_strategy(Strategy::beam(2));
        let out = generate(&tiny.model, &ctx, &beam, &mut |_| {})?;
        assert_eq!(out.len(), 2);
        for (sample, g) in out.iter().enumerate() {
            assert_eq!(g.tokens.len(), NEW);
            let score = g
                .score
                .ok_or_else(|| anyhow!("beam result without score"))?;
            let (logp, _) = replay(&tiny, &mem, &spans, sample, mode, &g.tokens)?;
            let want = logp / NEW as f32;
            assert!(
                (score - want).abs() <= 1e-4,
                "{mode:?}, sample {sample}: beam score {score}, forward gives {want}"
            );
        }
    }
    Ok(())
}

/// The argument an error names; panics on a non-argument error.
fn arg_of(r: vl_decoder::Result<ImageContext>) -> String {
    match r {
        Err(DecoderError::Argument { arg, reason }) => format!("{arg}: {reason}"),
        Err(e) => format!("not an argument error: {e}"),
        Ok(_) => "accepted".into(),
    }
}

/// (f) Bad spans and memory are errors naming the argument, not panics.
#[test]
fn bad_spans_are_errors() -> Result<()> {
    let tiny = tiny(15)?;
    let model = &tiny.model;
    let mem = memory(2, 16)?;
    let mode = MediaAttention::MostRecent;
    let max = tiny.cfg.max_position_embeddings;
    let ok = vec![span(1, 2)];
    let cases: Vec<(&str, Vec<Vec<MediaSpan>>, &str)> = vec![
        (
            "one list for two samples",
            vec![ok.clone()],
            "spans: expected one list",
        ),
        (
            "three lists",
            vec![ok.clone(); 3],
            "spans: expected one list",
        ),
        (
            "an image of no token",
            vec![ok.clone(), vec![span(1, 0)]],
            "has 0 tokens",
        ),
        (
            "text_start past the last position",
            vec![ok.clone(), vec![span(max, 1)]],
            "max_position_embeddings",
        ),
        (
            "images out of order",
            vec![vec![span(4, 1), span(2, 1)], ok.clone()],
            "text order",
        ),
        (
            "more tokens than memory_len",
            vec![ok.clone(), vec![span(1, 5), span(2, MEMORY_LEN - 4)]],
            "memory_len 8",
        ),
        (
            "token counts overflowing",
            vec![ok.clone(), vec![span(1, usize::MAX), span(2, 2)]],
            "memory_len 8",
        ),
    ];
    for (what, spans, want) in cases {
        let err = arg_of(model.interleaved_context(&mem, &spans, mode));
        assert!(
            err.starts_with("spans:") && err.contains(want),
            "{what}: {err}"
        );
    }
    let spans = vec![ok.clone(), ok.clone()];
    let wrong_dim = Tensor::zeros((2, MEMORY_LEN, MEMORY_DIM + 1), DType::F32, &Device::Cpu)?;
    let empty = Tensor::zeros((2, 0, MEMORY_DIM), DType::F32, &Device::Cpu)?;
    for (what, m) in [("memory_dim", &wrong_dim), ("no token", &empty)] {
        let err = arg_of(model.interleaved_context(m, &spans, mode));
        assert!(err.starts_with("memory:"), "{what}: {err}");
    }
    // Exactly memory_len tokens, images at the same position, a sample
    // without image: accepted.
    let edge = vec![vec![span(0, 4), span(0, 4)], Vec::new()];
    let ctx = model.interleaved_context(&mem, &edge, mode)?;
    let logits = cached(model, &ctx, 1, &tokens(2, 3, 17)?, &[2, 1])?;
    assert_eq!(logits.dims(), &[2, 3, VOCAB]);
    Ok(())
}

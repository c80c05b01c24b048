//! Generation on tiny models: greedy against the uncached forward, seeded
//! sampling, beam search against exhaustive search, stops, batching and
//! streaming.
//!
//! The tiny models' weights are drawn from a seeded generator (candle's CPU
//! `randn` cannot be seeded), so every run tests the same models.

use anyhow::{anyhow, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use vl_decoder::{
    generate, generate_from, step_decodings, DecoderConfig, DecoderError, Decoding, EarlyStopping,
    ForwardMasks, Generated, GenerationConfig, StopReason, Strategy, TokenEvent,
    VisionLanguageDecoder,
};

const MEMORY_DIM: usize = 16;
const IMAGE_LEN: usize = 5;

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

/// A tiny decoder whose weights are redrawn from `seed`: constant tensors
/// (norm weights) are kept, matrices `(rows, cols)` get N(0, 1/cols),
/// vectors N(0, 0.1).
fn tiny(vocab: usize, seed: u64, edit: impl FnOnce(&mut DecoderConfig)) -> Result<Tiny> {
    let dev = Device::Cpu;
    let mut cfg = DecoderConfig::tiny(vocab, MEMORY_DIM);
    edit(&mut cfg);
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

/// Seeded image memory `(images, IMAGE_LEN, MEMORY_DIM)`.
fn memory(images: usize, seed: u64) -> Result<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let values = normal(&mut rng, images * IMAGE_LEN * MEMORY_DIM, 1.0)?;
    Ok(Tensor::from_vec(
        values,
        (images, IMAGE_LEN, MEMORY_DIM),
        &Device::Cpu,
    )?)
}

fn run(t: &Tiny, memory: &Tensor, gen: &GenerationConfig) -> Result<Vec<Generated>> {
    let ctx = t.model.image_context(memory, None)?;
    Ok(generate(&t.model, &ctx, gen, &mut |_| {})?)
}

fn tokens(out: &[Generated]) -> Vec<Vec<u32>> {
    out.iter().map(|g| g.tokens.clone()).collect()
}

/// No EOS: captions run to `max_new_tokens`.
fn no_eos(t: &Tiny, max_new_tokens: usize) -> GenerationConfig {
    GenerationConfig {
        eos_token_ids: Vec::new(),
        ..GenerationConfig::greedy(&t.cfg, max_new_tokens)
    }
}

/// Log-probabilities of the next token after `prefix`, by the uncached
/// full forward of one image.
fn next_log_probs(t: &Tiny, memory: &Tensor, prefix: &[u32]) -> Result<Vec<f32>> {
    log_probs_after(t, Some(memory), prefix)
}

/// [`next_log_probs`], or text-only with no memory.
fn log_probs_after(t: &Tiny, memory: Option<&Tensor>, prefix: &[u32]) -> Result<Vec<f32>> {
    let tokens = Tensor::new(prefix, &Device::Cpu)?.unsqueeze(0)?;
    let logits = t.model.forward(&tokens, memory, ForwardMasks::default())?; // (1, len, vocab)
    let last = logits.narrow(1, prefix.len() - 1, 1)?.flatten_all()?;
    Ok(candle_nn::ops::log_softmax(&last, D::Minus1)?.to_vec1()?)
}

/// Asserts that every token of `caption` is the argmax of the uncached
/// forward after the start token and the tokens before it.
fn assert_greedy(t: &Tiny, memory: Option<&Tensor>, caption: &[u32], what: &str) -> Result<()> {
    let mut seq = vec![t.cfg.bos_token_id];
    for &tok in caption {
        let lp = log_probs_after(t, memory, &seq)?;
        let best = lp.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(lp[tok as usize], best, "{what}: after {seq:?}");
        seq.push(tok);
    }
    Ok(())
}

/// An EOS id under which the no-EOS greedy captions `free` stop at the
/// most distinct lengths (a caption stops at the first occurrence).
fn eos_with_distinct_lengths(free: &[Vec<u32>], vocab: u32) -> (u32, usize) {
    (0..vocab)
        .map(|eos| {
            let mut lens: Vec<usize> = free
                .iter()
                .map(|c| c.iter().position(|&x| x == eos).map_or(c.len(), |p| p + 1))
                .collect();
            lens.sort_unstable();
            lens.dedup();
            (eos, lens.len())
        })
        .max_by_key(|&(eos, n)| (n, std::cmp::Reverse(eos)))
        .unwrap_or((0, 0))
}

#[test]
fn validate_names_the_field() -> Result<()> {
    let t = tiny(20, 1, |_| {})?;
    let base = GenerationConfig::greedy(&t.cfg, 5);
    let sample = |temperature, top_k, top_p| Strategy::Sample {
        temperature,
        top_k,
        top_p,
        seed: 0,
    };
    let cases: Vec<(&str, GenerationConfig)> = vec![
        (
            "max_new_tokens",
            GenerationConfig {
                max_new_tokens: 0,
                ..base.clone()
            },
        ),
        (
            "min_new_tokens",
            GenerationConfig {
                min_new_tokens: 6,
                ..base.clone()
            },
        ),
        (
            "repetition_penalty",
            GenerationConfig {
                repetition_penalty: 0.0,
                no_repeat_ngram_size: 0,
                ..base.clone()
            },
        ),
        (
            "repetition_penalty",
            GenerationConfig {
                repetition_penalty: -1.0,
                no_repeat_ngram_size: 0,
                ..base.clone()
            },
        ),
        (
            "temperature",
            base.clone().with_strategy(sample(-0.5, None, None)),
        ),
        (
            "temperature",
            base.clone().with_strategy(sample(f64::NAN, None, None)),
        ),
        (
            "top_k",
            base.clone().with_strategy(sample(1.0, Some(0), None)),
        ),
        (
            "top_p",
            base.clone().with_strategy(sample(1.0, None, Some(0.0))),
        ),
        (
            "top_p",
            base.clone().with_strategy(sample(1.0, None, Some(1.5))),
        ),
        ("num_beams", base.clone().with_strategy(Strategy::beam(0))),
    ];
    for (field, cfg) in cases {
        match cfg.validate() {
            Err(DecoderError::Argument { arg, reason }) => {
                assert_eq!(arg, field, "{reason}");
                let msg = DecoderError::Argument { arg, reason }.to_string();
                assert!(msg.contains(field), "{msg}");
            }
            other => panic!("{field}: expected an argument error, got {other:?}"),
        }
    }
    base.validate()?;
    // Token ids are checked against the model's vocabulary.
    let bad_eos = GenerationConfig {
        eos_token_ids: vec![3, 20],
        ..base.clone()
    };
    let err = run(&t, &memory(1, 0)?, &bad_eos)
        .err()
        .map(|e| e.to_string());
    assert!(
        err.as_deref()
            .is_some_and(|e| e.contains("eos_token_ids") && e.contains("20")),
        "{err:?}"
    );
    Ok(())
}

#[test]
fn greedy_is_argmax_of_the_uncached_forward() -> Result<()> {
    let t = tiny(40, 2, |_| {})?;
    let mem = memory(2, 2)?;
    let out = run(&t, &mem, &no_eos(&t, 10))?;
    for (i, g) in out.iter().enumerate() {
        assert_eq!(
            (g.tokens.len(), g.stop, g.score),
            (10, StopReason::MaxNewTokens, None)
        );
        let image = mem.narrow(0, i, 1)?;
        let mut seq = vec![t.cfg.bos_token_id];
        for &tok in &g.tokens {
            let lp = next_log_probs(&t, &image, &seq)?;
            let best = lp.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(lp[tok as usize], best, "image {i} after {seq:?}");
            seq.push(tok);
        }
    }
    Ok(())
}

#[test]
fn temperature_zero_and_top_k_one_are_greedy() -> Result<()> {
    let t = tiny(40, 3, |_| {})?;
    let mem = memory(3, 3)?;
    let greedy = run(&t, &mem, &no_eos(&t, 8))?;
    for (temperature, top_k, top_p) in [
        (0.0, None, None),
        (0.0, Some(5), Some(0.5)),
        (1.0, Some(1), None),
        (1.0, None, Some(1e-6)),
    ] {
        let strategy = Strategy::Sample {
            temperature,
            top_k,
            top_p,
            seed: 7,
        };
        let out = run(&t, &mem, &no_eos(&t, 8).with_strategy(strategy))?;
        assert_eq!(
            tokens(&out),
            tokens(&greedy),
            "temperature {temperature} top_k {top_k:?} top_p {top_p:?}"
        );
    }
    Ok(())
}

#[test]
fn seeded_sampling_is_reproducible_and_per_row() -> Result<()> {
    let t = tiny(50, 4, |_| {})?;
    let mem = memory(3, 4)?;
    let sample = |seed| {
        no_eos(&t, 12).with_strategy(Strategy::Sample {
            temperature: 1.5,
            top_k: None,
            top_p: Some(0.95),
            seed,
        })
    };
    let a = tokens(&run(&t, &mem, &sample(11))?);
    assert_eq!(
        a,
        tokens(&run(&t, &mem, &sample(11))?),
        "same seed, same tokens"
    );
    let others = (12..16)
        .map(|s| Ok(tokens(&run(&t, &mem, &sample(s))?)))
        .collect::<Result<Vec<_>>>()?;
    assert!(
        others.iter().any(|o| *o != a),
        "every other seed gave {a:?}"
    );
    assert_ne!(a[0], a[1], "rows draw from separate streams");
    // A row's tokens do not depend on the rest of the batch.
    let two = tokens(&run(&t, &mem.narrow(0, 0, 2)?, &sample(11))?);
    assert_eq!(two, a[..2].to_vec());
    Ok(())
}

#[test]
fn max_new_tokens_and_eos_stop() -> Result<()> {
    let t = tiny(30, 5, |_| {})?;
    let mem = memory(1, 5)?;
    let free = run(&t, &mem, &no_eos(&t, 6))?;
    assert_eq!(free[0].tokens.len(), 6);
    assert_eq!(free[0].stop, StopReason::MaxNewTokens);
    // The greedy first token as EOS ends the caption at once.
    let eos = free[0].tokens[0];
    let gen = GenerationConfig {
        eos_token_ids: vec![29, eos],
        ..GenerationConfig::greedy(&t.cfg, 6)
    };
    let out = run(&t, &mem, &gen)?;
    assert_eq!(
        (out[0].tokens.clone(), out[0].stop),
        (vec![eos], StopReason::Eos)
    );
    for strategy in [
        Strategy::beam(3),
        Strategy::Beam {
            num_beams: 2,
            length_penalty: 0.0,
            early_stopping: EarlyStopping::Never,
        },
    ] {
        let out = run(&t, &mem, &gen.clone().with_strategy(strategy.clone()))?;
        let g = &out[0];
        assert!(
            !g.tokens.is_empty() && g.tokens.len() <= 6,
            "{strategy:?}: {g:?}"
        );
        let ends_in_eos = g
            .tokens
            .last()
            .is_some_and(|x| gen.eos_token_ids.contains(x));
        assert_eq!(
            g.stop == StopReason::Eos,
            ends_in_eos,
            "{strategy:?}: {g:?}"
        );
        assert!(g.tokens[..g.tokens.len() - 1]
            .iter()
            .all(|x| !gen.eos_token_ids.contains(x)));
        let length_penalty = match strategy {
            Strategy::Beam { length_penalty, .. } => length_penalty,
            _ => 1.0,
        };
        let score = |g: &Generated, gen: &GenerationConfig| -> Result<()> {
            let got = g.score.ok_or_else(|| anyhow!("{strategy:?}: no score"))?;
            let want = rescore(&t, &mem, gen, &g.tokens, length_penalty)?;
            assert!((got - want).abs() < 1e-4, "{strategy:?}: {g:?} vs {want}");
            Ok(())
        };
        score(g, &gen)?;
        let free_gen = no_eos(&t, 6).with_strategy(strategy.clone());
        let free = run(&t, &mem, &free_gen)?;
        assert_eq!(
            (free[0].tokens.len(), free[0].stop),
            (6, StopReason::MaxNewTokens)
        );
        score(&free[0], &free_gen)?;
    }
    Ok(())
}

#[test]
fn min_new_tokens_suppresses_eos() -> Result<()> {
    let t = tiny(30, 6, |_| {})?;
    let mem = memory(1, 6)?;
    let eos = run(&t, &mem, &no_eos(&t, 1))?[0].tokens[0];
    // Without min_new_tokens greedy decoding stops at once, so the checks
    // below test the suppression.
    let unconstrained = GenerationConfig {
        eos_token_ids: vec![eos],
        ..GenerationConfig::greedy(&t.cfg, 8)
    };
    assert_eq!(run(&t, &mem, &unconstrained)?[0].tokens, vec![eos]);
    for strategy in [
        Strategy::Greedy,
        Strategy::beam(3),
        Strategy::Sample {
            temperature: 1.0,
            top_k: Some(3),
            top_p: None,
            seed: 3,
        },
    ] {
        let gen = GenerationConfig {
            eos_token_ids: vec![eos],
            min_new_tokens: 4,
            ..GenerationConfig::greedy(&t.cfg, 8)
        }
        .with_strategy(strategy.clone());
        let g = &run(&t, &mem, &gen)?[0];
        assert!(
            g.tokens.len() >= 5 || g.stop != StopReason::Eos,
            "{strategy:?}: {g:?}"
        );
        assert!(
            !g.tokens.iter().take(4).any(|&x| x == eos),
            "{strategy:?}: {g:?}"
        );
    }
    Ok(())
}

#[test]
fn one_beam_is_greedy() -> Result<()> {
    let t = tiny(40, 7, |_| {})?;
    let mem = memory(3, 7)?;
    let free = tokens(&run(&t, &mem, &no_eos(&t, 8))?);
    let (eos, _) = eos_with_distinct_lengths(&free, 40);
    let gen = GenerationConfig {
        eos_token_ids: vec![eos],
        ..GenerationConfig::greedy(&t.cfg, 8)
    };
    let greedy = run(&t, &mem, &gen)?;
    for early_stopping in [EarlyStopping::False, EarlyStopping::True] {
        let strategy = Strategy::Beam {
            num_beams: 1,
            length_penalty: 1.0,
            early_stopping,
        };
        let beam = run(&t, &mem, &gen.clone().with_strategy(strategy))?;
        assert_eq!(tokens(&beam), tokens(&greedy), "{early_stopping:?}");
        for (b, g) in beam.iter().zip(&greedy) {
            assert_eq!(b.stop, g.stop);
        }
    }
    Ok(())
}

/// [`next_log_probs`] after the repetition penalty (once per distinct
/// token of the sequence, start token included, as transformers'
/// gather/scatter) and the `min_new_tokens` EOS suppression.
fn processed_log_probs(
    t: &Tiny,
    memory: &Tensor,
    gen: &GenerationConfig,
    prefix: &[u32],
) -> Result<Vec<f32>> {
    let seq: Vec<u32> = std::iter::once(gen.start_token_id)
        .chain(prefix.iter().copied())
        .collect();
    let mut lp = next_log_probs(t, memory, &seq)?;
    let mut distinct = seq;
    distinct.sort_unstable();
    distinct.dedup();
    for s in distinct {
        let x = &mut lp[s as usize];
        *x = if *x < 0.0 {
            *x * gen.repetition_penalty
        } else {
            *x / gen.repetition_penalty
        };
    }
    if prefix.len() < gen.min_new_tokens {
        for &e in &gen.eos_token_ids {
            lp[e as usize] = f32::NEG_INFINITY;
        }
    }
    Ok(lp)
}

/// `sum_logprobs / len^length_penalty`, as beam search scores a finished
/// hypothesis.
fn normalise(sum: f32, len: usize, length_penalty: f32) -> f32 {
    sum / (len as f64).powf(f64::from(length_penalty)) as f32
}

/// The beam score of `tokens`, recomputed with the uncached forward: a
/// wrong cache reorder on the winning path shows here.
fn rescore(
    t: &Tiny,
    memory: &Tensor,
    gen: &GenerationConfig,
    tokens: &[u32],
    length_penalty: f32,
) -> Result<f32> {
    let mut sum = 0f32;
    for (i, &tok) in tokens.iter().enumerate() {
        sum += processed_log_probs(t, memory, gen, &tokens[..i])?[tok as usize];
    }
    Ok(normalise(sum, tokens.len(), length_penalty))
}

/// The best finished hypothesis over every sequence of up to
/// `max_new_tokens` tokens, scored as beam search scores it;
/// `(tokens, score, runner-up score)`.
fn exhaustive(
    t: &Tiny,
    memory: &Tensor,
    gen: &GenerationConfig,
    length_penalty: f32,
) -> Result<(Vec<u32>, f32, f32)> {
    let mut scored: Vec<(f32, Vec<u32>)> = Vec::new();
    let mut open: Vec<(Vec<u32>, f32)> = vec![(Vec::new(), 0.0)];
    for step in 0..gen.max_new_tokens {
        let mut next_open = Vec::new();
        for (prefix, sum) in &open {
            let lp = processed_log_probs(t, memory, gen, prefix)?;
            for (v, &x) in lp.iter().enumerate() {
                if x == f32::NEG_INFINITY {
                    continue;
                }
                let mut tokens = prefix.clone();
                tokens.push(v as u32);
                if gen.eos_token_ids.contains(&(v as u32)) || step + 1 == gen.max_new_tokens {
                    scored.push((normalise(sum + x, tokens.len(), length_penalty), tokens));
                } else {
                    next_open.push((tokens, sum + x));
                }
            }
        }
        open = next_open;
    }
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    Ok((scored[0].1.clone(), scored[0].0, scored[1].0))
}

#[test]
fn beam_search_matches_exhaustive_search() -> Result<()> {
    // vocab 4, 3 tokens, 64 beams: every prefix stays a beam and every
    // hypothesis of the last step ranks among the first num_beams.
    let t = tiny(4, 8, |_| {})?;
    let mem = memory(2, 8)?;
    let settings = [
        (1.0, EarlyStopping::False, 1.0, 0),
        (0.0, EarlyStopping::Never, 1.0, 0),
        (2.0, EarlyStopping::Never, 1.0, 0),
        (-1.0, EarlyStopping::False, 1.0, 0),
        (1.0, EarlyStopping::False, 1.8, 1),
    ];
    // Ties allow either hypothesis; most cases must have a clear winner.
    let mut compared = 0;
    for (length_penalty, early_stopping, repetition_penalty, min_new_tokens) in settings {
        let gen = GenerationConfig {
            eos_token_ids: vec![3],
            repetition_penalty,
            min_new_tokens,
            ..GenerationConfig::greedy(&t.cfg, 3)
        }
        .with_strategy(Strategy::Beam {
            num_beams: 64,
            length_penalty,
            early_stopping,
        });
        let out = run(&t, &mem, &gen)?;
        for (i, g) in out.iter().enumerate() {
            let (best, score, runner_up) =
                exhaustive(&t, &mem.narrow(0, i, 1)?, &gen, length_penalty)?;
            let what = format!("image {i}, length_penalty {length_penalty}, {early_stopping:?}, repetition_penalty {repetition_penalty}");
            let got = g.score.ok_or_else(|| anyhow!("{what}: no score"))?;
            assert!((got - score).abs() < 1e-4, "{what}: score {got} vs {score}");
            let recomputed = rescore(&t, &mem.narrow(0, i, 1)?, &gen, &g.tokens, length_penalty)?;
            assert!(
                (got - recomputed).abs() < 1e-4,
                "{what}: score {got} vs recomputed {recomputed}"
            );
            if score - runner_up > 1e-4 {
                assert_eq!(g.tokens, best, "{what}");
                compared += 1;
            }
            let stop = if best.last() == Some(&3) {
                StopReason::Eos
            } else {
                StopReason::MaxNewTokens
            };
            assert_eq!(g.stop, stop, "{what}");
        }
    }
    assert!(
        compared >= settings.len(),
        "only {compared} of {} cases had a clear best hypothesis",
        2 * settings.len()
    );
    Ok(())
}

#[test]
fn batch_equals_each_image_alone() -> Result<()> {
    let t = tiny(32, 9, |_| {})?;
    let mem = memory(3, 9)?;
    let free = tokens(&run(&t, &mem, &no_eos(&t, 10))?);
    let (eos, distinct) = eos_with_distinct_lengths(&free, 32);
    assert!(
        distinct >= 2,
        "no EOS gives captions of different lengths: {free:?}"
    );
    let greedy = GenerationConfig {
        eos_token_ids: vec![eos],
        ..GenerationConfig::greedy(&t.cfg, 10)
    };
    for strategy in [
        Strategy::Greedy,
        Strategy::beam(3),
        Strategy::Beam {
            num_beams: 4,
            length_penalty: 0.5,
            early_stopping: EarlyStopping::True,
        },
    ] {
        let gen = greedy.clone().with_strategy(strategy.clone());
        let batch = run(&t, &mem, &gen)?;
        for (i, b) in batch.iter().enumerate() {
            let alone = run(&t, &mem.narrow(0, i, 1)?, &gen)?;
            assert_eq!(alone[0].tokens, b.tokens, "{strategy:?}, image {i}");
            assert_eq!(alone[0].stop, b.stop, "{strategy:?}, image {i}");
            match (alone[0].score, b.score) {
                (Some(x), Some(y)) => {
                    assert!((x - y).abs() < 1e-5, "{strategy:?}, image {i}: {x} vs {y}")
                }
                (x, y) => assert_eq!(x, y),
            }
        }
        let mut lens: Vec<usize> = batch.iter().map(|g| g.tokens.len()).collect();
        lens.dedup();
        assert!(
            lens.len() > 1,
            "{strategy:?}: captions should end at different lengths: {batch:?}"
        );
    }
    Ok(())
}

#[test]
fn beam_scores_match_the_uncached_forward() -> Result<()> {
    // Long enough for many cache reorders: a wrong one on the winning path
    // changes the recomputed score.
    let t = tiny(32, 12, |_| {})?;
    let mem = memory(3, 12)?;
    let free = tokens(&run(&t, &mem, &no_eos(&t, 10))?);
    let (eos, _) = eos_with_distinct_lengths(&free, 32);
    let settings = [
        (3, 1.0, EarlyStopping::False, 1.0, 0),
        (5, 0.0, EarlyStopping::Never, 1.0, 0),
        (4, 2.0, EarlyStopping::Never, 1.3, 2),
        (2, 0.7, EarlyStopping::True, 1.0, 3),
    ];
    for (num_beams, length_penalty, early_stopping, repetition_penalty, min_new_tokens) in settings
    {
        let gen = GenerationConfig {
            eos_token_ids: vec![eos, 31],
            repetition_penalty,
            min_new_tokens,
            ..GenerationConfig::greedy(&t.cfg, 10)
        }
        .with_strategy(Strategy::Beam {
            num_beams,
            length_penalty,
            early_stopping,
        });
        for (i, g) in run(&t, &mem, &gen)?.iter().enumerate() {
            let what =
                format!("image {i}, {num_beams} beams, {length_penalty}, {early_stopping:?}");
            let got = g.score.ok_or_else(|| anyhow!("{what}: no score"))?;
            let want = rescore(&t, &mem.narrow(0, i, 1)?, &gen, &g.tokens, length_penalty)?;
            assert!(
                (got - want).abs() < 1e-4,
                "{what}: {g:?}, recomputed {want}"
            );
            assert!(
                g.tokens.len() > min_new_tokens || g.stop != StopReason::Eos,
                "{what}: {g:?}"
            );
        }
    }
    Ok(())
}

#[test]
fn streaming_sees_exactly_the_returned_tokens() -> Result<()> {
    let t = tiny(32, 10, |_| {})?;
    let mem = memory(3, 10)?;
    let free = tokens(&run(&t, &mem, &no_eos(&t, 9))?);
    let (eos, _) = eos_with_distinct_lengths(&free, 32);
    let gen = GenerationConfig {
        eos_token_ids: vec![eos],
        ..GenerationConfig::greedy(&t.cfg, 9)
    };
    let ctx = t.model.image_context(&mem, None)?;
    for strategy in [
        Strategy::Greedy,
        Strategy::beam(3),
        Strategy::Sample {
            temperature: 1.0,
            top_k: Some(8),
            top_p: Some(0.9),
            seed: 5,
        },
    ] {
        let mut events: Vec<TokenEvent> = Vec::new();
        let out = generate(
            &t.model,
            &ctx,
            &gen.clone().with_strategy(strategy.clone()),
            &mut |e| events.push(e),
        )?;
        let mut seen = vec![Vec::new(); out.len()];
        for e in &events {
            assert_eq!(
                e.index,
                seen[e.image].len(),
                "{strategy:?}: events in order"
            );
            seen[e.image].push(e.token);
        }
        assert_eq!(seen, tokens(&out), "{strategy:?}");
    }
    Ok(())
}

#[test]
fn max_positions_is_a_stop_not_an_error() -> Result<()> {
    let t = tiny(30, 11, |c| c.max_position_embeddings = 6)?;
    let mem = memory(2, 11)?;
    for strategy in [Strategy::Greedy, Strategy::beam(2)] {
        let gen = no_eos(&t, 20).with_strategy(strategy.clone());
        for (i, g) in run(&t, &mem, &gen)?.iter().enumerate() {
            assert_eq!(
                (g.tokens.len(), g.stop),
                (6, StopReason::MaxPositions),
                "{strategy:?}"
            );
            // The tokens, not only their count: the cache at the last
            // position is read correctly.
            let image = mem.narrow(0, i, 1)?;
            match strategy {
                Strategy::Greedy => assert_greedy(&t, Some(&image), &g.tokens, "image")?,
                _ => {
                    let got = g.score.ok_or_else(|| anyhow!("{strategy:?}: no score"))?;
                    let want = rescore(&t, &image, &gen, &g.tokens, 1.0)?;
                    assert!((got - want).abs() < 1e-4, "image {i}: {got} vs {want}");
                }
            }
        }
        let text = generate(&t.model, &t.model.text_only_context(), &gen, &mut |_| {})?;
        assert_eq!(text.len(), 1);
        assert_eq!(
            (text[0].tokens.len(), text[0].stop),
            (6, StopReason::MaxPositions)
        );
        if strategy == Strategy::Greedy {
            assert_greedy(&t, None, &text[0].tokens, "text-only")?;
        }
        // Exactly at the limit, max_new_tokens is the reason.
        let g = &run(&t, &mem, &no_eos(&t, 6).with_strategy(strategy.clone()))?[0];
        assert_eq!((g.tokens.len(), g.stop), (6, StopReason::MaxNewTokens));
    }
    Ok(())
}

/// A prompt is continued by every strategy: greedy tokens are the argmax
/// of the uncached forward after start + prompt + the tokens before;
/// sampling at temperature 0 is that greedy run and seeded sampling is
/// reproducible; a 1-beam search is greedy too; an empty prompt is
/// `generate`; bad prompts are named.
#[test]
fn prompts_are_continued_by_every_strategy() -> Result<()> {
    let t = tiny(40, 9, |_| {})?;
    let mem = memory(2, 9)?;
    let ctx = t.model.image_context(&mem, None)?;
    let prompt = [7u32, 3, 12];
    let from = |cfg: &GenerationConfig, prompt: &[u32]| -> Result<Vec<Vec<u32>>> {
        Ok(tokens(&generate_from(
            &t.model,
            &ctx,
            cfg,
            prompt,
            &mut |_| {},
        )?))
    };
    let greedy = from(&no_eos(&t, 8), &prompt)?;
    for (i, caption) in greedy.iter().enumerate() {
        assert_eq!(caption.len(), 8);
        let image = mem.narrow(0, i, 1)?;
        let mut seq = vec![t.cfg.bos_token_id];
        seq.extend(prompt);
        for &tok in caption {
            let lp = next_log_probs(&t, &image, &seq)?;
            let best = lp.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(lp[tok as usize], best, "image {i} after {seq:?}");
            seq.push(tok);
        }
    }
    assert_ne!(greedy, from(&no_eos(&t, 8), &[])?, "prompt ignored");
    assert_eq!(
        from(&no_eos(&t, 8), &[])?,
        tokens(&run(&t, &mem, &no_eos(&t, 8))?)
    );
    let sample = |temperature, seed| {
        no_eos(&t, 8).with_strategy(Strategy::Sample {
            temperature,
            top_k: None,
            top_p: None,
            seed,
        })
    };
    assert_eq!(from(&sample(0.0, 1), &prompt)?, greedy);
    assert_eq!(
        from(&sample(1.5, 3), &prompt)?,
        from(&sample(1.5, 3), &prompt)?
    );
    let one_beam = no_eos(&t, 8).with_strategy(Strategy::Beam {
        num_beams: 1,
        length_penalty: 1.0,
        early_stopping: EarlyStopping::False,
    });
    assert_eq!(from(&one_beam, &prompt)?, greedy);
    let beams = one_beam.clone().with_strategy(Strategy::Beam {
        num_beams: 3,
        length_penalty: 1.0,
        early_stopping: EarlyStopping::False,
    });
    let b = from(&beams, &prompt)?;
    assert!(b.iter().all(|c| c.len() == 8));
    assert_ne!(b, from(&beams, &[])?, "beam search ignored the prompt");
    for bad in [vec![40u32], vec![1; 64]] {
        match generate_from(&t.model, &ctx, &no_eos(&t, 4), &bad, &mut |_| {}) {
            Err(DecoderError::Argument { arg, .. }) => assert_eq!(arg, "prompt"),
            other => panic!("expected an argument error, got {other:?}"),
        }
    }
    Ok(())
}

/// Decodings that join a running batch at different steps (and leave it
/// as they end), each with its own settings, give each image the tokens,
/// stop, score and cross-attention that `generate_from` gives it alone,
/// and stream exactly those tokens.
#[test]
fn decodings_joining_a_running_batch_equal_each_image_alone() -> Result<()> {
    let t = tiny(32, 9, |c| c.max_position_embeddings = 24)?;
    let mem = memory(5, 9)?;
    let free = tokens(&run(&t, &mem, &no_eos(&t, 10))?);
    let (eos, _) = eos_with_distinct_lengths(&free, 32);
    let base = GenerationConfig {
        eos_token_ids: vec![eos],
        cross_attention_of: Some(1),
        ..GenerationConfig::greedy(&t.cfg, 10)
    };
    let sample = Strategy::Sample {
        temperature: 1.3,
        top_k: Some(10),
        top_p: Some(0.9),
        seed: 4,
    };
    // (image, settings, prompt, the step it joins at)
    let jobs: Vec<(usize, GenerationConfig, Vec<u32>, usize)> = vec![
        (0, base.clone(), vec![], 0),
        (1, base.clone().with_strategy(Strategy::beam(3)), vec![], 0),
        (2, base.clone().with_strategy(sample.clone()), vec![], 2),
        (3, base.clone(), vec![7, 3], 3),
        (
            4,
            base.clone().with_strategy(Strategy::Beam {
                num_beams: 2,
                length_penalty: 0.5,
                early_stopping: EarlyStopping::True,
            }),
            vec![5],
            5,
        ),
        // Long, past the position limit, recording no cross-attention
        // while the others do.
        (
            1,
            GenerationConfig {
                max_new_tokens: 30,
                eos_token_ids: vec![],
                cross_attention_of: None,
                ..base.clone()
            },
            vec![],
            6,
        ),
    ];
    let ctx = t.model.image_context(&mem, None)?;
    let images = ctx.split()?;
    assert_eq!(images.len(), 5);
    let mut running: Vec<(usize, Decoding)> = Vec::new();
    let mut results: Vec<Option<Generated>> = vec![None; jobs.len()];
    let mut streamed: Vec<Vec<u32>> = vec![Vec::new(); jobs.len()];
    let mut most_together = 0;
    for step in 0.. {
        for (j, (image, gen, prompt, at)) in jobs.iter().enumerate() {
            if *at == step {
                running.push((j, Decoding::start(&t.model, &images[*image], gen, prompt)?));
            }
        }
        if running.is_empty() && step > 6 {
            break;
        }
        most_together = most_together.max(running.len());
        let ids: Vec<usize> = running.iter().map(|(j, _)| *j).collect();
        let mut refs: Vec<&mut Decoding> = running.iter_mut().map(|(_, d)| d).collect();
        step_decodings(&t.model, &mut refs, &mut |e| {
            assert_eq!(e.index, streamed[ids[e.image]].len());
            streamed[ids[e.image]].push(e.token);
        })?;
        for (j, d) in std::mem::take(&mut running) {
            match d.generated() {
                Some(_) => results[j] = d.into_generated(),
                None => running.push((j, d)),
            }
        }
    }
    assert!(
        most_together >= 4,
        "the jobs should overlap: {most_together}"
    );
    for (j, (image, gen, prompt, _)) in jobs.iter().enumerate() {
        let got = results[j]
            .as_ref()
            .ok_or_else(|| anyhow!("job {j} did not end"))?;
        let alone = generate_from(&t.model, &images[*image], gen, prompt, &mut |_| {})?;
        let want = &alone[0];
        assert_eq!(got.tokens, want.tokens, "job {j}");
        assert_eq!(got.stop, want.stop, "job {j}");
        assert_eq!(streamed[j], want.tokens, "job {j} streamed");
        match (got.score, want.score) {
            (Some(x), Some(y)) => assert!((x - y).abs() < 1e-5, "job {j}: {x} vs {y}"),
            (x, y) => assert_eq!(x, y, "job {j}"),
        }
        assert_eq!(
            got.cross_attention.len(),
            want.cross_attention.len(),
            "job {j}"
        );
        for (a, b) in got.cross_attention.iter().zip(&want.cross_attention) {
            let diff = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "job {j}: cross-attention differs by {diff}");
        }
    }
    // The long one ran into the position limit while others came and went.
    assert_eq!(
        results[5].as_ref().map(|g| g.stop),
        Some(StopReason::MaxPositions)
    );
    Ok(())
}

/// What a caller can get wrong about decodings is named.
#[test]
fn decodings_refuse_what_cannot_step_together() -> Result<()> {
    let t = tiny(32, 9, |_| {})?;
    let mem = memory(2, 9)?;
    let ctx = t.model.image_context(&mem, None)?;
    let gen = no_eos(&t, 4);
    let err = Decoding::start(&t.model, &ctx, &gen, &[]).err();
    assert!(
        matches!(&err, Some(DecoderError::Argument { arg: "image", .. })),
        "{err:?}"
    );
    let images = ctx.split()?;
    let mut a = Decoding::start(&t.model, &images[0], &gen, &[])?;
    let with_maps = GenerationConfig {
        cross_attention_of: Some(0),
        ..gen.clone()
    };
    let other_maps = GenerationConfig {
        cross_attention_of: Some(1),
        ..gen.clone()
    };
    let mut b = Decoding::start(&t.model, &images[1], &with_maps, &[])?;
    let mut b2 = Decoding::start(&t.model, &images[1], &other_maps, &[])?;
    let err = step_decodings(&t.model, &mut [&mut a, &mut b, &mut b2], &mut |_| {}).err();
    assert!(
        matches!(
            &err,
            Some(DecoderError::Argument {
                arg: "decodings",
                ..
            })
        ),
        "{err:?}"
    );
    let mut c = Decoding::start(&t.model, &t.model.text_only_context(), &gen, &[])?;
    let err = step_decodings(&t.model, &mut [&mut a, &mut c], &mut |_| {}).err();
    assert!(
        matches!(&err, Some(DecoderError::Argument { arg: "states", .. })),
        "{err:?}"
    );
    // Nothing stepped: both still start from their prefix.
    assert_eq!((a.position(), c.position()), (0, 0));
    Ok(())
}

//! Score processing shared by every strategy (transformers' logits
//! processors, in their order: repetition penalty, no repeated n-grams,
//! `min_new_tokens`, then the forced first and last tokens),
//! and the token choice of greedy decoding and sampling.

use candle_core::{Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use super::config::{GenerationConfig, Strategy, MIN_SAMPLING_TEMPERATURE};
use crate::error::Result;

/// Applies the repetition penalty, the n-gram ban and the `min_new_tokens`
/// EOS suppression
/// to one row's scores (logits for greedy and sampling, log-probabilities
/// for beam search, as in transformers).
///
/// `prefix` holds what was fed before the first generated token (the
/// start token, then the prompt), `generated` the row's tokens after it;
/// the penalty and the n-gram ban also cover the prefix, which
/// transformers' `input_ids` holds.
pub(crate) fn process(
    scores: &mut [f32],
    prefix: &[u32],
    generated: &[u32],
    cfg: &GenerationConfig,
) {
    if cfg.repetition_penalty != 1.0 {
        let mut seen: Vec<u32> = prefix.iter().chain(generated.iter()).copied().collect();
        seen.sort_unstable();
        seen.dedup();
        for t in seen {
            if let Some(s) = scores.get_mut(t as usize) {
                *s = if *s < 0.0 {
                    *s * cfg.repetition_penalty
                } else {
                    *s / cfg.repetition_penalty
                };
            }
        }
    }
    if cfg.no_repeat_ngram_size > 0 {
        ban_repeated_ngrams(scores, prefix, generated, cfg.no_repeat_ngram_size);
    }
    if !cfg.bad_words_ids.is_empty() {
        ban_bad_words(scores, prefix, generated, cfg);
    }
    if generated.len() < cfg.min_new_tokens {
        for &eos in &cfg.eos_token_ids {
            if let Some(s) = scores.get_mut(eos as usize) {
                *s = f32::NEG_INFINITY;
            }
        }
    }
    // transformers' ForcedBOS/ForcedEOSTokenLogitsProcessor: at `cur_len`
    // 1 (only the start token fed), and at `max_length - 1`.
    let cur_len = prefix.len() + generated.len();
    if let Some(bos) = cfg.forced_bos_token_id.filter(|_| cur_len == 1) {
        force(scores, bos);
    }
    if let Some(eos) = cfg
        .forced_eos_token_id
        .filter(|_| generated.len() + 1 == cfg.max_new_tokens)
    {
        force(scores, eos);
    }
}

/// transformers' `NoBadWordsLogitsProcessor` over `prefix + generated`:
/// each banned sequence's last token gets `-inf` where the sequence so far
/// ends with the tokens before it (always, for one token); a lone end
/// token is never banned.
fn ban_bad_words(scores: &mut [f32], prefix: &[u32], generated: &[u32], cfg: &GenerationConfig) {
    let ends_with = |head: &[u32]| -> bool {
        let n = head.len();
        if n > prefix.len() + generated.len() {
            return false;
        }
        // The last n tokens of prefix + generated.
        let from_generated = n.min(generated.len());
        let from_prefix = n - from_generated;
        head[..from_prefix] == prefix[prefix.len() - from_prefix..]
            && head[from_prefix..] == generated[generated.len() - from_generated..]
    };
    for words in &cfg.bad_words_ids {
        let Some((&last, head)) = words.split_last() else {
            continue;
        };
        if head.is_empty() && cfg.eos_token_ids.contains(&last) {
            continue;
        }
        if ends_with(head) {
            if let Some(s) = scores.get_mut(last as usize) {
                *s = f32::NEG_INFINITY;
            }
        }
    }
}

/// Every score `-inf` but `token`'s, which becomes 0.
fn force(scores: &mut [f32], token: u32) {
    scores.fill(f32::NEG_INFINITY);
    if let Some(s) = scores.get_mut(token as usize) {
        *s = 0.0;
    }
}

/// transformers' `NoRepeatNGramLogitsProcessor` over `prefix + generated`:
/// every token that would complete an `n`-gram already in the sequence gets
/// `-inf`.
fn ban_repeated_ngrams(scores: &mut [f32], prefix: &[u32], generated: &[u32], n: usize) {
    let seq: Vec<u32> = prefix.iter().chain(generated.iter()).copied().collect();
    if seq.len() + 1 < n {
        return;
    }
    let prefix = &seq[seq.len() + 1 - n..];
    for window in seq.windows(n) {
        if &window[..n - 1] == prefix {
            if let Some(s) = scores.get_mut(window[n - 1] as usize) {
                *s = f32::NEG_INFINITY;
            }
        }
    }
}

/// The index of the largest score; the first on ties, as `torch.argmax`.
///
/// In two passes that vectorise — the largest value (16 lanes at a time),
/// then its first place — where the one-pass scan, each comparison
/// waiting on the last, took 27.5 µs over GPT-2's 50,257 scores (2.6 µs
/// in two passes, AMD EPYC Zen 4): serial work for every row of a
/// batched step. NaN scores never win (as in the
/// scan: none compares greater), unless the first is NaN, which the scan
/// keeps.
pub(crate) fn argmax(scores: &[f32]) -> u32 {
    const LANES: usize = 16;
    match scores.first() {
        None => return 0,
        Some(s) if s.is_nan() => return 0,
        Some(_) => {}
    }
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = scores.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &s) in lanes.iter_mut().zip(c) {
            // `s > m` is false for a NaN `s`: NaN never becomes the max.
            *m = if s > *m { s } else { *m };
        }
    }
    let mut max = lanes
        .into_iter()
        .fold(f32::NEG_INFINITY, |m, s| if s > m { s } else { m });
    for &s in tail {
        if s > max {
            max = s;
        }
    }
    // The first score equal to the largest: the scan's pick (the first
    // score is not NaN, so the largest is at least it, and found).
    scores.iter().position(|&s| s == max).unwrap_or(0) as u32
}

/// Sets every score below the `k`-th largest to `-inf` (ties at the k-th
/// kept), as transformers' `TopKLogitsWarper`.
fn keep_top_k(scores: &mut [f32], k: usize) {
    if k == 0 || k >= scores.len() {
        return;
    }
    let mut sorted = scores.to_vec();
    let (_, kth, _) = sorted.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let kth = *kth;
    for s in scores.iter_mut() {
        if *s < kth {
            *s = f32::NEG_INFINITY;
        }
    }
}

/// Mixes a seed and a row index into the seed of that row's stream
/// (SplitMix64's finaliser), so rows draw independently.
fn row_seed(seed: u64, row: usize) -> u64 {
    const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut z = seed.wrapping_add(GOLDEN_GAMMA.wrapping_mul(row as u64 + 1));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Chooses one token per row from processed scores: greedy, or one seeded
/// sampler per row.
pub(crate) enum Chooser {
    /// `argmax`.
    Greedy,
    /// One candle [`LogitsProcessor`] per row, with transformers' top-k
    /// applied before it (candle's own top-k-then-top-p does not
    /// renormalise the top-k probabilities before the nucleus cut).
    Sample {
        rows: Vec<LogitsProcessor>,
        top_k: Option<usize>,
    },
}

impl Chooser {
    /// The chooser of `strategy` (not beam search) for `rows` rows.
    pub(crate) fn new(strategy: &Strategy, rows: usize) -> Self {
        match strategy {
            Strategy::Sample {
                temperature,
                top_k,
                top_p,
                seed,
            } if *temperature >= MIN_SAMPLING_TEMPERATURE => {
                let sampling = match top_p {
                    Some(p) if *p < 1.0 => Sampling::TopP {
                        p: *p,
                        temperature: *temperature,
                    },
                    _ => Sampling::All {
                        temperature: *temperature,
                    },
                };
                Self::Sample {
                    rows: (0..rows)
                        .map(|r| {
                            LogitsProcessor::from_sampling(row_seed(*seed, r), sampling.clone())
                        })
                        .collect(),
                    top_k: *top_k,
                }
            }
            _ => Self::Greedy,
        }
    }

    /// The next token of `row`.
    pub(crate) fn choose(&mut self, row: usize, scores: &mut [f32]) -> Result<u32> {
        match self {
            Self::Greedy => Ok(argmax(scores)),
            Self::Sample { rows, top_k } => {
                if let Some(k) = top_k {
                    keep_top_k(scores, *k);
                }
                let Some(processor) = rows.get_mut(row) else {
                    return Ok(argmax(scores));
                };
                let t = Tensor::from_slice(scores, scores.len(), &Device::Cpu)?;
                Ok(processor.sample(&t)?)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_words_as_transformers() {
        let mut cfg = GenerationConfig {
            max_new_tokens: 8,
            min_new_tokens: 0,
            start_token_id: 0,
            eos_token_ids: vec![2],
            pad_token_id: 1,
            repetition_penalty: 1.0,
            no_repeat_ngram_size: 0,
            strategy: Strategy::Greedy,
            forced_bos_token_id: None,
            forced_eos_token_id: None,
            // <unk> alone; 5 after 4; 6 after 0 5 (spanning the prefix);
            // a lone end token, which transformers drops.
            bad_words_ids: vec![vec![3], vec![4, 5], vec![0, 5, 6], vec![2]],
            cross_attention_of: None,
        };
        let run = |generated: &[u32], cfg: &GenerationConfig| {
            let mut s = [0.0f32; 8];
            process(&mut s, &[0], generated, cfg);
            s.iter()
                .enumerate()
                .filter(|(_, v)| v.is_infinite())
                .map(|(i, _)| i as u32)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(&[], &cfg), [3]);
        assert_eq!(run(&[5], &cfg), [3, 6]);
        assert_eq!(run(&[7, 4], &cfg), [3, 5]);
        assert_eq!(run(&[4, 7], &cfg), [3]);
        cfg.bad_words_ids.push(Vec::new());
        let e = cfg.validate().unwrap_err().to_string();
        assert!(
            e.contains("bad_words_ids") && e.contains("sequence 4"),
            "{e}"
        );
    }

    #[test]
    fn top_k_keeps_ties() {
        let mut s = [1.0, 3.0, 2.0, 2.0, 0.0];
        keep_top_k(&mut s, 2);
        assert_eq!(s[1], 3.0);
        assert_eq!((s[2], s[3]), (2.0, 2.0));
        assert!(s[0].is_infinite() && s[4].is_infinite());
    }

    #[test]
    fn penalty_and_min_tokens() {
        let cfg = GenerationConfig {
            max_new_tokens: 4,
            min_new_tokens: 2,
            start_token_id: 0,
            eos_token_ids: vec![3],
            pad_token_id: 0,
            repetition_penalty: 2.0,
            no_repeat_ngram_size: 0,
            strategy: Strategy::Greedy,
            forced_bos_token_id: None,
            bad_words_ids: Vec::new(),
            forced_eos_token_id: None,
            cross_attention_of: None,
        };
        let mut s = [4.0, -1.0, 1.0, 5.0];
        process(&mut s, &[cfg.start_token_id], &[1, 1], &cfg);
        assert_eq!(s, [2.0, -2.0, 1.0, 5.0]);
        let mut s = [4.0, -1.0, 1.0, 5.0];
        process(&mut s, &[cfg.start_token_id], &[1], &cfg);
        assert_eq!(s[3], f32::NEG_INFINITY);
        assert_eq!(argmax(&[1.0, 2.0, 2.0]), 1);
    }

    /// The one-pass scan [`argmax`] replaced: the first strictly largest.
    fn argmax_scan(scores: &[f32]) -> u32 {
        let mut best = 0;
        for (i, s) in scores.iter().enumerate() {
            if *s > scores[best] {
                best = i;
            }
        }
        best as u32
    }

    proptest::proptest! {
        /// [`argmax`] picks what the scan picks: ties (few distinct
        /// values), infinities and NaNs (the first one too), any length
        /// around the 16 lanes.
        #[test]
        fn argmax_is_the_scan(
            picks in proptest::collection::vec(0usize..7, 0..70),
        ) {
            let table = [0.5f32, -1.0, 2.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 2.0];
            let scores: Vec<f32> = picks.iter().map(|&i| table[i]).collect();
            proptest::prop_assert_eq!(argmax(&scores), argmax_scan(&scores));
        }
    }

    #[test]
    fn argmax_edges() {
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, 3.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 40]), 0);
        let mut long = vec![0f32; 50_257];
        long[50_256] = 1.0;
        assert_eq!(argmax(&long), 50_256);
        long[17] = 1.0;
        assert_eq!(argmax(&long), 17);
    }

    /// The forced first token only at the first step, the forced last
    /// token only at the last step `max_new_tokens` allows; each leaves
    /// its own score 0 and every other `-inf`, as transformers.
    #[test]
    fn forced_first_and_last_tokens() {
        let mut cfg = GenerationConfig::greedy(&crate::DecoderConfig::tiny(5, 8), 3);
        cfg.forced_bos_token_id = Some(1);
        cfg.forced_eos_token_id = Some(2);
        let start = [cfg.start_token_id];
        let ninf = f32::NEG_INFINITY;
        let mut s = [0.5f32, -3.0, 1.0, 2.0, 4.0];
        process(&mut s, &start, &[], &cfg);
        assert_eq!(s, [ninf, 0.0, ninf, ninf, ninf]);
        let mut s = [0.5f32, -3.0, 1.0, 2.0, 4.0];
        process(&mut s, &start, &[1], &cfg);
        assert_eq!(s, [0.5, -3.0, 1.0, 2.0, 4.0]);
        let mut s = [0.5f32, -3.0, 1.0, 2.0, 4.0];
        process(&mut s, &start, &[1, 4], &cfg);
        assert_eq!(s, [ninf, ninf, 0.0, ninf, ninf]);
    }

    #[test]
    fn repeated_ngrams_are_banned() {
        // [start 0] 1 2 3 1 2: the trigram (1, 2, 3) is taken, so 3 is banned;
        // the bigram ban (n = 2) after "2" also bans 3, after "1" bans 2.
        let mut s = [0.0f32; 5];
        ban_repeated_ngrams(&mut s, &[0], &[1, 2, 3, 1, 2], 3);
        assert_eq!(s, [0.0, 0.0, 0.0, f32::NEG_INFINITY, 0.0]);
        let mut s = [0.0f32; 5];
        ban_repeated_ngrams(&mut s, &[0], &[1, 2, 3, 1], 2);
        assert_eq!(s, [0.0, 0.0, f32::NEG_INFINITY, 0.0, 0.0]);
        // Too short to repeat anything; the start token counts.
        let mut s = [0.0f32; 5];
        ban_repeated_ngrams(&mut s, &[0], &[1], 3);
        assert_eq!(s, [0.0; 5]);
        let mut s = [0.0f32; 5];
        ban_repeated_ngrams(&mut s, &[4], &[4], 2);
        assert_eq!(s[4], f32::NEG_INFINITY);
    }
}

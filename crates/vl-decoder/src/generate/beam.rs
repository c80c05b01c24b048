//! Beam search, following transformers' vectorised `_beam_search`
//! (`generation/utils.py`, v4.50 and later; see the [module
//! documentation](super) for the conventions, step by step).
//!
//! Every image has its own search over `num_beams` rows of one shared
//! [`DecodeState`](crate::DecodeState); the image's keys and values
//! are projected once and read by all its beams, and only the text caches
//! are reordered between steps.

use candle_core::{Tensor, D};

use super::config::{EarlyStopping, GenerationConfig, Strategy};
use super::logits::process;
use super::{Generated, StopReason, TokenEvent};
use crate::context::ImageContext;
use crate::error::{arg_err, Result};
use crate::model::VisionLanguageDecoder;
use crate::state::{decode_rows, MAX_ROWS};

/// transformers' "very large negative value" that masks a beam or a
/// candidate (added in f32, as there).
const MASKED: f32 = -1.0e9;

/// The settings of one search.
struct Params {
    num_beams: usize,
    length_penalty: f32,
    early_stopping: EarlyStopping,
    /// Most generated tokens, after the position limit.
    max_new: usize,
    /// Candidates kept per step: `max(2, 1 + eos ids) * num_beams`.
    beams_to_keep: usize,
}

/// `len ^ length_penalty`, computed in f64 as Python's `int ** float`.
fn length_divisor(len: usize, length_penalty: f32) -> f32 {
    (len as f64).powf(f64::from(length_penalty)) as f32
}

/// One continuation of a running beam.
struct Candidate {
    /// Accumulated log-probability.
    score: f32,
    beam: usize,
    token: u32,
    /// Whether it ends the beam: an EOS id, or the last allowed token.
    hits: bool,
}

/// A finished-hypothesis slot (transformers' `sequences`, `beam_scores`,
/// `is_sent_finished`).
#[derive(Debug, Clone)]
struct Slot {
    tokens: Vec<u32>,
    /// Per token, the recorded cross-attention weights (empty when not
    /// recorded).
    maps: Vec<Vec<f32>>,
    score: f32,
    finished: bool,
}

/// The search of one image.
struct ImageSearch {
    running: Vec<Vec<u32>>,
    /// Per running beam, its tokens' recorded cross-attention weights.
    running_maps: Vec<Vec<Vec<f32>>>,
    running_scores: Vec<f32>,
    slots: Vec<Slot>,
    /// transformers' `is_early_stop_heuristic_unsatisfied`.
    improvable: bool,
    done: bool,
}

impl ImageSearch {
    fn new(num_beams: usize) -> Self {
        // Only the first beam is live at the start: the others would
        // repeat its candidates.
        let mut running_scores = vec![MASKED; num_beams];
        running_scores[0] = 0.0;
        Self {
            running: vec![Vec::new(); num_beams],
            running_maps: vec![Vec::new(); num_beams],
            running_scores,
            slots: vec![
                Slot {
                    tokens: Vec::new(),
                    maps: Vec::new(),
                    score: MASKED,
                    finished: false,
                };
                num_beams
            ],
            improvable: true,
            done: false,
        }
    }

    /// The best `beams_to_keep` continuations, best first (ties: the lower
    /// `beam * vocab + token`).
    fn candidates(
        &self,
        log_probs: &[Vec<f32>],
        p: &Params,
        cfg: &GenerationConfig,
    ) -> Vec<Candidate> {
        let vocab = log_probs.first().map_or(0, Vec::len);
        let mut flat: Vec<(f32, usize)> = log_probs
            .iter()
            .zip(&self.running_scores)
            .enumerate()
            .flat_map(|(b, (row, &run))| {
                row.iter()
                    .enumerate()
                    .map(move |(v, &lp)| (lp + run, b * vocab + v))
            })
            .collect();
        let best_first =
            |a: &(f32, usize), b: &(f32, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let k = p.beams_to_keep.min(flat.len());
        if k > 0 && k < flat.len() {
            flat.select_nth_unstable_by(k - 1, best_first);
            flat.truncate(k);
        }
        flat.sort_by(best_first);
        // Every beam has generated as many tokens: this step's token is
        // number `len + 1`; at `max_new` every candidate ends.
        let last = self.running[0].len() + 1 >= p.max_new;
        flat.into_iter()
            .map(|(score, i)| {
                let token = (i % vocab) as u32;
                Candidate {
                    score,
                    beam: i / vocab,
                    token,
                    hits: last || cfg.is_eos(token),
                }
            })
            .collect()
    }

    /// One step over this image's processed log-probabilities
    /// `(num_beams, vocab)` and, when recorded, each beam's cross-attention
    /// weights of this step; returns the new running beams as
    /// `(source beam, token)`.
    fn step(
        &mut self,
        log_probs: &[Vec<f32>],
        weights: &[Option<Vec<f32>>],
        p: &Params,
        cfg: &GenerationConfig,
    ) -> Vec<(usize, u32)> {
        let nb = p.num_beams;
        let generated = self.running[0].len() + 1;
        let cands = self.candidates(log_probs, p, cfg);
        let extend = |c: &Candidate, running: &[Vec<u32>]| {
            let mut t = running[c.beam].clone();
            t.push(c.token);
            t
        };
        let extend_maps = |c: &Candidate, running: &[Vec<Vec<f32>>]| {
            let mut m = running[c.beam].clone();
            if let Some(Some(w)) = weights.get(c.beam) {
                m.push(w.clone());
            }
            m
        };

        // Running beams: the best candidates that do not end.
        let masked: Vec<f32> = cands
            .iter()
            .map(|c| if c.hits { c.score + MASKED } else { c.score })
            .collect();
        let mut order: Vec<usize> = (0..cands.len()).collect();
        order.sort_by(|&i, &j| masked[j].total_cmp(&masked[i]));
        order.truncate(nb);
        let chosen: Vec<(usize, u32)> = order
            .iter()
            .map(|&i| (cands[i].beam, cands[i].token))
            .collect();
        let running: Vec<Vec<u32>> = order
            .iter()
            .map(|&i| extend(&cands[i], &self.running))
            .collect();
        let running_maps: Vec<Vec<Vec<f32>>> = order
            .iter()
            .map(|&i| extend_maps(&cands[i], &self.running_maps))
            .collect();
        let running_scores: Vec<f32> = order.iter().map(|&i| masked[i]).collect();

        // Finished hypotheses: candidates that end among the first
        // `num_beams` ranks, scored `score / generated^length_penalty`,
        // merged with the slots; the best `num_beams` stay. (transformers
        // also masks candidates of items that can no longer improve or are
        // full under early_stopping=True; such an image is done here and
        // no longer stepped, so those masks never apply.)
        let divisor = length_divisor(generated, p.length_penalty);
        let mut merged = std::mem::take(&mut self.slots);
        for (rank, c) in cands.iter().enumerate() {
            let finished = c.hits && rank < nb;
            merged.push(Slot {
                tokens: if finished {
                    extend(c, &self.running)
                } else {
                    Vec::new()
                },
                maps: if finished {
                    extend_maps(c, &self.running_maps)
                } else {
                    Vec::new()
                },
                score: if finished {
                    c.score / divisor
                } else {
                    c.score / divisor + MASKED
                },
                finished,
            });
        }
        merged.sort_by(|a, b| b.score.total_cmp(&a.score));
        merged.truncate(nb);
        self.slots = merged;
        self.running = running;
        self.running_maps = running_maps;
        self.running_scores = running_scores;

        // Can a running beam still beat the worst finished hypothesis?
        let best_len = if p.early_stopping == EarlyStopping::Never && p.length_penalty > 0.0 {
            p.max_new
        } else {
            generated
        };
        let best_possible = self.running_scores[0] / length_divisor(best_len, p.length_penalty);
        let worst = self
            .slots
            .iter()
            .map(|s| s.score)
            .fold(f32::INFINITY, f32::min);
        self.improvable &= self
            .slots
            .iter()
            .any(|s| best_possible > if s.finished { worst } else { MASKED });
        let full = p.early_stopping == EarlyStopping::True && self.slots.iter().all(|s| s.finished);
        let can_continue = !cands.iter().all(|c| c.hits);
        self.done = !(self.improvable && !full && can_continue);
        chosen
    }

    /// The best finished hypothesis (the best running beam if, in some
    /// degenerate case, none finished).
    fn result(&self, cfg: &GenerationConfig, p: &Params, limit: StopReason) -> Generated {
        let (tokens, score, cross_attention) = match self.slots.iter().find(|s| s.finished) {
            Some(s) => (s.tokens.clone(), s.score, s.maps.clone()),
            None => {
                let len = self.running[0].len().max(1);
                (
                    self.running[0].clone(),
                    self.running_scores[0] / length_divisor(len, p.length_penalty),
                    self.running_maps[0].clone(),
                )
            }
        };
        let stop = match tokens.last() {
            Some(&t) if cfg.is_eos(t) => StopReason::Eos,
            _ => limit,
        };
        Generated {
            tokens,
            score: Some(score),
            stop,
            cross_attention,
        }
    }
}

impl Params {
    /// The settings of `cfg`'s beam search for `images` images after a
    /// prefix of `prefix_len` tokens, and the stop reason of a search that
    /// reaches its last token.
    fn new(
        model: &VisionLanguageDecoder,
        cfg: &GenerationConfig,
        images: usize,
        prefix_len: usize,
    ) -> Result<(Self, StopReason)> {
        let Strategy::Beam {
            num_beams,
            length_penalty,
            early_stopping,
        } = cfg.strategy
        else {
            return arg_err("strategy", "beam search needs Strategy::Beam");
        };
        let max_positions = model.config().max_position_embeddings;
        let vocab = model.config().vocab_size;
        let per_beam = 2.max(1 + cfg.eos_token_ids.len());
        if vocab < per_beam {
            return arg_err(
                "eos_token_ids",
                format!(
                    "beam search keeps {per_beam} * num_beams candidates per step, more than the \
                     vocabulary size {vocab} * num_beams"
                ),
            );
        }
        // Every row is one beam of one image, indexed by u32.
        let beams_to_keep = per_beam.checked_mul(num_beams);
        let (Some(beams_to_keep), Some(_)) = (beams_to_keep, decode_rows(images, num_beams)) else {
            return arg_err(
                "num_beams",
                format!(
                    "expected at most {} beams per image ({images} images, {per_beam} candidates \
                     kept per beam), got {num_beams}",
                    (MAX_ROWS / images).min(usize::MAX / per_beam)
                ),
            );
        };
        let p = Params {
            num_beams,
            length_penalty,
            early_stopping,
            // The prefix takes positions of its own (the start token's is
            // counted as a generated one's, as before).
            max_new: cfg
                .max_new_tokens
                .min(max_positions.saturating_sub(prefix_len.saturating_sub(1))),
            beams_to_keep,
        };
        let limit = if p.max_new < cfg.max_new_tokens {
            StopReason::MaxPositions
        } else {
            StopReason::MaxNewTokens
        };
        Ok((p, limit))
    }
}

/// One image's beam search with its settings: what a decode loop drives.
pub(crate) struct BeamSearch {
    search: ImageSearch,
    p: Params,
    limit: StopReason,
}

impl BeamSearch {
    /// A search of `cfg` (beam search) over one image after `prefix_len`
    /// tokens.
    pub(crate) fn new(
        model: &VisionLanguageDecoder,
        cfg: &GenerationConfig,
        prefix_len: usize,
    ) -> Result<Self> {
        let (p, limit) = Params::new(model, cfg, 1, prefix_len)?;
        Ok(Self {
            search: ImageSearch::new(p.num_beams),
            p,
            limit,
        })
    }

    /// Beams, the search's rows.
    pub(crate) fn beams(&self) -> usize {
        self.p.num_beams
    }

    /// One step: see [`advance`].
    pub(crate) fn advance(
        &mut self,
        log_probs: Vec<Vec<f32>>,
        weights: &[Option<Vec<f32>>],
        prefix: &[u32],
        cfg: &GenerationConfig,
    ) -> (Vec<(usize, u32)>, Option<Generated>) {
        advance(
            &mut self.search,
            log_probs,
            weights,
            prefix,
            &self.p,
            cfg,
            self.limit,
        )
    }
}

/// One step of an image's search over its beams' log-probabilities
/// `(num_beams, vocab)` (processed here) and cross-attention weights: the
/// new running beams as `(source beam, token)`, and the result when the
/// search ended.
fn advance(
    search: &mut ImageSearch,
    mut log_probs: Vec<Vec<f32>>,
    weights: &[Option<Vec<f32>>],
    prefix: &[u32],
    p: &Params,
    cfg: &GenerationConfig,
    limit: StopReason,
) -> (Vec<(usize, u32)>, Option<Generated>) {
    for (row, beam) in log_probs.iter_mut().zip(&search.running) {
        process(row, prefix, beam, cfg);
    }
    let chosen = search.step(&log_probs, weights, p, cfg);
    let result = search.done.then(|| search.result(cfg, p, limit));
    (chosen, result)
}

/// Streams a finished search's tokens as `image`'s.
pub(crate) fn stream(g: &Generated, image: usize, on_token: &mut dyn FnMut(TokenEvent)) {
    for (index, &token) in g.tokens.iter().enumerate() {
        on_token(TokenEvent {
            image,
            token,
            index,
        });
    }
}

/// Beam search over every image at once: `num_beams` rows per image.
///
/// Each image's best hypothesis is streamed to `on_token` when that image's
/// search ends. Images whose search has ended are fed `pad_token_id` and
/// their logits ignored; decoding stops when every search has ended.
pub(crate) fn decode(
    model: &VisionLanguageDecoder,
    image: &ImageContext,
    cfg: &GenerationConfig,
    prefix: &[u32],
    on_token: &mut dyn FnMut(TokenEvent),
) -> Result<Vec<Generated>> {
    let images = image.images().max(1);
    let (p, limit) = Params::new(model, cfg, images, prefix.len())?;
    let num_beams = p.num_beams;
    let mut state = model.start_for(image, num_beams, prefix.len().saturating_add(p.max_new))?;
    let rows = state.rows();
    let mut searches: Vec<ImageSearch> = (0..rows / num_beams)
        .map(|_| ImageSearch::new(num_beams))
        .collect();
    let mut results: Vec<Option<Generated>> = vec![None; searches.len()];
    // (rows, prefix.len()) in the first step, (rows, 1) after.
    let mut next: Vec<u32> = prefix.repeat(rows);
    while searches.iter().any(|s| !s.done) {
        let input = Tensor::from_slice(&next, (rows, next.len() / rows), model.device())?;
        next.truncate(rows);
        let (logits, weights) =
            super::step_last(model, &mut state, &input, cfg.cross_attention_of)?; // (rows, vocab)
        let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let (log_probs, weights) = super::sampling::rows_of(&log_probs, weights)?;
        let mut log_probs = log_probs.into_iter();
        let mut weights = weights.into_iter();
        let mut order: Vec<u32> = (0..rows as u32).collect();
        for (i, search) in searches.iter_mut().enumerate() {
            let block: Vec<Vec<f32>> = log_probs.by_ref().take(num_beams).collect(); // (num_beams, vocab)
            let block_weights: Vec<Option<Vec<f32>>> = weights.by_ref().take(num_beams).collect();
            let first = i * num_beams;
            if search.done {
                next[first..first + num_beams].fill(cfg.pad_token_id);
                continue;
            }
            let (chosen, result) = advance(search, block, &block_weights, prefix, &p, cfg, limit);
            for (j, (src, token)) in chosen.into_iter().enumerate() {
                order[first + j] = (first + src) as u32;
                next[first + j] = token;
            }
            if let Some(g) = result {
                stream(&g, i, on_token);
                results[i] = Some(g);
            }
        }
        if searches.iter().any(|s| !s.done)
            && order.iter().enumerate().any(|(j, &i)| i as usize != j)
        {
            state.reorder(&order)?;
        }
    }
    Ok(results
        .into_iter()
        .map(|g| {
            g.unwrap_or(Generated {
                tokens: Vec::new(),
                score: None,
                stop: limit,
                cross_attention: Vec::new(),
            })
        })
        .collect())
}

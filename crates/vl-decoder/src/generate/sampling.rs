//! Greedy decoding and sampling: one row per image, all images decoded
//! together in one [`DecodeState`](crate::DecodeState).

use candle_core::Tensor;

use super::config::GenerationConfig;
use super::logits::{process, Chooser};
use super::{Generated, StopReason, TokenEvent};
use crate::context::ImageContext;
use crate::error::Result;
use crate::model::VisionLanguageDecoder;

/// One row's caption so far, greedy or sampled.
#[derive(Debug, Clone, Default)]
pub(crate) struct RowSearch {
    tokens: Vec<u32>,
    maps: Vec<Vec<f32>>,
    stop: Option<StopReason>,
}

impl RowSearch {
    /// Tokens chosen so far.
    pub(crate) fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the caption has ended at an EOS id.
    pub(crate) fn ended(&self) -> bool {
        self.stop.is_some()
    }

    /// Chooses the row's next token from its logits `scores` (processed
    /// here), records it with its cross-attention `weights`, streams it
    /// as `image`'s token, and returns the row's next input: the token, or
    /// `pad_token_id` once the caption ended.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn advance(
        &mut self,
        mut scores: Vec<f32>,
        weights: Option<Vec<f32>>,
        prefix: &[u32],
        cfg: &GenerationConfig,
        chooser: &mut Chooser,
        row: usize,
        image: usize,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<u32> {
        if self.stop.is_some() {
            return Ok(cfg.pad_token_id);
        }
        process(&mut scores, prefix, &self.tokens, cfg);
        let token = chooser.choose(row, &mut scores)?;
        let index = self.tokens.len();
        self.tokens.push(token);
        if let Some(w) = weights {
            self.maps.push(w);
        }
        on_token(TokenEvent {
            image,
            token,
            index,
        });
        if cfg.is_eos(token) {
            self.stop = Some(StopReason::Eos);
            Ok(cfg.pad_token_id)
        } else {
            Ok(token)
        }
    }

    /// The caption, ended at an EOS id or else by `limit`.
    pub(crate) fn result(self, limit: StopReason) -> Generated {
        Generated {
            tokens: self.tokens,
            score: None,
            stop: self.stop.unwrap_or(limit),
            cross_attention: self.maps,
        }
    }
}

/// A step's rows: logits (or log-probabilities), and cross-attention
/// weights when recorded.
pub(crate) type StepRows = (Vec<Vec<f32>>, Vec<Option<Vec<f32>>>);

/// A step's logits `(rows, vocab)` and cross-attention weights `(rows,
/// image_len)` as rows.
pub(crate) fn rows_of(logits: &Tensor, weights: Option<Tensor>) -> Result<StepRows> {
    let logits = logits.to_vec2::<f32>()?;
    let weights = match weights {
        Some(w) => w.to_vec2::<f32>()?.into_iter().map(Some).collect(),
        None => vec![None; logits.len()],
    };
    Ok((logits, weights))
}

/// Decodes one caption per image (one row in text-only mode), choosing
/// tokens with greedy decoding or seeded sampling.
///
/// Rows whose caption has ended are fed `pad_token_id` and their logits are
/// ignored; decoding stops when every row has ended, after
/// `max_new_tokens`, or when the next step would need a position past
/// `max_position_embeddings`.
///
/// `prefix` (the start token, then any prompt) is fed to every row in the
/// first step.
pub(crate) fn decode(
    model: &VisionLanguageDecoder,
    image: &ImageContext,
    cfg: &GenerationConfig,
    prefix: &[u32],
    on_token: &mut dyn FnMut(TokenEvent),
) -> Result<Vec<Generated>> {
    let mut state = model.start_for(image, 1, prefix.len().saturating_add(cfg.max_new_tokens))?;
    let rows = state.rows();
    let max_positions = model.config().max_position_embeddings;
    let mut chooser = Chooser::new(&cfg.strategy, rows);
    let mut searches = vec![RowSearch::default(); rows];
    // (rows, prefix.len()) in the first step, (rows, 1) after.
    let mut next: Vec<u32> = prefix.repeat(rows);
    let mut limit = StopReason::MaxNewTokens;
    for _ in 0..cfg.max_new_tokens {
        if state.position() >= max_positions {
            limit = StopReason::MaxPositions;
            break;
        }
        let input = Tensor::from_slice(&next, (rows, next.len() / rows), model.device())?;
        next.truncate(rows);
        let (logits, weights) =
            super::step_last(model, &mut state, &input, cfg.cross_attention_of)?;
        let (logits, weights) = rows_of(&logits, weights)?;
        for (row, (scores, w)) in logits.into_iter().zip(weights).enumerate() {
            next[row] =
                searches[row].advance(scores, w, prefix, cfg, &mut chooser, row, row, on_token)?;
        }
        if searches.iter().all(RowSearch::ended) {
            break;
        }
    }
    Ok(searches.into_iter().map(|s| s.result(limit)).collect())
}

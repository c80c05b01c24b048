//! Greedy decoding and sampling: one row per image, all images decoded
//! together in one [`DecodeState`](crate::model::DecodeState).

use candle_core::Tensor;

use super::config::GenerationConfig;
use super::logits::{process, Chooser};
use super::{Generated, StopReason, TokenEvent};
use crate::context::ImageContext;
use crate::error::Result;
use crate::model::VisionLanguageDecoder;

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
    let mut state = model.start(image, 1)?;
    let rows = state.rows();
    let max_positions = model.config().max_position_embeddings;
    let mut chooser = Chooser::new(&cfg.strategy, rows);
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); rows];
    let mut maps: Vec<Vec<Vec<f32>>> = vec![Vec::new(); rows];
    let mut stops: Vec<Option<StopReason>> = vec![None; rows];
    // (rows, prefix.len()) in the first step, (rows, 1) after.
    let mut next: Vec<u32> = prefix.repeat(rows);
    let mut limit = StopReason::MaxNewTokens;
    for index in 0..cfg.max_new_tokens {
        if state.position() >= max_positions {
            limit = StopReason::MaxPositions;
            break;
        }
        let input = Tensor::from_slice(&next, (rows, next.len() / rows), model.device())?;
        next.truncate(rows);
        let (logits, weights) =
            super::step_last(model, &mut state, &input, cfg.cross_attention_of)?;
        let logits = logits.to_vec2::<f32>()?; // (rows, vocab)
        let mut weights = match weights {
            Some(w) => w.to_vec2::<f32>()?.into_iter().map(Some).collect(), // (rows, image_len)
            None => vec![None; rows],
        };
        for (row, mut scores) in logits.into_iter().enumerate() {
            if stops[row].is_some() {
                next[row] = cfg.pad_token_id;
                continue;
            }
            process(&mut scores, prefix, &tokens[row], cfg);
            let token = chooser.choose(row, &mut scores)?;
            tokens[row].push(token);
            if let Some(w) = weights[row].take() {
                maps[row].push(w);
            }
            on_token(TokenEvent {
                image: row,
                token,
                index,
            });
            if cfg.is_eos(token) {
                stops[row] = Some(StopReason::Eos);
                next[row] = cfg.pad_token_id;
            } else {
                next[row] = token;
            }
        }
        if stops.iter().all(Option::is_some) {
            break;
        }
    }
    Ok(tokens
        .into_iter()
        .zip(stops)
        .zip(maps)
        .map(|((tokens, stop), cross_attention)| Generated {
            tokens,
            score: None,
            stop: stop.unwrap_or(limit),
            cross_attention,
        })
        .collect())
}

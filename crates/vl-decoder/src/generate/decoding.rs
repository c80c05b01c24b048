//! One image's generation as a value that a caller advances step by step
//! ([`Decoding`], [`step_decodings`]): what a server needs to let requests
//! join and leave a running batch between steps. The searches are
//! [`super::generate`]'s own — greedy, sampling and beam search choose
//! exactly as there.

use candle_core::{Tensor, D};

use super::beam::{self, BeamSearch};
use super::config::{GenerationConfig, Strategy};
use super::logits::Chooser;
use super::sampling::{rows_of, RowSearch};
use super::{Generated, StopReason, TokenEvent};
use crate::context::ImageContext;
use crate::error::{arg_err, Result};
use crate::model::VisionLanguageDecoder;
use crate::state::{DecodeState, StepOptions};

/// How a [`Decoding`] chooses its tokens.
enum Search {
    /// Greedy or sampled: one row.
    Row { row: RowSearch, chooser: Chooser },
    /// Beam search: `num_beams` rows.
    Beam(BeamSearch),
}

/// One image's generation in progress, with its own [`DecodeState`]:
/// started by [`Decoding::start`], advanced by [`step_decodings`] together
/// with any others (each at its own position, over its own image), ended
/// when [`Decoding::generated`] is `Some`.
///
/// Its tokens are those [`super::generate_from`] gives the image alone
/// with the same settings (sampling: the image's row 0 of a batch), up to
/// the products' rounding for the row count of the step that computed them
/// (see [`VisionLanguageDecoder::step_many`]).
pub struct Decoding {
    state: DecodeState,
    search: Search,
    cfg: GenerationConfig,
    /// The start token and the prompt.
    prefix: Vec<u32>,
    /// The next step's input, `(rows, len)` row-major.
    next: Vec<u32>,
    result: Option<Generated>,
}

impl std::fmt::Debug for Decoding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoding")
            .field("rows", &self.state.rows())
            .field("position", &self.state.position())
            .field("done", &self.result.is_some())
            .finish_non_exhaustive()
    }
}

impl Decoding {
    /// Starts generating after the start token and `prompt` over `image`
    /// (one image, or none in text-only mode) with `cfg`'s settings.
    ///
    /// # Errors
    /// As [`super::generate_from`]; [`crate::DecoderError::Argument`]
    /// naming `image` when it holds more than one image or is interleaved.
    pub fn start(
        model: &VisionLanguageDecoder,
        image: &ImageContext,
        cfg: &GenerationConfig,
        prompt: &[u32],
    ) -> Result<Self> {
        if image.images() > 1 || image.media.is_some() {
            return arg_err(
                "image",
                format!(
                    "expected a context of one image, got {} {}",
                    image.images(),
                    if image.media.is_some() {
                        "interleaved samples"
                    } else {
                        "images"
                    }
                ),
            );
        }
        let prefix = super::prefix_of(model, cfg, prompt)?;
        let search = match cfg.strategy {
            Strategy::Beam { .. } => Search::Beam(BeamSearch::new(model, cfg, prefix.len())?),
            Strategy::Greedy | Strategy::Sample { .. } => Search::Row {
                row: RowSearch::default(),
                chooser: Chooser::new(&cfg.strategy, 1),
            },
        };
        let rows = match &search {
            Search::Beam(b) => b.beams(),
            Search::Row { .. } => 1,
        };
        let state =
            model.start_for(image, rows, prefix.len().saturating_add(cfg.max_new_tokens))?;
        Ok(Self {
            next: prefix.repeat(rows),
            prefix,
            state,
            search,
            cfg: cfg.clone(),
            result: None,
        })
    }

    /// Rows it decodes: 1, or the beams.
    pub fn rows(&self) -> usize {
        self.state.rows()
    }

    /// Tokens fed so far (its next position).
    pub fn position(&self) -> usize {
        self.state.position()
    }

    /// The settings it generates with.
    pub fn config(&self) -> &GenerationConfig {
        &self.cfg
    }

    /// The result, once it ended.
    pub fn generated(&self) -> Option<&Generated> {
        self.result.as_ref()
    }

    /// The result, once it ended.
    pub fn into_generated(self) -> Option<Generated> {
        self.result
    }

    /// Tokens per row of its next input: the prefix's length first, 1 after.
    fn input_len(&self) -> usize {
        self.next.len() / self.state.rows()
    }

    /// Takes one step's logits `(rows, vocab)` and cross-attention weights
    /// `(rows, image_len)`: chooses, streams, ends or sets the next input.
    fn advance(
        &mut self,
        logits: &Tensor,
        weights: Option<Tensor>,
        image: usize,
        max_positions: usize,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<()> {
        let cfg = &self.cfg;
        match &mut self.search {
            Search::Row { row, chooser } => {
                let (logits, weights) = rows_of(logits, weights)?;
                let (Some(scores), Some(w)) =
                    (logits.into_iter().next(), weights.into_iter().next())
                else {
                    return arg_err("logits", "expected one row");
                };
                let token =
                    row.advance(scores, w, &self.prefix, cfg, chooser, 0, image, on_token)?;
                let generated = row.len();
                let limit = if generated >= cfg.max_new_tokens {
                    Some(StopReason::MaxNewTokens)
                } else if self.state.position() >= max_positions {
                    Some(StopReason::MaxPositions)
                } else {
                    None
                };
                if row.ended() || limit.is_some() {
                    let row = std::mem::take(row);
                    self.result = Some(row.result(limit.unwrap_or(StopReason::MaxNewTokens)));
                } else {
                    self.next = vec![token];
                }
            }
            Search::Beam(search) => {
                let log_probs = candle_nn::ops::log_softmax(logits, D::Minus1)?;
                let (log_probs, weights) = rows_of(&log_probs, weights)?;
                let (chosen, result) = search.advance(log_probs, &weights, &self.prefix, cfg);
                if let Some(g) = result {
                    beam::stream(&g, image, on_token);
                    self.result = Some(g);
                    return Ok(());
                }
                let order: Vec<u32> = chosen.iter().map(|&(src, _)| src as u32).collect();
                self.next = chosen.iter().map(|&(_, token)| token).collect();
                if order.iter().enumerate().any(|(j, &i)| i as usize != j) {
                    self.state.reorder(&order)?;
                }
            }
        }
        Ok(())
    }
}

/// Advances every decoding of `decodings` that has not ended by one token,
/// in one [`VisionLanguageDecoder::step_many`] per input length (one for a
/// running batch; a decoding's first step feeds its whole prefix). Each
/// token is streamed to `on_token` as for [`super::generate`], with
/// [`TokenEvent::image`] the decoding's index in `decodings`; beam search
/// streams its result when it ends.
///
/// # Errors
/// As [`VisionLanguageDecoder::step_many`] (every decoding reads an image,
/// or none does); [`crate::DecoderError::Argument`] naming `decodings`
/// when two record the cross-attention weights of different blocks.
pub fn step_decodings(
    model: &VisionLanguageDecoder,
    decodings: &mut [&mut Decoding],
    on_token: &mut dyn FnMut(TokenEvent),
) -> Result<()> {
    let live: Vec<usize> = (0..decodings.len())
        .filter(|&i| decodings[i].result.is_none())
        .collect();
    if live.is_empty() {
        return Ok(());
    }
    // The block whose weights some decoding records: the step computes
    // them for every row, and those that record none drop them.
    let mut asked = live
        .iter()
        .filter_map(|&i| decodings[i].cfg.cross_attention_of);
    let weights_of = asked.next();
    if asked.any(|layer| Some(layer) != weights_of) {
        return arg_err(
            "decodings",
            "expected the decodings that record cross-attention to record the same block's",
        );
    }
    let options = StepOptions {
        weights_of,
        ..StepOptions::last()
    };
    let max_positions = model.config().max_position_embeddings;
    let mut lens: Vec<usize> = live.iter().map(|&i| decodings[i].input_len()).collect();
    lens.sort_unstable();
    lens.dedup();
    for len in lens {
        let group: Vec<usize> = live
            .iter()
            .copied()
            .filter(|&i| decodings[i].input_len() == len)
            .collect();
        let inputs: Vec<Tensor> = group
            .iter()
            .map(|&i| {
                let d = &decodings[i];
                Tensor::from_slice(&d.next, (d.rows(), len), model.device())
            })
            .collect::<candle_core::Result<_>>()?;
        let outputs = {
            let mut states: Vec<&mut DecodeState> = decodings
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| group.contains(i))
                .map(|(_, d)| &mut d.state)
                .collect();
            model.step_many(&mut states, &inputs, options)?
        };
        for (&i, out) in group.iter().zip(outputs) {
            let weights = match decodings[i].cfg.cross_attention_of {
                Some(_) => super::mean_heads(out.weights)?,
                None => None,
            };
            decodings[i].advance(&out.values, weights, i, max_positions, on_token)?;
        }
    }
    Ok(())
}

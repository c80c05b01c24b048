//! Text generation: greedy decoding, seeded sampling and beam search over a
//! batch of images, with the image keys and values projected once.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use vl_decoder::{generate, DecoderConfig, GenerationConfig, Strategy, VisionLanguageDecoder};
//!
//! # fn main() -> Result<(), vl_decoder::DecoderError> {
//! let dev = Device::Cpu;
//! let vars = VarMap::new();
//! let cfg = DecoderConfig::tiny(50, 16);
//! let model = VisionLanguageDecoder::load(VarBuilder::from_varmap(&vars, DType::F32, &dev), &cfg)?;
//! let memory = Tensor::randn(0f32, 1.0, (2, 5, 16), &dev)?; // (images, image_len, memory_dim)
//! let ctx = model.image_context(&memory, None)?;
//!
//! // Or Strategy::Greedy, or Strategy::beam(num_beams).
//! let strategy = Strategy::Sample { temperature: 0.8, top_k: Some(20), top_p: Some(0.9), seed: 0 };
//! let gen = GenerationConfig::greedy(&cfg, 8).with_strategy(strategy);
//! let mut streamed = Vec::new();
//! let captions = generate(&model, &ctx, &gen, &mut |e| streamed.push(e))?;
//! assert_eq!(captions.len(), 2);
//! assert!(captions.iter().all(|c| !c.tokens.is_empty() && c.tokens.len() <= 8));
//! assert_eq!(streamed.len(), captions.iter().map(|c| c.tokens.len()).sum::<usize>());
//! # Ok(())
//! # }
//! ```
//!
//! # Beam search: the transformers conventions followed
//!
//! Beam search reproduces transformers' `GenerationMixin._beam_search` as
//! rewritten in v4.50 (PR #35802, the vectorised version without
//! `BeamSearchScorer`; read in `src/transformers/generation/utils.py`,
//! `_get_top_k_continuations`, `_get_running_beams_for_next_iteration`,
//! `_update_finished_beams`, `_check_early_stop_heuristic`,
//! `_beam_search_has_unfinished_sequences`), with a prompt of one token
//! (the start token, `decoder_prompt_len = 1`):
//!
//! 1. Running scores start at 0 for the first beam and -1e9 for the others.
//! 2. Each step takes `log_softmax` of the f32 logits, then the logits
//!    processors on those log-probabilities (repetition penalty over the
//!    whole sequence, start token included; `min_new_tokens`, which sets
//!    every EOS id to `-inf` while fewer than `min_new_tokens` tokens are
//!    generated), and adds the beam's running score.
//! 3. The best `max(2, 1 + eos ids) * num_beams` candidates over
//!    `num_beams * vocab` are kept (not `2 * num_beams` when there are
//!    several EOS ids). A candidate *ends* if its token is an EOS id or it is
//!    token number `max_new_tokens` (transformers' `MaxLengthCriteria`).
//! 4. The next running beams are the best `num_beams` candidates after
//!    adding -1e9 to those that end.
//! 5. Candidates that end and rank among the first `num_beams` are finished
//!    hypotheses scored `sum_logprobs / generated_len ^ length_penalty`,
//!    where `generated_len` counts the generated tokens *including* the one
//!    just chosen (the EOS): transformers'
//!    `cur_len + 1 - decoder_prompt_len`. They are merged with the kept
//!    hypotheses and the best `num_beams` stay. At the last token every
//!    top-`num_beams` candidate ends, so the open beams are finalised there
//!    (there is no separate `finalize`).
//! 6. An image's search ends when (a) early_stopping=True and it has
//!    `num_beams` finished hypotheses, or (b) the best running score divided
//!    by `L ^ length_penalty` is no longer above the worst finished score
//!    (with `num_beams` finished), where `L` = tokens generated so far, or
//!    `max_new_tokens` for early_stopping="never" with
//!    `length_penalty > 0`, or (c) every candidate ended (the last token).
//! 7. The result is the best finished hypothesis, with its score.
//!
//! Ties are broken towards the lower `beam * vocab + token` index (torch's
//! `topk` does not specify its order on ties). The maximum length also
//! respects the model: at most `max_position_embeddings` tokens are
//! generated (the last one is never fed).
//!
//! Sampling uses candle's `LogitsProcessor` (temperature, then top-p), with
//! transformers' top-k applied first; its random streams are not torch's,
//! so sampled tokens cannot match transformers token for token.

mod beam;
mod config;
mod decoding;
mod logits;
mod sampling;

pub use config::{EarlyStopping, GenerationConfig, Strategy, MIN_SAMPLING_TEMPERATURE};
pub use decoding::{step_decodings, Decoding};

use candle_core::Tensor;

use crate::context::ImageContext;
use crate::error::Result;
use crate::model::VisionLanguageDecoder;
use crate::state::{DecodeState, StepOptions};

/// Why a caption ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// It ends with one of `eos_token_ids`.
    Eos,
    /// It reached `max_new_tokens`.
    MaxNewTokens,
    /// It reached the model's `max_position_embeddings` before
    /// `max_new_tokens`: a normal stop, not an error.
    MaxPositions,
}

/// One image's caption.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// The tokens after the start token, the EOS included when one ended
    /// the caption.
    pub tokens: Vec<u32>,
    /// Beam search: the hypothesis' score,
    /// `sum_logprobs / len(tokens) ^ length_penalty`; `None` otherwise.
    pub score: Option<f32>,
    /// Why the caption ended.
    pub stop: StopReason,
    /// With [`GenerationConfig::cross_attention_of`]: per token of
    /// `tokens`, that block's cross-attention weights (heads averaged) over
    /// the image's tokens at the position that chose it — for beam search,
    /// along the hypothesis' own path. Empty otherwise.
    ///
    /// # Shapes
    /// `tokens.len()` rows of `image_len` weights.
    pub cross_attention: Vec<Vec<f32>>,
}

/// A token as it is chosen, for streaming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenEvent {
    /// The image (0 in text-only mode).
    pub image: usize,
    /// The token.
    pub token: u32,
    /// Its index in that image's [`Generated::tokens`].
    pub index: usize,
}

/// Generates one caption per image of `image` (one in text-only mode).
///
/// All images decode together in one
/// [`crate::DecodeState`]: one row per image for greedy
/// decoding and sampling, `num_beams` rows per image for beam search, all
/// reading the image's keys and values projected once. Images whose caption
/// has ended are fed `pad_token_id` and their logits ignored; decoding stops
/// when every caption has ended.
///
/// `on_token` sees every returned token, in order per image: for greedy
/// decoding and sampling as each token is chosen; for beam search, the
/// final hypothesis' tokens all at once, when that image's search ends
/// (earlier tokens may still change until then).
///
/// A caption that would pass the model's `max_position_embeddings` stops
/// with [`StopReason::MaxPositions`]; this is not an error.
///
/// # Shapes
/// `image` holds `images` images (see
/// [`VisionLanguageDecoder::image_context`]) → `images` results (1 in
/// text-only mode), each at most `max_new_tokens` tokens.
///
/// # Errors
/// [`DecoderError::Argument`](crate::DecoderError::Argument) naming the
/// field when [`GenerationConfig::validate`] fails or a token id is not in
/// the vocabulary; model errors otherwise.
pub fn generate(
    model: &VisionLanguageDecoder,
    image: &ImageContext,
    cfg: &GenerationConfig,
    on_token: &mut dyn FnMut(TokenEvent),
) -> Result<Vec<Generated>> {
    generate_from(model, image, cfg, &[], on_token)
}

/// As [`generate`], continuing `prompt`: every caption starts from the
/// start token followed by `prompt` (fed in one step, the image keys and
/// values still projected once), and [`Generated::tokens`] holds only the
/// tokens generated after it. The repetition penalty and the n-gram ban
/// see the prompt, as transformers' `input_ids` holds it; beam scores'
/// lengths count generated tokens only (transformers' `decoder_prompt_len`).
/// An empty `prompt` is [`generate`].
///
/// # Errors
/// As [`generate`]; [`DecoderError::Argument`](crate::DecoderError::Argument)
/// naming `prompt` when one of its ids is not in the vocabulary or it does
/// not fit in `max_position_embeddings` with the start token.
pub fn generate_from(
    model: &VisionLanguageDecoder,
    image: &ImageContext,
    cfg: &GenerationConfig,
    prompt: &[u32],
    on_token: &mut dyn FnMut(TokenEvent),
) -> Result<Vec<Generated>> {
    let prefix = prefix_of(model, cfg, prompt)?;
    // Steps of small parallel parts: the pool's workers stay awake between
    // them (see `KeepAwake`).
    let _awake = vl_attn::kernels::KeepAwake::for_device(model.device());
    match cfg.strategy {
        Strategy::Beam { .. } => beam::decode(model, image, cfg, &prefix, on_token),
        Strategy::Greedy | Strategy::Sample { .. } => {
            sampling::decode(model, image, cfg, &prefix, on_token)
        }
    }
}

/// Checks `cfg` and `prompt` against `model` and returns what every row
/// is fed first: the start token, then `prompt`.
fn prefix_of(
    model: &VisionLanguageDecoder,
    cfg: &GenerationConfig,
    prompt: &[u32],
) -> Result<Vec<u32>> {
    cfg.validate()?;
    let mc = model.config();
    cfg.check_ids(mc.vocab_size)?;
    if let Some(id) = prompt.iter().find(|&&id| id as usize >= mc.vocab_size) {
        return crate::error::arg_err(
            "prompt",
            format!("token id {id} is not below vocab_size {}", mc.vocab_size),
        );
    }
    if prompt.len() >= mc.max_position_embeddings {
        return crate::error::arg_err(
            "prompt",
            format!(
                "{} tokens and the start token do not fit in max_position_embeddings {}",
                prompt.len(),
                mc.max_position_embeddings
            ),
        );
    }
    Ok(std::iter::once(cfg.start_token_id)
        .chain(prompt.iter().copied())
        .collect())
}

/// One generation step: the last position's logits `(rows, vocab)` and,
/// when `weights_of` names a block, its cross-attention weights of that
/// position with the heads averaged, `(rows, image_len)` f32 — what a
/// heatmap of each generated token shows.
fn step_last(
    model: &VisionLanguageDecoder,
    state: &mut DecodeState,
    input: &Tensor,
    weights_of: Option<usize>,
) -> Result<(Tensor, Option<Tensor>)> {
    let options = StepOptions {
        weights_of,
        ..StepOptions::last()
    };
    let out = model.step(state, input, options)?;
    Ok((out.values, mean_heads(out.weights)?))
}

/// Cross-attention weights `(rows, heads, image_len)` with the heads
/// averaged, `(rows, image_len)` f32.
fn mean_heads(weights: Option<Tensor>) -> Result<Option<Tensor>> {
    Ok(match weights {
        Some(w) => Some(w.to_dtype(candle_core::DType::F32)?.mean(1)?),
        None => None,
    })
}

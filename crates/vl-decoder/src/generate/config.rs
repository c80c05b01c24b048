//! Generation settings: how many tokens, which ones end a caption, and how
//! the next token is chosen.

use crate::config::DecoderConfig;
use crate::error::{arg_err, Result};

/// Below this temperature, sampling is greedy decoding: dividing logits by a
/// smaller number overflows f32. The same cut-off as candle's
/// `LogitsProcessor::new`.
pub const MIN_SAMPLING_TEMPERATURE: f64 = 1e-7;

/// When beam search may stop before `max_new_tokens`, as transformers'
/// `early_stopping` (`True`, `False`, `"never"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EarlyStopping {
    /// Stop an image as soon as it has `num_beams` finished hypotheses.
    True,
    /// Stop when the best running beam, scored at its current length, can no
    /// longer beat the worst finished hypothesis (transformers' default).
    #[default]
    False,
    /// Stop only when no running beam can beat the worst finished hypothesis
    /// even at the longest allowed length (when `length_penalty > 0`): the
    /// canonical beam search with `length_penalty = 0`.
    Never,
}

/// How the next token is chosen.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Strategy {
    /// The most likely token (ties: the lowest id, as `torch.argmax`).
    Greedy,
    /// A token drawn from the softmax of `logits / temperature`, cut to the
    /// `top_k` most likely tokens, then to the smallest set whose
    /// probability (renormalised over the `top_k`) reaches `top_p`.
    Sample {
        /// Softmax temperature, `>= 0`; below [`MIN_SAMPLING_TEMPERATURE`]
        /// (in particular 0) this is greedy decoding.
        temperature: f64,
        /// Keep only the `top_k` most likely tokens (ties at the k-th logit
        /// are kept, as transformers' `TopKLogitsWarper`).
        top_k: Option<usize>,
        /// Nucleus sampling threshold in `(0, 1]`.
        top_p: Option<f64>,
        /// Seed of the random draws. Row `r` (image `r`) draws from its own
        /// stream, seeded from `(seed, r)`: the same seed gives the same
        /// tokens, and a row's tokens do not depend on the other rows.
        seed: u64,
    },
    /// Beam search, as transformers' `generate(num_beams=..)`.
    Beam {
        /// Beams per image, `>= 1`.
        num_beams: usize,
        /// Finished hypotheses are scored `sum_logprobs / len^length_penalty`
        /// (`len` = generated tokens, EOS included). 1.0 in transformers.
        length_penalty: f32,
        /// When an image's search may stop early.
        early_stopping: EarlyStopping,
    },
}

impl Strategy {
    /// Beam search with transformers' defaults: `length_penalty = 1.0`,
    /// `early_stopping = False`.
    pub fn beam(num_beams: usize) -> Self {
        Self::Beam {
            num_beams,
            length_penalty: 1.0,
            early_stopping: EarlyStopping::False,
        }
    }
}

/// Everything [`generate`](super::generate) needs besides the model and the
/// images. Serialised (a vl model directory's `generation`) without
/// [`GenerationConfig::cross_attention_of`], which is a per-call choice.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GenerationConfig {
    /// Most tokens generated per image, EOS included; `>= 1`.
    pub max_new_tokens: usize,
    /// No EOS id may be chosen before this many tokens
    /// (transformers' `min_new_tokens`).
    pub min_new_tokens: usize,
    /// The token fed first (`bos_token_id` / `decoder_start_token_id`); not
    /// part of the output.
    pub start_token_id: u32,
    /// Tokens that end a caption; empty: captions end at `max_new_tokens`.
    pub eos_token_ids: Vec<u32>,
    /// The token fed to rows whose caption has ended.
    pub pad_token_id: u32,
    /// transformers' `repetition_penalty`: every token already in the
    /// sequence (start token included, as transformers' `input_ids` holds
    /// it) has its score divided by this when positive, multiplied when
    /// not. 1.0 = off; must be positive.
    pub repetition_penalty: f32,
    /// transformers' `no_repeat_ngram_size`: no n-gram of this size occurs
    /// twice in a row's sequence (start token included, as transformers'
    /// `input_ids` holds it). 0 = off.
    pub no_repeat_ngram_size: usize,
    /// How the next token is chosen.
    pub strategy: Strategy,
    /// transformers' `forced_bos_token_id`: the first generated token is
    /// this one (every other score `-inf`, its own 0). `None` = off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forced_bos_token_id: Option<u32>,
    /// transformers' `forced_eos_token_id`: the last token
    /// `max_new_tokens` allows is this one (every other score `-inf`, its
    /// own 0). `None` = off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forced_eos_token_id: Option<u32>,
    /// transformers' `bad_words_ids`: token sequences never generated. A
    /// one-token sequence's token always scores `-inf`; a longer one's
    /// last token does where the sequence so far ends with the others.
    /// Sequences that are a lone end token are ignored, as transformers
    /// does. Empty = off.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bad_words_ids: Vec<Vec<u32>>,
    /// Also return, per generated token, block `i`'s cross-attention
    /// weights (heads averaged) of the position that chose it, in
    /// [`Generated::cross_attention`](super::Generated::cross_attention) —
    /// the heatmaps of a caption, from the pass that made it (transformers'
    /// `output_attentions` for cross-attention). `None`: nothing recorded.
    #[serde(skip)]
    pub cross_attention_of: Option<usize>,
}

impl GenerationConfig {
    /// Greedy decoding of up to `max_new_tokens` tokens with the model's
    /// start, end and padding tokens.
    pub fn greedy(cfg: &DecoderConfig, max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            min_new_tokens: 0,
            start_token_id: cfg.bos_token_id,
            eos_token_ids: vec![cfg.eos_token_id],
            pad_token_id: cfg.pad_token_id,
            repetition_penalty: 1.0,
            no_repeat_ngram_size: 0,
            strategy: Strategy::Greedy,
            forced_bos_token_id: None,
            forced_eos_token_id: None,
            bad_words_ids: Vec::new(),
            cross_attention_of: None,
        }
    }

    /// This configuration with another strategy.
    pub fn with_strategy(self, strategy: Strategy) -> Self {
        Self { strategy, ..self }
    }

    /// Rejects impossible settings, naming the field: `max_new_tokens` 0,
    /// `min_new_tokens > max_new_tokens`, a non-positive
    /// `repetition_penalty`, a negative or NaN `temperature`, `top_k` 0,
    /// `top_p` outside `(0, 1]`, `num_beams` 0, a non-finite
    /// `length_penalty`. Token ids are checked against the model's
    /// vocabulary by [`generate`](super::generate).
    pub fn validate(&self) -> Result<()> {
        if self.max_new_tokens == 0 {
            return arg_err("max_new_tokens", "must be positive, got 0");
        }
        if let Some(i) = self.bad_words_ids.iter().position(Vec::is_empty) {
            return arg_err(
                "bad_words_ids",
                format!("sequence {i} is empty; each bans one or more tokens"),
            );
        }
        if self.min_new_tokens > self.max_new_tokens {
            return arg_err(
                "min_new_tokens",
                format!(
                    "{} is above max_new_tokens {}",
                    self.min_new_tokens, self.max_new_tokens
                ),
            );
        }
        let p = self.repetition_penalty;
        if !(p > 0.0 && p.is_finite()) {
            return arg_err(
                "repetition_penalty",
                format!("must be positive and finite, got {p}"),
            );
        }
        match &self.strategy {
            Strategy::Greedy => Ok(()),
            Strategy::Sample {
                temperature,
                top_k,
                top_p,
                ..
            } => {
                if !(*temperature >= 0.0 && temperature.is_finite()) {
                    return arg_err(
                        "temperature",
                        format!("must be finite and >= 0, got {temperature}"),
                    );
                }
                if *top_k == Some(0) {
                    return arg_err("top_k", "must be positive, got 0");
                }
                match top_p {
                    Some(p) if !(*p > 0.0 && *p <= 1.0) => {
                        arg_err("top_p", format!("must be in (0, 1], got {p}"))
                    }
                    _ => Ok(()),
                }
            }
            Strategy::Beam {
                num_beams,
                length_penalty,
                ..
            } => {
                if *num_beams == 0 {
                    return arg_err("num_beams", "must be positive, got 0");
                }
                if !length_penalty.is_finite() {
                    return arg_err(
                        "length_penalty",
                        format!("must be finite, got {length_penalty}"),
                    );
                }
                Ok(())
            }
        }
    }

    /// Checks the token ids against a vocabulary of `vocab` tokens.
    pub fn check_ids(&self, vocab: usize) -> Result<()> {
        let ids = [
            ("start_token_id", self.start_token_id),
            ("pad_token_id", self.pad_token_id),
        ]
        .into_iter()
        .chain(self.eos_token_ids.iter().map(|&id| ("eos_token_ids", id)))
        .chain(
            self.forced_bos_token_id
                .map(|id| ("forced_bos_token_id", id)),
        )
        .chain(
            self.forced_eos_token_id
                .map(|id| ("forced_eos_token_id", id)),
        )
        .chain(
            self.bad_words_ids
                .iter()
                .flatten()
                .map(|&id| ("bad_words_ids", id)),
        );
        for (field, id) in ids {
            if id as usize >= vocab {
                return arg_err(
                    field,
                    format!("{id} is not below the vocabulary size {vocab}"),
                );
            }
        }
        Ok(())
    }

    /// Whether `token` ends a caption.
    pub(crate) fn is_eos(&self, token: u32) -> bool {
        self.eos_token_ids.contains(&token)
    }
}

//! Typed run settings shared by every front end: the device and dtype to
//! load on, parsed from their usual spellings (`cpu`, `cuda:1`, `bf16`),
//! and generation overrides applied over a checkpoint's defaults.

use candle_core::{DType, Device};
use vl_decoder::{DecoderConfig, DecoderError, GenerationConfig, Strategy};

use crate::error::{arg_err, Result};

/// Parses `cpu`, `cuda`, `cuda:N` or `metal` (`metal:N`).
pub fn parse_device(name: &str) -> Result<Device> {
    let (kind, ordinal) = match name.split_once(':') {
        Some((k, n)) => match n.parse::<usize>() {
            Ok(n) => (k, n),
            Err(_) => {
                return arg_err(
                    "device",
                    format!("`{name}`: the ordinal `{n}` is not a number"),
                )
            }
        },
        None => (name, 0),
    };
    match kind {
        "cpu" => Ok(Device::Cpu),
        "cuda" if cfg!(feature = "cuda") => Ok(Device::new_cuda(ordinal)?),
        "cuda" => arg_err(
            "device",
            format!("`{name}`: this build has no CUDA support (build with --features cuda)"),
        ),
        "metal" if cfg!(feature = "metal") => Ok(Device::new_metal(ordinal)?),
        "metal" => arg_err(
            "device",
            format!("`{name}`: this build has no Metal support (build with --features metal)"),
        ),
        _ => arg_err(
            "device",
            format!("`{name}` is not one of cpu, cuda[:N], metal[:N]"),
        ),
    }
}

/// Parses `f32`, `f16` or `bf16`.
pub fn parse_dtype(name: &str) -> Result<DType> {
    match name {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        _ => arg_err("dtype", format!("`{name}` is not one of f32, f16, bf16")),
    }
}

/// Parses a cache format — of the text cache or of the image's keys and
/// values (`--text-cache`, `--image-cache`; Python's `text_cache=`,
/// `image_cache=`): `f32`, `f16`, `bf16`, or `q8` (q8 rows, kept as u8;
/// see `vl_attn::quantize_kv`).
pub fn parse_cache_format(name: &str) -> Result<DType> {
    match name {
        "q8" => Ok(DType::U8),
        other => parse_dtype(other).or_else(|_| {
            arg_err(
                "cache",
                format!("`{name}` is not one of f32, f16, bf16 (or q8)"),
            )
        }),
    }
}

/// A cache format's spelling ([`parse_cache_format`]'s inverse): `q8`
/// for q8 rows, else the dtype's.
pub fn cache_format_name(dtype: DType) -> &'static str {
    match dtype {
        DType::U8 => "q8",
        other => other.as_str(),
    }
}

/// A generation setting that a front end can override, with its command
/// line spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// `max_new_tokens`, `--max-tokens`.
    MaxTokens,
    /// `min_new_tokens`, `--min-tokens`.
    MinTokens,
    /// `num_beams`, `--beams`.
    Beams,
    /// `length_penalty`, `--length-penalty`.
    LengthPenalty,
    /// `temperature`, `--temperature`.
    Temperature,
    /// `top_k`, `--top-k`.
    TopK,
    /// `top_p`, `--top-p`.
    TopP,
    /// `repetition_penalty`, `--repetition-penalty`.
    RepetitionPenalty,
    /// `no_repeat_ngram_size`, `--no-repeat-ngram-size`.
    NoRepeatNgramSize,
}

impl Setting {
    const ALL: [Setting; 9] = [
        Self::MaxTokens,
        Self::MinTokens,
        Self::Beams,
        Self::LengthPenalty,
        Self::Temperature,
        Self::TopK,
        Self::TopP,
        Self::RepetitionPenalty,
        Self::NoRepeatNgramSize,
    ];

    /// The field of [`GenerationConfig`] (or its [`Strategy`]) it sets.
    pub fn field(self) -> &'static str {
        match self {
            Self::MaxTokens => "max_new_tokens",
            Self::MinTokens => "min_new_tokens",
            Self::Beams => "num_beams",
            Self::LengthPenalty => "length_penalty",
            Self::Temperature => "temperature",
            Self::TopK => "top_k",
            Self::TopP => "top_p",
            Self::RepetitionPenalty => "repetition_penalty",
            Self::NoRepeatNgramSize => "no_repeat_ngram_size",
        }
    }

    /// Its command line flag.
    pub fn flag(self) -> &'static str {
        match self {
            Self::MaxTokens => "--max-tokens",
            Self::MinTokens => "--min-tokens",
            Self::Beams => "--beams",
            Self::LengthPenalty => "--length-penalty",
            Self::Temperature => "--temperature",
            Self::TopK => "--top-k",
            Self::TopP => "--top-p",
            Self::RepetitionPenalty => "--repetition-penalty",
            Self::NoRepeatNgramSize => "--no-repeat-ngram-size",
        }
    }

    /// The setting of a [`GenerationConfig`] field, as
    /// [`DecoderError::Argument`] names it.
    pub fn of_field(field: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.field() == field)
    }
}

/// An override that cannot be applied.
#[derive(Debug, thiserror::Error)]
pub enum OverrideError {
    /// A setting's value is wrong: the setting, the value given (when it
    /// alone is wrong) and why.
    #[error("{}{}: {reason}", setting.flag(), value.as_ref().map(|v| format!(" {v}")).unwrap_or_default())]
    Setting {
        /// The setting.
        setting: Setting,
        /// The value given, when it alone is wrong.
        value: Option<String>,
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint's own defaults, which no override touched, are
    /// impossible.
    #[error("the checkpoint's generation defaults: {0}")]
    Defaults(DecoderError),
}

impl OverrideError {
    /// The setting at fault, if one is.
    pub fn setting(&self) -> Option<Setting> {
        match self {
            Self::Setting { setting, .. } => Some(*setting),
            Self::Defaults(_) => None,
        }
    }
}

fn bad<T>(
    setting: Setting,
    value: impl ToString,
    reason: impl Into<String>,
) -> std::result::Result<T, OverrideError> {
    Err(OverrideError::Setting {
        setting,
        value: Some(value.to_string()),
        reason: reason.into(),
    })
}

/// Generation settings given by a user (command line flags, a script) to
/// apply over a checkpoint's defaults; `None` keeps the checkpoint's value.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationOverrides {
    /// Most tokens generated per image.
    pub max_tokens: Option<usize>,
    /// No end token before this many tokens.
    pub min_tokens: Option<usize>,
    /// Beam search with this many beams; 1 = none.
    pub beams: Option<usize>,
    /// Beam scores are `sum_logprobs / len^p`.
    pub length_penalty: Option<f32>,
    /// Sampling temperature; 0 = greedy.
    pub temperature: Option<f64>,
    /// Sample from the k most likely tokens.
    pub top_k: Option<usize>,
    /// Nucleus sampling threshold in (0, 1].
    pub top_p: Option<f64>,
    /// Penalise tokens already generated; 1 = off.
    pub repetition_penalty: Option<f32>,
    /// Never repeat an n-gram of this size; 0 = off.
    pub no_repeat_ngram_size: Option<usize>,
    /// Seed of sampling.
    pub seed: u64,
}

impl GenerationOverrides {
    /// `base` (a checkpoint's defaults) with the overrides applied, for a
    /// decoder of `decoder` (whose positions bound the tokens), validated.
    ///
    /// Sampling is chosen by a non-zero temperature, `top_k` or `top_p`;
    /// a temperature of 0 alone means greedy; beams keep the checkpoint's
    /// length penalty and early stopping unless overridden.
    ///
    /// # Errors
    /// [`OverrideError`] naming the setting: a value out of range, beams
    /// combined with sampling, more tokens than the positions allow.
    pub fn apply(
        &self,
        base: &GenerationConfig,
        decoder: &DecoderConfig,
    ) -> std::result::Result<GenerationConfig, OverrideError> {
        let room = decoder.max_position_embeddings.saturating_sub(1);
        let max_tokens = match self.max_tokens {
            Some(n) if n > room => {
                return bad(
                    Setting::MaxTokens,
                    n,
                    format!(
                        "the model reads at most {} positions, so at most {room} new tokens",
                        decoder.max_position_embeddings
                    ),
                )
            }
            Some(n) => n,
            None => base.max_new_tokens.min(room),
        };
        if let Some(t) = self.temperature.filter(|t| *t < 0.0 || !t.is_finite()) {
            return bad(Setting::Temperature, t, "must be a finite number >= 0");
        }
        let sampling = self.temperature.is_some_and(|t| t != 0.0)
            || self.top_k.is_some()
            || self.top_p.is_some();
        let strategy = match (self.beams, sampling) {
            (Some(0), _) => return bad(Setting::Beams, 0, "must be at least 1"),
            (Some(b), true) if b > 1 => {
                return bad(
                    Setting::Beams,
                    b,
                    "cannot be combined with sampling (--temperature/--top-k/--top-p)",
                )
            }
            (_, true) => {
                let (t, k, p) = match &base.strategy {
                    Strategy::Sample {
                        temperature,
                        top_k,
                        top_p,
                        ..
                    } => (*temperature, *top_k, *top_p),
                    _ => (1.0, None, None),
                };
                Strategy::Sample {
                    temperature: self.temperature.unwrap_or(t),
                    top_k: self.top_k.or(k),
                    top_p: self.top_p.or(p),
                    seed: self.seed,
                }
            }
            (None, false) if self.temperature == Some(0.0) => Strategy::Greedy,
            (Some(1), false) => Strategy::Greedy,
            (Some(b), false) => match &base.strategy {
                Strategy::Beam {
                    length_penalty,
                    early_stopping,
                    ..
                } => Strategy::Beam {
                    num_beams: b,
                    length_penalty: *length_penalty,
                    early_stopping: *early_stopping,
                },
                _ => Strategy::beam(b),
            },
            (None, false) => match &base.strategy {
                Strategy::Sample {
                    temperature,
                    top_k,
                    top_p,
                    ..
                } => Strategy::Sample {
                    temperature: *temperature,
                    top_k: *top_k,
                    top_p: *top_p,
                    seed: self.seed,
                },
                other => other.clone(),
            },
        };
        let strategy = match (strategy, self.length_penalty) {
            (
                Strategy::Beam {
                    num_beams,
                    early_stopping,
                    ..
                },
                Some(lp),
            ) => Strategy::Beam {
                num_beams,
                length_penalty: lp,
                early_stopping,
            },
            (s, _) => s,
        };
        let cfg = GenerationConfig {
            max_new_tokens: max_tokens,
            min_new_tokens: self
                .min_tokens
                .unwrap_or(base.min_new_tokens.min(max_tokens)),
            repetition_penalty: self.repetition_penalty.unwrap_or(base.repetition_penalty),
            no_repeat_ngram_size: self
                .no_repeat_ngram_size
                .unwrap_or(base.no_repeat_ngram_size),
            ..base.clone()
        }
        .with_strategy(strategy);
        if cfg.min_new_tokens > cfg.max_new_tokens {
            return Err(OverrideError::Setting {
                setting: Setting::MinTokens,
                value: None,
                reason: format!(
                    "{} is above {} {}",
                    cfg.min_new_tokens,
                    Setting::MaxTokens.flag(),
                    cfg.max_new_tokens
                ),
            });
        }
        match cfg.validate() {
            Ok(()) => Ok(cfg),
            Err(DecoderError::Argument { arg, reason }) => match Setting::of_field(arg) {
                Some(setting) => Err(OverrideError::Setting {
                    setting,
                    value: None,
                    reason,
                }),
                None => Err(OverrideError::Defaults(DecoderError::Argument {
                    arg,
                    reason,
                })),
            },
            Err(other) => Err(OverrideError::Defaults(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoder() -> DecoderConfig {
        DecoderConfig::tiny(50, 8) // 64 positions
    }

    fn base() -> GenerationConfig {
        GenerationConfig {
            strategy: Strategy::Beam {
                num_beams: 3,
                length_penalty: 0.5,
                early_stopping: vl_decoder::EarlyStopping::Never,
            },
            ..GenerationConfig::greedy(&decoder(), 20)
        }
    }

    #[test]
    fn nothing_given_keeps_the_checkpoint_defaults() {
        let got = GenerationOverrides::default()
            .apply(&base(), &decoder())
            .expect("apply");
        assert_eq!(got, base());
    }

    #[test]
    fn beams_keep_the_checkpoint_penalty_unless_given() {
        let o = GenerationOverrides {
            beams: Some(5),
            ..Default::default()
        };
        let got = o.apply(&base(), &decoder()).expect("apply");
        assert!(matches!(
            got.strategy,
            Strategy::Beam {
                num_beams: 5,
                length_penalty,
                ..
            } if length_penalty == 0.5
        ));
        let o = GenerationOverrides {
            length_penalty: Some(2.0),
            ..o
        };
        let got = o.apply(&base(), &decoder()).expect("apply");
        assert!(
            matches!(got.strategy, Strategy::Beam { length_penalty, .. } if length_penalty == 2.0)
        );
    }

    #[test]
    fn temperature_zero_is_greedy_and_sampling_takes_the_seed() {
        let o = GenerationOverrides {
            temperature: Some(0.0),
            ..Default::default()
        };
        assert_eq!(
            o.apply(&base(), &decoder()).expect("apply").strategy,
            Strategy::Greedy
        );
        let o = GenerationOverrides {
            top_k: Some(4),
            seed: 9,
            ..Default::default()
        };
        assert_eq!(
            o.apply(&base(), &decoder()).expect("apply").strategy,
            Strategy::Sample {
                temperature: 1.0,
                top_k: Some(4),
                top_p: None,
                seed: 9
            }
        );
    }

    #[test]
    fn bad_overrides_name_the_setting_typed() {
        let cases: [(GenerationOverrides, Setting, &str); 7] = [
            (
                GenerationOverrides {
                    beams: Some(0),
                    ..Default::default()
                },
                Setting::Beams,
                "--beams 0: must be at least 1",
            ),
            (
                GenerationOverrides {
                    beams: Some(2),
                    temperature: Some(0.7),
                    ..Default::default()
                },
                Setting::Beams,
                "cannot be combined with sampling",
            ),
            (
                GenerationOverrides {
                    temperature: Some(-1.0),
                    ..Default::default()
                },
                Setting::Temperature,
                "--temperature -1: must be a finite number >= 0",
            ),
            (
                GenerationOverrides {
                    max_tokens: Some(64),
                    ..Default::default()
                },
                Setting::MaxTokens,
                "at most 63 new tokens",
            ),
            (
                GenerationOverrides {
                    top_p: Some(1.5),
                    ..Default::default()
                },
                Setting::TopP,
                "--top-p: must be in (0, 1], got 1.5",
            ),
            (
                GenerationOverrides {
                    top_k: Some(0),
                    ..Default::default()
                },
                Setting::TopK,
                "--top-k: must be positive",
            ),
            (
                GenerationOverrides {
                    min_tokens: Some(10),
                    max_tokens: Some(5),
                    ..Default::default()
                },
                Setting::MinTokens,
                "--min-tokens: 10 is above --max-tokens 5",
            ),
        ];
        for (o, setting, says) in cases {
            let err = o.apply(&base(), &decoder()).unwrap_err();
            assert_eq!(err.setting(), Some(setting), "{err}");
            assert!(err.to_string().contains(says), "{err}");
        }
    }

    #[test]
    fn every_setting_maps_back_from_its_field() {
        for s in Setting::ALL {
            assert_eq!(Setting::of_field(s.field()), Some(s));
        }
        assert_eq!(Setting::of_field("eos_token_ids"), None);
    }

    #[test]
    fn devices_and_dtypes_name_the_flag_value() {
        assert!(parse_device("cpu").is_ok());
        assert_eq!(parse_dtype("bf16").ok(), Some(DType::BF16));
        let err = parse_device("cpu:x").unwrap_err().to_string();
        assert!(err.contains("`x` is not a number"), "{err}");
    }

    #[test]
    fn cache_formats_spell_back() {
        for name in ["f32", "f16", "bf16", "q8"] {
            let d = parse_cache_format(name).expect(name);
            assert_eq!(cache_format_name(d), name);
        }
        assert_eq!(parse_cache_format("q8").ok(), Some(DType::U8));
        let err = parse_cache_format("q4").unwrap_err().to_string();
        assert!(
            err.contains("`q4` is not one of f32, f16, bf16 (or q8)"),
            "{err}"
        );
    }
}

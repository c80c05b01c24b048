//! The Swin encoder family (`encoder.model_type` `donut-swin`,
//! transformers' `DonutSwinModel`: Donut's and Nougat's image encoder) onto
//! vl's [`Swin`]. The config's fields are vl's [`SwinConfig`]'s; the
//! preprocessing comes from `preprocessor_config.json` (Donut's or Nougat's
//! processor, [`super::config::HfPreprocessorConfig::swin_pixels`]).
//! Dropouts and stochastic depth act only in training: read and ignored.

use candle_nn::VarBuilder;
use serde::Deserialize;
use vl_vision::{Swin, SwinConfig};

use super::config::HfConfig;
use crate::error::{check_dropouts, Result};

/// The encoder `model_type`s read by this family.
pub const ENCODERS: &[&str] = &["donut-swin"];

/// `config.json`'s `encoder`: a transformers `DonutSwinConfig`.
#[derive(Debug, Clone, Deserialize)]
pub struct HfSwinConfig {
    /// `donut-swin`.
    pub model_type: String,
    /// The sizes, as vl's Swin reads them.
    #[serde(flatten)]
    pub swin: SwinConfig,
    /// Dropout on the residual branches, in training (default 0).
    #[serde(default)]
    pub hidden_dropout_prob: f64,
    /// Dropout on the attention probabilities, in training (default 0).
    #[serde(default)]
    pub attention_probs_dropout_prob: f64,
    /// Stochastic depth, in training (default 0.1).
    #[serde(default)]
    pub drop_path_rate: f64,
}

impl HfSwinConfig {
    /// Rejects what vl cannot run, naming the field.
    pub fn validate(&self) -> Result<()> {
        check_dropouts(&[
            ("encoder.hidden_dropout_prob", self.hidden_dropout_prob),
            (
                "encoder.attention_probs_dropout_prob",
                self.attention_probs_dropout_prob,
            ),
            ("encoder.drop_path_rate", self.drop_path_rate),
        ])?;
        Ok(self.swin.validate()?)
    }
}

/// The Swin under `encoder.` (and `enc_to_dec_proj.` when the widths
/// differ), as `swin_cfg` (the checkpoint's, with its preprocessing).
pub fn load(vb: VarBuilder, _cfg: &HfConfig, swin_cfg: &SwinConfig) -> Result<Swin> {
    Ok(Swin::load_split(
        vb.pp("encoder"),
        vb.pp("enc_to_dec_proj"),
        swin_cfg,
    )?)
}

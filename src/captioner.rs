//! Captioning images with a model directory: load, preprocess, encode once,
//! generate, decode text.

use std::path::Path;

use anyhow::{anyhow, Context};
use candle_core::{DType, Device, Tensor};
use image::DynamicImage;
use vl_decoder::{generate_from, GenerationConfig, Quantization, TokenEvent};
use vl_vision::preprocess::preprocess;
use vl_vision::VisionConfig;

use crate::checkpoint::VlModel;

/// One image's caption.
#[derive(Debug, Clone, PartialEq)]
pub struct Caption {
    /// The caption's text (special tokens dropped): with a prompt, the
    /// prompt and its continuation, as transformers decodes BLIP's output.
    pub text: String,
    /// The ids generated after the start token (and the prompt), the EOS
    /// included if one was generated.
    pub token_ids: Vec<u32>,
    /// With [`GenerationConfig::cross_attention_of`] set (see
    /// [`Captioner::with_heatmaps`]): per token, the cross-attention weights
    /// (heads averaged) over the image's patch tokens (the class token
    /// dropped) of the position that chose it, recorded while captioning.
    /// Empty otherwise.
    ///
    /// # Shapes
    /// `token_ids.len()` rows of `patches` weights.
    pub heatmaps: Vec<Vec<f32>>,
}

/// A loaded captioning model.
#[derive(Debug)]
pub struct Captioner {
    /// The model directory's contents.
    pub model: VlModel,
}

impl Captioner {
    /// Captions with a loaded model.
    pub fn new(model: VlModel) -> Self {
        Self { model }
    }

    /// Loads a vl model directory.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> anyhow::Result<Self> {
        Ok(Self {
            model: VlModel::load(dir, dtype, device)?,
        })
    }

    /// Quantizes the decoder's and the ViT's linear layers (and the LM
    /// head) to `q` (see [`VlModel::quantize`]). `Quantization::None`
    /// changes nothing.
    pub fn quantize(&mut self, q: Quantization) -> anyhow::Result<()> {
        Ok(self.model.quantize(q)?)
    }

    /// Greedy decoding with the model's special tokens, up to `max_new_tokens`.
    pub fn greedy_config(&self, max_new_tokens: usize) -> GenerationConfig {
        GenerationConfig::greedy(&self.model.config.decoder, max_new_tokens)
    }

    /// Captions a batch of images, streaming each token to `on_token`.
    pub fn caption(
        &self,
        images: &[&DynamicImage],
        cfg: &GenerationConfig,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> anyhow::Result<Vec<Caption>> {
        let pixels = images
            .iter()
            .map(|img| self.pixels(img))
            .collect::<anyhow::Result<Vec<_>>>()?;
        self.caption_pixels(&pixels, cfg, on_token)
    }

    /// One image as the encoder's input, so that a batch can be assembled
    /// from the images that preprocess without error.
    ///
    /// # Shapes
    /// Returns `(3, image_size, image_size)` f32.
    pub fn pixels(&self, image: &DynamicImage) -> anyhow::Result<Tensor> {
        let spec = self.model.pixel_spec()?;
        Ok(preprocess(image, spec, self.model.decoder.device())?)
    }

    /// Captions preprocessed images (from [`Captioner::pixels`]).
    pub fn caption_pixels(
        &self,
        pixels: &[Tensor],
        cfg: &GenerationConfig,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> anyhow::Result<Vec<Caption>> {
        self.caption_pixels_from(pixels, cfg, None, on_token)
    }

    /// Captions preprocessed images continuing `prompt` (see
    /// [`VlModel::prompt_ids`]: BLIP checkpoints only); `None` is
    /// [`Captioner::caption_pixels`].
    ///
    /// # Errors
    /// As [`VlModel::prompt_ids`], naming `prompt`; generation errors.
    pub fn caption_pixels_from(
        &self,
        pixels: &[Tensor],
        cfg: &GenerationConfig,
        prompt: Option<&str>,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> anyhow::Result<Vec<Caption>> {
        let prompt_ids = match prompt {
            Some(p) => self.model.prompt_ids(p)?,
            None => Vec::new(),
        };
        let memory = self.model.encode_pixels(&Tensor::stack(pixels, 0)?)?;
        let ctx = self.model.decoder.image_context(&memory, None)?;
        let generated = generate_from(&self.model.decoder, &ctx, cfg, &prompt_ids, on_token)?;
        // Image tokens before the patches: CLS (and DeiT's distillation token).
        let prefix = self
            .model
            .config
            .vision
            .as_ref()
            .map_or(1, VisionConfig::num_prefix_tokens);
        generated
            .into_iter()
            .map(|g| {
                // The prompt's words, then the caption (the start token is
                // special, skipped either way).
                let all: Vec<u32> = prompt_ids.iter().chain(&g.tokens).copied().collect();
                let text = self
                    .model
                    .tokenizer
                    .decode(&all, true)
                    .map_err(|e| anyhow!("decode {all:?}: {e}"))
                    .context("tokenizer")?;
                Ok(Caption {
                    text,
                    token_ids: g.tokens,
                    heatmaps: g
                        .cross_attention
                        .into_iter()
                        .map(|w| w.get(prefix..).map(<[f32]>::to_vec).unwrap_or_default())
                        .collect(),
                })
            })
            .collect()
    }
}

impl Captioner {
    /// The block whose cross-attention the heatmaps show: the last one that
    /// has cross-attention.
    pub fn heatmap_layer(&self) -> Option<usize> {
        self.model
            .decoder
            .blocks()
            .iter()
            .rposition(|b| b.has_cross_attention())
    }

    /// `cfg` recording the heatmaps of [`Captioner::heatmap_layer`] into
    /// each [`Caption::heatmaps`], from the captioning pass itself (no
    /// second encode or replay).
    ///
    /// # Errors
    /// When the model has no cross-attention.
    pub fn with_heatmaps(&self, cfg: &GenerationConfig) -> anyhow::Result<GenerationConfig> {
        let layer = self
            .heatmap_layer()
            .context("the model has no cross-attention")?;
        Ok(GenerationConfig {
            cross_attention_of: Some(layer),
            ..cfg.clone()
        })
    }
}

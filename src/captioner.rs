//! Captioning images with a model directory: load, preprocess, encode once,
//! generate, decode text.

use std::path::Path;

use anyhow::{anyhow, Context};
use candle_core::{DType, Device, Tensor, D};
use image::DynamicImage;
use vl_decoder::{generate, GenerationConfig, Quantization, TokenEvent};
use vl_vision::preprocess::preprocess;

use crate::checkpoint::VlModel;

/// One image's caption.
#[derive(Debug, Clone, PartialEq)]
pub struct Caption {
    /// The caption's text (special tokens dropped).
    pub text: String,
    /// The ids generated after the start token, the EOS included if one was
    /// generated.
    pub token_ids: Vec<u32>,
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

    /// Quantizes the decoder's linear layers (and LM head) to `q`; the
    /// vision encoder stays as loaded. `Quantization::None` changes nothing.
    pub fn quantize(&mut self, q: Quantization) -> anyhow::Result<()> {
        if let Some(format) = q.ggml_dtype() {
            self.model.decoder = self.model.decoder.quantize(format)?;
        }
        Ok(())
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
        let memory = self.model.encode_pixels(&Tensor::stack(pixels, 0)?)?;
        let ctx = self.model.decoder.image_context(&memory, None)?;
        let generated = generate(&self.model.decoder, &ctx, cfg, on_token)?;
        generated
            .into_iter()
            .map(|g| {
                let text = self
                    .model
                    .tokenizer
                    .decode(&g.tokens, true)
                    .map_err(|e| anyhow!("decode {:?}: {e}", g.tokens))
                    .context("tokenizer")?;
                Ok(Caption {
                    text,
                    token_ids: g.tokens,
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

    /// Per generated token, the cross-attention weights (heads averaged) of
    /// the position that chose it, over the image's patch tokens (the CLS
    /// token dropped), in [`Captioner::heatmap_layer`]. Computed by
    /// replaying the caption through a fresh decode state.
    ///
    /// # Shapes
    /// Returns `token_ids.len()` rows of `image_tokens - 1` weights.
    pub fn attention_maps(
        &self,
        image: &DynamicImage,
        token_ids: &[u32],
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let layer = self
            .heatmap_layer()
            .context("the model has no cross-attention")?;
        if token_ids.is_empty() {
            return Ok(Vec::new());
        }
        let dec = &self.model.decoder;
        let memory = self.model.encode_images(&[image])?;
        let ctx = dec.image_context(&memory, None)?;
        let mut state = dec.start(&ctx, 1)?;
        let mut input = vec![self.model.config.decoder.bos_token_id];
        input.extend_from_slice(&token_ids[..token_ids.len() - 1]);
        let n = input.len();
        let tokens = Tensor::from_vec(input, (1, n), dec.device())?;
        let (_, weights) = dec.step_hidden(&mut state, &tokens, Some(layer))?;
        let weights = weights.context("no cross-attention weights")?; // (1, h, n, image_len)
        let image_len = weights.dim(D::Minus1)?;
        let mean = weights.mean(1)?.squeeze(0)?.narrow(1, 1, image_len - 1)?; // (n, patches)
        Ok(mean.to_dtype(DType::F32)?.to_vec2::<f32>()?)
    }
}

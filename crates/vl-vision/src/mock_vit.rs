//! A mock vision encoder: deterministic image tokens from pixels, with no
//! training — patchify, a fixed random projection, a CLS token, positions.
//! It stands in for a real ViT wherever only the shapes and the data flow
//! matter.

use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use serde::{Deserialize, Serialize};

use crate::error::{arg_err, config_err, Result};
use crate::preprocess::MAX_IMAGE_SIDE;

/// The most values a mock ViT generates (projection, CLS token and
/// positions together): 64 Mi, 256 MiB in f32. The mock stands in for small
/// encoders; a config asking for more is refused before anything is
/// allocated.
pub const MAX_MOCK_VIT_VALUES: usize = 1 << 26;

/// The mock ViT's sizes and seed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MockVitConfig {
    /// Input height and width, in pixels.
    pub image_size: usize,
    /// Patch height and width; divides `image_size`.
    pub patch_size: usize,
    /// Input channels.
    pub num_channels: usize,
    /// Width of the output tokens.
    pub hidden_size: usize,
    /// Seed of the fixed projection, CLS token and positions.
    pub seed: u64,
}

impl MockVitConfig {
    /// 224×224 RGB with 16×16 patches: 196 patches + CLS = 197 tokens.
    pub fn base(hidden_size: usize, seed: u64) -> Self {
        Self {
            image_size: 224,
            patch_size: 16,
            num_channels: 3,
            hidden_size,
            seed,
        }
    }

    /// Patches per image.
    pub fn num_patches(&self) -> usize {
        (self.image_size / self.patch_size).pow(2)
    }

    /// Rejects impossible sizes.
    pub fn validate(&self) -> Result<()> {
        if self.patch_size == 0
            || self.image_size == 0
            || !self.image_size.is_multiple_of(self.patch_size)
        {
            return config_err(
                "patch_size",
                format!(
                    "{} must divide image_size {}",
                    self.patch_size, self.image_size
                ),
            );
        }
        if self.num_channels == 0 || self.hidden_size == 0 {
            return config_err(
                "hidden_size",
                "num_channels and hidden_size must be positive",
            );
        }
        if self.image_size > MAX_IMAGE_SIDE as usize {
            return config_err(
                "image_size",
                format!(
                    "{} is larger than the largest image side accepted, {MAX_IMAGE_SIDE}",
                    self.image_size
                ),
            );
        }
        match self.num_values() {
            Some(n) if n <= MAX_MOCK_VIT_VALUES => Ok(()),
            _ => config_err(
                "hidden_size",
                format!(
                    "image_size {}, patch_size {}, num_channels {} and hidden_size {} need more \
                     than the {MAX_MOCK_VIT_VALUES} values a mock ViT may generate",
                    self.image_size, self.patch_size, self.num_channels, self.hidden_size
                ),
            ),
        }
    }

    /// The values [`MockVit::new`] generates, `None` past `usize`; the
    /// patch size must be positive.
    fn num_values(&self) -> Option<usize> {
        let grid = self.image_size / self.patch_size;
        let patches = grid.checked_mul(grid)?;
        let fan_in = self
            .num_channels
            .checked_mul(self.patch_size)?
            .checked_mul(self.patch_size)?;
        // projection (fan_in, d) + cls (d) + positions (1 + patches, d)
        fan_in
            .checked_add(patches)?
            .checked_add(2)?
            .checked_mul(self.hidden_size)
    }
}

/// The mock encoder. Equal seeds give equal outputs on every machine.
#[derive(Debug, Clone)]
pub struct MockVit {
    /// `(channels * patch * patch, hidden)`.
    projection: Tensor,
    /// `(1, 1, hidden)`.
    cls: Tensor,
    /// `(1, 1 + patches, hidden)`.
    positions: Tensor,
    cfg: MockVitConfig,
}

fn seeded_normal(rng: &mut rand_chacha::ChaCha8Rng, n: usize, std: f32) -> Result<Vec<f32>> {
    let normal = match Normal::new(0f32, std) {
        Ok(n) => n,
        Err(e) => return config_err("hidden_size", format!("no normal of std {std}: {e}")),
    };
    Ok((0..n).map(|_| normal.sample(rng)).collect())
}

impl MockVit {
    /// Builds the fixed tensors from the config's seed.
    pub fn new(cfg: &MockVitConfig, dtype: DType, device: &Device) -> Result<Self> {
        cfg.validate()?;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(cfg.seed);
        let fan_in = cfg.num_channels * cfg.patch_size * cfg.patch_size;
        let d = cfg.hidden_size;
        let n = cfg.num_patches();
        let t = |data: Vec<f32>, shape: &[usize]| -> Result<Tensor> {
            Ok(Tensor::from_vec(data, shape, device)?.to_dtype(dtype)?)
        };
        let projection = t(
            seeded_normal(&mut rng, fan_in * d, (1.0 / fan_in as f32).sqrt())?,
            &[fan_in, d],
        )?;
        let cls = t(seeded_normal(&mut rng, d, 0.02)?, &[1, 1, d])?;
        let positions = t(seeded_normal(&mut rng, (1 + n) * d, 0.02)?, &[1, 1 + n, d])?;
        Ok(Self {
            projection,
            cls,
            positions,
            cfg: cfg.clone(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &MockVitConfig {
        &self.cfg
    }

    /// Image tokens: CLS first, then the patches in row-major order.
    ///
    /// # Shapes
    /// `images: (batch, channels, image_size, image_size)` →
    /// `(batch, 1 + patches, hidden)`.
    pub fn forward(&self, images: &Tensor) -> Result<Tensor> {
        let c = &self.cfg;
        let (b, ch, h, w) = match images.dims4() {
            Ok(d) => d,
            Err(_) => {
                return arg_err(
                    "images",
                    format!(
                        "expected shape (batch, channels, height, width), got {:?}",
                        images.dims()
                    ),
                )
            }
        };
        if (ch, h, w) != (c.num_channels, c.image_size, c.image_size) {
            return arg_err(
                "images",
                format!(
                    "expected shape (batch, {}, {}, {}), got {:?}",
                    c.num_channels,
                    c.image_size,
                    c.image_size,
                    images.dims()
                ),
            );
        }
        let (p, g) = (c.patch_size, c.image_size / c.patch_size);
        // (b, c, g, p, g, p) -> (b, g, g, c, p, p) -> (b, g*g, c*p*p)
        let patches = images
            .to_dtype(self.projection.dtype())?
            .reshape((b, ch, g, p, g, p))?
            .permute((0, 2, 4, 1, 3, 5))?
            .reshape((b, g * g, ch * p * p))?;
        // (b, n, d)
        let tokens = patches.broadcast_matmul(&self.projection)?;
        let cls = self.cls.broadcast_as((b, 1, c.hidden_size))?;
        Ok(Tensor::cat(&[&cls, &tokens], 1)?.broadcast_add(&self.positions)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the fuzz targets: a validated config whose patch count
    /// overflowed (`config`), and a 4.5 KB model directory whose mock ViT
    /// asked for 4 GiB of positions (`model_dir`).
    #[test]
    fn validate_refuses_sizes_that_overflow_or_allocate_too_much() {
        let mut cfg = MockVitConfig::base(4, 0);
        cfg.validate().expect("valid");
        for (image_size, patch_size, hidden_size) in
            [(1 << 40, 1, 4), (16_384, 1, 4), (16_384, 16_384, 1 << 40)]
        {
            cfg.image_size = image_size;
            cfg.patch_size = patch_size;
            cfg.hidden_size = hidden_size;
            let err = cfg.validate().unwrap_err().to_string();
            assert!(
                err.contains("image_size") || err.contains("hidden_size"),
                "{err}"
            );
            assert!(MockVit::new(&cfg, DType::F32, &Device::Cpu).is_err());
        }
        // The base config is far under the limit.
        let base = MockVitConfig::base(768, 0);
        assert!(base.num_values().expect("fits") < MAX_MOCK_VIT_VALUES / 64);
    }
}

#!/usr/bin/env python3
"""Writes the Hugging Face parity fixtures under tests/fixtures/hf/.

Two tiny VisionEncoderDecoder checkpoints (ViT encoder + GPT-2 decoder with
cross-attention), random weights from fixed seeds, saved the way
transformers saves them, each with a tokenizer, a test image already at the
model's input size, and transformers' outputs on it:

- `equal/`: encoder and decoder of equal width (32); `tokenizer.json`;
  generation defaults in `generation_config.json` (3 beams, 20 new tokens).
- `narrow/`: a 24-wide encoder under a 48-wide decoder, hence
  `enc_to_dec_proj`; weights in two shards with
  `model.safetensors.index.json`; the tokenizer as `vocab.json` +
  `merges.txt`; generation defaults only in `config.json` (the older
  layout; greedy, 20 new tokens, `no_repeat_ngram_size` 3).

Each directory also gets `expected.safetensors` (pixel values, the
encoder's last hidden state, teacher-forced input ids and logits) and
`expected.json` (greedy and 3-beam ids for 20 new tokens, and the ids
`generate()` gives with the checkpoint's own defaults).

With `--base DIR`, it also writes a base-size checkpoint (ViT-B/16 224 +
GPT-2 small, random weights, ~1 GB, never committed) for the benchmarks.

Needs torch, transformers, tokenizers, pillow (a venv; CI never runs this):

    python3 -m venv .venv && .venv/bin/pip install torch transformers tokenizers pillow safetensors
    .venv/bin/python scripts/hf_fixtures.py
"""

import argparse
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GenerationConfig,
    ViTConfig,
    ViTImageProcessor,
    VisionEncoderDecoderConfig,
    VisionEncoderDecoderModel,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "hf"
NEW_TOKENS = 20
EOS = "<|endoftext|>"
CORPUS = [
    "a small red square to the left of a large purple circle",
    "a dog running on the beach with a ball in its mouth",
    "two people riding bikes down a city street at night",
    "a plate of food with broccoli and rice on a wooden table",
    "a man holding an umbrella in the rain next to a bus",
    "the cat sleeps on a warm windowsill in the afternoon sun",
]


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer laid out as GPT-2's, with EOS as id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def test_image(size: int, seed: int) -> Image.Image:
    """Smooth colour fields plus noise, at the model's input size."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([x, y, 1 - x * y], axis=-1) * 200
    noise = rng.integers(0, 56, size=(size, size, 3))
    return Image.fromarray((base + noise).clip(0, 255).astype(np.uint8), "RGB")


def build(enc_width: int, dec_width: int, vocab: int, seed: int, image_size: int) -> VisionEncoderDecoderModel:
    torch.manual_seed(seed)
    enc = ViTConfig(
        hidden_size=enc_width,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=enc_width * 2,
        image_size=image_size,
        patch_size=8,
        initializer_range=0.2,
    )
    dec = GPT2Config(
        vocab_size=vocab,
        n_embd=dec_width,
        n_layer=2,
        n_head=4,
        n_positions=64,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=0,
        add_cross_attention=True,
    )
    cfg = VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    model = VisionEncoderDecoderModel(cfg).eval()
    # Layer norms start at (1, 0); perturb them so the parity test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or "layernorm" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def write_kind(name: str, enc_width: int, dec_width: int, seed: int) -> None:
    out = OUT / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    image_size = 32
    tok = train_tokenizer(300)
    vocab = tok.get_vocab_size()
    model = build(enc_width, dec_width, vocab, seed, image_size)
    eos = tok.token_to_id(EOS)
    model.config.decoder_start_token_id = eos
    model.config.pad_token_id = eos
    model.config.eos_token_id = eos

    if name == "equal":
        model.generation_config = GenerationConfig(
            decoder_start_token_id=eos,
            bos_token_id=eos,
            eos_token_id=eos,
            pad_token_id=eos,
            max_length=NEW_TOKENS + 1,
            num_beams=3,
            early_stopping=True,
            length_penalty=1.0,
        )
        model.save_pretrained(out)
        tok.save(str(out / "tokenizer.json"))
    else:
        model.generation_config = GenerationConfig(
            decoder_start_token_id=eos,
            bos_token_id=eos,
            eos_token_id=eos,
            pad_token_id=eos,
            max_length=NEW_TOKENS + 1,
            no_repeat_ngram_size=3,
        )
        model.save_pretrained(out, max_shard_size="40KB")
        # The older layout: generation defaults in config.json only.
        os.remove(out / "generation_config.json")
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(max_length=NEW_TOKENS + 1, no_repeat_ngram_size=3, num_beams=1)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        # The older tokenizer layout: vocab.json + merges.txt.
        tok.model.save(str(out))
        special = {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS}
        (out / "special_tokens_map.json").write_text(json.dumps(special) + "\n")
    processor = ViTImageProcessor(
        size={"height": image_size, "width": image_size},
        image_mean=[0.5, 0.4, 0.3],
        image_std=[0.2, 0.25, 0.3],
    )
    processor.save_pretrained(out)

    img = test_image(image_size, seed)
    img.save(out / "image.png")

    # What the Rust side reads back: reload from disk, as a user would.
    model = VisionEncoderDecoderModel.from_pretrained(out).eval()
    pixels = processor(images=Image.open(out / "image.png"), return_tensors="pt").pixel_values
    g = torch.Generator().manual_seed(seed)
    forced = torch.cat(
        [torch.tensor([[eos]]), torch.randint(1, vocab, (1, 11), generator=g)], dim=1
    )
    with torch.no_grad():
        enc_out = model.encoder(pixel_values=pixels).last_hidden_state
        logits = model(pixel_values=pixels, decoder_input_ids=forced).logits
        greedy = model.generate(pixels, max_new_tokens=NEW_TOKENS, num_beams=1, do_sample=False,
                                no_repeat_ngram_size=0, min_length=0)
        beam = model.generate(pixels, max_new_tokens=NEW_TOKENS, num_beams=3, do_sample=False,
                              length_penalty=1.0, early_stopping=False, no_repeat_ngram_size=0)
        defaults = model.generate(pixels)
    save_file(
        {
            "pixel_values": pixels.contiguous(),
            "encoder_last_hidden_state": enc_out.contiguous(),
            "decoder_input_ids": forced.to(torch.int64).contiguous(),
            "logits": logits.contiguous(),
        },
        str(out / "expected.safetensors"),
    )

    def after_start(ids: torch.Tensor) -> list:
        ids = ids[0].tolist()[1:]
        return ids[: ids.index(eos) + 1] if eos in ids else ids

    expected = {
        "greedy": after_start(greedy),
        "beam3": after_start(beam),
        "defaults": after_start(defaults),
        "defaults_text": tok.decode(after_start(defaults), skip_special_tokens=True),
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    print(name, {k: v for k, v in expected.items()})


def write_base(path: Path) -> None:
    """ViT-B/16 224 + GPT-2 small with cross-attention, random weights."""
    torch.manual_seed(0)
    enc = ViTConfig()
    dec = GPT2Config(add_cross_attention=True)
    cfg = VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id = dec.bos_token_id
    cfg.pad_token_id = dec.eos_token_id
    cfg.eos_token_id = dec.eos_token_id
    model = VisionEncoderDecoderModel(cfg).eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=dec.bos_token_id,
        eos_token_id=dec.eos_token_id,
        pad_token_id=dec.eos_token_id,
        max_new_tokens=16,
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    ViTImageProcessor().save_pretrained(path)
    # A byte-level BPE over the whole GPT-2 id range: enough to decode ids.
    vocab = {f"t{i}": i for i in range(dec.vocab_size - 1)}
    vocab[EOS] = dec.vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([EOS])
    tok.save(str(path / "tokenizer.json"))
    test_image(224, 0).save(path / "image.png")
    print("base checkpoint in", path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, help="also write the base-size benchmark checkpoint here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    write_kind("equal", 32, 32, seed=1)
    write_kind("narrow", 24, 48, seed=2)
    if args.base:
        write_base(args.base)


if __name__ == "__main__":
    main()

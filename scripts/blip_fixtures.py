#!/usr/bin/env python3
"""Writes the BLIP parity fixtures under tests/fixtures/blip/.

Tiny `BlipForConditionalGeneration` checkpoints (transformers' captioner:
a ViT-style vision tower with fused qkv and `post_layernorm`, a BERT text
decoder with cross-attention and `cls.predictions.transform`), random
weights from fixed seeds, saved the way transformers saves them, each with
a tiny BERT WordPiece `tokenizer.json` ([PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3,
[MASK] 4, [DEC] 5; start token [DEC] as `text_config.bos_token_id`, end
token [SEP] as `sep_token_id`), a test image already at the input size,
and transformers' outputs on it:

- `vision24/`: a 24-wide vision tower under a 32-wide text decoder
  (`encoder_hidden_size` 24).
- `vision32/`: both 32 wide; ReLU in the text decoder.

`BlipForConditionalGeneration.generate` runs the text decoder's own
generation config (from `text_config`), not the checkpoint's
`generation_config.json`: its defaults are greedy, 20 new tokens
(transformers' model-agnostic default), stopping at `sep_token_id`.

Each directory gets `expected.safetensors` (pixel values, the vision
tower's last hidden state, teacher-forced input ids and logits) and
`expected.json`: greedy and 3-beam ids for 12 new tokens, the ids
`generate()` gives with the checkpoint's defaults, and their text; then
the same with the prompt PROMPT, tokenized as BlipProcessor does ([CLS]
replaced by [DEC], the trailing [SEP] dropped by `generate`), the ids
being the generated ones only and the text the whole decoded sequence.

With `--base DIR`, it writes instead (the fixtures untouched) a
BLIP-base-shaped captioner to DIR for the benchmarks (random weights,
~1 GB, never committed): a ViT-B/16 vision tower at 384 under a 768-wide,
12-layer, 12-head BERT text decoder, vocab 30524, start token [DEC]
30522, end [SEP] 102, pad 0, as Salesforce/blip-image-captioning-base;
transformers' own init (std 0.02, the vision tower's too: its config's
default 1e-10 would leave it near zero) from seed 0; a WordPiece
`tokenizer.json` laid out as bert-base-uncased's ([PAD] 0, [UNK] 100,
[CLS] 101, [SEP] 102, [MASK] 103, filler words up to 30521) plus [DEC]
30522 and [ENC] 30523, so every id the model can emit decodes; BLIP's
preprocessor (bicubic, CLIP mean and std, 384); a 384x384 `image.png`.

Needs torch, transformers, tokenizers, pillow (a venv; CI never runs this):

    /work/venv/bin/python scripts/blip_fixtures.py
    /work/venv/bin/python scripts/blip_fixtures.py --base /tmp/blip-base
"""

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import (
    BlipConfig,
    BlipForConditionalGeneration,
    BlipImageProcessor,
    BlipTextConfig,
    BlipVisionConfig,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "blip"
NEW_TOKENS = 12
IMAGE_SIZE = 32
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]"]
PAD, UNK, CLS, SEP, MASK, DEC = range(6)
PROMPT = "a picture of"
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
WORDS = (
    "a picture of the an photo cat dog sitting on red blue green table "
    "man woman street with two in front room car tree sky"
).split()
PIECES = ["##s", "##ing", "##ed", "##er", "##y"]


def wordpiece(vocab: dict, cls: int, sep: int) -> Tokenizer:
    """BERT's lower-case WordPiece pipeline over `vocab`, with BERT's
    [CLS] ... [SEP] template."""
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tok


def bert_tokenizer() -> Tokenizer:
    """A tiny BERT WordPiece tokenizer, laid out as BLIP's (lower case)."""
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + PIECES)}
    for c in "abcdefghijklmnopqrstuvwxyz.,":
        vocab.setdefault(c, len(vocab))
    tok = wordpiece(vocab, CLS, SEP)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tok


def test_image(size: int, seed: int) -> Image.Image:
    """Smooth colour fields plus noise, at the model's input size."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([x, y, 1 - x * y], axis=-1) * 200
    noise = rng.integers(0, 56, size=(size, size, 3))
    return Image.fromarray((base + noise).clip(0, 255).astype(np.uint8), "RGB")


VARIANTS = {
    "vision24": dict(seed=21, vision_width=24, act="gelu"),
    "vision32": dict(seed=22, vision_width=32, act="relu"),
}


def write_variant(name: str, v: dict) -> None:
    out = OUT / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tok = bert_tokenizer()
    vocab = tok.get_vocab_size()
    torch.manual_seed(v["seed"])
    vision = BlipVisionConfig(
        hidden_size=v["vision_width"],
        intermediate_size=v["vision_width"] * 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=8,
        initializer_range=0.2,
    )
    text = BlipTextConfig(
        vocab_size=vocab,
        hidden_size=32,
        encoder_hidden_size=v["vision_width"],
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_act=v["act"],
        initializer_range=0.2,
        bos_token_id=DEC,
        eos_token_id=SEP,
        pad_token_id=PAD,
        sep_token_id=SEP,
    )
    cfg = BlipConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
    model = BlipForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # Norms start at (1, 0), biases at 0; the class and position
            # embeddings at ~0: perturb them so the parity test sees them.
            if "norm" in pname.lower() or "bias" in pname or "embedding" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    processor = BlipImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        resample=3,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )
    processor.save_pretrained(out)
    img = test_image(IMAGE_SIZE, v["seed"])
    img.save(out / "image.png")

    model = BlipForConditionalGeneration.from_pretrained(out).eval()
    pixels = processor(images=Image.open(out / "image.png"), return_tensors="pt").pixel_values
    g = torch.Generator().manual_seed(v["seed"])
    forced = torch.cat([torch.tensor([[DEC]]), torch.randint(6, vocab, (1, 9), generator=g)], dim=1)
    prompt_ids = torch.tensor([tok.encode(PROMPT).ids])
    assert prompt_ids[0, 0].item() == CLS and prompt_ids[0, -1].item() == SEP
    with torch.no_grad():
        enc_out = model.vision_model(pixel_values=pixels).last_hidden_state
        logits = model(pixel_values=pixels, input_ids=forced).logits
        runs = {}
        for key, ids in [("", None), ("prompt_", prompt_ids)]:
            kw = dict(input_ids=ids.clone()) if ids is not None else {}
            runs[key + "greedy"] = model.generate(pixels, max_new_tokens=NEW_TOKENS, num_beams=1,
                                                  do_sample=False, **kw)
            runs[key + "beam3"] = model.generate(pixels, max_new_tokens=NEW_TOKENS, num_beams=3,
                                                 do_sample=False, length_penalty=1.0,
                                                 early_stopping=False, **kw)
            runs[key + "defaults"] = model.generate(pixels, **kw)
    save_file(
        {
            "pixel_values": pixels.contiguous(),
            "vision_last_hidden_state": enc_out.contiguous(),
            "input_ids": forced.to(torch.int64).contiguous(),
            "logits": logits.contiguous(),
        },
        str(out / "expected.safetensors"),
    )
    # The prefix fed to the decoder: [DEC] then the prompt's words.
    prefix = len(prompt_ids[0]) - 1
    expected = {"prompt": PROMPT, "prompt_ids": [DEC] + prompt_ids[0, 1:-1].tolist()}
    for key, ids in runs.items():
        ids = ids[0].tolist()
        new = ids[prefix if key.startswith("prompt_") else 1:]
        new = new[: new.index(SEP) + 1] if SEP in new else new
        expected[key] = new
        expected[key + "_text"] = tok.decode(ids, skip_special_tokens=True)
    expected["transformers"] = transformers.__version__
    expected["torch"] = torch.__version__
    (out / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    print(name, expected)


BASE_SIZE = 384
BASE_BERT_VOCAB = 30522  # bert-base-uncased; [DEC] and [ENC] come after
BASE_PAD, BASE_UNK, BASE_CLS, BASE_SEP, BASE_MASK = 0, 100, 101, 102, 103
BASE_DEC, BASE_ENC = 30522, 30523


def base_bert_tokenizer() -> Tokenizer:
    """A WordPiece tokenizer laid out as BLIP-base's (bert-base-uncased plus
    [DEC] and [ENC]), its vocabulary the fixtures' words and filler words
    (`w<i>`) up to 30522 entries."""
    from tokenizers import AddedToken

    names = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(names)}
    for t in WORDS + PIECES + list("abcdefghijklmnopqrstuvwxyz.,"):
        vocab.setdefault(t, len(vocab))
    i = 0
    while len(vocab) < BASE_BERT_VOCAB:
        vocab.setdefault(f"w{i}", len(vocab))
        i += 1
    tok = wordpiece(vocab, BASE_CLS, BASE_SEP)
    tok.add_special_tokens([AddedToken(s, special=True)
                            for s in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]", "[ENC]"]])
    ids = [tok.token_to_id(s) for s in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]", "[ENC]"]]
    assert ids == [BASE_PAD, BASE_UNK, BASE_CLS, BASE_SEP, BASE_MASK, BASE_DEC, BASE_ENC], ids
    assert tok.get_vocab_size(True) == BASE_ENC + 1
    return tok


def write_base(out: Path) -> None:
    """A BLIP-base-shaped captioner (random weights) for the benchmarks."""
    out.mkdir(parents=True, exist_ok=True)
    tok = base_bert_tokenizer()
    torch.manual_seed(0)
    vision = BlipVisionConfig(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=BASE_SIZE,
        patch_size=16,
        initializer_range=0.02,
    )
    text = BlipTextConfig(
        vocab_size=tok.get_vocab_size(True),
        hidden_size=768,
        encoder_hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        max_position_embeddings=512,
        initializer_range=0.02,
        bos_token_id=BASE_DEC,
        eos_token_id=BASE_SEP,
        pad_token_id=BASE_PAD,
        sep_token_id=BASE_SEP,
    )
    cfg = BlipConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
    model = BlipForConditionalGeneration(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    BlipImageProcessor(
        size={"height": BASE_SIZE, "width": BASE_SIZE},
        resample=3,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    ).save_pretrained(out)
    test_image(BASE_SIZE, 0).save(out / "image.png")
    print("BLIP base checkpoint in", out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path,
                    help="write only the BLIP-base-shaped benchmark checkpoint, here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.base:
        torch.set_num_threads(2)
        write_base(args.base)
        return
    for name, v in VARIANTS.items():
        write_variant(name, v)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes the Florence-2 parity fixtures under tests/fixtures/florence2/.

Tiny `Florence2ForConditionalGeneration` checkpoints (DaViT vision tower,
projector, BART encoder-decoder), random weights from fixed seeds, saved
the way transformers 5 saves them, each with an offline-built tokenizer and
processor, two test images and transformers' outputs on them:

- `tiny-a/`: the layout of the converted hub checkpoints
  (florence-community/Florence-2-*). 64x64 input; DaViT 16/24/32/48 wide,
  depths 1/1/1/1, heads 2/3/4/6 and groups 4/6/8/12 (8 and 4 wide), the
  real patch embeddings (kernels 7/3/3/3, strides 4/2/2/2, paddings
  3/1/1/1, pre-norm on stages 1-3), window 2 (divides every stage's map:
  16, 8, 4, 2), MLP ratio 4; projection_dim 32 (BART's d_model; the last
  stage is 48 wide); 5 image tokens (1 pooled + 2x2). BART 32 wide, 2+2
  layers, 4 heads, FFN 64, 64 positions, no embedding scale, tied head.
  The vocabulary is handled as transformers' conversion script does it:
  the model is built with the original vocabulary (1325 = 301 BPE ids +
  1024 Florence-2 tokens), then `<image>` (id 1325) is added to the
  tokenizer and the embeddings resized with
  `resize_token_embeddings(1326, pad_to_multiple_of=64)` (mean
  initialisation), so `vocab_size` is 1344, above the tokenizer's 1326
  tokens, as the real 51328 is above 51290. Processor files as on the hub:
  `preprocessor_config.json`, `processor_config.json` (post-processor
  config and `num_additional_image_tokens` only), `tokenizer.json` with a
  `tokenizer_config.json` naming `BartTokenizer`.
- `tiny-b/`: 96x96 input; DaViT 16/24/32/40 wide, depths 1/2/1/1, heads
  1/3/2/5 (16/8/16/8 wide), groups 4/2/8/10 (4/12/4/4 wide), kernels
  5/3/2/3, strides 4/2/2/2, paddings 2/1/0/1, pre-norm on stage 1 only
  (maps 24, 12, 6, 3), window 5 (divides none of them: every stage pads its
  windows), MLP ratio 2; 10 image tokens (1 + 3x3). BART as tiny-a's but
  with `scale_embedding` true and an untied `lm_head`; `vocab_size` equal
  to the tokenizer's 1326 tokens. Processor files as transformers 5.24's
  `save_pretrained` writes them (the image processor nested in
  `processor_config.json`, `tokenizer_class` RobertaTokenizer).
- `tiny-orig/`: tiny-a's weights (before the vocabulary resize) in the
  original microsoft/Florence-2-* remote-code layout: `config.json` with
  `auto_map`, a `vision_config` of `model_type` "davit" (`dim_embed`,
  `image_pos_embed`, `visual_temporal_embedding`, `image_feature_source`),
  a `text_config` of `model_type` "florence2_language", `vocab_size` 1325;
  the original tensor names (ORIGINAL_LAYOUT below); the BPE tokenizer
  alone (301 ids: the original processor adds the 1024 Florence-2 tokens
  itself and has no `<image>`); microsoft's `preprocessor_config.json`.
  Its expected outputs are those of the original computation (image
  features in front of `<s> prompt </s>`, 1325 logits); they equal
  tiny-a's (logits: its first 1325 columns).

Every layer norm, the zero-initialised biases and the padding rows of the
embeddings are perturbed away from their init so the parity tests see
them; the decoder's last layer norm is scaled by LOGIT_GAIN so that the
greedy and beam choices have margins far above float error (logits' std
~9; smallest greedy top-1 - top-2 gap 0.10 in tiny-a, 0.30 in tiny-b;
greedy and beam ids unchanged under 2e-4 noise on the logits). Attention
is eager, everything f32.

Each directory gets `image.png` (64x64 or 96x96, already square),
`other.png` (75x50, which the processor squashes to the square size),
`generation_config.json` as the hub checkpoints' (3 beams,
`no_repeat_ngram_size` 3, early stopping, forced BOS 0 and EOS 2, start
token 2, no `max_length`), and `expected.safetensors` (f32 and i64,
batch 1; S the input size, C the last stage's width, h = w its map side):

- `pixel_values`, `pixel_values_other` (1, 3, S, S): the processor's
  output for `image.png` and `other.png`.
- `vision_features`: the vision tower's last hidden state, (1, C, h, w) in
  the transformers layouts; (1, h*w, C) in `tiny-orig`, as the original
  DaViT returns it.
- `image_features` (1, 1 + h*w, 32): the projector's output.
- `input_ids` (1, n): the processor's ids for `<CAPTION>`: 1 + h*w image
  tokens, then `<s>`, the prompt, `</s>` (in `tiny-orig` without the image
  tokens, as the original processor gives them; the model puts the image
  features in front). `encoder_states` (1, n, 32): BART's encoder on the
  merged embeddings. `input_ids_od`, `encoder_states_od`: the same for
  `<OD>`.
- `decoder_input_ids` (1, 8): a fixed teacher-forced sequence (start token
  2, `<s>`, two BPE ids, `<loc_417>`, the padding id 1, two BPE ids) and
  `logits` (1, 8, vocab_size).
- `greedy_ids`, `beam3_ids` (1, 13): `generate()` for `<CAPTION>`, 12 new
  tokens, `do_sample` false, 1 or 3 beams, the other settings from
  `generation_config.json`; the whole output, start token 2 first (then
  the forced `<s>`; the forced `</s>` last). `greedy_ids_od`,
  `beam3_ids_od`: the same for `<OD>`; `greedy_ids_other`: greedy for
  `<CAPTION>` on `other.png`; `defaults_ids` (1, 21): `generate()` for
  `<CAPTION>` with the checkpoint's own defaults (3 beams; with no
  `max_length` in generation_config.json, transformers 5 generates 20 new
  tokens after the start token, so 21 ids, not 20).

`expected.json` repeats the ids as lists with their decoded text, the
shapes of the float tensors, and the versions. `tasks.json` (from tiny-a's
processor) lists, for the 15 tasks Florence2Processor knows, the prompt it
builds and its ids, two other prompts (plain text; a task token with
extra text, an error), then crafted generated sequences per
post-processing family with `post_process_generation`'s results for a
641x427 image, from the ids (`sequence=`) and from their decoded text
(`text=`, special tokens kept), and OCR's area filter with the config
keys the post-processor reads.

Notes on transformers' Florence-2 (5.24), for the Rust side:
- The BART encoder gets `inputs_embeds`: the text ids go through
  `shared` (BartScaledWordEmbedding, so times sqrt(d_model) when
  `scale_embedding`), the image features replace the `<image>` positions
  unscaled; positions (offset 2) and `layernorm_embedding` then apply to
  the whole sequence. The original model embeds text with a plain
  nn.Embedding: no scale (the real checkpoints have `scale_embedding`
  false, so both agree there).
- The projector adds learned row/column embeddings ([column | row] halves
  of the channels) to the (C, h, w) map, flattens it, adds the cosine
  temporal embedding of frame 0 (sin 0, cos 1 alternating: 0, 1, 0, 1...),
  then puts the mean over positions first: 1 + h*w tokens, then the
  bias-free projection and a layer norm.
- The processor's prompt is `<image>` x image_seq_length + `<s>` + prompt
  + `</s>`, tokenized without adding special tokens; a task token must be
  alone (tasks without input) or is replaced with its input stripped.
- Without torchvision AutoImageProcessor picks CLIPImageProcessorPil:
  PIL bicubic resize of the uint8 RGB image to size x size, then x/255 (in
  f64, stored as f32), then (x - mean) / std in f32.
- HF's DaViT applies a stage's pre-norm to 4-D input too; the original
  ConvEmbed skips it there (so pre-norm on stage 0 would differ; neither
  layout here uses it).
- Florence2PostProcessor reads `PATTERN` / `AREA_THRESHOLD`, while the
  converted checkpoints' processor_config.json has `pattern` /
  `area_threshold`: the defaults apply. Its area is a shoelace sum over
  three of the quad's four edges.

With `--base DIR`, it writes instead (the fixtures untouched) a
Florence-2-base-shaped checkpoint to DIR for the benchmarks (random
weights, ~0.9 GB, never committed): DaViT 128/256/512/1024, depths
1/1/9/1, heads and groups 4/8/16/32, window 12, projection_dim 768,
768x768 input (577 image tokens); BART-base (6+6 layers, d_model 768, 12
heads, FFN 3072, 1024 positions); vocab 51328 as the converted
checkpoints'; transformers' own init (std 0.02) from seed 0; a byte-level
BPE tokenizer laid out as the real one (BART's 50265 ids with filler
tokens standing in for most words, `<mask>` 50264, the 1024 Florence-2
tokens from 50265, `<image>` 51289) plus 38 unused tokens so that it
covers all 51328 ids; tiny-a's processor and generation configs at 768; a
768x768 `image.png`. It checks that the checkpoint loads and generates
four tokens (greedy: the forced `<s>`, two free, the forced `</s>`).

Needs torch, transformers (5.x), tokenizers, pillow (a venv; CI never runs
this):

    /work/venv/bin/python scripts/florence2_fixtures.py
    /work/venv/bin/python scripts/florence2_fixtures.py --base /tmp/florence2-base
"""

import argparse
import copy
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AddedToken,
    AutoProcessor,
    AutoTokenizer,
    BartConfig,
    BartTokenizer,
    CLIPImageProcessorPil,
    Florence2Config,
    Florence2ForConditionalGeneration,
    Florence2Processor,
    Florence2VisionConfig,
    GenerationConfig,
)
from transformers.models.florence2.processing_florence2 import Florence2PostProcessor  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "florence2"

BOS, PAD, EOS, UNK = 0, 1, 2, 3
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
MASK = "<mask>"  # last id of BART's own vocabulary, before Florence-2's tokens
IMAGE_TOKEN = "<image>"
# The tokens microsoft's processing_florence2.py adds to BART's tokenizer, in
# its order (ids 50265..51288 in the real checkpoints; the misspelt
# `region_to_desciption` is theirs).
FLORENCE_TOKENS = (
    ["<od>", "</od>", "<ocr>", "</ocr>"]
    + [f"<loc_{i}>" for i in range(1000)]
    + ["<cap>", "</cap>", "<ncap>", "</ncap>", "<dcap>", "</dcap>", "<grounding>", "</grounding>",
       "<seg>", "</seg>", "<sep>", "<region_cap>", "</region_cap>", "<region_to_desciption>",
       "</region_to_desciption>", "<proposal>", "</proposal>", "<poly>", "</poly>", "<and>"]
)
assert len(FLORENCE_TOKENS) == 1024

NEW_TOKENS = 12
PAD_VOCAB_TO = 64  # transformers' conversion: resize_token_embeddings(len(tok), 64)
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
BICUBIC = 3
POST_SIZE = (641, 427)  # (W, H) for post_process_generation: bins of 0.641 x 0.427 px

# The hub checkpoints' generation_config.json (no max_length: 20 applies).
GENERATION = dict(
    bos_token_id=BOS,
    decoder_start_token_id=EOS,
    early_stopping=True,
    eos_token_id=EOS,
    forced_bos_token_id=BOS,
    forced_eos_token_id=EOS,
    no_repeat_ngram_size=3,
    num_beams=3,
    pad_token_id=PAD,
)

# Captions, shape words and the processor's prompts, so that prompts and
# crafted answers take few tokens.
CORPUS = [
    "a red car parked in front of a yellow building",
    "two dogs play with a ball on the green grass",
    "a small blue square to the left of a large purple circle",
    "a triangle, a rectangle and an oval on a white table",
    "the cat sleeps on a warm windowsill in the afternoon sun",
    "a man holding an umbrella in the rain next to a bus",
    "a wheel, a door and a window of a car",
    "TOTAL DUE $1,250.00 INVOICE No. 2024-117",
    "What is the text in the image?",
    "What is the text in the image, with regions?",
    "What does the image describe?",
    "Describe in detail what is shown in the image.",
    "Describe with a paragraph what is shown in the image.",
    "Locate the objects with category name in the image.",
    "Locate the objects in the image, with their descriptions.",
    "Locate the region proposals in the image.",
    "Locate the phrases in the caption:",
    "Locate a red car in the image with mask",
    "What is the polygon mask of region",
    "Locate a dog in the image.",
    "What is the region?",
    "What does the region describe?",
    "What text is in the region?",
]

# phrase_grounding.banned_grounding_tokens as transformers'
# convert_florence2_original_pytorch_to_hf.py writes it (duplicates kept).
BANNED_GROUNDING_TOKENS = [
    "it", "I", "me", "mine", "you", "your", "yours", "he", "him", "his", "she", "her", "hers",
    "they", "them", "their", "theirs", "one", "oneself", "we", "us", "our", "ours", "you", "your",
    "yours", "they", "them", "their", "theirs", "mine", "yours", "his", "hers", "its", "ours",
    "yours", "theirs", "myself", "yourself", "himself", "herself", "itself", "ourselves",
    "yourselves", "themselves", "this", "that", "these", "those", "who", "whom", "whose", "which",
    "what", "who", "whom", "whose", "which", "that", "all", "another", "any", "anybody", "anyone",
    "anything", "each", "everybody", "everyone", "everything", "few", "many", "nobody", "none",
    "one", "several", "some", "somebody", "someone", "something", "each other", "one another",
    "myself", "yourself", "himself", "herself", "itself", "ourselves", "yourselves", "themselves",
    "the image", "image", "images", "the", "a", "an", "a group", "other objects", "lots", "a set",
]
OCR_PATTERN = r"(.+?)<loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)>"
# The conversion script's post_processor_config. Its ocr keys are lower
# case, while Florence2PostProcessor reads "PATTERN" and "AREA_THRESHOLD":
# with the real config the default pattern and threshold 0 apply.
POST_PROCESSOR_CONFIG = {
    "ocr": {"pattern": OCR_PATTERN, "area_threshold": 0.0},
    "phrase_grounding": {"banned_grounding_tokens": BANNED_GROUNDING_TOKENS},
    "pure_text": {},
    "description_with_bboxes": {},
    "description_with_polygons": {},
    "polygons": {},
    "bboxes": {},
    "description_with_bboxes_or_polygons": {},
}


# ---------------------------------------------------------------------------
# Tokenizer and processor


def train_bpe(vocab_size: int) -> tuple[dict, list]:
    """A byte-level BPE laid out as BART's: <s> <pad> </s> <unk> first,
    the learned tokens, <mask> last. Returns (vocab, merges)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    merges = [tuple(m) for m in spec["model"]["merges"]]
    vocab[MASK] = len(vocab)
    assert [vocab[s] for s in SPECIALS] == [BOS, PAD, EOS, UNK]
    return vocab, merges


def bart_tokenizer(vocab: dict, merges: list) -> BartTokenizer:
    """transformers 5's BartTokenizer (tokenizers-backed, RoBERTa post
    processing) over the BPE, no Florence-2 tokens yet."""
    return BartTokenizer(vocab=vocab, merges=merges, add_prefix_space=False)


def florence_tokenizer(vocab: dict, merges: list, extra: list[str] = ()) -> BartTokenizer:
    """The converted checkpoints' tokenizer: BART's, the 1024 Florence-2
    tokens as extra special tokens, then `<image>` (special, not
    normalised) named `image_token`, then `extra` unused tokens."""
    tok = bart_tokenizer(vocab, merges)
    tok.add_special_tokens({"extra_special_tokens": FLORENCE_TOKENS})
    tok.add_tokens(AddedToken(IMAGE_TOKEN, special=True, normalized=False), special_tokens=True)
    if extra:
        tok.add_tokens(list(extra))
    # Reload so that `<image>` is a named token (tokenizer.image_token,
    # image_token_id), as transformers 5 reads the hub's tokenizer_config.
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        tok = AutoTokenizer.from_pretrained(tmp, image_token=IMAGE_TOKEN)
    base = len(vocab)
    assert tok.convert_tokens_to_ids(FLORENCE_TOKENS[0]) == base
    assert tok.image_token_id == base + len(FLORENCE_TOKENS)
    return tok


def image_processor(size: int, image_seq_length: int) -> CLIPImageProcessorPil:
    """Florence-2's preprocessor: a CLIP image processor (the PIL backend,
    what AutoImageProcessor picks without torchvision) resizing to
    size x size (bicubic, no aspect kept, no crop), rescale 1/255, ImageNet
    mean and std."""
    return CLIPImageProcessorPil(
        do_resize=True,
        size={"height": size, "width": size},
        resample=BICUBIC,
        do_center_crop=False,
        crop_size={"height": size, "width": size},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD,
        do_convert_rgb=None,
        image_seq_length=image_seq_length,
    )


def florence_processor(tok, size: int, image_seq_length: int) -> Florence2Processor:
    return Florence2Processor(
        image_processor=image_processor(size, image_seq_length),
        tokenizer=tok,
        num_additional_image_tokens=0,  # as the conversion leaves it
        post_processor_config=POST_PROCESSOR_CONFIG,
    )


def save_hub_processor(proc: Florence2Processor, out: Path) -> None:
    """The processor files as the converted hub checkpoints lay them out:
    `preprocessor_config.json` apart, `processor_config.json` with the
    processor's own settings, `tokenizer_config.json` naming BartTokenizer
    with `<image>` under `extra_special_tokens` and the Florence-2 tokens
    under `additional_special_tokens` (transformers 4.5x's keys, which 5.x
    reads)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc.save_pretrained(tmp)
        shutil.copy(Path(tmp) / "tokenizer.json", out / "tokenizer.json")
        pcfg = json.loads((Path(tmp) / "processor_config.json").read_text())
        tcfg = json.loads((Path(tmp) / "tokenizer_config.json").read_text())
    pre = pcfg.pop("image_processor")
    pre["processor_class"] = "Florence2Processor"
    write_json(out / "preprocessor_config.json", pre)
    write_json(out / "processor_config.json", pcfg)
    for key in ["is_local", "local_files_only", "backend", "model_specific_special_tokens", "image_token"]:
        tcfg.pop(key, None)
    tcfg["additional_special_tokens"] = tcfg.pop("extra_special_tokens")
    tcfg["extra_special_tokens"] = {"image_token": IMAGE_TOKEN}
    tcfg["tokenizer_class"] = "BartTokenizer"
    tcfg["model_max_length"] = 1024
    write_json(out / "tokenizer_config.json", tcfg)


def test_image(width: int, height: int, seed: int) -> Image.Image:
    """Smooth colour fields, a dark disc and noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    fx, fy = x / width, y / height
    base = np.stack([fx, fy, 1 - fx * fy], axis=-1) * 200
    disc = ((fx - 0.6) ** 2 + (fy - 0.4) ** 2 < 0.04)[..., None] * -120
    noise = rng.integers(0, 56, size=(height, width, 3))
    return Image.fromarray((base + disc + noise).clip(0, 255).astype(np.uint8), "RGB")


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------
# Models


def conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def feature_map(v: dict) -> int:
    """The side of DaViT's last feature map for a square input."""
    side = v["image_size"]
    for k, s, p in zip(v["vision"]["patch_size"], v["vision"]["patch_stride"], v["vision"]["patch_padding"]):
        side = conv_out(side, k, s, p)
    return side


VARIANTS = {
    "tiny-a": dict(
        seed=43,
        image_size=64,
        vision=dict(
            embed_dim=[16, 24, 32, 48],
            depths=[1, 1, 1, 1],
            num_heads=[2, 3, 4, 6],
            num_groups=[4, 6, 8, 12],
            patch_size=[7, 3, 3, 3],
            patch_stride=[4, 2, 2, 2],
            patch_padding=[3, 1, 1, 1],
            patch_prenorm=[False, True, True, True],
            window_size=2,
            mlp_ratio=4.0,
            max_position_embeddings=8,
            max_temporal_embeddings=4,
        ),
        text=dict(scale_embedding=False),
        tie_word_embeddings=True,
        pad_vocab=True,
        hub_layout=True,
    ),
    "tiny-b": dict(
        seed=42,
        image_size=96,
        vision=dict(
            embed_dim=[16, 24, 32, 40],
            depths=[1, 2, 1, 1],
            num_heads=[1, 3, 2, 5],
            num_groups=[4, 2, 8, 10],
            patch_size=[5, 3, 2, 3],
            patch_stride=[4, 2, 2, 2],
            patch_padding=[2, 1, 0, 1],
            patch_prenorm=[False, True, False, False],
            window_size=5,
            mlp_ratio=2.0,
            max_position_embeddings=6,
            max_temporal_embeddings=3,
        ),
        text=dict(scale_embedding=True),
        tie_word_embeddings=False,
        pad_vocab=False,
        hub_layout=False,
    ),
}
D_MODEL = 32
LOGIT_GAIN = 8.0


def florence_config(v: dict, vocab_size: int, image_token_id: int) -> Florence2Config:
    vision = Florence2VisionConfig(
        **v["vision"],
        projection_dim=D_MODEL,
        drop_path_rate=0.1,  # the real value; identity in eval
        initializer_range=0.2,
    )
    text = BartConfig(
        vocab_size=vocab_size,
        d_model=D_MODEL,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        activation_function="gelu",
        init_std=0.2,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=EOS,
        forced_eos_token_id=EOS,
        **v["text"],
    )
    return Florence2Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=image_token_id,
        tie_word_embeddings=v["tie_word_embeddings"],
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )


def perturb(model: Florence2ForConditionalGeneration, seed: int) -> None:
    """Moves every layer norm, every constant (zero-initialised) tensor and
    the zeroed padding rows of the embeddings away from their init; then
    scales the decoder's last layer norm by LOGIT_GAIN, so that the logits
    spread (std ~LOGIT_GAIN) and greedy and beam choices are not decided by
    float rounding; an untied head is drawn with the embeddings' std."""
    g = torch.Generator().manual_seed(seed)
    last_norm = model.model.language_model.decoder.layers[-1].final_layer_norm
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().flatten()
            if "norm" in name or bool((flat == flat[0]).all()):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            elif (p.dim() == 2 and "embed" in name) or name.endswith("shared.weight"):
                zero_rows = (p == 0).all(dim=1)
                if zero_rows.any():
                    p[zero_rows] = torch.randn(int(zero_rows.sum()), p.shape[1], generator=g) * 0.2
        last_norm.weight.mul_(LOGIT_GAIN)
        last_norm.bias.mul_(LOGIT_GAIN)
        if model.lm_head.weight is not model.model.language_model.shared.weight:
            # transformers initialises an untied head with the top-level
            # default std 0.02; give it BART's 0.2 like the tied one.
            model.lm_head.weight.normal_(0.0, 0.2, generator=g)


def load_model(path: Path) -> Florence2ForConditionalGeneration:
    return Florence2ForConditionalGeneration.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()


# ---------------------------------------------------------------------------
# The original (microsoft remote-code) layout
#
# ORIGINAL_LAYOUT: transformers name -> original name, the inverse of
# convert_florence2_original_pytorch_to_hf.py ({i}: stage, {j}: block, X:
# spatial_block or channel_block, ATTN: window_attn or channel_attn):
#
#   model.vision_tower.convs.{i}.conv.{weight,bias}      vision_tower.convs.{i}.proj.*
#   model.vision_tower.convs.{i}.norm.*                  vision_tower.convs.{i}.norm.*
#   model.vision_tower.blocks.{i}.{j}.X.conv1.*          ....X.conv1.fn.dw.*
#   model.vision_tower.blocks.{i}.{j}.X.norm1.*          ....X.ATTN.norm.*
#   model.vision_tower.blocks.{i}.{j}.X.ATTN.{qkv,proj}.*  ....X.ATTN.fn.{qkv,proj}.*
#   model.vision_tower.blocks.{i}.{j}.X.conv2.*          ....X.conv2.fn.dw.*
#   model.vision_tower.blocks.{i}.{j}.X.norm2.*          ....X.ffn.norm.*
#   model.vision_tower.blocks.{i}.{j}.X.ffn.fc{1,2}.*    ....X.ffn.fn.net.fc{1,2}.*
#   model.multi_modal_projector.image_projection.weight  image_projection, TRANSPOSED:
#       the original is an nn.Parameter (last_dim, projection_dim) used as
#       `x @ image_projection`; transformers' is nn.Linear's (out, in)
#   model.multi_modal_projector.image_proj_norm.*        image_proj_norm.*
#   model.multi_modal_projector.image_position_embed.{row,column}_embeddings.weight
#                                                        image_pos_embed.{row,column}_embeddings.weight
#   model.multi_modal_projector.visual_temporal_embed.pos_idx_to_embed
#                                                        visual_temporal_embed.pos_idx_to_embed
#   model.language_model.<rest>                          language_model.model.<rest>
#   lm_head.weight                                       language_model.lm_head.weight
#
# Vocabulary: the original has `vocab_size` 1325 rows (no `<image>`; the
# conversion adds it and pads to a multiple of 64). Tied copies: as in
# microsoft's model.safetensors, only language_model.model.shared.weight is
# stored; language_model.model.{encoder,decoder}.embed_tokens.weight and
# language_model.lm_head.weight are absent (the remote code ties them). The
# original's buffer language_model.final_logits_bias (1, 1325), zeros, is
# stored; the conversion drops it.

# transformers names tied to model.language_model.shared.weight in tiny-a.
TIED_TO_SHARED = [
    "model.language_model.encoder.embed_tokens.weight",
    "model.language_model.decoder.embed_tokens.weight",
    "lm_head.weight",
]

BLOCK_RENAMES = [
    (r"\.conv1\.(weight|bias)$", r".conv1.fn.dw.\1"),
    (r"\.conv2\.(weight|bias)$", r".conv2.fn.dw.\1"),
    (r"\.ffn\.(fc[12])\.", r".ffn.fn.net.\1."),
    (r"\.(window_attn|channel_attn)\.(qkv|proj)\.", r".\1.fn.\2."),
]


def original_name(name: str) -> str:
    """The original remote-code name of a transformers Florence-2 tensor."""
    if name.startswith("model.vision_tower."):
        rest = name[len("model."):]
        rest = re.sub(r"^(vision_tower\.convs\.\d+)\.conv\.", r"\1.proj.", rest)
        if ".blocks." in rest:
            attn = "window_attn" if ".spatial_block." in rest else "channel_attn"
            rest = re.sub(r"\.norm1\.", f".{attn}.norm.", rest)
            rest = re.sub(r"\.norm2\.", ".ffn.norm.", rest)
            for pat, rep in BLOCK_RENAMES:
                rest = re.sub(pat, rep, rest)
        return rest
    projector = {
        "image_projection.weight": "image_projection",
        "image_proj_norm.weight": "image_proj_norm.weight",
        "image_proj_norm.bias": "image_proj_norm.bias",
        "image_position_embed.row_embeddings.weight": "image_pos_embed.row_embeddings.weight",
        "image_position_embed.column_embeddings.weight": "image_pos_embed.column_embeddings.weight",
        "visual_temporal_embed.pos_idx_to_embed": "visual_temporal_embed.pos_idx_to_embed",
    }
    prefix = "model.multi_modal_projector."
    if name.startswith(prefix):
        return projector[name[len(prefix):]]
    if name.startswith("model.language_model."):
        return "language_model.model." + name[len("model.language_model."):]
    if name == "lm_head.weight":
        return "language_model.lm_head.weight"
    raise KeyError(name)


def to_original(state: dict, vocab_size: int) -> dict:
    """transformers' Florence-2 state dict (tied head) -> the original
    layout's tensors, as microsoft's model.safetensors holds them."""
    shared = state["model.language_model.shared.weight"]
    assert shared.shape[0] == vocab_size, shared.shape
    out = {}
    for name, t in state.items():
        if name in TIED_TO_SHARED:
            assert torch.equal(t, shared), name
            continue
        t = t.detach().clone().contiguous()
        if name == "model.multi_modal_projector.image_projection.weight":
            t = t.t().contiguous()
        out[original_name(name)] = t
    out["language_model.final_logits_bias"] = torch.zeros(1, vocab_size)
    return out


def from_original(orig: dict, names: list[str]) -> dict:
    """The original layout -> transformers names (`names`: the model's),
    as the conversion script maps it, the tied copies from `shared`; used to
    check the written file."""
    state = {}
    for name in names:
        t = orig[original_name("model.language_model.shared.weight" if name in TIED_TO_SHARED else name)]
        if name == "model.multi_modal_projector.image_projection.weight":
            t = t.t().contiguous()
        state[name] = t
    return state


def original_config(v: dict, vocab_size: int) -> dict:
    """config.json as microsoft/Florence-2-* write it (hand-written keys of
    their configuration_florence2.py)."""
    vis = v["vision"]
    return {
        "_name_or_path": "florence2",
        "architectures": ["Florence2ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_florence2.Florence2Config",
            "AutoModelForCausalLM": "modeling_florence2.Florence2ForConditionalGeneration",
        },
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "ignore_index": -100,
        "model_type": "florence2",
        "pad_token_id": PAD,
        "projection_dim": D_MODEL,
        "text_config": {
            "model_type": "florence2_language",
            "vocab_size": vocab_size,
            "activation_dropout": 0.1,
            "activation_function": "gelu",
            "add_bias_logits": False,
            "add_final_layer_norm": False,
            "attention_dropout": 0.1,
            "bos_token_id": BOS,
            "classif_dropout": 0.1,
            "classifier_dropout": 0.0,
            "d_model": D_MODEL,
            "decoder_attention_heads": 4,
            "decoder_ffn_dim": 64,
            "decoder_layerdrop": 0.0,
            "decoder_layers": 2,
            "decoder_start_token_id": EOS,
            "dropout": 0.1,
            "early_stopping": True,
            "encoder_attention_heads": 4,
            "encoder_ffn_dim": 64,
            "encoder_layerdrop": 0.0,
            "encoder_layers": 2,
            "eos_token_id": EOS,
            "forced_eos_token_id": EOS,
            "forced_bos_token_id": BOS,
            "gradient_checkpointing": False,
            "init_std": 0.2,
            "is_encoder_decoder": True,
            "label2id": {"LABEL_0": 0, "LABEL_1": 1, "LABEL_2": 2},
            "max_position_embeddings": 64,
            "no_repeat_ngram_size": 3,
            "normalize_before": False,
            "num_hidden_layers": 2,
            "pad_token_id": PAD,
            "scale_embedding": v["text"]["scale_embedding"],
            "num_beams": 3,
        },
        "vision_config": {
            "model_type": "davit",
            "drop_path_rate": 0.1,
            "patch_size": vis["patch_size"],
            "patch_stride": vis["patch_stride"],
            "patch_padding": vis["patch_padding"],
            "patch_prenorm": vis["patch_prenorm"],
            "enable_checkpoint": False,
            "dim_embed": vis["embed_dim"],
            "num_heads": vis["num_heads"],
            "num_groups": vis["num_groups"],
            "depths": vis["depths"],
            "window_size": vis["window_size"],
            "projection_dim": D_MODEL,
            "visual_temporal_embedding": {"type": "COSINE", "max_temporal_embeddings": vis["max_temporal_embeddings"]},
            "image_pos_embed": {"type": "learned_abs_2d", "max_pos_embeddings": vis["max_position_embeddings"]},
            "image_feature_source": ["spatial_avg_pool", "temporal_avg_pool"],
        },
        "vocab_size": vocab_size,
        "torch_dtype": "float32",
        "transformers_version": "4.41.0.dev0",
        "is_encoder_decoder": True,
    }


def original_preprocessor(size: int, image_seq_length: int) -> dict:
    """microsoft/Florence-2-*'s preprocessor_config.json."""
    return {
        "auto_map": {"AutoProcessor": "processing_florence2.Florence2Processor"},
        "crop_size": {"height": size, "width": size},
        "do_center_crop": False,
        "do_convert_rgb": None,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": IMAGENET_MEAN,
        "image_processor_type": "CLIPImageProcessor",
        "image_seq_length": image_seq_length,
        "image_std": IMAGENET_STD,
        "processor_class": "Florence2Processor",
        "resample": BICUBIC,
        "rescale_factor": 1 / 255,
        "size": {"height": size, "width": size},
    }


# ---------------------------------------------------------------------------
# Expected outputs


def forced_ids(tok) -> torch.Tensor:
    """Start token, <s>, two words, a location, the padding id, two words."""
    words = tok(" red car", add_special_tokens=False).input_ids[:2]
    more = tok(" a dog", add_special_tokens=False).input_ids[:2]
    loc = tok.convert_tokens_to_ids("<loc_417>")
    ids = [EOS, BOS] + words + [loc, PAD] + more
    assert len(ids) == 8, ids
    return torch.tensor([ids])


def compute_expected(model, proc, image: Image.Image, other: Image.Image, stand_in: int | None = None) -> dict:
    """transformers' outputs for the fixture images (see the module doc).
    `stand_in`: an id put in place of the image tokens (for a model whose
    vocabulary has no `<image>`)."""

    def inputs(text: str, img: Image.Image):
        x = proc(text=text, images=img, return_tensors="pt")
        if stand_in is not None:
            x["input_ids"] = x["input_ids"].masked_fill(x["input_ids"] == proc.image_token_id, stand_in)
        return x

    cap = inputs("<CAPTION>", image)
    od = inputs("<OD>", image)
    cap_other = inputs("<CAPTION>", other)
    forced = forced_ids(proc.tokenizer)
    greedy = dict(max_new_tokens=NEW_TOKENS, num_beams=1, do_sample=False)
    beam3 = dict(max_new_tokens=NEW_TOKENS, num_beams=3, do_sample=False)
    with torch.no_grad():
        vision = model.model.vision_tower(cap.pixel_values).last_hidden_state
        image_features = model.model.multi_modal_projector(vision)
        out = model(**cap, decoder_input_ids=forced)
        out_od = model(**od, decoder_input_ids=forced)
        e = {
            "pixel_values": cap.pixel_values,
            "pixel_values_other": cap_other.pixel_values,
            "vision_features": vision,
            "image_features": image_features,
            "input_ids": cap.input_ids,
            "encoder_states": out.encoder_last_hidden_state,
            "input_ids_od": od.input_ids,
            "encoder_states_od": out_od.encoder_last_hidden_state,
            "decoder_input_ids": forced,
            "logits": out.logits,
            "greedy_ids": model.generate(**cap, **greedy),
            "beam3_ids": model.generate(**cap, **beam3),
            "greedy_ids_od": model.generate(**od, **greedy),
            "beam3_ids_od": model.generate(**od, **beam3),
            "greedy_ids_other": model.generate(**cap_other, **greedy),
            "defaults_ids": model.generate(**cap),
        }
    return {k: v.contiguous() for k, v in e.items()}


def save_expected(out: Path, e: dict, tok) -> None:
    floats = {"pixel_values", "pixel_values_other", "vision_features", "image_features", "encoder_states",
              "encoder_states_od", "logits"}
    for k, v in e.items():
        assert v.dtype == (torch.float32 if k in floats else torch.int64), (k, v.dtype)
    save_file(e, str(out / "expected.safetensors"))
    summary = {}
    for k, v in e.items():
        if v.dtype == torch.int64:
            summary[k] = v[0].tolist()
            if "_ids" in k and not k.startswith(("input", "decoder")):
                summary[k + "_text"] = tok.decode(v[0].tolist(), skip_special_tokens=False)
        else:
            summary[k + "_shape"] = list(v.shape)
    summary["transformers"] = transformers.__version__
    summary["torch"] = torch.__version__
    write_json(out / "expected.json", summary)


def fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def write_variant(name: str, v: dict, vocab: dict, merges: list):
    """Builds, saves and reloads one transformers-layout variant; tiny-a
    also writes tiny-orig. Returns tiny-a's processor (for tasks.json)."""
    out = fresh_dir(OUT / name)
    tok = florence_tokenizer(vocab, merges)
    side = feature_map(v)
    seq_len = 1 + side * side
    size = v["image_size"]
    proc = florence_processor(tok, size, seq_len)

    torch.manual_seed(v["seed"])
    if v["pad_vocab"]:
        # As the conversion: the original vocabulary first, then `<image>`
        # and the padding to a multiple of 64.
        orig_vocab = len(tok) - 1
        cfg = florence_config(v, orig_vocab, image_token_id=UNK)
    else:
        cfg = florence_config(v, len(tok), image_token_id=tok.image_token_id)
    model = Florence2ForConditionalGeneration(cfg).eval()
    perturb(model, v["seed"])
    if v["pad_vocab"]:
        write_original(v, model, proc, orig_vocab, OUT / "tiny-orig", vocab, merges)
        model.resize_token_embeddings(len(tok), pad_to_multiple_of=PAD_VOCAB_TO)
        model.config.image_token_id = tok.image_token_id
    model.generation_config = GenerationConfig(**GENERATION)
    model.save_pretrained(out)
    if v["hub_layout"]:
        save_hub_processor(proc, out)
    else:
        proc.save_pretrained(out)
    test_image(size, size, v["seed"]).save(out / "image.png")
    test_image(75, 50, v["seed"] + 100).save(out / "other.png")

    # What the Rust side reads back: reload from disk, as a user would.
    model = load_model(out)
    proc = AutoProcessor.from_pretrained(out)
    assert type(proc.image_processor).__name__ == "CLIPImageProcessorPil"
    assert proc.num_image_tokens == seq_len and proc.image_token_id == model.config.image_token_id
    tied = model.lm_head.weight is model.model.language_model.shared.weight
    assert tied == v["tie_word_embeddings"], (name, tied)
    e = compute_expected(model, proc, Image.open(out / "image.png"), Image.open(out / "other.png"))
    assert e["image_features"].shape == (1, seq_len, D_MODEL)
    assert e["input_ids"][0, :seq_len].eq(model.config.image_token_id).all()
    save_expected(out, e, proc.tokenizer)
    print(name, "vocab", model.config.text_config.vocab_size, "tokenizer", len(proc.tokenizer),
          "greedy", e["greedy_ids"][0].tolist(), "beam3", e["beam3_ids"][0].tolist())
    return proc, model


def write_original(v: dict, model, proc, vocab_size: int, out: Path, vocab: dict, merges: list) -> None:
    """tiny-orig: tiny-a's weights (original vocabulary) in microsoft's
    layout, and the outputs of those weights computed as the original model
    does: image features in front of `<s> prompt </s>`."""
    out = fresh_dir(out)
    orig = to_original(model.state_dict(), vocab_size)
    save_file(orig, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", original_config(v, vocab_size))
    gen = {"_from_model_config": True, **GENERATION, "transformers_version": "4.41.0.dev0"}
    write_json(out / "generation_config.json", gen)
    size = v["image_size"]
    seq_len = proc.num_image_tokens
    write_json(out / "preprocessor_config.json", original_preprocessor(size, seq_len))
    # The original repos ship BART's tokenizer; their processor adds the
    # Florence-2 tokens at load time.
    base_tok = bart_tokenizer(vocab, merges)
    base_tok.save_pretrained(out)
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    for key in ["is_local", "local_files_only", "backend"]:
        tcfg.pop(key, None)
    tcfg["tokenizer_class"] = "BartTokenizer"
    tcfg["model_max_length"] = 1024
    write_json(out / "tokenizer_config.json", tcfg)
    test_image(size, size, v["seed"]).save(out / "image.png")
    test_image(75, 50, v["seed"] + 100).save(out / "other.png")

    # Read the file back through the inverse mapping into a transformers
    # model with the original vocabulary; `<unk>` stands in for the image
    # positions (their embeddings are replaced by the image features, so
    # the id is never looked up for them).
    back = Florence2ForConditionalGeneration._from_config(
        copy.deepcopy(model.config), attn_implementation="eager", dtype=torch.float32
    ).eval()
    names = list(back.state_dict().keys())
    stored = load_file(str(out / "model.safetensors"))
    read = {original_name(n) for n in names if n not in TIED_TO_SHARED}
    assert set(stored) == read | {"language_model.final_logits_bias"}, set(stored) ^ read
    missing, unexpected = back.load_state_dict(from_original(stored, names), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    assert back.model.language_model.config._attn_implementation == "eager"
    assert back.model.vision_tower.config._attn_implementation == "eager"
    back.generation_config = GenerationConfig(**GENERATION)
    for a, b in zip(model.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)
    e = compute_expected(back, proc, Image.open(out / "image.png"), Image.open(out / "other.png"), stand_in=UNK)
    n = seq_len
    for key in ["input_ids", "input_ids_od"]:
        assert e[key][0, :n].eq(UNK).all()
        e[key] = e[key][:, n:].contiguous()  # the original processor's ids
    # The original DaViT returns (batch, h*w, C).
    e["vision_features"] = e["vision_features"].flatten(2).transpose(1, 2).contiguous()
    save_expected(out, e, proc.tokenizer)
    print("tiny-orig vocab", vocab_size, "greedy", e["greedy_ids"][0].tolist())


# ---------------------------------------------------------------------------
# tasks.json


def locs(*bins: int) -> str:
    return "".join(f"<loc_{b}>" for b in bins)


# Crafted generated texts per post-processing family: (task, name, text).
# Texts are tokenized (no special tokens added) to give the sequences.
CASES = [
    # pure_text: <s> and </s> removed, then stripped; <pad> and <loc_*> kept.
    ("<CAPTION>", "caption", "</s><s>a red car parked in front of a yellow building</s>"),
    ("<CAPTION>", "bos_first_and_padding", "<s>two dogs play on the grass</s><pad><pad>"),
    ("<DETAILED_CAPTION>", "non_ascii_and_spaces", "</s><s>  a café, a cat  </s>"),
    ("<MORE_DETAILED_CAPTION>", "empty", "</s><s></s>"),
    ("<OCR>", "ocr_text", "</s><s>TOTAL DUE $1,250.00</s>"),
    ("<REGION_TO_CATEGORY>", "category_with_box", "</s><s>car" + locs(52, 333, 932, 774) + "</s>"),
    ("<REGION_TO_DESCRIPTION>", "description", "</s><s>a wheel of a car</s>"),
    ("<REGION_TO_OCR>", "region_ocr", "</s><s>INVOICE No. 2024-117</s>"),
    ("<UNKNOWN_TASK>", "unknown_task_is_pure_text", "</s><s>a blue square</s>"),
    # ocr: text then 8 bins; groups with fewer bins are dropped.
    ("<OCR_WITH_REGION>", "two_quads",
     "</s><s>TOTAL" + locs(10, 20, 300, 20, 300, 80, 10, 80) + "DUE $5" + locs(400, 500, 999, 500, 999, 600, 400, 600)
     + "</s>"),
    # A group of 7 bins does not end the lazy text match: the label keeps it.
    ("<OCR_WITH_REGION>", "seven_bins_and_tail",
     "</s><s>INVOICE" + locs(1, 2, 3, 4, 5, 6, 7) + "No." + locs(0, 0, 999, 0, 999, 999, 0, 999) + "left over</s>"),
    ("<OCR_WITH_REGION>", "padding_inside",
     "<s><pad>Page 3" + locs(100, 100, 200, 100, 200, 150, 100, 150) + "</s><pad>"),
    # description_with_bboxes: phrase then groups of 4 bins, one instance per box.
    ("<OD>", "three_phrases_one_with_two_boxes",
     "</s><s>car" + locs(54, 375, 906, 707) + "door" + locs(710, 276, 908, 537) + "wheel"
     + locs(708, 531, 906, 704) + locs(56, 540, 220, 700) + "</s>"),
    # The phrase pattern `[^<]+` may start inside a token: label "loc_4>dog".
    ("<OD>", "boxes_without_phrase_first", "<s>" + locs(1, 2, 3, 4) + "dog" + locs(100, 200, 300, 400) + "</s>"),
    ("<OD>", "five_bins_and_three_bins", "</s><s>cat" + locs(10, 20, 30, 40, 50) + "sun" + locs(7, 8, 9) + "</s>"),
    ("<DENSE_REGION_CAPTION>", "non_ascii_and_spaces_in_phrase",
     "</s><s> a café table " + locs(0, 0, 999, 999) + "a red car" + locs(500, 500, 600, 600) + "</s>"),
    # phrase_grounding: one instance per phrase with all its boxes; banned
    # phrases (exact, case-sensitive) dropped.
    ("<CAPTION_TO_PHRASE_GROUNDING>", "phrases",
     "</s><s>a red car" + locs(54, 375, 906, 707) + "a yellow building" + locs(0, 0, 999, 400)
     + locs(10, 10, 500, 300) + "</s>"),
    ("<CAPTION_TO_PHRASE_GROUNDING>", "banned_phrases",
     "</s><s>the image" + locs(0, 0, 999, 999) + "it" + locs(1, 1, 2, 2) + "a dog" + locs(100, 200, 300, 400)
     + "The Image" + locs(5, 6, 7, 8) + "</s>"),
    ("<CAPTION_TO_PHRASE_GROUNDING>", "no_text_before_boxes", "<s>" + locs(1, 2, 3, 4) + "</s>"),
    # polygons (empty phrases allowed): runs of bins split at <sep>, an odd
    # last coordinate dropped, <poly>...</poly> one instance each.
    ("<REFERRING_EXPRESSION_SEGMENTATION>", "two_polygons_odd_count",
     "</s><s>" + locs(100, 100, 200, 100, 200, 200) + "<sep>" + locs(300, 300, 400, 300, 400, 400, 350) + "</s>"),
    ("<REFERRING_EXPRESSION_SEGMENTATION>", "phrase_is_not_kept",
     "</s><s>a dog" + locs(10, 20, 30, 40, 50, 60, 70, 80) + "</s>"),
    ("<REGION_TO_SEGMENTATION>", "poly_instances",
     "</s><s><poly>" + locs(1, 2, 3, 4, 5, 6) + "</poly><poly>" + locs(10, 10, 20, 10, 20, 20) + "<sep>"
     + locs(30, 30, 40, 40) + "</poly></s>"),
    # One bin: an empty polygon; the label is what precedes the next <loc_.
    ("<REGION_TO_SEGMENTATION>", "single_bin_groups", "</s><s>" + locs(5) + "<sep>" + locs(6, 7, 8) + "<sep></s>"),
    ("<REGION_TO_SEGMENTATION>", "empty_poly_skipped",
     "</s><s><poly></poly><poly>" + locs(11, 12, 13, 14, 15, 16) + "</poly></s>"),
    # Nothing but <sep> after the first bin: no phrase match, no instance.
    ("<REFERRING_EXPRESSION_SEGMENTATION>", "separators_only", "</s><s>" + locs(1) + "<sep><sep><sep></s>"),
    # description_with_bboxes_or_polygons: boxes unless <poly> appears.
    ("<OPEN_VOCABULARY_DETECTION>", "boxes", "</s><s>a red car" + locs(54, 375, 906, 707) + "</s>"),
    ("<OPEN_VOCABULARY_DETECTION>", "polygons",
     "</s><s>a red car<poly>" + locs(54, 375, 906, 375, 906, 707, 54) + "</poly>a dog<poly>"
     + locs(1, 1, 2, 2, 3, 3) + "<sep>" + locs(4, 4, 5, 5) + "</poly></s>"),
    # bboxes (empty phrases allowed): labels empty.
    ("<REGION_PROPOSAL>", "three_boxes", "</s><s>" + locs(1, 2, 3, 4, 500, 500, 600, 600, 998, 997, 999, 999) + "</s>"),
    ("<REGION_PROPOSAL>", "text_is_ignored", "</s><s>car" + locs(10, 20, 30, 40) + "</s>"),
]

# An ocr config as Florence2PostProcessor reads it (upper-case keys), to
# reach the area filter. The area is the shoelace sum over the first three
# edges only (range(4 - 1)): the closing edge is left out.
AREA_CONFIG = {"ocr": {"PATTERN": OCR_PATTERN, "AREA_THRESHOLD": 0.01}}
AREA_CASES = [
    ("large_quad", "</s><s>BIG" + locs(100, 100, 900, 100, 900, 900, 100, 900) + "</s>"),
    ("small_quad", "</s><s>tiny" + locs(10, 10, 20, 10, 20, 20, 10, 20) + "</s>"),
    # Three-edge sum 0.5*|x0*y1-x1*y0 + x1*y2-x2*y1 + x2*y3-x3*y2| with the
    # quad placed so the missing closing edge decides.
    ("closing_edge_matters", "</s><s>skew" + locs(900, 900, 950, 900, 950, 950, 900, 950) + "</s>"),
]


def task_examples() -> dict:
    """An example --text input per task that takes one."""
    box = locs(52, 333, 932, 774)
    return {
        "<CAPTION_TO_PHRASE_GROUNDING>": "  a red car and a dog ",
        "<REFERRING_EXPRESSION_SEGMENTATION>": "a red car",
        "<REGION_TO_SEGMENTATION>": box,
        "<OPEN_VOCABULARY_DETECTION>": "a dog",
        "<REGION_TO_CATEGORY>": box,
        "<REGION_TO_DESCRIPTION>": box,
        "<REGION_TO_OCR>": box,
    }


def write_tasks(proc: Florence2Processor, image: Image.Image) -> None:
    tok = proc.tokenizer
    n = proc.num_image_tokens
    examples = task_examples()
    tasks = []
    for task, kind in proc.tasks_answer_post_processing_type.items():
        text_input = examples.get(task)
        text = task + text_input if text_input is not None else task
        prompt = proc._construct_prompts(text)[0]
        ids = proc(text=text, images=image).input_ids[0]
        assert ids[:n] == [proc.image_token_id] * n
        tasks.append({
            "task": task,
            "post_processing_type": kind,
            "text_input": text_input,
            "processor_text": text,
            "prompt": prompt,
            "input_ids": ids[n:],
        })
    assert len(tasks) == 15
    other_prompts = []
    for text in ["What is this?", "<OD>a dog"]:
        try:
            ids = proc(text=text, images=image).input_ids[0][n:]
            other_prompts.append({"processor_text": text, "prompt": proc._construct_prompts(text)[0],
                                  "input_ids": ids})
        except ValueError as err:
            other_prompts.append({"processor_text": text, "error": str(err)})

    cases = []
    for task, name, text in CASES:
        seq = tok(text, add_special_tokens=False).input_ids
        decoded = proc.batch_decode([seq], skip_special_tokens=False)[0]
        cases.append({
            "task": task,
            "name": name,
            "crafted": text,
            "sequence": seq,
            "text": decoded,
            "from_sequence": proc.post_process_generation(sequence=seq, task=task, image_size=POST_SIZE)[task],
            "from_text": proc.post_process_generation(text=decoded, task=task, image_size=POST_SIZE)[task],
        })
    post = Florence2PostProcessor(config=AREA_CONFIG, tokenizer=tok)
    area_cases = []
    for name, text in AREA_CASES:
        seq = tok(text, add_special_tokens=False).input_ids
        area_cases.append({
            "name": name,
            "sequence": seq,
            "ocr": post(sequence=seq, image_size=POST_SIZE, parse_tasks=["ocr"])["ocr"],
        })
    doc = {
        "about": "Florence2Processor prompts and post_process_generation results (transformers "
                 f"{transformers.__version__}), from tests/fixtures/florence2/tiny-a's processor. "
                 "tasks[].input_ids: the ids after the num_image_tokens image tokens the processor puts "
                 "first (<s> prompt </s>). cases[]: crafted generated sequences (tokenized without "
                 "special tokens added), text = batch_decode(sequence, skip_special_tokens=False), "
                 "from_sequence / from_text = post_process_generation(sequence= / text=, task, "
                 "image_size)[task]. image_size is (width, height). area_threshold: "
                 "Florence2PostProcessor's ocr parse with the upper-case config keys it reads (the "
                 "checkpoint's own keys are lower case and are not read).",
        "image_size": list(POST_SIZE),
        "num_image_tokens": n,
        "image_token_id": proc.image_token_id,
        "tasks": tasks,
        "other_prompts": other_prompts,
        "cases": cases,
        "area_threshold": {"config": AREA_CONFIG, "cases": area_cases},
    }
    write_json(OUT / "tasks.json", doc)


# ---------------------------------------------------------------------------
# Base-size checkpoint for the benchmarks

BASE_BART_VOCAB = 50265  # BART's; <mask> last
BASE_VOCAB = 51328  # the converted checkpoints' (51290 tokens padded to 64)
BASE_SIZE = 768


def base_tokenizer():
    """BART's layout at full size: the fixtures' BPE, filler tokens no
    merge reaches (`Ġw<i>`) up to 50264, `<mask>` 50264, the Florence-2
    tokens, `<image>` 51289, unused tokens up to 51327."""
    vocab, merges = train_bpe(300)
    del vocab[MASK]
    i = 0
    while len(vocab) < BASE_BART_VOCAB - 1:
        vocab.setdefault(f"\u0120w{i}", len(vocab))
        i += 1
    vocab[MASK] = BASE_BART_VOCAB - 1
    assert sorted(vocab.values()) == list(range(BASE_BART_VOCAB))
    unused = [f"<unused_{i}>" for i in range(BASE_VOCAB - BASE_BART_VOCAB - len(FLORENCE_TOKENS) - 1)]
    tok = florence_tokenizer(vocab, merges, extra=unused)
    assert tok.image_token_id == 51289 and len(tok) == BASE_VOCAB, (tok.image_token_id, len(tok))
    return tok


def write_base(out: Path) -> None:
    """A Florence-2-base-shaped checkpoint (random weights)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = base_tokenizer()
    side = BASE_SIZE // 32
    proc = florence_processor(tok, BASE_SIZE, 1 + side * side)
    torch.manual_seed(0)
    vision = Florence2VisionConfig(
        embed_dim=[128, 256, 512, 1024],
        depths=[1, 1, 9, 1],
        num_heads=[4, 8, 16, 32],
        num_groups=[4, 8, 16, 32],
        window_size=12,
        projection_dim=768,
    )
    text = BartConfig(
        vocab_size=BASE_VOCAB,
        d_model=768,
        encoder_layers=6,
        decoder_layers=6,
        encoder_attention_heads=12,
        decoder_attention_heads=12,
        encoder_ffn_dim=3072,
        decoder_ffn_dim=3072,
        max_position_embeddings=1024,
        scale_embedding=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=EOS,
        forced_eos_token_id=EOS,
    )
    cfg = Florence2Config(vision_config=vision.to_dict(), text_config=text.to_dict(),
                          image_token_id=tok.image_token_id, bos_token_id=BOS, eos_token_id=EOS,
                          pad_token_id=PAD)
    model = Florence2ForConditionalGeneration(cfg).eval()
    model.generation_config = GenerationConfig(**GENERATION)
    model.save_pretrained(out)
    save_hub_processor(proc, out)
    test_image(BASE_SIZE, BASE_SIZE, 0).save(out / "image.png")
    del model

    model = load_model(out)
    proc = AutoProcessor.from_pretrained(out)
    inputs = proc(text="<CAPTION>", images=Image.open(out / "image.png"), return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=4, num_beams=1, do_sample=False)
    print("Florence-2 base checkpoint in", out, "- input", tuple(inputs.input_ids.shape),
          "generated", ids[0].tolist())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path,
                    help="write only the Florence-2-base-shaped benchmark checkpoint, here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.base:
        torch.set_num_threads(2)
        write_base(args.base)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    vocab, merges = train_bpe(300)
    proc_a = None
    for name, v in VARIANTS.items():
        proc, _ = write_variant(name, v, vocab, merges)
        proc_a = proc_a or proc
    write_tasks(proc_a, Image.open(OUT / "tiny-a" / "image.png"))


if __name__ == "__main__":
    main()

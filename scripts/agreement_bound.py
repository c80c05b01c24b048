#!/usr/bin/env python3
"""How far `vl bench`'s "teacher-forced top-1 agreement with f32" can go on
a random-weight checkpoint, measured with transformers as an independent
reference.

`vl bench --dtype bf16` / `--quantize bf16|q8_0` compares the argmax over
the vocabulary of the reduced-precision model with the f32 model's at every
position of a teacher-forced pseudo-random token sequence. With random
weights the two largest logits are close (the median gap is a small
fraction of the logits' std), so any rounding of the weights or the
activations flips some argmaxes, whoever implements the model. This script
applies the same roundings to transformers' f32 model and counts the flips
with vl's definition of agreement, to tell how much of vl's figure is the
format itself and how much (if any) is vl.

The definition, as `agreement` in crates/vl-cli/src/bench.rs:

- n = min(--tokens, the decoder's max_position_embeddings) positions;
  ids[i] = ((i * 2654435761) >> 7) % vocab_size (unsigned 64-bit), one
  sequence, batch 1, fed exactly (no start token, no special tokens) as
  `decoder_input_ids` (VisionEncoderDecoderModel) or as the BLIP text
  decoder's `input_ids` under the image embeddings
  (`BlipForConditionalGeneration(pixel_values, input_ids)`).
- Florence-2 (`model_type` "florence2", transformers' converted layout:
  `Florence2ForConditionalGeneration`): n = min(--tokens, text_config's
  max_position_embeddings), vocab_size text_config's; the decoder reads
  what vl bench's `memory` gives it: BART's encoder over [image tokens;
  prompt], the `<CAPTION>` prompt as the processor writes it (`<image>` x
  image_seq_length, then `<s>What does the image describe?</s>`; the
  `<image>` positions take the projector's output). The sequence is fed as
  `decoder_input_ids` with the prompt as `input_ids`, logits compared at
  every position.
- agreement: the fraction of positions whose argmax (first index on ties)
  equals the f32 model's; margin: the median over positions of (largest
  logit - second largest) / the row's population std, for the f32 model.

Variants, each against the f32 model (same checkpoint, pixels, ids):

- `torch-bf16`: the whole model `.to(torch.bfloat16)`, pixels in bf16,
  logits cast to f32 (TrOCR's sinusoid table, a plain attribute that
  `.to` skips, is cast as well).
- `torch-bf16-f32-logits`: as `torch-bf16`, with the final norm and the
  LM head as vl runs them in a 16-bit decoder (`f32_logits`): the norm in
  f32, the head's products accumulated and written in f32. Florence-2's
  BART decoder has no final norm: only its `lm_head` changes (bf16 input
  and weights, f32 products and logits). torch runs DaViT's convolutions
  in bf16 here, where vl computes them in f32 on the CPU.
- `bf16-weights`: f32 model whose linear weights (every nn.Linear and
  GPT-2's Conv1D, in the vision encoder, the decoder and the LM head; not
  embeddings, the conv patch embedding, norms or biases) are rounded to
  bf16 (round to nearest even) and back. Florence-2: DaViT's qkv, proj,
  fc1 and fc2, the projector's image_projection, BART's encoder and
  decoder linear layers and `lm_head` (tied: the embedding stays f32), as
  vl converts them; not DaViT's patch and depth-wise convolutions.
- `bf16-weights+acts`: as `bf16-weights`, and each such layer's input
  activation rounded to bf16 as well (a forward pre-hook); everything
  else (residual stream, norms, attention, logits) in f32. The least
  rounding any model whose products take bf16 operands can have: the
  ceiling of `--dtype bf16`.
- `q8_0-weights`: the same weights through a ggml q8_0 round trip along
  the input dimension: per block of 32, d = max|w| / 127, q = roundf(w *
  (1/d)) (half away from zero, as ggml's and candle's reference code),
  w' = f16(d) * q. A layer whose input width is not a multiple of 32
  stays dense (listed on stderr). A tied LM head gets its own copy; the
  embedding stays f32.
- `q8_0-weights+acts`: as `q8_0-weights`, and each such layer's input
  activation also goes through the q8_0 round trip along its last
  dimension (ggml quantizes the activation row to q8_0, with an f16 scale,
  before the integer dot product): a forward pre-hook.
- `q8_0-best-scale-weights`: still the q8_0 format, but each block's
  scale chosen to minimise the block's squared error (d = s * max|w| /
  127 for 31 values of s in [0.85, 1], rounded to f16, values rounded to
  nearest within ±127) instead of ggml's max|w| / 127: whether a smarter
  q8_0 quantizer than ggml's and candle's would agree more.
- `q8_0-weights-vision`, `q8_0-weights-decoder`, `q8_0-weights-head`: the
  q8_0 round trip on one part of the model alone (the vision encoder's
  linear layers; the text decoder's, LM head excluded; the LM head),
  the rest f32: where the flips come from. Florence-2's parts: vision =
  `model.vision_tower` and `model.multi_modal_projector`; a fourth row,
  `q8_0-weights-text-encoder`, `model.language_model.encoder`; decoder =
  `model.language_model.decoder`; head = `lm_head`.
- `q4k-weights` (unless --skip-q4k): the linear weights (input widths a
  multiple of 256) through candle's own q4_K round trip, exactly the
  weights `vl --quantize q4k` multiplies by: `examples/ggml_roundtrip.rs`
  (built first: `cargo build --release --example ggml_roundtrip`) quantizes
  them with `QTensor::quantize` and dequantizes them.
- `q4k-weights+acts`: as `q4k-weights`, and each such layer's input
  activation through the q8_0 round trip (candle multiplies q4_K weights
  by activations rounded to q8_K, 8 bits per block of 256 with an f32
  scale: finer than q8_0's, so this row rounds them at least as much).
- `f64-dense`, `f64-q8_0-weights` (unless --skip-f64): the model in
  float64, dense and with the q8_0 weights: the first shows the f32
  rounding noise alone, the second that the q8_0 figure does not come from
  f32 arithmetic.

Each row also gives the median over positions of rms(logits - f32
logits) / std(f32 logits): the noise that the margins have to beat.

Pixels: DIR/image.png through the checkpoint's own image processor
(`AutoImageProcessor`, `BlipProcessor` for BLIP, Florence-2's
`AutoProcessor`), as scripts/check_generate.py; `--pixels synthetic` uses
vl bench's image instead (arange(3*s*s) * (1/(3*s*s)) - 0.5, reshaped to
1x3xsxs; Florence-2's s is its image processor's size, from
preprocessor_config.json or processor_config.json's `image_processor`),
the one behind vl's printed figures.

One forward pass per variant; tables (markdown) on stdout, all figures as
JSON in scripts/out/agreement_bound.json (`--out`). Deterministic (no
sampling; seed 0 anyway), `--threads` torch threads (default 1).

    /work/venv/bin/python scripts/agreement_bound.py /tmp/vit-gpt2-base /tmp/trocr-base /tmp/blip-base
    /work/venv/bin/python scripts/agreement_bound.py /tmp/florence2-base --pixels synthetic \
        --out scripts/out/agreement_bound_florence2.json

Needs torch, transformers, pillow (e.g. /work/venv); checkpoints from
scripts/hf_fixtures.py, trocr_fixtures.py, blip_fixtures.py,
florence2_fixtures.py `--base DIR`.
"""

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image
from transformers.pytorch_utils import Conv1D
from transformers.utils import logging as hf_logging

from check_generate import load_model

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 32


def token_ids(n: int, vocab: int) -> torch.Tensor:
    """vl bench's teacher-forced sequence (u64 arithmetic; Python ints are
    exact and the products stay below 2^64 for any n here)."""
    return torch.tensor([[((i * 2654435761) >> 7) % vocab for i in range(n)]], dtype=torch.long)


def roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: to nearest, halves away from zero (torch.round goes to
    even), exactly."""
    r = torch.round(v)
    t = torch.trunc(v)
    half = (v - t).abs() == 0.5
    return torch.where(half, t + torch.sign(v), r)


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """ggml's q8_0 round trip along the last dimension (a multiple of 32),
    computed in f32 as ggml does; returned in x's dtype."""
    b = x.float().reshape(-1, BLOCK)
    d = b.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = roundf(b * inv)
    return (q * d.half().float()).reshape(x.shape).to(x.dtype)


def q8_0_best_scale(x: torch.Tensor) -> torch.Tensor:
    """The q8_0 round trip with each block's scale the one of 31
    candidates s * max|w| / 127, s in [0.85, 1], whose f16-rounded value
    gives the least squared error (values rounded to nearest, within
    ±127); returned in x's dtype."""
    b = x.float().reshape(-1, BLOCK)
    amax = b.abs().amax(dim=1, keepdim=True)
    best, best_err = None, None
    for s in torch.linspace(0.85, 1.0, 31):
        d = (amax / 127 * s).half().float()
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        w = torch.clamp(roundf(b * inv), -127, 127) * d
        err = (w - b).pow(2).sum(dim=1, keepdim=True)
        if best is None:
            best, best_err = w, err
        else:
            better = err < best_err
            best = torch.where(better, w, best)
            best_err = torch.where(better, err, best_err)
    return best.reshape(x.shape).to(x.dtype)


# Florence-2's linear layers by part, by module prefix: the vision side
# (DaViT's qkv/proj/fc1/fc2 and the projector's image_projection), BART's
# text encoder, its decoder. The LM head (`lm_head`) is its own part.
FLORENCE_PARTS = {
    "model.vision_tower.": "vision",
    "model.multi_modal_projector.": "vision",
    "model.language_model.encoder.": "text-encoder",
    "model.language_model.decoder.": "decoder",
}


def model_parts(model, layers: list, family: str) -> dict:
    """The linear layers split into the vision encoder's, (Florence-2) the
    text encoder's, the text decoder's (LM head excluded) and the LM
    head."""
    head = model.get_output_embeddings()
    if head is None:  # BLIP
        head = model.text_decoder.get_output_embeddings()
    if family == "florence2":
        parts = {"vision": [], "text-encoder": [], "decoder": [], "head": []}
        for layer in layers:
            name, m, _ = layer
            if m is head:
                parts["head"].append(layer)
                continue
            key = next((v for k, v in FLORENCE_PARTS.items() if name.startswith(k)), None)
            if key is None:
                sys.exit(f"{name}: a linear layer of no known Florence-2 part")
            parts[key].append(layer)
        return parts
    vision = "vision_model." if family == "blip" else "encoder."
    parts = {"vision": [], "decoder": [], "head": []}
    for layer in layers:
        name, m, _ = layer
        key = "head" if m is head else "vision" if name.startswith(vision) else "decoder"
        parts[key].append(layer)
    return parts


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def linear_layers(model: torch.nn.Module) -> list:
    """(name, module, input width) of every linear layer: nn.Linear
    (weight [out, in]) and GPT-2's Conv1D (weight [in, out])."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            out.append((name, m, m.weight.shape[1]))
        elif isinstance(m, Conv1D):
            out.append((name, m, m.weight.shape[0]))
    return out


def input_last(m, w: torch.Tensor) -> torch.Tensor:
    """A layer's weight with the input dimension last (GPT-2's Conv1D
    stores [in, out], nn.Linear [out, in]), or such a weight back in the
    layer's own layout: the same transpose either way."""
    return w.t() if isinstance(m, Conv1D) else w


@contextlib.contextmanager
def weights_from(layers: list, new: dict):
    """Replaces the weight of each layer named in `new` by a Parameter of
    new[name]; restores the originals (ties included) on exit."""
    saved = []
    try:
        for name, m, _ in layers:
            if name in new:
                saved.append((m, m.weight))
                m.weight = torch.nn.Parameter(new[name].contiguous(), requires_grad=False)
        yield
    finally:
        for m, p in saved:
            m.weight = p


@contextlib.contextmanager
def transformed_weights(layers: list, f, blocked: bool):
    """Replaces each layer's weight by f(weight), f applied along the input
    dimension, for the time of the `with` (see `weights_from`). `blocked`:
    skip layers whose input width is not a multiple of 32."""
    new = {name: input_last(m, f(input_last(m, m.weight.data)))
           for name, m, width in layers if not (blocked and width % BLOCK)}
    with weights_from(layers, new):
        yield


def ggml_round_trip(layers: list, fmt: str, block: int) -> dict:
    """{layer name: its weight (in its own layout) rounded by candle's
    `fmt` round trip along the input dimension}, by examples/ggml_roundtrip
    (release build); layers whose input width is not a multiple of `block`
    are left out."""
    from safetensors.torch import load_file, save_file
    exe = ROOT / "target" / "release" / "examples" / "ggml_roundtrip"
    if not exe.exists():
        sys.exit(f"{exe} is missing: cargo build --release --example ggml_roundtrip")
    rows = {name: input_last(m, m.weight.data).contiguous().clone()
            for name, m, width in layers if width % block == 0}
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.safetensors", Path(tmp) / "out.safetensors"
        save_file(rows, str(src))
        subprocess.run([str(exe), str(src), str(dst), fmt], check=True)
        out = load_file(str(dst))
    return {name: input_last(m, out[name]) for name, m, width in layers if name in out}


@contextlib.contextmanager
def rounded_inputs(layers: list, f, blocked: bool):
    """f applied to every layer's input activation (a forward pre-hook);
    `blocked`: only layers whose input width is a multiple of 32."""
    hooks = []
    try:
        for name, m, width in layers:
            if not blocked or width % BLOCK == 0:
                hooks.append(m.register_forward_pre_hook(lambda _m, a: (f(a[0]),) + a[1:]))
        yield
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def f32_logits(model):
    """A bf16 model's logits as vl computes them for a 16-bit decoder
    (`VisionLanguageDecoder::logits`): the last hidden state widened to
    f32 before the final norm (GPT-2's `ln_f`; TrOCR and BLIP have none),
    the LM head's input rounded to bf16 as vl's many-row bf16 GEMM does,
    the products accumulated in f32 and the logits left in f32. Florence-2
    (BART) has no final norm either: its `lm_head` alone."""
    head = model.get_output_embeddings()
    if head is None:  # BLIP
        head = model.text_decoder.get_output_embeddings()
    norms = [m for name, m in model.named_modules() if name.endswith("transformer.ln_f")]
    saved = [(head, head.forward)] + [(m, m.forward) for m in norms]

    def head_forward(x):
        b = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(x.bfloat16().float(), head.weight.float(), b)

    def norm_forward(m):
        return lambda x: torch.nn.functional.layer_norm(
            x.float(), m.normalized_shape, m.weight.float(), m.bias.float(), m.eps)

    try:
        head.forward = head_forward
        for m in norms:
            m.forward = norm_forward(m)
        yield
    finally:
        for m, f in saved:
            m.forward = f


def synthetic_pixels(side) -> torch.Tensor:
    """vl bench's image: arange(3*h*w) * (1/(3*h*w)) - 0.5 in f32, 1x3xhxw;
    `side` is an int (square) or transformers' [height, width] (Swin's
    image_size in Donut and Nougat)."""
    h, w = (side, side) if isinstance(side, int) else side
    n = 3 * h * w
    step = torch.tensor(1.0 / n, dtype=torch.float32)
    return (torch.arange(n, dtype=torch.float32) * step - 0.5).reshape(1, 3, h, w)


def load_florence2(d: Path, pixels_from: str):
    """A Florence-2 checkpoint (transformers' layout): the f32
    Florence2ForConditionalGeneration, its pixel values, and the encoder's
    input ids: the processor's `<CAPTION>` prompt, `<image>` x
    image_seq_length then `<s>What does the image describe?</s>` (the ids
    vl bench's `memory` encodes with the image tokens)."""
    from transformers import AutoProcessor, Florence2ForConditionalGeneration
    cfg = json.loads((d / "config.json").read_text())
    if "auto_map" in cfg or cfg.get("vision_config", {}).get("model_type") == "davit":
        sys.exit(f"{d}: microsoft's original Florence-2 layout; transformers' "
                 "Florence2ForConditionalGeneration reads the converted one")
    model = Florence2ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(d)
    size = processor.image_processor.size
    side = size["height"]
    if size["width"] != side:
        sys.exit(f"{d}: image size {size}: vl bench's image is square")
    if pixels_from == "image":
        img = Image.open(d / "image.png").convert("RGB")
    else:
        img = Image.new("RGB", (side, side))  # for the prompt ids only
    enc = processor(text="<CAPTION>", images=img, return_tensors="pt")
    pixels = enc["pixel_values"].float() if pixels_from == "image" else synthetic_pixels(side)
    return model, pixels, enc["input_ids"]


def load(d: Path, pixels_from: str):
    """The f32 model, its pixel values, its family ("blip",
    "vision-encoder-decoder" or "florence2"), the decoder's vocab size and
    max positions, and (Florence-2) the text encoder's input ids."""
    if json.loads((d / "config.json").read_text()).get("model_type") == "florence2":
        model, pixels, prompt = load_florence2(d, pixels_from)
        dec = model.config.text_config
        return model, pixels, "florence2", dec.vocab_size, dec.max_position_embeddings, prompt
    model, processor, blip = load_model(d)
    if blip:
        dec = model.config.text_config
        side = model.config.vision_config.image_size
    else:
        dec = model.config.decoder
        side = model.config.encoder.image_size
    if pixels_from == "image":
        img = Image.open(d / "image.png").convert("RGB")
        pixels = processor(images=img, return_tensors="pt")["pixel_values"].float()
    else:
        pixels = synthetic_pixels(side)
    family = "blip" if blip else "vision-encoder-decoder"
    return model, pixels, family, dec.vocab_size, dec.max_position_embeddings, None


def cast_sinusoids(model, dtype) -> None:
    """TrOCR's sinusoid table is a plain attribute: `.to(dtype)` skips it.
    (Florence-2's only table, the projector's temporal cosine embedding, is
    a buffer.)"""
    if getattr(model.config, "model_type", None) in ("blip", "florence2"):
        return
    if model.decoder.config.model_type != "trocr":
        return
    pos = model.decoder.model.decoder.embed_positions
    if getattr(pos, "weights", None) is not None:
        pos.weights = pos.weights.to(dtype)


def logits_of(model, pixels, ids, family: str, prompt=None) -> torch.Tensor:
    """[n, vocab] teacher-forced logits, in the model's dtype. Florence-2:
    `prompt` (the `<CAPTION>` ids) is the text encoder's input, its
    `<image>` tokens replaced by the image features, and `ids` the
    decoder's."""
    with torch.inference_mode():
        if family == "blip":
            out = model(pixel_values=pixels, input_ids=ids)
        elif family == "florence2":
            out = model(input_ids=prompt, pixel_values=pixels, decoder_input_ids=ids, use_cache=False)
        else:
            out = model(pixel_values=pixels, decoder_input_ids=ids, use_cache=False)
    return out.logits[0]


def margins(logits: torch.Tensor) -> torch.Tensor:
    """(largest - second largest) / population std, per row."""
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) / logits.std(dim=-1, unbiased=False)


def median(t: torch.Tensor) -> float:
    """The upper median, as vl bench's (xs[len / 2] of the sorted values)."""
    s = t.flatten().sort().values
    return float(s[len(s) // 2])


def measure(d: Path, args) -> dict:
    t0 = time.perf_counter()
    model, pixels, family, vocab, max_pos, prompt = load(d, args.pixels)
    n = min(args.tokens, max_pos)
    ids = token_ids(n, vocab)
    layers = linear_layers(model)
    dense_layers = [(name, w) for name, _, w in layers if w % BLOCK]
    for name, w in dense_layers:
        print(f"{d}: {name} (input width {w}) stays dense under q8_0", file=sys.stderr)

    ref = logits_of(model, pixels, ids, family, prompt).float()
    ref64 = ref.double()
    ref_top = ref.argmax(dim=-1)
    ref_std = ref64.std(dim=-1, unbiased=False)
    margin = margins(ref64)
    rows = {}

    def record(name, logits, secs):
        top = logits.argmax(dim=-1)  # in the variant's own dtype (bf16 cast to f32)
        err = ((logits.double() - ref64).pow(2).mean(dim=-1).sqrt() / ref_std)
        same = (top == ref_top)
        rows[name] = dict(
            agreement=float(same.double().mean()),
            disagreements=int((~same).sum()),
            median_logit_err_in_std=median(err),
            # how decided the flipped positions were in the reference
            median_ref_margin_at_flips=median(margin[~same]) if (~same).any() else None,
            seconds=secs,
        )
        print(f"  {d.name} {name}: agreement {rows[name]['agreement']:.4f} "
              f"({time.perf_counter() - t0:.0f} s in)", file=sys.stderr, flush=True)

    def run(name, dtype=torch.float32, f64=False):
        t = time.perf_counter()
        px = pixels.to(dtype)
        out = logits_of(model, px, ids, family, prompt)
        record(name, out.double() if f64 else out.float(), time.perf_counter() - t)

    with transformed_weights(layers, bf16, blocked=False):
        run("bf16-weights")
        with rounded_inputs(layers, bf16, blocked=False):
            run("bf16-weights+acts")
    with transformed_weights(layers, q8_0, blocked=True):
        run("q8_0-weights")
        with rounded_inputs(layers, q8_0, blocked=True):
            run("q8_0-weights+acts")
    with transformed_weights(layers, q8_0_best_scale, blocked=True):
        run("q8_0-best-scale-weights")
    for part, part_layers in model_parts(model, layers, family).items():
        with transformed_weights(part_layers, q8_0, blocked=True):
            run(f"q8_0-weights-{part}")
    if not args.skip_q4k:
        with weights_from(layers, ggml_round_trip(layers, "q4k", 256)):
            run("q4k-weights")
            with rounded_inputs([l for l in layers if l[2] % 256 == 0], q8_0, blocked=True):
                run("q4k-weights+acts")
    if not args.skip_f64:
        model.double()
        cast_sinusoids(model, torch.float64)
        run("f64-dense", torch.float64, f64=True)
        # the original f32 weights are exact in f64: .float() recovers them
        with transformed_weights(layers, lambda w: q8_0(w.float()).double(), blocked=True):
            run("f64-q8_0-weights", torch.float64, f64=True)
        model.float()
        cast_sinusoids(model, torch.float32)
    model.to(torch.bfloat16)
    cast_sinusoids(model, torch.bfloat16)
    run("torch-bf16", torch.bfloat16)
    with f32_logits(model):
        run("torch-bf16-f32-logits", torch.bfloat16)
    # the table's order
    order = ["torch-bf16", "torch-bf16-f32-logits", "bf16-weights", "bf16-weights+acts", "q8_0-weights", "q8_0-weights+acts",
             "q8_0-best-scale-weights", "q8_0-weights-vision", "q8_0-weights-text-encoder",
             "q8_0-weights-decoder", "q8_0-weights-head",
             "q4k-weights", "q4k-weights+acts", "f64-dense", "f64-q8_0-weights"]
    rows = {k: rows[k] for k in order if k in rows}
    del model
    return dict(
        model=str(d), family=family,
        pixels=args.pixels, tokens=n, vocab_size=vocab,
        f32_median_margin_in_std=median(margin),
        f32_margin_quantiles={str(q): float(margin.quantile(q)) for q in (0.1, 0.25, 0.5, 0.75, 0.9)},
        linear_layers=len(layers),
        dense_under_q8_0=[name for name, _ in dense_layers],
        variants=rows,
        seconds=time.perf_counter() - t0,
    )


def table(r: dict) -> str:
    head = (f"### {r['model']} ({r['family']}, {r['pixels']} pixels, {r['tokens']} tokens; "
            f"f32 median top-1 margin {r['f32_median_margin_in_std']:.4f} logit std)\n\n"
            "| variant | agreement | flips | median logit err / std | median f32 margin at flips |\n"
            "|---|---|---|---|---|\n")
    lines = []
    for name, v in r["variants"].items():
        at = v["median_ref_margin_at_flips"]
        lines.append(f"| {name} | {v['agreement']:.4f} | {v['disagreements']} | "
                     f"{v['median_logit_err_in_std']:.5f} | {'-' if at is None else f'{at:.4f}'} |")
    return head + "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pixels", choices=["image", "synthetic"], default="image",
                    help="DIR/image.png through the checkpoint's processor (default), or vl bench's image")
    ap.add_argument("--skip-f64", action="store_true", help="skip the float64 rows")
    ap.add_argument("--skip-q4k", action="store_true",
                    help="skip the q4k rows (which need examples/ggml_roundtrip built)")
    ap.add_argument("--out", type=Path, default=ROOT / "scripts" / "out" / "agreement_bound.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    results = []
    for d in args.dirs:
        r = measure(d, args)
        results.append(r)
        print(table(r), flush=True)
    total = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        results=results, threads=args.threads, seconds=total,
        torch=torch.__version__, transformers=__import__("transformers").__version__,
    ), indent=2) + "\n")
    print(f"{total:.0f} s; figures: {args.out}")


if __name__ == "__main__":
    main()

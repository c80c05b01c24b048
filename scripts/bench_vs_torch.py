#!/usr/bin/env python3
"""vl next to transformers on one checkpoint, in one run: prints a table of
ratios (vl / torch; below 1 means vl is faster or smaller) and writes the raw
figures as JSON.

Three families, told apart by DIR/config.json: `model_type` "blip" runs
transformers' BlipForConditionalGeneration, anything else a
VisionEncoderDecoderModel (ViT + GPT-2, ViT/DeiT + TrOCR). The vl side is
`vl bench --model DIR` whatever the family. Base-size random checkpoints
(never committed):

    python3 -m venv .venv && .venv/bin/pip install torch transformers tokenizers safetensors pillow
    cargo build --release -p vl-cli && cargo build --release --example bench_attention
    # ViT-B/16 224 + GPT-2 small (~1 GB; also rewrites tests/fixtures/hf: `git checkout tests/fixtures`)
    .venv/bin/python scripts/hf_fixtures.py --base /tmp/vit-gpt2-base
    .venv/bin/python scripts/bench_vs_torch.py /tmp/vit-gpt2-base --threads 2
    # TrOCR-base shape: ViT-B/16 384 + 1024-wide TrOCR decoder (~1.3 GB)
    .venv/bin/python scripts/trocr_fixtures.py --base /tmp/trocr-base
    .venv/bin/python scripts/bench_vs_torch.py /tmp/trocr-base --threads 2 --skip-attention
    # BLIP-base captioner shape: ViT-B/16 384 + BERT-base decoder (~0.9 GB)
    .venv/bin/python scripts/blip_fixtures.py --base /tmp/blip-base
    .venv/bin/python scripts/bench_vs_torch.py /tmp/blip-base --threads 2 --skip-attention

    # Florence-2-base shape: DaViT 768x768 + BART-base encoder and decoder (~0.9 GB)
    .venv/bin/python scripts/florence2_fixtures.py --base /tmp/florence2-base
    .venv/bin/python scripts/bench_vs_torch.py /tmp/florence2-base --threads 2 --skip-attention

For Florence-2 (`model_type` "florence2", transformers'
Florence2ForConditionalGeneration) "encode" is the vision tower, the
projector and the BART encoder over the image tokens and the `<CAPTION>`
prompt (what the decoder reads), and the caption rows are `<CAPTION>`
with 20 new tokens, greedy and with 3 beams (the checkpoints' default).

The attention rows do not depend on the checkpoint: run them once (with the
vit-gpt2 run) and pass `--skip-attention` to the others. `--configs` limits
a run to some columns, e.g. `--configs torch-bf16,vl-q8_0,vl-bf16-q8_0`.

What is timed, on both sides, from a fixed synthetic image at the model's
input size, with 16 new tokens:
- encode ms: the vision tower alone (`model.encoder`, or BLIP's
  `model.vision_model`).
- decode ms/token: (generate k=17 tokens - generate k=1 token) / 16,
  greedy, `min_new_tokens` = `max_new_tokens` = k so the end token never
  stops it early (the script checks the generated length). For the
  vision-encoder-decoder both generations start from the same encoder
  outputs; BLIP's `generate` takes pixel values only, so both of its
  generations include one encode, which the difference cancels.
- caption ms: generate 16 tokens from pixel values (encode included).
- images/s: the same for a batch of `--batch` copies of the image.

- with `--positions 100,1000,3000`: ms/token at each cached text length:
  on the torch side the 8 greedy steps after the first new token past a
  prefix of P start tokens, timed inside one generate (a stopping
  criterion stamps each token; one warm-up, median of up to 3), as
  `vl bench --positions` times 8 steps after the same prefix.
- with `--caption-tokens N`: the caption row is N tokens on both sides
  (e.g. 1000 for a Nougat page; past 64 the torch side times one run).

Every measurement runs in its own process (one model at a time, a fresh
peak-RSS counter), with the same number of threads on both sides.

ONNX Runtime on the same checkpoint (f32 and dynamic int8, optimum's export,
timed the same way under the same JSON keys): `scripts/bench_ort.py`, in its
own venv (see its docstring).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 16
# Greedy steps timed after a prefix, per position of --positions (as vl bench).
STEPS_AFTER_PREFIX = 8
# Column ids (for --configs), their labels, and vl bench's flags.
TORCH_CONFIGS = {"torch-f32": ("torch f32", "f32"), "torch-bf16": ("torch bf16", "bf16")}
VL_CONFIGS = {
    "vl-f32": ("vl f32", ["--dtype", "f32"]),
    "vl-bf16": ("vl bf16", ["--dtype", "bf16"]),
    "vl-bf16w": ("vl bf16 weights", ["--quantize", "bf16"]),
    "vl-q8_0": ("vl q8_0", ["--quantize", "q8_0"]),
    "vl-q4k": ("vl q4k", ["--quantize", "q4k"]),
    "vl-bf16-q8_0": ("vl bf16 + q8_0", ["--dtype", "bf16", "--quantize", "q8_0"]),
    # q8_0 weights with the text cache kept in f32 (`vl q8_0` keeps it in
    # bf16, as it keeps the image's keys and values): what the 16-bit cache
    # saves, longer outputs most.
    "vl-q8_0-kv32": ("vl q8_0 + f32 cache", ["--quantize", "q8_0", "--text-cache", "f32"]),
}
ALL_CONFIGS = list(TORCH_CONFIGS) + list(VL_CONFIGS)


def model_type(model_dir: str) -> str:
    return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", "")


def is_blip(model_dir: str) -> bool:
    return model_type(model_dir) == "blip"


# Florence-2's caption rows: new tokens, and the beams of its checkpoints.
FLORENCE_TOKENS = 20
FLORENCE_BEAMS = 3


def timings(f, reps: int) -> list:
    """Milliseconds of `reps` calls of `f`, after one untimed warm-up."""
    f()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def florence_worker(model_dir: str, dtype: str, repeats: int) -> dict:
    """transformers' Florence2ForConditionalGeneration, timed as vl bench
    times a Florence-2 model."""
    import resource

    import torch
    from transformers import AutoProcessor, Florence2ForConditionalGeneration

    torch.manual_seed(0)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    t0 = time.perf_counter()
    model = Florence2ForConditionalGeneration.from_pretrained(model_dir, dtype=dt).eval()
    load_ms = (time.perf_counter() - t0) * 1e3
    processor = AutoProcessor.from_pretrained(model_dir)
    side = processor.image_processor.size["height"]
    n = 3 * side * side
    pixels = (torch.arange(n, dtype=torch.float32) / n - 0.5).reshape(1, 3, side, side).to(dt)
    prompt = processor(text="<CAPTION>", images=torch.zeros(3, side, side, dtype=torch.uint8),
                       return_tensors="pt")
    input_ids, attention = prompt["input_ids"], prompt["attention_mask"]
    # Lengths exact: no end token, no forced tokens or n-gram bans.
    fixed = dict(do_sample=False, eos_token_id=None, forced_eos_token_id=None,
                 forced_bos_token_id=None, no_repeat_ngram_size=0, early_stopping=False)

    def timed(f, reps=repeats):
        return statistics.median(timings(f, reps))

    def encode():
        feats = model.get_image_features(pixel_values=pixels).pooler_output
        emb = model.get_input_embeddings()(input_ids)
        mask = (input_ids == model.config.image_token_id).unsqueeze(-1)
        emb = emb.masked_scatter(mask, feats.to(emb.dtype))
        return model.model.language_model.encoder(inputs_embeds=emb, attention_mask=attention)

    with torch.inference_mode():
        encode_ms = timed(encode)
        enc = encode()

        def gen_n(k, beams=1, from_pixels=False):
            kw = dict(max_new_tokens=k, min_new_tokens=k, num_beams=beams, **fixed)
            if from_pixels:
                return model.generate(input_ids=input_ids, pixel_values=pixels,
                                      attention_mask=attention, **kw)
            return model.generate(input_ids=input_ids, attention_mask=attention,
                                  encoder_outputs=enc, **kw)

        for k, beams, px in [(1, 1, False), (NEW_TOKENS + 1, 1, False),
                             (FLORENCE_TOKENS, 1, True), (FLORENCE_TOKENS, FLORENCE_BEAMS, True)]:
            shape = tuple(gen_n(k, beams, px).shape)
            assert shape == (1, 1 + k), f"generate gave {shape}, want {(1, 1 + k)}"
        one = timed(lambda: gen_n(1))
        many = timed(lambda: gen_n(NEW_TOKENS + 1))
        ms_per_token = (many - one) / NEW_TOKENS
        e2e_ms = timed(lambda: gen_n(FLORENCE_TOKENS, from_pixels=True))
        # As many runs as `vl bench` times its beam caption.
        e2e_beam_ms = timed(lambda: gen_n(FLORENCE_TOKENS, FLORENCE_BEAMS, True),
                            reps=max(1, (repeats + 1) // 2))
    weights = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dict(
        side="torch", family="florence2", dtype=dtype, load_ms=load_ms, encode_ms=encode_ms,
        ms_per_token=ms_per_token, e2e_ms=e2e_ms, e2e_beam_ms=e2e_beam_ms,
        peak_rss_mb=rss, weights_mb=weights, rss_over_weights=rss / weights,
        torch=torch.__version__, threads=torch.get_num_threads(),
    )


def torch_worker(model_dir: str, dtype: str, repeats: int, batch: int,
                 positions=(), caption_tokens: int = 0) -> dict:
    """transformers' model timed as `vl bench` times vl's: `positions`
    adds ms/token after each prefix length, `caption_tokens` the caption's
    length (default NEW_TOKENS)."""
    import resource

    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    torch.manual_seed(0)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    blip = is_blip(model_dir)
    if blip:
        from transformers import BlipForConditionalGeneration as Model
    else:
        from transformers import VisionEncoderDecoderModel as Model
    t0 = time.perf_counter()
    model = Model.from_pretrained(model_dir, dtype=dt).eval()
    load_ms = (time.perf_counter() - t0) * 1e3
    if blip:
        side = model.config.vision_config.image_size
        encoder = model.vision_model
        # BLIP's generate passes its own eos (sep_token_id) and pad to the
        # text decoder (a second eos_token_id would be a duplicate keyword):
        # min_new_tokens alone keeps the end token out.
        gen = dict(do_sample=False, num_beams=1)
    else:
        side = model.config.encoder.image_size
        encoder = model.encoder
        gen = dict(do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0)
    # A square side, or Swin's [height, width] (Donut, Nougat).
    h, w = (side, side) if isinstance(side, int) else tuple(side)
    n = 3 * h * w
    pixels = (torch.arange(n, dtype=torch.float32) / n - 0.5).reshape(1, 3, h, w).to(dt)

    def timed(f, reps=repeats):
        return statistics.median(timings(f, reps))

    with torch.inference_mode():
        encode_ms = timed(lambda: encoder(pixel_values=pixels))
        enc = encoder(pixel_values=pixels)

        def gen_n(k, px=None, e=enc):
            """k new tokens, exactly: from pixels (px), else from the encoder
            outputs e (BLIP: from pixels always, its generate's only input)."""
            kw = dict(max_new_tokens=k, min_new_tokens=k, **gen)
            if blip:
                return model.generate(pixel_values=pixels if px is None else px, **kw)
            if px is not None:
                return model.generate(px, **kw)
            return model.generate(encoder_outputs=e, **kw)

        # Every sequence is the start token plus exactly k new tokens.
        for k, px in [(1, None), (NEW_TOKENS + 1, None), (NEW_TOKENS, pixels),
                      (2, pixels.repeat(2, 1, 1, 1))]:
            shape = tuple(gen_n(k, px=px).shape)
            want = (1 if px is None else px.shape[0], 1 + k)
            assert shape == want, f"generate gave {shape}, want {want}"
        one = timed(lambda: gen_n(1))
        many = timed(lambda: gen_n(NEW_TOKENS + 1))
        ms_per_token = (many - one) / NEW_TOKENS
        caption_tokens = caption_tokens or NEW_TOKENS
        e2e_ms = timed(lambda: gen_n(caption_tokens, px=pixels),
                       reps=repeats if caption_tokens <= 64 else 1)
        at = {}
        if positions:
            if blip:
                sys.exit("--positions: BLIP's generate takes no decoder prefix")
            dcfg = model.config.decoder
            limit = getattr(dcfg, "max_position_embeddings", None) or getattr(dcfg, "n_positions")
            start = model.config.decoder_start_token_id
            for p in positions:
                if p < 1 or p + STEPS_AFTER_PREFIX + 1 > limit:
                    sys.exit(f"--positions: {p} is past the decoder's {limit} positions")
                prefix = torch.full((1, p), start, dtype=torch.long)

                def steps(prefix=prefix):
                    """ms per step of the STEPS_AFTER_PREFIX steps after the
                    first new token, timed inside one generate: a stopping
                    criterion sees each new token as it comes, so the
                    prefix's prefill (seconds at P = 3000, and as noisy)
                    is not in the figure."""
                    stamps = []

                    class Stamp(StoppingCriteria):
                        def __call__(self, input_ids, scores, **kwargs):
                            stamps.append(time.perf_counter())
                            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

                    k = STEPS_AFTER_PREFIX + 1
                    out = model.generate(encoder_outputs=enc, decoder_input_ids=prefix,
                                         max_new_tokens=k, min_new_tokens=k,
                                         stopping_criteria=StoppingCriteriaList([Stamp()]), **gen)
                    assert out.shape == (1, prefix.shape[1] + k), out.shape
                    assert len(stamps) == k, len(stamps)
                    return (stamps[-1] - stamps[0]) * 1e3 / STEPS_AFTER_PREFIX

                steps()
                at[f"ms_per_token_at_{p}"] = statistics.median(
                    [steps() for _ in range(max(1, min(repeats, 3)))])
        batch_px = pixels.repeat(batch, 1, 1, 1)
        batch_ms = timed(lambda: gen_n(NEW_TOKENS, px=batch_px), reps=max(1, repeats // 2))
    weights = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dict(
        side="torch", family="blip" if blip else "vision-encoder-decoder", dtype=dtype,
        load_ms=load_ms, encode_ms=encode_ms,
        ms_per_token=ms_per_token, e2e_ms=e2e_ms, caption_tokens=caption_tokens,
        images_per_s=batch * 1e3 / batch_ms, **at,
        peak_rss_mb=rss, weights_mb=weights, rss_over_weights=rss / weights,
        torch=torch.__version__, threads=torch.get_num_threads(),
    )


def torch_attention(q_len: int, k_len: int, repeats: int) -> dict:
    import resource

    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    q = torch.randn(1, 12, q_len, 64)
    k = torch.randn(1, 12, k_len, 64)
    v = torch.randn(1, 12, k_len, 64)
    with torch.inference_mode():
        F.scaled_dot_product_attention(q, k, v)
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v)
            ts.append((time.perf_counter() - t) * 1e3)
    return dict(side="torch", q_len=q_len, k_len=k_len, ms=statistics.median(ts),
                peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def run_json(cmd, env):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine():
    """The machine this run measured: `lscpu`'s model name, vendor, family,
    model and SIMD flags (BENCHMARKS.md keeps a table per CPU), and the load
    average at the start (what "quiet" meant; the end's is added after the
    runs)."""
    info = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("Model name", "Vendor ID", "CPU family", "Model", "CPU(s)", "Flags"):
                info[key] = value.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        info["lscpu"] = f"unavailable: {e}"
    flags = set(info.pop("Flags", "").split())
    info["simd"] = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni",
                                         "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8") if f in flags)
    info["load average"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return info


def write_results(results: dict, out: Path) -> None:
    """Adds the load average at the end to `results["machine"]`, prints the
    machine line and writes every figure to `out` as JSON."""
    out.parent.mkdir(parents=True, exist_ok=True)
    results["machine"]["load average, end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    m = results["machine"]
    print(f"\nmachine: {m.get('Model name', '?')} (vendor {m.get('Vendor ID', '?')}, family "
          f"{m.get('CPU family', '?')} model {m.get('Model', '?')}; {m.get('simd', '')}); load "
          f"{m['load average']} -> {m['load average, end']}")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nraw figures: {out}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "scripts" / "out" / "bench_vs_torch.json")
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS),
                    help=f"comma list among {','.join(ALL_CONFIGS)} (default: all)")
    ap.add_argument("--skip-attention", action="store_true",
                    help="skip the attention kernel rows (they do not depend on the checkpoint)")
    ap.add_argument("--worker", choices=["torch", "attention"])
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--positions", default="",
                    help="comma list of cached text lengths to time decode steps at, both sides "
                         "(`vl bench --positions`), e.g. 100,1000,3000")
    ap.add_argument("--caption-tokens", type=int, default=0,
                    help="tokens of the caption row, both sides (default 16; e.g. 1000 for a "
                         "Nougat page; above 64 the torch side times one run)")
    ap.add_argument("--q-len", type=int, default=64)
    ap.add_argument("--k-len", type=int, default=576)
    args = ap.parse_args()

    positions = [int(p) for p in args.positions.split(",") if p.strip()]
    if args.worker == "torch":
        import torch
        torch.set_num_threads(args.threads)
        if model_type(args.model) == "florence2":
            print(json.dumps(florence_worker(args.model, args.dtype, args.repeats)))
        else:
            print(json.dumps(torch_worker(args.model, args.dtype, args.repeats, args.batch,
                                          positions, args.caption_tokens)))
        return
    if args.worker == "attention":
        import torch
        torch.set_num_threads(args.threads)
        print(json.dumps(torch_attention(args.q_len, args.k_len, args.repeats)))
        return

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in ALL_CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {','.join(unknown)} (known: {','.join(ALL_CONFIGS)})")

    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    py = [sys.executable, __file__, args.model, "--threads", str(args.threads),
          "--repeats", str(args.repeats), "--batch", str(args.batch),
          "--positions", args.positions, "--caption-tokens", str(args.caption_tokens)]
    vl_bin = str(ROOT / "target" / "release" / "vl")
    att_bin = str(ROOT / "target" / "release" / "examples" / "bench_attention")
    results = {"machine": machine()}
    print(f"machine: {results['machine']}", file=sys.stderr)
    columns = []
    for cid, (name, dtype) in TORCH_CONFIGS.items():
        if cid in configs:
            results[name] = run_json(py + ["--worker", "torch", "--dtype", dtype], env)
            columns.append(name)
            print(f"{name}: {results[name]}", file=sys.stderr)
    florence = model_type(args.model) == "florence2"
    # Florence-2: the caption rows as its torch worker times them, and no
    # batch row (its worker has none).
    vl_extra = (["--caption-tokens", str(FLORENCE_TOKENS), "--beams", str(FLORENCE_BEAMS),
                 "--quick"] if florence else [])
    if positions:
        vl_extra += ["--positions", ",".join(map(str, positions))]
    if args.caption_tokens and not florence:
        vl_extra += ["--caption-tokens", str(args.caption_tokens)]
    for cid, (name, extra) in VL_CONFIGS.items():
        if cid in configs:
            results[name] = run_json([vl_bin, "bench", "--model", args.model] + vl_extra + [
                                      "--repeats", str(args.repeats), "--batch", str(args.batch),
                                      "--threads", str(args.threads)] + extra, env)
            columns.append(name)
            print(f"{name}: {results[name]}", file=sys.stderr)
    if not args.skip_attention:
        for q_len, k_len, reps in [(64, 576, 20), (1024, 16384, 2)]:
            key = f"attention {q_len}x{k_len}"
            results[f"torch {key}"] = run_json(py + ["--worker", "attention", "--q-len", str(q_len),
                                                    "--k-len", str(k_len), "--repeats", str(reps)], env)
            results[f"vl {key}"] = run_json([att_bin, "--q-len", str(q_len), "--k-len", str(k_len),
                                             "--backend", "auto", "--repeats", str(reps)], env)
        results["vl module 1024x16384"] = run_json(
            [att_bin, "--module", "--backend", "fused", "--q-len", "1024", "--k-len", "16384",
             "--repeats", "1"], env)

    def get(config, key):
        """A figure, or None when its configuration did not run or vl bench
        did not print it."""
        v = results.get(config, {}).get(key)
        return v if isinstance(v, (int, float)) else None

    def ratio(a, b):
        return a / b if a is not None and b not in (None, 0) else None

    def fmt(v, spec="12.1f", width=12):
        return f"{v:{spec}}" if v is not None else f"{'-':>{width}}"

    rows = [("encode ms", "encode_ms"), ("decode ms/token", "ms_per_token"),
            (f"caption ms (encode + {FLORENCE_TOKENS if florence else args.caption_tokens or NEW_TOKENS})",
             "e2e_ms"),
            (f"caption ms, {FLORENCE_BEAMS} beams (encode + {FLORENCE_TOKENS})", "e2e_beam_ms"),
            (f"images/s, batch {args.batch}", "images_per_s"),
            ("peak RSS MB", "peak_rss_mb"), ("peak RSS / weights file", "rss_over_weights"),
            ("decode step reads MB", "decode_step_mb"), ("decode GB/s", "decode_gb_s"),
            ("machine read GB/s, start", "read_gb_s_start"),
            ("machine read GB/s, end", "read_gb_s_end"),
            ("decode / machine read", "decode_bandwidth_fraction")] + [
            (f"ms/token at position {p}", f"ms_per_token_at_{p}") for p in positions]
    width = max([12] + [len(c) + 2 for c in columns])
    print(f"\n{'':28}" + "".join(f"{c:>{width}}" for c in columns))
    for label, key in rows:
        spec = f"{width}.2f" if key in ("rss_over_weights", "decode_bandwidth_fraction") else f"{width}.1f"
        print(f"{label:28}" + "".join(fmt(get(c, key), spec, width) for c in columns))

    vl_run = [name for cid, (name, _) in VL_CONFIGS.items() if cid in configs]

    def fastest(key, best):
        """The vl configuration with the best `key` (min or max) and its value."""
        vals = [(get(c, key), c) for c in vl_run if get(c, key) is not None]
        return best(vals) if vals else (None, None)

    cap, cap_cfg = fastest("e2e_ms", min)
    ips, ips_cfg = fastest("images_per_s", max)
    tf32, tbf = "torch f32", "torch bf16"
    print("\nratios (vl / torch):")
    checks = [
        ("f32 decode / torch f32 (target <= 0.85)",
         ratio(get("vl f32", "ms_per_token"), get(tf32, "ms_per_token"))),
        ("q8_0 decode / torch bf16 (target <= 0.25)",
         ratio(get("vl q8_0", "ms_per_token"), get(tbf, "ms_per_token"))),
        ("bf16 decode / torch bf16 (target <= 0.5)",
         ratio(get("vl bf16", "ms_per_token"), get(tbf, "ms_per_token"))),
        ("bf16-weight decode / torch bf16 (target <= 0.5)",
         ratio(get("vl bf16 weights", "ms_per_token"), get(tbf, "ms_per_token"))),
        ("bf16 + q8_0 decode / torch bf16",
         ratio(get("vl bf16 + q8_0", "ms_per_token"), get(tbf, "ms_per_token"))),
        ("q4k decode / torch bf16",
         ratio(get("vl q4k", "ms_per_token"), get(tbf, "ms_per_token"))),
        ("f32 encode / torch f32 (target <= 1.0)",
         ratio(get("vl f32", "encode_ms"), get(tf32, "encode_ms"))),
        ("bf16 encode / torch bf16 (target <= 1.0)",
         ratio(get("vl bf16", "encode_ms"), get(tbf, "encode_ms"))),
        ("bf16-weight encode / torch bf16 (target <= 1.0)",
         ratio(get("vl bf16 weights", "encode_ms"), get(tbf, "encode_ms"))),
        (f"fastest caption ({cap_cfg or '-'}) / torch bf16 (target <= 0.5)",
         ratio(cap, get(tbf, "e2e_ms"))),
        ("f32 caption / torch f32", ratio(get("vl f32", "e2e_ms"), get(tf32, "e2e_ms"))),
        (f"images/s b{args.batch}, fastest ({ips_cfg or '-'}) / torch bf16 (target >= 1.0)",
         ratio(ips, get(tbf, "images_per_s"))),
        ("q8_0 peak RSS / dense weights file (target <= 1.0)", get("vl q8_0", "rss_over_weights")),
        ("bf16 + q8_0 peak RSS / dense weights file", get("vl bf16 + q8_0", "rss_over_weights")),
        ("bf16-weight peak RSS / dense weights file", get("vl bf16 weights", "rss_over_weights")),
        ("f32 peak RSS / weights file", get("vl f32", "rss_over_weights")),
        ("torch f32 peak RSS / weights file", get(tf32, "rss_over_weights")),
        ("bf16 top-1 agreement with f32 (target >= 0.97)", get("vl bf16", "top1_agreement")),
        ("bf16-weight top-1 agreement with f32 (target >= 0.97)",
         get("vl bf16 weights", "top1_agreement")),
        ("q8_0 top-1 agreement with f32 (target >= 0.97)", get("vl q8_0", "top1_agreement")),
        ("f32 reference's top-1 margin, in logit std", get("vl q8_0", "dense_top1_margin_in_std")),
        ("bf16 + q8_0 top-1 agreement with dense", get("vl bf16 + q8_0", "top1_agreement")),
        ("image cache speedup, f32", get("vl f32", "image_cache_speedup")),
        ("ms/token at 200 / at 10, f32", get("vl f32", "long_over_short")),
    ]
    if florence:
        beam, beam_cfg = fastest("e2e_beam_ms", min)
        # Florence-2's own targets (its issue).
        checks = [
            ("f32 encode / torch f32 (target <= 1.0)",
             ratio(get("vl f32", "encode_ms"), get(tf32, "encode_ms"))),
            ("bf16-weight encode / torch bf16 (target <= 1.0)",
             ratio(get("vl bf16 weights", "encode_ms"), get(tbf, "encode_ms"))),
            ("bf16 encode / torch bf16",
             ratio(get("vl bf16", "encode_ms"), get(tbf, "encode_ms"))),
            ("q8_0 decode / torch bf16 (target <= 0.35)",
             ratio(get("vl q8_0", "ms_per_token"), get(tbf, "ms_per_token"))),
            ("f32 decode / torch f32 (target <= 0.6)",
             ratio(get("vl f32", "ms_per_token"), get(tf32, "ms_per_token"))),
            (f"fastest <CAPTION> ({cap_cfg or '-'}) / torch bf16 (target <= 0.5)",
             ratio(cap, get(tbf, "e2e_ms"))),
            (f"fastest 3-beam <CAPTION> ({beam_cfg or '-'}) / torch bf16 (target <= 0.5)",
             ratio(beam, get(tbf, "e2e_beam_ms"))),
            ("bf16-weight top-1 agreement with f32", get("vl bf16 weights", "top1_agreement")),
            ("q8_0 top-1 agreement with f32", get("vl q8_0", "top1_agreement")),
            ("f32 reference's top-1 margin, in logit std",
             get("vl q8_0", "dense_top1_margin_in_std")),
        ]
    if not args.skip_attention:
        checks += [
            ("attention 64x576 / torch sdpa (target <= 1.0)",
             ratio(get("vl attention 64x576", "ms"), get("torch attention 64x576", "ms"))),
            ("attention 1024x16384 / torch sdpa",
             ratio(get("vl attention 1024x16384", "ms"), get("torch attention 1024x16384", "ms"))),
        ]
    for p in positions:
        key = f"ms_per_token_at_{p}"
        checks += [
            (f"q8_0 decode at position {p} / torch bf16 (issue 27: <= 0.35)",
             ratio(get("vl q8_0", key), get(tbf, key))),
            (f"f32 decode at position {p} / torch f32", ratio(get("vl f32", key), get(tf32, key))),
        ]
    label_width = max(50, *(len(label) for label, _ in checks))
    for label, v in checks:
        print(f"  {label:{label_width}} {fmt(v, '6.2f', 6)}")
    if not args.skip_attention:
        m = results["vl module 1024x16384"]
        peak, score = m.get("peak_rss_mb"), m.get("score_tensor_mb")
        print(f"  CrossAttention 1024x16384 peak RSS {fmt(peak, '.0f', 1)} MB "
              f"(a score tensor alone: {fmt(score, '.0f', 1)} MB)")
    write_results(results, args.out)


if __name__ == "__main__":
    main()

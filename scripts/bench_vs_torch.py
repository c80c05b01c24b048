#!/usr/bin/env python3
"""vl next to transformers on one checkpoint, in one run: prints a table of
ratios (vl / torch; below 1 means vl is faster or smaller) and writes the raw
figures as JSON.

    python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors pillow
    .venv/bin/python scripts/hf_fixtures.py --base /tmp/vit-gpt2-base
    cargo build --release -p vl-cli && cargo build --release --example bench_attention
    .venv/bin/python scripts/bench_vs_torch.py /tmp/vit-gpt2-base --threads 2

Every measurement runs in its own process (one model at a time, a fresh
peak-RSS counter), with the same number of threads on both sides.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 16


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def torch_worker(model_dir: str, dtype: str, repeats: int, batch: int) -> dict:
    import resource

    import torch
    from transformers import VisionEncoderDecoderModel

    torch.manual_seed(0)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    t0 = time.perf_counter()
    model = VisionEncoderDecoderModel.from_pretrained(model_dir, dtype=dt).eval()
    load_ms = (time.perf_counter() - t0) * 1e3
    side = model.config.encoder.image_size
    n = 3 * side * side
    pixels = (torch.arange(n, dtype=torch.float32) / n - 0.5).reshape(1, 3, side, side).to(dt)
    gen = dict(do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0)

    def timed(f, reps=repeats):
        f()
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            out.append((time.perf_counter() - t) * 1e3)
        return median(out)

    with torch.inference_mode():
        encode_ms = timed(lambda: model.encoder(pixel_values=pixels))
        enc = model.encoder(pixel_values=pixels)

        def gen_n(k, px=None, e=enc):
            if px is not None:
                return model.generate(px, max_new_tokens=k, min_new_tokens=k, **gen)
            return model.generate(encoder_outputs=e, max_new_tokens=k, min_new_tokens=k, **gen)

        one = timed(lambda: gen_n(1))
        many = timed(lambda: gen_n(NEW_TOKENS + 1))
        ms_per_token = (many - one) / NEW_TOKENS
        e2e_ms = timed(lambda: gen_n(NEW_TOKENS, px=pixels))
        batch_px = pixels.repeat(batch, 1, 1, 1)
        batch_ms = timed(lambda: gen_n(NEW_TOKENS, px=batch_px), reps=max(1, repeats // 2))
    weights = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dict(
        side="torch", dtype=dtype, load_ms=load_ms, encode_ms=encode_ms,
        ms_per_token=ms_per_token, e2e_ms=e2e_ms, images_per_s=batch * 1e3 / batch_ms,
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
    return dict(side="torch", q_len=q_len, k_len=k_len, ms=median(ts),
                peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def run_json(cmd, env):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "scripts" / "out" / "bench_vs_torch.json")
    ap.add_argument("--worker", choices=["torch", "attention"])
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--q-len", type=int, default=64)
    ap.add_argument("--k-len", type=int, default=576)
    args = ap.parse_args()

    if args.worker == "torch":
        import torch
        torch.set_num_threads(args.threads)
        print(json.dumps(torch_worker(args.model, args.dtype, args.repeats, args.batch)))
        return
    if args.worker == "attention":
        import torch
        torch.set_num_threads(args.threads)
        print(json.dumps(torch_attention(args.q_len, args.k_len, args.repeats)))
        return

    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    py = [sys.executable, __file__, args.model, "--threads", str(args.threads),
          "--repeats", str(args.repeats), "--batch", str(args.batch)]
    vl_bin = str(ROOT / "target" / "release" / "vl")
    att_bin = str(ROOT / "target" / "release" / "examples" / "bench_attention")
    results = {}
    for dtype in ["f32", "bf16"]:
        results[f"torch {dtype}"] = run_json(py + ["--worker", "torch", "--dtype", dtype], env)
        print(f"torch {dtype}: {results[f'torch {dtype}']}", file=sys.stderr)
    for name, extra in [("vl f32", ["--dtype", "f32"]), ("vl bf16", ["--dtype", "bf16"]),
                        ("vl q8_0", ["--quantize", "q8_0"]), ("vl q4k", ["--quantize", "q4k"])]:
        results[name] = run_json([vl_bin, "bench", "--model", args.model, "--repeats", str(args.repeats),
                                  "--batch", str(args.batch)] + extra, env)
        print(f"{name}: {results[name]}", file=sys.stderr)
    for q_len, k_len, reps in [(64, 576, 20), (1024, 16384, 2)]:
        key = f"attention {q_len}x{k_len}"
        results[f"torch {key}"] = run_json(py + ["--worker", "attention", "--q-len", str(q_len),
                                                "--k-len", str(k_len), "--repeats", str(reps)], env)
        results[f"vl {key}"] = run_json([att_bin, "--q-len", str(q_len), "--k-len", str(k_len),
                                         "--backend", "auto", "--repeats", str(reps)], env)
    results[f"vl module 1024x16384"] = run_json(
        [att_bin, "--module", "--backend", "fused", "--q-len", "1024", "--k-len", "16384",
         "--repeats", "1"], env)

    tf32, tbf = results["torch f32"], results["torch bf16"]
    rows = [("encode ms", "encode_ms"), ("decode ms/token", "ms_per_token"),
            ("caption ms (encode + 16)", "e2e_ms"), (f"images/s, batch {args.batch}", "images_per_s"),
            ("peak RSS MB", "peak_rss_mb")]
    print(f"\n{'':28}" + "".join(f"{k:>12}" for k in ["torch f32", "torch bf16", "vl f32", "vl bf16", "vl q8_0", "vl q4k"]))
    for label, key in rows:
        vals = [results[k].get(key) for k in ["torch f32", "torch bf16", "vl f32", "vl bf16", "vl q8_0", "vl q4k"]]
        print(f"{label:28}" + "".join(f"{v:12.1f}" if v is not None else f"{'-':>12}" for v in vals))
    print("\nratios (vl / torch):")
    checks = [
        ("f32 decode / torch f32 (target <= 0.6)", results["vl f32"]["ms_per_token"] / tf32["ms_per_token"]),
        ("q8_0 decode / torch bf16 (target <= 0.5)", results["vl q8_0"]["ms_per_token"] / tbf["ms_per_token"]),
        ("q4k decode / torch bf16 (target <= 0.5)", results["vl q4k"]["ms_per_token"] / tbf["ms_per_token"]),
        ("q8_0 caption / torch bf16 (target <= 1.0)", results["vl q8_0"]["e2e_ms"] / tbf["e2e_ms"]),
        ("f32 caption / torch f32", results["vl f32"]["e2e_ms"] / tf32["e2e_ms"]),
        ("f32 encode / torch f32", results["vl f32"]["encode_ms"] / tf32["encode_ms"]),
        ("bf16 encode / torch bf16", results["vl bf16"]["encode_ms"] / tbf["encode_ms"]),
        ("f32 peak RSS / weights file (target <= 1.2)", results["vl f32"]["rss_over_weights"]),
        ("q8_0 peak RSS / weights file (target <= 1.2)", results["vl q8_0"]["rss_over_weights"]),
        ("torch f32 peak RSS / weights file", tf32["rss_over_weights"]),
        ("image cache speedup, f32 (target >= 10)", results["vl f32"]["image_cache_speedup"]),
        ("ms/token at 200 / at 10, f32 (target <= 1.5)", results["vl f32"]["long_over_short"]),
        ("attention 64x576 / torch sdpa (target <= 1.0)",
         results["vl attention 64x576"]["ms"] / results["torch attention 64x576"]["ms"]),
        ("attention 1024x16384 / torch sdpa",
         results["vl attention 1024x16384"]["ms"] / results["torch attention 1024x16384"]["ms"]),
    ]
    for label, v in checks:
        print(f"  {label:50} {v:6.2f}")
    m = results["vl module 1024x16384"]
    print(f"  CrossAttention 1024x16384 peak RSS {m['peak_rss_mb']:.0f} MB "
          f"(a score tensor alone: {m['score_tensor_mb']:.0f} MB)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nraw figures: {args.out}")


if __name__ == "__main__":
    main()

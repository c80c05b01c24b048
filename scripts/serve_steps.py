#!/usr/bin/env python3
"""The decode step of `vl serve` at a given batch: the server's own
timing of each step (its debug log), over one wave of concurrent
requests on loopback.

    cargo build --release -p vl-cli
    .venv/bin/python scripts/hf_fixtures.py --base /tmp/vit-gpt2-base && git checkout tests/fixtures
    .venv/bin/python scripts/serve_steps.py /tmp/vit-gpt2-base --vl target/release/vl \\
        [--clients 16] [--tokens 256] [-- --quantize q8_0 --threads 2 ...]

Arguments after `--` go to `vl serve` (default: `--quantize q8_0
--threads 2`). The server is started with `RUST_LOG=vl_cli=debug`; a
first wave warms it (caches sized, pages faulted in), then a second wave
of `--clients` requests of exactly `--tokens` tokens over distinct
images is timed. Printed: the wave's wall time, and the p50 and p90 of
the steps that decoded every client's row at once (the others are the
wave's ramp, as requests join and leave), with their count. Needs Pillow
and NumPy (for the images), nothing else; the server is stopped at the
end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_python import make_images  # noqa: E402
from load_serve import ROOT, Server, body, data_url, free_port, post  # noqa: E402

STEP = re.compile(r"decoded (\d+) requests in ([0-9.]+) ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a checkpoint directory (scripts/hf_fixtures.py --base)")
    ap.add_argument("--vl", default=str(ROOT / "target/release/vl"))
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    serve_args = argv[cut + 1:] or ["--quantize", "q8_0", "--threads", "2"]

    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    env = dict(os.environ, RUST_LOG="vl_cli=debug", NO_COLOR="1")
    cmd = [args.vl, "serve", "--model", args.model, "--port", str(port),
           "--max-batch", str(max(args.clients, 1))] + serve_args
    server = Server(cmd, port, env, log=log)
    try:
        urls = [data_url(p) for p in make_images(Path(tempfile.mkdtemp()), args.clients)]

        def wave() -> float:
            answers = []

            def one(u):
                answers.append(post(server.base, body(u, args.tokens, False))[0])

            threads = [threading.Thread(target=one, args=(u,)) for u in urls]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            if any(s != 200 for s in answers):
                sys.exit(f"a request failed: statuses {answers}")
            return wall

        def steps() -> list:
            log.flush()
            return STEP.findall(Path(log.name).read_text(errors="replace"))

        wave()
        seen = len(steps())
        wall = wave()
        time.sleep(0.2)
        timed = steps()[seen:]
    finally:
        server.stop()
    full = sorted(float(ms) for n, ms in timed if int(n) == args.clients)
    if not full:
        sys.exit("no step decoded every client's row at once")
    print(json.dumps({
        "clients": args.clients,
        "tokens": args.tokens,
        "wave_s": round(wall, 3),
        "steps": len(full),
        "step_p50_ms": statistics.median(full),
        "step_p90_ms": full[min(len(full) - 1, int(0.9 * len(full)))],
        "serve_args": serve_args,
    }))


if __name__ == "__main__":
    main()

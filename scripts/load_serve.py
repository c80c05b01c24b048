#!/usr/bin/env python3
"""A bounded load test of `vl serve` on loopback: requests/s, latency and
time to first token at 1, 4 and 16 concurrent clients for two workloads,
the encoder's bound beside them, the same workload against a FastAPI
server around transformers (`scripts/serve_transformers.py`), and a
mixed run of good and bad requests with the server's memory.

    cargo build --release -p vl-cli
    .venv/bin/python scripts/hf_fixtures.py --base /tmp/vit-gpt2-base && git checkout tests/fixtures
    .venv/bin/python scripts/load_serve.py /tmp/vit-gpt2-base --quantize q8_0 --threads 2 \\
        [--text-cache f32] [--image-cache q8] [--encode-batch 16] [--transformers .venv/bin/python] [--mixed 1000] [--json out.json]

Workloads (every answer exactly its token count: `min_tokens` =
`max_tokens`, so random weights never end early):
  a) 16-token captions; b) 256-token generations.
Clients are closed loops: each sends its next request when its answer
came; requests/s = requests answered / wall time. Every answer is checked
against the single-request answer of its image (sent first, one at a
time). Time to first token is the first streamed content's arrival.

The encoder's bound: requests of one token at 16 clients — each image's
encoding cannot be shared by batching, so this is the most requests/s any
workload can reach.

`--mixed N`: N requests at 16 clients, 5% of them bad (each kind of bad
input in turn), the good ones 8-token captions; every good answer must
equal its single-request answer, every bad one a 4xx whose error names
the field; the server's RSS after warm-up and after the run is reported.

Only loopback is used; every request has a timeout; the servers started
are stopped at the end.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_python import make_images  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 600


def data_url(path: str) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def body(url: str, tokens: int, stream: bool, **extra) -> dict:
    b = {
        "model": extra.pop("model", None),
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
        ],
        "max_tokens": tokens,
        "min_tokens": tokens,
        "stream": stream,
    }
    b.update(extra)
    return {k: v for k, v in b.items() if v is not None}


def post(base: str, payload, stream: bool = False):
    """(status, answer json or text, seconds to first content, seconds)."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    req = urllib.request.Request(
        base + "/v1/chat/completions", data=data, headers={"content-type": "application/json"}
    )
    t0 = time.perf_counter()
    first = None
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            if not stream:
                answer = json.loads(r.read())
                t = time.perf_counter() - t0
                return r.status, answer["choices"][0]["message"]["content"], t, t
            text = []
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return 500, chunk, None, time.perf_counter() - t0
                piece = chunk["choices"][0]["delta"].get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter() - t0
                    text.append(piece)
            return r.status, "".join(text), first, time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = raw.decode(errors="replace")
        return e.code, answer, None, time.perf_counter() - t0


class Server:
    """A server process on loopback, stopped on exit; `log`, a file, takes
    its standard error (its log), which is otherwise discarded."""

    def __init__(self, cmd: list, port: int, env=None, log=None):
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log or subprocess.DEVNULL, text=True, env=env
        )
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                said = ""
                if log is not None:
                    log.flush()
                    tail = Path(log.name).read_text(errors="replace").strip().splitlines()[-5:]
                    said = ":\n" + "\n".join(tail)
                raise SystemExit(f"{cmd[0]} exited with {self.proc.returncode}{said}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise SystemExit(f"{cmd} not ready in 300 s")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_clients(base: str, clients: int, n: int, make, check, stream: bool) -> dict:
    """`n` requests from `clients` closed-loop clients; `make(i)` builds
    request i, `check(i, status, answer)` says whether its answer is right."""
    lock = threading.Lock()
    next_i = [0]
    lat, ttft, wrong = [], [], []

    def client():
        while True:
            with lock:
                i = next_i[0]
                if i >= n:
                    return
                next_i[0] += 1
            status, answer, first, t = post(base, make(i), stream)
            with lock:
                lat.append(t)
                if first is not None:
                    ttft.append(first)
                if not check(i, status, answer):
                    wrong.append((i, status, answer))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    def pct(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None

    return {
        "clients": clients,
        "requests": n,
        "wall_s": wall,
        "requests_per_s": n / wall,
        "p50_s": pct(lat, 50),
        "p99_s": pct(lat, 99),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "wrong": wrong[:5],
        "wrong_count": len(wrong),
    }


def workloads(base: str, urls: list, args, stream: bool, name: str, want: dict) -> list:
    out = []
    plan = [
        ("a", 16, [(1, 12), (4, 24), (16, 48)]),
        # (b)'s ratio divides by the sequential figure, which over four
        # requests moved 0.60-0.84 requests/s between runs of one binary:
        # eight sequential requests and three waves of sixteen.
        ("b", 256, [(1, 8), (4, 8), (16, 48)]),
    ]
    if args.quick:
        plan = [("a", 16, [(1, 4), (16, 16)]), ("b", 64, [(1, 2), (16, 16)])]
    for label, tokens, levels in plan:
        if name != "vl" and label != "a":
            continue
        for i, u in enumerate(urls):
            if (i, tokens) not in want:
                status, answer, _, _ = post(base, body(u, tokens, False))
                assert status == 200, (status, answer)
                want[(i, tokens)] = answer
        for clients, n in levels:
            r = run_clients(
                base,
                clients,
                n,
                lambda i: body(urls[i % len(urls)], tokens, stream),
                lambda i, s, a: s == 200 and a == want[(i % len(urls), tokens)],
                stream,
            )
            r.update(server=name, workload=label, tokens=tokens)
            out.append(r)
            print(json.dumps(r), flush=True)
    return out


BAD_KINDS = [
    ("body", lambda u: b'{"messages": ['),
    ("messages[0].content[0].image_url.url", lambda u: body("data:image/png;base64,@@@", 8, False)),
    ("messages[0].content[0].image_url.url", lambda u: body("https://example.com/a.png", 8, False)),
    (
        "messages[0].content[0].image_url.url",
        lambda u: body("data:image/png;base64," + base64.b64encode(b"not a png").decode(), 8, False),
    ),
    ("model", lambda u: body(u, 8, False, model="gpt-4o")),
    ("max_tokens", lambda u: body(u, 100000, False)),
    ("temperature", lambda u: body(u, 8, False, temperature=9.0)),
    ("task", lambda u: body(u, 8, False, task="od")),
    ("min_tokens", lambda u: dict(body(u, 8, False), min_tokens=9)),
    ("top_p", lambda u: body(u, 8, False, temperature=0.5, top_p=0.0)),
]


def mixed(server: Server, urls: list, n: int, want: dict) -> dict:
    for i, u in enumerate(urls):
        if (i, 8) not in want:
            status, answer, _, _ = post(server.base, body(u, 8, False))
            assert status == 200, (status, answer)
            want[(i, 8)] = answer
    # Warm-up: a first round at 16 clients.
    run_clients(server.base, 16, 64, lambda i: body(urls[i % len(urls)], 8, False),
                lambda i, s, a: True, False)
    rss_warm = server.rss_mib()
    bad = {i for i in range(n) if i % 20 == 7}  # 5%
    kinds = {}

    def make(i):
        if i in bad:
            field, build = BAD_KINDS[(i // 20) % len(BAD_KINDS)]
            kinds[i] = field
            return build(urls[i % len(urls)])
        return body(urls[i % len(urls)], 8, False)

    def check(i, status, answer):
        if i in bad:
            return (
                400 <= status < 500
                and isinstance(answer, dict)
                and answer.get("error", {}).get("param") == kinds[i]
            )
        return status == 200 and answer == want[(i % len(urls), 8)]

    r = run_clients(server.base, 16, n, make, check, False)
    r.update(
        workload="mixed",
        bad=len(bad),
        rss_after_warmup_mib=rss_warm,
        rss_after_mib=server.rss_mib(),
    )
    r["rss_ratio"] = r["rss_after_mib"] / rss_warm
    print(json.dumps(r), flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a checkpoint directory (scripts/hf_fixtures.py --base)")
    ap.add_argument("--quantize", default="q8_0")
    ap.add_argument("--text-cache", help="vl serve --text-cache (bf16, f16, f32); default: the server's (q8 under --quantize q8_0)")
    ap.add_argument("--image-cache", help="vl serve --image-cache (bf16, f16, f32, q8); default: the server's (q8 under --quantize q8_0)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--encode-batch", type=int, help="vl serve --encode-batch; default: the server's (1)")
    ap.add_argument("--vl", default=str(ROOT / "target/release/vl"))
    ap.add_argument("--transformers", help="a Python with torch, transformers, fastapi, uvicorn")
    ap.add_argument("--transformers-dtype", default="float32")
    ap.add_argument("--mixed", type=int, default=0, help="requests of the mixed good/bad run")
    ap.add_argument("--skip-workloads", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer and shorter requests")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp())
    urls = [data_url(p) for p in make_images(tmp, 8)]
    results = []
    want: dict = {}
    port = free_port()
    cmd = [args.vl, "serve", "--model", args.model, "--threads", str(args.threads),
           "--port", str(port), "--max-batch", "16", "--max-queue", "64"]
    if args.quantize != "none":
        cmd += ["--quantize", args.quantize]
    if args.text_cache:
        cmd += ["--text-cache", args.text_cache]
    if args.image_cache:
        cmd += ["--image-cache", args.image_cache]
    if args.encode_batch:
        cmd += ["--encode-batch", str(args.encode_batch)]
    vl = Server(cmd, port)
    try:
        if not args.skip_workloads:
            results += workloads(vl.base, urls, args, True, "vl", want)
            # The encoder's bound: one-token requests at 16 clients.
            for i, u in enumerate(urls):
                status, answer, _, _ = post(vl.base, body(u, 1, False))
                want[(i, 1)] = answer
            r = run_clients(vl.base, 16, 48, lambda i: body(urls[i % 8], 1, False),
                            lambda i, s, a: s == 200 and a == want[(i % 8, 1)], False)
            r.update(server="vl", workload="encoder bound (1 token)", tokens=1)
            print(json.dumps(r), flush=True)
            results.append(r)
        if args.mixed:
            results.append(mixed(vl, urls, args.mixed, want))
    finally:
        vl.stop()
    if args.transformers:
        port = free_port()
        t = Server([args.transformers, str(ROOT / "scripts/serve_transformers.py"), args.model,
                    "--threads", str(args.threads), "--port", str(port),
                    "--dtype", args.transformers_dtype], port)
        try:
            results += workloads(t.base, urls, args, False, "transformers", {})
        finally:
            t.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

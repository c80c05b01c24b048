#!/usr/bin/env python3
"""The baseline `scripts/load_serve.py` compares `vl serve` with: a FastAPI
server around transformers' `model.generate`, answering the subset of
`POST /v1/chat/completions` the load script sends (one `image_url` data
URL; `max_tokens`, `min_tokens`; greedy), shaped as OpenAI's answer.

    .venv/bin/pip install fastapi uvicorn   # beside torch + transformers
    .venv/bin/python scripts/serve_transformers.py DIR --threads 2 --port 8090

Each request is its own `generate` call (a batch of one image), as such a
server is usually written; calls are serialised by a lock, so that two
requests never split the same `--threads` cores between two `generate`s
(running them at once only oversubscribes the cores). `--dtype bfloat16`
serves the bf16 model.
"""


import argparse
import base64
import io
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a VisionEncoderDecoder checkpoint directory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8090)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()

    import torch
    import uvicorn
    from fastapi import FastAPI, HTTPException, Request
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, VisionEncoderDecoderModel

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = VisionEncoderDecoderModel.from_pretrained(args.model, dtype=dtype).eval()
    processor = AutoImageProcessor.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        url = None
        for message in body.get("messages", []):
            content = message.get("content")
            if isinstance(content, list):
                for part in content:
                    if part.get("type") == "image_url":
                        url = part["image_url"]["url"]
        if url is None or not url.startswith("data:") or "," not in url:
            raise HTTPException(400, "messages: one image_url data URL is needed")
        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
        max_tokens = int(body.get("max_tokens", 16))
        min_tokens = int(body.get("min_tokens", 0))

        def run():
            pixels = processor(images=image, return_tensors="pt").pixel_values.to(dtype)
            with lock, torch.inference_mode():
                ids = model.generate(
                    pixels,
                    max_new_tokens=max_tokens,
                    min_new_tokens=min_tokens,
                    do_sample=False,
                    num_beams=1,
                )
            return ids[0, 1:].tolist()

        # Off the event loop, so that /health and new requests are read
        # while a generate runs.
        import anyio

        ids = await anyio.to_thread.run_sync(run)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return {
            "id": f"chatcmpl-{time.time_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": args.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
            ],
            "usage": {"completion_tokens": len(ids)},
        }

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

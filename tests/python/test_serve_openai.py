"""`vl serve` against the official `openai` Python client, on loopback:
a plain and a streaming chat completion with an image, each equal to
`vl caption`'s caption of the same image, and the client's error for a
bad request naming the field.

Run by .ci/run after the cargo tests (the binary built by them):

    python3 -m venv .venv && .venv/bin/pip install openai pytest
    VL_BIN=target/debug/vl .venv/bin/pytest -q tests/python
"""

import base64
import os
import subprocess
import time
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
VL = os.environ.get("VL_BIN", str(ROOT / "target" / "debug" / "vl"))
SAMPLES = sorted((ROOT / "models" / "shapes-captioner" / "samples").glob("*.png"))[:3]


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen([VL, "serve", "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on "), line
        base = line.removeprefix("listening on ")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.models.list()
                break
            except openai.APIError:
                assert time.monotonic() < deadline, "not ready in 60 s"
                time.sleep(0.1)
        yield client
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def caption(path: Path) -> str:
    return subprocess.run([VL, "caption", str(path)], capture_output=True, text=True,
                          check=True).stdout.strip()


def messages(path: Path):
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    return [{"role": "user", "content": [
        {"type": "text", "text": "What is in the image?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]}]


def test_models_lists_the_served_model(server):
    assert [m.id for m in server.models.list().data] == ["shapes-captioner"]


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_plain_and_streaming_equal_vl_caption(server, path):
    want = caption(path)
    r = server.chat.completions.create(model="shapes-captioner", messages=messages(path))
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stream = server.chat.completions.create(model="shapes-captioner", messages=messages(path),
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == want


def test_bad_request_names_the_field(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.chat.completions.create(model="shapes-captioner", messages=messages(SAMPLES[0]),
                                       max_tokens=10_000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        server.chat.completions.create(model="gpt-4o", messages=messages(SAMPLES[0]))
    assert e.value.body["param"] == "model"

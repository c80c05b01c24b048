"""vl.Model.caption: parity with the `vl` command, every input kind, bad
inputs named, the GIL released."""

from __future__ import annotations

import io
import pathlib
import threading
import time

import numpy as np
import pytest
from PIL import Image

import vl
from conftest import FIXTURES, SHAPES, cli_json


def test_shipped_samples_match_the_cli(shapes, samples):
    cli = cli_json("--model", str(SHAPES), *map(str, samples))
    py = shapes.caption([str(p) for p in samples])
    assert len(py) == len(samples)
    for c, p in zip(cli, py):
        assert p == c, p["image"]
    # The samples' own captions (captions.tsv) are the model's.
    truth = dict(
        line.split("\t", 1)
        for line in (SHAPES / "samples" / "captions.tsv").read_text().splitlines()
        if "\t" in line
    )
    for p, r in zip(samples, py):
        if p.name in truth:
            assert r["caption"] == truth[p.name].strip(), p.name


def test_settings_match_the_cli(shapes, samples):
    args = ["--beams", "3", "--max-tokens", "6"]
    cli = cli_json("--model", str(SHAPES), *args, *map(str, samples[:3]))
    py = shapes.caption([str(p) for p in samples[:3]], beams=3, max_tokens=6)
    assert py == cli
    assert all(len(r["token_ids"]) <= 6 for r in py)
    sampled_cli = cli_json(
        "--model", str(SHAPES), "--temperature", "1.5", "--seed", "7", str(samples[0])
    )
    sampled = shapes.caption(str(samples[0]), temperature=1.5, seed=7)
    assert sampled == sampled_cli


def test_every_input_kind_gives_the_same_caption(shapes, samples):
    path = samples[1]
    expected = shapes.caption(str(path))[0]
    pil = Image.open(path)
    array = np.asarray(pil.convert("RGB"))
    assert array.flags["C_CONTIGUOUS"] and array.dtype == np.uint8
    inputs = [
        str(path),
        pathlib.Path(path),
        path.read_bytes(),
        bytearray(path.read_bytes()),
        pil,
        pil.convert("RGBA"),
        array,
        # Not contiguous: every other row and column of a 2x image.
        np.repeat(np.repeat(array, 2, axis=0), 2, axis=1)[::2, ::2],
        np.asfortranarray(array),
    ]
    results = shapes.caption(inputs)
    for i, r in enumerate(results):
        assert r["caption"] == expected["caption"], f"input {i} ({type(inputs[i]).__name__})"
        assert r["token_ids"] == expected["token_ids"]
    # Paths carry the path, as the CLI's lines do; other inputs do not.
    assert results[0]["image"] == str(path) and results[1]["image"] == str(path)
    assert "image" not in results[2] and "image" not in results[6]
    # One image alone is a list of one.
    assert shapes.caption(array) == [results[6]]


def test_an_array_is_read_as_rgb_rows(shapes, samples):
    array = np.asarray(Image.open(samples[0]).convert("RGB"))
    mirrored = np.ascontiguousarray(array[:, ::-1])
    assert shapes.caption(mirrored) == shapes.caption(Image.fromarray(mirrored))
    assert shapes.caption(mirrored)[0]["caption"] != shapes.caption(array)[0]["caption"]


def png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def test_a_bad_image_costs_only_itself(shapes, samples, tmp_path):
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(samples[0].read_bytes()[:100])
    inputs = [str(samples[0]), str(corrupt), b"not an image", str(tmp_path / "missing.png"), str(samples[1])]
    good = shapes.caption([str(samples[0]), str(samples[1])])

    returned = shapes.caption(inputs, errors="return", batch_size=2)
    assert returned[0] == good[0] and returned[4] == good[1]
    assert returned[1]["error_type"] == "ImageError" and "corrupt.png" in returned[1]["error"]
    assert returned[1]["image"] == str(corrupt)
    assert returned[2] == {"error": "images[2]: not an image (unknown format)", "error_type": "ImageError"}
    assert "missing.png" in returned[3]["error"] and "cannot open" in returned[3]["error"]
    # As the CLI reports the files it could not read.
    cli = cli_json("--model", str(SHAPES), str(samples[0]), str(corrupt))
    assert cli[1]["error"] == returned[1]["error"]

    with pytest.raises(vl.ImageError) as raised:
        shapes.caption(inputs)
    e = raised.value
    assert isinstance(e, vl.Error) and e.index == 1
    assert str(e).startswith("images[1]: ") and "corrupt.png" in str(e)
    assert "(and 2 more of 5 images failed; see .results)" in str(e)
    # Nothing computed is lost: the good images' results come along.
    assert e.results[0] == good[0] and e.results[4] == good[1]
    assert all(isinstance(e.results[i], vl.ImageError) for i in (1, 2, 3))


@pytest.mark.parametrize(
    "bad, named",
    [
        (np.zeros((8, 8, 3), dtype=np.float32), "got float32 of shape [8, 8, 3]"),
        (np.zeros((8, 8), dtype=np.uint8), "got uint8 of shape [8, 8]"),
        (np.zeros((8, 8, 4), dtype=np.uint8), "of shape [8, 8, 4]"),
        (np.zeros((0, 8, 3), dtype=np.uint8), "has no pixels"),
        (42, "a builtins.int"),
        (None, "a builtins.NoneType"),
    ],
)
def test_wrong_types_dtypes_and_shapes_are_named(shapes, samples, bad, named):
    with pytest.raises(vl.InputTypeError) as raised:
        shapes.caption([str(samples[0]), bad])
    assert isinstance(raised.value, TypeError)
    assert str(raised.value).startswith("images[1]: "), str(raised.value)
    assert named in str(raised.value)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"beams": 0}, "beams=0: must be at least 1"),
        ({"temperature": -1.0}, "temperature=-1: must be a finite number >= 0"),
        ({"max_tokens": 100000}, "max_tokens=100000"),
        ({"top_p": 0.0}, "top_p"),
        ({"task": "od"}, 'task="od": the model'),
        ({"batch_size": 0}, "batch_size=0"),
        ({"errors": "ignore"}, "errors='ignore'"),
    ],
)
def test_bad_settings_are_named(shapes, samples, kwargs, named):
    with pytest.raises(vl.ArgumentError) as raised:
        shapes.caption(str(samples[0]), **kwargs)
    assert isinstance(raised.value, ValueError)
    assert named in str(raised.value)


def test_load_errors_are_named(tmp_path):
    with pytest.raises(vl.ModelError, match="no such model directory"):
        vl.load(tmp_path / "absent")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(vl.ModelError, match="config.json"):
        vl.load(tmp_path)
    with pytest.raises(vl.ArgumentError, match='quantize="q3": not a format'):
        vl.load(SHAPES, quantize="q3")
    with pytest.raises(vl.ArgumentError, match="dtype"):
        vl.load(SHAPES, dtype="f64")
    with pytest.raises(vl.ArgumentError, match='text_cache="f32"'):
        vl.load(SHAPES, dtype="bf16", text_cache="f32")
    with pytest.raises(vl.ArgumentError, match='text_cache="f8"'):
        vl.load(SHAPES, text_cache="f8")
    with pytest.raises(vl.ArgumentError, match='image_cache="q8"'):
        vl.load(SHAPES, dtype="bf16", image_cache="q8")
    # q8 rows need heads a multiple of 32 wide; the captioner's are 16.
    for arg in ["text_cache", "image_cache"]:
        with pytest.raises(vl.ArgumentError, match=f"{arg}_dtype: q8 rows need a head width"):
            vl.load(SHAPES, **{arg: "q8"})


def test_quantized_load(samples):
    q = vl.load(SHAPES, quantize="q8_0")
    assert q.quantization == "q8_0" and q.family == "vl"
    r = q.caption(str(samples[0]))[0]
    assert r["caption"] and r["token_ids"][-1] == 2
    # Keys and values kept in bf16: the shipped captioner's wide margins
    # give the same tokens.
    kv16 = vl.load(SHAPES, quantize="q8_0", text_cache="bf16", image_cache="f32")
    assert kv16.caption(str(samples[0]))[0]["token_ids"] == r["token_ids"]


def test_caption_iter_streams_any_iterable(shapes, samples):
    expected = shapes.caption([str(p) for p in samples])
    # A generator, read a batch at a time.
    read = []

    def paths():
        for p in samples:
            read.append(p)
            yield str(p)

    it = shapes.caption_iter(paths(), batch_size=2)
    first = next(it)
    assert first == expected[0] and len(read) == 2
    assert [first, *it] == expected

    bad = [str(samples[0]), str(samples[1]), b"junk", str(samples[2])]
    got = []
    with pytest.raises(vl.ImageError) as raised:
        for r in shapes.caption_iter(iter(bad), batch_size=2):
            got.append(r)
    assert raised.value.index == 2 and got == expected[:2]
    with pytest.raises(vl.InputTypeError, match=r"^images\[3\]: "):
        list(shapes.caption_iter([str(samples[0])] * 3 + [1.5], batch_size=2))


def test_the_gil_is_released(shapes, samples):
    """Two threads caption at once while a pure-Python thread keeps
    running: with the GIL held through vl's work, neither could."""
    images = [np.asarray(Image.open(p).convert("RGB")) for p in samples] * 12
    expected = shapes.caption(images[: len(samples)])
    ticks = []
    spans = {}
    results = {}
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    def work(name):
        t0 = time.perf_counter()
        results[name] = shapes.caption(images, batch_size=4)
        spans[name] = (t0, time.perf_counter())

    ticker = threading.Thread(target=tick)
    ticker.start()
    workers = [threading.Thread(target=work, args=(n,)) for n in ("a", "b")]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=600)
    stop.set()
    ticker.join()
    (a0, a1), (b0, b1) = spans["a"], spans["b"]
    # The two calls overlapped, and each captioned correctly.
    assert max(a0, b0) < min(a1, b1), spans
    for name in ("a", "b"):
        assert results[name][: len(samples)] == expected
    # The ticker ran while both captioned.
    both = [t for t in ticks if max(a0, b0) < t < min(a1, b1)]
    assert len(both) >= 3, (len(both), spans)


def test_pipeline_has_transformers_shape(shapes, samples):
    pipe = vl.pipeline("image-to-text", model=shapes)
    one = pipe(str(samples[0]))
    expected = shapes.caption(str(samples[0]))[0]["caption"]
    assert one == [{"generated_text": expected}]
    many = pipe([str(samples[0]), Image.open(samples[1])])
    assert len(many) == 2 and many[0] == one
    assert list(many[1][0]) == ["generated_text"]
    short = pipe(str(samples[0]), max_new_tokens=3)
    assert len(shapes.caption(str(samples[0]), max_tokens=3)[0]["token_ids"]) <= 3
    assert short[0]["generated_text"] == shapes.caption(str(samples[0]), max_tokens=3)[0]["caption"]
    beams = pipe(str(samples[0]), generate_kwargs={"num_beams": 3, "do_sample": False})
    assert beams[0]["generated_text"] == shapes.caption(str(samples[0]), beams=3)[0]["caption"]
    with pytest.raises(vl.ArgumentError, match="generate_kwargs\\['output_scores'\\]"):
        pipe(str(samples[0]), generate_kwargs={"output_scores": True})
    with pytest.raises(vl.InputTypeError, match="does not fetch URLs"):
        pipe("https://example.invalid/cat.png")
    loaded = vl.pipeline("image-to-text", model=SHAPES)
    assert loaded(str(samples[0])) == one
    with pytest.raises(vl.ArgumentError, match="task='translation'"):
        vl.pipeline("translation", model=shapes)


def test_transformers_fixture_matches_transformers_and_the_cli():
    """A transformers ViT + GPT-2 checkpoint (tests/fixtures/hf, written by
    scripts/hf_fixtures.py): the ids transformers generated with the
    checkpoint's defaults."""
    import json

    d = FIXTURES / "hf" / "equal"
    expected = json.loads((d / "expected.json").read_text())
    model = vl.load(d)
    assert model.family == "vision-encoder-decoder"
    r = model.caption(str(d / "image.png"))[0]
    assert r["token_ids"] == expected["defaults"]
    assert r["caption"] == expected["defaults_text"]
    assert [r] == cli_json("--model", str(d), str(d / "image.png"))


def test_florence2_tasks_match_the_cli():
    d = FIXTURES / "florence2" / "tiny-a"
    model = vl.load(d)
    assert model.family == "florence2" and "od" in model.tasks
    image = str(d / "image.png")
    for task, text in [("caption", None), ("od", None), ("ocr-with-region", None), ("phrase-grounding", "a red square")]:
        extra = ["--text", text] if text else []
        cli = cli_json("--model", str(d), "--task", task, *extra, image)
        py = model.caption(image, task=task, prompt=text)
        assert py == cli, task
    od = model.caption(Image.open(image), task="<OD>")[0]
    assert set(od["<OD>"]) == {"bboxes", "labels"}


def test_a_hub_id_loads_from_the_cache(tmp_path, monkeypatch, samples):
    """`vl.load("org/name")` goes through vl's Hub client: with the Hub
    unreachable (a closed loopback port) it takes the snapshot the cache
    holds, as huggingface_hub lays it out; an id it does not hold is named."""
    snapshot = tmp_path / "hub" / "models--vl-test--shapes" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (snapshot / f).write_bytes((SHAPES / f).read_bytes())
    refs = snapshot.parent.parent / "refs"
    refs.mkdir()
    (refs / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    model = vl.load("vl-test/shapes")
    assert model.name == "vl-test/shapes"
    assert model.caption(str(samples[0])) == vl.load(SHAPES).caption(str(samples[0]))
    with pytest.raises(vl.ModelError, match="vl-test/absent.*not in the cache"):
        vl.load("vl-test/absent")
    with pytest.raises(vl.ArgumentError, match="revision"):
        vl.load(SHAPES, revision="main")

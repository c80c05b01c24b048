"""vl from Python: caption, read and detect in images with vl's Rust engine.

    import vl
    model = vl.load("models/shapes-captioner")
    model.caption(["scene.png"])
    # [{'image': 'scene.png', 'caption': 'a small red square ...', 'token_ids': [...]}]

- :func:`load` loads a checkpoint directory (vl's own, transformers'
  ViT/DeiT + GPT-2/TrOCR, BLIP, Florence-2) or a Hub id;
- :meth:`Model.caption` captions a list of images (paths, ``bytes``, PIL
  images, NumPy ``uint8`` arrays ``(H, W, 3)``), :meth:`Model.caption_iter`
  streams the results of any iterable;
- :func:`pipeline` is transformers' ``pipeline("image-to-text")``'s shape;
- :mod:`vl.ray` captions a Ray Data dataset on many machines.

The GIL is released while vl computes: other Python threads run, and
several threads may caption with one model at once. vl's CPU threads are
one per core unless ``threads`` (the first :func:`load` of the process)
says otherwise.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Union

# candle's worker pool spins this many rounds after an op before it sleeps
# (its own default, 25 000, keeps a core busy between ops): as the `vl`
# command sets it, before any pool starts.
os.environ.setdefault("CANDLE_BARRIER_POOL_SPIN_LIMIT", "2000")

from . import _vl  # noqa: E402

if os.environ.get("VL_KEEP_FREED_MEMORY", "1") != "0":
    # glibc's allocator keeps freed memory for reuse (as the `vl` command
    # does): set at import, before vl's threads start, since a thread keeps
    # the heap it first allocated from (vl.keep_freed_memory in the Rust
    # docs). A Swin page encode faulted ~1 M fresh pages without it.
    _vl.keep_freed_memory()

from ._errors import (  # noqa: E402
    ArgumentError,
    Error,
    ImageError,
    InputTypeError,
    ModelError,
)

__all__ = [
    "load",
    "Model",
    "pipeline",
    "ImageToTextPipeline",
    "Error",
    "ArgumentError",
    "InputTypeError",
    "ImageError",
    "ModelError",
]
__version__: str = _vl.__version__

#: One image: a path, encoded bytes, a PIL image or a NumPy uint8 array
#: of shape (H, W, 3).
Image = Any
Result = Dict[str, Any]


def load(
    model: Union[str, "os.PathLike[str]"],
    *,
    quantize: Optional[str] = None,
    dtype: str = "f32",
    text_cache: Optional[str] = None,
    image_cache: Optional[str] = None,
    threads: Optional[int] = None,
    revision: Optional[str] = None,
) -> "Model":
    """Loads a model to caption with.

    Args:
        model: a checkpoint directory (vl's own; transformers'
            ``VisionEncoderDecoder`` with ViT/DeiT + GPT-2/TrOCR, BLIP,
            Florence-2 in either layout), or a Hugging Face Hub id
            ``"org/name"``, fetched into the Hub's cache (``HF_HOME``,
            ``HF_ENDPOINT`` as ``huggingface_hub`` reads them).
        quantize: the linear layers' format: ``"bf16"``, ``"f16"``,
            ``"q8_0"`` or ``"q4k"`` (``None``: as stored). q8_0 is the
            fastest to decode at near-f32 quality; q4k the smallest.
        dtype: the activations' and dense weights' dtype: ``"f32"``,
            ``"f16"`` or ``"bf16"``.
        text_cache: the decoder's keys and values kept in ``"bf16"`` or
            ``"f16"`` under f32 activations (half the bytes each decode
            step reads from them, for long outputs such as a Nougat page,
            rounded as a bf16 model rounds them), ``"q8"`` (8-bit values
            with an f16 scale per 32, about half again; heads a multiple
            of 32 wide) or ``"f32"``. ``None``: when ``quantize`` converts
            the weights under f32 activations on the CPU, q8 for
            ``"q8_0"`` and ``"q4k"`` (bf16 where heads are not a multiple
            of 32 wide), the weights' type for ``"bf16"`` and ``"f16"``;
            otherwise ``dtype``.
        image_cache: the image's keys and values (projected once per
            image, read at every step), as ``text_cache``; the same
            default.
        threads: CPU threads (default: one per core). vl's thread pools
            are sized once per process, by the first ``load`` that runs
            any work; a later, different count raises
            :class:`ArgumentError`.
        revision: a Hub revision (branch, tag or commit) of ``model``.

    Raises:
        ModelError: the directory or id cannot be loaded (the message
            names the file, field or tensor at fault).
        ArgumentError: a bad ``quantize``, ``dtype``, ``text_cache``,
            ``image_cache``, ``threads`` or ``revision``.
    """
    if threads is not None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ArgumentError(f"threads={threads!r}: must be an int >= 1")
        # candle's matrix products read it; rayon's pool is sized below.
        os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
        _vl.set_threads(threads)
    native = _vl.load(
        os.fspath(model),
        quantize=quantize,
        dtype=dtype,
        text_cache=text_cache,
        image_cache=image_cache,
        revision=revision,
    )
    if os.environ.get("VL_KEEP_FREED_MEMORY", "1") != "0":
        # What the loader freed goes back to the kernel.
        _vl.return_freed_memory()
    return Model(native)


_SINGLE = (str, bytes, bytearray, os.PathLike)


def _as_list(images: Any) -> List[Image]:
    """``images`` as a list: one image alone, or a sequence of them."""
    if isinstance(images, _SINGLE) or _is_array_or_pil(images):
        return [images]
    if isinstance(images, (list, tuple)):
        return list(images)
    raise InputTypeError(
        f"images: a {type(images).__module__}.{type(images).__qualname__}; give an image "
        "(path, bytes, PIL image, uint8 array) or a list of them"
    )


def _is_array_or_pil(x: Any) -> bool:
    module = type(x).__module__
    return module.startswith("numpy") or module.startswith("PIL.")


class Model:
    """A loaded model (see :func:`load`). Safe to share between threads."""

    def __init__(self, native: "_vl.NativeModel") -> None:
        self._native = native

    def __repr__(self) -> str:
        return (
            f"vl.Model({self._native.name!r}, family={self.family!r}, "
            f"quantization={self.quantization!r})"
        )

    @property
    def name(self) -> str:
        """The directory or Hub id it was loaded from."""
        return self._native.name

    @property
    def path(self) -> str:
        """The directory of its files."""
        return os.fspath(self._native.path)

    @property
    def family(self) -> str:
        """``"vl"``, ``"vision-encoder-decoder"``, ``"blip"`` or ``"florence2"``."""
        return self._native.family

    @property
    def tasks(self) -> List[str]:
        """The tasks it takes (Florence-2's, by vl's names); empty for others."""
        return list(self._native.tasks)

    @property
    def quantization(self) -> str:
        """The format of its linear layers (``"none"`` when as stored)."""
        return self._native.quantization

    @property
    def generation(self) -> Dict[str, Any]:
        """The checkpoint's default generation settings."""
        return dict(self._native.generation)

    def caption(
        self,
        images: Union[Image, Sequence[Image]],
        *,
        max_tokens: Optional[int] = None,
        min_tokens: Optional[int] = None,
        beams: Optional[int] = None,
        length_penalty: Optional[float] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        repetition_penalty: Optional[float] = None,
        no_repeat_ngram_size: Optional[int] = None,
        seed: Optional[int] = None,
        prompt: Optional[str] = None,
        task: Optional[str] = None,
        batch_size: int = 8,
        errors: str = "raise",
    ) -> List[Result]:
        """Captions images; one result per image, in order.

        Args:
            images: an image or a list of them. An image is a path (``str``
                or ``os.PathLike``; any format the ``image`` crate reads),
                encoded file bytes (``bytes``/``bytearray``), a PIL image
                (converted to RGB), or a NumPy ``uint8`` array of shape
                ``(H, W, 3)`` in RGB order (read in place when
                C-contiguous; do not write to it while it is captioned).
            max_tokens: most tokens generated per image (default: the
                checkpoint's ``max_new_tokens``, within its positions).
            min_tokens: no end token before this many tokens.
            beams: beam search with this many beams (1: none).
            length_penalty: beam scores are ``sum_logprobs / len**p``.
            temperature: sampling temperature; 0 (or ``None`` with no
                ``top_k``/``top_p``) decodes greedily.
            top_k: sample among the k likeliest tokens.
            top_p: nucleus sampling threshold in (0, 1].
            repetition_penalty: penalise tokens already generated (1: off).
            no_repeat_ngram_size: never repeat an n-gram of this size.
            seed: the sampling seed (default 0): the same seed, the same
                captions.
            prompt: BLIP: the text the caption continues. Florence-2: the
                input of a task that takes one (a phrase to ground, a region
                as ``<loc_…>`` tokens), or without ``task`` a free prompt.
            task: Florence-2's task by vl's name or token: ``"caption"``,
                ``"detailed-caption"``, ``"more-detailed-caption"``,
                ``"ocr"``, ``"ocr-with-region"``, ``"od"``,
                ``"dense-region-caption"``, ``"region-proposal"``,
                ``"phrase-grounding"``, ``"open-vocabulary-detection"``,
                ``"region-to-description"`` … (see :attr:`Model.tasks`).
            batch_size: images captioned together (more: more images/s,
                more memory).
            errors: ``"raise"``: when an image fails, every other image is
                still captioned, then the first failure is raised (its
                class, e.g. :class:`ImageError`, with ``index`` and every
                outcome in ``results``). ``"return"``: a failed image's
                result is ``{"error": message, "error_type": class name}``
                (with ``"image"`` for a path), as ``vl caption --json``
                writes it.

        Returns:
            Per image a dict as ``vl caption --json`` writes it:
            ``caption`` (the text), ``token_ids`` (the generated ids),
            ``image`` (for a path input), and for a Florence-2 task its
            parsed output under the task's token, in the processor's keys
            (``{"<OD>": {"bboxes": [[x0, y0, x1, y1], ...], "labels":
            [...]}}``), in the input image's pixels.

        Raises:
            InputTypeError: an input of another type, or an array of
                another dtype or shape (before any work; names
                ``images[i]``).
            ArgumentError: a bad setting, prompt or task (before any work).
            ImageError: with ``errors="raise"``, an image that could not
                be read or used.
            Error: a failure of the computation itself.
        """
        items = _as_list(images)
        _check_errors(errors)
        outcomes = self._native.caption(
            items,
            settings=_settings(locals()),
            prompt=prompt,
            task=task,
            batch_size=_batch_size(batch_size),
        )
        results = [_result(i, item, o, errors) for i, (item, o) in enumerate(zip(items, outcomes))]
        if errors == "raise":
            for i, o in enumerate(outcomes):
                if isinstance(o, BaseException):
                    raise _at(o, i, results)
        return results

    def caption_iter(
        self,
        images: Iterable[Image],
        *,
        max_tokens: Optional[int] = None,
        min_tokens: Optional[int] = None,
        beams: Optional[int] = None,
        length_penalty: Optional[float] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        repetition_penalty: Optional[float] = None,
        no_repeat_ngram_size: Optional[int] = None,
        seed: Optional[int] = None,
        prompt: Optional[str] = None,
        task: Optional[str] = None,
        batch_size: int = 8,
        errors: str = "raise",
    ) -> Iterator[Result]:
        """Captions any iterable of images (a generator over a folder, a
        dataset's column) lazily: ``batch_size`` images are taken, captioned
        and their results yielded, in order, before the next are read.

        The arguments and results are :meth:`Model.caption`'s. With
        ``errors="raise"`` a failed image is raised where it comes, after
        the results before it were yielded (``index`` counts from the
        first image of the iterable).
        """
        _check_errors(errors)
        settings = _settings(locals())
        size = _batch_size(batch_size)
        chunk: List[Image] = []
        first = 0
        for item in images:
            chunk.append(item)
            if len(chunk) == size:
                yield from self._chunk(chunk, first, settings, prompt, task, size, errors)
                first += len(chunk)
                chunk = []
        if chunk:
            yield from self._chunk(chunk, first, settings, prompt, task, size, errors)

    def _chunk(
        self,
        chunk: List[Image],
        first: int,
        settings: Dict[str, Any],
        prompt: Optional[str],
        task: Optional[str],
        size: int,
        errors: str,
    ) -> Iterator[Result]:
        try:
            outcomes = self._native.caption(
                chunk, settings=settings, prompt=prompt, task=task, batch_size=size
            )
        except InputTypeError as e:
            raise _shift(e, first) from None
        for i, (item, o) in enumerate(zip(chunk, outcomes)):
            if errors == "raise" and isinstance(o, BaseException):
                raise _at(o, first + i, None)
            yield _result(first + i, item, o, errors)


_SETTINGS = (
    "max_tokens",
    "min_tokens",
    "beams",
    "length_penalty",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "seed",
)


def _settings(args: Dict[str, Any]) -> Dict[str, Any]:
    return {k: args[k] for k in _SETTINGS}


def _check_errors(errors: str) -> None:
    if errors not in ("raise", "return"):
        raise ArgumentError(f'errors={errors!r}: must be "raise" or "return"')


def _batch_size(n: Any) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ArgumentError(f"batch_size={n!r}: must be an int >= 1")
    return n


def _result(i: int, item: Image, outcome: Any, errors: str) -> Any:
    path = os.fspath(item) if isinstance(item, (str, os.PathLike)) else None
    if isinstance(outcome, BaseException):
        if errors == "raise":
            return outcome
        out: Result = {"error": str(outcome), "error_type": type(outcome).__name__}
    else:
        out = outcome
    if path is not None:
        out["image"] = path
    return out


def _at(e: BaseException, i: int, results: Optional[list]) -> BaseException:
    """``e`` (image ``i``'s failure) with its position and every outcome."""
    message = str(e)
    if not message.startswith(f"images[{i}]"):
        message = f"images[{i}]: {message}"
    if results is not None:
        failed = sum(isinstance(r, BaseException) for r in results)
        if failed > 1:
            message += f" (and {failed - 1} more of {len(results)} images failed; see .results)"
    out = type(e)(message)
    out.index = i
    out.results = results
    return out


def _shift(e: InputTypeError, first: int) -> InputTypeError:
    """An input-type error of a chunk, renumbered from the iterable's start."""
    import re

    message = re.sub(r"^images\[(\d+)\]", lambda m: f"images[{int(m.group(1)) + first}]", str(e))
    return type(e)(message)


# transformers' generate keywords and vl's names for them.
_GENERATE_KWARGS = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "num_beams": "beams",
    "length_penalty": "length_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "repetition_penalty": "repetition_penalty",
    "no_repeat_ngram_size": "no_repeat_ngram_size",
}


class ImageToTextPipeline:
    """transformers 4.x's ``ImageToTextPipeline`` shape on vl's engine:
    ``pipe(image)`` returns ``[{"generated_text": ...}]``, ``pipe([a, b])``
    one such list per image. Build it with :func:`pipeline`."""

    def __init__(self, model: Model, batch_size: int = 8) -> None:
        self.model = model
        self.batch_size = _batch_size(batch_size)

    def __repr__(self) -> str:
        return f"vl.ImageToTextPipeline({self.model!r})"

    def __call__(
        self,
        images: Union[Image, Sequence[Image]],
        max_new_tokens: Optional[int] = None,
        generate_kwargs: Optional[Dict[str, Any]] = None,
        prompt: Optional[str] = None,
        batch_size: Optional[int] = None,
    ) -> Union[List[Dict[str, str]], List[List[Dict[str, str]]]]:
        """Captions ``images`` (a path, a PIL image, or a list of them;
        bytes and NumPy arrays too).

        Args:
            max_new_tokens: most tokens per caption.
            generate_kwargs: transformers' ``generate`` settings that vl
                has: ``max_new_tokens``, ``min_new_tokens``, ``num_beams``,
                ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
                ``length_penalty``, ``repetition_penalty``,
                ``no_repeat_ngram_size``; another key raises
                :class:`ArgumentError`.
            prompt: text the caption continues (BLIP) or Florence-2's
                prompt.
            batch_size: images captioned together (default: the
                pipeline's).

        Returns:
            ``[{"generated_text": caption}]`` for one image; a list of
            those for a list of images.

        Raises:
            ImageError: an image could not be read (after the others
                were captioned; ``.results`` has every outcome).
        """
        settings: Dict[str, Any] = {}
        sample = None
        for key, value in (generate_kwargs or {}).items():
            if key == "do_sample":
                sample = bool(value)
            elif key in _GENERATE_KWARGS:
                settings[_GENERATE_KWARGS[key]] = value
            else:
                raise ArgumentError(
                    f"generate_kwargs[{key!r}]: not a setting vl has; it takes "
                    + ", ".join(["do_sample", *_GENERATE_KWARGS])
                )
        if max_new_tokens is not None:
            settings["max_tokens"] = max_new_tokens
        if sample is False:
            # Greedy (or beams) whatever sampling settings came along.
            for k in ("temperature", "top_k", "top_p"):
                settings.pop(k, None)
        elif sample and not any(k in settings for k in ("temperature", "top_k", "top_p")):
            settings["temperature"] = 1.0
        single = not isinstance(images, (list, tuple))
        items = _as_list(images)
        for i, item in enumerate(items):
            if isinstance(item, str) and item.startswith(("http://", "https://")):
                raise InputTypeError(
                    f"images[{i}]: {item}: vl does not fetch URLs; download the image and "
                    "pass its path or bytes"
                )
        results = self.model.caption(
            items, prompt=prompt, batch_size=batch_size or self.batch_size, **settings
        )
        out = [[{"generated_text": r["caption"]}] for r in results]
        return out[0] if single else out


def pipeline(
    task: str = "image-to-text",
    model: Union[str, "os.PathLike[str]", Model, None] = None,
    *,
    batch_size: int = 8,
    **load_kwargs: Any,
) -> ImageToTextPipeline:
    """transformers' ``pipeline("image-to-text", model=...)`` on vl.

    Args:
        task: ``"image-to-text"`` (also ``"image-text-to-text"``, which
            transformers 5.x routes captioning to; the results keep 4.x's
            shape without ``input_text``).
        model: a :class:`Model`, or what :func:`load` takes.
        batch_size: images captioned together.
        load_kwargs: :func:`load`'s keywords (``quantize``, ``dtype``,
            ``threads``, ``revision``).
    """
    if task not in ("image-to-text", "image-text-to-text"):
        raise ArgumentError(f"task={task!r}: vl's pipeline is 'image-to-text'")
    if model is None:
        raise ArgumentError("model: give a checkpoint directory, a Hub id or a vl.Model")
    if not isinstance(model, Model):
        model = load(model, **load_kwargs)
    elif load_kwargs:
        raise ArgumentError(
            f"{', '.join(load_kwargs)}: load options with a loaded vl.Model; pass them to vl.load"
        )
    return ImageToTextPipeline(model, batch_size=batch_size)

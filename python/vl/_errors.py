"""vl's exceptions. The native module raises these with vl's own message,
which names the culprit: the file, the tensor, the config field, the
argument, with the expected and the actual value."""

from __future__ import annotations

__all__ = ["Error", "ArgumentError", "InputTypeError", "ImageError", "ModelError"]


class Error(Exception):
    """Anything vl reports. Raised for one image of a batch, it carries
    ``index`` (the image's position) and ``results`` (every image's
    outcome: a result dict, or the exception of an image that failed), so
    that nothing already captioned is lost."""

    index: "int | None" = None
    results: "list | None" = None


class ArgumentError(Error, ValueError):
    """A bad argument: a generation setting, a task, a prompt, a format."""


class InputTypeError(ArgumentError, TypeError):
    """An input of a type vl does not take, or an array of the wrong
    dtype or shape."""


class ImageError(Error):
    """An image could not be read, decoded or used (missing, corrupt,
    too large, a size the model refuses)."""


class ModelError(Error):
    """A model could not be loaded: a missing directory, an unsupported
    checkpoint, a malformed config, weights or tokenizer."""

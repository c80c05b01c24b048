"""Type stubs of the native module ``vl._vl`` (see ``vl/__init__.py`` for
the documented API built on it)."""

import os
from typing import Any, Dict, List, Optional, Union

__version__: str

def load(
    source: Union[str, "os.PathLike[str]"],
    *,
    quantize: Optional[str] = None,
    dtype: str = "f32",
    text_cache: Optional[str] = None,
    image_cache: Optional[str] = None,
    revision: Optional[str] = None,
) -> NativeModel: ...
def set_threads(n: int) -> None: ...
def keep_freed_memory() -> None: ...
def return_freed_memory() -> None: ...

class NativeModel:
    @property
    def name(self) -> str: ...
    @property
    def path(self) -> "os.PathLike[str]": ...
    @property
    def family(self) -> str: ...
    @property
    def tasks(self) -> List[str]: ...
    @property
    def quantization(self) -> str: ...
    @property
    def generation(self) -> Dict[str, Any]: ...
    def caption(
        self,
        images: List[Any],
        *,
        settings: Dict[str, Any],
        prompt: Optional[str] = None,
        task: Optional[str] = None,
        batch_size: int = 8,
    ) -> List[Union[Dict[str, Any], BaseException]]: ...

"""The context in which NumPy allocates through pyattn's cache of large blocks (kept when freed,
handed out again for an array of their size; pyattn.nn.memory says more)."""
from __future__ import annotations

from . import _core


class cached_arrays:
    """NumPy arrays allocated in this block (in this thread or context) come from, and when
    freed go back to, pyattn's cache of large blocks. A class rather than a generator-based
    context manager: every pyattn.vjp enters it twice, and this costs a fifth as much."""

    __slots__ = ("_previous",)

    def __enter__(self) -> None:
        self._previous = _core.set_data_handler(_core.ARRAY_CACHE)

    def __exit__(self, *exc: object) -> None:
        _core.set_data_handler(self._previous)

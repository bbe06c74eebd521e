"""The context in which NumPy allocates through pyattn's cache of large blocks (kept when freed,
handed out again for an array of their size; pyattn.nn.memory says more)."""
from __future__ import annotations

import contextlib

from . import _core


@contextlib.contextmanager
def cached_arrays():
    """NumPy arrays allocated in this block (in this thread or context) come from, and when
    freed go back to, pyattn's cache of large blocks."""
    previous = _core.set_data_handler(_core.ARRAY_CACHE)
    try:
        yield
    finally:
        _core.set_data_handler(previous)

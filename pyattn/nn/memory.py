"""Reuse of large activation buffers across training steps.

A training step allocates and frees the same large arrays every step (activations, their
gradients, logits). NumPy's default allocator returns them to the system, so each step's
arrays start as fresh pages that the operating system zeroes on first touch. Inside
``cached_arrays()`` NumPy allocates through pyattn's cache instead: a freed block of 1 MiB or
more is kept (2 GiB in all at most, the oldest dropped first) and handed out again for an
array of exactly its size, from any thread. ``HybridLM.forward``, ``HybridLM.backward`` and
``cross_entropy`` run inside it, as do ``pyattn.vjp``'s forward and pullback (any dtype) and
every op call with bf16 arrays (its float32 copies);
``empty_cache()`` gives the kept blocks back. An array made
inside returns its block to the cache whenever it is freed, also after the block or after
``empty_cache()`` (the logits a caller keeps, for instance); when the system runs out of
memory for a new block, the kept ones are freed first.
"""
from __future__ import annotations

import functools

from .. import _core
from .._array_cache import cached_arrays


def with_cached_arrays(fn):
    """``fn`` run inside ``cached_arrays()``."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cached_arrays():
            return fn(*args, **kwargs)
    return wrapper


def empty_cache() -> int:
    """Frees the blocks the cache keeps; returns how many bytes that was."""
    return _core.array_cache_release()


def cached_bytes() -> int:
    """Bytes the cache keeps now."""
    return _core.array_cache_kept()

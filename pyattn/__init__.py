"""pyattn: every attention variant, softmax and linear, as C11 + OpenMP kernels for the CPU,
forward and backward, behind a NumPy API.

    import pyattn
    o = pyattn.softmax_attention(q, k, v, causal=True)
    out, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True)
    grads = pullback(do)          # {"q": dq, "k": dk, "v": dv}
"""
from __future__ import annotations

import contextlib

from . import _core, reference, testing
from .autodiff import vjp
from .delta import delta_rule, gated_delta_rule
from .feature_maps import feature_map
from .linear import (efficient_attention, gla, lightning_attention, linear_attention, mamba2,
                     retention, simple_gla)
from .softmax import softmax_attention
from ._ops import OpInfo, build_ops

__version__ = "0.1.0"

OPS = build_ops()


def set_num_threads(n: int) -> None:
    """Threads used by every kernel from now on, process-wide (default: OMP_NUM_THREADS, or
    the number of cores)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"set_num_threads(): n must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"set_num_threads(): n must be >= 1, got {n}")
    _core.set_num_threads(n)


def get_num_threads() -> int:
    """Threads the kernels use."""
    return _core.get_num_threads()


@contextlib.contextmanager
def num_threads(n: int):
    """``with pyattn.num_threads(n):`` runs the block with n threads, then restores the
    previous count. The setting is process-wide, not per Python thread."""
    previous = get_num_threads()
    set_num_threads(n)
    try:
        yield
    finally:
        _core.set_num_threads(previous)


def build_info() -> dict:
    """How this pyattn was built and what it runs: the ISA path chosen at run time ('avx512',
    'avx2' or 'generic'), the ones this CPU supports, the compiler, whether OpenMP is on,
    and the thread count."""
    return _core.build_info()


__all__ = [
    "OPS",
    "OpInfo",
    "build_info",
    "delta_rule",
    "efficient_attention",
    "feature_map",
    "gated_delta_rule",
    "get_num_threads",
    "gla",
    "lightning_attention",
    "linear_attention",
    "mamba2",
    "num_threads",
    "reference",
    "retention",
    "simple_gla",
    "testing",
    "set_num_threads",
    "softmax_attention",
    "vjp",
]

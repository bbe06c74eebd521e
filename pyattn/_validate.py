"""Argument checking shared by the op wrappers: every message names the argument, what was
expected and what was received."""
from __future__ import annotations

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
CHUNK_SIZES = (16, 32, 64, 128)


def float_arrays(fn: str, optional=(), **arrays):
    """Check that every given array is a float32/float64 ndarray (None allowed only for the
    names in ``optional``) and that all share one dtype; return C-contiguous versions (copied
    once if needed) and the dtype."""
    dtype = None
    first = None
    out = {}
    for name, a in arrays.items():
        if a is None and name in optional:
            out[name] = None
            continue
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{fn}(): '{name}' must be a numpy.ndarray, got {type(a).__name__}")
        if a.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{fn}(): '{name}' must be float32 or float64, got {a.dtype}")
        if dtype is None:
            dtype, first = a.dtype, name
        elif a.dtype != dtype:
            raise TypeError(
                f"{fn}(): all float arrays must share one dtype; '{first}' is {dtype} but "
                f"'{name}' is {a.dtype}"
            )
        out[name] = np.require(a, requirements="C")  # keeps 0-d arrays 0-d, unlike ascontiguousarray
    return out, dtype


def ndim(fn: str, name: str, a: np.ndarray, n: int, layout: str):
    if a.ndim != n:
        raise ValueError(f"{fn}(): '{name}' must be {n}-D {layout}, got shape {a.shape}")


def same(fn: str, what: str, got: dict):
    """All values of got (name -> size) must be equal."""
    vals = set(got.values())
    if len(vals) > 1:
        detail = ", ".join(f"{k}={v}" for k, v in got.items())
        raise ValueError(f"{fn}(): {what} must match, got {detail}")


def form(fn: str, value, forms: tuple):
    if value not in forms:
        raise ValueError(f"{fn}(): form must be one of {forms}, got {value!r}")
    return value


def chunk_size(fn: str, value):
    if value not in CHUNK_SIZES:
        raise ValueError(f"{fn}(): chunk_size must be one of {CHUNK_SIZES}, got {value!r}")
    return value


def integer(fn: str, name: str, value, lo: int):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fn}(): '{name}' must be an int, got {type(value).__name__}")
    if value < lo:
        raise ValueError(f"{fn}(): '{name}' must be >= {lo}, got {value}")
    return int(value)


def real(fn: str, name: str, value, lo: float = -np.inf):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{fn}(): '{name}' must be a float, got {type(value).__name__}")
    value = float(value)
    if not np.isfinite(value) or value < lo:
        raise ValueError(f"{fn}(): '{name}' must be finite and >= {lo}, got {value}")
    return value


def cu_seqlens(fn: str, name: str, cu, total: int, batch: int):
    """Validate a cu_seqlens array against the packed length; return it as int64."""
    if not isinstance(cu, np.ndarray):
        raise TypeError(f"{fn}(): '{name}' must be a numpy.ndarray, got {type(cu).__name__}")
    if cu.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"{fn}(): '{name}' must be int32 or int64, got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"{fn}(): '{name}' must be 1-D with at least 2 entries, got shape {cu.shape}")
    if batch != 1:
        raise ValueError(f"{fn}(): with '{name}' the batch size must be 1, got B={batch}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or cu[-1] != total or np.any(np.diff(cu) < 0):
        raise ValueError(
            f"{fn}(): '{name}' must start at 0, be non-decreasing and end at T={total}, got {cu.tolist()}"
        )
    return cu


def batch_offsets(batch: int, length: int):
    """cu_seqlens of a batch of equal sequences packed back to back."""
    return np.arange(batch + 1, dtype=np.int64) * length

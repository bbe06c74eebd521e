"""Normalising the rows of an array by their root mean square (RMSNorm) or their L2 norm (the
delta rule's qk_l2norm), forward and backward: one threaded C pass each, shared by the op
wrappers and pyattn.nn."""
from __future__ import annotations

from typing import Tuple

import numpy as np

from . import _core


def normalize_rows(x: np.ndarray, eps: float, mean: bool) -> Tuple[np.ndarray, np.ndarray]:
    """(x r, r) over the last axis, r = 1 / sqrt(mean(x^2) + eps) (``mean``) or
    1 / sqrt(sum(x^2) + eps); r of shape ``x.shape[:-1] + (1,)``."""
    d = x.shape[-1]
    y, r = np.empty(x.shape, x.dtype), np.empty(x.shape[:-1] + (1,), x.dtype)
    _core.rms_norm(np.ascontiguousarray(x).reshape(-1, d), eps, y.reshape(-1, d), r.reshape(-1), mean)
    return y, r


def normalize_rows_backward(dy: np.ndarray, y: np.ndarray, r: np.ndarray, mean: bool) -> np.ndarray:
    """The gradient reaching x from dy of (y, r) = normalize_rows(x, eps, mean):
    (dy - y avg(y dy)) r, avg the mean (or the sum) over the row."""
    d = y.shape[-1]
    dx = np.empty(y.shape, y.dtype)
    _core.rms_norm_backward(np.ascontiguousarray(dy, dtype=y.dtype).reshape(-1, d), y.reshape(-1, d),
                            r.reshape(-1), dx.reshape(-1, d), mean)
    return dx

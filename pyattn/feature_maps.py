"""Feature maps of linear attention, alone and differentiable (semantics: docs/ops.md)."""
from __future__ import annotations

import numpy as np

from . import _bf16, _validate as V
from ._engines import FEATURE_MAP_KINDS, feature_map_backward, feature_map_forward, feature_map_prepare
from .autodiff import register_vjp, split_cotangent

KINDS = FEATURE_MAP_KINDS


@_bf16.calls
def feature_map(x, kind, **params):
    """phi(x) over the last (feature) axis of x, as linear attention applies it to q and k.

    x: float32 or float64, ``[..., D]`` with at least one axis (``[B, T, H, D]`` for
    ``"cosformer"``, whose positions run along axis 1); D >= 1. Returns ``[..., F]`` of x's
    dtype. Kinds, with F and their parameters (any other parameter is a TypeError):

    * ``"identity"`` x; ``"elu1"`` elu(x) + 1; ``"relu"`` max(x, 0); ``"softmax"`` softmax over
      the features. F = D.
    * ``"focused"`` (FLatten; ``p``, an int >= 1, default 3): ``|r| r**p / |r**p|`` with
      r = relu(x) and |.| the L2 norm over the features; a row with no positive entry maps
      to 0. F = D.
    * ``"taylor"`` (Based): ``[1, x, vec(x x^T) / sqrt(2)]``, the full D x D outer product
      row-major, so ``phi(q).phi(k) = 1 + q.k + (q.k)**2 / 2``. F = 1 + D + D*D.
    * ``"performer"`` (FAVOR+; ``projection`` W ``[m, D]``, required, of x's dtype):
      ``phi(x) = exp(W x - |x|**2 / 2) / sqrt(m)``. F = m.
    * ``"cosformer"`` (``max_len``, a number > 0, default T): at position t = 0 .. T-1,
      ``[relu(x) cos(pi t / (2 max_len)), relu(x) sin(pi t / (2 max_len))]``. F = 2 D.

    Differentiable (``pyattn.vjp``) in x and, for performer, in ``projection``; the
    subgradient of relu at 0 is 0.
    """
    x, projection, opts = feature_map_prepare(x, kind, params)
    return feature_map_forward(x, projection, opts)


@register_vjp(feature_map)
def _feature_map_vjp(x, kind, **params):
    x, projection, opts = feature_map_prepare(x, kind, params)
    y = feature_map_forward(x, projection, opts)

    def pullback(cot):
        (dy,) = split_cotangent("feature_map", cot, 1)
        arrs, _ = V.float_arrays("feature_map pullback", ("dy",), x=x, dy=dy)
        dy = arrs["dy"]
        if dy is None:
            dy = np.zeros_like(y)
        if dy.shape != y.shape:
            raise ValueError(f"feature_map pullback: 'dy' must have shape {y.shape}, got {dy.shape}")
        dx, dprojection = feature_map_backward(x, projection, opts, dy)
        grads = {"x": dx}
        if projection is not None:
            grads["projection"] = dprojection
        return grads

    return y, pullback

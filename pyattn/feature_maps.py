"""Feature maps of linear attention, alone and differentiable (semantics: docs/ops.md)."""
from __future__ import annotations

import numpy as np

from . import _core
from . import _validate as V
from .autodiff import register_vjp, split_cotangent

KINDS = ("identity", "elu1", "relu", "softmax", "focused", "taylor", "performer", "cosformer")
_KIND_CODE = {kind: getattr(_core, "FM_" + kind.upper()) for kind in KINDS}
_PARAMS = {"focused": ("p",), "performer": ("projection",), "cosformer": ("max_len",)}


def _prepare(x, kind, params):
    """(x, projection, positional options of _core's feature map entry points)"""
    fn = "feature_map"
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"{fn}(): 'kind' must be one of {KINDS}, got {kind!r}")
    allowed = _PARAMS.get(kind, ())
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        takes = f"only {list(allowed)}" if allowed else "no parameters"
        raise TypeError(f"{fn}(): kind {kind!r} takes {takes}, got unexpected {unknown}")
    projection = params.get("projection")
    if kind == "performer" and projection is None:
        raise ValueError(f"{fn}(): kind 'performer' needs 'projection', an array [m, D]")
    arrs, _ = V.float_arrays(fn, ("projection",), x=x, projection=projection)
    x, projection = arrs["x"], arrs["projection"]
    if kind == "cosformer":
        V.ndim(fn, "x", x, 4, "[B, T, H, D]")
    elif x.ndim < 1:
        raise ValueError(f"{fn}(): 'x' must be at least 1-D [..., D], got shape {x.shape}")
    D = x.shape[-1]
    if D < 1:
        raise ValueError(f"{fn}(): 'x' needs a feature dimension D >= 1, got shape {x.shape}")
    p = V.integer(fn, "p", params.get("p", 3), 1)
    max_len = 1.0  # read by cosformer only
    if kind == "cosformer":
        given = params.get("max_len")
        if given is None:
            # with T = 0 there is no position to place; any positive value serves
            max_len = float(max(x.shape[1], 1))
        else:
            max_len = V.real(fn, "max_len", given, 0.0)
            if max_len <= 0:
                raise ValueError(f"{fn}(): 'max_len' must be > 0, got {given!r}")
    if projection is not None:
        if projection.ndim != 2 or projection.shape[1] != D or projection.shape[0] < 1:
            raise ValueError(
                f"{fn}(): 'projection' must have shape [m, D] = [m >= 1, {D}], got {projection.shape}"
            )
    return x, projection, (_KIND_CODE[kind], p, max_len)


def _out_features(kind_code, D, projection):
    if kind_code == _core.FM_TAYLOR:
        return 1 + D + D * D
    if kind_code == _core.FM_PERFORMER:
        return projection.shape[0]
    if kind_code == _core.FM_COSFORMER:
        return 2 * D
    return D


def _forward(x, projection, opts):
    y = np.empty(x.shape[:-1] + (_out_features(opts[0], x.shape[-1], projection),), dtype=x.dtype)
    _core.feature_map_forward(x, y, *opts, projection)
    return y


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
    x, projection, opts = _prepare(x, kind, params)
    return _forward(x, projection, opts)


@register_vjp(feature_map)
def _feature_map_vjp(x, kind, **params):
    x, projection, opts = _prepare(x, kind, params)
    y = _forward(x, projection, opts)

    def pullback(cot):
        (dy,) = split_cotangent("feature_map", cot, 1)
        arrs, _ = V.float_arrays("feature_map pullback", ("dy",), x=x, dy=dy)
        dy = arrs["dy"]
        if dy is None:
            dy = np.zeros_like(y)
        if dy.shape != y.shape:
            raise ValueError(f"feature_map pullback: 'dy' must have shape {y.shape}, got {dy.shape}")
        dx = np.empty_like(x)
        dprojection = None if projection is None else np.empty_like(projection)
        _core.feature_map_backward(x, dy, dx, *opts, projection, dprojection)
        grads = {"x": dx}
        if projection is not None:
            grads["projection"] = dprojection
        return grads

    return y, pullback

"""Rotary position embedding (semantics: docs/ops.md).

Half-split pairing, as GPT-NeoX, Llama's ``rotate_half`` and fla's ``RotaryEmbedding``
(``interleaved=False``): feature i of the first half and feature i + D/2 of the second half
form one pair, rotated by the angle ``p * theta ** (-2 i / D)`` at position p.
"""
from __future__ import annotations

import numpy as np

from . import _bf16, _core, _validate as V
from .autodiff import register_vjp, split_cotangent


def _angles(fn, x, positions, theta):
    """(x checked, cos, sin), the tables of ``tables`` in x's dtype."""
    arrs, dtype = V.float_arrays(fn, (), x=x)
    x = arrs["x"]
    V.ndim(fn, "x", x, 4, "[B, T, H, D]")
    B, T, H, D = x.shape
    if D % 2:
        raise ValueError(f"{fn}(): the head dim D of 'x' must be even, got D={D}")
    pos = np.asarray(positions)
    if pos.dtype.kind not in "iu":
        raise TypeError(f"{fn}(): 'positions' must be an integer array, got dtype {pos.dtype}")
    if pos.shape not in ((T,), (B, T)):
        raise ValueError(f"{fn}(): 'positions' must have shape ({T},) [T] or ({B}, {T}) [B, T], got {pos.shape}")
    theta = V.real(fn, "theta", theta, 0.0)
    if theta <= 0:
        raise ValueError(f"{fn}(): 'theta' must be > 0, got {theta}")
    return (x,) + tables(pos, D, theta, dtype)


def tables(positions, D, theta, dtype):
    """(cos, sin) of the angles over the full width, ``[T, 1, D]`` or ``[B, T, 1, D]`` in
    ``dtype``: cos repeated on both halves, sin negated on the first half (the sign of
    ``-x_{i+D/2} sin``), for integer positions ``[T]`` or ``[B, T]`` (unchecked:
    pyattn.nn's rotary layer calls this directly)."""
    # angles in float64: a float32 product p * freq loses the phase at long positions
    inv_freq = theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.asarray(positions).astype(np.float64)[..., None, None] * inv_freq
    cos, sin = np.cos(ang), np.sin(ang)
    return (np.concatenate([cos, cos], axis=-1).astype(dtype),
            np.concatenate([-sin, sin], axis=-1).astype(dtype))


def rotate(x, cos, sin, sign):
    """The rotation of x [B, T, H, D] by the angles of ``tables``' (cos, sin) (sign 1), or by
    their opposites (sign -1: the transpose, which is the backward), in one threaded C pass."""
    B, T, H, D = x.shape
    y = np.empty(x.shape, x.dtype)
    if y.size == 0:
        return y
    _core.rotary(np.ascontiguousarray(x).reshape(B * T, H, D), cos.reshape(-1, D), sin.reshape(-1, D),
                 sign, y.reshape(B * T, H, D))
    return y


@_bf16.calls
def rope(x, positions, theta=10000.0):
    """Rotary embedding: ``y[..., i] = x_i cos(a_i) - x_{i+D/2} sin(a_i)``,
    ``y[..., i+D/2] = x_{i+D/2} cos(a_i) + x_i sin(a_i)`` with ``a_i = p theta**(-2i/D)``,
    i < D/2, p the token's position.

    x ``[B, T, H, D]`` (D even, float32 or float64), positions an integer array ``[T]``
    (shared by the batch) or ``[B, T]``. The pairs are half-split (GPT-NeoX, Llama's
    ``rotate_half``, fla's default), not interleaved. The angles are computed in float64.
    Differentiable in x (``pyattn.vjp``: the rotation by the opposite angles). Returns y of
    x's shape and dtype.
    """
    x, cos, sin = _angles("rope", x, positions, theta)
    return rotate(x, cos, sin, 1)


@register_vjp(rope)
def _rope_vjp(x, positions, theta=10000.0):
    x, cos, sin = _angles("rope", x, positions, theta)

    def pullback(cot):
        (dy,) = split_cotangent("rope", cot, 1)
        dy = V.float_arrays("rope pullback", ("dy",), x=x, dy=dy)[0]["dy"]
        if dy is None:
            return {"x": np.zeros_like(x)}
        if dy.shape != x.shape:
            raise ValueError(f"rope pullback: 'dy' must have shape {x.shape}, got {dy.shape}")
        return {"x": rotate(dy, cos, sin, -1)}

    return rotate(x, cos, sin, 1), pullback

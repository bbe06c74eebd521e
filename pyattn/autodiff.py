"""The vjp registry (semantics: docs/ops.md).

``vjp(op, *args, **kwargs)`` runs the op's forward once, keeping what its C backward needs,
and returns ``(out, pullback)``. ``pullback(cotangent)`` takes a cotangent with the structure
of ``out`` (``None`` entries meaning zero) and returns a dict of gradients keyed by argument
name, one entry for every differentiable array that was given.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from . import _bf16
from ._array_cache import cached_arrays

_RULES: Dict[Callable, Callable] = {}


def register_vjp(op: Callable):
    """Decorator: ``rule(*args, **kwargs) -> (out, pullback)`` becomes ``op``'s vjp."""

    def wrap(rule: Callable) -> Callable:
        _RULES[op] = rule
        return rule

    return wrap


def vjp(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Tuple[Any, Callable[[Any], Dict[str, Any]]]:
    """Evaluate ``op(*args, **kwargs)`` and return ``(out, pullback)``.

    >>> out, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True)
    >>> grads = pullback(do)          # {"q": dq, "k": dk, "v": dv}

    ``pullback(cotangent)`` takes a cotangent shaped like ``out`` (a tuple where ``out`` is
    one; ``None`` entries, or a bare array for the first entry alone, mean zero) and returns
    ``{argument name: gradient}`` for every differentiable float array that was given, each
    of its argument's shape and dtype. A pullback may be called several times.

    The pullback keeps references to the input arrays, not copies (copying every input of
    every training step would double the memory): the backward reads them when the pullback
    runs. Arrays modified in place between the forward and the pullback (``k *= 10``, an
    optimizer step on a parameter) give silently wrong gradients, so do not modify them
    before the pullback has run; pass a copy to the forward where you must. The same holds for
    array-likes read without a copy (a contiguous float32 or float64 torch tensor). Inputs that
    the op had to copy (lists, non-contiguous, unaligned or byte-swapped arrays) are not affected.

    The forward and the pullback allocate their arrays (outputs, what the pullback keeps, the
    gradients) through pyattn's cache of large blocks (``pyattn.nn.cached_arrays``): a loop of
    training steps reuses the blocks the last step freed instead of fresh pages, which the
    system zeroes on first touch. ``pyattn.nn.empty_cache()`` gives the kept blocks back.
    """
    rule = _RULES.get(op)
    if rule is None:
        name = getattr(op, "__name__", repr(op))
        raise TypeError(f"vjp(): {name} has no registered vjp; differentiable ops: {sorted(f.__name__ for f in _RULES)}")
    if _bf16.has_bf16(args, kwargs):
        return _bf16.vjp(op, rule, args, kwargs)
    with cached_arrays():
        out, pullback = rule(*args, **kwargs)

    def cached_pullback(cot):
        with cached_arrays():
            return pullback(cot)

    return out, cached_pullback


def split_cotangent(fn: str, cot, n_out: int):
    """A cotangent as a tuple of n_out entries; a bare array stands for (array, None, ...)."""
    if isinstance(cot, (tuple, list)):
        if len(cot) != n_out:
            raise ValueError(f"{fn} pullback: expected a cotangent of {n_out} entries, got {len(cot)}")
        return tuple(cot)
    return (cot,) + (None,) * (n_out - 1)

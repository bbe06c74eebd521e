"""The vjp registry (DESIGN section 3).

``vjp(op, *args, **kwargs)`` runs the op's forward once, keeping what its C backward needs,
and returns ``(out, pullback)``. ``pullback(cotangent)`` takes a cotangent with the structure
of ``out`` (``None`` entries meaning zero) and returns a dict of gradients keyed by argument
name, one entry for every differentiable array that was given.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

_RULES: Dict[Callable, Callable] = {}


def register_vjp(op: Callable):
    """Decorator: ``rule(*args, **kwargs) -> (out, pullback)`` becomes ``op``'s vjp."""

    def wrap(rule: Callable) -> Callable:
        _RULES[op] = rule
        return rule

    return wrap


def vjp(op: Callable, *args, **kwargs) -> Tuple[Any, Callable]:
    """Evaluate ``op(*args, **kwargs)`` and return ``(out, pullback)``.

    >>> out, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True)
    >>> grads = pullback(do)          # {"q": dq, "k": dk, "v": dv}
    """
    rule = _RULES.get(op)
    if rule is None:
        name = getattr(op, "__name__", repr(op))
        raise TypeError(f"vjp(): {name} has no registered vjp; differentiable ops: {sorted(f.__name__ for f in _RULES)}")
    return rule(*args, **kwargs)


def split_cotangent(fn: str, cot, n_out: int):
    """A cotangent as a tuple of n_out entries; a bare array stands for (array, None, ...)."""
    if isinstance(cot, (tuple, list)):
        if len(cot) != n_out:
            raise ValueError(f"{fn} pullback: expected a cotangent of {n_out} entries, got {len(cot)}")
        return tuple(cot)
    return (cot,) + (None,) * (n_out - 1)

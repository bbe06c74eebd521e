"""bfloat16 calls of every op (semantics: docs/bf16.md).

An op called with ``ml_dtypes.bfloat16`` arrays (NumPy's bfloat16, the one JAX uses) stores
in bfloat16 and computes in float32: its bf16 arrays are widened to float32 (exactly: a
bf16 value is a float32 with a shorter mantissa), the float32 kernel runs, and the op's
main output ``o`` is rounded back to bf16 (to nearest, ties to even). The log-sum-exp, the
recurrent states and the other auxiliary outputs stay float32, as in PyTorch's CPU flash
attention. The arrays of such a call may be bfloat16 or float32 (keep states and per-head
parameters in float32 if you like); float64 is refused. Under ``pyattn.vjp`` each gradient
takes its argument's dtype and the cotangent may be bf16 or float32.

That is the portable path, on every CPU. Where the CPU multiplies bf16 in hardware
(AVX512-BF16 or AMX; ``pyattn.build_info()["isa"]`` says which path runs), the forward of
softmax attention's flash and parallel forms multiplies in bf16 when q, k and v are all bf16:
their values are exactly bf16, and the softmax's probabilities are rounded to bf16 for their
product with v (as PyTorch's bf16 flash attention does). So do the chunk forms' forwards of
the linear, delta and DPLR engines (q or RWKV's r, k and v bf16), whose block products round
both operands to bf16, in a plain call; under ``pyattn.vjp`` their forward multiplies in
float32, as their backward does. ``products()`` tells the kernels that they may.

A bf16 call (and its pullback) allocates its float32 copies and its outputs through pyattn's
cache of large blocks (``pyattn.nn.memory``): calls of the same shapes reuse the blocks the
previous one freed rather than fresh pages that the system zeroes first.
``pyattn.nn.empty_cache()`` returns what the cache keeps.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
from typing import Any, Callable, Dict, Tuple

import numpy as np

from . import _core
from ._array_cache import cached_arrays

# the in-place writes of an op: arguments it modifies, which must be written back into the
# caller's bf16 arrays after the float32 call
_WRITTEN = {"attention_with_kvcache": ("k_cache", "v_cache")}

# set while an op runs for a bf16 call whose q, k and v are all bf16
_PRODUCTS: contextvars.ContextVar[bool] = contextvars.ContextVar("pyattn_bf16_products", default=False)


def products() -> bool:
    """Whether the running op's q, k and v are bf16 values, so that its float32 kernels may
    multiply them (and the softmax's probabilities) in bf16."""
    return _PRODUCTS.get()


def is_bf16(a: Any) -> bool:
    """Whether ``a`` is an array (or array-like) of NumPy's bfloat16 dtype."""
    dtype: Any = getattr(a, "dtype", None)
    # NumPy's own types come first (dtype.num < 256, read in C); .name is slow Python
    return getattr(dtype, "num", 0) >= 256 and dtype.name == "bfloat16"


def _has_bf16(x: Any) -> bool:
    # on every call of every op: plain loops, the common cases first
    kind = type(x)
    if kind is np.ndarray:
        return x.dtype.num >= 256 and x.dtype.name == "bfloat16"
    if kind is list or kind is tuple:
        for e in x:
            if _has_bf16(e):
                return True
        return False
    if kind is dict:
        return _has_bf16(tuple(x.values()))
    return is_bf16(x)


def to_float32(a: Any) -> np.ndarray:
    """A bf16 array's values as a new float32 array of its shape."""
    a = np.ascontiguousarray(np.asarray(a))
    out = np.empty(a.shape, np.float32)
    _core.bf16_convert(a.reshape(-1).view(np.uint16), out.reshape(-1))
    return out


def to_bf16(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A float32 array rounded to ``dtype`` (the bfloat16 dtype), to nearest, ties to even."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    out = np.empty(a.shape, dtype)
    _core.bf16_convert(a.reshape(-1), out.reshape(-1).view(np.uint16))
    return out


def _lower(fn: str, name: str, x: Any) -> Any:
    """x with every bf16 array widened to float32 (lists, tuples and dicts entry by entry); a
    float64 array is a TypeError: a bf16 call computes in float32."""
    if isinstance(x, (list, tuple)):
        return type(x)(_lower(fn, name, e) for e in x)
    if isinstance(x, dict):
        return {key: _lower(fn, key, e) for key, e in x.items()}
    if is_bf16(x):
        return to_float32(x)
    if getattr(getattr(x, "dtype", None), "kind", None) == "f" and np.dtype(x.dtype) != np.float32:
        raise TypeError(f"{fn}(): a bfloat16 call takes bfloat16 or float32 arrays (it computes in "
                        f"float32); '{name}' is {x.dtype}")
    return x


def _bound(op: Callable, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """The call's arguments by name; a ``**params`` catch-all's entries under their own names."""
    sig = _signature(op)
    try:
        bound = sig.bind(*args, **kwargs).arguments
    except TypeError:
        return {}  # the op itself reports the bad call
    named = {}
    for name, value in bound.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


@functools.lru_cache(maxsize=None)
def _signature(op: Callable) -> inspect.Signature:
    return inspect.signature(op)


class _Call:
    """One bf16 call lowered to float32: its arguments, the bf16 dtype, and the arrays to write
    back after it."""

    def __init__(self, op: Callable, args: tuple, kwargs: dict):
        fn = op.__name__
        self.fn = fn
        self.named = _bound(op, args, kwargs)
        self.dtype = next(np.asarray(a).dtype for a in _flat(self.named.values()) if is_bf16(a))
        self.args = tuple(_lower(fn, f"argument {i}", a) for i, a in enumerate(args))
        self.kwargs = {key: _lower(fn, key, a) for key, a in kwargs.items()}
        lowered = _bound(op, self.args, self.kwargs)
        self.written = [(self.named[name], lowered[name]) for name in _WRITTEN.get(fn, ())
                        if is_bf16(self.named.get(name))]
        query = "q" if "q" in self.named else "r"  # RWKV's receptance plays the query
        self.products = all(is_bf16(self.named.get(name)) for name in (query, "k", "v"))

    def run(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs) with products() telling whether q, k, v are bf16."""
        token = _PRODUCTS.set(self.products)
        try:
            return fn(*args, **kwargs)
        finally:
            _PRODUCTS.reset(token)

    def finish(self, out):
        """The float32 call's result with its main output rounded to bf16; the caller's bf16
        arrays that the op wrote get the writes."""
        for mine, lowered in self.written:
            mine[...] = to_bf16(lowered, self.dtype)
        return _raise_main(out, self.dtype)

    def grad(self, name: str, g):
        """A gradient in its argument's dtype (lists entry by entry)."""
        given = self.named.get(name)
        if isinstance(g, list):
            given = given if isinstance(given, (list, tuple)) else [None] * len(g)
            return [to_bf16(e, self.dtype) if is_bf16(a) and e is not None else e for a, e in zip(given, g)]
        return to_bf16(g, self.dtype) if is_bf16(given) and g is not None else g


def _flat(values):
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from _flat(v)
        elif isinstance(v, dict):
            yield from _flat(v.values())
        else:
            yield v


def _raise_main(out, dtype):
    """The op's first output (o) rounded to bf16; the others (lse, states) stay float32."""
    if isinstance(out, tuple):
        return (_raise_main(out[0], dtype),) + out[1:]
    if isinstance(out, np.ndarray) and out.dtype == np.float32:
        return to_bf16(out, dtype)
    return out


def calls(op: Callable) -> Callable:
    """Decorator of a public op: a call with bf16 arrays runs the op in float32 (above)."""
    @functools.wraps(op)
    def call(*args, **kwargs):
        if not has_bf16(args, kwargs):
            return op(*args, **kwargs)
        with cached_arrays():  # the float32 copies: the same sizes call after call
            c = _Call(op, args, kwargs)
            return c.finish(c.run(op, *c.args, **c.kwargs))

    return call


def has_bf16(args: tuple, kwargs: dict) -> bool:
    """Whether a call has a bf16 array among its arguments."""
    return _has_bf16(args) or (bool(kwargs) and _has_bf16(tuple(kwargs.values())))


def vjp(op: Callable, rule: Callable, args: tuple, kwargs: dict) -> Tuple[Any, Callable]:
    """``rule``'s (out, pullback) for a bf16 call of ``op``: computed in float32, the output as
    ``calls`` gives it, each gradient in its argument's dtype."""
    with cached_arrays():
        c = _Call(op, args, kwargs)
        out, pullback = c.run(rule, *c.args, **c.kwargs)
        out = c.finish(out)

    def bf16_pullback(cot):
        with cached_arrays():
            grads = c.run(pullback, _lower(c.fn, "cotangent", cot))
            return {name: c.grad(name, g) for name, g in grads.items()}

    return out, bf16_pullback

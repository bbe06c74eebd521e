"""Argument checking shared by every op wrapper, the ones to come included.

Each function takes ``fn``, the public name of the op (``"gla"``, ``"softmax_attention
pullback"``), and the argument's own name, so that a message always reads
``fn(): 'name' must be <expected>, got <received>``. Errors are ``TypeError`` for a wrong
kind of value (not an array, not a bool, a float array of another dtype) and ``ValueError``
for a wrong value or shape of the right kind.

How an op uses it::

    arrs, dtype = V.float_arrays(fn, ("initial_state",), q=q, k=k, v=v, beta=beta, A=A,
                                 initial_state=initial_state)
    q = arrs["q"]
    V.ndim(fn, "q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    V.shape(fn, "beta", arrs["beta"], (B, T, H), "[B, T, H]")
    V.divides(fn, "k", arrs["k"].shape[2], "heads", "q", H)     # grouped heads
    A = V.per_head(fn, "A", arrs["A"], H)    # [H] or a scalar; its gradient:
                                             # V.reduce_to(dA, arrs["A"])
    scale = V.scale(fn, scale, K ** -0.5, dtype)
    window = V.int_pair(fn, "window", window, -1, "(left, right)")
    form = V.form(fn, form, FORMS)
    chunk_size = V.chunk_size(fn, chunk_size)
    output_final_state = V.boolean(fn, "output_final_state", output_final_state)

Conversions (NumPy's conventions):

* float inputs are converted with ``np.asarray``: lists and scalars are accepted. An
  ``ndarray`` keeps its dtype, and so does an array-like that carries one (``__array__`` or
  ``__dlpack__``: a torch tensor, a JAX array), converted without a copy where it can be;
  all of them in one call must share one dtype (float32 or float64; no silent casts:
  float16 and bfloat16 are refused). A tensor that requires grad is refused with a pointer
  to ``pyattn.torch``. Anything else (a list, a Python or NumPy scalar) takes that dtype,
  or float64 when no array was given. Non-contiguous, unaligned and byte-swapped arrays
  are copied once into C-contiguous, aligned, native-order ones; inputs are never modified.
* integer index arrays (``cu_seqlens``) may be any int32/int64 array-like (a list, a tensor).
* booleans must be ``bool`` or ``numpy.bool_``; integers must be Python or NumPy integers,
  not bools; floats may be any real number, not bools.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
CHUNK_SIZES = (16, 32, 64, 128)


def _native(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("=") if dtype.byteorder not in ("=", "|") else dtype


def _own_dtype(fn: str, name: str, a, expected: str):
    """``a`` as an ndarray of its own dtype when it carries one (``__array__``, ``__dlpack__``);
    anything else unchanged: ndarrays, and lists and scalars, which take the call's dtype
    (NumPy scalars have ``__array__`` but are scalars). ``expected`` names the dtypes the
    argument may have, for the message when NumPy cannot read it."""
    if isinstance(a, (np.ndarray, np.generic)) or not (hasattr(a, "__array__") or hasattr(a, "__dlpack__")):
        return a
    # torch refuses to export such a tensor with a message about .numpy() that pyattn never calls
    if getattr(a, "requires_grad", False) is True:
        raise TypeError(f"{fn}(): '{name}' is a tensor that requires grad, and the NumPy API returns "
                        f"no gradient to autograd: use pyattn.torch for torch tensors and autograd "
                        f"(or pass '{name}.detach()')")
    try:
        return np.asarray(a) if hasattr(a, "__array__") else np.from_dlpack(a)
    except (TypeError, ValueError, RuntimeError, BufferError) as e:
        # bfloat16 tensors end here (NumPy has no such dtype), and so do tensors on a GPU
        raise TypeError(f"{fn}(): '{name}' must be {expected}, got {type(a).__name__} of dtype "
                        f"{getattr(a, 'dtype', 'unknown')} that NumPy cannot read ({e})") from None


def float_arrays(fn: str, optional: Iterable[str] = (), **arrays) -> Tuple[Dict[str, Optional[np.ndarray]], np.dtype]:
    """The float inputs of one call, by name, as C-contiguous, aligned, native-order arrays
    of one dtype (float32 or float64), and that dtype. None is allowed only for the names in
    ``optional``. See the module docstring for the conversions."""
    optional = tuple(optional)
    arrays = {name: _own_dtype(fn, name, a, "float32 or float64") for name, a in arrays.items()}
    given = [(name, a) for name, a in arrays.items() if isinstance(a, np.ndarray)]
    first, dtype = (given[0][0], _native(given[0][1].dtype)) if given else ("", None)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"{fn}(): '{first}' must be float32 or float64, got {arrays[first].dtype}")
    out: Dict[str, Optional[np.ndarray]] = {}
    for name, a in arrays.items():
        if a is None:
            if name in optional:
                out[name] = None
                continue
            raise TypeError(f"{fn}(): '{name}' must be an array (numpy.ndarray or array-like), got NoneType")
        if isinstance(a, np.ndarray):
            got = _native(a.dtype)
            if got not in FLOAT_DTYPES:
                raise TypeError(f"{fn}(): '{name}' must be float32 or float64, got {a.dtype}")
            if got != dtype:
                raise TypeError(
                    f"{fn}(): all float arrays must share one dtype; '{first}' is {dtype} but "
                    f"'{name}' is {a.dtype}"
                )
        elif isinstance(a, (bool, np.bool_, str, bytes, dict, set)):
            raise TypeError(f"{fn}(): '{name}' must be an array of numbers, got {type(a).__name__}")
        else:
            try:
                a = np.asarray(a, dtype=dtype or np.float64)
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"{fn}(): '{name}' must be an array of numbers, got {type(a).__name__} ({e})"
                ) from None
        # keeps 0-d arrays 0-d, unlike ascontiguousarray; copies only when needed
        out[name] = np.require(a, dtype=_native(a.dtype), requirements=("C", "A"))
    return out, dtype or np.dtype(np.float64)


def ndim(fn: str, name: str, a: np.ndarray, n: int, layout: str) -> None:
    """``a`` has n axes; layout names them, as "[B, T, H, K]"."""
    if a.ndim != n:
        raise ValueError(f"{fn}(): '{name}' must be {n}-D {layout}, got shape {a.shape}")


def shape(fn: str, name: str, a: Optional[np.ndarray], expected: tuple, layout: str = "") -> None:
    """``a`` (when not None) has exactly the shape ``expected``; layout names its axes."""
    if a is not None and a.shape != tuple(expected):
        named = f" {layout}" if layout else ""
        raise ValueError(f"{fn}(): '{name}' must have shape {tuple(expected)}{named}, got {a.shape}")


def attention_qkv(fn: str, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> Tuple[int, ...]:
    """Softmax attention's q ``[B, Tq, H, Dk]``, k ``[B, Tk, Hk, Dk]``, v ``[B, Tk, Hk, Dv]``
    checked against each other (``H % Hk == 0``, head dims >= 1); returns (B, Tq, H, Dk, Tk,
    Hk, Dv)."""
    ndim(fn, "q", q, 4, "[B, Tq, H, Dk]")
    ndim(fn, "k", k, 4, "[B, Tk, Hk, Dk]")
    ndim(fn, "v", v, 4, "[B, Tk, Hk, Dv]")
    B, Tq, H, Dk = q.shape
    same(fn, "batch sizes", {"q": B, "k": k.shape[0], "v": v.shape[0]})
    same(fn, "key lengths", {"k": k.shape[1], "v": v.shape[1]})
    same(fn, "KV head counts", {"k": k.shape[2], "v": v.shape[2]})
    same(fn, "key head dims", {"q": Dk, "k": k.shape[3]})
    Tk, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    divides(fn, "k", Hk, "heads", "q", H)
    if Dk < 1 or Dv < 1:
        raise ValueError(f"{fn}(): head dims must be >= 1, got Dk={Dk}, Dv={Dv}")
    return B, Tq, H, Dk, Tk, Hk, Dv


def queries_keys(fn: str, q: np.ndarray, k: np.ndarray, qname: str = "q",
                 dims: str = "key head dims",
                 layouts: Tuple[str, str] = ("[B, Tq, H, Dk]", "[B, Tk, Hk, Dk]")) -> Tuple[int, ...]:
    """Queries ``[B, Tq, H, D]`` (named qname) and keys ``[B, Tk, Hk, D]`` checked against each
    other (same batch and head dim, ``H % Hk == 0``); returns (B, Tq, H, D, Tk, Hk)."""
    ndim(fn, qname, q, 4, layouts[0])
    ndim(fn, "k", k, 4, layouts[1])
    B, Tq, H, D = q.shape
    same(fn, "batch sizes", {qname: B, "k": k.shape[0]})
    same(fn, dims, {qname: D, "k": k.shape[3]})
    divides(fn, "k", k.shape[2], "heads", qname, H)
    return B, Tq, H, D, k.shape[1], k.shape[2]


def log_gate(fn: str, name: str, g: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """A log-space gate is a decay: every entry <= 0 (-inf is a full reset). NaN passes, so a
    diverging run shows NaN rather than an exception."""
    if g is not None and np.any(g > 0):
        idx = tuple(int(i) for i in np.argwhere(g > 0)[0])
        raise ValueError(f"{fn}(): '{name}' is a log-space decay and must be <= 0 (or -inf, a full "
                         f"reset), got {g[idx]!r} at index {idx}")
    return g


def finite(fn: str, name: str, a: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """Every entry of ``a`` (when not None) is finite: where a NaN or inf has no meaning
    (scores that rank positions), it is an error, not a silent pick."""
    if a is not None and not np.all(np.isfinite(a)):
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
        raise ValueError(f"{fn}(): '{name}' must be finite, got {float(a[idx])} at index {idx}")
    return a


def same(fn: str, what: str, got: dict) -> None:
    """All values of ``got`` (name -> size) are equal; what says which sizes they are."""
    vals = set(got.values())
    if len(vals) > 1:
        detail = ", ".join(f"{k}={v}" for k, v in got.items())
        raise ValueError(f"{fn}(): {what} must match, got {detail}")


def divides(fn: str, name: str, n: int, what: str, of_name: str, of_n: int,
            n_label: str = "Hk", of_label: str = "H") -> None:
    """Grouped heads: ``name`` has n of ``what`` (heads, groups), and ``of_name``'s count of_n
    must be a multiple of it. The message names the array at fault, as in "'k' has Hk=3
    heads; q's H=4 must be a multiple of it"."""
    if n < 1 or of_n % n:
        raise ValueError(f"{fn}(): '{name}' has {n_label}={n} {what}; {of_name}'s {of_label}={of_n} "
                         f"must be a multiple of it")


def per_head(fn: str, name: str, x: Optional[np.ndarray], H: int) -> Optional[np.ndarray]:
    """A per-head constant: shape (H,), or a scalar (0-d) shared by every head, returned
    broadcast to (H,) (a C-contiguous copy). The gradient of a scalar is the sum over heads:
    see ``reduce_to``."""
    if x is None:
        return None
    if x.shape == ():
        return np.full(H, x, dtype=x.dtype)
    if x.shape != (H,):
        raise ValueError(f"{fn}(): '{name}' must have shape ({H},) or be a scalar, got {x.shape}")
    return x


def reduce_to(grad: np.ndarray, like: np.ndarray) -> np.ndarray:
    """The gradient of an argument of ``like``'s shape that was broadcast to ``grad``'s (a
    scalar per_head constant, say): ``grad`` summed over the broadcast axes."""
    lead = grad.ndim - like.ndim
    g = grad.sum(axis=tuple(range(lead))) if lead else grad
    axes = tuple(i for i, n in enumerate(like.shape) if n == 1 and g.shape[i] != 1)
    return np.asarray(g.sum(axis=axes, keepdims=True) if axes else g, dtype=grad.dtype)


def form(fn: str, value, forms: Tuple[str, ...]) -> str:
    """One of the op's forms (a str)."""
    if not isinstance(value, str) or value not in forms:
        raise ValueError(f"{fn}(): form must be one of {forms}, got {value!r}")
    return value


def chunk_size(fn: str, value) -> int:
    """One of CHUNK_SIZES (an int)."""
    value = integer(fn, "chunk_size", value, 1)
    if value not in CHUNK_SIZES:
        raise ValueError(f"{fn}(): chunk_size must be one of {CHUNK_SIZES}, got {value!r}")
    return value


def boolean(fn: str, name: str, value) -> bool:
    """A flag: bool or numpy.bool_, nothing that merely has a truth value."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}(): '{name}' must be a bool (True or False), got {value!r} of type "
                        f"{type(value).__name__}")
    return bool(value)


def integer(fn: str, name: str, value, lo: int, hi: Optional[int] = None) -> int:
    """An int >= lo, and <= hi when given (Python or NumPy integer, not a bool)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fn}(): '{name}' must be an int, got {type(value).__name__}")
    if value < lo:
        raise ValueError(f"{fn}(): '{name}' must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{fn}(): '{name}' must be <= {hi}, got {value}")
    return int(value)


def int_pair(fn: str, name: str, value, lo: int, layout: str = "(a, b)") -> Tuple[int, int]:
    """Two ints >= lo, given as a tuple, a list or a 1-D array of two; layout names them in
    the message, as "(left, right)"."""
    if isinstance(value, np.ndarray) and value.shape == (2,):
        value = tuple(value)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{fn}(): '{name}' must be {layout}, got {value!r}")
    return integer(fn, f"{name}[0]", value[0], lo), integer(fn, f"{name}[1]", value[1], lo)


def real(fn: str, name: str, value, lo: float = -np.inf, dtype: Optional[np.dtype] = None) -> float:
    """A finite real >= lo (not a bool). With ``dtype``, it must also be finite in that
    dtype: a float32 call cannot take 1e39."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{fn}(): '{name}' must be a float, got {type(value).__name__}")
    value = float(value)
    if not np.isfinite(value) or value < lo:
        raise ValueError(f"{fn}(): '{name}' must be finite and >= {lo}, got {value}")
    if dtype is not None and abs(value) > float(np.finfo(dtype).max):
        raise ValueError(f"{fn}(): '{name}' = {value} overflows the inputs' dtype {np.dtype(dtype)} "
                         f"(largest finite {float(np.finfo(dtype).max):.4g})")
    return value


def scale(fn: str, value, default: float, dtype: np.dtype) -> float:
    """The score scale: ``default`` when None, else a finite real that fits ``dtype``."""
    return float(default) if value is None else real(fn, "scale", value, dtype=dtype)


def index_array(fn: str, name: str, x, ndim_: int, layout: str) -> np.ndarray:
    """An int32/int64 array-like of ``ndim_`` axes (layout names them), as int64."""
    if x is None or isinstance(x, (bool, np.bool_, str, bytes, dict, set)):
        raise TypeError(f"{fn}(): '{name}' must be an int32 or int64 array, got {type(x).__name__}")
    x = _own_dtype(fn, name, x, "int32 or int64")
    if not isinstance(x, np.ndarray):
        try:
            x = np.asarray(x)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{fn}(): '{name}' must be an int32 or int64 array, got "
                            f"{type(x).__name__} ({e})") from None
    if _native(x.dtype) not in INDEX_DTYPES:
        raise TypeError(f"{fn}(): '{name}' must be int32 or int64, got {x.dtype}")
    ndim(fn, name, x, ndim_, layout)
    return x.astype(np.int64)


def cu_seqlens(fn: str, name: str, cu, total: int, batch: int) -> np.ndarray:
    """Sequence offsets (an int32/int64 array-like [N + 1] from 0, non-decreasing, to
    ``total``; the batch must be 1), returned as int64."""
    cu = index_array(fn, name, cu, 1, "[N + 1]")
    if cu.shape[0] < 2:
        raise ValueError(f"{fn}(): '{name}' must be 1-D with at least 2 entries, got shape {cu.shape}")
    if batch != 1:
        raise ValueError(f"{fn}(): with '{name}' the batch size must be 1, got B={batch}")
    if cu[0] != 0 or cu[-1] != total or np.any(np.diff(cu) < 0):
        raise ValueError(
            f"{fn}(): '{name}' must start at 0, be non-decreasing and end at T={total}, got {cu.tolist()}"
        )
    return cu


def batch_offsets(batch: int, length: int) -> np.ndarray:
    """cu_seqlens of a batch of equal sequences packed back to back."""
    return np.arange(batch + 1, dtype=np.int64) * length

"""Checks for users and for pyattn's own tests: the relative-RMS metric, cross-form
comparison, and central finite differences.

    pyattn.testing.assert_close(o, o_ref)            # 1e-10 (float64) or 1e-5 (float32)
    pyattn.testing.check_forms("gla", (q, k, v, g), dict(initial_state=h0, output_final_state=True))
    pyattn.testing.gradcheck(pyattn.softmax_attention, (q, k, v), dict(causal=True))
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike

from .autodiff import vjp

# The numerics rules (docs/ops.md, "Numerics"): relative RMS error against the float64 oracle,
# float64 every form within 1e-10; float32 outputs within 1e-5, gradients within 1e-4.
# {dtype: (outputs, gradients)}
TOLERANCES = {np.dtype(np.float64): (1e-10, 1e-10), np.dtype(np.float32): (1e-5, 1e-4)}


def default_tolerance(*arrays) -> float:
    """The output tolerance of the least precise float dtype among ``arrays``: 1e-5 when
    any is float32 (or a narrower float), else 1e-10."""
    kinds = [np.asarray(a).dtype for a in arrays]
    low = any(d.kind == "f" and d.itemsize < 8 for d in kinds)
    return TOLERANCES[np.dtype(np.float32 if low else np.float64)][0]


def rel_rms(actual: ArrayLike, expected: ArrayLike) -> float:
    """rms(actual - expected) / rms(expected) over the finite entries of expected (0 when
    expected is all zero and actual equals it)."""
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    m = np.isfinite(b)
    if not m.any():
        return 0.0
    diff = np.sqrt(np.mean((a[m] - b[m]) ** 2))
    ref = np.sqrt(np.mean(b[m] ** 2))
    if ref == 0:
        return 0.0 if diff == 0 else float("inf")
    return float(diff / ref)


def assert_close(actual: ArrayLike, expected: ArrayLike, tol: Optional[float] = None, *,
                 atol: float = 1e-12, name: str = "value") -> float:
    """Assert ``rel_rms(actual, expected) <= tol``; for tiny outputs (rms of expected below
    ``atol``) the max absolute difference must be <= atol instead. Shapes must match, and
    non-finite entries (inf, -inf, NaN) must sit at the same places with the same values.
    ``tol`` defaults to the output tolerance of the less precise dtype of the two
    (``default_tolerance``): 1e-10 for float64, 1e-5 for float32; float32 gradients are held
    to 1e-4 (``TOLERANCES``), so pass that explicitly for them. Returns the error measured."""
    a = np.asarray(actual)
    b = np.asarray(expected)
    if tol is None:
        tol = default_tolerance(a, b)
    if a.shape != b.shape:
        raise AssertionError(f"{name}: shape {a.shape} != expected {b.shape}")
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    fa, fb = np.isfinite(a64), np.isfinite(b64)
    if not np.array_equal(fa, fb):
        bad = np.argwhere(fa != fb)[:5].tolist()
        raise AssertionError(f"{name}: finite/non-finite entries differ, e.g. at {bad}")
    nonfinite = ~fb
    if nonfinite.any() and not np.array_equal(a64[nonfinite], b64[nonfinite], equal_nan=True):
        raise AssertionError(f"{name}: non-finite entries differ")
    if not fb.any():
        return 0.0
    rms_ref = float(np.sqrt(np.mean(b64[fb] ** 2)))
    if rms_ref < atol:
        err = float(np.max(np.abs(a64[fb] - b64[fb])))
        if not err <= atol:
            raise AssertionError(f"{name}: max abs error {err:.3e} > atol {atol:.1e} (tiny output)")
        return err
    err = rel_rms(a64, b64)
    if not err <= tol:
        raise AssertionError(f"{name}: relative RMS error {err:.3e} > {tol:.1e}")
    return err


def _resolve(op) -> Tuple[Callable, Sequence[str], Sequence[str], Sequence[str]]:
    """(callable, positional array names, differentiable names, forms) of an op or op name."""
    from . import OPS

    info = OPS[op] if isinstance(op, str) else next((i for i in OPS.values() if i.fn is op), None)
    if info is not None:
        return info.fn, info.arrays, info.differentiable, info.forms
    params = [p.name for p in inspect.signature(op).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return op, params, params, ()


def _as_tuple(out):
    return tuple(out) if isinstance(out, tuple) else (out,)


def _random_cotangent(out, rng):
    """Random cotangent shaped like out (a tuple when out is), zero where out is not finite."""
    parts = []
    for o in _as_tuple(out):
        if o is None:
            parts.append(None)
            continue
        c = rng.standard_normal(o.shape).astype(o.dtype)
        parts.append(np.where(np.isfinite(o), c, 0).astype(o.dtype))
    return tuple(parts) if isinstance(out, tuple) else parts[0]


def _entries(name: str, value) -> List[Tuple[str, Any]]:
    """(key, value) of an argument or a gradient: itself under its name, or, for a list or
    tuple (merge_attention_states' ``os``), each entry under ``name[i]``."""
    if isinstance(value, (list, tuple)):
        return [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return [(name, value)]


def _flat(named: Dict[str, Any]) -> Dict[str, Any]:
    """A dict of arrays and lists of arrays keyed per array, ``name`` or ``name[i]``."""
    return {key: v for name, value in named.items() for key, v in _entries(name, value)}


def _inputs(names, args, kwargs) -> Dict[str, Tuple[str, np.ndarray]]:
    """The float arrays given, positional and keyword, entries of lists included:
    {key (``name`` or ``name[i]``): (argument name, array)}."""
    given = {**dict(zip(names, args)), **kwargs}
    return {key: (name, a) for name, value in given.items() for key, a in _entries(name, value)
            if isinstance(a, np.ndarray) and a.dtype.kind == "f"}


def check_forms(op: Union[str, Callable[..., Any]], args: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None, *,
                forms: Optional[Sequence[str]] = None,
                tol: Optional[Tuple[float, float]] = None, seed: int = 0) -> Dict[str, Dict[str, float]]:
    """Run every form of ``op`` (an OPS name or callable) on the same inputs through
    ``pyattn.vjp``, pull back one random cotangent (outputs and final state), and compare
    every output and every gradient with the first form's. ``tol = (outputs, gradients)``
    defaults to the per-dtype tolerances (TOLERANCES). Returns {form: {entry: error}}; raises
    AssertionError on the first entry out of tolerance."""
    kwargs = dict(kwargs or {})
    fn, names, _, op_forms = _resolve(op)
    forms = list(forms or op_forms)
    if len(forms) < 2:
        raise ValueError(f"check_forms(): need at least two forms, got {forms}")
    dtype = next(a.dtype for a in args if isinstance(a, np.ndarray))
    tol_out, tol_grad = tol or TOLERANCES[np.dtype(dtype)]
    rng = np.random.default_rng(seed)
    results, base, cot = {}, None, None
    for form in forms:
        out, pullback = vjp(fn, *args, **{**kwargs, "form": form})
        if cot is None:
            cot = _random_cotangent(out, rng)
        grads = pullback(cot)
        entries = {f"out[{i}]": o for i, o in enumerate(_as_tuple(out)) if o is not None}
        entries.update({f"d{k}": g for k, g in _flat(grads).items()})
        if base is None:
            base = entries
            continue
        errs = {}
        for key, ref in base.items():
            t = tol_out if key.startswith("out") else tol_grad
            errs[key] = assert_close(entries[key], ref, t, name=f"{form} vs {forms[0]}: {key}")
        results[form] = errs
    return results


def finite_differences(loss: Callable[[], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences ``(loss() at x + eps e_i - loss() at x - eps e_i) / (2 eps)`` for
    every entry i of x, which ``loss`` reads: x is perturbed in place, one entry at a time, and
    restored."""
    num = np.zeros_like(x)
    flat, nflat = x.reshape(-1), num.reshape(-1)
    for i in range(flat.size):
        orig = flat[i]
        flat[i] = orig + eps
        up = loss()
        flat[i] = orig - eps
        down = loss()
        flat[i] = orig
        nflat[i] = (up - down) / (2 * eps)
    return num


def gradcheck(op: Union[str, Callable[..., Any]], args: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None, *,
              wrt: Optional[Sequence[str]] = None,
              eps: float = 1e-6, atol: float = 1e-5, rtol: float = 1e-3, seed: int = 0) -> Dict[str, float]:
    """Compare ``pyattn.vjp``'s gradients with central finite differences of
    ``sum(out * cotangent)`` for every element of every differentiable float input (or those
    named in ``wrt``). An argument that is a list or tuple of arrays (merge_attention_states'
    ``os``) is checked entry by entry against ``grads[name][i]``, reported as ``name[i]``
    (``wrt`` takes either form). float64 inputs only (torch.autograd.gradcheck's defaults:
    eps 1e-6, atol 1e-5, rtol 1e-3). Returns {name: max |vjp - fd|}; raises AssertionError
    where ``|vjp - fd| > atol + rtol |fd|``."""
    fn, names, _, _ = _resolve(op)

    def own(a):  # a private contiguous copy, perturbed in place below
        if isinstance(a, (list, tuple)):
            return type(a)(own(x) for x in a)
        return np.array(a, copy=True, order="C") if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a

    args = [own(a) for a in args]
    kwargs = {k: own(v) for k, v in (kwargs or {}).items()}
    arrays = _inputs(names, args, kwargs)
    for key, (_, a) in arrays.items():
        if a.dtype != np.float64:
            raise TypeError(f"gradcheck(): '{key}' must be float64, got {a.dtype}")
    rng = np.random.default_rng(seed)
    out, pullback = vjp(fn, *args, **kwargs)
    cot = _random_cotangent(out, rng)
    grads = _flat(pullback(cot))
    if wrt is None:
        targets = [key for key in arrays if key in grads]
    else:
        targets = [key for key, (name, _) in arrays.items() if key in wrt or name in wrt]
        unknown = [n for n in wrt if not any(n in (key, name) for key, (name, _) in arrays.items())]
        if unknown:
            raise ValueError(f"gradcheck(): 'wrt' names no float array argument given: {unknown}")
    missing = [n for n in targets if n not in grads]
    if missing:
        raise AssertionError(f"gradcheck(): vjp gave no gradient for {missing}")

    def loss() -> float:
        o = _as_tuple(fn(*args, **kwargs))
        c = _as_tuple(cot)
        total = 0.0
        for oi, ci in zip(o, c):
            if oi is None or ci is None:
                continue
            total += float(np.sum(np.where(np.isfinite(oi), oi, 0) * ci))
        return total

    errors = {}
    for key in targets:
        num = finite_differences(loss, arrays[key][1], eps)
        diffs = np.abs(grads[key] - num)
        bound = atol + rtol * np.abs(num)
        errors[key] = float(diffs.max()) if diffs.size else 0.0
        if np.any(diffs > bound):
            worst = np.unravel_index(np.argmax(diffs - bound), diffs.shape)
            raise AssertionError(
                f"gradcheck(): d{key} at {tuple(int(i) for i in worst)}: vjp {grads[key][worst]:.6e}, "
                f"finite differences {num[worst]:.6e}"
            )
    return errors

"""The self-check report behind ``python -m pyattn``: for every op in pyattn.OPS and each of
its forms, the error against the float64 oracle (float32 and float64), a finite-difference
gradient check (float64), the float32 gradients against the float64 ones, and timings."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List

import numpy as np

from . import OPS, build_info, get_num_threads, reference
from .autodiff import vjp
from .testing import TOLERANCES, _as_tuple, _random_cotangent, gradcheck, rel_rms


@dataclass
class Row:
    op: str
    form: str
    err64: float
    err32: float
    grad_fd: str
    grad32: float
    fwd_ms: float
    fwd_bwd_ms: float
    ok: bool


def _max_err(outs, refs) -> float:
    return max(rel_rms(o, r) for o, r in zip(_as_tuple(outs), _as_tuple(refs)) if o is not None)


def _cast(args, kwargs, dtype):
    def c(x):
        return x.astype(dtype) if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x

    return [c(a) for a in args], {k: c(v) for k, v in kwargs.items()}


def _time(fn, min_time=0.05) -> float:
    fn()
    runs, t0 = 0, time.perf_counter()
    while True:
        fn()
        runs += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time:
            return elapsed / runs * 1e3


def check_op(name: str, seed: int = 0) -> List[Row]:
    info = OPS[name]
    rng = np.random.default_rng(seed)
    args, kwargs = info.example(rng, np.float64)
    ref = getattr(reference, name)(*args, **kwargs)
    tiny_args, tiny_kwargs = info.example(np.random.default_rng(seed + 1), np.float64, tiny=True)
    args32, kwargs32 = _cast(args, kwargs, np.float32)
    rows = []
    for form in info.forms:
        kw64, kw32 = {**kwargs, "form": form}, {**kwargs32, "form": form}
        out64, pull64 = vjp(info.fn, *args, **kw64)
        out32, pull32 = vjp(info.fn, *args32, **kw32)
        err64, err32 = _max_err(out64, ref), _max_err(out32, ref)
        cot = _random_cotangent(out64, np.random.default_rng(seed + 2))
        g64 = pull64(cot)
        g32 = pull32(tuple(None if c is None else c.astype(np.float32) for c in _as_tuple(cot))
                     if isinstance(cot, tuple) else cot.astype(np.float32))
        grad32 = max(rel_rms(g32[k], g64[k]) for k in g64)
        try:
            fd = gradcheck(info.fn, tiny_args, {**tiny_kwargs, "form": form})
            grad_fd, fd_ok = f"ok {max(fd.values()):.1e}", True
        except AssertionError as e:
            grad_fd, fd_ok = f"FAIL: {e}", False
        fwd_ms = _time(lambda: info.fn(*args32, **kw32))
        fwd_bwd_ms = _time(lambda: vjp(info.fn, *args32, **kw32)[1](
            tuple(None if c is None else c.astype(np.float32) for c in _as_tuple(cot))
            if isinstance(cot, tuple) else cot.astype(np.float32)))
        tol64 = TOLERANCES[np.dtype(np.float64)][0]
        tol32, tol32_grad = TOLERANCES[np.dtype(np.float32)]
        ok = err64 <= tol64 and err32 <= tol32 and grad32 <= tol32_grad and fd_ok
        rows.append(Row(name, form, err64, err32, grad_fd, grad32, fwd_ms, fwd_bwd_ms, ok))
    return rows


def format_table(rows: List[Row]) -> str:
    head = ("op", "form", "err f64", "err f32", "grad vs finite diff (f64)", "grad f32 vs f64",
            "fwd ms", "fwd+bwd ms", "")
    body = [(r.op, r.form, f"{r.err64:.1e}", f"{r.err32:.1e}", r.grad_fd, f"{r.grad32:.1e}",
             f"{r.fwd_ms:.2f}", f"{r.fwd_bwd_ms:.2f}", "ok" if r.ok else "FAIL") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def main() -> int:
    info = build_info()
    print(f"pyattn self-check: isa={info['isa']} (available {', '.join(info['isas_available'])}), "
          f"openmp={info['openmp']}, threads={get_num_threads()}, compiler: {info['compiler']}")
    t64, _ = TOLERANCES[np.dtype(np.float64)]
    t32, t32g = TOLERANCES[np.dtype(np.float32)]
    print(f"errors: relative RMS against the float64 oracle (pyattn.reference); pass if f64 <= {t64:.0e}, "
          f"f32 <= {t32:.0e}, f32 grads <= {t32g:.0e} of f64 grads, finite differences within "
          f"atol 1e-5 + rtol 1e-3; times are float32 on the example shapes\n")
    rows = []
    for name in OPS:
        rows += check_op(name)
    print(format_table(rows))
    failed = [f"{r.op}/{r.form}" for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0

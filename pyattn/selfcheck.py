"""The self-check report behind ``python -m pyattn``: for every op in pyattn.OPS and each of
its forms, the error against the float64 oracle (float32 and float64), a finite-difference
gradient check (float64), the float32 gradients against the float64 ones, and timings. An op
that pyattn.vjp refuses (no differentiable argument) gets its forward checked and "-" in the
gradient columns."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from . import OPS, build_info, get_num_threads, set_num_threads
from .autodiff import vjp
from .training import add_commands
from .testing import TOLERANCES, _as_tuple, _entries, _flat, _random_cotangent, gradcheck, rel_rms


@dataclass
class Row:
    op: str
    form: str
    err64: float
    err32: float
    grad_fd: str
    grad32: Optional[float]  # None (shown "-") for an op without gradients, as fwd_bwd_ms
    fwd_ms: float
    fwd_bwd_ms: Optional[float]
    ok: bool


def _err(out, ref) -> float:
    """The relative RMS error of a float output; an integer output (dsa_select's rows) must
    equal the oracle's: error 0, else inf."""
    if np.asarray(ref).dtype.kind in "iu":
        return 0.0 if out.dtype.kind in "iu" and np.array_equal(out, ref) else float("inf")
    return rel_rms(out, ref)


def _max_err(outs, refs) -> float:
    return max(_err(o, r) for o, r in zip(_as_tuple(outs), _as_tuple(refs)) if o is not None)


def _cast(args, kwargs, dtype):
    def c(x):
        if isinstance(x, list):
            return [c(e) for e in x]
        return x.astype(dtype) if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x

    return [c(a) for a in args], {k: c(v) for k, v in kwargs.items()}


def _time(fn, warmup: int = 3, min_time: float = 0.05) -> float:
    """Median milliseconds of fn() after ``warmup`` untimed calls (first-touch page faults,
    the thread pool's start, caches), over runs lasting at least min_time in all."""
    for _ in range(warmup):
        fn()
    times: List[float] = []
    while sum(times) < min_time or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _shapes(names: Sequence[str], args, kwargs) -> str:
    """The array arguments of a call, positional (named by ``names``) then keyword, as
    'name[d0,d1,...]'."""
    given = [e for n, a in list(zip(names, args)) + list(kwargs.items()) for e in _entries(n, a)]
    return " ".join(f"{n}[{','.join(str(d) for d in a.shape)}]" for n, a in given if isinstance(a, np.ndarray))


def _options(kwargs) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if not isinstance(v, np.ndarray))


def check_op(name: str, seed: int = 0) -> List[Row]:
    info = OPS[name]
    rng = np.random.default_rng(seed)
    args, kwargs = info.example(rng, np.float64)
    ref = info.reference(*args, **kwargs)
    tiny_args, tiny_kwargs = info.example(np.random.default_rng(seed + 1), np.float64, tiny=True)
    args32, kwargs32 = _cast(args, kwargs, np.float32)
    tol64 = TOLERANCES[np.dtype(np.float64)][0]
    tol32, tol32_grad = TOLERANCES[np.dtype(np.float32)]
    rows = []
    for form, form_kw in info.form_calls():
        kw64, kw32 = {**kwargs, **form_kw}, {**kwargs32, **form_kw}
        if not info.differentiable:
            err64 = _max_err(info.fn(*args, **kw64), ref)
            err32 = _max_err(info.fn(*args32, **kw32), ref)
            fwd_ms = _time(lambda: info.fn(*args32, **kw32))
            rows.append(Row(name, form, err64, err32, "-", None, fwd_ms, None, err64 <= tol64 and err32 <= tol32))
            continue
        out64, pull64 = vjp(info.fn, *args, **kw64)
        out32, pull32 = vjp(info.fn, *args32, **kw32)
        err64, err32 = _max_err(out64, ref), _max_err(out32, ref)
        cot = _random_cotangent(out64, np.random.default_rng(seed + 2))
        g64 = _flat(pull64(cot))
        g32 = _flat(pull32(tuple(None if c is None else c.astype(np.float32) for c in _as_tuple(cot))
                           if isinstance(cot, tuple) else cot.astype(np.float32)))
        grad32 = max(rel_rms(g32[k], g64[k]) for k in g64)
        try:
            fd = gradcheck(info.fn, tiny_args, {**tiny_kwargs, **form_kw})
            grad_fd, fd_ok = f"ok {max(fd.values()):.1e}", True
        except AssertionError as e:
            grad_fd, fd_ok = f"FAIL: {e}", False
        fwd_ms = _time(lambda: info.fn(*args32, **kw32))
        fwd_bwd_ms = _time(lambda: vjp(info.fn, *args32, **kw32)[1](
            tuple(None if c is None else c.astype(np.float32) for c in _as_tuple(cot))
            if isinstance(cot, tuple) else cot.astype(np.float32)))
        ok = err64 <= tol64 and err32 <= tol32 and grad32 <= tol32_grad and fd_ok
        rows.append(Row(name, form, err64, err32, grad_fd, grad32, fwd_ms, fwd_bwd_ms, ok))
    return rows


def format_table(rows: List[Row]) -> str:
    head = ("op", "form", "err f64", "err f32", "grad vs finite diff (f64)", "grad f32 vs f64",
            "fwd ms", "fwd+bwd ms", "result")
    body = [(r.op, r.form, f"{r.err64:.1e}", f"{r.err32:.1e}", r.grad_fd,
             "-" if r.grad32 is None else f"{r.grad32:.1e}", f"{r.fwd_ms:.2f}",
             "-" if r.fwd_bwd_ms is None else f"{r.fwd_bwd_ms:.2f}", "ok" if r.ok else "FAIL") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def format_shapes(names: Sequence[str], seed: int = 0) -> str:
    """What each op is checked on: the example call (oracle errors, float32 gradients,
    timings) and the tiny one (finite differences)."""
    lines = []
    for name in names:
        info = OPS[name]
        args, kwargs = info.example(np.random.default_rng(seed), np.float64)
        tiny_args, tiny_kwargs = info.example(np.random.default_rng(seed + 1), np.float64, tiny=True)
        lines.append(f"  {name}: {_shapes(info.arrays, args, kwargs)}; finite differences on "
                     f"{_shapes(info.arrays, tiny_args, tiny_kwargs)}")
        if _options(kwargs):
            lines.append(f"    options: {_options(kwargs)}")
    return "\n".join(lines)


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=_op_list, default=list(OPS), metavar="NAME[,NAME...]",
                        help="ops to check (default: all of pyattn.OPS: %(default)s)")
    parser.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                        help="threads for the kernels (default: pyattn's, from OMP_NUM_THREADS or the CPUs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {n}")
    return n


def _op_list(text: str) -> List[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in OPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown op {unknown or text!r}; choose from {', '.join(OPS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """``python -m pyattn [check] [options]``; ``check`` is the default command. Further
    commands (``train``, ``generate``: pyattn.training.add_commands) are subparsers added here."""
    parser = argparse.ArgumentParser(
        prog="python -m pyattn",
        description="pyattn's command line. Without a command it runs 'check'.",
        epilog="'python -m pyattn check --help' lists the options of the self-check.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    check = commands.add_parser(
        "check", help="the self-check report (default)",
        description="Checks every op and form against the float64 oracle (pyattn.reference) in "
                    "float64 and float32, its gradients against finite differences (float64) and "
                    "float32 against float64, and times the float32 forward and forward+backward "
                    "(median after warm-up calls). Exits 1 if any check fails.")
    add_check_arguments(check)
    check.set_defaults(run=run_check)
    add_commands(commands)
    return parser


def run_check(opts: argparse.Namespace) -> int:
    if opts.threads is not None:
        set_num_threads(opts.threads)
    info = build_info()
    print(f"pyattn self-check: isa={info['isa']} (available {', '.join(info['isas_available'])}), "
          f"openmp={info['openmp']}, threads={get_num_threads()}, compiler: {info['compiler']}")
    t64, _ = TOLERANCES[np.dtype(np.float64)]
    t32, t32g = TOLERANCES[np.dtype(np.float32)]
    print(f"errors: relative RMS against the float64 oracle (pyattn.reference); pass if f64 <= {t64:.0e}, "
          f"f32 <= {t32:.0e}, f32 grads <= {t32g:.0e} of f64 grads, finite differences within "
          f"atol 1e-5 + rtol 1e-3; integer outputs must equal the oracle's (error 0, else inf); "
          f"'-': the op has no gradient; times: float32, median ms after 3 warm-up calls")
    print("shapes checked, every form of each op (float64 and float32):")
    print(format_shapes(opts.ops, opts.seed) + "\n")
    rows = []
    for name in opts.ops:
        rows += check_op(name, opts.seed)
    print(format_table(rows))
    failed = [f"{r.op}/{r.form}" for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["check"] + argv
    opts = build_parser().parse_args(argv)
    return opts.run(opts)

"""Shared helpers for pyattn's benchmarks (what they report: README, "Benchmarks").

Import this module *before* numpy (the benchmark scripts do): it sets
``OPENBLAS_NUM_THREADS=1`` in the environment first, so numpy's BLAS, which the benchmarks
only use as a single-thread reference, runs on one thread. OpenBLAS reads that variable
once, when numpy is first imported; ``numpy_blas_threads()`` reads the count back from the
loaded library to check. pyattn's and torch's thread counts are set explicitly with
``set_threads`` (their ``set_num_threads``), not through the environment.

Timing (``measure``): every case is called once untimed to warm up (thread pool start, page
faults, lazy initialisation). A *sample* is one call timed with ``time.perf_counter``, or,
for calls shorter than 10 ms, a batch of back-to-back calls timed together and divided by
their number. The warm-up time picks the sample count so that each case gets about
``target_s`` seconds of timed runs (clamped to ``[min_reps, max_reps]``: a slow case gets
``min_reps`` samples). The reported figure is the **median** of the samples (the minimum is
printed too). The cases of one row (pyattn, numpy, torch) are measured interleaved, sample
by sample, so that a load change on the machine hits them alike. A case may have an untimed
``setup`` that builds fresh inputs for every call; nothing is cached across calls.

Shared machines: ``LoadMonitor`` measures the CPU time other processes took, over windows of
rounds lasting >= 0.25 s (/proc/stat counts 10 ms ticks). A sample in a window where they
took more than 5% of the CPUs is *disturbed*; ``measure``
takes extra samples (within a per-run budget) until each case has 3 quiet ones, and the
figures come from the quiet samples alone (from all of them if too few were quiet). It also
waits briefly (capped per run) for quiet moments. The tables print "samples" as used/taken
and "other %" as the largest foreign load among the samples used: above 5 means the row's
figure was taken on a busy machine.
"""
from __future__ import annotations

import os
import sys

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy is imported anywhere

import argparse  # noqa: E402
import ctypes  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Callable, List, Optional, Sequence  # noqa: E402

if "numpy" in sys.modules:  # pragma: no cover - a warning, not an error
    print("warning: numpy was imported before benchmarks.common; numpy's BLAS may use "
          "more than one thread", file=sys.stderr)

import numpy as np  # noqa: E402

import pyattn  # noqa: E402
from pyattn import _core  # noqa: E402

# ---- optional torch ---------------------------------------------------------------------

try:  # torch is a benchmark-only, optional comparison
    import torch  # noqa: E402
except Exception:  # ImportError, or a broken install
    torch = None

NA = "n/a"


def have_torch() -> bool:
    return torch is not None


# ---- threads ------------------------------------------------------------------------------


def set_threads(n: int) -> None:
    """The same intra-op thread count for pyattn and torch (when torch is installed)."""
    pyattn.set_num_threads(n)
    if torch is not None:
        torch.set_num_threads(n)
        if torch.get_num_threads() != n:
            raise RuntimeError(f"torch.set_num_threads({n}) did not take: {torch.get_num_threads()}")
    if pyattn.get_num_threads() != n:
        raise RuntimeError(f"pyattn.set_num_threads({n}) did not take: {pyattn.get_num_threads()}")


def numpy_blas_threads() -> Optional[int]:
    """Threads of the OpenBLAS that numpy loaded, read from the library; None if unknown."""
    fn = _openblas_fn(("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                       "openblas_get_num_threads64_", "openblas_get_num_threads"))
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    return int(fn())


def _openblas_fn(names: Sequence[str]):
    """The first of ``names`` exported by an OpenBLAS that numpy loaded, or None."""
    try:
        paths = {line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line}
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                return fn
    return None


# ---- machine peak -------------------------------------------------------------------------


def fma_peak(dtype, threads: int, seconds: float = 0.3, tries: int = 3) -> float:
    """GFLOP/s of independent FMA chains on ``threads`` threads (``_core.fma_peak``), for
    float32 or float64 with pyattn's run-time ISA: the best of ``tries`` measurements (a
    disturbed try can only be slower)."""
    is_double = np.dtype(dtype) == np.float64
    wait_quiet(5.0)
    return max(_core.fma_peak(bool(is_double), float(seconds), int(threads)) for _ in range(tries))


def read_bandwidth(threads: int, seconds: float = 0.5, nbytes: int = 512 << 20) -> float:
    """GB/s reading a buffer of ``nbytes`` (far beyond the caches) on ``threads`` threads
    (``_core.read_bandwidth``: the best pass over ``seconds``)."""
    return _core.read_bandwidth(float(seconds), int(threads), int(nbytes))


def threads_line(extra: str = "") -> str:
    """The thread counts pyattn and torch run with (after set_threads)."""
    line = f"threads: pyattn={pyattn.get_num_threads()}, torch={torch.get_num_threads() if torch is not None else NA}"
    return line + (f", {extra}" if extra else "")


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        fields = {}
        for line in open("/proc/cpuinfo"):
            if not line.strip():
                break
            k, _, v = line.partition(":")
            fields[k.strip()] = v.strip()
        cpu = (f"{fields.get('model name', cpu)} (family {fields.get('cpu family', '?')} "
               f"model {fields.get('model', '?')})")
    except OSError:
        pass
    info = pyattn.build_info()
    parts = [f"cpu: {cpu}, {os.cpu_count()} logical CPUs",
             f"pyattn {pyattn.__version__} isa={info.get('isa')} openmp={info.get('openmp')}",
             f"numpy {np.__version__} (BLAS threads: {numpy_blas_threads()})",
             f"torch {torch.__version__}" if torch is not None else "torch: not installed"]
    try:
        load = os.getloadavg()
        parts.append("load avg %.2f %.2f %.2f" % load)
    except OSError:
        pass
    return "; ".join(parts) + "\n" + build_line()


# ---- load from other processes -----------------------------------------------------------


class LoadMonitor:
    """CPU time that *other* processes took while a measurement ran, as a fraction of the
    machine (all CPUs): the system's busy time from /proc/stat less this process's own CPU
    time (os.times). A benchmark on a shared machine is only as good as this is small; rows
    taken under load are marked. None where /proc/stat is unreadable."""

    HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self):
        self.start = self._snap()

    @classmethod
    def _snap(cls):
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        busy = sum(v[:8]) - idle  # user nice system idle iowait irq softirq steal
        t = os.times()
        return busy / cls.HZ, (busy + idle) / cls.HZ, t.user + t.system

    def other(self) -> Optional[float]:
        end = self._snap()
        if self.start is None or end is None:
            return None
        busy, total, mine = (e - s for e, s in zip(end, self.start))
        if total <= 0:
            return None
        return max(0.0, min(1.0, (busy - mine) / total))


def load_footer(others: Sequence[Optional[float]]) -> str:
    """A line on the foreign load of the measured rows (their "other %" values)."""
    known = [o for o in others if o is not None]
    if not known:
        return "other processes' load during the rows: unknown (no /proc/stat)"
    bad = sum(o > QUIET["max_other"] for o in known)
    line = (f"other processes' load during the rows: max {100 * max(known):.0f}% of the "
            f"machine; {bad} of {len(known)} rows above {100 * QUIET['max_other']:.0f}%")
    if bad:
        line += " -- WARNING: those rows were disturbed by other work on the machine"
    return line


def load_cell(frac: Optional[float]) -> str:
    return NA if frac is None else f"{100 * frac:.0f}"


# ---- timing -------------------------------------------------------------------------------


QUIET = {
    "max_other": 0.05,        # a sample is quiet if other processes took <= 5% of the CPUs
    "min_quiet": 3,           # quiet samples a case needs before its disturbed ones are dropped
    "wait_budget_s": 120.0,   # seconds a run may spend waiting for quiet moments, in all
    "extra_budget_s": 150.0,  # seconds a run may spend on extra samples replacing disturbed ones
}


@dataclass
class Case:
    """One timed thing. ``run(state)`` is timed; ``setup()`` (untimed) makes a fresh ``state``
    for every call (no setup: ``run`` gets None). ``times`` holds the seconds per call of
    each sample, ``loads`` the share of the CPUs other processes took during it."""
    name: str
    run: Callable[[Any], Any]
    setup: Optional[Callable[[], Any]] = None
    times: List[float] = field(default_factory=list)
    loads: List[Optional[float]] = field(default_factory=list)
    inner: int = 1

    def sample(self, calls: int) -> float:
        """Seconds per call of ``calls`` back-to-back calls, timed together; the states
        are made beforehand, one per call, outside the timed region. Records the time."""
        states = [self.setup() if self.setup is not None else None for _ in range(calls)]
        t0 = time.perf_counter()
        for s in states:
            self.run(s)
        t1 = time.perf_counter()
        del states
        t = (t1 - t0) / calls
        self.times.append(t)
        self.loads.append(None)  # filled in by measure() for the sample's window
        return t

    def _quiet(self) -> List[int]:
        return [i for i, l in enumerate(self.loads) if l is None or l <= QUIET["max_other"]]

    def used(self) -> List[int]:
        """The samples the figures come from: the quiet ones when there are enough of them
        (``QUIET['min_quiet']``, or all samples if fewer were taken), else all."""
        q = self._quiet()
        return q if len(q) >= min(QUIET["min_quiet"], len(self.times)) else list(range(len(self.times)))

    @property
    def median(self) -> float:
        return statistics.median(self.times[i] for i in self.used())

    @property
    def min(self) -> float:
        return min(self.times[i] for i in self.used())

    @property
    def load(self) -> Optional[float]:
        """The largest foreign load among the samples used."""
        ls = [self.loads[i] for i in self.used() if self.loads[i] is not None]
        return max(ls) if ls else None

    @property
    def samples_cell(self) -> str:
        return f"{len(self.used())}/{len(self.times)}"


@dataclass
class Timing:
    target_s: float = 0.5    # timed seconds per case
    min_reps: int = 3        # samples per case, at least
    max_reps: int = 50       # samples per case, at most
    sample_s: float = 0.01   # a sample batches calls shorter than this
    warmup: int = 1          # untimed calls per case first


def wait_quiet(max_wait_s: float, window_s: float = 0.3) -> float:
    """Wait (at most ``max_wait_s``, drawn from the run's ``QUIET['wait_budget_s']``) until a
    ``window_s`` window in which other processes took <= ``QUIET['max_other']`` of the CPUs.
    Returns the seconds waited."""
    t0 = time.perf_counter()
    max_wait_s = min(max_wait_s, QUIET["wait_budget_s"])
    while True:
        mon = LoadMonitor()
        time.sleep(window_s)
        other = mon.other()
        waited = time.perf_counter() - t0
        if other is None or other <= QUIET["max_other"] or waited >= max_wait_s:
            break
    QUIET["wait_budget_s"] = max(0.0, QUIET["wait_budget_s"] - waited)
    return waited


def measure(cases: Sequence[Case], timing: Timing) -> Optional[float]:
    """Time the cases of one row; fills each case's ``times`` and ``loads``.

    Every case is warmed up (``timing.warmup`` untimed calls); a sample is one call, or for
    calls shorter than ``timing.sample_s`` a batch of calls timed together. ``reps`` samples
    of each case are taken, interleaved case by case, ``reps`` chosen so that the slowest
    case gets about ``timing.target_s`` seconds of timed runs (within ``[min_reps,
    max_reps]``). Shared machine: it first waits a little for a quiet moment (before every
    round too when a sample takes over 1 s). A sample is disturbed when other processes
    took more than ``QUIET['max_other']`` of the CPUs during its window (>= 0.25 s of
    rounds); while a case has fewer than ``QUIET['min_quiet']`` quiet samples, extra rounds
    are taken (at most ``reps`` more, within the run's ``QUIET['extra_budget_s']``). The
    figures then come from the quiet samples only (``Case.used``), or from all of them if
    too few were quiet. Returns the largest foreign load among the samples used (None if
    unknown), which the tables print."""
    for c in cases:
        c.times, c.loads = [], []
        t = min(c.sample(1) for _ in range(max(timing.warmup, 1)))
        c.inner = max(1, int(timing.sample_s / max(t, 1e-9)))
        c.est = t * c.inner  # seconds per sample
        c.times, c.loads = [], []
    slowest = max(c.est for c in cases)
    reps = int(round(timing.target_s / slowest))
    reps = max(timing.min_reps, min(timing.max_reps, reps))

    def window(max_rounds: int, wait: bool) -> int:
        """Rounds (one sample of each case) until ``WINDOW_S`` has passed, or max_rounds;
        the foreign load over the window is given to each of its samples (/proc/stat
        counts in 10 ms ticks: a shorter window could not tell 5% load from noise)."""
        if wait:
            wait_quiet(10.0 if slowest > 1.0 else 2.0)
        mon, t0, pending, k = LoadMonitor(), time.perf_counter(), [], 0
        while k < max_rounds:
            for c in cases:
                c.sample(c.inner)
                pending.append((c, len(c.times) - 1))
            k += 1
            if time.perf_counter() - t0 >= WINDOW_S:
                break
        load = mon.other()
        for c, i in pending:
            c.loads[i] = load
        return k

    done = 0
    while done < reps:  # fast rows wait for quiet once, not between windows (no cold restarts)
        done += window(reps - done, wait=done == 0 or slowest > 1.0)
    extra = 0
    need = min(QUIET["min_quiet"], reps)
    while (extra < reps and QUIET["extra_budget_s"] > 0
           and any(len(c._quiet()) < need for c in cases)):
        t0 = time.perf_counter()
        extra += window(reps - extra, wait=True)
        QUIET["extra_budget_s"] -= time.perf_counter() - t0
    loads = [c.load for c in cases if c.load is not None]
    return max(loads) if loads else None


WINDOW_S = 0.25


# ---- formatting ---------------------------------------------------------------------------


def rel_err(x, ref) -> float:
    """relative RMS error of x against ref, in float64"""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30))


def pyattn_case(name: str, f: Callable, args: Sequence, kwargs: dict, passes: str, do) -> Case:
    """Times pyattn's ``f(*args, **kwargs)`` ("fwd"), or ``pyattn.vjp`` of it then the
    pullback of ``do`` ("fwd+bwd")."""
    if passes == "fwd":
        def run(_):
            f(*args, **kwargs)
    else:
        def run(_):
            _, pb = pyattn.vjp(f, *args, **kwargs)
            pb(do)
    return Case(name, run)


def torch_case(name: str, fn: Callable, passes: str, inputs: dict, do, **consts) -> Case:
    """Times torch's ``fn(**inputs, **consts)`` ("fwd"), or the same on leaf copies of the
    ``inputs`` tensors then ``.backward(do)`` ("fwd+bwd"; the grads reset every call)."""
    if passes == "fwd":
        def run(_):
            fn(**inputs, **consts)
    else:
        leaves = {n: x.clone().requires_grad_(True) for n, x in inputs.items()}

        def run(_):
            for x in leaves.values():
                x.grad = None
            fn(**leaves, **consts).backward(do)
    return Case(name, run)


def fmt(x, spec: str = ".2f") -> str:
    if x is None:
        return NA
    if isinstance(x, str):
        return x
    return format(x, spec)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool = False,
                file=None) -> None:
    """A plain-text table (right-aligned columns) or, with ``markdown``, a markdown table."""
    file = file or sys.stdout
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    if markdown:
        print("| " + " | ".join(cells[0]) + " |", file=file)
        print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|", file=file)
        for r in cells[1:]:
            print("| " + " | ".join(r) + " |", file=file)
        return
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    print(line(cells[0]), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in cells[1:]:
        print(line(r), file=file)
    file.flush()


# ---- command line -------------------------------------------------------------------------


def base_parser(description: str, default_threads: int, sweep: bool = False) -> argparse.ArgumentParser:
    """The options every benchmark takes; with ``sweep``, ``--threads`` takes a list of thread
    counts (``args.threads`` a list), each run in turn (``thread_runs``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true",
                   help="CI-sized run: fewer sizes, shorter measurements")
    if sweep:
        p.add_argument("--threads", type=int, nargs="+", default=[default_threads],
                       help=f"thread counts for pyattn and torch, one table each (default {default_threads})")
    else:
        p.add_argument("--threads", type=int, default=default_threads,
                       help=f"threads for pyattn and torch (default {default_threads})")
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.add_argument("--target", type=float, default=None,
                   help="seconds of timed runs per case (default 0.5, --quick 0.15)")
    return p


def thread_runs(args):
    """For a sweep parser's args: per thread count, a copy of args with ``threads`` that count,
    the threads of pyattn, torch and BLAS set to it, and a heading line printed when there
    are several."""
    import copy
    for n in args.threads:
        one = copy.copy(args)
        one.threads = n
        set_threads(n)
        if len(args.threads) > 1:
            print(f"\n## threads: {n}\n", flush=True)
        yield one


def timing_from_args(args) -> Timing:
    target = args.target if args.target is not None else (0.15 if args.quick else 0.5)
    if args.quick:
        QUIET["wait_budget_s"], QUIET["extra_budget_s"] = 20.0, 20.0
    return Timing(target_s=target)


def timing_line(timing: Timing) -> str:
    return (f"timing: median over samples (>= {timing.min_reps}, ~{timing.target_s:g} s of timed "
            f"runs per case; calls < {timing.sample_s * 1e3:g} ms batched per sample), "
            f"after {timing.warmup} untimed warm-up call(s); cases of a row interleaved; "
            f"samples disturbed by other processes (> {100 * QUIET['max_other']:.0f}% of the "
            f"CPUs) replaced by extra ones and dropped when >= {QUIET['min_quiet']} quiet remain")


def print_header(timing: Timing, *lines: str, threads_extra: str = "") -> None:
    """The opening lines of every benchmark: the machine, the threads, the benchmark's own
    lines (shape, FLOPs), the timing method."""
    print(machine_line())
    print(threads_line(threads_extra))
    for line in lines:
        print(line)
    print(timing_line(timing))


def final_peak(dtype, threads: int, peak0: float) -> float:
    """The FMA peak measured again after the rows; prints both measurements and returns the
    larger, the one the "% peak" columns use."""
    peak1 = fma_peak(dtype, threads)
    peak = max(peak0, peak1)
    print(f"{np.dtype(dtype).name} FMA peak, {threads} thread(s): {peak:.1f} GFLOP/s "
          f"(before rows {peak0:.1f}, after {peak1:.1f}; the larger is used)")
    return peak


def percent_of_peak(rows: List[list], cols: Sequence[int], peak: float, missing: str = "") -> None:
    """In place: the GFLOP/s floats in columns ``cols`` of ``rows`` become "% of peak" cells;
    other entries stay, None or "" becoming ``missing``."""
    for r in rows:
        for c in cols:
            r[c] = fmt(100 * r[c] / peak, ".1f") if isinstance(r[c], float) else (r[c] or missing)


def build_line() -> str:
    """Which pyattn build runs: the extension file's mtime, and the git HEAD of its tree."""
    import datetime
    import subprocess
    path = _core.__file__
    mtime = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
    import hashlib
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    line = (f"pyattn build: {path} (sha256 {digest}, modified {mtime:%Y-%m-%d %H:%M:%S} UTC)")
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "csrc"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        if head:
            line += f", git HEAD {head}" + (" (csrc/ modified)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return line

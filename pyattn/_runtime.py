"""Threads, the kernel path and the build: the process-wide runtime settings that pyattn
re-exports (set_num_threads, get_num_threads, num_threads, build_info)."""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Dict, Iterator

from . import _core, _validate


# the kernel paths, widest first: amx and avx512_bf16 are the AVX-512 kernels with bf16
# products on AMX tiles or AVX512-BF16 (bf16 calls, _core.gemm_bf16), avx512 and the others
# compute bf16 in float
BF16_PRODUCT_ISAS = ("amx", "avx512_bf16")
ISAS = BF16_PRODUCT_ISAS + ("avx512", "avx2", "generic")


def check_isa_request() -> None:
    """PYATTN_ISA names the kernel path to run; one this build or CPU lacks is not silently
    replaced."""
    want = os.environ.get("PYATTN_ISA")
    if not want:
        return
    info = _core.build_info()
    if want not in ISAS:
        warnings.warn(f"PYATTN_ISA={want!r} is not a kernel path ({', '.join(ISAS)}); "
                      f"ignored, running {info['isa']}", RuntimeWarning, stacklevel=3)
    elif want != info["isa"]:
        warnings.warn(f"PYATTN_ISA={want!r}: this CPU runs only {', '.join(info['isas_available'])}; "
                      f"running {info['isa']}", RuntimeWarning, stacklevel=3)


def _cpu_count() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_warned_oversubscription = False


def set_num_threads(n: int) -> None:
    """Threads used by every kernel from now on, process-wide (default: OMP_NUM_THREADS, or
    the number of CPUs). More threads than CPUs only slow the kernels down: the first such
    request warns (RuntimeWarning), once per process.

    Fork: a child made by ``os.fork()`` or ``multiprocessing`` (the 'fork' start method) after
    pyattn has run keeps this setting and its kernels run threaded. Before a fork pyattn
    hands the forking thread's OpenMP threads back (GNU OpenMP's pool does not survive
    fork; the parent starts a new one on its next call); where that cannot be done, the
    child runs serially until it calls set_num_threads. Do not fork while another Python
    thread is inside a pyattn call."""
    global _warned_oversubscription
    n = _validate.integer("set_num_threads", "n", n, 1)
    cpus = _cpu_count()
    if n > cpus and not _warned_oversubscription:
        _warned_oversubscription = True
        warnings.warn(f"set_num_threads({n}): this process can run on {cpus} CPUs; more threads "
                      f"than CPUs slow the kernels down (warned once)", RuntimeWarning, stacklevel=2)
    _core.set_num_threads(n)


def get_num_threads() -> int:
    """Threads the kernels use."""
    return _core.get_num_threads()


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """``with pyattn.num_threads(n):`` runs the block with n threads, then restores the
    previous count. The setting is process-wide, not per Python thread."""
    previous = get_num_threads()
    set_num_threads(n)
    try:
        yield
    finally:
        _core.set_num_threads(previous)


def build_info() -> Dict[str, Any]:
    """How this pyattn was built and what it runs: the ISA path chosen at run time ('avx512',
    'avx2' or 'generic'), the ones this CPU supports, the compiler, whether OpenMP is on,
    and the thread count."""
    return dict(_core.build_info())

"""pyattn: every attention variant, softmax and linear, as C11 + OpenMP kernels for the CPU,
forward and backward, behind a NumPy API.

    import pyattn
    o = pyattn.softmax_attention(q, k, v, causal=True)
    out, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True)
    grads = pullback(do)          # {"q": dq, "k": dk, "v": dv}
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Dict, Iterator

from . import _core, _validate, data, kvcache, reference, testing
from .autodiff import vjp
from .delta import delta_rule, gated_delta_rule
from .feature_maps import feature_map
from .mla import mla_attention
from .linear import (efficient_attention, gla, lightning_attention, linear_attention, mamba2,
                     retention, simple_gla)
from .rope import rope
from .softmax import attention_with_kvcache, merge_attention_states, softmax_attention
from .sparse import (dsa_attention, dsa_index_scores, dsa_index_target, dsa_select, linformer_attention,
                     moba_attention, nsa_attention)
from .training import plot_history, train
from ._ops import OpInfo, build_ops
from . import nn

__version__ = "0.1.0"

OPS = build_ops()


def _check_isa_request() -> None:
    """PYATTN_ISA names the kernel path to run; one this build or CPU lacks is not silently
    replaced."""
    want = os.environ.get("PYATTN_ISA")
    if not want:
        return
    info = _core.build_info()
    if want not in ("avx512", "avx2", "generic"):
        warnings.warn(f"PYATTN_ISA={want!r} is not a kernel path (avx512, avx2, generic); "
                      f"ignored, running {info['isa']}", RuntimeWarning, stacklevel=3)
    elif want != info["isa"]:
        warnings.warn(f"PYATTN_ISA={want!r}: this CPU runs only {', '.join(info['isas_available'])}; "
                      f"running {info['isa']}", RuntimeWarning, stacklevel=3)


_check_isa_request()


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


__all__ = [
    "OPS",
    "OpInfo",
    "build_info",
    "data",
    "delta_rule",
    "dsa_attention",
    "dsa_index_scores",
    "dsa_index_target",
    "dsa_select",
    "efficient_attention",
    "feature_map",
    "gated_delta_rule",
    "get_num_threads",
    "gla",
    "kvcache",
    "lightning_attention",
    "linear_attention",
    "nn",
    "mamba2",
    "attention_with_kvcache",
    "merge_attention_states",
    "linformer_attention",
    "mla_attention",
    "moba_attention",
    "nsa_attention",
    "num_threads",
    "plot_history",
    "reference",
    "retention",
    "rope",
    "simple_gla",
    "testing",
    "set_num_threads",
    "softmax_attention",
    "train",
    "vjp",
]

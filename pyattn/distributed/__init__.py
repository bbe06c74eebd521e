"""pyattn across processes with MPI (mpi4py): data-parallel training and context parallelism
for long sequences.

Every function takes an mpi4py communicator ``comm`` whose ranks all make the same call;
launch with ``mpiexec -n N python script.py`` (one process per rank; give each
``OMP_NUM_THREADS`` threads). Inputs the ranks must agree on (shapes, dtypes, options) are
checked with one small collective before any data moves, so a disagreement is a ValueError
on every rank, never a hang.

Needs mpi4py (``pip install 'pyattn[mpi]'``, which brings MPICH's mpiexec); ``import
pyattn`` never imports it.
"""
from __future__ import annotations

try:
    from mpi4py import MPI  # noqa: F401  (the error below names the extra)
except ImportError as e:  # pragma: no cover - exercised where mpi4py is absent
    raise ImportError("pyattn.distributed needs mpi4py: pip install 'pyattn[mpi]' (mpi4py and the "
                      "mpich wheel, which brings mpiexec)") from e

from ._agree import agree
from .context import context_parallel
from .ring import ring_attention, zigzag_merge, zigzag_split

__all__ = ["agree", "context_parallel", "ring_attention", "zigzag_split", "zigzag_merge"]

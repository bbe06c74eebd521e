"""Data parallelism for ``pyattn.train``: each rank computes its share of every global batch,
and the gradients are summed over the ranks while the backward still runs."""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
from mpi4py import MPI

from ._agree import agree


def world() -> Any:
    """``MPI.COMM_WORLD`` (for ``python -m pyattn train`` started under mpiexec)."""
    return MPI.COMM_WORLD


class DataParallel:
    """One training run spread over the ranks of ``comm``: every rank draws the same global
    batch and computes a contiguous share of its rows; its gradient is weighted by its share
    of the batch's scored targets, so that the sum over the ranks is the gradient of the mean
    loss over all of them. The sum runs as non-blocking Allreduces, one per module (the head,
    each block, the embedding), each started as soon as the backward has finished that
    module's gradients, so the communication overlaps the backward of the layers below."""

    def __init__(self, comm, model, batch_size: int, settings: Dict[str, Any], data=()):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        if batch_size % self.size:
            # every rank reaches this with the same numbers: the same error everywhere, no hang
            raise ValueError(f"train(): batch_size={batch_size} must be a multiple of the number of "
                             f"ranks ({self.size}): each rank computes an equal share of every batch")
        agree(comm, "train()", {"settings": settings, "config": getattr(model, "config", None),
                                "params": [(n, p.shape, p.dtype.str) for n, p in model.params.items()],
                                "data": [_digest([a]) for a in data],
                                "initial parameters": _digest(model.params.values())})
        self.share = batch_size // self.size
        self.flat = {id(m): _flatten_grads(m) for m in _top_modules(model)}
        self.pending: List[Any] = []

    def my_rows(self, rows: np.ndarray, targets: np.ndarray, ignore_index: int = -100) -> Tuple[np.ndarray, float]:
        """(this rank's rows of the global batch ``rows``, its weight: its scored targets over
        the whole batch's). Every rank holds the whole batch's targets: no communication."""
        mine = rows[self.rank * self.share:(self.rank + 1) * self.share]
        total = int(np.sum(targets[rows] != ignore_index))
        return mine, int(np.sum(targets[mine] != ignore_index)) / max(total, 1)

    def start_loss(self, weighted_loss: float) -> None:
        """Starts summing the ranks' losses times their weights (the batch's mean loss), read
        by ``finish``: the sum rides along with the backward instead of holding it up."""
        self.loss = np.array([weighted_loss], np.float64)
        self.pending.append(self.comm.Iallreduce(MPI.IN_PLACE, self.loss, op=MPI.SUM))

    def ready(self) -> Callable:
        """The hook for ``HybridLM.backward(..., ready=)``: starts summing a module's gradients
        in place."""
        def start(module) -> None:
            flat = self.flat.get(id(module))
            if flat is None or not flat.size:
                return
            self.pending.append(self.comm.Iallreduce(MPI.IN_PLACE, flat, op=MPI.SUM))
            # MPI moves a non-blocking sum along only inside its own calls: give it one per module
            MPI.Request.Testall(self.pending)
        return start

    def finish(self) -> float:
        """Waits for every sum started; returns the batch's mean loss."""
        MPI.Request.Waitall(self.pending)
        self.pending.clear()
        return float(self.loss[0])

    def any(self, flag: bool) -> bool:
        """True on every rank when any rank passes True (Ctrl-C on one rank stops them all)."""
        return bool(self.comm.allreduce(int(flag), op=MPI.MAX))

    def check_same_params(self, model) -> None:
        """Raises on every rank unless every rank holds the same parameters, bit for bit."""
        seen = self.comm.allgather(_digest(model.params.values()))
        if len(set(seen)) != 1:
            raise RuntimeError(f"train(): the ranks' parameters differ (digests {seen}): the ranks did not "
                               "run the same steps")

    def bcast(self, value: Any) -> Any:
        """Rank 0's value on every rank."""
        return self.comm.bcast(value, root=0)


def _top_modules(model) -> List[Any]:
    """The modules HybridLM.backward reports ready: its direct children."""
    return list(model._children.values())


def _flatten_grads(module) -> np.ndarray:
    """One contiguous buffer holding every gradient of ``module``'s tree, each gradient array
    replaced by a view of it (values kept), so that one Allreduce sums them in place."""
    slots = []

    def walk(m):
        slots.extend((m, name) for name in m.g)
        for child in m._children.values():
            walk(child)

    walk(module)
    if not slots:
        return np.zeros(0)
    dtype = slots[0][0].g[slots[0][1]].dtype
    step = 64 // dtype.itemsize  # each view starts on a cache line, as a fresh array would
    starts, end = [], 0
    for m, name in slots:
        starts.append(end)
        end += -(-m.g[name].size // step) * step
    flat = np.zeros(end + step, dtype)
    base = (-flat.ctypes.data % 64) // dtype.itemsize
    flat = flat[base:base + end]
    for (m, name), at in zip(slots, starts):
        g = m.g[name]
        view = flat[at:at + g.size].reshape(g.shape)
        view[...] = g
        m.g[name] = view
    return flat


def _digest(arrays) -> str:
    """A hash of arrays' bytes: the ranks compare these rather than the arrays."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()

"""pyattn.distributed.context_parallel for torch tensors (eager autograd; CPU tensors)."""
from __future__ import annotations

from typing import Any, Callable, Union

import numpy as np
import torch

import pyattn
from pyattn.autodiff import vjp
from pyattn.distributed import context_parallel as _context_parallel


def _array(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy())


class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, comm, n_positional, tensor_kw, options, *tensors):
        args = [_array(t) for t in tensors[:n_positional]]
        kw = dict(options, **{name: _array(t) for name, t in zip(tensor_kw, tensors[n_positional:])})
        (o, final), pullback = vjp(_context_parallel, fn, *args, comm=comm, **kw)
        ctx.pullback = pullback
        ctx.names = list(pyattn.OPS[fn.__name__].arrays[:n_positional]) + list(tensor_kw)
        return torch.from_numpy(o), torch.from_numpy(final)

    @staticmethod
    def backward(ctx, do, dfinal):
        # every rank calls the pullback (it communicates), even with zero cotangents
        grads = ctx.pullback((None if do is None else _array(do), None if dfinal is None else _array(dfinal)))
        out = [None if grads.get(name) is None else torch.from_numpy(grads[name])
               for name in ctx.names]
        return (None, None, None, None, None, *out)


def context_parallel(op: Union[str, Callable], *tensors: Any, comm, **kw):
    """``pyattn.distributed.context_parallel`` on torch tensors: ``op`` a pyattn op or its name
    (``"gated_delta_rule"``, ...), ``tensors`` this rank's slice of the per-token tensors and
    the shared ones in the op's positional order; tensor keywords (``initial_state``, ``gv``,
    ``D``, ...) get gradients too. Returns ``(o_slice, final_state)`` tensors; ``backward``
    must run on every rank of ``comm`` (the pullback communicates). Eager only."""
    fn = getattr(pyattn, op) if isinstance(op, str) else op
    tensor_kw = tuple(k for k, val in kw.items() if isinstance(val, torch.Tensor))
    options = {k: val for k, val in kw.items() if k not in tensor_kw}
    return _ContextParallel.apply(fn, comm, len(tensors), tensor_kw, options,
                                  *tensors, *(kw[k] for k in tensor_kw))

"""Ring attention on torch tensors: pyattn.distributed.ring_attention as an autograd Function
(eager; the NumPy forward and its pullback)."""
from __future__ import annotations

import numpy as np
import torch

from .. import autodiff
from ..distributed import ring as _ring


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kw):
        arrays = [x.detach().cpu().numpy() for x in (q, k, v)]
        out, ctx.pullback = autodiff.vjp(_ring.ring_attention, *arrays, **kw)
        ctx.return_lse = kw["return_lse"]
        ctx.device = q.device
        outs = out if ctx.return_lse else (out,)
        return tuple(torch.from_numpy(np.asarray(x)).to(q.device) for x in outs)

    @staticmethod
    def backward(ctx, *grads):
        cot = tuple(None if g is None else g.detach().cpu().numpy() for g in grads)
        got = ctx.pullback(cot if ctx.return_lse else cot[0])
        return tuple(torch.from_numpy(got[x]).to(ctx.device) for x in "qkv") + (None,)


def ring_attention(q, k, v, *, comm, causal=True, scale=None, window=None, softcap=None,
                   return_lse=False, layout="contiguous"):
    """``pyattn.distributed.ring_attention`` on torch tensors (CPU float32/float64), eager,
    differentiable in q, k and v: every rank runs the forward and, with ``backward()``, the
    pullback (the ranks must all call ``backward``, since dK/dV travel the ring). Returns
    ``o``, or ``(o, lse)`` with ``return_lse=True``."""
    kw = dict(comm=comm, causal=causal, scale=scale, window=window, softcap=softcap,
              return_lse=return_lse, layout=layout)
    out = _RingAttention.apply(q, k, v, kw)
    return out if return_lse else out[0]

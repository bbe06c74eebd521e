"""The diagonal-plus-low-rank (DPLR) delta rule and RWKV-7 on it.

One C kernel computes, per (sequence, head), with S_0 = initial_state (zeros if None):
``S_t = (diag(exp(gk_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (scale q_t)``.
The wrappers here check arguments and call the kernel's forward and backward; they never loop
over time. Forms: ``"chunk"`` (default; rows in chunks of ``chunk_size``, the DPLR WY form)
and ``"recurrent"`` (step by step); each has its own C backward (chunk: per chunk from the
state the forward kept at its start; recurrent: step by step from states kept every 64 steps).
"""
from __future__ import annotations

import numpy as np

from . import _bf16, _core
from . import _validate as V
from ._engines import LinearEngine, sequences
from .autodiff import register_vjp

FORMS = ("chunk", "recurrent")


class _DplrEngine(LinearEngine):
    """One call of the DPLR kernel: the linear engine's checked call with gk its per-channel
    gate, plus a and b."""

    def __init__(self, fn, q, k, v, a, b, gk, h0, want_state, cu, N, form, chunk_size, scale):
        V.form(fn, form, FORMS)
        super().__init__(fn, q, k, v, gk, None, h0, want_state, cu, N, form, chunk_size, scale)
        self.a, self.b = a, b

    def forward(self, keep=False):
        q, v = self.q, self.v
        B, T, H, K = q.shape
        self.o = np.empty((B, T, H, v.shape[3]), dtype=q.dtype)
        self.ht = np.empty((self.N, H, K, v.shape[3]), dtype=q.dtype) if self.want_state else None
        self.states = _core.dplr_forward(q, self.k, v, self.a, self.b, self.gk, self.h0, self.o,
                                         self.ht, keep, *self.opts, self.products(keep))
        return self.o, self.ht

    def backward(self, do, dht):
        """{q, k, v, a, b, gk, h0: gradient} (h0 when given)."""
        g = {name: np.empty_like(getattr(self, name)) for name in ("q", "k", "v", "a", "b", "gk")}
        g["h0"] = None if self.h0 is None else np.empty_like(self.h0)
        _core.dplr_backward(self.q, self.k, self.v, self.a, self.b, self.gk, self.h0, do, dht,
                            self.states, g["q"], g["k"], g["v"], g["a"], g["b"], g["gk"], g["h0"], *self.opts)
        return g


def _engine(fn, names, arrays, scale, initial_state, output_final_state, cu_seqlens,
            form, chunk_size):
    """The checked call. arrays: the op's arrays by its names, in its argument order; names:
    the op's names of the kernel's (q, k, v, a, b, gk), for the errors."""
    arrs, _ = V.float_arrays(fn, ("initial_state",), **arrays, initial_state=initial_state)
    q, k, v, a, b, gk = (arrs[n] for n in names)
    qn, vn = names[0], names[2]
    V.ndim(fn, qn, q, 4, "[B, T, H, K]")
    V.ndim(fn, vn, v, 4, "[B, T, H, V]")
    B, T, H, K = q.shape
    for i, x in ((1, k), (3, a), (4, b), (5, gk)):
        V.shape(fn, names[i], x, q.shape, "[B, T, H, K]")
    V.shape(fn, vn, v, (B, T, H, v.shape[3]), "[B, T, H, V]")
    if K < 1 or v.shape[3] < 1:
        raise ValueError(f"{fn}(): head dims must be >= 1, got K={K}, V={v.shape[3]}")
    V.log_gate(fn, names[5], gk)
    cu, N = sequences(fn, B, T, cu_seqlens)
    scale = V.scale(fn, scale, K ** -0.5, q.dtype)
    want = V.boolean(fn, "output_final_state", output_final_state)
    return _DplrEngine(fn, q, k, v, a, b, gk, arrs["initial_state"], want, cu, N, form, chunk_size,
                       scale)


_DPLR_NAMES = ("q", "k", "v", "a", "b", "gk")
_RWKV7_NAMES = ("r", "k", "v", "a", "b", "w")


def _pullback(eng, names):
    """The vjp's pullback, gradients keyed by the op's argument names (engine name: op name)."""
    def pullback(cot):
        g = eng.backward(*eng.cotangent(cot))
        return {op: g[e] for e, op in names.items() if g[e] is not None}

    return pullback


@_bf16.calls
def dplr_delta_rule(q, k, v, a, b, gk, *, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, form="chunk", chunk_size=64):
    """The diagonal-plus-low-rank delta rule (fla's generalized delta rule):
    ``S_t = (diag(exp(gk_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (scale q_t)``.

    q, k, a, b, gk ``[B, T, H, K]``, v ``[B, T, H, V]``; gk a log-space decay per key channel
    (``gk <= 0``; ``-inf`` a full reset of the channel). ``scale`` defaults to ``K ** -0.5``;
    ``initial_state`` ``[N, H, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``,
    which restarts the recurrence at each boundary; B must then be 1). Forms: ``"chunk"``
    (default; ``chunk_size`` rows at a time, one of 16, 32, 64, 128: the WY form with GEMMs,
    forward and backward; under ``pyattn.vjp`` the forward keeps the state entering each chunk
    and the backward recomputes each chunk from it)
    and ``"recurrent"`` (step by step, and its backward step by step). Returns
    ``(o [B, T, H, V], final_state or None)``.
    """
    return _engine("dplr_delta_rule", _DPLR_NAMES, dict(q=q, k=k, v=v, a=a, b=b, gk=gk), scale,
                   initial_state, output_final_state, cu_seqlens, form,
                   chunk_size).forward()


def dplr_entering_states(q, k, v, a, b, gk, *, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None, chunk_size=64):
    """``dplr_delta_rule``'s chunk form that also returns the state entering each chunk: ``(o,
    final_state or None, states)``, states ``[B, NT, H, K, V]`` (NT = ceil(T / chunk_size);
    with cu_seqlens ``[1, every sequence's chunks in order, H, K, V]``), the layout of fla's
    ``return_intermediate_states``, which pyattn.torch.fla serves with it. Not differentiated."""
    eng = _engine("dplr_delta_rule", _DPLR_NAMES, dict(q=q, k=k, v=v, a=a, b=b, gk=gk), scale,
                  initial_state, output_final_state, cu_seqlens, "chunk", chunk_size)
    o, ht = eng.forward(keep=True)
    return o, ht, eng.entering_states()


_DPLR_GRADS = {"q": "q", "k": "k", "v": "v", "a": "a", "b": "b", "gk": "gk", "h0": "initial_state"}


@register_vjp(dplr_delta_rule)
def _dplr_delta_rule_vjp(q, k, v, a, b, gk, *, scale=None, initial_state=None,
                         output_final_state=False, cu_seqlens=None, form="chunk", chunk_size=64):
    eng = _engine("dplr_delta_rule", _DPLR_NAMES, dict(q=q, k=k, v=v, a=a, b=b, gk=gk), scale,
                  initial_state, output_final_state, cu_seqlens, form, chunk_size)
    return eng.forward(keep=True), _pullback(eng, _DPLR_GRADS)


@_bf16.calls
def rwkv7(r, w, k, v, a, b, *, scale=1.0, initial_state=None, output_final_state=False,
          cu_seqlens=None, form="chunk", chunk_size=64):
    """RWKV-7 (Goose) time mixing: ``dplr_delta_rule`` with the receptance r as the query and w
    as the log decay, in fla's ``chunk_rwkv7`` argument order:
    ``S_t = (diag(exp(w_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (scale r_t)``.

    r, w, k, a, b ``[B, T, H, K]``, v ``[B, T, H, V]``; ``scale`` defaults to 1 (None: ``K **
    -0.5``); the rest as ``dplr_delta_rule``.
    """
    return _engine("rwkv7", _RWKV7_NAMES, dict(r=r, w=w, k=k, v=v, a=a, b=b), scale,
                   initial_state, output_final_state, cu_seqlens, form, chunk_size).forward()


_RWKV7_GRADS = {"q": "r", "k": "k", "v": "v", "a": "a", "b": "b", "gk": "w", "h0": "initial_state"}


@register_vjp(rwkv7)
def _rwkv7_vjp(r, w, k, v, a, b, *, scale=1.0, initial_state=None, output_final_state=False,
               cu_seqlens=None, form="chunk", chunk_size=64):
    eng = _engine("rwkv7", _RWKV7_NAMES, dict(r=r, w=w, k=k, v=v, a=a, b=b), scale,
                  initial_state, output_final_state, cu_seqlens, form, chunk_size)
    return eng.forward(keep=True), _pullback(eng, _RWKV7_GRADS)

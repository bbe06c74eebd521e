"""Log-linear attention (log-linear Mamba-2, Guo et al. 2025).

A Mamba-2 style scalar-gated linear attention whose past is split into O(log T) parts by a
Fenwick tree over positions, each part weighted by its own data-dependent scale:
``o_t = sum_{s<=t} level_scales[t, lev(t, s)] exp(G_t - G_s) (scale q_t . k_s) v_s`` with
``G`` the cumulative log gate and ``lev(t, s) = bit_length(t XOR s)`` (0 for the token
itself). The wrappers here check arguments and call the C kernel's forward and backward; they
never loop over time.
"""
from __future__ import annotations

import numpy as np

from . import _bf16, _core
from . import _validate as V
from ._engines import sequences
from .autodiff import register_vjp, split_cotangent

FORMS = ("chunk", "recurrent", "parallel")
_FORM_CODE = {"parallel": 0, "recurrent": 2, "chunk": 3}
_FN = "log_linear_attention"


def levels_needed(length: int, start: int = 0, final_state: bool = False) -> int:
    """The number of levels L a sequence of ``length`` tokens resuming at position ``start``
    needs: ``bit_length(start + length - 1) + 1`` (``ceil(log2(length)) + 1`` from position 0,
    as fla), one more when the final state must hold a tree that grows past a power of two."""
    last = start + length - 1 if length else start
    need = int(last).bit_length() + 1
    if final_state:
        need = max(need, int(start + length).bit_length() + 1)
    return need


def _positions(initial_state, N, H):
    """Each sequence's starting position, as the initial state's level 0 holds it at [0, 0]."""
    if initial_state is None:
        return None
    raw = initial_state[:, :, 0, 0, 0].astype(np.float64)
    pos = np.rint(raw)
    bad = ~np.isfinite(raw) | (np.abs(raw - pos) > 0.25) | (pos < 0)
    if np.any(bad):
        n, h = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{_FN}(): initial_state[{n}, {h}, 0, 0, 0] holds the position the "
                         f"sequence resumes at and must be a whole number >= 0, got {raw[n, h]!r}")
    differs = np.any(pos != pos[:, :1], axis=1)
    if np.any(differs):
        n = int(np.argmax(differs))
        raise ValueError(f"{_FN}(): the heads of sequence {n} disagree on its position "
                         f"(initial_state[{n}, :, 0, 0, 0] = {raw[n].tolist()})")
    return pos[:, 0].astype(np.int64)


class _Engine:
    """One checked call of the kernel: its forward and its C backward."""

    def __init__(self, q, k, v, g, level_scales, scale, initial_state, output_final_state,
                 cu_seqlens, form, chunk_size):
        arrs, _ = V.float_arrays(_FN, ("initial_state",), q=q, k=k, v=v, g=g,
                                 level_scales=level_scales, initial_state=initial_state)
        q, k, v, g, ls, h0 = (arrs[n] for n in ("q", "k", "v", "g", "level_scales", "initial_state"))
        V.ndim(_FN, "q", q, 4, "[B, T, H, K]")
        V.ndim(_FN, "v", v, 4, "[B, T, H, V]")
        V.ndim(_FN, "level_scales", ls, 4, "[B, T, H, L]")
        B, T, H, K = q.shape
        V.shape(_FN, "k", k, q.shape, "[B, T, H, K]")
        V.shape(_FN, "v", v, (B, T, H, v.shape[3]), "[B, T, H, V]")
        V.shape(_FN, "g", g, (B, T, H), "[B, T, H]")
        V.shape(_FN, "level_scales", ls, (B, T, H, ls.shape[3]), "[B, T, H, L]")
        Vd, L = v.shape[3], ls.shape[3]
        if K < 1 or Vd < 1:
            raise ValueError(f"{_FN}(): head dims must be >= 1, got K={K}, V={Vd}")
        self.form = V.form(_FN, form, FORMS)
        V.chunk_size(_FN, chunk_size)
        V.log_gate(_FN, "g", g)
        cu, N = sequences(_FN, B, T, cu_seqlens)
        V.shape(_FN, "initial_state", h0, (N, H, L, K, Vd), "[N, H, L, K, V]")
        self.want = V.boolean(_FN, "output_final_state", output_final_state)
        start = _positions(h0, N, H)
        starts = np.zeros(N, np.int64) if start is None else start
        lengths = np.diff(cu)
        for n in range(N):
            need = levels_needed(int(lengths[n]), int(starts[n]), self.want)
            if L < need:
                at = f" resuming at position {starts[n]}" if starts[n] else ""
                extra = " and its final state" if self.want and need > levels_needed(int(lengths[n]), int(starts[n])) else ""
                raise ValueError(f"{_FN}(): level_scales has L={L} levels, but sequence {n} of "
                                 f"{lengths[n]} tokens{at}{extra} needs L >= {need}")
        if L > 62:
            raise ValueError(f"{_FN}(): level_scales has L={L} levels; at most 62 are supported")
        self.q, self.k, self.v, self.g, self.ls, self.h0 = q, k, v, g, ls, h0
        self.N = N
        self.opts = (cu, start, _FORM_CODE[self.form], int(chunk_size),
                     float(V.scale(_FN, scale, K ** -0.5, q.dtype)))
        self.o = self.ht = None

    def forward(self):
        q, v = self.q, self.v
        B, T, H, K = q.shape
        self.o = np.empty((B, T, H, v.shape[3]), dtype=q.dtype)
        if self.want:
            self.ht = np.empty((self.N, H, self.ls.shape[3], K, v.shape[3]), dtype=q.dtype)
        _core.loglin_forward(q, self.k, v, self.g, self.ls, self.h0, self.o, self.ht, *self.opts)
        return self.o, self.ht

    def backward(self, cot):
        """{argument name: gradient} for every array given."""
        do, dht = split_cotangent(_FN, cot, 2)
        if dht is not None and not self.want:
            raise ValueError(f"{_FN} pullback: got a cotangent for the final state, but output_final_state=False")
        arrs, _ = V.float_arrays(f"{_FN} pullback", ("do", "dht"), q=self.q, do=do, dht=dht)
        do, dht = arrs["do"], arrs["dht"]
        do = np.zeros_like(self.o) if do is None else do
        V.shape(f"{_FN} pullback", "do", do, self.o.shape)
        V.shape(f"{_FN} pullback", "dht", dht, None if self.ht is None else self.ht.shape)
        names = ("q", "k", "v", "g", "level_scales")
        grads = {n: np.empty_like(getattr(self, a)) for n, a in zip(names, ("q", "k", "v", "g", "ls"))}
        if self.h0 is not None:
            grads["initial_state"] = np.empty_like(self.h0)
        _core.loglin_backward(self.q, self.k, self.v, self.g, self.ls, self.h0, do, dht,
                              *(grads[n] for n in names), grads.get("initial_state"), *self.opts)
        return grads


@_bf16.calls
def log_linear_attention(q, k, v, g, level_scales, *, scale=None, initial_state=None,
                         output_final_state=False, cu_seqlens=None, form="chunk", chunk_size=64):
    """Log-linear attention (log-linear Mamba-2):
    ``o_t = sum_{s<=t} level_scales[t, lev(t, s)] exp(G_t - G_s) (scale q_t . k_s) v_s``.

    q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g ``[B, T, H]`` a log-space decay per step
    (``g <= 0``), ``G`` its cumulative sum within each sequence; level_scales ``[B, T, H, L]``
    weighs each query's past level by level. Positions of the Fenwick tree count from the start
    of the sequence (plus where an initial state resumes it); ``lev(t, s) = bit_length(t XOR
    s)``: 0 for the token itself, 1 for t - 1 when t is odd, and so on; this is exactly the
    level mask of fla's ``naive_log_linear_attn``. A sequence of T tokens needs
    ``L >= ceil(log2(T)) + 1`` levels (``levels_needed``); more are allowed and their scales
    unused. ``scale`` defaults to ``K ** -0.5`` (fla's kernels apply none: pass 1.0 to match).

    State: ``[N, H, L, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``, which
    restarts the recurrence and the tree at each boundary; B must then be 1). Level l >= 1 is
    the decayed sum ``sum exp(G - G_s) k_s v_s^T`` of the past tokens that are at level l from
    the next position; level 0 holds no tokens, only that next position at ``[0, 0]`` (the
    count of tokens seen, exact in float32 up to 2**24). A final state passed back as
    ``initial_state`` therefore continues the sequence exactly: two calls equal one call, as
    long as L covers the whole stream (and, for ``output_final_state``, the next position too:
    ``levels_needed(T, start, final_state=True)``). An initial state's level 0 must hold a whole
    position; its gradient there is 0.

    Forms: ``"chunk"`` (default; O(T log T): inside a block of ``chunk_size`` aligned
    positions the low levels are a masked quadratic product, the levels above are one state
    each, read with one matrix product per level and merged as the tree says when the block
    ends), ``"recurrent"`` (the O(log T) level states, updated per token) and ``"parallel"``
    (the masked T x T product: the chunk algorithm with one block as long as the sequence).
    Returns ``(o [B, T, H, V], final_state or None)``.
    """
    return _Engine(q, k, v, g, level_scales, scale, initial_state, output_final_state,
                   cu_seqlens, form, chunk_size).forward()


@register_vjp(log_linear_attention)
def _log_linear_attention_vjp(q, k, v, g, level_scales, *, scale=None, initial_state=None,
                              output_final_state=False, cu_seqlens=None, form="chunk",
                              chunk_size=64):
    eng = _Engine(q, k, v, g, level_scales, scale, initial_state, output_final_state,
                  cu_seqlens, form, chunk_size)
    return eng.forward(), eng.backward

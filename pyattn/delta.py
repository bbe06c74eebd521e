"""The delta-rule engine and its ops: DeltaNet, Gated DeltaNet and Kimi Delta Attention.

One C engine computes, per (sequence, value head), with S_0 = initial_state (zeros if None):
``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``,
``o_t = S_t^T (scale q_t)``, the gate g_t a K-vector (``kda``), a scalar (``gated_delta_rule``)
or 0 (``delta_rule``). The wrappers here check arguments, apply the optional L2 normalisation
of q and k (and its backward, one threaded C pass each), and call the engine's forward and
backward; they never loop over time.
"""
from __future__ import annotations

import numpy as np

from . import _bf16, _core
from . import _validate as V
from ._engines import LINEAR_FORMS, LinearEngine, engine_qkv, sequences
from ._rownorm import normalize_rows, normalize_rows_backward
from .autodiff import register_vjp

FORMS = LINEAR_FORMS
L2_EPS = 1e-6  # qk_l2norm: x / sqrt(sum x^2 + L2_EPS) over the head dimension


class _DeltaEngine(LinearEngine):
    """One call of the delta-rule engine: the linear engine's checked call with the gate g as
    its key gate (scalar [B, T, H] or vector [B, T, H, K]), plus beta."""

    def __init__(self, fn, q, k, v, g, beta, h0, want_state, cu, N, form, chunk_size, scale):
        super().__init__(fn, q, k, v, g, None, h0, want_state, cu, N, form, chunk_size, scale)
        self.beta = beta

    def forward(self, keep=False):
        q, v = self.q, self.v
        self.o = np.empty(v.shape, dtype=q.dtype)
        self.ht = np.empty((self.N, v.shape[2], q.shape[3], v.shape[3]), dtype=q.dtype) if self.want_state else None
        self.states = _core.delta_forward(q, self.k, v, self.gk, self.beta, self.h0, self.o, self.ht,
                                          keep, *self.opts, self.products(keep))
        return self.o, self.ht

    def backward(self, do, dht):
        """{q, k, v, g, beta, h0: gradient} (g and h0 when given)."""
        g = {"q": np.empty_like(self.q), "k": np.empty_like(self.k), "v": np.empty_like(self.v),
             "beta": np.empty_like(self.beta)}
        g["g"] = None if self.gk is None else np.empty_like(self.gk)
        g["h0"] = None if self.h0 is None else np.empty_like(self.h0)
        _core.delta_backward(self.q, self.k, self.v, self.gk, self.beta, self.h0, do, dht,
                             self.states, g["q"], g["k"], g["v"], g["g"], g["beta"], g["h0"], *self.opts)
        return g


def _delta(fn, q, k, v, g, beta, qk_l2norm, scale, initial_state, output_final_state, cu_seqlens,
           form, chunk_size):
    """(engine, the normalisation's (q, rq, k, rk) or None: normalised q and k and their
    1 / norms), arguments checked under the op's names. kda's v may have more heads than q
    and k (groups), and its gate is a K-vector per step and value head."""
    vector = fn == "kda"
    optional = ("g",) if fn == "delta_rule" else ()
    arrs, _ = engine_qkv(fn, q, k, v, optional, groups=vector, g=g, beta=beta, initial_state=initial_state)
    q, k, v, g, beta = arrs["q"], arrs["k"], arrs["v"], arrs["g"], arrs["beta"]
    B, T, H, K = q.shape
    if vector:
        HV = v.shape[2]
        V.shape(fn, "g", g, (B, T, HV, K), "[B, T, HV, K]")
        V.shape(fn, "beta", beta, (B, T, HV), "[B, T, HV]")
    else:
        V.shape(fn, "g", g, (B, T, H), "[B, T, H]")
        V.shape(fn, "beta", beta, (B, T, H), "[B, T, H]")
    V.log_gate(fn, "g", g)
    cu, N = sequences(fn, B, T, cu_seqlens)
    scale = V.scale(fn, scale, K ** -0.5, q.dtype)
    norm = None
    if V.boolean(fn, "qk_l2norm", qk_l2norm):
        (q, rq), (k, rk) = normalize_rows(q, L2_EPS, False), normalize_rows(k, L2_EPS, False)
        norm = (q, rq, k, rk)
    eng = _DeltaEngine(fn, q, k, v, g, beta, arrs["initial_state"],
                       V.boolean(fn, "output_final_state", output_final_state), cu, N, form, chunk_size,
                       scale)
    return eng, norm


def _delta_vjp(eng, norm):
    def pullback(cot):
        g = eng.backward(*eng.cotangent(cot))
        if norm is not None:
            q, rq, k, rk = norm
            g["q"] = normalize_rows_backward(g["q"], q, rq, False)
            g["k"] = normalize_rows_backward(g["k"], k, rk, False)
        names = {"q": "q", "k": "k", "v": "v", "g": "g", "beta": "beta", "initial_state": "h0"}
        return {op: g[e] for op, e in names.items() if g[e] is not None}

    return pullback


@_bf16.calls
def gated_delta_rule(q, k, v, g, beta, *, qk_l2norm=False, scale=None, initial_state=None,
                     output_final_state=False, cu_seqlens=None, form="chunk", chunk_size=64):
    """Gated DeltaNet: ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = S_t^T (scale q_t)``.

    q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g ``[B, T, H]`` a log-space decay per step
    (``g <= 0``; ``-inf`` is a full reset), beta ``[B, T, H]`` the writing strength (in
    ``(0, 1)`` for DeltaNet; up to 2 gives the negative eigenvalues of DeltaProduct / RWKV-7).
    With ``qk_l2norm=True`` q and k are first replaced by ``x / sqrt(sum x^2 + 1e-6)`` over the
    head dimension (differentiated). ``scale`` defaults to ``K ** -0.5``; ``initial_state``
    ``[N, H, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``, which restarts the
    recurrence at each boundary; B must then be 1). Forms: ``"chunk"`` (the WY / UT form,
    chunk_size 16/32/64/128, any T), ``"parallel"`` (one block per sequence), ``"recurrent"``
    (step by step: the decode form). Returns ``(o [B, T, H, V], final_state or None)``.
    """
    eng, _ = _delta("gated_delta_rule", q, k, v, g, beta, qk_l2norm, scale, initial_state,
                    output_final_state, cu_seqlens, form, chunk_size)
    return eng.forward()


@register_vjp(gated_delta_rule)
def _gated_delta_rule_vjp(q, k, v, g, beta, *, qk_l2norm=False, scale=None, initial_state=None,
                          output_final_state=False, cu_seqlens=None, form="chunk", chunk_size=64):
    eng, norm = _delta("gated_delta_rule", q, k, v, g, beta, qk_l2norm, scale, initial_state,
                       output_final_state, cu_seqlens, form, chunk_size)
    return eng.forward(keep=True), _delta_vjp(eng, norm)


@_bf16.calls
def delta_rule(q, k, v, beta, *, qk_l2norm=False, scale=None, initial_state=None,
               output_final_state=False, cu_seqlens=None, form="chunk", chunk_size=64):
    """DeltaNet: ``S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = S_t^T (scale q_t)``: ``gated_delta_rule`` without the gate; the same arguments,
    forms and returns."""
    eng, _ = _delta("delta_rule", q, k, v, None, beta, qk_l2norm, scale, initial_state,
                    output_final_state, cu_seqlens, form, chunk_size)
    return eng.forward()


@register_vjp(delta_rule)
def _delta_rule_vjp(q, k, v, beta, *, qk_l2norm=False, scale=None, initial_state=None,
                    output_final_state=False, cu_seqlens=None, form="chunk", chunk_size=64):
    eng, norm = _delta("delta_rule", q, k, v, None, beta, qk_l2norm, scale, initial_state,
                       output_final_state, cu_seqlens, form, chunk_size)
    return eng.forward(keep=True), _delta_vjp(eng, norm)


@_bf16.calls
def kda(q, k, v, g, beta, *, qk_l2norm=False, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, form="chunk", chunk_size=64):
    """Kimi Delta Attention: the gated delta rule with a decay per key channel,
    ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = S_t^T (scale q_t)``.

    Each step first decays the state row by row (key channel c by ``exp(g_tc)``), then makes
    the delta-rule correction: the decayed state's value for k_t is moved a fraction beta_t
    of the way to v_t. q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` with HV a multiple of H
    (grouped value heads: value head h reads q and k head ``h // (HV // H)``, and the
    gradients of q and k sum over a group); g ``[B, T, HV, K]`` the log decay of each key
    channel per step and value head (``g <= 0``; ``-inf`` resets the channel); beta
    ``[B, T, HV]``. g equal in every channel is ``gated_delta_rule``. The chunk form is the
    WY / UT form of ``gated_delta_rule`` with the chunk's gated Grams (of k with k, and of q
    with k) taken as ``gla``'s are: every factor an exponent <= 0 inside the chunk, or bounded
    by e^20 where a chunk is rescaled to one of its rows, so strong gates (-20 per step and
    beyond) neither overflow nor lose digits. ``qk_l2norm``, ``scale``, ``initial_state``
    ``[N, HV, K, V]``, ``cu_seqlens``, the forms and chunk sizes as ``gated_delta_rule``.
    Returns ``(o [B, T, HV, V], final_state or None)``.
    """
    eng, _ = _delta("kda", q, k, v, g, beta, qk_l2norm, scale, initial_state, output_final_state,
                    cu_seqlens, form, chunk_size)
    return eng.forward()


def kda_entering_states(q, k, v, g, beta, *, qk_l2norm=False, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None, chunk_size=64):
    """``kda``'s chunk form that also returns the state entering each chunk: ``(o, final_state
    or None, states)``, states ``[B, NT, H, K, V]`` (NT = ceil(T / chunk_size); with
    cu_seqlens ``[1, every sequence's chunks in order, H, K, V]``), the layout of fla's
    ``chunk_kda(return_intermediate_states=True)``, which pyattn.torch.fla serves with it.
    Not differentiated."""
    eng, _ = _delta("kda", q, k, v, g, beta, qk_l2norm, scale, initial_state, output_final_state,
                    cu_seqlens, "chunk", chunk_size)
    o, ht = eng.forward(keep=True)
    return o, ht, eng.entering_states()


@register_vjp(kda)
def _kda_vjp(q, k, v, g, beta, *, qk_l2norm=False, scale=None, initial_state=None, output_final_state=False,
             cu_seqlens=None, form="chunk", chunk_size=64):
    eng, norm = _delta("kda", q, k, v, g, beta, qk_l2norm, scale, initial_state, output_final_state,
                       cu_seqlens, form, chunk_size)
    return eng.forward(keep=True), _delta_vjp(eng, norm)

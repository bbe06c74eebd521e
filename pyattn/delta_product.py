"""Gated DeltaProduct on the delta-rule engine.

Each token applies ``num_householder`` delta-rule steps (a product of generalised Householder
transitions) after one decay, then is read by its query. That is the gated delta rule over
the sequence of ``T * num_householder`` steps in which a token's decay sits on its first step
and its query on its last (the other steps' queries are zero and their outputs unread), so
one ``gated_delta_rule`` call computes it in every form, forward and backward.
"""
from __future__ import annotations

import numpy as np

from . import _bf16, _validate as V
from .autodiff import register_vjp, vjp
from .delta import FORMS, gated_delta_rule


class _Steps:
    """One checked call and its sequence of steps for the engine."""

    def __init__(self, q, k, v, g, beta, num_householder, qk_l2norm, scale, initial_state,
                 output_final_state, cu_seqlens, form, chunk_size):
        fn = "gated_delta_product"
        n = V.integer(fn, "num_householder", num_householder, 1)
        arrs, dtype = V.float_arrays(fn, ("g", "initial_state"), q=q, k=k, v=v, g=g, beta=beta,
                                     initial_state=initial_state)
        q, k, v, g, beta = (arrs[x] for x in ("q", "k", "v", "g", "beta"))
        V.ndim(fn, "q", q, 4, "[B, T, H, K]")
        B, T, H, K = q.shape
        V.shape(fn, "k", k, (B, T * n, H, K), "[B, T * num_householder, H, K]")
        V.ndim(fn, "v", v, 4, "[B, T * num_householder, H, V]")
        V.shape(fn, "v", v, (B, T * n, H, v.shape[3]), "[B, T * num_householder, H, V]")
        V.shape(fn, "beta", beta, (B, T * n, H), "[B, T * num_householder, H]")
        V.shape(fn, "g", g, (B, T, H), "[B, T, H]")
        V.log_gate(fn, "g", g)
        V.form(fn, form, FORMS)
        V.chunk_size(fn, chunk_size)
        N = B
        if cu_seqlens is not None:
            cu = V.cu_seqlens(fn, "cu_seqlens", cu_seqlens, T, B)
            N, cu_seqlens = len(cu) - 1, cu * n
        V.shape(fn, "initial_state", arrs["initial_state"], (N, H, K, v.shape[3]), "[N, H, K, V]")
        self.n, self.T = n, T
        # the steps: a token's query on its last step, its decay on its first
        qs = np.zeros((B, T * n, H, K), dtype)
        qs[:, n - 1::n] = q
        gs = np.zeros((B, T * n, H), dtype)
        if g is not None:
            gs[:, ::n] = g
        self.gated = g is not None
        self.args = (qs, k, v, gs, beta)
        self.kwargs = dict(qk_l2norm=V.boolean(fn, "qk_l2norm", qk_l2norm),
                           scale=V.scale(fn, scale, K ** -0.5, dtype), initial_state=arrs["initial_state"],
                           output_final_state=V.boolean(fn, "output_final_state", output_final_state),
                           cu_seqlens=cu_seqlens, form=form, chunk_size=chunk_size)

    def tokens(self, out):
        """(o, final_state) of the tokens from the steps' outputs."""
        o, S = out
        return np.ascontiguousarray(o[:, self.n - 1::self.n]), S

    def pullback(self, steps_pullback, template, cot):
        do, dS = cot if isinstance(cot, tuple) else (cot, None)
        dos = np.zeros(template.shape, template.dtype)
        if do is not None:
            dos[:, self.n - 1::self.n] = do
        g = steps_pullback((dos, dS))
        grads = {"q": np.ascontiguousarray(g["q"][:, self.n - 1::self.n]), "k": g["k"], "v": g["v"],
                 "beta": g["beta"]}
        if self.gated:
            grads["g"] = np.ascontiguousarray(g["g"][:, ::self.n])
        if "initial_state" in g:
            grads["initial_state"] = g["initial_state"]
        return grads


@_bf16.calls
def gated_delta_product(q, k, v, g, beta, *, num_householder, qk_l2norm=False, scale=None,
                        initial_state=None, output_final_state=False, cu_seqlens=None, form="chunk",
                        chunk_size=64):
    """Gated DeltaProduct: per token t, the state decays once, ``S <- exp(g_t) S``, then takes
    ``n = num_householder`` delta-rule steps ``S <- (I - beta_j k_j k_j^T) S + beta_j k_j v_j^T``
    over the token's rows j = t n .. t n + n - 1 of k, v and beta, then gives
    ``o_t = S^T (scale q_t)``.

    q ``[B, T, H, K]``, g ``[B, T, H]`` a log decay per token (``<= 0``; None: no decay, the
    ungated DeltaProduct); k ``[B, T n, H, K]``, v ``[B, T n, H, V]``, beta ``[B, T n, H]`` (up
    to 2 for negative eigenvalues). ``cu_seqlens`` counts tokens (B must be 1); states
    ``[N, H, K, V]``. ``qk_l2norm``, ``scale`` (default ``K ** -0.5``, which fla's chunk form
    applies), the forms and the return as ``gated_delta_rule``, whose engine computes it over
    the ``T n`` steps. With ``num_householder=1`` it is ``gated_delta_rule``.
    """
    steps = _Steps(q, k, v, g, beta, num_householder, qk_l2norm, scale, initial_state, output_final_state,
                   cu_seqlens, form, chunk_size)
    return steps.tokens(gated_delta_rule(*steps.args, **steps.kwargs))


@register_vjp(gated_delta_product)
def _gated_delta_product_vjp(q, k, v, g, beta, *, num_householder, qk_l2norm=False, scale=None,
                             initial_state=None, output_final_state=False, cu_seqlens=None, form="chunk",
                             chunk_size=64):
    steps = _Steps(q, k, v, g, beta, num_householder, qk_l2norm, scale, initial_state, output_final_state,
                   cu_seqlens, form, chunk_size)
    out, pullback = vjp(gated_delta_rule, *steps.args, **steps.kwargs)
    return steps.tokens(out), lambda cot: steps.pullback(pullback, out[0], cot)

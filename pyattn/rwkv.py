"""RWKV-6 on the gated linear engine.

RWKV-6 reads the state before the step's own write and adds that write through a bonus:
``o_t = (S_{t-1} + diag(u) k_t v_t^T)^T (scale r_t)``, ``S_t = diag(exp(w_t)) S_{t-1} + k_t v_t^T``.
The engine's state after step t of the sequence with k, v and w moved one step later
(zeros first) is exactly S_{t-1}, so one ``gla`` call over the moved rows gives the first
term in every form; the bonus is a per-row product, and the final state takes the last
row's step after the engine's end state. Both are vectorised NumPy over batch and heads.
"""
from __future__ import annotations

import numpy as np

from . import _bf16, _validate as V
from .autodiff import register_vjp, vjp
from .linear import FORMS, gla


def _sequences(fn, B, T, cu_seqlens):
    """(N, the rows where a sequence starts, the non-empty sequences, their last rows as
    (batch indices, time indices))."""
    if cu_seqlens is None:
        full = np.arange(B if T else 0)
        return B, np.array([0] if T else [], np.int64), full, (full, np.full(len(full), T - 1))
    cu = V.cu_seqlens(fn, "cu_seqlens", cu_seqlens, T, B)
    full = np.flatnonzero(cu[1:] > cu[:-1])
    return len(cu) - 1, np.unique(cu[:-1][cu[:-1] < T]), full, (np.zeros(len(full), np.int64), cu[1:][full] - 1)


def _later(x, starts):
    """x's rows moved one step later along time, a zero row at each sequence start."""
    y = np.empty_like(x)
    y[:, 1:] = x[:, :-1]
    y[:, starts] = 0
    return y


def _earlier(dy, starts):
    """The gradient of _later: dy's rows one step earlier, where they came from a row."""
    dy = dy.copy()
    dy[:, starts] = 0
    dx = np.zeros_like(dy)
    dx[:, :-1] = dy[:, 1:]
    return dx


class _Rwkv6:
    """One checked rwkv6 call: the moved rows, the engine's call, the bonus and final step."""

    def __init__(self, r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, form,
                 chunk_size):
        fn = "rwkv6"
        arrs, _ = V.float_arrays(fn, ("initial_state",), r=r, k=k, v=v, w=w, u=u,
                                 initial_state=initial_state)
        r, k, v, w, u = (arrs[n] for n in ("r", "k", "v", "w", "u"))
        V.ndim(fn, "r", r, 4, "[B, T, H, K]")
        B, T, H, K = r.shape
        V.shape(fn, "k", k, r.shape, "[B, T, H, K]")
        V.shape(fn, "w", w, r.shape, "[B, T, H, K]")
        V.ndim(fn, "v", v, 4, "[B, T, H, V]")
        V.shape(fn, "v", v, (B, T, H, v.shape[3]), "[B, T, H, V]")
        V.shape(fn, "u", u, (H, K), "[H, K]")
        if K < 1 or v.shape[3] < 1:
            raise ValueError(f"{fn}(): head dims must be >= 1, got K={K}, V={v.shape[3]}")
        V.log_gate(fn, "w", w)
        V.form(fn, form, FORMS)
        V.chunk_size(fn, chunk_size)
        self.want = V.boolean(fn, "output_final_state", output_final_state)
        self.scale = V.scale(fn, scale, K ** -0.5, r.dtype)
        N, self.starts, self.full, self.last = _sequences(fn, B, T, cu_seqlens)
        V.shape(fn, "initial_state", arrs["initial_state"], (N, H, K, v.shape[3]), "[N, H, K, V]")
        self.r, self.k, self.v, self.w, self.u = r, k, v, w, u
        self.engine_args = (r, _later(k, self.starts), _later(v, self.starts), _later(w, self.starts))
        self.engine_kw = dict(scale=self.scale, initial_state=arrs["initial_state"],
                              output_final_state=self.want, cu_seqlens=cu_seqlens, form=form,
                              chunk_size=chunk_size)

    def bonus(self):
        """a [B, T, H]: the bonus weight scale r_t . (u k_t) of each row's own value."""
        return self.scale * np.einsum("bthk,hk,bthk->bth", self.r, self.u, self.k)

    def finish(self, o_engine, S_engine):
        """(o, final state) from the engine's output and end states."""
        o = o_engine + self.bonus()[..., None] * self.v
        if not self.want:
            return o, None
        S = S_engine.copy()
        b, t = self.last
        S[self.full] = (np.exp(self.w[b, t])[..., None] * S_engine[self.full]
                        + self.k[b, t][..., None] * self.v[b, t][..., None, :])
        return o, S

    def pullback(self, engine_pullback, S_engine, cot):
        """{r, k, v, w, u, initial_state: gradient} from the engine's pullback and the cotangent."""
        do, dS = cot if isinstance(cot, tuple) else (cot, None)
        do = np.zeros(self.v.shape, self.v.dtype) if do is None else do
        a = self.bonus()
        da = np.einsum("bthv,bthv->bth", do, self.v)
        dS_engine = None
        extra = {}
        if self.want and dS is not None:
            b, t = self.last
            dS_engine = dS.copy()
            decay = np.exp(self.w[b, t])[..., None]
            dS_engine[self.full] = decay * dS[self.full]
            extra = {"w": np.einsum("nhkv,nhkv->nhk", dS[self.full], decay * S_engine[self.full]),
                     "k": np.einsum("nhkv,nhv->nhk", dS[self.full], self.v[b, t]),
                     "v": np.einsum("nhkv,nhk->nhv", dS[self.full], self.k[b, t])}
        g = engine_pullback((do, dS_engine))
        dk = _earlier(g["k"], self.starts) + self.scale * da[..., None] * self.u * self.r
        dv = _earlier(g["v"], self.starts) + a[..., None] * do
        dw = _earlier(g["g"], self.starts)
        for name, grad in (("k", dk), ("v", dv), ("w", dw)):
            if name in extra:
                grad[self.last] += extra[name]
        grads = {"r": g["q"] + self.scale * da[..., None] * self.u * self.k, "k": dk, "v": dv, "w": dw,
                 "u": self.scale * np.einsum("bth,bthk,bthk->hk", da, self.r, self.k)}
        if "initial_state" in g:
            grads["initial_state"] = g["initial_state"]
        return grads


@_bf16.calls
def rwkv6(r, k, v, w, u, *, scale=None, initial_state=None, output_final_state=False,
          cu_seqlens=None, form="chunk", chunk_size=64):
    """RWKV-6 (Finch) time mixing: ``o_t = (S_{t-1} + diag(u) k_t v_t^T)^T (scale r_t)``,
    ``S_t = diag(exp(w_t)) S_{t-1} + k_t v_t^T``.

    r (the receptance, RWKV's query), k ``[B, T, H, K]``, v ``[B, T, H, V]``, w ``[B, T, H, K]``
    the data-dependent log decay per channel (``w <= 0``), u ``[H, K]`` the bonus of a token's
    own key-value product. ``scale`` defaults to ``K ** -0.5`` (fla's ``chunk_rwkv6``'s
    default); ``initial_state`` ``[N, H, K, V]``, ``cu_seqlens`` and the forms as ``gla``, on
    whose engine it runs. Returns ``(o [B, T, H, V], final_state or None)``.
    """
    call = _Rwkv6(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, form, chunk_size)
    return call.finish(*gla(*call.engine_args, **call.engine_kw))


@register_vjp(rwkv6)
def _rwkv6_vjp(r, k, v, w, u, *, scale=None, initial_state=None, output_final_state=False,
               cu_seqlens=None, form="chunk", chunk_size=64):
    call = _Rwkv6(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, form, chunk_size)
    (o, S_engine), engine_pullback = vjp(gla, *call.engine_args, **call.engine_kw)
    return call.finish(o, S_engine), lambda cot: call.pullback(engine_pullback, S_engine, cot)

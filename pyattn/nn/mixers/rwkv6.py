"""RWKV-6 (Finch; Peng et al. 2024, arXiv 2404.05892) time mixing, after fla's
``fla/layers/rwkv6.py``."""
from __future__ import annotations

import numpy as np

from ...rwkv import rwkv6
from ..layers import (GroupNorm, Mixer, gated_product, gated_product_backward, linear, linear_backward,
                      normal)

# the five data-dependent interpolations, in fla's order: r, w, k, v, g
_PARTS = "rwkvg"
_I = {c: i for i, c in enumerate(_PARTS)}


def _parts_first(t, rank):
    """``[B, T, 5 rank]`` -> the view ``[5, B T, rank]``."""
    return t.reshape(-1, 5, rank).transpose(1, 0, 2)


def token_shift(x, cache):
    """RWKV's token shift ``delta_t = x_{t-1} - x_t``: zeros before the first token in
    training, the cached last token when decoding (the cache's "prev" becomes x's last)."""
    shifted = np.empty_like(x)
    shifted[:, 1:] = x[:, :-1]
    shifted[:, 0] = 0 if cache is None else cache["prev"]
    if cache is not None:
        cache["prev"] = x[:, -1].copy()
    return shifted - x


def token_shift_backward(ddelta):
    """The gradient reaching x from that of ``delta = shift(x) - x``."""
    dx = -ddelta
    dx[:, :-1] += ddelta[:, 1:]
    return dx


class RWKV6Attention(Mixer):
    """Token shift ``delta_t = x_{t-1} - x_t`` (zeros before the first token); five
    data-dependent interpolation weights ``mu = tanh((x + delta mu_x) w_x1^T) w_x2^T + x_bias``
    (one low-rank product of rank ``proj_low_rank_dim`` per part); r, k, v, g projections of
    ``x + delta mu_part``; the decay ``w = -exp(tanh((x + delta mu_w) w_w1^T) w_w2^T + b_w2)``
    (rank ``gate_low_rank_dim``); ``pyattn.rwkv6(r, k, v, w, u, scale=1)`` with the bonus u
    ``[H, K]``; the output ``GroupNorm(o) * silu(g)`` (one group per head), then ``w_o``.

    Options: ``expand_k`` (0.5), ``expand_v`` (1), ``proj_low_rank_dim`` (32),
    ``gate_low_rank_dim`` (64), ``norm_eps`` (1e-5), ``chunk_size`` (64). fla's layer with its
    defaults; differs from fla in the initialisation (pyattn's normal(0.02) projections and
    zero mu, x_bias and u, where fla uses Xavier, orthogonal and zero-initialised LoRA weights).
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, expand_k=0.5, expand_v=1.0,
                 proj_low_rank_dim=32, gate_low_rank_dim=64, norm_eps=1e-5, chunk_size=64):
        super().__init__(dtype)
        H = n_heads
        K, Vd = int(d_model * expand_k) // H, int(d_model * expand_v) // H
        self.H, self.K, self.Vd, self.chunk_size, self.rank = H, K, Vd, chunk_size, proj_low_rank_dim
        self.add_param("mu_x", np.zeros(d_model))
        self.add_param("w_x1", normal(rng, (5 * proj_low_rank_dim, d_model)))
        self.add_param("w_x2", normal(rng, (d_model, 5 * proj_low_rank_dim)))
        self.add_param("x_bias", np.zeros((5, d_model)))
        for name, width in (("w_r", H * K), ("w_k", H * K), ("w_v", H * Vd), ("w_g", H * Vd),
                            ("w_w1", gate_low_rank_dim)):
            self.add_param(name, normal(rng, (width, d_model)))
        self.add_param("w_w2", normal(rng, (H * K, gate_low_rank_dim)))
        self.add_param("b_w2", np.zeros(H * K))
        self.add_param("u", np.zeros((H, K)))
        self.add_param("w_o", normal(rng, (d_model, H * Vd), out_std))
        self.g_norm = self.add_module("g_norm", GroupNorm(H * Vd, H, dtype=dtype, eps=norm_eps))

    def new_cache(self, batch, max_len):
        """The recurrent state and the last token (the next one's shift)."""
        return {"state": None, "prev": np.zeros((batch, self.p["mu_x"].shape[0]), self.dtype)}

    def _w_x2_parts(self):
        """w_x2 ``[d, 5 rank]`` as the five parts' ``[5, rank, d]``."""
        return self.p["w_x2"].reshape(-1, 5, self.rank).transpose(1, 2, 0)

    def _mix(self, x, cache, pos):
        B, T, d = x.shape
        H, K, Vd, r = self.H, self.K, self.Vd, self.rank
        delta = token_shift(x, cache)
        xx = x + delta * self.p["mu_x"]
        t1 = np.tanh(linear(xx, self.p["w_x1"]))
        # the five parts' low-rank products as one batched matmul, parts first: each part's
        # input inp[i] is then contiguous for its projection
        mus = (_parts_first(t1, r) @ self._w_x2_parts()).reshape(5, B, T, d) + self.p["x_bias"][:, None, None]
        inp = delta * mus
        inp += x
        lw = np.tanh(self.proj(inp[_I["w"]], "w_w1"))
        w = -np.exp(linear(lw, self.p["w_w2"]) + self.p["b_w2"]).reshape(B, T, H, K)
        rr, k = (self.proj(inp[_I[c]], "w_" + c).reshape(B, T, H, K) for c in "rk")
        v = self.proj(inp[_I["v"]], "w_v").reshape(B, T, H, Vd)
        o = self.run_op(rwkv6, (rr, k, v, w, self.p["u"]), dict(scale=1.0, chunk_size=self.chunk_size), cache)
        gpre = self.proj(inp[_I["g"]], "w_g")
        normed = self.g_norm.forward(o.reshape(B, T, H * Vd))
        on, sg = gated_product(gpre, normed)
        self.saved = (x, delta, xx, t1, mus, inp, lw, w, gpre, normed, sg, on)
        return linear(on, self.p["w_o"])

    def backward(self, dy):
        x, delta, xx, t1, mus, inp, lw, w, gpre, normed, sg, on = self.saved
        B, T, d = x.shape
        r = self.rank
        don = self.proj_backward(dy, on, "w_o")
        dgpre, dnormed = gated_product_backward(don, gpre, normed, sg)
        gr = self.pullback(self.g_norm.backward(dnormed).reshape(B, T, self.H, self.Vd))
        self.g["u"] += gr["u"]
        dinp = [None] * 5
        for c in "rkv":
            dinp[_I[c]] = self.proj_backward(gr[c].reshape(B, T, -1), inp[_I[c]], "w_" + c)
        dinp[_I["g"]] = self.proj_backward(dgpre, inp[_I["g"]], "w_g")
        dwpre = (gr["w"] * w).reshape(B, T, -1)  # d(-exp(a))/da = -exp(a) = w
        self.g["b_w2"] += dwpre.sum(axis=(0, 1))
        dlw = linear_backward(dwpre, lw, self.p["w_w2"], self.g["w_w2"]) * (1 - lw * lw)
        dinp[_I["w"]] = self.proj_backward(dlw, inp[_I["w"]], "w_w1")
        dx = sum(dinp)
        dmus = np.empty_like(mus)
        for i, di in enumerate(dinp):
            np.multiply(di, delta, out=dmus[i])
        ddelta = sum(di * mus[i] for i, di in enumerate(dinp))
        self.g["x_bias"] += dmus.sum(axis=(1, 2))
        dmus = dmus.reshape(5, B * T, d)
        self.g["w_x2"] += (dmus.transpose(0, 2, 1) @ _parts_first(t1, r)).transpose(1, 0, 2).reshape(d, 5 * r)
        dt1 = (dmus @ self._w_x2_parts().transpose(0, 2, 1)).transpose(1, 0, 2).reshape(t1.shape) * (1 - t1 * t1)
        dxx = linear_backward(dt1, xx, self.p["w_x1"], self.g["w_x1"])
        self.g["mu_x"] += np.einsum("btd,btd->d", dxx, delta)
        dx += dxx
        ddelta += dxx * self.p["mu_x"]
        return dx + token_shift_backward(ddelta)

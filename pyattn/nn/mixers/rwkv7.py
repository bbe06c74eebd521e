"""RWKV-7 (Goose; Peng et al. 2025, arXiv 2503.14456) time mixing, after fla's
``fla/layers/rwkv7.py``."""
from __future__ import annotations

import math

import numpy as np

from ...dplr import rwkv7
from ..layers import GroupNorm, Mixer, linear, linear_backward, normal, sigmoid
from .rwkv6 import token_shift, token_shift_backward

# the six token-shift interpolations, in fla's order: r, w, k, v, a, g
_PARTS = "rwkvag"
# fla's decay bound: w = -e^(-1/2) sigmoid(.), so every step keeps at least e^(-e^(-1/2))
_W_SCALE = -math.exp(-0.5)


def _depth_init(d_model: int, H: int, K: int, layer_idx: int, n_layers: int) -> dict:
    """RWKV-7's starting values (as fla's layer sets them) for block ``layer_idx`` of
    ``n_layers``: token-shift weights that shift less with depth, and per channel a linear
    ramp and a "zigzag" within each head that spread the decay, a and v biases."""
    deep = layer_idx / max(n_layers - 1, 1)     # 0 in the first block, 1 in the last
    shallow = 1 - layer_idx / n_layers          # 1 in the first block, towards 0
    n = np.arange(H * K)
    ramp = n / max(H * K - 1, 1) - 0.5
    half = max(K - 1, 1) / 2
    zigzag = ((n % K) - (K - 1) / 2) / half
    zigzag *= np.abs(zigzag)
    frac = np.arange(d_model) / d_model
    # r, w, k, v, a, g as _PARTS
    mu = np.stack([1 - frac ** (c * shallow) for c in (0.2, 0.9, 0.7, 0.7, 0.9, 0.2)])
    decay = -6 + 6 * (n / max(H * K - 1, 1)) ** (1 + deep ** 0.3)
    return {"mu": mu, "k_k": 0.71 - 0.1 * ramp, "k_a": np.full(H * K, 1.02), "r_k": np.full((H, K), -0.04),
            # the + 0.5 as fla's (its note: from RWKV-7's softplus form of the decay)
            "b_w2": decay + 0.5 + 2.5 * zigzag, "b_a2": -0.19 + 0.3 * zigzag + 0.4 * ramp,
            "b_v2": 0.73 - 0.4 * ramp, "g_norm": ((layer_idx + 1) / n_layers) ** 0.7}


def _low_rank(d_model: int, weight: float, factor: float) -> int:
    """fla's default rank of a LoRA: a multiple of 32, at least 32, growing as sqrt(d_model)."""
    return max(32, int(round(weight * math.sqrt(d_model) * factor / 32) * 32))


class RWKV7Attention(Mixer):
    """Token shift ``delta_t = x_{t-1} - x_t`` (zeros before the first token) and six
    interpolations ``x_p = x + delta mu_p``; r, k, v projections; the log decay ``w =
    -e^(-1/2) sigmoid(tanh(x_w w_w1^T) w_w2^T + b_w2)``; the in-context learning rate ``a =
    sigmoid(x_a w_a1^T w_a2^T + b_a2)``; the output gate ``g = sigmoid(x_g w_g1^T) w_g2^T``;
    ``kk = normalize(k k_k)`` per head, ``k <- k (1 + (a - 1) k_a)``;
    ``pyattn.rwkv7(r, w, k, v, a=-kk, b=kk a, scale=1)``; the output ``(GroupNorm(o) +
    (sum(r k r_k) per head) v) g`` (one group per head, eps ``K * norm_eps``), then ``w_o``.

    The value residual: in a HybridLM every rwkv7 mixer after the first mixes its values
    toward the first one's, ``v <- v + (v_first - v) sigmoid(x_v w_v1^T w_v2^T + b_v2)`` (fla's
    v_first, which its RWKV-7 model hands from layer 0 to the others); the model links them
    (``value_residual``, ``first``), and a mixer alone is a first one.

    Options: ``head_dim`` fixed by the model's ``n_heads``; ``decay_low_rank_dim``,
    ``a_low_rank_dim``, ``v_low_rank_dim``, ``gate_low_rank_dim`` (None: fla's defaults from
    d_model, at least 32), ``norm_eps`` (1e-5), ``chunk_size`` (64), ``layer_idx`` and
    ``n_layers`` (0 and 1; HybridLM passes the block's index and the model's depth). As fla's
    layer, the token-shift weights mu, the biases of the decay, a and v, the key scales k_k,
    k_a, r_k and the GroupNorm weight start at RWKV-7's values for that depth: the decay's bias
    spread over the channels, so that some keep almost all of their state a token and others
    little. Differs from fla in the other weights: pyattn's normal(0.02), where fla takes
    orthogonal r, k, v projections, a zero output projection and zero first LoRA matrices.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, decay_low_rank_dim=None,
                 a_low_rank_dim=None, v_low_rank_dim=None, gate_low_rank_dim=None, norm_eps=1e-5,
                 chunk_size=64, value_residual=False, layer_idx=0, n_layers=1):
        super().__init__(dtype)
        H = n_heads
        K = d_model // H
        factor = K / 64
        ranks = {"w": decay_low_rank_dim or _low_rank(d_model, 2.5, factor),
                 "a": a_low_rank_dim or _low_rank(d_model, 2.5, factor),
                 "v": v_low_rank_dim or _low_rank(d_model, 1.7, factor),
                 "g": gate_low_rank_dim or _low_rank(d_model, 5.0, 1.0)}
        self.H, self.K, self.chunk_size, self.value_residual = H, K, chunk_size, value_residual
        self.first: "RWKV7Attention" = self
        start = _depth_init(d_model, H, K, layer_idx, n_layers)
        self.add_param("mu", start["mu"])
        # (a zero k_k would leave kk zero: no low-rank term, no gradient to start it)
        for name in ("k_k", "k_a", "r_k"):
            self.add_param(name, start[name])
        for name in "rkv":
            self.add_param("w_" + name, normal(rng, (H * K, d_model)))
        for part in "wav"[:3 if value_residual else 2] + "g":
            self.add_param(f"w_{part}1", normal(rng, (ranks[part], d_model)))
            self.add_param(f"w_{part}2", normal(rng, (H * K, ranks[part])))
            if part != "g":
                self.add_param(f"b_{part}2", start[f"b_{part}2"])
        self.add_param("w_o", normal(rng, (d_model, H * K), out_std))
        self.g_norm = self.add_module("g_norm", GroupNorm(H * K, H, dtype=dtype, eps=K * norm_eps))
        self.g_norm.p["w"][...] = start["g_norm"]

    def new_cache(self, batch, max_len):
        """The recurrent state and the last token (the next one's shift)."""
        return {"state": None, "prev": np.zeros((batch, self.p["mu"].shape[1]), self.dtype)}

    def _heads(self, x):
        return x.reshape(x.shape[:2] + (self.H, self.K))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        delta = token_shift(x, cache)
        xs = {c: x + delta * self.p["mu"][i] for i, c in enumerate(_PARTS)}
        r, k, v0 = (self.proj(xs[c], "w_" + c) for c in "rkv")
        lw = np.tanh(self.proj(xs["w"], "w_w1"))
        sw = sigmoid(linear(lw, self.p["w_w2"]) + self.p["b_w2"])
        w = _W_SCALE * sw
        la = self.proj(xs["a"], "w_a1")
        a = sigmoid(linear(la, self.p["w_a2"]) + self.p["b_a2"])
        sg = sigmoid(self.proj(xs["g"], "w_g1"))
        g = linear(sg, self.p["w_g2"])
        if self.value_residual:
            lv = self.proj(xs["v"], "w_v1")
            mix = sigmoid(linear(lv, self.p["w_v2"]) + self.p["b_v2"])
            v = v0 + (self.first.v_first - v0) * mix
        else:
            lv = mix = None
            v = self.v_first = v0
            self.dv_first = np.zeros_like(v0)
        kh = self._heads(k * self.p["k_k"])
        norm = np.maximum(np.sqrt(np.sum(kh * kh, axis=-1, keepdims=True)), 1e-12)
        kk = kh / norm
        k2 = k * (1 + (a - 1) * self.p["k_a"])
        rh, k2h, vh, ah = (self._heads(t) for t in (r, k2, v, a))
        o = self.run_op(rwkv7, (rh, self._heads(w), k2h, vh, -kk, kk * ah),
                        dict(scale=1.0, chunk_size=self.chunk_size), cache)
        normed = self.g_norm.forward(o.reshape(B, T, -1))
        bonus = np.sum(rh * k2h * self.p["r_k"], axis=-1, keepdims=True)
        pre = normed + (bonus * vh).reshape(B, T, -1)
        out = pre * g
        self.saved = (x, delta, xs, r, k, v0, v, lw, sw, la, a, sg, g, lv, mix, norm, kk, k2, bonus, pre, out)
        return linear(out, self.p["w_o"])

    def backward(self, dy):
        x, delta, xs, r, k, v0, v, lw, sw, la, a, sg, g, lv, mix, norm, kk, k2, bonus, pre, out = self.saved
        B, T, _ = x.shape
        heads = self._heads
        dout = self.proj_backward(dy, out, "w_o")
        dpre = dout * g
        dg = dout * pre
        # the bonus (sum r k2 r_k per head) v
        dpre_h = heads(dpre)
        dbonus = np.sum(dpre_h * heads(v), axis=-1, keepdims=True)
        rh, k2h = heads(r), heads(k2)
        gr = self.pullback(self.g_norm.backward(dpre).reshape(B, T, self.H, self.K))
        dr = (gr["r"] + dbonus * k2h * self.p["r_k"]).reshape(B, T, -1)
        dk2 = (gr["k"] + dbonus * rh * self.p["r_k"]).reshape(B, T, -1)
        dv = (gr["v"] + dpre_h * bonus).reshape(B, T, -1)
        self.g["r_k"] += np.einsum("bthk,bthk->hk", dbonus * rh, k2h)
        # a = -kk, b = kk a (per head)
        ah = heads(a)
        dkk = gr["b"] * ah - gr["a"]
        da = (gr["b"] * kk).reshape(B, T, -1)
        # k2 = k (1 + (a - 1) k_a)
        dk = dk2 * (1 + (a - 1) * self.p["k_a"])
        da += dk2 * k * self.p["k_a"]
        self.g["k_a"] += np.einsum("btc,btc->c", dk2, k * (a - 1))
        # kk = normalize(k k_k) per head
        du = (dkk - kk * np.sum(dkk * kk, axis=-1, keepdims=True)) / norm
        du = np.where(norm > 1e-12, du, dkk / norm).reshape(B, T, -1)
        dk += du * self.p["k_k"]
        self.g["k_k"] += np.einsum("btc,btc->c", du, k)
        dxs = {"r": self.proj_backward(dr, xs["r"], "w_r"), "k": self.proj_backward(dk, xs["k"], "w_k")}
        # the output gate g = sigmoid(x_g w_g1^T) w_g2^T
        dsg = linear_backward(dg, sg, self.p["w_g2"], self.g["w_g2"])
        dxs["g"] = self.proj_backward(dsg * sg * (1 - sg), xs["g"], "w_g1")
        # a = sigmoid(x_a w_a1^T w_a2^T + b_a2)
        dapre = da * a * (1 - a)
        self.g["b_a2"] += dapre.sum(axis=(0, 1))
        dxs["a"] = self.proj_backward(linear_backward(dapre, la, self.p["w_a2"], self.g["w_a2"]), xs["a"], "w_a1")
        # w = -e^(-1/2) sigmoid(tanh(x_w w_w1^T) w_w2^T + b_w2)
        dwpre = gr["w"].reshape(B, T, -1) * _W_SCALE * sw * (1 - sw)
        self.g["b_w2"] += dwpre.sum(axis=(0, 1))
        dlw = linear_backward(dwpre, lw, self.p["w_w2"], self.g["w_w2"]) * (1 - lw * lw)
        dxs["w"] = self.proj_backward(dlw, xs["w"], "w_w1")
        # the values, and the value residual (the later mixers' backward runs first)
        if self.value_residual:
            self.first.dv_first += dv * mix
            dmix = dv * (self.first.v_first - v0) * mix * (1 - mix)
            self.g["b_v2"] += dmix.sum(axis=(0, 1))
            dlv = linear_backward(dmix, lv, self.p["w_v2"], self.g["w_v2"])
            dxs["v"] = self.proj_backward(dlv, xs["v"], "w_v1") + self.proj_backward(dv * (1 - mix), xs["v"], "w_v")
        else:
            dxs["v"] = self.proj_backward(dv + self.dv_first, xs["v"], "w_v")
        dx = sum(dxs.values())
        ddelta = sum(dxs[c] * self.p["mu"][i] for i, c in enumerate(_PARTS))
        self.g["mu"] += np.stack([np.einsum("btd,btd->d", dxs[c], delta) for c in _PARTS])
        return dx + token_shift_backward(ddelta)

"""Gated Linear Attention (Yang et al. 2024, arXiv 2312.06635), after fla's
``fla/layers/gla.py``."""
from __future__ import annotations

import numpy as np

from ...linear import gla
from ..layers import Mixer, RMSNorm, linear, linear_backward, logsigmoid, normal, sigmoid


class GatedLinearAttention(Mixer):
    """q, k, v projections (key dim ``expand_k`` = 0.5 of d_model, value dim d_model, as
    fla); the key gate from a low-rank projection, ``g = logsigmoid((x w_gk1^T) w_gk2^T +
    b_gk) / 16`` ``[B, T, H, K]``; ``pyattn.gla``; the output ``RMSNorm(o) * silu(x w_g^T)``
    per head, then ``w_o``. fla's defaults (no short convolution, ``gate_low_rank_dim`` 16,
    swish output gate).

    Options: ``expand_k`` (0.5), ``expand_v`` (1), ``gate_low_rank_dim`` (16),
    ``gate_logit_normalizer`` (16), ``norm_eps`` (1e-5), ``chunk_size`` (64), ``short_conv``
    (False, as fla's ``use_short_conv``: a short causal convolution, kernel 4 with SiLU,
    after each of the q, k, v projections). Differs from fla: no feature-map, ``clamp_min``
    or KV-group options.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, expand_k=0.5, expand_v=1.0,
                 gate_low_rank_dim=16, gate_logit_normalizer=16, norm_eps=1e-5, chunk_size=64,
                 short_conv=False):
        super().__init__(dtype)
        H = n_heads
        K, Vd = int(d_model * expand_k) // H, int(d_model * expand_v) // H
        self.H, self.K, self.Vd, self.chunk_size = H, K, Vd, chunk_size
        self.normalizer = gate_logit_normalizer
        self.add_qkv(rng, d_model, (H * K, H * K, H * Vd), short_conv)
        for name, n in (("w_g", H * Vd), ("w_gk1", gate_low_rank_dim)):
            self.add_param(name, normal(rng, (n, d_model)))
        self.add_param("w_gk2", normal(rng, (H * K, gate_low_rank_dim)))
        self.add_param("b_gk", np.zeros(H * K))
        self.add_param("w_o", normal(rng, (d_model, H * Vd), out_std))
        self.o_norm = self.add_module("o_norm", RMSNorm(Vd, dtype=dtype, eps=norm_eps, gated=True))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        H, K, Vd = self.H, self.K, self.Vd
        q, k, v = self.project_qkv(x, cache)
        low = self.proj(x, "w_gk1")
        gk = linear(low, self.p["w_gk2"]) + self.p["b_gk"]
        g = (logsigmoid(gk) / self.normalizer).reshape(B, T, H, K)
        o = self.run_op(gla, (q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H, Vd), g),
                        dict(chunk_size=self.chunk_size), cache)
        on = self.o_norm.forward(o, self.proj(x, "w_g").reshape(B, T, H, Vd)).reshape(B, T, -1)
        self.saved = (x, low, gk, on)
        return linear(on, self.p["w_o"])

    def backward(self, dy):
        x, low, gk, on = self.saved
        B, T, _ = x.shape
        don = self.proj_backward(dy, on, "w_o")
        do, dgate = self.o_norm.backward(don.reshape(B, T, self.H, self.Vd))
        dx = self.proj_backward(dgate.reshape(B, T, -1), x, "w_g")
        gr = self.pullback(do)
        dgk = gr["g"].reshape(B, T, -1) * sigmoid(-gk) / self.normalizer
        self.g["b_gk"] += dgk.sum(axis=(0, 1))
        dlow = linear_backward(dgk, low, self.p["w_gk2"], self.g["w_gk2"])
        dx += self.proj_backward(dlow, x, "w_gk1")
        return dx + self.project_qkv_backward(x, gr["q"], gr["k"], gr["v"])

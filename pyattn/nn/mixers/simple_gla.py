"""Simple GLA (a scalar gate per head and step; Sun et al. 2024's "Lightning Attention-2"
gating, fla's ``fla/layers/simple_gla.py``)."""
from __future__ import annotations

import numpy as np

from ...linear import simple_gla
from ..layers import Mixer, RMSNorm, linear, logsigmoid, normal, sigmoid


class SimpleGLA(Mixer):
    """q, k, v projections, each through a short causal convolution (kernel 4, SiLU);
    ``pyattn.simple_gla`` with the gate ``g = logsigmoid(x w_gk^T + b_gk) / 16`` (fla's
    ``gate_logit_normalizer``); the output ``RMSNorm(o) * silu(x w_g^T)`` per head, then
    ``w_o``. fla's defaults (``expand_k = expand_v = 1``, ``use_short_conv=True``, swish
    output gate).

    Options: ``head_dim`` (default d_model / n_heads), ``gate_logit_normalizer`` (16),
    ``norm_eps`` (1e-5), ``chunk_size`` (64). Differs from fla: no feature map or KV-group
    options.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, head_dim=None,
                 gate_logit_normalizer=16, norm_eps=1e-5, chunk_size=64):
        super().__init__(dtype)
        H = n_heads
        K = head_dim or d_model // H
        self.H, self.K, self.chunk_size, self.normalizer = H, K, chunk_size, gate_logit_normalizer
        self.add_qkv(rng, d_model, (H * K,) * 3, short_conv=True)
        for name, n in (("w_gk", H), ("w_g", H * K)):
            self.add_param(name, normal(rng, (n, d_model)))
        self.add_param("b_gk", np.zeros(H))
        self.add_param("w_o", normal(rng, (d_model, H * K), out_std))
        self.o_norm = self.add_module("o_norm", RMSNorm(K, dtype=dtype, eps=norm_eps, gated=True))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        shape = (B, T, self.H, self.K)
        q, k, v = self.project_qkv(x, cache)
        gk = self.proj(x, "w_gk") + self.p["b_gk"]
        g = logsigmoid(gk) / self.normalizer
        o = self.run_op(simple_gla, (q.reshape(shape), k.reshape(shape), v.reshape(shape), g),
                        dict(chunk_size=self.chunk_size), cache)
        on = self.o_norm.forward(o, self.proj(x, "w_g").reshape(shape)).reshape(B, T, -1)
        self.saved = (x, gk, on)
        return linear(on, self.p["w_o"])

    def backward(self, dy):
        x, gk, on = self.saved
        B, T, _ = x.shape
        don = self.proj_backward(dy, on, "w_o")
        do, dgate = self.o_norm.backward(don.reshape(B, T, self.H, self.K))
        dx = self.proj_backward(dgate.reshape(B, T, -1), x, "w_g")
        gr = self.pullback(do)
        dgk = gr["g"] * sigmoid(-gk) / self.normalizer
        self.g["b_gk"] += dgk.sum(axis=(0, 1))
        dx += self.proj_backward(dgk, x, "w_gk")
        return dx + self.project_qkv_backward(x, gr["q"], gr["k"], gr["v"])

"""Kimi Delta Attention (Kimi Linear, arXiv 2510.26692), after fla's ``fla/layers/kda.py``."""
from __future__ import annotations

import numpy as np

from ...delta import kda
from ..layers import Mixer, RMSNorm, linear, linear_backward, normal, sigmoid, softplus
from .gated_deltanet import dt_bias_init


class KimiDeltaAttention(Mixer):
    """q, k, v projections, each through a short causal convolution (kernel 4, SiLU);
    ``pyattn.kda`` with q and k L2-normalised, the per-channel gate ``g = -exp(A_log_h)
    softplus(f + dt_bias)`` from the low-rank ``f = (x w_f1^T) w_f2^T`` ``[B, T, H, K]`` and
    ``beta = sigmoid(x w_b^T)``; the output ``RMSNorm(o) * sigmoid(gate)`` per head with the
    low-rank ``gate = (x w_g1^T) w_g2^T + b_g2``, then ``w_o``. fla's layer with its gate and
    beta computed in the kernel (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``), its
    sigmoid output gate and its A_log and dt_bias initialisations.

    Options: ``head_dim`` (default d_model / n_heads), ``expand_v`` (1), ``norm_eps`` (1e-5),
    ``chunk_size`` (64). Differs from fla: head dim d_model / n_heads (fla: 128); no GVA,
    ``allow_neg_eigval``, ``safe_gate`` or ``lower_bound``.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, head_dim=None, expand_v=1.0,
                 norm_eps=1e-5, chunk_size=64):
        super().__init__(dtype)
        H = n_heads
        K = head_dim or d_model // H
        Vd = int(K * expand_v)
        self.H, self.K, self.Vd, self.chunk_size = H, K, Vd, chunk_size
        self.add_qkv(rng, d_model, (H * K, H * K, H * Vd), short_conv=True)
        for name, shape in (("w_f1", (Vd, d_model)), ("w_f2", (H * K, Vd)), ("w_b", (H, d_model)),
                            ("w_g1", (Vd, d_model)), ("w_g2", (H * Vd, Vd))):
            self.add_param(name, normal(rng, shape))
        self.add_param("b_g2", np.zeros(H * Vd))
        self.add_param("w_o", normal(rng, (d_model, H * Vd), out_std))
        self.add_param("A_log", np.log(rng.uniform(1, 16, H)))
        self.add_param("dt_bias", dt_bias_init(rng, H * K))
        self.o_norm = self.add_module("o_norm", RMSNorm(Vd, dtype=dtype, eps=norm_eps))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        H, K, Vd = self.H, self.K, self.Vd
        q, k, v = self.project_qkv(x, cache)
        f1 = self.proj(x, "w_f1")
        f = linear(f1, self.p["w_f2"]) + self.p["dt_bias"]
        A = -np.exp(self.p["A_log"])[:, None]
        g = A * softplus(f.reshape(B, T, H, K))
        beta = sigmoid(self.proj(x, "w_b"))
        o = self.run_op(kda, (q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H, Vd), g, beta),
                        dict(qk_l2norm=True, chunk_size=self.chunk_size), cache)
        g1 = self.proj(x, "w_g1")
        gate = sigmoid(linear(g1, self.p["w_g2"]) + self.p["b_g2"]).reshape(B, T, H, Vd)
        normed = self.o_norm.forward(o)
        on = (normed * gate).reshape(B, T, H * Vd)
        self.saved = (x, f1, f, A, g, beta, g1, gate, normed, on)
        return linear(on, self.p["w_o"])

    def backward(self, dy):
        x, f1, f, A, g, beta, g1, gate, normed, on = self.saved
        B, T, _ = x.shape
        don = self.proj_backward(dy, on, "w_o").reshape(gate.shape)
        do = self.o_norm.backward(don * gate)
        dpre = (don * normed * gate * (1 - gate)).reshape(B, T, -1)
        self.g["b_g2"] += dpre.sum(axis=(0, 1))
        dx_gate = self.proj_backward(linear_backward(dpre, g1, self.p["w_g2"], self.g["w_g2"]), x, "w_g1")
        gr = self.pullback(do)
        dx = dx_gate + self.proj_backward(gr["beta"] * beta * (1 - beta), x, "w_b")
        dg = gr["g"]
        self.g["A_log"] += np.einsum("bthk,bthk->h", dg, g)  # d g / d A_log = g
        df = (dg * A * sigmoid(f.reshape(dg.shape))).reshape(B, T, -1)
        self.g["dt_bias"] += df.sum(axis=(0, 1))
        dx += self.proj_backward(linear_backward(df, f1, self.p["w_f2"], self.g["w_f2"]), x, "w_f1")
        return dx + self.project_qkv_backward(x, gr["q"], gr["k"], gr["v"])

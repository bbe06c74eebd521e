"""RetNet's multi-scale retention (Sun et al. 2023, arXiv 2307.08621), after fla's
``fla/layers/multiscale_retention.py``."""
from __future__ import annotations

import numpy as np

from ...linear import retention
from ..layers import Mixer, RMSNorm, Rotary, linear, normal


class MultiScaleRetention(Mixer):
    """q, k, v projections (value dim ``expand_v`` = 2 times d_model, as fla), rotary
    embedding of q and k (fla's RotaryEmbedding: ``pyattn.rope``'s half-split pairs), the
    fixed multi-scale decays ``gamma_h = 1 - 2**(-5 - h)`` of ``pyattn.retention``; the
    output ``RMSNorm(o) * silu(x w_g^T)`` per head (fla's swish gate), then ``w_o``.

    Options: ``expand_k`` (1), ``expand_v`` (2), ``rope_theta`` (10000), ``norm_eps``
    (1e-5), ``chunk_size`` (64), ``short_conv`` (False, as fla's ``use_short_conv``: a short
    causal convolution, kernel 4 with SiLU, after each of the q, k, v projections). Differs
    from fla: no feature-map or KV-group options. The paper's xPos is RoPE here, as in fla.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, expand_k=1.0, expand_v=2.0,
                 rope_theta=10000.0, norm_eps=1e-5, chunk_size=64, short_conv=False):
        super().__init__(dtype)
        H = n_heads
        K, Vd = int(d_model * expand_k) // H, int(d_model * expand_v) // H
        self.H, self.K, self.Vd, self.chunk_size = H, K, Vd, chunk_size
        self.add_qkv(rng, d_model, (H * K, H * K, H * Vd), short_conv)
        self.add_param("w_g", normal(rng, (H * Vd, d_model)))
        self.add_param("w_o", normal(rng, (d_model, H * Vd), out_std))
        self.rotary = Rotary(K, rope_theta, dtype=dtype)
        self.o_norm = self.add_module("o_norm", RMSNorm(Vd, dtype=dtype, eps=norm_eps, gated=True))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        H, K, Vd = self.H, self.K, self.Vd
        q, k, v = self.project_qkv(x, cache)
        q, k = self.rotary.forward(np.arange(pos, pos + T), q.reshape(B, T, H, K), k.reshape(B, T, H, K))
        v = v.reshape(B, T, H, Vd)
        o = self.run_op(retention, (q, k, v), dict(chunk_size=self.chunk_size), cache)
        on = self.o_norm.forward(o, self.proj(x, "w_g").reshape(B, T, H, Vd)).reshape(B, T, -1)
        self.saved = (x, on)
        return linear(on, self.p["w_o"])

    def backward(self, dy):
        x, on = self.saved
        B, T, _ = x.shape
        don = self.proj_backward(dy, on, "w_o")
        do, dgate = self.o_norm.backward(don.reshape(B, T, self.H, self.Vd))
        dx = self.proj_backward(dgate.reshape(B, T, -1), x, "w_g")
        gr = self.pullback(do)
        dq, dk = self.rotary.backward(gr["q"], gr["k"])
        return dx + self.project_qkv_backward(x, dq, dk, gr["v"])

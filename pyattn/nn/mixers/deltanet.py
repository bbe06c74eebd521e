"""DeltaNet (Schlag et al. 2021; Yang et al. 2024, arXiv 2406.06484), after fla's
``fla/layers/delta_net.py``."""
from __future__ import annotations

from ...delta import delta_rule
from ..layers import Mixer, RMSNorm, linear, normal, sigmoid


class DeltaNet(Mixer):
    """q, k, v projections, each through a short causal convolution (kernel 4, SiLU);
    ``pyattn.delta_rule`` with q and k L2-normalised and ``beta = sigmoid(x w_b^T)``; a
    per-head RMSNorm of the output, then ``w_o``. fla's defaults (``use_beta``,
    ``qk_activation="silu"``, ``qk_norm="l2"``, no output gate).

    Options: ``head_dim`` (default d_model / n_heads), ``norm_eps`` (1e-5), ``chunk_size``
    (64). Differs from fla: no ``use_gate``, ``allow_neg_eigval`` or sum-norm options.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, head_dim=None, norm_eps=1e-5,
                 chunk_size=64):
        super().__init__(dtype)
        H = n_heads
        K = head_dim or d_model // H
        self.H, self.K, self.chunk_size = H, K, chunk_size
        self.add_qkv(rng, d_model, (H * K,) * 3, short_conv=True)
        self.add_param("w_b", normal(rng, (H, d_model)))
        self.add_param("w_o", normal(rng, (d_model, H * K), out_std))
        self.o_norm = self.add_module("o_norm", RMSNorm(K, dtype=dtype, eps=norm_eps))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        shape = (B, T, self.H, self.K)
        q, k, v = self.project_qkv(x, cache)
        beta = sigmoid(self.proj(x, "w_b"))
        o = self.run_op(delta_rule, (q.reshape(shape), k.reshape(shape), v.reshape(shape), beta),
                        dict(qk_l2norm=True, chunk_size=self.chunk_size), cache)
        on = self.o_norm.forward(o).reshape(B, T, -1)
        self.saved = (x, beta, on)
        return linear(on, self.p["w_o"])

    def backward(self, dy):
        x, beta, on = self.saved
        B, T, _ = x.shape
        don = self.proj_backward(dy, on, "w_o")
        gr = self.pullback(self.o_norm.backward(don.reshape(B, T, self.H, self.K)))
        dx = self.proj_backward(gr["beta"] * beta * (1 - beta), x, "w_b")
        return dx + self.project_qkv_backward(x, gr["q"], gr["k"], gr["v"])

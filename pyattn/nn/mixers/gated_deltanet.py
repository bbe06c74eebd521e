"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024, arXiv 2412.06464), after fla's
``fla/layers/gated_deltanet.py``."""
from __future__ import annotations

import numpy as np

from ...delta import gated_delta_rule
from ...delta_product import gated_delta_product
from ..layers import Mixer, RMSNorm, linear, normal, sigmoid, softplus


def dt_bias_init(rng, H):
    """Mamba's dt initialisation: dt log-uniform in [1e-3, 1e-1], floored at 1e-4, stored
    as its inverse softplus."""
    dt = np.exp(rng.random(H) * (np.log(0.1) - np.log(0.001)) + np.log(0.001))
    dt = np.maximum(dt, 1e-4)
    return dt + np.log(-np.expm1(-dt))


class GatedDeltaNet(Mixer):
    """q, k, v projections, each through a short causal convolution (kernel 4, SiLU);
    ``pyattn.gated_delta_rule`` with q and k L2-normalised (``qk_l2norm=True``), gate
    ``g = -exp(A_log) * softplus(x w_a^T + dt_bias)`` and ``beta = sigmoid(x w_b^T)``; the
    output ``RMSNorm(o) * silu(x w_g^T)`` per head, then ``w_o``.

    Options: ``head_dim`` (default d_model / n_heads), ``expand_v`` (value head dim =
    head_dim * expand_v, default 1), ``norm_eps`` (1e-5), ``chunk_size`` (64).

    Differs from fla: fla's defaults (head_dim 256, expand_v 2, six heads at 0.75 d_model)
    suit large models; here the head dim is d_model / n_heads and expand_v 1. No
    ``allow_neg_eigval``, GVA or short-convolution bias.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, head_dim=None, expand_v=1.0,
                 norm_eps=1e-5, chunk_size=64):
        self._build(d_model, n_heads, dtype, rng, out_std, head_dim, expand_v, norm_eps, chunk_size, 1, False)

    def _build(self, d_model, n_heads, dtype, rng, out_std, head_dim, expand_v, norm_eps, chunk_size, n,
               neg_eigval):
        """n delta steps per token (k, v and beta projections n times as wide); with
        neg_eigval, beta = 2 sigmoid(b) (eigenvalues of the transitions down to -1)."""
        super().__init__(dtype)
        H = n_heads
        K = head_dim or d_model // H
        Vd = int(K * expand_v)
        self.H, self.K, self.Vd, self.chunk_size = H, K, Vd, chunk_size
        self.n, self.beta_scale = n, 2.0 if neg_eigval else 1.0
        self.add_qkv(rng, d_model, (H * K, n * H * K, n * H * Vd), short_conv=True)
        for name, width in (("w_a", H), ("w_b", n * H), ("w_g", H * Vd)):
            self.add_param(name, normal(rng, (width, d_model)))
        self.add_param("w_o", normal(rng, (d_model, H * Vd), out_std))
        self.add_param("A_log", np.log(rng.uniform(0, 16, H)))
        self.add_param("dt_bias", dt_bias_init(rng, H))
        self.o_norm = self.add_module("o_norm", RMSNorm(Vd, dtype=dtype, eps=norm_eps, gated=True))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        H, K, Vd, n = self.H, self.K, self.Vd, self.n
        q, k, v = self.project_qkv(x, cache)
        a, b = self.proj(x, "w_a"), self.proj(x, "w_b")
        A = -np.exp(self.p["A_log"])
        sp = softplus(a + self.p["dt_bias"])
        g, s = A * sp, sigmoid(b)
        # a token's n steps are consecutive rows: [B, T, (n H D)] is [B, T n, H, D]
        args = (q.reshape(B, T, H, K), k.reshape(B, T * n, H, K), v.reshape(B, T * n, H, Vd), g,
                (self.beta_scale * s).reshape(B, T * n, H))
        kwargs = dict(qk_l2norm=True, chunk_size=self.chunk_size)
        if n == 1:
            o = self.run_op(gated_delta_rule, args, kwargs, cache)
        else:
            o = self.run_op(gated_delta_product, args, dict(kwargs, num_householder=n), cache)
        on = self.o_norm.forward(o, self.proj(x, "w_g").reshape(B, T, H, Vd)).reshape(B, T, H * Vd)
        self.saved = (x, a, A, g, s, on)
        return linear(on, self.p["w_o"])

    def backward(self, dy):
        x, a, A, g, s, on = self.saved
        B, T, _ = x.shape
        don = self.proj_backward(dy, on, "w_o")
        do, dgate = self.o_norm.backward(don.reshape(B, T, self.H, self.Vd))
        dx = self.proj_backward(dgate.reshape(B, T, -1), x, "w_g")
        gr = self.pullback(do)
        dx += self.proj_backward(self.beta_scale * gr["beta"].reshape(s.shape) * s * (1 - s), x, "w_b")
        dg = gr["g"]
        self.g["A_log"] += np.einsum("bth,bth->h", dg, g)  # d g / d A_log = g
        da = dg * A * sigmoid(a + self.p["dt_bias"])
        self.g["dt_bias"] += da.sum(axis=(0, 1))
        dx += self.proj_backward(da, x, "w_a")
        return dx + self.project_qkv_backward(x, gr["q"], gr["k"], gr["v"])


class GatedDeltaProduct(GatedDeltaNet):
    """Gated DeltaProduct (Siems et al. 2025, arXiv 2502.10297), after fla's
    ``fla/layers/gated_deltaproduct.py``: Gated DeltaNet's layer with ``num_householder``
    delta steps per token (the k, v and beta projections that many times as wide, each
    token's k and v rows through the short convolutions), ``pyattn.gated_delta_product``.

    Options: ``num_householder`` (2), ``allow_neg_eigval`` (True, as fla: ``beta = 2
    sigmoid(x w_b^T)``), and Gated DeltaNet's. Differs from fla as Gated DeltaNet does (head
    dim d_model / n_heads, expand_v 1, no GVA), and the forget gate is always on.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, head_dim=None, expand_v=1.0,
                 norm_eps=1e-5, chunk_size=64, num_householder=2, allow_neg_eigval=True):
        self._build(d_model, n_heads, dtype, rng, out_std, head_dim, expand_v, norm_eps, chunk_size,
                    num_householder, allow_neg_eigval)

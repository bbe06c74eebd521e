"""Log-linear Mamba-2 (Guo et al. 2025, arXiv 2506.04761), after fla's
``fla/layers/log_linear_mamba2.py``."""
from __future__ import annotations

import numpy as np

from ...log_linear import log_linear_attention
from ..layers import linear, normal, sigmoid, softplus
from .mamba2 import Mamba2


class LogLinearMamba2(Mamba2):
    """Mamba-2's layer (see ``Mamba2``) whose SSD is log-linear attention: the projections to
    z, x, B, C and dt, the short convolutions over x, B and C, ``dt = softplus(dt + dt_bias)``;
    then ``pyattn.log_linear_attention(q=C, k=B, v=x dt, g=A dt, level_scales, scale=1)`` with
    B and C shared by the heads of their group and ``level_scales = softplus(L dl)``, ``dl``
    one more projection (``num_levels`` per head) and ``L`` ``[H, num_levels]`` (ones at the
    start); ``+ D x``; ``RMSNorm(y * silu(z))``; ``w_o``.

    Options: Mamba2's, and ``num_levels`` (15: fla's, enough for 16,384 tokens; a sequence
    decoded past what its levels cover is an error of the op).
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, num_levels=15, **options):
        super().__init__(d_model, n_heads, dtype=dtype, rng=rng, out_std=out_std, **options)
        self.levels = num_levels
        self.add_param("w_dl", normal(rng, (n_heads * num_levels, d_model)))
        self.add_param("L", np.ones((n_heads, num_levels)))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        H, P, G, N, Lv = self.H, self.P, self.G, self.N, self.levels
        xs, Bm, Cm = self.convs((self.conv_x, self.conv_B, self.conv_C),
                                (self.proj(x, "w_x"), self.proj(x, "w_B"), self.proj(x, "w_C")), cache)
        xh = xs.reshape(B, T, H, P)
        dt_pre = self.proj(x, "w_dt") + self.p["dt_bias"]
        dt = softplus(dt_pre)
        A = -np.exp(self.p["A_log"])
        dl = self.proj(x, "w_dl").reshape(B, T, H, Lv)
        scales = softplus(self.p["L"] * dl)
        share = H // G  # heads per group of B and C
        q = np.repeat(Cm.reshape(B, T, G, N), share, axis=2)
        k = np.repeat(Bm.reshape(B, T, G, N), share, axis=2)
        y = self.run_op(log_linear_attention, (q, k, xh * dt[..., None], A * dt, scales),
                        dict(scale=1.0, chunk_size=self.chunk_size), cache)
        y = y + self.p["D"][:, None] * xh
        on = self.norm.forward(y.reshape(B, T, -1), self.proj(x, "w_z"))
        self.saved = (x, xh, dt_pre, dt, A, dl, on)
        return linear(on, self.p["w_o"])

    def backward(self, dy):
        x, xh, dt_pre, dt, A, dl, on = self.saved
        B, T, _ = x.shape
        H, P, G, N = self.H, self.P, self.G, self.N
        don = self.proj_backward(dy, on, "w_o")
        dyn, dz = self.norm.backward(don)
        dx = self.proj_backward(dz, x, "w_z")
        dyh = dyn.reshape(B, T, H, P)
        self.g["D"] += np.einsum("bthp,bthp->h", dyh, xh)
        gr = self.pullback(dyh)
        dxh = gr["v"] * dt[..., None] + dyh * self.p["D"][:, None]
        ddt = np.einsum("bthp,bthp->bth", gr["v"], xh) + gr["g"] * A
        self.g["A_log"] += np.einsum("bth,bth->h", gr["g"], dt) * A
        ddt_pre = ddt * sigmoid(dt_pre)
        self.g["dt_bias"] += ddt_pre.sum(axis=(0, 1))
        dx += self.proj_backward(ddt_pre, x, "w_dt")
        # level_scales = softplus(L dl)
        dpre = gr["level_scales"] * sigmoid(self.p["L"] * dl)
        self.g["L"] += np.einsum("bthl,bthl->hl", dpre, dl)
        dx += self.proj_backward((dpre * self.p["L"]).reshape(B, T, -1), x, "w_dl")
        dC, dB = (gr[n].reshape(B, T, G, H // G, N).sum(axis=3).reshape(B, T, G * N) for n in ("q", "k"))
        for conv, name, d in ((self.conv_x, "w_x", dxh.reshape(B, T, -1)), (self.conv_B, "w_B", dB),
                              (self.conv_C, "w_C", dC)):
            dx += self.proj_backward(conv.backward(d), x, name)
        return dx

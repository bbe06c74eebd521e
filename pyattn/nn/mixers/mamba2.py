"""Mamba-2 (Dao & Gu 2024, arXiv 2405.21060), after fla's ``fla/layers/mamba2.py``."""
from __future__ import annotations

import numpy as np

from ...linear import mamba2
from ..layers import Mixer, RMSNorm, ShortConv, linear, normal
from .gated_deltanet import dt_bias_init


class Mamba2(Mixer):
    """The input projection to z (the gate), x, B, C and dt; a short causal convolution
    (kernel 4, SiLU, with bias) over x, B and C; ``pyattn.mamba2`` (SSD) with
    ``A = -exp(A_log)``, the skip ``D`` and ``dt_bias``; ``RMSNorm(y * silu(z))`` over the
    whole inner width (fla's RMSNormGated with ``norm_before_gate=False``, one group); then
    ``w_o``. Inner width ``expand`` (2) times d_model, split into n_heads heads.

    Options: ``expand`` (2), ``d_state`` (64), ``n_groups`` (1), ``norm_eps`` (1e-5),
    ``chunk_size`` (64). Differs from fla: separate projections and convolutions for x, B,
    C (fla fuses them into one in_proj and one conv1d: the same maps, since the convolution
    is depthwise); the head count is n_heads rather than inferred from a head dim of 64; a
    state of 64 rather than 128; no ``D_has_hdim``, ``dt_limit`` or projection bias.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, expand=2, d_state=64, n_groups=1,
                 norm_eps=1e-5, chunk_size=64):
        super().__init__(dtype)
        H, I = n_heads, expand * d_model
        if I % H or H % n_groups:
            raise ValueError(f"mamba2 mixer: n_heads={H} must divide expand * d_model={I} and be a "
                             f"multiple of n_groups={n_groups}")
        self.H, self.P, self.G, self.N, self.chunk_size = H, I // H, n_groups, d_state, chunk_size
        GN = n_groups * d_state
        for name, n in (("w_z", I), ("w_x", I), ("w_B", GN), ("w_C", GN), ("w_dt", H)):
            self.add_param(name, normal(rng, (n, d_model)))
        self.add_param("w_o", normal(rng, (d_model, I), out_std))
        self.add_param("A_log", np.log(rng.uniform(1, 16, H)))
        self.add_param("D", np.ones(H))
        self.add_param("dt_bias", dt_bias_init(rng, H))
        self.conv_x = self.add_module("conv_x", ShortConv(I, dtype=dtype, rng=rng, bias=True))
        self.conv_B = self.add_module("conv_B", ShortConv(GN, dtype=dtype, rng=rng, bias=True))
        self.conv_C = self.add_module("conv_C", ShortConv(GN, dtype=dtype, rng=rng, bias=True))
        self.norm = self.add_module("norm", RMSNorm(I, dtype=dtype, eps=norm_eps, gated=True,
                                                    norm_before_gate=False))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        xs, Bm, Cm = self.convs((self.conv_x, self.conv_B, self.conv_C),
                                (self.proj(x, "w_x"), self.proj(x, "w_B"), self.proj(x, "w_C")), cache)
        A = -np.exp(self.p["A_log"])
        y = self.run_op(mamba2, (xs.reshape(B, T, self.H, self.P), self.proj(x, "w_dt"), A,
                                 Bm.reshape(B, T, self.G, self.N), Cm.reshape(B, T, self.G, self.N)),
                        dict(D=self.p["D"], dt_bias=self.p["dt_bias"], chunk_size=self.chunk_size), cache)
        on = self.norm.forward(y.reshape(B, T, -1), self.proj(x, "w_z"))
        self.saved = (x, A, on)
        return linear(on, self.p["w_o"])

    def backward(self, dy):
        x, A, on = self.saved
        B, T, _ = x.shape
        don = self.proj_backward(dy, on, "w_o")
        dyn, dz = self.norm.backward(don)
        dx = self.proj_backward(dz, x, "w_z")
        gr = self.pullback(dyn.reshape(B, T, self.H, self.P))
        self.g["A_log"] += gr["A"] * A
        self.g["D"] += gr["D"]
        self.g["dt_bias"] += gr["dt_bias"]
        dx += self.proj_backward(gr["dt"], x, "w_dt")
        for conv, name, d in ((self.conv_x, "w_x", gr["x"]), (self.conv_B, "w_B", gr["B"]),
                              (self.conv_C, "w_C", gr["C"])):
            dx += self.proj_backward(conv.backward(d.reshape(B, T, -1)), x, name)
        return dx

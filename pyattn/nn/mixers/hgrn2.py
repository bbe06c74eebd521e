"""HGRN2 (Qin et al. 2024, arXiv 2404.07904), after fla's ``fla/layers/hgrn2.py``: gated
linear attention whose key is the forget gate's complement."""
from __future__ import annotations

from ...linear import gla
from ..layers import Mixer, RMSNorm, linear, logsigmoid, normal, sigmoid, silu, silu_backward


class HGRN2(Mixer):
    """``q = silu(x w_q^T)``, the forget gate ``g = logsigmoid(x w_f^T)`` ``[B, T, H, K]``, the
    key its complement ``k = 1 - exp(g)`` (the input gate tied to the forget gate), the value
    ``v = x w_i^T``; ``pyattn.gla(q, k, v, g)``; the output ``RMSNorm(o)`` over all heads
    together, then ``w_o``. fla's defaults with ``num_heads`` given (``expand_ratio`` = the
    head size d_model / n_heads; no short convolution).

    Options: ``norm_eps`` (1e-5), ``chunk_size`` (64). Differs from fla: no ``lower_bound``
    (fla's HGRN2 model passes one per layer; the layer alone takes none) and no short
    convolution.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, norm_eps=1e-5, chunk_size=64):
        super().__init__(dtype)
        H = n_heads
        self.H, self.K, self.chunk_size = H, d_model // H, chunk_size
        for name in ("w_q", "w_f", "w_i"):
            self.add_param(name, normal(rng, (H * self.K, d_model)))
        self.add_param("w_o", normal(rng, (d_model, H * self.K), out_std))
        self.o_norm = self.add_module("o_norm", RMSNorm(H * self.K, dtype=dtype, eps=norm_eps))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        shape = (B, T, self.H, self.K)
        q, sq = silu(self.proj(x, "w_q"))
        f = self.proj(x, "w_f")
        k = sigmoid(-f)  # 1 - exp(logsigmoid(f)), without the cancellation
        o = self.run_op(gla, (q.reshape(shape), k.reshape(shape), self.proj(x, "w_i").reshape(shape),
                              logsigmoid(f).reshape(shape)), dict(chunk_size=self.chunk_size), cache)
        on = self.o_norm.forward(o.reshape(B, T, -1))
        self.saved = (x, q, sq, k, on)
        return linear(on, self.p["w_o"])

    def backward(self, dy):
        x, q, sq, k, on = self.saved
        B, T, _ = x.shape
        do = self.o_norm.backward(self.proj_backward(dy, on, "w_o")).reshape(B, T, self.H, self.K)
        gr = self.pullback(do)
        # d logsigmoid(f)/df = sigmoid(-f) = k; d k/df = -k (1 - k)
        df = ((gr["g"] - gr["k"] * (1 - k.reshape(gr["k"].shape))) * k.reshape(gr["k"].shape)).reshape(B, T, -1)
        dx = self.proj_backward(df, x, "w_f")
        dx += self.proj_backward(silu_backward(gr["q"].reshape(B, T, -1), q, sq), x, "w_q")
        return dx + self.proj_backward(gr["v"].reshape(B, T, -1), x, "w_i")

"""Lightning attention as MiniMax-01's layer (arXiv 2501.08313; Hugging Face's
``MiniMaxText01LightningAttention``); fla has no layer for it."""
from __future__ import annotations

from ...linear import lightning_attention
from ..layers import Mixer, RMSNorm, linear, normal, sigmoid, silu, silu_backward


class LightningAttention(Mixer):
    """q, k, v projections, each through a SiLU; ``pyattn.lightning_attention`` with its
    default decays ``exp(-2**(-8 (h + 1) / H))``; an RMSNorm over all heads' outputs
    together, times ``sigmoid(x w_g^T)``; then ``w_o``.

    Options: ``head_dim`` (default d_model / n_heads), ``norm_eps`` (1e-5), ``chunk_size``
    (64). Differs from MiniMax-01: one decay set for every layer (MiniMax scales the slopes
    by the layer's depth), separate q, k, v projections instead of one fused qkv.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, head_dim=None, norm_eps=1e-5,
                 chunk_size=64):
        super().__init__(dtype)
        H = n_heads
        K = head_dim or d_model // H
        self.H, self.K, self.chunk_size = H, K, chunk_size
        for name in ("w_q", "w_k", "w_v", "w_g"):
            self.add_param(name, normal(rng, (H * K, d_model)))
        self.add_param("w_o", normal(rng, (d_model, H * K), out_std))
        self.o_norm = self.add_module("o_norm", RMSNorm(H * K, dtype=dtype, eps=norm_eps))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        act = [silu(self.proj(x, n)) for n in ("w_q", "w_k", "w_v")]
        q, k, v = (a[0].reshape(B, T, self.H, self.K) for a in act)
        o = self.run_op(lightning_attention, (q, k, v), dict(chunk_size=self.chunk_size), cache)
        normed = self.o_norm.forward(o.reshape(B, T, -1))
        gl = self.proj(x, "w_g")
        gate = sigmoid(gl)
        on = normed * gate
        self.saved = (x, act, normed, gate, on)
        return linear(on, self.p["w_o"])

    def backward(self, dy):
        x, act, normed, gate, on = self.saved
        B, T, _ = x.shape
        don = self.proj_backward(dy, on, "w_o")
        dx = self.proj_backward(don * normed * gate * (1 - gate), x, "w_g")
        gr = self.pullback(self.o_norm.backward(don * gate).reshape(B, T, self.H, self.K))
        for name, (y, s) in zip("qkv", act):
            dx += self.proj_backward(silu_backward(gr[name].reshape(B, T, -1), y, s), x, "w_" + name)
        return dx

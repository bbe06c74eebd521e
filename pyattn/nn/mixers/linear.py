"""Linear attention (Katharopoulos et al. 2020, arXiv 2006.16236), after fla's
``fla/layers/linear_attn.py``."""
from __future__ import annotations

from ...linear import linear_attention
from ..layers import Mixer, RMSNorm, linear, normal

# feature maps that need neither parameters nor positions (cosformer's restart in every call)
FEATURE_MAPS = ("elu1", "relu", "identity", "softmax", "focused", "taylor")


class LinearAttention(Mixer):
    """q, k, v projections; ``pyattn.linear_attention`` with the feature map phi applied to
    q and k (default ``"elu1"``, Katharopoulos'); a per-head RMSNorm of the output (fla's
    ``output_norm="rmsnorm"``), then ``w_o``.

    Options: ``feature_map`` (one of ``FEATURE_MAPS``), ``normalize`` (False, as fla's
    ``do_feature_map_norm``: divide by ``phi(q).sum phi(k)``), ``head_dim`` (default d_model
    / n_heads), ``norm_eps`` (1e-5), ``chunk_size`` (64). Differs from fla: its default
    feature map is a learned elementwise product (Hedgehog-style); here the maps are
    pyattn's fixed ones, and there are no KV-group or q/k sum-norm options.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, feature_map="elu1", normalize=False,
                 head_dim=None, norm_eps=1e-5, chunk_size=64):
        super().__init__(dtype)
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"linear mixer: feature_map must be one of {FEATURE_MAPS}, got {feature_map!r}")
        H = n_heads
        K = head_dim or d_model // H
        self.H, self.K = H, K
        self.op_kw = dict(feature_map=feature_map, normalize=normalize, chunk_size=chunk_size)
        for name in ("w_q", "w_k", "w_v"):
            self.add_param(name, normal(rng, (H * K, d_model)))
        self.add_param("w_o", normal(rng, (d_model, H * K), out_std))
        self.o_norm = self.add_module("o_norm", RMSNorm(K, dtype=dtype, eps=norm_eps))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        q, k, v = (self.proj(x, n).reshape(B, T, self.H, self.K) for n in ("w_q", "w_k", "w_v"))
        o = self.run_op(linear_attention, (q, k, v), dict(self.op_kw), cache)
        on = self.o_norm.forward(o).reshape(B, T, -1)
        self.saved = (x, on)
        return linear(on, self.p["w_o"])

    def backward(self, dy):
        x, on = self.saved
        B, T, _ = x.shape
        don = self.proj_backward(dy, on, "w_o")
        gr = self.pullback(self.o_norm.backward(don.reshape(B, T, self.H, self.K)))
        dx = self.proj_backward(gr["q"].reshape(B, T, -1), x, "w_q")
        dx += self.proj_backward(gr["k"].reshape(B, T, -1), x, "w_k")
        dx += self.proj_backward(gr["v"].reshape(B, T, -1), x, "w_v")
        return dx

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
    / n_heads), ``norm_eps`` (1e-5), ``chunk_size`` (64), ``short_conv`` (False; True puts
    a short causal convolution, kernel 4 with SiLU, after each of the q, k, v projections).
    Differs from fla: its default feature map is a learned elementwise product
    (Hedgehog-style); here the maps are pyattn's fixed ones, and there are no KV-group or
    q/k sum-norm options.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, feature_map="elu1", normalize=False,
                 head_dim=None, norm_eps=1e-5, chunk_size=64, short_conv=False):
        super().__init__(dtype)
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"linear mixer: feature_map must be one of {FEATURE_MAPS}, got {feature_map!r}")
        H = n_heads
        K = head_dim or d_model // H
        self.H, self.K = H, K
        self.op_kw = dict(feature_map=feature_map, normalize=normalize, chunk_size=chunk_size)
        self.add_qkv(rng, d_model, (H * K,) * 3, short_conv)
        self.add_param("w_o", normal(rng, (d_model, H * K), out_std))
        self.o_norm = self.add_module("o_norm", RMSNorm(K, dtype=dtype, eps=norm_eps))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        q, k, v = (a.reshape(B, T, self.H, self.K) for a in self.project_qkv(x, cache))
        o = self.run_op(linear_attention, (q, k, v), dict(self.op_kw), cache)
        on = self.o_norm.forward(o).reshape(B, T, -1)
        self.saved = (x, on)
        return linear(on, self.p["w_o"])

    def backward(self, dy):
        x, on = self.saved
        B, T, _ = x.shape
        don = self.proj_backward(dy, on, "w_o")
        gr = self.pullback(self.o_norm.backward(don.reshape(B, T, self.H, self.K)))
        return self.project_qkv_backward(x, gr["q"], gr["k"], gr["v"])

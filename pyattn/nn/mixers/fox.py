"""The Forgetting Transformer's attention (FoX; Lin et al. 2025, arXiv 2503.02130), after fla's
``fla/layers/forgetting_attn.py``."""
from __future__ import annotations

import numpy as np

from ...softmax import forgetting_attention
from ..layers import linear, logsigmoid, normal, sigmoid
from .softmax import SoftmaxAttention


class ForgettingAttention(SoftmaxAttention):
    """q, k, v projections (``n_kv_heads`` KV heads), a forget gate per query head
    ``f = logsigmoid(x w_f^T + b_f)``, ``pyattn.forgetting_attention`` (causal softmax
    attention with scores ``scale q_i.k_j + F_i - F_j``, F the running sum of f), output
    projection ``w_o``. No rotary embedding: the forget gate places the tokens, as in fla.

    Options: ``n_kv_heads`` (default n_heads), ``head_dim`` (default d_model / n_heads),
    ``window`` (fla's ``window_size``: each query sees itself and the ``window - 1`` keys
    before it). Decoding keeps the keys, values and running gate sums of the past tokens and
    attends a step's queries over them (NumPy over batch and heads). Differs from fla: no qkv
    bias, qk norm or output gate options.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, n_kv_heads=None, head_dim=None,
                 window=None):
        super().__init__(d_model, n_heads, dtype=dtype, rng=rng, out_std=out_std, n_kv_heads=n_kv_heads,
                         head_dim=head_dim, window=window)
        self.window = window
        self.add_param("w_f", normal(rng, (n_heads, d_model)))
        self.add_param("b_f", np.zeros(n_heads))

    def new_cache(self, batch, max_len):
        cache = super().new_cache(batch, max_len)
        cache["F"] = np.zeros((batch, max_len, self.H))  # running gate sums, float64: they grow
        return cache

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        q, k, v = self.head_qkv(x, cache)
        fpre = self.proj(x, "w_f") + self.p["b_f"]
        f = logsigmoid(fpre)
        if cache is None:
            o, self.pullback = self.op_vjp(forgetting_attention, q, k, v, f, window=self.window)
        else:
            o = self.attend_gated_cache(q, k, v, f, cache)
        self.x, self.fpre, self.on = x, fpre, o.reshape(B, T, -1)
        return linear(self.on, self.p["w_o"])

    def attend_gated_cache(self, q, k, v, f, cache):
        """Appends k, v and the running gate sums to the cache and attends q (the last T
        positions) over every filled row, causal and windowed as in training: a prompt into an
        empty cache through the flash kernel, later tokens (one per step) over the cache."""
        n, T = cache["len"], q.shape[1]
        start = cache["F"][:, n - 1] if n else np.zeros((f.shape[0], f.shape[2]))
        F = start[:, None] + np.cumsum(f, axis=1, dtype=np.float64)
        K, Vc, Fk = self.append_cache(cache, k=k, v=v, F=F)
        if n == 0:  # a prompt: the flash kernel, no T x T scores
            return self.op_call(forgetting_attention, q, k, v, f, window=self.window)
        groups = self.H // self.Hk
        Kh, Vh = np.repeat(K, groups, axis=2), np.repeat(Vc, groups, axis=2)
        s = (q.transpose(0, 2, 1, 3) @ Kh.transpose(0, 2, 3, 1)) * self.D ** -0.5  # [B, H, T, S]
        s = s + (F.transpose(0, 2, 1)[..., :, None] - Fk.transpose(0, 2, 1)[..., None, :])
        i, j = n + np.arange(T)[:, None], np.arange(n + T)[None]
        visible = (j <= i) & (True if self.window is None else i - j < self.window)
        s = np.where(visible, s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        return (p @ Vh.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3).astype(q.dtype)

    def backward(self, dy):
        B, T, _ = dy.shape
        don = self.proj_backward(dy, self.on, "w_o")
        gr = self.pullback(don.reshape(B, T, self.H, self.D))
        dfpre = gr["g"] * sigmoid(-self.fpre)  # d logsigmoid(a) / da = sigmoid(-a)
        self.g["b_f"] += dfpre.sum(axis=(0, 1))
        dx = self.proj_backward(dfpre, self.x, "w_f")
        return dx + self.project_qkv_backward(self.x, gr["q"], gr["k"], gr["v"])

"""DSA: the softmax layer with DeepSeek sparse attention and its lightning indexer
(DeepSeek-V3.2), the indexer trained by distillation."""
from __future__ import annotations

import numpy as np

from ...sparse import dsa_attention, dsa_index_loss
from ..layers import linear, linear_weight_grad, normal
from .softmax import SoftmaxAttention


class DeepSeekSparseAttention(SoftmaxAttention):
    """The softmax layer (q, k, v projections, GQA, rotary embedding, ``w_o``) with
    ``pyattn.dsa_attention``: every query attends to the ``top_k`` earlier keys its lightning
    indexer scores highest. The indexer: ``index_q = x w_iq^T [B, T, Hi, Di]``, ``index_k = x
    w_ik^T [B, T, Di]``, ``index_w = Hi^-1/2 x w_iw^T [B, T, Hi]`` (DeepSeek-V3.2's, without its
    partial RoPE and key norm).

    As in DeepSeek-V3.2 the indexer sees x detached and learns from a loss of its own: the KL
    divergence from the main attention's distribution over the selected keys
    (``pyattn.dsa_index_target``, summed over heads, normalised) to the softmax of its scores
    there, averaged over the queries and weighted by ``index_loss_weight``
    (``pyattn.dsa_index_loss``, over the chosen keys only). ``backward`` adds
    that loss's gradient to the indexer's parameters (the model's loss does not reach them:
    the choice of keys is not differentiable) and leaves dx as the model's loss gives it; the
    last value is ``index_loss``.

    Options: ``top_k`` (64), ``index_heads`` (4), ``index_dim`` (head_dim),
    ``index_loss_weight`` (1.0), ``n_kv_heads``, ``head_dim``, ``rope_theta``. Decoding keeps
    the KV cache and a cache of index keys and runs ``dsa_attention`` for the new queries over
    them, so it chooses the keys training chooses.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, top_k=64, index_heads=4,
                 index_dim=None, index_loss_weight=1.0, n_kv_heads=None, head_dim=None,
                 rope_theta=10000.0):
        super().__init__(d_model, n_heads, dtype=dtype, rng=rng, out_std=out_std,
                         n_kv_heads=n_kv_heads, head_dim=head_dim, rope_theta=rope_theta)
        self.Hi, self.Di = index_heads, index_dim or self.D
        self.add_param("w_iq", normal(rng, (self.Hi * self.Di, d_model)))
        self.add_param("w_ik", normal(rng, (self.Di, d_model)))
        self.add_param("w_iw", normal(rng, (self.Hi, d_model)))
        self.top_k, self.index_loss_weight, self.index_loss = top_k, index_loss_weight, None

    def new_cache(self, batch, max_len):
        cache = super().new_cache(batch, max_len)
        cache["ik"] = np.zeros((batch, max_len, self.Di), self.dtype)
        return cache

    def indexer(self, x):
        """(index_q, index_k, index_w) of x [B, T, d]."""
        B, T, _ = x.shape
        return (linear(x, self.p["w_iq"]).reshape(B, T, self.Hi, self.Di), linear(x, self.p["w_ik"]),
                linear(x, self.p["w_iw"]) * self.Hi ** -0.5)

    def _mix(self, x, cache, pos):
        self.index = self.indexer(x)
        return super()._mix(x, cache, pos)

    def attention_vjp(self, q, k, v):
        self.qk = q, k
        return self.op_vjp(dsa_attention, q, k, v, *self.index, top_k=self.top_k)

    def attend_cache(self, q, k, v, cache):
        iq, ik, iw = self.index
        kc, vc, ikc = self.append_cache(cache, k=k, v=v, ik=ik)
        return self.op_call(dsa_attention, q, kc, vc, iq, ikc, iw, top_k=self.top_k)

    def index_distillation(self, index, q, k):
        """(the indexer's loss, its gradients by name: index_q, index_k, index_w) for the
        indexer's arrays (``indexer(x)``) and the main attention's rotated q, k."""
        loss, grads = dsa_index_loss(q, k, *index, top_k=self.top_k)
        w = self.index_loss_weight
        return w * loss, {name: g * np.asarray(w, g.dtype) for name, g in grads.items()}

    def backward(self, dy):
        dx = super().backward(dy)
        self.index_loss, grads = self.index_distillation(self.index, *self.qk)
        # the indexer's input is detached: its weights' gradients only, no dx
        for name, g in (("w_iq", grads["index_q"]), ("w_ik", grads["index_k"]),
                        ("w_iw", grads["index_w"] * self.Hi ** -0.5)):
            linear_weight_grad(g, self.x, self.g[name])
        return dx

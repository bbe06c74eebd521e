"""NSA: the softmax layer with native sparse attention (Yuan et al., 2025), after fla-org's
native-sparse-attention layer."""
from __future__ import annotations

import numpy as np

from ...sparse import nsa_attention
from ..layers import linear, normal, sigmoid
from .softmax import SoftmaxAttention

_GATES = ("g_cmp", "g_slc", "g_swa")


class NativeSparseAttention(SoftmaxAttention):
    """The softmax layer (q, k, v projections, GQA, rotary embedding, ``w_o``) with
    ``pyattn.nsa_attention`` in place of full attention, and NSA's branch gates: ``w_g [3 H,
    d_model]``, ``sigmoid(x w_g^T)`` split into the compressed, selected and sliding-window
    gates of every head, as the reference layer's ``g_proj``. The compressed keys are the
    block means (no learned compression MLP, as fla's layer).

    Options: ``block_size`` (64), ``block_count`` (16), ``window`` (512), ``n_kv_heads``
    (NSA shares one block choice per KV head), ``head_dim``, ``rope_theta``. Decoding keeps
    the softmax layer's KV cache and runs ``nsa_attention`` for the new queries over the
    cached keys, so it chooses the blocks training chooses.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, block_size=64, block_count=16,
                 window=512, n_kv_heads=None, head_dim=None, rope_theta=10000.0):
        super().__init__(d_model, n_heads, dtype=dtype, rng=rng, out_std=out_std,
                         n_kv_heads=n_kv_heads, head_dim=head_dim, rope_theta=rope_theta)
        self.add_param("w_g", normal(rng, (3 * self.H, d_model)))
        self.nsa = dict(block_size=block_size, block_count=block_count, window=window)

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        self.gate = sigmoid(linear(x, self.p["w_g"]))
        self.gates = list(np.moveaxis(self.gate.reshape(B, T, self.H, 3), -1, 0))
        return super()._mix(x, cache, pos)

    def attention_vjp(self, q, k, v):
        o, pullback = self.op_vjp(nsa_attention, q, k, v, *self.gates, **self.nsa)

        def gates_too(do):
            grads = pullback(do)
            self.dgates = np.stack([grads[name] for name in _GATES], axis=-1)
            return grads

        return o, gates_too

    def attend_cache(self, q, k, v, cache):
        return self.op_call(nsa_attention, q, *self.append_cache(cache, k=k, v=v), *self.gates, **self.nsa)

    def backward(self, dy):
        dx = super().backward(dy)
        B, T, _ = dy.shape
        dpre = (self.dgates.reshape(B, T, -1) * self.gate * (1 - self.gate))
        return dx + self.proj_backward(dpre, self.x, "w_g")

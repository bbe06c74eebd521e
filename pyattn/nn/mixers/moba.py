"""MoBA: the softmax layer with mixture-of-block attention (Lu et al., 2025)."""
from __future__ import annotations

from ...sparse import moba_attention
from .softmax import SoftmaxAttention


class MoBAAttention(SoftmaxAttention):
    """The softmax layer (q, k, v projections, GQA, rotary embedding, ``w_o``) with
    ``pyattn.moba_attention`` in place of full attention: each query attends causally within
    its own block of ``block_size`` keys and to the ``top_k - 1`` past blocks whose mean key
    it matches best. MoBA swaps the attention of a standard transformer layer and adds no
    parameters; so does this mixer.

    Options: ``block_size`` (64), ``top_k`` (3), ``n_kv_heads``, ``head_dim``,
    ``rope_theta``. Decoding keeps the softmax layer's preallocated KV cache and runs
    ``moba_attention`` for the new queries over the cached keys (the last positions of the
    sequence), so the blocks chosen are those training chooses.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, block_size=64, top_k=3,
                 n_kv_heads=None, head_dim=None, rope_theta=10000.0):
        super().__init__(d_model, n_heads, dtype=dtype, rng=rng, out_std=out_std,
                         n_kv_heads=n_kv_heads, head_dim=head_dim, rope_theta=rope_theta)
        self.moba = dict(block_size=block_size, top_k=top_k)

    def attention_vjp(self, q, k, v):
        return self.op_vjp(moba_attention, q, k, v, **self.moba)

    def attend_cache(self, q, k, v, cache):
        return self.op_call(moba_attention, q, *self.append_cache(cache, k=k, v=v), **self.moba)

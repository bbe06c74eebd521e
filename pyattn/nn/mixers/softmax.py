"""Softmax attention with RoPE, after fla's ``fla/layers/attn.py``."""
from __future__ import annotations

import numpy as np

from ...softmax import attention_with_kvcache, softmax_attention
from ..layers import Mixer, Rotary, grow_cache, linear, normal


class SoftmaxAttention(Mixer):
    """q, k, v projections (``n_kv_heads`` KV heads: GQA/MQA), rotary embedding of q and k
    (``pyattn.rope``'s half-split pairs, as fla's RotaryEmbedding), causal
    ``pyattn.softmax_attention`` (flash form), output projection ``w_o``.

    Options: ``n_kv_heads`` (default n_heads), ``head_dim`` (default d_model / n_heads),
    ``window`` (each query sees itself and the ``window - 1`` keys before it, fla's
    ``window_size``; default unbounded), ``sinks`` (the first ``sinks`` keys stay visible
    to every query, StreamingLLM's attention sinks), ``rope_theta`` (10000), ``short_conv``
    (False, as fla's attention layer; True puts a short causal convolution, kernel 4 with
    SiLU, after each of the q, k, v projections, as the convolution that Zoology's MQAR
    models put before every mixer; decoding then carries its state).

    Decoding keeps a preallocated KV cache per layer (``[B, max_len, Hk, D]``, doubled when a
    step would overflow it): ``pyattn.attention_with_kvcache`` writes each step's keys into it
    in place and attends over its filled part. Differs from fla: no qkv
    bias or qk norm options.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, n_kv_heads=None, head_dim=None,
                 window=None, sinks=0, rope_theta=10000.0, short_conv=False):
        super().__init__(dtype)
        H = n_heads
        Hk = n_kv_heads or H
        if H % Hk:
            raise ValueError(f"softmax mixer: n_kv_heads={Hk} must divide n_heads={H}")
        D = head_dim or d_model // H
        self.H, self.Hk, self.D = H, Hk, D
        self.add_qkv(rng, d_model, (H * D, Hk * D, Hk * D), short_conv)
        self.add_param("w_o", normal(rng, (d_model, H * D), out_std))
        self.rotary = Rotary(D, rope_theta, dtype=dtype)
        self.mask = dict(causal=True, window=None if window is None else (window - 1, 0), sinks=sinks)

    def new_cache(self, batch, max_len):
        shape = (batch, max_len, self.Hk, self.D)
        return {"k": np.zeros(shape, self.dtype), "v": np.zeros(shape, self.dtype), "len": 0,
                "conv": None}

    def head_qkv(self, x, cache):
        """q ``[B, T, H, D]``, k and v ``[B, T, Hk, D]`` of x (before any rotation)."""
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x, cache)
        return (q.reshape(B, T, self.H, self.D), k.reshape(B, T, self.Hk, self.D),
                v.reshape(B, T, self.Hk, self.D))

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        q, k, v = self.head_qkv(x, cache)
        q, k = self.rotary.forward(np.arange(pos, pos + T), q, k)
        if cache is None:
            o, self.pullback = self.attention_vjp(q, k, v)
        else:
            o = self.attend_cache(q, k, v, cache)
        self.x, self.on = x, o.reshape(B, T, -1)
        return linear(self.on, self.p["w_o"])

    def attention_vjp(self, q, k, v):
        """The training path's attention and its pullback."""
        return self.op_vjp(softmax_attention, q, k, v, **self.mask)

    def attend_cache(self, q, k, v, cache):
        """Writes k, v into the cache rows after its filled part and attends q over all
        filled rows (bottom-right causal: the new queries are the last rows). The one place
        that decoding touches the cache."""
        n, T = cache["len"], k.shape[1]
        grow_cache(cache, ("k", "v"), n + T)
        o = self.op_call(attention_with_kvcache, q, cache["k"], cache["v"], np.full(q.shape[0], n), k=k,
                         v=v, **self.mask)
        cache["len"] = n + T
        return o

    @staticmethod
    def append_cache(cache, **rows):
        """Writes each of rows (name -> [B, T, ...]) into the cache rows after its filled part
        and returns them as they are now filled, in the order given: the cached keys that a
        sparse layer's op reads whole (its new queries the last positions)."""
        n, T = cache["len"], next(iter(rows.values())).shape[1]
        grow_cache(cache, tuple(rows), n + T)
        for name, x in rows.items():
            cache[name][:, n:n + T] = x
        cache["len"] = n + T
        return [cache[name][:, :n + T] for name in rows]

    def backward(self, dy):
        B, T, _ = dy.shape
        don = self.proj_backward(dy, self.on, "w_o")
        gr = self.pullback(don.reshape(B, T, self.H, self.D))
        dq, dk = self.rotary.backward(gr["q"], gr["k"])
        return self.project_qkv_backward(self.x, dq, dk, gr["v"])

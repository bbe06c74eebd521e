"""Multi-head latent attention (DeepSeek-V2's MLA) over ``pyattn.mla_attention``."""
from __future__ import annotations

import numpy as np

from ...autodiff import vjp
from ...mla import _absorbed, _by_head_t, mla_attention
from ...softmax import attention_with_kvcache
from ..layers import Mixer, RMSNorm, Rotary, grow_cache, linear, normal


class MultiHeadLatentAttention(Mixer):
    """DeepSeek-V2's attention layer without the query compression: ``q = x w_q^T`` split per
    head into ``q_nope [Dn]`` and ``q_rope [Dr]`` (rotated), the latent row
    ``c_kv = RMSNorm(x w_dkv^T) [Dc]`` and one rotated key ``k_rope = x w_kr^T [Dr]`` shared
    by the heads; head h attends with keys ``[c_kv w_uk_h ; k_rope]`` and values
    ``c_kv w_uv_h`` (``pyattn.mla_attention``), then ``w_o``.

    Options: ``head_dim`` (Dn = Dv, default d_model / n_heads), ``rope_dim`` (Dr, default
    head_dim / 2, even), ``latent_dim`` (Dc, default 4 head_dim, DeepSeek-V2's ratio),
    ``form`` of training ("naive", default, or "absorbed"), ``rope_theta``.

    Decoding caches only latent rows, whatever the head count: one KV head of keys
    ``[c_kv ; k_rope]`` and values ``c_kv`` (``2 Dc + Dr`` numbers a position: the kernel
    reads keys and values from separate arrays), and attends in the absorbed form through
    ``pyattn.attention_with_kvcache``, ``w_uk`` folded into the query and ``w_uv`` into the
    output. Differs from DeepSeek-V2: no low-rank query
    projection (``q_lora_rank``) and no YaRN scaling of the rotary part.
    """

    def __init__(self, d_model, n_heads, *, dtype, rng, out_std, head_dim=None, rope_dim=None,
                 latent_dim=None, form="naive", rope_theta=10000.0):
        super().__init__(dtype)
        H = n_heads
        Dn = head_dim or d_model // H
        Dr = rope_dim or max(2, Dn // 2 // 2 * 2)
        Dc = latent_dim or 4 * Dn
        if Dr % 2:
            raise ValueError(f"mla mixer: rope_dim={Dr} must be even")
        self.H, self.Dn, self.Dr, self.Dc, self.form = H, Dn, Dr, Dc, form
        self.add_param("w_q", normal(rng, (H * (Dn + Dr), d_model)))
        self.add_param("w_dkv", normal(rng, (Dc, d_model)))
        self.add_param("w_kr", normal(rng, (Dr, d_model)))
        self.add_param("w_uk", normal(rng, (Dc, H, Dn)))
        self.add_param("w_uv", normal(rng, (Dc, H, Dn)))
        self.add_param("w_o", normal(rng, (d_model, H * Dn), out_std))
        self.kv_norm = self.add_module("kv_norm", RMSNorm(Dc, dtype=dtype))
        self.rotary = Rotary(Dr, rope_theta, dtype=dtype)

    def new_cache(self, batch, max_len):
        return {"k": np.zeros((batch, max_len, 1, self.Dc + self.Dr), self.dtype),
                "v": np.zeros((batch, max_len, 1, self.Dc), self.dtype), "len": 0}

    def _mix(self, x, cache, pos):
        B, T, _ = x.shape
        H, Dn, Dr = self.H, self.Dn, self.Dr
        q = self.proj(x, "w_q").reshape(B, T, H, Dn + Dr)
        q_nope = np.ascontiguousarray(q[..., :Dn])
        c_kv = self.kv_norm.forward(self.proj(x, "w_dkv"))
        kr = self.proj(x, "w_kr").reshape(B, T, 1, Dr)
        q_rope, k_rope = self.rotary.forward(np.arange(pos, pos + T), np.ascontiguousarray(q[..., Dn:]), kr)
        k_rope = k_rope.reshape(B, T, Dr)
        args = (q_nope, q_rope, c_kv, k_rope, self.p["w_uk"], self.p["w_uv"])
        if cache is None:
            o, self.pullback = vjp(mla_attention, *args, causal=True, form=self.form)
        else:
            o = self.attend_cache(args, cache)
        self.x, self.on = x, o.reshape(B, T, -1)
        return linear(self.on, self.p["w_o"])

    def attend_cache(self, args, cache):
        """Writes the new latent rows after the cache's filled part (doubling it when full)
        and attends the new queries over every filled row in the absorbed form."""
        q_nope, q_rope, c_kv, k_rope, w_uk, w_uv = args
        n, T = cache["len"], c_kv.shape[1]
        grow_cache(cache, ("k", "v"), n + T)
        q, k, v = _absorbed(dict(q_nope=q_nope, q_rope=q_rope, c_kv=c_kv, k_rope=k_rope, w_uk=w_uk))
        o = attention_with_kvcache(q, cache["k"], cache["v"], np.full(q.shape[0], n), k=k, v=v,
                                   scale=(self.Dn + self.Dr) ** -0.5)
        cache["len"] = n + T
        return _by_head_t(o, w_uv)

    def backward(self, dy):
        B, T, _ = dy.shape
        H, Dn, Dr = self.H, self.Dn, self.Dr
        don = self.proj_backward(dy, self.on, "w_o")
        gr = self.pullback(don.reshape(B, T, H, Dn))
        self.g["w_uk"] += gr["w_uk"]
        self.g["w_uv"] += gr["w_uv"]
        dq_rope, dkr = self.rotary.backward(gr["q_rope"], gr["k_rope"].reshape(B, T, 1, Dr))
        dq = np.concatenate([gr["q_nope"], dq_rope], axis=-1).reshape(B, T, -1)
        dx = self.proj_backward(dq, self.x, "w_q")
        dx += self.proj_backward(self.kv_norm.backward(gr["c_kv"]), self.x, "w_dkv")
        dx += self.proj_backward(dkr.reshape(B, T, Dr), self.x, "w_kr")
        return dx

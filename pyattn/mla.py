"""Multi-head latent attention (DeepSeek-V2's MLA) over softmax_attention (semantics:
docs/ops.md).

Keys and values are stored compressed: one latent row ``c_kv`` per position, shared by every
head, plus a shared rotary part ``k_rope``. Head h decompresses them with ``w_uk[:, h]`` and
``w_uv[:, h]``. Both forms run the attention itself through ``softmax_attention``'s flash
kernel; the einsums around it (and their gradients) are NumPy matrix products.
"""
from __future__ import annotations

import numpy as np

from . import _bf16, _validate as V
from .autodiff import register_vjp, split_cotangent, vjp
from .softmax import softmax_attention

FORMS = ("naive", "absorbed")
_FN = "mla_attention"


def _prepare(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, causal, scale, form):
    arrs, dtype = V.float_arrays(_FN, q_nope=q_nope, q_rope=q_rope, c_kv=c_kv, k_rope=k_rope,
                                 w_uk=w_uk, w_uv=w_uv)
    V.ndim(_FN, "q_nope", arrs["q_nope"], 4, "[B, T, H, Dn]")
    V.ndim(_FN, "q_rope", arrs["q_rope"], 4, "[B, T, H, Dr]")
    V.ndim(_FN, "c_kv", arrs["c_kv"], 3, "[B, Tk, Dc]")
    V.ndim(_FN, "k_rope", arrs["k_rope"], 3, "[B, Tk, Dr]")
    V.ndim(_FN, "w_uk", arrs["w_uk"], 3, "[Dc, H, Dn]")
    V.ndim(_FN, "w_uv", arrs["w_uv"], 3, "[Dc, H, Dv]")
    B, T, H, Dn = arrs["q_nope"].shape
    Dr = arrs["q_rope"].shape[3]
    Tk, Dc = arrs["c_kv"].shape[1:]
    Dv = arrs["w_uv"].shape[2]
    for name, size in (("q_nope's H", H), ("q_nope's Dn", Dn), ("c_kv's Dc", Dc), ("w_uv's Dv", Dv)):
        if size < 1:
            raise ValueError(f"{_FN}(): {name} must be >= 1, got {size}")
    V.shape(_FN, "q_rope", arrs["q_rope"], (B, T, H, Dr), "[B, T, H, Dr] (B, T, H of q_nope)")
    V.same(_FN, "batch sizes", {"q_nope": B, "c_kv": arrs["c_kv"].shape[0]})
    V.shape(_FN, "k_rope", arrs["k_rope"], (B, Tk, Dr), "[B, Tk, Dr] (B, Tk of c_kv, Dr of q_rope)")
    V.shape(_FN, "w_uk", arrs["w_uk"], (Dc, H, Dn), "[Dc, H, Dn] (Dc of c_kv, H and Dn of q_nope)")
    V.shape(_FN, "w_uv", arrs["w_uv"], (Dc, H, Dv), "[Dc, H, Dv] (Dc of c_kv, H of q_nope)")
    causal = V.boolean(_FN, "causal", causal)
    scale = V.scale(_FN, scale, (Dn + Dr) ** -0.5, dtype)
    form = V.form(_FN, form, FORMS)
    return arrs, dict(causal=causal, scale=scale), form


def _latent_to_heads(c_kv, w):
    """``c_kv [B, Tk, Dc]`` times ``w [Dc, H, D]`` for every head: ``[B, Tk, H, D]``."""
    B, Tk, Dc = c_kv.shape
    _, H, D = w.shape
    return (c_kv.reshape(B * Tk, Dc) @ w.reshape(Dc, H * D)).reshape(B, Tk, H, D)


def _heads_to_latent(x, w):
    """The transpose of _latent_to_heads: ``x [B, Tk, H, D]`` against ``w [Dc, H, D]``, summed
    over heads: ``[B, Tk, Dc]``."""
    B, Tk, H, D = x.shape
    Dc = w.shape[0]
    return (x.reshape(B * Tk, H * D) @ w.reshape(Dc, H * D).T).reshape(B, Tk, Dc)


def _weight_grad(c_kv, dx):
    """The gradient of ``w [Dc, H, D]`` in ``_latent_to_heads(c_kv, w)`` given ``dx [B, Tk, H, D]``."""
    B, Tk, H, D = dx.shape
    Dc = c_kv.shape[2]
    return (c_kv.reshape(B * Tk, Dc).T @ dx.reshape(B * Tk, H * D)).reshape(Dc, H, D)


def _by_head(x, w):
    """``x [B, T, H, D]`` times ``w[:, h, :]^T`` for each head h, ``w [Dc, H, D]``:
    ``[B, T, H, Dc]``. Folds w_uk into the query, and takes an output's cotangent back
    through w_uv."""
    return np.einsum("bthd,chd->bthc", x, w, optimize=True)


def _by_head_t(y, w):
    """``y [B, T, H, Dc]`` times ``w[:, h, :]`` for each head h: ``[B, T, H, D]``, the
    transpose of _by_head. Unfolds a latent output through w_uv."""
    return np.einsum("bthc,chd->bthd", y, w, optimize=True)


def _by_head_grad(y, x):
    """The gradient of ``w [Dc, H, D]`` in ``_by_head_t(y, w)`` given the cotangent x
    (equally, in ``_by_head(x, w)`` given the cotangent y)."""
    return np.einsum("bthc,bthd->chd", y, x, optimize=True)


def _naive(a):
    """softmax_attention's (q, k, v) with K and V decompressed per head."""
    B, Tk, Dr = a["k_rope"].shape
    H = a["q_nope"].shape[2]
    q = np.concatenate([a["q_nope"], a["q_rope"]], axis=3)
    k = np.concatenate([_latent_to_heads(a["c_kv"], a["w_uk"]),
                        np.broadcast_to(a["k_rope"][:, :, None, :], (B, Tk, H, Dr))], axis=3)
    return q, k, _latent_to_heads(a["c_kv"], a["w_uv"])


def _absorbed(a):
    """softmax_attention's (q, k, v) over the latent cache: w_uk folded into the query, one
    KV head holding ``[c_kv ; k_rope]`` as keys and ``c_kv`` as values."""
    q = np.concatenate([_by_head(a["q_nope"], a["w_uk"]), a["q_rope"]], axis=3)
    k = np.concatenate([a["c_kv"], a["k_rope"]], axis=2)[:, :, None, :]
    return q, k, a["c_kv"][:, :, None, :]


@_bf16.calls
def mla_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, causal=True, scale=None,
                  form="naive"):
    """Multi-head latent attention: softmax attention with per-head keys
    ``k_h = [c_kv w_uk_h ; k_rope]`` and values ``v_h = c_kv w_uv_h`` decompressed from a
    latent cache.

    q_nope ``[B, T, H, Dn]``, q_rope ``[B, T, H, Dr]`` (already rotated), c_kv ``[B, Tk, Dc]``
    and k_rope ``[B, Tk, Dr]`` (shared by every head), w_uk ``[Dc, H, Dn]``, w_uv
    ``[Dc, H, Dv]``; float32 or float64, one dtype. Query i of head h scores key j by
    ``s = scale (q_nope_ih . (c_kv_j w_uk_h) + q_rope_ih . k_rope_j)``, scale defaulting to
    ``(Dn + Dr) ** -0.5``, and returns ``o_ih = sum_j softmax_j(s) (c_kv_j w_uv_h)``,
    ``o [B, T, H, Dv]``. ``causal`` masks bottom-right as softmax_attention does
    (``i' = i + Tk - T``: a decode query sees the whole cache); a row with no visible key
    gives 0.

    Forms (they agree to rounding, forward and backward):
    ``"naive"`` decompresses K ``[B, Tk, H, Dn + Dr]`` and V ``[B, Tk, H, Dv]`` and runs
    softmax_attention over them (training, prefill). ``"absorbed"`` folds w_uk into the
    query (``q_lat_h = q_nope_h w_uk_h^T``, ``[B, T, H, Dc]``) and w_uv into the output, and
    runs softmax_attention as MQA over the latent cache itself: one KV head, keys
    ``[c_kv ; k_rope]`` (Dk = Dc + Dr), values c_kv (Dv = Dc). It reads only the latent
    cache: the decode form. Gradients (``pyattn.vjp``): all six arrays.
    """
    arrs, opts, form = _prepare(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, causal, scale, form)
    if form == "naive":
        return softmax_attention(*_naive(arrs), **opts)
    return _by_head_t(softmax_attention(*_absorbed(arrs), **opts), arrs["w_uv"])


def _naive_grads(a, g):
    """The six gradients from softmax_attention's (dq, dk, dv) of the naive form."""
    Dn = a["q_nope"].shape[3]
    dk_nope = g["k"][..., :Dn]
    return {"q_nope": g["q"][..., :Dn], "q_rope": g["q"][..., Dn:],
            "c_kv": _heads_to_latent(dk_nope, a["w_uk"]) + _heads_to_latent(g["v"], a["w_uv"]),
            "k_rope": g["k"][..., Dn:].sum(axis=2),
            "w_uk": _weight_grad(a["c_kv"], dk_nope), "w_uv": _weight_grad(a["c_kv"], g["v"])}


def _absorbed_grads(a, g):
    """The gradients of q_nope, q_rope, c_kv, k_rope and w_uk from softmax_attention's
    (dq, dk, dv) of the absorbed form (w_uv's comes from the output's unfolding)."""
    Dc = a["c_kv"].shape[2]
    dq_lat = g["q"][..., :Dc]
    return {"q_nope": _by_head_t(dq_lat, a["w_uk"]), "q_rope": g["q"][..., Dc:],
            "c_kv": g["k"][:, :, 0, :Dc] + g["v"][:, :, 0], "k_rope": g["k"][:, :, 0, Dc:],
            "w_uk": _by_head_grad(dq_lat, a["q_nope"])}


@register_vjp(mla_attention)
def _mla_attention_vjp(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, causal=True, scale=None,
                       form="naive"):
    a, opts, form = _prepare(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, causal, scale, form)
    if form == "naive":
        o, pull_attn = vjp(softmax_attention, *_naive(a), **opts)
    else:
        o_lat, pull_attn = vjp(softmax_attention, *_absorbed(a), **opts)
        o = _by_head_t(o_lat, a["w_uv"])

    def pullback(cot):
        (do,) = split_cotangent(_FN, cot, 1)
        arrs, _ = V.float_arrays(f"{_FN} pullback", ("do",), q_nope=a["q_nope"], do=do)
        do = np.zeros_like(o) if arrs["do"] is None else arrs["do"]
        V.shape(f"{_FN} pullback", "do", do, o.shape, "[B, T, H, Dv]")
        if form == "naive":
            grads = _naive_grads(a, pull_attn(do))
        else:
            grads = _absorbed_grads(a, pull_attn(_by_head(do, a["w_uv"])))
            grads["w_uv"] = _by_head_grad(o_lat, do)
        return {name: np.ascontiguousarray(g) for name, g in grads.items()}

    return o, pullback

"""Softmax attention: parallel, flash and recurrent forms (semantics: docs/ops.md)."""
from __future__ import annotations

import numpy as np

from . import _core
from . import _validate as V
from .autodiff import register_vjp, split_cotangent

FORMS = ("parallel", "flash", "recurrent")
_FORM_CODE = {"parallel": _core.FORM_PARALLEL, "flash": _core.FORM_FLASH, "recurrent": _core.FORM_RECURRENT}


def _prepare(q, k, v, causal, scale, window, sinks, alibi_slopes, softcap, cu_seqlens,
             cu_seqlens_q, cu_seqlens_k, form):
    fn = "softmax_attention"
    arrs, dtype = V.float_arrays(fn, ("alibi_slopes",), q=q, k=k, v=v, alibi_slopes=alibi_slopes)
    q, k, v, alibi = arrs["q"], arrs["k"], arrs["v"], arrs["alibi_slopes"]
    V.ndim(fn, "q", q, 4, "[B, Tq, H, Dk]")
    V.ndim(fn, "k", k, 4, "[B, Tk, Hk, Dk]")
    V.ndim(fn, "v", v, 4, "[B, Tk, Hk, Dv]")
    B, Tq, H, Dk = q.shape
    V.same(fn, "batch sizes", {"q": B, "k": k.shape[0], "v": v.shape[0]})
    V.same(fn, "key lengths", {"k": k.shape[1], "v": v.shape[1]})
    V.same(fn, "KV head counts", {"k": k.shape[2], "v": v.shape[2]})
    V.same(fn, "key head dims", {"q": Dk, "k": k.shape[3]})
    Tk, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    V.divides(fn, "k", Hk, "heads", "q", H)
    if Dk < 1 or Dv < 1:
        raise ValueError(f"{fn}(): head dims must be >= 1, got Dk={Dk}, Dv={Dv}")
    alibi = V.per_head(fn, "alibi_slopes", alibi, H)
    if alibi is not None and not np.all(np.isfinite(alibi)):
        # a NaN slope would make every score of its head NaN: a silent dead head, or NaN rows
        raise ValueError(f"{fn}(): 'alibi_slopes' must be finite, got {alibi}")
    V.form(fn, form, FORMS)
    if window is None:
        left, right = -1, -1
    else:
        left, right = V.int_pair(fn, "window", window, -1, "(left, right) or None")
    sinks = V.integer(fn, "sinks", sinks, 0)
    # beyond any sequence length a bound is no bound; keep it within int64 for the kernel
    left, right, sinks = (min(x, 2 ** 62) for x in (left, right, sinks))
    softcap = V.real(fn, "softcap", softcap, 0.0, dtype)
    scale = V.scale(fn, scale, Dk ** -0.5, dtype)
    if cu_seqlens is not None:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError(f"{fn}(): give either 'cu_seqlens' or 'cu_seqlens_q'/'cu_seqlens_k', not both")
        if Tq != Tk:
            raise ValueError(f"{fn}(): 'cu_seqlens' needs Tq == Tk, got Tq={Tq}, Tk={Tk}; use cu_seqlens_q/cu_seqlens_k")
        cu_q = cu_k = V.cu_seqlens(fn, "cu_seqlens", cu_seqlens, Tq, B)
    elif (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError(f"{fn}(): 'cu_seqlens_q' and 'cu_seqlens_k' must be given together")
    elif cu_seqlens_q is None:
        cu_q, cu_k = V.batch_offsets(B, Tq), V.batch_offsets(B, Tk)
    else:
        cu_q = V.cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, Tq, B)
        cu_k = V.cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, Tk, B)
        if len(cu_q) != len(cu_k):
            raise ValueError(f"{fn}(): cu_seqlens_q and cu_seqlens_k must have the same length, got {len(cu_q)} and {len(cu_k)}")
    opts = (cu_q, cu_k, _FORM_CODE[form], V.boolean(fn, "causal", causal), left, right, sinks, alibi,
            softcap, scale)
    return q, k, v, opts


def _forward(q, k, v, opts):
    B, Tq, H, _ = q.shape
    o = np.empty((B, Tq, H, v.shape[3]), dtype=q.dtype)
    lse = np.empty((B, Tq, H), dtype=q.dtype)
    _core.softmax_forward(q, k, v, o, lse, *opts)
    return o, lse


def softmax_attention(q, k, v, *, causal=False, scale=None, window=None, sinks=0,
                      alibi_slopes=None, softcap=0.0, cu_seqlens=None, cu_seqlens_q=None,
                      cu_seqlens_k=None, form="flash", return_lse=False):
    """Softmax attention ``o_i = sum_j softmax_j(s_ij) v_j`` over the keys visible to query i.

    q ``[B, Tq, H, Dk]``, k ``[B, Tk, Hk, Dk]``, v ``[B, Tk, Hk, Dv]`` with ``H % Hk == 0``
    (GQA/MQA: query head h reads KV head ``h // (H // Hk)``); float32 or float64, one dtype.
    ``s_ij = scale q_i.k_j`` (scale defaults to ``Dk ** -0.5``), then ``softcap * tanh(s /
    softcap)`` when ``softcap > 0``, then ``- alibi_slopes[h] * |i' - j|``.
    With ``i' = i + Tk - Tq`` (bottom-right alignment, as flash-attn), key j is visible iff
    ``(not causal or j <= i')`` and (``i' - left <= j <= i' + right`` for ``window=(left,
    right)``, -1 unbounded, or ``j < sinks``). A query with no visible key gets ``o = 0`` and
    ``lse = -inf``. NaN and inf propagate as in the float64 formula: a NaN or +inf score, or
    visible scores that are all -inf, make the query's row of ``o`` and its ``lse`` NaN; a
    non-finite value in a row of q, k or v (or of the cotangents) reaches only the outputs
    and gradients that depend on it, never a query that cannot see that key.
    ``cu_seqlens`` (B must be 1) packs sequences of equal query and key lengths;
    ``cu_seqlens_q``/``cu_seqlens_k`` (flash-attn's names) pack them separately.
    Forms: ``"flash"`` (tiled online softmax, never Tq x Tk memory), ``"parallel"``
    (materialised scores), ``"recurrent"`` (keys streamed one by one, the decode form).
    Returns ``o [B, Tq, H, Dv]``, or ``(o, lse)`` with ``return_lse=True``, ``lse [B, Tq, H]``
    the natural-log log-sum-exp of the scores. ``alibi_slopes [H]`` (finite) is a constant: it
    gets no gradient.
    """
    return_lse = V.boolean("softmax_attention", "return_lse", return_lse)
    q, k, v, opts = _prepare(q, k, v, causal, scale, window, sinks, alibi_slopes, softcap,
                             cu_seqlens, cu_seqlens_q, cu_seqlens_k, form)
    o, lse = _forward(q, k, v, opts)
    return (o, lse) if return_lse else o


@register_vjp(softmax_attention)
def _softmax_attention_vjp(q, k, v, *, return_lse=False, **kwargs):
    opts_kw = dict(causal=False, scale=None, window=None, sinks=0, alibi_slopes=None, softcap=0.0,
                   cu_seqlens=None, cu_seqlens_q=None, cu_seqlens_k=None, form="flash")
    unknown = set(kwargs) - set(opts_kw)
    if unknown:
        raise TypeError(f"softmax_attention(): unexpected keyword arguments {sorted(unknown)}")
    opts_kw.update(kwargs)
    return_lse = V.boolean("softmax_attention", "return_lse", return_lse)
    q, k, v, opts = _prepare(q, k, v, **opts_kw)
    o, lse = _forward(q, k, v, opts)

    def pullback(cot):
        do, dlse = split_cotangent("softmax_attention", cot, 2)
        if not return_lse and dlse is not None:
            raise ValueError("softmax_attention pullback: got a cotangent for lse, but return_lse=False")
        arrs, _ = V.float_arrays("softmax_attention pullback", ("do", "dlse"), q=q, do=do, dlse=dlse)
        do, dlse = arrs["do"], arrs["dlse"]
        if do is None:
            do = np.zeros_like(o)
        if do.shape != o.shape:
            raise ValueError(f"softmax_attention pullback: 'do' must have shape {o.shape}, got {do.shape}")
        if dlse is not None and dlse.shape != lse.shape:
            raise ValueError(f"softmax_attention pullback: 'dlse' must have shape {lse.shape}, got {dlse.shape}")
        dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
        _core.softmax_backward(q, k, v, o, lse, do, dlse, dq, dk, dv, *opts)
        return {"q": dq, "k": dk, "v": dv}

    return ((o, lse) if return_lse else o), pullback


def _merge_parts(os, lses):
    """(o [P, B, Tq, H, Dv], lse [P, B, Tq, H]) stacked from the checked parts."""
    fn = "merge_attention_states"
    if isinstance(os, np.ndarray) or isinstance(lses, np.ndarray):
        raise TypeError(f"{fn}(): 'os' and 'lses' must be sequences of arrays (one per part), got "
                        f"{type(os).__name__} and {type(lses).__name__}")
    os, lses = list(os), list(lses)
    if len(os) != len(lses) or not os:
        raise ValueError(f"{fn}(): 'os' and 'lses' must hold the same number (>= 1) of parts, got "
                         f"{len(os)} and {len(lses)}")
    arrays, _ = V.float_arrays(fn, **{f"os[{p}]": o for p, o in enumerate(os)},
                               **{f"lses[{p}]": x for p, x in enumerate(lses)})
    o0 = arrays["os[0]"]
    V.ndim(fn, "os[0]", o0, 4, "[B, Tq, H, Dv]")
    for p in range(len(os)):
        V.shape(fn, f"os[{p}]", arrays[f"os[{p}]"], o0.shape, "[B, Tq, H, Dv]")
        V.shape(fn, f"lses[{p}]", arrays[f"lses[{p}]"], o0.shape[:3], "[B, Tq, H]")
    return (np.stack([arrays[f"os[{p}]"] for p in range(len(os))]),
            np.stack([arrays[f"lses[{p}]"] for p in range(len(os))]))


def _merge_weights(lse_p):
    """(lse, w_p): lse = log sum_p exp(lse_p), w_p = exp(lse_p - lse); a row empty in every
    part (all -inf) has lse = -inf and weights 0; NaN propagates."""
    m = np.max(lse_p, axis=0)
    empty = m == -np.inf
    shift = np.where(empty, 0, m)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(lse_p - shift)
        total = np.sum(e, axis=0)
        lse = np.where(empty, -np.inf, shift + np.log(np.where(empty, 1, total)))
        w = np.where(empty, 0, e / np.where(empty, 1, total))
    return lse.astype(lse_p.dtype), w.astype(lse_p.dtype)


def merge_attention_states(os, lses):
    """Softmax attention over the union of disjoint key sets from its parts (flash decoding,
    ring attention): ``os`` a sequence of P outputs ``o_p [B, Tq, H, Dv]`` and ``lses`` their
    log-sum-exps ``lse_p [B, Tq, H]`` (``softmax_attention(..., return_lse=True)`` over each
    key set). Returns ``(o, lse)`` with ``lse = log sum_p exp(lse_p)`` and
    ``o = sum_p exp(lse_p - lse) o_p``: what one call over all the keys gives. A row empty in
    every part (all ``lse_p = -inf``) gives 0 and -inf; NaN in a part reaches the rows it is
    in. Differentiable in every ``o_p`` and ``lse_p`` through ``pyattn.vjp``: the pullback
    takes ``(do, dlse)`` (either may be None) and returns ``{"os": [do_p], "lses": [dlse_p]}``,
    one entry per part.
    """
    o_p, lse_p = _merge_parts(os, lses)
    lse, w = _merge_weights(lse_p)
    return np.einsum("pbth,pbthd->bthd", w, o_p), lse


@register_vjp(merge_attention_states)
def _merge_attention_states_vjp(os, lses):
    o_p, lse_p = _merge_parts(os, lses)
    lse, w = _merge_weights(lse_p)
    o = np.einsum("pbth,pbthd->bthd", w, o_p)

    def pullback(cot):
        do, dlse = split_cotangent("merge_attention_states", cot, 2)
        do = np.zeros_like(o) if do is None else np.asarray(do, o.dtype)
        # o = sum_p w_p o_p and lse depend on lse_p through w_p: dw_p/dlse_q = w_p (d_pq - w_q)
        dlse_p = w * np.einsum("bthd,pbthd->pbth", do, o_p - o)
        if dlse is not None:
            dlse_p += w * np.asarray(dlse, o.dtype)
        return {"os": [w[p][..., None] * do for p in range(len(o_p))],
                "lses": [dlse_p[p] for p in range(len(o_p))]}

    return (o, lse), pullback

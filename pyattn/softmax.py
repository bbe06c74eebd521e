"""Softmax attention: parallel, flash and recurrent forms (semantics: docs/ops.md)."""
from __future__ import annotations

import numpy as np

from . import _bf16, _validate as V
from ._engines import (SOFTMAX_FORMS, KVCall, forgetting_backward, forgetting_forward, forgetting_prepare,
                       softmax_backward, softmax_forward, softmax_prepare)
from .autodiff import register_vjp, split_cotangent

FORMS = SOFTMAX_FORMS


@_bf16.calls
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
    q, k, v, opts = softmax_prepare(q, k, v, causal, scale, window, sinks, alibi_slopes, softcap,
                                    cu_seqlens, cu_seqlens_q, cu_seqlens_k, form)
    o, lse = softmax_forward(q, k, v, opts)
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
    q, k, v, opts = softmax_prepare(q, k, v, **opts_kw)
    o, lse = softmax_forward(q, k, v, opts)

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
        dq, dk, dv = softmax_backward(q, k, v, o, lse, do, dlse, opts)
        return {"q": dq, "k": dk, "v": dv}

    return ((o, lse) if return_lse else o), pullback


@_bf16.calls
def forgetting_attention(q, k, v, g, *, window=None, scale=None, cu_seqlens=None, form="flash"):
    """The Forgetting Transformer's attention (FoX): causal softmax attention whose scores
    decay with the forget gates between query and key, ``s_ij = scale q_i.k_j + G_i - G_j``
    for ``j <= i``, ``G_i = g_0 + ... + g_i`` summed along each sequence.

    q ``[B, T, H, K]``, k ``[B, T, Hk, K]``, v ``[B, T, Hk, V]`` with ``H % Hk == 0`` (GQA:
    query head h reads KV head ``h // (H // Hk)``), and the log forget gate ``g [B, T, H]``,
    one per query head (``g <= 0``, say ``logsigmoid`` of a projection; ``-inf`` forgets every
    earlier key), float32 or float64, one dtype. ``G_i - G_j`` is the sum of the gates of
    steps ``j+1 .. i``; the kernel keeps G in two parts, so the bias stays exact to its own
    rounding however large G grows on long sequences. ``scale`` defaults to ``K ** -0.5``.
    ``window=w`` (an int >= 1) keeps only the keys ``i-w+1 .. i`` (fla's ``window_size``).
    ``cu_seqlens`` (B must be 1) packs sequences: G restarts at each one. Forms: ``"flash"``
    (tiled online softmax, never T x T memory) and ``"parallel"`` (materialised scores).
    With ``g = 0`` it is ``softmax_attention(q, k, v, causal=True)``. Returns ``o [B, T, H,
    V]``; differentiable in q, k, v and g through ``pyattn.vjp``. A NaN in q, k or v reaches
    what depends on it, as in softmax_attention; a NaN gate makes every later query of its
    head NaN (through G).
    """
    q, k, v, g, opts = forgetting_prepare(q, k, v, g, window, scale, cu_seqlens, form)
    return forgetting_forward(q, k, v, g, opts)[0]


@register_vjp(forgetting_attention)
def _forgetting_attention_vjp(q, k, v, g, *, window=None, scale=None, cu_seqlens=None, form="flash"):
    q, k, v, g, opts = forgetting_prepare(q, k, v, g, window, scale, cu_seqlens, form)
    o, lse = forgetting_forward(q, k, v, g, opts)

    def pullback(do):
        arrs, _ = V.float_arrays("forgetting_attention pullback", q=q, do=do)
        V.shape("forgetting_attention pullback", "do", arrs["do"], o.shape, "[B, T, H, V]")
        dq, dk, dv, dg = forgetting_backward(q, k, v, g, o, lse, arrs["do"], opts)
        return {"q": dq, "k": dk, "v": dv, "g": dg}

    return o, pullback


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


@_bf16.calls
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


@_bf16.calls
def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, causal=True,
                           scale=None, window=None, sinks=0, alibi_slopes=None, softcap=0.0,
                           block_table=None, num_splits=0, return_lse=False, return_colsum=False):
    """Softmax attention of new queries over a KV cache, writing the new keys into it first
    (flash-attn's ``flash_attn_with_kvcache``).

    q ``[B, Tq, H, Dk]``; the caches ``k_cache [B, capacity, Hk, Dk]``, ``v_cache [B,
    capacity, Hk, Dv]``, or, with ``block_table`` (int32/int64 ``[B, max_blocks]``), the
    paged layout ``[num_blocks, block_size, Hk, D]`` in which position t of sequence b is
    row ``t % block_size`` of block ``block_table[b, t // block_size]``. ``cache_seqlens``
    (int ``[B]``) counts the positions of each sequence already in the cache. The new
    ``k [B, Tnew, Hk, Dk]`` and ``v [B, Tnew, Hk, Dv]``, when given, are written in place
    into positions ``cache_seqlens[b] .. cache_seqlens[b] + Tnew - 1`` (nothing else in the
    caches changes, and ``cache_seqlens`` is not advanced: add Tnew yourself); then the
    queries attend over the first ``cache_seqlens[b] + Tnew`` positions with the masks and
    scores of ``softmax_attention`` (bottom-right aligned: the last query sits at the last
    position; ``causal`` defaults to True). GQA: query head h reads KV head ``h // (H //
    Hk)``, each cached row read once for its group.

    ``num_splits`` cuts each query's visible keys into that many parts, attended in
    parallel and merged by their log-sum-exps (flash decoding: one long sequence with few KV
    heads still uses every thread); 0 chooses from the thread count and the lengths; at most
    1024, whatever Tq. Up to 4 queries per sequence are answered from the cache in place;
    longer ones (a prefill into the cache) copy the visible keys and run the tiled flash
    kernel (``num_splits`` is then checked but unused).
    Every argument is checked before anything is written: bad input (a sequence that would
    run past the cache, a block index outside the pool, mismatched shapes or dtypes, an
    option out of range) raises and leaves the caches as they were, and so does a failure
    after the write (out of memory, an interrupt), which puts the overwritten rows back.
    When ``k, v`` are given the caches must be writeable C-contiguous arrays of q's dtype
    that share no memory; without them nothing is written, and the caches may be views of
    one buffer (a packed KV layout), but not one and the same array.

    Returns ``o [B, Tq, H, Dv]``, then ``lse [B, Tq, H]`` with ``return_lse=True``, then with
    ``return_colsum=True`` ``colsum [B, H, capacity]``: for each query head and cache
    position the attention probabilities summed over the call's queries (0 beyond the
    visible keys), which H2O accumulates to choose the heavy hitters
    (``pyattn.kvcache.h2o_keep``). Differentiable through ``pyattn.vjp`` in q, k, v and the
    caches (the rows read; the gradient for the rows overwritten is 0), not with
    ``return_colsum``.
    """
    fn = "attention_with_kvcache"
    return_lse = V.boolean(fn, "return_lse", return_lse)
    return_colsum = V.boolean(fn, "return_colsum", return_colsum)
    call = KVCall(q, k_cache, v_cache, cache_seqlens, k, v, causal, scale, window, sinks,
                  alibi_slopes, softcap, block_table, num_splits)
    B, _, H, _ = call.q.shape
    colsum = np.zeros((B, H, call.capacity), call.q.dtype) if return_colsum else None
    with call.written():
        o, lse = call.forward(colsum)
    out = (o,) + ((lse,) if return_lse else ()) + ((colsum,) if return_colsum else ())
    return out[0] if len(out) == 1 else out


@register_vjp(attention_with_kvcache)
def _attention_with_kvcache_vjp(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, causal=True,
                                scale=None, window=None, sinks=0, alibi_slopes=None, softcap=0.0,
                                block_table=None, num_splits=0, return_lse=False, return_colsum=False):
    fn = "attention_with_kvcache"
    return_lse = V.boolean(fn, "return_lse", return_lse)
    if V.boolean(fn, "return_colsum", return_colsum):
        raise ValueError(f"{fn}(): the column sums are not differentiable; call it without pyattn.vjp "
                         f"for them")
    call = KVCall(q, k_cache, v_cache, cache_seqlens, k, v, causal, scale, window, sinks,
                  alibi_slopes, softcap, block_table, num_splits)
    with call.written():
        o, lse = call.forward(None)
        # the pullback works on a copy of the keys read, so later writes into the caches (the
        # next decode step's) do not change it
        b, j, rows, cu_k = call.key_rows()
        qp, kp, vp, opts = call.gathered(rows, cu_k)
    B, Tq, H, _ = call.q.shape
    op, lsep = o.reshape(1, B * Tq, H, -1), lse.reshape(1, B * Tq, H)
    old = j < call.seqlens[b]
    read = np.sort(rows[old]) if call.table is not None else None
    shared_rows = read is not None and bool(np.any(read[1:] == read[:-1]))
    given_new = call.kn is not None

    def pullback(cot):
        do, dlse = split_cotangent(fn, cot, 2)
        if not return_lse and dlse is not None:
            raise ValueError(f"{fn} pullback: got a cotangent for lse, but return_lse=False")
        arrs, _ = V.float_arrays(f"{fn} pullback", ("do", "dlse"), q=qp, do=do, dlse=dlse)
        do, dlse = arrs["do"], arrs["dlse"]
        do = np.zeros((B, Tq, H, vp.shape[3]), qp.dtype) if do is None else do
        V.shape(f"{fn} pullback", "do", do, (B, Tq, H, vp.shape[3]), "[B, Tq, H, Dv]")
        if dlse is not None:
            V.shape(f"{fn} pullback", "dlse", dlse, (B, Tq, H), "[B, Tq, H]")
            dlse = dlse.reshape(1, B * Tq, H)
        dq, dk, dv = softmax_backward(qp, kp, vp, op, lsep, do.reshape(op.shape), dlse, opts)
        grads = {"q": dq.reshape(call.q.shape)}
        for name, cache, d in (("k_cache", call.kc, dk[0]), ("v_cache", call.vc, dv[0])):
            g = np.zeros_like(cache)
            flat = g.reshape(-1, *cache.shape[2:])
            if shared_rows:  # sequences that read one block of a paged cache add up there
                np.add.at(flat, rows[old], d[old])
            else:
                flat[rows[old]] = d[old]
            grads[name] = g
        if given_new:
            grads["k"] = dk[0][~old].reshape(call.kn.shape)
            grads["v"] = dv[0][~old].reshape(call.vn.shape)
        return grads

    return ((o, lse) if return_lse else o), pullback

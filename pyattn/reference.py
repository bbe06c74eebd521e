"""Float64 NumPy oracles: the most literal form of each formula in docs/ops.md.

Slow on purpose and independent of the kernels: no shared code, no tiling, no online
softmax, no chunks, no cumulative sums. Every function takes the public op's arguments and
returns float64 results with the op's output structure.

The gated linear and delta-rule oracles loop over t of the recurrence, one (sequence, head)
at a time: S_t = diag(exp(gk_t)) S_{t-1} diag(exp(gv_t)) + k_t v_t^T, o_t = S_t^T (scale q_t),
specialised per op. Arrays are [B, T, H, D], states [B, H, K, V] (key-major); ops with a state
take initial_state=None (zeros) and output_final_state=False and return (o, final_state),
final_state None unless asked for; cu_seqlens (B = 1) resets the recurrence at each boundary,
states are then [N, H, K, V]; form= and chunk_size= are accepted and ignored; scale defaults
to q.shape[-1] ** -0.5 (linear_attention: the feature dimension of phi(q)); mamba2 has none.
"""
from __future__ import annotations

import math

import numpy as np


def _visible_scores(qi, k, kh, h, ip, *, causal, scale, window, sinks, alibi_slopes, softcap):
    """(keys j visible to the query at bottom-right position ip, their scores s_ij)."""
    left, right = (-1, -1) if window is None else window
    keys, scores = [], []
    for j in range(k.shape[0]):
        visible = not causal or j <= ip
        in_window = (left < 0 or j >= ip - left) and (right < 0 or j <= ip + right)
        if not (visible and (in_window or j < sinks)):
            continue
        s = scale * np.dot(qi, k[j, kh])
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        if alibi_slopes is not None:
            s -= float(alibi_slopes[h]) * abs(ip - j)
        keys.append(j)
        scores.append(s)
    return keys, np.array(scores)


def softmax_attention(q, k, v, *, causal=False, scale=None, window=None, sinks=0,
                      alibi_slopes=None, softcap=0.0, cu_seqlens=None, cu_seqlens_q=None,
                      cu_seqlens_k=None, form=None, return_lse=False):
    """Loop over (sequence, head, query): visible keys by the definition, then softmax."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, Tq, H, Dk = q.shape
    Tk, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    mask = dict(causal=causal, scale=Dk ** -0.5 if scale is None else scale, window=window,
                sinks=sinks, alibi_slopes=alibi_slopes, softcap=softcap)
    if cu_seqlens is not None:
        cu_seqlens_q = cu_seqlens_k = cu_seqlens
    if cu_seqlens_q is None:
        seqs = [(b, 0, Tq, 0, Tk) for b in range(B)]
    else:
        cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
        seqs = [(0, cq[n], cq[n + 1], ck[n], ck[n + 1]) for n in range(len(cq) - 1)]
    o = np.zeros((B, Tq, H, Dv))
    lse = np.full((B, Tq, H), -np.inf)
    for b, qs, qe, ks, ke in seqs:
        tq, tk = qe - qs, ke - ks
        for h in range(H):
            kh = h // (H // Hk)
            for i in range(tq):
                keys, s = _visible_scores(q[b, qs + i, h], k[b, ks:ke], kh, h, i + tk - tq, **mask)
                if not keys:
                    continue
                m = s.max()
                p = np.exp(s - m)
                o[b, qs + i, h] = p @ v[b, ks + np.array(keys), kh] / p.sum()
                lse[b, qs + i, h] = m + np.log(p.sum())
    return (o, lse) if return_lse else o


def forgetting_attention(q, k, v, g, *, window=None, scale=None, cu_seqlens=None, form=None):
    """Loop over (sequence, head, query i): the scores of the keys j = i-w+1 .. i (all j <= i
    without a window), each plus the sum of the log gates g of steps j+1 .. i (summed from i
    backwards, so a -inf gate makes the earlier keys' scores -inf), then softmax."""
    q, k, v, g = _f64(q, k, v, g)
    B, T, H, K = q.shape
    Hk = k.shape[2]
    scale = K ** -0.5 if scale is None else scale
    o = np.zeros((B, T, H, v.shape[3]))
    for b, start, end in _sequences(B, T, cu_seqlens):
        for h in range(H):
            kh = h // (H // Hk)
            for i in range(start, end):
                lo = start if window is None else max(start, i - window + 1)
                between = np.append(np.cumsum(g[b, i:lo:-1, h])[::-1], 0.0)  # key j: g[j+1 .. i]
                s = scale * (k[b, lo:i + 1, kh] @ q[b, i, h]) + between
                with np.errstate(invalid="ignore"):
                    p = np.exp(s - s.max())
                o[b, i, h] = p @ v[b, lo:i + 1, kh] / p.sum()
    return o


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, causal=True,
                           scale=None, window=None, sinks=0, alibi_slopes=None, softcap=0.0,
                           block_table=None, num_splits=None, return_lse=False, return_colsum=False,
                           return_caches=False):
    """Writes k, v into float64 copies of the caches position by position, reads each
    sequence's first cache_seqlens[b] + Tnew positions back out, and attends over them.
    Returns the op's outputs, then with return_caches the written copies of the caches (the
    op writes into its caches in place)."""
    q = np.asarray(q, dtype=np.float64)
    kc, vc = (np.array(c, dtype=np.float64) for c in (k_cache, v_cache))
    B, Tq, H, Dk = q.shape
    R = kc.shape[1]

    def where(b, t):  # (block or batch row, row) of position t of sequence b
        return (block_table[b][t // R], t % R) if block_table is not None else (b, t)

    Tnew = 0 if k is None else k.shape[1]
    for b in range(B):
        for t in range(Tnew):
            kc[where(b, cache_seqlens[b] + t)] = k[b, t]
            vc[where(b, cache_seqlens[b] + t)] = v[b, t]
    capacity = R * (len(block_table[0]) if block_table is not None else 1)
    mask = dict(causal=causal, scale=Dk ** -0.5 if scale is None else scale, window=window,
                sinks=sinks, alibi_slopes=alibi_slopes, softcap=softcap)
    o = np.zeros((B, Tq, H, vc.shape[3]))
    lse = np.zeros((B, Tq, H))
    colsum = np.zeros((B, H, capacity))
    for b in range(B):
        L = cache_seqlens[b] + Tnew
        kb = np.stack([kc[where(b, t)] for t in range(L)]) if L else np.zeros((0,) + kc.shape[2:])
        vb = np.stack([vc[where(b, t)] for t in range(L)]) if L else np.zeros((0,) + vc.shape[2:])
        o[b], lse[b] = (x[0] for x in softmax_attention(q[b:b + 1], kb[None], vb[None], return_lse=True, **mask))
        for h in range(H):
            for i in range(Tq):
                keys, s = _visible_scores(q[b, i, h], kb, h // (H // kc.shape[2]), h, i + L - Tq, **mask)
                for j, sj in zip(keys, s):
                    colsum[b, h, j] += np.exp(sj - lse[b, i, h])
    out = (o,) + ((lse,) if return_lse else ()) + ((colsum,) if return_colsum else ())
    out += (kc, vc) if return_caches else ()
    return out[0] if len(out) == 1 else out


def mla_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, causal=True, scale=None, form=None):
    """Loop over (batch, head): decompress head h's keys [c_kv w_uk_h ; k_rope] and values
    c_kv w_uv_h, then loop over queries: visible keys (bottom-right causal), softmax."""
    q_nope, q_rope, c_kv, k_rope, w_uk, w_uv = (np.asarray(x, dtype=np.float64) for x in
                                                (q_nope, q_rope, c_kv, k_rope, w_uk, w_uv))
    B, T, H, Dn = q_nope.shape
    Tk, Dv = c_kv.shape[1], w_uv.shape[2]
    scale = (Dn + q_rope.shape[3]) ** -0.5 if scale is None else scale
    o = np.zeros((B, T, H, Dv))
    for b in range(B):
        for h in range(H):
            keys = np.concatenate([c_kv[b] @ w_uk[:, h, :], k_rope[b]], axis=1)
            values = c_kv[b] @ w_uv[:, h, :]
            for i in range(T):
                query = np.concatenate([q_nope[b, i, h], q_rope[b, i, h]])
                visible = [j for j in range(Tk) if not causal or j <= i + Tk - T]
                if not visible:
                    continue
                s = np.array([scale * np.dot(query, keys[j]) for j in visible])
                p = np.exp(s - s.max())
                o[b, i, h] = p @ values[visible] / p.sum()
    return o

# ---- the gated linear and delta-rule engines ----
__all__ = [
    "feature_map",
    "linear_attention",
    "retention",
    "lightning_attention",
    "simple_gla",
    "gla",
    "mamba2",
    "efficient_attention",
    "delta_rule",
    "gated_delta_rule",
    "kda",
]

FEATURE_MAPS = ("identity", "elu1", "relu", "softmax", "focused", "taylor", "performer",
                "cosformer")


# ---------------------------------------------------------------------------------------------
# small helpers (bookkeeping only: no maths of any op lives here)


def _f64(*arrays):
    return tuple(None if a is None else np.asarray(a, dtype=np.float64) for a in arrays)


def _sequences(B, T, cu_seqlens):
    """[(batch index, start, end)] of the independent sequences."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 1 or cu.dtype.kind not in "iu":
        raise ValueError(f"cu_seqlens: expected an int32/int64 array [N+1], got dtype "
                         f"{cu.dtype} shape {cu.shape}")
    if B != 1:
        raise ValueError(f"cu_seqlens: B must be 1, got B={B}")
    if cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens: must start at 0, be non-decreasing and end at T={T}, "
                         f"got {cu.tolist()}")
    return [(0, int(cu[n]), int(cu[n + 1])) for n in range(cu.size - 1)]


def _states(initial_state, N, H, K, V):
    """float64 copy of initial_state [N, H, K, V], or zeros."""
    if initial_state is None:
        return np.zeros((N, H, K, V))
    s = np.array(initial_state, dtype=np.float64)
    if s.shape != (N, H, K, V):
        raise ValueError(f"initial_state: expected shape {(N, H, K, V)}, got {s.shape}")
    return s


def _softplus(x):
    """log(1 + exp(x)), exactly (no threshold), overflow-free."""
    return np.logaddexp(0.0, x)


def _l2norm(x):
    """x / sqrt(sum x^2 + 1e-6) over the last axis (qk_l2norm)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


# ---------------------------------------------------------------------------------------------
# feature maps


def feature_map(x, kind, **params):
    """phi(x) over the last (feature) axis; float64.

    * ``"identity"``: x.                      * ``"elu1"``: elu(x) + 1.
    * ``"relu"``: max(x, 0).                  * ``"softmax"``: softmax over the feature axis.
    * ``"focused"`` (param ``p=3``): ``|r| * r**p / |r**p|``, r = relu(x), |.| the L2 norm over
      features; where ``|r**p| == 0`` (r = 0) the result is 0 (0/0 := 0).
    * ``"taylor"``: ``[1, x, vec(x x^T) / sqrt(2)]``, 1 + D + D*D features (vec row-major, the
      full outer product, not its upper triangle), so phi(q).phi(k) = 1 + q.k + (q.k)^2/2.
    * ``"performer"`` (param ``projection`` W [m, D], required): ``exp(W x - |x|^2/2) / sqrt(m)``,
      m features.
    * ``"cosformer"`` (param ``max_len``, default T): x must be ``[B, T, H, D]``; at position
      t = 0 .. T-1 along axis 1, ``[relu(x) cos(pi t / (2 max_len)), relu(x) sin(pi t / (2
      max_len))]``, 2D features, so phi(q_t).phi(k_s) = relu(q_t).relu(k_s) cos(pi (t-s) /
      (2 max_len)).
    """
    x = np.asarray(x, dtype=np.float64)
    allowed = {"focused": {"p"}, "performer": {"projection"}, "cosformer": {"max_len"}}
    if kind not in FEATURE_MAPS:
        raise ValueError(f"feature_map: kind must be one of {FEATURE_MAPS}, got {kind!r}")
    extra = set(params) - allowed.get(kind, set())
    if extra:
        raise TypeError(f"feature_map: kind {kind!r} takes no parameter(s) {sorted(extra)}")
    D = x.shape[-1]
    if kind == "identity":
        return x.copy()
    if kind == "elu1":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    if kind == "relu":
        return np.maximum(x, 0.0)
    if kind == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    if kind == "focused":
        p = params.get("p", 3)
        r = np.maximum(x, 0.0)
        rp = r ** p
        norm_r = np.sqrt(np.sum(r * r, axis=-1, keepdims=True))
        norm_rp = np.sqrt(np.sum(rp * rp, axis=-1, keepdims=True))
        safe = np.where(norm_rp > 0, norm_rp, 1.0)
        return np.where(norm_rp > 0, norm_r * rp / safe, 0.0)
    if kind == "taylor":
        outer = x[..., :, None] * x[..., None, :]
        quad = outer.reshape(x.shape[:-1] + (D * D,)) / math.sqrt(2.0)
        return np.concatenate([np.ones(x.shape[:-1] + (1,)), x, quad], axis=-1)
    if kind == "performer":
        if params.get("projection") is None:
            raise ValueError("feature_map: kind 'performer' needs projection=W of shape [m, D]")
        W = np.asarray(params["projection"], dtype=np.float64)
        if W.ndim != 2 or W.shape[1] != D:
            raise ValueError(f"feature_map: projection must be [m, {D}], got {W.shape}")
        m = W.shape[0]
        wx = np.einsum("...d,md->...m", x, W)
        sq = 0.5 * np.sum(x * x, axis=-1, keepdims=True)
        return np.exp(wx - sq) / math.sqrt(m)
    # cosformer
    if x.ndim != 4:
        raise ValueError(f"feature_map: kind 'cosformer' needs x [B, T, H, D], got {x.shape}")
    T = x.shape[1]
    max_len = params.get("max_len")
    max_len = T if max_len is None else max_len
    r = np.maximum(x, 0.0)
    out = np.zeros(x.shape[:-1] + (2 * D,))
    for t in range(T):
        angle = math.pi * t / (2.0 * max_len)
        out[:, t, :, :D] = r[:, t] * math.cos(angle)
        out[:, t, :, D:] = r[:, t] * math.sin(angle)
    return out


_feature_map = feature_map  # linear_attention's keyword argument `feature_map` shadows it


# ---------------------------------------------------------------------------------------------
# the gated linear engine


def linear_attention(q, k, v, *, feature_map=None, feature_map_params=None, normalize=False,
                     eps=1e-6, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, form=None, chunk_size=None):
    """Linear attention, no decay: phi = feature map (None = identity) applied to q and k,
    then ``S_t = S_{t-1} + phi(k_t) v_t^T``, ``o_t = S_t^T (scale phi(q_t))``.

    * ``scale`` defaults to F**-0.5, F the feature dimension of phi(q) (D for the elementwise
      maps, 1+D+D*D for taylor, m for performer, 2D for cosformer). The state is
      ``[B, H, F, V]``.
    * ``feature_map_params``: a dict passed as ``**params`` to ``feature_map``.
    * cosformer with ``cu_seqlens``: the position t restarts at 0 in every sequence, and
      ``max_len`` defaults to the length of each sequence (so packing equals separate calls);
      a ``max_len`` given in ``feature_map_params`` is used for every sequence. Without
      cu_seqlens, positions run 0 .. T-1 and max_len defaults to T.
    * ``normalize=True``: ``z_t = z_{t-1} + phi(k_t)`` and
      ``o_t = ((scale q_t)^T S_t) / ((scale q_t)^T z_t + eps)`` (q_t meaning phi(q_t)). The state
      then has V+1 columns, ``[.., F, V+1]``: columns 0..V-1 are S and the last column is z.
      ``initial_state`` must then be ``[.., F, V+1]`` too (S_0 = state[..., :V], z_0 =
      state[..., V]); the final state has the same layout, so it can be fed back as the next
      call's initial state. This equals the unnormalised op run on ``[v, 1]`` followed by
      ``o[..., :V] / (o[..., V] + eps)``.
    """
    q, k, v = _f64(q, k, v)
    kind = "identity" if feature_map is None else feature_map
    fparams = dict(feature_map_params or {})
    B, T, H, _ = q.shape
    V = v.shape[-1]
    seqs = _sequences(B, T, cu_seqlens)
    F = _feature_map(q, kind, **fparams).shape[-1]
    if cu_seqlens is None:
        pq, pk = _feature_map(q, kind, **fparams), _feature_map(k, kind, **fparams)
    else:
        # phi per sequence: the positions of cosformer restart at every boundary
        pq, pk = np.zeros((B, T, H, F)), np.zeros((B, T, H, F))
        for b, s, e in seqs:
            pq[b, s:e] = _feature_map(q[b:b + 1, s:e], kind, **fparams)[0]
            pk[b, s:e] = _feature_map(k[b:b + 1, s:e], kind, **fparams)[0]
    scale = F ** -0.5 if scale is None else float(scale)
    o = np.zeros((B, T, H, V))
    cols = V + 1 if normalize else V
    states = _states(initial_state, len(seqs), H, F, cols)
    for n, (b, start, end) in enumerate(seqs):
        for h in range(H):
            S = states[n, h, :, :V].copy()
            z = states[n, h, :, V].copy() if normalize else None
            for t in range(start, end):
                S = S + np.outer(pk[b, t, h], v[b, t, h])
                qs = scale * pq[b, t, h]
                if normalize:
                    z = z + pk[b, t, h]
                    o[b, t, h] = (S.T @ qs) / (qs @ z + eps)
                else:
                    o[b, t, h] = S.T @ qs
            states[n, h, :, :V] = S
            if normalize:
                states[n, h, :, V] = z
    return o, (states if output_final_state else None)


def retention(q, k, v, *, gamma=None, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, form=None, chunk_size=None):
    """RetNet retention: ``S_t = gamma_h S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (scale q_t)``.
    ``gamma`` [H] is the decay factor itself (not its log); default
    ``1 - 2**(-5 - arange(H))``."""
    q, k, v = _f64(q, k, v)
    B, T, H, K = q.shape
    V = v.shape[-1]
    gamma = 1.0 - 2.0 ** (-5.0 - np.arange(H)) if gamma is None else np.asarray(gamma, np.float64)
    if gamma.shape != (H,):
        raise ValueError(f"gamma: expected shape {(H,)}, got {gamma.shape}")
    scale = K ** -0.5 if scale is None else float(scale)
    seqs = _sequences(B, T, cu_seqlens)
    states = _states(initial_state, len(seqs), H, K, V)
    o = np.zeros((B, T, H, V))
    for n, (b, start, end) in enumerate(seqs):
        for h in range(H):
            S = states[n, h]
            for t in range(start, end):
                S = gamma[h] * S + np.outer(k[b, t, h], v[b, t, h])
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            states[n, h] = S
    return o, (states if output_final_state else None)


def lightning_attention(q, k, v, *, slopes=None, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None, form=None, chunk_size=None):
    """Lightning attention: ``S_t = exp(-slope_h) S_{t-1} + k_t v_t^T``,
    ``o_t = S_t^T (scale q_t)``; ``slopes`` [H] default ``2**(-8 (h+1) / H)``, h = 0..H-1."""
    q, k, v = _f64(q, k, v)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if slopes is None:
        slopes = np.array([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])
    slopes = np.asarray(slopes, np.float64)
    if slopes.shape != (H,):
        raise ValueError(f"slopes: expected shape {(H,)}, got {slopes.shape}")
    scale = K ** -0.5 if scale is None else float(scale)
    seqs = _sequences(B, T, cu_seqlens)
    states = _states(initial_state, len(seqs), H, K, V)
    o = np.zeros((B, T, H, V))
    for n, (b, start, end) in enumerate(seqs):
        for h in range(H):
            S = states[n, h]
            decay = math.exp(-slopes[h])
            for t in range(start, end):
                S = decay * S + np.outer(k[b, t, h], v[b, t, h])
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            states[n, h] = S
    return o, (states if output_final_state else None)


def simple_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
               cu_seqlens=None, form=None, chunk_size=None):
    """Scalar-gated linear attention: ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``,
    ``o_t = S_t^T (scale q_t)``; ``g [B, T, H]`` log-space, per step."""
    q, k, v, g = _f64(q, k, v, g)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    seqs = _sequences(B, T, cu_seqlens)
    states = _states(initial_state, len(seqs), H, K, V)
    o = np.zeros((B, T, H, V))
    for n, (b, start, end) in enumerate(seqs):
        for h in range(H):
            S = states[n, h]
            for t in range(start, end):
                S = np.exp(g[b, t, h]) * S + np.outer(k[b, t, h], v[b, t, h])
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            states[n, h] = S
    return o, (states if output_final_state else None)


def gla(q, k, v, g, *, gv=None, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, form=None, chunk_size=None):
    """Gated linear attention: ``S_t = diag(exp(g_t)) S_{t-1} diag(exp(gv_t)) + k_t v_t^T``,
    ``o_t = S_t^T (scale q_t)``; ``g [B, T, H, K]`` key-side log gate, ``gv [B, T, H, V]``
    optional value-side log gate (None = 0)."""
    q, k, v, g, gv = _f64(q, k, v, g, gv)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    seqs = _sequences(B, T, cu_seqlens)
    states = _states(initial_state, len(seqs), H, K, V)
    o = np.zeros((B, T, H, V))
    for n, (b, start, end) in enumerate(seqs):
        for h in range(H):
            S = states[n, h]
            for t in range(start, end):
                dk = np.diag(np.exp(g[b, t, h]))
                dv = np.diag(np.exp(gv[b, t, h])) if gv is not None else np.eye(V)
                S = dk @ S @ dv + np.outer(k[b, t, h], v[b, t, h])
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            states[n, h] = S
    return o, (states if output_final_state else None)


def rwkv6(r, k, v, w, u, *, scale=None, initial_state=None, output_final_state=False,
          cu_seqlens=None, form=None, chunk_size=None):
    """RWKV-6: ``o_t = (S_{t-1} + diag(u) k_t v_t^T)^T (scale r_t)``,
    ``S_t = diag(exp(w_t)) S_{t-1} + k_t v_t^T``; ``w [B, T, H, K]`` log decay, ``u [H, K]``."""
    r, k, v, w, u = _f64(r, k, v, w, u)
    B, T, H, K = r.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    seqs = _sequences(B, T, cu_seqlens)
    states = _states(initial_state, len(seqs), H, K, V)
    o = np.zeros((B, T, H, V))
    for n, (b, start, end) in enumerate(seqs):
        for h in range(H):
            S = states[n, h]
            for t in range(start, end):
                kv = np.outer(k[b, t, h], v[b, t, h])
                o[b, t, h] = (S + np.diag(u[h]) @ kv).T @ (scale * r[b, t, h])
                S = np.diag(np.exp(w[b, t, h])) @ S + kv
            states[n, h] = S
    return o, (states if output_final_state else None)


def mamba2(x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=True, initial_state=None,
           output_final_state=False, cu_seqlens=None, form=None, chunk_size=None):
    """Mamba-2 SSD, in its own state-space form (no scale):

        dt <- dt + dt_bias (when given), then softplus(dt) when dt_softplus
        h_t = exp(dt_t A_h) h_{t-1} + dt_t B_t x_t^T          (h is N x P)
        y_t = h_t^T C_t + D_h x_t

    ``x [B, T, H, P]``, ``dt [B, T, H]``, ``A [H]``, ``B, C [B, T, G, N]`` with H % G == 0 (head h
    reads group ``h // (H // G)``), ``D [H]``, ``dt_bias [H]``; state ``[B, H, N, P]``. softplus
    is the exact log(1 + exp(.)), without the threshold some implementations use.
    """
    x, dt, A, Bm, Cm, D, dt_bias = _f64(x, dt, A, B, C, D, dt_bias)
    Bsz, T, H, P = x.shape
    G, N = Bm.shape[2], Bm.shape[3]
    if H % G != 0:
        raise ValueError(f"B/C: H={H} must be divisible by the number of groups G={G}")
    rep = H // G
    seqs = _sequences(Bsz, T, cu_seqlens)
    states = _states(initial_state, len(seqs), H, N, P)
    y = np.zeros((Bsz, T, H, P))
    for n, (b, start, end) in enumerate(seqs):
        for h in range(H):
            grp = h // rep
            hs = states[n, h]
            for t in range(start, end):
                d = dt[b, t, h] + (dt_bias[h] if dt_bias is not None else 0.0)
                if dt_softplus:
                    d = _softplus(d)
                hs = np.exp(d * A[h]) * hs + d * np.outer(Bm[b, t, grp], x[b, t, h])
                y[b, t, h] = hs.T @ Cm[b, t, grp]
                if D is not None:
                    y[b, t, h] += D[h] * x[b, t, h]
            states[n, h] = hs
    return y, (states if output_final_state else None)


def efficient_attention(q, k, v, *, scale=None, form=None):
    """Efficient attention (Shen et al.), non-causal, per (batch, head):
    ``o = softmax_row(scale Q) (softmax_col(scale K)^T V)``, softmax_row over the features of
    each query, softmax_col over time for each key feature. q ``[B, Tq, H, K]``, k ``[B, Tk, H,
    K]``, v ``[B, Tk, H, V]``. Returns o only."""
    q, k, v = _f64(q, k, v)
    B, Tq, H, K = q.shape
    Tk, V = k.shape[1], v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    o = np.zeros((B, Tq, H, V))
    for b in range(B):
        for h in range(H):
            # softmax over time, one key feature (column) at a time
            kc = np.zeros((Tk, K))
            for c in range(K if Tk else 0):
                s = scale * k[b, :, h, c]
                e = np.exp(s - s.max())
                kc[:, c] = e / e.sum()
            context = np.zeros((K, V))
            for t in range(Tk):
                context += np.outer(kc[t], v[b, t, h])
            for t in range(Tq):
                s = scale * q[b, t, h]
                e = np.exp(s - s.max())
                o[b, t, h] = (e / e.sum()) @ context
    return o


# ---------------------------------------------------------------------------------------------
# the delta-rule engine


def gated_delta_rule(q, k, v, g, beta, *, qk_l2norm=False, scale=None, initial_state=None,
                     output_final_state=False, cu_seqlens=None, form=None, chunk_size=None):
    """Gated delta rule:
    ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = S_t^T (scale q_t)``; ``g, beta [B, T, H]``. With ``qk_l2norm`` q and k are first
    replaced by ``x / sqrt(sum x^2 + 1e-6)`` over the head dimension (scale still defaults to
    ``K**-0.5``)."""
    q, k, v, g, beta = _f64(q, k, v, g, beta)
    if qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    seqs = _sequences(B, T, cu_seqlens)
    states = _states(initial_state, len(seqs), H, K, V)
    o = np.zeros((B, T, H, V))
    eye = np.eye(K)
    for n, (b, start, end) in enumerate(seqs):
        for h in range(H):
            S = states[n, h]
            for t in range(start, end):
                kt, bt = k[b, t, h], beta[b, t, h]
                S = (np.exp(g[b, t, h]) * (eye - bt * np.outer(kt, kt)) @ S
                     + bt * np.outer(kt, v[b, t, h]))
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            states[n, h] = S
    return o, (states if output_final_state else None)


def gated_delta_product(q, k, v, g, beta, *, num_householder, qk_l2norm=False, scale=None,
                        initial_state=None, output_final_state=False, cu_seqlens=None, form=None,
                        chunk_size=None):
    """Gated DeltaProduct: per token t, ``S <- exp(g_t) S``, then for j in 0 .. n-1 (rows
    ``t n + j`` of k, v, beta) ``S <- (I - beta k k^T) S + beta k v^T``, then
    ``o_t = S^T (scale q_t)``; g None: no decay. cu_seqlens counts tokens."""
    n = int(num_householder)
    q, k, v, g, beta = _f64(q, k, v, g, beta)
    if qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    seqs = _sequences(B, T, cu_seqlens)
    states = _states(initial_state, len(seqs), H, K, V)
    o = np.zeros((B, T, H, V))
    eye = np.eye(K)
    for m, (b, start, end) in enumerate(seqs):
        for h in range(H):
            S = states[m, h]
            for t in range(start, end):
                if g is not None:
                    S = np.exp(g[b, t, h]) * S
                for r in range(t * n, t * n + n):
                    kr, br = k[b, r, h], beta[b, r, h]
                    S = (eye - br * np.outer(kr, kr)) @ S + br * np.outer(kr, v[b, r, h])
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            states[m, h] = S
    return o, (states if output_final_state else None)


def delta_rule(q, k, v, beta, *, qk_l2norm=False, scale=None, initial_state=None,
               output_final_state=False, cu_seqlens=None, form=None, chunk_size=None):
    """DeltaNet: ``S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = S_t^T (scale q_t)``; ``beta [B, T, H]``; ``qk_l2norm`` as in gated_delta_rule."""
    q, k, v, beta = _f64(q, k, v, beta)
    if qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    seqs = _sequences(B, T, cu_seqlens)
    states = _states(initial_state, len(seqs), H, K, V)
    o = np.zeros((B, T, H, V))
    eye = np.eye(K)
    for n, (b, start, end) in enumerate(seqs):
        for h in range(H):
            S = states[n, h]
            for t in range(start, end):
                kt, bt = k[b, t, h], beta[b, t, h]
                S = (eye - bt * np.outer(kt, kt)) @ S + bt * np.outer(kt, v[b, t, h])
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            states[n, h] = S
    return o, (states if output_final_state else None)


def kda(q, k, v, g, beta, *, qk_l2norm=False, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, form=None, chunk_size=None):
    """Kimi Delta Attention: per step, the state's key channel c decays by ``exp(g_tc)``, then
    ``S_t = S - beta_t k_t (k_t^T S - v_t^T)`` with S the decayed state, and
    ``o_t = S_t^T (scale q_t)``; q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` (value head h reads
    q and k head ``h // (HV // H)``), ``g [B, T, HV, K]``, ``beta [B, T, HV]``; ``qk_l2norm``
    as in gated_delta_rule."""
    q, k, v, g, beta = _f64(q, k, v, g, beta)
    if qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    scale = K ** -0.5 if scale is None else float(scale)
    seqs = _sequences(B, T, cu_seqlens)
    states = _states(initial_state, len(seqs), HV, K, V)
    o = np.zeros((B, T, HV, V))
    for n, (b, start, end) in enumerate(seqs):
        for h in range(HV):
            S = states[n, h]
            for t in range(start, end):
                qt, kt = q[b, t, h // group], k[b, t, h // group]
                S = np.exp(g[b, t, h])[:, None] * S
                S = S - beta[b, t, h] * np.outer(kt, kt @ S - v[b, t, h])
                o[b, t, h] = S.T @ (scale * qt)
            states[n, h] = S
    return o, (states if output_final_state else None)


# ---------------------------------------------------------------------------------------------
# rotary embedding


def dplr_delta_rule(q, k, v, a, b, gk, *, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, form=None, chunk_size=None):
    """The DPLR delta rule: ``S_t = (diag(exp(gk_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T``,
    ``o_t = S_t^T (scale q_t)``; q, k, a, b, gk ``[B, T, H, K]``, v ``[B, T, H, V]``."""
    q, k, v, a, b, gk = _f64(q, k, v, a, b, gk)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    seqs = _sequences(B, T, cu_seqlens)
    states = _states(initial_state, len(seqs), H, K, V)
    o = np.zeros((B, T, H, V))
    for n, (bi, start, end) in enumerate(seqs):
        for h in range(H):
            S = states[n, h]
            for t in range(start, end):
                transition = np.diag(np.exp(gk[bi, t, h])) + np.outer(b[bi, t, h], a[bi, t, h])
                S = transition @ S + np.outer(k[bi, t, h], v[bi, t, h])
                o[bi, t, h] = S.T @ (scale * q[bi, t, h])
            states[n, h] = S
    return o, (states if output_final_state else None)


def rwkv7(r, w, k, v, a, b, *, scale=1.0, initial_state=None, output_final_state=False,
          cu_seqlens=None, form=None, chunk_size=None):
    """RWKV-7: ``dplr_delta_rule`` with the receptance r as the query and w as the log decay."""
    return dplr_delta_rule(r, k, v, a, b, w, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def log_linear_attention(q, k, v, g, level_scales, *, scale=None, initial_state=None,
                         output_final_state=False, cu_seqlens=None, form=None, chunk_size=None):
    """Log-linear attention, the masked matrix per (sequence, head):
    ``o_t = sum_{s<=t} level_scales[t, lev(p_t, p_s)] exp(G_t - G_s) (scale q_t . k_s) v_s``,
    positions ``p`` counted from the state's position (its ``[.., 0, 0, 0]``), ``lev(a, b) =
    bit_length(a XOR b)``. A state's level l seen from position p is at level
    ``max(l, lev(p, p0))``, p0 the position it was left at."""
    q, k, v, g, ls = _f64(q, k, v, g, level_scales)
    B, T, H, K = q.shape
    V, L = v.shape[-1], ls.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    seqs = _sequences(B, T, cu_seqlens)
    h0 = None if initial_state is None else np.asarray(initial_state, np.float64)
    states = np.zeros((len(seqs), H, L, K, V))
    o = np.zeros((B, T, H, V))
    for n, (bi, start, end) in enumerate(seqs):
        n_t = end - start
        for h in range(H):
            p0 = 0 if h0 is None else int(np.rint(h0[n, h, 0, 0, 0]))
            G = np.cumsum(g[bi, start:end, h])
            pos = p0 + np.arange(n_t)
            qh, kh, vh, lh = (x[bi, start:end, h] for x in (q, k, v, ls))
            W = np.zeros((n_t, n_t))
            for t in range(n_t):
                for s in range(t + 1):
                    W[t, s] = lh[t, int(pos[t] ^ pos[s]).bit_length()] * np.exp(G[t] - G[s])
            o[bi, start:end, h] = (W * (scale * qh @ kh.T)) @ vh
            if h0 is not None:
                for t in range(n_t):
                    seen = int(pos[t] ^ p0).bit_length()
                    for level in range(1, L):
                        o[bi, start + t, h] += (lh[t, max(level, seen)] * np.exp(G[t])
                                                * h0[n, h, level].T @ (scale * qh[t]))
            end_pos = p0 + n_t
            if not output_final_state:
                continue
            for s in range(n_t):
                level = int(end_pos ^ pos[s]).bit_length()
                states[n, h, level] += np.exp(G[-1] - G[s]) * np.outer(kh[s], vh[s])
            if h0 is not None:
                seen = int(end_pos ^ p0).bit_length()
                decay = np.exp(G[-1]) if n_t else 1.0
                for level in range(1, L):
                    states[n, h, max(level, seen)] += decay * h0[n, h, level]
            states[n, h, 0] = 0
            states[n, h, 0, 0, 0] = end_pos
    return o, (states if output_final_state else None)


def rope(x, positions, theta=10000.0):
    """Loop over (batch, time, head, pair): feature i and feature i + D/2 rotated by the angle
    p theta^(-2i/D), p the position of the token."""
    x = np.asarray(x, dtype=np.float64)
    B, T, H, D = x.shape
    pos = np.broadcast_to(np.asarray(positions), (B, T))
    y = np.empty_like(x)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                for i in range(D // 2):
                    a = float(pos[b, t]) * theta ** (-2.0 * i / D)
                    c, s = math.cos(a), math.sin(a)
                    x1, x2 = x[b, t, h, i], x[b, t, h, i + D // 2]
                    y[b, t, h, i] = x1 * c - x2 * s
                    y[b, t, h, i + D // 2] = x2 * c + x1 * s
    return y


def _attend(qi, keys, values, scale):
    """One query's softmax attention over the listed key and value rows: (o, lse, the
    probabilities), each score scale * qi . k_j written out."""
    sc = np.array([scale * np.dot(qi, kj) for kj in keys])
    p = np.exp(sc - sc.max())
    return p @ values / p.sum(), sc.max() + np.log(p.sum()), p / p.sum()


def moba_attention(q, k, v, *, block_size, top_k, causal=True, scale=None, cu_seqlens=None):
    """Per (sequence, head, query at bottom-right position p): every block's score
    q . mean(k_block), the blocks chosen by the definition (own block first, then the best
    past ones, or when not causal the best other ones, ties to the lower block), the keys
    visible in them, then softmax."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, Tq, H, Dk = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    scale = Dk ** -0.5 if scale is None else scale
    seqs = ([(b, 0, Tq, 0, Tk) for b in range(B)] if cu_seqlens is None else
            [(0, cu_seqlens[n], cu_seqlens[n + 1], cu_seqlens[n], cu_seqlens[n + 1])
             for n in range(len(cu_seqlens) - 1)])
    o = np.zeros(q.shape[:3] + (v.shape[3],))
    for b, qs, qe, s, e in seqs:
        blocks = [(j, min(j + block_size, e)) for j in range(s, e, block_size)]
        for h in range(H):
            kh = h // (H // Hk)
            means = [k[b, j0:j1, kh].mean(axis=0) for j0, j1 in blocks]
            for i in range(qs, qe):
                p = s + (i - qs) + (e - s) - (qe - qs)  # the query's key position
                own = (p - s) // block_size
                score = [float(np.dot(q[b, i, h], m)) for m in means]
                if causal:
                    past = sorted(range(own), key=lambda j: (-score[j], j))[:top_k - 1]
                    keys = [t for j in past for t in range(*blocks[j])] + list(range(blocks[own][0], p + 1))
                else:
                    others = [j for j in range(len(blocks)) if j != own]
                    chosen = [own] + sorted(others, key=lambda j: (-score[j], j))[:top_k - 1]
                    keys = [t for j in chosen for t in range(*blocks[j])]
                o[b, i, h] = _attend(q[b, i, h], k[b, keys, kh], v[b, keys, kh], scale)[0]
    return o


def linformer_attention(q, k, v, E, F, *, scale=None):
    """Per (batch, head): k' = E k and v' = F v over time, then softmax over the S rows."""
    q, k, v, E, F = (np.asarray(x, dtype=np.float64) for x in (q, k, v, E, F))
    B, Tq, H, Dk = q.shape
    Hk = k.shape[2]
    scale = Dk ** -0.5 if scale is None else scale
    o = np.zeros(q.shape[:3] + (v.shape[3],))
    for b in range(B):
        for h in range(H):
            kh = h // (H // Hk)
            kp, vp = E @ k[b, :, kh], F @ v[b, :, kh]
            for i in range(Tq):
                s = scale * kp @ q[b, i, h]
                p = np.exp(s - s.max())
                o[b, i, h] = p @ vp / p.sum()
    return o


def nsa_attention(q, k, v, g_cmp, g_slc, g_swa, *, block_size=64, block_count=16, window=512,
                  k_cmp=None, v_cmp=None, scale=None, cu_seqlens=None):
    """Per (sequence, query i, KV head, query head of its group): the compressed branch over
    the complete blocks, one block selection per (i, KV head) from the group's summed
    importances, the selected keys (own block up to i), the sliding window, then the gated sum."""
    q, k, v, g_cmp, g_slc, g_swa, k_cmp, v_cmp = _f64(q, k, v, g_cmp, g_slc, g_swa, k_cmp, v_cmp)
    B, T, H, Dk = q.shape
    Hk, Dv = k.shape[2], v.shape[3]
    G = H // Hk
    bs = block_size
    scale = Dk ** -0.5 if scale is None else scale
    o = np.zeros((B, T, H, Dv))
    row0 = 0
    for b, s, e in _sequences(B, T, cu_seqlens):
        L = e - s
        nb = -(-L // bs)
        blocks = [(s + c * bs, s + min((c + 1) * bs, L)) for c in range(nb)]
        row0 = 0 if cu_seqlens is None else row0
        if k_cmp is None:
            kc = np.array([[k[b, j0:j1, kh].mean(axis=0) for kh in range(Hk)] for j0, j1 in blocks])
            vc = np.array([[v[b, j0:j1, kh].mean(axis=0) for kh in range(Hk)] for j0, j1 in blocks])
        else:
            kc, vc = k_cmp[b, row0:row0 + nb], v_cmp[b, row0:row0 + nb]
        row0 += nb
        for i in range(L):
            t = s + i
            own = i // bs
            for kh in range(Hk):
                heads = range(kh * G, (kh + 1) * G)
                visible = range((i + 1) // bs)
                o_cmp, lse = {}, {}
                for h in heads:
                    o_cmp[h] = np.zeros(Dv)
                    lse[h] = -np.inf
                    if len(visible):
                        o_cmp[h], lse[h], _ = _attend(q[b, t, h], kc[list(visible), kh], vc[list(visible), kh],
                                                      scale)
                imp = [sum(math.exp(scale * np.dot(q[b, t, h], kc[c, kh]) - lse[h]) for h in heads)
                       for c in range(own)]
                past = sorted(range(own), key=lambda c: (-imp[c], c))[:max(block_count - 1, 0)]
                slc_keys = [j for c in past for j in range(*blocks[c])] + list(range(blocks[own][0], t + 1))
                swa_keys = list(range(s + max(0, i - window + 1), t + 1))
                for h in heads:
                    branch = [_attend(q[b, t, h], k[b, keys, kh], v[b, keys, kh], scale)[0]
                              for keys in (slc_keys, swa_keys)]
                    o[b, t, h] = (g_cmp[b, t, h] * o_cmp[h] + g_slc[b, t, h] * branch[0]
                                  + g_swa[b, t, h] * branch[1])
    return o


def dsa_index_scores(index_q, index_k, index_w):
    """Per (batch, query t, key s, indexer head j): I[t, s] += w_tj * relu(q_tj . k_s)."""
    index_q, index_k, index_w = _f64(index_q, index_k, index_w)
    B, Tq, Hi, _ = index_q.shape
    Tk = index_k.shape[1]
    scores = np.zeros((B, Tq, Tk))
    for b in range(B):
        for t in range(Tq):
            for s in range(Tk):
                for j in range(Hi):
                    x = float(np.dot(index_q[b, t, j], index_k[b, s]))
                    scores[b, t, s] += index_w[b, t, j] * (0.0 if x < 0 else x)  # NaN stays NaN
    return scores


def dsa_select(index_q, index_k, index_w, *, top_k, causal=True, cu_seqlens=None):
    """Per (sequence, query t): the top_k visible keys by I[t, s] (ties to the lower s), in
    ascending order of s, then -1 padding; min(top_k, Tk) columns."""
    scores = dsa_index_scores(index_q, index_k, index_w)
    B, T, Tk = scores.shape
    idx = np.full((B, T, min(top_k, Tk)), -1, dtype=np.int64)
    for b, s0, e in _sequences(B, T, cu_seqlens):
        for t in range(s0, e):
            visible = range(s0, t + 1 if causal else e)
            best = sorted(sorted(visible, key=lambda s: (-scores[b, t, s], s))[:top_k])
            idx[b, t, :len(best)] = best
    return idx


def dsa_attention(q, k, v, index_q, index_k, index_w, *, top_k, causal=True, scale=None,
                  cu_seqlens=None):
    """Per (batch, query t, head): softmax over the keys dsa_select chose for t."""
    q, k, v = _f64(q, k, v)
    B, T, H, Dk = q.shape
    Hk, Dv = k.shape[2], v.shape[3]
    scale = Dk ** -0.5 if scale is None else scale
    idx = dsa_select(index_q, index_k, index_w, top_k=top_k, causal=causal, cu_seqlens=cu_seqlens)
    o = np.zeros((B, T, H, Dv))
    for b in range(B):
        for t in range(T):
            keys = [int(s) for s in idx[b, t] if s >= 0]
            if not keys:
                continue
            for h in range(H):
                kh = h // (H // Hk)
                o[b, t, h] = _attend(q[b, t, h], k[b, keys, kh], v[b, keys, kh], scale)[0]
    return o


def dsa_index_target(q, k, *, causal=True, scale=None, indices=None, cu_seqlens=None):
    """Per (sequence, query t, head): softmax over the visible keys (or over those of them
    listed in indices[t] when given), averaged over the heads into P[t, :]."""
    q, k = _f64(q, k)
    B, T, H, Dk = q.shape
    Hk = k.shape[2]
    scale = Dk ** -0.5 if scale is None else scale
    P = np.zeros((B, T, T))
    for b, s0, e in _sequences(B, T, cu_seqlens):
        for t in range(s0, e):
            keys = list(range(s0, t + 1 if causal else e))
            if indices is not None:
                keys = [s for s in keys if s in set(int(x) for x in np.asarray(indices)[b, t])]
            if not keys:
                continue
            for h in range(H):
                kh = h // (H // Hk)
                P[b, t, keys] += _attend(q[b, t, h], k[b, keys, kh], k[b, keys, kh], scale)[2] / H
    return P


def merge_attention_states(os, lses):
    """Per (b, t, h) in float64: ``lse = log sum_p
    exp(lse_p)``, ``o = sum_p exp(lse_p - lse) o_p``; 0 and -inf where every lse_p is -inf."""
    o_p = np.stack([np.asarray(o, np.float64) for o in os])
    lse_p = np.stack([np.asarray(x, np.float64) for x in lses])
    o, lse = np.zeros(o_p.shape[1:]), np.full(lse_p.shape[1:], -np.inf)
    for b, t, h in np.ndindex(*lse.shape):
        parts = lse_p[:, b, t, h]
        if np.all(parts == -np.inf):
            continue
        m = parts.max()
        lse[b, t, h] = m + math.log(sum(math.exp(x - m) for x in parts))
        o[b, t, h] = sum(math.exp(x - lse[b, t, h]) * o_p[p, b, t, h] for p, x in enumerate(parts))
    return o, lse

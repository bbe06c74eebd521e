"""KV-cache policies: which cached positions a decoder keeps when the cache must stay small.

Each policy returns the kept positions as sorted int64 indices into the cache; gather the
cache's rows with them (``k[:, keep]``) and attend over what is left. Kept keys keep the
positions they were written at (their rotary phases are already in them), so a decode query
attends to all of them.

``streaming_keep(T, sinks, window)`` (StreamingLLM): the first ``sinks`` positions and the
last ``window``; ``[K]``. Attending over them gives exactly ``softmax_attention(...,
causal=True, window=(window - 1, 0), sinks=sinks)`` for the newest query.

``h2o_keep(scores, budget, window)`` (H2O, heavy hitters): ``budget`` positions in all, the
last ``window`` of them the most recent, the rest those with the highest accumulated
attention ``scores`` (the column sums of the attention probabilities over the queries seen
so far). ``scores [..., T]``: ``[T]`` for one selection shared by every head, ``[H, T]`` (or
``[B, H, T]``) for one per head, as H2O evicts; the result is ``[..., K]``.

``snapkv_keep(q_obs, k, budget, window, kernel=5)`` (SnapKV, at the end of a prefill): the
last ``window`` positions (the observation window) plus the ``budget`` earlier positions
that the observation queries attend to most. ``[B, Hk, K]``, one selection per KV head.

Budgets follow their papers: H2O's ``budget`` is the whole cache after eviction (heavy
hitters and recent window together), SnapKV's counts the selected prompt positions, the
observation window coming on top of it. Where the cache is no larger than what would be kept,
every position is kept. Ties in the scores go to the lower position. Nothing is sized by an
argument beyond the cache (a T, budget, window or kernel of 10**12 is fine).
"""
from __future__ import annotations

import numpy as np

from . import _validate as V


def streaming_keep(T, sinks, window):
    """StreamingLLM's cache of a sequence of T positions: the first ``sinks`` (attention
    sinks) and the last ``window``, as sorted int64 indices ``[min(T, sinks + window)]``
    (positions in both are listed once). A decode query at position T - 1 attending to
    these keys equals ``softmax_attention(q, k, v, causal=True, window=(window - 1, 0),
    sinks=sinks)`` at that query.
    """
    fn = "streaming_keep"
    T = V.integer(fn, "T", T, 0)
    sinks = min(V.integer(fn, "sinks", sinks, 0), T)
    window = V.integer(fn, "window", window, 0)
    # the kept positions only: T may be far more than is kept
    return np.concatenate([np.arange(sinks, dtype=np.int64),
                           np.arange(max(T - window, sinks), T, dtype=np.int64)])


def _all_positions(lead, T):
    return np.ascontiguousarray(np.broadcast_to(np.arange(T, dtype=np.int64), tuple(lead) + (T,)))


def _top(scores, count):
    """Indices of the ``count`` highest scores along the last axis, ties to the lower index."""
    return np.argsort(-scores, axis=-1, kind="stable")[..., :count]


def _with_recent(chosen, start, T):
    """chosen ``[..., n]`` and the positions ``start .. T - 1``, sorted, int64."""
    recent = np.broadcast_to(np.arange(start, T, dtype=np.int64), chosen.shape[:-1] + (T - start,))
    return np.sort(np.concatenate([chosen.astype(np.int64), recent], axis=-1), axis=-1)


def h2o_keep(scores, budget, window):
    """H2O's heavy-hitter cache: keep ``budget`` of the T positions, the last ``window`` and
    the ``budget - window`` earlier ones with the highest accumulated attention ``scores``.

    ``scores [..., T]`` (float32 or float64, finite): the attention each cached position has
    received, summed over the queries so far, ``sum_i softmax_j(s_ij)``. ``[T]`` gives one
    selection for all heads; ``[H, T]`` or ``[B, H, T]`` one per head, as H2O evicts per head.
    Returns sorted int64 indices ``[..., min(T, budget)]``; ties go to the lower position.
    ``window <= budget``.
    """
    fn = "h2o_keep"
    arrs, _ = V.float_arrays(fn, scores=scores)
    scores = V.finite(fn, "scores", arrs["scores"])
    if scores.ndim < 1:
        raise ValueError(f"{fn}(): 'scores' must be [T], [H, T] or [..., T], got a scalar")
    budget = V.integer(fn, "budget", budget, 0)
    window = V.integer(fn, "window", window, 0)
    if window > budget:
        raise ValueError(f"{fn}(): 'window' ({window}) must be <= 'budget' ({budget}), the whole cache kept")
    T = scores.shape[-1]
    if T <= budget:
        return _all_positions(scores.shape[:-1], T)
    return _with_recent(_top(scores[..., :T - window], budget - window), T - window, T)


def _max_pool(x, kernel):
    """Max over the ``kernel`` (odd) neighbours centred on each entry of the last axis; at the
    edges over those that exist (torch's max_pool1d with padding kernel // 2). A kernel
    reaching past both ends is the whole axis: its padding is cut to the axis' length."""
    r = min(kernel // 2, max(x.shape[-1] - 1, 0))
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(r, r)], constant_values=-np.inf)
    return np.lib.stride_tricks.sliding_window_view(padded, 2 * r + 1, axis=-1).max(axis=-1)


def snapkv_keep(q_obs, k, budget, window, *, kernel=5, scale=None):
    """SnapKV's prompt compression: the observation queries vote for the earlier keys.

    q_obs ``[B, Tw, H, D]``: the queries of the prompt's last Tw positions (T - Tw .. T - 1,
    1 <= Tw <= T); k ``[B, T, Hk, D]``: the prompt's keys, ``H % Hk == 0``. Each observation query's
    causal softmax attention ``softmax_j(scale q_i.k_j)`` over keys ``j <= T - Tw + i``
    (scale defaulting to ``D ** -0.5``) is summed, per KV head, over the queries and the
    group's query heads, for the candidate positions ``0 .. T - window - 1``. The votes are
    max-pooled over ``kernel`` neighbouring positions (odd; 1: no pooling), which keeps a
    chosen token's neighbours with it, and the ``budget`` best candidates are kept together
    with the last ``window`` positions (the observation window when ``window == Tw``).
    Returns sorted int64 indices ``[B, Hk, min(T, budget + window)]``; ties go to the lower
    position.
    """
    fn = "snapkv_keep"
    arrs, dtype = V.float_arrays(fn, q_obs=q_obs, k=k)
    q, k = V.finite(fn, "q_obs", arrs["q_obs"]), V.finite(fn, "k", arrs["k"])
    B, Tw, H, D, T, Hk = V.queries_keys(fn, q, k, "q_obs", "head dims", ("[B, Tw, H, D]", "[B, T, Hk, D]"))
    if not 1 <= Tw <= T:
        raise ValueError(f"{fn}(): 'q_obs' holds the queries that vote, those of the prompt's last Tw "
                         f"positions: 1 <= Tw <= T (k's T={T}), got Tw={Tw}")
    budget = V.integer(fn, "budget", budget, 0)
    window = V.integer(fn, "window", window, 0)
    kernel = V.integer(fn, "kernel", kernel, 1)
    if kernel % 2 == 0:
        raise ValueError(f"{fn}(): 'kernel' must be odd (a window centred on each position), got {kernel}")
    scale = V.scale(fn, scale, D ** -0.5, dtype)
    candidates = T - window
    if candidates <= budget:
        return _all_positions((B, Hk), T)
    s = scale * np.einsum("bwkgd,btkd->bkgwt", q.reshape(B, Tw, Hk, H // Hk, D), k, optimize=True)
    future = np.arange(T)[None, :] > np.arange(T - Tw, T)[:, None]
    s[..., future] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    votes = p[..., :candidates].sum(axis=(2, 3))
    return _with_recent(_top(_max_pool(votes, kernel), budget), candidates, T)

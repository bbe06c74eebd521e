"""pyattn.kvcache: hand-worked cases of each policy, literal (looped) versions of H2O's and
SnapKV's selection on random inputs, bad input, and StreamingLLM's identity: a rolling cache
of sinks + window keys gives the outputs of full attention with that window and those sinks."""
from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.kvcache import h2o_keep, snapkv_keep, streaming_keep
from pyattn.testing import TOLERANCES, assert_close

# ------------------------------------------------------------------------------ StreamingLLM


@pytest.mark.parametrize("T,sinks,window,expected", [
    (10, 2, 3, [0, 1, 7, 8, 9]),
    (4, 2, 3, [0, 1, 2, 3]),       # sinks and window overlap: each position once
    (5, 0, 2, [3, 4]),
    (5, 2, 0, [0, 1]),
    (3, 4, 1, [0, 1, 2]),          # more sinks than positions
    (0, 2, 3, []),
])
def test_streaming_keep_by_hand(T, sinks, window, expected):
    keep = streaming_keep(T, sinks, window)
    assert keep.dtype == np.int64
    assert keep.tolist() == expected


def masked_attention(q, k, v, q_pos, k_pos, sinks, window):
    """Softmax attention of queries at positions q_pos over keys at positions k_pos (any
    order), each key visible when causal and (in the last ``window`` positions or a sink):
    the mask written from the original positions, vectorised NumPy in float64."""
    H, Hk = q.shape[2], k.shape[2]
    k, v = (np.repeat(x.astype(np.float64), H // Hk, axis=2) for x in (k, v))
    s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k) * q.shape[3] ** -0.5
    qp, kp = np.asarray(q_pos)[:, None], np.asarray(k_pos)[None, :]
    visible = (kp <= qp) & ((kp > qp - window) | (kp < sinks))
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("bhij,bjhd->bihd", p / p.sum(axis=-1, keepdims=True), v)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_rolling_streaming_cache_equals_windowed_attention(dtype):
    """Decode token by token into a fixed cache of sinks + window slots (sinks stay in the
    first slots, the recent tokens cycle through the rest): the positions held are
    streaming_keep's, and the new query attending to the whole cache gives the full causal
    attention with window=(window - 1, 0) and those sinks."""
    rng = np.random.default_rng(0)
    B, T, H, Hk, D, sinks, window = 2, 40, 4, 2, 8, 3, 6
    q = rng.standard_normal((B, T, H, D)).astype(dtype)
    k, v = (rng.standard_normal((B, T, Hk, D)).astype(dtype) for _ in range(2))
    full = pyattn.softmax_attention(q, k, v, causal=True, window=(window - 1, 0), sinks=sinks)
    cache_k = np.zeros((B, sinks + window, Hk, D), dtype)
    cache_v = np.zeros_like(cache_k)
    held = np.full(sinks + window, -1)
    for t in range(T):
        slot = t if t < sinks else sinks + (t - sinks) % window
        cache_k[:, slot], cache_v[:, slot], held[slot] = k[:, t], v[:, t], t
        n = min(t + 1, sinks + window)
        assert sorted(held[:n].tolist()) == streaming_keep(t + 1, sinks, window).tolist()
        o = pyattn.softmax_attention(q[:, t:t + 1], cache_k[:, :n], cache_v[:, :n], causal=True)
        assert_close(o[:, 0], full[:, t], TOLERANCES[np.dtype(dtype)][0], name=f"step {t}")


def test_chunked_prefill_over_the_kept_keys_equals_windowed_attention():
    """Prefill in chunks of C queries: each chunk attends to the keys streaming_keep kept
    before it plus its own, masked by their original positions; the cache is then cut back
    to streaming_keep. The outputs are the full attention's with window and sinks."""
    rng = np.random.default_rng(1)
    B, T, H, Hk, D, sinks, window, C = 1, 37, 2, 1, 8, 2, 5, 4
    q = rng.standard_normal((B, T, H, D))
    k, v = (rng.standard_normal((B, T, Hk, D)) for _ in range(2))
    full = pyattn.softmax_attention(q, k, v, causal=True, window=(window - 1, 0), sinks=sinks)
    kept = np.zeros(0, dtype=np.int64)
    for c0 in range(0, T, C):
        chunk = np.arange(c0, min(c0 + C, T))
        keys = np.concatenate([kept, chunk])
        o = masked_attention(q[:, chunk], k[:, keys], v[:, keys], chunk, keys, sinks, window)
        assert_close(o, full[:, chunk], 1e-10, name=f"chunk at {c0}")
        kept = keys[np.isin(keys, streaming_keep(chunk[-1] + 1, sinks, window))]
        assert len(kept) == min(chunk[-1] + 1, sinks + window)


# ----------------------------------------------------------------------------------- H2O


@pytest.mark.parametrize("scores,budget,window,expected", [
    ([5, 1, 3, 0, 2, 4, 1], 4, 2, [0, 2, 5, 6]),        # recent 5, 6; best of the rest 0, 2
    ([1, 1, 1, 1, 1], 3, 1, [0, 1, 4]),                 # ties to the lower position
    ([0, 9, 8, 7], 2, 2, [2, 3]),                       # window == budget: recency alone
    ([0, 9, 8, 7], 2, 0, [1, 2]),                       # no window: heavy hitters alone
    ([3, 1, 2], 3, 1, [0, 1, 2]),                       # T <= budget: everything
    ([3, 1, 2], 0, 0, []),
])
def test_h2o_keep_by_hand(scores, budget, window, expected):
    keep = h2o_keep(np.array(scores, dtype=np.float64), budget, window)
    assert keep.dtype == np.int64
    assert keep.tolist() == expected


def test_h2o_keep_per_head():
    scores = np.array([[5, 1, 3, 0, 2, 4, 1], [0, 1, 3, 9, 2, 4, 1], [1, 1, 1, 1, 1, 1, 1]], np.float32)
    keep = h2o_keep(scores, 4, 2)
    assert keep.shape == (3, 4) and keep.dtype == np.int64
    assert keep.tolist() == [[0, 2, 5, 6], [2, 3, 5, 6], [0, 1, 5, 6]]
    batched = h2o_keep(np.stack([scores, scores[::-1]]), 4, 2)
    assert batched.shape == (2, 3, 4)
    assert batched[1].tolist() == keep[::-1].tolist()


def h2o_literal(scores, budget, window):
    """H2O by the definition, one row at a time: the recent window, then the rest ranked by
    (score descending, position ascending)."""
    T = len(scores)
    if T <= budget:
        return list(range(T))
    rest = sorted(range(T - window), key=lambda j: (-scores[j], j))
    return sorted(rest[:budget - window] + list(range(T - window, T)))


def test_h2o_keep_on_accumulated_attention():
    """Scores as H2O accumulates them (column sums of the causal attention probabilities,
    per head), ties made likely by rounding to a coarse grid; every head's selection is the
    literal one."""
    rng = np.random.default_rng(2)
    H, T, D = 3, 50, 4
    q, k = rng.standard_normal((H, T, D)), rng.standard_normal((H, T, D))
    s = np.einsum("hid,hjd->hij", q, k) + np.where(np.tri(T, dtype=bool), 0, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    scores = np.round((p / p.sum(axis=-1, keepdims=True)).sum(axis=1), 1)
    for budget, window in [(10, 4), (20, 0), (49, 5), (50, 50)]:
        keep = h2o_keep(scores, budget, window)
        assert keep.tolist() == [h2o_literal(list(sc), budget, window) for sc in scores]


# -------------------------------------------------------------------------------- SnapKV


def test_snapkv_keep_by_hand():
    """D = 1, scale 1, q = 1, k_j = log(w_j): query at position p weighs key j by w_j over
    the keys up to p. w = [1, 4, 2, 1, 1, 1], observation window 4, 5:
    query 4 gives [1, 4, 2, 1] / 9 to candidates 0..3, query 5 gives [1, 4, 2, 1] / 10;
    votes [.21, .84, .42, .21]. Budget 2: without pooling 1 and 2; max-pooled over 3
    neighbours the votes are [.84, .84, .84, .42] and the tie goes to 0 and 1."""
    k = np.log(np.array([1, 4, 2, 1, 1, 1.]))[None, :, None, None]
    q = np.ones((1, 2, 1, 1))
    assert snapkv_keep(q, k, 2, 2, kernel=1, scale=1.0).tolist() == [[[1, 2, 4, 5]]]
    assert snapkv_keep(q, k, 2, 2, kernel=3, scale=1.0).tolist() == [[[0, 1, 4, 5]]]
    assert snapkv_keep(q, k, 1, 4, kernel=1, scale=1.0).tolist() == [[[1, 2, 3, 4, 5]]]
    assert snapkv_keep(q, k, 4, 2, kernel=1, scale=1.0).tolist() == [[[0, 1, 2, 3, 4, 5]]]
    keep = snapkv_keep(q, k, 2, 2, kernel=1, scale=1.0)
    assert keep.dtype == np.int64 and keep.shape == (1, 1, 4)


def snapkv_literal(q_obs, k, budget, window, kernel, scale):
    """SnapKV by the definition, loops over sequences, KV heads, query heads and queries."""
    B, Tw, H, D = q_obs.shape
    T, Hk = k.shape[1], k.shape[2]
    cand = T - window
    out = []
    for b in range(B):
        rows = []
        for kh in range(Hk):
            votes = np.zeros(cand)
            for h in range(kh * (H // Hk), (kh + 1) * (H // Hk)):
                for i in range(Tw):
                    pos = T - Tw + i
                    s = np.array([scale * q_obs[b, i, h] @ k[b, j, kh] for j in range(pos + 1)])
                    p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
                    votes += p[:cand] if pos + 1 >= cand else np.pad(p, (0, cand - pos - 1))
            r = kernel // 2
            pooled = [max(votes[max(0, j - r):j + r + 1]) for j in range(cand)]
            best = sorted(range(cand), key=lambda j: (-pooled[j], j))[:budget]
            rows.append(sorted(best + list(range(cand, T))))
        out.append(rows)
    return out


@pytest.mark.parametrize("Tw,window,budget,kernel", [(4, 4, 6, 5), (3, 5, 4, 1), (6, 2, 10, 3), (1, 0, 7, 7)])
def test_snapkv_keep_literal_gqa(Tw, window, budget, kernel):
    rng = np.random.default_rng(3)
    B, T, H, Hk, D = 2, 30, 4, 2, 8
    q = rng.standard_normal((B, Tw, H, D))
    k = rng.standard_normal((B, T, Hk, D))
    keep = snapkv_keep(q, k, budget, window, kernel=kernel)
    assert keep.shape == (B, Hk, budget + window)
    assert keep.tolist() == snapkv_literal(q, k, budget, window, kernel, D ** -0.5)


# ------------------------------------------------------------------ sizes beyond the data


def test_streaming_keep_lists_only_what_it_keeps():
    """A cache of 10**12 positions: only the kept ones are listed (nothing of size T); sinks
    and windows beyond T keep every position, as sinks = window = T does; small cases equal
    the mask over every position."""
    T = 10 ** 12
    assert streaming_keep(T, 4, 4).tolist() == [0, 1, 2, 3, T - 4, T - 3, T - 2, T - 1]
    assert streaming_keep(T, 0, 2).tolist() == [T - 2, T - 1]
    assert streaming_keep(T, 3, 0).tolist() == [0, 1, 2]
    assert streaming_keep(7, 10 ** 12, 10 ** 12).tolist() == streaming_keep(7, 7, 7).tolist() == list(range(7))
    for t in range(9):
        for sinks in range(11):
            for window in range(11):
                pos = np.arange(t)
                keep = streaming_keep(t, sinks, window)
                assert keep.dtype == np.int64
                assert keep.tolist() == pos[(pos < sinks) | (pos >= t - window)].tolist(), (t, sinks, window)


def test_budgets_and_kernels_beyond_the_cache():
    """SnapKV's kernel of 10**9 + 1 pools over every candidate, exactly as the narrowest
    kernel that does (2 candidates - 1); budgets and windows of 10**12 keep every position."""
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((2, 3, 4, 8)), rng.standard_normal((2, 20, 2, 8))
    want = snapkv_keep(q, k, 5, 3, kernel=2 * 17 - 1)
    assert np.array_equal(snapkv_keep(q, k, 5, 3, kernel=10 ** 9 + 1), want)
    every = np.broadcast_to(np.arange(20), (2, 2, 20))
    assert np.array_equal(snapkv_keep(q, k, 10 ** 12, 3), every)
    assert np.array_equal(snapkv_keep(q, k, 5, 10 ** 12), every)
    scores = rng.uniform(0, 1, (3, 20))
    assert np.array_equal(h2o_keep(scores, 10 ** 12, 10 ** 12), np.broadcast_to(np.arange(20), (3, 20)))


# ---------------------------------------------------------------------------- bad input


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match=r"streaming_keep\(\): 'T' must be >= 0, got -1"):
        streaming_keep(-1, 2, 3)
    with pytest.raises(TypeError, match=r"streaming_keep\(\): 'window' must be an int, got float"):
        streaming_keep(10, 2, 3.0)
    with pytest.raises(ValueError, match=r"h2o_keep\(\): 'window' \(5\) must be <= 'budget' \(4\)"):
        h2o_keep(np.ones(10), 4, 5)
    with pytest.raises(ValueError, match=r"h2o_keep\(\): 'scores' must be finite, got nan at index \(1, 2\)"):
        h2o_keep(np.array([[1, 2, 3.], [1, 2, np.nan]]), 2, 1)
    with pytest.raises(ValueError, match=r"h2o_keep\(\): 'scores' must be \[T\], \[H, T\]"):
        h2o_keep(np.float64(1.0), 2, 1)
    with pytest.raises(TypeError, match=r"h2o_keep\(\): 'scores' must be float32 or float64, got int64"):
        h2o_keep(np.arange(5), 2, 1)
    with pytest.raises(ValueError, match=r"h2o_keep\(\): 'budget' must be >= 0"):
        h2o_keep(np.ones(5), -1, 0)
    q, k = np.ones((1, 2, 4, 8)), np.ones((1, 10, 2, 8))
    with pytest.raises(ValueError, match=r"snapkv_keep\(\): 'kernel' must be odd"):
        snapkv_keep(q, k, 3, 2, kernel=4)
    with pytest.raises(ValueError, match=r"snapkv_keep\(\): head dims must match, got q_obs=8, k=4"):
        snapkv_keep(q, np.ones((1, 10, 2, 4)), 3, 2)
    with pytest.raises(ValueError, match=r"snapkv_keep\(\): 'k' has Hk=3 heads; q_obs's H=4 must be a multiple"):
        snapkv_keep(q, np.ones((1, 10, 3, 8)), 3, 2)
    with pytest.raises(ValueError, match=r"snapkv_keep\(\): batch sizes must match, got q_obs=1, k=2"):
        snapkv_keep(q, np.ones((2, 10, 2, 8)), 3, 2)
    with pytest.raises(ValueError, match=r"snapkv_keep\(\): 'q_obs' holds .* 1 <= Tw <= T \(k's T=1\), got Tw=2"):
        snapkv_keep(q, np.ones((1, 1, 2, 8)), 3, 2)
    with pytest.raises(ValueError, match=r"snapkv_keep\(\): 'q_obs' holds .* got Tw=0"):
        snapkv_keep(np.ones((1, 0, 4, 8)), k, 3, 2)
    with pytest.raises(ValueError, match=r"snapkv_keep\(\): 'k' must be 4-D \[B, T, Hk, D\]"):
        snapkv_keep(q, np.ones((10, 2, 8)), 3, 2)
    with pytest.raises(TypeError, match=r"snapkv_keep\(\): all float arrays must share one dtype"):
        snapkv_keep(q.astype(np.float32), k, 3, 2)
    with pytest.raises(ValueError, match=r"snapkv_keep\(\): 'k' must be finite"):
        snapkv_keep(q, np.full((1, 10, 2, 8), np.inf), 3, 2)

"""attention_with_kvcache: in-place writes, contiguous and paged caches, flash-decoding splits,
every mask option, column sums, gradients, bad input (caches untouched), NaN."""
import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn.kvcache import streaming_keep
from pyattn.testing import assert_close, gradcheck

from conftest import raises

MASKS = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "window_sinks": dict(causal=True, window=(5, 0), sinks=2),
    "alibi_softcap": dict(causal=True, softcap=3.0, alibi="slopes"),
    "window_right": dict(causal=False, window=(4, 2), scale=0.3),
}


def make(rng, dtype, *, B=3, Tq=1, Tnew=1, H=4, Hk=2, Dk=8, Dv=6, capacity=40, seqlens=(5, 0, 31),
         block_size=None):
    """q, caches, cache_seqlens, new k, v, block table (None unless block_size): the paged pool
    holds the sequences' blocks in a shuffled order, with spare blocks of garbage (NaN)."""
    seqlens = np.array(seqlens[:B])
    q = rng.standard_normal((B, Tq, H, Dk)).astype(dtype)
    k = rng.standard_normal((B, Tnew, Hk, Dk)).astype(dtype) if Tnew else None
    v = rng.standard_normal((B, Tnew, Hk, Dv)).astype(dtype) if Tnew else None
    if block_size is None:
        shape, table = (B, capacity), None
    else:
        per_seq = -(-capacity // block_size)
        table = rng.permutation(B * per_seq + 3)[:B * per_seq].reshape(B, per_seq).astype(np.int32)
        shape = (B * per_seq + 3, block_size)
    kc = rng.standard_normal(shape + (Hk, Dk)).astype(dtype)
    vc = rng.standard_normal(shape + (Hk, Dv)).astype(dtype)
    if table is None:  # rows past each sequence's end are never read
        for b, n in enumerate(seqlens + Tnew):
            kc[b, n:] = vc[b, n:] = np.nan
    return q, kc, vc, seqlens, k, v, table


def options(mask, H, rng, dtype):
    opts = dict(mask)
    if opts.pop("alibi", None):
        opts["alibi_slopes"] = rng.uniform(0.05, 0.5, H).astype(dtype)
    return opts


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("block_size", [None, 16, 5], ids=["contiguous", "paged16", "paged5"])
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
@pytest.mark.parametrize("Tq,Tnew", [(1, 1), (1, 0), (3, 3), (2, 5), (9, 9)])
def test_against_oracle(rng, dtype, block_size, mask, Tq, Tnew):
    """Outputs, LSE and column sums equal the oracle's for every split count; the caches
    equal the oracle's written caches everywhere (new rows written, nothing else touched)."""
    q, kc, vc, seqlens, k, v, table = make(rng, dtype, Tq=Tq, Tnew=Tnew, block_size=block_size)
    opts = options(MASKS[mask], q.shape[2], rng, dtype)
    ro, rlse, rcol, rkc, rvc = reference.attention_with_kvcache(
        q, kc, vc, seqlens, k=k, v=v, block_table=table, return_lse=True, return_colsum=True,
        return_caches=True, **opts)
    for num_splits in (0, 1, 3):
        kc_call, vc_call = kc.copy(), vc.copy()
        o, lse, col = pyattn.attention_with_kvcache(q, kc_call, vc_call, seqlens, k=k, v=v,
                                                    block_table=table, num_splits=num_splits,
                                                    return_lse=True, return_colsum=True, **opts)
        assert o.dtype == lse.dtype == col.dtype == dtype
        assert_close(o, ro, name=f"o, {num_splits} splits")
        assert_close(lse, rlse, name=f"lse, {num_splits} splits")
        assert_close(col, rcol, name=f"colsum, {num_splits} splits")
        np.testing.assert_array_equal(kc_call, rkc.astype(dtype))
        np.testing.assert_array_equal(vc_call, rvc.astype(dtype))


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("block_size", [None, 16, 5], ids=["contiguous", "paged16", "paged5"])
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
@pytest.mark.parametrize("H,Hk,Dk,Dv", [(32, 1, 19, 37), (26, 2, 8, 16), (13, 1, 5, 3)],
                         ids=["mqa32", "gqa13x2", "mqa13"])
def test_wide_groups_against_oracle(rng, dtype, block_size, mask, H, Hk, Dk, Dv):
    """Groups of a vector of query heads or more per KV head (the decode's wide layout: score
    and P V tiles with the heads across the lanes): every mask, both layouts, a group not a
    multiple of the vector, Dk and Dv past whole vectors, sequences of 150 keys (two key
    blocks and a ragged one), 1 key and 77, any split count (more parts than keys too)."""
    q, kc, vc, seqlens, k, v, table = make(rng, dtype, H=H, Hk=Hk, Dk=Dk, Dv=Dv, capacity=160,
                                           seqlens=(149, 0, 76), block_size=block_size)
    opts = options(MASKS[mask], H, rng, dtype)
    ro, rlse, rcol = reference.attention_with_kvcache(q, kc, vc, seqlens, k=k, v=v, block_table=table,
                                                      return_lse=True, return_colsum=True, **opts)
    for num_splits in (0, 1, 3, 64, 1024):
        o, lse, col = pyattn.attention_with_kvcache(q, kc.copy(), vc.copy(), seqlens, k=k, v=v,
                                                    block_table=table, num_splits=num_splits,
                                                    return_lse=True, return_colsum=True, **opts)
        assert_close(o, ro, name=f"o, {num_splits} splits")
        assert_close(lse, rlse, name=f"lse, {num_splits} splits")
        assert_close(col, rcol, name=f"colsum, {num_splits} splits")


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_wide_groups_nan_and_minus_inf(rng, dtype):
    """In the wide layout a NaN in a visible key of one KV head makes its group's rows NaN
    and no other row; a group whose visible scores are all -inf gets NaN rows."""
    q, kc, vc, seqlens, k, v, _ = make(rng, dtype, B=2, H=32, Hk=2, Dk=16, Dv=16, capacity=150,
                                       seqlens=(140, 90))
    bad = kc.copy()
    bad[1, 33, 1] = np.nan
    for splits in (0, 1, 5):
        clean = pyattn.attention_with_kvcache(q, kc, vc, seqlens, k=k, v=v, num_splits=splits)
        assert np.all(np.isfinite(clean))
        o = pyattn.attention_with_kvcache(q, bad, vc, seqlens, k=k, v=v, num_splits=splits)
        assert np.all(np.isnan(o[1, :, 16:])) and np.array_equal(o[0], clean[0])
        assert np.array_equal(o[1, :, :16], clean[1, :, :16])
        inf_q = q.copy()
        inf_q[1, :, :16] = 0
        inf_q[1, :, :16, 0] = np.inf
        kc_neg = kc.copy()
        kc_neg[1, :, 0, 0] = -1.0
        k_neg = k.copy()
        k_neg[1, :, 0, 0] = -1.0
        o, lse = pyattn.attention_with_kvcache(inf_q, kc_neg, vc, seqlens, k=k_neg, v=v,
                                               num_splits=splits, return_lse=True)
        assert np.all(np.isnan(o[1, :, :16])) and np.all(np.isnan(lse[1, :, :16]))
        assert np.all(np.isfinite(o[1, :, 16:])) and np.array_equal(o[0], clean[0])


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("H,Hk", [(1, 1), (8, 1), (6, 3), (32, 1)])
@pytest.mark.parametrize("threads", [1, 2])
def test_long_cache_splits(rng, dtype, H, Hk, threads):
    """One sequence with few KV heads over a long cache: any split count (0 chooses several
    parts on 2 threads) gives the one-pass result; the sequence's last query sees all keys."""
    q, kc, vc, seqlens, k, v, table = make(rng, dtype, B=1, H=H, Hk=Hk, Dk=16, Dv=16,
                                           capacity=5000, seqlens=(4321,))
    ref = pyattn.softmax_attention(q, np.concatenate([kc[:, :4321], k], 1),
                                   np.concatenate([vc[:, :4321], v], 1), causal=True, form="parallel")
    with pyattn.num_threads(threads):
        for splits in (0, 1, 2, 7, 64):
            o = pyattn.attention_with_kvcache(q, kc, vc, seqlens, k=k, v=v, num_splits=splits)
            assert_close(o, ref, name=f"o, {splits} splits")


@pytest.mark.parametrize("block_size", [None, 4], ids=["contiguous", "paged"])
@pytest.mark.parametrize("Tq,Tnew", [(1, 1), (2, 0), (3, 2), (6, 6)])
def test_gradcheck(rng, block_size, Tq, Tnew):
    """Finite differences of q, the new k, v and every cache entry (rows overwritten or never
    read get 0), with the mask options on, both decode and gathered paths."""
    q, kc, vc, seqlens, k, v, table = make(rng, np.float64, B=2, Tq=Tq, Tnew=Tnew, H=2, Hk=1, Dk=3,
                                           Dv=2, capacity=10, seqlens=(3, 2), block_size=block_size)
    if table is None:
        kc, vc = np.nan_to_num(kc), np.nan_to_num(vc)  # finite differences of every entry
    opts = dict(window=(4, 0), sinks=1, softcap=2.0, alibi_slopes=np.array([0.2, 0.1]),
                block_table=table, return_lse=True)
    kw = dict(k=k, v=v) if Tnew else {}
    gradcheck(pyattn.attention_with_kvcache, (q, kc, vc, seqlens), dict(kw, **opts))


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged"])
def test_gradients_match_softmax_attention(rng, dtype, block_size):
    """The pullback's q, k, v gradients are softmax_attention's over each sequence's keys, the
    cache rows read get their keys' gradients, and every other cache row gets 0."""
    q, kc, vc, seqlens, k, v, table = make(rng, dtype, Tq=2, Tnew=2, block_size=block_size)
    if table is None:
        kc, vc = np.nan_to_num(kc), np.nan_to_num(vc)
    B, Tq, H, _ = q.shape
    (o, lse), pb = pyattn.vjp(pyattn.attention_with_kvcache, q, kc, vc, seqlens, k=k, v=v,
                              block_table=table, window=(9, 0), return_lse=True)
    do = rng.standard_normal(o.shape).astype(dtype)
    dlse = rng.standard_normal(lse.shape).astype(dtype)
    g = pb((do, dlse))
    dkc_expect, dvc_expect = np.zeros_like(kc), np.zeros_like(vc)
    R = kc.shape[1]
    for b in range(B):
        L = seqlens[b] + 2
        where = [(table[b, t // R], t % R) if table is not None else (b, t) for t in range(L)]
        kb = np.stack([kc[w] for w in where])[None]
        vb = np.stack([vc[w] for w in where])[None]
        (ob, lb), pbb = pyattn.vjp(pyattn.softmax_attention, q[b:b + 1], kb, vb, causal=True,
                                   window=(9, 0), return_lse=True)
        assert_close(o[b:b + 1], ob, name="o")
        gb = pbb((do[b:b + 1], dlse[b:b + 1]))
        assert_close(g["q"][b:b + 1], gb["q"], 1e-4 if dtype == np.float32 else None, name="dq")
        for t, w in enumerate(where[:seqlens[b]]):
            dkc_expect[w], dvc_expect[w] = gb["k"][0, t], gb["v"][0, t]
        assert_close(g["k"][b], gb["k"][0, seqlens[b]:], 1e-4 if dtype == np.float32 else None, name="dk")
        assert_close(g["v"][b], gb["v"][0, seqlens[b]:], 1e-4 if dtype == np.float32 else None, name="dv")
    tol = 1e-4 if dtype == np.float32 else None
    assert_close(g["k_cache"], dkc_expect, tol, name="dk_cache")
    assert_close(g["v_cache"], dvc_expect, tol, name="dv_cache")


def test_shared_blocks_gradients_add(rng):
    """Two sequences reading one block of a paged cache (a shared prompt): its gradient is the
    sum of both sequences' gradients."""
    q, kc, vc, seqlens, k, v, table = make(rng, np.float64, B=2, Tnew=0, capacity=8, seqlens=(8, 8),
                                           block_size=4)
    table[1] = table[0]
    out, pb = pyattn.vjp(pyattn.attention_with_kvcache, q, kc, vc, seqlens, block_table=table)
    do = rng.standard_normal(out.shape)
    g = pb(do)
    parts = [pyattn.vjp(pyattn.attention_with_kvcache, q[b:b + 1], kc, vc, seqlens[b:b + 1],
                        block_table=table[b:b + 1])[1](do[b:b + 1]) for b in range(2)]
    assert_close(g["k_cache"], parts[0]["k_cache"] + parts[1]["k_cache"], name="dk_cache")
    assert_close(g["v_cache"], parts[0]["v_cache"] + parts[1]["v_cache"], name="dv_cache")


def test_pullback_ignores_later_writes(rng):
    """The pullback reads the keys as they were at the call: the next step's write into the
    caches does not change it."""
    q, kc, vc, seqlens, k, v, _ = make(rng, np.float64)
    kc, vc = np.nan_to_num(kc), np.nan_to_num(vc)
    out, pb = pyattn.vjp(pyattn.attention_with_kvcache, q, kc, vc, seqlens, k=k, v=v)
    do = rng.standard_normal(out.shape)
    before = pb(do)
    pyattn.attention_with_kvcache(q, kc, vc, seqlens, k=2 * k, v=2 * v)
    after = pb(do)
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])


def test_colsum_rows_sum_to_queries(rng):
    """Each query's probabilities sum to 1, so a head's column sums add up to the number of
    queries that see some key; positions beyond the visible keys stay 0."""
    q, kc, vc, seqlens, k, v, _ = make(rng, np.float64, Tq=3, Tnew=3)
    _, col = pyattn.attention_with_kvcache(q, kc, vc, seqlens, k=k, v=v, return_colsum=True)
    assert col.shape == (3, 4, 40)
    sees = np.minimum(seqlens + 3, 3)  # queries at positions >= 0 of each sequence
    assert_close(col.sum(-1), np.repeat(sees[:, None], 4, 1).astype(float), name="sums")
    for b, n in enumerate(seqlens + 3):
        assert np.all(col[b, :, n:] == 0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_streaming_rolling_cache_through_block_table(rng, dtype):
    """StreamingLLM with a physical cache of sinks + window slots: the block table (blocks of
    one row) lists the slots of the kept positions in order, the new token is written into the
    evicted slot, and every decode step equals full causal attention with window and sinks."""
    T, H, Hk, D, sinks, window = 40, 4, 2, 8, 3, 6
    q = rng.standard_normal((1, T, H, D)).astype(dtype)
    k = rng.standard_normal((1, T, Hk, D)).astype(dtype)
    v = rng.standard_normal((1, T, Hk, D)).astype(dtype)
    full = pyattn.softmax_attention(q, k, v, causal=True, window=(window - 1, 0), sinks=sinks)
    slots = sinks + window
    kc = np.full((slots, 1, Hk, D), np.nan, dtype)
    vc = np.full((slots, 1, Hk, D), np.nan, dtype)

    def slot(p):
        return p if p < sinks else sinks + (p - sinks) % window

    for t in range(T):
        kept = streaming_keep(t + 1, sinks, window)
        table = np.array([[slot(p) for p in kept]], np.int32)
        o = pyattn.attention_with_kvcache(q[:, t:t + 1], kc, vc, np.array([len(kept) - 1]),
                                          k=k[:, t:t + 1], v=v[:, t:t + 1], block_table=table)
        assert_close(o[0, 0], full[0, t], name=f"step {t}")


def test_nan_in_unread_rows_and_visible_keys(rng):
    """NaN in cache rows no query reads never reaches an output; a NaN in a visible key makes
    the rows that see it NaN (and only those), for every split count."""
    q, kc, vc, seqlens, k, v, _ = make(rng, np.float64, Tq=1, Tnew=1)
    bad = kc.copy()
    bad[2, 7, 1] = np.nan  # sequence 2, KV head 1, position 7 (window (5, 0) hides it)
    for splits in (0, 1, 4):
        clean = pyattn.attention_with_kvcache(q, kc, vc, seqlens, k=k, v=v, num_splits=splits)
        assert np.all(np.isfinite(clean))
        o = pyattn.attention_with_kvcache(q, bad, vc, seqlens, k=k, v=v, num_splits=splits)
        assert np.all(np.isnan(o[2, :, 2:])) and np.array_equal(o[:2], clean[:2])
        assert np.array_equal(o[2, :, :2], clean[2, :, :2])
        o = pyattn.attention_with_kvcache(q, bad, vc, seqlens, k=k, v=v, window=(5, 0), num_splits=splits)
        assert np.all(np.isfinite(o))


def test_all_scores_minus_inf_is_nan(rng):
    """A query whose visible scores are all -inf gets NaN, however its keys are split (a
    split of -inf scores alone is empty; the merge still sees the query had keys)."""
    q, kc, vc, seqlens, k, v, _ = make(rng, np.float64, B=1, Hk=1, H=1, seqlens=(31,))
    q[:] = 0
    q[0, 0, 0, 0] = np.inf
    kc[0, :31, 0, 0] = -1.0
    k[..., 0] = -1.0
    for splits in (1, 3):
        o, lse = pyattn.attention_with_kvcache(q, kc, vc, seqlens, k=k, v=v, num_splits=splits,
                                               return_lse=True)
        assert np.all(np.isnan(o)) and np.all(np.isnan(lse))


def test_empty_cache_and_no_keys(rng):
    """cache_seqlens 0 and no new keys: no key to see, o = 0 and lse = -inf."""
    q, kc, vc, _, _, _, _ = make(rng, np.float64, B=2, Tnew=0, seqlens=(0, 0))
    o, lse = pyattn.attention_with_kvcache(q, kc, vc, np.zeros(2, np.int64), return_lse=True)
    assert np.all(o == 0) and np.all(lse == -np.inf)


def bad_calls(rng):
    """id -> (exception, args, kwargs, message parts) of calls with new keys that must raise
    before anything is written."""
    q, kc, vc, seqlens, k, v, table = make(rng, np.float64, block_size=16)
    qc, kcc, vcc, sc, _, _, _ = make(rng, np.float64)
    q9, kc9, vc9, s9, k9, v9, _ = make(rng, np.float64, Tq=9, Tnew=9, seqlens=(5, 0, 20))
    qs, kcs, _, ss, ks, vs, _ = make(rng, np.float64, Dv=8)
    pool = np.zeros((4,) + kcs.shape[1:])  # two caches overlapping in pool[1:3]
    cont, paged, prefill = (qc, kcc, vcc, sc), (q, kc, vc, seqlens), (q9, kc9, vc9, s9)
    new, new9 = dict(k=k, v=v), dict(k=k9, v=v9)
    huge = np.array([2 ** 63 - 1, 0, 0])
    return {
        "past_capacity": (ValueError, (qc, kcc, vcc, np.array([5, 0, 40])), new,
                          ["'cache_seqlens'[2] = 40", "sequence 2 needs 41 cache rows", "holds 40"]),
        "seqlens_int64_max": (ValueError, (qc, kcc, vcc, huge), new,
                              ["'cache_seqlens'[0] = 9223372036854775807", "holds 40"]),
        "seqlens_int64_max_paged": (ValueError, (q, kc, vc, huge), dict(new, block_table=table),
                                    ["'cache_seqlens'[0] = 9223372036854775807", "holds 48"]),
        "seqlens_negative": (ValueError, (qc, kcc, vcc, np.array([5, -1, 3])), new, ["'cache_seqlens' must be >= 0"]),
        "seqlens_float": (TypeError, (qc, kcc, vcc, sc.astype(float)), new, ["'cache_seqlens' must be int32 or int64"]),
        "seqlens_length": (ValueError, (qc, kcc, vcc, sc[:2]), new, ["'cache_seqlens' must have B=3 entries"]),
        "block_outside_pool": (ValueError, paged, dict(new, block_table=np.where(table == table[2, 1], 99, table)),
                               ["block_table[2, 1] = 99", "outside the cache's"]),
        "block_int32_wrap": (ValueError, paged, dict(new, block_table=table + np.where(table == table[0, 0], 2 ** 32, 0)),
                             ["block_table[0, 0] = 4294967", "outside the cache's"]),
        "block_table_short": (ValueError, paged, dict(new, block_table=table[:, :1]), ["sequence 2 needs 32", "holds 16"]),
        "block_table_float": (TypeError, paged, dict(new, block_table=table.astype(float)),
                              ["'block_table' must be int32 or int64"]),
        "block_table_rows": (ValueError, paged, dict(new, block_table=table[:2]), ["'block_table' must have one row"]),
        "k_without_v": (ValueError, cont, dict(k=k), ["'k' and 'v' must be given together"]),
        "k_dtype": (TypeError, cont, dict(k=k.astype(np.float32), v=v), ["one dtype", "'k'"]),
        "k_float16": (TypeError, cont, dict(k=k.astype(np.float16), v=v), ["'k' must be float32 or float64"]),
        "cache_dtype": (TypeError, (qc, kcc, vcc.astype(np.float32), sc), new, ["one dtype", "'v_cache'"]),
        "q_dtype": (TypeError, (qc.astype(np.float32), kcc, vcc, sc), new, ["one dtype", "'q'"]),
        "cache_list": (TypeError, (qc, kcc.tolist(), vcc, sc), new, ["'k_cache' must be a numpy.ndarray"]),
        "cache_strided": (ValueError, (qc, kcc[:, ::2], vcc[:, ::2], np.array([1, 1, 1])), new,
                          ["'k_cache' must be a writeable"]),
        "same_cache": (ValueError, (qs, kcs, kcs, ss), dict(k=ks, v=vs), ["'k_cache' and 'v_cache' share memory"]),
        "overlapping_caches": (ValueError, (qs, pool[:3], pool[1:], ss), dict(k=ks, v=vs),
                               ["'k_cache' and 'v_cache' share memory"]),
        "gqa": (ValueError, (qc[:, :, :3], kcc, vcc, sc), new, ["'k_cache' has Hk=2 heads"]),
        "k_shape": (ValueError, cont, dict(k=k[:, :, :1], v=v[:, :, :1]), ["'k' must have shape"]),
        "num_splits_negative": (ValueError, cont, dict(new, num_splits=-1), ["'num_splits' must be >= 0"]),
        "num_splits_2000": (ValueError, cont, dict(new, num_splits=2000), ["'num_splits' must be <= 1024, got 2000"]),
        "num_splits_2000_paged": (ValueError, paged, dict(new, block_table=table, num_splits=2000),
                                  ["'num_splits' must be <= 1024"]),
        "num_splits_2000_prefill": (ValueError, prefill, dict(new9, num_splits=2000), ["'num_splits' must be <= 1024"]),
        "num_splits_2_70": (ValueError, cont, dict(new, num_splits=2 ** 70), ["'num_splits' must be <= 1024"]),
        "num_splits_float": (TypeError, cont, dict(new, num_splits=1.0), ["'num_splits' must be an int"]),
        "window": (ValueError, cont, dict(new, window=(-2, 0)), ["'window[0]' must be >= -1"]),
        "window_prefill": (ValueError, prefill, dict(new9, window=(3,)), ["'window' must be (left, right)"]),
        "sinks": (ValueError, cont, dict(new, sinks=-1), ["'sinks' must be >= 0"]),
        "softcap": (ValueError, cont, dict(new, softcap=float("nan")), ["'softcap' must be finite"]),
        "scale": (ValueError, prefill, dict(new9, scale=float("inf")), ["'scale' must be finite"]),
        "alibi_nan": (ValueError, cont, dict(new, alibi_slopes=np.full(4, np.nan)), ["'alibi_slopes' must be finite"]),
        "alibi_shape": (ValueError, cont, dict(new, alibi_slopes=np.ones(3)), ["'alibi_slopes' must have shape (4,)"]),
        "causal": (TypeError, cont, dict(new, causal="yes"), ["'causal' must be a bool"]),
        "return_lse": (TypeError, cont, dict(new, return_lse=1), ["'return_lse' must be a bool"]),
        "return_colsum": (TypeError, cont, dict(new, return_colsum=None), ["'return_colsum' must be a bool"]),
    }


BAD_CALLS = list(bad_calls(np.random.default_rng(0)))


@pytest.mark.parametrize("via", ["call", "vjp"])
@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_leaves_caches_untouched(rng, case, via):
    """Every argument is checked before the first write, alike under pyattn.vjp; the message
    names the public op and the argument."""
    exc, args, kwargs, must = bad_calls(rng)[case]
    kc, vc = args[1], args[2]
    before = [np.array(c, copy=True) for c in (kc, vc)]
    call = (pyattn.attention_with_kvcache,) if via == "call" else (pyattn.vjp, pyattn.attention_with_kvcache)
    msg = raises(exc, *call, *args, must=must, **kwargs)
    assert msg.startswith("attention_with_kvcache(): "), msg
    for c, b in zip((kc, vc), before):
        np.testing.assert_array_equal(np.asarray(c), b)


@pytest.mark.parametrize("via", ["call", "vjp"])
@pytest.mark.parametrize("entry,Tq", [("softmax_decode", 1), ("softmax_forward", 9)], ids=["decode", "prefill"])
@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged"])
def test_failure_after_write_restores_caches(rng, monkeypatch, via, entry, Tq, block_size):
    """A kernel that fails once the new keys are in (out of memory, an interrupt) leaves the
    caches as they were."""
    q, kc, vc, seqlens, k, v, table = make(rng, np.float64, Tq=Tq, Tnew=Tq, seqlens=(5, 0, 20),
                                           block_size=block_size)
    before = kc.copy(), vc.copy()

    def fail(*args):
        raise MemoryError("no memory")

    monkeypatch.setattr(pyattn._core, entry, fail)
    call = (pyattn.attention_with_kvcache,) if via == "call" else (pyattn.vjp, pyattn.attention_with_kvcache)
    raises(MemoryError, *call, q, kc, vc, seqlens, k=k, v=v, block_table=table, must=["no memory"])
    np.testing.assert_array_equal(kc, before[0])
    np.testing.assert_array_equal(vc, before[1])


def test_one_array_as_both_caches_is_refused(rng):
    """k_cache and v_cache as one array is an error even when nothing is written; two views of
    one packed buffer (keys and values interleaved) are read as they are."""
    q, kc, _, seqlens, _, _, _ = make(rng, np.float64, Tnew=0, Dv=8)
    for k_cache, v_cache in ((kc, kc), (kc, kc[:])):
        with pytest.raises(ValueError, match=r"attention_with_kvcache\(\): 'k_cache' and 'v_cache' are the same array"):
            pyattn.attention_with_kvcache(q, k_cache, v_cache, seqlens)
    packed = np.stack([kc, rng.standard_normal(kc.shape)], axis=2)     # [B, T, 2, Hk, D]
    np.testing.assert_array_equal(pyattn.attention_with_kvcache(q, packed[:, :, 0], packed[:, :, 1], seqlens),
                                  pyattn.attention_with_kvcache(q, kc, packed[:, :, 1].copy(), seqlens))


@pytest.mark.parametrize("Tq", [1, 9])
def test_num_splits_limits_accepted(rng, Tq):
    """0 and 1024 are the bounds of num_splits, whatever Tq."""
    q, kc, vc, seqlens, k, v, _ = make(rng, np.float64, Tq=Tq, Tnew=Tq, seqlens=(5, 0, 20))
    o0 = pyattn.attention_with_kvcache(q, kc.copy(), vc.copy(), seqlens, k=k, v=v, num_splits=0)
    o1024 = pyattn.attention_with_kvcache(q, kc.copy(), vc.copy(), seqlens, k=k, v=v, num_splits=1024)
    assert_close(o1024, o0)


def test_read_only_cache_without_new_keys(rng):
    """With no new keys nothing is written: a read-only (or strided) cache is fine."""
    q, kc, vc, seqlens, _, _, _ = make(rng, np.float64, Tnew=0)
    ref = pyattn.attention_with_kvcache(q, kc, vc, seqlens)
    kc.flags.writeable = False
    assert_close(pyattn.attention_with_kvcache(q, kc, vc[:, ::1], seqlens), ref)


def test_colsum_not_differentiable(rng):
    q, kc, vc, seqlens, k, v, _ = make(rng, np.float64)
    raises(ValueError, pyattn.vjp, pyattn.attention_with_kvcache, q, kc, vc, seqlens, k=k, v=v,
           return_colsum=True, must=["column sums are not differentiable"])


def test_core_checks_key_rows(rng):
    """_core.softmax_decode refuses key rows outside the cache, whoever calls it."""
    from pyattn import _core
    q, kc, vc, _, _, _, table = make(rng, np.float64, block_size=16)
    B, Tq, H, _ = q.shape
    o, lse = np.empty((B, Tq, H, 6)), np.empty((B, Tq, H))
    cu = np.arange(B + 1, dtype=np.int64)
    start = np.zeros(B, np.int64)
    opts = (True, -1, -1, 0, None, 0.0, 0.5)
    with pytest.raises(ValueError, match="outside the cache"):
        _core.softmax_decode(q, kc, vc, o, lse, cu, start, np.array([5, 0, 49]), table, 0, None, *opts)
    bad = table.copy()
    bad[0, 0] = -1
    with pytest.raises(ValueError, match="outside the cache"):
        _core.softmax_decode(q, kc, vc, o, lse, cu, start, np.array([5, 0, 3]), bad, 0, None, *opts)
    flat = kc.reshape(1, -1, *kc.shape[2:]), vc.reshape(1, -1, *vc.shape[2:])
    with pytest.raises(ValueError, match="outside the cache"):
        _core.softmax_decode(q, *flat, o, lse, cu, start, np.array([5, 0, flat[0].shape[1] + 1]), None, 0,
                             None, *opts)

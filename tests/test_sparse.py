"""moba_attention against its float64 oracle: block choice (own block, best past blocks, ties),
ragged last blocks, GQA, varlen, non-causal, gradients, bad input. linformer_attention.
nsa_attention and DeepSeek sparse attention (dsa_index_scores, dsa_select, dsa_attention,
dsa_index_target) against their oracles, and _core.softmax_decode_backward, the kernel under
their backward, against the flash backward."""
import inspect
import math

import numpy as np
import pytest

import pyattn
from pyattn import _core, reference
from pyattn.testing import TOLERANCES, assert_close, finite_differences, gradcheck

from conftest import f32_exact, raises

CASES = [  # T, block_size, top_k
    (37, 8, 2), (40, 8, 3), (16, 4, 1), (23, 5, 10), (1, 4, 2), (64, 16, 2), (50, 7, 4),
]


def qkv(rng, dtype, B=2, T=37, H=4, Hk=2, D=6, Dv=5):
    return (rng.standard_normal((B, T, H, D)).astype(dtype),
            rng.standard_normal((B, T, Hk, D)).astype(dtype),
            rng.standard_normal((B, T, Hk, Dv)).astype(dtype))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("T,bs,top_k", CASES, ids=[f"T{t}-bs{b}-k{k}" for t, b, k in CASES])
@pytest.mark.parametrize("H,Hk", [(4, 2), (2, 2), (3, 1)])
def test_against_oracle(rng, causal, T, bs, top_k, H, Hk):
    """float64 and float32 calls against the float64 oracle."""
    q, k, v = qkv(rng, np.float64, T=T, H=H, Hk=Hk)
    ref = reference.moba_attention(q, k, v, block_size=bs, top_k=top_k, causal=causal)
    for dtype in (np.float64, np.float32):
        args = [x.astype(dtype) for x in (q, k, v)]
        o = pyattn.moba_attention(*args, block_size=bs, top_k=top_k, causal=causal)
        assert o.dtype == dtype and o.shape == (2, T, H, 5)
        assert_close(o, ref, name=np.dtype(dtype).name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("Tq,Tk,bs,top_k", [(1, 37, 8, 2), (5, 40, 8, 3), (9, 12, 4, 2), (1, 1, 4, 2), (7, 23, 5, 10)])
def test_last_queries_against_oracle(rng, dtype, causal, Tq, Tk, bs, top_k):
    """Queries that are the last Tq positions (decoding): the oracle, and the same rows of a
    call with every query."""
    q, k, v = qkv(rng, dtype, T=Tk)
    o = pyattn.moba_attention(q[:, Tk - Tq:], k, v, block_size=bs, top_k=top_k, causal=causal)
    assert_close(o, reference.moba_attention(q[:, Tk - Tq:], k, v, block_size=bs, top_k=top_k, causal=causal))
    full = pyattn.moba_attention(q, k, v, block_size=bs, top_k=top_k, causal=causal)
    assert_close(o, full[:, Tk - Tq:])


def test_last_queries_gradcheck(rng):
    q, k, v = qkv(rng, np.float64, B=2, T=11, H=2, Hk=1, D=3, Dv=2)
    gradcheck(pyattn.moba_attention, (q[:, 8:], k, v), dict(block_size=3, top_k=2))


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_varlen_equals_separate_calls(rng, dtype, causal):
    """Packed sequences restart their blocks: each equals its own call, and the oracle."""
    cu = np.array([0, 13, 13, 40, 41])
    q, k, v = qkv(rng, dtype, B=1, T=41)
    o = pyattn.moba_attention(q, k, v, block_size=6, top_k=3, causal=causal, cu_seqlens=cu)
    assert_close(o, reference.moba_attention(q, k, v, block_size=6, top_k=3, causal=causal, cu_seqlens=cu))
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            part = pyattn.moba_attention(q[:, a:b], k[:, a:b], v[:, a:b], block_size=6, top_k=3, causal=causal)
            assert_close(o[:, a:b], part)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_every_block_is_causal_attention(rng, dtype):
    """top_k at least the number of blocks chooses them all: causal softmax attention."""
    q, k, v = qkv(rng, dtype, T=45)
    o = pyattn.moba_attention(q, k, v, block_size=8, top_k=6)
    assert_close(o, pyattn.softmax_attention(q, k, v, causal=True))
    o = pyattn.moba_attention(q, k, v, block_size=8, top_k=6, causal=False)
    assert_close(o, pyattn.softmax_attention(q, k, v))


def test_top_1_is_the_own_block(rng):
    """top_k = 1 (causal): each query sees only its own block, causally: block-diagonal
    causal attention, which softmax_attention gives with the blocks as sequences."""
    q, k, v = qkv(rng, np.float64, B=1, T=30)
    o = pyattn.moba_attention(q, k, v, block_size=7, top_k=1)
    cu = np.array([0, 7, 14, 21, 28, 30])
    assert_close(o, pyattn.softmax_attention(q, k, v, causal=True, cu_seqlens=cu))


def test_ties_go_to_the_lower_block(rng):
    """Blocks 0 and 2 have the same mean key, block 1 a worse one: a query of block 3 with
    top_k = 2 takes its own block and block 0, not block 2 (the oracle agrees)."""
    D, bs = 4, 3
    base = rng.standard_normal((bs, D))
    k = np.concatenate([base, -base, base[::-1], rng.standard_normal((bs, D))])[None, :, None, :]
    q = np.tile(base.mean(0), (1, 4 * bs, 1, 1))
    v = np.eye(4 * bs)[None, :, None, :]  # o's columns say which keys were attended
    o = pyattn.moba_attention(q, k, v, block_size=bs, top_k=2)
    assert_close(o, reference.moba_attention(q, k, v, block_size=bs, top_k=2))
    last = o[0, -1, 0]
    assert np.all(last[:3] > 0) and np.all(last[3:9] == 0) and np.all(last[9:] > 0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_full_keeps_the_own_block(rng, dtype):
    """causal=False, top_k = 2: the own block whatever its score, and the best other block,
    earlier or later. Blocks 1 and 2 share the best mean key, 0 and 3 the worst: a query of
    block 0 or 3 takes its own and block 1 (the tie to the lower), one of block 1 takes
    block 2, one of block 2 takes block 1 (the oracle agrees)."""
    D, bs = 4, 3
    base = rng.standard_normal((bs, D))
    k = np.concatenate([-base, base, base[::-1], -base])[None, :, None, :].astype(dtype)
    q = np.tile(base.mean(0), (1, 4 * bs, 1, 1)).astype(dtype)
    v = np.eye(4 * bs, dtype=dtype)[None, :, None, :]  # o's columns say which keys were attended
    o = pyattn.moba_attention(q, k, v, block_size=bs, top_k=2, causal=False)
    assert_close(o, reference.moba_attention(q, k, v, block_size=bs, top_k=2, causal=False))
    blocks = {0: [0, 1], 1: [1, 2], 2: [1, 2], 3: [1, 3]}
    for i in range(4 * bs):
        seen = [j for j in range(4) if np.all(o[0, i, 0, j * bs:(j + 1) * bs] > 0)]
        assert seen == blocks[i // bs], (i, seen)
        assert np.count_nonzero(o[0, i, 0]) == 2 * bs


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_full_top_1_is_the_whole_own_block(rng, dtype):
    """top_k = 1, causal=False: each query sees its whole own block and nothing else:
    non-causal attention with the blocks as sequences, forward and gradients."""
    q, k, v = qkv(rng, dtype, B=1, T=30)
    cu = np.array([0, 7, 14, 21, 28, 30])
    do = rng.standard_normal((1, 30, 4, 5)).astype(dtype)
    o, pullback = pyattn.vjp(pyattn.moba_attention, q, k, v, block_size=7, top_k=1, causal=False)
    ref, ref_pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, cu_seqlens=cu)
    assert_close(o, ref)
    g, want = pullback(do), ref_pullback(do)
    for name in "qkv":
        assert_close(g[name], want[name], TOLERANCES[np.dtype(dtype)][1], name=f"d{name}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cu", [None, [0, 4, 4, 13]], ids=["batch", "varlen"])
def test_moba_sizes_beyond_the_data(rng, causal, cu):
    """block_size and top_k far beyond the keys give the oracle's output, and exactly the
    output and gradients of the largest meaningful values (one block per sequence; every
    block), and size nothing from the argument."""
    T, longest = 13, 13 if cu is None else 9
    q, k, v = qkv(rng, np.float64, B=2 if cu is None else 1, T=T)
    do = rng.standard_normal(q.shape[:3] + (5,))
    kw = dict(causal=causal, cu_seqlens=None if cu is None else np.array(cu))
    for big, fit in ((dict(block_size=10 ** 9, top_k=2), dict(block_size=longest, top_k=2)),
                     (dict(block_size=4, top_k=10 ** 9), dict(block_size=4, top_k=-(-longest // 4)))):
        o, pullback = pyattn.vjp(pyattn.moba_attention, q, k, v, **big, **kw)
        want, want_pullback = pyattn.vjp(pyattn.moba_attention, q, k, v, **fit, **kw)
        assert_close(o, reference.moba_attention(q, k, v, **big, **kw))
        assert np.array_equal(o, want)
        assert np.array_equal(pyattn.moba_attention(q, k, v, **big, **kw), want)
        g, gw = pullback(do), want_pullback(do)
        for name in "qkv":
            assert np.array_equal(g[name], gw[name]), name


def test_moba_kernel_block_size_beyond_the_keys(rng):
    """_core's MoBA kernels called with block_size INT32_MAX: the buffers follow the
    longest sequence (9 keys), and the results equal block_size 9's."""
    cu = np.array([0, 4, 13], np.int64)
    H, Hk, D, Dv = 2, 1, 3, 2
    q, k, v = rng.standard_normal((13, H, D)), rng.standard_normal((13, Hk, D)), rng.standard_normal((13, Hk, Dv))
    km = np.stack([k[0:4].mean(0), k[4:13].mean(0)])
    do, dlse = rng.standard_normal((13, H, Dv)), rng.standard_normal((13, H))
    for causal in (False, True):
        out = []
        for bs in (2 ** 31 - 1, 9):
            choice = np.empty((13, H, 1), np.int32)
            _core.moba_select(q, km, cu, cu, bs, causal, 0 if causal else 1, choice)
            o, lse = np.empty((13, H, Dv)), np.empty((13, H))
            _core.moba_forward(q, k, v, choice, cu, cu, bs, causal, 0.5, o, lse)
            dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
            _core.moba_backward(q, k, v, o, lse, do, dlse, choice, cu, cu, bs, causal, 0.5, dq, dk, dv)
            out.append((choice, o, lse, dq, dk, dv))
        for a, b in zip(*out):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cu", [None, [0, 4, 11]], ids=["batch", "varlen"])
def test_gradcheck(rng, causal, cu):
    q, k, v = qkv(rng, np.float64, B=1 if cu else 2, T=11, H=2, Hk=1, D=3, Dv=2)
    gradcheck(pyattn.moba_attention, (q, k, v),
              dict(block_size=3, top_k=2, causal=causal, cu_seqlens=None if cu is None else np.array(cu)))


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_gradients_match_the_oracle_choice(rng, dtype):
    """With every block chosen the gradients are causal softmax attention's; with a few,
    the float32 gradients follow the float64 ones."""
    q, k, v = qkv(rng, dtype, T=45)
    do = rng.standard_normal((2, 45, 4, 5)).astype(dtype)
    g = pyattn.vjp(pyattn.moba_attention, q, k, v, block_size=8, top_k=6)[1](do)
    ref = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True)[1](do)
    tol = 1e-4 if dtype == np.float32 else None
    for name in "qkv":
        assert_close(g[name], ref[name], tol, name=f"d{name}")
    if dtype == np.float32:
        g32 = pyattn.vjp(pyattn.moba_attention, q, k, v, block_size=8, top_k=3)[1](do)
        args64 = [x.astype(np.float64) for x in (q, k, v)]
        g64 = pyattn.vjp(pyattn.moba_attention, *args64, block_size=8, top_k=3)[1](do.astype(np.float64))
        for name in "qkv":
            assert_close(g32[name], g64[name], 1e-4, name=f"d{name}")


def test_nan_stays_in_its_blocks(rng):
    """A NaN key reaches the queries whose chosen blocks hold it (its own block's later
    queries, at least), and no query that did not choose its block."""
    q, k, v = qkv(rng, np.float64, B=1, T=32, H=1, Hk=1)
    clean = pyattn.moba_attention(q, k, v, block_size=8, top_k=1)
    v[0, 20, 0, 0] = np.nan
    o = pyattn.moba_attention(q, k, v, block_size=8, top_k=1)
    assert np.all(np.isnan(o[0, 20:24, 0, 0])) and np.all(np.isfinite(o[0, 20:24, 0, 1:]))
    assert np.array_equal(o[0, :20], clean[0, :20])
    assert np.array_equal(o[0, 24:], clean[0, 24:])


@pytest.mark.parametrize("bad,exc,must", [
    (dict(block_size=0), ValueError, ["'block_size' must be >= 1"]),
    (dict(top_k=0), ValueError, ["'top_k' must be >= 1"]),
    (dict(block_size=2.5), TypeError, ["'block_size'"]),
    (dict(causal=1), TypeError, ["'causal'"]),
    (dict(cu_seqlens=np.array([0, 5])), ValueError, ["cu_seqlens"]),
])
def test_bad_options(rng, bad, exc, must):
    q, k, v = qkv(rng, np.float64, T=9)
    raises(exc, pyattn.moba_attention, q, k, v, must=must, **dict(dict(block_size=4, top_k=2), **bad))


def test_bad_arrays(rng):
    q, k, v = qkv(rng, np.float64, T=9)
    raises(ValueError, pyattn.moba_attention, q, k[:, :8], v[:, :8], block_size=4, top_k=2,
           must=["need Tq <= Tk, got Tq=9, Tk=8"])
    raises(ValueError, pyattn.moba_attention, q[:, :5], k, v, block_size=4, top_k=2,
           cu_seqlens=np.array([0, 9]), must=["same rows"])
    raises(ValueError, pyattn.moba_attention, q[:, :, :3], k, v, block_size=4, top_k=2,
           must=["'k' has Hk=2 heads"])
    raises(TypeError, pyattn.moba_attention, q, k.astype(np.float32), v, block_size=4, top_k=2,
           must=["one dtype"])


# --------------------------------------------------------------------------- linformer


def linformer_inputs(rng, dtype, B=2, Tq=7, T=9, S=4, H=4, Hk=2, D=5, Dv=3):
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((B, Tq, H, D), (B, T, Hk, D), (B, T, Hk, Dv)))
    E, F = (rng.standard_normal((S, T)).astype(dtype) / 3 for _ in range(2))
    return q, k, v, E, F


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", [dict(), dict(S=1), dict(T=1, S=3), dict(Tq=1, H=3, Hk=1), dict(S=40, T=33)],
                         ids=["base", "S1", "T1", "mqa", "S>T"])
def test_linformer_against_oracle(rng, dtype, shape):
    args = linformer_inputs(rng, dtype, **shape)
    o = pyattn.linformer_attention(*args)
    assert o.dtype == dtype
    assert_close(o, reference.linformer_attention(*args))
    assert_close(pyattn.linformer_attention(*args, scale=0.2), reference.linformer_attention(*args, scale=0.2))


def test_linformer_identity_projection_is_full_attention(rng):
    """E = F = I (S = T): attention over the keys themselves, non-causal."""
    q, k, v, _, _ = linformer_inputs(rng, np.float64, S=9)
    eye = np.eye(9)
    assert_close(pyattn.linformer_attention(q, k, v, eye, eye), pyattn.softmax_attention(q, k, v))


@pytest.mark.parametrize("shape", [dict(B=1, Tq=3, T=5, S=2, H=2, Hk=1, D=3, Dv=2), dict(B=2, Tq=2, T=4, S=3, H=2, Hk=2, D=2, Dv=2)])
def test_linformer_gradcheck(rng, shape):
    gradcheck(pyattn.linformer_attention, linformer_inputs(rng, np.float64, **shape))


def test_linformer_float32_gradients(rng):
    args = linformer_inputs(rng, np.float32)
    do = rng.standard_normal((2, 7, 4, 3)).astype(np.float32)
    g32 = pyattn.vjp(pyattn.linformer_attention, *args)[1](do)
    g64 = pyattn.vjp(pyattn.linformer_attention, *(a.astype(np.float64) for a in args))[1](do.astype(np.float64))
    for name in ("q", "k", "v", "E", "F"):
        assert_close(g32[name], g64[name], 1e-4, name=f"d{name}")


def test_linformer_bad_input(rng):
    q, k, v, E, F = linformer_inputs(rng, np.float64)
    raises(ValueError, pyattn.linformer_attention, q, k, v, E[:, :8], F, must=["key lengths", "E's columns"])
    raises(ValueError, pyattn.linformer_attention, q, k, v, E, F[:3], must=["'F' must have shape"])
    raises(ValueError, pyattn.linformer_attention, q, k, v, E[0], F, must=["'E' must be 2-D"])
    raises(TypeError, pyattn.linformer_attention, q, k, v, E.astype(np.float32), F, must=["one dtype"])


# --------------------------------------------------------------------------- nsa

F32_GRAD = TOLERANCES[np.dtype(np.float32)][1]  # float32 gradients against float64 ones


def nsa_inputs(rng, B=2, T=23, H=4, Hk=2, D=5, Dv=3, Tq=None):
    """float64 q, k, v and the gates g_cmp, g_slc, g_swa (in (0, 1), as a layer's sigmoids),
    float32-representable: one float64 oracle serves both dtypes."""
    Tq = T if Tq is None else Tq
    q, k, v = (f32_exact(rng.standard_normal(s)) for s in ((B, Tq, H, D), (B, T, Hk, D), (B, T, Hk, Dv)))
    return [q, k, v] + [f32_exact(rng.uniform(0, 1, (B, Tq, H))) for _ in range(3)]


def n_blocks(T, bs, cu=None):
    """Blocks of one batch row: ceil(T / bs), or the sequences' blocks one after another."""
    if cu is None:
        return -(-T // bs)
    return sum(-(-(int(e) - int(s)) // bs) for s, e in zip(cu[:-1], cu[1:]))


def cmp_rows(rng, B, nb, Hk, D, Dv):
    """Random k_cmp [B, nb, Hk, D], v_cmp [B, nb, Hk, Dv]."""
    return (f32_exact(rng.standard_normal((B, nb, Hk, D))), f32_exact(rng.standard_normal((B, nb, Hk, Dv))))


def block_means(x, bs, cu=None):
    """[B, blocks, Hk, D]: the mean of x's rows over each block of bs (restarting at each
    sequence of cu; the last block of a sequence may be shorter)."""
    bounds = [(0, x.shape[1])] if cu is None else list(zip(cu[:-1], cu[1:]))
    return np.stack([x[:, j:min(j + bs, e)].mean(axis=1) for s, e in bounds for j in range(s, e, bs)], axis=1)


NSA_CASES = {  # name: (B, T, block_size, block_count, window)
    "ragged": (2, 23, 4, 3, 5),
    "even": (2, 24, 4, 3, 5),
    "T1": (2, 1, 4, 3, 5),
    "count1": (2, 17, 4, 1, 5),
    "count_gt_blocks": (2, 17, 4, 10, 5),
    "window1": (2, 17, 4, 3, 1),
    "window_eq_T": (2, 17, 4, 3, 17),
    "window_gt_T": (2, 17, 4, 3, 40),
    "no_complete_block": (2, 9, 16, 3, 5),
    "bs1": (2, 20, 1, 4, 3),
    "B1": (1, 30, 4, 3, 6),
}


@pytest.mark.parametrize("H,Hk", [(4, 2), (4, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("case", NSA_CASES.values(), ids=NSA_CASES.keys())
def test_nsa_against_oracle(rng, case, H, Hk):
    """float64 and float32 calls against the float64 oracle (Dk = 5 != Dv = 3)."""
    B, T, bs, count, window = case
    args = nsa_inputs(rng, B=B, T=T, H=H, Hk=Hk)
    kw = dict(block_size=bs, block_count=count, window=window)
    ref = reference.nsa_attention(*args, **kw)
    for dtype in (np.float64, np.float32):
        o = pyattn.nsa_attention(*(x.astype(dtype) for x in args), **kw)
        assert o.dtype == dtype and o.shape == (B, T, H, 3)
        assert_close(o, ref, name=np.dtype(dtype).name)


@pytest.mark.parametrize("H,Hk", [(4, 2), (2, 2), (4, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("T,cu", [(1, None), (3, None), (4, None), (3, [0, 0, 3])],
                         ids=["T1", "T3", "T4", "varlen"])
def test_nsa_one_block_in_all(rng, T, cu, H, Hk):
    """B = 1 and every key in one block (T <= block_size = 4): the call has a single block."""
    args = nsa_inputs(rng, B=1, T=T, H=H, Hk=Hk)
    kw = dict(block_size=4, block_count=2, window=2, cu_seqlens=None if cu is None else np.array(cu))
    ref = reference.nsa_attention(*args, **kw)
    for dtype in (np.float64, np.float32):
        assert_close(pyattn.nsa_attention(*(x.astype(dtype) for x in args), **kw), ref, name=np.dtype(dtype).name)


def test_nsa_scale(rng):
    args = nsa_inputs(rng, B=2, T=15)
    kw = dict(block_size=3, block_count=2, window=4, scale=0.3)
    assert_close(pyattn.nsa_attention(*args, **kw), reference.nsa_attention(*args, **kw))


@pytest.mark.parametrize("given", [False, True], ids=["means", "k_cmp"])
def test_nsa_varlen_against_oracle(rng, given):
    """Packed sequences (one empty, one of a single row) restart their blocks."""
    cu = np.array([0, 7, 7, 20, 21, 30])
    args = nsa_inputs(rng, B=1, T=30)
    kw = dict(block_size=4, block_count=3, window=5, cu_seqlens=cu)
    if given:
        kw["k_cmp"], kw["v_cmp"] = cmp_rows(rng, 1, n_blocks(30, 4, cu), 2, 5, 3)
    ref = reference.nsa_attention(*args, **kw)
    for dtype in (np.float64, np.float32):
        kwd = {n: (x.astype(dtype) if n in ("k_cmp", "v_cmp") else x) for n, x in kw.items()}
        o = pyattn.nsa_attention(*(x.astype(dtype) for x in args), **kwd)
        assert_close(o, ref, name=np.dtype(dtype).name)


@pytest.mark.parametrize("given", [False, True], ids=["means", "k_cmp"])
def test_nsa_varlen_equals_batch(rng, given):
    """Two batch rows give the same outputs as the same rows packed by cu_seqlens."""
    B, T = 2, 13
    args = nsa_inputs(rng, B=B, T=T)
    kw = dict(block_size=4, block_count=2, window=3)
    packed_kw = dict(kw, cu_seqlens=np.array([0, T, 2 * T]))
    if given:
        kw["k_cmp"], kw["v_cmp"] = cmp_rows(rng, B, n_blocks(T, 4), 2, 5, 3)
        packed_kw["k_cmp"], packed_kw["v_cmp"] = (x.reshape((1, -1) + x.shape[2:]) for x in (kw["k_cmp"], kw["v_cmp"]))
    o = pyattn.nsa_attention(*args, **kw)
    packed = pyattn.nsa_attention(*(x.reshape((1, B * T) + x.shape[2:]) for x in args), **packed_kw)
    assert_close(packed, o.reshape(packed.shape))


@pytest.mark.parametrize("given", [False, True], ids=["means", "k_cmp"])
@pytest.mark.parametrize("Tq", [1, 5, 13])
def test_nsa_last_queries(rng, Tq, given):
    """Queries that are the last Tq positions (decoding): the same rows of the oracle over all
    positions (whose rows depend on their own query and gates only)."""
    T = 13
    q, k, v, *g = nsa_inputs(rng, B=2, T=T)
    kw = dict(block_size=4, block_count=2, window=3)
    if given:
        kw["k_cmp"], kw["v_cmp"] = cmp_rows(rng, 2, n_blocks(T, 4), 2, 5, 3)
    ref = reference.nsa_attention(q, k, v, *g, **kw)[:, T - Tq:]
    last = [x[:, T - Tq:] for x in [q] + g]
    for dtype in (np.float64, np.float32):
        kwd = {n: x.astype(dtype) for n, x in kw.items() if n in ("k_cmp", "v_cmp")}
        args = [last[0], k, v] + last[1:]
        o = pyattn.nsa_attention(*(x.astype(dtype) for x in args), **dict(kw, **kwd))
        assert o.shape == (2, Tq, 4, 3)
        assert_close(o, ref, name=np.dtype(dtype).name)


def test_nsa_k_cmp_given(rng):
    """Given rows k_cmp, v_cmp against the oracle; the block means given explicitly are the
    default call (the last block of 13 rows holds one)."""
    args = nsa_inputs(rng, B=2, T=13)
    kw = dict(block_size=4, block_count=2, window=3)
    kc, vc = cmp_rows(rng, 2, 4, 2, 5, 3)
    ref = reference.nsa_attention(*args, k_cmp=kc, v_cmp=vc, **kw)
    for dtype in (np.float64, np.float32):
        o = pyattn.nsa_attention(*(x.astype(dtype) for x in args), k_cmp=kc.astype(dtype), v_cmp=vc.astype(dtype), **kw)
        assert_close(o, ref, name=np.dtype(dtype).name)
    means = pyattn.nsa_attention(*args, k_cmp=block_means(args[1], 4), v_cmp=block_means(args[2], 4), **kw)
    assert_close(means, pyattn.nsa_attention(*args, **kw))


def _one_gate(q, name):
    """Gates with `name` all 1, the others 0."""
    return [np.full(q.shape[:3], float(n == name), q.dtype) for n in ("g_cmp", "g_slc", "g_swa")]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("branch", ["g_cmp", "g_slc", "g_swa"])
def test_nsa_branch_alone_is_causal_attention(rng, dtype, branch):
    """One gate 1, the others 0, and that branch seeing every past key: the window with
    window >= T, the selection with block_count >= the blocks, the compressed branch with
    block_size 1 and k_cmp, v_cmp = k, v. Outputs and gradients are causal softmax
    attention's; the other branches pass no gradient into k, v (and the compressed rows get
    softmax's dk, dv)."""
    q, k, v = nsa_inputs(rng, B=2, T=21)[:3]
    kw = {"g_swa": dict(block_size=4, block_count=2, window=21),
          "g_slc": dict(block_size=4, block_count=6, window=2),
          "g_cmp": dict(block_size=1, block_count=2, window=2, k_cmp=k, v_cmp=v)}[branch]
    do = f32_exact(rng.standard_normal((2, 21, 4, 3)))
    o_ref, pb = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True)
    ref = pb(do)
    cast = {n: (x.astype(dtype) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    qd, kd, vd = (x.astype(dtype) for x in (q, k, v))
    o, pullback = pyattn.vjp(pyattn.nsa_attention, qd, kd, vd, *_one_gate(qd, branch), **cast)
    assert_close(o, o_ref)
    g = pullback(do.astype(dtype))
    tol = F32_GRAD if dtype == np.float32 else None
    assert_close(g["q"], ref["q"], tol, name="dq")
    dk, dv = (g["k_cmp"], g["v_cmp"]) if branch == "g_cmp" else (g["k"], g["v"])
    assert_close(dk, ref["k"], tol, name="dk")
    assert_close(dv, ref["v"], tol, name="dv")
    if branch == "g_cmp":
        assert_close(g["k"], np.zeros_like(k), name="dk (other branches)")
        assert_close(g["v"], np.zeros_like(v), name="dv (other branches)")
    # the gate's own gradient: sum_d do * o_branch, here o itself
    assert_close(g[branch], np.sum(do * o_ref, axis=-1), tol, name=f"d{branch}")


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_nsa_ties_go_to_the_lower_block(dtype):
    """Blocks 0 and 2 hold the same keys and have the best (equal, exact) importance: with
    block_count = 2 a query of block 4 takes block 0 and its own block (v = I shows the keys
    attended by the selected branch alone)."""
    T, bs = 20, 4
    k = np.tile(np.array([0.0, 0.0, 1.0]), (T, 1))
    k[0:4] = k[8:12] = [2.0, 2.0, 0.0]
    k = k[None, :, None, :].astype(dtype)
    q = np.tile(np.array([1.0, 1.0, 0.0], dtype), (1, T, 2, 1))
    v = np.eye(T, dtype=dtype)[None, :, None, :]
    g = _one_gate(q, "g_slc")
    kw = dict(block_size=bs, block_count=2, window=2)
    o = pyattn.nsa_attention(q, k, v, *g, **kw)
    assert_close(o, reference.nsa_attention(q, k, v, *g, **kw))
    for t in range(16, 20):
        for h in range(2):
            assert np.array_equal(np.flatnonzero(o[0, t, h]), list(range(4)) + list(range(16, t + 1))), (t, h)


NSA_GRAD_LAYOUTS = {  # name: (nsa_inputs kwargs, cu_seqlens)
    "batch": (dict(B=2, T=7, H=2, Hk=1, D=3, Dv=2), None),
    "gqa": (dict(B=2, T=6, H=4, Hk=2, D=2, Dv=3), None),
    "varlen": (dict(B=1, T=14, H=2, Hk=1, D=3, Dv=2), [0, 3, 3, 9, 14]),
    "last_queries": (dict(B=2, T=7, Tq=3, H=2, Hk=1, D=3, Dv=2), None),
}


@pytest.mark.parametrize("given", [False, True], ids=["means", "k_cmp"])
@pytest.mark.parametrize("layout", NSA_GRAD_LAYOUTS.values(), ids=NSA_GRAD_LAYOUTS.keys())
def test_nsa_gradcheck(rng, layout, given):
    shape, cu = layout
    args = nsa_inputs(rng, **shape)
    kw = dict(block_size=2, block_count=2, window=3, cu_seqlens=None if cu is None else np.array(cu))
    if given:
        kw["k_cmp"], kw["v_cmp"] = cmp_rows(rng, shape["B"], n_blocks(shape["T"], 2, cu), shape["Hk"],
                                            shape["D"], shape["Dv"])
    errs = gradcheck(pyattn.nsa_attention, args, kw)
    want = {"q", "k", "v", "g_cmp", "g_slc", "g_swa"} | ({"k_cmp", "v_cmp"} if given else set())
    assert set(errs) == want


@pytest.mark.parametrize("given", [False, True], ids=["means", "k_cmp"])
def test_nsa_float32_gradients(rng, given):
    args = nsa_inputs(rng, B=2, T=23)
    kw = dict(block_size=4, block_count=3, window=5)
    if given:
        kw["k_cmp"], kw["v_cmp"] = cmp_rows(rng, 2, n_blocks(23, 4), 2, 5, 3)
    do = f32_exact(rng.standard_normal((2, 23, 4, 3)))
    g64 = pyattn.vjp(pyattn.nsa_attention, *args, **kw)[1](do)
    kw32 = {n: (x.astype(np.float32) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    g32 = pyattn.vjp(pyattn.nsa_attention, *(x.astype(np.float32) for x in args), **kw32)[1](do.astype(np.float32))
    assert set(g32) == set(g64) == {"q", "k", "v", "g_cmp", "g_slc", "g_swa"} | ({"k_cmp", "v_cmp"} if given else set())
    for name in g64:
        assert g32[name].dtype == np.float32 and g32[name].shape == g64[name].shape
        assert_close(g32[name], g64[name], F32_GRAD, name=f"d{name}")


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("gates", ["random", "g_cmp", "g_slc", "g_swa"])
@pytest.mark.parametrize("t", [0, 2, 13])
def test_nsa_nan_query(rng, dtype, gates, t):
    """A NaN in q at (t, head 1) makes o[t, head 1] NaN (whichever branch is gated on, and
    also before any block is complete: t = 0, 2 < block_size - 1), never a silent 0. Other
    rows are unchanged, and so are the heads of the other KV group; the other head of its
    group (which shares its block choice) stays finite."""
    q, k, v, *g = (x.astype(dtype) for x in nsa_inputs(rng, B=1, T=20))
    if gates != "random":
        g = _one_gate(q, gates)
    kw = dict(block_size=4, block_count=2, window=3)
    clean = pyattn.nsa_attention(q, k, v, *g, **kw)
    q[0, t, 1, 2] = np.nan
    o = pyattn.nsa_attention(q, k, v, *g, **kw)
    assert np.all(np.isnan(o[0, t, 1]))
    assert np.all(np.isfinite(o[0, t, 0]))
    assert np.array_equal(o[0, t, 2:], clean[0, t, 2:])
    assert np.array_equal(np.delete(o, t, axis=1), np.delete(clean, t, axis=1))


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan_query"])
@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("t", [5, 13])
def test_nsa_is_causal(rng, t, count, nan):
    """Keys and values after position t never reach the outputs of rows 0 .. t, also when a
    NaN in one query head at t (head 1) spoils the importances of its group: the other head
    of the group (head 0, finite) must still choose among past blocks only."""
    q, k, v, *g = nsa_inputs(rng, B=1, T=20)
    if nan:
        q[0, t, 1, 2] = np.nan
    kw = dict(block_size=4, block_count=count, window=3)
    o = pyattn.nsa_attention(q, k, v, *g, **kw)
    k2, v2 = k.copy(), v.copy()
    k2[0, t + 1:] = rng.standard_normal(k2[0, t + 1:].shape)
    v2[0, t + 1:] += 100
    o2 = pyattn.nsa_attention(q, k2, v2, *g, **kw)
    assert np.array_equal(o[0, :t + 1], o2[0, :t + 1], equal_nan=True)
    assert np.all(np.isfinite(o[0, t, 0]))


def test_nsa_bad_input(rng):
    q, k, v, *g = nsa_inputs(rng, B=2, T=9)
    kw = dict(block_size=4, block_count=2, window=3)
    nsa = pyattn.nsa_attention
    raises(ValueError, nsa, q, k, v, g[0][..., :2], g[1], g[2], **kw, must=["'g_cmp' must have shape (2, 9, 4)"])
    raises(ValueError, nsa, q, k, v, g[0], g[1][:, :3], g[2], **kw, must=["'g_slc' must have shape"])
    raises(ValueError, nsa, q, k, v, *g, k_cmp=np.zeros((2, 3, 2, 5)), **kw, must=["'k_cmp' and 'v_cmp'"])
    raises(ValueError, nsa, q, k, v, *g, v_cmp=np.zeros((2, 3, 2, 3)), **kw, must=["'k_cmp' and 'v_cmp'"])
    raises(ValueError, nsa, q, k, v, *g, **dict(kw, block_size=0), must=["'block_size' must be >= 1"])
    raises(ValueError, nsa, q, k, v, *g, **dict(kw, window=0), must=["'window' must be >= 1"])
    raises(ValueError, nsa, q, k, v, *g, **dict(kw, block_count=0), must=["'block_count' must be >= 1"])
    raises(ValueError, nsa, q, k, v, *g, k_cmp=np.zeros((2, 2, 2, 5)), v_cmp=np.zeros((2, 3, 2, 3)), **kw,
           must=["'k_cmp' must have shape (2, 3, 2, 5)"])
    raises(ValueError, nsa, q, k, v, *g, k_cmp=np.zeros((2, 3, 2, 5)), v_cmp=np.zeros((2, 3, 2, 5)), **kw,
           must=["'v_cmp' must have shape (2, 3, 2, 3)"])
    raises(TypeError, nsa, q, k, v, *g, k_cmp=np.zeros((2, 3, 2, 5), np.float32), v_cmp=np.zeros((2, 3, 2, 3)),
           **kw, must=["one dtype"])
    raises(TypeError, nsa, q, k, v, *g, **dict(kw, block_size=2.5), must=["'block_size'"])
    raises(ValueError, nsa, q, k[:, :5], v[:, :5], *g, **kw, must=["need Tq <= Tk, got Tq=9, Tk=5"])
    raises(ValueError, nsa, q, k, v, *g, **kw, cu_seqlens=np.array([0, 9]), must=["batch size must be 1"])


# --------------------------------------------------------------------------- dsa


def index_inputs(rng, B=2, Tq=19, Tk=None, Hi=2, Di=3):
    """float64 (float32-representable) index_q [B, Tq, Hi, Di], index_k [B, Tk, Di], index_w
    [B, Tq, Hi]."""
    Tk = Tq if Tk is None else Tk
    return [f32_exact(rng.standard_normal(s)) for s in ((B, Tq, Hi, Di), (B, Tk, Di), (B, Tq, Hi))]


def dsa_inputs(rng, B=2, T=19, H=4, Hk=2, D=5, Dv=3, Hi=2, Di=3):
    """q, k, v and the index arrays, float64 and float32-representable."""
    q, k, v = (f32_exact(rng.standard_normal(s)) for s in ((B, T, H, D), (B, T, Hk, D), (B, T, Hk, Dv)))
    return [q, k, v] + index_inputs(rng, B, T, T, Hi, Di)


def last(arrays, Tq):
    """The per-query arrays cut to their last Tq rows (index_k, k, v keep every key)."""
    return [x if i in ("k", "v", "index_k") else x[:, x.shape[1] - Tq:]
            for i, x in zip(("q", "k", "v", "index_q", "index_k", "index_w"), arrays)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("B,T,Hi,Di", [(2, 17, 3, 4), (1, 1, 2, 3), (2, 30, 1, 8)])
def test_dsa_index_scores_against_oracle(rng, dtype, B, T, Hi, Di):
    a = index_inputs(rng, B, T, T, Hi, Di)
    ref = reference.dsa_index_scores(*a)
    I = pyattn.dsa_index_scores(*(x.astype(dtype) for x in a))
    assert I.dtype == dtype and I.shape == (B, T, T)
    assert_close(I, ref)
    # queries that are the last rows: the same rows of the scores (Tq < Tk)
    assert_close(pyattn.dsa_index_scores(a[0][:, T - 1:].astype(dtype), a[1].astype(dtype),
                                         a[2][:, T - 1:].astype(dtype)), ref[:, T - 1:])


@pytest.mark.parametrize("B,Tq,Tk", [(2, 3, 4), (1, 5, 5)])
def test_dsa_index_scores_gradcheck(rng, B, Tq, Tk):
    errs = gradcheck(pyattn.dsa_index_scores, index_inputs(rng, B, Tq, Tk, Hi=2, Di=2))
    assert set(errs) == {"index_q", "index_k", "index_w"}


def test_dsa_index_scores_float32_gradients(rng):
    a = index_inputs(rng, 2, 13, 17, Hi=3, Di=4)
    dI = f32_exact(rng.standard_normal((2, 13, 17)))
    g64 = pyattn.vjp(pyattn.dsa_index_scores, *a)[1](dI)
    g32 = pyattn.vjp(pyattn.dsa_index_scores, *(x.astype(np.float32) for x in a))[1](dI.astype(np.float32))
    for name in ("index_q", "index_k", "index_w"):
        assert g32[name].dtype == np.float32
        assert_close(g32[name], g64[name], F32_GRAD, name=f"d{name}")


DSA_LAYOUTS = {  # name: (B, T, Tq, cu_seqlens)
    "batch": (2, 19, 19, None),
    "varlen": (1, 20, 20, [0, 6, 6, 15, 20]),
    "last_queries": (2, 15, 6, None),
    "one_query": (2, 15, 1, None),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("top_k", [1, 3, 19, 25])
@pytest.mark.parametrize("layout", DSA_LAYOUTS.values(), ids=DSA_LAYOUTS.keys())
def test_dsa_select_equals_oracle(rng, layout, top_k, causal):
    """The int64 rows exactly the oracle's (Tq < Tk: the last Tq rows of the oracle over all
    positions), min(top_k, Tk) of them."""
    B, T, Tq, cu = layout
    a = index_inputs(rng, B, T, T)
    kw = dict(top_k=top_k, causal=causal, cu_seqlens=None if cu is None else np.array(cu))
    ref = reference.dsa_select(*a, **kw)[:, T - Tq:]
    for dtype in (np.float64, np.float32):
        rows = pyattn.dsa_select(a[0][:, T - Tq:].astype(dtype), a[1].astype(dtype), a[2][:, T - Tq:].astype(dtype),
                                 **kw)
        assert rows.dtype == np.int64 and rows.shape == (B, Tq, min(top_k, T))
        assert np.array_equal(rows, ref)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cu", [None, [0, 4, 4, 11]], ids=["batch", "varlen"])
def test_dsa_select_every_key_pads(rng, cu, causal):
    """top_k >= the keys: every visible key, ascending, then -1 up to Tk columns (under
    cu_seqlens the rows count from the pack's start)."""
    B, T, top_k = (2, 11, 14) if cu is None else (1, 11, 14)
    rows = pyattn.dsa_select(*index_inputs(rng, B, T, T), top_k=top_k, causal=causal,
                             cu_seqlens=None if cu is None else np.array(cu))
    bounds = [(0, T)] if cu is None else list(zip(cu[:-1], cu[1:]))
    for s, e in bounds:
        for t in range(s, e):
            keys = list(range(s, t + 1 if causal else e))
            want = np.array(keys + [-1] * (T - len(keys)))
            for b in range(B):
                assert np.array_equal(rows[b, t], want), (b, t, rows[b, t])


def _tie_index(T=10):
    """Index arrays with exact integer scores I[t, s] = relu(a_s) + relu(b_s) (index_q rows
    the unit vectors, index_w ones): 0, 3, 1, 3, 3, 1, 3, 5, 3, 3 over s."""
    ik = np.array([[0, 0], [2, 1], [1, 0], [3, 0], [1, 2], [0, 1], [-1, 3], [5, -2], [2, 1], [1, 2]], float)[:T]
    iq = np.tile(np.eye(2), (1, T, 1, 1))
    return iq, ik[None], np.ones((1, T, 2))


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_dsa_select_ties_go_to_the_lower_key(dtype):
    """Equal scores: the lower key wins. Keys 1, 3, 4, 6, 8, 9 tie at 3 behind key 7 (5)."""
    a = [x.astype(dtype) for x in _tie_index()]
    assert np.array_equal(pyattn.dsa_index_scores(*a)[0, 0], [0, 3, 1, 3, 3, 1, 3, 5, 3, 3])
    full = pyattn.dsa_select(*a, top_k=3, causal=False)
    assert np.array_equal(full[0, 9], [1, 3, 7]) and np.array_equal(full[0, 0], [1, 3, 7])
    causal = pyattn.dsa_select(*a, top_k=3, causal=True)
    assert np.array_equal(causal[0, 9], [1, 3, 7])
    assert np.array_equal(causal[0, 6], [1, 3, 4])    # 1, 3, 4, 6 tie at 3
    assert np.array_equal(causal[0, 2], [0, 1, 2])    # every visible key
    assert np.array_equal(pyattn.dsa_select(*a, top_k=1, causal=True)[0, :, 0], [0, 1, 1, 1, 1, 1, 1, 7, 7, 7])
    for top_k in (1, 2, 3, 4, 6):
        for c in (True, False):
            assert np.array_equal(pyattn.dsa_select(*a, top_k=top_k, causal=c),
                                  reference.dsa_select(*a, top_k=top_k, causal=c))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dsa_select_ties_duplicated_keys(rng, causal):
    """Small integer index arrays with duplicated index_k rows: many exact ties, each broken to
    the lower key as by the oracle; of two identical key rows the lower is never passed over
    for the higher."""
    iq = rng.integers(-2, 3, (2, 16, 2, 3)).astype(float)
    ik = rng.integers(-2, 3, (2, 16, 3)).astype(float)
    ik[:, 9], ik[:, 12], ik[:, 14] = ik[:, 2], ik[:, 2], ik[:, 5]
    iw = rng.integers(1, 3, (2, 16, 2)).astype(float)
    for top_k in (1, 2, 4, 7):
        rows = pyattn.dsa_select(iq, ik, iw, top_k=top_k, causal=causal)
        assert np.array_equal(rows, reference.dsa_select(iq, ik, iw, top_k=top_k, causal=causal))
        for b in range(2):
            for t in range(16):
                chosen = set(rows[b, t].tolist())
                for lo, hi in ((2, 9), (9, 12), (2, 12), (5, 14)):
                    assert not (hi in chosen and lo not in chosen), (top_k, b, t, lo, hi)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_dsa_attends_the_chosen_keys(dtype):
    """q = 0: every chosen key has the same weight 1 / top_k; v = I shows which (the tie
    index arrays: query 9 takes keys 1, 3, 7)."""
    T = 10
    a = [x.astype(dtype) for x in _tie_index(T)]
    q = np.zeros((1, T, 2, 3), dtype)
    k = np.ones((1, T, 1, 3), dtype)
    v = np.eye(T, dtype=dtype)[None, :, None, :]
    o = pyattn.dsa_attention(q, k, v, *a, top_k=3)
    rows = pyattn.dsa_select(*a, top_k=3)
    for t in range(T):
        want = np.zeros(T)
        keys = rows[0, t][rows[0, t] >= 0]
        want[keys] = 1 / len(keys)
        for h in range(2):
            assert_close(o[0, t, h], want, name=f"o[{t}, {h}]")
    assert np.array_equal(np.flatnonzero(o[0, 9, 0]), [1, 3, 7])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("H,Hk", [(4, 2), (4, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("layout", DSA_LAYOUTS.values(), ids=DSA_LAYOUTS.keys())
def test_dsa_attention_against_oracle(rng, layout, H, Hk, causal):
    B, T, Tq, cu = layout
    args = dsa_inputs(rng, B=B, T=T, H=H, Hk=Hk)
    kw = dict(top_k=4, causal=causal, cu_seqlens=None if cu is None else np.array(cu))
    ref = reference.dsa_attention(*args, **kw)[:, T - Tq:]
    for dtype in (np.float64, np.float32):
        o = pyattn.dsa_attention(*(x.astype(dtype) for x in last(args, Tq)), **kw)
        assert o.dtype == dtype and o.shape == (B, Tq, H, 3)
        assert_close(o, ref, name=np.dtype(dtype).name)


def test_dsa_attention_scale(rng):
    args = dsa_inputs(rng, B=2, T=12)
    kw = dict(top_k=3, scale=0.7)
    assert_close(pyattn.dsa_attention(*args, **kw), reference.dsa_attention(*args, **kw))


DSA_GRAD_LAYOUTS = {  # name: (B, T, Tq, H, Hk, cu_seqlens)
    "batch": (2, 7, 7, 2, 1, None),
    "gqa": (2, 6, 6, 4, 2, None),
    "varlen": (1, 11, 11, 2, 1, [0, 4, 4, 11]),
    "last_queries": (2, 7, 3, 2, 1, None),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", DSA_GRAD_LAYOUTS.values(), ids=DSA_GRAD_LAYOUTS.keys())
def test_dsa_attention_gradcheck(rng, layout, causal):
    B, T, Tq, H, Hk, cu = layout
    args = last(dsa_inputs(rng, B=B, T=T, H=H, Hk=Hk, D=3, Dv=2, Hi=2, Di=2), Tq)
    gradcheck(pyattn.dsa_attention, args, dict(top_k=3, causal=causal, cu_seqlens=None if cu is None else np.array(cu)),
              wrt=["q", "k", "v"])


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_dsa_index_gradients_are_zero(rng, dtype):
    """The choice is not differentiated: the index arrays' gradients are exactly 0, of their
    shapes and dtype."""
    args = [x.astype(dtype) for x in dsa_inputs(rng, B=2, T=13)]
    o, pullback = pyattn.vjp(pyattn.dsa_attention, *args, top_k=4)
    g = pullback(rng.standard_normal(o.shape).astype(dtype))
    assert set(g) == {"q", "k", "v", "index_q", "index_k", "index_w"}
    for name, x in zip(("index_q", "index_k", "index_w"), args[3:]):
        assert g[name].shape == x.shape and g[name].dtype == dtype
        assert np.array_equal(g[name], np.zeros_like(x)), name
    for name in ("q", "k", "v"):
        assert np.all(np.isfinite(g[name])) and np.any(g[name] != 0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("Tq", [17, 5])
def test_dsa_every_key_is_softmax_attention(rng, dtype, causal, Tq):
    """top_k >= the keys chooses every visible key: softmax_attention (causal bottom-right
    or not), outputs and gradients."""
    T = 17
    args = last([x.astype(dtype) for x in dsa_inputs(rng, B=2, T=T)], Tq)
    do = f32_exact(rng.standard_normal((2, Tq, 4, 3))).astype(dtype)
    o, pb = pyattn.vjp(pyattn.dsa_attention, *args, top_k=T + 3, causal=causal)
    o_ref, pb_ref = pyattn.vjp(pyattn.softmax_attention, *args[:3], causal=causal)
    assert_close(o, o_ref)
    g, ref = pb(do), pb_ref(do)
    tol = F32_GRAD if dtype == np.float32 else None
    for name in "qkv":
        assert_close(g[name], ref[name], tol, name=f"d{name}")


def test_dsa_float32_gradients(rng):
    args = dsa_inputs(rng, B=2, T=23)
    kw = dict(top_k=5)
    do = f32_exact(rng.standard_normal((2, 23, 4, 3)))
    g64 = pyattn.vjp(pyattn.dsa_attention, *args, **kw)[1](do)
    g32 = pyattn.vjp(pyattn.dsa_attention, *(x.astype(np.float32) for x in args), **kw)[1](do.astype(np.float32))
    for name in "qkv":
        assert g32[name].dtype == np.float32
        assert_close(g32[name], g64[name], F32_GRAD, name=f"d{name}")


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", DSA_LAYOUTS.values(), ids=DSA_LAYOUTS.keys())
def test_dsa_index_target_against_oracle(rng, layout, causal, dtype):
    """Over every visible key and over dsa_select's indices: the oracle; each row a
    distribution (sums to 1) on exactly its keys, 0 elsewhere."""
    B, T, Tq, cu = layout
    q, k, _, *a = dsa_inputs(rng, B=B, T=T, H=4, Hk=2)
    cu = None if cu is None else np.array(cu)
    indices = reference.dsa_select(*a, top_k=4, causal=causal, cu_seqlens=cu)
    qd, kd = q[:, T - Tq:].astype(dtype), k.astype(dtype)
    for idx in (None, indices):
        ref = reference.dsa_index_target(q, k, causal=causal, indices=idx, cu_seqlens=cu)[:, T - Tq:]
        P = pyattn.dsa_index_target(qd, kd, causal=causal, cu_seqlens=cu,
                                    indices=None if idx is None else idx[:, T - Tq:])
        assert P.dtype == dtype and P.shape == (B, Tq, T)
        assert_close(P, ref)
        assert np.all(P >= 0)
        assert_close(P.sum(-1), np.ones((B, Tq)), name="row sums")
        # the keys of each row: visible (causal, its sequence), and among the indices
        pos = np.arange(T - Tq, T)
        seq_of = np.zeros(T, int) if cu is None else np.searchsorted(cu, np.arange(T), side="right") - 1
        keys = (seq_of[None, :] == seq_of[pos][:, None])
        if causal:
            keys &= np.arange(T)[None, :] <= pos[:, None]
        keys = np.broadcast_to(keys, P.shape).copy()
        if idx is not None:
            chosen = np.zeros((B, Tq, T + 1), bool)
            for b in range(B):
                for i in range(Tq):
                    chosen[b, i, idx[b, T - Tq + i]] = True  # -1 lands in the extra column
            keys &= chosen[..., :T]
        assert np.all(P[~keys] == 0)
        assert np.all(P[keys] > 0)


def test_dsa_index_target_no_keys(rng):
    """A query whose indices are all -1 has a row of 0; listing every visible key (as
    dsa_select does with top_k >= T) equals no indices."""
    q, k = dsa_inputs(rng, B=2, T=9)[:2]
    idx = np.tile(np.where(np.arange(9) <= np.arange(9)[:, None], np.arange(9), -1), (2, 1, 1))  # keys 0 .. t
    idx[1, 4] = -1
    P = pyattn.dsa_index_target(q, k, causal=True, indices=idx)
    assert np.array_equal(P[1, 4], np.zeros(9))
    assert_close(P, reference.dsa_index_target(q, k, causal=True, indices=idx))
    full = pyattn.dsa_index_target(q, k, causal=True)
    assert_close(np.delete(P.reshape(18, 9), 13, axis=0), np.delete(full.reshape(18, 9), 13, axis=0))
    every = np.tile(np.arange(9), (2, 9, 1))
    assert_close(pyattn.dsa_index_target(q, k, causal=False, indices=every),
                 pyattn.dsa_index_target(q, k, causal=False))


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dsa_nan(rng, dtype, causal):
    """A NaN in q at (t, h) makes o[t, h] NaN; in index_q (or index_w) at t, every head of
    query t, whose scores hold it; in index_k at key s, every query that sees s (causal: s and
    later). Never a silent 0, and the other outputs are unchanged."""
    args = [x.astype(dtype) for x in dsa_inputs(rng, B=1, T=20)]
    clean = pyattn.dsa_attention(*args, top_k=4, causal=causal)

    def with_nan(i, at):
        x = [a.copy() for a in args]
        x[i][at] = np.nan
        return pyattn.dsa_attention(*x, top_k=4, causal=causal)

    o = with_nan(0, (0, 7, 1, 0))
    assert np.all(np.isnan(o[0, 7, 1]))
    rest = np.ones(o.shape, bool)
    rest[0, 7, 1] = False
    assert np.array_equal(o[rest], clean[rest])
    for i, at in ((3, (0, 7, 1, 0)), (5, (0, 7, 1))):
        o = with_nan(i, at)
        assert np.all(np.isnan(o[0, 7]))
        assert np.array_equal(np.delete(o, 7, axis=1), np.delete(clean, 7, axis=1))
    o = with_nan(4, (0, 7, 1))
    seen = slice(7, None) if causal else slice(None)
    assert np.all(np.isnan(o[0, seen]))
    if causal:
        assert np.array_equal(o[0, :7], clean[0, :7])


def test_dsa_bad_input(rng):
    q, k, v, iq, ik, iw = dsa_inputs(rng, B=2, T=9)
    dsa = pyattn.dsa_attention
    raises(ValueError, dsa, q, k, v, iq, ik[..., :2], iw, top_k=3, must=["index dims must match", "index_k=2"])
    raises(TypeError, dsa, q, k, v, iq.astype(np.float32), ik.astype(np.float32), iw.astype(np.float32), top_k=3,
           must=["index arrays must have q's dtype float64"])
    raises(TypeError, dsa, q, k, v, iq, ik.astype(np.float32), iw, top_k=3, must=["one dtype"])
    raises(ValueError, dsa, q, k, v, iq, ik, iw, top_k=0, must=["'top_k' must be >= 1"])
    raises(TypeError, dsa, q, k, v, iq, ik, iw, top_k=2.0, must=["'top_k'"])
    raises(ValueError, dsa, q, k[:, :5], v[:, :5], iq, ik[:, :5], iw, top_k=3, must=["need Tq <= Tk, got Tq=9, Tk=5"])
    raises(ValueError, dsa, q, k, v, iq, ik, iw, top_k=3, cu_seqlens=np.array([0, 9]), must=["batch size must be 1"])
    raises(ValueError, dsa, q, k, v, iq, ik, iw[..., :1], top_k=3, must=["'index_w' must have shape (2, 9, 2)"])
    raises(ValueError, dsa, q, k, v, iq, ik[:, :5], iw, top_k=3, must=["'index_k' must have shape (2, 9, 3)"])
    raises(ValueError, pyattn.dsa_select, iq, ik, iw, top_k=0, must=["'top_k' must be >= 1"])
    raises(ValueError, pyattn.dsa_select, iq, ik[..., :2], iw, top_k=2, must=["index dims must match"])
    raises(ValueError, pyattn.dsa_select, iq, ik, iw, top_k=2, cu_seqlens=np.array([0, 9]),
           must=["batch size must be 1"])
    raises(ValueError, pyattn.dsa_index_scores, iq, ik[..., :2], iw, must=["index dims must match"])
    raises(TypeError, pyattn.dsa_index_scores, iq, ik.astype(np.float32), iw, must=["one dtype"])
    raises(ValueError, pyattn.dsa_index_target, q, k[:, :5], must=["need Tq <= Tk, got Tq=9, Tk=5"])
    raises(TypeError, pyattn.dsa_index_target, q, k, indices=np.zeros((2, 9, 3)), must=["'indices'"])


# --------------------------------------------------------------------------- softmax_decode_backward


def _decode_rows(B, T):
    """Every query row its own sequence seeing keys 0 .. i of its batch row: cu_q = arange(B T
    + 1); the keys of batch row b at rows b T .. (b + 1) T of the pool."""
    cu = np.arange(B * T + 1, dtype=np.int64)
    start = np.repeat(np.arange(B, dtype=np.int64) * T, T)
    end = start + np.tile(np.arange(1, T + 1, dtype=np.int64), B)
    return cu, start, end


def _decode(q, k, v, rows, table, scale, do, dlse):
    """softmax_decode, then softmax_decode_backward over the same keys: (o, lse, dq, dk, dv);
    q [1, R, H, Dk] and the pool k, v as given."""
    opts = (False, -1, -1, 0, None, 0.0, scale)
    o = np.empty(q.shape[:3] + (v.shape[3],), q.dtype)
    lse = np.empty(q.shape[:3], q.dtype)
    _core.softmax_decode(q, k, v, o, lse, *rows, table, 0, None, *opts)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    _core.softmax_decode_backward(q, k, v, o, lse, do, dlse, dq, dk, dv, *rows, table, *opts)
    return o, lse, dq, dk, dv


def _paged(x, R, perm):
    """x [T, Hk, D] as a pool of blocks of R rows [len(perm), R, Hk, D]: key j in block
    perm[j // R] at row j % R; the last block of perm is left out (random rows, never read)."""
    T = x.shape[0]
    n = -(-T // R)
    pool = np.random.default_rng(7).standard_normal((len(perm), R) + x.shape[1:]).astype(x.dtype)
    padded = np.zeros((n * R,) + x.shape[1:], x.dtype)
    padded[:T] = x
    pool[perm[:n]] = padded.reshape((n, R) + x.shape[1:])
    return pool


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("with_dlse", [True, False], ids=["dlse", "no_dlse"])
@pytest.mark.parametrize("B", [1, 2])
def test_decode_backward_is_causal_flash_backward(rng, dtype, with_dlse, B):
    """Query row i of batch row b seeing keys 0 .. i of b (start = b T): the decode forward is
    causal softmax_attention's (o, lse), and its backward the flash backward with the same do
    and dlse (GQA, Dk != Dv)."""
    T, H, Hk, D, Dv = 37, 4, 2, 6, 5
    q, k, v = (f32_exact(rng.standard_normal(s)) for s in ((B, T, H, D), (B, T, Hk, D), (B, T, Hk, Dv)))
    do = f32_exact(rng.standard_normal((B, T, H, Dv)))
    dlse = f32_exact(rng.standard_normal((B, T, H))) if with_dlse else None
    (o_ref, lse_ref), pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True, return_lse=True)
    ref = pullback((do, dlse))
    cast = [None if x is None else x.astype(dtype) for x in (q, k, v, do, dlse)]
    q1 = cast[0].reshape(1, B * T, H, D)
    do1 = cast[3].reshape(1, B * T, H, Dv)
    dlse1 = None if dlse is None else cast[4].reshape(1, B * T, H)
    o, lse, dq, dk, dv = _decode(q1, cast[1], cast[2], _decode_rows(B, T), None, D ** -0.5, do1, dlse1)
    tol = F32_GRAD if dtype == np.float32 else None
    assert_close(o.reshape(o_ref.shape), o_ref, name="o")
    assert_close(lse.reshape(lse_ref.shape), lse_ref, name="lse")
    assert dk.shape == k.shape and dv.shape == v.shape
    assert_close(dq.reshape(q.shape), ref["q"], tol, name="dq")
    assert_close(dk, ref["k"], tol, name="dk")
    assert_close(dv, ref["v"], tol, name="dv")


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("R", [1, 4])
def test_decode_backward_paged(rng, dtype, R):
    """The same keys through a shuffled block table (blocks of R rows; T = 37 leaves the last
    block short for R = 4) and a pool with an extra block no query reads: the gradients,
    unshuffled, are the flash backward's, and the unread rows (the extra block, the padding of
    the last one) get exactly 0."""
    T, H, Hk, D, Dv = 37, 4, 2, 6, 5
    q, k, v = (f32_exact(rng.standard_normal(s)) for s in ((1, T, H, D), (1, T, Hk, D), (1, T, Hk, Dv)))
    do, dlse = f32_exact(rng.standard_normal((1, T, H, Dv))), f32_exact(rng.standard_normal((1, T, H)))
    (o_ref, _), pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True, return_lse=True)
    ref = pullback((do, dlse))
    n = -(-T // R)
    perm = rng.permutation(n + 1)
    kp, vp = (_paged(x[0].astype(dtype), R, perm) for x in (k, v))
    table = np.tile(perm[:n].astype(np.int32), (T, 1))
    o, _, dq, dkp, dvp = _decode(q.astype(dtype), kp, vp, _decode_rows(1, T), table, D ** -0.5,
                                 do.astype(dtype), dlse.astype(dtype))
    tol = F32_GRAD if dtype == np.float32 else None
    assert_close(o, o_ref, name="o")
    assert_close(dq, ref["q"], tol, name="dq")
    assert dkp.shape == kp.shape and dvp.shape == vp.shape
    for got, want, name in ((dkp, ref["k"], "dk"), (dvp, ref["v"], "dv")):
        rows = got[perm[:n]].reshape((n * R,) + got.shape[2:])
        assert_close(rows[:T], want[0], tol, name=name)
        assert np.all(rows[T:] == 0), f"{name}: padding rows"
        assert np.all(got[perm[n]] == 0), f"{name}: the unread block"


def test_decode_backward_threads(rng):
    """One thread and two give the same gradients to 1e-12 (dK, dV are summed over per-thread
    buffers in another order), and two threads the same bits run after run. The work (T = 160,
    H = 4, Dk + Dv = 32) is well above the kernel's one-thread threshold."""
    T, H, Hk, D, Dv = 160, 4, 2, 16, 16
    q, k, v = (rng.standard_normal(s) for s in ((1, T, H, D), (1, T, Hk, D), (1, T, Hk, Dv)))
    do, dlse = rng.standard_normal((1, T, H, Dv)), rng.standard_normal((1, T, H))
    rows = _decode_rows(1, T)
    with pyattn.num_threads(1):
        one = _decode(q, k, v, rows, None, D ** -0.5, do, dlse)[2:]
    with pyattn.num_threads(2):
        two = _decode(q, k, v, rows, None, D ** -0.5, do, dlse)[2:]
        again = _decode(q, k, v, rows, None, D ** -0.5, do, dlse)[2:]
    for a, b, c, name in zip(one, two, again, ("dq", "dk", "dv")):
        assert_close(b, a, 1e-12, name=name)
        assert np.array_equal(b, c), name


def test_decode_backward_bad_input(rng):
    """softcap (and ALiBi) are refused, and so are gradient buffers of the wrong shape, dtype
    or writeability, and key rows outside the cache: ValueError / TypeError, never a crash."""
    T, H, Hk, D, Dv = 9, 2, 1, 4, 3
    q, k, v = (rng.standard_normal(s) for s in ((1, T, H, D), (1, T, Hk, D), (1, T, Hk, Dv)))
    do, dlse = rng.standard_normal((1, T, H, Dv)), rng.standard_normal((1, T, H))
    cu, start, end = _decode_rows(1, T)
    o, lse = _decode(q, k, v, (cu, start, end), None, 0.5, do, dlse)[:2]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)

    def call(dq=dq, dk=dk, dv=dv, end=end, softcap=0.0, alibi=None):
        _core.softmax_decode_backward(q, k, v, o, lse, do, dlse, dq, dk, dv, cu, start, end, None,
                                      False, -1, -1, 0, alibi, softcap, 0.5)

    raises(ValueError, call, softcap=5.0, must=["softcap"])
    raises(ValueError, call, alibi=np.ones(H), must=["alibi_slopes"])
    raises(ValueError, call, dq=np.zeros((1, 5, H, D)), must=["'dq' must have shape (1, 9, 2, 4)"])
    raises(ValueError, call, dq=np.zeros((1, T, H, D + 1)), must=["'dq' must have shape"])
    raises(ValueError, call, dk=np.zeros((1, 5, Hk, D)), must=["'dk' must have shape"])
    raises(TypeError, call, dq=np.zeros_like(q, np.float32), must=["'dq' must have dtype float64"])
    raises(ValueError, call, dq=np.broadcast_to(dq, dq.shape), must=["'dq' must be writeable"])
    raises(ValueError, call, end=end + 1, must=["outside the cache"])
    raises(TypeError, _core.softmax_decode_backward, q, k, v, must=["21 positional arguments"])
    call()  # the same buffers pass
    assert np.all(np.isfinite(dq)) and np.any(dq != 0)


def test_dsa_index_target_keeps_only_visible_listed_keys(rng):
    """Indices that list keys a causal query cannot see (here every key) give the target over
    the visible ones: the same as no indices, and as the oracle."""
    q, k = rng.standard_normal((1, 6, 2, 3)), rng.standard_normal((1, 6, 1, 3))
    every = np.broadcast_to(np.arange(6), (1, 6, 6)).copy()
    P = pyattn.dsa_index_target(q, k, indices=every)
    assert_close(P, pyattn.dsa_index_target(q, k))
    assert_close(P, pyattn.reference.dsa_index_target(q, k, indices=every))
    assert np.all(np.triu(P[0], 1) == 0)


def _literal_blocks(q, k, v, choice, cu, bs, scale, causal):
    """Each (row, head) attends to the whole blocks it lists and, causal, to its own block up
    to itself: o and lse, literally."""
    R, H, _ = q.shape
    G = H // k.shape[1]
    o, lse = np.zeros((R, H, v.shape[2])), np.full((R, H), -np.inf)
    for n in range(len(cu) - 1):
        for r in range(cu[n], cu[n + 1]):
            for h in range(H):
                keys = [x for j in choice[r, h] if j >= 0
                        for x in range(cu[n] + j * bs, min(cu[n] + (j + 1) * bs, cu[n + 1]))]
                if causal:
                    keys += list(range(cu[n] + (r - cu[n]) // bs * bs, r + 1))
                if keys:
                    s = scale * k[keys, h // G] @ q[r, h]
                    p = np.exp(s - s.max())
                    o[r, h] = p @ v[keys, h // G] / p.sum()
                    lse[r, h] = s.max() + np.log(p.sum())
    return o, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cu, H, Hk, bs", [([0, 23], 4, 2, 5), ([0, 9, 9, 26], 2, 1, 4)])
def test_moba_block_kernel(rng, cu, H, Hk, bs, causal):
    """_core.moba_forward against the literal block attention (rows choosing no block and not
    causal: 0 and -inf), and moba_backward against central differences of sum(o do) +
    sum(lse dlse)."""
    cu = np.array(cu, np.int64)
    T, D, Dv, S = cu[-1], 4, 3, 2
    q, k, v = rng.standard_normal((T, H, D)), rng.standard_normal((T, Hk, D)), rng.standard_normal((T, Hk, Dv))
    choice = np.full((T, H, S), -1, np.int32)
    for n in range(len(cu) - 1):
        nb = -(-(cu[n + 1] - cu[n]) // bs)
        for r in range(cu[n], cu[n + 1]):
            for h in range(H):
                c = rng.permutation((r - cu[n]) // bs if causal else nb)[:rng.integers(0, S + 1)]
                choice[r, h, :len(c)] = c
    scale = D ** -0.5

    def run():
        o, lse = np.empty((T, H, Dv)), np.empty((T, H))
        _core.moba_forward(q, k, v, choice, cu, cu, bs, causal, scale, o, lse)
        return o, lse

    o, lse = run()
    ro, rl = _literal_blocks(q, k, v, choice, cu, bs, scale, causal)
    assert_close(o, ro)
    assert_close(lse, rl)
    do, dlse = rng.standard_normal(o.shape), rng.standard_normal(lse.shape)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    _core.moba_backward(q, k, v, o, lse, do, dlse, choice, cu, cu, bs, causal, scale, dq, dk, dv)

    def loss():
        oo, ll = run()
        return np.sum(oo * do) + np.sum(np.where(np.isinf(ll), 0, ll) * dlse)

    for x, g in ((q, dq), (k, dk), (v, dv)):
        np.testing.assert_allclose(g, finite_differences(loss, x), rtol=1e-5, atol=1e-8)


def test_moba_block_kernel_checks_choice(rng):
    q, k, v = rng.standard_normal((8, 2, 4)), rng.standard_normal((8, 1, 4)), rng.standard_normal((8, 1, 4))
    cu = np.array([0, 8], np.int64)
    choice = np.zeros((8, 2, 1), np.int32)
    choice[3, 1, 0] = 2  # blocks of 4: the sequence has 2
    o, lse = np.empty((8, 2, 4)), np.empty((8, 2))
    with pytest.raises(ValueError, match="'choice' holds block 2 for a query of sequence 0, which may "
                                         "choose blocks below 2"):
        _core.moba_forward(q, k, v, choice, cu, cu, 4, False, 0.5, o, lse)
    choice[:] = -1
    choice[5, 0, 0] = 1  # causal: row 5 lies in block 1, its own
    with pytest.raises(ValueError, match="'choice' holds block 1 for a query of sequence 0, which may "
                                         "choose blocks below 1"):
        _core.moba_forward(q, k, v, choice, cu, cu, 4, True, 0.5, o, lse)
    two = np.full((8, 2, 2), -1, np.int32)
    two[6, 1] = [1, 1]  # not causal: a block listed twice for one (query, head) would count twice
    with pytest.raises(ValueError, match="'choice' lists block 1 twice for one \\(query, head\\)"):
        _core.moba_forward(q, k, v, two, cu, cu, 4, False, 0.5, o, lse)
    two[6, 1] = [1, 0]
    _core.moba_forward(q, k, v, two, cu, cu, 4, False, 0.5, o, lse)


@pytest.mark.parametrize("H, Hk, D, nk", [(8, 1, 32, 37), (8, 2, 16, 64), (4, 1, 64, 9)])
def test_decode_scores_four_by_four(rng, H, Hk, D, nk):
    """Shapes where float32 AVX-512 scores four keys by four heads at a time (G a multiple of 4,
    D a multiple of 16, short rows), with key counts not a multiple of 4: attention over a
    KV cache and DSA (forward and gradients) within float32 accuracy of float64."""
    q = rng.standard_normal((2, 1, H, D))
    kc, vc = rng.standard_normal((2, nk, Hk, D)), rng.standard_normal((2, nk, Hk, D))
    lens = np.array([nk, nk - 3])
    o64 = pyattn.attention_with_kvcache(q, kc.copy(), vc.copy(), lens)
    o32 = pyattn.attention_with_kvcache(*(x.astype(np.float32) for x in (q, kc, vc)), lens)
    assert_close(o32, o64, TOLERANCES[np.dtype(np.float32)][0])
    T = nk
    args = [f32_exact(rng.standard_normal(s)) for s in ((1, T, H, D), (1, T, Hk, D), (1, T, Hk, D), (1, T, 2, 4),
                                                        (1, T, 4), (1, T, 2))]
    kw = dict(top_k=max(T // 3, 1))
    o, pb = pyattn.vjp(pyattn.dsa_attention, *args, **kw)
    o32, pb32 = pyattn.vjp(pyattn.dsa_attention, *(a.astype(np.float32) for a in args), **kw)
    assert_close(o32, o, TOLERANCES[np.dtype(np.float32)][0])
    do = rng.standard_normal(o.shape)
    g, g32 = pb(do), pb32(do.astype(np.float32))
    for name in ("q", "k", "v"):
        assert_close(g32[name], g[name], TOLERANCES[np.dtype(np.float32)][1], name=name)


def test_nsa_selection_in_slabs(rng, monkeypatch):
    """The block importances computed a few queries at a time (slabs of 3 rows, across
    sequence ends) choose what the oracle chooses."""
    from pyattn import sparse
    monkeypatch.setattr(sparse, "_SELECT_ROWS", 3)
    q, k, v = rng.standard_normal((1, 23, 4, 4)), rng.standard_normal((1, 23, 2, 4)), rng.standard_normal((1, 23, 2, 3))
    g = [rng.uniform(0, 1, (1, 23, 4)) for _ in range(3)]
    kw = dict(block_size=3, block_count=3, window=2, cu_seqlens=np.array([0, 10, 23]))
    assert_close(pyattn.nsa_attention(q, k, v, *g, **kw), reference.nsa_attention(q, k, v, *g, **kw))


def test_moba_own_block_keeps_nan_to_who_sees_it(rng):
    """Inside the causal own block a masked pair is an exact 0 in the kernel's GEMMs; a NaN
    there reaches only the queries (keys) that see it. A NaN key and value at the last
    position: every earlier query's output and dq are those of a finite input. A NaN query
    at the first position of a block: the later keys of that block keep finite dk and dv."""
    T, bs = 12, 4
    q, k, v, do = (rng.standard_normal((1, T, 2, 3)) for _ in range(4))
    opts = dict(block_size=bs, top_k=2)
    o, pb = pyattn.vjp(pyattn.moba_attention, q, k, v, **opts)
    g = pb(do)
    kn, vn = k.copy(), v.copy()
    kn[0, T - 1], vn[0, T - 1] = np.nan, np.nan
    on, pbn = pyattn.vjp(pyattn.moba_attention, q, kn, vn, **opts)
    gn = pbn(do)
    assert np.all(np.isnan(on[0, T - 1]))
    assert_close(on[:, :T - 1], o[:, :T - 1])
    assert_close(on[:, :T - 1], pyattn.reference.moba_attention(q, kn, vn, **opts)[:, :T - 1])
    assert_close(gn["q"][:, :T - 1], g["q"][:, :T - 1])
    qn = q.copy()
    qn[0, 8] = np.nan  # block 2 is keys 8..11: only key 8 is visible to query 8
    gq = pyattn.vjp(pyattn.moba_attention, qn, k, v, **opts)[1](do)
    assert np.all(np.isfinite(gq["k"][0, 9:])) and np.all(np.isfinite(gq["v"][0, 9:]))
    assert np.all(np.isnan(gq["k"][0, 8]))


@pytest.mark.parametrize("H, Hk", [(1, 1), (4, 2)])
def test_moba_blocks_wider_than_a_kernel_tile(rng, H, Hk):
    """Blocks of 650 keys: an own block's queries and a past block's choosers (650 rows each)
    span more than one 512-row GEMM of the kernel; forward and gradients against the oracle
    and float64 finite differences of the op. The backward's dQ goes through per-thread
    buffers with fewer KV heads than threads, and is owned per KV head otherwise: then 1
    and 2 threads give the same bits."""
    T, bs = 1300, 650
    q = rng.standard_normal((1, T, H, 4))
    k, v = (rng.standard_normal((1, T, Hk, 4)) for _ in range(2))
    opts = dict(block_size=bs, top_k=2)
    o, pb = pyattn.vjp(pyattn.moba_attention, q, k, v, **opts)
    assert_close(o, pyattn.reference.moba_attention(q, k, v, **opts))
    do = rng.standard_normal(o.shape)
    with pyattn.num_threads(2):
        g = pb(do)
    with pyattn.num_threads(1):
        g1 = pb(do)
    for name in g:
        assert_close(g1[name], g[name])
        assert Hk < 2 or np.array_equal(g1[name], g[name]), name
    for name, x in (("q", q), ("k", k), ("v", v)) * 3:
        i = (0, int(rng.integers(0, T)), 0, int(rng.integers(0, 4)))
        old = x[i]
        x[i] = old + 1e-6
        up = np.sum(pyattn.moba_attention(q, k, v, **opts) * do)
        x[i] = old - 1e-6
        down = np.sum(pyattn.moba_attention(q, k, v, **opts) * do)
        x[i] = old
        fd = (up - down) / 2e-6
        assert abs(fd - g[name][i]) <= 1e-7 + 1e-5 * abs(fd), (name, i, fd, g[name][i])


@pytest.mark.parametrize("causal", [False, True])
def test_moba_select_is_a_stable_sort(rng, causal):
    """_core.moba_select against a stable argsort of -q.mean(k_block) (causal: blocks at and
    after the query's own as +inf, dropped after the sort; non-causal: the own block first,
    then the others in that order; NaN scores last), with NaN and tied scores present, GQA,
    two sequences and fewer queries than keys."""
    H, Hk, D, bs, slots = 4, 2, 3, 4, 3
    cu_q, cu_k = np.array([0, 9, 20], np.int64), np.array([0, 13, 30], np.int64)
    q = rng.standard_normal((20, H, D))
    q[3, 1] = np.nan
    q[12, 2] = 0  # every score 0: ties
    nb = [-(-int(n) // bs) for n in np.diff(cu_k)]
    km = rng.standard_normal((sum(nb), Hk, D))
    km[1, 0, 0] = np.nan
    choice = np.empty((20, H, slots), np.int32)
    _core.moba_select(q, km, cu_q, cu_k, bs, causal, slots, choice)
    first = np.concatenate(([0], np.cumsum(nb)))
    for n in range(2):
        lag = (cu_k[n + 1] - cu_k[n]) - (cu_q[n + 1] - cu_q[n])
        for r in range(cu_q[n], cu_q[n + 1]):
            own = (r - cu_q[n] + lag) // bs
            for h in range(H):
                with np.errstate(invalid="ignore"):
                    x = -(km[first[n]:first[n + 1], h // (H // Hk)] @ q[r, h])
                if causal:
                    x[own:] = np.inf
                    order = [j for j in np.argsort(x, kind="stable")[:slots] if j < own]
                else:
                    order = [own] + [j for j in np.argsort(x, kind="stable") if j != own][:slots - 1]
                assert list(choice[r, h]) == order + [-1] * (slots - len(order)), (r, h)


# --------------------------------------------------------------------------- sizes and empty inputs


def test_nsa_sizes_beyond_the_data(rng):
    """block_size, block_count and window far beyond the keys give the oracle's output, and
    exactly the output and gradients of the largest meaningful values (one block of T keys,
    never complete; every block; every key), and size nothing from the argument."""
    T = 13
    args = nsa_inputs(rng, T=T)
    do = rng.standard_normal((2, T, 4, 3))
    base = dict(block_size=4, block_count=2, window=3)
    for big, fit in ((dict(block_size=10 ** 9), dict(block_size=T + 1)), (dict(block_count=2 ** 40), dict(block_count=4)),
                     (dict(window=10 ** 12), dict(window=T))):
        o, pullback = pyattn.vjp(pyattn.nsa_attention, *args, **dict(base, **big))
        want, want_pullback = pyattn.vjp(pyattn.nsa_attention, *args, **dict(base, **fit))
        assert_close(o, reference.nsa_attention(*args, **dict(base, **big)))
        assert np.array_equal(o, want)
        assert np.array_equal(pyattn.nsa_attention(*args, **dict(base, **big)), want)
        g, gw = pullback(do), want_pullback(do)
        assert g.keys() == gw.keys()
        for name in g:
            assert np.array_equal(g[name], gw[name]), name


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dsa_top_k_beyond_the_keys(rng, causal):
    """top_k far beyond the keys: dsa_attention's output the oracle's, it and its gradients
    exactly top_k = Tk's; dsa_select's rows [B, Tq, Tk], top_k = Tk's and the oracle's."""
    T = 11
    args = dsa_inputs(rng, T=T)
    do = rng.standard_normal((2, T, 4, 3))
    o, pullback = pyattn.vjp(pyattn.dsa_attention, *args, top_k=10 ** 9, causal=causal)
    want, want_pullback = pyattn.vjp(pyattn.dsa_attention, *args, top_k=T, causal=causal)
    assert_close(o, reference.dsa_attention(*args, top_k=10 ** 9, causal=causal))
    assert np.array_equal(o, want)
    assert np.array_equal(pyattn.dsa_attention(*args, top_k=10 ** 9, causal=causal), want)
    g, gw = pullback(do), want_pullback(do)
    for name in g:
        assert np.array_equal(g[name], gw[name]), name
    rows = pyattn.dsa_select(*args[3:], top_k=10 ** 9, causal=causal)
    assert rows.shape == (2, T, T)
    assert np.array_equal(rows, pyattn.dsa_select(*args[3:], top_k=T, causal=causal))
    assert np.array_equal(rows, reference.dsa_select(*args[3:], top_k=10 ** 9, causal=causal))


def _empty_call(rng, op, dtype, B, Tq, Tk, cu):
    """(function, arrays, options) of one sparse op with Tq queries and Tk keys."""
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((B, Tq, 4, 6), (B, Tk, 2, 6), (B, Tk, 2, 5)))
    kw = {} if cu is None else dict(cu_seqlens=np.array(cu))
    if op == "moba":
        return pyattn.moba_attention, [q, k, v], dict(kw, block_size=4, top_k=2)
    if op == "nsa":
        gates = [rng.uniform(0, 1, (B, Tq, 4)).astype(dtype) for _ in range(3)]
        return pyattn.nsa_attention, [q, k, v] + gates, dict(kw, block_size=4, block_count=2, window=3)
    if op == "dsa":
        index = [rng.standard_normal(s).astype(dtype) for s in ((B, Tq, 2, 3), (B, Tk, 3), (B, Tq, 2))]
        return pyattn.dsa_attention, [q, k, v] + index, dict(kw, top_k=2)
    E, F = (rng.standard_normal((3, Tk)).astype(dtype) for _ in range(2))
    return pyattn.linformer_attention, [q, k, v, E, F], {}


EMPTY_LAYOUTS = {  # name: (B, Tq, Tk, cu_seqlens)
    "T0": (2, 0, 0, None),
    "Tq0": (2, 0, 5, None),
    "B0": (0, 4, 4, None),
    "varlen_empty": (1, 0, 0, [0, 0, 0]),
}


EMPTY_CASES = {f"{op}-{name}": (op, layout) for op in ("moba", "nsa", "dsa", "linformer")
               for name, layout in EMPTY_LAYOUTS.items() if op != "linformer" or layout[3] is None}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("op,layout", EMPTY_CASES.values(), ids=EMPTY_CASES.keys())
def test_empty_inputs(rng, op, layout, dtype):
    """No queries, keys or batch rows: an empty output of q's dtype, and under pyattn.vjp
    empty gradients of the inputs' shapes and dtype."""
    B, Tq, Tk, cu = layout
    fn, arrays, kw = _empty_call(rng, op, dtype, B, Tq, Tk, cu)
    o = fn(*arrays, **kw)
    assert o.shape == (B, Tq, 4, 5) and o.dtype == dtype
    out, pullback = pyattn.vjp(fn, *arrays, **kw)
    assert out.shape == o.shape and out.dtype == dtype
    grads = pullback(np.ones_like(out))
    names = list(inspect.signature(fn).parameters)[:len(arrays)]
    assert sorted(grads) == sorted(names)
    for name, x in zip(names, arrays):
        assert grads[name].shape == x.shape and grads[name].dtype == dtype, name


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_linformer_no_keys(rng, dtype):
    """T = 0 keys under Tq = 3 queries: k' = E k and v' = F v are S zero rows, so o = 0 (the
    oracle's), and every gradient is 0 or empty."""
    fn, arrays, _ = _empty_call(rng, "linformer", dtype, 2, 3, 0, None)
    o, pullback = pyattn.vjp(fn, *arrays)
    assert o.shape == (2, 3, 4, 5) and o.dtype == dtype
    assert_close(o, reference.linformer_attention(*arrays))
    assert np.array_equal(o, np.zeros_like(o))
    grads = pullback(rng.standard_normal(o.shape).astype(dtype))
    for name, x in zip("qkvEF", arrays):
        assert grads[name].shape == x.shape and grads[name].dtype == dtype
        assert np.array_equal(grads[name], np.zeros_like(x)), name


def index_loss_args(rng, layout, dtype=np.float64):
    """(q, k, index_q, index_k, index_w) of a DSA layout, queries cut to the last Tq, and its
    cu_seqlens."""
    B, T, Tq, cu = layout
    q, k, _, iq, ik, iw = last(dsa_inputs(rng, B=B, T=T, H=4, Hk=2), Tq)
    return [x.astype(dtype) for x in (q, k, iq, ik, iw)], None if cu is None else np.array(cu)


def literal_index_loss(q, k, index_q, index_k, index_w, *, top_k, causal=True, scale=None,
                       cu_seqlens=None):
    """dsa_index_loss's oracle (a loss with its gradients, not an op of OPS, so here rather
    than in pyattn.reference), from the oracles of its pieces: per (batch, query t), P =
    dsa_index_target over dsa_select's keys S, p = softmax of dsa_index_scores over S, KL(P
    || p); the loss is the mean over the queries. Queries that are the last Tq of Tk
    positions: rows of zeros fill the first Tk - Tq (each query's KL is its own). Returns the
    loss alone (its gradients are checked by finite differences)."""
    q, k, index_q, index_k, index_w = (np.asarray(x, np.float64) for x in (q, k, index_q, index_k, index_w))
    Tq, Tk = q.shape[1], k.shape[1]
    pad = lambda x: np.concatenate([np.zeros((x.shape[0], Tk - Tq) + x.shape[2:]), x], axis=1)
    q, index_q, index_w = pad(q), pad(index_q), pad(index_w)
    idx = reference.dsa_select(index_q, index_k, index_w, top_k=top_k, causal=causal, cu_seqlens=cu_seqlens)
    P = reference.dsa_index_target(q, k, causal=causal, scale=scale, indices=idx, cu_seqlens=cu_seqlens)
    scores = reference.dsa_index_scores(index_q, index_k, index_w)
    B = scores.shape[0]
    total = 0.0
    for b in range(B):
        for t in range(Tk - Tq, Tk):
            keys = [int(s) for s in idx[b, t] if s >= 0]
            if not keys:
                continue
            x = scores[b, t, keys]
            logp = x - x.max() - math.log(sum(math.exp(v - x.max()) for v in x))
            total += sum(P[b, t, s] * (math.log(P[b, t, s]) - lp) for s, lp in zip(keys, logp)
                         if not P[b, t, s] <= 0)
    return total / (B * Tq)

@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("top_k", [3, 25])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", DSA_LAYOUTS.values(), ids=DSA_LAYOUTS.keys())
def test_dsa_index_loss_against_oracle(rng, layout, causal, top_k, dtype):
    """The loss: the oracle's KL of the indexer's distribution from the main attention's over
    the chosen keys, mean over queries (float64 1e-10, float32 1e-5); float32 gradients within
    1e-4 of float64's; each gradient in its array's dtype and shape."""
    args, cu = index_loss_args(rng, layout)
    ref = literal_index_loss(*args, top_k=top_k, causal=causal, cu_seqlens=cu)
    low = [x.astype(dtype) for x in args]
    loss, grads = pyattn.dsa_index_loss(*low, top_k=top_k, causal=causal, cu_seqlens=cu)
    assert isinstance(loss, float) and ref > 0
    assert_close(np.array([loss]), np.array([ref]), TOLERANCES[np.dtype(dtype)][0], name="loss")
    _, g64 = pyattn.dsa_index_loss(*args, top_k=top_k, causal=causal, cu_seqlens=cu)
    for name, x in zip(("index_q", "index_k", "index_w"), low[2:]):
        assert grads[name].dtype == dtype and grads[name].shape == x.shape
        assert np.any(g64[name] != 0), name
        if dtype == np.float32:
            assert_close(grads[name], g64[name], F32_GRAD, name=f"d{name}")


@pytest.mark.parametrize("top_k", [3, 25])
@pytest.mark.parametrize("layout", DSA_LAYOUTS.values(), ids=DSA_LAYOUTS.keys())
def test_dsa_index_loss_gradients(rng, layout, top_k):
    """The gradients in index_q, index_k, index_w: central differences of the loss (the
    oracle's, above; the choice of keys does not move under eps); q and k get none (the
    target is constant)."""
    args, cu = index_loss_args(rng, layout)
    _, grads = pyattn.dsa_index_loss(*args, top_k=top_k, cu_seqlens=cu)
    assert set(grads) == {"index_q", "index_k", "index_w"}
    for name, x in zip(("index_q", "index_k", "index_w"), args[2:]):
        num = finite_differences(lambda: pyattn.dsa_index_loss(*args, top_k=top_k, cu_seqlens=cu)[0], x)
        assert_close(grads[name], num, 1e-7, name=f"d{name}")


def test_dsa_index_loss_is_the_composition(rng):
    """The same loss and gradients as the three public pieces composed in NumPy: the scores'
    vjp, dsa_select, dsa_index_target, the softmax over the chosen keys (float64 1e-12)."""
    q, k, _, iq, ik, iw = dsa_inputs(rng, B=2, T=33, Hi=3, Di=4)
    loss, grads = pyattn.dsa_index_loss(q, k, iq, ik, iw, top_k=7)
    scores, pullback = pyattn.vjp(pyattn.dsa_index_scores, iq, ik, iw)
    chosen = pyattn.dsa_select(iq, ik, iw, top_k=7)
    target = pyattn.dsa_index_target(q, k, indices=chosen)
    mask = np.zeros(scores.shape, bool)
    b, t, j = np.nonzero(chosen >= 0)
    mask[b, t, chosen[b, t, j]] = True
    s = np.where(mask, scores, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(target > 0, target * (np.log(target) - np.log(p)), 0).sum() / 66
    assert abs(loss - kl) <= 1e-12 * kl
    for name, g in pullback((p - target) / 66).items():
        assert_close(grads[name], g, 1e-12, name=f"d{name}")


def test_dsa_index_loss_threads_and_nan(rng):
    """The same bits at 1 and 2 threads (dik gathered per key in query order); a NaN in q, in
    index_q or in index_k makes the loss NaN, never a silent 0."""
    args = dsa_inputs(rng, B=2, T=40)
    q, k, iq, ik, iw = args[:2] + args[3:]
    with pyattn.num_threads(1):
        one = pyattn.dsa_index_loss(q, k, iq, ik, iw, top_k=5)
    with pyattn.num_threads(2):
        two = pyattn.dsa_index_loss(q, k, iq, ik, iw, top_k=5)
    assert one[0] == two[0]
    for name in one[1]:
        assert np.array_equal(one[1][name], two[1][name]), name
    for i, at in ((0, (0, 7, 1, 2)), (2, (1, 3, 0, 0)), (3, (0, 2, 1))):
        x = [q, k, iq, ik, iw]
        x[i] = x[i].copy()
        x[i][at] = np.nan
        assert np.isnan(pyattn.dsa_index_loss(*x, top_k=5)[0]), i


def test_dsa_index_loss_bad_input(rng):
    """Wrong shapes and dtypes name the argument; the kernel refuses rows that are not key
    rows and counts beyond top_k (no out-of-bounds read); T = 0 gives 0 and empty gradients."""
    q, k, _, iq, ik, iw = dsa_inputs(rng, B=2, T=9)
    f = pyattn.dsa_index_loss
    raises(ValueError, f, q, k, iq, ik[..., :2], iw, top_k=3, must=["index dims must match"])
    raises(TypeError, f, q, k, iq.astype(np.float32), ik.astype(np.float32), iw.astype(np.float32), top_k=3,
           must=["index arrays must have q's dtype float64"])
    raises(ValueError, f, q, k, iq[:, :4], ik, iw[:, :4], top_k=3, must=["'index_q' must have shape (2, 9, 2, 3)"])
    raises(ValueError, f, q, k, iq, ik, iw, top_k=0, must=["'top_k' must be >= 1"])
    raises(ValueError, f, q, k[:, :5], iq, ik[:, :5], iw, top_k=3, must=["need Tq <= Tk, got Tq=9, Tk=5"])
    rows, count = np.zeros((18, 3), np.int32), np.full(18, 3, np.int64)
    out = [np.empty(18), np.empty((18, 2, 3)), np.empty((18, 3)), np.empty((18, 2))]
    call = [q.reshape(18, 4, 5), k.reshape(18, 2, 5), iq.reshape(18, 2, 3), ik.reshape(18, 3), iw.reshape(18, 2)]
    bad = rows.copy()
    bad[5, 1] = 18
    raises(ValueError, _core.dsa_index_loss, *call, bad, count, 0.5, 1.0, *out, must=["rows[5, 1]=18"])
    many = count.copy()
    many[2] = 4
    raises(ValueError, _core.dsa_index_loss, *call, rows, many, 0.5, 1.0, *out, must=["count[2]=4"])
    _core.dsa_index_loss(*call, rows, count, 0.5, 1.0, *out)
    assert np.all(np.isfinite(out[0]))
    loss, grads = f(q[:, :0], k[:, :0], iq[:, :0], ik[:, :0], iw[:, :0], top_k=3)  # T = 0
    assert loss == 0 and grads["index_k"].shape == (2, 0, 3)

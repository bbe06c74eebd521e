"""moba_attention against its float64 oracle: block choice (own block, best past blocks, ties),
ragged last blocks, GQA, varlen, non-causal, gradients, bad input."""
import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn.testing import assert_close, gradcheck

from conftest import raises

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

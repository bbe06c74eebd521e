"""pyattn.forgetting_attention (the Forgetting Transformer, FoX): both forms x both dtypes
against the float64 oracles (docs/ops.md).

Forward: pyattn.reference.forgetting_attention (a loop over queries, the gates between key and
query summed per row). Gradients: ``dense_forgetting`` below, a vectorised float64 forward and
backward with materialised scores; finite differences (pyattn.testing.gradcheck) on tiny
shapes. Also: g = 0 is causal softmax_attention, bit for bit; cu_seqlens is separate calls;
a -inf gate is a sequence boundary; a long float32 sequence where G reaches -4000; the same
bits for any thread count; NaN in, NaN out; bad arguments.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn.testing import TOLERANCES, assert_close, gradcheck, rel_rms

from conftest import f32_exact, raises

FORMS = ("flash", "parallel")
DTYPES = (np.float64, np.float32)
IDS = {np.float64: "f64", np.float32: "f32"}


def tol_out(dtype):
    return TOLERANCES[np.dtype(dtype)][0]


def tol_grad(dtype):
    return TOLERANCES[np.dtype(dtype)][1]


# ------------------------------------------------------------------------------------------
# the gradient oracle


def _dense_one(q, k, v, g, do, window, scale):
    """One sequence: q [T, H, K], k [T, Hk, K], v [T, Hk, V], g [T, H], do [T, H, V]; returns
    o and the grads {q, k, v, g}. G by np.cumsum (float64 keeps its digits at these lengths);
    a nearly one-hot row would lose the diagonal's dP_ii - D_i = do_i.(v_i - o_i) to
    cancellation, so v_i - o_i is formed as sum_k P_ik (v_i - v_k); dg_t is the sum of dS over
    the pairs j < t <= i, those whose bias holds g_t."""
    T, H, _ = q.shape
    group = H // k.shape[1]
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    G = np.cumsum(g, axis=0).T  # [H, T]
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (j <= i) & (True if window is None else i - j < window)
    s = scale * np.einsum("ihd,jhd->hij", q, kk) + G[:, :, None] - G[:, None, :]
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(axis=2, keepdims=True))
    P = p / p.sum(axis=2, keepdims=True)  # [H, T, T]
    o = np.einsum("hij,jhd->ihd", P, vv)
    diff = np.einsum("ihd,jhd->hij", do, vv) - np.einsum("ihd,ihd->hi", do, o)[:, :, None]
    v_minus_o = np.einsum("hik,ikhd->ihd", P, vv[:, None] - vv[None, :])  # v_i - o_i
    diff[:, np.arange(T), np.arange(T)] = np.einsum("ihd,ihd->hi", do, v_minus_o)
    dS = P * diff
    dq = scale * np.einsum("hij,jhd->ihd", dS, kk)
    dk = scale * np.einsum("hij,ihd->jhd", dS, q).reshape(T, -1, group, q.shape[2]).sum(axis=2)
    dv = np.einsum("hij,ihd->jhd", P, do).reshape(T, -1, group, v.shape[2]).sum(axis=2)
    before = np.concatenate([np.zeros((H, T, 1)), np.cumsum(dS, axis=2)[:, :, :-1]], axis=2)
    dg = np.where(j >= i, before.transpose(0, 2, 1), 0.0).sum(axis=2).T  # [t, i]: rows i >= t
    return o, {"q": dq, "k": dk, "v": dv, "g": dg}


def dense_forgetting(q, k, v, g, do, *, window=None, scale=None, cu_seqlens=None, form=None):
    """float64 (o, grads) of forgetting attention for the cotangent do, sequence by sequence."""
    q, k, v, g, do = (np.asarray(x, np.float64) for x in (q, k, v, g, do))
    B, T = q.shape[:2]
    scale = q.shape[3] ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        seqs = [(0, int(a), int(e)) for a, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    o = np.zeros(q.shape[:3] + v.shape[3:])
    grads = {n: np.zeros_like(x) for n, x in (("q", q), ("k", k), ("v", v), ("g", g))}
    for b, a, e in seqs:
        if e > a:
            o[b, a:e], part = _dense_one(q[b, a:e], k[b, a:e], v[b, a:e], g[b, a:e], do[b, a:e],
                                         window, scale)
            for n in grads:
                grads[n][b, a:e] = part[n]
    return o, grads


# ------------------------------------------------------------------------------------------
# cases


def gates(kind, rng, shape):
    """FoX's (logsigmoid, mostly near 0), strong (around -20: each step forgets nearly all),
    weak (within 1e-3 of 0: plain causal softmax, nearly)."""
    if kind == "fox":
        return -np.logaddexp(0.0, -2.0 - rng.standard_normal(shape))
    if kind == "strong":
        return -20.0 * rng.uniform(0.8, 1.2, shape)
    return -1e-3 * rng.uniform(0.0, 1.0, shape)


# name: ((B, T, H, Hk, Dk, Dv), gate kind, kwargs)
CASES = {
    "T1": ((2, 1, 2, 2, 8, 8), "fox", {}),
    "T63_gqa": ((2, 63, 4, 2, 16, 16), "fox", {}),
    "T64_dk16_dv8": ((1, 64, 2, 1, 16, 8), "fox", {}),
    "T65_window5": ((2, 65, 2, 2, 16, 16), "fox", dict(window=5)),
    "T300_mqa_dk16_dv12": ((1, 300, 4, 1, 16, 12), "fox", {}),
    "T300_window100": ((1, 300, 2, 2, 8, 8), "fox", dict(window=100)),
    "T300_window1": ((1, 300, 2, 1, 8, 8), "fox", dict(window=1)),
    "strong_T300": ((1, 300, 2, 1, 16, 16), "strong", {}),
    "strong_T65_window3": ((2, 65, 2, 2, 8, 8), "strong", dict(window=3)),
    "weak_T300": ((1, 300, 2, 2, 16, 16), "weak", {}),
    "weak_T63_window40": ((1, 63, 2, 1, 8, 16), "weak", dict(window=40)),
    "scale_T65": ((1, 65, 2, 2, 8, 8), "fox", dict(scale=0.3)),
    "varlen_T300": ((1, 300, 2, 1, 16, 8), "fox", dict(cu_seqlens=np.array([0, 1, 64, 64, 190, 300]))),
    "varlen_strong_window": ((1, 130, 2, 2, 8, 8), "strong",
                             dict(window=7, cu_seqlens=np.array([0, 65, 66, 130]))),
}


@functools.lru_cache(maxsize=None)
def case_data(name):
    """(q, k, v, g, do float64 and float32-representable, kwargs, oracle o)."""
    (B, T, H, Hk, Dk, Dv), kind, kw = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    q, k, v, do = (f32_exact(rng.standard_normal(s)) for s in
                   ((B, T, H, Dk), (B, T, Hk, Dk), (B, T, Hk, Dv), (B, T, H, Dv)))
    g = f32_exact(gates(kind, rng, (B, T, H)))
    return q, k, v, g, do, kw, reference.forgetting_attention(q, k, v, g, **kw)


@functools.lru_cache(maxsize=None)
def case_dense(name):
    q, k, v, g, do, kw, _ = case_data(name)
    return dense_forgetting(q, k, v, g, do, **kw)


def as_dtype(arrays, dtype):
    return tuple(np.asarray(a, dtype=dtype) for a in arrays)


def test_the_gates_span_weak_to_strong():
    g = {kind: case_data(name)[3] for name, (_, kind, _) in CASES.items()}
    assert g["strong"].max() < -15 and -1e-3 <= g["weak"].min() and g["weak"].max() <= 0
    assert -1 < g["fox"].mean() < -0.05


# ------------------------------------------------------------------------------------------
# against the oracles


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_oracle_matches_reference(case):
    """The gradients' oracle computes the reference's forward."""
    q, k, v, g, do, kw, o = case_data(case)
    assert_close(case_dense(case)[0], o, 1e-12, name="dense o")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_vs_oracle(case, form, dtype):
    q, k, v, g, _, kw, o_ref = case_data(case)
    o = pyattn.forgetting_attention(*as_dtype((q, k, v, g), dtype), form=form, **kw)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert_close(o, o_ref, tol_out(dtype), name="o")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_grads_vs_dense_oracle(case, form, dtype):
    """float64 within 1e-10, float32 within 1e-4 of the float64 oracle's gradients, the strong
    gates' (a nearly one-hot softmax, gradients of 1e-9) included."""
    q, k, v, g, do, kw, _ = case_data(case)
    _, ref = case_dense(case)
    out, pullback = pyattn.vjp(pyattn.forgetting_attention, *as_dtype((q, k, v, g), dtype), form=form, **kw)
    grads = pullback(do.astype(dtype))
    assert set(grads) == {"q", "k", "v", "g"}
    for name, x in zip("qkvg", (q, k, v, g)):
        assert grads[name].dtype == dtype and grads[name].shape == x.shape
        # T = 1: dq, dk and dg are 0 exactly (one key: the softmax is 1 whatever the score)
        assert_close(grads[name], ref[name], tol_grad(dtype), atol=1e-30, name=f"d{name}")


# tiny shapes for finite differences: (B, T, H, Hk, Dk, Dv), gate kind, kwargs
GRADCHECK_CASES = {
    "plain": ((2, 6, 2, 2, 3, 2), "fox", {}),
    "T1": ((1, 1, 2, 1, 3, 2), "fox", {}),
    "gqa_window": ((1, 8, 4, 2, 3, 2), "fox", dict(window=3)),
    "mqa_dk4_dv1": ((1, 7, 2, 1, 4, 1), "weak", {}),
    "strongish": ((1, 6, 2, 1, 3, 2), "fox", dict(scale=2.0)),
    "varlen": ((1, 9, 2, 1, 3, 2), "fox", dict(cu_seqlens=np.array([0, 3, 3, 8, 9], np.int32))),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", sorted(GRADCHECK_CASES))
def test_gradcheck(case, form):
    (B, T, H, Hk, Dk, Dv), kind, kw = GRADCHECK_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    q, k, v = (rng.standard_normal(s) for s in ((B, T, H, Dk), (B, T, Hk, Dk), (B, T, Hk, Dv)))
    g = 3 * gates(kind, rng, (B, T, H))
    with pyattn.num_threads(1):  # hundreds of tiny calls
        errs = gradcheck(pyattn.forgetting_attention, (q, k, v, g), dict(kw, form=form))
    assert set(errs) == {"q", "k", "v", "g"}


# ------------------------------------------------------------------------------------------
# identities


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("T,window", [(1, None), (65, None), (300, None), (300, 70)])
def test_zero_gate_is_causal_softmax_attention(T, window, form, dtype):
    """g = 0: the same bits as softmax_attention(causal=True) forward; the gradients within
    rounding (FoX's backward takes the diagonal of dS from its row, see sm_gate)."""
    rng = np.random.default_rng(T)
    q, k, v, do = (rng.standard_normal(s).astype(dtype) for s in ((2, T, 4, 16), (2, T, 2, 16),
                                                                   (2, T, 2, 8), (2, T, 4, 8)))
    g = np.zeros((2, T, 4), dtype)
    fox, fox_pb = pyattn.vjp(pyattn.forgetting_attention, q, k, v, g, window=window, form=form)
    sm, sm_pb = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True, form=form,
                           window=None if window is None else (window - 1, 0))
    np.testing.assert_array_equal(fox, sm)
    fox_g, sm_g = fox_pb(do), sm_pb(do)
    eps = np.finfo(dtype).eps  # T = 1: dq = dk = 0, exactly in FoX, to rounding in softmax
    for name in "qkv":
        assert_close(fox_g[name], sm_g[name], 10 * eps, atol=100 * eps, name=f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("form", FORMS)
def test_cu_seqlens_is_separate_calls(form, dtype):
    """Packed sequences (one empty, one of a single step) give each sequence's own call: G
    restarts at every boundary."""
    cu = np.array([0, 100, 100, 101, 230, 300])
    rng = np.random.default_rng(7)
    q, k, v, do = (rng.standard_normal(s).astype(dtype) for s in ((1, 300, 4, 8), (1, 300, 2, 8),
                                                                   (1, 300, 2, 12), (1, 300, 4, 12)))
    g = gates("fox", rng, (1, 300, 4)).astype(dtype)
    o, pullback = pyattn.vjp(pyattn.forgetting_attention, q, k, v, g, cu_seqlens=cu, window=50, form=form)
    grads = pullback(do)
    for a, e in zip(cu[:-1], cu[1:]):
        part = slice(a, e)
        o1, pb1 = pyattn.vjp(pyattn.forgetting_attention, q[:, part], k[:, part], v[:, part], g[:, part],
                             window=50, form=form)
        assert_close(o[:, part], o1, 4 * np.finfo(dtype).eps, atol=1e-30, name=f"o[{a}:{e}]")
        for name, x in pb1(do[:, part]).items():
            assert_close(grads[name][:, part], x, 16 * np.finfo(dtype).eps, atol=1e-30, name=f"d{name}[{a}:{e}]")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("form", FORMS)
def test_minus_inf_gate_is_a_sequence_boundary(form, dtype):
    """g_t = -inf forgets every key before t: the queries from t on attend as if their sequence
    began at t (the gate's gradient there is 0, as at a sequence's first step)."""
    rng = np.random.default_rng(8)
    q, k, v, do = (rng.standard_normal(s).astype(dtype) for s in ((1, 200, 2, 8), (1, 200, 1, 8),
                                                                   (1, 200, 1, 8), (1, 200, 2, 8)))
    g = gates("fox", rng, (1, 200, 2)).astype(dtype)
    g[0, 120] = -np.inf
    o, pullback = pyattn.vjp(pyattn.forgetting_attention, q, k, v, g, form=form)
    assert_close(o, reference.forgetting_attention(q, k, v, g), tol_out(dtype), name="o")
    split, split_pb = pyattn.vjp(pyattn.forgetting_attention, q, k, v, np.where(np.isinf(g), 0, g),
                                 cu_seqlens=np.array([0, 120, 200]), form=form)
    assert_close(o, split, 4 * np.finfo(dtype).eps, atol=1e-30, name="o")
    grads, want = pullback(do), split_pb(do)
    for name in "qkvg":
        assert np.all(np.isfinite(grads[name]))
        assert_close(grads[name], want[name], 16 * np.finfo(dtype).eps, atol=1e-30, name=f"d{name}")


@pytest.mark.skip_under_sanitizer  # numerics over T = 4096; shorter calls cover the same tiles
def test_long_float32_sequence_keeps_the_bias_digits():
    """T = 4096 with g ~ -1 a step: G reaches about -4000, where a float32 G_j carries an error
    of 2e-4. The kernel's hi + lo bias keeps float32 o within 1e-5 of the float64 oracle (7e-8
    measured; the gradients within 1e-4 of the float64 kernel's); the same attention as
    softmax with -G_j in one more key dimension (what pyattn.torch.fla did before) misses the
    1e-5 (4e-5 measured), over 100x further off."""
    rng = np.random.default_rng(9)
    B, T, H, Hk, D = 1, 4096, 2, 1, 16
    q, k, v, do = (f32_exact(rng.standard_normal(s)) for s in ((B, T, H, D), (B, T, Hk, D),
                                                                 (B, T, Hk, D), (B, T, H, D)))
    g = f32_exact(-rng.uniform(0.5, 1.5, (B, T, H)))
    o_ref = reference.forgetting_attention(q, k, v, g)
    assert np.cumsum(g, axis=1).min() < -4000
    f32 = as_dtype((q, k, v, g), np.float32)
    errs = [assert_close(pyattn.forgetting_attention(*f32, form=form), o_ref, 1e-5, name=f"o {form}")
            for form in FORMS]
    G = np.cumsum(g, axis=1).astype(np.float32)
    q_ext = np.concatenate([f32[0] * np.float32(D ** -0.5), np.ones((B, T, H, 1), np.float32)], axis=-1)
    k_ext = np.concatenate([np.repeat(f32[1], H, axis=2), -G[..., None]], axis=-1)
    naive = pyattn.softmax_attention(q_ext, k_ext, np.repeat(f32[2], H, axis=2), causal=True, scale=1.0)
    assert rel_rms(naive, o_ref) > max(1e-5, 100 * max(errs))
    _, pb32 = pyattn.vjp(pyattn.forgetting_attention, *f32)
    _, pb64 = pyattn.vjp(pyattn.forgetting_attention, q, k, v, g)
    g32, g64 = pb32(do.astype(np.float32)), pb64(do)
    for name in "qkvg":
        assert_close(g32[name], g64[name], 1e-4, name=f"d{name}")


@pytest.mark.parametrize("form", FORMS)
def test_same_bits_for_any_thread_count(form):
    """One and two threads (one KV head unit per thread or the split into key and query
    blocks, see softmax_backward) give the same bits, the gate's sums included."""
    rng = np.random.default_rng(10)
    q, k, v, do = (rng.standard_normal(s).astype(np.float32) for s in ((1, 400, 4, 16), (1, 400, 2, 16),
                                                                        (1, 400, 2, 16), (1, 400, 4, 16)))
    g = gates("fox", rng, (1, 400, 4)).astype(np.float32)
    runs = []
    for n in (1, 2):
        with pyattn.num_threads(n):
            o, pullback = pyattn.vjp(pyattn.forgetting_attention, q, k, v, g, form=form)
            runs.append((o, pullback(do)))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    for name in "qkvg":
        np.testing.assert_array_equal(runs[0][1][name], runs[1][1][name])


# ------------------------------------------------------------------------------------------
# non-finite inputs


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("where", ["q", "k", "v", "g"])
def test_nan_in_nan_out(where, form, dtype):
    """A NaN at step t (head 1, or KV head 0 for k and v) makes NaN exactly the outputs that
    reach it: its query's row (q); the rows of the heads reading it that see key t (k, v: t ..
    t + window - 1); every later row of its head (g, through G). Every other output and the
    rows of dq before t keep the bits of the clean run; the gradient is NaN where it depends on
    it, never a silent 0."""
    rng = np.random.default_rng(11)
    B, T, H, Hk, D, t, window = 1, 150, 4, 2, 8, 70, 30
    q, k, v, do = (rng.standard_normal(s).astype(dtype) for s in ((B, T, H, D), (B, T, Hk, D),
                                                                   (B, T, Hk, D), (B, T, H, D)))
    g = gates("fox", rng, (B, T, H)).astype(dtype)
    clean, clean_pb = pyattn.vjp(pyattn.forgetting_attention, q, k, v, g, window=window, form=form)
    clean_grads = clean_pb(do)
    x = {"q": q, "k": k, "v": v, "g": g}
    poisoned = {n: a.copy() for n, a in x.items()}
    poisoned[where][(0, t, 1 if where in "qg" else 0)] = np.nan
    o, pullback = pyattn.vjp(pyattn.forgetting_attention, *(poisoned[n] for n in "qkvg"), window=window, form=form)
    grads = pullback(do)
    bad = np.zeros((T, H), bool)
    if where == "q":
        bad[t, 1] = True
    elif where == "g":
        bad[t:, 1] = True
    else:
        bad[t:t + window, :2] = True  # query heads 0 and 1 read KV head 0
    assert np.all(np.isnan(o[0][bad])) and np.all(np.isfinite(o[0][~bad]))
    np.testing.assert_array_equal(o[0][~bad], clean[0][~bad])
    np.testing.assert_array_equal(grads["q"][0, :t], clean_grads["q"][0, :t])
    assert np.isnan(grads["q"][0, t]).any()
    # dv = P^T do does not read v: a NaN in v reaches dk (through D_i = do_i . o_i)
    assert np.isnan(grads["k" if where == "v" else where]).any()


# ------------------------------------------------------------------------------------------
# arguments


def _args(B=1, T=9, H=2, Hk=1, K=4, V=3, dtype=np.float64):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((B, T, H, K), (B, T, Hk, K), (B, T, Hk, V)))
    return q, k, v, -rng.uniform(0, 1, (B, T, H)).astype(dtype)


def _bad_calls():
    q, k, v, g = _args()
    pos = g.copy()
    pos[0, 3, 1] = 0.5
    fn = pyattn.forgetting_attention
    return {
        "g-positive": (ValueError, lambda: fn(q, k, v, pos), ("forgetting_attention()", "'g'", "<= 0", "0.5",
                                                             "(0, 3, 1)")),
        "g-shape": (ValueError, lambda: fn(q, k, v, g[..., :1]), ("'g'", "(1, 9, 2)", "[B, T, H]", "(1, 9, 1)")),
        "g-per-kv-head": (ValueError, lambda: fn(q, k, v, np.zeros((1, 9, 1))), ("'g'", "(1, 9, 2)")),
        "g-float32": (TypeError, lambda: fn(q, k, v, g.astype(np.float32)), ("'g'", "float32", "float64")),
        "g-int": (TypeError, lambda: fn(q, k, v, g.astype(np.int64)), ("'g'", "int64")),
        "g-missing": (TypeError, lambda: fn(q, k, v, None), ("'g'", "NoneType")),
        "window-0": (ValueError, lambda: fn(q, k, v, g, window=0), ("'window'", ">= 1", "0")),
        "window--1": (ValueError, lambda: fn(q, k, v, g, window=-1), ("'window'", ">= 1", "-1")),
        "window-float": (TypeError, lambda: fn(q, k, v, g, window=2.0), ("'window'", "int", "float")),
        "window-bool": (TypeError, lambda: fn(q, k, v, g, window=True), ("'window'", "int", "bool")),
        "window-pair": (TypeError, lambda: fn(q, k, v, g, window=(3, 0)), ("'window'", "int", "tuple")),
        "form-recurrent": (ValueError, lambda: fn(q, k, v, g, form="recurrent"), ("form", "recurrent")),
        "scale-inf": (ValueError, lambda: fn(q, k, v, g, scale=np.inf), ("'scale'", "inf")),
        "scale-str": (TypeError, lambda: fn(q, k, v, g, scale="1"), ("'scale'", "float", "str")),
        "k-length": (ValueError, lambda: fn(q, k[:, :8], v[:, :8], g), ("lengths", "q=9", "k=8")),
        "heads": (ValueError, lambda: fn(*_args(H=3, Hk=2)), ("'k'", "Hk=2", "H=3")),
        "q-3d": (ValueError, lambda: fn(q[0], k, v, g), ("'q'", "4-D", "[B, T, H, K]")),
        "v-heads": (ValueError, lambda: fn(q, k, np.zeros((1, 9, 2, 3)), g), ("KV head counts", "k=1", "v=2")),
        "dk": (ValueError, lambda: fn(q, k[..., :3], v, g), ("key head dims", "q=4", "k=3")),
        "cu-batch": (ValueError, lambda: fn(*_args(B=2), cu_seqlens=np.array([0, 9])), ("'cu_seqlens'", "B=2")),
        "cu-end": (ValueError, lambda: fn(q, k, v, g, cu_seqlens=np.array([0, 5])), ("'cu_seqlens'", "T=9")),
        "cu-float": (TypeError, lambda: fn(q, k, v, g, cu_seqlens=np.array([0.0, 9.0])), ("'cu_seqlens'", "float64")),
        "unknown-keyword": (TypeError, lambda: fn(q, k, v, g, causal=True), ("causal",)),
        "pullback-shape": (ValueError, lambda: pyattn.vjp(fn, q, k, v, g)[1](np.zeros((1, 9, 2, 2))),
                           ("forgetting_attention pullback", "'do'", "(1, 9, 2, 3)")),
        "pullback-dtype": (TypeError, lambda: pyattn.vjp(fn, q, k, v, g)[1](np.zeros((1, 9, 2, 3), np.float32)),
                           ("forgetting_attention pullback", "'do'", "float32")),
    }


BAD = _bad_calls()


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_name_the_op_and_argument(case):
    exc, call, must = BAD[case]
    raises(exc, call, must=must)


def test_vjp_checks_arguments_like_the_forward():
    q, k, v, g = _args()
    raises(ValueError, pyattn.vjp, pyattn.forgetting_attention, q, k, v, np.abs(g) + 1, must=("'g'", "<= 0"))
    raises(ValueError, pyattn.vjp, pyattn.forgetting_attention, q, k, v, g, window=0, must=("'window'",))


def test_nan_gate_is_accepted_and_huge_window_is_no_window():
    """NaN passes the gate check (a diverging run shows NaN, not an exception); a window longer
    than every sequence is the whole causal past."""
    q, k, v, g = _args()
    g[0, 4, 0] = np.nan
    assert np.isnan(pyattn.forgetting_attention(q, k, v, g)[0, 4:, 0]).all()
    q, k, v, g = _args()
    np.testing.assert_array_equal(pyattn.forgetting_attention(q, k, v, g, window=2 ** 70),
                                  pyattn.forgetting_attention(q, k, v, g))


def test_core_checks_its_arguments():
    """_core.forgetting_forward/backward: one sequence layout, the gate's shape, the forms that
    take a gate."""
    from pyattn import _core

    q, k, v, g = _args()
    o, lse, cu = np.empty((1, 9, 2, 3)), np.empty((1, 9, 2)), np.array([0, 9])
    assert _core.forgetting_forward(q, k, v, g, o, lse, cu, _core.FORM_FLASH, -1, 0.5, False) is None
    raises(ValueError, _core.forgetting_forward, q, k, v, g, o, lse, cu, _core.FORM_RECURRENT, -1, 0.5, False,
           must=("'form'", "[0, 1]"))
    raises(ValueError, _core.forgetting_forward, q, k, v, g[..., :1].copy(), o, lse, cu, 1, -1, 0.5, False,
           must=("'g'", "(1, 9, 2)"))
    raises(ValueError, _core.forgetting_forward, q, k[:, :5].copy(), v[:, :5].copy(), g, o, lse, cu, 1, -1, 0.5,
           False, must=("same length",))
    raises(TypeError, _core.forgetting_backward, q, k, v, g, o, lse, must=("16 positional arguments",))
    dg = np.empty_like(g)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    raises(ValueError, _core.forgetting_backward, q, k, v, g, o, lse, o, dq, dk, dv, dg[..., :1].copy(), cu, 1,
           -1, 0.5, False, must=("'dg'", "(1, 9, 2)"))
    assert _core.forgetting_backward(q, k, v, g, o, lse, np.ones_like(o), dq, dk, dv, dg, cu, 1, -1, 0.5, False) is None
    assert np.all(np.isfinite(dg)) and np.all(dg[0, 0] == 0)

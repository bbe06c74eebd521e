"""NaN and inf in softmax attention (issue 14, item 1): a non-finite value reaches exactly the
outputs and gradients that depend on it, in every form and both dtypes, and nothing else.

* Forward: against pyattn.reference (the float64 loop over visible keys), non-finite entries
  included: a NaN or +inf score, or visible scores all -inf, make the row's o and lse NaN.
* Gradients: against ``select_oracle``, the same float64 formula as dense_softmax in
  conftest.py but gathered over each query's visible keys, so IEEE arithmetic decides every
  non-finite entry and a key a query cannot see takes no part in its row at all.
* Exactness: every output and gradient that does not depend on the poisoned value (worked
  out from which keys each query sees) has the same bits as in a clean run.

The poisoned positions cover keys a query sees and keys it cannot (causal future, outside a
window on either side, other sequences of cu_seqlens, past the end of a KV cache), the sinks,
the flash form's one-query decode path, GQA, Dk != Dv and feature counts that are not a
multiple of the vector width. Also here: the "softmax" feature map with non-finite inputs,
non-finite alibi_slopes rejected, and _core's mask bounds at INT64_MAX.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import pyattn
from pyattn import _core, reference
from pyattn.testing import TOLERANCES, assert_close

from conftest import f32_exact, make_inputs, visible_mask

FORMS = ("parallel", "flash", "recurrent")
DTYPES = (np.float64, np.float32)
INT64_MAX = 2 ** 63 - 1

# name: ((B, Tq, Tk, H, Hk, Dk, Dv), kwargs)
CASES = {
    # several query and key blocks in the flash form, forward and backward
    "causal_gqa_T200": ((1, 200, 200, 2, 1, 16, 12), dict(causal=True)),
    "window_sinks_T130": ((2, 130, 130, 2, 1, 8, 8), dict(causal=True, window=(20, 0), sinks=2)),
    "window_both_sides": ((1, 100, 100, 2, 2, 8, 11), dict(window=(7, 5))),
    "cu_seqlens": ((1, 120, 120, 2, 1, 8, 8),
                   dict(causal=True, cu_seqlens=np.array([0, 50, 50, 120]))),
    # Tq = 1: the flash form's decode path
    "decode_window_sinks": ((2, 1, 120, 4, 2, 16, 16), dict(causal=True, window=(40, 0), sinks=1)),
    # the first 15 queries see no key
    "tq_gt_tk": ((1, 40, 25, 2, 1, 8, 8), dict(causal=True)),
}

# name: poisoned entries (array, b, t, head, feature): t is the query (q, do, dlse) or the key
# (k, v) row; dlse has no feature (None)
POISONS = {
    "causal_gqa_T200": [("q", 0, 120, 1, 5), ("k", 0, 120, 0, 15), ("v", 0, 120, 0, 11),
                        ("k", 0, 199, 0, 0), ("v", 0, 199, 0, 4), ("v", 0, 0, 0, 3),
                        ("do", 0, 150, 1, 7), ("dlse", 0, 100, 1, None)],
    "window_sinks_T130": [("q", 1, 10, 1, 0), ("k", 1, 60, 0, 2), ("v", 0, 1, 0, 4),
                          ("v", 0, 100, 0, 7), ("do", 1, 90, 0, 3)],
    "window_both_sides": [("k", 0, 50, 1, 3), ("v", 0, 50, 0, 10), ("q", 0, 0, 0, 7)],
    "cu_seqlens": [("k", 0, 20, 0, 1), ("v", 0, 49, 0, 7), ("v", 0, 60, 0, 2), ("q", 0, 55, 1, 4)],
    "decode_window_sinks": [("k", 0, 100, 1, 3), ("v", 1, 50, 0, 5), ("k", 0, 0, 0, 2),
                            ("v", 1, 78, 1, 15), ("q", 1, 0, 2, 7)],
    "tq_gt_tk": [("k", 0, 10, 0, 3), ("q", 0, 5, 0, 1), ("q", 0, 30, 1, 1), ("v", 0, 24, 0, 0)],
}

POISON_PARAMS = [pytest.param(case, p, id=f"{case}-{p[0]}{p[2]}h{p[3]}")
                 for case in CASES for p in POISONS[case]]
VALUES = {"nan": np.nan, "inf": np.inf}


def tol_out(dtype):
    return TOLERANCES[np.dtype(dtype)][0]


def tol_grad(dtype):
    return TOLERANCES[np.dtype(dtype)][1]


def sequences(B, Tq, Tk, cu_seqlens):
    """(b, q start, q end, k start, k end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, Tq, 0, Tk) for b in range(B)]
    cu = [int(x) for x in cu_seqlens]
    return [(0, cu[n], cu[n + 1], cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def visibility(shape, kw):
    """[B, Tq, Tk] boolean: key j visible to query i (False across sequences)."""
    B, Tq, Tk = shape[:3]
    vis = np.zeros((B, Tq, Tk), bool)
    for b, qs, qe, ks, ke in sequences(B, Tq, Tk, kw.get("cu_seqlens")):
        vis[b, qs:qe, ks:ke] = visible_mask(qe - qs, ke - ks, causal=kw.get("causal", False),
                                            window=kw.get("window"), sinks=kw.get("sinks", 0))
    return vis


def select_oracle(q, k, v, do, dlse, shape, kw):
    """float64 o, lse and grads {q, k, v}, each query's row computed over its visible keys
    only, with plain IEEE arithmetic (np.errstate ignores the warnings)."""
    B, Tq, Tk, H, Hk, Dk, Dv = shape
    g = H // Hk
    scale = Dk ** -0.5
    vis = visibility(shape, kw)
    o = np.zeros((B, Tq, H, Dv))
    lse = np.full((B, Tq, H), -np.inf)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    with np.errstate(all="ignore"):
        for b in range(B):
            for i in range(Tq):
                J = np.nonzero(vis[b, i])[0]
                if not len(J):
                    continue
                for h in range(H):
                    kh = h // g
                    qi, K, V, doi = q[b, i, h], k[b, J, kh], v[b, J, kh], do[b, i, h]
                    s = scale * (K * qi).sum(axis=1)
                    m = s.max()
                    p = np.exp(s - m)
                    P = p / p.sum()
                    o[b, i, h] = (P[:, None] * V).sum(axis=0)
                    lse[b, i, h] = m + np.log(p.sum())
                    dv[b, J, kh] += P[:, None] * doi
                    D = (doi * o[b, i, h]).sum() - dlse[b, i, h]
                    dS = scale * P * ((V * doi).sum(axis=1) - D)
                    dq[b, i, h] = (dS[:, None] * K).sum(axis=0)
                    dk[b, J, kh] += dS[:, None] * qi
    return o, lse, {"q": dq, "k": dk, "v": dv}


@functools.lru_cache(maxsize=None)
def clean_data(case):
    """float64 (float32-representable) q, k, v, do, dlse of a case."""
    (B, Tq, Tk, H, Hk, Dk, Dv), _ = CASES[case]
    q, k, v = make_inputs(sum(map(ord, case)), B, Tq, Tk, H, Hk, Dk, Dv)
    r = np.random.default_rng(len(case))
    do = f32_exact(r.standard_normal((B, Tq, H, Dv)))
    dlse = f32_exact(r.standard_normal((B, Tq, H)))
    return {"q": q, "k": k, "v": v, "do": do, "dlse": dlse}


def poisoned(case, poison, value):
    """The case's inputs with the one entry of poison set to value."""
    data = {name: a.copy() for name, a in clean_data(case).items()}
    name, b, t, h, f = poison
    data[name][(b, t, h) if f is None else (b, t, h, f)] = value
    return data


def run(data, kw, form, dtype):
    """(o, lse, grads) of softmax_attention's vjp in dtype, cotangent (do, dlse)."""
    q, k, v, do, dlse = (np.asarray(data[n], dtype) for n in ("q", "k", "v", "do", "dlse"))
    (o, lse), pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, form=form,
                                    return_lse=True, **kw)
    return o, lse, pullback((do, dlse))


@functools.lru_cache(maxsize=None)
def clean_run(case, form, dtype):
    return run(clean_data(case), CASES[case][1], form, dtype)


@functools.lru_cache(maxsize=None)
def oracle(case, poison, value_name):
    """o and lse of pyattn.reference, grads of select_oracle (whose o and lse are checked
    against the reference's)."""
    shape, kw = CASES[case]
    data = poisoned(case, poison, VALUES[value_name])
    with np.errstate(all="ignore"):
        o_ref, lse_ref = reference.softmax_attention(data["q"], data["k"], data["v"],
                                                     return_lse=True, **kw)
    o_sel, lse_sel, grads = select_oracle(*(data[n] for n in ("q", "k", "v", "do", "dlse")),
                                          shape, kw)
    assert_close(o_sel, o_ref, 1e-12, name="select_oracle o")
    assert_close(lse_sel, lse_ref, 1e-12, name="select_oracle lse")
    return o_ref, lse_ref, grads


def reached(case, poison):
    """What depends on the poisoned entry: rows [B, Tq, H] of o, lse and dq; key rows
    [B, Tk, Hk] of dk and of dv."""
    shape, kw = CASES[case]
    B, Tq, Tk, H, Hk = shape[:5]
    g = H // Hk
    vis = visibility(shape, kw)
    name, b, t, h, _ = poison
    rows = np.zeros((B, Tq, H), bool)
    if name in ("k", "v"):
        for hq in range(h * g, (h + 1) * g):
            rows[b, :, hq] = vis[b, :, t]
    else:
        rows[b, t, h] = vis[b, t].any()
    keys = np.zeros((B, Tk, Hk), bool)
    for hq in range(H):
        keys[:, :, hq // g] |= (vis & rows[:, :, hq][:, :, None]).any(axis=1)
    # dv = sum_i P_ij do_i: the scores and do decide it, v and dlse do not
    return rows, keys, keys if name in ("q", "k", "do") else np.zeros_like(keys)


def assert_same_bits(actual, clean, where, name):
    """The entries where `where` holds (broadcast over trailing features) are those of the
    clean run, bit for bit."""
    mask = np.broadcast_to(where.reshape(where.shape + (1,) * (actual.ndim - where.ndim)),
                           actual.shape)
    assert not np.isnan(clean[mask]).any(), name
    np.testing.assert_array_equal(actual[mask], clean[mask], err_msg=name)


@pytest.mark.parametrize("value", sorted(VALUES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case, poison", POISON_PARAMS)
def test_poison_reaches_exactly_what_depends_on_it(case, poison, form, dtype, value):
    shape, kw = CASES[case]
    o, lse, grads = run(poisoned(case, poison, VALUES[value]), kw, form, dtype)
    o_clean, lse_clean, grads_clean = clean_run(case, form, dtype)
    o_ref, lse_ref, grads_sel = oracle(case, poison, value)
    assert_close(o, o_ref, tol_out(dtype), name="o")
    assert_close(lse, lse_ref, tol_out(dtype), name="lse")
    for name in ("q", "k", "v"):
        assert_close(grads[name], grads_sel[name], tol_grad(dtype), name=f"d{name}")
    # what cannot depend on the poison is bit for bit the clean run
    rows, keys, dv_keys = reached(case, poison)
    assert_same_bits(o, o_clean, ~rows, "o")
    assert_same_bits(lse, lse_clean, ~rows, "lse")
    assert_same_bits(grads["q"], grads_clean["q"], ~rows, "dq")
    assert_same_bits(grads["k"], grads_clean["k"], ~keys, "dk")
    assert_same_bits(grads["v"], grads_clean["v"], ~dv_keys, "dv")
    # and a NaN is never lost where the math makes it certain
    name, f = poison[0], poison[4]
    if value == "nan" and name in ("q", "k"):
        assert np.isnan(o[rows]).all() and np.isnan(lse[rows]).all()
        assert np.isnan(grads["q"][rows]).all()
        assert np.isnan(grads["k"][keys]).all() and np.isnan(grads["v"][keys]).all()
    if value == "nan" and name == "v":
        assert np.isnan(o[rows][:, f]).all() and np.all(np.isfinite(lse[rows]))
        assert np.isnan(grads["q"][rows]).all() and np.isnan(grads["k"][keys]).all()
        assert np.all(np.isfinite(grads["v"]))
    if value == "nan" and name in ("do", "dlse"):
        assert np.isnan(grads["q"][rows]).all() and np.isnan(grads["k"][keys]).all()
        if name == "do":
            assert np.isnan(grads["v"][dv_keys][:, f]).all()


def test_poison_table_reaches_and_spares():
    """Each case poisons a key some query sees, and a key hidden from a query that sees
    other keys (the one-query decode case included)."""
    for case, poisons in POISONS.items():
        vis = visibility(*CASES[case])
        keys = [(b, t) for name, b, t, _, _ in poisons if name in ("k", "v")]
        assert any(vis[b, :, t].any() for b, t in keys), case
        assert any((vis[b].any(axis=1) & ~vis[b, :, t]).any() for b, t in keys), case


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("form", FORMS)
def test_return_lse_false_same_nan_rows(form, dtype):
    """Without return_lse (cotangent do alone) the same o, and gradients as the oracle with
    dlse = 0."""
    case, poison = "causal_gqa_T200", ("k", 0, 120, 0, 15)
    shape, kw = CASES[case]
    data = poisoned(case, poison, np.nan)
    q, k, v, do = (np.asarray(data[n], dtype) for n in ("q", "k", "v", "do"))
    o, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, form=form, **kw)
    np.testing.assert_array_equal(o, run(data, kw, form, dtype)[0])
    grads = pullback(do)
    _, _, grads_sel = select_oracle(data["q"], data["k"], data["v"], data["do"],
                                    np.zeros(shape[:2] + shape[3:4]), shape, kw)
    for name in ("q", "k", "v"):
        assert_close(grads[name], grads_sel[name], tol_grad(dtype), name=f"d{name}")
    assert np.isnan(o[0, 120:]).all() and np.all(np.isfinite(o[0, :120]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("form", FORMS)
def test_kv_garbage_past_the_end(form, dtype):
    """Rows past a sequence's end hold garbage (np.empty's NaN, inf, huge values): with
    cu_seqlens the other sequence's every output and gradient is the clean run's, bit for
    bit; with causal masking alone the rows before the garbage keep their o, lse and dq."""
    B, T, H, Hk, Dk, Dv, L = 1, 260, 2, 1, 16, 8, 170
    q, k, v = make_inputs(5, B, T, T, H, Hk, Dk, Dv)
    do = f32_exact(np.random.default_rng(6).standard_normal((B, T, H, Dv)))
    r = np.random.default_rng(7)
    qd, kd, vd, dod = (np.asarray(a, dtype) for a in (q, k, v, do))
    kg, vg = kd.copy(), vd.copy()
    for a in (kg, vg):
        a[:, L:] = r.choice([np.nan, np.inf, -np.inf, 3e38], size=(B, T - L, Hk, 1))
    for kw, rows in ((dict(cu_seqlens=np.array([0, L, T])), slice(0, L)),
                     (dict(causal=True), slice(0, L))):
        outs = {}
        for name, (kk, vv) in (("clean", (kd, vd)), ("garbage", (kg, vg))):
            o, pullback = pyattn.vjp(pyattn.softmax_attention, qd, kk, vv, form=form, **kw)
            outs[name] = (o, pullback(dod))
        (o_c, g_c), (o_g, g_g) = outs["clean"], outs["garbage"]
        assert np.all(np.isfinite(o_c))
        np.testing.assert_array_equal(o_g[:, rows], o_c[:, rows])
        np.testing.assert_array_equal(g_g["q"][:, rows], g_c["q"][:, rows])
        if "cu_seqlens" in kw:  # the keys of sequence 0 are seen by its queries only
            np.testing.assert_array_equal(g_g["k"][:, rows], g_c["k"][:, rows])
            np.testing.assert_array_equal(g_g["v"][:, rows], g_c["v"][:, rows])
        assert not np.all(np.isfinite(o_g[:, L:]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("form", FORMS)
def test_visible_scores_all_neg_inf_give_nan(form, dtype):
    """Every visible score -inf is 0/0 in the softmax, NaN as in the oracle; a row with no
    visible key keeps o = 0, lse = -inf (Tq > Tk causal: the first rows)."""
    q, k, v = make_inputs(8, 1, 30, 20, 2, 2, 8, 8)
    k[..., 0] = np.abs(k[..., 0]) + 0.5
    q[0, 20, 1] = 0.0
    q[0, 20, 1, 0] = -np.inf  # every score of row 20, head 1: -inf
    qd, kd, vd = (np.asarray(a, dtype) for a in (q, k, v))
    (o, lse), pullback = pyattn.vjp(pyattn.softmax_attention, qd, kd, vd, causal=True,
                                    form=form, return_lse=True)
    with np.errstate(all="ignore"):
        o_ref, lse_ref = reference.softmax_attention(q, k, v, causal=True, return_lse=True)
    assert np.isnan(o_ref[0, 20, 1]).all() and np.isnan(lse_ref[0, 20, 1])
    assert_close(o, o_ref, tol_out(dtype), name="o")
    assert_close(lse, lse_ref, tol_out(dtype), name="lse")
    assert np.all(o[0, :10] == 0) and np.all(lse[0, :10] == -np.inf)
    grads = pullback((np.ones_like(o), np.zeros_like(lse)))
    assert np.isnan(grads["q"][0, 20, 1]).all()
    assert np.all(grads["q"][0, :10] == 0)
    assert np.isnan(grads["k"][0, :11, 1]).all() and np.isnan(grads["v"][0, :11, 1]).all()
    assert np.all(np.isfinite(grads["k"][0, 11:, 1])) and np.all(np.isfinite(grads["v"][:, :, 0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_feature_map_softmax_nonfinite(dtype):
    """feature_map(x, "softmax"): a row with NaN, inf, or all -inf gives NaN as the oracle
    does; -inf alone is a 0 weight; other rows and their gradients are untouched. D covers
    vector tails."""
    r = np.random.default_rng(9)
    for D in (1, 3, 8, 16, 17, 33):
        x = f32_exact(r.standard_normal((6, D)))
        x[1, D // 2] = np.nan
        x[2, D - 1] = np.inf
        x[3, 0] = -np.inf
        x[4] = -np.inf
        dy = f32_exact(r.standard_normal((6, D)))
        dy[5, D // 3] = np.nan
        xd, dyd = np.asarray(x, dtype), np.asarray(dy, dtype)
        y, pullback = pyattn.vjp(pyattn.feature_map, xd, "softmax")
        with np.errstate(all="ignore"):
            y_ref = reference.feature_map(x, "softmax")
            dx_ref = y_ref * (dy - (y_ref * dy).sum(axis=-1, keepdims=True))
        nan_rows = [1, 2, 4] if D > 1 else [1, 2, 3, 4]  # D = 1: row 3 is all -inf
        finite_rows = [r for r in range(6) if r not in nan_rows]
        assert np.isnan(y[nan_rows]).all() and np.all(np.isfinite(y[finite_rows]))
        assert_close(y, y_ref, tol_out(dtype), name=f"y D={D}")
        dx = pullback(dyd)["x"]
        assert np.isnan(dx[nan_rows + [5]]).all()
        if D > 1:
            assert y[3, 0] == 0 and dx[3, 0] == 0
        assert_close(dx, dx_ref, tol_grad(dtype), name=f"dx D={D}")
        clean = pullback(np.where(np.isnan(dyd), 0, dyd))["x"]
        np.testing.assert_array_equal(dx[:5], clean[:5])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_alibi_slopes_must_be_finite(bad):
    q, k, v = make_inputs(10, 1, 6, 6, 2, 2, 4, 4)
    slopes = np.array([0.5, bad])
    for call in (pyattn.softmax_attention,
                 lambda *a, **kw: pyattn.vjp(pyattn.softmax_attention, *a, **kw)):
        with pytest.raises(ValueError, match="alibi_slopes"):
            call(q, k, v, causal=True, alibi_slopes=slopes)


def core_forward_backward(q, k, v, do, form, causal, left, right, sinks):
    """_core.softmax_forward and softmax_backward called directly with these mask bounds."""
    B, Tq, H, Dk = q.shape
    Tk = k.shape[1]
    cu_q = np.arange(B + 1, dtype=np.int64) * Tq
    cu_k = np.arange(B + 1, dtype=np.int64) * Tk
    opts = (cu_q, cu_k, form, causal, left, right, sinks, None, 0.0, Dk ** -0.5)
    o = np.empty(q.shape[:3] + (v.shape[3],), q.dtype)
    lse = np.empty(q.shape[:3], q.dtype)
    _core.softmax_forward(q, k, v, o, lse, *opts, False)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    _core.softmax_backward(q, k, v, o, lse, do, None, dq, dk, dv, *opts, False)
    return o, lse, dq, dk, dv


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("form", [_core.FORM_PARALLEL, _core.FORM_FLASH, _core.FORM_RECURRENT],
                         ids=["parallel", "flash", "recurrent"])
@pytest.mark.parametrize("Tq, Tk", [(7, 11), (11, 7), (1, 9), (200, 200)])
def test_core_bounds_at_int64_max(Tq, Tk, form, dtype):
    """window_left, window_right and sinks at INT64_MAX, the largest value _core admits, mean
    no bound: the same bits as -1 (unbounded) and, for sinks, as every key a sink. Tq > Tk
    puts the first queries at negative positions."""
    q, k, v = (np.asarray(a, dtype) for a in make_inputs(11, 2, Tq, Tk, 2, 1, 8, 8))
    do = np.asarray(np.random.default_rng(12).standard_normal((2, Tq, 2, 8)), dtype)
    for causal in (False, True):
        unbounded = core_forward_backward(q, k, v, do, form, causal, -1, -1, 0)
        assert np.isfinite(unbounded[1]).any()
        for left, right, sinks in ((INT64_MAX, INT64_MAX, 0), (-1, INT64_MAX, 0),
                                   (INT64_MAX, -1, 0), (INT64_MAX, INT64_MAX, INT64_MAX),
                                   (0, 0, INT64_MAX), (-1, -1, INT64_MAX)):
            got = core_forward_backward(q, k, v, do, form, causal, left, right, sinks)
            for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, unbounded):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} {(left, right, sinks)}")

"""merge_attention_states: the parts of softmax attention over disjoint key sets merge into
one call over their union (the flash-decoding / ring-attention identity), forward and
backward; empty rows, NaN, bad input."""
import numpy as np
import pytest

import pyattn
from pyattn.testing import assert_close, finite_differences

from conftest import raises

SPLITS = [[0, 13], [0, 4, 9, 13], [0, 1, 2, 7, 13], [0, 0, 6, 13, 13]]  # empty parts included


def qkv(rng, dtype=np.float64, B=2, Tq=5, Tk=13, H=4, Hk=2, D=3, Dv=2):
    return (rng.standard_normal((B, Tq, H, D)).astype(dtype),
            rng.standard_normal((B, Tk, Hk, D)).astype(dtype),
            rng.standard_normal((B, Tk, Hk, Dv)).astype(dtype))


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("cuts", SPLITS, ids=[str(len(c) - 1) for c in SPLITS])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_identity(rng, cuts, causal, dtype):
    """Attend to each key range (a causal mask shifted to the range's place: window bounds
    keep the bottom-right alignment of the whole), merge, and get one call, forward and
    backward (q's gradient sums over the parts; k's and v's are the parts' rows)."""
    q, k, v = qkv(rng, dtype)
    Tq, Tk = q.shape[1], k.shape[1]
    do = rng.standard_normal((*q.shape[:3], v.shape[3])).astype(dtype)
    dlse = rng.standard_normal(q.shape[:3]).astype(dtype)
    (o, lse), pb = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=causal, return_lse=True)
    whole = pb((do, dlse))
    os, lses, pbs = [], [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        # keys a..b-1 of the whole; query i sees key j iff j <= i + Tk - Tq (causal)
        kw = dict(return_lse=True)
        if causal:  # in the part's own indices j' = j - a: j' <= i + (Tk - Tq - a)
            kw["window"] = (-1, Tk - Tq - a - (b - a - Tq))
            kw["causal"] = False
        (op, lp), pbp = pyattn.vjp(pyattn.softmax_attention, q, np.ascontiguousarray(k[:, a:b]),
                                   np.ascontiguousarray(v[:, a:b]), **kw)
        os.append(op)
        lses.append(lp)
        pbs.append(pbp)
    (mo, ml), mpb = pyattn.vjp(pyattn.merge_attention_states, os, lses)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    assert_close(mo, o, tol)
    assert_close(ml, lse, tol)
    g = mpb((do, dlse))
    dq = np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for (a, b), pbp, dop, dlp in zip(zip(cuts[:-1], cuts[1:]), pbs, g["os"], g["lses"]):
        gp = pbp((dop, dlp))
        dq += gp["q"]
        dk[:, a:b] = gp["k"]
        dv[:, a:b] = gp["v"]
    gtol = 1e-12 if dtype == np.float64 else 1e-4
    assert_close(dq, whole["q"], gtol, name="dq")
    assert_close(dk, whole["k"], gtol, name="dk")
    assert_close(dv, whole["v"], gtol, name="dv")


def test_finite_differences(rng):
    P, shape = 3, (1, 3, 2)
    os = [rng.standard_normal(shape + (2,)) for _ in range(P)]
    lses = [rng.standard_normal(shape) for _ in range(P)]
    do, dlse = rng.standard_normal(shape + (2,)), rng.standard_normal(shape)
    _, pb = pyattn.vjp(pyattn.merge_attention_states, os, lses)
    g = pb((do, dlse))

    def loss():
        o, lse = pyattn.merge_attention_states(os, lses)
        return np.sum(o * do) + np.sum(lse * dlse)

    for name, parts in (("os", os), ("lses", lses)):
        for p, x in enumerate(parts):
            error = np.abs(finite_differences(loss, x) - g[name][p])
            assert np.all(error < 1e-8), (name, p, error.max())


def test_empty_rows_and_nan(rng):
    shape = (1, 2, 1)
    os = [rng.standard_normal(shape + (3,)) for _ in range(2)]
    lses = [np.array([[[-np.inf], [0.5]]]), np.array([[[-np.inf], [-np.inf]]])]
    (o, lse), pb = pyattn.vjp(pyattn.merge_attention_states, os, lses)
    assert np.all(o[0, 0] == 0) and lse[0, 0, 0] == -np.inf
    assert np.array_equal(o[0, 1], os[0][0, 1]) and lse[0, 1, 0] == 0.5
    g = pb((np.ones_like(o), np.ones_like(lse)))
    assert all(np.all(np.isfinite(x)) for x in g["os"] + g["lses"])
    assert np.all(g["os"][1] == 0)
    lses[1] = np.array([[[np.nan], [-np.inf]]])
    o, lse = pyattn.merge_attention_states(os, lses)
    assert np.all(np.isnan(o[0, 0])) and np.isnan(lse[0, 0, 0])
    assert np.array_equal(o[0, 1], os[0][0, 1])


def test_bad_input(rng):
    o = rng.standard_normal((1, 2, 3, 4))
    lse = rng.standard_normal((1, 2, 3))
    f = pyattn.merge_attention_states
    raises(ValueError, f, [o, o], [lse], must=("same number",))
    raises(ValueError, f, [o, o[..., :2]], [lse, lse], must=("os[1]",))
    raises(ValueError, f, [o], [lse[..., :2]], must=("lses[0]",))
    raises(TypeError, f, [o, o.astype(np.float32)], [lse, lse], must=("os[1]",))
    raises(TypeError, f, o, lse, must=("sequences",))

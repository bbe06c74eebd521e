"""pyattn.mla_attention: both forms against the float64 oracle (pyattn.reference.mla_attention,
a loop over heads and queries) and against each other, forward and backward; gradients
against finite differences; the absorbed form's attention call is MQA over the latent
cache; bad input."""
from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn.testing import TOLERANCES, assert_close, check_forms, gradcheck

FORMS = ("naive", "absorbed")
DTYPES = (np.float64, np.float32)
NAMES = ("q_nope", "q_rope", "c_kv", "k_rope", "w_uk", "w_uv")


def make(seed, B, T, Tk, H, Dn, Dr, Dc, Dv, dtype=np.float64):
    """The six inputs, float32-representable (one float64 oracle serves both dtypes); the
    weights scaled by Dc ** -0.5 as a trained model's, so scores stay O(1)."""
    rng = np.random.default_rng(seed)
    shapes = ((B, T, H, Dn), (B, T, H, Dr), (B, Tk, Dc), (B, Tk, Dr), (Dc, H, Dn), (Dc, H, Dv))
    arrs = [rng.standard_normal(s) for s in shapes]
    arrs[4] *= Dc ** -0.5
    arrs[5] *= Dc ** -0.5
    return tuple(a.astype(np.float32).astype(dtype) for a in arrs)


# name: ((B, T, Tk, H, Dn, Dr, Dc, Dv), kwargs)
CASES = {
    "prefill_causal": ((2, 33, 33, 3, 16, 8, 24, 12), dict(causal=True)),
    "prefill_noncausal": ((1, 20, 20, 2, 8, 4, 16, 8), dict(causal=False)),
    "decode_T1": ((2, 1, 41, 4, 16, 8, 32, 16), dict(causal=True)),
    "chunk_Tq_lt_Tk": ((1, 7, 30, 2, 8, 4, 16, 12), dict(causal=True)),
    "Tq_gt_Tk_empty_rows": ((1, 9, 5, 2, 8, 4, 16, 8), dict(causal=True)),
    "no_rope_Dr0": ((1, 12, 12, 2, 8, 0, 16, 8), dict(causal=True)),
    "scale_given": ((1, 10, 14, 2, 8, 4, 16, 8), dict(causal=True, scale=0.3)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forms_match_the_oracle_and_each_other(case, dtype):
    dims, kw = CASES[case]
    args = make(1, *dims, dtype=dtype)
    ref = reference.mla_attention(*args, **kw)
    outs = {}
    for form in FORMS:
        o = pyattn.mla_attention(*args, **kw, form=form)
        assert o.dtype == dtype and o.shape == ref.shape
        assert_close(o, ref, TOLERANCES[np.dtype(dtype)][0], name=f"{case} {form}")
        outs[form] = o
    if case == "Tq_gt_Tk_empty_rows":  # the first T - Tk queries see no key: zeros
        assert np.all(ref[:, :4] == 0) and np.all(outs["absorbed"][:, :4] == 0)
    check_forms("mla_attention", args, kw)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False), dict(causal=True, scale=0.7)],
                         ids=["causal", "noncausal", "scale"])
@pytest.mark.parametrize("dims", [(1, 3, 4, 2, 3, 2, 4, 2), (2, 1, 5, 2, 2, 1, 3, 3)],
                         ids=["prefill_Tq3_Tk4", "decode_Tq1_Tk5"])
@pytest.mark.parametrize("form", FORMS)
def test_gradients_against_finite_differences(form, dims, kw):
    args = make(2, *dims)
    errs = gradcheck("mla_attention", args, dict(kw, form=form))
    assert set(errs) == set(NAMES)


@pytest.mark.parametrize("case", ["prefill_causal", "decode_T1", "chunk_Tq_lt_Tk", "no_rope_Dr0"])
def test_float32_gradients_match_float64(case):
    """Each form's float32 gradients within 1e-4 of the float64 ones (which the finite
    differences and check_forms hold to the oracle)."""
    dims, kw = CASES[case]
    a64 = make(3, *dims)
    a32 = tuple(a.astype(np.float32) for a in a64)
    do = np.random.default_rng(4).standard_normal((dims[0], dims[1], dims[3], dims[7]))
    g64 = pyattn.vjp(pyattn.mla_attention, *a64, **kw, form="naive")[1](do)
    for form in FORMS:
        g32 = pyattn.vjp(pyattn.mla_attention, *a32, **kw, form=form)[1](do.astype(np.float32))
        assert set(g32) == set(NAMES)
        for name in NAMES:
            assert g32[name].dtype == np.float32 and g32[name].shape == a32[NAMES.index(name)].shape
            assert_close(g32[name], g64[name], TOLERANCES[np.dtype(np.float32)][1], name=f"{form} d{name}")


def test_absorbed_attends_over_the_latent_cache_as_mqa(monkeypatch):
    """The absorbed form calls softmax_attention once with one KV head whose keys are
    [c_kv ; k_rope] and whose values are c_kv themselves, queries of Dc + Dr; the naive form
    with H decompressed heads of Dn + Dr and Dv."""
    from pyattn import mla

    B, T, Tk, H, Dn, Dr, Dc, Dv = 2, 1, 9, 4, 8, 4, 16, 6
    args = make(5, B, T, Tk, H, Dn, Dr, Dc, Dv)
    calls = []

    def spy(q, k, v, **kw):
        calls.append((q, k, v, kw))
        return pyattn.softmax_attention(q, k, v, **kw)

    monkeypatch.setattr(mla, "softmax_attention", spy)
    pyattn.mla_attention(*args, form="absorbed")
    (q, k, v, kw), = calls
    assert q.shape == (B, T, H, Dc + Dr) and k.shape == (B, Tk, 1, Dc + Dr) and v.shape == (B, Tk, 1, Dc)
    np.testing.assert_array_equal(k[:, :, 0, :Dc], args[2])
    np.testing.assert_array_equal(k[:, :, 0, Dc:], args[3])
    np.testing.assert_array_equal(v[:, :, 0], args[2])
    assert kw == dict(causal=True, scale=(Dn + Dr) ** -0.5)
    calls.clear()
    pyattn.mla_attention(*args, form="naive")
    (q, k, v, kw), = calls
    assert q.shape == (B, T, H, Dn + Dr) and k.shape == (B, Tk, H, Dn + Dr) and v.shape == (B, Tk, H, Dv)


def test_zero_cotangent_and_repeated_pullback():
    args = make(6, 1, 5, 8, 2, 4, 2, 8, 4)
    for form in FORMS:
        o, pullback = pyattn.vjp(pyattn.mla_attention, *args, form=form)
        zero = pullback(None)
        assert all(np.all(zero[n] == 0) for n in NAMES)
        do = np.ones_like(o)
        first, second = pullback(do), pullback((do,))
        for n in NAMES:
            np.testing.assert_array_equal(first[n], second[n])
            assert first[n].flags.c_contiguous


@pytest.mark.parametrize("B,T,Tk", [(1, 0, 4), (1, 3, 0), (0, 2, 3)], ids=["T0", "Tk0_no_keys", "B0"])
def test_empty_sizes(B, T, Tk):
    """No queries, no keys (every row empty: zeros and zero gradients) or no sequences."""
    args = make(9, B, T, Tk, 2, 3, 2, 4, 2)
    for form in FORMS:
        o, pullback = pyattn.vjp(pyattn.mla_attention, *args, form=form)
        assert o.shape == (B, T, 2, 2) and np.all(o == 0)
        grads = pullback(np.ones_like(o))
        for name, a in zip(NAMES, args):
            assert grads[name].shape == a.shape and np.all(grads[name] == 0)


def test_default_form_is_naive_and_array_likes_work():
    args = make(7, 1, 3, 4, 2, 3, 2, 4, 2)
    o = pyattn.mla_attention(*args)
    np.testing.assert_array_equal(o, pyattn.mla_attention(*args, form="naive"))
    assert_close(pyattn.mla_attention(*(a.tolist() for a in args), form="absorbed"), o)


# ---------------------------------------------------------------------------- bad input

GOOD = dict(B=2, T=3, Tk=5, H=2, Dn=4, Dr=2, Dc=6, Dv=3)


def good_args():
    return list(make(8, *GOOD.values()))


@pytest.mark.parametrize("index,shape,words", [
    (0, (2, 3, 2), "'q_nope' must be 4-D [B, T, H, Dn]"),
    (1, (2, 3, 2, 2, 1), "'q_rope' must be 4-D [B, T, H, Dr]"),
    (2, (2, 5, 6, 1), "'c_kv' must be 3-D [B, Tk, Dc]"),
    (3, (2, 5), "'k_rope' must be 3-D [B, Tk, Dr]"),
    (4, (6, 8), "'w_uk' must be 3-D [Dc, H, Dn]"),
    (5, (6, 2, 3, 1), "'w_uv' must be 3-D [Dc, H, Dv]"),
    (1, (2, 4, 2, 2), "'q_rope' must have shape (2, 3, 2, 2)"),
    (1, (2, 3, 3, 2), "'q_rope' must have shape (2, 3, 2, 2)"),
    (2, (1, 5, 6), "batch sizes must match, got q_nope=2, c_kv=1"),
    (3, (2, 5, 3), "'k_rope' must have shape (2, 5, 2)"),
    (3, (2, 4, 2), "'k_rope' must have shape (2, 5, 2)"),
    (4, (6, 3, 4), "'w_uk' must have shape (6, 2, 4)"),
    (4, (5, 2, 4), "'w_uk' must have shape (6, 2, 4)"),
    (4, (6, 2, 5), "'w_uk' must have shape (6, 2, 4)"),
    (5, (7, 2, 3), "'w_uv' must have shape (6, 2, 3)"),
    (5, (6, 1, 3), "'w_uv' must have shape (6, 2, 3)"),
    (5, (6, 2, 0), "w_uv's Dv must be >= 1, got 0"),
    (0, (2, 3, 0, 4), "q_nope's H must be >= 1, got 0"),
])
def test_bad_shapes_name_the_argument(index, shape, words):
    args = good_args()
    args[index] = np.zeros(shape)
    for form in FORMS:
        with pytest.raises(ValueError) as e:
            pyattn.mla_attention(*args, form=form)
        assert str(e.value).startswith("mla_attention(): ") and words in str(e.value), str(e.value)


def test_bad_dtypes_name_the_argument():
    args = good_args()
    args[3] = args[3].astype(np.float32)
    with pytest.raises(TypeError, match="'k_rope' is float32"):
        pyattn.mla_attention(*args)
    args = good_args()
    args[4] = args[4].astype(np.int64)
    with pytest.raises(TypeError, match="'w_uk' must be float32 or float64, got int64"):
        pyattn.mla_attention(*args)
    with pytest.raises(TypeError, match="'c_kv' must be an array"):
        pyattn.mla_attention(*good_args()[:2], None, *good_args()[3:])


def test_bad_options():
    args = good_args()
    with pytest.raises(ValueError, match=r"mla_attention\(\): form must be one of \('naive', 'absorbed'\), got 'flash'"):
        pyattn.mla_attention(*args, form="flash")
    with pytest.raises(TypeError, match="'causal' must be a bool"):
        pyattn.mla_attention(*args, causal=1)
    with pytest.raises(ValueError, match="'scale' must be finite"):
        pyattn.mla_attention(*args, scale=float("nan"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'window'"):
        pyattn.mla_attention(*args, window=(3, 0))
    o, pullback = pyattn.vjp(pyattn.mla_attention, *args)
    with pytest.raises(ValueError, match=r"mla_attention pullback\(\): 'do' must have shape \(2, 3, 2, 3\)"):
        pullback(np.ones((2, 3, 2, 4)))
    with pytest.raises(TypeError, match=r"mla_attention pullback\(\): all float arrays must share one dtype"):
        pullback(np.ones(o.shape, dtype=np.float32))

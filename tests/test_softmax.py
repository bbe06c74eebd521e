"""pyattn.softmax_attention: every form x dtype against the float64 oracles (docs/ops.md).

Forward: pyattn.reference.softmax_attention (the literal loop). Gradients: finite differences
(pyattn.testing.gradcheck) on tiny shapes, the dense NumPy backward of conftest.dense_softmax
on larger ones (float64 within 1e-10, float32 within 1e-4), and the forms against each other
(pyattn.testing.check_forms) at T ~ 300, where the flash form uses several query blocks (48
or 64 rows) and key blocks (256).
"""
from __future__ import annotations

import functools
import inspect

import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn.testing import TOLERANCES, assert_close, check_forms, gradcheck

from conftest import dense_softmax, f32_exact, make_inputs

FORMS = ("parallel", "flash", "recurrent")
DTYPES = (np.float64, np.float32)


def tol_out(dtype):
    return TOLERANCES[np.dtype(dtype)][0]


def tol_grad(dtype):
    return TOLERANCES[np.dtype(dtype)][1]


def grad_atol(dtype, grads):
    """Absolute floor of the gradient comparison, for a gradient that is exactly zero by
    cancellation (Tk = 1: dq = dk = 0): float64 keeps testing.assert_close's 1e-12; float32
    rounding leaves eps-sized residue, so its floor is the float32 gradient tolerance times
    the scale of the problem's gradients."""
    if np.dtype(dtype) == np.float64:
        return 1e-12
    scale = max(float(np.sqrt(np.mean(g ** 2))) if g.size else 0.0 for g in grads.values())
    return max(tol_grad(dtype) * scale, 1e-12)


def cast(kwargs, dtype):
    """kwargs with alibi_slopes as an array of dtype."""
    kw = dict(kwargs)
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = np.asarray(kw["alibi_slopes"], dtype=dtype)
    return kw


# name: ((B, Tq, Tk, H, Hk, Dk, Dv), kwargs[, qscale])
CASES = {
    "plain_T63": ((2, 63, 63, 2, 2, 16, 16), {}),
    "causal_T65": ((2, 65, 65, 2, 1, 16, 16), dict(causal=True)),
    "causal_T1": ((3, 1, 1, 2, 2, 8, 8), dict(causal=True)),
    "plain_T1": ((1, 1, 1, 2, 1, 8, 8), {}),
    "causal_T300": ((1, 300, 300, 2, 1, 16, 16), dict(causal=True)),
    "plain_T300": ((1, 300, 300, 1, 1, 8, 8), {}),
    "window_-1_0": ((1, 65, 65, 2, 2, 16, 16), dict(window=(-1, 0))),
    "window_5_0_causal": ((2, 65, 65, 2, 1, 16, 16), dict(causal=True, window=(5, 0))),
    "window_3_7": ((1, 63, 63, 2, 2, 16, 16), dict(window=(3, 7))),
    "window_3_7_causal": ((1, 63, 63, 2, 2, 16, 16), dict(causal=True, window=(3, 7))),
    "window_0_0": ((1, 33, 33, 2, 2, 8, 8), dict(window=(0, 0))),
    "window_7_-1": ((1, 33, 33, 2, 2, 8, 8), dict(window=(7, -1))),
    "window_300_100_130": ((1, 300, 300, 2, 2, 8, 8), dict(window=(100, 130))),
    "sinks_window_causal": ((2, 65, 65, 2, 2, 16, 16), dict(causal=True, window=(4, 0), sinks=3)),
    "sinks_window_noncausal": ((1, 63, 63, 2, 2, 8, 8), dict(window=(2, 2), sinks=5)),
    "sinks_no_window": ((1, 33, 33, 2, 2, 8, 8), dict(causal=True, sinks=2)),
    "alibi_causal": ((2, 63, 63, 2, 2, 16, 16), dict(causal=True, alibi_slopes=[0.5, 0.0625])),
    "alibi_noncausal": ((1, 65, 65, 2, 1, 16, 16), dict(alibi_slopes=[0.25, 0.03125])),
    "softcap": ((1, 65, 65, 2, 2, 16, 16), dict(softcap=2.0, scale=1.0)),
    "softcap_alibi_window": ((1, 65, 65, 2, 1, 16, 8),
                             dict(causal=True, softcap=1.5, alibi_slopes=[0.3, 0.1], window=(20, 0), sinks=1)),
    "mqa_h4_hk1": ((1, 33, 33, 4, 1, 8, 8), dict(causal=True)),
    "gqa_h4_hk2": ((2, 33, 33, 4, 2, 8, 8), dict(causal=True)),
    "mha_h4_hk4": ((1, 33, 33, 4, 4, 8, 8), dict(causal=True)),
    "dk24_dv8": ((2, 40, 40, 2, 1, 24, 8), dict(causal=True)),
    "dk5_dv11": ((1, 37, 37, 2, 2, 5, 11), {}),
    "decode_tq1": ((2, 1, 77, 4, 2, 16, 16), dict(causal=True)),
    "decode_tq1_window_sinks": ((1, 1, 300, 2, 1, 16, 16), dict(causal=True, window=(100, 0), sinks=4)),
    "decode_tq17_tk300": ((1, 17, 300, 2, 1, 16, 8), dict(causal=True)),
    "decode_tq70_tk300_window": ((1, 70, 300, 2, 2, 8, 8), dict(causal=True, window=(31, 0))),
    "tq_gt_tk_causal": ((2, 40, 25, 2, 1, 8, 8), dict(causal=True)),
    "tq_gt_tk_causal_sinks": ((1, 40, 25, 2, 2, 8, 8), dict(causal=True, sinks=4)),
    "tq_gt_tk_noncausal": ((1, 40, 25, 2, 2, 8, 8), {}),
    "tq_gt_tk_window_0_0": ((1, 70, 65, 2, 2, 8, 8), dict(window=(0, 0))),
    "tq300_tk40_causal": ((1, 300, 40, 2, 1, 8, 8), dict(causal=True)),
    "scale_0.37": ((1, 33, 33, 2, 2, 16, 16), dict(scale=0.37)),
    "scale_negative": ((1, 33, 33, 2, 2, 16, 16), dict(scale=-0.8, causal=True)),
    "peaky_scores": ((1, 65, 65, 2, 2, 16, 16), dict(causal=True), 4.0),
    "T300_all_options": ((1, 300, 300, 2, 1, 16, 16),
                         dict(causal=True, window=(70, 0), sinks=4, alibi_slopes=[0.25, 0.03], softcap=3.0)),
    "empty_keys": ((1, 5, 0, 2, 2, 8, 8), {}),
    "empty_queries": ((1, 0, 7, 2, 2, 8, 8), dict(causal=True)),
}


@functools.lru_cache(maxsize=None)
def case_data(name):
    """(q, k, v float64, kwargs, oracle o, oracle lse); inputs float32-representable."""
    spec = CASES[name]
    (B, Tq, Tk, H, Hk, Dk, Dv), kwargs = spec[0], spec[1]
    qscale = spec[2] if len(spec) > 2 else 1.0
    seed = sum(map(ord, name))
    q, k, v = make_inputs(seed, B, Tq, Tk, H, Hk, Dk, Dv, qscale=qscale)
    kw = cast(kwargs, np.float64)
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = f32_exact(kw["alibi_slopes"])
    o, lse = reference.softmax_attention(q, k, v, return_lse=True, **kw)
    return q, k, v, kw, o, lse


@functools.lru_cache(maxsize=None)
def case_cotangent(name):
    q, k, v, kw, o, lse = case_data(name)
    r = np.random.default_rng(sum(map(ord, name)) + 1)
    do = f32_exact(r.standard_normal(o.shape))
    dlse = f32_exact(np.where(np.isfinite(lse), r.standard_normal(lse.shape), 0))
    return do, dlse


@functools.lru_cache(maxsize=None)
def case_dense_grads(name, with_dlse):
    q, k, v, kw, _, _ = case_data(name)
    do, dlse = case_cotangent(name)
    return dense_softmax(q, k, v, do, dlse if with_dlse else None, **kw)


def as_dtype(arrays, dtype):
    return tuple(np.asarray(a, dtype=dtype) for a in arrays)


def masked_rows(lse):
    return ~np.isfinite(lse)


# ------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_helper_matches_reference(case):
    """The vectorised NumPy oracle used for gradients agrees with pyattn.reference."""
    q, k, v, kw, o, lse = case_data(case)
    o2, lse2 = dense_softmax(q, k, v, **kw)
    assert_close(o2, o, 1e-13, name="dense o")
    assert_close(lse2, lse, 1e-13, name="dense lse")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_vs_oracle(case, form, dtype):
    q, k, v, kw, o_ref, lse_ref = case_data(case)
    qd, kd, vd = as_dtype((q, k, v), dtype)
    o, lse = pyattn.softmax_attention(qd, kd, vd, form=form, return_lse=True, **cast(kw, dtype))
    assert o.dtype == dtype and lse.dtype == dtype
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape
    assert_close(o, o_ref, tol_out(dtype), name="o")
    assert_close(lse, lse_ref, tol_out(dtype), name="lse")
    # a row with no visible key: o = 0 exactly and lse = -inf
    dead = masked_rows(lse_ref)
    assert np.all(o[dead] == 0)
    assert np.all(lse[dead] == -np.inf)
    assert np.all(np.isfinite(o))
    # return_lse=False returns the same o
    o_only = pyattn.softmax_attention(qd, kd, vd, form=form, **cast(kw, dtype))
    assert isinstance(o_only, np.ndarray)
    np.testing.assert_array_equal(o_only, o)


def test_fully_masked_cases_present():
    """The case table does exercise rows with no visible key (and rows with some)."""
    n_dead = 0
    for name in ("tq_gt_tk_causal", "tq_gt_tk_causal_sinks", "tq_gt_tk_window_0_0", "empty_keys",
                 "tq300_tk40_causal"):
        lse = case_data(name)[5]
        n_dead += masked_rows(lse).sum()
        assert masked_rows(lse).any()
    assert n_dead > 0
    assert np.isfinite(case_data("tq_gt_tk_causal")[5]).any()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_all_rows_masked_every_form(form, dtype):
    """Every row masked: Tq > Tk causal with Tk rows all in the future of the top rows, and a
    window that sees nothing: o = 0, lse = -inf, gradients 0, no NaN."""
    q, k, v = as_dtype(make_inputs(3, 2, 9, 4, 2, 1, 8, 6), dtype)
    for kw in (dict(causal=True, window=(2, -1)),  # rows 0..4 future-only; rows 5.. window
               dict(window=(0, 0))):
        o, lse = pyattn.softmax_attention(q, k, v, form=form, return_lse=True, **kw)
        o_ref, lse_ref = reference.softmax_attention(q, k, v, return_lse=True, **kw)
        assert_close(o, o_ref, tol_out(dtype))
        assert_close(lse, lse_ref, tol_out(dtype))
    # Tq > Tk, causal: bottom-right alignment puts the first Tq - Tk queries before every key
    q, k, v = as_dtype(make_inputs(4, 1, 12, 5, 2, 2, 4, 4), dtype)
    out, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True, form=form,
                               return_lse=True)
    o, lse = out
    assert np.all(o[:, :7] == 0) and np.all(lse[:, :7] == -np.inf)
    assert np.all(np.isfinite(lse[:, 7:]))
    do = np.ones_like(o)
    g = pullback((do, np.where(np.isfinite(lse), 1.0, 0.0).astype(dtype)))
    assert np.all(g["q"][:, :7] == 0)
    for name in "qkv":
        assert np.all(np.isfinite(g[name])), name


# ------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("with_dlse", [False, True], ids=["do", "do+dlse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_grads_vs_dense_oracle(case, form, dtype, with_dlse):
    """float64 grads within 1e-10 and float32 grads within 1e-4 of the float64 NumPy backward."""
    q, k, v, kw, _, _ = case_data(case)
    do, dlse = case_cotangent(case)
    _, _, ref = case_dense_grads(case, with_dlse)
    qd, kd, vd = as_dtype((q, k, v), dtype)
    out, pullback = pyattn.vjp(pyattn.softmax_attention, qd, kd, vd, form=form,
                               return_lse=with_dlse, **cast(kw, dtype))
    cot = (do.astype(dtype), dlse.astype(dtype)) if with_dlse else do.astype(dtype)
    grads = pullback(cot)
    assert set(grads) == {"q", "k", "v"}
    for name, x in zip("qkv", (qd, kd, vd)):
        assert grads[name].dtype == dtype and grads[name].shape == x.shape
        assert_close(grads[name], ref[name], tol_grad(dtype), atol=grad_atol(dtype, ref),
                     name=f"d{name}")


# tiny shapes for finite differences: (B, Tq, Tk, H, Hk, Dk, Dv), kwargs
GRADCHECK_CASES = {
    "plain": ((2, 5, 5, 2, 2, 3, 2), {}),
    "causal": ((1, 6, 6, 2, 1, 3, 3), dict(causal=True)),
    "T1": ((1, 1, 1, 2, 2, 3, 2), dict(causal=True)),
    "window_-1_0": ((1, 6, 6, 2, 2, 3, 2), dict(window=(-1, 0))),
    "window_5_0": ((1, 8, 8, 1, 1, 3, 2), dict(causal=True, window=(5, 0))),
    "window_3_7": ((1, 7, 7, 2, 2, 3, 2), dict(window=(3, 7))),
    "window_0_0": ((1, 5, 5, 2, 1, 2, 2), dict(window=(0, 0))),
    "window_1_1_sinks": ((1, 7, 7, 2, 2, 3, 2), dict(window=(1, 1), sinks=2)),
    "causal_window_sinks": ((1, 8, 8, 2, 1, 3, 2), dict(causal=True, window=(2, 0), sinks=2)),
    "alibi": ((1, 6, 6, 2, 2, 3, 2), dict(causal=True, alibi_slopes=[0.5, 0.125])),
    "softcap": ((1, 6, 6, 2, 2, 3, 2), dict(softcap=1.5, scale=1.3)),
    "softcap_alibi_window": ((1, 7, 7, 2, 1, 3, 2),
                             dict(causal=True, softcap=2.0, alibi_slopes=[0.3, 0.7], window=(3, 0), sinks=1)),
    "mqa_h4_hk1": ((1, 4, 4, 4, 1, 2, 2), dict(causal=True)),
    "gqa_h4_hk2": ((1, 4, 4, 4, 2, 2, 2), {}),
    "mha_h4_hk4": ((1, 4, 4, 4, 4, 2, 2), dict(causal=True)),
    "dk4_dv1": ((1, 5, 5, 2, 1, 4, 1), {}),
    "decode_tq1": ((1, 1, 7, 2, 1, 3, 2), dict(causal=True)),
    "decode_tq3_tk8_window": ((1, 3, 8, 2, 2, 3, 2), dict(causal=True, window=(2, 0))),
    "tq_gt_tk_causal": ((1, 7, 4, 2, 1, 3, 2), dict(causal=True)),
    "tq_gt_tk_noncausal": ((1, 6, 4, 2, 2, 2, 2), {}),
    "scale": ((1, 5, 5, 2, 2, 3, 2), dict(scale=0.7)),
}


@pytest.mark.parametrize("return_lse", [False, True], ids=["o", "o+lse"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", sorted(GRADCHECK_CASES))
def test_gradcheck(case, form, return_lse):
    (B, Tq, Tk, H, Hk, Dk, Dv), kwargs = GRADCHECK_CASES[case]
    q, k, v = make_inputs(sum(map(ord, case)), B, Tq, Tk, H, Hk, Dk, Dv)
    kw = cast(kwargs, np.float64)
    # one thread: finite differences make hundreds of tiny calls (thread-count independence is
    # tested in test_threads.py)
    with pyattn.num_threads(1):
        errs = gradcheck(pyattn.softmax_attention, (q, k, v), dict(kw, form=form, return_lse=return_lse))
    assert set(errs) == {"q", "k", "v"}


@pytest.mark.parametrize("form", FORMS)
def test_gradcheck_varlen(form):
    with pyattn.num_threads(1):
        _gradcheck_varlen(form)


def _gradcheck_varlen(form):
    q, k, v = make_inputs(11, 1, 9, 9, 2, 1, 3, 2)
    cu = np.array([0, 3, 3, 8, 9], dtype=np.int32)
    errs = gradcheck(pyattn.softmax_attention, (q, k, v),
                     dict(cu_seqlens=cu, causal=True, form=form, return_lse=True))
    assert set(errs) == {"q", "k", "v"}
    q, k, v = make_inputs(12, 1, 6, 10, 2, 2, 3, 2)
    errs = gradcheck(pyattn.softmax_attention, (q, k, v),
                     dict(cu_seqlens_q=np.array([0, 2, 2, 6]), cu_seqlens_k=np.array([0, 5, 7, 10]),
                          causal=True, form=form, return_lse=True))
    assert set(errs) == {"q", "k", "v"}


CHECK_FORMS_CASES = {
    "causal_T300": ((1, 300, 300, 2, 1, 16, 16), dict(causal=True, return_lse=True)),
    "plain_T257_gqa": ((1, 257, 257, 4, 2, 8, 12), {}),
    "window_sinks_alibi_softcap_T300": ((1, 300, 300, 2, 2, 16, 8),
                                        dict(causal=True, window=(90, 10), sinks=3,
                                             alibi_slopes=[0.1, 0.02], softcap=4.0, return_lse=True)),
    "decode_tq65_tk300": ((2, 65, 300, 2, 1, 8, 8), dict(causal=True, window=(128, 0))),
    "tq300_tk70_causal": ((1, 300, 70, 2, 2, 8, 8), dict(causal=True, return_lse=True)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("case", sorted(CHECK_FORMS_CASES))
def test_check_forms(case, dtype):
    (B, Tq, Tk, H, Hk, Dk, Dv), kwargs = CHECK_FORMS_CASES[case]
    q, k, v = as_dtype(make_inputs(sum(map(ord, case)), B, Tq, Tk, H, Hk, Dk, Dv), dtype)
    res = check_forms("softmax_attention", (q, k, v), cast(kwargs, dtype))
    assert set(res) == {"parallel", "recurrent"}
    n_out = 2 if kwargs.get("return_lse") else 1
    for errs in res.values():
        assert {f"out[{i}]" for i in range(n_out)} | {"dq", "dk", "dv"} == set(errs)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", ["causal_T300", "T300_all_options", "decode_tq17_tk300", "gqa_h4_hk2"])
def test_float32_grads_match_float64_grads(case, form):
    """The float32 kernel's gradients are within 1e-4 of the float64 kernel's."""
    q, k, v, kw, _, _ = case_data(case)
    do, dlse = case_cotangent(case)
    grads = {}
    for dtype in DTYPES:
        qd, kd, vd = as_dtype((q, k, v), dtype)
        _, pullback = pyattn.vjp(pyattn.softmax_attention, qd, kd, vd, form=form, return_lse=True,
                                 **cast(kw, dtype))
        grads[dtype] = pullback((do.astype(dtype), dlse.astype(dtype)))
    for name in "qkv":
        assert_close(grads[np.float32][name], grads[np.float64][name], 1e-4, name=f"d{name}")


def _random_config(seed):
    """A random shape and option set around the tile edges (query blocks of 48/64, key blocks
    of 256, GEMM panels of 4..32): float64 inputs, kwargs (float64 alibi)."""
    r = np.random.default_rng(seed)
    Tq = int(r.choice([1, 2, 5, 47, 48, 49, 63, 64, 65, 97, 255, 256, 257, 300]))
    Tk = Tq if r.random() < 0.5 else int(r.choice([1, 5, 31, 32, 33, 64, 65, 255, 256, 257, 300]))
    Hk = int(r.choice([1, 2]))
    H = Hk * int(r.choice([1, 2, 3]))
    Dk, Dv = int(r.choice([1, 3, 8, 17])), int(r.choice([1, 2, 8, 13]))
    kw = {}
    if r.random() < 0.6:
        kw["causal"] = True
    if r.random() < 0.6:
        kw["window"] = (int(r.choice([-1, 0, 1, 5, 40, 100, 300])), int(r.choice([-1, 0, 1, 7, 60])))
    if r.random() < 0.4:
        kw["sinks"] = int(r.choice([1, 3, 33, 70]))
    if r.random() < 0.3:
        kw["softcap"] = float(r.choice([0.5, 3.0]))
    if r.random() < 0.3:
        kw["alibi_slopes"] = f32_exact(r.uniform(0, 0.3, H))
    q, k, v = make_inputs(seed, 1, Tq, Tk, H, Hk, Dk, Dv)
    do = f32_exact(r.standard_normal((1, Tq, H, Dv)))
    dlse = f32_exact(r.standard_normal((1, Tq, H)))
    return (q, k, v), kw, do, dlse


@pytest.mark.parametrize("seed", range(24))
def test_random_configs_vs_dense_oracle(seed):
    """Every form x dtype, forward and backward (with a dlse cotangent), against the dense
    NumPy oracle, on random shapes and options."""
    (q, k, v), kw, do, dlse = _random_config(seed)
    o_ref, lse_ref = dense_softmax(q, k, v, **kw)
    dlse = np.where(np.isfinite(lse_ref), dlse, 0)
    _, _, g_ref = dense_softmax(q, k, v, do, dlse, **kw)
    for dtype in DTYPES:
        kwd = cast(kw, dtype)
        for form in FORMS:
            (o, lse), pullback = pyattn.vjp(pyattn.softmax_attention, *as_dtype((q, k, v), dtype),
                                            form=form, return_lse=True, **kwd)
            assert_close(o, o_ref, tol_out(dtype), name=f"{form} o")
            assert_close(lse, lse_ref, tol_out(dtype), name=f"{form} lse")
            g = pullback((do.astype(dtype), dlse.astype(dtype)))
            for name in "qkv":
                assert_close(g[name], g_ref[name], tol_grad(dtype), atol=grad_atol(dtype, g_ref),
                             name=f"{form} d{name}")


# ------------------------------------------------------------------------------- varlen


def _run(q, k, v, kw, do, dlse, form):
    out, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, form=form, return_lse=True, **kw)
    return out[0], out[1], pullback((do, dlse))


@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("form", FORMS)
def test_varlen_equals_separate_sequences(form, dtype, cu_dtype):
    lens = [5, 0, 70, 1, 33, 0]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(cu_dtype)
    T = int(cu[-1])
    q, k, v = as_dtype(make_inputs(21, 1, T, T, 4, 2, 8, 6), dtype)
    r = np.random.default_rng(22)
    do = r.standard_normal((1, T, 4, 6)).astype(dtype)
    dlse = r.standard_normal((1, T, 4)).astype(dtype)
    kw = dict(causal=True, window=(20, 0), sinks=2, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4], dtype))
    o, lse, g = _run(q, k, v, dict(kw, cu_seqlens=cu), do, dlse, form)
    # against the oracles
    o_ref, lse_ref = reference.softmax_attention(q, k, v, cu_seqlens=cu, return_lse=True, **kw)
    assert_close(o, o_ref, tol_out(dtype))
    assert_close(lse, lse_ref, tol_out(dtype))
    _, _, gref = dense_softmax(q, k, v, do, dlse, cu_seqlens=cu, **kw)
    for name in "qkv":
        assert_close(g[name], gref[name], tol_grad(dtype), name=f"d{name}")
    # against one call per sequence
    for s, e in zip(cu[:-1], cu[1:]):
        sl = slice(int(s), int(e))
        if e == s:
            continue
        o1, lse1, g1 = _run(q[:, sl], k[:, sl], v[:, sl], kw, do[:, sl], dlse[:, sl], form)
        assert_close(o[:, sl], o1, tol_out(dtype), name="o piece")
        assert_close(lse[:, sl], lse1, tol_out(dtype), name="lse piece")
        for name in "qkv":
            assert_close(g[name][:, sl], g1[name], tol_grad(dtype), name=f"d{name} piece")
    # int32 and int64 offsets give the same result
    other = cu.astype(np.int64 if cu_dtype == np.int32 else np.int32)
    o2 = pyattn.softmax_attention(q, k, v, cu_seqlens=other, form=form, **kw)
    np.testing.assert_array_equal(o2, o)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("form", FORMS)
def test_varlen_q_k_different_lengths(form, dtype):
    """cu_seqlens_q / cu_seqlens_k: decode-like pieces (tq < tk), a piece with queries but no
    keys (fully masked), a piece with keys but no queries (zero dk, dv), tq > tk."""
    lq = [3, 1, 0, 10, 4, 66]
    lk = [7, 4, 5, 10, 0, 300]
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int64)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    Tq, Tk = int(cq[-1]), int(ck[-1])
    q, k, v = as_dtype(make_inputs(31, 1, Tq, Tk, 2, 1, 8, 4), dtype)
    r = np.random.default_rng(32)
    do = r.standard_normal((1, Tq, 2, 4)).astype(dtype)
    dlse = r.standard_normal((1, Tq, 2)).astype(dtype)
    kw = dict(causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)
    o, lse, g = _run(q, k, v, kw, do, dlse, form)
    o_ref, lse_ref = reference.softmax_attention(q, k, v, return_lse=True, **kw)
    assert_close(o, o_ref, tol_out(dtype))
    assert_close(lse, lse_ref, tol_out(dtype))
    # the piece with 4 queries and no keys
    assert np.all(lse[0, 14:18] == -np.inf) and np.all(o[0, 14:18] == 0)
    _, _, gref = dense_softmax(q, k, v, do, dlse, **kw)
    for name in "qkv":
        assert_close(g[name], gref[name], tol_grad(dtype), name=f"d{name}")
    # keys of the piece without queries get zero gradients
    assert np.all(g["k"][0, 11:16] == 0) and np.all(g["v"][0, 11:16] == 0)
    for n in range(len(lq)):
        qs, qe, ks, ke = int(cq[n]), int(cq[n + 1]), int(ck[n]), int(ck[n + 1])
        if qe == qs or ke == ks:
            continue
        o1, lse1, g1 = _run(q[:, qs:qe], k[:, ks:ke], v[:, ks:ke], dict(causal=True),
                            do[:, qs:qe], dlse[:, qs:qe], form)
        assert_close(o[:, qs:qe], o1, tol_out(dtype))
        assert_close(lse[:, qs:qe], lse1, tol_out(dtype))
        assert_close(g["q"][:, qs:qe], g1["q"], tol_grad(dtype))
        assert_close(g["k"][:, ks:ke], g1["k"], tol_grad(dtype))
        assert_close(g["v"][:, ks:ke], g1["v"], tol_grad(dtype))


def test_varlen_batch_equivalence():
    """B equal sequences are the same as the same sequences packed with cu_seqlens."""
    q, k, v = make_inputs(41, 3, 50, 50, 2, 2, 8, 8)
    kw = dict(causal=True, window=(10, 3))
    for form in FORMS:
        o_b, lse_b = pyattn.softmax_attention(q, k, v, form=form, return_lse=True, **kw)
        cu = np.arange(4) * 50
        o_p, lse_p = pyattn.softmax_attention(*(x.reshape(1, 150, *x.shape[2:]) for x in (q, k, v)),
                                              cu_seqlens=cu, form=form, return_lse=True, **kw)
        assert_close(o_p.reshape(o_b.shape), o_b, 1e-14)
        assert_close(lse_p.reshape(lse_b.shape), lse_b, 1e-14)


# ------------------------------------------------------------------------------- vjp structure


@pytest.mark.parametrize("form", FORMS)
def test_cotangent_structures(form):
    q, k, v = make_inputs(51, 2, 20, 20, 2, 1, 8, 4)
    r = np.random.default_rng(52)
    do = r.standard_normal((2, 20, 2, 4))
    dlse = r.standard_normal((2, 20, 2))
    kw = dict(causal=True, form=form)

    out, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, **kw)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, pyattn.softmax_attention(q, k, v, **kw))
    g_do = pullback(do)
    g_tuple = pullback((do, None))
    g_list = pullback([do, None])
    for name in "qkv":
        np.testing.assert_array_equal(g_tuple[name], g_do[name])
        np.testing.assert_array_equal(g_list[name], g_do[name])
    # pullback may be called again with another cotangent, and is linear in it
    g2 = pullback(2 * do)
    for name in "qkv":
        assert_close(g2[name], 2 * g_do[name], 1e-14)

    out, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, return_lse=True, **kw)
    assert isinstance(out, tuple) and len(out) == 2
    o, lse = out
    o_ref, lse_ref = pyattn.softmax_attention(q, k, v, return_lse=True, **kw)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(lse, lse_ref)
    g_full = pullback((do, dlse))
    g_none = pullback((do, None))
    g_bare = pullback(do)
    g_lse_only = pullback((None, dlse))
    for name in "qkv":
        np.testing.assert_array_equal(g_none[name], g_do[name])
        np.testing.assert_array_equal(g_bare[name], g_do[name])
        assert_close(g_none[name] + g_lse_only[name], g_full[name], 1e-12, name=name)
    # dlse is honoured, and matches the dense oracle
    _, _, ref = dense_softmax(q, k, v, do, dlse, causal=True)
    for name in "qkv":
        assert_close(g_full[name], ref[name], 1e-10, name=name)
    assert not np.allclose(g_full["q"], g_none["q"])
    _, _, ref_lse = dense_softmax(q, k, v, np.zeros_like(do), dlse, causal=True)
    for name in "qkv":
        assert_close(g_lse_only[name], ref_lse[name], 1e-10, name=name)


def test_dlse_gradient_is_softmax_weighted_keys():
    """d lse_i / d q_i = scale * sum_j p_ij k_j: the dlse cotangent alone, checked in closed form."""
    q, k, v = make_inputs(53, 1, 10, 10, 1, 1, 4, 3)
    for form in FORMS:
        (o, lse), pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, return_lse=True, form=form)
        dlse = np.zeros_like(lse)
        dlse[0, 4, 0] = 1.0
        g = pullback((None, dlse))
        s = 0.5 * q[0, 4, 0] @ k[0, :, 0].T
        p = np.exp(s - s.max())
        p /= p.sum()
        np.testing.assert_allclose(g["q"][0, 4, 0], 0.5 * p @ k[0, :, 0], rtol=1e-12, atol=1e-15)
        assert np.all(g["v"] == 0)


def test_inputs_not_modified():
    q, k, v = make_inputs(54, 1, 70, 300, 2, 1, 8, 8)
    alibi = np.array([0.1, 0.2])
    copies = [a.copy() for a in (q, k, v, alibi)]
    r = np.random.default_rng(55)
    do = r.standard_normal((1, 70, 2, 8))
    dlse = r.standard_normal((1, 70, 2))
    cot = (do.copy(), dlse.copy())
    for form in FORMS:
        out, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True, alibi_slopes=alibi,
                                   softcap=2.0, form=form, return_lse=True)
        pullback(cot)
        for a, c in zip((q, k, v, alibi), copies):
            np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(cot[0], do)
        np.testing.assert_array_equal(cot[1], dlse)


# ------------------------------------------------------------------------------- layouts


def _noncontig(a, kind):
    if kind == "transposed":  # a [B,T,H,D] stored as [B,H,T,D]
        return np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if kind == "fortran":
        return np.asfortranarray(a)
    if kind == "strided":  # every other element of a twice-as-large buffer
        big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        big[..., ::2] = a
        return big[..., ::2]
    if kind == "reversed":
        return np.ascontiguousarray(a[:, ::-1])[:, ::-1]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["transposed", "fortran", "strided", "reversed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("form", FORMS)
def test_noncontiguous_inputs(form, dtype, kind):
    q, k, v = as_dtype(make_inputs(61, 2, 37, 45, 4, 2, 8, 6), dtype)
    r = np.random.default_rng(62)
    do = r.standard_normal((2, 37, 4, 6)).astype(dtype)
    dlse = r.standard_normal((2, 37, 4)).astype(dtype)
    alibi = np.array([0.1, 0.2, 0.3, 0.4], dtype)
    kw = dict(causal=True, window=(9, 0), sinks=1, form=form, return_lse=True)
    nq, nk, nv, ndo, ndl = (_noncontig(a, kind) for a in (q, k, v, do, dlse[..., None]))
    ndl = ndl[..., 0]
    nal = alibi[::-1].copy()[::-1]
    for a, b in ((nq, q), (nk, k), (nv, v), (ndo, do), (ndl, dlse), (nal, alibi)):
        np.testing.assert_array_equal(a, b)
    assert not nq.flags.c_contiguous
    (o1, l1), pb1 = pyattn.vjp(pyattn.softmax_attention, q, k, v, alibi_slopes=alibi, **kw)
    (o2, l2), pb2 = pyattn.vjp(pyattn.softmax_attention, nq, nk, nv, alibi_slopes=nal, **kw)
    np.testing.assert_array_equal(o2, o1)
    np.testing.assert_array_equal(l2, l1)
    g1, g2 = pb1((do, dlse)), pb2((ndo, ndl))
    for name in "qkv":
        np.testing.assert_array_equal(g2[name], g1[name])
        assert g2[name].flags.c_contiguous
    assert o2.flags.c_contiguous and l2.flags.c_contiguous


@pytest.mark.parametrize("form", FORMS)
def test_empty_batch(form):
    q, k, v = (np.zeros((0, 5, 2, 4)) for _ in range(3))
    (o, lse), pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, form=form, return_lse=True)
    assert o.shape == (0, 5, 2, 4) and lse.shape == (0, 5, 2)
    g = pullback((o, lse))
    assert g["q"].shape == q.shape


@pytest.mark.parametrize("form", FORMS)
def test_empty_sequences_grads(form):
    """Tk = 0 (every row masked) and Tq = 0 (no output): gradients are zero-filled, with the
    inputs' shapes."""
    q, k, v = make_inputs(71, 1, 4, 0, 2, 2, 3, 5)
    (o, lse), pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, form=form, return_lse=True)
    assert o.shape == (1, 4, 2, 5) and np.all(o == 0) and np.all(lse == -np.inf)
    g = pullback((np.ones_like(o), np.zeros_like(lse)))
    assert g["q"].shape == q.shape and np.all(g["q"] == 0)
    assert g["k"].shape == k.shape and g["v"].shape == v.shape
    q, k, v = make_inputs(72, 2, 0, 6, 2, 1, 3, 5)
    (o, lse), pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, form=form, return_lse=True)
    assert o.shape == (2, 0, 2, 5) and lse.shape == (2, 0, 2)
    g = pullback((o, lse))
    assert g["q"].shape == q.shape
    assert np.all(g["k"] == 0) and np.all(g["v"] == 0)


def test_default_form_is_flash_and_scale_default():
    q, k, v = make_inputs(73, 1, 30, 30, 2, 2, 9, 4)
    o_default = pyattn.softmax_attention(q, k, v, causal=True)
    o_flash = pyattn.softmax_attention(q, k, v, causal=True, form="flash", scale=9 ** -0.5)
    np.testing.assert_array_equal(o_default, o_flash)
    assert inspect.signature(pyattn.softmax_attention).parameters["form"].default == "flash"


# ------------------------------------------------------------------------------- OPS


def test_ops_well_formed():
    assert "softmax_attention" in pyattn.OPS
    for name, info in pyattn.OPS.items():
        assert isinstance(info, pyattn.OpInfo)
        assert info.name == name
        assert callable(info.fn) and info.fn is getattr(pyattn, name)
        assert isinstance(info.forms, tuple)
        assert len(set(info.forms)) == len(info.forms)
        sig = inspect.signature(info.fn)
        if info.forms:
            assert info.default_form == info.forms[0]
            assert sig.parameters["form"].default == info.default_form
        else:  # an op without forms takes no form argument
            assert info.default_form is None and "form" not in sig.parameters
        positional = [p.name for p in sig.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert list(info.arrays) == positional[:len(info.arrays)]
        # keyword arrays (states, gates) are named parameters; feature_map's projection reaches
        # its **params
        named = {n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        assert set(info.differentiable) <= named or takes_any_keyword
        assert callable(info.reference)
        assert isinstance(info.has_state, bool) and isinstance(info.chunked, bool)
        assert ("initial_state" in sig.parameters) == info.has_state
        assert ("chunk_size" in sig.parameters) == info.chunked
        assert callable(info.example)
    sm = pyattn.OPS["softmax_attention"]
    assert sm.forms[0] == "flash" and set(sm.forms) == set(FORMS)
    assert sm.differentiable == ("q", "k", "v")


def _parts(value):
    """The arrays of an argument or a gradient: itself, or the entries of a list of arrays."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _ones_cotangent(out, dtype):
    """1 where an output is finite, 0 elsewhere, with out's structure."""
    if isinstance(out, tuple):
        return tuple(None if p is None else np.where(np.isfinite(p), 1, 0).astype(dtype) for p in out)
    return np.where(np.isfinite(out), 1, 0).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("name", sorted(pyattn.OPS))
def test_ops_examples_run_in_every_form(name, dtype):
    """Each op's example, in each form: the output matches the oracle (integer outputs
    exactly), vjp gives the same output and a finite gradient for every differentiable
    argument, and an op with none is refused by vjp. The example's float arrays (entries of
    lists too) have the dtype asked for and are differentiable unless the op has no gradient
    at all; its integer arrays are not differentiable."""
    info = pyattn.OPS[name]
    args, kwargs = info.example(np.random.default_rng(81), dtype)
    assert len(args) == len(info.arrays)
    for arg_name, a in zip(info.arrays, args):
        for x in _parts(a):
            assert isinstance(x, np.ndarray) and x.dtype.kind in "fiu", arg_name
            if x.dtype.kind == "f":
                assert x.dtype == dtype and (arg_name in info.differentiable or not info.differentiable)
            else:
                assert arg_name not in info.differentiable
    given = dict(zip(info.arrays, args), **kwargs)
    ref = info.reference(*args, **kwargs)
    for form, form_kw in info.form_calls():
        direct = info.fn(*args, **dict(kwargs, **form_kw))
        if info.differentiable:
            out, pullback = pyattn.vjp(info.fn, *args, **dict(kwargs, **form_kw))
        else:
            with pytest.raises(TypeError, match="no registered vjp"):
                pyattn.vjp(info.fn, *args, **dict(kwargs, **form_kw))
            out = direct
        assert type(out) is type(direct) is type(ref)
        parts = out if isinstance(out, tuple) else (out,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        assert len(parts) == len(refs)
        for p, pd, pr in zip(parts, direct if isinstance(direct, tuple) else (direct,), refs):
            if p is None:
                assert pr is None
                continue
            assert p.shape == pr.shape
            np.testing.assert_array_equal(p, pd)
            if pr.dtype.kind in "iu":  # chosen indices: exactly the oracle's
                assert p.dtype.kind in "iu"
                np.testing.assert_array_equal(p, pr)
                continue
            assert p.dtype == dtype
            assert np.all(np.isfinite(p) | np.isneginf(p))
            assert_close(p, pr, tol_out(dtype), name=f"{name} {form}")
        if info.differentiable:
            grads = pullback(_ones_cotangent(out, dtype))
            assert set(grads) == set(info.differentiable)
            for g_name, g in grads.items():
                assert len(_parts(g)) == len(_parts(given[g_name]))
                for gp, x in zip(_parts(g), _parts(given[g_name])):
                    assert gp.shape == x.shape and gp.dtype == dtype and np.all(np.isfinite(gp))
    if len(info.forms) > 1:
        check_forms(name, args, kwargs)


@pytest.mark.parametrize("name", sorted(pyattn.OPS))
def test_ops_tiny_examples_gradcheck(name):
    info = pyattn.OPS[name]
    if "tiny" not in inspect.signature(info.example).parameters:
        pytest.skip("example has no tiny variant")
    args, kwargs = info.example(np.random.default_rng(82), np.float64, tiny=True)
    given = dict(zip(info.arrays, args), **kwargs)
    # gradcheck reports the entries of a list argument (merge_attention_states' os) as os[i]
    expected = {f"{n}[{i}]" if isinstance(given[n], (list, tuple)) else n
                for n in info.differentiable for i in range(len(_parts(given[n])))}
    with pyattn.num_threads(1):
        for _, form_kw in info.form_calls():
            if not info.differentiable:  # the tiny example is right; vjp refuses the op
                out, ref = info.fn(*args, **dict(kwargs, **form_kw)), info.reference(*args, **kwargs)
                if ref.dtype.kind in "iu":
                    np.testing.assert_array_equal(out, ref)
                else:
                    assert_close(out, ref, tol_out(np.float64), name=name)
                with pytest.raises(TypeError, match="no registered vjp"):
                    gradcheck(info.fn, args, dict(kwargs, **form_kw))
                continue
            errs = gradcheck(info.fn, args, dict(kwargs, **form_kw))
            assert set(errs) == expected


def test_readonly_inputs():
    q, k, v = make_inputs(91, 1, 20, 20, 2, 1, 8, 8)
    ref = pyattn.softmax_attention(q, k, v, causal=True)
    for a in (q, k, v):
        a.flags.writeable = False
    for form in FORMS:
        (o, lse), pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True, form=form,
                                        return_lse=True)
        assert_close(o, ref, 1e-10)
        do = np.ones_like(o)
        do.flags.writeable = False
        g = pullback(do)
        assert all(g[n].flags.writeable for n in "qkv")
    assert o.flags.writeable and lse.flags.writeable


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window=(40, 0), sinks=3),
                                dict(softcap=2.0, alibi_slopes=np.linspace(0.01, 0.2, 8))],
                         ids=["causal", "window_sinks", "softcap_alibi"])
def test_decode_group_path(dtype, kw):
    """One query per sequence: the flash form's decode path handles a whole group of query
    heads per KV head (H=8, Hk=2 and varlen); it must match the oracle and the other forms."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, 1, 8, 16))
    k = rng.standard_normal((3, 150, 2, 16))
    v = rng.standard_normal((3, 150, 2, 12))
    ro, rl = reference.softmax_attention(q, k, v, return_lse=True, **kw)
    tol = 1e-10 if dtype == np.float64 else 1e-5
    kd = cast(kw, dtype)
    o, lse = pyattn.softmax_attention(*as_dtype((q, k, v), dtype), return_lse=True, **kd)
    assert_close(o, ro, tol)
    assert_close(lse, rl, tol)
    if dtype == np.float64:
        pyattn.testing.check_forms("softmax_attention", (q, k, v), {**kw, "return_lse": True})
    cu_q, cu_k = np.array([0, 1, 2, 3]), np.array([0, 0, 70, 150])
    qp, kp, vp = q.reshape(1, 3, 8, 16), k[:1, :150], v[:1, :150]
    o, lse = pyattn.softmax_attention(*as_dtype((qp, kp, vp), dtype), cu_seqlens_q=cu_q,
                                      cu_seqlens_k=cu_k, return_lse=True, **kd)
    ro, rl = reference.softmax_attention(qp, kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                         return_lse=True, **kw)
    assert_close(o, ro, tol)
    assert_close(lse, rl, tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("slope", [3.0, -3.0, 0.02], ids=["climbing", "falling", "gentle"])
@pytest.mark.parametrize("T", [7, 200, 301])
def test_running_max_moves(T, slope, dtype):
    """The online softmax's running max moving: scores that climb by 3 per key raise it in
    every key block and inside every micro-tile of one, falling scores never do, and an
    offset of 100 (exp(100) overflows float32) holds only if exp never sees a raw score.
    Non-causal (tiles every query sees whole) and causal, against the float64 oracle on the
    same (rounded) inputs."""
    rng = np.random.default_rng(T)
    D = 4
    q = np.zeros((1, T, 2, D))
    q[..., 0] = 1.0
    q[..., 1:] = 0.1 * rng.standard_normal((1, T, 2, D - 1))
    k = np.zeros((1, T, 2, D))
    k[..., 0] = (100.0 + slope * np.arange(T))[None, :, None]
    k[..., 1:] = rng.standard_normal((1, T, 2, D - 1))
    v = rng.standard_normal((1, T, 2, 5))
    q, k, v = as_dtype((q, k, v), dtype)
    for causal in (False, True):
        ro, rl = reference.softmax_attention(*(x.astype(np.float64) for x in (q, k, v)),
                                             scale=1.0, causal=causal, return_lse=True)
        o, lse = pyattn.softmax_attention(q, k, v, scale=1.0, causal=causal, return_lse=True)
        assert_close(o, ro, tol_out(dtype), name="o")
        assert_close(lse, rl, tol_out(dtype), name="lse")

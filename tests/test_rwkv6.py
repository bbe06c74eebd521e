"""rwkv6: every form x dtype against the float64 oracle (pyattn.reference.rwkv6, a loop over t
of the formula), gradients against central finite differences and across forms, cu_seqlens and
state passing, its relation to gla, non-finite inputs and bad arguments.

Inputs are float32-representable float64 arrays (conftest.f32_exact), so one float64 oracle
serves both dtypes.
"""
from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn.testing import TOLERANCES, assert_close, check_forms, gradcheck

from conftest import f32_exact, raises

DTYPES = (np.float64, np.float32)
DT_IDS = ["f64", "f32"]
FORMS = ("chunk", "parallel", "recurrent")


def inputs(seed, B=2, T=37, H=2, K=5, V=3, gate="mid", state=True):
    """r, k, v, w, u and h0 (float64, float32-representable). gate: the log decay per step,
    "weak" near 0, "mid" in [-1, 0], "strong" near -20."""
    rng = np.random.default_rng(seed)
    r, k = (f32_exact(rng.standard_normal((B, T, H, K))) for _ in range(2))
    v = f32_exact(rng.standard_normal((B, T, H, V)))
    lo, hi = {"weak": (-1e-3, 0.0), "mid": (-1.0, 0.0), "strong": (-21.0, -19.0)}[gate]
    w = f32_exact(rng.uniform(lo, hi, (B, T, H, K)))
    u = f32_exact(rng.standard_normal((H, K)))
    h0 = f32_exact(rng.standard_normal((B, H, K, V))) if state else None
    return r, k, v, w, u, h0


def run(dtype, r, k, v, w, u, h0=None, **kw):
    cast = [None if a is None else a.astype(dtype) for a in (r, k, v, w, u, h0)]
    return pyattn.rwkv6(*cast[:5], initial_state=cast[5], output_final_state=True, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
def test_forward_matches_the_oracle(form, T, dtype):
    r, k, v, w, u, h0 = inputs(T, T=T, K=6, V=4)
    o, S = run(dtype, r, k, v, w, u, h0, form=form, chunk_size=64)
    ro, rS = reference.rwkv6(r, k, v, w, u, initial_state=h0, output_final_state=True)
    tol = TOLERANCES[np.dtype(dtype)][0]
    assert o.dtype == dtype and S.dtype == dtype
    assert_close(o, ro, tol, name="o")
    assert_close(S, rS, tol, name="final_state")


@pytest.mark.parametrize("gate", ["weak", "strong"])
@pytest.mark.parametrize("form", FORMS)
def test_weak_and_strong_decays(form, gate):
    r, k, v, w, u, h0 = inputs(3, T=130, gate=gate)
    o, S = run(np.float32, r, k, v, w, u, h0, form=form, chunk_size=32)
    ro, rS = reference.rwkv6(r, k, v, w, u, initial_state=h0, output_final_state=True)
    assert_close(o, ro, TOLERANCES[np.dtype(np.float32)][0], name="o")
    assert_close(S, rS, TOLERANCES[np.dtype(np.float32)][0], name="final_state")


@pytest.mark.parametrize("form", FORMS)
def test_gradients_match_finite_differences(form):
    r, k, v, w, u, h0 = inputs(4, B=1, T=35, H=2, K=3, V=2)
    gradcheck("rwkv6", (r, k, v, w, u), dict(initial_state=h0, output_final_state=True, form=form,
                                              chunk_size=16))


def test_gradients_match_finite_differences_with_cu_seqlens():
    r, k, v, w, u, _ = inputs(5, B=1, T=20, H=1, K=3, V=2)
    h0 = f32_exact(np.random.default_rng(5).standard_normal((3, 1, 3, 2)))
    gradcheck("rwkv6", (r, k, v, w, u), dict(initial_state=h0, output_final_state=True,
                                              cu_seqlens=np.array([0, 7, 7, 20]), chunk_size=16))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_forms_agree_outputs_and_gradients(dtype):
    r, k, v, w, u, h0 = (a.astype(dtype) for a in inputs(6, T=300, K=8, V=6))
    check_forms("rwkv6", (r, k, v, w, u), dict(initial_state=h0, output_final_state=True))


@pytest.mark.parametrize("form", FORMS)
def test_cu_seqlens_equal_separate_calls(form):
    r, k, v, w, u, _ = inputs(7, B=1, T=90, K=4, V=3)
    cu = np.array([0, 30, 30, 71, 90])
    h0 = f32_exact(np.random.default_rng(7).standard_normal((4, 2, 4, 3)))
    do = np.random.default_rng(8).standard_normal(v.shape)
    dS = np.random.default_rng(9).standard_normal(h0.shape)
    (o, S), pull = pyattn.vjp(pyattn.rwkv6, r, k, v, w, u, initial_state=h0, output_final_state=True,
                              cu_seqlens=cu, form=form, chunk_size=16)
    grads = pull((do, dS))
    for n in range(4):
        a, b = cu[n], cu[n + 1]
        part = [x[:, a:b] for x in (r, k, v, w)]
        (on, Sn), pn = pyattn.vjp(pyattn.rwkv6, *part, u, initial_state=h0[n:n + 1],
                                  output_final_state=True, form=form, chunk_size=16)
        gn = pn((do[:, a:b], dS[n:n + 1]))
        assert_close(o[:, a:b], on, 1e-12, name=f"o of sequence {n}")
        assert_close(S[n:n + 1], Sn, 1e-12, name=f"final state of sequence {n}")
        for name in ("r", "k", "v", "w"):
            assert_close(grads[name][:, a:b], gn[name], 1e-12, name=f"d{name} of sequence {n}")
        assert_close(grads["initial_state"][n:n + 1], gn["initial_state"], 1e-12, name=f"dh0 {n}")


@pytest.mark.parametrize("form", FORMS)
def test_two_calls_equal_one(form):
    r, k, v, w, u, h0 = inputs(10, T=100)
    o, S = pyattn.rwkv6(r, k, v, w, u, initial_state=h0, output_final_state=True, form=form)
    o1, S1 = pyattn.rwkv6(*(x[:, :41] for x in (r, k, v, w)), u, initial_state=h0,
                          output_final_state=True, form=form)
    o2, S2 = pyattn.rwkv6(*(x[:, 41:] for x in (r, k, v, w)), u, initial_state=S1,
                          output_final_state=True, form=form)
    assert_close(np.concatenate([o1, o2], axis=1), o, 1e-12, name="o")
    assert_close(S2, S, 1e-12, name="final_state")


def test_without_decay_and_a_unit_bonus_it_is_linear_attention():
    """w = 0 and u = 1: o_t = (S_{t-1} + k_t v_t^T)^T r_t = S_t^T r_t, gla with g = 0."""
    r, k, v, w, u, h0 = inputs(11, T=70)
    o, S = pyattn.rwkv6(r, k, v, np.zeros_like(w), np.ones_like(u), initial_state=h0, output_final_state=True)
    go, gS = pyattn.gla(r, k, v, np.zeros_like(w), initial_state=h0, output_final_state=True)
    assert_close(o, go, 1e-12, name="o")
    assert_close(S, gS, 1e-12, name="final_state")


def test_u_gradient_is_the_bonus_sum():
    """du has one entry per (head, channel), summed over batch and time: finite differences
    on a long sequence as well as the tiny ones."""
    r, k, v, w, u, h0 = inputs(12, B=2, T=150, H=2, K=3, V=2)
    gradcheck("rwkv6", (r, k, v, w, u), dict(initial_state=h0, output_final_state=True), wrt=("u",))


@pytest.mark.parametrize("form", FORMS)
def test_nan_in_is_nan_out(form):
    r, k, v, w, u, h0 = inputs(13, B=1, T=80)
    t0 = 37
    rn = r.copy()
    rn[0, t0, 0, 1] = np.nan  # a query row: that output row alone
    o, S = pyattn.rwkv6(rn, k, v, w, u, initial_state=h0, output_final_state=True, form=form)
    assert np.isnan(o[0, t0, 0]).all() and np.isfinite(np.delete(o[0, :, 0], t0, axis=0)).all()
    assert np.isfinite(S).all()
    kn = k.copy()
    kn[0, t0, 1, 0] = np.nan  # a key: its own row (the bonus), every later row of its head, the state
    o, S = pyattn.rwkv6(r, kn, v, w, u, initial_state=h0, output_final_state=True, form=form)
    assert np.isfinite(o[0, :t0, 1]).all() and np.isnan(o[0, t0:, 1]).any(axis=-1).all()
    assert np.isfinite(o[0, :, 0]).all() and np.isnan(S[0, 1]).any() and np.isfinite(S[0, 0]).all()
    wn = w.copy()
    wn[0, -1, 0, 2] = np.nan  # the last decay reaches only the final state
    o, S = pyattn.rwkv6(r, k, v, wn, u, initial_state=h0, output_final_state=True, form=form)
    assert np.isfinite(o).all() and np.isnan(S[0, 0, 2]).all()


def test_empty_and_length_one_sequences():
    r, k, v, w, u, h0 = inputs(14, B=2, T=0)
    o, S = pyattn.rwkv6(r, k, v, w, u, initial_state=h0, output_final_state=True)
    assert o.shape == (2, 0, 2, 3)
    np.testing.assert_array_equal(S, h0)
    r, k, v, w, u, h0 = inputs(15, B=2, T=1)
    o, S = pyattn.rwkv6(r, k, v, w, u, initial_state=h0, output_final_state=True)
    ro, rS = reference.rwkv6(r, k, v, w, u, initial_state=h0, output_final_state=True)
    assert_close(o, ro, 1e-12, name="o")
    assert_close(S, rS, 1e-12, name="final_state")


def test_bad_arguments_name_themselves():
    r, k, v, w, u, h0 = inputs(16)
    raises(ValueError, pyattn.rwkv6, r, k, v, w, u[:1], must=("rwkv6()", "'u'"))
    raises(ValueError, pyattn.rwkv6, r, k, v, w[..., :2], u, must=("rwkv6()", "'w'"))
    raises(ValueError, pyattn.rwkv6, r, k, v, -w, u, must=("rwkv6()", "'w'"))
    raises(ValueError, pyattn.rwkv6, r, k, v, w, u, chunk_size=48, must=("rwkv6()", "chunk_size"))
    raises(ValueError, pyattn.rwkv6, r, k, v, w, u, form="flash", must=("rwkv6()", "form"))
    raises(ValueError, pyattn.rwkv6, r, k, v, w, u, initial_state=h0[:1], must=("rwkv6()", "initial_state"))
    raises(TypeError, pyattn.rwkv6, r, k, v.astype(np.float32), w, u, must=("rwkv6()",))

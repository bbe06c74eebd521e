"""gated_delta_product: every form x dtype against the float64 oracle
(pyattn.reference.gated_delta_product, loops over tokens and their steps), gradients against
central finite differences and across forms, one step = gated_delta_rule, the ungated form,
cu_seqlens counting tokens, state passing, non-finite inputs and bad arguments.

Inputs are float32-representable float64 arrays (conftest.f32_exact).
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


def inputs(seed, n=2, B=2, T=37, H=2, K=5, V=3, gate="mid", beta_hi=1.0, state=True):
    """q, g [B, T, ...] and k, v, beta [B, T n, ...] (float64, float32-representable); gate:
    "weak" near 0, "mid" in [-1, 0], "strong" near -20; beta in (0.1, beta_hi)."""
    rng = np.random.default_rng(seed)
    q = f32_exact(rng.standard_normal((B, T, H, K)))
    k = f32_exact(rng.standard_normal((B, T * n, H, K)))
    k = f32_exact(k / np.linalg.norm(k, axis=-1, keepdims=True))
    v = f32_exact(rng.standard_normal((B, T * n, H, V)))
    lo, hi = {"weak": (-1e-3, 0.0), "mid": (-1.0, 0.0), "strong": (-21.0, -19.0)}[gate]
    g = f32_exact(rng.uniform(lo, hi, (B, T, H)))
    beta = f32_exact(rng.uniform(0.1, beta_hi, (B, T * n, H)))
    h0 = f32_exact(rng.standard_normal((B, H, K, V))) if state else None
    return q, k, v, g, beta, h0


def run(dtype, q, k, v, g, beta, h0, n, **kw):
    cast = [None if a is None else a.astype(dtype) for a in (q, k, v, g, beta, h0)]
    return pyattn.gated_delta_product(*cast[:5], num_householder=n, initial_state=cast[5],
                                      output_final_state=True, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
def test_forward_matches_the_oracle(form, T, dtype):
    n = 3
    q, k, v, g, beta, h0 = inputs(T, n=n, T=T, K=6, V=4)
    o, S = run(dtype, q, k, v, g, beta, h0, n, form=form)
    ro, rS = reference.gated_delta_product(q, k, v, g, beta, num_householder=n, initial_state=h0,
                                           output_final_state=True)
    tol = TOLERANCES[np.dtype(dtype)][0]
    assert o.shape == q.shape[:3] + (4,) and o.dtype == dtype
    assert_close(o, ro, tol, name="o")
    assert_close(S, rS, tol, name="final_state")


@pytest.mark.parametrize("gate,beta_hi", [("weak", 1.0), ("strong", 1.0), ("mid", 1.99)])
@pytest.mark.parametrize("form", FORMS)
def test_weak_and_strong_gates_and_beta_near_two(form, gate, beta_hi):
    q, k, v, g, beta, h0 = inputs(3, T=100, gate=gate, beta_hi=beta_hi)
    o, S = run(np.float32, q, k, v, g, beta, h0, 2, form=form, chunk_size=32)
    ro, rS = reference.gated_delta_product(q, k, v, g, beta, num_householder=2, initial_state=h0,
                                           output_final_state=True)
    assert_close(o, ro, TOLERANCES[np.dtype(np.float32)][0], name="o")
    assert_close(S, rS, TOLERANCES[np.dtype(np.float32)][0], name="final_state")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("l2norm", [False, True])
def test_gradients_match_finite_differences(form, l2norm):
    q, k, v, g, beta, h0 = inputs(4, n=2, B=1, T=18, H=2, K=3, V=2)
    gradcheck("gated_delta_product", (q, k, v, g, beta),
              dict(num_householder=2, qk_l2norm=l2norm, initial_state=h0, output_final_state=True,
                   form=form, chunk_size=16))


def test_gradients_match_finite_differences_with_cu_seqlens_and_no_gate():
    q, k, v, _, beta, _ = inputs(5, n=3, B=1, T=11, H=1, K=3, V=2)
    h0 = f32_exact(np.random.default_rng(5).standard_normal((3, 1, 3, 2)))
    gradcheck("gated_delta_product", (q, k, v, None, beta),
              dict(num_householder=3, initial_state=h0, output_final_state=True,
                   cu_seqlens=np.array([0, 4, 4, 11]), chunk_size=16))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_forms_agree_outputs_and_gradients(dtype):
    q, k, v, g, beta, h0 = (a.astype(dtype) for a in inputs(6, n=2, T=150, K=8, V=6))
    check_forms("gated_delta_product", (q, k, v, g, beta),
                dict(num_householder=2, initial_state=h0, output_final_state=True))


@pytest.mark.parametrize("form", FORMS)
def test_one_step_per_token_is_gated_delta_rule(form):
    q, k, v, g, beta, h0 = inputs(7, n=1, T=80)
    do = np.random.default_rng(1).standard_normal(v.shape)
    kw = dict(qk_l2norm=True, initial_state=h0, output_final_state=True, form=form)
    (o, S), pull = pyattn.vjp(pyattn.gated_delta_product, q, k, v, g, beta, num_householder=1, **kw)
    (ro, rS), rpull = pyattn.vjp(pyattn.gated_delta_rule, q, k, v, g, beta, **kw)
    assert_close(o, ro, 1e-13, name="o")
    assert_close(S, rS, 1e-13, name="final_state")
    grads, rgrads = pull((do, None)), rpull((do, None))
    for name in rgrads:
        assert_close(grads[name], rgrads[name], 1e-12, name="d" + name)


@pytest.mark.parametrize("form", FORMS)
def test_cu_seqlens_count_tokens_and_equal_separate_calls(form):
    n = 2
    q, k, v, g, beta, _ = inputs(8, n=n, B=1, T=60, K=4, V=3)
    cu = np.array([0, 20, 20, 47, 60])
    h0 = f32_exact(np.random.default_rng(8).standard_normal((4, 2, 4, 3)))
    do = np.random.default_rng(9).standard_normal(q.shape[:3] + (3,))
    dS = np.random.default_rng(10).standard_normal(h0.shape)
    kw = dict(num_householder=n, output_final_state=True, form=form, chunk_size=16)
    (o, S), pull = pyattn.vjp(pyattn.gated_delta_product, q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **kw)
    grads = pull((do, dS))
    for m in range(4):
        a, b = cu[m], cu[m + 1]
        (om, Sm), pm = pyattn.vjp(pyattn.gated_delta_product, q[:, a:b], k[:, a * n:b * n], v[:, a * n:b * n],
                                  g[:, a:b], beta[:, a * n:b * n], initial_state=h0[m:m + 1], **kw)
        gm = pm((do[:, a:b], dS[m:m + 1]))
        assert_close(o[:, a:b], om, 1e-12, name=f"o {m}")
        assert_close(S[m:m + 1], Sm, 1e-12, name=f"final_state {m}")
        for name, lo, hi in (("q", a, b), ("g", a, b), ("k", a * n, b * n), ("v", a * n, b * n),
                             ("beta", a * n, b * n)):
            assert_close(grads[name][:, lo:hi], gm[name], 1e-12, name=f"d{name} {m}")


def test_two_calls_equal_one():
    n = 2
    q, k, v, g, beta, h0 = inputs(11, n=n, T=90)
    o, S = run(np.float64, q, k, v, g, beta, h0, n)
    o1, S1 = run(np.float64, q[:, :33], k[:, :66], v[:, :66], g[:, :33], beta[:, :66], h0, n)
    o2, S2 = run(np.float64, q[:, 33:], k[:, 66:], v[:, 66:], g[:, 33:], beta[:, 66:], S1, n)
    assert_close(np.concatenate([o1, o2], axis=1), o, 1e-12, name="o")
    assert_close(S2, S, 1e-12, name="final_state")


@pytest.mark.parametrize("form", FORMS)
def test_nan_in_is_nan_out(form):
    n = 2
    q, k, v, g, beta, h0 = inputs(12, n=n, B=1, T=70)
    t0 = 30
    kn = k.copy()
    kn[0, t0 * n + 1, 1, 0] = np.nan  # a step of token t0: that token on, its head only
    o, S = run(np.float64, q, kn, v, g, beta, h0, n, form=form)
    assert np.isfinite(o[0, :t0, 1]).all() and np.isnan(o[0, t0:, 1]).any(axis=-1).all()
    assert np.isfinite(o[0, :, 0]).all() and np.isfinite(S[0, 0]).all() and np.isnan(S[0, 1]).any()
    qn = q.copy()
    qn[0, t0, 0, 2] = np.nan  # a query: its own output row
    o, S = run(np.float64, qn, k, v, g, beta, h0, n, form=form)
    assert np.isnan(o[0, t0, 0]).all() and np.isfinite(np.delete(o[0, :, 0], t0, axis=0)).all()
    assert np.isfinite(S).all()


def test_bad_arguments_name_themselves():
    q, k, v, g, beta, h0 = inputs(13, n=2)
    f = pyattn.gated_delta_product
    raises(ValueError, f, q, k[:, :-1], v, g, beta, num_householder=2, must=("gated_delta_product()", "'k'"))
    raises(ValueError, f, q, k, v, g, beta, num_householder=3, must=("gated_delta_product()", "'k'"))
    raises(ValueError, f, q, k, v, g, beta, num_householder=0, must=("gated_delta_product()", "num_householder"))
    raises(TypeError, f, q, k, v, g, beta, num_householder=2.0, must=("gated_delta_product()", "num_householder"))
    raises(ValueError, f, q, k, v, g, beta[:, :-2], num_householder=2, must=("gated_delta_product()", "'beta'"))
    raises(ValueError, f, q, k, v, -g, beta, num_householder=2, must=("gated_delta_product()", "'g'"))
    raises(ValueError, f, q, k, v, g, beta, num_householder=2, chunk_size=48,
           must=("gated_delta_product()", "chunk_size"))
    raises(ValueError, f, q, k, v, g, beta, num_householder=2, initial_state=h0[:1],
           must=("gated_delta_product()", "initial_state"))

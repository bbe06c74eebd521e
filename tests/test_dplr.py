"""dplr_delta_rule and rwkv7: every form x dtype against the float64 oracle
(pyattn.reference.dplr_delta_rule, a loop over t of the formula), gradients against central
finite differences (float64) and float32 gradients against float64 ones, cu_seqlens and state
passing, the gated delta rule and KDA as special cases, rwkv7 as dplr_delta_rule with q = r,
the oracle against fla's naive recurrence, non-finite inputs and bad arguments.

Inputs are float32-representable float64 arrays (conftest.f32_exact), so one float64 oracle
serves both dtypes.
"""
from __future__ import annotations


import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn.dplr import FORMS
from pyattn.testing import TOLERANCES, assert_close, gradcheck

import fla_naive
from conftest import f32_exact, raises

DTYPES = (np.float64, np.float32)
DT_IDS = ["f64", "f32"]
GATES = {"weak": (-1e-3, 0.0), "mid": (-1.0, 0.0), "strong": (-21.0, -19.0)}


def inputs(seed, B=2, T=37, H=2, K=5, V=3, gate="mid", state=True):
    """q, k, v, a, b, gk and h0 (float64, float32-representable). a = -kappa, b = kappa lr
    with kappa a unit vector and lr in (0, 1), as RWKV-7 builds them, so the state stays
    bounded over long sequences. gate: the log decay, "weak" near 0, "mid" in [-1, 0],
    "strong" near -20."""
    rng = np.random.default_rng(seed)
    q, k = (f32_exact(rng.standard_normal((B, T, H, K))) for _ in range(2))
    v = f32_exact(rng.standard_normal((B, T, H, V)))
    kappa = rng.standard_normal((B, T, H, K))
    kappa /= np.maximum(np.linalg.norm(kappa, axis=-1, keepdims=True), 1e-12)
    a = f32_exact(-kappa)
    b = f32_exact(kappa * rng.uniform(0.1, 1.0, (B, T, H, K)))
    gk = f32_exact(rng.uniform(*GATES[gate], (B, T, H, K)))
    h0 = f32_exact(rng.standard_normal((B, H, K, V))) if state else None
    return q, k, v, a, b, gk, h0


def cast(dtype, *arrays):
    return [None if x is None else x.astype(dtype) for x in arrays]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
def test_forward_matches_the_oracle(form, T, dtype):
    q, k, v, a, b, gk, h0 = inputs(T, T=T, K=6, V=4)
    o, S = pyattn.dplr_delta_rule(*cast(dtype, q, k, v, a, b, gk), initial_state=h0.astype(dtype),
                                  output_final_state=True, form=form)
    ro, rS = reference.dplr_delta_rule(q, k, v, a, b, gk, initial_state=h0, output_final_state=True)
    tol = TOLERANCES[np.dtype(dtype)][0]
    assert o.dtype == dtype and S.dtype == dtype
    assert_close(o, ro, tol, name="o")
    assert_close(S, rS, tol, name="final_state")


@pytest.mark.parametrize("gate", ["weak", "strong"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
def test_weak_and_strong_decays(form, dtype, gate):
    q, k, v, a, b, gk, h0 = inputs(3, T=130, gate=gate)
    o, S = pyattn.dplr_delta_rule(*cast(dtype, q, k, v, a, b, gk), initial_state=h0.astype(dtype),
                                  output_final_state=True, form=form)
    ro, rS = reference.dplr_delta_rule(q, k, v, a, b, gk, initial_state=h0, output_final_state=True)
    tol = TOLERANCES[np.dtype(dtype)][0]
    assert_close(o, ro, tol, name="o")
    assert_close(S, rS, tol, name="final_state")


# under the sanitizer the strong gates' paths (blocks not factored), the common ones run elsewhere
@pytest.mark.parametrize("gate", [pytest.param("mid", marks=pytest.mark.skip_under_sanitizer), "strong"])
@pytest.mark.parametrize("form", FORMS)
def test_gradients_match_finite_differences(form, gate):
    q, k, v, a, b, gk, h0 = inputs(4, B=1, T=70, H=2, K=3, V=2, gate=gate)
    gradcheck("dplr_delta_rule", (q, k, v, a, b, gk),
              dict(initial_state=h0, output_final_state=True, form=form))


@pytest.mark.parametrize("form", FORMS)
def test_gradients_match_finite_differences_with_cu_seqlens(form):
    q, k, v, a, b, gk, _ = inputs(5, B=1, T=20, H=1, K=3, V=2)
    h0 = f32_exact(np.random.default_rng(5).standard_normal((3, 1, 3, 2)))
    gradcheck("dplr_delta_rule", (q, k, v, a, b, gk),
              dict(initial_state=h0, output_final_state=True, cu_seqlens=np.array([0, 7, 7, 20]),
                   form=form, chunk_size=16))


@pytest.mark.parametrize("form", FORMS)
def test_float32_gradients_match_float64(form):
    """float32 gradients within 1e-4 (rel RMS) of the float64 ones, which the finite
    differences above check; T = 300 crosses several of the backward's kept-state pieces."""
    q, k, v, a, b, gk, h0 = inputs(6, T=300, K=6, V=4)
    rng = np.random.default_rng(60)
    do = f32_exact(rng.standard_normal(v.shape))
    dS = f32_exact(rng.standard_normal(h0.shape))
    grads = {}
    for dtype in DTYPES:
        args = cast(dtype, q, k, v, a, b, gk)
        _, pull = pyattn.vjp(pyattn.dplr_delta_rule, *args, initial_state=h0.astype(dtype),
                             output_final_state=True, form=form)
        grads[dtype] = pull((do.astype(dtype), dS.astype(dtype)))
    assert set(grads[np.float64]) == {"q", "k", "v", "a", "b", "gk", "initial_state"}
    for name, want in grads[np.float64].items():
        got = grads[np.float32][name]
        assert got.dtype == np.float32
        assert_close(got, want, TOLERANCES[np.dtype(np.float32)][1], name=f"d{name}")


@pytest.mark.parametrize("form", FORMS)
def test_cu_seqlens_equal_separate_calls(form):
    q, k, v, a, b, gk, _ = inputs(7, B=1, T=150, K=4, V=3)
    cu = np.array([0, 30, 30, 101, 150])
    h0 = f32_exact(np.random.default_rng(7).standard_normal((4, 2, 4, 3)))
    do = np.random.default_rng(8).standard_normal(v.shape)
    dS = np.random.default_rng(9).standard_normal(h0.shape)
    (o, S), pull = pyattn.vjp(pyattn.dplr_delta_rule, q, k, v, a, b, gk, initial_state=h0,
                              output_final_state=True, cu_seqlens=cu, form=form)
    grads = pull((do, dS))
    for n in range(4):
        lo, hi = cu[n], cu[n + 1]
        part = [x[:, lo:hi] for x in (q, k, v, a, b, gk)]
        (on, Sn), pn = pyattn.vjp(pyattn.dplr_delta_rule, *part, initial_state=h0[n:n + 1],
                                  output_final_state=True, form=form)
        gn = pn((do[:, lo:hi], dS[n:n + 1]))
        assert_close(o[:, lo:hi], on, 1e-12, name=f"o of sequence {n}")
        assert_close(S[n:n + 1], Sn, 1e-12, name=f"final state of sequence {n}")
        for name in ("q", "k", "v", "a", "b", "gk"):
            assert_close(grads[name][:, lo:hi], gn[name], 1e-12, name=f"d{name} of sequence {n}")
        assert_close(grads["initial_state"][n:n + 1], gn["initial_state"], 1e-12, name=f"dh0 {n}")


@pytest.mark.parametrize("form", FORMS)
def test_two_calls_equal_one(form):
    q, k, v, a, b, gk, h0 = inputs(10, T=100)
    o, S = pyattn.dplr_delta_rule(q, k, v, a, b, gk, initial_state=h0, output_final_state=True, form=form)
    o1, S1 = pyattn.dplr_delta_rule(*(x[:, :41] for x in (q, k, v, a, b, gk)), initial_state=h0,
                                    output_final_state=True, form=form)
    o2, S2 = pyattn.dplr_delta_rule(*(x[:, 41:] for x in (q, k, v, a, b, gk)), initial_state=S1,
                                    output_final_state=True, form=form)
    assert_close(np.concatenate([o1, o2], axis=1), o, 1e-12, name="o")
    assert_close(S2, S, 1e-12, name="final_state")


def test_without_initial_or_final_state():
    q, k, v, a, b, gk, _ = inputs(17, T=50, state=False)
    o, S = pyattn.dplr_delta_rule(q, k, v, a, b, gk)
    ro, _ = reference.dplr_delta_rule(q, k, v, a, b, gk)
    assert S is None
    assert_close(o, ro, 1e-10, name="o")
    _, pull = pyattn.vjp(pyattn.dplr_delta_rule, q, k, v, a, b, gk)
    assert set(pull(np.ones_like(o))) == {"q", "k", "v", "a", "b", "gk"}


def test_the_gated_delta_rule_is_a_special_case():
    """gk = g on every channel, b = k, a = -beta exp(g) k and the write beta k:
    diag(exp(g)) + k (-beta exp(g) k)^T = exp(g) (I - beta k k^T), and (beta k) v^T is the
    gated delta rule's write."""
    q, k, v, _, _, gk, h0 = inputs(20, T=90)
    rng = np.random.default_rng(20)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    g = gk[..., 0]
    beta = rng.uniform(0.1, 1.0, g.shape)
    e = np.exp(g)[..., None]
    o, S = pyattn.dplr_delta_rule(q, beta[..., None] * k, v, -beta[..., None] * e * k, k,
                                  np.broadcast_to(g[..., None], k.shape).copy(), initial_state=h0,
                                  output_final_state=True)
    go, gS = pyattn.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close(o, go, 1e-12, name="o")
    assert_close(S, gS, 1e-12, name="final_state")


def _kda(q, k, v, gk, beta, h0, scale):
    """KDA (fla's kimi delta attention) literally: the channel decay, then the delta rule,
    S_t = (I - beta_t k_t k_t^T) diag(exp(gk_t)) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T scale q_t."""
    B, T, H, K = q.shape
    o = np.zeros(v.shape)
    S = h0.copy()
    for bi in range(B):
        for h in range(H):
            for t in range(T):
                kt = k[bi, t, h]
                decayed = np.exp(gk[bi, t, h])[:, None] * S[bi, h]
                S[bi, h] = (np.eye(K) - beta[bi, t, h] * np.outer(kt, kt)) @ decayed \
                    + beta[bi, t, h] * np.outer(kt, v[bi, t, h])
                o[bi, t, h] = S[bi, h].T @ (scale * q[bi, t, h])
    return o, S


def test_kda_is_a_special_case():
    """KDA decays before the delta rule: (I - beta k k^T) diag(e) = diag(e) + k (-beta e * k)^T,
    so b = k, a = -beta exp(gk) * k (the decay on a's channels) and the write beta k."""
    q, k, v, _, _, gk, h0 = inputs(21, T=70)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    beta = np.random.default_rng(21).uniform(0.1, 1.0, q.shape[:3])[..., None]
    o, S = pyattn.dplr_delta_rule(q, beta * k, v, -beta * np.exp(gk) * k, k, gk, initial_state=h0,
                                  output_final_state=True)
    ko, kS = _kda(q, k, v, gk, beta[..., 0], h0, q.shape[3] ** -0.5)
    assert_close(o, ko, 1e-12, name="o")
    assert_close(S, kS, 1e-12, name="final_state")


def test_rwkv7_is_dplr_delta_rule_with_q_r():
    r, k, v, a, b, w, h0 = inputs(22, T=80)
    for scale in (1.0, None, 0.3):
        kw = dict(initial_state=h0, output_final_state=True)
        (o, S), pull = pyattn.vjp(pyattn.rwkv7, r, w, k, v, a, b, **kw, **({} if scale == 1.0 else {"scale": scale}))
        want_scale = r.shape[3] ** -0.5 if scale is None else scale
        (do_, dS_), dpull = pyattn.vjp(pyattn.dplr_delta_rule, r, k, v, a, b, w, scale=want_scale, **kw)
        np.testing.assert_array_equal(o, do_)
        np.testing.assert_array_equal(S, dS_)
        cot = (np.ones_like(o), np.ones_like(S))
        g, dg = pull(cot), dpull(cot)
        assert set(g) == {"r", "w", "k", "v", "a", "b", "initial_state"}
        for name, dname in (("r", "q"), ("w", "gk"), ("k", "k"), ("v", "v"), ("a", "a"), ("b", "b"),
                            ("initial_state", "initial_state")):
            np.testing.assert_array_equal(g[name], dg[dname])
    ro, rS = reference.rwkv7(r, w, k, v, a, b, initial_state=h0, output_final_state=True)
    o, S = pyattn.rwkv7(r, w, k, v, a, b, initial_state=h0, output_final_state=True)
    assert_close(o, ro, 1e-10, name="o")
    assert_close(S, rS, 1e-10, name="final_state")


def test_rwkv7_gradients_match_finite_differences():
    r, k, v, a, b, w, h0 = inputs(23, B=1, T=20, H=2, K=3, V=2)
    gradcheck("rwkv7", (r, w, k, v, a, b), dict(initial_state=h0, output_final_state=True))


def _fla_naive():
    """fla's naive DPLR recurrence and torch, or a skip."""
    pytest.importorskip("einops")
    torch = pytest.importorskip("torch")
    return torch, fla_naive.load("ops/generalized_delta_rule/dplr/naive.py")


def test_oracle_equals_fla_s_naive_recurrence():
    torch, naive = _fla_naive()
    q, k, v, a, b, gk, h0 = inputs(24, T=40)
    # [B, H, T, D] float32, as the naive recurrence computes
    heads_first = [torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).float()
                   for x in (q, k, v, a, b, gk)]
    fo, fS = naive.dplr_recurrence(*heads_first, initial_state=torch.from_numpy(h0).float(), output_final_state=True)
    ro, rS = reference.dplr_delta_rule(q, k, v, a, b, gk, initial_state=h0, output_final_state=True)
    assert_close(fo.numpy().transpose(0, 2, 1, 3), ro, 1e-5, name="o")
    assert_close(fS.numpy(), rS, 1e-5, name="final_state")


@pytest.mark.parametrize("form", FORMS)
def test_nan_in_is_nan_out(form):
    q, k, v, a, b, gk, h0 = inputs(13, B=1, T=80)
    t0 = 37
    qn = q.copy()
    qn[0, t0, 0, 1] = np.nan  # a query row: that output row alone
    o, S = pyattn.dplr_delta_rule(qn, k, v, a, b, gk, initial_state=h0, output_final_state=True, form=form)
    assert np.isnan(o[0, t0, 0]).all() and np.isfinite(np.delete(o[0, :, 0], t0, axis=0)).all()
    assert np.isfinite(S).all()
    for name in ("k", "a", "b", "gk"):
        arrs = dict(q=q, k=k, v=v, a=a, b=b, gk=gk)
        x = arrs[name].copy()
        x[0, t0, 1, 0] = np.nan  # this row on: NaN in head 1, head 0 untouched
        arrs[name] = x
        o, S = pyattn.dplr_delta_rule(**arrs, initial_state=h0, output_final_state=True, form=form)
        assert np.isfinite(o[0, :t0, 1]).all(), name
        assert np.isnan(o[0, t0 + 1:, 1]).any(axis=-1).all(), name
        assert np.isfinite(o[0, :, 0]).all() and np.isfinite(S[0, 0]).all(), name
        assert np.isnan(S[0, 1]).any(), name
        _, pull = pyattn.vjp(pyattn.dplr_delta_rule, **arrs, initial_state=h0, output_final_state=True, form=form)
        g = pull((np.ones_like(o), np.ones_like(S)))
        # dq reads the states the NaN reached
        assert np.isnan(g["q"][0, t0 + 1:, 1]).any(axis=-1).all(), name
        assert np.isfinite(g["q"][0, :, 0]).all(), name


@pytest.mark.parametrize("row", [0, 21])
@pytest.mark.parametrize("name,value", [(n, x) for n in ("q", "k", "v", "a", "b", "gk") for x in (np.nan, np.inf)
                                        if not (n == "gk" and x == np.inf)])  # +inf: a positive gate
def test_nonfinite_input_gradients_as_the_recurrence(name, value, row):
    """A NaN or an inf in one input at row 0 or 21 (chunk_size 16) of a call without
    initial_state: the chunk form's gradients are non-finite exactly where the recurrent
    form's are (its literal steps; NaN where they are NaN, for a NaN), the finite entries
    within the float64 tolerance. The chunk backward takes a block holding a NaN gate or a
    non-finite k, v, a or b by the recurrent steps: in its Grams the value would reach
    gradients that the recurrence keeps finite."""
    arrs = dict(zip(("q", "k", "v", "a", "b", "gk"), inputs(17, B=1, T=40, state=False)[:6]))
    arrs[name] = arrs[name].copy()
    arrs[name][0, row, 1, 0] = value
    do = np.random.default_rng(3).standard_normal(arrs["v"].shape)
    grads = {}
    with np.errstate(invalid="ignore", over="ignore"):
        for form in ("chunk", "recurrent"):
            _, pull = pyattn.vjp(pyattn.dplr_delta_rule, **arrs, form=form, chunk_size=16)
            grads[form] = pull((do, None))
    for n, g in grads["chunk"].items():
        ref = grads["recurrent"][n]
        np.testing.assert_array_equal(np.isfinite(g), np.isfinite(ref), err_msg=f"d{n} finite")
        if np.isnan(value):
            np.testing.assert_array_equal(np.isnan(g), np.isnan(ref), err_msg=f"d{n} NaN")
        ok = np.isfinite(ref)
        assert_close(g[ok], ref[ok], TOLERANCES[np.dtype(np.float64)][1], name=f"d{n}")


@pytest.mark.parametrize("form", FORMS)
def test_full_reset_and_extreme_decays_stay_finite(form):
    """gk = -inf drops the diagonal part of its step (exp(-inf) = 0 in the oracle); gk near -1e4
    and -20 neither overflow nor give NaN, forward or backward."""
    q, k, v, a, b, gk, h0 = inputs(25, T=70)
    gk = gk.copy()
    gk[:, 10] = -np.inf
    gk[:, 20] = -1e4
    gk[:, 30:40] = -20.0
    (o, S), pull = pyattn.vjp(pyattn.dplr_delta_rule, q, k, v, a, b, gk, initial_state=h0,
                              output_final_state=True, form=form)
    ro, rS = reference.dplr_delta_rule(q, k, v, a, b, gk, initial_state=h0, output_final_state=True)
    assert_close(o, ro, 1e-10, name="o")
    assert_close(S, rS, 1e-10, name="final_state")
    g = pull((np.ones_like(o), np.ones_like(S)))
    for name, x in g.items():
        assert np.isfinite(x).all(), name
    assert (g["gk"][:, 10] == 0).all() and (g["gk"][:, 20] == 0).all()


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
@pytest.mark.parametrize("gate", list(GATES))
def test_chunk_equals_recurrent(chunk_size, gate):
    """The chunk form against the recurrent one in float64, forward and backward (the chunk
    form has its own), T = 150 dividing by none of the chunk sizes, with cu_seqlens cutting
    sequences inside chunks."""
    q, k, v, a, b, gk, _ = inputs(31, B=1, T=150, H=2, K=7, V=5, gate=gate)
    cu = np.array([0, 40, 41, 150])
    rng = np.random.default_rng(31)
    h0 = rng.standard_normal((3, 2, 7, 5))
    do, dS = rng.standard_normal(v.shape), rng.standard_normal(h0.shape)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)
    (o, S), pull = pyattn.vjp(pyattn.dplr_delta_rule, q, k, v, a, b, gk, form="chunk",
                              chunk_size=chunk_size, **kw)
    (ro, rS), rpull = pyattn.vjp(pyattn.dplr_delta_rule, q, k, v, a, b, gk, form="recurrent", **kw)
    assert_close(o, ro, 1e-12, name="o")
    assert_close(S, rS, 1e-12, name="final_state")
    grads, want = pull((do, dS)), rpull((do, dS))
    assert set(grads) == set(want) == {"q", "k", "v", "a", "b", "gk", "initial_state"}
    for name in want:
        assert_close(grads[name], want[name], 1e-12, name=f"d{name}")


@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
def test_chunk_gradients_equal_recurrent(T):
    """The chunk backward against the recurrent one (which the finite differences check) in
    float64 around the chunk size: a lone row, one row short of a chunk, a chunk, one over,
    several with a ragged last."""
    q, k, v, a, b, gk, h0 = inputs(33, T=T, K=6, V=4)
    rng = np.random.default_rng(33)
    do, dS = rng.standard_normal(v.shape), rng.standard_normal(h0.shape)
    grads = {}
    for form in FORMS:
        _, pull = pyattn.vjp(pyattn.dplr_delta_rule, q, k, v, a, b, gk, initial_state=h0,
                             output_final_state=True, form=form)
        grads[form] = pull((do, dS))
    for name, want in grads["recurrent"].items():
        assert_close(grads["chunk"][name], want, 1e-12, name=f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_chunk_form_survives_gates_that_overflow_a_naive_exp(dtype):
    """Log decays near -20 per step over a chunk of 128 rows: G reaches -2600, so exp(-G)
    overflows in double (and exp(-G) past 88 in float); every exponent must be relative."""
    q, k, v, a, b, gk, h0 = inputs(32, B=1, T=300, H=1, K=4, V=3, gate="strong")
    assert -gk[0, :128].sum(0).min() > np.log(np.finfo(np.float64).max)
    o, S = pyattn.dplr_delta_rule(*cast(dtype, q, k, v, a, b, gk), initial_state=h0.astype(dtype),
                                  output_final_state=True, form="chunk", chunk_size=128)
    ro, rS = reference.dplr_delta_rule(q, k, v, a, b, gk, initial_state=h0, output_final_state=True)
    tol = TOLERANCES[np.dtype(dtype)][0]
    assert_close(o, ro, tol, name="o")
    assert_close(S, rS, tol, name="final_state")


def test_empty_and_length_one_sequences():
    q, k, v, a, b, gk, h0 = inputs(14, B=2, T=0)
    o, S = pyattn.dplr_delta_rule(q, k, v, a, b, gk, initial_state=h0, output_final_state=True)
    assert o.shape == (2, 0, 2, 3)
    np.testing.assert_array_equal(S, h0)
    _, pull = pyattn.vjp(pyattn.dplr_delta_rule, q, k, v, a, b, gk, initial_state=h0, output_final_state=True)
    dS = np.random.default_rng(14).standard_normal(h0.shape)
    np.testing.assert_array_equal(pull((o, dS))["initial_state"], dS)
    q, k, v, a, b, gk, h0 = inputs(15, B=2, T=1)
    o, S = pyattn.dplr_delta_rule(q, k, v, a, b, gk, initial_state=h0, output_final_state=True)
    ro, rS = reference.dplr_delta_rule(q, k, v, a, b, gk, initial_state=h0, output_final_state=True)
    assert_close(o, ro, 1e-12, name="o")
    assert_close(S, rS, 1e-12, name="final_state")


def test_bad_arguments_name_themselves():
    q, k, v, a, b, gk, h0 = inputs(16)
    fn = pyattn.dplr_delta_rule
    raises(ValueError, fn, q, k, v, a[..., :2], b, gk, must=("dplr_delta_rule()", "'a'"))
    raises(ValueError, fn, q, k, v, a, b[:, :3], gk, must=("dplr_delta_rule()", "'b'"))
    raises(ValueError, fn, q, k, v, a, b, gk[..., 0], must=("dplr_delta_rule()", "'gk'"))
    raises(ValueError, fn, q, k, v, a, b, -gk + 0.1, must=("dplr_delta_rule()", "'gk'"))
    raises(ValueError, fn, q, k[:, :5], v, a, b, gk, must=("dplr_delta_rule()", "'k'"))
    raises(ValueError, fn, q, k, v[:, :, :1], a, b, gk, must=("dplr_delta_rule()", "'v'"))
    raises(ValueError, fn, q[0], k, v, a, b, gk, must=("dplr_delta_rule()", "'q'"))
    raises(ValueError, fn, q, k, v, a, b, gk, form="parallel", must=("dplr_delta_rule()", "form"))
    raises(ValueError, fn, q, k, v, a, b, gk, chunk_size=48, must=("dplr_delta_rule()", "chunk_size"))
    raises(ValueError, fn, q, k, v, a, b, gk, initial_state=h0[:1], must=("dplr_delta_rule()", "initial_state"))
    raises(ValueError, fn, q, k, v, a, b, gk, cu_seqlens=np.array([0, 5, 37]),
           must=("dplr_delta_rule()", "cu_seqlens"))
    raises(TypeError, fn, q, k, v, a.astype(np.float32), b, gk, must=("dplr_delta_rule()", "'a'"))
    raises(TypeError, fn, q, k, v, a, b, gk, output_final_state=1, must=("dplr_delta_rule()", "output_final_state"))
    raises(TypeError, fn, q, k, v, a, None, gk, must=("dplr_delta_rule()", "'b'"))
    raises(ValueError, fn, q, k, v, a, b, gk, scale=np.inf, must=("dplr_delta_rule()", "scale"))
    r, w = q, gk
    raises(ValueError, pyattn.rwkv7, r[..., :2], w, k, v, a, b, must=("rwkv7()",))
    raises(ValueError, pyattn.rwkv7, r, -w + 0.1, k, v, a, b, must=("rwkv7()", "'w'"))
    raises(ValueError, pyattn.rwkv7, r[0], w, k, v, a, b, must=("rwkv7()", "'r'"))
    raises(ValueError, pyattn.rwkv7, r, w, k, v, a, b, form="parallel", must=("rwkv7()", "form"))


# ---- pyattn._core directly: the states a chunk forward keeps for its backward
#
# dplr_forward(q, k, v, a, b, gk, h0, o, ht, keep, cu, form, chunk, scale, bf16) -> kept states or None
# dplr_backward(q, k, v, a, b, gk, h0, do, dht, states, dq, dk, dv, da, db, dgk, dh0, cu, form,
#               chunk, scale)

def test_core_kept_states():
    """keep=True with the chunk form returns, for every (sequence, head) in order, the state
    entering each chunk and then the final one (h0, the oracle's state at every chunk
    boundary, the final state: sequences of 11 and 6 rows, chunks of 4); a backward reading
    them equals one recomputing them, bitwise. Kept states of the wrong shape or dtype, or
    given to the recurrent form, raise."""
    from pyattn import _core
    H, K, V, C, lens = 2, 5, 3, 4, (11, 6)
    q, k, v, a, b, gk, _ = inputs(17, B=1, T=sum(lens), H=H, K=K, V=V)
    h0 = f32_exact(np.random.default_rng(17).standard_normal((len(lens), H, K, V)))
    cu = np.array([0, lens[0], sum(lens)], dtype=np.int64)
    o = np.zeros_like(v)
    ht = np.zeros_like(h0)
    fwd = [q, k, v, a, b, gk, h0, o, ht, True, cu, _core.FORM_CHUNK, C, K ** -0.5, False]
    kept = _core.dplr_forward(*fwd)
    assert kept.shape == (sum(H * (-(-n // C) + 1) for n in lens), K, V)
    slot = 0
    for n, (r0, r1) in enumerate(zip(cu[:-1], cu[1:])):
        for h in range(H):
            S = h0[n, h].copy()
            for t in range(r0, r1 + 1):
                if (t - r0) % C == 0 or t == r1:
                    assert_close(kept[slot], S, 1e-12, name=f"slot {slot} (n={n} h={h} t={t})")
                    slot += 1
                if t < r1:
                    S = (np.exp(gk[0, t, h])[:, None] * S + np.outer(b[0, t, h], a[0, t, h] @ S)
                         + np.outer(k[0, t, h], v[0, t, h]))
            np.testing.assert_array_equal(kept[slot - 1], ht[n, h])
    assert slot == len(kept)
    fwd[11] = _core.FORM_RECURRENT
    assert _core.dplr_forward(*fwd) is None  # no states kept outside the chunk form
    rng = np.random.default_rng(18)
    do, dht = rng.standard_normal(o.shape), rng.standard_normal(ht.shape)

    def backward(states, form=_core.FORM_CHUNK):
        grads = [np.zeros_like(x) for x in (q, k, v, a, b, gk, h0)]
        _core.dplr_backward(q, k, v, a, b, gk, h0, do, dht, states, *grads, cu, form, C, K ** -0.5)
        return grads

    for name, recomputed, read in zip(("dq", "dk", "dv", "da", "db", "dgk", "dh0"), backward(None),
                                      backward(kept)):
        np.testing.assert_array_equal(read, recomputed, err_msg=name)
    raises(ValueError, backward, kept[1:].copy(), must=("'states'", "shape"))
    raises(TypeError, backward, kept.astype(np.float32), must=("'states'", "float32"))
    raises(ValueError, backward, kept, _core.FORM_RECURRENT, must=("chunk form",))

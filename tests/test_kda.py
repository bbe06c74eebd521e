"""kda (Kimi Delta Attention): the delta-rule engine with a decay per key channel and grouped
value heads, every form x dtype (the conventions and tolerances of docs/ops.md).

* The oracles: pyattn.reference.kda (float64, the literal loop over t) for the outputs, and
  ``adjoint``, a float64 NumPy reverse loop of the recurrence written here, for the
  gradients; both checked first (against central differences of the oracle, and against
  fla's naive_recurrent_kda when fla's file and torch are there).
* Forward and every gradient of every form and chunk size against them (float64 within
  1e-10 relative RMS; float32 outputs 1e-5, gradients 1e-4 against the float64 values): T in
  {1, 63, 64, 65, 300}, Dk != Dv, HV = 2 H and 3 H (groups), initial and final states; gates
  near 0 (-1e-4), strong (-20 per step), mixed (-5 .. 0), spread over channels (-1e-4 .. -20
  in one step), -inf (a reset of a channel) and -1e30; beta near 2.
* Central finite differences (pyattn.testing.gradcheck, float64, tiny shapes) of q, k, v, g,
  beta and initial_state; the forms against each other (pyattn.testing.check_forms).
* Relations: g equal in every channel is gated_delta_rule (forward and gradients; dg summed
  over channels); KDA is dplr_delta_rule with a rank-one term built from k, beta and g (another
  kernel; forward and gradients by the chain rule); qk_l2norm is the op on normalised q and k;
  two calls carrying the state are one call; cu_seqlens is separate calls; decode steps are
  one call; the kept states.
* Threads (bitwise), non-contiguous inputs, cotangent structures, NaN in -> NaN out, empty
  shapes, bad arguments.

Inputs are float32-representable float64 arrays (conftest.f32_exact), so one float64 oracle
serves both dtypes. conftest fills every np.empty/np.empty_like with NaN for the whole session,
so an output or gradient the kernels forget to write shows up here as NaN.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import pyattn
from pyattn import _core, reference
from pyattn.testing import TOLERANCES, assert_close, check_forms, gradcheck, rel_rms

import fla_naive
from conftest import f32_exact, raises

DTYPES = (np.float64, np.float32)
DT_IDS = ["f64", "f32"]
FORMS = ("chunk", "parallel", "recurrent")
CHUNK_SIZES = (16, 32, 64, 128)
ARRAYS = ("q", "k", "v", "g", "beta")


def tol_out(dtype):
    return TOLERANCES[np.dtype(dtype)][0]


def tol_grad(dtype):
    return TOLERANCES[np.dtype(dtype)][1]


# ------------------------------------------------------------------------------- inputs

GATES = {  # a log decay per step, value head and key channel
    "normal": lambda r, s: -r.uniform(0.0, 1.0, s),
    "weak": lambda r, s: -1e-4 * r.random(s),
    "strong": lambda r, s: -20.0 + r.random(s),
    "mixed": lambda r, s: -5.0 * r.random(s),
    # each step's channels from -1e-4 to -20: strong and weak channels in the same block
    "spread": lambda r, s: -np.exp(r.uniform(np.log(1e-4), np.log(20.0), s)),
}


def build(seed, B=1, T=20, H=2, G=2, K=8, V=6, *, N=None, state=True, final=True, keys="unit",
          beta="normal", gates="normal"):
    """(args, kwargs) of kda in float64, float32-representable: q, k [B, T, H, K], v
    [B, T, H G, V] (G value heads per q/k head), g [B, T, H G, K], beta [B, T, H G].

    keys: "unit" (rows of unit norm, to float32 rounding), "l2norm" (raw Gaussian q and k with
    qk_l2norm=True), "small" (Gaussian scaled to norm ~0.5, not normalised: for finite
    differences of k). beta: "normal" (uniform in (0.05, 1)), "near2" (uniform in (1.9,
    1.99): negative eigenvalues of I - beta k k^T). gates: a key of GATES."""
    r = np.random.default_rng(seed)
    N = B if N is None else N
    HV = H * G
    q = r.standard_normal((B, T, H, K))
    k = r.standard_normal((B, T, H, K))
    kw = {}
    if keys == "unit":
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    elif keys == "small":
        k = 0.5 * k / np.sqrt(K)
    elif keys == "l2norm":
        kw["qk_l2norm"] = True
    else:
        raise ValueError(keys)
    v = r.standard_normal((B, T, HV, V))
    g = GATES[gates](r, (B, T, HV, K))
    lo, hi = {"normal": (0.05, 1.0), "near2": (1.9, 1.99)}[beta]
    b = r.uniform(lo, hi, (B, T, HV))
    args = tuple(f32_exact(x) for x in (q, k, v, g, b))
    if state:
        kw["initial_state"] = f32_exact(r.standard_normal((N, HV, K, V)))
    if final:
        kw["output_final_state"] = True
    return args, kw


def cast(args, kw, dtype):
    c = lambda x: x.astype(dtype) if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x  # noqa: E731
    return tuple(c(a) for a in args), {n: c(x) for n, x in kw.items()}


def vjp(args, kw, **opts):
    """((o, final_state), pullback(do, dht=None))"""
    out, pb = pyattn.vjp(pyattn.kda, *args, **kw, **opts)
    return out, lambda do, dht=None: pb((do, dht))


def oracle(args, kw):
    return reference.kda(*args, **kw)


def cotangents(seed, o, ht):
    r = np.random.default_rng(seed)
    do = f32_exact(r.standard_normal(o.shape))
    dht = None if ht is None else f32_exact(r.standard_normal(ht.shape))
    return do, dht


def check_out(out, ref, dtype, what=""):
    """Outputs and final state: dtype, shape, finite, within the output tolerance."""
    o, ht = out
    o_ref, ht_ref = ref
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert np.all(np.isfinite(o)), f"{what} o not finite"
    assert_close(o, o_ref, tol_out(dtype), name=f"{what} o")
    if ht_ref is None:
        assert ht is None
        return
    assert ht.dtype == dtype and ht.shape == ht_ref.shape
    assert np.all(np.isfinite(ht)), f"{what} final state not finite"
    assert_close(ht, ht_ref, tol_out(dtype), name=f"{what} final state")


def check_grads(g, g_ref, dtype, what=""):
    assert set(g) == set(g_ref), f"{what}: {sorted(g)} != {sorted(g_ref)}"
    for name in g_ref:
        assert g[name].dtype == dtype and g[name].shape == g_ref[name].shape, name
        assert np.all(np.isfinite(g[name])), f"{what} d{name} not finite"
        assert_close(g[name], g_ref[name], tol_grad(dtype), name=f"{what} d{name}")


# ------------------------------------------------------------------------------- adjoint oracle


def _l2(x):
    n = np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)
    return x / n, n


def adjoint(args, kw, do, dht):
    """float64 gradients {q, k, v, g, beta, initial_state (when given)} of kda by a literal
    reverse loop over the recurrence, one (batch, value head) at a time, states stored forward,
    dS carried backward. With D = diag(a) S_{t-1} (a = exp(g_t)), w = D^T k, u = beta (v - w),
    S_t = D + k u^T: du = dS^T k, dbeta = du . (v - w), dv = beta du, dk = dS u - beta D du,
    dD = dS - beta k du^T, dg = a * rowsum(S_{t-1} * dD), dS_{t-1} = diag(a) dD. No cu_seqlens."""
    assert kw.get("cu_seqlens") is None
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in args)
    l2 = kw.get("qk_l2norm", False)
    if l2:
        (q, nq), (k, nk) = _l2(q), _l2(k)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    group = HV // H
    scale = kw.get("scale") or K ** -0.5
    h0 = kw.get("initial_state")
    h0 = np.zeros((B, HV, K, V)) if h0 is None else np.asarray(h0, np.float64)
    dht = np.zeros((B, HV, K, V)) if dht is None else np.asarray(dht, np.float64)
    do = np.asarray(do, np.float64)
    gr = {"q": np.zeros_like(q), "k": np.zeros_like(k), "v": np.zeros_like(v), "g": np.zeros_like(g),
          "beta": np.zeros_like(beta), "initial_state": np.zeros_like(h0)}
    for b in range(B):
        for h in range(HV):
            hq = h // group
            S = [h0[b, h]]
            for t in range(T):
                D = np.exp(g[b, t, h])[:, None] * S[-1]
                kt = k[b, t, hq]
                S.append(D + np.outer(kt, beta[b, t, h] * (v[b, t, h] - D.T @ kt)))
            dS = dht[b, h].copy()
            for t in reversed(range(T)):
                a, Sp, kt, bt = np.exp(g[b, t, h]), S[t], k[b, t, hq], beta[b, t, h]
                D = a[:, None] * Sp
                w = D.T @ kt
                u = bt * (v[b, t, h] - w)
                dS = dS + scale * np.outer(q[b, t, hq], do[b, t, h])
                gr["q"][b, t, hq] += scale * S[t + 1] @ do[b, t, h]
                du = dS.T @ kt
                gr["beta"][b, t, h] = du @ (v[b, t, h] - w)
                gr["v"][b, t, h] = bt * du
                gr["k"][b, t, hq] += dS @ u - bt * D @ du
                dD = dS - bt * np.outer(kt, du)
                gr["g"][b, t, h] = a * np.sum(Sp * dD, axis=1)
                dS = a[:, None] * dD
            gr["initial_state"][b, h] = dS
    if l2:
        for name, y, n in (("q", q, nq), ("k", k, nk)):
            dy = gr[name]
            gr[name] = (dy - y * np.sum(y * dy, axis=-1, keepdims=True)) / n
    if kw.get("initial_state") is None:
        del gr["initial_state"]
    return gr


def _numeric_grads(args, kw, do, dht, eps=1e-6):
    """central differences of <do, o> + <dht, final state> of the oracle, every input"""
    arrays = dict(zip(ARRAYS, args), initial_state=kw["initial_state"])
    out = {}
    for name, x in arrays.items():
        num = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            orig = x[i]
            vals = []
            for d in (eps, -eps):
                x[i] = orig + d
                o, ht = oracle(args, kw)
                vals.append(np.sum(o * do) + np.sum(ht * dht))
            x[i] = orig
            num[i] = (vals[0] - vals[1]) / (2 * eps)
        out[name] = num
    return out


@pytest.mark.parametrize("spec", [dict(keys="l2norm", beta="near2"), dict(keys="small", G=3, gates="mixed")],
                         ids=["l2norm_near2", "G3_mixed"])
def test_adjoint_oracle_matches_finite_differences(spec):
    """The test's own adjoint oracle is right: against central differences of the reference
    forward, with groups, an initial state and a final-state cotangent."""
    args, kw = build(9, B=1, T=6, H=1, K=3, V=2, **dict(dict(G=2), **spec))
    o, ht = oracle(args, kw)
    do, dht = cotangents(10, o, ht)
    g = adjoint(args, kw, do, dht)
    num = _numeric_grads(args, kw, do, dht)
    assert set(g) == set(num)
    for name in num:
        np.testing.assert_allclose(g[name], num[name], rtol=1e-6, atol=1e-8, err_msg=name)


def _fla_naive():
    """fla's naive KDA module, or a skip"""
    pytest.importorskip("einops")
    return fla_naive.load("ops/kda/naive.py")


@pytest.mark.parametrize("gates", ["normal", "spread"])
def test_oracle_matches_fla_naive(gates):
    """pyattn.reference.kda and pyattn.kda agree with fla's naive_recurrent_kda (and, T a
    multiple of its chunk, naive_chunk_kda) on the same inputs: groups, initial and final
    states. fla computes in float32, hence the float32 tolerance."""
    import torch

    fla = _fla_naive()
    args, kw = build(31, B=2, T=64, H=2, G=2, K=16, V=8, gates=gates)
    q, k, v, g, beta = (torch.from_numpy(x) for x in args)
    h0 = torch.from_numpy(kw["initial_state"])
    ref = oracle(args, kw)
    for name, fn in (("recurrent", fla.naive_recurrent_kda), ("chunk", fla.naive_chunk_kda)):
        o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert_close(o.double().numpy(), ref[0], 1e-5, name=f"fla {name} o")
        assert_close(ht.double().numpy(), ref[1], 1e-5, name=f"fla {name} final state")
    o, ht = pyattn.kda(*args, **kw)
    assert_close(o, ref[0], 1e-10, name="o")
    assert_close(ht, ref[1], 1e-10, name="final state")


# ------------------------------------------------------------------------------- forward, gradients

SHAPES = {
    "B2_T65_G2": dict(B=2, T=65, H=2, G=2, K=8, V=6),
    "B1_T1_G2": dict(B=1, T=1, H=2, G=2, K=5, V=3),
    "B2_T130_G1_zero_state": dict(B=2, T=130, H=3, G=1, K=16, V=12, state=False),
    "B1_T64_G3_no_final": dict(B=1, T=64, H=1, G=3, K=7, V=9, final=False),
    "B1_T100_G2_l2norm": dict(B=1, T=100, H=2, G=2, K=12, V=4, keys="l2norm"),
    "B1_T80_G2_spread": dict(B=1, T=80, H=1, G=2, K=16, V=8, gates="spread"),
}


@functools.lru_cache(maxsize=None)
def shape_case(name):
    args, kw = build(sum(map(ord, name)), **SHAPES[name])
    return args, kw, oracle(args, kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", sorted(SHAPES))
@pytest.mark.parametrize("form", FORMS)
def test_forward_vs_oracle(form, case, dtype):
    args, kw, ref = shape_case(case)
    a, k = cast(args, kw, dtype)
    out = pyattn.kda(*a, **k, form=form)
    check_out(out, ref, dtype, form)
    if not kw.get("output_final_state"):
        assert out[1] is None


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_defaults_form_chunk_size_scale(dtype):
    """The default form is chunk with chunk_size 64; scale defaults to K**-0.5 and an explicit
    scale is honoured; output_final_state defaults to False; OPS lists the forms."""
    assert pyattn.OPS["kda"].forms[0] == "chunk" and set(pyattn.OPS["kda"].forms) == set(FORMS)
    assert pyattn.OPS["kda"].differentiable == ARRAYS + ("initial_state",)
    args, kw, _ = shape_case("B2_T65_G2")
    a, k = cast(args, kw, dtype)
    default = pyattn.kda(*a, **k)
    np.testing.assert_array_equal(default[0], pyattn.kda(*a, **k, form="chunk", chunk_size=64)[0])
    np.testing.assert_array_equal(default[0], pyattn.kda(*a, **dict(k, scale=8 ** -0.5))[0])
    other = pyattn.kda(*a, **dict(k, scale=0.37))
    assert_close(other[0], oracle(args, dict(kw, scale=0.37))[0], tol_out(dtype))
    k2 = {n: x for n, x in k.items() if n != "output_final_state"}
    assert pyattn.kda(*a, **k2)[1] is None


@functools.lru_cache(maxsize=None)
def chunk_case(T, state):
    args, kw = build(1000 + T + state, B=1, T=T, H=2, G=2, K=16, V=12, state=state)
    ref = oracle(args, kw)
    do, dht = cotangents(T, *ref)
    return args, kw, ref, do, dht, adjoint(args, kw, do, dht)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
def test_chunk_sizes(T, state, dtype):
    """Every chunk size, T a multiple of it or not (a ragged last chunk), with and without an
    initial state, HV = 2 H, Dk != Dv: outputs and final state against the oracle, every
    gradient against the adjoint oracle; and the parallel and recurrent forms alike."""
    args, kw, ref, do, dht, g_ref = chunk_case(T, state)
    a, k = cast(args, kw, dtype)
    runs = [("chunk", cs) for cs in CHUNK_SIZES] + [("parallel", 64), ("recurrent", 64)]
    for form, cs in runs:
        out, pb = vjp(a, k, form=form, chunk_size=cs)
        check_out(out, ref, dtype, f"{form} chunk_size={cs}")
        check_grads(pb(do.astype(dtype), dht.astype(dtype)), g_ref, dtype, f"{form} chunk_size={cs}")


REGIMES = {
    "beta_near2": dict(beta="near2"),
    "beta_near2_l2norm": dict(beta="near2", keys="l2norm"),
    "weak": dict(gates="weak"),
    "strong": dict(gates="strong"),
    "strong_near2": dict(gates="strong", beta="near2"),
    "mixed_G3": dict(gates="mixed", H=1, G=3),
    "spread": dict(gates="spread"),
}


@functools.lru_cache(maxsize=None)
def regime_case(which):
    spec = dict(dict(B=1, T=300, H=2, G=2, K=16, V=12), **REGIMES[which])
    args, kw = build(len(which) * 7 + 3, **spec)
    ref = oracle(args, kw)
    do, dht = cotangents(11, *ref)
    return args, kw, ref, do, dht, adjoint(args, kw, do, dht)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("which", sorted(REGIMES))
def test_beta_and_gate_regimes(which, form, dtype):
    """beta near 2 (I - beta k k^T flips the state's sign along k each step), gates near 0
    (-1e-4: a chunk's gate factors into one GEMM), strong (-20 per step: sub-blocks rescaled
    to one of their rows), mixed, and spread over the channels of each step (-1e-4 .. -20),
    T = 300, every chunk size: outputs, final states and every gradient finite and within
    tolerance of the oracle and the adjoint oracle."""
    args, kw, ref, do, dht, g_ref = regime_case(which)
    assert np.all(np.isfinite(ref[0])) and np.abs(ref[1]).max() < 1e3  # bounded
    a, k = cast(args, kw, dtype)
    for cs in (CHUNK_SIZES if form == "chunk" else (64,)):
        out, pb = vjp(a, k, form=form, chunk_size=cs)
        check_out(out, ref, dtype, f"{which} {form} {cs}")
        check_grads(pb(do.astype(dtype), dht.astype(dtype)), g_ref, dtype, f"{which} {form} {cs}")


@pytest.mark.parametrize("h0", [False, True], ids=["no_h0", "h0"])
@pytest.mark.parametrize("T", [1, 2, 16, 100])
@pytest.mark.parametrize("form", FORMS)
def test_strong_gate_dg_with_final_state_cotangent(form, T, h0):
    """Gates of -20 .. -19 per step and channel and a cotangent on the final state, float64,
    tiny shapes: dg (of size e^-20 ~ 2e-9 relative to the other gradients) within 1e-10
    relative RMS of the adjoint oracle, every form: dg must come from products of bounded
    factors, not from differences of undecayed terms, whose float64 rounding (~1e-16
    absolute) would be a relative error of ~1e-8 in dg."""
    K = V = 2 if T <= 2 else 4
    args, kw = build(T + 5 * h0, B=1, T=T, H=1, G=2, K=K, V=V, state=h0, gates="strong")
    kw["output_final_state"] = True
    ref = oracle(args, kw)
    do, dht = cotangents(3, *ref)
    g_ref = adjoint(args, kw, do, dht)
    _, pb = vjp(args, kw, form=form, chunk_size=16)
    got = pb(do, dht)
    for name in g_ref:
        assert_close(got[name], g_ref[name], 1e-10, name=f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
def test_resets_and_huge_gates(form, dtype):
    """g = -inf in some channels at some steps (a reset of those channels: what they held is
    forgotten), a whole step of -inf, and -1e30 in one channel followed by weak gates, among
    gates of -5 .. 0: every form and chunk size equals the oracle, finite, and every gradient
    the adjoint oracle's (the clamped steps' dg is 0, as exp's derivative there)."""
    args, kw = build(60, B=1, T=150, H=1, G=2, K=8, V=6, gates="mixed")
    q, k, v, g, beta = args
    g = g.copy()
    g[0, [0, 40, 64, 97], 0, :3] = -np.inf
    g[0, 97, 1] = -np.inf
    g[0, 20:30, 1, 5] = -20.0
    g[0, 120, 1, 2] = -1e30  # finite, but as good as a reset
    g[0, 121:150, 1, 2] = -1e-4  # weak gates after it: the rows' decays must keep their digits
    args = (q, k, v, g, beta)
    ref = oracle(args, kw)
    assert np.all(np.isfinite(ref[0])) and np.all(np.isfinite(ref[1]))
    do, dht = cotangents(61, *ref)
    g_ref = adjoint(args, kw, do, dht)
    assert all(np.all(np.isfinite(x)) for x in g_ref.values())
    a, kk = cast(args, kw, dtype)
    for cs in (CHUNK_SIZES if form == "chunk" else (64,)):
        out, pb = vjp(a, kk, form=form, chunk_size=cs)
        check_out(out, ref, dtype, f"{form} {cs}")
        grads = pb(do.astype(dtype), dht.astype(dtype))
        check_grads(grads, g_ref, dtype, f"{form} {cs}")
        assert np.all(grads["g"][0, 97, 1] == 0) and np.all(grads["g"][0, 40, 0, :3] == 0)


# ------------------------------------------------------------------------------- finite differences

TINY = dict(B=1, T=7, H=1, G=2, K=3, V=2, keys="small")

# name: builder kwargs (chunk_size popped)
GRADCHECK_CASES = {
    "plain": dict(TINY),
    "no_state": dict(TINY, state=False),
    "no_final": dict(TINY, final=False),
    "T1": dict(TINY, T=1),
    "l2norm": dict(TINY, keys="l2norm"),
    "near2": dict(TINY, keys="l2norm", beta="near2"),
    "strong": dict(TINY, gates="strong"),
    "weak": dict(TINY, gates="weak"),
    "spread": dict(TINY, gates="spread"),
    "G1_Dk4_Dv1": dict(TINY, G=1, K=4, V=1),
    "H2_G3": dict(TINY, H=2, G=3, T=5),
    # several chunks of 16 and a ragged last one: the chunk form's inter-chunk backward
    "T35_chunks": dict(B=1, T=35, H=1, G=2, K=2, V=2, keys="small", chunk_size=16),
    "T35_chunks_l2norm_B2": dict(B=2, T=35, H=1, G=1, K=2, V=2, keys="l2norm", chunk_size=16),
}


@pytest.mark.parametrize("case,form", [pytest.param(c, f, id=f"{c}-{f}") for c in sorted(GRADCHECK_CASES)
                                       for f in FORMS])
def test_gradcheck(case, form):
    spec = dict(GRADCHECK_CASES[case])
    cs = spec.pop("chunk_size", 64)
    args, kw = build(sum(map(ord, case)), **spec)
    with pyattn.num_threads(1):  # hundreds of tiny calls
        errs = gradcheck(pyattn.kda, args, dict(kw, form=form, chunk_size=cs))
    expected = set(ARRAYS) | ({"initial_state"} if spec.get("state", True) else set())
    assert set(errs) == expected


@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("form", FORMS)
def test_gradcheck_cu_seqlens(form, cu_dtype):
    cu = np.array([0, 3, 3, 8, 9], dtype=cu_dtype)
    args, kw = build(77, B=1, T=9, H=1, G=2, K=3, V=2, N=4, keys="small")
    kw["cu_seqlens"] = cu
    with pyattn.num_threads(1):
        errs = gradcheck(pyattn.kda, args, dict(kw, form=form))
    assert set(errs) == set(ARRAYS) | {"initial_state"}


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("which", ["normal", "spread"])
def test_check_forms(which, dtype):
    args, kw = build(41, B=2, T=300, H=2, G=2, K=16, V=12, keys="l2norm", gates=which)
    a, k = cast(args, kw, dtype)
    res = check_forms("kda", a, k)
    assert set(res) == {"parallel", "recurrent"}
    expected = {"out[0]", "out[1]"} | {f"d{n}" for n in ARRAYS} | {"dinitial_state"}
    for errs in res.values():
        assert set(errs) == expected


# ------------------------------------------------------------------------------- relations


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("gates", ["normal", "strong"])
@pytest.mark.parametrize("form", FORMS)
def test_equal_channels_is_gated_delta_rule(form, gates, dtype):
    """kda with g the same in every channel equals gated_delta_rule with that g: outputs,
    final states, the q, k, v, beta and initial-state gradients, and dg summed over the
    channels (float64: 1e-12 relative RMS; float32: 2e-6), every chunk size."""
    args, kw = build(62, B=2, T=150, H=2, G=1, K=16, V=12, keys="l2norm", gates=gates)
    a, k = cast(args, kw, dtype)
    q, kk, v, g, beta = a
    g1 = np.ascontiguousarray(g[..., 0])
    gv = np.ascontiguousarray(np.broadcast_to(g1[..., None], g.shape))
    tol = 1e-12 if dtype == np.float64 else 2e-6
    for cs in (CHUNK_SIZES if form == "chunk" else (64,)):
        out, pb = vjp((q, kk, v, gv, beta), k, form=form, chunk_size=cs)
        out2, pb2 = pyattn.vjp(pyattn.gated_delta_rule, q, kk, v, g1, beta, **k, form=form, chunk_size=cs)
        assert_close(out[0], out2[0], tol, name="o")
        assert_close(out[1], out2[1], tol, name="final state")
        do, dht = (x.astype(dtype) for x in cotangents(63, *out))
        gk, gd = pb(do, dht), pb2((do, dht))
        assert set(gk) == set(gd)
        for n in gd:
            got = gk[n].sum(axis=-1) if n == "g" else gk[n]
            assert_close(got, gd[n], tol, name=f"d{n}")


@pytest.mark.parametrize("form", FORMS)
def test_is_dplr_delta_rule(form):
    """KDA is the DPLR delta rule (pyattn.dplr_delta_rule, its recurrent form: another kernel)
    with b = k, a = -beta exp(g) k, the write beta k and gk = g, since
    (I - beta k k^T) diag(exp(g)) = diag(exp(g)) + k (-beta exp(g) k)^T: outputs and final state,
    and the gradients through that map by the chain rule, float64 within 1e-12."""
    args, kw = build(66, B=2, T=70, H=2, G=1, K=8, V=6, gates="mixed")
    q, k, v, g, beta = args
    bk, e = beta[..., None], np.exp(g)
    (o, ht), pb = vjp(args, kw, form=form, chunk_size=16)
    (o2, ht2), pb2 = pyattn.vjp(pyattn.dplr_delta_rule, q, bk * k, v, -bk * e * k, k, g, **kw)
    assert_close(o, o2, 1e-12, name="o")
    assert_close(ht, ht2, 1e-12, name="final state")
    do, dht = cotangents(67, o, ht)
    got, d = pb(do, dht), pb2((do, dht))
    want = {"q": d["q"], "v": d["v"], "initial_state": d["initial_state"],
            "k": bk * d["k"] + d["b"] - bk * e * d["a"],
            "beta": np.sum(k * d["k"] - e * k * d["a"], axis=-1),
            "g": d["gk"] - bk * e * k * d["a"]}
    for name, x in want.items():
        assert_close(got[name], x, 1e-12, name=f"d{name}")


def test_qk_l2norm_is_normalised_inputs():
    """qk_l2norm=True equals the op on q / sqrt(|q|^2 + 1e-6) and k likewise (outputs, final
    state), and scales q and k away: (c q, c k) give the same outputs for c > 0 (up to the
    1e-6 inside the norm)."""
    args, kw = build(64, B=1, T=100, H=2, G=2, K=8, V=6, keys="l2norm")
    plain = {n: x for n, x in kw.items() if n != "qk_l2norm"}
    q, k = args[:2]
    nq, nk = _l2(q)[0], _l2(k)[0]
    for form in FORMS:
        o, ht = pyattn.kda(*args, **kw, form=form)
        o2, ht2 = pyattn.kda(nq, nk, *args[2:], **plain, form=form)
        assert_close(o, o2, 1e-12)
        assert_close(ht, ht2, 1e-12)
        o3, _ = pyattn.kda(7 * q, 3 * k, *args[2:], **kw, form=form)
        assert_close(o3, o, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
def test_state_passing_two_calls(form, dtype):
    """T = 150 run as rows 0:70 then 70:150, the first call's final state as the second's
    initial state, equals one run: outputs and final state; and the gradients, pulling the
    second call's initial-state gradient back through the first as its final-state cotangent."""
    args, kw = build(17, B=2, T=150, H=2, G=2, K=8, V=6, keys="l2norm")
    a, k = cast(args, kw, dtype)
    full, pb = vjp(a, k, form=form)
    do, dht = (x.astype(dtype) for x in cotangents(18, *full))
    g = pb(do, dht)
    split = 70
    (o1, h1), pb1 = vjp(tuple(x[:, :split] for x in a), k, form=form)
    (o2, h2), pb2 = vjp(tuple(x[:, split:] for x in a), dict(k, initial_state=h1), form=form)
    assert_close(np.concatenate([o1, o2], axis=1), full[0], tol_out(dtype), name="o")
    assert_close(h2, full[1], tol_out(dtype), name="final state")
    g2 = pb2(do[:, split:], dht)
    g1 = pb1(do[:, :split], g2["initial_state"])
    assert set(g1) == set(g2) == set(g)
    for name, x in g.items():
        got = g1[name] if name == "initial_state" else np.concatenate([g1[name], g2[name]], axis=1)
        assert_close(got, x, tol_grad(dtype), name=f"d{name}")


def test_decode_steps_equal_one_call():
    """The recurrent form one step at a time (T = 1 calls carrying the state: decoding) equals
    one chunk call, float64."""
    args, kw = build(19, B=2, T=40, H=2, G=2, K=8, V=6)
    o, ht = pyattn.kda(*args, **kw, form="chunk")
    h = kw["initial_state"]
    outs = []
    for t in range(40):
        ot, h = pyattn.kda(*(x[:, t:t + 1] for x in args), **dict(kw, initial_state=h), form="recurrent")
        outs.append(ot)
    assert_close(np.concatenate(outs, axis=1), o, 1e-12)
    assert_close(h, ht, 1e-12)


LENS = [0, 5, 70, 0, 1, 64, 33, 0]  # empty first, middle and last; 1; a chunk; ragged


@functools.lru_cache(maxsize=None)
def varlen_case():
    cu = np.concatenate([[0], np.cumsum(LENS)])
    args, kw = build(20, B=1, T=int(cu[-1]), H=2, G=2, K=8, V=6, N=len(LENS), keys="l2norm")
    return cu, args, kw, oracle(args, dict(kw, cu_seqlens=cu))


@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
def test_cu_seqlens_equals_separate_calls(form, dtype, cu_dtype):
    """Packed sequences (empty ones included) give each sequence's output, final state and
    gradients as a call on it alone with its own initial state; an empty sequence passes its
    initial state through, and its final state's cotangent back. The packed result also
    matches the oracle."""
    cu, args, kw, ref = varlen_case()
    a, k = cast(args, kw, dtype)
    k["cu_seqlens"] = cu.astype(cu_dtype)
    out, pb = vjp(a, k, form=form)
    check_out(out, ref, dtype, "packed")
    o, ht = out
    do, dht = (x.astype(dtype) for x in cotangents(13, o, ht))
    g = pb(do, dht)
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        if e == s:
            np.testing.assert_array_equal(ht[n], k["initial_state"][n])
            np.testing.assert_array_equal(g["initial_state"][n], dht[n])
            continue
        pk = {n_: x for n_, x in k.items() if n_ != "cu_seqlens"}
        pk["initial_state"] = k["initial_state"][n:n + 1]
        (o1, ht1), pb1 = vjp(tuple(x[:, s:e] for x in a), pk, form=form)
        assert_close(o[:, s:e], o1, tol_out(dtype), name=f"seq {n} o")
        assert_close(ht[n:n + 1], ht1, tol_out(dtype), name=f"seq {n} state")
        g1 = pb1(do[:, s:e], dht[n:n + 1])
        assert set(g1) == set(g)
        for name, x in g1.items():
            got = g[name][n:n + 1] if name == "initial_state" else g[name][:, s:e]
            assert_close(got, x, tol_grad(dtype), name=f"seq {n} d{name}")


def test_cu_seqlens_equals_batch_and_starts_from_zeros():
    """B equal-length sequences as a batch, or packed with cu_seqlens: the same numbers; and
    without an initial state each packed sequence starts from zeros."""
    args, kw = build(15, B=3, T=40, H=2, G=2, K=8, V=6)
    packed = tuple(x.reshape((1, 120) + x.shape[2:]) for x in args)
    for cu_dtype in (np.int32, np.int64):
        pk = dict(kw, cu_seqlens=(np.arange(4) * 40).astype(cu_dtype))
        for form in FORMS:
            o_b, ht_b = pyattn.kda(*args, **kw, form=form)
            o_p, ht_p = pyattn.kda(*packed, **pk, form=form)
            assert_close(o_p.reshape(o_b.shape), o_b, 1e-13)
            assert_close(ht_p, ht_b, 1e-13)
    cu = np.array([0, 0, 30, 31, 100])
    args, kw = build(21, B=1, T=100, H=2, G=2, K=8, V=6, N=4, state=False)
    for form in FORMS:
        out = pyattn.kda(*args, **kw, cu_seqlens=cu, form=form)
        assert out[1].shape == (4, 4, 8, 6)
        check_out(out, oracle(args, dict(kw, cu_seqlens=cu)), np.float64, form)
        assert np.all(out[1][0] == 0)


def _unit_states(args, kw, n, hv, C):
    """the oracle's state of sequence n, value head hv entering each chunk of C rows, then the
    final one (float64)"""
    q, k, v, g, beta = args
    T, group = q.shape[1], v.shape[2] // q.shape[2]
    S = kw["initial_state"][n, hv].astype(np.float64)
    states = []
    for t in range(T + 1):
        if t % C == 0 or t == T:
            states.append(S.copy())
        if t < T:
            kt = k[n, t, hv // group].astype(np.float64)
            S = np.exp(g[n, t, hv].astype(np.float64))[:, None] * S
            S = S + np.outer(kt, beta[n, t, hv] * (v[n, t, hv] - S.T @ kt))
    return states


def test_core_kept_states():
    """_core.delta_forward with a vector gate and groups: keep=True with the chunk form returns
    the state entering each chunk of every (sequence, value head), then the final one (the
    oracle's); a backward reading them equals one recomputing them, bitwise; gradients of a
    grouped call have q's and k's shapes."""
    args, kw = build(23, B=2, T=9, H=1, G=2, K=4, V=3)
    q, k, v, g, beta = args
    h0 = kw["initial_state"]
    C, scale = 4, 4 ** -0.5
    cu = np.arange(3, dtype=np.int64) * 9
    o, ht = np.zeros(v.shape), np.zeros(h0.shape)
    kept = _core.delta_forward(q, k, v, g, beta, h0, o, ht, True, cu, _core.FORM_CHUNK, C, scale, False)
    assert kept.shape == (2 * 2 * 4, 4, 3)
    slot = 0
    for n in range(2):
        for hv in range(2):
            for S in _unit_states(args, kw, n, hv, C):
                assert_close(kept[slot], S, 1e-12, name=f"slot {slot}")
                slot += 1
    do, dht = cotangents(24, o, ht)
    grads = []
    for states in (None, kept):
        out = [np.zeros_like(x) for x in (q, k, v, g, beta, h0)]
        _core.delta_backward(q, k, v, g, beta, h0, do, dht, states, *out[:3], out[3], out[4], out[5], cu,
                             _core.FORM_CHUNK, C, scale)
        grads.append(out)
    for a, b, name in zip(*grads, ("dq", "dk", "dv", "dg", "dbeta", "dh0")):
        np.testing.assert_array_equal(a, b, err_msg=name)
    g_ref = adjoint(args, kw, do, dht)
    for got, name in zip(grads[0], ("q", "k", "v", "g", "beta", "initial_state")):
        assert_close(got, g_ref[name], 1e-10, name=f"d{name}")


# ------------------------------------------------------------------------------- long run


def test_long_float32_run():
    """T = 8192, float32, qk_l2norm keys, K = V = 32, two value heads per q/k head: the chunk
    and recurrent forms agree within 1e-4 relative RMS (outputs and final state), both finite
    and within 1e-4 of the float64 recurrent form, and the state stays bounded."""
    T = 8192
    args, kw = build(65, B=1, T=T, H=1, G=2, K=32, V=32, keys="l2norm", state=False, gates="spread")
    a, k = cast(args, kw, np.float32)
    o_c, h_c = pyattn.kda(*a, **k, form="chunk")
    o_r, h_r = pyattn.kda(*a, **k, form="recurrent")
    assert np.all(np.isfinite(o_c)) and np.all(np.isfinite(o_r))
    assert rel_rms(o_c, o_r) <= 1e-4, rel_rms(o_c, o_r)
    assert rel_rms(h_c, h_r) <= 1e-4, rel_rms(h_c, h_r)
    o64, h64 = pyattn.kda(*args, **kw, form="recurrent")
    assert rel_rms(o_c, o64) <= 1e-4 and rel_rms(h_c, h64) <= 1e-4
    assert np.linalg.norm(h_c[0, 0]) < 32  # sqrt(K V): unit keys, beta < 1, decays <= 1


# ------------------------------------------------------------------------------- threads, layouts


@functools.lru_cache(maxsize=None)
def threads_case(dtype, varlen):
    if varlen:
        args, kw = build(39, B=1, T=2000, H=1, G=2, K=32, V=32, N=4, keys="l2norm")
        kw["cu_seqlens"] = np.array([0, 700, 700, 1300, 2000])
    else:
        args, kw = build(39, B=2, T=1000, H=1, G=2, K=32, V=32, keys="l2norm")
    a, k = cast(args, kw, dtype)
    ref = oracle(args, kw)
    do, dht = (x.astype(dtype) for x in cotangents(40, *ref))
    return a, k, do, dht, ref


@pytest.mark.filterwarnings("ignore:set_num_threads")  # 4 threads on a 2-CPU machine
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "cu_seqlens"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_thread_count_invariance(dtype, varlen):
    """1, 2 and 4 threads give identical results (outputs, final states, every gradient),
    bitwise, in every form; the outputs also match the oracle."""
    a, k, do, dht, ref = threads_case(dtype, varlen)
    for form in FORMS:
        results = []
        for n in (1, 2, 4):
            with pyattn.num_threads(n):
                out, pb = vjp(a, k, form=form)
                g = pb(do, dht)
            results.append({"o": out[0], "final_state": out[1], **{f"d{x}": y for x, y in g.items()}})
        for r in results[1:]:
            assert set(r) == set(results[0])
            for name in r:
                np.testing.assert_array_equal(r[name], results[0][name], err_msg=f"{form} {name}")
        check_out((results[0]["o"], results[0]["final_state"]), ref, dtype, form)


def test_cotangent_structures():
    """pullback(do) == pullback((do, None)); the final state's cotangent alone; linearity; the
    inputs are not modified; outputs equal the direct call's."""
    args, kw = build(35, B=1, T=50, H=2, G=2, K=5, V=4, keys="l2norm")
    copies = [np.copy(x) for x in args] + [np.copy(kw["initial_state"])]
    out, pb = pyattn.vjp(pyattn.kda, *args, **kw)
    direct = pyattn.kda(*args, **kw)
    np.testing.assert_array_equal(out[0], direct[0])
    np.testing.assert_array_equal(out[1], direct[1])
    do, dht = cotangents(36, *out)
    g_full, g_do, g_ht, g_bare = pb((do, dht)), pb((do, None)), pb((None, dht)), pb(do)
    assert set(g_full) == set(ARRAYS) | {"initial_state"}
    for n in g_full:
        np.testing.assert_array_equal(g_bare[n], g_do[n])
        assert_close(g_do[n] + g_ht[n], g_full[n], 1e-12, name=n)
    g2 = pb((2 * do, 2 * dht))
    for n in g_full:
        assert_close(g2[n], 2 * g_full[n], 1e-13, name=n)
    for x, c in zip(list(args) + [kw["initial_state"]], copies):
        np.testing.assert_array_equal(x, c)


def test_noncontiguous_inputs():
    """Inputs stored transposed ([B, H, T, D] memory): the same results, bitwise."""
    args, kw = build(37, B=2, T=45, H=2, G=3, K=6, V=5)
    nc = tuple(np.ascontiguousarray(x.swapaxes(1, 2)).swapaxes(1, 2) for x in args)
    assert not any(x.flags.c_contiguous for x in nc)
    for form in FORMS:
        out, pb = vjp(args, kw, form=form)
        out_nc, pb_nc = vjp(nc, kw, form=form)
        np.testing.assert_array_equal(out_nc[0], out[0])
        np.testing.assert_array_equal(out_nc[1], out[1])
        g, g_nc = pb(out[0]), pb_nc(out[0])
        for n in g:
            np.testing.assert_array_equal(g_nc[n], g[n])


def test_empty_time_and_batch():
    """T = 0: an empty output and the initial state as the final state, whose gradient is the
    final state's cotangent. B = 0: empty outputs and gradients."""
    args, kw = build(3, B=2, T=0, H=1, G=2, K=4, V=3)
    for form in FORMS:
        (o, ht), pb = vjp(args, kw, form=form)
        assert o.shape == (2, 0, 2, 3)
        np.testing.assert_array_equal(ht, kw["initial_state"])
        dht = np.random.default_rng(4).standard_normal(ht.shape)
        g = pb(np.zeros_like(o), dht)
        np.testing.assert_array_equal(g["initial_state"], dht)
        for name, x in zip(ARRAYS, args):
            assert g[name].shape == x.shape
    args, kw = build(5, B=0, T=6, H=1, G=2, K=4, V=3)
    (o, ht), pb = vjp(args, kw)
    assert o.shape == (0, 6, 2, 3) and ht.shape[0] == 0
    g = pb(o, ht)
    for name, x in zip(ARRAYS, args):
        assert g[name].shape == x.shape


# ------------------------------------------------------------------------------- NaN in, NaN out


def check_nan_grads(grads, g_ref, dtype, may_add=(), rows=None):
    """Gradients NaN wherever the adjoint oracle's are (never a silent number), their finite
    entries within tolerance of it; NaN where the oracle's are finite only in the gradients
    named in may_add, at rows (of batch entry 1) in the range rows."""
    for n, x in grads.items():
        got, ref = np.isnan(x), np.isnan(g_ref[n])
        assert np.all(got[ref]), f"d{n}: the NaN vanished"
        extra = got & ~ref
        if n in may_add:
            assert not extra[0].any() and np.all((np.nonzero(extra[1])[0] >= rows[0]) & (np.nonzero(extra[1])[0] < rows[1])), n
        else:
            np.testing.assert_array_equal(got, ref, err_msg=f"d{n}: NaN entries")
        ok = ~got & ~ref
        assert_close(x[ok], g_ref[n][ok], tol_grad(dtype), name=f"d{n}")


NAN_RUNS = [("chunk", 16), ("chunk", 64), ("parallel", 64), ("recurrent", 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form,cs", NAN_RUNS, ids=[f"{f}{c}" for f, c in NAN_RUNS])
@pytest.mark.parametrize("name", ARRAYS + ("initial_state",))
def test_nan_input(name, form, cs, dtype):
    """A NaN in one input of batch entry 1 (row 40 of a per-step input, inside a chunk; one
    channel of g; one entry of the initial state): the outputs are NaN exactly where the
    oracle's are, the others within tolerance of a clean run's (batch entry 0's bitwise); the
    gradients are NaN wherever the adjoint oracle's are, and exactly there in the recurrent
    form, their finite entries within tolerance of it; batch entry 0's gradients are a clean
    run's, bitwise.

    The chunk and parallel forms may also give NaN inside the block that holds the bad value
    (its chunk; the parallel form's block is the sequence), as gated_delta_rule's do: the
    gate's gradient there is a reverse sum of per-row terms, in which those of the rows the
    NaN reaches (which cancel in exact arithmetic) meet the rows before it; and a NaN gate
    makes the block's cumulative gate NaN from its row on, whose differences the later rows'
    factors to the block's end take (dv). Gates of -1 .. 0 per step: a chunk of 16 takes its
    gate's factors whole, one of 64 (and the parallel form's block) by sub-blocks of 16."""
    args, kw = build(5, B=2, T=70, H=1, G=2, K=8, V=6)
    a, k = cast(args, kw, dtype)
    (o0, ht0), pb0 = vjp(a, k, form=form, chunk_size=cs)
    do, dht = (x.astype(dtype) for x in cotangents(6, o0, ht0))
    clean = pb0(do, dht)
    named = dict(zip(ARRAYS, a), initial_state=k["initial_state"])
    bad = named[name].copy()
    index = {"initial_state": (1, 0, 1, 2), "q": (1, 40, 0, 3), "k": (1, 40, 0, 3)}.get(name, (1, 40, 1, 3))
    bad[index[:bad.ndim]] = np.nan
    named[name] = bad
    a = tuple(named[n] for n in ARRAYS)
    k = dict(k, initial_state=named["initial_state"])
    (o, ht), pb = vjp(a, k, form=form, chunk_size=cs)
    with np.errstate(invalid="ignore"):
        ro, rht = oracle(a, k)
        g_ref = adjoint(a, k, do, dht)
    np.testing.assert_array_equal(np.isnan(o), np.isnan(ro))
    np.testing.assert_array_equal(np.isnan(ht), np.isnan(rht))
    assert np.isnan(o[1, 0 if name == "initial_state" else 40]).any()
    ok = ~np.isnan(ro)
    assert np.all(np.isfinite(o[ok]))
    assert_close(o[ok], o0[ok], tol_out(dtype), name="rows it cannot reach")
    np.testing.assert_array_equal(o[0], o0[0])
    grads = pb(do, dht)
    for n, x in grads.items():
        np.testing.assert_array_equal(x[0], clean[n][0], err_msg=f"d{n} of the other sequence")
    may_add = () if form == "recurrent" or name not in ("v", "g", "initial_state") else \
        ("g", "v") if name == "g" else ("g",)
    row = 0 if name == "initial_state" else 40
    block = (0, 70) if form == "parallel" else (row // cs * cs, row // cs * cs + cs)
    check_nan_grads(grads, g_ref, dtype, may_add, block)


@pytest.mark.parametrize("form", FORMS)
def test_nan_cotangent(form):
    """A NaN in do at row 30 of batch entry 1: every form's gradients are NaN exactly where the
    adjoint oracle's are (the rows up to 30, the initial state's), the others within tolerance
    of it, and batch entry 0's are a clean run's, bitwise."""
    args, kw = build(7, B=2, T=50, H=1, G=2, K=8, V=6)
    out, pb = vjp(args, kw, form=form, chunk_size=16)
    do, dht = cotangents(8, *out)
    clean = pb(do, dht)
    bad = do.copy()
    bad[1, 30, 0, 1] = np.nan
    with np.errstate(invalid="ignore"):
        g_ref = adjoint(args, kw, bad, dht)
    grads = pb(bad, dht)
    for n, x in grads.items():
        np.testing.assert_array_equal(x[0], clean[n][0], err_msg=f"d{n}")
    check_nan_grads(grads, g_ref, np.float64)


# ------------------------------------------------------------------------------- bad arguments


def _kda(T=8, H=2, G=2, K=4, V=3, B=1, dtype=np.float64):
    """valid kda arguments q, k, v, g, beta"""
    r = np.random.default_rng(0)
    HV = H * G
    q, k = (r.standard_normal((B, T, H, K)).astype(dtype) for _ in range(2))
    v = r.standard_normal((B, T, HV, V)).astype(dtype)
    g = -r.random((B, T, HV, K)).astype(dtype)
    return [q, k, v, g, r.uniform(0.1, 1, (B, T, HV)).astype(dtype)]


def _with(i, fn, **shape):
    def f():
        a = _kda(**shape)
        a[i] = fn(a[i])
        return a
    return f


def _pullback(args, kw, cot):
    return pyattn.vjp(pyattn.kda, *args, **kw)[1](cot)


F32 = np.float32
# id: (args, kwargs, exception, message parts)
BAD_CASES = {
    "g_scalar_gate": (_with(3, lambda g: g[..., 0]), {}, ValueError, ["'g'", "(1, 8, 4, 4)", "[B, T, HV, K]"]),
    "g_heads_of_q": (_with(3, lambda g: g[:, :, :2]), {}, ValueError, ["'g'", "(1, 8, 4, 4)", "(1, 8, 2, 4)"]),
    "g_channels": (_with(3, lambda g: g[..., :3]), {}, ValueError, ["'g'", "(1, 8, 4, 4)"]),
    "g_dtype": (_with(3, lambda g: g.astype(F32)), {}, TypeError, ["'g'", "float32", "float64"]),
    "g_int": (_with(3, lambda g: g.astype(np.int32)), {}, TypeError, ["'g'", "int32"]),
    "g_None": (_with(3, lambda g: None), {}, TypeError, ["'g'"]),
    "g_positive": (_with(3, lambda g: np.where(np.arange(4) == 2, 0.25, g)), {}, ValueError,
                   ["'g'", "<= 0", "0.25", "(0, 0, 0, 2)"]),
    "g_plus_inf": (_with(3, lambda g: np.where(np.arange(4) == 1, np.inf, g)), {}, ValueError, ["'g'"]),
    "beta_heads_of_q": (_with(4, lambda b: b[:, :, :2]), {}, ValueError, ["'beta'", "(1, 8, 4)", "(1, 8, 2)"]),
    "beta_4d": (_with(4, lambda b: b[..., None]), {}, ValueError, ["'beta'", "[B, T, HV]"]),
    "beta_dtype": (_with(4, lambda b: b.astype(F32)), {}, TypeError, ["'beta'", "float32"]),
    "beta_None": (_with(4, lambda b: None), {}, TypeError, ["'beta'"]),
    "v_heads_not_a_multiple": (_with(2, lambda x: x[:, :, :3]), {}, ValueError,
                               ["'q' has H=2 heads", "v's HV=3", "multiple"]),
    "v_time": (_with(2, lambda x: x[:, :5]), {}, ValueError, ["'v'", "[B, T, HV, V]"]),
    "v_batch": (lambda: _kda(B=2)[:2] + [x[:1] for x in _kda(B=2)[2:]], {}, ValueError, ["'v'"]),
    "v_ndim": (_with(2, lambda x: x[0]), {}, ValueError, ["'v'", "4-D"]),
    "q_ndim": (_with(0, lambda x: x[0]), {}, ValueError, ["'q'", "4-D"]),
    "k_shape": (_with(1, lambda x: x[..., :3]), {}, ValueError, ["'k'"]),
    "k_heads": (_with(1, lambda x: x[:, :, :1]), {}, ValueError, ["'k'"]),
    "dtype_mix_v": (_with(2, lambda x: x.astype(F32)), {}, TypeError, ["'v'", "float32", "float64"]),
    "dtype_float16": (_with(0, lambda x: x.astype(np.float16)), {}, TypeError, ["'q'", "float16"]),
    "head_dim_zero": (lambda: [x[..., :0] for x in _kda()[:2]] + _kda()[2:3] + [_kda()[3][..., :0]] + _kda()[4:],
                      {}, ValueError, ["K=0"]),
    "chunk_size_48": (_kda, {"chunk_size": 48}, ValueError, ["chunk_size", "48"]),
    "chunk_size_256_recurrent": (_kda, {"chunk_size": 256, "form": "recurrent"}, ValueError, ["chunk_size", "256"]),
    "form_flash": (_kda, {"form": "flash"}, ValueError, ["form", "'flash'"]),
    "form_unknown": (_kda, {"form": "wy"}, ValueError, ["form", "'wy'"]),
    "state_shape_heads_of_q": (_kda, {"initial_state": np.zeros((1, 2, 4, 3))}, ValueError,
                               ["'initial_state'", "(1, 4, 4, 3)", "(1, 2, 4, 3)"]),
    "state_transposed": (_kda, {"initial_state": np.zeros((1, 4, 3, 4))}, ValueError,
                         ["'initial_state'", "(1, 4, 4, 3)"]),
    "state_dtype": (_kda, {"initial_state": np.zeros((1, 4, 4, 3), F32)}, TypeError, ["'initial_state'", "float32"]),
    "state_count_cu_seqlens": (_kda, {"cu_seqlens": np.array([0, 4, 8]), "initial_state": np.zeros((1, 4, 4, 3))},
                               ValueError, ["'initial_state'", "(2, 4, 4, 3)"]),
    "cu_seqlens_B2": (lambda: _kda(B=2), {"cu_seqlens": np.array([0, 4, 8])}, ValueError, ["cu_seqlens", "B=2"]),
    "cu_seqlens_end": (_kda, {"cu_seqlens": np.array([0, 4, 7])}, ValueError, ["cu_seqlens", "T=8"]),
    "cu_seqlens_float": (_kda, {"cu_seqlens": np.array([0.0, 8.0])}, TypeError, ["cu_seqlens", "float64"]),
    "scale_string": (_kda, {"scale": "a"}, TypeError, ["'scale'"]),
    "scale_nan": (_kda, {"scale": float("nan")}, ValueError, ["'scale'"]),
    "qk_l2norm_string": (_kda, {"qk_l2norm": "yes"}, TypeError, ["qk_l2norm"]),
    "output_final_state_string": (_kda, {"output_final_state": "yes"}, TypeError, ["output_final_state"]),
}
PULLBACK_CASES = {
    "state_cotangent_without_state": ({}, (np.ones((1, 8, 4, 3)), np.ones((1, 4, 4, 3))), ValueError,
                                      ["output_final_state=False"]),
    "do_shape_heads_of_q": ({"output_final_state": True}, (np.ones((1, 8, 2, 3)), None), ValueError,
                            ["'do'", "(1, 8, 4, 3)"]),
    "dht_shape": ({"output_final_state": True}, (np.ones((1, 8, 4, 3)), np.ones((1, 2, 4, 3))), ValueError,
                  ["(1, 4, 4, 3)"]),
    "do_dtype": ({}, np.ones((1, 8, 4, 3), F32), TypeError, ["'do'", "float32"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_arguments(case):
    make, kw, exc, must = BAD_CASES[case]
    raises(exc, pyattn.kda, *make(), must=must, **kw)
    raises(exc, pyattn.vjp, pyattn.kda, *make(), must=must, **kw)


@pytest.mark.parametrize("case", sorted(PULLBACK_CASES))
def test_bad_pullback_cotangents(case):
    kw, cot, exc, must = PULLBACK_CASES[case]
    raises(exc, _pullback, _kda(), kw, cot, must=must)


def test_core_vector_gate_shapes_checked():
    """_core.delta_backward's dg has g's shape ([B, T, H, K] for a vector gate); a g of any
    other rank is refused under its own name."""
    q, k, v, g, beta = _kda()
    cu = np.array([0, 8], np.int64)
    opts = (cu, _core.FORM_CHUNK, 16, 0.5)
    o = np.zeros(v.shape)
    z = np.zeros_like
    raises(ValueError, _core.delta_forward, q, k, v, g[None], beta, None, o, None, False, *opts, False,
           must=("'g'", "3-D [B, T, H] or 4-D [B, T, H, K]", "5-D"))
    raises(ValueError, _core.delta_backward, q, k, v, g, beta, None, o, None, None, z(q), z(k), z(v),
           z(beta), z(beta), None, *opts, must=("'dg'", "(1, 8, 4, 4)"))
    _core.delta_backward(q, k, v, g, beta, None, o, None, None, z(q), z(k), z(v), z(g), z(beta), None, *opts)

"""Non-finite values in the gated linear engine ops (issue 14: items 1 and 3).

* A NaN (or an inf) in each input of every op, each form, both dtypes, at the first, a middle
  and the last row (seen by every later row, masked from every earlier one): outputs and
  gradients are non-finite exactly where the float64 oracle's are (pyattn.reference for the
  outputs, test_linear.adjoint, the literal reverse loop of the recurrence, for the
  gradients), their finite entries within the float32 and float64 tolerances of it, and what the bad value
  cannot reach (earlier rows, the other batch entry, other sequences of a packing) has the
  same bits as a run without it.
* Full resets (gates of -inf, gamma = 0, slopes = inf, A = -inf) and finite gates too large to
  keep digits (-1e30 per step): every form gives the oracle's values, and finite gradients
  that agree across forms.
* A positive log gate is a ValueError naming the argument and the value; NaN gates pass.
"""
from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn.testing import assert_close

from conftest import raises
from test_linear import (ALL_OPS, DT_IDS, DTYPES, STATEFUL, adjoint, build, call, cast, cotangents,
                         forms_of, oracle, tol_grad, tol_out, vjp)

B, T, H, K, V = 2, 40, 2, 8, 6
CHUNK = 16
ROWS = (0, 21, T - 1)
QUERY_SIDE = {"q", "C"}  # a bad row of these reaches its own output row only
PER_STEP = {"q", "k", "v", "g", "gv", "x", "dt", "B", "C"}
GRAD_OF_QUERY = {"q": "q", "C": "C"}  # the gradient that reads the states forward (dq)
GRAD_OF_KEYS = {"k": ("k", "v"), "B": ("B", "x")}  # those that read dS backward (dk, dv)


def case(op):
    """float64 (args, kw) of op, B = 2 sequences, 3 chunks of 16 rows (the last ragged)."""
    return build(op, 7, B=B, T=T, H=H, K=K, V=V)


def inputs(op, args, kw):
    """{name: array} of every float input the op reads"""
    named = dict(zip(pyattn.OPS[op].arrays, args))
    named.update({n: x for n, x in kw.items() if isinstance(x, np.ndarray)})
    return named


def with_value(op, args, kw, name, index, value):
    """copies of (args, kw) with input name's entry at index set to value"""
    names = pyattn.OPS[op].arrays
    args = tuple(x.copy() if n == name else x for n, x in zip(names, args))
    kw = {n: (x.copy() if n == name else x) for n, x in kw.items()}
    target = args[names.index(name)] if name in names else kw[name]
    target[index] = value
    return args, kw


def bad_index(name, x, r):
    """the entry made non-finite: batch 1, row r, head (or group) 0, channel 1; a per-head
    constant's head 1; the initial state of sequence 1"""
    if name in PER_STEP:
        return (1, r) + (0, 1)[: x.ndim - 2]
    if name == "initial_state":
        return (1, 0, 1, 2)
    return (1,)


def bad_cases(op, values=(np.nan,)):
    out = []
    args, kw = case(op)
    for name, x in inputs(op, args, kw).items():
        for value in values:
            for r in ROWS if name in PER_STEP else (None,):
                for form in forms_of(op):
                    out.append(pytest.param(op, name, r, value, form,
                                            id=f"{op}-{name}-{r}-{value}-{form}"))
    return out


def unseen_rows(op, name, r):
    """[B, T, H] mask of the output rows a bad entry of name (bad_index) cannot reach"""
    m = np.ones((B, T, H), bool)
    if name == "initial_state":
        m[1] = False
    elif name not in PER_STEP:  # a per-head constant of head 1
        m[:, :, 1] = False
    elif op == "efficient_attention" and name not in QUERY_SIDE:
        m[1] = False  # non-causal: a key reaches every query of its sequence
    elif name in QUERY_SIDE:
        m[1, r] = False
    else:
        m[1, r:] = False
    return m


def oracle_grads(op, args, kw, do, dht):
    if op == "efficient_attention":
        return efficient_grads(*args, do)
    return adjoint(op, args, kw, do, dht)


def efficient_grads(q, k, v, do):
    """float64 gradients of efficient attention, literally: softmaxes and their backwards"""
    scale = q.shape[3] ** -0.5
    sk = scale * k
    ek = np.exp(sk - sk.max(axis=1, keepdims=True))
    kc = ek / ek.sum(axis=1, keepdims=True)  # softmax over time
    sq = scale * q
    eq = np.exp(sq - sq.max(axis=3, keepdims=True))
    qs = eq / eq.sum(axis=3, keepdims=True)  # softmax over features
    C = np.einsum("bthk,bthv->bhkv", kc, v)
    dqs = np.einsum("bthv,bhkv->bthk", do, C)
    dq = scale * qs * (dqs - np.sum(qs * dqs, axis=3, keepdims=True))
    dC = np.einsum("bthk,bthv->bhkv", qs, do)
    dkc = np.einsum("bthv,bhkv->bthk", v, dC)
    dk = scale * kc * (dkc - np.sum(kc * dkc, axis=1, keepdims=True))
    return {"q": dq, "k": dk, "v": np.einsum("bthk,bhkv->bthv", kc, dC)}


def gla_forward(q, k, v, g, *, gv=None, scale=None, initial_state=None, output_final_state=False):
    """float64 (o, final state) of gla with the decays applied elementwise: reference.gla's
    products with diagonal matrices turn a NaN of one column (or row) of S into a NaN of
    every one (0 * NaN off the diagonal), which the recurrence itself does not."""
    B_, T_, H_, K_ = q.shape
    scale = K_ ** -0.5 if scale is None else scale
    gv = np.zeros(v.shape) if gv is None else gv
    S = np.zeros((B_, H_, K_, v.shape[3])) if initial_state is None else initial_state.copy()
    o = np.zeros(v.shape)
    for t in range(T_):
        S = np.exp(g[:, t])[..., None] * S * np.exp(gv[:, t])[..., None, :] \
            + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, scale * q[:, t])
    return o, (S if output_final_state else None)


def check_against(actual, expected, tol, what, nan=True):
    """non-finite exactly where expected is (NaN where it is NaN, for a NaN input: an inf
    input may give inf or NaN by the order of the sums), finite entries within tol of it"""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_array_equal(np.isfinite(a), np.isfinite(e), err_msg=f"{what}: finite entries")
    if nan:
        np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=f"{what}: NaN entries")
    ok = np.isfinite(e)
    assert_close(a[ok], e[ok], tol, name=what)


def run(op, args, kw, dtype, form, do, dht):
    a, k = cast(args, kw, dtype)
    out, pb = vjp(op, a, k, form=form, **({} if op == "efficient_attention" else {"chunk_size": CHUNK}))
    grads = pb(do.astype(dtype), None if dht is None else dht.astype(dtype))
    return out, grads


# ------------------------------------------------------------------------------- 1. NaN and inf in


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("op,name,r,value,form",
                         [p for op in ALL_OPS for p in bad_cases(op, (np.nan,))]
                         + [p for op in ("simple_gla", "gla", "mamba2", "efficient_attention")
                            for p in bad_cases(op, (np.inf,)) if p.values[1] in PER_STEP - {"g", "gv", "dt"}])
def test_nonfinite_input(op, name, r, value, form, dtype):
    args, kw = case(op)
    x = inputs(op, args, kw)[name]
    idx = bad_index(name, x, r)
    bad_args, bad_kw = with_value(op, args, kw, name, idx, value)
    with np.errstate(invalid="ignore", over="ignore"):
        o_ref, ht_ref = gla_forward(*bad_args, **bad_kw) if op == "gla" else oracle(op, bad_args, bad_kw)
        do, dht = cotangents(3, o_ref, ht_ref)
        g_ref = oracle_grads(op, bad_args, bad_kw, do, dht)
    nan = np.isnan(value)
    (o, ht), grads = run(op, bad_args, bad_kw, dtype, form, do, dht)
    (o0, ht0), grads0 = run(op, args, kw, dtype, form, do, dht)
    assert not np.isfinite(o).all(), "the bad value vanished from the output"

    check_against(o, o_ref, tol_out(dtype), "o", nan)
    if ht_ref is not None:
        check_against(ht, ht_ref, tol_out(dtype), "final state", nan)
    for n, g in grads.items():
        check_against(g, g_ref[n], tol_grad(dtype), f"d{n}", nan)

    seen = ~unseen_rows(op, name, r)
    np.testing.assert_array_equal(o[~seen], o0[~seen], err_msg="a row that cannot see the bad value changed")
    if name in PER_STEP or name == "initial_state":  # batch entry 0 is another sequence
        for n, g in grads.items():
            if g.ndim >= 2 and g.shape[0] == B:
                np.testing.assert_array_equal(g[0], grads0[n][0], err_msg=f"d{n} of the other sequence")
    if op == "efficient_attention" or name not in PER_STEP:
        return
    if name in QUERY_SIDE:  # dk, dv of later rows read dS from later rows only
        for n in GRAD_OF_KEYS["B" if op == "mamba2" else "k"]:
            np.testing.assert_array_equal(grads[n][1, r + 1:], grads0[n][1, r + 1:], err_msg=f"d{n} after it")
    else:  # dq of earlier rows reads the states of earlier rows only
        n = "C" if op == "mamba2" else "q"
        np.testing.assert_array_equal(grads[n][1, :r], grads0[n][1, :r], err_msg=f"d{n} before it")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("r", ROWS)
@pytest.mark.parametrize("op,form", [(op, f) for op in STATEFUL for f in forms_of(op)])
def test_nonfinite_cotangent(op, form, r, dtype):
    """A NaN in do at row r: the gradients it reaches (those of rows up to r, every
    gradient of a state or a constant) are NaN as the oracle's, the rest as without it."""
    args, kw = case(op)
    o_ref, ht_ref = oracle(op, args, kw)
    do, dht = cotangents(3, o_ref, ht_ref)
    bad = do.copy()
    bad[1, r, 0, 1] = np.nan
    with np.errstate(invalid="ignore"):
        g_ref = oracle_grads(op, args, kw, bad, dht)
    _, grads = run(op, args, kw, dtype, form, bad, dht)
    _, grads0 = run(op, args, kw, dtype, form, do, dht)
    for n, g in grads.items():
        check_against(g, g_ref[n], tol_grad(dtype), f"d{n}")
        if g.ndim >= 2 and g.shape[0] == B:
            np.testing.assert_array_equal(g[0], grads0[n][0], err_msg=f"d{n} of the other sequence")
    for n in GRAD_OF_KEYS["B" if op == "mamba2" else "k"]:
        np.testing.assert_array_equal(grads[n][1, r + 1:], grads0[n][1, r + 1:], err_msg=f"d{n} after it")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("op,form", [(op, f) for op in ALL_OPS for f in forms_of(op)])
def test_nan_stays_in_its_packed_sequence(op, form, dtype):
    """cu_seqlens: NaN in v (x) at the first row of the middle sequence, whose boundaries are
    not chunk boundaries, reaches neither neighbour, forward or backward."""
    cu = np.array([0, 13, 30, 45])
    args, kw = build(op, 11, B=1, T=45, H=H, K=K, V=V, N=3)
    kw["cu_seqlens"] = cu
    name = "x" if op == "mamba2" else "v"
    bad_args, bad_kw = with_value(op, args, kw, name, (0, 13, 0, 1), np.nan)
    o_ref, ht_ref = oracle(op, args, kw)
    do, dht = cotangents(5, o_ref, ht_ref)
    (o, ht), grads = run(op, bad_args, bad_kw, dtype, form, do, dht)
    (o0, ht0), grads0 = run(op, args, kw, dtype, form, do, dht)
    assert np.isnan(o[0, 13:30]).any()
    for s, e in ((0, 13), (30, 45)):
        np.testing.assert_array_equal(o[0, s:e], o0[0, s:e])
        for n, g in grads.items():
            if g.ndim >= 2 and g.shape[1] == 45:
                np.testing.assert_array_equal(g[0, s:e], grads0[n][0, s:e], err_msg=f"d{n}")
    if ht is not None:
        np.testing.assert_array_equal(ht[[0, 2]], ht0[[0, 2]])
        assert np.isnan(ht[1]).any()


def zero_start_case(op):
    """float64 (args, kw, name, index) of a gated op of any engine without initial_state, the
    gate entry made NaN at the first step (head 1): its decay of the zero start state."""
    r = np.random.default_rng(5)
    Bz, Tz, Hz, Kz, Vz = 1, 70, 2, 8, 6  # two chunks of 64, the second ragged

    def rnd(*shape):
        return r.standard_normal(shape)

    q, k, v = rnd(Bz, Tz, Hz, Kz), rnd(Bz, Tz, Hz, Kz), rnd(Bz, Tz, Hz, Vz)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g, gk = -r.random((Bz, Tz, Hz)) / 4, -r.random((Bz, Tz, Hz, Kz)) / 4
    beta = r.uniform(0.1, 1.0, (Bz, Tz, Hz))
    kappa = rnd(Bz, Tz, Hz, Kz)
    kappa /= np.linalg.norm(kappa, axis=-1, keepdims=True)
    cases = {
        "simple_gla": ((q, k, v, g), {}, "g", (0, 0, 1)),
        "gla": ((q, k, v, gk), {}, "g", (0, 0, 1, 2)),
        "retention": ((q, k, v), {"gamma": np.array([0.9, 0.8])}, "gamma", (1,)),
        "mamba2": ((v, rnd(Bz, Tz, Hz), -r.random(Hz), k, q), {}, "dt", (0, 0, 1)),
        "rwkv6": ((q, k, v, gk, rnd(Hz, Kz)), {}, "w", (0, 0, 1, 2)),
        "gated_delta_rule": ((q, k, v, g, beta), {}, "g", (0, 0, 1)),
        "kda": ((q, k, v, gk, beta), {}, "g", (0, 0, 1, 2)),
        "gated_delta_product": ((q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), g,
                                 np.repeat(beta, 2, axis=1)), {"num_householder": 2}, "g", (0, 0, 1)),
        "dplr_delta_rule": ((q, k, v, -kappa, 0.5 * kappa, gk), {}, "gk", (0, 0, 1, 2)),
        "log_linear_attention": ((q, k, v, g, r.random((Bz, Tz, Hz, 8))), {}, "g", (0, 0, 1)),
    }
    return cases[op]


ZERO_START_OPS = ("simple_gla", "gla", "retention", "mamba2", "rwkv6", "gated_delta_rule", "kda",
                  "gated_delta_product", "dplr_delta_rule", "log_linear_attention")


@pytest.mark.parametrize("op,form", [(op, f) for op in ZERO_START_OPS for f in pyattn.OPS[op].forms])
def test_nan_gate_at_a_zero_start(op, form):
    """A NaN gate at the first step of a call without initial_state: the zero state it decays
    becomes NaN (0 e^NaN), so every output row of that head is NaN (RWKV-6's from the second
    on: its first reads the state before the decay), as the oracle's, in every form (the chunk
    forms leave out a zero start's products, but not then); the other head keeps the bits of a
    run without it."""
    args, kw, name, index = zero_start_case(op)
    bad_args, bad_kw = with_value(op, args, kw, name, index, np.nan)
    with np.errstate(invalid="ignore"):
        o_ref = getattr(reference, op)(*bad_args, **bad_kw)[0]
    o = getattr(pyattn, op)(*bad_args, **bad_kw, form=form)[0]
    o0 = getattr(pyattn, op)(*args, **kw, form=form)[0]
    assert np.isnan(o_ref[:, 1:, 1]).all()
    check_against(o, o_ref, tol_out(np.float64), "o")
    np.testing.assert_array_equal(o[:, :, 0], o0[:, :, 0], err_msg="the other head changed")


ZERO_START_CHUNKED = tuple(op for op in ZERO_START_OPS if op != "log_linear_attention")


def _zero_start_runs(op, args, kw, do):
    """(out, grads) of op's chunk form (chunk 16) without initial_state, and with an
    initial_state of zeros, which the kernels multiply rather than leave out"""
    _, ht = getattr(pyattn, op)(*args, **kw, output_final_state=True)
    runs = []
    for h0 in (None, np.zeros_like(ht)):
        extra = {} if h0 is None else {"initial_state": h0}
        with np.errstate(invalid="ignore", over="ignore"):
            out, pullback = pyattn.vjp(getattr(pyattn, op), *args, **kw, **extra, form="chunk",
                                       chunk_size=16)
            grads = pullback((do, None))
        grads.pop("initial_state", None)
        runs.append((out[0], grads))
    return runs


@pytest.mark.parametrize("value", [None, np.nan, np.inf])
@pytest.mark.parametrize("op", ZERO_START_CHUNKED)
def test_left_out_zero_start_products_change_nothing(op, value):
    """The chunk forms leave out the products with a call's zero start state: the output and
    every gradient equal those of the same call given initial_state = zeros (whose products
    run), bit for bit, non-finite entries included: clean, and with a NaN or an inf in each
    per-step input at the first row, or in do at the first or a later row."""
    args, kw, _, _ = zero_start_case(op)
    T = args[0].shape[1]
    do = np.random.default_rng(2).standard_normal(getattr(pyattn, op)(*args, **kw)[0].shape)
    cases = [(None, None)]
    if value is not None:
        named = dict(zip(pyattn.OPS[op].arrays, args))
        cases = [(n, r) for n, x in named.items() if x.ndim >= 3 and x.shape[1] in (T, 2 * T)
                 for r in (0,)] + [("do", 0), ("do", 40)]
        if np.isinf(value):  # an inf gate is a positive one, an error; -inf is a reset
            cases = [(n, r) for n, r in cases if n not in ("g", "gk", "w", "dt")]
    for name, row in cases:
        a, k, d = args, kw, do
        if name == "do":
            d = do.copy()
            d[0, row, 1, 0] = value
        elif name is not None:
            index = (0, row, 1) + (0,) * (args[pyattn.OPS[op].arrays.index(name)].ndim - 3)
            a, k = with_value(op, args, kw, name, index, value)
        (o, grads), (o0, grads0) = _zero_start_runs(op, a, k, d)
        np.testing.assert_array_equal(o, o0, err_msg=f"o ({name} at row {row})")
        for n in grads:
            np.testing.assert_array_equal(grads[n], grads0[n], err_msg=f"d{n} ({name} at row {row})")


@pytest.mark.parametrize("op,name,index", [("simple_gla", "g", (1, 0, 0)), ("gla", "g", (1, 0, 0, 1)),
                                           ("mamba2", "dt", (1, 0, 0)), ("retention", "gamma", (0,))])
@pytest.mark.parametrize("form", ["chunk", "parallel", "recurrent"])
def test_nan_gate_at_a_zero_start_gradients(op, name, index, form):
    """The gradients of that call (the gated linear engine, whose literal adjoint the tests
    have): NaN exactly where the adjoint's are, the finite entries equal to it."""
    args, kw = build(op, 7, B=B, T=T, H=H, K=K, V=V, state=False, final=False)
    bad_args, bad_kw = with_value(op, args, kw, name, index, np.nan)
    with np.errstate(invalid="ignore"):
        o_ref, _ = oracle(op, bad_args, bad_kw)
        do, _ = cotangents(3, o_ref, None)
        g_ref = adjoint(op, bad_args, bad_kw, do, None)
    (o, _), grads = run(op, bad_args, bad_kw, np.float64, form, do, None)
    check_against(o, o_ref, tol_out(np.float64), "o")
    for n, g in grads.items():
        check_against(g, g_ref[n], tol_grad(np.float64), f"d{n}")


# ------------------------------------------------------------------------------- 2. resets, huge gates


def reset_case(op, gate):
    """(args, kw) of op with full resets (gate "reset") or -1e30 steps (gate "huge") at rows
    3, 20..23 and 37 of head 0: inside chunks, at a chunk's first row and at the last ones."""
    args, kw = case(op)
    rows = [3, 20, 21, 22, 23, 37]
    big = -np.inf if gate == "reset" else -1e30
    if op in ("simple_gla", "gla"):
        for r in rows:
            args, kw = with_value(op, args, kw, "g", (slice(None), r, 0), big)
        if op == "gla":
            for r in (5, 30):
                args, kw = with_value(op, args, kw, "gv", (slice(None), r, 1, slice(0, 3)), big)
    elif op == "mamba2":
        args, kw = with_value(op, args, kw, "A", (0,), big)
    elif op == "retention":
        args, kw = with_value(op, args, kw, "gamma", (0,), 0.0 if gate == "reset" else 1e-300)
    else:
        args, kw = with_value(op, args, kw, "slopes", (0,), np.inf if gate == "reset" else 1e30)
    return args, kw


RESET_OPS = ("simple_gla", "gla", "mamba2", "retention", "lightning_attention")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("gate", ["reset", "huge"])
@pytest.mark.parametrize("op,form", [(op, f) for op in RESET_OPS for f in forms_of(op)])
def test_resets_and_huge_gates_match_the_oracle(op, form, gate, dtype):
    args, kw = reset_case(op, gate)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        o_ref, ht_ref = oracle(op, args, kw)
    (o, ht), grads = run(op, args, kw, dtype, form, *cotangents(3, o_ref, ht_ref))
    assert_close(o, o_ref, tol_out(dtype), name="o")
    assert_close(ht, ht_ref, tol_out(dtype), name="final state")
    for n, g in grads.items():
        assert np.isfinite(g).all(), f"d{n} not finite"


@pytest.mark.parametrize("gate", ["reset", "huge"])
@pytest.mark.parametrize("op", RESET_OPS)
def test_reset_gradients_agree_across_forms_and_with_the_adjoint(op, gate):
    """float64: every form's gradients within 1e-10 of the recurrent form's, and of the
    literal adjoint where it is finite (its 0 * -inf of mamba2's dt aside)"""
    args, kw = reset_case(op, gate)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        o_ref, ht_ref = oracle(op, args, kw)
        do, dht = cotangents(3, o_ref, ht_ref)
        g_ref = adjoint(op, args, kw, do, dht)
    base = run(op, args, kw, np.float64, "recurrent", do, dht)[1]
    for n, g in base.items():
        ok = np.isfinite(g_ref[n])
        if n == "gamma" and gate == "reset":  # the adjoint's d/dlog(gamma) / gamma is 0 / 0 there
            assert_close(g[0], gamma_difference(args, kw, do, dht), 1e-8, name="dgamma at 0")
            continue
        if n not in ("dt", "dt_bias"):
            assert ok.all(), f"the adjoint's d{n} is not finite"
        assert_close(g[ok], g_ref[n][ok], 1e-10, name=f"recurrent d{n}")
    for form in ("chunk", "parallel"):
        for n, g in run(op, args, kw, np.float64, form, do, dht)[1].items():
            assert_close(g, base[n], 1e-10, name=f"{form} d{n}")


def gamma_difference(args, kw, do, dht, h=1e-5):
    """central difference of the oracle's <do, o> + <dht, final state> in gamma_0 at 0"""
    def loss(gamma0):
        gamma = kw["gamma"].copy()
        gamma[0] = gamma0
        o, ht = reference.retention(*args, **dict(kw, gamma=gamma))
        return np.sum(do * o) + np.sum(dht * ht)
    return (loss(h) - loss(-h)) / (2 * h)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", ["chunk", "parallel", "recurrent"])
def test_weak_gates_after_huge_ones_keep_their_digits(form, dtype):
    """-1e30 and -700 steps (not a reset in float64) followed by gates of -1e-3 inside one
    chunk: the later rows' relative decays are not absorbed by the cumulative sums"""
    args, kw = build("simple_gla", 9, B=1, T=64, H=2, K=8, V=6)
    g = np.full((1, 64, 2), -1e-3)
    g[0, 2:6, 0] = -1e30
    g[0, 2:6, 1] = -700.0
    args = args[:3] + (g,)
    o_ref, ht_ref = reference.simple_gla(*args, **kw)
    (o, ht), _ = run("simple_gla", args, kw, dtype, form, *cotangents(3, o_ref, ht_ref))
    assert_close(o, o_ref, tol_out(dtype), name="o")
    assert_close(ht, ht_ref, tol_out(dtype), name="final state")


# ------------------------------------------------------------------------------- 3. gate checks


def _small(op):
    args, kw = build(op, 1, B=1, T=5, H=2, K=4, V=3, state=False, final=False)
    return args, kw


@pytest.mark.parametrize("op,name,index", [("simple_gla", "g", (0, 3, 1)), ("gla", "g", (0, 2, 0, 3)),
                                           ("gla", "gv", (0, 4, 1, 2)), ("mamba2", "A", (1,))])
def test_positive_log_gate_is_an_error(op, name, index):
    args, kw = _small(op)
    bad_args, bad_kw = with_value(op, args, kw, name, index, 0.25)
    raises(ValueError, getattr(pyattn, op), *bad_args, **bad_kw, must=(f"'{name}'", "0.25", str(index)))
    raises(ValueError, pyattn.vjp, getattr(pyattn, op), *bad_args, **bad_kw, must=(f"'{name}'", "0.25"))
    nan_args, nan_kw = with_value(op, args, kw, name, index, np.nan)
    o, _ = getattr(pyattn, op)(*nan_args, **nan_kw)
    assert np.isnan(o).any()


@pytest.mark.parametrize("op,name,bad,ok", [("retention", "gamma", [0.5, -0.1], [0.0, 1.0]),
                                            ("retention", "gamma", [1.5, 0.9], [np.nan, 0.9]),
                                            ("lightning_attention", "slopes", [0.5, -1.0], [np.inf, 0.0]),
                                            ("lightning_attention", "slopes", [-np.inf, 1.0], [np.nan, 1.0])])
def test_constant_decay_ranges(op, name, bad, ok):
    args, _ = _small(op)
    raises(ValueError, getattr(pyattn, op), *args, **{name: np.array(bad)}, must=(f"'{name}'",))
    o, _ = getattr(pyattn, op)(*args, **{name: np.array(ok)})
    assert np.isnan(o).any() == bool(np.isnan(ok).any())
    ref, _ = getattr(reference, op)(*args, **{name: np.array(ok)})
    check_against(o, ref, tol_out(np.float64), "o")

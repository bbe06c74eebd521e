"""The delta-rule ops, delta_rule and gated_delta_rule, every form x dtype.

* Forward: against the float64 oracles of pyattn.reference (float64 within 1e-10 relative RMS,
  float32 within 1e-5), outputs and final states, with and without initial states, every chunk
  size, T in {1, 63, 64, 65, 300}, Dk != Dv, with and without qk_l2norm.
* Gradients: central finite differences (pyattn.testing.gradcheck, float64, tiny shapes over
  several chunks), and ``adjoint``: a float64 NumPy reverse loop written here from the matrix
  form of the recurrence (dS_{t-1} = e^g (I - beta k k^T) dS_t, ...; not the u-form the
  kernels use), which checks every form's gradients at T = 300 (float64 1e-10, float32 1e-4).
* beta near 2 (negative eigenvalues), gates from -1e-4 to -20 per step and -inf (a reset),
  gated with g = 0 against delta_rule, a long float32 run, state passing over two calls,
  cu_seqlens against separate calls, thread counts, bad arguments.

Inputs are float32-representable float64 arrays (conftest.f32_exact), so one float64 oracle
serves both dtypes; conftest fills every np.empty with NaN, so an unwritten output shows.
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
OPS = ("delta_rule", "gated_delta_rule")


def make(rng, B=2, T=40, H=2, K=8, V=6, *, gated=True, unit_keys=True, beta=(0.05, 1.0),
         gate=(0.0, 1.0), h0=True):
    """q, k, v, g (None when not gated), beta, h0 (None when not asked), float32-exact float64."""
    q = f32_exact(rng.standard_normal((B, T, H, K)))
    k = rng.standard_normal((B, T, H, K))
    if unit_keys:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    k = f32_exact(k)
    v = f32_exact(rng.standard_normal((B, T, H, V)))
    b = f32_exact(rng.uniform(*beta, (B, T, H)))
    g = f32_exact(-rng.uniform(*gate, (B, T, H))) if gated else None
    s0 = f32_exact(rng.standard_normal((B, H, K, V))) if h0 else None
    return q, k, v, g, b, s0


def call(op, q, k, v, g, b, dtype=np.float64, **kw):
    cast = lambda x: None if x is None else np.asarray(x, dtype)  # noqa: E731
    kw = {n: cast(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    if op == "gated_delta_rule":
        return pyattn.gated_delta_rule(cast(q), cast(k), cast(v), cast(g), cast(b), **kw)
    return pyattn.delta_rule(cast(q), cast(k), cast(v), cast(b), **kw)


def oracle(op, q, k, v, g, b, **kw):
    if op == "gated_delta_rule":
        return reference.gated_delta_rule(q, k, v, g, b, **kw)
    return reference.delta_rule(q, k, v, b, **kw)


def args_of(op, q, k, v, g, b):
    return (q, k, v, g, b) if op == "gated_delta_rule" else (q, k, v, b)


def adjoint(q, k, v, g, b, h0, do, dht, scale):
    """float64 gradients of sum(o * do) + sum(S_T * dht) for one batch of equal sequences,
    from the matrix form S_t = e (I - b k k^T) S_{t-1} + b k v^T (g None: e = 1)."""
    B, T, H, K = q.shape
    V = v.shape[3]
    grads = {n: np.zeros_like(x) for n, x in (("q", q), ("k", k), ("v", v), ("beta", b))}
    grads["g"] = None if g is None else np.zeros_like(g)
    grads["h0"] = np.zeros((B, H, K, V))
    eye = np.eye(K)
    for n in range(B):
        for h in range(H):
            S = [np.zeros((K, V)) if h0 is None else h0[n, h].copy()]
            for t in range(T):
                e = 1.0 if g is None else np.exp(g[n, t, h])
                kt, bt = k[n, t, h], b[n, t, h]
                S.append(e * (eye - bt * np.outer(kt, kt)) @ S[-1] + bt * np.outer(kt, v[n, t, h]))
            dS = np.zeros((K, V)) if dht is None else dht[n, h].copy()
            for t in range(T - 1, -1, -1):
                e = 1.0 if g is None else np.exp(g[n, t, h])
                kt, bt, vt, Sp = k[n, t, h], b[n, t, h], v[n, t, h], S[t]
                grads["q"][n, t, h] = scale * S[t + 1] @ do[n, t, h]
                dS = dS + scale * np.outer(q[n, t, h], do[n, t, h])
                grads["k"][n, t, h] = (bt * dS @ vt - e * bt * (dS @ Sp.T @ kt + Sp @ dS.T @ kt))
                grads["v"][n, t, h] = bt * dS.T @ kt
                grads["beta"][n, t, h] = kt @ dS @ vt - e * kt @ dS @ Sp.T @ kt
                if g is not None:
                    grads["g"][n, t, h] = e * np.sum(dS * ((eye - bt * np.outer(kt, kt)) @ Sp))
                dS = e * (eye - bt * np.outer(kt, kt)) @ dS
            grads["h0"][n, h] = dS
    return grads


def tol(dtype):
    return TOLERANCES[np.dtype(dtype)]


# ---- forward against the oracle --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
def test_forward_against_oracle(rng, op, form, dtype, T):
    q, k, v, g, b, s0 = make(rng, T=T, K=8, V=6, gated=op == "gated_delta_rule")
    o, ht = call(op, q, k, v, g, b, dtype, initial_state=s0, output_final_state=True, form=form)
    ro, rh = oracle(op, q, k, v, g, b, initial_state=s0, output_final_state=True)
    assert o.dtype == dtype and ht.dtype == dtype
    assert_close(o, ro, tol(dtype)[0], name="o")
    assert_close(ht, rh, tol(dtype)[0], name="final state")


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
@pytest.mark.parametrize("T", [63, 65, 300])
@pytest.mark.parametrize("op", OPS)
def test_chunk_sizes(rng, op, chunk_size, T):
    q, k, v, g, b, _ = make(rng, B=1, T=T, gated=op == "gated_delta_rule", h0=False)
    o, ht = call(op, q, k, v, g, b, form="chunk", chunk_size=chunk_size, output_final_state=True)
    ro, rh = oracle(op, q, k, v, g, b, output_final_state=True)
    assert_close(o, ro, 1e-10)
    assert_close(ht, rh, 1e-10)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op", OPS)
def test_qk_l2norm_and_head_dims(rng, op, form):
    q, k, v, g, b, s0 = make(rng, T=50, K=12, V=5, unit_keys=False, gated=op == "gated_delta_rule")
    q, k = 3 * q, 3 * k  # the op normalises them
    o, ht = call(op, q, k, v, g, b, qk_l2norm=True, initial_state=s0, output_final_state=True,
                 form=form, chunk_size=16)
    ro, rh = oracle(op, q, k, v, g, b, qk_l2norm=True, initial_state=s0, output_final_state=True)
    assert_close(o, ro, 1e-10)
    assert_close(ht, rh, 1e-10)


@pytest.mark.parametrize("form", FORMS)
def test_scale(rng, form):
    q, k, v, g, b, _ = make(rng, T=30)
    o, _ = call("gated_delta_rule", q, k, v, g, b, scale=0.37, form=form, chunk_size=16)
    ro, _ = oracle("gated_delta_rule", q, k, v, g, b, scale=0.37)
    assert_close(o, ro, 1e-10)


# ---- gradients -------------------------------------------------------------------------------


@pytest.mark.parametrize("qk_l2norm", [False, True], ids=["raw", "l2norm"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op", OPS)
def test_finite_differences(rng, op, form, qk_l2norm):
    q, k, v, g, b, s0 = make(rng, B=1, T=35, H=2, K=3, V=2, gated=op == "gated_delta_rule")
    gradcheck(op, args_of(op, q, k, v, g, b),
              dict(qk_l2norm=qk_l2norm, initial_state=s0, output_final_state=True, form=form,
                   chunk_size=16))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op", OPS)
def test_gradients_against_adjoint(rng, op, form, dtype):
    gated = op == "gated_delta_rule"
    q, k, v, g, b, s0 = make(rng, B=2, T=300, H=2, K=8, V=6, gated=gated)
    do = f32_exact(rng.standard_normal(v.shape))
    dht = f32_exact(rng.standard_normal(s0.shape))
    cast = lambda x: None if x is None else x.astype(dtype)  # noqa: E731
    _, pb = pyattn.vjp(getattr(pyattn, op), *(cast(x) for x in args_of(op, q, k, v, g, b)),
                       initial_state=cast(s0), output_final_state=True, form=form)
    got = pb((cast(do), cast(dht)))
    want = adjoint(q, k, v, g, b, s0, do, dht, 8 ** -0.5)
    for name, ref in want.items():
        if ref is None:
            continue
        key = "initial_state" if name == "h0" else name
        assert got[key].dtype == dtype
        assert_close(got[key], ref, tol(dtype)[1], name=f"d{key}")


@pytest.mark.parametrize("op", OPS)
def test_forms_agree(rng, op):
    q, k, v, g, b, s0 = make(rng, B=2, T=150, gated=op == "gated_delta_rule")
    check_forms(op, args_of(op, q, k, v, g, b),
                dict(qk_l2norm=True, initial_state=s0, output_final_state=True))


# ---- beta, gates --------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op", OPS)
def test_beta_near_two(rng, op, form):
    """beta in (1.9, 2): I - beta k k^T has the eigenvalue 1 - beta < 0 (DeltaProduct, RWKV-7)."""
    q, k, v, g, b, s0 = make(rng, T=120, beta=(1.9, 1.999), gated=op == "gated_delta_rule")
    o, ht = call(op, q, k, v, g, b, initial_state=s0, output_final_state=True, form=form)
    ro, rh = oracle(op, q, k, v, g, b, initial_state=s0, output_final_state=True)
    assert_close(o, ro, 1e-10)
    assert_close(ht, rh, 1e-10)
    do = f32_exact(rng.standard_normal(v.shape))
    _, pb = pyattn.vjp(getattr(pyattn, op), *args_of(op, q, k, v, g, b), initial_state=s0,
                       form=form)
    got = pb(do)
    want = adjoint(q, k, v, g, b, s0, do, None, 8 ** -0.5)
    for name in ("q", "k", "v", "beta"):
        assert_close(got[name], want[name], 1e-10, name=f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("gate", [(0.0, 1e-4), (19.0, 20.0), (0.0, 20.0)], ids=["weak", "strong", "mixed"])
def test_gate_strength(rng, form, dtype, gate):
    q, k, v, g, b, s0 = make(rng, T=130, gate=gate)
    cast = lambda x: x.astype(dtype)  # noqa: E731
    (o, ht), pb = pyattn.vjp(pyattn.gated_delta_rule, cast(q), cast(k), cast(v), cast(g), cast(b),
                             initial_state=cast(s0), output_final_state=True, form=form)
    ro, rh = oracle("gated_delta_rule", q, k, v, g, b, initial_state=s0, output_final_state=True)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(ht))
    assert_close(o, ro, tol(dtype)[0], name="o")
    assert_close(ht, rh, tol(dtype)[0], atol=1e-30, name="final state")
    do = f32_exact(rng.standard_normal(v.shape))
    dht = f32_exact(rng.standard_normal(s0.shape))
    got = pb((cast(do), cast(dht)))
    want = adjoint(q, k, v, g, b, s0, do, dht, 8 ** -0.5)
    for name, ref in want.items():
        key = "initial_state" if name == "h0" else name
        assert np.all(np.isfinite(got[key])), key
        assert_close(got[key], ref, tol(dtype)[1], atol=1e-30, name=f"d{key}")


@pytest.mark.parametrize("form", FORMS)
def test_reset_gate(rng, form):
    """g = -inf is a full reset: every form equals the oracle (finite), and the rows after the
    reset do not depend on what came before it."""
    q, k, v, g, b, s0 = make(rng, T=90)
    g[:, 37] = -np.inf
    o, ht = call("gated_delta_rule", q, k, v, g, b, initial_state=s0, output_final_state=True,
                 form=form, chunk_size=32)
    ro, rh = oracle("gated_delta_rule", q, k, v, g, b, initial_state=s0, output_final_state=True)
    assert np.all(np.isfinite(o))
    assert_close(o, ro, 1e-10)
    assert_close(ht, rh, 1e-10)
    o2, _ = call("gated_delta_rule", q, k, 5 * v, g, b, form=form, chunk_size=32)
    o1, _ = call("gated_delta_rule", q, k, v, g, b, form=form, chunk_size=32)
    v2 = v.copy()
    v2[:, :37] *= 5
    o3, _ = call("gated_delta_rule", q, k, v2, g, b, form=form, chunk_size=32)
    np.testing.assert_allclose(o3[:, 37:], o1[:, 37:], rtol=1e-12, atol=1e-12)
    assert not np.allclose(o2[:, 37:], o1[:, 37:])
    _, pb = pyattn.vjp(pyattn.gated_delta_rule, q, k, v, g, b, initial_state=s0, form=form)
    grads = pb(np.ones_like(v))
    assert all(np.all(np.isfinite(x)) for x in grads.values())
    assert np.all(grads["g"][:, 37] == 0)


@pytest.mark.parametrize("form", FORMS)
def test_gated_with_zero_gate_is_delta_rule(rng, form):
    q, k, v, _, b, s0 = make(rng, T=100, gated=False)
    g = np.zeros(b.shape)
    kw = dict(initial_state=s0, output_final_state=True, form=form, qk_l2norm=True)
    (o1, h1), pb1 = pyattn.vjp(pyattn.gated_delta_rule, q, k, v, g, b, **kw)
    (o2, h2), pb2 = pyattn.vjp(pyattn.delta_rule, q, k, v, b, **kw)
    assert_close(o1, o2, 1e-13)
    assert_close(h1, h2, 1e-13)
    do = rng.standard_normal(o1.shape)
    g1, g2 = pb1(do), pb2(do)
    for name in g2:
        assert_close(g1[name], g2[name], 1e-13, name=name)


def test_positive_gate_rejected(rng):
    q, k, v, g, b, _ = make(rng, T=5)
    g[0, 2, 1] = 0.5
    raises(ValueError, pyattn.gated_delta_rule, q, k, v, g, b, must=("'g'",))


# ---- long runs, state passing, varlen, threads ---------------------------------------------------


def test_long_run_float32(rng):
    """T = 16384, unit-norm keys: chunk and recurrent agree and the state stays bounded."""
    T, K, V = 16384, 32, 32
    q, k, v, g, b, _ = make(rng, B=1, T=T, H=1, K=K, V=V, unit_keys=False, gate=(0.0, 0.05),
                            h0=False)
    args = tuple(x.astype(np.float32) for x in (q, k, v, g, b))
    oc, hc = pyattn.gated_delta_rule(*args, qk_l2norm=True, output_final_state=True)
    orr, hr = pyattn.gated_delta_rule(*args, qk_l2norm=True, output_final_state=True,
                                      form="recurrent")
    assert_close(oc, orr, 1e-4)
    assert_close(hc, hr, 1e-4)
    assert np.linalg.norm(hc) < 10 * np.sqrt(V) * np.abs(v).max()
    o64, _ = pyattn.gated_delta_rule(q, k, v, g, b, qk_l2norm=True, form="recurrent")
    assert_close(oc, o64, 1e-4)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op", OPS)
def test_two_calls_equal_one(rng, op, form):
    q, k, v, g, b, s0 = make(rng, T=100, gated=op == "gated_delta_rule")
    f = getattr(pyattn, op)
    split = lambda x, sl: None if x is None else np.ascontiguousarray(x[:, sl])  # noqa: E731
    first, second = slice(0, 37), slice(37, 100)
    (o, ht), pb = pyattn.vjp(f, *args_of(op, q, k, v, g, b), initial_state=s0,
                             output_final_state=True, form=form)
    (oa, ha), pba = pyattn.vjp(f, *args_of(op, *(split(x, first) for x in (q, k, v, g, b))),
                               initial_state=s0, output_final_state=True, form=form)
    (ob, hb), pbb = pyattn.vjp(f, *args_of(op, *(split(x, second) for x in (q, k, v, g, b))),
                               initial_state=ha, output_final_state=True, form=form)
    assert_close(np.concatenate([oa, ob], 1), o, 1e-12)
    assert_close(hb, ht, 1e-12)
    do, dht = rng.standard_normal(o.shape), rng.standard_normal(ht.shape)
    whole = pb((do, dht))
    gb = pbb((split(do, second), dht))
    ga = pba((split(do, first), gb["initial_state"]))
    for name in whole:
        if name == "initial_state":
            assert_close(ga[name], whole[name], 1e-12, name=name)
        else:
            assert_close(np.concatenate([ga[name], gb[name]], 1), whole[name], 1e-12, name=name)


@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op", OPS)
def test_cu_seqlens_equal_separate_calls(rng, op, form, cu_dtype):
    lens = [17, 0, 70, 1, 33]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(cu_dtype)
    T = int(cu[-1])
    q, k, v, g, b, _ = make(rng, B=1, T=T, gated=op == "gated_delta_rule", h0=False)
    s0 = f32_exact(rng.standard_normal((len(lens), 2, 8, 6)))
    f = getattr(pyattn, op)
    (o, ht), pb = pyattn.vjp(f, *args_of(op, q, k, v, g, b), initial_state=s0,
                             output_final_state=True, cu_seqlens=cu, form=form, chunk_size=16)
    do = rng.standard_normal(o.shape)
    grads = pb(do)
    for n in range(len(lens)):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        part = lambda x: None if x is None else np.ascontiguousarray(x[:, sl])  # noqa: E731
        (on, hn), pbn = pyattn.vjp(f, *args_of(op, *(part(x) for x in (q, k, v, g, b))),
                                   initial_state=s0[n:n + 1], output_final_state=True, form=form,
                                   chunk_size=16)
        assert_close(o[:, sl], on, 1e-12)
        assert_close(ht[n:n + 1], hn, 1e-12)
        gn = pbn(np.ascontiguousarray(do[:, sl]))
        for name, x in gn.items():
            whole = grads[name][n:n + 1] if name == "initial_state" else grads[name][:, sl]
            assert_close(whole, x, 1e-12, name=name)


@pytest.mark.parametrize("form", FORMS)
def test_thread_counts_give_the_same_bits(rng, form):
    q, k, v, g, b, s0 = make(rng, B=3, T=200, H=3)
    results = []
    for n in (1, 2, 4):
        with pyattn.num_threads(n):
            (o, ht), pb = pyattn.vjp(pyattn.gated_delta_rule, q, k, v, g, b, initial_state=s0,
                                     output_final_state=True, form=form)
            results.append((o, ht, pb(np.ones_like(o))))
    for o, ht, gr in results[1:]:
        assert np.array_equal(o, results[0][0]) and np.array_equal(ht, results[0][1])
        for name in gr:
            assert np.array_equal(gr[name], results[0][2][name]), name


# ---- bad input -----------------------------------------------------------------------------------


def test_bad_arguments(rng):
    q, k, v, g, b, s0 = make(rng, T=10)
    f = pyattn.gated_delta_rule
    raises(ValueError, f, q, k, v, g, b[:, :5], must=("'beta'",))
    raises(ValueError, f, q, k, v, g[..., None], b, must=("'g'",))
    raises(TypeError, f, q, k, v, g, b.astype(np.float32), must=("beta",))
    raises(TypeError, f, q, k, v, g.astype(np.float32), b, must=("'g'",))
    raises(ValueError, f, q, k, v, g, b, chunk_size=48, must=("chunk_size",))
    raises(ValueError, f, q, k, v, g, b, form="flash", must=("form",))
    raises(ValueError, f, q, k, v, g, b, initial_state=s0[:, :, :3], must=("initial_state",))
    raises(ValueError, pyattn.delta_rule, q, k[..., :4], v, b, must=("'k'",))
    raises(TypeError, pyattn.delta_rule, q, k, v, b, qk_l2norm="yes", must=("qk_l2norm",))


def test_core_checks_buffers(rng):
    """_core's entry points check every buffer: wrong sizes raise, never crash."""
    from pyattn import _core

    q, k, v, g, b, s0 = make(rng, T=10)
    cu = np.array([0, 10, 20], np.int64)
    o = np.empty_like(v)
    with pytest.raises(ValueError, match="beta"):
        _core.delta_forward(q, k, v, g, b[:, :9], s0, o, None, False, cu, _core.FORM_CHUNK, 64, 0.3)
    with pytest.raises(ValueError, match="'o'"):
        _core.delta_forward(q, k, v, g, b, s0, o[:, :9], None, False, cu, _core.FORM_CHUNK, 64, 0.3)
    with pytest.raises(ValueError, match="'g'"):
        _core.delta_forward(q, k, v, g[..., None], b, s0, o, None, False, cu, _core.FORM_CHUNK,
                            64, 0.3)
    with pytest.raises(ValueError, match="dg"):
        _core.delta_backward(q, k, v, g, b, s0, o, None, None, np.empty_like(q), np.empty_like(k),
                             np.empty_like(v), None, np.empty_like(b), None, cu,
                             _core.FORM_CHUNK, 64, 0.3)
    with pytest.raises(ValueError, match="states"):
        _core.delta_backward(q, k, v, g, b, s0, o, None, np.zeros((3, 8, 6)), np.empty_like(q),
                             np.empty_like(k), np.empty_like(v), np.empty_like(g),
                             np.empty_like(b), None, cu, _core.FORM_CHUNK, 64, 0.3)

"""The gated linear engine ops: linear_attention, retention, lightning_attention, simple_gla,
gla, mamba2 and efficient_attention, every form x dtype (docs/ops.md).

* Forward: against the float64 oracles of pyattn.reference (float64 within 1e-10 relative RMS,
  float32 within 1e-5), outputs and final states, with and without initial states, every
  chunk size and T not a multiple of it.
* Gradients: central finite differences (pyattn.testing.gradcheck, float64, tiny shapes; T = 35
  with chunk_size 16 for several chunks) of every differentiable input; performer's projection
  by our own central differences (gradcheck cannot reach into feature_map_params); the forms
  against each other (pyattn.testing.check_forms) at T = 300; and ``adjoint``, a float64 NumPy
  reverse loop of the engine's recurrence written here (dS_{t-1} = diag(e^gk) dS_t diag(e^gv)
  + ..., dgk_t = rowsum(dS_t * diag(e^gk) S_{t-1} diag(e^gv))), with mamba2's chain rule,
  which checks every form's gradients at T = 300 (float64 1e-10, float32 1e-4).
* cu_seqlens equal separate calls, state passing over two halves equals one call (gradients
  through the carried state included), weak and strong gates, the relations between the ops,
  bad arguments, and the thread count (the chunk-parallel schedule).

Inputs are float32-representable float64 arrays (conftest.f32_exact), so one float64 oracle
serves both dtypes. conftest fills every np.empty/np.empty_like with NaN for the whole session,
so an output or gradient the kernels forget to write shows up here as NaN.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn.testing import TOLERANCES, assert_close, check_forms, gradcheck

from conftest import f32_exact, raises

DTYPES = (np.float64, np.float32)
DT_IDS = ["f64", "f32"]
FORMS = ("chunk", "parallel", "recurrent")
CHUNK_SIZES = (16, 32, 64, 128)
STATEFUL = ("linear_attention", "retention", "lightning_attention", "simple_gla", "gla", "mamba2")
ALL_OPS = STATEFUL + ("efficient_attention",)

# the arguments that map onto the time axis (sliced per sequence), per op
TIME_ARRAYS = {"x", "dt", "B", "C", "q", "k", "v", "g", "gv"}
# per-head constants: with cu_seqlens their gradient is the sum over the sequences'
PER_HEAD = {"gamma", "slopes", "A", "D", "dt_bias"}


def tol_out(dtype):
    return TOLERANCES[np.dtype(dtype)][0]


def tol_grad(dtype):
    return TOLERANCES[np.dtype(dtype)][1]


def forms_of(op):
    return pyattn.OPS[op].forms


def form_opts(op, form, chunk_size=None):
    if op == "efficient_attention":
        return {"form": form}
    return {"form": form} if chunk_size is None else {"form": form, "chunk_size": chunk_size}


# ------------------------------------------------------------------------------- inputs


def build(op, seed, B=1, T=20, H=2, K=8, V=6, *, N=None, state=True, final=True, gates="normal",
          **opt):
    """(args, kwargs) of op in float64, float32-representable. ``gates``: "normal", "weak"
    (g in (-1e-4, 0]), "strong" (g in [-20, -19]); for mamba2 the same through dt * A.
    Options: linear_attention ``feature_map``, ``params``, ``normalize``, ``m`` (performer
    features); retention/lightning ``const=False`` (the default decays); gla ``gv=False``;
    mamba2 ``G``, ``D=False``, ``dt_bias=False``, ``softplus=False``; efficient ``Tk``."""
    r = np.random.default_rng(seed)

    def rnd(*shape):
        return f32_exact(r.standard_normal(shape))

    def gate(shape, scale=1.0):
        if gates == "weak":
            return f32_exact(-1e-4 * r.random(shape))
        if gates == "strong":
            return f32_exact(-20.0 + r.random(shape))
        return f32_exact(-scale * r.random(shape))

    N = B if N is None else N
    kw = {}
    if op == "efficient_attention":
        Tk = opt.get("Tk", T)
        return (rnd(B, T, H, K), rnd(B, Tk, H, K), rnd(B, Tk, H, V)), kw
    if op == "mamba2":
        G = opt.get("G", 1)
        x = rnd(B, T, H, V)
        if gates == "strong":  # dt * A in about [-21, -16] per step
            dt = f32_exact(r.uniform(1.0, 1.3, (B, T, H)))
            A = -f32_exact(r.uniform(15.5, 16.0, H))
        elif gates == "weak":  # softplus(dt) ~ 0.05, |A| <= 1e-3
            dt = f32_exact(-3.0 + 0.1 * r.standard_normal((B, T, H)))
            A = -f32_exact(r.uniform(1e-4, 1e-3, H))
        else:
            dt = rnd(B, T, H)
            A = -f32_exact(r.uniform(0.5, 2.0, H))
        if not opt.get("softplus", True) or gates == "strong":
            kw["dt_softplus"] = False
            if gates != "strong":
                dt = np.abs(dt)
        args = (x, dt, A, rnd(B, T, G, K), rnd(B, T, G, K))
        if opt.get("D", True):
            kw["D"] = rnd(H)
        if opt.get("dt_bias", True) and kw.get("dt_softplus", True):
            kw["dt_bias"] = f32_exact(0.5 * r.standard_normal(H))
        F, cols, nonneg = K, V, False
    else:
        q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
        F, cols, nonneg = K, V, False
        if op == "linear_attention":
            fm = opt.get("feature_map")
            params = dict(opt.get("params") or {})
            if fm is not None:
                kw["feature_map"] = fm
            if fm == "performer":
                q, k = f32_exact(q * K ** -0.25), f32_exact(k * K ** -0.25)
                params = {"projection": rnd(opt.get("m", 6), K)}
            if params:
                kw["feature_map_params"] = params
            F = reference.feature_map(np.zeros((1, 1, 1, K)), fm or "identity", **params).shape[-1]
            if opt.get("normalize"):
                kw["normalize"] = True
                cols, nonneg = V + 1, True
                if fm in (None, "identity"):  # a positive normaliser
                    q, k = f32_exact(np.abs(q) + 0.1), f32_exact(np.abs(k) + 0.1)
            args = (q, k, v)
        elif op == "retention":
            args = (q, k, v)
            if opt.get("const", True):
                kw["gamma"] = f32_exact(r.uniform(0.6, 0.99, H))
        elif op == "lightning_attention":
            args = (q, k, v)
            if opt.get("const", True):
                kw["slopes"] = f32_exact(r.uniform(0.01, 1.0, H))
        elif op == "simple_gla":
            args = (q, k, v, gate((B, T, H)))
        elif op == "gla":
            args = (q, k, v, gate((B, T, H, K)))
            if opt.get("gv", True):
                kw["gv"] = gate((B, T, H, V), 0.5)
        else:
            raise ValueError(op)
    if state:
        h0 = rnd(N, H, F, cols)
        kw["initial_state"] = f32_exact(np.abs(h0)) if nonneg else h0
    if final:
        kw["output_final_state"] = True
    return args, kw


def cast(args, kw, dtype):
    def c(x):
        if isinstance(x, np.ndarray) and x.dtype.kind == "f":
            return x.astype(dtype)
        if isinstance(x, dict):
            return {name: c(val) for name, val in x.items()}
        return x

    return tuple(c(a) for a in args), {name: c(val) for name, val in kw.items()}


def call(op, args, kw, **opts):
    """(o, final_state or None) for every op (efficient_attention has no state)."""
    out = getattr(pyattn, op)(*args, **kw, **opts)
    return (out, None) if op == "efficient_attention" else out


def vjp(op, args, kw, **opts):
    """((o, final_state), pullback(do, dht=None))"""
    out, pb = pyattn.vjp(getattr(pyattn, op), *args, **kw, **opts)
    if op == "efficient_attention":
        return (out, None), lambda do, dht=None: pb(do)
    return out, lambda do, dht=None: pb((do, dht))


def oracle(op, args, kw):
    """(o, final_state or None) of pyattn.reference; efficient_attention with cu_seqlens as
    the oracle run on every sequence."""
    if op != "efficient_attention":
        return getattr(reference, op)(*args, **kw)
    kw = dict(kw)
    cu = kw.pop("cu_seqlens", None)
    if cu is None:
        return reference.efficient_attention(*args, **kw), None
    q, k, v = args
    o = np.zeros(q.shape[:3] + (v.shape[3],))
    for s, e in zip(cu[:-1], cu[1:]):
        if e > s:
            o[:, s:e] = reference.efficient_attention(q[:, s:e], k[:, s:e], v[:, s:e], **kw)
    return o, None


def cotangents(seed, o, ht):
    r = np.random.default_rng(seed)
    do = f32_exact(r.standard_normal(o.shape))
    dht = None if ht is None else f32_exact(r.standard_normal(ht.shape))
    return do, dht


def check_out(out, ref, dtype, what=""):
    o, ht = out
    o_ref, ht_ref = ref
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert np.all(np.isfinite(o))
    assert_close(o, o_ref, tol_out(dtype), name=f"{what} o")
    if ht_ref is None:
        assert ht is None
    else:
        assert ht.dtype == dtype and ht.shape == ht_ref.shape
        assert_close(ht, ht_ref, tol_out(dtype), name=f"{what} final state")


# ------------------------------------------------------------------------------- adjoint oracle


def engine_adjoint(q, k, v, gk, gv, scale, h0, do, dht):
    """Reverse-mode derivative of the engine's recurrence, literally, in float64, one
    (batch, head) at a time: states stored forward, dS carried backward.
    q, k [B,T,H,K]; v, do [B,T,H,V]; gk [B,T,H,K] or None; gv [B,T,H,V] or None; h0, dht
    [B,H,K,V] or None. Returns {q, k, v, gk, gv, h0}."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    B, T, H, K = q.shape
    V = v.shape[3]
    gk = np.zeros((B, T, H, K)) if gk is None else np.asarray(gk, np.float64)
    gv = np.zeros((B, T, H, V)) if gv is None else np.asarray(gv, np.float64)
    h0 = np.zeros((B, H, K, V)) if h0 is None else np.asarray(h0, np.float64)
    dht = np.zeros((B, H, K, V)) if dht is None else np.asarray(dht, np.float64)
    g = {"q": np.zeros_like(q), "k": np.zeros_like(k), "v": np.zeros_like(v),
         "gk": np.zeros_like(gk), "gv": np.zeros_like(gv), "h0": np.zeros_like(h0)}
    for b in range(B):
        for h in range(H):
            ak, av = np.exp(gk[b, :, h]), np.exp(gv[b, :, h])
            S = [h0[b, h]]
            for t in range(T):
                S.append(ak[t][:, None] * S[-1] * av[t][None, :] + np.outer(k[b, t, h], v[b, t, h]))
            dS = dht[b, h].copy()
            for t in reversed(range(T)):
                dS = dS + scale * np.outer(q[b, t, h], do[b, t, h])
                g["q"][b, t, h] = scale * S[t + 1] @ do[b, t, h]
                g["k"][b, t, h] = dS @ v[b, t, h]
                g["v"][b, t, h] = dS.T @ k[b, t, h]
                P = dS * (ak[t][:, None] * S[t] * av[t][None, :])
                g["gk"][b, t, h], g["gv"][b, t, h] = P.sum(axis=1), P.sum(axis=0)
                dS = ak[t][:, None] * dS * av[t][None, :]
            g["h0"][b, h] = dS
    return g


def _softplus(x):
    return np.logaddexp(0.0, x)


def adjoint(op, args, kw, do, dht):
    """float64 gradients of op (every argument the vjp differentiates) from engine_adjoint and
    the chain rule of each op's mapping onto the engine, written from docs/ops.md. Not for
    linear_attention with a feature map other than identity, nor cu_seqlens."""
    f = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
    h0 = f(kw.get("initial_state"))
    if op == "mamba2":
        x, dt, A, Bm, Cm = (f(a) for a in args)
        D, bias = f(kw.get("D")), f(kw.get("dt_bias"))
        Bsz, T, H, P = x.shape
        G = Bm.shape[2]
        rep = H // G
        pre = dt + (bias if bias is not None else 0.0)
        sp = kw.get("dt_softplus", True)
        dts = _softplus(pre) if sp else pre
        e = engine_adjoint(np.repeat(Cm, rep, axis=2), np.repeat(Bm, rep, axis=2), x * dts[..., None],
                           np.repeat((A * dts)[..., None], Bm.shape[3], axis=3), None, 1.0, h0, do, dht)
        dg = e["gk"].sum(axis=3)
        ddts = np.einsum("bthp,bthp->bth", e["v"], x) + dg * A
        dpre = ddts / (1.0 + np.exp(-pre)) if sp else ddts
        g = {"x": e["v"] * dts[..., None] + (0 if D is None else D[:, None] * do), "dt": dpre,
             "A": np.einsum("bth,bth->h", dg, dts), "B": e["k"].reshape(Bsz, T, G, rep, -1).sum(axis=3),
             "C": e["q"].reshape(Bsz, T, G, rep, -1).sum(axis=3)}
        if D is not None:
            g["D"] = np.einsum("bthp,bthp->h", do, x)
        if bias is not None:
            g["dt_bias"] = dpre.sum(axis=(0, 1))
    elif op == "linear_attention":
        assert kw.get("feature_map") in (None, "identity") and not kw.get("normalize")
        q, k, v = (f(a) for a in args)
        e = engine_adjoint(q, k, v, None, None, kw.get("scale", q.shape[3] ** -0.5), h0, do, dht)
        g = {"q": e["q"], "k": e["k"], "v": e["v"]}
    else:
        q, k, v = (f(a) for a in args[:3])
        B, T, H, K = q.shape
        scale = kw.get("scale", K ** -0.5)
        if op == "retention":
            gamma = f(kw.get("gamma"))
            logd = np.log(1.0 - 2.0 ** (-5.0 - np.arange(H)) if gamma is None else gamma)
            gk = np.broadcast_to(logd[None, None, :, None], (B, T, H, K))
        elif op == "lightning_attention":
            slopes = f(kw.get("slopes"))
            s = 2.0 ** (-8.0 * (np.arange(H) + 1) / H) if slopes is None else slopes
            gk = np.broadcast_to(-s[None, None, :, None], (B, T, H, K))
        elif op == "simple_gla":
            gk = np.repeat(f(args[3])[..., None], K, axis=3)
        else:
            gk = f(args[3])
        gv = f(kw.get("gv")) if op == "gla" else None
        e = engine_adjoint(q, k, v, gk, gv, scale, h0, do, dht)
        g = {"q": e["q"], "k": e["k"], "v": e["v"]}
        if op == "simple_gla":
            g["g"] = e["gk"].sum(axis=3)
        elif op == "gla":
            g["g"] = e["gk"]
            if gv is not None:
                g["gv"] = e["gv"]
        elif op == "retention" and kw.get("gamma") is not None:
            g["gamma"] = e["gk"].sum(axis=(0, 1, 3)) / f(kw["gamma"])
        elif op == "lightning_attention" and kw.get("slopes") is not None:
            g["slopes"] = -e["gk"].sum(axis=(0, 1, 3))
    if h0 is not None:
        g["initial_state"] = e["h0"]
    return g


# ------------------------------------------------------------------------------- cached cases

# name: (builder kwargs); every op is run on every case that makes sense for it
SHAPES = {
    "B2_T65_state": dict(B=2, T=65, H=2, K=8, V=6),
    "B1_T1_state": dict(B=1, T=1, H=2, K=5, V=3),
    "B2_T130_zero_state": dict(B=2, T=130, H=3, K=16, V=12, state=False),
    "B1_T64_no_final": dict(B=1, T=64, H=2, K=7, V=9, final=False),
}


@functools.lru_cache(maxsize=None)
def shape_case(op, name):
    spec = dict(SHAPES[name])
    if op == "efficient_attention":  # no state; Tk != Tq
        spec["Tk"] = spec["T"] + 7 if spec["T"] > 1 else 4
    if op == "mamba2":
        spec["G"] = 1 if spec["H"] == 3 else 2
    args, kw = build(op, sum(map(ord, op + name)), **spec)
    return args, kw, oracle(op, args, kw)


# ------------------------------------------------------------------------------- 1. forward


def _op_form_params():
    return [pytest.param(op, form, id=f"{op}-{form}") for op in ALL_OPS for form in forms_of(op)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", sorted(SHAPES))
@pytest.mark.parametrize("op,form", _op_form_params())
def test_forward_vs_oracle(op, form, case, dtype):
    args, kw, ref = shape_case(op, case)
    a, k = cast(args, kw, dtype)
    out = call(op, a, k, **form_opts(op, form))
    check_out(out, ref, dtype, f"{op} {form}")
    if op != "efficient_attention" and not kw.get("output_final_state"):
        assert out[1] is None


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("op", ALL_OPS)
def test_defaults_form_chunk_size_scale(op, dtype):
    """The default form is chunk (efficient: parallel) with chunk_size 64; scale defaults to
    K**-0.5 (mamba2: none); output_final_state defaults to False."""
    args, kw, _ = shape_case(op, "B2_T65_state")
    a, k = cast(args, kw, dtype)
    default = call(op, a, k)
    explicit = call(op, a, k, **form_opts(op, forms_of(op)[0], None if op == "efficient_attention" else 64))
    np.testing.assert_array_equal(default[0], explicit[0])
    assert forms_of(op)[0] == ("parallel" if op == "efficient_attention" else "chunk")
    if op not in ("mamba2", "linear_attention"):
        scaled = call(op, a, dict(k, scale=a[0].shape[3] ** -0.5))
        np.testing.assert_array_equal(scaled[0], default[0])
        other = call(op, a, dict(k, scale=0.37))
        assert_close(other[0], oracle(op, args, dict(kw, scale=0.37))[0], tol_out(dtype))
    if op != "efficient_attention":
        k2 = {n: x for n, x in k.items() if n != "output_final_state"}
        assert call(op, a, k2)[1] is None


@pytest.mark.parametrize("op", STATEFUL)
def test_empty_time_and_batch(op):
    """T = 0: an empty output and the initial state as the final state, whose gradient is the
    final state's cotangent. B = 0: empty outputs, empty gradients."""
    args, kw = build(op, 3, B=2, T=0, H=2, K=4, V=3)
    (o, ht), pb = vjp(op, args, kw)
    assert o.shape == (2, 0, 2, 3)
    np.testing.assert_array_equal(ht, kw["initial_state"])
    dht = np.random.default_rng(4).standard_normal(ht.shape)
    g = pb(np.zeros_like(o), dht)
    np.testing.assert_array_equal(g["initial_state"], dht)
    for name, x in zip(pyattn.OPS[op].arrays, args):
        assert g[name].shape == x.shape
    for name, x in g.items():  # the per-head constants: a sum over no step is 0
        assert np.all(x[...] == 0) if name in PER_HEAD else np.all(np.isfinite(x))
    args, kw = build(op, 5, B=0, T=6, H=2, K=4, V=3)
    (o, ht), pb = vjp(op, args, kw)
    assert o.shape == (0, 6, 2, 3) and ht.shape[0] == 0
    g = pb(o, ht)
    for name, x in zip(pyattn.OPS[op].arrays, args):
        assert g[name].shape == x.shape


def test_efficient_attention_empty_keys_and_queries():
    q, k, v = build("efficient_attention", 6, B=2, T=5, H=2, K=4, V=3, Tk=0)[0]
    o = pyattn.efficient_attention(q, k, v)
    assert o.shape == (2, 5, 2, 3) and np.all(o == 0)
    assert_close(o, reference.efficient_attention(q, k, v), 1e-10)
    q, k, v = build("efficient_attention", 7, B=1, T=0, H=2, K=4, V=3, Tk=6)[0]
    o, pb = pyattn.vjp(pyattn.efficient_attention, q, k, v)
    assert o.shape == (1, 0, 2, 3)
    g = pb(o)
    assert np.all(g["k"] == 0) and np.all(g["v"] == 0) and g["q"].shape == q.shape


# ------------------------------------------------------------------------------- 4. chunk sizes


@functools.lru_cache(maxsize=None)
def chunk_case(op, T):
    args, kw = build(op, 1000 + T + len(op), B=1, T=T, H=2, K=16, V=12)
    ref = oracle(op, args, kw)
    do, dht = cotangents(T, *ref)
    (_, _), pb = vjp(op, args, kw, form="recurrent")
    return args, kw, ref, do, dht, pb(do, dht)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("op", STATEFUL)
def test_chunk_sizes(op, T, dtype):
    """Every chunk size, T a multiple of it or not (a ragged last chunk): outputs and final
    state against the oracle, gradients against the float64 recurrent form's."""
    args, kw, ref, do, dht, g_ref = chunk_case(op, T)
    a, k = cast(args, kw, dtype)
    for cs in CHUNK_SIZES:
        out, pb = vjp(op, a, k, form="chunk", chunk_size=cs)
        check_out(out, ref, dtype, f"chunk_size={cs}")
        g = pb(do.astype(dtype), dht.astype(dtype))
        assert set(g) == set(g_ref)
        for name in g_ref:
            assert g[name].dtype == dtype
            assert_close(g[name], g_ref[name], tol_grad(dtype), name=f"chunk_size={cs} d{name}")


# ------------------------------------------------------------------------------- 2. finite differences

TINY = dict(B=1, T=7, H=2, K=3, V=2)

# name: (op, builder kwargs, the gradients expected)
GRADCHECK_CASES = {
    "linear_attention": ("linear_attention", dict(TINY), "q k v initial_state"),
    "linear_attention_no_state": ("linear_attention", dict(TINY, state=False), "q k v"),
    "linear_attention_normalize": ("linear_attention", dict(TINY, normalize=True), "q k v initial_state"),
    "linear_attention_elu1_normalize": ("linear_attention", dict(TINY, feature_map="elu1", normalize=True),
                                        "q k v initial_state"),
    "retention": ("retention", dict(TINY), "q k v gamma initial_state"),
    "retention_default_gamma": ("retention", dict(TINY, const=False), "q k v initial_state"),
    "lightning": ("lightning_attention", dict(TINY), "q k v slopes initial_state"),
    "lightning_default_slopes": ("lightning_attention", dict(TINY, const=False, final=False),
                                 "q k v initial_state"),
    "simple_gla": ("simple_gla", dict(TINY), "q k v g initial_state"),
    "simple_gla_T9_no_final": ("simple_gla", dict(TINY, T=9, final=False), "q k v g initial_state"),
    "simple_gla_T1": ("simple_gla", dict(TINY, T=1), "q k v g initial_state"),
    "simple_gla_strong": ("simple_gla", dict(TINY, gates="strong"), "q k v g initial_state"),
    "gla": ("gla", dict(TINY), "q k v g gv initial_state"),
    "gla_no_gv": ("gla", dict(TINY, gv=False, state=False), "q k v g"),
    "gla_weak": ("gla", dict(TINY, gates="weak"), "q k v g gv initial_state"),
    "mamba2": ("mamba2", dict(B=1, T=7, H=2, K=3, V=2), "x dt A B C D dt_bias initial_state"),
    "mamba2_G2_H4": ("mamba2", dict(B=1, T=5, H=4, K=2, V=2, G=2), "x dt A B C D dt_bias initial_state"),
    "mamba2_no_softplus": ("mamba2", dict(B=1, T=6, H=2, K=3, V=2, softplus=False, D=False),
                           "x dt A B C initial_state"),
    "mamba2_strong": ("mamba2", dict(B=1, T=6, H=2, K=3, V=2, gates="strong"), "x dt A B C D initial_state"),
    "efficient": ("efficient_attention", dict(B=1, T=5, H=2, K=3, V=2, Tk=6), "q k v"),
    "efficient_B2": ("efficient_attention", dict(B=2, T=4, H=1, K=3, V=2, Tk=3), "q k v"),
    # several chunks of 16 and a ragged last one: the chunk form's inter-chunk backward
    "simple_gla_T35_chunks": ("simple_gla", dict(B=1, T=35, H=1, K=2, V=2, chunk_size=16), "q k v g initial_state"),
    "gla_T35_chunks": ("gla", dict(B=1, T=35, H=1, K=2, V=2, chunk_size=16), "q k v g gv initial_state"),
}

LA_FEATURE_MAPS = {
    "identity": None, "elu1": None, "relu": None, "softmax": None, "focused": {"p": 2},
    "taylor": None, "performer": None, "cosformer": {"max_len": 10.0},
}
for _fm, _params in LA_FEATURE_MAPS.items():
    GRADCHECK_CASES[f"linear_attention_{_fm}"] = (
        "linear_attention", dict(TINY, T=5, feature_map=_fm, params=_params), "q k v initial_state")


@pytest.mark.parametrize("case,form", [pytest.param(c, f, id=f"{c}-{f}") for c in sorted(GRADCHECK_CASES)
                                       for f in forms_of(GRADCHECK_CASES[c][0])])
def test_gradcheck(case, form):
    op, spec, expected = GRADCHECK_CASES[case]
    spec = dict(spec)
    cs = spec.pop("chunk_size", None)
    args, kw = build(op, sum(map(ord, case)), **spec)
    with pyattn.num_threads(1):  # hundreds of tiny calls
        errs = gradcheck(getattr(pyattn, op), args, dict(kw, **form_opts(op, form, cs)))
    assert set(errs) == set(expected.split())


@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("op,form", _op_form_params())
def test_gradcheck_cu_seqlens(op, form, cu_dtype):
    cu = np.array([0, 3, 3, 8, 9], dtype=cu_dtype)
    spec = dict(B=1, T=9, H=2, K=3, V=2, N=4)
    if op == "linear_attention":
        spec.update(feature_map="cosformer")  # positions restart per sequence
    args, kw = build(op, 77 + len(op), **spec)
    kw["cu_seqlens"] = cu
    with pyattn.num_threads(1):
        errs = gradcheck(getattr(pyattn, op), args, dict(kw, form=form))
    given = set(pyattn.OPS[op].arrays) | set(kw)
    assert set(errs) == {n for n in pyattn.OPS[op].differentiable if n in given}


def _performer_loss(q, k, v, W, kw, do, dht):
    o, ht = pyattn.linear_attention(q, k, v, feature_map_params={"projection": W}, **kw)
    return float(np.sum(o * do) + np.sum(ht * dht))


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalize"])
@pytest.mark.parametrize("form", FORMS)
def test_performer_projection_gradient(form, normalize):
    """d/dW of performer's projection, which gradcheck cannot perturb (it lives inside
    feature_map_params): our own central differences, eps 1e-6, every entry of W."""
    args, kw = build("linear_attention", 31, **TINY, feature_map="performer", m=4, normalize=normalize)
    q, k, v = args
    W = kw.pop("feature_map_params")["projection"]
    kw["form"] = form
    (o, ht), pb = pyattn.vjp(pyattn.linear_attention, q, k, v, feature_map_params={"projection": W}, **kw)
    do, dht = cotangents(32, o, ht)
    g = pb((do, dht))
    assert set(g) == {"q", "k", "v", "initial_state", "projection"}
    assert g["projection"].shape == W.shape
    eps = 1e-6
    num = np.zeros_like(W)
    with pyattn.num_threads(1):
        for i in np.ndindex(W.shape):
            Wp, Wm = W.copy(), W.copy()
            Wp[i] += eps
            Wm[i] -= eps
            up = _performer_loss(q, k, v, Wp, kw, do, dht)
            num[i] = (up - _performer_loss(q, k, v, Wm, kw, do, dht)) / (2 * eps)
    assert np.max(np.abs(num)) > 1e-3  # W does matter here
    np.testing.assert_allclose(g["projection"], num, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("form", FORMS)
def test_performer_projection_gradient_cu_seqlens(form):
    """With cu_seqlens the projection's gradient is the sum of the sequences' gradients."""
    args, kw = build("linear_attention", 33, B=1, T=40, H=2, K=4, V=3, N=3, feature_map="performer", m=5)
    cu = np.array([0, 17, 17, 40])
    W = kw["feature_map_params"]["projection"]
    (o, ht), pb = vjp("linear_attention", args, dict(kw, cu_seqlens=cu), form=form)
    do, dht = cotangents(34, o, ht)
    total = pb(do, dht)["projection"]
    parts = np.zeros_like(W)
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        if e == s:
            continue
        piece = tuple(x[:, s:e] for x in args)
        (_, _), pbn = vjp("linear_attention", piece, dict(kw, initial_state=kw["initial_state"][n:n + 1]),
                          form=form)
        parts += pbn(do[:, s:e], dht[n:n + 1])["projection"]
    assert_close(total, parts, 1e-12)


# ------------------------------------------------------------------------------- 3. forms, adjoint

FORMS_CASES = {
    "linear_attention": ("linear_attention", dict(B=1, T=300, H=2, K=16, V=12)),
    "linear_attention_elu1_normalize": ("linear_attention",
                                        dict(B=2, T=150, H=2, K=16, V=12, feature_map="elu1", normalize=True)),
    "linear_attention_taylor": ("linear_attention", dict(B=1, T=200, H=1, K=4, V=12, feature_map="taylor")),
    "retention": ("retention", dict(B=1, T=300, H=2, K=16, V=12)),
    "lightning": ("lightning_attention", dict(B=1, T=300, H=2, K=16, V=12)),
    "simple_gla": ("simple_gla", dict(B=1, T=300, H=2, K=16, V=12)),
    "gla": ("gla", dict(B=1, T=300, H=2, K=16, V=12)),
    "gla_no_gv_B2": ("gla", dict(B=2, T=150, H=2, K=16, V=12, gv=False)),
    "mamba2": ("mamba2", dict(B=1, T=300, H=4, K=16, V=12, G=2)),
}


@functools.lru_cache(maxsize=None)
def forms_case(case):
    op, spec = FORMS_CASES[case]
    return op, *build(op, sum(map(ord, case)), **spec)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", sorted(FORMS_CASES))
def test_check_forms(case, dtype):
    op, args, kw = forms_case(case)
    a, k = cast(args, kw, dtype)
    res = check_forms(op, a, k)
    assert set(res) == {"parallel", "recurrent"}
    expected = {"out[0]", "out[1]"} | {f"d{n}" for n in pyattn.OPS[op].differentiable
                                       if n in pyattn.OPS[op].arrays or n in kw}
    for errs in res.values():
        assert set(errs) == expected


ADJOINT_CASES = {n: c for n, c in FORMS_CASES.items() if n in
                 ("linear_attention", "retention", "lightning", "simple_gla", "gla", "gla_no_gv_B2", "mamba2")}
ADJOINT_CASES["retention_default_gamma"] = ("retention", dict(B=1, T=130, H=3, K=8, V=8, const=False))


@functools.lru_cache(maxsize=None)
def adjoint_case(case):
    op, spec = ADJOINT_CASES[case]
    args, kw = build(op, sum(map(ord, case)) + 1, **spec)
    do, dht = cotangents(5, *oracle(op, args, kw))
    return op, args, kw, do, dht, adjoint(op, args, kw, do, dht)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", sorted(ADJOINT_CASES))
def test_grads_vs_adjoint_oracle(case, form, dtype):
    """Every gradient of every form against the float64 reverse loop, at T of several chunks:
    float64 within 1e-10, float32 within 1e-4."""
    op, args, kw, do, dht, ref = adjoint_case(case)
    a, k = cast(args, kw, dtype)
    _, pb = vjp(op, a, k, form=form)
    g = pb(do.astype(dtype), dht.astype(dtype))
    assert set(g) == set(ref)
    for name in ref:
        assert g[name].dtype == dtype and g[name].shape == ref[name].shape
        assert_close(g[name], ref[name], tol_grad(dtype), name=f"d{name}")


def test_adjoint_oracle_matches_finite_differences():
    """The test's own adjoint oracle is right: against gradcheck-style central differences of
    the reference forward on a small gla with both gates and a state."""
    args, kw = build("gla", 9, **TINY)
    o, ht = reference.gla(*args, **kw)
    do, dht = cotangents(10, o, ht)
    g = adjoint("gla", args, kw, do, dht)
    arrays = dict(zip("q k v g".split(), args), gv=kw["gv"], initial_state=kw["initial_state"])
    eps = 1e-6
    for name, x in arrays.items():
        num = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            orig = x[i]
            vals = []
            for d in (eps, -eps):
                x[i] = orig + d
                oo, hh = reference.gla(*args, **kw)
                vals.append(np.sum(oo * do) + np.sum(hh * dht))
            x[i] = orig
            num[i] = (vals[0] - vals[1]) / (2 * eps)
        np.testing.assert_allclose(g[name], num, rtol=1e-6, atol=1e-8, err_msg=name)


# ------------------------------------------------------------------------------- 5. weak, strong gates

GATE_OPS = {"simple_gla": "simple_gla", "gla_g": "gla", "gla_gv": "gla", "mamba2": "mamba2"}


@functools.lru_cache(maxsize=None)
def gate_case(which, strength):
    op = GATE_OPS[which]
    spec = dict(B=1, T=300, H=2, K=16, V=12)
    if op == "mamba2":
        spec["G"] = 2
    args, kw = build(op, len(which) * 7 + len(strength), gates=strength, **spec)
    if which == "gla_g":  # the key gate alone
        kw.pop("gv")
    if which == "gla_gv":  # the value gate carries the strength, the key gate is 0
        args = args[:3] + (np.zeros_like(args[3]),)
    ref = oracle(op, args, kw)
    do, dht = cotangents(11, *ref)
    return op, args, kw, ref, do, dht, adjoint(op, args, kw, do, dht)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("strength", ["weak", "strong"])
@pytest.mark.parametrize("which", sorted(GATE_OPS))
def test_weak_and_strong_gates(which, strength, form, dtype):
    """Gates near 0 (-1e-4) and strong (-20 per step; mamba2 dt*A down to -21), T = 300, every
    chunk size: outputs, final states and every gradient finite; outputs and final states
    match the oracle (float64 1e-10, float32 1e-5); every gradient, the gates' own included
    (under strong gates their true values are ~1e-9 of the others: the engine's identity
    leaves out the undecayed terms that would otherwise dominate them), matches the adjoint
    oracle in relative RMS (1e-10 / 1e-4)."""
    op, args, kw, ref, do, dht, g_ref = gate_case(which, strength)
    a, k = cast(args, kw, dtype)
    for cs in (CHUNK_SIZES if form == "chunk" else (None,)):
        out, pb = vjp(op, a, k, **form_opts(op, form, cs))
        check_out(out, ref, dtype, f"{strength} {form} {cs}")
        g = pb(do.astype(dtype), dht.astype(dtype))
        assert set(g) == set(g_ref)
        for name, x in g.items():
            assert np.all(np.isfinite(x)), f"d{name} not finite"
        for name in g_ref:
            assert_close(g[name], g_ref[name], tol_grad(dtype), name=f"{strength} {form} {cs} d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_gate_gradients_relative_accuracy(dtype):
    """With gates of mixed strength (-5 .. 0) the gate gradients hold the full relative
    tolerance in every form."""
    for op in ("simple_gla", "gla"):
        args, kw = build(op, 44, B=1, T=200, H=2, K=8, V=6)
        args = args[:3] + (f32_exact(5 * args[3]),)
        do, dht = cotangents(45, *oracle(op, args, kw))
        g_ref = adjoint(op, args, kw, do, dht)
        a, k = cast(args, kw, dtype)
        for form in FORMS:
            _, pb = vjp(op, a, k, form=form)
            g = pb(do.astype(dtype), dht.astype(dtype))
            for name in ("g", "gv"):
                if name in g_ref:
                    assert_close(g[name], g_ref[name], tol_grad(dtype), name=f"{op} {form} d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_gla_factored_and_split_blocks(dtype):
    """The chunk form factors a block's vector gate through its first row when the block
    spans at most 20 of log decay per channel, and splits it into 16-row sub-blocks
    otherwise. Per-step gates about -0.3 (a 64-row block spans ~19: factored, factors up to
    ~e^19) and -0.35 (~22: split) in alternate 64-row stretches, so one call mixes both:
    outputs, final states and every gradient against the oracle at every chunk size."""
    r = np.random.default_rng(48)
    T, K, Vd = 256, 8, 6
    q, k = (f32_exact(r.standard_normal((1, T, 2, K))) for _ in range(2))
    v = f32_exact(r.standard_normal((1, T, 2, Vd)))
    w = np.where((np.arange(T) // 64) % 2 == 0, 0.3, 0.35)[None, :, None, None]
    g = f32_exact(-w * r.uniform(0.9, 1.1, (1, T, 2, K)))
    gv = f32_exact(-w * r.uniform(0.9, 1.1, (1, T, 2, Vd)))
    args, kw = (q, k, v, g), {"gv": gv, "initial_state": f32_exact(r.standard_normal((1, 2, K, Vd))),
                               "output_final_state": True}
    ref = oracle("gla", args, kw)
    do, dht = cotangents(49, *ref)
    g_ref = adjoint("gla", args, kw, do, dht)
    a, kk = cast(args, kw, dtype)
    for cs in CHUNK_SIZES:
        out, pb = vjp("gla", a, kk, form="chunk", chunk_size=cs)
        check_out(out, ref, dtype, f"chunk_size={cs}")
        grads = pb(do.astype(dtype), dht.astype(dtype))
        for name in g_ref:
            assert_close(grads[name], g_ref[name], tol_grad(dtype), name=f"chunk_size={cs} d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("op", ["simple_gla", "gla"])
def test_gate_gradients_between_weak_and_strong(op, dtype):
    """Gates of -5 .. -10 per step on both sides (gla: key and value gates), with an initial
    state and a cotangent on the final state, T = 100: the gates' gradients are ~1e-3 .. 1e-6
    of the others, and the undecayed terms (a row with itself; the last row with the final
    state's cotangent) would leave their rounding, relative errors up to 1e-1 in float32.
    Every gradient within the full relative tolerance of the adjoint oracle, every form and
    chunk size."""
    r = np.random.default_rng(50)
    T, H, K, Vd = 100, 2, 8, 6
    q, k = (f32_exact(r.standard_normal((1, T, H, K))) for _ in range(2))
    v = f32_exact(r.standard_normal((1, T, H, Vd)))
    g = f32_exact(-r.uniform(5, 10, (1, T, H) if op == "simple_gla" else (1, T, H, K)))
    kw = {"initial_state": f32_exact(r.standard_normal((1, H, K, Vd))), "output_final_state": True}
    if op == "gla":
        kw["gv"] = f32_exact(-r.uniform(5, 10, (1, T, H, Vd)))
    args = (q, k, v, g)
    ref = oracle(op, args, kw)
    do, dht = cotangents(51, *ref)
    g_ref = adjoint(op, args, kw, do, dht)
    a, kk = cast(args, kw, dtype)
    for form in FORMS:
        for cs in (CHUNK_SIZES if form == "chunk" else (None,)):
            _, pb = vjp(op, a, kk, **form_opts(op, form, cs))
            grads = pb(do.astype(dtype), dht.astype(dtype))
            for name in g_ref:
                assert_close(grads[name], g_ref[name], tol_grad(dtype), name=f"{form} {cs} d{name}")


@functools.lru_cache(maxsize=None)
def long_case(op):
    args, kw = build(op, 46, B=1, T=2000, H=2, K=16, V=12)
    do, dht = cotangents(47, *oracle(op, args, kw))
    return args, kw, do, dht, adjoint(op, args, kw, do, dht)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op", ["retention", "lightning_attention", "mamba2"])
def test_float32_per_head_constant_gradients_long_sequence(op, form):
    """T = 2000, plain decays: the float32 gradients of the per-head constants (gamma, slopes;
    mamba2's A and dt_bias), sums over time of the per-step gate gradient, within 1e-4 of the
    float64 adjoint oracle, like every other float32 gradient. (Summed over the whole
    sequence, the gate identity's cancelling terms would exceed that; the engine restarts the
    identity at every piece of at most 64 rows.)"""
    args, kw, do, dht, ref = long_case(op)
    a, k = cast(args, kw, np.float32)
    _, pb = vjp(op, a, k, form=form)
    g = pb(do.astype(np.float32), dht.astype(np.float32))
    for name in ref:
        assert_close(g[name], ref[name], 1e-4, name=f"d{name}")


@pytest.mark.parametrize("form", ["chunk", "parallel"])
@pytest.mark.parametrize("which", ["g", "gv"])
def test_gla_float32_strong_then_weak_gates(which, form):
    """A vector gate that is strong (-20 per step) for the first 32 steps and weak (-1e-4)
    for the next 32, T = 64, one block of 64 rows (chunk_size 64, or the parallel form): the
    float32 outputs must stay within 1e-5 of the oracle, as the recurrent form's do and as
    simple_gla's do with the same gate (both checked alongside)."""
    r = np.random.default_rng(12)
    T, K, V = 64, 4, 4
    q, k, v = (f32_exact(r.standard_normal((1, T, 1, D))) for D in (K, K, V))
    gate = np.full((1, T, 1, K), -1e-4)
    gate[:, :32] = -20.0
    if which == "g":
        args, kw = (q, k, v, gate), {}
    else:
        args, kw = (q, k, v, np.zeros_like(gate)), {"gv": gate.copy()}
    o_ref = reference.gla(*args, **kw)[0]
    a, kk = cast(args, kw, np.float32)
    o_rec = pyattn.gla(*a, **kk, form="recurrent")[0]
    assert_close(o_rec, o_ref, 1e-5, name="recurrent o")
    o_sg = pyattn.simple_gla(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                             gate[..., 0].astype(np.float32), form=form, chunk_size=64)[0]
    assert_close(o_sg, reference.simple_gla(q, k, v, gate[..., 0])[0], 1e-5, name="simple_gla o")
    o = pyattn.gla(*a, **kk, form=form, chunk_size=64)[0]
    assert_close(o, o_ref, 1e-5, name=f"gla {form} o")


# ------------------------------------------------------------------------------- 6. cu_seqlens

LENS = [0, 5, 70, 0, 1, 64, 33, 0]  # empty first, middle and last; 1; a chunk; ragged


@functools.lru_cache(maxsize=None)
def varlen_case(op, variant):
    cu = np.concatenate([[0], np.cumsum(LENS)])
    T, N = int(cu[-1]), len(LENS)
    spec = dict(B=1, T=T, H=2, K=8, V=6, N=N)
    if op == "linear_attention":
        spec.update({"cosformer": dict(feature_map="cosformer"),
                     "cosformer_max_len": dict(feature_map="cosformer", params={"max_len": 50.0}),
                     "elu1_normalize": dict(feature_map="elu1", normalize=True),
                     "performer": dict(feature_map="performer")}.get(variant, {}))
    if op == "mamba2":
        spec["H"], spec["G"] = 4, 2
    args, kw = build(op, sum(map(ord, op + variant)), **spec)
    return cu, args, kw


def _varlen_params():
    out = []
    for op in ALL_OPS:
        variants = ["plain"]
        if op == "linear_attention":
            variants += ["cosformer", "cosformer_max_len", "elu1_normalize", "performer"]
        for variant in variants:
            for form in forms_of(op):
                out.append(pytest.param(op, variant, form, id=f"{op}-{variant}-{form}"))
    return out


def _piece(op, args, kw, n, s, e):
    """The arguments of rows s:e alone (with sequence n's initial state when n is given)."""
    names = pyattn.OPS[op].arrays
    a = tuple(x[:, s:e] if name in TIME_ARRAYS else x for name, x in zip(names, args))
    k = {name: (x[:, s:e] if name in TIME_ARRAYS and isinstance(x, np.ndarray) else x) for name, x in kw.items()}
    if "initial_state" in k and n is not None:
        k["initial_state"] = kw["initial_state"][n:n + 1]
    k.pop("cu_seqlens", None)
    return a, k


@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("op,variant,form", _varlen_params())
def test_cu_seqlens_equals_separate_calls(op, variant, form, dtype, cu_dtype):
    """Packed sequences (empty ones included) give each sequence's output, final state and
    gradients as a call on it alone with its own initial state (per-head constants: the sum
    of the sequences' gradients); an empty sequence passes its initial state through, and
    its final state's cotangent back. The packed result also matches the oracle."""
    cu, args, kw = varlen_case(op, variant)
    a, k = cast(args, kw, dtype)
    k["cu_seqlens"] = cu.astype(cu_dtype)
    out, pb = vjp(op, a, k, form=form)
    check_out(out, oracle(op, args, dict(kw, cu_seqlens=cu)), dtype, "packed")
    o, ht = out
    do, dht = cotangents(13, o, ht)
    do, dht = do.astype(dtype), None if dht is None else dht.astype(dtype)
    g = pb(do, dht)
    summed = {name: np.zeros(x.shape) for name, x in g.items() if name in PER_HEAD or name == "projection"}
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        if e == s:
            if ht is not None:
                np.testing.assert_array_equal(ht[n], k["initial_state"][n])
                np.testing.assert_array_equal(g["initial_state"][n], dht[n])
            continue
        pa, pk = _piece(op, a, k, n, s, e)
        (o1, ht1), pb1 = vjp(op, pa, pk, form=form)
        assert_close(o[:, s:e], o1, tol_out(dtype), name=f"seq {n} o")
        if ht is not None:
            assert_close(ht[n:n + 1], ht1, tol_out(dtype), name=f"seq {n} state")
        g1 = pb1(do[:, s:e], None if dht is None else dht[n:n + 1])
        assert set(g1) == set(g)
        for name, x in g1.items():
            if name in summed:
                summed[name] += x
            elif name == "initial_state":
                assert_close(g[name][n:n + 1], x, tol_grad(dtype), name=f"seq {n} d{name}")
            else:
                assert_close(g[name][:, s:e], x, tol_grad(dtype), name=f"seq {n} d{name}")
    for name, total in summed.items():
        assert_close(g[name], total, tol_grad(dtype), name=f"d{name} summed")


@pytest.mark.parametrize("op", ALL_OPS)
def test_cu_seqlens_equals_batch(op):
    """B equal-length sequences as a batch, or packed with cu_seqlens: the same numbers."""
    args, kw = build(op, 15, B=3, T=40, H=2, K=8, V=6)
    packed_args = tuple(x.reshape((1, 120) + x.shape[2:]) if x.ndim >= 3 else x for x in args)
    packed_kw = {n: (x.reshape((1, 120) + x.shape[2:]) if n in TIME_ARRAYS else x) for n, x in kw.items()}
    packed_kw["cu_seqlens"] = np.arange(4) * 40
    for form in forms_of(op):
        o_b, ht_b = call(op, args, kw, form=form)
        o_p, ht_p = call(op, packed_args, packed_kw, form=form)
        assert_close(o_p.reshape(o_b.shape), o_b, 1e-13)
        if ht_b is not None:
            assert_close(ht_p, ht_b, 1e-13)


# ------------------------------------------------------------------------------- 7. state passing


def _state_passing_params():
    out = []
    for op in STATEFUL:
        variants = ["plain"]
        if op == "linear_attention":
            variants.append("elu1_normalize")
        for variant in variants:
            for form in FORMS:
                out.append(pytest.param(op, variant, form, id=f"{op}-{variant}-{form}"))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("op,variant,form", _state_passing_params())
def test_state_passing_two_halves(op, variant, form, dtype):
    """T = 150 run as rows 0:70 then 70:150, the first half's final state as the second's
    initial state, equals one run: outputs and final state; and the gradients, pulling the
    second half's initial-state gradient back through the first half as its final state's
    cotangent."""
    spec = dict(B=2, T=150, H=2, K=8, V=6)
    if variant == "elu1_normalize":
        spec.update(feature_map="elu1", normalize=True)
    args, kw = build(op, 17 + len(op) + len(variant), **spec)
    a, k = cast(args, kw, dtype)
    full, pb = vjp(op, a, k, form=form)
    do, dht = (x.astype(dtype) for x in cotangents(18, *full))
    g = pb(do, dht)
    split = 70
    first = _piece(op, a, k, None, 0, split)
    second = _piece(op, a, k, None, split, 150)
    (o1, h1), pb1 = vjp(op, *first, form=form)
    (o2, h2), pb2 = vjp(op, second[0], dict(second[1], initial_state=h1), form=form)
    tol = tol_out(dtype)
    assert_close(np.concatenate([o1, o2], axis=1), full[0], tol, name="o")
    assert_close(h2, full[1], tol, name="final state")
    g2 = pb2(do[:, split:], dht)
    g1 = pb1(do[:, :split], g2["initial_state"])
    for name, x in g.items():
        if name == "initial_state":
            got = g1[name]
        elif name in PER_HEAD:
            got = g1[name].astype(np.float64) + g2[name]
        else:
            got = np.concatenate([g1[name], g2[name]], axis=1)
        assert_close(got, x, tol_grad(dtype), name=f"d{name}")


# ------------------------------------------------------------------------------- 8. feature maps


@functools.lru_cache(maxsize=None)
def feature_map_case(fm, normalize):
    params = {"focused": {"p": 3}, "cosformer": {"max_len": 80.0}}.get(fm)
    kind = {"None": None, "cosformer_default": "cosformer"}.get(fm, fm)
    args, kw = build("linear_attention", 19 + len(fm) + normalize, B=2, T=70, H=2,
                     K=3 if fm == "taylor" else 8, V=6, feature_map=kind, params=params,
                     normalize=normalize, m=10)
    return args, kw, oracle("linear_attention", args, kw)


FEATURE_MAPS = ["None", "identity", "elu1", "relu", "softmax", "focused", "taylor", "performer",
                "cosformer", "cosformer_default"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalize"])
@pytest.mark.parametrize("fm", FEATURE_MAPS)
def test_linear_attention_feature_maps(fm, normalize, form, dtype):
    args, kw, ref = feature_map_case(fm, normalize)
    a, k = cast(args, kw, dtype)
    out = call("linear_attention", a, k, form=form)
    check_out(out, ref, dtype, f"{fm}")
    # the state is [B, H, F, V (+1)], F the feature dimension of phi
    F = pyattn.feature_map(a[0], kw.get("feature_map") or "identity",
                           **(k.get("feature_map_params") or {})).shape[-1]
    assert out[1].shape == (2, 2, F, 6 + normalize)


@pytest.mark.parametrize("form", FORMS)
def test_linear_attention_normalize_is_a_ones_column(form):
    """normalize=True is the unnormalised op on [v, 1], then o[..., :V] / (o[..., V] + eps),
    with the state's last column z; eps is honoured."""
    args, kw = build("linear_attention", 21, B=1, T=90, H=2, K=8, V=5, feature_map="elu1", normalize=True)
    q, k, v = args
    for eps in (1e-6, 0.5):
        o, ht = pyattn.linear_attention(q, k, v, **kw, eps=eps, form=form)
        vv = np.concatenate([v, np.ones(v.shape[:3] + (1,))], axis=3)
        o1, ht1 = pyattn.linear_attention(q, k, vv, feature_map="elu1", initial_state=kw["initial_state"],
                                          output_final_state=True, form=form)
        assert_close(o, o1[..., :5] / (o1[..., 5:] + eps), 1e-12)
        assert_close(ht, ht1, 1e-12)
        assert_close(o, reference.linear_attention(q, k, v, **kw, eps=eps)[0], 1e-10)


# ------------------------------------------------------------------------------- 9. relations


def same_as(op, a, k, other, a2, k2, form, dtype, seed):
    """op(a, k) and other(a2, k2) give the same outputs, final states and q/k/v/state
    gradients; returns both gradient dicts (for their gate arguments' relation)."""
    out, pb = vjp(op, a, k, form=form)
    out2, pb2 = vjp(other, a2, k2, form=form)
    assert_close(out[0], out2[0], tol_out(dtype))
    assert_close(out[1], out2[1], tol_out(dtype))
    do, dht = (x.astype(dtype) for x in cotangents(seed, *out))
    g, g2 = pb(do, dht), pb2(do, dht)
    for n in ("q", "k", "v", "initial_state"):
        assert_close(g[n], g2[n], tol_grad(dtype), name=f"{op} d{n}")
    return g, g2


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
def test_retention_and_lightning_are_simple_gla(form, dtype):
    """retention == simple_gla with g = log(gamma) broadcast, lightning == simple_gla with
    g = -slope: outputs, states, q/k/v/state gradients, and d gamma = sum(dg) / gamma,
    d slope = -sum(dg)."""
    B, T, H = 2, 100, 3
    for op, name in (("retention", "gamma"), ("lightning_attention", "slopes")):
        args, kw = build(op, 23, B=B, T=T, H=H, K=8, V=6)
        a, k = cast(args, kw, dtype)
        c = k[name]
        logd = np.log(c.astype(np.float64)) if name == "gamma" else -c.astype(np.float64)
        g = np.ascontiguousarray(np.broadcast_to(logd, (B, T, H))).astype(dtype)
        ks = {n: x for n, x in k.items() if n != name}
        gr, gs = same_as(op, a, k, "simple_gla", a + (g,), ks, form, dtype, 24)
        dsum = gs["g"].sum(axis=(0, 1), dtype=np.float64)
        expected = dsum / c.astype(np.float64) if name == "gamma" else -dsum
        assert_close(gr[name], expected, tol_grad(dtype), name=f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_default_gamma_and_slopes(dtype):
    """gamma=None is 1 - 2**(-5 - h), slopes=None is 2**(-8 (h + 1) / H), h = 0..H-1 (docs/ops.md);
    the defaults are constants: no gradient entry for them."""
    H = 5
    args, kw = build("retention", 25, B=1, T=80, H=H, K=8, V=6, const=False)
    a, k = cast(args, kw, dtype)
    gamma = np.array([1 - 2.0 ** (-5 - h) for h in range(H)], dtype)
    slopes = np.array([2.0 ** (-8 * (h + 1) / H) for h in range(H)], dtype)
    for form in FORMS:
        out, pb = vjp("retention", a, k, form=form)
        explicit = call("retention", a, dict(k, gamma=gamma), form=form)
        assert_close(out[0], explicit[0], tol_out(dtype))
        assert_close(out[1], explicit[1], tol_out(dtype))
        assert "gamma" not in pb(np.ones_like(out[0]))
        out, pb = vjp("lightning_attention", a, k, form=form)
        explicit = call("lightning_attention", a, dict(k, slopes=slopes), form=form)
        assert_close(out[0], explicit[0], tol_out(dtype))
        assert_close(out[1], explicit[1], tol_out(dtype))
        assert "slopes" not in pb(np.ones_like(out[0]))
    # and the oracle's defaults agree
    assert_close(call("retention", a, k)[0], reference.retention(*args, **kw)[0], tol_out(dtype))
    assert_close(call("lightning_attention", a, k)[0], reference.lightning_attention(*args, **kw)[0],
                 tol_out(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
def test_gla_constant_across_k_is_simple_gla(form, dtype):
    args, kw = build("simple_gla", 26, B=2, T=100, H=2, K=8, V=6)
    a, k = cast(args, kw, dtype)
    q, kk, v, g = a
    gk = np.ascontiguousarray(np.repeat(g[..., None], 8, axis=3))
    gs, gg = same_as("simple_gla", a, k, "gla", (q, kk, v, gk), k, form, dtype, 27)
    assert_close(gg["g"].sum(axis=3, dtype=np.float64), gs["g"], tol_grad(dtype), name="dg")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("G", [1, 2, 3])
def test_mamba2_groups(G, form, dtype):
    """H = 6 heads over G groups (head h reads group h // (H // G)): the oracle, and the same
    call with B and C repeated to one group per head (their gradients summed over the group)."""
    H = 6
    args, kw = build("mamba2", 28 + G, B=2, T=70, H=H, K=5, V=4, G=G)
    a, k = cast(args, kw, dtype)
    out, pb = vjp("mamba2", a, k, form=form)
    check_out(out, oracle("mamba2", args, kw), dtype)
    rep = H // G
    x, dt, A, Bm, Cm = a
    wide = (x, dt, A) + tuple(np.ascontiguousarray(np.repeat(m, rep, axis=2)) for m in (Bm, Cm))
    out_w, pb_w = vjp("mamba2", wide, k, form=form)
    assert_close(out_w[0], out[0], tol_out(dtype))
    do, dht = (y.astype(dtype) for y in cotangents(29, *out))
    g, gw = pb(do, dht), pb_w(do, dht)
    for n in ("x", "dt", "A", "D", "dt_bias", "initial_state"):
        assert_close(g[n], gw[n], tol_grad(dtype), name=f"d{n}")
    for n in ("B", "C"):
        assert_close(g[n], gw[n].reshape(2, 70, G, rep, 5).sum(axis=3, dtype=np.float64), tol_grad(dtype),
                     name=f"d{n}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
def test_mamba2_is_simple_gla(form, dtype):
    """mamba2 = simple_gla(q=C, k=B, v=x dt, g=A dt, scale=1) + D x, dt = softplus(dt + bias)."""
    args, kw = build("mamba2", 30, B=1, T=90, H=2, K=6, V=4, G=1)
    x, dt, A, Bm, Cm = args
    d = _softplus(dt + kw["dt_bias"])
    a, k = cast(args, kw, dtype)
    y, h = call("mamba2", a, k, form=form)
    sg = cast((np.repeat(Cm, 2, axis=2), np.repeat(Bm, 2, axis=2), x * d[..., None], A * d),
              {"initial_state": kw["initial_state"], "output_final_state": True, "scale": 1.0}, dtype)
    o, hs = call("simple_gla", *sg, form=form)
    assert_close(y, o + (kw["D"][:, None] * x).astype(dtype), tol_out(dtype))
    assert_close(h, hs, tol_out(dtype))


def test_efficient_attention_is_two_softmaxes():
    """o = softmax_row(scale q) (softmax_col(scale k)^T v), written with NumPy's matrices."""
    q, k, v = build("efficient_attention", 31, B=2, T=40, H=2, K=8, V=5, Tk=55)[0]
    for scale in (None, 0.7):
        s = 8 ** -0.5 if scale is None else scale
        eq = np.exp(s * q - (s * q).max(axis=3, keepdims=True))
        ek = np.exp(s * k - (s * k).max(axis=1, keepdims=True))
        qs, kc = eq / eq.sum(axis=3, keepdims=True), ek / ek.sum(axis=1, keepdims=True)
        expected = np.einsum("bthk,bhkv->bthv", qs, np.einsum("bthk,bthv->bhkv", kc, v))
        assert_close(pyattn.efficient_attention(q, k, v, scale=scale), expected, 1e-12)


# ------------------------------------------------------------------------------- vjp structure


@pytest.mark.parametrize("op", STATEFUL)
def test_cotangent_structures(op):
    """pullback(do) == pullback((do, None)); the final state's cotangent alone; linearity; the
    inputs are not modified; outputs equal the direct call's."""
    args, kw = build(op, 35, B=1, T=50, H=2, K=5, V=4)
    copies = [np.copy(x) for x in args] + [np.copy(x) for x in kw.values() if isinstance(x, np.ndarray)]
    out, pb = pyattn.vjp(getattr(pyattn, op), *args, **kw)
    direct = getattr(pyattn, op)(*args, **kw)
    np.testing.assert_array_equal(out[0], direct[0])
    np.testing.assert_array_equal(out[1], direct[1])
    do, dht = cotangents(36, *out)
    g_full, g_do, g_ht = pb((do, dht)), pb((do, None)), pb((None, dht))
    g_bare = pb(do)
    for n in g_full:
        np.testing.assert_array_equal(g_bare[n], g_do[n])
        assert_close(g_do[n] + g_ht[n], g_full[n], 1e-12, name=n)
    g2 = pb((2 * do, 2 * dht))
    for n in g_full:
        assert_close(g2[n], 2 * g_full[n], 1e-13, name=n)
    after = list(args) + [x for x in kw.values() if isinstance(x, np.ndarray)]
    for x, c in zip(after, copies):
        np.testing.assert_array_equal(x, c)


@pytest.mark.parametrize("op", ALL_OPS)
def test_noncontiguous_inputs(op):
    """Inputs stored transposed ([B, H, T, D] memory): the same results, bitwise."""
    args, kw = build(op, 37, B=2, T=45, H=3, K=6, V=5)
    nc = tuple(np.ascontiguousarray(x.swapaxes(1, 2)).swapaxes(1, 2) if x.ndim == 4 else x[::-1].copy()[::-1]
               for x in args)
    assert not nc[0].flags.c_contiguous
    for form in forms_of(op):
        out, pb = vjp(op, args, kw, form=form)
        out_nc, pb_nc = vjp(op, nc, kw, form=form)
        np.testing.assert_array_equal(out_nc[0], out[0])
        do = np.ascontiguousarray(out[0].swapaxes(1, 2)).swapaxes(1, 2)
        g, g_nc = pb(np.ascontiguousarray(do)), pb_nc(do)
        for n in g:
            np.testing.assert_array_equal(g_nc[n], g[n])


# ------------------------------------------------------------------------------- 10. bad arguments


def _sg(T=8, H=2, K=4, V=3, B=1, dtype=np.float64):
    r = np.random.default_rng(0)
    return [r.standard_normal(s).astype(dtype) for s in ((B, T, H, K), (B, T, H, K), (B, T, H, V))] + \
        [-r.random((B, T, H)).astype(dtype)]


def _gla_args(T=8, H=2, K=4, V=3, B=1):
    q, k, v, _ = _sg(T, H, K, V, B)
    return [q, k, v, -np.random.default_rng(1).random((B, T, H, K))]


def _m2(H=3, G=1, T=8):
    r = np.random.default_rng(2)
    return [r.standard_normal((1, T, H, 2)), r.standard_normal((1, T, H)), -np.ones(H),
            r.standard_normal((1, T, G, 4)), r.standard_normal((1, T, G, 4))]


def _pullback(op_fn, args, kw, cot):
    return pyattn.vjp(op_fn, *args, **kw)[1](cot)


F32 = np.float32
# id: (callable, args, kwargs, exception, message parts)
BAD_CASES = {
    "q_ndim": (pyattn.simple_gla, lambda: [_sg()[0][0]] + _sg()[1:], {}, ValueError, ["'q'", "4-D"]),
    "k_ndim_gla": (pyattn.gla, lambda: [_gla_args()[0], _gla_args()[1][0]] + _gla_args()[2:], {}, ValueError,
                   ["'k'", "4-D"]),
    "v_ndim_retention": (pyattn.retention, lambda: _sg()[:2] + [_sg()[2][0]], {}, ValueError, ["'v'"]),
    "k_shape": (pyattn.linear_attention, lambda: [_sg()[0], _sg()[1][..., :3], _sg()[2]], {}, ValueError,
                ["'k'", "(1, 8, 2, 3)"]),
    "v_time": (pyattn.lightning_attention, lambda: _sg()[:2] + [_sg()[2][:, :5]], {}, ValueError, ["'v'"]),
    "g_shape": (pyattn.simple_gla, lambda: _sg()[:3] + [_gla_args()[3]], {}, ValueError, ["'g'", "(1, 8, 2)"]),
    "gla_g_shape": (pyattn.gla, lambda: _sg(), {}, ValueError, ["'g'", "(1, 8, 2, 4)"]),
    "gla_gv_shape": (pyattn.gla, _gla_args, {"gv": np.zeros((1, 8, 2, 4))}, ValueError, ["'gv'", "(1, 8, 2, 3)"]),
    "dtype_mix_k": (pyattn.simple_gla, lambda: [_sg()[0], _sg()[1].astype(F32)] + _sg()[2:], {}, TypeError,
                    ["'k'", "float32", "float64"]),
    "dtype_mix_g": (pyattn.simple_gla, lambda: _sg()[:3] + [_sg()[3].astype(F32)], {}, TypeError,
                    ["'g'", "float32", "float64"]),
    "dtype_mix_gla_g": (pyattn.gla, lambda: _gla_args()[:3] + [_gla_args()[3].astype(F32)], {}, TypeError,
                        ["'g'", "float32", "float64"]),
    "dtype_mix_gv": (pyattn.gla, _gla_args, {"gv": np.zeros((1, 8, 2, 3), F32)}, TypeError, ["'gv'", "float32"]),
    "dtype_mix_state": (pyattn.linear_attention, lambda: _sg()[:3], {"initial_state": np.zeros((1, 2, 4, 3), F32)},
                        TypeError, ["'initial_state'", "float32"]),
    "dtype_mix_gamma": (pyattn.retention, lambda: _sg()[:3], {"gamma": np.array([0.9, 0.8], F32)}, TypeError,
                        ["'gamma'", "float32"]),
    "dtype_mix_slopes": (pyattn.lightning_attention, lambda: _sg()[:3], {"slopes": np.array([0.9, 0.8], F32)},
                         TypeError, ["'slopes'", "float32"]),
    "dtype_mix_mamba2_A": (pyattn.mamba2, lambda: _m2()[:2] + [_m2()[2].astype(F32)] + _m2()[3:], {}, TypeError,
                           ["'A'", "float32"]),
    "dtype_mix_efficient": (pyattn.efficient_attention, lambda: _sg()[:2] + [_sg()[2].astype(F32)], {}, TypeError,
                            ["'v'", "float32"]),
    "dtype_float16": (pyattn.retention, lambda: [_sg()[0].astype(np.float16)] + _sg()[1:3], {}, TypeError,
                      ["'q'", "float16"]),
    "dtype_int_gate": (pyattn.simple_gla, lambda: _sg()[:3] + [np.zeros((1, 8, 2), np.int64)], {}, TypeError,
                       ["'g'", "int64"]),
    "not_an_array": (pyattn.gla, lambda: ["q"] + _gla_args()[1:], {}, TypeError, ["'q'", "str"]),
    "chunk_size_48": (pyattn.simple_gla, _sg, {"chunk_size": 48}, ValueError, ["chunk_size", "48"]),
    "chunk_size_48_gla": (pyattn.gla, _gla_args, {"chunk_size": 48}, ValueError, ["chunk_size", "48"]),
    "chunk_size_0_mamba2": (pyattn.mamba2, _m2, {"chunk_size": 0}, ValueError, ["chunk_size"]),
    "form_flash": (pyattn.gla, _gla_args, {"form": "flash"}, ValueError, ["form", "'flash'"]),
    "form_flash_linear": (pyattn.linear_attention, lambda: _sg()[:3], {"form": "flash"}, ValueError,
                          ["form", "'flash'"]),
    "form_chunk_efficient": (pyattn.efficient_attention, lambda: _sg()[:3], {"form": "chunk"}, ValueError,
                             ["form", "'chunk'"]),
    "state_shape": (pyattn.simple_gla, _sg, {"initial_state": np.zeros((1, 2, 3, 4))}, ValueError,
                    ["'initial_state'", "(1, 2, 4, 3)", "(1, 2, 3, 4)"]),
    "state_ndim": (pyattn.retention, lambda: _sg()[:3], {"initial_state": np.zeros((2, 4, 3))}, ValueError,
                   ["'initial_state'", "(2, 4, 3)"]),
    "state_normalize_needs_V+1": (pyattn.linear_attention, lambda: _sg()[:3],
                                  {"normalize": True, "initial_state": np.zeros((1, 2, 4, 3))}, ValueError,
                                  ["'initial_state'", "(1, 2, 4, 4)"]),
    "state_taylor_features": (pyattn.linear_attention, lambda: _sg()[:3],
                              {"feature_map": "taylor", "initial_state": np.zeros((1, 2, 4, 3))}, ValueError,
                              ["'initial_state'", "(1, 2, 21, 3)"]),
    "state_count_cu_seqlens": (pyattn.gla, _gla_args, {"cu_seqlens": np.array([0, 4, 8]),
                                                       "initial_state": np.zeros((1, 2, 4, 3))}, ValueError,
                               ["'initial_state'", "(2, 2, 4, 3)"]),
    "state_mamba2": (pyattn.mamba2, _m2, {"initial_state": np.zeros((1, 3, 2, 4))}, ValueError,
                     ["'initial_state'", "(1, 3, 4, 2)"]),
    "cu_seqlens_B2": (pyattn.simple_gla, lambda: _sg(B=2), {"cu_seqlens": np.array([0, 4, 8])}, ValueError,
                      ["cu_seqlens", "B=2"]),
    "cu_seqlens_B2_mamba2": (pyattn.mamba2, lambda: [np.concatenate([x, x]) if x.ndim > 1 else x for x in _m2()],
                             {"cu_seqlens": np.array([0, 8])}, ValueError, ["cu_seqlens", "B=2"]),
    "cu_seqlens_B2_efficient": (pyattn.efficient_attention, lambda: _sg(B=2)[:3], {"cu_seqlens": np.array([0, 8])},
                                ValueError, ["cu_seqlens", "B=2"]),
    "cu_seqlens_end": (pyattn.linear_attention, lambda: _sg()[:3], {"cu_seqlens": np.array([0, 4, 7])},
                       ValueError, ["cu_seqlens", "T=8"]),
    "cu_seqlens_decreasing": (pyattn.lightning_attention, lambda: _sg()[:3],
                              {"cu_seqlens": np.array([0, 5, 3, 8], np.int32)}, ValueError, ["cu_seqlens"]),
    "cu_seqlens_float": (pyattn.retention, lambda: _sg()[:3], {"cu_seqlens": np.array([0.0, 8.0])}, TypeError,
                         ["cu_seqlens", "float64"]),
    "cu_seqlens_efficient_Tq_ne_Tk": (pyattn.efficient_attention,
                                      lambda: [_sg()[0], _sg(T=6)[1], _sg(T=6)[2]],
                                      {"cu_seqlens": np.array([0, 8])}, ValueError, ["cu_seqlens", "Tq=8", "Tk=6"]),
    "mamba2_H_not_divisible_by_G": (pyattn.mamba2, lambda: _m2(H=3, G=2), {}, ValueError, ["'B'", "H=3"]),
    "mamba2_A_shape": (pyattn.mamba2, lambda: _m2()[:2] + [-np.ones(2)] + _m2()[3:], {}, ValueError,
                       ["'A'", "(3,)"]),
    "mamba2_dt_shape": (pyattn.mamba2, lambda: [_m2()[0], _m2()[1][..., :2]] + _m2()[2:], {}, ValueError, ["'dt'"]),
    "mamba2_C_shape": (pyattn.mamba2, lambda: _m2()[:4] + [_m2()[4][..., :3]], {}, ValueError, ["'C'"]),
    "mamba2_D_shape": (pyattn.mamba2, _m2, {"D": np.ones(2)}, ValueError, ["'D'", "(3,)"]),
    "mamba2_dt_bias_shape": (pyattn.mamba2, _m2, {"dt_bias": np.ones(4)}, ValueError, ["'dt_bias'", "(3,)"]),
    "gamma_shape": (pyattn.retention, lambda: _sg()[:3], {"gamma": np.array([0.9])}, ValueError,
                    ["'gamma'", "(2,)"]),
    "gamma_above_1": (pyattn.retention, lambda: _sg()[:3], {"gamma": np.array([0.9, 1.5])}, ValueError, ["'gamma'"]),
    "gamma_negative": (pyattn.retention, lambda: _sg()[:3], {"gamma": np.array([0.9, -0.1])}, ValueError,
                       ["'gamma'"]),
    "slopes_negative": (pyattn.lightning_attention, lambda: _sg()[:3], {"slopes": np.array([0.5, -1.0])},
                        ValueError, ["'slopes'"]),
    "slopes_minus_inf": (pyattn.lightning_attention, lambda: _sg()[:3], {"slopes": np.array([0.5, -np.inf])},
                         ValueError, ["'slopes'"]),
    "feature_map_unknown": (pyattn.linear_attention, lambda: _sg()[:3], {"feature_map": "cosh"}, ValueError,
                            ["'cosh'"]),
    "feature_map_params_not_dict": (pyattn.linear_attention, lambda: _sg()[:3],
                                    {"feature_map": "focused", "feature_map_params": 3}, TypeError,
                                    ["'feature_map_params'"]),
    "performer_without_projection": (pyattn.linear_attention, lambda: _sg()[:3], {"feature_map": "performer"},
                                     ValueError, ["projection"]),
    "performer_projection_shape": (pyattn.linear_attention, lambda: _sg()[:3],
                                   {"feature_map": "performer",
                                    "feature_map_params": {"projection": np.ones((5, 3))}},
                                   ValueError, ["projection", "(5, 3)"]),
    "scale_string": (pyattn.gla, _gla_args, {"scale": "a"}, TypeError, ["'scale'"]),
    "scale_nan": (pyattn.simple_gla, _sg, {"scale": float("nan")}, ValueError, ["'scale'"]),
    "eps_string": (pyattn.linear_attention, lambda: _sg()[:3], {"eps": "x"}, TypeError, ["'eps'"]),
    "head_dim_zero": (pyattn.simple_gla, lambda: [x[..., :0] for x in _sg()[:2]] + _sg()[2:], {}, ValueError,
                      ["K=0"]),
    "efficient_heads": (pyattn.efficient_attention, lambda: [_sg()[0], _sg(H=1)[1], _sg(H=1)[2]], {}, ValueError,
                        ["'k'"]),
    # pullbacks
    "pullback_state_cotangent_without_state": (
        _pullback, lambda: [pyattn.simple_gla, _sg(), {}, (np.ones((1, 8, 2, 3)), np.ones((1, 2, 4, 3)))], {},
        ValueError, ["output_final_state=False"]),
    "pullback_state_cotangent_without_state_gla": (
        _pullback, lambda: [pyattn.gla, _gla_args(), {}, (np.ones((1, 8, 2, 3)), np.ones((1, 2, 4, 3)))], {},
        ValueError, ["output_final_state=False"]),
    "pullback_state_cotangent_without_state_retention": (
        _pullback, lambda: [pyattn.retention, _sg()[:3], {}, (np.ones((1, 8, 2, 3)), np.ones((1, 2, 4, 3)))], {},
        ValueError, ["output_final_state=False"]),
    "pullback_state_cotangent_without_state_lightning": (
        _pullback, lambda: [pyattn.lightning_attention, _sg()[:3], {},
                            (np.ones((1, 8, 2, 3)), np.ones((1, 2, 4, 3)))],
        {}, ValueError, ["output_final_state=False"]),
    "pullback_state_cotangent_without_state_linear": (
        _pullback, lambda: [pyattn.linear_attention, _sg()[:3], {"normalize": True},
                            (np.ones((1, 8, 2, 3)), np.ones((1, 2, 4, 4)))], {},
        ValueError, ["output_final_state=False"]),
    "pullback_state_cotangent_without_state_mamba2": (
        _pullback, lambda: [pyattn.mamba2, _m2(), {}, (np.ones((1, 8, 3, 2)), np.ones((1, 3, 4, 2)))], {},
        ValueError, ["output_final_state=False"]),
    "pullback_do_shape": (_pullback, lambda: [pyattn.gla, _gla_args(), {"output_final_state": True},
                                              (np.ones((1, 8, 2, 4)), None)], {}, ValueError,
                          ["'do'", "(1, 8, 2, 3)"]),
    "pullback_dht_shape": (_pullback, lambda: [pyattn.simple_gla, _sg(), {"output_final_state": True},
                                               (np.ones((1, 8, 2, 3)), np.ones((1, 2, 3, 4)))], {}, ValueError,
                           ["(1, 2, 4, 3)"]),
    "pullback_do_dtype": (_pullback, lambda: [pyattn.retention, _sg()[:3], {}, np.ones((1, 8, 2, 3), F32)], {},
                          TypeError, ["'do'", "float32"]),
    "pullback_three_entries": (_pullback, lambda: [pyattn.simple_gla, _sg(), {"output_final_state": True},
                                                   (np.ones((1, 8, 2, 3)), None, None)], {}, ValueError, ["3"]),
    "pullback_efficient_two_entries": (_pullback, lambda: [pyattn.efficient_attention, _sg()[:3], {},
                                                           (np.ones((1, 8, 2, 3)), None)], {}, ValueError, ["2"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_arguments(case):
    fn, make, kw, exc, must = BAD_CASES[case]
    raises(exc, fn, *make(), must=must, **kw)


@pytest.mark.parametrize("op", ALL_OPS)
def test_bad_arguments_raise_through_vjp_too(op):
    """pyattn.vjp validates like the forward: a bad form is the same ValueError."""
    args, kw = build(op, 38, B=1, T=6, H=2, K=3, V=2)
    msg = raises(ValueError, pyattn.vjp, getattr(pyattn, op), *args, **kw, form="flash")
    assert "'flash'" in msg


# ------------------------------------------------------------------------------- 11. threads


@functools.lru_cache(maxsize=None)
def threads_case(op, dtype):
    spec = dict(B=1, T=2000, H=1, K=32, V=32)
    if op == "linear_attention":
        spec.update(feature_map="elu1")
    args, kw = build(op, 39 + len(op), **spec)
    a, k = cast(args, kw, dtype)
    out = oracle(op, args, kw)
    do, dht = (x.astype(dtype) for x in cotangents(40, *out))
    return a, k, do, dht, out


def _run_threads(op, a, k, do, dht, n, **opts):
    with pyattn.num_threads(n):
        out, pb = vjp(op, a, k, **opts)
        return out, pb(do, dht)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("op", ["simple_gla", "gla", "linear_attention", "mamba2"])
def test_threads_single_unit_chunk_parallel(op, dtype):
    """One (sequence, head) unit, T = 2000, K = V = 32: with 4 threads the chunk form splits
    the unit into chunks and passes the states (and their gradients) by a scan over chunks,
    which re-associates a few sums: float64 within 1e-12 of one thread, float32 within 1e-6
    (a few float32 ulps; measured <= 1e-7). The parallel and recurrent forms run one unit on
    one thread: bitwise equal. The 4-thread chunk output also matches the oracle."""
    a, k, do, dht, ref = threads_case(op, dtype)
    for form in FORMS:
        out1, g1 = _run_threads(op, a, k, do, dht, 1, form=form)
        out4, g4 = _run_threads(op, a, k, do, dht, 4, form=form)
        r1 = {"o": out1[0], "final_state": out1[1], **{f"d{n}": x for n, x in g1.items()}}
        r4 = {"o": out4[0], "final_state": out4[1], **{f"d{n}": x for n, x in g4.items()}}
        assert set(r1) == set(r4)
        for n in r1:
            if form != "chunk":
                np.testing.assert_array_equal(r4[n], r1[n], err_msg=f"{form} {n}")
            else:
                assert_close(r4[n], r1[n], 1e-12 if dtype == np.float64 else 1e-6, name=f"{form} {n}")
        if form == "chunk":
            check_out(out4, ref, dtype, "4 threads")


@pytest.mark.parametrize("op", ["gla", "mamba2"])
def test_threads_few_units_with_cu_seqlens(op):
    """Three sequences (one empty) x one head, fewer units than threads: the chunk-parallel
    schedule over several units (K = V = 32 gives the call enough work for 4 threads), against
    one thread and the oracle."""
    cu = np.array([0, 1100, 1100, 1700])
    args, kw = build(op, 41, B=1, T=1700, H=1, K=32, V=32, N=3)
    kw["cu_seqlens"] = cu
    ref = oracle(op, args, kw)
    do, dht = cotangents(42, *ref)
    out1, g1 = _run_threads(op, args, kw, do, dht, 1, form="chunk", chunk_size=32)
    out4, g4 = _run_threads(op, args, kw, do, dht, 4, form="chunk", chunk_size=32)
    check_out(out4, ref, np.float64)
    assert_close(out4[0], out1[0], 1e-12)
    assert_close(out4[1], out1[1], 1e-12)
    np.testing.assert_array_equal(out4[1][1], kw["initial_state"][1])
    for n in g1:
        assert_close(g4[n], g1[n], 1e-12, name=f"d{n}")


# ------------------------------------------------------------------------------- 12. kept states


# the engine's last arguments, unused here: beta, skip, then bf16 (forward) or dbeta, dskip
_FWD_TAIL = (None, None, False)
_BWD_TAIL = (None, None, None, None)


def _engine_backward(args, states, threads):
    """_core.linear_backward on the engine's raw arguments, with the forward's kept states or
    None (recomputed): every gradient."""
    q, k, v, g, gv, h0, do, dht, opts = args
    out = [np.empty_like(x) if x is not None else None for x in (q, k, v, g, gv, h0)]
    with pyattn.num_threads(threads):
        pyattn._core.linear_backward(q, k, v, g, gv, h0, do, dht, states, *out, *opts, *_BWD_TAIL)
    return out


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("units", ["one", "many"])
@pytest.mark.parametrize("gates", ["none", "scalar", "vector", "vector+gv"])
def test_kept_states(gates, units, threads, dtype):
    """The chunk forward under vjp keeps the state entering each chunk for the backward: per
    (sequence, head) the states entering its chunks, then the final one. With cu_seqlens
    (an empty sequence, ragged last chunks), one unit or three (one head), on the per-unit
    (1 thread) and the chunk-parallel (4 threads: fewer units than threads, and K = V = 32
    give the call enough work for them) schedules: the slots hold h0, the oracle's state at
    every chunk boundary and the final state, and a backward reading them gives the same
    gradients, bitwise, as one recomputing them. A key gate alone ("vector") is the case where
    the forward's state update reads operands its output pass made (k times its factors, the
    packed value rows); float32 as well as float64."""
    r = np.random.default_rng(7)
    cu = np.array([0, 500, 500, 1201]) if units == "many" else np.array([0, 1201])
    N, H, K, Vd, C = len(cu) - 1, 1, 32, 32, 32
    T = int(cu[-1])
    q, k = (r.standard_normal((1, T, H, K)) for _ in range(2))
    v = r.standard_normal((1, T, H, Vd))
    g = None if gates == "none" else -r.uniform(0, 0.5, (1, T, H) if gates == "scalar" else (1, T, H, K))
    gv = -r.uniform(0, 0.5, (1, T, H, Vd)) if gates == "vector+gv" else None
    h0 = r.standard_normal((N, H, K, Vd))
    q, k, v, g, gv, h0 = (None if x is None else x.astype(dtype) for x in (q, k, v, g, gv, h0))
    tol = 1e-12 if dtype == np.float64 else 1e-5
    o, ht = np.empty_like(v), np.empty_like(h0)
    opts = (cu.astype(np.int64), pyattn._core.FORM_CHUNK, C, 0.5)
    with pyattn.num_threads(threads):
        kept = pyattn._core.linear_forward(q, k, v, g, gv, h0, o, ht, True, *opts, *_FWD_TAIL)
    assert kept.shape == (H * sum(-(-(e - s) // C) + 1 for s, e in zip(cu[:-1], cu[1:])), K, Vd)
    slot = 0
    for n in range(N):
        s, e = int(cu[n]), int(cu[n + 1])
        for h in range(H):
            S = h0[n, h].copy()
            for t in range(s, e + 1):
                if (t - s) % C == 0 or t == e:
                    assert_close(kept[slot], S, tol, name=f"slot {slot} (n={n} h={h} t={t})")
                    slot += 1
                if t < e:
                    dk = np.exp(g[0, t, h]) if g is not None else 1.0
                    dv = np.exp(gv[0, t, h]) if gv is not None else 1.0
                    S = (np.reshape(dk, (-1, 1)) * S * np.reshape(dv, (1, -1))
                         + np.outer(k[0, t, h], v[0, t, h]))
            np.testing.assert_array_equal(kept[slot - 1], ht[n, h])
    assert slot == len(kept)
    do, dht = r.standard_normal(o.shape).astype(dtype), r.standard_normal(ht.shape).astype(dtype)
    args = (q, k, v, g, gv, h0, do, dht, opts)
    for a, b in zip(_engine_backward(args, kept, threads), _engine_backward(args, None, threads)):
        if a is not None:
            np.testing.assert_array_equal(a, b)
    raises(ValueError, pyattn._core.linear_backward, q, k, v, g, gv, h0, do, dht, kept[1:],
           *_engine_backward(args, None, 1), *opts, *_BWD_TAIL, must=("'states'",))
    raises(ValueError, pyattn._core.linear_backward, q, k, v, g, gv, h0, do, dht, kept,
           *_engine_backward(args, None, 1), opts[0], pyattn._core.FORM_PARALLEL, *opts[2:],
           *_BWD_TAIL, must=("chunk form",))


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("form", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("gates", ["none", "scalar", "vector"])
def test_engine_value_scale_and_skip(gates, form, threads):
    """The engine's beta (v_t read as beta_t v_t) and skip (o_t += skip_h v_t), Mamba-2's x dt
    and D x: equal to the engine on beta v with skip v added to its output, and the backward's
    dv, dbeta and dskip to the chain rule through that engine's dv'; with cu_seqlens (an empty
    sequence, a ragged last chunk), one unit per thread or fewer units than threads."""
    r = np.random.default_rng(13)
    cu = np.array([0, 70, 70, 171], np.int64)
    N, H, K, Vd, T = 3, 2, 8, 6, 171
    q, k = (r.standard_normal((1, T, H, K)) for _ in range(2))
    v = r.standard_normal((1, T, H, Vd))
    beta, skip = r.uniform(0.1, 2, (1, T, H)), r.standard_normal(H)
    g = None if gates == "none" else -r.uniform(0, 0.5, (1, T, H) if gates == "scalar" else (1, T, H, K))
    h0 = r.standard_normal((N, H, K, Vd))
    opts = (cu, getattr(pyattn._core, f"FORM_{form.upper()}"), 32, 0.5)
    vb = v * beta[..., None]
    o, ht, ob, htb = np.empty_like(v), np.empty_like(h0), np.empty_like(v), np.empty_like(h0)
    with pyattn.num_threads(threads):
        pyattn._core.linear_forward(q, k, v, g, None, h0, o, ht, False, *opts, beta, skip, False)
        pyattn._core.linear_forward(q, k, vb, g, None, h0, ob, htb, False, *opts, *_FWD_TAIL)
    assert_close(o, ob + skip[:, None] * v, 1e-14, name="o")
    assert_close(ht, htb, 1e-14, name="final state")
    do, dht = r.standard_normal(v.shape), r.standard_normal(h0.shape)
    out = [np.empty_like(x) if x is not None else None for x in (q, k, v, g, None, h0)]
    dbeta, dskip = np.empty_like(beta), np.empty_like(beta)
    with pyattn.num_threads(threads):
        pyattn._core.linear_backward(q, k, v, g, None, h0, do, dht, None, *out, *opts, beta, skip,
                                     dbeta, dskip)
    ref = _engine_backward((q, k, vb, g, None, h0, do, dht, opts), None, threads)
    for name, a, b in zip(("dq", "dk", "dg", "dh0"), [out[i] for i in (0, 1, 3, 5)],
                          [ref[i] for i in (0, 1, 3, 5)]):
        if a is not None:
            assert_close(a, b, 1e-13, name=name)
    assert_close(out[2], beta[..., None] * ref[2] + skip[:, None] * do, 1e-13, name="dv")
    assert_close(dbeta, np.einsum("bthv,bthv->bth", v, ref[2]), 1e-13, name="dbeta")
    assert_close(dskip, np.einsum("bthv,bthv->bth", v, do), 1e-13, name="dskip")


@pytest.mark.parametrize("gates", ["scalar", "vector"])
def test_engine_value_scale_one_long_unit(gates):
    """beta and skip on the chunk-parallel schedule (one unit of T=3000, K = V = 32, 4
    threads: fewer units than threads) in float32, under gates strong enough that a vector
    gate's blocks are not factored (sub-blocks): the same as the engine on beta v plus skip
    v; a NaN in beta at one row makes o NaN from that row on and leaves the rows before it."""
    r = np.random.default_rng(17)
    T, K, Vd = 3000, 32, 32
    q, k = (r.standard_normal((1, T, 1, K)).astype(np.float32) for _ in range(2))
    v = r.standard_normal((1, T, 1, Vd)).astype(np.float32)
    g = -r.uniform(0, 3, (1, T, 1) if gates == "scalar" else (1, T, 1, K)).astype(np.float32)
    beta = r.uniform(0.1, 2, (1, T, 1)).astype(np.float32)
    skip = np.array([0.7], np.float32)
    opts = (np.array([0, T], np.int64), pyattn._core.FORM_CHUNK, 64, 0.25)
    o, ob = np.empty_like(v), np.empty_like(v)
    with pyattn.num_threads(4):
        pyattn._core.linear_forward(q, k, v, g, None, None, o, None, False, *opts, beta, skip, False)
        pyattn._core.linear_forward(q, k, v * beta[..., None], g, None, None, ob, None, False,
                                    *opts, *_FWD_TAIL)
    assert_close(o, ob + skip[0] * v, 1e-6, name="o")
    beta[0, 1234, 0] = np.nan
    with pyattn.num_threads(4):
        pyattn._core.linear_forward(q, k, v, g, None, None, o, None, False, *opts, beta, skip, False)
    assert np.isnan(o[0, 1234:]).all()
    assert np.isfinite(o[0, :1234]).all()


def test_engine_value_options_checked():
    """beta takes no value gate; dbeta and dskip are given exactly with beta and skip; shapes."""
    r = np.random.default_rng(3)
    q = r.standard_normal((1, 5, 2, 4))
    v = r.standard_normal((1, 5, 2, 3))
    beta, skip, gv = r.uniform(size=(1, 5, 2)), r.standard_normal(2), -r.uniform(size=v.shape)
    opts = (np.array([0, 5], np.int64), pyattn._core.FORM_CHUNK, 64, 0.5)
    o = np.empty_like(v)
    raises(ValueError, pyattn._core.linear_forward, q, q, v, None, gv, None, o, None, False, *opts,
           beta, None, False, must=("'beta' needs gv None",))
    raises(ValueError, pyattn._core.linear_forward, q, q, v, None, None, None, o, None, False, *opts,
           beta[:, :4], None, False, must=("'beta'",))
    raises(ValueError, pyattn._core.linear_forward, q, q, v, None, None, None, o, None, False, *opts,
           None, skip[:1], False, must=("'skip'",))
    grads = [np.empty_like(x) for x in (q, q, v)]
    raises(ValueError, pyattn._core.linear_backward, q, q, v, None, None, None, v, None, None,
           *grads, None, None, None, *opts, None, skip, np.empty_like(beta), np.empty_like(beta),
           must=("'dbeta' must be None",))
    raises(TypeError, pyattn._core.linear_backward, q, q, v, None, None, None, v, None, None,
           *grads, None, None, None, *opts, beta, skip, np.empty_like(beta), None,
           must=("'dskip'",))


# ------------------------------------------------------------------------------- 13. groups of q and k


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("form", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("gates", ["scalar", "vector+gv"])
def test_engine_reads_grouped_q_and_k(gates, form, threads):
    """q and k with Hqk heads and v with H = 3 Hqk (Mamba-2's groups of B and C): head h reads
    q and k head h // 3. The engine on them equals the engine on q and k repeated to H heads,
    forward, and backward with dq and dk summed over each group's heads; with cu_seqlens, a
    ragged last chunk, one unit per thread or fewer units than threads."""
    r = np.random.default_rng(11)
    cu = np.array([0, 70, 70, 171], np.int64)
    N, Hqk, G, K, Vd, T = 3, 2, 3, 8, 6, 171
    H = Hqk * G
    q, k = (r.standard_normal((1, T, Hqk, K)) for _ in range(2))
    v = r.standard_normal((1, T, H, Vd))
    g = -r.uniform(0, 0.5, (1, T, H) if gates == "scalar" else (1, T, H, K))
    gv = -r.uniform(0, 0.5, (1, T, H, Vd)) if gates != "scalar" else None
    h0 = r.standard_normal((N, H, K, Vd))
    opts = (cu, getattr(pyattn._core, f"FORM_{form.upper()}"), 32, 0.5)
    qr, kr = (np.ascontiguousarray(np.repeat(x, G, axis=2)) for x in (q, k))
    outs = []
    for qq, kk in ((q, k), (qr, kr)):
        o, ht = np.empty_like(v), np.empty_like(h0)
        with pyattn.num_threads(threads):
            pyattn._core.linear_forward(qq, kk, v, g, gv, h0, o, ht, False, *opts, *_FWD_TAIL)
        outs.append((o, ht))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    do, dht = r.standard_normal(v.shape), r.standard_normal(h0.shape)
    grouped = _engine_backward((q, k, v, g, gv, h0, do, dht, opts), None, threads)
    repeated = _engine_backward((qr, kr, v, g, gv, h0, do, dht, opts), None, threads)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dgv", "dh0"), grouped, repeated):
        if name in ("dq", "dk"):
            b = b.reshape(1, T, Hqk, G, K).sum(axis=3)
        if a is not None:
            assert_close(a, b, 1e-13, name=name)


def test_engine_groups_must_divide_heads():
    """v's heads must be a multiple of q's, in both engines."""
    r = np.random.default_rng(3)
    q = r.standard_normal((1, 5, 2, 4))
    v = r.standard_normal((1, 5, 3, 4))
    opts = (np.array([0, 5], np.int64), pyattn._core.FORM_CHUNK, 64, 0.5)
    raises(ValueError, pyattn._core.linear_forward, q, q, v, None, None, None, np.empty_like(v),
           None, False, *opts, *_FWD_TAIL, must=("q and k have 2 heads", "H=3"))
    beta = r.uniform(size=(1, 5, 3))
    raises(ValueError, pyattn._core.delta_forward, q, q, v, None, beta, None, np.empty_like(v),
           None, False, *opts, False, must=("q and k have 2 heads", "H=3"))


def test_mamba2_without_heads_has_zero_group_gradients():
    """H = 0 heads over G = 1 group (H % G == 0): an empty output, and B and C, which no head
    reads, get zero gradients."""
    r = np.random.default_rng(5)
    x, dt = np.zeros((1, 6, 0, 2)), np.zeros((1, 6, 0))
    B, C = r.standard_normal((1, 6, 1, 3)), r.standard_normal((1, 6, 1, 3))
    (y, ht), pb = pyattn.vjp(pyattn.mamba2, x, dt, np.zeros(0), B, C)
    assert y.shape == (1, 6, 0, 2) and ht is None
    g = pb(np.zeros_like(y))
    np.testing.assert_array_equal(g["B"], np.zeros_like(B))
    np.testing.assert_array_equal(g["C"], np.zeros_like(C))


@pytest.mark.parametrize("threads", [1, 2])
def test_subnormal_flush_ends_with_the_call(threads):
    """The linear and delta engines flush subnormals to zero while they run (x86 takes a
    microcode assist for each one, and strong decays make thousands of them); the results
    under such decays stay within float32's tolerance of the float64 oracle, and the calling
    thread's floating-point mode is the same afterwards: NumPy still produces subnormals."""
    r = np.random.default_rng(2)
    q, v = (r.standard_normal((1, 80, 2, 8)) for _ in range(2))
    k = r.standard_normal((1, 80, 2, 8))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -r.uniform(1, 8, (1, 80, 2))
    beta = r.uniform(0, 1, (1, 80, 2))
    tiny = np.float32(1e-38)
    assert tiny * np.float32(1e-3) > 0  # subnormal arithmetic before the calls
    f32 = [x.astype(np.float32) for x in (q, k, v, g, beta)]
    with pyattn.num_threads(threads):
        o = pyattn.simple_gla(*f32[:4], form="chunk", chunk_size=16)[0]
        od = pyattn.gated_delta_rule(*f32, form="chunk", chunk_size=16)[0]
    assert tiny * np.float32(1e-3) > 0
    assert_close(o, reference.simple_gla(q, k, v, g)[0], 1e-5, name="simple_gla")
    assert_close(od, reference.gated_delta_rule(q, k, v, g, beta)[0], 1e-5, name="gated_delta_rule")


# ------------------------------------------------------------------------------- 14. rows 4 KiB apart


@pytest.mark.parametrize("form", ["chunk", "parallel"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("op", ["linear_attention", "simple_gla", "gla"])
def test_rows_4kib_apart_equal_one_head_at_a_time(op, dtype, form):
    """With H K = 4096 bytes (float32 H=8, K=V=128; float64 H=4), a row of q, k, v or do lies
    4 KiB after the previous one, which the kernels copy into contiguous rows before their
    products rather than reading in place; one head at a time (H=1) the rows are read in
    place. The outputs, final states and every gradient must be the same bits either way,
    over three chunks with a ragged last one."""
    r = np.random.default_rng(5)
    dt = np.dtype(dtype)
    H, T, K = 4096 // (128 * dt.itemsize), 150, 128
    q, k, v, do = (r.standard_normal((1, T, H, K)).astype(dt) * 0.3 for _ in range(4))
    h0, dht = (r.standard_normal((1, H, K, K)).astype(dt) for _ in range(2))
    gate = {"linear_attention": None, "simple_gla": (1, T, H), "gla": (1, T, H, K)}[op]
    g = None if gate is None else -r.uniform(0.01, 0.2, gate).astype(dt)

    def run(sl):
        args = [q[:, :, sl], k[:, :, sl], v[:, :, sl]] + ([] if g is None else [g[:, :, sl]])
        args = [np.ascontiguousarray(a) for a in args]
        out, pb = pyattn.vjp(getattr(pyattn, op), *args, initial_state=np.ascontiguousarray(h0[:, sl]),
                             output_final_state=True, form=form)
        grads = pb((np.ascontiguousarray(do[:, :, sl]), np.ascontiguousarray(dht[:, sl])))
        return out, grads

    whole_out, whole_grads = run(slice(None))
    for h in range(H):
        out, grads = run(slice(h, h + 1))
        np.testing.assert_array_equal(whole_out[0][:, :, h:h + 1], out[0])
        np.testing.assert_array_equal(whole_out[1][:, h:h + 1], out[1])
        for name, x in grads.items():
            whole = whole_grads[name]
            part = whole[:, h:h + 1] if name == "initial_state" else whole[:, :, h:h + 1]
            np.testing.assert_array_equal(part, x, err_msg=name)

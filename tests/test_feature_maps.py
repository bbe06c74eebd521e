"""pyattn.feature_map: every kind x dtype against the float64 oracle pyattn.reference.feature_map
(docs/ops.md), its gradients, its edge cases, its errors (public API and pyattn._core
directly), the thread count, and every ISA path.

Gradients: central finite differences (pyattn.testing.gradcheck, float64) on small shapes
whose D covers a vector body and a ragged tail on every ISA (D = 19: 16 + 3 float lanes on
AVX-512); directional finite differences on larger ones (several performer GEMM blocks, the
chunked elementwise path); an explicit NumPy formula for performer's dW summed over many row
blocks; float32 gradients against float64 ones within 1e-4.
"""
from __future__ import annotations

import functools
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import pyattn
from pyattn import _core, reference
from pyattn.feature_maps import KINDS
from pyattn.testing import TOLERANCES, assert_close, gradcheck

from conftest import case_params, f32_exact, raises, run_bad_arg_case

DTYPES = (np.float64, np.float32)
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
F64 = np.float64


def tol_out(dtype):
    return TOLERANCES[np.dtype(dtype)][0]


def inputs(kind, shape, seed, *, m=12, p=3, max_len=None, scale=1.0):
    """(x, params) in float64, float32-representable, so one oracle serves both dtypes.
    performer's x is scaled by D**-0.25 (FAVOR+'s data normaliser), as in use."""
    r = np.random.default_rng(seed)
    D = shape[-1]
    if kind == "performer":
        scale = scale * D ** -0.25
    x = f32_exact(scale * r.standard_normal(shape))
    params = {}
    if kind == "performer":
        params["projection"] = f32_exact(r.standard_normal((m, D)))
    elif kind == "focused":
        params["p"] = p
    elif kind == "cosformer" and max_len is not None:
        params["max_len"] = max_len
    return x, params


def cast(params, dtype):
    return {k: v.astype(dtype) if isinstance(v, np.ndarray) else v for k, v in params.items()}


def out_features(kind, D, m=12):
    return {"taylor": 1 + D + D * D, "performer": m, "cosformer": 2 * D}.get(kind, D)


def run_vjp(x, kind, params, dy):
    y, pullback = pyattn.vjp(pyattn.feature_map, x, kind, **params)
    return y, pullback(dy)


# ------------------------------------------------------------------------------- forward

# 4-D [B, T, H, D] (every kind takes these): D = 1, D below one vector, a vector body with a
# tail on every ISA, exact multiples of the vector widths, rows > the performer GEMM block
SHAPES = [(1, 1, 1, 1), (2, 3, 1, 1), (1, 5, 2, 3), (2, 9, 3, 17), (2, 4, 2, 64),
          (1, 3, 1, 130), (1, 300, 2, 33), (3, 7, 2, 8)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", KINDS)
def test_forward_vs_oracle(kind, shape, dtype):
    x, params = inputs(kind, shape, seed=sum(shape) + len(kind))
    ref = reference.feature_map(x, kind, **params)
    y = pyattn.feature_map(x.astype(dtype), kind, **cast(params, dtype))
    assert y.dtype == dtype
    assert y.shape == shape[:-1] + (out_features(kind, shape[-1]),)
    assert np.all(np.isfinite(y))
    assert_close(y, ref, tol_out(dtype), name=f"{kind} y")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("shape", [(7,), (5, 13), (3, 4, 9), (2, 1, 3, 2, 5), (40, 100)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "cosformer"])
def test_forward_any_rank(kind, shape, dtype):
    """Every kind but cosformer maps the last axis of an array of any rank >= 1."""
    x, params = inputs(kind, shape, seed=len(shape) + shape[-1])
    y = pyattn.feature_map(x.astype(dtype), kind, **cast(params, dtype))
    assert_close(y, reference.feature_map(x, kind, **params), tol_out(dtype), name=f"{kind} y")


@pytest.mark.parametrize("p", [1, 2, 3, 4, 7, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_focused_powers(p, dtype):
    x, params = inputs("focused", (2, 6, 2, 19), seed=p, p=p)
    y = pyattn.feature_map(x.astype(dtype), "focused", p=p)
    assert_close(y, reference.feature_map(x, "focused", p=p), tol_out(dtype))


@pytest.mark.parametrize("max_len", [None, 1, 3, 2.5, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_cosformer_max_len(max_len, dtype):
    """Positions run along axis 1 (B and H > 1 here); max_len may be below T (angles past
    pi / 2) or a float; None means T."""
    x, params = inputs("cosformer", (2, 11, 3, 5), seed=4, max_len=max_len)
    y = pyattn.feature_map(x.astype(dtype), "cosformer", **params)
    assert_close(y, reference.feature_map(x, "cosformer", **params), tol_out(dtype))
    if max_len is None:
        np.testing.assert_array_equal(y, pyattn.feature_map(x.astype(dtype), "cosformer", max_len=11))


@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_input(kind):
    x, params = inputs(kind, (2, 6, 3, 5), seed=9)
    xt = np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert not xt.flags.c_contiguous
    np.testing.assert_array_equal(pyattn.feature_map(xt, kind, **params),
                                  pyattn.feature_map(x, kind, **params))


def test_feature_map_exported():
    assert "feature_map" in pyattn.__all__
    assert pyattn.feature_map is pyattn.feature_maps.feature_map


# ------------------------------------------------------------------------------- gradients


GRAD_SHAPES = [(2, 3, 2, 5), (1, 3, 1, 19), (1, 1, 1, 1)]


@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck(kind, shape):
    x, params = inputs(kind, shape, seed=3 + sum(shape), m=5, max_len=7)
    errs = gradcheck(pyattn.feature_map, (x, kind), params)
    assert set(errs) == ({"x", "projection"} if kind == "performer" else {"x"})


@pytest.mark.parametrize("p", [1, 2, 5])
def test_gradcheck_focused_powers(p):
    x, params = inputs("focused", (3, 2, 1, 11), seed=p, p=p)
    gradcheck(pyattn.feature_map, (x, "focused"), params)


def test_gradcheck_cosformer_default_max_len():
    x, params = inputs("cosformer", (2, 5, 2, 3), seed=8)
    gradcheck(pyattn.feature_map, (x, "cosformer"), params)


def _loss(x, kind, params, dy):
    return float(np.sum(pyattn.feature_map(x, kind, **params) * dy))


# [B, T, H, D]: > FM_CHUNK (4096) elements for the chunked elementwise kinds, > 256 rows for
# performer's row blocks
DIRECTIONAL_SHAPES = [(2, 100, 3, 17), (1, 600, 1, 9)]


@pytest.mark.parametrize("shape", DIRECTIONAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", KINDS)
def test_directional_derivative(kind, shape):
    """<grad, v> equals the central difference of sum(phi(x) * dy) along a random direction
    v of every differentiable input (float64). The bound is relative to |grad| |v|, the
    largest the derivative can be: eps = 1e-6 leaves errors near 1e-12 of it, a wrong row or
    vector tail shows at 1e-3 and above."""
    x, params = inputs(kind, shape, seed=len(kind), m=20)
    r = np.random.default_rng(1)
    F = out_features(kind, shape[-1], m=20)
    dy = r.standard_normal(shape[:-1] + (F,))
    _, grads = run_vjp(x, kind, params, dy)
    vx = r.standard_normal(x.shape)
    vw = r.standard_normal(params["projection"].shape) if kind == "performer" else None
    exact = float(np.sum(grads["x"] * vx))
    if vw is not None:
        exact += float(np.sum(grads["projection"] * vw))
    eps = 1e-6

    def shifted(sign):
        p = dict(params)
        if vw is not None:
            p["projection"] = params["projection"] + sign * eps * vw
        return _loss(x + sign * eps * vx, kind, p, dy)

    numeric = (shifted(1) - shifted(-1)) / (2 * eps)
    scale = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()) * vx.size)
    assert abs(exact - numeric) <= 1e-9 * scale, (exact, numeric, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_performer_many_blocks_vs_numpy(dtype):
    """16,800 rows: 66 row blocks of 256, grouped into 33 parts whose dW are summed at the end;
    y, dx and dW against the NumPy formulas on the float64 oracle's y."""
    x, params = inputs("performer", (1, 4200, 4, 6), seed=5, m=16)
    W = params["projection"]
    dy = f32_exact(np.random.default_rng(6).standard_normal((1, 4200, 4, 16)))
    y_ref = reference.feature_map(x, "performer", projection=W)
    g = dy * y_ref
    dx_ref = g @ W - x * g.sum(-1, keepdims=True)
    dw_ref = g.reshape(-1, 16).T @ x.reshape(-1, 6)
    y, grads = run_vjp(x.astype(dtype), "performer", cast(params, dtype), dy.astype(dtype))
    tol_grad = TOLERANCES[np.dtype(dtype)][1]
    assert_close(y, y_ref, tol_out(dtype), name="y")
    assert_close(grads["x"], dx_ref, tol_grad, name="dx")
    assert_close(grads["projection"], dw_ref, tol_grad, name="dprojection")


@pytest.mark.parametrize("shape", [(2, 9, 3, 17), (1, 300, 2, 33), (2, 5, 1, 1)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", KINDS)
def test_float32_grads_vs_float64(kind, shape):
    x, params = inputs(kind, shape, seed=11 + shape[-1])
    F = out_features(kind, shape[-1])
    dy = f32_exact(np.random.default_rng(2).standard_normal(shape[:-1] + (F,)))
    _, g64 = run_vjp(x, kind, params, dy)
    _, g32 = run_vjp(x.astype(np.float32), kind, cast(params, np.float32), dy.astype(np.float32))
    assert set(g32) == set(g64)
    for name in g64:
        assert g32[name].dtype == np.float32
        assert_close(g32[name], g64[name], TOLERANCES[np.dtype(np.float32)][1], name=f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("kind", KINDS)
def test_zero_cotangent(kind, dtype):
    x, params = inputs(kind, (1, 4, 2, 5), seed=1)
    _, pullback = pyattn.vjp(pyattn.feature_map, x.astype(dtype), kind, **cast(params, dtype))
    for g in pullback(None).values():
        assert g.dtype == dtype and np.all(g == 0)


# ------------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("kind", ["relu", "focused", "cosformer"])
def test_all_negative_gives_zeros(kind, dtype):
    x = -np.abs(inputs(kind, (2, 3, 2, 7), seed=2)[0]) - 0.1
    x[0, 0, 0, :3] = 0.0  # zeros are not positive either: relu(0) = 0, subgradient 0
    x = x.astype(dtype)
    y, pullback = pyattn.vjp(pyattn.feature_map, x, kind)
    assert np.all(y == 0)
    dx = pullback(np.ones_like(y))["x"]
    assert np.all(np.isfinite(dx)) and np.all(dx == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_focused_mixed_rows(dtype):
    """Rows with no positive entry are 0 next to rows that have some."""
    x, _ = inputs("focused", (1, 6, 2, 9), seed=3)
    x[0, ::2] = -np.abs(x[0, ::2])
    y, pullback = pyattn.vjp(pyattn.feature_map, x.astype(dtype), "focused")
    assert_close(y, reference.feature_map(x, "focused"), tol_out(dtype))
    assert np.all(y[0, ::2] == 0) and np.all(np.abs(y[0, 1::2]).sum(-1) > 0)
    dx = pullback(np.ones_like(y))["x"]
    assert np.all(np.isfinite(dx)) and np.all(dx[0, ::2] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("magnitude", [1e2, 1e4, 1e30])
@pytest.mark.parametrize("kind", ["softmax", "elu1"])
def test_large_inputs_do_not_overflow(kind, magnitude, dtype):
    """exp(x) of a float32 overflows past 88.7, of a float64 past 709: softmax subtracts the
    row max, elu1 takes exp only of min(x, 0)."""
    x = f32_exact(magnitude * np.random.default_rng(4).standard_normal((3, 5, 2, 21)))
    x[0, 0, 0, :] = magnitude  # a row of ties at the maximum
    y, pullback = pyattn.vjp(pyattn.feature_map, x.astype(dtype), kind)
    assert np.all(np.isfinite(y))
    assert_close(y, reference.feature_map(x, kind), tol_out(dtype))
    if kind == "softmax":
        np.testing.assert_allclose(y.sum(-1), 1, rtol=30 * np.finfo(dtype).eps)
    dx = pullback(np.ones_like(y))["x"]
    assert np.all(np.isfinite(dx))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("magnitude", [2.0 ** -50, 2.0 ** -20, 2.0 ** 20, 2.0 ** 50])
def test_focused_scale_range(magnitude, dtype):
    """r**p of a float32 overflows for r > 2e12 (p = 3) and vanishes below 1e-13: focused
    works on r / max(r), so it follows the float64 oracle across the whole range. phi is
    homogeneous of degree 1 and a power-of-two scale is exact, so phi(c x) = c phi(x) and
    the gradient (degree 0) is unchanged, bit for bit."""
    x, _ = inputs("focused", (2, 5, 2, 13), seed=6)
    xs = x * magnitude
    y, pullback = pyattn.vjp(pyattn.feature_map, xs.astype(dtype), "focused")
    assert_close(y, reference.feature_map(xs, "focused"), tol_out(dtype), atol=0.0)
    dy = np.random.default_rng(7).standard_normal(y.shape).astype(dtype)
    dx = pullback(dy)["x"]
    y1, g1 = run_vjp(x.astype(dtype), "focused", {}, dy)
    np.testing.assert_array_equal(y, y1 * dtype(magnitude))
    np.testing.assert_array_equal(dx, g1["x"])


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_performer_large_x_underflows_to_zero(dtype):
    """|x|^2 / 2 far above |W x|: the features underflow to 0, never NaN or inf."""
    x, params = inputs("performer", (1, 8, 2, 16), seed=7, scale=100.0)
    y, pullback = pyattn.vjp(pyattn.feature_map, x.astype(dtype), "performer", **cast(params, dtype))
    assert np.all(np.isfinite(y)) and np.all(y >= 0)
    assert_close(y, reference.feature_map(x, "performer", **params), tol_out(dtype))
    grads = pullback(np.ones_like(y))
    assert all(np.all(np.isfinite(g)) for g in grads.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("kind", KINDS)
def test_d_equals_one(kind, dtype):
    x, params = inputs(kind, (3, 4, 2, 1), seed=12, m=3)
    y, grads = run_vjp(x.astype(dtype), kind, cast(params, dtype),
                       np.ones((3, 4, 2, out_features(kind, 1, m=3)), dtype))
    assert_close(y, reference.feature_map(x, kind, **params), tol_out(dtype))
    if kind == "softmax":  # one feature: phi = 1, gradient exactly 0
        assert np.all(y == 1) and np.all(grads["x"] == 0)
    if kind == "taylor":
        np.testing.assert_array_equal(y[..., 1], x[..., 0].astype(dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_empty_rows(kind):
    """No rows (B = 0 or T = 0): empty outputs and gradients; performer's dW is 0."""
    for shape in ((0, 5, 2, 4), (2, 0, 3, 4)):
        x, params = inputs(kind, shape, seed=0, m=3)
        y, grads = run_vjp(x, kind, params, np.zeros(shape[:-1] + (out_features(kind, 4, m=3),)))
        assert y.shape == shape[:-1] + (out_features(kind, 4, m=3),)
        assert grads["x"].shape == shape
        if kind == "performer":
            assert grads["projection"].shape == (3, 4) and np.all(grads["projection"] == 0)


# ------------------------------------------------------------------------------- threads


def _work(kind, rows, D, m=0, p=3, backward=False):
    """The kernels' own estimate of a call's multiply-adds (ops/feature_maps.c fm_work): about
    one thread per million of them."""
    w = {"elu1": 16 * rows * D, "softmax": 16 * rows * D,
         "focused": rows * D * (4 + 2 * math.log2(p + 1)), "taylor": rows * D * (D + 1),
         "performer": rows * m * (D + 16) * (1.5 if backward else 1),
         "cosformer": 2 * rows * D}.get(kind, rows * D)
    return 2 * w if backward else w


# enough work for two threads in every kind; performer's backward has 33 row parts
THREAD_SHAPES = {"identity": (4, 512, 8, 128), "relu": (4, 512, 8, 128), "elu1": (2, 128, 4, 130),
                 "softmax": (2, 128, 4, 130), "focused": (2, 512, 4, 65), "taylor": (2, 128, 8, 33),
                 "performer": (1, 4200, 4, 24), "cosformer": (2, 512, 8, 129)}


@pytest.mark.parametrize("kind", KINDS)
def test_thread_shapes_have_work_for_two_threads(kind):
    shape = THREAD_SHAPES[kind]
    rows = math.prod(shape[:-1])
    assert _work(kind, rows, shape[-1], m=24) >= 2e6
    assert rows * shape[-1] >= 2 * 4096 and rows >= 2


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("kind", KINDS)
def test_thread_count_does_not_change_results(kind, dtype):
    shape = THREAD_SHAPES[kind]
    x, params = inputs(kind, shape, seed=13, m=24)
    x, params = x.astype(dtype), cast(params, dtype)
    dy = np.random.default_rng(3).standard_normal(shape[:-1] + (out_features(kind, shape[-1], m=24),))
    dy = dy.astype(dtype)
    results = []
    for n in (1, 2, 3):
        with pyattn.num_threads(n):
            y, grads = run_vjp(x, kind, params, dy)
        results.append({"y": y, **grads})
    for key, one in results[0].items():
        assert not np.any(np.isnan(one)), key
        for other in results[1:]:
            np.testing.assert_array_equal(other[key], one, err_msg=key)


# ------------------------------------------------------------------------------- ISA paths


def isa_selfcheck(expected):
    """Run in a subprocess with PYATTN_ISA set: every kind and dtype forward against the
    oracle, float64 gradients by finite differences and float32 gradients against float64,
    with D covering vector bodies and tails of 16- and 32-byte vectors too."""
    assert pyattn.build_info()["isa"] == expected
    for kind in KINDS:
        for shape in ((2, 3, 2, 19), (1, 300, 1, 7)):
            x, params = inputs(kind, shape, seed=shape[-1], m=9)
            ref = reference.feature_map(x, kind, **params)
            dy = f32_exact(np.random.default_rng(0).standard_normal(ref.shape))
            _, g64 = run_vjp(x, kind, params, dy)
            for dtype in DTYPES:
                y, g = run_vjp(x.astype(dtype), kind, cast(params, dtype), dy.astype(dtype))
                assert_close(y, ref, tol_out(dtype), name=f"{expected} {kind} y")
                for name in g64:
                    assert_close(g[name], g64[name], TOLERANCES[np.dtype(dtype)][1],
                                 name=f"{expected} {kind} d{name}")
        x, params = inputs(kind, (1, 2, 1, 19), seed=1, m=4)
        gradcheck(pyattn.feature_map, (x, kind), params)
    print("ISA-OK", expected)


@pytest.mark.parametrize("isa", pyattn.build_info()["isas_available"])
def test_isa_path(isa):
    env = dict(os.environ, PYATTN_ISA=isa)
    code = (f"import sys; sys.path.insert(0, {TESTS_DIR!r}); import test_feature_maps; "
            f"test_feature_maps.isa_selfcheck({isa!r})")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, f"PYATTN_ISA={isa} failed:\n{res.stdout}\n{res.stderr}"
    assert f"ISA-OK {isa}" in res.stdout


# ------------------------------------------------------------------------------- bad input


fm = pyattn.feature_map


def x4(dtype=F64, shape=(2, 3, 2, 4)):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("kind", ["bogus", "ReLU", "", None, 3, ("relu",)])
def test_bad_kind(kind):
    raises(ValueError, fm, x4(), kind, must=("'kind'", repr(kind)) + tuple(f"'{k}'" for k in KINDS))


@pytest.mark.parametrize("kind,param", [("relu", "p"), ("identity", "projection"), ("focused", "max_len"),
                                        ("performer", "p"), ("cosformer", "projection"), ("softmax", "scale")])
def test_unknown_param(kind, param):
    kw = {param: 1}
    if kind == "performer":
        kw["projection"] = np.ones((3, 4))
    raises(TypeError, fm, x4(), kind, must=(f"'{param}'", repr(kind)), **kw)
    raises(TypeError, pyattn.vjp, fm, x4(), kind, must=(f"'{param}'",), **kw)


def test_performer_needs_projection():
    raises(ValueError, fm, x4(), "performer", must=("'projection'", "[m, D]"))
    raises(ValueError, fm, x4(), "performer", projection=None, must=("'projection'",))


@pytest.mark.parametrize("W,shown", [(np.ones(4), "(4,)"), (np.ones((3, 5)), "(3, 5)"),
                                     (np.ones((0, 4)), "(0, 4)"), (np.ones((2, 3, 4)), "(2, 3, 4)")])
def test_bad_projection_shape(W, shown):
    raises(ValueError, fm, x4(), "performer", projection=W, must=("'projection'", shown, "4"))


def test_bad_projection_type_and_dtype():
    raises(TypeError, fm, x4(), "performer", projection=[["a"] * 4], must=("'projection'", "array", "list"))
    raises(TypeError, fm, x4(), "performer", projection=np.ones((3, 4), np.int64), must=("'projection'", "int64"))
    raises(TypeError, fm, x4(), "performer", projection=np.ones((3, 4), np.float32),
           must=("'projection'", "'x'", "float32", "float64"))
    raises(TypeError, fm, x4(np.float32), "performer", projection=np.ones((3, 4)),
           must=("'projection'", "float32", "float64"))


@pytest.mark.parametrize("p,exc", [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError),
                                   ("3", TypeError), (None, TypeError), (3.0, TypeError)])
def test_bad_p(p, exc):
    raises(exc, fm, x4(), "focused", p=p, must=("'p'",) + ((">= 1", str(p)) if exc is ValueError else ("int",)))


def test_numpy_int_p_accepted():
    np.testing.assert_array_equal(fm(x4(), "focused", p=np.int64(2)), fm(x4(), "focused", p=2))


@pytest.mark.parametrize("max_len,exc,shown", [(0, ValueError, "0"), (-1.0, ValueError, "-1"),
                                               (float("nan"), ValueError, "nan"), (float("inf"), ValueError, "inf"),
                                               ("5", TypeError, "str"), (True, TypeError, "bool"),
                                               (np.ones(1), TypeError, "ndarray")])
def test_bad_max_len(max_len, exc, shown):
    raises(exc, fm, x4(), "cosformer", max_len=max_len, must=("'max_len'", shown))


@pytest.mark.parametrize("dtype", [np.float16, np.int64, np.complex128, np.bool_, np.longdouble, ">f2"])
def test_bad_x_dtype(dtype):
    raises(TypeError, fm, x4().astype(dtype), "relu", must=("'x'", "float32 or float64", str(np.dtype(dtype))))


@pytest.mark.parametrize("bad", [None, "x", True], ids=["None", "str", "bool"])
def test_x_not_an_array(bad):
    raises(TypeError, fm, bad, "relu", must=("'x'", "array", type(bad).__name__))


def test_x_array_likes_converted():
    np.testing.assert_array_equal(fm([1.0, -2.0], "relu"), np.array([1.0, 0.0]))
    raises(ValueError, fm, 3.0, "relu", must=("'x'", "1-D", "shape ()"))


def test_bad_x_shape():
    raises(ValueError, fm, np.ones(()), "relu", must=("'x'", "1-D", "shape ()"))
    raises(ValueError, fm, np.ones((2, 3, 4)), "cosformer", must=("'x'", "4-D", "(2, 3, 4)"))
    raises(ValueError, fm, np.ones((2, 3, 4, 5, 6)), "cosformer", must=("'x'", "4-D"))
    for kind in KINDS:
        kw = {"projection": np.ones((3, 0))} if kind == "performer" else {}
        raises(ValueError, fm, np.ones((2, 3, 2, 0)), kind, must=("'x'", "D >= 1", "(2, 3, 2, 0)"), **kw)


def test_vjp_cotangent_errors():
    y, pullback = pyattn.vjp(fm, x4(), "taylor")
    raises(ValueError, pullback, y[..., :5], must=("'dy'", str(y.shape), str(y[..., :5].shape)))
    raises(TypeError, pullback, y.astype(np.float32), must=("'dy'", "float32", "float64"))
    raises(TypeError, pullback, y.astype(np.int64), must=("'dy'", "int64"))
    raises(TypeError, pullback, "1.0", must=("'dy'", "array", "str"))
    raises(ValueError, pullback, 1.0, must=("'dy'", str(y.shape), "()"))
    raises(ValueError, pullback, (y, y), must=("cotangent", "1", "2"))


def test_vjp_bad_inputs_raise_like_forward():
    raises(ValueError, pyattn.vjp, fm, x4(), "nope", must=("'kind'",))
    raises(ValueError, pyattn.vjp, fm, x4(), "performer", must=("'projection'",))
    raises(TypeError, pyattn.vjp, fm, x4(np.float32), "performer", projection=np.ones((2, 4)),
           must=("'projection'", "float32"))


# ======================================================================= pyattn._core directly
#
# feature_map_forward(x, y, kind, p, max_len, projection_or_None)
# feature_map_backward(x, dy, dx, kind, p, max_len, projection_or_None, dprojection_or_None)

B, T, H, D, M = 2, 5, 3, 4, 6


def fwd_args(kind="performer", dtype=F64):
    x = x4(dtype, (B, T, H, D))
    F = out_features(kind, D, m=M)
    W = np.ones((M, D), dtype) * 0.1 if kind == "performer" else None
    return [x, np.zeros((B, T, H, F), dtype), getattr(_core, "FM_" + kind.upper()), 3, 5.0, W]


def bwd_args(kind="performer", dtype=F64):
    x, y, code, p, max_len, W = fwd_args(kind, dtype)
    dW = np.zeros_like(W) if W is not None else None
    return [x, np.ones_like(y), np.zeros_like(x), code, p, max_len, W, dW]


FWD_NAMES = ["x", "y", "kind", "p", "max_len", "projection"]
BWD_NAMES = ["x", "dy", "dx", "kind", "p", "max_len", "projection", "dprojection"]


@pytest.mark.parametrize("kind", KINDS)
def test_core_direct_good_calls_work(kind):
    args = fwd_args(kind)
    assert _core.feature_map_forward(*args) is None
    params = {"performer": {"projection": args[5]}, "focused": {"p": 3}, "cosformer": {"max_len": 5.0}}.get(kind, {})
    y, pullback = pyattn.vjp(fm, args[0], kind, **params)
    np.testing.assert_array_equal(args[1], y)
    args = bwd_args(kind)
    assert _core.feature_map_backward(*args) is None
    grads = pullback(args[1])
    np.testing.assert_array_equal(args[2], grads["x"])
    if kind == "performer":
        np.testing.assert_array_equal(args[7], grads["projection"])


@pytest.mark.parametrize("fn,n", [(_core.feature_map_forward, 6), (_core.feature_map_backward, 8)])
def test_core_wrong_argument_count(fn, n):
    args = (fwd_args if n == 6 else bwd_args)()
    for m in (0, n - 1, n + 1):
        call = (args + [None])[:m]
        raises(TypeError, fn, *call, must=(f"{n} positional arguments", f"got {m}"))
    with pytest.raises(TypeError):
        fn(*args, extra=1)


def _bad_core_cases(names, make, outputs):
    """(id, index, bad value, exception or None for 'must succeed', message parts)"""
    idx = {n: i for i, n in enumerate(names)}
    base = make()
    cases = []
    for name in [n for n in names if n in ("x", "y", "dy", "dx", "projection", "dprojection")]:
        a, i = base[idx[name]], idx[name]
        # x sets the dtype and the shapes of the call (and the projection's m, y's features),
        # so a wrong one of them is reported at the first argument that then disagrees
        later = {("x", "float32"): "projection", ("x", "last-dim"): "projection",
                 ("x", "first-dim"): names[1], ("x", "ndim"): names[1],
                 ("projection", "first-dim"): names[1]}
        shown = {v: f"'{later.get((name, v), name)}'" for v in ("float32", "first-dim", "last-dim", "ndim")}
        cases += [
            (f"{name}-list", i, a.tolist(), TypeError, (f"'{name}'", "numpy.ndarray", "list")),
            (f"{name}-float32", i, a.astype(np.float32), TypeError, (shown["float32"], "float32", "float64")),
            (f"{name}-int64", i, a.astype(np.int64), TypeError, (f"'{name}'", "int64")),
            (f"{name}-noncontig", i, np.asfortranarray(a), ValueError, (f"'{name}'", "C-contiguous")),
            (f"{name}-byteswapped", i, a.astype(">f8"), (TypeError, ValueError), (f"'{name}'",)),
            (f"{name}-first-dim", i, a[:1].copy(), ValueError, (shown["first-dim"], "shape")),
            (f"{name}-last-dim", i, a[..., :-1].copy(), ValueError, (shown["last-dim"], "shape")),
            (f"{name}-ndim", i, a[None].copy(), ValueError, (shown["ndim"], "shape")),
        ]
        ro = a.copy()
        ro.flags.writeable = False
        if name in outputs:
            cases.append((f"{name}-readonly", i, ro, ValueError, (f"'{name}'", "writeable")))
        else:
            cases.append((f"{name}-readonly-ok", i, ro, None, ()))
    cases += [
        ("kind--1", idx["kind"], -1, ValueError, ("'kind'", "[0, 7]", "-1")),
        ("kind-8", idx["kind"], 8, ValueError, ("'kind'", "8")),
        ("kind-str", idx["kind"], "performer", TypeError, ("'kind'", "int", "str")),
        ("kind-other", idx["kind"], _core.FM_RELU, ValueError, ("'projection'", "None", "'relu'")),
        ("p-0", idx["p"], 0, ValueError, ("'p'", "0")),
        ("p-float", idx["p"], 3.0, TypeError, ("'p'", "int", "float")),
        ("p-huge", idx["p"], 2 ** 70, ValueError, ("'p'", str(2 ** 70))),
        ("max_len-0", idx["max_len"], 0.0, ValueError, ("'max_len'", "> 0")),
        ("max_len-neg", idx["max_len"], -1.0, ValueError, ("'max_len'", "-1")),
        ("max_len-nan", idx["max_len"], float("nan"), ValueError, ("'max_len'", "nan")),
        ("max_len-str", idx["max_len"], "5", TypeError, ("'max_len'", "float", "str")),
        ("projection-None", idx["projection"], None, TypeError, ("'projection'", "numpy.ndarray", "NoneType")),
        ("projection-m0", idx["projection"], np.ones((0, D)), ValueError, ("'projection'", "m >= 1")),
        ("projection-D", idx["projection"], np.ones((M, D + 1)), ValueError,
         ("'projection'", f"(-1, {D})", f"({M}, {D + 1})")),
    ]
    if "dprojection" in idx:
        cases += [("dprojection-None", idx["dprojection"], None, TypeError, ("'dprojection'", "numpy.ndarray")),
                  ("dprojection-m", idx["dprojection"], np.ones((M + 1, D)), ValueError,
                   ("'dprojection'", f"({M}, {D})", f"({M + 1}, {D})"))]
    return cases


FWD_CASES = _bad_core_cases(FWD_NAMES, fwd_args, outputs=("y",))
BWD_CASES = _bad_core_cases(BWD_NAMES, bwd_args, outputs=("dx", "dprojection"))


@pytest.mark.parametrize("case", case_params(FWD_CASES))
def test_core_feature_map_forward_bad_args(case):
    _, index, bad, exc, must = case
    run_bad_arg_case(_core.feature_map_forward, fwd_args, index, bad, exc, must)


@pytest.mark.parametrize("case", case_params(BWD_CASES))
def test_core_feature_map_backward_bad_args(case):
    _, index, bad, exc, must = case
    run_bad_arg_case(_core.feature_map_backward, bwd_args, index, bad, exc, must)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "performer"])
def test_core_output_features_per_kind(kind):
    """y and dy must have exactly F features for the kind: F - 1 and F + 1 are refused."""
    for fn, make, pos, name in ((_core.feature_map_forward, fwd_args, 1, "y"),
                                (_core.feature_map_backward, bwd_args, 1, "dy")):
        for delta in (-1, 1):
            args = make(kind)
            F = out_features(kind, D)
            args[pos] = np.zeros((B, T, H, F + delta))
            raises(ValueError, fn, *args, must=(f"'{name}'", f"({B}, {T}, {H}, {F})"))


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "performer"])
def test_core_projection_only_for_performer(kind):
    args = fwd_args(kind)
    args[5] = np.ones((M, D))
    raises(ValueError, _core.feature_map_forward, *args, must=("'projection'", "None", f"'{kind}'"))
    args = bwd_args(kind)
    args[7] = np.ones((M, D))
    raises(ValueError, _core.feature_map_backward, *args, must=("'dprojection'", "None", f"'{kind}'"))


def test_core_x_rank_and_size():
    args = fwd_args("relu")
    args[0], args[1] = np.ones(()), np.ones(())
    raises(ValueError, _core.feature_map_forward, *args, must=("'x'", "1-D", "shape ()"))
    args = fwd_args("cosformer")
    args[0], args[1] = np.ones((B * T, H, D)), np.ones((B * T, H, 2 * D))
    raises(ValueError, _core.feature_map_forward, *args, must=("'x'", "4-D", f"({B * T}, {H}, {D})"))
    args = fwd_args("relu")
    args[0], args[1] = np.ones((B, T, H, 0)), np.ones((B, T, H, 0))
    raises(ValueError, _core.feature_map_forward, *args, must=("'x'", "D >= 1", "D=0"))
    # an empty x whose D * D does not fit in 64 bits: refused before any size is computed
    big = np.ones((0, 3037000499))
    args = fwd_args("taylor")
    args[0], args[1] = big, np.ones((0, 1))
    raises(ValueError, _core.feature_map_forward, *args, must=("taylor", "3037000499"))


def test_core_misaligned_buffer():
    args = fwd_args()
    y = args[1]
    buf = np.zeros(y.size * 8 + 1, np.uint8)
    args[1] = buf[1:].view(F64).reshape(y.shape)
    assert not args[1].flags.aligned
    raises(ValueError, _core.feature_map_forward, *args, must=("'y'", "aligned"))


def test_core_float32_call_with_float64_output():
    args = bwd_args(dtype=np.float32)
    args[2] = args[2].astype(F64)
    raises(TypeError, _core.feature_map_backward, *args, must=("'dx'", "float32", "float64"))


def test_core_no_references_kept():
    """The entry points borrow their arguments: reference counts are unchanged after many
    calls, successful or not."""
    fa, ba = fwd_args(), bwd_args()
    objs = tuple(a for a in fa + ba if isinstance(a, np.ndarray))
    counts = [sys.getrefcount(a) for a in objs]
    bad_y = np.zeros((B, T, H, M + 1))
    for _ in range(200):
        _core.feature_map_forward(*fa)
        _core.feature_map_backward(*ba)
        with pytest.raises(ValueError):
            _core.feature_map_forward(fa[0], bad_y, *fa[2:])
        with pytest.raises(TypeError):
            _core.feature_map_backward(*ba[:6], None, ba[7])
    del bad_y
    assert [sys.getrefcount(a) for a in objs] == counts

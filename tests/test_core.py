"""pyattn._core building blocks: the packed GEMM, the vectorised exp, and every ISA path
(PYATTN_ISA=avx512|avx2|generic, chosen in csrc/dispatch.c) run end to end in a subprocess.

GEMM error bound: for C = alpha op(A) op(B) + beta C in any summation order,
|C - C_exact| <= gamma_{K+2} (|alpha| |A||B| + |beta| |C|) with gamma_n ~ n u, u = eps / 2
(Higham, Accuracy and Stability, 3.5); the float64 reference has the same bound, so
(K + 3) eps covers kernel and reference together.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

import pyattn
from pyattn import _core, reference
from pyattn.testing import assert_close

DTYPES = (np.float64, np.float32)
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# (M, N, K): ragged edges of every micro-tile, several KC panels (K > 128 / 256), several MC
# blocks (M > 192), N > NC of the AVX-512 float path (2048), empty and K = 0 products
GEMM_SIZES = [(1, 1, 1), (7, 13, 5), (100, 37, 300), (513, 129, 257), (5, 2100, 3),
              (13, 1, 17), (1, 33, 2), (6, 5, 0), (0, 5, 3), (4, 0, 2), (0, 0, 0)]


def _operands(rng, M, N, K, ta, tb, dtype):
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(dtype)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(dtype)
    c = rng.standard_normal((M, N)).astype(dtype)
    return a, b, c


def _check_gemm(a, b, c0, ta, tb, alpha, beta, dtype):
    """Run _core.gemm on a copy of c0 and check it against the float64 product within the
    rounding bound. c0 may hold NaN when beta == 0 (it must not be read)."""
    c = c0.copy()
    assert _core.gemm(a, b, c, ta, tb, alpha, beta) is None
    A = a.astype(np.float64).T if ta else a.astype(np.float64)
    B = b.astype(np.float64).T if tb else b.astype(np.float64)
    K = A.shape[1]
    C0 = c0.astype(np.float64)
    ref = alpha * (A @ B)
    mag = abs(alpha) * (np.abs(A) @ np.abs(B))
    if beta != 0:
        ref = ref + beta * C0
        mag = mag + abs(beta) * np.abs(C0)
    eps = np.finfo(dtype).eps
    bound = (K + 3) * eps * mag + np.finfo(dtype).tiny
    assert c.dtype == dtype
    assert np.all(np.isfinite(c))
    err = np.abs(c.astype(np.float64) - ref)
    assert np.all(err <= bound), f"gemm error {err.max():.3e} above bound at {np.unravel_index(np.argmax(err - bound), err.shape)}"
    return c


@pytest.mark.parametrize("tb", [False, True], ids=["N", "T"])
@pytest.mark.parametrize("ta", [False, True], ids=["N", "T"])
@pytest.mark.parametrize("size", GEMM_SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_gemm(dtype, size, ta, tb, rng):
    M, N, K = size
    a, b, c = _operands(rng, M, N, K, ta, tb, dtype)
    _check_gemm(a, b, c, ta, tb, 1.0, 0.0, dtype)
    _check_gemm(a, b, c, ta, tb, -0.75, 1.25, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_gemm_every_row_count(dtype, rng):
    """M from 1 to 25 reaches every size of a last row panel (MR is 6 or 12: the kernel runs a
    third, two thirds or all of MR rows), with ragged columns and more than one K block."""
    for M in range(1, 26):
        for ta in (False, True):
            for tb in (False, True):
                a, b, c = _operands(rng, M, 37, 300, ta, tb, dtype)
                _check_gemm(a, b, c, ta, tb, 1.0, 0.0, dtype)
                _check_gemm(a, b, c, ta, tb, -0.75, 1.25, dtype)


@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (2.5, -1.5), (0.3, 0.0), (-1.0, 0.5),
                                        (0.0, 1.0), (0.0, 0.0), (1.0, -1.0)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_gemm_alpha_beta(dtype, alpha, beta, rng):
    for ta in (False, True):
        for tb in (False, True):
            a, b, c = _operands(rng, 37, 29, 41, ta, tb, dtype)
            out = _check_gemm(a, b, c, ta, tb, alpha, beta, dtype)
            if alpha == 0 and beta == 1:
                np.testing.assert_array_equal(out, c)
            if alpha == 0 and beta == 0:
                assert np.all(out == 0)


@pytest.mark.parametrize("size", [(1, 1, 1), (7, 13, 5), (100, 37, 300), (513, 129, 257), (6, 5, 0)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_gemm_beta0_does_not_read_c(dtype, size, rng):
    """beta = 0 overwrites C: NaN and inf in C must not leak into the result."""
    M, N, K = size
    for ta in (False, True):
        for tb in (False, True):
            a, b, _ = _operands(rng, M, N, K, ta, tb, dtype)
            for fill in (np.nan, np.inf):
                c = np.full((M, N), fill, dtype=dtype)
                out = _check_gemm(a, b, c, ta, tb, 1.5, 0.0, dtype)
                assert np.all(np.isfinite(out))
                if K == 0:
                    assert np.all(out == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_gemm_k0_scales_c(dtype, rng):
    a = np.zeros((4, 0), dtype)
    b = np.zeros((0, 3), dtype)
    c = rng.standard_normal((4, 3)).astype(dtype)
    out = c.copy()
    _core.gemm(a, b, out, False, False, 2.0, -0.5)
    np.testing.assert_array_equal(out, (c * dtype(-0.5)).astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_gemm_exact_small_integers(dtype, rng):
    """Products of small integers are exact in any order: the result must be bitwise exact."""
    for ta in (False, True):
        for tb in (False, True):
            M, N, K = 67, 45, 300
            a = rng.integers(-4, 5, (K, M) if ta else (M, K)).astype(dtype)
            b = rng.integers(-4, 5, (N, K) if tb else (K, N)).astype(dtype)
            c = rng.integers(-4, 5, (M, N)).astype(dtype)
            out = c.copy()
            _core.gemm(a, b, out, ta, tb, 2.0, -1.0)
            A = a.T if ta else a
            B = b.T if tb else b
            np.testing.assert_array_equal(out, 2 * (A.astype(np.int64) @ B.astype(np.int64)) - c)


# --------------------------------------------------------------------------------------- exp


def _exp(x):
    y = np.empty_like(x)
    assert _core.exp(x, y) is None
    return y


EXP_RANGES = {np.float32: (-87.3, 88.7), np.float64: (-708.0, 709.0)}
EXP_BOUND = {np.float32: 1.2e-7, np.float64: 4.5e-16}


def check_exp_accuracy(dtype, n_points, seed=0):
    lo, hi = EXP_RANGES[dtype]
    r = np.random.default_rng(seed)
    x = np.concatenate([np.linspace(lo, hi, n_points), r.uniform(lo, hi, n_points),
                        r.uniform(-1, 1, n_points // 4), [lo, hi, 0.0, -0.0]]).astype(dtype)
    y = _exp(x)
    ref = np.exp(x.astype(np.float64))  # float32: the float64 exp of the float32 input
    assert np.all(np.isfinite(y)) and np.all(y > 0)
    rel = np.abs(y.astype(np.float64) - ref) / ref
    worst = float(rel.max())
    assert worst <= EXP_BOUND[dtype], f"exp {np.dtype(dtype)}: max rel error {worst:.3e} at x={x[np.argmax(rel)]!r}"
    return worst


def check_exp_special(dtype):
    x = np.array([-np.inf, np.inf, np.nan, -1e4, 1e4, -1e30, 1e30, 0.0, -0.0], dtype)
    y = _exp(x)
    assert y[0] == 0 and y[1] == np.inf and np.isnan(y[2])
    assert y[3] == 0 and y[4] == np.inf and y[5] == 0 and y[6] == np.inf
    assert y[7] == 1 and y[8] == 1
    # NaN among finite values in one vector only poisons its own lane
    x = np.zeros(37, dtype)
    x[5] = np.nan
    y = _exp(x)
    assert np.isnan(y[5]) and np.all(np.delete(y, 5) == 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_exp_accuracy(dtype):
    check_exp_accuracy(dtype, 1_000_000)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_exp_special_values(dtype):
    check_exp_special(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_exp_overflow_underflow_edges(dtype):
    if dtype == np.float32:
        finite = np.array([88.72, 88.7228], dtype)      # exp < FLT_MAX
        over = np.array([88.73, 88.8, 89.0, 100.0], dtype)
        zero = np.array([-104.0, -105.0, -200.0, -1e4], dtype)  # below half the least subnormal
    else:
        finite = np.array([709.78, 709.782], dtype)
        over = np.array([709.79, 710.0, 711.0, 1000.0], dtype)
        zero = np.array([-745.2, -746.0, -800.0, -1e4], dtype)
    ref = np.exp(finite.astype(np.float64))
    y = _exp(finite)
    assert np.all(np.isfinite(y))
    assert np.all(np.abs(y - ref) / ref <= EXP_BOUND[dtype])
    assert np.all(_exp(over) == np.inf)
    assert np.all(_exp(zero) == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_exp_subnormal_results_rounded_not_flushed(dtype):
    """vmath.h promises rounded (not flushed) subnormal results: within one subnormal ulp."""
    if dtype == np.float32:
        x = np.linspace(-103.0, -87.4, 200_001).astype(dtype)
        ulp = 2.0 ** -149
    else:
        x = np.linspace(-744.0, -708.5, 200_001).astype(dtype)
        ulp = 2.0 ** -1074
    y = _exp(x)
    ref = np.exp(x.astype(np.float64)) if dtype == np.float32 else np.exp(x)
    assert np.all(y > 0)
    assert np.max(np.abs(y.astype(np.float64) - ref)) <= ulp


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_exp_tails_and_bounds(dtype, rng):
    """Every length up to a few vectors (tails of every size), odd large lengths; the tail
    path gives the vector path's values and writes nothing past n."""
    base = rng.uniform(-20, 20, 4099).astype(dtype)
    full = _exp(base)
    for n in list(range(0, 70)) + [127, 129, 1001, 4097, 4099]:
        buf = np.full(n + 16, -7.0, dtype)
        out = buf[:n]
        _core.exp(np.ascontiguousarray(base[:n]), out)
        np.testing.assert_array_equal(out, full[:n])
        assert np.all(buf[n:] == -7.0), n
        # an offset start (different alignment, different tail)
        if n >= 3:
            o2 = np.empty(n - 3, dtype)
            _core.exp(np.ascontiguousarray(base[3:n]), o2)
            np.testing.assert_array_equal(o2, full[3:n])


# The softmax kernels' exp (vexp_nonpos): arguments x - max <= 0, 2^n as one factor, so
# exactly 0 below NONPOS_LOW, where 2^n would be subnormal; above it vexp's polynomial, with
# vexp's bits on normal results.
NONPOS_LOW = {np.float32: -87.6, np.float64: -708.7}  # below: exactly 0


def _exp_nonpos(x):
    y = np.empty_like(x)
    assert _core.exp_nonpos(x, y) is None
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_exp_nonpos_accuracy_and_bits(dtype):
    lo = NONPOS_LOW[dtype]
    r = np.random.default_rng(3)
    x = np.concatenate([np.linspace(lo, 0, 1_000_001), r.uniform(lo, 0, 1_000_000),
                        r.uniform(-1, 0, 250_000), [0.0, -0.0, lo]]).astype(dtype)
    x = x[x >= lo]
    y = _exp_nonpos(x)
    ref = np.exp(x.astype(np.float64))
    normal = ref >= np.finfo(dtype).tiny
    rel = np.abs(y[normal].astype(np.float64) - ref[normal]) / ref[normal]
    assert rel.max() <= EXP_BOUND[dtype], rel.max()
    np.testing.assert_array_equal(y[normal], _exp(x[normal]))
    # between lo and the least normal result: a subnormal, rounded by one multiply
    ulp = float(np.finfo(dtype).smallest_subnormal)
    assert np.max(np.abs(y[~normal].astype(np.float64) - ref[~normal])) <= ulp


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_exp_nonpos_special_values_and_flush(dtype):
    lo = NONPOS_LOW[dtype]
    x = np.array([-np.inf, np.nan, 0.0, -0.0, np.nextafter(dtype(lo), dtype(-np.inf)), lo - 1,
                  -1e4, -1e30, -np.finfo(dtype).max], dtype)
    y = _exp_nonpos(x)
    assert y[0] == 0 and np.isnan(y[1]) and y[2] == 1 and y[3] == 1
    assert np.all(y[4:] == 0)
    # a NaN among other values poisons its own lane only; rounding above 0 (an LSE's last
    # bit) and the stated range's top still give exp
    x = np.zeros(37, dtype)
    x[5] = np.nan
    x[6] = 1e-6
    x[7] = 80.0
    y = _exp_nonpos(x)
    assert np.isnan(y[5]) and np.all(np.delete(y, [5, 6, 7]) == 1)
    np.testing.assert_allclose(y[6:8], np.exp(x[6:8].astype(np.float64)), rtol=EXP_BOUND[dtype])
    # the whole stated range above 0 (where the kernels never go): vexp's bits
    top = {np.float32: 88.37, np.float64: 709.43}[dtype]
    x = np.linspace(0, top, 200_001).astype(dtype)
    np.testing.assert_array_equal(_exp_nonpos(x), _exp(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_exp_nonpos_tails(dtype, rng):
    base = rng.uniform(-30, 0, 300).astype(dtype)
    full = _exp_nonpos(base)
    for n in list(range(0, 40)) + [127, 129, 299]:
        buf = np.full(n + 16, -7.0, dtype)
        _core.exp_nonpos(np.ascontiguousarray(base[:n]), buf[:n])
        np.testing.assert_array_equal(buf[:n], full[:n])
        assert np.all(buf[n:] == -7.0), n


# ------------------------------------------------------------------------------- ISA paths


def test_build_info():
    info = pyattn.build_info()
    assert set(info) >= {"isa", "isas_available", "compiler", "openmp", "num_threads"}
    avail = info["isas_available"]
    assert "generic" in avail
    assert avail == [i for i in pyattn._runtime.ISAS if i in avail]
    assert info["isa"] in avail
    if os.environ.get("PYATTN_ISA") is None:
        assert info["isa"] == avail[0]  # the widest path the CPU has
    assert isinstance(info["openmp"], bool)
    assert info["num_threads"] == pyattn.get_num_threads() >= 1
    assert isinstance(info["compiler"], str) and info["compiler"]


def isa_selfcheck(expected):
    """Run in a subprocess with PYATTN_ISA=expected: gemm, exp, the pointwise kernels and softmax attention (every
    form, forward and vjp, both dtypes) against NumPy and the oracles."""
    import conftest

    np.empty, np.empty_like = conftest.nan_empty, conftest.nan_empty_like
    info = pyattn.build_info()
    assert info["isa"] == expected, (info["isa"], expected)
    rng = np.random.default_rng(7)
    for dtype in DTYPES:
        # (13, 37, 1024) and (30, 37, 1024): rows of A 4 KiB apart in float32, which gemm packs,
        # whole panels and a ragged last one (MR is 6 or 12)
        for size in [(7, 13, 5), (100, 37, 300), (30, 70, 9), (13, 37, 1024), (30, 37, 1024)]:
            for ta in (False, True):
                for tb in (False, True):
                    a, b, c = _operands(rng, *size, ta, tb, dtype)
                    _check_gemm(a, b, c, ta, tb, 1.0, 0.0, dtype)
                    _check_gemm(a, b, c, ta, tb, 0.5, -2.0, dtype)
                    _check_gemm(a, b, np.full_like(c, np.nan), ta, tb, 1.0, 0.0, dtype)
        check_exp_accuracy(dtype, 100_000)
        check_exp_special(dtype)
        check_pointwise(dtype, rng)
        check_short_conv(dtype, rng)
    cases = [
        ((1, 70, 300, 2, 1, 13, 7),
         dict(causal=True, window=(150, 0), sinks=3, alibi_slopes=[0.05, 0.01], softcap=4.0)),
        ((2, 65, 65, 4, 2, 16, 16), {}),
        ((1, 9, 5, 2, 2, 8, 8), dict(causal=True)),  # rows with no visible key
    ]
    for (B, Tq, Tk, H, Hk, Dk, Dv), kw in cases:
        q, k, v = conftest.make_inputs(1, B, Tq, Tk, H, Hk, Dk, Dv)
        kw64 = dict(kw)
        if "alibi_slopes" in kw:
            kw64["alibi_slopes"] = np.array(kw["alibi_slopes"])
        o_ref, lse_ref = reference.softmax_attention(q, k, v, return_lse=True, **kw64)
        r = np.random.default_rng(2)
        do = r.standard_normal(o_ref.shape)
        dlse = np.where(np.isfinite(lse_ref), r.standard_normal(lse_ref.shape), 0)
        _, _, g_ref = conftest.dense_softmax(q, k, v, do, dlse, **kw64)
        for dtype, (tol, gtol) in ((np.float64, (1e-10, 1e-10)), (np.float32, (1e-5, 1e-4))):
            kwd = dict(kw64)
            if "alibi_slopes" in kwd:
                kwd["alibi_slopes"] = kwd["alibi_slopes"].astype(dtype)
            args = tuple(x.astype(dtype) for x in (q, k, v))
            for form in ("parallel", "flash", "recurrent"):
                (o, lse), pullback = pyattn.vjp(pyattn.softmax_attention, *args, form=form,
                                                return_lse=True, **kwd)
                assert_close(o, o_ref, tol, name=f"{expected} {form} o")
                assert_close(lse, lse_ref, tol, name=f"{expected} {form} lse")
                g = pullback((do.astype(dtype), dlse.astype(dtype)))
                for name in "qkv":
                    assert_close(g[name], g_ref[name], gtol, name=f"{expected} {form} d{name}")
        check_bf16_softmax(expected, q, k, v, kw64)
    check_chunk_engines(expected)
    print("ISA-OK", expected)


def check_bf16_softmax(isa, q, k, v, kw64):
    """A bf16 call (the bf16 products of the amx and avx512_bf16 paths) within relative RMS 1e-2
    of the float64 result on the same bf16 inputs, in the flash and parallel forms."""
    try:
        import ml_dtypes
    except ImportError:
        return
    bf16 = [x.astype(ml_dtypes.bfloat16) for x in (q, k, v)]
    o_ref = reference.softmax_attention(*(x.astype(np.float64) for x in bf16), **kw64)
    kw = dict(kw64)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = kw["alibi_slopes"].astype(np.float32)
    for form in ("parallel", "flash"):
        o = pyattn.softmax_attention(*bf16, form=form, **kw).astype(np.float64)
        assert_close(o, o_ref, 1e-2, name=f"{isa} {form} bf16 o")


def check_chunk_engines(expected):
    """The chunk forms of the gated linear engine (GLA, a factored vector gate) and of the
    delta engine (gated DeltaNet), T=130 (a ragged last chunk), against the float64 oracles:
    their blocks run every GEMM shape of the path's tile (row panels of 64 rows, triangles)."""
    r = np.random.default_rng(3)
    B, T, H, K, V = 1, 130, 2, 32, 24
    q, k, v = (r.standard_normal((B, T, H, d)) for d in (K, K, V))
    g = -0.1 * r.random((B, T, H, K))
    kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
    gs, beta = -0.1 * r.random((B, T, H)), r.random((B, T, H))
    cases = [(pyattn.gla, reference.gla, (q, k, v, g)),
             (pyattn.gated_delta_rule, reference.gated_delta_rule, (q, kn, v, gs, beta))]
    for op, ref, args in cases:
        o_ref = ref(*args)[0]
        for dtype, tol in ((np.float64, 1e-10), (np.float32, 1e-5)):
            o = op(*(x.astype(dtype) for x in args), form="chunk")[0]
            assert_close(o, o_ref, tol, name=f"{expected} {op.__name__} chunk o")


# ---- the threaded GEMM and the pointwise kernels of pyattn.nn ------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_gemm_same_bits_at_any_thread_count(dtype, rng):
    """The binding's GEMM splits rows of C over the threads and packs B once for the team;
    every entry sees the same FMAs in the same order, so the bits do not depend on the
    count. Sizes: one block, several uneven row blocks, several KC panels."""
    saved = pyattn.get_num_threads()
    try:
        for M, N, K in [(5, 7, 3), (700, 300, 900), (4096, 64, 256), (256, 96, 4096)]:
            for ta, tb in [(False, True), (True, False)]:
                a, b, c0 = _operands(rng, M, N, K, ta, tb, dtype)
                outs = []
                for t in (1, 2, 3):
                    pyattn.set_num_threads(t)
                    outs.append(_check_gemm(a, b, c0, ta, tb, 1.5, 0.5, dtype))
                for o in outs[1:]:
                    np.testing.assert_array_equal(o, outs[0])
    finally:
        pyattn.set_num_threads(saved)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_gemm_row_bits_do_not_depend_on_the_row_count(dtype, rng):
    """Fewer rows than a micro-panel (decoding) take their own path; a row of C must still
    get the bits it gets among many rows (one decoded token equals the forward's row), for
    B stored either way, one and several KC blocks, ragged and whole tiles, and alpha, beta
    that scale exactly (pyattn.nn's matmuls: alpha 1, beta 0 or 1). Other scalings may round
    by an ulp differently in the micro-kernel's vector and scalar epilogues."""
    for K, N in [(5, 3), (16, 23), (300, 40), (700, 70)]:
        x = rng.standard_normal((40, K)).astype(dtype)
        w = rng.standard_normal((N, K)).astype(dtype)
        c0 = rng.standard_normal((40, N)).astype(dtype)
        for b, tb in ((w, True), (np.ascontiguousarray(w.T), False)):
            for alpha, beta in ((1.0, 0.0), (1.0, 1.0), (-0.5, 2.0)):
                full = _check_gemm(x, b, c0, False, tb, alpha, beta, dtype)
                for m in (1, 2, 5):
                    few = _check_gemm(x[:m].copy(), b, c0[:m].copy(), False, tb, alpha, beta, dtype)
                    np.testing.assert_array_equal(few, full[:m])


POINTWISE_SIZES = [0, 1, 15, 17, 3 * 8192 + 5]


def check_pointwise(dtype, rng):
    """silu, its backward, SwiGLU's product and its backward, RMSNorm and rotary against float64 NumPy formulas, on sizes that
    leave vector tails and split over several blocks (also run per ISA path)."""
    eps = np.finfo(dtype).eps
    for n in POINTWISE_SIZES:
        x = (4 * rng.standard_normal(n)).astype(dtype)
        x[:min(n, 4)] = np.array([-200.0, 200.0, -0.0, 30.0])[:min(n, 4)]
        y, s = np.empty_like(x), np.empty_like(x)
        _core.silu(x, None, y, s)
        x64 = x.astype(np.float64)
        with np.errstate(over="ignore"):
            s_ref = 1 / (1 + np.exp(-x64))
        assert np.all(np.abs(s - s_ref) <= 4 * eps * s_ref + np.finfo(dtype).tiny)
        assert np.all(np.abs(y - x64 * s_ref) <= 4 * eps * np.abs(x64 * s_ref) + np.finfo(dtype).tiny)
        s_only = np.empty_like(x)
        _core.silu(x, None, None, s_only)
        np.testing.assert_array_equal(s_only, s)
        dy = rng.standard_normal(n).astype(dtype)
        dx = np.empty_like(x)
        _core.silu_backward(dy, y, s, dx)
        s64, y64 = s.astype(np.float64), y.astype(np.float64)
        dx_ref = dy * (s64 + y64 * (1 - s64))
        mag = np.abs(dy) * (s64 + np.abs(y64) * (1 + s64))
        assert np.all(np.abs(dx - dx_ref) <= 4 * eps * mag)
        b = rng.standard_normal(n).astype(dtype)
        h, s2 = np.empty_like(x), np.empty_like(x)
        _core.silu(x, b, h, s2)
        np.testing.assert_array_equal(s2, s)
        h_ref = x64 * s_ref * b
        assert np.all(np.abs(h - h_ref) <= 6 * eps * np.abs(h_ref) + np.finfo(dtype).tiny)
        da, db = np.empty_like(x), np.empty_like(x)
        _core.swiglu_backward(dy, x, b, s, da, db)
        db_ref = dy * x64 * s64
        da_ref = dy * b * s64 * (1 + x64 * (1 - s64))
        assert np.all(np.abs(db - db_ref) <= 4 * eps * np.abs(db_ref) + np.finfo(dtype).tiny)
        assert np.all(np.abs(da - da_ref) <= 8 * eps * np.abs(dy * b) * s64 * (1 + np.abs(x64) * (1 + s64))
                      + np.finfo(dtype).tiny)
    for (rows, d), mean in itertools.product([(0, 8), (1, 1), (3, 17), (700, 64), (5, 9000)],
                                             (True, False)):
        # mean False: the sum over the row instead of the mean (the delta rule's L2 norm)
        reduce = np.mean if mean else np.sum
        x = rng.standard_normal((rows, d)).astype(dtype)
        xhat, rstd = np.empty_like(x), np.empty(rows, dtype)
        _core.rms_norm(x, 1e-5, xhat, rstd, mean)
        x64 = x.astype(np.float64)
        r_ref = 1 / np.sqrt(reduce(x64 * x64, axis=1) + 1e-5)
        np.testing.assert_allclose(rstd, r_ref, rtol=8 * eps * np.sqrt(d) + 4 * eps, atol=0)
        np.testing.assert_allclose(xhat, x64 * r_ref[:, None], rtol=8 * eps * np.sqrt(d) + 4 * eps,
                                   atol=np.finfo(dtype).tiny)
        g = rng.standard_normal((rows, d)).astype(dtype)
        dx = np.empty_like(x)
        _core.rms_norm_backward(g, xhat, rstd, dx, mean)
        h64, g64 = xhat.astype(np.float64), g.astype(np.float64)
        avg = reduce(g64 * h64, axis=1, keepdims=True)
        dx_ref = (g64 - h64 * avg) * rstd[:, None].astype(np.float64)
        mag = (np.abs(g64) + np.abs(h64) * reduce(np.abs(g64) * np.abs(h64), axis=1, keepdims=True)) \
            * rstd[:, None].astype(np.float64)
        assert np.all(np.abs(dx - dx_ref) <= 4 * (d + 2) * eps * mag + np.finfo(dtype).tiny)
    for rows, H, D, n in [(6, 3, 8, 3), (40, 2, 2, 40), (1000, 4, 64, 250), (2, 1, 18, 1)]:
        x = rng.standard_normal((rows, H, D)).astype(dtype)
        ang = rng.uniform(-10, 10, (n, D // 2))
        cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=1).astype(dtype)
        sin = np.concatenate([-np.sin(ang), np.sin(ang)], axis=1).astype(dtype)
        for sign in (1, -1):
            out = np.empty_like(x)
            _core.rotary(x, cos, sin, sign, out)
            a = np.tile(ang, (rows // n, 1))[:, None, :] * sign
            x1, x2 = x[..., :D // 2].astype(np.float64), x[..., D // 2:].astype(np.float64)
            ref = np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)], axis=-1)
            assert np.all(np.abs(out - ref) <= 4 * eps * (np.abs(x1) + np.abs(x2)).max() + 4 * eps)


def _conv_reference(x, state, w, bias, dy):
    """float64 ShortConv: u, y = silu(u), and dx, dw [K, C], dbias of the loss sum(dy y)."""
    B, T, C = x.shape
    K = w.shape[0]
    before = np.zeros((B, K - 1, C)) if state is None else state.astype(np.float64)
    xp = np.concatenate([before, x.astype(np.float64)], axis=1)
    w64 = w.astype(np.float64)
    u = sum(w64[i] * xp[:, i:i + T] for i in range(K)) + (0 if bias is None else bias.astype(np.float64))
    sg = 1 / (1 + np.exp(-u))
    du = dy.astype(np.float64) * (sg + u * sg * (1 - sg))
    dxp = np.zeros_like(xp)
    for i in range(K):
        dxp[:, i:i + T] += du * w64[i]
    dw = np.stack([(du * xp[:, i:i + T]).sum(axis=(0, 1)) for i in range(K)])
    return u * sg, sg, dxp[:, K - 1:], dw, du.sum(axis=(0, 1))


def check_short_conv(dtype, rng):
    """The ShortConv kernels against float64 NumPy, with and without state and bias, T below
    and above K - 1, one tap."""
    eps = np.finfo(dtype).eps
    for B, T, C, K, with_state, with_bias in [(2, 9, 5, 4, False, True), (3, 2, 17, 4, True, False),
                                              (1, 300, 40, 4, True, True), (2, 5, 3, 1, False, False),
                                              (4, 70, 256, 3, False, True)]:
        x = rng.standard_normal((B, T, C)).astype(dtype)
        state = rng.standard_normal((B, K - 1, C)).astype(dtype) if with_state else None
        w = rng.standard_normal((K, C)).astype(dtype)
        bias = rng.standard_normal(C).astype(dtype) if with_bias else None
        dy = rng.standard_normal((B, T, C)).astype(dtype)
        y, s = np.empty_like(x), np.empty_like(x)
        _core.short_conv(x, state, w, bias, y, s)
        ry, rs, rdx, rdw, rdb = _conv_reference(x, state, w, bias, dy)
        tol = 16 * K * eps
        np.testing.assert_allclose(y, ry, rtol=tol, atol=tol)
        np.testing.assert_allclose(s, rs, rtol=tol, atol=tol)
        dx, dw = np.empty_like(x), np.empty_like(w)
        db = None if bias is None else np.empty_like(bias)
        _core.short_conv_backward(x, state, w, bias, dy, y, s, dx, dw, db)
        np.testing.assert_allclose(dx, rdx, rtol=tol, atol=tol)
        scale = np.sqrt(B * T)
        np.testing.assert_allclose(dw, rdw, rtol=tol * scale, atol=tol * scale)
        if bias is not None:
            np.testing.assert_allclose(db, rdb, rtol=tol * scale, atol=tol * scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_pointwise_kernels_match_numpy(dtype, rng):
    check_pointwise(dtype, rng)
    check_short_conv(dtype, rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_pointwise_kernels_propagate_nan_and_keep_bits_across_threads(dtype, rng):
    n = 2_000_003  # large enough that every kernel below gets more than one thread
    x = rng.standard_normal(n).astype(dtype)
    x[[0, 9000, n - 1]] = [np.nan, np.inf, -np.inf]
    saved = pyattn.get_num_threads()
    try:
        results = []
        for t in (1, 2, 3):
            pyattn.set_num_threads(t)
            y, s = np.empty_like(x), np.empty_like(x)
            _core.silu(x, None, y, s)
            dx = np.empty_like(x)
            _core.silu_backward(x, y, s, dx)
            xr = x[:300_003 * 3].reshape(-1, 3)
            xhat, rstd = np.empty_like(xr), np.empty(xr.shape[0], dtype)
            _core.rms_norm(xr, 1e-6, xhat, rstd, True)
            xc = x[:2 * 3900 * 256].reshape(2, 3900, 256)
            yc, sc = np.empty_like(xc), np.empty_like(xc)
            wc = np.linspace(-1, 1, 4 * 256).astype(dtype).reshape(4, 256)
            _core.short_conv(xc, None, wc, None, yc, sc)
            dxc, dwc = np.empty_like(xc), np.empty_like(wc)
            _core.short_conv_backward(xc, None, wc, None, xc, yc, sc, dxc, dwc, None)
            h, s2 = np.empty_like(x), np.empty_like(x)
            _core.silu(x, x[::-1].copy(), h, s2)
            da, db = np.empty_like(x), np.empty_like(x)
            _core.swiglu_backward(x, x, x[::-1].copy(), s2, da, db)
            xr3 = x[:300_000 * 4].reshape(300_000, 1, 4)
            tab = np.linspace(-1, 1, 8).astype(dtype).reshape(2, 4)
            rot = np.empty_like(xr3)
            _core.rotary(xr3, tab, tab[::-1].copy(), 1, rot)
            results.append((y, s, dx, xhat, rstd, yc, dxc, dwc, h, da, db, rot))
        for r in results[1:]:
            for a, b in zip(r, results[0]):
                np.testing.assert_array_equal(a, b)
        y, s, dx = results[0][:3]
        assert np.isnan(y[0]) and np.isnan(s[0]) and np.isnan(dx[0])
        assert s[9000] == 1 and y[9000] == np.inf and s[n - 1] == 0
    finally:
        pyattn.set_num_threads(saved)


def test_pointwise_kernels_take_zero_widths():
    """Rows of no elements (and no rows) are no work, not a division by zero."""
    f = np.float32
    x = np.zeros((3, 0), f)
    _core.rms_norm(x, 1e-5, np.zeros_like(x), np.zeros(3, f), True)
    _core.rms_norm_backward(x, x, np.ones(3, f), np.zeros_like(x), False)
    x3 = np.zeros((4, 0, 6), f)
    _core.rotary(x3, np.zeros((2, 6), f), np.zeros((2, 6), f), 1, np.zeros_like(x3))
    xc = np.zeros((2, 3, 0), f)
    w = np.zeros((4, 0), f)
    _core.short_conv(xc, None, w, None, np.zeros_like(xc), np.zeros_like(xc))
    _core.short_conv_backward(xc, None, w, None, xc, xc, xc, np.zeros_like(xc), np.zeros_like(w), None)
    for shape in [(1, 2, 0, 4), (1, 2, 3, 0), (0, 2, 3, 4)]:
        assert pyattn.rope(np.zeros(shape, f), np.arange(shape[1])).shape == shape


def test_pointwise_kernels_reject_bad_shapes():
    x = np.zeros((4, 6), np.float32)
    with pytest.raises(ValueError, match="'s'"):
        _core.silu(x, None, np.zeros_like(x), np.zeros((4, 5), np.float32))
    with pytest.raises(TypeError, match="dtype"):
        _core.silu_backward(x, x, x, np.zeros((4, 6)))
    with pytest.raises(ValueError, match="'db'"):
        _core.swiglu_backward(x, x, x, x, np.zeros_like(x), np.zeros((6, 4), np.float32))
    with pytest.raises(ValueError, match="'rstd'"):
        _core.rms_norm(x, 1e-5, np.zeros_like(x), np.zeros(3, np.float32), True)
    x3 = np.zeros((4, 2, 6), np.float32)
    with pytest.raises(ValueError, match="multiple"):
        _core.rotary(x3, np.zeros((3, 6), np.float32), np.zeros((3, 6), np.float32), 1, np.zeros_like(x3))
    with pytest.raises(ValueError, match="sign"):
        _core.rotary(x3, np.zeros((2, 6), np.float32), np.zeros((2, 6), np.float32), 0, np.zeros_like(x3))
    w = np.zeros((4, 6), np.float32)
    with pytest.raises(ValueError, match="'state'"):
        _core.short_conv(x3, np.zeros((4, 2, 6), np.float32), w, None, np.zeros_like(x3), np.zeros_like(x3))
    with pytest.raises(ValueError, match="'w'"):
        _core.short_conv(x3, None, np.zeros((4, 5), np.float32), None, np.zeros_like(x3), np.zeros_like(x3))
    with pytest.raises(ValueError, match="one tap"):
        _core.short_conv(x3, None, np.zeros((0, 6), np.float32), None, np.zeros_like(x3), np.zeros_like(x3))
    with pytest.raises(ValueError, match="'dbias'"):
        _core.short_conv_backward(x3, None, w, None, x3, x3, x3, np.zeros_like(x3), np.zeros_like(w),
                                  np.zeros(5, np.float32))


def _run_isa(isa):
    env = dict(os.environ)
    env["PYATTN_ISA"] = isa
    code = (f"import sys; sys.path.insert(0, {TESTS_DIR!r}); import test_core; "
            f"test_core.isa_selfcheck({isa!r})")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("isa", pyattn.build_info()["isas_available"])
def test_isa_path(isa):
    res = _run_isa(isa)
    assert res.returncode == 0, f"PYATTN_ISA={isa} failed:\n{res.stdout}\n{res.stderr}"
    assert f"ISA-OK {isa}" in res.stdout


@pytest.mark.parametrize("isa", ["amx", "avx512_bf16", "avx512", "avx2"])
def test_isa_unavailable_path_is_not_listed(isa):
    """An ISA this CPU lacks is not offered; asking for it falls back to the best one."""
    avail = pyattn.build_info()["isas_available"]
    if isa in avail:
        pytest.skip(f"this CPU has {isa}")
    env = dict(os.environ, PYATTN_ISA=isa)
    out = subprocess.run([sys.executable, "-c", "import pyattn; print(pyattn.build_info()['isa'])"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == avail[0]


def test_isa_unknown_name_falls_back():
    env = dict(os.environ, PYATTN_ISA="sse9000")
    out = subprocess.run([sys.executable, "-c", "import pyattn; print(pyattn.build_info()['isa'])"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == pyattn.build_info()["isas_available"][0]

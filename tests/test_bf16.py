"""bfloat16 calls (ml_dtypes.bfloat16 arrays): every op and form, forward and backward, within
relative RMS 1e-2 of the float64 result on the same (bf16-rounded) inputs; outputs bf16,
LSE and states float32, each gradient in its argument's dtype; the conversions bit-exact
against ml_dtypes; in-place cache writes kept; float64 refused; NaN in, NaN out."""
from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn import _bf16
from pyattn.testing import rel_rms

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays need ml_dtypes (pyattn[bf16])")
BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = 1e-2  # relative RMS against the float64 result: bf16 keeps 8 significant bits


def _map(x, f):
    """x with f applied to every array, through lists and dicts."""
    if isinstance(x, (list, tuple)):
        return type(x)(_map(e, f) for e in x)
    if isinstance(x, dict):
        return {k: _map(e, f) for k, e in x.items()}
    return f(x) if isinstance(x, np.ndarray) else x


def _to(dtype):
    return lambda a: a.astype(dtype) if a.dtype.kind == "f" or a.dtype == BF16 else a


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _bf16_call(name):
    """The op's example with its float arrays in bf16 (states and per-head constants too), and
    the same values (rounded) in float64."""
    info = pyattn.OPS[name]
    args, kwargs = info.example(np.random.default_rng(0), np.float64)
    a16, k16 = _map(list(args), _to(BF16)), _map(kwargs, _to(BF16))
    return info, (a16, k16), (_map(a16, _to(np.float64)), _map(k16, _to(np.float64)))


def test_conversions_match_ml_dtypes_bit_for_bit():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    specials = np.array([0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7FFFFF, 0x00000001, 0x80000000,
                         0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF], np.uint32)
    x = np.concatenate([bits, specials]).view(np.float32)
    got = _bf16.to_bf16(x, BF16).view(np.uint16)
    with np.errstate(invalid="ignore"):  # ml_dtypes warns on NaN, and converts it
        want = x.astype(BF16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    back = _bf16.to_float32(got.view(BF16))
    assert np.isnan(back[nan]).all() and np.array_equal(np.signbit(back[nan]), np.signbit(x[nan]))
    assert np.array_equal(back[~nan], want[~nan].view(BF16).astype(np.float32))
    # widening is exact, so bf16 -> float32 -> bf16 gives the same bits
    assert np.array_equal(_bf16.to_bf16(back, BF16).view(np.uint16)[~nan], got[~nan])


@pytest.mark.parametrize("name", sorted(pyattn.OPS))
def test_every_form_forward(name):
    info, (a16, k16), (a64, k64) = _bf16_call(name)
    for form, form_kw in info.form_calls():
        out = _tuple(info.fn(*a16, **k16, **form_kw))
        ref = _tuple(info.reference(*a64, **k64))
        main = out[0]
        if ref[0].dtype.kind == "i":  # dsa_select's rows: the same choice
            assert main.dtype == np.int64 and np.array_equal(main, ref[0]), form
            continue
        assert main.dtype == BF16, form
        assert rel_rms(main.astype(np.float64), ref[0]) <= TOL, form
        for aux, r in zip(out[1:], ref[1:]):  # LSE, final states, column sums: float32
            if aux is None:
                continue
            assert aux.dtype == np.float32, form
            fin = np.isfinite(r)
            assert np.array_equal(fin, np.isfinite(aux)) and rel_rms(aux[fin], r[fin]) <= TOL, form


def _cotangent(out, rng):
    return tuple(None if o is None else rng.standard_normal(o.shape) for o in _tuple(out))


@pytest.mark.parametrize("name", sorted(n for n, i in pyattn.OPS.items() if i.differentiable))
def test_every_form_backward(name):
    info, (a16, k16), (a64, k64) = _bf16_call(name)
    for form, form_kw in info.form_calls():
        out64, pull64 = pyattn.vjp(info.fn, *a64, **k64, **form_kw)
        out16, pull16 = pyattn.vjp(info.fn, *a16, **k16, **form_kw)
        cot = _cotangent(out64, np.random.default_rng(2))
        cot = tuple(None if c is None else c.astype(BF16 if i == 0 else np.float32) for i, c in enumerate(cot))
        cot64 = _map(cot, _to(np.float64))
        g16 = pull16(cot if isinstance(out64, tuple) else cot[0])
        g64 = pull64(cot64 if isinstance(out64, tuple) else cot64[0])
        assert set(g16) == set(g64), form
        named = dict(zip(info.arrays, a16), **k16)
        named.update(k16.get("feature_map_params") or {})
        for key, g in g64.items():
            for part16, part64, given in zip(*(x if isinstance(x, list) else [x] for x in (g16[key], g, named[key]))):
                assert part16.dtype == given.dtype, (form, key)
                assert rel_rms(part16.astype(np.float64), part64) <= TOL, (form, key)


def test_float32_states_with_bf16_inputs():
    """The state and per-head parameters may stay float32; the final state is float32."""
    rng = np.random.default_rng(3)
    B, T, H, K, V = 2, 70, 2, 16, 8
    q, k = (rng.standard_normal((B, T, H, K)).astype(BF16) for _ in range(2))
    v = rng.standard_normal((B, T, H, V)).astype(BF16)
    g = (-rng.random((B, T, H)) * 0.2).astype(BF16)
    beta = rng.random((B, T, H)).astype(BF16)
    h0 = rng.standard_normal((B, H, K, V)).astype(np.float32)
    o, ht = pyattn.gated_delta_rule(q, k, v, g, beta, qk_l2norm=True, initial_state=h0, output_final_state=True)
    assert o.dtype == BF16 and ht.dtype == np.float32
    up = lambda a: a.astype(np.float64)
    o64, ht64 = pyattn.reference.gated_delta_rule(up(q), up(k), up(v), up(g), up(beta), qk_l2norm=True,
                                                    initial_state=up(h0), output_final_state=True)
    # the chunk form multiplies in bf16 where the CPU can, and its final state then carries
    # the bf16 rounding of the products' operands; elsewhere, and in the recurrent form, the
    # state is float32's from the bf16 inputs
    assert rel_rms(up(o), o64) <= TOL and rel_rms(ht, ht64) <= (TOL if PRODUCTS else 1e-5)
    _, ht_rec = pyattn.gated_delta_rule(q, k, v, g, beta, qk_l2norm=True, initial_state=h0,
                                        output_final_state=True, form="recurrent")
    assert ht_rec.dtype == np.float32 and rel_rms(ht_rec, ht64) <= 1e-5
    (_, _), pull = pyattn.vjp(pyattn.gated_delta_rule, q, k, v, g, beta, qk_l2norm=True, initial_state=h0,
                              output_final_state=True)
    grads = pull((np.ones_like(o), np.ones((B, H, K, V), np.float32)))
    assert grads["initial_state"].dtype == np.float32 and grads["q"].dtype == BF16


def test_float64_is_refused():
    q = np.zeros((1, 4, 1, 8), BF16)
    with pytest.raises(TypeError, match="'initial_state' is float64"):
        pyattn.simple_gla(q, q, q, np.zeros((1, 4, 1), BF16), initial_state=np.zeros((1, 1, 8, 8)))


def test_kvcache_writes_reach_the_bf16_cache():
    rng = np.random.default_rng(4)
    B, cap, Hk, H, D = 2, 32, 1, 4, 16
    kc, vc = (rng.standard_normal((B, cap, Hk, D)).astype(BF16) for _ in range(2))
    kc32, vc32 = kc.astype(np.float32), vc.astype(np.float32)
    seqlens = np.array([5, 9], np.int32)
    q = rng.standard_normal((B, 1, H, D)).astype(BF16)
    k, v = (rng.standard_normal((B, 1, Hk, D)).astype(BF16) for _ in range(2))
    o = pyattn.attention_with_kvcache(q, kc, vc, seqlens, k=k, v=v)
    o32 = pyattn.attention_with_kvcache(q.astype(np.float32), kc32, vc32, seqlens, k=k.astype(np.float32),
                                        v=v.astype(np.float32))
    assert np.array_equal(kc.astype(np.float32), kc32) and np.array_equal(vc.astype(np.float32), vc32)
    assert np.array_equal(o.view(np.uint16), _bf16.to_bf16(o32, BF16).view(np.uint16))


@pytest.mark.parametrize("name", ["softmax_attention", "gla", "gated_delta_rule", "mamba2"])
def test_nan_in_nan_out(name):
    info, (a16, k16), _ = _bf16_call(name)
    first = a16[0].copy()
    first[0, 3] = np.nan
    out = _tuple(info.fn(first, *a16[1:], **k16))[0]
    assert np.isnan(out.astype(np.float32)[0, 3]).any()
    assert not np.isnan(out.astype(np.float32)[1:]).any()


def test_float32_calls_unchanged():
    """A call without bf16 arrays is the op itself: the same bits."""
    info = pyattn.OPS["gla"]
    args, kwargs = info.example(np.random.default_rng(5), np.float32)
    a = info.fn(*args, **kwargs)
    b = info.fn.__wrapped__(*args, **kwargs)
    assert all(x is None and y is None or np.array_equal(x, y) for x, y in zip(_tuple(a), _tuple(b)))


def test_conversion_checks_its_buffers():
    from pyattn import _core

    with pytest.raises(ValueError, match="dst"):
        _core.bf16_convert(np.zeros(3, np.uint16), np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="src"):
        _core.bf16_convert(np.zeros(3, np.float64), np.zeros(3, np.uint16))
    with pytest.raises(TypeError, match="dst"):
        _core.bf16_convert(np.zeros(3, np.float32), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="writeable"):
        dst = np.zeros(3, np.float32)
        dst.flags.writeable = False
        _core.bf16_convert(np.zeros(3, np.uint16), dst)


SOFTMAX_PRODUCT_CASES = {
    # T ragged against the packings' 16- and 32-row panels and the 192-key blocks; odd and
    # unequal head dims; GQA; every mask and score option; packed sequences
    "plain": dict(T=(70, 70), H=(4, 2), D=(40, 24), kw={}),
    "causal": dict(T=(250, 250), H=(2, 2), D=(64, 64), kw=dict(causal=True)),
    "decode-rows": dict(T=(5, 300), H=(4, 1), D=(33, 65), kw=dict(causal=True)),
    "window-sinks": dict(T=(200, 200), H=(2, 1), D=(32, 48), kw=dict(causal=True, window=(37, 0), sinks=3)),
    "softcap-alibi": dict(T=(97, 131), H=(2, 2), D=(16, 16), kw=dict(softcap=5.0, alibi_slopes="alibi")),
    "parallel": dict(T=(100, 100), H=(2, 2), D=(24, 40), kw=dict(causal=True, form="parallel")),
    "varlen": dict(T=(260, 260), H=(2, 2), D=(64, 32), kw=dict(causal=True, cu_seqlens=[0, 1, 65, 200, 260])),
}


@pytest.mark.parametrize("case", sorted(SOFTMAX_PRODUCT_CASES))
def test_softmax_bf16_products(case):
    """softmax attention with q, k, v all bf16: on a CPU with AVX512-BF16 or AMX (build_info's
    isa) the flash and parallel forwards multiply in bf16; on any CPU the result is within 1e-2
    of the float64 one on the same inputs, its LSE too, and its gradients in bf16."""
    c = SOFTMAX_PRODUCT_CASES[case]
    rng = np.random.default_rng(7)
    (Tq, Tk), (H, Hk), (Dk, Dv) = c["T"], c["H"], c["D"]
    B = 1 if "cu_seqlens" in c["kw"] else 2
    q, k, v = (rng.standard_normal(s).astype(BF16) for s in ((B, Tq, H, Dk), (B, Tk, Hk, Dk), (B, Tk, Hk, Dv)))
    kw = dict(c["kw"])
    if kw.get("alibi_slopes") == "alibi":
        kw["alibi_slopes"] = np.linspace(0.05, 0.2, H, dtype=np.float32)
    if "cu_seqlens" in kw:
        kw["cu_seqlens"] = np.array(kw["cu_seqlens"], np.int64)
    o, lse = pyattn.softmax_attention(q, k, v, return_lse=True, **kw)
    ref_kw = dict(kw, form="parallel")
    if "alibi_slopes" in kw:
        ref_kw["alibi_slopes"] = kw["alibi_slopes"].astype(np.float64)
    o64, lse64 = pyattn.reference.softmax_attention(*(x.astype(np.float64) for x in (q, k, v)),
                                                    return_lse=True, **ref_kw)
    assert o.dtype == BF16 and lse.dtype == np.float32
    assert rel_rms(o.astype(np.float64), o64) <= TOL
    assert rel_rms(lse, lse64) <= TOL
    out, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, **kw)
    assert np.array_equal(out.view(np.uint16), o.view(np.uint16))
    do = rng.standard_normal(o.shape).astype(BF16)
    g = pullback(do)
    _, ref_pullback = pyattn.vjp(pyattn.softmax_attention, *(x.astype(np.float64) for x in (q, k, v)), **ref_kw)
    g64 = ref_pullback(do.astype(np.float64))
    for name in ("q", "k", "v"):
        assert g[name].dtype == BF16 and rel_rms(g[name].astype(np.float64), g64[name]) <= TOL, name


def test_softmax_bf16_nonfinite_v_takes_the_float_kernel():
    """A NaN in a key a causal query cannot see stays out of its output on every path."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 90, 2, 32)).astype(BF16) for _ in range(3))
    v[0, 60, 1, 5] = np.nan
    o = pyattn.softmax_attention(q, k, v, causal=True).astype(np.float64)
    assert np.isfinite(o[:, :60]).all() and np.isfinite(o[:, 60:, 0]).all()
    assert np.isnan(o[0, 60:, 1, 5]).all()


def test_dsa_index_loss_bf16():
    """dsa_index_loss (not an op of OPS: a loss with its gradients) on bf16 arrays: computed in
    float32, the loss and each gradient within 1e-2 of float64's on the same values, each
    gradient bf16."""
    rng = np.random.default_rng(3)
    shapes = ((2, 17, 4, 8), (2, 17, 2, 8), (2, 17, 2, 4), (2, 17, 4), (2, 17, 2))
    a16 = [rng.standard_normal(s).astype(BF16) for s in shapes]
    loss, grads = pyattn.dsa_index_loss(*a16, top_k=5)
    ref, g64 = pyattn.dsa_index_loss(*[a.astype(np.float64) for a in a16], top_k=5)
    assert abs(loss - ref) <= TOL * ref
    for name, g in g64.items():
        assert grads[name].dtype == BF16, name
        assert rel_rms(grads[name].astype(np.float64), g) <= TOL, name


# ---- _core.gemm_bf16: float32 operands multiplied in bf16 (a bf16 HybridLM's projections) ----

PRODUCTS = pyattn.build_info()["isa"] in pyattn._runtime.BF16_PRODUCT_ISAS
needs_products = pytest.mark.skipif(not PRODUCTS, reason="this CPU (or PYATTN_ISA) has no bf16 "
                                    "products (AVX512-BF16 or AMX-BF16)")
# past one tile of C (96 x 64) and one pass over the pairs (256, i.e. K = 512) each way
GEMM_BF16_SIZES = [(1, 1, 1), (5, 7, 3), (33, 65, 31), (97, 130, 600), (200, 33, 513), (12, 70, 40)]


def _rounded(a):
    return a.astype(BF16).astype(np.float64)


@needs_products
@pytest.mark.parametrize("size", GEMM_BF16_SIZES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_bf16(size):
    """gemm_bf16 is the product of its operands rounded to bf16, which is exact in float32,
    summed in float32: within (K + 3) float32 epsilons of the magnitude |A| |B| of the float64
    product of the rounded operands, for each op(a), op(b), and beta 0 (c not read: NaN
    there) or 1."""
    M, N, K = size
    rng = np.random.default_rng(M * N + K)
    eps = np.finfo(np.float32).eps
    for ta in (False, True):
        for tb in (False, True):
            a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
            b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
            c0 = rng.standard_normal((M, N)).astype(np.float32)
            A, B = _rounded(a.T if ta else a), _rounded(b.T if tb else b)
            for alpha, beta in ((1.0, 0.0), (-0.75, 1.0)):
                c = np.full((M, N), np.nan, np.float32) if beta == 0 else c0.copy()
                assert pyattn._core.gemm_bf16(a, b, c, ta, tb, alpha, beta) is None
                ref = alpha * (A @ B) + beta * c0
                mag = abs(alpha) * (np.abs(A) @ np.abs(B)) + beta * np.abs(c0)
                err = np.abs(c - ref)
                assert np.all(err <= (K + 3) * eps * mag), (ta, tb, beta, err.max())
                # and the bf16 rounding is there: the float32 product differs
                if K > 1:
                    assert not np.array_equal(c, (alpha * ((a.T if ta else a) @ (b.T if tb else b))
                                                  + beta * c0).astype(np.float32))


@needs_products
def test_gemm_bf16_same_bits_at_any_thread_count_and_nan_rows():
    """Each entry of C gets the same operations at 1 and 2 threads; a NaN in row i of A makes
    row i of C NaN and leaves the others finite."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((300, 700)).astype(np.float32)
    b = rng.standard_normal((150, 700)).astype(np.float32)
    out = []
    for n in (1, 2):
        c = np.empty((300, 150), np.float32)
        with pyattn.num_threads(n):
            pyattn._core.gemm_bf16(a, b, c, False, True, 1.0, 0.0)
        out.append(c)
    assert np.array_equal(out[0], out[1])
    a[7, 123] = np.nan
    c = np.empty((300, 150), np.float32)
    pyattn._core.gemm_bf16(a, b, c, False, True, 1.0, 0.0)
    assert np.isnan(c[7]).all() and np.isfinite(np.delete(c, 7, axis=0)).all()


def test_gemm_bf16_errors():
    """float32 only, beta 0 or 1, and a RuntimeError that says why on a CPU without bf16
    products."""
    a = np.ones((4, 3), np.float32)
    b = np.ones((3, 5), np.float32)
    c = np.empty((4, 5), np.float32)
    if not PRODUCTS:
        with pytest.raises(RuntimeError, match="no bf16 products"):
            pyattn._core.gemm_bf16(a, b, c, False, False, 1.0, 0.0)
        return
    with pytest.raises(TypeError, match="float32"):
        pyattn._core.gemm_bf16(a.astype(np.float64), b.astype(np.float64), c.astype(np.float64),
                               False, False, 1.0, 0.0)
    with pytest.raises(ValueError, match="beta must be 0 or 1"):
        pyattn._core.gemm_bf16(a, b, c, False, False, 1.0, 0.5)
    with pytest.raises(ValueError, match="inner dimensions"):
        pyattn._core.gemm_bf16(a, b.T.copy(), c, False, False, 1.0, 0.0)


def test_bf16_model_projections_multiply_in_bf16(monkeypatch):
    """A bf16 HybridLM's projections go through gemm_bf16 (forward, both gradients, decoding)
    exactly where the CPU multiplies bf16; a float32 model's never do."""
    from pyattn.nn import HybridLM, cross_entropy, layers

    seen = []
    real = layers._core.gemm_bf16
    monkeypatch.setattr(layers._core, "gemm_bf16",
                        lambda a, b, c, ta, tb, alpha, beta: seen.append((ta, tb)) or
                        real(a, b, c, ta, tb, alpha, beta))
    tokens = np.random.default_rng(0).integers(0, 32, (2, 9))
    for dtype in ("float32", "bfloat16"):
        seen.clear()
        model = HybridLM(32, 16, 1, "gated_deltanet", n_heads=2, dtype=dtype)
        logits = model.forward(tokens)
        model.backward(cross_entropy(logits, tokens)[1])
        model.generate(tokens[:, :3], 2, temperature=0)
        kinds = set(seen)
        if dtype == "bfloat16" and PRODUCTS:
            assert kinds == {(False, True), (True, False), (False, False)}
        else:
            assert not seen


# ---- the chunk forms of the linear and delta engines multiply bf16 calls in bf16 ----

CHUNK_PRODUCT_OPS = ("simple_gla", "gla", "retention", "rwkv6", "gated_delta_rule", "kda",
                     "dplr_delta_rule", "rwkv7")


def _chunk_call(name, rng, T=150, H=2, D=32):
    """(arrays, kwargs) of a bf16 call of the chunk form: keys unit-norm for the delta rule"""
    q, k, v = (rng.standard_normal((2, T, H, D)) for _ in range(3))
    gate = lambda *s: -np.logaddexp(0.0, -rng.standard_normal((2, T, H) + s)) / 8
    beta = 1 / (1 + np.exp(-rng.standard_normal((2, T, H))))
    unit = k / np.linalg.norm(k, axis=-1, keepdims=True)
    u = rng.standard_normal((H, D)) * 0.1
    # RWKV-7's low-rank terms: a = -kappa, b = kappa lr (kappa a unit vector, lr in (0.1, 1))
    lr = rng.uniform(0.1, 1, (2, T, H, 1))
    args = {"simple_gla": (q, k, v, gate()), "gla": (q, k, v, gate(D)), "retention": (q, k, v),
            "rwkv6": (q, k, v, gate(D), u),
            "gated_delta_rule": (q, unit, v, gate(), beta), "kda": (q, unit, v, gate(D), beta),
            "dplr_delta_rule": (q, k, v, -unit, unit * lr, gate(D)),
            "rwkv7": (q, gate(D), k, v, -unit, unit * lr)}[name]
    return [a.astype(BF16) for a in args], {"form": "chunk", "output_final_state": True}


@pytest.mark.parametrize("name", CHUNK_PRODUCT_OPS)
def test_chunk_forward_multiplies_in_bf16(name):
    """The chunk forward of a bf16 call rounds its products' operands to bf16 exactly where the
    CPU multiplies bf16 (elsewhere it is the float32 call's, to the bit), stays within 1e-2 of
    float64 with its final state, gives the same bits on 1 and 2 threads and leaves the float32
    calls after it unchanged. Under vjp the forward is the float32 call's on every CPU, and the
    gradients are within 1e-2."""
    fn = getattr(pyattn, name)
    a16, kw = _chunk_call(name, np.random.default_rng(11))
    a32 = [a.astype(np.float32) for a in a16]
    f32_before = fn(*a32, **kw)
    with pyattn.num_threads(1):
        o1, ht1 = fn(*a16, **kw)
    with pyattn.num_threads(2):
        o2, ht2 = fn(*a16, **kw)
    assert np.array_equal(o1.view(np.uint16), o2.view(np.uint16)) and np.array_equal(ht1, ht2)
    o32, ht32 = fn(*a32, **kw)
    assert all(np.array_equal(x, y) for x, y in zip(f32_before, (o32, ht32)))
    same = np.array_equal(o1.view(np.uint16), o32.astype(BF16).view(np.uint16)) and np.array_equal(ht1, ht32)
    assert same != PRODUCTS
    o64, ht64 = fn(*(a.astype(np.float64) for a in a16), **kw)
    assert rel_rms(o1.astype(np.float64), o64) <= TOL and rel_rms(ht1, ht64) <= TOL
    # under vjp the forward multiplies in float32, as the backward does: the output is the
    # float32 call's, rounded
    do = np.random.default_rng(12).standard_normal(o1.shape).astype(BF16)
    (ov, htv), pull16 = pyattn.vjp(fn, *a16, **kw)
    assert np.array_equal(ov.view(np.uint16), o32.astype(BF16).view(np.uint16)) and np.array_equal(htv, ht32)
    _, pull64 = pyattn.vjp(fn, *(a.astype(np.float64) for a in a16), **kw)
    g16, g64 = pull16((do, None)), pull64((do.astype(np.float64), None))
    for key in g64:
        assert rel_rms(g16[key].astype(np.float64), g64[key]) <= TOL, key

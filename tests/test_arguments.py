"""Arguments are checked alike by every op (pyattn/_validate.py): array-likes converted as
NumPy users expect, flags that must be real booleans, forms and chunk sizes that must be
what they say, scales that must fit the dtype, unaligned and byte-swapped arrays copied,
messages that name the argument at fault, the environment and the thread count checked,
and MemoryErrors that say how much was asked for."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import pyattn
from pyattn import _validate as V

from conftest import raises

F32, F64 = np.float32, np.float64


def arrays(*shapes, dtype=F64, seed=0):
    r = np.random.default_rng(seed)
    return [r.standard_normal(s).astype(dtype) for s in shapes]


def qkv(B=1, T=9, H=2, K=4, Vd=3, dtype=F64):
    return arrays((B, T, H, K), (B, T, H, K), (B, T, H, Vd), dtype=dtype)


def gate(B=1, T=9, H=2, dtype=F64):
    return (-np.random.default_rng(1).uniform(0, 1, (B, T, H))).astype(dtype)


def mamba2_args(dtype=F64, H=4, G=2):
    x, dt, B, C = arrays((1, 9, H, 3), (1, 9, H), (1, 9, G, 2), (1, 9, G, 2), dtype=dtype)
    return [x, dt, -np.linspace(0.5, 1.5, H).astype(dtype), B, C]


# One call per op family: (name, callable, args, kwargs).
CALLS = {
    "softmax_attention": lambda dt=F64: (pyattn.softmax_attention, qkv(H=2, dtype=dt), dict(causal=True)),
    "linear_attention": lambda dt=F64: (pyattn.linear_attention, qkv(dtype=dt), dict(feature_map="elu1")),
    "retention": lambda dt=F64: (pyattn.retention, qkv(dtype=dt), {}),
    "lightning_attention": lambda dt=F64: (pyattn.lightning_attention, qkv(dtype=dt), {}),
    "simple_gla": lambda dt=F64: (pyattn.simple_gla, qkv(dtype=dt) + [gate(dtype=dt)], {}),
    "gla": lambda dt=F64: (pyattn.gla, qkv(dtype=dt) + [-np.abs(qkv(dtype=dt)[0])], {}),
    "mamba2": lambda dt=F64: (pyattn.mamba2, mamba2_args(dt), {}),
    "efficient_attention": lambda dt=F64: (pyattn.efficient_attention, qkv(dtype=dt), {}),
}


def first(out):
    return out[0] if isinstance(out, tuple) else out


# ----------------------------------------------------------------------- array-likes


@pytest.mark.parametrize("op", sorted(CALLS))
def test_lists_are_arrays(op):
    fn, args, kw = CALLS[op]()
    np.testing.assert_array_equal(first(fn(*[a.tolist() for a in args], **kw)), first(fn(*args, **kw)))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_lists_and_scalars_take_the_calls_dtype(dtype):
    q, k, v = qkv(dtype=dtype)
    o, _ = pyattn.retention(q, k, v, gamma=[0.9, 0.8])
    assert o.dtype == dtype
    np.testing.assert_array_equal(o, pyattn.retention(q, k, v, gamma=np.array([0.9, 0.8], dtype))[0])
    o2, _ = pyattn.retention(q, k, v.tolist(), gamma=0.9)  # a list v takes q's dtype
    assert o2.dtype == dtype


def test_all_lists_are_float64():
    q, k, v = qkv()
    assert pyattn.softmax_attention(q.tolist(), k.tolist(), v.tolist()).dtype == F64


@pytest.mark.parametrize("op,name,value", [
    ("retention", "gamma", 0.9),
    ("lightning_attention", "slopes", 0.25),
])
def test_scalar_per_head_constant(op, name, value):
    """A scalar decay is that decay for every head; its gradient is the sum over heads."""
    fn = getattr(pyattn, op)
    q, k, v = qkv()
    scalar_out, scalar_pb = pyattn.vjp(fn, q, k, v, **{name: value})
    full_out, full_pb = pyattn.vjp(fn, q, k, v, **{name: np.full(2, value)})
    np.testing.assert_array_equal(scalar_out[0], full_out[0])
    do = np.ones_like(full_out[0])
    g_scalar, g_full = scalar_pb(do)[name], full_pb(do)[name]
    assert g_scalar.shape == ()
    np.testing.assert_allclose(g_scalar, g_full.sum(), rtol=1e-12)


def test_mamba2_scalar_per_head_arguments():
    x, dt, A, B, C = mamba2_args()
    out, pb = pyattn.vjp(pyattn.mamba2, x, dt, -1.0, B, C, D=0.5, dt_bias=0.1)
    ref, ref_pb = pyattn.vjp(pyattn.mamba2, x, dt, np.full(4, -1.0), B, C, D=np.full(4, 0.5),
                             dt_bias=np.full(4, 0.1))
    np.testing.assert_array_equal(out[0], ref[0])
    g, g_ref = pb(np.ones_like(out[0])), ref_pb(np.ones_like(out[0]))
    for name in ("A", "D", "dt_bias"):
        assert g[name].shape == ()
        np.testing.assert_allclose(g[name], g_ref[name].sum(), rtol=1e-12)


def test_alibi_slopes_list_and_scalar():
    q, k, v = qkv()
    ref = pyattn.softmax_attention(q, k, v, alibi_slopes=np.array([0.5, 0.5]))
    np.testing.assert_array_equal(pyattn.softmax_attention(q, k, v, alibi_slopes=[0.5, 0.5]), ref)
    np.testing.assert_array_equal(pyattn.softmax_attention(q, k, v, alibi_slopes=0.5), ref)


@pytest.mark.parametrize("op", ["softmax_attention", "simple_gla", "efficient_attention"])
def test_cu_seqlens_as_list(op):
    fn, args, kw = CALLS[op]()
    np.testing.assert_array_equal(first(fn(*args, cu_seqlens=[0, 4, 9], **kw)),
                                  first(fn(*args, cu_seqlens=np.array([0, 4, 9]), **kw)))


def test_window_as_array():
    q, k, v = qkv()
    np.testing.assert_array_equal(pyattn.softmax_attention(q, k, v, window=np.array([2, 0])),
                                  pyattn.softmax_attention(q, k, v, window=(2, 0)))


def test_ndarray_dtypes_still_never_mix():
    q, k, v = qkv()
    raises(TypeError, pyattn.retention, q, k, v, gamma=np.array([0.9, 0.8], F32),
           must=("'gamma'", "float32", "float64"))
    raises(TypeError, pyattn.simple_gla, q, k, v, np.zeros((1, 9, 2), np.int64), must=("'g'", "int64"))


@pytest.mark.parametrize("bad,shown", [("abc", "str"), ([[1, "a"]], "list"), ({"a": 1}, "dict"), (True, "bool")])
def test_non_numeric_array_likes(bad, shown):
    q, k, v = qkv()
    raises(TypeError, pyattn.retention, q, k, v, gamma=bad, must=("'gamma'", shown))


def test_pullback_takes_list_cotangent():
    q, k, v = qkv()
    (o, _), pb = pyattn.vjp(pyattn.simple_gla, q, k, v, gate())
    np.testing.assert_array_equal(pb((o.tolist(), None))["g"], pb(o)["g"])



class ArrayOnly:
    """An array-like with __array__ alone (as pandas, xarray, a torch tensor): it carries
    its dtype."""

    def __init__(self, a):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        return self._a if dtype is None else self._a.astype(dtype)


class DLPackOnly:
    """An array-like with __dlpack__ alone (the array API's interchange)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)


WRAPS = {"array": ArrayOnly, "dlpack": DLPackOnly}


@pytest.mark.parametrize("wrap", sorted(WRAPS))
@pytest.mark.parametrize("op", sorted(CALLS))
def test_array_likes_keep_their_dtype(op, wrap):
    """float32 array-likes are computed in float32, as the same NumPy arrays are."""
    fn, args, kw = CALLS[op](F32)
    out = first(fn(*[WRAPS[wrap](a) for a in args], **kw))
    assert out.dtype == F32
    np.testing.assert_array_equal(out, first(fn(*args, **kw)))


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_array_likes_follow_the_dtype_rules(wrap):
    """An array-like's dtype decides the call's as an ndarray's does: lists and scalars take
    it, ndarrays must match it, and float16 is refused with the ndarray's message."""
    q, k, v = qkv(dtype=F32)
    o, _ = pyattn.retention(WRAPS[wrap](q), k.tolist(), v, gamma=0.9)
    assert o.dtype == F32
    np.testing.assert_array_equal(o, pyattn.retention(q, k, v, gamma=0.9)[0])
    raises(TypeError, pyattn.retention, q, WRAPS[wrap](k.astype(F64)), v, must=("one dtype", "'q'", "'k'"))
    got = raises(TypeError, pyattn.retention, WRAPS[wrap](q.astype(np.float16)), k, v)
    assert got == raises(TypeError, pyattn.retention, q.astype(np.float16), k, v)
    (o, _), pb = pyattn.vjp(pyattn.retention, q, k, v)
    assert pb(WRAPS[wrap](np.ones_like(o)))["q"].dtype == F32


def test_numpy_scalars_take_the_calls_dtype():
    """NumPy scalars have __array__ but stay scalars: like Python numbers, they take the
    call's dtype."""
    q, k, v = qkv(dtype=F32)
    o, _ = pyattn.retention(q, k, v, gamma=np.float64(0.9))
    assert o.dtype == F32
    np.testing.assert_array_equal(o, pyattn.retention(q, k, v, gamma=0.9)[0])


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_index_array_likes(wrap):
    q, k, v = qkv()
    np.testing.assert_array_equal(pyattn.softmax_attention(q, k, v, cu_seqlens=WRAPS[wrap](np.array([0, 4, 9]))),
                                  pyattn.softmax_attention(q, k, v, cu_seqlens=[0, 4, 9]))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", sorted(CALLS))
def test_torch_tensors_keep_their_dtype(op, dtype):
    torch = pytest.importorskip("torch")
    fn, args, kw = CALLS[op](np.dtype(dtype).type)
    out = first(fn(*[torch.from_numpy(a) for a in args], **kw))
    assert isinstance(out, np.ndarray) and out.dtype == dtype
    np.testing.assert_array_equal(out, first(fn(*args, **kw)))
    (o, _), pb = pyattn.vjp(pyattn.retention, *[torch.from_numpy(a) for a in qkv(dtype=np.dtype(dtype).type)])
    assert o.dtype == pb(torch.ones(o.shape, dtype=getattr(torch, dtype)))["k"].dtype == dtype


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_half_tensors_refused_like_numpy_float16(dtype):
    torch = pytest.importorskip("torch")
    q, k, v = qkv()
    half = torch.from_numpy(q).to(getattr(torch, dtype))
    numpy_msg = raises(TypeError, pyattn.softmax_attention, q.astype(np.float16), k, v)
    msg = raises(TypeError, pyattn.softmax_attention, half, k, v, must=("'q' must be float32 or float64", dtype))
    if dtype == "float16":
        assert msg == numpy_msg


def test_torch_tensor_requiring_grad_points_to_pyattn_torch():
    torch = pytest.importorskip("torch")
    q, k, v = qkv()
    kt = torch.from_numpy(k).requires_grad_()
    for call in ((pyattn.softmax_attention,), (pyattn.vjp, pyattn.softmax_attention)):
        raises(TypeError, *call, q, kt, v, must=("softmax_attention(): 'k'", "requires grad",
                                                 "use pyattn.torch for torch tensors and autograd"))
    np.testing.assert_array_equal(pyattn.softmax_attention(q, kt.detach(), v), pyattn.softmax_attention(q, k, v))


def test_torch_index_tensors():
    torch = pytest.importorskip("torch")
    q, k, v = qkv()
    for dtype in (torch.int32, torch.int64):
        np.testing.assert_array_equal(
            pyattn.softmax_attention(q, k, v, cu_seqlens=torch.tensor([0, 4, 9], dtype=dtype)),
            pyattn.softmax_attention(q, k, v, cu_seqlens=[0, 4, 9]))


# ----------------------------------------------------------------------- booleans


FLAGS = [
    ("softmax_attention", "causal"),
    ("softmax_attention", "return_lse"),
    ("simple_gla", "output_final_state"),
    ("linear_attention", "normalize"),
    ("linear_attention", "output_final_state"),
    ("mamba2", "dt_softplus"),
]


@pytest.mark.parametrize("op,flag", FLAGS)
@pytest.mark.parametrize("bad", ["yes", np.array([1, 0]), 1, None, 0.0], ids=["str", "array", "int", "None", "float"])
def test_flags_must_be_bools(op, flag, bad):
    fn, args, kw = CALLS[op]()
    raises(TypeError, fn, *args, **{**kw, flag: bad}, must=(f"'{flag}'", "bool", type(bad).__name__))
    raises(TypeError, pyattn.vjp, fn, *args, **{**kw, flag: bad}, must=(f"'{flag}'",))


@pytest.mark.parametrize("op,flag", FLAGS)
def test_numpy_bools_accepted(op, flag):
    fn, args, kw = CALLS[op]()
    a = fn(*args, **{**kw, flag: np.bool_(True)})
    b = fn(*args, **{**kw, flag: True})
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------- forms and chunk sizes


@pytest.mark.parametrize("op", sorted(CALLS))
@pytest.mark.parametrize("bad", [np.array(["chunk"]), ["flash"], None, 0], ids=["array", "list", "None", "int"])
def test_form_must_be_a_string(op, bad):
    fn, args, kw = CALLS[op]()
    raises(ValueError, fn, *args, form=bad, **kw, must=("form", "one of", repr(bad)))


@pytest.mark.parametrize("op", ["simple_gla", "gla", "mamba2", "linear_attention", "retention"])
@pytest.mark.parametrize("bad,exc", [(np.array([64]), TypeError), (64.0, TypeError), ("64", TypeError),
                                     (True, TypeError), (48, ValueError)], ids=["array", "float", "str", "bool", "48"])
def test_chunk_size_must_be_an_allowed_int(op, bad, exc):
    fn, args, kw = CALLS[op]()
    raises(exc, fn, *args, chunk_size=bad, **kw, must=("chunk_size",))


def test_chunk_size_numpy_int_accepted():
    fn, args, kw = CALLS["simple_gla"]()
    np.testing.assert_array_equal(fn(*args, chunk_size=np.int64(16))[0], fn(*args, chunk_size=16)[0])


# ----------------------------------------------------------------------- scales and dtypes


@pytest.mark.parametrize("op", ["softmax_attention", "simple_gla", "gla", "retention", "linear_attention",
                                "efficient_attention"])
def test_scale_overflowing_float32(op):
    fn, args, kw = CALLS[op](F32)
    raises(ValueError, fn, *args, scale=1e39, **kw, must=("'scale'", "1e+39", "float32"))
    fn64, args64, kw64 = CALLS[op](F64)
    assert np.all(np.isfinite(first(fn64(*args64, scale=1e-39, **kw64))))
    fn64(*args64, scale=1e39, **kw64)  # finite in float64: accepted


def test_softcap_and_eps_overflowing_float32():
    q, k, v = qkv(dtype=F32)
    raises(ValueError, pyattn.softmax_attention, q, k, v, softcap=1e39, must=("'softcap'", "float32"))
    raises(ValueError, pyattn.linear_attention, q, k, v, normalize=True, eps=1e39, must=("'eps'", "float32"))


def _unaligned(a):
    """A copy of a whose data starts one byte past an aligned address."""
    buf = np.zeros(a.nbytes + 1, np.uint8)
    out = buf[1:].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert not out.flags.aligned
    return out


@pytest.mark.parametrize("op", sorted(CALLS))
@pytest.mark.parametrize("how", ["unaligned", "byteswapped", "strided"])
def test_unaligned_byteswapped_strided_copied(op, how):
    fn, args, kw = CALLS[op]()
    if how == "unaligned":
        odd = [_unaligned(a) for a in args]
    elif how == "byteswapped":
        odd = [a.astype(a.dtype.newbyteorder(">")) for a in args]
    else:
        odd = [np.repeat(a, 2, axis=-1)[..., ::2] for a in args]
    ref = fn(*args, **kw)
    got = fn(*odd, **kw)
    for x, y in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        if y is not None:
            np.testing.assert_array_equal(x, y)
    out, pb = pyattn.vjp(fn, *odd, **kw)
    do = first(out)
    grads = pb(_unaligned(do) if how == "unaligned" else do.astype(do.dtype.newbyteorder(">")))
    ref_grads = pyattn.vjp(fn, *args, **kw)[1](do)
    for name in ref_grads:
        np.testing.assert_array_equal(grads[name], ref_grads[name], err_msg=name)


def test_feature_map_unaligned_and_byteswapped():
    (x,) = arrays((2, 5, 3, 4))
    ref = pyattn.feature_map(x, "taylor")
    np.testing.assert_array_equal(pyattn.feature_map(_unaligned(x), "taylor"), ref)
    np.testing.assert_array_equal(pyattn.feature_map(x.astype(">f8"), "taylor"), ref)
    W = arrays((6, 4))[0]
    np.testing.assert_array_equal(pyattn.feature_map(x, "performer", projection=_unaligned(W)),
                                  pyattn.feature_map(x, "performer", projection=W))


# ----------------------------------------------------------------------- messages


@pytest.mark.parametrize("H,Hk", [(4, 3), (2, 4)])
def test_gqa_message_names_the_array(H, Hk):
    q, = arrays((1, 5, H, 4))
    k, v = arrays((1, 5, Hk, 4), (1, 5, Hk, 4))
    raises(ValueError, pyattn.softmax_attention, q, k, v,
           must=(f"'k' has Hk={Hk} heads; q's H={H} must be a multiple of it",))


def test_mamba2_groups_message_names_the_array():
    x, dt, A, B, C = mamba2_args(H=4, G=3)
    raises(ValueError, pyattn.mamba2, x, dt, A, B, C, must=("'B' has G=3 groups; x's H=4 must be a multiple of it",))


def test_divides_is_general():
    V.divides("op", "k", 2, "heads", "q", 6)
    raises(ValueError, V.divides, "op", "beta", 4, "heads", "q", 6, "Hb", "H",
           must=("op(): 'beta' has Hb=4 heads; q's H=6 must be a multiple of it",))


def test_memory_error_says_how_much():
    """The parallel form materialises the scores: 10^6 x 10^6 of them cannot be allocated."""
    n = 1_000_000
    q = np.zeros((1, n, 1, 1))
    msg = raises(MemoryError, pyattn.softmax_attention, q, q, q, form="parallel", must=("bytes", "GiB"))
    asked = int(msg.split("allocate ")[1].split(" bytes")[0])
    assert asked >= 8 * n * 64  # at least a block of score rows of n keys, in float64


def test_reduce_to():
    g = np.arange(6.0).reshape(2, 3)
    assert V.reduce_to(g, np.zeros(())).shape == ()
    np.testing.assert_array_equal(V.reduce_to(g, np.zeros((1, 3))), g.sum(0, keepdims=True))
    np.testing.assert_array_equal(V.reduce_to(g, np.zeros(3)), g.sum(0))
    assert V.reduce_to(g, np.zeros((2, 3))) is g


# ----------------------------------------------------------------------- environment and threads


def _import_with_env(**env):
    return subprocess.run([sys.executable, "-c", "import pyattn; print(pyattn.build_info()['isa'])"],
                          env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)


def test_unknown_pyattn_isa_warns_at_import():
    run = _import_with_env(PYATTN_ISA="avx-512")
    assert run.returncode == 0, run.stderr
    assert "RuntimeWarning" in run.stderr and "PYATTN_ISA='avx-512'" in run.stderr
    assert "avx512, avx2, generic" in run.stderr


def test_known_pyattn_isa_is_quiet():
    run = _import_with_env(PYATTN_ISA="generic")
    assert run.returncode == 0 and run.stdout.strip() == "generic"
    assert "Warning" not in run.stderr, run.stderr


def test_set_num_threads_above_cpu_count_warns_once(monkeypatch):
    before = pyattn.get_num_threads()
    monkeypatch.setattr(pyattn._runtime, "_warned_oversubscription", False)
    monkeypatch.setattr(pyattn._runtime, "_cpu_count", lambda: 2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pyattn.set_num_threads(2)
        with pytest.warns(RuntimeWarning, match=r"set_num_threads\(3\).*2 CPUs"):
            pyattn.set_num_threads(3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pyattn.set_num_threads(5)
        assert pyattn.get_num_threads() == 5
    finally:
        pyattn.set_num_threads(before)


# ----------------------------------------------------------------------- documentation


def test_vjp_documents_inputs_modified_after_the_forward():
    doc = " ".join(pyattn.vjp.__doc__.split())
    assert "modif" in doc and "before the pullback" in doc


def test_assert_close_default_tolerance_per_dtype():
    ref = np.linspace(1.0, 2.0, 100)
    assert pyattn.testing.assert_close(ref * (1 + 5e-11), ref) <= 1e-10
    with pytest.raises(AssertionError, match="1.0e-10"):
        pyattn.testing.assert_close(ref * (1 + 1e-8), ref)
    assert pyattn.testing.assert_close((ref * (1 + 5e-6)).astype(F32), ref) <= 1e-5
    with pytest.raises(AssertionError, match="1.0e-05"):
        pyattn.testing.assert_close((ref * (1 + 1e-4)).astype(F32), ref)
    with pytest.raises(AssertionError, match="1.0e-05"):
        pyattn.testing.assert_close(ref, (ref * (1 + 1e-4)).astype(F32))


def test_set_num_threads_takes_numpy_ints():
    before = pyattn.get_num_threads()
    try:
        pyattn.set_num_threads(np.int64(1))
        assert pyattn.get_num_threads() == 1
    finally:
        pyattn.set_num_threads(before)
    raises(TypeError, pyattn.set_num_threads, np.float64(2.0), must=("'n'", "int", "float64"))

"""Bad input raises, never crashes (docs/ops.md): the right exception type, and a message
that names the argument and shows what was expected and what was received. Both through the
public API and by calling pyattn._core's entry points directly with bad buffers."""
from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn import _core

from conftest import case_params, raises, run_bad_arg_case

F64 = np.float64


def qkv(B=2, Tq=5, Tk=5, H=4, Hk=2, Dk=8, Dv=6, dtype=F64):
    r = np.random.default_rng(0)
    return (r.standard_normal((B, Tq, H, Dk)).astype(dtype),
            r.standard_normal((B, Tk, Hk, Dk)).astype(dtype),
            r.standard_normal((B, Tk, Hk, Dv)).astype(dtype))


sa = pyattn.softmax_attention


# ----------------------------------------------------------------------- shapes and dtypes


def _with(i, new):
    args = list(qkv())
    args[i] = new
    return args


def test_wrong_ndim():
    q, k, v = qkv()
    raises(ValueError, sa, q[0], k, v, must=("'q'", "4-D", "(5, 4, 8)"))
    raises(ValueError, sa, q, k[..., None], v, must=("'k'", "4-D", "(2, 5, 2, 8, 1)"))
    raises(ValueError, sa, q, k, v[0, 0], must=("'v'", "4-D", "(2, 6)"))
    raises(ValueError, sa, np.zeros(()), k, v, must=("'q'", "4-D", "()"))


def test_mismatched_batch():
    q, k, v = qkv()
    raises(ValueError, sa, q, k[:1], v, must=("batch", "q=2", "k=1", "v=2"))
    raises(ValueError, sa, q, k, np.concatenate([v, v]), must=("batch", "v=4"))


def test_mismatched_key_lengths():
    q, k, v = qkv()
    raises(ValueError, sa, q, k, v[:, :3], must=("key lengths", "k=5", "v=3"))


def test_mismatched_kv_heads():
    q, k, v = qkv()
    raises(ValueError, sa, q, k, v[:, :, :1], must=("KV head", "k=2", "v=1"))


def test_mismatched_key_dim():
    q, k, v = qkv()
    raises(ValueError, sa, q, k[..., :5], v, must=("head dims", "q=8", "k=5"))


@pytest.mark.parametrize("H,Hk", [(4, 3), (2, 4), (5, 2)])
def test_heads_not_divisible(H, Hk):
    q, k, v = qkv(H=H, Hk=Hk)
    raises(ValueError, sa, q, k, v, must=(f"H={H}", f"Hk={Hk}"))


def test_zero_sized_heads_and_dims():
    q, k, v = qkv()
    raises(ValueError, sa, q, k[:, :, :0], v[:, :, :0], must=("Hk=0",))
    raises(ValueError, sa, q[..., :0], k[..., :0], v, must=("Dk=0",))
    raises(ValueError, sa, q, k, v[..., :0], must=("Dv=0",))


@pytest.mark.parametrize("which", [0, 1, 2])
def test_dtype_mismatch(which):
    args = list(qkv())
    args[which] = args[which].astype(np.float32)
    names = ["q", "k", "v"]
    first = names[0] if which else names[1]
    msg = raises(TypeError, sa, *args, must=("float32", "float64", f"'{names[which]}'", f"'{first}'"))
    assert "dtype" in msg


@pytest.mark.parametrize("dtype", [np.float16, np.int64, np.int32, np.complex128, np.bool_, object])
def test_bad_dtype(dtype):
    q, k, v = qkv()
    bad = q.astype(dtype)
    raises(TypeError, sa, bad, k, v, must=("'q'", "float32 or float64", str(np.dtype(dtype))))
    raises(TypeError, sa, q, k.astype(dtype), v, must=("'k'", str(np.dtype(dtype))))


def test_longdouble_rejected():
    q, k, v = qkv()
    raises(TypeError, sa, q, k, v.astype(np.longdouble), must=("'v'", "float32 or float64"))


@pytest.mark.parametrize("bad", ["q", None, True, {"a": 1}, [["a"]]], ids=["str", "None", "bool", "dict", "list of str"])
def test_not_an_array(bad):
    q, k, v = qkv()
    raises(TypeError, sa, q, k, bad, must=("'v'", "array", type(bad).__name__))


@pytest.mark.parametrize("bad", [[[1.0]], 3.0], ids=["list", "float"])
def test_array_likes_are_converted_then_checked(bad):
    q, k, v = qkv()
    raises(ValueError, sa, q, k, bad, must=("'v'", "4-D", str(np.asarray(bad).shape)))


def test_no_silent_upcast_of_alibi():
    q, k, v = qkv()
    raises(TypeError, sa, q, k, v, alibi_slopes=np.ones(4, np.float32),
           must=("'alibi_slopes'", "float32", "float64"))
    raises(TypeError, sa, q, k, v, alibi_slopes=np.ones(4, np.int64), must=("'alibi_slopes'", "int64"))
    raises(ValueError, sa, q, k, v, alibi_slopes=np.ones(3), must=("'alibi_slopes'", "(4,)", "scalar", "(3,)"))
    raises(ValueError, sa, q, k, v, alibi_slopes=np.ones((4, 1)), must=("'alibi_slopes'", "(4, 1)"))


# ----------------------------------------------------------------------- options


@pytest.mark.parametrize("form", ["chunk", "Flash", "", None, 1])
def test_bad_form(form):
    q, k, v = qkv()
    raises(ValueError, sa, q, k, v, form=form, must=("form", repr(form), "'flash'", "'parallel'", "'recurrent'"))


@pytest.mark.parametrize("window", [(1, 2, 3), (4,), 5, "ab", {"l": 1, "r": 2}])
def test_window_not_a_pair(window):
    q, k, v = qkv()
    raises(ValueError, sa, q, k, v, window=window, must=("'window'", repr(window)))


@pytest.mark.parametrize("window,which,value", [((-2, 0), 0, -2), ((0, -5), 1, -5), ((-3, -3), 0, -3)])
def test_window_below_minus_one(window, which, value):
    q, k, v = qkv()
    raises(ValueError, sa, q, k, v, window=window, must=(f"window[{which}]", ">= -1", str(value)))


@pytest.mark.parametrize("window", [(1.5, 0), (0, "1"), (None, 0), (True, 0)])
def test_window_not_ints(window):
    q, k, v = qkv()
    raises(TypeError, sa, q, k, v, window=window, must=("window[", "int"))


def test_window_numpy_ints_accepted():
    q, k, v = qkv()
    a = sa(q, k, v, window=(np.int64(2), np.int32(0)))
    b = sa(q, k, v, window=[2, 0])
    np.testing.assert_array_equal(a, b)


def test_bad_sinks():
    q, k, v = qkv()
    raises(ValueError, sa, q, k, v, sinks=-1, must=("'sinks'", ">= 0", "-1"))
    raises(TypeError, sa, q, k, v, sinks=1.5, must=("'sinks'", "int", "float"))
    raises(TypeError, sa, q, k, v, sinks=None, must=("'sinks'",))


def test_bad_softcap():
    q, k, v = qkv()
    raises(ValueError, sa, q, k, v, softcap=-1.0, must=("'softcap'", ">= 0", "-1.0"))
    raises(ValueError, sa, q, k, v, softcap=float("nan"), must=("'softcap'", "nan"))
    raises(ValueError, sa, q, k, v, softcap=float("inf"), must=("'softcap'", "inf"))
    raises(TypeError, sa, q, k, v, softcap="2", must=("'softcap'", "str"))


def test_bad_scale():
    q, k, v = qkv()
    raises(ValueError, sa, q, k, v, scale=float("nan"), must=("'scale'", "nan"))
    raises(ValueError, sa, q, k, v, scale=float("-inf"), must=("'scale'", "-inf"))
    raises(TypeError, sa, q, k, v, scale="0.5", must=("'scale'", "str"))
    raises(TypeError, sa, q, k, v, scale=np.ones(1), must=("'scale'", "ndarray"))


def test_unknown_keyword():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="chunk_size"):
        sa(q, k, v, chunk_size=64)
    raises(TypeError, pyattn.vjp, sa, q, k, v, chunk_size=64, must=("chunk_size",))


# ----------------------------------------------------------------------- cu_seqlens


def packed(T=10, **kw):
    return qkv(B=1, Tq=T, Tk=T, **kw)


@pytest.mark.parametrize("cu,shown", [
    ([1, 5, 10], "[1, 5, 10]"),      # does not start at 0
    ([0, 6, 4, 10], "[0, 6, 4, 10]"),  # decreasing
    ([0, 5, 9], "[0, 5, 9]"),        # wrong end
    ([0, 5, 11], "[0, 5, 11]"),      # past the end
])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_bad_cu_seqlens_values(cu, shown, dtype):
    q, k, v = packed()
    raises(ValueError, sa, q, k, v, cu_seqlens=np.array(cu, dtype), must=("cu_seqlens", "T=10", shown))


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.uint64, np.int16])
def test_bad_cu_seqlens_dtype(dtype):
    q, k, v = packed()
    raises(TypeError, sa, q, k, v, cu_seqlens=np.array([0, 4, 10], dtype),
           must=("cu_seqlens", "int32 or int64", str(np.dtype(dtype))))


def test_bad_cu_seqlens_shape_and_type():
    q, k, v = packed()
    raises(ValueError, sa, q, k, v, cu_seqlens=np.array([0]), must=("cu_seqlens", "at least 2", "(1,)"))
    raises(ValueError, sa, q, k, v, cu_seqlens=np.array([[0, 10]]), must=("cu_seqlens", "1-D", "(1, 2)"))
    raises(TypeError, sa, q, k, v, cu_seqlens="0, 10", must=("cu_seqlens", "int32 or int64", "str"))


def test_cu_seqlens_needs_batch_1():
    q, k, v = qkv(B=2, Tq=10, Tk=10)
    raises(ValueError, sa, q, k, v, cu_seqlens=np.array([0, 4, 10]), must=("cu_seqlens", "batch", "B=2"))


def test_cu_seqlens_combinations():
    q, k, v = packed()
    cu = np.array([0, 4, 10])
    raises(ValueError, sa, q, k, v, cu_seqlens=cu, cu_seqlens_q=cu, cu_seqlens_k=cu,
           must=("cu_seqlens", "cu_seqlens_q"))
    raises(ValueError, sa, q, k, v, cu_seqlens_q=cu, must=("cu_seqlens_q", "cu_seqlens_k", "together"))
    raises(ValueError, sa, q, k, v, cu_seqlens_k=cu, must=("cu_seqlens_q", "cu_seqlens_k"))
    raises(ValueError, sa, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=np.array([0, 2, 3, 10]),
           must=("cu_seqlens_q", "cu_seqlens_k", "3", "4"))
    q2, k2, v2 = qkv(B=1, Tq=6, Tk=10)
    raises(ValueError, sa, q2, k2, v2, cu_seqlens=cu, must=("cu_seqlens", "Tq=6", "Tk=10"))
    raises(ValueError, sa, q2, k2, v2, cu_seqlens_q=np.array([0, 3, 7]), cu_seqlens_k=cu,
           must=("cu_seqlens_q", "T=6", "[0, 3, 7]"))


# ----------------------------------------------------------------------- vjp


def test_vjp_cotangent_wrong_shape():
    q, k, v = qkv()
    out, pullback = pyattn.vjp(sa, q, k, v)
    raises(ValueError, pullback, out[:, :3], must=("'do'", str(out.shape), str(out[:, :3].shape)))
    raises(ValueError, pullback, out[..., None], must=("'do'", str(out.shape)))
    (o, lse), pullback = pyattn.vjp(sa, q, k, v, return_lse=True)
    raises(ValueError, pullback, (o, lse[:, :2]), must=("'dlse'", str(lse.shape), str(lse[:, :2].shape)))
    raises(ValueError, pullback, (o, lse, lse), must=("cotangent", "2", "3"))
    raises(ValueError, pullback, (o,), must=("cotangent", "2", "1"))


def test_vjp_cotangent_wrong_dtype_and_type():
    q, k, v = qkv()
    out, pullback = pyattn.vjp(sa, q, k, v)
    raises(TypeError, pullback, out.astype(np.float32), must=("'do'", "float32", "float64"))
    raises(TypeError, pullback, out.astype(np.int64), must=("'do'", "int64"))
    raises(TypeError, pullback, "3.0", must=("'do'", "array", "str"))
    raises(ValueError, pullback, 3.0, must=("'do'", "(2, 5, 4, 6)", "()"))
    (o, lse), pullback = pyattn.vjp(sa, q, k, v, return_lse=True)
    raises(TypeError, pullback, (o, lse.astype(np.float32)), must=("'dlse'", "float32", "float64"))


def test_vjp_dlse_without_return_lse():
    q, k, v = qkv()
    out, pullback = pyattn.vjp(sa, q, k, v)
    raises(ValueError, pullback, (out, np.zeros(out.shape[:3])), must=("lse", "return_lse"))


def test_vjp_unregistered_function():
    q, k, v = qkv()

    def my_attention(q, k, v):
        return q

    raises(TypeError, pyattn.vjp, my_attention, q, k, v, must=("my_attention", "no registered vjp", "softmax_attention"))
    raises(TypeError, pyattn.vjp, np.exp, q, must=("exp", "no registered vjp"))
    raises(TypeError, pyattn.vjp, lambda x: x, q, must=("<lambda>",))


def test_vjp_bad_inputs_raise_like_forward():
    q, k, v = qkv()
    raises(TypeError, pyattn.vjp, sa, q, k.astype(np.float32), v, must=("'k'", "float32"))
    raises(ValueError, pyattn.vjp, sa, q, k, v, form="chunk", must=("form", "'chunk'"))


# ----------------------------------------------------------------------- threads


def test_set_num_threads_errors():
    before = pyattn.get_num_threads()
    raises(ValueError, pyattn.set_num_threads, 0, must=("n", ">= 1", "0"))
    raises(ValueError, pyattn.set_num_threads, -3, must=("-3",))
    raises(TypeError, pyattn.set_num_threads, "2", must=("int", "str"))
    raises(TypeError, pyattn.set_num_threads, 2.0, must=("int", "float"))
    raises(TypeError, pyattn.set_num_threads, True, must=("int", "bool"))
    raises(TypeError, pyattn.set_num_threads, None, must=("int", "NoneType"))
    with pytest.raises(ValueError):
        with pyattn.num_threads(0):
            pass
    assert pyattn.get_num_threads() == before
    raises(ValueError, _core.set_num_threads, 0, must=("'n'", "[1, 4096]", "0"))
    raises(ValueError, _core.set_num_threads, 5000, must=("'n'", "5000"))
    raises(TypeError, _core.set_num_threads, "2", must=("'n'", "int", "str"))
    raises(TypeError, _core.set_num_threads, must=("1", "0"))
    raises(TypeError, _core.set_num_threads, 1, 2, must=("1", "2"))
    raises(TypeError, _core.get_num_threads, 1, must=("0", "1"))
    raises(TypeError, _core.build_info, 1)
    assert pyattn.get_num_threads() == before


# ======================================================================= pyattn._core directly
#
# softmax_forward(q, k, v, o, lse, cu_q, cu_k, form, causal, window_left, window_right,
#                 sinks, alibi_slopes, softcap, scale, bf16)
# softmax_backward(q, k, v, o, lse, do, dlse_or_None, dq, dk, dv, cu_q, cu_k, form, causal,
#                  window_left, window_right, sinks, alibi_slopes, softcap, scale, bf16)

B, T, H, HK, DK, DV = 2, 7, 4, 2, 8, 6


def fwd_args(dtype=F64):
    q, k, v = qkv(B=B, Tq=T, Tk=T, H=H, Hk=HK, Dk=DK, Dv=DV, dtype=dtype)
    o = np.zeros((B, T, H, DV), dtype)
    lse = np.zeros((B, T, H), dtype)
    cu = np.arange(B + 1, dtype=np.int64) * T
    return [q, k, v, o, lse, cu, cu.copy(), _core.FORM_FLASH, True, -1, -1, 0, None, 0.0, DK ** -0.5,
            False]


def bwd_args(dtype=F64):
    q, k, v, o, lse, cu, cu2, *opts = fwd_args(dtype)
    _core.softmax_forward(q, k, v, o, lse, cu, cu2, *opts)
    do = np.ones_like(o)
    dlse = np.zeros_like(lse)
    return [q, k, v, o, lse, do, dlse, np.zeros_like(q), np.zeros_like(k), np.zeros_like(v),
            cu, cu2, *opts]


FWD_NAMES = ["q", "k", "v", "o", "lse", "cu_q", "cu_k", "form", "causal", "window_left",
             "window_right", "sinks", "alibi_slopes", "softcap", "scale", "bf16"]
BWD_NAMES = ["q", "k", "v", "o", "lse", "do", "dlse", "dq", "dk", "dv"] + FWD_NAMES[5:]


def test_core_direct_good_calls_work():
    """The argument lists below are right: the unmodified calls succeed and agree with the
    public API."""
    args = fwd_args()
    assert _core.softmax_forward(*args) is None
    o_ref, lse_ref = pyattn.softmax_attention(*args[:3], causal=True, return_lse=True)
    np.testing.assert_array_equal(args[3], o_ref)
    np.testing.assert_array_equal(args[4], lse_ref)
    args = bwd_args()
    assert _core.softmax_backward(*args) is None
    _, pullback = pyattn.vjp(pyattn.softmax_attention, *args[:3], causal=True, return_lse=True)
    g = pullback((args[5], args[6]))
    np.testing.assert_array_equal(args[7], g["q"])
    np.testing.assert_array_equal(args[8], g["k"])
    np.testing.assert_array_equal(args[9], g["v"])


@pytest.mark.parametrize("fn,n", [(_core.softmax_forward, 16), (_core.softmax_backward, 21),
                                  (_core.gemm, 7), (_core.exp, 2), (_core.exp_nonpos, 2),
                                  (_core.fma_peak, 3)])
def test_core_wrong_argument_count(fn, n):
    args = {16: fwd_args, 21: bwd_args}.get(n, lambda: [None] * n)()
    for m in (0, n - 1, n + 1):
        call = (args + [None])[:m] if m > n else args[:m]
        raises(TypeError, fn, *call, must=(f"{n} positional arguments", f"got {m}"))
    with pytest.raises(TypeError):
        fn(*args[:n], extra=1)


def _bad_core_cases(names, make, outputs, inputs_readonly_ok):
    """(id, index, bad value, exception or None for 'must succeed', message parts) for a
    softmax entry point."""
    idx = {n: i for i, n in enumerate(names)}
    base = make()
    cases = []
    arrays = [n for n in names if n in ("q", "k", "v", "o", "lse", "do", "dlse", "dq", "dk", "dv")]
    for name in arrays:
        a = base[idx[name]]
        i = idx[name]
        # q sets the dtype and the shapes of the call, so a bad q is reported at the first
        # argument that then disagrees with it
        shown = "'k'" if name == "q" else f"'{name}'"
        cases += [
            (f"{name}-list", i, a.tolist(), TypeError, (f"'{name}'", "numpy.ndarray", "list")),
            (f"{name}-float32", i, a.astype(np.float32), TypeError, (shown, "float32", "float64")),
            (f"{name}-int64", i, a.astype(np.int64), TypeError, (f"'{name}'", "int64")),
            (f"{name}-float16", i, a.astype(np.float16), TypeError, (f"'{name}'", "float16")),
            (f"{name}-noncontig", i, np.asfortranarray(a), ValueError, (f"'{name}'", "C-contiguous")),
            (f"{name}-batch", i, a[:1].copy(), ValueError, (shown, "shape", "(2,", "(1,")),
            (f"{name}-ndim", i, a[None].copy(), ValueError, (f"'{name}'", "shape")),
        ]
        ro = a.copy()
        ro.flags.writeable = False
        if name in outputs:
            cases.append((f"{name}-readonly", i, ro, ValueError, (f"'{name}'", "writeable")))
        elif name in inputs_readonly_ok:
            cases.append((f"{name}-readonly-ok", i, ro, None, ()))
    if "dlse" in idx:
        cases.append(("dlse-None-ok", idx["dlse"], None, None, ()))
    cases.append(("alibi-ok", idx["alibi_slopes"], np.full(4, 0.1), None, ()))
    ci, ck = idx["cu_q"], idx["cu_k"]
    cu = base[ci]
    for name, i in (("cu_seqlens_q", ci), ("cu_seqlens_k", ck)):
        cases += [
            (f"{name}-int32", i, cu.astype(np.int32), TypeError, (f"'{name}'", "int64", "int32")),
            (f"{name}-start", i, cu + 1, ValueError, (f"'{name}'", "from 0 to 14")),
            (f"{name}-end", i, np.array([0, 7, 13]), ValueError, (f"'{name}'", "14")),
            (f"{name}-past-end", i, np.array([0, 7, 15]), ValueError, (f"'{name}'", "14")),
            (f"{name}-decreasing", i, np.array([0, 9, 8, 14]), ValueError, (f"'{name}'", "non-decreasing")),
            (f"{name}-negative", i, np.array([0, -5, 14]), ValueError, (f"'{name}'", "non-decreasing")),
            (f"{name}-short", i, np.array([0]), ValueError, (f"'{name}'", "from 0 to 14")),
            (f"{name}-empty", i, np.array([], np.int64), ValueError, (f"'{name}'", "from 0 to 14")),
            (f"{name}-2d", i, cu[None].copy(), ValueError, (f"'{name}'", "shape")),
            (f"{name}-noncontig", i, np.repeat(cu, 2)[::2], ValueError, (f"'{name}'", "C-contiguous")),
            (f"{name}-list", i, [0, 7, 14], TypeError, (f"'{name}'", "numpy.ndarray")),
            (f"{name}-None", i, None, TypeError, (f"'{name}'", "numpy.ndarray", "NoneType")),
        ]
    cases += [
        ("cu-length-mismatch", ck, np.array([0, 3, 7, 14]), ValueError, ("cu_seqlens_q", "cu_seqlens_k", "3", "4")),
        ("cu-other-split-ok", ck, np.array([0, 3, 14]), None, ()),
        ("form-3", idx["form"], 3, ValueError, ("'form'", "[0, 2]", "3")),
        ("form--1", idx["form"], -1, ValueError, ("'form'", "-1")),
        ("form-str", idx["form"], "flash", TypeError, ("'form'", "int", "str")),
        ("form-float", idx["form"], 1.0, TypeError, ("'form'", "int", "float")),
        ("window_left--2", idx["window_left"], -2, ValueError, ("'window_left'", "-2")),
        ("window_right--2", idx["window_right"], -2, ValueError, ("'window_right'", "-2")),
        ("window_left-float", idx["window_left"], 1.5, TypeError, ("'window_left'", "int", "float")),
        ("sinks--1", idx["sinks"], -1, ValueError, ("'sinks'", "-1")),
        ("sinks-None", idx["sinks"], None, TypeError, ("'sinks'", "int")),
        ("alibi-shape", idx["alibi_slopes"], np.ones(3), ValueError, ("'alibi_slopes'", "(4,)", "(3,)")),
        ("alibi-dtype", idx["alibi_slopes"], np.ones(4, np.float32), TypeError, ("'alibi_slopes'", "float32")),
        ("alibi-list", idx["alibi_slopes"], [1.0] * 4, TypeError, ("'alibi_slopes'", "numpy.ndarray")),
        ("alibi-noncontig", idx["alibi_slopes"], np.ones(8)[::2], ValueError, ("'alibi_slopes'", "C-contiguous")),
        ("softcap-neg", idx["softcap"], -1.0, ValueError, ("'softcap'", "-1")),
        ("softcap-nan", idx["softcap"], float("nan"), ValueError, ("'softcap'", "nan")),
        ("softcap-str", idx["softcap"], "1", TypeError, ("'softcap'", "float", "str")),
        ("scale-inf", idx["scale"], float("inf"), ValueError, ("'scale'", "inf")),
        ("scale-nan", idx["scale"], float("nan"), ValueError, ("'scale'", "nan")),
        ("scale-None", idx["scale"], None, TypeError, ("'scale'", "float")),
    ]
    q, k, v = base[:3]
    cases += [
        ("k-Dk", idx["k"], k[..., :5].copy(), ValueError, ("'k'", "shape", "(2, -1, -1, 8)", "(2, 7, 2, 5)")),
        ("v-Tk", idx["v"], v[:, :3].copy(), ValueError, ("'v'", "shape", "(2, 7, 2, -1)", "(2, 3, 2, 6)")),
        ("v-Hk", idx["v"], v[:, :, :1].copy(), ValueError, ("'v'", "shape", "(2, 7, 2, -1)", "(2, 7, 1, 6)")),
    ]
    return cases


FWD_CASES = _bad_core_cases(FWD_NAMES, fwd_args, outputs=("o", "lse"), inputs_readonly_ok=("q", "k", "v"))
BWD_CASES = _bad_core_cases(BWD_NAMES, bwd_args, outputs=("dq", "dk", "dv"),
                            inputs_readonly_ok=("q", "k", "v", "o", "lse", "do", "dlse"))


@pytest.mark.parametrize("case", case_params(FWD_CASES))
def test_core_softmax_forward_bad_args(case):
    _, index, bad, exc, must = case
    run_bad_arg_case(_core.softmax_forward, fwd_args, index, bad, exc, must)


@pytest.mark.parametrize("case", case_params(BWD_CASES))
def test_core_softmax_backward_bad_args(case):
    _, index, bad, exc, must = case
    run_bad_arg_case(_core.softmax_backward, bwd_args, index, bad, exc, must)


@pytest.mark.parametrize("fn,make", [(_core.softmax_forward, fwd_args), (_core.softmax_backward, bwd_args)],
                         ids=["forward", "backward"])
def test_core_softmax_head_checks(fn, make):
    args = make()
    # H % Hk != 0: k and v with 3 KV heads against H = 4
    args[1] = np.zeros((B, T, 3, DK))
    args[2] = np.zeros((B, T, 3, DV))
    if fn is _core.softmax_backward:
        args[8] = np.zeros((B, T, 3, DK))
        args[9] = np.zeros((B, T, 3, DV))
    raises(ValueError, fn, *args, must=("H=4", "Hk=3"))
    args = make()
    args[1] = np.zeros((B, T, 0, DK))
    args[2] = np.zeros((B, T, 0, DV))
    raises(ValueError, fn, *args, must=("Hk=0",))
    # a float32 call with one float64 output
    args = make(np.float32)
    args[3] = args[3].astype(F64)
    raises(TypeError, fn, *args, must=("'o'", "float32", "float64"))


def test_core_softmax_misaligned_buffer():
    args = fwd_args()
    buf = np.zeros(args[3].size * 8 + 1, np.uint8)
    o = buf[1:].view(F64).reshape(args[3].shape)
    assert not o.flags.aligned
    args[3] = o
    raises(ValueError, _core.softmax_forward, *args, must=("'o'", "aligned"))


def test_core_causal_truthiness_error_propagates():
    class Bad:
        def __bool__(self):
            raise RuntimeError("no truth value")

    args = fwd_args()
    args[8] = Bad()
    raises(RuntimeError, _core.softmax_forward, *args, must=("no truth value",))


# ----------------------------------------------------------------------- gemm, exp direct


def gemm_args(dtype=F64):
    a = np.ones((3, 4), dtype)
    b = np.ones((4, 5), dtype)
    c = np.zeros((3, 5), dtype)
    return [a, b, c, False, False, 1.0, 0.0]


GEMM_CASES = [
    ("a-list", 0, [[1.0]], TypeError, ("'a'", "numpy.ndarray", "list")),
    ("a-int", 0, np.ones((3, 4), np.int64), TypeError, ("'a'", "float32 or float64", "int64")),
    ("a-1d", 0, np.ones(12), ValueError, ("'a'", "shape")),
    ("a-noncontig", 0, np.ones((4, 3)).T, ValueError, ("'a'", "C-contiguous")),
    ("b-dtype", 1, np.ones((4, 5), np.float32), TypeError, ("'b'", "float64", "float32")),
    ("b-3d", 1, np.ones((4, 5, 1)), ValueError, ("'b'", "shape")),
    ("b-noncontig", 1, np.ones((4, 10))[:, ::2], ValueError, ("'b'", "C-contiguous")),
    ("b-inner", 1, np.ones((6, 5)), ValueError, ("inner dimensions", "4", "6")),
    ("c-shape", 2, np.zeros((5, 3)), ValueError, ("'c'", "(3, 5)", "(5, 3)")),
    ("c-dtype", 2, np.zeros((3, 5), np.float32), TypeError, ("'c'", "float32")),
    ("c-noncontig", 2, np.zeros((5, 3)).T, ValueError, ("'c'", "C-contiguous")),
    ("c-list", 2, [[0.0] * 5] * 3, TypeError, ("'c'", "numpy.ndarray")),
    ("alpha-nan", 5, float("nan"), ValueError, ("'alpha'", "nan")),
    ("alpha-str", 5, "1", TypeError, ("'alpha'", "float", "str")),
    ("beta-inf", 6, float("inf"), ValueError, ("'beta'", "inf")),
    ("beta-None", 6, None, TypeError, ("'beta'", "float")),
]


@pytest.mark.parametrize("case", case_params(GEMM_CASES))
def test_core_gemm_bad_args(case):
    _, index, bad, exc, must = case
    args = gemm_args()
    args[index] = bad
    raises(exc, _core.gemm, *args, must=must)
    assert np.all(gemm_args()[2] == 0)


def test_core_gemm_readonly_c_and_transposed_shapes():
    args = gemm_args()
    args[2].flags.writeable = False
    raises(ValueError, _core.gemm, *args, must=("'c'", "writeable"))
    # with trans_a the a buffer is [K, M]: (3, 4) then means M = 4, K = 3 -> inner mismatch with b [4, 5]
    args = gemm_args()
    args[3] = True
    raises(ValueError, _core.gemm, *args, must=("inner dimensions", "3", "4"))
    args = gemm_args()
    args[4] = True  # b [N, K] = (4, 5): K = 5 != 4
    raises(ValueError, _core.gemm, *args, must=("inner dimensions",))


def test_core_exp_bad_args():
    x = np.linspace(-1, 1, 9)
    raises(ValueError, _core.exp, x, np.empty(8), must=("'out'", "(9,)", "(8,)"))
    raises(TypeError, _core.exp, x, np.empty(9, np.float32), must=("'out'", "float64", "float32"))
    raises(TypeError, _core.exp, x.astype(np.int64), np.empty(9), must=("'x'", "int64"))
    raises(ValueError, _core.exp, x.reshape(3, 3), np.empty((3, 3)), must=("'x'", "shape"))
    raises(ValueError, _core.exp, np.linspace(0, 1, 18)[::2], np.empty(9), must=("'x'", "C-contiguous"))
    raises(ValueError, _core.exp, x, np.empty(18)[::2], must=("'out'", "C-contiguous"))
    ro = np.empty(9)
    ro.flags.writeable = False
    raises(ValueError, _core.exp, x, ro, must=("'out'", "writeable"))
    raises(TypeError, _core.exp, [0.0], np.empty(1), must=("'x'", "numpy.ndarray"))
    raises(TypeError, _core.exp, x, None, must=("'out'", "numpy.ndarray"))


@pytest.mark.parametrize("fn,make,index,name,bad", [
    (_core.softmax_forward, fwd_args, 13, "softcap", -1.0),
    (_core.softmax_forward, fwd_args, 13, "softcap", float("nan")),
    (_core.softmax_forward, fwd_args, 14, "scale", float("inf")),
    (_core.softmax_backward, bwd_args, 18, "softcap", -0.5),
    (_core.softmax_backward, bwd_args, 19, "scale", float("nan")),
    (_core.gemm, gemm_args, 5, "alpha", float("nan")),
    (_core.gemm, gemm_args, 6, "beta", float("-inf")),
])
def test_core_bad_float_args_type_and_name(fn, make, index, name, bad):
    """The float arguments out of range: ValueError naming the argument (the values in the
    message are checked by the table entries above)."""
    args = make()
    args[index] = bad
    raises(ValueError, fn, *args, must=(f"'{name}'", "finite"))


def test_core_fma_peak_bad_args():
    raises(ValueError, _core.fma_peak, True, -1.0, 1, must=("'seconds'",))
    raises(ValueError, _core.fma_peak, True, 0.0, 0, must=("'threads'", "0"))
    raises(TypeError, _core.fma_peak, True, 0.0, "1", must=("'threads'", "int"))


def test_memory_error_for_unallocatable_scratch():
    """The parallel form materialises Tq x Tk scores: 10^6 x 10^6 of them cannot be allocated
    (8 TB) and must give MemoryError, not a crash; forward and backward."""
    n = 1_000_000
    q = np.zeros((1, n, 1, 1))
    with pytest.raises(MemoryError):
        pyattn.softmax_attention(q, q, q, form="parallel")
    with pytest.raises(MemoryError):
        pyattn.vjp(pyattn.softmax_attention, q, q, q, form="parallel")
    cu = np.array([0, n], np.int64)
    z = lambda: np.zeros((1, n, 1, 1))
    with pytest.raises(MemoryError):
        _core.softmax_backward(q, q, q, z(), np.zeros((1, n, 1)), z(), None, z(), z(), z(), cu, cu,
                               _core.FORM_PARALLEL, False, -1, -1, 0, None, 0.0, 1.0, False)
    # the process is fine afterwards
    small = np.ones((1, 3, 1, 1))
    np.testing.assert_allclose(pyattn.softmax_attention(small, small, small, form="parallel"), small)


def test_core_huge_int_message():
    args = fwd_args()
    args[9] = 2 ** 70
    raises(ValueError, _core.softmax_forward, *args, must=("'window_left'", str(2 ** 70)))


def test_huge_window_is_unbounded():
    q, k, v = qkv()
    np.testing.assert_array_equal(sa(q, k, v, window=(2 ** 70, 0)), sa(q, k, v, window=(-1, 0)))


@pytest.mark.parametrize("entry", ["exp", "gemm", "softmax_forward", "softmax_backward"])
def test_core_rejects_non_native_byte_order(entry):
    """A '>f8' array has dtype number NPY_FLOAT64 but its bytes are swapped: the kernels would
    read garbage, so _core must refuse it like any other wrong buffer."""
    if entry == "exp":
        raises((TypeError, ValueError), _core.exp, np.linspace(0, 1, 5).astype(">f8"), np.zeros(5),
               must=("'x'",))
    elif entry == "gemm":
        args = gemm_args()
        args[0] = args[0].astype(">f8")
        raises((TypeError, ValueError), _core.gemm, *args, must=("'a'",))
    elif entry == "softmax_forward":
        args = fwd_args()
        args[2] = args[2].astype(">f8")
        raises((TypeError, ValueError), _core.softmax_forward, *args, must=("'v'",))
    else:
        args = bwd_args()
        args[5] = args[5].astype(">f8")
        raises((TypeError, ValueError), _core.softmax_backward, *args, must=("'do'",))


def test_public_api_copies_non_native_byte_order():
    q, k, v = qkv()
    np.testing.assert_array_equal(sa(q, k, v.astype(">f8")), sa(q, k, v))
    raises(TypeError, sa, q, k, v.astype(">f4"), must=("'v'", ">f4", "float64"))


def test_bad_cu_seqlens_message_names_cu_seqlens():
    q, k, v = packed()
    raises(ValueError, sa, q, k, v, cu_seqlens=np.array([0, 6, 4, 10]), must=("'cu_seqlens'",))

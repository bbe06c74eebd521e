"""pyattn.jax: every differentiable op of pyattn.OPS, called on jax arrays with and without
jax.jit, gives pyattn's NumPy result bit for bit, and jax.grad gives pyattn.vjp's gradients bit
for bit; jax.vmap maps an op; dtypes, static arguments, integer operands and errors behave as
the module docstring says. The calls are each op's tiny registry example."""
from __future__ import annotations

import inspect
import re
import subprocess
import sys

import numpy as np
import pytest

import pyattn

jax = pytest.importorskip("jax", reason='pyattn.jax needs jax: pip install "pyattn[jax]"')

# Python (jax.pure_callback) over the kernels that tests/test_torch.py and the NumPy tests run under
# the sanitizers already: skipped there, where they would add minutes
pytestmark = pytest.mark.skip_under_sanitizer
import jax.numpy as jnp  # noqa: E402

import pyattn.jax as pjax  # noqa: E402

BRIDGED = [name for name, info in pyattn.OPS.items() if info.differentiable and name != "attention_with_kvcache"]
DTYPES = [np.float64, np.float32]


@pytest.fixture(autouse=True, scope="module")
def _x64():
    """float64 arrays stay float64 in jax only with x64 on; restored for whatever runs next."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def _is_float(x):
    return isinstance(x, np.ndarray) and x.dtype.kind == "f"


def _example(name, dtype, rng):
    """The registry example as (floats, ints, rest) by argument name: the float arrays (or lists
    of them), to differentiate; the integer arrays, traced too; everything else."""
    info = pyattn.OPS[name]
    args, kwargs = info.example(rng, dtype, tiny=True)
    bound = dict(zip(inspect.signature(info.fn).parameters, args), **kwargs)
    floats = {n: x for n, x in bound.items() if _is_float(x) or (isinstance(x, list) and all(map(_is_float, x)))}
    ints = {n: x for n, x in bound.items() if isinstance(x, np.ndarray) and n not in floats}
    rest = {n: x for n, x in bound.items() if n not in floats and n not in ints}
    return floats, ints, rest


def _assert_same_bits(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), b, strict=True)


def _loss(name, rest, cotangent):
    """sum(out * cotangent) over the op's outputs: its gradient in each output is the cotangent."""

    def loss(floats, ints):
        out = getattr(pjax, name)(**floats, **ints, **rest)
        return sum(jnp.sum(o * c) for o, c in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(cotangent)))

    return loss


def _random_like(out, rng):
    return jax.tree_util.tree_map(lambda o: rng.standard_normal(o.shape).astype(o.dtype), out)


def test_every_differentiable_op_is_bridged_with_its_signature():
    assert sorted(pjax.__all__) == sorted(BRIDGED)
    assert not hasattr(pjax, "attention_with_kvcache")
    for name in BRIDGED:
        want = inspect.signature(pyattn.OPS[name].fn).parameters.values()
        got = inspect.signature(getattr(pjax, name)).parameters.values()
        assert [(p.name, p.kind, p.default) for p in got] == [(p.name, p.kind, p.default) for p in want], name


def test_import_pyattn_does_not_import_jax():
    code = "import sys, pyattn; assert 'jax' not in sys.modules, 'pyattn imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_jax_the_import_error_names_the_extra():
    code = "import sys; sys.modules['jax'] = None; import pyattn.jax"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0
    assert 'ImportError: pyattn.jax needs jax: pip install "pyattn[jax]"' in run.stderr, run.stderr


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", BRIDGED)
def test_forward_is_pyattns_bits(name, dtype, rng):
    floats, ints, rest = _example(name, dtype, rng)
    want = pyattn.OPS[name].fn(**floats, **ints, **rest)

    def call(floats, ints):
        return getattr(pjax, name)(**floats, **ints, **rest)

    _assert_same_bits(call(floats, ints), want)
    _assert_same_bits(jax.jit(call)(floats, ints), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", BRIDGED)
def test_grad_is_pyattn_vjps_bits(name, dtype, rng):
    floats, ints, rest = _example(name, dtype, rng)
    out, pullback = pyattn.vjp(pyattn.OPS[name].fn, **floats, **ints, **rest)
    cotangent = _random_like(out, rng)
    want = pullback(cotangent)
    grad = jax.grad(_loss(name, rest, cotangent))
    for got in (grad(floats, ints), jax.jit(grad)(floats, ints)):
        assert set(got) == set(want)
        _assert_same_bits({n: got[n] for n in want}, want)


def test_vmap_over_a_leading_batch_axis(rng):
    q, k, v = (rng.standard_normal((3, 1, 5, 2, 4)) for _ in range(3))
    do = rng.standard_normal((3, 1, 5, 2, 4))

    def loss(q, k, v, do):
        return jnp.sum(pjax.softmax_attention(q, k, v, causal=True) * do)

    o = jax.jit(jax.vmap(lambda q, k, v: pjax.softmax_attention(q, k, v, causal=True)))(q, k, v)
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, do)
    for i in range(3):
        out, pullback = pyattn.vjp(pyattn.softmax_attention, q[i], k[i], v[i], causal=True)
        want = pullback(do[i])
        _assert_same_bits(o[i], out)
        _assert_same_bits([g[i] for g in grads], [want["q"], want["k"], want["v"]])


def test_float32_stays_float32(rng):
    floats, ints, rest = _example("gla", np.float32, rng)
    out = pjax.gla(**floats, **rest)
    grads = jax.grad(lambda f: jnp.sum(pjax.gla(**f, **rest)[0]))(floats)
    assert {x.dtype for x in jax.tree_util.tree_leaves((out, grads))} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_low_precision_is_computed_in_float32_and_returned_in_its_dtype(low, rng):
    """float16 is widened to float32 here; bfloat16 goes to pyattn's bf16 call (whose plain
    forward may multiply in bf16 where the CPU does): pyattn.jax gives those calls' bits, the
    plain call's for the output and pyattn.vjp's pullback's for the gradients."""
    floats, ints, rest = _example("gla", np.float32, rng)
    low_floats = {n: jnp.asarray(x, low) for n, x in floats.items()}
    given = np.asarray if low == "bfloat16" else (lambda x: np.asarray(x, np.float32))
    given_floats = {n: given(x) for n, x in low_floats.items()}
    out, pullback = pyattn.vjp(pyattn.gla, **given_floats, **rest)
    low_cotangent = [jnp.asarray(c, low) for c in _random_like(out, rng)]
    want = pullback(tuple(given(c) for c in low_cotangent))
    got = pjax.gla(**low_floats, **rest)
    grads = jax.grad(_loss("gla", rest, low_cotangent))(low_floats, {})
    _assert_same_bits(got, jax.tree_util.tree_map(lambda x: np.asarray(x, low), pyattn.gla(**given_floats, **rest)))
    _assert_same_bits(grads, {n: np.asarray(g, low) for n, g in want.items()})


def test_a_new_static_argument_retraces(rng):
    floats, _, _ = _example("softmax_attention", np.float64, rng)
    attend = jax.jit(pjax.softmax_attention, static_argnames=("causal", "window", "form", "return_lse"))
    for causal, window, form, return_lse in [(True, None, "flash", False), (False, None, "flash", False),
                                             (False, (1, 1), "parallel", True), (True, (2, 0), "recurrent", True)]:
        kw = dict(causal=causal, window=window, form=form, return_lse=return_lse)
        _assert_same_bits(attend(**floats, **kw), pyattn.softmax_attention(**floats, **kw))
    floats, _, rest = _example("simple_gla", np.float64, rng)
    rest.pop("output_final_state")
    gla = jax.jit(pjax.simple_gla, static_argnames=("output_final_state", "chunk_size"))
    for state, chunk_size in [(True, 16), (False, 16), (False, 32)]:
        got = gla(**floats, **rest, output_final_state=state, chunk_size=chunk_size)
        _assert_same_bits(got, pyattn.simple_gla(**floats, **rest, output_final_state=state, chunk_size=chunk_size))
        assert (got[1] is None) == (not state)


def test_integer_operands_are_traced_and_get_float0(rng):
    q, k, v = (rng.standard_normal((1, 9, 2, 3)) for _ in range(3))
    g = -rng.uniform(0, 1, (1, 9, 2))
    cu = np.array([0, 4, 9], np.int32)
    out, pullback = pyattn.vjp(pyattn.simple_gla, q, k, v, g, cu_seqlens=cu, output_final_state=True)
    cotangent = _random_like(out, rng)
    want = pullback(cotangent)

    def loss(q, k, v, g, cu):
        o, ht = pjax.simple_gla(q, k, v, g, cu_seqlens=cu, output_final_state=True)
        return jnp.sum(o * cotangent[0]) + jnp.sum(ht * cotangent[1])

    *grads, dcu = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), allow_int=True))(q, k, v, g, cu)
    _assert_same_bits(grads, [want[n] for n in ("q", "k", "v", "g")])
    assert dcu.dtype == jax.dtypes.float0 and dcu.shape == cu.shape


def test_an_array_inside_feature_map_params_gets_its_gradient(rng):
    q, k, v = (rng.standard_normal((1, 5, 2, 3)) * 0.5 for _ in range(3))
    W = rng.standard_normal((4, 3))
    kw = dict(feature_map="performer", output_final_state=True)
    out, pullback = pyattn.vjp(pyattn.linear_attention, q, k, v, feature_map_params={"projection": W}, **kw)
    cotangent = _random_like(out, rng)
    want = pullback(cotangent)

    def loss(q, W):
        o, ht = pjax.linear_attention(q, k, v, feature_map_params={"projection": W}, **kw)
        return jnp.sum(o * cotangent[0]) + jnp.sum(ht * cotangent[1])

    _assert_same_bits(jax.jit(jax.grad(loss, argnums=(0, 1)))(q, W), (want["q"], want["projection"]))


def _pyattn_error(fn, *args, **kwargs):
    """pyattn's own 'Type: message' for a bad call."""
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args, **kwargs)
    return f"{type(info.value).__name__}: {info.value}"


@pytest.mark.parametrize("bad", [dict(k_heads=3), dict(form="flashy"), dict(window=(1, 2, 3))])
def test_a_bad_argument_raises_pyattns_message(bad, rng):
    kw = {n: bad[n] for n in ("form", "window") if n in bad}
    q = rng.standard_normal((1, 5, 4, 3))
    k, v = (rng.standard_normal((1, 5, bad.get("k_heads", 2), 3)) for _ in range(2))
    message = _pyattn_error(pyattn.softmax_attention, q, k, v, **kw)
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(message)):
        pjax.softmax_attention(q, k, v, **kw)
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(message)):
        jax.jit(lambda q, k, v: pjax.softmax_attention(q, k, v, **kw))(q, k, v)


def test_an_unhashable_static_argument_is_a_type_error(rng):
    q = rng.standard_normal((1, 5, 2, 3))
    message = "softmax_attention(): 'window' must be an array or a hashable value, got set"
    with pytest.raises(TypeError, match=re.escape(message)):
        pjax.softmax_attention(q, q, q, window={1, 2})

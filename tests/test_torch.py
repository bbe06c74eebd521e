"""pyattn.torch: every differentiable op of pyattn.OPS as a torch custom op. Forward and
gradients equal pyattn's own (same bits), torch.library.opcheck and
torch.autograd.gradcheck pass, torch.compile traces a model without a graph break, dtypes
and devices are handled as documented."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import pyattn

torch = pytest.importorskip("torch", reason="pyattn.torch needs torch (pip install 'pyattn[torch]')")
pt = pytest.importorskip("pyattn.torch")

NAMES = sorted(pt.__all__)
DIFFERENTIABLE = [n for n in NAMES if pyattn.OPS[n].differentiable]


def _to_torch(x, grad_names=(), name=None):
    if isinstance(x, np.ndarray):
        t = torch.from_numpy(x.copy())
        if name in grad_names and t.is_floating_point():
            t.requires_grad_(True)
        return t
    if isinstance(x, list) and x and isinstance(x[0], np.ndarray):
        return [_to_torch(a, grad_names, name) for a in x]
    return x


def _example(name, dtype=np.float64, tiny=True, seed=0):
    """(pyattn args, kwargs) and the same as tensors, the differentiable ones requiring grad."""
    info = pyattn.OPS[name]
    args, kwargs = info.example(np.random.default_rng(seed), dtype, tiny=tiny)
    kwargs = {k: (v if k not in ("return_colsum",) else False) for k, v in kwargs.items()}
    diff = set(info.differentiable)
    targs = [_to_torch(a, diff, n) for a, n in zip(args, info.arrays)]
    tkwargs = {}
    for k, v in kwargs.items():
        if k == "feature_map_params" and isinstance(v, dict):
            tkwargs[k] = {pk: _to_torch(pv, diff, pk) for pk, pv in v.items()}
        else:
            tkwargs[k] = _to_torch(v, diff, k)
    return args, kwargs, targs, tkwargs


def _flat(out):
    if isinstance(out, (tuple, list)):
        return [x for o in out for x in _flat(o)]
    return [] if out is None else [out]


def _leaves(targs, tkwargs):
    """(name, tensor) of every tensor input that requires grad."""
    found = []

    def visit(name, x):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            found.append((name, x))
        elif isinstance(x, list):
            for i, xi in enumerate(x):
                visit(f"{name}[{i}]", xi)
        elif isinstance(x, dict):
            for k, v in x.items():
                visit(k, v)

    return found, visit


def test_every_op_has_a_function():
    assert set(NAMES) == set(pyattn.OPS)


@pytest.mark.parametrize("name", sorted(set(NAMES) - set(DIFFERENTIABLE)))
def test_forward_of_an_op_without_gradient_equals_pyattn(name):
    """dsa_select (indices, int64) and dsa_index_target: custom ops too, without autograd."""
    info = pyattn.OPS[name]
    args, kwargs, targs, tkwargs = _example(name, tiny=False)
    ref = info.fn(*args, **kwargs)
    out = getattr(pt, name)(*targs, **tkwargs)
    assert out.dtype == (torch.int64 if ref.dtype.kind == "i" else torch.float64)
    np.testing.assert_array_equal(out.numpy(), ref)
    result = torch.library.opcheck(pt._OPS[name].op, tuple(_call_values(name, targs, tkwargs)),
                                   test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.fixture(params=["eager", "custom_op"])
def path(request, monkeypatch):
    """Eager calls run pyattn directly (gradients through EagerVJP); traced or transformed
    ones go through the custom ops: both are checked."""
    if request.param == "custom_op":
        from pyattn.torch import _bridge

        monkeypatch.setattr(_bridge, "_plain_eager", lambda tensors: False)
    return request.param


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_forward_and_gradients_equal_pyattn(name, path):
    info = pyattn.OPS[name]
    args, kwargs, targs, tkwargs = _example(name, tiny=False)
    ref, pullback = pyattn.vjp(info.fn, *args, **kwargs)
    out = getattr(pt, name)(*targs, **tkwargs)
    refs, outs = _flat(ref), _flat(out)
    assert isinstance(out, tuple) == isinstance(ref, tuple) and len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.dtype == torch.float64
        np.testing.assert_array_equal(o.detach().numpy(), r)
    rng = np.random.default_rng(1)
    cots = [rng.standard_normal(r.shape) for r in refs]
    if isinstance(ref, tuple):
        cot = tuple(None if r is None else cots.pop(0) for r in ref)
    else:
        cot = cots[0]
    grads = pullback(cot)
    loss = sum((o * torch.from_numpy(c)).sum() for o, c in zip(_flat(out), _flat(cot)))
    found, visit = _leaves(targs, tkwargs)
    for n, a in zip(info.arrays, targs):
        visit(n, a)
    for k, v in tkwargs.items():
        visit(k, v)
    loss.backward()
    names = {n.split("[")[0] for n, _ in found}
    assert names == set(grads), (names, set(grads))
    for n, t in found:
        base, _, idx = n.partition("[")
        expected = grads[base][int(idx[:-1])] if idx else grads[base]
        np.testing.assert_array_equal(t.grad.numpy(), expected, err_msg=n)


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_opcheck(name):
    _, _, targs, tkwargs = _example(name)
    op = pt._OPS[name]
    values = _call_values(name, targs, tkwargs)
    result = torch.library.opcheck(op.op, tuple(values))
    assert all(v == "SUCCESS" for v in result.values()), result


def _call_values(name, targs, tkwargs):
    """The custom op's positional arguments for a public call (its defaults filled in)."""
    import inspect

    fn = getattr(pt, name)
    bound = inspect.signature(fn).bind(*targs, **tkwargs)
    bound.apply_defaults()
    op = pt._OPS[name]
    values = []
    for p in op.params:
        if p.name in ("projection", "p", "max_len"):
            params = bound.arguments.get("feature_map_params") or bound.arguments.get("params") or {}
            values.append(params.get(p.name))
        else:
            v = bound.arguments[p.name]
            values.append(list(v) if p.schema == "int[]?" and v is not None else v)
    return values


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_gradcheck_float64(name):
    _, _, targs, tkwargs = _example(name, seed=3)
    found, visit = _leaves(targs, tkwargs)
    for a in targs:
        visit("", a)
    for k, v in tkwargs.items():
        visit(k, v)
    leaves = [t for _, t in found]

    def f(*xs):
        it = iter(xs)

        def swap(x):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                return next(it).clone()  # attention_with_kvcache writes into its caches
            if isinstance(x, list):
                return [swap(xi) for xi in x]
            if isinstance(x, dict):
                return {k: swap(v) for k, v in x.items()}
            return x

        a = [swap(x) for x in targs]
        kw = {k: swap(v) for k, v in tkwargs.items()}
        # entries that are -inf (the LSE of a row with no key) have no derivative
        return tuple(torch.where(torch.isfinite(o.detach()), o, 0) for o in _flat(getattr(pt, name)(*a, **kw)))

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-5, rtol=1e-3)


def test_import_pyattn_does_not_import_torch():
    code = "import sys, pyattn; import pyattn.nn; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_float32_stays_float32_and_half_precision_round_trips():
    rng = np.random.default_rng(4)
    q = torch.from_numpy(rng.standard_normal((1, 20, 2, 8), dtype=np.float32))
    o = pt.softmax_attention(q, q, q, causal=True)
    assert o.dtype == torch.float32
    np.testing.assert_array_equal(o.numpy(), pyattn.softmax_attention(q.numpy(), q.numpy(), q.numpy(), causal=True))
    for half in (torch.bfloat16, torch.float16):
        qh = q.to(half).requires_grad_(True)
        g = -torch.rand(1, 20, 2).to(half)
        o, _ = pt.simple_gla(qh, qh, qh, g)
        assert o.dtype == half
        if half == torch.float16:  # widened to float32
            q32 = qh.detach().float().numpy()
            ref, _ = pyattn.simple_gla(q32, q32, q32, g.float().numpy())
            assert torch.equal(o.detach(), torch.from_numpy(ref).to(half))
        # bfloat16: pyattn's bf16 call, bit for bit (test_bfloat16_crosses_as_itself)
        o.float().sum().backward()
        assert qh.grad.dtype == half and torch.isfinite(qh.grad.float()).all()


@pytest.mark.parametrize("path", ["eager", "custom_op"], indirect=True)
def test_bfloat16_crosses_as_itself(path):
    """With ml_dtypes, a bf16 tensor reaches pyattn as a bf16 array viewing its memory (no
    float32 copy); outputs and gradients are pyattn's bf16 call's, bit for bit."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bf16 arrays need ml_dtypes (pyattn[bf16])")
    from pyattn.torch import _bridge

    rng = np.random.default_rng(8)
    x = torch.from_numpy(rng.standard_normal((1, 40, 2, 8), dtype=np.float32)).to(torch.bfloat16)
    a = _bridge.to_array(x)
    assert a.dtype == ml_dtypes.bfloat16 and np.shares_memory(a, x.view(torch.uint16).numpy())
    g = torch.from_numpy(-rng.random((1, 40, 2), dtype=np.float32) * 0.3).to(torch.bfloat16)
    leaves = [x.clone().requires_grad_(True)] + [
        torch.from_numpy(rng.standard_normal((1, 40, 2, 8), dtype=np.float32)).to(torch.bfloat16).requires_grad_(True)
        for _ in range(2)]
    o, _ = pt.simple_gla(*leaves, g)
    assert o.dtype == torch.bfloat16
    arrays = [_bridge.to_array(t.detach()) for t in leaves]
    ref, pull = pyattn.vjp(pyattn.simple_gla, *arrays, _bridge.to_array(g))
    assert np.array_equal(o.detach().view(torch.uint16).numpy(), ref[0].view(np.uint16))
    do = torch.randn(o.shape).to(torch.bfloat16)
    o.backward(do)
    grads = pull(_bridge.to_array(do))
    for name, t in zip("qkv", leaves):
        assert t.grad.dtype == torch.bfloat16
        assert np.array_equal(t.grad.view(torch.uint16).numpy(), grads[name].view(np.uint16)), name


def test_bfloat16_cache_takes_the_new_keys():
    pytest.importorskip("ml_dtypes", reason="bf16 arrays need ml_dtypes (pyattn[bf16])")
    B, Hk, H, D, cap = 1, 1, 2, 8, 16
    kc, vc = (torch.zeros(B, cap, Hk, D, dtype=torch.bfloat16) for _ in range(2))
    q = torch.ones(B, 1, H, D, dtype=torch.bfloat16)
    k, v = (torch.full((B, 1, Hk, D), 1.5, dtype=torch.bfloat16) for _ in range(2))
    o = pt.attention_with_kvcache(q, kc, vc, torch.tensor([3], dtype=torch.int32), k=k, v=v)
    assert o.dtype == torch.bfloat16 and (kc[0, 3] == 1.5).all() and (vc[0, 3] == 1.5).all()
    assert not kc[0, :3].any() and not kc[0, 4:].any()


def test_contiguous_tensors_cross_without_a_copy():
    from pyattn.torch import _bridge

    t = torch.randn(2, 3, 4, dtype=torch.float64)
    assert np.shares_memory(_bridge.to_array(t), t.numpy())
    strided = t.transpose(0, 1)
    assert not strided.is_contiguous()
    np.testing.assert_array_equal(_bridge.to_array(strided), strided.numpy())


def test_non_cpu_tensor_is_a_type_error():
    q = torch.empty(1, 4, 2, 8, device="meta")
    with pytest.raises(TypeError, match=r"softmax_attention\(\): 'q' is on meta.*CPU"):
        pt.softmax_attention(q, q, q)


def test_bad_argument_raises_pyattns_error():
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="must be a multiple"):
        pt.softmax_attention(q, k, k)
    with pytest.raises(TypeError, match="unknown feature-map parameters"):
        pt.feature_map(q, "focused", power=3)


def test_python_scalars_and_lists_as_pyattn_takes_them():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 9, 2, 4))
    ref, _ = pyattn.retention(q, q, q, gamma=0.9, cu_seqlens=[0, 4, 9])
    out, _ = pt.retention(*(torch.from_numpy(q),) * 3, gamma=0.9, cu_seqlens=[0, 4, 9])
    np.testing.assert_array_equal(out.numpy(), ref)


def test_kvcache_writes_in_place_and_is_differentiable():
    rng = np.random.default_rng(6)
    B, H, Hk, D, cap = 2, 4, 2, 8, 16
    kc, vc = (torch.from_numpy(rng.standard_normal((B, cap, Hk, D))) for _ in range(2))
    q = torch.from_numpy(rng.standard_normal((B, 1, H, D))).requires_grad_(True)
    k, v = (torch.from_numpy(rng.standard_normal((B, 1, Hk, D))).requires_grad_(True) for _ in range(2))
    lens = torch.tensor([5, 11])
    ref_caches = kc.numpy().copy(), vc.numpy().copy()
    ref, pull = pyattn.vjp(pyattn.attention_with_kvcache, q.detach().numpy(), *ref_caches, lens.numpy(),
                           k=k.detach().numpy(), v=v.detach().numpy())
    o = pt.attention_with_kvcache(q, kc, vc, lens, k=k, v=v)
    np.testing.assert_array_equal(o.detach().numpy(), ref)
    np.testing.assert_array_equal(kc.numpy(), ref_caches[0])          # written in place
    assert torch.equal(kc[1, 11], k[1, 0].detach())
    do = rng.standard_normal(ref.shape)
    (o * torch.from_numpy(do)).sum().backward()
    grads = pull(do)
    for name, t in (("q", q), ("k", k), ("v", v)):
        np.testing.assert_array_equal(t.grad.numpy(), grads[name])
    before = kc.clone()
    with pytest.raises(ValueError, match="num_splits"):
        pt.attention_with_kvcache(q, kc, vc, lens, k=k, v=v, num_splits=5000)
    assert torch.equal(kc, before)


@pytest.mark.parametrize("cache", ["strided", "float16"])
def test_kvcache_refuses_a_cache_it_could_only_copy(cache):
    """New keys written into a copy of the cache would be lost: a strided or half-precision
    cache is an error, in eager mode too, and the cache is left as it was."""
    B, Hk, D, cap = 1, 2, 8, 16
    wide = torch.zeros(B, cap, Hk, 2 * D)
    kc = wide[..., :D] if cache == "strided" else torch.zeros(B, cap, Hk, D, dtype=torch.float16)
    vc = torch.zeros(B, cap, Hk, D, dtype=kc.dtype)
    q, k, v = (torch.ones(B, 1, Hk, D, dtype=kc.dtype) for _ in range(3))
    with pytest.raises((TypeError, ValueError), match="k_cache"):
        pt.attention_with_kvcache(q, kc, vc, torch.tensor([3]), k=k, v=v)
    assert not kc.any()


def test_compile_fullgraph_traces_a_model():
    class Hybrid(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 3 * 16, dtype=torch.float64)
            self.gate = torch.nn.Linear(16, 2, dtype=torch.float64)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.proj(x).view(B, T, 3, 2, 8).unbind(2)
            g = torch.nn.functional.logsigmoid(self.gate(x))
            a = pt.softmax_attention(q, k, v, causal=True, window=(4, 0))
            b, _ = pt.gated_delta_rule(q, k, v, g, torch.sigmoid(g), qk_l2norm=True)
            return (a + b).reshape(B, T, 16)

    torch.manual_seed(0)
    model = Hybrid()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    eager = model(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    assert torch.equal(out, eager)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)


def test_stub_matches_the_functions():
    """pyattn/torch/__init__.pyi declares every function with the runtime's parameters."""
    import ast
    import inspect
    import pathlib

    stub = pathlib.Path(pt.__file__).with_suffix(".pyi").read_text()
    declared = {}
    for node in ast.parse(stub).body:
        if isinstance(node, ast.FunctionDef):
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            declared.setdefault(node.name, []).append(names + ([f"**{a.kwarg.arg}"] if a.kwarg else []))
    assert set(declared) == set(pt.__all__)
    for name, variants in declared.items():
        params = inspect.signature(getattr(pt, name)).parameters.values()
        runtime = [("**" if p.kind == p.VAR_KEYWORD else "") + p.name for p in params]
        for names in variants:
            if runtime[-1].startswith("**"):  # the stub spells out feature_map's parameters
                assert names[:len(runtime) - 1] == runtime[:-1], name
            else:
                assert names == runtime, name


def test_an_input_modified_before_the_backward_is_refused():
    """The eager path saves its inputs: autograd refuses a backward after one of them changed
    in place (pyattn's pullback would read the new values)."""
    q = torch.randn(1, 8, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 8, 2, 4, dtype=torch.float64)
    o = pt.softmax_attention(q, k, k)
    k.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()



def test_list_arguments_may_be_tuples():
    """merge_attention_states' parts given as tuples of tensors, as pyattn takes them."""
    rng = np.random.default_rng(7)
    os_ = [rng.standard_normal((1, 3, 2, 4)) for _ in range(2)]
    lses = [rng.standard_normal((1, 3, 2)) for _ in range(2)]
    o, lse = pt.merge_attention_states(tuple(map(torch.from_numpy, os_)), tuple(map(torch.from_numpy, lses)))
    ref_o, ref_lse = pyattn.merge_attention_states(os_, lses)
    np.testing.assert_array_equal(o.numpy(), ref_o)
    np.testing.assert_array_equal(lse.numpy(), ref_lse)


def test_python_scalars_before_a_tensor_argument_keep_the_gradients_in_place():
    """retention's gamma given as a Python list becomes a tensor, in its place among the
    arguments: initial_state, after it, still gets its own gradient."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 5, 2, 3)) for _ in range(3))
    h0, do = rng.standard_normal((1, 2, 3, 3)), rng.standard_normal((1, 5, 2, 3))
    gamma = [0.9, 0.5]
    leaves = [torch.from_numpy(a).requires_grad_(True) for a in (q, k, v, h0)]
    o, _ = pt.retention(*leaves[:3], gamma=gamma, initial_state=leaves[3])
    o.backward(torch.from_numpy(do))
    _, pullback = pyattn.vjp(pyattn.retention, q, k, v, gamma=np.array(gamma), initial_state=h0)
    grads = pullback((do, None))
    for t, name in zip(leaves, ("q", "k", "v", "initial_state")):
        np.testing.assert_allclose(t.grad.numpy(), grads[name], rtol=1e-12, atol=1e-12)

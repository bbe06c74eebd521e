"""The machinery behind pyattn.torch: one ``torch.library.custom_op`` per pyattn op, its
backward a custom op of its own, both generated from the op's Python signature.

Each op ``pyattn::<name>`` takes every argument of the pyattn op positionally (arrays as
tensors, flags and sizes as schema scalars) and returns a fixed tuple of tensors: every output
the op can give, an empty placeholder where the call's flags leave one out (``final_state``
without ``output_final_state``), so that the schema does not depend on the flags. The public
function maps the placeholders back to None and returns pyattn's structure.

``pyattn::<name>_backward`` takes the same arguments, the forward's outputs and their
cotangents, and returns one gradient per tensor argument (an empty placeholder for an
argument that gets none). It runs pyattn's C backward through ``pyattn.vjp``: the softmax
family reuses the forward's output and LSE, the others recompute their forward first. The
custom ops serve torch.compile, export, functorch transforms and dispatch modes; a plain
eager call runs pyattn directly (``Op._eager``, else ``Op.dispatch``), its gradients through
EagerVJP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from torch.utils._python_dispatch import _get_current_dispatch_mode

_functorch_active = torch._C._are_functorch_transforms_active
_dispatch_depth = torch._C._len_torch_dispatch_stack

import pyattn
from pyattn import _outputs as outputs
from pyattn._engines import KVCall, softmax_backward, softmax_prepare

# ------------------------------------------------------------------------------------------
# argument kinds

# Schema types of the non-tensor arguments, by name; every other argument is a tensor.
_SCALARS = {
    "causal": "bool", "return_lse": "bool", "return_colsum": "bool", "normalize": "bool",
    "output_final_state": "bool", "dt_softplus": "bool", "qk_l2norm": "bool",
    "sinks": "int", "num_splits": "int", "block_size": "int", "top_k": "int", "block_count": "int",
    "chunk_size": "int", "num_householder": "int",
    "scale": "float?", "softcap": "float", "eps": "float", "theta": "float",
    "form": "str", "kind": "str", "feature_map": "str?",
}
# softmax's window is (left, right); NSA's is one int, FoX's one int or None
_WINDOW = {"nsa_attention": "int", "forgetting_attention": "int?"}
# feature-map parameters travel as schema arguments of their own (a schema has no dict)
_MAP_PARAMS = (("projection", "Tensor?"), ("p", "int?"), ("max_len", "int?"))
_MAP_NAMES = frozenset(n for n, _ in _MAP_PARAMS)
_LISTS = {"os", "lses"}


@dataclass(frozen=True)
class Param:
    name: str
    schema: str            # its schema type
    keyword: bool          # keyword-only in pyattn's signature


def params_of(name: str, fn: Callable) -> List[Param]:
    """The schema arguments of op ``name``, in the order of pyattn's signature, with the
    feature-map parameters (``feature_map_params`` or ``**params``) spread into their own."""
    import inspect

    out = []
    for p in inspect.signature(fn).parameters.values():
        keyword = p.kind == p.KEYWORD_ONLY
        if p.kind == p.VAR_KEYWORD or p.name == "feature_map_params":
            out += [Param(n, t, True) for n, t in _MAP_PARAMS]
            continue
        if p.name in _LISTS:
            schema = "Tensor[]"
        elif p.name == "window":
            schema = _WINDOW.get(name, "int[]?")
        elif p.name in _SCALARS:
            schema = _SCALARS[p.name]
        else:
            schema = "Tensor?" if p.default is None else "Tensor"
        out.append(Param(p.name, schema, keyword))
    return out


# ------------------------------------------------------------------------------------------
# tensors <-> arrays

_HALF = (torch.bfloat16, torch.float16)
try:
    import ml_dtypes

    _BF16: Optional[np.dtype] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # without NumPy's bfloat16 type, bf16 tensors are computed in float32
    _BF16 = None
# the dtypes computed in float32 and returned in their own; bfloat16 crosses as itself when
# NumPy has the type (pyattn computes bf16 arrays itself)
_WIDENED = (torch.float16,) if _BF16 is not None else _HALF


def _numpy(t: torch.Tensor) -> np.ndarray:
    """The NumPy view of a CPU tensor that does not require grad; a bfloat16 one seen as
    NumPy's bfloat16 through its bits (torch will not export bf16 itself)."""
    if t.dtype is torch.bfloat16 and _BF16 is not None:
        return t.view(torch.uint16).numpy().view(_BF16)
    return t.numpy()


def to_array(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (a copy only where it is not contiguous); float16 (and
    bfloat16 without ml_dtypes) become float32. Each step only where needed: this runs for
    every tensor of every call."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype in _WIDENED:
        t = t.float()
    if not t.is_contiguous():
        t = t.contiguous()
    return _numpy(t)


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    """A tensor viewing a C-contiguous array (bfloat16 through its bits)."""
    if _BF16 is not None and a.dtype == _BF16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def to_tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = _from_numpy(np.ascontiguousarray(a))
    return t.to(dtype) if t.dtype != dtype else t


def placeholder(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,))


# ------------------------------------------------------------------------------------------
# calling pyattn from schema arguments


class CallPlan:
    """How an op's schema arguments become pyattn's (args, kwargs), worked out once per op:
    each slot's conversion (a tensor to an array, a list of tensors to a list of arrays, a
    window list to a tuple) and where it goes (positional, keyword, or gathered into the
    feature-map parameters). The conversions touch only the slots that need them: this runs
    for every call."""

    _TENSOR, _LIST, _WINDOW, _PLAIN = range(4)

    def __init__(self, params: Sequence[Param]):
        def kind(p: Param) -> int:
            if p.schema == "Tensor[]":
                return self._LIST
            if p.schema.startswith("Tensor"):
                return self._TENSOR
            return self._WINDOW if p.schema == "int[]?" else self._PLAIN

        self.positional = [(i, kind(p)) for i, p in enumerate(params)
                           if not p.keyword and p.name not in _MAP_NAMES]
        self.keywords = [(i, p.name, kind(p)) for i, p in enumerate(params)
                         if p.keyword and p.name not in _MAP_NAMES]
        self.maps = [(i, p.name, kind(p)) for i, p in enumerate(params) if p.name in _MAP_NAMES]
        # feature_map takes its parameters as **params, linear_attention as feature_map_params
        self.spread_maps = len(params) > 1 and params[1].name == "kind"
        self.kinds = [kind(p) for p in params]

    def _convert(self, v, kind: int):
        if v is None or kind == self._PLAIN:
            return v
        if kind == self._TENSOR:
            return to_array(v)
        if kind == self._LIST:
            return [to_array(x) for x in v]
        return tuple(v)

    def __call__(self, values: Sequence[Any]) -> Tuple[list, dict]:
        """pyattn's (args, kwargs) from the schema arguments."""
        return self.place([self._convert(v, kind) for v, kind in zip(values, self.kinds)])

    def place(self, values: Sequence[Any]) -> Tuple[list, dict]:
        """pyattn's (args, kwargs) from schema arguments already converted."""
        args = [values[i] for i, _ in self.positional]
        kwargs = {name: values[i] for i, name, _ in self.keywords}
        found = {name: values[i] for i, name, _ in self.maps if values[i] is not None}
        if found:
            if self.spread_maps:
                kwargs.update(found)
            else:
                kwargs["feature_map_params"] = found
        return args, kwargs


# ------------------------------------------------------------------------------------------
# outputs

def output_shapes(name: str, kw: Dict[str, Any]) -> List[Optional[tuple]]:
    """Each output's shape for a call with these schema arguments (None: a placeholder)."""
    def shape(arg):
        v = kw.get(arg)
        if isinstance(v, (list, tuple)) and v:
            v = v[0]
        return tuple(v.shape) if isinstance(v, torch.Tensor) else ()

    return [s if keep else None for s, keep in zip(outputs.shapes(name, shape, kw.get),
                                                   outputs.returned(name, kw.get))]


# ------------------------------------------------------------------------------------------
# the forward and backward kernels


def _first_float(values) -> torch.Tensor:
    for v in values:
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            v = v[0]
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    raise TypeError("pyattn.torch: the call has no floating-point tensor")


def _ret(values: tuple):
    """A custom op's return: a schema of one output returns it bare."""
    return values[0] if len(values) == 1 else values


def _tup(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _output_tensors(name: str, out, option: Callable[[str], Any], ref: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """pyattn's return value as one tensor per output (floats in ref's dtype, indices int64),
    a placeholder for each the call does not return."""
    return tuple(placeholder(ref) if a is None else to_tensor(a, torch.int64 if a.dtype.kind == "i" else ref.dtype)
                 for a in outputs.entries(name, out, option))


def _cotangent(name: str, cots: Sequence[Optional[torch.Tensor]], option: Callable[[str], Any]):
    """The cotangents of the returned outputs, as arrays in pyattn's return structure."""
    return outputs.structure(name, [None if c is None or not keep else to_array(c)
                                    for c, keep in zip(cots, outputs.returned(name, option))], option)


class Op:
    """One pyattn op as a pair of custom ops, its fake kernels and its autograd formula."""

    def __init__(self, name: str, fn: Callable, vjp_fn: Optional[Callable] = None,
                 forced: Optional[Dict[str, Any]] = None, differentiable: bool = True):
        """differentiable False: the op alone, without a backward (dsa_select's indices,
        dsa_index_target's distillation target), so that torch.compile traces it."""
        self.name, self.fn = name, fn
        # flags the forward always runs with, whatever the call's: the outputs vjp_fn reuses
        self.forced = dict(forced or {})
        self.params = params_of(name, fn)
        self.call_args = CallPlan(self.params)
        self.names = [p.name for p in self.params]
        self.outputs = outputs.names(name)
        self.tensors = [i for i, p in enumerate(self.params) if p.schema.startswith("Tensor")]
        self.windows = [i for i, p in enumerate(self.params) if p.schema == "int[]?"]
        # vjp_fn(args, kwargs, outs, cot) -> grads: a backward that reuses the forward's outputs
        self.vjp_fn = vjp_fn
        args = ", ".join(f"{p.schema} {p.name}" for p in self.params)
        rets = ", ".join("Tensor" for _ in self.outputs)
        self.op = torch.library.custom_op(f"pyattn::{name}", self._forward, mutates_args=(),
                                          schema=f"({args}) -> ({rets})")
        self.op.register_fake(self._fake)
        self.differentiable = differentiable
        if not differentiable:
            return
        outs = ", ".join(f"Tensor out_{o}" for o in self.outputs)
        cots = ", ".join(f"Tensor grad_{o}" for o in self.outputs)
        grads = ", ".join("Tensor[]" if self.params[i].schema == "Tensor[]" else "Tensor" for i in self.tensors)
        self.backward_op = torch.library.custom_op(
            f"pyattn::{name}_backward", self._backward, mutates_args=(),
            schema=f"({args}, {outs}, {cots}) -> ({grads})")
        self.backward_op.register_fake(self._fake_backward)
        self.op.register_autograd(self._autograd_backward, setup_context=self._setup_context)

    # -- forward
    def _forward(self, *values):
        kw = {**dict(zip(self.names, values)), **self.forced}
        args, kwargs = self.call_args(values)
        return _ret(_output_tensors(self.name, self.fn(*args, **{**kwargs, **self.forced}), kw.get,
                                    _first_float(values)))

    def _fake(self, *values):
        ref = _first_float(values)
        shapes = output_shapes(self.name, {**dict(zip(self.names, values)), **self.forced})
        dtype = torch.int64 if self.name in outputs.INDEX_OUTPUTS else ref.dtype
        return _ret(tuple(ref.new_empty(s if s is not None else (0,), dtype=dtype) for s in shapes))

    # -- backward
    def _backward(self, *values):
        n, m = len(self.params), len(self.outputs)
        fwd, outs, cots = values[:n], values[n:n + m], values[n + m:]
        grads = self._grads(fwd, outs, _cotangent(self.name, cots, dict(zip(self.names, fwd)).get))
        result = []
        for i in self.tensors:
            p, x = self.params[i], fwd[i]
            g = grads.get(p.name)
            if p.schema == "Tensor[]":
                result.append([to_tensor(gi, xi.dtype) for gi, xi in zip(g, x)])
            elif g is None or x is None:
                result.append(placeholder(_first_float(fwd)))
            else:
                result.append(to_tensor(g, x.dtype))
        return _ret(tuple(result))

    def _grads(self, fwd, outs, cot) -> Dict[str, Any]:
        """pyattn's gradients, by argument name, for the cotangent cot of the call fwd that
        returned outs."""
        kw = dict(zip(self.names, fwd))
        args, kwargs = self.call_args(fwd)
        if self.vjp_fn is not None and _first_float(fwd).dtype not in _HALF:
            kept = outputs.returned(self.name, {**kw, **self.forced}.get)
            return self.vjp_fn(args, kwargs, [to_array(o) if k else None for o, k in zip(outs, kept)], cot)
        return pyattn.vjp(self.fn, *args, **kwargs)[1](cot)

    def _fake_backward(self, *values):
        fwd = values[:len(self.params)]
        ref = _first_float(fwd)
        result = []
        for i in self.tensors:
            x = fwd[i]
            if self.params[i].schema == "Tensor[]":
                result.append([torch.empty_like(xi) for xi in x])
            elif x is None or not x.is_floating_point():
                result.append(ref.new_empty((0,)))
            else:
                result.append(torch.empty_like(x))
        return _ret(tuple(result))

    # -- autograd
    def _setup_context(self, ctx, inputs, output):
        flat, layout = [], []
        for v in list(inputs) + list(_tup(output)):
            if isinstance(v, torch.Tensor):
                layout.append(("t", len(flat)))
                flat.append(v)
            elif isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
                layout.append(("l", len(flat), len(v)))
                flat.extend(v)
            else:
                layout.append(("v", v))
        ctx.save_for_backward(*flat)
        ctx.layout = layout

    def _autograd_backward(self, ctx, *grads):
        saved = ctx.saved_tensors
        values = []
        for entry in ctx.layout:
            if entry[0] == "t":
                values.append(saved[entry[1]])
            elif entry[0] == "l":
                values.append(list(saved[entry[1]:entry[1] + entry[2]]))
            else:
                values.append(entry[1])
        n = len(self.params)
        fwd, outs = values[:n], values[n:]
        cots = [o.new_zeros(o.shape) if g is None else g.contiguous() for g, o in zip(grads, outs)]
        tensor_grads = iter(_tup(self.backward_op(*fwd, *outs, *cots)))
        result = []
        for i, p in enumerate(self.params):
            if not p.schema.startswith("Tensor"):
                result.append(None)
                continue
            g = next(tensor_grads)
            x = fwd[i]
            usable = x is not None and (p.schema == "Tensor[]" or x.is_floating_point())
            result.append(g if usable else None)
        return tuple(result)

    # -- the public call
    def __call__(self, values: Sequence[Any]):
        fast = self._eager(values)
        if fast is not None:
            return fast
        values = list(values)
        tensors: List[torch.Tensor] = []
        for i in self.tensors:
            v = values[i]
            if v is None:
                continue
            if self.params[i].schema == "Tensor[]":
                v = values[i] = list(v)
                tensors += v
            elif not isinstance(v, torch.Tensor):
                t = torch.as_tensor(v)
                # a Python float converted straight to the call's dtype (not through float32)
                v = values[i] = t if not t.is_floating_point() else torch.as_tensor(v, dtype=self._ref_dtype(values))
                tensors.append(v)
            else:
                tensors.append(v)
        for t in tensors:
            if t.device.type != "cpu":
                name = next(self.names[i] for i in self.tensors if values[i] is t or
                            (isinstance(values[i], list) and any(x is t for x in values[i])))
                raise TypeError(f"pyattn.torch.{self.name}(): '{name}' is on {t.device}; pyattn's "
                                f"kernels run on the CPU: move it with .cpu() (fla and flash-attn serve "
                                f"CUDA tensors)")
        for i in self.windows:
            if values[i] is not None:
                values[i] = [int(x) for x in values[i]]
        return self.dispatch(values, tensors)

    def _eager(self, values: Sequence[Any]):
        """The common call, straight to pyattn: plain contiguous CPU float32/float64 (or
        integer) tensors, nothing tracing or transforming. None for every other call, which
        the general path below converts, checks and dispatches. Kept short because it is the
        whole cost of a small call: run after a kernel has evicted the caches, each Python
        step here costs several times its warm time."""
        if torch.compiler.is_compiling() or _functorch_active() or _dispatch_depth():
            return None
        arrays = list(values)
        tensors = []
        dtype = None
        grad = False
        for i in self.tensors:
            t = values[i]
            if t is None:
                continue
            # a strided tensor crosses as a strided view: pyattn copies what it reads
            if type(t) is not torch.Tensor or not t.is_cpu or t.dtype in _WIDENED:
                return None
            if t.requires_grad:
                grad = True
                t = t.detach()
            arrays[i] = t.numpy() if t.dtype is not torch.bfloat16 else _numpy(t)
            tensors.append(values[i])
            if dtype is None and t.is_floating_point():
                dtype = t.dtype
        if dtype is None:
            return None
        for i in self.windows:
            if values[i] is not None:
                arrays[i] = tuple(int(x) for x in values[i])
        args, kwargs = self.call_args.place(arrays)
        if grad and self.differentiable and torch.is_grad_enabled():
            keys = [(self.names[i], None) for i in self.tensors if values[i] is not None]
            return EagerVJP.apply(_Call(self.fn, args, kwargs, dtype, keys), *tensors)
        return _as_tensors(self.fn(*args, **kwargs), dtype)

    def _ref_dtype(self, values: List[Any]) -> Optional[torch.dtype]:
        """The dtype of the call's first floating-point tensor argument (None: there is none)."""
        for i in self.tensors:
            for t in (values[i] if isinstance(values[i], (list, tuple)) else (values[i],)):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    return t.dtype
        return None

    def dispatch(self, values: List[Any], tensors: List[torch.Tensor]):
        """pyattn's return structure, of tensors. Where torch traces or transforms the call, the
        custom op; in plain eager mode pyattn's own call without the dispatcher's cost, with
        gradients through EagerVJP, whose backward reuses the forward's pullback instead of
        running it again."""
        if not _plain_eager(tensors):
            return outputs.structure(self.name, _tup(self.op(*values)), dict(zip(self.names, values)).get)
        args, kwargs = self.call_args(values)
        dtype = _first_float(values).dtype
        if (self.differentiable and torch.is_grad_enabled()
                and any(t.requires_grad for t in tensors if t.is_floating_point())):
            keys = [(p.name, i if isinstance(v, list) else None)
                    for p, v in zip(self.params, values)
                    for i, t in enumerate(v if isinstance(v, list) else [v]) if isinstance(t, torch.Tensor)]
            return EagerVJP.apply(_Call(self.fn, args, kwargs, dtype, keys), *tensors)
        return _as_tensors(self.fn(*args, **kwargs), dtype)


def _as_tensors(out, dtype: torch.dtype):
    """pyattn's return value with each array a tensor (floats in dtype, indices int64)."""
    if isinstance(out, tuple):
        return tuple(None if a is None else _as_tensor(a, dtype) for a in out)
    return _as_tensor(out, dtype)


def _as_tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """One of pyattn's outputs (C-contiguous, as pyattn returns them) as a tensor."""
    t = _from_numpy(a)
    want = dtype if t.is_floating_point() else torch.int64
    return t if t.dtype == want else t.to(want)


def _plain_eager(tensors: Sequence[torch.Tensor]) -> bool:
    """Plain tensors, no compiler tracing, no functorch transform, no dispatch mode: the call
    may run pyattn directly rather than through the custom op."""
    return (not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()
            and _get_current_dispatch_mode() is None and all(type(t) is torch.Tensor for t in tensors))


class _Call:
    """An op's call as one opaque argument of EagerVJP.apply: autograd.Function.apply walks
    its arguments as a pytree, and a list and a dict of arrays would be walked element by
    element on every call."""
    __slots__ = ("fn", "args", "kwargs", "dtype", "keys")

    def __init__(self, fn, args, kwargs, dtype, keys):
        self.fn, self.args, self.kwargs, self.dtype, self.keys = fn, args, kwargs, dtype, keys


class EagerVJP(torch.autograd.Function):
    """An op in eager mode with pyattn.vjp's pullback kept for the backward: the forward runs
    once (the custom op's backward, which torch.compile needs as a function of tensors,
    runs it again). Returns pyattn's structure (a tuple may hold None). The inputs are saved
    for backward so that autograd refuses gradients after one of them was modified in place."""

    @staticmethod
    def forward(ctx, call: _Call, *tensors: torch.Tensor):
        out, ctx.pullback = pyattn.vjp(call.fn, *call.args, **call.kwargs)
        outs = _as_tensors(out, call.dtype)
        ctx.keys, ctx.structured = call.keys, isinstance(outs, tuple)
        ctx.save_for_backward(*tensors)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        tensors = ctx.saved_tensors
        arrays = [None if g is None else to_array(g) for g in grads]
        found = ctx.pullback(tuple(arrays) if ctx.structured else arrays[0])
        result = []
        for (name, i), t in zip(ctx.keys, tensors):
            g = found.get(name)
            g = g if i is None or g is None else g[i]
            result.append(None if g is None else to_tensor(g, t.dtype))
        return (None, *result)


def spread_map_params(fn: str, params: Optional[Dict[str, Any]]) -> Tuple[Any, ...]:
    """(projection, p, max_len) from a feature map's parameters; another name is a TypeError
    as in pyattn."""
    params = dict(params or {})
    unknown = sorted(set(params) - {n for n, _ in _MAP_PARAMS})
    if unknown:
        raise TypeError(f"pyattn.torch.{fn}(): unknown feature-map parameters {unknown}")
    return tuple(params.get(n) for n, _ in _MAP_PARAMS)


def softmax_vjp(args, kwargs, outs, cot):
    """softmax_attention's backward from the forward's o and LSE: no forward recomputed."""
    q, k, v = args
    options = {n: x for n, x in kwargs.items() if n != "return_lse"}
    q, k, v, opts = softmax_prepare(q, k, v, **options)
    do, dlse = cot if isinstance(cot, tuple) else (cot, None)
    dq, dk, dv = softmax_backward(q, k, v, outs[0], outs[1], do, dlse, opts)
    return {"q": dq, "k": dk, "v": dv}


class KVCacheOp(Op):
    """attention_with_kvcache as two custom ops: ``pyattn::kvcache_append`` checks the whole
    call and writes the new keys and values into the caches (declared in mutates_args, so it
    has no autograd formula: torch allows none on a mutating op), then the functional
    ``pyattn::attention_with_kvcache`` attends over the caches it wrote, differentiable in q,
    the new k and v, and the cache rows read."""

    def __init__(self, fn: Callable):
        super().__init__("attention_with_kvcache", fn)
        args = ", ".join(("Tensor(a!) " if p.name in ("k_cache", "v_cache") else f"{p.schema} ") + p.name
                         for p in self.params)
        self.append_op = torch.library.custom_op("pyattn::kvcache_append", self._append,
                                                 mutates_args=("k_cache", "v_cache"),
                                                 schema=f"({args}) -> ()")
        self.append_op.register_fake(lambda *values: None)

    def _append(self, *values):
        self._check_caches(values)
        args, kwargs = self.call_args(values)
        # the arrays view the caches' memory, so the write lands in the tensors
        call = KVCall(*args, kwargs["k"], kwargs["v"], *(kwargs[n] for n in _KV_CALL_ARGS))
        with call.written():
            pass

    def _check_caches(self, values):
        """The caches take the new rows in place: a copy of them (another dtype, or made
        contiguous) would take them instead."""
        for name in ("k_cache", "v_cache"):
            t = values[self.names.index(name)]
            if t.dtype in _WIDENED or not t.is_contiguous():
                kinds = "float32, float64 or bfloat16" if _BF16 is not None else "float32 or float64"
                raise TypeError(f"pyattn.torch.attention_with_kvcache(): '{name}' must be a contiguous "
                                f"{kinds} tensor: the new keys are written into it")

    def _read_call(self, values):
        """pyattn's call over the caches as written: no new keys, every sequence longer by Tnew."""
        args, kwargs = self.call_args(values)
        k = kwargs.pop("k")
        kwargs.pop("v")
        if k is not None:
            args[3] = np.asarray(args[3]) + k.shape[1]
        return args, kwargs, k

    def _forward(self, *values):
        args, kwargs, _ = self._read_call(values)
        return _ret(_output_tensors(self.name, self.fn(*args, **kwargs), dict(zip(self.names, values)).get,
                                    _first_float(values)))

    def _grads(self, fwd, outs, cot) -> Dict[str, Any]:
        """pyattn's gradients over the caches as written; the new rows' gradients are k's and
        v's."""
        args, kwargs, k = self._read_call(fwd)
        grads = pyattn.vjp(self.fn, *args, **kwargs)[1](cot)
        if k is not None:
            # named rather than *args, which mypy (checking this body) would let fill k and v
            q, k_cache, v_cache, seqlens = args
            call = KVCall(q, k_cache, v_cache, seqlens, None, None, *(kwargs[x] for x in _KV_CALL_ARGS))
            B, Tnew = k.shape[:2]
            pos = np.asarray(seqlens)[:, None] - Tnew + np.arange(Tnew)
            rows = call.rows(np.arange(B)[:, None], pos).ravel()
            for name, cache in (("k", "k_cache"), ("v", "v_cache")):
                flat = grads[cache].reshape(-1, *grads[cache].shape[2:])
                grads[name] = flat[rows].reshape(B, Tnew, *flat.shape[1:])
                flat[rows] = 0  # overwritten rows: their old values reach nothing
        return grads

    def dispatch(self, values: List[Any], tensors: List[torch.Tensor]):
        """Traced: the append op, then the functional one. Eager: pyattn's own call, which
        writes the rows itself (EagerVJP's pyattn.vjp, or the plain call)."""
        if values[self.names.index("k")] is not None:
            self._check_caches(values)
            if not _plain_eager(tensors):
                self.append_op(*values)
        return super().dispatch(values, tensors)


# KVCall's arguments after (q, k_cache, v_cache, cache_seqlens, k, v), by keyword name
_KV_CALL_ARGS = ("causal", "scale", "window", "sinks", "alibi_slopes", "softcap", "block_table", "num_splits")

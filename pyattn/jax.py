"""pyattn's differentiable ops on jax arrays, under ``jax.jit``, ``jax.grad`` and ``jax.vmap``
on the CPU (the optional extra ``pip install "pyattn[jax]"``; ``import pyattn`` never imports jax).

    import jax, jax.numpy as jnp
    import pyattn.jax as pjax

    @jax.jit
    def loss(q, k, v, g):
        o, _ = pjax.simple_gla(q, k, v, g, form="chunk")
        return jnp.sum(o ** 2)

    dq, dk, dv, dg = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, g)

Every op of ``pyattn.OPS`` that ``pyattn.vjp`` differentiates is here under its name, with its
arguments and defaults, as a ``jax.custom_vjp`` over ``jax.pure_callback`` with
``vmap_method="sequential"`` (``jax.vmap`` runs the op once per entry of the mapped axis).
``attention_with_kvcache`` is not: it writes its caches in place, which a jax function cannot.

- Arguments that are arrays (NumPy or jax: q, k, v, gates, states, cu_seqlens, positions,
  alibi_slopes, the lists of merge_attention_states, the arrays in feature_map_params) are
  traced operands; every other argument (flags, sizes, scale, window, form, Python numbers)
  is static, passed to pyattn as given (a list as a tuple). A static argument is a Python
  value at trace time: under ``jax.jit`` make it a ``static_argnames`` entry or a constant of
  the traced function; a new value is then a new trace.
- The forward callback runs the pyattn op and gives its bits. The result shapes come from
  shape rules, without running a kernel at trace time.
- The backward callback runs ``pyattn.vjp`` and its pullback, so it recomputes the forward:
  jax keeps the inputs as residuals, not pyattn's saved state. The gradients are pyattn's;
  an operand pyattn.vjp does not differentiate (cu_seqlens, positions, alibi_slopes, a traced
  scale) gets a zero cotangent (float0 for integers).
- float32 and float64 keep their dtype (float64 needs ``jax_enable_x64``); bfloat16 reaches
  pyattn as NumPy's bfloat16 (pyattn's bf16 call: stored bf16, computed in float32); float16 is
  computed in float32; outputs and gradients come back in the inputs' dtype.
- pyattn checks the arguments inside the callback: a bad one reaches the caller as jax's
  ``JaxRuntimeError`` carrying pyattn's exception type and message.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Sequence, Tuple, Union, overload

import numpy as np

from . import OPS, _outputs
from .autodiff import vjp as _vjp

# jax is an optional extra: mypy checks this package without it too, jax then being Any
try:
    import jax  # type: ignore[import-not-found, unused-ignore]
    import jax.numpy as jnp  # type: ignore[import-not-found, unused-ignore]
    from jax import Array  # type: ignore[import-not-found, unused-ignore]
    from jax.typing import ArrayLike  # type: ignore[import-not-found, unused-ignore]
except ImportError as exc:
    raise ImportError('pyattn.jax needs jax: pip install "pyattn[jax]"') from exc

if TYPE_CHECKING:
    from .feature_maps import Kind

_WithState = Tuple[Array, Optional[Array]]
_Form = Literal["chunk", "parallel", "recurrent"]
_ChunkSize = Literal[16, 32, 64, 128]

_EXCLUDED = ("attention_with_kvcache",)  # writes its caches in place
__all__ = [name for name, info in OPS.items() if info.differentiable and name not in _EXCLUDED]

# arrays inside a dict argument that pyattn.vjp differentiates, keyed by their own name
_NESTED_GRADS: Dict[str, Tuple[str, ...]] = {"feature_map_params": ("projection",)}
# computed in float32 here; bfloat16 arrays go to pyattn as they are (its own bf16 call)
_LOW_PRECISION = (jnp.dtype(jnp.float16),)


class _Items(tuple):
    """The non-array entries of a dict argument, hashable; the call rebuilds the dict."""


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


def _freeze(x: Any) -> Any:
    """A static argument as a hashable value (lists become tuples)."""
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(y) for y in x)
    return x


def _split(name: str, arguments: Dict[str, Any]) -> Tuple[Tuple[Tuple[str, Any], ...], Dict[str, Any]]:
    """(static, operands): the arguments that are arrays (or lists of arrays, or arrays inside a
    dict) become operands, the rest static."""
    static: List[Tuple[str, Any]] = []
    operands: Dict[str, Any] = {}
    for arg, value in arguments.items():
        if _is_array(value):
            operands[arg] = jnp.asarray(value)
        elif isinstance(value, (list, tuple)) and value and all(_is_array(x) for x in value):
            operands[arg] = [jnp.asarray(x) for x in value]
        elif isinstance(value, dict):
            arrays = {key: jnp.asarray(x) for key, x in value.items() if _is_array(x)}
            if arrays:
                operands[arg] = arrays
            static.append((arg, _Items((key, _freeze(x)) for key, x in value.items() if key not in arrays)))
        else:
            static.append((arg, _freeze(value)))
    for arg, value in static:
        try:
            hash(value)
        except TypeError:
            raise TypeError(f"{name}(): {arg!r} must be an array or a hashable value, got "
                            f"{type(arguments[arg]).__name__}") from None
    return tuple(static), operands


def _kwargs(static: Tuple[Tuple[str, Any], ...], operands: Dict[str, Any]) -> Dict[str, Any]:
    """pyattn's keyword arguments from the static part and the operands (NumPy arrays)."""
    kwargs = {arg: dict(value) if isinstance(value, _Items) else value for arg, value in static}
    for arg, value in operands.items():
        kwargs[arg] = {**kwargs[arg], **value} if isinstance(value, dict) else value
    return kwargs


def _compute_dtype(operands: Any) -> Tuple[Any, Optional[Any]]:
    """(the float dtype of the results, float32 when that is a dtype pyattn computes in float32,
    else None). Mixed float dtypes pass to pyattn as they are, which refuses them by name."""
    floats = [x.dtype for x in jax.tree_util.tree_leaves(operands) if jnp.issubdtype(x.dtype, jnp.floating)]
    dtype = floats[0] if floats else np.dtype(np.float32)
    return dtype, (np.dtype(np.float32) if dtype in _LOW_PRECISION and set(floats) == {dtype} else None)


def _to_numpy(tree: Any, upcast: Optional[Any]) -> Any:
    def convert(x: Any) -> np.ndarray:
        x = np.asarray(x)
        return x.astype(upcast) if upcast is not None and x.dtype in _LOW_PRECISION else x

    return jax.tree_util.tree_map(convert, tree)


# ---------------------------------------------------------------------------------------------
# Result shapes, from the input shapes (pyattn._outputs' rules, shared with pyattn.torch): no
# kernel runs at trace time.


def _result_structs(name: str, static: Tuple[Tuple[str, Any], ...], operands: Dict[str, Any]) -> Any:
    dtype, _ = _compute_dtype(operands)
    option = dict(static).get

    def shape(arg: str) -> Tuple[int, ...]:
        value = operands.get(arg)
        for nested in (v for v in operands.values() if isinstance(v, dict)):
            value = nested.get(arg, value)  # performer's projection inside feature_map_params
        if isinstance(value, list):
            value = value[0]
        if value is None:  # cu_seqlens given as a list is static
            given = option(arg)
            return (len(given),) if isinstance(given, tuple) else ()
        return tuple(value.shape)

    entries = [jax.ShapeDtypeStruct(s, dtype) if keep else None
               for s, keep in zip(_outputs.shapes(name, shape, option), _outputs.returned(name, option))]
    return _outputs.structure(name, entries, option)


# ---------------------------------------------------------------------------------------------
# The callbacks and the custom_vjp.


def _grad_paths(name: str, operands: Dict[str, Any]) -> List[Optional[Tuple[Any, ...]]]:
    """The flattened operands' paths, with None for an operand that gets no gradient."""
    differentiable = OPS[name].differentiable
    paths: List[Optional[Tuple[Any, ...]]] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(operands)[0]:
        keys: Tuple[Any, ...] = tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path)
        floating = jnp.issubdtype(leaf.dtype, jnp.floating)
        nested = len(keys) == 2 and keys[1] in _NESTED_GRADS.get(keys[0], ())
        wanted = keys[0] in differentiable and (len(keys) == 1 or isinstance(keys[1], int))
        paths.append(keys if floating and (nested or wanted) else None)
    return paths


def _pick(grads: Dict[str, Any], keys: Tuple[Any, ...]) -> Any:
    """pyattn.vjp's gradient of the operand at ``keys``: grads[arg], a list's grads[arg][i], or
    for an array inside a dict argument grads[its key]."""
    if len(keys) == 1:
        return grads[keys[0]]
    return grads[keys[0]][keys[1]] if isinstance(keys[1], int) else grads[keys[1]]


@dataclasses.dataclass(frozen=True)
class _Call:
    """An op's name and static arguments. Hashable and compared by value, so that the
    callbacks of two calls with the same static arguments are equal and jax reuses what it
    compiled for the first, outside jit too."""

    name: str
    static: Tuple[Tuple[str, Any], ...]


class _Forward(_Call):
    def __call__(self, operands: Dict[str, Any]) -> Any:
        dtype, upcast = _compute_dtype(operands)
        out = OPS[self.name].fn(**_kwargs(self.static, _to_numpy(operands, upcast)))
        return jax.tree_util.tree_map(lambda x: np.asarray(x, dtype), out)


class _Backward(_Call):
    def __call__(self, operands: Dict[str, Any], cotangent: Any) -> List[np.ndarray]:
        dtype, upcast = _compute_dtype(operands)
        _, pullback = _vjp(OPS[self.name].fn, **_kwargs(self.static, _to_numpy(operands, upcast)))
        grads = pullback(_to_numpy(cotangent, upcast))
        return [np.asarray(_pick(grads, keys), dtype) for keys in _grad_paths(self.name, operands) if keys]


def _apply_impl(call: _Call, operands: Dict[str, Any]) -> Any:
    return jax.pure_callback(_Forward(call.name, call.static), _result_structs(call.name, call.static, operands),
                             operands, vmap_method="sequential")


def _apply_fwd(call: _Call, operands: Dict[str, Any]) -> Tuple[Any, Dict[str, Any]]:
    return _apply_impl(call, operands), operands


def _apply_bwd(call: _Call, operands: Dict[str, Any], cotangent: Any) -> Tuple[Dict[str, Any]]:
    leaves, treedef = jax.tree_util.tree_flatten(operands)
    paths = _grad_paths(call.name, operands)
    structs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf, keys in zip(leaves, paths) if keys]
    grads = iter(jax.pure_callback(_Backward(call.name, call.static), structs, operands, cotangent,
                                   vmap_method="sequential"))
    return (jax.tree_util.tree_unflatten(treedef, [next(grads) if keys else None for keys in paths]),)


_apply = jax.custom_vjp(_apply_impl, nondiff_argnums=(0,))
_apply.defvjp(_apply_fwd, _apply_bwd)


def _call(name: str, arguments: Dict[str, Any]) -> Any:
    static, operands = _split(name, arguments)
    return _apply(_Call(name, static), operands)


# ---------------------------------------------------------------------------------------------
# The ops: pyattn's signatures. locals() at the top of each holds exactly its arguments, so the
# signature is the one list of them.


@overload
def softmax_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
                      scale: Optional[float] = None, window: Optional[Tuple[int, int]] = None,
                      sinks: int = 0, alibi_slopes: Optional[ArrayLike] = None, softcap: float = 0.0,
                      cu_seqlens: Optional[ArrayLike] = None, cu_seqlens_q: Optional[ArrayLike] = None,
                      cu_seqlens_k: Optional[ArrayLike] = None,
                      form: Literal["flash", "parallel", "recurrent"] = "flash",
                      return_lse: Literal[False] = False) -> Array: ...
@overload
def softmax_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
                      scale: Optional[float] = None, window: Optional[Tuple[int, int]] = None,
                      sinks: int = 0, alibi_slopes: Optional[ArrayLike] = None, softcap: float = 0.0,
                      cu_seqlens: Optional[ArrayLike] = None, cu_seqlens_q: Optional[ArrayLike] = None,
                      cu_seqlens_k: Optional[ArrayLike] = None,
                      form: Literal["flash", "parallel", "recurrent"] = "flash",
                      return_lse: Literal[True]) -> Tuple[Array, Array]: ...
def softmax_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
                      scale: Optional[float] = None, window: Optional[Tuple[int, int]] = None,
                      sinks: int = 0, alibi_slopes: Optional[ArrayLike] = None, softcap: float = 0.0,
                      cu_seqlens: Optional[ArrayLike] = None, cu_seqlens_q: Optional[ArrayLike] = None,
                      cu_seqlens_k: Optional[ArrayLike] = None,
                      form: Literal["flash", "parallel", "recurrent"] = "flash",
                      return_lse: bool = False) -> Union[Array, Tuple[Array, Array]]:
    """``pyattn.softmax_attention`` on jax arrays: o, or (o, lse) with return_lse."""
    return _call("softmax_attention", locals())


def forgetting_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike, *,
                         window: Optional[int] = None, scale: Optional[float] = None,
                         cu_seqlens: Optional[ArrayLike] = None,
                         form: Literal["flash", "parallel"] = "flash") -> Array:
    """``pyattn.forgetting_attention`` on jax arrays."""
    return _call("forgetting_attention", locals())


def moba_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, block_size: int, top_k: int,
                   causal: bool = True, scale: Optional[float] = None,
                   cu_seqlens: Optional[ArrayLike] = None) -> Array:
    """``pyattn.moba_attention`` on jax arrays."""
    return _call("moba_attention", locals())


def nsa_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, g_cmp: ArrayLike, g_slc: ArrayLike,
                  g_swa: ArrayLike, *, block_size: int = 64, block_count: int = 16, window: int = 512,
                  k_cmp: Optional[ArrayLike] = None, v_cmp: Optional[ArrayLike] = None,
                  scale: Optional[float] = None, cu_seqlens: Optional[ArrayLike] = None) -> Array:
    """``pyattn.nsa_attention`` on jax arrays."""
    return _call("nsa_attention", locals())


def dsa_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, index_q: ArrayLike, index_k: ArrayLike,
                  index_w: ArrayLike, *, top_k: int, causal: bool = True, scale: Optional[float] = None,
                  cu_seqlens: Optional[ArrayLike] = None) -> Array:
    """``pyattn.dsa_attention`` on jax arrays (the index arrays' gradients are 0)."""
    return _call("dsa_attention", locals())


def dsa_index_scores(index_q: ArrayLike, index_k: ArrayLike, index_w: ArrayLike) -> Array:
    """``pyattn.dsa_index_scores`` on jax arrays."""
    return _call("dsa_index_scores", locals())


def linformer_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, E: ArrayLike, F: ArrayLike, *,
                        scale: Optional[float] = None) -> Array:
    """``pyattn.linformer_attention`` on jax arrays."""
    return _call("linformer_attention", locals())


def mla_attention(q_nope: ArrayLike, q_rope: ArrayLike, c_kv: ArrayLike, k_rope: ArrayLike,
                  w_uk: ArrayLike, w_uv: ArrayLike, *, causal: bool = True, scale: Optional[float] = None,
                  form: Literal["naive", "absorbed"] = "naive") -> Array:
    """``pyattn.mla_attention`` on jax arrays."""
    return _call("mla_attention", locals())


def merge_attention_states(os: Sequence[ArrayLike], lses: Sequence[ArrayLike]) -> Tuple[Array, Array]:
    """``pyattn.merge_attention_states`` on jax arrays: (o, lse); the gradients of os and lses
    are lists, one entry per part."""
    return _call("merge_attention_states", locals())


def rope(x: ArrayLike, positions: ArrayLike, theta: float = 10000.0) -> Array:
    """``pyattn.rope`` on jax arrays (positions an integer array: no gradient)."""
    return _call("rope", locals())


def feature_map(x: ArrayLike, kind: Kind, **params: Any) -> Array:
    """``pyattn.feature_map`` on jax arrays (performer's ``projection`` gets a gradient)."""
    return _call("feature_map", {"x": x, "kind": kind, **params})


def linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, feature_map: Optional[Kind] = None,
                     feature_map_params: Optional[Dict[str, Any]] = None, normalize: bool = False,
                     eps: float = 1e-6, scale: Optional[float] = None, initial_state: Optional[ArrayLike] = None,
                     output_final_state: bool = False, cu_seqlens: Optional[ArrayLike] = None,
                     form: _Form = "chunk", chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.linear_attention`` on jax arrays: (o, final_state or None); an array in
    feature_map_params (performer's projection) is an operand with a gradient."""
    return _call("linear_attention", locals())


def retention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, gamma: Optional[ArrayLike] = None,
              scale: Optional[float] = None, initial_state: Optional[ArrayLike] = None,
              output_final_state: bool = False, cu_seqlens: Optional[ArrayLike] = None,
              form: _Form = "chunk", chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.retention`` on jax arrays: (o, final_state or None)."""
    return _call("retention", locals())


def lightning_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, slopes: Optional[ArrayLike] = None,
                        scale: Optional[float] = None, initial_state: Optional[ArrayLike] = None,
                        output_final_state: bool = False, cu_seqlens: Optional[ArrayLike] = None,
                        form: _Form = "chunk", chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.lightning_attention`` on jax arrays: (o, final_state or None)."""
    return _call("lightning_attention", locals())


def simple_gla(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike, *, scale: Optional[float] = None,
               initial_state: Optional[ArrayLike] = None, output_final_state: bool = False,
               cu_seqlens: Optional[ArrayLike] = None, form: _Form = "chunk",
               chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.simple_gla`` on jax arrays: (o, final_state or None)."""
    return _call("simple_gla", locals())


def gla(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike, *, gv: Optional[ArrayLike] = None,
        scale: Optional[float] = None, initial_state: Optional[ArrayLike] = None,
        output_final_state: bool = False, cu_seqlens: Optional[ArrayLike] = None, form: _Form = "chunk",
        chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.gla`` on jax arrays: (o, final_state or None)."""
    return _call("gla", locals())


def mamba2(x: ArrayLike, dt: ArrayLike, A: ArrayLike, B: ArrayLike, C: ArrayLike, *,
           D: Optional[ArrayLike] = None, dt_bias: Optional[ArrayLike] = None, dt_softplus: bool = True,
           initial_state: Optional[ArrayLike] = None, output_final_state: bool = False,
           cu_seqlens: Optional[ArrayLike] = None, form: _Form = "chunk",
           chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.mamba2`` on jax arrays: (y, final_state or None)."""
    return _call("mamba2", locals())


def delta_rule(q: ArrayLike, k: ArrayLike, v: ArrayLike, beta: ArrayLike, *, qk_l2norm: bool = False,
               scale: Optional[float] = None, initial_state: Optional[ArrayLike] = None,
               output_final_state: bool = False, cu_seqlens: Optional[ArrayLike] = None,
               form: _Form = "chunk", chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.delta_rule`` on jax arrays: (o, final_state or None)."""
    return _call("delta_rule", locals())


def gated_delta_rule(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike, beta: ArrayLike, *,
                     qk_l2norm: bool = False, scale: Optional[float] = None,
                     initial_state: Optional[ArrayLike] = None, output_final_state: bool = False,
                     cu_seqlens: Optional[ArrayLike] = None, form: _Form = "chunk",
                     chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.gated_delta_rule`` on jax arrays: (o, final_state or None)."""
    return _call("gated_delta_rule", locals())


def gated_delta_product(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: Optional[ArrayLike], beta: ArrayLike, *,
                        num_householder: int, qk_l2norm: bool = False, scale: Optional[float] = None,
                        initial_state: Optional[ArrayLike] = None, output_final_state: bool = False,
                        cu_seqlens: Optional[ArrayLike] = None, form: _Form = "chunk",
                        chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.gated_delta_product`` on jax arrays: (o, final_state or None)."""
    return _call("gated_delta_product", locals())


def rwkv6(r: ArrayLike, k: ArrayLike, v: ArrayLike, w: ArrayLike, u: ArrayLike, *,
          scale: Optional[float] = None, initial_state: Optional[ArrayLike] = None,
          output_final_state: bool = False, cu_seqlens: Optional[ArrayLike] = None, form: _Form = "chunk",
          chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.rwkv6`` on jax arrays: (o, final_state or None)."""
    return _call("rwkv6", locals())


def dplr_delta_rule(q: ArrayLike, k: ArrayLike, v: ArrayLike, a: ArrayLike, b: ArrayLike, gk: ArrayLike, *,
                    scale: Optional[float] = None, initial_state: Optional[ArrayLike] = None,
                    output_final_state: bool = False, cu_seqlens: Optional[ArrayLike] = None,
                    form: Literal["chunk", "recurrent"] = "chunk", chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.dplr_delta_rule`` on jax arrays: (o, final_state or None)."""
    return _call("dplr_delta_rule", locals())


def rwkv7(r: ArrayLike, w: ArrayLike, k: ArrayLike, v: ArrayLike, a: ArrayLike, b: ArrayLike, *,
          scale: Optional[float] = 1.0, initial_state: Optional[ArrayLike] = None,
          output_final_state: bool = False, cu_seqlens: Optional[ArrayLike] = None,
          form: Literal["chunk", "recurrent"] = "chunk", chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.rwkv7`` on jax arrays: (o, final_state or None)."""
    return _call("rwkv7", locals())


def kda(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike, beta: ArrayLike, *, qk_l2norm: bool = False,
        scale: Optional[float] = None, initial_state: Optional[ArrayLike] = None,
        output_final_state: bool = False, cu_seqlens: Optional[ArrayLike] = None, form: _Form = "chunk",
        chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.kda`` on jax arrays: (o, final_state or None)."""
    return _call("kda", locals())


def log_linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike, level_scales: ArrayLike, *,
                         scale: Optional[float] = None, initial_state: Optional[ArrayLike] = None,
                         output_final_state: bool = False, cu_seqlens: Optional[ArrayLike] = None,
                         form: Literal["chunk", "recurrent", "parallel"] = "chunk", chunk_size: _ChunkSize = 64) -> _WithState:
    """``pyattn.log_linear_attention`` on jax arrays: (o, final_state or None)."""
    return _call("log_linear_attention", locals())


def efficient_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: Optional[float] = None,
                        cu_seqlens: Optional[ArrayLike] = None, form: Literal["parallel"] = "parallel") -> Array:
    """``pyattn.efficient_attention`` on jax arrays."""
    return _call("efficient_attention", locals())

"""pyattn's ops on CPU torch tensors, differentiable by autograd, traceable by torch.compile.

    import torch, pyattn.torch as pt
    q = torch.randn(2, 128, 4, 64, requires_grad=True)
    o = pt.softmax_attention(q, q, q, causal=True)
    o.sum().backward()                      # pyattn's C backward

Every op of ``pyattn.OPS`` has a function here of the same name, arguments and defaults,
taking and returning ``torch.Tensor``s where pyattn takes and returns arrays. Each is the
custom op ``torch.ops.pyattn.<name>`` (``torch.library.custom_op``) with a fake kernel
(shapes without computing) and, for the differentiable ones (all but ``dsa_select`` and
``dsa_index_target``), an autograd formula whose backward is the custom op
``torch.ops.pyattn.<name>_backward``, pyattn's C backward; so ``torch.library.opcheck``
passes and ``torch.compile(fullgraph=True)`` traces a model calling them without a graph
break. ``pyattn.testing.gradcheck``'s finite differences and ``torch.autograd.gradcheck`` agree
with it in float64.

- Tensors must be on the CPU (a CUDA tensor is a TypeError). Contiguous float32 and float64
  tensors reach the kernels without a copy (NumPy views of their memory) and the results come
  back in their dtype; others are made contiguous first. bfloat16 tensors reach pyattn as
  NumPy bfloat16 arrays viewing their memory (needs ml_dtypes, ``pyattn[bf16]``): pyattn's
  bf16 call, stored bf16 and computed in float32. float16 tensors (and bfloat16 without
  ml_dtypes) are computed in float32. Results and gradients come back in the inputs' dtype.
- Python scalars and lists where pyattn takes them (``gamma=0.9``, ``cu_seqlens=[0, 5, 9]``)
  are accepted, as tensors of the call's dtype (integers: int64).
- The backward of the softmax family reuses the forward's output and log-sum-exp; the other
  ops run their forward again inside the backward (pyattn.vjp) and then their C backward.
- ``attention_with_kvcache`` writes the new keys and values into ``k_cache`` and
  ``v_cache`` in place through ``torch.ops.pyattn.kvcache_append`` (its ``mutates_args``),
  after checking the whole call, then attends through the functional
  ``torch.ops.pyattn.attention_with_kvcache``, differentiable in q, k, v and the cache rows
  read (rows that the new keys overwrote get no gradient).

Needs torch (``pip install pyattn[torch]``); ``import pyattn`` never imports it.
"""
from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (the error below names the extra)
except ImportError as e:  # pragma: no cover - exercised where torch is absent
    raise ImportError("pyattn.torch needs torch: pip install 'pyattn[torch]' (torch's CPU wheel is "
                      "enough)") from e

import inspect as _inspect

import pyattn as _pyattn

from . import _bridge

_OPS: "dict[str, _bridge.Op]" = {}


def _public(name: str, op: "_bridge.Op"):
    """A function with pyattn's signature for ``name`` calling ``op``: generated source, so
    torch.compile traces plain positional code (no signature binding at run time)."""
    fn = _pyattn.OPS[name].fn
    sig = _inspect.signature(fn)
    # a feature map's parameters (a dict, or **params) travel as schema arguments of their own
    parts = [f"*_bridge.spread_map_params({name!r}, {p.name})" if p.name in ("feature_map_params", "params")
             else p.name for p in sig.parameters.values()]
    src = (f"def {name}{sig}:\n"
           f"    return _OPS[{name!r}](({', '.join(parts)},))\n")
    scope = {"_OPS": _OPS, "_bridge": _bridge}
    exec(compile(src, f"<pyattn.torch.{name}>", "exec"), scope)
    public = scope[name]
    public.__doc__ = (f"pyattn.{name} on CPU torch tensors, differentiable by autograd (the custom op "
                      f"torch.ops.pyattn.{name}).\n\n" + (fn.__doc__ or ""))
    public.__module__ = __name__
    return public


def _build():
    made = {}
    for name, info in _pyattn.OPS.items():
        if not info.differentiable:
            op = _bridge.Op(name, info.fn, differentiable=False)
        elif name == "attention_with_kvcache":
            op = _bridge.KVCacheOp(info.fn)
        elif name == "softmax_attention":
            op = _bridge.Op(name, info.fn, vjp_fn=_bridge.softmax_vjp, forced={"return_lse": True})
        else:
            op = _bridge.Op(name, info.fn)
        _OPS[name] = op
        made[name] = _public(name, op)
    return made


globals().update(_build())
__all__ = sorted(_OPS)

"""fla's (flash-linear-attention's) entry points on the CPU, computed by pyattn.

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule      # CUDA, Triton
    from pyattn.torch.fla import chunk_gated_delta_rule               # CPU, pyattn

Every function here has the name, the arguments (names, order, defaults), the layouts
(``[B, T, H, D]``, states ``[N, H, K, V]``, ``cu_seqlens`` a LongTensor with B = 1) and the
return convention of the fla function it replaces (``fla.ops.<family>``), and runs the pyattn
op of the same mathematics through ``pyattn.torch``: differentiable by autograd, on CPU
tensors. ``chunk_*`` and ``fused_chunk_*`` use pyattn's ``"chunk"`` form, ``fused_recurrent_*``
its ``"recurrent"`` form, ``parallel_*`` its ``"parallel"`` form.

- dtypes: the inputs are brought to one dtype, float64 if any is float64, else float32
  (fla mixes bfloat16 q/k/v with float32 gates and states); ``o`` comes back in q's dtype
  (v's or x's where fla's kernel gives it those: fused_recurrent_gdn2,
  fused_mul_recurrent_rwkv7, HGRN), ``final_state`` in that float32/float64 compute dtype
  (fla returns float32 states; HGRN's in x's dtype, as fla's).
- Flags pyattn computes exactly by rearranging the inputs are implemented that way:
  ``head_first=True`` (inputs ``[B, H, T, ...]``, transposed), ``reverse=True`` (time flipped
  per sequence), ``state_v_first=True`` (states ``[N, H, V, K]``, transposed), fla's
  in-kernel beta sigmoid and GDN gate (computed in torch first), GVA of the gated delta rule
  (v with more heads than q and k: q and k repeated per group), ``sink_bias`` of
  ``parallel_attn`` (``o * sigmoid(lse - sink_bias)``; with the forgetting gate ``g`` too, one
  more key dimension carries ``-G``); ``output_attentions`` of the parallel forms is fla's
  score matrix, computed in torch beside pyattn's op.
- A flag pyattn does not compute raises ``NotImplementedError`` naming it; none is ignored.
  ``cu_seqlens_cpu`` and ``chunk_indices`` are accepted and unused: fla's precomputed copies
  of what pyattn derives from ``cu_seqlens``.
"""
from __future__ import annotations

import warnings
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

import pyattn.torch as _pt
from pyattn import delta as _delta_np
from pyattn import dplr as _dplr_np

__all__ = [
    "chunk_simple_gla", "fused_chunk_simple_gla", "fused_recurrent_simple_gla", "parallel_simple_gla",
    "chunk_gla", "fused_recurrent_gla",
    "chunk_hgrn", "fused_recurrent_hgrn",
    "chunk_retention", "fused_chunk_retention", "fused_recurrent_retention", "parallel_retention",
    "chunk_linear_attn", "fused_chunk_linear_attn", "fused_recurrent_linear_attn",
    "chunk_lightning_attn", "fused_recurrent_lightning_attn",
    "parallel_based", "fused_chunk_based",
    "chunk_rwkv6", "fused_recurrent_rwkv6",
    "chunk_delta_rule", "fused_recurrent_delta_rule",
    "chunk_gated_delta_rule", "chunk_gdn", "fused_recurrent_gated_delta_rule", "fused_recurrent_gdn",
    "chunk_gated_delta_product", "chunk_kda", "fused_recurrent_kda",
    "chunk_dplr_delta_rule", "chunk_rwkv7", "fused_recurrent_dplr_delta_rule", "fused_recurrent_rwkv7",
    "fused_mul_recurrent_rwkv7", "chunk_gdn2", "fused_recurrent_gdn2", "chunk_log_linear_attn",
    "parallel_attn", "parallel_forgetting_attn", "parallel_nsa", "parallel_moba",
]

State = Optional[Tensor]


def _unsupported(fn: str, flag: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"pyattn.torch.fla.{fn}(): {flag} is not supported: {why}")


def _compute_dtype(*tensors) -> torch.dtype:
    floats = [t.dtype for t in tensors if isinstance(t, Tensor) and t.is_floating_point()]
    return torch.float64 if torch.float64 in floats else torch.float32


def _time_major(x, head_first: bool):
    """fla's old head-first layout [B, H, T, ...] as [B, T, H, ...]."""
    return x.transpose(1, 2) if head_first and x is not None else x


def _cu(cu_seqlens):
    return None if cu_seqlens is None else torch.as_tensor(cu_seqlens).to(torch.long)


def _reversal(T: int, cu: Optional[Tensor]) -> Tensor:
    """The time index that runs every sequence backwards (its own inverse)."""
    t = torch.arange(T)
    if cu is None:
        return t.flip(0)
    seq = torch.searchsorted(cu, t, right=True) - 1
    return cu[seq] + cu[seq + 1] - 1 - t


def _flip(x, order: Optional[Tensor]):
    return x if x is None or order is None else x.index_select(1, order)


def _state_in(h0, state_v_first: bool, dtype):
    """fla's initial state ([N, H, K, V], or [N, H, V, K] with state_v_first) as pyattn's."""
    if h0 is None:
        return None
    return (h0.transpose(-1, -2) if state_v_first else h0).to(dtype)


def _state_out(ht, state_v_first: bool):
    return ht.transpose(-1, -2) if state_v_first and ht is not None else ht


def _v_first(fn: str, state_v_first: bool, transpose_state_layout: Optional[bool]) -> bool:
    """fla's deprecated name of state_v_first, taken as fla takes it."""
    if transpose_state_layout is None:
        return state_v_first
    if state_v_first:
        raise ValueError(f"pyattn.torch.fla.{fn}(): cannot pass both `state_v_first` and the deprecated "
                         f"`transpose_state_layout`")
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                  stacklevel=3)
    return transpose_state_layout


def _chunk(chunk_size) -> int:
    return 64 if chunk_size is None else chunk_size


def _check_cu_batch(fn: str, q: Tensor, cu) -> None:
    if cu is not None and q.shape[0] != 1:
        raise ValueError(f"pyattn.torch.fla.{fn}(): the batch size is expected to be 1 rather than {q.shape[0]} "
                         f"when using `cu_seqlens`; flatten variable-length inputs first")


def _refuse_kwargs(fn: str, kwargs: dict) -> None:
    """What is left of an fla entry point's **kwargs once it took its own: head_first raises
    DeprecationWarning as in fla, anything else TypeError rather than being ignored."""
    if "head_first" in kwargs:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    if kwargs:
        raise TypeError(f"pyattn.torch.fla.{fn}(): unexpected keyword arguments {sorted(kwargs)}")


def _gva(fn: str, q: Tensor, k: Tensor, HV: int) -> Tuple[Tensor, Tensor]:
    """q and k repeated for v's HV heads (GVA: value head hv reads query/key head hv // (HV // H))."""
    H = q.shape[2]
    if HV == H:
        return q, k
    if HV % H:
        raise ValueError(f"pyattn.torch.fla.{fn}(): v has HV={HV} heads; it must be a multiple of q's H={H}")
    return q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)


def _run(op, q, k, v, *, gates=(), scale, initial_state, output_final_state, cu_seqlens, form, chunk_size,
         reverse=False, state_v_first=False, head_first=False, options=None, out_dtype=None) -> Tuple[Tensor, State]:
    """One pyattn.torch op of the gated linear / delta engines in fla's conventions.

    ``gates`` are (name, tensor) pairs passed by name (None ones left out), all [B, T, H, ...]
    like q. Returns (o in out_dtype, q's by default, and fla's layout, final state in fla's
    layout or None)."""
    out_dtype = q.dtype if out_dtype is None else out_dtype
    q, k, v = (_time_major(x, head_first) for x in (q, k, v))
    gates = [(n, _time_major(g, head_first)) for n, g in gates if g is not None]
    dtype = _compute_dtype(q, k, v, initial_state, *(g for _, g in gates))
    cu = _cu(cu_seqlens)
    order = _reversal(q.shape[1], cu) if reverse else None
    q, k, v = (_flip(x.to(dtype), order) for x in (q, k, v))
    kwargs = {n: _flip(g.to(dtype), order) for n, g in gates}
    o, ht = op(q, k, v, **kwargs, scale=scale, initial_state=_state_in(initial_state, state_v_first, dtype),
               output_final_state=output_final_state, cu_seqlens=cu, form=form, chunk_size=_chunk(chunk_size),
               **(options or {}))
    o = _time_major(_flip(o, order), head_first).to(out_dtype)
    return o, _state_out(ht, state_v_first)


# ------------------------------------------------------------------------------------------
# simple GLA, GLA, retention, lightning attention: the gated linear engine


def _simple_gla(fn, q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, form,
                chunk_size=64, reverse=False, state_v_first=False, head_first=False):
    _check_cu_batch(fn, _time_major(q, head_first), cu_seqlens)
    if g is None and g_gamma is None:
        return _run(_pt.linear_attention, q, k, v, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens, form=form, chunk_size=chunk_size,
                    reverse=reverse, state_v_first=state_v_first, head_first=head_first)
    if g_gamma is not None:
        # fla applies both decays when both are given: their logs add
        H = _time_major(q, head_first).shape[2]
        gamma = g_gamma.reshape((1, H, 1) if head_first else (1, 1, H)).expand(q.shape[:3])
        g = gamma if g is None else g + gamma.to(g.dtype)
    return _run(_pt.simple_gla, q, k, v, gates=[("g", g)], scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, form=form, chunk_size=chunk_size,
                reverse=reverse, state_v_first=state_v_first, head_first=head_first)


def chunk_simple_gla(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, g_gamma: Optional[Tensor] = None,
                     scale: Optional[float] = None, initial_state: State = None, output_final_state: bool = False,
                     state_v_first: bool = False, cu_seqlens: Optional[torch.LongTensor] = None,
                     cu_seqlens_cpu: Optional[torch.LongTensor] = None, *, chunk_size: Optional[int] = None,
                     head_first: bool = False) -> Tuple[Tensor, State]:
    """fla.ops.simple_gla.chunk_simple_gla: ``pyattn.torch.simple_gla(form="chunk")``.

    g ``[B, T, H]`` a log decay per step, g_gamma ``[H]`` a constant log decay per head (both
    given: both apply); neither: no decay (``linear_attention``). Returns ``(o, final_state)``."""
    return _simple_gla("chunk_simple_gla", q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                       cu_seqlens, "chunk", chunk_size, state_v_first=state_v_first, head_first=head_first)


def fused_chunk_simple_gla(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
                           g_gamma: Optional[Tensor] = None, scale: Optional[float] = None,
                           initial_state: State = None, output_final_state: bool = False,
                           cu_seqlens: Optional[torch.LongTensor] = None, *,
                           head_first: bool = False) -> Tuple[Tensor, State]:
    """fla.ops.simple_gla.fused_chunk_simple_gla: as ``chunk_simple_gla``."""
    return _simple_gla("fused_chunk_simple_gla", q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                       cu_seqlens, "chunk", head_first=head_first)


def fused_recurrent_simple_gla(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
                               g_gamma: Optional[Tensor] = None, scale: Optional[float] = None,
                               initial_state: State = None, output_final_state: bool = False, reverse: bool = False,
                               state_v_first: bool = False, cu_seqlens: Optional[torch.LongTensor] = None, *,
                               head_first: bool = False,
                               transpose_state_layout: Optional[bool] = None) -> Tuple[Tensor, State]:
    """fla.ops.simple_gla.fused_recurrent_simple_gla: ``pyattn.torch.simple_gla(form="recurrent")``;
    ``reverse=True`` runs every sequence backwards (the time axis flipped, exactly)."""
    state_v_first = _v_first("fused_recurrent_simple_gla", state_v_first, transpose_state_layout)
    return _simple_gla("fused_recurrent_simple_gla", q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                       cu_seqlens, "recurrent", reverse=reverse, state_v_first=state_v_first, head_first=head_first)


def _attentions(fn, q, k, g, scale, cu_seqlens, head_first) -> Tensor:
    """fla's ``output_attentions``: the decayed causal scores ``scale q_i.k_j exp(G_i - G_j)``,
    ``G`` the running sum of g, as ``[B, H, T, T]`` in q's dtype."""
    if cu_seqlens is not None:
        raise ValueError(f"pyattn.torch.fla.{fn}(): output_attentions=True is not supported with "
                         f"variable-length sequences (as in fla)")
    q, k, g = (_time_major(x, head_first) for x in (q, k, g))
    dtype = _compute_dtype(q, k, g)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    a = torch.einsum("bihd,bjhd->bhij", q.to(dtype) * scale, k.to(dtype))
    if g is not None:
        G = g.to(dtype).cumsum(1).transpose(1, 2)
        # the upper triangle is masked below: exp(0) there keeps it finite
        a = a * torch.exp((G.unsqueeze(-1) - G.unsqueeze(-2)).tril())
    return a.tril().to(q.dtype)


def parallel_simple_gla(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, scale: Optional[float] = None,
                        output_attentions: bool = False, cu_seqlens: Optional[torch.LongTensor] = None,
                        cu_seqlens_cpu: Optional[torch.LongTensor] = None, *,
                        head_first: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """fla.ops.simple_gla.parallel_simple_gla: ``pyattn.torch.simple_gla(form="parallel")``.
    Returns ``(o, attn)``, attn the decayed score matrix ``[B, H, T, T]`` with
    ``output_attentions=True`` (computed in torch beside pyattn's op), else None."""
    o, _ = _simple_gla("parallel_simple_gla", q, k, v, g, None, scale, None, False, cu_seqlens, "parallel",
                       head_first=head_first)
    if not output_attentions:
        return o, None
    return o, _attentions("parallel_simple_gla", q, k, g, scale, cu_seqlens, head_first)


def chunk_gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: Optional[float] = None, initial_state: State = None,
              output_final_state: bool = False, state_v_first: bool = False,
              cu_seqlens: Optional[torch.LongTensor] = None, cu_seqlens_cpu: Optional[torch.LongTensor] = None, *,
              head_first: bool = False) -> Tuple[Tensor, State]:
    """fla.ops.gla.chunk_gla: ``pyattn.torch.gla(form="chunk")``, g ``[B, T, H, K]`` the log
    decay per key channel."""
    _check_cu_batch("chunk_gla", _time_major(q, head_first), cu_seqlens)
    return _run(_pt.gla, q, k, v, gates=[("g", g)], scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, form="chunk", chunk_size=64,
                state_v_first=state_v_first, head_first=head_first)


def fused_recurrent_gla(q: Tensor, k: Tensor, v: Tensor, gk: Optional[Tensor] = None, gv: Optional[Tensor] = None,
                        scale: Optional[float] = None, initial_state: State = None, output_final_state: bool = False,
                        reverse: bool = False, state_v_first: bool = False,
                        cu_seqlens: Optional[torch.LongTensor] = None, *,
                        head_first: bool = False,
                        transpose_state_layout: Optional[bool] = None) -> Tuple[Tensor, State]:
    """fla.ops.gla.fused_recurrent_gla: ``pyattn.torch.gla(form="recurrent")`` with the key
    gate gk ``[B, T, H, K]`` and the value gate gv ``[B, T, H, V]`` (either may be None);
    ``reverse=True`` runs every sequence backwards."""
    state_v_first = _v_first("fused_recurrent_gla", state_v_first, transpose_state_layout)
    _check_cu_batch("fused_recurrent_gla", _time_major(q, head_first), cu_seqlens)
    common = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, form="recurrent", chunk_size=64, reverse=reverse,
                  state_v_first=state_v_first, head_first=head_first)
    if gv is None:
        if gk is None:
            return _run(_pt.linear_attention, q, k, v, **common)
    elif gk is None:
        gk = torch.zeros(q.shape, dtype=gv.dtype)
    return _run(_pt.gla, q, k, v, gates=[("g", gk), ("gv", gv)], **common)


def chunk_retention(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None, initial_state: State = None,
                    output_final_state: bool = False, cu_seqlens: Optional[torch.LongTensor] = None, *,
                    chunk_size: Optional[int] = None, head_first: bool = False) -> Tuple[Tensor, State]:
    """fla.ops.retention.chunk_retention: ``pyattn.torch.retention(form="chunk")`` with RetNet's
    decays ``gamma_h = 1 - 2**(-5 - h)``, as fla."""
    _check_cu_batch("chunk_retention", _time_major(q, head_first), cu_seqlens)
    return _run(_pt.retention, q, k, v, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, form="chunk", chunk_size=chunk_size,
                head_first=head_first)


def fused_chunk_retention(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
                          initial_state: State = None, output_final_state: bool = False,
                          cu_seqlens: Optional[torch.LongTensor] = None, *,
                          head_first: bool = False) -> Tuple[Tensor, State]:
    """fla.ops.retention.fused_chunk_retention: as ``chunk_retention``."""
    _check_cu_batch("fused_chunk_retention", _time_major(q, head_first), cu_seqlens)
    return _run(_pt.retention, q, k, v, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, form="chunk", chunk_size=64,
                head_first=head_first)


def fused_recurrent_retention(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
                              initial_state: State = None, output_final_state: bool = False, reverse: bool = False,
                              state_v_first: bool = False, cu_seqlens: Optional[torch.LongTensor] = None, *,
                              head_first: bool = False,
                              transpose_state_layout: Optional[bool] = None) -> Tuple[Tensor, State]:
    """fla.ops.retention.fused_recurrent_retention: ``pyattn.torch.retention(form="recurrent")``."""
    state_v_first = _v_first("fused_recurrent_retention", state_v_first, transpose_state_layout)
    _check_cu_batch("fused_recurrent_retention", _time_major(q, head_first), cu_seqlens)
    return _run(_pt.retention, q, k, v, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, form="recurrent", chunk_size=64,
                reverse=reverse, state_v_first=state_v_first, head_first=head_first)


def parallel_retention(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
                       output_attentions: bool = False, cu_seqlens: Optional[torch.LongTensor] = None, *,
                       head_first: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """fla.ops.retention.parallel_retention: ``pyattn.torch.retention(form="parallel")``.
    Returns ``(o, attn)`` as ``parallel_simple_gla`` with RetNet's decays."""
    _check_cu_batch("parallel_retention", _time_major(q, head_first), cu_seqlens)
    o, _ = _run(_pt.retention, q, k, v, scale=scale, initial_state=None, output_final_state=False,
                cu_seqlens=cu_seqlens, form="parallel", chunk_size=64, head_first=head_first)
    if not output_attentions:
        return o, None
    B, T, H = _time_major(q, head_first).shape[:3]
    g = torch.log1p(-torch.pow(2.0, -5.0 - torch.arange(H, dtype=torch.float64))).expand(B, T, H)
    return o, _attentions("parallel_retention", q, k, g.transpose(1, 2) if head_first else g, scale, cu_seqlens,
                          head_first)


def _lightning_slopes(H: int, layer_idx: int, num_layers: int) -> Tensor:
    # fla's decay: log gamma_h = -(8 / H) (1 - layer_idx / num_layers) h, head 0 undecayed
    return (8 / H * (1 - layer_idx / num_layers)) * torch.arange(H, dtype=torch.float64)


def chunk_lightning_attn(q: Tensor, k: Tensor, v: Tensor, layer_idx: int, num_layers: int,
                         scale: Optional[float] = None, initial_state: State = None, output_final_state: bool = False,
                         cu_seqlens: Optional[torch.LongTensor] = None, *, chunk_size: Optional[int] = None,
                         head_first: bool = False) -> Tuple[Tensor, State]:
    """fla.ops.lightning_attn.chunk_lightning_attn: ``pyattn.torch.lightning_attention(form="chunk")``
    with fla's per-layer slopes ``(8 / H) (1 - layer_idx / num_layers) h``."""
    _check_cu_batch("chunk_lightning_attn", _time_major(q, head_first), cu_seqlens)
    H = _time_major(q, head_first).shape[2]
    slopes = _lightning_slopes(H, layer_idx, num_layers).to(_compute_dtype(q, k, v, initial_state))
    return _run(_pt.lightning_attention, q, k, v, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, form="chunk", chunk_size=chunk_size,
                head_first=head_first, options={"slopes": slopes})


def fused_recurrent_lightning_attn(q: Tensor, k: Tensor, v: Tensor, layer_idx: int, num_layers: int,
                                   scale: Optional[float] = None, initial_state: State = None,
                                   output_final_state: bool = False, reverse: bool = False,
                                   cu_seqlens: Optional[torch.LongTensor] = None, *,
                                   head_first: bool = False) -> Tuple[Tensor, State]:
    """fla.ops.lightning_attn.fused_recurrent_lightning_attn:
    ``pyattn.torch.lightning_attention(form="recurrent")``, fla's slopes."""
    _check_cu_batch("fused_recurrent_lightning_attn", _time_major(q, head_first), cu_seqlens)
    H = _time_major(q, head_first).shape[2]
    slopes = _lightning_slopes(H, layer_idx, num_layers).to(_compute_dtype(q, k, v, initial_state))
    return _run(_pt.lightning_attention, q, k, v, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, form="recurrent", chunk_size=64,
                reverse=reverse, head_first=head_first, options={"slopes": slopes})


# ------------------------------------------------------------------------------------------
# linear attention and Based


def _linear_attn(fn, q, k, v, scale, initial_state, output_final_state, normalize, cu_seqlens, form,
                 reverse=False, head_first=False):
    _check_cu_batch(fn, _time_major(q, head_first), cu_seqlens)
    if not normalize:
        return _run(_pt.linear_attention, q, k, v, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens, form=form, chunk_size=64,
                    reverse=reverse, head_first=head_first)
    # fla's normalized state is (S [N, H, K, V], z [N, 1, H, K]); pyattn's is S with z as an
    # extra last column [N, H, K, V + 1]
    kv0, z0 = initial_state if isinstance(initial_state, tuple) else (initial_state, None)
    h0 = None
    if kv0 is not None or z0 is not None:
        N, H, K, V = _state_shape(q, v, cu_seqlens, head_first)
        ref = kv0 if kv0 is not None else z0
        dtype = _compute_dtype(q, k, v, kv0, z0)
        kv0 = ref.new_zeros((N, H, K, V), dtype=dtype) if kv0 is None else kv0.to(dtype)
        z0 = ref.new_zeros((N, H, K, 1), dtype=dtype) if z0 is None else z0[:, 0].unsqueeze(-1).to(dtype)
        h0 = torch.cat([kv0, z0], dim=-1)
    o, ht = _run(_pt.linear_attention, q, k, v, scale=scale, initial_state=h0, output_final_state=True,
                 cu_seqlens=cu_seqlens, form=form, chunk_size=64, reverse=reverse, head_first=head_first,
                 options={"normalize": True, "eps": 1e-10})
    z = ht[..., -1].unsqueeze(1).to(k.dtype)
    return o, (ht[..., :-1] if output_final_state else None, z)


def _state_shape(q, v, cu_seqlens, head_first):
    q, v = _time_major(q, head_first), _time_major(v, head_first)
    N = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    return N, q.shape[2], q.shape[3], v.shape[3]


_LinearState = Union[Tensor, Tuple[Optional[Tensor], Tensor], None]


def chunk_linear_attn(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
                      initial_state: _LinearState = None, output_final_state: bool = False, normalize: bool = True,
                      cu_seqlens: Optional[torch.LongTensor] = None, *,
                      head_first: bool = False) -> Tuple[Tensor, _LinearState]:
    """fla.ops.linear_attn.chunk_linear_attn: ``pyattn.torch.linear_attention(form="chunk")``.

    ``normalize=True`` (fla's default here) divides by ``(scale q_t) . z_t + 1e-10``, ``z_t``
    the running sum of keys, and returns ``(o, (final_state or None, z_state [N, 1, H, K]))``;
    ``initial_state`` may then be fla's tuple ``(S, z)``."""
    return _linear_attn("chunk_linear_attn", q, k, v, scale, initial_state, output_final_state, normalize,
                        cu_seqlens, "chunk", head_first=head_first)


def fused_chunk_linear_attn(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
                            initial_state: _LinearState = None, output_final_state: bool = False,
                            normalize: bool = True, cu_seqlens: Optional[torch.LongTensor] = None, *,
                            head_first: bool = False) -> Tuple[Tensor, _LinearState]:
    """fla.ops.linear_attn.fused_chunk_linear_attn: as ``chunk_linear_attn``."""
    return _linear_attn("fused_chunk_linear_attn", q, k, v, scale, initial_state, output_final_state, normalize,
                        cu_seqlens, "chunk", head_first=head_first)


def fused_recurrent_linear_attn(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
                                initial_state: _LinearState = None, output_final_state: bool = False,
                                reverse: bool = False, normalize: bool = False,
                                cu_seqlens: Optional[torch.LongTensor] = None, *,
                                head_first: bool = False) -> Tuple[Tensor, _LinearState]:
    """fla.ops.linear_attn.fused_recurrent_linear_attn: ``pyattn.torch.linear_attention(form="recurrent")``
    (``normalize=False`` by default here, as fla)."""
    return _linear_attn("fused_recurrent_linear_attn", q, k, v, scale, initial_state, output_final_state, normalize,
                        cu_seqlens, "recurrent", reverse=reverse, head_first=head_first)


def _based(q, k, v, scale, use_norm, form, head_first):
    # Based's kernel 1 + s + s^2 / 2 of s = scale q.k is the taylor feature map's
    # phi(q').phi(k) with q' = scale q and no further scale
    out_dtype = q.dtype
    q, k, v = (_time_major(x, head_first) for x in (q, k, v))
    dtype = _compute_dtype(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, _ = _pt.linear_attention((q.to(dtype) * scale), k.to(dtype), v.to(dtype), feature_map="taylor",
                                normalize=use_norm, eps=1e-6, scale=1.0, form=form)
    return _time_major(o, head_first).to(out_dtype)


def parallel_based(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None, use_norm: bool = True, *,
                   head_first: bool = False) -> Tensor:
    """fla.ops.based.parallel_based: causal ``o_i = sum_j (1 + s_ij + s_ij^2 / 2) v_j`` with
    ``s_ij = scale q_i.k_j``, divided by ``sum_j (...) + 1e-6`` with ``use_norm``:
    ``pyattn.torch.linear_attention(feature_map="taylor", form="parallel")``. Returns ``o``."""
    return _based(q, k, v, scale, use_norm, "parallel", head_first)


def fused_chunk_based(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None, use_norm: bool = True, *,
                      head_first: bool = False) -> Tensor:
    """fla.ops.based.fused_chunk_based: as ``parallel_based``, pyattn's ``"chunk"`` form."""
    return _based(q, k, v, scale, use_norm, "chunk", head_first)


# ------------------------------------------------------------------------------------------
# RWKV-6: the gated linear engine with the bonus u


def _rwkv6(fn, r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, form, reverse, kwargs):
    """fla's rwkv6 entry points take **kwargs: chunk_size is the chunk form's, the rest as
    _refuse_kwargs."""
    chunk_size = kwargs.pop("chunk_size", None) if form == "chunk" else None
    _refuse_kwargs(fn, kwargs)
    _check_cu_batch(fn, r, cu_seqlens)
    return _run(_pt.rwkv6, r, k, v, gates=[("w", w)], scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, form=form, chunk_size=chunk_size,
                reverse=reverse, options={"u": u.to(_compute_dtype(r, k, v, w, initial_state))})


def chunk_rwkv6(r: Tensor, k: Tensor, v: Tensor, w: Tensor, u: Tensor, scale: Optional[float] = None,
                initial_state: State = None, output_final_state: bool = False,
                cu_seqlens: Optional[torch.LongTensor] = None, cu_seqlens_cpu: Optional[torch.LongTensor] = None,
                **kwargs) -> Tuple[Tensor, State]:
    """fla.ops.rwkv6.chunk_rwkv6: ``pyattn.torch.rwkv6(form="chunk")``, w ``[B, T, H, K]`` the log
    decay per key channel, u ``[H, K]`` the bonus; ``chunk_size`` (a keyword) 16, 32, 64 or 128."""
    return _rwkv6("chunk_rwkv6", r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, "chunk",
                  False, kwargs)


def fused_recurrent_rwkv6(r: Tensor, k: Tensor, v: Tensor, w: Tensor, u: Tensor, scale: Optional[float] = None,
                          initial_state: State = None, output_final_state: bool = False, reverse: bool = False,
                          cu_seqlens: Optional[torch.LongTensor] = None, **kwargs) -> Tuple[Tensor, State]:
    """fla.ops.rwkv6.fused_recurrent_rwkv6: ``pyattn.torch.rwkv6(form="recurrent")``;
    ``reverse=True`` runs every sequence backwards."""
    return _rwkv6("fused_recurrent_rwkv6", r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens,
                  "recurrent", reverse, kwargs)


# ------------------------------------------------------------------------------------------
# the delta rule and the gated delta rule


def _gate_in_kernel(fn, g, A_log, dt_bias, lower_bound, dtype):
    """fla's gate computed before the kernel, differentiated: ``-exp(A_log) softplus(g +
    dt_bias)`` (GDN's per head; KDA's per key channel, dt_bias ``[HV * K]``), or with
    ``lower_bound`` KDA's ``lower_bound sigmoid(exp(A_log) (g + dt_bias))`` (A_log None: 1)."""
    if g is None or (A_log is None and lower_bound is None):
        raise ValueError(f"pyattn.torch.fla.{fn}(): `use_gate_in_kernel=True` needs `g` and `A_log`")
    g = g.to(dtype)
    if dt_bias is not None:
        g = g + dt_bias.to(dtype).reshape(g.shape[2:])
    # A_log has one entry per value head, in whatever shape fla's callers give it
    A = None if A_log is None else A_log.to(dtype).exp().reshape((-1,) + (1,) * (g.ndim - 3))
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(g if A is None else A * g)
    return -A * F.softplus(g)


def _delta(fn, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
           form, chunk_size, state_v_first=False, head_first=False, use_gate_in_kernel=False, A_log=None,
           dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, gk=None, lower_bound=None,
           intermediate=False):
    """The delta rule, the gated delta rule (g [B, T, HV]) or KDA (a gate per key channel:
    g [B, T, HV, K], or gk, with g added to every channel when both are given) in fla's
    conventions. intermediate: KDA's chunk form also returning the state entering each chunk."""
    q, k, v, g, beta, gk = (_time_major(x, head_first) for x in (q, k, v, g, beta, gk))
    _check_cu_batch(fn, q, cu_seqlens)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"pyattn.torch.fla.{fn}(): `allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`")
    HV = v.shape[2]
    if beta is None:
        beta = v.new_ones(v.shape[:3])
    if beta.ndim == v.ndim:
        raise _unsupported(fn, "beta of shape [B, T, H, V] (one beta per value channel)",
                           "pyattn's delta rule takes one beta per head and step, [B, T, H]")
    if use_gate_in_kernel:
        g = _gate_in_kernel(fn, g, A_log, dt_bias, lower_bound,
                            _compute_dtype(q, k, v, g, beta, A_log, dt_bias, initial_state))
    if gk is not None:
        g = gk if g is None else gk + g.unsqueeze(-1).to(gk.dtype)
    if use_beta_sigmoid_in_kernel:
        # in the compute dtype, as fla's kernel: a bfloat16 sigmoid would round it
        beta = torch.sigmoid(beta.to(_compute_dtype(q, k, v, beta))) * (2 if allow_neg_eigval else 1)
    q, k = _gva(fn, q, k, HV)
    if intermediate:
        return _entering_states(fn, _delta_np.kda_entering_states, (q, k, v, g, beta), scale, initial_state,
                                output_final_state, cu_seqlens, chunk_size, state_v_first, q.dtype, k.dtype,
                                qk_l2norm=use_qk_l2norm_in_kernel)
    if g is None:
        op, gates = _pt.delta_rule, [("beta", beta)]
    else:
        op, gates = (_pt.kda if g.ndim == 4 else _pt.gated_delta_rule), [("g", g), ("beta", beta)]
    o, ht = _run(op, q, k, v, gates=gates, scale=scale, initial_state=initial_state,
                 output_final_state=output_final_state, cu_seqlens=cu_seqlens, form=form, chunk_size=chunk_size,
                 state_v_first=state_v_first, options={"qk_l2norm": use_qk_l2norm_in_kernel})
    return _time_major(o, head_first), ht


def _entering_states(fn, states_fn, tensors, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                     state_v_first, out_dtype, h_dtype, **options):
    """fla's return_intermediate_states=True: (o in out_dtype, final state, the state entering
    each chunk [B, NT, H, K, V] in h_dtype, k's in fla), from pyattn's chunk form (states_fn,
    taking the kernel's arrays in order). Only under torch.inference_mode(), as fla allows it: no gradient flows
    through these states."""
    if not torch.is_inference_mode_enabled():
        raise ValueError(f"pyattn.torch.fla.{fn}(): return_intermediate_states is only allowed in inference mode "
                         f"(inside torch.inference_mode()), as in fla")
    dtype = _compute_dtype(*tensors, initial_state)
    h0 = _state_in(initial_state, state_v_first, dtype)
    cu = _cu(cu_seqlens)
    o, ht, h = states_fn(*(x.to(dtype).contiguous().numpy() for x in tensors), scale=scale,
                         initial_state=None if h0 is None else h0.contiguous().numpy(),
                         output_final_state=output_final_state, cu_seqlens=None if cu is None else cu.numpy(),
                         chunk_size=chunk_size, **options)
    ht = None if ht is None else torch.from_numpy(ht)
    return (torch.from_numpy(o).to(out_dtype), _state_out(ht, state_v_first),
            _state_out(torch.from_numpy(h).to(h_dtype), state_v_first))


def chunk_delta_rule(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, scale: Optional[float] = None,
                     initial_state: State = None, output_final_state: bool = False,
                     use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Optional[torch.LongTensor] = None,
                     cu_seqlens_cpu: Optional[torch.LongTensor] = None, *, chunk_size: int = 64,
                     head_first: bool = False) -> Tuple[Tensor, State]:
    """fla.ops.delta_rule.chunk_delta_rule: ``pyattn.torch.delta_rule(form="chunk")``, beta
    ``[B, T, H]``, ``use_qk_l2norm_in_kernel`` as pyattn's ``qk_l2norm`` (``x / sqrt(sum x^2 +
    1e-6)``, fla's). Any float dtype (fla's kernel refuses float32)."""
    return _delta("chunk_delta_rule", q, k, v, None, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, cu_seqlens, "chunk", chunk_size, head_first=head_first)


def fused_recurrent_delta_rule(q: Tensor, k: Tensor, v: Tensor, beta: Optional[Tensor] = None,
                               scale: Optional[float] = None, initial_state: State = None,
                               output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                               cu_seqlens: Optional[torch.LongTensor] = None, *,
                               head_first: bool = False) -> Tuple[Tensor, State]:
    """fla.ops.delta_rule.fused_recurrent_delta_rule: ``pyattn.torch.delta_rule(form="recurrent")``;
    beta None is 1. A beta per value channel ``[B, T, H, V]`` raises NotImplementedError."""
    return _delta("fused_recurrent_delta_rule", q, k, v, None, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, cu_seqlens, "recurrent", 64, head_first=head_first)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float] = None,
                           initial_state: State = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                           allow_neg_eigval: bool = False, state_v_first: bool = False,
                           cu_seqlens: Optional[torch.LongTensor] = None,
                           cu_seqlens_cpu: Optional[torch.LongTensor] = None,
                           chunk_indices: Optional[torch.LongTensor] = None, cp_context=None, *,
                           use_gate_in_kernel: bool = False, A_log: Optional[Tensor] = None,
                           dt_bias: Optional[Tensor] = None, chunk_size: int = 64,
                           head_first: bool = False,
                           transpose_state_layout: Optional[bool] = None) -> Tuple[Tensor, State]:
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule: ``pyattn.torch.gated_delta_rule(form="chunk")``.

    q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` with HV a multiple of H (GVA), g and beta
    ``[B, T, HV]``, states ``[N, HV, K, V]``. ``use_beta_sigmoid_in_kernel`` takes
    ``sigmoid(beta)`` (times 2 with ``allow_neg_eigval``); ``use_gate_in_kernel`` takes
    ``g = -exp(A_log) softplus(g + dt_bias)``, both differentiated. ``cp_context`` (context
    parallelism) raises NotImplementedError."""
    state_v_first = _v_first("chunk_gated_delta_rule", state_v_first, transpose_state_layout)
    if cp_context is not None:
        raise _unsupported("chunk_gated_delta_rule", "cp_context", "pyattn runs on one machine")
    return _delta("chunk_gated_delta_rule", q, k, v, g, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, cu_seqlens, "chunk", chunk_size, state_v_first, head_first,
                  use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)


def fused_recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
                                     gk: Optional[Tensor] = None, gv: Optional[Tensor] = None,
                                     beta: Optional[Tensor] = None, scale: Optional[float] = None,
                                     initial_state: State = None, output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                                     A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                                     use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                                     state_v_first: bool = False, cu_seqlens: Optional[torch.LongTensor] = None, *,
                                     head_first: bool = False,
                                     transpose_state_layout: Optional[bool] = None) -> Tuple[Tensor, State]:
    """fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule:
    ``pyattn.torch.gated_delta_rule(form="recurrent")`` (g None: ``delta_rule``), the arguments
    as ``chunk_gated_delta_rule``; beta None is 1. The key-side vector gate gk ``[B, T, HV, K]``
    (added to g when both are given) makes it ``pyattn.torch.kda``; the value-side gate gv
    raises NotImplementedError. Differentiable (fla's forward-only kernel is not)."""
    state_v_first = _v_first("fused_recurrent_gated_delta_rule", state_v_first, transpose_state_layout)
    if gv is not None:
        raise _unsupported("fused_recurrent_gated_delta_rule", "gv",
                           "pyattn's delta rule decays the state's key side only")
    return _delta("fused_recurrent_gated_delta_rule", q, k, v, g, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, cu_seqlens, "recurrent", 64, state_v_first, head_first,
                  use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, gk=gk)


def _kda_kwargs(fn, kwargs, chunked):
    """fla's KDA and GDN-2 entry points take **kwargs: A_log and dt_bias, chunk_size (the chunk form's),
    the deprecated transpose_state_layout; anything else is refused rather than ignored."""
    found = {"A_log": kwargs.pop("A_log", None), "dt_bias": kwargs.pop("dt_bias", None),
             "chunk_size": kwargs.pop("chunk_size", 64) if chunked else 64,
             "transpose_state_layout": kwargs.pop("transpose_state_layout", None)}
    _refuse_kwargs(fn, kwargs)
    return found


def _check_safe_gate(fn, safe_gate, use_gate_in_kernel, lower_bound) -> None:
    """fla's check of safe_gate with the gate in the kernel: a lower_bound in [-5, 0)."""
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError(f"pyattn.torch.fla.{fn}(): `lower_bound` must be specified when `safe_gate=True` and "
                             f"`use_gate_in_kernel=True`")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"pyattn.torch.fla.{fn}(): `lower_bound` must be in the safe range [-5, 0), got "
                             f"{lower_bound}")


def _check_intermediate(fn, return_intermediate_states, disable_recompute) -> None:
    """fla's rule: the per-chunk states come from the recomputing path only."""
    if return_intermediate_states and disable_recompute:
        raise ValueError(f"pyattn.torch.fla.{fn}(): return_intermediate_states must be used with "
                         f"disable_recompute=False, as in fla")


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float] = None,
              initial_state: State = None, output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
              use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
              allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: Optional[float] = None,
              disable_recompute: bool = False, return_intermediate_states: bool = False,
              state_v_first: bool = False, cu_seqlens: Optional[torch.LongTensor] = None,
              cu_seqlens_cpu: Optional[torch.LongTensor] = None, cp_context=None,
              **kwargs) -> Union[Tuple[Tensor, State], Tuple[Tensor, State, Tensor]]:
    """fla.ops.kda.chunk_kda: ``pyattn.torch.kda(form="chunk")``; q, k ``[B, T, H, K]``, v
    ``[B, T, HV, V]`` (GVA), g ``[B, T, HV, K]`` a log decay per key channel, beta ``[B, T,
    HV]``. ``use_gate_in_kernel`` takes ``g = -exp(A_log) softplus(g + dt_bias)`` (A_log
    ``[HV]`` and dt_bias ``[HV * K]`` as keywords; with ``lower_bound``, ``lower_bound
    sigmoid(exp(A_log) (g + dt_bias))``), ``use_beta_sigmoid_in_kernel`` and
    ``allow_neg_eigval`` as ``chunk_gated_delta_rule``, all differentiated. ``safe_gate``
    checks ``lower_bound`` as fla does (its gate already lies in ``[lower_bound, 0)``);
    ``disable_recompute`` changes no result; ``chunk_size`` (a keyword) 32 or 64, as fla.
    ``return_intermediate_states=True`` (inside ``torch.inference_mode()``, as fla) returns
    ``(o, final_state, h)`` with h ``[B, NT, HV, K, V]`` in k's dtype, the state entering each
    chunk (with cu_seqlens ``[1, every sequence's chunks, HV, K, V]``); ``cp_context`` raises
    NotImplementedError."""
    fn = "chunk_kda"
    extra = _kda_kwargs(fn, kwargs, True)
    if extra["chunk_size"] not in (32, 64):  # fla's own limit for KDA, checked first as fla does
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {extra['chunk_size']}.")
    if cp_context is not None:
        raise _unsupported(fn, "cp_context", "pyattn runs on one machine")
    _check_safe_gate(fn, safe_gate, use_gate_in_kernel, lower_bound)
    _check_intermediate(fn, return_intermediate_states, disable_recompute)
    return _delta(fn, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                  cu_seqlens, "chunk", extra["chunk_size"], _v_first(fn, state_v_first, extra["transpose_state_layout"]),
                  False, use_gate_in_kernel, extra["A_log"], extra["dt_bias"], use_beta_sigmoid_in_kernel,
                  allow_neg_eigval, lower_bound=lower_bound, intermediate=return_intermediate_states)


def fused_recurrent_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor] = None,
                        dt_bias: Optional[Tensor] = None, scale: Optional[float] = None, initial_state: State = None,
                        output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                        use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                        allow_neg_eigval: bool = False, lower_bound: Optional[float] = None,
                        state_v_first: bool = False, cu_seqlens: Optional[torch.LongTensor] = None,
                        **kwargs) -> Tuple[Tensor, State]:
    """fla.ops.kda.fused_recurrent_kda: ``pyattn.torch.kda(form="recurrent")``, the arguments as
    ``chunk_kda`` (A_log and dt_bias positional here, as fla). Differentiable."""
    fn = "fused_recurrent_kda"
    extra = _kda_kwargs(fn, kwargs, False)
    return _delta(fn, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                  cu_seqlens, "recurrent", 64, _v_first(fn, state_v_first, extra["transpose_state_layout"]),
                  False, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                  lower_bound=lower_bound)


chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule


def chunk_gated_delta_product(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Tensor,
                              num_householder: int, scale: Optional[float] = None, initial_state: State = None,
                              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                              cu_seqlens: Optional[torch.LongTensor] = None,
                              cu_seqlens_cpu: Optional[torch.LongTensor] = None) -> Tuple[Tensor, State]:
    """fla.ops.gated_delta_product.chunk_gated_delta_product: ``pyattn.torch.gated_delta_product(
    form="chunk")``; k, v, beta carry ``num_householder`` rows per token, g ``[B, T, H]`` (or
    None) one per token; any float dtype (fla's kernel refuses float32)."""
    _check_cu_batch("chunk_gated_delta_product", q, cu_seqlens)
    out_dtype = q.dtype
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    o, ht = _pt.gated_delta_product(q.to(dtype), k.to(dtype), v.to(dtype), None if g is None else g.to(dtype),
                                    beta.to(dtype), num_householder=num_householder,
                                    qk_l2norm=use_qk_l2norm_in_kernel, scale=scale,
                                    initial_state=_state_in(initial_state, False, dtype),
                                    output_final_state=output_final_state, cu_seqlens=_cu(cu_seqlens))
    return o.to(out_dtype), ht


def _hgrn(fn, x, g, initial_state, output_final_state, cu_seqlens):
    """HGRN's recurrence per channel, ``h_t = exp(g_t) h_{t-1} + x_t``, ``o_t = h_t`` (x, g
    ``[B, T, D]``, the state ``[N, D]``, both returned in x's dtype as fla's): GLA with one key channel (q = k = 1, no key gate,
    scale 1), x its values and g its value-side gate, in the recurrent form (both entry points:
    chunk_hgrn says why). The channels are independent, so they are cut into heads of at least
    64 (a divisor of D) that the threads share."""
    _check_cu_batch(fn, x, cu_seqlens)
    Bx, Tx, D = x.shape
    heads = max(1, D // 64)
    while D % heads:
        heads -= 1
    dtype = _compute_dtype(x, g, initial_state)
    v, gv = (t.to(dtype).reshape(Bx, Tx, heads, D // heads) for t in (x, g))
    one, zero = v.new_ones(Bx, Tx, heads, 1), v.new_zeros(Bx, Tx, heads, 1)
    h0 = None if initial_state is None else initial_state.reshape(-1, heads, 1, D // heads)
    o, ht = _run(_pt.gla, one, one, v, gates=[("g", zero), ("gv", gv)], scale=1.0, initial_state=h0,
                 output_final_state=output_final_state, cu_seqlens=cu_seqlens, form="recurrent", chunk_size=64)
    return o.reshape(Bx, Tx, D).to(x.dtype), None if ht is None else ht.reshape(-1, D).to(x.dtype)


def chunk_hgrn(x: Tensor, g: Tensor, initial_state: State = None,
               output_final_state: bool = False) -> Tuple[Tensor, State]:
    """fla.ops.hgrn.chunk_hgrn: HGRN's gated recurrence per channel, ``h_t = exp(g_t) h_{t-1} +
    x_t``, ``o_t = h_t``; x and g (a log decay) ``[B, T, D]``, state ``[B, D]``. pyattn's
    ``gla`` with one key channel and g as its value gate, in its recurrent form: with a state
    of one row per head a step is a few vector operations, and the chunk form's products gain
    nothing (B4 T2048 D512: 10 ms against 22 ms forward). Differentiable."""
    return _hgrn("chunk_hgrn", x, g, initial_state, output_final_state, None)


def fused_recurrent_hgrn(x: Tensor, g: Tensor, initial_state: State = None, output_final_state: bool = False,
                         cu_seqlens: Optional[torch.LongTensor] = None) -> Tuple[Tensor, State]:
    """fla.ops.hgrn.fused_recurrent_hgrn: ``chunk_hgrn`` with ``cu_seqlens`` (states ``[N,
    D]``). Differentiable."""
    return _hgrn("fused_recurrent_hgrn", x, g, initial_state, output_final_state, cu_seqlens)


# ------------------------------------------------------------------------------------------
# the DPLR delta rule and RWKV-7


def chunk_dplr_delta_rule(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor,
                          scale: Optional[float] = None, initial_state: State = None,
                          output_final_state: bool = False, cu_seqlens: Optional[torch.LongTensor] = None,
                          cu_seqlens_cpu: Optional[torch.LongTensor] = None, safe_gate: bool = False,
                          chunk_size: Optional[int] = None, disable_recompute: bool = False,
                          cp_context=None, lower_bound: Optional[float] = None,
                          **kwargs) -> Tuple[Tensor, State]:
    """fla.ops.generalized_delta_rule.chunk_dplr_delta_rule: ``pyattn.torch.dplr_delta_rule(
    form="chunk")``, a, b, gk ``[B, T, H, K]`` (gk the log decay per key channel); chunk_size
    None is fla's 16 (pyattn takes 16, 32, 64 or 128). ``safe_gate``, ``disable_recompute`` and
    ``cu_seqlens_cpu`` change no result; ``cp_context`` raises NotImplementedError.
    Differentiable."""
    fn = "chunk_dplr_delta_rule"
    _refuse_kwargs(fn, kwargs)
    if lower_bound is not None and lower_bound >= 0:
        raise ValueError(f"pyattn.torch.fla.{fn}(): `lower_bound` must be negative (gk is a log-decay < 0), "
                         f"got {lower_bound}.")
    if cp_context is not None:
        raise _unsupported(fn, "cp_context", "pyattn runs on one machine")
    _check_cu_batch(fn, q, cu_seqlens)
    return _run(_pt.dplr_delta_rule, q, k, v, gates=[("a", a), ("b", b), ("gk", gk)], scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                form="chunk", chunk_size=16 if chunk_size is None else chunk_size)


def chunk_rwkv7(r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, scale: float = 1.0,
                initial_state: State = None, output_final_state: bool = False,
                cu_seqlens: Optional[torch.LongTensor] = None, cu_seqlens_cpu: Optional[torch.LongTensor] = None,
                safe_gate: bool = False, chunk_size: Optional[int] = None, disable_recompute: bool = False,
                cp_context=None, lower_bound: Optional[float] = None, **kwargs) -> Tuple[Tensor, State]:
    """fla.ops.rwkv7.chunk_rwkv7: ``chunk_dplr_delta_rule`` with q = r and gk = w, scale 1 by
    default, as fla defines it."""
    _refuse_kwargs("chunk_rwkv7", kwargs)
    return chunk_dplr_delta_rule(r, k, v, a, b, w, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                 cu_seqlens_cpu=cu_seqlens_cpu, safe_gate=safe_gate, chunk_size=chunk_size,
                                 disable_recompute=disable_recompute, cp_context=cp_context,
                                 lower_bound=lower_bound)


def fused_recurrent_dplr_delta_rule(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor,
                                    scale: Optional[float] = None, initial_state: State = None,
                                    output_final_state: bool = False, reverse: bool = False,
                                    cu_seqlens: Optional[torch.LongTensor] = None) -> Tuple[Tensor, State]:
    """fla.ops.generalized_delta_rule.fused_recurrent_dplr_delta_rule:
    ``pyattn.torch.dplr_delta_rule(form="recurrent")``, a, b, gk ``[B, T, H, K]`` (gk the log
    decay per key channel); ``reverse=True`` runs every sequence backwards. Differentiable."""
    _check_cu_batch("fused_recurrent_dplr_delta_rule", q, cu_seqlens)
    return _run(_pt.dplr_delta_rule, q, k, v, gates=[("a", a), ("b", b), ("gk", gk)], scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                form="recurrent", chunk_size=None, reverse=reverse)


def fused_recurrent_rwkv7(r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                          scale: Optional[float] = None, initial_state: State = None,
                          output_final_state: bool = True,
                          cu_seqlens: Optional[torch.LongTensor] = None) -> Tuple[Tensor, State]:
    """fla.ops.rwkv7.fused_recurrent_rwkv7: ``fused_recurrent_dplr_delta_rule`` with q = r and
    gk = w, as fla defines it (scale None is ``K ** -0.5``; the final state is returned by
    default)."""
    return fused_recurrent_dplr_delta_rule(r, k, v, a, b, w, scale=scale, initial_state=initial_state,
                                           output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def fused_mul_recurrent_rwkv7(r: Tensor, w: Tensor, k: Tensor, v: Tensor, kk: Tensor, a: Tensor,
                              scale: Optional[float] = 1.0, initial_state: State = None,
                              output_final_state: bool = False, reverse: bool = False,
                              cu_seqlens: Optional[torch.LongTensor] = None, **kwargs) -> Tuple[Tensor, State]:
    """fla.ops.rwkv7.fused_mul_recurrent_rwkv7: RWKV-7's recurrence from its layer's own
    tensors, ``S_t = (diag(exp(w_t)) - (kk_t a_t) kk_t^T) S_{t-1} + k_t v_t^T``: that is
    ``fused_recurrent_dplr_delta_rule`` with its a = -kk and b = kk * a (fla's convention;
    scale None is ``K ** -0.5``); o in v's dtype, as fla's. ``reverse=True`` runs every sequence
    backwards. Differentiable (fla's kernel is forward-only)."""
    fn = "fused_mul_recurrent_rwkv7"
    _refuse_kwargs(fn, kwargs)
    _check_cu_batch(fn, r, cu_seqlens)
    # b = kk a in the compute dtype, as fla's kernel forms it: a bfloat16 product would round it
    dtype = _compute_dtype(r, w, k, v, kk, a, initial_state)
    b = kk.to(dtype) * a.to(dtype)
    return _run(_pt.dplr_delta_rule, r, k, v, gates=[("a", -kk), ("b", b), ("gk", w)], scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                form="recurrent", chunk_size=None, reverse=reverse, out_dtype=v.dtype)


def _gdn2(fn, q, k, v, g, b, w, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
          use_gate_in_kernel, lower_bound, state_v_first, cu_seqlens, form, chunk_size, intermediate=False):
    """Gated DeltaNet 2, ``S_t = (I - k_t (b_t k_t)^T) diag(exp(g_t)) S_{t-1} + k_t (w_t v_t)^T``,
    on the DPLR delta rule: its low-rank pair is k and a = -(b k exp(g)) (the erase reads the
    decayed state) and its value w v, formed in torch in the compute dtype and differentiated.
    v, g, b, w may have HV heads, a multiple of q's and k's H (GVA, as fla's recurrent kernel;
    fla's chunk form takes HV = H only). o in q's dtype (chunk) or v's (recurrent), as fla."""
    _check_cu_batch(fn, q, cu_seqlens)
    Bq, Tq, _, K = q.shape
    for name, x, last in (("g", g, K), ("b", b, K), ("w", w, v.shape[-1])):
        if tuple(x.shape) != (Bq, Tq, v.shape[2], last):
            raise ValueError(f"pyattn.torch.fla.{fn}(): {name} must have shape [B, T, HV, "
                             f"{'V' if name == 'w' else 'K'}] = {(Bq, Tq, v.shape[2], last)}, got {tuple(x.shape)}")
    out_dtype = q.dtype if form == "chunk" else v.dtype
    dtype = _compute_dtype(q, k, v, g, b, w, initial_state)
    if use_gate_in_kernel:
        g = _gate_in_kernel(fn, g, A_log, dt_bias, lower_bound, dtype)
    k_dtype = k.dtype
    q, k, v, g, b, w = (x.to(dtype) for x in (q, k, v, g, b, w))
    if use_qk_l2norm_in_kernel:  # fla's in-kernel normalisation, x / sqrt(sum x^2 + 1e-6)
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q, k = _gva(fn, q, k, v.shape[2])
    a, v = -(b * k * torch.exp(g)), w * v
    if intermediate:
        return _entering_states(fn, _dplr_np.dplr_entering_states, (q, k, v, a, k, g), scale, initial_state,
                                output_final_state, cu_seqlens, chunk_size, state_v_first, out_dtype, k_dtype)
    return _run(_pt.dplr_delta_rule, q, k, v, gates=[("a", a), ("b", k), ("gk", g)], scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                form=form, chunk_size=chunk_size, state_v_first=state_v_first, out_dtype=out_dtype)


def chunk_gdn2(q: Tensor, k: Tensor, v: Tensor, g: Tensor, b: Tensor, w: Tensor, scale: Optional[float] = None,
               initial_state: State = None, output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
               use_gate_in_kernel: bool = False, cu_seqlens: Optional[torch.LongTensor] = None,
               cu_seqlens_cpu: Optional[torch.LongTensor] = None, safe_gate: bool = False,
               lower_bound: Optional[float] = None, disable_recompute: bool = False,
               return_intermediate_states: bool = False, state_v_first: bool = False,
               **kwargs) -> Union[Tuple[Tensor, State], Tuple[Tensor, State, Tensor]]:
    """fla.ops.gdn2.chunk_gdn2: Gated DeltaNet 2, ``S_t = (I - k_t (b_t k_t)^T) diag(exp(g_t))
    S_{t-1} + k_t (w_t v_t)^T`` with b ``[B, T, H, K]`` the erase gate per key channel and w
    ``[B, T, H, V]`` the write gate per value channel (b = w = beta is KDA), computed by
    ``pyattn.torch.dplr_delta_rule(form="chunk")``. ``use_gate_in_kernel`` (``A_log``,
    ``dt_bias`` as keywords, ``lower_bound``), ``use_qk_l2norm_in_kernel`` and ``safe_gate``'s
    checks as ``chunk_kda``; ``chunk_size`` (a keyword) must be 64, as fla;
    ``disable_recompute`` and ``cu_seqlens_cpu`` change nothing. ``return_intermediate_states
    =True`` (inside ``torch.inference_mode()``) also returns h ``[B, NT, H, K, V]``, the state
    entering each chunk. Differentiable."""
    fn = "chunk_gdn2"
    extra = _kda_kwargs(fn, kwargs, True)
    if extra["chunk_size"] != 64:  # fla's own limit for GDN-2, checked first as fla does
        raise ValueError(f"`chunk_size` must be 64 for GDN-2, got {extra['chunk_size']}.")
    _check_safe_gate(fn, safe_gate, use_gate_in_kernel, lower_bound)
    _check_intermediate(fn, return_intermediate_states, disable_recompute)
    return _gdn2(fn, q, k, v, g, b, w, extra["A_log"], extra["dt_bias"], scale, initial_state, output_final_state,
                 use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound,
                 _v_first(fn, state_v_first, extra["transpose_state_layout"]), cu_seqlens, "chunk", 64,
                 intermediate=return_intermediate_states)


def fused_recurrent_gdn2(q: Tensor, k: Tensor, v: Tensor, g: Tensor, b: Tensor, w: Tensor,
                         A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                         scale: Optional[float] = None, initial_state: State = None, output_final_state: bool = False,
                         use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                         lower_bound: Optional[float] = None, state_v_first: bool = False,
                         cu_seqlens: Optional[torch.LongTensor] = None, **kwargs) -> Tuple[Tensor, State]:
    """fla.ops.gdn2.fused_recurrent_gdn2: ``chunk_gdn2``'s recurrence step by step
    (``pyattn.torch.dplr_delta_rule(form="recurrent")``), A_log and dt_bias positional as fla;
    v, g, b, w may have HV heads, a multiple of q's and k's H (GVA). Differentiable (fla's
    kernel is forward-only)."""
    fn = "fused_recurrent_gdn2"
    extra = _kda_kwargs(fn, kwargs, False)
    return _gdn2(fn, q, k, v, g, b, w, A_log, dt_bias, scale, initial_state, output_final_state,
                 use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound,
                 _v_first(fn, state_v_first, extra["transpose_state_layout"]), cu_seqlens, "recurrent", 64)


def chunk_log_linear_attn(q: Tensor, k: Tensor, v: Tensor, g: Tensor, level_scales: Tensor,
                          initial_state: State = None, output_final_state: bool = False,
                          cu_seqlens: Optional[torch.LongTensor] = None) -> Tuple[Tensor, State]:
    """fla.ops.log_linear_attn.chunk_log_linear_attn: ``pyattn.torch.log_linear_attention``
    with ``scale=1.0`` (fla applies none). q, k ``[B, T, 1, K]`` as fla takes them (one group
    shared by v's H heads; q and k of H heads are taken as well), v ``[B, T, H, V]``, g
    ``[B, T, H]``, level_scales ``[B, T, H, L]``. The state is pyattn's ``[N, H, L, K, V]``
    tensor (each level's state, the next position at ``[..., 0, 0, 0]``), not fla's
    LogLinearAttentionState; it resumes the sequence exactly. Differentiable."""
    fn = "chunk_log_linear_attn"
    _check_cu_batch(fn, q, cu_seqlens)
    if initial_state is not None and not isinstance(initial_state, Tensor):
        raise _unsupported(fn, "a LogLinearAttentionState initial_state",
                           "pass the [N, H, L, K, V] tensor pyattn returned as the final state")
    H = v.shape[2]
    if q.shape[2] != H or k.shape[2] != H:
        if q.shape[2] != 1 or k.shape[2] != 1:
            raise ValueError(f"pyattn.torch.fla.{fn}(): q and k must have 1 head (fla's group) or v's H={H}, "
                             f"got {q.shape[2]} and {k.shape[2]}")
        q, k = q.expand(-1, -1, H, -1), k.expand(-1, -1, H, -1)
    out_dtype = v.dtype
    dtype = _compute_dtype(q, k, v, g, level_scales, initial_state)
    o, ht = _pt.log_linear_attention(*(x.to(dtype).contiguous() for x in (q, k, v, g, level_scales)), scale=1.0,
                                     initial_state=None if initial_state is None else initial_state.to(dtype),
                                     output_final_state=output_final_state, cu_seqlens=_cu(cu_seqlens))
    return o.to(out_dtype), ht


# ------------------------------------------------------------------------------------------
# softmax attention and the sparse softmax family


def _softmax_prep(q, k, v, head_first, *others):
    """q, k, v time-major in the compute dtype of them and ``others``."""
    q, k, v = (_time_major(x, head_first) for x in (q, k, v))
    dtype = _compute_dtype(q, k, v, *others)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _seq_cumsum(g: Tensor, cu: Optional[Tensor]) -> Tensor:
    """The running sum of g along time, restarting at every sequence."""
    if cu is None:
        return g.cumsum(1)
    return torch.cat([g[:, a:b].cumsum(1) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)


def parallel_attn(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, scale: Optional[float] = None,
                  window_size: Optional[int] = None, cu_seqlens: Optional[torch.LongTensor] = None,
                  chunk_indices: Optional[torch.LongTensor] = None, *, sink_bias: Optional[Tensor] = None,
                  head_first: bool = False) -> Tensor:
    """fla.ops.attn.parallel_attn: causal softmax attention, ``pyattn.torch.softmax_attention``
    (flash form), GQA as fla (q ``[B, T, HQ, K]``, k, v ``[B, T, H, *]``). ``window_size=w``
    keeps keys ``i-w+1 .. i``; ``sink_bias [HQ]`` adds one learned logit per head to every
    softmax denominator (``o * sigmoid(lse - sink_bias)``). ``g [B, T, HQ]`` is FoX's log
    forgetting gate (``<= 0``), scores ``scale q_i.k_j + G_i - G_j`` (G its running sum per
    sequence): ``pyattn.torch.forgetting_attention``, whose kernel keeps G's digits however
    long the sequence. With both ``g`` and ``sink_bias`` the LSE is needed, which
    forgetting_attention does not return: then ``G_i`` (constant along the softmax's row)
    cancels and ``-G_j`` rides in one more key dimension (q's is 1), softmax attention of head
    dimension K + 1, which rounds the bias at the size of G in float32. Returns ``o``."""
    _check_cu_batch("parallel_attn", _time_major(q, head_first), cu_seqlens)
    out_dtype = q.dtype
    g = _time_major(g, head_first)
    q, k, v = _softmax_prep(q, k, v, head_first, g, sink_bias)
    cu = _cu(cu_seqlens)
    if g is not None and sink_bias is None:
        o = _pt.forgetting_attention(q, k, v, g.to(q.dtype), window=window_size, scale=scale, cu_seqlens=cu)
        return _time_major(o, head_first).to(out_dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if g is not None:
        G = _seq_cumsum(g.to(q.dtype), cu)
        k, v = (x.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for x in (k, v))
        q = torch.cat([q * scale, q.new_ones(q.shape[:3] + (1,))], -1)
        k = torch.cat([k, -G.unsqueeze(-1)], -1)
        scale = 1.0
    window = None if window_size is None else (window_size - 1, 0)
    kwargs = dict(causal=True, scale=scale, window=window, cu_seqlens=cu)
    if sink_bias is None:
        o = _pt.softmax_attention(q, k, v, **kwargs)
    else:
        o, lse = _pt.softmax_attention(q, k, v, return_lse=True, **kwargs)
        if g is not None:
            lse = lse + G  # the row term G_i that cancelled inside the softmax
        o = o * torch.sigmoid(lse - sink_bias.to(lse.dtype)).unsqueeze(-1)
    return _time_major(o, head_first).to(out_dtype)


def parallel_forgetting_attn(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: Optional[float] = None,
                             window_size: Optional[int] = None,
                             cu_seqlens: Optional[torch.LongTensor] = None) -> Tensor:
    """fla.ops.forgetting_attn.parallel_forgetting_attn: the Forgetting Transformer's attention,
    ``pyattn.torch.forgetting_attention`` (flash form). q ``[B, T, HQ, K]``, k ``[B, T, H, K]``,
    v ``[B, T, H, V]`` (GQA when HQ is a multiple of H), g ``[B, T, HQ]`` the log forget gate
    (``<= 0``); scores ``scale q_i.k_j + G_i - G_j``, G the running sum of g per sequence;
    ``window_size=w`` keeps keys ``i-w+1 .. i``; ``cu_seqlens`` needs B = 1, as fla. Computed in
    the compute dtype of q, k, v and g (fla takes a float32 g beside bfloat16 q, k, v); returns
    ``o`` in q's dtype."""
    _check_cu_batch("parallel_forgetting_attn", q, cu_seqlens)
    out_dtype = q.dtype
    q, k, v = _softmax_prep(q, k, v, False, g)
    o = _pt.forgetting_attention(q, k, v, g.to(q.dtype), window=window_size, scale=scale, cu_seqlens=_cu(cu_seqlens))
    return o.to(out_dtype)


def parallel_nsa(q: Tensor, k: Tensor, v: Tensor, g_cmp: Optional[Tensor] = None, g_slc: Optional[Tensor] = None,
                 g_swa: Optional[Tensor] = None, block_indices: Optional[torch.LongTensor] = None,
                 block_counts: Union[torch.LongTensor, int] = 16, block_size: int = 64, window_size: int = 0,
                 scale: Optional[float] = None, cu_seqlens=None, *, head_first: bool = False) -> Tensor:
    """fla.ops.nsa.parallel_nsa: ``pyattn.torch.nsa_attention``, ``o = g_cmp o_cmp + g_slc o_slc
    + g_swa o_swa`` (g_slc None: 1; ``window_size=0``: no sliding branch).

    fla always selects the first block and the query's previous block besides its own, pyattn
    its own and the best ones: the two agree when ``block_counts`` covers every block of the
    longest sequence, and a smaller ``block_counts`` raises NotImplementedError, as do
    ``block_indices``, a tensor of ``block_counts``, ``g_cmp=None`` and separate query and key
    ``cu_seqlens``. Returns ``o``."""
    fn = "parallel_nsa"
    if block_indices is not None:
        raise _unsupported(fn, "block_indices", "pyattn chooses the blocks itself")
    if g_cmp is None:
        raise _unsupported(fn, "g_cmp=None", "fla then attends to given block_indices, which pyattn does not take")
    if isinstance(block_counts, Tensor):
        raise _unsupported(fn, "block_counts as a tensor", "pyattn takes one block count for every query")
    if isinstance(cu_seqlens, tuple):
        cu_q, cu_k = cu_seqlens
        if not torch.equal(torch.as_tensor(cu_q), torch.as_tensor(cu_k)):
            raise _unsupported(fn, "cu_seqlens=(cu_seqlens_q, cu_seqlens_k) that differ",
                               "pyattn's NSA packs queries and keys alike")
        cu_seqlens = cu_q
    cu = _cu(cu_seqlens)
    _check_cu_batch(fn, _time_major(q, head_first), cu)
    T = _time_major(k, head_first).shape[1]
    lengths = [T] if cu is None else (cu[1:] - cu[:-1]).tolist()
    blocks = -(-max(lengths, default=0) // block_size)
    if block_counts < blocks:
        raise _unsupported(fn, f"block_counts={block_counts} below the {blocks} blocks of the longest sequence",
                           "fla forces the first and the previous block into the selection where pyattn chooses the "
                           "best ones; the two agree only when every block is selected")
    if window_size > 0 and g_swa is None:
        raise ValueError(f"pyattn.torch.fla.{fn}(): window_size={window_size} needs g_swa")
    out_dtype = q.dtype
    g_cmp, g_slc, g_swa = (_time_major(x, head_first) for x in (g_cmp, g_slc, g_swa))
    q, k, v = _softmax_prep(q, k, v, head_first, g_cmp, g_slc, g_swa)
    g_cmp = g_cmp.to(q.dtype)
    g_slc = g_cmp.new_ones(g_cmp.shape) if g_slc is None else g_slc.to(q.dtype)
    # no sliding branch: a one-key window weighted by exact zeros adds nothing
    g_swa = g_cmp.new_zeros(g_cmp.shape) if window_size <= 0 else g_swa.to(q.dtype)
    o = _pt.nsa_attention(q, k, v, g_cmp, g_slc, g_swa, block_size=block_size, block_count=max(block_counts, 1),
                          window=max(window_size, 1), scale=scale, cu_seqlens=cu)
    return _time_major(o, head_first).to(out_dtype)


def parallel_moba(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Optional[torch.LongTensor], max_seqlen: int,
                  chunk_size: int, topk: int, *, head_first: bool = False) -> Tensor:
    """fla.ops.moba.parallel_moba: ``pyattn.torch.moba_attention`` (causal): each query attends
    its own chunk causally and the ``topk - 1`` past chunks of highest ``q . mean(k_chunk)``;
    ``topk <= 1`` is plain causal attention, as fla. ``max_seqlen`` is unused (pyattn reads
    the lengths from ``cu_seqlens``). Returns ``o``."""
    _check_cu_batch("parallel_moba", _time_major(q, head_first), cu_seqlens)
    out_dtype = q.dtype
    q, k, v = _softmax_prep(q, k, v, head_first)
    cu = _cu(cu_seqlens)
    if topk <= 1:
        o = _pt.softmax_attention(q, k, v, causal=True, cu_seqlens=cu)
    else:
        o = _pt.moba_attention(q, k, v, block_size=chunk_size, top_k=topk, causal=True, cu_seqlens=cu)
    return _time_major(o, head_first).to(out_dtype)

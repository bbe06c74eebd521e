"""pyattn.OPS: one entry per public op, iterated by the tests, the report and benchmarks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class OpInfo:
    """What a test, the report or a benchmark needs to know about an op.

    fn: the public callable. forms: its forms, default first (empty for an op without a
    ``form`` argument, such as attention_with_kvcache). arrays: its array arguments in
    positional order (an argument may be a list of arrays, as merge_attention_states' ``os``,
    or an integer array, as rope's ``positions``); differentiable: the float array arguments,
    positional or keyword (feature_map's ``projection`` reaches its ``**params``), that get a
    gradient from pyattn.vjp when given (linear_attention's performer projection, passed
    inside feature_map_params, also gets one, keyed "projection"); empty for an op that
    pyattn.vjp refuses (dsa_select, dsa_index_target). has_state: whether it takes
    initial_state / output_final_state. chunked: whether it has chunk_size.
    example(rng, dtype, tiny=False) -> (args, kwargs): a valid call exercising the op's options
    (tiny: small enough for finite differences), used by the self-check report. reference:
    the op's float64 oracle, pyattn.reference's function of its name.
    """

    name: str
    fn: Callable
    forms: Tuple[str, ...]
    arrays: Tuple[str, ...]
    differentiable: Tuple[str, ...]
    has_state: bool
    chunked: bool
    example: Callable
    description: str = ""
    options: Dict[str, object] = field(default_factory=dict)

    @property
    def reference(self) -> Callable:
        """The float64 oracle the op is checked against."""
        from . import reference

        return getattr(reference, self.name)

    @property
    def default_form(self) -> Optional[str]:
        return self.forms[0] if self.forms else None

    def form_calls(self) -> Tuple[Tuple[str, Dict[str, str]], ...]:
        """(label, keyword arguments) of a call in each form: ``form=...`` for each form, one
        call without it ("-") for an op that has no forms."""
        return tuple((f, {"form": f}) for f in self.forms) or (("-", {}),)


def _softmax_example(rng: np.random.Generator, dtype=np.float64, tiny=False):
    B, Tq, Tk, H, Hk, Dk, Dv = (1, 5, 7, 2, 1, 3, 2) if tiny else (2, 77, 300, 4, 2, 16, 8)
    q = rng.standard_normal((B, Tq, H, Dk)).astype(dtype)
    k = rng.standard_normal((B, Tk, Hk, Dk)).astype(dtype)
    v = rng.standard_normal((B, Tk, Hk, Dv)).astype(dtype)
    window = (3, 0) if tiny else (200, 0)
    return (q, k, v), dict(causal=True, window=window, sinks=2, softcap=5.0, return_lse=True)


def _forgetting_example(rng: np.random.Generator, dtype=np.float64, tiny=False):
    """GQA, Dk != Dv, a window shorter than the sequence, FoX's gates (logsigmoid, mostly near
    0: long memory)."""
    B, T, H, Hk, Dk, Dv, window = (1, 7, 2, 1, 3, 2, 4) if tiny else (2, 150, 4, 2, 16, 12, 100)
    q = rng.standard_normal((B, T, H, Dk)).astype(dtype)
    k = rng.standard_normal((B, T, Hk, Dk)).astype(dtype)
    v = rng.standard_normal((B, T, Hk, Dv)).astype(dtype)
    g = -np.logaddexp(0.0, -2.0 - rng.standard_normal((B, T, H))).astype(dtype)
    return (q, k, v, g), dict(window=window)


def _qkv(rng, dtype, tiny, K=None):
    B, T, H, Kd, Vd = (1, 7, 2, 3, 2) if tiny else (2, 150, 3, 16, 12)
    K = Kd if K is None else K
    return [rng.standard_normal(s).astype(dtype) for s in ((B, T, H, K), (B, T, H, K), (B, T, H, Vd))]


def _state(rng, dtype, q, v, extra_cols=0):
    B, _, H, K = q.shape
    return rng.standard_normal((B, H, K, v.shape[3] + extra_cols)).astype(dtype)


def _linear_attention_example(rng, dtype=np.float64, tiny=False):
    q, k, v = _qkv(rng, dtype, tiny)
    q, k = np.abs(q), np.abs(k)  # a positive normaliser
    h0 = np.abs(_state(rng, dtype, q, v, extra_cols=1)) * 0.1
    return (q, k, v), dict(feature_map="elu1", normalize=True, initial_state=h0, output_final_state=True)


def _retention_example(rng, dtype=np.float64, tiny=False):
    q, k, v = _qkv(rng, dtype, tiny)
    gamma = rng.uniform(0.6, 0.99, q.shape[2]).astype(dtype)
    return (q, k, v), dict(gamma=gamma, initial_state=_state(rng, dtype, q, v), output_final_state=True)


def _lightning_example(rng, dtype=np.float64, tiny=False):
    q, k, v = _qkv(rng, dtype, tiny)
    slopes = rng.uniform(0.01, 1.0, q.shape[2]).astype(dtype)
    return (q, k, v), dict(slopes=slopes, initial_state=_state(rng, dtype, q, v), output_final_state=True)


def _simple_gla_example(rng, dtype=np.float64, tiny=False):
    q, k, v = _qkv(rng, dtype, tiny)
    g = -rng.uniform(0.0, 1.0, q.shape[:3]).astype(dtype)
    return (q, k, v, g), dict(initial_state=_state(rng, dtype, q, v), output_final_state=True)


def _gla_example(rng, dtype=np.float64, tiny=False):
    q, k, v = _qkv(rng, dtype, tiny)
    g = -rng.uniform(0.0, 1.0, q.shape).astype(dtype)
    gv = -rng.uniform(0.0, 0.5, v.shape).astype(dtype)
    return (q, k, v, g), dict(gv=gv, initial_state=_state(rng, dtype, q, v), output_final_state=True)


def _rwkv6_example(rng, dtype=np.float64, tiny=False):
    r, k, v = _qkv(rng, dtype, tiny)
    w = -rng.uniform(0.0, 1.0, r.shape).astype(dtype)
    u = rng.standard_normal(r.shape[2:]).astype(dtype)
    return (r, k, v, w, u), dict(initial_state=_state(rng, dtype, r, v), output_final_state=True)


def _dplr_arrays(rng, dtype, tiny):
    """q, k, v, a, b, gk of a stable DPLR call: RWKV-7's a = -kappa, b = kappa * lr with kappa a
    unit vector and lr in (0, 1), so every transition is a contraction."""
    q, k, v = _qkv(rng, dtype, tiny)
    kappa = rng.standard_normal(q.shape)
    kappa /= np.linalg.norm(kappa, axis=-1, keepdims=True)
    lr = rng.uniform(0.1, 1.0, q.shape)
    gk = -rng.uniform(0.0, 1.0, q.shape).astype(dtype)
    return q, k, v, (-kappa).astype(dtype), (kappa * lr).astype(dtype), gk


def _dplr_example(rng, dtype=np.float64, tiny=False):
    q, k, v, a, b, gk = _dplr_arrays(rng, dtype, tiny)
    return (q, k, v, a, b, gk), dict(initial_state=_state(rng, dtype, q, v), output_final_state=True)


def _rwkv7_example(rng, dtype=np.float64, tiny=False):
    r, k, v, a, b, w = _dplr_arrays(rng, dtype, tiny)
    return (r, w, k, v, a, b), dict(initial_state=_state(rng, dtype, r, v), output_final_state=True)


def _log_linear_example(rng, dtype=np.float64, tiny=False):
    """A sequence resumed at position 5 from a state of every level, more levels than needed."""
    q, k, v = _qkv(rng, dtype, tiny)
    B, T, H, _ = q.shape
    L = (5 + T).bit_length() + 2
    g = -rng.uniform(0.0, 1.0, (B, T, H)).astype(dtype)
    level_scales = rng.uniform(0.2, 1.0, (B, T, H, L)).astype(dtype)
    h0 = rng.standard_normal((B, H, L) + q.shape[3:] + v.shape[3:]).astype(dtype)
    h0[:, :, 0] = 0
    h0[:, :, 0, 0, 0] = 5
    return (q, k, v, g, level_scales), dict(initial_state=h0, output_final_state=True)


def _mamba2_example(rng, dtype=np.float64, tiny=False):
    Bsz, T, H, G, P, N = (1, 7, 2, 1, 3, 2) if tiny else (2, 150, 4, 2, 12, 16)
    x = rng.standard_normal((Bsz, T, H, P)).astype(dtype)
    dt = rng.standard_normal((Bsz, T, H)).astype(dtype)
    A = -rng.uniform(0.5, 2.0, H).astype(dtype)
    Bm, Cm = (rng.standard_normal((Bsz, T, G, N)).astype(dtype) for _ in range(2))
    D = rng.standard_normal(H).astype(dtype)
    dt_bias = rng.standard_normal(H).astype(dtype)
    h0 = rng.standard_normal((Bsz, H, N, P)).astype(dtype)
    return (x, dt, A, Bm, Cm), dict(D=D, dt_bias=dt_bias, initial_state=h0, output_final_state=True)


def _delta_example(rng, dtype=np.float64, tiny=False, gated=True):
    q, k, v = _qkv(rng, dtype, tiny)
    beta = rng.uniform(0.1, 1.0, q.shape[:3]).astype(dtype)
    kw = dict(qk_l2norm=True, initial_state=_state(rng, dtype, q, v), output_final_state=True)
    if not gated:
        return (q, k, v, beta), kw
    g = -rng.uniform(0.0, 1.0, q.shape[:3]).astype(dtype)
    return (q, k, v, g, beta), kw


def _delta_rule_example(rng, dtype=np.float64, tiny=False):
    return _delta_example(rng, dtype, tiny, gated=False)


def _delta_product_example(rng, dtype=np.float64, tiny=False):
    q, k, v = _qkv(rng, dtype, tiny)
    n = 2
    k, v = (np.repeat(x, n, axis=1) + rng.standard_normal((x.shape[0], x.shape[1] * n) + x.shape[2:]).astype(dtype)
            for x in (k, v))
    beta = rng.uniform(0.1, 1.9, k.shape[:3]).astype(dtype)
    g = -rng.uniform(0.0, 1.0, q.shape[:3]).astype(dtype)
    return (q, k, v, g, beta), dict(num_householder=n, qk_l2norm=True, initial_state=_state(rng, dtype, q, v),
                                    output_final_state=True)


def _kda_example(rng, dtype=np.float64, tiny=False):
    """Two value heads per q/k head (groups) and a decay per key channel."""
    B, T, H, Kd, Vd = (1, 7, 1, 3, 2) if tiny else (2, 150, 2, 16, 12)
    HV = 2 * H
    q, k = (rng.standard_normal((B, T, H, Kd)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((B, T, HV, Vd)).astype(dtype)
    g = -rng.uniform(0.0, 1.0, (B, T, HV, Kd)).astype(dtype)
    beta = rng.uniform(0.1, 1.0, (B, T, HV)).astype(dtype)
    h0 = rng.standard_normal((B, HV, Kd, Vd)).astype(dtype)
    return (q, k, v, g, beta), dict(qk_l2norm=True, initial_state=h0, output_final_state=True)


def _efficient_example(rng, dtype=np.float64, tiny=False):
    B, Tq, Tk, H, K, Vd = (1, 5, 6, 2, 3, 2) if tiny else (2, 120, 150, 3, 16, 12)
    q = rng.standard_normal((B, Tq, H, K)).astype(dtype)
    k = rng.standard_normal((B, Tk, H, K)).astype(dtype)
    v = rng.standard_normal((B, Tk, H, Vd)).astype(dtype)
    return (q, k, v), {}


def _mla_example(rng, dtype=np.float64, tiny=False):
    B, T, Tk, H, Dn, Dr, Dc, Dv = (1, 3, 4, 2, 3, 2, 4, 2) if tiny else (2, 37, 50, 4, 16, 8, 32, 12)
    shapes = ((B, T, H, Dn), (B, T, H, Dr), (B, Tk, Dc), (B, Tk, Dr), (Dc, H, Dn), (Dc, H, Dv))
    # weights scaled as a trained model's (std Dc ** -0.5), so scores stay O(1)
    q_nope, q_rope, c_kv, k_rope, w_uk, w_uv = (rng.standard_normal(s) for s in shapes)
    w_uk, w_uv = w_uk * Dc ** -0.5, w_uv * Dc ** -0.5
    return tuple(x.astype(dtype) for x in (q_nope, q_rope, c_kv, k_rope, w_uk, w_uv)), dict(causal=True)


def _kvcache_example(rng, dtype=np.float64, tiny=False):
    """New queries and keys into a paged cache (shuffled blocks, spare ones), GQA, window,
    sinks and softcap: cache_seqlens, the new k, v and block_table are keyword arguments."""
    B, Tq, H, Hk, D, Dv, bs, nblk, lens = ((1, 1, 2, 1, 3, 2, 2, 3, (3,)) if tiny else
                                           (2, 3, 4, 2, 16, 8, 8, 4, (20, 7)))
    q = rng.standard_normal((B, Tq, H, D)).astype(dtype)
    k_cache = rng.standard_normal((B * nblk + 1, bs, Hk, D)).astype(dtype)
    v_cache = rng.standard_normal((B * nblk + 1, bs, Hk, Dv)).astype(dtype)
    k = rng.standard_normal((B, Tq, Hk, D)).astype(dtype)
    v = rng.standard_normal((B, Tq, Hk, Dv)).astype(dtype)
    table = rng.permutation(B * nblk + 1)[:B * nblk].reshape(B, nblk).astype(np.int32)
    return (q, k_cache, v_cache), dict(cache_seqlens=np.array(lens), k=k, v=v, block_table=table,
                                       window=(9, 0), sinks=1, softcap=4.0, return_lse=True)


def _moba_example(rng, dtype=np.float64, tiny=False):
    B, T, H, Hk, D, Dv, bs, top_k = (1, 9, 2, 1, 3, 2, 3, 2) if tiny else (2, 150, 4, 2, 16, 12, 16, 3)
    q = rng.standard_normal((B, T, H, D)).astype(dtype)
    k = rng.standard_normal((B, T, Hk, D)).astype(dtype)
    v = rng.standard_normal((B, T, Hk, Dv)).astype(dtype)
    return (q, k, v), dict(block_size=bs, top_k=top_k, causal=True)


def _linformer_example(rng, dtype=np.float64, tiny=False):
    B, Tq, T, S, H, Hk, D, Dv = (1, 3, 5, 2, 2, 1, 3, 2) if tiny else (2, 60, 150, 32, 4, 2, 16, 12)
    q = rng.standard_normal((B, Tq, H, D)).astype(dtype)
    k = rng.standard_normal((B, T, Hk, D)).astype(dtype)
    v = rng.standard_normal((B, T, Hk, Dv)).astype(dtype)
    E, F = (rng.standard_normal((S, T)).astype(dtype) * T ** -0.5 for _ in range(2))
    return (q, k, v, E, F), {}


def _nsa_example(rng, dtype=np.float64, tiny=False):
    """GQA, T not a multiple of the block size, a window shorter than the sequence, learned
    compressed keys and values (one row per block)."""
    B, T, H, Hk, D, Dv, bs, count, window = ((1, 9, 2, 1, 3, 2, 2, 3, 3) if tiny else
                                             (2, 150, 4, 2, 16, 12, 16, 4, 40))
    q = rng.standard_normal((B, T, H, D)).astype(dtype)
    k = rng.standard_normal((B, T, Hk, D)).astype(dtype)
    v = rng.standard_normal((B, T, Hk, Dv)).astype(dtype)
    gates = [rng.uniform(0, 1, (B, T, H)).astype(dtype) for _ in range(3)]
    blocks = -(-T // bs)
    k_cmp = rng.standard_normal((B, blocks, Hk, D)).astype(dtype)
    v_cmp = rng.standard_normal((B, blocks, Hk, Dv)).astype(dtype)
    return (q, k, v, *gates), dict(block_size=bs, block_count=count, window=window, k_cmp=k_cmp, v_cmp=v_cmp)


def _index_arrays(rng, dtype, B, Tq, Tk, Hi, Di):
    return (rng.standard_normal((B, Tq, Hi, Di)).astype(dtype), rng.standard_normal((B, Tk, Di)).astype(dtype),
            rng.standard_normal((B, Tq, Hi)).astype(dtype))


def _dsa_example(rng, dtype=np.float64, tiny=False):
    """MQA (DeepSeek's indexer shares one choice across the heads), causal."""
    B, T, H, Hk, D, Dv, Hi, Di, top_k = (1, 7, 2, 1, 3, 2, 2, 2, 3) if tiny else (2, 150, 4, 1, 16, 12, 4, 8, 32)
    q = rng.standard_normal((B, T, H, D)).astype(dtype)
    k = rng.standard_normal((B, T, Hk, D)).astype(dtype)
    v = rng.standard_normal((B, T, Hk, Dv)).astype(dtype)
    return (q, k, v, *_index_arrays(rng, dtype, B, T, T, Hi, Di)), dict(top_k=top_k, causal=True)


def _dsa_index_example(rng, dtype=np.float64, tiny=False):
    B, Tq, Tk, Hi, Di = (1, 3, 4, 2, 2) if tiny else (2, 60, 150, 4, 16)
    return _index_arrays(rng, dtype, B, Tq, Tk, Hi, Di), {}


def _dsa_select_example(rng, dtype=np.float64, tiny=False):
    """Packed sequences (one shorter than top_k), causal. The index arrays are multiples of
    1/8, so every score is exact in float32 too and the keys chosen (ties to the lower key
    included) must equal the oracle's in either dtype."""
    T, Hi, Di, top_k, cu = (7, 2, 2, 2, (0, 3, 7)) if tiny else (150, 4, 8, 32, (0, 20, 21, 150))
    index = [np.round(x * 8) / 8 for x in _index_arrays(rng, np.float64, 1, T, T, Hi, Di)]
    return tuple(x.astype(dtype) for x in index), dict(top_k=top_k, causal=True, cu_seqlens=np.array(cu))


def _dsa_index_target_example(rng, dtype=np.float64, tiny=False):
    """GQA, a scale, and the sparse stage: the keys listed by dsa_select (-1 padded)."""
    from .sparse import dsa_select

    B, T, H, Hk, D, Hi, Di, top_k = (1, 5, 2, 1, 3, 2, 2, 2) if tiny else (2, 60, 4, 2, 16, 4, 8, 16)
    q = rng.standard_normal((B, T, H, D)).astype(dtype)
    k = rng.standard_normal((B, T, Hk, D)).astype(dtype)
    indices = dsa_select(*_index_arrays(rng, np.float64, B, T, T, Hi, Di), top_k=top_k)
    return (q, k), dict(causal=True, scale=0.3, indices=indices)


def _rope_example(rng, dtype=np.float64, tiny=False):
    """Positions [B, T] (each sequence at its own offset, up to ~1e5, where float32 angles would
    lose the phase) and Llama 3's theta."""
    B, T, H, D = (2, 3, 1, 4) if tiny else (2, 150, 4, 16)
    x = rng.standard_normal((B, T, H, D)).astype(dtype)
    positions = rng.integers(0, 100_000, (B, 1)) + np.arange(T)
    return (x, positions), dict(theta=500000.0)


def _feature_map_example(rng, dtype=np.float64, tiny=False):
    """Performer (FAVOR+): x scaled by D ** -0.25 as q and k are, a projection W [m, D]."""
    B, T, H, D, m = (1, 2, 2, 3, 4) if tiny else (2, 150, 3, 16, 24)
    x = rng.standard_normal((B, T, H, D)) * D ** -0.25
    projection = rng.standard_normal((m, D))
    return (x.astype(dtype),), dict(kind="performer", projection=projection.astype(dtype))


def _merge_example(rng, dtype=np.float64, tiny=False):
    """Parts with rows one part does not see (lse -inf), and a row no part sees."""
    P, B, Tq, H, Dv = (2, 1, 2, 2, 2) if tiny else (3, 2, 77, 4, 8)
    os = [rng.standard_normal((B, Tq, H, Dv)).astype(dtype) for _ in range(P)]
    lses = [(2 * rng.standard_normal((B, Tq, H))).astype(dtype) for _ in range(P)]
    lses[0][0, 0, 0] = -np.inf
    for part in lses:
        part[-1, -1, -1] = -np.inf
    return (os, lses), {}


def _op(fn: Callable, example: Callable, description: str, arrays: Tuple[str, ...],
        differentiable: Tuple[str, ...], forms: Tuple[str, ...] = ()) -> OpInfo:
    """An op without state or chunk size."""
    return OpInfo(name=fn.__name__, fn=fn, forms=forms, arrays=arrays, differentiable=differentiable,
                  has_state=False, chunked=False, example=example, description=description)


def _state_op(fn: Callable, forms: Tuple[str, ...], arrays: Tuple[str, ...],
              differentiable: Optional[Tuple[str, ...]], example: Callable, description: str) -> OpInfo:
    """An op with a recurrent state and a chunk size: differentiable in initial_state and in
    ``differentiable`` (default: its arrays)."""
    return OpInfo(name=fn.__name__, fn=fn, forms=forms, arrays=arrays,
                  differentiable=(differentiable or arrays) + ("initial_state",), has_state=True,
                  chunked=True, example=example, description=description)


def _attention_op(fn: Callable, example: Callable, description: str, arrays: Tuple[str, ...],
                  differentiable: Tuple[str, ...] = (), forms: Tuple[str, ...] = ()) -> OpInfo:
    """An op of the softmax family: no state, no chunk size; differentiable in its arrays and
    the keyword arrays named in ``differentiable``."""
    return _op(fn, example, description, arrays, arrays + differentiable, forms)


def build_ops() -> Dict[str, OpInfo]:
    from .softmax import (FORMS as SOFTMAX_FORMS, attention_with_kvcache, forgetting_attention,
                          merge_attention_states, softmax_attention)
    from . import delta, delta_product, dplr, linear, log_linear, rwkv
    from .feature_maps import feature_map
    from .mla import FORMS as MLA_FORMS, mla_attention
    from .rope import rope
    from .sparse import (dsa_attention, dsa_index_scores, dsa_index_target, dsa_select, linformer_attention,
                         moba_attention, nsa_attention)

    # the stateful ops: (fn, forms, arrays, differentiable or None for arrays, example, description)
    stateful: List[Tuple[Callable[..., Any], Tuple[str, ...], Tuple[str, ...], Optional[Tuple[str, ...]],
                         Callable[..., Any], str]] = [
        (linear.linear_attention, linear.FORMS, ("q", "k", "v"), ("q", "k", "v"),
         _linear_attention_example, "linear attention with feature maps, optionally normalised"),
        (linear.retention, linear.FORMS, ("q", "k", "v"), ("q", "k", "v", "gamma"),
         _retention_example, "RetNet retention: a constant decay per head"),
        (linear.lightning_attention, linear.FORMS, ("q", "k", "v"), ("q", "k", "v", "slopes"),
         _lightning_example, "Lightning attention: decay exp(-slope) per head"),
        (linear.simple_gla, linear.FORMS, ("q", "k", "v", "g"), None,
         _simple_gla_example, "scalar-gated linear attention"),
        (linear.gla, linear.FORMS, ("q", "k", "v", "g"), ("q", "k", "v", "g", "gv"),
         _gla_example, "gated linear attention: vector key gate, optional value gate"),
        (linear.mamba2, linear.FORMS, ("x", "dt", "A", "B", "C"),
         ("x", "dt", "A", "B", "C", "D", "dt_bias"),
         _mamba2_example, "Mamba-2 SSD: groups, D skip, dt_bias, softplus"),
        (rwkv.rwkv6, linear.FORMS, ("r", "k", "v", "w", "u"), None, _rwkv6_example,
         "RWKV-6: a vector decay and the bonus u of each token's own write, on the gated "
         "linear engine"),
        (delta.delta_rule, delta.FORMS, ("q", "k", "v", "beta"), None, _delta_rule_example,
         "DeltaNet: the delta rule, WY/UT chunk form"),
        (delta.gated_delta_rule, delta.FORMS, ("q", "k", "v", "g", "beta"), None, _delta_example,
         "Gated DeltaNet: the delta rule with a scalar decay per step"),
        (delta.kda, delta.FORMS, ("q", "k", "v", "g", "beta"), None, _kda_example,
         "Kimi Delta Attention: the delta rule with a decay per key channel, grouped value heads"),
        (delta_product.gated_delta_product, delta.FORMS, ("q", "k", "v", "g", "beta"), None,
         _delta_product_example, "Gated DeltaProduct: num_householder delta-rule steps per token "
         "after one decay, on the delta-rule engine"),
        (dplr.dplr_delta_rule, dplr.FORMS, ("q", "k", "v", "a", "b", "gk"), None, _dplr_example,
         "the diagonal-plus-low-rank delta rule: a vector decay and a rank-one update"),
        (dplr.rwkv7, dplr.FORMS, ("r", "w", "k", "v", "a", "b"), None, _rwkv7_example,
         "RWKV-7: the DPLR delta rule with the receptance r and the decay w"),
        (log_linear.log_linear_attention, log_linear.FORMS, ("q", "k", "v", "g", "level_scales"), None,
         _log_linear_example, "log-linear attention (log-linear Mamba-2): a Fenwick tree of states, "
         "each level weighted per query"),
    ]
    return {
        "softmax_attention": _attention_op(
            softmax_attention, _softmax_example,
            "softmax attention: causal/window/sinks/ALiBi/softcap, GQA, varlen",
            arrays=("q", "k", "v"), forms=("flash",) + tuple(f for f in SOFTMAX_FORMS if f != "flash")),
        "forgetting_attention": _attention_op(
            forgetting_attention, _forgetting_example,
            "Forgetting Transformer (FoX): causal softmax attention, scores plus G_i - G_j of a "
            "per-head forget gate; GQA, window, varlen",
            arrays=("q", "k", "v", "g"), forms=("flash", "parallel")),
        "attention_with_kvcache": _attention_op(
            attention_with_kvcache, _kvcache_example,
            "decode over a KV cache (contiguous or paged), new keys written in place, "
            "flash-decoding splits",
            arrays=("q", "k_cache", "v_cache"), differentiable=("k", "v")),
        "moba_attention": _attention_op(
            moba_attention, _moba_example,
            "MoBA: each query's own key block and its top_k - 1 best past blocks "
            "(by q . mean(k_block)), over MoBA's block kernel",
            arrays=("q", "k", "v")),
        "nsa_attention": _attention_op(
            nsa_attention, _nsa_example,
            "NSA: gated compressed (block means), selected (top blocks per GQA group) "
            "and sliding-window branches",
            arrays=("q", "k", "v", "g_cmp", "g_slc", "g_swa"), differentiable=("k_cmp", "v_cmp")),
        "dsa_attention": _attention_op(
            dsa_attention, _dsa_example,
            "DeepSeek sparse attention: each query's top_k keys by the lightning "
            "indexer, shared by its heads (index gradients 0: the choice)",
            arrays=("q", "k", "v", "index_q", "index_k", "index_w")),
        "dsa_index_scores": _attention_op(
            dsa_index_scores, _dsa_index_example,
            "DSA's lightning indexer scores sum_j w_tj relu(q_tj . k_s), [B, Tq, Tk]",
            arrays=("index_q", "index_k", "index_w")),
        "linformer_attention": _attention_op(
            linformer_attention, _linformer_example,
            "Linformer: softmax attention over keys and values projected along time "
            "by E and F [S, T]",
            arrays=("q", "k", "v", "E", "F")),
        "mla_attention": _attention_op(
            mla_attention, _mla_example,
            "multi-head latent attention (MLA): naive (decompressed K/V) or absorbed "
            "(MQA over the latent cache)",
            arrays=("q_nope", "q_rope", "c_kv", "k_rope", "w_uk", "w_uv"), forms=MLA_FORMS),
        "merge_attention_states": _op(
            merge_attention_states, _merge_example,
            "merges partial softmax attentions over disjoint key sets by their LSEs "
            "(flash decoding, ring attention); gradients as lists, one entry per part",
            arrays=("os", "lses"), differentiable=("os", "lses")),
        "dsa_select": _op(
            dsa_select, _dsa_select_example,
            "DSA's choice: each query's top_k visible keys by the indexer scores, int64 rows "
            "(not differentiable)",
            arrays=("index_q", "index_k", "index_w"), differentiable=()),
        "dsa_index_target": _op(
            dsa_index_target, _dsa_index_target_example,
            "DSA's indexer distillation target: the attention probabilities averaged over the "
            "heads (a target: not differentiable)",
            arrays=("q", "k"), differentiable=()),
        "rope": _op(
            rope, _rope_example, "rotary position embedding, half-split pairs, integer positions",
            arrays=("x", "positions"), differentiable=("x",)),
        "feature_map": _op(
            feature_map, _feature_map_example,
            "the feature maps of linear attention alone (identity, elu1, relu, softmax, focused, "
            "taylor, performer, cosformer)",
            arrays=("x",), differentiable=("x", "projection")),
        **{spec[0].__name__: _state_op(*spec) for spec in stateful},
        "efficient_attention": OpInfo(
            name="efficient_attention",
            fn=linear.efficient_attention,
            forms=("parallel",),
            arrays=("q", "k", "v"),
            differentiable=("q", "k", "v"),
            has_state=False,
            chunked=False,
            example=_efficient_example,
            description="efficient attention: softmax over features (q) and time (k), non-causal",
        ),
    }

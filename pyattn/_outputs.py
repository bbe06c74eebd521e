"""Each op's outputs as the framework bridges (pyattn.torch, pyattn.jax) must know them without
computing: their names, which of them a call returns, pyattn's return structure, and their
shapes from the inputs' shapes.

A shape rule only has to be right for a valid call and must not raise for an invalid one (a
missing argument or axis reads as 0): pyattn's own checks then report the call when it runs.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

# ops returning (o, final_state or None)
STATE_OPS = frozenset({"linear_attention", "retention", "lightning_attention", "simple_gla", "gla", "mamba2",
                       "delta_rule", "gated_delta_rule", "rwkv6",
                       "gated_delta_product", "dplr_delta_rule", "rwkv7", "kda",
                       "log_linear_attention"})
# ops returning o, then each further output its flag asks for (a tuple only when one does)
FLAGGED = {"softmax_attention": (("lse", "return_lse"),),
           "attention_with_kvcache": (("lse", "return_lse"), ("colsum", "return_colsum"))}
# ops whose output is an index array (int64), not of the call's float dtype
INDEX_OUTPUTS = frozenset({"dsa_select"})

Shape = Tuple[int, ...]


def names(op: str) -> Tuple[str, ...]:
    """Every output op can give, in order."""
    if op in STATE_OPS:
        return ("o", "final_state")
    if op == "merge_attention_states":
        return ("o", "lse")
    return ("o",) + tuple(out for out, _ in FLAGGED.get(op, ()))


def returned(op: str, option: Callable[[str], Any]) -> Tuple[bool, ...]:
    """Which of names(op) a call with these options returns."""
    if op in STATE_OPS:
        return (True, bool(option("output_final_state")))
    if op in FLAGGED:
        return (True,) + tuple(bool(option(flag)) for _, flag in FLAGGED[op])
    return (True,) * len(names(op))


def structure(op: str, entries: Sequence[Any], option: Callable[[str], Any]):
    """pyattn's return value from one entry per names(op) (those not returned are left out,
    or None for a state op's final state)."""
    mask = returned(op, option)
    if op in STATE_OPS:
        return entries[0], (entries[1] if mask[1] else None)
    if op == "merge_attention_states":
        return entries[0], entries[1]
    picked = [e for e, keep in zip(entries, mask) if keep]
    return picked[0] if len(picked) == 1 else tuple(picked)


def entries(op: str, out, option: Callable[[str], Any]) -> List[Optional[Any]]:
    """The inverse of structure: pyattn's return value as one entry per names(op), None for
    those the call does not return."""
    parts = list(out) if isinstance(out, tuple) else [out]
    mask = returned(op, option)
    if op in STATE_OPS or op == "merge_attention_states":
        return [parts[0], parts[1] if mask[1] else None]
    it = iter(parts)
    return [next(it) if keep else None for keep in mask]


def _axis(shape: Shape, axis: int) -> int:
    return shape[axis] if -len(shape) <= axis < len(shape) else 0


def feature_dim(kind: Optional[str], D: int, m: int) -> int:
    """F of pyattn.feature_map's kinds for D input features (m: performer's projection rows)."""
    return {"taylor": 1 + D + D * D, "performer": m, "cosformer": 2 * D}.get(kind or "identity", D)


def shapes(op: str, shape: Callable[[str], Shape], option: Callable[[str], Any]) -> List[Shape]:
    """The shape of each of names(op) for a call whose array arguments have these shapes
    (``shape(name)``: () when not given; a list argument's first entry; ``cu_seqlens`` [N+1]
    however it is given) and these other arguments (``option(name)``)."""
    q, v = shape("q") or shape("r"), shape("v")  # RWKV's query is r
    if op == "merge_attention_states":
        return [shape("os"), shape("lses")]
    if op in STATE_OPS:
        if op == "mamba2":
            x = shape("x")
            o, B, H, K, V = x, _axis(x, 0), _axis(x, 2), _axis(shape("B"), 3), _axis(x, 3)
        else:
            # o has q's rows (gated_delta_product's v has num_householder rows per token) and
            # v's heads, as the state (kda's q and k may have fewer)
            o, B, H, K, V = q[:2] + v[2:4], _axis(q, 0), _axis(v, 2), _axis(q, 3), _axis(v, 3)
            if op == "linear_attention":
                K = feature_dim(option("feature_map"), K, _axis(shape("projection"), 0))
                V += bool(option("normalize"))
        cu = shape("cu_seqlens")
        N = max(_axis(cu, 0) - 1, 0) if cu else B
        if op == "log_linear_attention":  # one K x V state per level
            return [o, (N, H, _axis(shape("level_scales"), 3), K, V)]
        return [o, (N, H, K, V)]
    if op == "mla_attention":
        return [shape("q_nope")[:3] + shape("w_uv")[2:3]]
    if op in ("dsa_index_scores", "dsa_select"):
        Tk = _axis(shape("index_k"), 1)
        width = Tk if op == "dsa_index_scores" else min(option("top_k"), Tk)
        return [shape("index_q")[:2] + (width,)]
    if op == "dsa_index_target":
        return [q[:2] + shape("k")[1:2]]
    if op == "rope":
        return [shape("x")]
    if op == "feature_map":
        x = shape("x")
        return [x[:-1] + (feature_dim(option("kind"), _axis(x, -1), _axis(shape("projection"), 0)),)]
    if op == "attention_with_kvcache":
        table = shape("block_table")
        capacity = _axis(shape("k_cache"), 1) * (_axis(table, 1) if table else 1)
        return [q[:3] + shape("v_cache")[3:4], q[:3], (_axis(q, 0), _axis(q, 2), capacity)]
    return [q[:3] + v[3:4]] + ([q[:3]] if op in FLAGGED else [])
